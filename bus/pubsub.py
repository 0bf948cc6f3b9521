"""The event stream: a publisher that stamps per-source sequence numbers, a subscriber that finds gaps.

ZeroMQ PUB/SUB drops silently when a subscriber is slow or late. Every event therefore carries its
source's sequence number (1, 2, 3, ...); a subscriber that sees ``seq`` jump counts the missing events and,
when given a ``fill`` function (the broker's replay ring), fetches them and delivers them in order before
the event that revealed the gap. Events from a source seen for the first time set its baseline (a live
subscriber does not want history unless it asks with ``replay``).

Sequence state is kept per source *incarnation* (the sender-process part of the message id) and changes only
for events whose MAC verified (:meth:`WireCodec.decode_header` checks it first), so a forged event cannot
move a sequence. An event that arrives on the socket at or below what its incarnation already *sent through the
socket* is a replay (PUB/SUB never repeats one): refused as ``replay`` and counted. One the ring delivered first (a
gap fill, a ``--since`` merge, a resumption after a broker restart, which takes the whole new ring while the live
copies of its newest events still wait in the socket's queue), and the ring's copy of one already delivered, are
ordinary duplicates. A new incarnation of a known source is a restart: it starts a new
sequence without a gap; gap fills take only the missing events' own incarnation.

A batch (several events of one source in one message, what a node's loop turn publishes) is read whole or
refused whole, and each of its events is tracked as if it came alone.

A ``sync`` probe carries its sender's latest sequence number, so the tail of a stream (lost with no later
event to reveal the gap) is a gap too. A publisher holds its most recent events: after a broker restart, or
after its publish path broke, the runtime hands them to the broker's ring (``refill``) before its probes go
out, so the gaps they reveal are filled rather than counted lost. The ring may then hold an event twice, or
a source's events out of order: fills take each sequence number once, in order.

Neither class is thread-safe: one owner thread each.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence

import structlog
import zmq

from ..protocol.codec import ArrayBackend
from ..protocol.envelope import BatchItem, Message, WireCodec, incarnation
from ..protocol.errors import ProtocolError
from ..protocol.messages import Body, Sync
from .sockets import TooManyFrames, readable, recv_frames, send_frames

log = structlog.get_logger(__name__)

SYNC = Sync.kind
SYNC_KIND = SYNC.encode()
NOBLOCK = int(zmq.NOBLOCK)  # pyzmq's enum arithmetic costs on the per-event path
DRAIN_BUDGET = 256  # messages processed per Subscriber.recv that finds nothing ready

Fill = Callable[[str, str, int, int], Sequence[Message]]
"""``fill(src, incarnation, first_seq, last_seq)`` returns the missing events it could recover, in order."""

# Per-(source, incarnation) sequences remembered, and per-source state (latest incarnation and sequence number,
# events lost), each least recently seen forgotten first. As many sources as incarnations: a source is seen
# whenever one of its incarnations is, so a source is forgotten only once none of its sequences is left.
MAX_INCARNATIONS = 4096
# What a publisher holds for a refill: a broker restart (detected at the next heartbeat) plus a few seconds of
# events at a busy node's rate; the restarted broker's ring takes every node's refill.
KEEP_EVENTS = 4096
KEEP_BYTES = 8 << 20
BATCH_EVENTS = 64  # events a node's loop turn sends in one message, at most (the broker's default)
# About this many bytes of events in one message, at most. High-water marks count messages, so this bounds
# what a stalled subscriber's queue can hold: EVENT_HWM batches of it, where one event a message held as many
# messages of ~200 B.
BATCH_BYTES = 16 << 10


def in_source_order(events: list[Message]) -> list[Message]:
    """``events`` with each source incarnation's own events sorted by sequence number in the places they held
    (the order between sources is kept): a publisher's refill lands in a ring after its newer events."""
    places: dict[tuple[str, str], list[int]] = {}
    for place, message in enumerate(events):
        places.setdefault((message.header.src, incarnation(message.header.id)), []).append(place)
    ordered = list(events)
    for spots in places.values():
        for place, message in zip(spots, sorted((events[i] for i in spots), key=lambda m: m.header.seq),
                                  strict=True):
            ordered[place] = message
    return ordered


class Publisher:
    """Publishes events from one source with consecutive sequence numbers starting at 1, and holds its most
    recent events (at least the last ``keep_events`` within about ``keep_bytes``, whole messages) so it can
    hand them to a broker whose ring lost them (:meth:`held`): a broker that died, or one this publisher's
    connection to broke.

    Inside :meth:`batching` (a node's loop turn), events without arrays wait and go out together when it
    ends: consecutive events of one kind, up to ``batch_events`` of them and about ``BATCH_BYTES``, as one
    message in the batch form (see :mod:`refbus.protocol.envelope`). ``batch_events=1`` sends each event
    alone, which subscribers older than protocol 2.2 need."""

    def __init__(self, sock: zmq.Socket, codec: WireCodec, *, keep_events: int = KEEP_EVENTS,
                 keep_bytes: int = KEEP_BYTES, batch_events: int = 1) -> None:
        if batch_events < 1:
            raise ValueError(f"batch_events must be at least 1, got {batch_events}")
        self.sock = sock
        self.codec = codec
        self.seq = 0
        self.keep_bytes = keep_bytes
        self.batch_events = batch_events
        self.messages = 0  # messages sent (a batch is one)
        self._keep_events = keep_events
        self._kept: deque[tuple[list[bytes], int, int]] = deque()  # (frames, size, events), oldest first
        self._kept_bytes = 0
        self._kept_events = 0
        self._waiting: list[tuple[str, BatchItem]] = []  # (kind, batch item) not sent yet, in order
        self._waiting_bytes = 0
        self._depth = 0  # batching() contexts open

    def publish(self, body: Body) -> int:
        """Send ``body`` as the next event (one frame when it has no arrays), or, inside :meth:`batching`,
        queue it for the batch; returns its sequence number. Arrays are sent at once, zero-copy, after what
        waits (the copy held for a refill is made here). A body that cannot be encoded raises and takes no
        sequence number: a number taken and never sent would be a gap every subscriber counts lost."""
        seq = self.seq + 1
        if self._depth and self.batch_events > 1:
            item = self.codec.batch_item(body, seq)
            if item is not None:
                self.seq = seq
                size = len(item[1])
                if self._waiting_bytes + size > BATCH_BYTES:  # a batch every receiver takes: bounded in bytes
                    self.flush()
                self._waiting.append((body.kind, item))
                self._waiting_bytes += size
                if len(self._waiting) >= self.batch_events:
                    self.flush()
                return seq
        frames = self.codec.encode(body, seq=seq, one_frame=True)
        self.seq = seq
        if self._waiting:
            self.flush()  # what waits goes first
        self._send(frames)
        return seq

    @contextlib.contextmanager
    def batching(self) -> Iterator[None]:
        """Events published inside wait and go out in batches when it ends (:meth:`flush`); inside another
        ``batching``, when the outermost ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.flush()

    def flush(self) -> None:
        """Send what waits for a batch: runs of one kind, in publishing order, at most ``batch_events`` each.
        A send that fails leaves what it had not sent waiting, in order, for the next flush or publish."""
        waiting = self._waiting
        if not waiting:
            return
        encode_batch, most = self.codec.encode_batch, max(1, self.batch_events)
        start = 0
        try:
            for end in range(1, len(waiting) + 1):
                if end == len(waiting) or waiting[end][0] != waiting[start][0] or end - start == most:
                    self._send(encode_batch(waiting[start][0], [item for _, item in waiting[start:end]]),
                               end - start)
                    start = end
        finally:
            del waiting[:start]
            self._waiting_bytes = sum(len(item[1]) for _, item in waiting)

    def publish_raw(self, body: Body) -> None:
        """Send a ``sync`` probe: it consumes no sequence number, and carries the latest one (see
        :class:`~refbus.protocol.messages.Sync`), so a subscriber learns of a tail it lost; what waits for a
        batch goes first."""
        self.flush()
        send_frames(self.sock, self.codec.encode(body, seq=self.seq))

    def held(self) -> list[tuple[list[bytes], int]]:
        """The messages held for a refill, oldest first: each one's frames as first sent and how many events
        it holds (what waits for a batch is sent first, so every event numbered so far is in one)."""
        self.flush()
        return [(frames, events) for frames, _, events in self._kept]

    def _send(self, frames: list, events: int = 1) -> None:
        send_frames(self.sock, frames)
        self.messages += 1
        self._keep(frames, events)

    def _keep(self, frames: list, events: int) -> None:
        """Hold a sent message; the oldest go while more than ``keep_bytes`` bytes are held, or while the others
        still hold ``keep_events`` events (whole messages: at least the last ``keep_events`` events stay, within
        the bytes; the newest message always stays)."""
        if len(frames) == 1:  # a one-frame message: its frame is the encoder's bytes, nobody else's
            kept, size = frames, len(frames[0])
        else:
            kept = [f if type(f) is bytes else bytes(memoryview(f)) for f in frames]  # the caller may reuse arrays
            size = sum(map(len, kept))
        held = self._kept
        held.append((kept, size, events))
        self._kept_bytes += size
        self._kept_events += events
        while len(held) > 1 and (self._kept_bytes > self.keep_bytes
                                 or self._kept_events - held[0][2] >= self._keep_events):
            _, size, events = held.popleft()
            self._kept_bytes -= size
            self._kept_events -= events


class Subscriber:
    """Receives events, validates them, tracks per-source sequence numbers and fills gaps.

    Gaps can only be told from sequence numbers when every event of a source arrives, so the socket carries
    the whole stream unless ``topics`` names the kinds it is subscribed to (ZeroMQ prefix subscriptions,
    made by the owner of the socket): then only events of those kinds are tracked, from the socket or the
    ring, and the sources that publish them must publish no other kind (the broker's ``node-up`` and
    ``node-down``). A gap that a fill answers with other kinds means that promise is broken: the gap is
    still accounted for (nothing is lost), and it is logged (``event.topics_incomplete``) and counted in
    :attr:`outside_topics`. ``kinds`` (within ``topics``) selects what is *delivered* (bodies of other kinds
    are not even decoded). Malformed events are counted by error code and logged, never raised: a bad publisher
    must not stop a subscriber (anything unexpected is counted as ``internal``); replays are counted as
    ``replay``. ``sync`` probes are consumed here; the tokens of those a handshake waits for
    (:meth:`expect`) are recorded in :attr:`tokens`. :attr:`last_seq` is each source's latest sequence
    number in its latest incarnation.

    What is kept per source and per source incarnation is bounded (``MAX_INCARNATIONS`` of each, the least
    recently seen forgotten first), so no stream of new sources grows it: a source whose sequence was
    forgotten but not its latest incarnation goes on from its last number; a source forgotten altogether
    starts a new baseline at its next event, like one never seen (not a restart: its ring history is not
    delivered again). Its lost events stay in :attr:`lost_total`.

    ``backend`` rebuilds the arrays in events (see :class:`~refbus.protocol.codec.ArrayUnpacker`): ``numpy`` by
    default, whatever library a publisher tagged them with, so that no publisher can make a subscribing process
    import torch (the orchestrator and env servers must never load it); ``native`` or ``torch`` only for a role
    that wants tensors and runs torch anyway. A ``fill`` must decode what it recovers with the same backend.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        codec: WireCodec,
        *,
        fill: Fill | None = None,
        kinds: frozenset[str] | None = None,
        topics: frozenset[str] | None = None,
        backend: ArrayBackend = "numpy",
    ) -> None:
        if topics is not None and (kinds is None or not kinds <= topics):
            raise ValueError(f"delivered kinds {sorted(kinds or ())} must be within the topics {sorted(topics)}")
        self.sock = sock
        self.codec = codec
        self.fill = fill
        self.kinds = kinds
        self.topics = topics
        self.backend: ArrayBackend = backend
        self.outside_topics = 0  # events a fill answered with kinds outside ``topics`` (see the class doc)
        self.last_seq: dict[str, int] = {}
        # Each source's latest incarnation, least recently seen first (an event of any of its incarnations
        # re-inserts it): the order in which sources, with their ``last_seq`` and ``lost``, are forgotten.
        self._epochs: dict[str, str] = {}
        # (source, incarnation) -> last seq, least recently seen first: a plain dict, whose order is that of
        # insertion (an event re-inserts its key), costs half an OrderedDict's get, move_to_end and set
        self._sequences: dict[tuple[str, str], int] = {}
        # (source, incarnation) -> the last seq that came through the socket (a repeat at or below it is a replay;
        # one above it, at or below the last delivered, came from the ring first); its keys within _sequences'
        self._socket_seqs: dict[tuple[str, str], int] = {}
        self.tokens: set[str] = set()  # expected tokens whose probe arrived (see expect)
        self._expected: set[str] = set()
        self.received = 0
        self.missed = 0  # events detected missing (before any fill)
        self.filled = 0
        self.lost: Counter[str] = Counter()  # source -> events found missing that no fill recovered (gone)
        self.lost_total = 0  # all of them, those of forgotten sources too
        self.duplicates = 0  # events the ring handed over again (fills, merges): not an error
        self.rejected: Counter[str] = Counter()
        self._ready: deque[Message] = deque()
        self._held: list[list] | None = None

    def recv(self, timeout_ms: int) -> Message | None:
        """The next event in per-source order, or None when none is delivered within ``timeout_ms`` (also while
        messages keep arriving that deliver none: probes, repeats, refused ones).

        When none is ready, it processes everything already waiting on the socket (at most ``DRAIN_BUDGET``
        messages) before it returns one: the loop and clock reads are paid once per batch, not per event."""
        ready = self._ready
        if ready:
            return ready.popleft()
        deadline = 0.0
        while not self.drain():  # may deliver nothing (probe, duplicate, rejected): keep waiting
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout_ms / 1000
            elif now >= deadline:  # messages keep coming, none deliverable: the wait ends all the same
                return None
            # Only this clock ends the wait: pyzmq's poll returns early when signals keep interrupting it.
            if not readable(self.sock, max(0, int((deadline - now) * 1000))) and time.monotonic() >= deadline:
                return None
        return ready.popleft()

    def drain(self, budget: int = DRAIN_BUDGET) -> int:
        """Process what is waiting on the socket, at most ``budget`` messages and until about ``budget`` events
        are ready (a batch brings many: fewer live objects for each garbage collection to walk), without
        blocking; returns how many events are ready to be delivered."""
        sock, take, ready = self.sock, self._take if self._held is None else self._park, self._ready
        for _ in range(budget):
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                break
            except TooManyFrames as exc:  # read off whole, its frames past the cap never kept
                self._refuse(exc)
                continue
            take(frames)
            if len(ready) >= budget:
                break
        return len(ready)

    def drain_one(self, flags: int = 0) -> None:
        """Receive and process one message (``zmq.Again`` with NOBLOCK when none is waiting)."""
        try:
            frames = recv_frames(self.sock, flags)
        except TooManyFrames as exc:
            self._refuse(exc)
            return
        if self._held is not None:
            self._park(frames)
        else:
            self._take(frames)

    def expect(self, token: str) -> None:
        """A handshake waits for the probe ``token``: once it arrives, ``token`` is in :attr:`tokens`. Other
        probes' tokens are not kept (every node's PUB handshake probes pass every subscriber): call
        :meth:`forget_token` when the handshake is over."""
        self._expected.add(token)

    def forget_token(self, token: str) -> None:
        """The handshake that expected ``token`` is over (whether its probe came or not)."""
        self._expected.discard(token)
        self.tokens.discard(token)

    def _park(self, frames: list) -> None:
        assert self._held is not None
        self._held.append(frames)
        if bytes(frames[0]) == SYNC_KIND:
            self._take(frames, tail=False)  # the handshake must see its probe while events are parked

    def _take(self, frames: list, tail: bool = True) -> None:
        """A message that came through the socket, live or parked. ``tail``: act on a probe's sequence number
        (not while events in front of it are parked). Positional arguments and :meth:`WireCodec.decode_body`: this
        runs once per event."""
        codec = self.codec
        try:
            batch = codec.decode_batch(frames)  # None for one event; a batch is decoded whole, MAC first
            if batch is not None:
                self._take_batch(batch)
                return
            checked = codec.decode_header(frames)  # MAC verified here, before any state changes
            kind = checked.kind
            header = checked.header
            if kind == SYNC:
                probe = codec.decode_body(checked).body
                assert isinstance(probe, Sync)
                if probe.token in self._expected:
                    self.tokens.add(probe.token)
                if tail and header.seq:
                    self._tail(header.src, header.seq, incarnation(header.id))
                return
            if self.topics is not None and kind not in self.topics:
                return  # a kind that merely starts like a topic: not part of what this subscription tracks
            if not self._track(header.src, header.seq, incarnation(header.id), True):
                return
            if self.kinds is None or kind in self.kinds:
                self._ready.append(codec.decode_body(checked, self.backend))
        except ProtocolError as exc:
            self._refuse(exc)
        except Exception:  # a bug the event exposed: counted and logged, the stream goes on
            self.rejected["internal"] += 1
            log.exception("event.failed")

    def _refuse(self, error: ProtocolError) -> None:
        """A message refused (counted by code, logged); the stream goes on."""
        self.rejected[error.code] += 1
        log.warning("event.rejected", code=error.code, error=str(error))

    def _take_batch(self, batch: list[Message]) -> None:
        """The events of one batch (one kind, one source incarnation, which the codec checked), each tracked as
        if it came alone; the common case, consecutive numbers all new, in one step of :meth:`_track`."""
        kind = batch[0].kind
        if self.topics is not None and kind not in self.topics:
            return
        deliver = self.kinds is None or kind in self.kinds
        lead = batch[0].header
        src, epoch, first = lead.src, incarnation(lead.id), lead.seq
        last = self._last(src, epoch)
        if (last is None or first > last) and all(m.header.seq == seq for seq, m in enumerate(batch, first)):
            if self._track(src, first, epoch, True, len(batch)) and deliver:
                self._ready.extend(batch)
            return
        track, ready = self._track, self._ready
        for message in batch:
            if track(src, message.header.seq, epoch, True) and deliver:
                ready.append(message)

    def hold(self) -> None:
        """Park incoming events (not yet sequence-checked) while a replay is merged in front of them."""
        self._held = []

    def release(self) -> None:
        """Process the parked events in arrival order and resume normal delivery."""
        held, self._held = self._held or [], None
        for frames in held:
            self._take(frames)

    def pop(self) -> Message | None:
        return self._ready.popleft() if self._ready else None

    def offer(self, message: Message) -> bool:
        """Sequence-check an already decoded event (replayed or filled); queue it if new and wanted."""
        header = message.header
        if self.topics is not None and message.kind not in self.topics:
            return False
        if not self._track(header.src, header.seq, incarnation(header.id), False):
            return False
        if self.kinds is None or message.kind in self.kinds:
            self._ready.append(message)
        return True

    def _track(self, src: str, seq: int, epoch: str, socket: bool, count: int = 1) -> bool:
        """Advance the sequence of ``src``'s incarnation ``epoch``; False for an event it already delivered. A
        jump is a gap: fill it first. A new incarnation starts a new baseline (a restarted node); when this
        subscriber already followed the source, that incarnation's every event came after it subscribed, so
        one that does not start at 1 is a gap from 1 (a restarted broker whose first events were forwarded
        before this subscriber's socket reconnected, or went before a live one overtook the ring's copy).
        ``socket``: the event came through the socket (live or parked), not from the ring. ``count``: the events
        numbered ``seq`` to ``seq + count - 1`` (part of a batch) in one step, for a caller that knows every one of
        them is new (``seq`` above the last number seen)."""
        key = (src, epoch)
        sequences, epochs = self._sequences, self._epochs
        last = sequences.pop(key, None)  # re-inserted below: the most recently seen is last
        latest = epochs.pop(src, None)  # the same for its source
        end = seq + count - 1
        if last is None and latest == epoch:
            # Its sequence was forgotten (other incarnations pushed it out), not its source: it goes on from
            # there, not as a restart that would fill, and deliver again, all the ring holds of it.
            last = self.last_seq[src]
            epochs[src] = epoch
            self._remember(key, last)
        if last is None:
            restarted = latest is not None
            if restarted:
                log.info("event.source_restarted", src=src, last_seq=self.last_seq.get(src))
            epochs[src] = epoch
            self._remember(key, end)
            if socket:
                self._socket_seqs[key] = end
            self.last_seq[src] = end
            self.received += count
            if restarted and seq > 1:
                self._gap(src, epoch, 1, seq - 1)
            return True
        if latest is not None:
            epochs[src] = latest
        if seq <= last:
            sequences[key] = last
            if socket and seq <= self._socket_seqs.get(key, 0):
                self.rejected["replay"] += 1
                log.warning("event.rejected", code="replay", src=src, incarnation=epoch, seq=seq, last_seq=last)
            else:
                self.duplicates += 1
                if socket:  # its live copy, after the ring's: what comes through the socket now goes on from it
                    self._socket_seqs[key] = seq
            return False
        sequences[key] = end
        if socket:
            self._socket_seqs[key] = end
        if latest == epoch:
            self.last_seq[src] = end
        self.received += count
        if seq > last + 1:
            self._gap(src, epoch, last + 1, seq - 1)
        return True

    def _last(self, src: str, epoch: str) -> int | None:
        """The last sequence number delivered of ``src``'s incarnation ``epoch``, forgotten or not while it is
        the source's latest; None for an incarnation not known."""
        last = self._sequences.get((src, epoch))
        if last is None and self._epochs.get(src) == epoch:
            return self.last_seq[src]
        return last

    def _tail(self, src: str, seq: int, epoch: str) -> None:
        """A probe says ``src``'s incarnation ``epoch`` has published up to ``seq``: what this subscriber has not
        seen of it is a gap (the tail of the stream, lost with no later event to reveal it). A probe never
        sets a baseline: an incarnation not seen yet is left to its first event."""
        key = (src, epoch)
        last = self._last(src, epoch)
        if last is None or seq <= last:
            return
        if key in self._sequences:
            self._sequences[key] = seq
        else:  # the source's latest incarnation, whose sequence was forgotten: remembered again, its source too
            self._epochs[src] = self._epochs.pop(src)
            self._remember(key, seq)
        if self._epochs.get(src) == epoch:
            self.last_seq[src] = seq
        self._gap(src, epoch, last + 1, seq)

    def _remember(self, key: tuple[str, str], seq: int) -> None:
        """Set a sequence not held (its source already most recent in ``_epochs``), then forget the least
        recently seen sequences and sources beyond ``MAX_INCARNATIONS`` each."""
        sequences = self._sequences
        sequences[key] = seq
        while len(sequences) > MAX_INCARNATIONS:
            oldest = next(iter(sequences))  # the least recently seen
            del sequences[oldest]
            self._socket_seqs.pop(oldest, None)
        epochs = self._epochs
        while len(epochs) > MAX_INCARNATIONS:
            src = next(iter(epochs))  # none of its sequences is left: every source seen since saw one of its own
            del epochs[src]
            self.last_seq.pop(src, None)
            self.lost.pop(src, None)  # still in lost_total

    def _gap(self, src: str, epoch: str, first: int, last: int) -> None:
        self.missed += last - first + 1
        recovered: list[Message] = []
        if self.fill is not None:
            try:
                recovered = list(self.fill(src, epoch, first, last))
            except Exception as exc:  # a failed fill loses the gap, never the live event that revealed it
                log.warning("event.fill_failed", src=src, first=first, last=last, error=str(exc))
        # The ring may hold an event twice (forwarded, then refilled by its publisher) and out of order.
        by_seq = {m.header.seq: m for m in recovered if first <= m.header.seq <= last
                  and incarnation(m.header.id) == epoch}
        recovered = [by_seq[seq] for seq in sorted(by_seq)]
        outside = sum(self.topics is not None and m.kind not in self.topics for m in recovered)
        if outside:
            self.outside_topics += outside
            log.warning("event.topics_incomplete", src=src, events=outside, topics=sorted(self.topics or ()),
                        detail="this source publishes kinds this subscription does not receive: each of its "
                        "events of those kinds costs a gap fill")
        for message in recovered:
            self.received += 1
            self.filled += 1
            if self.kinds is None or message.kind in self.kinds:
                self._ready.append(message)
        if len(recovered) < last - first + 1:
            self.lost[src] += last - first + 1 - len(recovered)
            self.lost_total += last - first + 1 - len(recovered)
            log.warning("event.gap", src=src, first=first, last=last, recovered=len(recovered))
