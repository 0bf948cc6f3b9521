"""Stores that survive their process, end to end under `refbus up`: an env server holding blobs and a
ps-worker holding shards, killed with SIGKILL, are restarted under their node ids and re-adopt their durable
stores; the run loses no blob, no micro batch (trainer fetches and deletes wait for the restart; the ledger
is exact, no violation, nothing held by a rank at the end) and no version; the store directories are gone
once the run ends."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from polling import wait_for
from test_supervise import QUICK
from test_up import RUN_S, START_S, STOP_S, Up, check_accounted

pytestmark = pytest.mark.timeout(RUN_S + 2 * STOP_S)


def segments(shm: Path, node: str) -> int:
    return sum(1 for _ in shm.glob(f"refbus-store.*.{node}/seg-*"))


def log_events(log: Path, event: str) -> list[dict]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def shard_files(shm: Path, node: str) -> int:
    own = {"lock", "id", "journal"}
    return sum(1 for p in shm.glob(f"refbus-store.*.{node}/*") if p.name not in own)


def test_killed_env_server_and_ps_worker_readopt_their_stores_and_nothing_is_lost(tmp_path: Path) -> None:
    steps = 5
    shm = tmp_path / "shm"
    up = Up(tmp_path, steps, *QUICK, "--store-directory", str(shm))
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        wait_for(lambda: up.alive() and segments(shm, "env-1") > 0 and shard_files(shm, "ps-worker-1") > 0,
                 RUN_S / 4, "env-1 holding blobs and ps-worker-1 shards", poll_s=0.02)
        pids = up.note_pids()
        victims = {name: pids[name] for name in ("env-1", "ps-worker-1")}
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(20_000)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], (output, summary["accounting"])
        deaths = {d["node"]: d for d in summary["deaths"]}
        for name, pid in victims.items():
            assert (deaths[name]["pid"], deaths[name]["exit"], deaths[name]["restarted"]) == (pid, "SIGKILL", True)
        # A push granted to the ps-worker just before it was killed fails its rank: that may cost a world restart
        # from the checkpoint (what the ranks held is reclaimed, named with them), never a store's blob.
        others = set(deaths) - set(victims)
        assert others <= {"trainer-0", "trainer-1"} and len(summary["world_restarts"]) == (1 if others else 0), output
        blobs_back = log_events(up.run_dir / "env-1.log", "store.readopted")
        assert len(blobs_back) == 1 and blobs_back[0]["blobs"] > 0 and blobs_back[0]["lost"] == 0, blobs_back
        shards_back = log_events(up.run_dir / "ps-worker-1.log", "store.readopted")
        assert len(shards_back) == 1 and shards_back[0]["shards"] > 0 and shards_back[0]["lost"] == 0, shards_back
        assert not log_events(up.run_dir / "ps-manager.log", "ps.versions_lost_on_worker"), "a version was lost"
        # Never a store's loss; a restarted world's ranks all lose what they held.
        blobs = check_accounted(summary, {"trainer-0", "trainer-1"} if others else set())
        if not others:
            assert blobs["lost"] == 0 and summary["dropped_micro_batches"] == 0, output  # fetches waited
            # The launcher's live fold agrees with the stores' own counters, and no rank held a blob at the end:
            # deletes that failed against the killed store were sent to its restarted process.
            accounting = summary["accounting"]
            assert all(result == "agreed" for result in accounting["reconciled"].values()), (output, accounting)
            assert accounting["held_at_end"] == {} and code == 0 and summary["ok"], (output, accounting)
        print(f"env-1 re-adopted {blobs_back[0]['blobs']} blobs ({blobs_back[0]['bytes']} bytes) in "
              f"{blobs_back[0]['seconds']:.4f}s, aborted {blobs_back[0]['aborted']}; ps-worker-1 re-adopted "
              f"{shards_back[0]['shards']} shards of versions {shards_back[0]['versions']} in "
              f"{shards_back[0]['seconds']:.4f}s")
        assert not list(shm.glob("refbus-store.*")), "store directories left after the run"
        assert up.leftovers() == []
    finally:
        up.close()
