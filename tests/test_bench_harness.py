"""The benchmark harness: worker tasks report, fail and die loudly, and the table states every verdict."""

from __future__ import annotations

import os
import signal

import pytest

from bench.harness import WAIT_S, BenchError, Channel, Row, format_table, parse_args, workers


def echo(ch: Channel, value: int) -> int:
    """Report ``value``, wait for an order, return ``value`` plus the order."""
    ch.send(value)
    return value + ch.recv()


def fail(ch: Channel) -> None:
    raise ValueError("garbage in")


def wait_forever(ch: Channel) -> None:
    ch.send(os.getpid())
    ch.recv(timeout_s=3600)


def test_a_task_reports_takes_orders_and_returns() -> None:
    with workers("bench-test") as (worker,):
        worker.submit(echo, 40)
        assert worker.message() == 40
        worker.tell(2)
        assert worker.result() == 42


def test_a_failing_task_raises_with_its_traceback_and_the_worker_runs_the_next() -> None:
    with workers("bench-test") as (worker,):
        with pytest.raises(BenchError, match="ValueError: garbage in"):
            worker.call(fail)
        worker.submit(echo, 1)
        worker.message()
        worker.tell(1)
        assert worker.result() == 2


def test_a_worker_killed_mid_task_raises_instead_of_hanging() -> None:
    with workers("bench-test") as (worker,):
        worker.submit(wait_forever)
        pid = worker.message()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(BenchError, match="bench-test exited"):
            worker.result(timeout_s=WAIT_S)
    assert worker.process.exitcode == -signal.SIGKILL


def test_the_table_states_ratio_goal_and_verdict_for_each_direction() -> None:
    rows = [
        Row("bulk", "fast", "GB/s", 2.0, 1.0, 0.80),
        Row("rpc", "slow", "us", 300.0, 100.0, 1.5, higher_is_better=False),
        Row("rpc", "info", "us", 1.0, 0.0, None, higher_is_better=False),
    ]
    lines = format_table(rows).splitlines()
    assert lines[1].split()[-4:] == ["200%", ">=", "80%", "met"]
    assert lines[2].split()[-5:] == ["3.00x", "<=", "1.50x", "NOT", "MET"]
    assert lines[3].split()[-3:] == ["nanx", "-", "-"]


def test_an_unknown_section_is_refused() -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--only", "nonsense"], prog="bench", description="", quick_help="", sections=("events",))
    assert exit_info.value.code == 2
    assert parse_args(["--quick"], prog="bench", description="", quick_help="").quick
