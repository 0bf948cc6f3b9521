"""Bounded exits: after SIGTERM a node process is gone within ``node.shutdown_timeout_s``, its final events
(shutdown deletes, ``bye``) in the stream; a shutdown hook that would block longer is cut off and the ``bye``
still goes out, without touching the sockets the hook may still use; the orchestrator's shutdown deletes against
a store that was killed end by the deadline, and at once when the registry already reports the store down."""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import exiting_roles
import numpy as np
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import holds_for, read_line, wait_for
from refbus.bus.reqrep import Client, RemoteError, RequestTimeout, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.halting import CONFIG_STATUS
from refbus.nodes.launch import NodeProcess, _die_with_parent, start_bus
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Body, Claim, Delete, EpisodeFinished, Keep, Kept, NodeDown
from structlog.testing import capture_logs

SHUTDOWN_S = 2.0
SHUTDOWN = ["--node-shutdown-timeout-s", str(SHUTDOWN_S)]
# The bound under test is node.shutdown_timeout_s; the slack covers reaping the process on a loaded machine.
GONE_S = 1.5 * SHUTDOWN_S
START_S = 30.0  # a node process ready (imports on busy cores)
NODE_TIMEOUT_S = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
KEEP = RetryPolicy()  # the configured request policy (requests.* defaults): its deadline bounds a keep


class Stream:
    """An in-process node that records every event from the bus (its loop runs in a thread)."""

    def __init__(self, control: str) -> None:
        self.runtime = NodeRuntime("observer", RuntimeSettings(bus=control, node_id="observer", metrics_port=-1))
        self.events: queue.Queue[Message] = queue.Queue()
        self.seen: list[Body] = []
        self.runtime.subscribe(self.events.put)
        self.runtime.start_background()

    def wait(self, match: Callable[[Body], bool], timeout: float, what: str) -> Body:
        def found() -> Body | None:
            while not self.events.empty():
                self.seen.append(self.events.get_nowait().body)
            return next((body for body in self.seen if match(body)), None)

        return wait_for(found, timeout, what)

    def close(self) -> None:
        self.runtime.join(timeout=GONE_S)


@pytest.fixture
def stream(bus: tuple[NodeProcess, str]) -> Iterator[Stream]:
    watcher = Stream(bus[1])
    yield watcher
    watcher.close()


@pytest.fixture
def nodes(tmp_path: Path, bus: tuple[NodeProcess, str]) -> Iterator[Callable[..., NodeProcess]]:
    """``nodes(role, name, *flags)``: a ready node process on the test's broker; every one reaped."""
    started: list[NodeProcess] = []

    def start(role: str, name: str, *flags: str) -> NodeProcess:
        node = NodeProcess(["node", role, "--bus-control", bus[1], "--node-id", name, *FAST_LIVENESS, *SHUTDOWN,
                            *flags], workdir=tmp_path, name=name)
        started.append(node)
        node.wait_ready(START_S)
        return node

    yield start
    for node in started:
        node.stop()


def keep_episode(endpoint: str, episode_id: str) -> list[str]:
    """Keep one two-branch episode on an env server (as a rollout worker would), each branch a sample of its
    record, so an orchestrator holds them until its group completes; its blob ids. Fails, naming
    the env server and why, when it does not keep it by the configured request policy's deadline (KEEP: three
    attempts from ``requests.timeout_s``, 7 timeouts in all); the socket is closed whatever happened, since the
    context's term waits for every socket of it."""
    branches = [random_arrays(4, seed=s, layers=2, top_k=2, k=3, max_count=2, routing_dtype=np.uint8)
                for s in (1, 2)]
    samples = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "ref": i} for i in range(len(branches))]
    ctx = zmq.Context()
    client = Client(ctx, endpoint, WireCodec("tester"), policy=KEEP)
    try:
        kept = client.request(Keep(episode_id=episode_id, branches=branches,
                                   info={"group": episode_id, "reward": 1.0, "samples": samples})).body
    except (RequestTimeout, RemoteError) as exc:
        raise AssertionError(f"the env server at {endpoint} did not keep {episode_id!r}: {exc}") from exc
    finally:
        client.close()
        ctx.term()
    assert isinstance(kept, Kept), kept
    return [ref.blob_id for ref in kept.refs]


def terminate(node: NodeProcess) -> float:
    """SIGTERM; the seconds until the process was gone (fails after GONE_S). It exits cleanly."""
    sent = time.monotonic()
    node.signal(signal.SIGTERM)
    wait_for(lambda: node.proc.poll() is not None, GONE_S, f"{node.name} gone after SIGTERM")
    assert node.proc.returncode == 0, node.log_tail()
    return time.monotonic() - sent


def said_bye(name: str) -> Callable[[Body], bool]:
    return lambda body: isinstance(body, NodeDown) and body.node_id == name and body.reason == "bye"


@pytest.mark.parametrize("role", ["env-server", "orchestrator", "ps-manager", "ps-worker"])
def test_sigterm_ends_each_role_within_the_shutdown_timeout_with_its_final_events(
    role: str, nodes: Callable[..., NodeProcess], stream: Stream
) -> None:
    flags: list[str] = []
    if role == "ps-worker":
        manager = nodes("ps-manager", "manager", "--ps-manager", "tcp://127.0.0.1:0")
        flags = ["--ps-manager", manager.info["endpoints"]["ps"]]
    elif role == "ps-manager":
        flags = ["--ps-manager", "tcp://127.0.0.1:0"]
    node = nodes(role, "node-under-test", *flags)
    kept: list[str] = []
    if role == "env-server":  # a blob still held at SIGTERM: its shutdown delete is a final event
        kept = keep_episode(node.info["endpoints"]["blobs"], "ep-held")
        stream.wait(lambda b: isinstance(b, EpisodeFinished), START_S, "the kept episode announced")

    took = terminate(node)

    stream.wait(said_bye("node-under-test"), SHUTDOWN_S, "the node's bye")
    if kept:
        delete = stream.wait(lambda b: isinstance(b, Delete), SHUTDOWN_S, "the shutdown delete")
        assert sorted(delete.blob_ids) == sorted(kept) and delete.reason == "shutdown"  # type: ignore[attr-defined]
    print(f"{role}: gone {took:.2f}s after SIGTERM")


SLOW_EXIT = """
import time


class SlowToFinalize:
    \"\"\"Held by a module, so the interpreter's exit finalizes it: as slow as tearing torch down on busy cores.\"\"\"

    def __del__(self) -> None:
        time.sleep(60)


held = SlowToFinalize()
"""


def test_a_node_is_gone_within_the_shutdown_timeout_however_slow_its_interpreters_exit(
    nodes: Callable[..., NodeProcess], stream: Stream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter's exit is not waited for: once it has begun, the exit watchdog's thread can no longer run,
    so a slow finalization (here a minute, from a sitecustomize every Python process of the node imports) would
    hold the process past ``node.shutdown_timeout_s``."""
    site = tmp_path / "slow-exit"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_EXIT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    node = nodes("env-server", "slow-exit")
    terminate(node)  # gone within GONE_S, status 0
    stream.wait(said_bye("slow-exit"), SHUTDOWN_S, "the node's bye")


def test_a_blocking_shutdown_hook_is_cut_off_and_the_bye_still_goes_out(
    bus: tuple[NodeProcess, str], stream: Stream
) -> None:
    runtime = NodeRuntime("stuck", RuntimeSettings(bus=bus[1], node_id="stuck", metrics_port=-1,
                                                   shutdown_timeout_s=SHUTDOWN_S))
    release = threading.Event()
    later_hook_ran = threading.Event()
    runtime.shutdown_hooks.append(lambda: release.wait(60))  # a hook that would block far beyond the deadline
    runtime.shutdown_hooks.append(later_hook_ran.set)
    try:
        with capture_logs() as logs:
            runtime.start_background()
            runtime.join(timeout=GONE_S)
        assert runtime.loop_thread is not None and not runtime.loop_thread.is_alive()
        # The close went on without the hook: it was cut off at its share of the deadline, and the node stopped.
        events = [entry["event"] for entry in logs]
        assert events.count("node.shutdown_hook_cut_off") == 1 and "node.stopped" in events, events
        stream.wait(said_bye("stuck"), SHUTDOWN_S, "the bye of the node whose hook was cut off")
        assert not later_hook_ran.is_set()  # hooks after a cut-off one do not run concurrently with the close
    finally:
        release.set()


def test_a_cut_off_hook_keeps_the_sockets_it_uses_and_the_bye_goes_out_on_one_of_its_own(
    bus: tuple[NodeProcess, str], stream: Stream
) -> None:
    """A hook cut off while it still uses the node's sockets (here ``calls.run_until``, polling the broker's
    control client, after publishing an event): ZeroMQ sockets are not thread-safe, and the close used to prove
    the final events and say ``bye`` on those very sockets from its own thread meanwhile (libzmq may abort the
    process). The close now touches neither the control client nor the PUB socket, nor the calls: the bye goes
    out on a socket of its own, and the hook's thread releases the sockets once the hook returns."""
    runtime = NodeRuntime("stuck", RuntimeSettings(bus=bus[1], node_id="stuck-polling", metrics_port=-1,
                                                   shutdown_timeout_s=SHUTDOWN_S))
    release = threading.Event()
    hook_thread: list[threading.Thread] = []
    used: list[str] = []  # what touched the hook's sockets from another thread while the hook ran

    def polling_hook() -> None:
        hook_thread.append(threading.current_thread())
        runtime.publish(Delete(blob_ids=["b-final"], holder="stuck-polling", reason="shutdown"))
        while not release.is_set():  # nothing pending wakes run_until: short turns
            runtime.calls.run_until(release.is_set, 0.05)

    def on_hook_sockets(name: str, method: Callable[..., object]) -> Callable[..., object]:
        def guarded(*args: object, **kwargs: object) -> object:
            if hook_thread and threading.current_thread() is not hook_thread[0] and not release.is_set():
                used.append(name)
                raise RuntimeError(f"{name} while a cut-off hook uses the sockets")
            return method(*args, **kwargs)

        return guarded

    runtime.shutdown_hooks.append(polling_hook)
    try:
        runtime.start_background()
        assert runtime.control is not None and runtime.publisher is not None
        runtime.control.request = on_hook_sockets("control.request", runtime.control.request)  # type: ignore[method-assign]
        runtime.control.send = on_hook_sockets("control.send", runtime.control.send)  # type: ignore[method-assign]
        runtime.publisher.publish_raw = on_hook_sockets("publish_raw", runtime.publisher.publish_raw)  # type: ignore[method-assign]
        runtime.calls.close = on_hook_sockets("calls.close", runtime.calls.close)  # type: ignore[method-assign]
        with capture_logs() as logs:
            runtime.join(timeout=GONE_S)
        assert runtime.loop_thread is not None and not runtime.loop_thread.is_alive()
        assert used == []
        events = [entry["event"] for entry in logs]
        assert events.count("node.shutdown_hook_cut_off") == 1 and "events.unconfirmed" in events, events
        stream.wait(said_bye("stuck-polling"), SHUTDOWN_S, "the bye of the node whose hook was cut off")
        assert not runtime.ctx.closed  # the hook still holds the sockets
    finally:
        release.set()
    wait_for(lambda: runtime.ctx.closed, SHUTDOWN_S, "the hook's thread releasing the sockets")


@pytest.mark.parametrize("registry_knows", [True, False], ids=["store-reported-down", "store-just-killed"])
def test_orchestrator_shutdown_deletes_against_a_killed_store_end_by_the_deadline(
    registry_knows: bool, nodes: Callable[..., NodeProcess], stream: Stream
) -> None:
    """The orchestrator holds an incomplete group's blobs on an env server that is then SIGKILLed: its
    shutdown deletes cannot reach it. The default retry schedule (14 s) is far longer than the deadline. A
    store the registry already reports down is not asked at all: what it held is published as lost."""
    env = nodes("env-server", "env-0")
    orchestrator = nodes("orchestrator", "orchestrator")
    kept = keep_episode(env.info["endpoints"]["blobs"], "ep-claimed")
    stream.wait(lambda b: isinstance(b, Claim) and b.holder == "orchestrator", START_S, "the orchestrator's claim")
    env.signal(signal.SIGKILL)
    env.proc.wait()
    if registry_knows:
        stream.wait(lambda b: isinstance(b, NodeDown) and b.node_id == "env-0", 3 * NODE_TIMEOUT_S,
                    "the killed env server reported down")

    took = terminate(orchestrator)

    stream.wait(said_bye("orchestrator"), SHUTDOWN_S, "the orchestrator's bye")
    log = orchestrator.log_tail(200)
    if registry_knows:  # not asked at all (no attempt, so no retry): its blobs are lost, naming the store
        lost = stream.wait(lambda b: isinstance(b, Delete) and b.reason == "lost", SHUTDOWN_S, "the loss")
        assert isinstance(lost, Delete) and lost.node == "env-0" and sorted(lost.blob_ids) == sorted(kept)
        assert "request.retry" not in log
    else:
        assert "delete.failed" in log and f'"blobs": {len(kept)}' in log
    print(f"orchestrator gone {took:.2f}s after SIGTERM (store {'reported down' if registry_knows else 'killed'})")


def test_a_child_whose_parent_died_before_it_asked_for_the_parent_death_signal_ends_at_once() -> None:
    """The launcher is killed between the fork and the child's request for a parent-death signal: no signal
    would ever come, so the child must see its parent changed and end before it becomes a node."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # Forked by this process, but told its parent was the one that is gone: what a reparented child sees.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             preexec_fn=functools.partial(_die_with_parent, gone.pid))
    try:
        assert child.wait(30) == 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


EXITING_ROLES = Path(__file__).with_name("exiting_roles.py")


def outlived_node(tmp_path: Path, role: str) -> tuple[int, str]:
    """Run ``tests/exiting_roles.py``'s ``role`` (its process outlives its node, which closes at once): its exit
    status, which the exit watchdog gives within the shutdown timeout, and its log."""
    node = NodeProcess(["node", role, "--node-metrics-port", "-1", *SHUTDOWN], workdir=tmp_path, name=role,
                       prefix=[sys.executable, str(EXITING_ROLES)])
    try:
        wait_for(lambda: node.proc.poll() is not None, START_S + GONE_S, f"{role} ended by the exit watchdog")
        return node.proc.returncode, node.log_tail(200)
    finally:
        node.stop()


@pytest.mark.parametrize(("role", "status", "reason", "failure"), [
    ("fails-then-hangs", 1, "the role raised RuntimeError, then its process hung",
     f"RuntimeError: {exiting_roles.FAILURE}"),
    ("loop-fails", 1, "the node's loop raised LoopStepFailed, then its process hung",
     f"LoopStepFailed: {exiting_roles.LOOP_FAILURE}"),
    ("finishes-then-hangs", 0, "the node closed cleanly; its process then hung in teardown", ""),
    ("refused-then-hangs", CONFIG_STATUS, "the role raised ConfigError, then its process hung",
     f"ConfigError: {exiting_roles.REFUSAL}"),
    ("refused-unclosed", CONFIG_STATUS,
     "the node did not close within node.shutdown_timeout_s after the role raised ConfigError",
     f"ConfigError: {exiting_roles.REFUSAL}"),
])
def test_the_exit_watchdog_ends_a_process_that_outlives_its_node_with_its_failure_status(
    tmp_path: Path, role: str, status: int, reason: str, failure: str
) -> None:
    """A role that failed after its node closed, then hung (a thread that never joins), and one whose node's loop
    died of an error in its background thread while the role waited on other work, used to be ended with status 0,
    the failure untold: a supervisor took either for a role that finished and never restarted it. Now the forced
    exit carries the failure (status 1, its traceback logged); a clean finish that merely hung in teardown still
    exits 0. A config the role refused (``ConfigError``, which ``refbus node`` exits 2 for: final) before a hang,
    its node closed or not, was forced out with status 1, which a supervisor restarts into the same refusal; now
    with the 2 the command would have exited with. Either way the log says why the watchdog ended it and where the
    main thread was."""
    code, log = outlived_node(tmp_path, role)
    assert code == status, log
    assert '"node.exit_forced"' in log and f'"reason": "{reason}"' in log and "main_thread_at" in log, log
    assert failure in log and ("Traceback" in log) == bool(failure), log


@pytest.mark.parametrize(("role", "status", "said"), [
    ("finishes-then-hangs", 0, "node.stopped"),  # the watchdog's last words: node.exit_forced
    ("fails-then-hangs", 1, "node.stopped"),
    ("hangs-mid-step", 0, "node.ready"),  # its first: node.stopped_by_deadline, once its stdin closes
])
def test_the_exit_watchdog_ends_a_process_whose_log_reader_is_gone(tmp_path: Path, role: str, status: int,
                                                                  said: str) -> None:
    """Before, a log line the watchdog wrote on its own thread (``node.stopped_by_deadline`` before it stops the
    node's loop, ``node.exit_forced`` before it ends the process) raised when the process's stderr was a pipe whose
    reader had gone (``refbus node ... | tee``, the reader ended by the same Ctrl-C): the watchdog's thread died with
    it, and a process whose role hung (after its node closed, or mid-step) ran on for good. Now neither line can keep
    the watchdog from the stop or the exit, with the status it carries."""
    command = [sys.executable, str(EXITING_ROLES), sys.executable, "-m", "refbus.nodes.cli", "node", role,
               "--node-metrics-port", "-1", *SHUTDOWN]
    proc = subprocess.Popen(command, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0)
    try:
        wait_for(lambda: said in read_line(proc, START_S), START_S, f"{role}'s {said}")
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.close()  # the log's reader is gone: what the node writes from now on fails
        proc.stdin.close()  # hangs-mid-step's shutdown clock starts
        wait_for(lambda: proc.poll() is not None, GONE_S, f"{role} ended by the exit watchdog")
        assert proc.returncode == status
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_runtime_the_role_closes_besides_its_node_does_not_start_the_nodes_shutdown_clock(tmp_path: Path) -> None:
    """Before, any runtime's close in a ``refbus node`` process started the exit watchdog's clock for the node the
    process runs: a role that made and closed a second one (a registry probe) had its node stopped at the hooks'
    share of the shutdown timeout (``node.stopped_by_deadline``), no stop asked, and the process gone. Now only
    the node's own shutdown does: it serves on until SIGTERM, which still ends it cleanly."""
    node = NodeProcess(["node", "probes-then-serves", "--node-metrics-port", "-1", *SHUTDOWN], workdir=tmp_path,
                       name="probes", prefix=[sys.executable, str(EXITING_ROLES)])
    with node:
        node.wait_ready(START_S)  # the probe closed before: a clock it started would end the node within SHUTDOWN_S
        holds_for(lambda: node.proc.poll() is None, GONE_S, "the node serving after its role closed a probe")
        terminate(node)
        assert "node.stopped_by_deadline" not in node.log_tail(200)


# A stop while joining ends the join at its next wait (INTERRUPT_CHECK_MS): well within half the shutdown timeout, at
# whose end the exit watchdog would have ended the process instead.
GIVES_WAY_S = SHUTDOWN_S / 2
# Slow heartbeats: a broker tells a contender for a held id to ask again a heartbeat interval later (its retry_after_s),
# a pause longer than the shutdown timeout. The node timeout must be above three of them and below the request retry
# schedule (14 s by default).
SLOW_BEAT_S = 2 * SHUTDOWN_S
SLOW_LIVENESS = ["--bus-heartbeat-interval-s", str(SLOW_BEAT_S), "--bus-node-timeout-s", str(3 * SLOW_BEAT_S + 1)]


def said(node: NodeProcess, event: str) -> bool:
    """Whether ``node``'s log has an ``event`` line."""
    return f'"event": "{event}"' in node.log_path.read_text(errors="replace")


def joining_env_server(tmp_path: Path, control: str, *flags: str) -> NodeProcess:
    return NodeProcess(["node", "env-server", "--bus-control", control, "--node-id", "joining", "--node-metrics-port",
                        "-1", *SHUTDOWN, *flags], workdir=tmp_path, name="joining")


def stopped_while_joining(node: NodeProcess, sig: int) -> None:
    """Send ``sig`` to ``node`` (still joining); it is gone within GIVES_WAY_S, status 0, as a stopped node."""
    node.signal(sig)
    wait_for(lambda: node.proc.poll() is not None, GIVES_WAY_S, f"{node.name} gone after {sig!r} while joining")
    log = node.log_tail(200)
    assert node.proc.returncode == 0, log
    assert said(node, "node.stopped_while_starting") and not said(node, "node.exit_forced"), log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_node_stopped_while_its_broker_does_not_answer_its_hello_ends_at_once_as_a_stopped_node(
    bus: tuple[NodeProcess, str], tmp_path: Path, sig: int
) -> None:
    """A node asked to stop while it was still saying hello to a broker that does not answer (not yet up, stopped,
    gone) went on asking it: its process ended only when the exit watchdog gave up on it, a whole
    node.shutdown_timeout_s later, with status 1 ("did not close"), as if it had failed. `refbus up` tearing a
    cluster down met that for every node still joining. Now the join gives way to the stop at its next wait and
    the process exits 0, as a node stopped once running does."""
    broker, control = bus
    broker.signal(signal.SIGSTOP)  # alive, its sockets open, answering nothing
    node = joining_env_server(tmp_path, control, *FAST_LIVENESS)
    try:
        wait_for(lambda: said(node, "request.retry"), START_S, "the node asking the silent broker again")
        stopped_while_joining(node, sig)
    finally:
        broker.signal(signal.SIGCONT)
        node.stop()


def test_a_node_stopped_while_its_id_is_held_by_a_silent_predecessor_ends_at_once_as_a_stopped_node(
    tmp_path: Path,
) -> None:
    """While another process holds its node id and has gone silent (a predecessor dying, here stopped), a joining
    node waits as long as the broker says before it asks again: that wait ignored a stop too (the process ended at
    the watchdog's deadline, status 1). Now it gives way as the hello's waits do."""
    broker, control = start_bus(tmp_path, extra=SLOW_LIVENESS)
    holder = NodeProcess(["monitor", "--bus-control", control, "--node-id", "joining", *SLOW_LIVENESS],
                         workdir=tmp_path, name="holder")
    node: NodeProcess | None = None
    try:
        holder.wait_ready(START_S)
        holder.signal(signal.SIGSTOP)
        node = joining_env_server(tmp_path, control, *SLOW_LIVENESS)
        wait_for(lambda: said(node, "node.id_held"), START_S, "the broker telling the node to ask again later")
        stopped_while_joining(node, signal.SIGTERM)
    finally:
        holder.signal(signal.SIGCONT)
        for process in (node, holder, broker):
            if process is not None:
                process.stop()
