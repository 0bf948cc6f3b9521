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
    """Parse the header of an open safetensors file; ManifestError(``bad-checkpoint``) says what is wrong."""
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
    header.pop("__metadata__", None)
    tensors = []
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError("bad-checkpoint", f"{path}: tensor {name!r} has a bad entry: {exc!r}") from None
        if end - begin != tensor_nbytes(dtype, shape) or begin < 0:
            raise ManifestError(
                "bad-checkpoint", f"{path}: tensor {name!r} spans [{begin}, {end}) but is {dtype}{shape}"
            )
        tensors.append(ShardTensor(name, dtype, shape, begin, end - begin))
    tensors.sort(key=lambda t: t.offset)
    nbytes = max((t.offset + t.nbytes for t in tensors), default=0)
    return CheckpointLayout(8 + size, nbytes, tensors)
