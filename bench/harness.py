"""What every benchmark shares: worker processes, timing, the result table and the command line.

- **workers**: :func:`workers` spawns processes that run module-level tasks ``task(channel, *args)`` one at a
  time; a task talks to the parent through its :class:`Channel`, the parent to the task through its
  :class:`Worker`. Every wait is bounded (``WAIT_S`` unless told otherwise) and raises :class:`BenchError`;
  every process is reaped when the ``with`` block ends, whatever happened.
- **timing**: :func:`timed_us` (mean µs per item), :func:`seconds_each` (seconds of each run),
  :func:`best_seconds` and :class:`Rate` with :func:`best_rates` (the best counts: other load on the machine
  only ever slows a run down), :func:`gc_paused`, :func:`lower_priority`.
- **report**: a :class:`Row` per figure (refbus, baseline, their ratio and its goal), :func:`format_table`,
  :func:`figures` and :func:`write_json` for ``--json``, :func:`run_line` for the closing line.
- **command line**: :func:`parse_args` gives every bench the same ``--quick``, ``--json PATH`` and, where it
  has sections, ``--only SECTION``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker, spawn
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import numpy as np
from refbus.bus.logs import configure_logging

WAIT_S = 30.0  # the longest any step waits for a peer before the bench fails
MIB = 1 << 20
GIB = 1 << 30


class BenchError(RuntimeError):
    """A worker failed, or a peer did not answer in time."""


# --- workers: the one way a bench starts helper processes ------------------------------------------------


class Channel:
    """A task's line to the parent: :meth:`send` reports progress, :meth:`recv`/:meth:`poll` take orders."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, value: Any) -> None:
        self._conn.send(("msg", value))

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether the parent sent an order (to running loops: stop), waiting up to ``timeout_s``."""
        return self._conn.poll(timeout_s)

    def recv(self, timeout_s: float = WAIT_S) -> Any:
        if not self._conn.poll(timeout_s):
            raise BenchError(f"no order from the parent within {timeout_s}s")
        _, value = self._conn.recv()
        return value


def _worker_main(conn: Connection) -> None:
    """Run tasks sent by the parent until it sends None (or goes away)."""
    configure_logging(level="error")
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while (job := conn.recv()) is not None:
            if job[0] != "call":
                continue  # an order for a task that has already ended
            _, task, args = job
            try:
                conn.send(("done", task(Channel(conn), *args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))


class Worker:
    """A spawned process that runs module-level tasks ``task(channel, *args)`` one at a time."""

    def __init__(self, ctx: SpawnContext, name: str, python: str | None = None) -> None:
        self.name = name
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), name=name, daemon=True)
        if python is None:
            self.process.start()
        else:
            # The spawn executable is one setting for the whole module: switched for this start only. The
            # resource tracker is started first, with the usual executable, so it stays where the parent is.
            resource_tracker.ensure_running()
            usual = spawn.get_executable()
            ctx.set_executable(python)
            try:
                self.process.start()
            finally:
                ctx.set_executable(usual)
        child.close()

    def submit(self, task: Callable[..., Any], *args: Any) -> None:
        self._conn.send(("call", task, args))

    def tell(self, order: Any) -> None:
        """Send an order to the running task (``go``, ``stop``, ...)."""
        self._conn.send(("tell", order))

    def message(self, timeout_s: float = WAIT_S) -> Any:
        """The next progress report of the running task."""
        return self._next("msg", timeout_s)

    def result(self, timeout_s: float = WAIT_S) -> Any:
        """The running task's return value."""
        return self._next("done", timeout_s)

    def call(self, task: Callable[..., Any], *args: Any, timeout_s: float = WAIT_S) -> Any:
        self.submit(task, *args)
        return self.result(timeout_s)

    def _next(self, expected: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise BenchError(f"{self.name}: no {expected!r} within {timeout_s:.0f}s")
        try:
            tag, value = self._conn.recv()
        except EOFError:
            raise BenchError(f"{self.name} exited (code {self.process.exitcode}) before its {expected!r}") from None
        if tag == "error":
            raise BenchError(f"{self.name} failed:\n{value}")
        if tag != expected:
            raise BenchError(f"{self.name}: expected {expected!r}, got {tag!r}: {value!r}")
        return value

    def ask_exit(self) -> None:
        with contextlib.suppress(OSError):
            self.tell("stop")
            self._conn.send(None)

    def reap(self, timeout_s: float) -> None:
        """Wait for the process to exit; terminate, then kill, if it does not."""
        self.process.join(timeout_s)
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is not None:
                break
            end()
            self.process.join(2.0)
        self._conn.close()


_open_pools = [0]  # nesting depth of workers(): the resource tracker is reaped when the outermost closes


@contextlib.contextmanager
def workers(*names: str, python: str | None = None) -> Iterator[list[Worker]]:
    """Spawned workers (starting concurrently), all reaped on exit whatever happened. May nest.

    ``python``: the executable that starts them instead of this interpreter, one that execs it elsewhere
    (``bench.hosts.Host.python``: inside a namespace host), so a bench places its workers on hosts.
    """
    ctx = multiprocessing.get_context("spawn")
    started: list[Worker] = []
    _open_pools[0] += 1
    try:
        for name in names:
            started.append(Worker(ctx, name, python))
        yield started
    finally:
        for worker in started:
            worker.ask_exit()
        for worker in started:
            worker.reap(5.0)
        _open_pools[0] -= 1
        if not _open_pools[0]:
            # Workers of an outer pool still hold the tracker's pipe: stopping it earlier would wait forever.
            _reap_resource_tracker()


def _reap_resource_tracker() -> None:
    """Spawning also starts multiprocessing's resource tracker process; stop and reap it too, or it ends
    as a zombie when this process exits under an init that does not reap (as in containers)."""
    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # private, but the only way to reap it
    if stop is not None:
        stop()


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (BenchError if the peer closes first)."""
    got = 0
    while got < view.nbytes:
        chunk = sock.recv_into(view[got:])
        if not chunk:
            raise BenchError("raw TCP peer closed early")
        got += chunk


RAW_BYTE = 7  # what a raw peer sends: every byte of a raw pull is this


def raw_peer(ch: Channel, nbytes: int, runs: int, direction: str, bind: str = "127.0.0.1") -> None:
    """The raw limit's far end, on one TCP connection to a port of ``bind`` (reported first): for each one-byte
    order, send ``nbytes`` of ``RAW_BYTE`` (``pull``), or receive them into a warm buffer and answer one byte
    (``push``)."""
    view = memoryview(np.full(nbytes, RAW_BYTE, dtype=np.uint8))
    with socket.create_server((bind, 0)) as listener:
        ch.send(listener.getsockname()[1])
        listener.settimeout(WAIT_S)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            for _ in range(runs):
                if conn.recv(1) != b"g":
                    raise BenchError("raw TCP client went away")
                if direction == "pull":
                    conn.sendall(view)
                else:
                    recv_exactly(conn, view)
                    conn.sendall(b"k")


def lower_priority(ch: Channel) -> int:
    """A task: give this worker (and the threads it starts later) the lowest CPU priority."""
    return os.nice(19)


# --- timing ----------------------------------------------------------------------------------------------


def timed_us(
    action: Callable[[Any], object], items: Sequence[Any], clock: Callable[[], float] = time.perf_counter
) -> float:
    """Mean microseconds of ``action(item)`` over ``items``.

    Profiles pass ``clock=time.thread_time``: CPU time of the calling thread, which neither waiting for a
    message nor being preempted by other load on the machine adds to.
    """
    start = clock()
    for item in items:
        action(item)
    return (clock() - start) * 1e6 / max(1, len(items))


def seconds_each(action: Callable[[], object], runs: int) -> list[float]:
    """Wall-clock seconds of each of ``runs`` calls of ``action``, in order (callers drop warm-ups)."""
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return seconds


def best_seconds(action: Callable[[], object], runs: int) -> float:
    """The fastest of ``runs`` calls of ``action``, in seconds (other load only ever slows a run down)."""
    return min(seconds_each(action, runs))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Profiles keep thousands of messages alive; a streaming node does not. Keep the collector out."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True)
class Rate:
    """``count`` units (events, messages) in ``seconds``; ``nbytes`` per unit for byte rates."""

    count: int
    seconds: float
    nbytes: int = 0
    cpu_s: float = 0.0  # CPU seconds the measuring process spent meanwhile (all its threads)

    @property
    def per_s(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0

    @property
    def gb_s(self) -> float:
        return self.per_s * self.nbytes / 1e9

    @property
    def cpu_us(self) -> float:
        """CPU microseconds per unit: what the rate would be bound by on an idle core, whatever the load."""
        return 1e6 * self.cpu_s / self.count if self.count else 0.0


def best_rates(measures: dict[str, Callable[[], Rate]], rounds: int) -> dict[str, Rate]:
    """Run every measure once per round, interleaved, and keep each one's best rate."""
    best: dict[str, Rate] = {}
    for _ in range(rounds):
        for name, measure in measures.items():
            rate = measure()
            if name not in best or rate.per_s > best[name].per_s:
                best[name] = rate
    return best


# --- report ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the result table."""

    section: str
    metric: str
    unit: str  # "events/s", "us", "GB/s", "MiB"
    refbus: float
    baseline: float
    goal: float | None  # a ratio; None for informational rows
    higher_is_better: bool = True

    @property
    def ratio(self) -> float:
        return self.refbus / self.baseline if self.baseline else float("nan")

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal


def _value(value: float, unit: str) -> str:
    if unit == "events/s":
        return f"{value / 1e3:,.1f}k/s"
    if unit == "us":
        return f"{value:,.1f} us"
    return f"{value:.2f} {unit}"


def _ratio(row: Row) -> str:
    return f"{row.ratio:.0%}" if row.higher_is_better else f"{row.ratio:.2f}x"


def _goal(row: Row) -> str:
    if row.goal is None:
        return "-"
    return f">= {row.goal:.0%}" if row.higher_is_better else f"<= {row.goal:.2f}x"


def _met(row: Row) -> str:
    return {True: "met", False: "NOT MET", None: "-"}[row.met]


def format_table(rows: Sequence[Row]) -> str:
    header = ("metric", "refbus", "baseline", "ratio", "goal", "")
    lines = [header, *((f"{r.section}: {r.metric}", _value(r.refbus, r.unit), _value(r.baseline, r.unit),
                        _ratio(r), _goal(r), _met(r)) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(_pad(cell, width, i) for i, (cell, width) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def _pad(cell: str, width: int, column: int) -> str:
    return cell.ljust(width) if column == 0 else cell.rjust(width)


def figures(settings: Any, quick: bool, seconds: float, rows: Sequence[Row], extra: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` writes for a bench that reports :class:`Row` s: its settings (a dataclass), the rows
    with their ratios and verdicts, and the bench's own ``extra`` figures."""
    return {
        "quick": quick,
        "settings": asdict(settings),
        "seconds": seconds,
        "rows": [asdict(r) | {"ratio": r.ratio, "met": r.met} for r in rows],
        **extra,
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON (tuples and other iterables as lists)."""
    Path(path).write_text(json.dumps(data, indent=2, default=list))


def run_line(quick: bool, seconds: float, parts: dict[str, float] | None = None) -> str:
    """The closing line: which run, how long (per part when given), and the machine's load meanwhile, the
    first thing to look at when a figure is off."""
    split = f" ({', '.join(f'{name} {secs:.1f} s' for name, secs in parts.items())})" if parts else ""
    return (f"{'quick' if quick else 'full'} run: {seconds:.1f} s{split}; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


# --- command line ----------------------------------------------------------------------------------------


def parse_args(
    argv: Sequence[str] | None, *, prog: str, description: str, quick_help: str, sections: Sequence[str] = (),
    hosts_help: str = "", more: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """``--quick`` and ``--json PATH`` for every bench; ``--only SECTION`` (repeatable, into ``only``: empty
    means all) for one with ``sections``; ``--hosts`` (its cross-host mode) for one with ``hosts_help``;
    ``more`` adds a bench's own options."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    if hosts_help:
        parser.add_argument("--hosts", action="store_true", help=hosts_help)
    if sections:
        parser.add_argument("--only", choices=sections, action="append", default=[],
                            help="run only this section (repeatable); default: all")
    if more is not None:
        more(parser)
    return parser.parse_args(argv)
