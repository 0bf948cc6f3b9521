"""The broker's replay ring: bounds, paging by cursor across interleaved sources, and events indexed (source,
sequence number) only when a replay first looks at them, unreadable ones and those too large for an answer
skipped and counted; replays and gap fills through an in-process broker around an event too large to replay, and
a resumption's replays bounded like gap fills."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from refbus.bus.broker import Broker, BrokerSettings, ReplayRing
from refbus.bus.forwarder import held_bytes
from refbus.bus.reqrep import RequestTimeout
from refbus.bus.runtime import FILL_SHARE, NodeRuntime, RuntimeSettings
from refbus.protocol.envelope import Limits, WireCodec, incarnation
from refbus.protocol.messages import Delete, Replayed, ReplayedEvent
from structlog.testing import capture_logs

T = TypeVar("T")
WAIT_S = 10.0
LOOPBACK = "tcp://127.0.0.1:0"


def _index(frames: list) -> tuple[str, int] | None:
    """A stand-in header: the source and sequence number in the first two frames ("bad": unreadable)."""
    return None if frames[0] == b"bad" else (frames[0].decode(), int(frames[1]))


def ring_of(max_events: int, max_bytes: int) -> ReplayRing:
    return ReplayRing(max_events=max_events, max_bytes=max_bytes, index=_index)


def _fill(ring: ReplayRing, events: list[tuple[str, int]]) -> None:
    for src, seq in events:
        ring.append([src.encode(), f"{seq:06d}".encode(), b"x" * 13])


def test_pages_cover_every_matching_event_once_whatever_the_sources_seqs() -> None:
    ring = ring_of(100, 1 << 20)
    # Two sources whose seqs interleave: paging by seq would skip one source's events.
    events = [("a", i) if i % 2 else ("b", i * 10) for i in range(1, 21)]
    _fill(ring, events)
    seen, cursor, more = [], 0, True
    while more:
        page, cursor, more = ring.select(since=0, src="", limit=3, max_bytes=1 << 20, cursor=cursor)
        seen += [(e.src, e.seq) for e in page]
    assert seen == events
    (page, _, more) = ring.select(since=100, src="b", limit=50, max_bytes=1 << 20, cursor=0)
    assert [e.seq for e in page] == [100, 120, 140, 160, 180, 200] and not more


def test_ring_is_bounded_by_count_and_bytes_and_cursors_survive_eviction() -> None:
    ring = ring_of(5, 1 << 20)
    _fill(ring, [("a", i) for i in range(1, 9)])
    assert len(ring) == 5 and ring.evicted == 3
    page, cursor, more = ring.select(since=0, src="", limit=2, max_bytes=1 << 20, cursor=0)
    assert [e.seq for e in page] == [4, 5] and more and cursor == 5
    _fill(ring, [("a", 9), ("a", 10)])  # evicts 4 and 5: the cursor still points past them
    page, cursor, more = ring.select(since=0, src="", limit=10, max_bytes=1 << 20, cursor=cursor)
    assert [e.seq for e in page] == [6, 7, 8, 9, 10] and not more

    entry = held_bytes([b"a", b"000001", b"x" * 13], 20)  # what each entry is charged
    small = ring_of(100, 3 * entry)
    _fill(small, [("a", i) for i in range(1, 6)])
    assert len(small) == 3 and small.nbytes == 3 * entry
    page, _, more = small.select(since=0, src="", limit=10, max_bytes=30, cursor=0)
    assert len(page) == 1 and more  # a page stops at about max_bytes, but always holds one event


def test_events_are_indexed_once_when_a_replay_first_needs_them_and_unreadable_ones_are_skipped() -> None:
    calls: list[bytes] = []

    def counting(frames: list) -> tuple[str, int] | None:
        calls.append(frames[1])
        return _index(frames)

    ring = ReplayRing(max_events=10, max_bytes=1 << 20, index=counting)
    _fill(ring, [("a", 1), ("a", 2)])
    ring.append([b"bad", b"garbage"])
    ring.append([b"a", b"3", b"x"], ("a", 3))  # indexed by the caller already
    assert calls == []  # appending reads no header
    page, _, _ = ring.select(since=0, src="a", limit=10, max_bytes=1 << 20, cursor=0)
    assert [e.seq for e in page] == [1, 2, 3] and ring.unreadable == 1
    ring.select(since=0, src="", limit=10, max_bytes=1 << 20, cursor=0)
    assert len(calls) == 3  # a second replay reads nothing again


def test_bytes_stay_exact_across_drains_larger_than_the_ring() -> None:
    """A capture drain hands in up to 4096 messages at once, more than a small ring holds: only the newest are
    kept, the rest count as appended and evicted, and the byte count is what the ring holds, drain after drain
    (it used to count the bytes of what the deque dropped, until the byte bound evicted all but one)."""
    ring = ring_of(10, 1 << 20)
    seq = 0
    for count in (25, 3, 10, 11, 40):  # larger than the ring, smaller, equal, one more, larger again
        entries = [[b"a", f"{seq + i:06d}".encode(), b"x" * (seq + i)] for i in range(1, count + 1)]
        ring.extend(entries, [sum(map(len, frames)) for frames in entries])
        seq += count
        page, _, _ = ring.select(since=0, src="", limit=100, max_bytes=1 << 20, cursor=0)
        assert [e.seq for e in page] == list(range(seq - len(ring) + 1, seq + 1)) and len(ring) == 10
        assert ring.nbytes == sum(sum(map(len, e.frames)) for e in page)
        assert ring.appended == seq and ring.evicted == seq - 10
    bounded = ring_of(10, 1000)  # and the byte bound still holds what fits, not one message
    bounded.extend([[b"a", b"000001", b"x" * 93]] * 30, [100] * 30)
    assert len(bounded) == 10 and bounded.nbytes == 1000


def test_what_was_read_of_an_entry_goes_with_it_when_it_is_evicted() -> None:
    """With CURVE every event comes with its (source, seq) already read, and a replay remembers what it read:
    those keys are dropped as their entries are evicted (by count or by bytes), not only when a replay runs, so a
    broker nobody asks for a replay holds no more keys than entries."""
    ring = ring_of(10, 1 << 20)
    for seq in range(1, 1001):
        ring.append([b"a", f"{seq:06d}".encode(), b"x"], ("a", seq))
        assert len(ring._keys) <= len(ring) == min(seq, 10)
    page, _, _ = ring.select(since=0, src="", limit=100, max_bytes=1 << 20, cursor=0)
    assert [e.seq for e in page] == list(range(991, 1001))

    _fill(ring, [("b", seq) for seq in range(1, 6)])  # read by a replay, then evicted by a drain of the capture
    ring.select(since=0, src="b", limit=100, max_bytes=1 << 20, cursor=0)
    ring.extend([[b"c", f"{seq:06d}".encode(), b"x"] for seq in range(1, 26)], [10] * 25)
    assert ring._keys == {}
    bounded = ring_of(100, 10 * held_bytes([b"a", b"000001", b"xyz"], 10))  # the byte bound evicts
    for seq in range(1, 101):
        bounded.append([b"a", f"{seq:06d}".encode(), b"xyz"], ("a", seq))
    assert len(bounded) == 10 and sorted(bounded._keys) == list(range(90, 100))


def test_a_message_no_answer_can_carry_is_skipped_counted_once_and_passed_by_the_cursor() -> None:
    """A message too large for a ``replayed`` answer within the body limit (an event near the limit in one frame,
    one with many or large array frames) used to be sent alone on a page the asking peer refuses: every replay that
    reached it failed, and its cursor never passed it. It is skipped: the messages after it still come, it is
    counted (once, however many replays pass it) and logged once."""
    ring = ring_of(100, 16 << 20)
    _fill(ring, [("a", 1)])
    ring.append([b"a", b"000002", b"x" * 950])  # one frame too large for a 1000-byte answer
    ring.append([b"a", b"000003", *[b""] * 5000])  # more frames than an answer carries
    _fill(ring, [("b", 1), ("a", 4)])
    answer = Limits(max_body_bytes=1000)
    with capture_logs() as logs:
        page, cursor, more = ring.select(since=0, src="", limit=10, max_bytes=500, cursor=0, reply_limits=answer)
        assert [(e.src, e.seq) for e in page] == [("a", 1), ("b", 1), ("a", 4)] and not more
        assert cursor == ring.appended and ring.too_large == 2
        page, _, _ = ring.select(since=2, src="a", limit=10, max_bytes=500, cursor=0, reply_limits=answer)
        assert [e.seq for e in page] == [4]  # a gap fill of 2..4 gets 4: 2 and 3 are counted lost by its reader
        page, cursor, more = ring.select(since=2, src="a", limit=1, max_bytes=500, cursor=0, reply_limits=answer)
        assert [e.seq for e in page] == [4] and not more
    assert ring.too_large == 2
    assert [(entry["event"], entry["seq"]) for entry in logs] == [("ring.too_large", 2), ("ring.too_large", 3)]
    # What fits an answer alone still comes alone, above the page's byte budget.
    page, _, _ = ring.select(since=0, src="a", limit=10, max_bytes=10, cursor=0, reply_limits=Limits())
    assert [e.seq for e in page] == [1]


MANY_FRAMES = 4096  # frames of each message the tests below keep: many, and within what a message may have


def test_messages_of_many_frames_are_charged_per_frame_against_the_byte_bound() -> None:
    """The byte bound used to count frame bytes only: messages of thousands of empty frames cost nothing, and a
    ring bound to 256 MiB held gigabytes of frame objects. Each frame of a kept message is charged what holding
    it costs."""
    ring = ring_of(100, 4 << 20)
    frames = [b"a", b"000001", *[b""] * (MANY_FRAMES - 2)]
    ring.append(frames)
    assert ring.nbytes == held_bytes(frames, 7) > MANY_FRAMES * 100
    for seq in range(2, 11):
        ring.append([b"a", f"{seq:06d}".encode(), *[b""] * (MANY_FRAMES - 2)])
    assert len(ring) == 3 and ring.evicted == 7 and ring.nbytes == 3 * held_bytes(frames, 7)


@pytest.mark.parametrize("limits", [Limits(max_body_bytes=256 << 10), Limits(max_items=100_000)],
                         ids=["body-bytes", "list-elements"])
def test_a_page_of_messages_of_many_frames_fits_the_asking_peers_limits(limits: Limits) -> None:
    """A page's budget used to count frame bytes only: messages of many empty frames made a page whose body was
    over the asking peer's body limit, or held more list elements than its ``max_items``, and every replay or gap
    fill over them was refused. Each message is counted by its frames too: every page decodes, and together they
    hand over every message."""
    ring = ring_of(100, 1 << 30)
    for seq in range(1, 41):
        ring.append([b"a", f"{seq:06d}".encode(), *[b""] * (MANY_FRAMES - 2)])
    broker, peer = WireCodec("bus", limits=limits), WireCodec("asker", limits=limits)
    seen, cursor, more = [], 0, True
    while more:  # as the broker's replay handler asks
        page, cursor, more = ring.select(0, "a", 10_000, limits.max_body_bytes // 2, cursor, limits)
        answer = Replayed(events=[ReplayedEvent([bytes(f) for f in e.frames]) for e in page], more=more,
                          cursor=cursor)
        body = peer.decode(broker.encode(answer, reply_to="x-1")).body
        assert isinstance(body, Replayed)
        seen += [int(event.frames[1]) for event in body.events]
    assert seen == list(range(1, 41))


def on_loop(runtime: NodeRuntime, work: Callable[[], T]) -> T:
    """Run ``work`` on ``runtime``'s loop thread and return its result."""
    done = threading.Event()
    result: list[T] = []
    runtime.call_soon(lambda: (result.append(work()), done.set()))
    assert done.wait(WAIT_S), "the loop did not run the call"
    return result[0]


@pytest.fixture
def small_bus() -> Iterator[tuple[Broker, Limits]]:
    """An in-process broker whose nodes take bodies of 4 KiB at most."""
    limits = Limits(max_body_bytes=4096)
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1, limits=limits), register=False)
    broker = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK))
    runtime.start_background()
    yield broker, limits
    runtime.join(WAIT_S)


def test_replays_and_gap_fills_across_an_event_too_large_to_replay_return_what_follows(
    small_bus: tuple[Broker, Limits]
) -> None:
    """An event whose body is within the limit (subscribers take it live) but whose one frame is not, inside a
    ``replayed`` answer: a replay of its source still returns the events after it, and a gap fill over it fills
    the others and counts it lost, where the asking peer used to refuse every page as too large (a gap fill
    always failed, and a ``subscribe(since=)`` or a resumption after a broker restart failed the node)."""
    broker, limits = small_bus
    control = broker.runtime.endpoints["control"]
    publisher = NodeRuntime("tester", RuntimeSettings(bus=control, node_id="pub", metrics_port=-1, limits=limits))
    reader = NodeRuntime("reader", RuntimeSettings(bus=control, node_id="reader", metrics_port=-1, limits=limits),
                         register=False)
    publisher.start_background()
    try:
        # A body of 4070 bytes, within the limit; its frame (with the kind and header) is 4130.
        big = Delete(blob_ids=["b" * 100] * 39 + ["c" * 50], holder="pub", reason="filtered")
        small = [Delete(blob_ids=[f"b{i}"], holder="pub", reason="filtered") for i in (1, 3)]

        def publish_each_alone() -> list[int]:  # not as one batch: each event its own message
            sent = []
            for body in (small[0], big, small[1]):
                sent.append(publisher.publish(body))
                publisher.publisher.flush()
            return sent

        assert on_loop(publisher, publish_each_alone) == [1, 2, 3]
        assert on_loop(publisher, publisher.flush_events)
        with capture_logs() as logs:
            events = reader.replay(since=0, src="pub", deadline_s=WAIT_S)
            assert [m.header.seq for m in events] == [1, 3]
            epoch = incarnation(events[0].header.id)
            assert [m.header.seq for m in reader.replay_range("pub", epoch, 1, 3)] == [1, 3]
        assert broker.ring.too_large == 1
        assert [entry["seq"] for entry in logs if entry["event"] == "ring.too_large"] == [2]
        assert broker._dropped_readings()[("too-large",)] == 1.0
    finally:
        reader.close()
        publisher.join(WAIT_S)


def test_a_resumption_after_a_broker_restart_replays_within_the_fill_deadline_and_goes_on_without(
    small_bus: tuple[Broker, Limits], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumption runs on the loop thread: its replays end within the fill deadline (not the retry policy's 14 s
    a page, which stopped the heartbeats until the node was declared down), and one that does not is logged, not
    raised (the re-join is not failed and tried again for ever)."""
    broker, limits = small_bus
    control = broker.runtime.endpoints["control"]
    node = NodeRuntime("tester", RuntimeSettings(bus=control, node_id="sub", metrics_port=-1, limits=limits))
    node.subscribe(lambda message: None)
    node.start_background()
    asked: list[float | None] = []

    def unanswered_replay(*, since: int = 0, deadline_s: float | None = None, **_: object) -> list:
        asked.append(deadline_s)
        raise RequestTimeout("the broker did not answer in time")

    def resume() -> BaseException | None:
        try:
            node._resume_subscriptions(time.monotonic() + node.fill_deadline_s())
        except Exception as exc:
            return exc
        return None

    try:
        monkeypatch.setattr(node, "replay", unanswered_replay)
        with capture_logs() as logs:
            assert on_loop(node, resume) is None
        assert len(asked) == 1 and asked[0] is not None and 0 < asked[0] <= FILL_SHARE * node.welcome.node_timeout
        assert [entry["event"] for entry in logs if entry["event"].startswith("replay.")] == ["replay.resume_failed"]
    finally:
        node.join(WAIT_S)


def test_the_gap_fills_a_resumption_reveals_get_a_deadline_of_their_own(
    small_bus: tuple[Broker, Limits], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole-ring replay a busy broker cuts off at the resumption's deadline leaves the events it would have
    brought to the gap fills that the parked events then reveal. Before, those fills shared the replay's deadline,
    already spent, so every gap was counted lost at once (a broker restart with eight nodes re-joining lost every
    event of its downtime); now the parked events are released, and their fills run, under a deadline of their own,
    after every subscription is proved."""
    broker, limits = small_bus
    control = broker.runtime.endpoints["control"]
    node = NodeRuntime("tester", RuntimeSettings(bus=control, node_id="sub", metrics_port=-1, limits=limits))
    subscriber = node.subscribe(lambda message: None)
    node.start_background()
    left_at_release: list[float] = []

    def replay_cut_off(*, deadline_s: float | None = None, **_: object) -> list:
        assert deadline_s is not None
        node._fill_end = time.monotonic()  # a broker too busy to answer: the turn's deadline is spent
        raise RequestTimeout("the broker did not answer in time")

    release = subscriber.release

    def release_and_measure() -> None:
        left_at_release.append(node._turn_deadline() - time.monotonic())
        release()

    def resume() -> None:
        node._fill_end = None  # a fresh turn
        node._resume_subscriptions(node._turn_deadline())

    try:
        monkeypatch.setattr(node, "replay", replay_cut_off)
        monkeypatch.setattr(subscriber, "release", release_and_measure)
        on_loop(node, resume)
        assert len(left_at_release) == 1 and left_at_release[0] > FILL_SHARE * node.welcome.node_timeout / 2, \
            left_at_release
    finally:
        node.join(WAIT_S)
