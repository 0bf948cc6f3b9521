"""The broker's registry is bounded (``bus.max_nodes``): hellos of new node ids past it are refused
``registry-full`` and counted, those registered keep their place, and entries that never heartbeat (a flooding
peer killed mid-flood) are expired within the node timeout, freeing their places. Registrations with garbage in
their fields are refused with a clear code while the broker keeps serving. A real broker process on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import FAST_LIVENESS
from polling import read_line, wait_for
from ps_support import scrape
from refbus.bus.sockets import make_socket
from refbus.nodes.launch import NodeProcess, NodeStartError, start_bus
from refbus.nodes.up import rendezvous
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Body, Bye, Error, Heartbeat, Hello, NodeInfo, NodeList, Nodes, Ok, Welcome

NODE_TIMEOUT_S = 1.0  # FAST_LIVENESS's
WAIT_S = 10 * NODE_TIMEOUT_S  # expiry: a liveness pass every node_timeout/4 after node_timeout, with room
ANSWER_MS = 10_000
MAX_NODES = 8
START_S = 30.0  # a node process starting, imports (a trainer's torch) included
FLOODER = Path(__file__).with_name("registry_flooder.py")


@pytest.fixture
def small_bus(tmp_path: Path) -> Iterator[tuple[NodeProcess, str]]:
    """A broker registering at most ``MAX_NODES`` nodes; stopped (and checked for a clean exit) afterwards."""
    proc, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, "--bus-max-nodes", str(MAX_NODES)])
    try:
        yield proc, control
    finally:
        assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def raw(small_bus) -> Iterator[zmq.Socket]:
    """A DEALER connected to the broker's control endpoint."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=small_bus[1])
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


CODEC = WireCodec("registry-test")


def ask(sock: zmq.Socket, body: Body) -> Body:
    sock.send_multipart(CODEC.encode(body))
    assert sock.poll(ANSWER_MS), f"the broker did not answer {body.kind}"
    return CODEC.decode(sock.recv_multipart()).body


def hello(sock: zmq.Socket, node_id: str, **fields: object) -> Body:
    """``sock``'s hello registering ``node_id`` (role ``flood`` on host ``h``, pid 1, unless ``fields`` say else)."""
    node = NodeInfo(**{"node_id": node_id, "role": "flood", "host": "h", "pid": 1, **fields})  # type: ignore[arg-type]
    return ask(sock, Hello(node=node, token=node_id))


def listed(sock: zmq.Socket, role: str = "") -> list[str]:
    answer = ask(sock, Nodes(role=role))
    assert isinstance(answer, NodeList) and not answer.omitted, answer
    return sorted(node.node_id for node in answer.nodes)


def keeper(spawn, control: str, node_id: str, name: str = "") -> NodeProcess:
    """A real node registered at ``control`` as ``node_id`` (its process named ``name``, default the id): started,
    and ready (its PUB proven live, listed)."""
    node = spawn(["monitor", "--bus-control", control, "--node-id", node_id, "--node-metrics-port", "-1"],
                 name or node_id)
    node.wait_ready()
    return node


def test_hellos_past_max_nodes_are_refused_and_those_registered_keep_their_place(small_bus, raw, spawn) -> None:
    proc, control = small_bus
    keeper(spawn, control, "keeper")
    for i in range(MAX_NODES - 1):  # they never prove their PUB live nor heartbeat: still joining
        assert isinstance(hello(raw, f"flood-{i}"), Welcome)
    refusals = [hello(raw, f"past-{i}") for i in range(3)]
    assert all(isinstance(r, Error) and r.code == "registry-full" and "bus.max_nodes" in r.message
               for r in refusals), refusals
    assert isinstance(hello(raw, "flood-0"), Welcome)  # registering again under its id is never refused
    assert listed(raw) == ["keeper"]
    assert scrape(proc.info["metrics"], "refbus_requests_rejected_total", code="registry-full") == 3
    with pytest.raises(NodeStartError, match="registry-full"):
        keeper(spawn, control, "late")
    # The joining entries never heartbeat: expired within the node timeout, they free their places.
    wait_for(lambda: isinstance(hello(raw, "past-0"), Welcome), WAIT_S, "a place freed by expiry")
    keeper(spawn, control, "later")
    assert listed(raw) == ["keeper", "later"]


def test_a_flooder_killed_mid_flood_leaves_nothing_registered_within_the_node_timeout(small_bus, raw, spawn) -> None:
    _, control = small_bus
    keeper(spawn, control, "keeper")
    flooder = subprocess.Popen([sys.executable, str(FLOODER), control], stdout=subprocess.PIPE, bufsize=0,
                               stdin=subprocess.DEVNULL)
    try:
        told = json.loads(read_line(flooder, WAIT_S))
        assert told == {"registered": MAX_NODES - 1, "refused": "registry-full"}
        flooded = wait_for(lambda: len(listed(raw, "flood")) == MAX_NODES - 1, WAIT_S, "the flooded nodes live")
        assert flooded
        assert "keeper" in listed(raw)
        flooder.send_signal(signal.SIGKILL)
        flooder.wait(WAIT_S)
    finally:
        flooder.kill()
        flooder.wait(WAIT_S)
        flooder.stdout.close()  # type: ignore[union-attr]
    wait_for(lambda: listed(raw) == ["keeper"], WAIT_S, "the flooded nodes expired")
    keeper(spawn, control, "after")
    assert listed(raw) == ["after", "keeper"]


def test_a_process_whose_id_another_took_keeps_no_entry_live_and_registers_again_once_that_one_is_gone(
        small_bus, raw, spawn) -> None:
    """A process replaced after all (stalled past the node timeout: its entry expired, another process registered
    its id), then heard again: its heartbeats (they name their process) are refused ``replaced`` instead of keeping
    the other's entry live, so once that one is SIGKILLed its entry expires and the stalled process registers
    again."""
    _, control = small_bus

    def registered() -> list[int]:
        answer = ask(raw, Nodes())
        assert isinstance(answer, NodeList)
        return [node.pid for node in answer.nodes if node.node_id == "dup"]

    first = keeper(spawn, control, "dup", "first")
    first.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: registered() == [], WAIT_S, "the stalled process's entry expired")
        second = keeper(spawn, control, "dup", "second")
        assert registered() == [second.pid]
    finally:
        first.signal(signal.SIGCONT)
    wait_for(lambda: "node.replaced" in first.log_tail(), WAIT_S, "the first process told it was replaced")
    assert registered() == [second.pid]
    second.signal(signal.SIGKILL)
    second.proc.wait(WAIT_S)
    wait_for(lambda: registered() == [first.pid], WAIT_S, "the first process registered again")


def test_garbage_registrations_are_refused_take_no_place_and_the_broker_keeps_serving(small_bus, raw) -> None:
    """Fields past the schema's bounds, a metrics endpoint that is no URL, a body that is no map: each refused
    ``schema`` naming the field, none counted against ``bus.max_nodes``, and the broker answers on."""
    garbage = [
        {"labels": {"k": "x" * 5000}},
        {"labels": {f"k{i}": "v" for i in range(65)}},
        {"role": ""},
        {"role": "r" * 300},
        {"metrics": "not a url"},
        {"pid": -1},
    ]
    for i in range(MAX_NODES + 1):  # more of them than the registry has places
        fields = garbage[i % len(garbage)]
        refused = hello(raw, f"garbage-{i}", **fields)
        assert isinstance(refused, Error) and refused.code == "schema", (fields, refused)
    kind, header, _ = CODEC.encode(Hello(node=NodeInfo(node_id="z", role="r", host="h", pid=1), token="z"))
    for body in (b"\x05", b"\x82\xa4node\xc0\xa5token\xa1z", b"\x91" * 100 + b"\xc0"):
        raw.send_multipart([kind, header, body])
        assert raw.poll(ANSWER_MS)
        refused = CODEC.decode(raw.recv_multipart()).body
        assert isinstance(refused, Error) and refused.code == "schema", refused
    assert isinstance(hello(raw, "good"), Welcome)
    replaced = ask(raw, Heartbeat(node_id="good", process=("h", 2, 0.0)))
    assert isinstance(replaced, Error) and replaced.code == "replaced" and "pid 1" in replaced.message
    kind, header, _ = CODEC.encode(Heartbeat(node_id="good"))
    raw.send_multipart([kind, header, b"\x82\xa7node_id\xa4good\xa7process\x93\xa1h\xff\x00"])  # pid -1
    assert raw.poll(ANSWER_MS)
    refused = CODEC.decode(raw.recv_multipart()).body
    assert isinstance(refused, Error) and refused.code == "schema" and "process" in refused.message, refused
    assert isinstance(ask(raw, Heartbeat(node_id="good", process=("h", 1, 0.0))), Ok)
    assert listed(raw) == []  # "good" never proved its PUB live: registered, not listed


def test_hellos_naming_odd_ids_roles_or_endpoints_are_refused_and_the_broker_keeps_serving(small_bus, raw) -> None:
    """Peers name files and log lines after node ids and roles, and connect to the endpoints a registration
    advertises: a hello whose id or role could leave a directory, read as a flag or forge a line, or whose endpoint
    is no address to connect to (one ZeroMQ would take modulo 65536 among them), is refused ``schema`` naming the
    field, registers nothing, and the broker answers on."""
    garbage = [
        ("node_id", {"node_id": "../../x"}), ("node_id", {"node_id": "a/b"}), ("node_id", {"node_id": "."}),
        ("node_id", {"node_id": "-rf"}), ("node_id", {"node_id": "a\nb"}), ("node_id", {"node_id": "a\0b"}),
        ("node_id", {"node_id": "n\u00e9"}), ("node_id", {"node_id": "a b"}),
        ("role", {"role": "x/../y"}), ("role", {"role": "r\nnode.up node=forged"}), ("role", {"role": "r o"}),
        ("endpoints", {"endpoints": {"blobs": "not an endpoint"}}),
        ("endpoints", {"endpoints": {"blobs": "tcp://127.0.0.1:70000"}}),
        ("endpoints", {"endpoints": {"blobs": "tcp://*:5555"}}), ("endpoints", {"endpoints": {"blobs": "tcp://h:0"}}),
        ("endpoints", {"endpoints": {"blobs": "inproc://x"}}), ("endpoints", {"endpoints": {"blobs": ""}}),
    ]
    for i, (field, fields) in enumerate(garbage):
        refused = hello(raw, str(fields.pop("node_id", f"odd-{i}")), **fields)
        assert isinstance(refused, Error) and refused.code == "schema" and f"hello.node.{field}" in refused.message, (
            fields, refused)
    endpoints = {"blobs": "tcp://127.0.0.1:5555", "ps": "ipc:///tmp/ps.sock", "trainer": "tcp://[::1]:7"}
    assert isinstance(hello(raw, "Env_0.a-1", role="env-server", endpoints=endpoints), Welcome)
    assert isinstance(hello(raw, "x" * 256), Welcome)
    assert isinstance(ask(raw, Heartbeat(node_id="Env_0.a-1")), Ok)
    unknown = ask(raw, Heartbeat(node_id="odd-8"))
    assert isinstance(unknown, Error) and unknown.code == "unknown-node", unknown


def test_byes_from_another_process_or_naming_garbage_leave_the_holder_registered(small_bus, raw) -> None:
    """A bye naming another process than the holder's (one replaced under its id) is refused ``replaced`` and
    counted; one whose ``process`` is garbage is refused ``schema`` naming it; the holder keeps its entry (its
    heartbeats answered) and the broker answers on. A bye naming the holder's process removes it, and so does one
    naming none (a third party's client), as before."""
    proc, _ = small_bus
    assert isinstance(hello(raw, "held"), Welcome)  # host h, pid 1, started 0
    foreign = ask(raw, Bye(node_id="held", process=("h", 2, 0.0)))
    assert isinstance(foreign, Error) and foreign.code == "replaced" and "pid 1" in foreign.message, foreign
    for process in ("h", ["h", 1], ["h", -1, 0.0], ["h", 1, -1.0], ["h", 1, "x"], ["h" * 300, 1, 0.0], {"h": 1}):
        kind, header, _ = CODEC.encode(Bye(node_id="held"))
        raw.send_multipart([kind, header, msgspec.msgpack.encode({"node_id": "held", "process": process})])
        assert raw.poll(ANSWER_MS)
        refused = CODEC.decode(raw.recv_multipart()).body
        assert isinstance(refused, Error) and refused.code == "schema" and "process" in refused.message, refused
    assert isinstance(ask(raw, Heartbeat(node_id="held", process=("h", 1, 0.0))), Ok)
    assert scrape(proc.info["metrics"], "refbus_requests_rejected_total", code="replaced") == 1
    assert "registry.bye_refused" in proc.log_tail(200), proc.log_tail()
    for node_id, process in (("held", ("h", 1, 0.0)), ("anonymous", None)):
        assert isinstance(hello(raw, node_id), Welcome)  # the holder again: its own process, kept as it was
        assert isinstance(ask(raw, Bye(node_id=node_id, process=process)), Ok)
        gone = ask(raw, Heartbeat(node_id=node_id))
        assert isinstance(gone, Error) and gone.code == "unknown-node", (node_id, gone)


def test_a_probe_takes_no_place_registers_nothing_and_is_refused_garbage(small_bus, raw, spawn) -> None:
    """A hello that only asks whether its id could be taken (``probe``) is answered ``ok`` with the registry full
    (it takes no place) and registers nothing (a heartbeat naming it is answered ``unknown-node``); under a live
    holder's id it is asked to wait (``id-in-use``) as a hello would be, the holder left as it was; a ``probe`` that
    is no boolean is refused ``schema``."""
    _, control = small_bus
    keeper(spawn, control, "held")
    for i in range(MAX_NODES - 1):
        assert isinstance(hello(raw, f"flood-{i}"), Welcome)
    free = NodeInfo(node_id="free", role="flood", host="h", pid=1)
    assert isinstance(ask(raw, Hello(node=free, token="free", probe=True)), Ok)
    unknown = ask(raw, Heartbeat(node_id="free"))
    assert isinstance(unknown, Error) and unknown.code == "unknown-node", unknown
    held = NodeInfo(node_id="held", role="monitor", host="h", pid=1)
    waiting = ask(raw, Hello(node=held, token="held", probe=True))
    assert isinstance(waiting, Error) and waiting.code == "id-in-use" and waiting.retry_after_s > 0, waiting
    assert listed(raw) == ["held"]
    kind, header, _ = CODEC.encode(Hello(node=free, token="garbage"))
    raw.send_multipart([kind, header, msgspec.msgpack.encode({"node": msgspec.to_builtins(free), "token": "garbage",
                                                              "probe": "yes"})])
    assert raw.poll(ANSWER_MS)
    refused = CODEC.decode(raw.recv_multipart()).body
    assert isinstance(refused, Error) and refused.code == "schema" and "probe" in refused.message, refused


@pytest.mark.parametrize("role", ["env-server", "trainer"])
def test_a_node_refused_at_start_for_a_full_registry_says_so_in_one_line_and_exits_1(
        spawn, tmp_path: Path, role: str) -> None:
    """A real node started against a real broker whose one place another node holds (``bus.max_nodes`` 1): before,
    the refusal (``registry-full``) escaped as a traceback. Now its last words are one line naming the broker, the
    code and the broker's reason, and it exits 1 as before (restartable: a place may free up). A trainer rank too,
    whose start-up failure was taken for a peer's death seen by gloo: it waited for a verdict its closed node
    could not give, until the exit watchdog ended it with status 0."""
    bus, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, "--bus-max-nodes", "1"])
    try:
        keeper(spawn, control, "filler")
        own = {"env-server": ["--store-directory", str(tmp_path / "shm")],
               "trainer": ["--trainer-rank", "0", "--trainer-world-size", "1",
                           "--trainer-init-method", rendezvous(tmp_path, "refused", 0)]}[role]
        # A shutdown timeout well within the trainer's wait for a peer's verdict (1.5 node timeouts of 5 s).
        refused = spawn(["node", role, "--bus-control", control, "--node-id", "late", "--node-metrics-port", "-1",
                         "--bus-node-timeout-s", "5", "--node-shutdown-timeout-s", "1", *own], "late")
        assert refused.proc.wait(timeout=START_S) == 1, refused.log_tail()
        said = refused.log_tail()
        assert "Traceback" not in said, said
        assert said.splitlines()[-1] == (
            f"refbus: the broker at {control} refused node id 'late': [registry-full] the broker registers at most "
            "1 nodes (bus.max_nodes), live or joining: 'late' is not registered"), said
    finally:
        assert bus.stop() == 0, bus.log_tail()
