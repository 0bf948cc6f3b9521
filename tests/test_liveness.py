"""Liveness drives ownership, with real processes killed by SIGKILL: a peer the registry reports down ends
every request to it at once; an orchestrator names a dead store's blobs ``lost`` after the restart grace;
an env server deletes a dead holder's blobs (``holder-down``) after the grace, except those a restarted
holder under the same id claimed back first."""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import read_line, wait_for
from refbus.bus.reqrep import Client, Outcome, PeerDown, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import NodeProcess
from refbus.nodes.payload.env_server import claims_nothing_back
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    CLAIMS_BACK,
    Blobs,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Fetch,
    Keep,
    Kept,
    NodeDown,
    NodeInfo,
    NodeUp,
)
from test_violations import accounted

NODE_TIMEOUT_S = 1.0  # FAST_LIVENESS
HEARTBEAT_S = 0.2
START_S = 30.0  # a process start on a loaded machine
CLAIMER = Path(__file__).with_name("claimer_node.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Observer:
    """An in-process node that queues every event of ``kinds`` (its loop runs in a thread)."""

    def __init__(self, control: str, kinds: frozenset[str]) -> None:
        self.runtime = NodeRuntime("observer", RuntimeSettings(bus=control, node_id="observer", metrics_port=-1,
                                                               heartbeat_interval_s=HEARTBEAT_S))
        self.events: queue.Queue[Message] = queue.Queue()
        self.runtime.subscribe(self.events.put, kinds=kinds)
        self.runtime.start_background()

    def wait(self, match: Callable[[Message], bool], timeout: float, what: str) -> Message:
        """The next event that ``match``es (others are skipped), within ``timeout`` seconds."""
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout}s") from None
            if match(event):
                return event


@pytest.fixture
def observer(bus: tuple[NodeProcess, str]) -> Iterator[Observer]:
    watcher = Observer(bus[1], frozenset({"claim", "delete", "node-down", "node-up"}))
    yield watcher
    watcher.runtime.join(timeout=START_S)


@pytest.fixture
def client() -> Iterator[Callable[[str], Client]]:
    import zmq

    ctx = zmq.Context()
    yield lambda endpoint: Client(ctx, endpoint, WireCodec("tester"), policy=RetryPolicy(timeout_s=START_S, attempts=1))
    ctx.destroy(linger=0)


def env_server(spawn: Callable[..., NodeProcess], control: str, node_id: str, *flags: str) -> tuple[NodeProcess, str]:
    proc = spawn(["node", "env-server", "--bus-control", control, "--node-id", node_id, *FAST_LIVENESS, *flags],
                 node_id)
    return proc, proc.wait_ready(START_S)["endpoints"]["blobs"]


def keep(client: Client, episode_id: str, branches: int) -> list[str]:
    arrays = [random_arrays(4, seed=i, layers=2, top_k=2, k=2, max_count=2, routing_dtype=np.uint8)
              for i in range(branches)]
    samples = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "ref": i} for i in range(branches)]
    kept = client.request(Keep(episode_id=episode_id, branches=arrays,
                               info={"group": episode_id, "reward": 1.0, "samples": samples})).body
    assert isinstance(kept, Kept)
    return [ref.blob_id for ref in kept.refs]


def is_down(node_id: str) -> Callable[[Message], bool]:
    return lambda event: event.kind == "node-down" and event.body.node_id == node_id


def is_delete(reason: str, node: str) -> Callable[[Message], bool]:
    return lambda event: isinstance(event.body, Delete) and (event.body.reason, event.body.node) == (reason, node)


def sigkill(proc: NodeProcess) -> None:
    proc.proc.kill()
    proc.proc.wait()


def test_a_peer_reported_down_ends_pending_and_new_requests_at_once(bus, spawn, observer: Observer) -> None:
    control = bus[1]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env, _ = env_server(spawn, control, "env-x", "--env-server-endpoint", endpoint)
    caller = NodeRuntime("caller", RuntimeSettings(bus=control, node_id="caller", metrics_port=-1,
                                                   heartbeat_interval_s=HEARTBEAT_S))
    peers = caller.track_peers()
    downs: queue.Queue[tuple[str, NodeInfo | None]] = queue.Queue()
    peers.on_down(lambda event, info: downs.put((event.node_id, info)))
    caller.start_background()
    outcomes: queue.Queue[Outcome] = queue.Queue()
    # Each attempt outlasts the node timeout many times: only the registry's node-down can end it early.
    patient = RetryPolicy(timeout_s=20 * NODE_TIMEOUT_S, attempts=3)

    def ask() -> None:
        caller.calls.request(endpoint, Claim(blob_ids=["b"], holder="caller"), outcomes.put, policy=patient)

    try:
        sigkill(env)
        caller.call_soon(ask)  # sent to a dead peer the registry does not know is dead yet
        pending = outcomes.get(timeout=sum(patient.timeouts()) + START_S)
        assert isinstance(pending, PeerDown) and "env-x reported down" in pending.reason, pending
        node_id, info = downs.get(timeout=START_S)
        assert node_id == "env-x" and info is not None and info.endpoints["blobs"] == endpoint
        caller.call_soon(ask)  # the registry says down: no attempt at all
        fresh = outcomes.get(timeout=START_S)
        assert isinstance(fresh, PeerDown) and "env-x reported down" in fresh.reason
        assert caller.calls.outcomes["peer-down"] == 2 and caller.calls.outcomes["timeout"] == 0
        # Back under the same id and endpoint: requests go through again.
        env_server(spawn, control, "env-x", "--env-server-endpoint", endpoint)
        observer.wait(lambda e: e.kind == "node-up" and e.body.node.node_id == "env-x", START_S, "env-x back up")
        answered = None
        while not isinstance(answered, Message):  # the caller may see node-up a little after the observer
            caller.call_soon(ask)
            answered = outcomes.get(timeout=sum(patient.timeouts()) + START_S)
        assert isinstance(answered.body, Claimed) and answered.body.missing == ["b"]
    finally:
        caller.join(START_S)


def test_a_host_paused_for_node_timeouts_gets_no_live_node_reported_down_and_a_node_that_died_meanwhile_soon(
        bus, spawn, observer: Observer) -> None:
    """A host whose processes did not run for three node timeouts (SIGSTOP here; a paused VM, a swapping host, a
    starved CPU), broker included: the broker woke up and reported every node down at once (``timeout``) before a
    heartbeat could reach it, live trainer ranks broke their world, requests to live peers failed and every store
    started the grace for what its holders hold (a soak that stopped the broker alone for 5-11 s saw it each time:
    its nodes' heartbeats had gone unanswered and were not yet in its sockets). The time the broker did not run
    counts toward no node's silence: the live node, woken after the broker's first liveness pass, stays up, and
    one SIGKILLed meanwhile is reported down about a node timeout after the wake-up."""
    broker, control = bus
    nodes = {name: spawn(["monitor", "--bus-control", control, "--node-id", name, *FAST_LIVENESS], name)
             for name in ("live", "dead")}
    up: set[str] = set()
    while up != set(nodes):
        up.add(observer.wait(lambda e: e.kind == "node-up" and e.body.node.node_id in nodes, START_S,
                             "both nodes up").body.node.node_id)
    for proc in (broker, nodes["live"]):
        proc.signal(signal.SIGSTOP)
    try:
        sigkill(nodes["dead"])
        # The pause itself: nothing can come from a stopped broker, so the wait is the stall, checked empty.
        with pytest.raises(queue.Empty):
            observer.events.get(timeout=3 * NODE_TIMEOUT_S)
        broker.signal(signal.SIGCONT)
        # Its first liveness pass after the wake-up, which judged before the live node could say anything.
        wait_for(lambda: any(word in broker.log_path.read_text() for word in ("bus.stalled", "node.down")),
                 START_S, "the broker's first liveness pass after the pause")
    finally:
        broker.signal(signal.SIGCONT)
        nodes["live"].signal(signal.SIGCONT)
    down = observer.wait(lambda e: e.kind == "node-down", 4 * NODE_TIMEOUT_S, "the dead node reported down")
    assert (down.body.node_id, down.body.reason) == ("dead", "timeout"), down.body
    # Nobody else, over two more node timeouts: the live nodes' heartbeats came through.
    with pytest.raises(AssertionError, match="no node-down"):
        observer.wait(lambda e: e.kind == "node-down", 2 * NODE_TIMEOUT_S, "node-down")


def test_the_orchestrator_names_a_killed_stores_blobs_lost_after_the_grace_and_goes_on(
        bus, spawn, observer: Observer, client) -> None:
    control = bus[1]
    grace_s = 1.0
    dead, dead_endpoint = env_server(spawn, control, "env-dead")
    _, live_endpoint = env_server(spawn, control, "env-live")
    orchestrator = spawn(["node", "orchestrator", "--bus-control", control, "--node-id", "orch", *FAST_LIVENESS,
                          "--node-metrics-port", "-1", "--node-restart-grace-s", str(grace_s)], "orch")
    orchestrator.wait_ready(START_S)
    wait_s = 10 * (NODE_TIMEOUT_S + grace_s) + START_S

    def claimed_by_orch(ids: list[str]) -> Callable[[Message], bool]:
        return lambda e: e.kind == "claim" and e.body.holder == "orch" and set(e.body.blob_ids) == set(ids)

    doomed = keep(client(dead_endpoint), "e-dead", 2)
    observer.wait(claimed_by_orch(doomed), wait_s, "the orchestrator's claim")
    sigkill(dead)
    observer.wait(is_down("env-dead"), wait_s, "env-dead down")
    lost = observer.wait(is_delete("lost", "env-dead"), wait_s, "the loss of env-dead's blobs").body
    assert lost.holder == "orch" and sorted(lost.blob_ids) == sorted(doomed)
    # The run goes on: the next episode, on the live replica, is claimed as before.
    fresh = keep(client(live_endpoint), "e-live", 1)
    observer.wait(claimed_by_orch(fresh), wait_s, "a claim after the loss")
    assert orchestrator.proc.poll() is None
    assert orchestrator.stop() == 0
    assert "blobs.lost" in orchestrator.log_path.read_text()


class HolderProcess:
    """A test node process (``proc``, its stdout a pipe) that a test kills or stops."""

    proc: subprocess.Popen

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(START_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(START_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()  # type: ignore[union-attr]


class Claimer(HolderProcess):
    """``tests/claimer_node.py`` as a process: registers as ``node_id`` and claims ``blob_ids``."""

    def __init__(self, control: str, node_id: str, endpoint: str, blob_ids: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(CLAIMER), control, node_id, endpoint, *blob_ids],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        readable, _, _ = select.select([self.proc.stdout], [], [], START_S)
        assert readable, f"{node_id} did not claim within {START_S}s"
        self.granted = json.loads(self.proc.stdout.readline())["granted"]  # type: ignore[union-attr]


def test_a_killed_holders_blobs_are_reclaimed_after_the_grace_unless_its_restart_claims_them_back(
        bus, spawn, observer: Observer, client) -> None:
    control = bus[1]
    grace_s = 5.0  # room for a holder process to restart and claim again
    _, endpoint = env_server(spawn, control, "env-h", "--node-restart-grace-s", str(grace_s))
    store = client(endpoint)
    ids_a, ids_b = keep(store, "ep-a", 2), keep(store, "ep-b", 1)
    wait_s = 10 * (NODE_TIMEOUT_S + grace_s) + START_S
    claimers: list[Claimer] = []
    try:
        claimers += [Claimer(control, "holder-a", endpoint, ids_a), Claimer(control, "holder-b", endpoint, ids_b)]
        assert (claimers[0].granted, claimers[1].granted) == (ids_a, ids_b)
        claimers[0].kill()
        observer.wait(is_down("holder-a"), wait_s, "holder-a down")
        # Restarted under the same id within the grace: it claims one of its blobs back (answered ok).
        claimers.append(Claimer(control, "holder-a", endpoint, ids_a[:1]))
        assert claimers[-1].granted == ids_a[:1]
        claimers[1].kill()  # after holder-a's node-down: its grace ends after holder-a's
        observer.wait(is_down("holder-b"), wait_s, "holder-b down")
        reclaimed_a = observer.wait(is_delete("holder-down", "holder-a"), wait_s, "holder-a's reclaim").body
        reclaimed_b = observer.wait(is_delete("holder-down", "holder-b"), wait_s, "holder-b's reclaim").body
        assert (reclaimed_a.blob_ids, reclaimed_a.holder) == (ids_a[1:], "env-h")
        assert (reclaimed_b.blob_ids, reclaimed_b.holder) == (ids_b, "env-h")
        kept = store.request(Fetch(blob_ids=ids_a, holder="tester")).body
        assert isinstance(kept, Blobs)
        assert [b.blob_id for b in kept.blobs] == ids_a[:1] and kept.missing == ids_a[1:]
        # A stale claim or delete of reclaimed blobs (a holder back from a partition): answered, not a violation.
        assert store.request(Delete(blob_ids=ids_b, holder="holder-b", reason="trained")).body == Deleted(
            blob_ids=[], reclaimed=ids_b)
        assert store.request(Claim(blob_ids=ids_b, holder="holder-b")).body == Claimed(blob_ids=[], reclaimed=ids_b)
    finally:
        for claimer in claimers:
            claimer.stop()


HAND_OVER_HOLDER = Path(__file__).with_name("hand_over_holder.py")
RANK_LABELS = {"rank": "0", CLAIMS_BACK: "0"}  # a trainer rank's registration: it claims nothing back


class Rank(HolderProcess):
    """``tests/hand_over_holder.py`` as a process: registers as ``node_id`` with ``labels`` and takes ``blob_ids``,
    which the orchestrator claimed, by publishing their hand-over; ``process``: its host, pid and start time."""

    def __init__(self, control: str, node_id: str, blob_ids: list[str], labels: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HAND_OVER_HOLDER), control, node_id, json.dumps(labels),
                                      *blob_ids], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, bufsize=0)
        self.process = tuple(json.loads(read_line(self.proc, START_S))["process"])



def _claimed(store: Client, episode_id: str, branches: int) -> list[str]:
    """Keep an episode and claim its blobs for the orchestrator (``orch``): what it hands over to a rank."""
    ids = keep(store, episode_id, branches)
    assert store.request(Claim(blob_ids=ids, holder="orch")).body == Claimed(blob_ids=ids)
    return ids


def test_a_rank_restarted_under_its_id_loses_what_its_killed_process_held_at_once_not_after_the_grace(
        bus, spawn, observer: Observer, client) -> None:
    """A trainer rank takes two blobs by hand-over and is SIGKILLed; a new process registers under its id (a world
    restart), which never claims back what the dead one held (its ``claims_back`` label): the store reclaims
    those blobs (``holder-down``, named with the rank) as soon as it hears the new process, not when the grace
    ends, and what the new process takes is its own. Before, they stayed for the whole grace (here far longer
    than the test waits), and a run that ended within it reported them held at its end."""
    control = bus[1]
    grace_s = 120.0  # far beyond what the test waits: what goes, goes on the new process's node-up
    _, endpoint = env_server(spawn, control, "env-r", "--node-restart-grace-s", str(grace_s),
                             "--env-server-handover-lease-s", str(5 * grace_s))
    store = client(endpoint)
    old, new = _claimed(store, "ep-old", 2), _claimed(store, "ep-new", 1)
    wait_s = 10 * NODE_TIMEOUT_S
    ranks: list[Rank] = []
    try:
        ranks.append(Rank(control, "trainer-r", old, RANK_LABELS))
        wait_for(lambda: accounted(store).held_by == {"trainer-r": 2, "orch": 1}, wait_s, "the rank's hand-over")
        ranks[0].kill()
        observer.wait(is_down("trainer-r"), wait_s, "the rank down")
        ranks.append(Rank(control, "trainer-r", new, RANK_LABELS))
        reclaimed = observer.wait(is_delete("holder-down", "trainer-r"), wait_s, "the dead process's reclaim").body
        assert (sorted(reclaimed.blob_ids), reclaimed.holder) == (sorted(old), "env-r")
        wait_for(lambda: accounted(store).held_by == {"trainer-r": 1}, wait_s, "the new process's hand-over")
        final = accounted(store)
        assert (final.reclaimed, final.deleted, final.violations) == ({"trainer-r": 2}, {"holder-down": 2}, {})
    finally:
        for rank in ranks:
            rank.stop()


def _garbage_rank_registrations(process: tuple[str, int, float]) -> list[NodeInfo]:
    """Registrations under a rank's id that prove nothing: its label with no process (pid 0, no host, a start time
    that is 0, negative, infinite or not a number), and a process without the label."""
    host, pid, started = process
    garbage = [(host, 0, started), ("", pid + 1, started), (host, pid + 1, 0.0), (host, pid + 1, -1.0),
               (host, pid + 1, float("inf")), (host, pid + 1, float("nan"))]
    forged = [NodeInfo(node_id="trainer-g", role="trainer", host=h, pid=p, started=t, labels=RANK_LABELS)
              for h, p, t in garbage]
    forged.append(NodeInfo(node_id="trainer-g", role="trainer", host=host, pid=pid + 1, started=started + 1))
    return forged


def test_registrations_with_garbage_process_fields_or_without_the_label_prove_no_rank_gone() -> None:
    """What a store reads from a ``node-up`` before it ends a grace early: only a real process that declares it
    never claims back."""
    process = ("host-a", 4242, 1_700_000_000.0)
    assert not any(claims_nothing_back(info) for info in _garbage_rank_registrations(process))
    real = NodeInfo(node_id="trainer-g", role="trainer", host="host-a", pid=4243, started=1_700_000_001.0,
                    labels=RANK_LABELS)
    assert claims_nothing_back(real)


def test_node_ups_another_node_publishes_are_refused_and_reclaim_nothing(
        bus, spawn, observer: Observer, client) -> None:
    """Registry events count from the broker only: ``node-up`` events naming a killed rank's id, published by
    another node (any node may publish any kind), are refused (``not-from-broker``, counted and logged) and end no
    grace, whatever their process fields say; a ``node-down`` so published reports no live node down. The rank's
    real new process then registers and the store reclaims what the dead one held at once."""
    control = bus[1]
    grace_s = 120.0  # far beyond what the test waits
    proc, endpoint = env_server(spawn, control, "env-g", "--node-restart-grace-s", str(grace_s),
                                "--env-server-handover-lease-s", str(5 * grace_s))
    store = client(endpoint)
    old = _claimed(store, "ep-old", 2)
    wait_s = 10 * NODE_TIMEOUT_S
    ranks: list[Rank] = []
    try:
        ranks.append(Rank(control, "trainer-g", old, RANK_LABELS))
        wait_for(lambda: accounted(store).held_by == {"trainer-g": 2}, wait_s, "the rank's hand-over")
        ranks[0].kill()
        observer.wait(is_down("trainer-g"), wait_s, "the rank down")
        forged: list[NodeUp | NodeDown] = [NodeUp(node=info) for info in _garbage_rank_registrations(ranks[0].process)]
        forged.append(NodeUp(node=NodeInfo(node_id="trainer-g", role="trainer", host=ranks[0].process[0],
                                           pid=ranks[0].process[1] + 1, started=time.time(), labels=RANK_LABELS)))
        forged.append(NodeDown(node_id="observer", role="observer", reason="timeout", last_seen=0.0))
        runtime = observer.runtime
        for body in forged:
            runtime.call_soon(lambda body=body: runtime.publish(body))
        wait_for(lambda: proc.log_path.read_text().count('"not-from-broker"') == len(forged), wait_s,
                 "the store refusing every forged registry event")
        assert '"holder.restarted"' not in proc.log_path.read_text()
        after = accounted(store)
        assert (after.held_by, after.reclaimed, after.deleted) == ({"trainer-g": 2}, {}, {}), after
        ranks.append(Rank(control, "trainer-g", [], RANK_LABELS))
        reclaimed = observer.wait(is_delete("holder-down", "trainer-g"), wait_s, "the dead process's reclaim").body
        assert sorted(reclaimed.blob_ids) == sorted(old)
        assert accounted(store).held_by == {}
    finally:
        for rank in ranks:
            rank.stop()


SERVED_PEER = Path(__file__).with_name("served_peer.py")
RESTARTS = 5


class ServedPeer:
    """``tests/served_peer.py`` as a process: registers as ``node_id`` and serves ``claim`` on a new ephemeral
    port each start (its ``endpoint``). ``wait``: return once it registered (else call :meth:`registered`: one
    started while no broker answers registers once one does, within its connect timeout)."""

    def __init__(self, control: str, node_id: str, *, wait: bool = True) -> None:
        self.node_id = node_id
        self.endpoint = ""
        self.proc = subprocess.Popen([sys.executable, str(SERVED_PEER), control, node_id],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if wait:
            self.registered()

    def registered(self) -> str:
        """Wait (at most ``START_S``) until it registered; its endpoint."""
        readable, _, _ = select.select([self.proc.stdout], [], [], START_S)
        assert readable, f"{self.node_id} did not register within {START_S}s"
        self.endpoint = json.loads(self.proc.stdout.readline())["endpoint"]  # type: ignore[union-attr]
        return self.endpoint

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(START_S)
        self.proc.stdout.close()  # type: ignore[union-attr]


def test_a_peer_restarted_on_new_ports_leaves_no_client_and_no_file_descriptor_behind(bus) -> None:
    """A peer SIGKILLed and restarted under the same id, each time on a new port (as under ``refbus up``): the
    caller tracking peers closes its client to every old endpoint, so neither its clients nor its open file
    descriptors grow with the restarts, and the new endpoint answers each time."""
    control = bus[1]
    caller = NodeRuntime("caller", RuntimeSettings(bus=control, node_id="caller", metrics_port=-1,
                                                   heartbeat_interval_s=HEARTBEAT_S))
    ups: queue.Queue[NodeInfo] = queue.Queue()
    caller.track_peers().on_up(ups.put)
    caller.start_background()
    outcomes: queue.Queue[Outcome] = queue.Queue()
    policy = RetryPolicy(timeout_s=START_S, attempts=1)

    def claim(endpoint: str) -> Outcome:
        caller.call_soon(lambda: caller.calls.request(endpoint, Claim(blob_ids=["b"], holder="caller"), outcomes.put,
                                                      policy=policy))
        return outcomes.get(timeout=policy.deadline_s + START_S)

    def state() -> tuple[int, list[str]]:
        """Open file descriptors of this process and the caller's clients, read on the caller's loop."""
        answer: queue.Queue[tuple[int, list[str]]] = queue.Queue()
        caller.call_soon(lambda: answer.put((len(os.listdir("/proc/self/fd")), sorted(caller.calls._clients))))
        return answer.get(timeout=START_S)

    def up(endpoint: str) -> None:
        while ups.get(timeout=START_S).endpoints.get("rpc") != endpoint:
            pass  # another node, or an earlier start of this one

    peer: ServedPeer | None = None
    fds: list[int] = []
    left: list[str] = []
    try:
        for _ in range(RESTARTS + 1):
            if peer is not None:
                left.append(peer.endpoint)
                peer.kill()
            peer = ServedPeer(control, "peer-x")
            up(peer.endpoint)
            reply = claim(peer.endpoint)
            assert isinstance(reply, Message) and reply.body == Claimed(blob_ids=[], missing=["b"]), reply
            open_fds, clients = state()
            assert clients == sorted([control, peer.endpoint])  # the old endpoints' clients are gone
            fds.append(open_fds)
        # ZeroMQ closes a socket's descriptors on its own thread, a moment after: wait for them, bounded.
        deadline = time.monotonic() + START_S
        while (open_fds := state()[0]) > fds[0] + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_fds <= fds[0] + 2, f"open descriptors grew with the restarts: {fds} then {open_fds}"
        # A request to a dead endpoint fails at once (its node was reported down) and makes no client.
        assert isinstance(claim(left[-1]), PeerDown)
        assert state()[1] == sorted([control, peer.endpoint])
    finally:
        if peer is not None and peer.proc.poll() is None:
            peer.kill()
        caller.join(START_S)
