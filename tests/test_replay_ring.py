"""The broker's replay ring: bounds, paging by cursor across interleaved sources, and events indexed (source,
sequence number) only when a replay first looks at them, unreadable ones skipped and counted."""

from __future__ import annotations

from refbus.bus.broker import ReplayRing


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

    small = ring_of(100, 60)  # each entry is 20 bytes
    _fill(small, [("a", i) for i in range(1, 6)])
    assert len(small) == 3 and small.nbytes == 60
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
    bounded = ring_of(100, 100)  # each entry is 10 bytes: the byte bound evicts
    for seq in range(1, 101):
        bounded.append([b"a", f"{seq:06d}".encode(), b"xyz"], ("a", seq))
    assert len(bounded) == 10 and sorted(bounded._keys) == list(range(90, 100))
