"""`refbus up` supervises: an env server, a rollout worker and a ps-worker killed with SIGKILL mid-run are
restarted under their node ids and the run completes, every death named (progress output, summary), every
kept blob deleted once or lost with the store that died; so is an orchestrator, whose restart resumes at the
trainer ranks' step with what it held; a death of a role that is not restartable ends the run naming it;
`--chaos` picks its victims from a seeded generator; a hung (SIGSTOPped) orchestrator is killed and restarted,
and a second SIGTERM during the launcher's shutdown stops nothing short; and a launcher killed with SIGKILL
leaves no process of its run behind (every node gets the parent-death signal and is gone within
``node.shutdown_timeout_s``, the trainer ranks and the rollout workers' offload threads included)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FAST_LIVENESS
from polling import read_line, wait_for
from refbus.nodes import up as up_module
from refbus.nodes.config import ConfigError
from refbus.nodes.entry_points import UserCodeFailed, load_entry_point
from refbus.nodes.halting import HALTED_PREFIX, HALTED_STATUS
from refbus.nodes.launch import NodeProcess
from refbus.nodes.store.durable import PREFIX as STORE_PREFIX
from refbus.nodes.supervisor import MAX_BACKOFF_FACTOR, Chaos, Liveness, Supervisor, Watched, describe_exit, kill_hung
from stalling_entry_points import STALL_ENV, STALL_UNTIL_ENV
from test_up import RUN_S, START_S, STOP_S, TESTS, Up, _failing_start, _up_elsewhere, check_accounted, log_events

SHUTDOWN_S = 1.2
# A fetch or delete against a killed store gives up within this schedule (1 + 1.5 + 2.25 s), not the default
# 14 s, so the steps after a kill stay short; it still outlasts the node timeout (a config relation).
QUICK = [*FAST_LIVENESS, "--node-shutdown-timeout-s", str(SHUTDOWN_S), "--requests-timeout-s", "1.0",
         "--requests-backoff", "1.5", "--up-restart-backoff-s", "0.2",
         # Short micro batches (two samples each): a killed store costs the micro batches holding its blobs,
         # never a whole step.
         "--orchestrator-seq-len", "16"]
# Stores of this budget (to their high-water marks) hold less than one step's episodes while a first training
# step that stalls this long lets rollouts run ahead: the orchestrator has to pause on full stores.
SMALL_BUDGET = 348 << 10  # about 43 of this run's episodes, each one blob of ~376 bytes charged ~8.1 KiB (charges)
STALL_S = 3.0
pytestmark = pytest.mark.timeout(RUN_S + 2 * STOP_S)


def live(pids: set[int]) -> set[int]:
    """The processes of ``pids`` that still run (a zombie waiting for its reaper has exited)."""
    running = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                running.add(pid)
    return running


def test_killed_env_server_rollout_worker_and_ps_worker_are_restarted_and_the_run_completes(tmp_path: Path) -> None:
    steps = 6
    up = Up(tmp_path, steps, *QUICK)
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        pids = up.note_pids()
        victims = {name: pids[name] for name in ("env-1", "rollout-1", "ps-worker-1")}
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        assert up.wait(RUN_S) in (0, 1), up.output()

        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        deaths = {d["node"]: d for d in summary["deaths"]}
        for name, pid in victims.items():
            assert (deaths[name]["pid"], deaths[name]["exit"], deaths[name]["restarted"]) == (pid, "SIGKILL", True)
            assert f"refbus up: {name} died (SIGKILL); restarting it" in output
            assert f"refbus up: {name} restarted (pid " in output
        # A push granted to the ps-worker just before it was killed is retried on another worker: no trainer
        # rank fails and the world never restarts. Nothing else may die.
        others = set(deaths) - set(victims)
        assert others == set() and summary["world_restarts"] == [], output
        assert summary["restarts"] == 3, output
        # Every kept blob is deleted once or lost with the store that died; nothing held or leaked.
        check_accounted(summary, {"env-1"})  # lost: what env-1 kept
        assert up.leftovers() == []
    finally:
        up.close()


def test_an_env_server_killed_while_dispatch_waits_on_full_stores_is_restarted_and_dispatch_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgets far below the work admission allows, and a first training step that stalls: the stores fill to
    their high-water marks and the orchestrator starts no group. env-1 is SIGKILLed during that pause: it is
    restarted, dispatch resumes once a store drains, and the run completes with every kept blob deleted
    once or lost with env-1 (what it held died with it), nothing held, leaked or unaccounted."""
    monkeypatch.setenv(STALL_ENV, str(STALL_S))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    steps = 4
    up = Up(tmp_path, steps, *QUICK, "--env-server-budget-bytes", str(SMALL_BUDGET),
            "--rl-train-step", "stalling_entry_points:train_step")
    orchestrator_log = up.run_dir / "orchestrator.log"
    try:
        wait_for(lambda: up.alive() and orchestrator_log.exists() and "dispatch.stores_full" in
                 orchestrator_log.read_text(), RUN_S / 2, "the orchestrator paused on full stores", poll_s=0.05)
        paused_at = len(orchestrator_log.read_text())
        pid = up.note_pids()["env-1"]
        os.kill(pid, signal.SIGKILL)
        assert up.wait(RUN_S) in (0, 1), up.output()

        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("env-1", pid, "SIGKILL", True)], output
        assert "dispatch.stores_drained" in orchestrator_log.read_text()[paused_at:]  # the pause ended
        check_accounted(summary, {"env-1"})
        assert up.leftovers() == []
    finally:
        up.close()


def test_a_step_whose_only_store_was_killed_is_skipped_by_every_rank_and_the_run_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One env server, not durable, SIGKILLed while the first training step stalls and after step 1 was shipped:
    every blob of step 1 died with it, so no rank can fetch any of its micro batches. Every rank skips step 1 at
    once (one agreement), pushes its unchanged weights as the next version and trains on: no trainer rank dies,
    the world is not restarted from its checkpoint, and every kept blob is deleted once or lost with env-0."""
    release = tmp_path / "release-step-0"
    monkeypatch.setenv(STALL_UNTIL_ENV, str(release))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    steps = 4
    up = Up(tmp_path, steps, *QUICK, "--up-env-servers", "1", "--store-durable", "false",
            "--rl-train-step", "stalling_entry_points:train_step")
    orchestrator_log = up.run_dir / "orchestrator.log"
    try:
        wait_for(lambda: up.alive() and orchestrator_log.exists()
                 and any(e["step"] == 1 for e in log_events(orchestrator_log, "step.shipped")),
                 START_S + RUN_S / 4, "step 1 shipped while step 0 stalls", poll_s=0.05)
        pid = up.note_pids()["env-0"]
        os.kill(pid, signal.SIGKILL)
        release.touch()
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(None)
        assert code in (0, 1), output  # 1: what env-0 held died with it
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        assert summary["world_restarts"] == [] and summary["restarts"] == 1, output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("env-0", pid, "SIGKILL", True)], output
        for rank in (0, 1):
            skipped = log_events(up.run_dir / f"trainer-{rank}.log", "step.skipped")
            assert 1 in {e["step"] for e in skipped}, output
            assert all("no micro batch could be fetched on any rank" in e["reason"] for e in skipped), skipped
            trained = {e["step"] for e in log_events(up.run_dir / f"trainer-{rank}.log", "step.trained")}
            assert trained | {e["step"] for e in skipped} == set(range(steps)), (trained, skipped)
        check_accounted(summary, {"env-0"})
        assert up.leftovers() == []
    finally:
        release.touch()
        up.close()


@contextlib.contextmanager
def _killed_in_the_last_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node: str,
                             *flags: str) -> Iterator[tuple[Up, int, int]]:
    """A one-step ``refbus up`` whose ranks stall in the step's training, ``node`` SIGKILLed while both do, with its
    restart 30 s off (past the run's end), then the stall released and the run waited for: yields the run, the
    killed pid and the exit code; every process of the run is reaped after."""
    release = tmp_path / "release-step-0"
    monkeypatch.setenv(STALL_UNTIL_ENV, str(release))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    up = Up(tmp_path, 1, *QUICK, *flags, "--rl-train-step", "stalling_entry_points:train_step",
            "--up-restart-backoff-s", "30", "--node-restart-grace-s", "60", "--env-server-handover-lease-s", "120")
    try:
        wait_for(lambda: up.alive() and len(list(tmp_path.glob(f"{release.name}.*"))) == 2, START_S + RUN_S / 4,
                 "both ranks in the last step's training", poll_s=0.05)
        pid = up.note_pids()[node]
        os.kill(pid, signal.SIGKILL)
        release.touch()
        yield up, pid, up.wait(RUN_S)
    finally:
        release.touch()
        up.close()


def test_a_store_killed_in_the_runs_last_seconds_is_back_for_the_accounting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """env-1 is SIGKILLed while both ranks hold the last step's blobs (its training stalls), with its restart 30 s
    off: before, the run ended within that backoff and the launcher, finding env-1 missing from the registry,
    reported ``stores' counters not read``. Now its restart is made at once when the holders have stopped, and
    its counters are read: every kept blob is deleted once or lost with env-1, nothing unaccounted."""
    with _killed_in_the_last_step(tmp_path, monkeypatch, "env-1", "--store-durable", "false") as (up, pid, _):
        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == 1 and summary["failed_nodes"] == [], output
        assert not any(why.startswith("stores' counters not read") for why in summary["not_ok"]), summary["not_ok"]
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("env-1", pid, "SIGKILL", True)], output
        check_accounted(summary, {"env-1"})
        assert up.leftovers() == []


def test_an_orchestrator_killed_in_the_runs_last_seconds_is_restarted_to_delete_what_it_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestrator is SIGKILLed while both ranks train the last step (their training stalls), its restart
    30 s off: before, the run ended within that backoff and what it held when it died was left to the stores'
    shutdown, reported held at the run's end (NOT ok, nothing lost). Now the launcher restarts it at once once
    the holders have stopped, and stops it: its shutdown claims back what the dead process held and deletes it."""
    with _killed_in_the_last_step(tmp_path, monkeypatch, "orchestrator") as (up, pid, code):
        summary = up.summary()
        output = up.output(None)
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("orchestrator", pid, "SIGKILL", True)], output
        assert "refbus up: orchestrator restarted (pid " in output
        assert code == 0 and summary["ok"] and summary["steps"] == 1, output
        assert summary["accounting"]["held_at_end"] == {}, summary["accounting"]
        check_accounted(summary, set())
        assert up.leftovers() == []


def test_killed_orchestrator_is_restarted_and_the_run_completes_with_every_blob_accounted_for(
        tmp_path: Path) -> None:
    """The restarted orchestrator takes the step from the trainer ranks and claims back what it held: the run
    ships exactly its steps, every kept blob is deleted once (nothing lost, nothing left held)."""
    steps = 4
    up = Up(tmp_path, steps, *QUICK)
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        pid = up.note_pids()["orchestrator"]
        os.kill(pid, signal.SIGKILL)
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(None)
        assert code == 0 and summary["ok"], output
        assert summary["steps"] == steps and summary["failed_nodes"] == [] and summary["restarts"] == 1, output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("orchestrator", pid, "SIGKILL", True)], output
        assert "refbus up: orchestrator died (SIGKILL); restarting it" in output
        assert "refbus up: orchestrator restarted (pid " in output
        assert "node deaths           1: orchestrator (SIGKILL); restarts 1" in output
        blobs = summary["blobs"]
        assert blobs["violations"] == 0 and blobs["held"] == 0 and blobs["lost"] == 0 and blobs["leaked"] == 0, output
        assert blobs["kept"] == blobs["deleted_total"], output
        assert up.leftovers() == []
    finally:
        up.close()


def test_killed_broker_is_restarted_on_its_addresses_and_the_run_completes_with_every_blob_accounted_for(
        tmp_path: Path) -> None:
    """The restarted broker binds the addresses the first one bound; every node re-joins by itself, hands the new
    ring the events it holds, and the watcher's subscription resumes: what the dead broker held in flight is
    recovered from those refills, so the ledger vouches for every delete and the run is ``ok``, with every blob
    accounted for by the stores' counters."""
    steps = 5
    up = Up(tmp_path, steps, *QUICK)
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        pids = up.note_pids()
        nodes = set(pids) - {"bus"}
        os.kill(pids["bus"], signal.SIGKILL)
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        assert [(d["node"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [("bus", "SIGKILL", True)], output
        assert "refbus up: bus died (SIGKILL); restarting it" in output and "refbus up: bus restarted (pid " in output
        logs = {name: (up.run_dir / f"{name}.log").read_text(errors="replace") for name in nodes}
        assert all("bus.broker_restarted" in log for log in logs.values()), [n for n, log in logs.items()
                                                                              if "bus.broker_restarted" not in log]
        # Every kept blob deleted once; nothing held, lost or leaked; the stores' counters vouch for the rest.
        blobs, accounting = summary["blobs"], summary["accounting"]
        assert blobs["violations"] == blobs["held"] == blobs["lost"] == blobs["leaked"] == 0, blobs
        assert blobs["kept"] == blobs["deleted_total"] > 0, blobs
        assert set(accounting["reconciled"]) == {"env-0", "env-1"} and accounting["stores_unread"] == [], output
        assert accounting["unaccounted"] == [] and blobs["missed_events"] == 0, output
        assert (code, summary["ok"]) == (0, True), output
        assert up.leftovers() == []
    finally:
        up.close()


def _steps(text: str) -> int:
    """The latest step a progress line of ``text`` reports (0 before the first)."""
    return max((int(n) for n in re.findall(r"step +(\d+)/", text)), default=0)


def test_hung_orchestrator_is_killed_and_restarted_and_a_second_sigterm_during_shutdown_stops_nothing_short(
        tmp_path: Path) -> None:
    """The orchestrator is SIGSTOPped mid-run: the broker reports it down (missed heartbeats) while its process
    still runs, so the launcher kills it (``up.node_hung``), charged to the restart budget, and restarts it; the
    run goes on. Then SIGTERM, and a second SIGTERM while the launcher stops the cluster: the shutdown still runs
    in order to its end (exit 130, summary, every kept blob deleted once, no store directory, no process left)."""
    node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
    # Down after a node timeout (judged every quarter of one), killed a node timeout later (its grace to
    # re-join), restarted after the backoff; the slack covers a loaded machine.
    hung_s = 4 * node_timeout_s + STOP_S / 3
    up = Up(tmp_path, 200, *QUICK)
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        pid = up.note_pids()["orchestrator"]
        os.kill(pid, signal.SIGSTOP)
        restarted = "refbus up: orchestrator restarted (pid "
        wait_for(lambda: up.alive() and restarted in up.output(None), hung_s, "the hung orchestrator restarted",
                 poll_s=0.1)
        at_restart = _steps(up.output_path.read_text(errors="replace"))
        wait_for(lambda: up.alive() and _steps(up.output(None)) > at_restart, RUN_S / 4,
                 f"a step after step {at_restart} (the restarted orchestrator dispatches)", poll_s=0.1)

        up.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "refbus up: stopping the cluster" in up.output(), STOP_S, "the launcher stopping the cluster",
                 poll_s=0.02)
        up.proc.send_signal(signal.SIGTERM)  # during the shutdown: it only asks again for what is under way
        try:
            code = up.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"refbus up still running {STOP_S:.0f}s after SIGTERM:\n{up.output()}") from None
        output = up.output(None)
        assert code == 130, output
        summary = up.summary()
        assert summary["interrupted"] is True and summary["failed_nodes"] == [], output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("orchestrator", pid, "SIGKILL, hung", True)], output
        assert summary["restarts"] == 1 and summary["world_restarts"] == [], output
        assert "up.node_hung" in output and f"refbus up: orchestrator (pid {pid}) hangs: the broker reports it down" \
            in output, output
        assert "refbus up: orchestrator died (SIGKILL, hung); restarting it in 0.2 s (restart 1/" in output, output
        assert output.count(") hangs: ") == 1, output  # once: nothing else, the new orchestrator included
        assert "node deaths           1: orchestrator (SIGKILL, hung); restarts 1" in output, output
        blobs = check_accounted(summary, set())  # the restarted orchestrator claimed back what it held
        assert blobs["lost"] == 0 and blobs["kept"] == blobs["deleted_total"] > 0, blobs
        config = tomllib.loads((up.run_dir / "cluster.toml").read_text())
        assert sorted(Path(config["store"]["directory"]).glob(f"{STORE_PREFIX}{config['store']['run']}.*")) == []
        assert up.leftovers() == []
    finally:
        up.close()


def test_launcher_killed_leaves_no_process_of_its_run(tmp_path: Path) -> None:
    up = Up(tmp_path, 200, *QUICK)
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        nodes = {pid for pid, _ in up.leftovers()} - {up.proc.pid}
        assert len(nodes) >= 11  # broker, ps-manager, 2 ps-workers, 2 env servers, 2 ranks, 2 rollouts, orchestrator

        killed = time.monotonic()
        up.proc.kill()
        up.proc.wait()
        # Each node is gone within node.shutdown_timeout_s of its parent-death signal; the slack covers start-up
        # of the signal handling on a loaded machine. The required bound (5 s) is kept with the default timeout.
        wait_for(lambda: not live(nodes), 4 * SHUTDOWN_S, f"no process of the run left (of {sorted(nodes)})")
        print(f"launcher SIGKILLed: every node gone after {time.monotonic() - killed:.2f}s")
    finally:
        up.close()


def test_a_relaunch_on_the_run_directory_of_a_killed_launcher_waits_until_its_nodes_are_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the kernel freed the run directory with the killed launcher while its nodes, in the shutdown their
    parent-death signal starts, still bound its ports and served its stores: the same command started again at
    once failed to start its ps-manager (address in use). Every node now holds the run directory's lock too: a
    relaunch waits for them, bounded, and takes the directory once they are all gone. The old ps-manager is
    stopped (SIGSTOP) so that it outlives the launcher as long as the test needs; the launcher is left unreaped
    (a zombie is gone too)."""
    monkeypatch.setattr(up_module.LocalCluster, "start", _failing_start)  # the relaunches start nothing
    up = Up(tmp_path, 200, *QUICK)
    manager = 0
    try:
        ready = up.run_dir / "ps-manager.ready.json"
        wait_for(lambda: up.alive() and ready.exists(), START_S, "the ps-manager of refbus up ready")
        manager = up.note_pids()["ps-manager"]
        os.kill(manager, signal.SIGSTOP)
        up.proc.kill()
        wait_for(lambda: not live({up.proc.pid}), STOP_S, "the launcher dead")
        nodes = {pid for pid, _ in up.leftovers()}
        assert manager in nodes

        assert _up_elsewhere(up.run_dir, "--node-shutdown-timeout-s", str(SHUTDOWN_S)) == 2
        assert f"still held by nodes of a refbus up that is gone (pid {up.proc.pid})" in capsys.readouterr().err

        alive_at_start: list[set[int]] = []

        def failing_start(cluster: up_module.LocalCluster, name: str, *command: str, wait: bool = True) -> NodeProcess:
            alive_at_start.append(live(nodes))  # the old run's nodes still running once the lock was taken
            return _failing_start(cluster, name)

        monkeypatch.setattr(up_module.LocalCluster, "start", failing_start)
        os.kill(manager, signal.SIGCONT)  # its pending parent-death signal stops it now
        assert _up_elsewhere(up.run_dir, "--node-shutdown-timeout-s", str(4 * SHUTDOWN_S)) == 1  # taken, then failed
        assert alive_at_start == [set()]
        assert f"nodes of an earlier refbus up (pid {up.proc.pid}, gone) still hold" in capsys.readouterr().out
    finally:
        if manager:
            with contextlib.suppress(ProcessLookupError):
                os.kill(manager, signal.SIGCONT)
        up.close()


# --- the supervisor's decisions, on stand-in processes -----------------------------------------------------


@dataclass
class _Proc:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class _Node:
    name: str
    pid: int
    proc: _Proc = field(default_factory=_Proc)
    signals: list[int] = field(default_factory=list)
    spawned: float = 0.0
    said: list[str] = field(default_factory=list)  # its log's lines after the first
    waited_ready: list[float] = field(default_factory=list)

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.proc.code = -sig

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join([f"log of {self.name}", *self.said][-lines:])

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool]) -> None:
        """A stand-in is ready at once: the wait is recorded (its timeout), not made."""
        self.waited_ready.append(timeout)


class _Cluster:
    def __init__(self, *names: str) -> None:
        self.nodes: list[_Node] = [_Node(name, 100 + i) for i, name in enumerate(names)]
        self.restarted: list[str] = []

    def restart(self, dead: _Node) -> _Node:
        node = _Node(dead.name, dead.pid + 1000)
        self.nodes[self.nodes.index(dead)] = node
        self.restarted.append(dead.name)
        return node


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_supervisor_restarts_with_backoff_within_its_budget_and_ends_the_run_otherwise() -> None:
    cluster, clock, said = _Cluster("bus", "env-0", "orchestrator", "trainer-0"), _Clock(), []
    supervisor = Supervisor(cluster, budget=2, backoff_s=1.0, say=said.append, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[1].signal(signal.SIGKILL)
    assert supervisor.poll() is None and cluster.restarted == []  # waits out the backoff
    clock.now = 1.0
    assert supervisor.poll() is None and cluster.restarted == ["env-0"]
    cluster.nodes[1].proc.code = 1
    assert supervisor.poll() is None
    clock.now = 2.5
    assert supervisor.poll() is None and cluster.restarted == ["env-0"]  # the second backoff is doubled
    clock.now = 3.0
    assert supervisor.poll() is None and cluster.restarted == ["env-0", "env-0"]
    cluster.nodes[3].proc.code = 0  # a trainer rank that finished its steps is no death
    assert supervisor.poll() is None
    cluster.nodes[1].signal(signal.SIGKILL)
    assert "restart budget (2) is spent" in (supervisor.poll() or "")
    assert supervisor.fatal == ["env-0"] and supervisor.restarts == 2
    assert [(d["node"], d["exit"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        ("env-0", "SIGKILL", True), ("env-0", "exit 1", True), ("env-0", "SIGKILL", False)]

    cluster, said = _Cluster("ps-manager", "trainer-0"), []
    supervisor = Supervisor(cluster, budget=5, backoff_s=1.0, say=said.append, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[0].proc.code = 1  # the ps-manager replays its journal: restarted like the others
    assert supervisor.poll() is None
    clock.now += 1.0
    assert supervisor.poll() is None and cluster.restarted == ["ps-manager"]
    cluster.nodes[1].proc.code = 1  # a trainer rank without world restarts is not restartable
    assert "trainer-0 died (exit 1); it is not restartable" in (supervisor.poll() or "")
    assert supervisor.fatal == ["trainer-0"]
    assert describe_exit(-signal.SIGTERM) == "SIGTERM" and describe_exit(3) == "exit 3"


class _World(_Cluster):
    def restart_world(self) -> list[_Node]:
        ranks = [node for node in self.nodes if node.name.startswith("trainer-")]
        for rank in ranks:
            self.restart(rank)
        return ranks


@pytest.mark.parametrize("first", ["killed", "partner"])
def test_a_rank_that_exits_because_chaos_killed_its_partner_is_not_charged_whichever_death_is_seen_first(
        first: str) -> None:
    """Chaos SIGKILLs trainer-1; trainer-0, its collective broken, exits 1 before the supervisor's next poll. The
    world restart follows from the kill, so it is not charged, whichever rank's death the poll meets first (the
    cluster's order lists trainer-0 first). Before, trainer-0's exit was met first and charged to the budget."""
    names = ("trainer-0", "trainer-1") if first == "partner" else ("trainer-1", "trainer-0")
    cluster, clock = _World("bus", *names), _Clock()
    supervisor = Supervisor(cluster, budget=3, backoff_s=1.0, say=lambda _: None, clock=clock,  # type: ignore[arg-type]
                            world_restarts=True)
    killed, partner = (cluster.nodes[2], cluster.nodes[1]) if first == "partner" else cluster.nodes[1:]
    supervisor.expect_death(killed)
    killed.signal(signal.SIGKILL)
    partner.proc.code = 1
    assert supervisor.poll() is None and supervisor.charged == 0
    clock.now += 1.0
    assert supervisor.poll() is None and supervisor.world_restarted and supervisor.charged == 0
    partner = next(n for n in cluster.nodes if n.name == "trainer-0")
    partner.proc.code = 1  # a crash of the restarted world nobody asked for: charged
    assert supervisor.poll() is None and supervisor.charged == 1


def test_a_node_that_halted_the_run_ends_it_at_once_naming_why_and_is_never_restarted() -> None:
    """A node that exits ``HALTED_STATUS`` decided that the run cannot go on (the orchestrator's halts: budgets
    that cannot hold a step, a step its ranks did not acknowledge). Before, a restartable one was restarted as a
    crash, to decide the same again, until the restart budget was spent. Now the run ends at once, named after
    the node and the reason of its last halt line (its log keeps an earlier incarnation's); a crash before it
    was restarted as ever."""
    cluster, clock, said = _Cluster("bus", "env-0", "orchestrator"), _Clock(), []
    supervisor = Supervisor(cluster, budget=5, backoff_s=1.0, say=said.append, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[2].proc.code = 1
    assert supervisor.poll() is None
    clock.now += 1.0
    assert supervisor.poll() is None and cluster.restarted == ["orchestrator"]
    orchestrator = cluster.nodes[2]
    orchestrator.said = [f"{HALTED_PREFIX}an earlier incarnation's halt", '{"event": "node.started"}',
                         f"{HALTED_PREFIX}no step can ever ship", '{"event": "node.closed"}']
    orchestrator.proc.code = HALTED_STATUS
    why = "orchestrator halted the run (exit 4, halted): no step can ever ship"
    assert supervisor.poll() == why
    assert cluster.restarted == ["orchestrator"] and supervisor.restarts == supervisor.charged == 1
    assert supervisor.fatal == ["orchestrator"] and said[-1].startswith(f"refbus up: {why}\nlog of orchestrator")
    assert [(d["node"], d["exit"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        ("orchestrator", "exit 1", True), ("orchestrator", "exit 4, halted", False)]


def _restart_delays(supervisor: Supervisor, cluster: _Cluster, clock: _Clock, name: str,
                    ran_s: list[float]) -> list[float]:
    """Kill ``name`` after it ran each of ``ran_s`` seconds and restart it when due; each restart's delay."""
    delays: list[float] = []
    restarted = cluster.restarted.count(name)
    for ran in ran_s:
        clock.now += ran
        node = next(n for n in cluster.nodes if n.name == name)
        node.signal(signal.SIGKILL)
        died = clock.now
        assert supervisor.poll() is None
        for _ in range(4 * 16):  # quarter seconds up to the longest backoff at 1 s
            if cluster.restarted.count(name) > restarted + len(delays):
                break
            clock.now += 0.25
            assert supervisor.poll() is None
        delays.append(clock.now - died)
    return delays


def test_a_restart_still_due_when_the_run_ends_is_not_reported_as_made() -> None:
    """Before, a restart was counted, and its death reported restarted, once it was scheduled: a run that
    ended within the backoff claimed a restart it never made."""
    cluster, clock = _Cluster("bus", "env-0"), _Clock()
    supervisor = Supervisor(cluster, budget=3, backoff_s=1.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[1].signal(signal.SIGKILL)
    assert supervisor.poll() is None and supervisor.charged == 1  # the budget pays when the restart is decided
    pending = supervisor.report()
    assert pending == {"restarts": 0, "world_restarts": [], "deaths": [
        {"node": "env-0", "pid": 101, "exit": "SIGKILL", "at_s": 0.0, "restarted": False}]}
    clock.now = 1.0
    assert supervisor.poll() is None and cluster.restarted == ["env-0"]
    made = supervisor.report()
    assert made["restarts"] == 1 and [d["restarted"] for d in made["deaths"]] == [True]


def test_at_the_runs_end_the_stores_due_restarts_are_made_at_once_and_nothing_else() -> None:
    """Before, an env server that died in the run's last seconds was still within its backoff (up to half the
    grace) when the launcher read the stores' counters: the run reported ``stores' counters not read``, NOT ok,
    though nothing was lost. At the end its restart is made at once, and so is that of a store whose death the
    last poll did not see; a rollout worker's stays due, and a store whose death ends the run is not restarted."""
    cluster, clock, said = _Cluster("bus", "env-0", "env-1", "rollout-0", "env-2"), _Clock(), []
    supervisor = Supervisor(cluster, budget=3, backoff_s=4.0, say=said.append, clock=clock)  # type: ignore[arg-type]
    for name in ("env-0", "rollout-0", "env-2"):
        next(n for n in cluster.nodes if n.name == name).signal(signal.SIGKILL)
    assert supervisor.poll() is None and cluster.restarted == []  # every restart waits out its backoff
    cluster.nodes[2].signal(signal.SIGKILL)  # env-1, after the last poll; the budget is spent by then
    clock.now = 1.0
    supervisor.note_exits("env-")
    started = supervisor.restart_now("env-")
    assert sorted(n.name for n in started) == ["env-0", "env-2"] == sorted(cluster.restarted)
    assert supervisor.fatal == ["env-1"] and any("restart budget (3) is spent" in line for line in said)
    assert [(d["node"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        ("env-0", True), ("rollout-0", False), ("env-2", True), ("env-1", False)]
    supervisor.note_exits("env-")
    assert supervisor.restart_now("env-") == [] and supervisor.fatal == ["env-1"]  # each death handled once


class _Ending(_Cluster):
    """The launcher's stops on stand-ins: each sends SIGTERM to what still runs; stopping the orchestrator also
    kills ``dies_meanwhile`` (a store that dies while the holders stop)."""

    def __init__(self, *names: str, dies_meanwhile: str) -> None:
        super().__init__(*names)
        self.dies_meanwhile = dies_meanwhile
        self.stopped: list[tuple[str, int]] = []
        self.waited_first: list[str] = []  # stopped once waited for to be ready
        self.config = SimpleNamespace(node=SimpleNamespace(connect_timeout_s=1.0))

    def by_role(self, prefix: str) -> list[_Node]:
        return [node for node in self.nodes if node.name.startswith(prefix)]

    def stop(self, nodes: list[_Node]) -> None:
        for node in nodes:
            if node.proc.poll() is None:
                if node.waited_ready:
                    self.waited_first.append(node.name)
                node.signal(signal.SIGTERM)
                self.stopped.append((node.name, node.pid))
            if node.name == "orchestrator":
                next(n for n in self.nodes if n.name == self.dies_meanwhile).signal(signal.SIGKILL)


def test_at_the_runs_end_a_store_that_dies_while_the_holders_stop_is_back_for_the_accounting() -> None:
    """The end of a run: the orchestrator died with its restart still due, and env-1 dies while the launcher stops
    the holders. Before, the stores' exits were noted before those stops, so env-1's death went unseen: not
    restarted, its counters not read (NOT ok, nothing lost). Now the orchestrator's exit is noted before its stop,
    the stores' after the stops: env-1 and the orchestrator are restarted, the new orchestrator stopped at once,
    and no exit the launcher's stops made is taken for a death."""
    cluster, clock = _Ending("bus", "env-0", "env-1", "orchestrator", "trainer-0", "rollout-0",
                             dies_meanwhile="env-1"), _Clock()
    supervisor = Supervisor(cluster, budget=5, backoff_s=4.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    cluster.nodes[3].signal(signal.SIGKILL)
    assert supervisor.poll() is None and cluster.restarted == []  # the orchestrator's restart waits its backoff
    clock.now = 1.0
    up_module.stop_the_holders(cluster, supervisor, SimpleNamespace(requested=False))  # type: ignore[arg-type]
    assert cluster.restarted == ["env-1", "orchestrator"]
    assert [(n.name, n.waited_ready) for n in cluster.nodes if n.waited_ready] == [
        ("env-1", [2.0]), ("orchestrator", [2.0])]  # each restart waited for, at twice the connect timeout
    assert cluster.stopped == [("trainer-0", 104), ("rollout-0", 105), ("orchestrator", 1103)]
    assert cluster.waited_first == ["orchestrator"]  # the restart made here, stopped once ready
    assert [(d["node"], d["exit"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        ("orchestrator", "SIGKILL", True), ("env-1", "SIGKILL", True)]

    # An orchestrator restarted in the run's last seconds, still starting: waited for before its stop, so its
    # shutdown claims back what its predecessor held (before, the stop ended it before it joined: held at the end).
    starting = _Ending("bus", "env-0", "orchestrator", "trainer-0", dies_meanwhile="env-0")
    supervisor = Supervisor(starting, budget=5, backoff_s=4.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    up_module.stop_the_holders(starting, supervisor, SimpleNamespace(requested=False))  # type: ignore[arg-type]
    assert starting.waited_first == ["orchestrator"] and starting.nodes[2].waited_ready == [2.0]

    interrupted = _Ending("bus", "env-0", "orchestrator", "trainer-0", dies_meanwhile="env-0")
    supervisor = Supervisor(interrupted, budget=5, backoff_s=4.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    up_module.stop_the_holders(interrupted, supervisor, SimpleNamespace(requested=True))  # type: ignore[arg-type]
    assert interrupted.restarted == [] and supervisor.report()["deaths"] == []  # nothing restarted, nothing noted
    assert interrupted.waited_first == []  # nor waited for


def test_the_backoff_starts_over_after_a_node_ran_long_and_the_orchestrators_stays_within_half_the_grace() -> None:
    """A crash loop doubles the backoff up to 16x; a node that then ran 4 x the longest backoff (64 s at 1 s)
    was in no crash loop and is restarted after 1x again (before: 16x, for the rest of the run). The
    orchestrator's backoff stops at half ``node.restart_grace_s``: past the grace its stores reclaim what it
    held, so a later restart would lose all of it (a chaos soak lost 429 blobs so); 0 means no grace, no cap."""
    cluster, clock = _Cluster("bus", "env-0", "rollout-0", "orchestrator"), _Clock()
    supervisor = Supervisor(cluster, budget=100, backoff_s=1.0, say=lambda _: None, clock=clock,  # type: ignore[arg-type]
                            holder_grace_s=10.0)
    assert _restart_delays(supervisor, cluster, clock, "rollout-0", [1, 1, 1, 1, 1, 1]) == [1, 2, 4, 8, 16, 16]
    assert _restart_delays(supervisor, cluster, clock, "rollout-0", [63.75, 64, 1]) == [16, 1, 2]
    assert _restart_delays(supervisor, cluster, clock, "orchestrator", [1, 1, 1, 1, 1]) == [1, 2, 4, 5, 5]
    # An env server's too: the orchestrator declares a store's blobs lost once it has been down the grace (a chaos
    # soak lost 40 of a durable store's, back 8 s late, so).
    assert _restart_delays(supervisor, cluster, clock, "env-0", [1, 1, 1, 1, 1]) == [1, 2, 4, 5, 5]

    cluster, clock = _Cluster("bus", "orchestrator"), _Clock()
    supervisor = Supervisor(cluster, budget=100, backoff_s=1.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    assert _restart_delays(supervisor, cluster, clock, "orchestrator", [1, 1, 1, 1, 1]) == [1, 2, 4, 8, 16]


def test_a_broker_that_keeps_dying_is_restarted_within_half_a_node_timeout() -> None:
    """While the broker is down no death is reported and no store's counters can be read: a soak that SIGKILLed
    it every 30 s (a crash loop to the doubling) had it down 8 s each time, and a run that ended in such a gap
    could not account for its stores. Its backoff stops at half ``bus.node_timeout_s``; 0 means no cap."""
    cluster, clock = _Cluster("bus", "rollout-0"), _Clock()
    supervisor = Supervisor(cluster, budget=100, backoff_s=0.5, say=lambda _: None, clock=clock,  # type: ignore[arg-type]
                            node_timeout_s=5.0)
    assert _restart_delays(supervisor, cluster, clock, "bus", [30, 30, 30, 30, 30]) == [0.5, 1, 2, 2.5, 2.5]
    assert _restart_delays(supervisor, cluster, clock, "rollout-0", [30, 30, 30, 30, 30]) == [0.5, 1, 2, 4, 8]
    cluster, clock = _Cluster("bus"), _Clock()
    supervisor = Supervisor(cluster, budget=100, backoff_s=0.5, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    assert _restart_delays(supervisor, cluster, clock, "bus", [30, 30, 30, 30, 30]) == [0.5, 1, 2, 4, 8]


def test_chaos_kills_restartable_nodes_only_and_the_seed_fixes_the_sequence() -> None:
    def victims(seed: int) -> list[str]:
        cluster, clock = _Cluster("bus", "ps-manager", "ps-worker-0", "env-0", "env-1", "trainer-0", "trainer-1",
                                  "rollout-0", "orchestrator"), _Clock()
        chaos = Chaos(cluster, 2.0, seed, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
        for tick in range(1, 21):
            clock.now = tick
            chaos.poll()
            for node in cluster.nodes:  # every victim restarted at once
                if node.proc.code is not None:
                    cluster.restart(node)
        return chaos.killed

    first = victims(7)
    assert len(first) == 10 and set(first) <= {"ps-manager", "ps-worker-0", "env-0", "env-1", "rollout-0",
                                               "orchestrator"}
    assert victims(7) == first
    assert any(victims(seed) != first for seed in range(8, 12))
    with pytest.raises(ValueError):
        Chaos(_Cluster(), 0.0, 0)  # type: ignore[arg-type]


def test_deaths_chaos_causes_are_restarted_without_spending_the_budget() -> None:
    cluster, clock = _Cluster("bus", "env-0", "rollout-0"), _Clock()
    supervisor = Supervisor(cluster, budget=1, backoff_s=0.0, say=lambda _: None, clock=clock)  # type: ignore[arg-type]
    chaos = Chaos(cluster, 1.0, 3, say=lambda _: None, clock=clock, on_kill=supervisor.expect_death)  # type: ignore[arg-type]
    for tick in range(1, 6):  # five deliberate kills against a budget of one
        clock.now = tick
        chaos.poll()
        assert supervisor.poll() is None
        assert supervisor.poll() is None  # the restart is due at once (no backoff)
    assert len(chaos.killed) == 5 and supervisor.restarts == 5 and supervisor.charged == 0
    cluster.nodes[1].proc.code = 1  # a crash nobody asked for is charged
    assert supervisor.poll() is None and supervisor.charged == 1
    supervisor.poll()
    cluster.nodes[1].proc.code = 1
    assert "restart budget (1) is spent" in (supervisor.poll() or "")


def test_kill_hung_decides_on_a_timeout_of_this_incarnation_of_a_running_restartable_node_only() -> None:
    down = Liveness("orchestrator", up=False, pid=100, started=10.0, reason="timeout")
    running = Watched("orchestrator", pid=100, spawned=9.5, running=True, exiting=False, killed=False)
    assert kill_hung(down, running, stopping=False)
    assert not kill_hung(down, running, stopping=True)  # the cluster's own shutdown
    for reason in ("bye", "replaced"):
        assert not kill_hung(Liveness("orchestrator", up=False, pid=100, started=10.0, reason=reason), running,
                             stopping=False)
    assert not kill_hung(Liveness("orchestrator", up=True, pid=100, started=10.0), running, stopping=False)
    assert not kill_hung(down, None, stopping=False)  # no such node supervised
    # Another incarnation: another pid, or an earlier process that had this pid (started before this one).
    assert not kill_hung(down, Watched("orchestrator", 101, 9.5, True, False, False), stopping=False)
    assert not kill_hung(down, Watched("orchestrator", 100, 10.5, True, False, False), stopping=False)
    assert not kill_hung(down, Watched("orchestrator", 100, 9.5, False, False, False), stopping=False)  # exited
    assert not kill_hung(down, Watched("orchestrator", 100, 9.5, True, True, False), stopping=False)  # restarting
    assert not kill_hung(down, Watched("orchestrator", 100, 9.5, True, False, True), stopping=False)  # killed once
    manager = Liveness("ps-manager", up=False, pid=7, started=10.0, reason="timeout")
    assert kill_hung(manager, Watched("ps-manager", 7, 9.5, True, False, False), stopping=False)
    rank = Liveness("trainer-0", up=False, pid=8, started=10.0, reason="timeout")
    assert not kill_hung(rank, Watched("trainer-0", 8, 9.5, True, False, False), stopping=False)
    assert kill_hung(rank, Watched("trainer-0", 8, 9.5, True, False, False), stopping=False, worlds=True)


def test_supervisor_kills_a_node_reported_hung_once_after_the_grace_and_restarts_it_charged() -> None:
    cluster, clock, said, stopping = _Cluster("bus", "env-0", "orchestrator"), _Clock(), [], [False]
    supervisor = Supervisor(cluster, budget=3, backoff_s=0.5, say=said.append, clock=clock,  # type: ignore[arg-type]
                            hung_grace_s=1.0, stopping=lambda: stopping[0])
    env, orchestrator = cluster.nodes[1], cluster.nodes[2]
    env.spawned = orchestrator.spawned = 5.0

    def down(node: _Node, reason: str = "timeout", started: float = 6.0) -> Liveness:
        return Liveness(node.name, up=False, pid=node.pid, started=started, reason=reason)

    # Late, not hung: it re-joins (the same incarnation) within the grace.
    supervisor.heard([down(env), Liveness(env.name, up=True, pid=env.pid, started=6.0)])
    clock.now = 2.0
    assert supervisor.poll() is None and env.signals == []
    # A clean exit, another incarnation's report, a report during the cluster's shutdown: nothing is killed.
    supervisor.heard([down(env, "bye"), down(orchestrator, started=4.0)])
    supervisor.heard([down(env)])
    stopping[0] = True
    clock.now = 4.0
    assert supervisor.poll() is None and env.signals == [] and orchestrator.signals == []
    stopping[0] = False
    # Hung: killed once the grace has passed, its death charged and named, then restarted.
    supervisor.heard([down(orchestrator)])
    clock.now = 4.5
    assert supervisor.poll() is None and orchestrator.signals == []
    clock.now = 5.0
    assert supervisor.poll() is None and orchestrator.signals == [signal.SIGKILL]
    assert supervisor.charged == 1 and any("orchestrator (pid 102) hangs" in line for line in said)
    assert [(d["node"], d["exit"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        ("orchestrator", "SIGKILL, hung", False)]  # not yet: its restart is due after the backoff
    # Reports about the dead incarnation while its restart is due kill nothing.
    supervisor.heard([down(orchestrator)])
    clock.now = 7.0
    assert supervisor.poll() is None and cluster.restarted == ["orchestrator"] and orchestrator.signals == [9]
    assert [d["restarted"] for d in supervisor.report()["deaths"]] == [True]
    # At most once per incarnation: a process that outlives its SIGKILL (uninterruptible) is not killed again.
    env.signal = env.signals.append  # type: ignore[method-assign]
    supervisor.heard([down(env)])
    clock.now = 8.0
    assert supervisor.poll() is None and env.signals == [signal.SIGKILL]
    supervisor.heard([down(env)])
    clock.now = 9.0
    assert supervisor.poll() is None and env.signals == [signal.SIGKILL] and supervisor.charged == 1


class _PidReusingCluster(_Cluster):
    """Each restart's process gets the next of ``pids`` (the kernel reuses the pids of dead processes), spawned
    at the clock's time."""

    def __init__(self, clock: _Clock, pids: list[int], *names: str) -> None:
        super().__init__(*names)
        self.clock = clock
        self.pids = pids

    def restart(self, dead: _Node) -> _Node:
        node = _Node(dead.name, self.pids.pop(0), spawned=self.clock.now)
        self.nodes[self.nodes.index(dead)] = node
        self.restarted.append(dead.name)
        return node


def test_a_later_process_with_a_chaos_or_hung_victims_pid_is_supervised_as_any_other() -> None:
    """Before, the pids killed on purpose or as hung were remembered for the rest of the run: a later process
    that got one crashed uncharged, was never killed when it hung, and its crash was named ", hung"."""
    clock = _Clock()
    # Restarts get, in turn: 201, 202, the hung victim's pid 103, the chaos victim's 101, 103 once more, 204, 205.
    cluster = _PidReusingCluster(clock, [201, 202, 103, 101, 103, 204, 205], "bus", "env-0", "rollout-0",
                                 "orchestrator")
    supervisor = Supervisor(cluster, budget=10, backoff_s=0.0, say=lambda _: None, clock=clock,  # type: ignore[arg-type]
                            hung_grace_s=1.0)
    env, rollout, orchestrator = cluster.nodes[1:]

    def by_name(name: str) -> _Node:
        return next(n for n in cluster.nodes if n.name == name)

    def dies(node: _Node, code: int) -> None:
        node.proc.code = code
        clock.now += 1.0
        assert supervisor.poll() is None
        assert supervisor.poll() is None  # no backoff: restarted at once

    def hangs(node: _Node) -> None:
        supervisor.heard([Liveness(node.name, up=False, pid=node.pid, started=clock.now, reason="timeout")])
        clock.now += 1.0  # the grace
        assert supervisor.poll() is None

    supervisor.expect_death(env)  # chaos: pid 101, not charged
    dies(env, -signal.SIGKILL)
    hangs(orchestrator)  # pid 103: killed, charged
    assert orchestrator.signals == [signal.SIGKILL] and supervisor.poll() is None and supervisor.charged == 1
    dies(rollout, 1)  # restarted as pid 103
    dies(by_name("env-0"), 1)  # restarted as pid 101
    assert supervisor.charged == 3 and (by_name("rollout-0").pid, by_name("env-0").pid) == (103, 101)

    dies(by_name("rollout-0"), 1)  # pid 103 again, a crash: not named hung; restarted as pid 103 once more
    dies(by_name("env-0"), 1)  # pid 101 again, a crash nobody asked for: charged
    assert supervisor.charged == 5
    hung = by_name("rollout-0")
    hangs(hung)  # pid 103 again, hung: killed (and restarted)
    assert hung.signals == [signal.SIGKILL] and supervisor.charged == 6
    assert [(d["node"], d["pid"], d["exit"]) for d in supervisor.report()["deaths"]] == [
        ("env-0", 101, "SIGKILL"), ("orchestrator", 103, "SIGKILL, hung"), ("rollout-0", 102, "exit 1"),
        ("env-0", 201, "exit 1"), ("rollout-0", 103, "exit 1"), ("env-0", 101, "exit 1"),
        ("rollout-0", 103, "SIGKILL, hung")]


# --- final and transient refusals, on real node processes --------------------------------------------------

BACKOFF_S = 0.2
# A supervised node comes up, or its restarts end, within a start plus the longest backoff.
SUPERVISED_S = START_S + MAX_BACKOFF_FACTOR * BACKOFF_S


class _Processes:
    """The launcher's cluster, cut down: real ``refbus node`` processes (``spawn``), one command per name."""

    def __init__(self, spawn: Callable[..., NodeProcess], commands: dict[str, list[str]]) -> None:
        self.spawn, self.commands = spawn, commands
        self.nodes: list[NodeProcess] = [spawn(command, name) for name, command in commands.items()]
        self.restarted: list[str] = []

    def restart(self, dead: NodeProcess) -> NodeProcess:
        dead.stop()
        node = self.spawn(self.commands[dead.name], dead.name)
        self.nodes[self.nodes.index(dead)] = node
        self.restarted.append(dead.name)
        return node

    def restart_world(self) -> list[NodeProcess]:
        raise AssertionError("no trainer world here")


def _supervised(supervisor: Supervisor, until: Callable[[], object]) -> Callable[[], object]:
    """A predicate for ``wait_for`` that polls ``supervisor`` first, failing once the run would end."""

    def step() -> object:
        why = supervisor.poll()
        assert why is None, why
        return until()

    return step


REFUSING_ENV = ["node", "env-server", "--node-id", "env-0", "--bus-control", "tcp://127.0.0.1:1", "--store-run",
                "refused", "--env-server-budget-bytes", str(1 << 20)]
UNPROTECTED = "tcp://198.18.0.1:0"  # other hosts would reach it: refused with no secret, no CURVE, not insecure
HELD = "an address another process holds"  # replaced by the test with one it holds


@pytest.mark.parametrize(("command", "says"), [
    ([*REFUSING_ENV, "--env-server-high-water", "5"], "env_server.high_water must be above 0 and at most 1, got 5.0"),
    ([*REFUSING_ENV, "--env-server-score", "no_such_module:score"],
     "entry point 'no_such_module:score' cannot be loaded"),
    (["node", "bus", "--node-id", "bus", "--bus-control", UNPROTECTED, "--bus-events-in", HELD, "--bus-metrics-port",
      "0", "--security-insecure", "false"], f"refusing to bind {UNPROTECTED}: other hosts could reach it"),
    (["node", "orchestrator", "--node-id", "orchestrator", "--bus-control", "tcp://127.0.0.1:1",
      "--orchestrator-dispatch", "true", "--orchestrator-prompt", "no_such_module:prompt"],
     "entry point 'no_such_module:prompt' cannot be loaded"),
], ids=["at-load", "in-its-role", "refused-by-security", "an-entry-point"])
def test_a_node_whose_config_cannot_work_is_never_restarted_and_the_run_ends_naming_it(
        spawn, tmp_path: Path, command: list[str], says: str) -> None:
    """A node refused its config (exit status 2): an env server's at load, or in its role (an entry point it cannot
    load); a broker's address, which security refuses to bind unprotected, and an orchestrator's prompt entry
    point it cannot load (before: exit 1, as a crash). Before, it was restarted with backoff, to refuse the same
    config again, until the restart budget was spent. Now the run ends at once, named after the node and its
    refusal's last line; nothing is restarted."""
    name = command[command.index("--node-id") + 1]
    # The broker's events address is one another process holds: a config security refuses is told as such,
    # whatever holds the node's other ports (it was told "address in use", a crash, when another cluster held them).
    with socket.create_server(("127.0.0.1", 0)) as held:
        command = [f"tcp://127.0.0.1:{held.getsockname()[1]}" if arg == HELD else arg for arg in command]
        cluster = _Processes(spawn, {name: [*command, "--store-directory", str(tmp_path / "shm")]})
        supervisor = Supervisor(cluster, budget=3, backoff_s=BACKOFF_S, say=lambda _: None)  # type: ignore[arg-type]
        why = wait_for(supervisor.poll, SUPERVISED_S, "the run to end")
    assert why.startswith(f"{name} cannot run as configured (exit 2, config): {says}"), why
    assert cluster.restarted == [] and supervisor.fatal == [name], why
    assert [(d["node"], d["exit"], d["restarted"]) for d in supervisor.report()["deaths"]] == [
        (name, "exit 2, config", False)]


# User modules, written where the test's node processes import them from (``_importable``).
USER_MODULES = {
    # Its top-level code fails for a while only: the data file it reads is still being written.
    "half_written": "raise ValueError(\"could not convert string to float: '' (data file still being written)\")\n",
    "needs_dependency": "import refbus_no_such_dependency\n\ndef score(prompt, completion):\n    return 0.0\n",
    "fails_oddly": "raise AttributeError('a module of its own lacks something today')\n",
    "being_written": "def score(prompt,\n",  # read half-way: a SyntaxError
    "fine": "LIMIT = 3\n\ndef score(prompt, completion):\n    return 0.0\n",
}


def _importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write :data:`USER_MODULES` to ``tmp_path`` and put it on the ``PYTHONPATH`` node processes inherit, and on
    this process's ``sys.path`` (forgetting the modules imported here afterwards)."""
    for name, text in USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(("spec", "raised"), [
    ("half_written:score", ValueError), ("fails_oddly:score", AttributeError), ("being_written:score", SyntaxError),
])
def test_an_entry_point_whose_module_raised_at_import_is_user_code_that_failed_not_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, raised: type[Exception]) -> None:
    _importable(tmp_path, monkeypatch)
    with pytest.raises(UserCodeFailed) as failed:
        load_entry_point(spec)
    assert not isinstance(failed.value, ValueError) and isinstance(failed.value.__cause__, raised)
    assert f"entry point {spec!r}: importing {spec.split(':')[0]} raised {raised.__name__}" in str(failed.value)


@pytest.mark.parametrize(("spec", "says"), [
    ("refbus_no_such_module:score", "No module named 'refbus_no_such_module'"),
    # A dependency of the module missing never clears by itself: the config's to change, as a missing module.
    ("needs_dependency:score", "No module named 'refbus_no_such_dependency'"),
    ("fine:missing", "module 'fine' has no attribute 'missing'"),
])
def test_an_entry_point_the_config_names_wrongly_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, says: str) -> None:
    _importable(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=re.escape(f"entry point {spec!r} cannot be loaded: {says}")):
        load_entry_point(spec)
    with pytest.raises(ConfigError, match="is not callable"):
        load_entry_point("fine:LIMIT")


@pytest.mark.parametrize("command", [
    [*REFUSING_ENV, "--env-server-score", "half_written:score"],
    ["node", "orchestrator", "--node-id", "orchestrator", "--bus-control", "tcp://127.0.0.1:1",
     "--orchestrator-dispatch", "true", "--orchestrator-prompt", "half_written:prompt"],
], ids=["env-server", "orchestrator"])
def test_a_node_whose_entry_points_module_raised_at_import_is_restarted_as_a_crash(
        spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    """The module an entry point names raises a ValueError at import (a data file it reads still being written):
    user code that crashed, so the node exits 1 with its traceback and is restarted within the budget, whatever
    its role. Before, an env server took any ValueError for a config that cannot work: exit 2, the run ended at
    once (the orchestrator, for the same failure, was restarted)."""
    _importable(tmp_path, monkeypatch)
    name = command[command.index("--node-id") + 1]
    cluster = _Processes(spawn, {name: [*command, "--store-directory", str(tmp_path / "shm")]})
    supervisor = Supervisor(cluster, budget=1, backoff_s=BACKOFF_S, say=lambda _: None)  # type: ignore[arg-type]
    why = wait_for(supervisor.poll, 2 * SUPERVISED_S, "the restart budget spent")  # a start, a restart
    assert why.startswith(f"{name} died (exit 1); the restart budget (1) is spent"), why
    assert cluster.restarted == [name] and supervisor.fatal == [name], why
    assert [(d.node, d.exit, d.restarted) for d in supervisor.deaths] == [(name, "exit 1", True),
                                                                          (name, "exit 1", False)]
    assert "ValueError: could not convert string to float" in cluster.nodes[0].log_tail(), cluster.nodes[0].log_tail()


HOLD_STORE = """
import sys
from refbus.nodes.store.durable import DurableStore
store = DurableStore(sys.argv[1], sys.argv[2], sys.argv[3], budget_bytes=0, what="a test's hold")
print("held", flush=True)
sys.stdin.read()
"""


def test_a_durable_env_server_whose_store_a_live_process_holds_is_restarted_until_it_is_let_go(
        bus, spawn, tmp_path: Path) -> None:
    """Another live process holds env-0's durable store (as a predecessor not yet dead would): env-0 says who
    holds it and exits 1, a failure that clears by itself, so it is restarted, and it comes up once the holder
    is SIGKILLed. Before, it exited 2, the status of a config that cannot work."""
    _, control = bus
    shm, run = tmp_path / "shm", "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_STORE, str(shm), run, "env-0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, bufsize=0)
    try:
        assert read_line(holder, START_S) == "held"
        command = ["node", "env-server", "--node-id", "env-0", "--bus-control", control, *FAST_LIVENESS,
                   "--store-directory", str(shm), "--store-run", run, "--env-server-budget-bytes", str(1 << 20)]
        cluster = _Processes(spawn, {"env-0": command})
        supervisor = Supervisor(cluster, budget=10, backoff_s=BACKOFF_S, say=lambda _: None)  # type: ignore[arg-type]
        wait_for(_supervised(supervisor, lambda: supervisor.deaths), SUPERVISED_S, "env-0 refused the held store")
        refused = supervisor.deaths[0]
        assert refused.exit == "exit 1", cluster.nodes[0].log_tail()
        assert f"refbus: store {shm}/" in cluster.nodes[0].log_tail()
        assert f"is held by process {holder.pid}" in cluster.nodes[0].log_tail()
        holder.kill()
        holder.wait()
        wait_for(_supervised(supervisor, lambda: cluster.nodes[0].ready_file.exists()), SUPERVISED_S,
                 "env-0 up once the holder is gone")
        assert cluster.restarted and set(cluster.restarted) == {"env-0"} and supervisor.fatal == []
        assert {d.exit for d in supervisor.deaths} == {"exit 1"}
    finally:
        holder.kill()
        holder.wait()
