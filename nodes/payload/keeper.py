"""The env server's blob store: kept branch arrays and who owns each blob, with no sockets.

Life of a blob (the ownership rules of docs/ARCHITECTURE.md):

1. :meth:`Keeper.keep` copies an episode's branches into one buffer per branch (a *blob*) and returns a
   :class:`~refbus.protocol.messages.BlobRef` per branch. The env server (``source``) owns it.
2. :meth:`Keeper.claim` hands it to the first claimer (the orchestrator). Unclaimed blobs are deleted by
   :meth:`Keeper.expire` once their hand-over lease ends (reason ``undelivered``); :meth:`Keeper.discard`
   deletes an abandoned episode's unclaimed blobs; :meth:`Keeper.close` deletes everything (``shutdown``).
   A holder reported down (:meth:`Keeper.holder_down`) that is not back as the same process
   (:meth:`Keeper.holder_back`) within its grace loses, at :meth:`Keeper.reclaim`, every blob it holds here
   (reason ``holder-down``) except those its restarted incarnation claimed meanwhile (again: a claim by the
   current holder is answered ok; or for the first time: a blob unclaimed until then). A restarted
   incarnation reported down in turn, within that grace, gets a fresh one: only what a later incarnation
   claims in it is spared. A new process under its id that never claims back ends the grace at once
   (:meth:`Keeper.end_grace`). :meth:`Keeper.hand_over` follows the
   orchestrator's hand-over to a trainer rank (the ``reference`` event), so a rank's blobs are its own and
   not the orchestrator's.
   :meth:`Keeper.record` files the episode's ``episode-finished`` record with its blobs, for as long as one
   of them lives, so :meth:`Keeper.holdings` can tell a restarted holder what it held and what nobody
   claimed.
3. :meth:`Keeper.fetch` reads it, any number of times, by anyone (trainer ranks fetch what they train).
4. :meth:`Keeper.delete` removes it exactly once, whoever asks; a tombstone remembers who and why, so a
   second delete or a later fetch is reported as an ownership violation naming both holders. A blob
   reclaimed from a holder that went down is the exception: a later claim, fetch or delete of it, by
   whoever asks, is answered ``reclaimed`` and is no violation. Such a request is stale (a holder cut off
   from the cluster, back as the same process, that never learnt it was declared down, or someone it handed
   the reference to), and the blob's loss is already on record, named with the holder. So is a blob this
   store lost (reason ``lost``: it failed verification when a restart re-adopted the store).

A restarted env server on a durable store rebuilds its keeper from the store's journal
(:mod:`.blob_journal`) through :meth:`Keeper.restore`, :meth:`Keeper.restore_drop` and
:meth:`Keeper.restore_counters`, then :meth:`Keeper.adopt_tombstones`: a delete its earlier process had
done is answered ``repeated`` when the same holder asks again (a retry across the restart), not refused, and so
is a discard of the same episode. Every call that changes ownership takes a ``commit`` (:data:`Commit`), which
the env server's journal records before anything changes.

Every call returns a frozen result that says what happened (deleted ids, violations, unknown ids), so the
node can publish the matching events and count them. A :class:`Keeper` is not thread-safe: one owner
thread, or a lock around every call (the env server's). :func:`pack_branches` is pure and thread-safe, so the
copy and hashing of :meth:`Keeper.keep` can run outside that lock (:meth:`Keeper.store`).

This module imports numpy and the protocol's types only. Env servers import it; they never load torch.
"""

from __future__ import annotations

import struct
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from ...protocol.codec import Hashed, checksum
from ...protocol.envelope import MessageIds
from ...protocol.messages import BlobRef, EpisodeFinished, Violation
from .branch import Branch, BranchError
from .charges import BLOB_OVERHEAD_BYTES, blob_charge, info_charge

UNDELIVERED = "undelivered"
SHUTDOWN = "shutdown"
DISCARDED = "discarded"
HOLDER_DOWN = "holder-down"
LOST = "lost"
VIOLATION_ACTIONS = ("claim", "fetch", "delete")

DEFAULT_MAX_TOMBSTONES = 1_000_000
DEFAULT_TOMBSTONE_S = 300.0  # five handover leases: a late repeat comes within a retry schedule or a step

# Offsets of the fields inside a blob's buffer are multiples of this, so every field view is naturally
# aligned for its dtype (itemsize <= 8) and numpy takes its fast paths.
_ALIGN = 8


def array_checksums(arrays: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    """:func:`refbus.protocol.codec.checksum` of each array's C-order bytes, in the mapping's order: the values
    the wire descriptors carry."""
    return tuple(_array_checksum(a) for a in arrays.values())


def _array_checksum(array: np.ndarray) -> int:
    if type(array) is np.ndarray and array.flags.c_contiguous:
        return checksum(array)  # its buffer is exactly its C-order bytes: no view to build (~5 us a blob)
    return checksum(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))


def blob_checksum(arrays: Mapping[str, np.ndarray], digests: Sequence[int] | None = None) -> int:
    """The checksum of a blob (``BlobRef.checksum``): xxh3-64 over the little-endian uint64 checksums of its
    arrays, in the mapping's order, which must be the canonical field order (:data:`branch.FIELDS`).

    Each per-array checksum is :func:`array_checksums`' value, the same the wire descriptor carries, so a
    receiver that verified its frames hashes only 8 bytes per field more. ``digests``: those checksums when
    the caller already has them. The arrays are read, not kept.
    """
    values = array_checksums(arrays) if digests is None else digests
    return checksum(struct.pack(f"<{len(values)}Q", *values))


R = TypeVar("R")
Commit = Callable[[R], None]
"""What a keeper call that changes ownership runs with its result once it has decided it and before it changes
anything (a durable env server commits the call's journal records there): when it raises, the call has changed
nothing (no blob moved or went, no violation or stale request counted) and the exception propagates, so the
keeper never runs ahead of its journal."""

RETRY_AFTER_S = 0.25
"""What an ``over-budget`` refusal (or a durable store's ``journal-failed``: its tmpfs full) asks the keeper to
wait before trying again: blobs leave as their holders delete them, so room comes back in steps, not at a time
the store could predict."""


class KeepError(ValueError):
    """``keep`` refused an episode and kept nothing. ``code`` is stable (it becomes the error reply's code):
    ``bad-branch``, ``over-budget``, ``duplicate-episode``, ``closed``, or from an env server ``bad-info`` (its
    ``info`` cannot be encoded, or a durable store's journal cannot hold the episode's record) or, with a durable
    store, ``journal-failed`` (a write failed) or ``store-failed``.
    ``retry_after_s`` > 0 (``over-budget`` of an episode that fits the budget at all, ``journal-failed``): the
    same keep may succeed after that long."""

    def __init__(self, code: str, message: str, *, retry_after_s: float = 0.0) -> None:
        self.code = code
        self.retry_after_s = retry_after_s
        super().__init__(message)


@dataclass(frozen=True, slots=True, eq=False)
class PackedBranch:
    """A branch copied into one private buffer: what a blob holds. Built by :func:`pack`.

    ``arrays`` are read-only views of ``buffer``, in canonical field order. ``nbytes`` counts array bytes
    (alignment padding, under 8 bytes per field, is not counted).
    """

    arrays: Mapping[str, np.ndarray]
    buffer: np.ndarray = field(repr=False)
    tokens: int
    nbytes: int
    checksum: int
    routing_shape: tuple[int, int] | None
    segment: str = ""  # the durable store's segment holding ``buffer`` ("" when it is private memory)
    digests: tuple[int, ...] = ()  # checksum of each array, in field order (empty: not known, hashed on send)

    def sendable(self) -> dict[str, np.ndarray | Hashed]:
        """The arrays as a ``fetch`` reply carries them: with their checksums from keep time when known, so a
        send never hashes them again (they are read-only, so those checksums still hold)."""
        if not self.digests:
            return dict(self.arrays)
        return {name: Hashed(array, digest) for (name, array), digest in zip(self.arrays.items(), self.digests,
                                                                           strict=True)}


def pack_branches(branches: Sequence[Branch | Mapping[str, np.ndarray]]) -> tuple[PackedBranch, ...]:
    """Validate every branch, then copy each into its own contiguous buffer and hash it.

    Mappings are validated with :meth:`Branch.from_arrays`. Ownership: the result is a copy; the caller may
    reuse or free its arrays as soon as this returns. Pure, so any thread may call it.

    Raises:
        KeepError: ``bad-branch``, naming the branch index and the field, if any branch is invalid.
            Every branch is validated before anything is copied.
    """
    validated: list[Branch] = []
    for index, branch in enumerate(branches):
        if isinstance(branch, Branch):
            validated.append(branch)
            continue
        if not isinstance(branch, Mapping):
            raise KeepError("bad-branch", f"branch {index}: expected a Branch or a mapping of field arrays, "
                                          f"got {type(branch).__name__}")
        try:
            validated.append(Branch.from_arrays(branch))
        except BranchError as exc:
            raise KeepError("bad-branch", f"branch {index}: {exc}") from None
    return tuple(_pack_one(branch) for branch in validated)


def _pack_one(branch: Branch) -> PackedBranch:
    fields = branch.to_arrays()
    offsets: list[int] = []
    end = 0
    for array in fields.values():
        offsets.append(end)
        end += -(-array.nbytes // _ALIGN) * _ALIGN
    buffer = np.empty(end, dtype=np.uint8)
    arrays: dict[str, np.ndarray] = {}
    for (name, array), offset in zip(fields.items(), offsets, strict=True):
        view = buffer[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        view.flags.writeable = False
        arrays[name] = view
    buffer.flags.writeable = False
    digests = array_checksums(arrays)
    return PackedBranch(
        arrays=arrays,
        buffer=buffer,
        tokens=branch.token_count,
        nbytes=branch.nbytes,
        checksum=blob_checksum(arrays, digests),
        routing_shape=branch.routing_shape,
        digests=digests,
    )


@dataclass(frozen=True, slots=True)
class HandOverResult:
    """What a hand-over did. ``moved``: claimed blobs that moved to the holder now; ``again``: those the holder,
    reported down and in its grace, took by its own hand-over (its restarted incarnation's: kept when the grace
    ends), including any a repeat by another node had moved to it first; ``refused``: claimed blobs left with
    their holder because the hand-over's publisher is neither end of it (:meth:`Keeper.hand_over`)."""

    moved: tuple[str, ...] = ()
    again: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What a claim did. ``claimed``: moved to the holder now; ``already``: the holder had claimed them
    before (a repeated claim is harmless); ``gone``: deleted before the claim (lease ended, discarded);
    ``unknown``: never kept here (or forgotten past the tombstone window); ``violations``: owned by another
    holder, refused; ``reclaimed``: reclaimed from a holder that went down (a stale claim, refused);
    ``again``: of ``claimed`` and ``already``, those the holder, reported down and in its grace, took back
    (its restarted incarnation's: kept when the grace ends)."""

    holder: str
    claimed: tuple[str, ...] = ()
    already: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    violations: tuple[Violation, ...] = ()
    reclaimed: tuple[str, ...] = ()
    again: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What a fetch found. ``blobs``: blob id → its packed branch (arrays are read-only views of the keeper's
    buffers), in request order; ``unknown``: never kept here; ``violations``: fetches of deleted blobs;
    ``reclaimed``: fetches of blobs reclaimed from a holder that went down (stale, no violation)."""

    blobs: Mapping[str, PackedBranch] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()
    violations: tuple[Violation, ...] = ()
    reclaimed: tuple[str, ...] = ()

    @property
    def arrays(self) -> dict[str, Mapping[str, np.ndarray]]:
        """blob id → fields."""
        return {blob_id: packed.arrays for blob_id, packed in self.blobs.items()}


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """What a delete did: ``deleted`` now by ``holder`` for ``reason``; ``unknown``: never kept here;
    ``violations``: already deleted (each names the first deleter as ``owner``); ``reclaimed``: already
    reclaimed from a holder that went down, or lost (stale, no violation); ``repeated``: deleted by the same
    holder (or discarded with the same episode) before this store restarted (a retry across the restart:
    answered as deleted, nothing moves); ``episode``: the episode a discard deleted them of ("" otherwise)."""

    holder: str
    reason: str
    deleted: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    violations: tuple[Violation, ...] = ()
    reclaimed: tuple[str, ...] = ()
    repeated: tuple[str, ...] = ()
    episode: str = ""


@dataclass(frozen=True, slots=True)
class KeeperStats:
    """A snapshot of the keeper's counters (safe to read after the call returns)."""

    blobs_held: int
    bytes_held: int  # charged against the budget: each blob's blob_charge, each held record's info_charge
    kept_total: int
    deleted: Mapping[str, int]  # by reason
    violations: Mapping[str, int]  # by action: claim, fetch, delete
    held_by: Mapping[str, int]  # live blobs by claimer; "" for unclaimed (the env server's own)
    reclaimed: Mapping[str, int]  # blobs deleted for reason ``holder-down``, by the holder that went down
    stale: Mapping[str, int]  # requests' ids answered ``reclaimed``, by action: claim, fetch, delete


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """One episode of :meth:`Keeper.holdings`: its keep position, its record, the ids of its live blobs held
    by the holder asked about, and those still unclaimed."""

    position: int
    record: EpisodeFinished
    held: tuple[str, ...]
    unclaimed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Blob:
    episode_id: str
    packed: PackedBranch
    holder: str = ""  # "" until claimed: the env server itself owns it


@dataclass
class _HolderDown:
    until: float  # when its grace ends
    process: Hashable | None  # the process reported down (None: unknown)
    claimed_again: set[str] = field(default_factory=set)  # blob ids its new incarnation claimed since
    # The grace this one cut short (``process`` restarted the process that one waits for): it resumes should
    # ``process`` come back after all, since what that grace would not spare is still the earlier process's.
    earlier: _HolderDown | None = None
    handed: set[str] = field(default_factory=set)  # moved to it since by another node's repeat of a hand-over


def _later(down: _HolderDown, seconds: float) -> _HolderDown:
    """``down`` with its grace's end, and that of every grace it cut short, ``seconds`` later."""
    earlier = _later(down.earlier, seconds) if down.earlier is not None else None
    return replace(down, until=down.until + seconds, earlier=earlier)


@dataclass(frozen=True, slots=True)
class _Tombstone:
    holder: str  # who deleted it
    reason: str
    at: float  # when (the keeper's clock)
    adopted: bool = False  # replayed by a restarted store: a repeat of its delete is answered, not refused
    episode: str = ""  # the episode a discard deleted it of ("" for any other delete)

    @property
    def reclaimed(self) -> bool:
        """Gone with a node's death (a dead holder's, or lost by this store): later requests are stale."""
        return self.reason in (HOLDER_DOWN, LOST)


class Keeper:
    """Kept blobs of one env server (``source``, serving at ``endpoint``) and the exactly-once rules.

    ``budget_bytes`` caps the bytes charged (:attr:`bytes_held`): each blob's :func:`~.charges.blob_charge` and
    each held episode record's :func:`~.charges.info_charge`; a keep beyond it fails and nothing is ever evicted.
    ``max_blobs`` (None: no cap) caps the live blobs: a durable store maps one segment per blob, and a process has
    a limited number of mappings (:func:`~refbus.nodes.store.durable.segment_limit`).
    ``handover_lease_s`` is how long a blob may stay unclaimed before :meth:`expire` deletes it.
    ``clock`` (monotonic seconds) stamps keeps; tests inject their own. Blob ids are a random per-keeper
    prefix plus a counter, so a restarted env server never reissues an id. Deleted ids are remembered for
    ``tombstone_s`` seconds (at most the last ``max_tombstones``), so memory levels off at the delete rate
    times the window; older ones read as unknown.
    """

    def __init__(
        self,
        source: str,
        endpoint: str,
        *,
        budget_bytes: int,
        handover_lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_tombstones: int = DEFAULT_MAX_TOMBSTONES,
        tombstone_s: float = DEFAULT_TOMBSTONE_S,
        node: str = "",
        max_blobs: int | None = None,
    ) -> None:
        if max_blobs is not None and max_blobs < 1:
            raise ValueError(f"max_blobs must be >= 1, got {max_blobs}")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        if handover_lease_s <= 0:
            raise ValueError(f"handover_lease_s must be > 0, got {handover_lease_s}")
        if max_tombstones < 1:
            raise ValueError(f"max_tombstones must be >= 1, got {max_tombstones}")
        if tombstone_s <= 0:
            raise ValueError(f"tombstone_s must be > 0, got {tombstone_s}")
        self.tombstone_s = tombstone_s
        self.source = source
        self.endpoint = endpoint
        self.node = node  # the env server's node id, named in every reference
        self.budget_bytes = budget_bytes
        self.max_blobs = max_blobs
        self.handover_lease_s = handover_lease_s
        self.clock = clock
        self.max_tombstones = max_tombstones
        self.kept_total = 0
        self.deleted: Counter[str] = Counter()
        self.violations: Counter[str] = Counter()
        self.reclaimed: Counter[str] = Counter()
        self.stale: Counter[str] = Counter()
        self._held_by: Counter[str] = Counter()
        self._ids = MessageIds()
        self._blobs: dict[str, _Blob] = {}
        self._episodes: dict[str, list[str]] = {}
        # episode id -> (keep position, its record), in keep order; gone with the episode's last blob
        self._records: dict[str, tuple[int, EpisodeFinished]] = {}
        self._record_charges: dict[str, int] = {}  # episode id -> its record's charge, while it has blobs
        self._positions = 0
        # (deadline, blob id) in keep order; deadlines never decrease (monotonic clock, one lease length),
        # so expiry pops from the front and costs nothing for blobs that are not due.
        self._leases: deque[tuple[float, str]] = deque()
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._holders_down: dict[str, _HolderDown] = {}
        # Episode -> blob ids an earlier process of this store discarded (adopted tombstones): a discard retried
        # across the restart answers them. Made once, at the re-adoption; ids whose tombstone went are skipped.
        self._discarded: dict[str, list[str]] = {}
        self._bytes_held = 0
        self._closed = False

    # --- keeping ------------------------------------------------------------------------------------

    def keep(self, episode_id: str, branches: Sequence[Branch | Mapping[str, np.ndarray]]) -> list[BlobRef]:
        """Keep an episode's branches; one reference per branch, in order. :func:`pack` then :meth:`store`.

        Ownership: the arrays are copied; the caller may reuse or free its own as soon as this returns.

        Raises:
            KeepError: see :func:`pack` and :meth:`store`; nothing is kept.
        """
        return self.store(episode_id, pack_branches(branches))

    def check(self, episode_id: str, nbytes: Sequence[int], record_bytes: int = 0) -> int:
        """Whether an episode of blobs of ``nbytes`` array bytes each, and a record charged ``record_bytes``, may be
        kept now; its charge. Asked by :meth:`store`, and before a durable store writes the blobs' segments.

        Raises:
            KeepError: ``over-budget`` if the bytes charged would exceed the budget (``retry_after_s`` > 0 when
                the episode fits the budget at all) or the live blobs would exceed ``max_blobs`` (too many
                blobs), ``duplicate-episode`` if ``episode_id`` still has blobs here, ``closed`` after
                :meth:`close`.
        """
        if self._closed:
            raise KeepError("closed", f"episode {episode_id!r}: the env server is shutting down")
        if episode_id in self._episodes:
            raise KeepError("duplicate-episode", f"episode {episode_id!r} is already kept here")
        if self.max_blobs is not None and len(self._blobs) + len(nbytes) > self.max_blobs:
            fits = len(nbytes) <= self.max_blobs
            raise KeepError(
                "over-budget",
                f"episode {episode_id!r}: too many blobs, it needs {len(nbytes)}, {len(self._blobs)} of at most "
                f"{self.max_blobs} are held (a durable store maps each, within the process's vm.max_map_count)"
                + (f"; retry after {RETRY_AFTER_S} s" if fits else "; it can never fit"),
                retry_after_s=RETRY_AFTER_S if fits else 0.0,
            )
        total = sum(blob_charge(n) for n in nbytes) + record_bytes
        if self._bytes_held + total > self.budget_bytes:
            fits = total <= self.budget_bytes
            raise KeepError(
                "over-budget",
                f"episode {episode_id!r} needs {total} bytes ({sum(nbytes)} array bytes in {len(nbytes)} blobs, "
                f"each charged whole pages and {BLOB_OVERHEAD_BYTES} more, and {record_bytes} of info), "
                f"{self._bytes_held} of {self.budget_bytes} are held"
                + (f"; retry after {RETRY_AFTER_S} s" if fits else "; it can never fit"),
                retry_after_s=RETRY_AFTER_S if fits else 0.0,
            )
        return total

    def store(self, episode_id: str, packed: Sequence[PackedBranch], record_bytes: int = 0) -> list[BlobRef]:
        """Keep already packed branches (the keeper takes their buffers); one reference per branch.
        ``record_bytes``: the charge of the record :meth:`record` files next (its :func:`~.charges.info_charge`),
        held with the episode's blobs.

        Raises:
            KeepError: see :meth:`check`. Nothing is kept.
        """
        total = self.check(episode_id, [p.nbytes for p in packed], record_bytes)
        deadline = self.clock() + self.handover_lease_s
        refs: list[BlobRef] = []
        for branch in packed:
            blob_id = self._ids.next()
            self._blobs[blob_id] = _Blob(episode_id, branch)
            self._held_by[""] += 1
            self._leases.append((deadline, blob_id))
            refs.append(
                BlobRef(
                    endpoint=self.endpoint,
                    source=self.source,
                    blob_id=blob_id,
                    fields=list(branch.arrays),
                    tokens=branch.tokens,
                    nbytes=branch.nbytes,
                    checksum=branch.checksum,
                    routing_shape=list(branch.routing_shape) if branch.routing_shape else None,
                    node=self.node,
                )
            )
        if refs:
            self._episodes[episode_id] = [ref.blob_id for ref in refs]
            self._record_charges[episode_id] = record_bytes
            self._bytes_held += total
        self.kept_total += len(refs)
        return refs

    def withdraw(self, episode_id: str) -> None:
        """Undo the :meth:`store` of ``episode_id`` just made, whose announcement failed (its journal record
        could not be committed): its blobs, bytes, record and count go as if it had never been kept. Only for
        an episode no one has heard of yet: its ids leave no tombstones."""
        for blob_id in self._episodes.pop(episode_id, ()):
            blob = self._blobs.pop(blob_id)
            self._bytes_held -= blob_charge(blob.packed.nbytes)
            self._move(blob.holder, None)
            self.kept_total -= 1
        self._records.pop(episode_id, None)
        self._bytes_held -= self._record_charges.pop(episode_id, 0)

    def record(self, record: EpisodeFinished) -> None:
        """File the ``episode-finished`` record of an episode just stored (its blobs live here), for
        :meth:`holdings`; dropped with the episode's last blob. An episode with no blobs is not filed. Its
        charge was :meth:`store`'s ``record_bytes``."""
        if record.episode_id in self._episodes:
            self._records[record.episode_id] = (self._positions, record)
            self._positions += 1

    def restore_record(self, record: EpisodeFinished, charge: int | None) -> None:
        """:meth:`record` for a record an earlier process of this store filed (its blobs restored), charged what
        :meth:`store` charged it then (None: not known, its :func:`~.charges.info_charge` as it is now)."""
        if record.episode_id in self._episodes:
            charge = info_charge(record.info) if charge is None else charge
            self._bytes_held += charge - self._record_charges.get(record.episode_id, 0)
            self._record_charges[record.episode_id] = charge
            self.record(record)

    def charge_of(self, episode_id: str) -> int:
        """The charge of ``episode_id``'s record (0: none held)."""
        return self._record_charges.get(episode_id, 0)

    def holdings(self, holder: str, after: int = 0) -> Iterator[HeldRecord]:
        """The episodes with a live blob held by ``holder`` or unclaimed, in keep order from keep position
        ``after`` on. Lazy: consume it before any other call on the keeper."""
        for episode_id, (position, record) in self._records.items():
            if position < after:
                continue
            held: list[str] = []
            unclaimed: list[str] = []
            for blob_id in self._episodes[episode_id]:
                owner = self._blobs[blob_id].holder
                if owner == holder:
                    held.append(blob_id)
                elif not owner:
                    unclaimed.append(blob_id)
            if held or unclaimed:
                yield HeldRecord(position, record, tuple(held), tuple(unclaimed))

    # --- ownership ----------------------------------------------------------------------------------

    def claim(self, blob_ids: Sequence[str], holder: str, *, commit: Commit[ClaimResult] | None = None
              ) -> ClaimResult:
        """``holder`` takes ownership of unclaimed blobs (repeated ids count once). ``commit``: see
        :data:`Commit`."""
        claimed: list[str] = []
        already: list[str] = []
        gone: list[str] = []
        unknown: list[str] = []
        violations: list[Violation] = []
        reclaimed: list[str] = []
        for blob_id in dict.fromkeys(blob_ids):
            blob = self._blobs.get(blob_id)
            if blob is None:
                tomb = self._tombstones.get(blob_id)
                (unknown if tomb is None else reclaimed if tomb.reclaimed else gone).append(blob_id)
            elif not blob.holder:  # claimed by its restarted incarnation if it is down: not the dead one's
                claimed.append(blob_id)
            elif blob.holder == holder:  # taken back by its restarted incarnation if it is down
                already.append(blob_id)
            else:
                violations.append(_violation(
                    blob_id, "claim", holder, blob.holder, f"{holder} claimed it after {blob.holder} had claimed it"))
        down = self._holders_down.get(holder)
        result = ClaimResult(holder, tuple(claimed), tuple(already), tuple(gone), tuple(unknown), tuple(violations),
                             tuple(reclaimed), (*claimed, *already) if down is not None else ())
        if commit is not None:
            commit(result)
        for blob_id in claimed:
            self._hand(blob_id, holder)
        if down is not None:  # its restarted incarnation's: kept when the grace ends
            down.claimed_again.update(result.again)
        self._count(violations)
        self._count_stale("claim", reclaimed)
        return result

    def hand_over(self, blob_ids: Sequence[str], holder: str, *, by_holder: bool = True,
                  publisher: str | None = None, commit: Commit[HandOverResult] | None = None) -> HandOverResult:
        """Claimed blobs moved to ``holder`` (a trainer rank took them from the orchestrator: the
        ``reference`` event); unclaimed, deleted or unknown ids are left alone.

        ``publisher``: the node that published the hand-over. A blob moves only when that node is one of the
        hand-over's two ends, the blob's holder here (the orchestrator that claimed it) or ``holder`` itself:
        any peer may publish a ``reference``, and one moved by a third node would make the real holder's delete a
        violation, or have the blob reclaimed with a holder that is down. The others are left with their holder
        (``refused``). None: a move already judged (a journal's replay).

        ``by_holder``: the holder itself published the hand-over. Then what it takes while it is down, in its
        grace, is its restarted incarnation's (kept as claimed again), whether it moves now or a repeat of the
        hand-over by another node moved it to the holder first in this grace. A repeat by another node (the
        orchestrator's, on the rank's answer) moves what the holder's own did not and spares nothing: it may
        come after the holder died, for a step the dead process took.

        A hand-over repeated by the holder (a rank re-publishing it to a restarted store) changes nothing for what
        the holder holds already. ``commit``: see :data:`Commit`."""
        down = self._holders_down.get(holder)
        moved, taken, refused = [], [], []
        for blob_id in dict.fromkeys(blob_ids):
            blob = self._blobs.get(blob_id)
            if blob is None or not blob.holder:
                continue
            if blob.holder != holder and publisher not in (None, holder, blob.holder):
                refused.append(blob_id)
            elif blob.holder != holder:
                moved.append(blob_id)
                taken.append(blob_id)
            elif down is not None and blob_id in down.handed:
                taken.append(blob_id)
        result = HandOverResult(tuple(moved), tuple(taken) if by_holder and down is not None else (), tuple(refused))
        if commit is not None:
            commit(result)
        for blob_id in moved:
            self._hand(blob_id, holder)
        if down is not None and by_holder:  # its restarted incarnation's: kept when the grace ends
            down.handed.difference_update(taken)
            down.claimed_again.update(taken)
        elif down is not None:
            down.handed.update(moved)
        return result

    def known(self, blob_ids: Sequence[str]) -> tuple[str, ...]:
        """Those of ``blob_ids`` that are live here, in order (a hand-over of any other changes nothing here)."""
        return tuple(b for b in blob_ids if b in self._blobs)

    def holds(self, holder: str) -> bool:
        """Whether ``holder`` holds any blob here (asked on every ``node-up``: a count, not a scan)."""
        return self._held_by.get(holder, 0) > 0

    def holder_down(self, holder: str, grace_s: float, now: float | None = None, *, process: Hashable | None = None,
                    claimed_again: Iterable[str] = (), commit: Commit[bool] | None = None) -> bool:
        """``holder`` was reported down (``process``: the process that went down, None when unknown): unless it
        is back as that process (:meth:`holder_back`) within ``grace_s``, :meth:`reclaim` deletes what it holds
        here, except what its restarted incarnation claims again. A second report of the same process, or of an
        unknown one, keeps the first deadline. A report of another process than the one recorded (the restarted
        incarnation died within the grace) starts a fresh grace of ``grace_s``: what the holder holds is then
        reclaimed at its end except what a later incarnation claims again in it (what the dead incarnation had
        claimed is no longer spared). ``claimed_again``: blobs its restarted incarnation already took back (a
        restarted store resuming the grace). True when a grace started (the first report or a fresh one), False
        for a repeat. ``commit`` runs with that answer before the grace starts (see :data:`Commit`)."""
        now = self.clock() if now is None else now
        down = self._holders_down.get(holder)
        started = down is None or (process is not None and process != down.process)
        if commit is not None:
            commit(started)
        if not started:
            return False
        earlier = replace(down, earlier=None) if down is not None else None  # one back: see holder_back
        self._holders_down[holder] = _HolderDown(now + grace_s, process, set(claimed_again), earlier)
        return True

    def holder_back(self, holder: str, process: Hashable | None = None, *, commit: Commit[bool] | None = None) -> bool:
        """``holder`` is live as ``process``. True when that is the process reported down (it was slow, not dead):
        it keeps what it holds, unless that report had started a fresh grace (:meth:`holder_down`): the grace it
        cut short then resumes, with its deadline, sparing what this process claimed in either (it is the
        restarted incarnation of that grace's process). False when the holder is not down, or live as another
        process (a restart: it keeps what it claims again within the grace). ``commit`` runs with that answer before
        anything changes (see :data:`Commit`)."""
        down = self._holders_down.get(holder)
        back = down is not None and down.process == process
        if commit is not None:
            commit(back)
        if down is None or not back:
            return False
        if down.earlier is None:
            del self._holders_down[holder]
        else:
            self._holders_down[holder] = replace(down.earlier,
                                                 claimed_again=down.earlier.claimed_again | down.claimed_again)
        return True

    def extend_deadlines(self, seconds: float) -> None:
        """Move every hand-over lease's end and every holder's grace end (a grace a fresh one cut short too)
        ``seconds`` later: time the caller measured this store's loop not running, during which the claims and
        returns that would have settled them waited unread in its sockets, counts toward none. One shift for all
        keeps the leases in deadline order."""
        if seconds <= 0:
            return
        self._leases = deque((deadline + seconds, blob_id) for deadline, blob_id in self._leases)
        for holder, down in self._holders_down.items():
            self._holders_down[holder] = _later(down, seconds)

    def in_grace(self, holder: str) -> bool:
        """Whether ``holder`` is reported down and its grace still runs (not back, nothing reclaimed yet)."""
        return holder in self._holders_down

    def reclaim(self, now: float | None = None, *, commit: Callable[[str, DeleteResult], None] | None = None
                ) -> dict[str, DeleteResult]:
        """Delete what each holder whose grace has ended still holds (holder: the env server, reason
        ``holder-down``), except what its restarted incarnation claimed again in that grace; by the holder that
        went down. A grace a fresh one cut short ends with it.

        ``commit(holder, result)`` runs for each holder in turn before its blobs go (see :data:`Commit`): when
        it raises, the holders before it are done, that one and those after it still wait (their graces ended:
        the next call reclaims them), and the exception propagates."""
        now = self.clock() if now is None else now
        return {holder: self._end_grace(holder, commit)
                for holder in [h for h, down in self._holders_down.items() if down.until <= now]}

    def end_grace(self, holder: str, process: Hashable, *,
                  commit: Callable[[str, DeleteResult], None] | None = None) -> DeleteResult | None:
        """``holder``, reported down, is live as ``process``, which never claims back what earlier processes under
        its id held (the caller knows it from its registration): its grace can spare nothing more, so it ends now,
        and what the holder holds goes as at :meth:`reclaim`, except what later incarnations took again in it.
        One process holds a node id at a time, so a new one means the process reported down is gone for good.

        None (nothing changes) when the holder is in no grace, when the process reported down is unknown or is
        ``process`` (back, not replaced: :meth:`holder_back`), or when another node's repeat of a hand-over moved
        blobs to the holder in the grace that the holder's own event has not taken yet (:meth:`hand_over`): they
        may be the new process's, its own ``reference`` still on its way, and keep the grace. ``commit``: as at
        :meth:`reclaim`."""
        down = self._holders_down.get(holder)
        if down is None or down.process is None or down.process == process or down.handed:
            return None
        return self._end_grace(holder, commit)

    def _end_grace(self, holder: str, commit: Callable[[str, DeleteResult], None] | None) -> DeleteResult:
        """Delete what ``holder`` holds but what its grace spares, and end that grace (see :meth:`reclaim`)."""
        kept = self._holders_down[holder].claimed_again
        ids = tuple(i for i, blob in self._blobs.items() if blob.holder == holder and i not in kept)
        result = DeleteResult(self.source, HOLDER_DOWN, ids)
        if commit is not None:
            commit(holder, result)
        del self._holders_down[holder]
        self._remove(ids, self.source, HOLDER_DOWN)
        return result

    def fetch(self, blob_ids: Sequence[str], holder: str, *, commit: Commit[FetchResult] | None = None
              ) -> FetchResult:
        """The arrays of live blobs (anyone may fetch; repeated ids count once). ``commit`` (see :data:`Commit`)
        records the violations it counts.

        Ownership: the arrays are the keeper's read-only views, not copies. They stay valid after the blob
        is deleted (they keep its buffer alive), but the keeper no longer counts those bytes.
        """
        found: dict[str, PackedBranch] = {}
        unknown: list[str] = []
        violations: list[Violation] = []
        reclaimed: list[str] = []
        for blob_id in dict.fromkeys(blob_ids):
            blob = self._blobs.get(blob_id)
            if blob is not None:
                found[blob_id] = blob.packed
            elif (tomb := self._tombstones.get(blob_id)) is not None and tomb.reclaimed:
                reclaimed.append(blob_id)
            elif tomb is not None:
                violations.append(_violation(
                    blob_id, "fetch", holder, tomb.holder,
                    f"{holder} fetched it after {tomb.holder} had deleted it ({tomb.reason})"))
            else:
                unknown.append(blob_id)
        result = FetchResult(found, tuple(unknown), tuple(violations), tuple(reclaimed))
        if commit is not None:
            commit(result)
        self._count(violations)
        self._count_stale("fetch", reclaimed)
        return result

    def delete(self, blob_ids: Sequence[str], holder: str, reason: str, *,
               commit: Commit[DeleteResult] | None = None) -> DeleteResult:
        """Delete live blobs, whoever holds them (the last holder deletes, and the env server cannot see the
        hand-over from orchestrator to trainer). A blob already deleted is a violation (repeated ids in one
        call count once; a retried request is answered from the server's reply cache, never replayed here).
        ``commit``: see :data:`Commit`.
        """
        live: list[str] = []
        unknown: list[str] = []
        violations: list[Violation] = []
        reclaimed: list[str] = []
        repeated: list[str] = []
        for blob_id in dict.fromkeys(blob_ids):
            if blob_id in self._blobs:
                live.append(blob_id)
            elif (tomb := self._tombstones.get(blob_id)) is not None and tomb.adopted and tomb.holder == holder:
                repeated.append(blob_id)
            elif tomb is not None and tomb.reclaimed:
                reclaimed.append(blob_id)
            elif tomb is not None:
                violations.append(_violation(
                    blob_id, "delete", holder, tomb.holder,
                    f"{holder} deleted it ({reason}) after {tomb.holder} had deleted it ({tomb.reason})"))
            else:
                unknown.append(blob_id)
        result = DeleteResult(holder, reason, tuple(live), tuple(unknown), tuple(violations), tuple(reclaimed),
                              tuple(repeated))
        if commit is not None:
            commit(result)
        self._remove(live, holder, reason)
        self._count(violations)
        self._count_stale("delete", reclaimed)
        return result

    def discard(self, episode_id: str, reason: str = DISCARDED, *, commit: Commit[DeleteResult] | None = None
                ) -> DeleteResult:
        """Delete an abandoned episode's unclaimed blobs (holder: the env server, ``episode``: this one).

        Claimed blobs are left to their holder, who now decides their fate. An unknown or fully deleted
        episode deletes nothing, so a repeated discard is harmless; one an earlier process of this store
        carried out (a retry across its restart) answers what that discard deleted as ``repeated``.
        ``commit``: see :data:`Commit`.
        """
        ids = tuple(b for b in self._episodes.get(episode_id, ()) if not self._blobs[b].holder)
        repeated = tuple(b for b in self._discarded.get(episode_id, ())
                         if (tomb := self._tombstones.get(b)) is not None and tomb.episode == episode_id)
        result = DeleteResult(self.source, reason, ids, repeated=repeated, episode=episode_id)
        if commit is not None:
            commit(result)
        self._remove(ids, self.source, reason, episode=episode_id)
        return result

    def expire(self, now: float | None = None, *, commit: Commit[DeleteResult] | None = None) -> DeleteResult:
        """Delete blobs still unclaimed when their hand-over lease ends (``now`` defaults to the clock).
        ``commit``: see :data:`Commit` (the leases it did not end end at the next call)."""
        now = self.clock() if now is None else now
        ended = 0
        due: list[str] = []
        for deadline, blob_id in self._leases:
            if deadline > now:
                break
            ended += 1
            blob = self._blobs.get(blob_id)
            if blob is not None and not blob.holder:
                due.append(blob_id)
        result = DeleteResult(self.source, UNDELIVERED, tuple(due))
        if commit is not None:
            commit(result)
        for _ in range(ended):
            self._leases.popleft()
        self._remove(due, self.source, UNDELIVERED)
        return result

    def close(self) -> DeleteResult:
        """Delete everything still held (reason ``shutdown``) and refuse later keeps. Idempotent."""
        self._closed = True
        self._leases.clear()
        ids = tuple(self._blobs)
        self._remove(ids, self.source, SHUTDOWN)
        return DeleteResult(self.source, SHUTDOWN, ids)

    # --- re-adoption (a restarted store replays its journal through these) ----------------------------

    def restore(self, episode_id: str, blob_id: str, packed: PackedBranch) -> None:
        """Hold a blob kept by an earlier process of this store, unclaimed, with a fresh hand-over lease
        (the earlier process's deadline is on another clock); counted as kept."""
        self._blobs[blob_id] = _Blob(episode_id, packed)
        self._episodes.setdefault(episode_id, []).append(blob_id)
        self._held_by[""] += 1
        self._leases.append((self.clock() + self.handover_lease_s, blob_id))
        self._bytes_held += blob_charge(packed.nbytes)
        self.kept_total += 1

    def restore_drop(self, blob_ids: Sequence[str], holder: str, reason: str, episode: str = "") -> DeleteResult:
        """Replay a delete (``episode``: the episode a discard deleted them of, "" for any other delete): live
        blobs go as :meth:`delete` would remove them; ids no longer live (a compacted journal keeps their
        tombstones only) get their tombstone back."""
        live = self.known(blob_ids)
        now = self.clock()
        for blob_id in blob_ids:
            if blob_id not in self._blobs:
                self._tombstones[blob_id] = _Tombstone(holder, reason, now, episode=episode)
        self._remove(live, holder, reason, episode=episode)
        return DeleteResult(holder, reason, live, episode=episode)

    def restore_counters(self, kept: int, deleted: Mapping[str, int], violations: Mapping[str, int],
                         reclaimed: Mapping[str, int]) -> None:
        """Set the counters an earlier process of this store had reached (a compacted journal's totals)."""
        self.kept_total = kept
        self.deleted, self.violations, self.reclaimed = Counter(deleted), Counter(violations), Counter(reclaimed)

    def adopt_tombstones(self) -> None:
        """Mark every tombstone as an earlier process's: a repeat of its delete by the same holder, or of the
        discard of its episode, is answered ``repeated`` (a retry across the restart), not refused or ignored."""
        for blob_id, tomb in self._tombstones.items():
            self._tombstones[blob_id] = replace(tomb, adopted=True)
            if tomb.episode:
                self._discarded.setdefault(tomb.episode, []).append(blob_id)

    def tombstones(self) -> Iterator[tuple[str, str, str, str]]:
        """(blob id, deleter, reason, episode discarded or "") of every remembered deletion, oldest first."""
        return ((blob_id, tomb.holder, tomb.reason, tomb.episode) for blob_id, tomb in self._tombstones.items())

    def blobs(self) -> Iterator[tuple[str, str, str, PackedBranch]]:
        """(blob id, episode id, holder, packed) of every live blob, in keep order ("": unclaimed)."""
        return ((blob_id, blob.episode_id, blob.holder, blob.packed) for blob_id, blob in self._blobs.items())

    def claimed(self) -> dict[str, list[str]]:
        """Holder -> the ids of the live blobs it has claimed (or took over), in keep order; unclaimed ones left
        out."""
        claimed: dict[str, list[str]] = {}
        for blob_id, blob in self._blobs.items():
            if blob.holder:
                claimed.setdefault(blob.holder, []).append(blob_id)
        return claimed

    def unclaimed_records(self) -> list[EpisodeFinished]:
        """The filed records of the live episodes none of whose live blobs anyone has claimed, in keep order:
        those whose ``episode-finished`` may never have reached a reader (nobody acted on it)."""
        return [record for episode_id, (_, record) in self._records.items()
                if not any(self._blobs[blob_id].holder for blob_id in self._episodes[episode_id])]

    def record_of(self, episode_id: str) -> EpisodeFinished | None:
        """The filed ``episode-finished`` record of a live episode (None: none filed)."""
        filed = self._records.get(episode_id)
        return filed[1] if filed is not None else None

    # --- state --------------------------------------------------------------------------------------

    @property
    def blobs_held(self) -> int:
        return len(self._blobs)

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    def stats(self) -> KeeperStats:
        return KeeperStats(
            blobs_held=len(self._blobs),
            bytes_held=self._bytes_held,
            kept_total=self.kept_total,
            deleted=dict(self.deleted),
            violations=dict(self.violations),
            held_by=dict(self._held_by),
            reclaimed=dict(self.reclaimed),
            stale=dict(self.stale),
        )

    # --- internals ----------------------------------------------------------------------------------

    def _remove(self, blob_ids: Sequence[str], holder: str, reason: str, *, episode: str = "") -> None:
        """Delete live ``blobs_ids`` (``episode``: the episode a discard deletes them of), each leaving a
        tombstone."""
        now = self.clock()
        tomb = _Tombstone(holder, reason, now, episode=episode)
        for blob_id in blob_ids:
            blob = self._blobs.pop(blob_id)
            self._bytes_held -= blob_charge(blob.packed.nbytes)
            self._move(blob.holder, None)
            if reason == HOLDER_DOWN:
                self.reclaimed[blob.holder] += 1
            siblings = self._episodes[blob.episode_id]
            siblings.remove(blob_id)
            if not siblings:
                del self._episodes[blob.episode_id]
                self._records.pop(blob.episode_id, None)
                self._bytes_held -= self._record_charges.pop(blob.episode_id, 0)
            self._tombstones[blob_id] = tomb
        tombs = self._tombstones
        while tombs and (len(tombs) > self.max_tombstones or next(iter(tombs.values())).at < now - self.tombstone_s):
            tombs.popitem(last=False)
        if blob_ids:
            self.deleted[reason] += len(blob_ids)

    def _count_stale(self, action: str, reclaimed: Sequence[str]) -> None:
        if reclaimed:
            self.stale[action] += len(reclaimed)

    def _count(self, violations: Sequence[Violation]) -> None:
        self.violations.update(v.action for v in violations)

    def _hand(self, blob_id: str, holder: str) -> None:
        """Live ``blob_id`` is ``holder``'s now."""
        blob = self._blobs[blob_id]
        self._blobs[blob_id] = _Blob(blob.episode_id, blob.packed, holder)
        self._move(blob.holder, holder)

    def _move(self, holder: str, to: str | None) -> None:
        """Count a blob out of ``holder``'s and into ``to``'s (None: deleted); holders holding nothing go."""
        self._held_by[holder] -= 1
        if not self._held_by[holder]:
            del self._held_by[holder]
        if to is not None:
            self._held_by[to] += 1



def _violation(blob_id: str, action: str, holder: str, owner: str, detail: str) -> Violation:
    """A refused request for ``blob_id`` (counted by the keeper once the request's changes are made)."""
    return Violation(blob_id=blob_id, action=action, holder=holder, owner=owner, detail=detail)
