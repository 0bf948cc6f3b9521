"""A ps-worker's sealed shards in a :class:`~refbus.nodes.store.durable.DurableStore`: what a seal and a
release commit, and how a restarted worker re-adopts the shards an earlier process sealed.

The worker's segments live in the store's directory (its :class:`~.shm.SegmentPool` directory), so
same-host pushers and pullers map them there under the same names before and after a restart. Records:

=========== ==========================================================================================
``seal``    shard (push lease), version, rank, segment, format version and every tensor's layout and
            checksum: committed after the checksums were verified and before the manager is told, so a
            seal is acknowledged only once it is durable
``release`` shards the manager freed (their segments go back to the pool, reused or unlinked)
=========== ==========================================================================================

:meth:`ShardJournal.readopt` replays them: every tensor of a shard still sealed is verified against its
checksum; a shard that fails is lost (named, its segment removed). Files no live seal names (open shards
never sealed, free segments of the dead process) are removed and counted as swept. Not thread-safe: the
worker's loop owns it.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from ...protocol.codec import checksum
from ...protocol.messages_ps import ShardTensor
from ..store.durable import DurableStore

SHARD_FORMAT = 1  # raw tensor bytes at the offsets the seal lists
COMPACT_MIN_RECORDS = 1024  # records since the last compaction before one is due (DurableStore.compact_due)


@dataclass(frozen=True, slots=True)
class SealedShard:
    """A shard an earlier process sealed, verified: its push lease, version, rank, segment and tensors."""

    lease: str
    version: int
    rank: int
    segment: str
    tensors: tuple[ShardTensor, ...]


@dataclass(frozen=True, slots=True)
class ShardReadoption:
    """What a restarted worker found: shards verified, lost (lease -> why), files swept (never sealed, or
    free), the journal's damage ("" if none), seconds spent."""

    shards: tuple[SealedShard, ...]
    lost: dict[str, str]
    swept: int
    damaged: str
    seconds: float


class ShardJournal:
    """Commits a worker's seals and releases to ``store`` (see the module doc)."""

    def __init__(self, store: DurableStore) -> None:
        self.store = store
        self._sealed: dict[str, dict] = {}  # live shard -> its seal record

    def sealed(self, lease: str, version: int, rank: int, segment: str, tensors: Sequence[ShardTensor]) -> None:
        if lease in self._sealed:
            return  # a pusher's retried seal: already durable
        record = {"op": "seal", "lease": lease, "version": version, "rank": rank, "segment": segment,
                  "format": SHARD_FORMAT, "tensors": msgspec.to_builtins(list(tensors))}
        self.store.commit(record)
        self._sealed[lease] = record
        self._compact_if_due()

    def released(self, leases: Iterable[str]) -> None:
        """Commit the release of those of ``leases`` still sealed (each once: a release may name a shard twice)."""
        gone = [lease for lease in dict.fromkeys(leases) if lease in self._sealed]
        if gone:
            self.store.commit({"op": "release", "leases": gone})
            for lease in gone:
                del self._sealed[lease]
            self._compact_if_due()

    def readopt(self) -> ShardReadoption:
        """Replay the journal, verify every live shard, sweep the rest and compact (see the module doc)."""
        started = time.perf_counter()
        for record in self.store.replay.records:
            if record.get("op") == "seal":
                self._sealed[record["lease"]] = record
            elif record.get("op") == "release":
                for lease in record["leases"]:
                    self._sealed.pop(lease, None)
        shards: list[SealedShard] = []
        lost: dict[str, str] = {}
        for lease, record in list(self._sealed.items()):
            why = _verify(self.store.path / record["segment"], record)
            if why:
                lost[lease] = why
                del self._sealed[lease]
                continue
            shards.append(SealedShard(lease, record["version"], record["rank"], record["segment"],
                                      tuple(msgspec.convert(record["tensors"], list[ShardTensor]))))
        swept = self.store.sweep(record["segment"] for record in self._sealed.values())
        self._compact()
        return ShardReadoption(tuple(shards), lost, len(swept), self.store.replay.damaged,
                               time.perf_counter() - started)

    def close(self, *, remove: bool) -> None:
        self.store.close(remove=remove)

    def _compact_if_due(self) -> None:
        if self.store.compact_due(len(self._sealed), COMPACT_MIN_RECORDS):
            self._compact()

    def _compact(self) -> None:
        self.store.compact(self._sealed.values())


def _verify(path: os.PathLike[str], record: dict) -> str:
    """Why the shard in ``path`` cannot be served ("" when every tensor matches its checksum)."""
    if record.get("format") != SHARD_FORMAT:
        return f"shard format version {record.get('format')}, this build reads version {SHARD_FORMAT}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return f"segment {os.fspath(path)} is missing"
    try:
        size = os.fstat(fd).st_size
        tensors = msgspec.convert(record["tensors"], list[ShardTensor])
        if any(t.offset + t.nbytes > size for t in tensors):
            return f"segment {os.fspath(path)}: {size} bytes, shorter than its tensors"
        if not size:
            return ""
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for t in tensors:
                    if checksum(view[t.offset : t.offset + t.nbytes]) != t.checksum:
                        return f"tensor {t.name!r} of version {record['version']}: its bytes do not match its checksum"
            finally:
                view.release()
        return ""
    except (msgspec.ValidationError, ValueError) as exc:
        return f"unreadable seal record: {exc}"
    finally:
        os.close(fd)
