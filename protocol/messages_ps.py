"""Message kinds of the parameter server (ps-manager, ps-worker and their clients).

Control plane (requests to the ps-manager): worker registration, push begin and shard commit, pull begin,
lease renewal and release, manifests and status, broadcast init, and the staleness inventory
(reserve / occupy / consume / abort). Data plane (requests to a ps-worker): shard open, write, seal and
read, segment release, and the broadcast-init stream (plan, header, chunks, end). Tensor bytes travel only
on the data plane, as buffer frames (``Array`` fields) or through shared memory named by ``segment``.

After a commit the manager publishes the foundation's ``version-bump`` event (never before).

Conventions: ``version`` fields that may be omitted (``None``) mean "the latest committed version";
``lease`` is an opaque id the manager hands out with a TTL; ``checksum`` is xxh3-64 of the raw bytes
(:func:`refbus.protocol.codec.checksum`); dtypes are the codec's portable names (``float32``,
``bfloat16``, ...); ``offset``/``nbytes`` are bytes inside a worker's segment.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .messages import Array, Body, Name, NonNegative, register_kind

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


# --- shared structures ------------------------------------------------------------------------------


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A tensor a pusher is about to write: its name, dtype and shape."""

    name: Name
    dtype: str
    shape: list[NonNegative]


class ShardTensor(msgspec.Struct, frozen=True, array_like=True):
    """A tensor inside one shard segment; ``checksum`` is 0 until the bytes are written."""

    name: Name
    dtype: str
    shape: list[NonNegative]
    offset: NonNegative
    nbytes: NonNegative
    checksum: NonNegative = 0


class Location(msgspec.Struct, frozen=True, array_like=True):
    """Where one copy of a tensor lives: a worker, a segment of it and the byte offset inside."""

    worker: Name
    segment: Name
    offset: NonNegative


class ManifestEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a committed version. Pushed tensors have one location; broadcast-init ones, one per
    worker that received the checkpoint."""

    name: Name
    dtype: str
    shape: list[NonNegative]
    nbytes: NonNegative
    checksum: NonNegative
    locations: list[Location]


class WorkerInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A registered ps-worker: its node id, data endpoint, host and shared-memory directory."""

    worker: Name
    endpoint: str
    host: str
    shm_dir: str
    pid: NonNegative = 0


class Manifest(msgspec.Struct, frozen=True):
    """A committed version: every tensor, where it lives, and the digest over (name, dtype, shape, nbytes,
    checksum) of all tensors, independent of placement."""

    version: NonNegative
    digest: str
    nbytes: NonNegative
    entries: list[ManifestEntry]
    workers: list[WorkerInfo]


class ByteRange(msgspec.Struct, frozen=True, array_like=True):
    offset: NonNegative
    nbytes: NonNegative


class BatchEntry(msgspec.Struct, frozen=True, array_like=True):
    """One trajectory of the staleness inventory: a reference (the manager never holds its bytes)."""

    prompt_id: Name
    trajectory: str
    policy_version: NonNegative


class InventoryBuffer(msgspec.Struct, frozen=True, array_like=True):
    version: NonNegative
    occupied: NonNegative
    reserved: NonNegative
    free: NonNegative
    state: str  # open, stuck, ready


# --- requests to the ps-manager ---------------------------------------------------------------------


@register_kind("ps-register")
class PsRegister(Body, frozen=True):
    """A ps-worker joins (or re-joins after a manager restart) the parameter server."""

    worker: WorkerInfo


@register_kind("ps-push-begin")
class PushBegin(Body, frozen=True):
    """Trainer rank ``rank`` of ``world`` starts writing its own tensors of ``version``."""

    version: NonNegative
    rank: NonNegative
    world: Positive
    holder: Name
    tensors: list[TensorSpec]
    host: str = ""  # the pusher's host: a worker there is preferred (writes go through shared memory)
    # The first push of a trainer world that (re)started from its checkpoint of step ``version``: it starts a
    # new lineage, the versions >= ``version`` of the old one are retired.
    resumes: bool = False


@register_kind("ps-shard-commit")
class ShardCommit(Body, frozen=True):
    """Sent by the worker once a rank's shard is written and every checksum verified: the worker's
    acknowledgement. The last rank's commit commits the version."""

    lease: Name
    version: NonNegative
    rank: NonNegative
    worker: Name
    segment: Name
    tensors: list[ShardTensor]


@register_kind("ps-pull-begin")
class PullBegin(Body, frozen=True):
    """Lease a committed version for reading: ``version`` (default latest), refused when it is more than
    ``max_staleness`` versions behind the trainer."""

    holder: Name
    version: NonNegative | None = None
    max_staleness: NonNegative | None = None


@register_kind("ps-lease-renew")
class LeaseRenew(Body, frozen=True):
    """Keep leases (and staleness reservations, by prompt id) alive for another TTL."""

    leases: list[str] = []
    prompts: list[str] = []


@register_kind("ps-lease-release")
class LeaseRelease(Body, frozen=True):
    """End a lease. Releasing a push lease before its shard commit aborts the push; releasing a pull lease
    that already expired is a ``lease-expired`` error (the bytes read may have been reused)."""

    lease: Name


@register_kind("ps-manifest")
class ManifestQuery(Body, frozen=True):
    version: NonNegative | None = None


@register_kind("ps-status")
class PsStatus(Body, frozen=True):
    pass


@register_kind("ps-init")
class InitRequest(Body, frozen=True):
    """Load a safetensors checkpoint into ``workers`` (default: every registered one) by binary-tree
    broadcast; answered once every worker verified its copy, or with ``init-failed``."""

    path: str
    workers: list[str] = []
    chunk_bytes: NonNegative = 0  # 0: the manager's configured chunk size


@register_kind("ps-init-done")
class InitDone(Body, frozen=True):
    """A worker holds and verified the whole checkpoint of ``init_id``."""

    init_id: Name
    worker: Name
    segment: Name
    file_opens: NonNegative  # how many times this worker opened the checkpoint file
    tensors: list[ShardTensor] = []  # the root's layout and checksums (the root reports them)


@register_kind("ps-init-failed")
class InitFailed(Body, frozen=True):
    """``reporter`` saw ``worker`` fail during broadcast ``init_id``."""

    init_id: Name
    reporter: Name
    worker: Name
    reason: str


@register_kind("ps-reserve")
class Reserve(Body, frozen=True):
    """Reserve ``count`` slots for a rollout group starting at ``policy_version``. A ``leased`` reservation
    is aborted after the manager's lease TTL unless renewed (``ps-lease-renew{prompts}``)."""

    prompt_id: Name
    policy_version: NonNegative
    count: Positive = 1
    leased: bool = False


@register_kind("ps-occupy")
class Occupy(Body, frozen=True):
    prompt_id: Name
    trajectory: str
    policy_version: NonNegative


@register_kind("ps-consume")
class Consume(Body, frozen=True):
    version: NonNegative | None = None


@register_kind("ps-abort")
class Abort(Body, frozen=True):
    prompt_id: Name


@register_kind("ps-inventory")
class InventoryQuery(Body, frozen=True):
    pass


# --- requests to a ps-worker ------------------------------------------------------------------------


@register_kind("ps-shard-open")
class ShardOpen(Body, frozen=True):
    """Allocate (or reuse) a segment of at least ``nbytes`` for the push holding ``lease``."""

    lease: Name
    nbytes: NonNegative


@register_kind("ps-shard-write")
class ShardWrite(Body, frozen=True):
    """Bytes of a shard through frames (cross-host): ``data[i]`` (uint8) goes to ``offsets[i]``."""

    lease: Name
    offsets: list[NonNegative]
    data: list[Array]


@register_kind("ps-shard-seal")
class ShardSeal(Body, frozen=True):
    """Every byte is written: verify ``tensors``' checksums and commit the shard at the manager."""

    lease: Name
    version: NonNegative
    rank: NonNegative
    tensors: list[ShardTensor]


@register_kind("ps-shard-read")
class ShardRead(Body, frozen=True):
    """Read byte ranges of a segment (cross-host pulls). The caller holds a pull lease on the version."""

    segment: Name
    ranges: list[ByteRange]


@register_kind("ps-release")
class Release(Body, frozen=True):
    """Manager to worker: the shards (push leases or init ids) are no longer needed; recycle their memory."""

    shards: list[str]


@register_kind("ps-init-plan")
class InitPlan(Body, frozen=True):
    """Manager to the root worker: read ``path`` and broadcast it to ``workers`` (rank order; the root is
    rank 0). Each worker derives its children from its rank, so the plan travels down with the header."""

    init_id: Name
    path: str
    workers: list[WorkerInfo]
    chunk_bytes: Positive
    ack_timeout_s: Seconds


@register_kind("ps-init-header")
class InitHeader(Body, frozen=True):
    """Parent to child: the tree and the checkpoint's layout, so the child can allocate its segment."""

    init_id: Name
    workers: list[WorkerInfo]
    ack_timeout_s: Seconds
    nbytes: NonNegative
    tensors: list[ShardTensor]


@register_kind("ps-init-chunk")
class InitChunk(Body, frozen=True):
    init_id: Name
    offset: NonNegative
    data: Array  # uint8; its frame checksum is verified on receipt


@register_kind("ps-init-end")
class InitEnd(Body, frozen=True):
    """Parent to child: every chunk was sent; ``tensors`` carry the root's checksums to verify against."""

    init_id: Name
    tensors: list[ShardTensor]


# --- replies ----------------------------------------------------------------------------------------


@register_kind("ps-push-grant")
class PushGrant(Body, frozen=True):
    """Where rank's shard goes: the worker, the layout (offsets) and the lease to renew while writing."""

    lease: Name
    ttl_s: Seconds
    worker: WorkerInfo
    nbytes: NonNegative
    tensors: list[ShardTensor]


@register_kind("ps-shard-opened")
class ShardOpened(Body, frozen=True):
    segment: Name
    capacity: NonNegative


@register_kind("ps-committed")
class Committed(Body, frozen=True):
    """A rank's shard is acknowledged; ``committed`` when it was the last one and the version is visible."""

    version: NonNegative
    committed: bool
    digest: str = ""


@register_kind("ps-pull-grant")
class PullGrant(Body, frozen=True):
    lease: Name
    ttl_s: Seconds
    manifest: Manifest


@register_kind("ps-lease-state")
class LeaseState(Body, frozen=True):
    """Answer to a renewal: what is no longer held (expired or never known)."""

    expired: list[str] = []
    prompts_expired: list[str] = []


@register_kind("ps-manifest-info")
class ManifestInfo(Body, frozen=True):
    manifest: Manifest


@register_kind("ps-state")
class PsState(Body, frozen=True):
    """The manager's view: ``latest`` is -1 before the first commit."""

    latest: int
    retained: list[NonNegative]
    pinned: dict[str, NonNegative]  # version (as text) -> pull leases holding it
    pending: list[NonNegative]
    leases: NonNegative
    trainer_version: int
    workers: list[WorkerInfo]


@register_kind("ps-shard-data")
class ShardData(Body, frozen=True):
    data: list[Array]


@register_kind("ps-init-result")
class InitResult(Body, frozen=True):
    version: NonNegative
    digest: str
    workers: list[str]
    rounds: NonNegative
    file_opens: dict[str, NonNegative]
    seconds: float


@register_kind("ps-reserved")
class Reserved(Body, frozen=True):
    version: NonNegative


@register_kind("ps-placed")
class Placed(Body, frozen=True):
    version: NonNegative
    staleness: NonNegative
    ready: bool
    aborted_versions: list[NonNegative] = []


@register_kind("ps-batch")
class Batch(Body, frozen=True):
    """The consumed batch, or ``ready=False`` when buffer ``version`` is not READY yet."""

    version: NonNegative
    ready: bool
    entries: list[BatchEntry] = []


@register_kind("ps-aborted")
class Aborted(Body, frozen=True):
    version: NonNegative
    slots: NonNegative
    evicted: list[BatchEntry] = []


@register_kind("ps-inventory-state")
class InventoryState(Body, frozen=True):
    eta: NonNegative
    batch_size: NonNegative
    trainer_version: NonNegative
    highest_aborted: int
    buffers: list[InventoryBuffer]
    counters: dict[str, int]
