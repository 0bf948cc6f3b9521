"""A trainer rank killed with SIGKILL mid-run of `refbus up`: its world ends loudly (the surviving rank names the
dead one and exits), the supervisor restarts the whole world from its checkpoints, the orchestrator waits for
the new world and continues from the step it reports, the parameter server takes the new lineage's versions,
and the run completes every step with every kept blob deleted once or lost with its node, no ownership
violation and no process left."""

from __future__ import annotations

import os
import signal
import tomllib
from pathlib import Path

import pytest
from polling import wait_for
from test_supervise import QUICK
from test_up import RUN_S, START_S, STOP_S, Up, log_events

CHECKPOINT_EVERY = 1
# A short restart grace: the orchestrator waits it out (after the last old rank is down) before it ships to
# the new world, so the stores have reclaimed what the old world held.
RESTART_GRACE_S = 2.0
pytestmark = pytest.mark.timeout(RUN_S + 2 * STOP_S)


def test_killed_trainer_rank_restarts_its_world_from_the_checkpoint_and_the_run_completes(tmp_path: Path) -> None:
    steps = 4
    up = Up(tmp_path, steps, *QUICK, "--up-checkpoint-every", str(CHECKPOINT_EVERY),
            "--node-restart-grace-s", str(RESTART_GRACE_S))
    try:
        # Past both ranks' checkpoints of step 2 (the progress line can come before a rank's write), before the
        # run's end: the new world resumes from step 2 or later.
        def checkpointed(rank: int) -> int:
            if not (up.run_dir / "cluster.toml").exists():
                return 0
            return max((int(p.stem.split("-")[1]) for p in (checkpoints(up) / f"rank-{rank}")
                        .glob("step-*.safetensors")), default=0)

        wait_for(lambda: up.alive() and min(checkpointed(0), checkpointed(1)) >= 2, START_S + RUN_S / 4,
                 "both ranks' checkpoints of step 2", poll_s=0.1)
        victim = up.note_pids()["trainer-1"]
        survivor = up.pids["trainer-0"]
        os.kill(victim, signal.SIGKILL)
        # Exit 1: what the dead world held is lost (reclaimed by the stores, named), so the ledger is not "ok".
        assert up.wait(RUN_S) in (0, 1), up.output(20_000)

        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        assert summary["restarts"] == 1 and summary["world_restarts"] == ["trainer-1"], output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("trainer-1", victim, "SIGKILL", True)], output
        assert "refbus up: trainer-1 died (SIGKILL); stopping its trainer world" in output
        assert "refbus up: trainer world restarted from its checkpoint" in output
        assert "trainer worlds        restarted 1 times from checkpoints (after the death of trainer-1)" in output
        assert summary["blobs"]["violations"] == 0 and summary["accounting"]["unaccounted"] == [], output
        blobs, accounting = summary["blobs"], summary["accounting"]
        # Every kept blob deleted exactly once or lost with its node: only trainer ranks lose anything.
        assert blobs["kept"] == blobs["deleted_total"] + blobs["lost"], output
        assert blobs["held"] == 0 and blobs["leaked"] == 0 and accounting["held_at_end"] == {}, output
        assert set(accounting["lost"]) <= {"trainer-0", "trainer-1"}, output
        assert accounting["stores_unread"] == [] and set(accounting["reconciled"]) == {"env-0", "env-1"}, output

        # The surviving rank ended its world loudly, naming the dead rank.
        broken = log_events(up.run_dir / "trainer-0.log", "trainer.world_broken")
        assert broken and broken[0]["dead_rank"] == 1 and broken[0]["dead_node"] == "trainer-1", output
        # The new world agreed on a checkpointed step and the orchestrator continued from it.
        resumed = log_events(up.run_dir / "trainer-0.log", "trainer.resumed")
        assert resumed and 2 <= resumed[-1]["step"] < steps, output
        continued = log_events(up.run_dir / "orchestrator.log", "trainers.world_resumed")
        assert [e["step"] for e in continued] == [resumed[-1]["step"]], output
        lineage = log_events(up.run_dir / "ps-manager.log", "ps.lineage_started")
        assert lineage[-1]["version"] == resumed[-1]["step"], output
        assert survivor not in {pid for pid, _ in up.leftovers()}
        assert up.leftovers() == []
    finally:
        up.close()


def checkpoints(up: Up) -> Path:
    """The checkpoint directory of ``up``'s run, once its config is written: keyed by its run id."""
    run = tomllib.loads((up.run_dir / "cluster.toml").read_text())["store"]["run"]
    return up.run_dir / "checkpoints" / run


def test_a_run_directory_given_again_starts_the_new_run_from_step_0(tmp_path: Path) -> None:
    """The checkpoints (and rendezvous files) of a run are its own: a second run in the same run directory
    trains all its steps from the initial weights, not from where the first one ended, and the first one's
    checkpoints stay."""
    steps = 2
    runs = []
    for _ in range(2):
        up = Up(tmp_path, steps, *QUICK, "--up-checkpoint-every", "1")
        try:
            assert up.wait(RUN_S) == 0, up.output(20_000)
            summary = up.summary()
            assert summary["ok"] and summary["ps_versions"] == list(range(steps + 1)), up.output(20_000)
            runs.append(checkpoints(up))
        finally:
            up.close()
    first, second = runs
    assert first != second and first.parent == second.parent == tmp_path / "run" / "checkpoints"
    for run in runs:
        assert sorted(p.name for p in (run / "rank-0").iterdir()) == ["step-1.safetensors", "step-2.safetensors"]
    for rank in (0, 1):  # each rank's log holds both runs (appended): each started fresh, neither resumed
        log = tmp_path / "run" / f"trainer-{rank}.log"
        assert [e["step"] for e in log_events(log, "trainer.fresh_start")] == [0, 0]
        assert log_events(log, "trainer.resumed") == []
