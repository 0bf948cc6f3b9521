"""Cross-host pulls as ZeroMQ frames: a shard's tensors read from a worker in pieces, straight into their
destination.

Why pieces: ZeroMQ allocates each received frame. A frame of tens of MiB is a fresh ``mmap`` whose pages
are faulted in as the bytes arrive and unmapped once it is freed, so every pull paid first-touch (~1.5 GB/s
on these machines) on every byte. Frames of at most :data:`PIECE_BYTES` come from the heap instead, which
glibc reuses from one piece to the next (:func:`refbus.bus.memory.keep_receive_memory`, which readers and
workers call, keeps that heap from being handed back between pulls), so
they land in memory already in use; the one copy into the destination reads them while they are hot.

Why one check: frames are not hashed on decode. Each tensor is hashed once, streaming over its pieces,
against the manifest's checksum: the end-to-end check of the bytes the pusher wrote (a frame corrupted in
transit fails it the same way). The hash rides on the copy into the destination
(:func:`~refbus.protocol.codec.copy_hashing`), so each piece is read from memory once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ...bus.reqrep import Client, Pipeline, RemoteError, RequestTimeout
from ...protocol.codec import copy_hashing
from ...protocol.envelope import MAX_BUFFERS, Message
from ...protocol.messages_ps import ByteRange, ManifestEntry, ShardData, ShardRead

PIECE_BYTES = 4 << 20  # well under glibc's 32 MiB mmap threshold ceiling, large enough that per-frame work is noise


@dataclass(frozen=True, slots=True)
class Wanted:
    """One tensor to read: its manifest entry and where its bytes start in ``segment``."""

    entry: ManifestEntry
    offset: int
    segment: str


class FramesError(Exception):
    """A read failed (the request's outcome) or a tensor does not match its manifest checksum."""


def _pieces(wanted: Sequence[Wanted], piece_bytes: int) -> Iterator[tuple[int, ByteRange]]:
    """``(index into wanted, range)`` for every piece, in order."""
    for index, item in enumerate(wanted):
        nbytes = item.entry.nbytes
        for start in range(0, nbytes, piece_bytes):
            yield index, ByteRange(item.offset + start, min(piece_bytes, nbytes - start))


def read_frames(worker: Client, wanted: Sequence[Wanted], destination: Callable[[ManifestEntry], torch.Tensor], *,
                chunk_bytes: int, window: int, piece_bytes: int = PIECE_BYTES,
                first_write: Callable[[ManifestEntry], None] | None = None) -> list[torch.Tensor]:
    """Read every ``wanted`` tensor from ``worker`` into ``destination(entry)`` (a writable, contiguous flat
    uint8 tensor of ``entry.nbytes``, e.g. a view of the caller's output or a fresh buffer); the destinations,
    in order, each verified against its entry's checksum.

    Requests carry up to ``chunk_bytes`` of pieces of one segment (and at most ``MAX_BUFFERS`` pieces: each
    comes back as a frame of the reply), ``window`` in flight; each reply's pieces are
    copied into their destinations as it arrives and released, so about ``window`` replies' frames are held.
    The first request that fails ends the read (no later one is sent).
    ``first_write(entry)`` runs before the first byte of a tensor is written into its destination: a caller
    writing into tensors it already holds learns exactly which ones a failed read changed.

    Raises:
        FramesError: a request failed (its outcome is the cause) or a tensor's bytes do not match.
    """
    targets = [destination(item.entry) for item in wanted]
    views = [t.numpy() if t.numel() else np.empty(0, np.uint8) for t in targets]
    hashes = [xxhash.xxh3_64() for _ in wanted]
    hashed = [0] * len(wanted)  # bytes of each tensor hashed so far: its checksum is over them in order
    # Pieces copied ahead of what is hashed (a reply that overtook an earlier one, resent after a loss): start ->
    # bytes, hashed from the destination once the bytes before them are.
    ahead: list[dict[int, int]] = [{} for _ in wanted]
    written = [False] * len(wanted)
    requests: list[tuple[ShardRead, list[tuple[int, int]]]] = []  # request, [(index, start in the tensor)]
    size = 0
    for index, piece in _pieces(wanted, piece_bytes):
        segment = wanted[index].segment
        if not requests or size + piece.nbytes > chunk_bytes or requests[-1][0].segment != segment or \
                len(requests[-1][0].ranges) == MAX_BUFFERS:
            requests.append((ShardRead(segment, []), []))
            size = 0
        requests[-1][0].ranges.append(piece)
        requests[-1][1].append((index, piece.offset - wanted[index].offset))
        size += piece.nbytes

    def arrived(number: int, reply: Message) -> None:
        read, places = requests[number]
        data = reply.body
        if not isinstance(data, ShardData) or len(data.data) != len(read.ranges):
            raise FramesError(f"{worker.endpoint} answered a read of {len(read.ranges)} ranges with {data.kind}")
        for (index, start), array, piece in zip(places, data.data, read.ranges, strict=True):
            if array.nbytes != piece.nbytes:
                raise FramesError(f"{worker.endpoint} sent {array.nbytes} bytes for a range of {piece.nbytes}")
            if not written[index]:
                written[index] = True
                if first_write is not None:
                    first_write(wanted[index].entry)
            view, end = views[index], start + piece.nbytes
            if start != hashed[index]:
                view[start:end] = np.frombuffer(array, np.uint8)
                ahead[index][start] = piece.nbytes
                continue
            copy_hashing(view[start:end], array, hashes[index])
            while (later := ahead[index].pop(end, None)) is not None:
                hashes[index].update(view[end : end + later])
                end += later
            hashed[index] = end

    # Requests are handed over one at a time, so a failed one ends the read at once: the rest are never sent,
    # and a dead worker costs one request's deadline, not one per window's worth of requests.
    stream = Pipeline(window=window, backend="numpy", verify=False, on_reply=arrived)
    for read, _ in requests:
        stream.add(worker, read)
        stream.wait(until=lambda: not stream.waiting(worker))
        _raise_failed(worker, stream.outcomes)
    stream.wait()
    _raise_failed(worker, stream.outcomes)
    for item, digest in zip(wanted, hashes, strict=True):
        if digest.intdigest() != item.entry.checksum:
            raise FramesError(f"tensor {item.entry.name!r} does not match the checksum of its manifest")
    return targets


def _raise_failed(worker: Client, outcomes: Sequence[Message | RemoteError | RequestTimeout | None]) -> None:
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise FramesError(f"reading from {worker.endpoint} failed: {outcome}") from outcome
