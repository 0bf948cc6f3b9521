"""Hostile input for live nodes: deterministic mutations of valid frames, targeted bad messages, a probe
that expects exactly one reply per request, and the resident memory of a process.

Mutations are cheap: the valid frames are built once and each case edits a copy of their bytes with a
``random.Random`` seeded per case, so a failing case is reproduced from its seed alone.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
from refbus.bus.sockets import recv_frames
from refbus.protocol.envelope import MIN_FRAMES, PROTOCOL_VERSION, Message, WireCodec

CASES = int(os.environ.get("REFBUS_FUZZ_CASES", "2000"))
REPLY_WAIT_MS = 10_000  # per probe: many times a node's slowest honest answer on a loaded machine
RSS_GROWTH_KIB = 256 << 10  # generous: decoding garbage may fragment the heap, it must not hoard it

Frames = list[bytes]

# Bytes a mutation likes to write: msgpack type markers that change a value's meaning or size.
_MARKERS = bytes([0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC4, 0xC7, 0xCC, 0xCF, 0xD3,
                  0xD4, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF])


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return bytes([rng.choice(_MARKERS)])
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(buf))
        buf[pos] = rng.choice(_MARKERS) if rng.random() < 0.5 else buf[pos] ^ (1 << rng.randrange(8))
    return bytes(buf)


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))] if data else data


def _insert(data: bytes, rng: random.Random) -> bytes:
    pos = rng.randrange(len(data) + 1)
    return data[:pos] + bytes(rng.choice(_MARKERS) for _ in range(rng.randint(1, 8))) + data[pos:]


def _huge_length(data: bytes, rng: random.Random) -> bytes:
    """A container or string header declaring 2**32-1 items at a random place."""
    pos = rng.randrange(len(data) + 1)
    return data[:pos] + bytes([rng.choice([0xDD, 0xDF, 0xDB, 0xC6])]) + b"\xff\xff\xff\xff" + data[pos:]


_BYTE_EDITS: list[Callable[[bytes, random.Random], bytes]] = [_flip, _flip, _truncate, _insert, _huge_length]


def mutate(frames: Frames, rng: random.Random) -> Frames:
    """A copy of ``frames`` edited by one to three random operations; never an empty message."""
    out = list(frames)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(10)
        if op < 6:  # edit one frame's bytes, most often the header or the body
            index = rng.choice([1, 2, 2, 2] if len(out) > 2 else range(len(out)))
            index = min(index, len(out) - 1)
            out[index] = rng.choice(_BYTE_EDITS)(out[index], rng)
        elif op == 6 and len(out) > 1:
            del out[rng.randrange(len(out))]
        elif op == 7:
            out.insert(rng.randrange(len(out) + 1), rng.randbytes(rng.randint(0, 16)))
        elif op == 8 and len(out) > 1:
            i, j = rng.sample(range(len(out)), 2)
            out[i], out[j] = out[j], out[i]
        else:
            out[rng.randrange(len(out))] = b""
    return out or [b""]


def header(**overrides: Any) -> bytes:
    """A raw header map (what a third-party client would write), fields replaced by ``overrides``."""
    fields = {"v": list(PROTOCOL_VERSION), "id": "fuzz-1", "src": "fuzzer", "seq": 0, "ts": time.time()}
    return msgspec.msgpack.encode({**fields, **overrides})


def nested(depth: int) -> bytes:
    """``depth`` nested one-element lists around nil, encoded (100,000 deep is ~100 KB)."""
    return b"\x91" * depth + b"\xc0"


def with_info(frames: Frames, info: bytes) -> Frames:
    """``frames`` of a body with an ``info`` map field whose value is the raw msgpack ``info``."""
    body = msgspec.msgpack.decode(frames[2])
    body.pop("info", None)
    encoded = msgspec.msgpack.encode(body)
    count = encoded[0] & 0x0F  # a fixmap: bodies here have few fields
    assert encoded[0] & 0xF0 == 0x80 and count < 15
    return [frames[0], frames[1], bytes([0x80 | (count + 1)]) + encoded[1:] + b"\xa4info" + info, *frames[3:]]


def targeted(valid: Frames) -> dict[str, Frames]:
    """Named hostile variants of a valid request: each must be answered with exactly one ``error``."""
    kind, head, body, *buffers = valid
    return {
        "deep-nesting-100k": with_info(valid, b"\x81\xa1x" + nested(100_000)),
        "deep-nesting-500": with_info(valid, b"\x81\xa1x" + nested(500)),
        "deep-nesting-in-unknown-field": [kind, head, b"\x81\xa7unknown" + nested(100_000), *buffers],
        "deep-nesting-in-header": [kind, bytes([head[0] + 1]) + head[1:] + b"\xa1z" + nested(100_000), body,
                                   *buffers],
        "many-empty-maps": with_info(valid, b"\xdd\x00\x20\x00\x00" + b"\x80" * (2 << 20)),
        "huge-declared-list": with_info(valid, b"\xdd\xff\xff\xff\xff"),
        "huge-declared-string": [kind, head, b"\x81\xdb\xff\xff\xff\xff", *buffers],
        "huge-declared-bin-in-header": [kind, b"\x81\xa2id\xc6\xff\xff\xff\xff", body, *buffers],
        "extra-buffer-frame": [*valid, b"stray"],
        "missing-body": [kind, head],
        "only-kind": [kind],
        "req-style-delimiter": [b"", *valid],
        "wrong-major-version": [kind, header(v=[PROTOCOL_VERSION[0] + 1, 0]), body, *buffers],
        "version-not-a-pair": [kind, header(v="one"), body, *buffers],
        "unknown-kind": [b"no-such-kind", head, body, *buffers],
        "non-ascii-kind": [b"\xff\xfe", head, body, *buffers],
        "truncated-body": [kind, head, body[: len(body) // 2], *buffers],
        "truncated-header": [kind, head[: len(head) // 2], body, *buffers],
        "body-not-a-map": [kind, head, msgspec.msgpack.encode([1, 2, 3]), *buffers],
        "wrong-field-types": [kind, head, msgspec.msgpack.encode({k: [[{}]] for k in msgspec.msgpack.decode(body)}),
                              *buffers],
        "invalid-utf8": [kind, head, b"\x81\xa4info\x81\xa1x\xa2\xff\xfe", *buffers],
        "reserved-byte": [kind, head, b"\xc1", *buffers],
        "int-overflow": [kind, head, b"\x81\xa4info\x81\xa1x\xcf\xff\xff\xff\xff\xff\xff\xff\xff", *buffers],
        "ext-in-header": [kind, b"\xd6\xff\x00\x00\x00\x00", body, *buffers],
    } | ({
        "absurd-zero-size-shape": zero_size_shape(valid, [0, 2**59, 8]),
        "absurd-routing-shape": zero_size_shape(valid, [0, 100_000, 8]),
        "too-many-dimensions": zero_size_shape(valid, [0] * 40),
        "huge-declared-frame-size": [kind, head, body, *(b"" for _ in buffers)],
    } if buffers else {})


def zero_size_shape(frames: Frames, shape: list[int]) -> Frames:
    """``frames`` with every array descriptor's shape replaced by ``shape`` and its frame emptied."""
    from refbus.protocol.codec import checksum

    def rewrite(code: int, data: memoryview) -> msgspec.msgpack.Ext:
        dtype, _, index, _ = msgspec.msgpack.decode(data)
        return msgspec.msgpack.Ext(code, msgspec.msgpack.encode([dtype, shape, index, checksum(b"")]))

    body = msgspec.msgpack.decode(frames[2], ext_hook=rewrite)
    return [frames[0], frames[1], msgspec.msgpack.encode(body), *(b"" for _ in frames[MIN_FRAMES:])]


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` in KiB, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


class Prober:
    """A DEALER that sends one message and waits for exactly one reply."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.codec = WireCodec("fuzz-prober")

    def ask(self, frames: Frames, what: str) -> Message:
        """The reply to ``frames``, decoded; fails if none arrives or it cannot be decoded."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(REPLY_WAIT_MS, zmq.POLLIN), f"{what}: no reply within {REPLY_WAIT_MS} ms"
        return self.codec.decode(recv_frames(self.sock))

    def round_trip(self, body: Any) -> Frames:
        """A valid request's reply as ``[kind, body]`` bytes (the header differs per message); the reply must
        answer this request, so a stray extra reply to an earlier probe fails here."""
        msg_id = self.codec.new_id()
        self.sock.send_multipart(self.codec.encode(body, msg_id=msg_id))
        assert self.sock.poll(REPLY_WAIT_MS, zmq.POLLIN), f"no reply to a valid {body.kind}"
        frames = [bytes(f) for f in recv_frames(self.sock)]
        reply = self.codec.decode(frames)
        assert reply.header.re == msg_id, f"reply to {reply.header.re!r} arrived for {msg_id!r}: a probe got two"
        return [frames[0], frames[2], *frames[MIN_FRAMES:]]

    def close(self) -> None:
        self.sock.close()


def fuzz_forever(endpoint: str) -> None:
    """Send mutated ``delete`` requests to ``endpoint`` without end, printing ``started`` once some are out:
    what a test kills with SIGKILL in the middle of a stream."""
    from refbus.protocol.messages import Delete

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    valid = [bytes(f) for f in WireCodec("fuzz-victim").encode(Delete(blob_ids=["b"], holder="h", reason="r"))]
    rng = random.Random(0)
    for sent in range(1, 1 << 62):
        sock.send_multipart(mutate(valid, rng))
        while sock.poll(0, zmq.POLLIN):
            sock.recv_multipart()
        if sent == 200:
            print("started", flush=True)


def trainer_rank_main(bus: str, init: str, conn: Connection) -> None:
    """A trainer rank (world size 1) that serves ``step-batch`` while it waits for step 0 (a spawned child)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    from refbus.bus.logs import configure_logging
    from refbus.bus.runtime import NodeRuntime, RuntimeSettings
    from refbus.nodes.payload.trainer_rank import StepFailed, TrainerRank
    from refbus.nodes.settings import TrainerSettings

    configure_logging(level="error")
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=timedelta(seconds=60))
    runtime = NodeRuntime("trainer", RuntimeSettings(bus=bus, node_id="fuzz-trainer", metrics_port=-1,
                                                     connect_timeout_s=20))
    trainer = TrainerRank(runtime, settings=TrainerSettings(batch_timeout_s=3600))
    runtime.start_background()
    try:
        conn.send(runtime.endpoints["trainer"])
        while not runtime.stopping:
            try:
                trainer.begin_step(0)
            except StepFailed:
                break
    finally:
        runtime.join()
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    fuzz_forever(sys.argv[1])
