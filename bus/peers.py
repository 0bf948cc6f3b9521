"""The registry as one node sees it: which peers are live, which the broker reported down, and their endpoints.

:class:`Peers` is fed by the broker's ``node-up`` (the node's :class:`~refbus.protocol.messages.NodeInfo`,
with its endpoints) and ``node-down`` (its node id) events, and seeded with one registry lookup when the
node starts (peers that were up before it subscribed). A ``node-down`` does, in this order:

1. the role's listeners (:meth:`Peers.on_down`) learn of it, with the last :class:`NodeInfo` known for the
   node (None when it was never seen up), so a role knows a store is down before the outcomes below reach it;
2. every endpoint the node advertised is marked down in ``runtime.calls``: pending calls to it end with
   ``PeerDown`` at once and new ones fail at once, instead of running a retry schedule against a node the
   registry reports down (a deadline against a down peer is zero); then their clients are closed
   (:meth:`~refbus.bus.calls.Calls.forget`: the down marks stay, so new requests still fail at once without
   a socket, and a client is made again once the node is up).

A ``node-up`` marks the node's endpoints up again, then tells the listeners (:meth:`Peers.on_up`). One naming
another process (:func:`incarnation`) than the one held live, never reported down, first reports that one down
as above, reason :data:`REPLACED` (as a broker that knew it would have: see below). Endpoints
the node advertised before and no longer does (a restarted process, on new ephemeral ports) are dead for good:
their clients are forgotten as well, and their down marks are kept for the last :data:`RETIRED_DOWN_MARKS` of
them only (a stale reference to one fails at once; an older one would wait out its deadline), so a long run of
restarts leaves neither sockets nor marks behind. An endpoint another live peer advertises is never forgotten.
Of the peers that went down, the latest :data:`DOWN_KEPT` are remembered (:attr:`Peers.down`): a node restarted
under a new id (the default ids hold the pid) leaves its old one behind for good. Whether a node that comes
back is the same process (:func:`incarnation`) or a restart, and how long to wait for it
(``node.restart_grace_s``), is the role's decision: this view only reports.

Opt-in (``runtime.track_peers()``), for roles that act on liveness: its subscription is filtered by topic,
so the broker sends it ``node-up`` and ``node-down`` only, not the whole stream. Gaps are still told: the
broker is those events' one source and publishes no other kind, so every event of its sequence arrives (a
restarted broker is a new incarnation, whose re-joins emit ``node-up`` again). The runtime hands it only those the
broker published: one any other node publishes is refused (:data:`NOT_FROM_BROKER`). Loop thread only.

A restarted broker knows only the nodes that re-join it: one that died while it was down is never reported
down by it. So after a re-join that found a new broker incarnation the runtime calls :meth:`Peers.expect_rejoins`
and, once the registry had time to fill (a node timeout, a heartbeat interval and the sockets' reconnect cap),
looks it up and hands the answer to :meth:`Peers.reconcile`: every live peer neither reported up since nor
listed goes down as above, reason :data:`ABSENT_AFTER_RESTART`. One that died and was restarted under its id
meanwhile re-joins as a new process, which confirms the id: its ``node-up`` reports the dead one down instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import structlog

from ..protocol.envelope import Message
from ..protocol.messages import NodeDown, NodeInfo, NodeUp
from .calls import Calls

log = structlog.get_logger(__name__)

OnUp = Callable[[NodeInfo], None]
OnDown = Callable[[NodeDown, "NodeInfo | None"], None]

KINDS = frozenset({NodeUp.kind, NodeDown.kind})
ABSENT_AFTER_RESTART = "absent-after-broker-restart"  # the reason of a node-down found by :meth:`Peers.reconcile`
NOT_FROM_BROKER = "not-from-broker"  # the code of a node-up or node-down another node published, refused
REPLACED = "replaced"  # the reason of a node-down for a process another took the id from (the broker's word too)
RETIRED_DOWN_MARKS = 1024  # down marks kept for endpoints restarted peers left behind (the newest ones)
# Down peers remembered (their last entry), the latest to go down kept: a node restarted under a new id (default
# ids hold the pid) never comes back under the old one.
DOWN_KEPT = 4096


def incarnation(node: NodeInfo) -> tuple[str, int, float]:
    """What tells one process from a restart under the same node id: host, pid and start time."""
    return node.host, node.pid, node.started


class Peers:
    """Live and down peers with their endpoints (see the module doc). Owned by the runtime
    (``runtime.track_peers()``), which feeds it events (:meth:`handle`) and the start-up lookup (:meth:`seed`).
    ``self_id`` is this node's own id: a ``node-down`` about itself (the broker forgot it) changes nothing."""

    def __init__(self, calls: Calls, self_id: str) -> None:
        self._calls = calls
        self._self_id = self_id
        self.live: dict[str, NodeInfo] = {}
        self.down: dict[str, NodeInfo | None] = {}  # node id -> its last known entry, the earliest down first
        self._up_listeners: list[OnUp] = []
        self._down_listeners: list[OnDown] = []
        self._unconfirmed: set[str] = set()  # live peers a restarted broker has not reported up yet
        self._retired: dict[str, None] = {}  # endpoints left behind by restarted peers, oldest first
        # Whether a registry lookup seeded ``live``: until one did, a peer missing from it may be live all the same
        # (up before this node subscribed, its node-up never heard), so its absence proves nothing.
        self.seeded = False

    def on_up(self, listener: OnUp) -> None:
        """Call ``listener(info)`` for every ``node-up`` (after its endpoints are marked up)."""
        self._up_listeners.append(listener)

    def on_down(self, listener: OnDown) -> None:
        """Call ``listener(event, last_info)`` for every ``node-down`` (before pending calls to it resolve)."""
        self._down_listeners.append(listener)

    def seed(self, nodes: Iterable[NodeInfo], role: str = "") -> None:
        """Peers live when the registry answered a lookup of ``role``'s nodes ("": every role; at this node's
        start, or a later lookup its role makes); listeners are not called. After a lookup of every role
        :attr:`seeded` holds: a peer not live here is not live in the registry."""
        self.seeded = self.seeded or not role
        for node in nodes:
            if node.node_id != self._self_id:
                self.live.setdefault(node.node_id, node)

    def expect_rejoins(self) -> None:
        """The broker restarted (this node found a new incarnation): every live peer must re-join it. Each
        ``node-up`` from now on confirms one; :meth:`reconcile` settles the others."""
        self._unconfirmed = set(self.live)

    def reconcile(self, listed: Iterable[NodeInfo]) -> list[str]:
        """After :meth:`expect_rejoins`, once the new broker's registry had time to fill: mark down (listeners
        and pending calls as for a ``node-down``, reason :data:`ABSENT_AFTER_RESTART`) every live peer that
        neither came up since nor is ``listed`` (the registry's answer); returns their ids. A peer whose
        ``node-up`` crossed the answer is confirmed by that event, so only one the registry lacked goes down
        (should it come up later after all, its ``node-up`` revives it as any other's does)."""
        present = {node.node_id for node in listed}
        gone = sorted(node_id for node_id in self._unconfirmed if node_id in self.live and node_id not in present)
        self._unconfirmed = set()
        for node_id in gone:
            info = self.live[node_id]
            self._down(NodeDown(node_id=node_id, role=info.role, reason=ABSENT_AFTER_RESTART,
                                last_seen=info.last_seen))
        return gone

    def handle(self, message: Message) -> None:
        body = message.body
        if isinstance(body, NodeUp):
            self._up(body.node)
        elif isinstance(body, NodeDown):
            self._down(body)

    def endpoint_of(self, node_id: str, name: str) -> str | None:
        """The endpoint ``name`` that live node ``node_id`` advertises now (a restarted node may have moved),
        or None when it is not live or advertises none."""
        info = self.live.get(node_id)
        return info.endpoints.get(name) if info is not None else None

    def node_of(self, endpoint: str) -> str | None:
        """The id of the node (live or down) that advertised ``endpoint``, or None."""
        for nodes in (self.live, self.down):
            for node_id, info in nodes.items():
                if info is not None and endpoint in info.endpoints.values():
                    return node_id
        return None

    # --- internals ----------------------------------------------------------------------------------

    def _up(self, node: NodeInfo) -> None:
        if node.node_id == self._self_id:
            return
        held = self.live.get(node.node_id)
        if held is not None and incarnation(held) != incarnation(node):
            # Another process took the id of one this view holds live, never reported down: it died while the
            # broker was down, and the restarted broker that this one joined never knew it. Reported down here as
            # that broker would have (``replaced``), its pending calls end now, not at their deadlines.
            self._down(NodeDown(node_id=node.node_id, role=held.role, reason=REPLACED, last_seen=held.last_seen))
        was_down = self.down.pop(node.node_id, None)
        before = self.live.get(node.node_id, was_down)  # what it advertised last, live or down (None: unknown)
        self._unconfirmed.discard(node.node_id)
        self.live[node.node_id] = node
        for endpoint in node.endpoints.values():
            self._calls.mark_up(endpoint)
            self._retired.pop(endpoint, None)
        if before is not None:
            self._retire(set(before.endpoints.values()) - set(node.endpoints.values()))
        for listener in self._up_listeners:
            self._notify(listener, node)

    def _down(self, event: NodeDown) -> None:
        if event.node_id == self._self_id:
            return
        info = self.live.pop(event.node_id, None)
        if info is None:
            info = self.down.pop(event.node_id, None)
        self.down[event.node_id] = info
        while len(self.down) > DOWN_KEPT:
            del self.down[next(iter(self.down))]
        log.info("peer.down", node=event.node_id, role=event.role, reason=event.reason,
                 endpoints=sorted(info.endpoints.values()) if info else [])
        for listener in self._down_listeners:
            self._notify(listener, event, info)
        if info is not None:
            reason = f"{event.node_id} reported down ({event.reason})"
            for endpoint in info.endpoints.values():
                self._calls.mark_down(endpoint, reason)
            for endpoint in set(info.endpoints.values()) - self._advertised():
                self._calls.forget(endpoint)  # its pending calls just ended: closed now (or at the next tick)

    def _advertised(self) -> set[str]:
        """Every endpoint a live peer advertises."""
        return {endpoint for info in self.live.values() for endpoint in info.endpoints.values()}

    def _retire(self, endpoints: set[str]) -> None:
        """``endpoints`` a restarted peer no longer advertises: dead for good unless a live peer has them."""
        for endpoint in sorted(endpoints - self._advertised()):
            self._calls.forget(endpoint)
            if self._calls.down_reason(endpoint) is not None:
                self._retired[endpoint] = None
        while len(self._retired) > RETIRED_DOWN_MARKS:
            oldest = next(iter(self._retired))
            del self._retired[oldest]
            self._calls.mark_up(oldest)  # drops only its mark: no client is left to it

    @staticmethod
    def _notify(listener: Callable[..., None], *args: object) -> None:
        try:
            listener(*args)
        except Exception:  # one role's failing listener must not cost the others their news
            log.exception("peers.listener_failed")
