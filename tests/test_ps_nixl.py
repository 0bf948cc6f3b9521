"""PS pulls over NIXL (``remote="nixl"``) against real ps-worker processes: byte-identical pulls with every
checksum verified, garbage answers and requests failing clearly while the worker keeps serving, a worker
SIGKILLed mid-transfer failing the pull instead of returning torn bytes, and a clear error when NIXL is missing
while the frames path still pushes and pulls.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ps_support import PsCluster, make_state, segments, start_cluster
from refbus.bus.reqrep import RemoteError
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.ps.client import PsClient, PsError
from refbus.nodes.ps.frames import Wanted
from refbus.nodes.ps.nixl import NixlError, NixlReader
from refbus.nodes.ps.shm import sweep_orphans
from refbus.protocol.messages_ps import NixlOpen, NixlOpened

NIXL_MISSING = importlib.util.find_spec("nixl_cu12") is None
if NIXL_MISSING and os.environ.get("REFBUS_REQUIRE_NIXL") == "1":  # CI: a skip would hide a missing install
    raise RuntimeError("REFBUS_REQUIRE_NIXL=1 but nixl_cu12 is not installed (make installs nixl-cu12==1.5.1)")
needs_nixl = pytest.mark.skipif(NIXL_MISSING, reason="NIXL is an optional extra (make test installs it)")


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    _, control = bus
    # Segments in /dev/shm itself (no durable store): what a SIGKILLed worker leaves is swept by pid below.
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=1, extra=["--store-durable", "false"])
    yield cluster
    for name, proc in cluster.workers.items():
        if name not in getattr(cluster, "killed", ()):
            assert proc.stop() == 0, proc.log_tail()
    assert cluster.manager_proc is not None and cluster.manager_proc.stop() == 0
    sweep_orphans("/dev/shm", cluster.prefix)  # what a SIGKILLed worker left (its restart would sweep it)
    assert segments(cluster.prefix) == [], "shared-memory segments leaked"


def nixl_client(cluster: PsCluster, name: str) -> tuple[Any, PsClient]:
    # transport="frames": never map the segments, so every byte crosses from the worker's process by NIXL.
    return cluster.client(name, transport="frames", remote="nixl")


@needs_nixl
def test_pull_over_nixl_is_byte_identical_and_verified(cluster: PsCluster) -> None:
    runtime, ps = nixl_client(cluster, "nixl-reader")
    try:
        state = make_state(seed=5, scale=64)
        digest = ps.push(state, 0).digest
        pulled = ps.pull()
        assert pulled.digest == digest
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert ps.read_bytes["nixl"] == sum(t.nbytes for t in state.values()) and ps.read_bytes["frames"] == 0
        out = {name: torch.zeros_like(t) for name, t in state.items()}
        into = ps.pull(out=out)  # straight into the caller's tensors
        assert all(into[name] is out[name] and torch.equal(out[name], t) for name, t in state.items())
        ps.push(make_state(seed=6, scale=64), 1)  # the next version reuses segments registered before
        assert all(torch.equal(ps.pull()[name], t) for name, t in make_state(seed=6, scale=64).items())
    finally:
        runtime.close()


@needs_nixl
def test_garbage_fails_clearly_and_the_worker_keeps_serving(cluster: PsCluster) -> None:
    runtime, ps = nixl_client(cluster, "nixl-garbage")
    try:
        state = make_state(seed=9, scale=16)
        ps.push(state, 0)
        entries = ps.manifest().entries
        location = entries[0].locations[0]
        worker = runtime.client(cluster.worker_info["w0"]["endpoints"]["ps"])
        with pytest.raises(RemoteError) as err:
            worker.request(NixlOpen("no-such-segment"))
        assert err.value.code == "unknown-segment"
        real = worker.request(NixlOpen(location.segment)).body
        assert isinstance(real, NixlOpened) and real.capacity > 0

        reader = NixlReader("garbage-reader")
        wanted = [Wanted(e, e.locations[0].offset, e.locations[0].segment) for e in entries if e.nbytes]

        def read(answer: NixlOpened) -> list[torch.Tensor]:
            return reader.read(wanted, lambda _: answer, lambda e: torch.empty(e.nbytes, dtype=torch.uint8),
                               deadline_s=5.0)

        with pytest.raises(NixlError, match="unusable agent metadata"):
            read(NixlOpened("no-agent", b"\x00garbage", real.address, real.capacity))
        with pytest.raises(NixlError, match="ends past segment"):
            read(NixlOpened(real.agent, real.metadata, real.address, 8))
        with pytest.raises(NixlError, match="names agent"):
            read(NixlOpened("someone-else", real.metadata, real.address, real.capacity))
        with pytest.raises(NixlError):  # an address the worker never registered: refused or failed, never read
            read(NixlOpened(real.agent, real.metadata, real.address + (1 << 40), real.capacity))
        shifted = [Wanted(w.entry, w.offset + 1, w.segment) for w in wanted
                   if w.offset + w.entry.nbytes < real.capacity]
        with pytest.raises(NixlError, match="does not match the checksum"):  # the wrong bytes never pass
            reader.read(shifted, lambda _: real, lambda e: torch.empty(e.nbytes, dtype=torch.uint8), deadline_s=5.0)

        pulled = ps.pull()  # the worker still serves NIXL pulls
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
    finally:
        runtime.close()


@needs_nixl
@pytest.mark.parametrize("when", ["before-the-read", "during-the-read"])
def test_worker_killed_around_a_transfer_never_returns_torn_bytes(cluster: PsCluster, when: str) -> None:
    runtime, ps = nixl_client(cluster, "nixl-killed")
    puller = None
    # The read's own bound (one retry schedule per chunk_bytes) plus the lease release afterwards.
    pull_bound_s = 2 * sum(runtime.settings.retry.timeouts()) * (1 + (256 << 20) // ps.chunk_bytes)
    try:
        state = {"big": torch.arange(64 << 20, dtype=torch.int32)}  # 256 MiB: a copy long enough to interrupt
        ps.push(state, 0)
        proc = cluster.workers["w0"]
        agent = ps._nixl._agent  # type: ignore[union-attr]
        posted = agent.transfer
        entered = threading.Event()

        def kill() -> None:
            os.kill(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(timeout=10)

        def transfer(handle: Any) -> str:
            # The worker has answered ps-nixl-open; it dies before the READ is posted, or while it runs.
            if when == "before-the-read":
                kill()
            entered.set()
            return posted(handle)

        agent.transfer = transfer
        cluster.killed = {"w0"}  # type: ignore[attr-defined]
        outcome: list[object] = []
        puller = threading.Thread(target=lambda: outcome.append(_pull_or_error(ps)), daemon=True)
        puller.start()
        assert entered.wait(30), "the pull never reached its transfer"
        if when == "during-the-read":
            kill()
        puller.join(pull_bound_s)
        assert not puller.is_alive(), "the pull outlived its deadline"
        (result,) = outcome
        if when == "before-the-read" or isinstance(result, BaseException):
            assert isinstance(result, PsError), f"a pull from a killed worker returned {result!r}"
            assert "w0" in str(result) and "segment" in str(result)
        else:  # the copy won the race with the kill: then every byte must be the pushed one
            assert torch.equal(result["big"], state["big"])  # type: ignore[index]
    finally:
        if puller is not None:  # a failure above may leave it pulling: it ends by its bound, before the close
            puller.join(pull_bound_s)
        runtime.close()


def _pull_or_error(ps: PsClient) -> object:
    try:
        return ps.pull()
    except (PsError, RemoteError) as exc:
        return exc


def test_missing_nixl_is_a_clear_error_at_start_and_frames_still_push_and_pull(
    cluster: PsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without NIXL, asking for it fails at once saying how to install it; the frames path (the default) works
    all the same: a real push, and a pull whose every byte crosses from the worker's process over ZeroMQ."""
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # import fails as if it were not installed
    runtime = NodeRuntime("ps-client", RuntimeSettings(bus=cluster.control, node_id="nixl-missing", metrics_port=-1),
                          register=False)
    try:
        with pytest.raises(NixlError, match=r"pip install --no-deps nixl-cu12"):
            PsClient(runtime, cluster.manager, remote="nixl")
        ps = PsClient(runtime, cluster.manager, transport="frames")  # remote="frames": the default
        state = make_state(seed=11, scale=16)
        digest = ps.push(state, 0).digest
        pulled = ps.pull(verify=True)
        assert pulled.digest == digest
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert ps.read_bytes == {"frames": sum(t.nbytes for t in state.values())}  # nothing over NIXL or mapped
        assert sys.modules["nixl_cu12"] is None  # the frames path never tried to import it
    finally:
        runtime.close()


def test_a_worker_configured_for_nixl_without_it_refuses_to_start(bus, spawn, tmp_path: Path) -> None:
    _, control = bus
    hidden = tmp_path / "hidden"
    (hidden / "nixl_cu12").mkdir(parents=True)
    (hidden / "nixl_cu12" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    path = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH", "")) if p)
    proc = spawn(["node", "ps-worker", "--node-id", "w-nonixl", "--bus-control", control, "--ps-transport", "nixl",
                  "--ps-manager", "tcp://127.0.0.1:9"], "w-nonixl", env={"PYTHONPATH": path})
    assert proc.proc.wait(timeout=60) == 2, proc.log_tail()
    assert "pip install --no-deps nixl-cu12" in proc.log_tail() and "hidden by the test" in proc.log_tail()
