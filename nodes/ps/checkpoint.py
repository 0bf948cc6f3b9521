"""Reading a safetensors checkpoint straight into a segment.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape, and
``data_offsets`` relative to the data section) and the data section. Parsing it here (rather than through
``safetensors.safe_open``, which maps the file itself) lets the root worker ``readinto`` its reused segment
chunk by chunk, with one open of the file, and forward each chunk as soon as it is read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

from ...protocol.messages_ps import ShardTensor
from .manifest import ManifestError, tensor_nbytes

MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit

DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class CheckpointLayout:
    """Where the data section starts in the file, its size, and every tensor at its offset inside it."""

    data_start: int
    nbytes: int
    tensors: list[ShardTensor]


def read_layout(f: BinaryIO, path: str) -> CheckpointLayout:
    """Parse the header of an open safetensors file; ManifestError(``bad-checkpoint``) says what is wrong: a
    header that is not a JSON object, an entry that is not one, an unknown dtype, a shape that is not a list of
    non-negative integers, data offsets that are not two non-negative integers spanning exactly the tensor, or
    a data section that ends past the end of the file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ManifestError("bad-checkpoint", f"{path}: too short for a safetensors header")
    (size,) = struct.unpack("<Q", raw)
    if size > MAX_HEADER_BYTES:
        raise ManifestError("bad-checkpoint", f"{path}: header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError("bad-checkpoint", f"{path}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ManifestError("bad-checkpoint", f"{path}: header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    tensors = [_tensor(path, name, info) for name, info in header.items()]
    tensors.sort(key=lambda t: t.offset)
    nbytes = max((t.offset + t.nbytes for t in tensors), default=0)
    data_start = 8 + size
    here = f.tell()
    file_bytes = f.seek(0, 2)
    f.seek(here)
    if data_start + nbytes > file_bytes:
        raise ManifestError("bad-checkpoint", f"{path}: the data section ends at byte {data_start + nbytes}, past "
                            f"the end of the file ({file_bytes} bytes)")
    return CheckpointLayout(data_start, nbytes, tensors)


def _count(value: object) -> bool:
    """A non-negative JSON integer (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(path: str, name: str, info: object) -> ShardTensor:
    def bad(what: str) -> ManifestError:
        return ManifestError("bad-checkpoint", f"{path}: tensor {name!r} has a bad entry: {what}")

    if not isinstance(info, dict):
        raise bad(f"a JSON {type(info).__name__}, not an object")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise bad(f"dtype {info.get('dtype')!r} is none of {sorted(DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(x) for x in offsets):
        raise bad(f"data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if end < begin or end - begin != tensor_nbytes(dtype, shape):
        raise ManifestError("bad-checkpoint", f"{path}: tensor {name!r} spans [{begin}, {end}) but is {dtype}{shape}")
    return ShardTensor(name, dtype, shape, begin, end - begin)
