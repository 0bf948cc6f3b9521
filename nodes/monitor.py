"""`refbus monitor`: the live event stream, one line per event.

Readable lines by default; ``--json`` prints one JSON object per line with ``type``, ``src``, ``seq``,
``ts``, ``id`` and the body's fields (arrays shown as ``<dtype[shape]>``), strict JSON: a number that is not
finite (a sender's ``ts`` among them) is ``null``. In a readable line the text a sender chose (its ``src``, the
string fields) has its non-printable characters escaped (``\\x1b``), so an event cannot drive the terminal, and a
``ts`` that is no time the clock can show (not finite, out of range) is ``?``. ``--since SEQ`` first replays
the broker's ring (every source's events with ``seq >= SEQ``), then continues live with no gap and no
duplicate. With ``--duration S`` each step of joining the bus waits at most ``S`` (not ``node.connect_timeout_s``),
so a broker that does not answer ends the command about then (exit status 1).

The monitor ends when its output does: a reader that goes away (``refbus monitor | head -5``) ends it with
status :data:`BROKEN_PIPE_STATUS`, as a shell reports a tool that SIGPIPE killed; any other failure to write
(a full disk) ends it with a message and status 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..bus.runtime import NodeRuntime, RuntimeSettings
from ..protocol.envelope import Message, describe
from .top import finite, json_safe, printable

_HEADER_FIELDS = ("type", "src", "seq", "ts", "id")

BROKEN_PIPE_STATUS = 128 + 13
"""The exit status when the reader of the output went away: 128 + SIGPIPE, what a shell reports for a tool its
closed pipe killed (Python ignores SIGPIPE, so it is returned, as Ctrl-C's 130 is)."""


def _clock(ts: object) -> str:
    """``ts`` (wall-clock seconds, the sender's: display only) as local ``HH:MM:SS.mmm``; ``?`` when it is no time
    this clock can show (not a finite number, out of the platform's range)."""
    seconds = finite(ts)
    if seconds is not None:
        with contextlib.suppress(OverflowError, OSError, ValueError):
            return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}"
    return "?"


def format_line(record: dict[str, Any]) -> str:
    """``12:00:01.234 node-up          bus#3  node=...`` (nested values as compact JSON, whose escapes keep them
    printable; strings with their non-printable characters escaped)."""
    fields = " ".join(f"{k}={_shown(v)}" for k, v in record.items() if k not in _HEADER_FIELDS)
    source = f"{printable(record['src'])}#{record['seq']}"
    return f"{_clock(record['ts'])} {printable(record['type']):<17} {source}  {fields}"


def _shown(value: object) -> str:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def format_json(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON (numbers that are not finite as ``null``)."""
    return json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False)


class Monitor:
    """Prints events as they arrive; stops after ``count`` events or ``duration`` seconds when given, and at
    once when ``out`` cannot be written (:attr:`failed` then holds why): an event handler's errors are logged
    and the stream goes on, so a reader gone would otherwise cost one error per event, for ever."""

    def __init__(
        self,
        runtime: NodeRuntime,
        *,
        as_json: bool = False,
        kinds: tuple[str, ...] = (),
        since: int | None = None,
        count: int = 0,
        out: TextIO = sys.stdout,
    ) -> None:
        self.runtime = runtime
        self.as_json = as_json
        self.count = count
        self.printed = 0
        self.out = out
        self.failed: OSError | None = None
        runtime.subscribe(self.show, kinds=frozenset(kinds) or None, since=since)

    def show(self, message: Message) -> None:
        record = describe(message)
        line = format_json(record) if self.as_json else format_line(record)
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except OSError as exc:
            self.failed = exc
            self.runtime.stop()
            return
        self.printed += 1
        if self.count and self.printed >= self.count:
            self.runtime.stop()


def run_monitor(
    settings: RuntimeSettings,
    *,
    as_json: bool,
    kinds: tuple[str, ...],
    since: int | None,
    count: int,
    duration: float,
) -> int:
    """Print the stream to stdout until ``count`` events, ``duration`` seconds or a stop; the exit status: 0,
    :data:`BROKEN_PIPE_STATUS` when the reader went away, 1 when stdout could not be written otherwise."""
    if duration > 0:  # the join's waits count against the duration (the deadline below starts before it)
        settings = dataclasses.replace(settings, connect_timeout_s=min(settings.connect_timeout_s, duration))
    runtime = NodeRuntime("monitor", settings)
    monitor = Monitor(runtime, as_json=as_json, kinds=kinds, since=since, count=count)
    deadline = time.monotonic() + duration if duration > 0 else None
    until: Callable[[], bool] | None = (lambda: time.monotonic() >= deadline) if deadline else None
    runtime.run(until=until)
    if monitor.failed is None:
        return 0
    if isinstance(monitor.failed, BrokenPipeError):
        return reader_gone()
    drop_stdout()
    print(f"refbus: cannot write the events: {monitor.failed}", file=sys.stderr)
    return 1


def drop_stdout() -> None:
    """Point stdout at the null device: what is still buffered can never be written, and the interpreter's
    flush at exit would fail on it again (``Exception ignored ... BrokenPipeError``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def reader_gone() -> int:
    """The exit status of a command whose output's reader went away (``refbus top --json | head -1``), its
    stdout dropped (:func:`drop_stdout`): :data:`BROKEN_PIPE_STATUS`, no traceback."""
    drop_stdout()
    return BROKEN_PIPE_STATUS
