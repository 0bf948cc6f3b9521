"""`refbus monitor`: the live event stream, one line per event.

Readable lines by default; ``--json`` prints one JSON object per line with ``type``, ``src``, ``seq``,
``ts``, ``id`` and the body's fields (arrays shown as ``<dtype[shape]>``). ``--since SEQ`` first replays
the broker's ring (every source's events with ``seq >= SEQ``), then continues live with no gap and no
duplicate.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..bus.runtime import NodeRuntime, RuntimeSettings
from ..protocol.envelope import Message, describe

_HEADER_FIELDS = ("type", "src", "seq", "ts", "id")


def format_line(record: dict[str, Any]) -> str:
    """``12:00:01.234 node-up          bus#3  node=...`` (nested values as compact JSON)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(record["ts"])) + f".{int(record['ts'] * 1000) % 1000:03d}"
    fields = " ".join(
        f"{k}={v if isinstance(v, str | int | float) else json.dumps(v, separators=(',', ':'))}"
        for k, v in record.items()
        if k not in _HEADER_FIELDS
    )
    return f"{stamp} {record['type']:<17} {record['src']}#{record['seq']}  {fields}"


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
        line = json.dumps(record, separators=(",", ":")) if self.as_json else format_line(record)
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
    runtime = NodeRuntime("monitor", settings)
    Monitor(runtime, as_json=as_json, kinds=kinds, since=since, count=count)
    deadline = time.monotonic() + duration if duration > 0 else None
    until: Callable[[], bool] | None = (lambda: time.monotonic() >= deadline) if deadline else None
    runtime.run(until=until)
    return 0
