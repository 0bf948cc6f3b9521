"""The README's "Running for real" section, run as written on three namespace hosts (bench/hosts.py).

The cluster file is the README's ``toml`` block, the commands are the lines of its first ``sh`` block, each
run through ``bash -c`` inside the host its comment names (so ``$(hostname)`` is the host's own name), in
the README's order (the key commands first, to completion), from one directory, with ``refbus`` and
``torchrun`` on the PATH. Nothing here repeats a flag of those commands: when the README changes, this test
runs the new text.

Checked from the outside, as a user would: ``refbus monitor --json`` on hostA (as the README says) and
``refbus ledger`` on its output; Prometheus on hostA with the shipped scrape config pointed at the broker's
``/sd`` on hostA, scraping every node of hostB and hostC; the rollout workers' weight reads by path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for
from refbus.nodes.launch import NodeProcess
from test_observability import PROMETHEUS, prometheus

from bench import hosts

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the environment's scripts: refbus, torchrun
HOST_NAMES = ("hostA", "hostB", "hostC")
STOP_S = 30.0  # a node's shutdown: its deletes, each bounded by the default request retry schedule (14 s)


@dataclass(frozen=True)
class Group:
    """Command lines the README gives one comment: run on each of ``hosts``, in order."""

    hosts: tuple[str, ...]
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Recipe:
    cluster_toml: str
    groups: tuple[Group, ...]


def readme_recipe(text: str) -> Recipe:
    """The "Running for real" section's cluster file (its ``toml`` block) and per-host commands (its first
    ``sh`` block: a comment naming hosts, then their commands; ``\\`` continues a line)."""
    start = text.index("## Running for real")
    section = text[start:text.index("\n## ", start)]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    (toml,) = [body for lang, body in blocks if lang == "toml"]
    commands = next(body for lang, body in blocks if lang == "sh")
    groups: list[Group] = []
    for raw in commands.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if line.startswith("#"):
            groups.append(Group(tuple(re.findall(r"\bhost[A-Z]\b", line.split("(")[0])), ()))
        elif line:
            groups[-1] = Group(groups[-1].hosts, (*groups[-1].lines, line))
    return Recipe(toml, tuple(groups))


def test_the_readme_recipe_parses_into_the_hosts_it_names() -> None:
    recipe = readme_recipe(README.read_text())
    assert [g.hosts for g in recipe.groups] == [("hostA",), ("hostA",), ("hostB", "hostC"), ("hostB", "hostC"),
                                                ("hostA",)]
    assert [len(g.lines) for g in recipe.groups] == [6, 2, 3, 1, 1]
    assert all("refbus keys generate keys " in line for line in recipe.groups[0].lines)
    assert recipe.groups[1].lines[0].startswith("refbus node bus ")
    assert recipe.groups[3].lines[0].startswith("torchrun ")
    assert recipe.groups[4].lines[0].startswith("refbus node orchestrator ")
    settings = tomllib.loads(recipe.cluster_toml)
    assert settings["bus"]["control"] == "tcp://hostA:7770" and settings["node"]["metrics_host"] == "0.0.0.0"
    assert settings["security"]["curve_dir"] == "keys"


def events(path: Path) -> Iterator[dict[str, Any]]:
    """The monitor's records so far (a line still being written is left for the next read)."""
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def nodes_up(path: Path) -> set[tuple[str, str]]:
    """(role, host) of every node-up the monitor saw."""
    return {(r["node"]["role"], r["node"]["host"]) for r in events(path) if r.get("type") == "node-up"}


def nodes_left(path: Path) -> bool:
    """Whether every node that came up, but the broker and the monitor, has left."""
    records = list(events(path))
    up = {r["node"]["node_id"] for r in records if r.get("type") == "node-up"
          and r["node"]["role"] not in ("bus", "monitor")}
    return up <= {r["node_id"] for r in records if r.get("type") == "node-down"}


class Started:
    """The README's processes, each in its host, stopped with SIGTERM and reaped (the harness kills leftovers)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, host: hosts.Host, line: str) -> subprocess.Popen[bytes]:
        name = f"{host.name}-{len(self.procs)}-{line.split()[2] if line.startswith('refbus') else line.split()[0]}"
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = host.popen(["bash", "-c", line], cwd=self.workdir, env=self.env, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, proc))
        return proc

    def tail(self, name: str, lines: int = 25) -> str:
        text = (self.workdir / f"{name}.log").read_text(errors="replace")
        return f"--- {name}\n" + "\n".join(text.splitlines()[-lines:])

    def tails(self) -> str:
        return "\n".join(self.tail(name) for name, _ in self.procs)

    def stop(self, name: str) -> int:
        proc = dict(self.procs)[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def named(self, role: str) -> list[str]:
        return [name for name, _ in self.procs if name.endswith(f"-{role}")]


def _get(host: hosts.Host, url: str) -> bytes | None:
    """``url`` fetched from inside ``host`` (Prometheus listens on that host's loopback), None if no answer."""
    result = host.run([sys.executable, "-c", "import sys, urllib.request; "
                       "sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=5).read())", url],
                      timeout=30)
    return result.stdout.encode() if result.returncode == 0 else None


def _query(host: hosts.Host, api: str, expr: str) -> list[dict[str, Any]]:
    from urllib.parse import urlencode

    body = _get(host, f"{api}/api/v1/query?{urlencode({'query': expr})}")
    assert body is not None, f"prometheus did not answer {expr!r}"
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.timeout(400)  # every wait below is bounded and fails with the logs before this
def test_the_readme_per_host_commands_run_as_written_and_train(make_hosts, tmp_path: Path) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; `make test` installs it)")
    recipe = readme_recipe(README.read_text())
    settings = tomllib.loads(recipe.cluster_toml)
    steps = settings["trainer"]["steps"]
    cluster = make_hosts(3, names=HOST_NAMES)
    a = cluster["hostA"]
    (tmp_path / "cluster.toml").write_text(recipe.cluster_toml)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = Started(tmp_path, env)
    keys, control, data, trainers, orchestrator = recipe.groups
    monitor: NodeProcess | None = None
    record = tmp_path / "events"
    try:
        for line in keys.lines:
            assert run.start(a, line).wait(60) == 0, run.tails()
        run.start(a, control.lines[0])  # the broker
        # The README's watcher, before the run: every blob's story is in its output. It runs from the test's
        # directory, so the key directory is named in full.
        with open(record, "wb") as out:
            monitor = NodeProcess(["monitor", "--config", str(tmp_path / "cluster.toml"), "--node-id", "monitor",
                                   "--security-curve-dir", str(tmp_path / "keys"), "--json"], workdir=tmp_path,
                                  name="monitor", stdout=out, prefix=a.argv(()))
        monitor.wait_ready(60)
        with prometheus(PROMETHEUS, tmp_path, "http://hostA:7779/sd", prefix=a.argv(()),
                        fetch=lambda url: _get(a, url)) as api:
            for line in control.lines[1:]:
                run.start(a, line)
            expected = {("ps-manager", "hostA")}
            wait_for(lambda: expected <= nodes_up(record), 60, f"{expected} up\n{run.tails()}")
            for host in data.hosts:
                for line in data.lines:
                    run.start(cluster[host], line)
            expected |= {(role, host) for role in ("ps-worker", "env-server", "rollout") for host in data.hosts}
            wait_for(lambda: expected <= nodes_up(record), 60, f"{expected} up\n{run.tails()}")
            ranks = [run.start(cluster[host], line) for host in trainers.hosts for line in trainers.lines]
            # Every node of hostB and hostC is scraped through the broker's /sd on hostA; the ranks wait for
            # their first step batch meanwhile (the orchestrator is not there yet), so they are all there.
            wanted = {(role, host) for role in ("ps-worker", "env-server", "rollout", "trainer")
                      for host in ("hostB", "hostC")}

            def scraped() -> bool:
                assert all(r.poll() is None for r in ranks), run.tails()
                return wanted <= {(s["metric"]["role"], s["metric"]["instance"].split(":")[0])
                                  for s in _query(a, api, "up == 1")}

            wait_for(scraped, 60, f"prometheus scraping {sorted(wanted)}", poll_s=0.5)
            for line in orchestrator.lines:
                run.start(a, line)
            wait_for(lambda: all(r.poll() is not None for r in ranks), 300, f"the ranks' {steps} steps\n{run.tails()}")
            assert [r.returncode for r in ranks] == [0] * len(ranks), run.tails()
            bumps = [r["version"] for r in events(record) if r.get("type") == "version-bump"]
            assert max(bumps) == steps, bumps  # version 0, then one per step
            # ps.replicas 2 puts a copy of every shard on each host's ps-worker: each rollout worker mapped
            # every tensor from its own host's copy, none came as frames.
            reads = {(s["metric"]["instance"].split(":")[0], s["metric"]["path"]): float(s["value"][1])
                     for s in _query(a, api, "refbus_rollout_weights_read_bytes_total")}
            for host in ("hostB", "hostC"):
                assert reads.get((host, "shm"), 0) > 0 and reads.get((host, "frames"), 0) == 0, reads

        orchestrator_log = (tmp_path / f"{run.named('orchestrator')[0]}.log").read_text()
        # It waited for version 0 instead of failing runs, and shipped no step past the ranks' budget.
        for event in ('"run.failed"', '"step.redeliver"', '"step.undeliverable"'):
            assert event not in orchestrator_log, run.tail(run.named("orchestrator")[0])
        assert f'"max_steps": {steps}' in orchestrator_log, run.tail(run.named("orchestrator")[0])
        # Shut down as the README says: the orchestrator first, the broker last.
        for role in ("orchestrator", "rollout", "env-server", "ps-worker", "ps-manager"):
            for name in run.named(role):
                assert run.stop(name) == 0, run.tail(name)
        wait_for(lambda: nodes_left(record), 30, f"every node's goodbye seen\n{run.tails()}")
        assert monitor.stop() == 0, monitor.log_tail()
        assert run.stop(run.named("bus")[0]) == 0, run.tail(run.named("bus")[0])
    finally:
        if monitor is not None:
            monitor.stop()
        for name, _ in run.procs:
            run.stop(name)

    ledger = subprocess.run([str(BIN / "refbus"), "ledger", str(record), "--json"], capture_output=True, text=True,
                            timeout=60, env=env, check=False)
    assert ledger.returncode == 0, ledger.stdout + ledger.stderr
    total = json.loads(ledger.stdout)["total"]
    assert total["kept"] > 0 and total["deleted_total"] == total["kept"], total
    assert (total["leaked"], total["held"], total["violations"]) == (0, 0, 0), total
    assert total["deleted"].get("trained", 0) > 0, total
