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

from .messages import Array, Body, Name, NonNegative, Positive, register_kind

Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


# --- shared structures ------------------------------------------------------------------------------


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A tensor a pusher is about to write: its name, dtype and shape."""

    name: Name  # tensor name
    dtype: str  # portable dtype name
    shape: list[NonNegative]  # dimensions


class ShardTensor(msgspec.Struct, frozen=True, array_like=True):
    """A tensor inside one shard segment; ``checksum`` is 0 until the bytes are written."""

    name: Name  # tensor name
    dtype: str  # portable dtype name
    shape: list[NonNegative]  # dimensions
    offset: NonNegative  # byte offset in the segment
    nbytes: NonNegative  # bytes
    checksum: NonNegative = 0  # xxh3-64 of the bytes


class Location(msgspec.Struct, frozen=True, array_like=True):
    """Where one copy of a tensor lives: a worker, a segment of it and the byte offset inside."""

    worker: Name  # ps-worker node id
    segment: Name  # shared-memory segment name
    offset: NonNegative  # byte offset in the segment


class ManifestEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a committed version. Pushed tensors have one location; broadcast-init ones, one per
    worker that received the checkpoint."""

    name: Name  # tensor name
    dtype: str  # portable dtype name
    shape: list[NonNegative]  # dimensions
    nbytes: NonNegative  # bytes
    checksum: NonNegative  # xxh3-64 of the bytes
    locations: list[Location]  # where its copies live


class WorkerInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A registered ps-worker: its node id, data endpoint, host and shared-memory directory."""

    worker: Name  # its node id
    endpoint: str  # its data endpoint
    host: str  # its host
    shm_dir: str  # its shared-memory directory
    pid: NonNegative = 0  # its process id
    boot_id: str = ""  # its kernel's boot id: a client elsewhere reads another one (or none)
    nonce_file: str = ""  # a file in shm_dir holding ``nonce``: only a client on its host reads it there
    nonce: str = ""  # random per worker process (hex); a client maps segments only after reading it back
    started: float = 0.0  # its process's start time, as in its registry entry (host, pid and this tell the process)


class Manifest(msgspec.Struct, frozen=True):
    """A committed version: every tensor, where it lives, and the digest over (name, dtype, shape, nbytes,
    checksum) of all tensors, independent of placement."""

    version: NonNegative  # policy version
    digest: str  # manifest digest
    nbytes: NonNegative  # bytes
    entries: list[ManifestEntry]  # every tensor
    workers: list[WorkerInfo]  # the workers


class ByteRange(msgspec.Struct, frozen=True, array_like=True):
    offset: NonNegative  # first byte
    nbytes: NonNegative  # bytes to read


class BatchEntry(msgspec.Struct, frozen=True, array_like=True):
    """One trajectory of the staleness inventory: a reference (the manager never holds its bytes)."""

    prompt_id: Name  # the rollout group's prompt
    trajectory: str  # reference to the trajectory (the manager holds no bytes)
    policy_version: NonNegative  # weights version the rollout started with


class InventoryBuffer(msgspec.Struct, frozen=True, array_like=True):
    version: NonNegative  # target training version
    occupied: NonNegative  # slots holding a trajectory
    reserved: NonNegative  # slots reserved by rollouts in flight
    free: NonNegative  # slots free
    state: str  # open, stuck, ready


# --- requests to the ps-manager ---------------------------------------------------------------------


@register_kind("ps-register")
class PsRegister(Body, frozen=True):
    """A ps-worker joins (or re-joins after a manager restart) the parameter server. One whose ``worker.worker`` is
    no node id, or whose ``worker.endpoint`` is no address to connect to (pushers and pullers are sent there), is
    refused ``schema``."""

    worker: WorkerInfo  # ps-worker node id
    segments: list[Name] = []  # segments of the sealed shards it holds (a restart: those it re-adopted)
    # Segment -> its shard id (push lease) for each of ``segments``: the manager releases those no version
    # or pending push needs any more (their release was lost while the worker was down).
    shards: dict[Name, Name] = {}


@register_kind("ps-push-begin")
class PushBegin(Body, frozen=True):
    """Trainer rank ``rank`` of ``world`` starts writing its own tensors of ``version``."""

    version: NonNegative  # version being pushed
    rank: NonNegative  # trainer rank
    world: Positive  # ranks in the trainer world
    holder: Name  # the pusher
    tensors: list[TensorSpec]  # this rank's tensors
    host: str = ""  # the pusher's host: a worker there is preferred (writes go through shared memory)
    # The first push of a trainer world that (re)started from its checkpoint of step ``version``: it starts a
    # new lineage, the versions >= ``version`` of the old one are retired.
    resumes: bool = False
    # The lease of this rank's attempt that failed on a worker (it died or could not be reached): that
    # attempt's copies are dropped and the rank starts over on other workers; the version stays pending.
    retry: str = ""
    # Workers the pusher could not reach: not granted again for this push while registered as a process its
    # attempts were granted (one restarted since under its id is not the one that failed).
    avoid: list[Name] = []
    # Drawn by a trainer world when it starts, the same for all its ranks ("" from a pusher that names none): a
    # resuming push joins the pending version another rank began only when both name the same token, and a
    # rank a restarted manager restored from its journal too (the same world, its push started over).
    world_token: str = ""


@register_kind("ps-shard-commit")
class ShardCommit(Body, frozen=True):
    """Sent by the worker once a rank's shard is written and every checksum verified: the worker's
    acknowledgement. The last rank's commit commits the version."""

    lease: Name  # lease id
    version: NonNegative  # policy version
    rank: NonNegative  # trainer rank
    worker: Name  # ps-worker node id
    segment: Name  # shared-memory segment name
    tensors: list[ShardTensor]  # layout and verified checksums


@register_kind("ps-pull-begin")
class PullBegin(Body, frozen=True):
    """Lease a committed version for reading: ``version`` (default latest), refused when it is more than
    ``max_staleness`` versions behind the trainer."""

    holder: Name  # the reader
    version: NonNegative | None = None  # version wanted; nil: the latest
    max_staleness: NonNegative | None = None  # most versions behind the trainer; nil: any


@register_kind("ps-lease-renew")
class LeaseRenew(Body, frozen=True):
    """Keep leases (and staleness reservations, by prompt id) alive for another TTL."""

    leases: list[str] = []  # lease ids to renew
    prompts: list[str] = []  # prompt ids whose reservations to renew


@register_kind("ps-lease-release")
class LeaseRelease(Body, frozen=True):
    """End a lease. Releasing a push lease before its shard commit aborts the push; releasing a pull lease
    that already expired is a ``lease-expired`` error (the bytes read may have been reused)."""

    lease: Name  # the lease to end


@register_kind("ps-manifest")
class ManifestQuery(Body, frozen=True):
    version: NonNegative | None = None  # nil: the latest


@register_kind("ps-status")
class PsStatus(Body, frozen=True):
    pass


@register_kind("ps-init")
class InitRequest(Body, frozen=True):
    """Load a safetensors checkpoint into ``workers`` (default: every registered one) by binary-tree
    broadcast; answered once every worker verified its copy, or with ``init-failed``."""

    path: str  # safetensors checkpoint path
    workers: list[str] = []  # worker ids; empty: every registered one
    chunk_bytes: NonNegative = 0  # 0: the manager's configured chunk size


@register_kind("ps-init-done")
class InitDone(Body, frozen=True):
    """A worker holds and verified the whole checkpoint of ``init_id``. The manager releases the copy of an init it
    never ran (and no version names) as an orphan: nothing else would."""

    init_id: Name  # the broadcast's id
    worker: Name  # ps-worker node id
    segment: Name  # segment holding the copy
    file_opens: NonNegative  # how many times this worker opened the checkpoint file
    tensors: list[ShardTensor] = []  # the root's layout and checksums (the root reports them)


@register_kind("ps-init-failed")
class InitFailed(Body, frozen=True):
    """``reporter`` saw ``worker`` fail during broadcast ``init_id``."""

    init_id: Name  # the broadcast's id
    reporter: Name  # the worker that saw it
    worker: Name  # the worker that failed
    reason: str  # what failed


@register_kind("ps-reserve")
class Reserve(Body, frozen=True):
    """Reserve ``count`` slots for a rollout group starting at ``policy_version``. A ``leased`` reservation
    is aborted after the manager's lease TTL unless renewed (``ps-lease-renew{prompts}``)."""

    prompt_id: Name  # the rollout group's prompt
    policy_version: NonNegative  # weights version the rollout started with
    count: Positive = 1  # slots to reserve
    leased: bool = False  # abort unless renewed within the lease TTL


@register_kind("ps-occupy")
class Occupy(Body, frozen=True):
    prompt_id: Name  # the rollout group's prompt
    trajectory: str  # reference to the trajectory (the manager holds no bytes)
    policy_version: NonNegative  # weights version the rollout started with


@register_kind("ps-consume")
class Consume(Body, frozen=True):
    """Take the trainer's next batch, answered ``Batch``. The batch the last consume took is answered again to a
    retry of that request or to a consume naming its buffer, after a ps-manager restart too (it is journaled):
    a reply lost with the manager loses no batch."""

    version: NonNegative | None = None  # buffer to consume; nil: the trainer's version


@register_kind("ps-abort")
class Abort(Body, frozen=True):
    prompt_id: Name  # the group whose reservations end


@register_kind("ps-inventory")
class InventoryQuery(Body, frozen=True):
    pass


# --- requests to a ps-worker ------------------------------------------------------------------------


@register_kind("ps-shard-open")
class ShardOpen(Body, frozen=True):
    """Allocate (or reuse) a segment of at least ``nbytes`` for the push holding ``lease``, answered once it is made
    (a slice a worker's loop turn, about 0.25 s/GiB; a repeated open of the lease meanwhile joins it). Until its
    seal verifies, it counts against the worker's ``ps.max_open_bytes`` (beyond: ``open-limit``) from the start
    and goes back to the pool ``ps.push_timeout_s`` after the open; ``no-room`` when the worker's filesystem
    cannot hold it; ``released`` when the lease is released before the segment is made, and for a later open of
    that lease."""

    lease: Name  # lease id
    nbytes: NonNegative  # bytes needed at least
    # Each tensor's bytes in the shard, when its pieces will come as ps-shard-write frames: the worker hashes them
    # as they are written instead of at seal. Optional (omitted when empty), so older peers neither send nor read it.
    tensors: list[ByteRange] = []


@register_kind("ps-shard-write")
class ShardWrite(Body, frozen=True):
    """Bytes of a shard through frames (cross-host): ``data[i]`` (uint8) goes to ``offsets[i]``."""

    lease: Name  # lease id
    offsets: list[NonNegative]  # where each data frame goes
    data: list[Array]  # uint8 arrays, one per offset; unhashed: the seal verifies every tensor


@register_kind("ps-shard-seal")
class ShardSeal(Body, frozen=True):
    """Every byte is written: verify ``tensors``' checksums and commit the shard at the manager (answered with the
    manager's answer). While the worker verifies, the shard takes no write (``sealed``); a release meanwhile is
    answered ``released``."""

    lease: Name  # lease id
    version: NonNegative  # version pushed
    rank: NonNegative  # trainer rank
    tensors: list[ShardTensor]  # layout and checksums to verify


@register_kind("ps-shard-read")
class ShardRead(Body, frozen=True):
    """Read byte ranges of a segment (cross-host pulls). The caller holds a pull lease on the version."""

    segment: Name  # shared-memory segment name
    ranges: list[ByteRange]  # byte ranges wanted


@register_kind("ps-nixl-open")
class NixlOpen(Body, frozen=True):
    """Expose a segment for NIXL reads (pulls with ``ps.transport = "nixl"``). The caller holds a pull lease
    on the version."""

    segment: Name  # shared-memory segment name


@register_kind("ps-release")
class Release(Body, frozen=True):
    """Manager to worker: the shards (push leases or init ids) are no longer needed; recycle their memory. A worker
    takes it only from the manager it registered with (``src`` its node id; others: ``not-manager``)."""

    shards: list[str]  # push lease ids or init ids


@register_kind("ps-init-plan")
class InitPlan(Body, frozen=True):
    """Manager to every worker of an init's tree (``workers``, rank order; the root, rank 0, last: once every other
    worker acknowledged its own): the root reads ``path`` and broadcasts it; every other worker takes that init's
    header only as this plan names it (its tree, from its parent). Each worker derives its children from its rank.
    A worker takes a plan only from the manager it registered with (``src`` its node id; others: ``not-manager``),
    naming it (else ``bad-init``), and the root reads only a regular file (anything else fails the init, by name)."""

    init_id: Name  # the broadcast's id
    path: str  # safetensors checkpoint path
    workers: list[WorkerInfo]  # the tree, in rank order (root first)
    chunk_bytes: Positive  # bytes per broadcast chunk
    ack_timeout_s: Seconds  # how long a parent waits for a child's acknowledgement


@register_kind("ps-init-header")
class InitHeader(Body, frozen=True):
    """Parent to child: the tree and the checkpoint's layout, so the child can allocate its segment. Taken only for
    an init the manager's plan announced to the child (else ``not-planned``, before any memory is spent), carrying
    the plan's tree (else ``bad-init``), from the worker that tree names as the child's parent (``src``; others:
    ``not-parent``), once per init (else ``bad-init``); ``no-room`` when the child's filesystem cannot hold the
    segment. Answered once the segment is made (the parent sends chunks only then): the parent waits
    ``ack_timeout_s`` plus 1 s a GiB of ``nbytes`` for that, the allowance a pusher's ``ps-shard-open`` has too.
    Until verified, the segment goes back to the pool ``ps.init_timeout_s`` after the header."""

    init_id: Name  # the broadcast's id
    workers: list[WorkerInfo]  # the tree, in rank order (root first)
    ack_timeout_s: Seconds  # how long a parent waits for a child's acknowledgement
    nbytes: NonNegative  # bytes of the checkpoint
    tensors: list[ShardTensor]  # the checkpoint's layout


@register_kind("ps-init-chunk")
class InitChunk(Body, frozen=True):
    """Parent to child: bytes of the checkpoint. Taken only after the init's header (else ``unknown-init``) and
    from its sender (else ``not-parent``)."""

    init_id: Name  # the broadcast's id
    offset: NonNegative  # byte offset in the checkpoint
    data: Array  # uint8; its frame checksum is verified on receipt


@register_kind("ps-init-end")
class InitEnd(Body, frozen=True):
    """Parent to child: every chunk was sent; ``tensors`` carry the root's checksums to verify against. Taken as
    the chunks are."""

    init_id: Name  # the broadcast's id
    tensors: list[ShardTensor]  # the root's layout and checksums


# --- replies ----------------------------------------------------------------------------------------


@register_kind("ps-push-grant")
class PushGrant(Body, frozen=True):
    """Where rank's shard goes: the worker, the layout (offsets) and the lease to renew while writing."""

    lease: Name  # lease id
    ttl_s: Seconds  # lease lifetime; renew before it ends
    worker: WorkerInfo  # where the shard goes
    nbytes: NonNegative  # shard bytes
    tensors: list[ShardTensor]  # the layout (offsets)
    # Further workers that each get a full copy (written by the pusher like the first); the version commits
    # only once every copy of every rank is verified.
    replicas: list[WorkerInfo] = []


@register_kind("ps-shard-opened")
class ShardOpened(Body, frozen=True):
    segment: Name  # the segment to write
    capacity: NonNegative  # its bytes


@register_kind("ps-nixl-opened")
class NixlOpened(Body, frozen=True):
    """A segment registered with the worker's NIXL agent, until it is released."""

    agent: str  # the worker's NIXL agent name (unique per worker incarnation)
    metadata: bytes  # the agent's metadata, for the reader's add_remote_agent
    address: NonNegative  # the segment's first byte in the worker's address space
    capacity: NonNegative  # the segment's bytes


@register_kind("ps-committed")
class Committed(Body, frozen=True):
    """A rank's shard is acknowledged; ``committed`` when it was the last one and the version is visible."""

    version: NonNegative  # the version
    committed: bool  # this was the last rank: the version is visible
    digest: str = ""  # the manifest digest, once committed


@register_kind("ps-pull-grant")
class PullGrant(Body, frozen=True):
    lease: Name  # lease id
    ttl_s: Seconds  # lease lifetime; renew before it ends
    manifest: Manifest  # the version's manifest


@register_kind("ps-lease-state")
class LeaseState(Body, frozen=True):
    """Answer to a renewal: what is no longer held (expired or never known)."""

    expired: list[str] = []  # leases no longer held
    prompts_expired: list[str] = []  # prompts whose reservations ended


@register_kind("ps-manifest-info")
class ManifestInfo(Body, frozen=True):
    manifest: Manifest  # the version's manifest


@register_kind("ps-state")
class PsState(Body, frozen=True):
    """The manager's view: ``latest`` is -1 before the first commit. A new lineage commits versions numbered
    as the ones it retired; ``latest_digest`` tells them apart (an older manager sends none)."""

    latest: int  # latest committed version
    retained: list[NonNegative]  # versions kept
    pinned: dict[str, NonNegative]  # version (as text) -> pull leases holding it
    pending: list[NonNegative]  # versions being pushed
    leases: NonNegative  # live leases
    trainer_version: int  # version the trainer trains next
    workers: list[WorkerInfo]  # registered workers
    latest_digest: str = ""  # manifest digest of ``latest`` ("" before the first commit)


@register_kind("ps-shard-data")
class ShardData(Body, frozen=True):
    data: list[Array]  # one uint8 array per range asked; unhashed: the reader verifies every tensor


@register_kind("ps-init-result")
class InitResult(Body, frozen=True):
    version: NonNegative  # version the checkpoint became
    digest: str  # its manifest digest
    workers: list[str]  # workers holding it
    rounds: NonNegative  # broadcast rounds
    file_opens: dict[str, NonNegative]  # checkpoint file opens, by worker
    seconds: float  # broadcast time


@register_kind("ps-reserved")
class Reserved(Body, frozen=True):
    version: NonNegative  # buffer the slots are in


@register_kind("ps-placed")
class Placed(Body, frozen=True):
    version: NonNegative  # buffer the trajectory went to
    staleness: NonNegative  # version minus policy version
    ready: bool  # the buffer is full
    aborted_versions: list[NonNegative] = []  # policy versions this placement aborted


@register_kind("ps-batch")
class Batch(Body, frozen=True):
    """The consumed batch, or ``ready=False`` when buffer ``version`` is not READY yet."""

    version: NonNegative  # the buffer
    ready: bool  # false: not full yet
    entries: list[BatchEntry] = []  # the batch


@register_kind("ps-aborted")
class Aborted(Body, frozen=True):
    version: NonNegative  # highest version aborted
    slots: NonNegative  # reservations ended
    evicted: list[BatchEntry] = []  # trajectories removed


@register_kind("ps-inventory-state")
class InventoryState(Body, frozen=True):
    eta: NonNegative  # most versions a trajectory may lag (η)
    batch_size: NonNegative  # slots per buffer (B)
    trainer_version: NonNegative  # version the trainer trains next
    highest_aborted: int  # every policy version up to it is aborted
    buffers: list[InventoryBuffer]  # one per target version
    counters: dict[str, int]  # event counters
