"""A ps-worker never spends a long loop turn on one shard: a seal hashes the segment a slice a turn, and a
broadcast init's segment is made (``posix_fallocate``) a slice a turn, so heartbeats and requests are served
in between however large the shard. Meanwhile the shard is not readable and takes no write; a release (or the
unclaimed timeout) stops the slicing and frees what it made; a worker killed in the middle leaves nothing that
a restarted one keeps, and the manager sees the copy gone.

Run as a script, this module is the worker killed mid-seal (``python test_ps_sliced.py DIRECTORY``) or while
it makes a push's segment (``python test_ps_sliced.py open PREFIX``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from polling import read_line, wait_for
from ps_support import segment_file, segments, start_cluster
from refbus.bus.reqrep import HandlerError, RemoteError, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.ps.client import PsClient, PushSession
from refbus.nodes.ps.shm import ALLOCATE_SLICE_BYTES, segment_bytes
from refbus.nodes.ps.worker import PsWorker
from refbus.nodes.settings import PsSettings
from refbus.protocol.codec import HASH_SLICE_BYTES, checksum
from refbus.protocol.messages import Error, Ok
from refbus.protocol.messages_ps import (
    InitHeader,
    InitPlan,
    PushGrant,
    Release,
    ShardOpen,
    ShardOpened,
    ShardSeal,
    ShardTensor,
    ShardWrite,
    WorkerInfo,
)

HERE = Path(__file__).resolve()
SEAL_BYTES = 2 * HASH_SLICE_BYTES + 1  # three slices: hashed over three loop turns


def _worker(directory: Path, node_id: str, prefix: str) -> tuple[NodeRuntime, PsWorker]:
    """A ps-worker whose handlers and timers the test calls itself (its loop does not run), registered with
    ``ps-manager``; close the runtime when done."""
    runtime = NodeRuntime("ps-worker", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id=node_id, metrics_port=-1),
                          register=False)
    settings = PsSettings(manager="tcp://127.0.0.1:9", worker="tcp://127.0.0.1:0", shm_dir=str(directory),
                          shm_prefix=prefix, pin_memory=False)
    worker = PsWorker(runtime, settings)
    worker._manager_id = "ps-manager"  # as its registration would have set it
    return runtime, worker


def _handle(handler: Callable[[Any], Any], body: Any, src: str) -> Any:
    return handler(types.SimpleNamespace(body=body, header=types.SimpleNamespace(id="r", v=(2, 2), src=src)))


def _turn(runtime: NodeRuntime) -> None:
    """One loop turn's timers: those due now, what the worker asked ``later`` for until now (not what they ask
    for)."""
    runtime._run_timers()


def _seal_begun(worker: PsWorker, lease: str) -> tuple[ShardSeal, list[Any]]:
    """Open ``lease``, write SEAL_BYTES into it through the mapping (as a same-host pusher does) and send its seal;
    returns the seal and the list the answers to pushers land in."""
    opened = _handle(worker._open, ShardOpen(lease, SEAL_BYTES), "pusher")
    data = np.frombuffer(worker.pool.get(opened.segment).view(0, SEAL_BYTES), np.uint8)
    data[:] = np.arange(SEAL_BYTES, dtype=np.uint64).astype(np.uint8)
    seal = ShardSeal(lease, 0, 0, [ShardTensor("t", "uint8", [SEAL_BYTES], 0, SEAL_BYTES, checksum(data))])
    answers: list[Any] = []
    worker.server.answer = lambda pending, body: answers.append(body)  # type: ignore[method-assign]
    assert _handle(worker._seal, seal, "pusher") is None
    return seal, answers


def test_a_seal_hashes_a_slice_a_loop_turn_and_the_shard_is_neither_written_nor_read_meanwhile(
        tmp_path: Path) -> None:
    """A seal of three hash slices: after the turn that took it, no commit has gone to the manager, the shard is
    not sealed (not readable) and takes no write; two more turns verify it and commit. A release between two
    turns stops the hashing: the pusher is answered ``released``, the segment is free, no commit ever goes."""
    runtime, worker = _worker(tmp_path, "w0", "seal")
    try:
        _seal_begun(worker, "push-a")
        assert runtime.calls.in_flight(worker.settings.manager) == 0 and "push-a" not in worker.sealed
        with pytest.raises(HandlerError) as err:
            _handle(worker._write, ShardWrite("push-a", [0], [np.zeros(8, np.uint8)]), "pusher")
        assert err.value.code == "sealed" and "being sealed" in str(err.value)
        _turn(runtime)
        assert runtime.calls.in_flight(worker.settings.manager) == 0
        _turn(runtime)
        assert runtime.calls.in_flight(worker.settings.manager) == 1 and "push-a" in worker.sealed  # the commit

        _, answers = _seal_begun(worker, "push-b")
        _turn(runtime)
        _handle(worker._release, Release(["push-b"]), "ps-manager")
        assert len(answers) == 1 and isinstance(answers[0], Error) and answers[0].code == "released"
        assert "push-b" not in worker.shards and worker.pool.in_use_bytes == worker.shards["push-a"].capacity
        _turn(runtime)
        _turn(runtime)
        assert runtime.calls.in_flight(worker.settings.manager) == 1 and "push-b" not in worker.sealed  # no commit
    finally:
        runtime.close()


def test_an_init_segment_is_made_a_slice_a_loop_turn_and_a_release_meanwhile_removes_it(tmp_path: Path) -> None:
    """The segment of a planned init three allocation slices long: the header is answered only once the last
    slice is made (the parent sends chunks only then); a release while it is made answers the header
    ``released`` and removes the file, and nothing of it stays in the pool."""
    runtime, worker = _worker(tmp_path, "w1", "make")
    try:
        answers: list[Any] = []
        worker.server.answer = lambda pending, body: answers.append(body)  # type: ignore[method-assign]
        tree = [WorkerInfo("w0", "tcp://127.0.0.1:9", "here", str(tmp_path)), worker.info()]
        nbytes = 2 * ALLOCATE_SLICE_BYTES + 1
        for init_id in ("init-a", "init-b"):
            _handle(worker._plan, InitPlan(init_id, "/nonexistent", tree, 64, 5.0), "ps-manager")
            assert _handle(worker._header, InitHeader(init_id, tree, 5.0, nbytes, []), "w0") is None
            _turn(runtime)
            assert answers == [] and init_id not in worker.shards and worker.pool.in_use_bytes == 0
            made = [p for p in tmp_path.iterdir() if p.name.startswith("make.") and p.suffix not in (".nonce", ".lock")]
            assert [p.stat().st_size for p in made] == [2 * ALLOCATE_SLICE_BYTES]  # two slices of three
            if init_id == "init-a":
                _handle(worker._release, Release([init_id]), "ps-manager")
                assert len(answers) == 1 and isinstance(answers[0], Error) and answers[0].code == "released"
                assert not made[0].exists()
                answers.clear()
        _turn(runtime)  # init-a's step, if it were still made, would run here too
        assert answers == [Ok()] and worker.shards["init-b"].capacity == segment_bytes(nbytes)
        assert worker.pool.in_use_bytes == segment_bytes(nbytes) and worker.pool.free_bytes == 0
    finally:
        runtime.close()


OPEN_BYTES = 2 * ALLOCATE_SLICE_BYTES + 1  # three allocation slices: made over three loop turns


def _made(directory: Path, prefix: str) -> list[Path]:
    """The segment files of ``prefix`` in ``directory``, whole or being made."""
    return [p for p in directory.iterdir() if p.name.startswith(f"{prefix}.") and p.suffix not in (".nonce", ".lock")]


def test_a_push_open_is_made_a_slice_a_loop_turn_answered_once_made_and_a_release_meanwhile_removes_it(
        tmp_path: Path) -> None:
    """A ps-shard-open of three allocation slices is answered only once the last slice is made, its bytes
    counted against ``ps.max_open_bytes`` from the start; the pusher's retry meanwhile joins it (one segment,
    both answered). A release while it is made answers the pusher ``released`` and removes the file, and a later
    open of that lease is refused ``released``."""
    runtime, worker = _worker(tmp_path, "w0", "open")
    try:
        answers: list[Any] = []
        worker.server.answer = lambda pending, body: answers.append(body)  # type: ignore[method-assign]
        worker.max_open_bytes = segment_bytes(OPEN_BYTES) + 4096
        assert _handle(worker._open, ShardOpen("push-a", OPEN_BYTES), "pusher") is None
        assert [p.stat().st_size for p in _made(tmp_path, "open")] == [ALLOCATE_SLICE_BYTES]
        with pytest.raises(HandlerError) as err:  # the open being made holds its bytes already
            _handle(worker._open, ShardOpen("push-other", 8192), "pusher")
        assert err.value.code == "open-limit"
        _turn(runtime)
        assert answers == [] and "push-a" not in worker.shards and worker.pool.in_use_bytes == 0
        assert [p.stat().st_size for p in _made(tmp_path, "open")] == [2 * ALLOCATE_SLICE_BYTES]
        assert _handle(worker._open, ShardOpen("push-a", OPEN_BYTES), "pusher") is None  # a retry joins it
        _turn(runtime)
        segment = worker.shards["push-a"]
        assert answers == [ShardOpened(segment.name, segment_bytes(OPEN_BYTES))] * 2
        assert [p.name for p in _made(tmp_path, "open")] == [segment.name]

        answers.clear()
        worker.max_open_bytes = 4 * segment_bytes(OPEN_BYTES)
        assert _handle(worker._open, ShardOpen("push-b", OPEN_BYTES), "pusher") is None
        _turn(runtime)
        _handle(worker._release, Release(["push-b"]), "ps-manager")
        assert len(answers) == 1 and isinstance(answers[0], Error) and answers[0].code == "released"
        assert [p.name for p in _made(tmp_path, "open")] == [segment.name]
        _turn(runtime)  # push-b's step, if it were still made, would run here
        assert len(answers) == 1 and "push-b" not in worker.shards
        assert worker.pool.in_use_bytes == segment.capacity and worker.pool.free_bytes == 0
        with pytest.raises(HandlerError) as err:
            _handle(worker._open, ShardOpen("push-b", OPEN_BYTES), "pusher")
        assert err.value.code == "released"
    finally:
        runtime.close()


def test_an_open_finds_no_room_that_a_segment_still_being_made_will_take(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The room an open checks for is the filesystem's free bytes less what the segments still being made will
    take: a second open that fits only in bytes the first one's later slices need is refused ``no-room`` up front,
    and the first is made whole. Before, both were admitted and their interleaved slices failed the earlier one
    midway (``no-room`` after its pusher had waited), though it fit on its own."""
    total = segment_bytes(OPEN_BYTES) + ALLOCATE_SLICE_BYTES

    def statvfs(path: Any) -> Any:  # a filesystem of ``total`` bytes, less what the files in it take
        used = sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
        return types.SimpleNamespace(f_bavail=total - used, f_frsize=1)

    runtime, worker = _worker(tmp_path, "w0", "room")
    monkeypatch.setattr("refbus.nodes.ps.worker.os.statvfs", statvfs)
    try:
        answers: list[Any] = []
        worker.server.answer = lambda pending, body: answers.append(body)  # type: ignore[method-assign]
        assert _handle(worker._open, ShardOpen("push-a", OPEN_BYTES), "pusher") is None  # one slice of three made
        with pytest.raises(HandlerError) as err:  # free now: two slices and a page; push-a needs a slice and a page
            _handle(worker._open, ShardOpen("push-b", 2 * ALLOCATE_SLICE_BYTES), "pusher")
        assert err.value.code == "no-room" and "promised" in str(err.value)
        for _ in range(2):
            _turn(runtime)
        segment = worker.shards["push-a"]
        assert answers == [ShardOpened(segment.name, segment_bytes(OPEN_BYTES))]
    finally:
        runtime.close()


def test_a_pusher_waits_for_a_segment_made_past_its_request_retry_schedule() -> None:
    """A ps-shard-open is answered once the worker made the segment, about 0.25 s/GiB: the pusher sends it again
    (joining the open in progress) until its request retry schedule plus ``ALLOCATE_ALLOWANCE_S_PER_GIB`` a GiB
    has passed, where it gave the worker up (and asked for another) at the end of the schedule alone."""
    worker_runtime = NodeRuntime("ps-worker", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id="w0",
                                                              metrics_port=-1), register=False)
    server = worker_runtime.serve("ps", "tcp://127.0.0.1:0")
    sent: list[str] = []

    def making(request: Any) -> ShardOpened | None:  # the segment is made by the open's third send
        sent.append(request.header.id)
        return ShardOpened("seg", request.body.nbytes) if len(sent) == 3 else None

    server.on(ShardOpen.kind, making, cached=False)
    schedule = RetryPolicy(timeout_s=0.05, attempts=2, backoff=1.0)  # a request given up after 0.1 s
    runtime = NodeRuntime("trainer", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id="t", metrics_port=-1,
                                                     retry=schedule), register=False)
    ps = PsClient(runtime, "tcp://127.0.0.1:1", transport="frames")
    grant = PushGrant("push-l", 10.0, WorkerInfo("w0", worker_runtime.endpoints["ps"], "h", "/none"), 1 << 30, [])
    loop = threading.Thread(target=worker_runtime.loop)
    loop.start()
    try:
        session = PushSession(ps, grant, 0, 0, 1)
        session._open_copies()  # an allowance of ALLOCATE_ALLOWANCE_S_PER_GIB for the GiB
        assert [copy.info.worker for copy in session._copies] == ["w0"]
        assert len(sent) == 3 and len(set(sent)) == 1  # one request, sent again
    finally:
        worker_runtime.stop()
        loop.join(10)
        worker_runtime.close()
        ps.close()
        runtime.close()


def _open_victim(prefix: str) -> None:
    """A worker in /dev/shm that begins the open of a shard three allocation slices long (its first slice made,
    two to go), says ``making`` and waits to be killed."""
    _, worker = _worker(Path("/dev/shm"), "w0", prefix)
    assert _handle(worker._open, ShardOpen("push-k", OPEN_BYTES), "pusher") is None
    print("making", flush=True)
    sys.stdin.read()


def _sigkill_once(args: list[str], says: str) -> None:
    """Run this module as a script with ``args`` (a worker stopped midway), and SIGKILL it once it ``says`` so."""
    victim = subprocess.Popen([sys.executable, str(HERE), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              bufsize=0)
    try:
        assert read_line(victim, 30) == says
    finally:
        victim.kill()
        victim.wait(10)


def test_a_worker_killed_while_making_a_push_segment_leaves_nothing_in_dev_shm_after_a_restart() -> None:
    """A worker SIGKILLed while a push's segment is made leaves the partial file; the next worker's start under
    that prefix removes it, and nothing of the prefix is left in /dev/shm once that one closes."""
    free = shutil.disk_usage("/dev/shm").free
    if free < 2 * OPEN_BYTES:
        pytest.skip(f"/dev/shm has {free >> 20} MiB free, under twice the {OPEN_BYTES >> 20} MiB shard")
    prefix = f"open-victim-{os.getpid()}"
    try:  # whatever the victim got to make is removed, even when it did not stop where the test expects
        _sigkill_once(["open", prefix], "making")
        assert [p.stat().st_size for p in _made(Path("/dev/shm"), prefix)] == [ALLOCATE_SLICE_BYTES]
        runtime, _ = _worker(Path("/dev/shm"), "w0", prefix)
        try:
            assert segments(prefix) == []  # its start swept what the killed process was making
        finally:
            runtime.close()
        assert sorted(Path("/dev/shm").glob(f"{prefix}.*")) == []  # its own lock and nonce files too
    finally:
        for left in Path("/dev/shm").glob(f"{prefix}.*"):
            left.unlink(missing_ok=True)


def _victim(directory: str) -> None:
    """A worker that begins a seal (its first hash slice taken, two to go), says ``hashing`` and waits to be
    killed."""
    runtime, worker = _worker(Path(directory), "w0", "victim")
    _seal_begun(worker, "push-k")
    assert runtime.calls.in_flight(worker.settings.manager) == 0  # nothing committed: the manager knows no copy
    print("hashing", flush=True)
    sys.stdin.read()


def test_a_worker_killed_mid_seal_leaves_nothing_a_restarted_one_keeps(tmp_path: Path) -> None:
    """A worker SIGKILLed with its seal half hashed has told the manager nothing (no commit goes before the
    seal is verified: the manager never lists that copy, and the pusher's push fails over as for any dead
    worker); the segment file it left is removed by the next worker's start."""
    _sigkill_once([str(tmp_path)], "hashing")
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("victim.")]
    assert any(p.stat().st_size == segment_bytes(SEAL_BYTES) for p in tmp_path.iterdir()), left
    runtime, worker = _worker(tmp_path, "w0", "victim")
    try:
        kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("victim."))
        assert kept == sorted([worker.host_proof.path.name, f"victim.{worker.pool.token}.lock"]), kept
    finally:
        runtime.close()


LARGE_INIT_BYTES = 8 * ALLOCATE_SLICE_BYTES  # eight slices: half a second or more of allocation


def test_a_worker_killed_while_making_an_init_segment_fails_the_init_and_a_restarted_one_leaks_nothing(
        bus, spawn, tmp_path: Path) -> None:
    """The root of an init over one worker is SIGKILLed while its segment is made (the file is there, not whole
    yet): the manager fails the init naming it, and the worker started again under its id leaves no segment in
    the directory and serves on."""
    free = shutil.disk_usage("/dev/shm").free
    if free < 2 * LARGE_INIT_BYTES:
        pytest.skip(f"/dev/shm has {free >> 20} MiB free, under twice the {LARGE_INIT_BYTES >> 20} MiB checkpoint")
    header = json.dumps({"t": {"dtype": "U8", "shape": [LARGE_INIT_BYTES], "data_offsets": [0, LARGE_INIT_BYTES]}})
    header += " " * (-len(header) % 8)
    path = tmp_path / "large.safetensors"
    with open(path, "wb") as f:  # sparse: zeros, no disk
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + LARGE_INIT_BYTES)
    _, control = bus
    cluster = start_cluster(spawn, control, "sliced-kill", workers=1)
    runtime, ps = cluster.client()
    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ps.init(str(path), workers=["w0"], timeout_s=60)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    def partial() -> bool:
        sizes = [segment_file(name).stat().st_size for name in segments(cluster.prefix)]
        return any(0 < size < LARGE_INIT_BYTES for size in sizes)

    runner = threading.Thread(target=init)
    try:
        runner.start()
        wait_for(partial, 30, "the segment being made", poll_s=0.001)
        cluster.workers["w0"].signal(signal.SIGKILL)
        cluster.workers["w0"].proc.wait(10)
        runner.join(60)
        assert not runner.is_alive() and isinstance(outcome[0], RemoteError), outcome
        assert outcome[0].code == "init-failed" and "'w0'" in str(outcome[0]) and "went down" in str(outcome[0])
        new = spawn(["node", "ps-worker", "--node-id", "w0", "--ps-manager", cluster.manager, *cluster.flags], "w0")
        cluster.worker_info["w0"] = new.wait_ready()
        cluster.workers["w0"] = new
        assert segments(cluster.prefix) == []  # its start swept what the killed process was making
        assert [w.pid for w in ps.status().workers] == [new.pid]
    finally:
        runner.join(60)
        runtime.close()
        for proc in [*cluster.workers.values(), cluster.manager_proc]:
            assert proc is not None
            proc.stop()
    assert segments(cluster.prefix) == []


if __name__ == "__main__":
    if sys.argv[1] == "open":
        _open_victim(sys.argv[2])
    else:
        _victim(sys.argv[1])
