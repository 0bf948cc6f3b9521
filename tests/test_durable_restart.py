"""Stores that survive their process, end to end under `refbus up`: an env server holding blobs, a ps-worker
holding shards and the ps-manager, killed with SIGKILL together, are restarted under their node ids and
re-adopt their durable stores (the manager replays its journal of versions; the live worker registers with it
again); the run loses no blob, no micro batch (trainer fetches and deletes wait for the restart; the ledger
is exact, no violation, nothing held by a rank at the end) and no version; the store directories are gone
once the run ends."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
import zmq
from branches import random_arrays
from polling import holds_for, read_line, wait_for
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket, recv_frames
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ledger import Ledger
from refbus.nodes.payload import env_server as env_server_module
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.keeper import KeepError
from refbus.nodes.payload.orchestrator import Orchestrator
from refbus.nodes.payload.orchestrator_core import Deadlines, Halt
from refbus.nodes.settings import EnvServerSettings, OrchestratorSettings, StoreSettings
from refbus.nodes.store import journal
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    THIRD_PARTY_HAND_OVER,
    Body,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Discard,
    EpisodeFinished,
    Error,
    Held,
    HoldingsQuery,
    Keep,
    Kept,
    NodeDown,
    Ok,
    Reference,
    StepBatch,
)
from structlog.testing import capture_logs
from test_liveness import RANK_LABELS, Rank
from test_supervise import QUICK
from test_up import RUN_S, START_S, STOP_S, Up, check_accounted, log_events
from test_violations import accounted

pytestmark = pytest.mark.timeout(RUN_S + 2 * STOP_S)
WAIT_S = 30.0
NODE_TIMEOUT_S = 10.0  # a broker's, where a killed store must be judged by its restart's registration, not by it
STALLER = Path(__file__).with_name("stalled_env_server.py")
HALF_GROUP = OrchestratorSettings(dispatch=False, trainers=1, group_size=2, groups_per_step=1, seq_len=64)


def segments(shm: Path, node: str) -> int:
    return sum(1 for _ in shm.glob(f"refbus-store.*.{node}/seg-*"))


def shard_files(shm: Path, node: str) -> int:
    own = {"lock", "id", "journal"}
    return sum(1 for p in shm.glob(f"refbus-store.*.{node}/*") if p.name not in own)


def _client(ctx: zmq.Context, endpoint: str, name: str = "tester") -> Client:
    """A client of a store's ``blobs`` endpoint, one attempt per request."""
    return Client(ctx, endpoint, WireCodec(name), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))


def _node(control: str, node_id: str, role: str = "trainer") -> NodeRuntime:
    """An in-process node registered on the bus at ``control`` (a holder, or its restarted process)."""
    return NodeRuntime(role, RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1))


def _restarted(spawn, command: list[str], name: str, ctx: zmq.Context) -> tuple[NodeProcess, Client]:
    """A killed env server started again (``command``) under ``name``, ready, and a client of it."""
    restarted = spawn(command, name)
    return restarted, _client(ctx, restarted.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"], "probe")


def _store_with_grace(spawn, control: str, tmp_path: Path, node_id: str,
                      grace_s: float) -> tuple[list[str], NodeProcess, str]:
    """A durable env server ``node_id`` giving holders ``grace_s`` of restart grace (hand-over lease long
    enough never to end in a test): its command (to start it again), its process and its blobs endpoint."""
    command = ["node", "env-server", "--bus-control", control, "--node-id", node_id, "--store-directory",
               str(tmp_path / "shm"), "--store-run", node_id, "--node-restart-grace-s", str(grace_s),
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, node_id)
    return command, first, first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]


def _two_claimed(client: Client, holder: str, seed: int) -> list[str]:
    """Keep an episode of two blobs and claim both for ``holder``; their ids."""
    kept = client.request(Keep(episode_id="ep", branches=[random_arrays(6, seed=seed)] * 2)).body
    assert isinstance(kept, Kept)
    ids = [r.blob_id for r in kept.refs]
    assert client.request(Claim(blob_ids=ids, holder=holder)).body == Claimed(blob_ids=ids)
    return ids


def test_killed_env_server_ps_worker_and_ps_manager_come_back_from_their_stores_and_nothing_is_lost(
        tmp_path: Path) -> None:
    steps = 5
    shm = tmp_path / "shm"
    up = Up(tmp_path, steps, *QUICK, "--store-directory", str(shm))
    try:
        wait_for(lambda: up.alive() and "step   1/" in up.output(), START_S + RUN_S / 4, "step 1", poll_s=0.1)
        wait_for(lambda: up.alive() and segments(shm, "env-1") > 0 and shard_files(shm, "ps-worker-1") > 0,
                 RUN_S / 4, "env-1 holding blobs and ps-worker-1 shards", poll_s=0.02)
        pids = up.note_pids()
        victims = {name: pids[name] for name in ("env-1", "ps-worker-1", "ps-manager")}
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        code = up.wait(RUN_S)
        summary = up.summary()
        output = up.output(None)
        assert summary["steps"] == steps and summary["failed_nodes"] == [], (output, summary["accounting"])
        deaths = {d["node"]: d for d in summary["deaths"]}
        for name, pid in victims.items():
            assert (deaths[name]["pid"], deaths[name]["exit"], deaths[name]["restarted"]) == (pid, "SIGKILL", True)
        # A push granted to the ps-worker just before it was killed, or in flight when the manager was, fails its
        # rank: that may cost a world restart from the checkpoint (what the ranks held is reclaimed, named with
        # them), never a store's blob.
        others = set(deaths) - set(victims)
        assert others <= {"trainer-0", "trainer-1"} and len(summary["world_restarts"]) == (1 if others else 0), output
        blobs_back = log_events(up.run_dir / "env-1.log", "store.readopted")
        assert len(blobs_back) == 1 and blobs_back[0]["blobs"] > 0 and blobs_back[0]["lost"] == 0, blobs_back
        shards_back = log_events(up.run_dir / "ps-worker-1.log", "store.readopted")
        assert len(shards_back) == 1 and shards_back[0]["shards"] > 0 and shards_back[0]["lost"] == 0, shards_back
        assert not log_events(up.run_dir / "ps-manager.log", "ps.versions_lost_on_worker"), "a version was lost"
        recovered = log_events(up.run_dir / "ps-manager.log", "ps.manager_recovered")
        assert len(recovered) == 1 and recovered[0]["versions"], recovered
        assert log_events(up.run_dir / "ps-worker-0.log", "ps.manager_restarted"), "ps-worker-0 never re-registered"
        # Never a store's loss; a restarted world's ranks all lose what they held.
        blobs = check_accounted(summary, {"trainer-0", "trainer-1"} if others else set())
        if not others:
            assert blobs["lost"] == 0 and summary["dropped_micro_batches"] == 0, output  # fetches waited
            # The launcher's live fold agrees with the stores' own counters, and no rank held a blob at the end:
            # deletes that failed against the killed store were sent to its restarted process. Only the killed
            # store may have corrected the fold: an event its process had not yet published when it was killed
            # (an episode-finished of a keep it had committed) died with it, and its counters go on.
            accounting = summary["accounting"]
            assert accounting["reconciled"]["env-0"] == "agreed", (output, accounting)
            assert accounting["reconciled"]["env-1"] == "agreed" or \
                accounting["reconciled"]["env-1"].startswith("corrected"), (output, accounting)
            assert accounting["held_at_end"] == {} and code == 0 and summary["ok"], (output, accounting)
        print(f"env-1 re-adopted {blobs_back[0]['blobs']} blobs ({blobs_back[0]['bytes']} bytes) in "
              f"{blobs_back[0]['seconds']:.4f}s, aborted {blobs_back[0]['aborted']}; ps-worker-1 re-adopted "
              f"{shards_back[0]['shards']} shards of versions {shards_back[0]['versions']} in "
              f"{shards_back[0]['seconds']:.4f}s")
        assert not list(shm.glob("refbus-store.*")), "store directories left after the run"
        assert up.leftovers() == []
    finally:
        up.close()


def _keep_half_a_group(ctx: zmq.Context, endpoint: str, seed: int) -> None:
    """Keep episode ``ep`` of two blobs at ``endpoint``, the first of group ``g``'s two: its group waits, so an
    orchestrator that claims them holds both."""
    producer = Client(ctx, endpoint, WireCodec("producer"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
    arrays = random_arrays(6, seed=seed)
    samples = [{"input_ids": list(range(6)), "ref": i} for i in range(2)]
    kept = producer.request(Keep(episode_id="ep", branches=[arrays, arrays],
                                 info={"group": "g", "reward": 1.0, "samples": samples})).body
    producer.close()
    assert isinstance(kept, Kept)


def test_a_claim_that_failed_against_a_killed_store_is_granted_by_its_restarted_process(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """The orchestrator claims an episode's blobs while their durable store is reported down (the claim fails
    at once), the store is SIGKILLed and restarted under its node id on another port: the claim waits for the
    new process and is granted there; no blob counts as missing (before, the claim failed for good, the
    episode lost those samples and its blobs expired unclaimed)."""
    control = bus[1]
    orchestrator_runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator",
                                                                       metrics_port=-1))
    orchestrator = Orchestrator(orchestrator_runtime, OrchestratorSettings(), Deadlines(restart_grace_s=WAIT_S))
    orchestrator_runtime.start_background()  # before the store: its start-up recovery finds no store
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-d", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "claims", "--env-server-budget-bytes", str(64 << 20),
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, "env-d")
    endpoint = first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    peers = orchestrator_runtime.track_peers()
    ctx = zmq.Context()
    try:
        wait_for(lambda: "env-d" in peers.live, WAIT_S, "the orchestrator knowing env-d")
        reported = threading.Event()
        orchestrator_runtime.call_soon(lambda: (orchestrator_runtime.calls.mark_down(endpoint, "env-d reported down"),
                                                reported.set()))
        assert reported.wait(WAIT_S)
        _keep_half_a_group(ctx, endpoint, seed=1)
        # The keep's answer can precede its episode-finished event: killed in between, the store re-adopts an
        # episode nobody heard of (see docs/STORE.md). This test is about the claim, so the event goes first.
        _killed_once_its_event_is_in_the_ring(control, "env-d", first)
        restarted = spawn(command, "env-d-restarted").wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
        wait_for(lambda: orchestrator.claimed + orchestrator.missing == 2, WAIT_S, "the claim's outcome")
        assert (orchestrator.claimed, orchestrator.missing) == (2, 0)
        probe = _client(ctx, restarted, "probe")
        account = accounted(probe)
        probe.close()
        assert account.held_by == {"orchestrator": 2}, account
    finally:
        orchestrator_runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _killed_once_its_event_is_in_the_ring(control: str, node_id: str, store: NodeProcess) -> None:
    """SIGKILL ``store`` once its ``episode-finished`` is in the broker's ring: the event left before it died."""
    asker = NodeRuntime("asker", RuntimeSettings(bus=control, node_id="asker", metrics_port=-1), register=False)
    try:
        wait_for(lambda: any(m.kind == EpisodeFinished.kind for m in asker.replay(src=node_id)), WAIT_S,
                 f"{node_id}'s episode-finished in the broker's ring")
    finally:
        asker.close()
    store.proc.kill()
    assert store.proc.wait(timeout=WAIT_S) == -signal.SIGKILL


def test_a_claim_whose_grace_ends_as_its_restarted_store_registers_is_sent_again_there_and_granted(
        spawn, tmp_path: Path) -> None:
    """The orchestrator's claim of an episode is in flight to its durable store, SIGKILLed as the event left; the
    store's restarted process registers only after the claim's grace (``node.restart_grace_s``) has ended, under
    a broker whose node timeout had not yet judged the dead one, so the claim ends then (its store replaced), as
    the store comes back and re-announces the episode (``again``: dropped, its first event still waiting). The
    claim is sent again to the restarted process and granted: nothing missing, nothing claimed twice. Before, the
    claim gave up, the episode went on without its samples, and its blobs were deleted ``claim-failed`` or left to
    expire unclaimed."""
    grace_s = 1.0
    bus = spawn(["node", "bus", "--bus-control", "tcp://127.0.0.1:0", "--bus-events-in", "tcp://127.0.0.1:0",
                 "--bus-events-out", "tcp://127.0.0.1:0", "--bus-metrics-port", "0", "--bus-heartbeat-interval-s",
                 "0.2", "--bus-node-timeout-s", str(NODE_TIMEOUT_S)], "bus")
    control = bus.wait_ready(timeout=WAIT_S)["endpoints"]["control"]
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-g", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "edge", "--env-server-budget-bytes", str(64 << 20),
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, "env-g")
    endpoint = first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator", metrics_port=-1,
                                                          retry=RetryPolicy(timeout_s=WAIT_S, attempts=1)))
    orchestrator = Orchestrator(runtime, HALF_GROUP, Deadlines(restart_grace_s=grace_s))
    arrivals, blocked, release = orchestrator._arrivals, threading.Event(), threading.Event()
    ctx = zmq.Context()
    runtime.start_background()
    try:
        wait_for(lambda: "env-g" in orchestrator._peers.live and not arrivals, WAIT_S, "the orchestrator up")
        runtime.call_soon(lambda: (blocked.set(), release.wait(WAIT_S)))  # its loop held: the event waits
        assert blocked.wait(WAIT_S)
        _keep_half_a_group(ctx, endpoint, seed=5)
        _killed_once_its_event_is_in_the_ring(control, "env-g", first)
        release.set()
        wait_for(lambda: arrivals and arrivals[-1].claims_pending, WAIT_S, "the claim sent to the dead store")
        holds_for(lambda: arrivals and arrivals[-1].claims_pending, grace_s, "the claim in flight")
        _, probe = _restarted(spawn, command, "env-g-restarted", ctx)
        core = orchestrator.core
        wait_for(lambda: core.episodes, WAIT_S, "the episode fed")
        assert (orchestrator.claimed, orchestrator.missing, core.sink.dropped["missing"]) == (2, 0, 0)
        account = accounted(probe)
        probe.close()
        assert (account.held_by, dict(account.deleted)) == ({"orchestrator": 2}, {}), account
    finally:
        release.set()
        runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_an_episode_whose_event_died_with_its_store_is_announced_again_by_the_restarted_process_and_trained(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """An episode kept (the keep answered) by a durable store SIGKILLed before any orchestrator heard of it: the
    restarted process publishes its ``episode-finished`` again (``again``), and the orchestrator, up since
    before the restart, claims and groups it. Before, the restart announced claims only: the episode was never
    claimed, trained or dropped, and expired unclaimed after the hand-over lease."""
    control = bus[1]
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-e", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "again", "--env-server-budget-bytes", str(64 << 20),
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, "env-e")
    endpoint = first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    watcher = _node(control, "watcher", role="watcher")
    peers = watcher.track_peers()
    watcher.start_background()
    ctx = zmq.Context()
    orchestrator_runtime = None
    try:
        _keep_half_a_group(ctx, endpoint, seed=3)
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        wait_for(lambda: "env-e" not in peers.live, WAIT_S, "the broker reporting env-e down")
        # Up after the keep's event (whether or not it left) and with no store to recover from: only the restarted
        # store can tell it of the episode.
        orchestrator_runtime = NodeRuntime("orchestrator", RuntimeSettings(bus=control, node_id="orchestrator",
                                                                           metrics_port=-1))
        orchestrator = Orchestrator(orchestrator_runtime, HALF_GROUP, Deadlines(restart_grace_s=WAIT_S))
        orchestrator_runtime.start_background()
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        _, probe = _restarted(spawn, command, "env-e-restarted", ctx)
        wait_for(lambda: orchestrator.claimed + orchestrator.missing == 2, WAIT_S, "the episode claimed")
        assert (orchestrator.claimed, orchestrator.missing, orchestrator.core.episodes) == (2, 0, 1)
        assert orchestrator.core.recovered_episodes == 0  # announced, not recovered: the recovery found no store
        account = accounted(probe)
        probe.close()
        assert account.held_by == {"orchestrator": 2}, account
    finally:
        if orchestrator_runtime is not None:
            orchestrator_runtime.join(timeout=WAIT_S)
        watcher.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_keep_its_journal_cannot_hold_is_refused_whole_and_later_keeps_survive_a_kill(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """Keeps whose record the journal cannot hold (an ``info`` array of a type it cannot write; one too large
    once its arrays are written as lists) are refused ``bad-info`` with nothing held, no segment left and the
    store still serving; a keep after them survives SIGKILL and restart. Before, the first was held unannounced
    with its segment leaked, and the second was committed as a record every restart read as garbage, losing
    every later keep."""
    shm = tmp_path / "shm"
    command = ["node", "env-server", "--bus-control", bus[1], "--node-id", "env-j", "--store-directory", str(shm),
               "--store-run", "journal", "--env-server-budget-bytes", str(256 << 20),  # the huge info's charge fits
               "--env-server-handover-lease-s", "600"]
    first = spawn(command, "env-j")
    endpoint = first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
    ctx = zmq.Context()
    try:
        producer = Client(ctx, endpoint, WireCodec("producer"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
        arrays = random_arrays(6, seed=1)
        too_large = np.zeros(journal.MAX_RECORD_BYTES // 9 + 1, np.float32)  # 9 msgpack bytes a float as a list
        for episode, info in (("ep-complex", {"x": np.ones(4, np.complex64)}), ("ep-huge", {"x": too_large})):
            with pytest.raises(RemoteError) as refused:
                producer.request(Keep(episode_id=episode, branches=[arrays, arrays], info=info))
            assert refused.value.code == "bad-info" and episode in refused.value.detail
        kept = producer.request(Keep(episode_id="ep-good", branches=[arrays], info={"reward": 1.0})).body
        assert isinstance(kept, Kept)
        account = accounted(producer)
        assert (account.kept, account.held) == (1, 1), account
        assert segments(shm, "env-j") == 1
        producer.close()
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        restarted, probe = _restarted(spawn, command, "env-j-restarted", ctx)
        account = accounted(probe)
        probe.close()
        assert (account.kept, account.held_by) == (1, {"": 1}), account
        assert segments(shm, "env-j") == 1
        readopted = log_events(restarted.log_path, "store.readopted")
        assert readopted and readopted[0]["blobs"] == 1 and readopted[0]["aborted"] == 0, readopted
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("down", ["before-the-kill", "while-dead"])
def test_a_holder_gone_around_a_store_restart_has_its_blobs_reclaimed_by_the_restarted_store(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path, down: str) -> None:
    """A holder claims two blobs of a durable env server and stops: reported down either before the store is
    SIGKILLed (its grace running: the store's journal has it) or while the store is dead (the registry no
    longer lists it). The restarted store gives it the grace it would have had and reclaims both blobs
    ``holder-down`` when it ends. Before, they stayed held by the dead holder until the store shut down: a
    chaos soak ended with blobs held at its end by a trainer rank that had long exited."""
    control = bus[1]
    grace_s = 1.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-h", grace_s)
    holder = _node(control, "trainer-h")
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    try:
        holder.start_background()
        _two_claimed(client, "trainer-h", seed=4)
        client.close()
        if down == "before-the-kill":
            holder.join(timeout=WAIT_S)  # bye: the broker reports it down
            wait_for(lambda: '"holder.down"' in first.log_tail(200), WAIT_S, "the store hearing of the holder's end")
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        if down == "while-dead":
            holder.join(timeout=WAIT_S)
        restarted, probe = _restarted(spawn, command, "env-h-restarted", ctx)
        wait_for(lambda: accounted(probe).reclaimed == {"trainer-h": 2}, 10 * grace_s + WAIT_S,
                 "the restarted store reclaiming the gone holder's blobs")
        account = accounted(probe)
        assert (account.held, account.deleted) == (0, {"holder-down": 2})
        assert '"holder.down_at_restart"' in restarted.log_tail(200)
        probe.close()
    finally:
        holder.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_ledger_started_after_a_kill_accounts_what_the_restarted_store_kept_before_it_as_no_loss(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A relaunch's view: a durable env server hands two blobs to a holder and is SIGKILLed, its holder gone with
    it for good; a ledger whose stream starts only then (a relaunched launcher's) folds the restarted process's
    events: its claims published again name blobs the ledger never saw kept, which the store reclaims
    ``holder-down`` when the dead holder's grace ends. They are kept before the stream, deleted
    ``holder-down-before`` from that holder, and the account is ok and agrees with the store's counters. Before,
    the ledger reported them lost by '?', unaccounted: every relaunch after a kill said NOT ok."""
    control = bus[1]
    grace_s = 1.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-r", grace_s)
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    ledger = Ledger()
    watcher = _node(control, "ledger-r", role="monitor")
    watcher.subscribe(ledger.apply_message)  # live: the first process's events are before its stream
    try:
        ids = _two_claimed(client, "orch-r", seed=5)  # orch-r never registers: gone at the store's restart
        client.close()
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        watcher.start_background()
        _, probe = _restarted(spawn, command, "env-r-restarted", ctx)
        wait_for(lambda: accounted(probe).reclaimed == {"orch-r": 2}, 10 * grace_s + WAIT_S,
                 "the restarted store reclaiming the gone holder's blobs")
        account = accounted(probe)
        probe.close()
        wait_for(lambda: all(ledger.tombstones.get(blob_id) is not None for blob_id in ids), WAIT_S,
                 "the ledger folding the reclaim")
    finally:
        watcher.join(timeout=WAIT_S)
        ctx.destroy(linger=0)
    report = ledger.report()
    assert report.ok and report.lost == {} and report.inherited == {"orch-r": 2}, report
    assert (account.kept, account.deleted) == (2, {"holder-down": 2})
    assert (report.kept["env-r"], report.deleted["env-r"]) == (2, {"holder-down-before": 2})


def test_a_holder_restarted_while_its_store_was_dead_keeps_only_what_it_claims_back(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A holder claims two blobs of a durable env server (the store journals which process it is), the store is
    SIGKILLed, and while it is dead the holder stops and starts again under its node id: no ``node-down``
    reaches the store, and the registry lists the holder live. The restarted store tells the new process from
    the one that took the blobs and gives the holder the grace: the blob the new process claims back (before
    or after the store's check) stays its own, and so does one handed over to it in that grace (a ``reference``
    event: a trainer rank's new world takes its step so), the other one is reclaimed once the grace ends.
    Before, the store took the live holder for the one that claimed and kept both for a process that knew
    neither, until the store shut down."""
    control = bus[1]
    grace_s = 2.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-r", grace_s)
    holder = _node(control, "trainer-r")
    orchestrator = _node(control, "orch-r", "orchestrator")
    again: NodeRuntime | None = None
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    try:
        holder.start_background()
        orchestrator.start_background()  # live throughout: the restarted store leaves it alone
        ids = _two_claimed(client, "trainer-r", seed=6)
        kept = client.request(Keep(episode_id="ep-next", branches=[random_arrays(6, seed=7)])).body
        assert isinstance(kept, Kept)
        (next_step,) = [r.blob_id for r in kept.refs]  # the orchestrator's until it hands it to the rank
        assert client.request(Claim(blob_ids=[next_step], holder="orch-r")).body == Claimed(blob_ids=[next_step])
        client.close()
        wait_for(lambda: '"holder.seen"' in first.log_tail(200), WAIT_S, "the store journaling the holder's process")
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        holder.join(timeout=WAIT_S)
        again = _node(control, "trainer-r")
        again.start_background()
        restarted, probe = _restarted(spawn, command, "env-r-restarted", ctx)
        assert probe.request(Claim(blob_ids=ids[:1], holder="trainer-r")).body == Claimed(blob_ids=ids[:1])
        wait_for(lambda: '"holder.down_at_restart"' in restarted.log_tail(200), WAIT_S, "the holder's grace")
        handed = Reference(step=1, holder="trainer-r", blob_ids=[next_step])
        again.call_soon(lambda: again.publish(handed))
        wait_for(lambda: accounted(probe).held_by.get("orch-r", 0) == 0, WAIT_S, "the hand-over reaching the store")
        wait_for(lambda: accounted(probe).reclaimed == {"trainer-r": 1}, 10 * grace_s + WAIT_S,
                 "the restarted store reclaiming what the holder's earlier process held")
        final = accounted(probe)
        assert (final.held_by, final.deleted) == ({"trainer-r": 2}, {"holder-down": 1}), final
        assert probe.request(Claim(blob_ids=ids[:1], holder="trainer-r")).body == Claimed(blob_ids=ids[:1])
        down = log_events(restarted.log_path, "holder.down_at_restart")
        assert [(e["holder"], e["live"]) for e in down] == [("trainer-r", True)], down
        probe.close()
    finally:
        holder.join(timeout=WAIT_S)
        orchestrator.join(timeout=WAIT_S)
        if again is not None:
            again.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _restart_holder(store: NodeProcess, control: str, holder: NodeRuntime) -> NodeRuntime:
    """Stop ``holder`` (its bye: the broker reports it down) and start its next process under its node id, each
    once the store has heard of the one before; returns the new process's runtime (the caller joins it)."""
    holder.join(timeout=WAIT_S)
    wait_for(lambda: '"holder.down"' in store.log_tail(200), WAIT_S, "the store hearing of the holder's end")
    again = _node(control, holder.node_id)
    again.start_background()
    wait_for(lambda: '"holder.restarted"' in store.log_tail(200), WAIT_S, "the store hearing of its restart")
    return again


@pytest.mark.parametrize("kill", ["after-the-grace", "within-the-grace"])
def test_a_holder_that_restarted_keeps_what_it_claimed_again_across_a_store_restart(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path, kill: str) -> None:
    """A holder of two blobs stops; its restarted process (same node id) claims one of them again within the
    grace. The durable store is SIGKILLed once the grace is over (the other blob reclaimed) or while it runs,
    and restarted. Either way the restarted store keeps the blob claimed again for the live holder, and
    reclaims the other one once (before: it found only the ``holder-down`` record, gave the live holder the grace
    anew and reclaimed both, losing a blob the holder was using: a chaos soak lost 99 of the orchestrator's)."""
    control = bus[1]
    grace_s = 3.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-a", grace_s)
    holder = _node(control, "trainer-a")
    again: NodeRuntime | None = None
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    try:
        holder.start_background()
        ids = _two_claimed(client, "trainer-a", seed=5)
        again = _restart_holder(first, control, holder)
        assert client.request(Claim(blob_ids=ids[:1], holder="trainer-a")).body == Claimed(blob_ids=ids[:1])
        if kill == "after-the-grace":
            wait_for(lambda: accounted(client).reclaimed == {"trainer-a": 1}, 10 * grace_s + WAIT_S,
                     "the grace ending with the blob not claimed again reclaimed")
        client.close()
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        restarted, probe = _restarted(spawn, command, "env-a-restarted", ctx)
        wait_for(lambda: '"store.holders_checked"' in restarted.log_tail(200), WAIT_S,
                 "the restarted store checking its holders")
        if kill == "after-the-grace":  # a grace given anew would end within two
            holds_for(lambda: accounted(probe).reclaimed == {"trainer-a": 1}, 2 * grace_s,
                      "the live holder keeping the blob it took back")
            assert '"holder.down_at_restart"' not in restarted.log_tail(200)
        else:
            wait_for(lambda: accounted(probe).reclaimed, 10 * grace_s + WAIT_S,
                     "the restarted store ending the grace it resumed")
        final = accounted(probe)
        assert (final.held_by, final.reclaimed, final.deleted) == (
            {"trainer-a": 1}, {"trainer-a": 1}, {"holder-down": 1}), final
        assert probe.request(Claim(blob_ids=ids[:1], holder="trainer-a")).body == Claimed(blob_ids=ids[:1])
        probe.close()
    finally:
        holder.join(timeout=WAIT_S)
        if again is not None:
            again.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_holder_restarted_and_gone_again_within_its_grace_loses_what_its_restart_claimed_too(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A holder of two blobs stops; its restarted process (same node id) claims one of them back and a new one
    within the grace, then stops too and never comes back. Its report starts a fresh grace, at whose end all three
    are reclaimed. Before, the second report kept the first grace, which spared what the restarted process had
    claimed: those two blobs stayed held by a process that was gone, until the store shut down."""
    control = bus[1]
    grace_s = 3.0
    _, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-d", grace_s)
    holder = _node(control, "trainer-d")
    again: NodeRuntime | None = None
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    try:
        holder.start_background()
        ids = _two_claimed(client, "trainer-d", seed=8)
        again = _restart_holder(first, control, holder)
        kept = client.request(Keep(episode_id="ep-new", branches=[random_arrays(6, seed=9)])).body
        assert isinstance(kept, Kept)
        new = kept.refs[0].blob_id
        assert client.request(Claim(blob_ids=[ids[0], new], holder="trainer-d")).body == Claimed(blob_ids=[new, ids[0]])
        again.join(timeout=WAIT_S)  # and the restarted process is reported down within the grace
        wait_for(lambda: accounted(client).reclaimed == {"trainer-d": 3}, 10 * grace_s + WAIT_S,
                 "the fresh grace ending with everything the holder held reclaimed")
        assert accounted(client).held_by == {}
        assert [e["holder"] for e in log_events(first.log_path, "holder.down")] == ["trainer-d", "trainer-d"]
        client.close()
    finally:
        holder.join(timeout=WAIT_S)
        if again is not None:
            again.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _logged_at(event: dict) -> float:
    """When a node logged ``event`` (a record of :func:`log_events`), on the wall clock (``time.time()``)."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()


@pytest.mark.parametrize("at", ["reclaiming", "reclaimed"])
def test_a_store_killed_as_it_reclaims_a_replaced_ranks_blobs_reclaims_them_once_after_its_restart(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path, at: str) -> None:
    """A trainer rank takes two blobs by hand-over and is SIGKILLed; as its new process registers (it claims nothing
    back), the durable store reclaims them at once, and is SIGKILLed in the middle: before anything of it is
    journaled, or once it is (the keeper still holding them, no event out). The restarted store reclaims them
    exactly once, well within the grace: it finds the rank down in its journal and live as the new process, or
    the reclaim journaled. Nothing is held, both are deleted ``holder-down`` with the rank, no violation."""
    control, grace_s = bus[1], 120.0  # far beyond what the test waits
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-x", "--store-directory",
               str(tmp_path / "shm"), "--store-run", "env-x", "--node-restart-grace-s", str(grace_s),
               "--env-server-handover-lease-s", str(5 * grace_s)]
    marker = tmp_path / "stalled"
    first = spawn(command, "env-x", prefix=[sys.executable, str(STALLER), at, str(marker)])
    ctx = zmq.Context()
    ranks: list[Rank] = []
    try:
        client = _client(ctx, first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"])
        ids = _two_claimed(client, "orchestrator", seed=11)
        ranks.append(Rank(control, "trainer-x", ids, RANK_LABELS))
        wait_for(lambda: accounted(client).held_by == {"trainer-x": 2}, WAIT_S, "the rank's hand-over")
        client.close()
        ranks[0].kill()
        ranks.append(Rank(control, "trainer-x", [], RANK_LABELS))  # once the broker takes the killed one for dead
        wait_for(marker.exists, WAIT_S, "the store stalled in the reclaim")
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        _, probe = _restarted(spawn, command, "env-x-restarted", ctx)
        wait_for(lambda: accounted(probe).held_by == {}, WAIT_S, "the restarted store reclaiming the rank's blobs")
        final = accounted(probe)
        assert (final.deleted, final.reclaimed, final.violations) == ({"holder-down": 2}, {"trainer-x": 2}, {}), final
        probe.close()
    finally:
        for rank in ranks:
            rank.stop()
        ctx.destroy(linger=0)


def test_a_store_killed_twice_in_a_holders_grace_reclaims_when_the_grace_first_given_ends(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A holder of two blobs is reported down, and its durable store is SIGKILLed twice within the grace it gave,
    restarted each time. The last restarted store reclaims both blobs ``holder-down`` when that first grace ends
    (its end is journaled on the wall clock): not before, and not a grace after its own start. Before, each
    restart gave the grace whole again (the ``holder-down`` record kept no end), and the last one reclaimed a
    grace after its start, past the bound below: a chaos soak with a store killed twice in a holder's grace ended
    with 35 blobs still held."""
    control = bus[1]
    grace_s = 8.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-g", grace_s)
    holder = _node(control, "trainer-g")
    ctx = zmq.Context()
    client = _client(ctx, endpoint)
    try:
        holder.start_background()
        _two_claimed(client, "trainer-g", seed=10)
        client.close()
        holder.join(timeout=WAIT_S)  # bye: the broker reports it down
        (down,) = wait_for(lambda: log_events(first.log_path, "holder.down"), WAIT_S,
                           "the store hearing of the holder's end")
        ends = _logged_at(down) + grace_s  # the grace's end was journaled just before, on the same clock
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        second, probe = _restarted(spawn, command, "env-g-second", ctx)
        wait_for(lambda: '"holder.down_at_restart"' in second.log_tail(200), WAIT_S, "the second process's check")
        # Killed again past half the grace: one given whole by the third process would end a grace after its start,
        # past the bound below by over a quarter grace.
        holds_for(lambda: not accounted(probe).reclaimed, ends - grace_s / 2 - time.time(),
                  "the second process keeping the blobs within the grace")
        probe.close()
        second.proc.kill()
        assert second.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        third, probe = _restarted(spawn, command, "env-g-third", ctx)
        holds_for(lambda: not accounted(probe).reclaimed, ends - grace_s / 8 - time.time(),
                  "the third process keeping the blobs until the grace's end")
        wait_for(lambda: accounted(probe).reclaimed == {"trainer-g": 2}, ends + grace_s / 4 - time.time(),
                 "the third process reclaiming the blobs when the grace first given ends")
        assert accounted(probe).deleted == {"holder-down": 2}
        (resumed,) = log_events(third.log_path, "holder.down_at_restart")
        assert resumed["grace_s"] < grace_s / 2, resumed  # what was left of it, not a grace anew
        probe.close()
    finally:
        holder.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _send(ctx: zmq.Context, endpoint: str, codec: WireCodec, frames: list) -> Body:
    """The answer of the store at ``endpoint`` to ``frames`` (a request as first encoded: a retry sends them
    again, under the same request id), within ``WAIT_S``."""
    sock = make_socket(ctx, zmq.DEALER, connect=endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(int(WAIT_S * 1000), zmq.POLLIN), f"no answer from {endpoint} within {WAIT_S}s"
        return codec.decode(recv_frames(sock)).body
    finally:
        sock.close(linger=0)


def test_a_keep_and_a_discard_sent_again_to_the_restarted_store_are_answered_as_the_first_process_did(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A producer's keep and discard are carried out and committed, and the store is SIGKILLed: the answers
    may have died with it, so the producer sends the same requests (same ids) to the restarted process, which
    has no reply cache. It answers the keep ``kept`` with the references the first process gave (the episode it
    re-adopted, with the same branches) and the discard with the ids the first one deleted (``repeated``, from
    the adopted tombstones). A different keep under a re-adopted episode's id is still ``duplicate-episode``.
    Before, the keep was refused ``duplicate-episode`` and the discard answered an empty list."""
    command, first, endpoint = _store_with_grace(spawn, bus[1], tmp_path, "env-r", 10.0)
    codec = WireCodec("producer")
    ctx = zmq.Context()
    try:
        keep = codec.encode(Keep(episode_id="ep-kept", branches=[random_arrays(6, seed=1), random_arrays(7, seed=2)]),
                            msg_id=codec.new_id())
        discard = codec.encode(Discard(episode_id="ep-dropped"), msg_id=codec.new_id())
        kept = _send(ctx, endpoint, codec, keep)
        dropped = _send(ctx, endpoint, codec, codec.encode(
            Keep(episode_id="ep-dropped", branches=[random_arrays(5, seed=3)] * 2), msg_id=codec.new_id()))
        assert isinstance(kept, Kept) and isinstance(dropped, Kept)
        deleted = _send(ctx, endpoint, codec, discard)
        assert deleted == Deleted(blob_ids=[ref.blob_id for ref in dropped.refs])
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        restarted, probe = _restarted(spawn, command, "env-r-restarted", ctx)
        again = restarted.info["endpoints"]["blobs"]
        assert _send(ctx, again, codec, keep) == kept
        assert _send(ctx, again, codec, discard) == deleted
        other = _send(ctx, again, codec, codec.encode(Keep(episode_id="ep-kept", branches=[random_arrays(6, seed=9)]),
                                                      msg_id=codec.new_id()))
        assert isinstance(other, Error) and other.code == "duplicate-episode", other
        account = accounted(probe)
        probe.close()
        assert (account.kept, account.held_by, account.deleted) == (4, {"": 2}, {"discarded": 2}), account
    finally:
        ctx.destroy(linger=0)


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
                    reason="a tmpfs of the test's own needs root, unshare and nsenter (a mount namespace)")
def test_changes_a_full_tmpfs_cannot_journal_change_nothing_and_go_through_once_there_is_room(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path) -> None:
    """A durable env server on a 2 MiB tmpfs of its own (a private mount namespace) that fills up: a claim and a
    delete whose journal records cannot be written are answered ``journal-failed`` with ``retry_after_s``, change
    nothing and are not cached (the same requests sent again run again), and a holder's grace that ends then is
    reclaimed at a later tick. Once there is room the same requests go through, the reclaim with them, and a
    SIGKILLed and restarted store re-adopts exactly what was answered. Before, the keeper changed first and the
    journal raised: the claim answered ``internal`` (cached for good) though the keeper had moved the blob, the
    delete dropped it from memory with no event and its segment left behind (its retry a violation), the reclaim
    dropped blobs unannounced, and the restart brought back what had been answered as gone."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    keeper = subprocess.Popen(  # holds the namespace, and with it the tmpfs, across the store's restart
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=2m,mode=0700 tmpfs "$0" && echo mounted && '
         "exec sleep 600", str(mount)], stdout=subprocess.PIPE, bufsize=0)
    inside = ["nsenter", "-t", str(keeper.pid), "-m", "--"]
    filler = mount / "filler"
    control, grace_s = bus[1], 1.0
    command = ["node", "env-server", "--bus-control", control, "--node-id", "env-f", "--store-directory", str(mount),
               "--store-run", "full", "--env-server-budget-bytes", str(2_000_000),
               "--env-server-handover-lease-s", "600", "--node-restart-grace-s", str(grace_s)]
    holder = _node(control, "trainer-f")
    codec = WireCodec("orchestrator")
    ctx = zmq.Context()
    try:
        assert read_line(keeper, WAIT_S) == "mounted"
        first = spawn(command, "env-f", prefix=inside)
        endpoint = first.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"]
        client = _client(ctx, endpoint)
        kept = client.request(Keep(episode_id="ep", branches=[random_arrays(6, seed=1)] * 200)).body
        assert isinstance(kept, Kept)
        ids = [ref.blob_id for ref in kept.refs]
        holder.start_background()
        assert client.request(Claim(blob_ids=ids[:10], holder="orchestrator")).body == Claimed(blob_ids=ids[:10])
        assert client.request(Claim(blob_ids=ids[10:12], holder="trainer-f")).body == Claimed(blob_ids=ids[10:12])
        subprocess.run([*inside, "dd", "if=/dev/zero", f"of={filler}", "bs=4096"], capture_output=True, check=False)
        granted = 0
        for blob_id in ids[12:]:  # what is left of the journal's last page takes a few records: fill it
            claim = codec.encode(Claim(blob_ids=[blob_id], holder="orchestrator"), msg_id=codec.new_id())
            answer = _send(ctx, endpoint, codec, claim)
            if not isinstance(answer, Claimed):
                break
            granted += 1
        assert isinstance(answer, Error) and answer.code == "journal-failed" and answer.retry_after_s > 0, answer
        delete = codec.encode(Delete(blob_ids=[ids[0]], holder="orchestrator", reason="trained"), msg_id=codec.new_id())
        refused = _send(ctx, endpoint, codec, delete)
        assert isinstance(refused, Error) and refused.code == "journal-failed", refused
        before = accounted(client)
        assert before.held_by == {"": 188 - granted, "orchestrator": 10 + granted, "trainer-f": 2}, before
        assert before.deleted == {} and before.violations == {}, before
        assert _send(ctx, endpoint, codec, claim) == answer  # run again, not a cached answer: still no room
        holder.join(timeout=WAIT_S)  # bye: its grace ends while the tmpfs is full
        holds_for(lambda: accounted(client) == before, 3 * grace_s, "nothing changing while the tmpfs is full")
        subprocess.run([*inside, "rm", "-f", str(filler)], check=True)
        assert _send(ctx, endpoint, codec, claim) == Claimed(blob_ids=[blob_id])
        assert _send(ctx, endpoint, codec, delete) == Deleted(blob_ids=[ids[0]])
        wait_for(lambda: accounted(client).reclaimed == {"trainer-f": 2}, 5 * grace_s, "the reclaim once there is room")
        after = accounted(client)
        client.close()
        assert after.deleted == {"trained": 1, "holder-down": 2} and after.violations == {}, after
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        restarted = spawn(command, "env-f-restarted", prefix=inside)
        probe = _client(ctx, restarted.wait_ready(timeout=WAIT_S)["endpoints"]["blobs"], "probe")
        again = accounted(probe)
        probe.close()
        assert (again.kept, again.held_by, again.deleted, again.reclaimed) == \
            (after.kept, after.held_by, after.deleted, after.reclaimed), (again, after)
    finally:
        holder.join(timeout=WAIT_S)
        ctx.destroy(linger=0)
        keeper.kill()
        keeper.wait(timeout=WAIT_S)


class _Full:
    """A durable env server's journal whose commits of the record kinds in ``full`` fail as on a full tmpfs
    (``ENOSPC``): once each (the same request sent again finds room), or, not ``once``, until :meth:`room`.
    ``failed``: the kinds refused, in order."""

    def __init__(self, env: EnvServer, *full: str, once: bool = True) -> None:
        assert env.journal is not None
        self.commit = env.journal.store.commit
        self.full = set(full)
        self.once = once
        self.failed: list[str] = []
        env.journal.store.commit = self

    def __call__(self, record: dict) -> None:
        if record.get("op") in self.full:
            if self.once:
                self.full.discard(record["op"])
            self.failed.append(record["op"])
            raise OSError(errno.ENOSPC, "No space left on device (a full tmpfs, for a moment)")
        self.commit(record)

    def room(self) -> None:
        self.full.clear()


def _durable_env(control: str, tmp_path: Path, node_id: str, grace_s: float = 10.0) -> tuple[NodeRuntime, EnvServer]:
    runtime = _node(control, node_id, "env-server")
    env = EnvServer(runtime, EnvServerSettings(source=node_id), restart_grace_s=grace_s, store=StoreSettings(
        durable=True, directory=str(tmp_path / "shm")), run=node_id)
    return runtime, env


def _ops(env: EnvServer) -> list[str]:
    """The kinds of the records committed to ``env``'s journal, in order."""
    assert env.journal is not None
    path = env.journal.store.path / "journal"
    return [record["op"] for record in journal.replay(path.read_bytes(), str(path)).records]


def test_an_orchestrator_claim_and_delete_its_store_could_not_journal_go_through_once_there_is_room(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """The orchestrator claims a malformed episode's blob and deletes it at once (``malformed``) on a durable
    store whose journal cannot take the claim, then the delete, the first time (a full tmpfs): each is answered
    ``journal-failed`` with ``retry_after_s``, sent again after it and goes through; nothing is missing, nothing
    failed, no violation. Before, both were given up: the claim lost the sample and the blob stayed unclaimed,
    or a failed delete left it held by the orchestrator until it was gone."""
    control = bus[1]
    env_runtime, env = _durable_env(control, tmp_path, "env-jo")
    full = _Full(env, "claim", "drop")
    runtime = _node(control, "orchestrator", "orchestrator")
    orchestrator = Orchestrator(runtime, HALF_GROUP)
    env_runtime.start_background()
    runtime.start_background()
    try:
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        info = {"group": "g", "reward": 1.0, "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 1], "ref": 0}]}
        env.keep("bad", [random_arrays(6, seed=3, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)],
                 info=info)
        wait_for(lambda: env.stats().deleted.get("malformed"), WAIT_S, "the malformed episode's blob deleted")
        assert full.failed == ["claim", "drop"]
        assert (orchestrator.claimed, orchestrator.missing, orchestrator.failed_deletes) == (1, 0, 0)
        stats = env.stats()
        assert (stats.deleted, stats.blobs_held, dict(env.keeper._held_by)) == ({"malformed": 1}, 0, {})
        ctx = zmq.Context()
        try:
            assert accounted(_client(ctx, env.endpoint)).violations == {}
        finally:
            ctx.destroy(linger=0)
    finally:
        runtime.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)


@contextlib.contextmanager
def _holding_half_a_group(control: str, tmp_path: Path, env_id: str
                          ) -> Iterator[tuple[EnvServer, NodeRuntime, Orchestrator]]:
    """A durable env server ``env_id`` and an orchestrator (:data:`HALF_GROUP`), both running in this process;
    the env server keeps one episode of a group of two, which the orchestrator claims and holds while the group
    is not whole. Both are stopped at the end."""
    env_runtime, env = _durable_env(control, tmp_path, env_id)
    runtime = _node(control, "orchestrator", "orchestrator")
    orchestrator = Orchestrator(runtime, HALF_GROUP)
    env_runtime.start_background()
    runtime.start_background()
    try:
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        info = {"group": "g", "reward": 1.0, "samples": [{"input_ids": list(range(6)), "loss_mask": [0] * 5 + [1],
                                                          "ref": 0}]}
        env.keep("half", [random_arrays(6, seed=9, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)],
                 info=info)
        wait_for(lambda: env.stats().held_by == {"orchestrator": 1}, WAIT_S, "the orchestrator holding the blob")
        yield env, runtime, orchestrator
    finally:
        runtime.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)


def test_an_orchestrator_shutdown_delete_its_store_could_not_journal_goes_through_once_there_is_room(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """The orchestrator stops holding a blob of a group not yet whole: its shutdown deletes it, and the durable
    store's journal cannot take that delete the first time (a full tmpfs). Answered ``journal-failed`` with
    ``retry_after_s``, the delete is sent again after it, within the shutdown's deadline, and goes through.
    Before, the shutdown gave it up (``delete.failed``): the store held the blob for the gone orchestrator
    until its grace ended, then reclaimed it ``holder-down``."""
    with _holding_half_a_group(bus[1], tmp_path, "env-js") as (env, runtime, orchestrator):
        full = _Full(env, "drop")
        runtime.join(timeout=WAIT_S)
        assert full.failed == ["drop"]
        stats = env.stats()
        assert (orchestrator.failed_deletes, stats.deleted, stats.blobs_held) == (0, {"shutdown": 1}, 0), stats


@pytest.mark.parametrize("final", [False, True])
def test_an_orchestrator_halted_on_a_deadline_leaves_what_it_holds_for_its_restart(
        bus: tuple[NodeProcess, str], tmp_path: Path, final: bool) -> None:
    """An orchestrator holding a blob halts. On a deadline (no new trainer world in time: not final) it ends as a
    crash would, deleting nothing, and its restarted process claims the blob back from the store's holdings; a
    final halt (budgets that cannot hold a step) deletes what it holds at shutdown, as any stop. Before, every
    halt deleted everything: a world merely late past the orchestrator's wait cost the run its buffered
    rollouts, though the restart it exits for would have fed them."""
    with _holding_half_a_group(bus[1], tmp_path, "env-jh") as (env, runtime, orchestrator):
        runtime.call_soon(lambda: orchestrator._execute([Halt("a deadline ran out", final=final)]))
        assert runtime.loop_thread is not None
        runtime.loop_thread.join(timeout=WAIT_S)
        runtime.join(timeout=WAIT_S)
        assert orchestrator.failure == "a deadline ran out" and orchestrator.halt_final is final
        if final:
            assert (env.stats().deleted, env.stats().blobs_held) == ({"shutdown": 1}, 0)
            return
        assert (env.stats().deleted, env.stats().held_by) == ({}, {"orchestrator": 1})
        again = _node(bus[1], "orchestrator", "orchestrator")
        restarted = Orchestrator(again, HALF_GROUP)
        again.start_background()
        try:
            wait_for(lambda: restarted.claimed == 1, WAIT_S, "the restarted orchestrator claiming the blob back")
            assert env.stats().held_by == {"orchestrator": 1} and env.stats().deleted == {}
        finally:
            again.join(timeout=WAIT_S)


def test_an_orchestrator_restarted_and_stopped_at_once_deletes_what_its_dead_predecessor_held(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """An orchestrator holding a blob ends as a crash would (a halt that is not final deletes nothing); its
    restarted process is stopped at once, its start-up recovery not finished (or not begun), as a run's launcher
    stops the orchestrator it restarts at the run's end. The shutdown finishes the recovery first: it claims the
    blob back and deletes it (``shutdown``). Before, the stop came first and the blob stayed the dead process's,
    left to the store's own shutdown and reported held at the run's end."""
    with _holding_half_a_group(bus[1], tmp_path, "env-jr") as (env, runtime, orchestrator):
        runtime.call_soon(lambda: orchestrator._execute([Halt("a deadline ran out", final=False)]))
        assert runtime.loop_thread is not None
        runtime.loop_thread.join(timeout=WAIT_S)
        runtime.join(timeout=WAIT_S)
        assert (env.stats().deleted, env.stats().held_by) == ({}, {"orchestrator": 1})
        again = _node(bus[1], "orchestrator", "orchestrator")
        restarted = Orchestrator(again, HALF_GROUP)
        again.start_background()
        again.join(timeout=WAIT_S)
        assert restarted.claimed == 1 and restarted.deleted == {"shutdown": 1}
        assert (env.stats().deleted, env.stats().blobs_held) == ({"shutdown": 1}, 0)


def test_a_trainer_rank_delete_its_store_could_not_journal_goes_through_once_there_is_room(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """A trainer rank deletes a blob it holds on a durable store whose journal cannot take the delete the first
    time (a full tmpfs): answered ``journal-failed`` with ``retry_after_s``, the delete is sent again after it and
    deletes the blob once, no violation. Before, the rank gave it up (``failed``) and the store held the blob
    for the rank until the rank was gone."""
    import torch.distributed as dist
    from refbus.nodes.payload.trainer_rank import TrainerRank
    from refbus.nodes.settings import TrainerSettings

    control = bus[1]
    env_runtime, env = _durable_env(control, tmp_path, "env-jt")
    env_runtime.start_background()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    rank_runtime = _node(control, "trainer-j")
    try:
        rank = TrainerRank(rank_runtime, settings=TrainerSettings(batch_timeout_s=WAIT_S), restart_grace_s=WAIT_S)
        rank_runtime.start_background()
        ref = env.keep("ep", [random_arrays(6, seed=4, layers=2, top_k=2, k=2, max_count=2,
                                            routing_dtype=np.uint8)])[0]
        ctx = zmq.Context()
        try:
            client = _client(ctx, env.endpoint)
            assert client.request(Claim(blob_ids=[ref.blob_id], holder="trainer-j")).body == \
                Claimed(blob_ids=[ref.blob_id])
            wait_for(lambda: "env-jt" in rank._peers.live, WAIT_S, "the rank knowing env-jt")
            full = _Full(env, "drop")
            release = rank._on_loop(lambda done: rank._delete({ref.blob_id: ref}, {ref.blob_id: "trained"}, done))
            assert full.failed == ["drop"]
            assert (release.deleted, release.failed, release.violations) == ((ref.blob_id,), (), ())
            account = accounted(client)
            assert (account.held_by, account.deleted, account.violations) == ({}, {"trained": 1}, {})
        finally:
            ctx.destroy(linger=0)
    finally:
        rank_runtime.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)
        dist.destroy_process_group()


@contextlib.contextmanager
def _claimed_by_the_orchestrator(control: str, tmp_path: Path, env_id: str, rank_id: str, grace_s: float = 10.0
                                 ) -> Iterator[tuple[NodeRuntime, EnvServer, NodeRuntime, Client, str]]:
    """A durable env server ``env_id`` and a rank ``rank_id`` (a bare node: the test publishes its events), both
    running in this process, and a client of the store; one blob kept and claimed by the orchestrator. Yields the
    store's runtime, the store, the rank, the client and the blob id; all stopped at the end."""
    env_runtime, env = _durable_env(control, tmp_path, env_id, grace_s)
    rank = _node(control, rank_id)
    ctx = zmq.Context()
    env_runtime.start_background()
    rank.start_background()
    try:
        (ref,) = env.keep("ep", [random_arrays(6, seed=5)])
        client = _client(ctx, env.endpoint)
        assert client.request(Claim(blob_ids=[ref.blob_id], holder="orchestrator")).body == \
            Claimed(blob_ids=[ref.blob_id])
        try:
            yield env_runtime, env, rank, client, ref.blob_id
        finally:
            client.close()
    finally:
        rank.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_hand_over_its_store_could_not_journal_waits_and_is_made_before_its_ranks_down(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """A trainer rank takes over a blob the orchestrator claimed (its ``reference`` event) while its durable
    store's journal cannot take the ``move`` (a full tmpfs), then goes down. The hand-over waits, nothing changed,
    and the ``holdings`` a restarted orchestrator asks (to claim back and feed again what it held) is refused
    ``journal-failed`` with ``retry_after_s`` meanwhile; the rank's down waits behind it. Once there is room the
    hand-over is journaled and made, then the down, in that order: the blob is the rank's and is reclaimed
    ``holder-down`` with it when its grace ends, and the orchestrator's holdings no longer list it. Before, the
    event was logged and dropped: the blob stayed the orchestrator's, listed for its restart, and the rank's down
    found it holding nothing."""
    grace_s, codec, ctx = 0.5, WireCodec("orchestrator"), zmq.Context()
    try:
        with _claimed_by_the_orchestrator(bus[1], tmp_path, "env-jr", "trainer-jr", grace_s) as \
                (_, env, rank, client, blob_id):
            wait_for(lambda: "trainer-jr" in env._peers.live, WAIT_S, "the store knowing the rank")
            full = _Full(env, "move", once=False)
            rank.call_soon(lambda: rank.publish(Reference(step=1, holder="trainer-jr", blob_ids=[blob_id])))
            wait_for(lambda: full.failed, WAIT_S, "the hand-over's journal write failing")
            holdings = codec.encode(HoldingsQuery(holder="orchestrator"), msg_id=codec.new_id())
            refused = _send(ctx, env.endpoint, codec, holdings)
            assert isinstance(refused, Error) and refused.code == "journal-failed", refused
            assert refused.retry_after_s > 0, refused
            rank.join(timeout=WAIT_S)  # bye: the broker reports it down
            wait_for(lambda: "trainer-jr" in env._peers.down, WAIT_S, "the rank's down reaching the store")
            assert accounted(client).held_by == {"orchestrator": 1}
            full.room()
            wait_for(lambda: accounted(client).reclaimed == {"trainer-jr": 1}, 10 * grace_s,
                     "the rank's blob reclaimed")
            ops = _ops(env)
            assert ops[ops.index("move"):] == ["move", "holder-down", "drop", "holder-settled"], ops
            held = _send(ctx, env.endpoint, codec, holdings)  # the same request: an error answer is not cached
            assert isinstance(held, Held) and held.episodes == [], held
    finally:
        ctx.destroy(linger=0)


def test_a_hand_over_a_third_node_publishes_moves_nothing_and_its_ends_still_hand_over(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """Any peer may publish a ``reference``. One published by a node that is neither end of the hand-over (not the
    rank it names, not the orchestrator that claimed the blob) moves nothing at the store: refused, logged with its
    publisher and counted, and the store goes on. The ends still hand over: the rank's own event, and the
    orchestrator's repeat. Before, the third node's event moved the orchestrator's blob to whatever holder it named
    (the orchestrator's delete of it then a violation, or the blob reclaimed with a holder that is down)."""
    with _claimed_by_the_orchestrator(bus[1], tmp_path, "env-tp", "trainer-tp") as \
            (_, env, rank, client, blob_id):
        repeated = env.keep("ep-2", [random_arrays(6, seed=6)])[0].blob_id
        assert client.request(Claim(blob_ids=[repeated], holder="orchestrator")).body == Claimed(blob_ids=[repeated])
        intruder, orchestrator = _node(bus[1], "intruder", "rollout"), _node(bus[1], "orchestrator", "orchestrator")
        intruder.start_background()
        orchestrator.start_background()
        try:
            with capture_logs() as logs:
                intruder.call_soon(lambda: intruder.publish(Reference(step=1, holder="trainer-tp",
                                                                      blob_ids=[blob_id, repeated])))
                wait_for(lambda: any(e["event"] == "reference.refused" for e in logs) or
                         accounted(client).held_by != {"orchestrator": 2}, WAIT_S, "the third node's hand-over heard")
            assert accounted(client).held_by == {"orchestrator": 2}
            (refused,) = [e for e in logs if e["event"] == "reference.refused"]
            assert (refused["src"], refused["holder"], refused["blobs"]) == ("intruder", "trainer-tp", 2), refused
            assert env._references.rejected == {THIRD_PARTY_HAND_OVER: 1}
            rank.call_soon(lambda: rank.publish(Reference(step=1, holder="trainer-tp", blob_ids=[blob_id])))
            orchestrator.call_soon(lambda: orchestrator.publish(Reference(step=2, holder="trainer-tp",
                                                                          blob_ids=[repeated])))
            wait_for(lambda: accounted(client).held_by == {"trainer-tp": 2}, WAIT_S, "both ends' hand-overs made")
        finally:
            intruder.join(timeout=WAIT_S)
            orchestrator.join(timeout=WAIT_S)


def test_hand_overs_waiting_on_a_full_journal_are_bounded_and_past_it_the_store_ends_as_a_crash_would(
        bus: tuple[NodeProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a durable store's journal cannot take a ``move`` (a full tmpfs that stays full), hand-overs wait. One
    naming blobs never kept here (every store hears every hand-over; any peer may publish one) changes nothing
    here and does not wait. Past ``WAITING_MAX`` blob ids waiting, the node ends as a crash would: logged, no
    shutdown deletes, its store left for its restarted process (which learns the hand-overs again as any store
    back as a new process does), where waiting on grew its memory with the cluster's event rate without end.
    Before, every hand-over heard waited, whoever's blobs it named, and the queue had no bound."""
    monkeypatch.setattr(env_server_module, "WAITING_MAX", 8)
    with _claimed_by_the_orchestrator(bus[1], tmp_path, "env-jw", "trainer-jw") as \
            (env_runtime, env, rank, _, blob_id):
        full = _Full(env, "move", once=False)
        foreign = [f"elsewhere-{i}" for i in range(64)]
        for _ in range(3):
            rank.call_soon(lambda: rank.publish(Reference(step=1, holder="trainer-jw", blob_ids=foreign)))
        rank.call_soon(lambda: rank.publish(Reference(step=1, holder="trainer-jw", blob_ids=[blob_id])))
        wait_for(lambda: full.failed, WAIT_S, "the hand-over's journal write failing")
        assert [action for action, _, _ in env._waiting] == ["reference"] and not env.abandoned
        for step in range(2, 10):
            rank.call_soon(lambda step=step: rank.publish(Reference(step=step, holder="trainer-jw",
                                                                    blob_ids=[blob_id])))
        assert env_runtime.loop_thread is not None
        env_runtime.loop_thread.join(timeout=WAIT_S)
        assert not env_runtime.loop_thread.is_alive() and "WAITING_MAX" not in env.abandoned
        assert "9 blob ids" in env.abandoned, env.abandoned
        assert env.journal is not None and (env.journal.store.path / "journal").exists()
        assert env.stats().held_by == {"orchestrator": 1}  # nothing deleted at the end: the restart's to settle
        with pytest.raises(KeepError) as refused:  # an embedder's keep: refused for good, not journal-failed
            env.keep("after", [random_arrays(6, seed=6)])
        assert refused.value.code == "closed" and not refused.value.retry_after_s
        with pytest.raises(KeepError) as refused:  # nor a discard (before: an OSError for ever, "call again")
            env.discard("ep")
        assert refused.value.code == "closed"


def test_a_holders_down_and_back_change_nothing_until_their_records_are_journaled(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """A durable store's journal cannot take a holder's ``holder-down`` (a full tmpfs): nothing changes (no grace
    runs, nothing is reclaimed) until the record is committed at a later tick, then the grace runs and the blob is
    reclaimed at its end. A holder reported down and back as the same process (slow, not dead) whose
    ``holder-settled`` cannot be committed stays in its grace, nothing reclaimed meanwhile, until the record is in;
    then it keeps its blob. Before, both changed memory first and then failed to journal: the grace ran and
    reclaimed with no ``holder-down`` on record, and the return was never journaled, so a restarted store would
    have found that holder still down."""
    control, grace_s = bus[1], 0.5
    env_runtime, env = _durable_env(control, tmp_path, "env-jd", grace_s)
    gone, slow = _node(control, "trainer-gone"), _node(control, "trainer-slow")
    ctx = zmq.Context()
    for runtime in (env_runtime, gone, slow):
        runtime.start_background()
    try:
        refs = env.keep("ep", [random_arrays(6, seed=8)] * 2)
        client = _client(ctx, env.endpoint)
        for holder, ref in zip(("trainer-gone", "trainer-slow"), refs, strict=True):
            assert client.request(Claim(blob_ids=[ref.blob_id], holder=holder)).body == Claimed(blob_ids=[ref.blob_id])
        wait_for(lambda: {"trainer-gone", "trainer-slow"} <= set(env._peers.live), WAIT_S, "the store knowing both")
        full = _Full(env, "holder-down", once=False)
        gone.join(timeout=WAIT_S)  # bye: the broker reports it down
        wait_for(lambda: full.failed, WAIT_S, "the holder-down's journal write failing")
        before = accounted(client)
        holds_for(lambda: accounted(client) == before, 3 * grace_s, "no grace while its start is not journaled")
        full.room()
        wait_for(lambda: accounted(client).reclaimed == {"trainer-gone": 1}, 10 * grace_s, "the reclaim at its end")
        ops = _ops(env)
        assert ops[ops.index("holder-down"):] == ["holder-down", "drop", "holder-settled"], ops

        full = _Full(env, "holder-settled", once=False)
        info = env._peers.live["trainer-slow"]
        down = NodeDown(node_id="trainer-slow", role="trainer", reason="timeout", last_seen=0.0)
        env_runtime.call_soon(lambda: (env._on_node_down(down, info), env._on_node_up(info)))
        wait_for(lambda: full.failed, WAIT_S, "the holder-settled's journal write failing")

        def in_grace() -> bool:
            with env._lock:
                return env.keeper.in_grace("trainer-slow")

        assert in_grace()
        holds_for(lambda: accounted(client).held_by == {"trainer-slow": 1}, 3 * grace_s, "nothing reclaimed meanwhile")
        full.room()
        wait_for(lambda: not in_grace(), 10 * grace_s, "the return made once journaled")
        assert _ops(env)[-2:] == ["holder-down", "holder-settled"]
        final = accounted(client)
        assert (final.held_by, final.reclaimed) == ({"trainer-slow": 1}, {"trainer-gone": 1}), final
        client.close()
    finally:
        for runtime in (slow, gone, env_runtime):
            runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _stand_in_rank(control: str, node_id: str, conn: Connection) -> None:
    """A trainer rank's process as the orchestrator sees it: registered (rank 0, step 0), it takes every step
    batch, publishes its ``reference`` (as a real rank does before it answers), answers ``ok`` and tells the test
    (``conn``) the step; until it is killed."""
    runtime = NodeRuntime("trainer", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1))
    server = runtime.serve("trainer", "tcp://127.0.0.1:0")

    def take(request: Message) -> Ok:
        batch = request.body
        assert isinstance(batch, StepBatch)
        runtime.publish(Reference(step=batch.step, holder=node_id, blob_ids=list(batch.owned)))
        conn.send(batch.step)
        return Ok()

    server.on(StepBatch.kind, take)
    runtime.labels.update(rank="0", data_rank="0", leader="1")
    runtime.status = lambda: {"step": 0.0}
    runtime.run()


@pytest.mark.parametrize("rank_after", ["gone", "restarted"])
def test_a_hand_over_published_while_its_store_was_dead_is_reclaimed_with_its_rank_that_died_meanwhile(
        bus: tuple[NodeProcess, str], spawn, tmp_path: Path, rank_after: str) -> None:
    """The orchestrator claims a group's two blobs on a durable env server, which is SIGKILLed; then a trainer rank
    takes the step batch that hands them over (its ``reference`` event and the orchestrator's go out while the
    store is dead) and is SIGKILLed in turn, before the store comes back; it stays gone, or is restarted under its
    node id (a new world, which knows nothing of that batch). The restarted store re-adopts the blobs as the
    orchestrator's; the orchestrator, seeing it back as a new process, publishes the hand-over again naming the
    rank's process that took it, which the store finds gone: it reclaims both blobs ``holder-down``, named with the
    rank, and lists none of them to a restarted orchestrator. Before, no one told the restarted store (the rank
    that repeats its hand-overs was dead): the blobs stayed the orchestrator's there, held until the store's
    shutdown, and a restarted orchestrator asking its holdings was offered them to claim back and train again."""
    control, grace_s = bus[1], 1.0
    command, first, endpoint = _store_with_grace(spawn, control, tmp_path, "env-k", grace_s)
    runtime = _node(control, "orchestrator", "orchestrator")
    orchestrator = Orchestrator(runtime, HALF_GROUP, Deadlines(restart_grace_s=10 * WAIT_S))
    ctx = zmq.Context()
    ranks: list[multiprocessing.process.BaseProcess] = []
    steps, child = multiprocessing.get_context("spawn").Pipe()

    def start_rank() -> None:
        ranks.append(multiprocessing.get_context("spawn").Process(target=_stand_in_rank,
                                                                  args=(control, "trainer-k", child), daemon=True))
        ranks[-1].start()

    try:
        runtime.start_background()
        wait_for(lambda: not orchestrator._arrivals, WAIT_S, "the orchestrator's start-up recovery")
        client = _client(ctx, endpoint)
        for m in range(2):
            record = {"group": "gk", "reward": float(m),
                      "samples": [{"input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1], "ref": 0}]}
            arrays = random_arrays(6, seed=m, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
            assert isinstance(client.request(Keep(episode_id=f"k-{m}", branches=[arrays], info=record)).body, Kept)
        wait_for(lambda: accounted(client).held_by == {"orchestrator": 2}, WAIT_S, "the orchestrator's claims")
        client.close()
        first.proc.kill()
        assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        start_rank()
        assert steps.poll(WAIT_S) and steps.recv() == 0, "the rank took no step batch"
        wait_for(lambda: not orchestrator.core.holdings.held, WAIT_S, "the step batch acknowledged")
        ranks[0].kill()  # dead before its store is back: it cannot tell the restarted store what it took
        ranks[0].join(WAIT_S)
        wait_for(lambda: orchestrator.core.world_down is not None, WAIT_S, "the rank reported down")
        if rank_after == "restarted":
            start_rank()
            wait_for(lambda: "trainer-k" in orchestrator._peers.live, WAIT_S, "the rank's new process registered")
        _, probe = _restarted(spawn, command, "env-k-restarted", ctx)
        wait_for(lambda: accounted(probe).reclaimed == {"trainer-k": 2}, 10 * grace_s + WAIT_S,
                 "the restarted store reclaiming the dead rank's blobs")
        final = accounted(probe)
        assert (final.held_by, final.deleted, final.violations) == ({}, {"holder-down": 2}, {}), final
        held = probe.request(HoldingsQuery(holder="orchestrator")).body
        assert isinstance(held, Held) and held.episodes == [], held  # nothing for a restarted orchestrator
        probe.close()
    finally:
        for rank in ranks:
            rank.kill()
            rank.join(WAIT_S)
        steps.close()
        child.close()
        runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_reference_naming_a_garbage_process_is_rejected_and_the_store_goes_on(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """``reference`` events whose ``process`` is not a process (a negative pid, a start time that is not a number
    ≥ 0, too few fields, not an array) are rejected as malformed, counted, and change nothing: the blob stays the
    orchestrator's, no grace starts. The store goes on: a well-formed hand-over after them, naming the live rank's
    process, moves the blob to the rank, which keeps it (no grace)."""
    control = bus[1]
    env_runtime, env = _durable_env(control, tmp_path, "env-g", grace_s=0.5)
    publisher = _node(control, "orchestrator", "orchestrator")
    rank = _node(control, "trainer-g")
    env_runtime.start_background()
    publisher.start_background()
    rank.start_background()
    ctx = zmq.Context()
    try:
        (ref,) = env.keep("ep", [random_arrays(6, seed=8)])
        client = _client(ctx, env.endpoint)
        assert client.request(Claim(blob_ids=[ref.blob_id], holder="orchestrator")).body == \
            Claimed(blob_ids=[ref.blob_id])
        wait_for(lambda: "trainer-g" in env._peers.live, WAIT_S, "the store knowing the rank")
        def rejected() -> int:
            return sum(s.rejected["schema"] for s, _, _ in env_runtime._subscriptions)

        for n, process in enumerate([("h", -1, 1.0), ("h", 1, float("nan")), ("h", 1, -1.0), ("h", 1), "h"], 1):
            bad = Reference(step=0, holder="trainer-g", blob_ids=[ref.blob_id], process=process)  # type: ignore[arg-type]
            publisher.call_soon(lambda bad=bad: publisher.publish(bad))
            wait_for(lambda n=n: rejected() == n, WAIT_S, f"garbage reference {process!r} rejected")
        assert accounted(client).held_by == {"orchestrator": 1} and not env.keeper.in_grace("trainer-g")
        info = env._peers.live["trainer-g"]
        good = Reference(step=0, holder="trainer-g", blob_ids=[ref.blob_id],
                         process=(info.host, info.pid, info.started))
        publisher.call_soon(lambda: publisher.publish(good))
        wait_for(lambda: accounted(client).held_by == {"trainer-g": 1}, WAIT_S, "the well-formed hand-over applied")
        holds_for(lambda: not env.keeper.in_grace("trainer-g") and accounted(client).reclaimed == {}, 2 * 0.5,
                  "the live rank keeping what it took")
        client.close()
    finally:
        rank.join(timeout=WAIT_S)
        publisher.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)


def test_a_hand_over_to_a_rank_the_store_has_not_seen_register_yet_is_kept_once_it_registers(
        bus: tuple[NodeProcess, str], tmp_path: Path) -> None:
    """The orchestrator's ``reference`` names a rank's process that the store has not seen register (its
    ``node-up`` still on its way): the store takes it for gone and the grace starts with the hand-over, but the
    rank's ``node-up`` as that very process within the grace brings it back, and it keeps what it took, nothing
    reclaimed. (A hand-over naming no process would have it taken for a restart, which keeps nothing.)"""
    control, grace_s = bus[1], 2.0
    env_runtime, env = _durable_env(control, tmp_path, "env-u", grace_s=grace_s)
    publisher = _node(control, "orchestrator", "orchestrator")
    rank = _node(control, "trainer-u")
    env_runtime.start_background()
    publisher.start_background()
    ctx = zmq.Context()
    try:
        (ref,) = env.keep("ep", [random_arrays(6, seed=9)])
        client = _client(ctx, env.endpoint)
        assert client.request(Claim(blob_ids=[ref.blob_id], holder="orchestrator")).body == \
            Claimed(blob_ids=[ref.blob_id])
        info = rank.info()
        handed = Reference(step=0, holder="trainer-u", blob_ids=[ref.blob_id], process=(info.host, info.pid,
                                                                                          info.started))
        publisher.call_soon(lambda: publisher.publish(handed))
        wait_for(lambda: env.keeper.in_grace("trainer-u"), WAIT_S, "the grace started with the hand-over")
        assert accounted(client).held_by == {"trainer-u": 1}
        rank.start_background()
        wait_for(lambda: not env.keeper.in_grace("trainer-u"), grace_s, "the rank back as the process named")
        holds_for(lambda: accounted(client).held_by == {"trainer-u": 1}, 1.5 * grace_s, "the rank keeping its blob")
        assert accounted(client).reclaimed == {}
        client.close()
    finally:
        rank.join(timeout=WAIT_S)
        publisher.join(timeout=WAIT_S)
        env_runtime.join(timeout=WAIT_S)
        ctx.destroy(linger=0)
