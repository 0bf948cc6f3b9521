"""Stores that survive their process, end to end under `refbus up`: an env server killed with SIGKILL while
it holds blobs is restarted under its node id, re-adopts its durable store and the run loses no blob and no
micro batch (trainer fetches wait for the restart; the ledger is exact, no violation); the store directories
are gone once the run ends."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from polling import wait_for
from test_supervise import QUICK
from test_up import RUN_S, START_S, STOP_S, Up

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


def test_killed_env_server_readopts_its_store_and_the_run_loses_no_blob(tmp_path: Path) -> None:
    steps = 5
    shm = tmp_path / "shm"
    up = Up(tmp_path, steps, *QUICK, "--store-directory", str(shm))
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        wait_for(lambda: up.alive() and segments(shm, "env-1") > 0, RUN_S / 4, "env-1 holding blobs", poll_s=0.02)
        pid = up.note_pids()["env-1"]
        os.kill(pid, signal.SIGKILL)
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(20_000)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], output
        assert [(d["node"], d["pid"], d["exit"], d["restarted"]) for d in summary["deaths"]] == [
            ("env-1", pid, "SIGKILL", True)], output
        readopted = log_events(up.run_dir / "env-1.log", "store.readopted")
        assert len(readopted) == 1 and readopted[0]["blobs"] > 0 and readopted[0]["lost"] == 0, readopted
        blobs = summary["blobs"]
        assert blobs["lost"] == blobs["violations"] == blobs["held"] == blobs["leaked"] == 0, blobs
        assert blobs["unaccounted"] == 0 and blobs["kept"] == blobs["deleted_total"], blobs
        assert summary["dropped_micro_batches"] == 0, output  # fetches waited for the restart
        assert code == 0 and summary["ok"], output
        print(f"env-1 re-adopted {readopted[0]['blobs']} blobs ({readopted[0]['bytes']} bytes) in "
              f"{readopted[0]['seconds']:.4f}s; aborted {readopted[0]['aborted']}")
        assert not list(shm.glob("refbus-store.*")), "store directories left after the run"
        assert up.leftovers() == []
    finally:
        up.close()
