"""Observability: `refbus top`, the broker's Prometheus service discovery (/sd), the shipped scrape config, and
every PromQL expression of the Grafana dashboard evaluated by a real Prometheus scraping a full `refbus up`
cluster."""

from __future__ import annotations

import ast
import contextlib
import http.server
import json
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.metrics import MAX_CONNECTIONS, REQUEST_TIMEOUT_S
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket
from refbus.nodes.launch import NodeProcess
from refbus.nodes.payload.charges import blob_charge, info_charge
from refbus.nodes.top import rows
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Blobs, Fetch, Hello, Keep, Kept, NodeInfo, Nodes, Replay, Sync
from test_up import NODES, START_S, STOP_S, Up

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "refbus.json"
SCRAPE_CONFIG = ROOT / "dashboards" / "prometheus.yml"
ALERT_RULES = ROOT / "dashboards" / "alerts.yml"
ALERT_TESTS = ROOT / "tests" / "alerts_test.yml"
PROMETHEUS = shutil.which("prometheus")  # Debian's package installs both in /usr/bin; `make test` installs it
PROMTOOL = shutil.which("promtool")
WAIT_S = 30.0
PATIENT = RetryPolicy(timeout_s=10.0, attempts=1)
SCRAPE_S = 1.0  # the test's scrape (and /sd refresh) interval: the shipped config's, halved
SCRAPES = 10  # scrapes a series that should exist gets to show up in (a rate needs two)
OVERRUN = 10  # a wait bounded by scrapes is failed as hung only past this many times its scrapes' worth

LISTENING = re.compile(r'msg="Listening on" address=(127\.0\.0\.1:[1-9]\d*)')  # the port Prometheus bound

# Grafana fills these in; for an instant query any window holding a few 1 s scrapes will do.
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$__interval": "10s", "$__range": "10s"}


# --- helpers ---------------------------------------------------------------------------------------------


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def ready_info(proc: NodeProcess) -> dict[str, Any]:
    """A running node's registry entry, from its ready file."""
    return json.loads(proc.ready_file.read_text())


def sd_url(broker: NodeProcess) -> str:
    return ready_info(broker)["metrics"].removesuffix("/metrics") + "/sd"


def scraped(url: str, series: str) -> bool:
    """Whether a node's metrics endpoint shows a sample whose name and labels start with ``series``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return any(line.startswith(series) for line in response.read().decode().splitlines())


def branch(tokens: int) -> dict[str, np.ndarray]:
    """One branch's arrays, as a rollout worker would keep them."""
    return random_arrays(tokens, seed=tokens, layers=2, top_k=2, k=2, max_count=2)


def episode(episode_id: str, **info: Any) -> Keep:
    """A one-sample episode with arrays (what the orchestrator groups, claims and ships or drops)."""
    sample = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "ref": 0}
    return Keep(episode_id=episode_id, branches=[branch(4)], info={"samples": [sample], **info})


def top(control: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "top", "--once", "--bus-control", control,
                             *flags], capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr
    return result.stdout


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, rows' nested panels included."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            yield from ((panel["title"], target["expr"]) for target in panel.get("targets", []))
            yield from walk(panel.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def fetch_local(url: str) -> bytes | None:
    """``url``'s body from this process, None when it does not answer (yet)."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
        return response.read()
    return None


@contextlib.contextmanager
def prometheus(binary: str, workdir: Path, sd: str, *, prefix: Sequence[str] = (),
               fetch: Callable[[str], bytes | None] = fetch_local) -> Iterator[str]:
    """A Prometheus server (``binary``) scraping every 1 s what ``sd`` lists, with the shipped scrape config (only the
    address and intervals changed); yields its API base URL and always reaps the process. ``prefix`` runs it
    through a launcher that execs it (a namespace host), ``fetch`` reads a URL where it can be reached."""
    shipped = SCRAPE_CONFIG.read_text()
    for fixed in ("http://127.0.0.1:7779/sd", "scrape_interval: 2s", "refresh_interval: 2s", "  - alerts.yml"):
        assert fixed in shipped, f"{SCRAPE_CONFIG} no longer says {fixed!r}: update this test"
    config = workdir / "prometheus.yml"
    config.write_text(shipped.replace("http://127.0.0.1:7779/sd", sd).replace(": 2s", ": 1s")
                      .replace("  - alerts.yml", f"  - {ALERT_RULES}"))
    log_path = workdir / "prometheus.log"
    # Port 0: the kernel picks a free port as Prometheus binds it, so no other process can take it first (a
    # port picked beforehand could be); Prometheus logs the address it got.
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*prefix, binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                                 "--web.listen-address=127.0.0.1:0"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        def listening() -> str | None:
            assert proc.poll() is None, f"prometheus exited:\n{log_path.read_text()[-3000:]}"
            found = LISTENING.search(log_path.read_text(errors="replace"))
            return found and found.group(1)

        base = f"http://{wait_for(listening, WAIT_S, 'prometheus listening')}"

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited:\n{log_path.read_text()[-3000:]}"
            return fetch(f"{base}/-/ready") is not None

        wait_for(ready, WAIT_S, "prometheus ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(base: str, expr: str) -> dict[str, Any]:
    """An instant query through the HTTP API: its JSON answer (also for errors, which come with a 400)."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        return get_json(url)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def scrapes(base: str, node: str) -> int:
    """How many times Prometheus has scraped ``node`` so far (its ``up`` samples), answered or not."""
    result = query(base, f'count_over_time(up{{node="{node}"}}[1h])')["data"]["result"]
    return int(float(result[0]["value"][1])) if result else 0


def answered(base: str) -> dict[str, float]:
    """How many scrapes each node has answered so far (``up`` was 1): it only grows, so a wait on it does not need
    every node answering at one moment, which a loaded machine would make a matter of luck."""
    result = query(base, "sum by (node) (sum_over_time(up[1h]))")["data"]["result"]
    return {r["metric"]["node"]: float(r["value"][1]) for r in result}


def within_scrapes(base: str, check: Callable[[], Any], what: str) -> Any:
    """``check()``'s first truthy value, polled while Prometheus scrapes SCRAPES more times; fails naming ``what``
    after that many scrapes without it (the timeout only stops a Prometheus that no longer scrapes)."""
    since = scrapes(base, "bus")

    def done() -> Any:
        value = check()
        assert value or scrapes(base, "bus") < since + SCRAPES, f"no {what} after {SCRAPES} scrapes"
        return value

    return wait_for(done, OVERRUN * SCRAPES * SCRAPE_S, what)


# --- refbus top ------------------------------------------------------------------------------------------


def test_top_once_shows_every_node_with_its_status(bus, spawn) -> None:
    _, control = bus
    env = spawn(["node", "env-server", "--bus-control", control, "--node-id", "top-env", *FAST_LIVENESS], "top-env")
    watch = spawn(["monitor", "--bus-control", control, "--node-id", "top-watch", *FAST_LIVENESS], "top-watch")
    endpoint = env.wait_ready()["endpoints"]["blobs"]
    watch.wait_ready()
    ctx = zmq.Context()
    try:
        keep = episode("top-ep")
        kept = Client(ctx, endpoint, WireCodec("tester"), policy=PATIENT).request(keep).body
        assert isinstance(kept, Kept)
    finally:
        ctx.destroy(linger=0)

    def env_row_with_blob() -> dict[str, dict[str, Any]] | None:
        found = {row["node_id"]: row for row in json.loads(top(control, "--json"))["nodes"]}
        return found if found.get("top-env", {}).get("blobs_held") == 1 else None

    found = wait_for(env_row_with_blob, WAIT_S, "top shows the env server's kept blob")  # after its next heartbeat
    assert set(found) == {"top-env", "top-watch"}  # the broker is not a registry member, top is not a node
    for node_id, proc, role in (("top-env", env, "env-server"), ("top-watch", watch, "monitor")):
        row = found[node_id]
        assert (row["role"], row["pid"], row["host"]) == (role, proc.pid, socket.gethostname())
        assert 0 <= row["heartbeat_age_s"] < 5
    assert found["top-env"]["bytes_held"] == blob_charge(kept.refs[0].nbytes) + info_charge(keep.info)
    assert found["top-watch"]["blobs_held"] is None and found["top-watch"]["lag"] is None  # reports neither

    table = top(control)
    assert "cluster local" in table.splitlines()[0]
    assert re.search(r"^NODE\s+ROLE\s+HOST\s+PID\s+BLOBS\s+BYTES\s+VERSION\s+LAG\s+HEARTBEAT$", table, re.MULTILINE)
    assert re.search(rf"^top-env\s+env-server\s+\S+\s+{env.pid}\s+1\s+[\d.]+ KiB\s+-\s+-\s+[\d.]+s$", table,
                     re.MULTILINE)


def test_top_rows_version_lag_and_age() -> None:
    def node(node_id: str, role: str, status: dict[str, float], last_seen: float = 99.0) -> NodeInfo:
        return NodeInfo(node_id=node_id, role=role, host="h", pid=1, last_seen=last_seen, status=status)

    table = rows([node("r1", "rollout", {"version": 3.0}), node("m", "ps-manager", {"version": 5.0}),
                  node("t0", "trainer", {"step": 4.0, "blobs_held": 2.0}), node("x", "monitor", {}, last_seen=101.0)],
                 now=100.0)
    assert [(r.node_id, r.version, r.lag) for r in table] == [
        ("x", None, None), ("m", 5.0, 0.0), ("r1", 3.0, 2.0), ("t0", 4.0, 1.0)]  # by role, then id
    assert [r.heartbeat_age_s for r in table] == [0.0, 1.0, 1.0, 1.0]  # a clock ahead never reads negative
    assert table[3].blobs_held == 2.0 and table[3].bytes_held is None


# --- service discovery -----------------------------------------------------------------------------------


def test_sd_lists_the_broker_and_live_nodes_and_drops_them_when_down(bus, spawn) -> None:
    """Every live node is listed, and nodes that leave are dropped. A hello whose metrics URL /sd could not list
    is refused ``schema`` (one such node, registered, once kept /sd from ever changing)."""
    broker, control = bus
    url = sd_url(broker)
    ctx = zmq.Context()
    try:
        hostile = NodeInfo(node_id="sd-hostile", role="monitor", host="h", pid=1, metrics="http://[::1")
        with pytest.raises(RemoteError) as refused:
            Client(ctx, control, WireCodec("sd-hostile"), policy=PATIENT).request(Hello(node=hostile, token="t"))
        assert refused.value.code == "schema", refused.value
    finally:
        ctx.destroy(linger=0)
    nodes = {name: spawn(["monitor", "--bus-control", control, "--node-id", name, *FAST_LIVENESS], name)
             for name in ("sd-stays", "sd-leaves", "sd-killed")}
    endpoints = {name: proc.wait_ready()["metrics"] for name, proc in nodes.items()}
    endpoints["bus"] = ready_info(broker)["metrics"]

    def listed() -> dict[str, dict[str, Any]]:
        groups = get_json(url)
        return {group["labels"]["node"]: group for group in groups}

    groups = wait_for(lambda: (found := listed()).keys() == endpoints.keys() and found, WAIT_S,
                      "every node listed in /sd")
    for name, group in groups.items():
        metrics = urllib.parse.urlsplit(endpoints[name])
        assert group["targets"] == [metrics.netloc]
        assert group["labels"] == {"node": name, "role": "bus" if name == "bus" else "monitor", "cluster": "local",
                                   "__metrics_path__": metrics.path}

    assert nodes["sd-leaves"].stop() == 0  # bye: gone at once
    wait_for(lambda: listed().keys() == {"bus", "sd-stays", "sd-killed"}, WAIT_S,
             "a node that said bye dropped from /sd")
    nodes["sd-killed"].proc.kill()  # missed heartbeats: gone after the node timeout
    wait_for(lambda: listed().keys() == {"bus", "sd-stays"}, WAIT_S, "a killed node dropped from /sd")


def test_a_scraped_node_cannot_pass_its_series_off_as_another_nodes(bus, tmp_path: Path) -> None:
    """Regression: the shipped scrape config honored a target's own labels, so a registered node whose metrics
    said ``node="bus", role="bus"`` had its series stored as the broker's. The labels /sd gives a target (node,
    role, cluster) now win, and what the target says of them, or of its job and instance, is dropped."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; `make test` installs it)")
    broker, control = bus
    claimed = b'refbus_claimed_total{node="bus",role="bus",cluster="other",job="x",instance="y"} 7\n'

    class Lying(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(claimed)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    target = f"127.0.0.1:{server.server_address[1]}"
    node = NodeRuntime("monitor", RuntimeSettings(node_id="sd-liar", bus=control, metrics_port=-1))
    node.metrics_url = f"http://{target}/metrics"  # registered as its endpoint, which serves the lie
    try:
        node.start_background()
        with prometheus(PROMETHEUS, tmp_path, sd_url(broker)) as api:
            series = within_scrapes(api, lambda: query(api, "refbus_claimed_total")["data"]["result"],
                                    "the liar's series scraped")
        assert [s["metric"] for s in series] == [{"__name__": "refbus_claimed_total", "node": "sd-liar",
                                                 "role": "monitor", "cluster": "local", "job": "refbus",
                                                 "instance": target}]
    finally:
        node.join(WAIT_S)
        server.shutdown()
        server.server_close()
        serving.join(WAIT_S)


# --- the metrics endpoint against hostile clients ----------------------------------------------------------


def threads_of(pid: int) -> int:
    """How many threads process ``pid`` runs now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)$", status, re.MULTILINE).group(1))  # type: ignore[union-attr]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end of non-blocking ``sock`` closed it (what it sent first is read off)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_idle_connections_cannot_starve_a_nodes_metrics_endpoint(bus) -> None:
    """Regression: each connection to a node's metrics endpoint held a thread and a file descriptor until the
    client closed it, so clients that connect and send nothing (or a request's first bytes) ran the node out of
    descriptors: its scrapes and its ZeroMQ sockets stopped being served. Now at most MAX_CONNECTIONS are served
    at once (more are closed at once), each closed REQUEST_TIMEOUT_S after it was taken up, so a scrape is
    answered while they stay open."""
    broker, _ = bus
    url = ready_info(broker)["metrics"]
    address = urllib.parse.urlsplit(url)
    before = threads_of(broker.pid)
    idle: list[socket.socket] = []
    try:
        for i in range(MAX_CONNECTIONS + 64):
            sock = socket.create_connection((address.hostname, address.port), timeout=WAIT_S)
            if i % 2:
                sock.sendall(b"GET /metr")  # a request begun and never finished
            sock.setblocking(False)
            idle.append(sock)
        most = before

        def scrape_answered() -> bool:
            nonlocal most
            most = max(most, threads_of(broker.pid))
            return fetch_local(url) is not None

        wait_for(scrape_answered, 4 * REQUEST_TIMEOUT_S, "a scrape answered while idle connections are open")
        slack = 4  # threads of the broker's own that come and go
        assert most <= before + MAX_CONNECTIONS + slack, f"{most - before} more threads for idle connections"
        wait_for(lambda: all(closed_by_peer(sock) for sock in idle), 4 * REQUEST_TIMEOUT_S,
                 "every idle connection closed by the node")
    finally:
        for sock in idle:
            sock.close()
    assert broker.proc.poll() is None


def test_garbage_requests_leave_a_nodes_metrics_endpoint_serving(bus) -> None:
    """Malformed request lines, oversized lines and headers, unknown paths and methods, and clients that reset
    their connection mid-request are each answered or closed; scrapes go on being answered, and the node logs
    no traceback for any of them."""
    broker, _ = bus
    url = ready_info(broker)["metrics"]
    address = urllib.parse.urlsplit(url)
    garbage = [
        b"GARBAGE\r\n\r\n",
        bytes(range(256)) * 16,
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(200)) + b"\r\n",
        b"GET /no-such-path HTTP/1.1\r\n\r\n",
        b"GET /%ff%00?%zz HTTP/9.9\r\n\r\n",
        b"HEAD /metrics HTTP/1.1\r\n\r\n",
        b"POST /sd HTTP/1.1\r\nContent-Length: 100000000\r\n\r\nhalf a body",
        b"GET /metr",
    ]
    for request in garbage:
        with socket.create_connection((address.hostname, address.port), timeout=2 * REQUEST_TIMEOUT_S) as sock:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):  # until the node closes it; a timeout fails the test
                    pass
    for request in garbage:  # the client gone mid-request, its connection reset
        sock = socket.create_connection((address.hostname, address.port), timeout=WAIT_S)
        sock.sendall(request[:64])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        sock.close()
    assert scraped(url, "refbus_node_info")
    assert broker.proc.poll() is None
    assert "Traceback" not in broker.log_path.read_text()


# --- shipped configs -------------------------------------------------------------------------------------


def test_shipped_scrape_config_is_valid() -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make test` installs it)")
    result = subprocess.run([PROMTOOL, "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True,
                            timeout=WAIT_S)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["check", "rules", str(ALERT_RULES)], ["test", "rules", str(ALERT_TESTS)]],
                         ids=["check", "unit-tests"])
def test_alert_rules_are_valid_and_fire_on_what_they_guard(command: list[str]) -> None:
    """Each alert fires on the series that should trip it, after its ``for``, and not on the others
    (``tests/alerts_test.yml``)."""
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make test` installs it)")
    result = subprocess.run([PROMTOOL, *command], capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stdout + result.stderr


TARGET_LABELS = {"node", "role", "cluster", "job", "instance"}  # what Prometheus gives every series of a target


def is_metric_name(node: ast.AST) -> bool:
    """Whether ``node`` is a string literal that is a refbus metric name."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return re.fullmatch(r"refbus_\w+", node.value) is not None


def exported_metrics() -> dict[str, set[str]]:
    """Every metric name the nodes register (``metric``, ``histogram``, ``register_live``, or a literal a loop
    registers), with the label names its registration gives it."""
    exported: dict[str, set[str]] = {}
    for path in [*(ROOT / "bus").rglob("*.py"), *(ROOT / "nodes").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if is_metric_name(node):
                exported.setdefault(node.value, set())
            if isinstance(node, ast.Call) and node.args and is_metric_name(node.args[0]):
                labels = [k.value for k in node.keywords if k.arg == "labels"]
                if labels and isinstance(labels[0], ast.Tuple):
                    exported.setdefault(node.args[0].value, set()).update(e.value for e in labels[0].elts)
    return exported


def test_every_alert_rule_names_metrics_and_labels_the_nodes_export() -> None:
    """A rule over a metric or label no node exports evaluates fine and never fires: no other test would see a
    metric renamed under its rule (the live cluster fires one rule only, and the rules' unit tests feed the
    series their own names)."""
    exported = exported_metrics()
    expressions = re.findall(r"^\s*expr: (.+)$", ALERT_RULES.read_text(), re.MULTILINE)
    assert len(expressions) == ALERT_RULES.read_text().count("- alert: ")
    for expr in expressions:
        names = re.findall(r"\b(refbus_\w+)", expr)
        assert names and all(name in exported for name in names), (expr, [n for n in names if n not in exported])
        selected = {label for _, matchers in re.findall(r"\b(refbus_\w+)\{([^}]*)\}", expr)
                    for label in re.findall(r"(\w+)\s*[=!]", matchers)}
        grouped = {label.strip() for labels in re.findall(r"\bby \(([^)]*)\)", expr) for label in labels.split(",")}
        known = TARGET_LABELS.union(*(exported[name] for name in names))
        assert selected | grouped <= known, (expr, (selected | grouped) - known)


def test_dashboard_provisions_as_is() -> None:
    text = DASHBOARD.read_text()
    dashboard = json.loads(text)
    assert "__inputs" not in dashboard and "${DS_" not in text
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    expressions = dashboard_expressions()
    assert len(expressions) >= 20

    def datasources(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from datasources(value)
        elif isinstance(node, list):
            for value in node:
                yield from datasources(value)

    assert all(ds == {"type": "prometheus", "uid": "${datasource}"} for ds in datasources(dashboard["panels"]))


# --- the dashboard against a real Prometheus ---------------------------------------------------------------


def _provoke_errors(broker: dict[str, Any], monitor_metrics: str) -> None:
    """Make the error counters exist: an event of an unknown kind (forwarded by the broker, rejected by the
    monitor) and a malformed event (forwarded too, and unreadable for the broker's ring when a replay reads
    it). Sent until both are counted, because a new PUB connection loses what it sends before it is up."""
    ctx = zmq.Context()
    try:
        pub = make_socket(ctx, zmq.PUB, connect=broker["endpoints"]["events_in"])
        codec = WireCodec("bad-publisher")
        control = Client(ctx, broker["endpoints"]["control"], codec, policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
        seq = 0

        def counted() -> bool:
            nonlocal seq
            seq += 1
            _, header, body = codec.encode(Sync(token="x"), seq=seq)
            pub.send_multipart([b"no-such-kind", header, body])
            pub.send_multipart([b"too-few-frames"])
            control.request(Replay(since=seq, src="no-such-source"))  # reads every ring event it has not read
            return (scraped(broker["metrics"], 'refbus_bus_events_dropped_total{reason="malformed"}')
                    and scraped(monitor_metrics, 'refbus_bus_events_rejected_total{code="unknown-kind"}'))

        wait_for(counted, WAIT_S, "a rejected and a dropped event counted")
    finally:
        ctx.destroy(linger=0)


def _provoke_violation_and_request_error(events: Path) -> None:
    """Make the ownership-violation and request-error counters exist in a healthy cluster: fetch a blob after
    its owner deleted it (refused and counted as a violation by the env server that kept it; read-only, the
    run goes on), and send that env server a request of a kind it does not serve. ``events``: what a
    `refbus monitor --json` attached to the cluster printed."""
    def deleted_blob() -> tuple[str, str] | None:
        endpoints: dict[str, str] = {}
        for line in events.read_text().splitlines()[:-1]:  # the last line may be half written
            record = json.loads(line)
            if record["type"] == "episode-finished":
                endpoints.update((ref["blob_id"], ref["endpoint"]) for ref in record["refs"])
            elif record["type"] == "delete" and (known := [b for b in record["blob_ids"] if b in endpoints]):
                return known[0], endpoints[known[0]]
        return None

    blob_id, endpoint = wait_for(deleted_blob, WAIT_S, "a blob kept and deleted while the monitor watched")
    ctx = zmq.Context()
    try:
        client = Client(ctx, endpoint, WireCodec("tester"), policy=PATIENT)
        reply = client.request(Fetch(blob_ids=[blob_id], holder="dashboard-test")).body
        assert isinstance(reply, Blobs) and (reply.blobs, reply.missing) == ([], [blob_id])
        with pytest.raises(RemoteError):
            client.request(Nodes())
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(300)  # every wait below is bounded and fails with a message (and reaps the run) before this
def test_every_dashboard_expression_parses_and_returns_data(spawn, tmp_path: Path) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; `make test` installs it)")
    up = Up(tmp_path, 1000)  # runs until this test has what it needs, then gets Ctrl-C
    try:
        broker = up.bus()
        control = broker["endpoints"]["control"]
        with prometheus(PROMETHEUS, tmp_path, broker["metrics"].removesuffix("/metrics") + "/sd") as api:
            # A second terminal's `refbus monitor`, as a user watches a run: one more node to scrape.
            events = tmp_path / "watch.jsonl"
            with open(events, "wb") as out:
                watch = spawn(["monitor", "--json", "--node-id", "watch", "--bus-control", control], "watch",
                              stdout=out)
            watch_info = watch.wait_ready()
            expected = {"bus", "watch", *NODES}
            # The run's own start first (its nodes ready, torch imported on busy cores), bounded as the run is;
            # then Prometheus, counted in scrapes: each node found through /sd and answering, twice (a rate
            # needs two samples).
            spawned = NODES - {"up-watcher"}  # node processes, each with its ready file (the watcher is in up's)
            wait_for(lambda: up.alive() and spawned <= set(up.note_pids()), START_S, "every node of the run ready")
            within_scrapes(api, lambda: up.alive() and (counts := answered(api)).keys() == expected
                           and min(counts.values()) >= 2, f"two answered scrapes of every node ({sorted(expected)})")
            wait_for(lambda: up.alive() and query(api, "max(refbus_ps_current_version) >= 2")["data"]["result"],
                     START_S, "the cluster training (version 2 scraped)")
            _provoke_errors(broker, watch_info["metrics"])
            _provoke_violation_and_request_error(events)

            def outcome(title: str, expr: str) -> str | None:
                """None while ``expr`` has no data and Prometheus has scraped fewer than SCRAPES times since
                ``since`` (counters appear on their first scrape after their first event, rates after two)."""
                promql = expr
                for variable, value in GRAFANA_VARIABLES.items():
                    promql = promql.replace(variable, value)
                answer = query(api, promql)
                if answer["status"] != "success":
                    return f"{title}: {expr}: {answer.get('error')}"
                if answer["data"]["result"]:
                    return "ok"
                if scrapes(api, "bus") >= since + SCRAPES:
                    return f"{title}: {expr}: no data after {SCRAPES} scrapes"
                return None

            since = scrapes(api, "bus")
            # The timeout only stops a Prometheus that no longer scrapes: the scrape count bounds each wait.
            answers = [wait_for(lambda title=title, expr=expr: outcome(title, expr), OVERRUN * SCRAPES * SCRAPE_S,
                                f"{title}: {expr} answered, or {SCRAPES} scrapes without data")
                       for title, expr in dashboard_expressions()]
            failures = [answer for answer in answers if answer != "ok"]
            assert not failures, "dashboard queries that failed:\n" + "\n".join(failures)

            # The shipped alerting rules load and evaluate against the live cluster; the violation provoked
            # above fires its alert (it has no `for`), and a healthy run trips none of the others.
            def rules_evaluated() -> list[dict[str, Any]] | None:
                groups = get_json(f"{api}/api/v1/rules")["data"]["groups"]
                rules = [rule for group in groups for rule in group["rules"]]
                never = "0001-01-01T00:00:00Z"  # Prometheus's lastEvaluation before the first evaluation
                return rules if rules and all(rule["lastEvaluation"] != never for rule in rules) else None

            rules = wait_for(rules_evaluated, WAIT_S, "every alerting rule evaluated")
            shipped = ALERT_RULES.read_text().count("- alert: ")
            assert len(rules) == shipped and all(rule["health"] == "ok" for rule in rules), rules

            def firing() -> set[str]:
                alerts = get_json(f"{api}/api/v1/alerts")["data"]["alerts"]
                return {alert["labels"]["alertname"] for alert in alerts if alert["state"] == "firing"}

            wait_for(lambda: "RefbusOwnershipViolation" in firing(), WAIT_S, "the violation's alert firing")
            assert firing() == {"RefbusOwnershipViolation"}

            # The broker counts nodes by their role, in a label of its own (role is the target's: the broker's).
            by_role = query(api, "sum by (member_role) (refbus_bus_nodes)")["data"]["result"]
            assert {r["metric"]["member_role"]: float(r["value"][1]) for r in by_role} == {
                "monitor": 2, "ps-manager": 1, "ps-worker": 2, "env-server": 2, "trainer": 2, "rollout": 2,
                "orchestrator": 1}

        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(STOP_S) == 130, up.output()
        assert up.leftovers() == []
    finally:
        up.close()
