"""A ps-worker's segments hold no file descriptor; honest pushes and pulls go on beside many of them.

Real processes: a broker, a ps-manager and one ps-worker started under a low descriptor limit (``prlimit``).
Each test checks at the end that no shared-memory segment of its cluster is left behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ps_support import PsCluster, checksums, make_state, segments, start_cluster
from refbus.nodes.ps.shm import SegmentPool
from refbus.protocol.messages_ps import ShardOpen

NOFILE = 256  # the worker's descriptor limit: a segment that held one would run it out within the test


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    _, control = bus
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=0)
    worker = spawn(["node", "ps-worker", "--node-id", "w0", "--ps-manager", cluster.manager, *cluster.flags], "w0",
                   prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"])
    cluster.worker_info["w0"] = worker.wait_ready()
    cluster.workers["w0"] = worker
    yield cluster
    for proc in [worker, cluster.manager_proc]:
        assert proc is not None and proc.stop() == 0, proc.log_tail() if proc else ""
    assert segments(cluster.prefix) == [], "shared-memory segments leaked"


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
        segment = pool.acquire(100)
        view = segment.view(0, 16)  # e.g. a frame in flight to ZeroMQ
        pool.release(segment)
        assert not segment.path.exists() and mapped(segment.path)
        del view
        assert not mapped(segment.path)
    finally:
        pool.close()
