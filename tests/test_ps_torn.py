"""Pulls never leave torn weights: a pull into ``out=`` that fails part-way says so (``TornPull``), and a
rollout worker whose weights it tore refuses to generate until a full pull succeeds.

The rollout worker runs in this process on a real PS cluster (processes); its model methods are called
directly on the test thread (they are what its offload thread runs). The pull is frozen half-way by the
client's ``before_write`` hook while the ps-worker holding the other half is killed with SIGKILL. A refresh
that loses a worker this way is served again by that worker's restart (its copies re-adopted), without a new
push; with a second copy of every shard the refresh never tears at all.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from polling import wait_for
from ps_support import (
    LEASE_TTL_S,
    PsCluster,
    make_state,
    rank_part,
    restart_worker,
    start_cluster,
    stop_cluster_after_kills,
)
from refbus.bus.reqrep import HandlerError, RemoteError, RequestTimeout, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.config import Config
from refbus.nodes.ps.client import PsClient, PsError, TornPull
from refbus.nodes.rl.rollout import RolloutWorker
from refbus.nodes.toy.policy import make_policy
from refbus.protocol.messages import Generate
from refbus.protocol.messages_ps import LeaseRelease, WorkerInfo

# Requests to a killed worker give up after 0.3 + 0.3 s: the torn pull fails quickly.
FAST_RETRY = RetryPolicy(timeout_s=0.3, attempts=2, backoff=1.0)
WAIT_S = 10 * sum(FAST_RETRY.timeouts())  # a scrape held while a pull runs waits at most this long


@pytest.fixture
def cluster(bus, spawn, request) -> Iterator[PsCluster]:
    """Two ps-workers, one copy of every shard (``ps.replicas``: the indirect parameter, 1 by default)."""
    _, control = bus
    replicas = getattr(request, "param", 1)
    cluster = start_cluster(spawn, control, request.node.name[:24], workers=2,
                            extra=["--ps-replicas", str(replicas)])
    yield cluster
    stop_cluster_after_kills(cluster)


def _rollout(cluster: PsCluster, metrics: dict[str, Callable[[], Any]] | None = None,
             ) -> tuple[NodeRuntime, RolloutWorker]:
    """A rollout worker on ``cluster``, reading as frames; ``metrics`` gets each metric's read (what a scrape
    calls), by name."""
    config = Config()
    config = dataclasses.replace(config, ps=dataclasses.replace(config.ps, manager=cluster.manager))
    settings = RuntimeSettings(bus=cluster.control, node_id="rollout-torn", metrics_port=-1, retry=FAST_RETRY)
    runtime = NodeRuntime("rollout", settings, register=False)
    if metrics is not None:
        runtime.metric = lambda name, doc, read, **_: metrics.__setitem__(name, read)  # type: ignore[method-assign]
    worker = RolloutWorker(runtime, config)
    worker.ps.transport = "frames"  # every byte goes through the workers, so a dead one fails the pull
    return runtime, worker


def _push_world_of_two(ps: PsClient, state: dict[str, torch.Tensor], version: int) -> None:
    """Rank r's shard goes to worker w<r>: half of the model on each worker."""
    for rank in (0, 1):
        ps.push(rank_part(state, rank, 2), version, rank=rank, world=2)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name in a if torch.equal(a[name], b[name]))


def test_a_pull_torn_half_way_stops_generation_until_a_full_pull(cluster: PsCluster) -> None:
    pusher_runtime, pusher = cluster.client("pusher")
    runtime, worker = _rollout(cluster)
    try:
        old, new = make_policy(1).state_dict(), make_policy(2).state_dict()
        pusher.push(dict(old), 0)  # on w0 alone
        worker.refresh()
        assert worker.version == 0 and worker.torn is None
        ask = Generate(prompt=[1, 2, 3], max_new_tokens=2)
        assert worker._generate(ask, worker._clock()).policy_version == 0

        _push_world_of_two(pusher, dict(new), 1)
        frozen: list[str] = []

        def freeze_and_kill(name: str) -> None:
            # Half-way: w0's half of version 1 is being written; w1, which holds the other half, dies.
            if not frozen:
                cluster.workers["w1"].signal(signal.SIGKILL)
                cluster.workers["w1"].proc.wait(10)
            frozen.append(name)

        worker.ps.before_write = freeze_and_kill
        with pytest.raises(TornPull) as torn:
            worker.ps.pull(out=worker.model.state_dict())
        assert torn.value.version == 1 and torn.value.written
        assert isinstance(torn.value.cause, PsError) and "w1" in str(torn.value.cause)
        # The model really is a mix: some tensors from version 1, the rest still version 0.
        mixed = _weights(worker.model)
        assert set(_same(mixed, new)) >= set(torn.value.written) and _same(mixed, old)

        # The rollout worker's own refresh meets the same tear (w0's half is written again, w1's fails):
        # it then serves no version and refuses to generate.
        worker.ps.before_write = None
        worker.refresh()
        assert worker.torn is not None and worker.version == -1 and worker.torn_pulls == 1
        generated = worker.generated
        for _ in range(3):
            with pytest.raises(HandlerError) as refused:
                # It tries a full pull first: version 1 lost half its copies, so it fails.
                worker._generate(ask, worker._clock())
            assert refused.value.code == "no-weights" and "torn" in str(refused.value)
        assert worker.generated == generated, "an episode was generated with mixed weights"

        # A full pull of a version that is whole restores service, with exactly its bytes.
        newest = make_policy(3).state_dict()
        pusher.push(dict(newest), 2)
        reply = worker._generate(ask, worker._clock())
        assert reply.policy_version == 2 and worker.torn is None
        assert _same(_weights(worker.model), newest) == sorted(newest)
    finally:
        runtime.close()
        pusher_runtime.close()


def test_a_segment_gone_between_its_check_and_its_mapping_is_read_as_frames(cluster: PsCluster) -> None:
    """The rollout worker's refresh maps a copy on this host once it saw the segment's file: a file gone between
    that check and its open (its worker released or lost it meanwhile) made the pull raise a bare
    FileNotFoundError that the refresh did not catch, and the version was not pulled. The tensor is read as
    frames from the worker instead, as one whose file is not visible at all is, and the refresh serves it."""
    pusher_runtime, pusher = cluster.client("pusher")
    runtime, worker = _rollout(cluster)
    worker.ps.transport = "auto"
    checked = worker.ps._local_path
    moved: list[tuple[str, str]] = []

    def vanishing(info: WorkerInfo, segment: str) -> str | None:
        """The check as it is, then the file's name goes (put back at the end: its worker still holds it)."""
        path = checked(info, segment)
        if path is not None and not moved:
            away = os.path.join(os.path.dirname(path), f"gone-{os.getpid()}")
            os.rename(path, away)
            moved.append((away, path))
        return path

    try:
        state = make_policy(1).state_dict()
        pusher.push(dict(state), 0)
        worker.ps._local_path = vanishing  # type: ignore[method-assign]
        worker.refresh()
        assert moved, "no copy was mapped from this host"
        assert worker.version == 0 and worker.torn is None and worker.ps.read_bytes["frames"] > 0
        assert _same(_weights(worker.model), state) == sorted(state)
    finally:
        for away, path in moved:
            os.rename(away, path)
        runtime.close()
        pusher_runtime.close()


def test_a_metrics_scrape_while_a_pull_counts_a_new_path_reads_a_snapshot(cluster: PsCluster) -> None:
    """A scrape of the rollout's bytes pulled (a metrics server thread) iterated the client's counts by path
    while the refresh's pull, on another thread, added a path to them: "dictionary changed size during
    iteration". Here the scrape is held inside its reading while a real pull counts its first frames, then goes
    on: it reads the counts as they were, and the pull's are all there for the next scrape."""
    pusher_runtime, pusher = cluster.client("pusher")
    metrics: dict[str, Callable[[], Any]] = {}
    runtime, worker = _rollout(cluster, metrics)
    inside, counted = threading.Event(), threading.Event()

    class Held(int):
        """A count whose reading waits (bounded) until the pull has counted."""

        def __float__(self) -> float:
            inside.set()
            counted.wait(WAIT_S)
            return float(int(self))

    worker.ps.read_bytes["shm"] = Held(0)
    scrape = metrics["refbus_rollout_weights_read_bytes_total"]
    scraped: list[object] = []
    scraper = threading.Thread(target=lambda: scraped.append(_outcome(scrape)), name="scrape")
    try:
        pusher.push(dict(make_policy(1).state_dict()), 0)
        scraper.start()
        assert inside.wait(WAIT_S), "the scrape never read a count"
        worker.refresh()
        counted.set()
        scraper.join(WAIT_S)
        assert not scraper.is_alive() and worker.version == 0
        assert scraped == [{("shm",): 0.0}], scraped
        assert scrape()[("frames",)] == float(worker.ps.read_bytes["frames"]) > 0
    finally:
        counted.set()
        scraper.join(WAIT_S)
        runtime.close()
        pusher_runtime.close()


def _outcome(call: Callable[[], object]) -> object:
    """What ``call`` returned, or the exception it raised."""
    try:
        return call()
    except Exception as exc:
        return exc


def _kill_at_first_write(cluster: PsCluster, worker: RolloutWorker, victim: str) -> list[str]:
    """Arm ``worker``'s next pull to SIGKILL ``victim`` just before its first write into the model; returns the
    list the written names are added to (empty: the pull never wrote)."""
    written: list[str] = []

    def kill(name: str) -> None:
        if not written:
            cluster.workers[victim].signal(signal.SIGKILL)
            cluster.workers[victim].proc.wait(10)
        written.append(name)

    worker.ps.before_write = kill
    return written


def test_a_worker_killed_mid_refresh_is_refused_until_its_restart_serves_that_version(cluster: PsCluster,
                                                                                    spawn) -> None:
    """The rollout worker's own refresh (a bump to version 1, half of it on w1) loses w1 half-way: it serves no
    version and refuses to generate. w1 restarted under its id re-adopts its copies, and the next attempt
    pulls version 1 whole, from the new process, with nothing pushed again."""
    pusher_runtime, pusher = cluster.client("pusher")
    runtime, worker = _rollout(cluster)
    try:
        old, new = make_policy(1).state_dict(), make_policy(2).state_dict()
        pusher.push(dict(old), 0)
        worker.refresh()
        assert worker.version == 0
        _push_world_of_two(pusher, dict(new), 1)
        written = _kill_at_first_write(cluster, worker, "w1")
        worker.refresh()
        worker.ps.before_write = None
        assert written, "the refresh never wrote into the model"
        assert worker.torn is not None and worker.torn.version == 1 and worker.version == -1
        assert worker.torn_pulls == 1
        ask = Generate(prompt=[1, 2, 3], max_new_tokens=2)
        with pytest.raises(HandlerError) as refused:
            worker._generate(ask, worker._clock())  # its pull first: w1's half is still missing
        assert refused.value.code == "no-weights" and worker.generated == 0

        restarted = restart_worker(spawn, cluster, "w1")
        assert {w.worker: w.pid for w in pusher.status().workers}["w1"] == restarted.pid
        reply = worker._generate(ask, worker._clock())
        assert reply.policy_version == 1 and worker.torn is None and worker.generated == 1
        assert _same(_weights(worker.model), new) == sorted(new)
        status = pusher.status()
        assert status.latest == 1 and status.leases == 0  # nothing pushed again, no lease left behind
    finally:
        runtime.close()
        pusher_runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_worker_killed_mid_refresh_with_a_second_copy_never_tears_the_weights(cluster: PsCluster) -> None:
    """Every shard on both workers: the worker the refresh reads second dies while it writes what the first
    sent; its tensors come from their other copy, and the model holds version 1 whole."""
    pusher_runtime, pusher = cluster.client("pusher")
    runtime, worker = _rollout(cluster)
    try:
        old, new = make_policy(1).state_dict(), make_policy(2).state_dict()
        pusher.push(dict(old), 0)
        worker.refresh()
        assert worker.version == 0
        _push_world_of_two(pusher, dict(new), 1)
        entries = pusher.manifest(1).entries
        assert all({loc.worker for loc in e.locations} == {"w0", "w1"} for e in entries)
        first = entries[0].locations[0].worker  # read first (tensors are read by their first copy's worker)
        victim = "w1" if first == "w0" else "w0"
        assert any(e.locations[0].worker == victim for e in entries)  # some tensors must come from the other copy
        written = _kill_at_first_write(cluster, worker, victim)
        worker.refresh()
        assert written and worker.version == 1 and worker.torn is None and worker.torn_pulls == 0
        assert _same(_weights(worker.model), new) == sorted(new)
        assert worker._generate(Generate(prompt=[1, 2, 3], max_new_tokens=2), worker._clock()).policy_version == 1
        assert pusher.status().leases == 0
    finally:
        runtime.close()
        pusher_runtime.close()


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_copy_whose_worker_was_down_at_the_commit_is_read_once_that_worker_is_back(cluster: PsCluster,
                                                                                    spawn) -> None:
    """Rank 1's copies on w1 and w0 are verified, then w1 dies (SIGKILL) before rank 0 pushes: version 0 commits
    while w1 is down, so its manifest lists only w0 among its workers. w1 restarted under its id serves its copy
    again, and the rollout worker's refresh reads rank 1's tensors from it (their first copy)."""
    pusher_runtime, pusher = cluster.client("pusher")
    runtime, worker = _rollout(cluster)
    try:
        state = make_policy(2).state_dict()
        pusher.push(rank_part(dict(state), 1, 2), 0, rank=1, world=2)  # rank 1: first copy on w1
        cluster.workers["w1"].signal(signal.SIGKILL)
        cluster.workers["w1"].proc.wait(10)
        wait_for(lambda: "w1" not in {w.worker for w in pusher.status().workers}, 10 * LEASE_TTL_S,
                 "the manager to drop w1")
        pusher.push(rank_part(dict(state), 0, 2), 0, rank=0, world=2)  # on w0 alone: version 0 commits
        committed = pusher.manifest(0)
        assert [w.worker for w in committed.workers] == ["w0"]
        assert any(e.locations[0].worker == "w1" for e in committed.entries)  # read from w1 once it is back

        restarted = restart_worker(spawn, cluster, "w1")
        wait_for(lambda: {w.worker: w.pid for w in pusher.status().workers}.get("w1") == restarted.pid,
                 10 * LEASE_TTL_S, "w1 registered again")
        worker.refresh()
        assert worker.version == 0 and worker.torn is None
        assert _same(_weights(worker.model), state) == sorted(state)
        assert pusher.status().leases == 0
    finally:
        runtime.close()
        pusher_runtime.close()


def test_an_out_the_version_cannot_fill_is_refused_before_any_write(cluster: PsCluster) -> None:
    runtime, ps = cluster.client()
    try:
        state = make_state(seed=4)
        ps.push(state, 0)
        out = {name: torch.zeros_like(t) for name, t in state.items()}
        extra = {**out, "not.in.the.version": torch.zeros(3)}
        with pytest.raises(PsError, match="lacks") as err:
            ps.pull(out=extra)
        assert not isinstance(err.value, TornPull)
        wrong = {**out, "layer0.weight": torch.zeros(2, 2)}
        with pytest.raises(PsError, match="shape"):
            ps.pull(out=wrong)
        assert all(not t.any() for t in out.values()), "a refused pull wrote into out"
        assert ps.pull(out=out).version == 0
        assert all(torch.equal(out[name], state[name]) for name in state)
        assert ps.status().leases == 0
    finally:
        runtime.close()


def test_a_pull_into_out_whose_lease_release_fails_is_torn(cluster: PsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte was written into ``out``, but the release that proves the lease held throughout fails: the
    manager no longer knows the lease (``unknown-lease``), or does not answer. ``out`` is then torn."""
    runtime, ps = cluster.client()
    other_runtime, _ = cluster.client("other")
    try:
        state = make_state(seed=5)
        ps.push(state, 0)
        out = {name: torch.zeros_like(t) for name, t in state.items()}

        def release_behind_its_back(name: str) -> None:
            if name == next(iter(out)):
                lease = next(iter(ps._keeper._held))
                other_runtime.client(cluster.manager).request(LeaseRelease(lease))

        ps.before_write = release_behind_its_back
        with pytest.raises(TornPull) as torn:
            ps.pull(out=out)
        assert isinstance(torn.value.cause, RemoteError) and torn.value.cause.code == "unknown-lease"
        assert torn.value.version == 0 and set(torn.value.written) == set(out)

        ps.before_write = None
        real = ps._manager.request

        def no_answer_to_release(body, **kwargs):  # the manager never answers the release
            if isinstance(body, LeaseRelease):
                raise RequestTimeout(f"{cluster.manager}: no answer")
            return real(body, **kwargs)

        monkeypatch.setattr(ps._manager, "request", no_answer_to_release)
        with pytest.raises(TornPull) as torn:
            ps.pull(out=out)
        assert isinstance(torn.value.cause, RequestTimeout)
        with pytest.raises(RequestTimeout):  # no out: nothing torn, the failure is the pull's
            ps.pull()
        monkeypatch.undo()
        assert ps.pull(out=out).version == 0  # a full pull: out is whole again
        assert all(torch.equal(out[name], state[name]) for name in state)
    finally:
        other_runtime.close()
        runtime.close()
