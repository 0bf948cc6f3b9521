"""The one way tests wait: poll a condition with a short interval until a deadline, or a child's next line
with a bounded select."""

from __future__ import annotations

import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(poll_s)


def holds_for(predicate: Callable[[], Any], duration: float, what: str, poll_s: float = 0.02) -> None:
    """Poll ``predicate`` for ``duration`` seconds, failing naming ``what`` as soon as it is falsy: that
    something does not happen within a configured time (a grace, a timeout) it would happen in."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding within {duration}s"
        time.sleep(poll_s)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` writes to its stdout (an unbuffered binary pipe, ``bufsize=0``: a buffered reader
    would hold lines back from select), stripped; fails after ``timeout`` seconds of silence or when the child
    closed its stdout (it exited) without a line."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the child (pid {proc.pid}) said nothing within {timeout}s"
    line = proc.stdout.readline()
    assert line, f"the child (pid {proc.pid}) closed its stdout without a line (exit {proc.poll()})"
    return line.decode().strip()


def all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP takes effect asynchronously: a thread still
    running may read its socket after the signal was sent)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue
    return bool(states) and all(state == "T" for state in states)


def pause(proc: Any, seconds: float, stop_within: float) -> None:
    """Stop ``proc`` (a ``NodeProcess``: ``pid``, ``signal``) with SIGSTOP, wait at most ``stop_within`` seconds for
    every thread of it to be stopped, keep it stopped ``seconds`` (the pause itself, the condition a test is about:
    a paused host, a swapped-out process), then SIGCONT it, whatever happened meanwhile."""
    proc.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: all_stopped(proc.pid), stop_within, f"every thread of pid {proc.pid} to stop")
        time.sleep(seconds)
    finally:
        proc.signal(signal.SIGCONT)
