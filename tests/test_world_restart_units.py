"""Trainer-world restarts, decided in-process: the orchestrator core stops shipping when a rank of its world
goes down, gives up the step in delivery, waits for a new world (every old rank down, the stores' reclaim
grace passed, all new ranks reporting one step) and continues from that step, or halts naming the world;
the supervisor restarts the whole world once for a dead rank and chaos may pick trainer ranks; a trainer
rank ends its world for the death of a rank of that world only."""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from refbus.bus.peers import ABSENT_AFTER_RESTART
from refbus.nodes.config import Config
from refbus.nodes.payload import orchestrator_core
from refbus.nodes.payload.orchestrator_core import (
    TRAINER_DOWN,
    Deadlines,
    DeliverBatch,
    Halt,
    OrchestratorCore,
    SendRun,
)
from refbus.nodes.rl.trainer import end_world_on_peer_death
from refbus.nodes.supervisor import Chaos, Supervisor
from refbus.nodes.up import LocalCluster, _cluster_config, rendezvous
from refbus.protocol.messages import NodeDown, NodeInfo
from structlog.testing import capture_logs
from test_orchestrator_core import T0, deletes, env_server, episode, feed_group, of, ranked, settings, trainer
from test_supervise import _Clock, _Cluster, _Node

GRACE_S = 2.0
DEADLINES = Deadlines(delivery_s=30.0, redeliver_after_s=2.0, run_s=44.0, restart_grace_s=GRACE_S,
                      world_restart_s=20.0)


def restarted(rank: int, step: int) -> NodeInfo:
    """Rank ``rank`` of a new world (another process) that resumed at ``step``."""
    return msgspec.structs.replace(trainer(rank), pid=100 + rank, endpoints={"trainer": f"tcp://new{rank}"},
                                   status={"step": float(step)})


def test_a_dead_rank_pauses_shipping_until_a_new_world_reports_its_step_and_the_old_one_is_reclaimed() -> None:
    core = OrchestratorCore(settings(max_staleness=4), DEADLINES)  # the samples' version 0 is never too stale
    core.use_trainers(T0, [trainer(0), trainer(1)])
    for step in range(3):  # steps 0..2 shipped and acknowledged
        delivered = of(DeliverBatch, feed_group(core, T0, f"g{step}"))
        assert [d.step for d in delivered] == [step, step]
        for d in delivered:
            core.on_delivered(T0, d.step, d.endpoint, None)
    step3 = of(DeliverBatch, feed_group(core, T0, "g3"))
    core.on_delivered(T0, 3, step3[0].endpoint, None)  # rank 0 took step 3; rank 1 died before it answered

    actions = core.trainer_down(T0 + 1, trainer(1))
    rank1_owned = sorted(step3[1].batch.owned)
    assert rank1_owned and deletes(actions) == {}  # it may have taken its batch before it died: nothing yet
    assert core.on_delivered(T0 + 1, 3, step3[1].endpoint, "tcp://t1 went down: trainer-1 reported down") == []
    assert of(DeliverBatch, feed_group(core, T0 + 1, "g4")) == []  # nothing ships to a broken world
    assert of(DeliverBatch, core.tick(T0 + 2)) == []

    new_world = [restarted(0, 2), restarted(1, 2)]
    assert core.use_trainers(T0 + 2, new_world) == []  # rank 0 of the old world is not reported down yet
    assert core.trainer_down(T0 + 2, trainer(0)) == []
    assert core.use_trainers(T0 + 2 + GRACE_S, [restarted(0, 2), restarted(1, 3)]) == []  # not one step yet
    assert core.use_trainers(T0 + 2 + GRACE_S, new_world) == []  # the stores' reclaim is not over
    resumed = core.use_trainers(T0 + 2 + 1.25 * GRACE_S, new_world)
    # The stores have reclaimed what the old world held, and no acknowledgement or reference of rank 1 came: it
    # never took its batch, which is deleted now.
    assert deletes(resumed) == {TRAINER_DOWN: rank1_owned}
    resumed = of(DeliverBatch, resumed)
    assert sorted((d.step, d.endpoint) for d in resumed) == [(2, "tcp://new0"), (2, "tcp://new1")]
    assert core.step == 3 and core.policy_version == 2 and core.world_restarts == 1
    assert core.rewound_groups == 2  # steps 2 and 3 of the old world: their admission slots are free again
    assert core.trainer_down(T0 + 10, trainer(1)) == []  # the old world's processes are no longer the world


@pytest.mark.parametrize(("resume_at", "estimated"), [(36, False), (5, True), (0, False)])
def test_the_groups_each_step_shipped_are_kept_for_the_newest_steps_only_and_a_deeper_rewind_still_frees_them(
        monkeypatch: pytest.MonkeyPatch, resume_at: int, estimated: bool) -> None:
    """Regression: the groups of every step shipped were kept one entry a step for the whole run (one a few
    seconds, for days). Now the newest SHIPPED_STEPS_KEPT steps are, and older ones one total: a world resumed
    within the kept steps, or before every folded one, gives back exactly the groups of the steps it rewinds;
    one resumed among the folded steps counts each as a full step, and says so."""
    monkeypatch.setattr(orchestrator_core, "SHIPPED_STEPS_KEPT", 8, raising=False)
    core = OrchestratorCore(settings(max_staleness=1), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    steps = 40
    for step in range(steps):
        delivered = of(DeliverBatch, feed_group(core, T0, f"g{step}", version=core.policy_version))
        assert [d.step for d in delivered] == [step, step]
        for d in delivered:
            core.on_delivered(T0, d.step, d.endpoint, None)
        core.on_version(core.step)
    assert len(core._groups_of_step) <= 8
    core.trainer_down(T0 + 1, trainer(0))
    core.trainer_down(T0 + 1, trainer(1))
    new_world = [restarted(0, resume_at), restarted(1, resume_at)]
    with capture_logs() as logs:
        core.use_trainers(T0 + 1 + 1.25 * GRACE_S, new_world)
    assert core.world_restarts == 1 and core.step == resume_at
    assert core.rewound_groups == steps - resume_at  # one group a step
    assert any(entry["event"] == "trainers.rewind_estimated" for entry in logs) is estimated


def test_a_sample_of_the_retired_lineage_that_arrives_after_a_world_resumed_is_stale_not_shipped() -> None:
    """Regression: a world resumed at step K retires the dead world's versions above K, and the queued samples of
    those versions were dropped ``stale``; but a group still open then (its other runs in flight, generated by
    the retired weights) completed later and shipped at step K: a sample of a version above the weights that
    train its step counted as fresh. Now such a sample is stale whenever its step is packed."""
    core = OrchestratorCore(settings(max_staleness=1), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    for step in range(6):
        delivered = of(DeliverBatch, feed_group(core, T0, f"g{step}", version=core.policy_version))
        assert [d.step for d in delivered] == [step, step]
        for d in delivered:
            core.on_delivered(T0, d.step, d.endpoint, None)
        core.on_version(core.step)
    first = episode("open-0", "open", 1.0, version=6)  # of the dead world's lineage
    assert core.on_episode(T0, first, first.refs) == []
    core.trainer_down(T0 + 1, trainer(0))
    core.trainer_down(T0 + 1, trainer(1))
    core.use_trainers(T0 + 1 + 1.25 * GRACE_S, [restarted(0, 3), restarted(1, 3)])
    assert (core.step, core.policy_version) == (3, 3)
    last = episode("open-1", "open", 0.0, version=6)  # its run was in flight: the retired weights generated it
    actions = core.on_episode(T0 + 5, last, last.refs)
    assert of(DeliverBatch, actions) == []
    assert deletes(actions) == {"stale": ["b-open-0", "b-open-1"]} and not core.holdings.held


def test_a_world_resumed_before_the_step_a_restarted_core_took_gives_back_the_earlier_steps_slots() -> None:
    """Regression: a restarted core counts the steps before the one it resumes at as admitted groups, but a world
    resumed from a checkpoint before that step gave back only the groups this core shipped: admitted and never
    released, they held admission above its bound for good, and no run went out again. Now those steps count
    as full ones, given back as they were counted."""
    core = OrchestratorCore(settings(max_staleness=1), DEADLINES, prompts=lambda rng: [1])
    core.on_version(9)
    core.use_trainers(T0, [ranked(0, step=9), ranked(1, step=9)])
    delivered = of(DeliverBatch, feed_group(core, T0, "g9", version=9))
    assert [d.step for d in delivered] == [9, 9]
    for d in delivered:
        core.on_delivered(T0, d.step, d.endpoint, None)
    core.trainer_down(T0 + 1, ranked(0, step=9))
    core.trainer_down(T0 + 1, ranked(1, step=9))
    core.use_trainers(T0 + 1 + 1.25 * GRACE_S, [restarted(0, 6), restarted(1, 6)])  # its checkpoint of step 6
    assert (core.step, core.policy_version, core.rewound_groups) == (6, 6, 4)  # steps 6..8 counted, and step 9
    core.use_replicas([env_server("env-a")])
    assert of(SendRun, core.dispatch(T0 + 10)) and core.idle_reason(T0 + 10) == ("", "")


def test_a_restarted_cores_fills_are_dropped_when_its_world_goes_down() -> None:
    """A world that goes down before a restarted core's fills are delivered resumes from a checkpoint, every
    rank at one step: the new world is sent no fill, its step ships whole."""
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1])
    ranks = [ranked(0, step=1, received=1), ranked(1, step=1, received=0)]
    feed_group(core, T0, "g2", version=2)
    (fill,) = of(DeliverBatch, core.use_trainers(T0, ranks))
    assert (fill.step, fill.batch.rank, fill.batch.micro_batches) == (1, 1, [])
    core.trainer_down(T0 + 1, ranks[0])
    core.trainer_down(T0 + 1, ranks[1])
    assert of(DeliverBatch, core.use_trainers(T0 + 1 + 1.25 * GRACE_S, [restarted(0, 1), restarted(1, 1)])) == []
    assert core.step == 1  # g2, of the retired lineage's version 2, was dropped stale
    shipped = of(DeliverBatch, feed_group(core, T0 + 4, "g3", version=1))
    assert [(d.step, d.batch.rank) for d in shipped] == [(1, 0), (1, 1)]
    assert all(d.batch.micro_batches for d in shipped)


def test_a_step_batch_a_live_rank_takes_after_its_world_went_down_is_its_own_and_never_deleted() -> None:
    """Regression: when a rank died, every batch of the step in delivery that was not acknowledged yet was
    deleted ``trainer-down`` at once, those still in flight included. A rank of that world still alive takes
    its batch (its ``reference`` makes the blobs its own) and answers: its fetch and its delete after the step
    then hit blobs deleted under it (violations), or the orchestrator's delete took a live rank's blobs. Now a
    batch a rank refused is deleted at once, one acknowledged or referenced (its answer lost) is the rank's,
    and one whose outcome stays unknown is deleted once the stores have reclaimed the old world's blobs."""
    core = OrchestratorCore(settings(), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    to0, to1 = of(DeliverBatch, feed_group(core, T0, "g0"))
    assert to0.batch.owned and to1.batch.owned
    core.on_delivered(T0, 0, to0.endpoint, "[not-leader] rank 0 does not delete for data rank 0", refused=True)
    actions = core.trainer_down(T0 + 1, trainer(0))  # rank 1's batch is still in flight
    assert deletes(actions) == {TRAINER_DOWN: to0.batch.owned}  # refused: nothing of it is rank 0's
    assert core.on_delivered(T0 + 1.1, 0, to1.endpoint, None) == []  # rank 1 took it: its own from now on
    assert not core.holdings.held and core.holdings.handed_over == len(to1.batch.owned)
    core.trainer_down(T0 + 2, trainer(1))
    assert deletes(core.tick(T0 + 2 + 1.25 * GRACE_S)) == {}  # nothing of it is deleted, ever
    assert deletes(core.use_trainers(T0 + 3 + 1.25 * GRACE_S, [restarted(0, 0), restarted(1, 0)])) == {}
    assert core.world_restarts == 1 and core.world_down is None

    # A batch that got no answer: the rank may hold it. Deleted once the stores reclaimed the old world's blobs.
    core = OrchestratorCore(settings(), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    to0, to1 = of(DeliverBatch, feed_group(core, T0, "g0"))
    core.on_delivered(T0, 0, to0.endpoint, None)
    core.on_delivered(T0 + 2, 0, to1.endpoint, "no reply from tcp://t1 to step-batch within the deadline")
    assert deletes(core.trainer_down(T0 + 3, trainer(0))) == {}
    assert core.on_delivered(T0 + 3, 0, to1.endpoint, "no reply") == []  # still unknown
    core.on_reference(0, "trainer-0", to1.batch.owned)  # another rank's: says nothing of rank 1's batch
    assert deletes(core.trainer_down(T0 + 4, trainer(1))) == {}
    assert deletes(core.tick(T0 + 4 + 1.25 * GRACE_S - 0.01)) == {}
    assert deletes(core.tick(T0 + 4 + 1.25 * GRACE_S)) == {TRAINER_DOWN: to1.batch.owned}
    assert not core.holdings.held

    # A rank that took its batch, trained it, deleted its blobs and left before its answer was read (the
    # request ended as its rank went down): its reference event says it took it, before or after the world
    # went down. Nothing of it is deleted here (that would be a second delete, a violation).
    for referenced_first in (True, False):
        core = OrchestratorCore(settings(), DEADLINES)
        core.use_trainers(T0, [trainer(0), trainer(1)])
        to0, to1 = of(DeliverBatch, feed_group(core, T0, "g0"))
        core.on_delivered(T0, 0, to0.endpoint, None)
        if referenced_first:
            core.on_reference(0, "trainer-1", to1.batch.owned)
        assert deletes(core.trainer_down(T0 + 1, trainer(1))) == {}
        core.on_delivered(T0 + 1, 0, to1.endpoint, "tcp://t1 went down: trainer-1 reported down (bye)")
        if not referenced_first:
            core.on_reference(0, "trainer-1", to1.batch.owned)
        assert not core.holdings.held and core.holdings.handed_over == len(to0.batch.owned) + len(to1.batch.owned)
        core.trainer_down(T0 + 1, trainer(0))
        assert deletes(core.tick(T0 + 1 + 1.25 * GRACE_S)) == {}


def test_no_new_world_within_the_wait_halts_naming_the_dead_rank() -> None:
    core = OrchestratorCore(settings(), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    core.trainer_down(T0, trainer(0))
    assert of(Halt, core.tick(T0 + 19)) == []
    halts = of(Halt, core.tick(T0 + 20))
    assert len(halts) == 1 and "trainer world went down (trainer-0 first)" in halts[0].reason
    assert core.failure == halts[0].reason
    # Not final: a world its supervisor's backoff holds back past this wait may yet come; the orchestrator exits
    # 1 and, restarted, waits for it again (final halts exit HALTED_STATUS: refbus up would end the run).
    assert not halts[0].final


class _WorldCluster(_Cluster):
    def __init__(self, *names: str) -> None:
        super().__init__(*names)
        self.worlds = 0

    def restart_world(self) -> list[_Node]:
        self.worlds += 1
        ranks = [n for n in self.nodes if n.name.startswith("trainer-")]
        return [self.restart(rank) for rank in ranks]


def test_the_supervisor_restarts_the_whole_world_once_for_a_dead_rank_after_the_others_had_time_to_exit() -> None:
    cluster, clock, said = _WorldCluster("orchestrator", "trainer-0", "trainer-1"), _Clock(), []
    supervisor = Supervisor(cluster, budget=3, backoff_s=0.5, say=said.append, clock=clock,  # type: ignore[arg-type]
                            world_restarts=True, world_exit_s=2.0)
    cluster.nodes[2].signal(signal.SIGKILL)
    assert supervisor.poll() is None and supervisor.world_pending
    assert supervisor.report() == {"restarts": 0, "world_restarts": [], "deaths": [  # due, not made yet
        {"node": "trainer-1", "pid": 102, "exit": "SIGKILL", "at_s": 0.0, "restarted": False}]}
    cluster.nodes[1].proc.code = 1  # the survivor ends its broken world: part of the same restart
    clock.now = 1.9
    assert supervisor.poll() is None and cluster.worlds == 0
    clock.now = 2.0
    assert supervisor.poll() is None and cluster.worlds == 1 and not supervisor.world_pending
    assert cluster.restarted == ["trainer-0", "trainer-1"]
    assert supervisor.report() == {"restarts": 1, "world_restarts": ["trainer-1"], "deaths": [
        {"node": "trainer-1", "pid": 102, "exit": "SIGKILL", "at_s": 0.0, "restarted": True}]}
    assert "trainer-1 died (SIGKILL); stopping its trainer world" in said[0]

    # Without checkpoints a dead rank ends the run, as before.
    cluster = _WorldCluster("trainer-0", "trainer-1")
    supervisor = Supervisor(cluster, budget=3, backoff_s=0.5, say=said.append, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[0].proc.code = 1
    assert "trainer-0 died (exit 1); it is not restartable" in (supervisor.poll() or "")


def test_chaos_picks_trainer_ranks_only_when_worlds_are_restarted() -> None:
    for worlds in (False, True):
        cluster, clock = _WorldCluster("env-0", "trainer-0", "trainer-1"), _Clock()
        chaos = Chaos(cluster, 1.0, 3, say=lambda _: None, clock=clock, worlds=worlds)  # type: ignore[arg-type]
        for tick in range(1, 31):
            clock.now = tick
            chaos.poll()
            for node in list(cluster.nodes):
                if node.proc.code is not None:
                    cluster.restart(node)
        picked = {name.split("-")[0] for name in chaos.killed}
        assert picked == ({"env", "trainer"} if worlds else {"env"})


def test_a_rank_a_restarted_broker_lacked_ends_the_world_only_if_it_is_not_back_a_node_timeout_later() -> None:
    """A peer rank reported down because a restarted broker's registry lacked it (slow to re-join, perhaps
    alive) is given ``exit_within_s``: back as the same process by then, the world goes on; still absent, or
    back as another process, it ends the world as any death does. Before, such a report ended the world at once."""
    runtime, done = _Runtime(), threading.Event()
    end_world_on_peer_death(runtime, _Trainer(), {0: 10, 1: 11}, done, exit_within_s=1.0)  # type: ignore[arg-type]
    (on_down,) = runtime.peers.listeners
    rank1 = msgspec.structs.replace(trainer(1), pid=11)
    absent = NodeDown(node_id="trainer-1", role="trainer", reason=ABSENT_AFTER_RESTART, last_seen=0.0)
    on_down(absent, rank1)
    (delay_s, check), = runtime.timers
    assert delay_s == 1.0
    runtime.peers.live["trainer-1"] = rank1  # it re-joined as the same process
    check()
    on_down(absent, rank1)
    runtime.peers.live["trainer-1"] = msgspec.structs.replace(rank1, pid=99)  # another process under the id
    with pytest.raises(AssertionError, match=r"aborted: trainer rank 1 \(trainer-1, pid 11\) went down "
                                             r"\(absent-after-broker-restart\)"):
        runtime.timers[-1][1]()
    del runtime.peers.live["trainer-1"]
    on_down(absent, rank1)
    with pytest.raises(AssertionError, match="aborted: trainer rank 1"):
        runtime.timers[-1][1]()  # never back
    done.set()  # past the last collective: neither a report nor a check that fires then ends the world
    on_down(absent, rank1)
    runtime.timers[-1][1]()


class _Peers:
    def __init__(self) -> None:
        self.listeners: list = []
        self.live: dict[str, NodeInfo] = {}

    def on_down(self, listener: object) -> None:
        self.listeners.append(listener)


class _Runtime:
    def __init__(self) -> None:
        self.peers = _Peers()
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def track_peers(self) -> _Peers:
        return self.peers

    def later(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.timers.append((delay_s, callback))


class _Trainer:
    rank = 0
    broken = ""
    interrupted = False

    def abort(self, reason: str) -> None:  # raising stops the listener before it ends this process
        raise AssertionError(f"aborted: {reason}")


def test_a_rank_ignores_the_deaths_of_other_worlds_ranks_of_other_roles_and_of_peers_after_the_last_step() -> None:
    """The trainer's peer view (refbus node trainer): only a rank of its own world (same pid) ends it."""
    runtime, done = _Runtime(), threading.Event()
    broken = end_world_on_peer_death(runtime, _Trainer(), {0: 10, 1: 11}, done, exit_within_s=1.0)  # type: ignore[arg-type]
    (on_down,) = runtime.peers.listeners
    old_rank1 = msgspec.structs.replace(trainer(1), pid=7)  # an earlier world's rank 1, under the same node id
    on_down(NodeDown(node_id="trainer-1", role="trainer", reason="replaced", last_seen=0.0), old_rank1)
    on_down(NodeDown(node_id="env-0", role="env-server", reason="timeout", last_seen=0.0),
            NodeInfo(node_id="env-0", role="env-server", host="h", pid=11))
    on_down(NodeDown(node_id="trainer-1", role="trainer", reason="timeout", last_seen=0.0), None)
    assert not broken.is_set()
    rank1 = msgspec.structs.replace(trainer(1), pid=11)
    with pytest.raises(AssertionError, match=r"aborted: trainer rank 1 \(trainer-1, pid 11\) went down \(timeout\)"):
        on_down(NodeDown(node_id="trainer-1", role="trainer", reason="timeout", last_seen=0.0), rank1)  # this world's
    done.set()  # past the last step's collective: a peer that finished and left breaks nothing
    on_down(NodeDown(node_id="trainer-1", role="trainer", reason="bye", last_seen=0.0), rank1)
    assert not broken.is_set()


def test_each_run_of_a_run_directory_has_its_own_checkpoints_and_rendezvous_files(tmp_path: Path) -> None:
    """Two runs in one run directory: each gets a fresh run id that keys its checkpoint directory and its
    worlds' rendezvous files, so the second neither resumes the first's checkpoints nor meets a rendezvous
    file a broken world of the first left."""
    first, second = (_cluster_config(Config(), tmp_path) for _ in range(2))
    assert first.store.run != second.store.run
    for config in (first, second):
        assert config.trainer.checkpoint_dir == str(tmp_path / "checkpoints" / config.store.run)
        assert config.trainer.init_method == f"file://{tmp_path}/gloo-rendezvous-{config.store.run}-0"
    cluster = LocalCluster(second, tmp_path)
    cluster.restart_world()  # no rank runs: only the next world's rendezvous is fixed
    assert cluster.config.trainer.init_method == f"file://{tmp_path}/gloo-rendezvous-{second.store.run}-1"

    # A run given its run id again continues that run (its stores and checkpoints) but no world meets a file an
    # earlier launcher's broken world left: ranks that read it would connect to that world's dead ranks.
    left = tmp_path / "gloo-rendezvous-mine-0"
    left.write_text("a broken world's")
    given = Config()
    given.store = dataclasses.replace(given.store, run="mine")
    again = _cluster_config(given, tmp_path)
    assert again.trainer.checkpoint_dir == str(tmp_path / "checkpoints" / "mine")
    assert again.trainer.init_method == f"file://{left}" and not left.exists()


def test_a_relative_run_directory_gives_absolute_rendezvous_urls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file://run/x`` is host ``run``, path ``/x`` to torch: a relative run directory (``--run-dir run``) put the
    rendezvous file at the root of the file system."""
    monkeypatch.chdir(tmp_path)
    assert rendezvous(Path("run"), "r1", 2) == f"file://{tmp_path}/run/gloo-rendezvous-r1-2"
