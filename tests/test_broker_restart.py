"""The broker can die. SIGKILLed and started again on the same addresses (what `refbus up` does, or an
operator), it is back in service at the nodes' next heartbeats: every node re-joins by itself and the registry
is rebuilt from those re-joins; requests between nodes (keep, claim, fetch, delete) go on while it is down; a
subscriber resumes, and the events the dead broker held in flight are recovered from their publisher's refill
of the new ring, with or without a later event to reveal the gap. What a publisher no longer holds is counted
lost (metric and log line), never missing silently: every event published is either delivered or counted."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import FAST_LIVENESS
from polling import all_stopped, wait_for
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.peers import ABSENT_AFTER_RESTART
from refbus.bus.reqrep import Client, HandlerError, Outcome, PeerDown, RequestTimeout, RetryPolicy, Server
from refbus.bus.runtime import FILL_SHARE, BusUnavailable, NodeRuntime, RuntimeSettings
from refbus.bus.sockets import RECONNECT_IVL_MAX_MS, make_socket
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    Blobs,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Fetch,
    Heartbeat,
    Hello,
    NodeDown,
    NodeInfo,
    RunEnd,
)
from test_liveness import (  # noqa: F401
    HEARTBEAT_S,
    NODE_TIMEOUT_S,
    START_S,
    ServedPeer,
    client,
    env_server,
    keep,
    sigkill,
)

QUICK = RetryPolicy(timeout_s=HEARTBEAT_S, attempts=1)
IN_FLIGHT = 50  # events published while the broker is frozen: some are in its socket buffers when it dies
HELD_FEW = 10  # a publisher holding fewer events than the dead broker took


def node(control: str, node_id: str, **settings: Any) -> NodeRuntime:
    return NodeRuntime("tester", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                 heartbeat_interval_s=HEARTBEAT_S, **settings))


def restart_bus(workdir: Path, endpoints: dict[str, str]) -> NodeProcess:
    """A broker bound to the addresses a dead one bound (its registry entry's ``endpoints``)."""
    bus = NodeProcess(["node", "bus", "--bus-control", endpoints["control"], "--bus-events-in",
                       endpoints["events_in"], "--bus-events-out", endpoints["events_out"], "--bus-metrics-port", "0",
                       *FAST_LIVENESS], workdir=workdir, name="bus")
    bus.wait_ready(START_S)
    return bus


def in_process_bus(endpoints: dict[str, str] | None = None) -> NodeRuntime:
    """A broker on this process's threads (fast to start and stop; its loop in a thread), on ephemeral loopback
    ports or on ``endpoints`` (a dead one's), with the FAST_LIVENESS heartbeat and node timeout."""
    ends = endpoints or dict.fromkeys(("control", "events_in", "events_out"), "tcp://127.0.0.1:0")
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1, heartbeat_interval_s=HEARTBEAT_S),
                          register=False)
    Broker(runtime, BrokerSettings(control=ends["control"], events_in=ends["events_in"],
                                   events_out=ends["events_out"], node_timeout_s=NODE_TIMEOUT_S))
    runtime.start_background()
    return runtime


def received_unread(port: int) -> int:
    """Bytes the kernel holds for the reader of established loopback TCP connections on local ``port``."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, state, queues = int(fields[1].split(":")[1], 16), fields[3], fields[4]
        if local_port == port and state == "01":
            total += int(queues.split(":")[1], 16)
    return total


@pytest.fixture
def nodes() -> Iterator[list[NodeRuntime]]:
    started: list[NodeRuntime] = []
    yield started
    for runtime in reversed(started):
        runtime.join(timeout=START_S)


@pytest.mark.parametrize(("held", "later"), [(IN_FLIGHT + 3, True), (IN_FLIGHT + 3, False), (HELD_FEW, True)],
                         ids=["held-then-later-event", "held-no-later-event", "mostly-not-held"])
def test_a_killed_broker_restarted_on_its_addresses_is_back_in_service_and_every_event_is_delivered_or_counted(
        tmp_path: Path, spawn: Callable[..., NodeProcess], client: Callable[[str], Client],  # noqa: F811
        nodes: list[NodeRuntime], held: int, later: bool) -> None:
    """``held``: events the publisher holds for a refill (all it published, or only the last few); ``later``:
    whether it publishes again after the restart (revealing the gap) or not (its probes carry the tail)."""
    first, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    buses = [first]
    asker = NodeRuntime("asker", RuntimeSettings(bus=control, node_id="asker", metrics_port=-1), register=False)
    try:
        endpoints = first.info["endpoints"]
        _, blobs = env_server(spawn, control, "env-x")
        publisher, subscriber = node(control, "pub", held_events=held), node(control, "sub")
        delivered: queue.Queue[Message] = queue.Queue()
        subscription = subscriber.subscribe(delivered.put, kinds=frozenset({RunEnd.kind}))
        nodes += [publisher, subscriber]
        for runtime in nodes:
            runtime.start_background()

        def registered() -> set[str]:
            return {n.node_id for n in asker.lookup(policy=QUICK) or ()}

        def publish(count: int) -> None:
            for step in range(count):
                publisher.call_soon(lambda step=step: publisher.publish(RunEnd(reason="tick", steps=step)))

        publish(3)
        seqs = [delivered.get(timeout=START_S).header.seq for _ in range(3)]
        assert seqs == [1, 2, 3]

        # Freeze the broker so what it receives stays unread in its sockets, then kill it.
        first.signal(signal.SIGSTOP)
        wait_for(lambda: all_stopped(first.pid), START_S, "every thread of the broker stopped")
        publish(IN_FLIGHT)
        port = int(endpoints["events_in"].rsplit(":", 1)[1])
        # Half the events' bytes, unread: ZeroMQ's own heartbeats on the other connections are a few bytes.
        event_bytes = len(WireCodec("pub").encode(RunEnd(reason="tick", steps=0), seq=1, one_frame=True)[0])
        wait_for(lambda: received_unread(port) >= IN_FLIGHT * event_bytes // 2, START_S,
                 "events waiting in the frozen broker's socket")
        first.proc.kill()
        first.proc.wait()

        # Requests between nodes go on without a broker.
        store = client(blobs)
        blob_ids = keep(store, "ep-1", 2)
        claimed = store.request(Claim(blob_ids=blob_ids, holder="tester")).body
        assert isinstance(claimed, Claimed) and claimed.missing == []
        fetched = store.request(Fetch(blob_ids=blob_ids, holder="tester")).body
        assert isinstance(fetched, Blobs) and [b.blob_id for b in fetched.blobs] == blob_ids
        deleted = store.request(Delete(blob_ids=blob_ids, holder="tester", reason="trained")).body
        assert isinstance(deleted, Deleted) and deleted.blob_ids == blob_ids
        assert registered() == set()  # the registry is gone with the broker

        buses.append(restart_bus(tmp_path, endpoints))
        back = time.monotonic()
        # Every node re-joins at its next heartbeat (bounded here by a process start on a loaded machine).
        wait_for(lambda: registered() == {"env-x", "pub", "sub"}, START_S, "every node registered again")
        print(f"registry rebuilt {time.monotonic() - back:.2f}s after the new broker was ready "
              f"(heartbeat interval {HEARTBEAT_S}s)")
        assert publisher.broker_restarts == subscriber.broker_restarts == 1

        # The stream resumes: what the dead broker held comes from the publisher's refill of the new ring, and
        # what the publisher no longer held is counted lost where the subscriber sees the gap.
        if later:
            publish(1)
        last = 3 + IN_FLIGHT + int(later)
        got = [delivered.get(timeout=START_S)]
        while got[-1].header.seq != last:
            got.append(delivered.get(timeout=START_S))
        lost = subscription.lost["pub"]
        assert [m.header.seq for m in got] == sorted(m.header.seq for m in got)
        # The resumption took the whole new ring while live copies of its newest events could wait in the socket:
        # those are duplicates, never replays.
        assert not subscription.rejected, subscription.rejected
        assert len(got) + lost == last - 3, (len(got), lost)
        # A publisher holds whole messages: a batch that crosses ``held`` is kept whole.
        refilled = publisher.refilled
        assert min(held, 3 + IN_FLIGHT) <= refilled <= 3 + IN_FLIGHT
        if refilled == 3 + IN_FLIGHT:  # all held: nothing lost
            assert [m.header.seq for m in got] == list(range(4, last + 1)) and subscription.lost.total() == 0
        else:  # the frozen broker's unread events cannot have reached the subscriber: older than held, lost
            assert lost == IN_FLIGHT - refilled and [m.header.seq for m in got] == list(range(4 + lost, last + 1))
    finally:
        asker.close()
        while nodes:  # before the broker: their goodbyes reach it
            nodes.pop().join(timeout=START_S)
        for bus in buses:
            if bus.proc.poll() is None:
                os.kill(bus.pid, signal.SIGCONT)
            bus.stop()


def test_events_published_before_a_subscriber_rejoined_a_restarted_broker_reach_it_from_the_new_ring(
        tmp_path: Path, nodes: list[NodeRuntime]) -> None:
    """The new broker's XPUB drops what comes before a subscriber's socket is connected to it, and no later
    event may come to reveal the gap: a subscription resumes by proving itself live and taking the new ring.
    Here the broker comes back on another events port, so the subscriber cannot connect before it re-joins."""
    first, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    buses = [first]
    asker = NodeRuntime("asker", RuntimeSettings(bus=control, node_id="asker", metrics_port=-1), register=False)
    try:
        publisher, subscriber = node(control, "pub"), node(control, "sub")
        delivered: queue.Queue[Message] = queue.Queue()
        subscription = subscriber.subscribe(delivered.put, kinds=frozenset({RunEnd.kind}))
        nodes += [publisher, subscriber]
        for runtime in nodes:
            runtime.start_background()
        publisher.call_soon(lambda: publisher.publish(RunEnd(reason="tick", steps=0)))
        assert delivered.get(timeout=START_S).header.seq == 1

        blocked, gate = threading.Event(), threading.Event()
        subscriber.call_soon(lambda: (blocked.set(), gate.wait(START_S)))  # its loop stalls: no re-join yet
        assert blocked.wait(START_S)
        first.proc.kill()
        first.proc.wait()
        buses.append(restart_bus(tmp_path, {**first.info["endpoints"], "events_out": "tcp://127.0.0.1:0"}))
        wait_for(lambda: "pub" in {n.node_id for n in asker.lookup(policy=QUICK) or ()}, START_S,
                 "the publisher registered again")
        for step in (1, 2):
            publisher.call_soon(lambda step=step: publisher.publish(RunEnd(reason="tick", steps=step)))
        wait_for(lambda: {m.header.seq for m in asker.replay(src="pub")} == {1, 2, 3}, START_S,
                 "both events in the new broker's ring, after the refilled first one")

        gate.set()
        got = [delivered.get(timeout=START_S) for _ in range(2)]
        assert [m.header.seq for m in got] == [2, 3]
        assert subscription.lost.total() == 0 and subscriber.broker_restarts == 1
    finally:
        asker.close()
        while nodes:
            nodes.pop().join(timeout=START_S)
        for bus in buses:
            bus.stop()


def test_a_publish_path_that_broke_under_a_live_broker_is_dropped_held_and_refilled_when_it_answers_again(
        tmp_path: Path, nodes: list[NodeRuntime]) -> None:
    """The broker stalls (SIGSTOP) until ZeroMQ's heartbeats drop the publisher's connection: the publisher drops
    its PUB queue with it and holds what it publishes meanwhile; once the same broker answers again, it
    re-joins, refills the ring and its probes reveal the tail, so the subscriber gets every event, in order."""
    bus, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    try:
        publisher, subscriber = node(control, "pub"), node(control, "sub")
        delivered: queue.Queue[Message] = queue.Queue()
        subscription = subscriber.subscribe(delivered.put, kinds=frozenset({RunEnd.kind}))
        nodes += [publisher, subscriber]
        for runtime in nodes:
            runtime.start_background()
        publisher.call_soon(lambda: publisher.publish(RunEnd(reason="tick", steps=0)))
        assert delivered.get(timeout=START_S).header.seq == 1

        bus.signal(signal.SIGSTOP)
        try:
            for step in range(1, 4):  # before and after the connection drops
                publisher.call_soon(lambda step=step: publisher.publish(RunEnd(reason="tick", steps=step)))
            wait_for(lambda: publisher.publish_path_lost, START_S, "the connection to the stalled broker dropped")
            publisher.call_soon(lambda: publisher.publish(RunEnd(reason="held", steps=4)))
        finally:
            bus.signal(signal.SIGCONT)
        got = [delivered.get(timeout=START_S) for _ in range(4)]
        assert [m.header.seq for m in got] == [2, 3, 4, 5] and subscription.lost.total() == 0
        assert publisher.refilled >= 5 and publisher.broker_restarts == 0
    finally:
        while nodes:
            nodes.pop().join(timeout=START_S)
        bus.stop()


def test_a_rejoin_whose_probe_fails_once_still_resumes_subscriptions_on_the_retry(
        nodes: list[NodeRuntime], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first re-join with a restarted broker registers (so the node knows the new incarnation) but its PUB
    probe is not seen in time; the retry, a heartbeat later, finds the same incarnation, and must still make the
    subscriptions live again on the new broker (events it dropped before they reconnected come from its ring)."""
    first = in_process_bus()
    buses = [first]
    try:
        subscriber = node(first.endpoints["control"], "sub")
        subscriber.subscribe(lambda message: None)
        nodes.append(subscriber)
        resumed = threading.Event()
        resume, prove = subscriber._resume_subscriptions, subscriber._prove_published
        fail_next = threading.Event()

        def resume_and_tell(by: float) -> None:
            resume(by)
            resumed.set()

        def prove_or_fail_once(token: str, timeout_s: float) -> None:
            if fail_next.is_set():
                fail_next.clear()
                raise BusUnavailable("simulated: the new broker did not see the probe in time")
            prove(token, timeout_s)

        monkeypatch.setattr(subscriber, "_resume_subscriptions", resume_and_tell)
        monkeypatch.setattr(subscriber, "_prove_published", prove_or_fail_once)
        subscriber.start_background()

        endpoints = dict(first.endpoints)
        first.join(START_S)
        fail_next.set()
        buses.append(in_process_bus(endpoints))
        # A heartbeat finds the new broker, the first re-join fails at its probe, the retry a heartbeat later.
        bound = NODE_TIMEOUT_S + 10 * HEARTBEAT_S
        wait_for(lambda: subscriber.broker_restarts == 1 and not fail_next.is_set(), bound,
                 "a re-join that reached the new broker and failed at its probe")
        assert resumed.wait(bound), "the subscriptions did not resume after the retried re-join"
        wait_for(lambda: not subscriber._resume_pending, bound, "the resume done")
    finally:
        while nodes:
            nodes.pop().join(timeout=START_S)
        for bus in buses:
            bus.join(START_S)


def test_a_node_that_died_while_the_broker_was_down_is_reported_down_after_the_restart(
        tmp_path: Path, spawn: Callable[..., NodeProcess], nodes: list[NodeRuntime]) -> None:
    """The new broker knows only the nodes that re-join it, so it never publishes node-down for one that died
    while it was down. A peer tracker that found the new broker looks the registry up once it had time to fill
    (a node timeout and a heartbeat) and reports down, as the broker would have, every live peer it lacks; the
    nodes that re-joined stay up."""
    first, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    buses = [first]
    try:
        victim = spawn(["monitor", "--bus-control", control, "--node-id", "victim", *FAST_LIVENESS], "victim")
        victim.wait_ready(START_S)
        alive, tracker = node(control, "alive"), node(control, "tracker")
        peers = tracker.track_peers()
        downs: queue.Queue[tuple[NodeDown, NodeInfo | None]] = queue.Queue()
        peers.on_down(lambda down, info: downs.put((down, info)))
        nodes += [alive, tracker]
        for runtime in nodes:
            runtime.start_background()
        wait_for(lambda: {"victim", "alive"} <= set(peers.live), START_S, "the tracker sees both peers live")

        endpoints = first.info["endpoints"]
        sigkill(first)
        sigkill(victim)  # dies while no broker can notice
        buses.append(restart_bus(tmp_path, endpoints))
        back = time.monotonic()
        # The tracker re-joins at its next heartbeat, then gives the registry a node timeout, a heartbeat and the
        # reconnect cap to fill before it looks; twice that (and a heartbeat for the re-join) for a loaded machine.
        bound = 2 * (NODE_TIMEOUT_S + 2 * HEARTBEAT_S + RECONNECT_IVL_MAX_MS / 1000)
        try:
            down, info = downs.get(timeout=bound)
        except queue.Empty:
            raise AssertionError(f"no node-down for the dead node within {bound}s of the restart") from None
        print(f"node-down {time.monotonic() - back:.2f}s after the new broker was ready")
        assert (down.node_id, down.reason, down.role) == ("victim", ABSENT_AFTER_RESTART, "monitor")
        assert info is not None and info.pid == victim.pid
        assert downs.empty() and "alive" in peers.live and "victim" not in peers.live  # one reconcile, done
        assert tracker.broker_restarts == 1
    finally:
        while nodes:
            nodes.pop().join(timeout=START_S)
        for bus in buses:
            bus.stop()


def test_a_node_restarted_while_the_broker_was_down_has_its_dead_process_reported_down_and_its_calls_ended(
        tmp_path: Path, nodes: list[NodeRuntime]) -> None:
    """A node SIGKILLed and restarted under its id while the broker was down re-joins the new broker as a new
    process: that broker never knew the dead one, so it reports no ``replaced``, and the re-join confirms the id
    to the peer tracker's check after the restart. The tracker reports the dead process down itself when the
    node-up names another process than the one it holds live: a request still pending to the dead process's
    endpoint (a store's delete sent just before it died) ends with PeerDown at once, so its caller can send it
    again to the new process, not at its deadline against a port nobody listens on."""
    first, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    buses = [first]
    served: list[ServedPeer] = []
    try:
        served.append(old := ServedPeer(control, "peer-x"))
        tracker = node(control, "tracker")
        peers = tracker.track_peers()
        downs: queue.Queue[tuple[NodeDown, NodeInfo | None]] = queue.Queue()
        peers.on_down(lambda down, info: downs.put((down, info)))
        nodes.append(tracker)
        tracker.start_background()
        wait_for(lambda: "peer-x" in peers.live, START_S, "the tracker sees peer-x live")

        endpoints = first.info["endpoints"]
        sigkill(first)
        old.kill()  # dies while no broker can notice
        outcomes: queue.Queue[Outcome] = queue.Queue()
        # Each attempt outlasts the wait below: only a down report can end it in time.
        patient = RetryPolicy(timeout_s=START_S, attempts=2)
        tracker.call_soon(lambda: tracker.calls.request(old.endpoint, Claim(blob_ids=["b"], holder="tracker"),
                                                        outcomes.put, policy=patient))
        served.append(new := ServedPeer(control, "peer-x", wait=False))  # its hello waits for the new broker
        buses.append(restart_bus(tmp_path, endpoints))
        new.registered()
        try:
            ended = outcomes.get(timeout=START_S)
        except queue.Empty:
            raise AssertionError(f"the call to the dead process did not end within {START_S}s of the new one's "
                                 "registration") from None
        assert isinstance(ended, PeerDown) and "peer-x reported down (replaced)" in ended.reason, ended
        down, info = downs.get(timeout=START_S)
        assert (down.node_id, down.reason) == ("peer-x", "replaced")
        assert info is not None and info.pid == old.proc.pid
        wait_for(lambda: peers.endpoint_of("peer-x", "rpc") == new.endpoint, START_S, "the new process is live")
        tracker.call_soon(lambda: tracker.calls.request(new.endpoint, Claim(blob_ids=["b"], holder="tracker"),
                                                        outcomes.put, policy=patient))
        answered = outcomes.get(timeout=sum(patient.timeouts()) + START_S)
        assert isinstance(answered, Message) and answered.body == Claimed(blob_ids=[], missing=["b"]), answered
        assert downs.empty()  # one report of the dead process
    finally:
        while nodes:
            nodes.pop().join(timeout=START_S)
        for peer in served:
            peer.kill()
        for bus in buses:
            bus.stop()


class ForgetfulBroker:
    """A stand-in for a broker that came back and cannot take the re-joins (it crashes again, or every node
    re-joins it at once): bound at a dead broker's control address, it answers every heartbeat ``unknown-node``
    (so the node re-joins) and never answers a ``hello``. Serves on its own thread until :meth:`close`."""

    def __init__(self, control: str) -> None:
        self.ctx = zmq.Context()
        self.server = Server(make_socket(self.ctx, zmq.ROUTER, bind=control), WireCodec("bus-again"))
        self.rejoins: set[str] = set()  # the ids of the hellos seen: one per re-join (its resends share it)

        def forgotten(request: Message) -> None:
            raise HandlerError("unknown-node", "not registered (send hello)")

        def unanswered(request: Message) -> None:
            self.rejoins.add(request.header.id)

        self.server.on(Heartbeat.kind, forgotten, cached=False)
        self.server.on(Hello.kind, unanswered, cached=False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            if self.server.sock.poll(50):
                self.server.handle_one(zmq.NOBLOCK)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(START_S)
        self.ctx.destroy(linger=0)


def test_a_broker_that_forgot_the_node_and_never_answers_its_rejoin_holds_none_of_its_requests_nor_its_stop(
        tmp_path: Path) -> None:
    """A re-join runs on the loop thread: every step of it ends within a share of the node timeout (the fill
    deadline), so while the broker that came back answers heartbeats ``unknown-node`` and never the ``hello``, the
    node answers every peer request in time (not after the 15 s connect timeout a hello waited), tries the re-join
    again a heartbeat later each time, and a SIGTERM ends it within its shutdown timeout of the turn."""
    bus, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    peer = ServedPeer(control, "peer-1")
    stand_in: ForgetfulBroker | None = None
    ctx = zmq.Context()
    # A turn's broker work (a re-join, gap fills) ends within the fill deadline; twice the node timeout leaves the
    # rest of the turn and a loaded machine room.
    bound = 2 * NODE_TIMEOUT_S
    probe = Client(ctx, peer.endpoint, WireCodec("prober"), policy=RetryPolicy(timeout_s=bound, attempts=1))
    try:
        assert probe.request(Claim(blob_ids=["b"], holder="prober")).body == Claimed(blob_ids=[], missing=["b"])
        sigkill(bus)
        stand_in = ForgetfulBroker(control)
        retries = 3
        deadline = time.monotonic() + retries * (FILL_SHARE * NODE_TIMEOUT_S + HEARTBEAT_S) + START_S
        slowest = 0.0
        while len(stand_in.rejoins) < retries:
            assert time.monotonic() < deadline, f"{len(stand_in.rejoins)} re-joins tried, not {retries}"
            sent = time.monotonic()
            try:
                probe.request(Claim(blob_ids=["b"], holder="prober"))
            except RequestTimeout:
                raise AssertionError(f"a request unanswered for {bound}s while the node re-joined") from None
            slowest = max(slowest, time.monotonic() - sent)
        print(f"{len(stand_in.rejoins)} re-joins tried; slowest answer meanwhile {slowest:.3f}s")

        peer.proc.send_signal(signal.SIGTERM)
        shutdown_s = RuntimeSettings().shutdown_timeout_s
        try:
            assert peer.proc.wait(bound + shutdown_s) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGTERM during re-joins: not gone within {bound + shutdown_s}s") from None
    finally:
        peer.kill()
        probe.close()
        ctx.destroy(linger=0)
        if stand_in is not None:
            stand_in.close()
        bus.stop()
