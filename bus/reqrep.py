"""Request/reply over DEALER (client) and ROUTER (server), with timeouts, retries and idempotency.

The contract:

* A request carries a message id. A retry resends the *same* frames, so the same id.
* The server executes a request once per ``(source, id)``: a retried request is answered again from a reply
  cache and not executed a second time. Handlers registered with ``cached=False`` (reads such as ``fetch``)
  are simply re-executed, so large replies are not kept. Neither is an error reply that asks for a retry
  (``retry_after_s`` > 0: its handler changed nothing), so the same request sent again runs again.
* Every failure becomes an ``error`` reply with a stable code: malformed frames, unknown kinds, schema and
  version errors, oversized messages, handler errors (:class:`HandlerError`), unexpected exceptions
  (``internal``). The server keeps serving others whatever it receives.
* No request without a deadline: every request ends by its :class:`RetryPolicy` (finite attempts, each with a
  finite timeout) or an explicit deadline. A client raises :class:`RemoteError` for an ``error`` reply and
  :class:`RequestTimeout` at the deadline. Late replies to earlier requests are passed to ``on_stray``.
* Sending never waits: a DEALER keeps its queue to a peer whose connection dropped and would block once that
  queue reaches its high-water mark, so every request is sent with ``NOBLOCK``. A send the full queue refuses
  is an attempt that gets no reply (counted in :attr:`Client.unsent`, logged): the retry policy resends it when
  the next attempt is due, and the request ends in :class:`RequestTimeout` at its deadline like any other
  unanswered one, its message saying that the send queue was full.
* Requests issued from a node loop that must not block it go through :class:`~.calls.Calls`; outcomes of
  either path are sorted by :func:`split_outcomes`.

Neither class is thread-safe: one owner thread each.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from math import ceil, isfinite
from typing import TypeVar

import structlog
import zmq

from ..protocol.codec import ArrayBackend
from ..protocol.envelope import MIN_FRAMES, Message, WireCodec
from ..protocol.errors import ProtocolError
from ..protocol.messages import Body, Error, Ok
from .security import peer_id
from .sockets import DEFAULT_OPTIONS, SocketOptions, TooManyFrames, make_socket, recv_frames, recv_routed, send_frames

log = structlog.get_logger(__name__)


MIN_TIMEOUT_S = 0.001
"""The shortest wait for a reply a retry policy may schedule: a shorter one is no wait at all (a request resent
without end, a zero backoff's division by zero), not a schedule anyone meant."""

MAX_ATTEMPTS = 1 << 16
"""The most attempts of one retry policy: its schedule is a tuple of that many timeouts, computed up front."""

INTERRUPT_CHECK_MS = 50
"""How often a :class:`Client` whose :attr:`~Client.interrupt` is set calls it while it waits for a reply: the
longest a stop waits for a starting node's request to give way to it."""


@dataclass(frozen=True)
class RetryPolicy:
    """The one retry policy: ``attempts`` tries, the wait growing by ``backoff`` up to ``max_timeout_s``.

    Refused (``ValueError``): fewer than 1 or more than :data:`MAX_ATTEMPTS` attempts, a timeout that is not
    finite, or any attempt's timeout below :data:`MIN_TIMEOUT_S` (a backoff of 0, or one so small that it shrinks
    the wait to nothing; a ``max_timeout_s`` that caps it there)."""

    timeout_s: float = 2.0
    attempts: int = 3
    backoff: float = 2.0
    max_timeout_s: float = 10.0
    _schedule: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A policy is a request's deadline: it must end.
        if not 1 <= self.attempts <= MAX_ATTEMPTS or not (
                self.timeout_s > 0 and isfinite(self.timeout_s) and isfinite(self.max_timeout_s)):
            raise ValueError(f"a retry policy needs 1 to {MAX_ATTEMPTS} attempts and finite positive timeouts, "
                             f"not {self}")
        if not isfinite(self.backoff):
            raise ValueError(f"a retry policy needs a finite backoff, not {self}")
        schedule = [self.timeout_s]
        for _ in range(self.attempts - 1):
            schedule.append(min(schedule[-1] * self.backoff, self.max_timeout_s))
        if (shortest := min(schedule)) < MIN_TIMEOUT_S:
            raise ValueError(f"a retry policy whose attempts wait {shortest:g} s for a reply (under "
                             f"{MIN_TIMEOUT_S:g} s) resends without waiting: raise its backoff or max_timeout_s, "
                             f"not {self}")
        # Computed once: every request walks it on its round trip's critical path.
        object.__setattr__(self, "_schedule", tuple(schedule))

    def timeouts(self) -> tuple[float, ...]:
        """Each attempt's timeout, in order."""
        return self._schedule

    @property
    def deadline_s(self) -> float:
        """The default deadline of a request under this policy: the sum of its attempts' timeouts."""
        return sum(self.timeouts())

    def lasting(self, deadline_s: float) -> RetryPolicy:
        """This policy with more attempts, so that a request whose outcome must be known is sent again (the
        same frames: a server answers a repeat from its reply cache) until ``deadline_s``, not only until
        :attr:`deadline_s`. Pass ``deadline_s`` as the request's deadline too: it, not the count, ends it. At
        most :data:`MAX_ATTEMPTS` attempts: a deadline longer than that many of the last timeout is waited out
        after the last send."""
        more = max(0.0, deadline_s - self.deadline_s)
        return replace(self, attempts=min(MAX_ATTEMPTS, self.attempts + ceil(more / self.timeouts()[-1])))


SEND_ONCE = RetryPolicy(attempts=1)
"""For requests whose handler answers late (a deferred reply is not cached, so a resend would run it again):
one send, then wait until the call's deadline."""


class Attempts:
    """When one request is (re)sent and when it is given up: the policy's attempts, none after ``deadline``
    (absolute, monotonic); the last attempt waits until the deadline."""

    __slots__ = ("_policy", "_timeouts", "deadline", "sent")

    def __init__(self, policy: RetryPolicy, deadline_s: float | None, now: float) -> None:
        self._policy = policy
        self._timeouts = iter(policy.timeouts())
        self.deadline = now + (policy.deadline_s if deadline_s is None else deadline_s)
        self.sent = 0

    def next(self, now: float) -> tuple[bool, float] | None:
        """Call when the request is due (and once at the start): ``(send now?, when it is due next)``, or
        None once the deadline has passed."""
        if now >= self.deadline:
            return None
        timeout = next(self._timeouts, None)
        if timeout is None:
            return False, self.deadline
        self.sent += 1
        return True, min(now + timeout, self.deadline)

    def start_over(self) -> None:
        """The server asked for the request again later (``retry_after_s``): the next :meth:`next` sends, the
        policy's attempts starting over; the deadline stays."""
        self._timeouts = iter(self._policy.timeouts())


class RequestTimeout(TimeoutError):
    """No reply by the request's deadline (every attempt of its retry policy sent)."""


class RemoteError(Exception):
    """The server answered with an ``error`` reply."""

    def __init__(self, error: Error, endpoint: str) -> None:
        self.code = error.code
        self.detail = error.message
        self.retry_after_s = error.retry_after_s
        self.endpoint = endpoint
        super().__init__(f"{endpoint} rejected {error.request_kind or 'request'}: [{error.code}] {error.message}")


class PeerDown(Exception):
    """The peer was reported down (registry ``node-down``) while the request was pending, or before it was
    sent."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"{peer} went down: {reason}")


Outcome = Message | RemoteError | RequestTimeout | PeerDown
"""How a request ended: its reply, or why there is none."""

Failure = RemoteError | RequestTimeout | PeerDown

K = TypeVar("K")


def split_outcomes(keyed: Iterable[tuple[K, Outcome]]) -> tuple[list[tuple[K, Message]], list[tuple[K, Failure]]]:
    """Sort :func:`gather` / :class:`~.calls.Calls` outcomes into replies and failures, keeping the caller's
    keys (and their order): ``split_outcomes(zip(calls, gather(calls)))``."""
    replies: list[tuple[K, Message]] = []
    failures: list[tuple[K, Failure]] = []
    for key, outcome in keyed:
        if isinstance(outcome, Message):
            replies.append((key, outcome))
        else:
            failures.append((key, outcome))
    return replies, failures


class HandlerError(Exception):
    """Raised by a handler to answer with an ``error`` reply of ``code`` (e.g. ``unknown-blob``);
    ``retry_after_s`` > 0 says the request may succeed when sent again after that long: the handler must then
    have changed nothing, since that reply is not cached and the same request sent again runs again."""

    def __init__(self, code: str, message: str, *, retry_after_s: float = 0.0) -> None:
        self.code = code
        self.retry_after_s = retry_after_s
        super().__init__(message)


class Client:
    """A DEALER connected to one server endpoint. Its sends never block (see the module docstring):
    :attr:`retries` counts resends after a timeout, :attr:`unsent` the sends refused because the queue to the
    endpoint was full (its high-water mark reached: the peer gone, partitioned or not reading)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        codec: WireCodec,
        *,
        policy: RetryPolicy = RetryPolicy(),
        options: SocketOptions = DEFAULT_OPTIONS,
        on_stray: Callable[[Message], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.codec = codec
        self.policy = policy
        self.on_stray = on_stray
        self.retries = 0
        self.unsent = 0
        self._full = False  # the last send was refused: logged once until one goes out again
        # While set, called at least every INTERRUPT_CHECK_MS while recv (so request) waits; what it raises ends
        # the wait (a reply that came is returned first): how a starting node gives way to a stop (NodeRuntime.start).
        self.interrupt: Callable[[], None] | None = None
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, options=options)
        self._polled = [(self.sock, zmq.POLLIN)]  # kept: Socket.poll builds a new Poller on every call

    def encode(self, body: Body, msg_id: str = "") -> tuple[str, list]:
        """A request's id (``msg_id``, default a new one) and frames (sent as they are by every retry): one frame
        when ``body`` has no arrays, which every receiver accepts and which costs ZeroMQ and pyzmq a third of
        three frames."""
        msg_id = msg_id or self.codec.new_id()
        return msg_id, self.codec.encode(body, msg_id=msg_id, one_frame=True)

    def send(self, body: Body) -> str:
        """Send without waiting; the reply (if any) reaches :meth:`recv` or ``on_stray``. Returns its id. A send
        the full queue refuses (:meth:`try_send`) is counted and logged, and no reply comes: the caller's own
        deadline ends its wait."""
        msg_id, frames = self.encode(body)
        self.try_send(frames, body.kind)
        return msg_id

    def try_send(self, frames: list, kind: str) -> bool:
        """Send one request's frames without blocking; False (counted in :attr:`unsent`, logged when the queue
        becomes full) when the queue to the endpoint is full. ZeroMQ takes a multipart message whole or not at
        all: the high-water mark is checked before its first frame only."""
        try:
            send_frames(self.sock, frames, zmq.NOBLOCK)
        except zmq.Again:
            self.unsent += 1
            if not self._full:
                self._full = True
                log.warning("request.queue_full", kind=kind, endpoint=self.endpoint,
                            detail="the send queue to this endpoint is full (the peer gone or not reading): "
                            "requests are not sent and end at their deadlines until it drains")
            return False
        if self._full:
            self._full = False
            log.info("request.queue_moving", endpoint=self.endpoint, unsent=self.unsent)
        return True

    def request(
        self, body: Body, *, policy: RetryPolicy | None = None, backend: ArrayBackend = "numpy"
    ) -> Message:
        """Send ``body`` and wait for its reply, retrying per ``policy``. Arrays in the reply are owned by
        the caller (they view the received frames). Raises :class:`RemoteError` or :class:`RequestTimeout`, at
        the policy's deadline at the latest: an attempt the full send queue refuses waits out its timeout all the
        same (a reply to an earlier attempt may still come), and the timeout then says the queue was full.

        The single-request path of :func:`gather`, kept lean because control round trips are latency-bound.
        """
        policy = policy or self.policy
        msg_id, frames = self.encode(body)
        unsent = 0
        for attempt, timeout in enumerate(policy.timeouts()):
            if attempt:
                self.retries += 1
                log.info("request.retry", kind=body.kind, endpoint=self.endpoint, attempt=attempt + 1)
            if not self.try_send(frames, body.kind):
                unsent += 1
            deadline = time.monotonic() + timeout
            wait_ms = int(timeout * 1000) + 1
            while (reply := self.recv(wait_ms, backend=backend)) is not None:
                if reply.header.re != msg_id:
                    self.stray(reply)
                    wait_ms = _ms_until(deadline)
                elif isinstance(reply.body, Error):
                    raise RemoteError(reply.body, self.endpoint)
                else:
                    return reply
        raise RequestTimeout(f"no reply from {self.endpoint} to {body.kind} after {policy.attempts} attempts"
                             f"{unsent_note(self.endpoint, unsent)}")

    def recv(self, timeout_ms: int, *, backend: ArrayBackend = "numpy", verify: bool = True) -> Message | None:
        """The next valid reply within ``timeout_ms`` (0: only one already waiting); invalid replies are logged
        and skipped.

        A poll, then a receive of what it found (a receive that finds nothing raises ``zmq.Again``, ~8 us); not
        a blocking receive under ``RCVTIMEO``, though it saves the poll's call: pyzmq resumes a receive that a
        signal interrupted with the whole timeout again, so signals arriving more often than it would hold a
        request past its deadline for as long as they come. A poll that signals interrupt returns sooner instead
        (pyzmq takes the time passed off what is left after every interruption, so it runs out early): this polls
        again until its own deadline. With :attr:`interrupt` set, each poll lasts at most
        :data:`INTERRUPT_CHECK_MS` and the interrupt is called after every one that brought nothing. The round trip's
        critical path: one call, no helpers."""
        deadline = time.monotonic() + timeout_ms / 1000
        polled = self._polled
        interrupt = self.interrupt
        while True:
            if zmq.zmq_poll(polled, timeout_ms if interrupt is None else min(timeout_ms, INTERRUPT_CHECK_MS)):
                try:
                    return self.codec.decode(recv_frames(self.sock, zmq.NOBLOCK), backend=backend, verify=verify)
                except ProtocolError as exc:
                    log.warning("reply.rejected", endpoint=self.endpoint, code=exc.code, error=str(exc))
            if interrupt is not None:
                interrupt()
            if time.monotonic() >= deadline:  # only this clock ends the wait: an empty poll may come early
                return None
            timeout_ms = _ms_until(deadline)

    def stray(self, reply: Message) -> None:
        """Hand a reply that answers none of the caller's requests to ``on_stray`` (logged when unset)."""
        if self.on_stray is not None:
            self.on_stray(reply)
        elif isinstance(reply.body, Error):
            log.warning("reply.stray_error", endpoint=self.endpoint, code=reply.body.code, error=reply.body.message)

    def close(self) -> None:
        self.sock.close()


def unsent_note(endpoint: str, unsent: int) -> str:
    """What a :class:`RequestTimeout` adds when ``unsent`` of the request's attempts were never sent."""
    return f" ({unsent} not sent: the send queue to {endpoint} was full)" if unsent else ""


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000) + 1)


@dataclass
class _Call:
    index: int
    client: Client
    kind: str
    msg_id: str
    frames: list
    attempts: Attempts
    due: float = 0.0
    unsent: int = 0  # attempts the full send queue refused


class Pipeline:
    """Requests issued as they become ready, at most ``window`` in flight per client, each retried per
    ``policy`` (or its client's) until its deadline: ``deadline_s`` after it is first sent (default: the sum
    of the policy's timeouts). :func:`gather` is one pipeline given every request at once; a producer that
    makes its requests as it goes (a push hashing its pieces) passes each to :meth:`add` when ready and keeps the
    window full meanwhile, instead of waiting for a batch to drain.

    ``outcomes[index]`` (``index`` from :meth:`add`) is set once a request ends: its reply, or the
    :class:`RemoteError` / :class:`RequestTimeout` it ended with. ``verify=False`` skips frame checksums for
    callers that verify the bytes themselves. ``on_reply(index, reply)``, when given, takes each successful
    reply as it arrives; it is not kept (its outcome is its header with an ``Ok`` body), so a caller
    streaming large replies holds about ``window`` of them at a time. Late duplicate replies go to each
    client's ``on_stray``.

    An object, not closures that call each other: those form a reference cycle through their cells that would
    keep every reply (its received frames) alive until the garbage collector happens to run, so large replies
    kept landing in fresh, page-faulting memory.
    """

    def __init__(self, *, window: int = 8, policy: RetryPolicy | None = None, deadline_s: float | None = None,
                 backend: ArrayBackend = "numpy", verify: bool = True,
                 on_reply: Callable[[int, Message], None] | None = None) -> None:
        self.window = window
        self.policy = policy
        self.deadline_s = deadline_s
        self.backend: ArrayBackend = backend
        self.verify = verify
        self.on_reply = on_reply
        self.outcomes: list[Message | RemoteError | RequestTimeout | None] = []
        self._bodies: dict[int, Body] = {}  # queued, not yet sent
        self.queued: dict[Client, deque[int]] = {}
        self.in_flight: dict[str, _Call] = {}
        self.busy: Counter[Client] = Counter()
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket, Client] = {}

    def add(self, client: Client, body: Body) -> int:
        """Queue ``body`` for ``client`` and send it at once when its window has room; its index in
        :attr:`outcomes`. Does not wait for anything."""
        index = len(self.outcomes)
        self.outcomes.append(None)
        self._bodies[index] = body
        if client not in self.queued:
            self.queued[client] = deque()
            self._poller.register(client.sock, zmq.POLLIN)
            self._by_socket[client.sock] = client
        self.queued[client].append(index)
        self.launch(client)
        return index

    def wait(self, until: Callable[[], bool] | None = None) -> None:
        """Receive replies (and resend on timeouts) until ``until()`` holds, or until every request added has
        ended (the default)."""
        in_flight = self.in_flight
        while in_flight and not (until is not None and until()):
            now = time.monotonic()
            for call in [c for c in in_flight.values() if c.due <= now]:
                self.attempt(call)
            if not in_flight:
                break
            for sock, _ in self._poller.poll(_ms_until(min(c.due for c in in_flight.values()))):
                client = self._by_socket[sock]
                while (reply := client.recv(0, backend=self.backend, verify=self.verify)) is not None:
                    call = in_flight.get(reply.header.re)
                    if call is None or call.client is not client:
                        client.stray(reply)
                    elif isinstance(reply.body, Error):
                        self.finish(call, RemoteError(reply.body, client.endpoint))
                    elif self.on_reply is not None:
                        self.on_reply(call.index, reply)
                        self.finish(call, Message(reply.kind, reply.header, Ok()))
                    else:
                        self.finish(call, reply)

    def waiting(self, client: Client) -> int:
        """Requests for ``client`` added but not sent yet (its window is full)."""
        return len(self.queued.get(client, ()))

    def attempt(self, call: _Call) -> None:
        step = call.attempts.next(time.monotonic())
        if step is None:
            self.finish(call, RequestTimeout(
                f"no reply from {call.client.endpoint} to {call.kind} after {call.attempts.sent} attempts"
                f"{unsent_note(call.client.endpoint, call.unsent)}"))
            return
        send, call.due = step
        if send:
            if call.attempts.sent > 1:
                call.client.retries += 1
                log.info("request.retry", kind=call.kind, endpoint=call.client.endpoint, attempt=call.attempts.sent)
            if not call.client.try_send(call.frames, call.kind):
                call.unsent += 1  # an attempt without a reply: resent when the next is due, or ends at the deadline

    def launch(self, client: Client) -> None:
        while self.queued[client] and self.busy[client] < self.window:
            index = self.queued[client].popleft()
            body = self._bodies.pop(index)
            msg_id, frames = client.encode(body)
            call = _Call(index, client, body.kind, msg_id, frames,
                         Attempts(self.policy or client.policy, self.deadline_s, time.monotonic()))
            self.in_flight[msg_id] = call
            self.busy[client] += 1
            self.attempt(call)

    def finish(self, call: _Call, outcome: Message | RemoteError | RequestTimeout) -> None:
        self.outcomes[call.index] = outcome
        del self.in_flight[call.msg_id]
        self.busy[call.client] -= 1
        self.launch(call.client)


def gather(
    calls: Sequence[tuple[Client, Body]],
    *,
    window: int = 8,
    policy: RetryPolicy | None = None,
    deadline_s: float | None = None,
    backend: ArrayBackend = "numpy",
    verify: bool = True,
    on_reply: Callable[[int, Message], None] | None = None,
) -> list[Message | RemoteError | RequestTimeout]:
    """Run requests concurrently: one :class:`Pipeline` (same options) given every call at once. Returns one
    outcome per call, in order (sort them with :func:`split_outcomes`)."""
    run = Pipeline(window=window, policy=policy, deadline_s=deadline_s, backend=backend, verify=verify,
                   on_reply=on_reply)
    for client, body in calls:
        run.add(client, body)
    run.wait()
    results, run.outcomes = run.outcomes, []
    return results  # type: ignore[return-value]


Handler = Callable[[Message], Body | None]
"""Returns the reply body, or None to answer later with :meth:`Server.answer` (see :attr:`Server.pending`)."""


@dataclass(frozen=True)
class Pending:
    """A request to answer later: who asked, and which message id the reply answers. ``peer``: the node id
    CURVE authenticated the asker as ("" on a plain server). ``one_frame``: the form it was asked in, which
    the reply takes (a client that sends only the multi-frame form, as an older peer's, gets it back)."""

    identity: bytes
    reply_to: str
    peer: str = ""
    one_frame: bool = False


@dataclass
class _Route:
    handler: Handler
    cached: bool
    verify: bool


# Ids of cached replies remembered exactly (older ones only per sender incarnation, as a floor): four reply
# caches. An env server of `refbus up` caches about 80 replies a second (claims, deletes), so that is over three
# minutes of ids, past every request's deadline (by default 14 s; a run's 44 s), and full within about 400
# steps: memory levels off (about 0.3 KB an id) instead of growing through a long run.
SEEN_SIZE = 16384


class Server:
    """Dispatches requests arriving on a bound ROUTER to handlers by kind, and replies.

    A handler gets the decoded :class:`Message` and returns the reply body. It owns the request's arrays
    after the call (they view the received frames). Raise :class:`HandlerError` for an expected failure.
    Bodies of kinds without a handler are never decoded.

    Replies of cached routes are kept per ``(source, id)``, at most ``cache_size`` of them and
    ``cache_bytes`` in all, evicted oldest first; a reply larger than ``cache_bytes`` is sent, not kept (a
    retry of its request is then a replay, below).

    ``authenticated`` (a CURVE socket): a request whose ``src`` is not the node id its connection was admitted
    as is answered ``wrong-src`` (``unauthenticated`` when the connection has none) and never handled.
    Replays: a request of a cached route whose id is still cached is a retry and gets the cached reply. One
    whose reply was cached and has since been evicted is a replay, refused with ``replay`` (its handler does not
    run twice): the ids of the last ``seen_size`` cached replies are remembered, and below them, per sender
    incarnation (the part of the id before ``-``), the highest evicted counter (ids are ``<incarnation>-<hex
    counter>``, rising). Pure reads (``cached=False``), deferred answers and error replies with a
    ``retry_after_s`` (the request may succeed when sent again: its handler changed nothing) run again on a
    retry, as before.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        codec: WireCodec,
        *,
        cache_size: int = 4096,
        cache_bytes: int = 64 << 20,
        seen_size: int = SEEN_SIZE,
        backend: ArrayBackend = "numpy",
        authenticated: bool = False,
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.backend = backend
        self.authenticated = authenticated
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.routes: dict[str, _Route] = {}
        self.handled: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.duplicates = 0
        self.undeliverable = 0
        self._replies: OrderedDict[tuple[str, str], tuple[list, int]] = OrderedDict()
        self._cached_bytes = 0
        self.seen_size = seen_size
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # ids whose reply was cached
        self._floors: OrderedDict[tuple[str, str], int] = OrderedDict()  # (src, incarnation) -> evicted counter
        self._current: tuple[bytes, str, str, bool] = (b"", "", "", False)  # built into a Pending when asked for
        self._last: zmq.Frame | None = None  # the last frame of the request being handled: its connection's metadata

    def on(self, kind: str, handler: Handler, *, cached: bool = True, verify: bool = True) -> None:
        """Route ``kind`` to ``handler``. ``cached=False`` for pure reads that are safe to run twice.
        ``verify=False`` skips the frame checksums on decode, for handlers whose bytes are verified end to end
        later (always checked on a signed bus)."""
        self.routes[kind] = _Route(handler, cached, verify)

    @property
    def pending(self) -> Pending:
        """The request being handled; a handler that returns None keeps this to :meth:`answer` later."""
        return Pending(*self._current)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the replies held for retries."""
        return self._cached_bytes

    def peer_address(self) -> str:
        """Where the request being handled came from, as ZeroMQ names its connection (``Peer-Address``): an IP
        address over TCP, ``localhost:...`` over ipc; "" where it names none (inproc) and outside a handler. Read
        only when a handler asks: most never do."""
        if self._last is None:
            return ""
        try:
            return self._last.get("Peer-Address")
        except zmq.ZMQError:
            return ""

    def answer(self, pending: Pending, body: Body) -> None:
        """Reply to a deferred request (not cached: a retry re-runs its handler, which defers again)."""
        self._send(pending.identity, body, pending.reply_to, pending.one_frame)

    def handle_one(self, flags: int = 0) -> None:
        """Receive one request and answer it. Never raises for anything a peer sent: what the decoder or a
        handler does not expect is answered ``internal`` and logged."""
        try:
            identity, envelope, last = recv_routed(self.sock, flags)
        except TooManyFrames as exc:  # read off whole, its frames past the cap never kept
            self._refuse(exc.identity, exc, exc.head, False)
            return
        peer = peer_id(last) if self.authenticated else ""
        self._last = last
        try:
            self._dispatch(identity, envelope, peer)
        except Exception as exc:
            self.rejected["internal"] += 1
            log.exception("request.failed")
            self._send(identity, Error("internal", f"{type(exc).__name__}: {exc}"), self.codec.peek_id(envelope),
                       len(envelope) < MIN_FRAMES)
        finally:
            self._last = None

    def _dispatch(self, identity: bytes, envelope: list, peer: str) -> None:
        one_frame = len(envelope) < MIN_FRAMES  # the form it was asked in: one frame (and a MAC) or three and more
        try:
            checked = self.codec.decode_header(envelope)
            kind, header = checked.kind, checked.header
            if self.authenticated and header.src != peer:
                code = "wrong-src" if peer else "unauthenticated"
                self.rejected[code] += 1
                log.warning("request.refused", code=code, src=header.src, peer=peer, kind=kind)
                self._send(identity, Error(code, f"this connection is authenticated as {peer or 'nobody'!r}, "
                                                 f"not as {header.src!r}", kind), header.id, one_frame)
                return
            route = self.routes.get(kind)
            if route is None:
                self.rejected["unexpected-kind"] += 1
                self._send(identity, Error("unexpected-kind", f"this node does not serve {kind!r} requests", kind),
                           header.id, one_frame)
                return
            request = self.codec.decode(envelope, backend=self.backend, verify=route.verify, checked=checked)
        except ProtocolError as exc:
            self._refuse(identity, exc, envelope, one_frame)
            return
        key = (header.src, header.id)
        cached = self._replies.get(key) if route.cached else None  # only cached routes' replies are kept
        if cached is not None:
            self.duplicates += 1
            self._send_frames(identity, cached[0])
            return
        if route.cached and self._replayed(key):
            self.rejected["replay"] += 1
            log.warning("request.rejected", code="replay", kind=kind, src=header.src, id=header.id)
            self._send(identity, Error("replay", f"request {header.id!r} from {header.src!r} was already "
                                       "answered; a retry must come while its reply is cached", kind), header.id,
                       one_frame)
            return
        self._current = (identity, header.id, peer, one_frame)
        reply = self._run(route.handler, request)
        if reply is None:
            return
        try:
            frames_out = self.codec.encode(reply, reply_to=header.id, one_frame=one_frame)
        except (ProtocolError, NotImplementedError, TypeError, ValueError) as exc:
            self.rejected["internal"] += 1
            log.exception("reply.unencodable", kind=request.kind, reply_kind=reply.kind)
            frames_out = self.codec.encode(Error("internal", f"reply could not be encoded: {exc}", request.kind),
                                           reply_to=header.id, one_frame=one_frame)
        if route.cached and not (isinstance(reply, Error) and reply.retry_after_s > 0):
            self._cache(key, frames_out)
        self._send_frames(identity, frames_out)

    def _cache(self, key: tuple[str, str], frames: list) -> None:
        # Seen whether or not the reply is kept: a retry of a request whose reply was too large to keep is
        # refused as a replay, never run twice.
        self._seen[key] = None
        while len(self._seen) > self.seen_size:
            self._raise_floor(self._seen.popitem(last=False)[0])
        nbytes = sum(memoryview(frame).nbytes for frame in frames)
        if nbytes > self.cache_bytes:
            return
        self._replies[key] = (frames, nbytes)
        self._cached_bytes += nbytes
        while len(self._replies) > self.cache_size or self._cached_bytes > self.cache_bytes:
            self._cached_bytes -= self._replies.popitem(last=False)[1][1]

    def _replayed(self, key: tuple[str, str]) -> bool:
        """Whether the request ``key`` (not in the reply cache) was answered already."""
        if key in self._seen:
            return True
        split = _split_id(key[1])
        if split is None:
            return False
        floor = self._floors.get((key[0], split[0]))
        return floor is not None and split[1] <= floor

    def _raise_floor(self, key: tuple[str, str]) -> None:
        split = _split_id(key[1])
        if split is None:
            return
        incarnation_key = (key[0], split[0])
        self._floors[incarnation_key] = max(split[1], self._floors.get(incarnation_key, 0))
        self._floors.move_to_end(incarnation_key)
        while len(self._floors) > self.seen_size:
            self._floors.popitem(last=False)

    def _refuse(self, identity: bytes, error: ProtocolError, envelope: list, one_frame: bool) -> None:
        """Answer a request that failed the envelope's checks with its error (counted, logged), to the id its
        ``envelope`` (or the first frames of it) names, when one can be read."""
        self.rejected[error.code] += 1
        log.warning("request.rejected", code=error.code, error=str(error))
        self._send(identity, Error(error.code, str(error), error.kind or ""), self.codec.peek_id(envelope), one_frame)

    def _run(self, handler: Handler, request: Message) -> Body | None:
        try:
            reply = handler(request)
        except HandlerError as exc:
            self.rejected[exc.code] += 1
            return Error(exc.code, str(exc), request.kind, retry_after_s=exc.retry_after_s)
        except ProtocolError as exc:
            self.rejected[exc.code] += 1
            return Error(exc.code, str(exc), request.kind)
        except Exception as exc:
            self.rejected["internal"] += 1
            log.exception("request.handler_failed", kind=request.kind, src=request.header.src)
            return Error("internal", f"{type(exc).__name__}: {exc}", request.kind)
        self.handled[request.kind] += 1
        return reply

    def _send(self, identity: bytes, body: Body, reply_to: str, one_frame: bool) -> None:
        self._send_frames(identity, self.codec.encode(body, reply_to=reply_to, one_frame=one_frame))

    def _send_frames(self, identity: bytes, frames: list) -> None:
        try:
            send_frames(self.sock, [identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Peer gone (ROUTER_MANDATORY) or not reading: it will retry and be answered from the cache.
            self.undeliverable += 1
            log.warning("reply.undeliverable", error=str(exc))


def _split_id(msg_id: str) -> tuple[str, int] | None:
    """``(incarnation, counter)`` of an id ``<incarnation>-<hex counter>``; None for any other form (a
    third-party client's ids need only be unique)."""
    prefix, dash, counter = msg_id.rpartition("-")
    if not dash or not prefix or not 0 < len(counter) <= 16:
        return None
    try:
        return prefix, int(counter, 16)
    except ValueError:
        return None
