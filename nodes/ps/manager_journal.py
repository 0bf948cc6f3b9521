"""The ps-manager's decisions that must outlive its process, in a :class:`~refbus.nodes.store.durable.DurableStore`.

A restarted ps-manager (same node id, same run) replays them and comes back with every committed version it
retained, its lineage, the staleness inventory's trainer version and the batch the last ``consume`` handed
out. Records:

=========== ==========================================================================================
``commit``  a committed version: its manifest, its shards ``[worker, shard id]`` and the push leases that
            committed it (a pusher's repeated seal of one is answered as committed after a restart too)
``lineage`` a trainer world resumed at ``version``: the versions ``>= version`` were retired
``trainer`` the staleness inventory's trainer version after a ``consume``, and the batch it handed out
            (:class:`HandedOut`): its reply may not have left before a crash, and a retry of it, answered
            ``out-of-order`` by a restarted inventory already past it, would lose the batch for good
``rank``    a rank of the pending version done (every copy verified): its layout and checksums, its copies
            ``{worker: segment}``, its lease and holder; replayed into the pending version, since its pusher
            has returned and never pushes it again
``abort``   the pending ``version`` was aborted: its done ranks are not restored
``retried`` done ``rank`` of the pending ``version`` under ``lease`` was replaced by its pusher's new attempt
            (a retry: its copies were released): it is not restored; the new attempt has a ``rank`` record
            of its own once done
=========== ==========================================================================================

Each is committed before anyone learns of the decision (the ``version-bump``, the answers). What is not
recorded is lost with the process on purpose: a rank still being written, leases, reservations and an init
round belong to the incarnation that granted them, and their holders are told so when they come back (a
restored pending version is aborted like any other if its missing ranks do not commit within the push
timeout of the restart). Shards are not released
here: the workers re-register listing what they hold, and the manager releases what no version names.

The journal's own rules hold (:mod:`refbus.nodes.store.journal`): a record torn by a crash mid-append (its commit
flag never written) is ignored. Anything else that is not a record of this module (garbage, a record of an unknown
kind or with fields that do not parse) refuses the journal with :class:`~refbus.nodes.store.durable.StoreError`
naming the file: versions are never silently dropped. Not thread-safe: the manager's loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ...protocol.messages_ps import BatchEntry, Manifest
from ..store.durable import DurableStore, StoreError
from .versions import DoneRank, Shard, VersionStore

COMPACT_MIN_RECORDS = 256  # records since the last compaction before one is due (DurableStore.compact_due)


class _Commit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    manifest: Manifest
    shards: list[tuple[str, str]]
    leases: list[str]


class _Lineage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    version: int


class HandedOut(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The batch of buffer ``version`` a ``consume`` handed out, and that request's ``(source, id)``."""

    request: tuple[str, str]
    version: int
    entries: list[BatchEntry]


class _Trainer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    version: int
    handed_out: HandedOut | None = None  # None: no batch handed out since the lineage began


class _Rank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    done: DoneRank


class _Retried(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    version: int
    rank: int
    lease: str


# Abort records have a lineage record's fields: {"op": "abort", "version": V}.
_KINDS: dict[str, type[msgspec.Struct]] = {"commit": _Commit, "lineage": _Lineage, "trainer": _Trainer,
                                           "rank": _Rank, "abort": _Lineage, "retried": _Retried}


@dataclass(frozen=True, slots=True)
class Recovered:
    """What a replay rebuilt: the inventory's ``trainer_version`` (-1: nothing moved it), the records read, the
    versions retained and the batch the last ``consume`` handed out (None: none since the lineage began)."""

    trainer_version: int
    records: int
    versions: list[int]
    handed_out: HandedOut | None


class ManagerJournal:
    """Commits the manager's durable decisions to ``store`` and replays them (see the module doc)."""

    def __init__(self, store: DurableStore) -> None:
        self.store = store

    def committed(self, manifest: Manifest, shards: Iterable[Shard], leases: Iterable[str]) -> None:
        self.store.commit(_commit(manifest, shards, leases))

    def lineage(self, version: int) -> None:
        self.store.commit({"op": "lineage", "version": version})

    def trainer(self, version: int, handed_out: HandedOut) -> None:
        self.store.commit(_trainer(version, handed_out))

    def rank_done(self, done: DoneRank) -> None:
        self.store.commit(_rank(done))

    def aborted(self, version: int) -> None:
        self.store.commit({"op": "abort", "version": version})

    def retried(self, version: int, rank: int, lease: str) -> None:
        self.store.commit({"op": "retried", "version": version, "rank": rank, "lease": lease})

    def replay(self, versions: VersionStore, now: float) -> Recovered:
        """Rebuild ``versions`` (fresh) from the records, in order; raises StoreError naming the journal and the
        record when one is not a record of this module. Nothing is freed: no reader is known yet. A pending
        version restored from ``rank`` records counts as started ``now`` (its push timeout runs from there)."""
        trainer = -1
        handed_out: HandedOut | None = None
        records = self.store.replay.records
        for index, raw in enumerate(records):
            record = self._parse(index, raw)
            if isinstance(record, _Commit):
                versions.restore(record.manifest, [(w, s) for w, s in record.shards], frozenset(record.leases))
                trainer = max(trainer, record.manifest.version)
            elif isinstance(record, _Rank):
                versions.restore_rank(record.done, now)
            elif isinstance(record, _Trainer):
                trainer = max(trainer, record.version)
                handed_out = record.handed_out
            elif isinstance(record, _Retried):
                versions.drop_rank(record.version, record.rank, record.lease)
            elif record.op == "abort":
                versions.abort(record.version)
            elif record.op == "lineage":
                if versions.pending is not None:  # the lineage's start aborted it
                    versions.abort(versions.pending.version)
                versions.start_lineage(record.version)
                trainer = record.version  # the inventory rewinds with the lineage
                handed_out = None  # and its buffers are the new lineage's
        return Recovered(trainer, len(records), versions.retained(), handed_out)

    def compact_if_due(self, versions: VersionStore, trainer_version: int, handed_out: HandedOut | None) -> None:
        """Rewrite the journal as the versions retained now, the inventory's trainer version and the batch last
        handed out once enough records piled up: a long run keeps a journal the size of its retained versions."""
        live = versions.retained()
        if self.store.compact_due(len(live) + 1, COMPACT_MIN_RECORDS):
            self.store.compact([*(_commit(m, sh, le) for m, sh, le in versions.stored(live)),
                                _trainer(trainer_version, handed_out),
                                *(_rank(done) for done in versions.done_ranks())])

    def close(self, *, remove: bool) -> None:
        self.store.close(remove=remove)

    def _parse(self, index: int, raw: dict[str, Any]) -> _Commit | _Lineage | _Trainer | _Rank | _Retried:
        kind = _KINDS.get(raw.get("op"))  # type: ignore[arg-type]
        try:
            if kind is None:
                raise msgspec.ValidationError(f"unknown record kind {raw.get('op')!r}")
            return msgspec.convert(raw, kind)  # type: ignore[return-value]
        except msgspec.ValidationError as exc:
            raise StoreError(f"{self.store.path / 'journal'}: record {index} is not a ps-manager record ({exc}); "
                             f"this journal is refused whole, left as it is: inspect or remove {self.store.path}") \
                from None


def _commit(manifest: Manifest, shards: Iterable[Shard], leases: Iterable[str]) -> dict[str, Any]:
    return {"op": "commit", "manifest": msgspec.to_builtins(manifest), "shards": [list(s) for s in shards],
            "leases": sorted(leases)}


def _trainer(version: int, handed_out: HandedOut | None) -> dict[str, Any]:
    record: dict[str, Any] = {"op": "trainer", "version": version}
    if handed_out is not None:
        record["handed_out"] = msgspec.to_builtins(handed_out)
    return record


def _rank(done: DoneRank) -> dict[str, Any]:
    return {"op": "rank", "done": msgspec.to_builtins(done)}
