"""Arrays as out-of-band frames.

An array inside a message body is replaced by a msgpack extension value (a *descriptor*) and its bytes travel
as a separate ZeroMQ frame after the body, so they are never copied into the msgpack stream:

    descriptor = [dtype: str, shape: list[int], frame: int, checksum: int | nil]   (msgpack array)

``dtype`` is a portable name (``float32``, ``bfloat16``, ``uint8``, ...; wire bytes are little-endian),
``frame`` the index into the message's buffer frames, ``checksum`` the xxh3-64 of the bytes, or nil for a
frame sent :class:`Unhashed` (wire 2.1): only a decoder told not to verify frames (a route whose bytes are
verified end to end by other means) accepts one; every other decoder refuses it like a wrong checksum. The extension
code says which library the sender used (numpy or torch) so the receiver rebuilds the same type by default.

Zero copy: the encoder hands the array's own memory to ZeroMQ when the array is contiguous (the caller must
not modify it until the send completes; ZeroMQ holds a reference). The decoder returns arrays that *view* the
received frame (writable, kept alive by the array). Non-contiguous input is made contiguous with one copy.

torch is imported only when a torch tensor is encoded or a torch result is asked for, so processes that move
numpy arrays alone (env servers) never load it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import xxhash

from .errors import ArrayError, ChecksumMismatch, shown

EXT_NUMPY = 1
EXT_TORCH = 2

MAX_DIMS = 32  # numpy allows 64; no array that travels has more than a handful

ArrayBackend = Literal["native", "numpy", "torch"]
Buffer = Any  # bytes, memoryview, zmq.Frame: anything exposing the buffer protocol

_NUMPY_BY_NAME: dict[str, np.dtype] = {
    str(np.dtype(t)): np.dtype(t)
    for t in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_NAME_BY_NUMPY: dict[np.dtype, str] = {dtype: name for name, dtype in _NUMPY_BY_NAME.items()}
# torch dtypes that numpy cannot hold travel as raw bytes of the same width.
_TORCH_ONLY_WIDTH = {
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


def checksum(data: Buffer) -> int:
    """xxh3-64 of a buffer: 6.5-9 GB/s from memory on one core, so verifying every frame costs little next to
    moving it."""
    return xxhash.xxh3_64_intdigest(data)


# What one step of SlicedChecksums hashes: about 10 ms at xxh3's rate (see checksum), so a loop thread that hashes
# gigabytes a step a turn still answers requests and heartbeats within a few steps.
HASH_SLICE_BYTES = 64 << 20


class SlicedChecksums:
    """The :func:`checksum` of each of several byte ranges, taken at most ``slice_bytes`` a :meth:`step`, so that a
    node's loop thread can hash gigabytes one step a loop turn and serve in between.

    The bytes are looked at through ``view(offset, nbytes)`` during a step only, never held between steps: the
    memory behind them may be released between two steps, and whoever releases it simply stops stepping."""

    def __init__(self, view: Callable[[int, int], Buffer], ranges: Sequence[tuple[int, int]], *,
                 slice_bytes: int = HASH_SLICE_BYTES) -> None:
        """``ranges``: ``(offset, nbytes)`` each, hashed in order."""
        self._view = view
        self._ranges = list(ranges)
        self._slice_bytes = slice_bytes
        self._digest = xxhash.xxh3_64()
        self._hashed = 0  # bytes of the current range hashed so far
        self.digests: list[int] = []  # one per range hashed whole, in order

    def step(self) -> bool:
        """Hash up to ``slice_bytes`` more; True once every range is hashed (:attr:`digests` then holds them all)."""
        budget = self._slice_bytes
        while len(self.digests) < len(self._ranges):
            offset, nbytes = self._ranges[len(self.digests)]
            take = min(budget, nbytes - self._hashed)
            if take:
                self._digest.update(self._view(offset + self._hashed, take))
                self._hashed += take
                budget -= take
            if self._hashed < nbytes:
                return False
            self.digests.append(self._digest.intdigest())
            self._digest.reset()
            self._hashed = 0
        return True


# Sub-chunks of a fused copy: small enough that a sub-chunk hashed is still in L2 (1 MiB a core here) when it is
# copied, so the copy reads it from cache. Measured here over 4 MiB pieces: 256 KiB-1 MiB alike, 64-128 KiB
# slower (Python per step and less reuse).
FUSED_BYTES = 256 << 10


def copy_hashing(target: np.ndarray, source: Buffer, digest: xxhash.xxh3_64, *, step: int = FUSED_BYTES) -> None:
    """Copy ``source`` into ``target`` and feed the same bytes, in order, to ``digest``: one pass over memory.

    Done sub-chunk by sub-chunk (hash ``step`` bytes, then copy those bytes while they are in cache), so it costs
    little more than a copy, where a whole copy followed by a whole hash reads the source twice (measured here,
    CPU time over 4 MiB pieces: 4.8 against 3.5 GB/s for pieces still in L3, as received frames are; 4.6
    against 4.3 from DRAM). ``digest`` afterwards holds what ``digest.update(bytes(source))`` would.

    ``target`` is a writable C-contiguous uint8 array and ``source`` a C-contiguous buffer of exactly
    ``target.nbytes`` bytes (a uint8 array, ``bytes``, a ZeroMQ frame, ...); ValueError otherwise, with nothing
    copied or hashed.
    """
    try:
        data = np.frombuffer(source, np.uint8)
    except (ValueError, TypeError, BufferError) as exc:
        raise ValueError(f"copy_hashing needs a C-contiguous byte buffer: {exc}") from None
    if target.dtype != np.uint8 or target.ndim != 1 or not target.flags.c_contiguous or not target.flags.writeable:
        raise ValueError("copy_hashing writes into a writable C-contiguous 1-d uint8 array")
    if data.nbytes != target.nbytes:
        raise ValueError(f"copy_hashing of {data.nbytes} bytes into {target.nbytes}")
    if step <= 0:
        raise ValueError(f"copy_hashing step must be positive, not {step}")
    for start in range(0, data.nbytes, step):
        part = data[start : start + step]
        digest.update(part)
        target[start : start + step] = part


def _torch() -> Any:
    import torch

    return torch


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def dtype_width(name: str) -> int:
    """Bytes per element of a wire dtype name; raises ArrayError for names the codec does not know."""
    if name in _NUMPY_BY_NAME:
        return _NUMPY_BY_NAME[name].itemsize
    if name in _TORCH_ONLY_WIDTH:
        return _TORCH_ONLY_WIDTH[name]
    raise ArrayError(f"unknown dtype {shown(name)}")


class Hashed:
    """An array to encode with a checksum its sender already holds, so the send does not hash it again.

    The sender vouches that ``checksum`` is :func:`checksum` of the array's C-order bytes (an array it keeps
    read-only since it hashed it); the receiver verifies the bytes it gets exactly as for any other array.
    """

    __slots__ = ("array", "checksum")

    def __init__(self, array: Any, checksum: int) -> None:
        self.array = array
        self.checksum = checksum


class Unhashed:
    """An array to encode without a checksum (nil in its descriptor), for a receiver that verifies the bytes
    end to end by other means and decodes with ``verify=False``: the parameter server's shard pieces, checked
    against the manifest's per-tensor checksums (the worker's seal, the reader's pull). Saves the sender a pass
    over every byte; any receiver that does verify frames refuses the frame.
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


_UNHASHED = -1  # internal marker for the encoder: the descriptor's checksum is nil


class ArrayPacker:
    """``enc_hook`` for msgspec that moves arrays out of the body into buffer frames.

    Long-lived and not thread-safe: call :meth:`begin` before encoding each body; the list it returns
    receives the buffers in descriptor order. Encoded arrays must stay unmodified until ZeroMQ has sent
    their frames (ZeroMQ holds a reference to their memory, not a copy).
    """

    __slots__ = ("_frames",)

    def __init__(self) -> None:
        self._frames: list[Buffer] = []

    def begin(self) -> list[Buffer]:
        self._frames = []
        return self._frames

    def enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        if type(obj) is Hashed:
            if not isinstance(obj.array, np.ndarray):
                raise ArrayError(f"a Hashed value must hold a numpy array, not {type(obj.array).__name__}")
            return self._numpy(obj.array, obj.checksum)
        if type(obj) is Unhashed:
            if not isinstance(obj.array, np.ndarray):
                raise ArrayError(f"an Unhashed value must hold a numpy array, not {type(obj.array).__name__}")
            return self._numpy(obj.array, _UNHASHED)
        if isinstance(obj, np.ndarray | np.generic):
            return self._numpy(np.asarray(obj))
        if _is_torch_tensor(obj):
            return self._torch(obj)
        raise NotImplementedError(f"cannot encode {type(obj).__name__} in a refbus message")

    def _add(self, code: int, dtype: str, shape: tuple[int, ...], data: memoryview,
             digest: int | None = None) -> msgspec.msgpack.Ext:
        index = len(self._frames)
        self._frames.append(data)
        if digest is None:
            digest = checksum(data)
        descriptor = msgspec.msgpack.encode((dtype, shape, index, None if digest == _UNHASHED else digest))
        return msgspec.msgpack.Ext(code, descriptor)

    def _numpy(self, array: np.ndarray, digest: int | None = None) -> msgspec.msgpack.Ext:
        name = _NAME_BY_NUMPY.get(array.dtype)  # native dtypes: str(dtype) costs ~6 us, once per array
        if name is None:
            native = array.dtype.newbyteorder("=")
            name = str(native)
            if name not in _NUMPY_BY_NAME:
                raise ArrayError(f"numpy dtype {array.dtype} cannot travel (plain numeric and bool dtypes only)")
            if not array.dtype.isnative:
                array = array.astype(native)
                if digest != _UNHASHED:
                    digest = None  # the sender's checksum was of other bytes
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return self._add(EXT_NUMPY, name, array.shape, memoryview(flat), digest)

    def _torch(self, tensor: Any) -> msgspec.msgpack.Ext:
        if tensor.device.type != "cpu":
            raise ArrayError(f"tensor on {tensor.device} must be moved to CPU before it travels")
        if tensor.layout != _torch().strided:
            raise ArrayError(f"tensor layout {tensor.layout} cannot travel (dense tensors only)")
        name = str(tensor.dtype).removeprefix("torch.")
        dtype_width(name)
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
        if flat.numel() <= 1 or flat.stride(0) != 1:
            # torch calls 0/1-element tensors contiguous whatever their stride; a fresh copy has stride 1.
            flat = flat.clone(memory_format=_torch().contiguous_format)
        flat = flat.view(_torch().uint8)
        return self._add(EXT_TORCH, name, tuple(tensor.shape), memoryview(flat.numpy()))


class ArrayUnpacker:
    """``ext_hook`` for msgspec that rebuilds arrays from descriptors and buffer frames.

    Long-lived and not thread-safe: call :meth:`begin` with the message's buffer frames before decoding a
    body. ``backend`` picks the result type: ``native`` (what the sender used), ``numpy`` or ``torch``.
    With ``verify`` every frame's checksum is checked. Results view the frames (no copy) and keep them
    alive. After decoding, :attr:`used` counts the referenced frames so the caller can reject stray ones.

    A shape may have at most :data:`MAX_DIMS` dimensions and, its zero dimensions counted as one, at most
    ``max_elements`` elements: a zero-sized array matches an empty frame whatever its other dimensions, and
    a receiver must never size a buffer from ``[0, 2**59, 8]``.
    """

    __slots__ = ("_backend", "_buffers", "_max_elements", "_unhashed", "_used", "_verify")

    def __init__(self, *, max_elements: int = 1 << 40) -> None:
        self._max_elements = max_elements
        self._buffers: Sequence[Buffer] = ()
        self._backend: ArrayBackend = "native"
        self._verify = True
        self._unhashed = False
        self._used: set[int] = set()

    def begin(self, buffers: Sequence[Buffer], backend: ArrayBackend = "native", verify: bool = True,
              unhashed: bool | None = None) -> None:
        """Start on one message's ``buffers``. ``verify`` checks each frame's checksum; ``unhashed`` accepts
        frames sent :class:`Unhashed` (default: when not verifying). They differ on a signed bus, where the
        envelope verifies every checksum a frame carries but a route that checks its bytes end to end still
        takes the unhashed ones (the MAC covers their bytes in transit)."""
        self._buffers = buffers
        self._backend = backend
        self._verify = verify
        self._unhashed = not verify if unhashed is None else unhashed
        self._used.clear()

    @property
    def used(self) -> int:
        return len(self._used)

    def ext_hook(self, code: int, data: memoryview) -> Any:
        # Called once per array received (a trainer's fetch: one per blob field), so it reads attributes and
        # the dtype table once and builds numpy arrays inline; every check stays, in the same order.
        if code not in (EXT_NUMPY, EXT_TORCH):
            raise ArrayError(f"unknown msgpack extension code {code}")
        try:
            dtype, shape, index, digest = _DESCRIPTOR.decode(data)
        except msgspec.MsgspecError as exc:
            raise ArrayError(f"bad array descriptor: {exc}") from None
        # The dtype first: the messages below name it, and only a known name may reach them.
        np_dtype = _NUMPY_BY_NAME.get(dtype)
        width = np_dtype.itemsize if np_dtype is not None else dtype_width(dtype)
        buffers, used = self._buffers, self._used
        if not 0 <= index < len(buffers):
            raise ArrayError(f"descriptor points at buffer frame {index}, message has {len(buffers)}")
        if index in used:
            raise ArrayError(f"buffer frame {index} is referenced twice")
        if len(shape) > MAX_DIMS:
            raise ArrayError(f"{dtype} shape has {len(shape)} dimensions, at most {MAX_DIMS} travel")
        if shape and min(shape) < 0:
            raise ArrayError(f"negative dimension in shape {list(shape)}")
        elements = math.prod(shape)  # Python ints: a hostile shape cannot wrap around
        if elements > self._max_elements or (
            not elements and math.prod(dim or 1 for dim in shape) > self._max_elements
        ):
            raise ArrayError(
                f"{dtype}{list(shape)} has more than {self._max_elements} elements (limits.max_message_bytes)"
            )
        used.add(index)
        buffer = buffers[index]
        view = memoryview(buffer)
        expected = elements * width
        if view.nbytes != expected:
            raise ArrayError(
                f"buffer frame {index} holds {view.nbytes} bytes, {dtype}{list(shape)} needs {expected}"
            )
        if digest is None:
            if not self._unhashed:
                raise ChecksumMismatch(f"buffer frame {index} ({dtype}{list(shape)}) travels unhashed, which only "
                                       "a route that verifies its bytes by other means accepts")
        elif self._verify and checksum(view) != digest:
            raise ChecksumMismatch(f"buffer frame {index} ({dtype}{list(shape)}) does not match its checksum")
        backend = self._backend
        wants_torch = backend == "torch" or (backend == "native" and code == EXT_TORCH)
        if not wants_torch and np_dtype is None:
            raise ArrayError(f"{dtype} has no numpy equivalent; decode with backend='torch'")
        try:
            if wants_torch:
                return _to_torch(view, dtype, shape)
            # On the frame itself, not the memoryview: the array then keeps the frame alive without one more
            # object per array for the garbage collector to track.
            array = np.frombuffer(buffer, dtype=np_dtype)
            if not array.flags.aligned:
                array = array.copy()
            return array.reshape(shape)
        except (ValueError, RuntimeError) as exc:  # e.g. an empty frame with an absurd zero-sized shape
            raise ArrayError(f"cannot build {dtype}{list(shape)} from buffer frame {index}: {exc}") from None


_Descriptor = tuple[str, tuple[int, ...], int, int | None]
_DESCRIPTOR = msgspec.msgpack.Decoder(_Descriptor)  # one decoder, not a type lookup per array


def _aligned(view: memoryview, alignment: int) -> memoryview:
    """``view``, or an aligned private copy of it. ZeroMQ places received frames at arbitrary offsets of its
    receive buffer, and torch kernels crash (SIGSEGV) on misaligned complex128/float64 data."""
    if alignment == 1 or view.nbytes == 0:
        return view
    data = np.frombuffer(view, dtype=np.uint8)
    # The address from __array_interface__: ``ndarray.ctypes`` builds a ctypes object (~100 us) per call.
    if data.__array_interface__["data"][0] % alignment == 0:
        return view
    return memoryview(data.copy())


def _to_torch(view: memoryview, dtype: str, shape: tuple[int, ...]) -> Any:
    torch = _torch()
    torch_dtype = getattr(torch, dtype)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if view.readonly:
        # torch tensors are always writable; a read-only source (bytes) gets one private copy.
        view = memoryview(bytearray(view))
    alignment = _NUMPY_BY_NAME[dtype].alignment if dtype in _NUMPY_BY_NAME else dtype_width(dtype)
    return torch.frombuffer(_aligned(view, alignment), dtype=torch_dtype).reshape(shape)
