"""The broker's event forwarding in ZeroMQ's own C loop: no Python on the per-event path.

A :class:`Forwarder` runs ``zmq_proxy`` between the broker's XSUB (``events_in``) and XPUB (``events_out``) on
a thread of its own (the call releases the GIL): events go from publishers to subscribers unchanged, and
subscriptions go back upstream. Every message also goes, as a copy, to a capture PUB on ``inproc``; the
broker's loop thread drains one SUB of it in batches into the replay ring (:meth:`drain`) and another,
subscribed to the ``sync`` kind only, into the ``sync`` handshake (:meth:`drain_probes`). The capture never
blocks the proxy: a capture that falls ``CAPTURE_HWM`` messages behind loses copies (the ring misses them, and
a subscriber whose gap fill needs them counts them lost), never events.

The broker's own events (``node-up``, ``node-down``, the subscribers' ``sync`` probes) enter through an
``inproc`` PUB connected to the same XSUB, so they reach subscribers and the ring the way every node's do.

Nothing here reads an event: the kind, header, MAC and size checks are the subscribers' (they verify every
event end to end), the ring indexes events by source and sequence only when a replay asks. The one check is
the frame count: a captured message of more than ``MAX_FRAMES`` frames is read off and dropped, never kept
(subscribers refuse it the same way).

Sockets: the XSUB and XPUB are bound by the caller (the runtime); this module binds its inproc endpoints on
them before the proxy starts, and owns the capture pair, the own-events PUB and the proxy's control pair. After
:meth:`start` only the proxy thread touches the XSUB and XPUB, until :meth:`stop` has joined it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

import structlog
import zmq

from ..protocol.envelope import MAX_KIND_BYTES, ONE_FRAME_MARK
from ..protocol.messages import MAX_FRAMES, Sync
from .sockets import EVENT_HWM, TooManyFrames, discard_rest, recv_frames

log = structlog.get_logger(__name__)

CAPTURE_HWM = 4 * EVENT_HWM  # copies queued for the ring before the capture drops them
SUBSCRIBE_ALL = b"\x01"
NOBLOCK = int(zmq.NOBLOCK)  # pyzmq's enum arithmetic costs on the per-message path
RCVMORE = int(zmq.RCVMORE)
START_PROBE = b"\x02refbus-forwarder-probe"  # not an event: a kind never starts with a control byte
_names = itertools.count()
# What a kept message of several frames costs per frame besides its bytes: a ``zmq.Frame`` and its list slot
# (~190 bytes measured). Charged against the ring's byte bound, so frames without bytes cannot fill memory under it.
HELD_FRAME_BYTES = 256


def held_bytes(frames: list, size: int) -> int:
    """What the ring charges for keeping ``frames`` (a message of several frames, ``size`` bytes of them)."""
    return size + HELD_FRAME_BYTES * len(frames)


def is_event(first_frame: bytes) -> bool:
    """Whether a captured message is an event: subscription messages (``\\x00``/``\\x01`` + topic) and the
    start probe begin with a control byte; an event begins with its ASCII kind."""
    return bool(first_frame) and first_frame[0] > 0x1F


class Forwarder:
    """``zmq_proxy`` from ``xsub`` to ``xpub`` on its own thread, a capture for the ring, and a PUB for the
    broker's own events. ``ctx`` must be the context of ``xsub`` and ``xpub`` (inproc endpoints are per
    context); ``signed``: the cluster signs messages (a MAC frame ends each); ``dropped``: where captured
    messages it drops are counted, by reason (the broker's counter)."""

    def __init__(self, ctx: zmq.Context, xsub: zmq.Socket, xpub: zmq.Socket, *, signed: bool,
                 dropped: Counter[str]) -> None:
        self.ctx = ctx
        self.signed = signed  # events carry a MAC frame: no message is one frame by its first frame alone
        self.dropped = dropped
        self.xsub = xsub
        self.xpub = xpub
        name = f"refbus-forwarder-{next(_names)}-{id(self):x}"
        own_in, capture_at, control_at = (f"inproc://{name}-{part}" for part in ("own", "capture", "control"))
        xsub.bind(own_in)
        xsub.send(SUBSCRIBE_ALL)  # the ring sees every event, whether or not anyone subscribes
        self.capture_pub = self._socket(zmq.PUB, bind=capture_at, hwm=CAPTURE_HWM)
        self.capture = self._socket(zmq.SUB, connect=capture_at, hwm=CAPTURE_HWM)
        self.capture.setsockopt(zmq.SUBSCRIBE, b"")
        self.probes = self._socket(zmq.SUB, connect=capture_at, hwm=EVENT_HWM)
        self.probes.setsockopt(zmq.SUBSCRIBE, Sync.kind.encode())  # both forms start with the kind
        self.own = self._socket(zmq.PUB, connect=own_in, hwm=EVENT_HWM)
        self._control_end = self._socket(zmq.PAIR, bind=control_at)
        self._control = self._socket(zmq.PAIR, connect=control_at)
        self._thread: threading.Thread | None = None

    def _socket(self, kind: int, *, bind: str = "", connect: str = "", hwm: int = 1000) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = hwm
        if bind:
            sock.bind(bind)
        if connect:
            sock.connect(connect)
        return sock

    def start(self, timeout_s: float) -> None:
        """Start the proxy, then wait until the own-events PUB is live through it (its subscription from the
        XSUB arrived): the broker's first event must not vanish. Raises ``TimeoutError`` after ``timeout_s``."""
        self._thread = threading.Thread(target=self._proxy, name="refbus-forwarder", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.own.send(START_PROBE)
            if self.capture.poll(10, zmq.POLLIN):
                while self.capture.poll(0, zmq.POLLIN):
                    if self.capture.recv_multipart()[0] == START_PROBE:
                        return
        raise TimeoutError(f"the broker's own events did not come through its forwarder within {timeout_s}s")

    def _proxy(self) -> None:
        try:
            zmq.proxy_steerable(self.xsub, self.xpub, self.capture_pub, self._control_end)
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:  # the broker cannot forward any more: say so where operators look
            log.error("forwarder.failed", error=str(exc))

    def drain(self, on_events: Callable[[list, list[int]], None], budget: int = 4096) -> int:
        """Hand what the capture holds, at most ``budget`` messages, to ``on_events(entries, sizes)``: each
        entry one frame (``bytes``) or a list of frames, with its size in bytes. Control messages
        (subscriptions, start probes: :func:`is_event` tells them) come along, rare as they are: reading each
        message's first byte here would cost every event. Returns how many messages were read (loop thread
        only).

        Per message this is one ``recv`` and two appends. An unsigned one-frame event is told by its first
        frame alone (the kind ends in a NUL, which the multi-frame form's kind frame never holds; an
        unsigned batch, one frame too, holds one in its first lengths), so only other messages pay for asking
        ZeroMQ whether more frames follow. A sender that breaks that rule
        splits its own message into entries no replay can read (skipped and counted), nobody else's.

        A message of more than ``MAX_FRAMES`` frames is read off and dropped (counted in ``dropped`` as
        ``malformed``, logged); a kept message of several frames is sized with :func:`held_bytes`."""
        recv, more = self.capture.recv, self.capture.get
        trust_mark = not self.signed
        entries: list = []
        sizes: list[int] = []
        keep, size_of = entries.append, sizes.append
        count = 0
        for count in range(1, budget + 1):
            try:
                first = recv(NOBLOCK)
            except zmq.Again:
                count -= 1
                break
            if (trust_mark and first.find(ONE_FRAME_MARK, 0, MAX_KIND_BYTES) >= 0) or not more(RCVMORE):
                keep(first)
                size_of(len(first))
                continue
            frames = [first]
            size = len(first)
            while more(RCVMORE):
                if len(frames) == MAX_FRAMES:
                    self._drop(first, MAX_FRAMES + discard_rest(self.capture))
                    break
                frame = recv(copy=False)  # array frames stay in ZeroMQ's buffer
                frames.append(frame)
                size += len(frame)
            else:
                entries.append(frames)
                sizes.append(held_bytes(frames, size))
        if entries:
            on_events(entries, sizes)
        return count

    def _drop(self, first: bytes, count: int) -> None:
        """A captured message of ``count`` frames, more than ``MAX_FRAMES``: read off already, not kept."""
        error = TooManyFrames(count, [first])
        self.dropped[error.code] += 1
        log.warning("event.dropped", code=error.code, kind=first[:MAX_KIND_BYTES], error=str(error))

    def drain_probes(self, on_probe: Callable[[list], None], budget: int = 256) -> None:
        """Hand each captured ``sync`` probe (frames as bytes) to ``on_probe`` (loop thread only). A message of
        more than ``MAX_FRAMES`` frames is read off and skipped: the capture's :meth:`drain` counts it."""
        for _ in range(budget):
            try:
                frames = recv_frames(self.probes, NOBLOCK)
            except zmq.Again:
                return
            except TooManyFrames:
                continue
            on_probe(frames)

    def stop(self) -> None:
        """End the proxy and close this module's sockets (the caller closes the XSUB and XPUB after)."""
        if self._thread is not None:
            self._control.send(b"TERMINATE")
            self._thread.join()
            self._thread = None
        for sock in (self.own, self.capture, self.probes, self.capture_pub, self._control, self._control_end):
            sock.close()
