"""TrainerRank in two real trainer-rank processes joined by torch.distributed (gloo on 127.0.0.1), a real
broker process, and fake env servers (``test_fetcher.FakeEnvServer``) in this process. The test plays the
orchestrator: it sends each rank its ``step-batch`` and checks what the ranks trained, dropped and deleted.

Covered: a fetch failure on one data rank drops that micro batch there (zero loss, real routing rows) and
every rank learns the run-wide count; peers of one data rank (tensor-parallel style) drop together, count
on both, and only the leader deletes; a step with nothing fetchable raises ``StepSkipped`` on every rank and
its blobs are still deleted; every owned blob is deleted exactly once with the right reason; ``reference``
and ``fetch-ack`` mirrors reach the event stream; a non-leader refuses owned blobs. Every wait is bounded and
every process reaped. A step that computes for three node timeouts keeps the rank registered, and the
next step's batch is acknowledged while it computes; step batches beyond what a rank holds not yet begun
are refused. A fetch from a store that never answers keeps the rank
heartbeating and serving step batches until its deadline, then drops the blob's micro batch (``timeout``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy, gather
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.config import ConfigError
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.payload.assemble import AssembledBatch
from refbus.nodes.payload.branch import Branch
from refbus.nodes.payload.fetcher import to_micro_batch
from refbus.nodes.payload.trainer_rank import RECEIVED_STEPS, STEPS_AHEAD_MARGIN
from refbus.nodes.rl.trainer import rank_and_world
from refbus.nodes.settings import OrchestratorSettings, TrainerSettings
from refbus.nodes.up import rendezvous
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import (
    Accounted,
    Accounts,
    Claim,
    Claimed,
    FetchAck,
    MicroBatchRefs,
    NodeDown,
    Ok,
    Reference,
    Replay,
    Replayed,
    StepBatch,
)
from test_fetcher import (
    LAYERS,
    TOP_K,
    FakeEnvServer,
    SampleSpec,
    ServedStore,
    Step,
    check_assembled,
    make_step,
    start_env_server,
)

pytest_plugins = ["wire_fixtures"]

WAIT_S = 30.0
FAST = RetryPolicy(timeout_s=0.5, attempts=2, backoff=1.0)
TENSORS = ("loss_mask", "routed_experts", "sampling_mask", "topk_ids", "topk_logprobs", "topk_valid")
# Two data ranks get two routed micro batches and one unrouted micro batch each, no dummies.
SPECS = (
    SampleSpec(50, heads=True),
    SampleSpec(45, mask=True),
    SampleSpec(40),
    SampleSpec(35, heads=True, mask=True),
    SampleSpec(30, routing=None, mask=True),
    SampleSpec(30, routing=None, mask=True),
)
# The toy policy a rank trains when RankConfig.vocab_size is set: its vocabulary and expert count.
VOCAB, EXPERTS = 64, 8


@dataclass(frozen=True)
class RankConfig:
    data_rank: int | None = None  # None: the torch rank
    data_ranks: int | None = None  # None: the world size
    leader: bool = True
    compute_s: float = 0.0  # > 0: step 0 "computes" this long, then until the test says go
    collective_mid_step: bool = False  # step 0's training runs a collective once the test says go
    fetch_policy: RetryPolicy = FAST
    skip_limit: int = 3  # trainer.skip_limit
    max_staleness: int = 1  # orchestrator.max_staleness: how far ahead a step batch may be
    seq_len: int | None = OrchestratorSettings.seq_len  # as the trainer role passes it; None: none passed
    vocab_size: int = 0  # > 0: each step trains the toy policy of this vocabulary (EXPERTS experts) as
    # ``refbus node trainer`` does, the rank told the model's limits as it tells them


# --- the trainer-rank process ----------------------------------------------------------------------------


def rank_main(rank: int, world: int, init: str, bus: str, config: RankConfig, steps: int, conn: Connection) -> None:
    """One trainer rank: join the process group and the bus, then run ``steps`` steps and report each."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    from prometheus_client import REGISTRY
    from refbus.bus.logs import configure_logging
    from refbus.bus.runtime import NodeRuntime, RuntimeSettings
    from refbus.nodes.payload.fetcher import FetchSettings
    from refbus.nodes.payload.trainer_rank import StepFailed, StepSkipped, TrainerRank
    from refbus.nodes.rl.trainer import micro_batches, model_limits
    from refbus.nodes.settings import TrainerSettings
    from refbus.nodes.toy.policy import make_policy
    from refbus.nodes.toy.train import make_optimizer, train_step

    configure_logging(level="error")
    torch.set_num_threads(1)  # two ranks on a shared machine: more threads only contend
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=20))
    model = make_policy(0, vocab_size=config.vocab_size, n_experts=EXPERTS, n_layers=LAYERS, top_k=TOP_K) \
        if config.vocab_size else None
    optimizer = make_optimizer(model) if model is not None else None
    runtime = NodeRuntime("trainer", RuntimeSettings(bus=bus, node_id=f"trainer-{rank}", metrics_port=0,
                                                     retry=FAST, connect_timeout_s=10))
    trainer = TrainerRank(runtime, settings=TrainerSettings(batch_timeout_s=WAIT_S, skip_limit=config.skip_limit),
                          data_rank=config.data_rank,
                          data_ranks=config.data_ranks, leader=config.leader, max_staleness=config.max_staleness,
                          **({} if config.seq_len is None else {"seq_len": config.seq_len}),
                          limits=model_limits(model) if model is not None else None,
                          fetch=FetchSettings(blobs_per_request=2, policy=config.fetch_policy))
    try:
        runtime.start_background()
        conn.send(runtime.endpoints["trainer"])
        for step in range(steps):
            report: dict[str, Any] = {}
            try:
                result = trainer.begin_step(step)
            except StepFailed as exc:
                report["failed"] = str(exc)
                report["skipped"] = isinstance(exc, StepSkipped)
            else:
                report["dropped"] = result.dropped
                report["dropped_global"] = result.dropped_global
                report["batches"] = [
                    {name: getattr(b, name).numpy().copy() for name in TENSORS if getattr(b, name) is not None}
                    | {"dropped": b.dropped} for b in result.batches
                ]
                report["routing_rows"] = result.fetch.routing_rows.numpy().copy()
                report["fetch_failures"] = [getattr(b, "reason", None) for b in result.fetch.batches]
                report["fetch_seconds"] = result.fetch.seconds
                if model is not None:
                    report["trained"] = train_step(model, optimizer, micro_batches(result))["tokens"]
            if config.compute_s and step == 0:
                conn.send(("computing", step))
                time.sleep(config.compute_s)  # the training step: the node loop gets no help from this thread
                assert conn.recv() == ("go", step)
            if config.collective_mid_step and step == 0:
                conn.send(("computing", step))
                assert conn.recv() == ("go", step)
                dist.all_reduce(torch.zeros(1))  # a dead peer breaks the world here: this raises, end_step never runs
            release = trainer.end_step(step)
            report["deleted"] = release.deleted
            report["dropped_metric"] = REGISTRY.get_sample_value("refbus_dropped_micro_batches_total")
            report["held_metric"] = REGISTRY.get_sample_value("refbus_trainer_blobs_held")
            report["skipped_metric"] = REGISTRY.get_sample_value("refbus_trainer_steps_skipped_total")
            conn.send(report)
    finally:
        runtime.join()
        dist.destroy_process_group()


class Ranks:
    """Two spawned trainer-rank processes; :meth:`close` reaps them whatever happened."""

    def __init__(self, bus: str, configs: tuple[RankConfig, RankConfig], steps: int, workdir: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        init = rendezvous(workdir, "test", 0)  # a file: no port to pick that another process could take first
        self.conns: list[Connection] = []
        self.procs = []
        for rank, config in enumerate(configs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, 2, init, bus, config, steps, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def recv(self, rank: int) -> Any:
        assert self.conns[rank].poll(WAIT_S), f"rank {rank} sent nothing within {WAIT_S}s"
        return self.conns[rank].recv()

    def close(self) -> list[int | None]:
        for proc in self.procs:
            proc.join(WAIT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        return [proc.exitcode for proc in self.procs]


# --- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc: NodeProcess
    proc, control = start_bus(Path(tmp_path_factory.mktemp("bus")))
    try:
        yield control
    finally:
        assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def envs(serve: Callable) -> tuple[FakeEnvServer, FakeEnvServer]:
    return start_env_server(serve, "env-a"), start_env_server(serve, "env-b")


class Orchestrator:
    """Clients (``orchestrator(endpoint)``) sending as node ``orchestrator``, which is registered with role
    ``orchestrator`` on every bus :meth:`join` names, before the ranks start: a rank takes step batches only
    from an orchestrator its registry lists."""

    def __init__(self, zmq_ctx: zmq.Context) -> None:
        self.zmq_ctx = zmq_ctx
        self.made: list[Client] = []
        self.codec = WireCodec("orchestrator")

    @staticmethod
    def join(bus: str) -> NodeRuntime:
        """The ``orchestrator`` node, registered on ``bus`` (the caller joins it before the bus stops)."""
        node = NodeRuntime("orchestrator", RuntimeSettings(bus=bus, node_id="orchestrator", metrics_port=-1))
        node.start_background()
        return node

    def __call__(self, endpoint: str) -> Client:
        self.made.append(Client(self.zmq_ctx, endpoint, self.codec, policy=RetryPolicy(timeout_s=5.0, attempts=1)))
        return self.made[-1]

    def close(self) -> None:
        for client in self.made:
            client.close()


@pytest.fixture
def orchestrator(bus: str, zmq_ctx: zmq.Context) -> Iterator[Orchestrator]:
    """An :class:`Orchestrator` registered on the module's bus (a test with a bus of its own joins it too)."""
    made = Orchestrator(zmq_ctx)
    node = made.join(bus)
    try:
        yield made
    finally:
        made.close()
        node.join(timeout=WAIT_S)


def hand_over(clients: list[Client], batches: list[StepBatch]) -> None:
    outcomes = gather(list(zip(clients, batches, strict=True)))
    assert all(not isinstance(o, Exception) and isinstance(o.body, Ok) for o in outcomes), outcomes


def step_batch(step: int, rank: int, data: Step, data_rank: int, *, owned: bool = True) -> StepBatch:
    return StepBatch(step=step, rank=rank, micro_batches=list(data.ranks[data_rank]),
                     owned=list(data.owned[data_rank]) if owned else [])


def received(batch: dict[str, Any], refs) -> AssembledBatch:
    tensors = {name: torch.from_numpy(batch[name]) for name in TENSORS if name in batch}
    return AssembledBatch(micro_batch=to_micro_batch(refs), dropped=batch["dropped"], **tensors)


def deletes(envs: tuple[FakeEnvServer, ...]) -> Counter[tuple[str, str, str]]:
    """(blob id, holder, reason) of every delete the env servers received."""
    return Counter((blob_id, d.holder, d.reason) for env in envs for d in env.deletes for blob_id in d.blob_ids)


def events(bus: str, zmq_ctx: zmq.Context, kind: str) -> list[Any]:
    codec = WireCodec("test-replay")
    client = Client(zmq_ctx, bus, codec, policy=RetryPolicy(timeout_s=5.0, attempts=1))
    try:
        page = client.request(Replay(since=0)).body
    finally:
        client.close()
    assert isinstance(page, Replayed)
    # A node sends what it published in one loop turn as one batch (two step batches taken in one turn: two
    # ``reference`` events in one message).
    messages = [m for e in page.events for m in (codec.decode_batch(e.frames) or [codec.decode(e.frames)])]
    return [m.body for m in messages if m.body.kind == kind]


def check_dropped(batch: dict[str, Any], rows: np.ndarray) -> None:
    """Zero loss, and routing made of real rows repeated, never zeros."""
    assert batch["dropped"] and not batch["loss_mask"].any()
    routing = batch["routed_experts"][0]
    real = {row.tobytes() for row in rows}
    assert all(row.tobytes() in real for row in routing)


# --- tests -----------------------------------------------------------------------------------------------


def test_failures_are_agreed_over_ranks_and_blobs_deleted_once(bus, envs, orchestrator, zmq_ctx,
                                                              tmp_path: Path) -> None:
    partial = make_step(envs, SPECS, data_ranks=2, prefix="a")
    nothing = make_step(envs, SPECS, data_ranks=2, prefix="b", seed=1)
    nothing_again = make_step(envs, SPECS, data_ranks=2, prefix="c", seed=2)
    victim = next(i.ref.blob_id for i in partial.ranks[0][0].samples if i.ref is not None)
    for env in envs:
        env.missing_for["trainer-0"] = {victim}
        nothing_ids = sorted(nothing.branches)  # absent or garbage (a byte flipped): nothing of step 1 verifies
        env.missing |= set(nothing_ids[::2]) | set(nothing_again.branches)
        env.corrupt |= set(nothing_ids[1::2])
        env.reclaimed |= set(nothing.owned[0][:1])  # answered reclaimed: no longer held, no violation

    # One skip in a row allowed: step 1 is skipped, step 2 (nothing fetchable again) fails.
    ranks = Ranks(bus, (RankConfig(skip_limit=1), RankConfig(skip_limit=1)), steps=3, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        hand_over(clients, [step_batch(0, rank, partial, rank) for rank in (0, 1)])
        # A re-delivery of a step batch (a new request, the same batch) is acknowledged again and changes
        # nothing; a different batch for the same step is refused.
        hand_over(clients, [step_batch(0, rank, partial, rank) for rank in (0, 1)])
        for rank in (0, 1):
            (other,) = gather([(clients[rank], step_batch(0, rank, nothing, rank))])
            assert isinstance(other, RemoteError) and other.code == "duplicate-step", other
        hand_over(clients, [step_batch(1, rank, nothing, rank) for rank in (0, 1)])
        hand_over(clients, [step_batch(2, rank, nothing_again, rank) for rank in (0, 1)])
        reports = [[ranks.recv(rank) for _ in range(3)] for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]

    # Step 0: rank 0's first micro batch failed there: dropped on rank 0 only, counted run-wide on both.
    first = [reports[rank][0] for rank in (0, 1)]
    assert first[0]["dropped"] == (0,) and first[1]["dropped"] == ()
    assert first[0]["dropped_global"] == first[1]["dropped_global"] == 1
    assert first[0]["dropped_metric"] == 1 and first[1]["dropped_metric"] == 0
    check_dropped(first[0]["batches"][0], first[0]["routing_rows"])
    for rank in (0, 1):
        for index, batch in enumerate(first[rank]["batches"]):
            if not batch["dropped"]:
                check_assembled(received(batch, partial.ranks[rank][index]), partial.ranks[rank][index],
                                partial.branches)
    # Step 1: nothing fetchable anywhere: both ranks skip it (the world goes on), and still delete what they own
    # (a blob its store reclaimed meanwhile is no longer held either).
    for rank in (0, 1):
        assert "no micro batch could be fetched on any rank" in reports[rank][1]["failed"]
        assert reports[rank][1]["skipped"] and reports[rank][1]["skipped_metric"] == 1
        assert reports[rank][0]["skipped_metric"] == 0
        # Step 2: nothing fetchable again, one skip in a row already: it fails on both ranks, not skipped.
        assert "trainer.skip_limit = 1: the cause persists" in reports[rank][2]["failed"]
        assert not reports[rank][2]["skipped"] and reports[rank][2]["skipped_metric"] == 1
        assert reports[rank][2]["held_metric"] == 0

    done = deletes(envs)
    dropped_blobs = ({i.ref.blob_id for i in partial.ranks[0][0].samples if i.ref is not None}
                     | set(nothing.branches) | set(nothing_again.branches))
    expected = Counter()
    for data in (partial, nothing, nothing_again):
        for rank in (0, 1):
            for blob_id in data.owned[rank]:
                expected[blob_id, f"trainer-{rank}", "dropped" if blob_id in dropped_blobs else "trained"] += 1
    assert done == expected, "every owned blob deleted exactly once, by its rank, with its reason"
    assert sum(len(env.blobs) for env in envs) == len(done)

    references = events(bus, zmq_ctx, Reference.kind)
    assert {(r.step, r.holder, tuple(r.blob_ids)) for r in references} >= {
        (step, f"trainer-{rank}", data.owned[rank]) for step, data in enumerate((partial, nothing, nothing_again))
        for rank in (0, 1)}
    acks = [a for a in events(bus, zmq_ctx, FetchAck.kind) if a.step == 0 and a.holder == "trainer-0"]
    assert len(acks) == 1 and victim not in acks[0].blob_ids


def test_a_rank_whose_world_breaks_mid_step_deletes_the_steps_blobs_as_it_stops(bus, envs, orchestrator,
                                                                                 tmp_path: Path) -> None:
    """Both ranks fetched step 0 and train it; rank 1 is SIGKILLed there, so rank 0's next collective raises
    and its process ends without ``end_step``. Rank 0's node shutdown deletes the step's blobs it owns
    (``dropped``, once each); rank 1's are left to their stores (reclaimed ``holder-down``). Before, rank 0's
    were left too: a world broken by one rank's death cost every rank's blobs (counted lost). Each rank's step
    also has a dummy micro batch borrowing the other's first: a borrowed blob is its owner's, never deleted by
    the borrower's shutdown (it was, and the owner's own delete of it then counted a violation)."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="w")
    config = RankConfig(collective_mid_step=True)
    ranks = Ranks(bus, (config, config), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        batches = [step_batch(0, rank, data, rank) for rank in (0, 1)]
        borrowing = [msgspec.structs.replace(batch, micro_batches=[
            *batch.micro_batches, msgspec.structs.replace(batches[1 - rank].micro_batches[0], dummy=True)])
            for rank, batch in enumerate(batches)]
        hand_over(clients, borrowing)
        for rank in (0, 1):
            assert ranks.recv(rank) == ("computing", 0)
        ranks.procs[1].kill()
        ranks.procs[1].join(WAIT_S)
        ranks.conns[0].send(("go", 0))
    finally:
        exits = ranks.close()
    assert exits[1] == -signal.SIGKILL and exits[0] not in (0, None), exits
    assert deletes(envs) == Counter({(blob_id, "trainer-0", "dropped"): 1 for blob_id in data.owned[0]})


def test_peers_of_one_data_rank_drop_together_and_only_the_leader_deletes(bus, envs, orchestrator,
                                                                         tmp_path: Path) -> None:
    specs = [SampleSpec(s.tokens, np.uint16 if s.routing is not None else None, s.heads, s.mask) for s in SPECS]
    data = make_step(envs, specs, data_ranks=1, prefix="p")
    victim = next(i.ref.blob_id for i in data.ranks[0][1].samples if i.ref is not None)
    for env in envs:
        env.missing_for["trainer-1"] = {victim}  # only the non-leader's fetch fails

    peers = RankConfig(data_rank=0, data_ranks=1, leader=True), RankConfig(data_rank=0, data_ranks=1, leader=False)
    ranks = Ranks(bus, peers, steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        with pytest.raises(RemoteError, match="not-leader"):
            clients[1].request(step_batch(0, 1, data, 0, owned=True))
        hand_over(clients, [step_batch(0, 0, data, 0), step_batch(0, 1, data, 0, owned=False)])
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]

    for report in reports:
        assert report["dropped"] == (1,) and report["dropped_global"] == 1 and report["dropped_metric"] == 1
        check_dropped(report["batches"][1], report["routing_rows"])
        for index, batch in enumerate(report["batches"]):
            if index != 1:
                check_assembled(received(batch, data.ranks[0][index]), data.ranks[0][index], data.branches)
    dropped_blobs = {i.ref.blob_id for i in data.ranks[0][1].samples if i.ref is not None}
    assert deletes(envs) == Counter(
        {(blob_id, "trainer-0", "dropped" if blob_id in dropped_blobs else "trained"): 1 for blob_id in data.owned[0]})
    assert reports[1]["deleted"] == ()


def test_step_batches_come_only_from_the_registered_orchestrator_and_never_far_ahead(
        bus, envs, orchestrator, zmq_ctx, tmp_path: Path) -> None:
    """Before, any peer could send a rank step batches: 256 of them for far-future steps took every slot for good,
    the real step 0 was refused ``too-many-steps`` and the rank reported ``received`` a million steps ahead."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="f")
    ranks = Ranks(bus, (RankConfig(), RankConfig()), steps=1, workdir=tmp_path)
    forger = None
    try:
        endpoints = [ranks.recv(rank) for rank in (0, 1)]
        forger = Client(zmq_ctx, endpoints[0], WireCodec("forger"), policy=RetryPolicy(timeout_s=5.0, attempts=1))
        with pytest.raises(RemoteError, match="not-orchestrator") as refused:
            forger.request(step_batch(0, 0, data, 0, owned=False))
        assert "'forger' is no orchestrator the registry lists live" in str(refused.value)
        clients = [orchestrator(endpoint) for endpoint in endpoints]
        # max_staleness 1: a step batch at most 1 + STEPS_AHEAD_MARGIN steps ahead of step 0 is taken.
        with pytest.raises(RemoteError, match="step-too-far") as refused:
            clients[0].request(step_batch(1 + STEPS_AHEAD_MARGIN + 1, 0, data, 0, owned=False))
        assert refused.value.retry_after_s > 0
        with pytest.raises(RemoteError, match="step-too-far"):
            clients[0].request(step_batch(1_000_000, 0, data, 0, owned=False))
        hand_over(clients, [step_batch(0, rank, data, rank) for rank in (0, 1)])
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        if forger is not None:
            forger.close()
        exits = ranks.close()
    assert exits == [0, 0]
    assert all("failed" not in report and report["dropped_global"] == 0 for report in reports), reports


def test_a_step_batch_naming_an_owned_blob_at_two_stores_is_refused_and_never_deleted_elsewhere(
        bus, envs, orchestrator, tmp_path: Path) -> None:
    """Regression: an owned blob referenced again in a dummy micro batch, unrouted (so not fetched there) and at
    another store, was taken: the rank deleted it at that other store after the step (``delete.failed``) and
    never at its own, which held it for the rank until it went down. Now the batch is refused ``bad-step-batch``
    naming the blob, and the right one is trained and deleted once, where the blob lives."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="c")
    ranks = Ranks(bus, (RankConfig(), RankConfig()), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        batches = [step_batch(0, rank, data, rank) for rank in (0, 1)]
        ref = next(s.ref for mb in batches[0].micro_batches for s in mb.samples
                   if s.ref and s.ref.blob_id in batches[0].owned and len(s.ref.fields) > 1)
        owned = ref.blob_id
        elsewhere = msgspec.structs.replace(ref, endpoint="tcp://127.0.0.1:9", node="env-elsewhere",
                                            fields=[f for f in ref.fields if f != "routed_experts"], routing_shape=None)
        dummy = msgspec.structs.replace(batches[0].micro_batches[0], dummy=True, samples=[
            msgspec.structs.replace(batches[0].micro_batches[0].samples[0], ref=elsewhere)])
        with pytest.raises(RemoteError, match="bad-step-batch") as refused:
            clients[0].request(msgspec.structs.replace(batches[0], micro_batches=[*batches[0].micro_batches, dummy]))
        assert f"blob {owned!r}: referenced as" in str(refused.value)
        hand_over(clients, batches)
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all("failed" not in report for report in reports), reports
    assert deletes(envs) == Counter({(blob_id, f"trainer-{rank}", "trained"): 1
                                     for rank in (0, 1) for blob_id in data.owned[rank]})


def test_step_batches_of_unequal_micro_batch_counts_are_skipped_by_every_rank(bus, envs, orchestrator,
                                                                              tmp_path: Path) -> None:
    """Regression: ranks whose step batches held different numbers of micro batches entered the agreement's
    all-reduce with vectors of different sizes, and gloo aborted a rank's process (SIGABRT), breaking the world.
    Now every rank skips the step (``StepSkipped``, the same reason on each) and deletes its blobs ``dropped``."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="m")
    ranks = Ranks(bus, (RankConfig(), RankConfig()), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        batches = [step_batch(0, rank, data, rank) for rank in (0, 1)]
        extra = msgspec.structs.replace(batches[0].micro_batches[0], dummy=True)
        batches[0] = msgspec.structs.replace(batches[0], micro_batches=[*batches[0].micro_batches, extra])
        hand_over(clients, batches)
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all(report["skipped"] and "hold from 3 to 4 micro batches" in report["failed"] for report in reports), \
        reports
    assert deletes(envs) == Counter({(blob_id, f"trainer-{rank}", "dropped"): 1
                                     for rank in (0, 1) for blob_id in data.owned[rank]})


def test_a_restarted_orchestrators_fill_makes_every_rank_skip_the_step_the_other_rank_holds(
        bus, envs, orchestrator, tmp_path: Path) -> None:
    """An orchestrator that died delivering a step (rank 0 took its batch, rank 1 never got one) is restarted
    and sends rank 1 an empty batch for that step (a fill): each rank's ``begin_step`` raises ``StepSkipped``
    naming the fill, and rank 0 deletes the blobs it holds ``dropped``. Without the fill rank 1 waited for
    its batch and rank 0 in the agreement for ever."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="f")
    ranks = Ranks(bus, (RankConfig(), RankConfig()), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        hand_over(clients, [step_batch(0, 0, data, 0), StepBatch(step=0, rank=1, micro_batches=[], owned=[])])
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all(report["skipped"] and "a restarted orchestrator's fill" in report["failed"] for report in reports), \
        reports
    assert deletes(envs) == Counter({(blob_id, "trainer-0", "dropped"): 1 for blob_id in data.owned[0]})


def test_a_micro_batch_longer_than_seq_len_is_refused_before_the_rank_allocates_it(bus, envs, orchestrator,
                                                                                   tmp_path: Path) -> None:
    """Regression: a step batch with a micro batch of 2**40 tokens was taken; its assembly failed to allocate (the
    micro batch dropped), then so did its stand-in's, and the RuntimeError ended the rank mid-step. Now a micro
    batch longer than ``orchestrator.seq_len`` is refused ``bad-step-batch``, and the real step trains."""
    data = make_step(envs, SPECS, data_ranks=2, prefix="l")
    ranks = Ranks(bus, (RankConfig(), RankConfig()), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        batches = [step_batch(0, rank, data, rank) for rank in (0, 1)]
        first, *rest = batches[0].micro_batches
        with pytest.raises(RemoteError, match="bad-step-batch") as refused:
            clients[0].request(msgspec.structs.replace(batches[0], micro_batches=[
                msgspec.structs.replace(first, length=2**40), *rest]))
        assert "micro batch 0 is 1099511627776 tokens long, more than orchestrator.seq_len" in str(refused.value)
        hand_over(clients, batches)
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all("failed" not in report and report["dropped_global"] == 0 for report in reports), reports


def test_a_rank_given_no_seq_len_takes_the_micro_batches_of_an_orchestrator_that_packs_longer_ones(
        bus, envs, orchestrator, tmp_path: Path) -> None:
    """Regression: a rank embedded as the README says (no ``seq_len`` passed) refused ``bad-step-batch`` every
    micro batch longer than ``orchestrator.seq_len``'s default, so an honest orchestrator packing 4096 tokens had
    each step refused. A rank told no ``seq_len`` bounds no length; the trainer role passes its config's."""
    longer = OrchestratorSettings.seq_len + 8
    data = make_step(envs, (SampleSpec(longer, heads=True), SampleSpec(45, mask=True)), data_ranks=2, prefix="e",
                     seq_len=2 * OrchestratorSettings.seq_len)
    assert max(mb.length for rank in data.ranks for mb in rank) > OrchestratorSettings.seq_len
    ranks = Ranks(bus, (RankConfig(seq_len=None), RankConfig(seq_len=None)), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        hand_over(clients, [step_batch(0, rank, data, rank) for rank in (0, 1)])
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all("failed" not in report and report["dropped_global"] == 0 for report in reports), reports


# Samples a toy policy trains: routed and not, with top-k heads and sampling masks.
MODEL_SPECS = (
    SampleSpec(50, heads=True),
    SampleSpec(45, heads=True, mask=True),
    SampleSpec(40),
    SampleSpec(35, heads=True),
    SampleSpec(30, routing=None, heads=True, mask=True),
    SampleSpec(30, routing=None),
)


def model_step(envs: tuple[FakeEnvServer, ...], prefix: str, seed: int) -> Step:
    """A step of MODEL_SPECS whose ids fit the toy policy, with the inline inputs the orchestrator ships: token
    ids below VOCAB (where a token has a sampling mask, its first id, as a sampler's would be), advantage 1."""
    data = make_step(envs, MODEL_SPECS, data_ranks=2, prefix=prefix, seed=seed, vocab=VOCAB, experts=EXPERTS)
    rng = np.random.default_rng(seed)

    def with_inputs(mb: MicroBatchRefs) -> MicroBatchRefs:
        ids = rng.integers(0, VOCAB, mb.length)
        offset = 0
        for item in mb.samples:
            branch = data.branches.get(item.ref.blob_id) if item.ref is not None else None
            if branch is not None and branch.mask_counts is not None:
                counts = branch.mask_counts[: item.tokens]
                masked = counts > 0
                ids[offset : offset + item.tokens][masked] = branch.mask_ids[(np.cumsum(counts) - counts)[masked]]
            offset += item.tokens
        return msgspec.structs.replace(mb, inputs={"input_ids": ids, "advantages": np.ones(mb.length, np.float32),
                                                   "loss_mask": np.ones(mb.length, np.bool_)})

    return replace(data, ranks=tuple(tuple(with_inputs(mb) for mb in rank) for rank in data.ranks))


def with_token(batch: StepBatch, index: int, token: int) -> StepBatch:
    """``batch`` with the first token id of its micro batch ``index`` replaced by ``token``."""
    micro_batches = list(batch.micro_batches)
    ids = np.array(micro_batches[index].inputs["input_ids"], dtype=np.int64)
    ids[0] = token
    micro_batches[index] = msgspec.structs.replace(micro_batches[index],
                                                   inputs={**micro_batches[index].inputs, "input_ids": ids})
    return msgspec.structs.replace(batch, micro_batches=micro_batches)


def with_value(data: Step, envs: tuple[FakeEnvServer, ...], blob_id: str, field: str, value: int) -> Step:
    """``data`` with the first value of array ``field`` of blob ``blob_id`` replaced by ``value``, kept again at its
    store (a new checksum, which every reference to it names)."""
    arrays = {name: array.copy() for name, array in data.branches[blob_id].to_arrays().items()}
    arrays[field].reshape(-1)[0] = value
    branch = Branch.from_arrays(arrays)
    ref = next(env for env in envs if blob_id in env.blobs).keep(blob_id, branch)
    ranks = tuple(tuple(msgspec.structs.replace(mb, samples=[
        msgspec.structs.replace(item, ref=ref) if item.ref is not None and item.ref.blob_id == blob_id else item
        for item in mb.samples]) for mb in rank) for rank in data.ranks)
    return replace(data, ranks=ranks, branches={**data.branches, blob_id: branch})


def holding(data: Step, blob_ids: set[str]) -> list[tuple[int, ...]]:
    """Per data rank, the indices of its micro batches that name one of ``blob_ids``."""
    return [tuple(index for index, mb in enumerate(rank)
                  if any(item.ref is not None and item.ref.blob_id in blob_ids for item in mb.samples))
            for rank in data.ranks]


def trained_or_dropped(steps: list[Step], dropped: set[str]) -> Counter[tuple[str, str, str]]:
    """The deletes expected when every step trained but the micro batches naming ``dropped`` blobs."""
    return Counter({(blob_id, f"trainer-{rank}", "dropped" if blob_id in dropped else "trained"): 1
                    for data in steps for rank in (0, 1) for blob_id in data.owned[rank]})


def test_a_token_id_past_the_models_vocabulary_is_refused_before_the_forward_and_the_world_trains_on(
        bus, envs, orchestrator, tmp_path: Path) -> None:
    """Regression: a sample whose token id was the model's vocabulary size reached the forward pass (CPU: the
    embedding raises; CUDA: a device-side assert that poisons the process's context); the rank died mid-step with
    the step's blobs, and its peer with it in the step's next collective. Now the rank checks every id against the
    model before the forward: the sample's micro batch is dropped on every rank (zero loss, counted, the sample
    named in the log), its blobs deleted ``dropped`` once, and the world trains this step and the next."""
    steps = [model_step(envs, prefix, seed) for seed, prefix in enumerate("vw")]
    config = RankConfig(vocab_size=VOCAB)
    ranks = Ranks(bus, (config, config), steps=2, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        first = [step_batch(0, rank, steps[0], rank) for rank in (0, 1)]
        hand_over(clients, [with_token(first[0], 0, VOCAB), first[1]])
        hand_over(clients, [step_batch(1, rank, steps[1], rank) for rank in (0, 1)])
        reports = [[ranks.recv(rank) for _ in range(2)] for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert [reports[rank][0]["dropped"] for rank in (0, 1)] == [(0,), ()]
    assert reports[0][0]["fetch_failures"][0] == "out-of-range"
    assert [report["dropped_global"] for rank in (0, 1) for report in reports[rank]] == [1, 0, 1, 0]
    assert all(report["trained"] > 0 for rank in (0, 1) for report in reports[rank]), reports
    victims = {i.ref.blob_id for i in steps[0].ranks[0][0].samples if i.ref is not None}
    assert deletes(envs) == trained_or_dropped(steps, victims)


def test_garbage_ids_in_inputs_or_blobs_are_refused_on_every_rank_and_every_step_trains(
        bus, envs, orchestrator, tmp_path: Path) -> None:
    """Token ids at and past the vocabulary (up to 2**63 - 1, and below 0) in the inline ids, top-k heads or
    sampling masks, and an expert id past the model's experts in routing rows: each step drops the micro batch
    holding it on the ranks that hold it, agreed on by all, and trains the rest; no rank dies. (Each garbage id is
    in a micro batch whose rank has another with routing rows and top-k heads: one without would skip the step.)"""
    tokens = ((1, 1, VOCAB + 1), (0, 0, 2**63 - 1), (1, 2, -1))  # (rank, micro batch, token id)
    values = ((0, "topk_ids", VOCAB), (4, "mask_ids", VOCAB + 1), (2, "routed_experts", EXPERTS))  # of sample 0, ...
    steps = [model_step(envs, f"g{step}", step) for step in range(len(tokens) + len(values))]
    batches = [[step_batch(step, rank, data, rank) for rank in (0, 1)] for step, data in enumerate(steps)]
    expected: list[list[tuple[int, ...]]] = []
    victims: set[str] = set()
    for step, (rank, index, token) in enumerate(tokens):
        batches[step][rank] = with_token(batches[step][rank], index, token)
        expected.append([(index,) if r == rank else () for r in (0, 1)])
        victims |= {i.ref.blob_id for i in steps[step].ranks[rank][index].samples if i.ref is not None}
    for step, (sample, field, value) in enumerate(values, start=len(tokens)):
        blob_id = f"g{step}-blob-{sample}"
        steps[step] = with_value(steps[step], envs, blob_id, field, value)
        batches[step] = [step_batch(step, rank, steps[step], rank) for rank in (0, 1)]
        expected.append(holding(steps[step], {blob_id}))
        victims |= {i.ref.blob_id for rank, held in enumerate(expected[-1]) for index in held
                    for i in steps[step].ranks[rank][index].samples if i.ref is not None}
    config = RankConfig(vocab_size=VOCAB, max_staleness=len(steps))
    ranks = Ranks(bus, (config, config), steps=len(steps), workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        for batch in batches:
            hand_over(clients, batch)
        reports = [[ranks.recv(rank) for _ in steps] for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    for step, dropped in enumerate(expected):
        assert [reports[rank][step]["dropped"] for rank in (0, 1)] == dropped, step
        assert all(reports[rank][step]["dropped_global"] == sum(map(len, dropped)) for rank in (0, 1)), step
        assert all(reports[rank][step]["trained"] > 0 for rank in (0, 1)), step
    assert deletes(envs) == trained_or_dropped(steps, victims)


def test_a_step_longer_than_the_node_timeout_keeps_the_rank_live_and_serving(
    envs, orchestrator, zmq_ctx, tmp_path: Path
) -> None:
    node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
    proc, bus = start_bus(tmp_path, extra=FAST_LIVENESS)
    registered = orchestrator.join(bus)
    try:
        steps = [make_step(envs, SPECS, data_ranks=2, prefix=prefix, seed=seed) for seed, prefix in enumerate("xy")]
        # Staleness enough to hold RECEIVED_STEPS steps ahead: the cap on how many is what is tested here.
        computing = RankConfig(compute_s=3 * node_timeout_s, max_staleness=RECEIVED_STEPS)
        ranks = Ranks(bus, (computing, computing), steps=2, workdir=tmp_path)
        try:
            clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
            hand_over(clients, [step_batch(0, rank, steps[0], rank) for rank in (0, 1)])
            assert [ranks.recv(rank) for rank in (0, 1)] == [("computing", 0)] * 2
            # Step 1's batch while step 0 computes: acknowledged, or the ranks would wait for "go" forever.
            hand_over(clients, [step_batch(1, rank, steps[1], rank) for rank in (0, 1)])
            # A rank holds at most RECEIVED_STEPS step batches not yet begun: what a peer sends beyond is refused
            # (retryable), not kept. Those it holds are never begun here, and own nothing.
            ahead = [step_batch(step, 1, steps[1], 1, owned=False) for step in range(2, RECEIVED_STEPS + 1)]
            hand_over([clients[1]] * len(ahead), ahead)
            with pytest.raises(RemoteError, match="too-many-steps") as refused:
                clients[1].request(step_batch(RECEIVED_STEPS + 1, 1, steps[1], 1, owned=False))
            assert refused.value.retry_after_s > 0
            for rank in (0, 1):
                ranks.conns[rank].send(("go", 0))
            reports = [ranks.recv(rank) for _ in (0, 1) for rank in (0, 1)]
            assert all("failed" not in report and report["dropped_global"] == 0 for report in reports), reports
        finally:
            exits = ranks.close()
        assert exits == [0, 0]
        assert [client.retries for client in clients] == [0, 0]
        # Both ranks left with "bye"; none was ever declared down for silence.
        down = sorted((event.node_id, event.reason) for event in events(bus, zmq_ctx, NodeDown.kind))
        assert down == [("trainer-0", "bye"), ("trainer-1", "bye")]
    finally:
        registered.join(timeout=WAIT_S)
        assert proc.stop() == 0, proc.log_tail()


def test_a_fetch_from_a_store_that_never_answers_leaves_the_loop_serving(
    envs, orchestrator, zmq_ctx, tmp_path: Path
) -> None:
    node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
    # The fetch outlives five node timeouts: a rank whose loop waited on it would be declared down.
    patient = RetryPolicy(timeout_s=node_timeout_s, attempts=5, backoff=1.0)
    proc, bus = start_bus(tmp_path, extra=FAST_LIVENESS)
    registered = orchestrator.join(bus)
    try:
        steps = [make_step(envs, SPECS, data_ranks=2, prefix=prefix, seed=seed) for seed, prefix in enumerate("uv")]
        victim = next(i.ref.blob_id for i in steps[0].ranks[0][0].samples if i.ref is not None)
        store = next(env for env in envs if victim in env.blobs)
        store.silent.add(victim)  # the store reads the fetch and never answers it: a store cut off mid-fetch
        config = RankConfig(fetch_policy=patient)

        def victim_fetches() -> int:
            return sum(victim in f.blob_ids and f.holder == "trainer-0" for f in list(store.fetches))

        ranks = Ranks(bus, (config, config), steps=2, workdir=tmp_path)
        try:
            clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
            hand_over(clients, [step_batch(0, rank, steps[0], rank) for rank in (0, 1)])
            wait_for(victim_fetches, WAIT_S, "rank 0's fetch of the silenced blob")
            hand_over(clients, [step_batch(1, rank, steps[1], rank) for rank in (0, 1)])
            # Step 1's batch was taken while step 0's fetch still had attempts to make (each is one store
            # request): the loop serving it did not wait for that fetch to end.
            attempts_at_ack = victim_fetches()
            reports = [ranks.recv(rank) for _ in (0, 1) for rank in (0, 1)]
        finally:
            exits = ranks.close()
        assert exits == [0, 0]
        assert attempts_at_ack < patient.attempts, "step 1's batch waited for step 0's fetch"
        first = reports[0]
        # The victim's micro batch, and any other whose blob shared the unanswered request, timed out.
        timed_out = tuple(i for i, reason in enumerate(first["fetch_failures"]) if reason is not None)
        assert 0 in timed_out and {first["fetch_failures"][i] for i in timed_out} == {"timeout"}
        assert first["dropped"] == timed_out
        assert victim_fetches() == patient.attempts  # the fetch made every attempt of its policy before it timed out
        check_dropped(first["batches"][0], first["routing_rows"])
        assert all("failed" not in report for report in reports)
        assert [report["dropped_global"] for report in reports] == [len(timed_out)] * 2 + [0, 0]
        # The victim's micro batch was dropped and its owned blobs deleted as such; nothing was trained twice.
        reasons = {blob_id: reason for blob_id, holder, reason in deletes(envs) if holder == "trainer-0"}
        assert reasons[victim] == "dropped" if victim in steps[0].owned[0] else victim not in reasons
        assert [client.retries for client in clients] == [0, 0]
        down = sorted((event.node_id, event.reason) for event in events(bus, zmq_ctx, NodeDown.kind))
        assert down == [("trainer-0", "bye"), ("trainer-1", "bye")], "a rank missed its heartbeats"
    finally:
        registered.join(timeout=WAIT_S)
        assert proc.stop() == 0, proc.log_tail()


def test_deletes_to_a_store_killed_mid_step_reach_its_restarted_process(bus, orchestrator, spawn, tmp_path: Path,
                                                                         zmq_ctx) -> None:
    """A durable env server is SIGKILLed while the ranks train on its blobs, and restarted under its node id
    (re-adopting its store, listening elsewhere) only after the ranks' deletes failed against the dead one:
    the deletes wait for the new process and reach it, so every blob is deleted once, by its rank, and
    nothing stays held (before, the ranks gave up and held them until the store's shutdown)."""
    command = ["node", "env-server", "--bus-control", bus, "--node-id", "env-d", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "deletes", "--env-server-budget-bytes", str(64 << 20),
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, "env-d")
    policy = RetryPolicy(timeout_s=WAIT_S, attempts=1)
    client = Client(zmq_ctx, first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"], WireCodec("producer"),
                    policy=policy)
    try:
        data = make_step([ServedStore(client)], SPECS, data_ranks=2, prefix="d")
    finally:
        client.close()
    computing = RankConfig(compute_s=0.01)
    ranks = Ranks(bus, (computing, computing), steps=1, workdir=tmp_path)
    try:
        clients = [orchestrator(ranks.recv(rank)) for rank in (0, 1)]
        hand_over(clients, [step_batch(0, rank, data, rank) for rank in (0, 1)])
        assert [ranks.recv(rank) for rank in (0, 1)] == [("computing", 0)] * 2  # both fetched: the blobs were read
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        for rank in (0, 1):
            ranks.conns[rank].send(("go", 0))  # the deletes go to the dead process: nothing answers there
        restarted = spawn(command, "env-d-restarted").wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
        reports = [ranks.recv(rank) for rank in (0, 1)]
    finally:
        exits = ranks.close()
    assert exits == [0, 0]
    assert all("failed" not in report and report["dropped_global"] == 0 for report in reports), reports
    assert [sorted(report["deleted"]) for report in reports] == [sorted(owned) for owned in data.owned]
    assert [report["held_metric"] for report in reports] == [0, 0]
    client = Client(zmq_ctx, restarted, WireCodec("probe"), policy=policy)
    try:
        account = client.request(Accounts()).body
    finally:
        client.close()
    assert isinstance(account, Accounted)
    kept = sum(len(owned) for owned in data.owned)
    assert (account.kept, account.held, account.deleted, account.violations) == (kept, 0, {"trained": kept}, {})


def test_hand_overs_published_while_a_durable_store_was_dead_reach_its_restarted_process(spawn, tmp_path: Path,
                                                                                         zmq_ctx) -> None:
    """Two ranks take a step batch (their ``reference`` events go out) while the durable env server holding its
    blobs is dead; its restarted process re-adopts them, still the orchestrator's. The ranks see the new process
    come up and publish their hand-overs again, so the store holds each blob for its rank, and when the ranks
    die it reclaims them ``holder-down``, named with them. Before, the restarted store kept them as the
    orchestrator's: never reclaimed with the ranks (held until the store's shutdown), and a restarted
    orchestrator would have taken them back and shipped them again."""
    bus_proc, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
    grace_s = 1.0
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-h", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "hand-overs", "--env-server-budget-bytes", str(64 << 20),
               "--env-server-handover-lease-s", "600", "--node-restart-grace-s", str(grace_s)]
    orchestrator_node = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator",
                                                                    metrics_port=-1))
    orchestrator_node.start_background()  # the blobs' holder before the hand-over: live all along
    ranks = None
    stores: list[NodeProcess] = []
    policy = RetryPolicy(timeout_s=WAIT_S, attempts=1)
    try:
        first = spawn(command, "env-h")
        stores.append(first)
        client = Client(zmq_ctx, first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"], WireCodec("producer"),
                        policy=policy)
        try:
            data = make_step([ServedStore(client)], SPECS, data_ranks=2, prefix="h")
            owned = [blob_id for ids in data.owned for blob_id in ids]
            assert client.request(Claim(blob_ids=owned, holder="orchestrator")).body == Claimed(blob_ids=owned)
        finally:
            client.close()
        ranks = Ranks(control, (RankConfig(compute_s=0.01),) * 2, steps=1, workdir=tmp_path)
        rank_clients = [Client(zmq_ctx, ranks.recv(rank), WireCodec("orchestrator"), policy=policy)
                        for rank in (0, 1)]
        try:
            first.proc.kill()
            assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
            hand_over(rank_clients, [step_batch(0, rank, data, rank) for rank in (0, 1)])  # the store is dead
        finally:
            for rank_client in rank_clients:
                rank_client.close()
        stores.append(spawn(command, "env-h-restarted"))
        probe = Client(zmq_ctx, stores[-1].wait_ready(timeout=WAIT_S)["endpoints"]["blobs"], WireCodec("probe"),
                       policy=policy)
        try:
            def account() -> Accounted:
                reply = probe.request(Accounts()).body
                assert isinstance(reply, Accounted)
                return reply

            each = {f"trainer-{rank}": len(data.owned[rank]) for rank in (0, 1)}
            wait_for(lambda: account().held_by == each, 10 * node_timeout_s, "the ranks' hand-overs applied")
            assert [ranks.recv(rank) for rank in (0, 1)] == [("computing", 0)] * 2  # fetched from the new process
            for proc in ranks.procs:
                proc.kill()  # dead mid-step: what they hold is the store's to reclaim
            wait_for(lambda: account().reclaimed == each, 5 * (node_timeout_s + grace_s),
                     "the dead ranks' blobs reclaimed holder-down")
            final = account()
            assert (final.held_by, final.deleted, final.violations) == ({}, {"holder-down": len(owned)}, {})
        finally:
            probe.close()
    finally:
        if ranks is not None:
            ranks.close()
        orchestrator_node.join(timeout=WAIT_S)
        for store in stores:  # before the broker, so their goodbyes reach it
            store.stop()
        assert bus_proc.stop() == 0, bus_proc.log_tail()


# --- without processes: the rank's own bookkeeping ---------------------------------------------------------


def _nan_batch(owned: list[str]) -> StepBatch:
    from refbus.protocol.messages import BlobRef, MicroBatchRefs, SampleSlice

    refs = [BlobRef(endpoint="tcp://e", source="s", blob_id=blob_id, fields=["topk_ids"], tokens=4, nbytes=4,
                    checksum=0, node="env") for blob_id in owned]
    inputs = {"input_ids": np.arange(4), "advantages": np.array([np.nan, 1.0, 2.0, 0.0], dtype=np.float32)}
    mb = MicroBatchRefs(samples=[SampleSlice(f"x/{i}", 4, ref) for i, ref in enumerate(refs)], length=4 * len(refs),
                        inputs={name: np.concatenate([column] * len(refs)) for name, column in inputs.items()})
    return StepBatch(step=0, rank=0, micro_batches=[mb], owned=owned)


def test_an_identical_step_batch_with_nan_inputs_is_the_same_batch() -> None:
    """Regression: a re-delivered step batch whose float inputs held a NaN compared unequal to itself, so the
    rank refused its own step as a duplicate."""
    from refbus.nodes.payload.trainer_rank import _same_batch

    batch = _nan_batch(["a"])
    again = _nan_batch(["a"])  # the same values, other arrays
    assert _same_batch(batch, again)
    changed = _nan_batch(["a"])
    changed.micro_batches[0].inputs["advantages"][1] = 5.0
    assert not _same_batch(batch, changed)


def test_end_step_after_any_step_failure_deletes_what_the_rank_owns_and_held_follows() -> None:
    """Regression: ``end_step`` after a ``StepFailed`` that ``begin_step`` did not raise from its agreement (the
    node loop not answering the fetch) failed with a KeyError, and ``held`` (the ``blobs_held`` status) kept
    every blob whose delete failed or found it missing."""
    from refbus.nodes.payload.trainer_rank import StepFailed, StepRelease, TrainerRank, _Received

    batch = _nan_batch(["a", "b", "c"])
    refs = {s.ref.blob_id: s.ref for s in batch.micro_batches[0].samples}
    rank = object.__new__(TrainerRank)  # its bookkeeping only: no node, no process group
    rank.runtime = type("Runtime", (), {"loop_thread": object()})()
    rank._cond = threading.Condition()
    rank._running = {}
    rank.held = {"a", "b", "c", "later"}
    rank._wait_for = lambda step: rank._running.setdefault(step, (_Received(batch, refs), frozenset()))[0]
    asked: list[dict[str, str]] = []

    def on_loop(start: Callable) -> Any:
        if not asked:
            asked.append({})
            raise StepFailed("rank 0: the node loop did not end the requests within 1s")
        answer: list[Any] = []
        start(answer.append)
        return answer[0]

    def delete(refs: Any, reasons: dict[str, str], done: Callable) -> None:
        asked.append(dict(reasons))
        done(StepRelease(deleted=("a",), failed=("b",), missing=("c",)))

    rank._on_loop = on_loop
    rank._delete = delete
    with pytest.raises(StepFailed, match="did not end the requests"):
        rank.begin_step(0)
    release = rank.end_step(0)
    assert asked[1] == {"a": "dropped", "b": "dropped", "c": "dropped"}
    assert release == StepRelease(deleted=("a",), failed=("b",), missing=("c",))
    assert rank.held == {"later"}  # none of the step's is asked for again: the store reclaims what failed
    assert rank.end_step(0) == StepRelease() and rank.end_step(1) == StepRelease()  # nothing (more) to delete


def test_the_trainer_role_takes_the_limits_its_model_defines_and_checks_none_it_does_not() -> None:
    from refbus.nodes.payload.fetcher import ModelLimits
    from refbus.nodes.rl.trainer import model_limits
    from refbus.nodes.toy.policy import make_policy

    assert model_limits(make_policy(0, vocab_size=VOCAB, n_experts=EXPERTS)) == ModelLimits(VOCAB, EXPERTS)
    mixtral_like = torch.nn.Module()
    mixtral_like.config = type("Config", (), {"vocab_size": 32000, "num_local_experts": 8})()
    assert model_limits(mixtral_like) == ModelLimits(32000, 8)
    dense = torch.nn.Module()
    dense.config = type("Config", (), {"vocab_size": 32000, "num_experts": None})()
    assert model_limits(dense) == ModelLimits(32000, None)
    assert model_limits(torch.nn.Linear(2, 2)) == ModelLimits()
    # A dropped micro batch's forward takes in-range ids only: out-of-range ones become 0, malformed ones all 0.
    limits = ModelLimits(VOCAB)
    ids = np.array([3, VOCAB, -1, 2**63 - 1], dtype=np.int64)
    np.testing.assert_array_equal(limits.in_range({"input_ids": ids}, 4)["input_ids"], [3, 0, 0, 0])
    np.testing.assert_array_equal(limits.in_range({"input_ids": np.ones(3, np.float32)}, 4)["input_ids"], [0] * 4)
    kept = {"input_ids": np.array([1, 2])}
    assert limits.in_range(kept, 2) is kept and ModelLimits().in_range(kept, 2) is kept


def test_a_rank_without_its_rank_or_world_size_is_told_what_to_set() -> None:
    """Before, ``refbus node trainer`` run without torchrun died with ``KeyError: 'RANK'``."""
    unset = TrainerSettings()  # rank and world size -1: from the environment
    assert rank_and_world(unset, {"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)
    assert rank_and_world(TrainerSettings(rank=0, world_size=1), {}) == (0, 1)
    for environ, says in (({"WORLD_SIZE": "2"}, r"trainer\.rank is -1 \(read \$RANK\) but \$RANK is not set: .*"
                                                r"--trainer-rank"),
                          ({"RANK": "0"}, r"\$WORLD_SIZE is not set: .*--trainer-world-size"),
                          ({"RANK": "one", "WORLD_SIZE": "2"}, r"\$RANK is 'one'"),
                          ({"RANK": "5", "WORLD_SIZE": "2"}, r"trainer\.rank 5 is not below trainer\.world_size 2")):
        with pytest.raises(ConfigError, match=says):
            rank_and_world(unset, environ)


def test_a_trainer_node_without_rank_exits_2_with_a_message(tmp_path: Path) -> None:
    environ = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "node", "trainer", "--node-metrics-port", "-1",
                             "--bus-control", "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=120,
                            env=environ, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("refbus: trainer.rank is -1"), result.stderr


def test_end_step_never_changes_the_running_steps_under_the_loop_threads_look_at_them() -> None:
    """Regression: ``end_step`` (the training thread) took its step out of the running steps without the rank's
    lock, so the loop thread's look at what the rank holds on a restarted store (``_held_at``, under the lock:
    which hand-overs to repeat there) failed mid-iteration with "dictionary changed size during iteration", and
    the repeated hand-overs were lost. Here the look pauses mid-iteration until ``end_step`` returned, or for
    half a second: ``end_step`` now waits for the lock instead."""
    from refbus.nodes.payload.trainer_rank import StepRelease, TrainerRank, _Received

    batch = _nan_batch(["a"])
    refs = {s.ref.blob_id: s.ref for s in batch.micro_batches[0].samples}
    looking, ended = threading.Event(), threading.Event()

    class Running(dict):
        """The running steps; an iteration over their values pauses after its start, as a thread switch would."""

        def values(self):  # type: ignore[override]
            values = iter(dict.values(self))
            looking.set()
            ended.wait(0.5)
            yield from values

    rank = object.__new__(TrainerRank)  # its bookkeeping only: no node, no process group
    rank._cond = threading.Condition()
    rank._received = {}
    rank._running = Running({0: (_Received(batch, refs), frozenset())})
    rank.held = {"a"}
    rank._on_loop = lambda start: StepRelease(deleted=("a",))
    looked: list[Any] = []
    look = threading.Thread(target=lambda: looked.append(_outcome(lambda: rank._held_at("env"))))
    look.start()
    assert looking.wait(WAIT_S)
    releases: list[Any] = []
    end = threading.Thread(target=lambda: (releases.append(rank.end_step(0)), ended.set()))
    end.start()
    look.join(WAIT_S)
    end.join(WAIT_S)
    assert not look.is_alive() and not end.is_alive()
    assert looked == [{0: ["a"]}] and releases == [StepRelease(deleted=("a",))]
    assert not rank._running and not rank.held


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        return exc
