"""Every message kind of the refbus protocol, in one place.

A message body is a frozen msgspec Struct; its ``kind`` is the first frame on the wire (and the PUB/SUB
topic). Decoding validates the body against its Struct: a missing field, a wrong type or a value out of
range is a :class:`~refbus.protocol.errors.SchemaError`. Fields that a receiver does not know are ignored,
so a minor version may add optional fields; removing or retyping a field needs a new major version.

Array-valued fields (typed ``Array``) hold numpy arrays or torch tensors; they travel as out-of-band frames
(see :mod:`refbus.protocol.codec`), never inside the msgpack body.

Kinds by direction:

* events (PUB/SUB through the broker): ``episode-finished``, ``reference``, ``fetch-ack``, ``version-bump``,
  ``delete``, ``node-up``, ``node-down``, ``sync``
* requests (DEALER to ROUTER): ``hello``, ``heartbeat``, ``bye``, ``nodes``, ``replay``, ``sync``, ``fetch``,
  ``delete``
* replies: ``welcome``, ``ok``, ``node-list``, ``replayed``, ``blobs``, ``error``
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

Array = Any  # numpy.ndarray or torch.Tensor; carried as a buffer frame (see codec)
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Base of all message bodies. Subclasses set ``kind``."""

    kind: ClassVar[str] = ""


KINDS: dict[str, type[Body]] = {}


def _kind(name: str) -> Any:
    def register(cls: type[Body]) -> type[Body]:
        if name in KINDS:
            raise RuntimeError(f"kind {name!r} defined twice")
        cls.kind = name
        KINDS[name] = cls
        return cls

    return register


# --- shared structures ------------------------------------------------------------------------------


class NodeInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A live node as the broker's registry knows it."""

    node_id: Name
    role: Name
    host: str
    pid: NonNegative
    endpoints: dict[str, str] = {}
    metrics: str = ""  # http://host:port/metrics, or "" when the node serves none
    started: float = 0.0
    last_seen: float = 0.0
    status: dict[str, float] = {}


class BlobRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where one kept branch lives and what it holds; what travels instead of the arrays."""

    endpoint: str
    blob_id: Name
    fields: list[str]
    tokens: NonNegative
    nbytes: NonNegative
    checksum: NonNegative
    routing_shape: list[int] | None = None  # [layers, top_k] when routed_experts is kept


class BlobSlice(msgspec.Struct, frozen=True, omit_defaults=True):
    """One sample's use of a blob: the reference and how many tokens of it are kept after truncation."""

    ref: BlobRef
    kept_tokens: NonNegative


class ReplayedEvent(msgspec.Struct, frozen=True, array_like=True):
    """One event of the replay ring, as its original frames."""

    kind: str
    header: bytes
    body: bytes
    buffers: list[bytes]


class FetchedBlob(msgspec.Struct, frozen=True):
    blob_id: Name
    arrays: dict[str, Array]


# --- events -----------------------------------------------------------------------------------------


@_kind("node-up")
class NodeUp(Body, frozen=True):
    node: NodeInfo


@_kind("node-down")
class NodeDown(Body, frozen=True):
    node_id: Name
    role: Name
    reason: str  # "bye" (clean exit) or "timeout" (missed heartbeats)
    last_seen: float


@_kind("sync")
class Sync(Body, frozen=True):
    """Slow-joiner handshake; never shown as an event.

    As an event: a probe with ``token``. As a request to the broker: ``path="pub"`` is answered once the
    broker has received the node's probe through its PUB socket (answered late, when it arrives);
    ``path="sub"`` makes the broker publish the probe to subscribers, so a SUB socket can see that its
    subscription is live.
    """

    token: Name
    path: Literal["pub", "sub"] = "pub"


@_kind("episode-finished")
class EpisodeFinished(Body, frozen=True):
    episode_id: Name
    source: Name
    refs: list[BlobRef]
    policy_version: NonNegative = 0


@_kind("reference")
class Reference(Body, frozen=True):
    """The orchestrator hands a step's blobs to a trainer (mirror of the point-to-point move)."""

    step: NonNegative
    holder: Name
    slices: list[BlobSlice]


@_kind("fetch-ack")
class FetchAck(Body, frozen=True):
    step: NonNegative
    holder: Name
    blob_ids: list[str]


@_kind("version-bump")
class VersionBump(Body, frozen=True):
    version: NonNegative
    nbytes: NonNegative
    manifest_digest: str


@_kind("delete")
class Delete(Body, frozen=True):
    """Event and request: ``holder`` deletes ``blob_ids`` for ``reason`` (trained, filtered, ...)."""

    blob_ids: list[str]
    holder: Name
    reason: Name


# --- requests ---------------------------------------------------------------------------------------


@_kind("hello")
class Hello(Body, frozen=True):
    node: NodeInfo
    token: Name  # the node publishes ``sync`` with this token until the broker has seen it


@_kind("heartbeat")
class Heartbeat(Body, frozen=True):
    node_id: Name
    status: dict[str, float] = {}


@_kind("bye")
class Bye(Body, frozen=True):
    node_id: Name
    reason: str = "shutdown"


@_kind("nodes")
class Nodes(Body, frozen=True):
    role: str = ""  # "" lists every role


@_kind("replay")
class Replay(Body, frozen=True):
    """Events with per-source ``seq >= since`` from the broker's ring, oldest first, at most ``limit``."""

    since: NonNegative = 0
    src: str = ""  # "" replays every source
    limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 10_000


@_kind("fetch")
class Fetch(Body, frozen=True):
    blob_ids: list[str]
    holder: Name


# --- replies ----------------------------------------------------------------------------------------


@_kind("welcome")
class Welcome(Body, frozen=True):
    """The broker's answer to ``hello``: where to publish and subscribe, and the liveness timing."""

    broker_id: Name
    events_in: str
    events_out: str
    heartbeat_interval: float
    node_timeout: float


@_kind("ok")
class Ok(Body, frozen=True):
    detail: str = ""


@_kind("node-list")
class NodeList(Body, frozen=True):
    nodes: list[NodeInfo]


@_kind("replayed")
class Replayed(Body, frozen=True):
    events: list[ReplayedEvent]
    more: bool  # True when ``limit`` cut the answer; ask again from the last seq + 1


@_kind("blobs")
class Blobs(Body, frozen=True):
    blobs: list[FetchedBlob]


@_kind("error")
class Error(Body, frozen=True):
    """The reply to a request that failed. ``code`` is stable (``malformed``, ``unknown-blob``, ...)."""

    code: Name
    message: str
    request_kind: str = ""
