"""Every message kind of the refbus protocol, in one place.

A message body is a frozen msgspec Struct; its ``kind`` is the first frame on the wire (and the PUB/SUB
topic). Decoding validates the body against its Struct: a missing field, a wrong type or a value out of
range is a :class:`~refbus.protocol.errors.SchemaError`. Fields that a receiver does not know are ignored,
so a minor version may add optional fields; removing or retyping a field needs a new major version.

Array-valued fields (typed ``Array``) hold numpy arrays or torch tensors; they travel as out-of-band frames
(see :mod:`refbus.protocol.codec`), never inside the msgpack body.

Kinds by direction:

* events (PUB/SUB through the broker): ``episode-finished``, ``claim``, ``reference``, ``fetch-ack``,
  ``delete``, ``violation``, ``version-bump``, ``node-up``, ``node-down``, ``sync``, ``run-end``
* requests (DEALER to ROUTER): ``hello``, ``heartbeat``, ``bye``, ``nodes``, ``replay``, ``refill``, ``sync``, ``keep``,
  ``discard``, ``claim``, ``fetch``, ``delete``, ``accounts``, ``holdings``, ``step-batch``, ``run``,
  ``generate``
* replies: ``welcome``, ``ok``, ``node-list``, ``replayed``, ``kept``, ``blobs``, ``claimed``, ``deleted``,
  ``accounted``, ``held``, ``generated``, ``error``
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from .errors import shown

Array = Any  # numpy.ndarray or torch.Tensor; carried as a buffer frame (see codec)
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Major = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # a protocol major version
MAX_KEY_CHARS = 256
MAX_NODE_ENTRIES = 64
"""Entries a node's ``endpoints``, ``labels`` and ``status`` each hold at most. With their keys and values
bounded too, one registration is at most ~2.3 MB encoded (~0.6 MB in ASCII; real nodes: well under 1 KB), so
what the broker keeps and answers per node is bounded whatever a node sends."""

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def is_id(value: str, max_chars: int = MAX_KEY_CHARS) -> bool:
    """Whether ``value`` has the shape of a node id or role: 1 to ``max_chars`` ASCII letters, digits, '.', '_' or
    '-', the first a letter or digit (registrations, and the key directory's allow-list with its own bound)."""
    return len(value) <= max_chars and _ID.fullmatch(value) is not None


def id_problem(value: str, what: str = "node id") -> str:
    """What is wrong with ``value`` as a node id or role (``what`` names it); empty when nothing is (:func:`is_id`):
    ids name files (a node's durable store directory, its key files) and lines of output, where '/', '..', a NUL,
    a leading '-', a newline or a character a file name cannot carry would leave a directory, name another node's
    store once made a file name, read as a flag or forge a line."""
    if not is_id(value):
        return (f"{what} {shown(value)} is not 1 to {MAX_KEY_CHARS} letters, digits, '.', '_' or '-' starting with a "
                "letter or digit")
    return ""


def plain_name(name: str) -> bool:
    """True when ``name`` is one file name that stays in the directory it is joined to: not empty, no '/', no
    NUL, not '.' or '..'. A ps-worker names its nonce file and segments, a config its segments' prefix; an
    absolute or '../' name would make a client open (and, pushing, write into) a file of its own choosing."""
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


MAX_RUN_CHARS = 128
"""Characters of a run id at most: with a file name's 255 bytes, room for what a run's file names add to it."""


def run_id_problem(value: str) -> str:
    """What is wrong with ``value`` as a run id (``store.run``); empty when nothing is. A run id is a shorter node
    id without '.': it names store directories ``refbus-store.<run>.<node id>`` (and a launcher's checkpoint
    directory and rendezvous file), which stay apart per run and node only while the first '.' ends the run."""
    if len(value) > MAX_RUN_CHARS or not _RUN_ID.fullmatch(value):
        return (f"run id {shown(value)} is not 1 to {MAX_RUN_CHARS} letters, digits, '_' or '-' starting with a "
                "letter or digit")
    return ""


Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]  # a map key, a host name
Text = Annotated[str, msgspec.Meta(max_length=4096)]  # an endpoint, a URL, a label's value
Entries = Annotated[dict[Key, Text], msgspec.Meta(max_length=MAX_NODE_ENTRIES)]
Readings = Annotated[dict[Key, float], msgspec.Meta(max_length=MAX_NODE_ENTRIES)]
# One process of a node, what tells it from a restart under the same node id: host, pid, wall-clock start time
Process = tuple[Key, NonNegative, Annotated[float, msgspec.Meta(ge=0)]]

MAX_FRAMES = 65_536
"""Frames one message has at most (its kind, header, body, buffer frames and MAC frame): a receiver refuses one
with more (``malformed``) before it holds them, and a sender refuses to build one. High enough for what nodes
send (a step batch carries three inline arrays a micro batch: 21,844 micro batches a rank), low enough that one
message's frames held as objects stay within ~12 MiB whatever a peer sends."""

VIOLATION_SAMPLE = 16
"""Blob ids a ``violation`` event names at most (``sample``), however many its ``count`` says were refused."""

DELETE_REASONS = frozenset({
    "trained", "dropped", "filtered", "stale", "eval", "incomplete", "late", "max_steps", "unreferenced", "malformed",
    "claim-failed", "trainer-down", "shutdown", "undelivered", "discarded", "holder-down", "lost",
})
"""Every reason refbus gives a ``delete`` or ``discard`` (see :class:`Delete`). An env server refuses any other
(``bad-reason``): it counts what it deleted by reason (a metric series and an ``accounted`` entry each), so the
reasons a peer could make up would grow them without bound."""


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Base of all message bodies. Subclasses set ``kind``."""

    kind: ClassVar[str] = ""


KINDS: dict[str, type[Body]] = {}


def register_kind(name: str) -> Any:
    """Class decorator: register a Body subclass as the message kind ``name``."""

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

    node_id: Name  # unique node id
    role: Name  # `bus`, `env-server`, `orchestrator`, `trainer`, ...
    host: Key  # host name the node runs on
    pid: NonNegative  # process id
    endpoints: Entries = {}  # name -> endpoint it serves (`control`, `blobs`, ...)
    labels: Entries = {}  # role facts peers select on: an env server's source, a trainer's rank
    metrics: Text = ""  # http://host:port/metrics, or "" when the node serves none
    started: float = 0.0  # wall-clock start time
    last_seen: float = 0.0  # wall-clock time of its last heartbeat
    status: Readings = {}  # role numbers from its heartbeats


class BlobRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where one kept branch lives and what it holds: what travels instead of the arrays."""

    endpoint: str  # the env server's blob endpoint (fetch, claim, delete)
    source: Name  # the env server's source name: replicas of one source share it (default: its node id)
    blob_id: Name  # the store's id of this blob
    fields: list[str]  # the branch's array fields, in canonical order
    tokens: NonNegative  # tokens of the branch
    nbytes: NonNegative  # bytes of its arrays
    checksum: NonNegative  # xxh3-64 over the blob's array checksums, in field order
    routing_shape: list[int] | None = None  # [layers, top_k] when routed_experts is kept
    node: str = ""  # the store's node id: its endpoint is looked up again in the registry if it moved


class SampleSlice(msgspec.Struct, frozen=True, omit_defaults=True):
    """One sample of a micro batch: its blob (None: a sample without arrays) and its kept token count."""

    sample_id: str  # the sample's id
    tokens: NonNegative  # tokens kept for it in this micro batch
    ref: BlobRef | None = None  # its blob


class MicroBatchRefs(msgspec.Struct, frozen=True, omit_defaults=True):
    """A packed micro batch as references, in packing order; ``inputs`` carries small inline arrays
    (token ids, advantages) that the framework ships with it."""

    samples: list[SampleSlice]  # the samples, in packing order
    length: NonNegative  # padded token length
    dummy: bool = False  # padding batch: trained with zero weight
    inputs: dict[str, Array] = {}  # small inline arrays, by name


class ReplayedEvent(msgspec.Struct, frozen=True, array_like=True):
    """One message of the replay ring, an event or a batch of one source's events: its frames exactly as the
    broker received them (any form, with the MAC frame when signed), so the MAC verifies and the envelope
    decodes as if it came live."""

    frames: Annotated[list[bytes], msgspec.Meta(min_length=1, max_length=MAX_FRAMES)]  # a message's frames as received


# Not tracked by the garbage collector (gc=False): a trainer holds one per blob until its step ends, each a
# GC-tracked object more for every collection to count and traverse (~1 ms a step of 1024 blobs). It holds a
# name and a dict of arrays (decoded; Hashed ones when sent) and nothing refers back to it, so it is never part
# of a reference cycle, which would leak untracked. Not in the docstring: that is the protocol reference's text.
class FetchedBlob(msgspec.Struct, frozen=True, gc=False):
    """One blob of a ``blobs`` answer: its arrays, each a buffer frame."""

    blob_id: Name  # the blob
    arrays: dict[str, Array]  # field -> array, in the blob's field order


# --- events -----------------------------------------------------------------------------------------


@register_kind("node-up")
class NodeUp(Body, frozen=True):
    node: NodeInfo  # the node, as registered


@register_kind("node-down")
class NodeDown(Body, frozen=True):
    node_id: Name  # the node gone
    role: Name  # its role
    reason: str  # "bye" (clean exit), "timeout" (missed heartbeats) or "replaced" (another process took the id)
    last_seen: float  # wall-clock time of its last heartbeat


@register_kind("sync")
class Sync(Body, frozen=True):
    """Slow-joiner handshake; refbus subscribers consume it (a raw SUB socket sees it too).

    As an event: a probe with ``token``, not part of any sequence. Its header ``seq`` is the sender's latest
    event sequence number (0 from the broker and before a node's first event): a subscriber that has seen
    less of that incarnation has lost the tail of its stream and fills it from the ring.

    As a request to the broker: ``path="pub"`` is answered once the broker has received the node's probe
    through its PUB socket (answered late, when it arrives); ``path="sub"`` makes the broker publish the probe
    to subscribers, so a SUB socket can see that its subscription is live.
    """

    token: Name  # probe token chosen by the node
    path: Literal["pub", "sub"] = "pub"  # which path the probe proves (requests only)


@register_kind("episode-finished")
class EpisodeFinished(Body, frozen=True):
    """An env server kept an episode's arrays; ``refs`` (one per branch) are what travels instead.

    ``info`` is the framework's small episode record (reward, token ids, ...); arrays in it ride as frames.
    ``again``: published again by a restarted durable store for an episode it re-adopted that nobody had
    claimed (its first process may have died between committing the keep and publishing the event, so the
    stream may or may not carry the first one): the same record; readers that count episodes count it once.
    """

    episode_id: Name  # the episode
    source: Name  # the store's source name
    refs: list[BlobRef]  # one per kept branch, in order
    policy_version: NonNegative = 0  # version that produced it
    info: dict[str, Any] = {}  # the framework's episode record
    again: bool = False  # a restarted store's repeat of an unclaimed episode's event


@register_kind("claim")
class Claim(Body, frozen=True):
    """Request to an env server and its mirror event: ``holder`` takes ownership of ``blob_ids``.

    The acknowledged hand-over from the env server; unclaimed blobs are deleted when their lease ends.
    """

    blob_ids: list[str]  # blobs to take over
    holder: Name  # the new owner


CLAIMS_BACK = "claims_back"
"""The registration label by which a process says whether it may claim back what earlier processes under its node
id held (``"0"``: never; a trainer rank, restarted with its whole world from a checkpoint, trains new data). A
store then reclaims what a holder reported down held as soon as such a new process registers under its id,
instead of waiting out the grace (``node.restart_grace_s``) for claims that never come."""


THIRD_PARTY_HAND_OVER = "third-party-hand-over"
"""The code under which a node counts a ``reference`` it refused (``refbus_bus_events_rejected_total``): published
by neither end of the hand-over."""


@register_kind("reference")
class Reference(Body, frozen=True):
    """Event: the orchestrator handed ``blob_ids`` to trainer ``holder`` for ``step`` (mirror of the
    acknowledged ``step-batch`` request). ``process``: the rank's process that took them (host, pid, start
    time), which the orchestrator names, so a store that learns of the hand-over after that process is gone
    reclaims them as that holder's. Any peer may publish one, so it counts only from one of its two ends: the
    blobs' holder (the orchestrator that claimed them) or ``holder`` itself; one from a third node moves nothing
    (logged, counted in ``refbus_bus_events_rejected_total`` under code ``third-party-hand-over``)."""

    step: NonNegative  # training step
    holder: Name  # the trainer rank
    blob_ids: list[str]  # blobs handed over
    process: Process | None = None  # the holder's process that took them (None: not named)


@register_kind("fetch-ack")
class FetchAck(Body, frozen=True):
    """Event: ``holder`` fetched and verified ``blob_ids`` for ``step`` (``nbytes`` in ``seconds``, until the
    tensors were assembled; ``failed``: micro batches it could not fetch)."""

    step: NonNegative  # training step
    holder: Name  # the trainer rank
    blob_ids: list[str]  # blobs fetched and verified
    nbytes: NonNegative = 0  # bytes fetched
    seconds: float = 0.0  # fetch and assembly time
    failed: NonNegative = 0  # micro batches not fetched


@register_kind("version-bump")
class VersionBump(Body, frozen=True):
    version: NonNegative  # the committed policy version
    nbytes: NonNegative  # bytes of its weights
    manifest_digest: str  # digest of its manifest


@register_kind("delete")
class Delete(Body, frozen=True):
    """Request to an env server and its mirror event: ``holder`` deletes ``blob_ids`` for ``reason``, one of
    ``DELETE_REASONS``: a trainer rank's ``trained`` and ``dropped``; the orchestrator's ``filtered``, ``stale``,
    ``eval``, ``incomplete``, ``late``, ``max_steps``, ``unreferenced``, ``malformed``, ``claim-failed``,
    ``trainer-down`` and ``shutdown``; the store's own ``undelivered``, ``shutdown`` and ``discarded``. An env
    server refuses a request with any other reason ``bad-reason``, deleting nothing.

    Two reasons come from liveness and name a ``node``: ``holder-down`` (the env server deleted what that
    holder held: it went down and was not back within ``node.restart_grace_s``, or a new process that claims
    nothing back, label ``claims_back`` ``"0"``, registered under its id) and ``lost`` (an event only,
    published by the holder: the store ``node`` went down and was not back within the grace, so its blobs
    are gone without a delete)."""

    blob_ids: list[str]  # blobs to delete
    holder: Name  # who deletes them (their owner)
    reason: Name  # why (see above)
    node: str = ""  # the node whose going down caused it: the dead holder (holder-down), the dead store (lost)


@register_kind("violation")
class Violation(Body, frozen=True):
    """Event: an ownership rule was broken (a second delete, a delete or claim by a non-owner, a fetch of
    a deleted blob). Logged and counted where it happened; tests assert there are none. One event per refused
    request and (``action``, ``holder``, ``owner``), however many ids it names: ``count`` ids were refused,
    ``blob_id`` is the first of them and ``sample`` the first ``VIOLATION_SAMPLE`` (16), in request order. A
    reader older than ``count`` reads one violation of ``blob_id``."""

    blob_id: str  # the first blob refused
    action: Name  # delete, fetch, claim
    holder: Name  # who tried
    owner: str  # who held it (or who deleted it), "" if never known
    detail: str  # what happened to the first blob, for people
    count: Positive = 1  # blob ids refused alike, ``blob_id`` included
    sample: Annotated[list[str], msgspec.Meta(max_length=VIOLATION_SAMPLE)] = []  # the first ids refused (at most 16)


@register_kind("run-end")
class RunEnd(Body, frozen=True):
    """Event: the launcher finished the run (``reason``: ``done``, ``interrupted`` or ``failed``) after its
    holders stopped and before its stores do. A live ``refbus ledger`` stops here: a blob then held by
    anyone but its store is a leak."""

    reason: Name  # `done`, `interrupted` or `failed`
    steps: NonNegative = 0  # steps trained


# --- requests ---------------------------------------------------------------------------------------


@register_kind("hello")
class Hello(Body, frozen=True):
    """Registration with the broker. ``wire`` lists the protocol majors the node speaks (empty: only the one
    in this message's header); the broker answers with the one it chose, or a ``version`` error. A ``probe`` only
    asks whether ``node`` could take its id: answered ``ok`` where a hello would be let in, refused ``id-in-use``
    as one would be, and nothing is registered or replaced (a broker that predates probes answers ``welcome``,
    registering it)."""

    node: NodeInfo  # the registering node
    token: Name  # the node publishes ``sync`` with this token until the broker has seen it
    wire: Annotated[list[Major], msgspec.Meta(max_length=16)] = []  # protocol majors spoken
    probe: bool = False  # only ask whether the id could be taken: nothing registered, no holder replaced


@register_kind("heartbeat")
class Heartbeat(Body, frozen=True):
    """A registered node is alive. ``process`` names the sender (host, pid, start time, as in its ``hello``): the
    broker refuses ``replaced`` a heartbeat from another process than the one registered under ``node_id`` now,
    so a process whose id a later one took cannot keep that one's entry live once it is gone."""

    node_id: Name  # the node
    status: Readings = {}  # role numbers shown in the registry
    process: Process | None = None  # the sending process (None: not named, taken as the registered one)


@register_kind("bye")
class Bye(Body, frozen=True):
    """A registered node leaves: the broker removes its entry (``node-down``, reason ``bye``). ``process`` names
    the sender as a heartbeat's does: the broker refuses ``replaced`` a bye from another process than the one
    registered under ``node_id`` now, so a process whose id a later one took cannot remove that one's entry."""

    node_id: Name  # the node leaving
    reason: str = "shutdown"  # why it leaves
    process: Process | None = None  # the leaving process (None: not named, taken as the registered one)


@register_kind("nodes")
class Nodes(Body, frozen=True):
    role: Key = ""  # "" lists every role


@register_kind("replay")
class Replay(Body, frozen=True):
    """Events with per-source ``seq >= since`` from the broker's ring, in ring order, from ring position
    ``cursor`` on, at most ``limit`` messages (and about half the body limit in bytes, half ``max_items`` in
    list elements, each frame counted) per answer. A batch whose last event qualifies comes whole: the reader
    skips its events below ``since``. A message that no answer within the body limit could carry (an event
    near the limit, one with large or many array frames) is skipped, and counted by the broker: its events are
    missing to the reader (a gap fill counts them lost)."""

    since: NonNegative = 0  # first per-source seq wanted
    src: str = ""  # "" replays every source
    limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 10_000  # most messages per answer
    cursor: NonNegative = 0  # ring position to start from


@register_kind("refill")
class Refill(Body, frozen=True):
    """A publisher hands the broker its own recent events again (after the broker restarted, or after its
    publish path broke): the broker adds them to its ring, not to the live stream, so subscribers recover
    them by gap fill and drop what they already have by sequence number. Answered ``ok``."""

    events: list[ReplayedEvent]  # the sender's own events, oldest first, frames exactly as first published


@register_kind("keep")
class Keep(Body, frozen=True):
    """Request to an env server from a remote producer (a rollout worker): keep these branches' arrays.

    Each branch maps field names (``routed_experts``, ``topk_ids``, ``topk_logprobs``, ``mask_ids``,
    ``mask_counts``) to arrays. Answered with ``kept``; the env server then publishes ``episode-finished``.
    Refused ``over-budget`` when what it would hold exceeds ``env_server.budget_bytes``: each blob's array bytes
    in whole pages plus a fixed overhead, and ``info`` (held with the episode's record while a blob of it lives).
    """

    episode_id: Name  # unique per store
    branches: list[dict[str, Array]]  # per branch: field -> array
    policy_version: NonNegative = 0  # version that produced it
    info: dict[str, Any] = {}  # small episode record, published as is


@register_kind("discard")
class Discard(Body, frozen=True):
    """Request to an env server: the client abandoned this episode; delete what it kept (once). ``reason`` is one
    of ``DELETE_REASONS`` other than those the store gives its own deletes (``holder-down``, ``lost``,
    ``undelivered``, ``shutdown``); any other is refused ``bad-reason``."""

    episode_id: Name  # the episode
    reason: Name = "discarded"  # delete reason


@register_kind("run")
class Run(Body, frozen=True):
    """Request from the orchestrator to an env server: run one episode of ``prompt`` (answered with ``ok``
    once the episode is kept and ``episode-finished`` is published, or with an error)."""

    episode_id: Name  # the episode to run
    group: Name  # its group
    prompt: list[int]  # token ids
    eval: bool = False  # an evaluation episode


@register_kind("generate")
class Generate(Body, frozen=True):
    """Request from an env server to a rollout worker: complete ``prompt`` with the weights it serves."""

    prompt: list[int]  # token ids
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)]  # tokens to generate at most
    # Seconds the sender waits for the reply from sending it (0: not said, as by an older sender): a worker
    # drops a request still queued that long after it arrived, unstarted (answered ``expired``).
    deadline_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


@register_kind("generated")
class Generated(Body, frozen=True):
    """Reply to ``generate``: the full sequence (prompt included), the policy version that produced it,
    and the per-token arrays to keep (a branch: field name -> array, as frames)."""

    tokens: list[int]  # prompt and completion token ids
    policy_version: NonNegative  # version of the weights used
    arrays: dict[str, Array]  # the branch to keep: field -> array


@register_kind("fetch")
class Fetch(Body, frozen=True):
    """Request to an env server: the arrays of ``blob_ids`` (answered with ``blobs``)."""

    blob_ids: list[str]  # blobs wanted
    holder: Name  # who asks
    step: NonNegative = 0  # training step it is for


@register_kind("accounts")
class Accounts(Body, frozen=True):
    """Request to an env server: its blob counters (answered with ``accounted``), ``holders`` at most in
    ``held_by`` and ``reclaimed`` (the largest; the rest summed under ``*``)."""

    holders: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64  # most holders listed by name


@register_kind("holdings")
class HoldingsQuery(Body, frozen=True):
    """Request to an env server: the episodes with a live blob held by ``holder`` or still unclaimed
    (answered with ``held``), in keep order, from keep position ``after`` on, at most ``limit`` (and about a
    quarter of the body limit in bytes) per answer. What a restarted holder asks to take back what its
    earlier incarnation held."""

    holder: Name  # whose holdings
    after: NonNegative = 0  # keep position to start from
    limit: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 256  # most episodes per answer


@register_kind("step-batch")
class StepBatch(Body, frozen=True):
    """Request from the orchestrator to one trainer rank: its micro batches for ``step``.

    Acknowledging it moves ownership of ``owned`` (the blobs this rank deletes after the step) to the rank;
    micro batches may also reference blobs owned by other ranks (dummies repeat real routing rows). A rank takes
    it only from a node its registry lists live as the orchestrator (``not-orchestrator``), and only for a step
    at most ``orchestrator.max_staleness`` + 2 ahead of the one it trains next (``step-too-far``).
    """

    step: NonNegative  # training step
    rank: NonNegative  # the trainer rank
    micro_batches: list[MicroBatchRefs]  # its micro batches
    owned: list[str]  # blobs this rank deletes after the step
    policy_version: NonNegative = 0  # version the batch is for


# --- replies ----------------------------------------------------------------------------------------


@register_kind("welcome")
class Welcome(Body, frozen=True):
    """The broker's answer to ``hello``: where to publish and subscribe, and the liveness timing."""

    broker_id: Name  # the broker's node id
    events_in: str  # XSUB endpoint to publish to
    events_out: str  # XPUB endpoint to subscribe to
    heartbeat_interval: float  # seconds between heartbeats
    node_timeout: float  # seconds without one before node-down
    wire: NonNegative = 0  # the protocol major chosen from the hello's ``wire``
    event_batch: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 1  # events a node may send in one message (2.2)


@register_kind("ok")
class Ok(Body, frozen=True):
    detail: str = ""  # optional note


@register_kind("node-list")
class NodeList(Body, frozen=True):
    nodes: list[NodeInfo]  # the live nodes
    # live nodes left out, the largest entries first, because the answer would not fit the body limit with them
    omitted: NonNegative = 0


@register_kind("replayed")
class Replayed(Body, frozen=True):
    events: list[ReplayedEvent]  # ring messages (events, batches of events), in ring order
    more: bool  # True when the answer was cut; ask again from ``cursor``
    cursor: NonNegative = 0  # ring position after the last message examined


@register_kind("blobs")
class Blobs(Body, frozen=True):
    """Reply to ``fetch``: the blobs found, and the ids that were unknown or already deleted."""

    blobs: list[FetchedBlob]  # blobs found, in request order
    missing: list[str] = []  # ids unknown or deleted


@register_kind("claimed")
class Claimed(Body, frozen=True):
    """Reply to ``claim``: ids now owned by the claimer, ids that no longer exist (lease ended, never kept),
    ids refused because another holder owns them, and ids refused as stale: the store reclaimed them from a
    holder that went down (``holder-down``), so nobody may own them again."""

    blob_ids: list[str]  # now owned by the claimer
    missing: list[str] = []  # gone or never kept
    violations: list[str] = []  # owned by another holder
    reclaimed: list[str] = []  # taken back from a holder that went down


@register_kind("deleted")
class Deleted(Body, frozen=True):
    """Reply to ``delete``: ids deleted now, ids refused as ownership violations (already deleted), ids
    this store never kept, and ids refused as stale: the store reclaimed them from a holder that went down
    (``holder-down``), which is no violation."""

    blob_ids: list[str]  # deleted now
    violations: list[str] = []  # already deleted
    missing: list[str] = []  # never kept here
    reclaimed: list[str] = []  # taken back from a holder that went down


@register_kind("accounted")
class Accounted(Body, frozen=True):
    """Reply to ``accounts``: a store's counters since it started, as of its event ``seq`` (every event it
    published up to ``seq`` is counted, none after). ``kept = sum(deleted) + held``; ``held_by``: blobs
    held by claimer (``""``: unclaimed, the store's own); ``reclaimed``: blobs deleted ``holder-down``, by
    the holder that went down; ``violations``: refused requests by action."""

    store: Name  # node id
    seq: NonNegative  # the store's last event seq counted
    kept: NonNegative  # blobs kept
    held: NonNegative  # blobs alive now
    deleted: dict[str, NonNegative] = {}  # deleted, by reason
    held_by: dict[str, NonNegative] = {}  # alive, by holder
    reclaimed: dict[str, NonNegative] = {}  # deleted holder-down, by holder
    violations: dict[str, NonNegative] = {}  # refused requests, by action


class HeldEpisode(msgspec.Struct, frozen=True, omit_defaults=True):
    """One episode of a ``held`` answer: its ``episode-finished`` record as published (every ref, whoever
    holds it now), the ids of its live blobs ``held`` by the asking holder, and those still ``unclaimed``."""

    episode: EpisodeFinished  # as published
    held: list[str] = []  # its blobs held by the asker
    unclaimed: list[str] = []  # its blobs nobody claimed


@register_kind("held")
class Held(Body, frozen=True):
    """Reply to ``holdings``: one page of episodes; ``more`` when the answer was cut (ask again from
    ``cursor``, the keep position after the last episode examined)."""

    episodes: list[HeldEpisode]  # one page
    cursor: NonNegative  # keep position to ask from next
    more: bool = False  # the answer was cut


@register_kind("kept")
class Kept(Body, frozen=True):
    """Reply to ``keep``: one reference per branch, in order."""

    refs: list[BlobRef]  # one per branch, in order


@register_kind("error")
class Error(Body, frozen=True):
    """The reply to a request that failed. ``code`` is stable (``malformed``, ``unknown-blob``, ...).
    ``retry_after_s`` > 0: the failure is temporary (a store over its byte budget, or unable to journal the
    change) and the request changed nothing: the same request may succeed when sent again after that many
    seconds (such a reply is not cached)."""

    code: Name  # stable error code
    message: str  # what was wrong and where
    request_kind: str = ""  # kind of the failed request
    retry_after_s: float = 0.0  # > 0: temporary, retry after this long
