"""The broker forwards in ZeroMQ's proxy without reading events, so garbage on ``events_in`` reaches the
subscribers, who refuse and count it; the broker keeps forwarding, its ring keeps serving replays (skipping
and counting what it cannot read), and its own events and the ``sync`` handshake keep working."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from polling import wait_for
from refbus.bus import broker as broker_module
from refbus.bus.broker import Broker, BrokerSettings, frames_of
from refbus.bus.forwarder import held_bytes, is_event
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS, make_socket
from refbus.protocol.envelope import MAX_KIND_BYTES, Message, WireCodec
from refbus.protocol.messages import MAX_FRAMES, Error, NodeList, Nodes, Ok, Refill, ReplayedEvent, RunEnd, Sync
from zmq.utils.monitor import recv_monitor_message

LOOPBACK = "tcp://127.0.0.1:0"
WAIT_S = 30.0
GARBAGE = [
    [b"\x00"],  # looks like an unsubscription
    [b"\x01anything"],  # looks like a subscription
    [b"too-few-frames"],
    [b"run-end", b"not msgpack", b"\xc1"],
    [b"\xff\xfe kind not ascii", b"", b""],
    [b"run-end\x00\xff\xff\xff\x7f" + b"x" * 8],  # one frame whose header length runs past its end
    [b"sync", b"\x80", b"\x80"],  # a probe that is not one
]


@pytest.fixture
def broker() -> Iterator[Broker]:
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK))
    runtime.start_background()
    try:
        yield node
    finally:
        runtime.join(WAIT_S)


def test_control_bytes_tell_captured_subscriptions_from_events() -> None:
    assert not is_event(b"\x01") and not is_event(b"\x00topic") and not is_event(b"")
    assert is_event(b"run-end") and is_event(b"sync\x00header")


def test_garbage_on_events_in_is_forwarded_refused_by_subscribers_and_skipped_by_replays(broker: Broker) -> None:
    control = broker.runtime.endpoints["control"]
    received: queue.Queue[Message] = queue.Queue()
    subscriber_node = NodeRuntime("watcher", RuntimeSettings(bus=control, node_id="watcher", metrics_port=-1))
    subscription = subscriber_node.subscribe(received.put, kinds=frozenset({RunEnd.kind}))
    publisher_node = NodeRuntime("pub", RuntimeSettings(bus=control, node_id="pub", metrics_port=-1))
    ctx = zmq.Context()
    try:
        subscriber_node.start_background()  # joins: hello, sync proof through the forwarder, node-up
        publisher_node.start_background()
        raw = make_socket(ctx, zmq.PUB, connect=broker.runtime.endpoints["events_in"], options=EVENT_OPTIONS)
        codec = WireCodec("prober")
        subscription.expect("raw-probe")

        def garbage_counted() -> bool:
            for frames in GARBAGE:
                raw.send_multipart(frames)
            raw.send_multipart(codec.encode(Sync(token="raw-probe")))  # marks when the garbage went through
            return "raw-probe" in subscription.tokens and sum(subscription.rejected.values()) >= 4

        wait_for(garbage_counted, WAIT_S, "the subscriber refusing the garbage", poll_s=0.05)
        assert set(subscription.rejected) <= {"malformed", "unknown-kind", "bad-kind", "too-large", "version"}

        publisher_node.call_soon(lambda: publisher_node.publish(RunEnd(reason="after-garbage", steps=1)))
        event = received.get(timeout=WAIT_S)
        assert (event.header.src, event.body.reason) == ("pub", "after-garbage")

        replayed = publisher_node_replay(subscriber_node)
        assert [(m.header.src, m.kind) for m in replayed if m.kind == RunEnd.kind] == [("pub", RunEnd.kind)]
        unread = wait_for(lambda: broker.ring.unreadable, WAIT_S, "the ring counting what it could not read")
        assert unread >= 4 and broker.dropped["malformed"] >= unread  # (bad "sync" probes are counted too)
    finally:
        ctx.destroy(linger=0)
        publisher_node.join(WAIT_S)
        subscriber_node.join(WAIT_S)


def publisher_node_replay(node: NodeRuntime) -> list[Message]:
    """Every ring event, read through ``node``'s loop thread (its control client is that thread's)."""
    done: queue.Queue[list[Message]] = queue.Queue()
    node.call_soon(lambda: done.put(node.replay(since=0)))
    return done.get(timeout=WAIT_S)


def test_garbage_refills_are_refused_and_counted_and_the_broker_keeps_its_ring_and_serving(broker: Broker) -> None:
    control = broker.runtime.endpoints["control"]
    node = NodeRuntime("pub", RuntimeSettings(bus=control, node_id="pub", metrics_port=-1), register=False)
    ctx = zmq.Context()
    try:
        own, other = WireCodec("pub"), WireCodec("intruder")
        genuine = [bytes(f) for f in own.encode(RunEnd(reason="held", steps=1), seq=7, one_frame=True)]
        forged = [bytes(f) for f in other.encode(RunEnd(reason="not-pub's", steps=1), seq=8)]
        probe = [bytes(f) for f in own.encode(Sync(token="held-probe"), seq=7)]
        events = [ReplayedEvent(frames) for frames in (*GARBAGE, forged, probe, genuine)]
        dropped = sum(broker.dropped.values())
        answer = node.broker().request(Refill(events=events)).body
        assert isinstance(answer, Ok) and answer.detail == f"kept 1 of {len(events)}"
        assert broker.dropped["wrong-src"] == 1 and sum(broker.dropped.values()) - dropped >= 5

        # A body that is no refill at all: a schema error, answered; the broker serves on.
        dealer = make_socket(ctx, zmq.DEALER, connect=control)
        frames = [bytes(f) for f in own.encode(Refill(events=[]))]
        for body in (msgspec.msgpack.encode({"events": [["not", 1, "frames"]]}), msgspec.msgpack.encode({"events": 3}),
                     msgspec.msgpack.encode({"events": [[[]]]})):
            dealer.send_multipart([frames[0], frames[1], body])
            assert dealer.poll(int(WAIT_S * 1000)), "the broker answers a garbage refill"
            reply = own.decode(dealer.recv_multipart()).body
            assert isinstance(reply, Error) and reply.code == "schema", reply

        replayed = node.replay(src="pub")
        assert [(m.header.seq, m.body.reason) for m in replayed] == [(7, "held")]
        assert [m.header.src for m in node.replay()].count("intruder") == 0
    finally:
        ctx.destroy(linger=0)
        node.close()


def test_a_captured_message_of_more_frames_than_any_message_has_is_dropped_not_kept(broker: Broker) -> None:
    """The proxy forwards without reading, and the capture used to keep every message in the ring as it came: a
    forged event of 500,000 empty frames was held as 500,000 frame objects, its size counted as a few bytes. The
    capture reads such a message off and drops it (counted ``malformed``); a message of several frames it keeps is
    charged per frame."""
    ctx = zmq.Context()
    try:
        raw = make_socket(ctx, zmq.PUB, connect=broker.runtime.endpoints["events_in"], options=EVENT_OPTIONS)
        codec = WireCodec("forger")
        kind, header, body = (bytes(f) for f in codec.encode(RunEnd(reason="forged", steps=1), seq=1))
        marker = [bytes(f) for f in codec.encode(RunEnd(reason="marker", steps=2), seq=2)]  # three frames

        def held() -> list[tuple[int, int]]:  # (frames, bytes charged) of each ring entry, read on the loop thread
            entries: queue.Queue[list[tuple[int, int]]] = queue.Queue()
            broker.runtime.call_soon(lambda: entries.put([(len(frames_of(entry)), size) for entry, size in
                                                          zip(broker.ring._entries, broker.ring._sizes, strict=True)]))
            return entries.get(timeout=WAIT_S)

        marker_entry = (len(marker), held_bytes(marker, sum(map(len, marker))))

        def dropped_and_marker_kept() -> bool:  # sent until the XSUB's subscription reached the PUB
            raw.send_multipart([kind, header, body, *[b""] * (2 * MAX_FRAMES)])
            raw.send_multipart(marker)
            return broker.dropped["malformed"] >= 1 and marker_entry in held()

        wait_for(dropped_and_marker_kept, WAIT_S, "the capture dropping the long message", poll_s=0.05)
        assert max(frames for frames, _ in held()) <= MAX_FRAMES
    finally:
        ctx.destroy(linger=0)


Resting = tuple[queue.Queue[Message], NodeRuntime, NodeRuntime]  # what run-end events the watcher got, it, a publisher


@pytest.fixture
def resting(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> Iterator[Resting]:
    """``broker`` with a capture that rests a minute between batches, and two nodes joined to it: a watcher
    whose run-end events land in the queue, and a publisher node. Yields (queue, watcher, publisher)."""
    monkeypatch.setattr(broker_module, "CAPTURE_REST_S", 60.0)
    control = broker.runtime.endpoints["control"]
    received: queue.Queue[Message] = queue.Queue()
    subscriber_node = NodeRuntime("watcher", RuntimeSettings(bus=control, node_id="watcher", metrics_port=-1))
    subscriber_node.subscribe(received.put, kinds=frozenset({RunEnd.kind}))
    publisher_node = NodeRuntime("pub", RuntimeSettings(bus=control, node_id="pub", metrics_port=-1))
    try:
        subscriber_node.start_background()
        publisher_node.start_background()
        yield received, subscriber_node, publisher_node
    finally:
        publisher_node.join(WAIT_S)
        subscriber_node.join(WAIT_S)


def test_a_resting_capture_delays_only_the_rings_copy_and_replays_catch_up_first(
    broker: Broker, resting: Resting
) -> None:
    """Between batches the capture rests (here for a minute): events still reach subscribers at once, the
    ring takes them at the next batch, and a replay in between drains the capture before it answers."""
    received, subscriber_node, publisher_node = resting
    wait_for(lambda: broker.forwarded > 0, WAIT_S, "a first batch, after which the capture rests")
    resting_at = broker.forwarded
    for steps in range(1, 6):
        publisher_node.call_soon(lambda steps=steps: publisher_node.publish(RunEnd(reason="rest", steps=steps)))
    assert [received.get(timeout=WAIT_S).body.steps for _ in range(5)] == [1, 2, 3, 4, 5]
    assert broker.forwarded == resting_at, "the capture rested: the ring has not taken them yet"

    replayed = publisher_node_replay(subscriber_node)
    assert [m.body.steps for m in replayed if m.kind == RunEnd.kind and m.header.src == "pub"] == [1, 2, 3, 4, 5]
    assert broker.forwarded > resting_at  # messages: the five events may have gone as one batch


DOOMED_PUBLISHER = """
import sys, time
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.protocol.messages import RunEnd
node = NodeRuntime("pub", RuntimeSettings(bus=sys.argv[1], node_id="doomed", metrics_port=-1))
node.start()
burst = int(sys.argv[2])  # events a turn: more than one travel as one batch
steps = 0
while True:
    with node.publisher.batching():
        for _ in range(burst):
            steps += 1
            node.publish(RunEnd(reason="doomed", steps=steps))
    time.sleep(0.002)
"""


def _drain(received: queue.Queue[Message], got: list[Message]) -> list[Message]:
    """Move what ``received`` holds now into ``got``; returns ``got``."""
    with contextlib.suppress(queue.Empty):
        while True:
            got.append(received.get_nowait())
    return got


def _receive_until(received: queue.Queue[Message], got: list[Message], done: Callable[[list[Message]], bool],
                   what: str) -> list[Message]:
    """Move what ``received`` gets into ``got`` until ``done(got)``; fails naming ``what`` after WAIT_S."""
    wait_for(lambda: done(_drain(received, got)), WAIT_S, what)
    return got


def _steps_of(src: str, messages: list[Message]) -> list[int]:
    return [m.body.steps for m in messages if m.kind == RunEnd.kind and m.header.src == src]


def _ring_and_subscriber_agree(subscriber_node: NodeRuntime, received: queue.Queue[Message],
                               got: list[Message]) -> list[int]:
    """The dead ``doomed`` publisher's steps once the ring (a replay drains the capture first) and the subscriber
    hold the same ones; fails when they never do within WAIT_S. Polled, not waited out in a quiet
    spell: what the publisher wrote before it died may still be on its way through the broker."""
    ring: list[int] = []

    def agree() -> bool:
        ring[:] = _steps_of("doomed", publisher_node_replay(subscriber_node))
        return _steps_of("doomed", _drain(received, got)) == ring

    wait_for(agree, WAIT_S, "the ring and the subscriber to hold the same events of the killed publisher",
             poll_s=0.1)
    return ring


@pytest.mark.parametrize("burst", [1, 16], ids=["one-a-message", "batches"])
def test_a_publisher_sigkilled_mid_stream_while_the_capture_rests_leaves_the_ring_whole(
    broker: Broker, resting: Resting, burst: int
) -> None:
    """A publisher process killed in the middle of its stream, while the capture holds a rest's worth of its
    events (a minute here), perhaps mid-message on the wire, its events one a message or in batches: the ring
    then holds exactly what the subscriber got, in order and without holes (a batch arrives whole or not at
    all), and the broker forwards on."""
    received, subscriber_node, publisher_node = resting
    doomed = subprocess.Popen([sys.executable, "-c", DOOMED_PUBLISHER, broker.runtime.endpoints["control"],
                               str(burst)])
    try:
        got = [received.get(timeout=WAIT_S) for _ in range(50)]
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(WAIT_S) == -signal.SIGKILL
        publisher_node.call_soon(lambda: publisher_node.publish(RunEnd(reason="after-kill", steps=1)))
        _receive_until(received, got, lambda got: bool(_steps_of("pub", got)), "the event after the kill")
        assert [m.body.reason for m in got if m.header.src == "pub"] == ["after-kill"]  # the broker forwards on

        steps = _ring_and_subscriber_agree(subscriber_node, received, got)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 50 and len(steps) % burst == 0
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.wait(WAIT_S)


def test_garbage_between_events_in_one_resting_batch_splits_no_other_message(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Garbage interleaved with valid events, all drained in one batch after a rest: multi-frame garbage whose
    first frame holds the one-frame mark (the drain takes it for a whole one-frame message, so its later
    frames come as entries of their own), garbage multi-frame events and control bytes. Every valid event is
    replayed whole and in order, the garbage is counted, and the broker forwards on."""
    monkeypatch.setattr(broker_module, "CAPTURE_REST_S", 60.0)
    control = broker.runtime.endpoints["control"]
    received: queue.Queue[Message] = queue.Queue()
    subscriber_node = NodeRuntime("watcher", RuntimeSettings(bus=control, node_id="watcher", metrics_port=-1))
    subscriber_node.subscribe(received.put, kinds=frozenset({RunEnd.kind}))
    ctx = zmq.Context()
    try:
        subscriber_node.start_background()
        raw = make_socket(ctx, zmq.PUB, connect=broker.runtime.endpoints["events_in"], options=EVENT_OPTIONS)
        warmup = WireCodec("warmup")

        def through() -> bool:  # the broker's subscription reached this PUB
            raw.send_multipart(warmup.encode(RunEnd(reason="warmup", steps=1), one_frame=True))
            return not received.empty()

        wait_for(through, WAIT_S, "a raw publisher's first event through the broker", poll_s=0.05)
        wait_for(lambda: broker.forwarded > 0, WAIT_S, "a first batch, after which the capture rests")
        unread_before = broker.ring.unreadable
        mixed = WireCodec("mixed")
        split_mark = [b"run-end\x00not a header", b"run-end", b"\x00\x01"]  # marked first frame, then two more
        for seq in range(1, 21):
            raw.send_multipart(mixed.encode(RunEnd(reason="mixed", steps=seq), seq=seq, one_frame=seq % 2 == 0))
            raw.send_multipart(split_mark if seq % 3 else GARBAGE[seq % len(GARBAGE)])
        got = _receive_until(received, [], lambda got: len(_steps_of("mixed", got)) >= 20, "the 20 valid events")
        assert _steps_of("mixed", got) == list(range(1, 21))

        replayed = publisher_node_replay(subscriber_node)
        assert _steps_of("mixed", replayed) == list(range(1, 21))
        assert broker.ring.unreadable > unread_before
        raw.send_multipart(mixed.encode(RunEnd(reason="after-garbage", steps=21), seq=21, one_frame=True))
        assert received.get(timeout=WAIT_S).body.reason == "after-garbage"
    finally:
        ctx.destroy(linger=0)
        subscriber_node.join(WAIT_S)


def test_a_subscription_longer_than_any_topic_drops_its_connection_before_anything_keeps_it(broker: Broker) -> None:
    """Regression: the broker's XPUB took subscriptions of any length. ZeroMQ keeps each in a trie at about 80 bytes
    per byte of topic, and the forwarder passes it upstream to the XSUB and every publisher's PUB, which keep it
    too: 1,000 subscriptions of 4 KiB from one subscriber grew the broker by 320 MiB. The XPUB now refuses a
    message longer than a subscription to the longest topic refbus uses (an event kind, ``MAX_KIND_BYTES``):
    ZeroMQ drops the connection that sends one as it decodes it, and nothing is kept or passed on; subscribers to
    topics of that length, and to everything, are served as before."""
    out, events_in = broker.runtime.endpoints["events_out"], broker.runtime.endpoints["events_in"]
    longest = b"k" * MAX_KIND_BYTES
    ctx = zmq.Context()
    try:
        upstream = make_socket(ctx, zmq.XPUB, connect=events_in, options=EVENT_OPTIONS)  # sees what goes upstream
        hostile = make_socket(ctx, zmq.SUB, connect=out, options=EVENT_OPTIONS)
        dropped = hostile.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        hostile.setsockopt(zmq.SUBSCRIBE, b"h" * 4096)
        assert dropped.poll(int(WAIT_S * 1000)), "the broker dropping the connection of a 4 KiB subscription"
        assert recv_monitor_message(dropped)["event"] == zmq.EVENT_DISCONNECTED

        honest = make_socket(ctx, zmq.SUB, connect=out, options=EVENT_OPTIONS)
        honest.setsockopt(zmq.SUBSCRIBE, longest)
        seen: list[bytes] = []

        def passed_upstream() -> bool:
            while upstream.poll(0):
                seen.append(upstream.recv())
            return b"\x01" + longest in seen

        wait_for(passed_upstream, WAIT_S, "the longest topic's subscription passed upstream")
        assert max(len(message) for message in seen) == 1 + MAX_KIND_BYTES, [message[:16] for message in seen]

        publisher = make_socket(ctx, zmq.PUB, connect=events_in, options=EVENT_OPTIONS)
        event = longest + b"\x00an event of the longest kind"
        wait_for(lambda: publisher.send(event) or honest.poll(50), WAIT_S, "the honest subscriber's event")
        assert honest.recv() == event
        client = Client(ctx, broker.runtime.endpoints["control"], WireCodec("checker"),
                        policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
        assert isinstance(client.request(Nodes()).body, NodeList)  # the broker serves on
    finally:
        ctx.destroy(linger=0)
