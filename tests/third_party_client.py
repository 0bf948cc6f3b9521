"""A refbus client written from README and docs/PROTOCOL.md alone, as a third party would write one.

It uses pyzmq, msgpack and the standard library (hashlib and hmac sign), nothing of refbus or msgspec, and no
numpy: arrays are bytes with a dtype name and a shape. Checksums are xxh3-64 (seed 0), which the standard
library lacks; the ``xxhash`` package computes them when it is installed (refbus itself depends on it), and
:data:`xxh3` is None otherwise. Sending arrays needs it (a descriptor carries its checksum); without it a
client can still decode what it receives, unverified. tests/test_third_party_client.py drives this module
against live nodes and checks its imports.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

try:
    import xxhash

    xxh3: Callable[[bytes], int] | None = xxhash.xxh3_64_intdigest
except ImportError:  # the protocol's checksums cannot be computed: received arrays stay unverified
    xxh3 = None

VERSION = [2, 2]
EXT_NUMPY = 1
EXT_TORCH = 2
MAC_BYTES = 32
ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
            "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
            "bfloat16": 2}


class ClientError(Exception):
    """Something the peer sent is not what docs/PROTOCOL.md says it sends."""


class RemoteError(Exception):
    """An ``error`` reply: its ``code``, ``message`` and ``retry_after_s``."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.code = body["code"]
        self.retry_after_s = body.get("retry_after_s", 0.0)
        super().__init__(f"{self.code}: {body['message']}")


@dataclass(frozen=True)
class Array:
    """An array as the wire carries it: dtype name, shape and C-order little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def checksum(self) -> int:
        if xxh3 is None:
            raise ClientError("xxh3 checksums need the xxhash package")
        return xxh3(self.data)


@dataclass(frozen=True)
class Message:
    kind: str
    header: dict[str, Any]
    body: dict[str, Any]


def blob_checksum(arrays: Sequence[Array]) -> int:
    """xxh3-64 over the arrays' checksums, each a little-endian uint64, in field order."""
    if xxh3 is None:
        raise ClientError("xxh3 checksums need the xxhash package")
    return xxh3(b"".join(struct.pack("<Q", array.checksum()) for array in arrays))


class Wire:
    """Encodes and decodes envelopes for node ``src``; ``secret`` signs and checks every message."""

    def __init__(self, src: str, secret: bytes = b"") -> None:
        self.src = src
        self.secret = secret
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"

    def encode(self, kind: str, body: dict[str, Any], *, msg_id: str = "") -> tuple[str, list[bytes]]:
        """The multi-frame form of ``body``; :class:`Array` values anywhere in it become buffer frames."""
        buffers: list[bytes] = []

        def array_ext(value: object) -> msgpack.ExtType:
            if not isinstance(value, Array):
                raise TypeError(f"cannot encode {type(value).__name__}")
            descriptor = [value.dtype, list(value.shape), len(buffers), value.checksum()]
            buffers.append(value.data)
            return msgpack.ExtType(EXT_NUMPY, msgpack.packb(descriptor))

        msg_id = msg_id or self.new_id()
        body_bytes = msgpack.packb(body, default=array_ext)
        header = {"v": VERSION, "id": msg_id, "src": self.src, "seq": 0, "ts": time.time()}
        if self.secret:
            header["signed"] = True
        frames = [kind.encode("ascii"), msgpack.packb(header), body_bytes, *buffers]
        if self.secret:
            frames.append(self.mac(frames))
        return msg_id, frames

    def mac(self, frames: Sequence[bytes]) -> bytes:
        """HMAC-SHA256 over each frame as its 8-byte little-endian length, then its bytes."""
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(struct.pack("<Q", len(frame)))
            mac.update(frame)
        return mac.digest()

    def decode_events(self, frames: Sequence[bytes]) -> list[Message]:
        """An event message's events: the batch form (``kind ‖ 0x01 ‖ msgpack [[header, body], ...]``, one MAC
        for all when signed) gives each of its events, any other form its one message."""
        first = frames[0]
        mark = first.find(b"\1", 0, 256)
        if mark < 0 or len(frames) > 2 or b"\0" in first[:mark]:
            return [self.decode(frames)]
        kind, events = first[:mark].decode("ascii"), msgpack.unpackb(first[mark + 1:])
        for header, _ in events[1:]:
            check_version(header)
        self.check(first, events[0][0], frames)  # one MAC covers the batch
        return [Message(kind, header, body) for header, body in events]

    def check(self, first: bytes, header: dict[str, Any], frames: Sequence[bytes]) -> list[bytes]:
        """The frames a message's MAC covers, once its version (and MAC, when this client signs) checked."""
        check_version(header)
        signed = list(frames[:-1]) if header.get("signed") else list(frames)
        if self.secret:
            if not header.get("signed") or len(frames[-1]) != MAC_BYTES:
                raise ClientError(f"unsigned {first[:32]!r} on a signed bus")
            if not hmac.compare_digest(self.mac(signed), frames[-1]):
                raise ClientError(f"bad MAC on {first[:32]!r}")
        return signed

    def decode(self, frames: Sequence[bytes]) -> Message:
        """Either form, MAC checked when this client signs, arrays rebuilt and checked against their frames."""
        first = frames[0]
        mark = first.find(b"\0", 0, 256)
        header = msgpack.unpackb(frames[1] if mark < 0 else _one_frame_header(first, mark))
        signed = self.check(first, header, frames)
        if mark >= 0:
            if len(signed) != 1:
                raise ClientError("a one-frame message followed by frames other than its MAC")
            kind, header_len = first[:mark], struct.unpack_from("<I", first, mark + 1)[0]
            body_bytes, buffers = first[mark + 5 + header_len:], []
        else:
            kind, body_bytes, buffers = first, signed[2], signed[3:]

        def array_of(code: int, data: bytes) -> Array:
            if code not in (EXT_NUMPY, EXT_TORCH):
                raise ClientError(f"ext code {code}")
            dtype, shape, index, checksum = msgpack.unpackb(data)
            frame = bytes(buffers[index])
            size = ITEMSIZE[dtype]
            for dim in shape:
                size *= dim
            if len(frame) != size:
                raise ClientError(f"frame {index}: {len(frame)} bytes for {dtype}{shape}")
            array = Array(dtype, tuple(shape), frame)
            if xxh3 is not None and array.checksum() != checksum:
                raise ClientError(f"frame {index} does not match its checksum")
            return array

        body = msgpack.unpackb(body_bytes, ext_hook=array_of)
        return Message(kind.decode("ascii"), header, body)


def check_version(header: dict[str, Any]) -> None:
    if header["v"][0] != VERSION[0]:
        raise ClientError(f"protocol {header['v']} from {header['src']}")


def _one_frame_header(frame: bytes, mark: int) -> bytes:
    start = mark + 5
    return frame[start:start + struct.unpack_from("<I", frame, mark + 1)[0]]


class Peer:
    """A DEALER connected to one request endpoint (a ROUTER)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, wire: Wire) -> None:
        self.wire = wire
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def request(self, kind: str, body: dict[str, Any], *, timeout_s: float, attempts: int = 3) -> Message:
        """Send, wait for the reply whose ``re`` is this request's id; on a timeout resend the same frames
        (the same id: the server answers a retry from its reply cache). An ``error`` reply raises."""
        msg_id, frames = self.wire.encode(kind, body)
        for _ in range(attempts):
            self.sock.send_multipart(frames)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not self.sock.poll(int(left * 1000) + 1):
                    break
                reply = self.wire.decode(self.sock.recv_multipart())
                if reply.header.get("re") != msg_id:
                    continue  # the late answer to an earlier request
                if reply.kind == "error":
                    raise RemoteError(reply.body)
                return reply
        raise TimeoutError(f"no reply to {kind} within {attempts} x {timeout_s}s")

    def close(self) -> None:
        self.sock.close(linger=0)


class Events:
    """A SUB socket on the broker's ``events_out``, made live with the ``sync`` handshake."""

    def __init__(self, ctx: zmq.Context, control: Peer, events_out: str, *, timeout_s: float) -> None:
        self.wire = control.wire
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(events_out)
        self.last_seq: dict[tuple[str, str], int] = {}
        self.syncs_seen: list[Message] = []
        self.ready: list[Message] = []  # the rest of a batch, oldest first
        token = f"sub-{os.urandom(6).hex()}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            control.request("sync", {"token": token, "path": "sub"}, timeout_s=timeout_s)
            while (event := self.receive(100)) is not None:
                if event.kind == "sync":
                    self.syncs_seen.append(event)
                    if event.body["token"] == token:
                        return
        raise TimeoutError(f"no sync probe arrived from {events_out} within {timeout_s}s")

    def receive(self, timeout_ms: int) -> Message | None:
        """The next event, None when none arrives within ``timeout_ms``."""
        if not self.ready:
            if not self.sock.poll(timeout_ms):
                return None
            self.ready = self.wire.decode_events(self.sock.recv_multipart())
        return self.ready.pop(0)

    def next(self, kind: str, *, timeout_s: float, where: Callable[[dict[str, Any]], bool] = lambda body: True
             ) -> Message:
        """The next ``kind`` event whose body passes ``where``; ``sync`` probes (seq 0) are skipped, and each
        source incarnation's ``seq`` must grow."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            event = self.receive(int(left * 1000) + 1)
            if event is None:
                break
            if event.kind == "sync":
                self.syncs_seen.append(event)
                continue
            source = (event.header["src"], event.header["id"].partition("-")[0])
            if event.header["seq"] <= self.last_seq.get(source, 0):
                raise ClientError(f"event seq {event.header['seq']} from {source} does not grow")
            self.last_seq[source] = event.header["seq"]
            if event.kind == kind and where(event.body):
                return event
        raise TimeoutError(f"no {kind} event within {timeout_s}s")

    def close(self) -> None:
        self.sock.close(linger=0)


def hello(control: Peer, node_id: str, *, timeout_s: float) -> dict[str, Any]:
    """Register with the broker; the ``welcome`` body (event endpoints, the chosen major)."""
    node = {"node_id": node_id, "role": "client", "host": socket.gethostname(), "pid": os.getpid()}
    welcome = control.request("hello", {"node": node, "token": f"hello-{os.urandom(6).hex()}", "wire": [VERSION[0]]},
                              timeout_s=timeout_s)
    if welcome.kind != "welcome" or welcome.body["wire"] != VERSION[0]:
        raise ClientError(f"expected welcome with wire {VERSION[0]}, got {welcome}")
    return welcome.body
