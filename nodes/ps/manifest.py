"""Manifests: how a shard is laid out, what a committed version holds, and the checks between the two.

Pure functions over the wire structs of :mod:`refbus.protocol.messages_ps`; no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec
import xxhash

from ...protocol.codec import dtype_width
from ...protocol.errors import ArrayError
from ...protocol.messages_ps import Manifest, ManifestEntry, ShardTensor, TensorSpec, WorkerInfo

# Tensors start on 64-byte boundaries: a cache line, and enough for any SIMD load on a view of a segment.
ALIGN = 64


class ManifestError(ValueError):
    """A layout, shard or push that does not match what it must. ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor; ManifestError(``bad-dtype``) for a dtype the codec cannot carry."""
    try:
        width = dtype_width(dtype)
    except ArrayError as exc:
        raise ManifestError("bad-dtype", str(exc)) from None
    return math.prod(shape) * width


def layout(specs: Iterable[TensorSpec], *, align: int = ALIGN) -> tuple[list[ShardTensor], int]:
    """Offsets for ``specs`` packed in order into one segment; returns the tensors and the segment size.

    Raises ManifestError(``duplicate-name``) when a name repeats.
    """
    placed: list[ShardTensor] = []
    seen: set[str] = set()
    offset = 0
    for spec in specs:
        if spec.name in seen:
            raise ManifestError("duplicate-name", f"tensor {spec.name!r} appears twice in one push")
        seen.add(spec.name)
        nbytes = tensor_nbytes(spec.dtype, spec.shape)
        placed.append(ShardTensor(spec.name, spec.dtype, list(spec.shape), offset, nbytes))
        offset += -(-nbytes // align) * align
    return placed, offset


def check_shard(expected: Sequence[ShardTensor], got: Sequence[ShardTensor]) -> None:
    """A committed shard must be the granted layout, tensor for tensor (checksums aside).

    Raises ManifestError(``manifest-mismatch``) naming the first difference.
    """
    if [t.name for t in got] != [t.name for t in expected]:
        missing = sorted({t.name for t in expected} - {t.name for t in got})
        extra = sorted({t.name for t in got} - {t.name for t in expected})
        raise ManifestError(
            "manifest-mismatch",
            f"shard tensors differ from the granted layout (missing {missing[:5]}, unexpected {extra[:5]}, "
            "or a different order)",
        )
    for want, have in zip(expected, got, strict=True):
        for field in ("dtype", "shape", "offset", "nbytes"):
            if getattr(want, field) != getattr(have, field):
                raise ManifestError(
                    "manifest-mismatch",
                    f"tensor {want.name!r}: {field} {getattr(have, field)!r} does not match the granted "
                    f"{getattr(want, field)!r}",
                )


def check_compatible(specs: Iterable[TensorSpec], previous: Manifest | None) -> None:
    """A pushed tensor that the previous version also holds must keep its dtype and shape.

    Raises ManifestError(``shape-mismatch``).
    """
    if previous is None:
        return
    known = {e.name: e for e in previous.entries}
    for spec in specs:
        entry = known.get(spec.name)
        if entry is not None and (entry.dtype, entry.shape) != (spec.dtype, list(spec.shape)):
            raise ManifestError(
                "shape-mismatch",
                f"tensor {spec.name!r} is pushed as {spec.dtype}{list(spec.shape)} but version "
                f"{previous.version} holds it as {entry.dtype}{entry.shape}",
            )


def digest(entries: Iterable[ManifestEntry]) -> str:
    """xxh3-64 (hex) over every tensor's name, dtype, shape, size and checksum, in name order.

    Placement is left out: the same bytes held by other workers are the same version.
    """
    canonical = sorted((e.name, e.dtype, e.shape, e.nbytes, e.checksum) for e in entries)
    return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(canonical))


def build(version: int, entries: list[ManifestEntry], workers: Iterable[WorkerInfo]) -> Manifest:
    """A Manifest with its digest and total size; ``workers`` are narrowed to those it references."""
    used = {loc.worker for e in entries for loc in e.locations}
    return Manifest(
        version=version,
        digest=digest(entries),
        nbytes=sum(e.nbytes for e in entries),
        entries=sorted(entries, key=lambda e: e.name),
        workers=[w for w in workers if w.worker in used],
    )
