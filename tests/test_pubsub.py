"""The event stream over a real PUB/SUB pair on loopback tcp: sequence numbers, gap detection and fill,
duplicates, source restarts, malformed events counted (never raised), ``hold``/``release`` ordering.

Each test first makes the subscription live with ``sync`` probes (ZeroMQ drops what a PUB sends before the
subscription reaches it), then sends events either through a ``Publisher`` or as hand-made frames on the raw
PUB socket (to skip, repeat or corrupt sequence numbers).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from polling import wait_for
from refbus.bus import pubsub
from refbus.bus.pubsub import Publisher, Subscriber
from refbus.bus.runtime import FILL_SHARE, NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS, FrameCounter, bound_endpoint, readable, recv_frames
from refbus.protocol.codec import EXT_NUMPY, checksum
from refbus.protocol.envelope import MIN_FRAMES, PROTOCOL_VERSION, Message, WireCodec, incarnation
from refbus.protocol.messages import MAX_FRAMES, Blobs, Delete, FetchedBlob, Sync, VersionBump
from structlog.testing import capture_logs

pytest_plugins = ["wire_fixtures"]

WAIT_MS = 5000
SRC = "env-0"


def event(i: int) -> Delete:
    return Delete(blob_ids=[f"b{i}"], holder=SRC, reason="filtered")


def frames_for(codec: WireCodec, seq: int, body: Any = None) -> list[bytes]:
    return [bytes(f) for f in codec.encode(body if body is not None else event(seq), seq=seq)]


class Stream:
    """A bound PUB, a connected SUB wrapped in a Subscriber, made live before the test uses them."""

    def __init__(self, pub: zmq.Socket, sub_sock: zmq.Socket, source: WireCodec | None = None,
                 secret: bytes = b"", **subscriber: Any) -> None:
        self.pub = pub
        self.source = source or WireCodec(SRC, secret=secret)
        self.publisher = Publisher(pub, self.source)
        self.sub = Subscriber(sub_sock, WireCodec("monitor", secret=secret), **subscriber)
        self.go_live()

    def go_live(self, timeout_s: float = 5.0) -> None:
        """Probe with ``sync`` (seq 0, consumed by the subscriber) until one arrives."""
        token = f"live-{time.monotonic_ns():x}"
        self.sub.expect(token)
        deadline = time.monotonic() + timeout_s
        while token not in self.sub.tokens:
            assert time.monotonic() < deadline, "subscription never became live"
            self.publisher.publish_raw(Sync(token=token))
            assert self.sub.recv(20) is None
        assert self.publisher.seq == 0

    def send(self, *seqs: int) -> list[list[bytes]]:
        """Hand-made events of SRC with the given sequence numbers, in that order."""
        sent = [frames_for(self.source, seq) for seq in seqs]
        for frames in sent:
            self.pub.send_multipart(frames)
        return sent

    def receive(self, count: int, timeout_ms: int = WAIT_MS) -> list[Message]:
        """The next ``count`` delivered events, all within one deadline."""
        got: list[Message] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while len(got) < count and (remaining := deadline - time.monotonic()) > 0:
            message = self.sub.recv(int(remaining * 1000) + 1)
            if message is not None:
                got.append(message)
        assert len(got) == count, f"only {len(got)} of {count} events arrived: {got}"
        return got

    def nothing_more(self) -> bool:
        return self.sub.recv(50) is None


@pytest.fixture
def stream(bound_pair: Any) -> Any:
    def make(**subscriber: Any) -> Stream:
        pub, sub_sock, _ = bound_pair(zmq.PUB, zmq.SUB, options=EVENT_OPTIONS)
        return Stream(pub, sub_sock, **subscriber)

    return make


def seqs(messages: list[Message]) -> list[int]:
    return [m.header.seq for m in messages]


# --- sequence numbers ---------------------------------------------------------------------------------


def test_publisher_numbers_events_from_one(stream: Any) -> None:
    s = stream()
    numbers = [s.publisher.publish(event(i)) for i in range(1, 201)]
    assert numbers == list(range(1, 201))
    got = s.receive(200)
    assert seqs(got) == list(range(1, 201))
    assert [m.body for m in got] == [event(i) for i in range(1, 201)]
    assert {m.header.src for m in got} == {SRC}
    assert len({m.header.id for m in got}) == 200
    assert (s.sub.received, s.sub.missed, s.sub.filled, s.sub.duplicates) == (200, 0, 0, 0)
    assert s.sub.last_seq == {SRC: 200}
    assert not s.sub.rejected
    assert s.nothing_more()


def test_sync_probes_do_not_consume_sequence_numbers(stream: Any) -> None:
    s = stream()
    s.sub.expect("probe-2")
    s.publisher.publish_raw(Sync(token="probe-2"))
    assert s.publisher.publish(event(1)) == 1
    assert seqs(s.receive(1)) == [1]
    assert "probe-2" in s.sub.tokens
    assert s.sub.received == 1


def test_an_event_that_cannot_be_encoded_takes_no_sequence_number(stream: Any) -> None:
    """A body the codec refuses raises at publish, alone or inside a batch, and leaves no hole in the sequence:
    a number taken and never sent was counted lost by every subscriber."""
    s = stream()
    unencodable = [Delete(blob_ids=[object()], holder=SRC, reason="filtered"),  # type: ignore[list-item]
                   Blobs([FetchedBlob("b", {"x": object()})])]  # type: ignore[dict-item]
    for body in unencodable:
        with pytest.raises(Exception, match="cannot encode"):
            s.publisher.publish(body)
    assert s.publisher.publish(event(1)) == 1
    s.publisher.batch_events = 4
    with s.publisher.batching():
        for body in unencodable:
            with pytest.raises(Exception, match="cannot encode"):
                s.publisher.publish(body)
        assert s.publisher.publish(event(2)) == 2
    assert seqs(s.receive(2)) == [1, 2] and s.nothing_more()
    assert (s.sub.missed, s.sub.lost_total, s.publisher.seq) == (0, 0, 2)


def test_first_event_of_a_source_sets_its_baseline(stream: Any) -> None:
    s = stream()
    s.send(7, 8)
    assert seqs(s.receive(2)) == [7, 8]
    assert s.sub.missed == 0


def test_sources_are_tracked_independently(stream: Any) -> None:
    s = stream()
    other = WireCodec("env-1")
    for codec, seq in [(s.source, 1), (other, 1), (s.source, 2), (other, 3), (s.source, 3)]:
        s.pub.send_multipart(frames_for(codec, seq))
    got = s.receive(5)
    assert [(m.header.src, m.header.seq) for m in got] == [(SRC, 1), ("env-1", 1), (SRC, 2), ("env-1", 3), (SRC, 3)]
    assert s.sub.missed == 1
    assert s.sub.last_seq == {SRC: 3, "env-1": 3}


# --- gaps ---------------------------------------------------------------------------------------------


def test_gap_is_detected_and_counted(stream: Any) -> None:
    s = stream()
    s.send(1, 2, 5, 6, 9)
    assert seqs(s.receive(5)) == [1, 2, 5, 6, 9]
    assert s.sub.missed == 2 + 2
    assert s.sub.filled == 0
    assert s.sub.received == 5
    assert s.sub.last_seq[SRC] == 9


class Ring:
    """A stand-in for the broker's replay ring: every event of SRC, and the fill calls it answered."""

    def __init__(self, count: int, *, only: set[int] | None = None, extra: tuple[int, ...] = ()) -> None:
        self.source, reader = WireCodec(SRC), WireCodec("ring-reader")  # the stream's source: one incarnation
        self.events = {seq: reader.decode(frames_for(self.source, seq)) for seq in range(1, count + 1)}
        self.only = only
        self.extra = extra
        self.calls: list[tuple[str, int, int]] = []

    def fill(self, src: str, epoch: str, first: int, last: int) -> list[Message]:
        self.calls.append((src, first, last))
        wanted = [seq for seq in range(first, last + 1) if self.only is None or seq in self.only]
        return [self.events[seq] for seq in sorted([*self.extra, *wanted])]


def test_gaps_are_filled_in_order(stream: Any) -> None:
    ring = Ring(8)
    s = stream(fill=ring.fill, source=ring.source)
    s.send(1, 2, 5, 6, 8)
    got = s.receive(8)
    assert seqs(got) == list(range(1, 9))
    assert [m.body for m in got] == [event(i) for i in range(1, 9)]
    assert ring.calls == [(SRC, 3, 4), (SRC, 7, 7)]
    assert (s.sub.missed, s.sub.filled, s.sub.received) == (3, 3, 8)
    assert s.nothing_more()


def test_partial_fill_delivers_what_it_got_and_ignores_events_outside_the_gap(stream: Any) -> None:
    ring = Ring(6, only={4}, extra=(2,))  # recovers 4 of 3..4, and also hands back 2 (already delivered)
    s = stream(fill=ring.fill, source=ring.source)
    s.send(1, 2, 5)
    assert seqs(s.receive(4)) == [1, 2, 4, 5]
    assert ring.calls == [(SRC, 3, 4)]
    assert (s.sub.missed, s.sub.filled) == (2, 1)
    assert s.nothing_more()


def test_a_fill_that_hands_an_event_twice_and_out_of_order_delivers_each_once_in_order(stream: Any) -> None:
    ring = Ring(6)
    s = stream(fill=lambda *gap: list(reversed(ring.fill(*gap))) * 2, source=ring.source)  # a refilled ring
    s.send(1, 5)
    assert seqs(s.receive(5)) == [1, 2, 3, 4, 5]
    assert (s.sub.missed, s.sub.filled, s.sub.duplicates) == (3, 3, 0)
    assert s.nothing_more()


def test_a_probe_carrying_a_later_sequence_number_reveals_a_lost_tail(stream: Any) -> None:
    ring = Ring(5)
    s = stream(fill=ring.fill, source=ring.source)
    s.send(1, 2)
    assert seqs(s.receive(2)) == [1, 2]
    s.pub.send_multipart(frames_for(ring.source, 5, Sync(token="tail")))  # "I have published up to 5"
    assert seqs(s.receive(3)) == [3, 4, 5]
    assert ring.calls == [(SRC, 3, 5)] and s.sub.lost.total() == 0
    s.pub.send_multipart(frames_for(ring.source, 5, Sync(token="again")))  # nothing more to fill
    s.send(6)
    assert seqs(s.receive(1)) == [6] and ring.calls == [(SRC, 3, 5)]


def test_a_probe_sets_no_baseline_and_a_tail_no_fill_recovers_is_counted_lost(stream: Any) -> None:
    s = stream(fill=lambda *gap: [])
    other = WireCodec("env-1")
    s.sub.expect("unknown-source")
    s.pub.send_multipart(frames_for(other, 9, Sync(token="unknown-source")))  # no history wanted
    s.send(1)
    s.pub.send_multipart(frames_for(s.source, 3, Sync(token="tail")))
    s.pub.send_multipart(frames_for(other, 1))
    assert [(m.header.src, m.header.seq) for m in s.receive(2)] == [(SRC, 1), ("env-1", 1)]
    assert s.sub.lost == {SRC: 2} and "unknown-source" in s.sub.tokens


def test_a_publisher_holds_its_latest_events_within_its_bounds(stream: Any) -> None:
    s = stream()
    s.publisher = Publisher(s.pub, s.source, keep_events=3)
    for i in range(1, 6):
        s.publisher.publish(event(i))
    reader = WireCodec("reader")
    assert [(reader.decode(frames).header.seq, n) for frames, n in s.publisher.held()] == [(3, 1), (4, 1), (5, 1)]
    one_size = sum(map(len, s.publisher.held()[0][0]))
    by_bytes = Publisher(s.pub, s.source, keep_bytes=2 * one_size + 1)
    for i in range(1, 6):
        by_bytes.publish(event(i))
    assert [reader.decode(frames).header.seq for frames, _ in by_bytes.held()] == [4, 5]
    array = np.arange(8, dtype=np.int64)
    with_array = Publisher(s.pub, s.source)
    with_array.publish(Blobs([FetchedBlob("b", {"x": array})]))
    array[:] = -1  # the caller reuses its array after publishing: the held copy is what was sent
    held = reader.decode(with_array.held()[0][0]).body
    assert held.blobs[0].arrays["x"].tolist() == list(range(8))


def test_a_topic_filtered_socket_gets_only_its_kinds_in_either_form_and_tracks_only_their_sources(
        bound_pair: Any) -> None:
    pub, sub_sock, _ = bound_pair(zmq.PUB, zmq.SUB, options=EVENT_OPTIONS)
    sub_sock.setsockopt(zmq.UNSUBSCRIBE, b"")
    for topic in (b"delete", b"sync"):  # what runtime.subscribe(topics=...) subscribes to
        sub_sock.setsockopt(zmq.SUBSCRIBE, topic)
    s = Stream(pub, sub_sock, kinds=frozenset({"delete"}), topics=frozenset({"delete"}))
    bumps = Publisher(pub, WireCodec("ps-manager"))
    s.publisher.publish(event(1))  # the one-frame form: "delete\0..."
    for version in range(1, 4):
        bumps.publish(VersionBump(version=version, nbytes=1, manifest_digest="d"))
    s.pub.send_multipart(frames_for(s.source, 2))  # the multi-frame form: "delete" alone in the first frame
    assert seqs(s.receive(2)) == [1, 2]
    assert s.nothing_more()
    assert s.sub.last_seq == {SRC: 2} and s.sub.received == 2 and not s.sub.rejected


def test_a_gap_filled_with_kinds_outside_the_topics_is_accounted_and_flagged_not_lost(stream: Any) -> None:
    source, reader = WireCodec(SRC), WireCodec("ring-reader")
    bump = reader.decode(frames_for(source, 3, VersionBump(version=1, nbytes=1, manifest_digest="d")))
    s = stream(fill=lambda *gap: [bump], source=source, kinds=frozenset({"delete"}), topics=frozenset({"delete"}))
    s.send(1, 2)
    s.pub.send_multipart(frames_for(source, 3, bump.body))  # arrives (the socket takes all): not tracked
    s.send(4)
    assert seqs(s.receive(3)) == [1, 2, 4]
    assert (s.sub.missed, s.sub.filled, s.sub.outside_topics, s.sub.lost.total()) == (1, 1, 1, 0)
    with pytest.raises(ValueError, match="within the topics"):
        Subscriber(s.sub.sock, reader, kinds=frozenset({"delete", "claim"}), topics=frozenset({"delete"}))


def test_repeats_on_the_socket_are_refused_as_replays(stream: Any) -> None:
    s = stream()
    s.send(1, 2, 3, 2, 3, 3, 4)
    assert seqs(s.receive(4)) == [1, 2, 3, 4]
    assert s.sub.rejected == {"replay": 3}
    assert (s.sub.duplicates, s.sub.missed) == (0, 0)
    assert s.nothing_more()


def test_restarted_source_is_accepted_from_one(stream: Any) -> None:
    s = stream()
    for i in range(1, 4):
        s.publisher.publish(event(i))
    restarted = Publisher(s.pub, WireCodec(SRC))  # same node id, new process: seq starts over
    for i in range(1, 3):
        restarted.publish(event(10 + i))
    got = s.receive(5)
    assert seqs(got) == [1, 2, 3, 1, 2]
    assert [m.body for m in got[3:]] == [event(11), event(12)]
    assert got[0].header.id.split("-")[0] != got[3].header.id.split("-")[0]
    assert (s.sub.duplicates, s.sub.missed) == (0, 0)
    assert s.sub.last_seq[SRC] == 2


def test_a_new_incarnation_restarts_the_sequence_without_a_gap_fill(stream: Any) -> None:
    ring = Ring(3)
    s = stream(fill=ring.fill, source=ring.source)
    s.send(1, 2, 3)
    restarted = WireCodec(SRC)
    for seq in (1, 2):
        s.pub.send_multipart(frames_for(restarted, seq))
    assert seqs(s.receive(5)) == [1, 2, 3, 1, 2]
    assert ring.calls == [] and (s.sub.missed, s.sub.rejected) == (0, {})


def test_a_followed_source_whose_new_incarnation_first_shows_after_one_fills_from_one(stream: Any) -> None:
    """A restarted broker's first events can be forwarded before a subscriber's socket reconnects: the
    subscriber followed that source before, so the new incarnation's events 1.. all came after it subscribed,
    and a first event above 1 is a gap (filled from the ring, or counted lost)."""
    earlier, ring = WireCodec(SRC), Ring(5)
    s = stream(fill=ring.fill, source=ring.source)
    s.pub.send_multipart(frames_for(earlier, 1))
    s.send(4, 5)
    got = s.receive(6)
    assert seqs(got) == [1, 1, 2, 3, 4, 5]
    assert ring.calls == [(SRC, 1, 3)] and (s.sub.missed, s.sub.filled, s.sub.lost.total()) == (3, 3, 0)

    unfilled = stream(source=WireCodec(SRC))
    unfilled.pub.send_multipart(frames_for(earlier, 1))
    unfilled.send(3)
    assert seqs(unfilled.receive(2)) == [1, 3]
    assert unfilled.sub.lost[SRC] == 2


def test_gap_fills_take_only_the_missing_events_own_incarnation(stream: Any) -> None:
    """A restarted source reuses sequence numbers: the ring's events of its earlier incarnation with the
    same numbers are not the missing ones."""
    earlier, ring = WireCodec(SRC), Ring(6)
    reader = WireCodec("ring-reader")
    stale = [reader.decode(frames_for(earlier, seq, event(100 + seq))) for seq in (2, 3)]

    def fill(src: str, epoch: str, first: int, last: int) -> list[Message]:
        return [*stale, *ring.fill(src, epoch, first, last)]

    s = stream(fill=fill, source=ring.source)
    s.send(1, 4)
    got = s.receive(4)
    assert seqs(got) == [1, 2, 3, 4]
    assert [m.body for m in got] == [event(i) for i in range(1, 5)]
    assert (s.sub.missed, s.sub.filled) == (2, 2)


SECRET = b"stream-secret"


def test_a_forged_high_seq_event_is_refused_and_genuine_events_still_arrive(stream: Any) -> None:
    ring = Ring(4)
    s = stream(secret=SECRET)
    s.sub.fill = ring.fill
    s.publisher.publish(event(1))
    forged = [bytes(f) for f in s.source.encode(event(1000), seq=1000)]
    forged[-1] = bytes(32)  # same source and incarnation, no secret: the MAC cannot be right
    s.pub.send_multipart(forged)
    unsigned_forgery = frames_for(WireCodec(SRC), 1000)
    s.pub.send_multipart(unsigned_forgery)
    for i in (2, 3):
        s.publisher.publish(event(i))
    got = s.receive(3)
    assert seqs(got) == [1, 2, 3] and [m.body for m in got] == [event(1), event(2), event(3)]
    assert s.sub.rejected == {"signature": 2}
    assert (s.sub.missed, s.sub.duplicates, ring.calls) == (0, 0, [])
    assert s.sub.last_seq[SRC] == 3


def test_a_replayed_signed_event_is_refused_as_replay_and_counted(stream: Any) -> None:
    s = stream(secret=SECRET)
    sent = [[bytes(f) for f in s.source.encode(event(seq), seq=seq)] for seq in (1, 2, 3)]
    for frames in sent:
        s.pub.send_multipart(frames)
    assert seqs(s.receive(3)) == [1, 2, 3]
    for frames in (sent[0], sent[2], sent[1]):  # captured and sent again, MAC intact
        s.pub.send_multipart(frames)
    s.publisher.seq = 3
    s.publisher.publish(event(4))
    assert seqs(s.receive(1)) == [4]
    assert s.sub.rejected == {"replay": 3}
    assert s.sub.duplicates == 0 and s.nothing_more()


# --- malformed events ---------------------------------------------------------------------------------


def header(seq: int, src: str = "bad-publisher", **overrides: Any) -> bytes:
    fields = {"v": list(PROTOCOL_VERSION), "id": f"bad-{seq}", "src": src, "seq": seq, "ts": time.time()}
    return msgspec.msgpack.encode({**fields, **overrides})


def blobs_with_corrupt_buffer(seq: int) -> list[bytes]:
    frames = frames_for(WireCodec("bad-publisher"), seq, Blobs([FetchedBlob("b", {"x": np.arange(4)})]))
    frames[MIN_FRAMES] = b"\x01" + frames[MIN_FRAMES][1:]
    return frames


GOOD_BODY = msgspec.msgpack.encode({"blob_ids": ["b"], "holder": "h", "reason": "r"})
MALFORMED_EVENTS = [
    ([b"\xff"], "malformed"),
    ([b"delete", header(1)], "malformed"),
    ([b"\xff\xfe", header(2), GOOD_BODY], "malformed"),
    ([b"delete", b"\xc1\xc1", GOOD_BODY], "malformed"),
    ([b"delete", header(3), b"\xc1"], "malformed"),
    ([b"delete", header(4), GOOD_BODY, b"stray frame"], "malformed"),
    ([b"teleport", header(5), GOOD_BODY], "unknown-kind"),
    ([b"delete", header(6, v=[PROTOCOL_VERSION[0] + 1, 0]), GOOD_BODY], "version"),
    ([b"delete", header(7), msgspec.msgpack.encode({"holder": "h", "reason": "r"})], "schema"),
    ([b"delete", header(8), msgspec.msgpack.encode({"blob_ids": 5, "holder": "h", "reason": "r"})], "schema"),
    (blobs_with_corrupt_buffer(9), "checksum"),
]


def test_malformed_events_are_counted_by_code_and_the_stream_goes_on(stream: Any) -> None:
    s = stream()
    s.publisher.publish(event(1))
    for frames, _ in MALFORMED_EVENTS:
        s.pub.send_multipart(frames)
    s.publisher.publish(event(2))
    got = s.receive(2)  # never raises; the good events around the bad ones arrive
    assert seqs(got) == [1, 2]
    assert s.sub.rejected == Counter(code for _, code in MALFORMED_EVENTS)
    assert s.sub.last_seq[SRC] == 2
    assert s.nothing_more()


def test_an_event_of_more_frames_than_any_message_has_is_refused_unkept_and_the_stream_goes_on(stream: Any) -> None:
    """An event of [kind, header, body], then many empty frames, then a MAC passes every byte limit: a subscriber
    used to hold an object per frame before checking the MAC (and the broker forwards it to every subscriber).
    Past ``MAX_FRAMES`` its frames are read off without being kept and it is refused ``malformed``; the next
    event is delivered."""
    s = stream(secret=SECRET)
    kind, header_frame, body, mac = (bytes(f) for f in s.source.encode(event(1), seq=1))
    kept_before = FrameCounter.frames
    s.pub.send_multipart([kind, header_frame, body, *[b""] * (3 * MAX_FRAMES), mac])
    s.publisher.seq = 0
    s.publisher.publish(event(1))
    assert seqs(s.receive(1)) == [1]
    assert s.sub.rejected == {"malformed": 1}
    assert FrameCounter.frames - kept_before < MAX_FRAMES  # frames past the cap were never held
    assert s.nothing_more()


def test_unwanted_kinds_are_tracked_but_not_delivered_or_decoded(stream: Any) -> None:
    s = stream(kinds=frozenset({"delete"}))
    bump = VersionBump(version=3, nbytes=10, manifest_digest="d")
    s.pub.send_multipart(frames_for(s.source, 1))
    s.pub.send_multipart(frames_for(s.source, 2, bump))
    same_sender = incarnation(msgspec.msgpack.decode(frames_for(s.source, 2)[1])["id"])
    s.pub.send_multipart([b"version-bump", header(3, src=SRC, id=f"{same_sender}-ff"), b"\xc1 not decoded"])
    s.pub.send_multipart(frames_for(s.source, 5))
    assert seqs(s.receive(2)) == [1, 5]
    assert s.sub.last_seq[SRC] == 5
    assert s.sub.missed == 1
    assert not s.sub.rejected
    assert s.nothing_more()


def test_event_with_an_impossible_array_shape_is_counted_not_raised(stream: Any) -> None:
    """Regression: numpy/torch errors for an absurd shape escaped Subscriber.recv instead of being counted."""
    s = stream()
    for seq, shape in enumerate(([2**62, 4], [2**32, 2**32, 0]), start=1):
        descriptor = msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(["uint8", shape, 0, checksum(b"")]))
        body = msgspec.msgpack.encode({"blobs": [{"blob_id": "b", "arrays": {"x": descriptor}}]})
        s.pub.send_multipart([b"blobs", header(seq), body, b""])
    s.publisher.publish(event(1))
    assert seqs(s.receive(1)) == [1]
    assert s.sub.rejected == Counter({"array": 2})


def test_recv_waits_its_full_timeout_after_a_rejected_event(stream: Any) -> None:
    s = stream()
    go = threading.Event()

    def slow_publisher() -> None:  # owns the PUB socket until joined
        s.pub.send_multipart([b"\xff"])
        go.wait(0.3)  # a slow source, on purpose
        s.publisher.publish(event(1))

    thread = threading.Thread(target=slow_publisher)
    thread.start()
    try:
        message = s.sub.recv(WAIT_MS)
    finally:
        go.set()
        thread.join(WAIT_MS / 1000)
    assert message is not None and message.header.seq == 1


FLOOD = """
import sys, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.linger = 0
pub.sndhwm = 0
pub.connect(sys.argv[1])
garbage = b"\\xff" * 4096  # no event: counted malformed. Long enough that what is queued when it stops is read at once
while True:
    pub.send(garbage)
"""


def test_recv_ends_at_its_timeout_while_undeliverable_messages_keep_arriving(
        bound_pair: Any, tmp_path: Any) -> None:
    """A flood of messages the subscriber refuses, from another process (a thread's flood is too slow to keep
    the socket from ever running dry), must not hold ``recv`` past its timeout."""
    sub_sock, _, endpoint = bound_pair(zmq.SUB, zmq.PUB, options=EVENT_OPTIONS)
    sub_sock.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber = Subscriber(sub_sock, WireCodec("monitor"))
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, endpoint])
    waited: list[float] = []
    try:
        wait_for(lambda: subscriber.drain() == 0 and readable(sub_sock, 10), WAIT_MS / 1000, "the flood")
        timeout_ms = 100

        def receive() -> None:
            started = time.monotonic()
            assert subscriber.recv(timeout_ms) is None
            waited.append(time.monotonic() - started)

        receiver = threading.Thread(target=receive)
        receiver.start()
        receiver.join(20 * timeout_ms / 1000)
        held = receiver.is_alive()
    finally:
        flood.kill()
        flood.wait()
    receiver.join(WAIT_MS / 1000)  # the flood is gone: the socket runs dry and an old recv returns too
    assert not held, f"recv({timeout_ms}) still waiting after {20 * timeout_ms} ms of undeliverable messages"
    assert waited and waited[0] < 20 * timeout_ms / 1000


def test_a_failing_fill_does_not_lose_the_live_events(stream: Any) -> None:
    newer_kind = [b"teleport", header(2, src=SRC), GOOD_BODY]  # an event this node cannot decode
    reader = WireCodec("ring-reader")

    def fill(src: str, epoch: str, first: int, last: int) -> list[Message]:  # replay_range on that ring entry
        return [reader.decode(newer_kind)]

    s = stream(fill=fill)
    s.send(1)
    s.pub.send_multipart(newer_kind)
    s.send(3, 4)
    assert seqs(s.receive(3, timeout_ms=500)) == [1, 3, 4]


def test_a_fill_the_broker_never_answers_ends_within_its_deadline_and_counts_the_gap_lost(
    stream: Any, sockets: Any
) -> None:
    """A gap fill runs inside the take of the event that revealed the gap (on a node's loop thread): against a
    broker that reads the replay request and never answers, it gives up within the runtime's fill deadline (for
    a node that has not joined, a share of its heartbeat interval; not the default policy's 14 s), the gap is
    counted lost and the live event is delivered."""
    silent = sockets(zmq.ROUTER, bind="tcp://127.0.0.1:0")  # a broker's control endpoint that answers nothing
    heartbeat_s = 0.2
    runtime = NodeRuntime("monitor", RuntimeSettings(bus=bound_endpoint(silent), node_id="monitor", metrics_port=-1,
                                                     heartbeat_interval_s=heartbeat_s), register=False)
    try:
        assert runtime.fill_deadline_s() == FILL_SHARE * heartbeat_s < heartbeat_s
        fills: list[str] = []

        def counted_fill(src: str, epoch: str, first: int, last: int) -> list[Message]:
            fills.append(src)
            return runtime.replay_range(src, epoch, first, last)

        s = stream(fill=counted_fill)
        s.send(1)
        assert seqs(s.receive(1)) == [1]
        with capture_logs() as logs:
            s.send(3)
            # The bound only stops a hang: a fill under the default policy (14 s) would fail it.
            assert seqs(s.receive(1, timeout_ms=int(10 * heartbeat_s * 1000))) == [3]
        assert fills == [SRC]
        assert (s.sub.missed, s.sub.filled, s.sub.lost[SRC]) == (1, 0, 1)
        # It gave up under the policy fitted to the fill deadline (two attempts), not the default one (three).
        (failed,) = [entry for entry in logs if entry["event"] == "replay.failed"]
        assert failed["error"].endswith("to replay after 2 attempts"), failed
        assert [replay_request(silent) for _ in range(2)] == [(SRC, 2)] * 2
    finally:
        runtime.close()


def test_the_gap_fills_of_one_loop_turn_share_one_deadline(sockets: Any) -> None:
    """Several gaps found in one loop turn (e.g. after a queue overflowed) against a broker that never answers:
    the first fill waits out the deadline, the next ones of that turn are counted lost at once, so the turn holds
    the loop for one deadline, not one per gap; the next turn has a deadline of its own."""
    silent = sockets(zmq.ROUTER, bind="tcp://127.0.0.1:0")
    runtime = NodeRuntime("monitor", RuntimeSettings(bus=bound_endpoint(silent), node_id="monitor", metrics_port=-1,
                                                     heartbeat_interval_s=0.2), register=False)
    found: list[int] = []

    def fill_in_one_turn() -> None:
        found.extend(len(runtime.replay_range(source, "inc", 2, 2)) for source in ("a", "b", "c"))
        runtime.stop()

    try:
        with capture_logs() as logs:
            runtime.call_soon(fill_in_one_turn)
            runtime.loop()
        assert found == [0, 0, 0]
        # The first fill waited out the deadline (its fitted policy's two attempts); the others found it spent
        # and sent nothing.
        outcomes = [(entry["event"], entry["src"]) for entry in logs if entry["event"].startswith("replay.")]
        assert outcomes == [("replay.failed", "a"), ("replay.skipped", "b"), ("replay.skipped", "c")], logs
        assert [replay_request(silent) for _ in range(2)] == [("a", 2)] * 2
        assert silent.poll(0, zmq.POLLIN) == 0
    finally:
        runtime.close()


def replay_request(broker: zmq.Socket) -> tuple[str, int]:
    """(src, since) of the next replay request that reached ``broker`` (a ROUTER that never answers)."""
    assert broker.poll(WAIT_MS, zmq.POLLIN), "no replay request came"
    request = WireCodec("broker").decode(recv_frames(broker)[1:])
    assert request.kind == "replay", request
    return request.body.src, request.body.since


# --- hold / release -----------------------------------------------------------------------------------


def hold_and_park(s: Stream, *seqs_: int) -> list[list[bytes]]:
    """Hold, send ``seqs_`` and a probe, and drain them all into the parked list."""
    s.sub.hold()
    sent = s.send(*seqs_)
    token = f"during-hold-{len(seqs_)}"
    s.sub.expect(token)
    s.publisher.publish_raw(Sync(token=token))
    for _ in range(len(sent) + 1):
        assert s.sub.sock.poll(WAIT_MS, zmq.POLLIN)
        s.sub.drain_one()
    assert token in s.sub.tokens  # probes are seen even while events are parked
    assert s.sub.recv(0) is None  # nothing is delivered while held
    return sent


def test_hold_parks_events_until_a_replay_is_merged_in_front(stream: Any) -> None:
    s = stream()
    s.send(1, 2)
    assert seqs(s.receive(2)) == [1, 2]
    sent = hold_and_park(s, 3, 4, 5, 6, 7)
    assert s.sub.received == 2 and s.sub.last_seq[SRC] == 2

    reader = WireCodec("replay-reader")
    replayed = [reader.decode(frames) for frames in sent[:3]]  # the ring's copy of 3..5
    assert [s.sub.offer(m) for m in replayed] == [True, True, True]
    s.sub.release()
    got = s.receive(5)
    assert seqs(got) == [3, 4, 5, 6, 7]
    assert got[:3] == replayed  # the replayed objects themselves come first
    assert s.sub.duplicates == 3  # the parked copies of 3..5
    assert s.sub.missed == 0
    assert s.nothing_more()


def test_live_copies_of_what_the_ring_delivered_first_are_duplicates_and_only_socket_repeats_are_replays(
    stream: Any,
) -> None:
    """A resumption after a broker restart proves the subscription live, then takes the whole new ring: the live
    copies of the ring's newest events may still wait in the socket's queue, and arrive after the ring delivered
    them. They are duplicates, not replays (every node of a run logged a ``replay`` warning per such event at each
    broker restart); an event the socket itself repeats is still a replay, before and after."""
    s = stream()
    s.send(1, 2)
    assert seqs(s.receive(2)) == [1, 2]
    queued = s.send(3, 4, 5)  # forwarded live, not yet read off the socket
    reader = WireCodec("replay-reader")
    assert [s.sub.offer(reader.decode(frames)) for frames in queued] == [True, True, True]  # the ring's copies
    assert seqs([s.sub.pop() for _ in range(3)]) == [3, 4, 5]
    s.send(6)
    assert seqs(s.receive(1)) == [6]
    assert (s.sub.duplicates, s.sub.rejected) == (3, {})  # the live 3, 4 and 5
    s.send(5, 2, 7)  # the socket repeats 5 (it carried 5 already) and 2
    assert seqs(s.receive(1)) == [7]
    assert s.sub.rejected == {"replay": 2}
    assert s.nothing_more()


def test_replay_from_the_first_event_is_not_mistaken_for_a_restart(stream: Any) -> None:
    s = stream()
    sent = hold_and_park(s, 1, 2, 3, 4)
    reader = WireCodec("replay-reader")
    for frames in sent[:2]:  # the ring's copy of 1..2
        s.sub.offer(reader.decode(frames))
    s.sub.release()
    got = s.receive(4)
    assert seqs(got) == [1, 2, 3, 4]
    assert s.nothing_more()
    assert s.sub.duplicates == 2


def test_release_without_replay_delivers_parked_events_in_arrival_order(stream: Any) -> None:
    s = stream()
    s.send(1, 2)
    assert seqs(s.receive(2)) == [1, 2]
    hold_and_park(s, 3, 4, 4, 6)
    assert s.sub.pop() is None
    s.sub.release()
    assert seqs(s.receive(3)) == [3, 4, 6]
    assert (s.sub.rejected, s.sub.duplicates, s.sub.missed) == ({"replay": 1}, 0, 1)  # the socket repeated 4
    s.send(7)
    assert seqs(s.receive(1)) == [7]  # normal delivery resumed


# --- arrays on the stream -----------------------------------------------------------------------------


def test_event_arrays_view_the_received_frame(stream: Any) -> None:
    s = stream()
    source = (np.arange(1000) % 251).astype(np.uint8).reshape(10, 100)  # uint8: any frame address is aligned
    s.publisher.publish(Blobs([FetchedBlob("b", {"x": source})]))
    (message,) = s.receive(1)
    array = message.body.blobs[0].arrays["x"]
    assert np.array_equal(array, source)
    assert isinstance(message.buffers[0], zmq.Frame)
    assert np.shares_memory(array, np.frombuffer(message.buffers[0], dtype=np.uint8))
    assert array.flags.writeable


TORCH_TAGGED = """
import json, sys, threading, time
import msgspec, zmq
from refbus.bus.pubsub import Subscriber
from refbus.bus.reqrep import Server
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS, bound_endpoint, make_socket
from refbus.protocol.codec import EXT_TORCH, checksum
from refbus.protocol.envelope import PROTOCOL_VERSION, WireCodec
from refbus.protocol.messages import EpisodeFinished, Replayed, ReplayedEvent, Sync

def event(seq):  # an episode-finished whose info holds a 1-byte array its sender tagged torch
    header = msgspec.msgpack.encode({"v": list(PROTOCOL_VERSION), "id": "evil-1", "src": "env-0", "seq": seq,
                                     "ts": 0.0})
    tagged = msgspec.msgpack.Ext(EXT_TORCH, msgspec.msgpack.encode(["uint8", [1], 0, checksum(b"\\0")]))
    body = msgspec.msgpack.encode({"episode_id": "e", "source": "s", "refs": [], "info": {"x": tagged}})
    return [b"episode-finished", header, body, b"\\0"]

seen = {}
ctx = zmq.Context()
pub = make_socket(ctx, zmq.PUB, bind="tcp://127.0.0.1:0", options=EVENT_OPTIONS)
sub = make_socket(ctx, zmq.SUB, connect=bound_endpoint(pub), options=EVENT_OPTIONS)
sub.setsockopt(zmq.SUBSCRIBE, b"")
subscriber = Subscriber(sub, WireCodec("orchestrator"), kinds=frozenset({EpisodeFinished.kind}))
subscriber.expect("live")
deadline = time.monotonic() + 10
while "live" not in subscriber.tokens and time.monotonic() < deadline:  # the subscription reaches the PUB
    pub.send_multipart(WireCodec("env-0").encode(Sync(token="live")))
    subscriber.recv(20)
pub.send_multipart(event(1))
seen["live"] = type(subscriber.recv(10_000).body.info["x"]).__module__

# What a runtime replays from the broker's ring (a gap fill, a --since merge) is decoded alike.
router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
ring = Server(router, WireCodec("bus"))
ring.on("replay", lambda _: Replayed(events=[ReplayedEvent(event(2))], more=False), cached=False)
broker = threading.Thread(target=ring.handle_one)
broker.start()
runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=bound_endpoint(router), node_id="orchestrator",
                                                      metrics_port=-1), register=False)
(replayed,) = runtime.replay(since=2)
broker.join()
seen["replayed"] = type(replayed.body.info["x"]).__module__
runtime.close()
seen["torch"] = "torch" in sys.modules
print(json.dumps(seen), flush=True)
"""


def test_an_event_whose_array_is_tagged_torch_never_makes_a_subscriber_import_torch() -> None:
    """Regression: subscribers decoded events with the sender's library, so any publisher could make the
    orchestrator (or an env server) import torch with one array tagged ext code 2. In a fresh interpreter
    (this one may have torch loaded): the event arrives live and from the ring, its array is numpy, and torch
    was never imported."""
    child = subprocess.run([sys.executable, "-c", TORCH_TAGGED], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == {"live": "numpy", "replayed": "numpy", "torch": False}


# --- the lean path --------------------------------------------------------------------------------------


def _state(sub: Subscriber) -> tuple[Any, ...]:
    ready = [(m.kind, m.header, m.body, list(m.buffers)) for m in sub._ready]
    return (ready, sub.received, sub.missed, sub.filled, sub.lost, sub.duplicates, sub.rejected, sub.last_seq,
            sub.tokens, sub.outside_topics, list(sub._sequences.items()))


@pytest.mark.parametrize("subscriber", [
    {}, {"kinds": frozenset({"delete"})}, {"kinds": frozenset({"delete"}), "topics": frozenset({"delete", "sync"})},
    {"parked": True},
], ids=["all", "kinds", "topics", "parked"])
def test_an_event_frame_as_bytes_and_as_a_memoryview_leave_a_subscriber_in_the_same_state(
    zmq_ctx: zmq.Context, subscriber: dict[str, Any]
) -> None:
    """A one-frame event received as ``bytes`` takes the lean path (``decode_header``'s first step, ``event_header``,
    then ``decode_body``); a memoryview of the same frame takes the general one. A stream with gaps (filled in part),
    replays, a restart, probes, kinds outside ``kinds`` and ``topics``, a kind nobody defines and every mutation of an
    event and of a probe leaves both subscribers with the same deliveries, counters and sequences."""
    parked = subscriber.pop("parked", False)
    rng = random.Random(16)
    first, restarted, other = WireCodec(SRC), WireCodec(SRC), WireCodec("env-1")
    ring = {seq: first.decode(first.encode(event(seq), seq=seq, one_frame=True)) for seq in (6, 12)}

    def fill(src: str, epoch: str, low: int, high: int) -> list[Message]:
        return [ring[seq] for seq in range(low, high + 1) if seq in ring]

    def one(codec: WireCodec, seq: int, body: Any = None) -> bytes:
        return codec.encode(body if body is not None else event(seq), seq=seq, one_frame=True)[0]

    stream = [one(first, seq) for seq in (1, 2, 3)] + [one(other, 1), one(first, 7), one(first, 2)]
    stream += [one(first, 8, VersionBump(version=3, nbytes=10, manifest_digest="d")), one(first, 9, Sync(token="p"))]
    stream += [one(first, 13), one(restarted, 1), one(restarted, 4), one(first, 14)]
    stream.append(one(first, 15).replace(b"delete", b"deletf", 1))  # a kind nobody defines
    for frame in (one(first, 16), one(first, 9, Sync(token="q"))):
        stream += [frame[:cut] for cut in range(len(frame))]
        for at in range(len(frame)):
            stream += [frame[:at] + bytes([value]) + frame[at + 1:] for value in (0, rng.randrange(256))]
    states = []
    for view in (bytes, memoryview):
        sub = Subscriber(zmq_ctx.socket(zmq.SUB), WireCodec("monitor"), fill=fill, **subscriber)
        for token in "pq":
            sub.expect(token)
        if parked:
            sub.hold()
        for frame in stream:
            (sub._park if parked else sub._take)([view(frame)])
        if parked:
            sub.release()
        states.append(_state(sub))
        sub.sock.close()
    assert states[0] == states[1]
    ready, received, missed, filled, lost, _, rejected = states[0][:7]
    assert len(ready) > 10 and received > 10 and missed and filled and lost and rejected
    assert rejected["replay"]  # the socket repeated 2, parked or not


def test_the_least_recently_seen_incarnation_is_forgotten_first(zmq_ctx: zmq.Context, monkeypatch: Any) -> None:
    """Sequences live in a dict whose order is recency: an event (a replay too) makes its incarnation the most
    recent, and past ``MAX_INCARNATIONS`` the least recent is forgotten, its source with it when the source has no
    other: its next event sets a new baseline, as a source never seen does (a restart would fill from 1 and
    deliver again what the ring still holds of it)."""
    monkeypatch.setattr(pubsub, "MAX_INCARNATIONS", 3)
    sub = Subscriber(zmq_ctx.socket(zmq.SUB), WireCodec("monitor"))
    codecs = {name: WireCodec(name) for name in "abcd"}
    order = []
    for name, seq in [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("d", 1), ("a", 2), ("b", 2), ("c", 3), ("d", 2)]:
        sub._take(codecs[name].encode(event(seq), seq=seq, one_frame=True))
        order.append("".join(src for src, _ in sub._sequences))
        assert list(sub._epochs) == list(order[-1]) and set(sub.last_seq) == set(order[-1])
    assert order == ["a", "ab", "abc", "bca", "cad", "cda", "dab", "abc", "bcd"]
    assert (sub.received, sub.missed, sub.lost, sub.rejected) == (8, 0, {}, {"replay": 1})
    assert sub.last_seq == {"b": 2, "c": 3, "d": 2}
    sub.sock.close()


def test_a_live_source_whose_sequence_other_incarnations_pushed_out_goes_on_from_its_last_number(
    zmq_ctx: zmq.Context, monkeypatch: Any
) -> None:
    """Past ``MAX_INCARNATIONS`` other incarnations (another source restarting, say), a live source's sequence is
    forgotten but not its source: its next event goes on from its last number (a gap filled as ever), where it
    used to be taken for a restart whose gap from 1 filled, and delivered again, everything the ring held of it.
    A probe of it still reveals a lost tail."""
    monkeypatch.setattr(pubsub, "MAX_INCARNATIONS", 4)
    source = WireCodec(SRC)
    ring = {seq: source.decode(source.encode(event(seq), seq=seq, one_frame=True)) for seq in range(1, 12)}
    fills: list[tuple[int, int]] = []

    def fill(src: str, epoch: str, first: int, last: int) -> list[Message]:
        fills.append((first, last))
        return [ring[seq] for seq in range(first, last + 1)]

    sub = Subscriber(zmq_ctx.socket(zmq.SUB), WireCodec("monitor"), fill=fill)

    def take(codec: WireCodec, seq: int, body: Any = None) -> list[int]:
        sub._take(codec.encode(body if body is not None else event(seq), seq=seq, one_frame=True))
        delivered = [m.header.seq for m in sub._ready if m.header.src == codec.src]
        sub._ready.clear()
        return delivered

    def restarts_elsewhere(count: int) -> None:
        for _ in range(count):  # a new incarnation of env-1 each time: a process restarted under the same id
            take(WireCodec("env-1"), 1)

    assert [take(source, seq) for seq in (1, 2, 3)] == [[1], [2], [3]]
    restarts_elsewhere(5)
    assert (SRC, incarnation(ring[1].header.id)) not in sub._sequences and SRC in sub._epochs
    assert take(source, 4) == [4] and take(source, 6) == [5, 6]
    restarts_elsewhere(5)
    sub._take(source.encode(Sync(token="tail"), seq=8))  # a probe: 7 and 8 went missing
    assert [m.header.seq for m in sub._ready] == [7, 8]
    sub._ready.clear()
    restarts_elsewhere(5)
    batch = source.encode_batch(event(0).kind, [source.batch_item(event(seq), seq) for seq in (8, 9, 10)])
    sub._take(batch)  # a parked batch that starts at a number the probe's fill delivered
    assert [m.header.seq for m in sub._ready] == [9, 10]
    assert fills == [(5, 5), (7, 8)] and (sub.missed, sub.filled, sub.lost_total) == (3, 3, 0)
    assert sub.last_seq[SRC] == 10 and sub.duplicates == 1 and not sub.rejected
    sub.sock.close()


def test_what_a_subscriber_keeps_is_bounded_whatever_the_sources_and_probes_and_totals_survive(
    zmq_ctx: zmq.Context, monkeypatch: Any
) -> None:
    """Every node's PUB handshake probes, and every source, reach every subscriber: a subscriber keeps only the
    tokens a handshake waits for, until it is over, and the state of the ``MAX_INCARNATIONS`` sources seen last;
    the events lost stay counted in ``lost_total`` when their source is forgotten."""
    monkeypatch.setattr(pubsub, "MAX_INCARNATIONS", 8)
    sub = Subscriber(zmq_ctx.socket(zmq.SUB), WireCodec("monitor"), fill=lambda *gap: [])
    for i in range(100):
        codec = WireCodec(f"src-{i}")
        sub._take(codec.encode(Sync(token=f"t-{i}")))
        for seq in (1, 3):  # 2 goes missing: lost
            sub._take(codec.encode(event(seq), seq=seq, one_frame=True))
    assert sub.tokens == set()
    assert len(sub._sequences) == len(sub._epochs) == len(sub.last_seq) == len(sub.lost) == 8
    assert sub.lost_total == 100 and (sub.received, sub.missed) == (200, 100)
    sub.expect("mine")
    sub._take(WireCodec("joining").encode(Sync(token="mine")))
    assert sub.tokens == {"mine"}
    sub.forget_token("mine")
    assert sub.tokens == set() and sub._expected == set()
    sub.sock.close()
