"""PS replicas and same host by proof, as real processes.

* Every shard has ``ps.replicas`` copies on distinct workers; a version commits once all are verified.
* kill -9 of a worker holding one copy mid-run: pulls go on with 0 failures (the client switches copies),
  no committed version is lost, a push granted to it is retried on another worker, and once the manager
  knows it is down it never hands it out again; with every copy down a pull fails at once naming them.
* A client maps a worker's segments only after proving it is on the worker's host (boot id + nonce file);
  a forged or garbled proof means frames, or a clear error when the client insists on shared memory.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import torch
from polling import wait_for
from ps_support import (
    PsCluster,
    make_state,
    rank_part,
    restart_worker,
    scrape,
    start_cluster,
    stop_cluster_after_kills,
)
from refbus.bus.reqrep import RemoteError, RequestTimeout, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import start_bus
from refbus.nodes.ps import client as ps_client
from refbus.nodes.ps import host_proof
from refbus.nodes.ps.client import PsClient, PsError
from refbus.protocol.messages import Ok
from refbus.protocol.messages_ps import (
    LeaseRelease,
    PsRegister,
    PullBegin,
    PullGrant,
    PushBegin,
    ShardSeal,
    TensorSpec,
    WorkerInfo,
)

# Requests to a killed worker give up after 0.3 + 0.3 s (the broker declares it down after 1 s).
FAST_RETRY = RetryPolicy(timeout_s=0.3, attempts=2, backoff=1.0)
NODE_TIMEOUT_S = 1.0  # tests/conftest.py FAST_LIVENESS


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    _, control = bus
    workers = getattr(request, "param", 3)
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=workers)
    yield cluster
    stop_cluster_after_kills(cluster)


@pytest.fixture
def patient_bus(tmp_path: Path) -> Iterator[str]:
    """A broker that times nodes out after 8 s: a worker killed and restarted at once is replaced, not timed
    out (the supervisor restarts within 0.5 s, the default node timeout is 5 s)."""
    proc, control = start_bus(tmp_path, extra=["--bus-heartbeat-interval-s", "0.2", "--bus-node-timeout-s", "8.0"])
    try:
        yield control
    finally:
        assert proc.stop() == 0, proc.log_tail()


# slow_notice_bus's node timeout: the pusher meets both dead workers (each within one 0.6 s request schedule, plus a
# grant) well before the manager learns they are down, however loaded the machine.
SLOW_NOTICE_S = 6.0


@pytest.fixture
def slow_notice_bus(tmp_path: Path) -> Iterator[str]:
    """A broker that times nodes out after SLOW_NOTICE_S: a worker killed stays registered with the manager (and is
    granted) for a while, yet a test can wait until it is known down."""
    proc, control = start_bus(tmp_path, extra=["--bus-heartbeat-interval-s", "0.2", "--bus-node-timeout-s",
                                               str(SLOW_NOTICE_S)])
    try:
        yield control
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _client(cluster: PsCluster, name: str, **kwargs) -> tuple[NodeRuntime, PsClient]:
    settings = RuntimeSettings(bus=cluster.control, node_id=name, metrics_port=-1, retry=FAST_RETRY)
    runtime = NodeRuntime("ps-client", settings, register=False)
    return runtime, PsClient(runtime, cluster.manager, **kwargs)


def _kill(cluster: PsCluster, name: str) -> None:
    cluster.workers[name].signal(signal.SIGKILL)
    cluster.workers[name].proc.wait(10)


def _workers_of(ps: PsClient, version: int) -> set[str]:
    return {loc.worker for e in ps.manifest(version).entries for loc in e.locations}


def _grant(runtime: NodeRuntime, cluster: PsCluster, version: int | None = None) -> PullGrant:
    """A raw pull grant (released at once): what the manager hands out."""
    manager = runtime.client(cluster.manager)
    grant = manager.request(PullBegin("inspector", version)).body
    assert isinstance(grant, PullGrant)
    manager.request(LeaseRelease(grant.lease))
    return grant


def test_sigkill_of_a_worker_holding_copies_loses_no_version_and_fails_no_pull(cluster: PsCluster) -> None:
    runtime, ps = _client(cluster, "pusher")
    reader_runtime, reader = _client(cluster, "reader", transport="frames")  # every byte through a worker
    stop = threading.Event()
    pulls: list[int] = []
    failures: list[BaseException] = []

    def read_loop() -> None:
        while not stop.is_set():
            try:
                state = reader.pull(verify=True)
                assert torch.equal(state["scale"], torch.tensor(float(state.version)))
                pulls.append(state.version)
            except BaseException as exc:
                failures.append(exc)

    thread = threading.Thread(target=read_loop)
    try:
        for version in range(2):
            assert ps.push(make_state(seed=version), version).committed
        assert _workers_of(ps, 0) == {"w0", "w1"}  # ps.replicas defaults to 2: rank 0 on w0, then w1
        thread.start()
        wait_for(lambda: len(pulls) >= 3, 10, "the reader's first pulls")

        # A push is half-written to w0 and w1 when w1 dies: it is retried on w0 and w2.
        _push_killing_w1_halfway(cluster, ps, make_state(seed=2), 2)
        assert _workers_of(ps, 2) == {"w0", "w2"}

        wait_for(lambda: "w1" not in {w.worker for w in ps.status().workers}, 5 * NODE_TIMEOUT_S,
                 "the manager to learn that w1 is down")
        for version in (3, 4):
            assert ps.push(make_state(seed=version), version).committed
            assert "w1" not in _workers_of(ps, version)
        count = len(pulls)
        wait_for(lambda: len(pulls) >= count + 3, 10, "pulls after the kill")
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the reader still pulls"
        assert failures == [], failures[:3]
        # No version lost: every retained one is whole and readable, and never handed out with w1 in it.
        for version in ps.status().retained:
            grant = _grant(runtime, cluster, version)
            assert "w1" not in {w.worker for w in grant.manifest.workers}
            assert all(loc.worker != "w1" for e in grant.manifest.entries for loc in e.locations)
            assert reader.pull(version, verify=True).version == version

        # Every copy down: the pull fails at once, by the manager, naming the workers.
        _kill(cluster, "w0")
        _kill(cluster, "w2")
        wait_for(lambda: ps.status().workers == [], 5 * NODE_TIMEOUT_S, "the manager to learn all are down")
        with pytest.raises(RemoteError) as err:
            reader.pull()
        assert err.value.code == "copies-down" and "'w0'" in str(err.value) and "'w2'" in str(err.value)
        log = cluster.manager_proc.log_tail(300)  # type: ignore[union-attr]
        assert '"ps.push_retried"' in log and '"ps.worker_down"' in log
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(30)
        reader_runtime.close()
        runtime.close()


def test_a_push_whose_seal_answer_is_lost_after_the_version_committed_returns_it_committed(
        cluster: PsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both copies' seals reach their workers, which commit them at the manager (the version commits and is
    announced), but w1's answer is lost (it died after forwarding its commit, or answered late): the pusher
    takes it for a failed worker and asks for a new grant, which is refused ``push-aborted`` (nothing pending
    to retry). The push returns the committed version instead of failing it, and the next push follows."""
    runtime, ps = _client(cluster, "pusher")
    real = ps_client.gather
    lost: list[str] = []

    def lossy(calls: Any, **kwargs: Any) -> list[Any]:
        outcomes = real(calls, **kwargs)
        if not lost and any(isinstance(body, ShardSeal) for _, body in calls):
            lost.append(calls[1][0].endpoint)
            outcomes[1] = RequestTimeout(f"no reply from {calls[1][0].endpoint}")
        return outcomes

    monkeypatch.setattr(ps_client, "gather", lossy)
    try:
        state = make_state(seed=1)
        with structlog.testing.capture_logs() as logs:
            result = ps.push(state, 0)
        assert lost and result.committed and result.digest == ps.manifest(0).digest
        assert [e["event"] for e in logs if e["event"].startswith(("push.", "ps.push"))] == [
            "push.worker_failed", "ps.push_found_committed"]
        assert ps.push(make_state(seed=2), 1).committed and ps.status().latest == 1
    finally:
        runtime.close()


def test_bad_replica_and_grant_fields_get_clear_errors(cluster: PsCluster) -> None:
    runtime, ps = _client(cluster, "garbage")
    try:
        ps.push(make_state(seed=1), 0)
        manager = runtime.client(cluster.manager)
        specs = [TensorSpec("scale", "float32", [])]
        with pytest.raises(RemoteError) as err:  # a retry of a lease that is no push in progress
            manager.request(PushBegin(1, 0, 1, "raw", specs, retry="push-nonsense"))
        assert err.value.code == "push-aborted" and "push-nonsense" in str(err.value)
        with pytest.raises(RemoteError) as err:  # every worker avoided
            manager.request(PushBegin(1, 0, 1, "raw", specs, avoid=["w0", "w1", "w2"]))
        assert err.value.code == "no-workers" and "'w2'" in str(err.value)
        grant = manager.request(PushBegin(1, 0, 1, "raw", specs, avoid=["w0", "not-a-worker"])).body
        assert grant.worker.worker == "w1" and [w.worker for w in grant.replicas] == ["w2"]
        with pytest.raises(RemoteError) as err:  # another rank's lease
            manager.request(PushBegin(1, 1, 2, "raw", specs, retry=grant.lease))
        assert err.value.code == "push-aborted"
        manager.request(LeaseRelease(grant.lease))  # aborts version 1
        # A malformed field is refused by the manager's decoder, naming it, and the manager goes on serving.
        with pytest.raises(RemoteError) as err:
            manager.request(PushBegin(1, 0, 1, "raw", specs, avoid=[""]))
        assert "avoid" in str(err.value)
        assert ps.push(make_state(seed=2), 1).committed
    finally:
        runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_same_host_by_proof_and_a_garbled_proof_means_frames(cluster: PsCluster) -> None:
    runtime, ps = _client(cluster, "prover")
    try:
        state = make_state(seed=3)
        ps.push(state, 0)
        info = ps.status().workers[0]
        assert info.boot_id == host_proof.boot_id() and info.nonce and info.nonce_file
        assert host_proof.refusal(info, host_proof.boot_id()) is None
        assert ps.pull().version == 0 and ps.read_bytes["shm"] > 0 and ps.read_bytes["frames"] == 0

        # The host name says "same host" but the proof does not hold: frames, and an error in the log.
        nonces = [Path(w.shm_dir) / w.nonce_file for w in ps.status().workers]
        nonce = nonces[0]
        for forged in (msgspec.structs.replace(info, boot_id="0" * 36),
                       msgspec.structs.replace(info, nonce="f" * 32),
                       msgspec.structs.replace(info, nonce_file="../../etc/hostname"),
                       msgspec.structs.replace(info, nonce_file="", nonce="", boot_id="")):
            assert host_proof.refusal(forged, host_proof.boot_id()) is not None
        original = nonce.read_bytes()
        for garbage in (b"", b"\xff\x00" * 100, original + b"\n", b"x" * 4096):
            nonce.write_bytes(garbage)
            assert "another nonce" in (host_proof.refusal(info, host_proof.boot_id()) or "")
        originals = [path.read_bytes() for path in nonces]
        for path in nonces:
            path.write_bytes(b"\x00garbled")
        fresh_runtime, fresh = _client(cluster, "fresh")
        strict_runtime, strict = _client(cluster, "strict", transport="shm")
        try:
            pulled = fresh.pull(verify=True)
            assert pulled.version == 0 and fresh.read_bytes["shm"] == 0 and fresh.read_bytes["frames"] > 0
            assert all(torch.equal(pulled[name], state[name]) for name in state)
            with pytest.raises(PsError, match="not proved to be on this host"):
                strict.pull()
        finally:
            fresh_runtime.close()
            strict_runtime.close()
        for path, content in zip(nonces, originals, strict=True):
            path.write_bytes(content)
        # The workers kept serving: a push and a mapped pull work as before.
        assert ps.push(make_state(seed=4), 1).committed
        assert ps.pull().version == 1

        # A registration carrying a garbled proof is kept as data, never trusted: pulls avoid mapping it.
        fake = WorkerInfo("fake", "tcp://127.0.0.1:9", info.host, info.shm_dir, 1, "\x00" * 3, "/etc/passwd", "")
        assert isinstance(runtime.client(cluster.manager).request(PsRegister(fake)).body, Ok)
        assert host_proof.refusal(fake, host_proof.boot_id()) is not None
    finally:
        runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_push_mapping_one_copy_and_sending_the_other_as_frames_hashes_each_tensor_once_and_both_verify(
    cluster: PsCluster,
) -> None:
    """w1's proof is garbled, so a push maps w0's segment and sends w1's copy as frames: each tensor is hashed
    once, on its way into w0's segment, and that checksum is what w1's seal checks the frames against."""
    runtime, ps = _client(cluster, "prover")
    try:
        w1 = next(w for w in ps.status().workers if w.worker == "w1")
        nonce = Path(w1.shm_dir) / w1.nonce_file
        original = nonce.read_bytes()
        nonce.write_bytes(b"\x00garbled")
        try:
            state = make_state(seed=7)
            assert ps.push(state, 0).committed
        finally:
            nonce.write_bytes(original)
        non_empty = sum(1 for t in state.values() if t.numel())
        w0, w1_metrics = cluster.worker_info["w0"]["metrics"], cluster.worker_info["w1"]["metrics"]
        assert scrape(w0, "refbus_ps_sealed_tensors_total", digest="segment") == len(state)  # mapped: no frames
        assert scrape(w1_metrics, "refbus_ps_sealed_tensors_total", digest="streamed") == non_empty
        reader_runtime, reader = _client(cluster, "reader", transport="frames")
        try:
            pulled = reader.pull(0, verify=True)
            assert all(torch.equal(pulled[name], t) for name, t in state.items())
        finally:
            reader_runtime.close()
    finally:
        runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_pull_falls_to_the_next_copy_when_a_worker_dies_unannounced(cluster: PsCluster) -> None:
    """Reads that a killed worker (not yet known down) never answers go to the next copy."""
    runtime, ps = _client(cluster, "pusher")
    reader_runtime, reader = _client(cluster, "reader", transport="frames")
    try:
        ps.push(make_state(seed=5), 0)
        _kill(cluster, "w0")  # the first copy of every tensor; the manager does not know yet
        pulled = reader.pull(verify=True)
        assert pulled.version == 0 and torch.equal(pulled["scale"], torch.tensor(5.0))
        assert reader.read_bytes["frames"] > 0
        assert ps.status().leases == 0
    finally:
        reader_runtime.close()
        runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_worker_death_between_two_ranks_keeps_the_pending_version(cluster: PsCluster) -> None:
    """Rank 0's copies are verified on w0 and w1, then w1 dies before rank 1 pushes: rank 0 lost one copy
    (as a committed version would), the version still commits and reads whole from w0."""
    runtime, ps = _client(cluster, "ranks")
    try:
        state = make_state(seed=6)
        assert not ps.push(rank_part(state, 0, 2), 0, rank=0, world=2).committed
        _kill(cluster, "w1")
        wait_for(lambda: "w1" not in {w.worker for w in ps.status().workers}, 5 * NODE_TIMEOUT_S,
                 "the manager to learn that w1 is down")
        assert ps.status().pending == [0]
        assert ps.push(rank_part(state, 1, 2), 0, rank=1, world=2).committed
        assert _workers_of(ps, 0) == {"w0", "w1"}  # the manifest records both copies of rank 0
        grant = _grant(runtime, cluster, 0)
        assert {loc.worker for e in grant.manifest.entries for loc in e.locations} == {"w0"}  # w1 never handed out
        pulled = ps.pull(verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
    finally:
        runtime.close()


def _push_killing_w1_halfway(cluster: PsCluster, ps: PsClient, state: dict[str, torch.Tensor], version: int) -> None:
    """Push ``state`` granted to w0 and w1, SIGKILL w1 after half the tensors are written: the push must be
    granted again on w0 and w2 and commit."""
    names = list(state)
    with ps.begin_push(state, version) as session:
        assert session.workers == ["w0", "w1"]
        for name in names[: len(names) // 2]:
            session.write(name, state[name])
        _kill(cluster, "w1")
        for name in names[len(names) // 2 :]:
            session.write(name, state[name])
        result = session.commit()
    assert result.committed and session.grants == 2 and session.workers == ["w0", "w2"]


def test_a_frames_push_streaming_to_a_worker_killed_mid_push_is_written_again_elsewhere(cluster: PsCluster) -> None:
    """The push's writes stream (several in flight, sent as each is ready): the write that meets the dead
    worker fails the copy, the rank gets a new grant without it and writes everything again there."""
    runtime, ps = _client(cluster, "pusher", transport="frames", chunk_bytes=1)  # one write per piece
    reader_runtime, reader = _client(cluster, "reader", transport="frames")
    try:
        state = make_state(seed=5)
        _push_killing_w1_halfway(cluster, ps, state, 0)
        pulled = reader.pull(0, verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert reader.read_bytes["frames"] > 0 and ps.read_bytes["shm"] == 0
        # w2 was written only by the second grant, in order: its seal took every digest as the pieces streamed in.
        metrics = cluster.worker_info["w2"]["metrics"]
        empty = sum(1 for t in state.values() if t.numel() == 0)  # nothing to stream: hashed (for nothing) at seal
        assert empty and scrape(metrics, "refbus_ps_sealed_tensors_total", digest="streamed") == len(state) - empty
        assert scrape(metrics, "refbus_ps_sealed_tensors_total", digest="segment") == empty
    finally:
        reader_runtime.close()
        runtime.close()


def test_a_frames_push_whose_every_worker_dies_fails_naming_them(cluster: PsCluster) -> None:
    runtime, ps = _client(cluster, "pusher", transport="frames", chunk_bytes=1, wait_workers_s=0.0)
    try:
        state = make_state(seed=6)
        names = list(state)
        with ps.begin_push(state, 0) as session:
            session.write(names[0], state[names[0]])
            for name in ("w0", "w1", "w2"):
                _kill(cluster, name)
            # Either every grant's workers fail (named, with the grants used), or the manager knows them all
            # down and has none left to grant.
            with pytest.raises((PsError, RemoteError), match=r"ps-worker w[012] failed|no-workers"):
                for name in names[1:]:
                    session.write(name, state[name])
                session.commit()
        assert ps.status().latest == -1  # nothing committed
    finally:
        runtime.close()


def test_a_worker_killed_and_restarted_at_once_under_its_id_stays_registered(patient_bus, spawn) -> None:
    """The new w1 registers with the manager before its runtime joins the bus; joining makes the broker report
    the killed process ``replaced``, which reaches the manager after the new one registered: that news of an
    earlier process must not drop the live worker."""
    cluster = start_cluster(spawn, patient_bus, "replaced", workers=2)
    runtime, ps = _client(cluster, "inspector")
    try:
        _kill(cluster, "w1")
        new = restart_worker(spawn, cluster, "w1")
        manager = cluster.manager_proc
        assert manager is not None

        def heard_down() -> list[dict]:  # logged by the manager's peer view right before its listener runs
            records = [json.loads(line) for line in manager.log_tail(400).splitlines() if line.startswith("{")]
            return [r for r in records if r.get("event") == "peer.down" and r.get("node") == "w1"]

        assert wait_for(heard_down, 10, "the manager to hear that the killed w1 is down")[0]["reason"] == "replaced"
        registered = {w.worker: w for w in ps.status().workers}
        assert "w1" in registered and registered["w1"].pid == new.pid
        assert ps.push(make_state(seed=1, tensors=2), 0).committed
        assert _workers_of(ps, 0) == {"w0", "w1"}  # the new w1 is granted its copy
        assert ps.pull(0, verify=True).version == 0
    finally:
        runtime.close()
    stop_cluster_after_kills(cluster)


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_restarted_worker_releases_the_readopted_shards_whose_release_it_missed(cluster: PsCluster,
                                                                                 spawn) -> None:
    """Version 0 has a copy on w1; w1 is down when version 0 retires, so its release never reaches it. The
    restarted w1 re-adopts that copy from its durable store and lists it at registration: the manager
    releases it there and then."""
    runtime, ps = _client(cluster, "pusher")
    try:
        assert ps.push(make_state(seed=1, tensors=2), 0).committed and _workers_of(ps, 0) == {"w0", "w1"}
        _kill(cluster, "w1")
        wait_for(lambda: "w1" not in {w.worker for w in ps.status().workers}, 5 * NODE_TIMEOUT_S,
                 "the manager to learn that w1 is down")
        for version in (1, 2):
            assert ps.push(make_state(seed=version, tensors=2), version).committed
        assert ps.status().retained == [1, 2]  # version 0 retired while w1 was down
        new = restart_worker(spawn, cluster, "w1")
        assert '"store.readopted"' in new.log_tail(400)
        wait_for(lambda: cluster.held("w1") == 0, 10, "the restarted w1 to release version 0's copy")
        assert '"ps.orphans_released"' in cluster.manager_proc.log_tail(400)  # type: ignore[union-attr]
    finally:
        runtime.close()



def test_a_push_that_failed_on_every_worker_is_granted_them_again_once_restarted(slow_notice_bus, spawn) -> None:
    """Both workers of a push's grant are SIGKILLed mid-push: its copy fails on w0, the new grant (without w0)
    names w1, whose death the broker has not noticed yet, and fails too; every worker is avoided, the grant is
    refused ``no-workers``. Both restart under their ids as new processes: those are not the ones that failed,
    so the push is granted them and commits, instead of waiting out ``wait_workers_s`` and failing."""
    cluster = start_cluster(spawn, slow_notice_bus, "avoided", workers=2)
    runtime, ps = _client(cluster, "pusher", transport="frames", chunk_bytes=1, wait_workers_s=30.0)
    inspector_runtime, inspector = _client(cluster, "inspector")
    state = make_state(seed=1, tensors=4)
    outcome: list[Any] = []

    def finish(session: ps_client.PushSession) -> None:
        try:
            for name, tensor in state.items():
                session.write(name, tensor)
            outcome.append(session.commit())
        except BaseException as exc:
            outcome.append(exc)
        finally:
            session.abort()

    try:
        with structlog.testing.capture_logs() as logs:
            session = ps.begin_push(state, 0)
            assert session.workers == ["w0", "w1"]
            _kill(cluster, "w0")
            _kill(cluster, "w1")
            pusher = threading.Thread(target=finish, args=(session,))
            pusher.start()
            wait_for(lambda: any(e["event"] == "push.waiting_for_workers" for e in logs), SLOW_NOTICE_S,
                     "the push to be refused no-workers, every worker avoided")
            # Restarted once the old processes are known down, so each serves as soon as it registers.
            wait_for(lambda: inspector.status().workers == [], 5 * SLOW_NOTICE_S, "the manager to learn both are down")
            restart_worker(spawn, cluster, "w0")
            restart_worker(spawn, cluster, "w1")
            pusher.join(ps.wait_workers_s + 10)
        assert not pusher.is_alive(), "the push still runs"
        assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
        assert outcome[0].committed and session.grants == 3 and set(session.workers) <= {"w0", "w1"}
        assert [e["worker"] for e in logs if e["event"] == "push.worker_failed"] == ["w0", "w1"]
        assert inspector.pull(0, verify=True).version == 0
    finally:
        inspector_runtime.close()
        runtime.close()
    stop_cluster_after_kills(cluster)
