"""A ps-manager killed with SIGKILL and restarted under its node id, as real processes.

* Between two pushes: it replays its journal and comes back with the versions it retained (their exact bytes
  pulled), the workers register again on their own, a new push commits, the staleness inventory's trainer
  version survives and a reservation of the dead process is refused ``unknown-reservation`` until made again.
* In the middle of a push (one rank's shard committed): the other rank's commit is refused ``push-aborted``
  naming the restart; the version is pushed again and commits; the dead push's shards are released, once.
* A push (``PsClient.push``) in flight when the manager dies starts over: killed after both ranks' grants, or
  before any begin is answered, each rank pushes again on its own and one version commits with the exact bytes;
  a version the dead manager had committed and journaled is taken as committed, not pushed twice; a refusal
  that does not name a restart still raises at once.
* While a reader holds a lease: nothing is released for a lease TTL after the restart, so versions committed
  meanwhile do not reuse the memory the reader maps (its bytes stay those of its version); its release is
  refused ``unknown-lease`` naming the restart; afterwards the workers hold exactly the retained versions.
* After a consume's batch is journaled, its reply lost with the process: the request sent again (same id) to
  the restarted manager, and a new consume naming the batch's buffer, get the same batch, not
  ``out-of-order``; the run goes on with the next buffer.
* A torn last journal record (a crash mid-append) is ignored; garbage (a length garbled mid-journal included), a
  directory in place of the journal or of a compaction's new journal, or a record of another kind refuses the
  journal, naming it, exit 2, and leaves it as it was. Compacted, the journal replays the same state.
* SIGKILLed inside its compactions (stopped there first: the new journal half or wholly written, not yet in
  place) while real clients push, resume lineages and abort pushes: each restart serves exactly what was
  committed.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import torch
import zmq
from polling import holds_for, wait_for
from ps_support import (
    PsCluster,
    checksums,
    make_state,
    rank_part,
    restart_manager,
    start_cluster,
    stop_cluster_after_kills,
)
from refbus.bus.reqrep import RemoteError, RequestTimeout, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket, recv_frames
from refbus.nodes.config import Config
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ps import manifest as mf
from refbus.nodes.ps.client import PsClient, PushResult, PushSession
from refbus.nodes.ps.manager_journal import COMPACT_MIN_RECORDS, HandedOut, ManagerJournal
from refbus.nodes.ps.versions import DoneRank, VersionStore
from refbus.nodes.rl.rollout import REFRESH_EVERY_S, RolloutWorker
from refbus.nodes.store import journal
from refbus.nodes.store.durable import DurableStore, StoreError
from refbus.nodes.toy.policy import make_policy
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Generate
from refbus.protocol.messages_ps import Batch, BatchEntry, Consume, Location, ManifestEntry, TensorSpec, WorkerInfo

NODE_TIMEOUT_S = 1.0  # tests/conftest.py FAST_LIVENESS
FAST_RETRY = RetryPolicy(timeout_s=0.5, attempts=3, backoff=2.0)  # outlasts the manager's restart
# A rollout worker's requests (its polls among them) wait this long; a generation is answered well within it.
POLL_RETRY = RetryPolicy(timeout_s=10.0, attempts=1)
GENERATE_RETRY = RetryPolicy(timeout_s=POLL_RETRY.timeout_s / 4, attempts=1)
WORKERS = {"w0", "w1"}
# The lease TTL of the reader's cluster: the restart's hold on releases lasts this long. The test pushes two small
# versions inside the hold (well under a second when idle), so the TTL leaves a wide margin for a loaded machine.
READ_TTL_S = 15.0
WORKER = WorkerInfo("w0", "tcp://w0", "h", "/dev/shm", 1, "boot", "n", "nonce")


def _cluster(spawn, control: str, tag: str, tmp_path: Path, *extra: str) -> PsCluster:
    return start_cluster(spawn, control, tag, workers=2,
                         extra=["--store-directory", str(tmp_path / "shm"), *extra])


@pytest.fixture
def cluster(bus, spawn, tmp_path: Path) -> Iterator[PsCluster]:
    _, control = bus
    cluster = _cluster(spawn, control, "mgr-restart", tmp_path, "--ps-batch-size", "1", "--ps-eta", "0")
    yield cluster
    stop_cluster_after_kills(cluster)


class _PausedAfterGrant(PsClient):
    """A pusher that stops once its first grant is answered (its shard opened on the workers) until ``go``: the
    test kills the manager there, with every rank's push begun."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.granted = threading.Event()
        self.go = threading.Event()

    def begin_push(self, like: Any, version: int, **kwargs: Any) -> PushSession:
        session = super().begin_push(like, version, **kwargs)
        if not self.granted.is_set():
            self.granted.set()
            assert self.go.wait(30), "the test never let the push go on"
        return session


def _client(cluster: PsCluster, name: str, kind: type[PsClient] = PsClient,
            retry: RetryPolicy = FAST_RETRY) -> tuple[NodeRuntime, PsClient]:
    settings = RuntimeSettings(bus=cluster.control, node_id=name, metrics_port=-1, retry=retry)
    runtime = NodeRuntime("ps-client", settings, register=False)
    return runtime, kind(runtime, cluster.manager)


def _kill(cluster: PsCluster) -> None:
    assert cluster.manager_proc is not None
    cluster.manager_proc.signal(signal.SIGKILL)
    assert cluster.manager_proc.proc.wait(10) == -signal.SIGKILL


def _restart(spawn, cluster: PsCluster, ps: PsClient) -> NodeProcess:
    """Start the (dead) manager again and wait until both workers registered with the new process on their own."""
    new = restart_manager(spawn, cluster)
    wait_for(lambda: {w.worker for w in ps.status().workers} == WORKERS, 10 * NODE_TIMEOUT_S,
             "both workers to register with the restarted manager")
    return new


def _kill_and_restart(spawn, cluster: PsCluster, ps: PsClient) -> NodeProcess:
    _kill(cluster)
    return _restart(spawn, cluster, ps)


def _retained_bytes(ps: PsClient) -> dict[str, float]:
    """Worker -> the bytes of the segments the retained versions' copies on it take (their files' sizes)."""
    status = ps.status()
    directories = {w.worker: Path(w.shm_dir) for w in status.workers}
    copies = {(loc.worker, loc.segment) for version in status.retained for entry in ps.manifest(version).entries
              for loc in entry.locations}
    return {w: float(sum((directories[w] / segment).stat().st_size for worker, segment in copies if worker == w))
            for w in WORKERS}


def _settles(cluster: PsCluster, ps: PsClient) -> None:
    """Wait until every worker's memory in use is exactly that of the retained versions' copies on it: what was
    held back is released, nothing is leaked, nothing still needed was released."""
    wait_for(lambda: {w: cluster.held(w) for w in WORKERS} == _retained_bytes(ps), 4 * READ_TTL_S,
             "each worker to hold exactly the retained versions")


def _journal_file(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "shm").glob("refbus-store.*.ps-manager/journal")
    return path


def test_killed_between_pushes_the_manager_comes_back_with_its_versions_and_training_goes_on(
        cluster: PsCluster, spawn) -> None:
    runtime, ps = _client(cluster, "trainer")
    try:
        digests = {v: ps.push(make_state(seed=v, tensors=4), v).digest for v in (0, 1)}
        # The inventory: version 1's batch consumed (the trainer version moves to 2), then a live reservation.
        assert ps.reserve("p1", 1) == 1 and ps.occupy("p1", "t1", 1).ready
        assert ps.consume(1).ready and ps.inventory().trainer_version == 2
        assert ps.reserve("p2", 2) == 2
        new = _kill_and_restart(spawn, cluster, ps)
        assert '"ps.manager_recovered"' in new.log_tail(200)
        status = ps.status()
        assert (status.latest, status.retained, status.trainer_version) == (1, [0, 1], 2)
        for version in (0, 1):
            pulled = ps.pull(version, verify=True)
            assert pulled.digest == digests[version]
            assert checksums(dict(pulled)) == checksums(make_state(seed=version, tensors=4))
        with pytest.raises(RemoteError) as refused:
            ps.occupy("p2", "t2", 2)
        assert refused.value.code == "unknown-reservation"
        assert ps.reserve("p2", 2) == 2 and ps.occupy("p2", "t2", 2).ready  # made again, it fills the batch
        assert ps.push(make_state(seed=2, tensors=4), 2).committed
        assert ps.status().retained == [1, 2]
        assert checksums(dict(ps.pull(2, verify=True))) == checksums(make_state(seed=2, tensors=4))
        _settles(cluster, ps)  # version 0's copies released once the restart's hold ended, and nothing else
        log = new.log_tail(400)
        assert '"ps.versions_lost_on_worker"' not in log and '"ps.release_failed"' not in log
    finally:
        runtime.close()


def test_a_push_in_flight_when_the_manager_dies_keeps_its_done_ranks_and_commits_when_the_rest_push_again(
        cluster: PsCluster, spawn) -> None:
    """Rank 0's shard is done (its push returned) and rank 1's is written but not sealed when the manager is
    SIGKILLed: the restarted manager restores rank 0 into the pending version from its journal; rank 1's seal
    is refused naming the restart, its push again alone commits the version with both ranks' exact bytes.
    Before, the restart forgot rank 0, whose pusher never pushes it again: the version could not commit."""
    runtime, ps = _client(cluster, "rank0")
    runtime1, ps1 = _client(cluster, "rank1")
    state = make_state(seed=5, tensors=6)
    try:
        assert ps.push(state, 0).committed
        first = ps.push(rank_part(state, 0, 2), 1, rank=0, world=2)  # rank 0's shard committed, version pending
        assert not first.committed
        part = rank_part(state, 1, 2)
        with ps1.begin_push(part, 1, rank=1, world=2) as session:
            for name, tensor in part.items():
                session.write(name, tensor)
            _kill_and_restart(spawn, cluster, ps)
            with pytest.raises(RemoteError) as refused:
                session.commit()
        assert refused.value.code == "push-aborted" and "restarted" in refused.value.detail, refused.value
        assert ps.status().pending == [1] and ps.status().latest == 0
        assert ps1.push(part, 1, rank=1, world=2).committed
        assert checksums(dict(ps.pull(1, verify=True))) == checksums(state)
        _settles(cluster, ps)  # the dead push's shards released; versions 0 and 1 kept
    finally:
        runtime.close()
        runtime1.close()


def test_a_done_rank_whose_pusher_never_heard_is_written_again_after_the_restart(cluster: PsCluster,
                                                                                  spawn) -> None:
    """Rank 0's shard was done and journaled, but its pusher starts its push over (it did not hear the answer,
    as when the manager dies before it goes out): the restarted manager takes the same holder's begin as a
    retry of the restored rank, rank 0 is written again, and the version commits once rank 1 pushes."""
    runtime, ps = _client(cluster, "rank0")
    runtime1, ps1 = _client(cluster, "rank1")
    state = make_state(seed=6, tensors=6)
    try:
        assert not ps.push(rank_part(state, 0, 2), 0, rank=0, world=2).committed
        _kill_and_restart(spawn, cluster, ps)
        assert ps.status().pending == [0]
        # Refused ``version-conflict`` (rank 0 already pushing) unless taken as the restored rank's retry.
        assert not ps.push(rank_part(state, 0, 2), 0, rank=0, world=2).committed
        assert ps1.push(rank_part(state, 1, 2), 0, rank=1, world=2).committed
        assert checksums(dict(ps.pull(0, verify=True))) == checksums(state)
        _settles(cluster, ps)  # rank 0's first copies released once the restart's hold ended
    finally:
        runtime.close()
        runtime1.close()


def _push_in_thread(pool: ThreadPoolExecutor, ps: PsClient, tensors: dict[str, torch.Tensor], version: int,
                    rank: int, world: int) -> Future[PushResult]:
    return pool.submit(ps.push, tensors, version, rank=rank, world=world)


def _result(push: Future[PushResult], ps: PsClient) -> PushResult:
    """The push's result, within its restart deadline plus the slowest attempt it may have in flight then."""
    return push.result(timeout=2 * ps.wait_workers_s)


def _restarts(logs: list[dict[str, Any]]) -> dict[int, set[str]]:
    """Rank -> the reasons ``ps.push_restarted`` gave for it."""
    reasons: dict[int, set[str]] = {}
    for entry in logs:
        if entry["event"] == "ps.push_restarted":
            reasons.setdefault(entry["rank"], set()).add(entry["reason"])
    return reasons


def test_a_push_begun_by_every_rank_when_the_manager_dies_starts_over_and_commits(cluster: PsCluster,
                                                                                 spawn) -> None:
    state = make_state(seed=7, tensors=6)
    runtime, observer = _client(cluster, "observer")
    ranks = [_client(cluster, f"rank{rank}", _PausedAfterGrant) for rank in (0, 1)]
    pausing = [ps for _, ps in ranks if isinstance(ps, _PausedAfterGrant)]
    try:
        with structlog.testing.capture_logs() as logs, ThreadPoolExecutor(2) as pool:
            pushes = [_push_in_thread(pool, ps, rank_part(state, rank, 2), 0, rank, 2)
                      for rank, ps in enumerate(pausing)]
            try:
                for ps in pausing:
                    assert ps.granted.wait(10 * NODE_TIMEOUT_S), "a rank's push was never granted"
                _kill_and_restart(spawn, cluster, observer)
            finally:
                for ps in pausing:
                    ps.go.set()
            results = [_result(push, ps) for push, ps in zip(pushes, pausing, strict=True)]
        # Each rank's seal was refused by the restarted manager naming the restart, and each started over.
        assert _restarts(logs) == {0: {"manager-restarted"}, 1: {"manager-restarted"}}, logs
        assert sorted(r.committed for r in results) == [False, True]
        status = observer.status()
        assert (status.latest, status.retained, status.pending) == (0, [0], [])
        pulled = observer.pull(0, verify=True)
        assert pulled.digest == next(r.digest for r in results if r.committed)
        assert checksums(dict(pulled)) == checksums(state)
        _settles(cluster, observer)  # the dead push's shards released; the committed copies kept
    finally:
        for rank_runtime, _ in ranks:
            rank_runtime.close()
        runtime.close()


def test_a_push_whose_begin_the_dead_manager_never_answered_commits_once_it_is_back(cluster: PsCluster,
                                                                                   spawn) -> None:
    state = make_state(seed=8, tensors=6)
    runtime, observer = _client(cluster, "observer")
    ranks = [_client(cluster, f"rank{rank}") for rank in (0, 1)]
    try:
        _kill(cluster)
        with structlog.testing.capture_logs() as logs, ThreadPoolExecutor(2) as pool:
            pushes = [_push_in_thread(pool, ps, rank_part(state, rank, 2), 0, rank, 2)
                      for rank, (_, ps) in enumerate(ranks)]
            # Every rank's begin went unanswered (its request policy ran out) before the manager is back.
            wait_for(lambda: set(_restarts(logs)) == {0, 1}, 4 * FAST_RETRY.deadline_s,
                     "both ranks to start their push over")
            _restart(spawn, cluster, observer)
            results = [_result(push, ps) for push, (_, ps) in zip(pushes, ranks, strict=True)]
        assert set().union(*_restarts(logs).values()) <= {"manager-timeout", "manager-down"}, logs
        assert sorted(r.committed for r in results) == [False, True]
        assert observer.status().latest == 0
        assert checksums(dict(observer.pull(0, verify=True))) == checksums(state)
        _settles(cluster, observer)
    finally:
        for rank_runtime, _ in ranks:
            rank_runtime.close()
        runtime.close()


def test_a_restarted_push_of_a_version_the_dead_manager_committed_is_taken_as_committed(cluster: PsCluster,
                                                                                      spawn) -> None:
    """The durable manager committed and journaled the version, then died before the pusher heard: the pusher's
    fresh begin is refused ``version-conflict``, and the replayed manifest holding its bytes makes it done."""
    state = make_state(seed=9, tensors=4)
    runtime, observer = _client(cluster, "observer")
    pusher_runtime, pusher = _client(cluster, "pusher")
    try:
        digest = observer.push(state, 0).digest
        _kill(cluster)
        with structlog.testing.capture_logs() as logs, ThreadPoolExecutor(1) as pool:
            push = _push_in_thread(pool, pusher, state, 0, 0, 1)
            wait_for(lambda: 0 in _restarts(logs), 4 * FAST_RETRY.deadline_s, "the push to start over")
            _restart(spawn, cluster, observer)
            result = _result(push, pusher)
        assert (result.committed, result.digest) == (True, digest)
        assert any(entry["event"] == "ps.push_found_committed" for entry in logs), logs
        status = observer.status()
        assert (status.latest, status.retained, status.pending) == (0, [0], [])  # not pushed twice
        _settles(cluster, observer)
    finally:
        pusher_runtime.close()
        runtime.close()


def test_a_refusal_that_names_no_restart_still_raises_at_once(cluster: PsCluster) -> None:
    runtime, ps = _client(cluster, "trainer")
    try:
        assert ps.push(make_state(seed=1, tensors=2), 0).committed
        with structlog.testing.capture_logs() as logs, pytest.raises(RemoteError) as refused:
            ps.push(make_state(seed=2, tensors=2), 5)  # not the next version
        assert refused.value.code == "version-conflict", refused.value
        assert _restarts(logs) == {}
        # A version already committed with other bytes is a conflict too, never taken as done.
        with pytest.raises(RemoteError) as again:
            ps.push(make_state(seed=3, tensors=2), 0)
        assert again.value.code == "version-conflict", again.value
    finally:
        runtime.close()


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "no-journal"])
def test_a_lease_of_the_dead_manager_keeps_its_memory_for_a_ttl_and_its_release_is_refused(
        bus, spawn, tmp_path: Path, durable: bool) -> None:
    """Durable, the restarted manager knows it restarted (its store was there). Without a journal it learns it
    from the workers' registrations, listing shards of push leases it never granted; before, it released them
    at once and version 3 took the memory the reader still read."""
    _, control = bus
    cluster = _cluster(spawn, control, "mgr-lease", tmp_path, "--ps-lease-ttl-s", str(READ_TTL_S),
                       "--store-durable", str(durable).lower())
    runtime, ps = _client(cluster, "trainer")
    reader_runtime, reader = _client(cluster, "reader")
    try:
        for version in (0, 1):
            assert ps.push(make_state(seed=version, tensors=4), version).committed
        held = reader.pull(0, shared=True)  # views of the workers' segments, under a lease
        expected = checksums(make_state(seed=0, tensors=4))
        assert checksums(dict(held)) == expected
        _kill_and_restart(spawn, cluster, ps)
        # Version 2 retires version 0; version 3 would take the memory released by then. The restarted manager
        # releases nothing for a lease TTL: the reader's bytes are still version 0's.
        for version in (2, 3):
            assert ps.push(make_state(seed=version, tensors=4), version).committed
        assert ps.status().retained == [2, 3]
        assert checksums(dict(held)) == expected
        with pytest.raises(RemoteError) as refused:
            held.release()
        assert refused.value.code == "unknown-lease" and "restarted" in refused.value.detail, refused.value
        _settles(cluster, ps)
        assert checksums(dict(ps.pull(3, verify=True))) == checksums(make_state(seed=3, tensors=4))
        log = cluster.manager_proc.log_tail(400)  # type: ignore[union-attr]
        assert '"ps.held_releases_sent"' in log and ('"ps.restart_inferred"' in log) != durable, log
    finally:
        runtime.close()
        reader_runtime.close()
    stop_cluster_after_kills(cluster)


def test_a_rollout_worker_generates_while_the_manager_is_dead_and_pulls_what_the_restarted_one_commits(
        cluster: PsCluster, spawn) -> None:
    """A rollout worker serving version 0 answers every generation while the manager is dead (SIGKILL): its
    tick's poll waits on the loop thread, never in front of the generations. Before, each tick's poll ran on
    the thread that generates and held every generation queued behind it for the poll's whole retry schedule.
    Once the manager is back, the next version is pulled."""
    config = Config()
    config = dataclasses.replace(config, ps=dataclasses.replace(config.ps, manager=cluster.manager))
    settings = RuntimeSettings(bus=cluster.control, node_id="rollout-r", metrics_port=-1, retry=POLL_RETRY)
    runtime = NodeRuntime("rollout", settings)
    worker = RolloutWorker(runtime, config)
    pusher_runtime, pusher = _client(cluster, "trainer")
    try:
        pusher.push(dict(make_policy(1).state_dict()), 0)
        runtime.start_background()
        wait_for(lambda: worker.version == 0, 10 * REFRESH_EVERY_S, "version 0 pulled")
        generate = pusher_runtime.client(runtime.endpoints["generate"], policy=GENERATE_RETRY)
        ask = Generate(prompt=[1, 2, 3], max_new_tokens=2)
        _kill(cluster)
        # Every tick meanwhile polls the dead manager, which never answers within GENERATE_RETRY.
        holds_for(lambda: generate.request(ask).body.policy_version == 0, 3 * REFRESH_EVERY_S,
                  "generations answered with version 0 while the manager is dead")
        _restart(spawn, cluster, pusher)
        newer = make_policy(2).state_dict()
        pusher.push(dict(newer), 1)
        wait_for(lambda: worker.version == 1, 10 * REFRESH_EVERY_S, "version 1 pulled from the restarted manager")
        assert generate.request(ask).body.policy_version == 1
        assert all(torch.equal(worker.model.state_dict()[name], t) for name, t in newer.items())
    finally:
        pusher_runtime.close()
        runtime.stop()
        runtime.join(10 * REFRESH_EVERY_S)


def _journaled(path: Path, record: dict[str, Any]) -> bool:
    """Whether the journal at ``path`` holds a committed record with ``record``'s fields (read as it grows)."""
    return any(raw.items() >= record.items() for raw in journal.replay(path.read_bytes(), str(path)).records)


def test_a_consume_whose_reply_died_with_the_manager_gets_its_batch_from_the_restarted_one(
        cluster: PsCluster, spawn, tmp_path: Path) -> None:
    """The manager journals the consume of buffer 0 (the trainer version moves to 1) and is killed before its
    reply reaches the trainer: the request sent again gets batch 0, not ``out-of-order`` and the batch lost."""
    runtime, ps = _client(cluster, "trainer")
    codec = WireCodec("trainer")
    ctx = zmq.Context()
    frames = codec.encode(Consume(0), msg_id=codec.new_id())
    try:
        assert ps.reserve("p0", 0) == 0 and ps.occupy("p0", "t0", 0).ready
        lost = make_socket(ctx, zmq.DEALER, connect=cluster.manager)
        lost.send_multipart(frames)
        path = _journal_file(tmp_path)
        wait_for(lambda: _journaled(path, {"op": "trainer", "version": 1}), 10.0, "the consume journaled")
        lost.close()  # its reply, sent or not, is never read: lost with the process killed next
        _kill_and_restart(spawn, cluster, ps)
        retry = make_socket(ctx, zmq.DEALER, connect=cluster.manager)
        retry.send_multipart(frames)
        assert retry.poll(10_000, zmq.POLLIN), "no answer to the consume sent again"
        answer = codec.decode(recv_frames(retry)).body
        batch0 = Batch(0, True, [BatchEntry("p0", "t0", 0)])
        assert answer == batch0
        assert ps.consume(0) == batch0 and ps.inventory().trainer_version == 1
        assert ps.consume() == Batch(1, False)
        assert ps.reserve("p1", 1) == 1 and ps.occupy("p1", "t1", 1).ready
        assert ps.consume(1) == Batch(1, True, [BatchEntry("p1", "t1", 1)]) == ps.consume(1)
    finally:
        runtime.close()
        ctx.destroy(linger=0)  # closes the sockets an assertion left open


def test_a_torn_last_record_is_ignored_and_garbage_refuses_the_journal(cluster: PsCluster, spawn,
                                                                       tmp_path: Path) -> None:
    runtime, ps = _client(cluster, "trainer")
    try:
        digest = ps.push(make_state(seed=1, tensors=3), 0).digest
        path = _journal_file(tmp_path)
        _kill(cluster)
        # Killed between a record's bytes and its commit flag: the record never counted.
        body, _flag = journal.encode({"op": "lineage", "version": 0})
        with path.open("ab") as out:
            out.write(body)
        _restart(spawn, cluster, ps)
        assert ps.status().retained == [0] and ps.pull(0, verify=True).digest == digest
        # Garbage after the last record: the journal is refused, named, and left as it is.
        _kill(cluster)
        with path.open("ab") as out:
            out.write(b"\x10\x00\x00\x00" + bytes(range(40)))
        before = path.read_bytes()
        refused = spawn(["node", "ps-manager", "--node-id", "ps-manager", "--ps-manager", cluster.manager,
                         *cluster.flags], "ps-manager-refused")
        assert refused.proc.wait(30) == 2, refused.log_tail()
        assert '"ps.journal_unusable"' in refused.log_tail() and str(path) in refused.log_tail()
        assert path.read_bytes() == before
        # Cut back to its good records, the journal serves again: nothing was lost.
        path.write_bytes(before[: len(before) - 44])
        _restart(spawn, cluster, ps)
        assert ps.pull(0, verify=True).digest == digest
    finally:
        runtime.close()


def _garble_a_length(path: Path) -> None:
    """The first record's length made to run past the end of the journal (64 KiB more: a bit of its third byte
    flipped): what follows it looks like a record cut by a crash, unless the committed records after it are seen."""
    data = bytearray(path.read_bytes())
    data[len(journal.header()) + 2] ^= 0x01
    path.write_bytes(bytes(data))


def _journal_a_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _new_journal_a_directory(path: Path) -> None:
    path.with_name("journal.new").mkdir()


def test_a_journal_damaged_other_than_by_a_crash_refuses_the_start_naming_it(cluster: PsCluster, spawn,
                                                                            tmp_path: Path) -> None:
    """A record's length garbled in the middle of the journal (the records after it committed), a directory in
    place of the journal or of a compaction's new journal: each time the restart exits 2 naming the file and
    leaves the store as it found it; undamaged again, the journal serves every committed version."""
    runtime, ps = _client(cluster, "trainer")
    try:
        digests = {v: ps.push(make_state(seed=v, tensors=3), v).digest for v in (0, 1)}
        path = _journal_file(tmp_path)

        def found() -> list[tuple[str, bool, bytes]]:
            """The store's files (not its lock, which names the process that opened it last)."""
            return sorted((p.name, p.is_dir(), p.read_bytes() if p.is_file() else b"") for p in path.parent.iterdir()
                          if p.name != "lock")

        for damage in (_garble_a_length, _journal_a_directory, _new_journal_a_directory):
            _kill(cluster)
            before = path.read_bytes()
            damage(path)
            damaged = found()
            refused = spawn(["node", "ps-manager", "--node-id", "ps-manager", "--ps-manager", cluster.manager,
                             *cluster.flags], f"ps-manager-refused-{damage.__name__}")
            assert refused.proc.wait(30) == 2, refused.log_tail()
            named = path.with_name("journal.new") if damage is _new_journal_a_directory else path
            assert '"ps.journal_unusable"' in refused.log_tail() and f"{named}:" in refused.log_tail()
            assert found() == damaged, damage.__name__
            for made in (path, path.with_name("journal.new")):
                if made.is_dir():
                    made.rmdir()
            path.write_bytes(before)
            _restart(spawn, cluster, ps)
            assert ps.status().retained == [0, 1]
            assert {v: ps.pull(v, verify=True).digest for v in (0, 1)} == digests
    finally:
        runtime.close()


def test_a_journal_record_of_another_kind_or_shape_refuses_the_journal(tmp_path: Path) -> None:
    done = msgspec.to_builtins(DoneRank(1, 2, True, 0, "lease", "rank0", {"w0": "seg"}, [], "world-a"))
    for bad in ({"op": "retire", "version": 1}, {"op": "commit", "manifest": {"version": "x"}, "shards": [],
                                                 "leases": []}, {"op": "lineage"}, {"op": "abort"},
                {"op": "rank", "version": 1, "world": 2, "rank": 0}, {"op": "rank", "done": {**done, "world_token": 7}},
                {"op": "rank", "done": {**done, "world": "two"}}, {"op": "retried", "version": 1, "rank": 0},
                {"op": "retried", "version": 1, "rank": 0, "lease": 5},
                {"op": "retried", "version": 1, "rank": 0, "lease": "l", "extra": 1}):
        store = DurableStore(tmp_path, "run", "m", budget_bytes=0, what="ps", strict=True)
        store.commit({"op": "trainer", "version": 3})
        store.commit(bad)
        store.close(remove=False)
        store = DurableStore(tmp_path, "run", "m", budget_bytes=0, what="ps", strict=True)
        with pytest.raises(StoreError, match=r"journal: record 1 is not a ps-manager record"):
            ManagerJournal(store).replay(VersionStore(2), 0.0)
        store.close(remove=True)


def test_the_journal_is_compacted_to_the_retained_versions_and_replays_the_same(tmp_path: Path) -> None:
    """Hundreds of commits, a lineage and consumed batches: the journal is rewritten to what is retained, and a
    replay of it (as a restarted manager does) rebuilds the same versions, lineage and trainer version."""
    workers = [WorkerInfo("w0", "tcp://w0", "h", "/dev/shm", 1, "boot", "n", "nonce")]
    store = DurableStore(tmp_path, "run", "m", budget_bytes=0, what="ps", strict=True)
    recorder, versions = ManagerJournal(store), VersionStore(3)
    for version in range(400):
        if version == 300:  # a trainer world resumed at 290: 290..299 retired, pushed again
            versions.start_lineage(290)
            recorder.lineage(290)
        number = version if version < 300 else version - 10
        entry = ManifestEntry("a", "float32", [1], 4, version, [Location("w0", f"s{version}", 0)])
        manifest = mf.build(number, [entry], workers)
        versions.restore(manifest, [("w0", f"lease-{version}")], frozenset({f"lease-{version}"}))
        recorder.committed(manifest, [("w0", f"lease-{version}")], [f"lease-{version}"])
        handed_out = HandedOut(("trainer", f"id-{number}"), number, [BatchEntry("p", f"t{number}", number)])
        recorder.trainer(number + 1, handed_out)
        recorder.compact_if_due(versions, number + 1, handed_out)
    assert store.records_since_compact < 400
    store.close(remove=False)
    again = VersionStore(3)
    recovered = ManagerJournal(DurableStore(tmp_path, "run", "m", budget_bytes=0, what="ps",
                                            strict=True)).replay(again, 0.0)
    assert recovered.versions == again.retained() == versions.retained() == [387, 388, 389]
    assert recovered.trainer_version == 390 and recovered.records < 400 and recovered.handed_out == handed_out
    assert again.stored(again.retained()) == versions.stored(versions.retained())


def _done_rank(versions: VersionStore, version: int, rank: int, holder: str) -> DoneRank:
    """Rank ``rank`` of ``version`` (world 2) begun and verified on w0, the other rank still missing; what the
    manager journals of it."""
    specs = [TensorSpec(f"t{rank}", "float32", [4])]
    (layout,) = versions.begin(version, rank, 2, specs, ["w0"], f"lease-{version}-{rank}", 0.0, holder=holder)
    written = msgspec.structs.replace(layout, checksum=1000 + rank)
    versions.commit_shard(version, rank, f"lease-{version}-{rank}", "w0", f"seg-{version}-{rank}", [written],
                          [WORKER])
    done = versions.done_rank(version, rank)
    assert done is not None
    return done


def test_done_ranks_replay_into_the_pending_version_until_it_commits_aborts_or_a_lineage_starts(
        tmp_path: Path) -> None:
    """Unit: a ``rank`` record restores the pending version with that rank done (its copies kept, its holder
    known); a later commit, abort or lineage leaves nothing pending; a compaction keeps the done ranks."""

    def opened() -> ManagerJournal:
        return ManagerJournal(DurableStore(tmp_path, "run", "m", budget_bytes=0, what="ps", strict=True))

    def replayed() -> VersionStore:
        """What a restarted manager rebuilds now; recording goes on in the reopened journal, as it does."""
        nonlocal recorder
        recorder.close(remove=False)
        recorder = opened()
        again = VersionStore(3)
        recorder.replay(again, 5.0)
        return again

    recorder, versions = opened(), VersionStore(3)
    recorder.rank_done(_done_rank(versions, 0, 0, "rank0"))
    again = replayed()
    assert again.pending is not None and (again.pending.version, sorted(again.pending.ranks)) == (0, [0])
    assert again.restored_holder(0, 0) == ("rank0", "lease-0-0") and again.shards_on("w0") == {"lease-0-0"}
    assert again.done_ranks() == versions.done_ranks()
    recorder.aborted(0)  # e.g. rank 1 never came within the push timeout
    assert replayed().pending is None
    versions.abort(0)
    recorder.rank_done(_done_rank(versions, 0, 0, "rank0"))
    recorder.retried(0, 0, "lease-0-9")  # another attempt's lease: rank 0 stays
    assert sorted(replayed().pending.ranks) == [0]  # type: ignore[union-attr]
    recorder.retried(0, 0, "lease-0-0")  # rank 0's pusher retried: its copies were released
    assert replayed().pending is None  # no rank left: the pushers begin it again
    versions.abort(0)
    recorder.rank_done(_done_rank(versions, 0, 0, "rank0"))
    (layout,) = versions.begin(0, 1, 2, [TensorSpec("t1", "float32", [4])], ["w0"], "lease-0-1", 0.0)
    _, manifest, _ = versions.commit_shard(0, 1, "lease-0-1", "w0", "seg-0-1",
                                           [msgspec.structs.replace(layout, checksum=1001)], [WORKER])
    assert manifest is not None and versions.pending is None  # rank 1 committed the version
    ((_, shards, leases),) = versions.stored([0])
    recorder.committed(manifest, shards, leases)
    again = replayed()
    assert again.pending is None and again.latest == 0
    recorder.rank_done(_done_rank(versions, 1, 0, "rank0"))
    recorder.lineage(1)  # a trainer world resumed at 1: the pending push of the old one was aborted
    again = replayed()
    assert again.pending is None and again.retained() == [0]
    versions.abort(1)
    versions.start_lineage(1)
    recorder.rank_done(done := _done_rank(versions, 1, 0, "rank0"))
    for _ in range(COMPACT_MIN_RECORDS + 1):
        recorder.trainer(1, HandedOut(("trainer", "id"), 0, []))
    recorder.compact_if_due(versions, 1, None)
    assert recorder.store.records_since_compact == 0
    again = replayed()
    assert again.done_ranks() == [done] and again.retained() == [0]
    recorder.close(remove=True)


def test_a_resuming_push_joins_a_pending_version_restored_from_the_journal_only_of_its_own_world() -> None:
    """Unit: a pending version of a new lineage joins the other ranks of that lineage, but once restored from
    the journal (after a manager restart) only a push naming the same world token does (that world's push
    started over): the world that pushed it may be gone and a restarted world pushes the same version, so a
    resuming push of another token, or naming none, starts the lineage afresh (no lease of the new manager
    would ever end the restored version: joined, a resuming begin of a restored rank is refused until the push
    timeout). A rank record of a manager older than tokens replays as naming none."""
    for token in ("world-a", ""):
        versions = VersionStore(3)
        versions.start_lineage(4)
        specs = [TensorSpec("t0", "float32", [4])]
        (layout,) = versions.begin(4, 0, 2, specs, ["w0"], "lease-4-0", 0.0, resumes=True, holder="rank0",
                                   world_token=token)
        versions.commit_shard(4, 0, "lease-4-0", "w0", "seg-4-0", [msgspec.structs.replace(layout, checksum=7)],
                              [WORKER])
        assert versions.joins_lineage(4, 2, token) and versions.joins_lineage(4, 2)
        done = versions.done_rank(4, 0)
        assert done is not None and done.resumes and done.world_token == token
        restored = VersionStore(3)
        restored.restore_rank(done, 0.0)
        assert restored.pending is not None and not restored.joins_lineage(4, 2)
        assert not restored.joins_lineage(4, 2, "world-b")
        assert restored.joins_lineage(4, 2, token) == bool(token)
        assert restored.of_world(4, 0, token) == bool(token) and not restored.of_world(4, 1, token)
    old = msgspec.to_builtins(done)
    del old["world_token"]
    assert msgspec.convert(old, DoneRank) == done  # the last one named no token



PAUSING_LAUNCHER = [sys.executable, str(Path(__file__).parent / "compaction_pausing_manager.py")]
COMPACT_EVERY = 4  # the pausing manager's COMPACT_MIN_RECORDS: a compaction every dozen records or so
RETAIN = 2  # the cluster's ps.retain_versions (its default)
OP_TIMEOUT_S = 20 * NODE_TIMEOUT_S  # one step of the schedule, its retries across a restart included


def _stopped(proc: NodeProcess) -> bool:
    """Whether ``proc`` is stopped (by a SIGSTOP: state T in /proc)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _registered(observer: PsClient) -> bool:
    """Whether both workers registered with the manager; False when it does not answer (stopped meanwhile)."""
    try:
        return {w.worker for w in observer.status().workers} == WORKERS
    except RequestTimeout:
        return False


def _restart_pausing(spawn, cluster: PsCluster, observer: PsClient, pause: str) -> NodeProcess:
    """The manager started again by the pausing launcher: compactions frequent, and ``pause`` (``N:POINT``, or ""
    for none) stops it inside one (see tests/compaction_pausing_manager.py); once both workers registered, or it
    stopped already (the step in flight at the kill, retried, made records)."""
    env = {"REFBUS_TEST_COMPACT_MIN_RECORDS": str(COMPACT_EVERY), "REFBUS_TEST_PAUSE_COMPACTION": pause}
    new = restart_manager(spawn, cluster, prefix=PAUSING_LAUNCHER, env=env)
    wait_for(lambda: _stopped(new.proc) or _registered(observer), 10 * NODE_TIMEOUT_S,
             "both workers to register with the restarted manager")
    return new


class _Pushes:
    """A seeded schedule of steps by real clients, and the versions they committed: a push of the next version, a
    trainer world resuming at the latest version (a new lineage pushes it again), or a world-2 push whose rank 0 is
    done and whose rank 1 aborts it. Each step is followed by :meth:`check`; run again after it raised (its
    retries gave up while the manager was away), a step that ended is not repeated, one that did not starts over
    and ends the same way."""

    def __init__(self, rng: random.Random, rank0: PsClient, rank1: PsClient) -> None:
        self.rng, self.rank0, self.rank1 = rng, rank0, rank1
        self.committed: dict[int, str] = {}  # version -> digest of what the clients saw committed
        self.steps = 0

    def next(self) -> Callable[[], None]:
        """The schedule's next step and check."""
        step, ended = self._step(), False

        def run() -> None:
            nonlocal ended
            if not ended:
                step()
                ended = True
            self.check()

        return run

    def _step(self) -> Callable[[], None]:
        self.steps += 1
        latest, seed = max(self.committed, default=-1), self.steps
        kind = self.rng.choice(["push", "push", "lineage", "aborted"] if latest >= 0 else ["push"])
        if kind == "push":
            return lambda: self._commit(latest + 1, self.rank0.push(make_state(seed, tensors=3), latest + 1))
        if kind == "lineage":
            return lambda: self._commit(latest, self.rank0.push(make_state(seed, tensors=3), latest, resumes=True,
                                                                world_token=f"world-{seed}"))
        return lambda: self._aborted(latest + 1, make_state(seed, tensors=4))

    def _commit(self, version: int, result: PushResult) -> None:
        assert result.committed
        self.committed = {v: d for v, d in self.committed.items() if v < version} | {version: result.digest}

    def _aborted(self, version: int, state: dict[str, torch.Tensor]) -> None:
        assert not self.rank0.push(rank_part(state, 0, 2), version, rank=0, world=2).committed
        self.rank1.begin_push(rank_part(state, 1, 2), version, rank=1, world=2).abort()

    def check(self) -> None:
        """The manager serves exactly what was committed: the last versions retained, their bytes verified and
        their digests the committed ones, nothing pending (an aborted push's done rank is not), the trainer
        version at the latest."""
        expected = sorted(self.committed)[-RETAIN:]
        status = self.rank0.status()
        assert (status.retained, status.pending, status.trainer_version) == (expected, [], expected[-1]), status
        for version in expected:
            assert self.rank0.pull(version, verify=True).digest == self.committed[version]


def test_a_manager_sigkilled_inside_its_journal_compactions_recovers_what_was_committed(
        cluster: PsCluster, spawn, tmp_path: Path) -> None:
    """Real clients push, resume lineages and abort pushes (a seeded schedule) against a manager whose journal is
    compacted every dozen records. Three times it stops itself (SIGSTOP) inside its 1st or 2nd compaction, between
    a record's bytes and its flag in the new journal or with the new journal whole but not yet renamed over the
    old one, is SIGKILLed there and restarted on the same journal; the step in flight goes on against the new
    process. After every step the state is exactly what was committed: versions retained with their bytes, the
    lineage's versions, no aborted push's done rank pending, the trainer version."""
    rng = random.Random(7)
    pauses = iter([*(f"{rng.randint(1, 2)}:{rng.choice(['rename', 'flag:1', 'flag:3'])}" for _ in range(3)), ""])
    runtime, ps = _client(cluster, "rank0")
    runtime1, ps1 = _client(cluster, "rank1")
    # The test's own client (the steps' run on the pool's thread): one short try, the manager may be stopped.
    observing, observer = _client(cluster, "observer", retry=RetryPolicy(timeout_s=NODE_TIMEOUT_S / 2, attempts=1))
    schedule = _Pushes(rng, ps, ps1)
    new_journal = _journal_file(tmp_path).with_name("journal.new")
    pool = ThreadPoolExecutor(1)
    try:
        _kill(cluster)  # the cluster's first manager, before any push: its journal holds nothing
        pause = next(pauses)
        manager, running, kills, rerun = _restart_pausing(spawn, cluster, observer, pause), None, 0, False
        while pause or running is not None:  # a compaction is due every dozen records: each pause comes soon
            assert schedule.steps < 200, f"the manager never paused inside a compaction ({pause})"
            if running is None:
                step = schedule.next()
                running = pool.submit(step)
            wait_for(lambda: running.done() or _stopped(manager.proc), OP_TIMEOUT_S,  # noqa: B023
                     f"a step to end or the manager to stop inside a compaction ({pause})")
            if _stopped(manager.proc):
                assert new_journal.exists(), pause  # inside the compaction's window
                _kill(cluster)
                kills += 1
                pause = next(pauses)
                manager = _restart_pausing(spawn, cluster, observer, pause)
                rerun = True
            elif running.exception() is not None and rerun:  # its retries gave up while the manager was away
                running, rerun = pool.submit(step), False
            else:
                running.result()  # a failure of the step or of its check, with no kill to blame
                running = None
        # Each restart found the compaction cut short (its new journal) and discarded it: the old journal stood.
        assert manager.log_path.read_text().count('"store.compaction_discarded"') == kills == 3
    finally:
        pool.shutdown(wait=True)
        runtime.close()
        runtime1.close()
        observing.close()
