"""Hostile peers against live nodes of every role that listens: the broker (control and ``events_in``), an env
server, a trainer rank, a rollout worker, a ps-manager and a ps-worker, each its own process.

Every request endpoint gets targeted cases (deep nesting, absurd and zero-size shapes, frame-count
mismatches, huge declared sizes, wrong versions, unknown kinds, REQ-style delimiters, truncated msgpack,
wrong types) and ``REFBUS_FUZZ_CASES`` (default 2,000) seeded random mutations of a valid request. Each
probe gets exactly one reply; targeted ones an ``error`` with a protocol code. Afterwards the node is alive,
its resident memory has not grown without bound, and the same valid request gets a byte-identical reply.
Garbage pushed into ``events_in`` kills neither the broker nor a ``refbus monitor`` subscriber, live or
replaying the ring. A fuzzing client killed with SIGKILL mid-stream leaves the node serving the others.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zmq
from fuzz_support import (
    CASES,
    RSS_GROWTH_KIB,
    Frames,
    Prober,
    mutate,
    nested,
    rss_kib,
    targeted,
    trainer_rank_main,
    with_info,
)
from polling import wait_for
from ps_support import start_cluster
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.up import rendezvous
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import (
    BlobRef,
    Body,
    EpisodeFinished,
    Fetch,
    Generate,
    Heartbeat,
    Keep,
    MicroBatchRefs,
    SampleSlice,
    StepBatch,
    Violation,
)
from refbus.protocol.messages_ps import ManifestQuery, ShardWrite

WAIT_S = 60.0
# Targeted cases whose code is fixed whatever the endpoint.
EXPECTED = {
    "deep-nesting-100k": "malformed",
    "deep-nesting-in-unknown-field": "malformed",
    "deep-nesting-in-header": "malformed",
    "many-empty-maps": "malformed",
    "huge-declared-bin-in-header": "malformed",
    "missing-body": "malformed",
    "only-kind": "malformed",
    "req-style-delimiter": "malformed",
    "wrong-major-version": "version",
    "unknown-kind": "unknown-kind",
    "non-ascii-kind": "malformed",
    "truncated-header": "malformed",
    "ext-in-header": "malformed",
    "absurd-zero-size-shape": "array",
    "too-many-dimensions": "array",
    "huge-declared-frame-size": "array",
}


@dataclass
class Target:
    """A request endpoint, the process behind it, the request mutated there and the valid one checked."""

    endpoint: str
    pid: int
    base: Body
    valid: Body
    has_info: bool = False  # an Any-typed ``info``: 500 levels of nesting there decode, then are refused


@dataclass
class Cluster:
    control: str
    events_in: str
    bus: NodeProcess
    monitor: NodeProcess
    monitor_out: Path
    workdir: Path
    targets: dict[str, Target] = field(default_factory=dict)
    procs: list[NodeProcess] = field(default_factory=list)


def _ref() -> BlobRef:
    return BlobRef(endpoint="tcp://127.0.0.1:1", source="fuzz-env", blob_id="fuzz-blob", fields=["routed_experts"],
                   tokens=4, nbytes=16, checksum=1, routing_shape=[2, 2])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("fuzz")
    bus, control = start_bus(workdir)
    procs: list[NodeProcess] = [bus]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    trainer = ctx.Process(target=trainer_rank_main, args=(control, rendezvous(workdir, "test", 0), child), daemon=True)
    monitor_out = workdir / "monitor.jsonl"
    out = open(monitor_out, "wb")  # noqa: SIM115 - closed at teardown
    try:
        trainer.start()

        def spawn(command: list[str], name: str) -> NodeProcess:
            procs.append(NodeProcess(command, workdir=workdir, name=name))
            return procs[-1]

        flags = ["--bus-control", control]
        env = spawn(["node", "env-server", "--node-id", "fuzz-env", *flags], "env")
        monitor = NodeProcess(["monitor", "--json", *flags], workdir=workdir, name="monitor", stdout=out)
        procs.append(monitor)
        ps = start_cluster(spawn, control, "fuzz", workers=1)
        rollout = spawn(["node", "rollout", "--node-id", "fuzz-rollout", "--ps-manager", ps.manager, *flags],
                        "rollout")
        bus_info = bus.info
        env_info, rollout_info = env.wait_ready(WAIT_S), rollout.wait_ready(WAIT_S)
        monitor.wait_ready(WAIT_S)
        assert parent.poll(WAIT_S), "the trainer rank did not start"
        trainer_endpoint = parent.recv()
        worker = ps.workers["w0"]
        assert trainer.pid is not None
        keep = Keep(episode_id="fuzz-episode", info={"reward": 1.0, "ids": [1, 2, 3]}, branches=[{
            "routed_experts": np.arange(16, dtype=np.uint8).reshape(4, 2, 2),
            "topk_ids": np.arange(8, dtype=np.int32).reshape(4, 2),
            "topk_logprobs": np.zeros((4, 2), dtype=np.float32)}])
        step = StepBatch(step=5, rank=99, owned=[], micro_batches=[MicroBatchRefs(
            samples=[SampleSlice("fuzz/0", 4, _ref())], length=4, inputs={"input_ids": np.arange(4)})])
        shard = ShardWrite(lease="fuzz-no-lease", offsets=[0], data=[np.arange(8, dtype=np.uint8)])
        unknown = Heartbeat(node_id="fuzz-nobody", status={"x": 1.0})
        generate = Generate(prompt=[1, 2, 3], max_new_tokens=2)  # no weights exist: refused, deterministically
        cluster = Cluster(control, bus_info["endpoints"]["events_in"], bus, monitor, monitor_out, workdir,
                          procs=procs)
        cluster.targets = {
            "broker-control": Target(control, bus.pid, unknown, unknown),
            "env-server": Target(env_info["endpoints"]["blobs"], env.pid, keep,
                                 Fetch(blob_ids=["fuzz-none"], holder="fuzzer"), has_info=True),
            "trainer-rank": Target(trainer_endpoint, trainer.pid, step, step),
            "rollout": Target(rollout_info["endpoints"]["generate"], rollout.pid, generate, generate),
            "ps-manager": Target(ps.manager, ps.manager_proc.pid, ManifestQuery(version=999),  # type: ignore[union-attr]
                                 ManifestQuery(version=999)),
            "ps-worker": Target(ps.worker_info["w0"]["endpoints"]["ps"], worker.pid, shard, shard),
        }
        yield cluster
    finally:
        for proc in reversed(procs):
            proc.stop()
        if trainer.is_alive():
            trainer.terminate()
        trainer.join(10)
        if trainer.is_alive():
            trainer.kill()
            trainer.join()
        out.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.parametrize("name", ["broker-control", "env-server", "trainer-rank", "rollout", "ps-manager",
                                  "ps-worker"])
def test_hostile_requests_get_one_error_each_and_the_node_serves_on(cluster: Cluster, zctx: zmq.Context,
                                                                      name: str) -> None:
    target = cluster.targets[name]
    prober = Prober(zctx, target.endpoint)
    before = prober.round_trip(target.valid)
    if isinstance(target.base, Keep):  # later valid keeps of the same episode are refused, not kept again
        prober.round_trip(target.base)
    rss_before = rss_kib(target.pid)
    valid: Frames = [bytes(f) for f in prober.codec.encode(target.base)]

    for case, frames in targeted(valid).items():
        reply = prober.ask(frames, case)
        assert reply.kind == "error", (case, reply)
        code = reply.body.code  # type: ignore[union-attr]
        assert code != "internal", (case, reply.body)
        if case in EXPECTED:
            assert code == EXPECTED[case], (case, reply.body)
        if case == "deep-nesting-500" and target.has_info:
            assert code == "malformed" and "limits.max_depth" in reply.body.message, reply.body  # type: ignore[union-attr]

    outcomes: Counter[str] = Counter()
    for index in range(CASES):
        reply = prober.ask(mutate(valid, random.Random(f"{name}:{index}")), f"{name} mutation {index}")
        outcomes[reply.body.code if reply.kind == "error" else reply.kind] += 1  # type: ignore[union-attr]
    assert outcomes["internal"] == 0, outcomes
    assert sum(outcomes.values()) == CASES

    assert _alive(target.pid), f"{name} died"
    assert prober.round_trip(target.valid) == before  # also proves no probe was answered twice
    assert rss_kib(target.pid) - rss_before < RSS_GROWTH_KIB
    prober.close()


def _event_frames(codec: WireCodec, body: Body, seq: int) -> Frames:
    return [bytes(f) for f in codec.encode(body, seq=seq)]


def _printed(out: Path, marker: str) -> bool:
    return marker in out.read_text(errors="replace")


def test_garbage_events_kill_neither_the_broker_nor_subscribers(cluster: Cluster, zctx: zmq.Context) -> None:
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # every garbage event must reach the broker
    pub.connect(cluster.events_in)
    garbage = WireCodec("fuzz-garbage")
    marker_codec = WireCodec("fuzz-marker")
    seq = 0

    def marker(tag: str) -> None:
        nonlocal seq
        seq += 1
        pub.send_multipart(_event_frames(marker_codec, Violation(blob_id=tag, action="fuzz", holder="fuzzer", owner="",
                                                                  detail=""), seq))

    def shown(tag: str, out: Path = cluster.monitor_out) -> bool:
        if not _printed(out, tag):
            marker(tag)  # PUB connects asynchronously: repeat until one got through
            return False
        return True

    wait_for(lambda: shown("fuzz-ready"), WAIT_S, "the monitor printing an event from the fuzzing publisher")
    rss_before = rss_kib(cluster.bus.pid)

    episode = _event_frames(garbage, EpisodeFinished(episode_id="e", source="s", refs=[], info={"x": 1}), 1)
    cases = targeted(episode)
    cases["deep-nesting-100k-event"] = with_info(episode, b"\x81\xa1x" + nested(100_000))
    for frames in cases.values():
        pub.send_multipart(frames)
    for index in range(CASES):
        pub.send_multipart(mutate(episode, random.Random(f"events:{index}")))
    one_frame = [bytes(f) for f in garbage.encode(EpisodeFinished(episode_id="e", source="s", refs=[], info={"x": 1}),
                                                  seq=2, one_frame=True)]
    for index in range(CASES):  # the one-frame form: kind, header length, header and body in one frame
        pub.send_multipart(mutate(one_frame, random.Random(f"one-frame-events:{index}")))
    wait_for(lambda: shown("fuzz-done"), WAIT_S, "the monitor printing an event sent after the garbage")

    assert _alive(cluster.bus.pid) and cluster.bus.proc.poll() is None, cluster.bus.log_tail()
    assert cluster.monitor.proc.poll() is None, cluster.monitor.log_tail()
    assert rss_kib(cluster.bus.pid) - rss_before < RSS_GROWTH_KIB

    # The ring holds the garbage: a replaying subscriber and a raw replay must get through it.
    runtime = NodeRuntime("fuzz-replayer", RuntimeSettings(bus=cluster.control, metrics_port=-1), register=False)
    try:
        replayed = runtime.replay(since=0)
    finally:
        runtime.close()
    assert any(isinstance(e.body, Violation) and e.body.blob_id == "fuzz-done" for e in replayed)
    replay_out = cluster.workdir / "replaying-monitor.jsonl"
    with open(replay_out, "wb") as out, NodeProcess(["monitor", "--json", "--since", "0", "--bus-control",
                                                     cluster.control], workdir=cluster.workdir,
                                                    name="replaying-monitor", stdout=out) as replaying:
        replaying.wait_ready(WAIT_S)
        wait_for(lambda: _printed(replay_out, "fuzz-done"), WAIT_S, "the replaying monitor past the garbage")
        assert replaying.proc.poll() is None, replaying.log_tail()
    pub.close()


def test_a_fuzzing_client_killed_mid_stream_leaves_the_node_serving(cluster: Cluster, zctx: zmq.Context) -> None:
    target = cluster.targets["env-server"]
    prober = Prober(zctx, target.endpoint)
    before = prober.round_trip(target.valid)
    fuzzer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuzz_support.py")), target.endpoint],
                              stdout=subprocess.PIPE)
    try:
        assert fuzzer.stdout is not None
        assert fuzzer.stdout.readline() == b"started\n"
        fuzzer.send_signal(signal.SIGKILL)
        assert fuzzer.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if fuzzer.poll() is None:
            fuzzer.kill()
            fuzzer.wait()
        if fuzzer.stdout is not None:
            fuzzer.stdout.close()
    assert _alive(target.pid)
    assert prober.round_trip(target.valid) == before
    prober.close()
