"""The parameter-server library for trainer ranks and rollout workers.

    ps = PsClient(runtime, manager_endpoint)
    ps.push(model.state_dict(), version)              # trainer rank: its own tensors only
    weights = ps.pull(dtype=torch.bfloat16, keep_fp32=("*.norm.weight",))    # rollout: latest version

Push: the manager places the rank's shard on ``ps.replicas`` workers (the first on this host when there is
one) and grants a lease; the bytes go into each worker's shared-memory segment directly (same host, proved
by :mod:`.host_proof`) or as ZeroMQ frames; each worker verifies every checksum and its acknowledgement
commits its copy at the manager (the version commits with the last copy of the last rank). A worker that
fails under the push is replaced: the rank asks for a new grant and writes its tensors again; one that fails
after it recorded its commit (the version may have committed meanwhile) fails the push only when the manager's
manifest of the version does not hold the rank's tensors and checksums. A push that
fails otherwise releases its lease, which aborts the version (a push that dies midway stops renewing: same
result). A push that fails because the manager restarted or is away starts over once it is back
(:meth:`PsClient.push`).

Pull: the manager grants a lease on a committed version and its manifest (copies on workers it knows down
left out); tensors on this host are read straight from the workers' segments (mapped once, kept mapped, no
socket), others come as frames (so does one whose segment cannot be mapped after all: gone since it was seen),
from the next copy when a worker fails. The lease
is released at the end; if it had expired (the version's memory may have been reused), the pull fails with
:class:`LeaseExpired` instead of returning torn bytes. A pull into ``out=`` (how rollout workers refresh in
place) either returns with every tensor of ``out`` holding the returned version, or raises
:class:`TornPull` naming what it wrote: ``out`` is then torn and must not be used until a full pull.
``shared=True`` returns tensors that *are* the segment's memory (read-only, valid until
:meth:`PulledState.release`).

Leases are renewed by a daemon thread while this process lives (:class:`LeaseKeeper`). Not thread-safe
otherwise: one PsClient per thread, like the runtime it uses.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NoReturn, TypeVar

import numpy as np
import structlog
import torch
import xxhash
import zmq

from ...bus.memory import keep_receive_memory
from ...bus.reqrep import MAX_ATTEMPTS, Client, PeerDown, Pipeline, RemoteError, RequestTimeout, RetryPolicy, gather
from ...bus.runtime import NodeRuntime
from ...bus.sockets import DEFAULT_OPTIONS, SocketOptions
from ...protocol.codec import Unhashed, checksum, copy_hashing
from ...protocol.envelope import MAX_BUFFERS, WireCodec
from ...protocol.messages import Body, plain_name
from ...protocol.messages_ps import (
    Abort,
    Aborted,
    Batch,
    ByteRange,
    Committed,
    Consume,
    InitRequest,
    InitResult,
    InventoryQuery,
    InventoryState,
    LeaseRelease,
    LeaseRenew,
    LeaseState,
    Location,
    Manifest,
    ManifestEntry,
    ManifestInfo,
    ManifestQuery,
    NixlOpen,
    NixlOpened,
    Occupy,
    Placed,
    PsState,
    PsStatus,
    PullBegin,
    PullGrant,
    PushBegin,
    PushGrant,
    Reserve,
    Reserved,
    ShardOpen,
    ShardOpened,
    ShardSeal,
    ShardTensor,
    ShardWrite,
    TensorSpec,
    WorkerInfo,
)
from . import host_proof
from .frames import PIECE_BYTES, FramesError, Wanted, read_frames
from .leases import RESTARTED
from .nixl import NixlError, NixlReader, NixlUnusable
from .shm import SegmentMaps, allocation_allowance_s

log = structlog.get_logger(__name__)

Transport = Literal["auto", "shm", "frames"]
Remote = Literal["frames", "nixl"]  # how bytes not mapped from shared memory travel (``ps.transport``)
_WINDOW = 4  # frame messages in flight per worker
PUSH_ATTEMPTS = 3  # grants one rank's push may use when workers fail under it (the first included)
# Error codes of a worker that lost the shard or segment asked about (it restarted): try another copy.
_WORKER_LOST = frozenset({"unknown-shard", "unknown-segment"})
INIT_ASK_EVERY_S = 5.0  # a broadcast init's request is sent again this often (see PsClient.init)
WORKERS_FIRST_PAUSE_S = 0.25  # a push finding no ps-worker polls again after this, doubling
WORKERS_MAX_PAUSE_S = 2.0
ReplyT = TypeVar("ReplyT", bound=Body)
T = TypeVar("T")


class PsError(RuntimeError):
    """A parameter-server operation that could not be completed; the message says which and why."""


class LeaseExpired(PsError):
    """A lease ran out before it was released: bytes read under it may belong to a later version."""


class TornPull(PsError):
    """A pull into ``out=`` failed after it had written into ``out``: those tensors (``written``) may hold
    another version than the rest, so ``out`` as a whole holds no version. ``cause`` is the failure
    (``LeaseExpired`` when the lease ran out, or whatever failed the release that proves it held: an
    ``unknown-lease`` RemoteError, a RequestTimeout; then even the written bytes may be torn). Only a later full
    pull into the same ``out`` makes it whole again."""

    def __init__(self, version: int, written: Sequence[str], cause: BaseException) -> None:
        self.version = version
        self.written = tuple(written)
        self.cause = cause
        super().__init__(f"pull of version {version} into out= failed after writing {len(self.written)} "
                         f"tensor(s) ({', '.join(self.written[:3])}{', ...' if len(self.written) > 3 else ''}): "
                         f"out is torn ({type(cause).__name__}: {cause})")


def wire_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class PushResult:
    version: int
    committed: bool  # this rank's commit was the last one: the version is visible
    digest: str  # the manifest digest once committed, else ""
    nbytes: int
    seconds: float


class PulledState(Mapping[str, torch.Tensor]):
    """A pulled version: name -> tensor, plus the version and manifest digest it hashes to.

    A shared pull holds its lease until :meth:`release` (or the end of a ``with`` block); its tensors view
    the workers' memory and must not be used afterwards. Other pulls hold nothing.
    """

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], release: PsClient | None = None,
                 lease: str = "") -> None:
        self.version = manifest.version
        self.digest = manifest.digest
        self.nbytes = manifest.nbytes
        self._tensors = tensors
        self._client = release
        self._lease = lease

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def release(self) -> None:
        """End a shared pull; raises LeaseExpired if the views may have been overwritten meanwhile."""
        client, self._client = self._client, None
        if client is not None:
            self._tensors = {}
            client._end_pull(self._lease, self.version)

    def __enter__(self) -> PulledState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseKeeper:
    """Renews held leases from a daemon thread, every third of their TTL, until :meth:`close`.

    The thread owns its own socket and codec (sockets are not thread-safe); the ZeroMQ context is shared.
    A process that dies stops renewing, which is the point: its leases then expire at the manager.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, node_id: str, *, secret: bytes = b"",
                 options: SocketOptions = DEFAULT_OPTIONS) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._node_id = node_id
        self._secret = secret
        self._options = options  # the node's socket options (its CURVE keys)
        self._held: dict[str, float] = {}  # lease -> TTL
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def hold(self, lease: str, ttl_s: float) -> None:
        with self._lock:
            self._held[lease] = ttl_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"ps-leases-{self._node_id}", daemon=True)
                self._thread.start()

    def drop(self, lease: str) -> None:
        with self._lock:
            self._held.pop(lease, None)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        codec = WireCodec(self._node_id, secret=self._secret)
        client = Client(self._ctx, self._endpoint, codec, policy=RetryPolicy(timeout_s=1.0, attempts=2),
                        options=self._options)
        try:
            while not self._stopping:
                with self._lock:
                    leases = list(self._held)
                    ttl = min(self._held.values(), default=3.0)
                if leases:
                    self._renew(client, leases)
                self._wake.wait(ttl / 3)
                self._wake.clear()
        finally:
            client.close()

    def _renew(self, client: Client, leases: list[str]) -> None:
        try:
            state = client.request(LeaseRenew(leases)).body
        except (RequestTimeout, RemoteError) as exc:
            log.warning("ps.lease_renew_failed", error=str(exc))
            return
        assert isinstance(state, LeaseState)
        with self._lock:
            for lease in state.expired:
                # Usually a race with a release or commit that just ended it; the owner learns at release.
                self._held.pop(lease, None)


class _WorkerFailed(PsError):
    """A ps-worker did not answer (dead, or unreachable) or no longer knows the shard (it restarted)."""

    def __init__(self, worker: str, cause: BaseException) -> None:
        self.worker = worker
        super().__init__(f"ps-worker {worker} failed: {cause}")


def _raise_from(worker: str, exc: BaseException) -> NoReturn:
    """Raise ``exc`` as :class:`_WorkerFailed` when it is a failure of ``worker`` itself (worth trying
    another worker), else as it is (a refusal)."""
    if isinstance(exc, (RequestTimeout, PeerDown)) or (isinstance(exc, RemoteError) and exc.code in _WORKER_LOST):
        raise _WorkerFailed(worker, exc) from exc
    raise exc


def _manager_away(exc: BaseException) -> str | None:
    """Why a push's failure ``exc`` means the ps-manager restarted or is away (worth starting the push over),
    or None for any other failure (a refusal that stands). A worker's own failures never get here: the push
    session replaces the worker (:class:`_WorkerFailed`), so a timeout or a down peer here is the manager's."""
    if isinstance(exc, RemoteError):
        if exc.code == "push-aborted" and RESTARTED in exc.detail:
            return "manager-restarted"
        return "manager-unreachable" if exc.code == "manager-unreachable" else None
    return "manager-timeout" if isinstance(exc, RequestTimeout) else "manager-down"


@dataclass
class _Copy:
    """One worker receiving a copy of the shard: its client, and its segment's file when mapped here."""

    info: WorkerInfo
    client: Client
    path: str | None


class PushSession:
    """One rank's shard of one version being written, one copy to each worker of the grant.

    :meth:`write` each granted tensor (any order), then :meth:`commit`. Copies on this host are copied into
    the workers' segments at once; cross-host ones travel as frames (messages of up to the client's chunk
    size, a few in flight) and reference the caller's memory until sent. Tensors must stay unchanged until
    :meth:`commit` returns: a copy whose worker fails is written again, to another worker the manager grants
    (up to ``PUSH_ATTEMPTS`` grants in all). Leaving a ``with`` block without committing (or :meth:`abort`)
    aborts the version.
    """

    def __init__(self, client: PsClient, grant: PushGrant, version: int, rank: int, world: int) -> None:
        self.version = version
        self.rank = rank
        self.world = world
        self.grants = 1
        self._client = client
        self._grant = grant
        self._layout = {t.name: t for t in grant.tensors}
        self._written: dict[str, torch.Tensor] = {}
        self._sums: dict[str, int] = {}
        self._copies: list[_Copy] = []
        self._queued: list[tuple[int, Unhashed]] = []  # pieces of the next write to the cross-host copies
        self._queued_bytes = 0
        self._stream: Pipeline | None = None  # the writes in flight to the cross-host copies of this grant
        self._sent: list[tuple[int, _Copy]] = []  # (index in the stream's outcomes, copy) of writes not yet answered
        self._avoid: set[str] = set()
        self._started = time.monotonic()
        self._open = True
        self._sealed = False  # a seal was sent: every copy's commit may have reached the manager

    @property
    def workers(self) -> list[str]:
        """The workers of the current grant, the first one first."""
        return [self._grant.worker.worker, *(w.worker for w in self._grant.replicas)]

    def start(self) -> None:
        """Open the shard on every worker of the grant (a failing worker is replaced by another)."""
        self._attempt(lambda: None)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one granted tensor (same dtype and shape as announced; any device, any strides)."""
        spec = self._layout.get(name)
        if spec is None:
            raise PsError(f"tensor {name!r} is not part of this push of version {self.version}")
        if wire_dtype(tensor.dtype) != spec.dtype or list(tensor.shape) != spec.shape:
            raise PsError(f"tensor {name!r} is {wire_dtype(tensor.dtype)}{list(tensor.shape)}, the push announced "
                          f"{spec.dtype}{spec.shape}")
        tensor = tensor.detach()
        self._attempt(lambda: self._put(spec, tensor))
        self._written[name] = tensor

    def commit(self) -> PushResult:
        """Seal the shard on every worker: each verifies every checksum and commits its copy at the manager;
        the version commits with the last copy of the last rank.

        A failure after a seal was sent is raised only when the version is not committed with this rank's
        tensors: a worker may have recorded its commit at the manager and then failed (or its answer was
        lost), so the version committed while this pusher saw the copy fail; its new grant is then refused
        ``push-aborted`` (nothing pending to retry). When the manager's manifest of the version holds exactly
        this rank's tensors and checksums, that committed version is returned (``ps.push_found_committed``)."""
        missing = sorted(set(self._layout) - set(self._written))
        if missing:
            raise PsError(f"push of version {self.version} rank {self.rank}: never written: {missing[:5]}")
        try:
            answers = self._attempt(self._seal)
        except (PsError, RemoteError, RequestTimeout, PeerDown) as exc:
            found = self._committed_anyway()
            if found is None:
                raise
            log.info("ps.push_found_committed", version=self.version, rank=self.rank, digest=found.digest,
                     error=str(exc))
            self._ended()
            return found
        self._ended()
        done = next((a for a in answers if a.committed), answers[-1])
        return PushResult(self.version, done.committed, done.digest, self._grant.nbytes,
                          time.monotonic() - self._started)

    def _ended(self) -> None:
        """The shard is committed: nothing to abort, no lease to renew."""
        self._open = False
        self._client._keeper.drop(self._grant.lease)

    def _committed_anyway(self) -> PushResult | None:
        """This rank's push as committed when a seal was sent and the manager's manifest of the version holds
        exactly its tensors and checksums; None otherwise, or when the manager does not answer (the caller's
        failure stands: :meth:`PsClient.push` starts over when the manager is away)."""
        if not self._sealed:
            return None
        with contextlib.suppress(RequestTimeout, PeerDown):
            return self._client._committed_before(self.version, self._sums, time.monotonic() - self._started)
        return None

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._client._abort_push(self._grant.lease)

    def _attempt(self, step: Callable[[], T]) -> T:
        """Run ``step``; when a worker fails, ask for a new grant without it, open the shard and write every
        tensor written so far again there, then run ``step`` again."""
        while True:
            try:
                if not self._copies:
                    self._open_copies()
                    for name, tensor in self._written.items():
                        self._put(self._layout[name], tensor)
                return step()
            except _WorkerFailed as failed:
                self._avoid.add(failed.worker)
                if self.grants >= PUSH_ATTEMPTS:
                    raise PsError(f"push of version {self.version} rank {self.rank}: {failed} (after "
                                  f"{self.grants} grants; workers failed: {sorted(self._avoid)})") from failed
                log.warning("push.worker_failed", version=self.version, rank=self.rank, worker=failed.worker,
                            error=str(failed))
                self._regrant()

    def _regrant(self) -> None:
        """A new grant for this rank, avoiding the workers that failed (the manager grants one again that
        restarted since as another process); the version stays pending."""
        old = self._grant
        self._grant = self._client._grant(PushBegin(
            self.version, self.rank, self.world, self._client.holder, [], self._client.host, retry=old.lease,
            avoid=sorted(self._avoid)))
        self.grants += 1
        self._client._keeper.drop(old.lease)
        self._client._keeper.hold(self._grant.lease, self._grant.ttl_s)
        # Writes still in flight to the old grant's copies are abandoned: their answers arrive as strays.
        self._copies, self._queued, self._queued_bytes = [], [], 0
        self._stream, self._sent = None, []

    def _open_copies(self) -> None:
        copies = []
        # The tensors' ranges let a worker written through frames hash each tensor as its pieces arrive (.streamed).
        ranges = [ByteRange(t.offset, t.nbytes) for t in self._grant.tensors]
        for info in [self._grant.worker, *self._grant.replicas]:
            client = self._client._worker(info)
            # Answered once the worker made the segment, a slice a loop turn: sent again (joining the open in
            # progress) until the retry schedule plus the allowance for that has passed.
            making_s = allocation_allowance_s(self._grant.nbytes)
            policy = client.policy.lasting(client.policy.deadline_s + making_s)
            try:
                opened = self._client._ask(client, ShardOpen(self._grant.lease, self._grant.nbytes, ranges),
                                           ShardOpened, policy=policy)
            except (RequestTimeout, RemoteError, PeerDown) as exc:
                _raise_from(info.worker, exc)
            copies.append(_Copy(info, client, self._client._local_path(info, opened.segment)))
        self._copies = copies

    def _put(self, spec: ShardTensor, tensor: torch.Tensor) -> None:
        # A CPU-contiguous tensor's bytes are hashed on their way into the segment (one pass over them); any
        # other is copied by torch from wherever it lives (strided, or on a device), then hashed from the segment.
        # Either way the checksum is of the tensor's C-order bytes, so the frames below reuse it once it is known.
        flat = _as_bytes(tensor) if tensor.device.type == "cpu" and tensor.is_contiguous() else None
        known: int | None = None
        for copy in self._copies:
            if copy.path is None:
                continue
            view = self._client._writes.view(copy.path, spec.offset, spec.nbytes)
            if flat is not None:
                digest = xxhash.xxh3_64()
                copy_hashing(np.frombuffer(view, np.uint8), flat, digest)
                known = digest.intdigest()
                continue
            if spec.nbytes:
                torch.frombuffer(view, dtype=tensor.dtype).reshape(tensor.shape).copy_(tensor)
            known = checksum(view)
        if all(copy.path is not None for copy in self._copies):
            assert known is not None
            self._sums[spec.name] = known
            return
        data = flat if flat is not None else _as_bytes(tensor)
        whole = xxhash.xxh3_64()  # streamed over the pieces: the same value as checksum(data)
        # Pieces of PIECE_BYTES, so the worker receives them into reused heap memory (see .frames). They travel
        # unhashed (codec.Unhashed): the worker's seal checks every tensor against the pusher's checksum, end to
        # end, so a frame checksum would be a second pass over every byte that nobody verifies. A write goes out
        # as soon as it is full, while earlier ones are still in flight: hashing the next pieces overlaps sending
        # these. A tensor a same-host copy already hashed is not hashed again.
        for start in range(0, max(1, data.nbytes), PIECE_BYTES):
            piece = data[start : start + PIECE_BYTES]
            if known is None:
                whole.update(piece)
            if self._queued and (self._queued_bytes + piece.nbytes > self._client.chunk_bytes
                                 or len(self._queued) == MAX_BUFFERS):  # a frame each: no receiver takes more
                self._send()
            self._queued.append((spec.offset + start, Unhashed(piece)))
            self._queued_bytes += piece.nbytes
        self._sums[spec.name] = whole.intdigest() if known is None else known

    def _seal(self) -> list[Committed]:
        self._send()
        if self._stream is not None:
            self._stream.wait()
        self._check_writes()
        sealed = [ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, self._sums[t.name])
                  for t in self._grant.tensors]
        seal = ShardSeal(self._grant.lease, self.version, self.rank, sealed)
        self._sealed = True
        answers = []
        for copy, outcome in zip(self._copies, gather([(c.client, seal) for c in self._copies]), strict=True):
            if isinstance(outcome, Exception):
                _raise_from(copy.info.worker, outcome)
            if not isinstance(outcome.body, Committed):
                raise PsError(f"{copy.info.worker} answered {seal.kind} with {outcome.body.kind}")
            answers.append(outcome.body)
        return answers

    def _send(self) -> None:
        """Send the queued pieces as one write to every cross-host copy; wait only while a copy's window is
        full (until this write is on its way), failing on the first write that failed."""
        if not self._queued:
            return
        offsets = [offset for offset, _ in self._queued]
        write = ShardWrite(self._grant.lease, offsets, [piece for _, piece in self._queued])
        self._queued, self._queued_bytes = [], 0
        if self._stream is None:
            self._stream = Pipeline(window=_WINDOW)
        stream = self._stream
        remote = [copy for copy in self._copies if copy.path is None]
        for copy in remote:
            self._sent.append((stream.add(copy.client, write), copy))
        stream.wait(until=lambda: not any(stream.waiting(copy.client) for copy in remote))
        self._check_writes()

    def _check_writes(self) -> None:
        """Forget the writes that succeeded; raise for the first one that failed."""
        if self._stream is None:
            return
        outcomes = self._stream.outcomes
        pending = []
        for index, copy in self._sent:
            outcome = outcomes[index]
            if outcome is None:
                pending.append((index, copy))
            elif isinstance(outcome, Exception):
                _raise_from(copy.info.worker, outcome)
        self._sent = pending

    def __enter__(self) -> PushSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # a no-op after commit; otherwise the version must not become visible


class PsClient:
    """Push, pull, init and the staleness inventory, through ``runtime``'s sockets.

    ``runtime`` need not run its loop (a trainer rank can build one with ``register=False``); the client
    closes itself in the runtime's shutdown hooks. ``transport``: ``auto`` uses shared memory for workers on
    this host and frames otherwise; ``frames`` never maps memory; ``shm`` insists on it. ``remote``: how the
    bytes not mapped travel, ``frames`` (ZeroMQ) or ``nixl`` (NIXL READs; NixlError here when NIXL is missing).
    """

    def __init__(self, runtime: NodeRuntime, manager: str, *, transport: Transport = "auto",
                 chunk_bytes: int = 64 << 20, policy: RetryPolicy | None = None,
                 wait_workers_s: float = 30.0, remote: Remote = "frames") -> None:
        if remote not in ("frames", "nixl"):
            raise ValueError(f"ps.transport must be 'frames' or 'nixl', not {remote!r}")
        # NixlError at once (saying how to install it) when NIXL is wanted but missing, not at the first pull.
        self._nixl = NixlReader(runtime.node_id) if remote == "nixl" else None
        self.runtime = runtime
        keep_receive_memory()  # pulled pieces land where the last pull's were, not on fresh pages
        self.wait_workers_s = wait_workers_s
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.holder = runtime.node_id
        self.host = runtime.settings.host
        self._manager = runtime.client(manager, policy=policy)
        self._workers: dict[str, Client] = {}  # worker id -> the client to its endpoint now (see _worker)
        self._writes = SegmentMaps(readonly=False)
        self._reads = SegmentMaps(readonly=True)
        self._boot_id = host_proof.boot_id()
        self._proofs: dict[tuple[str, str], str | None] = {}  # (worker, nonce) -> why not same host, or None
        self._keeper = LeaseKeeper(runtime.ctx, manager, runtime.node_id, secret=runtime.settings.secret,
                                   options=runtime.options)
        self.read_bytes: Counter[str] = Counter()  # bytes pulled, by path: "shm" (mapped), "frames" or "nixl"
        # A pull counts into read_bytes (a new path adds a key) while a metrics scrape reads it on its own thread.
        self._counting = threading.Lock()
        # Called with each name just before a pull writes it into ``out``: lets a test freeze or fail a pull
        # half-way (what a lost worker or an expired lease does in production).
        self.before_write: Callable[[str], None] | None = None
        runtime.shutdown_hooks.append(self.close)

    def close(self) -> None:
        """Stop renewing leases and forget mappings (idempotent)."""
        self._keeper.close()
        self._writes.clear()
        self._reads.clear()

    # --- push ---------------------------------------------------------------------------------------

    def push(self, tensors: Mapping[str, torch.Tensor], version: int, *, rank: int = 0, world: int = 1,
             resumes: bool = False, world_token: str = "") -> PushResult:
        """Write this rank's ``tensors`` as its shard of ``version``; returns once the shard is acknowledged.
        ``resumes``: the first push of a trainer world that starts (again) at step ``version``: it starts a
        new lineage, the parameter server retires its versions ``>= version`` instead of refusing the push.
        ``world_token``: drawn by the trainer world when it started, the same on every rank, so the ranks of
        one world join one resuming version (see below) and a dead world's ranks never do.

        Only this rank's own tensors (no all-gather); the last rank's acknowledgement commits the version.
        The caller keeps ownership of ``tensors`` (they are copied out before this returns). Raises
        RemoteError for a refused push (``version-conflict``, ``shape-mismatch``, ``duplicate-name``,
        ``checksum``, ``push-aborted``, ...); any failure aborts the version.

        A restart of the ps-manager does not fail the push: when it fails because the manager restarted (a
        ``push-aborted`` naming the restart) or is away (no answer within the request policy, the bus
        reported it down, a worker could not record the commit there: ``manager-unreachable``), the push
        starts over from ``tensors`` (a fresh ``ps-push-begin`` of the same version, ``ps.push_restarted``
        logged), pausing as :meth:`_grant` does, until ``wait_workers_s`` after the first such failure (then
        the last failure is raised). Every rank of a world that was still pushing does so on its own, and the
        restarted manager's pending version takes each rank's fresh begin: one version commits (a resuming
        one only when the ranks name their ``world_token``: the restored ranks of a world that names none may
        be a dead world's, so a resuming push starts its lineage afresh without them). A restarted
        durable manager that had committed the version before it died refuses the fresh begin
        ``version-conflict``; when its manifest of ``version`` holds exactly this rank's bytes (names and
        checksums), the push returns it as committed instead of raising.
        """
        started = time.monotonic()
        deadline: float | None = None
        pause = WORKERS_FIRST_PAUSE_S
        sums: dict[str, int] | None = None
        while True:
            try:
                with self.begin_push(tensors, version, rank=rank, world=world, resumes=resumes,
                                     world_token=world_token) as session:
                    for name, tensor in tensors.items():
                        session.write(name, tensor)
                    return session.commit()
            except (RemoteError, RequestTimeout, PeerDown) as exc:
                if deadline is not None and isinstance(exc, RemoteError) and exc.code == "version-conflict":
                    sums = sums if sums is not None else {n: checksum(_as_bytes(t)) for n, t in tensors.items()}
                    done = self._committed_before(version, sums, time.monotonic() - started)
                    if done is not None:
                        log.info("ps.push_found_committed", version=version, rank=rank, digest=done.digest)
                        return done
                reason = _manager_away(exc)
                if reason is None:
                    raise
                now = time.monotonic()
                deadline = now + self.wait_workers_s if deadline is None else deadline
                if now + pause > deadline:
                    raise
                log.warning("ps.push_restarted", version=version, rank=rank, reason=reason, error=str(exc),
                            retry_in_s=pause)
                time.sleep(pause)
                pause = min(2 * pause, WORKERS_MAX_PAUSE_S)

    def _committed_before(self, version: int, sums: Mapping[str, int], seconds: float) -> PushResult | None:
        """``version`` as this rank's committed push when the manager's manifest of it holds exactly the tensors
        ``sums`` names, with those checksums (a commit the restarted manager replayed); None otherwise."""
        try:
            manifest = self.manifest(version)
        except RemoteError:  # unknown-version: not committed (or no longer retained)
            return None
        held = {e.name: e.checksum for e in manifest.entries}
        if any(held.get(name) != value for name, value in sums.items()):
            return None
        nbytes = sum(e.nbytes for e in manifest.entries if e.name in sums)
        return PushResult(version, True, manifest.digest, nbytes, seconds)

    def begin_push(self, like: Mapping[str, torch.Tensor], version: int, *, rank: int = 0,
                   world: int = 1, resumes: bool = False, world_token: str = "") -> PushSession:
        """Start a streaming push: the shard's layout comes from ``like`` (dtypes and shapes only); write
        each tensor when it is ready (e.g. layer by layer), then commit. See :class:`PushSession` and
        :meth:`push` for the arguments."""
        specs = [TensorSpec(name, wire_dtype(t.dtype), list(t.shape)) for name, t in like.items()]
        grant = self._grant(PushBegin(version, rank, world, self.holder, specs, self.host, resumes,
                                      world_token=world_token))
        self._keeper.hold(grant.lease, grant.ttl_s)
        session = PushSession(self, grant, version, rank, world)
        try:
            session.start()
        except BaseException:
            session.abort()
            raise
        return session

    def _grant(self, begin: PushBegin) -> PushGrant:
        """The manager's grant for a push. ``no-workers`` (every ps-worker down, e.g. restarting) and
        ``init-running`` (a broadcast init loads the next version) are waited out, polling with a doubling pause
        (at least the refusal's ``retry_after_s``), for up to ``wait_workers_s``: a push is worth a short wait,
        a trainer world that fails over it is not."""
        deadline = time.monotonic() + self.wait_workers_s
        pause = WORKERS_FIRST_PAUSE_S
        while True:
            try:
                return self._ask(self._manager, begin, PushGrant)
            except RemoteError as exc:
                pause = max(pause, exc.retry_after_s)
                if exc.code not in ("no-workers", "init-running") or time.monotonic() + pause > deadline:
                    raise
                log.warning("push.waiting_for_workers" if exc.code == "no-workers" else "push.waiting_for_init",
                            version=begin.version, retry_in_s=pause)
                time.sleep(pause)
                pause = min(2 * pause, WORKERS_MAX_PAUSE_S)

    def _abort_push(self, lease: str) -> None:
        """Releasing an uncommitted push lease aborts the version at once (no waiting for the TTL)."""
        self._keeper.drop(lease)
        with contextlib.suppress(RemoteError, RequestTimeout, PeerDown):  # a manager away aborts it by its TTL
            self._manager.request(LeaseRelease(lease))

    # --- pull ---------------------------------------------------------------------------------------

    def pull(
        self,
        version: int | None = None,
        *,
        max_staleness: int | None = None,
        dtype: torch.dtype | None = None,
        keep_fp32: Sequence[str] = (),
        out: Mapping[str, torch.Tensor] | None = None,
        shared: bool = False,
        verify: bool = False,
    ) -> PulledState:
        """A committed version (latest by default) as name -> tensor.

        * ``max_staleness``: refuse (``too-stale``) a version more than this many versions behind the trainer.
        * ``dtype``: cast floating-point tensors to it, except names matching a ``keep_fp32`` pattern
          (fnmatch), which become float32.
        * ``out``: copy (and cast) into these existing tensors instead of allocating; they are returned.
          Every name of ``out`` must be in the version with the same shape (checked before anything is
          written: PsError leaves ``out`` untouched). When this returns, every tensor of ``out`` holds the
          returned version; a failure after the first write raises :class:`TornPull` (``out`` is torn).
        * ``shared``: tensors on this host are read-only views of the workers' shared memory (no copy at
          all), valid until ``release()``; cast or ``out`` tensors are copies as usual.
        * ``verify``: hash every tensor against the manifest (tensors read as frames always are).

        Raises RemoteError (``unknown-version``, ``too-stale``, ...), LeaseExpired, TornPull, PsError.
        """
        self._check_out_free(out or {})
        grant = self._ask(self._manager, PullBegin(self.holder, version, max_staleness), PullGrant)
        self._keeper.hold(grant.lease, grant.ttl_s)
        cast = _Cast(dtype, tuple(keep_fp32), out or {}, self.before_write)
        try:
            cast.check(grant.manifest)
            tensors = self._read(grant.manifest, cast, shared=shared, verify=verify)
        except BaseException as exc:
            self._keeper.drop(grant.lease)
            with contextlib.suppress(RemoteError, RequestTimeout):
                self._manager.request(LeaseRelease(grant.lease))
            if cast.written and isinstance(exc, Exception):
                raise TornPull(grant.manifest.version, cast.written, exc) from exc
            raise
        if shared:
            return PulledState(grant.manifest, tensors, self, grant.lease)
        try:
            # The lease is checked before the pull is reported done: bytes copied after it ran out may be torn.
            # Any failure there (expired, unknown to the manager, no answer) leaves that unproven: out is torn.
            self._end_pull(grant.lease, grant.manifest.version)
        except Exception as exc:
            if cast.written:
                raise TornPull(grant.manifest.version, cast.written, exc) from exc
            raise
        return PulledState(grant.manifest, tensors)

    def _check_out_free(self, out: Mapping[str, torch.Tensor]) -> None:
        """Refuse (PsError, nothing written) an ``out`` whose memory an abandoned NIXL READ may still write:
        bytes pulled into it could be overwritten afterwards."""
        if self._nixl is None:
            return
        busy = [name for name, t in out.items() if t.device.type == "cpu" and t.numel()
                and self._nixl.may_write(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())]
        if busy:
            raise PsError(f"out[{busy[0]!r}] (and {len(busy) - 1} more) may still be written by an abandoned NIXL "
                          f"transfer ({self._nixl.unusable}): pull into other tensors")

    def _end_pull(self, lease: str, version: int) -> None:
        self._keeper.drop(lease)
        try:
            self._manager.request(LeaseRelease(lease))
        except RemoteError as exc:
            if exc.code == "lease-expired":
                raise LeaseExpired(f"the pull lease on version {version} expired before the read finished; "
                                   "the bytes may belong to a later version") from None
            raise

    def _read(self, manifest: Manifest, cast: _Cast, *, shared: bool, verify: bool) -> dict[str, torch.Tensor]:
        """Every tensor of ``manifest``: mapped from a copy this host proved it sees, else as frames from
        one copy's worker; a worker that fails (dead, unreachable, restarted) is replaced by the next copy's."""
        workers = {w.worker: w for w in manifest.workers}
        result: dict[str, torch.Tensor] = {}
        remote: defaultdict[str, list[tuple[ManifestEntry, list[Location]]]] = defaultdict(list)
        with warnings.catch_warnings():
            # Read-only mappings are intended: torch warns that its tensors cannot be written through.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for entry in manifest.entries:
                local = self._local_location(entry, workers)
                view = None if local is None else self._mapped(manifest.version, entry, *local)
                if view is None:
                    remote[entry.locations[0].worker].append((entry, list(entry.locations)))
                    continue
                self._count("shm", entry.nbytes)
                if verify:
                    _verify(entry, view)
                source = _typed(torch.frombuffer(view, dtype=torch.uint8) if entry.nbytes else None, entry)
                result[entry.name] = cast.deliver(entry.name, source, private=False, shared=shared)
        failed: dict[str, str] = {}
        while remote:
            worker_name = next(iter(remote))
            items = remote.pop(worker_name)
            try:
                self._read_frames(workers[worker_name], items, cast, result)
            except _WorkerFailed as exc:
                failed[worker_name] = str(exc.__cause__ or exc)
                log.warning("pull.copy_failed", version=manifest.version, worker=worker_name, error=failed[worker_name])
                for entry, locations in items:
                    if entry.name in result:
                        continue
                    left = [loc for loc in locations if loc.worker not in failed]
                    if not left:
                        raise PsError(f"tensor {entry.name!r} of version {manifest.version}: every copy failed: "
                                      f"{failed}") from exc
                    remote[left[0].worker].append((entry, left))
        return result

    def _mapped(self, version: int, entry: ManifestEntry, path: str, offset: int) -> memoryview | None:
        """``entry``'s bytes in the segment file ``path`` that :meth:`_local_path` saw, or None when it cannot be
        mapped after all (gone since that check: its worker released or lost it; or not a segment file): the
        entry is then read as frames, as one not visible is (``transport="shm"``: PsError)."""
        try:
            return self._reads.view(path, offset, entry.nbytes)
        except OSError as exc:
            if self.transport == "shm":
                raise PsError(f"segment {path} of tensor {entry.name!r} could not be mapped: {exc}") from exc
            log.warning("pull.segment_unmapped", version=version, tensor=entry.name, path=path, error=str(exc),
                        using="frames")
            return None

    def _read_frames(self, worker: WorkerInfo, items: list[tuple[ManifestEntry, list[Location]]], cast: _Cast,
                     result: dict[str, torch.Tensor]) -> None:
        """Read ``items`` from their first location, all on ``worker``, into ``result`` (in pieces, each
        tensor hashed once against the manifest: see .frames). Raises _WorkerFailed when the worker does not
        serve them all (the caller tries another copy; what it wrote into ``out`` is rewritten then)."""
        wanted = [Wanted(entry, locations[0].offset, locations[0].segment) for entry, locations in items]
        direct: dict[str, torch.Tensor] = {}

        def destination(entry: ManifestEntry) -> torch.Tensor:
            # Bytes go straight into an output tensor of the same layout; anything else via a buffer and deliver.
            target = cast.out.get(entry.name)
            if (target is not None and target.device.type == "cpu" and target.is_contiguous()
                    and target.dtype == torch_dtype(entry.dtype) and list(target.shape) == entry.shape):
                direct[entry.name] = target
                return target.reshape(-1).view(torch.uint8)
            return torch.empty(entry.nbytes, dtype=torch.uint8)

        def first_write(entry: ManifestEntry) -> None:
            if entry.name in direct:
                cast.writing(entry.name)

        client = self._worker(worker)
        # A reader that abandoned a transfer refuses reads: frames then, as without NIXL.
        nixl = self._nixl if self._nixl is not None and self._nixl.unusable is None else None
        try:
            if nixl is not None:
                def read_into(entry: ManifestEntry) -> torch.Tensor:
                    # A READ may land any of its bytes first: every out tensor it targets counts as written
                    # (marked here, once ``destination`` has said which ones it targets).
                    target = destination(entry)
                    first_write(entry)
                    return target

                # The bound the frames path gives the same bytes: one retry schedule per chunk_bytes request.
                chunks = -(-sum(item.entry.nbytes for item in wanted) // self.chunk_bytes)
                raws = nixl.read(wanted, lambda segment: self._ask(client, NixlOpen(segment), NixlOpened),
                                 read_into, deadline_s=sum(client.policy.timeouts()) * max(1, chunks))
            else:
                raws = read_frames(client, wanted, destination, chunk_bytes=self.chunk_bytes, window=_WINDOW,
                                   first_write=first_write)
        except NixlUnusable as exc:
            if direct:  # the abandoned READ may still write into out: no other copy may go there (TornPull)
                raise PsError(f"worker {worker.worker}: {exc}; out is not written again") from exc
            raise _WorkerFailed(worker.worker, exc) from exc  # its buffers stay with the reader: another copy
        except (FramesError, NixlError) as exc:
            # Any failure, a refusal included (a restarted worker reusing a segment name), is worth the next
            # copy: a read changes nothing on the worker.
            raise _WorkerFailed(worker.worker, exc) from exc
        for item, raw in zip(wanted, raws, strict=True):
            entry = item.entry
            if entry.name in direct:
                result[entry.name] = direct[entry.name]
            else:
                result[entry.name] = cast.deliver(entry.name, _typed(raw if entry.nbytes else None, entry),
                                                  private=True, shared=False)
            self._count("frames" if nixl is None else "nixl", entry.nbytes)

    def _count(self, path: str, nbytes: int) -> None:
        with self._counting:
            self.read_bytes[path] += nbytes

    def read_totals(self) -> dict[str, int]:
        """:attr:`read_bytes` as of now, safe to call from any thread (a metrics scrape) while a pull counts."""
        with self._counting:
            return dict(self.read_bytes)

    # --- broadcast init, inspection -----------------------------------------------------------------

    def init(self, path: str, *, workers: Sequence[str] = (), chunk_bytes: int = 0,
             timeout_s: float = 600.0) -> InitResult:
        """Load a safetensors checkpoint into ``workers`` (default all) by tree broadcast; the new version.

        The request goes again every ``INIT_ASK_EVERY_S`` (rarer for a ``timeout_s`` of more than
        ``MAX_ATTEMPTS`` of them) until ``timeout_s`` (the same id: the manager running
        it answers it once, when it ends), so a manager restarted meanwhile, which knows nothing of the init the
        dead one ran, hears it and starts it over, or refuses it by name (``unknown-worker``: a worker not yet
        registered with it again).

        Raises RemoteError ``init-failed`` naming the worker that failed.
        """
        attempts = min(MAX_ATTEMPTS, max(1, math.ceil(timeout_s / INIT_ASK_EVERY_S)))
        every = timeout_s / attempts
        policy = RetryPolicy(timeout_s=every, attempts=attempts, backoff=1.0, max_timeout_s=every)
        reply = self._manager.request(InitRequest(path, list(workers), chunk_bytes), policy=policy).body
        assert isinstance(reply, InitResult)
        return reply

    def manifest(self, version: int | None = None) -> Manifest:
        return self._ask(self._manager, ManifestQuery(version), ManifestInfo).manifest

    def status(self) -> PsState:
        return self._ask(self._manager, PsStatus(), PsState)

    # --- staleness inventory ------------------------------------------------------------------------

    def reserve(self, prompt_id: str, policy_version: int, count: int = 1, *, leased: bool = False) -> int:
        """The training version whose buffer now holds ``count`` slots for this prompt (group)."""
        return self._ask(self._manager, Reserve(prompt_id, policy_version, count, leased), Reserved).version

    def occupy(self, prompt_id: str, trajectory: str, policy_version: int) -> Placed:
        return self._ask(self._manager, Occupy(prompt_id, trajectory, policy_version), Placed)

    def consume(self, version: int | None = None) -> Batch:
        return self._ask(self._manager, Consume(version), Batch)

    def abort(self, prompt_id: str) -> Aborted:
        return self._ask(self._manager, Abort(prompt_id), Aborted)

    def inventory(self) -> InventoryState:
        return self._ask(self._manager, InventoryQuery(), InventoryState)

    # --- internals ----------------------------------------------------------------------------------

    def _ask(self, client: Client, body: Body, expect: type[ReplyT], *, policy: RetryPolicy | None = None) -> ReplyT:
        reply = client.request(body, policy=policy).body
        if not isinstance(reply, expect):
            raise PsError(f"{client.endpoint} answered {body.kind} with {reply.kind}, expected {expect.kind}")
        return reply

    def _worker(self, info: WorkerInfo) -> Client:
        """The client to ``info``'s worker, one per worker id: a worker that restarted on a new endpoint (what
        grants and manifests say now) has its old client closed, not kept (a socket and reconnects to a dead
        port each), and the proofs of its earlier processes dropped. Each operation takes its workers' clients
        from the grant or manifest it works on, one operation at a time on the caller's thread; only a push
        session left open while another operation meets the worker's new endpoint still holds the closed one."""
        client = self._workers.get(info.worker)
        if client is not None and client.endpoint != info.endpoint:
            self.runtime.release_client(client)
            for key in [key for key in self._proofs if key[0] == info.worker and key[1] != info.nonce]:
                del self._proofs[key]
            client = None
        if client is None:
            client = self._workers[info.worker] = self.runtime.client(info.endpoint)
        return client

    def _local_path(self, worker: WorkerInfo, segment: str) -> str | None:
        """The segment's file when this client may map it (same host by proof, visible), else None. Raises
        :class:`PsError` for a segment name that is not a plain file name (it would name a file elsewhere)."""
        if self.transport == "frames":
            return None
        if not plain_name(segment):
            raise PsError(f"worker {worker.worker} named segment {segment[:64]!r}: not a plain file name")
        refused = self._same_host_refusal(worker)
        if refused is not None:
            if self.transport == "shm":
                raise PsError(f"worker {worker.worker} is not proved to be on this host: {refused}")
            return None
        path = os.path.join(worker.shm_dir, segment)
        if os.path.exists(path):
            return path
        if self.transport == "shm":
            raise PsError(f"segment {path} of worker {worker.worker} is not visible from this process")
        return None

    def _same_host_refusal(self, worker: WorkerInfo) -> str | None:
        """Why ``worker``'s segments may not be mapped here (None: proved they may), once per worker process.
        A worker whose host name is this one's but whose proof fails is logged as an error: the name lied."""
        key = (worker.worker, worker.nonce)
        if key not in self._proofs:
            refused = self._proofs[key] = host_proof.refusal(worker, self._boot_id)
            if refused is not None and worker.host == self.host:
                log.error("ps.same_host_unproved", worker=worker.worker, host=worker.host, reason=refused,
                          using="frames" if self.transport == "auto" else "nothing")
        return self._proofs[key]

    def _local_location(self, entry: ManifestEntry, workers: Mapping[str, WorkerInfo]) -> tuple[str, int] | None:
        for location in entry.locations:
            path = self._local_path(workers[location.worker], location.segment)
            if path is not None:
                return path, location.offset
        return None


@dataclass(frozen=True)
class _Cast:
    """How pulled tensors are delivered: dtype cast with a keep-fp32 list, into ``out`` when given."""

    dtype: torch.dtype | None
    keep_fp32: tuple[str, ...]
    out: Mapping[str, torch.Tensor]
    before_write: Callable[[str], None] | None = None
    written: list[str] = field(default_factory=list)  # names of ``out`` written so far, in order

    def check(self, manifest: Manifest) -> None:
        """Refuse, before anything is written, an ``out`` that this version cannot fill completely, and a grant
        that places a copy on a worker it does not describe (no endpoint to read it from: a manager of another
        build, a damaged grant), which would fail half-way through the pull."""
        listed = {w.worker for w in manifest.workers}
        unlisted = sorted({loc.worker for e in manifest.entries for loc in e.locations} - listed)
        if unlisted:
            raise PsError(f"version {manifest.version}'s grant places copies on workers it does not describe: "
                          f"{unlisted[:5]}; nothing read")
        entries = {e.name: e for e in manifest.entries}
        missing = sorted(set(self.out) - set(entries))
        if missing:
            raise PsError(f"out has tensors that version {manifest.version} lacks: {missing[:5]}")
        for name, target in self.out.items():
            if list(target.shape) != entries[name].shape:
                raise PsError(f"out[{name!r}] has shape {list(target.shape)}, version {manifest.version} has "
                              f"{entries[name].shape}")

    def target(self, name: str, source: torch.Tensor) -> torch.dtype:
        if self.dtype is None or not source.is_floating_point():
            return source.dtype
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep_fp32):
            return torch.float32
        return self.dtype

    def writing(self, name: str) -> None:
        """Bytes are about to be written into ``out[name]``: recorded first, since a write that fails
        half-way has torn that tensor too."""
        if self.before_write is not None:
            self.before_write(name)
        if name not in self.written:
            self.written.append(name)

    def deliver(self, name: str, source: torch.Tensor, *, private: bool, shared: bool) -> torch.Tensor:
        """``source`` views shared memory (``private=False``) or memory this process owns."""
        target = self.out.get(name)
        if target is not None:
            self.writing(name)
            return target.copy_(source)
        dtype = self.target(name, source)
        if dtype != source.dtype:
            return source.to(dtype)
        return source if private or shared else source.clone()


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a CPU copy of ``tensor`` (no copy when it is already CPU-contiguous)."""
    return tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _typed(raw: torch.Tensor | None, entry: ManifestEntry) -> torch.Tensor:
    """Bytes (uint8, None when empty) as the entry's dtype and shape, without a copy."""
    dtype = torch_dtype(entry.dtype)
    if raw is None or not entry.nbytes:
        return torch.empty(entry.shape, dtype=dtype)
    return raw.view(dtype).reshape(entry.shape)


def _verify(entry: ManifestEntry, data: object) -> None:
    if checksum(data) != entry.checksum:
        raise PsError(f"tensor {entry.name!r} does not match the checksum of its manifest")
