"""Staleness inventory of the ps-manager: the Reserve / Occupy / Consume protocol with bound η.

Pure bookkeeping, no I/O, no clock and no threads: the manager owns one instance, calls it from a single
thread (its event loop) and maps each call to a wire message. Nothing here is thread safe. The protocol
(versions, slots, groups, idempotence, aborted versions, liveness, leases) is specified in
``docs/STALENESS.md``; the property tests in ``tests/test_staleness.py`` hold this module to it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "AbortResult",
    "BufferInfo",
    "BufferState",
    "CloseReport",
    "DoubleOccupyError",
    "Entry",
    "InvalidArgumentError",
    "InventoryClosedError",
    "InventoryMisuseError",
    "InventoryStats",
    "NoRoomError",
    "OutOfOrderError",
    "Placement",
    "PromptReusedError",
    "ReadyBatch",
    "ReservationAbortedError",
    "ReservationConflictError",
    "ReservationEndedError",
    "ReservationInfo",
    "ReserveRefused",
    "StalenessError",
    "StalenessInventory",
    "UnknownReservationError",
    "VersionAbortedError",
    "VersionMismatchError",
]

TrajT = TypeVar("TrajT")


# --------------------------------------------------------------------------------------------- errors


class StalenessError(Exception):
    """Base class of every error raised by the staleness inventory."""


class InvalidArgumentError(StalenessError, ValueError):
    """An argument is out of its domain (negative η, batch size < 1, count > B, negative version...)."""


class InventoryClosedError(StalenessError):
    """The inventory was closed; it accepts no further calls."""


class ReserveRefused(StalenessError):
    """A reservation cannot be granted. Not a bug: the dispatcher waits, retries or syncs weights.

    Attributes name the prompt, the policy version asked for and the trainer version at refusal time.
    """

    def __init__(self, message: str, *, prompt_id: str, policy_version: int, trainer_version: int) -> None:
        super().__init__(message)
        self.prompt_id = prompt_id
        self.policy_version = policy_version
        self.trainer_version = trainer_version


class VersionAbortedError(ReserveRefused):
    """Permanent refusal: the policy version is at or below the highest aborted version.

    Rollouts still on that version must pull newer weights before they can be dispatched again.
    """

    def __init__(
        self, message: str, *, prompt_id: str, policy_version: int, trainer_version: int, highest_aborted: int
    ) -> None:
        super().__init__(message, prompt_id=prompt_id, policy_version=policy_version, trainer_version=trainer_version)
        self.highest_aborted = highest_aborted


class NoRoomError(ReserveRefused):
    """Transient refusal: every buffer in range is taken for now (reserved or occupied).

    Room appears when an in-flight rollout is aborted, or a new range opens after a consume.
    """


class InventoryMisuseError(StalenessError, ValueError):
    """The caller broke the protocol (wrong order, unknown prompt, inconsistent versions)."""

    def __init__(self, message: str, *, prompt_id: str | None = None) -> None:
        super().__init__(message)
        self.prompt_id = prompt_id


class UnknownReservationError(InventoryMisuseError):
    """Occupy, abort or renew for a prompt id that holds no reservation (never reserved, or forgotten)."""


class ReservationEndedError(InventoryMisuseError):
    """The prompt's reservation already ended; ``outcome`` is "occupied" or "aborted"."""

    def __init__(self, message: str, *, prompt_id: str, outcome: str) -> None:
        super().__init__(message, prompt_id=prompt_id)
        self.outcome = outcome


class DoubleOccupyError(ReservationEndedError):
    """Occupy after every reserved slot of the prompt was already occupied."""


class ReservationAbortedError(ReservationEndedError):
    """Occupy after the reservation was aborted (failed rollout, expired lease): delete the trajectory."""


class PromptReusedError(ReservationEndedError):
    """Reserve with the id of a prompt that already finished while its buffer is still live."""


class ReservationConflictError(InventoryMisuseError):
    """A repeated reserve for a live prompt id asks for a different policy version or count."""


class VersionMismatchError(InventoryMisuseError):
    """A policy version that cannot be right: newer than the trainer, or older than the reservation."""


class OutOfOrderError(InventoryMisuseError):
    """``consume(version)`` named a version other than the next one in order."""


# ------------------------------------------------------------------------------------------ value types


class BufferState(enum.Enum):
    """State of one buffer. Consumed buffers no longer exist."""

    OPEN = "open"
    """At least one slot is free."""
    STUCK = "stuck"
    """Every slot is taken but some are still reserved: waiting on in-flight rollouts."""
    READY = "ready"
    """All B slots are occupied: the trainer may consume it once every lower version is consumed."""


@dataclass(frozen=True, slots=True)
class Entry(Generic[TrajT]):
    """One stored trajectory and the policy version that generated it."""

    prompt_id: str
    trajectory: TrajT
    policy_version: int


@dataclass(frozen=True, slots=True)
class ReadyBatch(Generic[TrajT]):
    """A consumed buffer: ``version`` is the training version; entries are in completion order."""

    version: int
    entries: tuple[Entry[TrajT], ...]

    @property
    def trajectories(self) -> list[TrajT]:
        """The trajectories alone, in entry order."""
        return [e.trajectory for e in self.entries]

    @property
    def max_staleness(self) -> int:
        """Largest ``version - policy_version`` of the batch (at most η by construction)."""
        return max(self.version - e.policy_version for e in self.entries)


@dataclass(frozen=True, slots=True)
class Placement:
    """Result of ``occupy``.

    ``version`` is the buffer the trajectory landed in; ``ready`` says that buffer is now READY;
    ``aborted_versions`` lists the policy versions this placement newly aborted (ascending, possibly empty),
    for the manager to publish.
    """

    prompt_id: str
    version: int
    staleness: int
    ready: bool
    aborted_versions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AbortResult(Generic[TrajT]):
    """Result of ``abort``/``expire``: ``aborted_slots`` reservations ended; ``evicted`` members removed
    from their buffer (the caller deletes them, they will never be trained on)."""

    prompt_id: str
    version: int
    aborted_slots: int
    evicted: tuple[Entry[TrajT], ...]


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """Snapshot of one live buffer."""

    version: int
    occupied: int
    reserved: int
    free: int
    state: BufferState


@dataclass(frozen=True, slots=True)
class ReservationInfo:
    """Snapshot of one live prompt: ``buffer`` holds its ``reserved`` outstanding slots."""

    prompt_id: str
    policy_version: int
    count: int
    buffer: int
    reserved: int
    occupied: int
    deadline: float | None


@dataclass(frozen=True, slots=True)
class InventoryStats:
    """Gauges and monotonically increasing counters (``*_total``) for metrics and tests.

    Ledger invariants: ``reserved_total == occupied_total + aborted_total + reserved_slots`` (every reserved
    slot ends exactly once) and ``occupied_total == consumed_trajectories + evicted_total +
    discarded_total + occupied_slots`` (every stored trajectory leaves exactly once).
    """

    eta: int
    batch_size: int
    trainer_version: int
    highest_aborted: int
    live_prompts: int
    reserved_slots: int
    occupied_slots: int
    open_buffers: int
    stuck_buffers: int
    ready_buffers: int
    reserved_total: int
    occupied_total: int
    aborted_total: int
    evicted_total: int
    discarded_total: int
    expired_prompts_total: int
    consumed_batches_total: int
    consumed_trajectories: int
    refused_aborted_total: int
    refused_no_room_total: int


@dataclass(frozen=True, slots=True)
class CloseReport(Generic[TrajT]):
    """What ``close`` ended: the prompts whose reservations it aborted and every stored trajectory."""

    aborted_prompts: tuple[str, ...]
    aborted_slots: int
    discarded: tuple[Entry[TrajT], ...]


# ------------------------------------------------------------------------------------------- internals

_OCCUPIED = "occupied"
_ABORTED = "aborted"


@dataclass(slots=True)
class _Buffer(Generic[TrajT]):
    version: int
    reserved: int = 0
    entries: list[Entry[TrajT]] = field(default_factory=list)


@dataclass(slots=True)
class _Reservation:
    prompt_id: str
    policy_version: int
    count: int
    buffer: int
    reserved: int
    occupied: int = 0
    # Set by the first occupy: from then on the group stays in `buffer` so it is never split.
    placed: bool = False
    deadline: float | None = None


def _check_int(name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a batch size is always a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


# ------------------------------------------------------------------------------------------- inventory


class StalenessInventory(Generic[TrajT]):
    """Reserve / Occupy / Consume buffers with staleness bound ``eta`` (see the module docstring).

    Guarantees: every consumed trajectory has ``0 <= batch.version - policy_version <= eta``; batches are
    consumed in version order, each with exactly ``batch_size`` entries; every reserved slot ends exactly
    once, occupied or aborted; a group's members land in one batch.
    """

    def __init__(self, eta: int, batch_size: int, *, start_version: int = 0) -> None:
        """``eta`` >= 0 (0 = synchronous), ``batch_size`` >= 1 trajectories per batch, ``start_version``
        >= 0 the version of the initial weights (the first batch trains at it)."""
        self._eta = _check_int("eta", eta, minimum=0)
        self._batch_size = _check_int("batch_size", batch_size, minimum=1)
        self._start_version = _check_int("start_version", start_version, minimum=0)
        self._trainer_version = start_version
        # Highest f such that every buffer in [T, f] is READY (T - 1 when buffer T is not). Never decreases:
        # READY buffers stay READY until consumed, and consuming T moves T and the run's start together.
        self._ready_frontier = start_version - 1
        self._buffers: dict[int, _Buffer[TrajT]] = {}
        self._live: dict[str, _Reservation] = {}
        # Finished prompts, remembered (outcome, buffer version) until that version is consumed so late
        # duplicates get a precise error instead of being mistaken for new prompts.
        self._ended: dict[str, tuple[str, int]] = {}
        self._ended_by_version: dict[int, list[str]] = {}
        self._closed = False
        self._reserved_total = 0
        self._occupied_total = 0
        self._aborted_total = 0
        self._evicted_total = 0
        self._discarded_total = 0
        self._expired_total = 0
        self._consumed_batches = 0
        self._consumed_trajectories = 0
        self._refused_aborted = 0
        self._refused_no_room = 0

    # ------------------------------------------------------------------------------------- properties

    @property
    def eta(self) -> int:
        """The staleness bound η."""
        return self._eta

    @property
    def batch_size(self) -> int:
        """Trajectories per batch (B)."""
        return self._batch_size

    @property
    def trainer_version(self) -> int:
        """T: the version of the next batch ``consume`` hands out."""
        return self._trainer_version

    @property
    def highest_aborted(self) -> int:
        """Every policy version <= this one is aborted: its trajectories can no longer be placed.

        Starts at ``start_version - eta - 1`` (versions whose whole range lies before the first batch).
        """
        return self._ready_frontier - self._eta

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    # ----------------------------------------------------------------------------------------- protocol

    def reserve(self, prompt_id: str, policy_version: int, count: int = 1, *, deadline: float | None = None) -> int:
        """Reserve ``count`` slots (a group of that size) for a rollout starting at ``policy_version``.

        Returns the target training version: the highest buffer in [max(V, T), V + η] with ``count`` free
        slots. Idempotent per live prompt id (returns the buffer currently holding its slots).

        Raises ``VersionAbortedError`` (V <= ``highest_aborted``), ``NoRoomError`` (range full for now),
        ``VersionMismatchError`` (V > T), ``ReservationConflictError`` (repeat with other V or count),
        ``PromptReusedError`` (id of a finished prompt), ``InvalidArgumentError`` (count not in [1, B]).
        """
        self._check_open()
        _check_int("policy_version", policy_version, minimum=0)
        _check_int("count", count, minimum=1)
        if count > self._batch_size:
            raise InvalidArgumentError(
                f"prompt {prompt_id!r}: count {count} exceeds batch_size {self._batch_size}; "
                "a group must fit in one batch"
            )
        live = self._live.get(prompt_id)
        if live is not None:
            if live.policy_version != policy_version or live.count != count:
                raise ReservationConflictError(
                    f"prompt {prompt_id!r} already reserved {live.count} slot(s) at policy version "
                    f"{live.policy_version}; repeat asks {count} at version {policy_version}",
                    prompt_id=prompt_id,
                )
            return live.buffer
        ended = self._ended.get(prompt_id)
        if ended is not None:
            raise PromptReusedError(
                f"prompt {prompt_id!r} already finished ({ended[0]}, buffer {ended[1]}); prompt ids must be "
                "unique per dispatch",
                prompt_id=prompt_id,
                outcome=ended[0],
            )
        self._check_not_future(prompt_id, policy_version)
        if policy_version <= self.highest_aborted:
            self._refused_aborted += 1
            raise VersionAbortedError(
                f"prompt {prompt_id!r}: policy version {policy_version} is aborted (highest aborted "
                f"{self.highest_aborted}, trainer at {self._trainer_version}, eta {self._eta}); "
                "pull newer weights",
                prompt_id=prompt_id,
                policy_version=policy_version,
                trainer_version=self._trainer_version,
                highest_aborted=self.highest_aborted,
            )
        low = max(policy_version, self._trainer_version)
        for version in range(policy_version + self._eta, low - 1, -1):
            if self._room(version) >= count:
                self._buffer(version).reserved += count
                self._live[prompt_id] = _Reservation(
                    prompt_id=prompt_id,
                    policy_version=policy_version,
                    count=count,
                    buffer=version,
                    reserved=count,
                    deadline=deadline,
                )
                self._reserved_total += count
                return version
        self._refused_no_room += 1
        raise NoRoomError(
            f"prompt {prompt_id!r}: no buffer in [{low}, {policy_version + self._eta}] has {count} free "
            f"slot(s) for policy version {policy_version} (trainer at {self._trainer_version})",
            prompt_id=prompt_id,
            policy_version=policy_version,
            trainer_version=self._trainer_version,
        )

    def occupy(self, prompt_id: str, trajectory: TrajT, policy_version: int) -> Placement:
        """Store one completed trajectory of a reserved prompt; ends one of its reserved slots.

        The first member of a prompt moves all of its reserved slots to the lowest buffer in range with room
        for them; every member of the prompt then lands there. ``policy_version`` must lie between the
        reserved version and T. Raises ``UnknownReservationError``, ``DoubleOccupyError``,
        ``ReservationAbortedError`` or ``VersionMismatchError``; on error nothing changes.
        """
        self._check_open()
        _check_int("policy_version", policy_version, minimum=0)
        res = self._require_live(prompt_id, action="occupy")
        if policy_version < res.policy_version:
            # The range was computed from the reserved version; an older member could exceed the bound.
            raise VersionMismatchError(
                f"prompt {prompt_id!r}: occupy at policy version {policy_version} is older than its "
                f"reservation at version {res.policy_version}",
                prompt_id=prompt_id,
            )
        self._check_not_future(prompt_id, policy_version)
        if not res.placed:
            self._place(res)
        buf = self._buffers[res.buffer]
        buf.reserved -= 1
        buf.entries.append(Entry(prompt_id=prompt_id, trajectory=trajectory, policy_version=policy_version))
        res.reserved -= 1
        res.occupied += 1
        self._occupied_total += 1
        if res.reserved == 0:
            self._end(res, _OCCUPIED)
        ready = len(buf.entries) == self._batch_size
        aborted: tuple[int, ...] = ()
        if ready:
            aborted = self._advance_frontier()
        return Placement(
            prompt_id=prompt_id,
            version=buf.version,
            staleness=buf.version - policy_version,
            ready=ready,
            aborted_versions=aborted,
        )

    def consume(self, version: int | None = None) -> ReadyBatch[TrajT] | None:
        """Hand the trainer buffer T if it is READY and advance T; ``None`` when it is not READY yet.

        ``version``, when given, must equal T (``OutOfOrderError`` otherwise): a guard for a trainer that
        expects a specific step.
        """
        self._check_open()
        current = self._trainer_version
        if version is not None and version != current:
            raise OutOfOrderError(
                f"consume asked for version {version} but the next batch in order is version {current}"
            )
        buf = self._buffers.get(current)
        if buf is None or len(buf.entries) < self._batch_size:
            return None
        del self._buffers[current]
        self._trainer_version = current + 1
        for prompt_id in self._ended_by_version.pop(current, ()):
            self._ended.pop(prompt_id, None)
        self._consumed_batches += 1
        self._consumed_trajectories += len(buf.entries)
        return ReadyBatch(version=current, entries=tuple(buf.entries))

    def abort(self, prompt_id: str, *, keep_occupied: bool = False) -> AbortResult[TrajT]:
        """End every remaining reservation of a prompt (failed rollout or cancelled group).

        Its already occupied members are evicted and returned (unless ``keep_occupied``) so the caller
        deletes them. Raises ``UnknownReservationError`` or ``ReservationEndedError``.
        """
        self._check_open()
        res = self._require_live(prompt_id, action="abort")
        return self._abort(res, keep_occupied=keep_occupied)

    def renew(self, prompt_id: str, deadline: float | None) -> None:
        """Move the lease deadline of a live prompt (``None``: no lease)."""
        self._check_open()
        self._require_live(prompt_id, action="renew").deadline = deadline

    def expire(self, now: float) -> list[AbortResult[TrajT]]:
        """Abort (evicting occupied members) every live prompt whose deadline is <= ``now``.

        Results are ordered by deadline, then prompt id.
        """
        self._check_open()
        due = sorted(
            (r.deadline, r.prompt_id) for r in self._live.values() if r.deadline is not None and r.deadline <= now
        )
        self._expired_total += len(due)
        return [self._abort(self._live[prompt_id], keep_occupied=False) for _, prompt_id in due]

    def advance(self, version: int) -> CloseReport[TrajT]:
        """Weights ``version`` were committed: T becomes ``version`` when it is behind (a trainer that does
        not ``consume`` through this inventory); nothing happens otherwise (``consume`` already moved T).

        Buffers below the new T can never be consumed in order: their live reservations are aborted
        (evicting what they occupied) and their other trajectories discarded; both are returned.
        """
        self._check_open()
        _check_int("version", version, minimum=0)
        if version <= self._trainer_version:
            return CloseReport(aborted_prompts=(), aborted_slots=0, discarded=())
        report = self._drop(lambda buffer: buffer < version)
        self._trainer_version = version
        self._ready_frontier = max(self._ready_frontier, version - 1)
        self._advance_frontier()
        return report

    def rewind(self, version: int) -> CloseReport[TrajT]:
        """A trainer world restarted from its checkpoint of step ``version`` (a new lineage of versions): T
        becomes ``version`` and every buffer is dropped (its trajectories may come from versions the new
        lineage replaces): live reservations aborted, trajectories discarded, both returned. The one case
        where T and ``highest_aborted`` go back."""
        self._check_open()
        _check_int("version", version, minimum=0)
        report = self._drop(lambda buffer: True)
        self._trainer_version = version
        self._ready_frontier = version - 1
        return report

    def _drop(self, doomed: Callable[[int], bool]) -> CloseReport[TrajT]:
        aborted = [self._abort(res, keep_occupied=False) for res in list(self._live.values()) if doomed(res.buffer)]
        discarded: list[Entry[TrajT]] = []
        for version in sorted(v for v in self._buffers if doomed(v)):
            discarded += self._buffers.pop(version).entries
        for version in [v for v in self._ended_by_version if doomed(v)]:
            for prompt_id in self._ended_by_version.pop(version):
                self._ended.pop(prompt_id, None)
        self._discarded_total += len(discarded)
        return CloseReport(aborted_prompts=tuple(a.prompt_id for a in aborted),
                           aborted_slots=sum(a.aborted_slots for a in aborted),
                           discarded=tuple(e for a in aborted for e in a.evicted) + tuple(discarded))

    def close(self) -> CloseReport[TrajT]:
        """End the run: abort every live reservation, return every stored trajectory, refuse later calls."""
        self._check_open()
        prompts = tuple(sorted(self._live))
        slots = sum(r.reserved for r in self._live.values())
        discarded = tuple(e for v in sorted(self._buffers) for e in self._buffers[v].entries)
        self._aborted_total += slots
        self._discarded_total += len(discarded)
        self._live.clear()
        self._buffers.clear()
        self._ended.clear()
        self._ended_by_version.clear()
        self._closed = True
        return CloseReport(aborted_prompts=prompts, aborted_slots=slots, discarded=discarded)

    # ------------------------------------------------------------------------------------ introspection

    def capacity(self, policy_version: int) -> int:
        """Free slots a reservation at ``policy_version`` could use now, summed over its range (0 when the
        version is aborted). For admission control; a group also needs them in one buffer."""
        self._check_open()
        _check_int("policy_version", policy_version, minimum=0)
        if policy_version <= self.highest_aborted or policy_version > self._trainer_version:
            return 0
        return sum(self._room(v) for v in range(self._trainer_version, policy_version + self._eta + 1))

    def buffers(self) -> list[BufferInfo]:
        """Snapshots of the live buffers (any slot reserved or occupied), by ascending version."""
        return [self._info(self._buffers[v]) for v in sorted(self._buffers)]

    def reservation(self, prompt_id: str) -> ReservationInfo | None:
        """Snapshot of a live prompt, or ``None`` when it holds no reservation."""
        res = self._live.get(prompt_id)
        if res is None:
            return None
        return ReservationInfo(
            prompt_id=res.prompt_id,
            policy_version=res.policy_version,
            count=res.count,
            buffer=res.buffer,
            reserved=res.reserved,
            occupied=res.occupied,
            deadline=res.deadline,
        )

    def stats(self) -> InventoryStats:
        """Gauges and counters; see ``InventoryStats`` for the ledger invariants."""
        states = [self._state(b) for b in self._buffers.values()]
        return InventoryStats(
            eta=self._eta,
            batch_size=self._batch_size,
            trainer_version=self._trainer_version,
            highest_aborted=self.highest_aborted,
            live_prompts=len(self._live),
            reserved_slots=sum(b.reserved for b in self._buffers.values()),
            occupied_slots=sum(len(b.entries) for b in self._buffers.values()),
            open_buffers=states.count(BufferState.OPEN),
            stuck_buffers=states.count(BufferState.STUCK),
            ready_buffers=states.count(BufferState.READY),
            reserved_total=self._reserved_total,
            occupied_total=self._occupied_total,
            aborted_total=self._aborted_total,
            evicted_total=self._evicted_total,
            discarded_total=self._discarded_total,
            expired_prompts_total=self._expired_total,
            consumed_batches_total=self._consumed_batches,
            consumed_trajectories=self._consumed_trajectories,
            refused_aborted_total=self._refused_aborted,
            refused_no_room_total=self._refused_no_room,
        )

    # ---------------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise InventoryClosedError("the staleness inventory is closed")

    def _check_not_future(self, prompt_id: str, policy_version: int) -> None:
        if policy_version > self._trainer_version:
            raise VersionMismatchError(
                f"prompt {prompt_id!r}: policy version {policy_version} is newer than the trainer version "
                f"{self._trainer_version}; such weights do not exist yet",
                prompt_id=prompt_id,
            )

    def _require_live(self, prompt_id: str, *, action: str) -> _Reservation:
        res = self._live.get(prompt_id)
        if res is not None:
            return res
        ended = self._ended.get(prompt_id)
        if ended is None:
            raise UnknownReservationError(
                f"{action} for prompt {prompt_id!r}, which holds no reservation", prompt_id=prompt_id
            )
        outcome, version = ended
        message = f"{action} for prompt {prompt_id!r}, whose reservation already ended ({outcome}, buffer {version})"
        if action == "occupy":
            error = DoubleOccupyError if outcome == _OCCUPIED else ReservationAbortedError
            raise error(message, prompt_id=prompt_id, outcome=outcome)
        raise ReservationEndedError(message, prompt_id=prompt_id, outcome=outcome)

    def _room(self, version: int) -> int:
        buf = self._buffers.get(version)
        if buf is None:
            return self._batch_size
        return self._batch_size - buf.reserved - len(buf.entries)

    def _buffer(self, version: int) -> _Buffer[TrajT]:
        buf = self._buffers.get(version)
        if buf is None:
            buf = self._buffers[version] = _Buffer(version=version)
        return buf

    def _drop_if_empty(self, version: int) -> None:
        # Absent means empty, so empty buffers are not kept: memory follows the live slots only.
        buf = self._buffers.get(version)
        if buf is not None and buf.reserved == 0 and not buf.entries:
            del self._buffers[version]

    def _place(self, res: _Reservation) -> None:
        # Lowest buffer with room for the whole remaining group; the group's own buffer qualifies once its
        # slots are released, so the search always succeeds and never goes above it.
        old = res.buffer
        self._buffers[old].reserved -= res.reserved
        target = next(v for v in range(self._trainer_version, old + 1) if self._room(v) >= res.reserved)
        self._buffer(target).reserved += res.reserved
        res.buffer = target
        res.placed = True
        self._drop_if_empty(old)

    def _abort(self, res: _Reservation, *, keep_occupied: bool) -> AbortResult[TrajT]:
        buf = self._buffers[res.buffer]
        buf.reserved -= res.reserved
        evicted: tuple[Entry[TrajT], ...] = ()
        if res.occupied and not keep_occupied:
            evicted = tuple(e for e in buf.entries if e.prompt_id == res.prompt_id)
            buf.entries = [e for e in buf.entries if e.prompt_id != res.prompt_id]
            self._evicted_total += len(evicted)
        slots = res.reserved
        self._aborted_total += slots
        res.reserved = 0
        self._end(res, _ABORTED)
        self._drop_if_empty(buf.version)
        return AbortResult(prompt_id=res.prompt_id, version=buf.version, aborted_slots=slots, evicted=evicted)

    def _end(self, res: _Reservation, outcome: str) -> None:
        del self._live[res.prompt_id]
        self._ended[res.prompt_id] = (outcome, res.buffer)
        self._ended_by_version.setdefault(res.buffer, []).append(res.prompt_id)

    def _advance_frontier(self) -> tuple[int, ...]:
        before = self.highest_aborted
        nxt = self._ready_frontier + 1
        while (buf := self._buffers.get(nxt)) is not None and len(buf.entries) == self._batch_size:
            nxt += 1
        self._ready_frontier = nxt - 1
        # Versions below the initial weights never existed, so they are not reported.
        return tuple(range(max(before + 1, self._start_version), self.highest_aborted + 1))

    def _state(self, buf: _Buffer[TrajT]) -> BufferState:
        taken = buf.reserved + len(buf.entries)
        if len(buf.entries) == self._batch_size:
            return BufferState.READY
        if taken == self._batch_size:
            return BufferState.STUCK
        return BufferState.OPEN

    def _info(self, buf: _Buffer[TrajT]) -> BufferInfo:
        occupied = len(buf.entries)
        return BufferInfo(
            version=buf.version,
            occupied=occupied,
            reserved=buf.reserved,
            free=self._batch_size - occupied - buf.reserved,
            state=self._state(buf),
        )
