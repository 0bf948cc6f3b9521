"""Staleness inventory (Reserve / Occupy / Consume with bound η): unit tests of each rule, a model-based
state machine checking the placement rules against a restatement of the spec, and discrete-event
simulations of asynchronous rollouts against a trainer."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from refbus.nodes.ps.staleness import (
    AbortResult,
    BufferState,
    DoubleOccupyError,
    InvalidArgumentError,
    InventoryClosedError,
    InventoryMisuseError,
    NoRoomError,
    OutOfOrderError,
    PromptReusedError,
    ReadyBatch,
    ReservationAbortedError,
    ReservationConflictError,
    ReservationEndedError,
    ReserveRefused,
    StalenessError,
    StalenessInventory,
    UnknownReservationError,
    VersionAbortedError,
    VersionMismatchError,
)

Traj = tuple[str, int]


def make(eta: int, batch_size: int, start_version: int = 0) -> StalenessInventory[Traj]:
    return StalenessInventory[Traj](eta, batch_size, start_version=start_version)


def fill(inv: StalenessInventory[Traj], prefix: str, n: int, version: int) -> list[int]:
    """Reserve and occupy ``n`` single-trajectory prompts at ``version``; returns where each landed."""
    landed = []
    for i in range(n):
        pid = f"{prefix}{i}"
        inv.reserve(pid, version)
        landed.append(inv.occupy(pid, (pid, 0), version).version)
    return landed


def states(inv: StalenessInventory[Traj]) -> dict[int, BufferState]:
    return {b.version: b.state for b in inv.buffers()}


# ------------------------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("eta", "batch_size", "start"),
    [(-1, 4, 0), (0, 0, 0), (1, -3, 0), (1, 2, -1), (True, 2, 0), (1.5, 2, 0), (1, 2.0, 0)],
)
def test_bad_construction_is_refused(eta: object, batch_size: object, start: object) -> None:
    with pytest.raises(InvalidArgumentError) as excinfo:
        StalenessInventory(eta, batch_size, start_version=start)  # type: ignore[arg-type]
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, StalenessError)


def test_negative_eta_message_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"eta must be >= 0, got -2"):
        make(-2, 4)


def test_initial_state() -> None:
    inv = make(2, 4, start_version=10)
    assert inv.trainer_version == 10
    assert inv.highest_aborted == 10 - 2 - 1
    assert inv.buffers() == []
    assert inv.consume() is None
    s = inv.stats()
    assert (s.eta, s.batch_size, s.live_prompts, s.reserved_total) == (2, 4, 0, 0)


# ----------------------------------------------------------------------------------------- reserve


def test_reserve_takes_highest_buffer_in_range_with_room() -> None:
    inv = make(2, 2)
    assert [inv.reserve(f"p{i}", 0) for i in range(6)] == [2, 2, 1, 1, 0, 0]
    with pytest.raises(NoRoomError) as excinfo:
        inv.reserve("p6", 0)
    err = excinfo.value
    assert (err.prompt_id, err.policy_version, err.trainer_version) == ("p6", 0, 0)
    assert "'p6'" in str(err)
    assert "[0, 2]" in str(err)


def test_reserve_never_goes_below_trainer_version() -> None:
    inv = make(2, 1)
    fill(inv, "a", 1, 0)
    assert inv.consume() is not None
    # V = 0, η = 2: range [0, 2] clipped to [T=1, 2].
    assert inv.reserve("x", 0) == 2
    assert inv.reserve("y", 0) == 1
    with pytest.raises(NoRoomError):
        inv.reserve("z", 0)


def test_reserve_is_idempotent_per_prompt() -> None:
    inv = make(1, 4)
    first = inv.reserve("g", 0, count=2)
    assert inv.reserve("g", 0, count=2) == first
    assert inv.stats().reserved_total == 2
    assert inv.reservation("g") is not None
    assert inv.reservation("g").reserved == 2  # type: ignore[union-attr]


def test_repeat_reserve_with_other_version_or_count_conflicts() -> None:
    inv = make(1, 4)
    fill(inv, "a", 4, 0)
    inv.consume()
    inv.reserve("g", 1, count=2)
    with pytest.raises(ReservationConflictError, match=r"'g'.*version 1.*version 0"):
        inv.reserve("g", 0, count=2)
    with pytest.raises(ReservationConflictError, match="'g'"):
        inv.reserve("g", 1, count=3)


def test_group_reserves_count_slots_in_one_buffer() -> None:
    inv = make(1, 3)
    assert inv.reserve("g1", 0, count=2) == 1
    # Buffer 1 has one free slot left: a second group of 2 must go to buffer 0.
    assert inv.reserve("g2", 0, count=2) == 0
    assert inv.reserve("s", 0, count=1) == 1
    assert {b.version: (b.reserved, b.free) for b in inv.buffers()} == {0: (2, 1), 1: (3, 0)}


@pytest.mark.parametrize("count", [0, -1, 5])
def test_count_out_of_range_is_refused(count: int) -> None:
    inv = make(1, 4)
    with pytest.raises(InvalidArgumentError, match="count"):
        inv.reserve("g", 0, count=count)


def test_reserve_from_the_future_is_a_protocol_error() -> None:
    inv = make(3, 2)
    with pytest.raises(VersionMismatchError, match=r"'p'.*policy version 1.*trainer version 0"):
        inv.reserve("p", 1)
    assert inv.stats().reserved_total == 0


def test_stale_policy_version_is_refused_as_aborted() -> None:
    inv = make(1, 1)
    for _ in range(3):
        t = inv.trainer_version
        fill(inv, f"v{t}-", 1, t)
        assert inv.consume() is not None
    assert inv.trainer_version == 3
    # V = 1: range [1, 2] is already consumed.
    with pytest.raises(VersionAbortedError) as excinfo:
        inv.reserve("late", 1)
    assert excinfo.value.highest_aborted >= 1
    assert "'late'" in str(excinfo.value)
    assert "policy version 1" in str(excinfo.value)
    assert inv.stats().refused_aborted_total == 1


def test_refusals_are_not_protocol_errors() -> None:
    # A dispatcher catches ReserveRefused as normal flow control; it must not be a ValueError.
    assert not issubclass(ReserveRefused, ValueError)
    assert issubclass(NoRoomError, ReserveRefused)
    assert issubclass(VersionAbortedError, ReserveRefused)
    assert issubclass(UnknownReservationError, InventoryMisuseError)
    assert issubclass(DoubleOccupyError, ReservationEndedError)


# ------------------------------------------------------------------------------------------ occupy


def test_occupy_moves_to_lowest_buffer_with_room() -> None:
    inv = make(2, 2)
    assert inv.reserve("p", 0) == 2
    placement = inv.occupy("p", ("p", 0), 0)
    assert placement.version == 0
    assert placement.staleness == 0
    assert not placement.ready
    assert {b.version: (b.occupied, b.reserved) for b in inv.buffers()} == {0: (1, 0)}


def test_occupy_skips_buffers_taken_by_reservations() -> None:
    inv = make(1, 1)
    assert inv.reserve("a", 0) == 1
    assert inv.reserve("b", 0) == 0
    # Buffer 0 is held by b's reservation, so a lands in its own buffer 1.
    assert inv.occupy("a", ("a", 0), 0).version == 1
    assert states(inv) == {0: BufferState.STUCK, 1: BufferState.READY}
    assert inv.consume() is None  # buffer 1 is READY but 0 is not: strict order
    placement = inv.occupy("b", ("b", 0), 0)
    assert placement.version == 0
    assert placement.ready
    assert [inv.consume().version, inv.consume().version] == [0, 1]  # type: ignore[union-attr]


def test_buffer_states_open_stuck_ready() -> None:
    inv = make(0, 2)
    inv.reserve("a", 0)
    assert states(inv) == {0: BufferState.OPEN}
    inv.reserve("b", 0)
    assert states(inv) == {0: BufferState.STUCK}
    inv.occupy("a", ("a", 0), 0)
    assert states(inv) == {0: BufferState.STUCK}
    assert inv.stats().stuck_buffers == 1
    inv.occupy("b", ("b", 0), 0)
    assert states(inv) == {0: BufferState.READY}
    assert inv.stats().ready_buffers == 1


def test_group_never_split_across_batches() -> None:
    inv = make(1, 3)
    assert inv.reserve("s", 0) == 1
    assert inv.reserve("g", 0, count=2) == 1
    assert inv.reserve("t", 0) == 0
    inv.occupy("t", ("t", 0), 0)  # buffer 0: 1 occupied, 2 free
    inv.reserve("u", 0)  # highest with room: buffer 0 (buffer 1 full)
    # Buffer 0 now has exactly one free slot; the group of 2 must stay in buffer 1.
    assert inv.occupy("g", ("g", 0), 0).version == 1
    # A single would have gone to buffer 0.
    assert inv.occupy("s", ("s", 0), 0).version == 0
    assert inv.occupy("g", ("g", 1), 0).version == 1
    assert inv.reservation("g") is None


def test_group_moves_all_remaining_slots_on_first_occupy() -> None:
    inv = make(2, 4)
    assert inv.reserve("g", 0, count=3) == 2
    inv.occupy("g", ("g", 0), 0)
    info = inv.reservation("g")
    assert info is not None
    assert (info.buffer, info.reserved, info.occupied) == (0, 2, 1)
    assert {b.version: (b.occupied, b.reserved) for b in inv.buffers()} == {0: (1, 2)}
    # Idempotent reserve now answers the buffer holding the slots.
    assert inv.reserve("g", 0, count=3) == 0


def test_occupy_without_reservation() -> None:
    inv = make(1, 2)
    with pytest.raises(UnknownReservationError, match=r"occupy for prompt 'ghost'"):
        inv.occupy("ghost", ("ghost", 0), 0)
    assert inv.stats().occupied_total == 0


def test_double_occupy() -> None:
    inv = make(1, 2)
    inv.reserve("p", 0)
    inv.occupy("p", ("p", 0), 0)
    with pytest.raises(DoubleOccupyError, match=r"'p'.*occupied") as excinfo:
        inv.occupy("p", ("p", 1), 0)
    assert excinfo.value.outcome == "occupied"
    assert inv.stats().occupied_total == 1


def test_group_occupies_exactly_count_members() -> None:
    inv = make(0, 4)
    inv.reserve("g", 0, count=2)
    inv.occupy("g", ("g", 0), 0)
    inv.occupy("g", ("g", 1), 0)
    with pytest.raises(DoubleOccupyError):
        inv.occupy("g", ("g", 2), 0)


def test_occupy_after_abort_says_aborted() -> None:
    inv = make(1, 2)
    inv.reserve("p", 0)
    inv.abort("p")
    with pytest.raises(ReservationAbortedError, match=r"'p'.*aborted") as excinfo:
        inv.occupy("p", ("p", 0), 0)
    assert excinfo.value.outcome == "aborted"


def test_occupy_older_than_reservation_is_refused_and_changes_nothing() -> None:
    inv = make(1, 2)
    fill(inv, "a", 2, 0)
    inv.consume()
    inv.reserve("p", 1)
    before = inv.buffers()
    with pytest.raises(VersionMismatchError, match=r"'p'.*policy version 0.*version 1"):
        inv.occupy("p", ("p", 0), 0)
    assert inv.buffers() == before
    assert inv.reservation("p") is not None


def test_occupy_from_the_future_is_refused() -> None:
    inv = make(1, 2)
    inv.reserve("p", 0)
    with pytest.raises(VersionMismatchError, match="newer than the trainer"):
        inv.occupy("p", ("p", 0), 1)


def test_member_with_newer_policy_version_is_accepted() -> None:
    inv = make(1, 1)
    inv.reserve("g", 0, count=1)  # reserved at 0 -> buffer 1
    fill(inv, "a", 1, 0)  # buffer 0 ready
    inv.consume()
    placement = inv.occupy("g", ("g", 0), 1)  # the rollout actually started on weights 1
    assert (placement.version, placement.staleness) == (1, 0)


# ----------------------------------------------------------------------------------------- consume


def _balanced(inv: StalenessInventory[Traj]) -> None:
    s = inv.stats()
    assert s.reserved_total == s.occupied_total + s.aborted_total + s.reserved_slots
    assert s.occupied_total == s.consumed_trajectories + s.evicted_total + s.discarded_total + s.occupied_slots


def test_a_commit_ahead_of_the_trainer_version_advances_it_and_drops_what_fell_behind() -> None:
    inv = make(eta=1, batch_size=2)
    fill(inv, "a", 1, 0)  # a stored trajectory
    inv.reserve("g", 0, 2)  # a group in flight, one member stored
    inv.occupy("g", ("g", 0), 0)
    assert inv.advance(0).discarded == () and inv.trainer_version == 0  # not ahead: nothing happens
    with pytest.raises(VersionMismatchError):
        inv.reserve("late", 3)
    report = inv.advance(3)  # e.g. three commits by a trainer that never consumed here
    assert inv.trainer_version == 3 and inv.highest_aborted == 3 - 1 - 1  # T - 1 - eta
    assert report.aborted_prompts == ("g",) and report.aborted_slots == 1
    assert sorted(e.prompt_id for e in report.discarded) == ["a0", "g"]
    assert inv.buffers() == [] and inv.reserve("late", 3) == 4
    with pytest.raises(UnknownReservationError):
        inv.occupy("g", ("g", 1), 0)
    _balanced(inv)


def test_a_new_lineage_rewinds_the_trainer_version_and_drops_every_buffer() -> None:
    inv = make(eta=1, batch_size=1)
    fill(inv, "a", 2, 0)
    assert inv.consume(0) is not None and inv.consume(1) is not None and inv.trainer_version == 2
    inv.reserve("b", 2)
    report = inv.rewind(1)
    assert inv.trainer_version == 1 and report.aborted_prompts == ("b",) and inv.buffers() == []
    assert inv.reserve("c", 1) == 2 and inv.highest_aborted == -1
    with pytest.raises(InvalidArgumentError):
        inv.advance(-1)
    _balanced(inv)


def test_consume_returns_batch_in_order_and_advances() -> None:
    inv = make(0, 3)
    fill(inv, "a", 3, 0)
    batch = inv.consume()
    assert batch is not None
    assert batch.version == 0
    assert batch.trajectories == [("a0", 0), ("a1", 0), ("a2", 0)]
    assert [e.policy_version for e in batch.entries] == [0, 0, 0]
    assert batch.max_staleness == 0
    assert inv.trainer_version == 1
    assert inv.consume() is None
    s = inv.stats()
    assert (s.consumed_batches_total, s.consumed_trajectories) == (1, 3)


def test_consume_refuses_partial_batch() -> None:
    inv = make(0, 3)
    fill(inv, "a", 2, 0)
    assert inv.consume() is None
    assert inv.trainer_version == 0


def test_consume_with_expected_version() -> None:
    inv = make(0, 1)
    fill(inv, "a", 1, 0)
    with pytest.raises(OutOfOrderError, match=r"version 1.*version 0"):
        inv.consume(1)
    assert inv.consume(0) is not None


def test_consumed_batch_staleness_within_eta() -> None:
    inv = make(2, 1)
    inv.reserve("old", 0)  # -> buffer 2
    fill(inv, "a", 1, 0)  # -> buffer 0
    fill(inv, "b", 1, 0)  # reserve -> 1, occupy -> 1
    inv.consume()
    inv.consume()
    assert inv.occupy("old", ("old", 0), 0).staleness == 2
    batch = inv.consume()
    assert batch is not None
    assert (batch.version, batch.max_staleness) == (2, 2)


# ------------------------------------------------------------------------------- aborted versions


def test_versions_are_aborted_when_their_range_is_ready() -> None:
    inv = make(1, 1)
    assert inv.highest_aborted == -2
    inv.reserve("a", 0)  # -> 1
    inv.reserve("b", 0)  # -> 0
    p = inv.occupy("a", ("a", 0), 0)
    assert (p.version, p.aborted_versions) == (1, ())  # buffer 0 still open: nothing aborted
    p = inv.occupy("b", ("b", 0), 0)
    # Buffers 0 and 1 READY: version 0 (range [0, 1]) can no longer be placed.
    assert (p.version, p.aborted_versions) == (0, (0,))
    assert inv.highest_aborted == 0
    with pytest.raises(VersionAbortedError):
        inv.reserve("c", 0)
    inv.consume()
    inv.consume()
    assert inv.reserve("c", 1) == 2


def test_aborted_versions_reported_once_and_only_from_start_version() -> None:
    inv = make(0, 1, start_version=5)
    reported: list[int] = []
    for _ in range(4):
        t = inv.trainer_version
        inv.reserve(f"p{t}", t)
        reported.extend(inv.occupy(f"p{t}", (f"p{t}", 0), t).aborted_versions)
        inv.consume()
    assert reported == [5, 6, 7, 8]


def test_eta_zero_is_synchronous() -> None:
    inv = make(0, 2)
    fill(inv, "a", 2, 0)
    # Buffer 0 full: rollouts on weights 0 must wait for the trainer, even before it consumes.
    with pytest.raises(VersionAbortedError):
        inv.reserve("b", 0)
    inv.consume()
    with pytest.raises(VersionAbortedError):
        inv.reserve("b", 0)
    assert inv.reserve("b", 1) == 1


# ------------------------------------------------------------------------------------------- abort


def test_abort_frees_slots_for_others() -> None:
    inv = make(0, 1)
    inv.reserve("a", 0)
    with pytest.raises(NoRoomError):
        inv.reserve("b", 0)
    result = inv.abort("a")
    assert (result.prompt_id, result.version, result.aborted_slots, result.evicted) == ("a", 0, 1, ())
    assert inv.buffers() == []
    assert inv.reserve("b", 0) == 0


def test_abort_evicts_occupied_group_members_by_default() -> None:
    inv = make(0, 4)
    inv.reserve("g", 0, count=3)
    inv.occupy("g", ("g", 0), 0)
    inv.occupy("g", ("g", 1), 0)
    result = inv.abort("g")
    assert result.aborted_slots == 1
    assert [e.trajectory for e in result.evicted] == [("g", 0), ("g", 1)]
    assert inv.buffers() == []
    s = inv.stats()
    assert (s.occupied_total, s.aborted_total, s.evicted_total, s.reserved_slots) == (2, 1, 2, 0)


def test_abort_can_keep_occupied_members() -> None:
    inv = make(0, 4)
    inv.reserve("g", 0, count=3)
    inv.occupy("g", ("g", 0), 0)
    result = inv.abort("g", keep_occupied=True)
    assert (result.aborted_slots, result.evicted) == (2, ())
    assert {b.version: (b.occupied, b.reserved) for b in inv.buffers()} == {0: (1, 0)}


def test_abort_twice_and_unknown() -> None:
    inv = make(0, 2)
    with pytest.raises(UnknownReservationError, match="'nope'"):
        inv.abort("nope")
    inv.reserve("p", 0)
    inv.abort("p")
    with pytest.raises(ReservationEndedError, match=r"abort for prompt 'p'.*aborted"):
        inv.abort("p")
    inv.reserve("q", 0)
    inv.occupy("q", ("q", 0), 0)
    with pytest.raises(ReservationEndedError, match="occupied"):
        inv.abort("q")
    assert inv.stats().aborted_total == 1


def test_abort_hole_is_refilled_by_later_completion() -> None:
    # A hole left by an abort in the lowest buffer is filled by the next completion (lowest with room).
    inv = make(1, 2)
    assert [inv.reserve(p, 0) for p in "abcd"] == [1, 1, 0, 0]
    inv.occupy("c", ("c", 0), 0)
    inv.abort("d")
    assert inv.occupy("a", ("a", 0), 0).version == 0
    assert inv.consume() is not None


# ------------------------------------------------------------------------------------ prompt reuse


def test_finished_prompt_id_cannot_be_reused_while_its_buffer_lives() -> None:
    inv = make(0, 2)
    fill(inv, "p", 1, 0)
    with pytest.raises(PromptReusedError, match=r"'p0'.*unique"):
        inv.reserve("p0", 0)
    fill(inv, "q", 1, 0)
    inv.consume()
    # Forgotten once its buffer is consumed: memory stays bounded; the id is new again.
    assert inv.reserve("p0", 1) == 1
    with pytest.raises(UnknownReservationError):
        inv.occupy("q0", ("q0", 1), 1)


# ------------------------------------------------------------------------------------------ leases


def test_expire_aborts_only_past_deadlines_in_deadline_order() -> None:
    inv = make(1, 4)
    inv.reserve("late", 0, deadline=7.0)
    inv.reserve("early", 0, deadline=5.0)
    inv.reserve("forever", 0)
    assert inv.expire(4.9) == []
    results = inv.expire(7.0)
    assert [r.prompt_id for r in results] == ["early", "late"]
    assert inv.reservation("forever") is not None
    assert inv.stats().expired_prompts_total == 2
    with pytest.raises(ReservationAbortedError):
        inv.occupy("early", ("early", 0), 0)


def test_renew_moves_the_deadline() -> None:
    inv = make(1, 4)
    inv.reserve("p", 0, deadline=1.0)
    inv.renew("p", 10.0)
    assert inv.expire(5.0) == []
    assert inv.reservation("p").deadline == 10.0  # type: ignore[union-attr]
    inv.renew("p", None)
    assert inv.expire(1e9) == []
    with pytest.raises(UnknownReservationError):
        inv.renew("nope", 1.0)


def test_expired_group_evicts_its_members() -> None:
    inv = make(0, 4)
    inv.reserve("g", 0, count=2, deadline=3.0)
    inv.occupy("g", ("g", 0), 0)
    [result] = inv.expire(3.0)
    assert [e.trajectory for e in result.evicted] == [("g", 0)]
    assert inv.buffers() == []


# ----------------------------------------------------------------------------------- introspection


def test_capacity_counts_free_slots_in_range() -> None:
    inv = make(1, 3)
    assert inv.capacity(0) == 6
    inv.reserve("g", 0, count=2)
    assert inv.capacity(0) == 4
    assert inv.capacity(1) == 0  # from the future
    fill(inv, "a", 3, 0)  # reserved high, placed low: buffer 0 READY, buffer 1 keeps one free slot
    assert inv.capacity(0) == 1


def test_close_returns_everything_and_refuses_later_calls() -> None:
    inv = make(1, 2)
    fill(inv, "a", 1, 0)
    inv.reserve("g", 0, count=2)
    report = inv.close()
    assert report.aborted_prompts == ("g",)
    assert report.aborted_slots == 2
    assert [e.trajectory for e in report.discarded] == [("a0", 0)]
    assert inv.closed
    s = inv.stats()
    assert (s.reserved_slots, s.aborted_total, s.discarded_total) == (0, 2, 1)
    for call in (lambda: inv.reserve("x", 0), inv.consume, lambda: inv.expire(0.0), inv.close):
        with pytest.raises(InventoryClosedError):
            call()


# ------------------------------------------------------------------- model-based state machine


class InventoryMachine(RuleBasedStateMachine):
    """Random protocol traffic; each call's outcome is checked against the spec restated on snapshots."""

    def __init__(self) -> None:
        super().__init__()
        self.inv: StalenessInventory[Traj] = make(0, 1)
        self.start = 0
        self.ids = itertools.count()
        self.live: dict[str, int] = {}  # prompt -> reserved version
        self.ended: list[str] = []
        self.reserved_slots = 0
        self.ended_slots = 0
        self.trajectories: Counter[Traj] = Counter()
        self.left: Counter[Traj] = Counter()

    @initialize(eta=st.integers(0, 3), batch_size=st.integers(1, 4), start=st.integers(0, 3))
    def setup(self, eta: int, batch_size: int, start: int) -> None:
        self.inv = make(eta, batch_size, start_version=start)
        self.start = start

    def free(self) -> dict[int, int]:
        return {b.version: b.free for b in self.inv.buffers()}

    def ready(self) -> set[int]:
        return {b.version for b in self.inv.buffers() if b.state is BufferState.READY}

    def expected_highest_aborted(self) -> int:
        t, eta, ready = self.inv.trainer_version, self.inv.eta, self.ready()
        v = t
        while not all(b in ready for b in range(t, v + eta + 1)):
            v -= 1
        return v

    @rule(lag=st.integers(0, 4), count=st.integers(1, 4))
    def reserve(self, lag: int, count: int) -> None:
        inv = self.inv
        version = max(0, inv.trainer_version - lag)
        count = min(count, inv.batch_size)
        t, eta, bsize = inv.trainer_version, inv.eta, inv.batch_size
        free = self.free()
        expected = next((v for v in range(version + eta, max(version, t) - 1, -1) if free.get(v, bsize) >= count), None)
        pid = f"p{next(self.ids)}"
        if version <= self.expected_highest_aborted():
            with pytest.raises(VersionAbortedError):
                inv.reserve(pid, version, count)
        elif expected is None:
            with pytest.raises(NoRoomError):
                inv.reserve(pid, version, count)
        else:
            assert inv.reserve(pid, version, count) == expected
            self.live[pid] = version
            self.reserved_slots += count

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def occupy(self, data: st.DataObject) -> None:
        inv = self.inv
        pid = data.draw(st.sampled_from(sorted(self.live)))
        info = inv.reservation(pid)
        assert info is not None
        version = data.draw(st.integers(info.policy_version, inv.trainer_version))
        if info.occupied == 0:
            # First member: the group's slots go to the lowest buffer with room for all of them.
            free = self.free()
            free[info.buffer] += info.reserved
            expected = next(
                v for v in range(inv.trainer_version, info.buffer + 1) if free.get(v, inv.batch_size) >= info.reserved
            )
        else:
            expected = info.buffer
        before = inv.highest_aborted
        traj = (pid, info.occupied)
        placement = inv.occupy(pid, traj, version)
        assert placement.version == expected
        assert 0 <= placement.staleness == expected - version <= inv.eta
        assert placement.aborted_versions == tuple(range(max(before + 1, self.start), inv.highest_aborted + 1))
        self.trajectories[traj] += 1
        self.ended_slots += 1
        if info.reserved == 1:
            del self.live[pid]
            self.ended.append(pid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.booleans())
    def abort(self, data: st.DataObject, keep: bool) -> None:
        pid = data.draw(st.sampled_from(sorted(self.live)))
        info = self.inv.reservation(pid)
        assert info is not None
        result = self.inv.abort(pid, keep_occupied=keep)
        assert result.aborted_slots == info.reserved
        assert len(result.evicted) == (0 if keep else info.occupied)
        self.left.update(e.trajectory for e in result.evicted)
        self.ended_slots += result.aborted_slots
        del self.live[pid]
        self.ended.append(pid)

    @rule()
    def consume(self) -> None:
        t = self.inv.trainer_version
        was_ready = t in self.ready()
        batch = self.inv.consume()
        assert (batch is not None) == was_ready
        if batch is not None:
            assert batch.version == t
            assert len(batch.entries) == self.inv.batch_size
            assert all(0 <= t - e.policy_version <= self.inv.eta for e in batch.entries)
            self.left.update(batch.trajectories)

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def late_call(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(self.ended))
        with pytest.raises((ReservationEndedError, UnknownReservationError)):
            self.inv.occupy(pid, (pid, 99), self.inv.trainer_version)
        with pytest.raises((ReservationEndedError, UnknownReservationError)):
            self.inv.abort(pid)

    @invariant()
    def buffers_in_bounds(self) -> None:
        inv = self.inv
        for b in inv.buffers():
            assert inv.trainer_version <= b.version <= inv.trainer_version + inv.eta
            assert b.occupied + b.reserved + b.free == inv.batch_size
            assert b.free >= 0
            assert b.occupied + b.reserved > 0

    @invariant()
    def ledger_balances(self) -> None:
        s = self.inv.stats()
        assert s.reserved_total == self.reserved_slots
        assert s.reserved_total == s.occupied_total + s.aborted_total + s.reserved_slots
        assert self.reserved_slots == self.ended_slots + s.reserved_slots
        assert s.occupied_total == s.consumed_trajectories + s.evicted_total + s.occupied_slots
        assert s.highest_aborted == self.expected_highest_aborted()

    def teardown(self) -> None:
        report = self.inv.close()
        self.left.update(e.trajectory for e in report.discarded)
        # Every stored trajectory leaves exactly once: consumed, evicted or discarded at close.
        assert self.left == self.trajectories


InventoryMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestInventoryMachine = InventoryMachine.TestCase


# ------------------------------------------------------------------- async rollout simulation

MAX_LATENCY = 6
LEASE = MAX_LATENCY + 1  # healthy rollouts always finish within their lease; hung ones never do
TICK_LIMIT = 20_000


@dataclass
class Sim:
    """Parameters of one simulated run, all drawn by hypothesis.

    Latencies, fates ("ok", "fail": one member fails and the group is aborted, "hang": every member
    finishes after the lease expired) and member version bumps are cycled through.
    """

    eta: int
    group_size: int
    groups_per_batch: int
    concurrency: int
    push_lag: int
    steps: int
    latencies: list[int]
    fates: list[str]
    bumps: list[int]


@dataclass
class Simulation:
    """A dispatcher keeping up to ``concurrency`` groups in flight on the latest published weights,
    rollouts finishing after their latencies, lease expiry ticks, and a trainer that consumes each READY
    batch and publishes the next weights ``push_lag`` ticks later. Discrete time, deterministic."""

    sim: Sim
    inv: StalenessInventory[Traj] = field(init=False)
    events: list[tuple[int, int, str, object]] = field(default_factory=list)
    now: int = 0
    published: int = 0
    training: bool = False
    ticks: int = 0
    live: dict[str, int] = field(default_factory=dict)  # groups still running -> reserved version
    hung: set[str] = field(default_factory=set)
    batches: list[ReadyBatch[Traj]] = field(default_factory=list)
    reserved: Counter[str] = field(default_factory=Counter)  # slots reserved per prompt
    ended: Counter[str] = field(default_factory=Counter)  # slots ended (occupied or aborted) per prompt
    stored: Counter[Traj] = field(default_factory=Counter)  # trajectories accepted by occupy
    left: Counter[Traj] = field(default_factory=Counter)  # trajectories consumed, evicted or discarded
    dispatched: int = 0
    max_buffers: int = 0
    off_sync: int = 0  # buffers seen at a version other than T
    off_range: int = 0  # buffers seen outside [T, T + η]

    def __post_init__(self) -> None:
        self.inv = make(self.sim.eta, self.sim.group_size * self.sim.groups_per_batch)
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._lat = itertools.cycle(self.sim.latencies)
        self._fate = itertools.cycle(self.sim.fates)
        self._bump = itertools.cycle(self.sim.bumps)

    def schedule(self, delay: int, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self._seq), kind, payload))

    def dispatch(self, fate: str | None = None) -> bool:
        """Reserve one group on the published weights; False when refused."""
        g, eta, pid = self.sim.group_size, self.sim.eta, f"p{next(self._ids)}"
        try:
            target = self.inv.reserve(pid, self.published, g, deadline=self.now + LEASE)
        except ReserveRefused:
            return False
        assert max(self.published, self.inv.trainer_version) <= target <= self.published + eta
        self.dispatched += 1
        self.reserved[pid] += g
        self.live[pid] = self.published
        self.schedule(LEASE, "tick", None)
        fate = fate or next(self._fate)
        failing = next(self._lat) % g if fate == "fail" else -1
        if fate == "hang":
            self.hung.add(pid)
        for member in range(g):
            delay = 1 + next(self._lat) % MAX_LATENCY + (LEASE if fate == "hang" else 0)
            self.schedule(delay, "fail" if member == failing else "done", (pid, member))
        return True

    def abort_results(self, results: list[AbortResult[Traj]]) -> None:
        for result in results:
            self.ended[result.prompt_id] += result.aborted_slots
            self.left.update(e.trajectory for e in result.evicted)
            self.live.pop(result.prompt_id, None)

    def complete(self, kind: str, pid: str, member: int) -> None:
        if pid in self.hung:
            # Finishes after its lease expired: the manager must refuse the trajectory.
            with pytest.raises((ReservationAbortedError, UnknownReservationError)):
                self.inv.occupy(pid, (pid, member), self.published)
            return
        if pid not in self.live:
            return  # a sibling failed and the group was cancelled
        if kind == "fail":
            self.abort_results([self.inv.abort(pid)])
            return
        version = min(self.live[pid] + next(self._bump), self.published)
        self.inv.occupy(pid, (pid, member), version)
        self.stored[(pid, member)] += 1
        self.ended[pid] += 1
        if self.ended[pid] == self.reserved[pid]:
            del self.live[pid]

    def loop(self, want_dispatch: Callable[[], bool], fate: str | None = None) -> None:
        """Run until no event is pending; ``want_dispatch`` says whether to start another group."""
        while True:
            self.abort_results(self.inv.expire(self.now))
            while want_dispatch() and self.dispatch(fate):
                pass
            if not self.training and (batch := self.inv.consume()) is not None:
                self.batches.append(batch)
                self.left.update(batch.trajectories)
                self.training = True
                self.schedule(self.sim.push_lag, "push", batch.version + 1)
            buffers = self.inv.buffers()
            self.max_buffers = max(self.max_buffers, len(buffers))
            t = self.inv.trainer_version
            self.off_sync += sum(b.version != t for b in buffers)
            self.off_range += sum(not t <= b.version <= t + self.sim.eta for b in buffers)
            if not self.events:
                return
            self.ticks += 1
            assert self.ticks < TICK_LIMIT, "no progress: the simulation livelocked"
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == "push":
                    self.published = payload  # type: ignore[assignment]
                    self.training = False
                elif kind in ("done", "fail"):
                    self.complete(kind, *payload)  # type: ignore[misc]

    def run(self) -> None:
        # Until the trainer has its steps, then stop dispatching and let every rollout end.
        self.loop(lambda: len(self.batches) < self.sim.steps and len(self.live) < self.sim.concurrency)

    def fill_leftovers(self) -> int:
        """Dispatch healthy groups for exactly the free slots up to the highest partial buffer and let them
        finish: a drained inventory must be able to complete every batch it started. Returns that buffer's
        version (T - 1 when nothing was left)."""
        inv, bsize = self.inv, self.inv.batch_size
        top = max((b.version for b in inv.buffers()), default=inv.trainer_version - 1)
        free = {b.version: b.free for b in inv.buffers()}
        needed = sum(free.get(v, bsize) for v in range(inv.trainer_version, top + 1))
        goal = self.dispatched + needed // self.sim.group_size
        self.loop(lambda: self.dispatched < goal, fate="ok")
        return top


sims = st.builds(
    Sim,
    eta=st.integers(0, 3),
    group_size=st.integers(1, 3),
    groups_per_batch=st.integers(1, 3),
    concurrency=st.integers(1, 8),
    push_lag=st.integers(0, 3),
    steps=st.integers(1, 5),
    latencies=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    fates=st.lists(st.sampled_from(["ok", "ok", "fail", "hang"]), max_size=6).map(lambda xs: [*xs, "ok"]),
    bumps=st.lists(st.integers(0, 2), min_size=1, max_size=4),
)


def check_batches(s: Simulation) -> None:
    eta, g, bsize = s.sim.eta, s.sim.group_size, s.inv.batch_size
    assert [b.version for b in s.batches] == list(range(len(s.batches)))  # strictly in order
    for batch in s.batches:
        assert len(batch.entries) == bsize
        for e in batch.entries:
            assert 0 <= batch.version - e.policy_version <= eta
        assert set(Counter(e.prompt_id for e in batch.entries).values()) == {g}  # groups whole


@settings(max_examples=120, deadline=None)
@given(sims)
def test_simulated_async_rollouts(sim: Sim) -> None:
    s = Simulation(sim)
    s.run()
    inv = s.inv

    assert len(s.batches) >= sim.steps  # the trainer was never starved for good
    check_batches(s)

    # Every reserved slot ended exactly once, occupied or aborted, and the inventory agrees.
    assert s.ended == s.reserved
    st_ = inv.stats()
    assert st_.reserved_total == sum(s.reserved.values())
    assert st_.occupied_total == sum(s.stored.values())
    assert st_.reserved_total == st_.occupied_total + st_.aborted_total
    assert st_.expired_prompts_total == len(s.hung)

    # Drained: nothing reserved, nothing STUCK, nothing READY left for the trainer.
    assert (st_.live_prompts, st_.reserved_slots, st_.stuck_buffers) == (0, 0, 0)
    assert all(b.state is BufferState.OPEN for b in inv.buffers() if b.version == inv.trainer_version)

    # Admission control: at most η + 1 buffers, all within [T, T + η]; η = 0 only ever uses buffer T.
    assert s.off_range == 0
    assert s.max_buffers <= sim.eta + 1
    if sim.eta == 0:
        assert s.off_sync == 0

    # The partial batches left behind are completable: fill them and everything is consumed.
    top = s.fill_leftovers()
    assert inv.buffers() == []
    assert inv.trainer_version == top + 1
    check_batches(s)
    assert s.ended == s.reserved

    # Every stored trajectory left exactly once: consumed or evicted (close finds nothing).
    report = inv.close()
    assert (report.aborted_slots, report.discarded) == (0, ())
    assert s.left == s.stored


@settings(max_examples=40, deadline=None)
@given(sims)
def test_simulated_eta_zero_is_synchronous(sim: Sim) -> None:
    s = Simulation(dataclasses.replace(sim, eta=0))
    s.run()
    s.fill_leftovers()
    assert len(s.batches) >= sim.steps
    assert s.off_sync == 0
    for batch in s.batches:
        assert {e.policy_version for e in batch.entries} == {batch.version}
