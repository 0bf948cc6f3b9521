"""Offload on a real node runtime (its loop in a background thread): jobs run one at a time on the offload
thread, urgent ones first; each outcome, a raised exception included, reaches the loop thread; the loop
keeps running callbacks while a job blocks; a job's ``sys.exit()`` ends that job only; nothing runs after close."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from polling import wait_for
from refbus.bus.offload import JobAborted, Offload
from refbus.bus.runtime import NodeRuntime, RuntimeSettings

WAIT_S = 10.0


@pytest.fixture
def runtime() -> Iterator[NodeRuntime]:
    node = NodeRuntime("offload-test", RuntimeSettings(node_id="offload-test", metrics_port=-1), register=False)
    node.start_background()
    try:
        yield node
    finally:
        node.join(WAIT_S)


def test_jobs_run_in_order_urgent_first_and_outcomes_reach_the_loop_thread(runtime: NodeRuntime) -> None:
    offload = Offload(runtime, "test")
    gate = threading.Event()
    ran: list[str] = []
    outcomes: list[tuple[str, object, bool]] = []
    workers: set[threading.Thread] = set()

    def job(name: str, fail: bool = False) -> str:
        workers.add(threading.current_thread())
        ran.append(name)
        if name == "blocker":
            assert gate.wait(WAIT_S)
        if fail:
            raise ValueError(f"{name} failed")
        return name.upper()

    def then(name: str):
        return lambda outcome: outcomes.append((name, outcome, threading.current_thread() is runtime.loop_thread))

    offload.submit(lambda: job("blocker"), then("blocker"))
    wait_for(lambda: ran == ["blocker"], WAIT_S, "the blocking job to start")
    for name, urgent, fail in (("a", False, False), ("b", False, True), ("u1", True, False), ("u2", True, False)):
        offload.submit(lambda name=name, fail=fail: job(name, fail), then(name), urgent=urgent)
    served = threading.Event()
    runtime.call_soon(served.set)  # the loop is not held up by the blocked job
    assert served.wait(WAIT_S)
    assert ran == ["blocker"]
    gate.set()
    wait_for(lambda: len(outcomes) == 5, WAIT_S, "every outcome on the loop thread")

    assert ran == ["blocker", "u1", "u2", "a", "b"]
    assert len(workers) == 1 and runtime.loop_thread not in workers
    assert [(name, loop) for name, _, loop in outcomes] == [(name, True) for name in ran]
    by_name = {name: outcome for name, outcome, _ in outcomes}
    assert by_name["a"] == "A" and by_name["u1"] == "U1"
    assert isinstance(by_name["b"], ValueError) and str(by_name["b"]) == "b failed"

    offload.close()
    offload.submit(lambda: job("late"), then("late"))  # after close: dropped
    assert not any(thread.is_alive() for thread in workers)
    assert "late" not in ran and len(outcomes) == 5


def test_a_job_that_raises_what_is_no_exception_ends_that_job_only(runtime: NodeRuntime) -> None:
    """Regression: ``sys.exit()`` or a ``KeyboardInterrupt`` raised by user code in a job ended the offload
    thread (``SystemExit`` in silence): that job's ``then`` never came, nor any later job's. Now each is its
    job's outcome, a :class:`JobAborted` chaining it, and the next job runs."""
    offload = Offload(runtime, "test")
    outcomes: list[object] = []

    def raising(exc: BaseException) -> None:
        raise exc

    offload.submit(lambda: sys.exit("gave up"), outcomes.append)
    offload.submit(lambda: raising(KeyboardInterrupt()), outcomes.append)
    offload.submit(lambda: "next", outcomes.append)
    wait_for(lambda: len(outcomes) == 3, WAIT_S, "every job's outcome")
    exited, interrupted, after = outcomes
    assert isinstance(exited, JobAborted) and isinstance(exited.__cause__, SystemExit)
    assert str(exited) == "the job raised SystemExit: gave up"
    assert isinstance(interrupted, JobAborted) and str(interrupted) == "the job raised KeyboardInterrupt"
    assert after == "next"
