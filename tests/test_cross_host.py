"""Real refbus nodes on three namespace hosts (bench/hosts.py): each host has its own network, host name
and /dev/shm, so a node's advertised endpoints, same-host detection and shared memory are exercised as
across real machines. The broker and the ps-manager on hostA, data-plane nodes on hostB and hostC, clients
inside the hosts; every node binds the wildcard address and advertises its host name, unsigned and
unencrypted by choice (``INSECURE``): these tests are about hosts, tests/test_readme_hosts.py about the secure
recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST_LIVENESS
from host_probe import branches, digest
from prometheus_client.parser import text_string_to_metric_families
from ps_support import Actor, checksums, make_state
from refbus.nodes.launch import NodeProcess
from refbus.nodes.toy.policy import make_policy

from bench import hosts

PROBE = str(Path(__file__).with_name("host_probe.py"))
WAIT_S = 10.0
CONTROL = "tcp://hostA:7770"  # each host has its own ports: the README's fixed ones cannot collide here
SD = "http://hostA:7779/sd"
INSECURE = ["--security-insecure", "true"]  # wildcard binds without signing or CURVE: the operator's choice


def _node(spawn: Callable[..., NodeProcess], host: hosts.Host, name: str, *flags: str) -> dict[str, Any]:
    """A ``refbus node`` process inside ``host``; its registry entry once ready."""
    return spawn(["node", *flags, "--node-id", name, *FAST_LIVENESS, *INSECURE], name, prefix=host.argv(())).wait_ready(
        timeout=WAIT_S * 3)


def _broker(spawn: Callable[..., NodeProcess], host: hosts.Host) -> dict[str, Any]:
    return _node(spawn, host, "bus", "bus", "--bus-control", "tcp://0.0.0.0:7770", "--bus-events-in",
                 "tcp://0.0.0.0:7771", "--bus-events-out", "tcp://0.0.0.0:7772", "--node-metrics-host", "0.0.0.0")


def _probe(host: hosts.Host, *args: str) -> dict[str, Any]:
    result = host.run([sys.executable, PROBE, *args], timeout=WAIT_S * 3)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_blobs_cross_hosts_byte_identical_and_metrics_scrape_across(make_hosts, spawn) -> None:
    cluster = make_hosts(3)
    a, b, c = cluster
    bus = _broker(spawn, a)
    assert bus["endpoints"]["control"] == "tcp://hostA:7770" and bus["metrics"].startswith("http://hostA:")
    env = _node(spawn, b, "env-B", "env-server", "--bus-control", CONTROL, "--env-server-endpoint", "tcp://0.0.0.0:0",
                "--node-metrics-host", "0.0.0.0")
    endpoint = env["endpoints"]["blobs"]
    assert endpoint.startswith("tcp://hostB:") and env["host"] == "hostB"
    # A node that keeps the default metrics bind advertises loopback, as before.
    quiet = _node(spawn, c, "env-C", "env-server", "--bus-control", CONTROL, "--env-server-endpoint",
                  "tcp://0.0.0.0:0")
    assert quiet["metrics"].startswith("http://127.0.0.1:")

    seed = 11
    result = _probe(c, "blobs", "--endpoint", endpoint, "--seed", str(seed))
    assert result["endpoints"] == [endpoint, endpoint]
    assert result["digests"] == [digest(arrays) for arrays in branches(seed)]

    scraped = _probe(a, "scrape", "--sd", SD, "--node", "env-B")
    assert scraped["target"] == env["metrics"].removeprefix("http://").removesuffix("/metrics")
    assert scraped["target"].startswith("hostB:")
    text = scraped["metrics"]
    assert _sample(text, "refbus_blobs_kept_total") == 2
    assert _sample(text, "refbus_blobs_deleted_total", reason="trained") == 2
    assert _sample(text, "refbus_blobs_held") == 0
    assert _sample(text, "refbus_node_info", node="env-B", role="env-server") == 1


@pytest.fixture
def actors() -> Any:
    started: list[Actor] = []
    yield started
    for actor in started:
        actor.stop()


def _segments(host: hosts.Host) -> list[Path]:
    """The ps segments in a host's /dev/shm, in the workers' durable store directories or not (not the
    stores' own files, nor the workers' host-proof nonce files)."""
    return [p for p in host.shm.rglob("*")
            if p.is_file() and p.name not in ("lock", "id", "journal") and not p.name.endswith((".nonce", ".lock"))]


def test_ps_pulls_map_shared_memory_on_the_workers_host_and_use_frames_across(make_hosts, spawn, actors) -> None:
    cluster = make_hosts(3)
    a, b, c = cluster
    _broker(spawn, a)
    # One copy per shard, so the pull on the other host has nothing of its own host to map.
    manager = _node(spawn, a, "ps-manager", "ps-manager", "--bus-control", CONTROL, "--ps-manager",
                    "tcp://0.0.0.0:7780", "--ps-replicas", "1")["endpoints"]["ps"]
    assert manager == "tcp://hostA:7780"
    for host in (b, c):
        worker = _node(spawn, host, f"w-{host.name}", "ps-worker", "--bus-control", CONTROL, "--ps-manager", manager,
                       "--ps-worker", "tcp://0.0.0.0:0")
        assert worker["endpoints"]["ps"].startswith(f"tcp://{host.name}:")

    def actor(host: hosts.Host, *args: str) -> Actor:
        actors.append(Actor(*args, "--manager", manager, prefix=host.argv(())))
        return actors[-1]

    pushed = actor(b, "push", "--version", "0", "--seed", "7").expect("pushed", WAIT_S * 3)
    assert pushed["committed"]
    # The push went to the worker on the pusher's host: its segments are in hostB's /dev/shm only (each
    # worker's durable store directory is there from its start, with the store's own files).
    assert _segments(b) and not _segments(c)
    expected = checksums(make_state(7))
    local = actor(b, "pull", "--version", "0").expect("pulled", WAIT_S * 3)
    remote = actor(c, "pull", "--version", "0").expect("pulled", WAIT_S * 3)
    assert local["checksums"] == remote["checksums"] == expected
    assert local["digest"] == remote["digest"] == pushed["digest"]
    assert local["frames"] == 0  # mapped from hostB's shared memory
    assert remote["frames"] >= sum(1 for t in make_state(7).values() if t.numel())  # every tensor as frames


def test_a_worker_whose_host_name_lies_is_read_through_frames_never_mapped(make_hosts, spawn, actors) -> None:
    """A ps-worker on hostC advertises the host name hostB (a copied config, a container sharing names), and
    hostB's /dev/shm holds decoys under its file names. Both hosts share a kernel (same boot id), so only the
    nonce read back tells them apart: a pull on hostB gets frames with the right bytes, never the decoys."""
    cluster = make_hosts(3)
    a, b, c = cluster
    _broker(spawn, a)
    manager = _node(spawn, a, "ps-manager", "ps-manager", "--bus-control", CONTROL, "--ps-manager",
                    "tcp://0.0.0.0:7780")["endpoints"]["ps"]
    _node(spawn, c, "w-liar", "ps-worker", "--bus-control", CONTROL, "--ps-manager", manager,
          "--ps-worker", "tcp://hostC:0", "--node-host", "hostB")  # reachable at hostC, named hostB

    def actor(host: hosts.Host, *args: str) -> Actor:
        actors.append(Actor(*args, "--manager", manager, prefix=host.argv(())))
        return actors[-1]

    pushed = actor(b, "push", "--version", "0", "--seed", "7").expect("pushed", WAIT_S * 3)
    assert pushed["committed"] and _segments(c) and not _segments(b)  # the bytes went as frames to hostC
    for real in (p for p in c.shm.rglob("*") if p.is_file()):  # decoys at the same paths: the nonce file
        decoy = b.shm / real.relative_to(c.shm)                   # garbled, segments zeros of the same size
        decoy.parent.mkdir(parents=True, exist_ok=True)
        decoy.write_bytes(b"decoy" if real.name.endswith(".nonce") else bytes(real.stat().st_size))
    pulled = actor(b, "pull", "--version", "0").expect("pulled", WAIT_S * 3)
    assert pulled["checksums"] == checksums(make_state(7)) and pulled["digest"] == pushed["digest"]
    assert pulled["frames"] >= sum(1 for t in make_state(7).values() if t.numel())  # none mapped


def test_torchrun_trainer_ranks_on_two_hosts_rendezvous_and_push_one_version(make_hosts, spawn, actors,
                                                                            tmp_path: Path) -> None:
    cluster = make_hosts(3)
    a, b, c = cluster
    _broker(spawn, a)
    manager = _node(spawn, a, "ps-manager", "ps-manager", "--bus-control", CONTROL, "--ps-manager",
                    "tcp://0.0.0.0:7780")["endpoints"]["ps"]
    for host in (b, c):
        _node(spawn, host, f"w-{host.name}", "ps-worker", "--bus-control", CONTROL, "--ps-manager", manager,
              "--ps-worker", "tcp://0.0.0.0:0")
    # The README's torchrun line (c10d rendezvous on hostB), one rank per host; no steps: the ranks meet
    # through torchrun, connect gloo across the hosts, join the bus and push version 0 together.
    logs = {}
    ranks = {}
    for host in (b, c):
        logs[host.name] = open(tmp_path / f"torchrun-{host.name}.log", "wb")  # noqa: SIM115 - closed below
        ranks[host.name] = host.popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", "hostB:29500",
             "-m", "refbus.nodes.cli", "node", "trainer", "--bus-control", CONTROL, "--ps-manager", manager,
             "--trainer-endpoint", "tcp://0.0.0.0:0", "--trainer-steps", "0", "--node-host", host.name, *INSECURE],
            stdout=logs[host.name], stderr=subprocess.STDOUT)
    try:
        codes = {name: proc.wait(WAIT_S * 9) for name, proc in ranks.items()}
    finally:
        for log in logs.values():
            log.close()
    tails = {name: (tmp_path / f"torchrun-{name}.log").read_text()[-3000:] for name in ranks}
    assert codes == {"hostB": 0, "hostC": 0}, tails

    pulled = Actor("pull", "--version", "0", "--manager", manager, prefix=a.argv(()))
    actors.append(pulled)
    assert pulled.expect("pulled", WAIT_S * 3)["checksums"] == checksums(make_policy(0).state_dict())
