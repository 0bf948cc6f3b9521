"""Parameter-server building blocks in-process: segments, leases, versions and retention, manifests, and
the safetensors reader."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import torch
from polling import wait_for
from pool_support import acquire
from refbus.bus.reqrep import HandlerError, PeerDown, RemoteError, RequestTimeout
from refbus.nodes.ps import client as ps_client
from refbus.nodes.ps import manager as manager_module
from refbus.nodes.ps import manifest as mf
from refbus.nodes.ps import shm
from refbus.nodes.ps.checkpoint import read_layout
from refbus.nodes.ps.host_proof import NonceFile
from refbus.nodes.ps.leases import LeaseTable
from refbus.nodes.ps.manager import PsManager
from refbus.nodes.ps.manager_journal import ManagerJournal
from refbus.nodes.ps.manifest import ManifestError, check_shard, digest, layout
from refbus.nodes.ps.shm import OwnerLock, SegmentMaps, SegmentPool, sweep_orphans
from refbus.nodes.ps.versions import VersionStore
from refbus.nodes.settings import PsSettings
from refbus.nodes.store.durable import DurableStore
from refbus.protocol.codec import checksum
from refbus.protocol.envelope import WireCodec
from refbus.protocol.errors import SchemaError
from refbus.protocol.messages import Body, Error, NodeDown, NodeInfo
from refbus.protocol.messages_ps import (
    InitDone,
    InitFailed,
    InitRequest,
    LeaseRelease,
    Location,
    ManifestEntry,
    PsRegister,
    PsStatus,
    PullBegin,
    PushBegin,
    PushGrant,
    Release,
    ShardCommit,
    ShardTensor,
    TensorSpec,
    WorkerInfo,
)
from safetensors.torch import save


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path  # tmpfs or not, the pool's contract is the same


def test_pool_reuses_segments_and_unlinks_everything_on_close(shm_dir: Path) -> None:
    pool = SegmentPool(shm_dir, "unit", pin=False, max_free=1)
    a = acquire(pool, 10_000)
    a.view(0, 4)[:] = b"abcd"
    maps = SegmentMaps(readonly=True)
    assert bytes(maps.view(str(a.path), 0, 4)) == b"abcd"  # another mapping sees the same memory
    pool.release(a)
    b = acquire(pool, 5_000)  # best fit among free segments: the same one, already faulted in
    assert b is a and pool.reused == 1 and pool.created == 1
    c, d = acquire(pool, 100), acquire(pool, 100)
    pool.release(c)
    pool.release(d)  # beyond max_free: the older free one is unlinked now
    assert not c.path.exists() and d.path.exists()
    assert pool.in_use_bytes == a.capacity and pool.free_bytes == d.capacity
    with pytest.raises(ValueError, match="outside"):
        b.view(b.capacity - 1, 2)
    pool.close()
    assert list(shm_dir.iterdir()) == []


def test_a_pool_that_adopts_an_earlier_process_s_segments_under_its_token_names_new_ones_past_them(
        shm_dir: Path) -> None:
    """A durable worker restarted with the pid it had (a container's first process) adopts the shards its
    earlier process sealed under the same token: the next new segment must not take one of their names (it did:
    ``FileExistsError``, and the push failed ``internal``)."""
    earlier = SegmentPool(shm_dir, "unit", pin=False, token="7")
    sealed = [acquire(earlier, 100) for _ in range(3)]
    restarted = SegmentPool(shm_dir, "unit", pin=False, token="7")
    for segment in sealed[1:]:  # the first was released before the restart: not adopted
        restarted.adopt(segment.name)
    fresh = acquire(restarted, 100)
    assert fresh.name == "unit.7.4" and fresh.name not in {s.name for s in sealed}
    other = SegmentPool(shm_dir, "unit", pin=False, token="8")
    other.adopt(sealed[2].name)  # another token's name does not move this pool's numbers
    assert acquire(other, 100).name == "unit.8.1"


def test_sweep_removes_only_segments_of_dead_processes(shm_dir: Path) -> None:
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000
    (shm_dir / f"unit.{dead}.1").write_bytes(b"x")
    (shm_dir / f"unit.{os.getpid()}.1").write_bytes(b"x")
    assert sweep_orphans(shm_dir, "unit") == [f"unit.{dead}.1"]
    assert [p.name for p in shm_dir.iterdir()] == [f"unit.{os.getpid()}.1"]


def test_sweep_skips_a_leftover_it_cannot_remove_and_the_worker_starts(shm_dir: Path) -> None:
    """A name of a dead token that cannot be unlinked (here a directory) is logged and left: the sweep raised
    (``IsADirectoryError``), and so did every ps-worker's start on that host."""
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000
    (shm_dir / f"unit.{dead}.1").mkdir()
    (shm_dir / f"unit.{dead}.2").write_bytes(b"x")
    assert sweep_orphans(shm_dir, "unit") == [f"unit.{dead}.2"]
    assert [p.name for p in shm_dir.iterdir()] == [f"unit.{dead}.1"]


OTHER_UID = 65534  # nobody


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root (os.chown)")
def test_files_another_user_planted_are_never_removed_or_taken_as_a_token_s(shm_dir: Path) -> None:
    """``/dev/shm`` is shared by every user: a file of a dead-looking token planted by another user stays (a
    worker not running as root failed to unlink it, and failed to start), a token with another user's lock is
    left alone, and a worker whose own token has another user's file under it takes the next token."""
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000
    planted = [shm_dir / f"unit.{dead}.1", shm_dir / f"unit.{dead + 1}.{shm.LOCK_SUFFIX}",
               shm_dir / f"unit.{dead + 1}.1"]
    for path in planted:
        path.write_bytes(b"x")
        os.chown(path, OTHER_UID, OTHER_UID)
    assert sweep_orphans(shm_dir, "unit") == []
    lock = OwnerLock.take(shm_dir, "unit", pid=dead)
    try:
        assert lock.token == f"{dead}-1"
        assert all(path.exists() for path in planted)
    finally:
        lock.release()


def test_the_host_proof_file_replaces_a_symlink_planted_under_its_name(tmp_path: Path) -> None:
    """The nonce file was opened O_CREAT|O_TRUNC through whatever stood at its name: a symlink there made the
    worker truncate and overwrite the file it names."""
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the worker's user\n")
    (tmp_path / "unit.7.nonce").symlink_to(victim)
    proof = NonceFile.create(tmp_path, "unit", "7")
    assert victim.read_text() == "a file of the worker's user\n"
    assert not proof.path.is_symlink() and proof.path.read_text() == proof.nonce
    proof.remove()


# A process that takes the lock of token ``<pid>``, creates one segment, says so and waits to be killed.
_HOLDER = """
import sys, time
from refbus.nodes.ps.shm import OwnerLock, SegmentPool
lock = OwnerLock.take(sys.argv[1], "unit", pid=int(sys.argv[2]))
SegmentPool(sys.argv[1], "unit", pin=False, token=lock.token).allocate(100, slice_bytes=4096).step()
print(lock.token, flush=True)
time.sleep(600)
"""


def test_sweep_spares_every_token_whose_lock_is_held_and_removes_it_once_its_holder_died(shm_dir: Path) -> None:
    """Segments are judged by their lock, not by their pid: a live holder whose pid does not exist here (a
    worker of another PID namespace) keeps its segments; a SIGKILLed holder's are removed, lock file too."""
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000  # no process here has this pid
    mine = OwnerLock.take(shm_dir, "unit", pid=dead)
    pool = SegmentPool(shm_dir, "unit", pin=False, token=mine.token)
    kept = acquire(pool, 100)
    assert (mine.token, kept.name) == (str(dead), f"unit.{dead}.1")
    # Another live holder of the same pid (the other namespace's) gets a token of its own, not these names.
    other = OwnerLock.take(shm_dir, "unit", pid=dead)
    other_pool = SegmentPool(shm_dir, "unit", pin=False, token=other.token)
    assert other.token == f"{dead}-1" and acquire(other_pool, 1).name == f"unit.{dead}-1.1"
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
        segments = [acquire(pool, 100) for _ in range(3)]
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


def test_a_segment_a_worker_names_outside_its_directory_is_never_mapped(tmp_path: Path) -> None:
    """A worker's segment names were joined to its directory unchecked and mapped read-write by a pusher: an
    absolute or '../' name, or a symlink in the worker's own directory (its host proof passing), made the
    pusher write tensor bytes into a file of its own user."""
    from refbus.bus.runtime import NodeRuntime, RuntimeSettings
    from refbus.nodes.ps.client import PsClient, PsError
    from refbus.nodes.ps.host_proof import boot_id

    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the pusher's user\n")
    rogue = tmp_path / "rogue"
    rogue.mkdir()
    (rogue / "n.nonce").write_text("abc123")
    (rogue / "seg").symlink_to(victim)
    runtime = NodeRuntime("ps-client", RuntimeSettings(node_id="t", metrics_port=-1), register=False)
    ps = PsClient(runtime, "tcp://127.0.0.1:1")
    info = WorkerInfo(worker="rogue", endpoint="tcp://127.0.0.1:1", host="h", shm_dir=str(rogue), pid=1,
                      boot_id=boot_id(), nonce_file="n.nonce", nonce="abc123")
    try:
        for segment in (str(victim), "../victim.txt", "..", "a\0b"):
            with pytest.raises(PsError, match="not a plain file name"):
                ps._local_path(info, segment)
        path = ps._local_path(info, "seg")
        assert path is not None
        with pytest.raises(OSError):
            ps._writes.view(path, 0, 4)
        assert victim.read_text() == "a file of the pusher's user\n"
    finally:
        ps.close()
        runtime.close()


def test_segment_maps_refuse_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO where a segment should be is refused at once, for readers too: its open no longer waits for a
    writer."""
    fifo = tmp_path / "unit.1.1"
    os.mkfifo(fifo)
    for readonly in (False, True):  # read-write first: its open never waited, so the old code failed, not hung
        with pytest.raises(OSError, match="not a regular file"):
            SegmentMaps(readonly=readonly).view(str(fifo), 0, 1)


# --- the manager's handlers on a stub runtime -------------------------------------------------------------


class _StubRuntime:
    """What PsManager uses of a NodeRuntime: its handlers are called directly, its requests recorded."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.sent: list[tuple[str, Body, Callable[..., None]]] = []  # (endpoint, body, on_done)
        self.published: list[Body] = []
        self.down_listeners: list[Callable[..., None]] = []
        self.up_listeners: list[Callable[..., None]] = []
        self.marked_up: list[str] = []
        self.shutdown_hooks: list[Callable[[], None]] = []
        self.server = types.SimpleNamespace(on=lambda kind, handler, **_: self.handlers.__setitem__(kind, handler),
                                            pending=object(), answer=lambda pending, body: None)
        self.calls = types.SimpleNamespace(
            request=lambda endpoint, body, on_done, **_: self.sent.append((endpoint, body, on_done)),
            mark_up=self.marked_up.append)

    def serve(self, name: str, endpoint: str) -> Any:
        return self.server

    def track_peers(self) -> Any:
        return types.SimpleNamespace(on_down=self.down_listeners.append, on_up=self.up_listeners.append)

    def every(self, seconds: float, callback: Callable[[], None]) -> None:
        pass

    def metric(self, *args: Any, **kwargs: Any) -> None:
        pass

    def histogram(self, *args: Any, **kwargs: Any) -> Any:
        return types.SimpleNamespace(observe=lambda value: None)

    def publish(self, body: Body) -> None:
        self.published.append(body)

    def call(self, body: Body, request_id: str = "r1") -> Any:
        return self.handlers[body.kind](types.SimpleNamespace(body=body, header=types.SimpleNamespace(id=request_id)))

    def released(self, worker: str) -> list[str]:
        return [shard for endpoint, body, _ in self.sent
                if endpoint == f"tcp://{worker}:1" and isinstance(body, Release) for shard in body.shards]


def _manager(**settings: Any) -> tuple[_StubRuntime, PsManager]:
    runtime = _StubRuntime()
    return runtime, PsManager(runtime, PsSettings(**settings))  # type: ignore[arg-type]


def _worker(name: str, pid: int = 1) -> WorkerInfo:
    return WorkerInfo(name, f"tcp://{name}:1", "h", "/dev/shm", pid, "boot", "nonce", "n", started=100.0 + pid)


SPEC = [TensorSpec("a", "float32", [4])]


def _begin(runtime: _StubRuntime, version: int, rank: int = 0, world: int = 1) -> PushGrant:
    grant = runtime.call(PushBegin(version, rank, world, "trainer", SPEC, "h"))
    assert isinstance(grant, PushGrant)
    return grant


def _seal(runtime: _StubRuntime, grant: PushGrant, version: int, worker: str, rank: int = 0) -> Any:
    tensors = [msgspec.structs.replace(t, checksum=1) for t in grant.tensors]
    return runtime.call(ShardCommit(grant.lease, version, rank, worker, f"seg-{grant.lease}-{worker}", tensors))


def _push(runtime: _StubRuntime, version: int) -> PushGrant:
    grant = _begin(runtime, version)
    for worker in [grant.worker, *grant.replicas]:
        _seal(runtime, grant, version, worker.worker)
    return grant


def test_a_restarted_worker_is_told_to_release_the_shards_it_readopted_that_nothing_needs() -> None:
    """w1 is down while versions 0 and 1 retire (their releases to it are lost); restarted (durable), it
    registers re-adopting those copies and others still needed: the manager releases exactly the orphans."""
    runtime, manager = _manager(replicas=2, retain_versions=3)
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    grants = {version: _push(runtime, version) for version in range(3)}
    runtime.down_listeners[0](NodeDown("w1", "ps-worker", "timeout", 0.0),
                              NodeInfo("w1", "ps-worker", "h", 1, started=101.0))
    for version in (3, 4):
        _push(runtime, version)
    assert manager.versions.retained() == [2, 3, 4] and runtime.released("w1") == []  # w1 was down: nothing sent
    held = {f"seg-{grants[v].lease}-w1": grants[v].lease for v in range(3)}
    assert runtime.call(PsRegister(_worker("w1", pid=2), sorted(held), held)).kind == "ok"
    assert sorted(runtime.released("w1")) == sorted(grants[v].lease for v in (0, 1))  # version 2 is retained
    assert runtime.marked_up[-1] == "tcp://w1:1"  # a fixed endpoint marked down by the node-down is usable again
    # A copy of the pending push is the pusher's (its seal may be retried): kept. An older worker names no
    # shard ids: nothing is released, as before.
    pending = _begin(runtime, 5)
    assert {w.worker for w in [pending.worker, *pending.replicas]} == {"w0", "w1"}
    runtime.sent.clear()
    held = {f"seg-{grants[2].lease}-w1": grants[2].lease, "seg-pending": pending.lease}
    runtime.call(PsRegister(_worker("w1", pid=3), sorted(held), held))
    runtime.call(PsRegister(_worker("w1", pid=4), sorted(held)))
    assert runtime.released("w1") == []


def test_a_pull_grant_names_only_copies_a_registered_worker_listed_or_committed() -> None:
    """A worker (re-)registers listing the segments it holds (a restarted manager learns where the copies are
    this way): a copy it did not list is left out of pull grants, and a tensor none holds fails at once."""
    runtime, _ = _manager(replicas=2)
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    grant = _push(runtime, 0)
    both = runtime.call(PullBegin("reader", 0))
    assert [loc.worker for loc in both.manifest.entries[0].locations] == ["w0", "w1"]
    runtime.call(PsRegister(_worker("w1", pid=2)))  # back without its copy
    narrowed = runtime.call(PullBegin("reader", 0))
    assert [loc.worker for loc in narrowed.manifest.entries[0].locations] == ["w0"]
    runtime.call(PsRegister(_worker("w0", pid=2), [f"seg-{grant.lease}-w1"]))  # lists another worker's segment
    with pytest.raises(HandlerError) as err:
        runtime.call(PullBegin("reader", 0))
    assert err.value.code == "copies-down" and "no longer holds it" in str(err.value)
    held = f"seg-{grant.lease}-w0"
    runtime.call(PsRegister(_worker("w0", pid=3), [held], {held: grant.lease}))
    assert [loc.worker for loc in runtime.call(PullBegin("reader", 0)).manifest.entries[0].locations] == ["w0"]


def test_a_pull_grant_placing_a_copy_on_a_worker_it_does_not_describe_is_refused_before_anything_is_written(
        ) -> None:
    """A grant (a manager of another build, a damaged one) whose second tensor sits on a worker its ``workers``
    do not describe: the pull is refused (PsError, naming it) before the first tensor is written, so ``out`` is
    not torn. Before, the read failed half-way with a bare ``KeyError`` the rollout's refresh did not catch."""
    workers = [WorkerInfo("w0", "tcp://127.0.0.1:1", "h", "/dev/shm")]
    entries = [ManifestEntry(name, "float32", [1], 4, 0, [Location(worker, "seg", 0)])
               for name, worker in (("a", "w0"), ("b", "w9"))]
    out = {"a": torch.zeros(1), "b": torch.zeros(1)}
    cast = ps_client._Cast(None, (), out)
    with pytest.raises(ps_client.PsError, match=r"does not describe: \['w9'\]; nothing read"):
        cast.check(mf.build(0, entries, workers))
    assert cast.written == []
    ps_client._Cast(None, (), {"a": out["a"]}).check(mf.build(0, entries[:1], workers))


def test_a_done_rank_whose_last_copy_is_lost_aborts_the_pending_version_at_a_registration_or_a_node_down(
        ) -> None:
    """replicas=1, world 2: rank 0 is done on w0 (its pusher has returned). w0 restarts without its store and
    registers, listing no segment, before the node-down of its earlier process arrives (which then changes
    nothing): the registration aborts the version, which would otherwise commit with rank 0 unreadable. The same
    rule holds at a node-down: a done rank keeps its answer while a registered worker holds a copy of it."""
    runtime, manager = _manager(replicas=1)
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    other = [TensorSpec("b", "float32", [4])]
    first = _begin(runtime, 0, rank=0, world=2)
    second = runtime.call(PushBegin(0, 1, 2, "trainer", other, "h"))
    assert (first.worker.worker, second.worker.worker) == ("w0", "w1")
    _seal(runtime, first, 0, "w0", rank=0)
    held = {f"seg-{first.lease}-w0": first.lease}
    runtime.call(PsRegister(_worker("w0", pid=2), sorted(held), held))  # a restart that re-adopted it: kept
    assert manager.versions.pending is not None
    runtime.call(PsRegister(_worker("w0", pid=3)))  # a restart without its store
    assert manager.versions.pending is None and manager.versions.aborted_total == 1
    runtime.down_listeners[0](NodeDown("w0", "ps-worker", "replaced", 0.0),
                              NodeInfo("w0", "ps-worker", "h", 2, started=102.0))
    with pytest.raises(HandlerError) as err:
        _seal(runtime, second, 0, "w1", rank=1)
    assert err.value.code == "push-aborted" and manager.versions.latest == -1 and runtime.published == []
    # At a node-down: rank 0 done on w0 and w1 (replicas=2) loses w0's copy, then w1's.
    runtime, manager = _manager(replicas=2)
    for name in ("w0", "w1", "w2"):
        runtime.call(PsRegister(_worker(name)))
    first = _begin(runtime, 0, rank=0, world=2)
    assert [first.worker.worker, *(w.worker for w in first.replicas)] == ["w0", "w1"]
    for name in ("w0", "w1"):
        _seal(runtime, first, 0, name, rank=0)
    runtime.down_listeners[0](NodeDown("w2", "ps-worker", "timeout", 0.0),
                              NodeInfo("w2", "ps-worker", "h", 1, started=101.0))
    runtime.down_listeners[0](NodeDown("w0", "ps-worker", "timeout", 0.0),
                              NodeInfo("w0", "ps-worker", "h", 1, started=101.0))
    assert manager.versions.pending is not None
    runtime.down_listeners[0](NodeDown("w1", "ps-worker", "timeout", 0.0),
                              NodeInfo("w1", "ps-worker", "h", 1, started=101.0))
    assert manager.versions.pending is None and manager.versions.aborted_total == 1


def test_after_a_manager_restart_a_worker_back_without_its_copy_aborts_nothing_while_another_may_still_hold_one(
        tmp_path: Path) -> None:
    """replicas=2, world 2: rank 0 is done on w0 and w1 (journaled, its pusher returned); the manager is
    SIGKILLed and restarted. w0 registers again without its copy while w1 has not registered yet: w1 may still
    hold its copy, so the version stays pending (it was aborted, and with it a rank that would never be pushed
    again); w1 back with its copy keeps it. w1 back without it, or reported down before it registers, aborts."""
    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    def restarted() -> tuple[_StubRuntime, PsManager, PushGrant]:
        runtime = _StubRuntime()
        recorder = journal()
        PsManager(runtime, PsSettings(replicas=2), journal=recorder)  # type: ignore[arg-type]
        for name in ("w0", "w1"):
            runtime.call(PsRegister(_worker(name)))
        first = runtime.call(PushBegin(5, 0, 2, "rank0", SPEC, "h", True, world_token="world-a"))
        assert [first.worker.worker, *(w.worker for w in first.replicas)] == ["w0", "w1"]
        for name in ("w0", "w1"):
            _seal(runtime, first, 5, name, rank=0)
        recorder.close(remove=False)  # SIGKILL
        runtime = _StubRuntime()
        manager = PsManager(runtime, PsSettings(replicas=2), journal=journal())  # type: ignore[arg-type]
        runtime.call(PsRegister(_worker("w0", pid=2)))  # back without its store
        assert manager.versions.pending is not None and manager.versions.aborted_total == 0
        return runtime, manager, first

    runtime, manager, first = restarted()
    held = {f"seg-{first.lease}-w1": first.lease}
    runtime.call(PsRegister(_worker("w1", pid=2), sorted(held), held))
    assert manager.versions.pending is not None and sorted(manager.versions.pending.ranks) == [0]
    manager.journal.close(remove=True)  # type: ignore[union-attr]

    runtime, manager, _ = restarted()
    runtime.call(PsRegister(_worker("w1", pid=2)))
    assert manager.versions.pending is None and manager.versions.aborted_total == 1
    manager.journal.close(remove=True)  # type: ignore[union-attr]

    runtime, manager, _ = restarted()
    runtime.down_listeners[0](NodeDown("w1", "ps-worker", "timeout", 0.0),
                              NodeInfo("w1", "ps-worker", "h", 1, started=101.0))
    assert manager.versions.pending is None and manager.versions.aborted_total == 1
    manager.journal.close(remove=True)  # type: ignore[union-attr]


def test_a_resuming_push_started_over_after_a_manager_restart_joins_the_ranks_of_its_world_restored(
        tmp_path: Path) -> None:
    """A world of two resumes at 5: rank 0 is done (journaled, its pusher returned), rank 1 is being written
    when the manager is SIGKILLed. Restarted, it restores rank 0; rank 1's push starts over (resuming, as it
    was) naming the same world token and joins it: version 5 commits with both ranks, rank 0's copy kept. A
    begin of the same world by the restored rank's own pusher (it never heard its answer) rewrites it. A
    resuming begin of another token, or naming none, starts the lineage afresh without the restored rank."""
    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    other = [TensorSpec("b", "float32", [4])]

    def killed_mid_push(token: str) -> tuple[_StubRuntime, PsManager, PushGrant]:
        """Rank 0 of world ``token`` done, rank 1 begun, then the manager killed and restarted; w0 registered
        again listing rank 0's copy."""
        runtime = _StubRuntime()
        recorder = journal()
        PsManager(runtime, PsSettings(replicas=1), journal=recorder)  # type: ignore[arg-type]
        runtime.call(PsRegister(_worker("w0")))
        first = runtime.call(PushBegin(5, 0, 2, "rank0", SPEC, "h", True, world_token=token))
        _seal(runtime, first, 5, "w0", rank=0)
        runtime.call(PushBegin(5, 1, 2, "rank1", other, "h", True, world_token=token))
        recorder.close(remove=False)  # SIGKILL: its shutdown hooks never ran
        runtime = _StubRuntime()
        manager = PsManager(runtime, PsSettings(replicas=1), journal=journal())  # type: ignore[arg-type]
        held = {f"seg-{first.lease}-w0": first.lease}
        runtime.call(PsRegister(_worker("w0", pid=2), sorted(held), held))
        assert manager.versions.pending is not None and sorted(manager.versions.pending.ranks) == [0]
        return runtime, manager, first

    runtime, manager, first = killed_mid_push("world-a")
    again = runtime.call(PushBegin(5, 1, 2, "rank1", other, "h", True, world_token="world-a"))
    assert manager.versions.pending is not None and sorted(manager.versions.pending.ranks) == [0, 1]
    assert _seal(runtime, again, 5, "w0", rank=1).committed and manager.versions.latest == 5
    assert {e.name: e.locations[0].segment for e in manager.versions.manifest(5).entries} == {
        "a": f"seg-{first.lease}-w0", "b": f"seg-{again.lease}-w0"}
    assert manager._held_back == [] and manager.versions.aborted_total == 0  # nothing to release
    manager.journal.close(remove=True)  # type: ignore[union-attr]

    runtime, manager, first = killed_mid_push("world-a")
    rewritten = runtime.call(PushBegin(5, 0, 2, "rank0", SPEC, "h", True, world_token="world-a"))
    assert rewritten.lease != first.lease and manager._held_back == [("w0", first.lease)]  # a TTL after the restart
    again = runtime.call(PushBegin(5, 1, 2, "rank1", other, "h", True, world_token="world-a"))
    _seal(runtime, rewritten, 5, "w0", rank=0)
    assert _seal(runtime, again, 5, "w0", rank=1).committed and manager.versions.latest == 5
    manager.journal.close(remove=True)  # type: ignore[union-attr]

    for token in ("world-b", ""):
        runtime, manager, first = killed_mid_push("world-a")
        runtime.call(PushBegin(5, 1, 2, "rank1", other, "h", True, world_token=token))
        assert manager.versions.pending is not None and sorted(manager.versions.pending.ranks) == [1]
        assert manager.versions.aborted_total == 1
        manager.journal.close(remove=True)  # type: ignore[union-attr]


def test_a_done_rank_replaced_by_a_retry_is_not_restored_after_a_manager_restart(tmp_path: Path) -> None:
    """replicas=1, world 2: rank 0 is done (journaled) on w0, but its pusher took the seal for failed (the
    answer was lost) and retries: the new attempt replaces the done rank and its copy is released. The manager
    is SIGKILLed before the new attempt is done: the restart must not restore the rank whose copy is gone, so
    rank 0's push starts over and the version commits with the new copy."""
    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    runtime = _StubRuntime()
    recorder = journal()
    PsManager(runtime, PsSettings(replicas=1), journal=recorder)  # type: ignore[arg-type]
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    first = _begin(runtime, 0, rank=0, world=2)
    _seal(runtime, first, 0, "w0", rank=0)
    retried = runtime.call(PushBegin(0, 0, 2, "trainer", [], "h", retry=first.lease, avoid=["w0"]))
    assert retried.worker.worker == "w1" and runtime.released("w0") == [first.lease]
    recorder.close(remove=False)  # SIGKILL: its shutdown hooks never ran
    runtime = _StubRuntime()
    manager = PsManager(runtime, PsSettings(replicas=1), journal=journal())  # type: ignore[arg-type]
    assert manager.versions.pending is None
    runtime.call(PsRegister(_worker("w0", pid=2)))
    runtime.call(PsRegister(_worker("w1", pid=2)))
    again = _begin(runtime, 0, rank=0, world=2)
    second = runtime.call(PushBegin(0, 1, 2, "trainer", [TensorSpec("b", "float32", [4])], "h"))
    _seal(runtime, again, 0, again.worker.worker, rank=0)
    assert _seal(runtime, second, 0, second.worker.worker, rank=1).committed
    assert manager.versions.manifest(0).entries[0].locations[0].segment == f"seg-{again.lease}-{again.worker.worker}"
    manager.journal.close(remove=True)  # type: ignore[union-attr]


def test_an_avoided_worker_registered_again_as_another_process_is_granted_again() -> None:
    """``avoid`` names the workers a pusher could not reach: one registered since as another process (restarted
    under its id) is not the one that failed and is granted again, even when every worker is avoided; one
    registered as a process this push's attempts were granted stays avoided, and so does a name none of them was
    granted (taken at the pusher's word). Unknown names and duplicates change nothing else."""
    runtime = _StubRuntime()
    PsManager(runtime, PsSettings(replicas=2))  # type: ignore[arg-type]
    for name in ("w0", "w1"):
        runtime.call(PsRegister(_worker(name)))

    def retry(lease: str, avoid: list[str]) -> PushGrant:
        grant = runtime.call(PushBegin(0, 0, 1, "trainer", [], "h", retry=lease, avoid=avoid))
        assert isinstance(grant, PushGrant)
        return grant

    second = retry(_begin(runtime, 0).lease, ["w0"])
    assert second.worker.worker == "w1" and second.replicas == []
    with pytest.raises(HandlerError) as err:  # both failed the push: nothing to grant
        retry(second.lease, ["w0", "w1"])
    assert err.value.code == "no-workers" and "['w0', 'w1']" in str(err.value)
    runtime.call(PsRegister(_worker("w0", pid=2)))  # w0 restarted: a new process
    with structlog.testing.capture_logs() as logs:
        third = retry(second.lease, ["w1", "w0", "w0", "ghost", "ghost"])
    assert third.worker == _worker("w0", pid=2) and third.replicas == []
    assert [e["restarted"] for e in logs if e["event"] == "ps.push_retried"] == [["w0"]]
    runtime.call(PsRegister(_worker("w2")))  # never granted to this push: the pusher's word stands
    with pytest.raises(HandlerError) as err:  # the new w0 failed too: the process granted is avoided now
        retry(third.lease, ["w0", "w1", "w2"])
    assert err.value.code == "no-workers"
    assert retry(third.lease, ["w0", "w1"]).worker.worker == "w2"


def test_a_world_token_that_is_not_a_string_is_refused_by_the_decoder() -> None:
    codec = WireCodec("trainer")
    kind, header, body = codec.encode(PushBegin(5, 0, 2, "rank0", SPEC, "h", True, world_token="world-a"))[:3]
    assert codec.decode([kind, header, body]).body.world_token == "world-a"
    for bad in (7, ["world-a"], None):
        fields = msgspec.msgpack.decode(body)
        fields["world_token"] = bad
        with pytest.raises(SchemaError, match=r"at `\$\.world_token`"):
            codec.decode([kind, header, msgspec.msgpack.encode(fields)])


def test_a_commit_the_journal_cannot_record_is_served_logged_and_unknown_to_a_restart(tmp_path: Path) -> None:
    """A journal write that fails (a full tmpfs) does not stop the manager: the version is committed and
    announced, the failure logged; a restarted manager knows only what was recorded."""
    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    runtime = _StubRuntime()
    recorder = journal()
    manager = PsManager(runtime, PsSettings(replicas=1), journal=recorder)  # type: ignore[arg-type]
    runtime.call(PsRegister(_worker("w0")))

    def full() -> None:
        raise OSError(28, "No space left on device")

    recorder.store.before_flag = full
    with structlog.testing.capture_logs() as logs:
        _push(runtime, 0)
    assert manager.versions.retained() == [0] and [b.version for b in runtime.published] == [0]
    assert any(entry["event"] == "ps.journal_failed" for entry in logs)
    recorder.store.before_flag = None
    _push(runtime, 1)
    recorder.store.close(remove=False)  # killed, not stopped: its shutdown hooks never ran, the journal stays
    restarted = PsManager(_StubRuntime(), PsSettings(replicas=1), journal=journal())  # type: ignore[arg-type]
    assert restarted.versions.retained() == [1] and restarted.versions.latest == 1


def test_a_manager_without_a_journal_holds_an_init_shard_it_never_made_for_a_lease_ttl() -> None:
    """A manager without a journal learns it restarted from the registrations: a re-adopted shard it never made
    may be a version the dead process committed and a reader still reads under its lease, a broadcast init's as
    much as a push's. Every release is held one lease TTL; an init shard this process made itself (its init
    failed) holds nothing back."""
    runtime, manager = _manager(replicas=1)
    held = {"seg-a": "init-0123456789ab"}  # loaded by an init of the dead process
    runtime.call(PsRegister(_worker("w0", pid=2), sorted(held), held))
    assert runtime.released("w0") == [] and manager._held_back == [("w0", "init-0123456789ab")]
    assert manager._releases_from > 0.0
    runtime, manager = _manager(replicas=1)
    runtime.call(PsRegister(_worker("w0")))
    assert runtime.call(InitRequest("/x.safetensors", ["w0"]), "init-1") is None and manager.init is not None
    init_id = manager.init.init_id
    runtime.call(InitFailed(init_id, "w0", "w0", "no such file"))
    runtime.sent.clear()
    held = {"seg-b": init_id}  # its release was lost: the worker restarted, re-adopting it
    runtime.call(PsRegister(_worker("w0", pid=2), sorted(held), held))
    assert runtime.released("w0") == [init_id] and manager._releases_from == 0.0


def test_a_worker_registering_twice_while_releases_are_held_back_is_told_each_orphan_once() -> None:
    """Releases held back one lease TTL after a restart add up: a worker that registers twice in that time (its
    answer lost, say) listed its orphans twice, and the one release sent named each shard twice, which a durable
    worker refused ``internal`` (its journal dropped the shard once, then failed on the second)."""
    ttl_s = 0.2
    runtime, manager = _manager(replicas=1, lease_ttl_s=ttl_s)
    held = {"seg-a": "push-0123456789ab-1", "seg-b": "push-0123456789ab-2"}  # of the dead manager process
    for _ in range(2):
        runtime.call(PsRegister(_worker("w0", pid=2), sorted(held), held))
    assert runtime.released("w0") == []

    def expired() -> list[str]:
        manager._expire()
        return runtime.released("w0")

    assert sorted(wait_for(expired, 25 * ttl_s, "the held-back release to go")) == sorted(held.values())


def test_a_release_lost_to_a_node_down_of_the_earlier_process_goes_again_at_the_node_up() -> None:
    """A worker restarted on a fixed endpoint registers before it joins the bus; the node-down of its earlier
    process then marks that endpoint down, so the release sent at the registration ends PeerDown. It is sent
    again once the registered process's node-up arrives (never for another process's node-up)."""
    runtime, _ = _manager(replicas=2, retain_versions=1)
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    grants = {version: _push(runtime, version) for version in range(2)}
    runtime.down_listeners[0](NodeDown("w1", "ps-worker", "timeout", 0.0),
                              NodeInfo("w1", "ps-worker", "h", 1, started=101.0))
    held = {f"seg-{grants[0].lease}-w1": grants[0].lease}
    runtime.sent.clear()
    runtime.call(PsRegister(_worker("w1", pid=2), sorted(held), held))
    (endpoint, release, on_done), = runtime.sent
    assert isinstance(release, Release) and release.shards == [grants[0].lease]
    on_done(PeerDown(endpoint, "ps-worker-w1 reported down (replaced)"))
    runtime.sent.clear()
    runtime.up_listeners[0](NodeInfo("w1", "ps-worker", "h", 1, started=101.0))  # the earlier process: nothing
    assert runtime.sent == []
    runtime.up_listeners[0](NodeInfo("w1", "ps-worker", "h", 2, started=102.0))
    assert runtime.released("w1") == [grants[0].lease]
    runtime.up_listeners[0](NodeInfo("w1", "ps-worker", "h", 2, started=102.0))  # sent once
    assert len(runtime.sent) == 1


def test_a_release_a_live_worker_did_not_answer_or_refused_is_sent_again_a_bounded_number_of_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that times out or is refused leaves the segment in use on a live worker: it is sent again from
    the timer, up to RELEASE_ATTEMPTS sends in all, and never to another process than the one that failed it
    (a restarted worker's registration releases what it re-adopted)."""
    monkeypatch.setattr(manager_module, "RELEASE_AGAIN_S", 0.0)
    runtime, manager = _manager(replicas=1, retain_versions=1)
    runtime.call(PsRegister(_worker("w0")))
    first = _push(runtime, 0)
    runtime.sent.clear()
    _push(runtime, 1)  # retires version 0: its shard is released
    failures: list[Exception] = [RequestTimeout("no reply from tcp://w0"),
                                 RemoteError(Error("internal", "journal write failed", Release.kind), "tcp://w0")]
    for attempt in range(1, manager_module.RELEASE_ATTEMPTS + 1):
        (_, release, on_done), = [sent for sent in runtime.sent if isinstance(sent[1], Release)]
        assert release.shards == [first.lease], attempt
        runtime.sent.clear()
        on_done(failures[attempt % 2])
        manager._expire()
    assert runtime.sent == []  # the last send failed too: given up, logged
    _push(runtime, 2)  # version 1's release times out; the worker restarts before it is sent again
    (_, _, on_done), = [sent for sent in runtime.sent if isinstance(sent[1], Release)]
    on_done(RequestTimeout("no reply from tcp://w0"))
    runtime.call(PsRegister(_worker("w0", pid=2)))
    runtime.sent.clear()
    manager._expire()
    assert runtime.sent == []


def test_a_broadcast_init_and_a_push_never_commit_the_same_version() -> None:
    """An init commits the next version: it is refused while a push is pending, and a push is refused while
    an init runs (retryable), so no version number is committed twice."""
    runtime, manager = _manager(replicas=1, retain_versions=2)
    runtime.call(PsRegister(_worker("w0")))
    _push(runtime, 0)
    pending = _begin(runtime, 1)
    with pytest.raises(HandlerError) as err:
        runtime.call(InitRequest("/x.safetensors", ["w0"]), "init-1")
    assert err.value.code == "init-busy" and "version 1 is being pushed" in str(err.value)
    assert manager.init is None
    _seal(runtime, pending, 1, "w0")  # the push commits; now the init may run, and loads version 2
    assert runtime.call(InitRequest("/x.safetensors", ["w0"]), "init-2") is None and manager.init is not None
    init_id = manager.init.init_id
    with pytest.raises(HandlerError) as err:
        _begin(runtime, 2)
    assert err.value.code == "init-running" and err.value.retry_after_s > 0 and init_id in str(err.value)
    assert manager.versions.pending is None and manager.leases.live() == []
    runtime.call(InitDone(init_id, "w0", "seg-init", 1, [ShardTensor("a", "float32", [4], 0, 16, 7)]))
    assert manager.init is None and manager.versions.latest == 2
    assert [bump.version for bump in runtime.published] == [0, 1, 2]
    _push(runtime, 3)  # pushes go on after the init's version
    assert manager.versions.manifest(2).entries[0].locations[0].segment == "seg-init"
    # Defense in depth: the store itself refuses an init's commit beside a pending push.
    store = VersionStore(retain=2)
    store.begin(0, 0, 1, SPEC, ["w0"], "L0", now=0.0)
    with pytest.raises(ManifestError) as verr:
        store.commit_init(mf.build(0, [], []), [("w0", "init-x")])
    assert verr.value.code == "version-conflict"


def test_a_push_refused_while_an_init_runs_waits_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client takes ``init-running`` as it takes ``no-workers``: it asks again after ``retry_after_s``."""
    refusal = Error("init-running", "init x runs", PushBegin.kind, retry_after_s=0.5)
    answers: list[Any] = [RemoteError(refusal, "tcp://manager"), "grant"]
    slept: list[float] = []
    fake = types.SimpleNamespace(wait_workers_s=5.0, _manager=None)

    def ask(_client: Any, _body: Any, _kind: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    fake._ask = ask
    monkeypatch.setattr(ps_client.time, "sleep", slept.append)
    assert ps_client.PsClient._grant(fake, PushBegin(0, 0, 1, "t", SPEC)) == "grant"  # type: ignore[arg-type]
    assert slept == [0.5]  # the refusal's retry_after_s, above the first pause


def test_a_push_lease_lives_until_every_copy_is_verified_so_the_pushers_abort_aborts() -> None:
    """replicas=2: the first copy is verified, the second fails for good and the pusher gives up (releases its
    lease): the version is no longer pending and the rank pushes it again at once."""
    runtime, manager = _manager(replicas=2)
    runtime.call(PsRegister(_worker("w0")))
    runtime.call(PsRegister(_worker("w1")))
    grant = _begin(runtime, 0)
    assert not _seal(runtime, grant, 0, "w0").committed
    assert [lease.lease_id for lease in manager.leases.live()] == [grant.lease]  # w1's copy is still to come
    assert runtime.call(LeaseRelease(grant.lease)).kind == "ok"  # the pusher aborts
    assert manager.versions.pending is None and manager.versions.aborted_total == 1
    assert sorted(runtime.released("w0") + runtime.released("w1")) == [grant.lease, grant.lease]
    again = _begin(runtime, 0)
    for worker in ("w0", "w1"):
        answer = _seal(runtime, again, 0, worker)
    assert answer.committed and manager.leases.live() == []  # the last copy verified: the lease ended
    # A rank done while another rank is still pushing: its lease ends with its last copy.
    first = _begin(runtime, 1, rank=0, world=2)
    for worker in ("w0", "w1"):
        assert not _seal(runtime, first, 1, worker, rank=0).committed
    assert first.lease not in {lease.lease_id for lease in manager.leases.live()}


@pytest.mark.parametrize(("header", "named"), [
    (b"[]", "a JSON list, not an object"),
    (b"3", "a JSON int, not an object"),
    (b'"x"', "a JSON str, not an object"),
    (b"null", "a JSON NoneType, not an object"),
    ({"a": []}, "tensor 'a' has a bad entry: a JSON list, not an object"),
    ({"a": 3}, "tensor 'a' has a bad entry: a JSON int"),
    ({"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, "dtype 'F33' is none of"),
    ({"a": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, "dtype ['F32'] is none of"),
    ({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}, "shape [-1, -4] is not a list of"),
    ({"a": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}}, "shape [2.0, 2] is not a list of"),
    ({"a": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, "shape [True, 4] is not a list of"),
    ({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, "shape '4' is not a list of"),
    ({"a": {"dtype": "F32", "shape": [4]}}, "data_offsets None are not two"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 32]}}, "are not two non-negative"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}}, "are not two non-negative"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, "spans [16, 0) but is float32[4]"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "spans [0, 8) but is float32[4]"),
    ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "past the end of the file"),
    ({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, "past the end of the file"),
])
def test_a_malformed_checkpoint_header_is_refused_by_name(header: bytes | dict, named: str) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + b"\0" * 16  # 16 data bytes: room for a float32[4]
    with pytest.raises(ManifestError) as err:
        read_layout(io.BytesIO(blob), "bad.safetensors")
    assert err.value.code == "bad-checkpoint" and named in str(err.value), str(err.value)
    good = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    raw = json.dumps(good).encode()
    found = read_layout(io.BytesIO(struct.pack("<Q", len(raw)) + raw + b"\0" * 16), "good.safetensors")
    assert found.nbytes == 16 and [(t.name, t.shape) for t in found.tensors] == [("a", [4])]


def test_a_resuming_push_refused_for_its_request_retires_nothing() -> None:
    """A push that starts a new lineage is checked (rank, dtypes, names, shapes) before the old lineage's
    versions are retired: a refused one leaves them readable."""
    runtime, manager = _manager(replicas=1, retain_versions=3)
    runtime.call(PsRegister(_worker("w0")))
    for version in range(3):
        _push(runtime, version)
    bad = [(PushBegin(1, 2, 2, "t", SPEC, "h", True), "bad-rank"),
           (PushBegin(1, 0, 1, "t", [TensorSpec("a", "float32", [5])], "h", True), "shape-mismatch"),
           (PushBegin(1, 0, 1, "t", [TensorSpec("a", "complex32", [4])], "h", True), "bad-dtype"),
           (PushBegin(1, 0, 1, "t", SPEC + SPEC, "h", True), "duplicate-name")]
    for begin, code in bad:
        with pytest.raises(HandlerError) as err:
            runtime.call(begin)
        assert err.value.code == code
        assert manager.versions.retained() == [0, 1, 2] and manager.versions.lineages == 0
    grant = runtime.call(PushBegin(1, 0, 1, "t", SPEC, "h", True))  # a good one starts the lineage
    assert isinstance(grant, PushGrant) and manager.versions.retained() == [0] and manager.versions.lineages == 1


def test_ps_state_carries_the_latest_digest_which_tells_a_new_lineages_version_from_the_retired_one() -> None:
    """A trainer world resumed at 1 commits its own version 1 (other bytes) over the retired one: ps-state's
    number is the same, its digest is the new version's, as in the bump (what a rollout's poll compares)."""
    runtime, _ = _manager(replicas=1)
    runtime.call(PsRegister(_worker("w0")))
    assert runtime.call(PsStatus()).latest_digest == ""  # nothing committed
    for version in (0, 1):
        _push(runtime, version)
    old = runtime.call(PsStatus())
    assert old.latest == 1 and old.latest_digest == runtime.published[-1].manifest_digest
    grant = runtime.call(PushBegin(1, 0, 1, "trainer", SPEC, "h", True))
    tensors = [msgspec.structs.replace(t, checksum=2) for t in grant.tensors]
    for worker in [grant.worker, *grant.replicas]:
        runtime.call(ShardCommit(grant.lease, 1, 0, worker.worker, f"seg-{grant.lease}-{worker.worker}", tensors))
    new = runtime.call(PsStatus())
    assert new.latest == 1 and new.latest_digest == runtime.published[-1].manifest_digest != old.latest_digest


def test_a_begin_again_by_the_same_pusher_replaces_its_unwritten_attempt_and_no_one_elses() -> None:
    """A begin the pusher sent while the manager was away reaches it late and is granted unread: the pusher's
    fresh begin of that rank replaces that attempt (its lease ended, its copies released, the version still
    pending); another holder's begin of the rank, or one after the rank's shard is verified, stays a conflict."""
    runtime, manager = _manager(replicas=1)
    runtime.call(PsRegister(_worker("w0")))
    stale = _begin(runtime, 0, rank=0, world=2)
    fresh = _begin(runtime, 0, rank=0, world=2)
    assert fresh.lease != stale.lease and manager.leases.get(stale.lease) is None
    assert runtime.released("w0") == [stale.lease] and manager.versions.pending is not None
    with pytest.raises(HandlerError) as other:
        runtime.call(PushBegin(0, 0, 2, "someone-else", SPEC, "h"))
    assert other.value.code == "version-conflict"
    _seal(runtime, fresh, 0, "w0")  # rank 0 verified: a begin of it again is not taken for a lost one
    with pytest.raises(HandlerError) as done:
        runtime.call(PushBegin(0, 0, 2, "trainer", SPEC, "h"))
    assert done.value.code == "version-conflict"
    second = runtime.call(PushBegin(0, 1, 2, "trainer", [TensorSpec("b", "float32", [4])], "h"))
    committed = _seal(runtime, second, 0, "w0", rank=1)
    assert committed.committed and manager.versions.latest == 0


def test_a_resuming_begin_by_the_same_pusher_starts_a_lineage_instead_of_taking_over_the_dead_worlds_attempt(
        ) -> None:
    """A trainer world restarted under the same node ids resumes at the version its dead world was pushing, with
    that world's rank-0 attempt still leased and its rank 1 already verified: the resuming begin starts a new
    lineage (the old attempt aborted), never a retry into the dead world's pending version."""
    runtime, manager = _manager(replicas=1)
    runtime.call(PsRegister(_worker("w0")))
    stale = _begin(runtime, 0, rank=0, world=2)
    other = runtime.call(PushBegin(0, 1, 2, "trainer", [TensorSpec("b", "float32", [4])], "h"))
    _seal(runtime, other, 0, "w0", rank=1)
    resumed = runtime.call(PushBegin(0, 0, 2, "trainer", SPEC, "h", True))
    assert isinstance(resumed, PushGrant) and manager.versions.lineages == 1
    assert manager.leases.get(stale.lease) is None
    pending = manager.versions.pending
    assert pending is not None and pending.version == 0 and 1 not in pending.ranks, pending



def test_the_segments_a_worker_is_known_to_hold_lose_each_shard_as_its_release_goes_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's record of the segments a worker holds (what pull grants may name) is pruned as it sends a
    release: before, every segment a worker ever committed stayed there, growing with every version. A release
    that goes unanswered prunes it all the same (nothing serves a released shard), and a shard id pruned late
    (a resend) never takes a segment name the worker reused since for a live shard."""
    monkeypatch.setattr(manager_module, "RELEASE_AGAIN_S", 0.0)
    runtime, manager = _manager(replicas=1, retain_versions=2)
    runtime.call(PsRegister(_worker("w0")))
    grants = [_push(runtime, version) for version in range(40)]
    assert manager.held["w0"] == {f"seg-{g.lease}-w0": g.lease for g in grants[-2:]}
    # Version 37's release (sent at version 39's commit) is not answered: the worker freed its segment all the
    # same (the reply was lost) and reuses its name for version 40, whose commit releases version 38.
    (_, release, on_done), = [sent for sent in runtime.sent if isinstance(sent[1], Release)][-1:]
    assert release.shards == [grants[37].lease]
    on_done(RequestTimeout("no reply from tcp://w0"))
    reused = f"seg-{grants[37].lease}-w0"
    grant = _begin(runtime, 40)
    tensors = [msgspec.structs.replace(t, checksum=1) for t in grant.tensors]
    assert runtime.call(ShardCommit(grant.lease, 40, 0, "w0", reused, tensors)).committed
    runtime.sent.clear()
    manager._expire()  # version 37's release goes again
    assert runtime.released("w0") == [grants[37].lease]
    assert manager.held["w0"] == {f"seg-{grants[39].lease}-w0": grants[39].lease, reused: grant.lease}
    assert [loc.segment for loc in runtime.call(PullBegin("reader", 40)).manifest.entries[0].locations] == [reused]



def test_a_long_run_of_failing_pushes_keeps_the_journal_compacted_and_a_restart_recovers_the_same(
        tmp_path: Path) -> None:
    """Versions 0 and 1 commit, then hundreds of pushes of version 2 fail (world 2: rank 0 done and journaled,
    rank 1's pusher gives up, which aborts the version): each leaves records, and no commit comes to compact
    them. The journal is compacted as records pile up all the same. A manager SIGKILLed right after a
    compaction that an abort made comes back with the same versions and nothing pending (the aborted rank is
    not restored); one killed with rank 0 done again comes back with it."""
    from refbus.nodes.ps.manager_journal import COMPACT_MIN_RECORDS

    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    def restart(manager: PsManager) -> tuple[_StubRuntime, PsManager]:
        manager.journal.close(remove=False)  # type: ignore[union-attr]  # SIGKILL: no shutdown hook ran
        runtime = _StubRuntime()
        again = PsManager(runtime, PsSettings(replicas=1, retain_versions=2), journal=journal())  # type: ignore[arg-type]
        assert again.versions.retained() == manager.versions.retained() == [0, 1] and again.versions.latest == 1
        assert again.versions.stored([0, 1]) == manager.versions.stored([0, 1])
        assert again.inventory.trainer_version == manager.inventory.trainer_version == 1
        assert again.versions.done_ranks() == manager.versions.done_ranks()
        return runtime, again

    runtime = _StubRuntime()
    manager = PsManager(runtime, PsSettings(replicas=1, retain_versions=2), journal=journal())  # type: ignore[arg-type]
    runtime.call(PsRegister(_worker("w0")))
    for version in (0, 1):
        _push(runtime, version)
    runtime.call(LeaseRelease(_begin(runtime, 2).lease))  # one abort record: compactions fall on aborts below
    other = [TensorSpec("b", "float32", [4])]
    most, failed = 0, 0
    store = manager.journal.store  # type: ignore[union-attr]
    while failed == 0 or store.records_since_compact > 0:
        assert failed < 2 * COMPACT_MIN_RECORDS, "no compaction without a commit"
        first = _begin(runtime, 2, rank=0, world=2)
        _seal(runtime, first, 2, "w0", rank=0)
        second = runtime.call(PushBegin(2, 1, 2, "trainer", other, "h"))
        most = max(most, store.records_since_compact)
        assert runtime.call(LeaseRelease(second.lease)).kind == "ok" and manager.versions.pending is None
        failed += 1
    assert most <= COMPACT_MIN_RECORDS and (store.path / "journal").stat().st_size < 16 * 1024
    runtime, manager = restart(manager)
    assert manager.versions.pending is None
    runtime.call(PsRegister(_worker("w0", pid=2)))
    _seal(runtime, _begin(runtime, 2, rank=0, world=2), 2, "w0", rank=0)
    runtime, manager = restart(manager)
    assert len(manager.versions.done_ranks()) == 1
    manager.journal.close(remove=True)  # type: ignore[union-attr]


def test_a_compaction_at_a_lineage_start_keeps_the_rewound_trainer_version_and_no_old_batch(tmp_path: Path) -> None:
    """A consume handed out a batch; then a trainer world resumes at 1, and the journal is compacted at that
    lineage record: the compacted journal holds the inventory rewound to 1 and no batch handed out, as the
    manager does, so a restarted manager does not hand the old lineage's batch out again."""
    from refbus.nodes.ps.manager_journal import COMPACT_MIN_RECORDS
    from refbus.protocol.messages_ps import Consume, Occupy, Reserve

    def journal() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "ps-manager", budget_bytes=0, what="ps", strict=True))

    settings = PsSettings(replicas=1, eta=0, batch_size=1)
    runtime, recorder = _StubRuntime(), journal()
    manager = PsManager(runtime, settings, journal=recorder)  # type: ignore[arg-type]
    runtime.call(PsRegister(_worker("w0")))
    for version in (0, 1, 2):
        _push(runtime, version)
    runtime.call(Reserve("p", 2))
    runtime.call(Occupy("p", "t", 2))
    consume = types.SimpleNamespace(body=Consume(), header=types.SimpleNamespace(id="c1", src="trainer"))
    assert runtime.handlers[Consume.kind](consume).ready and manager._handed_out is not None
    recorder.store.records_since_compact = COMPACT_MIN_RECORDS  # the next record makes a compaction due
    runtime.call(PushBegin(1, 0, 1, "trainer", SPEC, "h", True))
    assert recorder.store.records_since_compact == 0 and manager._handed_out is None
    recorder.close(remove=False)  # SIGKILL: its shutdown hooks never ran
    restarted = PsManager(_StubRuntime(), settings, journal=journal())  # type: ignore[arg-type]
    assert restarted.inventory.trainer_version == manager.inventory.trainer_version == 1
    assert restarted._handed_out is None and restarted.versions.retained() == manager.versions.retained() == []
    restarted.journal.close(remove=True)  # type: ignore[union-attr]


def test_time_the_manager_did_not_run_counts_toward_no_leases_life(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager whose loop did not run for longer than a lease's TTL (stopped, swapped out, starved) expired every
    lease on waking, before the renewals waiting in its sockets were read: a soak that paused a run's processes
    for 4-10 s had a rank's push aborted under it, and the rank fail. The stall now moves every lease's deadline
    and the pending push's start; time after the wake-up counts as ever."""
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(manager_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    runtime, manager = _manager(replicas=1, lease_ttl_s=1.0, push_timeout_s=2.0)
    manager.passes = manager_module.PassStalls(manager.passes.period_s, lambda: clock.now)
    runtime.call(PsRegister(_worker("w0")))
    grant = _begin(runtime, 0)
    clock.now += 5.0  # no pass ran: past the TTL and the push timeout
    manager._expire()
    assert manager.leases.get(grant.lease) is not None and manager.versions.pending is not None
    assert manager.passes.stalled_s == pytest.approx(5.0 - manager.passes.period_s)
    for _ in range(int(1.0 / manager.passes.period_s) + 1):  # a TTL of running passes, no renewal: it expires
        clock.now += manager.passes.period_s
        manager._expire()
    assert manager.leases.get(grant.lease) is None and manager.leases.ended(grant.lease) == "expired"
