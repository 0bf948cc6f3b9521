"""Scale bench: the control plane of a large run, simulated on this machine at a documented model run's rates.

The model run (``Model``): a 30B MoE (48 layers, top-8 routing), 1,024 episodes a step, 64 inference nodes
(each an env server and a rollout worker), 16 trainer ranks. The arithmetic:

* Generation: 1,024 episodes of ~8k tokens = 8.4M tokens a step; at ~5,000 tokens/s per inference node (3B
  active parameters, batched decode) 64 nodes take ~26 s a step, so **~40 episodes/s**, 0.6 per node.
* Blobs: an episode keeps ~4 blobs (its branches' token/logprob/routing records; the routing record alone is
  8k tokens x 48 layers x 8 experts = 3 MiB, which is why it is kept by reference on its env server).
* Events: each blob sees ~5 between keep and delete (``episode-finished``, ``claim``, ``reference``,
  ``fetch-ack``, ``delete``): **20 events an episode, ~800 events/s** for the run, 12.3 per node.
* Bursts: claims, references and fetch-acks of a step go out together at the step boundary; the bench drives
  ``burst`` = 4 times the average all the time, **49 events/s per node** (3,150/s at 64 nodes, 12,600/s at
  256), as the rate the bus must sustain with margin.
* Beside events: every node heartbeats once a ``heartbeat_s`` (env server and rollout worker per inference
  node, one per trainer rank), and each rollout worker refreshes the registry every ``lookup_s``.
* Fan-out: the orchestrator and the launcher's watcher decode the whole stream; every env server and trainer
  rank tracks peers with a subscription the broker filters by topic (``node-up`` and ``node-down`` only, the
  kinds of ``runtime.track_peers()``), so the broker sends every event to 2 subscribers, and the registry's
  events to ``nodes + trainer_ranks`` more.

For each node count of the sweep, a fresh broker (``Broker`` in a ``NodeRuntime``, as ``refbus node bus``
runs it) serves: simulated nodes (real PUB and control sockets, many per process, each registered with
``hello`` and made live by the ``sync`` handshake, as a real node is: the broker announces its ``node-up`` to
the peer trackers and lists it in every lookup, or the bench fails; each publishes ~170-byte events at the
per-node rate and heartbeats), an orchestrator (a registered ``NodeRuntime`` whose subscription decodes and
sequence-checks every event, as the real one's does), the watcher and the peer trackers (SUB sockets
subscribed as the runtime subscribes them, every one held open for the whole run; the watcher's keeps only
its latest message, ``CONFLATE``, so ZeroMQ reads every copy off the wire and no Python on this machine's two
cores pretends to be 80 nodes' own; a peer tracker's, subscribed to several topics, is read in full, since
``CONFLATE`` would also collapse its subscriptions to the last one).
Before the nodes join, every subscription is proved live (it received a ``sync`` probe published into
``events_in``), and after the run every one must have heard what it subscribed to (the watcher an event, each
peer tracker the ``node-up`` of the orchestrator, which joins after the proof), or the bench fails: a
subscriber that silently never existed would make the broker look cheaper. Reported per count: the event
rate offered and delivered, broker CPU per event (its whole process: forwarding, ring, heartbeats, lookups), publish-to-
orchestrator latency p50/p99 (the envelope's send timestamp against the receive time, one host clock) and the
orchestrator's subscription CPU per episode (20 events). **Baseline**, at each count in the same run: a bare
``zmq.proxy`` process (XSUB to XPUB in ZeroMQ's C loop with the broker's socket options, nothing else:
``bench.bus.bare_proxy_node``) forwarding the same simulated nodes' events (published straight to it: it has
no registry, so no heartbeats or lookups) to the same subscriptions (the orchestrator's being one more
``CONFLATE`` socket); the broker's CPU per event (its whole process) is printed as a multiple of the proxy's
(its forwarding threads only, read per thread in nanoseconds), each counted from the nodes' ``go``, so neither
pays for its set-up, the subscriptions' probes or the connections made before it. **Headroom** is the
largest count sustained (p99 < 50 ms and >= 95% of the offered events delivered) over 64 and over 256: the
factor by which this machine's bus could grow past the model run (the goal is >= 4 at 64). The projection fits
the broker's CPU to the event copies it sends (events x subscribers: the fan-out grows with the node count
twice) over the counts sustained, and extrapolates to 64 and 256 nodes.

Also reported: the CPU the simulated subscribers spend reading what the broker sends them (``readers core``),
and the CPU the simulated nodes spend publishing, heartbeating and looking up (``nodes core``): on real hosts
each node pays its own, here it comes off the same two cores. So the simulated nodes and subscribers run at the
lowest CPU priority, yielding to the broker and the orchestrator being measured, and the simulated nodes wake
once a millisecond (``TICK_S``) to send what fell due instead of waking for every event.
``--whole-stream-trackers`` runs peer trackers subscribed to the whole stream (as before topic filtering)
instead; ``--compare-whole-stream`` runs both sweeps in the same run and prints the whole-stream figures as
ratios to the topic-filtered ones.

    python -m bench.scale [--quick] [--json PATH] [--nodes 16 64 128 ...] [--whole-stream-trackers |
                          --compare-whole-stream]

On a 2-core machine every process of the simulation shares the cores with the broker, so the figures are a
lower bound for a broker with a host of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import zmq
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.peers import KINDS as PEER_KINDS
from refbus.bus.pubsub import Publisher
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings, prove_published
from refbus.bus.sockets import EVENT_OPTIONS, make_socket
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Delete, Heartbeat, Hello, NodeInfo, NodeList, Nodes, Sync

from bench.bus import bare_proxy_node
from bench.harness import WAIT_S, BenchError, Channel, Worker, lower_priority, run_line, workers, write_json

LOOPBACK = "tcp://127.0.0.1:0"
P99_LIMIT_S = 0.050
DELIVERED_SHARE = 0.95
PUBLISHER_PROCESSES = 2
TICK_S = 0.001  # the simulated nodes publish what fell due once a tick
WHOLE_STREAM = 2  # subscriptions of the whole stream in a run of any size: the orchestrator and the watcher
TRACKED = (*sorted(kind.encode() for kind in PEER_KINDS), Sync.kind.encode())  # a peer tracker's topics, sync last
PEER_TOPICS = tuple(sorted(kind.encode() for kind in PEER_KINDS))
PROBE_MS = 10  # between sync probes while proving the subscriptions live
DRAIN_MS = 100  # the peer trackers' reader looks for the order to stop at least this often
HEAR_S = 5.0  # after the run, the longest a subscription that heard nothing yet is waited for


@dataclass(frozen=True)
class Model:
    """The model run the rates come from (see the module doc for the arithmetic)."""

    nodes: int = 64
    trainer_ranks: int = 16
    episodes_per_step: int = 1024
    step_s: float = 26.0
    blobs_per_episode: int = 4
    events_per_blob: int = 5
    burst: float = 4.0
    heartbeat_s: float = 1.0
    lookup_s: float = 5.0

    @property
    def events_per_episode(self) -> int:
        return self.blobs_per_episode * self.events_per_blob

    @property
    def events_per_node_s(self) -> float:
        episodes_per_node_s = self.episodes_per_step / self.nodes / self.step_s
        return episodes_per_node_s * self.events_per_episode * self.burst


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    warmup_s: float
    window_s: float
    filtered: bool = True  # peer trackers subscribe by topic (as built); False: the whole stream (the baseline)


FULL = Settings(sizes=(16, 32, 64, 128, 192, 256, 320, 384), warmup_s=1.0, window_s=4.0)
QUICK = Settings(sizes=(2, 4), warmup_s=0.2, window_s=0.5)


@dataclass(frozen=True)
class Point:
    """What one node count measured."""

    nodes: int
    offered_per_s: float
    delivered_per_s: float
    broker_cpu_us: float  # the broker process's CPU per event it captured (heartbeats and lookups included)
    broker_core: float  # the broker process's CPU seconds per second (1.0: a whole core)
    subscribers: int  # whole-stream subscriptions: every event is sent this many times
    peer_trackers: int  # topic-filtered subscriptions (registry events only)
    fanout_core: float  # CPU seconds per second the simulated subscribers spend reading what the broker sends
    nodes_core: float  # CPU seconds per second the simulated nodes spend publishing, heartbeating, looking up
    p50_ms: float
    p99_ms: float
    orchestrator_cpu_us_per_episode: float
    proxy_cpu_us: float  # the bare zmq.proxy's CPU per event it forwarded: same nodes' events, same subscriptions
    proxy_forwarded: int  # events the bare proxy forwarded from go

    @property
    def sustained(self) -> bool:
        return self.p99_ms < P99_LIMIT_S * 1e3 and self.delivered_per_s >= DELIVERED_SHARE * self.offered_per_s

    @property
    def vs_proxy(self) -> float:
        """The broker's CPU per event as a multiple of the bare proxy's."""
        return self.broker_cpu_us / self.proxy_cpu_us if self.proxy_cpu_us else float("nan")


# --- tasks (each in its own worker process) -----------------------------------------------------------


def broker_task(ch: Channel) -> dict[str, float]:
    """A broker on ephemeral ports until told to stop; its CPU seconds and events captured from ``go``."""
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="scale-bus", metrics_port=-1), register=False)
    broker = Broker(runtime, BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK,
                                            node_timeout_s=3600))
    try:
        runtime.start()
        ch.send(dict(runtime.endpoints))
        runtime.loop(until=ch.poll)
        ch.recv()  # go
        cpu, forwarded, start = time.process_time(), broker.forwarded, time.perf_counter()
        runtime.loop(until=ch.poll)
        return {"cpu_s": time.process_time() - cpu, "forwarded": broker.forwarded - forwarded,
                "seconds": time.perf_counter() - start}
    finally:
        runtime.close()


def orchestrator_task(ch: Channel, control: str, warmup_s: float, window_s: float) -> dict[str, Any]:
    """A registered node whose subscription decodes every event; latency and CPU over the window."""
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="scale-orchestrator",
                                                          metrics_port=-1))
    latencies: list[float] = []
    counted = [False]

    def on_event(message: Message) -> None:
        if counted[0]:
            latencies.append(time.time() - message.header.ts)

    runtime.subscribe(on_event)
    try:
        runtime.start()
        ch.send("ready")
        runtime.loop(until=ch.poll)
        ch.recv()  # go
        runtime.loop(until=_after(warmup_s))
        counted[0] = True
        start, cpu = time.perf_counter(), time.process_time()
        runtime.loop(until=_after(window_s))
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
        counted[0] = False
        return {"events": len(latencies), "seconds": seconds, "cpu_s": cpu_s,
                "p50_s": float(np.percentile(latencies, 50)) if latencies else float("inf"),
                "p99_s": float(np.percentile(latencies, 99)) if latencies else float("inf")}
    finally:
        runtime.close()


def fanout_task(ch: Channel, events_in: str, events_out: str, whole: int, trackers: int,
                registry: bool) -> dict[str, Any]:
    """``whole`` subscriptions of the whole stream (the watcher) and ``trackers`` peer-tracking ones (the
    topics ``runtime.track_peers()`` subscribes to), every socket held until the end. A whole-stream one keeps
    only its latest message (``CONFLATE``: ZeroMQ's I/O thread reads every copy the broker sends, as a real
    subscriber's would, and no Python here spends what real nodes spend on their own cores); a peer tracker is
    read in full (``CONFLATE`` would collapse its several subscriptions to the last one set), counting the
    registry events it hears. Reports ``ready`` once every subscription is live (:func:`_prove_live`), then
    runs until ``stop``; then waits (at most ``HEAR_S``) for what was still in flight to the subscriptions that
    have heard nothing yet: an event for a whole-stream one, with a ``registry`` (a broker) a registry event
    for a peer tracker. Returns the process's CPU and wall seconds from ready to stop, how many whole-stream
    subscriptions hold an event and the registry events each peer tracker heard."""
    ctx = zmq.Context()
    try:
        subs = [_subscription(ctx, events_out, [b""] if index < whole else TRACKED)
                for index in range(whole + trackers)]
        streams, heard = subs[:whole], dict.fromkeys(subs[whole:], 0)
        _prove_live(ctx, events_in, subs)
        ch.send("ready")
        cpu, start = time.process_time(), time.perf_counter()
        while not ch.poll(0 if heard else DRAIN_MS / 1000):
            for sock, _ in zmq.zmq_poll([(sock, zmq.POLLIN) for sock in heard], DRAIN_MS):
                _read(sock, heard)
        cpu_s, seconds = time.process_time() - cpu, time.perf_counter() - start
        deadline = time.monotonic() + HEAR_S
        while time.monotonic() < deadline:
            silent = [sock for sock in streams if not sock.poll(0)]  # nothing read off them: CONFLATE holds one
            deaf = [sock for sock, count in heard.items() if not count] if registry else []
            if not silent and not deaf:
                break
            for sock, _ in zmq.zmq_poll([(sock, zmq.POLLIN) for sock in (*silent, *deaf)], PROBE_MS):
                if sock in heard:
                    _read(sock, heard)
        return {"cpu_s": cpu_s, "seconds": seconds, "whole_heard": sum(bool(sock.poll(0)) for sock in streams),
                "registry_heard": list(heard.values())}
    finally:
        ctx.destroy(linger=0)


def _read(sock: zmq.Socket, heard: dict[zmq.Socket, int]) -> None:
    """Read what a peer tracker holds, counting the registry events in ``heard``."""
    while sock.poll(0):
        heard[sock] += sock.recv_multipart()[0].startswith(PEER_TOPICS)


def _subscription(ctx: zmq.Context, events_out: str, topics: Sequence[bytes]) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.linger = 0
    if list(topics) == [b""]:
        sock.setsockopt(zmq.CONFLATE, 1)  # one subscription: nothing for CONFLATE to collapse
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(events_out)
    return sock


def _prove_live(ctx: zmq.Context, events_in: str, subs: Sequence[zmq.Socket]) -> None:
    """Publish ``sync`` probes into ``events_in`` until every one of ``subs`` received one. A peer tracker's
    ``sync`` topic sorts after its others and a socket sends its subscriptions in order, so one that heard a
    probe has every subscription in place. Raises :class:`BenchError` naming how many did not within
    ``WAIT_S``."""
    token = secrets.token_hex(8)
    publisher = Publisher(make_socket(ctx, zmq.PUB, connect=events_in, options=EVENT_OPTIONS),
                          WireCodec(f"scale-fanout-{token}"))
    waiting = set(subs)
    deadline = time.monotonic() + WAIT_S
    try:
        while waiting:
            if time.monotonic() > deadline:
                raise BenchError(f"{len(waiting)} of {len(subs)} subscriptions never received a sync probe")
            publisher.publish_raw(Sync(token=token))
            for sock, _ in zmq.zmq_poll([(sock, zmq.POLLIN) for sock in waiting], PROBE_MS):
                while sock.poll(0):
                    if any(token.encode() in frame for frame in sock.recv_multipart()):
                        waiting.discard(sock)
    finally:
        publisher.sock.close()


def publisher_task(ch: Channel, endpoints: dict[str, str], node_ids: list[str], model: Model,
                   seconds: float) -> dict[str, float]:
    """Simulated inference nodes: each publishes at the model's per-node rate for ``seconds`` after ``go``;
    with a broker (``control`` in ``endpoints``) each registers first, heartbeats and looks up the registry,
    without one (the bare proxy) each publishes straight into ``events_in``. Returns events sent, requests
    made, the longest list a lookup answered (``listed``) and CPU seconds."""
    ctx = zmq.Context()
    try:
        nodes = [_SimNode(ctx, endpoints, node_id) for node_id in node_ids]
        ch.send("ready")
        ch.recv()  # go
        body = Delete(blob_ids=[f"env-0-ep-{i:06d}-b0" for i in range(3)], holder="trainer-0", reason="trained")
        interval = 1.0 / (model.events_per_node_s * len(nodes))
        start = time.perf_counter()
        due = start
        sent = requests = listed = 0
        codec = WireCodec("scale-replies")  # decodes any sender's replies: the lookups' lists are counted
        # Requests spread evenly: heartbeats and lookups of all nodes, one due every so often.
        requests_due = [(start + model.heartbeat_s * i / len(nodes), model.heartbeat_s, i, True)
                        for i, node in enumerate(nodes) if node.control is not None]
        requests_due += [(start + model.lookup_s * i / len(nodes), model.lookup_s, i, False)
                         for i, node in enumerate(nodes) if node.control is not None]
        heapq.heapify(requests_due)
        waiting: dict[zmq.Socket, int] = {}  # control sockets with replies due -> how many
        cpu = time.process_time()
        while (now := time.perf_counter()) - start < seconds:
            while due <= now:
                nodes[sent % len(nodes)].publisher.publish(body)
                sent += 1
                due += interval
            while requests_due and requests_due[0][0] <= now:
                at, every, index, beat = heapq.heappop(requests_due)
                node = nodes[index]
                assert node.control is not None
                node.control.send(Heartbeat(node_id=node.node_id) if beat else Nodes(role="env-server"))
                waiting[node.control.sock] = waiting.get(node.control.sock, 0) + 1
                requests += 1
                heapq.heappush(requests_due, (at + every, every, index, beat))
            for sock in [sock for sock, _ in zmq.zmq_poll([(sock, zmq.POLLIN) for sock in waiting], 0)]:
                reply = codec.decode(sock.recv_multipart(), backend="numpy").body
                if isinstance(reply, NodeList):
                    listed = max(listed, len(reply.nodes))
                waiting[sock] -= 1
                if not waiting[sock]:
                    del waiting[sock]
            # The simulated nodes' own CPU is not the bus's: wake once a tick and send what fell due meanwhile,
            # instead of once per event (thousands of wake-ups a second stole a core from the broker).
            next_at = min(due, requests_due[0][0]) if requests_due else due
            time.sleep(max(TICK_S, next_at - time.perf_counter()))
        return {"sent": sent, "requests": requests, "listed": listed, "cpu_s": time.process_time() - cpu}
    finally:
        ctx.destroy(linger=0)


class _SimNode:
    """One simulated node: its own PUB and, with a broker, a control connection it registered on (``hello``)."""

    def __init__(self, ctx: zmq.Context, endpoints: dict[str, str], node_id: str) -> None:
        self.node_id = node_id
        codec = WireCodec(node_id)
        self.control: Client | None = None
        events_in = endpoints["events_in"]
        if "control" in endpoints:
            self.control = Client(ctx, endpoints["control"], codec, policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
            info = NodeInfo(node_id=node_id, role="env-server", host="scale", pid=0)
            token = codec.new_id()
            welcome = self.control.request(Hello(node=info, token=token)).body
            events_in = welcome.events_in  # type: ignore[union-attr]
        pub = make_socket(ctx, zmq.PUB, connect=events_in, options=EVENT_OPTIONS)
        self.publisher = Publisher(pub, codec)
        if self.control is not None:  # live, as a real node: listed by lookups, announced to the peer trackers
            prove_published(self.control, self.publisher, token, WAIT_S)


def peer_trackers(model: Model, nodes: int) -> int:
    """Peer-tracking subscriptions of a run of ``nodes``: every env server and trainer rank tracks peers."""
    return nodes + model.trainer_ranks


def subscriptions(model: Model, nodes: int, filtered: bool) -> tuple[int, int]:
    """(whole-stream, topic-filtered) subscriptions of a run of ``nodes``; unfiltered, the peer trackers take the
    whole stream too (as before topic filtering: the baseline)."""
    trackers = peer_trackers(model, nodes)
    return (WHOLE_STREAM, trackers) if filtered else (WHOLE_STREAM + trackers, 0)


def _after(seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() >= deadline


# --- the sweep (parent side) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """The workers of a sweep: ``broker`` runs the broker, ``proxy`` the bare proxy (its baseline), ``fanout``
    and ``pubs`` (the simulated subscribers and nodes) run at the lowest CPU priority."""

    broker: Worker
    proxy: Worker
    orchestrator: Worker
    fanout: Worker
    pubs: tuple[Worker, ...]


@contextlib.contextmanager
def pool() -> Iterator[Pool]:
    names = ["scale-broker", "scale-proxy", "scale-orchestrator", "scale-fanout",
             *(f"scale-pub{i}" for i in range(PUBLISHER_PROCESSES))]
    with workers(*names) as started:
        broker, proxy, orchestrator, fanout, *pubs = started
        for simulated in (fanout, *pubs):  # what real nodes run on their own hosts yields to what is measured
            simulated.call(lower_priority)
        yield Pool(broker, proxy, orchestrator, fanout, tuple(pubs))


def drive(workers_of: Pool, forwarder: Worker, task: Callable[[Channel], Any], nodes: int, model: Model,
          settings: Settings) -> dict[str, Any]:
    """One run of ``nodes`` simulated nodes through the forwarder ``task`` (on ``forwarder``): the broker (it
    sends ``control`` among its endpoints, and the orchestrator joins it) or the bare proxy (the orchestrator's
    subscription is one more whole-stream socket). Order: the fan-out's subscriptions proved live, then the
    orchestrator, then the nodes, then ``go``. Returns each worker's result.

    Raises:
        BenchError: a worker failed or was late, the nodes sent nothing, or a subscription heard nothing of
            what it subscribed to.
    """
    orchestrator, fanout, pubs = workers_of.orchestrator, workers_of.fanout, workers_of.pubs
    forwarder.submit(task)
    endpoints = forwarder.message()
    brokered = "control" in endpoints
    whole, trackers = subscriptions(model, nodes, settings.filtered)
    seconds = settings.warmup_s + settings.window_s + 0.5
    fanout.submit(fanout_task, endpoints["events_in"], endpoints["events_out"], whole - brokered, trackers, brokered)
    _ready(fanout, nodes)
    if brokered:  # after the peer trackers are live: its node-up reaches every one of them
        orchestrator.submit(orchestrator_task, endpoints["control"], settings.warmup_s, settings.window_s)
        _ready(orchestrator, nodes)
    run = secrets.token_hex(3)
    ids = [f"env-{run}-{i}" for i in range(nodes)]
    for index, worker in enumerate(pubs):
        worker.submit(publisher_task, endpoints, ids[index::len(pubs)], model, seconds)
    for worker in pubs:
        _ready(worker, nodes)
    for worker in (forwarder, orchestrator, *pubs) if brokered else (forwarder, *pubs):
        worker.tell("go")  # the forwarder counts its events and CPU from here, whichever it is
    try:
        seen = orchestrator.result(seconds + WAIT_S) if brokered else {}
        sent = [worker.result(seconds + WAIT_S) for worker in pubs]
    finally:
        fanout.tell("stop")
        forwarder.tell("stop")
        readers = fanout.result()
    cpu = forwarder.result()
    if not sum(s["sent"] for s in sent):
        raise BenchError(f"the publishers of {nodes} nodes sent nothing")
    deaf = (whole - brokered - readers["whole_heard"]) + (sum(not n for n in readers["registry_heard"])
                                                          if brokered else 0)
    listed = max(s["listed"] for s in sent)
    if brokered and listed < nodes:
        raise BenchError(f"the registry listed {listed} of {nodes} simulated nodes live: lookups would be short")
    if deaf:
        raise BenchError(f"{deaf} of {whole - brokered + trackers} simulated subscriptions heard nothing of what "
                         "they subscribed to: the broker sent fewer copies than the run models")
    return {"seen": seen, "sent": sent, "readers": readers, "cpu": cpu}


def _ready(worker: Worker, nodes: int) -> None:
    if worker.message(WAIT_S + nodes * 0.05) != "ready":
        raise BenchError(f"{worker.name} did not get ready")


def measure(workers_of: Pool, nodes: int, model: Model, settings: Settings) -> Point:
    """``nodes`` through the broker, then through the bare proxy (the baseline), in the same pool."""
    brokered = drive(workers_of, workers_of.broker, broker_task, nodes, model, settings)
    proxied = drive(workers_of, workers_of.proxy, bare_proxy_node, nodes, model, settings)
    seen, cpu, readers = brokered["seen"], brokered["cpu"], brokered["readers"]
    whole, trackers = subscriptions(model, nodes, settings.filtered)
    events = seen["events"]
    return Point(
        nodes=nodes,
        offered_per_s=nodes * model.events_per_node_s,
        delivered_per_s=events / seen["seconds"],
        broker_cpu_us=1e6 * cpu["cpu_s"] / max(1, cpu["forwarded"]),
        broker_core=cpu["cpu_s"] / cpu["seconds"],
        subscribers=whole,
        peer_trackers=trackers,
        fanout_core=readers["cpu_s"] / readers["seconds"],
        nodes_core=sum(s["cpu_s"] for s in brokered["sent"]) / (settings.warmup_s + settings.window_s + 0.5),
        p50_ms=seen["p50_s"] * 1e3,
        p99_ms=seen["p99_s"] * 1e3,
        orchestrator_cpu_us_per_episode=1e6 * seen["cpu_s"] / max(1, events) * model.events_per_episode,
        proxy_cpu_us=1e6 * proxied["cpu"]["cpu_s"] / max(1, proxied["cpu"]["forwarded"]),
        proxy_forwarded=proxied["cpu"]["forwarded"],
    )


def sweep_in(workers_of: Pool, model: Model, settings: Settings) -> list[Point]:
    return [measure(workers_of, nodes, model, settings) for nodes in settings.sizes]


def sweep(model: Model, settings: Settings) -> list[Point]:
    """Every node count of ``settings``, in a pool of its own."""
    with pool() as workers_of:
        return sweep_in(workers_of, model, settings)


def compare(model: Model, settings: Settings) -> tuple[list[Point], list[Point]]:
    """The topic-filtered sweep and the whole-stream one, in the same pool: (filtered, whole stream)."""
    with pool() as workers_of:
        return (sweep_in(workers_of, model, dataclasses.replace(settings, filtered=True)),
                sweep_in(workers_of, model, dataclasses.replace(settings, filtered=False)))


def headroom(points: Sequence[Point], nodes: int) -> float:
    """The largest node count sustained, over ``nodes`` (0 when none was)."""
    return max((p.nodes for p in points if p.sustained), default=0) / nodes


def format_report(points: Sequence[Point], model: Model, *, filtered: bool = True) -> str:
    lines = [f"Model run: {model.episodes_per_step} episodes/step every {model.step_s:.0f} s on {model.nodes} "
             f"inference nodes, {model.events_per_episode} events/episode, burst x{model.burst:.0f}: "
             f"{model.events_per_node_s:.1f} events/s per node; {model.trainer_ranks} trainer ranks; heartbeats "
             f"every {model.heartbeat_s:.0f} s, a lookup every {model.lookup_s:.0f} s per node; peer trackers "
             f"{'topic-filtered' if filtered else 'on the whole stream'}",
             "  broker us/event: the broker process's CPU per event; proxy us/event: the bare zmq.proxy's, same "
             "nodes' events to the same subscriptions, measured after it at each count (its baseline)",
             f"  {'nodes':>5s} {'offered/s':>10s} {'delivered/s':>12s} {'broker core':>12s} {'readers core':>13s} "
             f"{'nodes core':>11s} {'p50 ms':>8s} {'p99 ms':>8s} {'orch us/episode':>16s} "
             f"{'broker us/event':>16s} {'proxy us/event':>15s} {'x proxy':>8s}  sustained"]
    for p in points:
        lines.append(f"  {p.nodes:5d} {p.offered_per_s:10.0f} {p.delivered_per_s:12.0f} {p.broker_core:12.0%} "
                     f"{p.fanout_core:13.0%} {p.nodes_core:11.0%} {p.p50_ms:8.2f} {p.p99_ms:8.2f} "
                     f"{p.orchestrator_cpu_us_per_episode:16.1f} {p.broker_cpu_us:16.2f} {p.proxy_cpu_us:15.2f} "
                     f"{p.vs_proxy:8.2f}  {'yes' if p.sustained else 'no'}")
    idle, per_copy = broker_cost(points)
    for nodes in (64, 256):
        events = nodes * model.events_per_node_s
        whole, trackers = subscriptions(model, nodes, filtered)
        copies = events * whole
        lines.append(f"  projected to {nodes} nodes: {events:,.0f} events/s to {whole} "
                     f"whole-stream subscribers ({trackers} peer trackers get the registry's "
                     f"events only); broker {100 * (idle + per_copy * copies):.0f}% of a core ({100 * idle:.0f}% "
                     f"idle + {per_copy * 1e6:.2f} us per event copy, fitted); headroom "
                     f"x{headroom(points, nodes):.2f} (largest count sustained here, over {nodes})")
    return "\n".join(lines)


def format_comparison(filtered: Sequence[Point], whole: Sequence[Point]) -> str:
    """The whole-stream sweep's figures as ratios to the topic-filtered one's, count by count (same run)."""
    lines = ["Peer trackers on the whole stream vs topic-filtered (same run), whole / filtered:",
             f"  {'nodes':>5s} {'broker core':>20s} {'broker us/event':>22s} {'p99 ms':>24s}"]
    for f, w in zip(filtered, whole, strict=True):
        lines.append(f"  {f.nodes:5d} {w.broker_core:6.0%} / {f.broker_core:4.0%} = "
                     f"{_ratio(w.broker_core, f.broker_core)} {w.broker_cpu_us:6.2f} / {f.broker_cpu_us:5.2f} = "
                     f"{_ratio(w.broker_cpu_us, f.broker_cpu_us)} {w.p99_ms:7.2f} / {f.p99_ms:6.2f} = "
                     f"{_ratio(w.p99_ms, f.p99_ms)}")
    for nodes in (64, 256):
        lines.append(f"  headroom over {nodes}: x{headroom(whole, nodes):.2f} whole stream, "
                     f"x{headroom(filtered, nodes):.2f} topic-filtered")
    return "\n".join(lines)


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:6.2f}x" if baseline else "     -"


def broker_cost(points: Sequence[Point]) -> tuple[float, float]:
    """The broker's CPU as ``idle + per_copy * copies/s`` (cores; least squares over the sustained counts, or
    all when fewer than two were): it sends every event once per subscriber, so copies, not events, drive it."""
    fitted = [p for p in points if p.sustained]
    fitted = fitted if len(fitted) >= 2 else list(points)
    copies = [p.delivered_per_s * p.subscribers for p in fitted]
    if len(fitted) < 2:
        return 0.0, fitted[0].broker_core / copies[0] if fitted and copies[0] else 0.0
    per_copy, idle = np.polyfit(copies, [p.broker_core for p in fitted], 1)
    return max(0.0, float(idle)), max(0.0, float(per_copy))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two tiny sizes, short windows (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--nodes", type=int, nargs="+", help="node counts to sweep (default: 16 ... 384)")
    trackers = parser.add_mutually_exclusive_group()
    trackers.add_argument("--whole-stream-trackers", action="store_true",
                          help="peer trackers subscribe to the whole stream, not by topic")
    trackers.add_argument("--compare-whole-stream", action="store_true",
                          help="sweep with topic-filtered peer trackers, then with whole-stream ones, and print "
                               "the ratios")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = dataclasses.replace(settings, sizes=tuple(args.nodes or settings.sizes),
                                   filtered=not args.whole_stream_trackers)
    model = Model()
    started = time.monotonic()
    if args.compare_whole_stream:
        filtered, whole = compare(model, settings)
        sweeps = {"filtered": filtered, "whole_stream": whole}
        print(format_report(filtered, model, filtered=True), end="\n\n")
        print(format_report(whole, model, filtered=False), end="\n\n")
        print(format_comparison(filtered, whole))
    else:
        points = sweep(model, settings)
        sweeps = {"filtered" if settings.filtered else "whole_stream": points}
        print(format_report(points, model, filtered=settings.filtered))
    elapsed = time.monotonic() - started
    print(f"\n{run_line(args.quick, elapsed)}")
    if args.json:
        write_json(args.json, {"model": asdict(model), "settings": asdict(settings), "sweeps": {
            name: {"points": [asdict(p) | {"sustained": p.sustained, "vs_proxy": p.vs_proxy} for p in points],
                   "headroom": {str(n): headroom(points, n) for n in (64, 256)}}
            for name, points in sweeps.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
