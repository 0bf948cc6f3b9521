"""The broker's replay ring: bounds, and paging by cursor across interleaved sources."""

from __future__ import annotations

from refbus.bus.broker import ReplayRing


def _fill(ring: ReplayRing, events: list[tuple[str, int]]) -> None:
    for src, seq in events:
        ring.append(src, seq, [b"kind", b"header", b"x" * 10])


def test_pages_cover_every_matching_event_once_whatever_the_sources_seqs() -> None:
    ring = ReplayRing(max_events=100, max_bytes=1 << 20)
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
    ring = ReplayRing(max_events=5, max_bytes=1 << 20)
    _fill(ring, [("a", i) for i in range(1, 9)])
    assert len(ring) == 5 and ring.evicted == 3
    page, cursor, more = ring.select(since=0, src="", limit=2, max_bytes=1 << 20, cursor=0)
    assert [e.seq for e in page] == [4, 5] and more and cursor == 5
    _fill(ring, [("a", 9), ("a", 10)])  # evicts 4 and 5: the cursor still points past them
    page, cursor, more = ring.select(since=0, src="", limit=10, max_bytes=1 << 20, cursor=cursor)
    assert [e.seq for e in page] == [6, 7, 8, 9, 10] and not more

    small = ReplayRing(max_events=100, max_bytes=60)  # each entry is 20 bytes
    _fill(small, [("a", i) for i in range(1, 6)])
    assert len(small) == 3 and small.nbytes == 60
    page, _, more = small.select(since=0, src="", limit=10, max_bytes=30, cursor=0)
    assert len(page) == 1 and more  # a page stops at about max_bytes, but always holds one event
