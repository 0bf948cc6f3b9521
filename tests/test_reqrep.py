"""Request/reply over real DEALER/ROUTER sockets on loopback tcp: a ``Server`` serviced by a background
thread, ``Client``s and raw DEALERs in the test thread.

Covers normal replies (arrays included), every kind of malformed request answered with an ``error`` reply
of the right code while the server keeps serving, idempotent retries (executed once, answered twice),
``cached=False`` routes, handler errors, timeouts, deferred replies and ``gather``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from polling import read_line
from refbus.bus.reqrep import (
    MAX_ATTEMPTS,
    MIN_TIMEOUT_S,
    Client,
    HandlerError,
    Pending,
    Pipeline,
    RemoteError,
    RequestTimeout,
    RetryPolicy,
    Server,
    gather,
)
from refbus.bus.sockets import FrameCounter, SocketOptions, bound_endpoint, recv_frames
from refbus.protocol.codec import EXT_NUMPY, Unhashed, checksum
from refbus.protocol.envelope import MIN_FRAMES, PROTOCOL_VERSION, Limits, Message, WireCodec
from refbus.protocol.errors import SchemaError
from refbus.protocol.messages import MAX_FRAMES, Blobs, Delete, Error, Fetch, FetchedBlob, Ok

pytest_plugins = ["wire_fixtures"]

LOOPBACK = "tcp://127.0.0.1:0"
WAIT_MS = 5000
PATIENT = RetryPolicy(timeout_s=5.0, attempts=1)
OVERRUN = 10  # deadlines a request may overrun before its test calls it hung (only to stop hangs, never a timing)
DELETE = Delete(blob_ids=["b1"], holder="orchestrator", reason="trained")
RAW = WireCodec("raw-client")
REPLIES = WireCodec("reply-reader")


@pytest.fixture
def clients(zmq_ctx: zmq.Context) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(endpoint: str, *, policy: RetryPolicy = PATIENT, on_stray: Any = None, src: str = "") -> Client:
        client = Client(zmq_ctx, endpoint, WireCodec(src or f"client-{len(made)}"), policy=policy, on_stray=on_stray)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def raw_dealer(sockets: Any) -> Callable[[str], zmq.Socket]:
    return lambda endpoint: sockets(zmq.DEALER, connect=endpoint)


def bounded(call: Callable[[], Any], deadline_s: float) -> Any:
    """What ``call()`` returned or raised, run in a thread that must end within OVERRUN x ``deadline_s``: only to
    stop a hang (a request that never ends) with a clear failure; how long it took is never asserted."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # handed to the test, which asserts which one it is
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # daemon: a hung call must not hold the interpreter
    thread.start()
    thread.join(OVERRUN * deadline_s)
    assert not thread.is_alive(), f"still waiting {OVERRUN} x its {deadline_s} s deadline later: it hangs"
    return outcome[0]


def recv_message(sock: zmq.Socket, codec: WireCodec, timeout_ms: int = WAIT_MS) -> Message:
    """The next message on ``sock``, decoded; fails the test if none arrives in time."""
    assert sock.poll(timeout_ms, zmq.POLLIN), f"nothing arrived within {timeout_ms} ms"
    return codec.decode(recv_frames(sock))


def exchange(dealer: zmq.Socket, frames: list, timeout_ms: int = WAIT_MS) -> Message:
    """Send raw frames on a DEALER and decode the reply."""
    dealer.send_multipart(frames)
    return recv_message(dealer, REPLIES, timeout_ms)


class Counting:
    """Handlers that count executions; they run on the server thread."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.ids: list[str] = []

    def delete(self, request: Message) -> Ok:
        self.calls["delete"] += 1
        self.ids.append(request.header.id)
        assert isinstance(request.body, Delete)
        return Ok(detail=f"deleted {','.join(request.body.blob_ids)} #{self.calls['delete']}")

    def blobs(self, request: Message) -> Ok:
        self.calls["blobs"] += 1
        return Ok()

    def setup(self, server: Server) -> None:
        server.on("delete", self.delete)
        server.on("blobs", self.blobs)  # a kind with arrays: the server decodes only bodies it serves


# --- normal operation ---------------------------------------------------------------------------------


def test_request_reply_round_trip(serve: Any, clients: Any) -> None:
    handlers = Counting()
    srv = serve(handlers.setup)
    client = clients(srv.endpoint, src="trainer-3")
    reply = client.request(DELETE)
    assert reply.kind == "ok"
    assert reply.body == Ok(detail="deleted b1 #1")
    assert reply.header.src == "srv"
    assert reply.header.re == handlers.ids[0]
    assert handlers.ids[0].startswith(client.codec.new_id().split("-")[0])
    assert client.request(Delete(blob_ids=["b2", "b3"], holder="o", reason="r")).body.detail == "deleted b2,b3 #2"
    assert srv.server.handled["delete"] == 2
    assert client.retries == 0
    assert not srv.server.rejected


def test_arrays_travel_both_ways_and_are_owned_by_the_receiver(serve: Any, clients: Any) -> None:
    seen: list[tuple[bool, float]] = []

    def echo(request: Message) -> Blobs:
        arrays = request.body.blobs[0].arrays
        matrix = arrays["m"]
        seen.append((bool(matrix.flags.writeable), float(matrix.sum())))
        matrix *= 2  # the handler owns the request's arrays
        return Blobs([FetchedBlob("back", {"m": matrix, "t": arrays["t"] + 1})])

    def setup(server: Server) -> None:
        server.backend = "native"  # each array as its sender's library made it (the default is numpy)
        server.on("blobs", echo)

    srv = serve(setup)
    client = clients(srv.endpoint)
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    reply = client.request(Blobs([FetchedBlob("b", {"m": matrix, "t": tensor})]), backend="native")
    assert seen == [(True, 66.0)]
    back = reply.body.blobs[0].arrays
    assert isinstance(back["m"], np.ndarray) and back["m"].flags.writeable
    assert np.array_equal(back["m"], matrix * 2)
    assert isinstance(back["t"], torch.Tensor) and back["t"].dtype == torch.bfloat16
    assert back["t"].tolist() == (tensor + 1).tolist()
    assert np.array_equal(matrix, np.arange(12, dtype=np.float32).reshape(3, 4))  # the sender's copy untouched
    as_torch = client.request(Blobs([FetchedBlob("b", {"m": matrix, "t": tensor})]), backend="torch")
    assert isinstance(as_torch.body.blobs[0].arrays["m"], torch.Tensor)


# --- malformed requests -------------------------------------------------------------------------------


def raw_frames(body: Any = DELETE, msg_id: str = "raw-1") -> list[bytes]:
    return [bytes(f) for f in RAW.encode(body, msg_id=msg_id)]


def raw_header(**overrides: Any) -> bytes:
    fields = {"v": list(PROTOCOL_VERSION), "id": "raw-1", "src": "raw-client", "seq": 0, "ts": time.time()}
    return msgspec.msgpack.encode({**fields, **overrides})


def corrupt_checksum() -> list[bytes]:
    frames = raw_frames(Blobs([FetchedBlob("b", {"x": np.arange(4, dtype=np.int32)})]))
    frames[MIN_FRAMES] = b"\xff" + frames[MIN_FRAMES][1:]
    return frames


BODY_LIMIT = 4096
MALFORMED = {
    # name: (frames, code, message fragment, reply's re, request_kind)
    "garbage-one-frame": (lambda: [b"\xffgarbage\x13"], "malformed", "got 1", "", ""),
    "one-frame-empty-kind": (lambda: [b"\x00\xffgarbage\x13"], "malformed", "empty kind", "", ""),
    "one-frame-cut-header": (lambda: [b"delete\x00\x10\x00\x00\x00\x81"], "malformed", "16-byte header", "", ""),
    "garbage-three-frames": (lambda: [b"\x93\x01\x02", b"\xc1\xc1", b"\xff" * 16], "malformed", "not ASCII", "", ""),
    "undecodable-header": (lambda: [b"delete", b"\xc1\xc1", raw_frames()[2]], "malformed", "header frame", "",
                           "delete"),
    "kind-and-header-only": (lambda: raw_frames()[:2], "malformed", "expected at least 3 frames", "raw-1", ""),
    "stray-buffer-frame": (lambda: [*raw_frames(), b"stray"], "malformed",
                           "1 buffer frames but the body describes 0", "raw-1", "delete"),
    "undecodable-body": (lambda: [*raw_frames()[:2], b"\xc1"], "malformed", "body frame", "raw-1", "delete"),
    "unknown-kind": (lambda: [b"teleport", *raw_frames()[1:]], "unknown-kind", "unknown message kind 'teleport'",
                     "raw-1", "teleport"),
    "missing-field": (lambda: [*raw_frames()[:2], msgspec.msgpack.encode({"holder": "h", "reason": "r"})],
                      "schema", "missing required field `blob_ids`", "raw-1", "delete"),
    "wrong-type": (lambda: [*raw_frames()[:2], msgspec.msgpack.encode({"blob_ids": "b1", "holder": "h",
                                                                       "reason": "r"})],
                   "schema", "Expected `array`, got `str` - at `$.blob_ids`", "raw-1", "delete"),
    "newer-major-version": (lambda: [b"delete", raw_header(v=[PROTOCOL_VERSION[0] + 1, 0]), raw_frames()[2]],
                            "version", f"protocol {PROTOCOL_VERSION[0] + 1}.0 from 'raw-client'", "raw-1", "delete"),
    "oversized-body": (lambda: raw_frames(Delete(blob_ids=[f"blob-{i:05d}" for i in range(1000)], holder="h",
                                                 reason="r")),
                       "too-large", f"limit {BODY_LIMIT}", "raw-1", "delete"),
    "checksum-mismatch": (corrupt_checksum, "checksum", "does not match its checksum", "raw-1", "blobs"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_request_gets_an_error_reply_and_the_server_keeps_serving(
    case: str, serve: Any, clients: Any, raw_dealer: Any
) -> None:
    build, code, fragment, reply_to, request_kind = MALFORMED[case]
    handlers = Counting()
    srv = serve(handlers.setup, limits=Limits(max_body_bytes=BODY_LIMIT))
    well_behaved = clients(srv.endpoint)
    assert well_behaved.request(DELETE).body.detail == "deleted b1 #1"

    reply = exchange(raw_dealer(srv.endpoint), build())
    assert reply.kind == "error"
    assert isinstance(reply.body, Error)
    assert reply.body.code == code, reply.body
    assert fragment in reply.body.message
    assert reply.body.request_kind == request_kind
    assert reply.header.re == reply_to
    assert srv.server.rejected == Counter({code: 1})

    assert well_behaved.request(DELETE).body.detail == "deleted b1 #2"
    assert handlers.calls["delete"] == 2  # the malformed request never reached the handler
    assert handlers.calls["blobs"] == 0


def test_a_burst_of_garbage_is_answered_one_by_one(serve: Any, clients: Any, raw_dealer: Any) -> None:
    handlers = Counting()
    srv = serve(handlers.setup, limits=Limits(max_body_bytes=BODY_LIMIT))
    dealer = raw_dealer(srv.endpoint)
    for build, *_ in MALFORMED.values():
        dealer.send_multipart(build())
    codes = [recv_message(dealer, REPLIES).body.code for _ in MALFORMED]
    assert codes == [code for _, code, *_ in MALFORMED.values()]
    assert clients(srv.endpoint).request(DELETE).kind == "ok"
    assert sum(srv.server.rejected.values()) == len(MALFORMED)


def test_a_kind_the_server_does_not_serve(serve: Any, clients: Any, raw_dealer: Any) -> None:
    srv = serve(Counting().setup)
    with pytest.raises(RemoteError) as info:
        clients(srv.endpoint).request(Fetch(blob_ids=["b1"], holder="t"))
    assert info.value.code == "unexpected-kind"
    assert info.value.detail == "this node does not serve 'fetch' requests"
    assert srv.server.rejected["unexpected-kind"] == 1
    # Its body is never decoded: an undecodable one gets the same answer, not a decoder's error.
    reply = exchange(raw_dealer(srv.endpoint), [b"fetch", raw_header(), b"\xc1"])
    assert (reply.body.code, reply.header.re) == ("unexpected-kind", "raw-1")
    assert srv.server.rejected["unexpected-kind"] == 2


def test_descriptor_with_an_impossible_shape_gets_an_error_reply(
    serve: Any, clients: Any, raw_dealer: Any
) -> None:
    """Regression: numpy/torch errors for an absurd zero-sized shape escaped handle_one (no reply, loop dead)."""
    srv = serve(Counting().setup, tolerate_errors=True)
    descriptor = msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(["uint8", [2**32, 2**32, 0], 0,
                                                                        checksum(b"")]))
    body = msgspec.msgpack.encode({"blobs": [{"blob_id": "b", "arrays": {"x": descriptor}}]})
    dealer = raw_dealer(srv.endpoint)
    dealer.send_multipart([b"blobs", raw_header(), body, b""])
    assert dealer.poll(1000, zmq.POLLIN), "no error reply"
    assert REPLIES.decode(recv_frames(dealer)).body.code == "array"
    assert not srv.errors
    assert clients(srv.endpoint).request(DELETE).kind == "ok"


def test_errors_about_what_a_peer_sent_quote_it_short_so_a_large_request_never_gets_a_large_reply(
    serve: Any, clients: Any, raw_dealer: Any
) -> None:
    """Regression: a 4 MiB kind frame sent without a MAC to a signed server was answered ``unknown-kind`` with
    the kind three times over (12 MiB: message and ``request_kind``), and a 4 MiB dtype name came back whole
    in an ``array`` error; both went to the log whole too."""
    secret = b"cluster-secret"
    handlers = Counting()
    srv = serve(handlers.setup, secret=secret)
    dealer = raw_dealer(srv.endpoint)
    replies = WireCodec("reply-reader", secret=secret)
    big = 4 << 20

    dealer.send_multipart([b"k" * big, raw_header(), b"\x80"])
    kind_error = recv_message(dealer, replies)
    assert (kind_error.body.code, kind_error.body.request_kind) == ("malformed", "")
    assert kind_error.body.message.startswith(f"kind frame is {big} bytes, limit 256: b'kkk")
    descriptor = msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(["A" * big, [1], 0, checksum(b"a")]))
    body = msgspec.msgpack.encode({"blobs": [{"blob_id": "b", "arrays": {"x": descriptor}}]})
    frames = [b"blobs", raw_header(id="raw-2", signed=True), body, b"a"]
    dealer.send_multipart([*frames, WireCodec("raw-client", secret=secret)._mac(frames)])
    dtype_error = recv_message(dealer, replies)
    assert (dtype_error.body.code, dtype_error.body.request_kind) == ("array", "blobs")
    assert dtype_error.body.message == f"blobs: unknown dtype '{'A' * 48}'... ({big} characters)"
    for reply in (kind_error, dtype_error):
        assert len(reply.body.message) < 200
    assert srv.server.rejected == Counter({"malformed": 1, "array": 1})
    dealer.send_multipart(WireCodec("raw-client", secret=secret).encode(DELETE, msg_id="raw-3"))
    assert recv_message(dealer, replies).body.detail == "deleted b1 #1"  # and it keeps serving


# --- the one-frame form -------------------------------------------------------------------------------


def one_frame(body: Any = DELETE, msg_id: str = "raw-1", codec: WireCodec = RAW) -> list[bytes]:
    return [bytes(f) for f in codec.encode(body, msg_id=msg_id, one_frame=True)]


def one_frame_with(header: bytes, body: bytes, kind: bytes = b"delete") -> list[bytes]:
    """A one-frame request with this header and body, whatever they hold."""
    return [b"".join((kind, b"\0", len(header).to_bytes(4, "little"), header, body))]


def test_a_client_asks_in_one_frame_and_a_server_answers_in_the_form_it_was_asked_in(
    serve: Any, clients: Any, raw_dealer: Any
) -> None:
    srv = serve(Counting().setup)
    dealer = raw_dealer(srv.endpoint)
    client = clients(srv.endpoint)
    assert client.encode(DELETE)[1] and len(client.encode(DELETE)[1]) == 1  # no arrays: one frame
    assert len(client.encode(Blobs([FetchedBlob("b", {"x": np.arange(3)})]))[1]) == 4  # arrays: multi-frame
    for frames, reply_frames in ((one_frame(msg_id="raw-1"), 1), (raw_frames(msg_id="raw-2"), 3)):
        dealer.send_multipart(frames)
        assert dealer.poll(WAIT_MS, zmq.POLLIN)
        reply = recv_frames(dealer)
        assert len(reply) == reply_frames
        assert REPLIES.decode(reply).body.detail.startswith("deleted b1")
    assert client.request(DELETE).body.detail == "deleted b1 #3"


def test_a_signed_server_answers_a_signed_one_frame_request_in_one_frame_and_its_mac(
    serve: Any, clients: Any, raw_dealer: Any
) -> None:
    secret = b"s3cret"
    srv = serve(Counting().setup, secret=secret)
    signing = WireCodec("raw-client", secret=secret)
    dealer = raw_dealer(srv.endpoint)
    dealer.send_multipart(one_frame(codec=signing))
    assert dealer.poll(WAIT_MS, zmq.POLLIN)
    reply = recv_frames(dealer)
    assert len(reply) == 2  # the frame and its MAC
    assert WireCodec("reader", secret=secret).decode(reply).body.detail == "deleted b1 #1"
    frame, mac = one_frame(codec=signing)
    dealer.send_multipart([frame[:-1] + bytes([frame[-1] ^ 1]), mac])  # the body changed after signing
    assert dealer.poll(WAIT_MS, zmq.POLLIN)
    refused = WireCodec("reader", secret=secret).decode(recv_frames(dealer))
    assert (refused.body.code, refused.header.re) == ("signature", "raw-1")


def test_a_request_of_more_frames_than_any_message_has_is_refused_unkept_and_the_server_keeps_serving(
    serve: Any, raw_dealer: Any, zmq_ctx: zmq.Context
) -> None:
    """A request of [kind, header, body] and then millions of empty frames passes every byte limit: the server
    used to build an object per frame, then check its MAC (an outsider could hold its loop for seconds and its
    memory for gigabytes). Past ``MAX_FRAMES`` its frames are read off without being kept, and it is refused
    ``malformed``, answered to the id its header names; the next request is served."""
    secret = b"s3cret"
    srv = serve(Counting().setup, secret=secret)
    signing = WireCodec("raw-client", secret=secret)
    dealer = raw_dealer(srv.endpoint)
    kind, header, body, mac = (bytes(f) for f in signing.encode(DELETE, msg_id="raw-1"))
    kept_before = FrameCounter.frames  # array frames received in this process, the server thread's included
    dealer.send_multipart([kind, header, body, *[b""] * (3 * MAX_FRAMES), mac])
    refused = recv_message(dealer, WireCodec("reader", secret=secret))
    assert isinstance(refused.body, Error)
    assert (refused.body.code, refused.header.re) == ("malformed", "raw-1")
    assert f"at most {MAX_FRAMES}" in refused.body.message
    assert FrameCounter.frames - kept_before < MAX_FRAMES  # frames past the cap were never held
    assert srv.server.rejected == Counter({"malformed": 1})
    client = Client(zmq_ctx, srv.endpoint, WireCodec("signed-client", secret=secret), policy=PATIENT)
    try:
        assert client.request(DELETE).body.detail == "deleted b1 #1"
    finally:
        client.close()


ONE_FRAME_MALFORMED = {
    # name: (frames, code, message fragment, reply's re)
    "schema": (lambda: one_frame_with(raw_header(), msgspec.msgpack.encode({"blob_ids": "b1", "holder": "h",
                                                                           "reason": "r"})),
               "schema", "Expected `array`, got `str`", "raw-1"),
    "undecodable-body": (lambda: one_frame_with(raw_header(), b"\xc1"), "malformed", "body frame", "raw-1"),
    "undecodable-header": (lambda: one_frame_with(b"\xc1\xc1", raw_frames()[2]), "malformed", "header frame", ""),
    "signed-without-mac": (lambda: one_frame_with(raw_header(signed=True), raw_frames()[2]), "malformed",
                           "followed by 0 frames (a MAC frame only expected)", "raw-1"),
    "followed-by-a-frame": (lambda: [*one_frame(), b"stray"], "malformed", "followed by 1 frames (none expected)",
                            "raw-1"),
    "newer-major-version": (lambda: one_frame_with(raw_header(v=[PROTOCOL_VERSION[0] + 1, 0]), raw_frames()[2]),
                            "version", f"protocol {PROTOCOL_VERSION[0] + 1}.0", "raw-1"),
    "unknown-kind": (lambda: one_frame_with(raw_header(), raw_frames()[2], kind=b"teleport"), "unknown-kind",
                     "unknown message kind 'teleport'", "raw-1"),
    "array-without-frame": (lambda: one_frame_with(raw_header(), msgspec.msgpack.encode(
        {"blobs": [{"blob_id": "b", "arrays": {"x": msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(
            ["uint8", [4], 0, checksum(b"abcd")]))}}]}), kind=b"blobs"), "array", "message has 0", "raw-1"),
    "header-length-past-the-end": (lambda: [b"delete\0\xff\xff\xff\x7f" + raw_header()], "malformed",
                                   "byte header", ""),
}


@pytest.mark.parametrize("case", list(ONE_FRAME_MALFORMED), ids=list(ONE_FRAME_MALFORMED))
def test_garbage_in_the_one_frame_form_gets_an_error_reply_it_can_match_and_the_server_keeps_serving(
    case: str, serve: Any, clients: Any, raw_dealer: Any
) -> None:
    build, code, fragment, reply_to = ONE_FRAME_MALFORMED[case]
    handlers = Counting()
    srv = serve(handlers.setup)
    dealer = raw_dealer(srv.endpoint)
    dealer.send_multipart(build())
    assert dealer.poll(WAIT_MS, zmq.POLLIN), "no error reply"
    frames = recv_frames(dealer)
    reply = REPLIES.decode(frames)
    assert isinstance(reply.body, Error)
    assert (reply.body.code, reply.header.re) == (code, reply_to), reply.body
    assert fragment in reply.body.message
    assert srv.server.rejected == Counter({code: 1})
    assert clients(srv.endpoint).request(DELETE).body.detail == "deleted b1 #1"
    assert handlers.calls["blobs"] == 0


# --- a server killed with SIGKILL mid-request -----------------------------------------------------------

DOOMED = """
import zmq
from refbus.bus.reqrep import Server
from refbus.bus.sockets import bound_endpoint, make_socket
from refbus.protocol.envelope import WireCodec

sock = make_socket(zmq.Context(), zmq.ROUTER, bind="tcp://127.0.0.1:0")
server = Server(sock, WireCodec("doomed"))

def hold(request):
    print("held", request.header.id, flush=True)
    return None  # never answered: the request is in the server's hands when it dies

server.on("delete", hold, cached=False)
print(bound_endpoint(sock), flush=True)
while True:
    server.handle_one()
"""


def test_a_request_to_a_server_sigkilled_mid_request_ends_with_a_timeout_by_its_deadline(clients: Any) -> None:
    # Unbuffered, so select() sees every line the child wrote.
    proc = subprocess.Popen([sys.executable, "-c", DOOMED], stdout=subprocess.PIPE, bufsize=0)
    killer = None
    try:
        endpoint = read_line(proc, WAIT_MS / 1000)
        policy = RetryPolicy(timeout_s=0.3, attempts=2, backoff=2.0)  # deadline 0.9 s

        def kill_once_held() -> None:
            ready, _, _ = select.select([proc.stdout], [], [], WAIT_MS / 1000)
            if ready and proc.stdout.readline().startswith(b"held"):  # type: ignore[union-attr]
                os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_held)
        killer.start()
        client = clients(endpoint, policy=policy)
        outcome = bounded(lambda: client.request(DELETE), policy.deadline_s)
        assert isinstance(outcome, RequestTimeout), outcome
        assert str(outcome) == f"no reply from {endpoint} to delete after 2 attempts"
        assert proc.wait(WAIT_MS / 1000) == -signal.SIGKILL  # it died holding the request
        assert client.retries == 1  # the resend after the first timeout: it waited out both attempts
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT_MS / 1000)
        if killer is not None:
            killer.join(WAIT_MS / 1000)


# --- retries and idempotency --------------------------------------------------------------------------


def test_same_frames_twice_execute_once_and_are_answered_twice(serve: Any, raw_dealer: Any) -> None:
    handlers = Counting()
    srv = serve(handlers.setup)
    dealer = raw_dealer(srv.endpoint)
    frames = raw_frames(msg_id="retry-me")
    dealer.send_multipart(frames)
    dealer.send_multipart(frames)
    first, second = recv_frames(dealer), recv_frames(dealer)
    assert [bytes(f) for f in first] == [bytes(f) for f in second]  # the cached reply, resent as is
    assert REPLIES.decode(first).body == Ok(detail="deleted b1 #1")
    assert REPLIES.decode(first).header.re == "retry-me"
    assert handlers.calls["delete"] == 1
    assert srv.server.duplicates == 1
    assert srv.server.handled["delete"] == 1


def test_reply_cache_is_bounded_in_bytes_and_evicts_oldest_first(serve: Any, raw_dealer: Any) -> None:
    """Replies are kept within ``cache_bytes``, oldest evicted first; one larger than the budget is sent
    but not kept, and its id is remembered like an evicted one's: a repeat of either is refused as a replay
    rather than run twice (a retry of the large one once ran its handler again)."""
    runs: Counter[str] = Counter()

    def padded(request: Message) -> Ok:
        size = int(request.body.reason)
        runs[request.header.id] += 1
        return Ok(detail="x" * size)

    def setup(server: Server) -> None:
        server.cache_bytes = 10_000
        server.on("delete", padded)

    srv = serve(setup)
    dealer = raw_dealer(srv.endpoint)

    def ask(msg_id: str, size: int) -> Message:
        return exchange(dealer, raw_frames(Delete(blob_ids=["b"], holder="h", reason=str(size)), msg_id=msg_id))

    for index in range(4):
        assert len(ask(f"m-{index}", 3000).body.detail) == 3000
    assert srv.server.cached_bytes <= 10_000
    assert len(ask("huge", 20_000).body.detail) == 20_000  # sent, though larger than the whole cache
    assert ask("huge", 20_000).body.code == "replay"  # not kept, and not run twice
    assert srv.server.cached_bytes <= 10_000
    ask("m-3", 3000)  # the newest entry: answered from the cache
    assert ask("m-0", 3000).body.code == "replay"  # the oldest: evicted, and not run twice
    assert runs == Counter({"m-0": 1, "m-1": 1, "m-2": 1, "m-3": 1, "huge": 1})
    assert srv.server.duplicates == 1
    assert srv.server.rejected["replay"] == 2


def test_a_replayed_request_is_refused_and_counted_while_retries_get_the_cached_reply(
    serve: Any, raw_dealer: Any
) -> None:
    handlers = Counting()

    def setup(server: Server) -> None:
        handlers.setup(server)
        server.cache_size = 2

    srv = serve(setup)
    dealer = raw_dealer(srv.endpoint)
    first = raw_frames(msg_id="0a1b2c-1")
    assert exchange(dealer, first).body == Ok(detail="deleted b1 #1")
    assert exchange(dealer, first).body == Ok(detail="deleted b1 #1")  # a retry: the cached reply
    for counter in (2, 3):
        assert exchange(dealer, raw_frames(msg_id=f"0a1b2c-{counter}")).kind == "ok"
    replayed = exchange(dealer, first)  # its reply is evicted now: the same frames are a replay
    assert isinstance(replayed.body, Error) and replayed.body.code == "replay"
    assert "'0a1b2c-1'" in replayed.body.message and replayed.header.re == "0a1b2c-1"
    assert handlers.calls["delete"] == 3
    assert (srv.server.duplicates, srv.server.rejected["replay"]) == (1, 1)


def test_requests_below_an_incarnations_forgotten_ids_are_replays(serve: Any, raw_dealer: Any) -> None:
    """Past ``seen_size`` ids, what is remembered per sender incarnation is the highest forgotten counter."""
    handlers = Counting()

    def setup(server: Server) -> None:
        handlers.setup(server)
        server.cache_size = 1
        server.seen_size = 2

    srv = serve(setup)
    dealer = raw_dealer(srv.endpoint)
    for counter in range(1, 6):
        assert exchange(dealer, raw_frames(msg_id=f"feed-{counter:x}")).kind == "ok"
    for counter in (1, 3):  # forgotten ids, under the floor of incarnation "feed"
        assert exchange(dealer, raw_frames(msg_id=f"feed-{counter:x}")).body.code == "replay"
    assert exchange(dealer, raw_frames(msg_id="beef-1")).kind == "ok"  # another incarnation: its own counters
    assert handlers.calls["delete"] == 6
    assert srv.server.rejected["replay"] == 2


@pytest.mark.parametrize("msg_id", ["-", "abc-", "-12", "a-zz", "a-" + "f" * 40, "a-b-c", "x-+1", "m-\u00e9"])
def test_garbage_message_ids_are_served_once_and_refused_when_replayed(
    serve: Any, raw_dealer: Any, msg_id: str
) -> None:
    handlers = Counting()

    def setup(server: Server) -> None:
        handlers.setup(server)
        server.cache_size = 1

    srv = serve(setup)
    dealer = raw_dealer(srv.endpoint)
    assert exchange(dealer, raw_frames(msg_id=msg_id)).kind == "ok"
    assert exchange(dealer, raw_frames(msg_id="other-1")).kind == "ok"
    assert exchange(dealer, raw_frames(msg_id=msg_id)).body.code == "replay"
    assert handlers.calls["delete"] == 2 and srv.errors == []


def test_idempotency_is_per_source_and_message_id(serve: Any, raw_dealer: Any) -> None:
    handlers = Counting()
    srv = serve(handlers.setup)
    dealer = raw_dealer(srv.endpoint)
    other_source = WireCodec("another-client")
    for frames in (raw_frames(msg_id="m-1"), raw_frames(msg_id="m-2"), other_source.encode(DELETE, msg_id="m-1")):
        assert exchange(dealer, frames).kind == "ok"
    assert handlers.calls["delete"] == 3
    assert srv.server.duplicates == 0


def test_client_retry_after_a_slow_reply_executes_once(serve: Any, clients: Any) -> None:
    """The first reply comes after the client's timeout: the retry (same id) is answered from the cache."""
    retry_seen: list[int] = []
    handlers = Counting()

    def setup(server: Server) -> None:
        def slow_delete(request: Message) -> Ok:
            if not handlers.calls:
                retry_seen.append(server.sock.poll(WAIT_MS, zmq.POLLIN))  # hold the reply until the retry is in
            return handlers.delete(request)

        server.on("delete", slow_delete)

    srv = serve(setup)
    strays: list[Message] = []
    client = clients(srv.endpoint, policy=RetryPolicy(timeout_s=0.2, attempts=4), on_stray=strays.append)
    reply = client.request(DELETE)
    assert reply.body == Ok(detail="deleted b1 #1")
    assert retry_seen == [zmq.POLLIN]
    assert client.retries == 1
    if not strays:
        late = client.recv(WAIT_MS)
        assert late is not None
        strays.append(late)
    assert [(m.header.re, m.body) for m in strays] == [(reply.header.re, reply.body)]
    assert handlers.calls["delete"] == 1
    assert srv.server.duplicates == 1
    # The late duplicate does not confuse the next request.
    assert client.request(DELETE).body == Ok(detail="deleted b1 #2")


def test_uncached_routes_execute_again(serve: Any, raw_dealer: Any) -> None:
    reads: list[str] = []

    def fetch(request: Message) -> Blobs:
        reads.append(request.header.id)
        return Blobs([FetchedBlob("b1", {"x": np.full(3, len(reads), dtype=np.int64)})])

    srv = serve(lambda server: server.on("fetch", fetch, cached=False))
    dealer = raw_dealer(srv.endpoint)
    frames = raw_frames(Fetch(blob_ids=["b1"], holder="t"), msg_id="read-1")
    first, second = exchange(dealer, frames), exchange(dealer, frames)
    assert reads == ["read-1", "read-1"]
    assert first.body.blobs[0].arrays["x"].tolist() == [1, 1, 1]
    assert second.body.blobs[0].arrays["x"].tolist() == [2, 2, 2]
    assert srv.server.duplicates == 0


def test_handler_errors_are_cached_like_replies(serve: Any, raw_dealer: Any) -> None:
    attempts: list[str] = []

    def refuse(request: Message) -> Ok:
        attempts.append(request.header.id)
        raise HandlerError("not-owner", "blob b1 is held by trainer-1")

    srv = serve(lambda server: server.on("delete", refuse))
    dealer = raw_dealer(srv.endpoint)
    frames = raw_frames(msg_id="del-1")
    replies = [exchange(dealer, frames), exchange(dealer, frames)]
    assert [r.body.code for r in replies] == ["not-owner", "not-owner"]
    assert attempts == ["del-1"]
    assert srv.server.rejected == Counter({"not-owner": 1})


def test_an_error_that_asks_for_a_retry_is_not_cached_so_the_same_request_runs_again(serve: Any,
                                                                                      raw_dealer: Any) -> None:
    """A handler that changed nothing and answers ``retry_after_s`` (a store whose journal could not record the
    change) is asked again by the same request, under the same id: it runs again, and its answer this time is
    cached as any other. Before, the error was cached and every retry of that id got it for good."""
    attempts: list[str] = []

    def full_then_room(request: Message) -> Ok:
        attempts.append(request.header.id)
        if len(attempts) == 1:
            raise HandlerError("journal-failed", "no room for the record", retry_after_s=0.25)
        return Ok()

    srv = serve(lambda server: server.on("delete", full_then_room))
    dealer = raw_dealer(srv.endpoint)
    frames = raw_frames(msg_id="del-1")
    replies = [exchange(dealer, frames) for _ in range(3)]
    assert [r.body.kind for r in replies] == ["error", "ok", "ok"]
    assert replies[0].body.retry_after_s == 0.25 and attempts == ["del-1", "del-1"]


# --- handler failures ---------------------------------------------------------------------------------


def test_handler_error_becomes_a_remote_error_with_its_code(serve: Any, clients: Any) -> None:
    def fetch(request: Message) -> Blobs:
        raise HandlerError("unknown-blob", f"no blob {request.body.blob_ids[0]!r}")

    srv = serve(lambda server: server.on("fetch", fetch))
    client = clients(srv.endpoint)
    with pytest.raises(RemoteError) as info:
        client.request(Fetch(blob_ids=["gone"], holder="t"))
    err = info.value
    assert (err.code, err.detail, err.endpoint) == ("unknown-blob", "no blob 'gone'", srv.endpoint)
    assert str(err) == f"{srv.endpoint} rejected fetch: [unknown-blob] no blob 'gone'"
    assert srv.server.rejected == Counter({"unknown-blob": 1})
    assert srv.server.handled["fetch"] == 0


def test_unexpected_exception_is_internal_and_the_server_survives(serve: Any, clients: Any) -> None:
    handlers = Counting()

    def setup(server: Server) -> None:
        handlers.setup(server)
        server.on("fetch", lambda request: 1 // 0)
        server.on("ok", lambda request: (_ for _ in ()).throw(SchemaError("holder unknown", kind="ok")))

    srv = serve(setup)
    client = clients(srv.endpoint)
    with pytest.raises(RemoteError) as info:
        client.request(Fetch(blob_ids=["b1"], holder="t"))
    assert info.value.code == "internal"
    assert info.value.detail == "ZeroDivisionError: integer division or modulo by zero"
    with pytest.raises(RemoteError) as info:
        client.request(Ok())
    assert info.value.code == "schema"
    assert "holder unknown" in info.value.detail
    assert client.request(DELETE).kind == "ok"
    assert srv.server.rejected == Counter({"internal": 1, "schema": 1})


def test_reply_that_cannot_be_encoded_is_an_internal_error(serve: Any, clients: Any) -> None:
    srv = serve(lambda server: server.on("fetch", lambda request: Blobs([FetchedBlob("b", {
        "x": np.array(["not numeric"], dtype=object)})])), tolerate_errors=True)
    with pytest.raises(RemoteError) as info:
        clients(srv.endpoint, policy=RetryPolicy(timeout_s=0.3, attempts=1)).request(Fetch(blob_ids=["b"], holder="t"))
    assert info.value.code == "internal"
    assert not srv.errors


# --- timeouts -----------------------------------------------------------------------------------------


def test_request_timeout_retries_the_same_frames(sockets: Any, clients: Any) -> None:
    silent = sockets(zmq.ROUTER, bind=LOOPBACK)  # bound, never answers
    endpoint = bound_endpoint(silent)
    client = clients(endpoint, policy=RetryPolicy(timeout_s=0.05, attempts=3, backoff=2.0))
    with pytest.raises(RequestTimeout, match=f"no reply from {endpoint} to delete after 3 attempts"):
        client.request(DELETE)
    assert client.retries == 2  # each resend came after the previous attempt's timeout
    copies = []
    for _ in range(3):
        assert silent.poll(WAIT_MS, zmq.POLLIN)
        copies.append(tuple(bytes(f) for f in recv_frames(silent)[1:]))
    assert len(set(copies)) == 1  # a retry resends the same frames: same message id
    assert silent.poll(0, zmq.POLLIN) == 0


def test_signals_during_the_wait_do_not_hold_a_request_past_its_deadline(sockets: Any, clients: Any) -> None:
    """A thread that handles a signal every 20 ms (a timer, a profiler) still gets its timeout on time: the
    wait is a poll, which pyzmq resumes with the time left (a receive under RCVTIMEO restarts whole)."""
    silent = sockets(zmq.ROUTER, bind=LOOPBACK)
    client = clients(bound_endpoint(silent), policy=RetryPolicy(timeout_s=0.3, attempts=1))
    handled = []
    stop = threading.Event()
    waiter = threading.main_thread().ident
    assert threading.get_ident() == waiter  # handlers run on the main thread, whose wait they interrupt

    overran = threading.Event()

    def interrupt() -> None:
        # Only to stop a hang: a wait restarted by every signal would never end, so the signals stop once it has
        # run OVERRUN deadlines (then such a wait ends, and the test fails on ``overran``).
        for _ in range(int(OVERRUN * 0.3 / 0.02)):
            if stop.wait(0.02):
                return
            signal.pthread_kill(waiter, signal.SIGUSR1)
        overran.set()

    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.append(1))
    sender = threading.Thread(target=interrupt)
    sender.start()
    try:
        with pytest.raises(RequestTimeout):
            client.request(DELETE)
    finally:
        stop.set()
        sender.join(WAIT_MS / 1000)
        signal.signal(signal.SIGUSR1, previous)
    assert not overran.is_set(), f"the wait outlasted {OVERRUN} deadlines: signals restarted it"
    assert len(handled) >= 3  # the wait went on through interruption after interruption (about 15)


def test_request_timeout_when_nothing_listens(sockets: Any, clients: Any) -> None:
    probe = sockets(zmq.ROUTER, bind=LOOPBACK)
    endpoint = bound_endpoint(probe)
    probe.close()
    with pytest.raises(RequestTimeout):
        clients(endpoint, policy=RetryPolicy(timeout_s=0.05, attempts=2)).request(DELETE)


def test_a_full_send_queue_never_blocks_a_request_which_ends_at_its_deadline(
    zmq_ctx: zmq.Context, silent_endpoint: str
) -> None:
    """A DEALER queues requests to an endpoint it cannot reach up to its high-water mark, then refuses them: a
    send returns at once (counted), and a request or a gather ends in a timeout at its policy's deadline."""
    endpoint = silent_endpoint  # nobody answers
    hwm = 10
    client = Client(zmq_ctx, endpoint, WireCodec("queued"), options=SocketOptions(sndhwm=hwm))
    try:
        for _ in range(hwm + 5):
            client.send(DELETE)
        assert client.unsent == 5
        policy = RetryPolicy(timeout_s=0.1, attempts=2, backoff=2.0)  # deadline 0.3 s
        full = rf"after 2 attempts \(2 not sent: the send queue to {re.escape(endpoint)} was full\)"
        outcome = bounded(lambda: client.request(DELETE, policy=policy), policy.deadline_s)
        assert isinstance(outcome, RequestTimeout) and re.search(full, str(outcome)), outcome
        assert (client.unsent, client.retries) == (7, 1)
        outcomes = bounded(lambda: gather([(client, DELETE)] * 3, policy=policy), policy.deadline_s)
        assert all(isinstance(o, RequestTimeout) and re.search(full, str(o)) for o in outcomes), outcomes
        assert client.unsent == 13
    finally:
        client.close()


def test_retry_policy_timeouts() -> None:
    policy = RetryPolicy(timeout_s=1.0, attempts=5, backoff=3.0, max_timeout_s=10.0)
    assert list(policy.timeouts()) == [1.0, 3.0, 9.0, 10.0, 10.0]
    assert list(RetryPolicy(attempts=1).timeouts()) == [2.0]
    # Lasting: attempts added, at the last timeout or longer, until the sends cover the longer deadline.
    assert list(policy.lasting(60.0).timeouts()) == [1.0, 3.0, 9.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    assert policy.lasting(1.0) == policy and sum(policy.lasting(60.0).timeouts()[:-1]) < 60.0


@pytest.mark.parametrize("bad", [dict(backoff=0.0), dict(backoff=1e-9), dict(max_timeout_s=1e-6),
                                 dict(timeout_s=1e-4), dict(backoff=float("nan")),
                                 dict(attempts=MAX_ATTEMPTS + 1, backoff=1.0)])
def test_a_retry_policy_that_would_not_wait_for_a_reply_is_refused(bad: dict[str, float]) -> None:
    """Before, a backoff of 0 made a zero last timeout (``lasting`` then divided by it) and 1e-9 one so short
    that ``lasting`` built a schedule of about 1e19 attempts."""
    with pytest.raises(ValueError, match="retry policy"):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_a_lasting_policy_is_bounded_however_long_its_deadline() -> None:
    short = RetryPolicy(timeout_s=MIN_TIMEOUT_S, attempts=1)
    assert len(short.lasting(365 * 24 * 3600.0).timeouts()) == MAX_ATTEMPTS


def test_an_invalid_reply_does_not_cut_the_wait_short(zmq_ctx: zmq.Context, clients: Any) -> None:
    """A garbage reply, then the real one later: the client skips the garbage and keeps waiting."""
    router = zmq_ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:*")
    endpoint = bound_endpoint(router)
    done = threading.Event()

    def fake_server() -> None:  # owns ``router`` from here on
        codec = WireCodec("fake")
        try:
            if not router.poll(WAIT_MS, zmq.POLLIN):
                return
            identity, *frames = router.recv_multipart()
            request = codec.decode(frames)
            router.send_multipart([identity, b"garbage"])
            done.wait(0.3)  # a slow server, on purpose
            router.send_multipart([identity, *codec.encode(Ok(detail="late"), reply_to=request.header.id)])
        finally:
            router.close()

    thread = threading.Thread(target=fake_server)
    thread.start()
    try:
        client = clients(endpoint, policy=RetryPolicy(timeout_s=3.0, attempts=1))
        assert client.request(DELETE).body == Ok(detail="late")  # the garbage before it did not end the wait
        assert client.retries == 0
    finally:
        done.set()
        thread.join(WAIT_MS / 1000)
    assert not thread.is_alive()


# --- deferred replies ---------------------------------------------------------------------------------


def test_deferred_reply_is_answered_later(serve: Any, clients: Any) -> None:
    parked: list[Pending] = []
    parked_one = threading.Event()

    def setup(server: Server) -> None:
        def wait_for_it(request: Message) -> None:
            parked.append(server.pending)
            parked_one.set()
            return None

        def release(request: Message) -> Ok:
            for pending in parked:
                server.answer(pending, Ok(detail=f"released by {request.header.src}"))
            return Ok(detail=f"released {len(parked)}")

        server.on("fetch", wait_for_it)
        server.on("delete", release)

    srv = serve(setup)
    waiter, releaser = clients(srv.endpoint, src="waiter"), clients(srv.endpoint, src="releaser")
    msg_id = waiter.send(Fetch(blob_ids=["b1"], holder="t"))
    assert parked_one.wait(WAIT_MS / 1000)
    assert waiter.recv(50) is None  # deferred: no reply yet
    assert releaser.request(DELETE).body == Ok(detail="released 1")
    late = waiter.recv(WAIT_MS)
    assert late is not None
    assert late.header.re == msg_id
    assert late.body == Ok(detail="released by releaser")
    assert parked[0].reply_to == msg_id and parked[0].identity
    assert srv.server.handled["fetch"] == 1


def test_deferred_requests_are_not_cached(serve: Any, raw_dealer: Any) -> None:
    """A retry of a deferred request re-runs its handler (which defers again); both get answered."""
    parked: list[Pending] = []

    def setup(server: Server) -> None:
        def release(request: Message) -> Ok:
            for i, pending in enumerate(parked):
                server.answer(pending, Ok(detail=str(i)))
            return Ok(detail="done")

        server.on("fetch", lambda request: parked.append(server.pending))
        server.on("delete", release)

    srv = serve(setup)
    dealer = raw_dealer(srv.endpoint)
    frames = raw_frames(Fetch(blob_ids=["b1"], holder="t"), msg_id="deferred-1")
    dealer.send_multipart(frames)
    dealer.send_multipart(frames)
    dealer.send_multipart(raw_frames(msg_id="release"))
    replies = [recv_message(dealer, REPLIES) for _ in range(3)]
    assert [(r.header.re, r.body.detail) for r in replies] == [
        ("deferred-1", "0"), ("deferred-1", "1"), ("release", "done")
    ]
    assert len(parked) == 2
    assert srv.server.duplicates == 0


# --- gather -------------------------------------------------------------------------------------------


def test_gather_returns_outcomes_in_order(serve: Any, clients: Any, sockets: Any) -> None:
    handlers = Counting()

    def setup(server: Server) -> None:
        handlers.setup(server)
        server.on("fetch", lambda request: (_ for _ in ()).throw(HandlerError("unknown-blob", "nope")))

    srv = serve(setup)
    first, second = clients(srv.endpoint), clients(srv.endpoint)
    silent = sockets(zmq.ROUTER, bind=LOOPBACK)
    nobody = clients(bound_endpoint(silent), policy=RetryPolicy(timeout_s=0.05, attempts=2))
    outcomes = gather(
        [(first, DELETE), (second, Fetch(blob_ids=["x"], holder="t")), (nobody, DELETE), (first, DELETE)]
        + [(second, Delete(blob_ids=[f"b{i}"], holder="o", reason="r")) for i in range(20)],
        window=4,
    )
    assert isinstance(outcomes[0], Message) and outcomes[0].kind == "ok"
    assert isinstance(outcomes[1], RemoteError) and outcomes[1].code == "unknown-blob"
    assert isinstance(outcomes[2], RequestTimeout)
    assert isinstance(outcomes[3], Message)
    assert [o.body.detail.split()[1] for o in outcomes[4:]] == [f"b{i}" for i in range(20)]
    assert handlers.calls["delete"] == 22
    assert nobody.retries == 1


def test_gather_deadline_outlasts_the_attempts_and_cuts_them_short(clients: Any, sockets: Any) -> None:
    once = RetryPolicy(timeout_s=0.05, attempts=1)
    # Outlasts: a request sent once whose attempt has timed out still takes the reply that comes before its
    # deadline. Its attempt has timed out once another one's, sent after it with the same timeout, has.
    server = sockets(zmq.ROUTER, bind=LOOPBACK)
    endpoint = bound_endpoint(server)
    waiting, reference = clients(endpoint), clients(endpoint)
    deadline_s = 30.0  # far past the attempt: only a stall of the test thread that long could reach it
    waited = []
    waiter = threading.Thread(target=lambda: waited.extend(gather([(waiting, DELETE)], policy=once,
                                                                  deadline_s=deadline_s)), daemon=True)
    waiter.start()
    try:
        first = recv_frames(server) if server.poll(WAIT_MS, zmq.POLLIN) else None
        assert first is not None, "the waiting request never arrived"
        (timed_out,) = gather([(reference, DELETE)], policy=once)
        assert isinstance(timed_out, RequestTimeout)
        request = REPLIES.decode(first[1:])
        server.send_multipart([first[0], *REPLIES.encode(Ok(detail="after the attempt"), reply_to=request.header.id)])
    finally:
        waiter.join(deadline_s)  # answered above, or ended by its deadline
    assert not waiter.is_alive(), "the waiting gather outlived its deadline"
    assert isinstance(waited[0], Message) and waited[0].body == Ok(detail="after the attempt"), waited
    assert waiting.retries == 0  # one send: the wait after it ran past the attempt's timeout

    silent = sockets(zmq.ROUTER, bind=LOOPBACK)
    client = clients(bound_endpoint(silent))
    sent_once = gather([(client, DELETE)], policy=once, deadline_s=0.3)
    assert isinstance(sent_once[0], RequestTimeout)
    cut = gather([(client, DELETE)], policy=RetryPolicy(timeout_s=0.05, attempts=50, backoff=1.0), deadline_s=0.12)
    assert isinstance(cut[0], RequestTimeout)
    ids = Counter()
    while silent.poll(0, zmq.POLLIN):
        ids[REPLIES.decode(recv_frames(silent)[1:]).header.id] += 1
    assert sorted(ids.values())[0] == 1  # the first call: sent once
    assert 1 <= sorted(ids.values())[1] <= 3  # the second: no attempt after 0.12 s of 50 ms timeouts


def test_gather_hands_replies_to_on_reply_as_they_arrive_and_keeps_only_their_headers(
    serve: Any, clients: Any, sockets: Any
) -> None:
    def echo(request: Message) -> Blobs:
        return Blobs([FetchedBlob(request.body.holder, {"x": np.full(4, len(request.body.holder), np.uint8)})])

    srv = serve(lambda server: server.on("fetch", echo))
    client = clients(srv.endpoint)
    dead = clients(bound_endpoint(sockets(zmq.ROUTER, bind=LOOPBACK)), policy=RetryPolicy(timeout_s=0.05, attempts=1))
    seen: dict[int, list[int]] = {}
    outcomes = gather([(client, Fetch(blob_ids=["b"], holder="h" * n)) for n in (1, 2, 3)] + [(dead, DELETE)],
                      window=2, on_reply=lambda index, reply: seen.setdefault(
                          index, reply.body.blobs[0].arrays["x"].tolist()))
    assert seen == {0: [1] * 4, 1: [2] * 4, 2: [3] * 4}
    assert [o.body for o in outcomes[:3]] == [Ok()] * 3 and all(not o.buffers for o in outcomes[:3])
    assert isinstance(outcomes[3], RequestTimeout)  # failures are returned as before, never handed over


def test_a_pipeline_sends_each_request_as_it_is_added_and_waits_only_while_a_window_is_full(
    serve: Any, clients: Any
) -> None:
    seen: list[str] = []

    def delete(request: Message) -> Ok:
        seen.append(request.body.blob_ids[0])
        return Ok()

    srv = serve(lambda server: server.on("delete", delete))
    client = clients(srv.endpoint)
    stream = Pipeline(window=2)
    for i in range(7):
        stream.add(client, Delete(blob_ids=[f"b{i}"], holder="o", reason="r"))
        assert len(stream.in_flight) <= 2 and stream.waiting(client) <= 1
        stream.wait(until=lambda: not stream.waiting(client))  # at most the window in flight, nothing queued
        assert stream.waiting(client) == 0
    stream.wait()
    assert not stream.in_flight and all(o is not None and o.kind == "ok" for o in stream.outcomes)
    assert seen == [f"b{i}" for i in range(7)]  # one connection: served in the order added


def test_gather_keeps_no_reply_alive_once_the_caller_drops_it(serve: Any, clients: Any) -> None:
    """Replies hold received frames (MiBs each): they must be freed when the caller drops them, not whenever the
    garbage collector next runs, or every step's frames land in fresh memory that page-faults."""
    blobs = Blobs([FetchedBlob("b", {"x": np.ones(8, np.uint8)})])
    srv = serve(lambda server: server.on("fetch", lambda request: blobs))
    client = clients(srv.endpoint)
    gc.disable()
    try:
        outcomes = gather([(client, Fetch(blob_ids=["b"], holder="h"))] * 3, window=2)
        arrays = [weakref.ref(o.body.blobs[0].arrays["x"]) for o in outcomes]
        del outcomes
        assert [a() for a in arrays] == [None] * 3, "a reply outlived its last reference (a reference cycle)"
    finally:
        gc.enable()


def test_a_route_without_verify_takes_frames_whose_checksum_does_not_match(serve: Any, raw_dealer: Any) -> None:
    received: list[list[int]] = []

    def blobs(request: Message) -> Ok:
        received.append(request.body.blobs[0].arrays["x"].view(np.uint8).tolist())
        return Ok()

    checked = serve(lambda server: server.on("blobs", blobs))
    unchecked = serve(lambda server: server.on("blobs", blobs, verify=False))
    assert exchange(raw_dealer(checked.endpoint), corrupt_checksum()).body.code == "checksum"
    assert exchange(raw_dealer(unchecked.endpoint), corrupt_checksum()).body == Ok()
    assert received == [[0xFF, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]]  # arange(4) int32, first byte overwritten
    unhashed = Blobs([FetchedBlob("b", {"x": Unhashed(np.arange(4, dtype=np.uint8))})])
    sender = WireCodec("unhashed-sender")
    assert exchange(raw_dealer(checked.endpoint), sender.encode(unhashed)).body.code == "checksum"  # refused
    assert exchange(raw_dealer(unchecked.endpoint), sender.encode(unhashed)).body == Ok()
    assert received[-1] == [0, 1, 2, 3]


TORCH_TAGGED_CALLS = """
import json, sys
import msgspec, zmq
from refbus.bus.reqrep import Client, Server
from refbus.bus.sockets import bound_endpoint, make_socket
from refbus.protocol.codec import EXT_TORCH, checksum
from refbus.protocol.envelope import PROTOCOL_VERSION, WireCodec
from refbus.protocol.messages import Fetch, Ok

tagged = msgspec.msgpack.Ext(EXT_TORCH, msgspec.msgpack.encode(["uint8", [1], 0, checksum(b"\\0")]))

def frames(kind, body, **header):  # a message whose one array its sender tagged torch
    head = {"v": list(PROTOCOL_VERSION), "id": "evil-1", "src": "evil", "seq": 0, "ts": 0.0, **header}
    return [kind, msgspec.msgpack.encode(head), msgspec.msgpack.encode(body), b"\\0"]

seen = {}
ctx = zmq.Context()
server = Server(make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0"), WireCodec("env-0"))
def keep(request):
    seen["request"] = type(request.body.branches[0]["x"]).__module__
    return Ok()
server.on("keep", keep)
dealer = make_socket(ctx, zmq.DEALER, connect=bound_endpoint(server.sock))
dealer.send_multipart(frames(b"keep", {"episode_id": "e", "branches": [{"x": tagged}]}))
server.sock.poll(10_000)
server.handle_one()
assert dealer.poll(10_000)

peer = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
client = Client(ctx, bound_endpoint(peer), WireCodec("orchestrator"))
msg_id = client.send(Fetch(blob_ids=["b"], holder="orchestrator"))
assert peer.poll(10_000)
received = peer.recv_multipart()
reply = frames(b"blobs", {"blobs": [{"blob_id": "b", "arrays": {"x": tagged}}]}, re=msg_id)
peer.send_multipart([received[0], *reply])
seen["reply"] = type(client.recv(10_000).body.blobs[0].arrays["x"]).__module__
seen["torch"] = "torch" in sys.modules
print(json.dumps(seen), flush=True)
"""


def test_a_request_or_reply_whose_array_is_tagged_torch_never_makes_a_node_import_torch() -> None:
    """A server and a client decode arrays as numpy unless their role asks otherwise: any peer could make the
    orchestrator (or an env server, or the broker) import torch with one array tagged ext code 2. In a fresh
    interpreter (this one has torch loaded): the request's and the reply's arrays are numpy, torch never
    imported."""
    child = subprocess.run([sys.executable, "-c", TORCH_TAGGED_CALLS], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == {"request": "numpy", "reply": "numpy", "torch": False}
