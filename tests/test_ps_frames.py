"""Cross-host pulls as frames (refbus.nodes.ps.frames) against a fake worker on a real socket: tensors read
in pieces that cross tensor and request boundaries land byte-identical in their destinations; corrupt, short
or missing answers, and a worker process SIGKILLed mid-read, fail the read with what went wrong."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from refbus.bus.reqrep import Client, HandlerError, RetryPolicy, Server
from refbus.bus.sockets import bound_endpoint
from refbus.nodes.ps.frames import FramesError, Wanted, read_frames
from refbus.nodes.ps.worker import served_pieces
from refbus.protocol.codec import Unhashed, checksum
from refbus.protocol.envelope import MAX_BUFFERS, NIL_CHECKSUM_SINCE, Message, WireCodec
from refbus.protocol.messages_ps import Location, ManifestEntry, ShardData, ShardRead

pytest_plugins = ["wire_fixtures"]

PATIENT = RetryPolicy(timeout_s=5.0, attempts=1)
SIZES = (0, 3, 17, 5, 40)  # bytes per tensor; pieces of 5 bytes cut most of them, requests of 12 cut pieces


def segment_and_wanted(segment: str = "seg-a") -> tuple[np.ndarray, list[Wanted]]:
    data = np.random.default_rng(7).integers(0, 256, 8 + sum(SIZES), dtype=np.uint8)
    wanted, offset = [], 8  # tensors start past a header the read must skip
    for index, size in enumerate(SIZES):
        raw = data[offset : offset + size]
        entry = ManifestEntry(f"t{index}", "uint8", [size], size, checksum(raw), [Location("w", segment, offset)])
        wanted.append(Wanted(entry, offset, segment))
        offset += size
    return data, wanted


def worker(data: np.ndarray, reads: list[ShardRead], answer: Callable[[ShardRead], Any] | None = None):
    def read(request: Message) -> ShardData:
        body = request.body
        assert isinstance(body, ShardRead)
        reads.append(body)
        if answer is not None:
            return answer(body)
        return ShardData([data[r.offset : r.offset + r.nbytes] for r in body.ranges])

    return lambda server: server.on(ShardRead.kind, read, cached=False)


@pytest.fixture
def client(zmq_ctx: zmq.Context):
    made: list[Client] = []

    def make(endpoint: str, policy: RetryPolicy = PATIENT) -> Client:
        made.append(Client(zmq_ctx, endpoint, WireCodec("reader"), policy=policy))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_pieces_land_byte_identical_in_caller_and_fresh_destinations(serve: Any, client: Any) -> None:
    data, wanted = segment_and_wanted()
    reads: list[ShardRead] = []
    srv = serve(worker(data, reads))
    given = torch.zeros(17, dtype=torch.uint8)  # t2 goes into a tensor the caller owns

    def destination(entry: ManifestEntry) -> torch.Tensor:
        return given if entry.name == "t2" else torch.empty(entry.nbytes, dtype=torch.uint8)

    got = read_frames(client(srv.endpoint), wanted, destination, chunk_bytes=12, window=2, piece_bytes=5)
    assert got[2] is given
    for item, tensor in zip(wanted, got, strict=True):
        start = item.offset
        assert tensor.numpy().tobytes() == data[start : start + item.entry.nbytes].tobytes(), item.entry.name
    ranges = [r for read in reads for r in read.ranges]
    assert max(r.nbytes for r in ranges) == 5 and sum(r.nbytes for r in ranges) == sum(SIZES)
    assert all(sum(r.nbytes for r in read.ranges) <= 12 for read in reads) and len(reads) >= 6


def test_a_request_asks_for_no_more_pieces_than_one_answer_carries(serve: Any, client: Any) -> None:
    """Each piece comes back as a frame, and no receiver takes a message of more than ``MAX_FRAMES`` frames: a
    shard of many small tensors is read in requests of at most ``MAX_BUFFERS`` pieces, however many
    ``chunk_bytes`` would hold."""
    count = MAX_BUFFERS + 10
    data = np.random.default_rng(3).integers(0, 256, count, dtype=np.uint8)
    wanted = [Wanted(ManifestEntry(f"t{i}", "uint8", [1], 1, checksum(data[i : i + 1]), [Location("w", "seg", i)]),
                     i, "seg") for i in range(count)]
    reads: list[ShardRead] = []
    srv = serve(worker(data, reads))
    got = read_frames(client(srv.endpoint), wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                      chunk_bytes=1 << 30, window=2)
    assert bytes(torch.cat(got).numpy()) == data.tobytes()
    assert len(reads) == 2 and max(len(read.ranges) for read in reads) == MAX_BUFFERS


def test_a_reply_that_overtakes_an_earlier_one_of_the_same_tensor_still_verifies(serve: Any, client: Any) -> None:
    """Replies of a window may come in another order than their requests (one resent after a loss comes after
    later ones): every byte lands in its place, and each tensor's checksum is still over its bytes in order (it
    was over the order of arrival, so the read failed though every byte was right)."""
    data, wanted = segment_and_wanted()
    held: list[Any] = []

    def answer(read: ShardRead) -> ShardData:
        return ShardData([data[r.offset : r.offset + r.nbytes] for r in read.ranges])

    def setup(server: Server) -> None:
        def read(request: Message) -> ShardData | None:
            body = request.body
            assert isinstance(body, ShardRead)
            if len(held) < 2:  # the first two: the second answered first, then the first
                held.append((server.pending, body))
                if len(held) == 2:
                    for pending, kept in reversed(held):
                        server.answer(pending, answer(kept))
                return None
            return answer(body)

        server.on(ShardRead.kind, read, cached=False)

    got = read_frames(client(serve(setup).endpoint), wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                      chunk_bytes=12, window=2, piece_bytes=5)
    assert len(held) == 2 and held[0][1].ranges[-1].offset + 5 == held[1][1].ranges[0].offset  # t2 spans both
    assert [t.numpy().tobytes() for t in got] == [data[w.offset : w.offset + w.entry.nbytes].tobytes()
                                                  for w in wanted]


def test_a_signed_reader_takes_unhashed_pieces_and_the_manifest_still_catches_changed_bytes(
        serve: Any, zmq_ctx: zmq.Context) -> None:
    # Workers send shard pieces unhashed; signing (a MAC over every frame) must not turn them away.
    secret = b"s" * 32
    data, wanted = segment_and_wanted()
    unhashed = worker(data, [], lambda read: ShardData([Unhashed(data[r.offset : r.offset + r.nbytes])
                                                         for r in read.ranges]))
    reader = Client(zmq_ctx, serve(unhashed, secret=secret).endpoint, WireCodec("reader", secret=secret),
                    policy=PATIENT)
    try:
        got = read_frames(reader, wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8), chunk_bytes=12,
                          window=2, piece_bytes=5)
        assert [t.numpy().tobytes() for t in got] == [data[w.offset : w.offset + w.entry.nbytes].tobytes()
                                                      for w in wanted]
        data[wanted[3].offset] ^= 0x01  # signed and unhashed in transit, still checked against the manifest
        with pytest.raises(FramesError, match="'t3' does not match the checksum"):
            read_frames(reader, wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8), chunk_bytes=12,
                        window=2, piece_bytes=5)
    finally:
        reader.close()


def test_a_worker_hashes_the_pieces_it_serves_to_a_reader_too_old_to_read_unhashed_frames() -> None:
    pieces = [np.arange(5, dtype=np.uint8), np.arange(3, dtype=np.uint8)]
    verifying = WireCodec("reader")
    for asked_in in [(2, 0), (1, 9)]:
        served = served_pieces(pieces, asked_in)
        assert not any(isinstance(piece, Unhashed) for piece in served)
        assert [p.tobytes() for p in served] == [p.tobytes() for p in pieces]
        verifying.decode(verifying.encode(ShardData(served)))  # every frame carries a checksum that verifies
    for asked_in in [NIL_CHECKSUM_SINCE, (NIL_CHECKSUM_SINCE[0], NIL_CHECKSUM_SINCE[1] + 1)]:
        served = served_pieces(pieces, asked_in)
        assert all(isinstance(piece, Unhashed) for piece in served)
        assert [p.array.tobytes() for p in served] == [p.tobytes() for p in pieces]  # type: ignore[union-attr]


def test_bytes_that_changed_after_the_manifest_fail_the_read_naming_the_tensor(serve: Any, client: Any) -> None:
    data, wanted = segment_and_wanted()
    data[wanted[4].offset + 33] ^= 0x40  # t4's last piece, after its checksum was taken
    srv = serve(worker(data, []))
    with pytest.raises(FramesError, match="'t4' does not match the checksum"):
        read_frames(client(srv.endpoint), wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                    chunk_bytes=12, window=2, piece_bytes=5)


@pytest.mark.parametrize(("answer", "match"), [
    (lambda read: ShardData([np.zeros(r.nbytes + 1, np.uint8) for r in read.ranges]), "bytes for a range of"),
    (lambda read: ShardData([]), "answered a read of"),
    (lambda read: (_ for _ in ()).throw(HandlerError("unknown-segment", "gone")), "unknown-segment"),
], ids=["long-piece", "no-pieces", "refused"])
def test_a_garbled_or_refused_answer_fails_the_read(serve: Any, client: Any, answer: Any, match: str) -> None:
    data, wanted = segment_and_wanted()
    srv = serve(worker(data, [], answer))
    with pytest.raises(FramesError, match=match):
        read_frames(client(srv.endpoint), wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                    chunk_bytes=12, window=2, piece_bytes=5)


def test_a_worker_that_never_answers_fails_the_read_at_its_deadline(client: Any, sockets: Any) -> None:
    _, wanted = segment_and_wanted()
    silent = bound_endpoint(sockets(zmq.ROUTER, bind="tcp://127.0.0.1:0"))
    with pytest.raises(FramesError, match="no reply"):
        read_frames(client(silent, RetryPolicy(timeout_s=0.05, attempts=2)), wanted,
                    lambda e: torch.empty(e.nbytes, dtype=torch.uint8), chunk_bytes=12, window=2, piece_bytes=5)


def _dying_worker(endpoint_out: Any) -> None:
    """A worker process that answers the first read, then is SIGKILLed by the second (mid-pull)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    data, _ = segment_and_wanted()
    reads: list[ShardRead] = []

    def read(request: Message) -> ShardData:
        if reads:
            os.kill(os.getpid(), signal.SIGKILL)
        reads.append(request.body)
        return ShardData([data[r.offset : r.offset + r.nbytes] for r in request.body.ranges])

    server = Server(sock, WireCodec("dying-worker"))
    server.on(ShardRead.kind, read, cached=False)
    endpoint_out.send(bound_endpoint(sock))
    while True:
        if sock.poll(1000, zmq.POLLIN):
            server.handle_one()


def test_a_worker_killed_mid_read_fails_it_within_the_policy(client: Any) -> None:
    _, wanted = segment_and_wanted()
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=_dying_worker, args=(theirs,), daemon=True)
    proc.start()
    try:
        assert ours.poll(30), "worker never started"
        endpoint = ours.recv()
        policy = RetryPolicy(timeout_s=0.2, attempts=2)
        with pytest.raises(FramesError, match="no reply"):
            read_frames(client(endpoint, policy), wanted, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                        chunk_bytes=12, window=1, piece_bytes=5)
        proc.join(timeout=10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
