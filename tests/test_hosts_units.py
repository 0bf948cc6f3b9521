"""bench/hosts.py's bookkeeping, without building namespaces (no root needed): reaping only the processes
teardown killed, teardown that runs whatever stopping the processes did, probes the sweep finds, and a
SIGTERM cleanup that cannot deadlock on the registry lock."""

from __future__ import annotations

import os
import subprocess
import sys

from bench import hosts


def _exited_unreaped(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has exited, leaving it to be reaped (WNOWAIT: its status stays for Popen.wait)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_reaping_collects_only_the_killed_survivors_not_other_children() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    _exited_unreaped(other)
    _exited_unreaped(killed)
    hosts._reap_children([killed.pid, 1])  # pid 1 is no child of ours: ignored
    assert other.wait(timeout=10) == 3  # its exit status is still its own
    assert killed.poll() is not None  # collected (Popen then reports it ended, status unknown to it)
