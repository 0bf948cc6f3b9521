"""The parameter-server library for trainer ranks and rollout workers.

    ps = PsClient(runtime, manager_endpoint)
    ps.push(model.state_dict(), version)              # trainer rank: its own tensors only
    weights = ps.pull(dtype=torch.bfloat16, keep_fp32=("*.norm.weight",))    # rollout: latest version

Push: the manager places the rank's shard on a worker (one on this host when there is one) and grants a
lease; the bytes go into the worker's shared-memory segment directly (same host) or as ZeroMQ frames; the
worker verifies every checksum and its acknowledgement commits the shard at the manager. A push that fails
midway releases its lease, which aborts the version (a push that dies midway stops renewing: same result).

Pull: the manager grants a lease on a committed version and its manifest; tensors on this host are read
straight from the workers' segments (mapped once, kept mapped, no socket), others come as frames. The lease
is released at the end; if it had expired (the version's memory may have been reused), the pull fails with
:class:`LeaseExpired` instead of returning torn bytes. ``shared=True`` returns tensors that *are* the
segment's memory (read-only, valid until :meth:`PulledState.release`).

Leases are renewed by a daemon thread while this process lives (:class:`LeaseKeeper`). Not thread-safe
otherwise: one PsClient per thread, like the runtime it uses.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import structlog
import torch
import zmq

from ...bus.reqrep import Client, RemoteError, RequestTimeout, RetryPolicy, gather
from ...bus.runtime import NodeRuntime
from ...bus.sockets import DEFAULT_OPTIONS, SocketOptions
from ...protocol.codec import checksum
from ...protocol.envelope import WireCodec
from ...protocol.messages import Body
from ...protocol.messages_ps import (
    Abort,
    Aborted,
    Batch,
    Committed,
    Consume,
    InitRequest,
    InitResult,
    InventoryQuery,
    InventoryState,
    LeaseRelease,
    LeaseRenew,
    LeaseState,
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
from .frames import PIECE_BYTES, FramesError, Wanted, read_frames
from .nixl import NixlError, NixlReader
from .shm import SegmentMaps

log = structlog.get_logger(__name__)

Transport = Literal["auto", "shm", "frames"]
Remote = Literal["frames", "nixl"]  # how bytes not mapped from shared memory travel (``ps.transport``)
_WINDOW = 4  # frame messages in flight per worker
WORKERS_FIRST_PAUSE_S = 0.25  # a push finding no ps-worker polls again after this, doubling
WORKERS_MAX_PAUSE_S = 2.0
ReplyT = TypeVar("ReplyT", bound=Body)


class PsError(RuntimeError):
    """A parameter-server operation that could not be completed; the message says which and why."""


class LeaseExpired(PsError):
    """A lease ran out before it was released: bytes read under it may belong to a later version."""


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


class PushSession:
    """One rank's shard of one version being written.

    :meth:`write` each granted tensor (any order), then :meth:`commit`. Same-host shards are copied into
    the worker's segment at once; cross-host ones travel as frames (messages of up to the client's chunk
    size, a few in flight) and reference the caller's memory until sent, so tensors must stay unchanged
    until :meth:`commit` returns. Leaving a ``with`` block without committing (or :meth:`abort`) aborts the
    version.
    """

    def __init__(self, client: PsClient, grant: PushGrant, version: int, rank: int, worker: Client,
                 path: str | None) -> None:
        self.version = version
        self.rank = rank
        self._client = client
        self._grant = grant
        self._worker = worker
        self._path = path
        self._layout = {t.name: t for t in grant.tensors}
        self._sums: dict[str, int] = {}
        self._queued: list[tuple[int, np.ndarray]] = []
        self._queued_bytes = 0
        self._started = time.monotonic()
        self._open = True

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one granted tensor (same dtype and shape as announced; any device, any strides)."""
        spec = self._layout.get(name)
        if spec is None:
            raise PsError(f"tensor {name!r} is not part of this push of version {self.version}")
        if wire_dtype(tensor.dtype) != spec.dtype or list(tensor.shape) != spec.shape:
            raise PsError(f"tensor {name!r} is {wire_dtype(tensor.dtype)}{list(tensor.shape)}, the push announced "
                          f"{spec.dtype}{spec.shape}")
        tensor = tensor.detach()
        if self._path is not None:
            view = self._client._writes.view(self._path, spec.offset, spec.nbytes)
            if spec.nbytes:
                # One copy from wherever the tensor lives (strided, or on a device) into the mapped segment.
                torch.frombuffer(view, dtype=tensor.dtype).reshape(tensor.shape).copy_(tensor)
            self._sums[name] = checksum(view)
            return
        data = _as_bytes(tensor)
        self._sums[name] = checksum(data)
        chunk = self._client.chunk_bytes
        # Pieces of PIECE_BYTES, so the worker receives them into reused heap memory (see .frames).
        for start in range(0, max(1, data.nbytes), PIECE_BYTES):
            piece = data[start : start + PIECE_BYTES]
            if self._queued_bytes + piece.nbytes > _WINDOW * chunk:
                self._flush()
            self._queued.append((spec.offset + start, piece))
            self._queued_bytes += piece.nbytes

    def commit(self) -> PushResult:
        """Seal the shard: the worker verifies every checksum and commits it at the manager."""
        missing = sorted(set(self._layout) - set(self._sums))
        if missing:
            raise PsError(f"push of version {self.version} rank {self.rank}: never written: {missing[:5]}")
        self._flush()
        sealed = [ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, self._sums[t.name])
                  for t in self._grant.tensors]
        done = self._client._ask(self._worker, ShardSeal(self._grant.lease, self.version, self.rank, sealed),
                                 Committed)
        self._open = False
        self._client._keeper.drop(self._grant.lease)
        return PushResult(self.version, done.committed, done.digest, self._grant.nbytes,
                          time.monotonic() - self._started)

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._client._abort_push(self._grant.lease)

    def _flush(self) -> None:
        if not self._queued:
            return
        chunk = self._client.chunk_bytes
        batches: list[tuple[Client, Body]] = []
        offsets: list[int] = []
        pieces: list[np.ndarray] = []
        size = 0
        for offset, piece in self._queued:
            if pieces and size + piece.nbytes > chunk:
                batches.append((self._worker, ShardWrite(self._grant.lease, offsets, pieces)))
                offsets, pieces, size = [], [], 0
            offsets.append(offset)
            pieces.append(piece)
            size += piece.nbytes
        batches.append((self._worker, ShardWrite(self._grant.lease, offsets, pieces)))
        self._queued, self._queued_bytes = [], 0
        for outcome in gather(batches, window=_WINDOW):
            if isinstance(outcome, Exception):
                raise outcome

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
        self.wait_workers_s = wait_workers_s
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.holder = runtime.node_id
        self.host = runtime.settings.host
        self._manager = runtime.client(manager, policy=policy)
        self._workers: dict[str, Client] = {}
        self._writes = SegmentMaps(readonly=False)
        self._reads = SegmentMaps(readonly=True)
        self._keeper = LeaseKeeper(runtime.ctx, manager, runtime.node_id, secret=runtime.settings.secret,
                                   options=runtime.options)
        self.read_bytes: Counter[str] = Counter()  # bytes pulled, by path: "shm" (mapped), "frames" or "nixl"
        runtime.shutdown_hooks.append(self.close)

    def close(self) -> None:
        """Stop renewing leases and forget mappings (idempotent)."""
        self._keeper.close()
        self._writes.clear()
        self._reads.clear()

    # --- push ---------------------------------------------------------------------------------------

    def push(self, tensors: Mapping[str, torch.Tensor], version: int, *, rank: int = 0, world: int = 1,
             resumes: bool = False) -> PushResult:
        """Write this rank's ``tensors`` as its shard of ``version``; returns once the shard is acknowledged.
        ``resumes``: the first push of a trainer world that starts (again) at step ``version``: it starts a
        new lineage, the parameter server retires its versions ``>= version`` instead of refusing the push.

        Only this rank's own tensors (no all-gather); the last rank's acknowledgement commits the version.
        The caller keeps ownership of ``tensors`` (they are copied out before this returns). Raises
        RemoteError for a refused push (``version-conflict``, ``shape-mismatch``, ``duplicate-name``,
        ``checksum``, ``push-aborted``, ...); any failure aborts the version.
        """
        with self.begin_push(tensors, version, rank=rank, world=world, resumes=resumes) as session:
            for name, tensor in tensors.items():
                session.write(name, tensor)
            return session.commit()

    def begin_push(self, like: Mapping[str, torch.Tensor], version: int, *, rank: int = 0,
                   world: int = 1, resumes: bool = False) -> PushSession:
        """Start a streaming push: the shard's layout comes from ``like`` (dtypes and shapes only); write
        each tensor when it is ready (e.g. layer by layer), then commit. See :class:`PushSession`."""
        specs = [TensorSpec(name, wire_dtype(t.dtype), list(t.shape)) for name, t in like.items()]
        grant = self._grant(PushBegin(version, rank, world, self.holder, specs, self.host, resumes))
        self._keeper.hold(grant.lease, grant.ttl_s)
        try:
            worker = self._worker(grant.worker)
            opened = self._ask(worker, ShardOpen(grant.lease, grant.nbytes), ShardOpened)
            path = self._local_path(grant.worker, opened.segment)
        except BaseException:
            self._abort_push(grant.lease)
            raise
        return PushSession(self, grant, version, rank, worker, path)

    def _grant(self, begin: PushBegin) -> PushGrant:
        """The manager's grant for a push. ``no-workers`` (every ps-worker down, e.g. restarting) is waited
        out, polling with a doubling pause, for up to ``wait_workers_s``: a push is worth a short wait,
        a trainer world that fails over it is not."""
        deadline = time.monotonic() + self.wait_workers_s
        pause = WORKERS_FIRST_PAUSE_S
        while True:
            try:
                return self._ask(self._manager, begin, PushGrant)
            except RemoteError as exc:
                if exc.code != "no-workers" or time.monotonic() + pause > deadline:
                    raise
                log.warning("push.waiting_for_workers", version=begin.version, retry_in_s=pause)
                time.sleep(pause)
                pause = min(2 * pause, WORKERS_MAX_PAUSE_S)

    def _abort_push(self, lease: str) -> None:
        """Releasing an uncommitted push lease aborts the version at once (no waiting for the TTL)."""
        self._keeper.drop(lease)
        with contextlib.suppress(RemoteError, RequestTimeout):
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
        * ``shared``: tensors on this host are read-only views of the workers' shared memory (no copy at
          all), valid until ``release()``; cast or ``out`` tensors are copies as usual.
        * ``verify``: hash every tensor against the manifest (tensors read as frames always are).

        Raises RemoteError (``unknown-version``, ``too-stale``, ...), LeaseExpired, PsError.
        """
        grant = self._ask(self._manager, PullBegin(self.holder, version, max_staleness), PullGrant)
        self._keeper.hold(grant.lease, grant.ttl_s)
        cast = _Cast(dtype, tuple(keep_fp32), out or {})
        try:
            tensors = self._read(grant.manifest, cast, shared=shared, verify=verify)
        except BaseException:
            self._keeper.drop(grant.lease)
            with contextlib.suppress(RemoteError, RequestTimeout):
                self._manager.request(LeaseRelease(grant.lease))
            raise
        if shared:
            return PulledState(grant.manifest, tensors, self, grant.lease)
        self._end_pull(grant.lease, grant.manifest.version)
        return PulledState(grant.manifest, tensors)

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
        workers = {w.worker: w for w in manifest.workers}
        result: dict[str, torch.Tensor] = {}
        remote: defaultdict[str, list[tuple[ManifestEntry, int, str]]] = defaultdict(list)
        with warnings.catch_warnings():
            # Read-only mappings are intended: torch warns that its tensors cannot be written through.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for entry in manifest.entries:
                local = self._local_location(entry, workers)
                if local is None:
                    location = entry.locations[0]
                    remote[location.worker].append((entry, location.offset, location.segment))
                    continue
                path, offset = local
                view = self._reads.view(path, offset, entry.nbytes)
                self.read_bytes["shm"] += entry.nbytes
                if verify:
                    _verify(entry, view)
                source = _typed(torch.frombuffer(view, dtype=torch.uint8) if entry.nbytes else None, entry)
                result[entry.name] = cast.deliver(entry.name, source, private=False, shared=shared)
        for worker_name, items in remote.items():
            result.update(self._read_frames(workers[worker_name], items, cast))
            self.read_bytes["frames" if self._nixl is None else "nixl"] += sum(entry.nbytes for entry, _, _ in items)
        return result

    def _read_frames(self, worker: WorkerInfo, items: list[tuple[ManifestEntry, int, str]],
                     cast: _Cast) -> dict[str, torch.Tensor]:
        wanted = [Wanted(entry, offset, segment) for entry, offset, segment in items]
        direct: dict[str, torch.Tensor] = {}

        def destination(entry: ManifestEntry) -> torch.Tensor:
            # Bytes go straight into an output tensor of the same layout; anything else via a buffer and deliver.
            target = cast.out.get(entry.name)
            if (target is not None and target.device.type == "cpu" and target.is_contiguous()
                    and target.dtype == torch_dtype(entry.dtype) and list(target.shape) == entry.shape):
                direct[entry.name] = target
                return target.reshape(-1).view(torch.uint8)
            return torch.empty(entry.nbytes, dtype=torch.uint8)

        client = self._worker(worker)
        try:
            if self._nixl is not None:
                # The bound the frames path gives the same bytes: one retry schedule per chunk_bytes request.
                chunks = -(-sum(item.entry.nbytes for item in wanted) // self.chunk_bytes)
                raws = self._nixl.read(wanted, lambda segment: self._ask(client, NixlOpen(segment), NixlOpened),
                                       destination, deadline_s=sum(client.policy.timeouts()) * max(1, chunks))
            else:
                raws = read_frames(client, wanted, destination, chunk_bytes=self.chunk_bytes, window=_WINDOW)
        except (FramesError, NixlError) as exc:
            raise PsError(f"{worker.worker}: {exc}") from exc
        result: dict[str, torch.Tensor] = {}
        for item, raw in zip(wanted, raws, strict=True):
            entry = item.entry
            if entry.name in direct:
                result[entry.name] = direct[entry.name]
            else:
                source = _typed(raw if entry.nbytes else None, entry)
                result[entry.name] = cast.deliver(entry.name, source, private=True, shared=False)
        return result

    # --- broadcast init, inspection -----------------------------------------------------------------

    def init(self, path: str, *, workers: Sequence[str] = (), chunk_bytes: int = 0,
             timeout_s: float = 600.0) -> InitResult:
        """Load a safetensors checkpoint into ``workers`` (default all) by tree broadcast; the new version.

        Raises RemoteError ``init-failed`` naming the worker that failed.
        """
        policy = RetryPolicy(timeout_s=timeout_s, attempts=1)
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

    def _ask(self, client: Client, body: Body, expect: type[ReplyT]) -> ReplyT:
        reply = client.request(body).body
        if not isinstance(reply, expect):
            raise PsError(f"{client.endpoint} answered {body.kind} with {reply.kind}, expected {expect.kind}")
        return reply

    def _worker(self, info: WorkerInfo) -> Client:
        client = self._workers.get(info.endpoint)
        if client is None:
            client = self._workers[info.endpoint] = self.runtime.client(info.endpoint)
        return client

    def _local_path(self, worker: WorkerInfo, segment: str) -> str | None:
        """The segment's file when this client may map it (same host, visible), else None."""
        if self.transport == "frames" or worker.host != self.host:
            if self.transport == "shm":
                raise PsError(f"worker {worker.worker} is on {worker.host}, not this host {self.host}")
            return None
        path = os.path.join(worker.shm_dir, segment)
        if os.path.exists(path):
            return path
        if self.transport == "shm":
            raise PsError(f"segment {path} of worker {worker.worker} is not visible from this process")
        return None

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

    def target(self, name: str, source: torch.Tensor) -> torch.dtype:
        if self.dtype is None or not source.is_floating_point():
            return source.dtype
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep_fp32):
            return torch.float32
        return self.dtype

    def deliver(self, name: str, source: torch.Tensor, *, private: bool, shared: bool) -> torch.Tensor:
        """``source`` views shared memory (``private=False``) or memory this process owns."""
        target = self.out.get(name)
        if target is not None:
            if target.shape != source.shape:
                raise PsError(f"out[{name!r}] has shape {list(target.shape)}, the version has {list(source.shape)}")
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
