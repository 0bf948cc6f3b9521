"""A ps-worker's segments that nobody claims: any peer may open a shard under a lease the ps-manager never
granted (an init's header is taken only as the manager planned it). Such segments are bounded while held
(``open-limit``), handed back once the manager would have given up on them, and hold no file descriptor; honest
pushes, inits and pulls go on beside them.

Real processes: a broker, a ps-manager and one ps-worker started under a low descriptor limit (``prlimit``),
with short push and init timeouts and a small bound on unclaimed bytes. Each test checks at the end that no
shared-memory segment of its cluster is left behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from polling import wait_for
from pool_support import acquire
from ps_support import PsCluster, checksums, make_state, segments, start_cluster
from refbus.bus.reqrep import RemoteError
from refbus.nodes.ps.shm import SegmentPool
from refbus.protocol.codec import checksum
from refbus.protocol.messages_ps import InitChunk, InitEnd, InitHeader, ShardOpen, ShardTensor, WorkerInfo
from safetensors.torch import save_file

PUSH_TIMEOUT_S = 3.0
INIT_TIMEOUT_S = 3.0
OPEN_BYTES = 4 << 20  # ps.max_open_bytes of the worker
NOFILE = 256  # the worker's descriptor limit: a segment that held one would run it out within the test


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    _, control = bus
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=0, extra=[
        "--ps-push-timeout-s", str(PUSH_TIMEOUT_S), "--ps-init-timeout-s", str(INIT_TIMEOUT_S),
        "--ps-max-open-bytes", str(OPEN_BYTES)])
    worker = spawn(["node", "ps-worker", "--node-id", "w0", "--ps-manager", cluster.manager, *cluster.flags], "w0",
                   prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"])
    cluster.worker_info["w0"] = worker.wait_ready()
    cluster.workers["w0"] = worker
    yield cluster
    for proc in [worker, cluster.manager_proc]:
        assert proc is not None and proc.stop() == 0, proc.log_tail() if proc else ""
    assert segments(cluster.prefix) == [], "shared-memory segments leaked"


def test_opens_under_leases_never_granted_are_bounded_and_handed_back(cluster: PsCluster) -> None:
    """Made-up opens count against ps.max_open_bytes (the next is refused ``open-limit``) and go back to the pool
    once a push they belonged to would have been aborted; a sealed shard is kept, and pushes and pulls go on."""
    runtime, ps = cluster.client()
    try:
        state = make_state(seed=1)
        ps.push(state, 0)  # sealed: claimed, whatever the timeouts
        held = cluster.held("w0")
        worker = runtime.client(cluster.worker_info["w0"]["endpoints"]["ps"])
        for i in range(2):
            worker.request(ShardOpen(f"push-made-up-{i}", OPEN_BYTES // 2))
        with pytest.raises(RemoteError) as err:
            worker.request(ShardOpen("push-made-up-2", 0))
        assert err.value.code == "open-limit" and "ps.max_open_bytes" in str(err.value)
        assert cluster.held("w0") == held + OPEN_BYTES
        wait_for(lambda: cluster.held("w0") == held, 4 * PUSH_TIMEOUT_S, "the unclaimed segments handed back")
        with pytest.raises(RemoteError) as err:  # a late open of one takes no segment
            worker.request(ShardOpen("push-made-up-0", OPEN_BYTES // 2))
        assert err.value.code == "released"
        assert checksums(ps.pull()) == checksums(state)  # the sealed shard outlived the push timeout
        later = make_state(seed=2)
        ps.push(later, 1)
        assert checksums(ps.pull()) == checksums(later)
    finally:
        runtime.close()


def test_an_init_the_manager_never_planned_takes_no_memory_and_a_planned_one_is_not_bounded_as_pushes(
        cluster: PsCluster, tmp_path: Path) -> None:
    """A peer that names itself the parent in the header of an init the manager never planned is refused
    ``not-planned`` before any memory is spent (it was taken, up to ps.max_open_bytes, for ps.init_timeout_s);
    chunks and the end of it are refused too. A broadcast init the manager runs is bounded by the filesystem's
    room, not by ps.max_open_bytes: a checkpoint larger than that bound loads (it was refused ``open-limit``)."""
    runtime, ps = cluster.client("test-parent")
    try:
        held = cluster.held("w0")
        worker = runtime.client(cluster.worker_info["w0"]["endpoints"]["ps"])
        (me,) = ps.status().workers
        parent = WorkerInfo("test-parent", "tcp://127.0.0.1:9", "elsewhere", "/nonexistent")
        zeros = np.zeros(4096, np.uint8)
        layout = [ShardTensor("a", "uint8", [4096], 0, 4096, checksum(zeros))]
        refusals = [(InitHeader("init-a", [parent, me], 5.0, 4096, layout), "not-planned"),
                    (InitHeader("init-big", [parent, me], 5.0, 1 << 40, layout), "not-planned"),
                    (InitChunk("init-a", 0, zeros), "unknown-init"), (InitEnd("init-a", layout), "unknown-init")]
        for body, code in refusals:
            with pytest.raises(RemoteError) as err:
                worker.request(body)
            assert err.value.code == code, body.kind
        assert cluster.held("w0") == held

        state = {"big": torch.arange(OPEN_BYTES // 4 + 1024, dtype=torch.float32)}  # past ps.max_open_bytes
        path = tmp_path / "big.safetensors"
        save_file(state, str(path))
        result = ps.init(str(path), workers=["w0"], timeout_s=30)
        assert torch.equal(ps.pull(result.version, verify=True)["big"], state["big"])
        assert cluster.held("w0") > held + OPEN_BYTES
        for i in range(2):  # the pushes' bound is what it was: an init's copy is not counted in it
            worker.request(ShardOpen(f"push-made-up-{i}", OPEN_BYTES // 2))
        with pytest.raises(RemoteError) as err:
            worker.request(ShardOpen("push-made-up-2", 0))
        assert err.value.code == "open-limit"
    finally:
        runtime.close()


def test_segments_hold_no_file_descriptor(cluster: PsCluster) -> None:
    """More segments than the worker's descriptor limit: every open is taken, pushes and pulls go on."""
    runtime, ps = cluster.client()
    try:
        worker = runtime.client(cluster.worker_info["w0"]["endpoints"]["ps"])
        for i in range(NOFILE + 44):
            worker.request(ShardOpen(f"push-empty-{i}", 0))
        pid = cluster.workers["w0"].pid
        assert len(os.listdir(f"/proc/{pid}/fd")) < NOFILE // 2
        state = make_state(seed=4)
        ps.push(state, 0)
        assert checksums(ps.pull()) == checksums(state)
    finally:
        runtime.close()


def test_a_segment_is_unmapped_once_released_and_no_view_is_left(tmp_path: Path) -> None:
    def mapped(path: Path) -> bool:
        return str(path) in Path("/proc/self/maps").read_text()

    pool = SegmentPool(tmp_path, "unmap", pin=False, max_free=0)
    try:
        segment = acquire(pool, 100)
        view = segment.view(0, 16)  # e.g. a frame in flight to ZeroMQ
        pool.release(segment)
        assert not segment.path.exists() and mapped(segment.path)
        del view
        assert not mapped(segment.path)
    finally:
        pool.close()
