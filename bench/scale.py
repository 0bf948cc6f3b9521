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
``hello``, publishing ~170-byte events at the per-node rate and heartbeating), an orchestrator (a registered
``NodeRuntime`` whose subscription decodes and sequence-checks every event, as the real one's does), the
watcher and the peer trackers (SUB sockets subscribed as the runtime subscribes them, that keep only their
latest message: ZeroMQ reads every copy off the wire, no Python on this machine's two cores pretends to be 80
nodes' own). Reported per count: the event rate offered and
delivered, broker CPU per event (its whole process: forwarding, ring, heartbeats, lookups), publish-to-
orchestrator latency p50/p99 (the envelope's send timestamp against the receive time, one host clock) and the
orchestrator's subscription CPU per episode (20 events). **Headroom** is the largest count sustained (p99 <
50 ms and >= 95% of the offered events delivered) over 64 and over 256: the factor by which this machine's
bus could grow past the model run (the goal is >= 4 at 64). The projection fits the broker's CPU to the event
copies it sends (events x subscribers: the fan-out grows with the node count twice) over the counts
sustained, and extrapolates to 64 and 256 nodes.

Also reported: the CPU the simulated subscribers spend reading what the broker sends them (``readers core``),
and the CPU the simulated nodes spend publishing, heartbeating and looking up (``nodes core``): on real hosts
each node pays its own, here it comes off the same two cores. So the simulated nodes and subscribers run at the
lowest CPU priority, yielding to the broker and the orchestrator being measured, and the simulated nodes wake
once a millisecond (``TICK_S``) to send what fell due instead of waking for every event.
``--whole-stream-trackers`` runs the baseline, peer trackers subscribed to the whole stream (as before topic
filtering), for before/after figures from the same code.

    python -m bench.scale [--quick] [--json PATH] [--nodes 16 64 128 ...] [--whole-stream-trackers]

On a 2-core machine every process of the simulation shares the cores with the broker, so the figures are a
lower bound for a broker with a host of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import zmq
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.peers import KINDS as PEER_KINDS
from refbus.bus.pubsub import Publisher
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import EVENT_OPTIONS, make_socket
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Delete, Heartbeat, Hello, NodeInfo, Nodes, Sync

from bench.harness import WAIT_S, BenchError, Channel, lower_priority, run_line, workers, write_json

LOOPBACK = "tcp://127.0.0.1:0"
P99_LIMIT_S = 0.050
DELIVERED_SHARE = 0.95
PUBLISHER_PROCESSES = 2
TICK_S = 0.001  # the simulated nodes publish what fell due once a tick
WHOLE_STREAM = 2  # subscriptions of the whole stream in a run of any size: the orchestrator and the watcher


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

    @property
    def sustained(self) -> bool:
        return self.p99_ms < P99_LIMIT_S * 1e3 and self.delivered_per_s >= DELIVERED_SHARE * self.offered_per_s


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


def fanout_task(ch: Channel, events_out: str, whole: int, trackers: int) -> dict[str, float]:
    """``whole`` subscriptions of the whole stream (the watcher) and ``trackers`` peer-tracking ones (the
    topics ``runtime.track_peers()`` subscribes to). Each keeps only its latest message (``CONFLATE``), so
    ZeroMQ's I/O thread reads whatever the broker sends off every connection (the broker pays for every copy,
    as with real subscribers) while no Python here costs the machine what real nodes would spend on their
    own cores. Returns the process's CPU seconds and wall seconds from ready to stop."""
    ctx = zmq.Context()
    tracked = [kind.encode() for kind in sorted(PEER_KINDS)] + [Sync.kind.encode()]
    try:
        for index in range(whole + trackers):
            sock = ctx.socket(zmq.SUB)
            sock.linger = 0
            sock.setsockopt(zmq.CONFLATE, 1)
            for topic in [b""] if index < whole else tracked:
                sock.setsockopt(zmq.SUBSCRIBE, topic)
            sock.connect(events_out)
        ch.send("ready")
        cpu, start = time.process_time(), time.perf_counter()
        ch.recv(timeout_s=3600)  # stop
        return {"cpu_s": time.process_time() - cpu, "seconds": time.perf_counter() - start}
    finally:
        ctx.destroy(linger=0)


def publisher_task(ch: Channel, control: str, node_ids: list[str], model: Model, seconds: float) -> dict[str, int]:
    """Simulated inference nodes: each registers, then publishes at the model's per-node rate, heartbeats and
    looks up the registry; for ``seconds`` after ``go``. Returns events sent and requests made."""
    ctx = zmq.Context()
    try:
        nodes = [_SimNode(ctx, control, node_id) for node_id in node_ids]
        ch.send("ready")
        ch.recv()  # go
        body = Delete(blob_ids=[f"env-0-ep-{i:06d}-b0" for i in range(3)], holder="trainer-0", reason="trained")
        interval = 1.0 / (model.events_per_node_s * len(nodes))
        start = time.perf_counter()
        due = start
        sent = requests = 0
        # Requests spread evenly: heartbeats and lookups of all nodes, one due every so often.
        requests_due = [(start + model.heartbeat_s * i / len(nodes), model.heartbeat_s, i, True)
                        for i in range(len(nodes))]
        requests_due += [(start + model.lookup_s * i / len(nodes), model.lookup_s, i, False) for i in range(len(nodes))]
        heapq.heapify(requests_due)
        waiting: dict[zmq.Socket, int] = {}  # control sockets with replies due -> how many
        cpu = time.process_time()
        while (now := time.perf_counter()) - start < seconds:
            while due <= now:
                nodes[sent % len(nodes)].publisher.publish(body)
                sent += 1
                due += interval
            while requests_due[0][0] <= now:
                at, every, index, beat = heapq.heappop(requests_due)
                node = nodes[index]
                node.control.send(Heartbeat(node_id=node.node_id) if beat else Nodes(role="env-server"))
                waiting[node.control.sock] = waiting.get(node.control.sock, 0) + 1
                requests += 1
                heapq.heappush(requests_due, (at + every, every, index, beat))
            for sock in [sock for sock, _ in zmq.zmq_poll([(sock, zmq.POLLIN) for sock in waiting], 0)]:
                sock.recv_multipart()
                waiting[sock] -= 1
                if not waiting[sock]:
                    del waiting[sock]
            # The simulated nodes' own CPU is not the bus's: wake once a tick and send what fell due meanwhile,
            # instead of once per event (thousands of wake-ups a second stole a core from the broker).
            time.sleep(max(TICK_S, min(due, requests_due[0][0]) - time.perf_counter()))
        return {"sent": sent, "requests": requests, "cpu_s": time.process_time() - cpu}
    finally:
        ctx.destroy(linger=0)


class _SimNode:
    """One simulated node: registered (``hello``), its own PUB and control connection."""

    def __init__(self, ctx: zmq.Context, control: str, node_id: str) -> None:
        self.node_id = node_id
        codec = WireCodec(node_id)
        self.control = Client(ctx, control, codec, policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
        info = NodeInfo(node_id=node_id, role="env-server", host="scale", pid=0)
        welcome = self.control.request(Hello(node=info, token=codec.new_id())).body
        pub = make_socket(ctx, zmq.PUB, connect=welcome.events_in, options=EVENT_OPTIONS)  # type: ignore[union-attr]
        self.publisher = Publisher(pub, codec)


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


def measure(pool: dict[str, Any], nodes: int, model: Model, settings: Settings) -> Point:
    broker, orchestrator, fanout, pubs = pool["broker"], pool["orchestrator"], pool["fanout"], pool["pubs"]
    broker.submit(broker_task)
    endpoints = broker.message()
    seconds = settings.warmup_s + settings.window_s + 0.5
    orchestrator.submit(orchestrator_task, endpoints["control"], settings.warmup_s, settings.window_s)
    whole, filtered = subscriptions(model, nodes, settings.filtered)
    fanout.submit(fanout_task, endpoints["events_out"], whole - 1, filtered)  # and the orchestrator
    run = secrets.token_hex(3)
    ids = [f"env-{run}-{i}" for i in range(nodes)]
    for index, worker in enumerate(pubs):
        worker.submit(publisher_task, endpoints["control"], ids[index::len(pubs)], model, seconds)
    for worker in (orchestrator, fanout, *pubs):
        if worker.message(WAIT_S + nodes * 0.05) != "ready":
            raise BenchError(f"{worker.name} did not get ready")
    for worker in (broker, orchestrator, *pubs):
        worker.tell("go")
    try:
        seen = orchestrator.result(seconds + WAIT_S)
        sent = [worker.result(seconds + WAIT_S) for worker in pubs]
    finally:
        fanout.tell("stop")
        broker.tell("stop")
        readers = fanout.result()
    cpu = broker.result()
    if not sum(s["sent"] for s in sent):
        raise BenchError(f"the publishers of {nodes} nodes sent nothing")
    events = seen["events"]
    return Point(
        nodes=nodes,
        offered_per_s=nodes * model.events_per_node_s,
        delivered_per_s=events / seen["seconds"],
        broker_cpu_us=1e6 * cpu["cpu_s"] / max(1, cpu["forwarded"]),
        broker_core=cpu["cpu_s"] / cpu["seconds"],
        subscribers=whole,
        peer_trackers=filtered,
        fanout_core=readers["cpu_s"] / readers["seconds"],
        nodes_core=sum(s["cpu_s"] for s in sent) / seconds,
        p50_ms=seen["p50_s"] * 1e3,
        p99_ms=seen["p99_s"] * 1e3,
        orchestrator_cpu_us_per_episode=1e6 * seen["cpu_s"] / max(1, events) * model.events_per_episode,
    )


def sweep(model: Model, settings: Settings) -> list[Point]:
    names = ["scale-broker", "scale-orchestrator", "scale-fanout",
             *(f"scale-pub{i}" for i in range(PUBLISHER_PROCESSES))]
    with workers(*names) as started:
        broker, orchestrator, fanout, *pubs = started
        pool = {"broker": broker, "orchestrator": orchestrator, "fanout": fanout, "pubs": pubs}
        for simulated in (fanout, *pubs):  # what real nodes run on their own hosts yields to what is measured
            simulated.call(lower_priority)
        return [measure(pool, nodes, model, settings) for nodes in settings.sizes]


def headroom(points: Sequence[Point], nodes: int) -> float:
    """The largest node count sustained, over ``nodes`` (0 when none was)."""
    return max((p.nodes for p in points if p.sustained), default=0) / nodes


def format_report(points: Sequence[Point], model: Model, *, filtered: bool = True) -> str:
    lines = [f"Model run: {model.episodes_per_step} episodes/step every {model.step_s:.0f} s on {model.nodes} "
             f"inference nodes, {model.events_per_episode} events/episode, burst x{model.burst:.0f}: "
             f"{model.events_per_node_s:.1f} events/s per node; {model.trainer_ranks} trainer ranks; heartbeats "
             f"every {model.heartbeat_s:.0f} s, a lookup every {model.lookup_s:.0f} s per node; peer trackers "
             f"{'topic-filtered' if filtered else 'on the whole stream (baseline)'}",
             f"  {'nodes':>5s} {'offered/s':>10s} {'delivered/s':>12s} {'broker core':>12s} {'readers core':>13s} "
             f"{'nodes core':>11s} "
             f"{'p50 ms':>8s} {'p99 ms':>8s} {'orch us/episode':>16s}  sustained"]
    for p in points:
        lines.append(f"  {p.nodes:5d} {p.offered_per_s:10.0f} {p.delivered_per_s:12.0f} {p.broker_core:12.0%} "
                     f"{p.fanout_core:13.0%} {p.nodes_core:11.0%} {p.p50_ms:8.2f} {p.p99_ms:8.2f} "
                     f"{p.orchestrator_cpu_us_per_episode:16.1f}  {'yes' if p.sustained else 'no'}")
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
    parser.add_argument("--whole-stream-trackers", action="store_true",
                        help="the baseline: peer trackers subscribe to the whole stream, not by topic")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = dataclasses.replace(settings, sizes=tuple(args.nodes or settings.sizes),
                                   filtered=not args.whole_stream_trackers)
    model = Model()
    started = time.monotonic()
    points = sweep(model, settings)
    print(format_report(points, model, filtered=settings.filtered))
    elapsed = time.monotonic() - started
    print(f"\n{run_line(args.quick, elapsed)}")
    if args.json:
        write_json(args.json, {"model": asdict(model), "settings": asdict(settings),
                               "points": [asdict(p) | {"sustained": p.sustained} for p in points],
                               "headroom": {str(n): headroom(points, n) for n in (64, 256)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
