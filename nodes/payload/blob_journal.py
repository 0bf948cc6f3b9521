"""An env server's blobs in a :class:`~refbus.nodes.store.durable.DurableStore`: what each change of its
:class:`~.keeper.Keeper` commits, and how a restarted env server re-adopts what an earlier process kept.

Every blob's bytes live in a segment of the store; the keeper's arrays are read-only views of it. Records
(one per change, committed before the change is answered):

=============== ===================================================================================
``keep``        an episode's blobs (id, segment and layout of each; segments written before the record),
                its ``episode-finished`` record (arrays in ``info`` are kept as lists) and the record's
                ``charge`` against the budget (records of earlier builds have none: charged their ``info``
                as replayed)
``claim``       blob ids moved to ``holder`` by a claim
``move``        blob ids handed over to ``holder`` (a ``reference`` event)
``drop``        blob ids deleted by ``holder`` for ``reason`` (their segments are unlinked after); ``ep``: the
                episode a discard deleted them of (absent for any other delete)
``violation``   ``n`` violations of ``action`` refused (the ledger's counters stay exact)
``counters``    a compacted journal's totals (kept, deleted by reason, violations, reclaimed)
``holder-down`` ``holder`` was reported down (``inc``: the incarnation that went down, host, pid and start
                time, or null), a grace starting: its blobs are reclaimed once it ends (``until``: when, on the
                wall clock, ``time.time()``), by this process or a restarted one, which gives what is left of
                it (:func:`resumed_grace`). One for a holder already down (another incarnation, a restarted
                one that died in the grace) starts a fresh grace with nothing claimed again, cutting the
                earlier one short. Records of earlier builds have no ``until``: their grace is given whole
``again``       blob ids ``holder``, reported down and in its grace, claimed again (its restarted
                incarnation's: a restarted store resuming the grace keeps them for it)
``holder-back`` ``holder`` came back as the incarnation its last ``holder-down`` named: the grace that record
                cut short resumes, with its end and what was claimed again in either
``holder-settled`` ``holder``'s grace ended, at its deadline or cut short by a new process that claims nothing
                back (what it had not claimed again was reclaimed), or it came back as
                the same process: nothing is left to resume for it
``holder-seen`` the process ``holder`` was (``inc``) when it took blobs here, written when that changes: a
                restarted store that finds another process live under the id knows the holder restarted
                while the store was dead, though no ``node-down`` reached it
=============== ===================================================================================

:meth:`BlobJournal.readopt` replays them into a fresh keeper: blobs live at the end whose segment fails
verification, or that exceed the budget or the blob cap, are *lost*: deleted with reason ``lost`` and named in
the result.
Segments no committed ``keep`` names (a keep cut off before its commit flag) are removed and counted as
*aborted*: that keep was never acknowledged, so its run failed and is sent again. Deleted ids keep their
tombstones, so a repeated delete by the same holder across the restart is answered, not refused.

A holder record (``holder-down``, ``again``, ``holder-back``, ``holder-settled``, ``holder-seen``) whose fields do
not parse (a ``holder-down`` whose ``until`` is not a finite number of seconds since the epoch, say) is skipped,
as if never written, and the rest of the journal replayed: these records only decide which of a dead holder's
blobs are reclaimed, and when.

Not thread-safe: the env server calls it under its keeper lock, except :meth:`BlobJournal.write`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from ...protocol.messages import EpisodeFinished, Violation
from ..store.durable import DurableStore, Segment, StoreFull
from .charges import blob_charge
from .keeper import LOST, RETRY_AFTER_S, DeleteResult, Keeper, KeepError, PackedBranch

# A grace a restarted store resumes is never shorter than this share of a whole one. The holder's restarted
# incarnation may have tried to claim back while this store was dead, and those claims failed: it sends them
# again, re-located, once it learns of the restarted process (StoreRestarts: every 0.1 s, for a whole grace
# after its first send). That takes the process's node-up through the broker, for a claim left pending against
# the dead process the end of its request attempt (requests.timeout_s, 2 s by default), then the resend and
# its answer. A share of the grace, not a fixed time, so it scales with what the operator gave holders to come
# back and never exceeds it: a quarter is 2.5 s at the default 10 s, room for that, while a restart lengthens a
# grace only when it comes in its last quarter or after its end, and then to a quarter grace past that restart.
MIN_RESUMED_GRACE_SHARE = 0.25
COMPACT_MIN_RECORDS = 4096  # records since the last compaction before one is due (DurableStore.compact_due)
IDS_PER_RECORD = 65_536  # blob ids in one claim, move or drop record, at most (ids are under 256 bytes)


@dataclass(frozen=True, slots=True)
class Readoption:
    """What a restart found: ``blobs`` re-adopted live; ``lost`` (blob id -> why) deleted with reason ``lost``;
    ``aborted`` segments of keeps never committed; ``damaged``: the journal's damage ("" if none)."""

    blobs: int
    bytes: int
    lost: Mapping[str, str]
    aborted: int
    damaged: str
    seconds: float
    holders_down: Mapping[str, tuple[str, int, float] | None]  # holder -> the incarnation reported down
    # holder reported down -> when its grace ends, wall clock (None: a record of an earlier build, without it)
    grace_ends: Mapping[str, float | None]
    claimed_again: Mapping[str, frozenset[str]]  # holder reported down -> blob ids it claimed again since
    holders_seen: Mapping[str, tuple[str, int, float]]  # holder -> the incarnation that took blobs here last
    # holder reported down as another incarnation within a grace -> the grace that cut short: the incarnation
    # reported down before, what was claimed again in it and when it ends (as ``grace_ends``)
    earlier_down: Mapping[str, tuple[tuple[str, int, float] | None, frozenset[str], float | None]]
    episodes: frozenset[str]  # episodes with a blob re-adopted live: kept by an earlier process of this store


class BlobJournal:
    """Commits a keeper's changes to ``store`` (see the module doc). ``wall_clock``: the clock a grace's end is
    journaled on (``time.time``: it must mean the same to the next process, maybe after a reboot, which a
    monotonic clock does not)."""

    def __init__(self, store: DurableStore, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.wall_clock = wall_clock
        self._layouts: dict[str, dict[str, Any]] = {}  # live blob id -> its committed layout (names its segment)
        # Holders reported down whose reclaim is still to come, and what each claimed again since (kept through
        # compactions); for one reported down again as another incarnation, the grace that cut short.
        self.holders_down: dict[str, tuple[str, int, float] | None] = {}
        self.claimed_again: dict[str, set[str]] = {}
        self.grace_ends: dict[str, float | None] = {}  # wall clock; None: replayed from a record without one
        self.earlier_down: dict[str, tuple[tuple[str, int, float] | None, set[str], float | None]] = {}
        self.holders_seen: dict[str, tuple[str, int, float]] = {}

    # --- writing (any thread) -----------------------------------------------------------------------

    def write(self, packed: Sequence[PackedBranch]) -> list[PackedBranch]:
        """Copy each packed branch into a segment; the same branches, viewing their segments. Nothing is
        committed yet (:meth:`kept` does).

        Raises:
            KeepError: ``over-budget`` with a retry-after when the tmpfs has no room (nothing is left);
                ``closed`` once a shutdown removed the store; ``store-failed`` for any other error of the
                file system (nothing is left either).
        """
        written: list[PackedBranch] = []
        try:
            for branch in packed:
                written.append(_view(self.store.write(branch.buffer), branch))
        except StoreFull as exc:
            self.store.unlink(b.segment for b in written)
            raise KeepError("over-budget", f"{exc}; retry after {RETRY_AFTER_S} s",
                            retry_after_s=RETRY_AFTER_S) from None
        except FileNotFoundError:  # the store was closed and removed meanwhile: a shutdown
            raise KeepError("closed", "the env server is shutting down") from None
        except OSError as exc:  # EIO, EMFILE, ENOMEM from a mapping: nothing of the keep may stay behind
            self.store.unlink(b.segment for b in written)
            raise KeepError("store-failed", f"the store could not write the blob: {exc}") from None
        return written

    def discard(self, packed: Sequence[PackedBranch]) -> None:
        """Remove the segments of branches :meth:`write` wrote that the keeper refused."""
        self.store.unlink(b.segment for b in packed if b.segment)

    # --- committing (under the keeper's lock) -------------------------------------------------------

    def kept(self, record: EpisodeFinished, packed: Sequence[PackedBranch], charge: int) -> None:
        """An episode kept: its blobs (``record.refs``, viewing ``packed``) and its record, charged ``charge``
        against the budget (:func:`~.charges.info_charge` of its ``info`` as it came), in one commit."""
        layouts = [_layout(ref.blob_id, branch) for ref, branch in zip(record.refs, packed, strict=True)]
        self.store.commit(_keep(record.episode_id, layouts, record, charge))
        self._layouts.update((layout["id"], layout) for layout in layouts)

    def claimed(self, blob_ids: Sequence[str], holder: str) -> None:
        for ids in _runs(blob_ids):
            self.store.commit({"op": "claim", "ids": ids, "holder": holder})

    def moved(self, blob_ids: Sequence[str], holder: str) -> None:
        for ids in _runs(blob_ids):
            self.store.commit({"op": "move", "ids": ids, "holder": holder})

    def dropped(self, result: DeleteResult) -> None:
        """Commit ``result``'s deletes (before the keeper makes them: :data:`~.keeper.Commit`); :meth:`released`
        unlinks their segments once it made them."""
        for ids in _runs(result.deleted):
            self.store.commit(_drop_record(ids, result.holder, result.reason, result.episode))

    def released(self, result: DeleteResult) -> None:
        """Unlink the segments of ``result``'s deletes, committed and made (the keeper's views stay valid). Only
        then: a blob the keeper still holds keeps its layout, which a compaction writes."""
        self.store.unlink(self._layouts.pop(blob_id)["segment"] for blob_id in result.deleted
                          if blob_id in self._layouts)

    def holder_down(self, holder: str, incarnation: tuple[str, int, float] | None, grace_s: float) -> None:
        """``holder`` was reported down (``incarnation``: the process that went down, None when unknown), a grace
        of ``grace_s`` from now starting (:meth:`~.keeper.Keeper.holder_down`): its first, or a fresh one that
        cuts short the grace of the incarnation reported down before. Its end is journaled on the wall clock. The
        process already recorded down is a repeat (a change sent again after a later record of it failed): nothing
        is written, so the grace recorded first, with what was claimed again in it, stands."""
        if holder in self.holders_down and self.holders_down[holder] == incarnation:
            return
        until = self.wall_clock() + grace_s
        self.store.commit(_down_record(holder, incarnation, until))
        self._went_down(holder, incarnation, until)

    def holder_seen(self, holder: str, incarnation: tuple[str, int, float]) -> bool:
        """``holder`` is process ``incarnation`` as it takes blobs here: committed when that changed (True)."""
        if self.holders_seen.get(holder) == incarnation:
            return False
        self.store.commit(_holder_record("holder-seen", holder, incarnation))
        self.holders_seen[holder] = incarnation
        return True

    def claimed_back(self, blob_ids: Sequence[str], holder: str) -> None:
        """``holder``, reported down and in its grace, claimed ``blob_ids`` again (a claim's ``again``)."""
        if blob_ids and holder in self.holders_down:
            for ids in _runs(blob_ids):
                self.store.commit({"op": "again", "ids": ids, "holder": holder})
            self.claimed_again[holder].update(blob_ids)

    def holder_back(self, holder: str) -> None:
        """``holder`` is back as the process last reported down (:meth:`~.keeper.Keeper.holder_back`): the grace
        that report cut short resumes (``holder-back``), or there is none and it is settled."""
        if holder not in self.earlier_down:
            self.holder_settled(holder)
            return
        self.store.commit({"op": "holder-back", "holder": holder})
        self._came_back(holder)

    def holder_settled(self, holder: str) -> None:
        """``holder`` is back as the same process, or its grace ended: nothing to resume for it. Committed: a
        restarted store that found only the ``holder-down`` record would give the holder, live as a newer
        process that took back what it wanted long ago, the grace anew, and reclaim what it holds."""
        if holder in self.holders_down:
            self.store.commit({"op": "holder-settled", "holder": holder})
            self._settled(holder)

    def violated(self, violations: Sequence[Violation]) -> None:
        for action, n in Counter(v.action for v in violations).items():
            self.store.commit({"op": "violation", "action": action, "n": n})

    def compact_due(self, keeper: Keeper) -> bool:
        return self.store.compact_due(keeper.blobs_held, COMPACT_MIN_RECORDS)

    def compact(self, keeper: Keeper) -> None:
        """Rewrite the journal as the keeper's state now (atomic: the old journal or the new one)."""
        held = keeper.claimed()
        self.holders_seen = {holder: seen for holder, seen in self.holders_seen.items() if holder in held}
        self.store.compact(_snapshot(keeper, held, self._layouts, self.holders_down, self.claimed_again,
                                     self.grace_ends, self.earlier_down, self.holders_seen))

    def close(self, *, remove: bool) -> None:
        self.store.close(remove=remove)

    # --- re-adoption --------------------------------------------------------------------------------

    def readopt(self, keeper: Keeper) -> Readoption:
        """Replay the store's journal into ``keeper`` (fresh, nothing kept yet), then drop as ``lost`` what
        fails verification or exceeds the budget (committed, so the keeper's counters carry the loss), remove
        segments of keeps never committed, and compact when the journal has grown or was cut. The lost ids
        are named in the result; the caller publishes their deletes."""
        started = time.perf_counter()
        replay = self.store.replay
        live = _live_at_end(replay.records)
        broken: dict[str, str] = {}
        for record in replay.records:
            op = record.get("op")
            if op == "keep":
                for layout in record["blobs"]:
                    blob_id = layout["id"]
                    found = self.store.segment(layout["segment"]) if blob_id in live else None
                    if isinstance(found, str):
                        broken[blob_id] = found
                    packed = _packed(layout, found if isinstance(found, Segment) else None)
                    keeper.restore(record["ep"], blob_id, packed)
                    self._layouts[blob_id] = layout
                if record.get("rec"):
                    charge = record.get("charge")
                    keeper.restore_record(msgspec.msgpack.decode(record["rec"], type=EpisodeFinished),
                                          charge if isinstance(charge, int) else None)
            elif op == "claim":
                keeper.claim(record["ids"], record["holder"])
            elif op == "move":
                keeper.hand_over(record["ids"], record["holder"], by_holder=False)  # ``again`` records say
            elif op == "drop":
                episode = record.get("ep", "")  # a discard's (an earlier build's records have none)
                keeper.restore_drop(record["ids"], record["holder"], record["reason"],
                                    episode if isinstance(episode, str) else "")
                for blob_id in record["ids"]:
                    self._layouts.pop(blob_id, None)
            elif op == "violation":
                keeper.violations[record["action"]] += record["n"]
            elif op == "counters":
                keeper.restore_counters(record["kept"], record["deleted"], record["violations"], record["reclaimed"])
            elif op == "holder-down" and (down := _holder_down(record)) is not None:
                self._went_down(*down)
            elif op == "holder-seen" and (seen := _holder_incarnation(record)) is not None and seen[1] is not None:
                self.holders_seen[seen[0]] = seen[1]
            elif op == "again" and (again := _claimed_again(record)) is not None and again[0] in self.holders_down:
                self.claimed_again[again[0]].update(again[1])
            elif op == "holder-back" and isinstance(holder := record.get("holder"), str) \
                    and holder in self.earlier_down:
                self._came_back(holder)
            elif op == "holder-settled" and isinstance(holder := record.get("holder"), str):
                self._settled(holder)
        keeper.adopt_tombstones()
        over = _over_budget(keeper, broken)
        broken.update(over)
        if broken:
            lost = keeper.restore_drop(list(broken), keeper.source, LOST)
            self.dropped(lost)
            self.released(lost)
        aborted = self.store.sweep(layout["segment"] for layout in self._layouts.values())
        if self.compact_due(keeper) or replay.uncommitted is not None or replay.damaged:
            self.compact(keeper)
        return Readoption(keeper.blobs_held, keeper.bytes_held, broken, len(aborted), replay.damaged,
                          time.perf_counter() - started, dict(self.holders_down), dict(self.grace_ends),
                          {holder: frozenset(ids) for holder, ids in self.claimed_again.items()},
                          dict(self.holders_seen),
                          {holder: (down, frozenset(ids), until)
                           for holder, (down, ids, until) in self.earlier_down.items()},
                          frozenset(episode for _, episode, _, _ in keeper.blobs()))

    # --- holders down: the state a live change and its replay share ----------------------------------

    def _went_down(self, holder: str, incarnation: tuple[str, int, float] | None, until: float | None) -> None:
        """A grace ending at ``until`` (wall clock; None: unknown) starts with nothing claimed again; a holder
        already down keeps the grace this one cuts short (only that one: see :meth:`~.keeper.Keeper.holder_down`)."""
        if holder in self.holders_down:
            self.earlier_down[holder] = (self.holders_down[holder], self.claimed_again[holder],
                                         self.grace_ends[holder])
        self.holders_down[holder] = incarnation
        self.claimed_again[holder] = set()
        self.grace_ends[holder] = until

    def _came_back(self, holder: str) -> None:
        """The grace ``holder``'s last report cut short resumes, with its end and what was claimed again in
        either."""
        incarnation, again, until = self.earlier_down.pop(holder)
        self.holders_down[holder] = incarnation
        self.claimed_again[holder] = again | self.claimed_again[holder]
        self.grace_ends[holder] = until

    def _settled(self, holder: str) -> None:
        self.holders_down.pop(holder, None)
        self.claimed_again.pop(holder, None)
        self.grace_ends.pop(holder, None)
        self.earlier_down.pop(holder, None)


def resumed_grace(until: float | None, now: float, grace_s: float) -> float:
    """The grace a restarted store gives a holder whose journaled grace ends at ``until`` (wall clock, as
    ``now``): what is left of it, at most ``grace_s`` (a wall clock set back since the record was written must
    not lengthen it past a whole grace from now) and at least :data:`MIN_RESUMED_GRACE_SHARE` of ``grace_s``
    (past its end, or a clock set forward: the holder gets a last chance to claim back what its claims failed
    to while the store was dead). ``until`` None (a record of an earlier build): the whole grace, as those
    builds gave it."""
    if until is None:
        return grace_s
    return min(grace_s, max(grace_s * MIN_RESUMED_GRACE_SHARE, until - now))


def _layout(blob_id: str, branch: PackedBranch) -> dict[str, Any]:
    base = branch.buffer.ctypes.data
    return {"id": blob_id, "segment": branch.segment, "tokens": branch.tokens, "nbytes": branch.nbytes,
            "checksum": branch.checksum, "routing": list(branch.routing_shape) if branch.routing_shape else None,
            "fields": [[name, a.dtype.str, list(a.shape), a.ctypes.data - base] for name, a in branch.arrays.items()]}


def _view(segment: Segment, branch: PackedBranch) -> PackedBranch:
    """``branch`` with its arrays viewing ``segment`` (same layout) instead of its private buffer."""
    layout = _layout("", branch)
    return replace(_packed({**layout, "segment": segment.name}, segment), digests=branch.digests)


def _packed(layout: Mapping[str, Any], segment: Segment | None) -> PackedBranch:
    """A packed branch from its committed layout, viewing ``segment`` (None: a placeholder without arrays,
    for a blob that is lost or deleted later in the journal)."""
    arrays: dict[str, np.ndarray] = {}
    buffer = segment.data if segment is not None else np.empty(0, np.uint8)
    if segment is not None:
        for name, dtype, shape, offset in layout["fields"]:
            dt = np.dtype(dtype)
            count = math.prod(shape)
            arrays[name] = buffer[offset : offset + count * dt.itemsize].view(dt).reshape(shape)
    routing = layout["routing"]
    return PackedBranch(arrays=arrays, buffer=buffer, tokens=layout["tokens"], nbytes=layout["nbytes"],
                        checksum=layout["checksum"], routing_shape=tuple(routing) if routing else None,
                        segment=layout["segment"])


def _live_at_end(records: Sequence[Mapping[str, Any]]) -> set[str]:
    live: set[str] = set()
    for record in records:
        if record.get("op") == "keep":
            live.update(layout["id"] for layout in record["blobs"])
        elif record.get("op") == "drop":
            live.difference_update(record["ids"])
    return live


def _over_budget(keeper: Keeper, broken: Mapping[str, str]) -> dict[str, str]:
    """The newest live blobs beyond the keeper's budget or its blob cap (a restart under a smaller one): lost,
    named. A blob dropped frees its charge, the last of its episode's its record's too."""
    blobs = list(keeper.blobs())
    left = Counter(episode_id for blob_id, episode_id, _, _ in blobs if blob_id not in broken)
    count = len(blobs) - len(broken)
    freed = sum(blob_charge(packed.nbytes) for blob_id, _, _, packed in blobs if blob_id in broken)
    freed += sum(keeper.charge_of(episode_id) for episode_id in {e for _, e, _, _ in blobs} if not left[episode_id])
    excess = keeper.bytes_held - keeper.budget_bytes - freed
    cap = keeper.max_blobs if keeper.max_blobs is not None else count
    over: dict[str, str] = {}
    for blob_id, episode_id, _, packed in reversed(blobs):
        if excess <= 0 and count <= cap:
            break
        if blob_id not in broken:
            over[blob_id] = (f"over env_server.budget_bytes = {keeper.budget_bytes}" if excess > 0 else
                             f"over the store's cap of {cap} blobs") + " after the restart"
            excess -= blob_charge(packed.nbytes)
            count -= 1
            left[episode_id] -= 1
            if not left[episode_id]:
                excess -= keeper.charge_of(episode_id)
    return over


def _holder_record(op: str, holder: str, incarnation: tuple[str, int, float] | None) -> dict[str, Any]:
    return {"op": op, "holder": holder, "inc": list(incarnation) if incarnation else None}


def _down_record(holder: str, incarnation: tuple[str, int, float] | None, until: float | None) -> dict[str, Any]:
    """A ``holder-down`` record; one whose end is unknown (replayed from an earlier build's) is written without
    ``until`` again, so it still replays as such."""
    record = _holder_record("holder-down", holder, incarnation)
    if until is not None:
        record["until"] = until
    return record


def _holder_down(record: Mapping[str, Any]) -> tuple[str, tuple[str, int, float] | None, float | None] | None:
    """A ``holder-down`` record's (holder, incarnation, end of its grace on the wall clock: None for a record of
    an earlier build, which has no ``until``); None for one whose fields do not parse, ``until`` included (a
    bool, or not a finite number of seconds since the epoch): skipped, as :func:`_holder_incarnation` says."""
    down = _holder_incarnation(record)
    if down is None:
        return None
    if "until" not in record:
        return (*down, None)
    until = record["until"]
    if isinstance(until, bool) or not isinstance(until, int | float) or not math.isfinite(until) or until < 0:
        return None
    return (*down, float(until))


def _holder_incarnation(record: Mapping[str, Any]) -> tuple[str, tuple[str, int, float] | None] | None:
    """A ``holder-down`` or ``holder-seen`` record's (holder, incarnation); None for one whose fields do not
    parse (either only decides whether a dead holder's blobs are reclaimed: skipped, they stay with their
    holder as before)."""
    holder, inc = record.get("holder"), record.get("inc")
    if not isinstance(holder, str) or not holder:
        return None
    if inc is None:
        return holder, None
    if isinstance(inc, list) and len(inc) == 3 and isinstance(inc[0], str) and isinstance(inc[1], int) \
            and isinstance(inc[2], int | float):
        return holder, (inc[0], inc[1], float(inc[2]))
    return None


def _claimed_again(record: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    """An ``again`` record's (holder, blob ids); None for one whose fields do not parse (skipped: those blobs
    are then reclaimed with the rest of what the holder held when its grace ends, as before such records)."""
    holder, ids = record.get("holder"), record.get("ids")
    if isinstance(holder, str) and holder and isinstance(ids, list) and all(isinstance(i, str) for i in ids):
        return holder, ids
    return None


def _snapshot(keeper: Keeper, holders: Mapping[str, list[str]], layouts: Mapping[str, dict[str, Any]],
              holders_down: Mapping[str, tuple[str, int, float] | None],
              claimed_again: Mapping[str, set[str]],
              grace_ends: Mapping[str, float | None],
              earlier_down: Mapping[str, tuple[tuple[str, int, float] | None, set[str], float | None]],
              holders_seen: Mapping[str, tuple[str, int, float]]) -> Iterator[dict[str, Any]]:
    """The keeper's state as journal records: live blobs with their holders (``holders``: its
    :meth:`~.keeper.Keeper.claimed`), records, tombstones, totals, holders reported down that still hold blobs
    here, with what each claimed again and when its grace ends (after the grace a later report cut short, as they
    replay), and the process each holder was when it last took blobs here (``holders_seen``: pruned to
    ``holders`` by the caller)."""
    episodes: dict[str, list[dict[str, Any]]] = {}
    for blob_id, episode_id, _, _ in keeper.blobs():
        episodes.setdefault(episode_id, []).append(layouts[blob_id])
    for episode_id, layouts in episodes.items():
        yield _keep(episode_id, layouts, keeper.record_of(episode_id), keeper.charge_of(episode_id))
    for holder, held in holders.items():
        for ids in _runs(held):
            yield {"op": "claim", "ids": ids, "holder": holder}
    for blob_id, holder, reason, episode in keeper.tombstones():
        yield _drop_record([blob_id], holder, reason, episode)
    stats = keeper.stats()
    yield {"op": "counters", "kept": stats.kept_total, "deleted": dict(stats.deleted),
           "violations": dict(stats.violations), "reclaimed": dict(stats.reclaimed)}
    for holder, seen in holders_seen.items():
        yield _holder_record("holder-seen", holder, seen)
    for holder, incarnation in holders_down.items():
        if holder in holders:
            graces = [earlier_down[holder]] if holder in earlier_down else []
            for down, again, until in [*graces, (incarnation, claimed_again.get(holder, set()), grace_ends[holder])]:
                yield _down_record(holder, down, until)
                for ids in _runs(sorted(again.intersection(holders[holder]))):
                    yield {"op": "again", "ids": ids, "holder": holder}


def _drop_record(blob_ids: list[str], holder: str, reason: str, episode: str) -> dict[str, Any]:
    """A ``drop`` record; ``ep`` only for a discard's (``episode`` not "")."""
    record: dict[str, Any] = {"op": "drop", "ids": blob_ids, "holder": holder, "reason": reason}
    if episode:
        record["ep"] = episode
    return record


def _runs(blob_ids: Sequence[str]) -> Iterator[list[str]]:
    """``blob_ids`` in runs of at most :data:`IDS_PER_RECORD`: each run one record, of a bounded size (a journal
    record holds at most ``journal.MAX_RECORD_BYTES``). Each id's change stands alone, so a kill between two
    runs' records leaves a state the owner's retry completes."""
    for start in range(0, len(blob_ids), IDS_PER_RECORD):
        yield list(blob_ids[start : start + IDS_PER_RECORD])


def _keep(episode_id: str, layouts: list[dict[str, Any]], record: EpisodeFinished | None,
          charge: int) -> dict[str, Any]:
    rec = msgspec.msgpack.encode(record, enc_hook=_plain) if record is not None else b""
    return {"op": "keep", "ep": episode_id, "blobs": layouts, "rec": rec, "charge": charge}


def _plain(obj: Any) -> Any:
    """Arrays and numpy scalars in a record's ``info`` as plain lists and numbers."""
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    raise NotImplementedError(f"cannot journal {type(obj).__name__}")
