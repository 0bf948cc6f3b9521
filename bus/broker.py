"""The broker (``refbus node bus``): event forwarding, the node registry and the replay ring.

Sockets (all bound):

* ``events_in`` (XSUB): every node's PUB connects here. The broker subscribes to everything itself, so
  events reach the ring even when no subscriber is connected.
* ``events_out`` (XPUB): subscribers connect here; events are forwarded unchanged (frames are not
  re-encoded, array frames are not copied). A subscription to a topic longer than any event kind drops its
  connection (:func:`max_subscription_bytes`).
* ``control`` (ROUTER): ``hello``, ``sync``, ``heartbeat``, ``bye``, ``nodes``, ``replay``, ``refill``.

Without CURVE, events are forwarded by ZeroMQ's proxy on a thread of its own (:mod:`.forwarder`) and never
read on the way: subscribers check every event end to end (shape, version, sizes, MAC). The ring is filled
from the forwarder's capture in batches and reads an event's header (source, sequence number) only when a
replay first looks at it; one it cannot read is skipped and counted by error code. With CURVE the broker
forwards in Python, reading each event's header to refuse a ``src`` other than its connection's key (and
what it cannot read). The ring keeps the most recent events, bounded by count and by bytes. A broker that
dies takes its ring and registry with it; restarted on the same addresses, it rebuilds the registry from the
nodes' re-joins, and each node hands the new ring the events it still holds (``refill``: into the ring, not
the live stream), so subscribers' gap fills recover what the dead broker took (see :mod:`.runtime`).

Registry: a node registers with ``hello`` and proves its PUB path live with the ``sync`` handshake; then
the broker publishes ``node-up``. A node that says ``bye``, or misses heartbeats for ``node_timeout_s`` (on
the monotonic clock, counting no time the broker's own loop did not run: :meth:`Broker._credit_stall`), is removed
with ``node-down``. One node id, one live process: another process takes a
registered id only from a predecessor dying, and a live holder's id is refused it ``id-in-use``
(:meth:`Broker._check_holder`); a holder replaced after all (silent for half the node timeout, then heard
again) has its heartbeats refused ``replaced`` (they name their process) instead of keeping the new entry
live, and its bye too (it names its process) instead of removing it. The broker's own events come from its
node id with their own sequence. The registry holds at most ``max_nodes`` nodes, live or joining: a ``hello``
of a new node id past it is refused ``registry-full``.

Service discovery: the broker's metrics endpoint also answers ``/sd`` with every live node's metrics
endpoint (and its own) in the format of Prometheus's ``http_sd_configs``, so Prometheus finds a whole
cluster from one fixed address. A ``hello`` whose ``metrics`` is neither empty nor an ``http://host[:port]/path``
URL is refused ``schema`` (the node is not registered), so every member's entry can be listed. An endpoint is
listed only at the address the node's connection comes from (:func:`metrics_host_problem`): a node cannot
point Prometheus at another host. The labels that say whose series they are (node, role, cluster) are the
broker's, which a scrape config that does not honor the target's own labels keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import itertools
import queue
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog
import zmq

from ..protocol.envelope import MAX_KIND_BYTES, Limits, Message, negotiate
from ..protocol.errors import ProtocolError, shown
from ..protocol.messages import (
    MAX_FRAMES,
    Body,
    Bye,
    Error,
    Heartbeat,
    Hello,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Ok,
    Process,
    Refill,
    Replay,
    Replayed,
    ReplayedEvent,
    Sync,
    Welcome,
    id_problem,
)
from .forwarder import CAPTURE_HWM, SUBSCRIBE_ALL, Forwarder, held_bytes, is_event
from .metrics import ROUTES, by_label
from .peers import incarnation
from .pubsub import BATCH_EVENTS
from .reqrep import HandlerError, Pending, Server
from .runtime import ID_IN_USE, NodeRuntime
from .sockets import TooManyFrames, connect_problem, recv_from, send_frames
from .stall import PassStalls

log = structlog.get_logger(__name__)

SD_PATH = "/sd"  # the service-discovery path of the broker's metrics endpoint
CAPTURE_BATCH = 4096  # captured events drained into the ring per loop wake-up, at most
CAPTURE_REST_S = 0.050  # a capture drained of its backlog waits this long for the next batch
TOKEN_HORIZON_S = 60.0  # probe tokens seen, and PUB handshakes waiting for their probe, are kept this long
WAITING_MAX = 4096  # PUB handshakes waiting for their probe at most: past it the oldest is answered an error
# Probe tokens seen kept at most, the oldest forgotten first: a handshake whose token was forgotten is answered at
# its next probe (a node probes until it is).
SEEN_MAX = 4096
# (node id, role) pairs whose joins are counted at most: past it the oldest of nodes not registered now are
# forgotten (default node ids hold the pid: every restart leaves an id behind for good).
JOINS_MAX = 4096
# Host names of metrics URLs waiting to be resolved, at most: past it such a URL is not listed in /sd (a resolver
# that hangs must not queue lookups without end).
LOOKUPS_MAX = 64
# (role, host) pairs whose node slots are kept, and (role, host, slot) restart series, at most each: past it the
# least recently counted are forgotten (a node names its own host: a peer cannot grow the series for good).
RESTARTS_MAX = 4096
# Control requests read before a liveness pass, at most: the heartbeats queued behind a busy loop, and no more,
# so requests that keep coming faster than the broker answers them cannot hold the loop there (its capture and
# probes undrained, no node ever expired).
EXPIRE_DRAIN = 4096
# A ``replayed`` body besides its messages' frames: its fields (about 35 bytes; 3 map entries and the list of
# messages), and msgpack's length prefix of each frame, of each message's frame list and of each message (5 bytes
# each, at most).
REPLAYED_BYTES = 64
REPLAYED_ITEMS = 4
PREFIX_BYTES = 5
# What ZeroMQ frames a subscription in: ZMTP 3.1's SUBSCRIBE command (b"\x09SUBSCRIBE" and the topic; ZMTP 3.0's
# b"\x01" and the topic is shorter), and with CURVE, the MESSAGE command around every message (its name, nonce, MAC
# and flags).
SUBSCRIBE_FRAMING = 10
CURVE_FRAMING = 33


def max_subscription_bytes(curve: bool) -> int:
    """The most one message a subscriber sends the broker's XPUB may take on the wire (its ``ZMQ_MAXMSGSIZE``): a
    subscription to the longest topic refbus subscribes to, an event kind (``MAX_KIND_BYTES``). ZeroMQ keeps every
    subscription in a trie, about 80 bytes per byte of topic, and the forwarder passes it upstream to the XSUB and
    to every publisher's PUB, which keep it too (with CURVE the broker reads them off instead): a connection that
    sends a longer one is dropped by ZeroMQ as it decodes it, before anything keeps it. With CURVE the bound also
    holds the handshake's largest command, a SUB's INITIATE (276 bytes)."""
    return SUBSCRIBE_FRAMING + MAX_KIND_BYTES + (CURVE_FRAMING if curve else 0)


@dataclass(frozen=True)
class BrokerSettings:
    control: str = "tcp://127.0.0.1:7770"
    events_in: str = "tcp://127.0.0.1:7771"
    events_out: str = "tcp://127.0.0.1:7772"
    ring_events: int = 65_536
    ring_bytes: int = 256 << 20
    event_batch: int = BATCH_EVENTS  # what the welcome allows each node: events in one message, at most
    node_timeout_s: float = 5.0
    cluster: str = "local"  # the ``cluster`` label of every service-discovery target
    max_nodes: int = 4096  # nodes registered at most, live or still joining: a hello past it is refused


def sd_target(metrics_url: str) -> tuple[str, str]:
    """``(host:port, path)`` of a metrics URL, what an /sd group names (Prometheus scrapes it over http); ValueError,
    saying why, when ``metrics_url`` is no ``http://host[:port]/path`` URL."""
    try:
        url = urlsplit(metrics_url)  # raises on some (an unclosed IPv6 bracket)
        url.port  # noqa: B018 -- raises on a port that is not a number in 0..65535
    except ValueError:
        url = None
    if url is None or url.scheme != "http" or not url.hostname:
        raise ValueError(f"{shown(metrics_url)} is not an http://host[:port]/path URL")
    return url.netloc, url.path


def registration_problem(node: NodeInfo) -> str:
    """What makes ``node`` a registration the broker refuses (``schema``), naming the field; empty when nothing
    does: a node id or role that is none (:func:`~refbus.protocol.messages.id_problem`; peers name files and log
    lines after them), an endpoint peers could not connect to (:func:`~.sockets.connect_problem`: they connect to
    what a registration advertises, and ZeroMQ would take a port above 65535 modulo 65536, elsewhere) or a metrics
    endpoint that is no URL (:func:`sd_target`)."""
    if problem := id_problem(node.node_id):
        return f"hello.node.node_id: {problem}"
    if problem := id_problem(node.role, "role"):
        return f"hello.node.role: {problem}"
    for name, endpoint in node.endpoints.items():
        if problem := connect_problem(endpoint):
            return f"hello.node.endpoints[{shown(name)}]: {problem}"
    if node.metrics:
        try:
            sd_target(node.metrics)
        except ValueError as exc:
            return f"hello.node.metrics: {exc}"
    return ""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IPAddress | None:
    """``text`` as an IP address, an IPv4 address mapped into IPv6 as the IPv4 address; None when it is none."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def of_this_machine(ip: IPAddress) -> bool:
    """Whether ``ip`` is an address of this machine: loopback, or one a socket can bind."""
    if ip.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


def metrics_host_problem(addresses: Sequence[str], peer: str) -> str:
    """Why /sd must not list a metrics endpoint at ``addresses`` (its URL's host: the address, or every address the
    name resolves to) for a node whose control connection comes from ``peer`` (ZeroMQ's ``Peer-Address``); ""
    when it may. Each address must be the peer's own, or, for a peer on this machine, one of this machine's
    (loopback included): Prometheus then scrapes the node that registered, never a host it names. ZeroMQ names
    an IP address for every transport that crosses hosts, and an ipc peer ``localhost:<uid>:<gid>:<pid>``; a peer
    it names no address for is accepted nothing."""
    peer_ip = _ip(peer)
    local = of_this_machine(peer_ip) if peer_ip is not None else peer.split(":", 1)[0] == "localhost"
    for address in addresses:
        ip = _ip(address)
        if ip is None or not (ip == peer_ip or (local and of_this_machine(ip))):
            where = "an address of this machine" if local else "the node's own address"
            source = shown(peer) if peer else "an address ZeroMQ does not name"
            return (f"{shown(address)} is not {where}, where its connection to the broker comes from ({source}): "
                    "Prometheus would scrape another host")
    return ""


def resolved_problem(host: str, peer: str) -> str:
    """:func:`metrics_host_problem` of the host name ``host``, resolved (a lookup that may block: not on the loop
    thread), of its addresses in the IP family of ``peer``'s address only for a peer on another host (every one
    for a peer on this machine, where any address of this machine will do); why when it does not resolve, or to
    no address of that family. A dual-stack name resolves to an IPv4 and an IPv6 address while the node reaches
    the broker over one family, whose addresses are the ones the broker can check; the other family's are the
    name's word, as its later records are (docs/SECURITY.md)."""
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except OSError as exc:
        return f"{shown(host)} does not resolve here: {exc}"
    peer_ip = _ip(peer)
    if peer_ip is not None and not of_this_machine(peer_ip):
        addresses = [a for a in addresses if (ip := _ip(a)) is not None and ip.version == peer_ip.version]
        if not addresses:
            return (f"{shown(host)} resolves to no IPv{peer_ip.version} address, the family its connection to the "
                    f"broker comes over ({shown(peer)}): Prometheus could not scrape the address the broker sees")
    return metrics_host_problem(addresses, peer)


@dataclass(frozen=True)
class RingEvent:
    """One message a replay selected (an event, or a batch of one source's events): its ring position (grows
    by one per message, never reused), source, the sequence number of its last event and frames as
    received."""

    index: int
    src: str
    seq: int
    frames: list


@dataclass
class _Member:
    info: NodeInfo  # ``last_seen`` is wall-clock time, for display only
    token: str
    heard: float  # the broker's monotonic clock at the last hello or heartbeat: what liveness is judged on
    live: bool = False
    # what /sd lists for it once the broker has accepted its metrics endpoint (None until then, and for good when
    # it has none, or one not at the address its connection comes from)
    sd: dict[str, Any] | None = None
    # bytes of ``info`` encoded, what it adds to a ``node-list`` answer: read by the first answer after ``info``
    # changed (None until then), not on every heartbeat, which come far more often than lookups
    size: int | None = None
    # the slot of its (role, host) it holds, given when it came up (-1 until then): what its restarts count against
    slot: int = -1
    # the latest other process that asked for its id while it was registered: (its incarnation's repr, the broker's
    # ``drained`` count when it first asked)
    contest: tuple[str, int] | None = None
    # the broker's ``drained`` count when it last heard this node's heartbeat: one heard at a higher count than an
    # ask's arrived after that ask, where one heard at the same count may have been queued behind it
    drained: int = 0


@dataclass
class _Slots:
    """The node slots of one (role, host): each node up there holds one, and a node that comes up takes back the
    slot of the latest departure there, so a node restarting in a loop counts its restarts against one slot
    whatever its ids, while a world whose nodes each restart once counts one restart on each of its slots."""

    given: int = 0  # slots handed out: a node coming up with none vacant gets slot ``given``
    vacant: list[int] = dataclasses.field(default_factory=list)  # slots of nodes gone down, the latest last


# A ``node-list`` body besides its entries: its field names, the list's length prefix and ``omitted`` (about 25
# bytes).
NODE_LIST_BYTES = 64


def _replaced(member: _Member, process: Process | None) -> str:
    """Why a heartbeat or bye naming ``process`` is not the registered process's (``""`` when it is): one that names
    none (a client that predates the field, a third party's) is taken as the registered one's."""
    if process is None or tuple(process) == incarnation(member.info):
        return ""
    host, pid, started = incarnation(member.info)
    return (f"{member.info.node_id!r} is registered by another process since (host {host!r}, pid {pid}, started "
            f"{started:.3f}): node ids must be unique, this process is not registered")


def _stamp(seconds: float) -> str:
    """A wall-clock time a node reported, in UTC to the second; "at an unknown time" when it is no time at all."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, ValueError, OSError):
        return "at an unknown time"


def _size_of(member: _Member) -> int:
    """Bytes of ``member.info`` encoded, computed once per change of it."""
    if member.size is None:
        member.size = len(msgspec.msgpack.encode(member.info))
    return member.size


Index = Callable[[list], "tuple[str, int] | None"]
"""``index(frames)``: an event's (source, sequence number); None when its header cannot be read."""
NOT_REPLAYED = ("", -1)  # the key of what no replay selects: unreadable headers, ``sync`` probes


def _touched(entries: dict[Any, Any], key: Any, value: Any) -> None:
    """Set ``entries[key]``, the key becoming the most recently counted; past ``RESTARTS_MAX`` keys the least
    recently counted are forgotten."""
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > RESTARTS_MAX:
        del entries[next(iter(entries))]


def frames_of(entry: Any) -> list:
    """A ring entry's frames: a one-frame message is kept as its frame alone (no list to make per event)."""
    return entry if isinstance(entry, list) else [entry]


def reply_cost(entry: Any) -> tuple[int, int]:
    """What the ring entry ``entry`` adds to a ``replayed`` body, bytes and list elements (what the asking
    peer's ``limits.max_body_bytes`` and ``limits.max_items`` bound): its frames' bytes and msgpack's length
    prefix of each frame, of its frame list and of the message; an element per frame, for its frame list and for
    the message. An entry of many empty frames costs by its frames, not its few bytes."""
    if isinstance(entry, list):
        return sum(len(frame) for frame in entry) + PREFIX_BYTES * (len(entry) + 2), len(entry) + 2
    return len(entry) + PREFIX_BYTES * 3, 3


def fits_reply(entry: Any, limits: Limits) -> bool:
    """Whether a ``replayed`` answer within ``limits`` (the asking peer's, the broker's by configuration) can
    carry the ring entry ``entry`` alone: its body limit, its list elements, and the ``MAX_FRAMES`` frames a
    ``ReplayedEvent`` holds."""
    nbytes, items = reply_cost(entry)
    return (not isinstance(entry, list) or len(entry) <= MAX_FRAMES) and \
        REPLAYED_BYTES + nbytes <= limits.max_body_bytes and REPLAYED_ITEMS + items <= limits.max_items


class ReplayRing:
    """The most recent event messages (an event, or a batch of one source's events), oldest first, bounded by
    count and bytes: an entry is charged its frames' bytes and, when it has several frames, what holding each
    costs (:func:`~.forwarder.held_bytes`), so messages of many empty frames cannot fill memory under the bound.

    Appending stores the frames only, in batches (:meth:`extend`): an event's source and sequence number are
    read (``index``) the first time a replay looks at it, and remembered until the entry is evicted, so neither
    the forwarding path nor the capture parses headers. Events whose header cannot be read are skipped by replays
    and counted in :attr:`unreadable`; ``index`` returns :data:`NOT_REPLAYED` for what is no event (a ``sync``
    probe).
    """

    def __init__(self, max_events: int, max_bytes: int, index: Index) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.index = index
        self.nbytes = 0
        self.evicted = 0
        self.appended = 0
        self.unreadable = 0
        self.too_large = 0  # messages replays skipped because no answer could carry them (each counted once)
        self._entries: deque[Any] = deque(maxlen=max_events)  # a frame, or a list of frames
        self._sizes: deque[int] = deque(maxlen=max_events)
        # Ring position -> (src, seq), once read, of held entries only: an entry's key goes when it is evicted.
        self._keys: dict[int, tuple[str, int]] = {}
        self._too_large: set[int] = set()  # ring positions of held entries a replay skipped as too large

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, frames: list, key: tuple[str, int] | None = None) -> None:
        """Keep one event (``key``: its (source, seq) when the caller has read them already)."""
        if key is not None:
            self._keys[self.appended] = key
        self.extend([frames], [held_bytes(frames, sum(len(f) for f in frames))])

    def extend(self, entries: list, sizes: list[int]) -> None:
        """Keep events (each a frame, or a list of frames), oldest first, charged ``sizes`` bytes against the
        bound: a frame's length, a list's :func:`~.forwarder.held_bytes`."""
        count = len(entries)
        oldest = self.appended - len(self._entries)  # the ring position of the oldest entry held
        self.appended += count  # ring positions: one per message handed in, kept or not
        if count > self.max_events:  # more than the ring holds: only the newest go in, the rest count evicted
            skipped = count - self.max_events
            entries, sizes = entries[skipped:], sizes[skipped:]
            self.evicted += skipped
            count = self.max_events
        overflow = len(self._entries) + count - self.max_events
        if overflow > 0:  # the deques drop these as they extend: take their bytes off first
            self.nbytes -= sum(itertools.islice(self._sizes, 0, overflow))
            self.evicted += overflow
            self._forget(oldest, overflow)
            oldest += overflow
        self._entries.extend(entries)
        self._sizes.extend(sizes)
        self.nbytes += sum(sizes)
        evicted = 0
        while self.nbytes > self.max_bytes and len(self._entries) > 1:
            self._entries.popleft()
            self.nbytes -= self._sizes.popleft()
            evicted += 1
        if evicted:
            self.evicted += evicted
            self._forget(oldest, evicted)

    def _forget(self, first: int, count: int) -> None:
        """Drop what is kept about the evicted ring positions ``first`` to ``first + count - 1`` (their keys, their
        too-large marks): it goes with the entries, so it never outgrows the ring (with CURVE every event comes
        with its key). Costs the fewer of ``count`` and the keys held."""
        end = first + count
        if self._too_large:
            self._too_large = {index for index in self._too_large if index >= end}
        keys = self._keys
        if not keys:
            return
        if count <= len(keys):
            for index in range(first, end):
                keys.pop(index, None)
        else:
            for index in [index for index in keys if index < end]:
                del keys[index]

    def select(
        self, since: int, src: str, limit: int, max_bytes: int, cursor: int, reply_limits: Limits | None = None
    ) -> tuple[list[RingEvent], int, bool]:
        """Messages at ring position ``>= cursor`` whose last event has ``seq >= since`` (of ``src`` when
        given), oldest first, at most ``limit`` of them and about ``max_bytes`` of answer body
        (:func:`reply_cost`); the cursor to continue from; whether more remain. A batch comes whole: the reader
        skips its events below ``since``.

        ``reply_limits``: the limits of the peer that decodes the answer. A page holds at most half its
        ``max_items`` list elements (the first message alone may take more), as it holds about half its body
        limit in bytes. A message that would not fit an answer alone (:func:`fits_reply`) is skipped, the cursor
        passing it, so it cannot stall every replay that reaches it: counted in :attr:`too_large` and logged the
        first time a replay skips it. Its reader finds its events missing (a gap fill counts them lost)."""
        found: list[RingEvent] = []
        nbytes = items = 0
        max_items = reply_limits.max_items // 2 if reply_limits is not None else None
        first = self.appended - len(self._entries)
        keys = self._keys
        start = max(0, cursor - first)  # skip what the cursor already passed
        for index, entry in enumerate(itertools.islice(self._entries, start, None), first + start):
            key = keys.get(index)
            if key is None:
                key = keys[index] = self._read(entry)
            if key[1] >= since and (not src or key[0] == src):
                if reply_limits is not None and not fits_reply(entry, reply_limits):
                    self._skip(index, key, entry, reply_limits)
                    continue
                size, count = reply_cost(entry)
                if len(found) == limit or (found and (nbytes + size > max_bytes or
                                                      (max_items is not None and items + count > max_items))):
                    return found, index, True
                found.append(RingEvent(index, key[0], key[1], frames_of(entry)))
                nbytes += size
                items += count
        return found, self.appended, False

    def _skip(self, index: int, key: tuple[str, int], entry: Any, limits: Limits) -> None:
        """A replay passes the message at ring position ``index``, too large for an answer: counted and logged
        once per message, however many replays pass it."""
        if index in self._too_large:
            return
        self._too_large.add(index)
        self.too_large += 1
        log.warning("ring.too_large", src=key[0], seq=key[1], bytes=reply_cost(entry)[0],
                    frames=len(frames_of(entry)), max_body_bytes=limits.max_body_bytes, max_items=limits.max_items,
                    detail="a replay cannot carry this message: it is skipped, and a gap fill that needs it "
                    "counts its events lost")

    def _read(self, entry: Any) -> tuple[str, int]:
        key = self.index(frames_of(entry))
        if key is None:
            self.unreadable += 1
            return NOT_REPLAYED
        return key


class Broker:
    """The bus role. Owns its sockets through ``runtime`` and runs on its loop.

    Liveness is judged on ``clock`` (monotonic: a wall-clock step must not expire or revive a node); the
    wall clock only stamps ``NodeInfo.last_seen`` for display.
    """

    def __init__(
        self, runtime: NodeRuntime, settings: BrokerSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.runtime = runtime
        self.settings = settings
        self.clock = clock
        self.codec = runtime.codec
        self.ring = ReplayRing(settings.ring_events, settings.ring_bytes, self._index)
        self.members: dict[str, _Member] = {}
        self.seen_tokens: dict[str, float] = {}  # probe token -> when last seen, oldest first
        # sync{path=pub} handshakes whose probe has not come yet: token -> (the deferred answer, when asked), oldest
        # first; answered an error when the probe has not come within TOKEN_HORIZON_S or beyond WAITING_MAX.
        self.waiting: dict[str, tuple[Pending, float]] = {}
        self.forwarded = 0  # event messages (a batch counts once)
        self.dropped: Counter[str] = Counter()
        self.joins: Counter[tuple[str, str]] = Counter()  # (node id, role) -> times it came up
        # (role, host) -> its node slots; (role, host, slot) -> joins that took that slot back after a departure:
        # restarts, whether under the same id or a new (pid-based) one. A slot's series starts at 0 when it is
        # given, so the first restart is an increase Prometheus sees.
        self.slots: dict[tuple[str, str], _Slots] = {}
        self.restarts: dict[tuple[str, str, str], int] = {}
        self.seq = 0
        # What /sd serves, rebuilt on the loop thread at every registry change and replaced whole (never
        # mutated), so the HTTP thread reads a consistent snapshot without a lock.
        self._targets: tuple[dict[str, Any], ...] = ()
        # Metrics URL host names to resolve, off the loop thread (a lookup may block for seconds): (member, host,
        # peer address), at most LOOKUPS_MAX waiting (counted on the loop thread); None ends the resolver.
        self._lookups: queue.SimpleQueue[tuple[_Member, str, str] | None] = queue.SimpleQueue()
        self._lookups_waiting = 0
        self._full_logged = False  # whether the registry's last filling (past ``max_nodes``) was logged
        # Liveness passes that read the control queue empty: a request handled after one arrived after it.
        self.drained = 0

        for endpoint in (settings.control, settings.events_in, settings.events_out):  # before any is bound
            runtime.check_bind(endpoint)
        self.xsub = runtime.bind(zmq.XSUB, "events_in", settings.events_in, runtime.event_options)
        self.curve = runtime.curve
        self.xpub = runtime.bind(zmq.XPUB, "events_out", settings.events_out, dataclasses.replace(
            runtime.event_options, max_frame_bytes=max_subscription_bytes(self.curve is not None)))
        self.forwarder: Forwarder | None = None
        if self.curve is None:
            self.forwarder = forwarder = Forwarder(runtime.ctx, self.xsub, self.xpub,
                                                   signed=bool(runtime.settings.secret), dropped=self.dropped)
            self.own = forwarder.own  # the broker's events go through the forwarder like every node's
            runtime.shutdown_hooks.append(forwarder.stop)  # before the runtime closes the XSUB and XPUB
            forwarder.start(runtime.settings.connect_timeout_s)
            runtime.watch(forwarder.capture, self._drain_capture)
            runtime.watch(forwarder.probes, lambda: forwarder.drain_probes(self._probe_seen))
        else:  # each event's src is checked against its connection's key: Python reads every event
            self.xsub.send(SUBSCRIBE_ALL)
            self.own = self.xpub
            runtime.watch(self.xsub, self._forward)
            runtime.watch(self.xpub, self._drain_subscriptions)
        self.server: Server = runtime.serve("control", settings.control)
        self.server.on(Hello.kind, self._hello)
        self.server.on(Sync.kind, self._sync, cached=False)
        self.server.on(Heartbeat.kind, self._heartbeat, cached=False)
        self.server.on(Bye.kind, self._bye)
        self.server.on(Nodes.kind, self._nodes, cached=False)
        self.server.on(Replay.kind, self._replay, cached=False)
        self.server.on(Refill.kind, self._refill)  # cached: a retried page is not added twice
        # The liveness passes' period and stalls (see _credit_stall).
        self.passes = PassStalls(min(settings.node_timeout_s / 4, 0.5), clock)
        runtime.every(self.passes.period_s, self._expire)
        runtime.status = lambda: {"nodes": float(len(self.members)), "ring_events": float(len(self.ring))}
        self._register_metrics()
        ROUTES[SD_PATH] = self.service_discovery
        runtime.shutdown_hooks.append(self._unroute)
        threading.Thread(target=self._resolve, name="refbus-sd-resolver", daemon=True).start()
        runtime.shutdown_hooks.append(lambda: self._lookups.put(None))

    # --- event path ---------------------------------------------------------------------------------

    def _drain_capture(self) -> None:
        """Captured events into the ring; then, unless a backlog is left, the capture rests for
        ``CAPTURE_REST_S`` so the next events gather into one batch (the loop wakes once per batch, not per
        event). Replays and refills catch up with the capture first (:meth:`_catch_up`): a rest delays only
        the ring's copy, never what a replay sees."""
        assert self.forwarder is not None
        if self.forwarder.drain(self._record, CAPTURE_BATCH) < CAPTURE_BATCH:
            self.runtime.rest(self.forwarder.capture, CAPTURE_REST_S)

    def _catch_up(self) -> None:
        """Everything the forwarder has passed on so far into the ring: what the capture holds, which is at most
        ``CAPTURE_HWM`` messages, so events that keep coming faster than the ring takes them cannot hold the loop
        here."""
        if self.forwarder is not None:
            for _ in range(-(-CAPTURE_HWM // CAPTURE_BATCH)):
                if self.forwarder.drain(self._record, CAPTURE_BATCH) < CAPTURE_BATCH:
                    return

    def _record(self, entries: list, sizes: list[int]) -> None:
        """Captured events (the forwarder already sent them on) into the ring."""
        self.ring.extend(entries, sizes)
        self.forwarded += len(entries)

    def _index(self, frames: list) -> tuple[str, int] | None:
        """A ring entry's source and its last event's sequence number (a batch holds several, one source)."""
        frames = [bytes(f) for f in frames]
        if not is_event(frames[0]):  # a subscription or start probe the capture brought along
            return NOT_REPLAYED
        try:
            last = self.codec.read_events(frames, known=False)[-1]
        except ProtocolError as exc:
            self.dropped[exc.code] += 1
            log.warning("ring.unreadable", code=exc.code, error=str(exc))
            return None
        return NOT_REPLAYED if last.kind == Sync.kind else (last.header.src, last.header.seq)

    def _forward(self, budget: int = 1024) -> None:
        """With CURVE: forward in Python, each event's ``src`` checked against its connection's key first."""
        xsub, xpub = self.xsub, self.xpub
        for _ in range(budget):
            try:
                frames, peer = recv_from(xsub, zmq.NOBLOCK)
            except zmq.Again:
                return
            except TooManyFrames as exc:
                self.dropped[exc.code] += 1
                log.warning("event.dropped", code=exc.code, error=str(exc))
                continue
            try:
                # Headers only (bodies are the subscribers'); kinds newer than this broker pass. A batch holds
                # one source's events (the reader checks), so its last header speaks for all.
                received = self.codec.read_events(frames, known=False)[-1]
                kind, header = received.kind, received.header
            except ProtocolError as exc:
                self.dropped[exc.code] += 1
                log.warning("event.dropped", code=exc.code, error=str(exc))
                continue
            if header.src != peer:
                code = "wrong-src" if peer else "unauthenticated"
                self.dropped[code] += 1
                log.warning("event.dropped", code=code, src=header.src, peer=peer, kind=kind)
                continue
            if kind == Sync.kind:
                self._probe_seen(frames)
                send_frames(xpub, frames)  # subscribers read the sender's latest sequence number from it
                continue
            send_frames(xpub, frames)
            self.ring.append(frames, (header.src, header.seq))
            self.forwarded += 1

    def _drain_subscriptions(self) -> None:
        while True:
            try:
                self.xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def emit(self, body: Body) -> None:
        """Publish the broker's own event to subscribers and the ring."""
        self.seq += 1
        frames = [bytes(f) for f in self.codec.encode(body, seq=self.seq, one_frame=True)]
        send_frames(self.own, frames)
        if self.forwarder is None:  # else the capture brings it to the ring
            self.ring.append(frames, (self.runtime.node_id, self.seq))

    def _probe_seen(self, frames: list) -> None:
        try:
            probe = self.codec.decode(frames).body
        except Exception as exc:
            self.dropped["malformed"] += 1
            log.warning("sync.rejected", error=str(exc))
            return
        if not isinstance(probe, Sync):  # a kind that merely starts with "sync"
            return
        seen = self.seen_tokens
        seen.pop(probe.token, None)  # seen again: it goes last, in the order of when it was seen
        seen[probe.token] = self.clock()
        while len(seen) > SEEN_MAX:
            del seen[next(iter(seen))]
        # A joining node's node-up goes out before the answer that completes its join: the node subscribes
        # only after that answer, so it rarely meets its own node-up live (never a guarantee: with the
        # forwarder the event still crosses the proxy thread, which may run later).
        came_up = False
        for member in self.members.values():
            if member.token == probe.token and not member.live:
                member.live = came_up = True
                log.info("node.up", node=member.info.node_id, role=member.info.role)
                self._count_join((member.info.node_id, member.info.role))
                self._count_restart(member)
                self.emit(NodeUp(node=member.info))
        if came_up:  # once, not per node: hellos sharing a token all come up on one probe
            self._refresh_targets()
        waiting = self.waiting.pop(probe.token, None)
        if waiting is not None:
            self.server.answer(waiting[0], Ok("seen"))

    def _count_join(self, key: tuple[str, str]) -> None:
        """One more join of (node id, role); past ``JOINS_MAX`` pairs the oldest joined of the nodes not registered
        now are forgotten (their series end; a registered node's count never restarts)."""
        joins = self.joins
        joins[key] = joins.pop(key, 0) + 1  # the most recently joined last
        extra = len(joins) - JOINS_MAX
        if extra > 0:
            for gone in [key for key in joins if key[0] not in self.members][:extra]:
                del joins[gone]

    def _count_restart(self, member: _Member) -> None:
        """``member`` came up: it takes the slot of the latest departure of its role on its host, one restart of
        that slot, or a new slot (no restart) when none is vacant there. A restart under a new id that comes up
        before the broker notices its old process gone takes a new slot, and the next join there the old one: a
        loop whose processes overlap so spreads its restarts over as many slots as overlap, never more."""
        key = (member.info.role, member.info.host)
        slots = self.slots.get(key) or _Slots()
        _touched(self.slots, key, slots)
        if slots.vacant:
            member.slot = slots.vacant.pop()
            restarted = 1
        else:
            member.slot, slots.given = slots.given, slots.given + 1
            restarted = 0
        series = (*key, str(member.slot))
        _touched(self.restarts, series, self.restarts.get(series, 0) + restarted)

    # --- control ------------------------------------------------------------------------------------

    def _hello(self, request: Message) -> Body:
        hello = request.body
        assert isinstance(hello, Hello)
        self._check_own(request, hello.node.node_id, hello.node.role)
        if problem := registration_problem(hello.node):
            raise HandlerError("schema", problem)
        wire = negotiate(hello.wire)
        node = msgspec.structs.replace(hello.node, last_seen=time.time())
        old = self.members.get(node.node_id)
        if old is not None:
            self._check_holder(old, node)
        elif not hello.probe:  # a probe takes no place
            self._check_room(node)
        if hello.probe:  # the id could be taken: a holder silent for half the node timeout is left to expire
            return Ok("free")
        # Another process under the same id: told by (host, pid, start time), not by pid alone, since a container
        # restarts its process as pid 1 each time.
        same = old is not None and old.live and incarnation(old.info) == incarnation(node)
        if old is not None and old.live and not same:
            self._remove(old, "replaced")
        live = same
        member = self.members[node.node_id] = _Member(node, hello.token, self.clock(), live=live,
                                                      slot=old.slot if same else -1)
        if node.metrics:
            self._check_metrics_host(member, self.server.peer_address())
        if live:  # a live node registering again (broker forgot it, or new endpoints): its entry may differ
            self._refresh_targets()
        return Welcome(
            broker_id=self.runtime.node_id,
            events_in=self.runtime.endpoints["events_in"],
            events_out=self.runtime.endpoints["events_out"],
            heartbeat_interval=self.runtime.settings.heartbeat_interval_s,
            node_timeout=self.settings.node_timeout_s,
            wire=wire,
            event_batch=self.settings.event_batch,
        )

    def _check_room(self, node: NodeInfo) -> None:
        """Refuse ``registry-full`` a hello that would register a new node id past ``max_nodes`` (live or still
        joining): every registration costs memory, each lookup, /sd and liveness pass walks them all, and a peer
        flooding distinct ids must not make the registry, or the loop that serves it, grow without end. Those
        registered keep their entries (a node registering again under its id is never refused); a joining entry
        that never proves its PUB live frees its place within ``node_timeout_s``. Logged once per filling."""
        if len(self.members) < self.settings.max_nodes:
            self._full_logged = False
            return
        if not self._full_logged:
            self._full_logged = True
            log.warning("registry.full", max_nodes=self.settings.max_nodes, refused=node.node_id, role=node.role,
                        detail="hellos of new node ids are refused until registered nodes leave or time out")
        raise HandlerError("registry-full", f"the broker registers at most {self.settings.max_nodes} nodes "
                           f"(bus.max_nodes), live or joining: {node.node_id!r} is not registered")

    def _check_holder(self, holder: _Member, node: NodeInfo) -> None:
        """Let ``node`` take the id ``holder`` is registered under, or refuse it ``id-in-use``.

        Its own process again (the same incarnation) and a predecessor that is dying (silent for half the node
        timeout: a live node beats every heartbeat interval, at most a third of it) may take it, so a restart after
        a crash comes up within half the node timeout of the crash. Otherwise the holder may be a live process
        or one that died a moment ago, which only its next heartbeat tells: the first ask of each contender is
        refused for a heartbeat interval (``retry_after_s``), and once the holder has been heard after that ask
        the contender is refused for good (no ``retry_after_s``): another live process holds the id, a config
        that cannot work. A dead process's last heartbeat was sent before it died, before its successor could
        ask, yet may be handled after the ask when a busy loop queued it: a heartbeat counts only once a liveness
        pass read the control queue empty after the ask (``drained``), since it then arrived after it. Nothing of
        the holder changes but the contender it remembers (the latest one only), and nothing a contender claims
        (its host, pid, start time) counts against the holder's heartbeats."""
        if incarnation(holder.info) == incarnation(node):
            return
        contender = repr(incarnation(node))  # a start time that is NaN must match itself too
        now = self.clock()
        silent = now - holder.heard
        if silent > self.settings.node_timeout_s / 2:
            return
        info = holder.info
        said = (f"node id {shown(info.node_id)} is held by {info.role} pid {info.pid} on host {shown(info.host)}, "
                f"started {_stamp(info.started)}, heard {silent:.1f}s ago; this process is pid {node.pid} on host "
                f"{shown(node.host)}")
        if holder.contest is not None and holder.contest[0] == contender and holder.drained > holder.contest[1]:
            log.warning("registry.id_in_use", node=info.node_id, holder_host=info.host, holder_pid=info.pid,
                        contender_host=node.host, contender_pid=node.pid)
            raise HandlerError(ID_IN_USE, f"{said}: the holder still heartbeats, so two live processes were "
                                          "started under one node id (give each its own node id)")
        if holder.contest is None or holder.contest[0] != contender:
            holder.contest = (contender, self.drained)
        raise HandlerError(ID_IN_USE, f"{said}: ask again; a holder that stays silent for "
                                      f"{self.settings.node_timeout_s / 2:g}s is taken for dying and replaced",
                           retry_after_s=self.runtime.settings.heartbeat_interval_s)

    def _check_own(self, request: Message, node_id: str, role: str = "") -> None:
        """With CURVE, a node speaks for itself only: the registry entry it names is its own (the server checked
        ``src``), registered under the role the allow-list grants its key."""
        if self.curve is None:
            return
        if node_id != request.header.src:
            raise HandlerError("wrong-src", f"{request.header.src!r} cannot speak for node {node_id!r}")
        grant = next((g for g in self.curve.allowed.values() if g.node_id == node_id), None)
        if role and (grant is None or grant.role != role):
            raise HandlerError("wrong-role", f"{node_id!r} is allowed as {grant.role if grant else 'nothing'!r}, "
                                             f"not as {role!r}")

    def _sync(self, request: Message) -> Body | None:
        sync = request.body
        assert isinstance(sync, Sync)
        if sync.path == "sub":
            send_frames(self.own, self.codec.encode(Sync(token=sync.token)))
            return Ok("published")
        if sync.token in self.seen_tokens:
            return Ok("seen")
        self.waiting.pop(sync.token, None)  # asked again: it goes last, in the order of when it was asked
        self.waiting[sync.token] = (self.server.pending, self.clock())
        while len(self.waiting) > WAITING_MAX:
            self._give_up(next(iter(self.waiting)), f"more than {WAITING_MAX} handshakes were waiting")
        return None

    def _give_up(self, token: str, why: str) -> None:
        """Answer a waiting PUB handshake with an error (the node's join fails and is tried again later)."""
        pending, _ = self.waiting.pop(token)
        self.server.answer(pending, Error("sync-expired", f"the probe of sync token {token!r} was not seen: {why}",
                                          Sync.kind))

    def _heartbeat(self, request: Message) -> Body:
        beat = request.body
        assert isinstance(beat, Heartbeat)
        self._check_own(request, beat.node_id)
        member = self.members.get(beat.node_id)
        if member is None:
            raise HandlerError("unknown-node", f"{beat.node_id!r} is not registered (send hello)")
        if refused := _replaced(member, beat.process):
            raise HandlerError("replaced", refused)
        member.info = msgspec.structs.replace(member.info, last_seen=time.time(), status=beat.status)
        member.size = None
        member.heard = self.clock()
        member.drained = self.drained
        return Ok()

    def _bye(self, request: Message) -> Body:
        bye = request.body
        assert isinstance(bye, Bye)
        self._check_own(request, bye.node_id)
        member = self.members.get(bye.node_id)
        if member is None:
            return Ok()
        if refused := _replaced(member, bye.process):
            # A process replaced under its id that stops before a heartbeat of it was refused: removing the entry
            # would report the live process that took the id down. Counted as a rejected request, logged.
            info = member.info
            log.warning("registry.bye_refused", node=info.node_id, holder_host=info.host, holder_pid=info.pid,
                        sender=list(bye.process or ()), detail="a bye from another process than the node id's "
                        "holder (one replaced): the holder stays registered")
            raise HandlerError("replaced", refused)
        self._remove(member, "bye")
        return Ok()

    def _nodes(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Nodes)
        role = ask.role
        listed = [m for m in self.members.values() if m.live and (not role or m.info.role == role)]
        budget = self.codec.limits.max_body_bytes - NODE_LIST_BYTES
        sizes = {m.info.node_id: _size_of(m) for m in listed}
        if sum(sizes.values()) <= budget:
            return NodeList(nodes=[m.info for m in listed])
        # The schema bounds each entry, not how many there are: the smallest go first, so what nodes normally
        # register (under 1 KB each) is always answered and only the largest entries are left out.
        kept: set[str] = set()
        for member in sorted(listed, key=lambda m: sizes[m.info.node_id]):
            if sizes[member.info.node_id] > budget:
                break
            budget -= sizes[member.info.node_id]
            kept.add(member.info.node_id)
        omitted = [m.info.node_id for m in listed if m.info.node_id not in kept]
        log.warning("registry.list_cut", role=role, listed=len(kept), omitted=len(omitted), first_omitted=omitted[:8],
                    detail=f"the live nodes' entries would not fit the {self.codec.limits.max_body_bytes}-byte body "
                    "limit: the largest are left out of this answer")
        return NodeList(nodes=[m.info for m in listed if m.info.node_id in kept], omitted=len(omitted))

    def _replay(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Replay)
        # Replies must fit the peer's body limit: events are small (references, not arrays), and a message that
        # could not fit one alone (an event near the body limit, one with large arrays) is skipped.
        limits = self.codec.limits
        self._catch_up()
        entries, cursor, more = self.ring.select(ask.since, ask.src, ask.limit, limits.max_body_bytes // 2,
                                                 ask.cursor, limits)
        events = [ReplayedEvent([bytes(frame) for frame in event.frames]) for event in entries]
        return Replayed(events=events, more=more, cursor=cursor)

    def _refill(self, request: Message) -> Body:
        """A publisher's own held events into the ring (not to subscribers): each header is read (and its MAC
        checked when the cluster signs) here, and an event that is not the sender's own, or unreadable, is
        refused and counted in :attr:`dropped`; the rest are kept."""
        refill = request.body
        assert isinstance(refill, Refill)
        self._catch_up()  # what the capture holds came first: the ring keeps arrival order where it can
        kept = 0
        for event in refill.events:
            key = self._index(event.frames)
            if key is None or key == NOT_REPLAYED:
                continue  # unreadable (counted by _index) or a probe: nothing a replay could use
            if key[0] != request.header.src:
                self.dropped["wrong-src"] += 1
                log.warning("refill.refused", code="wrong-src", src=key[0], sender=request.header.src)
                continue
            self.ring.append(event.frames, key)
            kept += 1
        return Ok(f"kept {kept} of {len(refill.events)}")

    def _remove(self, member: _Member, reason: str) -> None:
        info = self.members.pop(member.info.node_id, member).info
        if member.live:
            log.info("node.down", node=info.node_id, role=info.role, reason=reason)
            self.emit(NodeDown(node_id=info.node_id, role=info.role, reason=reason, last_seen=info.last_seen))
            key = (info.role, info.host)
            slots = self.slots.get(key) or _Slots()
            slots.vacant.append(member.slot)
            _touched(self.slots, key, slots)
            self._refresh_targets()

    def _expire(self) -> None:
        self._credit_stall()
        # Heartbeats may be queued behind a busy loop: read them before judging anyone silent.
        for _ in range(EXPIRE_DRAIN):
            try:
                self.server.handle_one(zmq.NOBLOCK)
            except zmq.Again:
                self.drained += 1
                break
        now = self.clock()
        for member in list(self.members.values()):
            if now - member.heard > self.settings.node_timeout_s:
                self._remove(member, "timeout")
        horizon = self.clock() - TOKEN_HORIZON_S
        for token, seen in list(self.seen_tokens.items()):  # oldest first
            if seen >= horizon:
                break
            del self.seen_tokens[token]
        for token, (_, asked) in list(self.waiting.items()):  # oldest first
            if asked >= horizon:
                break
            self._give_up(token, f"not within {TOKEN_HORIZON_S:g}s")

    def _credit_stall(self) -> None:
        """Count no silence the broker could not hear. A liveness pass more than a whole period late means this
        process did not run its loop meanwhile (stopped, swapped out, starved of CPU): the nodes' heartbeats of
        that time wait unread in its sockets, or went unanswered and are sent again once it answers. That time is
        added to every member's ``heard``, so a broker waking after more than ``node_timeout_s`` does not report
        every live node down at once (each would break its trainer world, fail the requests to it and start the
        stores' grace for what it holds) before reading a single heartbeat; a node that died meanwhile is reported
        one node timeout after the wake-up."""
        stalled = self.passes.stall()
        if not stalled:
            return
        for member in self.members.values():
            member.heard += stalled
        log.warning("bus.stalled", seconds=round(stalled, 3), nodes=len(self.members),
                    detail="the broker's loop did not run: that time counts toward no node's silence")

    # --- service discovery (Prometheus http_sd) -------------------------------------------------------

    def service_discovery(self) -> list[dict[str, Any]]:
        """Prometheus ``http_sd_configs`` targets: one group ``{"targets": ["host:port"], "labels": {node,
        role, cluster, __metrics_path__}}`` for the broker and for every live node whose metrics endpoint it
        accepted (one at the address the node's connection comes from, :func:`metrics_host_problem`).

        Runs on the metrics HTTP thread: it reads only the snapshot the loop thread replaces whole.
        """
        if not self.runtime.metrics_url:
            return list(self._targets)
        return [self._sd_group(self.runtime.node_id, self.runtime.role, self.runtime.metrics_url), *self._targets]

    def _sd_group(self, node_id: str, role: str, metrics_url: str) -> dict[str, Any]:
        """The /sd group of one node; ValueError when ``metrics_url`` is not one (see :func:`sd_target`)."""
        target, path = sd_target(metrics_url)
        labels = {"node": node_id, "role": role, "cluster": self.settings.cluster, "__metrics_path__": path}
        return {"targets": [target], "labels": labels}

    def _check_metrics_host(self, member: _Member, peer: str) -> None:
        """Decide whether /sd lists ``member``'s metrics endpoint (its URL checked by hello already): at once for
        an address, after a lookup off the loop thread for a host name (:meth:`_resolve`)."""
        host = urlsplit(member.info.metrics).hostname or ""
        if _ip(host) is not None:
            self._decide(member, metrics_host_problem([host], peer), peer)
        elif self._lookups_waiting >= LOOKUPS_MAX:
            self._decide(member, f"{LOOKUPS_MAX} host names wait to be resolved already", peer)
        else:
            self._lookups_waiting += 1
            self._lookups.put((member, host, peer))

    def _resolve(self) -> None:
        """The resolver thread: each host name looked up, the outcome handed to the loop thread."""
        while (lookup := self._lookups.get()) is not None:
            member, host, peer = lookup
            self.runtime.call_soon(functools.partial(self._resolved, member, resolved_problem(host, peer), peer))

    def _resolved(self, member: _Member, problem: str, peer: str) -> None:
        self._lookups_waiting -= 1
        if self.members.get(member.info.node_id) is member:  # not replaced or removed meanwhile
            self._decide(member, problem, peer)

    def _decide(self, member: _Member, problem: str, peer: str) -> None:
        """List ``member``'s metrics endpoint in /sd, or say why not: the node stays registered, unscraped."""
        info = member.info
        if problem:
            log.warning("sd.target_refused", node=info.node_id, role=info.role, metrics=info.metrics, peer=peer,
                        error=problem, detail="not listed in /sd: set node.metrics_host (and node.host, for a "
                        "wildcard bind) to an address of the node that the broker sees it connect from")
            return
        member.sd = self._sd_group(info.node_id, info.role, info.metrics)
        if member.live:
            self._refresh_targets()

    def _refresh_targets(self) -> None:
        """Rebuild the /sd snapshot from the live members whose endpoints were accepted (loop thread only)."""
        self._targets = tuple(m.sd for m in self.members.values() if m.live and m.sd is not None)

    def _unroute(self) -> None:
        """Stop serving /sd from this broker (a process may host another broker later)."""
        if ROUTES.get(SD_PATH) == self.service_discovery:
            del ROUTES[SD_PATH]

    def _dropped_readings(self) -> dict[tuple[str, ...], float]:
        readings = by_label(self.dropped)
        if self.ring.too_large:
            readings[("too-large",)] = float(self.ring.too_large)
        return readings

    def _register_metrics(self) -> None:
        self.runtime.metric("refbus_bus_messages_forwarded_total",
                            "Event messages forwarded by the broker (a batch of one node's events counts once).",
                      lambda: {(): float(self.forwarded)})
        self.runtime.metric("refbus_bus_events_dropped_total", "Events the broker refused to forward (with CURVE: "
                            "a src not its connection's), found unreadable in its ring when a replay read them, or "
                            "that replays skip because no answer within the body limit can carry them (too-large), "
                            "by reason.",
                      self._dropped_readings, labels=("reason",))
        self.runtime.metric("refbus_bus_stalled_seconds_total", "Seconds the broker's liveness passes came late "
                            "(its loop did not run: stopped, swapped out, starved of CPU), counted toward no node's "
                            "silence.",
                            lambda: {(): self.passes.stalled_s})
        self.runtime.metric("refbus_bus_ring_events", "Events held in the replay ring.",
                      lambda: {(): float(len(self.ring))}, kind="gauge")
        self.runtime.metric("refbus_bus_ring_bytes", "Bytes held in the replay ring, each frame of a message of "
                            "several counted 256 more (what holding it costs).",
                      lambda: {(): float(self.ring.nbytes)}, kind="gauge")
        # Labelled member/member_role, not node/role: those are the scrape target's own (the broker's), which the
        # scrape config sets over what a target says.
        self.runtime.metric("refbus_bus_joins_total", "Times each node came up (joined, or re-joined after a restart).",
                            lambda: {key: float(n) for key, n in dict(self.joins).items()},
                            labels=("member", "member_role"))
        self.runtime.metric("refbus_bus_restarts_total", "Nodes that came up on a host in the slot of a node of their "
                            "role that went down there (a restart, under the same node id or a new one), by role, "
                            "host and slot (0 from the slot's first node up).",
                            lambda: {key: float(n) for key, n in dict(self.restarts).items()},
                            labels=("member_role", "member_host", "member_slot"))
        self.runtime.metric("refbus_bus_nodes", "Live registered nodes, by their role.",
                      lambda: dict(Counter((m.info.role,) for m in list(self.members.values()) if m.live)),
                      labels=("member_role",), kind="gauge")
