"""docs/PROTOCOL.md is enough to write a client: tests/third_party_client.py (pyzmq, msgpack and the standard
library only) keeps, claims, fetches and deletes on a real env-server process behind a real broker and follows
the event stream that mirrors every move, unsigned and signed."""

from __future__ import annotations

import ast
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import third_party_client as client
import zmq
from conftest import FAST_LIVENESS
from refbus.nodes.launch import NodeProcess, start_bus

pytest_plugins = ["wire_fixtures"]  # zmq_ctx

WAIT_S = 10.0
CLIENT_MODULES = {"__future__", "collections", "dataclasses", "hashlib", "hmac", "itertools", "os", "socket",
                  "struct", "time", "typing", "msgpack", "zmq", "xxhash"}
SECRET = "third-party-secret"


def test_the_client_imports_nothing_but_pyzmq_msgpack_and_the_standard_library() -> None:
    tree = ast.parse(Path(client.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= CLIENT_MODULES, imported - CLIENT_MODULES
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, third_party_client; print(' '.join(sorted(sys.modules)))"],
        cwd=Path(client.__file__).parent, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert not {"refbus", "msgspec", "numpy", "torch"} & {name.split(".")[0] for name in loaded}



def branch(tokens: int, *, layers: int = 3, top_k: int = 2, k: int = 4) -> dict[str, client.Array]:
    """Routing, top-k ids and log-probabilities of ``tokens`` tokens, packed by hand (no numpy)."""
    routing = bytes((1 + i % 200) for i in range(tokens * layers * top_k))
    ids = struct.pack(f"<{tokens * k}i", *(7 + i for i in range(tokens * k)))
    logprobs = struct.pack(f"<{tokens * k}f", *(-0.5 - i / 64 for i in range(tokens * k)))
    return {"routed_experts": client.Array("uint8", (tokens, layers, top_k), routing),
            "topk_ids": client.Array("int32", (tokens, k), ids),
            "topk_logprobs": client.Array("float32", (tokens, k), logprobs)}


@pytest.mark.parametrize("secret", ["", SECRET], ids=["unsigned", "signed"])
def test_keep_claim_fetch_delete_and_follow_the_events(secret: str, tmp_path: Path, zmq_ctx: zmq.Context) -> None:
    if client.xxh3 is None:
        pytest.skip("the xxhash package is not installed: a client cannot checksum the arrays it keeps")
    signing = ["--security-secret", secret] if secret else []
    broker, control_endpoint = start_bus(tmp_path, extra=[*FAST_LIVENESS, *signing])
    try:
        store = NodeProcess(["node", "env-server", "--bus-control", control_endpoint, "--node-id", "env-tp",
                             *FAST_LIVENESS, *signing], workdir=tmp_path, name="env-tp")
        try:
            store.wait_ready(timeout=WAIT_S * 3)
            run_the_life_cycle(zmq_ctx, control_endpoint, secret.encode())
        finally:
            assert store.stop() == 0, store.log_tail()
    finally:
        assert broker.stop() == 0, broker.log_tail()


def run_the_life_cycle(ctx: zmq.Context, control_endpoint: str, secret: bytes) -> None:
    wire = client.Wire(f"third-party-{os.getpid()}", secret)
    control = client.Peer(ctx, control_endpoint, wire)
    welcome = client.hello(control, wire.src, timeout_s=WAIT_S)
    events = client.Events(ctx, control, welcome["events_out"], timeout_s=WAIT_S)
    assert events.syncs_seen and all(e.header["seq"] == 0 for e in events.syncs_seen), "sync probes are visible"

    stores = control.request("nodes", {"role": "env-server"}, timeout_s=WAIT_S).body["nodes"]
    store = next(node for node in stores if node["node_id"] == "env-tp")
    blobs = client.Peer(ctx, store["endpoints"]["blobs"], wire)

    branches = [branch(5), branch(3, k=2)]
    kept = blobs.request("keep", {"episode_id": "tp-1", "branches": branches, "policy_version": 2,
                                  "info": {"reward": 0.25}}, timeout_s=WAIT_S)
    refs = kept.body["refs"]
    assert [(r["fields"], r["tokens"], r["routing_shape"], r["node"]) for r in refs] == [
        (list(b), b["topk_ids"].shape[0], [3, 2], "env-tp") for b in branches]
    for ref, sent in zip(refs, branches, strict=True):
        assert ref["checksum"] == client.blob_checksum(list(sent.values()))
    ids = [ref["blob_id"] for ref in refs]
    finished = events.next("episode-finished", timeout_s=WAIT_S, where=lambda b: b["episode_id"] == "tp-1")
    assert finished.body["refs"] == refs and finished.body["info"] == {"reward": 0.25}

    holder = wire.src
    claimed = blobs.request("claim", {"blob_ids": ids, "holder": holder}, timeout_s=WAIT_S)
    assert claimed.kind == "claimed" and claimed.body == {"blob_ids": ids}  # defaults omitted
    assert events.next("claim", timeout_s=WAIT_S).body == {"blob_ids": ids, "holder": holder}

    fetched = blobs.request("fetch", {"blob_ids": ids, "holder": holder}, timeout_s=WAIT_S).body
    assert fetched.get("missing", []) == [] and [b["blob_id"] for b in fetched["blobs"]] == ids
    for ref, sent, got in zip(refs, branches, fetched["blobs"], strict=True):
        assert got["arrays"] == sent  # dtype, shape and bytes, in field order
        assert client.blob_checksum(list(got["arrays"].values())) == ref["checksum"]

    deleted = blobs.request("delete", {"blob_ids": ids, "holder": holder, "reason": "trained"}, timeout_s=WAIT_S)
    assert deleted.body == {"blob_ids": ids}
    assert events.next("delete", timeout_s=WAIT_S).body == {"blob_ids": ids, "holder": holder, "reason": "trained"}
    with pytest.raises(client.RemoteError) as unknown:
        blobs.request("fetch", {"blob_ids": ids, "holder": ""}, timeout_s=WAIT_S)
    assert unknown.value.code == "schema"  # an empty Name

    _, frames = wire.encode("fetch", {"blob_ids": ids, "holder": holder})
    blobs.sock.send_multipart([b"", *frames])  # what a REQ socket sends: its reply has no delimiter, REQ drops it
    assert blobs.sock.poll(int(WAIT_S * 1000))
    reply = wire.decode(blobs.sock.recv_multipart())
    assert (reply.kind, reply.body["code"], reply.header.get("re", "")) == ("error", "malformed", "")

    if secret:  # the same request unsigned, or signed with another secret, is refused
        for intruder in (client.Wire("intruder"), client.Wire("intruder", b"another-secret")):
            stranger = client.Peer(ctx, store["endpoints"]["blobs"], intruder)
            _, frames = intruder.encode("fetch", {"blob_ids": ids, "holder": "intruder"})
            stranger.sock.send_multipart(frames)
            assert stranger.sock.poll(int(WAIT_S * 1000))
            reply = client.Wire("reader").decode(stranger.sock.recv_multipart())
            assert (reply.kind, reply.body["code"]) == ("error", "signature")
            stranger.close()
    control.request("bye", {"node_id": wire.src}, timeout_s=WAIT_S)
    for sock in (events, blobs, control):
        sock.close()
