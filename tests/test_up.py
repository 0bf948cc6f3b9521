"""`refbus up` end to end: a whole local cluster runs the RL loop for a few steps (a first training step and a
first generation longer than the node timeout among them), checked from its JSON summary and from the event
stream (`refbus monitor --json`, fed to the ledger); and Ctrl-C mid-run (SIGINT to the
launcher only, as a terminal delivers it) stops everything within seconds, frees every kept blob and leaves no
process and no shared-memory segment behind.

:class:`Up` (one `refbus up` run on ephemeral ports) is also what tests/test_observability.py scrapes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST_LIVENESS
from polling import read_line, wait_for
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes import up as up_module
from refbus.nodes.cli import _command, build_parser
from refbus.nodes.config import Config, ConfigError, load_config
from refbus.nodes.launch import NodeProcess, NodeStartError
from refbus.nodes.ledger import Ledger
from refbus.nodes.store.durable import PREFIX as STORE_PREFIX
from refbus.nodes.supervisor import BROKER
from refbus.nodes.up import LocalCluster, RunRecord, _report, _StopFlag, _summary, run_up, wait_first_version
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import NodeInfo, NodeUp, StepBatch, VersionBump
from stalling_entry_points import STALL_ENV
from test_liveness import free_port

CLI = [sys.executable, "-m", "refbus.nodes.cli"]
TESTS = Path(__file__).parent
# Every endpoint the launcher binds, ephemeral: runs never collide with each other or with a user's cluster.
EPHEMERAL_PORTS = ["--bus-control", "tcp://127.0.0.1:0", "--bus-events-in", "tcp://127.0.0.1:0",
                   "--bus-events-out", "tcp://127.0.0.1:0", "--bus-metrics-port", "0",
                   "--ps-manager", "tcp://127.0.0.1:0"]
# The nodes the default config starts (besides the broker); "up-watcher" is the launcher's own watcher.
NODES = {"ps-manager", "ps-worker-0", "ps-worker-1", "env-0", "env-1", "trainer-0", "trainer-1", "rollout-0",
         "rollout-1", "orchestrator", "up-watcher"}
START_S = 60.0  # broker up, or the cluster running its first steps (torch imports on 2 busy cores)
RUN_S = 240.0  # a short run, start to summary
STOP_S = 30.0  # Ctrl-C to exit: "within seconds", with room for a loaded CI machine
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SMALL_RING = 300  # events: a 4-step run publishes more
MONITOR_ID = "test-monitor"
# Above the suite's default (120 s): the waits in these tests are bounded on their own and fail with a message
# (and reap the run) before this.
pytestmark = pytest.mark.timeout(RUN_S + 2 * STOP_S)


class Up:
    """One `refbus up` run: a child in its own process group (a terminal's foreground job), on ephemeral
    ports, with its run directory, JSON summary and plot under ``workdir``. :meth:`close` reaps every
    process of the run whatever happened."""

    def __init__(self, workdir: Path, steps: int, *flags: str) -> None:
        self.run_dir = workdir / "run"
        self.summary_path = workdir / "summary.json"
        self.plot_path = workdir / "plot.png"
        self.output_path = workdir / "up.out"
        self.pids: dict[str, int] = {}  # node name -> pid, from the ready files while they exist
        with open(self.output_path, "wb") as out:
            self.proc = subprocess.Popen(
                [*CLI, "up", "--up-steps", str(steps), *EPHEMERAL_PORTS, "--run-dir", str(self.run_dir),
                 "--summary-out", str(self.summary_path), "--plot-out", str(self.plot_path), *flags],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)

    def output(self, chars: int | None = 4000) -> str:
        """What ``refbus up`` printed: the last ``chars`` characters (for a message), or all of it (None: to look
        for a line, however much the nodes logged after it)."""
        said = self.output_path.read_text(errors="replace")
        return said if chars is None else said[-chars:]

    def alive(self) -> bool:
        assert self.proc.poll() is None, f"refbus up exited with {self.proc.returncode}:\n{self.output()}"
        return True

    def bus(self) -> dict[str, Any]:
        """The broker's registry entry (real endpoints and metrics URL), once it is up."""
        ready = self.run_dir / "bus.ready.json"  # written atomically (rename)
        wait_for(lambda: self.alive() and ready.exists(), START_S, "the broker of refbus up ready")
        return json.loads(ready.read_text())

    def started(self) -> None:
        """Wait until the launcher has started every node: the orchestrator, started last, is ready. Its
        ``cluster.toml`` changes no more after that but at a trainer world's restart (each start pins what the
        nodes started after it must find)."""
        ready = self.run_dir / "orchestrator.ready.json"
        wait_for(lambda: self.alive() and ready.exists(), START_S, "every node of refbus up started")

    def note_pids(self) -> dict[str, int]:
        """Record the pid of every node whose ready file exists now (a node removes it when it stops)."""
        for path in self.run_dir.glob("*.ready.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.pids[path.name.removesuffix(".ready.json")] = json.loads(path.read_text())["pid"]
        return self.pids

    def wait(self, timeout: float) -> int:
        """The exit code, noting pids while the run goes on; fails (with the output) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.note_pids()
            assert time.monotonic() < deadline, f"refbus up still running after {timeout:.0f}s:\n{self.output()}"
            time.sleep(0.05)
        return self.proc.returncode

    def summary(self) -> dict[str, Any]:
        assert self.summary_path.exists(), f"no summary written:\n{self.output()}"
        return json.loads(self.summary_path.read_text())

    def leftovers(self) -> list[tuple[int, str]]:
        """Live processes (other than this one) whose command line names the run directory."""
        return [(pid, cmdline) for pid, cmdline in _processes() if str(self.run_dir) in cmdline and pid != os.getpid()]

    def segments(self, pids: set[int]) -> list[str]:
        """Shared-memory segments (``<prefix>.<pid>.<n>``, from the run's config) of ``pids``: in ``ps.shm_dir``,
        or in the workers' durable store directories under ``store.directory``."""
        config = tomllib.loads((self.run_dir / "cluster.toml").read_text())
        ps, store = config["ps"], config["store"]
        patterns = [(ps["shm_dir"], "{}"), (store["directory"], f"{STORE_PREFIX}*/{{}}")]
        return sorted(str(path) for pid in pids for directory, pattern in patterns
                      for path in Path(directory).glob(pattern.format(f"{ps['shm_prefix']}.{pid}.*")))

    def close(self) -> None:
        """Ctrl-C if still running, SIGKILL to its process group if that does not end it; then SIGKILL any
        process of the run still alive (each started in its own session, so the group does not reach them)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid, _ in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
    return found


class EventLog:
    """What `refbus monitor --json --since 0` (attached to a run's broker) printed, read incrementally."""

    def __init__(self, workdir: Path, control: str) -> None:
        workdir.mkdir()
        self.path = workdir / "events.jsonl"
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        with open(self.path, "wb") as out:
            self.monitor = NodeProcess(["monitor", "--json", "--since", "0", "--bus-control", control,
                                        "--node-id", MONITOR_ID], workdir=workdir, name="monitor", stdout=out)

    def refresh(self) -> list[dict[str, Any]]:
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(complete)
        self.records.extend(json.loads(line) for line in complete.splitlines() if line.strip())
        return self.records

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    def version(self) -> int:
        self.refresh()
        return max((r["version"] for r in self.of("version-bump")), default=-1)

    def finish(self) -> None:
        """After the run: read until every node that came up said goodbye (the broker forwards the last
        ``node-down`` just before it stops), then stop the monitor (its broker is gone)."""
        def still_up() -> set[str]:
            self.refresh()
            came_up = {r["node"]["node_id"] for r in self.of("node-up")} - {MONITOR_ID}
            return came_up - {r["node_id"] for r in self.of("node-down")}

        try:
            wait_for(lambda: not still_up(), 20, "the monitor saw every node of the run leave")
        finally:
            self.monitor.stop()
            self.refresh()


def check_blobs(log: EventLog, up_blobs: dict[str, Any]) -> None:
    """From the stream alone: every kept blob deleted exactly once, by its owner, none held, no violation;
    the same account as the launcher's summary."""
    ledger = Ledger()
    for record in log.records:
        ledger.apply(record)
    report = ledger.report()
    totals = report.totals()
    assert report.violations == [] and not log.of("violation")
    assert totals["kept"] == totals["deleted_total"] > 0 and totals["held"] == totals["leaked"] == 0, totals
    assert totals == up_blobs  # the launcher folded the same stream live

    kept = [ref["blob_id"] for r in log.of("episode-finished") for ref in r["refs"]]
    deleted = Counter(blob_id for r in log.of("delete") for blob_id in r["blob_ids"])
    assert len(kept) == len(set(kept)) == totals["kept"]
    assert set(deleted) == set(kept) and set(deleted.values()) == {1}


def log_events(log: Path, event: str) -> list[dict]:
    """The records of ``event`` in a node's JSON log (lines that do not parse are skipped)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            try:
                found.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return found


def check_accounted(summary: dict[str, Any], losers: set[str]) -> dict[str, Any]:
    """A run after deaths: every kept blob deleted once or lost, only with ``losers``; no violation, nothing
    held, leaked or unaccounted. Returns the summary's blob totals."""
    blobs = summary["blobs"]
    assert blobs["violations"] == blobs["held"] == blobs["leaked"] == blobs["unaccounted"] == 0, blobs
    assert blobs["kept"] == blobs["deleted_total"] + blobs["lost"], blobs
    assert set(summary["accounting"]["lost"]) <= losers, summary["accounting"]
    return blobs


def check_no_process_and_no_segment(up: Up, log: EventLog) -> None:
    assert up.leftovers() == []
    workers = {r["node"]["pid"] for r in log.of("node-up") if r["node"]["role"] == "ps-worker"}
    assert len(workers) == 2 and workers == {pid for name, pid in up.pids.items() if name.startswith("ps-worker")}
    assert up.segments(workers) == []


def check_every_node_said_bye(log: EventLog) -> None:
    down = {r["node_id"]: r["reason"] for r in log.of("node-down")}
    assert down == dict.fromkeys(NODES, "bye")  # a clean exit each, none timed out


def test_up_runs_steps_and_accounts_for_every_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: each trainer rank's first step and each rollout's first generation block for three node timeouts
    (entry points given by name, as a user's are): no node is declared down, no step batch is sent twice. The
prompt source is a quick curriculum whose rising level the progress lines and the summary report.
    The broker's ring holds fewer events than the run publishes: the launcher's account, folded live and
    reconciled with every env server's own counters, is exact all the same."""
    started = time.monotonic()
    node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
    monkeypatch.setenv(STALL_ENV, str(3 * node_timeout_s))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    up = Up(tmp_path, 4, *FAST_LIVENESS, "--rl-train-step", "stalling_entry_points:train_step",
            "--rl-generate", "stalling_entry_points:generate", "--bus-ring-events", str(SMALL_RING),
            "--orchestrator-prompt", "curriculum_entry_points:QuickCurriculum")
    log = None
    try:
        log = EventLog(tmp_path / "watch", up.bus()["endpoints"]["control"])
        assert up.wait(RUN_S) == 0, up.output()
        log.finish()

        summary = up.summary()
        assert (summary["ok"], summary["interrupted"], summary["failed_nodes"]) == (True, False, [])
        assert summary["steps"] == 4 and summary["ps_versions"] == [0, 1, 2, 3, 4]
        blobs = summary["blobs"]
        assert blobs["kept"] == blobs["deleted_total"] > 0, blobs
        assert blobs["held"] == blobs["leaked"] == blobs["violations"] == 0, blobs
        by_version = summary["reward"]["by_version"]
        assert by_version and {v for v, _ in by_version} <= {0, 1, 2, 3, 4}
        assert all(math.isfinite(r) for _, r in by_version)
        assert summary["orchestrator_peak_rss_bytes"] > 0
        assert len(summary["fetch_seconds_per_step"]) == 4 and all(s > 0 for s in summary["fetch_seconds_per_step"])
        assert summary["bytes"]["by_reference_fetched"] > 0 and summary["dropped_micro_batches"] == 0
        assert up.plot_path.read_bytes().startswith(PNG_SIGNATURE)
        assert len(summary["seconds_per_step"]) == 4 and all(s > 0 for s in summary["seconds_per_step"])
        shares = summary["deleted_shares"]
        assert set(shares) == set(blobs["deleted"]) and sum(shares.values()) == pytest.approx(1, abs=1e-3)
        filtered = summary["filtered_share_by_version"]
        assert filtered and all(0 <= share <= 1 for _, share in filtered)
        assert "eps/s" in up.output() and "elapsed, ~" in up.output() and "why samples left" in up.output()
        # The prompt source (a curriculum moving on every GROUPS_PER_LEVEL completed groups) hears the groups
        # the orchestrator completes, and its level shows on the progress lines and in the summary.
        levels = [task["level"] for _, task in summary["task_by_version"]]
        assert levels == sorted(levels) and levels[-1] > levels[0] >= 1, summary["task_by_version"]
        assert "task level=" in up.output()

        check_blobs(log, blobs)
        assert len(log.records) > SMALL_RING  # more than the ring could replay at the end
        assert summary["accounting"]["reconciled"] == {"env-0": "agreed", "env-1": "agreed"}
        assert summary["accounting"]["unaccounted"] == summary["accounting"]["stores_unread"] == []
        assert blobs["missed_events"] == blobs["lost"] == 0
        assert [r["version"] for r in log.of("version-bump")] == [0, 1, 2, 3, 4]  # one new version per step
        acks = Counter((r["step"], r["holder"]) for r in log.of("fetch-ack"))
        assert acks == Counter({(step, f"trainer-{rank}"): 1 for step in range(4) for rank in range(2)})
        episodes = log.of("episode-finished")
        assert episodes and all(math.isfinite(r["info"]["reward"]) for r in episodes)
        assert {r["policy_version"] for r in episodes} <= {0, 1, 2, 3, 4}
        check_every_node_said_bye(log)
        resent = [line for line in (up.run_dir / "orchestrator.log").read_text().splitlines()
                  if "request.retry" in line and StepBatch.kind in line]
        assert resent == []
        check_no_process_and_no_segment(up, log)
        print(f"refbus up, 4 steps: {time.monotonic() - started:.1f}s")
    finally:
        up.close()
        if log is not None:
            log.monitor.stop()


def test_the_summary_takes_version_bumps_from_the_ps_manager_only() -> None:
    """Before, ``refbus up`` counted every ``version-bump`` on the stream, whoever sent it: a rollout worker's
    (or any peer's) bump of version 999 made the summary report 999 steps trained. Against a real broker, a
    rollout worker's bump is refused and the ps-manager's are taken, by the role the broker reported each up
    as."""
    loopback = "tcp://127.0.0.1:0"
    bus = NodeRuntime(BROKER, RuntimeSettings(node_id=BROKER, metrics_port=-1), register=False)
    Broker(bus, BrokerSettings(control=loopback, events_in=loopback, events_out=loopback))
    bus.start_background()
    control = bus.endpoints["control"]
    record = RunRecord()
    started: list[NodeRuntime] = []
    try:
        watcher = NodeRuntime("monitor", RuntimeSettings(bus=control, node_id="up-watcher", metrics_port=-1))
        bumps: list[tuple[str, int]] = []  # every bump the record has folded, by sender

        def on_event(message: Any) -> None:
            record.on_event(message)
            if isinstance(message.body, VersionBump):
                bumps.append((message.header.src, message.body.version))

        watcher.subscribe(on_event, since=0)
        nodes = {role: NodeRuntime(role, RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1))
                 for role, node_id in (("ps-manager", "ps-manager"), ("rollout-worker", "rollout-0"))}
        for runtime in (watcher, *nodes.values()):
            runtime.start_background()
            started.append(runtime)
        wait_for(lambda: {"ps-manager", "rollout-0"} <= record.joined.keys(), START_S, "both nodes reported up")

        def bump(role: str, *versions: int) -> None:
            nodes[role].call_soon(lambda: [nodes[role].publish(VersionBump(version=v, nbytes=0, manifest_digest="d"))
                                           for v in versions])

        bump("rollout-worker", 999)
        bump("ps-manager", 0, 1)
        wait_for(lambda: len(bumps) == 3, START_S, "the three bumps folded")
        assert sorted(bumps) == [("ps-manager", 0), ("ps-manager", 1), ("rollout-0", 999)]
        assert record.versions == [0, 1]
    finally:
        for runtime in reversed(started):
            runtime.join(STOP_S)
        bus.join(STOP_S)
    config = Config()
    config.up = dataclasses.replace(config.up, steps=1)
    summary = _summary(record, 0, config, interrupted=False, failed=[], problems=[])
    assert (summary["steps"], summary["ps_versions"], summary["version_bumps_refused"]) == (1, [0, 1], 1)


def test_a_bump_before_its_senders_node_up_waits_for_it_and_unknown_senders_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two publishers' events may cross: a bump seen before its sender's node-up is held until the broker says
    the sender's role (taken for the ps-manager, refused for any other). Bumps of senders never reported up are
    held at most ``UNCONFIRMED_BUMPS_MAX``, the oldest refused first, and count as refused in the summary."""
    monkeypatch.setattr(up_module, "UNCONFIRMED_BUMPS_MAX", 3)
    record = RunRecord()

    def event(src: str, body: Any) -> None:
        record.on_event(WireCodec(src).decode(WireCodec(src).encode(body)))

    def up(node_id: str, role: str) -> None:
        event(BROKER, NodeUp(node=NodeInfo(node_id=node_id, role=role, host="h", pid=1)))

    event("ps-manager", VersionBump(version=0, nbytes=0, manifest_digest="d"))
    event("rollout-0", VersionBump(version=999, nbytes=0, manifest_digest="d"))
    up("rollout-0", "rollout-worker")
    up("not-the-broker", "ps-manager")  # a node-up not from the broker says nothing
    event("not-the-broker", NodeUp(node=NodeInfo(node_id="ps-manager", role="ps-manager", host="h", pid=1)))
    assert (record.versions, record.refused_bumps) == ([], 1)
    up("ps-manager", "ps-manager")
    event("ps-manager", VersionBump(version=1, nbytes=0, manifest_digest="d"))
    assert (record.versions, record.refused_bumps) == ([0, 1], 1)
    for i in range(5):  # senders the broker never reported up
        event(f"ghost-{i}", VersionBump(version=10**6 + i, nbytes=0, manifest_digest="d"))
    assert record.refused_bumps == 3 and [src for src, *_ in record.unconfirmed_bumps] == ["ghost-2", "ghost-3",
                                                                                          "ghost-4"]
    config = Config()
    summary = _summary(record, 0, config, interrupted=False, failed=[], problems=[])
    assert (summary["steps"], summary["version_bumps_refused"]) == (1, 6)


def test_a_store_whose_counters_were_not_read_makes_the_run_not_ok(capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the stores the launcher could not reconcile were printed as unaccounted, then "result ok"."""
    record = RunRecord()
    record.versions = [0, 1, 2]
    config = Config()
    config.up = dataclasses.replace(config.up, steps=2)
    assert _summary(record, 0, config, interrupted=False, failed=[], problems=[])["ok"]  # every store read
    problem = "store env-1: not in the registry: its counters not read"
    summary = _summary(record, 0, config, interrupted=False, failed=[], problems=[problem])
    assert not summary["ok"] and summary["not_ok"] == [f"stores' counters not read ({problem})"]
    assert summary["accounting"]["stores_unread"] == [problem]
    _report({**summary, "restarts": 0, "deaths": [], "world_restarts": []},
            argparse.Namespace(summary_out=None, plot_out=None))
    out = capsys.readouterr().out
    assert f"not reconciled        {problem}" in out
    assert f"result                NOT ok: stores' counters not read ({problem})" in out


def test_ctrl_c_mid_run_stops_everything_and_frees_every_blob(tmp_path: Path) -> None:
    up = Up(tmp_path, 200)
    log = None
    try:
        log = EventLog(tmp_path / "watch", up.bus()["endpoints"]["control"])
        wait_for(lambda: up.alive() and log.version() >= 2, START_S + RUN_S / 4, "version 2 published", poll_s=0.1)
        workers = {pid for name, pid in up.note_pids().items() if name.startswith("ps-worker")}
        assert len(workers) == 2 and up.segments(workers)  # the run holds weights in shared memory now
        assert {up.proc.pid, *up.pids.values()} <= {pid for pid, _ in up.leftovers()}  # the scan sees the run

        interrupted = time.monotonic()
        up.proc.send_signal(signal.SIGINT)  # to the launcher only: its nodes run in their own sessions
        try:
            code = up.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"refbus up still running {STOP_S:.0f}s after Ctrl-C:\n{up.output()}") from None
        took = time.monotonic() - interrupted
        assert code == 130, up.output()
        log.finish()

        summary = up.summary()
        assert summary["interrupted"] is True and summary["ok"] is False
        assert 2 <= summary["steps"] < 200
        blobs = summary["blobs"]
        assert blobs["kept"] == blobs["deleted_total"] > 0, blobs
        assert blobs["held"] == blobs["leaked"] == blobs["violations"] == 0, blobs
        check_blobs(log, blobs)
        check_every_node_said_bye(log)
        check_no_process_and_no_segment(up, log)
        print(f"Ctrl-C to exit: {took:.1f}s")
    finally:
        up.close()
        if log is not None:
            log.monitor.stop()


def test_ctrl_c_during_start_up_starts_no_further_node(tmp_path: Path) -> None:
    up = Up(tmp_path, 200)
    try:
        up.bus()
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(STOP_S + START_S) == 130, up.output()
        assert up.leftovers() == []
        # The nodes the launcher starts a few seconds after the broker (each leaves its log file) never start.
        started = sorted(path.stem for path in up.run_dir.glob("*.log"))
        assert not {"trainer-0", "trainer-1", "rollout-0", "rollout-1", "orchestrator"} & set(started), started
    finally:
        up.close()


def _failing_start(self: LocalCluster, name: str, *command: str, wait: bool = True) -> NodeProcess:
    raise NodeStartError(f"{name} exited with 1:\n(log tail)")


@pytest.mark.parametrize("keep_logs", [False, True])
def test_a_failed_start_removes_the_temporary_run_directory_unless_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], keep_logs: bool) -> None:
    """Before, a node that failed to start returned before the clean-up: the temporary run directory stayed,
    with the secret in its cluster.toml. No process starts here: the start of the broker fails at once."""
    monkeypatch.setattr(LocalCluster, "start", _failing_start)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("REFBUS_SECRET", "s3cret")
    args = build_parser().parse_args(["up", *(["--keep-logs"] if keep_logs else [])])
    assert run_up(load_config(args), args) == 1
    out = capsys.readouterr().out
    assert "a node failed to start: bus exited with 1" in out
    left = list(tmp_path.glob("refbus-up-*"))
    if keep_logs:
        (kept,) = left
        assert f"run directory kept: {kept}" in out and "s3cret" in (kept / "cluster.toml").read_text()
    else:
        assert left == []


def test_outputs_the_end_of_a_run_could_not_write_are_refused_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a --plot-out without the plot extra or a --summary-out in a missing directory, or naming a
    directory, was a traceback at the very end of the run (and the run directory stayed)."""
    monkeypatch.setattr(LocalCluster, "start", _failing_start)  # were the check missed: nothing would start
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an install without the plot extra
    for flags, says in ((["--plot-out", str(tmp_path / "p.png")], r"needs matplotlib: install the plot extra"),
                        (["--summary-out", str(tmp_path / "no-such-dir" / "s.json")], r"no directory .*no-such-dir"),
                        (["--summary-out", str(tmp_path)], r"is a directory: name the file to write")):
        args = build_parser().parse_args(["up", *flags])
        with pytest.raises(ConfigError, match=says):
            run_up(load_config(args), args)
        assert _command(load_config(args), args) == 2  # the CLI's: a message, as for a bad config
    assert list(tmp_path.iterdir()) == []  # no run directory made


def test_a_run_dir_that_names_a_file_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a --run-dir naming a file (or under one) ended in a FileExistsError traceback, exit 1."""
    monkeypatch.setattr(LocalCluster, "start", _failing_start)  # were the check missed: nothing would start
    (tmp_path / "a-file").write_text("not a directory")
    for run_dir in (tmp_path / "a-file", tmp_path / "a-file" / "under"):
        args = build_parser().parse_args(["up", "--run-dir", str(run_dir)])
        with pytest.raises(ConfigError, match=rf"--run-dir {run_dir}: cannot be made a directory"):
            run_up(load_config(args), args)
        assert _command(load_config(args), args) == 2


def _up_elsewhere(run_dir: Path, *flags: str) -> int:
    """A second ``refbus up`` given ``run_dir`` (and ``flags``), in this process, whose nodes would fail to start
    (none starts)."""
    args = build_parser().parse_args(["up", *EPHEMERAL_PORTS, "--run-dir", str(run_dir), *flags])
    return _command(load_config(args), args)


def test_a_run_dir_another_launcher_uses_is_refused_untouched_and_free_once_that_launcher_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, a second launcher given a run directory in use rewrote its cluster.toml (another run id) before
    anything failed: the first run's restarted nodes read it, and a durable env server restarted empty."""
    monkeypatch.setattr(LocalCluster, "start", _failing_start)  # the second launcher starts nothing
    up = Up(tmp_path, 200)
    try:
        up.started()  # its own config rewrites done: what changes now is the second launcher's doing
        config = (up.run_dir / "cluster.toml").read_bytes()
        assert _up_elsewhere(up.run_dir) == 2
        assert f"is in use by another refbus up (pid {up.proc.pid})" in capsys.readouterr().err
        assert (up.run_dir / "cluster.toml").read_bytes() == config and up.alive()

        up.proc.kill()  # the kernel drops the lock with the launcher
        up.proc.wait()
        assert _up_elsewhere(up.run_dir) == 1  # taken: its start failed, as the stand-in makes it
        assert "a node failed to start" in capsys.readouterr().out
    finally:
        up.close()


def test_a_lock_file_left_with_garbage_holds_nothing_and_one_that_cannot_be_used_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(LocalCluster, "start", _failing_start)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / up_module.RUN_DIR_LOCK).write_bytes(b"\xff not a pid \x00")
    assert _up_elsewhere(tmp_path / "garbage") == 1  # not refused: no process holds it
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / up_module.RUN_DIR_LOCK).symlink_to(tmp_path / "elsewhere")
    assert _up_elsewhere(tmp_path / "link") == 2
    assert "cannot use its lock file" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists()


HOLD_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()  # until the test closes it
"""


def test_a_run_dir_whose_dead_launchers_pid_a_live_process_has_now_is_taken_once_its_nodes_are_gone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the lock file named its launcher by pid alone: once the kernel gave a dead launcher's pid to an
    unrelated live process, a launcher given the run directory while the dead one's nodes still exited was refused
    at once, "in use by another refbus up". The lock names the launcher's start time too now: a live process with
    that pid that started at another time is not it, so its nodes are waited for and the run directory taken. Here
    the dead launcher's node is a real process holding the lock, and the live process with the launcher's pid is
    this one (the launcher started a clock tick before it). A bare pid, as older launchers wrote, still counts as
    the launcher while a process has that pid."""
    path = tmp_path / up_module.RUN_DIR_LOCK
    pid = os.getpid()
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: its start
    path.write_text(f"{pid} {started - 1}\n")
    node = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0)
    taken: list[str] = []
    try:
        assert read_line(node, START_S) == "held"
        waiting = threading.Thread(target=lambda: taken.append(_took(tmp_path)), daemon=True)
        waiting.start()
        said: list[str] = []

        def waits() -> bool:
            said.append(capsys.readouterr().out)
            return "waiting for them to exit" in "".join(said) or not waiting.is_alive()  # waiting, or refused

        wait_for(waits, START_S, "the launcher waiting for the dead launcher's node")
        assert f"(pid {pid}, gone) still hold --run-dir" in "".join(said), said
    finally:
        assert node.stdin is not None
        node.stdin.close()  # the node exits: the kernel drops the lock
        node.wait(START_S)
    waiting.join(START_S)
    assert taken == [f"{pid} {started}"], taken

    path.write_text(f"{pid}\n")  # an older launcher's lock, held
    with open(path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match=rf"is in use by another refbus up \(pid {pid}\)"):
            _took(tmp_path)


def _took(run_dir: Path) -> str:
    """Take ``run_dir`` as a launcher does (waiting for a dead launcher's nodes at most START_S): the lock file's
    stamp while held."""
    with up_module.hold_run_dir(run_dir, START_S):
        return (run_dir / up_module.RUN_DIR_LOCK).read_text().strip()


def test_a_node_holds_the_run_directory_lock_it_inherits_but_passes_it_to_no_process_it_execs(
        tmp_path: Path) -> None:
    """Before, the lock a node inherited stayed inheritable in it: a helper its user code started with
    ``close_fds=False`` (or ``os.system``, ``posix_spawn``) kept the run directory held after the run, and every
    later launcher on it waited, then was refused, naming nodes that were all gone. A real broker node here."""
    with up_module.hold_run_dir(tmp_path) as lock:
        node = NodeProcess(["node", "bus", *EPHEMERAL_PORTS[:6], "--bus-metrics-port", "0"], workdir=tmp_path,
                           name="bus", pass_fds=(lock,))
    with node, open(tmp_path / up_module.RUN_DIR_LOCK, "rb") as again:
        node.wait_ready(START_S)
        with pytest.raises(BlockingIOError):  # the node holds it, the launcher's descriptor closed
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
        flags = int(Path(f"/proc/{node.pid}/fdinfo/{lock}").read_text().split("flags:")[1].split()[0], 8)
        assert flags & os.O_CLOEXEC, f"the lock is inheritable in the node (flags {flags:o})"


def test_the_stores_start_after_every_slow_start_just_before_the_orchestrator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaunch's durable stores give the killed orchestrator ``node.restart_grace_s`` from their start to come
    back and claim what it held. Before, the env servers started before the trainer ranks (rendezvous, resume from
    checkpoints), the rollout workers (each one's torch import, one after the other) and version 0 of the weights:
    the orchestrator came up 6.5 s (idle) to 23.5 s (busy cores) after them, and with the grace over, what the
    stores kept was deleted ``holder-down-before`` instead of trained. Now nothing slow starts between the stores
    and the orchestrator. Stand-in starts record the order; no process runs."""
    started: list[str] = []

    def start(cluster: LocalCluster, name: str, *command: str, wait: bool = True) -> Any:
        started.append(name)
        return argparse.Namespace(name=name, info={"endpoints": {"ps": "tcp://127.0.0.1:1"}})

    monkeypatch.setattr(LocalCluster, "start", start)
    monkeypatch.setattr(LocalCluster, "wait_ready", lambda cluster, node, timeout: None)
    monkeypatch.setattr(up_module, "wait_first_version", lambda cluster, record, stop: started.append("version 0"))
    config = load_config(build_parser().parse_args(["up", "--up-env-servers", "2", "--up-rollouts", "2",
                                                    "--up-trainers", "2", "--up-ps-workers", "1"]))
    up_module._start_nodes(LocalCluster(config, tmp_path), config.up, RunRecord(), _StopFlag())

    assert started == ["ps-manager", "ps-worker-0", "trainer-0", "trainer-1", "rollout-0", "rollout-1", "version 0",
                       "env-0", "env-1", "orchestrator"]


def test_a_node_that_died_while_a_later_one_starts_is_named_at_once_not_the_one_waiting(tmp_path: Path) -> None:
    """Before, a trainer rank that died while its partner waited in their rendezvous went unnamed: the launcher
    waited out four connect timeouts and blamed the partner (``trainer-0 not ready``). Here the node waited on
    is an env server whose broker never answers (it gives up after its connect timeout)."""
    args = build_parser().parse_args(["up", "--bus-control", f"tcp://127.0.0.1:{free_port()}",
                                      "--node-connect-timeout-s", "2", "--node-metrics-port", "-1"])
    cluster = LocalCluster(load_config(args), tmp_path)
    try:
        dead = cluster.start("ps-worker-0", "node", "ps-worker", "--no-such-flag", wait=False)
        assert dead.proc.wait(START_S) == 2  # a usage error: it never starts
        with pytest.raises(NodeStartError, match=r"(?s)^ps-worker-0 exited with 2 while env-0 was starting:\n.*"
                                                 r"unrecognized arguments: --no-such-flag"):
            cluster.start("env-0", "node", "env-server")
        # The same while the trainers' version 0 is awaited: the node that died is named at once.
        with pytest.raises(NodeStartError, match=r"(?s)^ps-worker-0 exited with 2 while the trainers published "
                                                 r"version 0 of the weights:\n.*--no-such-flag"):
            wait_first_version(cluster, RunRecord(), _StopFlag())
    finally:
        cluster.stop_all()
