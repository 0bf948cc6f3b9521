"""Tensor checksums taken while a shard's frames are written, so a worker's seal need not read them again.

A cross-host push arrives as ``ps-shard-write`` pieces, each copied into the segment. Hashing every tensor
from the segment at seal is a whole extra pass over the shard that nothing overlaps (~0.15 s a GiB here).
When the pusher names its tensors' byte ranges at open, :class:`StreamedDigests` hashes each piece as it is
copied (:func:`~refbus.protocol.codec.copy_hashing`, one pass over the bytes) and the seal uses that digest.

Why the check stays as strong: a streamed digest is used only for a tensor whose range, since the ranges were
named, was written exactly once, contiguously and in order, from its first byte to its last, through
:meth:`StreamedDigests.write`. Every write into a segment that comes through the worker goes through it, and
any other write touching a tensor's range (overlapping, repeated, out of order, a gap, or crossing into
another tensor) spoils that tensor, which the seal then hashes from the segment. So the digest is of exactly
the bytes in the segment at seal. The one writer that bypasses the worker is a process on the worker's host
that maps the segment file itself, which is the same-host pusher (whose writes never travel as frames, so its
tensors are never complete here and are hashed from the segment) or something with the segment files'
permissions, which could equally change the bytes after any seal.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import numpy as np
import xxhash

from ...protocol.codec import Buffer, copy_hashing
from ...protocol.messages_ps import ByteRange


class BadLayout(ValueError):
    """Tensor ranges that cannot describe a shard: past its end or overlapping."""


class StreamedDigests:
    """Per-tensor xxh3 digests of one shard, streamed as its bytes are written (see the module doc).

    Zero-byte tensors are not tracked (hashing them from the segment costs nothing).
    """

    def __init__(self, ranges: Sequence[ByteRange], nbytes: int) -> None:
        """Raises:
            BadLayout: a range ends past ``nbytes`` or two ranges share a byte.
        """
        spans = sorted((r.offset, r.nbytes) for r in ranges if r.nbytes)
        for offset, size in spans:
            if offset + size > nbytes:
                raise BadLayout(f"tensor bytes [{offset}, {offset + size}) are past the shard's {nbytes} bytes")
        for (offset, size), (after, _) in itertools.pairwise(spans):
            if offset + size > after:
                raise BadLayout(f"tensor bytes [{offset}, {offset + size}) overlap the tensor at {after}")
        self._starts = [offset for offset, _ in spans]
        self._sizes = [size for _, size in spans]
        self._done = [0] * len(spans)  # bytes streamed in order from each tensor's start; -1: spoiled
        self._digests = [xxhash.xxh3_64() for _ in spans]

    def write(self, target: np.ndarray, offset: int, source: Buffer) -> None:
        """Copy ``source`` into ``target`` (the segment's writable uint8 view of the bytes at ``offset``, of the
        same length), hashing it on the way when it continues exactly one tensor's stream; otherwise copy it
        and spoil every tensor it touches."""
        nbytes = target.nbytes
        if not nbytes:
            return
        end = offset + nbytes
        index = bisect.bisect_right(self._starts, offset) - 1
        if index >= 0:
            start, size, done = self._starts[index], self._sizes[index], self._done[index]
            if done >= 0 and offset == start + done and end <= start + size:
                copy_hashing(target, source, self._digests[index])
                self._done[index] = done + nbytes
                return
        target[:] = np.frombuffer(source, np.uint8)
        index = max(index, 0)
        while index < len(self._starts) and self._starts[index] < end:
            if self._starts[index] + self._sizes[index] > offset:
                self._done[index] = -1
            index += 1

    def digest(self, offset: int, nbytes: int) -> int | None:
        """The streamed xxh3-64 of the tensor at ``[offset, offset + nbytes)``, or None when it is not one of the
        named ranges or its bytes were not written exactly once, in order, whole (hash the segment instead)."""
        index = bisect.bisect_left(self._starts, offset)
        if index == len(self._starts) or self._starts[index] != offset or self._sizes[index] != nbytes:
            return None
        if self._done[index] != nbytes:
            return None
        return self._digests[index].intdigest()
