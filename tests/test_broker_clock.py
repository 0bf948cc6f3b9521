"""The broker judges liveness on a monotonic clock: a wall-clock step (NTP, a VM resumed) expires no node and
revives none; only time on the liveness clock does. On the same clock it gives up PUB handshakes whose probe
never came. It tells a restarted process under the same node id by its incarnation, not its pid. What it reads
before a liveness pass, and before a replay, is bounded, and so is what it keeps and answers of each node. A
real broker on loopback sockets, its clock injected."""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgspec
import pytest
import zmq
from polling import wait_for
from refbus.bus import broker as bus_broker
from refbus.bus import runtime as bus_runtime
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.forwarder import CAPTURE_HWM
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy
from refbus.bus.runtime import ID_IN_USE, NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS, make_socket
from refbus.protocol.envelope import Limits, Message, WireCodec
from refbus.protocol.messages import (
    Bye,
    Error,
    Heartbeat,
    Hello,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Ok,
    Sync,
    Welcome,
)
from structlog.testing import capture_logs

T = TypeVar("T")
NODE_TIMEOUT_S = 1.0
WAIT_S = 10.0
LOOPBACK = "tcp://127.0.0.1:0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def broker() -> Iterator[tuple[Broker, FakeClock]]:
    clock = FakeClock()
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    settings = BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK,
                              node_timeout_s=NODE_TIMEOUT_S)
    node = Broker(runtime, settings, clock=clock)
    runtime.start_background()
    try:
        yield node, clock
    finally:
        runtime.join(WAIT_S)


def on_loop(broker: Broker, work: Callable[[], T]) -> T:
    """Run ``work`` on the broker's loop thread (where its registry lives) and return its result."""
    done = threading.Event()
    result: list[T] = []
    broker.runtime.call_soon(lambda: (result.append(work()), done.set()))
    assert done.wait(WAIT_S), "the broker's loop did not run the call"
    return result[0]


def advance(broker: Broker, clock: FakeClock, seconds: float) -> None:
    """Let ``seconds`` pass on the liveness clock while the broker runs: the clock moves a liveness period at a time,
    a liveness pass after each, on the loop thread. (A jump with no pass in between is a broker whose loop did not
    run: that time counts toward no node's silence.)"""
    def run() -> None:
        left = seconds
        while left > 0:
            step = min(left, broker.passes.period_s)
            clock.now += step
            broker._expire()
            left -= step

    on_loop(broker, run)


def expire_now(broker: Broker) -> set[str]:
    """One liveness pass now; the registered node ids after it."""
    def run() -> set[str]:
        broker._expire()
        return set(broker.members)

    return on_loop(broker, run)


def test_a_wall_clock_step_expires_no_node_and_the_liveness_clock_does(
    broker: tuple[Broker, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, clock = broker
    ctx = zmq.Context()
    client = Client(ctx, node.runtime.endpoints["control"], WireCodec("worker-1"),
                    policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    try:
        info = NodeInfo(node_id="worker-1", role="worker", host="localhost", pid=1)
        assert isinstance(client.request(Hello(node=info, token="t-1")).body, Welcome)
        assert "worker-1" in expire_now(node)

        real_time = time.time
        for step_s in (3600.0, -3600.0):  # the wall clock jumps an hour ahead, then an hour back
            monkeypatch.setattr(time, "time", lambda step_s=step_s: real_time() + step_s)
            assert "worker-1" in expire_now(node), f"a wall-clock step of {step_s:+.0f}s expired the node"
        monkeypatch.setattr(time, "time", real_time)

        # A heartbeat within the timeout (liveness clock) keeps it; silence beyond it removes it.
        advance(node, clock, NODE_TIMEOUT_S * 0.75)
        assert isinstance(client.request(Heartbeat(node_id="worker-1")).body, Ok)
        advance(node, clock, NODE_TIMEOUT_S * 0.75)
        assert "worker-1" in expire_now(node)
        seen = on_loop(node, lambda: node.members["worker-1"].info.last_seen)
        assert abs(seen - time.time()) < 60  # the displayed last-seen stays wall-clock time
        advance(node, clock, NODE_TIMEOUT_S * 1.5)
        assert "worker-1" not in expire_now(node)
    finally:
        client.close()
        ctx.term()


def test_pub_handshakes_whose_probe_never_comes_are_answered_an_error_and_forgotten(
    broker: tuple[Broker, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``sync{path=pub}`` waits for its probe on the PUB path. One whose probe never comes (a join that timed
    out, a broken or hostile client) is answered ``sync-expired`` and forgotten: after the horizon on the broker's
    clock, or at once, the oldest first, when too many wait."""
    node, clock = broker
    ctx = zmq.Context()
    client = Client(ctx, node.runtime.endpoints["control"], WireCodec("asker"))

    def waiting(tokens: list[str]) -> None:
        wait_for(lambda: on_loop(node, lambda: list(node.waiting)) == tokens, WAIT_S, f"waiting: {tokens}")

    def expired(count: int) -> set[str]:
        """The ids the next ``count`` replies answer, each ``sync-expired``."""
        answered = set()
        for _ in range(count):
            reply = client.recv(int(WAIT_S * 1000))
            assert reply is not None, "no answer to a handshake the broker gave up"
            assert isinstance(reply.body, Error) and reply.body.code == "sync-expired", reply.body
            answered.add(reply.header.re)
        return answered

    try:
        old = [client.send(Sync(token=f"t-{i}", path="pub")) for i in range(2)]
        waiting(["t-0", "t-1"])
        advance(node, clock, bus_broker.TOKEN_HORIZON_S / 2)
        recent = client.send(Sync(token="t-2", path="pub"))
        waiting(["t-0", "t-1", "t-2"])
        advance(node, clock, bus_broker.TOKEN_HORIZON_S / 2 + 1)
        expire_now(node)
        assert expired(2) == set(old)
        waiting(["t-2"])  # asked within the horizon: it still waits

        monkeypatch.setattr(bus_broker, "WAITING_MAX", 3)
        for i in range(3, 6):
            client.send(Sync(token=f"t-{i}", path="pub"))
        assert expired(1) == {recent}  # the fourth waiting pushed the oldest out
        waiting(["t-3", "t-4", "t-5"])
    finally:
        client.close()
        ctx.term()


def test_the_same_id_and_pid_with_another_start_time_is_a_restart(
        broker: tuple[Broker, FakeClock], monkeypatch: pytest.MonkeyPatch) -> None:
    """A node SIGKILLed and restarted within the node timeout says hello again under its id; in a container its
    pid is 1 both times. The start time tells the new process: the old one, silent for half the node timeout (a
    predecessor dying), goes down (``replaced``) and the new one comes up, so peers drop the old endpoints and
    learn the new ones."""
    node, clock = broker
    control = node.runtime.endpoints["control"]
    events: queue.Queue[Message] = queue.Queue()
    watcher = NodeRuntime("watcher", RuntimeSettings(bus=control, node_id="watcher", metrics_port=-1))
    watcher.subscribe(events.put, kinds=frozenset({NodeUp.kind, NodeDown.kind}))
    first = NodeRuntime("worker", RuntimeSettings(bus=control, node_id="worker", metrics_port=-1))
    second = NodeRuntime("worker", RuntimeSettings(bus=control, node_id="worker", metrics_port=-1))
    second.started = first.started + 1.0  # the same host and pid: only the start time differs
    monkeypatch.setattr(first, "_heartbeat", lambda: None)  # it beats no more: its process died, in effect
    started: list[NodeRuntime] = []

    def next_about_worker() -> Message:
        while True:
            event = events.get(timeout=WAIT_S)
            body = event.body
            if (body.node.node_id if isinstance(body, NodeUp) else body.node_id) == "worker":
                return event

    try:
        for runtime in (watcher, first):
            runtime.start_background()
            started.append(runtime)
        up = next_about_worker().body
        assert isinstance(up, NodeUp) and up.node.started == first.started
        advance(node, clock, 0.75 * NODE_TIMEOUT_S)  # past half the node timeout since the hello: not yet expired
        second.start_background()  # the restarted process; the first never said bye
        started.append(second)
        down, up = next_about_worker().body, next_about_worker().body
        assert isinstance(down, NodeDown) and down.reason == "replaced"
        assert isinstance(up, NodeUp) and up.node.started == second.started and up.node.pid == first.info().pid
    finally:
        for runtime in reversed(started):  # the second first: its bye removes the entry, the first's then nothing
            runtime.join(WAIT_S)


def test_an_id_goes_to_another_process_only_once_its_holder_is_silent_on_the_liveness_clock(
        broker: tuple[Broker, FakeClock]) -> None:
    """Another process asking for a held id is asked to wait (``retry_after_s``) while the holder was heard within
    half the node timeout; a holder heard after that ask (a heartbeat that arrived after it, past a liveness pass
    that read the control queue empty) is live, and the asker is refused for good; a holder silent past half the
    node timeout is a predecessor dying, and the asker takes the id (the holder goes down, ``replaced``, before it
    is expired)."""
    node, clock = broker
    ctx = zmq.Context()
    client = Client(ctx, node.runtime.endpoints["control"], WireCodec("worker"),
                    policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))

    def hello(pid: int) -> Welcome | RemoteError:
        try:
            return client.request(Hello(node=NodeInfo(node_id="worker", role="worker", host="h", pid=pid),
                                        token=f"t-{pid}")).body
        except RemoteError as exc:
            assert exc.code == ID_IN_USE
            return exc

    try:
        assert isinstance(hello(1), Welcome)
        advance(node, clock, NODE_TIMEOUT_S * 0.25)
        assert hello(2).retry_after_s > 0  # heard a moment ago: dying or live, its next heartbeat tells
        advance(node, clock, NODE_TIMEOUT_S * 0.125)
        assert hello(2).retry_after_s > 0  # not heard since the ask, not silent for long yet
        expire_now(node)  # read the control queue empty: what comes next arrived after the ask
        assert isinstance(client.request(Heartbeat(node_id="worker")).body, Ok)
        assert hello(2).retry_after_s == 0  # heard after the ask: live
        assert hello(3).retry_after_s > 0  # a new asker is asked to wait again
        advance(node, clock, NODE_TIMEOUT_S * 0.75)
        assert isinstance(hello(3), Welcome)  # silent for three quarters of the node timeout: dying
        assert on_loop(node, lambda: node.members["worker"].info.pid) == 3
    finally:
        client.close()
        ctx.term()


def test_restarts_are_counted_per_node_slot_whatever_the_node_ids(broker: tuple[Broker, FakeClock]) -> None:
    """Default node ids hold the pid, so a node restarting in a loop comes up under a new id each time and its
    per-id join count never passes 1. The broker gives each node up on a host a slot of its role there, and a
    node coming up takes back the slot of the latest departure there: a worker restarted four times under new pids
    (once up before its predecessor left: a new slot, and the next join there takes the old one back) is 4
    restarts of one slot, what ``RefbusNodeRestartLoop`` fires on; a world of four ranks restarted once, the
    normal recovery, is one restart of each of four slots, which it does not; env servers that came up once and
    left cleanly are none. Each slot's series is there at 0 from its first node up, so Prometheus sees the first
    restart as an increase (it takes a series' first sample as its start)."""
    node, _ = broker
    control = node.runtime.endpoints["control"]

    def started(role: str, node_id: str, host: str) -> NodeRuntime:
        runtime = NodeRuntime(role, RuntimeSettings(bus=control, node_id=node_id, host=host, metrics_port=-1))
        runtime.start_background()
        wait_for(lambda: on_loop(node, lambda: node_id in node.members and node.members[node_id].live), WAIT_S,
                 f"{node_id} live")
        return runtime

    healthy = [started("env-server", f"env-server-h1-{pid}", "h1") for pid in (10, 11, 12)]
    world = [started("trainer", f"trainer-{rank}", "h2") for rank in range(4)]
    previous = started("worker", "worker-h1-100", "h1")
    try:
        assert on_loop(node, lambda: dict(node.restarts)) == {
            **{("env-server", "h1", str(slot)): 0 for slot in range(3)},
            **{("trainer", "h2", str(slot)): 0 for slot in range(4)}, ("worker", "h1", "0"): 0}
        for runtime in world:  # the world ends and is restarted from its checkpoint, under the same rank ids
            runtime.join(WAIT_S)
        world = [started("trainer", f"trainer-{rank}", "h2") for rank in range(4)]
        for pid in (101, 102, 103):  # crashed (its bye still sent) and restarted under a new pid
            previous.join(WAIT_S)
            previous = started("worker", f"worker-h1-{pid}", "h1")
        overlapping = started("worker", "worker-h1-104", "h1")  # up before its predecessor is gone
        previous.join(WAIT_S)
        previous = started("worker", "worker-h1-105", "h1")  # overlapping's restart, it too up before it left
        overlapping.join(WAIT_S)
        for runtime in healthy:
            runtime.join(WAIT_S)
        assert on_loop(node, lambda: dict(node.restarts)) == {
            **{("env-server", "h1", str(slot)): 0 for slot in range(3)},
            **{("trainer", "h2", str(slot)): 1 for slot in range(4)},
            ("worker", "h1", "0"): 4, ("worker", "h1", "1"): 0}
    finally:
        for runtime in [previous, *world, *healthy]:
            runtime.join(WAIT_S)


def test_restarts_counted_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host a node names is a key: past ``RESTARTS_MAX`` (role, host) pairs, and as many (role, host, slot)
    series, the least recently counted are forgotten, so nodes naming ever new hosts cannot grow them for good."""
    monkeypatch.setattr(bus_broker, "RESTARTS_MAX", 2)
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK))
    prober = WireCodec("prober")
    try:
        def cycle(node_id: str, host: str) -> None:
            """``node_id`` comes up on ``host`` and goes down."""
            info = NodeInfo(node_id=node_id, role="worker", host=host, pid=1)
            node.members[node_id] = bus_broker._Member(info, f"join-{node_id}", 0.0)
            node._probe_seen(prober.encode(Sync(token=f"join-{node_id}")))
            node._remove(node.members[node_id], "timeout")

        one_vacant = bus_broker._Slots(given=1, vacant=[0])
        for i in range(5):
            cycle(f"a-{i}", "a")
        assert (node.restarts, node.slots) == ({("worker", "a", "0"): 4}, {("worker", "a"): one_vacant})
        for i in range(10):  # hosts named by a peer, each restarted once
            cycle(f"garbage-{i}-0", f"host-{i}")
            cycle(f"garbage-{i}-1", f"host-{i}")
        cycle("a-5", "a")  # its slots were forgotten: counted again from its next departure
        cycle("a-6", "a")
        assert (node.restarts, node.slots) == ({("worker", "host-9", "0"): 1, ("worker", "a", "0"): 1},
                                               {("worker", "host-9"): one_vacant, ("worker", "a"): one_vacant})
    finally:
        runtime.close()


def test_time_the_broker_did_not_run_counts_toward_no_nodes_silence(broker: tuple[Broker, FakeClock]) -> None:
    """A liveness pass that comes more than a period late is a broker whose loop did not run (stopped, swapped out,
    starved): that time is credited to every node, so it expires none at its wake-up before their heartbeats can
    come; silence after it counts as ever. Before, every node was expired at the first pass."""
    node, clock = broker
    info = NodeInfo(node_id="worker-1", role="worker", host="localhost", pid=1)

    def stall() -> None:
        node._expire()
        node.members["worker-1"] = bus_broker._Member(info, "t-1", clock.now - 0.5 * NODE_TIMEOUT_S, live=True)
        clock.now += 3 * NODE_TIMEOUT_S  # no pass ran meanwhile

    on_loop(node, stall)
    assert "worker-1" in expire_now(node)
    assert on_loop(node, lambda: node.passes.stalled_s) == pytest.approx(3 * NODE_TIMEOUT_S - node.passes.period_s)
    advance(node, clock, 0.25 * NODE_TIMEOUT_S)
    assert "worker-1" in expire_now(node)  # silent half a node timeout before the stall, a quarter after it
    advance(node, clock, 0.5 * NODE_TIMEOUT_S)
    assert "worker-1" not in expire_now(node)


def test_requests_and_events_that_keep_coming_hold_neither_the_liveness_pass_nor_a_replay() -> None:
    """Before judging liveness the broker reads the heartbeats queued behind a busy loop, and before a replay what
    its capture holds. Both reads are bounded: requests (or events) arriving faster than the broker handles them
    used to keep it reading for good, its capture and probes undrained and no node ever expired."""
    clock = FakeClock()
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK,
                                          node_timeout_s=NODE_TIMEOUT_S), clock=clock)
    endless = 1_000_000  # reads past this many never end
    try:
        handled: list[int] = []

        def one_more_request(flags: int = 0) -> None:  # the queue is never empty
            handled.append(flags)
            if len(handled) > endless:
                raise RuntimeError("the liveness pass kept reading requests")

        node.server.handle_one = one_more_request  # type: ignore[method-assign]
        info = NodeInfo(node_id="worker-1", role="worker", host="localhost", pid=1)
        node.members["worker-1"] = bus_broker._Member(info, "t-1", clock.now - 2 * NODE_TIMEOUT_S, live=True)
        node._expire()
        assert len(handled) == bus_broker.EXPIRE_DRAIN and "worker-1" not in node.members

        assert node.forwarder is not None
        drains: list[int] = []

        def full_capture(on_events: Callable[[list, list[int]], None], budget: int = 4096) -> int:
            drains.append(budget)
            if len(drains) * budget > endless:
                raise RuntimeError("the replay kept draining the capture")
            return budget  # as many as asked: more keep coming

        node.forwarder.drain = full_capture  # type: ignore[method-assign]
        node._catch_up()
        batch = bus_broker.CAPTURE_BATCH
        assert len(drains) * batch >= CAPTURE_HWM > (len(drains) - 1) * batch  # all the capture can hold, no more
    finally:
        runtime.close()


def test_probe_tokens_seen_and_the_joins_counted_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node's PUB handshake probes, and every node id (the default ones hold the pid, so a restart brings a
    new one), reach the broker: it keeps the latest ``SEEN_MAX`` probe tokens, and the joins of ``JOINS_MAX``
    (node id, role) pairs, forgetting the oldest joined of the nodes not registered now."""
    monkeypatch.setattr(bus_broker, "SEEN_MAX", 5)
    monkeypatch.setattr(bus_broker, "JOINS_MAX", 3)
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK))
    prober = WireCodec("prober")
    try:
        for i in range(20):
            node._probe_seen(prober.encode(Sync(token=f"t-{i}")))
        node._probe_seen(prober.encode(Sync(token="t-16")))  # seen again: the latest
        assert list(node.seen_tokens) == ["t-15", "t-17", "t-18", "t-19", "t-16"]

        def join(node_id: str) -> None:
            info = NodeInfo(node_id=node_id, role="worker", host="localhost", pid=1)
            node.members[node_id] = bus_broker._Member(info, f"join-{node_id}", 0.0)
            node._probe_seen(prober.encode(Sync(token=f"join-{node_id}")))

        join("stays")  # registered all along: its count is never forgotten
        for i in range(10):
            join(f"worker-{i}")
            node._remove(node.members[f"worker-{i}"], "bye")
        join("stays")
        assert dict(node.joins) == {("worker-8", "worker"): 1, ("worker-9", "worker"): 1, ("stays", "worker"): 2}
    finally:
        runtime.close()


class _GrowsItsDict:
    """A count whose reading adds a key to the dict it is in: what the loop thread may do while the metrics HTTP
    thread reads that dict (a scrape that iterates the live dict then fails with "changed size")."""

    def __init__(self, counts: dict[Any, Any], key: Callable[[int], Any], value: float = 1.0) -> None:
        self.counts, self.key, self.value = counts, key, value

    def grow(self) -> None:
        self.counts[self.key(len(self.counts))] = 0

    def __float__(self) -> float:
        self.grow()
        return self.value

    def __add__(self, other: int) -> float:
        self.grow()
        return self.value + other

    __radd__ = __add__


class _MemberThatJoinsAnother:
    """A registry entry whose liveness, read, registers another node (a hello on the loop thread meanwhile)."""

    def __init__(self, members: dict[str, Any], role: str) -> None:
        self.members, self.info = members, NodeInfo(node_id=f"n-{len(members)}", role=role, host="h", pid=1)

    @property
    def live(self) -> bool:
        self.members[f"other-{len(self.members)}"] = bus_broker._Member(self.info, "t", 0.0)
        return True


def test_metric_readers_read_copies_of_what_the_loop_thread_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics are read on the HTTP thread while the loop thread changes the registry and the counters: every
    reader of a dict reads a copy of it, so a change meanwhile never fails the scrape."""
    readers: dict[str, Callable[[], dict[tuple[str, ...], float]]] = {}

    def capture(name: str, doc: str, read: Callable[[], Any], **_: Any) -> None:
        readers[name] = read

    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    runtime.metric = capture  # type: ignore[method-assign]
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK))
    monkeypatch.setattr(bus_runtime, "serve_metrics", lambda host, port: ("http://127.0.0.1:1/metrics", lambda: None))
    try:
        runtime.settings = dataclasses.replace(runtime.settings, metrics_port=0)
        runtime._serve_metrics()
        node.dropped["malformed"] = _GrowsItsDict(node.dropped, lambda n: f"code-{n}")  # type: ignore[assignment]
        node.joins[("w", "worker")] = _GrowsItsDict(node.joins, lambda n: (f"w-{n}", "worker"))  # type: ignore[assignment]
        node.restarts[("worker", "h", "0")] = _GrowsItsDict(node.restarts, lambda n: ("worker", f"h-{n}", "0"))  # type: ignore[assignment]
        node.members["w"] = _MemberThatJoinsAnother(node.members, "worker")  # type: ignore[assignment]
        calls = runtime.calls
        calls.outcomes["reply"] = _GrowsItsDict(calls.outcomes, lambda n: f"outcome-{n}")  # type: ignore[assignment]
        calls.rejected["malformed"] = _GrowsItsDict(calls.rejected, lambda n: f"code-{n}")  # type: ignore[assignment]
        servers = runtime._servers
        for server in servers:  # two counters merged: the second is added key by key
            server.handled["sync"] = _GrowsItsDict(server.handled, lambda n: f"kind-{n}")  # type: ignore[assignment]
        servers.append(servers[0])
        assert readers["refbus_bus_events_dropped_total"]()[("malformed",)] == 1.0
        assert readers["refbus_bus_joins_total"]()[("w", "worker")] == 1.0
        assert readers["refbus_bus_restarts_total"]()[("worker", "h", "0")] == 1.0
        assert readers["refbus_bus_nodes"]() == {("worker",): 1}
        assert readers["refbus_request_outcomes_total"]()[("reply",)] == 1.0
        assert readers["refbus_replies_rejected_total"]()[("malformed",)] == 1.0
        assert readers["refbus_requests_total"]()[("sync",)] == 2.0
    finally:
        runtime.close()


def test_oversized_registrations_are_refused_and_a_registry_answer_always_fits_the_body_limit() -> None:
    """Regression: ``NodeInfo`` had no bounds, so two ``hello``s with ~9 MiB of labels each made every ``nodes``
    answer larger than the body limit: refused, and every node's lookups failed while the sender heartbeated.
    Now a registration or heartbeat over the schema's bounds is refused ``schema``; entries within them that
    together would not fit are cut from the answer, the largest first (counted in ``omitted``), which a node's
    lookup takes for no answer (never for a list of the live nodes); and a runtime fits the status numbers a
    role adds to its heartbeats."""
    limits = Limits(max_body_bytes=256 << 10)  # small, so that a few registrations within the bounds exceed it
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1, limits=limits), register=False)
    node = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK,
                                          node_timeout_s=60.0))
    runtime.start_background()
    control = runtime.endpoints["control"]
    victim = NodeRuntime("worker", RuntimeSettings(bus=control, node_id="victim", metrics_port=-1, limits=limits))
    ctx = zmq.Context()
    codec = WireCodec("fat", limits=limits)
    client = Client(ctx, control, codec, policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    pub = make_socket(ctx, zmq.PUB, connect=runtime.endpoints["events_in"], options=EVENT_OPTIONS)
    try:
        victim.start()

        def refused(body: Any) -> str:
            with pytest.raises(RemoteError) as info:
                client.request(body)
            assert info.value.code == "schema", info.value
            return info.value.detail

        many = {f"k{i}": "v" for i in range(65)}  # a node's endpoints, labels and status hold 64 entries at most
        assert "length <= 64 - at `$.node.labels`" in refused(
            Hello(node=NodeInfo(node_id="fat-x", role="worker", host="h", pid=1, labels=many), token="t-x"))
        assert "length <= 4096 - at `$.node.endpoints[...]`" in refused(
            Hello(node=NodeInfo(node_id="fat-y", role="worker", host="h", pid=1, endpoints={"e": "x" * 4097}),
                  token="t-y"))
        assert "length <= 64 - at `$.status`" in refused(
            Heartbeat(node_id="victim", status={name: 1.0 for name in many}))
        assert on_loop(node, lambda: sorted(node.members)) == ["victim"]

        # Five registrations within the bounds, ~64 KB each: together over the 256 KiB body limit. fat-0's
        # entry is the largest.
        for i in range(5):
            labels = {f"label-{j}": ("x" if i else "y") * (4096 if i == 0 else 4000) for j in range(16)}
            info = NodeInfo(node_id=f"fat-{i}", role="worker", host="h", pid=1, labels=labels)
            assert isinstance(client.request(Hello(node=info, token=f"fat-{i}")).body, Welcome)

        def all_live() -> bool:
            for i in range(5):  # probes until the PUB's connection carries them
                pub.send_multipart(codec.encode(Sync(token=f"fat-{i}"), one_frame=True))
            return on_loop(node, lambda: sum(member.live for member in node.members.values())) == 6

        wait_for(all_live, WAIT_S, "every registration live")
        answer = client.request(Nodes()).body
        assert isinstance(answer, NodeList)
        listed = sorted(info.node_id for info in answer.nodes)
        assert listed == ["fat-1", "fat-2", "fat-3", "fat-4", "victim"] and answer.omitted == 1, answer.omitted
        assert len(msgspec.msgpack.encode(answer)) <= limits.max_body_bytes
        # A cut list is no answer to a node: it would take the nodes left out for gone (a restarted broker's
        # reconciliation, a restarted store's check of its holders). Its lookup fails, logged, as an unanswered
        # one does; the registry itself goes on serving (the heartbeat below).
        with capture_logs() as logs:
            assert victim.lookup("worker") is None
        assert [entry.get("omitted") for entry in logs if entry["event"] == "registry.lookup_failed"] == [1]

        victim.status = lambda: {**{f"n{i}": float(i) for i in range(100)}, "x" * 300: 1.0}
        status = victim._beat_status()
        assert status == {f"n{i}": float(i) for i in range(64)}
        assert isinstance(victim.broker().request(Heartbeat(node_id="victim", status=status)).body, Ok)
    finally:
        pub.close()
        client.close()
        ctx.term()
        victim.close()
        runtime.join(WAIT_S)


def test_a_metrics_url_sd_cannot_list_is_refused_and_never_holds_the_other_targets_out(
    broker: tuple[Broker, FakeClock],
) -> None:
    """Regression: the broker built its /sd answer from every live member's ``metrics`` with urlsplit, which raises
    on some (``http://[::1``): while such a node was live every rebuild raised, so /sd never changed again, and the
    node-up, bye or expiry that rebuilt it failed after its member was removed (a bye was answered ``internal``).
    Now a hello whose metrics URL /sd could not list is refused ``schema`` (the node is not registered), and a
    rebuild lists only the endpoints accepted at hello, so a member that got in anyway is left out, every other
    listed."""
    node, _ = broker
    ctx = zmq.Context()
    client = Client(ctx, node.runtime.endpoints["control"], WireCodec("sd-peer"),
                    policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))

    def info(node_id: str, metrics: str) -> NodeInfo:
        return NodeInfo(node_id=node_id, role="worker", host="h", pid=1, metrics=metrics)

    def listed() -> list[str]:
        return sorted(group["labels"]["node"] for group in node.service_discovery())

    try:
        for bad in ("http://[::1", "http://h:99999/metrics", "http://h:port/metrics", "ftp://h:1/metrics",
                    "h:1/metrics", "http:///metrics"):
            with pytest.raises(RemoteError) as refused:
                client.request(Hello(node=info("sd-bad", bad), token="t-bad"))
            assert refused.value.code == "schema" and "hello.node.metrics" in refused.value.detail, refused.value
        assert on_loop(node, lambda: list(node.members)) == []

        for node_id in ("sd-a", "sd-b"):
            hello = Hello(node=info(node_id, "http://127.0.0.1:9/metrics"), token=node_id)
            assert isinstance(client.request(hello).body, Welcome)

        def let_one_in_and_rebuild() -> list[str]:
            # As if a registration had got past hello: live, with a URL /sd cannot list.
            node.members["sd-bad"] = bus_broker._Member(info("sd-bad", "http://[::1"), "t-bad", node.clock())
            for member in node.members.values():
                member.live = True
            node._refresh_targets()
            return listed()

        assert on_loop(node, let_one_in_and_rebuild) == ["sd-a", "sd-b"]
        assert isinstance(client.request(Bye(node_id="sd-a")).body, Ok)
        assert listed() == ["sd-b"]
    finally:
        client.close()
        ctx.term()


def test_sd_lists_a_metrics_endpoint_only_at_the_address_its_node_connects_from(
    broker: tuple[Broker, FakeClock],
) -> None:
    """Regression: /sd listed whatever host:port a hello's metrics URL named, so any node that registered made the
    cluster's Prometheus scrape any host it chose (a cloud metadata address, an internal service). The broker now
    lists an endpoint only at the address the node's connection comes from, or, for a node on the broker's
    machine, at an address of that machine (a host name when every address it resolves to is one, resolved off
    the loop thread): a node that names another host stays registered, unlisted, and ``sd.target_refused`` says
    why; honest nodes registered after it are listed."""
    node, _ = broker
    ctx = zmq.Context()
    client = Client(ctx, node.runtime.endpoints["control"], WireCodec("sd-peer"),
                    policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    prober = WireCodec("prober")

    def join(node_id: str, metrics: str) -> None:
        hello = Hello(node=NodeInfo(node_id=node_id, role="worker", host="h", pid=1, metrics=metrics), token=node_id)
        assert isinstance(client.request(hello).body, Welcome)
        on_loop(node, lambda: node._probe_seen(prober.encode(Sync(token=node_id))))  # its PUB proven: live

    def listed() -> dict[str, list[str]]:
        return {group["labels"]["node"]: group["targets"] for group in node.service_discovery()}

    try:
        with capture_logs() as logs:
            join("sd-foreign", "http://192.0.2.1:9100/metrics")  # TEST-NET-1: no address of this machine
            join("sd-metadata", "http://169.254.169.254/latest/meta-data")
            join("sd-loopback", "http://127.0.0.1:9/metrics")
            join("sd-named", "http://localhost:9/metrics")
            wait_for(lambda: "sd-named" in listed(), WAIT_S, "the endpoint named by a host name listed once resolved")
        assert listed() == {"sd-loopback": ["127.0.0.1:9"], "sd-named": ["localhost:9"]}
        refused = {entry["node"]: entry["error"] for entry in logs if entry["event"] == "sd.target_refused"}
        assert refused.keys() == {"sd-foreign", "sd-metadata"}, refused
        assert "'192.0.2.1' is not an address of this machine" in refused["sd-foreign"]
        answer = client.request(Nodes()).body  # registered all the same, and the broker serves on
        assert isinstance(answer, NodeList) and {n.node_id for n in answer.nodes} == {
            "sd-foreign", "sd-metadata", "sd-loopback", "sd-named"}
    finally:
        client.close()
        ctx.term()


def test_a_metrics_host_is_the_nodes_own_address_or_for_a_node_on_this_machine_one_of_its() -> None:
    """What /sd accepts of a node on another host, whose connection ZeroMQ names by its address, and of one on the
    broker's machine (loopback, or ipc, which ZeroMQ names ``localhost:...``); of a connection it names no address
    for, nothing."""
    remote = "192.0.2.7"
    assert bus_broker.metrics_host_problem([remote], remote) == ""
    assert bus_broker.metrics_host_problem([remote], f"::ffff:{remote}") == ""  # an IPv4 peer of a dual-stack socket
    # Another host, the broker's own loopback, a name that resolves to one more address than the node's own.
    for elsewhere in (["192.0.2.8"], ["127.0.0.1"], [remote, "192.0.2.8"]):
        assert "is not the node's own address" in bus_broker.metrics_host_problem(elsewhere, remote), elsewhere
    assert "is not the node's own address" in bus_broker.resolved_problem("localhost", remote)
    for local in ("127.0.0.1", "::1", "localhost:0:0:4242"):
        assert bus_broker.metrics_host_problem(["127.0.0.1", "::1"], local) == ""
        assert bus_broker.resolved_problem("localhost", local) == ""
        assert "is not an address of this machine" in bus_broker.metrics_host_problem(["192.0.2.8"], local)
    assert "is not the node's own address" in bus_broker.metrics_host_problem(["127.0.0.1"], "")  # named none


def test_a_dual_stack_metrics_host_name_is_checked_in_the_family_of_the_nodes_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's host name that resolves to an IPv4 and an IPv6 address (dual-stack DNS) is accepted over either
    family when every address of that family is the node's own; one more address of that family elsewhere, or
    none of it, is refused."""
    records = {"gpu-node-7.cluster": ["198.18.20.7", "fd00:20::7"], "two-hosts.cluster": ["198.18.20.7", "198.18.20.8",
               "fd00:20::7"], "v6-only.cluster": ["fd00:20::7"]}

    def getaddrinfo(host: str, port: None, **_: Any) -> list[tuple[Any, ...]]:
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
                for a in records[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for peer in ("198.18.20.7", "::ffff:198.18.20.7", "fd00:20::7"):
        assert bus_broker.resolved_problem("gpu-node-7.cluster", peer) == "", peer
    assert "'198.18.20.8' is not the node's own address" in bus_broker.resolved_problem("two-hosts.cluster",
                                                                                       "198.18.20.7")
    assert "resolves to no IPv4 address" in bus_broker.resolved_problem("v6-only.cluster", "198.18.20.7")
