"""Streamed seal digests (``nodes/ps/streamed.py``): a tensor's streamed digest is given only when its bytes were
written exactly once, in order and whole; every other pattern of writes leaves the seal to hash the segment,
and whatever the pattern, the segment holds exactly the bytes written last."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from refbus.nodes.ps.streamed import BadLayout, StreamedDigests
from refbus.protocol.codec import checksum
from refbus.protocol.messages import Body
from refbus.protocol.messages_ps import ByteRange, ShardOpen

# Three tensors with a gap between the last two (alignment padding), and an empty one.
LAYOUT = [ByteRange(0, 100), ByteRange(100, 60), ByteRange(176, 40), ByteRange(216, 0)]
NBYTES = 216


def _shard() -> tuple[StreamedDigests, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return StreamedDigests(LAYOUT, NBYTES), np.zeros(NBYTES, np.uint8), rng.integers(0, 256, NBYTES, dtype=np.uint8)


def _write(streamed: StreamedDigests, segment: np.ndarray, offset: int, data: np.ndarray) -> None:
    streamed.write(segment[offset : offset + data.nbytes], offset, data)


def _pieces(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(at, min(at + size, end)) for at in range(start, end, size)]


def test_writes_once_in_order_give_each_tensors_digest() -> None:
    streamed, segment, data = _shard()
    for r in LAYOUT[:3]:
        for at, end in _pieces(r.offset, r.offset + r.nbytes, 16):
            _write(streamed, segment, at, data[at:end])
    assert bytes(segment[:160]) == data[:160].tobytes() and bytes(segment[176:]) == data[176:].tobytes()
    for r in LAYOUT[:3]:
        assert streamed.digest(r.offset, r.nbytes) == checksum(segment[r.offset : r.offset + r.nbytes])
    # Not a named range (the empty tensor is not tracked; a range inside one; a range across two): no digest.
    assert streamed.digest(216, 0) is None
    assert streamed.digest(0, 50) is None and streamed.digest(0, 160) is None and streamed.digest(10, 100) is None


def test_a_tensor_written_other_than_once_in_order_has_no_digest_and_the_segment_holds_the_last_bytes() -> None:
    streamed, segment, data = _shard()
    corrupt = data ^ 0xFF
    # Tensor 0 whole, then its middle written again with other bytes (an overlapping second write).
    _write(streamed, segment, 0, data[:100])
    _write(streamed, segment, 40, corrupt[40:60])
    # Tensor 1 out of order: its second half first.
    _write(streamed, segment, 130, data[130:160])
    _write(streamed, segment, 100, data[100:130])
    # Tensor 2 written twice over from the start (a retried write): each byte twice, in order each time.
    _write(streamed, segment, 176, data[176:216])
    _write(streamed, segment, 176, data[176:216])
    for r in LAYOUT[:3]:
        assert streamed.digest(r.offset, r.nbytes) is None
    assert bytes(segment[40:60]) == corrupt[40:60].tobytes() and bytes(segment[100:160]) == data[100:160].tobytes()


@pytest.mark.parametrize(
    "writes",
    [
        [(0, 50), (60, 100)],  # a gap, then the rest: the gap's bytes never came
        [(0, 50), (50, 120)],  # one write across the boundary into the next tensor
        [(90, 110)],  # across a boundary first
        [(150, 200)],  # from the padding into tensor 2
    ],
    ids=["gap", "past-its-end", "across-first", "from-padding"],
)
def test_writes_that_do_not_stay_in_one_tensors_stream_spoil_what_they_touch(writes: list[tuple[int, int]]) -> None:
    streamed, segment, data = _shard()
    for start, end in writes:
        _write(streamed, segment, start, data[start:end])
    touched = [r for r in LAYOUT[:3] if any(s < r.offset + r.nbytes and e > r.offset for s, e in writes)]
    # Writing the touched tensors whole and in order afterwards does not bring their digest back.
    for r in touched:
        _write(streamed, segment, r.offset, data[r.offset : r.offset + r.nbytes])
        assert streamed.digest(r.offset, r.nbytes) is None


def test_a_write_into_padding_only_spoils_nothing_and_a_tensor_half_written_has_no_digest() -> None:
    streamed, segment, data = _shard()
    _write(streamed, segment, 160, data[160:176])
    _write(streamed, segment, 176, data[176:200])
    assert streamed.digest(176, 40) is None  # only 24 of its 40 bytes came
    _write(streamed, segment, 200, data[200:216])
    assert streamed.digest(176, 40) == checksum(data[176:216])


@pytest.mark.parametrize(
    ("ranges", "why"),
    [
        ([ByteRange(0, 100), ByteRange(100, 117)], "past the shard's 216 bytes"),
        ([ByteRange(300, 1)], "past the shard's"),
        ([ByteRange(0, 100), ByteRange(99, 10)], "overlap the tensor at 99"),
        ([ByteRange(50, 10), ByteRange(0, 100)], "overlap the tensor at 50"),  # given out of order
        ([ByteRange(10, 20), ByteRange(10, 20)], "overlap"),  # the same range twice
    ],
)
def test_garbage_ranges_are_refused_by_name(ranges: list[ByteRange], why: str) -> None:
    with pytest.raises(BadLayout, match=why):
        StreamedDigests(ranges, NBYTES)


def test_ranges_that_do_not_match_the_sealed_tensors_give_no_digest() -> None:
    """The open named the first tensor as two halves (a wrong count): the seal's whole tensor matches neither."""
    streamed = StreamedDigests([ByteRange(0, 50), ByteRange(50, 50)], NBYTES)
    segment, data = np.zeros(NBYTES, np.uint8), np.arange(NBYTES, dtype=np.uint8)
    _write(streamed, segment, 0, data[:100])  # crosses the named boundary: both halves spoiled
    assert streamed.digest(0, 100) is None and streamed.digest(0, 50) is None


class _OlderShardOpen(Body, frozen=True):
    """``ps-shard-open`` as builds before the tensor ranges declared it."""

    lease: str
    nbytes: int


def test_the_optional_ranges_travel_between_older_and_newer_peers_in_both_directions() -> None:
    newer = ShardOpen("L-1", 4096, [ByteRange(0, 1024), ByteRange(1024, 3072)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(newer), type=_OlderShardOpen) == _OlderShardOpen("L-1", 4096)
    from_older = msgspec.msgpack.decode(msgspec.msgpack.encode(_OlderShardOpen("L-1", 4096)), type=ShardOpen)
    assert from_older == ShardOpen("L-1", 4096) and from_older.tensors == []
    assert msgspec.msgpack.encode(ShardOpen("L-1", 4096)) == msgspec.msgpack.encode(_OlderShardOpen("L-1", 4096))
