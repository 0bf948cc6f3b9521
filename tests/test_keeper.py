"""The keeper alone: keeping (validation, copies, checksums, budget), and every ownership rule, on an
injected clock."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from branches import random_arrays
from refbus.nodes.payload.branch import Branch
from refbus.nodes.payload.charges import PAGE_BYTES, blob_charge, info_charge
from refbus.nodes.payload.keeper import (
    DISCARDED,
    HOLDER_DOWN,
    RETRY_AFTER_S,
    SHUTDOWN,
    UNDELIVERED,
    Keeper,
    KeepError,
    array_checksums,
    blob_checksum,
    pack_branches,
)
from refbus.protocol.codec import checksum
from refbus.protocol.messages import EpisodeFinished

LEASE_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def arrays(tokens: int = 6, *, routing: type = np.uint8, seed: int = 0) -> dict[str, np.ndarray]:
    """Every field, consistent: routing [tokens, 3, 2], top-k [tokens, 4], masks of 0..2 ids per token."""
    return random_arrays(tokens, seed=seed, layers=3, top_k=2, k=4, max_count=2, routing_dtype=routing)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def keeper(clock: Clock) -> Keeper:
    return Keeper("env-a", "tcp://127.0.0.1:9", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock,
                  node="env-a-0")


def test_keep_copies_each_branch_and_describes_it(keeper: Keeper) -> None:
    full = arrays(6)
    wide = arrays(5, routing=np.uint16, seed=1)
    topk_only = {k: v for k, v in arrays(4, seed=2).items() if k.startswith("topk")}
    refs = keeper.keep("ep-1", [Branch(**full), wide, topk_only])

    assert [r.fields for r in refs] == [list(full), list(wide), ["topk_ids", "topk_logprobs"]]
    assert [r.tokens for r in refs] == [6, 5, 4]
    assert [r.routing_shape for r in refs] == [[3, 2], [3, 2], None]
    assert [r.nbytes for r in refs] == [sum(a.nbytes for a in b.values()) for b in (full, wide, topk_only)]
    assert {(r.source, r.endpoint, r.node) for r in refs} == {("env-a", "tcp://127.0.0.1:9", "env-a-0")}
    assert len({r.blob_id for r in refs}) == 3
    assert (keeper.blobs_held, keeper.bytes_held) == (3, sum(blob_charge(r.nbytes) for r in refs))

    originals = {k: v.copy() for k, v in full.items()}
    for array in full.values():
        array[...] = 0  # the caller reuses its buffers: the kept copy must not change
    stored = keeper.fetch([refs[0].blob_id], "t").arrays[refs[0].blob_id]
    assert list(stored) == list(originals)
    for name, array in stored.items():
        np.testing.assert_array_equal(array, originals[name])
        assert array.dtype == originals[name].dtype and not array.flags.writeable
    assert stored["routed_experts"].dtype == np.uint8
    assert keeper.fetch([refs[1].blob_id], "t").arrays[refs[1].blob_id]["routed_experts"].dtype == np.uint16
    assert refs[0].checksum == blob_checksum(originals)
    packed = keeper.fetch([refs[0].blob_id], "t").blobs[refs[0].blob_id]
    # the checksums of keep time travel with every fetch (a send never hashes again)
    sendable = packed.sendable()
    assert [h.checksum for h in sendable.values()] == [checksum(a.tobytes()) for a in originals.values()]
    assert [h.array for h in sendable.values()] == list(stored.values())


def test_blob_checksum_hashes_the_wire_checksums_in_field_order() -> None:
    fields = arrays(3)
    digests = b"".join(checksum(memoryview(a.reshape(-1).view(np.uint8))).to_bytes(8, "little")
                       for a in fields.values())
    assert blob_checksum(fields) == xxhash.xxh3_64_intdigest(digests)
    assert blob_checksum(dict(reversed(fields.items()))) != blob_checksum(fields)


def test_array_checksums_are_of_the_c_order_bytes_whatever_the_layout() -> None:
    """Contiguous arrays are hashed through their own buffer; every other layout through a C-order copy: the
    checksum is of the same bytes either way (what a receiver hashes in the frame)."""
    base = np.arange(4 * 6 * 8, dtype=np.int32).reshape(4, 6, 8)
    layouts = [base, base[:, ::2], np.asfortranarray(base), base.transpose(2, 0, 1), base[1:3], base[:0],
               np.array(7, dtype=np.uint16), base.astype(np.float32).view(np.uint8), base.astype(">i4")[:2]]
    for array in layouts:
        expected = xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).tobytes())
        assert array_checksums({"a": array}) == (expected,), (array.dtype, array.shape, array.strides)
    assert blob_checksum({"a": base[:, ::2]}) == blob_checksum({"a": np.ascontiguousarray(base[:, ::2])})


def test_a_bad_branch_rejects_the_episode_and_keeps_nothing(keeper: Keeper) -> None:
    bad = arrays(4)
    bad["mask_ids"] = bad["mask_ids"][:-1] if bad["mask_ids"].size else np.zeros(1, np.int32)
    for branches, where in (([arrays(4), bad], "branch 1: mask_ids"),
                            ([arrays(4), {"routed_experts": np.zeros((2, 3, 2), np.int64)}], "branch 1: routed"),
                            ([arrays(4), {"nope": np.zeros(2)}], "branch 1: nope"),
                            ([arrays(4), [1, 2]], "branch 1: expected a Branch or a mapping")):
        with pytest.raises(KeepError, match=where) as err:
            keeper.keep("ep-bad", branches)
        assert err.value.code == "bad-branch"
    assert (keeper.blobs_held, keeper.bytes_held, keeper.kept_total) == (0, 0, 0)
    assert keeper.keep("ep-bad", [arrays(4)])  # the id was not taken by the refused attempts


def test_budget_refuses_without_evicting(clock: Clock) -> None:
    one = arrays(8)
    size = blob_charge(sum(a.nbytes for a in one.values()))
    keeper = Keeper("env-a", "e", budget_bytes=2 * size, handover_lease_s=LEASE_S, clock=clock)
    with pytest.raises(KeepError, match=f"needs {3 * size} bytes .*, 0 of {2 * size}") as err:
        keeper.keep("too-big", [one, one, one])
    assert err.value.code == "over-budget" and keeper.blobs_held == 0
    assert err.value.retry_after_s == 0  # larger than the whole budget: retrying cannot help
    (first,) = keeper.keep("a", [one])
    keeper.keep("b", [one])
    with pytest.raises(KeepError, match=f"needs {size} bytes .*, {2 * size} of {2 * size}") as err:
        keeper.keep("c", [one])
    assert err.value.retry_after_s == RETRY_AFTER_S > 0  # fits once a holder deletes: backpressure, not a fault
    assert keeper.blobs_held == 2 and first.blob_id in keeper.fetch([first.blob_id], "t").arrays
    keeper.delete([first.blob_id], "t", "trained")
    keeper.keep("c", [one])  # deleting made room


def test_duplicate_episode_and_keep_after_close_are_refused(keeper: Keeper) -> None:
    keeper.keep("ep", [arrays(2)])
    with pytest.raises(KeepError) as err:
        keeper.keep("ep", [arrays(2)])
    assert err.value.code == "duplicate-episode" and keeper.blobs_held == 1
    keeper.close()
    with pytest.raises(KeepError) as err:
        keeper.keep("later", [arrays(2)])
    assert err.value.code == "closed" and keeper.blobs_held == 0


def test_claim_moves_once_and_a_second_claimer_is_a_violation(keeper: Keeper) -> None:
    a, b = (r.blob_id for r in keeper.keep("ep", [arrays(2), arrays(3)]))
    first = keeper.claim([a, a, "nope"], "orch")
    assert (first.claimed, first.already, first.unknown, first.violations) == ((a,), (), ("nope",), ())
    again = keeper.claim([a, b], "orch")
    assert (again.claimed, again.already) == ((b,), (a,))
    (violation,) = keeper.claim([a], "thief").violations
    assert (violation.blob_id, violation.action, violation.holder, violation.owner) == (a, "claim", "thief", "orch")
    keeper.delete([a], "trainer-0", "trained")
    assert keeper.claim([a], "orch").gone == (a,)
    assert keeper.stats().violations == {"claim": 1}


def test_fetch_is_open_to_anyone_until_deleted(keeper: Keeper) -> None:
    (ref,) = keeper.keep("ep", [arrays(3)])
    keeper.claim([ref.blob_id], "orch")
    assert keeper.fetch([ref.blob_id], "trainer-1").arrays.keys() == {ref.blob_id}
    assert keeper.fetch(["never"], "trainer-1").unknown == ("never",)
    keeper.delete([ref.blob_id], "trainer-0", "trained")
    late = keeper.fetch([ref.blob_id], "trainer-1")
    (violation,) = late.violations
    assert not late.arrays and not late.unknown
    assert (violation.action, violation.holder, violation.owner) == ("fetch", "trainer-1", "trainer-0")
    assert "trained" in violation.detail


def test_delete_happens_once_then_reports_both_holders(keeper: Keeper) -> None:
    a, b = (r.blob_id for r in keeper.keep("ep", [arrays(2), arrays(2)]))
    first = keeper.delete([a, a, "never"], "trainer-0", "trained")
    assert (first.deleted, first.unknown, first.violations) == ((a,), ("never",), ())
    assert (first.holder, first.reason) == ("trainer-0", "trained")
    second = keeper.delete([a, b], "trainer-1", "trained")
    assert second.deleted == (b,)
    (violation,) = second.violations
    assert (violation.blob_id, violation.action, violation.holder, violation.owner) == (
        a, "delete", "trainer-1", "trainer-0")
    assert keeper.stats().deleted == {"trained": 2} and keeper.stats().violations == {"delete": 1}
    assert (keeper.blobs_held, keeper.bytes_held) == (0, 0)


def test_tombstones_are_bounded(clock: Clock) -> None:
    keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock, max_tombstones=2)
    ids = [r.blob_id for r in keeper.keep("ep", [arrays(1), arrays(1), arrays(1)])]
    keeper.delete(ids, "t", "trained")
    again = keeper.delete(ids, "u", "trained")
    assert again.unknown == (ids[0],) and [v.blob_id for v in again.violations] == ids[1:]


def test_tombstones_are_forgotten_after_their_window(clock: Clock) -> None:
    """Memory levels off at the delete rate times ``tombstone_s``: a repeat within the window is a violation,
    after it the id reads as unknown."""
    keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock, tombstone_s=10.0)
    old, recent = (r.blob_id for r in keeper.keep("ep", [arrays(1), arrays(1)]))
    keeper.delete([old], "t", "trained")
    clock.now += 6
    keeper.delete([recent], "t", "trained")
    assert [v.blob_id for v in keeper.delete([old], "u", "trained").violations] == [old]  # 6 s: remembered
    clock.now += 5
    keeper.delete([], "t", "trained")  # any delete prunes what is older than the window
    again = keeper.delete([old, recent], "u", "trained")
    assert again.unknown == (old,) and [v.blob_id for v in again.violations] == [recent]
    with pytest.raises(ValueError, match="tombstone_s"):
        Keeper("env-a", "e", budget_bytes=1, handover_lease_s=1.0, tombstone_s=0.0)


def test_unclaimed_blobs_expire_as_undelivered(keeper: Keeper, clock: Clock) -> None:
    early = [r.blob_id for r in keeper.keep("early", [arrays(2), arrays(2)])]
    clock.now += 5
    (late,) = (r.blob_id for r in keeper.keep("late", [arrays(2)]))
    keeper.claim([early[0]], "orch")
    assert keeper.expire(clock.now + LEASE_S - 5 - 0.001).deleted == ()
    result = keeper.expire(clock.now + LEASE_S - 5)
    assert (result.deleted, result.holder, result.reason) == ((early[1],), "env-a", UNDELIVERED)
    clock.now += LEASE_S
    assert keeper.expire().deleted == (late,)
    assert keeper.blobs_held == 1  # the claimed one stays with its holder
    (violation,) = keeper.delete([late], "orch", "filtered").violations
    assert violation.owner == "env-a" and "undelivered" in violation.detail


def test_discard_deletes_only_unclaimed_blobs_of_the_episode(keeper: Keeper) -> None:
    a, b = (r.blob_id for r in keeper.keep("ep", [arrays(2), arrays(2)]))
    (other,) = (r.blob_id for r in keeper.keep("other", [arrays(2)]))
    keeper.claim([a], "orch")
    assert keeper.discard("ep").deleted == (b,)
    assert keeper.discard("ep").deleted == () and keeper.discard("unknown").deleted == ()
    assert keeper.stats().deleted == {DISCARDED: 1}
    assert set(keeper.fetch([a, other], "t").arrays) == {a, other}


def test_a_tiny_blob_is_charged_its_pages_and_overhead_so_tiny_blobs_meet_the_budget_first(clock: Clock) -> None:
    """Before, the budget counted array bytes only: a 1 MiB budget took 65,000 one-byte blobs, each a tmpfs file
    of a page, a mapping and kilobytes of memory, until the process ran out of mappings (``store-failed``)."""
    tiny = {"routed_experts": np.ones((1, 1, 1), np.uint8)}
    assert blob_charge(1) == blob_charge(PAGE_BYTES) > PAGE_BYTES
    assert blob_charge(PAGE_BYTES + 1) == blob_charge(1) + PAGE_BYTES
    keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock)
    kept = 0
    with pytest.raises(KeepError, match=r"needs .* bytes \(1 array bytes in 1 blobs") as err:
        while True:
            keeper.keep(f"ep-{kept}", [tiny])
            kept += 1
    assert err.value.code == "over-budget" and err.value.retry_after_s == RETRY_AFTER_S
    assert kept == (1 << 20) // blob_charge(1) and keeper.bytes_held == kept * blob_charge(1)


def test_live_blobs_are_capped_by_max_blobs(clock: Clock) -> None:
    keeper = Keeper("env-a", "e", budget_bytes=1 << 30, handover_lease_s=LEASE_S, clock=clock, max_blobs=3)
    (a, _) = keeper.keep("ep-1", [arrays(2), arrays(2)])
    with pytest.raises(KeepError, match="too many blobs, it needs 2, 2 of at most 3 are held") as err:
        keeper.keep("ep-2", [arrays(2), arrays(2)])
    assert err.value.code == "over-budget" and err.value.retry_after_s == RETRY_AFTER_S
    with pytest.raises(KeepError, match="it can never fit") as err:
        keeper.keep("ep-3", [arrays(2)] * 4)
    assert err.value.retry_after_s == 0 and keeper.blobs_held == 2
    keeper.delete([a.blob_id], "t", "trained")
    assert len(keeper.keep("ep-2", [arrays(2), arrays(2)])) == 2  # a delete made room
    with pytest.raises(ValueError, match="max_blobs"):
        Keeper("env-a", "e", budget_bytes=1, handover_lease_s=1.0, max_blobs=0)


def test_an_episodes_info_is_charged_while_its_record_is_held(clock: Clock) -> None:
    """Before, ``info`` (up to the body limit, held with the record as long as a blob of the episode lived) was
    never counted against the budget."""
    info = {"group": "g", "reward": 1.0, "a": np.zeros(1000, np.float32)}
    charge = info_charge(info)
    assert charge > 4000 and charge == info_charge({"group": "g", "reward": 1.0, "a": [0.0] * 1000}) + 4000
    keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock)
    refs = keeper.store("ep", pack_branches([arrays(2), arrays(3)]), charge)
    keeper.record(EpisodeFinished(episode_id="ep", source="env-a", refs=refs, info=info))
    blobs = sum(blob_charge(r.nbytes) for r in refs)
    assert keeper.bytes_held == blobs + charge == keeper.stats().bytes_held
    with pytest.raises(KeepError, match=f"and {1 << 20} of info"):
        keeper.store("big", pack_branches([arrays(2)]), 1 << 20)
    keeper.delete([refs[0].blob_id], "t", "trained")
    assert keeper.bytes_held == blob_charge(refs[1].nbytes) + charge  # held while a blob of the episode lives
    keeper.delete([refs[1].blob_id], "t", "trained")
    assert keeper.bytes_held == 0
    keeper.store("gone", pack_branches([arrays(2)]), charge)
    keeper.withdraw("gone")
    assert keeper.bytes_held == 0


def test_close_deletes_everything_held(keeper: Keeper) -> None:
    ids = [r.blob_id for r in keeper.keep("ep", [arrays(2), arrays(3)])]
    keeper.claim(ids[:1], "orch")
    result = keeper.close()
    assert (set(result.deleted), result.holder, result.reason) == (set(ids), "env-a", SHUTDOWN)
    assert keeper.close().deleted == ()
    stats = keeper.stats()
    assert (stats.blobs_held, stats.bytes_held, stats.kept_total, stats.deleted) == (0, 0, 2, {SHUTDOWN: 2})


def test_blob_ids_differ_across_restarts(clock: Clock) -> None:
    ids = set()
    for _ in range(3):
        keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S, clock=clock)
        ids.update(r.blob_id for r in keeper.keep("ep", [arrays(1), arrays(1)]))
    assert len(ids) == 6


def test_an_empty_mask_and_zero_tokens_are_kept() -> None:
    keeper = Keeper("env-a", "e", budget_bytes=1 << 20, handover_lease_s=LEASE_S)
    empty = {"routed_experts": np.zeros((0, 2, 2), np.uint8), "mask_ids": np.zeros(0, np.int32),
             "mask_counts": np.zeros(0, np.int32)}
    (ref,) = keeper.keep("ep", [empty])
    assert (ref.tokens, ref.nbytes) == (0, 0)
    assert keeper.fetch([ref.blob_id], "t").arrays[ref.blob_id]["routed_experts"].shape == (0, 2, 2)


@pytest.mark.parametrize("kwargs", [{"budget_bytes": 0}, {"handover_lease_s": 0.0}, {"max_tombstones": 0}])
def test_settings_are_checked(kwargs: dict) -> None:
    settings = {"budget_bytes": 1, "handover_lease_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Keeper("env-a", "e", **settings)


GRACE_S = 5.0


def _claimed(keeper: Keeper, episode: str, holder: str, count: int = 2) -> list[str]:
    ids = [ref.blob_id for ref in keeper.keep(episode, [arrays(4, seed=i) for i in range(count)])]
    assert keeper.claim(ids, holder).claimed == tuple(ids)
    return ids


def test_a_holder_down_past_its_grace_loses_what_it_holds_and_no_one_else_does(keeper: Keeper, clock: Clock) -> None:
    dead = _claimed(keeper, "ep-dead", "orch")
    other = _claimed(keeper, "ep-other", "orch-2")
    unclaimed = [ref.blob_id for ref in keeper.keep("ep-free", [arrays(3)])]
    keeper.holder_down("orch", GRACE_S)
    clock.now += GRACE_S - 0.1
    assert keeper.reclaim() == {}
    clock.now += 0.1
    result = keeper.reclaim()
    assert list(result) == ["orch"]
    assert (result["orch"].deleted, result["orch"].holder, result["orch"].reason) == (tuple(dead), "env-a", HOLDER_DOWN)
    assert keeper.stats().deleted == {HOLDER_DOWN: 2}
    assert keeper.reclaim() == {}  # once
    # Its blobs are gone (a later delete is answered reclaimed, not deleted twice); the others are untouched.
    assert keeper.delete(dead, "orch", "trained").reclaimed == tuple(dead)
    assert set(keeper.fetch([*other, *unclaimed], "t").arrays) == {*other, *unclaimed}


def test_stale_requests_for_reclaimed_blobs_are_answered_reclaimed_not_as_violations(keeper: Keeper,
                                                                                     clock: Clock) -> None:
    """A holder cut off past its grace comes back as the same process and touches what it held: every claim,
    fetch and delete of a reclaimed blob, by it or by anyone it handed the reference to, is stale."""
    reclaimed = _claimed(keeper, "ep-cut", "orch", count=2)
    live = _claimed(keeper, "ep-live", "orch-2")
    trained = _claimed(keeper, "ep-trained", "orch-2")
    assert keeper.delete(trained, "rank-0", "trained").deleted == tuple(trained)
    keeper.holder_down("orch", GRACE_S)
    clock.now += GRACE_S
    assert keeper.reclaim()["orch"].deleted == tuple(reclaimed)

    claim = keeper.claim([*reclaimed, *reclaimed, "never-kept"], "orch")  # repeated ids count once
    assert (claim.claimed, claim.already, claim.gone, claim.unknown, claim.violations, claim.reclaimed) == (
        (), (), (), ("never-kept",), (), tuple(reclaimed))
    fetch = keeper.fetch([reclaimed[0], live[0]], "rank-1")
    assert (list(fetch.arrays), fetch.unknown, fetch.violations) == ([live[0]], (), ())
    assert fetch.reclaimed == (reclaimed[0],)
    # One request mixing a live blob, a reclaimed one, one deleted twice and garbage: each gets its own answer.
    delete = keeper.delete([live[0], reclaimed[1], trained[0], "x" * 300, ""], "orch", "trained")
    assert (delete.deleted, delete.reclaimed, delete.unknown) == ((live[0],), (reclaimed[1],), ("x" * 300, ""))
    assert [(v.blob_id, v.owner) for v in delete.violations] == [(trained[0], "rank-0")]  # a real second delete
    assert keeper.delete(reclaimed, "orch", "shutdown").reclaimed == tuple(reclaimed)  # and again: still stale
    stats = keeper.stats()
    assert stats.violations == {"delete": 1}
    assert stats.stale == {"claim": 2, "fetch": 1, "delete": 3}
    assert stats.deleted == {HOLDER_DOWN: 2, "trained": 3}  # nothing reclaimed is counted as deleted twice
    assert stats.reclaimed == {"orch": 2}


def test_a_grace_ended_by_a_new_process_reclaims_at_once_what_a_deadline_would_and_nothing_twice(
        keeper: Keeper, clock: Clock) -> None:
    """A rank (process A) holds two blobs by hand-over and is reported down; its new process B takes a third by
    its own hand-over in the grace. ``end_grace`` for B reclaims A's two at once, not B's, with the grace's end
    accounting, and ends the grace: a later deadline, or a second call, reclaims nothing more."""
    old = _claimed(keeper, "ep-old", "orch")
    new = _claimed(keeper, "ep-new", "orch", count=1)
    keeper.hand_over(old, "rank")
    keeper.holder_down("rank", GRACE_S, process="A")
    assert keeper.hand_over(new, "rank", publisher="rank").again == tuple(new)  # B's own hand-over
    committed: list[tuple[str, tuple[str, ...]]] = []
    result = keeper.end_grace("rank", "B", commit=lambda holder, r: committed.append((holder, r.deleted)))
    assert result is not None and (result.deleted, result.holder, result.reason) == (tuple(old), "env-a", HOLDER_DOWN)
    assert committed == [("rank", tuple(old))] and not keeper.in_grace("rank")
    stats = keeper.stats()
    assert (stats.held_by, stats.reclaimed, stats.deleted) == ({"rank": 1}, {"rank": 2}, {HOLDER_DOWN: 2})
    assert keeper.end_grace("rank", "B") is None
    clock.now += GRACE_S
    assert keeper.reclaim() == {} and keeper.stats().held_by == {"rank": 1}


def test_a_grace_is_not_ended_by_its_own_process_an_unknown_one_or_blobs_another_node_handed_over(
        keeper: Keeper, clock: Clock) -> None:
    """``end_grace`` changes nothing for a holder in no grace, for the process the grace waits for (back, not
    replaced: :meth:`holder_back` decides), when the process reported down is unknown (nothing says the new one is
    another), or while blobs the orchestrator's repeat moved to the holder in the grace wait for the holder's own
    hand-over (the new process's, perhaps, its event still on its way); once that comes, the grace ends."""
    ids = _claimed(keeper, "ep", "orch")
    handed = _claimed(keeper, "ep-handed", "orch", count=1)
    keeper.hand_over(ids, "rank")
    assert keeper.end_grace("rank", "B") is None  # not down
    keeper.holder_down("rank", GRACE_S, process="A")
    assert keeper.end_grace("rank", "A") is None  # its own process
    keeper.hand_over(handed, "rank", by_holder=False, publisher="orch")  # the orchestrator's repeat, in the grace
    assert keeper.end_grace("rank", "B") is None
    keeper.hand_over(handed, "rank", publisher="rank")  # the holder's own event takes it
    assert keeper.end_grace("rank", "B").deleted == tuple(ids)  # type: ignore[union-attr]
    assert keeper.stats().held_by == {"rank": 1}
    _claimed(keeper, "ep-2", "orch-2")
    keeper.holder_down("orch-2", GRACE_S)  # process unknown
    assert keeper.end_grace("orch-2", "B") is None and keeper.in_grace("orch-2")
    assert keeper.stats().held_by == {"rank": 1, "orch-2": 2}


def test_a_holder_back_within_the_grace_keeps_everything(keeper: Keeper, clock: Clock) -> None:
    _claimed(keeper, "ep", "orch")
    keeper.holder_down("orch", GRACE_S)
    keeper.holder_back("orch")
    clock.now += GRACE_S * 2
    assert keeper.reclaim() == {}
    assert keeper.blobs_held == 2


def test_a_restarted_holder_keeps_what_it_claims_again_within_the_grace(keeper: Keeper, clock: Clock) -> None:
    ids = _claimed(keeper, "ep", "orch", count=3)
    keeper.holder_down("orch", GRACE_S)
    clock.now += 1.0
    again = keeper.claim(ids[:2], "orch")  # idempotent: the current holder's claim is answered ok
    assert (again.claimed, again.already, again.violations) == ((), tuple(ids[:2]), ())
    keeper.holder_down("orch", GRACE_S)  # a second report does not move the deadline
    clock.now += GRACE_S - 1.0
    assert keeper.reclaim()["orch"].deleted == (ids[2],)
    assert set(keeper.fetch(ids[:2], "t").arrays) == set(ids[:2])


@pytest.mark.parametrize("successor", [False, True])
def test_a_restarted_holder_down_in_turn_within_the_grace_gets_a_fresh_one_sparing_only_what_a_later_one_claims(
        keeper: Keeper, clock: Clock, successor: bool) -> None:
    """Process A of a holder dies holding two blobs; its restarted process B claims one of them back and an
    unclaimed one within A's grace, then dies too. B's report starts a fresh grace: at its end everything the
    holder holds is reclaimed, except what a later process C claims in it (exactly that). Before, the second
    report kept A's deadline and A's grace spared what B had claimed: B's blobs stayed held by a process that
    was gone, until the store shut down."""
    held = _claimed(keeper, "ep-held", "orch")
    free = [ref.blob_id for ref in keeper.keep("ep-free", [arrays(3)])]
    assert keeper.holder_down("orch", GRACE_S, process="A")
    clock.now += 1.0
    assert keeper.claim([held[0], *free], "orch").again == (*free, held[0])  # B, the restart
    clock.now += 1.0
    assert keeper.holder_down("orch", GRACE_S, process="B")  # B dies within A's grace
    assert not keeper.holder_down("orch", GRACE_S, process="B")  # a repeat keeps B's deadline
    assert not keeper.holder_down("orch", GRACE_S)  # and so does a report of an unknown process
    clock.now += GRACE_S - 2.0
    assert keeper.reclaim() == {}  # A's deadline: B's grace runs
    if successor:
        assert keeper.claim([held[0]], "orch").again == (held[0],)  # C, B's restart, takes one back
    clock.now += 2.0
    kept = [held[0]] if successor else []
    assert keeper.reclaim()["orch"].deleted == tuple(b for b in (*held, *free) if b not in kept)
    assert keeper.stats().held_by == ({"orch": 1} if successor else {})
    assert keeper.reclaim() == {} and not keeper.in_grace("orch")


def test_a_restarted_holder_reported_down_that_is_back_as_the_same_process_resumes_the_grace_it_cut_short(
        keeper: Keeper, clock: Clock) -> None:
    """B, the restart of A, reported down within A's grace, comes back as the same process (slow, not dead): it
    keeps what it claimed, before its report and after, and A's grace goes on to its own deadline for the rest."""
    held = _claimed(keeper, "ep-held", "orch", count=3)
    keeper.holder_down("orch", GRACE_S, process="A")
    keeper.claim(held[:1], "orch")
    clock.now += 1.0
    keeper.holder_down("orch", GRACE_S, process="B")
    keeper.claim(held[1:2], "orch")
    assert not keeper.holder_back("orch", "A")  # not the process last reported down
    assert keeper.holder_back("orch", "B") and keeper.in_grace("orch")
    clock.now += GRACE_S - 1.0
    assert keeper.reclaim()["orch"].deleted == (held[2],)
    assert keeper.stats().held_by == {"orch": 2} and not keeper.in_grace("orch")


def test_deadlines_moved_later_by_a_stall_move_every_lease_and_grace_alike(keeper: Keeper, clock: Clock) -> None:
    """A stall the store measured moves every hand-over lease's end and every grace's end, a grace a fresh one
    cut short too: nothing ends before its moved deadline, everything at it, the leases still in order."""
    early = [r.blob_id for r in keeper.keep("early", [arrays(2)])]
    clock.now += 5
    late = [r.blob_id for r in keeper.keep("late", [arrays(2)])]
    held = _claimed(keeper, "ep-held", "orch", count=2)
    keeper.holder_down("orch", GRACE_S, process="A")
    clock.now += 1.0
    keeper.holder_down("orch", GRACE_S, process="B")  # A's restart B, down in A's grace: A's cut short
    keeper.extend_deadlines(30.0)
    keeper.extend_deadlines(0.0)  # no stall: nothing moves
    assert keeper.expire(clock.now - 6 + LEASE_S + 30 - 0.001).deleted == ()
    assert keeper.expire(clock.now - 6 + LEASE_S + 30).deleted == tuple(early)
    assert keeper.expire(clock.now - 1 + LEASE_S + 30).deleted == tuple(late)
    assert keeper.reclaim(clock.now + GRACE_S + 30 - 0.001) == {}
    assert keeper.holder_back("orch", "B")  # A's grace resumes, with its deadline moved too
    assert keeper.reclaim(clock.now - 1.0 + GRACE_S + 30 - 0.001) == {}
    assert keeper.reclaim(clock.now - 1.0 + GRACE_S + 30)["orch"].deleted == tuple(held)


def test_a_restarted_holder_keeps_what_it_claims_for_the_first_time_within_the_grace(
        keeper: Keeper, clock: Clock) -> None:
    """Blobs unclaimed when the holder went down and claimed by its restarted incarnation are not the dead
    incarnation's: the reclaim at the grace's end leaves them."""
    held = _claimed(keeper, "ep-held", "orch")
    free = [ref.blob_id for ref in keeper.keep("ep-free", [arrays(3), arrays(4)])]
    keeper.holder_down("orch", GRACE_S)
    assert keeper.claim(free, "orch").claimed == tuple(free)
    clock.now += GRACE_S
    assert keeper.reclaim()["orch"].deleted == tuple(held)
    assert set(keeper.fetch(free, "t").arrays) == set(free)


def test_holdings_list_the_records_of_what_a_holder_holds_or_nobody_claimed(keeper: Keeper) -> None:
    """In keep order, from a keep position on; an episode only partly the holder's lists its part; an episode
    wholly another holder's, or gone, is not listed; a record leaves with its episode's last blob."""
    def keep(episode: str, count: int) -> list[str]:
        refs = keeper.keep(episode, [arrays(3, seed=i) for i in range(count)])
        keeper.record(EpisodeFinished(episode_id=episode, source="env-a", refs=refs, info={"group": "g"}))
        return [ref.blob_id for ref in refs]

    mine, split, others = keep("mine", 2), keep("split", 3), keep("others", 1)
    free, gone = keep("free", 1), keep("gone", 1)
    keeper.claim([*mine, *split], "orch")
    keeper.hand_over(split[:1], "rank-0")
    keeper.claim(others, "orch-2")
    keeper.delete(gone, "env-a", "discarded")
    listed = [(h.position, h.record.episode_id, h.held, h.unclaimed) for h in keeper.holdings("orch")]
    assert listed == [(0, "mine", tuple(mine), ()), (1, "split", tuple(split[1:]), ()), (3, "free", (), tuple(free))]
    assert [h.record.episode_id for h in keeper.holdings("orch", after=2)] == ["free"]
    assert [h.record.episode_id for h in keeper.holdings("orch-2")] == ["others", "free"]
    keeper.delete([*mine, *split], "orch", "trained")
    keeper.delete(free, "env-a", "discarded")
    assert list(keeper.holdings("orch")) == [] and keeper.blobs_held == 1
    keeper.record(EpisodeFinished(episode_id="never-kept", source="env-a", refs=[]))  # no blobs: not filed
    assert [h.record.episode_id for h in keeper.holdings("orch-2")] == ["others"]


def test_blobs_handed_to_a_trainer_rank_are_its_own(keeper: Keeper, clock: Clock) -> None:
    ids = _claimed(keeper, "ep", "orch", count=3)
    free = [ref.blob_id for ref in keeper.keep("ep-free", [arrays(3)])]
    assert keeper.hand_over([*ids[:2], *free, "nope"], "rank-0").moved == tuple(ids[:2])  # unclaimed, unknown: left
    assert keeper.holds("rank-0") and keeper.holds("orch")
    assert keeper.stats().held_by == {"orch": 1, "rank-0": 2, "": 1}  # the store's counts follow the hand-over
    keeper.holder_down("orch", GRACE_S)
    keeper.holder_down("rank-0", GRACE_S)
    clock.now += GRACE_S
    result = keeper.reclaim()
    assert (result["orch"].deleted, result["rank-0"].deleted) == ((ids[2],), tuple(ids[:2]))
    assert keeper.blobs_held == 1  # the unclaimed one waits for its lease
    assert keeper.stats().held_by == {"": 1} and keeper.stats().reclaimed == {"orch": 1, "rank-0": 2}


def test_blobs_handed_to_a_trainer_rank_in_its_grace_are_its_restarted_worlds(keeper: Keeper, clock: Clock) -> None:
    """A trainer rank never claims: its restarted world takes blobs by hand-over (``reference``). What moves to
    it while it is down, in its grace, is the new process's and survives the reclaim of what the dead one
    held; a hand-over of its own blobs (a repeat) moves nothing."""
    ids = _claimed(keeper, "ep", "orch", count=3)
    assert keeper.hand_over(ids[:1], "rank-0").moved == tuple(ids[:1])  # the dead process's
    keeper.holder_down("rank-0", GRACE_S)
    assert keeper.hand_over(ids[:2], "rank-0").moved == tuple(ids[1:2])  # the restarted world's step
    clock.now += GRACE_S
    assert keeper.reclaim()["rank-0"].deleted == tuple(ids[:1])
    assert keeper.stats().held_by == {"orch": 1, "rank-0": 1}
    assert set(keeper.fetch(ids[1:2], "rank-0").arrays) == set(ids[1:2])


def test_a_hand_over_another_node_repeats_in_a_ranks_grace_moves_but_spares_only_what_the_rank_takes_itself(
        keeper: Keeper, clock: Clock) -> None:
    """The orchestrator repeats each hand-over on the rank's answer, which can come after the rank died (for a
    step the dead process took): that repeat moves the blobs, so they are reclaimed with the rank's, but does
    not count them as its restarted incarnation's (they were kept for good, under a node id whose new process
    never knew them). The rank's own event does, even when the repeat moved the blobs first."""
    ids = _claimed(keeper, "ep", "orch", count=3)
    keeper.holder_down("rank-0", GRACE_S, process="p1")
    dead_step = keeper.hand_over(ids[:1], "rank-0", by_holder=False)
    assert (dead_step.moved, dead_step.again) == (tuple(ids[:1]), ())
    assert keeper.hand_over(ids[1:2], "rank-0", by_holder=False).again == ()  # the repeat came first
    assert keeper.hand_over(ids[1:2], "rank-0").again == tuple(ids[1:2])  # then the restarted rank's own
    clock.now += GRACE_S
    assert keeper.reclaim()["rank-0"].deleted == tuple(ids[:1])
    assert keeper.stats().held_by == {"orch": 1, "rank-0": 1}


def test_a_commit_that_raises_changes_nothing_and_the_same_call_after_it_does_all(keeper: Keeper,
                                                                                   clock: Clock) -> None:
    """Every call that changes ownership hands its decided result to ``commit`` (a durable store's journal
    record) before it changes anything: when that raises (a full tmpfs), nothing changed (no blob moved or went,
    no violation counted, no lease or grace ended), and the same call made again does it all. Before, the keeper
    changed first and the env server's journal raised after it: memory and journal went apart."""
    kept = [r.blob_id for r in keeper.keep("ep", [arrays(2, seed=n) for n in range(6)])]
    (late,) = [r.blob_id for r in keeper.keep("late", [arrays(2)])]
    keeper.claim(kept[:2], "orch")
    keeper.claim(kept[2:3], "rank-0")
    keeper.holder_down("rank-0", 1.0, process=("h", 1, 1.0))
    keeper.delete(kept[5:], "orch", "trained")

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    clock.now += LEASE_S
    before = keeper.stats()
    attempts = [
        lambda commit: keeper.claim([kept[3], kept[0]], "other", commit=commit),  # one claimed, one violation
        lambda commit: keeper.hand_over(kept[:1], "rank-1", commit=commit),
        lambda commit: keeper.delete([kept[1], kept[5]], "orch", "trained", commit=commit),  # one a violation
        lambda commit: keeper.fetch(kept[5:], "orch", commit=commit),  # a violation
        lambda commit: keeper.discard("late", commit=commit),
        lambda commit: keeper.expire(commit=commit),
        lambda commit: keeper.reclaim(commit=commit),
    ]
    for attempt in attempts:
        with pytest.raises(OSError):
            attempt(full)
        assert keeper.stats() == before
    assert keeper.in_grace("rank-0")
    results = [attempt(None) for attempt in attempts]
    assert results[0].claimed == (kept[3],) and len(results[0].violations) == 1
    assert results[1].moved == (kept[0],)
    assert results[2].deleted == (kept[1],) and len(results[2].violations) == 1
    assert results[4].deleted == (late,)
    assert results[5].deleted == (kept[4],)  # its lease ended; the other unclaimed one was discarded
    assert results[6]["rank-0"].deleted == (kept[2],) and not keeper.in_grace("rank-0")
    stats = keeper.stats()
    assert stats.violations == {"claim": 1, "delete": 1, "fetch": 1}
    assert stats.deleted == {"trained": 2, DISCARDED: 1, UNDELIVERED: 1, HOLDER_DOWN: 1}
    assert stats.held_by == {"rank-1": 1, "other": 1}
