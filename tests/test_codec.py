"""Array codec: numpy and torch arrays through ``WireCodec.encode``/``decode``, byte for byte.

Property tests over every supported dtype, 0-d, empty and non-contiguous input (transposed, strided,
reversed), big-endian numpy input, and every decode backend; zero-copy checks on both ends; arrays decoded
from real ZeroMQ frames view those frames and are writable.
"""

from __future__ import annotations

import gc
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import xxhash
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from refbus.bus.sockets import recv_frames
from refbus.protocol.codec import (
    EXT_NUMPY,
    EXT_TORCH,
    FUSED_BYTES,
    Hashed,
    SlicedChecksums,
    Unhashed,
    checksum,
    copy_hashing,
    dtype_width,
)
from refbus.protocol.envelope import MIN_FRAMES, WireCodec
from refbus.protocol.errors import ArrayError, ChecksumMismatch
from refbus.protocol.messages import Blobs, FetchedBlob

pytest_plugins = ["wire_fixtures"]

NUMPY_DTYPES = [
    np.dtype(name)
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
]
TORCH_DTYPES = [
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
    torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]
TORCH_ONLY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
BACKENDS = ["native", "numpy", "torch"]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
EXAMPLES = settings(max_examples=50, deadline=None)

CODEC = WireCodec("codec-test")


# --- helpers ------------------------------------------------------------------------------------------


def wire_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def raw_bytes(array: Any) -> bytes:
    """The C-order bytes of an array's logical contents (what must arrive), for numpy or torch."""
    if isinstance(array, torch.Tensor):
        flat = array.detach().resolve_conj().resolve_neg().reshape(-1)
        return flat.clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy().tobytes()
    return np.asarray(array).tobytes(order="C")


def pack(*arrays: Any) -> list:
    """Frames of a message whose body carries ``arrays`` (in order)."""
    return CODEC.encode(Blobs([FetchedBlob("b", {f"a{i}": a for i, a in enumerate(arrays)})]))


def unpack(frames: list, backend: str = "native", codec: WireCodec = CODEC) -> list[Any]:
    arrays = codec.decode(frames, backend=backend).body.blobs[0].arrays  # type: ignore[arg-type]
    return [arrays[f"a{i}"] for i in range(len(arrays))]


def roundtrip(array: Any, backend: str = "native") -> Any:
    (decoded,) = unpack(pack(array), backend)
    return decoded


def address(buffer: Any) -> int:
    """Address of the first byte of any buffer-protocol object."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def assert_same_array(decoded: Any, source: Any, backend: str) -> None:
    """Type per backend, same dtype name, same shape, identical bytes."""
    source_is_torch = isinstance(source, torch.Tensor)
    wants_torch = backend == "torch" or (backend == "native" and source_is_torch)
    assert isinstance(decoded, torch.Tensor if wants_torch else np.ndarray), type(decoded)
    native = wire_name(source.dtype) if source_is_torch else str(source.dtype.newbyteorder("="))
    assert wire_name(decoded.dtype) == native
    assert tuple(decoded.shape) == tuple(source.shape)
    if not source_is_torch and not source.dtype.isnative:
        source = source.astype(source.dtype.newbyteorder("="))
    assert raw_bytes(decoded) == raw_bytes(source)
    if isinstance(decoded, np.ndarray):
        assert decoded.dtype.isnative


# --- strategies ---------------------------------------------------------------------------------------


def numpy_views(array: np.ndarray) -> st.SearchStrategy[np.ndarray]:
    """The array itself or a non-contiguous view of it."""
    views = [array, array.T]
    if array.ndim >= 1:
        views += [array[::2], array[::-1], array[..., 1::2]]
    if array.ndim >= 2:
        views.append(np.swapaxes(array, 0, 1)[:, ::2])
    return st.sampled_from(views)


numpy_arrays = st.sampled_from(NUMPY_DTYPES).flatmap(lambda dtype: hnp.arrays(dtype, SHAPES)).flatmap(numpy_views)


@st.composite
def torch_tensors(draw: st.DrawFn, dtypes: list[torch.dtype] = TORCH_DTYPES) -> torch.Tensor:
    """Any bit pattern of any supported dtype (bool: 0/1), then maybe a non-contiguous view of it."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(SHAPES)
    count = int(np.prod(shape, dtype=np.int64))
    width = torch.empty((), dtype=dtype).element_size()
    if count == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        data = bytearray(draw(st.binary(min_size=count * width, max_size=count * width)))
        raw = torch.frombuffer(data, dtype=torch.uint8).clone()
        if dtype == torch.bool:
            raw &= 1
        tensor = raw.view(dtype).reshape(shape)
    views = [tensor]
    if tensor.ndim >= 1:
        views += [tensor[::2], tensor[..., 1:], tensor.permute(*reversed(range(tensor.ndim)))]
    if tensor.ndim >= 2:
        views.append(tensor.transpose(0, 1)[:, ::2])
    if tensor.is_complex():
        views.append(tensor.conj())  # a lazy conjugate view: the wire must carry the conjugated values
    return draw(st.sampled_from(views))


def contiguous_with_odd_stride(tensor: torch.Tensor) -> bool:
    """torch calls a tensor of 0 or 1 element contiguous whatever its strides."""
    return tensor.ndim >= 1 and tensor.numel() <= 1 and tensor.stride(-1) != 1


# --- property tests -----------------------------------------------------------------------------------


@EXAMPLES
@given(array=numpy_arrays, backend=st.sampled_from(BACKENDS))
def test_numpy_round_trip_is_byte_identical(array: np.ndarray, backend: str) -> None:
    assert_same_array(roundtrip(array, backend), array, backend)


@EXAMPLES
@given(
    array=st.sampled_from([d for d in NUMPY_DTYPES if d.itemsize > 1])
    .flatmap(lambda dtype: hnp.arrays(dtype.newbyteorder(">"), SHAPES))
    .flatmap(numpy_views),
    backend=st.sampled_from(BACKENDS),
)
def test_big_endian_numpy_arrives_native_with_the_same_values(array: np.ndarray, backend: str) -> None:
    assert not array.dtype.isnative
    decoded = roundtrip(array, backend)
    assert_same_array(decoded, array, backend)
    if isinstance(decoded, np.ndarray):
        assert np.array_equal(decoded, array, equal_nan=array.dtype.kind in "fc")


@EXAMPLES
@given(tensor=torch_tensors(), backend=st.sampled_from(["native", "torch"]))
def test_torch_round_trip_is_byte_identical(tensor: torch.Tensor, backend: str) -> None:
    assert_same_array(roundtrip(tensor, backend), tensor, backend)


@EXAMPLES
@given(tensor=torch_tensors([d for d in TORCH_DTYPES if d not in TORCH_ONLY]))
def test_torch_decodes_as_numpy_when_asked(tensor: torch.Tensor) -> None:
    assert_same_array(roundtrip(tensor, "numpy"), tensor, "numpy")


@pytest.mark.parametrize("dtype", sorted(TORCH_ONLY, key=str), ids=wire_name)
def test_torch_only_dtypes_refuse_a_numpy_result(dtype: torch.dtype) -> None:
    frames = pack(torch.zeros(3, dtype=dtype))
    with pytest.raises(ArrayError, match=rf"{wire_name(dtype)} has no numpy equivalent; decode with backend='torch'"):
        unpack(frames, "numpy")
    assert wire_name(roundtrip(torch.zeros(3, dtype=dtype)).dtype) == wire_name(dtype)


@settings(max_examples=15, deadline=None)
@given(arrays=st.lists(st.one_of(numpy_arrays, torch_tensors()), min_size=1, max_size=5))
def test_many_arrays_in_one_body_keep_their_order(arrays: list[Any]) -> None:
    frames = pack(*arrays)
    assert len(frames) == MIN_FRAMES + len(arrays)
    for i, (decoded, source) in enumerate(zip(unpack(frames), arrays, strict=True)):
        assert_same_array(decoded, source, "native")
        expected = source.astype(source.dtype.newbyteorder("=")) if isinstance(source, np.ndarray) else source
        assert bytes(frames[MIN_FRAMES + i]) == raw_bytes(expected)


# --- specific shapes and inputs -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_d_arrays_and_numpy_scalars(backend: str) -> None:
    for source in (np.array(2.5, dtype=np.float32), np.float64(-1.25), np.bool_(True), np.array(7, dtype=">i4")):
        decoded = roundtrip(source, backend)
        assert tuple(decoded.shape) == ()
        assert raw_bytes(decoded) == np.asarray(source).astype(np.asarray(source).dtype.newbyteorder("=")).tobytes()
    tensor = torch.tensor(3, dtype=torch.bfloat16)
    decoded = roundtrip(tensor, "native")
    assert isinstance(decoded, torch.Tensor) and decoded.shape == () and decoded.item() == 3.0


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2), (2, 0, 0)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_arrays_keep_their_shape(shape: tuple[int, ...], backend: str) -> None:
    for source in (np.empty(shape, dtype=np.float16), torch.empty(shape, dtype=torch.int64)):
        frames = pack(source)
        assert memoryview(frames[MIN_FRAMES]).nbytes == 0
        decoded = unpack(frames, backend)[0]
        assert tuple(decoded.shape) == shape
        assert wire_name(decoded.dtype) == wire_name(source.dtype)


def test_tensor_with_grad_and_negative_view_travels_as_values() -> None:
    leaf = torch.arange(6, dtype=torch.float32, requires_grad=True)
    decoded = roundtrip(leaf * 2)
    assert not decoded.requires_grad
    assert decoded.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    complex_values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert roundtrip(complex_values.conj()).tolist() == [1 - 2j, 3 + 4j]
    assert roundtrip(torch._neg_view(complex_values)).tolist() == [-1 - 2j, -3 + 4j]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(8, dtype=torch.float32).reshape(1, 8)[:, 0],  # batch of one, one column
        lambda: torch.empty(0, 8, dtype=torch.bfloat16)[:, 0],  # empty batch, one column
        lambda: torch.arange(4, dtype=torch.int16)[::2][:1],
    ],
    ids=["one-row-column", "empty-column", "strided-single"],
)
def test_torch_contiguous_views_with_a_non_unit_stride(make: Any) -> None:
    """Regression: the packer once viewed such tensors as uint8 directly, which torch refuses."""
    tensor = make()
    assert contiguous_with_odd_stride(tensor) and tensor.is_contiguous()
    assert_same_array(roundtrip(tensor), tensor, "native")


def test_numpy_sent_torch_received_maps_dtypes() -> None:
    for dtype in NUMPY_DTYPES:
        decoded = roundtrip(np.zeros((2, 3), dtype=dtype), "torch")
        assert decoded.dtype == getattr(torch, str(dtype)), dtype


def test_descriptors_name_the_sending_library() -> None:
    """The ext code says numpy or torch; native decoding rebuilds the sender's type."""
    for source, code in ((np.arange(3), EXT_NUMPY), (torch.arange(3), EXT_TORCH)):
        frames = pack(source)
        raw = msgspec.msgpack.decode(frames[2], ext_hook=lambda code, data: (code, msgspec.msgpack.decode(data)))
        ext_code, (dtype, shape, index, digest) = raw["blobs"][0]["arrays"]["a0"]
        assert ext_code == code
        assert (dtype, shape, index) == ("int64", [3], 0)
        assert digest == checksum(frames[MIN_FRAMES])
        assert type(roundtrip(source)) is type(source)


@pytest.mark.parametrize(
    "source",
    [
        np.array(["text"]),
        np.array([object()], dtype=object),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.zeros(2, dtype="V8"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
    ],
    ids=["str", "object", "datetime", "longdouble-or-void", "structured"],
)
def test_numpy_dtypes_that_cannot_travel_are_refused(source: np.ndarray) -> None:
    with pytest.raises(ArrayError, match="cannot travel"):
        pack(source)


@pytest.mark.filterwarnings("ignore::UserWarning")  # complex32 is experimental, quint8 deprecated
@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e8m0fnu, torch.quint8], ids=wire_name)
def test_torch_dtypes_the_wire_does_not_know_are_refused(dtype: torch.dtype) -> None:
    if dtype == torch.quint8:
        tensor = torch.quantize_per_tensor(torch.zeros(2), 1.0, 0, dtype)
    else:
        tensor = torch.empty(2, dtype=dtype)
    with pytest.raises(ArrayError, match=rf"unknown dtype '{wire_name(dtype)}'"):
        pack(tensor)


def test_tensors_off_cpu_or_not_dense_are_refused() -> None:
    with pytest.raises(ArrayError, match="tensor on meta must be moved to CPU"):
        pack(torch.empty(3, device="meta"))
    with pytest.raises(ArrayError, match=r"layout torch\.sparse_coo cannot travel"):
        pack(torch.eye(3).to_sparse())


def test_dtype_width_and_checksum() -> None:
    assert dtype_width("bfloat16") == 2 and dtype_width("complex128") == 16 and dtype_width("bool") == 1
    with pytest.raises(ArrayError, match="unknown dtype 'float128'"):
        dtype_width("float128")
    assert checksum(b"abc") == checksum(memoryview(b"abc")) == checksum(bytearray(b"abc"))
    assert checksum(b"abc") != checksum(b"abd")


@pytest.mark.parametrize("shape", [[1], [1] * 40, [-1], [1 << 62, 1 << 62]], ids=["fits", "deep", "negative", "huge"])
def test_an_unknown_dtype_is_refused_first_and_quoted_short(shape: list[int]) -> None:
    """Regression: a descriptor's dtype was quoted whole (a 4 MiB name, a 4 MiB error), and the shape checks
    named it before it was known to be a dtype at all."""
    name = "A" * (4 << 20)
    codec = WireCodec("receiver")
    descriptor = msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode([name, shape, 0, checksum(b"a")]))
    frames = [b"blobs", *WireCodec("sender").encode(Blobs([]))[1:2],
              msgspec.msgpack.encode({"blobs": [{"blob_id": "b", "arrays": {"x": descriptor}}]}), b"a"]
    with pytest.raises(ArrayError) as info:
        codec.decode(frames)
    assert str(info.value) == f"blobs: unknown dtype '{'A' * 48}'... ({len(name)} characters)"


def test_a_hashed_array_travels_with_the_checksum_its_sender_gave_and_the_receiver_still_verifies_it() -> None:
    array = np.arange(4096, dtype=np.uint8).reshape(64, 64)
    frames = pack(Hashed(array, checksum(array.tobytes())))
    assert address(frames[MIN_FRAMES]) == array.ctypes.data  # zero copy as for a plain array
    (decoded,) = unpack(frames)
    assert decoded.tobytes() == array.tobytes() and decoded.shape == array.shape
    wrong = pack(Hashed(array, checksum(array.tobytes()) ^ 1))  # not hashed again: the given value travels
    with pytest.raises(ChecksumMismatch):
        unpack(wrong)
    big_endian = array.astype(">u2")  # converted to other bytes on the way: the given checksum is not used
    (swapped,) = unpack(pack(Hashed(big_endian, checksum(big_endian.tobytes()))))
    assert swapped.tolist() == big_endian.tolist()
    with pytest.raises(ArrayError, match="numpy array"):
        pack(Hashed(torch.zeros(3), 0))


def test_an_unhashed_array_travels_with_a_nil_checksum_that_only_a_decoder_not_verifying_accepts() -> None:
    array = np.arange(4096, dtype=np.uint8).reshape(64, 64)
    frames = pack(Unhashed(array))
    assert address(frames[MIN_FRAMES]) == array.ctypes.data  # zero copy as for a plain array
    with pytest.raises(ChecksumMismatch, match="unhashed"):  # every verifying receiver refuses it
        unpack(frames)
    (decoded,) = CODEC.decode(frames, verify=False).body.blobs[0].arrays.values()  # type: ignore[union-attr]
    assert decoded.tobytes() == array.tobytes() and decoded.shape == array.shape
    (swapped,) = CODEC.decode(pack(Unhashed(array.astype(">u2"))), verify=False).body.blobs[0].arrays.values()
    assert swapped.tolist() == array.astype(">u2").tolist()  # converted on the way, and still sent unhashed
    with pytest.raises(ArrayError, match="numpy array"):
        pack(Unhashed(torch.zeros(3)))  # type: ignore[arg-type]


def test_on_a_signed_bus_a_route_not_verifying_takes_unhashed_frames_and_still_checks_every_checksum_sent() -> None:
    # Signing turns every carried checksum's check on; it must not turn unhashed frames away from the routes
    # that verify their bytes end to end (the parameter server's shard pieces), or no shard could move.
    signed = WireCodec("signed-sender", secret=b"k" * 32)
    receiver = WireCodec("signed-receiver", secret=b"k" * 32)
    array = np.arange(64, dtype=np.uint8)
    unhashed = signed.encode(Blobs([FetchedBlob("b", {"a0": Unhashed(array)})]))
    (decoded,) = receiver.decode(unhashed, verify=False).body.blobs[0].arrays.values()  # type: ignore[union-attr]
    assert decoded.tobytes() == array.tobytes()
    with pytest.raises(ChecksumMismatch, match="unhashed"):
        receiver.decode(unhashed)
    wrong = signed.encode(Blobs([FetchedBlob("b", {"a0": Hashed(array, checksum(array) ^ 1)})]))
    with pytest.raises(ChecksumMismatch, match="does not match"):  # a checksum that is sent is checked
        receiver.decode(wrong, verify=False)
    with pytest.raises(ChecksumMismatch, match="does not match"):  # by the subscriber's entry point too
        receiver.decode_body(receiver.decode_header(wrong), verify=False)
    decoded_body = receiver.decode_body(receiver.decode_header(unhashed), verify=False).body
    assert decoded_body.blobs[0].arrays["a0"].tobytes() == array.tobytes()  # type: ignore[union-attr]


# --- zero copy ----------------------------------------------------------------------------------------


def test_encode_hands_over_the_source_memory() -> None:
    array = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensor = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    frames = pack(array, tensor)
    numpy_frame, torch_frame = frames[MIN_FRAMES:]
    assert isinstance(numpy_frame, memoryview) and isinstance(torch_frame, memoryview)
    assert np.shares_memory(np.frombuffer(numpy_frame, dtype=np.uint8), array)
    assert address(numpy_frame) == array.ctypes.data
    assert address(torch_frame) == tensor.data_ptr()
    array[0, 0] = 99.0  # the frame is the array's memory, not a snapshot
    assert np.frombuffer(numpy_frame, dtype=np.float32)[0] == 99.0


def test_non_contiguous_input_is_copied_once() -> None:
    array = np.arange(24, dtype=np.int32).reshape(4, 6)
    frames = pack(array.T, array[:, ::2])
    for frame in frames[MIN_FRAMES:]:
        assert not np.shares_memory(np.frombuffer(frame, dtype=np.uint8), array)
    assert bytes(frames[MIN_FRAMES]) == np.ascontiguousarray(array.T).tobytes()


def test_decode_views_writable_buffers_without_copying() -> None:
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    tensor = torch.arange(12, dtype=torch.int16)
    frames = pack(array, tensor)
    as_numpy, as_torch = unpack(frames)
    assert np.shares_memory(as_numpy, array)
    assert as_torch.data_ptr() == tensor.data_ptr()
    (torch_as_numpy,) = unpack(pack(tensor), "numpy")
    assert torch_as_numpy.ctypes.data == tensor.data_ptr()
    assert torch_as_numpy.flags.writeable
    as_numpy[0, 0] = -1.0  # a view: writes reach the source
    assert array[0, 0] == -1.0


def test_read_only_bytes_decode_to_private_torch_copies() -> None:
    frames = [bytes(f) for f in pack(torch.arange(4, dtype=torch.float32))]
    (tensor,) = unpack(frames)
    assert tensor.data_ptr() != address(frames[MIN_FRAMES])
    tensor += 1  # writable even though the frame was immutable bytes
    assert tensor.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert np.frombuffer(frames[MIN_FRAMES], dtype=np.float32).tolist() == [0.0, 1.0, 2.0, 3.0]


# --- over real ZeroMQ frames --------------------------------------------------------------------------


def send_and_receive(pair: tuple[zmq.Socket, zmq.Socket, str], frames: list) -> list:
    push, pull, _ = pair
    push.send_multipart(frames, copy=False)
    assert pull.poll(5000, zmq.POLLIN)
    received = recv_frames(pull)
    assert all(isinstance(f, zmq.Frame) for f in received[MIN_FRAMES:])
    return received


@pytest.fixture
def push_pull(bound_pair: Any) -> tuple[zmq.Socket, zmq.Socket, str]:
    return bound_pair(zmq.PUSH, zmq.PULL)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.one_of(numpy_arrays, torch_tensors()), backend=st.sampled_from(["native", "torch"]))
def test_arrays_from_zmq_frames_view_the_frame_and_are_writable(push_pull: Any, source: Any, backend: str) -> None:
    received = send_and_receive(push_pull, pack(source))
    (decoded,) = unpack(received, backend)
    frame = received[MIN_FRAMES]
    # Byte identity is checked on the received frame itself (test_tensors_decoded_from_zmq_frames_are_aligned
    # covers computing on the decoded result).
    expected = source.astype(source.dtype.newbyteorder("=")) if isinstance(source, np.ndarray) else source
    assert bytes(frame) == raw_bytes(expected)
    wants_torch = backend == "torch" or isinstance(source, torch.Tensor)
    assert isinstance(decoded, torch.Tensor if wants_torch else np.ndarray)
    assert tuple(decoded.shape) == tuple(source.shape)
    assert wire_name(decoded.dtype) == (wire_name(source.dtype) if isinstance(source, torch.Tensor) else
                                        str(source.dtype.newbyteorder("=")))
    if memoryview(frame).nbytes == 0:
        return
    # Zero copy wherever the frame is aligned for the dtype (a misaligned frame may take one private copy).
    if isinstance(decoded, torch.Tensor):
        views = decoded.data_ptr() == address(frame)
        assert views or address(frame) % decoded.element_size() != 0
        flat = decoded.reshape(-1).view(torch.uint8)
    else:
        views = bool(np.shares_memory(decoded, np.frombuffer(frame, dtype=np.uint8)))
        assert views or address(frame) % decoded.dtype.alignment != 0
        assert raw_bytes(decoded) == bytes(frame)
        assert decoded.flags.writeable
        flat = decoded.reshape(-1).view(np.uint8)
    before = bytes(frame)[0]
    flat[0] ^= 0xFF  # writable; a view writes through to the frame
    assert int(flat[0]) == before ^ 0xFF
    assert bytes(frame)[0] == (before ^ 0xFF if views else before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=wire_name)
def test_tensors_decoded_from_zmq_frames_are_aligned(push_pull: Any, dtype: torch.dtype) -> None:
    misaligned = []
    for length in range(1, 9):  # shift the buffer frame's offset in the stream byte by byte
        tensor = torch.zeros(50, dtype=dtype)
        received = send_and_receive(push_pull, CODEC.encode(Blobs([FetchedBlob("b" * length, {"x": tensor})])))
        decoded = CODEC.decode(received, backend="torch").body.blobs[0].arrays["x"]
        # Only the address is read: running a kernel on a misaligned complex128 tensor can crash the process.
        if decoded.data_ptr() % decoded.element_size():
            misaligned.append((length, decoded.data_ptr() % 16))
    assert not misaligned


def test_decoded_array_keeps_its_frame_alive(push_pull: Any) -> None:
    source = np.arange(1 << 16, dtype=np.uint32)
    received = send_and_receive(push_pull, pack(source))
    frame_address = address(received[MIN_FRAMES])
    (decoded,) = unpack(received)
    del received
    gc.collect()
    assert decoded.ctypes.data == frame_address
    assert np.array_equal(decoded, source)
    decoded[:] = 7  # still writable memory that belongs to the (kept-alive) frame
    assert int(decoded.sum()) == 7 * (1 << 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_numpy_array_through_tcp_is_byte_identical(push_pull: Any, backend: str) -> None:
    rng = np.random.default_rng(7)
    source = rng.integers(0, 255, size=(1024, 1024), dtype=np.uint8)[:, ::2]  # non-contiguous, 512 KiB
    (decoded,) = unpack(send_and_receive(push_pull, pack(source)), backend)
    assert_same_array(decoded, source, backend)


@pytest.mark.parametrize("step", [FUSED_BYTES, 7])
@pytest.mark.parametrize("offset", [0, 1, -1, 2, 3])  # around multiples of the step: 0, 1, step-1, step, step+1, ...
def test_copy_hashing_copies_and_hashes_the_same_bytes_at_every_size_around_the_step(step: int, offset: int) -> None:
    rng = np.random.default_rng(step + offset)
    for multiple in (0, 1, 3):
        size = multiple * step + offset
        if size < 0:
            continue
        data = rng.integers(0, 256, size, dtype=np.uint8)
        for source in (data, data.tobytes(), memoryview(data.tobytes()), data.view(np.uint8).reshape(1, -1)):
            target = np.full(size, 0xAB, np.uint8)
            digest = xxhash.xxh3_64(b"before")  # a stream already started continues with these bytes
            copy_hashing(target, source, digest, step=step)
            assert bytes(target) == data.tobytes()
            assert digest.intdigest() == xxhash.xxh3_64_intdigest(b"before" + data.tobytes())
        whole = xxhash.xxh3_64()
        copy_hashing(np.empty(size, np.uint8), data, whole, step=step)
        assert whole.intdigest() == checksum(data)


def test_copy_hashing_refuses_what_it_cannot_copy_in_one_pass_and_touches_nothing() -> None:
    data = np.arange(64, dtype=np.uint8)
    digest = xxhash.xxh3_64()
    target = np.zeros(32, np.uint8)
    bad = [
        (target, data[::2], "C-contiguous byte buffer"),  # strided source
        (target, memoryview(data.tobytes())[::2], "C-contiguous byte buffer"),
        (np.zeros(33, np.uint8), data[:32], "32 bytes into 33"),  # lengths differ
        (np.zeros(64, np.uint8)[::2], data[:32], "writable C-contiguous"),  # strided target
        (np.zeros(8, np.float32), data[:32], "writable C-contiguous"),  # not bytes
        (np.frombuffer(bytes(32), np.uint8), data[:32], "writable C-contiguous"),  # read-only
    ]
    for into, source, why in bad:
        with pytest.raises(ValueError, match=why):
            copy_hashing(into, source, digest)
    with pytest.raises(ValueError, match="step must be positive"):
        copy_hashing(target, data[:32], digest, step=0)
    assert not target.any() and digest.intdigest() == xxhash.xxh3_64_intdigest(b"")


@pytest.mark.parametrize("slice_bytes", [1, 7, 100, 1000, 1 << 20])
def test_sliced_checksums_are_the_whole_ranges_checksums_and_each_step_hashes_at_most_a_slice(slice_bytes: int) -> None:
    data = np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8)
    ranges = [(0, 100), (100, 0), (100, 333), (433, 567), (0, 1000)]
    looked_at: list[int] = []

    def view(offset: int, nbytes: int) -> memoryview:
        looked_at.append(nbytes)
        return memoryview(data)[offset:offset + nbytes]

    hashing = SlicedChecksums(view, ranges, slice_bytes=slice_bytes)
    steps = 1
    while not hashing.step():
        assert len(hashing.digests) < len(ranges)
        steps += 1
    assert hashing.digests == [checksum(data[offset:offset + nbytes]) for offset, nbytes in ranges]
    assert steps == max(1, -(-2000 // slice_bytes)) and max(looked_at) <= slice_bytes
