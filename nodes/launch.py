"""The one way to start a node process: ``refbus node <role>`` (or another refbus command) in a child.

A :class:`NodeProcess` waits for the node's ready file (its registry entry as JSON, written once the node
is on the bus) instead of guessing with sleeps, and stops it with SIGTERM, escalating to SIGKILL. Logs go
to a file per node so a failing start can say why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

READY_POLL_S = 0.01

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the child before exec: ask Linux to send SIGTERM when the parent (pid ``parent``) dies (no-op
    elsewhere). A node process is gone ``node.shutdown_timeout_s`` after it, its final events sent when the
    broker still runs. A parent that died between the fork and this call sends no signal (the child was already
    reparented), so the child ends here instead: it has not become a node yet, and ``_exit`` because the
    parent's Python signal handlers are still installed in this forked copy."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


class StartCancelled(Exception):
    """The caller gave up waiting for a node (it is shutting down); the node may still be starting."""


class NodeStartError(RuntimeError):
    """A node exited or did not become ready in time; the message ends with its log tail."""


def raise_if_exited(nodes: Iterable[NodeProcess], awaited: str) -> None:
    """Raise :class:`NodeStartError` naming the first of ``nodes`` that has exited, with its exit status and log
    tail, while ``awaited`` (what the caller waits for, as words: "env-0 was starting"); nothing when all run."""
    for node in nodes:
        if node.proc.poll() is not None:
            raise NodeStartError(f"{node.name} exited with {node.proc.returncode} while {awaited}:\n"
                                 f"{node.log_tail()}")


class NodeProcess:
    """A refbus child process. The caller owns it: call :meth:`stop` (or use it as a context manager).

    The child gets SIGTERM when the *thread* that started it ends (Linux's parent-death signal follows the
    thread): start nodes from a thread that outlives them, as the launcher and the tests do.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        workdir: Path | None = None,
        name: str = "",
        env: dict[str, str] | None = None,
        stdout: int | IO[Any] | None = None,
        prefix: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="refbus-"))
        self.info: dict[str, Any] = {}  # the registry entry, once wait_ready() returned it
        self.name = name or command[0]
        self.ready_file = self.workdir / f"{self.name}.ready.json"
        self.log_path = self.workdir / f"{self.name}.log"
        # Appended: a node restarted under the same name keeps its earlier incarnations' logs.
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # ``prefix`` runs the node through a launcher that execs it (e.g. one that enters a namespace), so
        # the pid, the signals and the parent-death signal are still the node's own. ``pass_fds`` stay open in
        # the node (the launcher's run-directory lock: held for as long as any process of the run lives).
        self.ready_file.unlink(missing_ok=True)  # an earlier incarnation's, left by a kill: not this one's
        argv = [*prefix, sys.executable, "-m", "refbus.nodes.cli", *command, "--ready-file", str(self.ready_file)]
        # Own session: a terminal's Ctrl-C reaches the launcher only, which stops its nodes in order.
        # PDEATHSIG: a launcher that is killed outright does not leave its nodes behind.
        # Wall-clock time before the start: the node's registered start time (NodeInfo.started) is later, so
        # a report about an earlier process that had the same pid is told apart.
        self.spawned = time.time()
        self.proc = subprocess.Popen(
            argv,
            stdout=stdout if stdout is not None else self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0, *, cancelled: Callable[[], bool] | None = None,
                   needs: Sequence[NodeProcess] = ()) -> dict[str, Any]:
        """The node's registry entry once it is ready; raises :class:`NodeStartError` if it, or one of the nodes
        it ``needs``, dies first (naming the one that died, with its log tail: a node waiting on a dead peer, a
        trainer rank on its partner's rendezvous, would only time out, blamed), and :class:`StartCancelled` as
        soon as ``cancelled()`` is true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise StartCancelled(self.name)
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.proc.poll() is not None:
                raise NodeStartError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            raise_if_exited(needs, f"{self.name} was starting")
            time.sleep(READY_POLL_S)
        raise NodeStartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code. Safe to call twice."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bus_flags(control: str) -> list[str]:
    """Flags that point a node at a broker."""
    return ["--bus-control", control]


def start_bus(
    workdir: Path, *, extra: Sequence[str] = (), timeout: float = 30.0, bind: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> tuple[NodeProcess, str]:
    """A broker on ephemeral ports of ``bind`` (loopback by default), started through ``prefix`` (see
    :class:`NodeProcess`); returns it and its control endpoint."""
    bus = NodeProcess(
        ["node", "bus", "--bus-control", f"tcp://{bind}:0", "--bus-events-in", f"tcp://{bind}:0",
         "--bus-events-out", f"tcp://{bind}:0", "--bus-metrics-port", "0", *extra],
        workdir=workdir,
        name="bus",
        prefix=prefix,
    )
    try:
        info = bus.wait_ready(timeout)
    except NodeStartError:
        bus.stop()
        raise
    return bus, info["endpoints"]["control"]
