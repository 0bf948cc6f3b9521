"""The parameter server as real processes: push, pull, leases, crashes, retention, casts and bad input.

Every cluster is a broker, a ps-manager and ps-workers started through ``NodeProcess`` with a short lease TTL;
trainer ranks and rollout workers that must die are actor processes (``ps_support.py``), or a real rollout
worker whose refresh freezes half-way (``stalling_entry_points.policy``). Each test checks at the end that no
shared-memory segment of its cluster is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from polling import pause, wait_for
from ps_support import (
    LEASE_TTL_S,
    Actor,
    PsCluster,
    checksums,
    make_state,
    rank_part,
    scrape,
    segments,
    start_cluster,
)
from refbus.bus.reqrep import RemoteError
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import start_bus
from refbus.nodes.ps.client import WORKERS_FIRST_PAUSE_S, PsError
from refbus.nodes.toy.policy import make_policy
from refbus.protocol.codec import checksum
from refbus.protocol.messages import VersionBump
from refbus.protocol.messages_ps import (
    ByteRange,
    LeaseRelease,
    PsRegister,
    PushBegin,
    Release,
    ShardOpen,
    ShardSeal,
    ShardTensor,
    ShardWrite,
    TensorSpec,
)
from stalling_entry_points import FREEZE_ENV
from structlog.testing import capture_logs

TESTS = Path(__file__).parent


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    _, control = bus
    yield from _running_cluster(spawn, control, request)


# How long the stall test stops its ps-manager: three lease TTLs, so every lease's deadline passes meanwhile.
MANAGER_PAUSE_S = 3 * LEASE_TTL_S


@pytest.fixture
def patient_cluster(tmp_path: Path, spawn, request) -> Iterator[PsCluster]:
    """A cluster whose broker times nodes out after four lease TTLs: a ps-manager stopped for MANAGER_PAUSE_S
    is not reported down."""
    bus, control = start_bus(tmp_path, extra=["--bus-heartbeat-interval-s", "0.2",
                                              "--bus-node-timeout-s", str(4 * LEASE_TTL_S)])
    try:
        yield from _running_cluster(spawn, control, request)
    finally:
        assert bus.stop() == 0, bus.log_tail()


def _running_cluster(spawn, control: str, request) -> Iterator[PsCluster]:
    """A cluster on the broker at ``control`` (extra flags from ``request.param``) while the test runs; then its
    actors and processes are stopped (each must exit 0) and no shared-memory segment may be left."""
    extra = getattr(request, "param", [])
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=2, extra=extra)
    actors: list[Actor] = []
    cluster.actors = actors  # type: ignore[attr-defined]
    yield cluster
    for actor in actors:
        actor.stop()
    for proc in [*cluster.workers.values(), cluster.manager_proc]:
        assert proc is not None and proc.stop() == 0, proc.log_tail() if proc else ""
    assert segments(cluster.prefix) == [], "shared-memory segments leaked"


def actor(cluster: PsCluster, *args: str) -> Actor:
    started = Actor(*args, "--manager", cluster.manager)
    cluster.actors.append(started)  # type: ignore[attr-defined]
    return started


def test_two_trainer_ranks_push_and_two_rollouts_pull_byte_identical(cluster: PsCluster) -> None:
    state = make_state(seed=7)
    pushers = [actor(cluster, "push", "--version", "0", "--rank", str(r), "--world", "2", "--seed", "7")
               for r in range(2)]
    results = [p.expect("pushed") for p in pushers]
    assert sorted(r["committed"] for r in results) == [False, True]  # the last rank's ack commits
    digest = next(r["digest"] for r in results if r["committed"])
    pullers = [actor(cluster, "pull") for _ in range(2)]
    pulled = [p.expect("pulled") for p in pullers]
    assert all(p["version"] == 0 and p["digest"] == digest for p in pulled)
    assert all(p["checksums"] == checksums(state) for p in pulled)

    runtime, ps = cluster.client(transport="frames")
    try:
        over_frames = ps.pull(verify=True)
        assert over_frames.digest == digest
        assert all(torch.equal(over_frames[name], t) for name, t in state.items())
        placed = {loc.worker for e in ps.manifest().entries for loc in e.locations}
        assert placed == {"w0", "w1"}  # each rank's shard went to its own worker
    finally:
        runtime.close()


def test_readers_never_wait_for_a_push_and_never_see_a_torn_version(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        first = ps.push(make_state(seed=1), 0)
        pusher = actor(cluster, "push", "--version", "1", "--seed", "2", "--pause")
        pusher.expect("paused")  # version 1 is half written and stays so while the readers run
        seen: list[tuple[int, str]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader(index: int) -> None:
            rt, client = cluster.client(name=f"reader-{index}")
            try:
                while not stop.is_set():
                    pulled = client.pull(verify=True)  # verify: the bytes hash to the manifest
                    seen.append((pulled.version, pulled.digest))
            except BaseException as exc:
                errors.append(exc)
            finally:
                rt.close()

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        try:
            for thread in threads:
                thread.start()
            # The push stays open (its lease renewed) until resumed below: a pull that waited for it, or for its
            # lease to lapse, would not end meanwhile.
            wait_for(lambda: len(seen) >= 24, 20, "pulls while the push is open")
            assert {v for v, _ in seen} == {0}, "a reader saw the version still being pushed"
            pusher.resume()
            second = pusher.expect("pushed")
            count = len(seen)
            wait_for(lambda: any(v == 1 for v, _ in seen[count:]), 20, "readers to see version 1")
        finally:
            stop.set()
            for thread in threads:
                if thread.ident is not None:
                    thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "a reader still pulls"
        assert not errors, errors
        assert set(seen) <= {(0, first.digest), (1, second["digest"])}
    finally:
        runtime.close()


def test_killed_puller_lease_expires_and_pushes_proceed(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        ps.push(make_state(seed=1), 0)
        one_version = cluster.held("w0")
        holder = actor(cluster, "pull", "--hold")
        assert holder.expect("pulled")["version"] == 0
        holder.expect("holding")
        assert ps.status().pinned == {"0": 1}
        holder.kill()
        # Pushes never wait for readers, and version 0 stays held for the dead reader until its lease ends.
        for version in (1, 2, 3):
            assert ps.push(make_state(seed=version), version).committed
        state = ps.status()
        assert state.retained == [2, 3] and state.pinned == {"0": 1}
        wait_for(lambda: ps.status().pinned == {}, 5 * LEASE_TTL_S, "the dead reader's lease to expire")
        assert ps.status().leases == 0
        # Version 0 is freed: only the two retained versions' shards stay in use on w0.
        wait_for(lambda: cluster.held("w0") == 2 * one_version, 5, "version 0's shard to be released")
        log = cluster.manager_proc.log_tail(200)  # type: ignore[union-attr]
        assert '"ps.lease_expired"' in log and '"kind": "pull"' in log
        assert scrape(cluster.manager_metrics, "refbus_ps_leases_expired_total", kind="pull") == 1
        assert scrape(cluster.manager_metrics, "refbus_ps_leases_active", kind="pull") == 0
    finally:
        runtime.close()


def test_a_manager_stopped_past_the_lease_ttl_ends_no_renewed_lease_on_waking(patient_cluster: PsCluster) -> None:
    """A ps-manager process stopped (SIGSTOP) for three lease TTLs and then continued ends no lease whose holder
    renewed it all along: the renewals of that time wait unread in the manager's socket, and the time it did not
    run counts toward no lease's life (it logs ``ps.stalled``). The holder's release succeeds. A lease whose holder
    was killed before the pause still expires, within a few TTLs of the wake-up."""
    cluster = patient_cluster
    manager = cluster.manager_proc
    assert manager is not None
    runtime, ps = cluster.client()
    try:
        for version in (0, 1):
            ps.push(make_state(seed=version), version)
        held = ps.pull(0, shared=True)  # its lease renewed by this process's lease keeper throughout
        gone = actor(cluster, "pull", "--version", "1", "--hold")
        assert gone.expect("pulled")["version"] == 1
        gone.expect("holding")
        gone.kill()  # its lease on version 1 is renewed no more
        assert ps.status().pinned == {"0": 1, "1": 1}
        pause(manager, MANAGER_PAUSE_S, stop_within=LEASE_TTL_S)  # every lease's deadline passes meanwhile

        def only_the_renewed_lease_left() -> bool:
            pinned = ps.status().pinned
            assert "0" in pinned, f"the lease its holder kept renewing ended at the manager's wake-up: {pinned}"
            return pinned == {"0": 1}

        wait_for(only_the_renewed_lease_left, 3 * LEASE_TTL_S, "the killed holder's lease to expire after the wake-up")
        held.release()  # raises LeaseExpired had the manager ended the lease
        assert ps.status().leases == 0
        records = [json.loads(line) for line in manager.log_tail(400).splitlines() if line.startswith("{")]
        stalled = [r["seconds"] for r in records if r.get("event") == "ps.stalled"]
        assert sum(stalled) >= MANAGER_PAUSE_S - LEASE_TTL_S, stalled
        assert [(r["kind"], r["version"]) for r in records if r.get("event") == "ps.lease_expired"] == [("pull", 1)]
    finally:
        runtime.close()


def test_a_rollout_killed_mid_refresh_holds_nothing_once_dead(cluster: PsCluster, spawn, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout worker process SIGKILLed in the middle of a weight refresh (a version bump's pull, one tensor
    of its model written): the pull lease its lease keeper renewed expires, the version it was reading is
    freed once retired, and no segment is left at the end (the fixture)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    frozen = tmp_path / "frozen"
    monkeypatch.setenv(FREEZE_ENV, f"2:{frozen}")  # its pull of version 0 completes, the next one freezes
    runtime, ps = cluster.client()
    try:
        ps.push(dict(make_policy(1).state_dict()), 0)
        one_version = cluster.held("w0")
        rollout = spawn(["node", "rollout", "--node-id", "rollout-killed", "--ps-manager", cluster.manager,
                         "--rl-policy", "stalling_entry_points:policy", *cluster.flags], "rollout")
        metrics = rollout.wait_ready()["metrics"]
        wait_for(lambda: scrape(metrics, "refbus_rollout_policy_version") == 0, 10, "the rollout to pull version 0")
        ps.push(dict(make_policy(2).state_dict()), 1)  # its bump starts the refresh that freezes
        wait_for(frozen.exists, 10, "the rollout's refresh of version 1 to stop half-way")
        assert ps.status().pinned == {"1": 1}
        rollout.signal(signal.SIGKILL)
        assert rollout.proc.wait(10) == -signal.SIGKILL
        wait_for(lambda: ps.status().pinned == {}, 5 * LEASE_TTL_S, "the killed rollout's lease to expire")
        assert ps.status().leases == 0
        records = [json.loads(line) for line in cluster.manager_proc.log_tail(400).splitlines()  # type: ignore[union-attr]
                   if line.startswith("{")]
        assert [(r["kind"], r["version"]) for r in records
                if r.get("event") == "ps.lease_expired" and r.get("holder") == "rollout-killed"] == [("pull", 1)]
        for version in (2, 3):  # versions 0 and 1 retire: both freed, nothing read them any more
            assert ps.push(dict(make_policy(version + 1).state_dict()), version).committed
        wait_for(lambda: cluster.held("w0") == 2 * one_version, 5, "versions 0 and 1 to be released")
    finally:
        runtime.close()


def test_killed_pusher_never_commits_and_its_memory_is_reclaimed(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        ps.push(make_state(seed=1), 0)
        before = cluster.held("w0")
        pusher = actor(cluster, "push", "--version", "1", "--seed", "2", "--pause")
        pusher.expect("paused")
        assert ps.status().pending == [1]
        assert cluster.held("w0") > before  # its segment is in use
        pusher.kill()
        wait_for(lambda: ps.status().pending == [], 5 * LEASE_TTL_S, "the dead pusher's lease to expire")
        assert ps.status().latest == 0
        wait_for(lambda: cluster.held("w0") == before, 5, "the aborted shard's memory to be released")
        with pytest.raises(RemoteError) as err:
            ps.pull(1)
        assert err.value.code == "unknown-version"
        # The version can be pushed again, into the recycled segment (no new memory).
        created = _segments_created(cluster)
        assert ps.push(make_state(seed=2), 1).committed
        assert _segments_created(cluster) == created
    finally:
        runtime.close()


def test_registrations_naming_no_worker_id_or_no_address_are_refused_and_the_manager_serves_on(
        cluster: PsCluster) -> None:
    """Pushers, pullers and the manager connect to the endpoint a ps-register names: before, any was taken (a port
    over 65535 ZeroMQ takes modulo 65536, a bind's wildcard, no address at all), under any worker id (``../x``).
    Each is refused ``schema`` naming the field; the registered workers stay as they were, and serve."""
    runtime, ps = cluster.client()
    try:
        w0 = next(w for w in ps.status().workers if w.worker == "w0")
        manager = runtime.client(cluster.manager)
        garbage = [("worker", {"worker": "../x"}), ("worker", {"worker": "w\n0"}), ("worker", {"worker": "-w"}),
                   ("endpoint", {"endpoint": "tcp://127.0.0.1:70000"}), ("endpoint", {"endpoint": "tcp://*:5"}),
                   ("endpoint", {"endpoint": "not an endpoint"}), ("endpoint", {"endpoint": ""})]
        for field, fields in garbage:
            with pytest.raises(RemoteError) as err:
                manager.request(PsRegister(msgspec.structs.replace(w0, **{"worker": "rogue", **fields})))
            assert err.value.code == "schema" and f"ps-register.worker.{field}:" in str(err.value), (fields, err.value)
        assert sorted(w.worker for w in ps.status().workers) == ["w0", "w1"]
        assert ps.push(make_state(seed=3), 0).committed
        assert ps.pull().version == 0
    finally:
        runtime.close()


def _segments_created(cluster: PsCluster) -> float:
    return scrape(cluster.worker_info["w0"]["metrics"], "refbus_ps_segments_created_total")


def test_retained_versions_and_freeing_once_unread(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        states = [make_state(seed=v) for v in range(5)]
        ps.push(states[0], 0)
        ps.push(states[1], 1)
        reader = ps.pull(1, shared=True)  # holds version 1 while it is retired
        for version in (2, 3, 4):
            ps.push(states[version], version)
        status = ps.status()
        assert status.retained == [3, 4] and status.pinned == {"1": 1}
        assert all(torch.equal(reader[name], t) for name, t in states[1].items())  # still intact
        with pytest.raises(RemoteError) as err:
            ps.pull(1)
        assert err.value.code == "unknown-version" and "retained: [3, 4]" in str(err.value)
        held = cluster.held("w0")
        reader.release()
        assert ps.status().pinned == {}
        wait_for(lambda: cluster.held("w0") < held, 5, "version 1 to be freed")
        assert cluster.held("w0", "free") > 0  # kept mapped for reuse, not unmapped
        latest = ps.pull()
        assert latest.version == 4 and all(torch.equal(latest[n], t) for n, t in states[4].items())
        metrics = cluster.manager_metrics
        assert scrape(metrics, "refbus_ps_current_version") == 4
        assert scrape(metrics, "refbus_ps_versions_committed_total") == 5
        assert scrape(metrics, "refbus_ps_push_seconds_count") == 5
        assert scrape(metrics, "refbus_ps_pull_seconds_count") == 2
    finally:
        runtime.close()


def test_strided_and_contiguous_tensors_pushed_through_shared_memory_pull_back_byte_identical(
        cluster: PsCluster) -> None:
    """A CPU-contiguous tensor is hashed on its way into the segment, any other copied by torch and hashed
    from the segment: both seal against the worker's own hash of the segment and pull back the same."""
    runtime, ps = cluster.client()
    try:
        base = torch.arange(48 * 70_000, dtype=torch.float32).reshape(48, 70_000)  # 13 MiB: many fused steps
        state = {"transposed": base[:8, :16].t(), "every-other": base[:, ::2], "contiguous": base,
                 "bf16": base[0].to(torch.bfloat16), "empty": torch.empty(0, 3)}
        assert not state["transposed"].is_contiguous() and state["contiguous"].is_contiguous()
        assert ps.push(state, 0).committed
        pulled = ps.pull(verify=True)
        assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert ps.read_bytes["shm"] > 0
    finally:
        runtime.close()


def test_pull_casts_with_keep_fp32_and_into_existing_tensors(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        state = make_state(seed=3)
        ps.push(state, 0)
        cast = ps.pull(dtype=torch.bfloat16, keep_fp32=("*.norm.weight", "scale"))
        for name, tensor in state.items():
            if not tensor.is_floating_point():
                assert cast[name].dtype == tensor.dtype and torch.equal(cast[name], tensor)
            elif name.endswith(".norm.weight") or name == "scale":
                assert cast[name].dtype == torch.float32 and torch.equal(cast[name], tensor.float())
            else:
                assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], tensor.to(torch.bfloat16))
        out = {name: torch.zeros_like(t) for name, t in state.items()}
        into = ps.pull(out=out)
        assert all(into[name] is out[name] and torch.equal(out[name], t) for name, t in state.items())
        with ps.pull(shared=True) as shared:
            weight = shared["layer0.weight"]
            assert torch.equal(weight, state["layer0.weight"])
        with pytest.raises(PsError, match="shape"):
            ps.pull(out={"layer0.weight": torch.zeros(1)})
    finally:
        runtime.close()


def test_version_bump_is_published_after_the_commit(cluster: PsCluster) -> None:
    watcher = NodeRuntime("watcher", RuntimeSettings(bus=cluster.control, metrics_port=-1))
    bumps: list[VersionBump] = []
    pullable: list[bool] = []
    runtime, ps = cluster.client()

    def on_bump(message) -> None:
        bumps.append(message.body)
        # The bump is never ahead of the commit: the version is already readable when it arrives.
        pullable.append(ps.manifest(message.body.version).digest == message.body.manifest_digest)

    watcher.subscribe(on_bump, kinds=frozenset({VersionBump.kind}))
    try:
        watcher.start()
        results = []
        for version in range(3):
            results.append(ps.push(make_state(seed=version), version))
            watcher.loop(until=lambda: len(bumps) > version)  # noqa: B023 - evaluated within the iteration
        assert [b.version for b in bumps] == [0, 1, 2]
        assert [b.manifest_digest for b in bumps] == [r.digest for r in results]
        assert pullable == [True, True, True]
    finally:
        watcher.close()
        runtime.close()


def test_bad_input_gets_clear_errors(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        with pytest.raises(RemoteError) as err:
            ps.pull()
        assert err.value.code == "unknown-version" and "no version" in str(err.value)
        state = make_state(seed=1)
        ps.push(state, 0)
        with pytest.raises(RemoteError) as err:
            ps.pull(7)
        assert err.value.code == "unknown-version" and "version 7" in str(err.value)
        with pytest.raises(RemoteError) as err:
            ps.push(state, 5)
        assert err.value.code == "version-conflict" and "next version is 1" in str(err.value)
        wrong = dict(state, **{"layer0.weight": torch.zeros(3, 3)})
        with pytest.raises(RemoteError) as err:
            ps.push(wrong, 1)
        assert err.value.code == "shape-mismatch" and "layer0.weight" in str(err.value)
        assert ps.status().pending == []  # a refused push leaves nothing behind

        # Two ranks claiming the same tensor, and a rank outside the world.
        with ps.begin_push(rank_part(state, 0, 2), 1, rank=0, world=2):
            with pytest.raises(RemoteError) as err:
                ps.push(rank_part(state, 0, 2), 1, rank=1, world=2)
            assert err.value.code == "duplicate-name"
        with pytest.raises(RemoteError) as err:
            ps.push(state, 1, rank=2, world=2)
        assert err.value.code == "bad-rank"

        # A shard whose declared layout or checksums do not match what was granted and written.
        manager = runtime.client(cluster.manager)
        specs = [TensorSpec("a", "float32", [4]), TensorSpec("b", "int64", [2])]
        grant = manager.request(PushBegin(1, 0, 1, "raw", specs)).body
        worker = runtime.client(grant.worker.endpoint)
        worker.request(ShardOpen(grant.lease, grant.nbytes))
        data = [np.ones(4, np.float32).view(np.uint8), np.array([5, 6], np.int64).view(np.uint8)]
        worker.request(ShardWrite(grant.lease, [t.offset for t in grant.tensors], data))
        right = [ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, checksum(d))
                 for t, d in zip(grant.tensors, data, strict=True)]
        wrong_sum = [right[0], msgspec.structs.replace(right[1], checksum=right[1].checksum ^ 1)]
        with pytest.raises(RemoteError) as err:
            worker.request(ShardSeal(grant.lease, 1, 0, wrong_sum))
        assert err.value.code == "checksum" and "'b'" in str(err.value)
        reshaped = [right[0], ShardTensor("b", "int64", [1], right[1].offset, 8, checksum(data[1][:8]))]
        with pytest.raises(RemoteError) as err:
            worker.request(ShardSeal(grant.lease, 1, 0, reshaped))
        assert err.value.code == "manifest-mismatch" and "'b'" in str(err.value) and "shape" in str(err.value)
        # One verified copy of the two the grant names (ps.replicas 2) does not commit the version.
        assert not worker.request(ShardSeal(grant.lease, 1, 0, right)).body.committed
        assert ps.status().latest == 0
        # A verified copy's bytes are what readers will be promised: no write changes them any more.
        with pytest.raises(RemoteError) as err:
            worker.request(ShardWrite(grant.lease, [grant.tensors[1].offset], [np.zeros(16, np.uint8)]))
        assert err.value.code == "sealed" and grant.lease in str(err.value)
        (replica,) = grant.replicas
        other = runtime.client(replica.endpoint)
        other.request(ShardOpen(grant.lease, grant.nbytes))
        other.request(ShardWrite(grant.lease, [t.offset for t in grant.tensors], data))
        assert other.request(ShardSeal(grant.lease, 1, 0, right)).body.committed
        pulled = ps.pull()
        assert pulled["b"].tolist() == [5, 6] and pulled["a"].tolist() == [1.0] * 4
        # Only the manager frees a copy: a release from any other peer (this client, naming the lease that
        # committed the version readers pull) is refused, and the bytes stay.
        for copy in (worker, other):
            with pytest.raises(RemoteError) as err:
                copy.request(Release([grant.lease]))
            assert err.value.code == "not-manager" and "'test-client'" in str(err.value)
        assert ps.pull(verify=True)["b"].tolist() == [5, 6]
        # An open handled after its lease's release (the manager gave that attempt up while the open was queued)
        # takes no segment: nobody would release it again.
        given_up = manager.request(PushBegin(2, 0, 1, "raw", specs)).body
        manager.request(LeaseRelease(given_up.lease))  # aborts the push: the manager releases its copies

        def refused_released() -> bool:
            try:
                runtime.client(given_up.worker.endpoint).request(ShardOpen(given_up.lease, given_up.nbytes))
            except RemoteError as exc:
                assert exc.code == "released" and "new grant" in str(exc)
                return True
            return False

        wait_for(refused_released, 4 * LEASE_TTL_S, "the manager's release of the push it gave up")
        assert ps.pull()["b"].tolist() == [5, 6]
    finally:
        runtime.close()


def test_a_seal_uses_streamed_digests_only_for_bytes_written_once_in_order(cluster: PsCluster) -> None:
    """Tensors named at open and written in order are sealed from their streamed digests; a tensor whose bytes a
    second, overlapping write changed is hashed from the segment and fails the seal by name. Garbage ranges get
    a clear error and the worker keeps serving."""
    runtime, _ = cluster.client()
    try:
        manager = runtime.client(cluster.manager)
        specs = [TensorSpec("a", "float32", [4096]), TensorSpec("b", "int64", [1000]), TensorSpec("c", "uint8", [777])]
        grant = manager.request(PushBegin(1, 0, 1, "raw", specs)).body
        worker = runtime.client(grant.worker.endpoint)
        metrics = cluster.worker_info[grant.worker.worker]["metrics"]
        ranges = [ByteRange(t.offset, t.nbytes) for t in grant.tensors]
        garbage = [([ByteRange(0, grant.nbytes + 1)], "bad-layout", "past the shard"),
                   ([ranges[0], ByteRange(ranges[0].offset + 1, 8)], "bad-layout", "overlap"),
                   ([ByteRange(-1, 8)], "schema", ">= 0")]  # refused by the schema before the worker sees it
        for wrong, code, why in garbage:
            with pytest.raises(RemoteError) as err:
                worker.request(ShardOpen(grant.lease, grant.nbytes, wrong))
            assert err.value.code == code and why in str(err.value), err.value
        worker.request(ShardOpen(grant.lease, grant.nbytes, ranges))

        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, t.nbytes, dtype=np.uint8) for t in grant.tensors]
        for t, d in zip(grant.tensors, data, strict=True):  # in order, in pieces of 1000 bytes
            worker.request(ShardWrite(grant.lease, [t.offset + i for i in range(0, t.nbytes, 1000)],
                                      [d[i : i + 1000] for i in range(0, t.nbytes, 1000)]))
        c = grant.tensors[2]
        worker.request(ShardWrite(grant.lease, [c.offset + 100], [data[2][100:200] ^ 1]))  # overwrites c's bytes
        right = [ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, checksum(d))
                 for t, d in zip(grant.tensors, data, strict=True)]
        with pytest.raises(RemoteError) as err:
            worker.request(ShardSeal(grant.lease, 1, 0, right))
        assert err.value.code == "checksum" and "'c'" in str(err.value)
        assert scrape(metrics, "refbus_ps_sealed_tensors_total", digest="streamed") == 2  # a and b
        assert scrape(metrics, "refbus_ps_sealed_tensors_total", digest="segment") == 1  # c, which fails

        worker.request(ShardWrite(grant.lease, [c.offset], [data[2]]))  # c right again, written a third time
        assert not worker.request(ShardSeal(grant.lease, 1, 0, right)).body.committed  # one copy of two
        assert scrape(metrics, "refbus_ps_sealed_tensors_total", digest="streamed") == 4
        assert scrape(metrics, "refbus_ps_sealed_tensors_total", digest="segment") == 2
    finally:
        runtime.close()


@pytest.mark.parametrize("cluster", [["--ps-eta", "1", "--ps-batch-size", "2"]], indirect=True)
def test_staleness_inventory_through_the_manager(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        assert ps.reserve("p0", 0, 2) == 1  # the highest buffer in [0, 0 + eta]
        assert ps.reserve("p1", 0, 2) == 0
        placed = [ps.occupy("p1", f"traj-p1-{i}", 0) for i in range(2)]
        assert placed[-1].ready and placed[-1].version == 0
        with pytest.raises(RemoteError) as err:
            ps.consume(1)
        assert err.value.code == "out-of-order"
        batch = ps.consume()
        assert batch.ready and batch.version == 0 and [e.trajectory for e in batch.entries] == ["traj-p1-0",
                                                                                              "traj-p1-1"]
        aborted = ps.abort("p0")
        assert aborted.slots == 2 and aborted.evicted == []
        with pytest.raises(RemoteError) as err:
            ps.occupy("p0", "late", 0)
        assert err.value.code == "reservation-aborted"
        with pytest.raises(RemoteError) as err:
            ps.reserve("p2", 5)
        assert err.value.code == "version-mismatch"
        # A leased reservation whose holder stops renewing is aborted after the lease TTL.
        ps.reserve("p3", 1, 2, leased=True)
        wait_for(lambda: ps.inventory().counters["expired_prompts_total"] == 1, 5 * LEASE_TTL_S, "the lease to expire")
        with pytest.raises(RemoteError) as err:
            ps.occupy("p3", "late", 1)
        assert err.value.code == "reservation-aborted"
        # Commits move the trainer version: weights 3 exist once version 3 is committed, never before.
        for version in range(4):
            ps.push(make_state(seed=version), version)
        assert ps.inventory().trainer_version == 3 and ps.reserve("p4", 3) == 4
    finally:
        runtime.close()


def test_a_push_waits_out_a_moment_without_ps_workers(bus, spawn, request) -> None:
    """Every ps-worker down at once (chaos, a restart): the push waits for one to register instead of
    failing its trainer world; with nothing coming back it fails with ``no-workers`` once its wait is over."""
    _, control = bus
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=0)
    state = make_state(5, tensors=3)
    runtime, quick = cluster.client("pusher-quick", wait_workers_s=1.0)  # pauses of 0.25 and 0.5 s fit in it
    try:
        with capture_logs() as logs, pytest.raises(RemoteError, match="no-workers"):
            quick.push(state, 0)
        # It waited (a pause, logged) before giving up.
        waits = [entry["retry_in_s"] for entry in logs if entry["event"] == "push.waiting_for_workers"]
        assert waits[:1] == [WORKERS_FIRST_PAUSE_S], logs
    finally:
        runtime.close()
    runtime, patient = cluster.client("pusher-patient", wait_workers_s=30.0)
    pushed: list[object] = []
    thread = threading.Thread(target=lambda: pushed.append(patient.push(state, 0)), daemon=True)
    try:
        thread.start()
        worker = spawn(["node", "ps-worker", "--node-id", "w-late", "--ps-manager", cluster.manager, *cluster.flags],
                       "w-late")
        worker.wait_ready()
        thread.join(30.0)
        assert pushed and not thread.is_alive()  # committed on the worker that came up meanwhile
        assert worker.stop() == 0
    finally:
        thread.join(30.0)  # the push's own wait (wait_workers_s) ends it when no worker came
        runtime.close()
    assert cluster.manager_proc is not None and cluster.manager_proc.stop() == 0
