"""A segment of a ps-worker's pool made in one call, for tests that need one ready (the worker itself makes its
segments a slice a loop turn)."""

from __future__ import annotations

from refbus.nodes.ps.shm import Segment, SegmentPool, segment_bytes


def acquire(pool: SegmentPool, nbytes: int) -> Segment:
    """A segment of at least ``nbytes`` from ``pool``, made at once, owned by the caller until ``pool.release``.
    Raises OSError (``ENOSPC`` when the tmpfs has no room)."""
    segment = pool.allocate(nbytes, slice_bytes=segment_bytes(nbytes)).step()
    assert segment is not None, "one step makes a segment of one slice"
    return segment
