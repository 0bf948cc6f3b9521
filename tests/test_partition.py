"""A network partition on namespace hosts (bench/hosts.py): hostC's link is cut mid-run and restored.

hostA runs the broker, the ps-manager, the orchestrator and the event recorder (`refbus monitor --json`);
hostB an env server, a rollout worker, the ps-worker and the trainer rank (a world of one: gloo cannot survive
a partition, so no rank is on the host that gets cut); hostC an env server, a rollout worker and a holder
(tests/partition_holder.py) that claimed blobs kept on hostB's env server. tests/partition_entry_points.py
makes the moment of the cut certain: hostC's env server holds its groups open on request (at the cut the
orchestrator holds hostC blobs in groups that cannot complete, and runs are in flight there), the cut waits
until the trainer rank holds none of hostC's blobs, and the rank trains at most two steps while hostC is
away, the rest after it is back.

While cut (the bridge port of hostC down, as a switch port that fails): hostC's nodes are declared down; the
runs in flight there fail and new ones go to hostB, and steps go on; after ``node.restart_grace_s`` the
orchestrator declares the blobs it held on hostC's env server ``lost`` naming it, and hostB's env server
reclaims the holder's blobs (``holder-down``) naming the holder. Restored, the same processes join again:
the holder's stale claim and delete are answered ``reclaimed`` (no violation), the orchestrator deletes on
hostC's env server what it declared lost there (reason ``lost``, counted once by the ledger), and hostC's
episodes are trained again. The run completes its steps with 0 violations and exact accounting, nothing
held at the end, every process reaped, every namespace removed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for
from refbus.bus.reqrep import RetryPolicy
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ledger import Ledger
from test_readme_hosts import events

from bench import hosts

TESTS = Path(__file__).parent
HOLDER = str(TESTS / "partition_holder.py")
BIN = Path(sys.executable).parent
HOST_NAMES = ("hostA", "hostB", "hostC")
STEPS = 24
HEARTBEAT_S, NODE_TIMEOUT_S, GRACE_S = 0.2, 1.0, 2.0
# Requests retry for 1 + 2 + 4 + 4 + 4 = 15 s, longer than the cut (LIVENESS_S below bounds it).
REQUESTS = {"timeout_s": 1.0, "attempts": 5, "backoff": 2.0, "max_timeout_s": 4.0}
SCHEDULE_S = RetryPolicy(**REQUESTS).deadline_s  # type: ignore[arg-type]
START_S = 60.0  # a node ready (torch imports on two busy cores)
RUN_S = 120.0  # steps of the toy loop
LIVENESS_S = 6 * (NODE_TIMEOUT_S + GRACE_S)  # a loss decided and published after the cut
REJOIN_S = LIVENESS_S + SCHEDULE_S  # back after the restore: TCP retransmits, the broker's unknown-node, hello
STOP_S = 15.0

pytestmark = pytest.mark.timeout(START_S * 3 + RUN_S + 2 * LIVENESS_S + REJOIN_S + 4 * STOP_S)

CLUSTER_TOML = """\
[bus]
control = "tcp://hostA:7770"
heartbeat_interval_s = {heartbeat}
node_timeout_s = {node_timeout}
[node]
restart_grace_s = {grace}
[security]
insecure = true  # wildcard binds without signing or CURVE: this test is about partitions, not security
[requests]
timeout_s = {timeout_s}
attempts = {attempts}
backoff = {backoff}
max_timeout_s = {max_timeout_s}
[ps]
manager = "tcp://hostA:7780"
worker = "tcp://0.0.0.0:0"
[env_server]
endpoint = "tcp://0.0.0.0:0"
handover_lease_s = 25.0
[rollout]
endpoint = "tcp://0.0.0.0:0"
[trainer]
endpoint = "tcp://0.0.0.0:0"
steps = {steps}
rank = 0
world_size = 1
init_method = "file://{rendezvous}"
[orchestrator]
dispatch = true
trainers = 1
group_size = 2
groups_per_step = 1
max_staleness = 2
seq_len = 16
"""


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines written so far (a line still being written is left for the next read)."""
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def _records(path: Path, kind: str, **fields: Any) -> list[dict[str, Any]]:
    return [r for r in events(path) if r.get("type") == kind and all(r.get(k) == v for k, v in fields.items())]


def _downs(path: Path, nodes: set[str], after: int = 0) -> set[str]:
    return {r["node_id"] for r in list(events(path))[after:] if r.get("type") == "node-down"} & nodes


def _ups(path: Path, nodes: set[str], after: int) -> set[str]:
    return {r["node"]["node_id"] for r in list(events(path))[after:] if r.get("type") == "node-up"} & nodes


def _version(path: Path) -> int:
    return max((r["version"] for r in _records(path, "version-bump")), default=-1)


def _frozen_group_held(path: Path, hold_log: Path) -> bool:
    """A score held on hostC whose group's first episode, kept there, the orchestrator claimed: that group cannot
    complete (its other run waits on hostC), so the orchestrator holds the blob until the cut."""
    if not hold_log.exists():
        return False
    held = [entry["held"] for entry in _lines(hold_log)]
    records = list(events(path))
    claimed = {b for r in records if r.get("type") == "claim" and r["holder"] == "orchestrator" for b in r["blob_ids"]}
    return any(r["info"]["samples"][0]["input_ids"][:len(prompt)] == prompt and r["refs"][0]["blob_id"] in claimed
               for r in records if r.get("type") == "episode-finished" and r["src"] == "env-C" for prompt in held)


def _trainer_done_with_env_c(path: Path) -> bool:
    """No blob of hostC is with the trainer rank or in a complete group: all were trained or dropped. Under the
    hold no group there completes any more, so from now on the trainer never asks hostC for anything (a fetch
    or delete to a store that is cut off would end only at its deadline, costing the run steps)."""
    records = list(events(path))
    ledger = Ledger()
    for record in records:
        ledger.apply(record)
    groups: dict[str, list[str]] = {}
    for r in records:
        if r.get("type") == "episode-finished" and r["src"] == "env-C":
            groups.setdefault(r["info"]["group"], []).extend(ref["blob_id"] for ref in r["refs"])
    complete = {blob_id for ids in groups.values() if len(ids) > 1 for blob_id in ids}
    return not any(blob.store == "env-C" and (blob.owner == "trainer-0" or blob_id in complete)
                   for blob_id, blob in ledger.blobs.items())


def _write(path: Path, value: int) -> None:
    """``value`` in ``path``, whole at once (a reader never sees half of it)."""
    part = path.with_suffix(".part")
    part.write_text(str(value))
    part.replace(path)


def _stop(procs: list[NodeProcess]) -> None:
    """SIGTERM to all at once (once: a second one could end a node that has closed but not yet exited), then
    each must exit 0 within its shutdown timeout."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        try:
            code = proc.proc.wait(STOP_S)
        finally:
            proc.stop()
        assert code == 0, f"{proc.name} exited with {code}:\n{proc.log_path.read_text()[-3000:]}"


def test_a_host_cut_off_mid_run_loses_what_it_kept_and_its_stale_requests_are_refused(
        make_hosts, spawn, tmp_path: Path) -> None:
    cluster = make_hosts(3, names=HOST_NAMES)
    a, b, c = (cluster[name] for name in HOST_NAMES)
    config = tmp_path / "cluster.toml"
    config.write_text(CLUSTER_TOML.format(heartbeat=HEARTBEAT_S, node_timeout=NODE_TIMEOUT_S, grace=GRACE_S,
                                          steps=STEPS, rendezvous=tmp_path / "gloo", **REQUESTS))
    record, hold, hold_log, limit = tmp_path / "events", tmp_path / "hold", tmp_path / "hold.log", tmp_path / "steps"
    hold_env = {"PYTHONPATH": str(TESTS), "REFBUS_TEST_HOLD": str(hold), "REFBUS_TEST_HOLD_LOG": str(hold_log)}

    started: list[NodeProcess] = []

    def node(host: hosts.Host, name: str, *command: str, wait: bool = True, **kwargs: Any) -> NodeProcess:
        proc: NodeProcess = spawn(["node", *command, "--config", str(config), "--node-id", name], name,
                                  prefix=host.argv(()), **kwargs)
        started.append(proc)
        if wait:
            proc.wait_ready(START_S)
        return proc

    bus = node(a, "bus", "bus", "--bus-control", "tcp://0.0.0.0:7770", "--bus-events-in", "tcp://0.0.0.0:7771",
               "--bus-events-out", "tcp://0.0.0.0:7772")
    with open(record, "wb") as out:
        # From the ring's start: the broker's events before the subscription went live are in the record too.
        monitor: NodeProcess = spawn(["monitor", "--config", str(config), "--json", "--since", "1"], "monitor",
                                     stdout=out, prefix=a.argv(()))
    monitor.wait_ready(START_S)
    node(a, "ps-manager", "ps-manager", "--ps-manager", "tcp://0.0.0.0:7780")
    stores = [node(b, "ps-worker", "ps-worker", wait=False), node(b, "env-B", "env-server", wait=False),
              node(c, "env-C", "env-server", "--env-server-score", "partition_entry_points:score", env=hold_env,
                   wait=False)]
    for proc in stores:
        proc.wait_ready(START_S)
    _, env_b, env_c = stores
    with open(tmp_path / "holder.out", "wb") as out, open(tmp_path / "holder.log", "wb") as err:
        holder = c.popen([sys.executable, HOLDER, "tcp://hostA:7770", "holder-C", env_b.info["endpoints"]["blobs"]],
                         stdout=out, stderr=err, env={"PYTHONPATH": str(TESTS)})

    def holder_said() -> list[dict[str, Any]]:
        assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]
        return list(_lines(tmp_path / "holder.out"))

    held = wait_for(holder_said, START_S, "the holder on hostC claimed its blobs on hostB")[0]["held"]
    # torch imports in parallel: the trainer rank and the rollout workers
    slow = [node(b, "trainer-0", "trainer", "--rl-train-step", "partition_entry_points:train_step", wait=False,
                 env={"PYTHONPATH": str(TESTS), "REFBUS_TEST_STEPS": str(limit)}),
            node(b, "rollout-B", "rollout", wait=False),
            node(c, "rollout-C", "rollout", wait=False)]
    for proc in slow:
        proc.wait_ready(START_S)
    trainer = slow[0]
    orchestrator = node(a, "orchestrator", "orchestrator", "--orchestrator-prompt",
                        "partition_entry_points:make_prompt", env={"PYTHONPATH": str(TESTS)})

    def alive() -> None:
        for proc in (bus, monitor, env_b, env_c, orchestrator):
            assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.log_tail()}"

    def running(condition: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: alive() or condition()

    wait_for(running(lambda: _version(record) >= 2), RUN_S, "two steps trained")
    hold.touch()
    wait_for(running(lambda: _frozen_group_held(record, hold_log)), RUN_S / 2,
             "the orchestrator holding a hostC blob of a group that cannot complete")
    wait_for(running(lambda: _trainer_done_with_env_c(record)), RUN_S / 2, "the trainer done with hostC's blobs")

    cut_at = len(list(events(record)))
    version_at_cut = _version(record)
    # At most a few steps while cut off (hostB's groups alone would train the rest at once): most come after.
    _write(limit, version_at_cut + 2)
    c.link(up=False)
    on_c = {"env-C", "rollout-C", "holder-C"}
    wait_for(running(lambda: _downs(record, on_c, cut_at) == on_c), LIVENESS_S, "hostC's nodes declared down")
    wait_for(running(lambda: _records(record, "delete", reason="lost", node="env-C", src="orchestrator")),
             LIVENESS_S, "the orchestrator declaring its blobs on env-C lost")
    wait_for(running(lambda: _records(record, "delete", reason="holder-down", node="holder-C")), LIVENESS_S,
             "env-B reclaiming the holder's blobs")
    wait_for(running(lambda: _version(record) > version_at_cut), RUN_S / 2, "a step trained while hostC is cut off")
    assert env_c.proc.poll() is None and holder.poll() is None  # cut off, not dead

    restored_at = len(list(events(record)))
    hold.unlink()
    c.link(up=True)
    wait_for(running(lambda: _ups(record, on_c, restored_at) == on_c), REJOIN_S, "hostC's nodes back")
    stale = wait_for(lambda: holder_said()[1:], REJOIN_S, "the holder's stale claim and delete answered")[0]
    assert stale["claim"] == {"reply": "claimed", "blob_ids": [], "reclaimed": held}, stale
    assert stale["delete"] == {"reply": "deleted", "blob_ids": [], "reclaimed": held}, stale
    lost_ids = {i for r in _records(record, "delete", reason="lost", src="orchestrator") for i in r["blob_ids"]}
    wait_for(running(lambda: {i for r in _records(record, "delete", reason="lost", src="env-C")
                              for i in r["blob_ids"]} == lost_ids), REJOIN_S,
             "env-C deleting what the orchestrator declared lost there, once it is back")

    limit.unlink()
    # hostC is in the run again: groups run there after it came back are trained, unless the trainer's steps
    # were all done first (a loaded machine can let hostB alone finish them while the link comes back).
    wait_for(running(lambda: trainer.proc.poll() is not None or any(
        r.get("type") == "delete" and r["reason"] == "trained" and r["src"] == "env-C"
        for r in list(events(record))[restored_at:])), RUN_S, "hostC's episodes trained again, or the run done")
    assert trainer.proc.wait(RUN_S) == 0, trainer.log_tail()
    assert _version(record) == STEPS
    orchestrator_log = orchestrator.log_path.read_text()
    assert '"run.failed"' in orchestrator_log and "env-C reported down" in orchestrator_log, orchestrator.log_tail()
    # Stopped as the launcher does: holders first, then the rollout workers, the stores, the PS, the broker last.
    _stop([orchestrator])
    holder.terminate()
    _stop([p for p in started if p.name.startswith("rollout")])
    assert holder.wait(STOP_S) == 0, (tmp_path / "holder.log").read_text()[-3000:]
    # The holders are gone: every blob still kept is its store's own (nothing held by a holder).
    ledger = Ledger()
    for entry in events(record):
        ledger.apply(entry)
    assert all(blob.owner in ("env-B", "env-C") for blob in ledger.blobs.values()), ledger.blobs
    _stop([env_b, env_c])
    _stop([p for p in started if p.name.startswith("ps-")])
    _stop([monitor])
    _stop([bus])

    assert not _records(record, "violation")
    report = subprocess.run([str(BIN / "refbus"), "ledger", str(record), "--json"], capture_output=True, text=True,
                            timeout=60, check=False)
    summary = json.loads(report.stdout)
    total = summary["total"]
    assert total["kept"] == total["deleted_total"] + total["held"] + total["lost"], summary
    assert (total["held"], total["leaked"], total["violations"], total["unaccounted"]) == (0, 0, 0, 0), summary
    assert summary["lost"] == {"env-C": len(lost_ids), "holder-C": len(held)}, summary
    assert lost_ids and report.returncode == 1  # not ok: blobs were lost, and each is named
    print(f"partition: lost {len(lost_ids)} on env-C, reclaimed {len(held)} from holder-C; {total}")

    cluster.down()
    assert hosts.leftovers(cluster.name) == []
    assert all(proc.proc.poll() is not None for proc in [*started, monitor]) and holder.poll() is not None
