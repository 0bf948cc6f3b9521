"""The broker (``refbus node bus``): event forwarding, the node registry and the replay ring.

Sockets (all bound):

* ``events_in`` (XSUB): every node's PUB connects here. The broker subscribes to everything itself, so
  events reach the ring even when no subscriber is connected.
* ``events_out`` (XPUB): subscribers connect here; events are forwarded unchanged (frames are not
  re-encoded, array frames are not copied).
* ``control`` (ROUTER): ``hello``, ``sync``, ``heartbeat``, ``bye``, ``nodes``, ``replay``.

The broker checks each event's envelope header (it must place it in the ring by source and sequence
number; the kind frame, version and sizes are checked with it) but never decodes its body: subscribers
validate bodies. Events with an unreadable header, a kind that is not ASCII or another major version are
dropped and counted by error code. The ring keeps the most recent events, bounded by count and by bytes.

Registry: a node registers with ``hello`` and proves its PUB path live with the ``sync`` handshake; then
the broker publishes ``node-up``. A node that says ``bye``, or misses heartbeats for ``node_timeout_s`` (on
the monotonic clock), is removed with ``node-down``. The broker's own events come from its node id with
their own sequence.

Service discovery: the broker's metrics endpoint also answers ``/sd`` with every live node's metrics
endpoint (and its own) in the format of Prometheus's ``http_sd_configs``, so Prometheus finds a whole
cluster from one fixed address.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog
import zmq

from ..protocol.envelope import Message, negotiate
from ..protocol.errors import ProtocolError
from ..protocol.messages import (
    Body,
    Bye,
    Heartbeat,
    Hello,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Ok,
    Replay,
    Replayed,
    ReplayedEvent,
    Sync,
    Welcome,
)
from .metrics import ROUTES
from .reqrep import HandlerError, Pending, Server
from .runtime import NodeRuntime
from .sockets import recv_frames, recv_from, send_frames

log = structlog.get_logger(__name__)

SD_PATH = "/sd"  # the service-discovery path of the broker's metrics endpoint


@dataclass(frozen=True)
class BrokerSettings:
    control: str = "tcp://127.0.0.1:7770"
    events_in: str = "tcp://127.0.0.1:7771"
    events_out: str = "tcp://127.0.0.1:7772"
    ring_events: int = 65_536
    ring_bytes: int = 256 << 20
    node_timeout_s: float = 5.0
    cluster: str = "local"  # the ``cluster`` label of every service-discovery target


@dataclass
class _Entry:
    index: int  # ring position: grows by one per event, never reused
    src: str
    seq: int
    frames: list
    nbytes: int


@dataclass
class _Member:
    info: NodeInfo  # ``last_seen`` is wall-clock time, for display only
    token: str
    heard: float  # the broker's monotonic clock at the last hello or heartbeat: what liveness is judged on
    live: bool = False


class ReplayRing:
    """The most recent events, oldest first, bounded by count and bytes."""

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evicted = 0
        self.appended = 0
        self._entries: deque[_Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, src: str, seq: int, frames: list) -> None:
        nbytes = sum(len(f) for f in frames)
        self._entries.append(_Entry(self.appended, src, seq, frames, nbytes))
        self.appended += 1
        self.nbytes += nbytes
        while len(self._entries) > self.max_events or (self.nbytes > self.max_bytes and len(self._entries) > 1):
            self.nbytes -= self._entries.popleft().nbytes
            self.evicted += 1

    def select(self, since: int, src: str, limit: int, max_bytes: int, cursor: int) -> tuple[list[_Entry], int, bool]:
        """Entries at ring position ``>= cursor`` with ``seq >= since`` (of ``src`` when given), oldest first,
        at most ``limit`` of them and about ``max_bytes``; the cursor to continue from; whether more remain."""
        found: list[_Entry] = []
        nbytes = 0
        start = max(0, cursor - (self.appended - len(self._entries)))  # skip what the cursor already passed
        for entry in itertools.islice(self._entries, start, None):
            if entry.seq >= since and (not src or entry.src == src):
                if len(found) == limit or (found and nbytes + entry.nbytes > max_bytes):
                    return found, entry.index, True
                found.append(entry)
                nbytes += entry.nbytes
        return found, self.appended, False


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
        self.ring = ReplayRing(settings.ring_events, settings.ring_bytes)
        self.members: dict[str, _Member] = {}
        self.seen_tokens: dict[str, float] = {}
        self.waiting: dict[str, Pending] = {}
        self.forwarded = 0
        self.dropped: Counter[str] = Counter()
        self.joins: Counter[tuple[str, str]] = Counter()  # (node id, role) -> times it came up
        self.seq = 0
        # What /sd serves, rebuilt on the loop thread at every registry change and replaced whole (never
        # mutated), so the HTTP thread reads a consistent snapshot without a lock.
        self._targets: tuple[dict[str, Any], ...] = ()

        self.xsub = runtime.bind(zmq.XSUB, "events_in", settings.events_in, runtime.event_options)
        self.xsub.send(b"\x01")  # subscribe to everything: the ring must see every event
        self.xpub = runtime.bind(zmq.XPUB, "events_out", settings.events_out, runtime.event_options)
        self.curve = runtime.curve
        self.server: Server = runtime.serve("control", settings.control)
        self.server.on(Hello.kind, self._hello)
        self.server.on(Sync.kind, self._sync, cached=False)
        self.server.on(Heartbeat.kind, self._heartbeat, cached=False)
        self.server.on(Bye.kind, self._bye)
        self.server.on(Nodes.kind, self._nodes, cached=False)
        self.server.on(Replay.kind, self._replay, cached=False)
        runtime.watch(self.xsub, self._forward)
        runtime.watch(self.xpub, self._drain_subscriptions)
        runtime.every(min(settings.node_timeout_s / 4, 0.5), self._expire)
        runtime.status = lambda: {"nodes": float(len(self.members)), "ring_events": float(len(self.ring))}
        self._register_metrics()
        ROUTES[SD_PATH] = self.service_discovery
        runtime.shutdown_hooks.append(self._unroute)

    # --- event path ---------------------------------------------------------------------------------

    def _forward(self, budget: int = 1024) -> None:
        xsub, xpub = self.xsub, self.xpub
        for _ in range(budget):
            try:
                frames, peer = recv_from(xsub, zmq.NOBLOCK) if self.curve else (recv_frames(xsub, zmq.NOBLOCK), "")
            except zmq.Again:
                return
            try:
                # The header only (bodies are the subscribers'); kinds newer than this broker pass.
                kind, header, _ = self.codec.decode_header(frames, known=False)
            except ProtocolError as exc:
                self.dropped[exc.code] += 1
                log.warning("event.dropped", code=exc.code, error=str(exc))
                continue
            if self.curve and header.src != peer:
                code = "wrong-src" if peer else "unauthenticated"
                self.dropped[code] += 1
                log.warning("event.dropped", code=code, src=header.src, peer=peer, kind=kind)
                continue
            if kind == Sync.kind:
                self._probe_seen(frames)
                continue
            send_frames(xpub, frames)
            self.ring.append(header.src, header.seq, frames)
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
        frames = self.codec.encode(body, seq=self.seq, one_frame=True)
        send_frames(self.xpub, frames)
        self.ring.append(self.runtime.node_id, self.seq, [bytes(f) for f in frames])

    def _probe_seen(self, frames: list) -> None:
        try:
            probe = self.codec.decode(frames).body
        except Exception as exc:
            self.dropped["malformed"] += 1
            log.warning("sync.rejected", error=str(exc))
            return
        assert isinstance(probe, Sync)
        self.seen_tokens[probe.token] = self.clock()
        pending = self.waiting.pop(probe.token, None)
        if pending is not None:
            self.server.answer(pending, Ok("seen"))
        for member in self.members.values():
            if member.token == probe.token and not member.live:
                member.live = True
                log.info("node.up", node=member.info.node_id, role=member.info.role)
                self.joins[(member.info.node_id, member.info.role)] += 1
                self.emit(NodeUp(node=member.info))
                self._refresh_targets()

    # --- control ------------------------------------------------------------------------------------

    def _hello(self, request: Message) -> Body:
        hello = request.body
        assert isinstance(hello, Hello)
        self._check_own(request, hello.node.node_id, hello.node.role)
        wire = negotiate(hello.wire)
        node = msgspec.structs.replace(hello.node, last_seen=time.time())
        old = self.members.get(node.node_id)
        if old is not None and old.live and old.info.pid != node.pid:
            self._remove(old, "replaced")
        live = old is not None and old.live and old.info.pid == node.pid
        self.members[node.node_id] = _Member(node, hello.token, self.clock(), live=live)
        if live:  # a live node registering again (broker forgot it, or new endpoints): its entry may differ
            self._refresh_targets()
        return Welcome(
            broker_id=self.runtime.node_id,
            events_in=self.runtime.endpoints["events_in"],
            events_out=self.runtime.endpoints["events_out"],
            heartbeat_interval=self.runtime.settings.heartbeat_interval_s,
            node_timeout=self.settings.node_timeout_s,
            wire=wire,
        )

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
            send_frames(self.xpub, self.codec.encode(Sync(token=sync.token)))
            return Ok("published")
        if sync.token in self.seen_tokens:
            return Ok("seen")
        self.waiting[sync.token] = self.server.pending
        return None

    def _heartbeat(self, request: Message) -> Body:
        beat = request.body
        assert isinstance(beat, Heartbeat)
        self._check_own(request, beat.node_id)
        member = self.members.get(beat.node_id)
        if member is None or not member.live:  # not live: its join broke off before the sync proof
            raise HandlerError("unknown-node", f"{beat.node_id!r} is not registered (send hello)")
        member.info = msgspec.structs.replace(member.info, last_seen=time.time(), status=beat.status)
        member.heard = self.clock()
        return Ok()

    def _bye(self, request: Message) -> Body:
        bye = request.body
        assert isinstance(bye, Bye)
        self._check_own(request, bye.node_id)
        member = self.members.get(bye.node_id)
        if member is not None:
            self._remove(member, "bye")
        return Ok()

    def _nodes(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Nodes)
        role = ask.role
        infos = [m.info for m in self.members.values() if m.live and (not role or m.info.role == role)]
        return NodeList(nodes=infos)

    def _replay(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Replay)
        # Replies must fit the peer's body limit: events are small (references, not arrays).
        budget = self.codec.limits.max_body_bytes // 2
        entries, cursor, more = self.ring.select(ask.since, ask.src, ask.limit, budget, ask.cursor)
        events = [ReplayedEvent([bytes(frame) for frame in entry.frames]) for entry in entries]
        return Replayed(events=events, more=more, cursor=cursor)

    def _remove(self, member: _Member, reason: str) -> None:
        info = self.members.pop(member.info.node_id, member).info
        if member.live:
            log.info("node.down", node=info.node_id, role=info.role, reason=reason)
            self.emit(NodeDown(node_id=info.node_id, role=info.role, reason=reason, last_seen=info.last_seen))
            self._refresh_targets()

    def _expire(self) -> None:
        # Heartbeats may be queued behind a busy loop: read them before judging anyone silent.
        while True:
            try:
                self.server.handle_one(zmq.NOBLOCK)
            except zmq.Again:
                break
        now = self.clock()
        for member in list(self.members.values()):
            if now - member.heard > self.settings.node_timeout_s:
                self._remove(member, "timeout")
        horizon = self.clock() - 60.0
        for token, seen in list(self.seen_tokens.items()):
            if seen < horizon:
                del self.seen_tokens[token]

    # --- service discovery (Prometheus http_sd) -------------------------------------------------------

    def service_discovery(self) -> list[dict[str, Any]]:
        """Prometheus ``http_sd_configs`` targets: one group ``{"targets": ["host:port"], "labels": {node,
        role, cluster, __metrics_path__}}`` for the broker and for every live node that serves metrics.

        Runs on the metrics HTTP thread: it reads only the snapshot the loop thread replaces whole.
        """
        own = [self._sd_group(self.runtime.node_id, self.runtime.role, self.runtime.metrics_url)]
        return own + list(self._targets) if self.runtime.metrics_url else list(self._targets)

    def _sd_group(self, node_id: str, role: str, metrics_url: str) -> dict[str, Any]:
        url = urlsplit(metrics_url)
        labels = {"node": node_id, "role": role, "cluster": self.settings.cluster, "__metrics_path__": url.path}
        return {"targets": [url.netloc], "labels": labels}

    def _refresh_targets(self) -> None:
        """Rebuild the /sd snapshot from the live members (loop thread only)."""
        self._targets = tuple(self._sd_group(m.info.node_id, m.info.role, m.info.metrics)
                              for m in self.members.values() if m.live and m.info.metrics)

    def _unroute(self) -> None:
        """Stop serving /sd from this broker (a process may host another broker later)."""
        if ROUTES.get(SD_PATH) == self.service_discovery:
            del ROUTES[SD_PATH]

    def _register_metrics(self) -> None:
        self.runtime.metric("refbus_bus_events_forwarded_total", "Events forwarded by the broker.",
                      lambda: {(): float(self.forwarded)})
        self.runtime.metric("refbus_bus_events_dropped_total", "Events the broker could not forward, by reason.",
                      lambda: {(k,): float(v) for k, v in self.dropped.items()}, labels=("reason",))
        self.runtime.metric("refbus_bus_ring_events", "Events held in the replay ring.",
                      lambda: {(): float(len(self.ring))}, kind="gauge")
        self.runtime.metric("refbus_bus_ring_bytes", "Bytes held in the replay ring.",
                      lambda: {(): float(self.ring.nbytes)}, kind="gauge")
        # Labelled member/member_role, not node/role: those are the scrape target's own (the broker's).
        self.runtime.metric("refbus_bus_joins_total", "Times each node came up (joined, or re-joined after a restart).",
                            lambda: {key: float(n) for key, n in self.joins.items()}, labels=("member", "member_role"))
        self.runtime.metric("refbus_bus_nodes", "Live registered nodes, by role.",
                      lambda: dict(Counter((m.info.role,) for m in self.members.values() if m.live)),
                      labels=("role",), kind="gauge")
