"""Asynchronous requests from a node loop: send now, get exactly one outcome later, never block the loop.

Every call has a deadline. Its outcome is exactly one of: the reply (a :class:`Message`), the server's
``error`` reply (:class:`RemoteError`), no reply by the deadline (:class:`RequestTimeout`), or the peer
reported down meanwhile or before it was sent (:class:`PeerDown`). It reaches the call's ``on_done`` on
the loop thread, once; replies arriving after that are dropped and counted (``late``), malformed ones are
counted by error code (``rejected``) and resolve nothing.

Retries resend the same frames (the same message id) at the times the call's :class:`RetryPolicy` gives,
so a server answers a repeat from its reply cache instead of running it twice. A handler that defers its
reply is not cached: call it with :data:`SEND_ONCE` and the deadline it needs. A call that ended without an
answer is repeated the same way by a new call given its id (``msg_id``). A call made with ``retry_after``
answered an ``error`` with ``retry_after_s`` > 0 (its handler changed nothing and did not cache the error: an
env server that could not journal a claim, fetch or delete) is sent again, the same frames, that long after,
its policy's attempts starting over, while that is before its deadline; the error is its outcome once it is
not.

Sends never block the loop: a request the full send queue refuses (the peer gone or partitioned with a
high-water mark's worth already queued to it) is an attempt without a reply (counted in the client's
``unsent``, logged), resent when the policy's next attempt is due, and ends in :class:`RequestTimeout` at its
deadline like any unanswered request.

An endpoint marked down (:meth:`Calls.mark_down`, fed by the registry's ``node-down`` through
:class:`~refbus.bus.peers.Peers`) gets no retry schedule: its pending calls end with :class:`PeerDown` at
once, and so does every new request to it (on the next loop turn, never inside :meth:`Calls.request`),
until it is marked up again. The latest ``DOWN_MARKS`` marks are kept: an endpoint whose mark went (its node
down long ago, while as many others went down since) is asked again and its requests end by their deadlines.

A client is kept per endpoint until :meth:`Calls.forget` closes it: the registry's view
(:class:`~refbus.bus.peers.Peers`) forgets the endpoints of a peer reported down and those a restarted peer
no longer advertises, so a long run of restarts (each on a new ephemeral port) leaves no socket behind.

:meth:`Calls.gather` sends many requests at once (a window per endpoint) and hands their outcomes over in one
list when the last one ends (and, to a caller that asks, each one as it ends). :meth:`Calls.run_until` drives
the calls without a node loop: from a thread that runs none (a benchmark, a test driving a fetcher), or from a
node's shutdown hooks once its loop has stopped.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

from ..protocol.codec import ArrayBackend
from ..protocol.envelope import Message, MessageIds
from ..protocol.errors import ProtocolError
from ..protocol.messages import Body, Error
from .reqrep import Attempts, Client, Outcome, PeerDown, RemoteError, RequestTimeout, RetryPolicy, unsent_note
from .sockets import readable, recv_frames

log = structlog.get_logger(__name__)

# Endpoints marked down kept at most, the latest marked kept: one whose mark goes (its node down long ago, never
# back under those endpoints) is asked again like any endpoint, and its requests end by their deadlines.
DOWN_MARKS = 4096

OnDone = Callable[[Outcome], None]
Connect = Callable[[str], Client]
Watch = Callable[[zmq.Socket, Callable[[], None]], None]
Release = Callable[[Client], None]


@dataclass
class _Call:
    msg_id: str
    endpoint: str
    kind: str
    frames: list
    on_done: OnDone
    backend: ArrayBackend
    attempts: Attempts
    verify: bool = True
    due: float = 0.0
    unsent: int = 0  # attempts the full send queue refused
    retry_after: bool = False  # an error with retry_after_s > 0 is not the outcome while the deadline allows a resend
    refused: str = ""  # why no client was made for it (its endpoint down or unusable): PeerDown on the next tick


class Calls:
    """Asynchronous requests issued from the node loop thread. Owned by the :class:`NodeRuntime`
    (``runtime.calls``), which drives it: :meth:`wait_s` bounds the loop's poll, :meth:`tick` runs after
    it every turn, and each peer's socket is drained when readable.

    :meth:`request` sends at once and returns; exactly one of reply / remote error / timeout / peer down
    reaches ``on_done``, on the loop thread, exactly once (an exception it raises is logged, not
    propagated). Late replies after the outcome are dropped (counted). Loop thread only: from other threads
    go through ``runtime.call_soon``.
    """

    def __init__(self, connect: Connect, policy: RetryPolicy, *, watch: Watch | None = None, budget: int = 256,
                 release: Release | None = None) -> None:
        """``connect(endpoint)`` makes the one client per endpoint (closed by its maker); ``watch(sock, cb)``
        has ``cb`` called when ``sock`` is readable (a node loop's poller; None: nothing polls the sockets but
        :meth:`run_until`); ``release(client)`` stops watching a client :meth:`forget` drops and closes it
        (default: only closes it); ``policy`` is the default retry policy; ``budget`` caps the replies handled
        per socket per turn, so other sockets get theirs."""
        self._connect = connect
        self._watch = watch
        self._release = release if release is not None else Client.close
        self.policy = policy
        self._budget = budget
        self._clients: dict[str, Client] = {}
        self._polled: tuple[list[Client], zmq.Poller] | None = None  # run_until's poller and its clients
        self._pending: dict[str, _Call] = {}
        self._per_endpoint: Counter[str] = Counter()
        self._due: list[tuple[float, int, str]] = []  # (due, tie-break, msg id); stale entries are skipped
        self._order = itertools.count()
        self._down: dict[str, str] = {}  # endpoint -> why it is down, the earliest marked first
        self._held: set[str] = set()  # endpoints whose client a caller keeps: never forgotten
        self._forgetting: set[str] = set()  # to forget once no call to them is pending
        self._down_ids = MessageIds()  # ids of requests refused without a client (endpoint down or unusable)
        self._refused: list[_Call] = []  # requests to a down endpoint: PeerDown on the next tick
        self._soon: list[Callable[[], None]] = []  # outcomes known at once, delivered on the next tick
        self.outcomes: Counter[str] = Counter()  # reply / remote-error / timeout / peer-down
        self.late = 0
        self.rejected: Counter[str] = Counter()

    def client(self, endpoint: str, *, held: bool = False) -> Client:
        """The one client to ``endpoint``, made and watched on first use. Blocking ``request`` on it is
        allowed (before the loop runs, or for a short round trip): replies it meets that belong to pending
        calls are handed back here (decoded with that request's backend). ``held``: the caller keeps the
        client object itself (the broker's control client), so :meth:`forget` never closes it."""
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = self._connect(endpoint)
            client.on_stray = lambda reply: self._resolve(reply, endpoint)
            if self._watch is not None:
                self._watch(client.sock, lambda: self._drain(client))
        if held:
            self._held.add(endpoint)
        return client

    def forget(self, endpoint: str) -> bool:
        """Close the client to ``endpoint`` (its socket unwatched and closed, linger 0) and drop what is kept
        about it, once no call to it is pending: at once when none is (True), else when the last one ends
        (False; a request made meanwhile keeps it until that one ends too). For an endpoint that is gone for
        good (a restarted peer's old port): its socket would otherwise hold a file descriptor and reconnect
        to it for ever. A later request to it makes a new client, unless it is still marked down
        (:meth:`mark_down` marks are not touched here): that request fails at once, as before, and no client
        is made for it. Unknown and ``held`` endpoints are left alone (False)."""
        if endpoint in self._held or endpoint not in self._clients:
            self._forgetting.discard(endpoint)
            return False
        if self._per_endpoint[endpoint]:
            self._forgetting.add(endpoint)
            return False
        self._forgetting.discard(endpoint)
        client = self._clients.pop(endpoint)
        client.on_stray = None
        self._release(client)
        return True

    def request(
        self,
        endpoint: str,
        body: Body,
        on_done: OnDone,
        *,
        deadline_s: float | None = None,
        policy: RetryPolicy | None = None,
        backend: ArrayBackend = "numpy",
        verify: bool = True,
        msg_id: str = "",
        retry_after: bool = False,
    ) -> str:
        """Send ``body`` to ``endpoint`` now, without blocking (a full send queue makes this attempt one without a
        reply); its outcome goes to ``on_done`` later. ``deadline_s`` from now (default: the sum of the policy's attempt
        timeouts); ``policy`` (default: the runtime's) says when to resend. ``backend`` decodes the reply's arrays
        (``"numpy"``, the default, keeps torch out whatever the peer tagged); ``verify=False`` skips frame checksums for
        a caller that verifies the bytes itself. The reply's arrays belong to ``on_done``. Returns the message id (for
        :meth:`cancel`). A request to an endpoint reported down, or to one ZeroMQ cannot connect to (a peer's garbage
        address), gets no client and ends with :class:`PeerDown` on the next tick.

        ``msg_id`` (default: a new id) sends it as the request of that id: given the id and body of an earlier
        call that has ended without an answer (its peer reported down), it is that request again, so a server
        that carried it out answers from its reply cache (or refuses it ``replay``) instead of running it twice.
        Raises ``ValueError`` for the id of a call still pending.

        ``retry_after``: an ``error`` reply with ``retry_after_s`` > 0 (the server changed nothing, and runs the
        same request again) is not the outcome while the deadline is more than that far off: the request is sent
        again that long after (logged), its policy's attempts starting over. For requests to a handler that
        answers so, whose outcome the caller would otherwise give up on (an env server's claims, fetches and
        deletes: a full tmpfs for a moment)."""
        if msg_id in self._pending:
            raise ValueError(f"request {msg_id!r} is still pending: it is resent by its own retry policy")
        refused = self._down.get(endpoint)
        client = None
        if refused is None:
            try:
                client = self.client(endpoint)
            except zmq.ZMQError as exc:  # the call fails, not the caller
                log.warning("request.bad_endpoint", kind=body.kind, endpoint=endpoint, error=str(exc))
                refused = f"not an endpoint this node can connect to: {exc}"
        msg_id, frames = (msg_id or self._down_ids.next(), []) if client is None else client.encode(body, msg_id)
        call = _Call(msg_id, endpoint, body.kind, frames, on_done, backend,
                     Attempts(policy or self.policy, deadline_s, _now()), verify, refused=refused or "",
                     retry_after=retry_after)
        self._pending[msg_id] = call
        self._per_endpoint[endpoint] += 1
        if client is None:
            self._refused.append(call)  # resolved by the next tick: on_done never runs inside request()
        else:
            self._attempt(call, _now())
        return msg_id

    def gather(
        self,
        requests: Sequence[tuple[str, Body]],
        on_done: Callable[[list[Outcome]], None],
        *,
        window: int = 8,
        deadline_s: float | None = None,
        policy: RetryPolicy | None = None,
        backend: ArrayBackend = "numpy",
        verify: bool = True,
        retry_after: bool = False,
        on_each: Callable[[Body, Outcome], None] | None = None,
    ) -> None:
        """The asynchronous :func:`~.reqrep.gather`: send ``(endpoint, body)`` requests, at most ``window`` in
        flight per endpoint (the next one is sent when one ends), each as :meth:`request` with the other
        arguments (``deadline_s`` counts from when each is sent). ``on_done`` gets one outcome per request, in
        order, once the last one ends: on the loop thread, never inside this call (an empty list included).
        Sort them with :func:`~.reqrep.split_outcomes`. ``on_each(body, outcome)``, when given, is told of each
        request as it ends, on the loop thread, before ``on_done``: a caller that can use the early replies
        (a fetch assembling what has come while the rest is on the wire) need not wait for the last. Nothing
        here keeps the outcomes once ``on_done`` has them, so the frames of a reply are freed as soon as the
        caller drops it (no garbage collection needed)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        gathering = _Gathering(self, requests, on_done, on_each, window,
                               dict(deadline_s=deadline_s, policy=policy, backend=backend, verify=verify,
                                    retry_after=retry_after))
        if not requests:
            self._soon.append(lambda: on_done([]))
        gathering.start()

    def peer_down(self, endpoint: str, reason: str) -> int:
        """Resolve every pending call to ``endpoint`` with :class:`PeerDown`; returns how many."""
        calls = [c for c in self._pending.values() if c.endpoint == endpoint]
        for call in calls:
            self._finish(call, PeerDown(endpoint, reason))
        return len(calls)

    def mark_down(self, endpoint: str, reason: str) -> int:
        """The registry reports the peer at ``endpoint`` down: resolve its pending calls with :class:`PeerDown`
        (returns how many) and refuse new requests to it the same way until :meth:`mark_up` (or until
        ``DOWN_MARKS`` endpoints were marked down since)."""
        self._down.pop(endpoint, None)  # marked again: the latest mark last
        self._down[endpoint] = reason
        while len(self._down) > DOWN_MARKS:
            del self._down[next(iter(self._down))]
        return self.peer_down(endpoint, reason)

    def mark_up(self, endpoint: str) -> None:
        """The peer at ``endpoint`` is live again (it re-registered): requests to it are sent again."""
        self._down.pop(endpoint, None)

    def down_reason(self, endpoint: str) -> str | None:
        """Why ``endpoint`` is marked down, or None while it is not."""
        return self._down.get(endpoint)

    def cancel(self, msg_id: str) -> bool:
        """Forget a pending call without calling its ``on_done``; False when it is not pending."""
        call = self._pending.get(msg_id)
        if call is None:
            return False
        self._forget(call)
        return True

    def in_flight(self, endpoint: str | None = None) -> int:
        """Pending calls (to ``endpoint``, or to all)."""
        return len(self._pending) if endpoint is None else self._per_endpoint[endpoint]

    def tick(self) -> None:
        """Resend what is due and time out what has reached its deadline. Runs every loop turn: nothing is
        allocated when nothing is waiting."""
        if self._soon:
            soon, self._soon = self._soon, []
            for callback in soon:
                _run_callback(callback, "deferred")
        if self._refused:
            refused, self._refused = self._refused, []
            for call in refused:
                if call.msg_id in self._pending:  # not cancelled meanwhile
                    self._finish(call, PeerDown(call.endpoint, call.refused))
        if not self._due:
            return
        now = _now()
        while self._due and self._due[0][0] <= now:
            due, _, msg_id = heapq.heappop(self._due)
            call = self._pending.get(msg_id)
            if call is not None and call.due == due:
                self._attempt(call, now)

    def wait_s(self) -> float | None:
        """Seconds until :meth:`tick` has something to do; None when nothing is pending."""
        if self._soon:
            return 0.0
        if not self._pending:
            self._due.clear()  # only stale entries are left
            return None
        if self._refused:
            return 0.0
        return max(0.0, self._due[0][0] - _now())

    def run_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Serve replies, resends and deadlines on this thread until ``done()`` (True) or ``timeout_s`` passes
        (False). For the owner of sockets no loop polls now: a thread without a node loop, or a node's shutdown
        hook (its loop has stopped and handed it the sockets). Outcomes reach their ``on_done`` here."""
        end = _now() + timeout_s
        while not done():
            left = end - _now()
            if left <= 0:
                return False
            wait = self.wait_s()
            clients, poller = self._poller()
            readable_now = {sock for sock, _ in poller.poll(1000 * min(left, wait if wait is not None else left))}
            for client in clients:
                # Not when forgotten by an earlier outcome of this turn (its socket is closed).
                if client.sock in readable_now and self._clients.get(client.endpoint) is client:
                    self._drain(client)
            self.tick()
        return True

    def _poller(self) -> tuple[list[Client], zmq.Poller]:
        """A poller of every client's socket, made again only when the clients changed (compared by identity:
        the kept list holds them, so no identity is reused meanwhile)."""
        clients = list(self._clients.values())
        if self._polled is None or len(self._polled[0]) != len(clients) or \
                any(a is not b for a, b in zip(self._polled[0], clients, strict=True)):
            poller = zmq.Poller()
            for client in clients:
                poller.register(client.sock, zmq.POLLIN)
            self._polled = (clients, poller)
        return self._polled

    def close(self) -> None:
        """Drop every pending call without an outcome (the node is shutting down; its sockets close)."""
        self._pending.clear()
        self._per_endpoint.clear()
        self._due.clear()
        self._refused.clear()
        self._soon.clear()
        self._forgetting.clear()

    # --- internals ----------------------------------------------------------------------------------

    def _attempt(self, call: _Call, now: float) -> None:
        step = call.attempts.next(now)
        if step is None:
            note = unsent_note(call.endpoint, call.unsent)
            self._finish(call, RequestTimeout(f"no reply from {call.endpoint} to {call.kind} within the deadline "
                                              f"({call.attempts.sent} attempts){note}"))
            return
        send, call.due = step
        heapq.heappush(self._due, (call.due, next(self._order), call.msg_id))
        if send:
            client = self._clients[call.endpoint]
            if call.attempts.sent > 1:
                client.retries += 1
                log.info("request.retry", kind=call.kind, endpoint=call.endpoint, attempt=call.attempts.sent)
            if not client.try_send(call.frames, call.kind):
                call.unsent += 1  # no reply can come to it: due again at the next attempt, or at the deadline

    def _drain(self, client: Client) -> None:
        """Take the replies waiting on ``client`` (its socket polled readable): at most the budget, each
        after the first only once :func:`readable` says one is there (a receive that finds none raises)."""
        for _ in range(self._budget):
            try:
                frames = recv_frames(client.sock, zmq.NOBLOCK)  # TooManyFrames: a ProtocolError, refused below
                checked = client.codec.decode_header(frames)
                call = self._pending.get(checked.header.re)
                # A reply to no pending call is decoded without torch or checksums: it is only counted.
                backend = call.backend if call is not None else "numpy"
                reply = client.codec.decode(frames, backend=backend, verify=call is not None and call.verify,
                                            checked=checked)
            except zmq.Again:
                return
            except ProtocolError as exc:
                self.rejected[exc.code] += 1
                log.warning("reply.rejected", endpoint=client.endpoint, code=exc.code, error=str(exc))
            else:
                self._resolve(reply, client.endpoint)
            if client.sock.closed or not readable(client.sock):  # an outcome's on_done may forget its client
                return

    def _resolve(self, reply: Message, endpoint: str) -> None:
        call = self._pending.get(reply.header.re)
        if call is None or call.endpoint != endpoint:
            self.late += 1
            log.debug("reply.late", endpoint=endpoint, kind=reply.kind)
            return
        body = reply.body
        if isinstance(body, Error) and self._again_later(call, body):
            return
        self._finish(call, RemoteError(body, call.endpoint) if isinstance(body, Error) else reply)

    def _again_later(self, call: _Call, error: Error) -> bool:
        """Whether ``call`` (made with ``retry_after``) is sent again ``error.retry_after_s`` from now, before
        its deadline, instead of ending with ``error``: the server changed nothing and did not cache it, so the
        same frames run the request again."""
        now = _now()
        due = now + error.retry_after_s
        if not call.retry_after or error.retry_after_s <= 0 or due >= call.attempts.deadline:
            return False
        log.info("request.retry_after", kind=call.kind, endpoint=call.endpoint, code=error.code,
                 retry_after_s=error.retry_after_s)
        call.attempts.start_over()
        call.due = due  # the policy's next resend, already queued, is skipped as stale
        heapq.heappush(self._due, (due, next(self._order), call.msg_id))
        return True

    def _forget(self, call: _Call) -> None:
        endpoint = call.endpoint
        del self._pending[call.msg_id]
        self._per_endpoint[endpoint] -= 1
        if not self._per_endpoint[endpoint]:
            del self._per_endpoint[endpoint]
            if endpoint in self._forgetting:
                # On the next tick, not here: the client may be in the middle of a drain or a blocking request.
                self._soon.append(lambda: self._forget_idle(endpoint))

    def _forget_idle(self, endpoint: str) -> None:
        if endpoint in self._forgetting:  # not cancelled meanwhile (close)
            self.forget(endpoint)

    def _finish(self, call: _Call, outcome: Outcome) -> None:
        self._forget(call)
        self.outcomes[_OUTCOME_NAMES[type(outcome)]] += 1
        _run_callback(lambda: call.on_done(outcome), call.kind, call.endpoint)


def _run_callback(callback: Callable[[], None], kind: str, endpoint: str = "") -> None:
    try:
        callback()
    except Exception:
        log.exception("request.on_done_failed", kind=kind, endpoint=endpoint)


_OUTCOME_NAMES: dict[type, str] = {Message: "reply", RemoteError: "remote-error", RequestTimeout: "timeout",
                                   PeerDown: "peer-down"}

_now = time.monotonic


class _Gathering:
    """One :meth:`Calls.gather` in progress. An object, not closures that call each other: such closures form a
    reference cycle through their cells, and the outcomes (received frames of every reply) would then live until
    the garbage collector happens to run, so each step's frames landed in fresh, page-faulting memory."""

    __slots__ = ("_calls", "_left", "_on_done", "_on_each", "_options", "_outcomes", "_queued", "_requests",
                 "_window")

    def __init__(self, calls: Calls, requests: Sequence[tuple[str, Body]], on_done: Callable[[list[Outcome]], None],
                 on_each: Callable[[Body, Outcome], None] | None, window: int, options: dict[str, Any]) -> None:
        self._calls = calls
        self._requests = requests
        self._on_done = on_done
        self._on_each = on_each
        self._options = options
        self._outcomes: list[Outcome | None] = [None] * len(requests)
        self._queued: dict[str, deque[int]] = defaultdict(deque)
        for index, (endpoint, _) in enumerate(requests):
            self._queued[endpoint].append(index)
        self._left = len(requests)
        self._window = window

    def start(self) -> None:
        for endpoint, indices in list(self._queued.items()):
            for _ in range(min(self._window, len(indices))):
                self._send(endpoint)

    def _send(self, endpoint: str) -> None:
        index = self._queued[endpoint].popleft()
        self._calls.request(endpoint, self._requests[index][1],
                            lambda outcome: self._ended(index, endpoint, outcome), **self._options)

    def _ended(self, index: int, endpoint: str, outcome: Outcome) -> None:
        self._outcomes[index] = outcome
        self._left -= 1
        if self._on_each is not None:
            self._on_each(self._requests[index][1], outcome)
        if self._queued[endpoint]:
            self._send(endpoint)
        elif not self._left:
            outcomes, self._outcomes = self._outcomes, []  # handed over: the caller alone decides how long they live
            self._on_done(outcomes)  # type: ignore[arg-type]  # every slot is filled
