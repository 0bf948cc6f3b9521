"""Asynchronous requests (``runtime.calls``) over real loopback sockets: the caller is a real
:class:`NodeRuntime` whose loop the test drives on its own thread; the peers are raw ROUTERs the test answers
by hand (so every interleaving is chosen, not hoped for), a :class:`Server` thread, or a server process
killed with SIGKILL.

Covers each outcome (reply, remote error, timeout at the deadline, peer down), retries with the same id,
cancel, late and malformed replies (counted, resolving nothing), exactly-once delivery under mixed
interleavings, the loop's poll bounded by the earliest deadline, ``gather``'s window per endpoint and its
one ordered list of outcomes, ``lookup_async`` (joined while in flight, None at its deadline), and shutdown
with calls pending.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from polling import read_line
from refbus.bus import calls as calls_module
from refbus.bus import peers as peers_module
from refbus.bus.peers import Peers
from refbus.bus.reqrep import (
    SEND_ONCE,
    Client,
    HandlerError,
    Outcome,
    PeerDown,
    RemoteError,
    RequestTimeout,
    RetryPolicy,
    split_outcomes,
)
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import RECONNECT_IVL_MAX_MS, bound_endpoint, recv_frames, send_frames
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    Blobs,
    Bye,
    Delete,
    Error,
    FetchedBlob,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Ok,
)

pytest_plugins = ["wire_fixtures"]

LOOPBACK = "tcp://127.0.0.1:0"
WAIT_S = 5.0  # upper bound for anything that should arrive promptly on loopback
PEER = WireCodec("peer")
DELETE = Delete(blob_ids=["b1"], holder="caller", reason="trained")
BLOBS = Blobs([FetchedBlob("b1", {"x": np.ones(8, np.uint8)})])
FAST = RetryPolicy(timeout_s=0.05, attempts=3, backoff=1.0)  # resends every 50 ms, three sends in all
OVERRUN = 10  # deadlines a call may overrun before its test calls it hung (only to stop hangs, never a timing)


def make_caller(*, ticker: bool = True) -> NodeRuntime:
    """A started, unregistered runtime. ``ticker`` adds a 10 ms timer so every loop turn is short (the
    test's predicates poll peers between turns); without it only the runtime's own deadlines wake it."""
    runtime = NodeRuntime("caller", RuntimeSettings(node_id="caller", metrics_port=-1, heartbeat_interval_s=3600.0),
                          register=False)
    if ticker:
        runtime.every(0.01, lambda: None)
    runtime.start()
    return runtime


@pytest.fixture
def caller() -> Iterator[NodeRuntime]:
    runtime = make_caller()
    yield runtime
    runtime.close()


def pump(runtime: NodeRuntime, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Run the caller's loop on this thread until ``predicate()`` holds; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    runtime.loop(until=lambda: bool(predicate()) or time.monotonic() > deadline)
    value = predicate()
    assert value, f"timed out after {timeout}s waiting for {what}"
    return value


class Recorder:
    """``on_done`` callbacks that record every outcome by key (so a second delivery shows)."""

    def __init__(self) -> None:
        self.outcomes: dict[Any, list[Outcome]] = {}
        self.order: list[Any] = []  # the keys in the order their outcomes came

    def __call__(self, key: Any) -> Callable[[Outcome], None]:
        self.outcomes.setdefault(key, [])

        def record(outcome: Outcome) -> None:
            self.outcomes[key].append(outcome)
            self.order.append(key)

        return record

    def one(self, key: Any) -> Outcome:
        got = self.outcomes[key]
        assert len(got) == 1, f"{key}: {len(got)} outcomes {got!r}"
        return got[0]

    def resolved(self, *keys: Any) -> bool:
        return all(self.outcomes[k] for k in keys)


class Peer:
    """A raw ROUTER the test answers by hand."""

    def __init__(self, sockets: Any) -> None:
        self.sock = sockets(zmq.ROUTER, bind=LOOPBACK)
        self.endpoint = bound_endpoint(self.sock)
        self.received: list[tuple[bytes, Message]] = []

    def poll(self) -> int:
        """Take whatever has arrived; how many requests arrived so far."""
        while self.sock.poll(0, zmq.POLLIN):
            frames = recv_frames(self.sock)
            self.received.append((bytes(frames[0]), PEER.decode(frames[1:])))
        return len(self.received)

    def ids(self) -> list[str]:
        return [m.header.id for _, m in self.received]

    def answer(self, msg_id: str, body: Any = None) -> None:
        identity = next(i for i, m in self.received if m.header.id == msg_id)
        send_frames(self.sock, [identity, *PEER.encode(body or Ok(detail=msg_id), reply_to=msg_id)])

    def send_raw(self, msg_id: str, frames: list[bytes]) -> None:
        identity = next(i for i, m in self.received if m.header.id == msg_id)
        self.sock.send_multipart([identity, *frames])


@pytest.fixture
def peers(sockets: Any) -> Callable[[], Peer]:
    return lambda: Peer(sockets)


def one_turn(runtime: NodeRuntime) -> None:
    turns = iter((False, True))
    runtime.loop(until=lambda: next(turns))


def wait_received(runtime: NodeRuntime, peer: Peer, count: int) -> None:
    pump(runtime, lambda: peer.poll() >= count, f"{count} requests at {peer.endpoint}")


# --- each outcome -------------------------------------------------------------------------------------


def test_reply_and_remote_error_from_a_server(caller: NodeRuntime, serve: Any) -> None:
    def delete(request: Message) -> Ok:
        if request.body.blob_ids == ["missing"]:
            raise HandlerError("unknown-blob", "no blob 'missing'")
        return Ok(detail="deleted")

    srv = serve(lambda server: server.on("delete", delete))
    done = Recorder()
    ok_id = caller.calls.request(srv.endpoint, DELETE, done("ok"))
    caller.calls.request(srv.endpoint, Delete(blob_ids=["missing"], holder="caller", reason="r"), done("err"))
    assert caller.calls.in_flight(srv.endpoint) == 2 and caller.calls.in_flight() == 2
    pump(caller, lambda: done.resolved("ok", "err"), "both outcomes")
    reply = done.one("ok")
    assert isinstance(reply, Message) and reply.body == Ok(detail="deleted") and reply.header.re == ok_id
    error = done.one("err")
    assert isinstance(error, RemoteError) and error.code == "unknown-blob" and error.endpoint == srv.endpoint
    assert caller.calls.in_flight() == 0 and caller.calls.in_flight(srv.endpoint) == 0
    assert caller.calls.outcomes == Counter({"reply": 1, "remote-error": 1})
    replies, failures = split_outcomes((key, got[0]) for key, got in sorted(done.outcomes.items()))
    assert replies == [("ok", reply)] and failures == [("err", error)]


def test_retries_resend_the_same_id_then_the_reply_resolves(caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("call"), policy=FAST, deadline_s=60.0)
    wait_received(caller, peer, 2)
    assert set(peer.ids()) == {msg_id}, "a retry must resend the same message id"
    peer.answer(msg_id, Ok(detail="second"))
    pump(caller, lambda: done.resolved("call"), "the reply")
    assert done.one("call").body == Ok(detail="second")
    retries = caller.calls.client(peer.endpoint).retries
    assert retries >= 1
    peer.answer(msg_id, Ok(detail="again"))  # the answer to a resend, after the outcome
    pump(caller, lambda: caller.calls.late == 1, "the late duplicate to be counted")
    assert len(done.outcomes["call"]) == 1


def test_an_error_saying_retry_after_is_sent_again_after_it_within_the_deadline_when_asked(
        caller: NodeRuntime, peers: Any) -> None:
    """A call made with ``retry_after`` answered an error with ``retry_after_s`` > 0 (its server changed nothing)
    is sent again, the same id, that long after, even when its policy had no attempt left, and ends with the
    reply to that; one whose deadline comes first, or made without ``retry_after``, ends with the error."""
    peer = peers()
    done = Recorder()
    later = Error("journal-failed", "no room for now", "delete", retry_after_s=0.05)
    again = caller.calls.request(peer.endpoint, DELETE, done("again"), policy=SEND_ONCE, deadline_s=60.0,
                                 retry_after=True)
    plain = caller.calls.request(peer.endpoint, DELETE, done("plain"), policy=SEND_ONCE, deadline_s=60.0)
    short = caller.calls.request(peer.endpoint, DELETE, done("short"), policy=SEND_ONCE, deadline_s=WAIT_S,
                                 retry_after=True)
    wait_received(caller, peer, 3)
    for msg_id in (again, plain):
        peer.answer(msg_id, later)
    peer.answer(short, Error("journal-failed", "no room for now", "delete", retry_after_s=2 * WAIT_S))
    pump(caller, lambda: done.resolved("plain", "short"), "the errors given up")
    assert [error.code for error in (done.one("plain"), done.one("short"))] == ["journal-failed"] * 2
    wait_received(caller, peer, 4)
    assert peer.ids()[3] == again and not done.outcomes["again"]
    peer.answer(again, Ok(detail="room again"))
    pump(caller, lambda: done.resolved("again"), "the reply to the request sent again")
    assert done.one("again").body == Ok(detail="room again")
    assert caller.calls.in_flight() == 0


def test_timeout_comes_at_the_deadline_after_every_attempt(caller: NodeRuntime, peers: Any) -> None:
    """Each call ends at its own deadline, shown by the order of the outcomes (calls are due in deadline order,
    however late the loop turns), and a call whose every attempt has timed out still takes a reply that comes
    before its deadline."""
    peer = peers()
    done = Recorder()
    # default's 150 ms end first; once, issued after patient, ends before it only if its 0.3 s deadline cuts the
    # 2 s attempt both have short.
    default = caller.calls.request(peer.endpoint, DELETE, done("default"), policy=FAST)  # deadline: 3 x 50 ms
    patient = caller.calls.request(peer.endpoint, DELETE, done("patient"), policy=SEND_ONCE)  # its 2 s attempt
    once = caller.calls.request(peer.endpoint, DELETE, done("once"), policy=SEND_ONCE, deadline_s=0.3)
    retried = caller.calls.request(peer.endpoint, DELETE, done("retried"), policy=FAST, deadline_s=600.0)
    pump(caller, lambda: done.resolved("once", "patient", "default"), "three timeouts",
         timeout=WAIT_S + SEND_ONCE.deadline_s)
    for key in ("once", "patient", "default"):
        assert isinstance(done.one(key), RequestTimeout), done.one(key)
    assert done.order == ["default", "once", "patient"]

    # retried made its three attempts, and the last one has timed out once a call sent after it with the same
    # 50 ms has: retried still waits for its deadline, and a reply now resolves it.
    pump(caller, lambda: peer.poll() and Counter(peer.ids())[retried] == 3, "retried's three attempts")
    reference = caller.calls.request(peer.endpoint, DELETE, done("reference"),
                                     policy=RetryPolicy(timeout_s=FAST.timeout_s, attempts=1))
    pump(caller, lambda: done.resolved("reference"), "the reference call's timeout")
    assert isinstance(done.one("reference"), RequestTimeout) and not done.outcomes["retried"]
    peer.answer(retried, Ok(detail="after every attempt"))
    pump(caller, lambda: done.resolved("retried"), "the reply after every attempt timed out")
    assert done.one("retried").body == Ok(detail="after every attempt")
    peer.poll()
    assert Counter(peer.ids()) == Counter({once: 1, patient: 1, retried: 3, default: 3, reference: 1})
    assert caller.calls.outcomes == Counter({"timeout": 4, "reply": 1})
    assert caller.calls.in_flight() == 0


def test_the_loop_wakes_for_a_deadline_without_any_other_reason(peers: Any) -> None:
    runtime = make_caller(ticker=False)  # the only timer is an hourly heartbeat
    try:
        peer = peers()
        done = Recorder()
        deadline_s = 0.2
        runtime.calls.request(peer.endpoint, DELETE, done("call"), policy=SEND_ONCE, deadline_s=deadline_s)
        # Only to stop a hang: a poll blocked for the heartbeat's hour is ended after OVERRUN deadlines.
        overrun = threading.Timer(OVERRUN * deadline_s, runtime.stop)
        overrun.start()
        try:
            runtime.loop(until=lambda: done.resolved("call"))
        finally:
            overrun.cancel()
            overrun.join()
        assert done.resolved("call"), "the loop slept past the call's deadline (waiting for the hourly heartbeat)"
        assert isinstance(done.one("call"), RequestTimeout)
    finally:
        runtime.close()


def test_peer_down_resolves_each_call_to_that_peer_once(caller: NodeRuntime, peers: Any) -> None:
    down, up = peers(), peers()
    done = Recorder()
    ids = [caller.calls.request(down.endpoint, DELETE, done(i), deadline_s=60.0) for i in range(3)]
    other = caller.calls.request(up.endpoint, DELETE, done("other"), deadline_s=60.0)
    wait_received(caller, down, 3)
    assert caller.calls.peer_down(down.endpoint, "node-down: timeout") == 3
    assert caller.calls.peer_down(down.endpoint, "again") == 0
    for i in range(3):
        outcome = done.one(i)
        assert isinstance(outcome, PeerDown) and outcome.peer == down.endpoint and "timeout" in outcome.reason
    assert caller.calls.in_flight(down.endpoint) == 0 and caller.calls.in_flight() == 1
    for msg_id in ids:  # the peer was only slow: its answers now come late
        down.answer(msg_id)
    pump(caller, lambda: caller.calls.late == 3, "three late replies")
    assert all(len(done.outcomes[i]) == 1 for i in range(3))
    wait_received(caller, up, 1)
    up.answer(other)
    pump(caller, lambda: done.resolved("other"), "the other peer's reply")
    assert isinstance(done.one("other"), Message)


@pytest.mark.parametrize("endpoint", ["tcp://host-without-port", "garbage", "", "ipc://" + "x" * 200])
def test_a_request_to_an_endpoint_zeromq_refuses_ends_peer_down_and_the_caller_goes_on(
        caller: NodeRuntime, peers: Any, endpoint: str) -> None:
    """A peer's garbage address (an event's reference, a registry entry): before, making its client raised out of
    request(), so the caller's call never got an outcome (an orchestrator's claim stayed pending and every later
    episode queued behind it). Now the call ends PeerDown on the next tick, never inside request(), and can be
    cancelled until then."""
    peer = peers()
    done = Recorder()
    msg_id = caller.calls.request(endpoint, DELETE, done("bad"), deadline_s=60.0)
    cancelled = caller.calls.request(endpoint, DELETE, done("cancelled"), deadline_s=60.0)
    assert done.outcomes["bad"] == [] and msg_id != cancelled
    assert caller.calls.cancel(cancelled) is True and caller.calls.cancel(cancelled) is False
    good = caller.calls.request(peer.endpoint, DELETE, done("good"), deadline_s=60.0)
    pump(caller, lambda: done.resolved("bad"), "the bad endpoint's outcome")
    outcome = done.one("bad")
    assert isinstance(outcome, PeerDown) and outcome.peer == endpoint
    assert "not an endpoint this node can connect to" in outcome.reason
    wait_received(caller, peer, 1)
    peer.answer(good)
    pump(caller, lambda: done.resolved("good"), "the good peer's reply")
    assert isinstance(done.one("good"), Message) and done.outcomes["cancelled"] == []
    assert caller.calls.outcomes["peer-down"] == 1 and caller.calls.in_flight() == 0


def test_a_request_sent_under_an_earlier_calls_id_is_answered_from_the_servers_reply_cache(
        caller: NodeRuntime, serve: Any, peers: Any) -> None:
    """``msg_id``: a request sent again under the id of a call that has ended (here answered; a call its peer
    was reported down before answering is repeated the same way) is that request again: the server answers it
    from its reply cache and its handler ran once; without it, a new request runs again. The id of a call still
    pending is refused (its own retries resend it), and a request refused for a down endpoint keeps the id."""
    ran: list[str] = []

    def delete(request: Message) -> Ok:
        ran.append(request.header.id)
        return Ok(detail=f"run {len(ran)}")

    srv = serve(lambda server: server.on("delete", delete))
    done = Recorder()
    first = caller.calls.request(srv.endpoint, DELETE, done("first"))
    pump(caller, lambda: done.resolved("first"), "the first reply")
    assert caller.calls.request(srv.endpoint, DELETE, done("again"), msg_id=first) == first
    caller.calls.request(srv.endpoint, DELETE, done("new"))
    pump(caller, lambda: done.resolved("again", "new"), "both replies")
    assert [done.one(key).body for key in ("first", "again", "new")] == [Ok(detail="run 1")] * 2 + [
        Ok(detail="run 2")]
    assert len(ran) == 2 and ran[0] == first
    silent = peers()
    pending = caller.calls.request(silent.endpoint, DELETE, done("pending"), deadline_s=60.0)
    with pytest.raises(ValueError, match="still pending"):
        caller.calls.request(silent.endpoint, DELETE, done("twice"), msg_id=pending)
    assert caller.calls.cancel(pending)
    caller.calls.mark_down(silent.endpoint, "node-down: timeout")
    assert caller.calls.request(silent.endpoint, DELETE, done("down"), msg_id=pending) == pending
    pump(caller, lambda: done.resolved("down"), "the refusal")
    assert isinstance(done.one("down"), PeerDown)


def test_cancel_forgets_a_call_and_its_reply_is_late(caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("cancelled"), policy=SEND_ONCE, deadline_s=0.2)
    kept = caller.calls.request(peer.endpoint, DELETE, done("kept"), deadline_s=60.0)
    assert caller.calls.cancel(msg_id) is True
    assert caller.calls.cancel(msg_id) is False
    assert caller.calls.in_flight(peer.endpoint) == 1
    wait_received(caller, peer, 2)
    peer.answer(msg_id)
    peer.answer(kept)
    pump(caller, lambda: done.resolved("kept") and caller.calls.late == 1, "the kept reply and the late one")
    time_past_deadline = time.monotonic() + 0.25
    pump(caller, lambda: time.monotonic() > time_past_deadline, "the cancelled call's deadline to pass")
    assert done.outcomes["cancelled"] == []


def test_late_reply_after_a_timeout_is_dropped_and_counted(caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("call"), policy=SEND_ONCE, deadline_s=0.1)
    pump(caller, lambda: done.resolved("call"), "the timeout")
    peer.poll()
    peer.answer(msg_id)
    pump(caller, lambda: caller.calls.late == 1, "the late reply")
    assert isinstance(done.one("call"), RequestTimeout)


# --- garbage ------------------------------------------------------------------------------------------


def test_malformed_replies_are_counted_and_resolve_nothing(caller: NodeRuntime, peers: Any) -> None:
    peer, impostor = peers(), peers()
    done = Recorder()
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("call"), deadline_s=60.0)
    caller.calls.request(impostor.endpoint, DELETE, done("impostor"), deadline_s=60.0)
    wait_received(caller, peer, 1)
    wait_received(caller, impostor, 1)
    good = [bytes(f) for f in PEER.encode(Ok(detail="real"), reply_to=msg_id)]
    garbage = {
        "one-frame": [b"\x00\xffgarbage"],
        "not-ascii-kind": [b"\xff\xfe", good[1], good[2]],
        "bad-header": [good[0], b"\xc1\xc1", good[2]],
        "bad-body": [good[0], good[1], b"\xc1"],
        "unknown-kind": [b"teleport", good[1], good[2]],
        "stray-buffer": [*good, b"extra"],
    }
    for frames in garbage.values():
        peer.send_raw(msg_id, frames)
    # A well-formed reply carrying this call's id, from another peer, is not its answer.
    impostor.send_raw(impostor.ids()[0], good)
    pump(caller, lambda: sum(caller.calls.rejected.values()) == len(garbage) and caller.calls.late == 1,
         "every malformed reply rejected and the impostor's counted late")
    assert set(caller.calls.rejected) <= {"malformed", "unknown-kind"}
    assert done.outcomes["call"] == [] and caller.calls.in_flight(peer.endpoint) == 1
    peer.answer(msg_id, Ok(detail="real"))
    pump(caller, lambda: done.resolved("call"), "the real reply")
    assert done.one("call").body == Ok(detail="real")
    assert done.outcomes["impostor"] == []


# --- exactly once -------------------------------------------------------------------------------------


ACTIONS = ("reply", "reply-twice", "error", "garbage-then-reply", "cancel", "timeout", "peer-down", "done-cancels")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_outcome_is_delivered_exactly_once_whatever_the_interleaving(
    caller: NodeRuntime, peers: Any, seed: int
) -> None:
    rng = random.Random(seed)
    endpoints = [peers() for _ in range(3)]
    downed = endpoints[2]
    counts: Counter[str] = Counter()
    calls: dict[str, tuple[Peer, str]] = {}
    cancelled: set[str] = set()

    def on_done(box: list[str]) -> Callable[[Outcome], None]:
        def done(outcome: Outcome) -> None:
            msg_id = box[0]
            counts[msg_id] += 1
            action = calls[msg_id][1]
            # Re-entrancy: an outcome handler that cancels another call and starts a new one.
            if action == "done-cancels":
                victim = next((m for m, (_, a) in calls.items() if a == "timeout" and m not in cancelled
                               and counts[m] == 0), None)
                if victim is not None and caller.calls.cancel(victim):
                    cancelled.add(victim)
        return done

    for _ in range(40):
        action = rng.choice(ACTIONS)
        peer = downed if action == "peer-down" else rng.choice(endpoints[:2])  # the downed peer answers nothing
        deadline = 0.3 if action == "timeout" else 60.0
        box: list[str] = []  # the id, known once the request is sent
        box.append(caller.calls.request(peer.endpoint, DELETE, on_done(box), policy=FAST, deadline_s=deadline))
        calls[box[0]] = (peer, action)
    for peer in endpoints:
        mine = {m for m, (p, _) in calls.items() if p is peer}
        pump(caller, lambda p=peer, ids=mine: (p.poll(), ids <= set(p.ids()))[1], f"every request at {peer.endpoint}")
    order = list(calls)
    rng.shuffle(order)
    for msg_id in order:
        peer, action = calls[msg_id]
        if action in ("reply", "done-cancels"):
            peer.answer(msg_id)
        elif action == "reply-twice":
            peer.answer(msg_id)
            peer.answer(msg_id)
        elif action == "error":
            peer.answer(msg_id, Error(code="nope", message="refused", request_kind="delete"))
        elif action == "garbage-then-reply":
            peer.send_raw(msg_id, [b"\x00garbage"])
            peer.answer(msg_id)
        elif action == "cancel" and caller.calls.cancel(msg_id):
            cancelled.add(msg_id)
        if rng.random() < 0.3:
            one_turn(caller)  # let some outcomes land between the peer's answers
    caller.calls.peer_down(downed.endpoint, "killed")
    pump(caller, lambda: caller.calls.in_flight() == 0, "every call resolved", timeout=WAIT_S + 0.3)
    for msg_id, (peer, _) in calls.items():  # every call is answered once more, after its outcome
        peer.answer(msg_id)
    late = len(calls) + sum(action == "reply-twice" for _, action in calls.values())
    pump(caller, lambda: caller.calls.late >= late, "every answer after an outcome counted late")
    assert caller.calls.late == late
    for msg_id, (_, action) in calls.items():
        expected = 0 if msg_id in cancelled else 1
        assert counts[msg_id] == expected, (msg_id, action, counts[msg_id])
    assert sum(caller.calls.outcomes.values()) == len(calls) - len(cancelled)


# --- a server killed with SIGKILL ---------------------------------------------------------------------

CHILD = """
import sys, zmq
from refbus.bus.reqrep import Server
from refbus.bus.sockets import bound_endpoint, make_socket
from refbus.protocol.envelope import WireCodec

sock = make_socket(zmq.Context(), zmq.ROUTER, bind="tcp://127.0.0.1:0")
server = Server(sock, WireCodec("doomed"))

def hold(request):
    print("held", request.header.id, flush=True)
    return None  # never answered: the caller's calls stay pending until the process dies

server.on("delete", hold, cached=False)
print(bound_endpoint(sock), flush=True)
while True:
    server.handle_one()
"""


def test_calls_to_a_server_killed_with_sigkill_resolve_by_their_deadline(caller: NodeRuntime, serve: Any) -> None:
    # Unbuffered, so select() sees every line the child wrote (a buffered reader would hold some back).
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, bufsize=0)
    try:
        endpoint = read_line(proc, WAIT_S)
        done = Recorder()
        short = [caller.calls.request(endpoint, DELETE, done(("short", i)), policy=SEND_ONCE, deadline_s=0.5)
                 for i in range(3)]
        long = [caller.calls.request(endpoint, DELETE, done(("long", i)), policy=SEND_ONCE, deadline_s=600.0)
                for i in range(2)]
        held = {read_line(proc, WAIT_S).split()[1] for _ in range(5)}
        assert held == set(short + long)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(WAIT_S) == -signal.SIGKILL
        pump(caller, lambda: done.resolved(*[("short", i) for i in range(3)]), "the short deadlines",
             timeout=10 * 0.5)
        assert all(isinstance(done.one(("short", i)), RequestTimeout) for i in range(3))
        assert caller.calls.in_flight(endpoint) == 2
        # The registry would report the node down: the long calls end then, not in ten minutes.
        assert caller.calls.peer_down(endpoint, "node-down: killed") == 2
        assert all(isinstance(done.one(("long", i)), PeerDown) for i in range(2))
        # The caller is unharmed: a live server still answers.
        srv = serve(lambda server: server.on("delete", lambda _: Ok()))
        caller.calls.request(srv.endpoint, DELETE, done("live"))
        pump(caller, lambda: done.resolved("live"), "a live server's reply")
        assert isinstance(done.one("live"), Message)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()


# --- a peer that is gone: full send queues -------------------------------------------------------------

HWM = 20  # a small send high-water mark: the queue to a peer that is gone is full after HWM requests


def small_queues(runtime: NodeRuntime) -> NodeRuntime:
    """The clients ``runtime`` makes from now on queue at most HWM requests to a peer."""
    runtime.options = dataclasses.replace(runtime.options, sndhwm=HWM)
    return runtime


def test_requests_to_a_peer_that_is_gone_never_block_the_loop_and_end_at_their_deadlines(
    caller: NodeRuntime, silent_endpoint: str
) -> None:
    """A DEALER keeps its queue to a peer it cannot reach and refuses sends once the queue is full: each refused
    attempt is one without a reply, and the call still ends at its deadline, with the loop turning meanwhile."""
    endpoint = silent_endpoint  # nobody answers: requests to it queue, up to HWM
    small_queues(caller)
    turns = Counter()
    caller.every(0.01, lambda: turns.update(["turn"]))
    ended: dict[int, Outcome] = {}
    deadline_s = 0.5
    for i in range(HWM + 50):  # a send that waited on the full queue would wait for ever: the test would hang
        caller.calls.request(endpoint, DELETE, lambda outcome, i=i: ended.setdefault(i, outcome), policy=FAST,
                             deadline_s=deadline_s)
    client = caller.calls.client(endpoint)
    assert client.unsent == 50  # the first attempts past the high-water mark, refused at once
    assert not ended  # outcomes come from the loop's turns: none ended while they were issued
    pump(caller, lambda: len(ended) == HWM + 50, "every call to end", timeout=OVERRUN * deadline_s)
    assert turns["turn"] >= 10  # the loop kept turning (every 10 ms) while the calls were pending
    for outcome in ended.values():
        assert isinstance(outcome, RequestTimeout), outcome
    for i in range(HWM, HWM + 50):  # never sent at all: every attempt found the queue full
        assert f"not sent: the send queue to {endpoint} was full" in str(ended[i]), ended[i]
    assert caller.calls.outcomes == Counter({"timeout": HWM + 50}) and caller.calls.in_flight() == 0
    assert client.retries > 0 and client.unsent == 50 + client.retries  # nothing drains the queue: no resend went


SERVING = """
import sys, zmq
from refbus.bus.reqrep import Server
from refbus.bus.sockets import bound_endpoint, make_socket
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Ok

sock = make_socket(zmq.Context(), zmq.ROUTER, bind=sys.argv[1])
server = Server(sock, WireCodec("serving"))
server.on("delete", lambda request: Ok(detail="served"), cached=False)
print(bound_endpoint(sock), flush=True)
while True:
    server.handle_one()
"""


def test_a_peer_sigkilled_while_requests_flow_leaves_the_loop_running_and_is_reached_again_once_back() -> None:
    """Requests flow to a server process that is SIGKILLed: those sent after its death fill the queue to it and
    end at their deadlines while the caller's loop keeps issuing; a server back on the same endpoint answers."""
    caller = small_queues(make_caller())
    children: list[subprocess.Popen] = []

    def serve_in_child(endpoint: str) -> str:
        proc = subprocess.Popen([sys.executable, "-c", SERVING, endpoint], stdout=subprocess.PIPE, bufsize=0)
        children.append(proc)
        return read_line(proc, WAIT_S)

    try:
        endpoint = serve_in_child(LOOPBACK)
        deadline_s = 0.3
        ended: dict[int, Outcome] = {}
        issued: list[float] = []
        flowing = [True]

        def issue() -> None:  # a request every loop turn (5 ms), as a role's timers would
            if flowing[0]:
                i = len(issued)
                issued.append(time.monotonic())
                caller.calls.request(endpoint, DELETE, lambda outcome: ended.setdefault(i, outcome), policy=SEND_ONCE,
                                     deadline_s=deadline_s)

        caller.every(0.005, issue)
        pump(caller, lambda: sum(isinstance(o, Message) for o in ended.values()) >= 5, "replies from the server")
        os.kill(children[0].pid, signal.SIGKILL)
        assert children[0].wait(WAIT_S) == -signal.SIGKILL
        killed = len(issued)
        client = caller.calls.client(endpoint)
        pump(caller, lambda: client.unsent >= HWM and len(issued) >= killed + 3 * HWM,
             "the loop to go on issuing requests past a full queue")
        flowing[0] = False
        after = range(killed, len(issued))
        pump(caller, lambda: all(i in ended for i in after), "every request sent after the kill to end",
             timeout=10 * deadline_s)
        assert all(isinstance(ended[i], RequestTimeout) for i in after), [ended[i] for i in after]
        assert any("send queue" in str(ended[i]) for i in after)
        # Back on the same endpoint: the refused sends of a call are tried again at its next attempts.
        assert serve_in_child(endpoint) == endpoint
        done = Recorder()
        every_100_ms = RetryPolicy(timeout_s=0.1, attempts=int(WAIT_S / 0.1), backoff=1.0)
        caller.calls.request(endpoint, DELETE, done("back"), policy=every_100_ms)
        pump(caller, lambda: done.resolved("back"), "the reply of the server that came back", timeout=2 * WAIT_S)
        assert isinstance(done.one("back"), Message) and done.one("back").body == Ok(detail="served")
    finally:
        caller.close()
        for proc in children:
            if proc.poll() is None:
                proc.kill()
            proc.wait(WAIT_S)
            assert proc.stdout is not None
            proc.stdout.close()


# --- shutdown -----------------------------------------------------------------------------------------


def test_gather_keeps_a_window_per_endpoint_and_hands_over_every_outcome_once_in_order(
    caller: NodeRuntime, peers: Any
) -> None:
    slow, fast = peers(), peers()
    got: list[list[Outcome]] = []
    requests = [(slow.endpoint, Delete(blob_ids=[f"s{i}"], holder="caller", reason="trained")) for i in range(3)]
    requests.insert(1, (fast.endpoint, DELETE))
    caller.calls.gather(requests, got.append, window=2, policy=SEND_ONCE, deadline_s=60.0)
    wait_received(caller, fast, 1)
    wait_received(caller, slow, 2)
    one_turn(caller)
    assert slow.poll() == 2, "a third request to one endpoint went out with a window of two"
    fast.answer(fast.ids()[0])
    slow.answer(slow.ids()[0])
    wait_received(caller, slow, 3)  # one ended: the queued one goes out
    slow.answer(slow.ids()[1], Error("unknown-blob", "gone"))
    assert not got, "outcomes handed over before the last request ended"
    slow.answer(slow.ids()[2])
    pump(caller, lambda: got, "the gathered outcomes")
    assert len(got) == 1
    (outcomes,) = got  # in the order asked: slow 0, fast, slow 1 (refused), slow 2
    assert [type(o) for o in outcomes] == [Message, Message, RemoteError, Message], outcomes
    assert [o.body.detail for o in outcomes if isinstance(o, Message)] == [slow.ids()[0], fast.ids()[0],
                                                                          slow.ids()[2]]
    assert outcomes[2].code == "unknown-blob"
    empty: list[list[Outcome]] = []
    caller.calls.gather([], empty.append)
    assert not empty, "on_done ran inside gather()"
    pump(caller, lambda: empty, "the empty gather's outcome")
    assert empty == [[]]


def test_gathered_outcomes_die_with_the_callers_last_reference(caller: NodeRuntime, peers: Any) -> None:
    """Replies hold received frames (MiBs each in a fetch): nothing of gather may keep them alive in a reference
    cycle, or every step's frames wait for the garbage collector and land in fresh, page-faulting memory."""
    peer = peers()
    got: list[list[Outcome]] = []
    gc.disable()
    try:
        caller.calls.gather([(peer.endpoint, DELETE)] * 3, got.append, window=2, policy=SEND_ONCE, deadline_s=60.0)
        for count in (2, 3):
            wait_received(caller, peer, count)
            peer.answer(peer.ids()[count - 2], BLOBS)
        peer.answer(peer.ids()[2], BLOBS)
        pump(caller, lambda: got, "the gathered outcomes")
        replies = [weakref.ref(o.body.blobs[0].arrays["x"]) for o in got.pop()]
        assert [r() for r in replies] == [None] * 3, "a reply outlived its last reference (a reference cycle)"
    finally:
        gc.enable()


def test_lookup_async_joins_a_lookup_in_flight_and_answers_none_at_its_deadline(peers: Any) -> None:
    broker = peers()  # stands in for the broker: the test answers registry requests by hand
    runtime = NodeRuntime("caller", RuntimeSettings(bus=broker.endpoint, node_id="caller", metrics_port=-1,
                                                    heartbeat_interval_s=3600.0, retry=FAST), register=False)
    runtime.every(0.01, lambda: None)
    runtime.start()
    try:
        answers: list[tuple[str, Any]] = []
        runtime.lookup_async("rollout", lambda nodes: answers.append(("first", nodes)))
        runtime.lookup_async("rollout", lambda nodes: answers.append(("second", nodes)))
        wait_received(runtime, broker, 1)
        one_turn(runtime)
        assert broker.poll() == 1 and answers == [], "a lookup in flight is joined, not sent again"
        (_, asked), = broker.received
        assert asked.body == Nodes(role="rollout")
        broker.answer(asked.header.id, NodeList(nodes=[]))
        pump(runtime, lambda: len(answers) == 2, "both callers answered")
        assert answers == [("first", []), ("second", [])]
        # Unanswered: None once the deadline passes (a retry resends the same id), never an exception.
        runtime.lookup_async("rollout", lambda nodes: answers.append(("unanswered", nodes)), deadline_s=0.2)
        pump(runtime, lambda: len(answers) == 3, "the unanswered lookup to end", timeout=WAIT_S + 0.2)
        assert answers[2] == ("unanswered", None)
        broker.poll()
        assert len(broker.ids()) > 2 and len(set(broker.ids()[1:])) == 1
    finally:
        runtime.close()


def test_close_drops_pending_calls_without_an_outcome(peers: Any) -> None:
    runtime = make_caller()
    peer = peers()
    done = Recorder()
    runtime.calls.request(peer.endpoint, DELETE, done("call"), deadline_s=60.0)
    wait_received(runtime, peer, 1)
    runtime.close()
    assert runtime.calls.in_flight() == 0 and runtime.calls.wait_s() is None
    assert done.outcomes["call"] == []


def test_a_calls_client_serves_blocking_requests_too(caller: NodeRuntime, peers: Any, serve: Any) -> None:
    """A blocking request on the same socket hands replies of pending calls back to their outcomes."""
    peer = peers()
    done = Recorder()
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("async"), deadline_s=60.0)
    wait_received(caller, peer, 1)
    peer.answer(msg_id, Ok(detail="async"))
    client = caller.calls.client(peer.endpoint)
    assert client is caller.calls.client(peer.endpoint)
    blocking = RetryPolicy(timeout_s=0.2, attempts=1)
    with pytest.raises(RequestTimeout):  # the raw peer never answers the blocking request itself
        client.request(DELETE, policy=blocking)
    assert done.one("async").body == Ok(detail="async")


def test_a_node_the_broker_forgot_learns_it_from_a_heartbeat_and_joins_again(bus: Any) -> None:
    """Heartbeats are calls: the broker's ``unknown-node`` answer to one makes the node register again."""
    _, control = bus
    runtime = NodeRuntime("rejoiner", RuntimeSettings(bus=control, node_id="rejoiner", metrics_port=-1))
    runtime.every(0.01, lambda: None)
    runtime.start()
    other = Client(runtime.ctx, control, WireCodec("other"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    try:

        def registered() -> bool:
            listed = other.request(Nodes(role="rejoiner")).body
            assert isinstance(listed, NodeList)
            return any(node.node_id == "rejoiner" for node in listed.nodes)

        assert registered()
        other.request(Bye(node_id="rejoiner"))  # the broker forgets the node; the node does not know yet
        assert not registered()
        interval = runtime.welcome.heartbeat_interval if runtime.welcome else 1.0
        pump(runtime, lambda: runtime.calls.outcomes["remote-error"] >= 1, "a heartbeat refused",
             timeout=10 * interval)
        pump(runtime, registered, "the node registered again", timeout=10 * interval)
    finally:
        other.close()  # before the runtime terms the context they share
        runtime.close()


# --- forgetting the client of an endpoint that is gone ------------------------------------------------


def test_forget_closes_the_client_and_drops_what_is_kept_and_a_later_request_makes_a_new_one(
        caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    first = caller.calls.request(peer.endpoint, DELETE, done("first"), policy=FAST, deadline_s=60.0)
    wait_received(caller, peer, 2)  # resent once at least: the client has counted a retry
    peer.answer(first)
    pump(caller, lambda: done.resolved("first"), "the first reply")
    client = caller.calls.client(peer.endpoint)
    retries = caller._client_total("retries")
    assert client.retries >= 1 and client.sock in caller._callbacks and client in caller._clients

    assert caller.calls.forget(peer.endpoint) is True
    assert client.sock.closed and client.on_stray is None
    assert peer.endpoint not in caller.calls._clients and peer.endpoint not in caller.calls._per_endpoint
    assert client.sock not in caller._callbacks and client not in caller._clients
    assert caller._client_total("retries") == retries  # a counter: what the closed client counted stays
    assert caller.calls.forget(peer.endpoint) is False  # already forgotten: nothing to do
    one_turn(caller)  # the loop polls on without the closed socket

    again = caller.calls.request(peer.endpoint, DELETE, done("again"), deadline_s=60.0)
    wait_received(caller, peer, 3)
    peer.answer(again, Ok(detail="new client"))
    pump(caller, lambda: done.resolved("again"), "the reply through a new client")
    assert done.one("again").body == Ok(detail="new client")
    assert caller.calls.client(peer.endpoint) is not client


def test_forget_with_calls_pending_closes_the_client_once_the_last_one_ended(caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    ids = [caller.calls.request(peer.endpoint, DELETE, done(i), deadline_s=60.0) for i in range(2)]
    wait_received(caller, peer, 2)
    client = caller.calls.client(peer.endpoint)
    assert caller.calls.forget(peer.endpoint) is False  # deferred: two calls are pending
    peer.answer(ids[0])
    pump(caller, lambda: done.resolved(0), "the first reply")
    one_turn(caller)
    assert not client.sock.closed and caller.calls.in_flight(peer.endpoint) == 1
    caller.calls.request(peer.endpoint, DELETE, done("late"), policy=SEND_ONCE, deadline_s=0.2)
    peer.answer(ids[1])
    pump(caller, lambda: done.resolved(1), "the second reply")
    one_turn(caller)
    assert not client.sock.closed  # a request made meanwhile keeps it until that one ends too
    pump(caller, lambda: done.resolved("late") and client.sock.closed, "the last call's end, then the close")
    assert isinstance(done.one(1), Message) and isinstance(done.one("late"), RequestTimeout)
    assert peer.endpoint not in caller.calls._clients and caller.calls.in_flight() == 0
    assert caller.calls.wait_s() is None  # nothing left to do: the loop may sleep


def test_a_forgotten_endpoint_still_marked_down_fails_at_once_without_a_new_socket(
        caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    done = Recorder()
    caller.calls.client(peer.endpoint)
    caller.calls.mark_down(peer.endpoint, "node-down: timeout")
    assert caller.calls.forget(peer.endpoint) is True
    msg_id = caller.calls.request(peer.endpoint, DELETE, done("refused"), deadline_s=60.0)
    assert caller.calls.in_flight(peer.endpoint) == 1 and peer.endpoint not in caller.calls._clients
    pump(caller, lambda: done.resolved("refused"), "the refusal")
    refused = done.one("refused")
    assert isinstance(refused, PeerDown) and "timeout" in refused.reason
    assert caller.calls.cancel(msg_id) is False and peer.endpoint not in caller.calls._clients
    caller.calls.mark_up(peer.endpoint)  # back (the same address): a new client, answered
    back = caller.calls.request(peer.endpoint, DELETE, done("back"), deadline_s=60.0)
    wait_received(caller, peer, 1)
    peer.answer(back)
    pump(caller, lambda: done.resolved("back"), "the reply once back")
    assert isinstance(done.one("back"), Message)


def test_forgetting_unknown_or_held_endpoints_changes_nothing(caller: NodeRuntime, peers: Any) -> None:
    peer = peers()
    for garbage in ("", "not an endpoint", "tcp://127.0.0.1:1", peer.endpoint):
        assert caller.calls.forget(garbage) is False
    assert caller.calls._clients == {} and caller.calls._forgetting == set()
    held = caller.calls.client(peer.endpoint, held=True)  # the broker's control client is held so
    assert caller.calls.forget(peer.endpoint) is False and not held.sock.closed
    assert caller.calls.client(peer.endpoint) is held


def test_peers_forget_the_endpoints_a_restarted_peer_left_and_keep_a_bounded_number_of_down_marks(
        caller: NodeRuntime, peers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers_module, "RETIRED_DOWN_MARKS", 2)
    view = Peers(caller.calls, "caller")
    calls = caller.calls

    def event(body: Any) -> Message:
        return PEER.decode(PEER.encode(body))

    def up(node_id: str, pid: int, **endpoints: str) -> None:
        view.handle(event(NodeUp(NodeInfo(node_id=node_id, role="env-server", host="h", pid=pid, endpoints=endpoints))))

    def down(node_id: str) -> None:
        view.handle(event(NodeDown(node_id=node_id, role="env-server", reason="replaced", last_seen=0.0)))

    old = [peers().endpoint for _ in range(4)]
    up("env-0", 1, blobs=old[0])
    first = calls.client(old[0])
    down("env-0")
    assert first.sock.closed and old[0] not in calls._clients  # no pending call: closed at once
    assert calls.down_reason(old[0]) is not None  # still refused at once, without a socket
    for pid, endpoint in enumerate(old[1:], start=2):  # restarts, each on a new port
        up("env-0", pid, blobs=endpoint)
        calls.client(endpoint)
        down("env-0")
    up("env-0", 9, blobs="tcp://127.0.0.1:9")
    assert set(calls._clients) == set()
    # The marks of the two latest endpoints left behind are kept; older ones dropped (the bound).
    assert [calls.down_reason(endpoint) is not None for endpoint in old] == [False, False, True, True]
    assert calls.down_reason("tcp://127.0.0.1:9") is None
    # A peer restarted without a node-down between (it died while the broker was down, and the restarted broker
    # never knew it): the earlier process is reported down first, so its pending call ends with PeerDown at once
    # (not at its deadline) and its client is forgotten; an endpoint another live peer advertises is left alone.
    # The same process re-joining is no restart.
    shared = peers().endpoint
    up("env-1", 1, blobs=old[3], shared=shared)
    up("env-2", 1, shared=shared)
    done = Recorder()
    calls.request(old[3], DELETE, done("pending"), policy=SEND_ONCE, deadline_s=60.0)
    kept = calls.client(shared)
    up("env-1", 2, blobs="tcp://127.0.0.1:10")
    ended = done.one("pending")
    assert isinstance(ended, PeerDown) and ended.reason == "env-1 reported down (replaced)", ended
    assert old[3] not in calls._clients and calls.down_reason(old[3]) is not None
    assert calls.client(shared) is kept and not kept.sock.closed  # marked down with env-1, as by any node-down
    up("env-2", 1, shared=shared)  # env-2 re-joins the restarted broker too: its endpoint is up again
    up("env-1", 2, blobs="tcp://127.0.0.1:10")
    assert "env-1" in view.live and "env-1" not in view.down and calls.down_reason("tcp://127.0.0.1:10") is None
    # Garbage: empty or odd endpoints, an unknown node going down, this node itself.
    up("env-3", 1)
    up("env-3", 2, blobs="not an endpoint")
    up("env-3", 3)
    down("env-3")
    down("never-seen")
    up("caller", 1, blobs=shared)
    down("caller")
    assert calls.client(shared) is kept and calls.down_reason(shared) is None
    assert set(view.live) == {"env-0", "env-1", "env-2"} and set(view.down) == {"env-3", "never-seen"}


def test_down_peers_and_down_marks_are_bounded_the_latest_kept(caller: NodeRuntime,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node restarted under a new id (the default ids hold the pid) goes down once and never comes back under
    it: the peers remembered down, and the endpoints marked down, keep the latest ones only. A peer marked down
    again counts as the latest; live peers are untouched."""
    monkeypatch.setattr(peers_module, "DOWN_KEPT", 3)
    monkeypatch.setattr(calls_module, "DOWN_MARKS", 4)
    view = Peers(caller.calls, "caller")

    def event(body: Any) -> Message:
        return PEER.decode(PEER.encode(body))

    def up(node_id: str) -> None:
        endpoints = {"blobs": f"tcp://127.0.0.1:{1000 + int(node_id.split('-')[1])}"}
        view.handle(event(NodeUp(NodeInfo(node_id=node_id, role="env-server", host="h", pid=1, endpoints=endpoints))))

    def down(node_id: str) -> None:
        view.handle(event(NodeDown(node_id=node_id, role="env-server", reason="timeout", last_seen=0.0)))

    up("env-0")
    for i in range(1, 11):
        up(f"env-{i}")
        down(f"env-{i}")
    down("env-8")  # down again: the latest
    assert list(view.down) == ["env-9", "env-10", "env-8"] and set(view.live) == {"env-0"}
    assert list(caller.calls._down) == [f"tcp://127.0.0.1:{1000 + i}" for i in (7, 9, 10, 8)]
    assert caller.calls.down_reason("tcp://127.0.0.1:1008") == "env-8 reported down (timeout)"


def test_sockets_back_off_reconnecting_to_a_peer_that_is_gone(sockets: Any) -> None:
    sock = sockets(zmq.DEALER, connect="tcp://127.0.0.1:1")
    assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_IVL_MAX_MS > sock.getsockopt(zmq.RECONNECT_IVL)


def test_policies_always_end() -> None:
    for bad in (dict(attempts=0), dict(timeout_s=0.0), dict(timeout_s=float("inf")), dict(max_timeout_s=float("nan"))):
        with pytest.raises(ValueError, match="retry policy"):
            RetryPolicy(**bad)  # type: ignore[arg-type]
    assert RetryPolicy(timeout_s=2.0, attempts=3).deadline_s == 14.0
