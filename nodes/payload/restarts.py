"""Requests that outlive a durable store's restart.

A durable env server killed with SIGKILL is restarted under its node id, re-adopts its store (every blob it
had acknowledged, with its holder and tombstones) and may listen on another port. A request to it that
failed meanwhile (``PeerDown``: the registry reported it down; ``RequestTimeout``: nothing answered) is not
lost: :class:`StoreRestarts` sends it again, re-located to where the store's node id listens then, until
``node.restart_grace_s`` after it was first sent (past it, for a caller that says when its store is back or still
awaited, for one retry schedule more: the orchestrator's claims). Fetches (trainer ranks) and claims (the
orchestrator) are answered the same however often they arrive (a claim repeated by its holder is ``already``), so
they are sent again to any process; a delete (trainer ranks) only to another process than the one it went to, which
answers what its predecessor had committed as done (``repeated``). A request its store answered with
``retry_after_s`` (nothing changed) is not this module's: callers ask ``calls`` to send it again
(``retry_after``), to the same process, within the request's deadline.

Events published while a durable store was dead never reach it: :class:`StoreReturns` tells a role when such a
store is back as a new process, and listening, so it can publish again what that process missed (the
``reference`` events of hand-overs).

No torch here: the orchestrator uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...bus.calls import Calls
from ...bus.peers import Peers, incarnation
from ...bus.reqrep import Outcome, PeerDown, RequestTimeout
from ...protocol.messages import Accounts, NodeDown, NodeInfo


class _OfBlobs(Protocol):
    @property
    def blob_ids(self) -> list[str]: ...


R = TypeVar("R")
B = TypeVar("B", bound=_OfBlobs)
Sent = tuple[tuple[str, R], Outcome]  # a request (endpoint, body) and how it ended


def durable_store(peers: Peers, node_id: str) -> bool:
    """Whether ``node_id``'s last registry entry names a durable store (a restart re-adopts its blobs)."""
    info = peers.live.get(node_id) or peers.down.get(node_id)
    return info is not None and "store" in info.labels


@dataclass(frozen=True)
class StoreRestarts:
    """How a request outlives a store's restart: one to a durable store (``durable(node id)``, e.g.
    :func:`durable_store`) that failed (down, or unanswered) is sent again, re-located, every ``poll_s``
    (``later(delay, callback)``: the node loop's timer) until ``wait_s`` after it was first sent
    (``node.restart_grace_s``); past that, for ``back_s`` more (a retry schedule), while ``back(node id)`` says its
    store is back or still awaited: a restarted process that registers as the wait ends ends the request that went
    to the dead one then, and would otherwise never be asked. Which failed requests may be sent again, and when,
    is the caller's rule (:meth:`gather`'s ``again``)."""

    durable: Callable[[str], bool]
    later: Callable[[float, Callable[[], None]], None]
    wait_s: float
    poll_s: float = 0.1
    back: Callable[[str], bool] | None = None
    back_s: float = 0.0

    def waiting(self, sent: Sequence[Sent[B]], node_of: Callable[[str], str], elapsed_s: float) -> list[B] | None:
        """The requests of ``sent`` that failed for want of their store (down, or unanswered) with every blob
        (``node_of(blob id)``: its store's node id) on a durable store, and, once ``elapsed_s`` since the first
        send is past ``wait_s``, one ``back`` says is back or awaited; None when there are none or ``elapsed_s``
        is past ``wait_s`` plus ``back_s`` (past ``wait_s`` without ``back``): the requests a restarted process
        may still answer."""
        if elapsed_s < self.wait_s:
            store = self.durable
        elif (back := self.back) is not None and elapsed_s < self.wait_s + self.back_s:
            def store(node: str) -> bool:
                return self.durable(node) and back(node)
        else:
            return None
        return [request for (_, request), outcome in sent if isinstance(outcome, PeerDown | RequestTimeout)
                and all((node := node_of(blob_id)) and store(node) for blob_id in request.blob_ids)] or None

    def gather(self, calls: Calls, requests: list[tuple[str, R]], done: Callable[[list[Sent[R]]], None], *,
               again: Callable[[list[Sent[R]]], list[R] | None],
               relocate: Callable[[list[R]], list[tuple[str, R]]], settled: Sequence[Sent[R]] = (),
               **options: Any) -> None:
        """Send ``requests`` (``calls.gather`` with ``options``); once each has its outcome, ``again(sent)``
        picks the failed ones to send again after ``poll_s`` (``relocate`` turns them into new requests, to
        their stores' endpoints then), or ``[]`` to look again after ``poll_s`` without sending, or None: then
        ``done`` gets every request's last outcome (``settled`` ones included). Loop thread only."""

        def ended(outcomes: list[Outcome]) -> None:
            sent = [*settled, *zip(requests, outcomes, strict=True)]
            retry = again(sent)
            if retry is None:
                done(sent)
                return
            kept = [entry for entry in sent if not any(entry[0][1] is request for request in retry)]
            self.later(self.poll_s, lambda: self.gather(calls, relocate(retry), done, again=again, relocate=relocate,
                                                        settled=kept, **options))

        calls.gather(requests, ended, **options)


class StoreReturns:
    """Calls ``back(node id)`` when a durable env server registers as another process than the one last heard of
    (a restart that re-adopted its blobs, or one not heard of yet) and ``wanted(node id)`` says this role has
    something to tell it: first it asks the new process a read (``accounts``), whose answer says its loop runs and
    so its subscriptions are live (it registers, hence the ``node-up``, before they are); no answer by the deadline
    still calls ``back`` (a live store whose loop most likely runs by then), one that went down again meanwhile does
    not (its next process's ``node-up`` asks again). A ``node-down`` forgets the process heard: the next
    ``node-up``, even of the same process, counts. Subscribes on ``peers``; loop thread only."""

    def __init__(self, peers: Peers, calls: Calls, wanted: Callable[[str], bool], back: Callable[[str], None]) -> None:
        self._peers = peers
        self._calls = calls
        self._wanted = wanted
        self._back = back
        self._heard: dict[str, tuple[str, int, float]] = {}  # live durable store -> its process last heard
        peers.on_up(self._up)
        peers.on_down(self._down)

    def _up(self, info: NodeInfo) -> None:
        endpoint, process = info.endpoints.get("blobs"), incarnation(info)
        if endpoint is None or not durable_store(self._peers, info.node_id) or self._heard.get(info.node_id) == process:
            return  # no env server re-adopting blobs, or the same process joining again (a broker restart)
        self._heard[info.node_id] = process
        if self._wanted(info.node_id):
            self._calls.request(endpoint, Accounts(holders=1), lambda outcome: self._answered(info.node_id, outcome))

    def _down(self, down: NodeDown, info: NodeInfo | None) -> None:
        self._heard.pop(down.node_id, None)

    def _answered(self, node: str, outcome: Outcome) -> None:
        if not isinstance(outcome, PeerDown):
            self._back(node)
