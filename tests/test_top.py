"""`refbus top` as a process, live, against a real broker: a node it shows SIGKILLed leaves its table once the
broker declares it down, and top goes on; the broker SIGKILLed under it is reported on every refresh until a
broker restarted on its addresses answers, and the cluster is shown again. Against a fake broker: whatever
answers at ``bus.control`` (hostile text and numbers, records that do not decode, a reply of another kind, an
error) is shown escaped or reported, and top goes on. With ``--json`` every line it prints is strict JSON."""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST_LIVENESS
from refbus.bus.reqrep import HandlerError
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.cli import NODES_OMITTED_STATUS
from refbus.nodes.launch import start_bus
from refbus.nodes.monitor import BROKEN_PIPE_STATUS
from refbus.protocol.envelope import Message
from refbus.protocol.messages import NodeInfo, NodeList, Nodes, Ok
from scenario_support import Registry
from test_broker_restart import in_process_bus
from test_liveness import HEARTBEAT_S, NODE_TIMEOUT_S, START_S, ServedPeer

INTERVAL_S = 0.1
# A lookup gives up after 4 x 0.3 s: above the node timeout (1 s), as the config requires of every request.
REQUESTS = ["--requests-timeout-s", "0.3", "--requests-attempts", "4", "--requests-backoff", "1"]
LOOKUP_S = 1.2
HOSTILE = "h\x1b]0;pwned\x07\n"


def _strict(line: bytes) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def _ctrl_c_as_a_terminal_has_it() -> None:
    """In the child before exec: SIGINT back to its default. A suite started in the background by a
    non-interactive shell runs with SIGINT ignored, which the child would inherit, and Python then raises no
    KeyboardInterrupt; top in a terminal always has the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Top:
    """``refbus top --json`` live, as a process; :meth:`close` reaps it."""

    def __init__(self, control: str) -> None:
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "refbus.nodes.cli", "top", "--json", "--interval", str(INTERVAL_S),
             "--bus-control", control, *FAST_LIVENESS, *REQUESTS],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._err, preexec_fn=_ctrl_c_as_a_terminal_has_it)
        self._pending = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        self.lines = 0

    def next(self, deadline: float) -> Any:
        """The next line, parsed as strict JSON; fails past ``deadline`` (monotonic) or when top exited."""
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise AssertionError(f"top printed no line in time: {self.stderr()}")
            data = os.read(self.proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
            if not data:
                raise AssertionError(f"top exited: {self.stderr()}")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        self.lines += 1
        return _strict(line)

    def until(self, match: Callable[[Any], bool], timeout: float, what: str) -> Any:
        """Read lines until one ``match``es (returned), each one strict JSON, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                shown = self.next(deadline)
            except AssertionError as exc:
                raise AssertionError(f"waiting for {what}: {exc}") from None
            if match(shown):
                return shown

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it: top exits 130 and says nothing on stderr but its warnings."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(START_S)

    def stderr(self) -> str:
        self._err.seek(0)
        state = "running" if self.proc.poll() is None else f"exit {self.proc.returncode}"
        return f"({state}) " + self._err.read()[-3000:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(START_S)
        self._selector.close()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self._err.close()


@pytest.fixture
def top() -> Iterator[Callable[[str], Top]]:
    started: list[Top] = []

    def start(control: str) -> Top:
        started.append(Top(control))
        return started[-1]

    yield start
    for proc in started:
        proc.close()


@pytest.fixture
def steady() -> Iterator[Callable[[str], NodeRuntime]]:
    """``steady(control)``: an in-process node reporting version 3 that stays up (and re-joins a restarted
    broker by itself); joined at teardown."""
    started: list[NodeRuntime] = []

    def start(control: str) -> NodeRuntime:
        runtime = NodeRuntime("steady", RuntimeSettings(bus=control, node_id="steady", metrics_port=-1,
                                                        heartbeat_interval_s=HEARTBEAT_S))
        runtime.status = lambda: {"version": 3.0}
        runtime.start_background()
        started.append(runtime)
        return runtime

    yield start
    for runtime in started:
        runtime.join(timeout=START_S)


def _ids(shown: Any) -> set[str] | None:
    """The node ids of a table; None for anything else (a report)."""
    return {row["node_id"] for row in shown["nodes"]} if "nodes" in shown else None


def _version(table: dict[str, Any], node_id: str) -> float | None:
    return next(row["version"] for row in table["nodes"] if row["node_id"] == node_id)


def test_top_goes_on_while_a_node_it_shows_is_sigkilled(bus, top, steady) -> None:
    control = bus[1]
    steady(control)
    peer = ServedPeer(control, "peer-killed")
    try:
        watching = top(control)
        watching.until(lambda s: _ids(s) == {"steady", "peer-killed"} and _version(s, "steady") == 3.0, START_S,
                       "both nodes")
        peer.kill()

        def gone(shown: Any) -> bool:
            ids = _ids(shown) or set()
            assert "steady" in ids, shown  # every refresh is a table, with the node that stays
            return "peer-killed" not in ids

        # Shown until the broker declares it down (a node timeout without heartbeats), then gone: top lists live
        # nodes.
        watching.until(gone, 5 * NODE_TIMEOUT_S + LOOKUP_S, "the killed node to go")
        registry = Registry(control)  # asked after top dropped the node: the broker must have declared it down
        try:
            assert "peer-killed" not in registry.nodes(), "top dropped the node before the broker's verdict"
        finally:
            registry.close()
        before = watching.lines
        watching.until(lambda s: _ids(s) == {"steady"} and watching.lines >= before + 3, 10 * (INTERVAL_S + LOOKUP_S),
                       "top to go on refreshing")
        assert watching.interrupt() == 130 and "Traceback" not in watching.stderr(), watching.stderr()
    finally:
        peer.kill()  # reaped whatever happened (a second kill does nothing)


def test_top_reports_a_sigkilled_broker_until_its_restart_answers(tmp_path: Path, top, steady) -> None:
    first, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    restarted: NodeRuntime | None = None
    try:
        steady(control)
        watching = top(control)
        watching.until(lambda s: _ids(s) == {"steady"}, START_S, "the steady node")
        first.signal(signal.SIGKILL)
        assert first.proc.wait(START_S) == -signal.SIGKILL
        # Each refresh that finds no broker is one JSON object naming it (not a table, not a crash, not a hang).
        for _ in range(2):
            report = watching.until(lambda s: "error" in s, 5 * (INTERVAL_S + LOOKUP_S), "a report")
            assert set(report) == {"error"} and control in report["error"], report
        assert watching.proc.poll() is None
        restarted = in_process_bus(first.info["endpoints"])  # on the dead one's addresses
        # The node re-joins at its next heartbeat (its status numbers come with the heartbeat after); top's next
        # lookup shows it.
        watching.until(lambda s: _ids(s) == {"steady"} and _version(s, "steady") == 3.0,
                       10 * (HEARTBEAT_S + INTERVAL_S + LOOKUP_S), "the restarted broker's registry")
        assert watching.interrupt() == 130 and "Traceback" not in watching.stderr(), watching.stderr()
    finally:
        if restarted is not None:
            restarted.join(timeout=START_S)
        first.stop()


def test_top_shows_a_registry_answer_cut_to_the_body_limit_and_says_how_many_were_left_out(tmp_path: Path) -> None:
    """Regression: a registry whose entries do not all fit one answer within the body limit is answered cut (the
    largest left out, counted in ``omitted``), which top took for no answer: "no registry from the broker", exit 1,
    no node shown, on every refresh. Now top shows the nodes that came and says how many were left out (the
    ``omitted`` of its JSON). A real broker with a 64 KiB body limit; three nodes of ~40 KB of labels each."""
    body_limit = 64 << 10
    broker, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, "--limits-max-body-bytes", str(body_limit)])
    started: list[NodeRuntime] = []
    try:
        for node_id in ("small", "fat-0", "fat-1", "fat-2"):
            runtime = NodeRuntime("fat", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                         heartbeat_interval_s=HEARTBEAT_S))
            if node_id != "small":  # each fits a hello, but no two of them one answer
                runtime.labels.update({f"label-{i}": "x" * 4000 for i in range(10)})
            runtime.start_background()  # back once its join is complete: live in the registry
            started.append(runtime)

        def once(*flags: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "top", "--once", *flags, "--bus-control",
                                   control, *FAST_LIVENESS, *REQUESTS], capture_output=True, text=True, timeout=START_S)

        shown = once("--json")
        assert shown.returncode == 0, shown.stderr
        table = _strict(shown.stdout.encode())
        assert table["omitted"] == 2 and len(table["nodes"]) == 2 and "small" in _ids(table), table["omitted"]
        text = once()
        assert text.returncode == 0, text.stderr
        assert "2 nodes left out (registry answer over the body limit)" in text.stdout, text.stdout[-500:]
        assert re.search(r"^small\s+fat\s", text.stdout, re.MULTILINE), text.stdout[-500:]
        # `refbus nodes` likewise lists what came (it said "no registry", exit 1), says how many it left out and
        # exits 3: a script must not take the list for the whole registry.
        listed = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "nodes", "--json", "--bus-control", control,
                                 *FAST_LIVENESS, *REQUESTS], capture_output=True, text=True, timeout=START_S)
        assert listed.returncode == NODES_OMITTED_STATUS, listed.stderr
        assert [node["node_id"] for node in _strict(listed.stdout.encode())].count("small") == 1, listed.stdout[-500:]
        assert "refbus: 2 nodes left out" in listed.stderr, listed.stderr
    finally:
        for runtime in started:
            runtime.join(timeout=START_S)
        broker.stop()


def _fake_broker(replies: list[Callable[[], Any]]) -> NodeRuntime:
    """A broker's control endpoint that answers the n-th ``nodes`` request with ``replies[n]()`` (the last one
    from then on); retries of one request get the same answer (a cached handler)."""
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="fake-bus", metrics_port=-1), register=False)
    server = runtime.serve("control", "tcp://127.0.0.1:0")
    asked = [0]

    def answer(request: Message) -> Any:
        asked[0] += 1
        return replies[min(asked[0], len(replies)) - 1]()

    server.on(Nodes.kind, answer)
    runtime.start_background()
    return runtime


def _hostile() -> NodeList:
    nan, inf = math.nan, math.inf
    return NodeList([
        NodeInfo("ro", "rollout", "h", 1, status={"version": -1.0}, last_seen=time.time()),  # no weights
        NodeInfo("pm", "ps-manager", HOSTILE, 2, status={"version": 7.0}, last_seen=time.time()),
        NodeInfo("env", "env-server", "h", 3, status={"blobs_held": nan, "bytes_held": inf}, last_seen=nan),
        NodeInfo("tr\x1b[2J", "trainer\r", "h", 4, status={"step": -inf}, last_seen=time.time() + 1e9),
    ])


def _undecodable() -> NodeList:
    # Not what NodeInfo allows (a status number that is text, a negative pid): top's decoder rejects the reply.
    return NodeList([NodeInfo("bad", "rollout", "h", -5, status={"version": "seven"})])  # type: ignore[dict-item]


def _refuse() -> Any:
    raise HandlerError("internal", "the registry is having a bad day")


def test_top_shows_garbage_from_the_registry_escaped_and_reports_what_it_cannot_show(top) -> None:
    fake = _fake_broker([_hostile, _undecodable, Ok, _refuse, _hostile])
    control = fake.endpoints["control"]
    try:
        watching = top(control)
        deadline = 5 * (INTERVAL_S + LOOKUP_S)
        first = watching.until(lambda s: True, START_S, "the first table")
        assert first["omitted"] == 0, first
        table = {row["node_id"]: row for row in first["nodes"]}
        assert table["ro"]["version"] is None and table["ro"]["lag"] is None  # below 0: no version
        assert table["pm"]["host"] == HOSTILE and table["pm"]["lag"] == 0.0  # JSON escapes the text itself
        assert table["env"]["blobs_held"] is None and table["env"]["bytes_held"] is None
        assert table["env"]["heartbeat_age_s"] == 0.0 and table["tr\x1b[2J"]["heartbeat_age_s"] == 0.0
        assert table["tr\x1b[2J"]["version"] is None and table["tr\x1b[2J"]["role"] == "trainer\r"
        for what in ("a record that does not decode", "a reply of another kind", "an error"):
            report = watching.until(lambda s: True, deadline, what)
            assert set(report) == {"error"} and control in report["error"], (what, report)
        assert _ids(watching.until(lambda s: True, deadline, "the table again")) == {"ro", "pm", "env", "tr\x1b[2J"}
        assert watching.interrupt() == 130 and "Traceback" not in watching.stderr(), watching.stderr()
        # The text table of the same registry: every line printable, one line per node.
        once = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "top", "--once", "--bus-control", control,
                               *FAST_LIVENESS, *REQUESTS], capture_output=True, text=True, timeout=START_S)
        assert once.returncode == 0, once.stderr
        lines = once.stdout.strip("\n").splitlines()
        assert len(lines) == 6 and all(line.isprintable() for line in lines), lines  # title, header, 4 nodes
        assert "h\\x1b]0;pwned\\x07\\x0a" in once.stdout and "tr\\x1b[2J" in once.stdout
    finally:
        fake.join(timeout=START_S)


def test_top_ends_when_its_reader_goes_away(bus, top) -> None:
    """``refbus top --json | head -1``: before, the next refresh's write raised BrokenPipeError out of the command
    (a traceback, exit 1); now top ends as a tool SIGPIPE killed would, saying nothing."""
    watching = top(bus[1])
    assert "nodes" in watching.until(lambda shown: "nodes" in shown, START_S, "a table")
    watching.proc.stdout.close()  # type: ignore[union-attr]
    assert watching.proc.wait(START_S) == BROKEN_PIPE_STATUS, watching.stderr()
    assert "Traceback" not in watching.stderr() and "Exception ignored" not in watching.stderr(), watching.stderr()
