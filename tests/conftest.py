"""Shared fixtures: real broker processes on ephemeral loopback ports, always reaped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from refbus.nodes.launch import NodeProcess, start_bus

# Short liveness timing so node-down tests finish quickly.
FAST_LIVENESS = ["--bus-heartbeat-interval-s", "0.2", "--bus-node-timeout-s", "1.0"]


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[tuple[NodeProcess, str]]:
    """A broker process and its control endpoint; stopped (and checked for a clean exit) afterwards."""
    proc, control = start_bus(tmp_path, extra=FAST_LIVENESS)
    try:
        yield proc, control
    finally:
        assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """``spawn(command, name)`` starts a refbus child; every one is stopped at teardown."""
    started: list[NodeProcess] = []

    def start(command: list[str], name: str, **kwargs: object) -> NodeProcess:
        proc = NodeProcess(command, workdir=tmp_path, name=name, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
