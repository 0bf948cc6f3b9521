"""The event stream: a publisher that stamps per-source sequence numbers, a subscriber that finds gaps.

ZeroMQ PUB/SUB drops silently when a subscriber is slow or late. Every event therefore carries its
source's sequence number (1, 2, 3, ...); a subscriber that sees ``seq`` jump counts the missing events and,
when given a ``fill`` function (the broker's replay ring), fetches them and delivers them in order before
the event that revealed the gap. Events from a source seen for the first time set its baseline (a live
subscriber does not want history unless it asks with ``replay``).

Neither class is thread-safe: one owner thread each.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence

import structlog
import zmq

from ..protocol.envelope import Message, WireCodec
from ..protocol.errors import ProtocolError
from ..protocol.messages import Body, Sync

log = structlog.get_logger(__name__)

Fill = Callable[[str, int, int], Sequence[Message]]
"""``fill(src, first_seq, last_seq)`` returns the missing events it could recover, in order."""


def recv_frames(sock: zmq.Socket, flags: int = 0, *, copied: int = 3) -> list:
    """One multipart message; the first ``copied`` frames as bytes, the rest zero-copy ``zmq.Frame``s.

    Small header frames are cheaper as bytes; array frames stay in ZeroMQ's buffer (writable, no copy).
    """
    frames: list = [sock.recv(flags)]
    while sock.rcvmore:
        frames.append(sock.recv(copy=len(frames) < copied))
    return frames


class Publisher:
    """Publishes events from one source with consecutive sequence numbers starting at 1."""

    def __init__(self, sock: zmq.Socket, codec: WireCodec) -> None:
        self.sock = sock
        self.codec = codec
        self.seq = 0

    def publish(self, body: Body) -> int:
        """Send ``body`` as the next event; returns its sequence number. Arrays are sent zero-copy."""
        self.seq += 1
        self.sock.send_multipart(self.codec.encode(body, seq=self.seq), copy=False)
        return self.seq

    def publish_raw(self, body: Body, *, seq: int = 0) -> None:
        """Send without consuming a sequence number (``sync`` probes are not part of the stream)."""
        self.sock.send_multipart(self.codec.encode(body, seq=seq), copy=False)


class Subscriber:
    """Receives events, validates them, tracks per-source sequence numbers and fills gaps.

    Malformed events are counted by error code and logged, never raised: a bad publisher must not stop
    a subscriber. ``sync`` probes are consumed here and recorded in :attr:`tokens`.
    """

    def __init__(self, sock: zmq.Socket, codec: WireCodec, *, fill: Fill | None = None) -> None:
        self.sock = sock
        self.codec = codec
        self.fill = fill
        self.last_seq: dict[str, int] = {}
        self.tokens: set[str] = set()
        self.received = 0
        self.missed = 0  # events detected missing (before any fill)
        self.filled = 0
        self.duplicates = 0
        self.rejected: Counter[str] = Counter()
        self._ready: deque[Message] = deque()
        self._held: list[Message] | None = None

    def recv(self, timeout_ms: int) -> Message | None:
        """The next event in per-source order, or None when nothing arrives within ``timeout_ms``."""
        if self._ready:
            return self._ready.popleft()
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            self.drain_one()
            if self._ready:
                return self._ready.popleft()
            timeout_ms = 0
        return None

    def drain_one(self) -> None:
        """Receive and process one message that is known to be waiting (poller-driven loops)."""
        frames = recv_frames(self.sock)
        try:
            message = self.codec.decode(frames)
        except ProtocolError as exc:
            self.rejected[exc.code] += 1
            log.warning("event.rejected", code=exc.code, error=str(exc))
            return
        if isinstance(message.body, Sync):
            self.tokens.add(message.body.token)
        elif self._held is not None:
            self._held.append(message)
        else:
            self.offer(message)

    def hold(self) -> None:
        """Park incoming events (not yet sequence-checked) while a replay is merged in front of them."""
        self._held = []

    def release(self) -> None:
        """Offer the parked events in arrival order and resume normal delivery."""
        held, self._held = self._held or [], None
        for message in held:
            self.offer(message)

    def pop(self) -> Message | None:
        return self._ready.popleft() if self._ready else None

    def offer(self, message: Message) -> bool:
        """Apply sequence tracking to ``message``; queue it for delivery unless it is a duplicate."""
        src, seq = message.header.src, message.header.seq
        last = self.last_seq.get(src)
        if last is not None and seq <= last:
            if seq == 1:
                log.info("event.source_restarted", src=src, last_seq=last)
            else:
                self.duplicates += 1
                return False
        elif last is not None and seq > last + 1:
            self._gap(src, last + 1, seq - 1)
        self.last_seq[src] = seq
        self.received += 1
        self._ready.append(message)
        return True

    def _gap(self, src: str, first: int, last: int) -> None:
        self.missed += last - first + 1
        recovered = list(self.fill(src, first, last)) if self.fill else []
        for message in recovered:
            if first <= message.header.seq <= last:
                self.received += 1
                self.filled += 1
                self._ready.append(message)
        if len(recovered) < last - first + 1:
            log.warning("event.gap", src=src, first=first, last=last, recovered=len(recovered))
