"""The manager's versions: the push being written, the committed versions it retains, and when to free one.

Rules (the parameter server's, as docs/ARCHITECTURE.md states them):

* A version becomes visible only when every rank's shard is committed: written to each of the workers its
  grant named (``replicas`` copies), and its checksums verified by every one of them; until then it is
  *pending* and nobody can read it. At most one version is
  pending; it must be ``latest + 1`` (any version when nothing is committed yet).
* A pending version that loses a rank (its lease expired or was released) or misses the push timeout is
  aborted: it never becomes visible and its shards are handed back for recycling. A rank whose attempt
  failed on a worker (it died or could not be reached) may start over on other workers
  (:meth:`VersionStore.retry`): only that attempt's copies are dropped, the version stays pending.
* **A manager restart** keeps the ranks whose shards were done (every copy verified) when it died: they are
  restored into the pending version from the manager's journal (:meth:`VersionStore.restore_rank`), since
  their pushers have returned and never push them again; the other ranks push again and the version commits.
  A restored rank whose pusher did not hear of it (it starts its push over) writes it again
  (:meth:`VersionStore.retry`, as the same holder's retry). A resuming push joins a pending version with
  restored ranks only when it names their trainer world's token (:meth:`VersionStore.joins_lineage`: the same
  world, its push started over); otherwise it starts its lineage afresh.
* The newest ``retain`` committed versions are kept. An older one is *retired*: no new reader may lease it,
  and its shards are freed as soon as no pull lease holds it.
* **Lineages.** A trainer world that starts (again) from its checkpoint of step ``K`` pushes version ``K``
  declaring it resumes (:meth:`VersionStore.start_lineage`, then ``begin(..., resumes=True)``): that push
  starts a new lineage. The versions ``>= K`` of the old lineage are retired at once (a reader's lease on
  one runs out normally, then its shards are freed; no new reader gets one), a push of the old lineage
  still pending is aborted, and the new lineage's ``K``, ``K+1``, ... follow without a conflict. The
  versions below ``K`` are the same in both lineages and stay as they are.

Pure bookkeeping: no I/O and no clock of its own. Methods return the shards to release; the manager sends
the ``ps-release`` requests. A shard is ``(worker, shard_id)``: the push lease id, or the broadcast init id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from ...protocol.messages_ps import Location, Manifest, ManifestEntry, ShardTensor, TensorSpec, WorkerInfo
from . import manifest as mf
from .manifest import ManifestError

Shard = tuple[str, str]  # (worker, shard id)


@dataclass
class _RankShard:
    lease: str
    workers: list[str]  # every worker granted a copy, the first one first
    tensors: list[ShardTensor]
    segments: dict[str, str] = field(default_factory=dict)  # worker -> segment of each verified copy
    committed: list[ShardTensor] | None = None  # the verified layout and checksums (the same on every copy)
    holder: str = ""  # who pushes it (its lease's holder)
    restored: bool = False  # done, restored from the journal: its lease died with an earlier manager process
    world_token: str = ""  # the token of the trainer world that pushes it ("" when its pusher named none)

    @property
    def done(self) -> bool:
        return len(self.segments) == len(self.workers)


@dataclass
class _Pending:
    version: int
    world: int
    started: float
    ranks: dict[int, _RankShard] = field(default_factory=dict)
    resumes: bool = False  # the first push of a new lineage

    def shards(self) -> list[Shard]:
        return [(w, r.lease) for r in self.ranks.values() for w in r.workers]


class DoneRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank of the pending version whose every copy is verified: what a restart needs to restore it (the
    manager's journal records it as it is)."""

    version: int
    world: int
    resumes: bool
    rank: int
    lease: str
    holder: str
    segments: dict[str, str]  # worker -> segment, in the order the grant named the workers
    tensors: list[ShardTensor]  # the verified layout and checksums
    world_token: str = ""  # its trainer world's token ("" in a record of a manager older than tokens)


@dataclass(eq=False)  # identity: two lineages may store the same version number
class _Stored:
    manifest: Manifest
    shards: list[Shard]
    leases: frozenset[str]
    readers: int = 0
    retired: bool = False


class VersionStore:
    """Pending push, committed versions, retention and freeing."""

    def __init__(self, retain: int) -> None:
        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self.retain = retain
        self.latest = -1
        self.committed_total = 0
        self.aborted_total = 0
        self.pending: _Pending | None = None
        self.lineages = 0  # lineages started after the first
        self._stored: dict[int, _Stored] = {}
        self._superseded: list[_Stored] = []  # retired with their lineage, still read
        self._pins: dict[str, _Stored] = {}  # pull lease id -> the version it holds

    # --- reading ------------------------------------------------------------------------------------

    def retained(self) -> list[int]:
        """Versions a reader may lease, oldest first."""
        return sorted(v for v, s in self._stored.items() if not s.retired)

    def pinned(self) -> dict[int, int]:
        """Version -> number of pull leases holding it (only versions with readers)."""
        pinned: dict[int, int] = {}
        for stored in [*self._superseded, *(self._stored[v] for v in sorted(self._stored))]:
            if stored.readers:
                pinned[stored.manifest.version] = pinned.get(stored.manifest.version, 0) + stored.readers
        return pinned

    def held_bytes(self) -> int:
        """Bytes of every version still held by the workers (retained, or retired but read)."""
        return sum(e.nbytes * len(e.locations) for s in [*self._stored.values(), *self._superseded]
                   for e in s.manifest.entries)

    def shards_on(self, worker: str) -> set[str]:
        """The shard ids on ``worker`` that a version (retained, or retired but read) or the pending push still
        names: every other shard it holds may be freed."""
        stored = [*self._stored.values(), *self._superseded]
        pending = self.pending.shards() if self.pending is not None else []
        return {shard for w, shard in [*(s for st in stored for s in st.shards), *pending] if w == worker}

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a retained version (default latest); ManifestError(``unknown-version``)."""
        if version is None:
            if self.latest < 0:
                raise ManifestError("unknown-version", "no version has been committed yet")
            version = self.latest
        stored = self._stored.get(version)
        if stored is None or stored.retired:
            raise ManifestError(
                "unknown-version",
                f"version {version} is not retained (retained: {self.retained() or 'none'}, latest {self.latest})",
            )
        return stored.manifest

    def stored(self, versions: Iterable[int]) -> list[tuple[Manifest, list[Shard], frozenset[str]]]:
        """Each of ``versions`` (retained) as committed: manifest, shards, the push leases that committed it."""
        return [(s.manifest, s.shards, s.leases) for s in (self._stored[v] for v in versions)]

    def restore(self, manifest: Manifest, shards: list[Shard], leases: frozenset[str]) -> None:
        """Replay a commit an earlier process of the manager recorded (its journal), as it was committed then
        (retention included) but counted nowhere. No reader is known, so what retention retires is dropped at
        once: its shards are released as the workers re-register listing them. The pending version it
        committed (restored ranks of it) is pending no more."""
        if self.pending is not None and self.pending.version <= manifest.version:
            self.pending = None
        self._store(manifest, shards, leases, counted=False)

    def pending_rank(self, version: int, rank: int) -> _RankShard | None:
        """Rank ``rank``'s shard of the pending version when that is ``version``; None otherwise."""
        pending = self.pending
        return pending.ranks.get(rank) if pending is not None and pending.version == version else None

    def done_rank(self, version: int, rank: int) -> DoneRank | None:
        """Rank ``rank`` of the pending ``version`` as a restart would restore it, once every copy of it is
        verified (None before)."""
        pending = self.pending
        shard = self.pending_rank(version, rank)
        if pending is None or shard is None or not shard.done or shard.committed is None:
            return None
        return DoneRank(version, pending.world, pending.resumes, rank, shard.lease, shard.holder,
                        {w: shard.segments[w] for w in shard.workers}, list(shard.committed), shard.world_token)

    def done_ranks(self) -> list[DoneRank]:
        """Every done rank of the pending version (none when nothing is pending)."""
        pending = self.pending
        if pending is None:
            return []
        ranks = (self.done_rank(pending.version, rank) for rank in pending.ranks)
        return [done for done in ranks if done is not None]

    def restore_rank(self, done: DoneRank, now: float) -> None:
        """Replay a done rank an earlier process of the manager recorded: it joins the pending version (made,
        started ``now``, when there is none; one of another version or world is replaced: the journal's later
        record wins). Its pusher's fresh begin may replace it (see :meth:`restored_holder`)."""
        pending = self.pending
        if pending is None or pending.version != done.version or pending.world != done.world:
            pending = self.pending = _Pending(done.version, done.world, now, resumes=done.resumes)
        layout = [msgspec.structs.replace(t, checksum=0) for t in done.tensors]  # as a grant hands it out
        pending.ranks[done.rank] = _RankShard(done.lease, list(done.segments), layout, dict(done.segments),
                                              list(done.tensors), done.holder, restored=True,
                                              world_token=done.world_token)

    def drop_rank(self, version: int, rank: int, lease: str) -> None:
        """Replay a retry an earlier process of the manager recorded: rank ``rank`` of the pending ``version``,
        done under ``lease``, was replaced by a new attempt (its copies released), so it is not restored. A
        pending version left with no rank is pending no more (its pushers begin it again)."""
        pending = self.pending
        shard = self.pending_rank(version, rank)
        if pending is None or shard is None or shard.lease != lease:
            return
        del pending.ranks[rank]
        if not pending.ranks:
            self.pending = None

    def restored_holder(self, version: int, rank: int) -> tuple[str, str]:
        """(holder, lease) of rank ``rank`` of the pending ``version`` when it was restored from the journal;
        ("", "") otherwise."""
        shard = self.pending_rank(version, rank)
        return (shard.holder, shard.lease) if shard is not None and shard.restored else ("", "")

    def pin(self, version: int, lease: str = "") -> None:
        """A pull lease now holds ``version`` (it must be retained). Pass the ``lease`` id when a new lineage
        may retire the version while it is read: :meth:`unpin` then finds the very version it read."""
        self.manifest(version)
        stored = self._stored[version]
        stored.readers += 1
        if lease:
            self._pins[lease] = stored

    def unpin(self, version: int, lease: str = "") -> list[Shard]:
        """A pull lease on ``version`` ended; returns the shards to free if that released a retired version."""
        stored = self._pins.pop(lease, None) or self._stored.get(version)
        if stored is None:
            return []
        stored.readers -= 1
        return self._free_if_unread(stored)

    def start_lineage(self, version: int) -> list[Shard]:
        """A trainer world resumes from its checkpoint of step ``version`` and pushes ``version`` next: retire
        every version ``>= version`` (see the module doc); returns the shards to free now (those unread).
        The caller aborts a pending push first, unless :meth:`joins_lineage` (another rank of the new world
        began it)."""
        assert self.pending is None, "abort the pending push before a new lineage starts"
        freed: list[Shard] = []
        for old in sorted(v for v in self._stored if v >= version):
            stored = self._stored.pop(old)
            stored.retired = True
            if stored.readers:
                self._superseded.append(stored)
            else:
                freed += stored.shards
        self.latest = max(self.retained(), default=-1)
        self.lineages += 1
        return freed

    def joins_lineage(self, version: int, world: int, world_token: str = "") -> bool:
        """Whether a resuming push of ``version`` by the trainer world ``world_token`` joins the pending one:
        another rank of that world began the new lineage. A dead world's leftovers never join a new world's
        version: not when both name a token and the tokens differ, and not a rank restored from the journal
        unless it names the same token (else the world that pushed it may be gone, a world restarted since
        pushing the same version, and no lease of this process would end that pending version); the
        resuming push starts the lineage afresh instead."""
        pending = self.pending
        return (pending is not None and pending.resumes and pending.version == version and pending.world == world
                and all(self._of_world(shard, world_token) for shard in pending.ranks.values()))

    def of_world(self, version: int, rank: int, world_token: str) -> bool:
        """Whether rank ``rank`` of the pending ``version`` is pushed by the trainer world ``world_token``: both
        name the same token (a world that names none is never taken for the same)."""
        shard = self.pending_rank(version, rank)
        return shard is not None and world_token != "" and shard.world_token == world_token

    @staticmethod
    def _of_world(shard: _RankShard, world_token: str) -> bool:
        """Whether ``shard`` may belong to the trainer world ``world_token``: the same token when both name one;
        otherwise (a pusher older than tokens) as long as it was not restored from the journal."""
        if world_token and shard.world_token:
            return world_token == shard.world_token
        return not shard.restored

    # --- pushing ------------------------------------------------------------------------------------

    def check_specs(self, rank: int, world: int, specs: list[TensorSpec], *, lineage_at: int | None = None) -> None:
        """What :meth:`begin` checks of a rank's request alone: ``bad-rank``, ``bad-dtype``, ``duplicate-name``,
        ``shape-mismatch`` against the latest version, or with ``lineage_at`` the latest a new lineage at that
        version keeps (below it). Raises ManifestError; changes nothing, so a caller checks before it acts."""
        if not 0 <= rank < world:
            raise ManifestError("bad-rank", f"rank {rank} is outside world size {world}")
        mf.layout(specs)
        base = self.latest if lineage_at is None else max((v for v in self.retained() if v < lineage_at), default=-1)
        mf.check_compatible(specs, self._stored[base].manifest if base in self._stored else None)

    def begin(
        self, version: int, rank: int, world: int, specs: list[TensorSpec], workers: list[str], lease: str,
        now: float, *, resumes: bool = False, holder: str = "", world_token: str = "",
    ) -> list[ShardTensor]:
        """Start rank ``rank``'s shard of ``version``, one copy on each of ``workers``; returns its layout.
        ``resumes``: the push starts (or joins) a new lineage at ``version`` (:meth:`start_lineage` came first).
        ``holder`` and ``world_token``: who pushes it, and its trainer world (kept for a restart, see
        :meth:`done_rank`).

        Raises ManifestError: ``version-conflict`` (not the next version, another version pending, a
        different world size, a rank already pushing), ``bad-rank``, ``duplicate-name``,
        ``shape-mismatch``, ``bad-dtype``.
        """
        if not 0 <= rank < world:
            raise ManifestError("bad-rank", f"rank {rank} is outside world size {world}")
        if self.latest >= 0 and version != self.latest + 1 and not resumes:
            raise ManifestError(
                "version-conflict", f"push of version {version}: the next version is {self.latest + 1}"
            )
        pending = self.pending
        if pending is not None and pending.version != version:
            raise ManifestError(
                "version-conflict", f"push of version {version}: version {pending.version} is still being pushed"
            )
        if pending is not None and pending.world != world:
            raise ManifestError(
                "version-conflict",
                f"push of version {version} with world size {world}: rank(s) {sorted(pending.ranks)} began "
                f"it with world size {pending.world}",
            )
        if pending is not None and rank in pending.ranks:
            raise ManifestError("version-conflict", f"rank {rank} of version {version} is already pushing")
        tensors, _ = mf.layout(specs)
        mf.check_compatible(specs, self._stored[self.latest].manifest if self.latest in self._stored else None)
        if pending is not None:
            taken = {t.name: r for r, s in pending.ranks.items() for t in s.tensors}
            for spec in specs:
                if spec.name in taken:
                    raise ManifestError(
                        "duplicate-name",
                        f"tensor {spec.name!r} of version {version} is already pushed by rank {taken[spec.name]}",
                    )
        if pending is None:
            pending = self.pending = _Pending(version, world, now, resumes=resumes)
        pending.ranks[rank] = _RankShard(lease, list(workers), tensors, holder=holder, world_token=world_token)
        return tensors

    def retry(self, version: int, rank: int, failed: str, workers: list[str], lease: str) -> tuple[
            list[ShardTensor], list[Shard]]:
        """Rank ``rank``'s attempt under lease ``failed`` could not finish (a worker died or was unreachable):
        it starts over under ``lease`` on ``workers``, the version stays pending. Returns the layout (the
        same as before) and the failed attempt's copies to release.

        Raises ManifestError(``push-aborted``) when ``failed`` is not that rank's attempt in progress.
        """
        pending = self.pending
        shard = self.pending_rank(version, rank)
        if shard is None or shard.lease != failed:
            raise ManifestError("push-aborted", f"version {version} rank {rank} has no push in progress under "
                                f"lease {failed!r} to retry")
        old = [(w, shard.lease) for w in shard.workers]
        assert pending is not None
        pending.ranks[rank] = _RankShard(lease, list(workers), shard.tensors, holder=shard.holder,
                                         world_token=shard.world_token)
        return shard.tensors, old

    def commit_shard(
        self, version: int, rank: int, lease: str, worker: str, segment: str, tensors: list[ShardTensor],
        workers: Iterable[WorkerInfo],
    ) -> tuple[bool, Manifest | None, list[Shard]]:
        """Record one verified copy of a rank's shard. Returns ``(accepted, manifest, freed)``: the manifest
        when this was the last copy of the last rank (the version is now committed), and shards freed by
        retention.

        Idempotent: a repeated commit of a shard already recorded is accepted again. Raises ManifestError:
        ``push-aborted`` (no such push in progress), ``manifest-mismatch``.
        """
        stored = self._stored.get(version)
        if stored is not None and lease in stored.leases:
            return True, stored.manifest, []
        pending = self.pending
        shard = self.pending_rank(version, rank)
        if shard is None or shard.lease != lease:
            raise ManifestError(
                "push-aborted", f"version {version} rank {rank} has no push in progress under this lease"
            )
        if worker not in shard.workers:
            raise ManifestError(
                "manifest-mismatch", f"rank {rank} was granted workers {shard.workers}, not {worker!r}"
            )
        mf.check_shard(shard.tensors, tensors)
        if shard.committed is not None and [t.checksum for t in tensors] != [t.checksum for t in shard.committed]:
            raise ManifestError("manifest-mismatch", f"rank {rank}'s copy on {worker!r} has other checksums than "
                                f"its copy on {next(iter(shard.segments))!r}")
        shard.segments[worker] = segment
        shard.committed = list(tensors)
        assert pending is not None
        if len(pending.ranks) < pending.world or not all(r.done for r in pending.ranks.values()):
            return True, None, []
        entries = [
            ManifestEntry(t.name, t.dtype, t.shape, t.nbytes, t.checksum,
                          [Location(w, r.segments[w], t.offset) for w in r.workers])
            for r in pending.ranks.values()
            for t in r.committed or ()
        ]
        manifest = mf.build(version, entries, workers)
        leases = frozenset(r.lease for r in pending.ranks.values())
        self.pending = None
        return True, manifest, self._store(manifest, pending.shards(), leases)

    def rank_done(self, version: int, rank: int, lease: str) -> bool:
        """Whether every copy of rank ``rank``'s shard of the pending ``version`` under ``lease`` is verified."""
        shard = self.pending_rank(version, rank)
        return shard is not None and shard.lease == lease and shard.done

    def commit_init(self, manifest: Manifest, shards: list[Shard]) -> list[Shard]:
        """Commit a version loaded by broadcast init; returns shards freed by retention. ManifestError
        ``version-conflict`` while a push is pending (it would commit the same version) or when the version is
        not after the latest."""
        if self.pending is not None:
            raise ManifestError("version-conflict", f"version {self.pending.version} is being pushed: an init "
                                "cannot commit beside it")
        if manifest.version <= self.latest:
            raise ManifestError("version-conflict", f"version {manifest.version} is not after {self.latest}")
        return self._store(manifest, shards, frozenset())

    def next_version(self) -> int:
        return self.latest + 1

    def abort(self, version: int) -> list[Shard]:
        """Drop the pending ``version`` (if it is the pending one); returns its shards to release."""
        pending = self.pending
        if pending is None or pending.version != version:
            return []
        self.pending = None
        self.aborted_total += 1
        return pending.shards()

    # --- internals ----------------------------------------------------------------------------------

    def _store(self, manifest: Manifest, shards: list[Shard], leases: frozenset[str], *,
               counted: bool = True) -> list[Shard]:
        self._stored[manifest.version] = _Stored(manifest, shards, leases)
        self.latest = manifest.version
        self.committed_total += counted
        freed: list[Shard] = []
        for version in self.retained()[: -self.retain]:
            self._stored[version].retired = True
            freed += self._free_if_unread(self._stored[version])
        return freed

    def _free_if_unread(self, stored: _Stored) -> list[Shard]:
        if not stored.retired or stored.readers > 0:
            return []
        version = stored.manifest.version
        if self._stored.get(version) is stored:
            del self._stored[version]
        elif stored in self._superseded:
            self._superseded.remove(stored)
        return stored.shards
