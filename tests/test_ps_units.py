"""Parameter-server building blocks in-process: segments, leases, versions and retention, manifests, and
the safetensors reader."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
from refbus.nodes.ps import shm
from refbus.nodes.ps.checkpoint import read_layout
from refbus.nodes.ps.leases import LeaseTable
from refbus.nodes.ps.manifest import ManifestError, check_shard, digest, layout
from refbus.nodes.ps.shm import OwnerLock, SegmentMaps, SegmentPool, sweep_orphans
from refbus.nodes.ps.versions import VersionStore
from refbus.protocol.codec import checksum
from refbus.protocol.messages_ps import ManifestEntry, ShardTensor, TensorSpec, WorkerInfo
from safetensors.torch import save


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path  # tmpfs or not, the pool's contract is the same


def test_pool_reuses_segments_and_unlinks_everything_on_close(shm_dir: Path) -> None:
    pool = SegmentPool(shm_dir, "unit", pin=False, max_free=1)
    a = pool.acquire(10_000)
    a.view(0, 4)[:] = b"abcd"
    maps = SegmentMaps(readonly=True)
    assert bytes(maps.view(str(a.path), 0, 4)) == b"abcd"  # another mapping sees the same memory
    pool.release(a)
    b = pool.acquire(5_000)  # best fit among free segments: the same one, already faulted in
    assert b is a and pool.reused == 1 and pool.created == 1
    c, d = pool.acquire(100), pool.acquire(100)
    pool.release(c)
    pool.release(d)  # beyond max_free: the older free one is unlinked now
    assert not c.path.exists() and d.path.exists()
    assert pool.in_use_bytes == a.capacity and pool.free_bytes == d.capacity
    with pytest.raises(ValueError, match="outside"):
        b.view(b.capacity - 1, 2)
    pool.close()
    assert list(shm_dir.iterdir()) == []


def test_sweep_removes_only_segments_of_dead_processes(shm_dir: Path) -> None:
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000
    (shm_dir / f"unit.{dead}.1").write_bytes(b"x")
    (shm_dir / f"unit.{os.getpid()}.1").write_bytes(b"x")
    assert sweep_orphans(shm_dir, "unit") == [f"unit.{dead}.1"]
    assert [p.name for p in shm_dir.iterdir()] == [f"unit.{os.getpid()}.1"]


# A process that takes the lock of token ``<pid>``, creates one segment, says so and waits to be killed.
_HOLDER = """
import sys, time
from refbus.nodes.ps.shm import OwnerLock, SegmentPool
lock = OwnerLock.take(sys.argv[1], "unit", pid=int(sys.argv[2]))
SegmentPool(sys.argv[1], "unit", pin=False, token=lock.token).acquire(100)
print(lock.token, flush=True)
time.sleep(600)
"""


def test_sweep_spares_every_token_whose_lock_is_held_and_removes_it_once_its_holder_died(shm_dir: Path) -> None:
    """Segments are judged by their lock, not by their pid: a live holder whose pid does not exist here (a
    worker of another PID namespace) keeps its segments; a SIGKILLed holder's are removed, lock file too."""
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000  # no process here has this pid
    mine = OwnerLock.take(shm_dir, "unit", pid=dead)
    pool = SegmentPool(shm_dir, "unit", pin=False, token=mine.token)
    kept = pool.acquire(100)
    assert (mine.token, kept.name) == (str(dead), f"unit.{dead}.1")
    # Another live holder of the same pid (the other namespace's) gets a token of its own, not these names.
    other = OwnerLock.take(shm_dir, "unit", pid=dead)
    other_pool = SegmentPool(shm_dir, "unit", pin=False, token=other.token)
    assert other.token == f"{dead}-1" and other_pool.acquire(1).name == f"unit.{dead}-1.1"
    # Two holders in child processes (pids that do not exist here either), SIGKILLed below.
    children = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(shm_dir), str(pid)], stdout=subprocess.PIPE,
                                 text=True) for pid in (dead + 1, dead + 2)]
    try:
        for child, pid in zip(children, (dead + 1, dead + 2), strict=True):
            assert child.stdout is not None and child.stdout.readline().strip() == str(pid)
        held = {f"unit.{token}.{n}" for token in (dead, f"{dead}-1", dead + 1, dead + 2) for n in ("1", "lock")}
        assert sweep_orphans(shm_dir, "unit") == []  # every lock is held: nothing goes, whatever the pids say
        assert {p.name for p in shm_dir.iterdir()} == held
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait()
        # A new process that has a dead holder's pid takes its token over; what that one left goes first.
        reused = OwnerLock.take(shm_dir, "unit", pid=dead + 2)
        assert reused.token == str(dead + 2) and not (shm_dir / f"unit.{dead + 2}.1").exists()
        assert sweep_orphans(shm_dir, "unit") == [f"unit.{dead + 1}.1"]  # its holder is gone: its lock goes too
        assert {p.name for p in shm_dir.iterdir()} == held - {f"unit.{dead + 1}.1", f"unit.{dead + 1}.lock",
                                                              f"unit.{dead + 2}.1"}
        reused.release()
    finally:
        for child in children:
            child.kill()
            child.wait()
            assert child.stdout is not None
            child.stdout.close()
    other_pool.close()
    other.release()
    pool.close()
    mine.release()
    assert list(shm_dir.iterdir()) == []


def test_pinning_without_cuda_warns_once(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_pin_warned", False)
    monkeypatch.setattr(shm, "_cuda_torch", lambda: None)
    pool = SegmentPool(shm_dir, "pin", pin=True)
    with structlog.testing.capture_logs() as logs:
        segments = [pool.acquire(100) for _ in range(3)]
    assert [e["event"] for e in logs] == ["ps.pinned_memory_unavailable"]
    assert not any(s.pinned for s in segments)
    pool.close()


def test_leases_expire_unless_renewed_and_remember_how_they_ended() -> None:
    table = LeaseTable(ttl_s=1.0)
    kept = table.grant("pull", "r1", 3, now=0.0)
    lost = table.grant("push", "t0", 4, now=0.0)
    assert table.renew(kept.lease_id, now=0.9)
    assert table.expire(now=1.5) == [lost]
    assert table.ended(lost.lease_id) == "expired" and table.expired_total == {"push": 1, "pull": 0}
    assert table.release(lost.lease_id) is None
    assert table.release(kept.lease_id) is kept and table.ended(kept.lease_id) == "released"


def _entries(version: int) -> list[ManifestEntry]:
    return [ManifestEntry("w", "float32", [2], 8, version, [])]


def test_versions_commit_only_when_every_rank_did_and_retain_k() -> None:
    store = VersionStore(retain=2)
    workers = [WorkerInfo("w0", "tcp://x", "h", "/dev/shm")]
    specs = [TensorSpec("a", "float32", [2]), TensorSpec("b", "int8", [3])]
    for version in range(4):
        rank0 = store.begin(version, 0, 2, specs[:1], ["w0"], f"L{version}.0", now=0.0)
        rank1 = store.begin(version, 1, 2, specs[1:], ["w0"], f"L{version}.1", now=0.0)
        _, manifest, _ = store.commit_shard(version, 0, f"L{version}.0", "w0", "s0", rank0, workers)
        assert manifest is None and store.latest == version - 1  # not visible with one rank missing
        _, manifest, freed = store.commit_shard(version, 1, f"L{version}.1", "w0", "s1", rank1, workers)
        assert manifest is not None and manifest.version == store.latest == version
        if version == 1:
            store.pin(1)  # a reader holds version 1 across its retirement
        # Retiring version 0 frees it at once; version 1 is retired too but still read, so it stays.
        assert freed == {2: [("w0", "L0.0"), ("w0", "L0.1")]}.get(version, [])
    assert store.retained() == [2, 3] and store.pinned() == {1: 1}
    with pytest.raises(ManifestError, match="not retained"):
        store.pin(1)
    assert store.unpin(1) == [("w0", "L1.0"), ("w0", "L1.1")]


def test_versions_abort_and_refuse_what_does_not_fit() -> None:
    store = VersionStore(retain=1)
    spec = [TensorSpec("a", "float32", [2])]
    granted = store.begin(0, 0, 1, spec, ["w0"], "L0", now=0.0)
    bad = [ShardTensor("a", "float32", [2], 64, 8)]
    with pytest.raises(ManifestError) as err:
        store.commit_shard(0, 0, "L0", "w0", "s", bad, [])
    assert err.value.code == "manifest-mismatch" and "offset" in str(err.value)
    with pytest.raises(ManifestError) as err:
        store.begin(1, 0, 1, spec, ["w0"], "L1", now=0.0)
    assert err.value.code == "version-conflict" and "still being pushed" in str(err.value)
    assert store.abort(0) == [("w0", "L0")] and store.pending is None
    with pytest.raises(ManifestError) as err:
        store.commit_shard(0, 0, "L0", "w0", "s", granted, [])
    assert err.value.code == "push-aborted"


def test_layout_aligns_and_digest_ignores_placement() -> None:
    tensors, total = layout([TensorSpec("a", "uint8", [3]), TensorSpec("b", "bfloat16", [5, 2])])
    assert [(t.offset, t.nbytes) for t in tensors] == [(0, 3), (64, 20)] and total == 128
    with pytest.raises(ManifestError) as err:
        layout([TensorSpec("x", "complex32", [1])])
    assert err.value.code == "bad-dtype"
    check_shard(tensors, tensors)
    here = ManifestEntry("a", "uint8", [3], 3, 9, [])
    assert digest([here]) == digest([ManifestEntry("a", "uint8", [3], 3, 9, [])])
    assert digest([here]) != digest([ManifestEntry("a", "uint8", [3], 3, 10, [])])


def test_checkpoint_layout_matches_safetensors() -> None:
    state = {"z": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a": torch.randn(4).to(torch.bfloat16),
             "m": torch.tensor([True, False])}
    blob = save(state)
    found = read_layout(io.BytesIO(blob), "mem")
    assert {t.name: (t.dtype, t.shape) for t in found.tensors} == {
        "z": ("int64", [2, 3]), "a": ("bfloat16", [4]), "m": ("bool", [2])}
    for t in found.tensors:
        start = found.data_start + t.offset
        raw = blob[start : start + t.nbytes]
        assert checksum(raw) == checksum(state[t.name].reshape(-1).view(torch.uint8).numpy())
    with pytest.raises(ManifestError) as err:
        read_layout(io.BytesIO(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!"), "bad")
    assert err.value.code == "bad-checkpoint"


def test_a_worker_met_again_on_a_new_endpoint_has_its_old_client_closed() -> None:
    """The PS client keeps one client per worker id: a worker restarted on a new port (what grants and
    manifests say now) has its old client closed and its earlier processes' host proofs dropped."""
    from refbus.bus.runtime import NodeRuntime, RuntimeSettings
    from refbus.nodes.ps.client import PsClient

    runtime = NodeRuntime("ps-client", RuntimeSettings(node_id="t", metrics_port=-1), register=False)
    ps = PsClient(runtime, "tcp://127.0.0.1:1", transport="frames")

    def info(worker: str, port: int, nonce: str) -> WorkerInfo:
        return WorkerInfo(worker=worker, endpoint=f"tcp://127.0.0.1:{port}", host="h", shm_dir="/none", nonce=nonce)

    try:
        first = ps._worker(info("w0", 2, "a"))
        other = ps._worker(info("w1", 3, "a"))
        assert ps._worker(info("w0", 2, "a")) is first
        ps._proofs.update({("w0", "a"): "not proved", ("w1", "a"): None})
        for restart in range(1, 4):
            again = ps._worker(info("w0", 3 + restart, f"n{restart}"))
            assert first.sock.closed and first not in runtime._clients and again in runtime._clients
            first = again
        assert sorted(ps._workers) == ["w0", "w1"] and not other.sock.closed and not first.sock.closed
        assert set(ps._proofs) == {("w1", "a")}
        assert [client.endpoint for client in runtime._clients if client not in (ps._manager,)] == [
            "tcp://127.0.0.1:3", "tcp://127.0.0.1:6"]
    finally:
        ps.close()
        runtime.close()
