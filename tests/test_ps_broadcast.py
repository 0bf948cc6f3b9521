"""Broadcast init from a safetensors checkpoint across real ps-worker processes.

One cluster of 8 workers serves every N in {1, 2, 3, 5, 8} (an init names the workers it loads); every
worker reports how often it opened the file, and the test hashes every worker's copy itself. A separate
cluster loses an interior worker of the tree, which must fail the init loudly, by name, without hanging.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from polling import holds_for, wait_for
from ps_support import (
    LEASE_TTL_S,
    PsCluster,
    make_state,
    restart_manager,
    restart_worker,
    segment_file,
    segments,
    start_cluster,
)
from refbus.bus.reqrep import HandlerError, RemoteError
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import start_bus
from refbus.nodes.ps.broadcast import WINDOW, Relay, children, parent, rounds
from refbus.nodes.ps.client import INIT_ASK_EVERY_S, PsClient
from refbus.nodes.ps.shm import allocation_allowance_s, sweep_orphans
from refbus.nodes.ps.worker import PsWorker
from refbus.nodes.settings import PsSettings
from refbus.protocol.codec import checksum
from refbus.protocol.envelope import Message
from refbus.protocol.messages import NodeDown, NodeInfo, Ok
from refbus.protocol.messages_ps import (
    InitChunk,
    InitDone,
    InitEnd,
    InitFailed,
    InitHeader,
    InitPlan,
    Release,
    ShardOpen,
    WorkerInfo,
)
from safetensors.torch import save_file
from test_liveness import START_S, Observer

CHUNK = ["--ps-chunk-bytes", "4096"]  # many chunks even for a small checkpoint: the stream is pipelined


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = make_state(seed=11, tensors=16, scale=8)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path, state


def _stop(cluster: PsCluster) -> None:
    for proc in [*cluster.workers.values(), cluster.manager_proc]:
        assert proc is not None
        proc.stop()


def test_broadcast_init_over_1_2_3_5_8_workers(bus, spawn, checkpoint) -> None:
    path, state = checkpoint
    _, control = bus
    cluster = start_cluster(spawn, control, "bcast", workers=8, extra=CHUNK)
    runtime, ps = cluster.client()
    try:
        for n in (1, 2, 3, 5, 8):
            names = [f"w{i}" for i in range(n)]
            result = ps.init(str(path), workers=names, timeout_s=30)
            assert result.workers == names and result.rounds == math.ceil(math.log2(n))
            assert sum(result.file_opens.values()) == 1 and result.file_opens["w0"] == 1  # only the root read it
            manifest = ps.manifest(result.version)
            assert manifest.digest == result.digest
            for entry in manifest.entries:
                assert sorted(loc.worker for loc in entry.locations) == sorted(names)
                want = checksum(state[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy())
                assert entry.checksum == want, entry.name
                for loc in entry.locations:  # every worker's own copy, read from its segment
                    with open(segment_file(loc.segment), "rb") as f:
                        f.seek(loc.offset)
                        assert checksum(f.read(entry.nbytes)) == want, (entry.name, loc.worker)
            pulled = ps.pull(result.version, verify=True)
            assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert ps.status().retained == [3, 4]  # inits are versions too, retained like pushes
    finally:
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []


def test_a_dead_interior_worker_fails_init_by_name(bus, spawn, checkpoint) -> None:
    path, _ = checkpoint
    _, control = bus
    # The init starts at once, before the broker declares w1 down: the manager still believes w1 alive, so
    # the tree itself must notice.
    cluster = start_cluster(spawn, control, "bdead", workers=4, extra=[*CHUNK, "--ps-ack-timeout-s", "3.0"])
    runtime, ps = cluster.client()
    try:
        victim = cluster.workers["w1"]  # rank 1 of 4 relays to rank 3
        assert children(1, 4) == [3]
        victim.proc.kill()
        victim.proc.wait(10)
        with pytest.raises(RemoteError) as err:
            ps.init(str(path), timeout_s=30)
        message = str(err.value)
        assert err.value.code == "init-failed" and "'w1'" in message and "rank 1" in message
        # Ended by w1's missing acknowledgement or its node-down, never by the 30 s init timeout (whose failure
        # names the workers that "did not finish before the init timeout").
        assert "init timeout" not in message, message
        # The survivors' partial copies are released, and the failed init committed nothing.
        assert ps.status().latest == -1
        wait_for(lambda: all(cluster.held(w) == 0 for w in ("w0", "w2", "w3")), 10, "partial copies to be freed")
    finally:
        runtime.close()
        _stop(cluster)
    # The victim never allocated a segment: its host-proof nonce file is all the sweep finds.
    assert [n for n in sweep_orphans("/dev/shm", cluster.prefix) if not n.endswith(".nonce")] == []
    assert segments(cluster.prefix) == []


@pytest.mark.parametrize("n", range(1, 40))
def test_tree_reaches_every_worker_once_in_ceil_log2_rounds(n: int) -> None:
    received = {0: 0}  # rank -> round it receives in
    for rank in range(n):
        for k, child in enumerate(children(rank, n)):
            assert child not in received and parent(child) == rank
            received[child] = rank.bit_length() + k + 1
    assert sorted(received) == list(range(n))
    assert max(received.values()) == rounds(n) == (math.ceil(math.log2(n)) if n > 1 else 0)


class _Memory:
    """A segment stand-in for a relay driven by hand: a bytearray with ``view`` and ``name``."""

    def __init__(self, nbytes: int) -> None:
        self.name = "mem"
        self.data = bytearray(nbytes)

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        end = len(self.data) if nbytes is None else offset + nbytes
        if offset < 0 or end > len(self.data) or end < offset:
            raise ValueError(f"bytes [{offset}, {end}) are outside the segment")
        return memoryview(self.data)[offset:end]


class _Turns:
    """A node loop's ``later`` for a relay driven by hand: callbacks wait until :meth:`run` runs them, each in a
    turn of its own, until none is left."""

    def __init__(self) -> None:
        self.waiting: list[Callable[[], None]] = []
        self.turns = 0

    def later(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.waiting.append(callback)

    def run(self) -> None:
        while self.waiting:
            self.turns += 1
            self.waiting.pop(0)()


def _run_timers(runtime: NodeRuntime) -> None:
    """Run ``runtime``'s timers (its loop not running) until none is due: what a relay asked ``later`` for."""
    while runtime._timers and runtime._timers[0].due <= time.monotonic():
        runtime._run_timers()


def _tree(n: int) -> list[WorkerInfo]:
    return [WorkerInfo(f"w{i}", f"tcp://127.0.0.1:{9000 + i}", "here", "/dev/shm") for i in range(n)]


def test_a_relay_keeps_at_most_a_window_of_chunks_in_flight_per_child_and_reads_only_as_far(checkpoint) -> None:
    """The root of 4 (children w1, w2) with 64-byte chunks: nothing acknowledged, each child has WINDOW chunks
    and the file is read no further; each acknowledgement lets exactly one more chunk go to that child; a
    stuck child does not hold back the other; every child gets every chunk once, in order, then the end. The
    root reports its own copy done at the end of the file, whatever its children got (each worker reports
    for itself)."""
    path, state = checkpoint
    sent: list[tuple[str, Any, Callable[[Any], None]]] = []
    reports: list[Any] = []
    memory: dict[str, _Memory] = {}

    def acquire(shard: str, nbytes: int, then: Callable[[_Memory], None]) -> None:
        then(memory.setdefault(shard, _Memory(nbytes)))

    turns = _Turns()
    relay = Relay("init-1", "w0", acquire=acquire,  # type: ignore[arg-type]
                  send=lambda peer, body, deadline_s, on_done: sent.append((peer.worker, body, on_done)),
                  report=reports.append, later=turns.later)
    chunk = 64
    relay.stream_from(InitPlan("init-1", str(path), _tree(4), chunk, 5.0))
    turns.run()

    def chunks_to(worker: str) -> list[Any]:
        return [(body, done) for to, body, done in sent if to == worker and isinstance(body, InitChunk)]

    # Nothing but the header goes to a child until it acknowledges it (its segment is made by then).
    assert [(to, type(body)) for to, body, _ in sent] == [("w1", InitHeader), ("w2", InitHeader)]
    assert relay._read == chunk
    ok = Message(kind="ok", header=None, body=Ok())  # type: ignore[arg-type]  # only its type is looked at
    for _, _, done in list(sent):
        done(ok)
        turns.run()
    assert len(chunks_to("w1")) == len(chunks_to("w2")) == WINDOW
    assert relay._read == WINDOW * chunk  # read only as far as the children take
    acked: set[int] = set()

    def acknowledge(worker: str) -> None:
        for i, (to, body, done) in enumerate(sent):  # grows as acknowledgements send more
            if to == worker and isinstance(body, InitChunk) and i not in acked:
                acked.add(i)
                done(ok)
                turns.run()

    chunks_to("w1")[0][1](ok)
    turns.run()
    acked.add(next(i for i, (to, body, _) in enumerate(sent) if to == "w1" and isinstance(body, InitChunk)))
    assert len(chunks_to("w1")) == WINDOW + 1 and len(chunks_to("w2")) == WINDOW
    acknowledge("w1")  # w1 takes everything as it comes while w2 is stuck: the root reads for w1
    assert relay._read == len(memory["init-1"].data) and len(chunks_to("w2")) == WINDOW
    assert not any(isinstance(body, InitEnd) for to, body, _ in sent if to == "w2")
    acknowledge("w2")  # w2 catches up from the segment
    nbytes = len(memory["init-1"].data)
    for worker in ("w1", "w2"):
        messages = [body for to, body, _ in sent if to == worker]
        offsets = [body.offset for body in messages if isinstance(body, InitChunk)]
        assert offsets == list(range(0, nbytes, chunk))  # every chunk once, in order
        assert isinstance(messages[0], InitHeader) and isinstance(messages[-1], InitEnd)
    assert isinstance(reports[0], InitDone) and reports[0].file_opens == 1 and relay._file is None
    want = {name: checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in state.items()}
    assert {t.name: t.checksum for t in reports[0].tensors} == want


def test_a_relay_refuses_a_chunk_before_its_header_or_outside_its_segment_and_holds_nothing() -> None:
    sent: list[Any] = []
    answers: list[Any] = []
    acknowledge: list[Callable[[Any], None]] = []

    def send(peer: WorkerInfo, body: Any, deadline_s: float, on_done: Callable[[Any], None]) -> None:
        sent.append(body)
        acknowledge.append(on_done)

    relay = Relay("init-2", "w1", acquire=lambda shard, nbytes, then: then(_Memory(nbytes)),  # type: ignore[arg-type]
                  send=send, report=sent.append, later=_Turns().later)
    with pytest.raises(ValueError, match="chunk before header"):
        relay.on_chunk(InitChunk("init-2", 0, np.zeros(8, np.uint8)))
    relay.on_header(InitHeader("init-2", _tree(4), 5.0, 100, []), answers.append)  # w1 relays to w3
    assert [type(body) for body in sent] == [InitHeader] and answers == [Ok()]
    acknowledge[0](Message(kind="ok", header=None, body=Ok()))  # type: ignore[arg-type]
    for offset, size in ((96, 8), (1 << 40, 1)):
        with pytest.raises(ValueError, match="outside the segment"):
            relay.on_chunk(InitChunk("init-2", offset, np.full(size, 7, np.uint8)))
    assert relay._chunks == [] and [type(body) for body in sent] == [InitHeader]  # nothing held or passed on
    relay.on_chunk(InitChunk("init-2", 0, np.full(100, 7, np.uint8)))  # still serves a good chunk
    assert [type(body) for body in sent] == [InitHeader, InitChunk]


def _init_in_background(ps: PsClient, path: Path, workers: list[str],
                        timeout_s: float) -> tuple[threading.Thread, list[BaseException | None]]:
    """``ps.init`` on a started thread, as an init over a stalled worker blocks: the thread, and the list its
    outcome lands in (``None``: it succeeded). The caller joins the thread."""
    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ps.init(str(path), workers=workers, timeout_s=timeout_s)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=init)
    runner.start()
    return runner, outcome


def _stalled_on(cluster: PsCluster, ps: PsClient, path: Path, workers: list[str], victim: str,
                timeout_s: float) -> tuple[threading.Thread, list[BaseException | None]]:
    """An init over ``workers`` (see :func:`_init_in_background`) whose stream stalls on ``victim``, a worker below
    the root: the root is stopped until the victim has taken the manager's plan (the root's plan goes last), then
    the victim is stopped and the root goes on."""
    root, stalled = cluster.workers[workers[0]], cluster.workers[victim]
    root.proc.send_signal(signal.SIGSTOP)
    try:
        started = _init_in_background(ps, path, workers, timeout_s)
        wait_for(lambda: "ps.init_planned" in stalled.log_tail(400), 10, f"{victim} to take its plan")
        stalled.proc.send_signal(signal.SIGSTOP)
    finally:
        root.proc.send_signal(signal.SIGCONT)
    return started


def test_a_worker_killed_mid_stream_fails_the_init_by_name_and_the_rest_serve_the_next(bus, spawn,
                                                                                     checkpoint) -> None:
    """w3 (a leaf under w1) is stopped once it took its plan, so the stream stalls on it with its header in flight,
    then SIGKILLed once the others hold their copies: the init fails naming w3, the survivors free their
    partial copies and a broadcast over them succeeds."""
    path, state = checkpoint
    _, control = bus
    cluster = start_cluster(spawn, control, "bkill", workers=4, extra=[*CHUNK, "--ps-ack-timeout-s", "5.0"])
    runtime, ps = cluster.client()
    victim = cluster.workers["w3"]
    runner = None
    try:
        runner, outcome = _stalled_on(cluster, ps, path, ["w0", "w1", "w2", "w3"], "w3", 30)
        wait_for(lambda: all(cluster.held(w) > 0 for w in ("w0", "w1", "w2")), 10, "the others to hold copies")
        victim.proc.kill()
        victim.proc.wait(10)
        runner.join(30)
        assert not runner.is_alive() and isinstance(outcome[0], RemoteError), outcome
        assert outcome[0].code == "init-failed" and "'w3'" in str(outcome[0])
        wait_for(lambda: all(cluster.held(w) == 0 for w in ("w0", "w1", "w2")), 10, "partial copies to be freed")
        result = ps.init(str(path), workers=["w0", "w1", "w2"], timeout_s=30)
        pulled = ps.pull(result.version, verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
    finally:
        if runner is not None:  # a failure above may leave the init waiting on the stopped w3: end it first
            victim.proc.kill()
            runner.join(30)
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []


def test_only_the_manager_sends_plans_and_a_checkpoint_that_is_not_a_file_fails_the_init(bus, spawn, checkpoint,
                                                                                          tmp_path: Path) -> None:
    """A plan makes its root open the path it names. Any peer could send one (it was answered ``ok``), and a FIFO
    there blocked the worker's loop in ``open`` for good: alive, answering nothing. Now only the manager the
    worker registered with is heard, and a path that is not a regular file fails the init at once, by name."""
    path, state = checkpoint
    _, control = bus
    cluster = start_cluster(spawn, control, "bplan", workers=1, extra=CHUNK)
    runtime, ps = cluster.client()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    me = WorkerInfo(worker="w0", endpoint=cluster.worker_info["w0"]["endpoints"]["ps"], host="h", shm_dir="/none")
    try:
        with pytest.raises(RemoteError) as refused:
            runtime.client(me.endpoint).request(InitPlan("forged", str(fifo), [me], 4096, 5.0))
        assert refused.value.code == "not-manager" and "'test-client'" in str(refused.value)
        with pytest.raises(RemoteError) as failed:
            ps.init(str(fifo), timeout_s=30)
        assert failed.value.code == "init-failed" and f"{fifo}" in str(failed.value), failed.value
        assert "not a regular file" in str(failed.value) and "init timeout" not in str(failed.value)
        result = ps.init(str(path), timeout_s=30)  # the worker serves on
        pulled = ps.pull(result.version, verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
    finally:
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []


def test_an_init_the_manager_ran_when_it_was_killed_is_refused_by_its_restarted_process(bus, spawn,
                                                                                      checkpoint) -> None:
    """w3 (a leaf under w1) is stopped once it took its plan, so the init over w0..w3 stalls; the manager is
    SIGKILLed and restarted. The client's request, sent again, reaches the new process, which knows no such init
    and refuses it naming w3 (not registered again: stopped); the copies the dead init left are released; an init
    over the others then succeeds."""
    path, state = checkpoint
    _, control = bus
    cluster = start_cluster(spawn, control, "binit-restart", workers=4,
                            extra=[*CHUNK, "--ps-ack-timeout-s", "60.0"])  # the stalled stream never fails by itself
    runtime, ps = cluster.client()
    victim = cluster.workers["w3"]
    runner = None
    try:
        runner, outcome = _stalled_on(cluster, ps, path, ["w0", "w1", "w2", "w3"], "w3", 60)
        wait_for(lambda: all(cluster.held(w) > 0 for w in ("w0", "w1", "w2")), 10, "the others to hold copies")
        assert cluster.manager_proc is not None
        cluster.manager_proc.signal(signal.SIGKILL)
        cluster.manager_proc.proc.wait(10)
        restart_manager(spawn, cluster)
        runner.join(3 * INIT_ASK_EVERY_S)  # the next resend reaches the new process
        assert not runner.is_alive() and isinstance(outcome[0], RemoteError), outcome
        assert outcome[0].code == "unknown-worker" and "'w3'" in str(outcome[0])
        # The dead init's copies are released by the new manager (once a lease TTL passed since its start).
        wait_for(lambda: all(cluster.held(w) == 0 for w in ("w0", "w1", "w2")), 10 * LEASE_TTL_S,
                 "the dead init's copies to be freed")
        result = ps.init(str(path), workers=["w0", "w1", "w2"], timeout_s=30)
        pulled = ps.pull(result.version, verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
    finally:
        victim.proc.kill()
        victim.proc.wait(10)
        if runner is not None:
            runner.join(30)
        runtime.close()
        _stop(cluster)


def test_a_root_that_cannot_read_the_checkpoint_reports_it_at_once_and_closes_the_file(tmp_path: Path,
                                                                                      checkpoint) -> None:
    """Whatever fails the root's read (a header that is not an object, a segment it has no room for), the
    manager hears it now by name (InitFailed), not at the init timeout, and the file is closed."""
    bad = tmp_path / "list.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"[]")

    def no_room(shard: str, nbytes: int, then: Callable[[Any], None]) -> None:
        raise HandlerError("no-room", f"no room for {nbytes} bytes")

    for path, acquire, named in ((bad, lambda shard, nbytes, then: then(_Memory(nbytes)), "not an object"),
                                 (checkpoint[0], no_room, "HandlerError: no room for")):
        reports: list[Any] = []
        relay = Relay("init-3", "w0", acquire=acquire, send=lambda *args: None,  # type: ignore[arg-type]
                      report=reports.append, later=_Turns().later)
        relay.stream_from(InitPlan("init-3", str(path), _tree(2), 64, 5.0))
        assert relay.failed and relay._file is None
        assert len(reports) == 1 and isinstance(reports[0], InitFailed) and named in reports[0].reason
        assert reports[0].worker == "w0" and str(path) in reports[0].reason


def test_a_released_init_stops_its_relay_before_its_segment_is_reused(tmp_path: Path, checkpoint) -> None:
    """A ps-worker (its handlers called directly, its loop not running) roots an init with one child; the
    manager releases the init mid-stream. The acknowledgements still in flight then read and send nothing,
    so the segment, handed to the next shard opened, keeps that shard's bytes; a late header or chunk of the
    released init is refused and takes no segment."""
    path, _ = checkpoint
    runtime = NodeRuntime("ps-worker", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id="w0", metrics_port=-1),
                          register=False)
    try:
        settings = PsSettings(manager="tcp://127.0.0.1:9", worker="tcp://127.0.0.1:0", shm_dir=str(tmp_path),
                              shm_prefix="relay", pin_memory=False)
        worker = PsWorker(runtime, settings)

        worker._manager_id = "ps-manager"  # as its registration would have set it

        def handle(handler: Callable[[Any], Any], body: Any, src: str = "w1") -> Any:
            return handler(types.SimpleNamespace(body=body, header=types.SimpleNamespace(id="r", v=(2, 2), src=src)))

        me = worker.info()
        child = WorkerInfo("w1", "tcp://127.0.0.1:9", "here", str(tmp_path))
        relay = worker._relay("init-r")
        relay.stream_from(InitPlan("init-r", str(path), [me, child], 64, 5.0))
        _run_timers(runtime)
        child_state = relay._children[0]
        ok = Message(kind="ok", header=None, body=Ok())  # type: ignore[arg-type]  # only its type is looked at
        relay._acknowledged(child_state, "header", ok)
        _run_timers(runtime)
        assert child_state.in_flight == WINDOW and relay._file is not None  # waiting for acknowledgements
        read, sent = relay._read, child_state.sent

        handle(worker._release, Release(["init-r"]), "ps-manager")
        assert relay.failed and relay._file is None and "init-r" not in worker.relays
        opened = handle(worker._open, ShardOpen("push-next", 4096))
        segment = worker.shards["push-next"]
        assert opened.segment == segment.name  # the pool handed the init's segment on
        segment.view(0, 4096)[:] = b"\x5a" * 4096
        relay._acknowledged(child_state, "chunk", ok)  # an acknowledgement that was in flight
        assert relay._read == read and child_state.sent == sent  # nothing read into it, nothing sent from it
        assert bytes(segment.view(0, 4096)) == b"\x5a" * 4096

        shards = dict(worker.shards)
        for handler, body in ((worker._header, InitHeader("init-r", [child, me], 5.0, 4096, [])),
                              (worker._chunk, InitChunk("init-r", 0, np.zeros(8, np.uint8)))):
            with pytest.raises(HandlerError) as err:
                handle(handler, body)
            assert err.value.code == "released"
        assert worker.shards == shards and "init-r" not in worker.relays
    finally:
        runtime.close()


def test_a_worker_registers_again_with_a_restarted_manager_and_abandons_its_inits_in_progress(
        tmp_path: Path, checkpoint) -> None:
    """A ps-worker (handlers and peer listeners called directly) roots an init mid-stream. A node-up of the
    manager it registered with changes nothing; once the bus says that manager is down and another process of
    it comes up, the worker abandons the init (the dead manager will never commit or release it: its segment
    goes back to the pool) and registers again, listing the shards it holds."""
    path, _ = checkpoint
    runtime = NodeRuntime("ps-worker", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id="w0", metrics_port=-1),
                          register=False)
    try:
        settings = PsSettings(manager="tcp://127.0.0.1:9", worker="tcp://127.0.0.1:0", shm_dir=str(tmp_path),
                              shm_prefix="reregister", pin_memory=False)
        worker = PsWorker(runtime, settings)
        me = worker.info()
        relay = worker._relay("init-r")
        child = WorkerInfo("w1", "tcp://127.0.0.1:8", "here", str(tmp_path))  # not the manager's endpoint
        relay.stream_from(InitPlan("init-r", str(path), [me, child], 64, 5.0))
        assert relay._file is not None and worker.pool.in_use_bytes > 0
        first = NodeInfo("ps-manager", "ps-manager", "h", 10, started=1.0)
        worker._manager_up(first)  # the manager registered with at start: nothing to do
        worker._manager_up(first)
        assert runtime.calls.in_flight(settings.manager) == 0 and "init-r" in worker.relays
        worker._manager_down(NodeDown("ps-manager", "ps-manager", "timeout", 0.0), first)
        worker._manager_up(NodeInfo("ps-manager", "ps-manager", "h", 11, started=2.0))
        assert relay.failed and relay._file is None and "init-r" not in worker.relays
        assert worker.pool.in_use_bytes == 0 and "init-r" in worker.released
        assert runtime.calls.in_flight(settings.manager) == 1  # the registration, on its way
    finally:
        runtime.close()


def _sparse_checkpoint(path: Path, nbytes: int, *, tensors: int) -> Path:
    """A safetensors checkpoint at ``path`` of ``tensors`` uint8 tensors, ``nbytes`` of zeros in all: sparse, so it
    takes no disk (the workers' segments still take ``nbytes`` each)."""
    each = nbytes // tensors
    header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [each], "data_offsets": [i * each, (i + 1) * each]}
                         for i in range(tensors)}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + each * tensors)
    return path


def _skip_unless_shm_holds(nbytes: int) -> None:
    """Skip unless /dev/shm, which other work shares, has twice ``nbytes`` free: room for the test's segments
    that leaves the others as much."""
    free = shutil.disk_usage("/dev/shm").free
    if free < 2 * nbytes:
        pytest.skip(f"/dev/shm has {free >> 20} MiB free, under twice the {nbytes >> 20} MiB the test's segments take")


LARGE_INIT_BYTES = 2 << 30  # reading it and hashing it took this machine about twice the bus's 1 s node timeout


def test_a_large_init_onto_one_worker_keeps_it_live(bus, spawn, tmp_path: Path) -> None:
    """A root with no children reads the checkpoint a chunk a loop turn and hashes it a slice a turn, so its
    heartbeats keep going out: a 2 GiB init onto one worker, under the bus's 1 s node timeout, succeeds and the
    broker never reports the worker down (read and hashed in one turn, it was, and the manager failed the init:
    "went down (timeout) during the broadcast")."""
    _skip_unless_shm_holds(LARGE_INIT_BYTES)  # the worker's segment holds the whole checkpoint
    path = _sparse_checkpoint(tmp_path / "large.safetensors", LARGE_INIT_BYTES, tensors=4)
    _, control = bus
    watcher = Observer(control, frozenset({"node-down"}))
    cluster = start_cluster(spawn, control, "blarge", workers=1)
    runtime, ps = cluster.client()
    try:
        result = ps.init(str(path), workers=["w0"], timeout_s=START_S)
        assert result.workers == ["w0"] and result.file_opens == {"w0": 1}
        downs = [watcher.events.get_nowait().body for _ in range(watcher.events.qsize())]
        assert not [down for down in downs if down.node_id == "w0"], downs
    finally:
        runtime.close()
        watcher.runtime.join(START_S)
        _stop(cluster)
        for name in segments(cluster.prefix):  # a worker that did not get to unlink its segment
            segment_file(name).unlink()


def test_a_worker_takes_an_init_s_header_only_as_the_manager_planned_it_and_bounds_it_by_free_room(
        tmp_path: Path) -> None:
    """A ps-worker (handlers called directly) below the root of an init. A header the manager's plan did not
    announce, or that carries another tree or comes from another parent than planned, is refused before any
    segment is made; the planned one is taken however much larger than ps.max_open_bytes (that bound is for
    pushes nobody planned), and one the filesystem has no room for is refused by name before anything is made."""
    runtime = NodeRuntime("ps-worker", RuntimeSettings(bus="tcp://127.0.0.1:9", node_id="w1", metrics_port=-1),
                          register=False)
    try:
        settings = PsSettings(manager="tcp://127.0.0.1:9", worker="tcp://127.0.0.1:0", shm_dir=str(tmp_path),
                              shm_prefix="planned", pin_memory=False, max_open_bytes=4096)
        worker = PsWorker(runtime, settings)
        worker._manager_id = "ps-manager"  # as its registration would have set it

        def handle(handler: Callable[[Any], Any], body: Any, src: str) -> Any:
            return handler(types.SimpleNamespace(body=body, header=types.SimpleNamespace(id="r", v=(2, 2), src=src)))

        tree = [_tree(1)[0], worker.info(), WorkerInfo("w2", "tcp://127.0.0.1:9002", "here", str(tmp_path))]
        big = 1 << 20  # 256 times ps.max_open_bytes
        refusals = [(InitHeader("init-p", tree, 5.0, big, []), "w0", "not-planned"),  # no plan yet
                    (InitPlan("init-p", "/nonexistent", tree, 64, 5.0), "w0", "not-manager")]
        for body, src, code in refusals:
            with pytest.raises(HandlerError) as err:
                handle(worker._header if isinstance(body, InitHeader) else worker._plan, body, src)
            assert err.value.code == code, body
        assert handle(worker._plan, InitPlan("init-p", "/nonexistent", tree, 64, 5.0), "ps-manager") == Ok()
        assert handle(worker._plan, InitPlan("init-q", "/nonexistent", tree, 64, 5.0), "ps-manager") == Ok()
        assert worker.relays == {} and worker.pool.in_use_bytes == 0  # a plan below the root reads nothing
        refusals = [(InitHeader("init-x", tree, 5.0, 4096, []), "w0", "not-planned"),
                    (InitHeader("init-p", [*tree[:2], tree[0]], 5.0, big, []), "w0", "bad-init"),
                    (InitHeader("init-p", tree, 5.0, big, []), "w2", "not-parent")]
        for body, src, code in refusals:
            with pytest.raises(HandlerError) as err:
                handle(worker._header, body, src)
            assert err.value.code == code, (body, src)
        assert worker.relays == {} and worker.pool.in_use_bytes == 0 and worker.shards == {}

        answers: list[Any] = []
        worker.server.answer = lambda pending, body: answers.append(body)  # type: ignore[method-assign]
        assert handle(worker._header, InitHeader("init-p", tree, 5.0, big, []), "w0") is None  # answered when made
        assert answers == [Ok()] and worker.pool.in_use_bytes == big  # planned: not bounded by ps.max_open_bytes
        with pytest.raises(HandlerError) as err:
            handle(worker._header, InitHeader("init-p", tree, 5.0, big, []), "w0")
        assert err.value.code == "bad-init"  # one header per init
        with pytest.raises(HandlerError) as err:  # more than the filesystem holds: said before anything is made
            handle(worker._header, InitHeader("init-q", tree, 5.0, 1 << 60, []), "w0")
        assert err.value.code == "no-room" and str(tmp_path) in str(err.value) and "bytes free" in str(err.value)
        assert worker.pool.in_use_bytes == big and "init-q" not in worker.shards
    finally:
        runtime.close()


SEGMENT_BYTES = 448 << 20  # the checkpoint of the tests below: the root's and the child's segments, 896 MiB in all
ACK_S = 0.5  # their ps.ack_timeout_s: far above a chunk's acknowledgement here, below making SEGMENT_BYTES slowly
PATIENT_NODE_TIMEOUT_S = 3.0  # outlasts a child stopped for ACK_S and the allowance for SEGMENT_BYTES
# How long past ACK_S a child stays stopped: past the old deadline, with ~0.34 s of the allowance left to make
# SEGMENT_BYTES once it goes on (~0.05 s here; several times that on a loaded machine).
STOPPED_PAST_ACK_S = 0.1


@pytest.fixture
def patient_bus(tmp_path: Path) -> Iterator[str]:
    """A broker (its control endpoint) that reports no node down that was stopped under PATIENT_NODE_TIMEOUT_S."""
    proc, control = start_bus(tmp_path, extra=["--bus-heartbeat-interval-s", "0.2",
                                               "--bus-node-timeout-s", str(PATIENT_NODE_TIMEOUT_S)])
    try:
        yield control
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _segment_cluster(spawn: Callable[..., Any], control: str, tag: str, tmp_path: Path) -> tuple[PsCluster, Path]:
    """Two workers with ``ps.ack_timeout_s`` ACK_S, and a checkpoint of SEGMENT_BYTES for them (skipped when
    /dev/shm has not the room)."""
    _skip_unless_shm_holds(2 * SEGMENT_BYTES)
    path = _sparse_checkpoint(tmp_path / "segment.safetensors", SEGMENT_BYTES, tensors=2)
    return start_cluster(spawn, control, tag, workers=2,
                         extra=["--ps-ack-timeout-s", str(ACK_S), "--ps-chunk-bytes", str(1 << 20)]), path


def test_a_parent_waits_for_a_child_s_segment_by_the_allowance_for_its_size(patient_bus, spawn,
                                                                            tmp_path: Path) -> None:
    """w1 answers the header only once it made its segment, and is slow to (as a loaded host making a large one is:
    stopped from when it took its plan until ps.ack_timeout_s and a tenth of a second have passed, so past the old
    deadline, leaving most of the allowance for making the segment once it goes on): its parent waits
    ack_timeout_s plus ``shm.allocation_allowance_s`` of the segment, the rule a pusher's open uses, and the init
    succeeds. Waiting ack_timeout_s alone, the parent failed it ("did not acknowledge the header within 0.5s"),
    however large the segment."""
    cluster, path = _segment_cluster(spawn, patient_bus, "bslowmake", tmp_path)
    runtime, ps = cluster.client()
    child = cluster.workers["w1"]
    runner = None
    try:
        runner, outcome = _stalled_on(cluster, ps, path, ["w0", "w1"], "w1", START_S)
        holds_for(runner.is_alive, ACK_S + STOPPED_PAST_ACK_S, "the init to wait for w1 to make its segment")
        child.proc.send_signal(signal.SIGCONT)
        runner.join(START_S)
        assert not runner.is_alive() and outcome == [None], outcome
    finally:
        child.proc.send_signal(signal.SIGCONT)
        if runner is not None:
            runner.join(START_S)
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []


def test_a_child_killed_while_it_makes_its_segment_fails_the_init_by_its_deadline_and_leaves_nothing(
        bus, spawn, tmp_path: Path) -> None:
    """w1 is SIGKILLed as soon as the file of its segment appears (while its first 256 MiB slice is being made, as
    a 1 ms poll sees it here; a kill a loaded machine lands later fails the init all the same): the
    init fails naming w1 by the header's deadline (ps.ack_timeout_s plus the allowance for the segment) or w1's
    node-down, never at the init timeout; w0 frees its copy, and w1's file is swept when it starts again: nothing
    is left."""
    cluster, path = _segment_cluster(spawn, bus[1], "bkillmake", tmp_path)
    runtime, ps = cluster.client()
    child = cluster.workers["w1"]
    token = f"{cluster.prefix}.{child.proc.pid}."
    runner, outcome = _init_in_background(ps, path, ["w0", "w1"], START_S)
    try:
        wait_for(lambda: [n for n in segments(cluster.prefix) if n.startswith(token)], START_S,
                 "w1 to start making its segment", poll_s=0.001)
        child.proc.kill()
        child.proc.wait(10)
        # Ended by the header's deadline or w1's node-down (FAST_LIVENESS: 1 s): within twice both together.
        runner.join(2 * (ACK_S + allocation_allowance_s(SEGMENT_BYTES) + 1.0))
        assert not runner.is_alive() and isinstance(outcome[0], RemoteError), outcome
        message = str(outcome[0])
        assert outcome[0].code == "init-failed" and "'w1'" in message and "init timeout" not in message, message
        wait_for(lambda: cluster.held("w0") == 0, 10, "w0 to free its copy")
        restart_worker(spawn, cluster, "w1")  # its start sweeps the dead process's files
        assert [n for n in segments(cluster.prefix) if n.startswith(token)] == []
    finally:
        child.proc.kill()
        runner.join(START_S)
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []
