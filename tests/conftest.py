"""Shared fixtures: real broker processes on ephemeral loopback ports, always reaped; namespace hosts."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.settings import StoreSettings
from refbus.nodes.store.durable import PREFIX, remove_unheld

from bench import hosts as namespace_hosts

# Short liveness timing so node-down tests finish quickly.
FAST_LIVENESS = ["--bus-heartbeat-interval-s", "0.2", "--bus-node-timeout-s", "1.0"]


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[tuple[NodeProcess, str]]:
    """A broker process and its control endpoint; stopped (and checked for a clean exit) afterwards."""
    proc, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    try:
        yield proc, control
    finally:
        assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP endpoint on loopback that never answers: it listens and never accepts, so a ZeroMQ peer's connection
    completes in the kernel's backlog while its handshake never does, and requests to it queue up to the
    high-water mark and stay there. Unlike a closed port, no other process can take the port meanwhile (and
    then drain the queue)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """``spawn(command, name)`` starts a refbus child; every one is stopped at teardown, the last started
    first (a broker started here outlives its nodes, so their goodbyes reach it)."""
    started: list[NodeProcess] = []

    def start(command: list[str], name: str, **kwargs: object) -> NodeProcess:
        proc = NodeProcess(command, workdir=tmp_path, name=name, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def make_hosts() -> Iterator[Callable[..., namespace_hosts.Hosts]]:
    """``make_hosts(n, names=...)``: ``n`` namespace hosts (bench/hosts.py), all torn down afterwards (each
    one, even when another's teardown fails; any failure then fails the test).

    Skips with the reason where they cannot be built (not root, no iproute2); with ``REFBUS_REQUIRE_NETNS=1``
    (set by CI) that is a failure instead.
    """
    built: list[namespace_hosts.Hosts] = []

    def make(count: int, **kwargs: object) -> namespace_hosts.Hosts:
        try:
            cluster = namespace_hosts.build(count, **kwargs)  # type: ignore[arg-type]
        except namespace_hosts.HostsUnavailable as exc:
            if os.environ.get("REFBUS_REQUIRE_NETNS") == "1":
                pytest.fail(f"REFBUS_REQUIRE_NETNS=1 but namespace hosts are unavailable: {exc}")
            pytest.skip(str(exc))
        built.append(cluster)
        return cluster

    yield make
    failed = []
    for cluster in built:  # each one, whatever the ones before it did
        try:
            cluster.down()
        except Exception as exc:  # reported below, once every cluster had its down
            failed.append(f"{cluster.name}: {exc!r}")
    if failed:
        pytest.fail("namespace hosts left behind:\n" + "\n".join(failed))


@pytest.fixture(scope="session", autouse=True)
def durable_stores_left() -> Iterator[None]:
    """At the end of the session, remove the durable stores that nodes the tests killed left under the default
    store directory (test clusters: cluster ``local`` on a loopback broker), made during the session and held
    by no live process."""
    started = time.time()
    yield
    for path in Path(StoreSettings().directory).glob(f"{PREFIX}local-tcp___127.0.0.1_*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= started:
                remove_unheld(path)
