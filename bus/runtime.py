"""The node runtime: the one way every role runs.

A role builds on a :class:`NodeRuntime`: it binds request servers (:meth:`serve`), subscribes to events
(:meth:`subscribe`), publishes (:meth:`publish`), opens clients to peers (:meth:`client`) and adds timers
(:meth:`every`); then :meth:`run` does the rest:

1. start the Prometheus endpoint (127.0.0.1 and an ephemeral port unless configured; a wildcard bind is
   advertised as ``host``, like the ZeroMQ endpoints);
2. register with the broker (``hello`` → ``welcome``; a node id another live process holds is refused,
   :class:`NodeIdInUse`, while a predecessor dying gives it up within half the node timeout), connect the PUB
   socket to the broker and prove it live (``sync`` handshake: no event is lost to ZeroMQ's slow-joiner window),
   then make every subscription live the same way and replay what was asked for;
3. loop: one poller over every socket, timers, asynchronous requests (:attr:`calls`, each ending by its
   deadline), heartbeats (with the role's ``status``), re-registering if the broker forgot the node. The
   events a turn publishes go out before the loop waits again, each run of one kind as one message (the
   batch form, up to the welcome's ``event_batch`` events): a burst costs one ZeroMQ message, not one per
   event. A
   broker that died and came back under the same address answers the next heartbeat ``unknown-node``: the
   node says ``hello`` again (the registry is rebuilt from these re-joins). A re-join runs on the loop thread,
   every step of it (hello, refill, probes, the subscriptions' replays) within one ``FILL_SHARE`` of the node
   timeout, so a broker that answers heartbeats but not the re-join (crashing again, or swamped by every node
   re-joining at once) never holds requests, timers or a stop for longer: the re-join is tried again a
   heartbeat later. A PUB connection that drops is
   disconnected at once (its queue with it), so nothing this node publishes reaches a new broker before it
   has re-joined; at the re-join it hands the new ring the events it holds (``refill``: the dead broker's in
   flight and what it published meanwhile), then proves its PUB path with probes that carry its latest
   sequence number, so every subscriber fills the gap from the ring, even with no later event to reveal
   it. What a node no longer holds is counted lost where subscribers find it missing, never silently. While
   the broker is away, point-to-point requests between nodes go on; only registry lookups and replays fail
   (by their deadlines);
4. on SIGINT/SIGTERM or :meth:`stop`: run the role's shutdown hooks, flush the events published so far, say
   ``bye``, close every socket (linger 0), remove ipc socket files and the ready file; all of it within
   ``shutdown_timeout_s`` of the stop (:meth:`shutdown_left` is what a hook that waits on peers may take; a
   hook still running when the hooks' share is spent is cut off and logged; the sockets stay its thread's,
   which may still use them, so ``bye`` goes out on a socket of its own and the final events go unconfirmed).
   In a ``refbus node`` process the :class:`ExitWatchdog` then guarantees the exit itself.

Single-threaded by design: handlers run on the loop thread and must not block for long. User code that
may compute for long (a training step, a generation) runs on another thread, so the loop keeps answering
heartbeats and requests meanwhile: either the loop runs in its own thread (:meth:`start_background`) or
the role hands the work to an :class:`~refbus.bus.offload.Offload` thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import msgspec
import structlog
import zmq
from prometheus_client import REGISTRY, Histogram
from prometheus_client.registry import Collector
from zmq.utils.monitor import recv_monitor_message

from ..protocol.codec import ArrayBackend
from ..protocol.envelope import SPOKEN_MAJORS, Limits, Message, WireCodec
from ..protocol.envelope import incarnation as envelope_incarnation
from ..protocol.errors import ProtocolError
from ..protocol.messages import (
    MAX_KEY_CHARS,
    MAX_NODE_ENTRIES,
    Body,
    Bye,
    Error,
    Heartbeat,
    Hello,
    NodeInfo,
    NodeList,
    Nodes,
    Refill,
    Replay,
    Replayed,
    ReplayedEvent,
    Sync,
    Welcome,
)
from .calls import Calls
from .metrics import by_label, register_live, serve_metrics
from .peers import KINDS as PEER_KINDS
from .peers import NOT_FROM_BROKER, Peers, incarnation
from .pubsub import KEEP_EVENTS, Publisher, Subscriber, in_source_order
from .reqrep import (
    INTERRUPT_CHECK_MS,
    MIN_TIMEOUT_S,
    SEND_ONCE,
    Client,
    Outcome,
    RemoteError,
    RequestTimeout,
    RetryPolicy,
    Server,
)
from .security import Curve, ZapHandler, check_bind, load_curve
from .sockets import (
    EVENT_OPTIONS,
    RECONNECT_IVL_MAX_MS,
    FrameCounter,
    SocketOptions,
    advertised,
    bound_endpoint,
    make_socket,
    readable,
    remove_ipc_file,
)

log = structlog.get_logger(__name__)

SYNC_PROBE_INTERVAL_MS = 20
# Shares of ``shutdown_timeout_s``, counted from the stop: the shutdown hooks end by HOOKS_SHARE, the final
# event flush and bye by CLOSE_SHARE, and the process is gone by the whole (what is left is its exit).
HOOKS_SHARE = 0.7
CLOSE_SHARE = 0.95
BYE_TIMEOUT_S = 0.5
STUCK_FRAMES = 6  # of the main thread's stack, innermost, logged when the exit watchdog ends the process
BROKER_SILENT_BEATS = 2  # heartbeats in a row without an answer before the node logs that the broker is silent
# What a loop turn waits on the broker for runs on the loop thread: gap fills (inside a subscriber's take of the
# event that revealed the gap) and a re-join (hello, refill, probes, the subscriptions' resumption). All of it, in
# one turn, ends within this share of the node timeout the broker judges this node by, so a slow or dying broker
# never holds the loop until the node is declared down (its next heartbeat still goes out in time) nor keeps it
# from requests, timers and a stop meanwhile. A node that has not joined (no broker judges it) takes this share of
# its heartbeat interval. A fill cut off there counts the gap lost; a re-join cut off there is tried again a
# heartbeat later.
FILL_SHARE = 0.5


@dataclass(frozen=True)
class RuntimeSettings:
    """What every node needs, whatever its role."""

    bus: str = "tcp://127.0.0.1:7770"  # the broker's control endpoint
    node_id: str = ""  # default: <role>-<hostname>-<pid>
    host: str = field(default_factory=socket.gethostname)  # advertised in place of wildcard binds
    secret: bytes = b""
    heartbeat_interval_s: float = 1.0
    connect_timeout_s: float = 15.0
    shutdown_timeout_s: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: ephemeral, -1: no endpoint
    ready_file: str = ""
    limits: Limits = field(default_factory=Limits)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_frame_bytes: int = -1
    curve_dir: str = ""  # key directory of ``refbus keys generate``; empty: no CURVE
    curve_key: str = ""  # this node's secret key file (default: <curve_dir>/<node_id>.key_secret)
    insecure: bool = False  # bind non-loopback addresses with neither signing nor CURVE
    held_events: int = KEEP_EVENTS  # own recent events held to refill a broker's ring (see Publisher)


class BusUnavailable(RuntimeError):
    """The broker could not be reached, refused this node's ``hello`` (its registry full) or did not complete the
    handshake in time: what may clear by itself (``refbus node`` says why in one line, exit status 1)."""


ID_IN_USE = "id-in-use"
"""The broker's refusal of a ``hello`` under a node id another process holds: with ``retry_after_s`` while it cannot
tell that holder's heartbeats stopped (a predecessor dying) from a live holder, without once it heard the holder
beat after the ask."""


class NodeIdInUse(RuntimeError):
    """Another live process holds this node's id (the broker heard it heartbeat after this process asked): two
    processes started under one node id, a configuration that cannot work. The message names the holder."""


class NodeStopped(Exception):
    """A stop (SIGINT/SIGTERM, :meth:`NodeRuntime.stop` or :meth:`~NodeRuntime.begin_shutdown`) came while the node
    was starting: :meth:`NodeRuntime.start` gave way to it at its next wait on the broker (within
    :data:`~.reqrep.INTERRUPT_CHECK_MS`), the node not or not wholly joined. ``refbus node`` exits as a node stopped
    once running does."""


@contextlib.contextmanager
def on_signals(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM call ``callback`` (then the previous handlers come back)."""
    previous = {sig: signal.signal(sig, lambda *_: callback()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


StatusOf = Callable[[BaseException], int | None]
"""The exit status a process's command gives a failure that ends it; None for one it does not map (a crash)."""


class ExitWatchdog:
    """Process-wide exit bound for ``refbus node`` processes (never installed in an embedding process).

    The shutdown clock starts when SIGINT/SIGTERM arrives (seen through the interpreter's wakeup fd, so even
    while the main thread is stuck in native code: a collective, a long kernel) or when the node begins its
    shutdown otherwise (:meth:`NodeRuntime.begin_shutdown`). The watchdog then stops the node's loop at the
    hooks' share of ``shutdown_timeout_s`` if it still runs (a training loop that drives the node and cannot
    finish its step), and ends the process when the whole timeout is spent and it is still alive (``os._exit``
    with :func:`forced_status`, logged ``node.exit_forced`` with why and where the main thread was). The
    interpreter's own exit is never waited for: :meth:`run` ends the process as soon as the node's main function
    is done.
    """

    _installed: ExitWatchdog | None = None

    def __init__(self, status_of: StatusOf) -> None:
        self._status_of = status_of
        self._begun = threading.Event()
        self._node: NodeRuntime | None = None
        self._signals, signalled = socket.socketpair()
        signalled.setblocking(False)
        self._signalled = signalled  # kept open for the process's life: the interpreter writes to it
        signal.set_wakeup_fd(signalled.fileno(), warn_on_full_buffer=False)

    @classmethod
    def install(cls, status_of: StatusOf) -> None:
        """Arm the watchdog for this process (idempotent; main thread, before any node is made). ``status_of`` is the
        exit status the process's command gives a failure that ends it (None for one it does not map: a crash), so
        a forced exit after that failure carries it (:func:`forced_status`)."""
        if cls._installed is None:
            cls._installed = watchdog = cls(status_of)
            threading.Thread(target=watchdog._watch, name="refbus-exit-watchdog", daemon=True).start()

    @classmethod
    def attach(cls, node: NodeRuntime) -> None:
        """``node`` is the one this process runs (the first made wins)."""
        watchdog = cls._installed
        if watchdog is not None and watchdog._node is None:
            watchdog._node = node

    @classmethod
    def notify(cls, node: NodeRuntime) -> None:
        """``node`` began its shutdown (safe from signal handlers: the only lock taken is the watchdog's own). Only
        the attached node's starts the clock: another runtime the role makes and closes (a probe of the registry)
        must not end the node the process runs."""
        watchdog = cls._installed
        if watchdog is not None and node is watchdog._node:
            watchdog._begun.set()

    def _watch(self) -> None:
        while not self._begun.is_set():
            ready, _, _ = select.select([self._signals], [], [], 0.1)
            stopping = {signal.SIGINT, signal.SIGTERM}
            if ready and stopping & set(self._signals.recv(64)) and self._node is not None:
                self._node.begin_shutdown()
        node = self._node
        assert node is not None
        timeout = node.settings.shutdown_timeout_s
        time.sleep(max(0.0, node.shutdown_started + timeout * HOOKS_SHARE - time.monotonic()))
        if not node.stopping:
            with contextlib.suppress(Exception):  # as forced_status's report: a log line must not cost the stop
                log.warning("node.stopped_by_deadline", shutdown_timeout_s=timeout)
            node.stop()
        time.sleep(max(0.0, node.shutdown_started + timeout - time.monotonic()))
        _exit_now(forced_status(node, self._status_of))

    @staticmethod
    def run(main: Callable[[], int]) -> NoReturn:
        """Run a node process's ``main`` and end the process with its status as soon as it returns (status 1,
        after the traceback the interpreter would print, when it raises). Not through the interpreter's exit:
        its finalization (modules, torch's among them) takes seconds on a loaded machine, and once it has begun
        the watchdog's thread can no longer run, so the process would outlive ``shutdown_timeout_s``. Nothing
        is left for that exit to do: refbus starts only daemon threads and the node has closed."""
        try:
            code = main()
        except SystemExit as exc:  # what the interpreter would make of it
            code = exit_status(exc)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter reports it (a library may have set its own hook)
            code = 1
        _exit_now(code)


def exit_status(exc: BaseException) -> int:
    """The status the interpreter ends a process with when ``exc`` escapes its main thread: a ``SystemExit``'s
    code (0 for none, 1 for a message), 1 for any other exception."""
    if not isinstance(exc, SystemExit):
        return 1
    return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1


def forced_status(node: NodeRuntime, status_of: StatusOf) -> int:
    """The status :class:`ExitWatchdog` ends the process with once ``node``'s ``shutdown_timeout_s`` is spent and
    the process still runs, logged ``node.exit_forced`` with the reason, the failure's traceback (which no one
    would print otherwise) and where the main thread was.

    A supervisor reads the status as what the role came to (``refbus up`` restarts a failed node, never a trainer
    rank that exited 0: it finished its steps), so a failure must not be hidden behind the forced exit. When its
    loop failed (:attr:`NodeRuntime.loop_failed`: a loop in a background thread dies unseen while the role's main
    thread waits on other work) or the main thread is raising or handling an exception (the role failed, then hung
    in a ``finally`` or ``except`` clause: a thread that never joins, a process group that cannot be destroyed),
    the status the process's command would have exited with had it returned: ``status_of(failure)`` (a final one,
    the config refused, stays final: a restart would fail the same way), else :func:`exit_status` (1; a
    ``SystemExit``'s own, as :meth:`ExitWatchdog.run` would have exited). When the node did not close (its shutdown
    overran): that status unless it is 0, else 1. A node that closed cleanly, on a stop or once its role was done,
    and whose process then hung in teardown exits 0: its work is done and its bye said, a restart could only redo it
    (a trainer world would train again from its last checkpoint), and cutting such a teardown short is the
    watchdog's purpose, not a failure; the warning says where it hung. The report never keeps the process from its
    exit: a stderr whose reader is gone (a pipe's) or a full disk fails it, unseen."""
    failure = node.loop_failed or _in_flight(threading.main_thread())
    failed = 0  # the status the failure calls for: what the command would have exited with
    if failure is not None:
        mapped = status_of(failure)
        failed = exit_status(failure) if mapped is None else mapped
    who = "the node's loop" if node.loop_failed else "the role"
    raised = f"{who} raised {type(failure).__name__}"
    if not node.closed:
        status, reason = failed or 1, "the node did not close within node.shutdown_timeout_s"
        if failure is not None:
            reason += f" after {raised}"
    elif failure is not None:
        status, reason = failed, f"{raised}, then its process hung"
    else:
        status, reason = 0, "the node closed cleanly; its process then hung in teardown"
    with contextlib.suppress(Exception):  # a failed report would end the watchdog's thread, never the process
        _report_forced(node, status, reason, failure)
    return status


def _report_forced(node: NodeRuntime, status: int, reason: str, failure: BaseException | None) -> None:
    """Log ``node.exit_forced`` (:func:`forced_status`): ``status``, ``reason``, where the main thread is and
    ``failure``'s traceback."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    where = "".join(traceback.format_stack(frame, limit=STUCK_FRAMES)) if frame is not None else "(exited)"
    report = log.warning if status == 0 else log.error
    report("node.exit_forced", status=status, reason=reason, shutdown_timeout_s=node.settings.shutdown_timeout_s,
           main_thread_at=where, exc_info=failure)


def _in_flight(thread: threading.Thread) -> BaseException | None:
    """The exception ``thread`` is raising or handling now (the one whose ``finally`` or ``except`` clause it is
    in), None when none."""
    current = sys._current_exceptions().get(thread.ident or 0)
    if isinstance(current, tuple):  # Python 3.11: an exc_info triple; later versions give the exception itself
        current = current[1]
    return current if isinstance(current, BaseException) else None


def prove_published(control: Client, publisher: Publisher, token: str, timeout_s: float) -> None:
    """The ``sync`` handshake of a publisher: ask the broker (on ``control``) to answer once it has seen
    ``token`` come through ``publisher``, probing every ``SYNC_PROBE_INTERVAL_MS`` until it has. With the
    token of a node's ``hello`` this is what makes the broker list the node live and announce its ``node-up``.
    Raises :class:`BusUnavailable` when the broker refuses or does not see it within ``timeout_s``."""
    msg_id = control.send(Sync(token=token, path="pub"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        publisher.publish_raw(Sync(token=token))
        reply = control.recv(SYNC_PROBE_INTERVAL_MS)
        if reply is None:
            continue
        if reply.header.re == msg_id:
            if isinstance(reply.body, Error):
                raise BusUnavailable(f"broker refused the event handshake: {reply.body.message}")
            return
        control.stray(reply)
    raise BusUnavailable(f"the broker did not see this node's events within {timeout_s:.1f}s")


def policy_by(end: float, what: str) -> RetryPolicy:
    """A retry policy whose attempts all end by ``end`` (monotonic): a first wait of a third of what is left, then
    one resend that waits the rest. Raises :class:`RequestTimeout` (``what`` not complete in time) when too
    little is left to wait for a reply."""
    left = end - time.monotonic()
    if left < 3 * MIN_TIMEOUT_S:
        raise RequestTimeout(f"{what} not complete within its deadline")
    return RetryPolicy(timeout_s=left / 3, attempts=2, backoff=2.0, max_timeout_s=left)


def _exit_now(code: int) -> NoReturn:
    """End the process with ``code`` now, its output flushed first."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _merged(counters: Iterable[Counter[str]]) -> dict[tuple[str, ...], float]:
    """The sum of ``counters`` as one-label readings, each read from a copy (see :func:`.metrics.by_label`)."""
    total: Counter[str] = Counter()
    for counter in counters:
        total.update(dict(counter))
    return by_label(total)


@dataclass(order=True)
class _Timer:
    due: float
    interval: float | None = field(compare=False)  # None: once
    callback: Callable[[], None] = field(compare=False)


class NodeRuntime:
    """Sockets, loop, registration, heartbeats, metrics and shutdown for one node process."""

    def __init__(self, role: str, settings: RuntimeSettings, *, register: bool = True) -> None:
        self.role = role
        self.settings = settings
        self.register = register
        self.curve: Curve | None = None
        if settings.curve_dir:
            # A registered node must be what its key is granted; a tool that only asks (no registry entry)
            # may use any granted key, and is its node id.
            self.curve = load_curve(settings.curve_dir, settings.curve_key, settings.node_id,
                                    role if register else "")
        default_id = self.curve.grant.node_id if self.curve else f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.node_id = settings.node_id or default_id
        self.ctx = zmq.Context()
        # Before any socket: a CURVE handshake that found no ZAP handler would admit anyone.
        self.zap = ZapHandler(self.ctx, self.curve.allowed) if self.curve is not None else None
        self.codec = WireCodec(self.node_id, secret=settings.secret, limits=settings.limits)
        self.options = SocketOptions(max_frame_bytes=settings.max_frame_bytes, curve=self.curve)
        self.event_options = dataclasses.replace(EVENT_OPTIONS, curve=self.curve)
        self.endpoints: dict[str, str] = {}
        self.labels: dict[str, str] = {}
        # The role's numbers for its heartbeats: at most MAX_NODE_ENTRIES, named in at most MAX_KEY_CHARS
        # characters (what is over is left out: see _beat_status).
        self.status: Callable[[], dict[str, float]] = dict
        self._status_cut = False  # _beat_status had to leave numbers out (logged once)
        self._replaced = False  # the last heartbeat was refused: another process registered this node id since
        self.started = time.time()
        self.metrics_url = ""
        self.welcome: Welcome | None = None
        self.publisher: Publisher | None = None
        self.control: Client | None = None
        self.shutdown_hooks: list[Callable[[], None]] = []
        self._poller = zmq.Poller()
        self._callbacks: dict[zmq.Socket, Callable[[], None]] = {}
        self._owned: list[zmq.Socket] = []
        self._bound_ipc: list[str] = []
        self._clients: list[Client] = []
        self._clients_lock = threading.Lock()  # a training loop's thread makes and releases clients too
        self._released: Counter[str] = Counter()  # retries and unsent of released clients: the metrics are counters
        self._servers: list[Server] = []
        self._collectors: list[Collector] = []
        self._subscriptions: list[tuple[Subscriber, Callable[[Message], None], int | None]] = []
        self._timers: list[_Timer] = []
        self._stopping = False
        self._shutdown_started: float | None = None
        self.closed = False  # close() has finished
        self.loop_failed: BaseException | None = None  # what ended the loop when it raised (see forced_status)
        self._rejoin = False
        self._resume_pending = False  # the broker restarted and live subscriptions have not yet resumed
        self._refill_pending = False  # the broker restarted or the PUB path broke: held events not yet handed over
        # The broker work of one loop turn (gap fills, a re-join) shares one fill_deadline_s() (see _turn_deadline):
        # when it ends, what the turn's fills have not fetched is counted lost. None: none yet this turn.
        self._in_turns = False
        self._fill_end: float | None = None
        self.broker_incarnation = ""  # the incarnation of the broker process that welcomed this node last
        self.broker_restarts = 0  # re-joins that found a new broker process (it died and came back)
        self._heartbeats_unanswered = 0
        self._calls: deque[Callable[[], None]] = deque()
        self._confirmed_seq = 0
        self._pub_endpoint = ""  # the broker's events_in the PUB socket is connected to ("" when none)
        self.publish_path_lost = False  # the PUB connection dropped: re-join (and refill) at the next answered beat
        self.refilled = 0  # held events handed to a broker's ring again
        self._thread: threading.Thread | None = None
        self._stop_metrics: Callable[[], None] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.calls = Calls(self.client, settings.retry, watch=self.watch, release=self.release_client)
        self._lookups: dict[str, list[Callable[[list[NodeInfo] | None], None]]] = {}  # role -> waiting callers
        """Asynchronous requests to peers: a role's requests that must not block the loop go here."""
        self._peers: Peers | None = None
        self._peer_events: Subscriber | None = None  # the subscription feeding _peers
        ExitWatchdog.attach(self)

    # --- building blocks for roles -------------------------------------------------------------------

    def check_bind(self, endpoint: str) -> None:
        """Raise :class:`~.security.SecurityError` if ``endpoint`` is an address other hosts reach and nothing
        protects it: what :meth:`bind` checks first, for a role to check all its addresses before binding any (so
        a config security refuses is told as such, whatever holds its other ports)."""
        check_bind(endpoint, signed=bool(self.settings.secret), curve=self.curve is not None,
                   insecure=self.settings.insecure)

    def bind(self, socket_type: int, name: str, endpoint: str, options: SocketOptions | None = None) -> zmq.Socket:
        """Bind a socket, advertise it under ``name`` and close it at shutdown. Raises
        :class:`~.security.SecurityError` for an address other hosts reach when nothing protects it."""
        self.check_bind(endpoint)
        sock = make_socket(self.ctx, socket_type, bind=endpoint, options=options or self.options)
        actual = bound_endpoint(sock)
        if actual.startswith("ipc://"):
            self._bound_ipc.append(actual)
        self.endpoints[name] = advertised(actual, self.settings.host)
        self._owned.append(sock)
        return sock

    def serve(self, name: str, endpoint: str, *, backend: ArrayBackend = "numpy") -> Server:
        """A request server on a bound ROUTER, advertised in the registry as ``name``. ``backend`` rebuilds the
        arrays in requests: numpy by default, whatever library a peer tagged them with, so no peer can make this
        process import torch; ``native`` or ``torch`` only for a role that wants tensors and runs torch anyway."""
        server = Server(self.bind(zmq.ROUTER, name, endpoint), self.codec, backend=backend,
                        authenticated=self.curve is not None)
        self._servers.append(server)
        self.watch(server.sock, lambda: self._drain(server.sock, server.handle_one))
        return server

    def client(self, endpoint: str, *, policy: RetryPolicy | None = None) -> Client:
        """A request client to a peer, closed at shutdown. It belongs to one thread: the loop thread unless it
        is watched nowhere and another thread (a training loop) uses it until the node stops."""
        client = Client(self.ctx, endpoint, self.codec, policy=policy or self.settings.retry, options=self.options)
        with self._clients_lock:
            self._clients.append(client)
        return client

    def release_client(self, client: Client) -> None:
        """Close a client from :meth:`client` before shutdown (its peer is gone for good): unwatched when it
        was watched, its socket closed at once, its counts kept in the node's metrics. On the thread that
        owns it (see :meth:`client`); a client this node no longer holds is only closed."""
        if self._callbacks.pop(client.sock, None) is not None:
            self._poller.unregister(client.sock)
        with self._clients_lock:
            if client in self._clients:
                self._clients.remove(client)
                self._released["retries"] += client.retries
                self._released["unsent"] += client.unsent
        client.close()

    def _client_total(self, count: str) -> int:
        """``retries`` or ``unsent`` summed over every client this node made, released ones included."""
        with self._clients_lock:
            return self._released[count] + sum(getattr(client, count) for client in self._clients)

    def subscribe(
        self, handler: Callable[[Message], None], *, kinds: frozenset[str] | None = None, since: int | None = None,
        topics: frozenset[str] | None = None, backend: ArrayBackend = "numpy",
    ) -> Subscriber:
        """Deliver events (of ``kinds``, default all) to ``handler`` in per-source order, gaps filled from
        the broker's ring.

        With ``since``, first replay every ring event with ``seq >= since`` (each source), then go live
        without loss or duplicates. With ``topics`` (a superset of ``kinds``), the broker sends this
        subscription only events of those kinds (and ``sync`` probes): every kind that the sources of
        ``kinds`` publish must be in it, or their sequence gaps cannot be told (see
        :class:`~refbus.bus.pubsub.Subscriber`). ``backend`` rebuilds the arrays in events, live, replayed and
        filled: numpy unless a role that runs torch asks for tensors, so no publisher can make this node import
        torch. Subscriptions become live during :meth:`run`'s start-up.
        """
        sock = make_socket(self.ctx, zmq.SUB, options=self.event_options)
        for topic in sorted(topics) if topics is not None else [""]:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())  # the first frame starts with the kind, either form
        if topics is not None:
            sock.setsockopt(zmq.SUBSCRIBE, Sync.kind.encode())  # the liveness handshake and stream tails
        self._owned.append(sock)

        def fill(src: str, incarnation: str, first: int, last: int) -> list[Message]:
            return self.replay_range(src, incarnation, first, last, backend=backend)

        subscriber = Subscriber(sock, self.codec, fill=fill, kinds=kinds, topics=topics, backend=backend)
        self._subscriptions.append((subscriber, handler, since))
        return subscriber

    def track_peers(self) -> Peers:
        """The registry as this node sees it (:class:`~refbus.bus.peers.Peers`), made on first call: from
        then on a peer the broker reports down fails every pending and new :attr:`calls` request to its
        endpoints at once. Opt-in (it subscribes to ``node-up``/``node-down``, and the broker sends it those
        kinds only: the broker is their one source and publishes nothing else, so its sequence numbers stay
        whole): call it before :meth:`run`. Those events count from the broker only (:meth:`_registry_event`)."""
        if self._peers is None:
            self._peers = Peers(self.calls, self.node_id)
            self._peer_events = self.subscribe(self._registry_event, kinds=PEER_KINDS, topics=PEER_KINDS)
        return self._peers

    def _registry_event(self, message: Message) -> None:
        """A ``node-up`` or ``node-down`` for :attr:`_peers`, from the broker that welcomed this node; one any other
        node published (any node may publish any kind) is refused, counted under :data:`NOT_FROM_BROKER` and logged:
        a forged ``node-down`` would end every request to a live peer, break a trainer world and start the grace
        after which stores reclaim what the peer holds. (Only CURVE binds a source to a process: on a plain or
        signed bus a node can still send as the broker's id.)"""
        assert self._peers is not None and self._peer_events is not None
        src = message.header.src
        if self.welcome is not None and src != self.welcome.broker_id:
            self._peer_events.rejected[NOT_FROM_BROKER] += 1
            log.warning("event.refused", code=NOT_FROM_BROKER, kind=message.kind, src=src,
                        broker=self.welcome.broker_id, detail="registry events count from the broker only")
            return
        self._peers.handle(message)

    def publish(self, body: Body) -> int:
        """Publish an event through the broker; returns its sequence number."""
        if self.publisher is None:
            raise RuntimeError("publish() before the node joined the bus")
        return self.publisher.publish(body)

    def every(self, interval_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread every ``interval_s`` seconds (above 0: a zero interval would keep the
        loop in its timers for good)."""
        if not interval_s > 0:
            raise ValueError(f"a timer's interval must be above 0 seconds, got {interval_s!r}")
        heapq.heappush(self._timers, _Timer(time.monotonic() + interval_s, interval_s, callback))

    def later(self, delay_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` once on the loop thread after ``delay_s`` seconds (loop thread only)."""
        heapq.heappush(self._timers, _Timer(time.monotonic() + delay_s, None, callback))

    def watch(self, sock: zmq.Socket, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop thread whenever ``sock`` is readable."""
        self._callbacks[sock] = callback
        self._poller.register(sock, zmq.POLLIN)

    def rest(self, sock: zmq.Socket, delay_s: float) -> None:
        """Stop watching ``sock`` for ``delay_s`` seconds (loop thread only): what arrives meanwhile waits in
        its queue and is handled in one batch, for one wake-up of the loop instead of one each."""
        self._poller.unregister(sock)
        self.later(delay_s, lambda: self._poller.register(sock, zmq.POLLIN))

    def broker(self) -> Client:
        """The client of the broker's control endpoint, made on first use: registry queries and replays work
        for a node that does not register too (a CLI command, a launcher)."""
        if self.control is None:
            self.control = self.calls.client(self.settings.bus, held=True)
        return self.control

    def listing(self, role: str = "", *, policy: RetryPolicy | None = None) -> NodeList | None:
        """The broker's ``node-list`` answer for ``role`` (all roles with ``""``) as it came, whole or cut to fit the
        body limit (``omitted`` > 0: that many live nodes left out); None, logged, when the broker does not answer
        within ``policy`` (default: the runtime's) or answers anything else. For a display, which shows what came
        and says what was left out; whoever takes a node missing from the list for a node gone uses
        :meth:`lookup`. Blocks."""
        try:
            listed = self.broker().request(Nodes(role=role), policy=policy).body
        except (RemoteError, RequestTimeout) as exc:
            log.warning("registry.lookup_failed", role=role, error=str(exc))
            return None
        return self._node_list(role, listed)

    def lookup(self, role: str = "", *, policy: RetryPolicy | None = None) -> list[NodeInfo] | None:
        """The live nodes of ``role`` (all roles with ``""``) in the broker's registry; None, logged, when the
        broker does not answer within ``policy`` (default: the runtime's) or answers anything but the whole
        list (one it had to cut to fit the body limit is no answer: callers take a node missing from the list
        for a node gone). Blocks until then: for start-up, shutdown and commands; a running node loop uses
        :meth:`lookup_async`."""
        listed = self.listing(role, policy=policy)
        return None if listed is None else self._whole(role, listed)

    def _listed(self, role: str, listed: Body) -> list[NodeInfo] | None:
        """The nodes of a ``nodes`` answer when it is the whole list; None, logged, otherwise."""
        node_list = self._node_list(role, listed)
        return None if node_list is None else self._whole(role, node_list)

    def _node_list(self, role: str, listed: Body) -> NodeList | None:
        """``listed`` when it is a ``node-list``; None, logged, otherwise."""
        if not isinstance(listed, NodeList):  # what answers at bus.control is a peer: its reply may be anything
            log.warning("registry.lookup_failed", role=role, error=f"{self.settings.bus} answered {Nodes.kind} "
                        f"with {listed.kind}, not {NodeList.kind}")
            return None
        return listed

    def _whole(self, role: str, listed: NodeList) -> list[NodeInfo] | None:
        """The nodes of ``listed`` when the broker left none out; None, logged, otherwise."""
        if listed.omitted:
            log.warning("registry.lookup_failed", role=role, omitted=listed.omitted,
                        error="the broker left live nodes out of its answer to fit the body limit: a list that "
                        "lacks them would have them taken for gone")
            return None
        return listed.nodes

    def lookup_async(self, role: str, on_done: Callable[[list[NodeInfo] | None], None], *,
                     deadline_s: float | None = None) -> None:
        """The :meth:`lookup` for a node loop, which must never wait on the broker: ``on_done`` gets the live
        nodes of ``role`` (all roles with ``""``), or None (logged) when the broker did not answer within
        ``deadline_s`` (default: the runtime's retry schedule) or answered an error or a cut list. Called on the
        loop thread, once, never inside this call. A lookup of ``role`` already in flight is joined, not repeated (its
        deadline holds; an ``on_done`` already waiting is not added twice), so a periodic caller facing a broker
        that stopped answering has one request out and one answer coming, not one per tick. Loop thread only."""
        waiting = self._lookups.get(role)
        if waiting is not None:
            if on_done not in waiting:
                waiting.append(on_done)
            return
        self._lookups[role] = [on_done]

        def done(outcome: Outcome) -> None:
            nodes: list[NodeInfo] | None = None
            if isinstance(outcome, Message):
                nodes = self._listed(role, outcome.body)
            else:
                log.warning("registry.lookup_failed", role=role, error=str(outcome))
            for callback in self._lookups.pop(role, ()):
                try:
                    callback(nodes)
                except Exception:  # one caller's failure must not cost the others their answer
                    log.exception("registry.lookup_callback_failed", role=role)

        self.calls.request(self.settings.bus, Nodes(role=role), done, deadline_s=deadline_s)

    def replay(
        self, *, since: int = 0, src: str = "", until: int | None = None, incarnation: str = "",
        deadline_s: float | None = None, backend: ArrayBackend = "numpy",
    ) -> list[Message]:
        """Events from the broker's replay ring with ``since <= seq`` (and ``<= until`` when given; with one
        ``src`` this stops paging once every number up to ``until`` was found), decoded, in ring order except
        that each source incarnation's events come in sequence order (a refill puts older events after newer
        ones). Pages through the ring by its cursor. ``incarnation`` keeps only that sender incarnation's
        events (a restarted source reuses numbers). Blocks: each page's request under the runtime's retry
        policy, or, with ``deadline_s``, under a short one fitted to what is left of it, so the whole replay
        ends within ``deadline_s`` (:class:`RequestTimeout` otherwise). ``backend`` rebuilds the events' arrays
        (see :meth:`subscribe`)."""
        broker = self.broker()
        events: list[Message] = []
        found: set[int] = set()  # numbers since..until seen (with one src): all of them ends the paging
        cursor = 0
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            policy = None if end is None else policy_by(end, f"replay from {self.settings.bus} in {deadline_s:.3f}s")
            reply = broker.request(Replay(since=since, src=src, cursor=cursor), policy=policy)
            page = reply.body
            assert isinstance(page, Replayed)
            for message in self._ring_events(page.events, backend):
                if message.header.seq < since:  # the earlier events of a batch the ring selected
                    continue
                if not incarnation or envelope_incarnation(message.header.id) == incarnation:
                    events.append(message)
                    if until is not None and message.header.seq <= until:
                        found.add(message.header.seq)
            cursor = page.cursor
            if not page.more or (until is not None and src and len(found) > until - since):
                return in_source_order([e for e in events if until is None or e.header.seq <= until])

    def _ring_events(self, entries: list[ReplayedEvent], backend: ArrayBackend) -> Iterator[Message]:
        """Each event of the ring's messages, decoded (a batch gives all of its own); a message that fails its
        checks is logged and skipped, never the others."""
        codec = self.codec
        for entry in entries:
            try:
                yield from codec.decode_batch(entry.frames) or [codec.decode(entry.frames, backend=backend)]
            except ProtocolError as exc:
                log.warning("replay.rejected", code=exc.code, error=str(exc))

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between heartbeats: the broker's (it judges liveness) once joined, the settings' before."""
        return self.welcome.heartbeat_interval if self.welcome else self.settings.heartbeat_interval_s

    def fill_deadline_s(self) -> float:
        """How long the broker work of one loop turn (its gap fills, every page; a re-join, every step) may take:
        ``FILL_SHARE`` of the broker's node timeout once joined, of the heartbeat interval before."""
        return FILL_SHARE * (self.welcome.node_timeout if self.welcome else self.settings.heartbeat_interval_s)

    def _turn_deadline(self) -> float:
        """When this loop turn's broker work ends (monotonic): one :meth:`fill_deadline_s` from its first piece. Outside
        the loop each piece gets one of its own."""
        if self._fill_end is None or not self._in_turns:
            self._fill_end = time.monotonic() + self.fill_deadline_s()
        return self._fill_end

    def replay_range(self, src: str, incarnation: str, first: int, last: int, *,
                     backend: ArrayBackend = "numpy") -> list[Message]:
        """Gap fill for subscribers: the ring's events ``first..last`` of ``src``'s ``incarnation``. It runs on
        the loop thread, so all the fills of one loop turn (several gaps at once, e.g. after a queue overflowed)
        end within one :meth:`fill_deadline_s`; a fill outside the loop gets one of its own. A broker that does
        not answer by then (or answers an error) gives nothing, logged, and the subscriber counts the gap lost."""
        left = self._turn_deadline() - time.monotonic()
        if left <= 0:
            log.warning("replay.skipped", src=src, first=first, last=last,
                        detail="this loop turn's gap fills used their time: the gap is counted lost")
            return []
        try:
            return self.replay(since=first, src=src, until=last, incarnation=incarnation, deadline_s=left,
                               backend=backend)
        except (RequestTimeout, RemoteError, OSError) as exc:
            log.warning("replay.failed", src=src, first=first, last=last, error=str(exc))
            return []

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread (safe from any thread): how an embedding framework's own
        threads hand work to the node, since sockets belong to the loop thread."""
        self._calls.append(callback)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def start_background(self) -> threading.Thread:
        """Start and loop in a daemon thread (for embedding in a framework's process); :meth:`stop` ends it
        and :meth:`join` waits for the clean shutdown. Signal handling stays with the embedding process. A start
        that fails raises its error here once the node has closed (:attr:`closed`)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self.start()
            except BaseException as exc:
                failure.append(exc)
                try:
                    self.close()
                finally:  # a close that raised must not leave the caller waiting for good
                    ready.set()
                return
            ready.set()
            try:
                self.loop()
            finally:
                self.close()

        self._thread = threading.Thread(target=main, name=f"refbus-{self.node_id}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self._thread

    def join(self, timeout: float | None = None) -> None:
        """Stop a background node and wait for its shutdown."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads); starts the shutdown clock."""
        self.begin_shutdown()
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def begin_shutdown(self) -> None:
        """Start the shutdown clock (once): the node is to be gone ``shutdown_timeout_s`` from now. For a role
        whose own loop ends the node later (a training loop finishing its step); :meth:`stop` calls it."""
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
            ExitWatchdog.notify(self)

    @property
    def shutdown_started(self) -> float:
        """When the shutdown clock started (monotonic); now when it has not."""
        return self._shutdown_started if self._shutdown_started is not None else time.monotonic()

    def shutdown_left(self) -> float:
        """Seconds a shutdown hook may still spend (waiting on peers, joining a thread); 0 once spent. The hooks
        get ``HOOKS_SHARE`` of the timeout (the rest is for the final events), and never so long that the
        broker, missing the heartbeats meanwhile, would declare the node down before its bye."""
        hooks_s = self.settings.shutdown_timeout_s * HOOKS_SHARE
        if self.welcome is not None:
            hooks_s = min(hooks_s, self.welcome.node_timeout - 2 * self.welcome.heartbeat_interval)
        return max(0.0, self.shutdown_started + hooks_s - time.monotonic())

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread :meth:`start_background` runs the loop in; None when the node is not embedded that way."""
        return self._thread

    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            role=self.role,
            host=self.settings.host,
            pid=os.getpid(),
            endpoints=dict(self.endpoints),
            labels=dict(self.labels),
            metrics=self.metrics_url,
            started=self.started,
        )

    # --- lifecycle ----------------------------------------------------------------------------------

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """Start, loop until stopped (or ``until()`` is true), then shut down cleanly."""
        with self.stop_on_signals():
            try:
                self.start()
                self.loop(until=until)
            finally:
                self.close()

    def stop_on_signals(self) -> contextlib.AbstractContextManager[None]:
        """SIGINT and SIGTERM ask the node to stop (:meth:`stop`) instead of killing the process, so its
        shutdown hooks run (within ``shutdown_timeout_s``). Main thread only."""
        return on_signals(self.stop)

    def start(self) -> None:
        """Serve metrics, join the broker, make the subscriptions live, start the heartbeats, write the ready file.
        Its waits on the broker (each bounded by ``connect_timeout_s`` or the retry policy: the broker may not be up
        yet) give way to a stop asked before or meanwhile as soon as a poll of theirs brings nothing:
        :class:`NodeStopped` within :data:`~.reqrep.INTERRUPT_CHECK_MS`, the node to be closed as after any start
        that failed."""
        self._serve_metrics()
        control = self.broker() if self.register or self._subscriptions else None
        if control is not None:
            control.interrupt = self._give_way_to_stop
        try:
            if self.register:
                self._join()
            for subscriber, _, since in self._subscriptions:
                self._go_live(subscriber, since)
            if self._peers is not None and (listed := self.lookup()) is not None:
                self._peers.seed(listed)  # peers up before the subscription was live: node-up came before it
        finally:
            if control is not None:
                control.interrupt = None  # the node runs: a stop ends its loop, and its close still asks the broker
        self.every(self.heartbeat_interval_s, self._heartbeat)  # the broker's interval wins: it judges liveness
        self._write_ready_file()
        log.info("node.ready", endpoints=self.endpoints, metrics=self.metrics_url)

    def loop(self, *, until: Callable[[], bool] | None = None) -> None:
        """Serve until stopped (or ``until()`` is true). Events published during a turn go out together, as
        batches, before the loop waits again (see :class:`~.pubsub.Publisher`)."""
        publisher = self.publisher
        try:
            with publisher.batching() if publisher is not None else contextlib.nullcontext():
                self._turns(until, publisher)
        except BaseException as exc:  # kept: a loop in a background thread dies unseen while the process goes on
            self.loop_failed = exc
            raise

    def _turns(self, until: Callable[[], bool] | None, publisher: Publisher | None) -> None:
        self._in_turns = True
        try:
            self._turns_until(until, publisher)
        finally:
            self._in_turns = False

    def _turns_until(self, until: Callable[[], bool] | None, publisher: Publisher | None) -> None:
        wake, wake_fd = self._wake_r, self._wake_r.fileno()
        while not self._stopping and not (until and until()):
            self._fill_end = None
            while self._calls:
                call = self._calls.popleft()
                try:
                    call()
                except Exception:
                    log.exception("node.call_failed")
            self._deliver_ready()
            if self._rejoin:
                self._rejoin = False
                try:
                    # Every step by one deadline: a broker that does not answer must not hold the loop.
                    self._join(self._turn_deadline())  # sets _resume_pending when the broker restarted or moved
                    if self._resume_pending:
                        # The resumption (probes, the whole ring, the gap fills it reveals) gets a deadline of its
                        # own: sharing the join's, a join slowed by every node re-joining at once left it nothing,
                        # and gaps it could have filled were counted lost. Due timers (a heartbeat) go out between.
                        self._run_timers()
                        self._fill_end = None
                        self._resume_subscriptions(self._turn_deadline())
                        self._resume_pending = False
                except (BusUnavailable, RequestTimeout, RemoteError) as exc:  # gone again, or slow: retry later
                    log.warning("bus.rejoin_failed", error=str(exc))
                    self.later(self.settings.heartbeat_interval_s, self._request_rejoin)
            timeout_ms = self._run_timers()
            calls_wait = self.calls.wait_s()
            if calls_wait is not None:
                timeout_ms = min(timeout_ms, int(calls_wait * 1000) + 1)
            if publisher is not None:
                publisher.flush()
            for sock, _ in self._poller.poll(timeout_ms):
                if sock is wake or sock == wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(64)
                    continue
                callback = self._callbacks.get(sock)
                if callback is None:  # a client released by an earlier callback of this turn
                    continue
                try:
                    callback()
                except Exception:  # whatever a peer sent, the node keeps serving the others
                    log.exception("node.callback_failed")
            self.calls.tick()

    def close(self) -> None:
        """Shut down within ``shutdown_timeout_s`` of the stop: hooks, final events, bye, sockets.

        A hook cut off at its share of the deadline may still be using this node's sockets and codec on its
        thread (a ``calls.run_until`` polling the broker's control client, a publish), and neither ZeroMQ
        sockets nor the codec are thread-safe: they stay that thread's. The final events then cannot be proven
        received (that takes the PUB socket and the control client: skipped, logged); the bye goes out on a
        socket and codec of its own; the hook's thread drops the pending calls and releases the sockets once
        the hook returns (or the process's exit does)."""
        self.begin_shutdown()
        self._stopping = True
        cut_off = self._run_shutdown_hooks()
        close_by = self.shutdown_started + self.settings.shutdown_timeout_s * CLOSE_SHARE
        bye_s = min(BYE_TIMEOUT_S, self.settings.shutdown_timeout_s * (CLOSE_SHARE - HOOKS_SHARE) / 2)
        if cut_off:
            if self.publisher is not None and self.publisher.seq != self._confirmed_seq:
                log.warning("events.unconfirmed", error="a cut-off shutdown hook may still be using the PUB socket "
                            "and the control client")
            self._say_bye(close_by, bye_s, own_socket=True)
            self._remove_ready_file()
            self.closed = True
            log.info("node.stopped", sockets="released by the cut-off hook's thread once the hook returns")
            return
        self.flush_events(max(0.0, close_by - bye_s - time.monotonic()))
        self._say_bye(close_by, bye_s)
        self.calls.close()
        self._remove_ready_file()
        self.closed = True
        self._release()
        log.info("node.stopped")

    def _bye(self) -> Bye:
        """This process's ``bye``: it names the process, so a broker refuses it (``replaced``) once another process
        holds the node id."""
        return Bye(node_id=self.node_id, process=incarnation(self.info()))

    def _say_bye(self, close_by: float, bye_s: float, *, own_socket: bool = False) -> None:
        """Tell the broker this node leaves (one attempt, at most ``bye_s``, by ``close_by``), when it joined and
        another process has not replaced it (its bye would remove that one's entry). The bye names this process,
        so a broker refuses it (``replaced``) for a replacement this process was never told of. ``own_socket``: on
        a client and codec made for it alone, closed after (another thread holds the node's)."""
        if self.control is None or self.welcome is None or self._replaced:
            return
        policy = RetryPolicy(timeout_s=max(0.05, min(bye_s, close_by - time.monotonic())), attempts=1)
        control = self.control
        with contextlib.suppress(Exception):  # the broker may be gone, the context closing under a cut-off hook
            if own_socket:
                codec = WireCodec(self.node_id, secret=self.settings.secret, limits=self.settings.limits)
                control = Client(self.ctx, self.settings.bus, codec, policy=policy, options=self.options)
            try:
                control.request(self._bye(), policy=policy)
            finally:
                if own_socket:
                    control.close()

    def _release(self) -> None:
        """Close every socket and the context, remove ipc files, stop serving metrics (the last step of
        :meth:`close`, on whichever thread may touch the sockets last)."""
        with self._clients_lock:
            clients = list(self._clients)
        for client in clients:
            client.close()
        for sock in self._owned:
            sock.close()
        for endpoint in self._bound_ipc:
            remove_ipc_file(endpoint)
        if self._stop_metrics is not None:
            self._stop_metrics()
        for collector in self._collectors:
            REGISTRY.unregister(collector)
        self._collectors.clear()
        self._wake_r.close()
        self._wake_w.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()

    def _run_shutdown_hooks(self) -> bool:
        """Run the hooks in order on a helper thread (the loop has stopped: it hands them its sockets) until
        the hooks' share of the deadline; True when one was cut off (logged; the hooks after it do not run,
        and the sockets stay that thread's: once the hook returns it drops the pending calls and releases
        them)."""
        running: list[str] = []
        state = {"done": False, "cut": False}
        decided = threading.Lock()  # the hooks ending and the cut-off exclude each other

        def run_hooks() -> None:
            for hook in self.shutdown_hooks:
                if state["cut"]:
                    break
                running[:] = [getattr(hook, "__qualname__", repr(hook))]
                try:
                    hook()
                except Exception:
                    log.exception("node.shutdown_hook_failed", hook=running[0])
            with decided:
                state["done"] = True
            if state["cut"]:
                self.calls.close()
                self._release()

        thread = threading.Thread(target=run_hooks, name=f"refbus-shutdown-{self.node_id}", daemon=True)
        thread.start()
        thread.join(self.shutdown_left())
        with decided:
            if state["done"]:
                thread.join()  # only its last lines are left
                return False
            state["cut"] = True
        log.error("node.shutdown_hook_cut_off", hook=next(iter(running), "?"),
                  shutdown_timeout_s=self.settings.shutdown_timeout_s)
        return True

    def _remove_ready_file(self) -> None:
        if self.settings.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.ready_file)

    # --- internals ----------------------------------------------------------------------------------

    def _serve_metrics(self) -> None:
        if self.settings.metrics_port < 0:
            return
        bound, self._stop_metrics = serve_metrics(self.settings.metrics_host, self.settings.metrics_port)
        self.metrics_url = advertised(bound, self.settings.host)
        self.metric("refbus_node_info", "This node's identity (value 1).",
                    lambda: {(self.node_id, self.role): 1.0}, labels=("node", "role"), kind="gauge")
        self.metric("refbus_wire_array_frames_received_total", "Array (buffer) frames this process received.",
                    lambda: {(): float(FrameCounter.frames)})
        self.metric("refbus_wire_array_received_bytes_total", "Bytes of array frames this process received.",
                    lambda: {(): float(FrameCounter.nbytes)})
        self.metric("refbus_bus_events_published_total", "Events this node published.",
                    lambda: {(): float(self.publisher.seq if self.publisher else 0)})
        self.metric("refbus_bus_messages_published_total",
                    "Event messages this node sent (a batch of events counts once).",
                    lambda: {(): float(self.publisher.messages if self.publisher else 0)})
        subscribers = [s for s, _, _ in self._subscriptions]
        for name, doc, attribute in (
            ("refbus_bus_events_received_total", "Events received by this node's subscriptions.", "received"),
            ("refbus_bus_event_gaps_total", "Events found missing by sequence number (before gap fill).", "missed"),
            ("refbus_bus_events_filled_total", "Missing events recovered from the broker's replay ring.", "filled"),
            ("refbus_bus_events_duplicate_total", "Duplicate events dropped by sequence number.", "duplicates"),
        ):
            self.metric(name, doc, lambda a=attribute: {(): float(sum(getattr(s, a) for s in subscribers))})
        self.metric("refbus_bus_events_lost_total", "Events found missing that the replay ring could not recover "
                    "(a broker that died took them with its ring, or the ring had evicted them).",
                    lambda: {(): float(sum(s.lost_total for s in subscribers))})
        self.metric("refbus_bus_events_rejected_total", "Events refused (malformed, forged, replayed), by code.",
                    lambda: _merged(s.rejected for s in subscribers), labels=("code",))
        self.metric("refbus_bus_broker_restarts_total", "Times this node re-joined a broker that had died and "
                    "come back.", lambda: {(): float(self.broker_restarts)})
        self.metric("refbus_requests_total", "Requests this node's servers answered, by kind.",
                    lambda: _merged(server.handled for server in list(self._servers)), labels=("kind",))
        self.metric("refbus_requests_rejected_total", "Requests answered with an error, by code.",
                    lambda: _merged(server.rejected for server in list(self._servers)), labels=("code",))
        self.metric("refbus_requests_duplicate_total", "Retried requests answered from the reply cache.",
                    lambda: {(): float(sum(server.duplicates for server in list(self._servers)))})
        self.metric("refbus_request_retries_total", "Requests this node sent again after a timeout.",
                    lambda: {(): float(self._client_total("retries"))})
        self.metric("refbus_request_unsent_total", "Request sends refused because the queue to the peer was full "
                    "(the peer gone or not reading); each is an attempt without a reply.",
                    lambda: {(): float(self._client_total("unsent"))})
        self.metric("refbus_request_outcomes_total", "Asynchronous requests resolved, by outcome.",
                    lambda: by_label(self.calls.outcomes), labels=("outcome",))
        self.metric("refbus_replies_late_total", "Replies that arrived after their request's outcome (dropped).",
                    lambda: {(): float(self.calls.late)})
        if self.zap is not None:
            zap = self.zap
            self.metric("refbus_security_peers_refused_total", "Connections the ZAP handler refused, by reason "
                        "(unknown-key: a CURVE key not in the allow-list).",
                        lambda: by_label(zap.refused), labels=("reason",))
        self.metric("refbus_replies_rejected_total", "Malformed replies dropped, by error code.",
                    lambda: by_label(self.calls.rejected), labels=("code",))

    def metric(
        self,
        name: str,
        doc: str,
        read: Callable[[], dict[tuple[str, ...], float]],
        *,
        labels: tuple[str, ...] = (),
        kind: str = "counter",
    ) -> None:
        """Expose ``read()`` (label values -> value, read at scrape time) on this node's metrics endpoint
        while the node runs; nothing when the node serves no metrics."""
        if self.settings.metrics_port >= 0:
            self._collectors.append(register_live(name, doc, read, labels=labels, kind=kind))

    def histogram(self, name: str, doc: str, *, buckets: Sequence[float]) -> Histogram:
        """A histogram to ``observe`` into (any thread), exposed on this node's metrics endpoint while the node
        runs. Counters and gauges are :meth:`metric` reads of plain attributes instead: they cost nothing on
        hot paths."""
        histogram = Histogram(name, doc, buckets=buckets, registry=None)
        if self.settings.metrics_port >= 0:
            REGISTRY.register(histogram)
            self._collectors.append(histogram)
        return histogram

    def _join(self, by: float | None = None) -> bool:
        """Register with the broker and prove the event path live before anything is published. True when
        the broker is a new process (it died and came back) or moved: live subscriptions must resume. That is
        also kept in ``_resume_pending`` as soon as it is known, before the refill and the probe, and the refill
        itself in ``_refill_pending`` until it is done: a join that fails after it (the probe not seen in time)
        leaves them set for the retry, which finds the same broker incarnation and so cannot tell again.

        A ``hello`` the broker refuses (its registry full) is :class:`BusUnavailable`, naming the broker's reason.
        ``by`` (monotonic): a re-join from the loop, whose every step (hello, each refill page, the probe) ends by
        then, :class:`BusUnavailable` or :class:`RequestTimeout` otherwise. Without it (the first join, at
        start) the hello is sent every second for ``connect_timeout_s`` (the broker may still be starting), and
        the rest takes up to ``connect_timeout_s`` more."""
        self.broker()
        assert self.control is not None
        token = self.codec.new_id()
        if by is None:
            hello_policy = self._first_hello_policy()
        else:
            hello_policy = policy_by(by, f"the re-join of {self.settings.bus}")
        try:
            reply = self._hello(token, hello_policy, waiting=by is None)
        except RequestTimeout as exc:
            raise BusUnavailable(f"no broker answered at {self.settings.bus}: {exc}") from None
        except RemoteError as exc:  # the broker's reason says it all: no traceback to read it from
            raise BusUnavailable(f"the broker at {self.settings.bus} refused node id {self.node_id!r}: "
                                 f"[{exc.code}] {exc.detail}") from None
        welcome = reply.body
        assert isinstance(welcome, Welcome)
        if welcome.wire not in SPOKEN_MAJORS:
            raise BusUnavailable(f"broker {welcome.broker_id!r} chose protocol major {welcome.wire}, this node "
                                 f"speaks {list(SPOKEN_MAJORS)}")
        if self.publisher is not None:  # what the turn published goes now, ahead of the refill, never after it
            self.publisher.flush()
        if self.publisher is None:
            pub = make_socket(self.ctx, zmq.PUB, options=self.event_options)
            self._owned.append(pub)
            monitor = pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            monitor.linger = 0
            self._owned.append(monitor)
            self.watch(monitor, lambda: self._on_publish_path(monitor))
            self.publisher = Publisher(pub, self.codec, keep_events=self.settings.held_events)
        self.publisher.batch_events = welcome.event_batch
        refill = bool(self._pub_endpoint) and self._pub_endpoint != welcome.events_in  # the broker moved
        refill |= self.publish_path_lost
        if self._pub_endpoint != welcome.events_in:  # one stream per incarnation: a moved broker is no new one
            if self._pub_endpoint:
                self.publisher.sock.disconnect(self._pub_endpoint)
            self.publisher.sock.connect(welcome.events_in)
            self._pub_endpoint = welcome.events_in
        self.publish_path_lost = False
        moved = self.welcome is not None and self.welcome.events_out != welcome.events_out
        if moved:
            assert self.welcome is not None
            for subscriber, _, _ in self._subscriptions:  # live subscriptions follow a broker that moved
                subscriber.sock.disconnect(self.welcome.events_out)
                subscriber.sock.connect(welcome.events_out)
        broker = envelope_incarnation(reply.header.id)
        restarted = bool(self.broker_incarnation) and broker != self.broker_incarnation
        if restarted:
            self.broker_restarts += 1
            log.warning("bus.broker_restarted", broker=welcome.broker_id, detail="registered again; this node's "
                        "held events go to the new ring, so subscribers fill what the old broker held in flight")
        self.broker_incarnation = broker
        self.welcome = welcome
        if restarted or moved:  # kept until the subscriptions resumed, whatever fails from here on
            self._resume_pending = True
        if restarted and self._peers is not None:  # peers that died meanwhile: the new broker never saw them
            self._peers.expect_rejoins()
            tries = max(1, math.ceil(welcome.node_timeout / welcome.heartbeat_interval))
            # Every live peer re-joins by then: its sockets reconnect to the new broker within their reconnect cap,
            # and it re-joins at its next heartbeat, well within a node timeout.
            settle_s = welcome.node_timeout + welcome.heartbeat_interval + RECONNECT_IVL_MAX_MS / 1000
            self.later(settle_s, lambda: self._reconcile_peers(broker, tries))
        if refill or restarted:  # kept until handed over, whatever fails from here on
            self._refill_pending = True
        end = time.monotonic() + self.settings.connect_timeout_s if by is None else by
        if self._refill_pending:  # before the probes: the gaps they reveal fill from it
            if self.publisher.seq:
                self._refill(end)
            self._refill_pending = False
        self._prove_published(token, end - time.monotonic())
        self._confirmed_seq = self.publisher.seq
        log.info("node.joined", bus=self.settings.bus, broker=welcome.broker_id)
        return restarted or moved

    def _first_hello_policy(self) -> RetryPolicy:
        """A hello at start: sent every second for ``connect_timeout_s`` (the broker may still be starting)."""
        return RetryPolicy(timeout_s=1.0, attempts=max(1, int(self.settings.connect_timeout_s)), backoff=1.0)

    def check_id(self) -> None:
        """Ask the broker whether another live process holds this node's id, for a node that cannot start because
        another process holds what is its own (its durable store), as its predecessor not yet dead may:
        :class:`NodeIdInUse` when one does (the broker heard it heartbeat after the ask), :class:`BusUnavailable`
        when the broker does not answer or decide within ``connect_timeout_s``, or refuses the ``hello`` for another
        reason (one that predates probes, its registry full: no word on the id); it returns when the id is free or
        its holder is dying. The ``hello`` it asks with is a probe: nothing is registered and no holder replaced (a
        broker that predates probes registers it, and is told ``bye`` at once)."""
        control = self.broker()
        try:
            reply = self._hello(self.codec.new_id(), self._first_hello_policy(), waiting=True, probe=True)
        except RequestTimeout as exc:
            raise BusUnavailable(f"no broker answered at {self.settings.bus}: {exc}") from None
        except RemoteError as exc:
            raise BusUnavailable(f"the broker at {self.settings.bus} did not say whether node id {self.node_id!r} "
                                 f"is held: {exc}") from None
        if isinstance(reply.body, Welcome):
            with contextlib.suppress(RequestTimeout, RemoteError):  # unsaid, the entry expires in a node timeout
                control.request(self._bye(), policy=RetryPolicy(timeout_s=1.0, attempts=1))

    def _hello(self, token: str, policy: RetryPolicy, *, waiting: bool, probe: bool = False) -> Message:
        """The broker's answer to this node's ``hello``. While another process holds the node id (:data:`ID_IN_USE`)
        a first join (``waiting``) asks again when the broker says, for up to ``connect_timeout_s``: the broker lets
        it in once the holder is a predecessor dying, within half its node timeout; :class:`NodeIdInUse` once it
        heard the holder heartbeat after the ask, :class:`BusUnavailable` (restartable) when it has not decided by
        then. A re-join raises the refusal (:class:`RemoteError`) and is tried again later. ``probe``: asked as a
        probe (see :class:`~..protocol.messages.Hello`)."""
        assert self.control is not None
        end = time.monotonic() + self.settings.connect_timeout_s
        while True:
            try:
                return self.control.request(Hello(node=self.info(), token=token, wire=list(SPOKEN_MAJORS),
                                                  probe=probe), policy=policy)
            except RemoteError as exc:
                if exc.code != ID_IN_USE or not waiting:
                    raise
                if exc.retry_after_s <= 0:
                    raise NodeIdInUse(f"the broker at {self.settings.bus} refused node id {self.node_id!r}: "
                                      f"{exc.detail}") from None
                if time.monotonic() + exc.retry_after_s > end:
                    raise BusUnavailable(f"the broker at {self.settings.bus} did not let node id {self.node_id!r} "
                                         f"in within {self.settings.connect_timeout_s:g}s: {exc.detail}") from None
                log.info("node.id_held", detail=exc.detail, retry_after_s=exc.retry_after_s)
                self._pause(exc.retry_after_s)  # the broker's word: the holder beats, or is silent, by then

    def _give_way_to_stop(self) -> None:
        """Raise :class:`NodeStopped` once a stop was asked: what the start's waits on the broker call between their
        polls (the control client's ``interrupt``)."""
        if self._shutdown_started is not None:
            log.info("node.stopped_while_starting", bus=self.settings.bus, joined=self.welcome is not None)
            raise NodeStopped(f"node {self.node_id!r} was asked to stop while it was starting")

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, calling the control client's ``interrupt`` as its own waits do (a starting node's pause
        gives way to a stop too)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, INTERRUPT_CHECK_MS / 1000))
            if self.control is not None and self.control.interrupt is not None:
                self.control.interrupt()

    def _reconcile_peers(self, broker: str, tries: int) -> None:
        """A node timeout, a heartbeat interval and the reconnect cap after a re-join found broker incarnation
        ``broker``, every live peer has re-joined it or is gone: look the registry up (asynchronously) and mark
        down the peers it lacks (:meth:`~.peers.Peers.reconcile`). A lookup that fails is tried again a heartbeat
        later, ``tries`` times in all, then given up (logged). Nothing is done for a broker that restarted again
        since (its own re-join scheduled its own check)."""
        if self._peers is None or self.welcome is None or broker != self.broker_incarnation or self._stopping:
            return
        peers, interval = self._peers, self.welcome.heartbeat_interval

        def done(nodes: list[NodeInfo] | None) -> None:
            if broker != self.broker_incarnation:
                return
            if nodes is None:
                if tries > 1:
                    self.later(interval, lambda: self._reconcile_peers(broker, tries - 1))
                else:
                    log.warning("peers.reconcile_gave_up", detail="the restarted broker's registry did not answer; "
                                "peers that died while it was down stay live here")
                return
            gone = peers.reconcile(nodes)
            if gone:
                log.warning("peers.absent_after_broker_restart", nodes=gone,
                            detail="live before the broker restarted, not re-joined since: reported down")

        self.lookup_async("", done, deadline_s=interval)

    def _refill(self, by: float) -> None:
        """Hand the broker this node's held events (see :class:`~refbus.bus.pubsub.Publisher`) for its ring, in
        pages within the body limit, every page by ``by`` (monotonic). A page the broker refuses is logged:
        subscribers count its events lost where they find them missing, never silently. One it does not answer
        in time raises :class:`RequestTimeout` (the re-join fails, and its retry hands over every held event
        again: the ring keeps a duplicate, which subscribers drop)."""
        assert self.control is not None and self.publisher is not None
        budget = self.codec.limits.max_body_bytes // 2
        held = self.publisher.held()
        taken = 0
        page: list[ReplayedEvent] = []
        size = 0
        page_events = 0
        for frames, events in [*held, ([], 0)]:  # the empty entry sends the last page
            nbytes = sum(map(len, frames))
            if page and (not frames or size + nbytes > budget):
                try:
                    self.control.request(Refill(events=page), policy=policy_by(by, "the refill"))
                    taken += page_events
                except RemoteError as exc:
                    log.warning("bus.refill_failed", events=page_events, error=str(exc))
                page, size, page_events = [], 0, 0
            if frames:
                page.append(ReplayedEvent(frames))
                size += nbytes
                page_events += events
        self.refilled += taken
        log.info("bus.refilled", events=taken, messages=len(held), latest_seq=self.publisher.seq)

    def _on_publish_path(self, monitor: zmq.Socket) -> None:
        """The PUB socket's connection to the broker dropped: drop its queue with it (disconnect), so nothing
        reaches a restarted broker before this node has re-joined and refilled its ring; the events published
        meanwhile are held (:meth:`_refill`). The next answered heartbeat re-joins."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint = event.get("endpoint", b"")
            endpoint = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
            if event["event"] == zmq.EVENT_DISCONNECTED and endpoint == self._pub_endpoint:
                assert self.publisher is not None
                self.publisher.sock.disconnect(endpoint)
                self._pub_endpoint = ""
                self.publish_path_lost = True
                log.warning("bus.publish_path_lost", events_in=endpoint, detail="events are held until this "
                            "node re-joins the broker, then handed to its ring")

    def _go_live(self, subscriber: Subscriber, since: int | None) -> None:
        """Connect a subscription, wait until a broker probe arrives through it (so no window is lost),
        merge the requested replay, then hand it to the loop."""
        assert self.welcome is not None and self.control is not None, "subscriptions need a registered node"
        subscriber.sock.connect(self.welcome.events_out)
        self._prove_subscribed(subscriber, since)
        self.watch(subscriber.sock, lambda: self._drain(subscriber.sock, subscriber.drain_one))
        self._deliver_ready()

    def _prove_subscribed(self, subscriber: Subscriber, since: int | None, by: float | None = None, *,
                          keep_held: bool = False) -> None:
        """Wait until a broker probe arrives through ``subscriber`` (from then on no event misses it), then
        merge the ring's events with ``seq >= since`` (each source) in front of what arrived meanwhile.

        ``by`` (monotonic): the probes end by then (:class:`BusUnavailable` or :class:`RequestTimeout`
        otherwise), and so does the replay; one that does not (or that fails) is logged, not raised: the
        subscription is live, and what it did not merge shows as gaps, filled or counted lost. Without it (at
        start) the probes take up to ``connect_timeout_s`` and the replay runs under the runtime's retry policy,
        its failure raised. ``keep_held``: what arrived meanwhile stays parked once it is proved (the caller
        releases it: the gap fills that reveals run then); released at once when the proof fails."""
        assert self.welcome is not None and self.control is not None
        subscriber.hold()
        token = self.codec.new_id()
        subscriber.expect(token)
        try:
            deadline = time.monotonic() + self.settings.connect_timeout_s if by is None else by
            while token not in subscriber.tokens:
                if time.monotonic() > deadline:
                    raise BusUnavailable(f"no events arrived from {self.welcome.events_out} in time")
                self.control.request(Sync(token=token, path="sub"),
                                     policy=None if by is None else policy_by(by, "the subscription's probe"))
                if subscriber.sock.poll(SYNC_PROBE_INTERVAL_MS, zmq.POLLIN):
                    while token not in subscriber.tokens and subscriber.sock.poll(0, zmq.POLLIN):
                        subscriber.drain_one()
            if since is not None:
                for event in self._replay_by(since, by, subscriber.backend):
                    subscriber.offer(event)
        except BaseException:
            subscriber.forget_token(token)
            subscriber.release()
            raise
        subscriber.forget_token(token)
        if not keep_held:
            subscriber.release()

    def _replay_by(self, since: int, end: float | None, backend: ArrayBackend) -> list[Message]:
        """The ring's events with ``seq >= since`` (each source); with ``end`` (monotonic), only what a replay
        that ends by then brings, nothing (logged) when it does not."""
        if end is None:
            return self.replay(since=since, backend=backend)
        left = end - time.monotonic()
        error = "the replays of this resumption used their time"
        if left > 0:
            try:
                return self.replay(since=since, deadline_s=left, backend=backend)
            except (RequestTimeout, RemoteError, OSError) as exc:
                error = str(exc)
        log.warning("replay.resume_failed", since=since, error=error,
                    detail="the subscription is live; what the ring held for it shows as gaps, filled or counted lost")
        return []

    def _resume_subscriptions(self, by: float) -> None:
        """After a broker restart: events published before a subscription's socket reconnected were dropped
        by the new broker's XPUB but are in its ring (it holds only what came after its start), so each
        subscription proves itself live again and takes the whole new ring; what it already has is a
        duplicate, and what neither delivered shows as a gap and is counted lost, even when no later event
        from that source comes to reveal it. It runs on the loop thread: the probes and replays of all the
        subscriptions end by ``by`` (monotonic: the re-join's deadline, see :meth:`_join`), so heartbeats still go
        out; probes not seen by then raise (the re-join is tried again), replays cut off there are logged. What
        arrived meanwhile stays parked until every subscription is proved, then the gap fills it reveals get a
        deadline of their own (a whole-ring replay a busy broker cut off leaves its events to them, so sharing
        the replays' deadline counted them all lost), due timers (a heartbeat) going out first."""
        proved: list[Subscriber] = []
        try:
            for subscriber, _, _ in self._subscriptions:
                self._prove_subscribed(subscriber, 0, by, keep_held=True)
                proved.append(subscriber)
        finally:
            if proved:
                self._run_timers()
                self._fill_end = None
            for subscriber in proved:
                subscriber.release()
        self._deliver_ready()

    def flush_events(self, timeout_s: float = 2.0) -> bool:
        """Wait (at most ``timeout_s``) until the broker has received every event published so far.

        The PUB path is ordered, so once a probe sent after them arrives, they all did. Sockets close with
        linger 0, so :meth:`close` calls this when something was published since the last confirmation.
        """
        if self.publisher is None or self.control is None or self.publisher.seq == self._confirmed_seq:
            return True
        seq = self.publisher.seq
        try:
            self._prove_published(self.codec.new_id(), timeout_s)
        except BusUnavailable as exc:
            log.warning("events.unconfirmed", error=str(exc))
            return False
        self._confirmed_seq = seq
        return True

    def _prove_published(self, token: str, timeout_s: float) -> None:
        """Ask the broker to answer once it has seen ``token`` through our PUB, probing until it has."""
        assert self.control is not None and self.publisher is not None
        prove_published(self.control, self.publisher, token, timeout_s)

    def _deliver_ready(self) -> None:
        for subscriber, handler, _ in self._subscriptions:
            while not self._stopping and (message := subscriber.pop()) is not None:
                try:
                    handler(message)
                except Exception:  # one event the role cannot handle must not cost it the stream
                    subscriber.rejected["internal"] += 1
                    log.exception("event.handler_failed", kind=message.kind, src=message.header.src)

    def _drain(self, sock: zmq.Socket, handle: Callable[[int], None], budget: int = 256,
               slice_s: float = 0.005) -> None:
        """Handle what is waiting on ``sock`` (``handle(zmq.NOBLOCK)`` once per message), at most ``budget``
        messages or ``slice_s`` seconds, so other sockets (a version-bump behind a queue of slow requests) get a
        turn. The loop's poll found ``sock`` readable; later messages are asked for with :func:`readable`."""
        deadline = time.monotonic() + slice_s
        for _ in range(budget):
            try:
                handle(zmq.NOBLOCK)
            except zmq.Again:
                break
            if time.monotonic() > deadline or not readable(sock):
                break
        self._deliver_ready()

    def _heartbeat(self) -> None:
        # Not resent: the next heartbeat is due when this one's deadline passes.
        if self.control is not None and self.welcome is not None:
            beat = Heartbeat(node_id=self.node_id, status=self._beat_status(), process=incarnation(self.info()))
            self.calls.request(self.settings.bus, beat, self._on_heartbeat, deadline_s=self.welcome.heartbeat_interval,
                               policy=SEND_ONCE)

    def _beat_status(self) -> dict[str, float]:
        """:attr:`status` as a heartbeat carries it, within the schema's bounds: numbers a role adds (an
        orchestrator's prompt source reports its own) never get the heartbeat refused, which would have the node
        reported down. What is over is left out (names too long, then the numbers past ``MAX_NODE_ENTRIES``),
        logged once."""
        status = self.status()
        if len(status) <= MAX_NODE_ENTRIES and all(len(name) <= MAX_KEY_CHARS for name in status):
            return status
        named = ((name, value) for name, value in status.items() if len(name) <= MAX_KEY_CHARS)
        fitted = dict(itertools.islice(named, MAX_NODE_ENTRIES))
        if not self._status_cut:
            self._status_cut = True
            log.warning("heartbeat.status_cut", numbers=len(status), kept=len(fitted),
                        detail=f"a heartbeat carries at most {MAX_NODE_ENTRIES} numbers named in at most "
                        f"{MAX_KEY_CHARS} characters: the rest are not shown in the registry")
        return fitted

    def _on_heartbeat(self, outcome: Outcome) -> None:
        if isinstance(outcome, RequestTimeout):
            self._heartbeats_unanswered += 1
            if self._heartbeats_unanswered == BROKER_SILENT_BEATS:
                log.warning("bus.silent", bus=self.settings.bus, heartbeats_unanswered=BROKER_SILENT_BEATS,
                            detail="registry lookups and replays fail meanwhile; requests between nodes go on")
            return
        if self._heartbeats_unanswered >= BROKER_SILENT_BEATS:
            log.info("bus.answering", bus=self.settings.bus, heartbeats_unanswered=self._heartbeats_unanswered)
        self._heartbeats_unanswered = 0
        if self.publish_path_lost:
            self._request_rejoin()
        replaced = isinstance(outcome, RemoteError) and outcome.code == "replaced"
        if replaced and not self._replaced:
            # Not re-joined: that would take the id back from the other process, which would take it back in turn.
            # Once that one is gone and expired, the broker answers unknown-node and this process registers again.
            log.error("node.replaced", detail=outcome.detail)
        self._replaced = replaced
        if isinstance(outcome, RemoteError):
            if outcome.code == "unknown-node":
                log.warning("node.forgotten_by_broker", detail=outcome.detail)
                self._request_rejoin()
            elif not replaced:
                log.warning("control.error", code=outcome.code, error=outcome.detail)

    def _request_rejoin(self) -> None:
        self._rejoin = True

    def _run_timers(self) -> int:
        now = time.monotonic()
        while self._timers and self._timers[0].due <= now:
            timer = heapq.heappop(self._timers)
            try:
                timer.callback()
            except Exception:
                log.exception("node.timer_failed")
            if timer.interval is not None:
                timer.due = max(timer.due + timer.interval, now)
                heapq.heappush(self._timers, timer)
        if not self._timers:
            return 1000
        return max(0, int((self._timers[0].due - time.monotonic()) * 1000) + 1)

    def _write_ready_file(self) -> None:
        if not self.settings.ready_file:
            return
        tmp = f"{self.settings.ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(msgspec.to_builtins(self.info()), f)
        os.replace(tmp, self.settings.ready_file)
