"""One node id, one live process: a real broker refuses a second live process under an id another one holds and
heartbeats for (exit 2, naming the holder), on another host or on the holder's (where it finds the durable store
locked first), leaves the holder serving with nothing taken from it, refuses forged registrations the same way,
and still lets a process restarted after a SIGKILL take its id back."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import holds_for, wait_for
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy
from refbus.bus.runtime import ID_IN_USE
from refbus.bus.sockets import make_socket
from refbus.nodes.halting import CONFIG_STATUS
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Error, Hello, Keep, Kept, NodeInfo, Nodes, Welcome

NODE_TIMEOUT_S = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
START_S = 30.0  # a node process starting, imports included
# The broker decides on a contender within half its node timeout of its first ask (a silent holder) or at the
# holder's next heartbeat (a live one); a few node timeouts bound that with room for a loaded machine.
DECIDED_S = 4 * NODE_TIMEOUT_S


def _registry(control: str) -> dict[str, dict]:
    listed = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "nodes", "--json", "--bus-control", control],
                            capture_output=True, text=True, timeout=START_S, check=True)
    return {entry["node_id"]: entry for entry in json.loads(listed.stdout)}


def _liveness_events(path: Path) -> list[tuple[str, str, str]]:
    """(type, node id, reason) of the node-up and node-down events a ``monitor --json`` wrote to ``path``."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["type"], r.get("node_id") or r["node"]["node_id"], r.get("reason", "")) for r in records]


def _watch(spawn, control: str, out: Path) -> NodeProcess:
    """A monitor writing every node-up and node-down to ``out`` as JSON lines (wait for it to be ready)."""
    return spawn(["monitor", "--json", "--bus-control", control, *FAST_LIVENESS, "--node-id", "watcher",
                  "--kind", "node-up", "--kind", "node-down"], "watcher", stdout=open(out, "wb"))


def _seen_after_marker(spawn, control: str, out: Path) -> list[tuple[str, str, str]]:
    """The watcher's liveness events up to a marker node's node-up: the broker emits its events in order, so every
    event it emitted before the marker registered is among them."""
    marker = spawn(["monitor", "--bus-control", control, *FAST_LIVENESS, "--node-id", "marker"], "marker")
    marker.wait_ready(START_S)
    wait_for(lambda: ("node-up", "marker", "") in _liveness_events(out), DECIDED_S, "the marker's node-up")
    return _liveness_events(out)


@pytest.mark.parametrize("node_id", ["../x", "-rf", "a\nb", "env/0", "n\u00e9"])
def test_a_node_given_a_node_id_that_is_none_exits_2_naming_it_before_it_makes_anything(
        tmp_path: Path, node_id: str) -> None:
    """Before, any ``--node-id`` was taken: ``env/0`` made the store directory ``refbus-store.<run>.env_0``, which
    ``env_0``'s process then adopted as its own (and ``../x`` named a key file outside the key directory). Now it is
    refused at the flag, exit 2, and nothing is made; no broker is needed to be told."""
    shm = tmp_path / "shm"
    result = subprocess.run(
        [sys.executable, "-m", "refbus.nodes.cli", "node", "env-server", f"--node-id={node_id}",
         "--store-directory", str(shm), "--bus-control", "tcp://127.0.0.1:9", "--node-connect-timeout-s", "1",
         "--node-metrics-port", "-1"], capture_output=True, text=True, timeout=START_S, stdin=subprocess.DEVNULL)
    assert result.returncode == CONFIG_STATUS, result.stderr
    said = result.stderr.splitlines()[-1]
    assert f"--node-id: node id {node_id!r} is not 1 to 256 letters" in said and "Traceback" not in result.stderr, said
    assert not shm.exists()


def test_a_second_live_process_under_one_node_id_exits_2_and_the_first_keeps_serving_until_killed(
        bus, spawn, tmp_path: Path) -> None:
    """Two env servers started with ``--node-id env-0`` on two hosts (their own store directories): before, the
    second registered, the first was reported down (``replaced``: its peers dropped its endpoints and its blobs)
    while it went on serving, its heartbeats answered for the second. Now the second is refused once the broker
    hears the first heartbeat, and exits 2 naming the holder; the first stays registered as it was, never
    reported down, and serves. Once the first is SIGKILLed, a process started under the id again comes up."""
    _, control = bus
    events = tmp_path / "liveness.jsonl"
    _watch(spawn, control, events).wait_ready(START_S)

    def env_server(name: str) -> NodeProcess:
        return _env_server(spawn, control, name, tmp_path / name)

    first = env_server("first")
    blobs = first.wait_ready(START_S)["endpoints"]["blobs"]
    held = _registry(control)["env-0"]
    second = env_server("second")
    assert second.proc.wait(timeout=START_S + DECIDED_S) == CONFIG_STATUS, second.log_tail()
    said = second.log_tail().splitlines()[-1]
    assert said.startswith("refbus: ") and "'env-0'" in said and f"pid {first.pid} " in said, said
    assert "still heartbeats" in said and f"this process is pid {second.pid} " in said, said

    assert first.proc.poll() is None and _unchanging(_registry(control)["env-0"]) == _unchanging(held)
    assert ("node-down", "env-0", "replaced") not in _seen_after_marker(spawn, control, events)
    ctx = zmq.Context()
    client = Client(ctx, blobs, WireCodec("tester"), policy=RetryPolicy(timeout_s=START_S, attempts=1))
    try:
        assert isinstance(client.request(Keep(episode_id="ep", branches=[random_arrays(4, seed=1)])).body, Kept)
    finally:
        client.close()
        ctx.term()

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=START_S)
    restarted = env_server("restarted")
    restarted.wait_ready(START_S + DECIDED_S)
    wait_for(lambda: _registry(control)["env-0"]["pid"] == restarted.pid, DECIDED_S, "the restart registered")


def test_a_second_live_process_under_one_node_id_on_its_host_exits_2_naming_the_store_and_the_holder(
        bus, spawn, tmp_path: Path) -> None:
    """Two env servers started with ``--node-id env-0`` on one host (one store directory): before, the second found
    the store locked, as a predecessor not yet dead would hold it, and exited 1, which a supervisor restarts until
    its budget is spent, naming the holder each time. Now it asks the broker, which hears the holder heartbeat: it
    exits 2, naming the store and the holder; the holder stays registered as it was."""
    _, control = bus
    first = _env_server(spawn, control, "first", tmp_path / "shm")
    first.wait_ready(START_S)
    held = _unchanging(_registry(control)["env-0"])
    second = _env_server(spawn, control, "second", tmp_path / "shm")
    assert second.proc.wait(timeout=START_S + DECIDED_S) == CONFIG_STATUS, second.log_tail()
    said = second.log_tail().splitlines()[-1]
    assert said.startswith("refbus: store ") and f"held by process {first.pid}:" in said, said
    assert f"'env-0' is held by env-server pid {first.pid} " in said and "still heartbeats" in said, said
    assert first.proc.poll() is None and _unchanging(_registry(control)["env-0"]) == held


def _env_server(spawn, control: str, name: str, store: Path) -> NodeProcess:
    """An env server started as ``--node-id env-0``, its durable store under ``store``."""
    return spawn(["node", "env-server", "--bus-control", control, *FAST_LIVENESS, "--node-id", "env-0",
                  "--store-directory", str(store), "--store-run", "ids", "--env-server-handover-lease-s", "600"], name)


def _unchanging(entry: dict) -> dict:
    """A registry entry less what every heartbeat changes."""
    return {key: value for key, value in entry.items() if key not in ("last_seen", "status")}


def test_forged_registrations_never_evict_a_live_holder(bus, spawn, tmp_path: Path) -> None:
    """Hellos claiming a live node's id with made-up incarnations (another host and pid; its own host and pid with
    another start time; a start time that is no time) are each asked to wait, then refused for good once the
    holder heartbeats: the holder stays registered as it was and is never reported down. A holder's start time that
    is no time at all is said so in the refusal."""
    _, control = bus
    events = tmp_path / "liveness.jsonl"
    _watch(spawn, control, events).wait_ready(START_S)
    holder = spawn(["monitor", "--bus-control", control, *FAST_LIVENESS, "--node-id", "holder"], "holder")
    holder.wait_ready(START_S)
    before = _unchanging(_registry(control)["holder"])
    ctx = zmq.Context()
    client = Client(ctx, control, WireCodec("forger"), policy=RetryPolicy(timeout_s=START_S, attempts=1))

    def refusal(node: NodeInfo) -> RemoteError:
        try:
            reply = client.request(Hello(node=node, token=f"t-{node.pid}-{node.started}", wire=[2]))
        except RemoteError as exc:
            assert exc.code == ID_IN_USE and "'holder'" in exc.detail and f"pid {holder.pid} " in exc.detail, exc
            return exc
        raise AssertionError(f"a forged hello was let in: {reply.body}")

    forgeries = [NodeInfo(node_id="holder", role="monitor", host="elsewhere", pid=4242, started=1.0),
                 NodeInfo(node_id="holder", role="monitor", host=before["host"], pid=holder.pid,
                          started=before["started"] + 1.0),
                 NodeInfo(node_id="holder", role="monitor", host="h", pid=7, started=math.nan)]
    try:
        for forged in forgeries:
            assert refusal(forged).retry_after_s > 0
            final = wait_for(lambda forged=forged: (exc := refusal(forged)).retry_after_s == 0 and exc, DECIDED_S,
                             "the refusal for good")
            assert "still heartbeats" in final.detail
        # A registration that is no time at all holds its id as any other does, its refusals still said.
        ghost = NodeInfo(node_id="ghost", role="monitor", host="h", pid=1, started=math.inf)
        client.request(Hello(node=ghost, token="t-ghost", wire=[2]))
        with pytest.raises(RemoteError, match="started at an unknown time") as refused:
            client.request(Hello(node=msgspec.structs.replace(ghost, pid=2), token="t-ghost-2", wire=[2]))
        assert refused.value.code == ID_IN_USE and refused.value.retry_after_s > 0
    finally:
        client.close()
        ctx.term()
    assert holder.proc.poll() is None and _unchanging(_registry(control)["holder"]) == before
    assert not [event for event in _seen_after_marker(spawn, control, events) if event[:2] == ("node-down", "holder")]


HEARTBEAT_S = 0.2
# Half the node timeout well above the broker's stop below: the dead holder is still within it when the restart's
# first ask is handled, whatever the broker handles first.
LATE_TIMEOUT_S = 3.0
LATE_LIVENESS = ["--bus-heartbeat-interval-s", str(HEARTBEAT_S), "--bus-node-timeout-s", str(LATE_TIMEOUT_S)]


def test_a_restart_is_never_refused_for_good_on_heartbeats_its_predecessor_sent_before_it_died(
        spawn, tmp_path: Path) -> None:
    """A node SIGKILLed while heartbeats it sent are still queued at a busy broker (stopped here, SIGSTOP), and its
    restart's hello queued behind them: the broker handles some of those heartbeats after the restart's first ask.
    Before, they counted as the holder heard after the ask, and the restart was refused for good (exit 2, which
    ends a whole run); now only a heartbeat that arrived after the ask counts, and the restart takes the id once
    its dead predecessor has been silent for half the node timeout."""
    bus, control = start_bus(tmp_path, extra=LATE_LIVENESS)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=control)
    codec = WireCodec("restart")

    def ask(body: Hello | Nodes) -> object:
        sock.send_multipart(codec.encode(body))
        assert sock.poll(START_S * 1000), f"the broker did not answer {body.kind}"
        return codec.decode(sock.recv_multipart()).body

    def let_in(answer: object) -> bool:
        assert isinstance(answer, Welcome) or (isinstance(answer, Error) and answer.code == ID_IN_USE
                                               and answer.retry_after_s > 0), answer
        return isinstance(answer, Welcome)

    try:
        holder = spawn(["monitor", "--bus-control", control, *LATE_LIVENESS, "--node-id", "a"], "holder")
        held = holder.wait_ready(START_S)
        ask(Nodes())  # connected before the broker stops: its hello then queues there beside the heartbeats
        restart = Hello(node=NodeInfo(node_id="a", role="monitor", host=held["host"], pid=holder.pid + 1,
                                      started=time.time()), token="restart", wire=[2])
        bus.signal(signal.SIGSTOP)
        try:
            holds_for(lambda: holder.proc.poll() is None, 3 * HEARTBEAT_S, "the holder beating at a stopped broker")
            holder.signal(signal.SIGKILL)
            holder.proc.wait(START_S)
            sock.send_multipart(codec.encode(restart))
            holds_for(lambda: bus.proc.poll() is None, HEARTBEAT_S, "the stopped broker, the hello on its way")
        finally:
            bus.signal(signal.SIGCONT)
        assert sock.poll(START_S * 1000), "the broker did not answer the queued hello"
        if not let_in(codec.decode(sock.recv_multipart()).body):
            wait_for(lambda: let_in(ask(restart)), 4 * LATE_TIMEOUT_S, "the restart let in", poll_s=HEARTBEAT_S)
    finally:
        sock.close(linger=0)
        ctx.term()
        assert bus.stop() == 0, bus.log_tail()


def test_a_node_whose_store_is_held_says_so_when_the_broker_has_no_room_to_say_whose_its_id_is(
        spawn, tmp_path: Path) -> None:
    """An env server whose store a stalled holder (SIGSTOP, expired) still locks asks the broker whether its id is
    held, the broker's registry full (``bus.max_nodes``): its hello was refused ``registry-full``, which escaped as
    a traceback in place of the last words (a refusal not about the id is no verdict on it; a probe now takes no
    place, so the id is found free); the node exits 1 (restarted) naming the store and its holder."""
    bus, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, "--bus-max-nodes", "1"])
    ctx = zmq.Context()
    client = Client(ctx, control, WireCodec("tester"), policy=RetryPolicy(timeout_s=START_S, attempts=1))
    holder = _env_server(spawn, control, "holder", tmp_path / "shm")
    try:
        holder.wait_ready(START_S)
        holder.signal(signal.SIGSTOP)
        wait_for(lambda: not client.request(Nodes()).body.nodes, DECIDED_S, "the stalled holder expired")
        filler = spawn(["monitor", "--bus-control", control, *FAST_LIVENESS, "--node-id", "filler"], "filler")
        filler.wait_ready(START_S)  # the registry's one place, kept by its heartbeats
        second = _env_server(spawn, control, "second", tmp_path / "shm")
        assert second.proc.wait(timeout=START_S + DECIDED_S) == 1, second.log_tail()
        said = second.log_tail()
        assert "Traceback" not in said and said.splitlines()[-1].startswith("refbus: store "), said
        assert f"held by process {holder.pid}:" in said.splitlines()[-1], said
    finally:
        holder.signal(signal.SIGCONT)
        client.close()
        ctx.term()
        holder.stop()
        assert bus.stop() == 0, bus.log_tail()


PROBE_TIMEOUT_S = 8.0  # past the second process's start and half of it: the holder stalled that long is not expired
PROBE_LIVENESS = ["--bus-heartbeat-interval-s", str(HEARTBEAT_S), "--bus-node-timeout-s", str(PROBE_TIMEOUT_S)]


def test_a_process_asking_whose_its_id_is_never_replaces_a_holder_merely_slow(spawn, tmp_path: Path) -> None:
    """Env servers under one node id on one host, the holder stalled (SIGSTOP) past half the node timeout but not
    the node timeout while the others, finding the store locked, ask the broker whose the id is: before, the ask was
    a hello the broker let in, replacing the holder (reported down, ``replaced``: its peers drop its blobs) until
    its bye; now it is a probe, answered without registering or replacing anything. One of them SIGKILLed while
    its probe waits leaves nothing either; the other exits 1 naming the store, and the holder, resumed, was never
    reported down and keeps its entry."""
    bus, control = start_bus(tmp_path, extra=PROBE_LIVENESS)
    try:
        events = tmp_path / "liveness.jsonl"
        _watch(spawn, control, events).wait_ready(START_S)
        holder = _env_server(spawn, control, "holder", tmp_path / "shm")
        holder.wait_ready(START_S)
        held = _unchanging(_registry(control)["env-0"])
        holder.signal(signal.SIGSTOP)
        try:
            killed = _env_server(spawn, control, "killed", tmp_path / "shm")
            second = _env_server(spawn, control, "second", tmp_path / "shm")
            wait_for(lambda: "node.id_held" in killed.log_tail(), START_S, "the probe waiting on the holder")
            killed.signal(signal.SIGKILL)
            assert second.proc.wait(timeout=START_S + PROBE_TIMEOUT_S) == 1, second.log_tail()
        finally:
            holder.signal(signal.SIGCONT)
        said = second.log_tail().splitlines()[-1]
        assert said.startswith("refbus: store ") and f"held by process {holder.pid}:" in said, said
        assert holder.proc.poll() is None and _unchanging(_registry(control)["env-0"]) == held
        seen = _seen_after_marker(spawn, control, events)
        assert not [event for event in seen if event[:2] == ("node-down", "env-0")], seen
    finally:
        assert bus.stop() == 0, bus.log_tail()


def test_a_replaced_process_stopped_before_it_was_told_leaves_the_process_that_took_its_id_registered(
        bus, spawn, tmp_path: Path) -> None:
    """A node stalled (SIGSTOP) until the broker expired it, its id registered by another process meanwhile, then
    stopped (SIGTERM, pending until SIGCONT) before any heartbeat of it was answered ``replaced``: before, its bye
    named only the node id, and the broker removed the other process's entry (a live node reported down, up again
    at its next heartbeat); now the bye names its process, and the broker refuses it: the live process keeps its
    entry and is never reported down."""
    broker, control = bus
    events = tmp_path / "liveness.jsonl"
    _watch(spawn, control, events).wait_ready(START_S)

    def monitor(name: str) -> NodeProcess:
        return spawn(["monitor", "--bus-control", control, *FAST_LIVENESS, "--node-id", "dup"], name)

    first = monitor("first")
    first.wait_ready(START_S)
    first.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: ("node-down", "dup", "timeout") in _liveness_events(events), DECIDED_S, "the stall expired")
        second = monitor("second")
        second.wait_ready(START_S)
        first.signal(signal.SIGTERM)  # handled once resumed: the loop stops before it sends another heartbeat
    finally:
        first.signal(signal.SIGCONT)
    assert first.proc.wait(START_S) == 0, first.log_tail()
    seen = [event for event in _seen_after_marker(spawn, control, events) if event[1] == "dup"]
    assert seen == [("node-up", "dup", ""), ("node-down", "dup", "timeout"), ("node-up", "dup", "")], seen
    assert _registry(control)["dup"]["pid"] == second.pid
    assert second.proc.poll() is None
    assert "registry.bye_refused" in broker.log_tail(200), broker.log_tail()
