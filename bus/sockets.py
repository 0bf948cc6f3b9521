"""Socket factory: every refbus socket is made here, with its options chosen on purpose.

* ``LINGER = 0``: closing never blocks on unsent messages; ownership moves are acknowledged and retried
  at the application level, so nothing relies on ZeroMQ flushing at close.
* High-water marks: control and request sockets keep ZeroMQ's 1000; the event path is raised
  (``EVENT_HWM``) because a subscriber that falls behind catches up from the broker's replay ring.
* ``ROUTER_MANDATORY``: a reply to a peer that is gone raises instead of vanishing silently.
* ZeroMQ heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``) on connection-oriented sockets, so dead TCP peers are
  noticed even when no application traffic flows.
* ``MAXMSGSIZE``: a hard per-frame cap, so a peer cannot make us allocate without bound. Frames per message
  are capped on receipt (``MAX_FRAMES``): ZeroMQ has no such option, so :func:`recv_frames` and its siblings
  read a longer message off the socket without keeping its frames and raise :class:`TooManyFrames`.
* ``RECONNECT_IVL_MAX``: reconnecting to a peer that is gone backs off to about one attempt a second instead
  of ZeroMQ's fixed 100 ms.
* CURVE (``SocketOptions.curve``): bound sockets serve with the cluster's server key and admit clients through
  the node's ZAP handler; connecting sockets use the node's own key pair (:mod:`.security`).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ..protocol.errors import MalformedMessage
from ..protocol.messages import MAX_FRAMES
from .security import HOST_SCHEMES, Curve, apply_curve, peer_id

EVENT_HWM = 100_000
COPY_BELOW = 64 * 1024  # frames smaller than this are copied into ZeroMQ: cheaper than tracking a zero-copy
_SNDMORE = int(zmq.SNDMORE)  # pyzmq's enum arithmetic costs ~0.6 us per frame on the hot path
# pyzmq's compiled send and recv, without the Python-level ``Socket.send`` in front (it only adds the draft
# API's routing_id and group, which refbus never uses): ~1.5 us less per frame sent.
_zmq_send = zmq.backend.Socket.send
_zmq_recv = zmq.backend.Socket.recv
_POLLIN = int(zmq.POLLIN)
# ZeroMQ retries a dropped or refused connection every RECONNECT_IVL (100 ms) for ever by default. A node
# restarted under ``refbus up`` binds a new ephemeral port, so a socket to its old endpoint would try a dead
# port ten times a second until it is closed: the interval doubles up to this cap instead (plus ZeroMQ's
# jitter of up to 100 ms). The cap is one default heartbeat interval, not more: a broker restarted on its
# old address must still be reached within about a heartbeat, as the nodes' re-join promises (with a shorter
# heartbeat, within this cap: a peer tracker's check for peers that never re-joined waits it out too).
RECONNECT_IVL_MAX_MS = 1000


@dataclass(frozen=True)
class SocketOptions:
    sndhwm: int = 1000
    rcvhwm: int = 1000
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    max_frame_bytes: int = -1
    curve: Curve | None = None  # None: plain text, nobody authenticated


DEFAULT_OPTIONS = SocketOptions()
EVENT_OPTIONS = SocketOptions(sndhwm=EVENT_HWM, rcvhwm=EVENT_HWM)


class CannotBind(RuntimeError):
    """A bind (a socket's, or the metrics endpoint's) the operating system refused for a reason that can clear by
    itself (an address not yet this machine's, another process's), or a metrics host name that does not resolve
    (a name server may answer later): the message names the address and why. ``refbus node`` exits 1 on it,
    restartable."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"cannot bind {address}: {why}")


class BindRefused(CannotBind):
    """A bind the operating system refuses for a reason that cannot clear by itself (:data:`REFUSED_BIND_ERRNOS`):
    only the configuration can cure it, so ``refbus node`` exits with the config status (2, final: never
    restarted to be refused again). The message names the address and why."""


# Why the operating system refuses a bind: a message, not a traceback. One that can clear by itself: an address
# not (yet) assigned to this machine (an interface still coming up, a floating address on its way over), an
# interface or host name ZeroMQ finds no device for (ENODEV: an interface not up yet, a name server that does
# not answer now; as a metrics host name that does not resolve).
CLEARING_BIND_ERRNOS = frozenset({errno.EADDRNOTAVAIL, errno.ENODEV})
# One that cannot: a privileged port without the right to it (EACCES, EPERM), an ipc path in a directory that
# does not exist (ENOENT; nothing of refbus makes it) or this user may not write (EACCES).
REFUSED_BIND_ERRNOS = frozenset({errno.EACCES, errno.ENOENT, errno.EPERM})


class AddressInUse(CannotBind):
    """A bind to an address another process holds: a second cluster on the same ports, most often. The message
    says so and what to change."""

    def __init__(self, address: str) -> None:
        super().__init__(address, "another process holds that address (another refbus cluster on this host? give "
                         "this one other ports in its config)")


def bind_error(address: str, code: int | None, why: str) -> CannotBind | None:
    """What to raise for a bind to ``address`` the operating system refused with errno ``code`` (``why``: its
    words): :class:`AddressInUse`, :class:`BindRefused` for a reason that cannot clear by itself,
    :class:`CannotBind` for one that can; None for any other errno (the caller re-raises what it caught)."""
    if code == errno.EADDRINUSE:
        return AddressInUse(address)
    if code in REFUSED_BIND_ERRNOS:
        return BindRefused(address, why)
    if code in CLEARING_BIND_ERRNOS:
        return CannotBind(address, why)
    return None


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    options: SocketOptions = DEFAULT_OPTIONS,
) -> zmq.Socket:
    """A socket with refbus's options, bound or connected. The caller owns and closes it. Raises, for a bind the
    operating system refuses (:func:`bind_error`): :class:`AddressInUse` for an address another process holds,
    :class:`BindRefused` for a reason only the configuration can cure, :class:`CannotBind` for one that can clear
    by itself."""
    sock = ctx.socket(socket_type)
    sock.linger = 0
    sock.sndhwm = options.sndhwm
    sock.rcvhwm = options.rcvhwm
    sock.setsockopt(zmq.HEARTBEAT_IVL, options.heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, options.heartbeat_timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_frame_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if options.curve is not None:
        apply_curve(sock, options.curve, server=bind is not None)
    try:
        if bind is not None:
            sock.bind(wildcard_port(bind))
        if connect is not None:
            sock.connect(connect)
    except zmq.ZMQError as exc:
        sock.close()
        refused = bind_error(bind, exc.errno, exc.strerror) if bind is not None else None
        if refused is not None:
            raise refused from None
        raise
    return sock


ENDPOINT_SCHEMES: tuple[str, ...] = ("tcp", "ipc", *sorted(HOST_SCHEMES - {"tcp"}))
"""The transports a cluster's endpoints may use: those the processes of a cluster reach each other over with
the socket types refbus uses (ROUTER, DEALER, PUB, SUB, XPUB, XSUB); not ``inproc`` (one process only), nor
the multicast and datagram ones (other socket types)."""

_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def host_problem(host: str, *, in_endpoint: bool = False) -> str:
    """What is wrong with ``host`` as a host name or IP address; empty when nothing is. ``in_endpoint``: the
    host of a ZeroMQ endpoint, which may also be ``*`` (every interface) or an IPv6 address in brackets."""
    literal = host[1:-1] if in_endpoint and host.startswith("[") and host.endswith("]") else host
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(literal.split("%", 1)[0])  # an IPv6 address may name its zone
        return ""
    if (in_endpoint and host == "*") or (len(host) <= 253 and _HOST_NAME.fullmatch(host)):
        return ""
    return f"{host!r} is not a host name or IP address" + (" (nor *)" if in_endpoint else "")


def endpoint_problem(endpoint: str) -> str:
    """What is wrong with ``endpoint`` as a cluster endpoint (empty when nothing is): ``ipc://PATH``, or
    ``tcp://HOST:PORT`` (``ws``/``wss``: then an optional ``/path``) with a host :func:`host_problem` accepts,
    ``*`` included, and a port from 0 to 65535 or ``*`` (0 and ``*``: an ephemeral one, for a bind; ZeroMQ's
    form is ``*``, :func:`wildcard_port`). ZeroMQ would refuse what is wrong only where a node binds or connects
    it, or take a port above 65535 modulo 65536."""
    scheme, separator, address = endpoint.partition("://")
    if not separator or scheme not in ENDPOINT_SCHEMES:
        return (f"{endpoint!r} is not an endpoint transport://address with transport "
                f"{', '.join(ENDPOINT_SCHEMES[:-1])} or {ENDPOINT_SCHEMES[-1]}")
    if scheme == "ipc":
        return "" if address else f"{endpoint!r} names no path"
    if scheme != "tcp":
        address = address.split("/", 1)[0]
    host, colon, port = address.rpartition(":")
    if not colon or (port != "*" and (not (port.isascii() and port.isdigit()) or int(port) > 65_535)):
        return f"{endpoint!r} has no port from 0 to 65535 or * (write {scheme}://host:port)"
    return host_problem(host, in_endpoint=True)


def connect_problem(endpoint: str) -> str:
    """What is wrong with ``endpoint`` as one peers connect to (empty when nothing is): a cluster endpoint
    (:func:`endpoint_problem`) naming one address, not a bind's wildcard host (``*``) or ephemeral port (0, ``*``),
    which a node binds but advertises resolved."""
    if problem := endpoint_problem(endpoint):
        return problem
    scheme, _, address = endpoint.partition("://")
    if scheme == "ipc":
        return ""
    host, _, port = (address if scheme == "tcp" else address.split("/", 1)[0]).rpartition(":")
    if host == "*" or port in ("*", "0"):
        return f"{endpoint!r} is a wildcard to bind, not an address to connect to"
    return ""


def wildcard_port(endpoint: str) -> str:
    """Accept ``tcp://host:0`` as ZeroMQ's ephemeral-port form ``tcp://host:*``."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket actually bound (resolves ephemeral ports)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def advertised(endpoint: str, host: str) -> str:
    """What peers should connect to for a bound endpoint: wildcard hosts replaced by ``host``."""
    for wildcard in ("://0.0.0.0:", "://*:", "://[::]:"):
        if wildcard in endpoint:
            return endpoint.replace(wildcard, f"://{host}:")
    return endpoint



def remove_ipc_file(endpoint: str) -> None:
    """Remove the socket file of an ``ipc://`` endpoint this process bound (ZeroMQ leaves it behind)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path and not path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class FrameCounter:
    """Array frames this process has received, on any socket (metrics; the orchestrator's proof that it
    never receives array bytes)."""

    frames = 0
    nbytes = 0


class TooManyFrames(MalformedMessage):
    """A message of more than ``MAX_FRAMES`` frames, read off the socket whole (ZeroMQ delivers a multipart
    message whole, so what follows is the next message) without keeping its frames past the cap. ``head``: its
    first frames as bytes (at most the receive's ``copied``), enough to read the id of the request it was;
    ``identity``: the sender's routing id on a ROUTER (:func:`recv_routed`), else empty."""

    def __init__(self, count: int, head: list[bytes]) -> None:
        super().__init__(f"message of {count} frames, at most {MAX_FRAMES}: refused unread")
        self.head = head
        self.identity = b""


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message: small frames copied, large ones zero-copy (ZeroMQ keeps a reference to
    their memory until sent, so the caller must not modify it before)."""
    flags = int(flags)
    last = len(frames) - 1
    if not last:  # one frame (an event, a request or reply without arrays): no loop
        frame = frames[0]
        _zmq_send(sock, frame, flags, len(frame) < COPY_BELOW)
        return
    more = flags | _SNDMORE
    for index, frame in enumerate(frames):
        _zmq_send(sock, frame, flags if index == last else more, len(frame) < COPY_BELOW)


def readable(sock: zmq.Socket, timeout_ms: int = 0) -> bool:
    """Whether a message is waiting on ``sock``, or arrives within ``timeout_ms``: a zero-timeout poll (~3 us),
    where a NOBLOCK receive that finds nothing raises ``zmq.Again`` (~8 us), so drain loops ask this before
    each receive but the first. ``zmq_poll`` itself: ``Socket.poll`` builds a ``Poller`` and a dict around it
    (~0.7 us more)."""
    return bool(zmq.zmq_poll([(sock, _POLLIN)], timeout_ms))


def recv_frames(sock: zmq.Socket, flags: int = 0, *, copied: int = 3) -> list[Any]:
    """One multipart message; the first ``copied`` frames as bytes, the rest zero-copy ``zmq.Frame``s.

    Small header frames are cheaper as bytes; array frames stay in ZeroMQ's buffer (writable, no copy).
    Raises ``zmq.Again`` when ``flags`` has NOBLOCK and nothing is waiting, :class:`TooManyFrames` for a message
    of more than ``MAX_FRAMES`` frames (read off the socket all the same: the next receive gets the next one).
    """
    frame = _zmq_recv(sock, flags, False)
    if not frame.more:  # the common message (an event, most requests and replies): one frame
        return [frame.bytes]
    return _recv_rest(sock, frame, copied)[0]


def recv_from(sock: zmq.Socket, flags: int = 0, *, copied: int = 3) -> tuple[list[Any], str]:
    """:func:`recv_frames` on a CURVE socket, with the node id its ZAP handler bound to the sender's
    connection ("" when none did)."""
    frames, last = _recv_rest(sock, _zmq_recv(sock, flags, False), copied)
    return frames, peer_id(last)


def recv_routed(sock: zmq.Socket, flags: int = 0, *, copied: int = 3) -> tuple[bytes, list[Any], zmq.Frame]:
    """One message on a ROUTER: the sender's routing id, then the frames it sent as :func:`recv_frames` gives
    them, and the last frame (whose metadata a CURVE socket's ZAP handler bound, see :func:`peer_id`)."""
    # ZeroMQ always follows a ROUTER's routing id with the message, so it is received as bytes without a
    # Frame: reading whether more follows costs ~2 us either way (Frame.more or the RCVMORE option).
    identity = _zmq_recv(sock, flags)
    try:
        frames, last = _recv_rest(sock, _zmq_recv(sock, 0, False), copied)
    except TooManyFrames as exc:
        exc.identity = identity  # a server answers the refusal to its sender
        raise
    return identity, frames, last


def _recv_rest(sock: zmq.Socket, frame: zmq.Frame, copied: int) -> tuple[list[Any], zmq.Frame]:
    """The message whose first frame is ``frame``, and its last frame; :class:`TooManyFrames` past
    ``MAX_FRAMES``."""
    frames: list[Any] = [frame.bytes]
    while frame.more:  # Frame.more is cheap; the RCVMORE socket option costs ~2 us per frame
        frame = _zmq_recv(sock, 0, False)
        held = len(frames)
        if held < copied:
            frames.append(frame.bytes)
        elif held < MAX_FRAMES:
            FrameCounter.frames += 1
            FrameCounter.nbytes += len(frame)
            frames.append(frame)
        else:
            count = held + 1 + (discard_rest(sock) if frame.more else 0)
            raise TooManyFrames(count, frames[:copied])
    return frames, frame


def discard_rest(sock: zmq.Socket) -> int:
    """Read the rest of the message being received on ``sock`` (more frames follow) without keeping it: one frame
    held at a time, however many there are. Returns how many frames were read."""
    count = 0
    more = True
    while more:
        more = _zmq_recv(sock, 0, False).more
        count += 1
    return count
