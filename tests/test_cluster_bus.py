"""The broker as a real process: registry, node-up/node-down, monitor output, replay, bad input, shutdown."""

from __future__ import annotations

import errno
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import FAST_LIVENESS
from golden_wire import load
from refbus.bus.metrics import serve_metrics
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import AddressInUse, BindRefused, CannotBind, bind_error, make_socket
from refbus.nodes.halting import CONFIG_STATUS, final_reason
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.monitor import BROKEN_PIPE_STATUS
from refbus.protocol.envelope import PROTOCOL_VERSION, Header, WireCodec
from refbus.protocol.messages import Delete, Error, Hello, NodeInfo, NodeList, Nodes, RunEnd, Sync, Welcome


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _monitor(spawn, control: str, name: str, out: Path, *flags: str) -> NodeProcess:
    return spawn(["monitor", "--json", "--bus-control", control, *FAST_LIVENESS, *flags], name,
                 stdout=open(out, "wb"))


def test_killed_node_goes_down_and_monitor_json_shows_it(bus, spawn, tmp_path: Path) -> None:
    _, control = bus
    out = tmp_path / "watch.jsonl"
    watcher = _monitor(spawn, control, "watcher", out, "--kind", "node-down", "--count", "1")
    watcher.wait_ready()
    victim = spawn(["monitor", "--bus-control", control, "--node-id", "victim", *FAST_LIVENESS], "victim")
    victim.wait_ready()
    victim.proc.kill()
    assert watcher.proc.wait(timeout=30) == 0, watcher.log_tail()
    (down,) = _records(out)
    # The node-up events from the ring, in order: the watcher's and then the victim's. Live, the watcher could
    # also meet its own node-up if the broker's proxy thread were held up past the watcher's subscription.
    ups = tmp_path / "ups.jsonl"
    replayer = _monitor(spawn, control, "replayer", ups, "--since", "0", "--kind", "node-up", "--count", "2")
    assert replayer.proc.wait(timeout=30) == 0, replayer.log_tail()

    (up,) = [record for record in _records(ups) if record["node"]["node_id"] == "victim"]
    assert (up["type"], up["node"]["node_id"], up["node"]["pid"]) == ("node-up", "victim", victim.pid)
    assert (down["type"], down["node_id"], down["reason"]) == ("node-down", "victim", "timeout")
    for record in (up, down):
        assert record["src"] == "bus" and isinstance(record["seq"], int) and isinstance(record["ts"], float)
    assert down["seq"] > up["seq"]


def test_registry_lists_live_nodes_and_bye_removes_them(bus, spawn, tmp_path: Path) -> None:
    _, control = bus
    node = spawn(["monitor", "--bus-control", control, "--node-id", "lister-target"], "target")
    node.wait_ready()
    listed = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "nodes", "--json", "--bus-control", control],
                            capture_output=True, text=True, timeout=30, check=True)
    entries = {n["node_id"]: n for n in json.loads(listed.stdout)}
    assert entries["lister-target"]["role"] == "monitor"
    assert entries["lister-target"]["pid"] == node.pid
    assert entries["lister-target"]["metrics"].startswith("http://127.0.0.1:")

    out = tmp_path / "replay.jsonl"
    assert node.stop() == 0
    replayer = _monitor(spawn, control, "replayer", out, "--since", "0", "--kind", "node-down", "--count", "1")
    assert replayer.proc.wait(timeout=30) == 0, replayer.log_tail()
    (down,) = _records(out)
    assert (down["node_id"], down["reason"]) == ("lister-target", "bye")


def test_monitor_since_replays_ring_in_order_then_goes_live(bus, spawn, tmp_path: Path) -> None:
    _, control = bus
    for i in range(3):
        node = spawn(["monitor", "--bus-control", control, "--node-id", f"early-{i}"], f"early-{i}")
        node.wait_ready()
        assert node.stop() == 0
    out = tmp_path / "since.jsonl"
    # 3 x (up, down) from the ring, then this monitor's own node-up, then a live one.
    late = _monitor(spawn, control, "late", out, "--since", "1", "--count", "8")
    late.wait_ready()
    live = spawn(["monitor", "--bus-control", control, "--node-id", "live-one"], "live-one")
    live.wait_ready()
    assert late.proc.wait(timeout=30) == 0, late.log_tail()
    records = _records(out)
    assert [r["seq"] for r in records] == list(range(1, 9))
    assert [(r["type"], r.get("node_id") or r["node"]["node_id"]) for r in records[:6]] == [
        (kind, f"early-{i}") for i in range(3) for kind in ("node-up", "node-down")
    ]
    assert records[-1]["node"]["node_id"] == "live-one"


def test_monitor_shows_hostile_events_escaped_and_its_json_stays_strict(
    bus, spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a header ts that is not finite or out of the clock's range made a readable line raise (the
    event was dropped, logged event.handler_failed) and --json print NaN/Infinity (not JSON); terminal control
    sequences in a sender's id or a string field were written as they came. Now such a ts shows as ``?`` (as
    ``null`` in JSON) and non-printable characters are escaped."""
    _, control = bus
    outs = {mode: tmp_path / f"{mode}.out" for mode in ("text", "json")}

    def watch(mode: str, *flags: str) -> NodeProcess:
        return spawn(["monitor", *flags, "--bus-control", control, *FAST_LIVENESS, "--kind", "run-end", "--count",
                      "5"], f"watch-{mode}", stdout=open(outs[mode], "wb"))

    monitors = [watch("text"), watch("json", "--json")]
    for monitor in monitors:
        monitor.wait_ready()
    # The broker registers no such id, but an event names its source itself: any publisher may send one.
    evil = "evil\x1b]0;pwned\x07\x1b[2J"
    pub = NodeRuntime("evil", RuntimeSettings(bus=control, node_id="evil", metrics_port=-1, heartbeat_interval_s=0.2))
    stamps = {2: math.nan, 3: math.inf, 4: 1e300}  # event seq -> the header ts it is sent with
    stamp = pub.codec._stamp

    def hostile_stamp(seq: int, msg_id: str = "", reply_to: str = "") -> Header:
        header = stamp(seq, msg_id, reply_to)
        if not seq:  # a request: its source must stay the registered id
            return header
        return msgspec.structs.replace(header, src=evil, ts=stamps.get(seq, header.ts))

    monkeypatch.setattr(pub.codec, "_stamp", hostile_stamp)
    reasons = ["first", "ts-nan", "ts-inf", "ts-1e300", "last\x1b[31mRED\x1b[0m"]
    pub.start_background()
    try:
        for reason in reasons:
            pub.call_soon(lambda reason=reason: pub.publish(RunEnd(reason=reason)))
        for monitor in monitors:
            assert monitor.proc.wait(timeout=30) == 0, monitor.log_tail()
    finally:
        pub.join(10)
    text = outs["text"].read_bytes()
    assert b"\x1b" not in text and b"\x07" not in text
    lines = text.decode().splitlines()
    assert len(lines) == 5, lines
    assert [line.split()[0] == "?" for line in lines] == [False, True, True, True, False], lines
    assert all("evil\\x1b]0;pwned\\x07\\x1b[2J#" in line for line in lines), lines
    assert "reason=last\\x1b[31mRED\\x1b[0m" in lines[-1], lines[-1]

    def strict(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    records = [json.loads(line, parse_constant=strict) for line in outs["json"].read_text().splitlines()]
    assert [(r["reason"], r["src"]) for r in records] == [(reason, evil) for reason in reasons]
    assert [r["ts"] is None for r in records] == [False, True, True, False, False]  # 1e300 is a finite number


def test_monitor_with_a_duration_ends_then_when_the_broker_does_not_answer(silent_endpoint: str) -> None:
    """Regression: joining a broker that does not answer took node.connect_timeout_s (15 s) whatever
    --duration said. Now each step of the join waits at most the duration."""
    duration_s = 2.0
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "monitor", "--duration", str(duration_s),
                             "--bus-control", silent_endpoint], capture_output=True, text=True,
                            timeout=5 * duration_s)  # well under the 15 s connect timeout
    assert result.returncode == 1 and "no broker answered" in result.stderr, result.stderr
    assert time.monotonic() - started < 5 * duration_s


def test_monitor_ends_when_its_reader_goes_away(bus, spawn) -> None:
    """``refbus monitor | head -1``: before, each write to the closed pipe failed as one more logged handler
    error and the monitor ran on for ever."""
    _, control = bus
    read_end, write_end = os.pipe()
    try:
        watcher = spawn(["monitor", "--json", "--since", "0", "--bus-control", control, *FAST_LIVENESS], "watcher",
                        stdout=write_end)
    finally:
        os.close(write_end)
    with open(read_end, "rb") as reader:
        assert select.select([reader], [], [], 30)[0], watcher.log_tail()
        assert json.loads(reader.readline())["type"] == "node-up"
    # An event after the reader is gone: the monitor's next write meets the closed pipe.
    spawn(["monitor", "--bus-control", control, "--node-id", "after"], "after").wait_ready()
    assert watcher.proc.wait(timeout=30) == BROKEN_PIPE_STATUS, watcher.log_tail()
    assert "handler_failed" not in watcher.log_tail() and "Exception ignored" not in watcher.log_tail()


def test_gap_is_filled_from_the_ring(bus) -> None:
    _, control = bus
    settings = RuntimeSettings(bus=control, metrics_port=-1)
    pub = NodeRuntime("pub", RuntimeSettings(bus=control, metrics_port=-1, node_id="pub"))
    sub = NodeRuntime("sub", settings)
    got: list[int] = []
    subscriber = sub.subscribe(lambda m: got.append(m.header.seq), kinds=frozenset({"delete"}))
    try:
        pub.start()
        sub.start()
        events_out = sub.welcome.events_out
        publish = [lambda i=i: pub.publish(Delete(blob_ids=[f"b{i}"], holder="pub", reason="test")) for i in range(40)]
        for p in publish[:10]:
            p()
        sub.loop(until=lambda: len(got) >= 10)
        # Lose 10 events on the wire: they are published while this subscriber is disconnected.
        subscriber.sock.disconnect(events_out)
        for p in publish[10:20]:
            p()
        assert pub.flush_events(20)  # the broker forwarded them (to nobody) before the subscriber is back
        subscriber.sock.connect(events_out)
        token = sub.codec.new_id()
        subscriber.expect(token)
        deadline = time.monotonic() + 20
        while token not in subscriber.tokens and time.monotonic() < deadline:
            sub.control.request(Sync(token=token, path="sub"))
            if subscriber.sock.poll(20, zmq.POLLIN):
                subscriber.drain_one()
        publish[20]()
        sub.loop(until=lambda: len(got) >= 21)
        assert got == list(range(1, 22))
        assert (subscriber.missed, subscriber.filled, subscriber.duplicates) == (10, 10, 0)
    finally:
        sub.close()
        pub.close()


def test_bad_requests_get_clear_errors_and_broker_keeps_serving(bus) -> None:
    _, control = bus
    ctx = zmq.Context()
    codec = WireCodec("prober")
    raw = make_socket(ctx, zmq.DEALER, connect=control)
    try:
        def ask(frames: list) -> Error:
            raw.send_multipart(frames)
            assert raw.poll(10_000), "broker did not answer"
            reply = codec.decode(raw.recv_multipart())
            assert isinstance(reply.body, Error)
            return reply.body

        assert ask([b"garbage"]).code == "malformed"
        assert ask([b"nodes", b"\xc1", b"\x80"]).code == "malformed"
        kind, _, body = codec.encode(Nodes())
        assert ask([b"no-such-kind", codec.encode(Nodes())[1], body]).code == "unknown-kind"
        newer = Header((PROTOCOL_VERSION[0] + 1, 0), "x1", "prober", 0, time.time())
        err = ask([kind, codec._encoder.encode(newer), body])
        assert err.code == "version" and f"{PROTOCOL_VERSION[0] + 1}.0" in err.message
        wrong_type = codec.encode(Nodes())
        wrong_type[2] = b"\x81\xa4role\x05"  # {"role": 5}
        err = ask(wrong_type)
        assert err.code == "schema" and "role" in err.message
        huge = codec.encode(Nodes())
        huge[2] = b"\x81\xa4role\xdb" + (32 << 20).to_bytes(4, "big") + b"x" * (32 << 20)
        assert ask(huge).code == "too-large"

        old = ask(load(PROTOCOL_VERSION[0] - 1, "hello"))  # a peer of the previous major
        assert old.code == "version" and f"protocol {PROTOCOL_VERSION[0] - 1}.0" in old.message
        node = NodeInfo(node_id="negotiator", role="monitor", host="h", pid=1)
        err = ask(codec.encode(Hello(node=node, token="t-1", wire=[PROTOCOL_VERSION[0] + 1])))
        assert err.code == "version" and "peer speaks protocol majors" in err.message

        raw.send_multipart(codec.encode(Hello(node=node, token="t-2", wire=[PROTOCOL_VERSION[0], 99])))
        assert raw.poll(10_000)
        welcome = codec.decode(raw.recv_multipart()).body
        assert isinstance(welcome, Welcome) and welcome.wire == PROTOCOL_VERSION[0]
        raw.send_multipart(codec.encode(Nodes()))
        assert raw.poll(10_000)
        assert isinstance(codec.decode(raw.recv_multipart()).body, NodeList)
    finally:
        raw.close()
        ctx.term()


def test_sigterm_leaves_no_process_and_no_socket_file(tmp_path: Path, spawn) -> None:
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    endpoints = {name: f"ipc://{sockets}/{name}" for name in ("control", "in", "out")}
    bus = spawn(["node", "bus", "--bus-control", endpoints["control"], "--bus-events-in", endpoints["in"],
                 "--bus-events-out", endpoints["out"], "--bus-metrics-port", "0"], "ipc-bus")
    bus.wait_ready()
    node = spawn(["monitor", "--bus-control", endpoints["control"], "--node-id", "ipc-node"], "ipc-node")
    node.wait_ready()
    assert sorted(p.name for p in sockets.iterdir()) == ["control", "in", "out"]
    for proc, sig in ((node, signal.SIGTERM), (bus, signal.SIGINT)):
        proc.signal(sig)
        assert proc.proc.wait(timeout=20) == 0, proc.log_tail()
    assert list(sockets.iterdir()) == []
    assert not bus.ready_file.exists() and not node.ready_file.exists()


@pytest.mark.parametrize("command", [[], ["node"], ["node", "bus"], ["monitor"], ["nodes"], ["config", "show"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", *command, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: refbus" in result.stdout and len(result.stdout.splitlines()) > 5


def test_signed_cluster_admits_its_nodes_and_refuses_a_wrong_secret(tmp_path: Path, spawn) -> None:
    bus, control = start_bus(tmp_path, extra=["--security-secret", "s3cret"])
    try:
        good = spawn(["monitor", "--bus-control", control, "--security-secret", "s3cret", "--node-id", "good"], "good")
        assert good.wait_ready()["node_id"] == "good"
        bad = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "monitor", "--bus-control", control,
                              "--security-secret", "wrong", "--node-connect-timeout-s", "2", "--requests-attempts",
                              "1", *FAST_LIVENESS], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "no broker answered" in bad.stderr
        assert "signature" in bus.log_tail(200)  # the broker said why it refused
    finally:
        assert bus.stop() == 0


@pytest.mark.parametrize("held", ["control", "metrics"])
def test_a_broker_whose_port_another_process_holds_says_so_and_exits_1(tmp_path: Path, held: str) -> None:
    """A second cluster started on the first one's ports (its control endpoint, or the broker's fixed metrics
    port): the broker names the address and what to change, with no traceback (before: a ZeroMQ or socketserver
    traceback ending in "Address already in use")."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        taken, flags = (f"tcp://127.0.0.1:{port}", ["--bus-control", f"tcp://127.0.0.1:{port}",
                                                    "--bus-metrics-port", "0"]) if held == "control" else \
            (f"http://127.0.0.1:{port}", ["--bus-control", "tcp://127.0.0.1:0", "--bus-metrics-port", str(port)])
        result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "node", "bus", *flags,
                                 "--bus-events-in", "tcp://127.0.0.1:0", "--bus-events-out", "tcp://127.0.0.1:0"],
                                capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        listener.close()
    assert result.returncode == 1, result.stderr
    assert f"refbus: cannot bind {taken}: another process holds that address" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


NOT_THIS_MACHINE = "198.19.255.254"  # no interface of this machine has it (the hosts harness uses 198.18.0.x)


@pytest.mark.parametrize("bound", ["control", "metrics"])
def test_a_broker_given_an_address_not_of_this_machine_says_so_and_exits_1(tmp_path: Path, bound: str) -> None:
    """A config naming a host that is not this machine's (a copied config, a wrong interface): the broker names
    the address and why, with no traceback (before: a ZeroMQ or socketserver traceback ending in "Cannot assign
    requested address"). Nothing is sent anywhere: the bind fails before any traffic."""
    taken, flags = (f"tcp://{NOT_THIS_MACHINE}:0", ["--bus-control", f"tcp://{NOT_THIS_MACHINE}:0",
                                                   "--bus-metrics-port", "0"]) if bound == "control" else \
        (f"http://{NOT_THIS_MACHINE}:0", ["--bus-control", "tcp://127.0.0.1:0", "--bus-metrics-port", "0",
                                          "--node-metrics-host", NOT_THIS_MACHINE])
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "node", "bus", *flags, "--security-insecure",
                             "true", "--bus-events-in", "tcp://127.0.0.1:0", "--bus-events-out", "tcp://127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"refbus: cannot bind {taken}: Cannot assign requested address" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_broker_whose_ipc_directory_does_not_exist_says_so_and_exits_2_as_a_config_that_cannot_work(
        tmp_path: Path) -> None:
    """An ipc endpoint in a directory that does not exist (nothing of refbus makes it): a restart would be refused
    the same, so the broker exits with the final config status (2), its last line naming the address and why.
    Before, it exited 1 and ``refbus up`` restarted it until the restart budget was spent."""
    endpoint = f"ipc://{tmp_path}/missing/control"
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "node", "bus", "--bus-control", endpoint,
                             "--bus-events-in", "tcp://127.0.0.1:0", "--bus-events-out", "tcp://127.0.0.1:0",
                             "--bus-metrics-port", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == CONFIG_STATUS, result.stderr
    assert final_reason(CONFIG_STATUS, result.stderr).startswith(f"cannot bind {endpoint}: No such file or directory")
    assert "Traceback" not in result.stderr, result.stderr


def test_a_bind_refused_for_good_is_told_from_one_that_can_clear_by_itself(tmp_path: Path) -> None:
    """Every errno a bind is refused with, sorted: an address not yet this machine's can clear (``CannotBind``,
    exit 1), as can an interface or host name not found now; a missing ipc directory, a privileged port cannot
    (``BindRefused``, exit 2). Real binds, a socket's and the metrics endpoint's, for the ones this host can
    refuse to root."""
    for code in (errno.EACCES, errno.EPERM, errno.ENOENT):
        assert isinstance(bind_error("tcp://127.0.0.1:80", code, os.strerror(code)), BindRefused), code
    for code in (errno.EADDRNOTAVAIL, errno.ENODEV):
        assert type(bind_error(f"tcp://{NOT_THIS_MACHINE}:0", code, os.strerror(code))) is CannotBind, code
    assert type(bind_error("tcp://127.0.0.1:1", errno.EADDRINUSE, "")) is AddressInUse
    assert bind_error("tcp://127.0.0.1:1", errno.EINVAL, "") is None  # not a refusal: the caller re-raises

    ctx = zmq.Context()
    try:
        with pytest.raises(BindRefused, match="No such file or directory"):
            make_socket(ctx, zmq.ROUTER, bind=f"ipc://{tmp_path}/missing/control")
        with pytest.raises(CannotBind, match="Cannot assign requested address") as clears:
            make_socket(ctx, zmq.ROUTER, bind=f"tcp://{NOT_THIS_MACHINE}:0")
        assert not isinstance(clears.value, BindRefused)
    finally:
        ctx.term()
    with pytest.raises(CannotBind, match="Cannot assign requested address") as clears:
        serve_metrics(NOT_THIS_MACHINE, 0)
    assert not isinstance(clears.value, BindRefused)
