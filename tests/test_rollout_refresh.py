"""The rollout worker's weight refreshes, against a fake PS client and offload queue (no processes): a bump
that arrives while a refresh is queued or running is not lost, and a manager that does not answer costs the
queued generations one refresh attempt per tick, not one each."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from refbus.bus.reqrep import HandlerError, RequestTimeout
from refbus.nodes.rl.rollout import REFRESH_EVERY_S, RolloutWorker
from refbus.protocol.messages import Generate, VersionBump


class FakeOffload:
    """Jobs are kept, not run: the test runs them (and hands back their outcome) when it wants."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], Callable[[Any], None], bool]] = []

    def submit(self, job: Callable[[], Any], done: Callable[[Any], None], urgent: bool = False) -> None:
        self.jobs.append((job, done, urgent))

    def run_next(self) -> None:
        job, done, _ = self.jobs.pop(0)
        try:
            outcome = job()
        except Exception as exc:
            outcome = exc
        done(outcome)


class SilentManager:
    """A PS client whose manager never answers (each status() is one whole retry schedule, here instant)."""

    def __init__(self) -> None:
        self.asked = 0

    def status(self) -> Any:
        self.asked += 1
        raise RequestTimeout("ps-status: no reply from the manager")

    def pull(self, **kwargs: Any) -> Any:
        raise AssertionError("nothing to pull from a manager that does not answer")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _worker(version: int) -> tuple[RolloutWorker, FakeOffload, SilentManager, Clock]:
    worker = RolloutWorker.__new__(RolloutWorker)
    offload, ps, clock = FakeOffload(), SilentManager(), Clock()
    worker.offload, worker.ps, worker._clock = offload, ps, clock  # type: ignore[assignment]
    worker.version, worker.torn, worker.torn_pulls, worker.generated = version, None, 0, 0
    worker._refresh_queued, worker._refresh_missed, worker._unanswered_at = False, False, -math.inf
    return worker, offload, ps, clock


def _bump(version: int) -> Any:
    return SimpleNamespace(body=VersionBump(version, 0, ""))


def test_a_bump_during_a_refresh_queues_another_refresh_when_it_ends() -> None:
    worker, offload, _, _ = _worker(version=3)
    worker._on_bump(_bump(4))
    assert len(offload.jobs) == 1 and offload.jobs[0][2]  # urgent: ahead of the generations
    worker._on_bump(_bump(5))  # while that refresh is queued (or running): it may miss version 5
    worker._want_refresh()  # a tick meanwhile adds nothing
    assert len(offload.jobs) == 1
    offload.run_next()
    assert len(offload.jobs) == 1, "the bump that came during the refresh was dropped"
    offload.run_next()
    assert offload.jobs == []  # one more, not a loop


def test_a_tick_during_a_refresh_queues_nothing_more() -> None:
    worker, offload, _, _ = _worker(version=3)
    worker._want_refresh()
    worker._want_refresh()
    offload.run_next()
    assert offload.jobs == []


def test_a_silent_manager_costs_queued_generations_one_refresh_per_tick() -> None:
    worker, _, ps, clock = _worker(version=-1)
    ask = Generate(prompt=[1, 2], max_new_tokens=2)
    for _ in range(5):  # generations queued while the worker has no weights and the manager is silent
        with pytest.raises(HandlerError) as refused:
            worker._generate(ask)
        assert refused.value.code == "no-weights"
    assert ps.asked == 1
    clock.now += REFRESH_EVERY_S  # a tick later: one more attempt
    for _ in range(3):
        with pytest.raises(HandlerError):
            worker._generate(ask)
    assert ps.asked == 2
