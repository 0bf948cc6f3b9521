"""CURVE clusters: `refbus keys generate`, the ZAP allow-list, src checked against the authenticated node id,
refused peers counted while the node keeps serving, the parameter server's frames and broadcast init under
CURVE, and the bind refusal of an unprotected node."""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import wait_for
from ps_support import make_state, start_cluster
from refbus.bus.reqrep import Client, RemoteError, RequestTimeout, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.security import Curve, SecurityError, check_bind, generate, load_curve
from refbus.bus.sockets import EVENT_OPTIONS, SocketOptions, make_socket, send_frames
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.ps.client import PsClient
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import (
    Blobs,
    Bye,
    Claim,
    Claimed,
    Delete,
    Deleted,
    EpisodeFinished,
    Fetch,
    Keep,
    Kept,
)
from safetensors.torch import save_file

pytest_plugins = ["wire_fixtures"]  # zmq_ctx

WAIT_S = 10.0
PATIENT = RetryPolicy(timeout_s=2.0, attempts=3)
# A refused or plain peer never gets an answer: one short attempt bounds the wait.
ONE_TRY = RetryPolicy(timeout_s=1.0, attempts=1)
CLI = [sys.executable, "-m", "refbus.nodes.cli"]

NODES = {"bus": "bus", "env-a": "env-server", "observer": "observer", "tester": "tester"}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    for node_id, role in NODES.items():
        generate(str(directory), node_id, role)
    return directory


def curve_of(keys: Path, node_id: str) -> Curve:
    return load_curve(str(keys), "", node_id, NODES[node_id])



@pytest.fixture
def curve_cluster(tmp_path: Path, keys: Path, spawn: Callable[..., NodeProcess]) -> Iterator[dict[str, Any]]:
    """A CURVE broker and env server (processes), and an in-process observer queueing every event."""
    flags = ["--security-curve-dir", str(keys)]
    bus, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, *flags])
    env = spawn(["node", "env-server", "--bus-control", control, "--node-id", "env-a", *FAST_LIVENESS, *flags],
                "env-a")
    info = env.wait_ready(timeout=WAIT_S * 3)
    observer = NodeRuntime("observer", RuntimeSettings(bus=control, node_id="observer", metrics_port=-1,
                                                       curve_dir=str(keys)))
    events: queue.Queue[Message] = queue.Queue()
    observer.subscribe(events.put)
    observer.start_background()
    try:
        yield {"bus": bus, "control": control, "env": env, "info": info, "events": events}
    finally:
        observer.join(timeout=WAIT_S)
        env.stop()
        assert bus.stop() == 0, bus.log_tail()


def next_event(events: queue.Queue[Message], kind: str) -> Message:
    def found() -> Message | None:
        while not events.empty():
            event = events.get_nowait()
            if event.kind == kind:
                return event
        return None

    return wait_for(found, WAIT_S, f"a {kind} event")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        return response.read().decode()


def metric(url: str, line_start: str) -> float:
    for line in scrape(url).splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def client(ctx: zmq.Context, endpoint: str, src: str, curve: Curve | None,
           policy: RetryPolicy = PATIENT) -> Client:
    return Client(ctx, endpoint, WireCodec(src), policy=policy, options=SocketOptions(curve=curve))


def test_keys_generate_makes_private_pairs_and_an_allow_list(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    made = subprocess.run([*CLI, "keys", "generate", str(directory), "--node-id", "env-a", "--role", "env-server"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for stem in ("cluster", "env-a"):
        secret = (directory / f"{stem}.key_secret").read_text().strip()
        public = (directory / f"{stem}.key").read_text().strip()
        assert stat.S_IMODE((directory / f"{stem}.key_secret").stat().st_mode) == 0o600
        assert zmq.curve_public(secret.encode()).decode() == public
        assert secret not in made.stdout + made.stderr and public in made.stdout
    entry = [line.split() for line in (directory / "allow-list").read_text().splitlines()
             if not line.startswith("# ")]
    assert entry == [[(directory / "env-a.key").read_text().strip(), "env-a", "env-server"]]

    again = subprocess.run([*CLI, "keys", "generate", str(directory), "--node-id", "env-a", "--role", "env-server"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already in" in again.stderr
    assert secret == (directory / "env-a.key_secret").read_text().strip()  # never replaced
    bad = subprocess.run([*CLI, "keys", "generate", str(directory), "--node-id", "a b", "--role", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "node ids and roles" in bad.stderr


def test_a_curve_cluster_keeps_claims_fetches_deletes_and_publishes(curve_cluster: dict[str, Any], keys: Path,
                                                                    zmq_ctx: zmq.Context) -> None:
    endpoint = curve_cluster["info"]["endpoints"]["blobs"]
    tester = client(zmq_ctx, endpoint, "tester", curve_of(keys, "tester"))
    arrays = random_arrays(64, seed=0, layers=4, top_k=2, k=3, max_count=3, routing_dtype=np.uint8)
    kept = tester.request(Keep(episode_id="ep-1", branches=[arrays], policy_version=1)).body
    assert isinstance(kept, Kept)
    ids = [ref.blob_id for ref in kept.refs]
    finished = next_event(curve_cluster["events"], EpisodeFinished.kind)
    assert finished.header.src == "env-a" and finished.body.refs == kept.refs

    assert tester.request(Claim(blob_ids=ids, holder="tester")).body == Claimed(blob_ids=ids)
    assert next_event(curve_cluster["events"], Claim.kind).body == Claim(blob_ids=ids, holder="tester")
    fetched = tester.request(Fetch(blob_ids=ids, holder="tester")).body
    assert isinstance(fetched, Blobs) and not fetched.missing
    for name, array in arrays.items():
        np.testing.assert_array_equal(fetched.blobs[0].arrays[name], array)
    assert tester.request(Delete(blob_ids=ids, holder="tester", reason="trained")).body == Deleted(blob_ids=ids)
    assert next_event(curve_cluster["events"], Delete.kind).body.blob_ids == ids


def test_unknown_keys_and_plain_clients_are_refused_and_the_node_keeps_serving(
        curve_cluster: dict[str, Any], keys: Path, zmq_ctx: zmq.Context) -> None:
    endpoint, metrics = curve_cluster["info"]["endpoints"]["blobs"], curve_cluster["info"]["metrics"]
    stranger_public, stranger_secret = zmq.curve_keypair()  # knows the cluster's server key, not allow-listed
    valid = curve_of(keys, "tester")
    stranger = dataclasses.replace(valid, public=stranger_public, secret=stranger_secret)
    with pytest.raises(RequestTimeout):
        client(zmq_ctx, endpoint, "tester", stranger, ONE_TRY).request(Claim(blob_ids=["b"], holder="tester"))
    refused = 'refbus_security_peers_refused_total{reason="unknown-key"}'
    wait_for(lambda: metric(metrics, refused) >= 1, WAIT_S, "the refusal counted")
    assert stranger_public.decode() in curve_cluster["env"].log_tail() and "security.peer_refused" in \
        curve_cluster["env"].log_tail()

    with pytest.raises(RequestTimeout):  # no CURVE at all: the handshake never completes, nothing is served
        client(zmq_ctx, endpoint, "tester", None, ONE_TRY).request(Claim(blob_ids=["b"], holder="tester"))

    answered = client(zmq_ctx, endpoint, "tester", valid).request(Claim(blob_ids=["b"], holder="tester")).body
    assert answered == Claimed(blob_ids=[], missing=["b"])
    assert metric(metrics, 'refbus_requests_total{kind="claim"}') == 1  # the refused ones never reached a handler


def test_a_valid_key_posing_as_another_node_is_refused(curve_cluster: dict[str, Any], keys: Path,
                                                       zmq_ctx: zmq.Context) -> None:
    endpoint, metrics = curve_cluster["info"]["endpoints"]["blobs"], curve_cluster["info"]["metrics"]
    tester = curve_of(keys, "tester")
    with pytest.raises(RemoteError) as err:
        client(zmq_ctx, endpoint, "observer", tester).request(Delete(blob_ids=["x"], holder="observer",
                                                                     reason="trained"))
    assert err.value.code == "wrong-src" and "'tester'" in err.value.detail
    assert metric(metrics, 'refbus_requests_rejected_total{code="wrong-src"}') == 1
    assert metric(metrics, 'refbus_requests_total{kind="delete"}') == 0

    # The broker's registry: a key speaks only for its own node id, under its allowed role.
    control = client(zmq_ctx, curve_cluster["control"], "tester", tester)
    with pytest.raises(RemoteError) as bye:
        control.request(Bye(node_id="env-a"))
    assert bye.value.code == "wrong-src"

    # Events: a PUB with a valid key publishing as env-a is dropped at the broker's events_in.
    bus = curve_cluster["bus"].info
    pub = make_socket(zmq_ctx, zmq.PUB, connect=bus["endpoints"]["events_in"],
                      options=dataclasses.replace(EVENT_OPTIONS, curve=tester))
    forged = WireCodec("env-a")
    dropped = 'refbus_bus_events_dropped_total{reason="wrong-src"}'

    def forge() -> bool:
        send_frames(pub, forged.encode(Claim(blob_ids=["forged"], holder="x"), seq=1))
        return metric(bus["metrics"], dropped) >= 1

    wait_for(forge, WAIT_S, "the forged event dropped", poll_s=0.05)
    assert all(e.body != Claim(blob_ids=["forged"], holder="x") for e in drain(curve_cluster["events"]))


def drain(events: queue.Queue[Message]) -> list[Message]:
    out = []
    while not events.empty():
        out.append(events.get_nowait())
    return out


def test_a_node_refuses_to_bind_an_unprotected_address() -> None:
    settings = RuntimeSettings(node_id="lonely", metrics_port=-1)
    runtime = NodeRuntime("env-server", settings, register=False)
    try:
        with pytest.raises(SecurityError, match=re.escape("security.insecure = true")):
            runtime.bind(zmq.ROUTER, "blobs", "tcp://0.0.0.0:0")
        assert runtime.bind(zmq.ROUTER, "loopback", "tcp://127.0.0.1:0")
    finally:
        runtime.close()
    check_bind("tcp://0.0.0.0:7770", signed=True, curve=False, insecure=False)
    check_bind("tcp://0.0.0.0:7770", signed=False, curve=True, insecure=False)
    check_bind("tcp://0.0.0.0:7770", signed=False, curve=False, insecure=True)
    for local in ("tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://[::1]:0", "ipc:///tmp/x", "inproc://x",
                  "ws://127.0.0.1:0/refbus"):
        check_bind(local, signed=False, curve=False, insecure=False)
    # Transports other than tcp and WebSocket were all taken for local, whatever their address.
    for remote in ("tcp://*:0", "tcp://0.0.0.0:0", "tcp://[::]:0", "tcp://no-such-host.invalid:0",
                   "ws://0.0.0.0:0/refbus", "wss://*:0", "tipc://{0,1}", "udp://*:5555", "pgm://eth0;239.192.1.1:5555"):
        with pytest.raises(SecurityError):
            check_bind(remote, signed=False, curve=False, insecure=False)

    started = subprocess.run([*CLI, "node", "env-server", "--env-server-endpoint", "tcp://0.0.0.0:0",
                              "--bus-control", "tcp://127.0.0.1:1", "--node-metrics-port", "-1"],
                             capture_output=True, text=True, timeout=60,
                             env={name: value for name, value in os.environ.items() if name != "REFBUS_SECRET"})
    output = started.stdout + started.stderr
    assert started.returncode != 0 and "refusing to bind tcp://0.0.0.0:0" in output and "security.insecure" in output


GARBAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("garbage secret", lambda d: (d / "env-a.key_secret").write_text("not a key\n"), "40 Z85 characters"),
    ("binary secret", lambda d: (d / "env-a.key_secret").write_bytes(b"\xff" * 40), "cannot be read"),
    ("40 non-Z85 chars", lambda d: (d / "env-a.key_secret").write_text("~" * 40), "not Z85"),
    # Z85 characters whose 5-character groups exceed 32 bits: the decoder's struct.error was not caught.
    ("overflowing Z85 secret", lambda d: (d / "env-a.key_secret").write_text("#" * 40), "not Z85"),
    ("overflowing Z85 allow-list key", lambda d: (d / "allow-list").open("a").write("#" * 40 + " env-b x\n"),
     "line 3 is not a CURVE key: not Z85"),
    # Once encoded with '?' for each non-ASCII character, a key was taken for Z85 and failed as a pair mismatch.
    ("non-ASCII secret", lambda d: (d / "env-a.key_secret").write_text(
        "\u00e9" + (d / "env-a.key_secret").read_text()[1:]), "non-ASCII characters"),
    # Writable by others, in a directory others can reach (in a 0700 directory it is accepted: see the umask test).
    ("allow-list writable by others", lambda d: (d.chmod(0o755), (d / "allow-list").chmod(0o666)), "chmod go-w"),
    ("key directory writable by others", lambda d: d.chmod(0o1777), "writable by group or others"),
    ("pair mismatch", lambda d: (d / "env-a.key").write_text(zmq.curve_keypair()[0].decode()), "not one key pair"),
    ("readable secret", lambda d: (d / "env-a.key_secret").chmod(0o644), "chmod 600"),
    ("missing cluster key", lambda d: (d / "cluster.key_secret").unlink(), "does not exist"),
    ("torn allow-list", lambda d: (d / "allow-list").write_text("abc env-a\n"), "line 1"),
    ("key not listed", lambda d: (d / "allow-list").write_text(""), "is not in"),
    ("other node's grant", lambda d: (d / "allow-list").write_text(
        (d / "allow-list").read_text().replace(" env-a ", " env-b ")), "--node-id env-b"),
]


@pytest.mark.parametrize(("case", "spoil", "message"), GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_key_files_give_a_clear_error(tmp_path: Path, case: str, spoil: Callable[[Path], None],
                                              message: str) -> None:
    directory = tmp_path / "keys"
    generate(str(directory), "env-a", "env-server")
    spoil(directory)
    with pytest.raises(SecurityError, match=re.escape(message)):
        load_curve(str(directory), "", "env-a", "env-server")


OTHER_UID = 65534  # nobody


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root (os.chown)")
def test_key_files_another_user_could_change_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    generate(str(directory), "env-a", "env-server")
    os.chown(directory / "allow-list", OTHER_UID, OTHER_UID)  # its owner could add their own key to it
    owned = f"allow-list {directory}/allow-list is owned by uid {OTHER_UID}"
    with pytest.raises(SecurityError, match=re.escape(owned)):
        load_curve(str(directory), "", "env-a", "env-server")
    os.chown(directory / "allow-list", 0, 0)
    os.chown(directory, OTHER_UID, OTHER_UID)  # its owner could replace any file in it
    with pytest.raises(SecurityError, match=re.escape(f"key directory {directory} is owned by uid {OTHER_UID}")):
        load_curve(str(directory), "", "env-a", "env-server")
    with pytest.raises(SecurityError, match=re.escape(f"key directory {directory} is owned by uid {OTHER_UID}")):
        generate(str(directory), "env-b", "env-server")
    assert not (directory / "env-b.key_secret").exists()


def test_keys_generate_makes_a_directory_it_reuses_private(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)  # made earlier by a script, or a shared file system's default
    generate(str(directory), "env-a", "env-server")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    load_curve(str(directory), "", "env-a", "env-server")


def test_keys_made_under_a_umask_of_002_load(tmp_path: Path) -> None:
    # 002 is the default login umask where each user has a private group (Debian, Ubuntu, Fedora). generate wrote
    # the allow-list 0664 under it, then refused its own allow-list as group-writable.
    directory = tmp_path / "keys"
    allow_list = directory / "allow-list"
    umask = os.umask(0o002)
    try:
        generate(str(directory), "env-a", "env-server")
        assert stat.S_IMODE(allow_list.stat().st_mode) == 0o600
        load_curve(str(directory), "", "env-a", "env-server")
        # An allow-list an earlier version wrote 0664: no other user reaches it in the 0700 directory, so it
        # loads; the next generate tightens it.
        allow_list.chmod(0o664)
        load_curve(str(directory), "", "env-a", "env-server")
        generate(str(directory), "env-b", "env-server")
        assert stat.S_IMODE(allow_list.stat().st_mode) == 0o600
        load_curve(str(directory), "", "env-b", "env-server")
        # Once the group can reach the directory, a group-writable allow-list is the group's to rewrite.
        allow_list.chmod(0o664)
        directory.chmod(0o750)
        with pytest.raises(SecurityError, match=re.escape(f"allow-list {allow_list} is writable by group")):
            load_curve(str(directory), "", "env-a", "env-server")
    finally:
        os.umask(umask)


@pytest.mark.parametrize("node_id", ["cluster", "allow-list"])
def test_keys_generate_refuses_the_key_directorys_own_names_as_node_ids(tmp_path: Path, node_id: str) -> None:
    directory = tmp_path / "keys"
    generate(str(directory))
    cluster_key = (directory / "cluster.key").read_text()
    refused = subprocess.run([*CLI, "keys", "generate", str(directory), "--node-id", node_id, "--role", "monitor"],
                             capture_output=True, text=True, timeout=60)
    # Before, "cluster" failed on the cluster key's own files, telling the operator to remove the cluster key.
    assert refused.returncode == 2 and f"'{node_id}' is reserved" in refused.stderr
    assert "remove it" not in refused.stderr and (directory / "cluster.key").read_text() == cluster_key
    assert f" {node_id} " not in (directory / "allow-list").read_text()


def test_a_node_is_the_node_id_its_key_grants(keys: Path) -> None:
    tool = NodeRuntime("cli", RuntimeSettings(metrics_port=-1, curve_dir=str(keys),
                                              curve_key=str(keys / "tester.key_secret")), register=False)
    try:
        assert tool.node_id == "tester" and tool.codec.src == "tester"
    finally:
        tool.close()
    with pytest.raises(SecurityError, match=re.escape("needs --node-id or security.curve_key")):
        NodeRuntime("cli", RuntimeSettings(metrics_port=-1, curve_dir=str(keys)), register=False)
    granted = "allowed as node 'tester' (tester), not as 'tester' (env-server)"
    with pytest.raises(SecurityError, match=re.escape(granted)):
        NodeRuntime("env-server", RuntimeSettings(metrics_port=-1, curve_dir=str(keys),
                                                  curve_key=str(keys / "tester.key_secret")))


def test_garbage_key_files_stop_a_node_at_start_with_the_file_named(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    generate(str(directory), "env-a", "env-server")
    (directory / "env-a.key_secret").write_text("garbage\n")
    started = subprocess.run([*CLI, "node", "env-server", "--node-id", "env-a", "--security-curve-dir",
                              str(directory), "--bus-control", "tcp://127.0.0.1:1"],
                             capture_output=True, text=True, timeout=60)
    output = started.stdout + started.stderr
    assert started.returncode != 0 and f"{directory}/env-a.key_secret is not a CURVE key" in output


def test_a_sigkilled_curve_node_comes_back_under_its_key(curve_cluster: dict[str, Any], keys: Path,
                                                        spawn: Callable[..., NodeProcess],
                                                        zmq_ctx: zmq.Context) -> None:
    env = curve_cluster["env"]
    env.proc.send_signal(signal.SIGKILL)
    env.proc.wait(timeout=WAIT_S)
    again = spawn(["node", "env-server", "--bus-control", curve_cluster["control"], "--node-id", "env-a",
                   *FAST_LIVENESS, "--security-curve-dir", str(keys)], "env-a-again")
    info = again.wait_ready(timeout=WAIT_S * 3)
    tester = client(zmq_ctx, info["endpoints"]["blobs"], "tester", curve_of(keys, "tester"))
    branch = random_arrays(8, seed=1, layers=4, top_k=2, k=3, max_count=3, routing_dtype=np.uint8)
    kept = tester.request(Keep(episode_id="ep-2", branches=[branch])).body
    assert isinstance(kept, Kept) and len(kept.refs) == 1
    assert next_event(curve_cluster["events"], EpisodeFinished.kind).body.episode_id == "ep-2"


def test_ps_broadcast_init_and_a_frames_pull_run_under_curve(tmp_path: Path, spawn: Callable[..., NodeProcess]) -> None:
    keys = tmp_path / "ps-keys"
    for node_id, role in {"bus": "bus", "ps-manager": "ps-manager", "w0": "ps-worker", "w1": "ps-worker",
                          "w2": "ps-worker", "ps-client": "ps-client"}.items():
        generate(str(keys), node_id, role)
    curve = ["--security-curve-dir", str(keys)]
    bus, control = start_bus(tmp_path, extra=[*FAST_LIVENESS, *curve])
    state = make_state(seed=3, tensors=6, scale=4)
    checkpoint = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint))
    cluster = start_cluster(spawn, control, "curve", workers=3, extra=["--ps-chunk-bytes", "4096", *curve])
    runtime = NodeRuntime("ps-client", RuntimeSettings(bus=control, node_id="ps-client", metrics_port=-1,
                                                       curve_dir=str(keys)), register=False)
    try:
        ps = PsClient(runtime, cluster.manager, transport="frames")
        result = ps.init(str(checkpoint), workers=["w0", "w1", "w2"], timeout_s=WAIT_S * 3)
        assert result.workers == ["w0", "w1", "w2"] and result.file_opens == {"w0": 1, "w1": 0, "w2": 0}  # by tree
        pulled = ps.pull(result.version, verify=True)
        assert all(torch.equal(pulled[name], tensor) for name, tensor in state.items())
        assert ps.read_bytes["frames"] == sum(t.numel() * t.element_size() for t in state.values())
    finally:
        runtime.close()
        for proc in [*cluster.workers.values(), cluster.manager_proc]:
            proc.stop()
        assert bus.stop() == 0, bus.log_tail()
