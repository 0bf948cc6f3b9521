"""`refbus monitor`: the live event stream, one line per event.

Readable lines by default; ``--json`` prints one JSON object per line with ``type``, ``src``, ``seq``,
``ts``, ``id`` and the body's fields (arrays shown as ``<dtype[shape]>``), strict JSON: a number that is not
finite (a sender's ``ts`` among them) is ``null``. In a readable line the text a sender chose (its ``src``, the
string fields) has its non-printable characters escaped (``\\x1b``), so an event cannot drive the terminal, and a
``ts`` that is no time the clock can show (not finite, out of range) is ``?``. ``--since SEQ`` first replays
the broker's ring (every source's events with ``seq >= SEQ``), then continues live with no gap and no
duplicate. With ``--duration S`` each step of joining the bus waits at most ``S`` (not ``node.connect_timeout_s``),
so a broker that does not answer ends the command about then (exit status 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..bus.runtime import NodeRuntime, RuntimeSettings
from ..protocol.envelope import Message, describe
from .top import finite, json_safe, printable

_HEADER_FIELDS = ("type", "src", "seq", "ts", "id")


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
    """Prints events as they arrive; stops after ``count`` events or ``duration`` seconds when given."""

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
        runtime.subscribe(self.show, kinds=frozenset(kinds) or None, since=since)

    def show(self, message: Message) -> None:
        record = describe(message)
        line = format_json(record) if self.as_json else format_line(record)
        self.out.write(line + "\n")
        self.out.flush()
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
    if duration > 0:  # the join's waits count against the duration (the deadline below starts before it)
        settings = dataclasses.replace(settings, connect_timeout_s=min(settings.connect_timeout_s, duration))
    runtime = NodeRuntime("monitor", settings)
    Monitor(runtime, as_json=as_json, kinds=kinds, since=since, count=count)
    deadline = time.monotonic() + duration if duration > 0 else None
    until: Callable[[], bool] | None = (lambda: time.monotonic() >= deadline) if deadline else None
    runtime.run(until=until)
    return 0
