"""The envelope ``[kind, header, body, *buffers]``: round trips, every way a message can be malformed (each
raises the right ``ProtocolError`` subclass with a message that says what and where), size limits,
signing, and ``describe()``."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from fuzz_support import mutate
from refbus.protocol import envelope, errors
from refbus.protocol.codec import EXT_NUMPY, EXT_TORCH, checksum
from refbus.protocol.envelope import (
    MAX_BUFFERS,
    MAX_KIND_BYTES,
    MIN_FRAMES,
    PROTOCOL_VERSION,
    Header,
    Limits,
    Message,
    MessageIds,
    WireCodec,
    describe,
)
from refbus.protocol.errors import (
    MAX_DETAIL_CHARS,
    SHOWN_CHARS,
    ArrayError,
    BadSignature,
    ChecksumMismatch,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaError,
    UnknownKind,
    VersionMismatch,
    shown,
)
from refbus.protocol.messages import (
    KINDS,
    MAX_FRAMES,
    Blobs,
    Bye,
    Delete,
    EpisodeFinished,
    Error,
    Fetch,
    FetchAck,
    FetchedBlob,
    Heartbeat,
    Hello,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Ok,
    Replay,
    Replayed,
    ReplayedEvent,
    Sync,
    VersionBump,
    Welcome,
)
from refbus.protocol.messages_ps import ShardData

SENDER = WireCodec("sender")
RECEIVER = WireCodec("receiver")
DELETE = Delete(blob_ids=["b1", "b2"], holder="orchestrator", reason="trained")


def raises(
    exc_type: type[ProtocolError], frames: list, *, match: str, codec: WireCodec = RECEIVER, **kw: Any
) -> ProtocolError:
    """Decode ``frames`` expecting exactly ``exc_type`` (not a subclass) with a message matching ``match``."""
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames, **kw)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert info.value.code == exc_type.code
    assert info.match(match)
    return info.value


def raises_array_error(exc_type: type[ArrayError], frames: list, *, match: str, **kw: Any) -> ProtocolError:
    """Array errors are raised inside the body decoder; decode() attaches the kind afterwards and the message
    names it like every other decode error."""
    kind = bytes(frames[0]).decode()
    err = raises(exc_type, frames, match=f"^{kind}: {match.removeprefix('^')}", **kw)
    assert err.kind == kind
    return err


def header_bytes(**overrides: Any) -> bytes:
    fields: dict[str, Any] = {"v": list(PROTOCOL_VERSION), "id": "m-1", "src": "sender", "seq": 3, "ts": time.time()}
    fields.update(overrides)
    return msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not None})


def body_bytes(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


def ext(code: int, dtype: str, shape: list[int], frame: int, digest: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode([dtype, shape, frame, digest]))


def blobs_frames(descriptors: dict[str, msgspec.msgpack.Ext], buffers: list[bytes]) -> list:
    body = body_bytes(blobs=[{"blob_id": "b", "arrays": descriptors}])
    return [b"blobs", header_bytes(), body, *buffers]


def with_array(array: Any) -> list:
    return SENDER.encode(Blobs([FetchedBlob("b", {"x": array})]))


# --- round trips --------------------------------------------------------------------------------------

# Kinds covered by these round trips (the by-reference kinds are covered by their own tests).
NODE = NodeInfo(node_id="env-0", role="env-server", host="h", pid=12, endpoints={"blobs": "tcp://h:1"},
                status={"load": 0.5})
SAMPLES = [
    NodeUp(node=NODE),
    NodeDown(node_id="env-0", role="env-server", reason="timeout", last_seen=1.5),
    Sync(token="t", path="sub"),
    FetchAck(step=3, holder="trainer-0", blob_ids=["blob-1"]),
    VersionBump(version=9, nbytes=1 << 40, manifest_digest="ab12"),
    DELETE,
    Hello(node=NODE, token="tok"),
    Heartbeat(node_id="env-0", status={"blobs": 3.0}),
    Bye(node_id="env-0"),
    Nodes(role="trainer"),
    Replay(since=5, src="env-0", limit=10),
    Fetch(blob_ids=["blob-1"], holder="trainer-0"),
    Welcome(broker_id="bus", events_in="tcp://a:1", events_out="tcp://a:2", heartbeat_interval=1.0,
            node_timeout=5.0),
    Ok(detail="fine"),
    NodeList(nodes=[NODE]),
    Replayed(events=[ReplayedEvent([b"delete", b"\x80", b"\x80", b"raw"])], more=True),
    Error(code="unknown-blob", message="no such blob", request_kind="fetch"),
]


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: b.kind)
def test_every_kind_round_trips(body: Any) -> None:
    frames = SENDER.encode(body, seq=7, msg_id="id-7", reply_to="id-3")
    assert frames[0] == body.kind.encode("ascii")
    assert len(frames) == MIN_FRAMES
    message = RECEIVER.decode(frames)
    assert message.kind == body.kind
    assert type(message.body) is KINDS[body.kind]
    assert message.body == body
    assert message.header.v == PROTOCOL_VERSION
    assert (message.header.src, message.header.seq, message.header.id, message.header.re) == (
        "sender", 7, "id-7", "id-3"
    )
    assert abs(message.header.ts - time.time()) < 60
    assert message.buffers == []


def test_samples_cover_the_core_kinds() -> None:
    required = {"episode-finished", "reference", "fetch-ack", "version-bump", "delete", "hello", "heartbeat",
                "fetch", "error"}
    assert required <= set(KINDS)
    assert {b.kind for b in SAMPLES} <= set(KINDS)
    assert len({b.kind for b in SAMPLES}) == len(SAMPLES)


def test_message_ids_are_unique_and_differ_between_codecs() -> None:
    ids = MessageIds()
    many = [ids.next() for _ in range(10_000)]
    assert len(set(many)) == len(many)
    assert WireCodec("a").new_id().split("-")[0] != WireCodec("a").new_id().split("-")[0]
    first = SENDER.decode(SENDER.encode(Ok())).header.id
    assert SENDER.decode(SENDER.encode(Ok())).header.id != first


def test_unknown_body_fields_are_ignored_for_minor_versions() -> None:
    frames = [b"ok", header_bytes(v=[PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7]),
              body_bytes(detail="x", added_in_a_later_minor=[1, 2])]
    message = RECEIVER.decode(frames)
    assert message.body == Ok(detail="x")
    assert message.header.v[1] == PROTOCOL_VERSION[1] + 7


def test_frames_may_be_any_buffer() -> None:
    frames = with_array(np.arange(4, dtype=np.int32))
    for convert in (bytes, bytearray, memoryview):
        message = RECEIVER.decode([convert(f) for f in frames])
        assert message.body.blobs[0].arrays["x"].tolist() == [0, 1, 2, 3]


# --- malformed envelopes ------------------------------------------------------------------------------


def test_errors_form_one_family_with_distinct_codes() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, ProtocolError)]
    codes = [c.code for c in classes]
    assert len(classes) >= 9
    assert len(set(codes)) == len(codes), codes
    assert issubclass(ChecksumMismatch, ArrayError)
    assert str(SchemaError("bad", kind="delete")) == "delete: bad"
    assert SchemaError("bad", kind="delete").kind == "delete"


@pytest.mark.parametrize(
    ("frames", "count"),
    [([], 0), ([b"\xffgarbage\x13"], 1), ([b"delete", header_bytes()], 2)],
    ids=["none", "garbage", "kind+header"],
)
def test_too_few_frames(frames: list, count: int) -> None:
    err = raises(MalformedMessage, frames, match=rf"expected at least 3 frames \[kind, header, body, \*buffers\] or "
                 rf"one frame kind ‖ 0x00 ‖ len\(header\) ‖ header ‖ body, got {count}$")
    assert err.kind is None


def test_garbage_frames() -> None:
    raises(MalformedMessage, [b"\x93\x01\x02", b"\xc1\xc1\xc1", b"\xff" * 16], match="kind frame is not ASCII")
    err = raises(MalformedMessage, [b"delete", b"\xc1\xc1\xc1", b"\xff" * 16], match="^delete: header frame: ")
    assert err.kind == "delete"


def test_non_ascii_kind_names_the_bytes() -> None:
    raises(MalformedMessage, [b"d\xc3\xa9l\xc3\xa8te", header_bytes(), body_bytes()],
           match=r"kind frame is not ASCII: b'd\\xc3\\xa9l")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"", "header frame: Input data was truncated"),
        (b"\x93\x01\x02\x03", r"header frame: Expected `object`, got `array`"),
        (header_bytes()[:-3], "header frame: Input data was truncated"),
        (header_bytes(src=None), "header frame: Object missing required field `src`"),
        (header_bytes(seq="three"), r"header frame: Expected `int`, got `str` - at `\$.seq`"),
        (header_bytes(v=[1]), r"header frame: Expected `array` of length 2, got 1 - at `\$.v`"),
        (header_bytes() + b"\x00", "header frame: Input data was not valid msgpack|trailing characters"),
        (header_bytes(id="i" * 257), r"header frame: Expected `str` of length <= 256 - at `\$.id`"),
        (header_bytes(re="r" * 5000), r"header frame is \d+ bytes, limit 4096"),
        (header_bytes(pad="p" * 5000), r"header frame is \d+ bytes, limit 4096"),  # unknown fields count too
    ],
    ids=["empty", "not-a-map", "truncated", "missing-src", "seq-type", "short-version", "trailing-bytes", "long-id",
         "long-reply-id", "large-header"],
)
def test_undecodable_header(header: bytes, match: str) -> None:
    raises(MalformedMessage, [b"ok", header, body_bytes()], match=rf"^ok: {match}")


def test_unknown_kind_names_it_and_its_source() -> None:
    err = raises(UnknownKind, [b"teleport", header_bytes(src="env-7"), body_bytes()],
                 match="^teleport: unknown message kind 'teleport' from 'env-7'$")
    assert err.kind == "teleport"
    raises(UnknownKind, [b"", header_bytes(), body_bytes()], match="unknown message kind ''")


@pytest.mark.parametrize("secret", [b"", b"cluster-secret"], ids=["plain", "signed"])
def test_a_kind_frame_over_the_limit_is_refused_malformed_before_anything_else_and_quoted_short(secret: bytes) -> None:
    """Regression: the multi-frame form's kind had no length limit; a 4 MiB kind went on to the kind, header
    and MAC checks and its ``unknown-kind`` error quoted it whole (a reply three times its size)."""
    codec = WireCodec("receiver", secret=secret)
    for kind in (b"k" * (MAX_KIND_BYTES + 1), b"k" * (4 << 20)):
        # No MAC, an undecodable header: the length is the first thing refused.
        err = raises(MalformedMessage, [kind, b"\xc1", body_bytes()], codec=codec,
                     match=rf"^kind frame is {len(kind)} bytes, limit {MAX_KIND_BYTES}: b'k{{48}}'\.\.\. "
                           rf"\({len(kind)} bytes\)$")
        assert err.kind is None
    # At the limit, a kind is read as before (and quoted short).
    err = raises(UnknownKind, [b"k" * MAX_KIND_BYTES, header_bytes(), body_bytes()],
                 match=r"unknown message kind 'k{48}'\.\.\. \(256 characters\) from 'sender'$")
    assert len(str(err)) < 200


def test_error_texts_quote_what_a_peer_sent_short() -> None:
    """A kind a peer made up, or a library's message quoting a value whole, never makes an error text large."""
    assert shown("dtype") == "'dtype'"
    assert shown("A" * 100) == f"'{'A' * SHOWN_CHARS}'... (100 characters)"
    assert shown(b"\x00" * 100) == f"{bytes(SHOWN_CHARS)!r}... (100 bytes)"
    assert str(UnknownKind("x", kind="tele\nport")) == "'tele\\nport': x"  # not printable: quoted
    assert str(UnknownKind("x", kind="k" * 100)) == f"{shown('k' * 100)}: x"
    long_enum = raises(SchemaError, [b"sync", header_bytes(), body_bytes(token="t", path="p" * (1 << 20))],
                       match=r"^sync: Invalid enum value 'p+\.\.\. \(\d+ characters\)$")
    assert len(long_enum.detail) < MAX_DETAIL_CHARS + 40


@pytest.mark.parametrize("major", [PROTOCOL_VERSION[0] + 1, PROTOCOL_VERSION[0] + 40, PROTOCOL_VERSION[0] - 1])
def test_other_major_version_is_refused(major: int) -> None:
    frames = [b"delete", header_bytes(v=[major, 3], src="trainer-2"), SENDER.encode(DELETE)[2]]
    raises(VersionMismatch, frames, match=rf"^delete: protocol {major}\.3 from 'trainer-2', this node speaks "
           rf"{PROTOCOL_VERSION[0]}\.{PROTOCOL_VERSION[1]}$")


def test_version_is_checked_before_the_kind() -> None:
    raises(VersionMismatch, [b"teleport", header_bytes(v=[PROTOCOL_VERSION[0] + 1, 0]), body_bytes()],
           match="protocol")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\xc1", "body frame: "),
        (SENDER.encode(DELETE)[2][:-2], "body frame: Input data was truncated"),
        (b"", "body frame: Input data was truncated"),
    ],
    ids=["reserved-byte", "truncated", "empty"],
)
def test_undecodable_body(body: bytes, match: str) -> None:
    raises(MalformedMessage, [b"delete", header_bytes(), body], match=f"^delete: {match}")


@pytest.mark.parametrize(
    ("kind", "body", "match"),
    [
        ("delete", body_bytes(holder="h", reason="r"), "Object missing required field `blob_ids`"),
        ("delete", body_bytes(blob_ids="b1", holder="h", reason="r"),
         r"Expected `array`, got `str` - at `\$.blob_ids`"),
        ("delete", body_bytes(blob_ids=["b1", 2], holder="h", reason="r"),
         r"Expected `str`, got `int` - at `\$.blob_ids\[1\]`"),
        ("delete", body_bytes(blob_ids=[], holder="", reason="r"), r"Expected `str` of length >= 1 - at `\$.holder`"),
        ("delete", msgspec.msgpack.encode(["b1"]), "Expected `object`, got `array`"),
        ("fetch-ack", body_bytes(step=-1, holder="t", blob_ids=[]), r"Expected `int` >= 0 - at `\$.step`"),
        ("version-bump", body_bytes(version=1, nbytes=-5, manifest_digest="d"),
         r"Expected `int` >= 0 - at `\$.nbytes`"),
        ("replay", body_bytes(limit=0), r"Expected `int` >= 1 - at `\$.limit`"),
        ("sync", body_bytes(token="t", path="sideways"), r"Invalid enum value 'sideways' - at `\$.path`"),
        ("node-up", body_bytes(node={**msgspec.to_builtins(NODE), "pid": -1}),
         r"Expected `int` >= 0 - at `\$.node.pid`"),
        ("node-list", body_bytes(nodes=[msgspec.to_builtins(NODE), {"node_id": "x"}]),
         r"Object missing required field `role` - at `\$.nodes\[1\]`"),
        ("ok", body_bytes(detail=msgspec.msgpack.Ext(EXT_NUMPY, b"\x90")),
         r"Expected `str`, got `ext` - at `\$.detail`"),
        ("episode-finished", body_bytes(episode_id="e", source="s", refs=[], again="yes"),
         r"Expected `bool`, got `str` - at `\$.again`"),
    ],
    ids=["missing-field", "wrong-type", "wrong-item-type", "empty-name", "not-a-map", "negative-step",
         "negative-nbytes", "limit-below-range", "bad-literal", "nested-negative", "nested-missing", "ext-in-str",
         "not-a-flag"],
)
def test_body_schema_errors_say_what_and_where(kind: str, body: bytes, match: str) -> None:
    err = raises(SchemaError, [kind.encode(), header_bytes(), body], match=rf"^{kind}: {match}")
    assert err.kind == kind


# --- size limits --------------------------------------------------------------------------------------


def test_body_over_the_limit_is_refused_before_decoding() -> None:
    frames = SENDER.encode(Delete(blob_ids=[f"blob-{i:04d}" for i in range(100)], holder="h", reason="r"))
    size = len(frames[2])
    at_limit = WireCodec("rx", limits=Limits(max_body_bytes=size))
    assert len(at_limit.decode(frames).body.blob_ids) == 100
    below = WireCodec("rx", limits=Limits(max_body_bytes=size - 1))
    raises(MessageTooLarge, frames, codec=below, match=rf"^delete: body is {size} bytes, limit {size - 1}$")
    # Checked before the body is parsed: garbage of that size is still "too large", not "malformed".
    raises(MessageTooLarge, [b"delete", header_bytes(), b"\xc1" * size], codec=below, match="body is")


def test_message_over_the_limit_is_refused() -> None:
    frames = with_array(np.zeros(1000, dtype=np.float64))
    total = sum(memoryview(f).nbytes for f in frames)
    assert WireCodec("rx", limits=Limits(max_message_bytes=total)).decode(frames).kind == "blobs"
    small = WireCodec("rx", limits=Limits(max_message_bytes=total - 1))
    raises(MessageTooLarge, frames, codec=small, match=rf"^blobs: message is {total} bytes, limit {total - 1}$")


def test_default_limits() -> None:
    assert Limits().max_body_bytes == 16 << 20
    assert Limits().max_message_bytes == 8 << 30


# --- buffer frames and array descriptors --------------------------------------------------------------


def test_stray_buffer_frames_are_refused() -> None:
    raises(MalformedMessage, [*SENDER.encode(Ok()), b"stray"], match=r"^ok: 1 buffer frames but the body describes 0$")
    frames = with_array(np.arange(3))
    raises(MalformedMessage, [*frames, b"x", b"y"], match="3 buffer frames but the body describes 1")


def test_descriptor_pointing_at_a_missing_frame() -> None:
    frames = with_array(np.arange(3))
    raises_array_error(ArrayError, frames[:MIN_FRAMES], match=r"^descriptor points at buffer frame 0, message has 0$")
    bad = blobs_frames({"x": ext(EXT_NUMPY, "uint8", [1], 5, checksum(b"a"))}, [b"a"])
    raises_array_error(ArrayError, bad, match="descriptor points at buffer frame 5, message has 1")
    negative = blobs_frames({"x": ext(EXT_NUMPY, "uint8", [1], -1, checksum(b"a"))}, [b"a"])
    raises_array_error(ArrayError, negative, match="descriptor points at buffer frame -1, message has 1")


def test_frame_referenced_twice() -> None:
    desc = ext(EXT_NUMPY, "uint8", [1], 0, checksum(b"a"))
    raises_array_error(ArrayError, blobs_frames({"x": desc, "y": desc}, [b"a"]),
                       match="buffer frame 0 is referenced twice")


@pytest.mark.parametrize("size", [0, 11, 13, 24])
def test_wrong_frame_size(size: int) -> None:
    frames = with_array(np.zeros((3, 2), dtype=np.float16))
    raises_array_error(ArrayError, [*frames[:MIN_FRAMES], b"\x00" * size],
                       match=rf"^buffer frame 0 holds {size} bytes, float16\[3, 2\] needs 12$")


def test_checksum_mismatch() -> None:
    frames = with_array(torch.arange(8, dtype=torch.bfloat16).reshape(2, 4))
    corrupt = bytearray(frames[MIN_FRAMES])
    corrupt[5] ^= 0x01
    err = raises_array_error(ChecksumMismatch, [*frames[:MIN_FRAMES], corrupt],
                             match=r"^buffer frame 0 \(bfloat16\[2, 4\]\) does not match its checksum$")
    assert err.code == "checksum" and isinstance(err, ArrayError)
    unchecked = RECEIVER.decode([*frames[:MIN_FRAMES], corrupt], verify=False)
    assert unchecked.body.blobs[0].arrays["x"].shape == (2, 4)


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (msgspec.msgpack.Ext(9, b"\x90"), "unknown msgpack extension code 9"),
        (msgspec.msgpack.Ext(EXT_TORCH, b"\xc1"), "bad array descriptor: "),
        (msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(["uint8", [1], 0])), "bad array descriptor: "),
        (msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode("x")), "bad array descriptor: Expected `array`"),
        (ext(EXT_NUMPY, "float128", [1], 0, 0), "unknown dtype 'float128'"),
        (ext(EXT_NUMPY, "uint8", [-1], 0, 0), r"negative dimension in shape \[-1\]"),
    ],
    ids=["unknown-ext-code", "undecodable", "short", "not-an-array", "unknown-dtype", "negative-dim"],
)
def test_bad_descriptors(descriptor: msgspec.msgpack.Ext, match: str) -> None:
    raises_array_error(ArrayError, blobs_frames({"x": descriptor}, [b"a"]), match=f"^{match}")


def test_array_errors_name_the_kind_like_other_decode_errors() -> None:
    """Regression: the kind, learnt after the error was raised, used to be missing from its message."""
    frames = with_array(np.zeros(3, dtype=np.float32))
    raises(ArrayError, [*frames[:MIN_FRAMES], b"short"], match="^blobs: buffer frame 0 holds 5 bytes")


@pytest.mark.parametrize("code", [EXT_NUMPY, EXT_TORCH], ids=["numpy", "torch"])
@pytest.mark.parametrize("shape", [[2**32, 2**32, 0], [2**62, 4]], ids=["huge-with-zero", "product-wraps"])
def test_shape_too_big_for_an_empty_frame_is_an_array_error(code: int, shape: list[int]) -> None:
    """Regression: 0 elements (or an int64 product wrapping to 0) passed the size check against an empty frame
    and numpy/torch then raised ValueError/RuntimeError, which escaped the ProtocolError family."""
    dims = ", ".join(str(d) for d in shape)
    raises_array_error(ArrayError, blobs_frames({"x": ext(code, "uint8", shape, 0, checksum(b""))}, [b""]),
                       match=rf".*uint8\[{dims}\]")


def test_numpy_only_decoder_refuses_torch_only_dtype() -> None:
    frames = with_array(torch.zeros(2, dtype=torch.float8_e4m3fn))
    raises_array_error(ArrayError, frames, backend="numpy", match="float8_e4m3fn has no numpy equivalent")


# --- signing ------------------------------------------------------------------------------------------

SECRET = b"cluster-secret"


def signed_pair() -> tuple[WireCodec, WireCodec]:
    return WireCodec("signer", secret=SECRET), WireCodec("verifier", secret=SECRET)


def mac_of(frames: list, secret: bytes = SECRET) -> bytes:
    """The wire's MAC, written out from its documented definition (not the codec's helper): HMAC-SHA256 over
    each frame's length as 8 little-endian bytes followed by the frame."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little") + bytes(frame))
    return mac.digest()


def signed_by_hand(header: dict[str, Any], body: bytes, *buffers: bytes, kind: bytes = b"delete") -> list[bytes]:
    """Frames a third-party signer would send: the header map exactly as given, the MAC frame last."""
    frames = [kind, msgspec.msgpack.encode(header), body, *buffers]
    return [*frames, mac_of(frames)]


def test_signed_round_trip() -> None:
    signer, verifier = signed_pair()
    frames = signer.encode(DELETE, seq=4)
    header = msgspec.msgpack.decode(frames[1], type=Header)
    assert header.signed and len(frames) == MIN_FRAMES + 1
    assert frames[-1] == mac_of(frames[:-1])  # the MAC is outside what it signs
    message = verifier.decode(frames)
    assert message.body == DELETE and message.header.seq == 4 and message.buffers == []
    array_frames = signer.encode(Blobs([FetchedBlob("b", {"x": np.arange(5)})]))
    decoded = verifier.decode(array_frames)
    assert decoded.body.blobs[0].arrays["x"].tolist() == [0, 1, 2, 3, 4] and len(decoded.buffers) == 1
    assert WireCodec("unsigned").decode(frames).body == DELETE  # an unsigned node skips the MAC frame


@pytest.mark.parametrize(
    "header",
    [
        {"v": [2, 7], "id": "x-1", "src": "third-party", "seq": 0, "ts": 1.5, "signed": True, "later": {"a": [1]}},
        {"signed": True, "ts": 1.5, "seq": 0, "src": "third-party", "id": "x-1", "v": [2, 0]},
        {"v": [2, 0], "id": "x-1", "src": "third-party", "seq": 0, "ts": 1800000000, "signed": True},
    ],
    ids=["unknown-optional-field-newer-minor", "reordered-keys", "integer-ts"],
)
def test_the_mac_covers_the_bytes_received_not_a_re_encoding(header: dict[str, Any]) -> None:
    _, verifier = signed_pair()
    frames = signed_by_hand(header, msgspec.msgpack.encode(DELETE))
    message = verifier.decode(frames)
    assert message.body == DELETE and message.header.src == "third-party"


def test_signed_arrays_verify_as_received() -> None:
    _, verifier = signed_pair()
    data = np.arange(4, dtype=np.uint8)
    body = msgspec.msgpack.encode({"blobs": [{"blob_id": "b", "arrays": {"x": msgspec.msgpack.Ext(
        EXT_NUMPY, msgspec.msgpack.encode(["uint8", [4], 0, checksum(data.tobytes())]))}}]})
    header = {"ts": 2, "v": [2, 0], "id": "x-2", "src": "third-party", "seq": 0, "signed": True}
    frames = signed_by_hand(header, body, data.tobytes(), kind=b"blobs")
    assert verifier.decode(frames).body.blobs[0].arrays["x"].tolist() == [0, 1, 2, 3]


def test_unsigned_message_to_a_signed_codec() -> None:
    _, verifier = signed_pair()
    raises(BadSignature, SENDER.encode(DELETE), codec=verifier,
           match="^delete: unsigned message from 'sender' on a signed bus$")


def test_wrong_secret() -> None:
    _, verifier = signed_pair()
    frames = WireCodec("intruder", secret=b"another-secret").encode(DELETE)
    raises(BadSignature, frames, codec=verifier, match="^delete: bad MAC on message from 'intruder'$")


@pytest.mark.parametrize(
    ("mac", "match"),
    [(b"", "MAC frame of 0 bytes from 'signer', expected 32"), (b"\0" * 31, "MAC frame of 31 bytes"),
     (b"\0" * 32, "bad MAC on message from 'signer'"), (b"\0" * 1000, "MAC frame of 1000 bytes")],
    ids=["empty", "short", "zeros", "long"],
)
def test_garbage_mac_frames_are_refused(mac: bytes, match: str) -> None:
    signer, verifier = signed_pair()
    frames = [bytes(f) for f in signer.encode(DELETE)]
    raises(BadSignature, [*frames[:-1], mac], codec=verifier, match=match)


@pytest.mark.parametrize("form", ["frames", "one-frame", "batch"])
def test_a_long_mac_frame_is_refused_by_its_size_before_any_copy(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last frame of a signed message was copied whole before its size was checked: a forged message whose
    last frame was 512 MiB cost 512 MiB more. Its size is read from the buffer, and only a 32-byte MAC is copied."""
    signer, verifier = signed_pair()
    if form == "batch":
        items = [signer.batch_item(DELETE, seq) for seq in (1, 2)]
        signed = [bytes(f) for f in signer.encode_batch(DELETE.kind, [item for item in items if item is not None])]
    else:
        signed = [bytes(f) for f in signer.encode(DELETE, one_frame=form == "one-frame")]
    long_mac = memoryview(bytearray(1 << 20))  # stands for the zmq.Frame a receiver hands over
    copied: list[int] = []
    as_bytes = envelope._as_bytes
    monkeypatch.setattr(envelope, "_as_bytes", lambda frame: copied.append(memoryview(frame).nbytes) or as_bytes(frame))
    frames = [*signed[:-1], long_mac]
    with pytest.raises(BadSignature, match=f"MAC frame of {1 << 20} bytes"):
        verifier.read_events(frames) if form == "batch" else verifier.decode_header(frames)
    assert 1 << 20 not in copied


def test_a_message_of_more_arrays_than_a_message_has_frames_is_refused_by_its_sender() -> None:
    """No receiver takes a message of more than ``MAX_FRAMES`` frames: the sender refuses to build one (the caller
    splits it), where it used to go out and be refused by every receiver."""
    signer, verifier = signed_pair()
    full = ShardData(data=[np.zeros(1, np.uint8)] * MAX_BUFFERS)
    frames = signer.encode(full)
    assert len(frames) == MAX_FRAMES and len(verifier.decode(frames).body.data) == MAX_BUFFERS
    with pytest.raises(MessageTooLarge, match=f"{MAX_BUFFERS + 1} arrays in one message, at most {MAX_BUFFERS}"):
        signer.encode(ShardData(data=[np.zeros(1, np.uint8)] * (MAX_BUFFERS + 1)))


def test_a_signed_header_without_a_mac_frame_is_malformed() -> None:
    signer, verifier = signed_pair()
    frames = [bytes(f) for f in signer.encode(DELETE)][:-1]
    for codec in (verifier, RECEIVER):
        raises(MalformedMessage, frames, codec=codec, match="a signed header, but no frame after the body")


@pytest.mark.parametrize(
    "tamper",
    [
        lambda f: [f[0], f[1], SENDER.encode(Delete(blob_ids=["other"], holder="orchestrator", reason="trained"))[2],
                   f[3]],
        lambda f: [f[0], f[1], f[2][:-1] + b"X", f[3]],
        lambda f: [f[0], msgspec.msgpack.encode(msgspec.structs.replace(
            msgspec.msgpack.decode(f[1], type=Header), seq=99)), f[2], f[3]],
        lambda f: [f[0], msgspec.msgpack.encode(msgspec.structs.replace(
            msgspec.msgpack.decode(f[1], type=Header), src="someone-else")), f[2], f[3]],
        lambda f: [b"fetch", f[1], f[2], f[3]],
        lambda f: [f[0], f[1], f[2], b"", f[3]],
    ],
    ids=["other-body", "flipped-body-byte", "header-seq", "header-src", "kind", "extra-empty-frame"],
)
def test_tampering_breaks_the_signature(tamper: Callable[[list], list]) -> None:
    signer, verifier = signed_pair()
    frames = [bytes(f) for f in signer.encode(DELETE, seq=5)]
    assert verifier.decode(frames).body == DELETE
    raises(BadSignature, tamper(frames), codec=verifier, match="bad MAC on message from")


def test_bytes_moved_between_frames_break_the_signature() -> None:
    """Without length prefixes, ``kind ‖ header`` could shift a byte across the frame boundary unnoticed."""
    signer, verifier = signed_pair()
    kind, header, body, mac = (bytes(f) for f in signer.encode(DELETE))
    moved = [kind, header[:-1], header[-1:] + body, mac]
    assert b"".join(moved[:3]) == kind + header + body
    with pytest.raises(ProtocolError):
        verifier.decode(moved)


def test_signed_codec_always_verifies_buffers() -> None:
    signer, verifier = signed_pair()
    frames = [bytes(f) for f in signer.encode(Blobs([FetchedBlob("b", {"x": np.arange(4, dtype=np.uint8)})]))]
    tampered = [*frames[:MIN_FRAMES], b"\x09\x01\x02\x03", frames[-1]]
    raises(BadSignature, tampered, codec=verifier, verify=False, match="bad MAC")
    assert WireCodec("plain").decode(tampered, verify=False).body.blobs[0].arrays["x"].tolist() == [9, 1, 2, 3]


# --- one-frame form ------------------------------------------------------------------------------------


def one_frame(kind: bytes, header: bytes, body: bytes) -> bytes:
    """The one-frame form written out from its documented layout."""
    return kind + b"\0" + len(header).to_bytes(4, "little") + header + body


@pytest.mark.parametrize("secret", [b"", SECRET], ids=["plain", "signed"])
def test_one_frame_round_trip_in_both_codecs(secret: bytes) -> None:
    sender, receiver = WireCodec("sender", secret=secret), WireCodec("receiver", secret=secret)
    frames = sender.encode(DELETE, seq=7, msg_id="m-7", one_frame=True)
    assert len(frames) == 1 + bool(secret) and frames[0].startswith(b"delete\0")  # still a topic prefix
    multi = sender.encode(DELETE, seq=7, msg_id="m-7")
    header, body = multi[1], multi[2]
    if not secret:  # same header and body bytes as the multi-frame form (ts aside)
        ts_free = msgspec.msgpack.decode(frames[0][11:11 + int.from_bytes(frames[0][7:11], "little")])
        assert {k: v for k, v in ts_free.items() if k != "ts"} == {
            k: v for k, v in msgspec.msgpack.decode(header).items() if k != "ts"}
        assert frames[0].endswith(body)
    message = receiver.decode(frames)
    assert (message.kind, message.body, message.header.seq, message.header.id) == ("delete", DELETE, 7, "m-7")
    assert message.buffers == []
    assert WireCodec("unsigned").decode(frames).body == DELETE


def test_messages_with_arrays_keep_their_array_frames() -> None:
    frames = SENDER.encode(Blobs([FetchedBlob("b", {"x": np.arange(3)})]), one_frame=True)
    assert [bytes(f) for f in frames[:1]] == [b"blobs"] and len(frames) == MIN_FRAMES + 1


def test_a_hand_written_one_frame_message_decodes() -> None:
    header = msgspec.msgpack.encode({"ts": 3, "v": [2, 9], "id": "h-1", "src": "third-party", "seq": 0,
                                     "later": [1, 2]})
    message = RECEIVER.decode([one_frame(b"delete", header, msgspec.msgpack.encode(DELETE))])
    assert message.body == DELETE and message.header.src == "third-party"


GOOD_HEADER = msgspec.msgpack.encode({"v": [2, 0], "id": "g-1", "src": "garbage", "seq": 1, "ts": 1.0})
GOOD_BODY = msgspec.msgpack.encode(DELETE)


@pytest.mark.parametrize(
    ("frames", "exc_type", "match"),
    [
        ([b"\0" + GOOD_HEADER], MalformedMessage, "^one-frame message with an empty kind$"),
        ([b"delete\0\x01\x00"], MalformedMessage, "^one-frame message of 9 bytes ends inside its header length$"),
        ([b"delete\0\xff\xff\xff\xff" + GOOD_HEADER], MalformedMessage,
         f"^one-frame message declares a 4294967295-byte header, {len(GOOD_HEADER)} bytes follow$"),
        ([one_frame(b"delete", GOOD_HEADER[:-3], GOOD_BODY)], MalformedMessage, "^delete: header frame:"),
        ([one_frame(b"delete", GOOD_HEADER, b"\xc1")], MalformedMessage, "^delete: body frame:"),
        ([one_frame(b"del\xffete", GOOD_HEADER, GOOD_BODY)], MalformedMessage, "^kind frame is not ASCII"),
        ([one_frame(b"teleport", GOOD_HEADER, GOOD_BODY)], UnknownKind, "unknown message kind 'teleport'"),
        ([one_frame(b"delete", GOOD_HEADER, GOOD_BODY), b"extra"], MalformedMessage,
         r"^delete: one-frame message followed by 1 frames \(none expected\)$"),
        ([one_frame(b"delete", msgspec.msgpack.encode({"v": [2, 0], "id": "g", "src": "s", "seq": 1, "ts": 1.0,
                                                       "signed": True}), GOOD_BODY)], MalformedMessage,
         r"^delete: one-frame message followed by 0 frames \(a MAC frame only expected\)$"),
        ([one_frame(b"delete", msgspec.msgpack.encode({"v": [1, 0], "id": "g", "src": "s", "seq": 1, "ts": 1.0}),
                    GOOD_BODY)], VersionMismatch, "^delete: protocol 1.0 from 's'"),
        ([one_frame(b"delete", GOOD_HEADER, msgspec.msgpack.encode({"blob_ids": 5}))], SchemaError, "blob_ids"),
    ],
    ids=["empty-kind", "short-length", "huge-header-length", "cut-header", "bad-body", "non-ascii-kind",
         "unknown-kind", "extra-frame", "signed-without-mac", "old-version", "schema"],
)
def test_garbage_one_frame_messages(frames: list, exc_type: type[ProtocolError], match: str) -> None:
    raises(exc_type, frames, match=match)


def test_a_signing_codec_refuses_an_unsigned_one_frame_message_and_a_moved_mac() -> None:
    signer, verifier = signed_pair()
    raises(BadSignature, SENDER.encode(DELETE, one_frame=True), codec=verifier, match="unsigned message")
    frame, mac = (bytes(f) for f in signer.encode(DELETE, one_frame=True))
    raises(BadSignature, [frame[:-1] + b"X", mac], codec=verifier, match="bad MAC")
    raises(MalformedMessage, [frame, mac, mac], codec=verifier, match="followed by 2 frames")


def test_random_mutations_of_one_frame_messages_raise_protocol_errors_only() -> None:
    for secret in (b"", SECRET):
        codec = WireCodec("fuzzed", secret=secret)
        valid = [bytes(f) for f in WireCodec("sender", secret=secret).encode(DELETE, seq=1, one_frame=True)]
        for index in range(500):
            frames = mutate(valid, random.Random(f"one-frame:{secret!r}:{index}"))
            with contextlib.suppress(ProtocolError):  # anything else fails the test
                codec.decode(frames)


# --- describe -----------------------------------------------------------------------------------------


def test_describe_is_json_ready_with_header_fields_and_body() -> None:
    message = RECEIVER.decode(SENDER.encode(DELETE, seq=12, msg_id="m-12"))
    record = describe(message)
    assert record["type"] == "delete"
    assert record["src"] == "sender"
    assert record["seq"] == 12
    assert record["id"] == "m-12"
    assert abs(record["ts"] - time.time()) < 60
    assert record["blob_ids"] == ["b1", "b2"] and record["holder"] == "orchestrator" and record["reason"] == "trained"
    assert json.loads(json.dumps(record)) == record


def test_describe_summarises_arrays_and_nested_structs() -> None:
    body = Blobs([FetchedBlob("b", {
        "routing": np.zeros((5, 48, 8), dtype=np.uint8),
        "logprobs": torch.zeros(5, 2, dtype=torch.bfloat16),
        "scalar": np.float32(1.0),
        "empty": torch.empty(0, 3, dtype=torch.float8_e5m2),
    })])
    record = describe(RECEIVER.decode(SENDER.encode(body)))
    assert record["blobs"] == [{"blob_id": "b", "arrays": {
        "routing": "<uint8[5x48x8]>",
        "logprobs": "<bfloat16[5x2]>",
        "scalar": "<float32[]>",
        "empty": "<float8_e5m2[0x3]>",
    }}]
    node_up = describe(RECEIVER.decode(SENDER.encode(NodeUp(node=NODE))))
    assert node_up["node"]["endpoints"] == {"blobs": "tcp://h:1"} and node_up["node"]["status"] == {"load": 0.5}
    json.dumps(node_up)


def test_describe_includes_fields_at_their_default() -> None:
    """Regression: bodies omit defaults on the wire (omit_defaults), and describe() used to omit them too."""
    record = describe(RECEIVER.decode(SENDER.encode(Bye(node_id="env-0"))))
    assert record["reason"] == "shutdown"
    assert describe(RECEIVER.decode(SENDER.encode(Ok())))["detail"] == ""
    nested = describe(RECEIVER.decode(SENDER.encode(NodeUp(node=NodeInfo(node_id="n", role="r", host="h", pid=1)))))
    assert nested["node"]["endpoints"] == {} and nested["node"]["metrics"] == ""


def test_message_repr_hides_buffers() -> None:
    message = RECEIVER.decode(with_array(np.arange(3)))
    assert isinstance(message, Message)
    assert "memory at" not in repr(message) and "buffers=<1>" in repr(message)
    assert len(message.buffers) == 1


def _header_outcome(codec: WireCodec, frames: list[Any], **kwargs: Any) -> Any:
    try:
        return codec.decode_header(frames, **kwargs)
    except ProtocolError as exc:
        return type(exc), str(exc), exc.kind


def test_the_one_step_path_for_unsigned_one_frame_events_decides_as_the_general_path_does() -> None:
    """``decode_header`` takes an unsigned one-frame ``bytes`` message in one short step and leaves the rest to
    the general path (which a memoryview of the same frame takes): every byte of an event replaced by a few
    values, and every truncation, must give the same result or the same refusal either way."""
    rng = random.Random(14)
    sender = WireCodec("pub-7")
    receiver = WireCodec("sub", limits=Limits(max_body_bytes=120))
    frames_of = [sender.encode(body, seq=3, one_frame=True)
                 for body in (Delete(blob_ids=["b-1", "b-2"], holder="t-0", reason="trained"), Sync(token="t"),
                              Delete(blob_ids=[f"b-{i}" for i in range(40)], holder="t-0", reason="too-large"))]
    frames_of.append([sender.encode(Ok(), one_frame=True)[0].replace(b"ok", b"zz", 1)])  # a kind nobody defines
    variants = 0
    for (frame,) in frames_of:
        mutants = [frame[:cut] for cut in range(len(frame))]
        for at in range(len(frame)):
            mutants += [frame[:at] + bytes([value]) + frame[at + 1:] for value in (0, rng.randrange(256))]
        for mutant in [frame, *mutants]:
            for known in (True, False):
                fast = _header_outcome(receiver, [mutant], known=known)
                general = _header_outcome(receiver, [memoryview(mutant)], known=known)
                assert fast == general, mutant
                variants += 1
    assert variants > 1000
    ok = receiver.decode_header(frames_of[0])
    assert (ok.kind, ok.header.src, ok.header.seq) == ("delete", "pub-7", 3)


def _decode_outcome(decode: Callable[[], Message]) -> Any:
    try:
        message = decode()
    except ProtocolError as exc:
        return type(exc), str(exc), exc.kind
    return message.kind, message.header, message.body, list(message.buffers)


@pytest.mark.parametrize(("limits", "codes"), [
    (Limits(max_body_bytes=400, max_items=20, max_depth=3), {"delete": 1, "sync": 1, "malformed": 2, "array": 1}),
    (Limits(max_body_bytes=400, max_depth=3), {"delete": 2, "sync": 1, "malformed": 1, "array": 1}),
], ids=["bounds-walked", "depth-checked"])
def test_the_lean_event_path_accepts_and_refuses_as_decode_does(limits: Limits, codes: dict[str, int]) -> None:
    """A subscriber decodes the common event with ``decode_header``'s first step, ``event_header``, then
    ``decode_body``; anything ``event_header`` declines goes on through ``decode_header``. For every truncation of an
    event and every byte replaced by a few values, that path gives what ``decode`` on the general path (a memoryview of
    the same frame) gives: the same message or the same refusal. The events: bodies over ``max_items`` bytes (walked by
    ``check_structure``, one with too many items), an ``Any``-typed field nested too deep (refused by the walk, or by
    the depth check after decoding when ``max_items`` is too large for the walk to run), an array reference with no
    buffer frame (decoded right after a message with one, so the unpacker must be reset)."""
    rng = random.Random(15)
    sender = WireCodec("pub-8")
    receiver = WireCodec("sub", limits=limits)
    bodies = [Delete(blob_ids=["b-1", "b-2"], holder="t-0", reason="trained"), Sync(token="t"),
              Delete(blob_ids=[f"b-{i}" for i in range(30)], holder="t-0", reason="too-many-items"),
              EpisodeFinished(episode_id="e", source="s", refs=[], info={"a": [[[1]]], "b": "x" * 9})]
    frames_of = [sender.encode(body, seq=4, one_frame=True) for body in bodies]
    with_array = sender.encode(EpisodeFinished(episode_id="e", source="s", refs=[], info={"x": np.arange(3)}))
    header = sender.encode(Ok(), seq=4, one_frame=True)[0].split(b"\0", 1)[1]
    header = header[4 : 4 + int.from_bytes(header[:4], "little")]
    # the body of a message with an array, sent without its buffer frame: it references one nobody sent
    frames_of.append([b"episode-finished\0" + len(header).to_bytes(4, "little") + header + bytes(with_array[2])])
    variants = lean = 0
    for (frame,) in frames_of:
        mutants = [frame[:cut] for cut in range(len(frame))]
        for at in range(len(frame)):
            mutants += [frame[:at] + bytes([value]) + frame[at + 1:] for value in (0, rng.randrange(256))]
        for mutant in [frame, *mutants]:
            receiver.decode(with_array)  # the unpacker holds another message's buffer frame before each decode
            checked = receiver.event_header(mutant)
            if checked is None:
                fast = _decode_outcome(lambda m=mutant: receiver.decode([m]))
            else:
                lean += 1
                fast = _decode_outcome(lambda c=checked: receiver.decode_body(c))
            receiver.decode(with_array)
            general = _decode_outcome(lambda m=mutant: receiver.decode([memoryview(m)]))
            assert fast == general, mutant
            variants += 1
    assert variants > 2000 and lean > 1000, (variants, lean)
    outcomes: Counter[str] = Counter()
    for (frame,) in frames_of:
        receiver.decode(with_array)
        checked = receiver.event_header(frame)
        assert checked is not None
        outcome = _decode_outcome(lambda c=checked: receiver.decode_body(c))
        outcomes[outcome[0].code if isinstance(outcome[0], type) else outcome[0]] += 1
    assert outcomes == codes
    receiver.decode(with_array)
    with pytest.raises(ArrayError, match="points at buffer frame 0, message has 0"):  # none left from before
        receiver.decode_body(receiver.event_header(frames_of[-1][0]))  # type: ignore[arg-type]
