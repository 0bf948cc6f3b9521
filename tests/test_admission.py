"""Admission on env servers whose budgets hold one step and no more, end to end: a broker, two durable env
servers of one source (``refbus node env-server``, 3 of this run's episodes each under the budget, 2 under the
high-water mark) and the real orchestrator dispatching (``refbus node orchestrator``: groups of 3, 2 a step, one
group at a time);
in this process a rollout worker that answers at once (or holds the generations of the groups the test says),
a ps-manager's version, and a trainer rank that acknowledges each step and deletes what its stores say it holds.

Before, a group went where the stores' high-water marks had room for it, or, with nothing in flight and every
store full, anywhere (one run a store in turn) under their budgets: a store already at its budget took a run
that waited for room there until it failed ``over-budget``, its group was abandoned and the next one went the
same way, for good. Now each run reserves room for its episode, under the budgets when every store is full, so
a group started can always complete; the run trains its steps with every blob deleted once and nothing lost,
and an env server killed while runs hold room there gives that room back and loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import FAST_LIVENESS
from partition_entry_points import PROMPT_TOKENS
from polling import wait_for
from refbus.bus.reqrep import Client, Pending, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.halting import HALTED_STATUS, halt_reason
from refbus.nodes.launch import NodeProcess
from refbus.nodes.settings import NodeSettings
from refbus.nodes.supervisor import Supervisor
from refbus.nodes.toy import task
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    Accounted,
    Accounts,
    Delete,
    Deleted,
    Generate,
    Generated,
    Held,
    HoldingsQuery,
    Ok,
    Reference,
    StepBatch,
)
from scenario_support import Registry
from test_payload_scenario import capture_ledger
from test_up import TESTS

WAIT_S = 20.0  # a node ready, a store drained
GENERATE_TIMEOUT_S = 2.0  # a run waiting for room fails this soon: before, every group after the stall did
RUN_WAIT_S = 10 * GENERATE_TIMEOUT_S  # the steps of a run that goes on
HOLD_S = 5 * GENERATE_TIMEOUT_S  # the env servers' generate timeout while the rollout worker holds generations
# Each episode here is one blob of under a page, charged 8 KiB and its info (about 8.3 KiB): a budget of 3.
BUDGET = 26_000
GROUP_SIZE, GROUPS_PER_STEP, STEPS = 3, 2, 2
TRAINER = "trainer-0"
STORES = ("env-0", "env-1")


def group_of(prompt: list[int]) -> int:
    """The number of the group a prompt of ``partition_entry_points.make_prompt`` was made for."""
    return sum(int(t) * task.TASK.vocab_size**i for i, t in enumerate(prompt[:PROMPT_TOKENS]))


class Rollout:
    """A rollout worker that answers each generation at once, except those of groups ``hold`` says: held until
    :meth:`release`. A group's first episode is right and the others wrong (rewards differ: never filtered)."""

    def __init__(self, control: str, hold: Callable[[int], bool]) -> None:
        self.runtime = NodeRuntime("rollout", RuntimeSettings(bus=control, node_id="rollout-0", metrics_port=-1))
        self.server = self.runtime.serve("generate", "tcp://127.0.0.1:0")
        self.server.on(Generate.kind, self._on_generate, cached=False)
        self.hold = hold
        self.held: list[tuple[str, Pending, Generated]] = []  # (env server, its request, the answer)
        self.asked: Counter[tuple[int, ...]] = Counter()

    def _on_generate(self, request: Message) -> Generated | None:
        ask = request.body
        assert isinstance(ask, Generate)
        prompt = tuple(ask.prompt)
        right = not self.asked[prompt]
        self.asked[prompt] += 1
        tokens = [*prompt, (prompt[0] + (1 if right else 2)) % task.TASK.vocab_size]
        answer = Generated(tokens, 0, {"routed_experts": np.ones((len(tokens), 2, 2), np.uint8)})
        if not self.hold(group_of(ask.prompt)):
            return answer
        self.held.append((request.header.src, self.server.pending, answer))
        return None

    def release(self) -> None:
        """Answer what is held (a killed env server's requests go nowhere) and hold nothing from now on."""

        def answer() -> None:
            self.hold = lambda group: False
            held, self.held = self.held, []
            for _, pending, generated in held:
                self.server.answer(pending, generated)

        self.runtime.call_soon(answer)


class Trainer:
    """A trainer rank without torch: acknowledges each step batch once, publishing its ``reference`` first
    as a rank does, and reports the last one received in its heartbeat status."""

    def __init__(self, control: str) -> None:
        self.runtime = NodeRuntime("trainer", RuntimeSettings(bus=control, node_id=TRAINER, metrics_port=-1))
        self.runtime.labels.update(rank="0", data_rank="0", leader="1")
        self.steps: list[int] = []
        self.runtime.serve("trainer", "tcp://127.0.0.1:0").on(StepBatch.kind, self._on_step_batch)
        self.runtime.status = lambda: {"step": 0.0, "received": float(self.steps[-1] if self.steps else -1)}

    def _on_step_batch(self, request: Message) -> Ok:
        batch = request.body
        assert isinstance(batch, StepBatch)
        if batch.step not in self.steps:
            self.runtime.publish(Reference(step=batch.step, holder=TRAINER, blob_ids=list(batch.owned)))
            self.steps.append(batch.step)
        return Ok()


@dataclass
class Cluster:
    control: str
    workdir: Path
    rollout: Rollout
    trainer: Trainer
    stores: dict[str, NodeProcess]
    orchestrator: NodeProcess
    ctx: zmq.Context
    registry: Registry
    clients: dict[str, Client] = field(default_factory=dict)

    generate_timeout_s: float = GENERATE_TIMEOUT_S

    def store_command(self, name: str) -> list[str]:
        return ["node", "env-server", "--bus-control", self.control, "--node-id", name, *FAST_LIVENESS,
                "--store-directory", str(self.workdir / "shm"), "--store-run", name, "--env-server-source", "toy",
                "--env-server-budget-bytes", str(BUDGET),
                "--env-server-generate-timeout-s", str(self.generate_timeout_s)]

    def connect(self, name: str, entry: dict[str, Any]) -> None:
        with contextlib.suppress(KeyError):
            self.clients.pop(name).close()
        self.clients[name] = Client(self.ctx, entry["endpoints"]["blobs"], WireCodec("trained"),
                                    policy=RetryPolicy(timeout_s=WAIT_S / 4, attempts=1))

    def train(self) -> int:
        """Delete, as the trainer rank, what every store says it holds (the steps it took); blobs deleted."""
        deleted = 0
        for client in self.clients.values():
            held = client.request(HoldingsQuery(holder=TRAINER)).body
            assert isinstance(held, Held) and not held.more
            if ids := [blob_id for entry in held.episodes for blob_id in entry.held]:
                reply = client.request(Delete(blob_ids=ids, holder=TRAINER, reason="trained")).body
                assert isinstance(reply, Deleted) and reply.blob_ids == ids, reply
                deleted += len(ids)
        return deleted

    def accounts(self, name: str) -> Accounted:
        reply = self.clients[name].request(Accounts(holders=4)).body
        assert isinstance(reply, Accounted)
        return reply

    def orchestrator_status(self) -> dict[str, float]:
        return self.registry.nodes("orchestrator")["orchestrator"].status

    def trained(self, steps: int) -> bool:
        """Train what was shipped; whether ``steps`` were (the orchestrator still running)."""
        assert self.orchestrator.proc.poll() is None, self.orchestrator.log_tail()
        self.train()
        return len(self.trainer.steps) >= steps

    def finish(self) -> None:
        """Stop the orchestrator (it deletes what it holds), train the last step, and check the ledger: every blob
        kept deleted once by its owner, none lost, no violation."""
        wait_for(lambda: self.orchestrator_status().get("runs_in_flight") == 0, WAIT_S, "no run in flight")
        self.orchestrator.signal(signal.SIGTERM)
        assert self.orchestrator.proc.wait(WAIT_S) == 0, self.orchestrator.log_tail()
        wait_for(lambda: self.train() >= 0 and all(self.accounts(n).held == 0 for n in STORES), WAIT_S,
                 "every store empty")
        report = capture_ledger(self.control, self.workdir).report()
        totals = report.totals()
        assert report.ok and totals["kept"] == totals["deleted_total"] > 0, report.as_dict()
        assert totals["violations"] == totals["lost"] == 0 and "lost" not in totals["deleted"], report.as_dict()


@pytest.fixture
def cluster(bus, spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request) -> Iterator[Cluster]:
    """The cluster of the module doc; ``request.param``: which groups' generations the rollout worker holds, the
    env servers' generate timeout (how long they wait for one) and the orchestrator's groups_per_step."""
    hold, generate_timeout_s, groups_per_step = request.param
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    _, control = bus
    manager = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="ps-version", metrics_port=-1))
    manager.status = lambda: {"version": 0.0}
    rollout, trainer = Rollout(control, hold), Trainer(control)
    ctx, registry = zmq.Context(), Registry(control)
    started = [manager, rollout.runtime, trainer.runtime]
    try:
        for node in started:
            node.start_background()
        cluster = Cluster(control, tmp_path, rollout, trainer, {}, None, ctx, registry,
                          generate_timeout_s=generate_timeout_s)  # type: ignore[arg-type]
        cluster.stores = {name: spawn(cluster.store_command(name), name) for name in STORES}
        cluster.orchestrator = spawn(
            ["node", "orchestrator", "--bus-control", control, "--node-id", "orchestrator", *FAST_LIVENESS,
             "--node-metrics-port", "-1", "--orchestrator-dispatch", "true", "--orchestrator-trainers", "1",
             "--orchestrator-prompt", "partition_entry_points:make_prompt", "--orchestrator-seq-len", "64",
             "--orchestrator-group-size", str(GROUP_SIZE), "--orchestrator-groups-per-step", str(groups_per_step),
             "--orchestrator-max-steps", str(STEPS), "--orchestrator-max-staleness", "100",
             "--orchestrator-max-groups-in-flight", "1",
             "--env-server-generate-timeout-s", str(generate_timeout_s)], "orchestrator")
        for name, proc in cluster.stores.items():
            cluster.connect(name, proc.wait_ready(WAIT_S))
        cluster.orchestrator.wait_ready(WAIT_S)
        yield cluster
    finally:
        for client in (cluster.clients.values() if "cluster" in locals() else ()):
            client.close()
        ctx.destroy(linger=0)
        registry.close()
        for node in started:
            node.join(WAIT_S)


@pytest.mark.parametrize("cluster", [(lambda group: False, GENERATE_TIMEOUT_S, GROUPS_PER_STEP)], indirect=True)
def test_stores_that_hold_one_step_train_every_step_and_every_blob_is_deleted_once(cluster: Cluster) -> None:
    """A step's 6 episodes fill both stores to their budgets. The second group of each step finds every store at
    its high-water mark and nothing in flight: before, its runs went one a store in turn, so env-0, two short of
    its budget and the first in that order, took two runs, one of which waited there until it failed; the group
    was abandoned and the next one went the same way, for good."""
    wait_for(lambda: cluster.trained(STEPS), RUN_WAIT_S, f"{STEPS} steps trained")
    cluster.finish()


@pytest.mark.parametrize("cluster", [(lambda group: group >= 3, HOLD_S, GROUPS_PER_STEP)], indirect=True)
def test_an_env_server_killed_while_runs_hold_room_there_gives_it_back_and_loses_nothing(cluster: Cluster) -> None:
    """Step 0 trained, group 2 is queued (one of its episodes on env-1) and group 3's generations are held with
    two of its runs' room reserved on env-1, when env-1 is SIGKILLed: its runs fail, their room is given back
    (the orchestrator reserves only for its run still in flight on env-0), and env-1 restarted re-adopts its
    store. Once the generations go on, the run trains its steps and nothing is lost."""
    rollout = cluster.rollout
    wait_for(lambda: cluster.trained(1) and any(src == "env-1" for src, _, _ in rollout.held)
             and cluster.accounts("env-1").held_by.get("orchestrator", 0) >= 1
             and cluster.orchestrator_status().get("episodes_reserved") == GROUP_SIZE,
             RUN_WAIT_S, "group 3 holding room on env-1, which keeps a queued episode")
    reserved_on_env_0 = sum(src == "env-0" for src, _, _ in rollout.held)
    victim = cluster.stores["env-1"]
    os.kill(victim.proc.pid, signal.SIGKILL)
    assert victim.proc.wait(WAIT_S) == -signal.SIGKILL
    wait_for(lambda: cluster.orchestrator_status().get("episodes_reserved") == reserved_on_env_0, WAIT_S,
             "env-1's reservations given back")
    restarted = NodeProcess(cluster.store_command("env-1"), workdir=cluster.workdir, name="env-1-restarted")
    try:
        cluster.connect("env-1", restarted.wait_ready(WAIT_S))
        assert cluster.accounts("env-1").held_by.get("orchestrator", 0) >= 1  # re-adopted
        rollout.release()
        wait_for(lambda: cluster.trained(STEPS), RUN_WAIT_S, f"{STEPS} steps trained after the restart")
        cluster.finish()
    finally:
        assert restarted.stop() == 0, restarted.log_tail()


@pytest.mark.parametrize("cluster", [(lambda group: False, GENERATE_TIMEOUT_S, 3)], indirect=True)
def test_stores_that_cannot_hold_a_step_halt_the_orchestrator_and_the_supervisor_ends_the_run_naming_why(
        cluster: Cluster) -> None:
    """Steps of 3 groups of 3 against two stores of 3 episodes each: once they hold two groups no step can ever
    ship. The real orchestrator halts with ``HALTED_STATUS``, its last words on stderr the reason, and
    ``refbus up``'s supervisor, watching its process, ends the run naming it and why. Before, it exited 1, a
    crash to the supervisor, which restarted it to measure and halt again until the restart budget was spent."""
    orchestrator = cluster.orchestrator
    # The halt waits node.restart_grace_s (the default here) for another store to register once it is short.
    assert orchestrator.proc.wait(RUN_WAIT_S + NodeSettings().restart_grace_s) == HALTED_STATUS, \
        orchestrator.log_tail()
    reason = halt_reason(orchestrator.log_tail())
    assert "one step needs 9 (groups_per_step 3 x group_size 3): no step can ever ship" in reason, reason
    supervisor = Supervisor(SimpleNamespace(nodes=[orchestrator]), budget=3, backoff_s=0.0,  # type: ignore[arg-type]
                            say=lambda _: None)
    assert supervisor.poll() == f"orchestrator halted the run (exit {HALTED_STATUS}, halted): {reason}"
    assert supervisor.restarts == 0 and supervisor.fatal == ["orchestrator"]
