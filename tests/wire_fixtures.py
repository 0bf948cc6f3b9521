"""Fixtures and helpers for the in-process wire and bus tests (test_codec, test_envelope, test_reqrep,
test_pubsub): a ZeroMQ context per test, socket pairs on loopback tcp with ephemeral ports, and a request
server serviced by a background thread that owns its socket.

Test modules load this with ``pytest_plugins = ["wire_fixtures"]``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import zmq
from refbus.bus.reqrep import Server
from refbus.bus.sockets import DEFAULT_OPTIONS, SocketOptions, bound_endpoint, make_socket
from refbus.protocol.envelope import Limits, WireCodec

LOOPBACK = "tcp://127.0.0.1:0"
WAIT_MS = 5000  # upper bound for anything that should arrive promptly on loopback


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    """A fresh context; every socket still open at teardown is closed (linger 0) and the context termed."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


SocketFactory = Callable[..., zmq.Socket]


@pytest.fixture
def sockets(zmq_ctx: zmq.Context) -> Iterator[SocketFactory]:
    """``sockets(type, bind=..., connect=...)``: a refbus socket closed at teardown."""
    made: list[zmq.Socket] = []

    def make(socket_type: int, *, options: SocketOptions = DEFAULT_OPTIONS, **kwargs: object) -> zmq.Socket:
        sock = make_socket(zmq_ctx, socket_type, options=options, **kwargs)  # type: ignore[arg-type]
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


PairFactory = Callable[..., tuple[zmq.Socket, zmq.Socket, str]]


@pytest.fixture
def bound_pair(sockets: SocketFactory) -> PairFactory:
    """``bound_pair(bind_type, connect_type)``: (bound socket, connected socket, resolved endpoint).

    The bound side listens on ``tcp://127.0.0.1:0``; a SUB on the connected side subscribes to everything.
    """

    def make(
        bind_type: int, connect_type: int, *, options: SocketOptions = DEFAULT_OPTIONS
    ) -> tuple[zmq.Socket, zmq.Socket, str]:
        bound = sockets(bind_type, bind=LOOPBACK, options=options)
        endpoint = bound_endpoint(bound)
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        connected = sockets(connect_type, connect=endpoint, options=options)
        if connect_type == zmq.SUB:
            connected.setsockopt(zmq.SUBSCRIBE, b"")
        return bound, connected, endpoint

    return make


class ServerThread:
    """A :class:`Server` on a ROUTER bound to loopback tcp, serviced by a thread that owns the socket.

    ``setup(server)`` registers handlers on the thread. Exceptions escaping ``handle_one`` (which must
    never happen for anything a peer sends) are recorded in :attr:`errors` and serving continues.
    """

    def __init__(
        self, ctx: zmq.Context, setup: Callable[[Server], None], *, limits: Limits | None = None, secret: bytes = b""
    ) -> None:
        self.ctx = ctx
        self.setup = setup
        self.limits = limits
        self.secret = secret
        self.server: Server | None = None
        self.endpoint = ""
        self.errors: list[BaseException] = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(WAIT_MS / 1000), "server thread did not start"
        assert not self.errors, f"server setup failed: {self.errors!r}"
        return self

    def _run(self) -> None:
        sock = make_socket(self.ctx, zmq.ROUTER, bind=LOOPBACK)
        try:
            self.server = Server(sock, WireCodec("srv", limits=self.limits, secret=self.secret))
            self.setup(self.server)
            self.endpoint = bound_endpoint(sock)
        except BaseException as exc:  # reported by start()
            self.errors.append(exc)
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(20, zmq.POLLIN):
                    try:
                        self.server.handle_one()
                    except Exception as exc:
                        self.errors.append(exc)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_MS / 1000)
        assert not self._thread.is_alive(), "server thread did not stop"


@pytest.fixture
def serve(zmq_ctx: zmq.Context) -> Iterator[Callable[..., ServerThread]]:
    """``serve(setup, limits=..., secret=..., tolerate_errors=False)``: a started :class:`ServerThread`.

    At teardown the thread is stopped and joined; unless ``tolerate_errors``, any exception that escaped
    ``handle_one`` fails the test.
    """
    started: list[tuple[ServerThread, bool]] = []

    def start(setup: Callable[[Server], None], *, tolerate_errors: bool = False, **kwargs: object) -> ServerThread:
        thread = ServerThread(zmq_ctx, setup, **kwargs)  # type: ignore[arg-type]
        started.append((thread, tolerate_errors))
        return thread.start()

    yield start
    for thread, _ in started:
        thread.stop()
    for thread, tolerate in started:
        assert tolerate or not thread.errors, f"Server.handle_one raised: {thread.errors!r}"
