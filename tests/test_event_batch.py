"""The batch form of events: several events of one kind from one source in one frame, each with its own header.

How it reads (every event of a batch equals the same event sent alone; a batch is refused whole, with an error
that says what is wrong, whatever its bytes), how a publisher makes batches (runs of one kind in publishing
order, bounded in count and bytes, arrays and probes never inside one), how a subscriber takes them (sequence
gaps across batches, garbage counted once), and how a cluster uses them (the broker's ``event_batch`` reaches
every node at join, replays hand a batch's events from ``since`` on).
"""

from __future__ import annotations

import queue
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from fuzz_support import mutate
from refbus.bus import pubsub
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.pubsub import Publisher, Subscriber
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS
from refbus.nodes.config import ConfigError
from refbus.protocol.codec import EXT_NUMPY
from refbus.protocol.envelope import BATCH_MARK, Header, Limits, Message, WireCodec
from refbus.protocol.errors import (
    ArrayError,
    BadSignature,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaError,
    UnknownKind,
    VersionMismatch,
)
from refbus.protocol.messages import Blobs, Delete, FetchedBlob, RunEnd, Sync
from test_config import load

pytest_plugins = ["wire_fixtures"]

WAIT_S = 30.0
LOOPBACK = "tcp://127.0.0.1:0"
SECRET = b"batch-secret"


def delete(i: int) -> Delete:
    return Delete(blob_ids=[f"b{i}"], holder="t-0", reason="trained")


def batch(codec: WireCodec, first_seq: int, count: int, body: Callable[[int], Any] = delete) -> list[bytes]:
    items = [codec.batch_item(body(seq), seq) for seq in range(first_seq, first_seq + count)]
    return [bytes(frame) for frame in codec.encode_batch(body(first_seq).kind, [i for i in items if i is not None])]


def decoded(codec: WireCodec, frames: list[bytes]) -> list[Message]:
    return [codec.decode_body(received) for received in codec.read_events(frames)]


# --- the form -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [b"", SECRET], ids=["plain", "signed"])
def test_each_event_of_a_batch_is_the_event_sent_alone(secret: bytes) -> None:
    sender, reader = WireCodec("env-0", secret=secret), WireCodec("sub", secret=secret)
    frames = batch(sender, 7, 5)
    assert frames[0].startswith(b"delete" + BATCH_MARK) and len(frames) == (2 if secret else 1)
    events = decoded(reader, frames)
    assert [m.header.seq for m in events] == [7, 8, 9, 10, 11]
    assert [m.body for m in events] == [delete(seq) for seq in range(7, 12)]
    assert len({m.header.id for m in events}) == 5 and {m.header.src for m in events} == {"env-0"}
    for message in events:  # the same header and body as the one-frame form of the same event
        item = sender.batch_item(message.body, message.header.seq)
        assert item is not None
        alone = sender.encode_batch("delete", [item])
        assert alone[0].startswith(b"delete\0")
        again = reader.decode(alone)
        assert (again.body, again.header.seq, again.header.signed) == (message.body, message.header.seq, bool(secret))


def test_an_event_with_arrays_is_never_a_batch_item() -> None:
    codec = WireCodec("env-0")
    assert codec.batch_item(Blobs([FetchedBlob("b", {"x": np.arange(3)})]), 1) is None
    assert codec.batch_item(delete(1), 1) is not None


def test_a_batch_is_no_request() -> None:
    with pytest.raises(MalformedMessage, match="only an event stream carries one"):
        WireCodec("server").decode_header(batch(WireCodec("client"), 1, 3))


ENCODE = msgspec.msgpack.Encoder().encode


def _header(src: str = "env-0", seq: int = 1, v: tuple[int, int] = (2, 2), signed: bool = False,
            incarnation: str = "0123456789ab") -> Header:
    return Header(v, f"{incarnation}-{seq}", src, seq, 1.0, "", signed)


def _batch(*pairs: Any, kind: bytes = b"delete") -> bytes:
    return kind + BATCH_MARK + ENCODE(list(pairs))


ONE = (_header(), delete(1))
ARRAY_REF = msgspec.msgpack.Ext(EXT_NUMPY, msgspec.msgpack.encode(["uint8", [3], 0, None]))  # no frame follows


@pytest.mark.parametrize(("frames", "error", "match"), [
    ([_batch()], MalformedMessage, "batch of 0 events, 1 to 65535 expected"),
    ([b"\x01" + ENCODE([ONE])], MalformedMessage, "batch with an empty kind"),
    ([b"delete\x01" + ENCODE({"a": 1})], MalformedMessage, "batch: Expected `array`"),
    ([_batch(ONE)[:-3]], MalformedMessage, "batch: Input data was truncated"),
    ([_batch((_header(), delete(1), 3))], MalformedMessage, "batch: Expected `array` of length 2"),
    ([_batch(({"v": "x"}, delete(1)))], MalformedMessage, "batch: Expected `array`, got `str` - at `$[0][0].v`"),
    ([_batch(ONE, (_header("b", 2), delete(2)))], MalformedMessage, "mixes sources"),
    ([_batch(ONE, (_header(seq=2, incarnation="ffffffffffff"), delete(2)))], MalformedMessage, "incarnations"),
    ([_batch(ONE, (_header(seq=2, signed=True), delete(2)))], MalformedMessage, "MAC flags"),
    ([_batch(ONE, (_header(seq=2, v=(3, 0)), delete(2)))], VersionMismatch, "protocol 3.0"),
    ([_batch(ONE, kind=b"no-such-kind")], UnknownKind, "unknown message kind 'no-such-kind'"),
    ([_batch(ONE, kind=b"\xffkind")], MalformedMessage, "not ASCII"),
    ([_batch(ONE), b"extra"], MalformedMessage, "batch followed by 1 frames"),
    ([_batch(*[(_header(seq=i), delete(i)) for i in range(1, 13)])], MalformedMessage, "more than 100 list"),
    ([_batch((_header(), Delete(blob_ids=["x" * 1600], holder="t", reason="r")))], MessageTooLarge, "batch is"),
    ([_batch(ONE, (_header(seq=2), {"blob_ids": 5}))], SchemaError, "Expected `array`, got `int`"),
    ([_batch((_header(), {"episode_id": "e", "source": "s", "refs": [], "info": {"x": ARRAY_REF}}),
             kind=b"episode-finished")], ArrayError, "frame 0"),
], ids=["empty", "no-kind", "not-a-list", "cut", "pair-of-three", "bad-header", "two-sources",
        "two-incarnations", "two-mac-flags", "old-major", "unknown-kind", "kind-not-ascii", "extra-frame",
        "too-many-items", "too-large", "bad-body", "array-without-frame"])
def test_a_bad_batch_is_refused_whole_saying_what_is_wrong(frames: list[bytes], error: type, match: str) -> None:
    """``decode_batch`` refuses the whole batch with the error that says what is wrong; ``read_events`` (headers
    only) the same, for everything but the bodies."""
    reader = WireCodec("sub", limits=Limits(max_body_bytes=1500, max_items=100))
    with pytest.raises(ProtocolError) as info:
        reader.decode_batch(frames)
    assert type(info.value) is error and info.value.code == error.code
    assert match in str(info.value), str(info.value)
    if error not in (SchemaError, ArrayError):
        with pytest.raises(error, match=re.escape(match)):
            reader.read_events(frames)


def test_a_signed_bus_refuses_a_batch_without_its_mac_or_with_a_wrong_one() -> None:
    reader = WireCodec("sub", secret=SECRET)
    frames = batch(WireCodec("env-0", secret=SECRET), 1, 3)
    with pytest.raises(BadSignature, match="without its MAC frame on a signed bus"):
        reader.read_events(frames[:1])
    with pytest.raises(BadSignature, match="bad MAC"):
        reader.read_events([frames[0], bytes(32)])
    with pytest.raises(BadSignature, match="without its MAC frame"):
        reader.read_events(batch(WireCodec("env-0"), 1, 3))
    forged = batch(WireCodec("env-0", secret=b"another"), 1, 3)
    with pytest.raises(BadSignature):
        reader.read_events(forged)


def test_a_forged_batch_on_a_signed_bus_is_refused_before_its_events_are_parsed() -> None:
    """The MAC is checked over the frame before a byte of the events is read: a forged batch (here 8 MiB of
    events) costs one SHA-256 pass, not a parse."""

    class Untouched:
        def decode(self, data: Any) -> Any:
            raise AssertionError("the events were parsed before the MAC was checked")

    reader = WireCodec("sub", secret=SECRET)
    reader._batch_header_decoder = Untouched()  # type: ignore[assignment]
    forged = batch(WireCodec("env-0", secret=b"not-the-secret"), 1, 2)
    events = ENCODE([(_header(seq=i, signed=True), delete(i)) for i in range(1, 100_000)])
    for frames in ([forged[0], bytes(32)], [b"delete\x01" + events, bytes(32)], [b"delete\x01" + events]):
        with pytest.raises(BadSignature):
            reader.read_events(frames)
        with pytest.raises(BadSignature):
            reader.decode_batch(frames)


def _outcome(decode: Callable[[], list[Message] | None]) -> Any:
    try:
        messages = decode()
    except ProtocolError as exc:
        return type(exc), str(exc), exc.kind
    return [(m.kind, m.header, m.body) for m in messages or []]


@pytest.mark.parametrize("secret", [b"", SECRET], ids=["plain", "signed"])
def test_garbage_batches_decide_as_the_general_path_does_and_are_never_read_in_part(secret: bytes) -> None:
    """Every truncation of a batch, every byte replaced by a few values, and random mutations of its frames:
    ``decode_batch`` (one msgspec call for an unsigned batch) gives what the general path gives (``read_events``,
    then ``decode_body`` for each event): the same messages or the same refusal, never another exception and
    never part of a batch. Signed, only the intact batch reads."""
    rng = random.Random(22)
    sender, reader = WireCodec("env-0", secret=secret), WireCodec("sub", secret=secret,
                                                                  limits=Limits(max_body_bytes=900))
    bodies = [delete(1), delete(2), Delete(blob_ids=[f"b{i}" for i in range(40)], holder="t", reason="big")]
    frames = [bytes(f) for f in sender.encode_batch("delete", [sender.batch_item(b, n) or () for n, b in
                                                                enumerate(bodies, 3)])]
    frame, rest = frames[0], frames[1:]
    mutants = [[frame[:cut], *rest] for cut in range(len(frame))]
    for at in range(len(frame)):
        mutants += [[frame[:at] + bytes([value]) + frame[at + 1:], *rest] for value in (0, 1, rng.randrange(256))]
    mutants += [mutate(frames, rng) for _ in range(300)]
    read = refused = 0
    for mutant in [frames, *mutants]:
        one_step = _outcome(lambda m=mutant: reader.decode_batch(m))
        general = _outcome(lambda m=mutant: [reader.decode_body(r) for r in reader.read_events(m)])
        if isinstance(one_step, list) and not one_step:  # no batch (a mark cut away): the general path reads
            continue  # it as one message, which test_envelope covers
        assert one_step == general, mutant
        if isinstance(one_step, list):
            read += 1
            assert len(one_step) == 3 and (mutant == frames or not secret), "read in part, or signed and changed"
        else:
            refused += 1
    assert read >= 1 and refused > len(frame)
    assert [m.header.seq for m in reader.decode_batch(frames) or []] == [3, 4, 5]


# --- the publisher and the subscriber ---------------------------------------------------------------------


class Pair:
    """A bound PUB with a batching Publisher, a connected SUB in a Subscriber, made live with probes."""

    def __init__(self, pub: zmq.Socket, sub: zmq.Socket, batch_events: int = 4) -> None:
        self.publisher = Publisher(pub, WireCodec("env-0"), batch_events=batch_events)
        self.raw = pub
        self.sub = Subscriber(sub, WireCodec("monitor"))
        self.sock = sub
        deadline = time.monotonic() + WAIT_S
        self.sub.expect("live")
        while "live" not in self.sub.tokens:
            assert time.monotonic() < deadline, "subscription never became live"
            self.publisher.publish_raw(Sync(token="live"))
            assert self.sub.recv(20) is None

    def receive(self, count: int) -> list[Message]:
        got: list[Message] = []
        deadline = time.monotonic() + WAIT_S
        while len(got) < count and time.monotonic() < deadline:
            message = self.sub.recv(100)
            if message is not None:
                got.append(message)
        assert len(got) == count, got
        return got


@pytest.fixture
def pair(bound_pair: Any) -> Callable[..., Pair]:
    def make(**kwargs: Any) -> Pair:
        pub, sub, _ = bound_pair(zmq.PUB, zmq.SUB, options=EVENT_OPTIONS)
        return Pair(pub, sub, **kwargs)

    return make


def test_a_turn_sends_runs_of_one_kind_in_order_bounded_and_arrays_alone(pair: Callable[..., Pair]) -> None:
    p = pair(batch_events=4)
    sent: list[list[Any]] = []
    real_send = pubsub.send_frames
    bodies: list[Any] = [delete(1), delete(2), RunEnd(reason="r", steps=3), delete(4),
                         Blobs([FetchedBlob("b", {"x": np.arange(3)})]), *[delete(i) for i in range(6, 12)]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pubsub, "send_frames", lambda sock, frames: (sent.append(frames), real_send(sock, frames)))
        with p.publisher.batching():
            seqs = [p.publisher.publish(body) for body in bodies]
            # 4 waiting reached the limit (3 runs), the array went alone, then the next 4 deletes; 2 wait
            assert len(sent) == 5
            p.publisher.publish_raw(Sync(token="tail"))  # a probe flushes first: it carries the latest number
            assert len(sent) == 7
    assert seqs == list(range(1, 12))
    firsts = [bytes(frames[0]).split(b"\0", 1)[0].split(BATCH_MARK, 1)[0] for frames in sent]
    assert firsts == [b"delete", b"run-end", b"delete", b"blobs", b"delete", b"delete", b"sync"]
    got = p.receive(11)
    assert [m.header.seq for m in got] == seqs and [m.kind for m in got] == [b.kind for b in bodies]
    assert p.publisher.messages == 6 and p.sub.lost.total() == 0 and not p.sub.rejected
    assert [n for _, n in p.publisher.held()] == [2, 1, 1, 1, 4, 2]


def test_a_turn_closes_a_batch_at_about_its_byte_bound(pair: Callable[..., Pair], monkeypatch: Any) -> None:
    p = pair(batch_events=1000)
    item = WireCodec("env-0").batch_item(delete(1), 1)
    assert item is not None
    monkeypatch.setattr(pubsub, "BATCH_BYTES", 3 * len(item[1]))
    with p.publisher.batching():
        for i in range(1, 8):
            p.publisher.publish(delete(i))
    assert p.publisher.messages == 3  # 3 + 3 (a 4th would pass the bound), then the last one at the turn's end
    big = Delete(blob_ids=["x" * 100], holder="t-0", reason="trained")  # larger than the bound: alone
    with p.publisher.batching():
        p.publisher.publish(delete(8))
        p.publisher.publish(big)
        p.publisher.publish(delete(10))
    assert p.publisher.messages == 6  # what waited, the large one alone, the last one
    assert [m.header.seq for m in p.receive(10)] == list(range(1, 11))


def test_a_publisher_keeps_order_and_loses_nothing_when_a_send_fails_nests_or_its_limit_drops(
        pair: Callable[..., Pair], monkeypatch: Any) -> None:
    p = pair(batch_events=8)
    real_send, failures = pubsub.send_frames, [1]

    def send_failing_once(sock: zmq.Socket, frames: list) -> None:
        if failures and bytes(frames[0]).startswith(b"run-end"):
            failures.pop()
            raise zmq.ZMQError(zmq.EAGAIN)
        real_send(sock, frames)

    monkeypatch.setattr(pubsub, "send_frames", send_failing_once)
    with pytest.raises(zmq.ZMQError), p.publisher.batching():
        p.publisher.publish(delete(1))
        with p.publisher.batching():  # nested: the outer turn ends the batch
            p.publisher.publish(RunEnd(reason="r", steps=2))
        assert p.publisher.messages == 0
        p.publisher.publish(delete(3))
    assert p.publisher.messages == 1  # the deletes' run went; the failed run and what followed wait, in order
    with p.publisher.batching():
        p.publisher.publish(delete(4))
        p.publisher.batch_events = 1  # lowered mid-turn: what waits goes first, then one a message
        p.publisher.publish(delete(5))
    assert [m.header.seq for m in p.receive(5)] == [1, 2, 3, 4, 5] and p.sub.lost.total() == 0


def test_outside_a_turn_and_with_a_batch_of_one_every_event_goes_alone(pair: Callable[..., Pair]) -> None:
    p = pair(batch_events=1)
    with p.publisher.batching():
        for i in range(1, 4):
            p.publisher.publish(delete(i))
    p.publisher.batch_events = 8
    p.publisher.publish(delete(4))
    assert p.publisher.messages == 4
    assert [m.header.seq for m in p.receive(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="at least 1"):
        Publisher(p.raw, WireCodec("x"), batch_events=0)


def test_a_lost_batch_is_a_gap_and_a_garbage_one_is_counted_once(pair: Callable[..., Pair]) -> None:
    p = pair()
    codec = p.publisher.codec
    p.raw.send_multipart(batch(codec, 1, 3))
    p.raw.send_multipart(batch(codec, 7, 2))  # 4..6 never sent
    p.raw.send_multipart([b"delete\x01\x05\x00\x00\x00garbage"])
    p.raw.send_multipart(batch(codec, 9, 2))
    got = p.receive(7)
    assert [m.header.seq for m in got] == [1, 2, 3, 7, 8, 9, 10]
    assert p.sub.missed == 3 and p.sub.lost["env-0"] == 3 and p.sub.rejected == {"malformed": 1}
    p.raw.send_multipart(batch(codec, 9, 3))  # 9 and 10 again, live: replays; 11 is new
    assert [m.header.seq for m in p.receive(1)] == [11]
    assert p.sub.rejected == {"malformed": 1, "replay": 2}


def test_a_publisher_holds_at_least_its_last_keep_events_events_in_whole_messages(
        pair: Callable[..., Pair]) -> None:
    p = pair(batch_events=8)
    p.publisher = Publisher(p.raw, p.publisher.codec, keep_events=10, batch_events=8)
    seq = 0
    for size in (5, 8, 5, 3, 8):
        with p.publisher.batching():
            for _ in range(size):
                seq += 1
                p.publisher.publish(delete(seq))
        counts = [n for _, n in p.publisher.held()]
        assert sum(counts) >= min(seq, 10) and sum(counts) - counts[0] < 10, counts
    assert [n for _, n in p.publisher.held()] == [3, 8]


def test_a_subscriber_readies_about_its_budget_of_events_per_drain(pair: Callable[..., Pair]) -> None:
    p = pair(batch_events=64)
    for first in range(1, 64 * 8, 64):
        p.raw.send_multipart(batch(p.publisher.codec, first, 64))
    deadline = time.monotonic() + WAIT_S
    while not p.sub.drain(budget=100):
        assert time.monotonic() < deadline
    assert 100 <= len(p.sub._ready) < 100 + 64  # stops once the budget of events is ready, not messages
    assert [m.header.seq for m in p.receive(64 * 8)] == list(range(1, 64 * 8 + 1))


# --- in a cluster -----------------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[Callable[[int], tuple[Broker, NodeRuntime, NodeRuntime]]]:
    """``cluster(event_batch)``: a broker, a publishing node and a subscribing node, each on its own loop."""
    runtimes: list[NodeRuntime] = []

    def make(event_batch: int) -> tuple[Broker, NodeRuntime, NodeRuntime]:
        bus = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
        broker = Broker(bus, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK,
                                            event_batch=event_batch))
        bus.start_background()
        runtimes.append(bus)
        control = bus.endpoints["control"]
        nodes = [NodeRuntime(role, RuntimeSettings(bus=control, node_id=role, metrics_port=-1))
                 for role in ("pub", "sub")]
        for node in nodes:
            runtimes.insert(0, node)
            node.start_background()
        return broker, nodes[0], nodes[1]

    yield make
    for runtime in runtimes:
        runtime.join(WAIT_S)


def _on_loop(node: NodeRuntime, call: Callable[[], Any]) -> Any:
    done: queue.Queue[Any] = queue.Queue()
    node.call_soon(lambda: done.put(call()))
    return done.get(timeout=WAIT_S)


@pytest.mark.parametrize("event_batch", [1, 64])
def test_a_cluster_batches_a_turn_as_its_broker_allows_and_replays_from_inside_a_batch(
        cluster: Callable[[int], tuple[Broker, NodeRuntime, NodeRuntime]], event_batch: int) -> None:
    _, pub, sub = cluster(event_batch)
    assert _on_loop(pub, lambda: pub.publisher.batch_events if pub.publisher else 0) == event_batch
    before = _on_loop(pub, lambda: pub.publisher.messages if pub.publisher else 0)
    _on_loop(pub, lambda: [pub.publish(RunEnd(reason="turn", steps=step)) for step in range(1, 11)])
    messages = _on_loop(pub, lambda: pub.publisher.messages if pub.publisher else 0) - before
    assert messages == (10 if event_batch == 1 else 1)

    def publish_then_rejoin() -> tuple[int, int]:  # a re-join sends what the turn published first, before it
        assert pub.publisher is not None  # reconnects, refills or probes: never after the refill
        pub.publish(RunEnd(reason="turn", steps=11))
        before = pub.publisher.messages
        pub._join()
        return before, pub.publisher.messages

    before, after = _on_loop(pub, publish_then_rejoin)
    assert after == before + (event_batch > 1)
    assert _on_loop(pub, lambda: pub.flush_events(WAIT_S))  # the broker has them: the ring will
    replayed = _on_loop(sub, lambda: sub.replay(since=5, src="pub"))
    assert [m.body.steps for m in replayed if m.kind == RunEnd.kind] == [5, 6, 7, 8, 9, 10, 11]
    assert all(m.header.seq >= 5 for m in replayed)


def test_the_event_batch_key_is_bounded() -> None:
    assert load().bus.event_batch == pubsub.BATCH_EVENTS
    assert load("--bus-event-batch", "1").bus.event_batch == 1
    for bad in ("0", "65536"):
        with pytest.raises(ConfigError, match=r"bus\.event_batch must be from 1 to 65535"):
            load("--bus-event-batch", bad)
