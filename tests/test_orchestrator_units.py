"""Orchestrator pieces without a cluster: replica routing, trainer addressing, where a blob's store is asked. And
one garbage record over the wire: a real broker, env server and orchestrator, a stand-in trainer rank."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from branches import random_arrays
from polling import wait_for
from refbus.bus.reqrep import Client, HandlerError, PeerDown, Pending, RequestTimeout, RetryPolicy, Server
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import send_frames
from refbus.bus.stall import PassStalls
from refbus.nodes.launch import NodeProcess
from refbus.nodes.payload.charges import episode_charge
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.orchestrator import IDLE_LOG_S, Orchestrator
from refbus.nodes.payload.orchestrator_core import Deadlines
from refbus.nodes.payload.restarts import StoreRestarts
from refbus.nodes.payload.shipping import (
    HandedOver,
    ReplicaRouter,
    Taker,
    TrainerAddress,
    TrainSink,
    group_by_endpoint,
    registry_locator,
)
from refbus.nodes.settings import EnvServerSettings, OrchestratorSettings
from refbus.protocol import envelope
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    DELETE_REASONS,
    THIRD_PARTY_HAND_OVER,
    Accounted,
    Accounts,
    BlobRef,
    Body,
    Claim,
    Claimed,
    Delete,
    Deleted,
    EpisodeFinished,
    Held,
    HeldEpisode,
    HoldingsQuery,
    Keep,
    Kept,
    NodeInfo,
    Ok,
    Reference,
    Run,
    StepBatch,
    VersionBump,
)
from structlog.testing import capture_logs

WAIT_S = 10.0
STALLER = Path(__file__).with_name("stalled_env_server.py")


def _env(node_id: str, source: str | None, endpoint: str) -> NodeInfo:
    labels = {"source": source} if source else {}
    return NodeInfo(node_id=node_id, role="env-server", host="h", pid=1, endpoints={"blobs": endpoint},
                    labels=labels)


def test_runs_go_to_the_replica_of_their_source_with_the_fewest_in_flight() -> None:
    router = ReplicaRouter()
    router.update([
        _env("a0", "A", "tcp://a0"), _env("a1", "A", "tcp://a1"), _env("solo", None, "tcp://solo"),
        NodeInfo(node_id="r", role="rollout", host="h", pid=2, endpoints={"generate": "tcp://r"}),
    ])
    assert router.replicas == {"A": ["tcp://a0", "tcp://a1"], "solo": ["tcp://solo"]}
    picks = [router.pick("A", f"e{n}") for n in range(4)]
    assert sorted(picks) == ["tcp://a0", "tcp://a0", "tcp://a1", "tcp://a1"]
    router.done("tcp://a1")
    assert router.pick("A", "e4") == "tcp://a1"  # a1 has one in flight now, a0 two
    router.done("tcp://never-picked")  # harmless
    assert router.in_flight["tcp://never-picked"] == 0
    with pytest.raises(LookupError, match="no live env-server replica for source 'B'"):
        router.pick("B", "e5")


def test_trainer_addresses_come_from_registry_labels_and_are_checked() -> None:
    node = NodeInfo(node_id="t1", role="trainer", host="h", pid=3, endpoints={"trainer": "tcp://t1"},
                    labels={"rank": "1", "data_rank": "0", "leader": "0"})
    assert TrainerAddress.from_node(node) == TrainerAddress("tcp://t1", 1, 0, leader=False)
    sink = TrainSink(holder=None, seq_len=64, max_staleness=1)  # type: ignore[arg-type]
    sink.use_trainers([TrainerAddress("tcp://t1", 1, 0, leader=False), TrainerAddress("tcp://t0", 0, 0)])
    assert [t.endpoint for t in sink.trainers] == ["tcp://t0", "tcp://t1"]  # leader first
    assert sink.data_ranks == 1
    with pytest.raises(ValueError, match="exactly one leader"):
        sink.use_trainers([TrainerAddress("tcp://t0", 0, 0), TrainerAddress("tcp://t1", 1, 0)])
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        sink.use_trainers([TrainerAddress("tcp://t0", 0, 1)])


def _ref(blob_id: str, endpoint: str, node: str = "") -> BlobRef:
    return BlobRef(endpoint=endpoint, source="s", blob_id=blob_id, fields=["topk_ids"], tokens=1, nbytes=4, checksum=0,
                   node=node)


def test_hand_overs_are_kept_per_store_until_deleted_and_never_beyond_their_bound() -> None:
    """What the orchestrator handed over is kept by store, step and rank (the process named) for a store's restart,
    until a ``delete`` event names it or its store is lost; references without a store node id are not kept. Beyond
    the bound the oldest are dropped before memory grows, counted and logged loudly."""
    rank, other = Taker("trainer-0", ("h", 1, 1.0)), Taker("trainer-1", ("h", 2, 1.0))
    handed = HandedOver(limit=4)
    handed.add(0, rank, [_ref("a", "tcp://e:1", "env-0"), _ref("b", "tcp://e:2", "env-1"), _ref("c", "tcp://e:3")])
    handed.add(1, other, [_ref("d", "tcp://e:1", "env-0")])
    assert handed.at("env-0") == {(0, rank): ["a"], (1, other): ["d"]} and handed.at("env-1") == {(0, rank): ["b"]}
    handed.gone(["a", "nope"])
    handed.forget_store("env-1")
    assert (handed.at("env-0"), handed.at("env-1"), len(handed)) == ({(1, other): ["d"]}, {}, 1)
    with capture_logs() as logs:
        handed.add(2, rank, [_ref(f"x{i}", "tcp://e:1", "env-0") for i in range(5)])
    assert (len(handed), handed.forgotten) == (4, 2)
    assert handed.at("env-0") == {(2, rank): ["x1", "x2", "x3", "x4"]}
    assert [(e["event"], e["log_level"], e["blobs"]) for e in logs] == [("handover.forgotten", "error", 2)]


@pytest.mark.parametrize("group_size", [1, 2])
def test_a_group_size_that_can_never_train_is_said_at_start(bus: tuple[NodeProcess, str], group_size: int) -> None:
    """A group of one has advantage 0, so every training group is filtered and no step ever ships: allowed (a
    dispatch or eval exercise), but said at start, naming the setting. Before, such a run generated for ever in
    silence."""
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=bus[1], node_id="orchestrator", metrics_port=-1))
    try:
        with capture_logs() as logs:
            Orchestrator(runtime, OrchestratorSettings(group_size=group_size))
    finally:
        runtime.close()
    warned = [e for e in logs if e["event"] == "orchestrator.group_of_one"]
    assert len(warned) == (group_size == 1) and all("orchestrator.group_size" in e["detail"] for e in warned)


def _stand_in_rank(control: str) -> tuple[NodeRuntime, Server]:
    """A stand-in ``trainer-0`` (rank 0, its data rank's leader) that heartbeats step 0 as a fresh rank does, and
    its ``trainer`` server, on which the test says what a step batch does."""
    trainer = NodeRuntime("trainer", RuntimeSettings(bus=control, node_id="trainer-0", metrics_port=-1))
    server = trainer.serve("trainer", "tcp://127.0.0.1:0")
    trainer.labels.update(rank="0", data_rank="0", leader="1")
    trainer.status = lambda: {"step": 0.0}
    return trainer, server


def test_claims_and_deletes_go_to_where_the_registry_says_the_store_is_now() -> None:
    """A store restarted on another port is asked at its new endpoint; a reference without a node, or whose store
    the registry does not list live, at the endpoint recorded at keep time."""
    moved, kept, unnamed = _ref("a", "tcp://old:1", "env-0"), _ref("b", "tcp://old:2", "env-1"), _ref("c", "tcp://old:3")
    also_moved = _ref("d", "tcp://old:1", "env-0")
    registry = {("env-0", "blobs"): "tcp://new:9"}
    locate = registry_locator(lambda node, name: registry.get((node, name)))
    assert group_by_endpoint([moved, kept, unnamed, also_moved], locate) == {
        "tcp://new:9": [moved, also_moved], "tcp://old:2": [kept], "tcp://old:3": [unnamed]}
    assert group_by_endpoint([moved, kept]) == {"tcp://old:1": [moved], "tcp://old:2": [kept]}


def test_a_claim_past_its_grace_is_sent_again_only_to_a_store_back_or_awaited_and_only_for_its_bound() -> None:
    """Within the grace every claim that failed for want of a durable store is sent again; past it, for ``back_s``
    more, only one whose stores are all back or still awaited (its restarted process registered as the grace
    ended); past that, none. Answered claims and claims on stores that keep nothing across a restart never are."""
    back = {"env-back"}
    restarts = StoreRestarts(lambda node: node != "env-plain", lambda delay, callback: None, wait_s=2.0,
                             back=back.__contains__, back_s=3.0)
    claims = {node: Claim(blob_ids=[node], holder="orchestrator") for node in ("env-back", "env-gone", "env-plain")}
    sent: list[Any] = [((f"tcp://{node}", claim), PeerDown(f"tcp://{node}", "reported down"))
                       for node, claim in claims.items()]
    sent.append((("tcp://env-back", Claim(blob_ids=["env-back"], holder="orchestrator")), Claimed(blob_ids=[])))
    sent.append((("tcp://env-gone", Claim(blob_ids=["env-gone"], holder="orchestrator")), RequestTimeout("none")))

    def again(elapsed_s: float) -> list[str] | None:
        waiting = restarts.waiting(sent, lambda blob_id: blob_id, elapsed_s)
        return None if waiting is None else [claim.blob_ids[0] for claim in waiting]

    assert again(1.9) == ["env-back", "env-gone", "env-gone"]
    assert again(2.0) == again(4.9) == ["env-back"]
    assert again(5.0) is None
    back.clear()
    assert again(2.0) is None


@contextlib.contextmanager
def _running(orchestrator: Orchestrator, *peers: NodeRuntime) -> Iterator[list[NodeRuntime]]:
    """Start ``peers``, then the orchestrator's node, each on its own loop thread, and wait for the
    orchestrator's start-up recovery; when the block ends, however it ends, join every node started, the last
    started first. Yields the nodes to join: a test that stops one itself removes it."""
    started: list[NodeRuntime] = []
    try:
        for node in (*peers, orchestrator.runtime):
            node.start_background()
            started.append(node)
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        yield started
    finally:
        for node in reversed(started):
            node.join(timeout=WAIT_S)


def test_a_malformed_episode_record_is_deleted_malformed_and_later_groups_still_train(
        bus: tuple[NodeProcess, str]) -> None:
    """An env server publishes an episode whose loss_mask is shorter than its token ids: the orchestrator claims
    its blob and deletes it (reason ``malformed``) at once; the next group trains. Before, the record was taken
    and made its step's packing raise: that step's blobs stayed held and nothing shipped again."""
    control = bus[1]
    steps: list[StepBatch] = []

    def take(request: Message) -> Ok:
        assert isinstance(request.body, StepBatch)
        steps.append(request.body)
        return Ok()

    trainer, rank_server = _stand_in_rank(control)
    rank_server.on(StepBatch.kind, take)
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-w", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="w"))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))

    def keep(episode_id: str, group: str, reward: float, loss_mask: list[int]) -> str:
        arrays = random_arrays(6, seed=len(episode_id), layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
        info: dict[str, Any] = {"group": group, "reward": reward,
                                "samples": [{"input_ids": list(range(6)), "loss_mask": loss_mask, "ref": 0}]}
        return env.keep(episode_id, [arrays], info=info)[0].blob_id

    with _running(orchestrator, trainer, env_runtime):
        bad = keep("bad", "gb", 1.0, [0, 1, 1])
        wait_for(lambda: env.stats().deleted.get("malformed"), 10, "the malformed episode's blob deleted")
        good = [keep(f"good-{m}", "gg", reward, [0, 0, 1, 1, 1, 1]) for m, reward in enumerate((1.0, 0.0))]
        wait_for(lambda: steps, 10, "a step batch at the trainer rank")
        assert sorted(steps[0].owned) == sorted(good)
        assert {s.sample_id for mb in steps[0].micro_batches for s in mb.samples} == {"good-0/0", "good-1/0"}
        wait_for(lambda: not orchestrator.core.holdings.held, 10, "the step batch acknowledged")
        stats = env.stats()
        assert stats.deleted == {"malformed": 1} and stats.blobs_held == 2 and bad not in good
        assert orchestrator.core.malformed_episodes == 1 and +orchestrator.core.sink.dropped == {"malformed": 1}


def test_references_to_stores_the_registry_does_not_list_are_not_claimed_and_leave_no_socket(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """A peer publishes episodes whose references name stores no node registered (or a node that is no env
    server), each at an endpoint of its own: the orchestrator claims none of them and opens no socket for them,
    and a real store's episode is still claimed. Before, it kept a client (a file descriptor) for every such
    endpoint for good: 1,200 forged events exhausted its descriptors and real claims failed."""
    control = bus[1]
    forger = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="forger", metrics_port=-1))
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-r", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="r"))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1,
                                                          retry=SHORT_RETRY))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))
    forged = 64

    def forge() -> None:
        for i in range(forged):  # half name a node nobody registered, half the forger (no env server)
            ref = BlobRef(endpoint=f"ipc://{tmp_path}/nowhere-{i}", source="s", blob_id=f"b{i}",
                          fields=["routed_experts"], tokens=1, nbytes=1, checksum=0,
                          node=f"ghost-{i}" if i % 2 else "forger")
            forger.publish(EpisodeFinished(episode_id=f"e{i}", source="s", refs=[ref]))

    with _running(orchestrator, forger, env_runtime):
        descriptors = len(os.listdir("/proc/self/fd"))
        forger.call_soon(forge)
        wait_for(lambda: orchestrator.core.episodes >= forged, WAIT_S, "the forged episodes fed to the core")
        assert orchestrator.claimed == 0 and orchestrator.missing == forged
        assert len(os.listdir("/proc/self/fd")) < descriptors + forged // 4, "a socket per forged endpoint"
        arrays = random_arrays(6, seed=1, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
        env.keep("real", [arrays], info={"group": "g", "reward": 1.0,
                                         "samples": [{"input_ids": list(range(6)), "loss_mask": [1] * 6, "ref": 0}]})
        wait_for(lambda: env.stats().held_by.get("orchestrator") == 1, WAIT_S, "the real store's blob claimed")


def test_the_orchestrators_shutdown_settles_the_claims_and_step_batches_still_in_flight(
        bus: tuple[NodeProcess, str]) -> None:
    """The store grants a claim and the trainer rank acknowledges a step batch only once the orchestrator has
    begun to stop: its shutdown waits for both answers, deletes the blob the late claim granted (``shutdown``)
    and leaves the acknowledged batch's blobs to the rank. Before, both were dropped unanswered: the granted
    blob stayed held by a node that was gone (a run ended with blobs held at its end), and the batch's blobs
    were deleted under the rank that had taken them."""
    control = bus[1]
    deferred_steps: list[Pending] = []
    deferred_claims: list[tuple[Pending, Message]] = []
    defer_claims = threading.Event()

    def take(request: Message) -> None:
        deferred_steps.append(rank_server.pending)  # answered by the test

    trainer, rank_server = _stand_in_rank(control)
    rank_server.on(StepBatch.kind, take)
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-s", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="s"))
    grant = env.server.routes[Claim.kind].handler

    def claim(request: Message) -> Claimed | None:
        if not defer_claims.is_set():
            return grant(request)
        deferred_claims.append((env.server.pending, request))  # answered by the test (a resend appends again)
        return None

    env.server.on(Claim.kind, claim)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))

    def keep(episode_id: str, group: str, reward: float) -> str:
        arrays = random_arrays(6, seed=len(episode_id), layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
        info: dict[str, Any] = {"group": group, "reward": reward,
                                "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1], "ref": 0}]}
        return env.keep(episode_id, [arrays], info=info)[0].blob_id

    stopper = threading.Thread(target=runtime.join, kwargs={"timeout": 30})
    with _running(orchestrator, trainer, env_runtime):
        try:
            shipped = {keep(f"a-{m}", "ga", reward) for m, reward in enumerate((1.0, 0.0))}
            wait_for(lambda: deferred_steps, 10, "the step batch at the trainer rank, unanswered")
            defer_claims.set()
            late = keep("b-0", "gb", 1.0)
            wait_for(lambda: deferred_claims, 10, "the next episode's claim at the store, unanswered")
            stopper.start()
            wait_for(lambda: orchestrator._closing, 10, "the orchestrator's shutdown under way")
            trainer.call_soon(lambda: [rank_server.answer(pending, Ok()) for pending in deferred_steps])
            # Garbage first on the claim's connection: rejected (counted), and the real answer still settles it.
            env_runtime.call_soon(lambda: [(send_frames(env.server.sock, [pending.identity, b"\xc1 not a reply"]),
                                            env.server.answer(pending, grant(request)))
                                           for pending, request in deferred_claims])
            stopper.join(timeout=30)
            assert not stopper.is_alive()
            stats = env.stats()
            assert stats.deleted == {"shutdown": 1} and stats.blobs_held == 2, stats
            calls = runtime.calls
            assert calls.rejected.total() >= 1 and calls.outcomes["reply"] >= 2, calls.rejected
            assert late not in shipped
        finally:  # the stopper joins the orchestrator's node: before the others are joined
            if stopper.is_alive():
                stopper.join(timeout=30)


def test_a_store_sigkilled_while_the_orchestrators_shutdown_waits_for_its_claim_ends_the_wait_in_bounds(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """The env server stalls on the orchestrator's claim (nothing granted yet), the orchestrator begins to stop
    and waits for that answer, and the store is SIGKILLed: the wait ends within its share of the shutdown
    time, the claim is reported unanswered (its blobs are the store's to reclaim) and the rest of the
    shutdown runs, never cut off at the node's deadline."""
    control = bus[1]
    marker = tmp_path / "stalled"
    store = spawn(["node", "env-server", "--bus-control", control, "--node-id", "env-k", "--store-directory",
                   str(tmp_path / "shm"), "--store-run", "stall"], "env-k",
                  prefix=[sys.executable, str(STALLER), "claim", str(marker)])
    endpoint = store.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))
    stopper = threading.Thread(target=runtime.join, kwargs={"timeout": WAIT_S})
    producer = Client(zmq_ctx := zmq.Context(), endpoint, WireCodec("producer"),
                      policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    try:
        runtime.start_background()
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        info = {"group": "gk", "reward": 1.0,
                "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1], "ref": 0}]}
        arrays = random_arrays(6, seed=3, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
        assert isinstance(producer.request(Keep(episode_id="k-0", branches=[arrays], info=info)).body, Kept)
        wait_for(marker.exists, WAIT_S, "the store stalled on the orchestrator's claim")
        with capture_logs() as logs:
            stopper.start()
            wait_for(lambda: orchestrator._closing, WAIT_S, "the orchestrator's shutdown under way")
            store.proc.kill()
            assert store.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
            stopper.join(timeout=WAIT_S)
            assert not stopper.is_alive() and runtime.closed
        events = [entry["event"] for entry in logs]
        assert "node.shutdown_hook_cut_off" not in events, events
        assert any(entry["event"] == "shutdown.unanswered" and entry["claims"] == 1 for entry in logs), events
    finally:
        producer.close()
        if stopper.is_alive():
            stopper.join(timeout=WAIT_S)
        elif not stopper.ident:
            runtime.join(timeout=WAIT_S)
        zmq_ctx.destroy(linger=0)


def test_a_store_whose_holdings_cursor_does_not_advance_ends_its_recovery_instead_of_paging_for_ever(
        bus: tuple[NodeProcess, str]) -> None:
    """A store answers the restarted orchestrator's ``holdings`` with a page that says there is more but whose
    cursor does not move past the one asked: the page's episode is still claimed and recovered, the store is
    not asked again, and the recovery ends (logged, naming the store). Before, the orchestrator asked for the
    same page for ever and its recovery never ended, so nothing was ever dispatched."""
    control = bus[1]
    store = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-g", metrics_port=-1))
    server = store.serve("blobs", "tcp://127.0.0.1:0")
    asked: list[HoldingsQuery] = []
    claims: list[Claim] = []
    ref = BlobRef(endpoint="tcp://127.0.0.1:1", source="g", blob_id="b-g", fields=["routed_experts"], tokens=6,
                  nbytes=48, checksum=0, routing_shape=[2, 2], node="env-g")
    record = EpisodeFinished(episode_id="g-0", source="g", refs=[ref], info={
        "group": "gg", "reward": 1.0, "samples": [{"input_ids": list(range(6)), "ref": 0}]})

    def holdings(request: Message) -> Held:
        assert isinstance(request.body, HoldingsQuery)
        asked.append(request.body)
        return Held(episodes=[HeldEpisode(episode=record, unclaimed=["b-g"])], cursor=request.body.after, more=True)

    def claim(request: Message) -> Claimed:
        assert isinstance(request.body, Claim)
        claims.append(request.body)
        return Claimed(blob_ids=request.body.blob_ids)

    server.on(HoldingsQuery.kind, holdings, cached=False)
    server.on(Claim.kind, claim)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))
    with capture_logs() as logs, _running(orchestrator, store):
        assert [query.after for query in asked] == [0]
        assert [c.blob_ids for c in claims] == [["b-g"]]
        assert orchestrator.core.recovered_episodes == 1 and set(orchestrator.core.holdings.held) == {"b-g"}
        stuck = [entry for entry in logs if entry["event"] == "recovery.cursor_stuck"]
        assert [(entry["node"], entry["after"], entry["cursor"]) for entry in stuck] == [("env-g", 0, 0)]


SHORT_RETRY = RetryPolicy(timeout_s=0.2, attempts=2)  # a request gives up after 0.6 s


def _kept_episode(env: EnvServer, episode_id: str, **info: Any) -> str:
    """Keep one 6-token episode on ``env`` (its record ``info`` plus one sample pointing to its blob)."""
    arrays = random_arrays(6, seed=len(episode_id), layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
    record = {"reward": 1.0, **info, "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1],
                                                  "ref": 0}]}
    return env.keep(episode_id, [arrays], info=record)[0].blob_id


def _peer_store_and_orchestrator(control: str, peer: str, source: str, *, groups_per_step: int
                                 ) -> tuple[NodeRuntime, EnvServer, Orchestrator]:
    """A peer's node (``peer``, posing as an env server to publish what it likes), a real env server of ``source``
    (node ``env-SOURCE``) and a non-dispatching orchestrator of one trainer, groups of two; none started."""
    peer_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id=peer, metrics_port=-1))
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id=f"env-{source}", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source=source))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=groups_per_step, seq_len=64))
    return peer_runtime, env, orchestrator


@pytest.mark.parametrize("replayed", [False, True], ids=["answered", "replay-refused"])
def test_a_claim_a_live_store_grants_after_it_gave_up_is_claimed_again_and_deleted(
        bus: tuple[NodeProcess, str], replayed: bool) -> None:
    """The store works through a backlog: the orchestrator's claim is granted only after every attempt of it
    went unanswered. The episode goes on without the blob (``missing``); the orchestrator claims it again (a
    repeat is answered ``already``) and deletes it (``claim-failed``). Before, the claim only counted as
    missing: the store kept the blob as the orchestrator's, which knew nothing of it, until its shutdown.
    ``replay-refused``: the claim again is refused as a replay (a resend whose first answer left the store's
    reply cache); claims being idempotent, a new request asks again (it was given up, the blob kept)."""
    control = bus[1]
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-c", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="c"))
    grant = env.server.routes[Claim.kind].handler
    backlog: list[tuple[Pending, Message]] = []
    worked_through = threading.Event()

    def work_through_backlog() -> None:
        worked_through.set()
        for pending, request in backlog:  # in order, as a store answers what it received
            env.server.answer(pending, grant(request))
        backlog.clear()

    refused: list[str] = []

    def claim(request: Message) -> Claimed | None:
        # Every attempt of the first claim waits in the backlog (a deferred reply is not cached: each one comes here).
        if not worked_through.is_set() and (not backlog or backlog[0][1].header.id == request.header.id):
            backlog.append((env.server.pending, request))
            return None
        work_through_backlog()
        if replayed and not refused:
            refused.append(request.header.id)
            raise HandlerError("replay", "answered already; its answer is no longer cached")
        return grant(request)

    env.server.on(Claim.kind, claim)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1,
                                                          retry=SHORT_RETRY))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))
    with _running(orchestrator, env_runtime):
        blob_id = _kept_episode(env, "c-0", group="gc")
        wait_for(lambda: orchestrator.missing, WAIT_S, "the orchestrator giving up its claim")
        env_runtime.call_soon(work_through_backlog)  # granted now: held by the orchestrator in the store
        wait_for(lambda: env.stats().deleted.get("claim-failed"), WAIT_S, "the late-granted blob deleted")
        stats = env.stats()
        assert stats.deleted == {"claim-failed": 1} and stats.blobs_held == 0 and not stats.violations, stats
        assert orchestrator.missing == 1 and blob_id not in orchestrator.core.holdings.held
        assert len(refused) == int(replayed)


def test_a_delete_whose_first_attempts_a_live_store_never_got_is_sent_again_as_the_same_request(
        bus: tuple[NodeProcess, str]) -> None:
    """The store never gets the first attempts of a delete (lost on the way) and stays live: the orchestrator
    sends the same request again (one request id, so a store that had deleted answers from its reply cache)
    past its retry schedule, and the blob is deleted once. Before, the delete was given up after the schedule
    and the blob, gone from the orchestrator's holdings, stayed in the store as its own."""
    control = bus[1]
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-d", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="d"))
    delete = env.server.routes[Delete.kind].handler
    received: list[str] = []

    def lossy(request: Message) -> Deleted | None:
        received.append(request.header.id)
        if len(received) <= SHORT_RETRY.attempts:
            return None  # lost: never answered
        return delete(request)

    env.server.on(Delete.kind, lossy)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1,
                                                          retry=SHORT_RETRY))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64),
                                Deadlines(busy_store_s=WAIT_S))
    with _running(orchestrator, env_runtime):
        _kept_episode(env, "e-0", group="ge", eval=True)  # scored, never trained: deleted ``eval`` at once
        wait_for(lambda: env.stats().deleted.get("eval"), WAIT_S, "the eval episode's blob deleted")
        stats = env.stats()
        assert stats.deleted == {"eval": 1} and stats.blobs_held == 0 and not stats.violations, stats
        assert len(received) == SHORT_RETRY.attempts + 1 and len(set(received)) == 1, received
        assert orchestrator.failed_deletes == 0


def test_a_delete_its_store_carried_out_before_it_was_reported_down_goes_again_as_the_same_request(
        bus: tuple[NodeProcess, str]) -> None:
    """The store carries out the orchestrator's delete, then its loop stalls past the node timeout before it
    answers: the broker reports it down, the delete waits for it, and the same process comes back (it joins
    again). The delete goes out again under its request id, and the store answers it from its reply cache: the
    blob is deleted once, no violation. Before, it went out as a new request, a second delete of a deleted blob,
    which the store counted as a violation."""
    control = bus[1]
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-r", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="r"))
    delete = env.server.routes[Delete.kind].handler
    carried_out: list[str] = []
    answer = threading.Event()

    def stall_before_answering(request: Message) -> Body | None:
        deleted = delete(request)
        carried_out.append(request.header.id)
        if len(carried_out) == 1:
            answer.wait(WAIT_S)  # no heartbeat goes out meanwhile: the broker reports the node down
        return deleted

    env.server.on(Delete.kind, stall_before_answering)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64),
                                Deadlines(restart_grace_s=WAIT_S))
    with _running(orchestrator, env_runtime):
        try:
            _kept_episode(env, "r-0", group="gr", eval=True)  # scored, never trained: deleted ``eval`` at once
            wait_for(lambda: (down := orchestrator.core.stores_down.get("env-r")) is not None and down.deletes, WAIT_S,
                     "the delete waiting for its store, reported down before it answered")
            answer.set()
            wait_for(lambda: orchestrator.deleted or env.stats().violations, WAIT_S,
                     "the delete sent again once the store is back, answered")
            stats = env.stats()
            assert stats.deleted == {"eval": 1} and stats.blobs_held == 0 and not stats.violations, stats
            assert len(carried_out) == 1 and orchestrator.deleted == {"eval": 1}, carried_out
            assert orchestrator.failed_deletes == 0 and "env-r" not in orchestrator.core.stores_down
        finally:  # the store's loop waits for this: set before it is joined
            answer.set()


def test_a_delete_a_killed_durable_store_carried_out_is_answered_done_by_its_restarted_process(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """The durable store commits the orchestrator's delete and is SIGKILLed before it answers; restarted under
    its node id, it re-adopts the store (with the delete's tombstone) on another port. The delete, waiting for
    the store, goes to the new process under its request id: that process has no reply cache, runs it and
    answers the blob its predecessor deleted as done (``repeated``): deleted once, no violation."""
    control = bus[1]
    marker = tmp_path / "stalled"
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-k", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "deleted", "--env-server-handover-lease-s", "600"]
    store = spawn(command, "env-k", prefix=[sys.executable, str(STALLER), "deleted", str(marker)])
    endpoint = store.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64),
                                Deadlines(restart_grace_s=3 * WAIT_S))
    ctx = zmq.Context()
    producer = Client(ctx, endpoint, WireCodec("producer"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    try:
        with _running(orchestrator):
            info = {"group": "gk", "reward": 1.0, "eval": True,  # scored, never trained: deleted ``eval`` at once
                    "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1], "ref": 0}]}
            arrays = random_arrays(6, seed=3, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
            assert isinstance(producer.request(Keep(episode_id="k-0", branches=[arrays], info=info)).body, Kept)
            wait_for(marker.exists, WAIT_S, "the store stalled, the orchestrator's delete carried out and unanswered")
            store.proc.kill()
            assert store.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
            restarted = spawn(command, "env-k-restarted").wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
            wait_for(lambda: orchestrator.deleted or orchestrator.failed_deletes or orchestrator.lost, WAIT_S,
                     "the delete's outcome at the restarted store")
            assert orchestrator.deleted == {"eval": 1} and not orchestrator.failed_deletes and not orchestrator.lost
            probe = Client(ctx, restarted, WireCodec("probe"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
            account = probe.request(Accounts()).body
            probe.close()
            assert isinstance(account, Accounted)
            assert account.deleted == {"eval": 1} and account.held == 0 and not account.violations, account
    finally:
        producer.close()
        ctx.destroy(linger=0)


def test_a_step_batch_its_rank_took_before_leaving_unanswered_is_never_deleted_by_the_orchestrator(
        bus: tuple[NodeProcess, str]) -> None:
    """A rank takes its step batch (its ``reference`` event makes the blobs its own), trains it, deletes its
    blobs and leaves before its answer is read: the orchestrator's request ends as the rank goes down, and
    its world with it. The reference event says the rank took the batch, so the orchestrator deletes nothing
    of it, at once or once the stores' reclaim period has passed. Before, every batch not acknowledged was
    deleted ``trainer-down`` as the world went down: a second delete of blobs their owner had deleted (a
    violation), or a delete of a live rank's blobs."""
    control = bus[1]
    grace_s = 0.5
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-t", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="t"), restart_grace_s=grace_s)
    trainer, rank_server = _stand_in_rank(control)
    taken: list[StepBatch] = []

    def take_and_never_answer(request: Message) -> None:
        assert isinstance(request.body, StepBatch)
        taken.append(request.body)
        trainer.publish(Reference(step=request.body.step, holder="trainer-0", blob_ids=list(request.body.owned)))

    rank_server.on(StepBatch.kind, take_and_never_answer, cached=False)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64),
                                Deadlines(restart_grace_s=grace_s, redeliver_after_s=0.4))
    ctx = zmq.Context()
    try:
        with _running(orchestrator, env_runtime, trainer) as started:
            kept = sorted(_kept_episode(env, f"t-{m}", group="gt", reward=float(m)) for m in range(2))
            wait_for(lambda: env.stats().held_by.get("trainer-0") == 2, WAIT_S, "the batch's blobs handed over")
            assert sorted(taken[0].owned) == kept
            rank = Client(ctx, env.endpoint, WireCodec("trainer-0"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
            assert rank.request(Delete(blob_ids=kept, holder="trainer-0", reason="trained")).body.blob_ids == kept
            rank.close()
            started.remove(trainer)
            trainer.join(timeout=WAIT_S)  # its bye: the world is down, its answer never came
            wait_for(lambda: orchestrator.core.world_down is not None, WAIT_S, "the trainer world down")
            due = orchestrator.core.world_down.reclaimed_by(grace_s)
            assert due is not None
            ticks: list[float] = []
            core_tick = orchestrator.core.tick
            orchestrator.core.tick = lambda now: (ticks.append(now), core_tick(now))[1]  # type: ignore[method-assign]
            wait_for(lambda: any(now >= due for now in ticks), WAIT_S + 1.25 * grace_s,
                     "a tick of the orchestrator past the stores' reclaim period (it gives up what is unsettled)")
            stats = env.stats()
            assert stats.deleted == {"trained": 2} and not stats.violations, stats
            assert not orchestrator.core.holdings.held and not orchestrator.core.world_down.unsettled
    finally:
        ctx.destroy(linger=0)


def test_a_reference_a_third_node_publishes_never_marks_a_dead_worlds_batch_taken(
        bus: tuple[NodeProcess, str]) -> None:
    """A rank takes its step batch and leaves without an answer or a ``reference`` of its own (killed before its
    event went out), and a third node publishes the rank's ``reference`` for it. Published by neither end of the
    hand-over (not the rank it names, not the orchestrator), it is refused at the orchestrator and at the store:
    logged with its publisher, counted, nothing settled or moved. The batch is still unknown when the world goes
    down, so the orchestrator deletes it (``trainer-down``) once the stores' reclaim period has passed. Before,
    the forged event marked the batch taken: never deleted, its blobs held by the orchestrator for good."""
    control = bus[1]
    grace_s = 0.5
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-f", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="f"), restart_grace_s=grace_s)
    trainer, rank_server = _stand_in_rank(control)
    intruder = NodeRuntime("rollout", RuntimeSettings(bus=control, node_id="intruder", metrics_port=-1))
    taken: list[StepBatch] = []
    rank_server.on(StepBatch.kind, lambda request: taken.append(request.body), cached=False)
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64),
                                Deadlines(restart_grace_s=grace_s, redeliver_after_s=0.4))
    with _running(orchestrator, env_runtime, trainer, intruder) as started, capture_logs() as logs:
        kept = sorted(_kept_episode(env, f"f-{m}", group="gf", reward=float(m)) for m in range(2))
        wait_for(lambda: taken, WAIT_S, "the rank taking its step batch")
        forged = Reference(step=taken[0].step, holder="trainer-0", blob_ids=list(taken[0].owned))
        intruder.call_soon(lambda: intruder.publish(forged))
        delivery = orchestrator.core.delivery
        assert delivery is not None

        def refused() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"] == "reference.refused"]

        wait_for(lambda: len(refused()) == 2 or delivery.referenced, WAIT_S,
                 "the third node's reference heard by the store and the orchestrator")
        assert [(e["src"], e["holder"]) for e in refused()] == [("intruder", "trainer-0")] * 2, refused()
        assert orchestrator._events.rejected == {THIRD_PARTY_HAND_OVER: 1}
        assert env.stats().held_by == {"orchestrator": 2}
        started.remove(trainer)
        trainer.join(timeout=WAIT_S)  # its bye: the world is down, its answer never came
        wait_for(lambda: orchestrator.core.world_down is not None, WAIT_S, "the trainer world down")
        wait_for(lambda: env.stats().deleted, WAIT_S + 1.25 * grace_s, "the unsettled batch deleted once the "
                 "stores' reclaim period passed")
        stats = env.stats()
        assert stats.deleted == {"trainer-down": 2} and not stats.held_by and not stats.violations, stats
        assert sorted(taken[0].owned) == kept


def test_an_orchestrator_that_sends_no_run_says_why_once_the_reason_has_held_a_while() -> None:
    """``dispatch.idle``: logged once a reason has held for ``IDLE_LOG_S`` (here: the start-up recovery, which
    this never-started node never finishes), not again while it holds, and again after it changed and held."""
    now = [1000.0]
    runtime = NodeRuntime("orchestrator", RuntimeSettings(node_id="orchestrator-idle", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(trainers=1, group_size=2, groups_per_step=1,
                                                              seq_len=64), clock=lambda: now[0])
    try:
        with capture_logs() as logs:
            for at in (0.0, IDLE_LOG_S - 0.1, IDLE_LOG_S, IDLE_LOG_S + 1.0):
                now[0] = 1000.0 + at
                orchestrator._dispatch()
        idle = [entry for entry in logs if entry["event"] == "dispatch.idle"]
        assert [(entry["reason"], entry["idle_s"]) for entry in idle] == [("recovering", IDLE_LOG_S)], idle
        assert "recovery requests out" in idle[0]["detail"]
    finally:
        runtime.close()


def test_an_orchestrator_timer_pass_that_comes_late_credits_the_stall_to_the_core_first() -> None:
    """Its timer pass comes a stall late (the loop stopped): the stall is credited to the core before the tick
    judges anything, so a store reported down just before keeps its grace; logged ``orchestrator.stalled`` and
    counted in ``refbus_orchestrator_stalled_seconds_total``. A pass on time credits nothing."""
    now = [1000.0]
    runtime = NodeRuntime("orchestrator", RuntimeSettings(node_id="orchestrator-stalled", metrics_port=-1))
    grace = Deadlines(restart_grace_s=5.0)
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64), grace,
                                clock=lambda: now[0])
    try:
        period = orchestrator.passes.period_s
        orchestrator.passes = PassStalls(period, lambda: now[0])  # the stall measured on the test's clock
        store = NodeInfo(node_id="env-a", role="env-server", host="h", pid=7, started=7.0,
                         endpoints={"blobs": "tcp://127.0.0.1:9"})
        orchestrator.core.store_down(now[0], store)
        now[0] += period
        orchestrator._tick()
        assert orchestrator.passes.stalled_s == 0.0 and orchestrator.core.stores_down["env-a"].until == 1005.0
        stall = 60.0
        now[0] += period + stall
        with capture_logs() as logs:
            orchestrator._tick()
        assert [e["seconds"] for e in logs if e["event"] == "orchestrator.stalled"] == [stall]
        assert orchestrator.core.stores_down["env-a"].until == 1005.0 + stall and orchestrator.core.lost == {}
        assert orchestrator.passes.stalled_s == stall
    finally:
        runtime.close()


def test_a_step_batch_no_message_can_carry_halts_the_run_naming_why(
        bus: tuple[NodeProcess, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step batch with more inline arrays than a message carries cannot be sent, now or by any resend: the
    orchestrator halts at once and says why. Before, the refused encode escaped as a logged callback error, the
    delivery stayed counted in flight with no outcome to come, and the run stalled until the delivery deadline
    halted it for 'no answer'. Its failure is that reason, so its process exits ``HALTED_STATUS``: before, this
    halt, the executor's own, left the failure empty and the process exited 0. (Three inline arrays a micro
    batch here against a bound of two.)"""
    monkeypatch.setattr(envelope, "MAX_BUFFERS", 2)
    control = bus[1]
    env_runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-h", metrics_port=-1))
    env = EnvServer(env_runtime, EnvServerSettings(source="h"))
    trainer, rank_server = _stand_in_rank(control)
    taken: list[StepBatch] = []
    rank_server.on(StepBatch.kind, lambda request: taken.append(request.body))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64), Deadlines())
    with capture_logs() as logs, _running(orchestrator, env_runtime, trainer):
        for m in range(2):
            _kept_episode(env, f"h-{m}", group="gh", reward=float(m))
        wait_for(lambda: [e for e in logs if e["event"] == "orchestrator.halted"], WAIT_S, "the orchestrator halted")
    (halted,) = [e for e in logs if e["event"] == "orchestrator.halted"]
    assert "batch for rank 0 cannot be sent" in halted["reason"] and "at most 2" in halted["reason"], halted
    assert not taken and orchestrator._delivering == 0
    assert orchestrator.failure == halted["reason"]


def test_every_reason_refbus_deletes_for_is_one_env_servers_accept() -> None:
    """An env server refuses (``bad-reason``) a delete whose reason is not in ``DELETE_REASONS``: every reason
    refbus's own nodes delete for is in it (their reason constants, and the literal reasons of the orchestrator's
    drops and deletes), and the protocol's ``delete`` documentation names each."""
    from refbus.nodes.payload import keeper, orchestrator_core, shipping, trainer_rank

    constants = {keeper.UNDELIVERED, keeper.SHUTDOWN, keeper.DISCARDED, keeper.HOLDER_DOWN, keeper.LOST,
                 orchestrator_core.TRAINER_DOWN, orchestrator_core.UNREFERENCED, orchestrator_core.CLAIM_FAILED,
                 shipping.MALFORMED, trainer_rank.TRAINED, trainer_rank.DROPPED_REASON}
    literals = {reason for module in (orchestrator_core, shipping)
                for reason in re.findall(r'\.(?:drop|delete)\(.*, "([a-z_-]+)"\)$', Path(module.__file__).read_text(),
                                         re.MULTILINE)}
    assert literals >= {"filtered", "stale", "eval", "incomplete", "late", "max_steps", "shutdown"}, literals
    assert constants | literals == DELETE_REASONS
    assert all(f"``{reason}``" in " ".join((Delete.__doc__ or "").split()) for reason in DELETE_REASONS)


def test_a_group_whose_runs_were_answered_and_whose_episodes_never_came_gives_its_slot_and_room_back(
        bus: tuple[NodeProcess, str]) -> None:
    """An env server answers every run ``ok`` but its ``episode-finished`` events never come (killed between its
    answer and its event, a broker restart): the orchestrator gives the group up once
    ``group_timeout_s`` plus the restart grace passed since the answers, frees its admission slot and the room its
    runs reserved, and the next group goes. Before, a group none of whose episodes came was in no timer: its slot
    (the only one, at a bound of one group) and its runs' room stayed taken, and no run went out again."""
    control = bus[1]
    runs: list[Run] = []
    manager = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="ps-version", metrics_port=-1))
    manager.status = lambda: {"version": 0.0}
    store = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-mute", metrics_port=-1))
    blobs = store.serve("blobs", "tcp://127.0.0.1:0")
    blobs.on(Run.kind, lambda request: (runs.append(request.body), Ok())[1])  # answered, never published
    blobs.on(HoldingsQuery.kind, lambda request: Held(episodes=[], cursor=0))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    settings = OrchestratorSettings(dispatch=True, trainers=1, group_size=2, groups_per_step=1, max_staleness=0,
                                    max_groups_in_flight=1, group_timeout_s=0.5, seq_len=64,
                                    prompt="refbus.nodes.toy.task:make_prompt")
    grace_s = 0.5
    orchestrator = Orchestrator(runtime, settings, Deadlines(restart_grace_s=grace_s))
    wait_s = settings.group_timeout_s + grace_s  # how long an answered run's episode may take to come
    with _running(orchestrator, manager, store):
        wait_for(lambda: len(runs) >= 2, WAIT_S, "the first group's runs at the env server")
        first = {run.group for run in runs}
        wait_for(lambda: {run.group for run in runs} - first, WAIT_S + 10 * wait_s, "another group's runs")
        assert orchestrator.core.abandoned_groups >= 1 and orchestrator.core.failed_runs == 0


def test_an_episode_finished_published_again_neither_regroups_nor_deletes_the_episode_it_repeats(
        bus: tuple[NodeProcess, str]) -> None:
    """A real env server keeps an episode; a peer publishes its ``episode-finished`` again, word for word, once its
    group is queued for a step: the orchestrator's claim is answered ``already`` (it holds the blob), and
    the repeat deletes nothing and counts nothing but a duplicate: no blob claimed, no episode, no sample ``missing``.
    Before, it was taken as a straggler of the closed group and its blob, queued to ship, deleted ``late`` at the
    store: the step would have named a deleted blob; later it counted an episode more and one sample ``missing``,
    and the blob answered ``already`` as claimed a second time."""
    repeater, env, orchestrator = _peer_store_and_orchestrator(bus[1], "repeater", "d", groups_per_step=2)
    env_runtime = env.runtime
    held = orchestrator.core.holdings.held
    with _running(orchestrator, repeater, env_runtime):
        first = _kept_episode(env, "e0", group="g0")
        _kept_episode(env, "e0b", group="g0", reward=0.0)
        wait_for(lambda: orchestrator.core.sink.queue, WAIT_S, "the first group queued")
        record = env.keeper.record_of("e0")  # as the store published it
        assert record is not None
        repeater.call_soon(lambda: repeater.publish(record))
        later = _kept_episode(env, "e1", group="g1")  # fed after the repeat: events are fed in arrival order
        wait_for(lambda: later in held, WAIT_S, "the episode after the repeat fed")
        assert first in held and env.stats().deleted == {}, env.stats().deleted
        assert [[s.sample_id for s in group] for group in orchestrator.core.sink.queue] == [["e0/0", "e0b/0"]]
        core = orchestrator.core
        assert (core.episodes, core.duplicate_episodes, core.sink.dropped["missing"]) == (3, 1, 0)
        assert (orchestrator.claimed, orchestrator.missing) == (3, 0)


def test_a_restarted_stores_repeat_of_an_episode_taken_already_counts_nothing(bus: tuple[NodeProcess, str]) -> None:
    """A restarted durable store publishes ``episode-finished`` again (``again``) for episodes it re-adopted that
    nobody claimed, not knowing whether the first event left; one the orchestrator had taken, its group queued
    since, is ignored whole: not counted as an episode, and no sample of it counted ``missing`` (its claim is
    answered ``already``: nothing new was granted). Before, it counted a second episode and a missing sample."""
    repeater, env, orchestrator = _peer_store_and_orchestrator(bus[1], "repeater", "r", groups_per_step=2)
    core = orchestrator.core
    with _running(orchestrator, repeater, env.runtime):
        _kept_episode(env, "e0", group="g0")
        _kept_episode(env, "e0b", group="g0", reward=0.0)
        wait_for(lambda: core.sink.queue, WAIT_S, "the group queued")
        record = env.keeper.record_of("e0")
        assert record is not None
        repeater.call_soon(lambda: repeater.publish(msgspec.structs.replace(record, again=True)))
        later = _kept_episode(env, "e1", group="g1")  # fed after the repeat: events are fed in arrival order
        wait_for(lambda: later in core.holdings.held, WAIT_S, "the episode after the repeat fed")
        assert (core.episodes, core.duplicate_episodes, core.sink.dropped["missing"]) == (3, 0, 0)
        assert env.stats().deleted == {}, env.stats().deleted


def test_an_episode_whose_blobs_no_store_granted_never_sizes_the_room_admission_counts(
        bus: tuple[NodeProcess, str]) -> None:
    """A peer publishes an episode naming a store nobody registered, at a real store's endpoint, its blob a TiB:
    nothing is claimed, and the episode's word does not change the charge admission reserves per run; a real
    store's episode sets it. Before, the forged size became the mean
    charge (so every store seemed to hold no group: with nothing in flight, the orchestrator halted the run for
    good, exit 4, budgets that cannot hold a step) and filled the real store's room until the next read."""
    forger, env, orchestrator = _peer_store_and_orchestrator(bus[1], "forger", "s", groups_per_step=1)
    env_runtime = env.runtime
    router = orchestrator.core.router
    with _running(orchestrator, forger, env_runtime):
        ref = BlobRef(endpoint=env.endpoint, source="s", blob_id="forged", fields=["routed_experts"], tokens=1,
                      nbytes=1 << 40, checksum=0, node="ghost")
        forger.call_soon(lambda: forger.publish(EpisodeFinished(episode_id="forged", source="s", refs=[ref])))
        wait_for(lambda: orchestrator.core.episodes >= 1, WAIT_S, "the forged episode fed to the core")
        assert router.episode_bytes == 0
        _kept_episode(env, "real", group="g")
        wait_for(lambda: orchestrator.core.episodes >= 2, WAIT_S, "the real episode fed to the core")
        record = env.keeper.record_of("real")
        assert record is not None and router.episode_bytes == episode_charge(record)


def test_after_a_refused_version_bump_the_version_is_read_again_from_the_ps_managers_registry_entry(
        bus: tuple[NodeProcess, str]) -> None:
    """The orchestrator knows version 1 (the ps-manager's bump); the manager has committed 4 since, its bump lost
    to the orchestrator (refused while the registry did not list it: a lookup unanswered, or the manager reported
    down after a stall), and its registry entry says 4. A refused bump (here a rollout's) makes the orchestrator
    read that entry again: it learns 4. Before, a version once known was never read again, and lagged until the
    manager's next bump, which a run at ``max_staleness`` 0 waits for in vain."""
    control = bus[1]
    committed = [1.0]
    forger = NodeRuntime("rollout", RuntimeSettings(bus=control, node_id="rollout-w", metrics_port=-1))
    manager = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="ps-manager", metrics_port=-1))
    manager.status = lambda: {"version": committed[0]}
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=True, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64,
                                                              prompt="partition_entry_points:make_prompt"))
    core = orchestrator.core
    with _running(orchestrator, forger, manager):
        wait_for(lambda: core.version_known and core.policy_version == 1, WAIT_S, "version 1 from the registry")
        committed[0] = 4.0  # committed since; its bump never counted here, its next heartbeat carries it
        forger.call_soon(lambda: forger.publish(VersionBump(version=50, nbytes=1, manifest_digest="forged")))
        wait_for(lambda: core.policy_version == 4, WAIT_S, "version 4 read again from the manager's entry")


def test_a_version_bump_counts_only_from_the_ps_manager_the_registry_lists(bus: tuple[NodeProcess, str]) -> None:
    """A rollout worker (any registered node that is no ps-manager) publishes ``version-bump`` 50: the orchestrator
    ignores it (it would widen the admission bound by 50 steps' groups and drop every queued sample ``stale``); the
    ps-manager's bump counts. Before, any peer's bump set the policy version."""
    control = bus[1]
    forger = NodeRuntime("rollout", RuntimeSettings(bus=control, node_id="rollout-v", metrics_port=-1))
    manager = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="ps-manager", metrics_port=-1))
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1))
    orchestrator = Orchestrator(runtime, OrchestratorSettings(dispatch=False, trainers=1, group_size=2,
                                                              groups_per_step=1, seq_len=64))
    core = orchestrator.core

    def forge() -> None:
        forger.publish(VersionBump(version=50, nbytes=1, manifest_digest="forged"))
        forger.publish(EpisodeFinished(episode_id="after", source="s", refs=[]))  # fed after the bump: in order

    with _running(orchestrator, forger, manager):
        forger.call_soon(forge)
        wait_for(lambda: core.episodes >= 1, WAIT_S, "the forger's events fed to the core")
        assert core.policy_version == 0 and not core.version_known
        manager.call_soon(lambda: manager.publish(VersionBump(version=1, nbytes=1, manifest_digest="m")))
        wait_for(lambda: core.version_known, WAIT_S, "the ps-manager's bump")
        assert core.policy_version == 1
