"""`refbus top`: a live table of the cluster's nodes, from the broker's registry.

Every refresh asks the broker for its registry (a ``nodes`` request) and shows one row per live node: id,
role, host, pid, blobs and bytes held, version, lag and heartbeat age. Blobs, bytes and version come from the
``status`` numbers each node sends with its heartbeats (``blobs_held``, ``bytes_held``, ``version``, or
``step`` for roles that count steps); a role that does not report one shows ``-``, and so does a version below
0 (a rollout worker with no weights, or torn ones) and any number that is not finite. Lag is how many versions
a node is behind the newest: the highest ``version`` any node reports (the ps-manager's committed version, a
rollout worker's weights, the orchestrator's policy) minus the node's own, never below 0. A ``step`` sets no
newest: a trainer reports the step it trains, which while it trains it is one past the newest version, so a
rollout worker serving the newest version reads 0, and so does that trainer. Text a node reports (id, role,
host) is shown with non-printable characters escaped (``\\x1b``), so a registry entry cannot drive the
terminal. The broker itself is not a registry member, so it is not a row; the title line names the cluster and
the broker's address.

A registry whose entries would not fit one answer within the body limit comes cut (the broker leaves the largest
out): top shows the nodes that came and says how many were left out, ``N nodes left out (registry answer over the
body limit)`` under the table.

On a terminal the table is redrawn in place (ANSI); otherwise each refresh is printed after the last.
``--once`` prints one table and exits; ``--json`` prints each refresh as one JSON object (one line),
``{"nodes": [row, ...], "omitted": N}``, ``omitted`` the live nodes left out of a cut answer. While
live, a broker that does not answer (or answers anything but its registry) is reported in place of the table,
as one line (with ``--json``, one JSON object ``{"error": ...}``, so every line stays strict JSON), and asked
again at the next refresh: a broker restarted on its addresses is shown again as soon as it answers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

from ..bus.runtime import BusUnavailable, NodeRuntime
from ..protocol.messages import NodeInfo
from .config import Config

# A terminal's screen is redrawn from its top-left corner, erasing what the last frame left below.
_HOME_AND_CLEAR = "\x1b[H\x1b[J"


@dataclass(frozen=True)
class Row:
    """One node as `refbus top` shows it; ``None`` where the node does not report the number."""

    node_id: str
    role: str
    host: str
    pid: int
    blobs_held: float | None
    bytes_held: float | None
    version: float | None
    lag: float | None
    heartbeat_age_s: float


def finite(value: object) -> float | None:
    """``value`` as a float when it is a finite number, else None (missing, NaN, infinite, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def json_safe(value: object) -> object:
    """``value`` (JSON-able builtins) with every non-finite float replaced by None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def printable(text: str) -> str:
    """``text`` with every non-printable character (controls, escapes, line breaks) written as an escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else
                                                 f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
                   for ch in text)


def _version(status: dict[str, float]) -> float | None:
    version = finite(status.get("version", status.get("step")))
    return version if version is not None and version >= 0 else None  # below 0: no (or torn) weights


def rows(nodes: Sequence[NodeInfo], now: float) -> list[Row]:
    """The table for ``nodes`` at wall-clock time ``now``, sorted by role then node id.

    ``version`` is the node's ``version`` status, else its ``step`` (None below 0 and when not finite, as
    every number here); ``lag`` is the highest ``version`` status of all rows (a ``step`` is none: see the
    module docstring) minus this row's version, at least 0 (both known); heartbeat
    age is ``now - last_seen``, never negative (the broker's clock stamps ``last_seen``; another host's clock
    may run slightly ahead).
    """
    versions = {n.node_id: _version(n.status) for n in nodes}
    known = [v for n in nodes if "version" in n.status and (v := versions[n.node_id]) is not None]
    newest = max(known) if known else None
    table = []
    for node in sorted(nodes, key=lambda n: (n.role, n.node_id)):
        version = versions[node.node_id]
        table.append(Row(
            node_id=node.node_id,
            role=node.role,
            host=node.host,
            pid=node.pid,
            blobs_held=finite(node.status.get("blobs_held")),
            bytes_held=finite(node.status.get("bytes_held")),
            version=version,
            lag=max(0.0, newest - version) if newest is not None and version is not None else None,
            heartbeat_age_s=max(0.0, finite(now - node.last_seen) or 0.0),
        ))
    return table


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    scaled, unit = value, "B"
    for larger in ("KiB", "MiB", "GiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, larger
    return f"{scaled:.0f} {unit}" if unit == "B" else f"{scaled:.1f} {unit}"


_COLUMNS = ("NODE", "ROLE", "HOST", "PID", "BLOBS", "BYTES", "VERSION", "LAG", "HEARTBEAT")


def format_table(table: Sequence[Row], title: str) -> str:
    """``title``, then an aligned text table with a header line (one line per row)."""
    cells = [_COLUMNS] + [
        (printable(r.node_id), printable(r.role), printable(r.host), str(r.pid), _number(r.blobs_held),
         _bytes(r.bytes_held), _number(r.version), _number(r.lag), f"{r.heartbeat_age_s:.1f}s")
        for r in table
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = [printable(title)] + [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in cells]
    return "\n".join(lines) + "\n"


class Top:
    """Asks the broker at ``config.bus.control`` for its registry and prints the table to ``out``."""

    def __init__(self, config: Config, *, as_json: bool = False, out: TextIO = sys.stdout) -> None:
        self.config = config
        self.as_json = as_json
        self.out = out
        self.redraw = out.isatty() and not as_json
        # Not a node: it neither registers nor serves metrics, so watching never changes what it watches.
        self.runtime = NodeRuntime("top", config.runtime(), register=False)

    def fetch(self) -> tuple[list[Row], int]:
        """The current table and how many live nodes the broker left out of it (a registry over its body limit is
        answered cut: shown as it came, never taken for the cluster); :class:`BusUnavailable` when the broker does
        not answer within the retries."""
        listed = self.runtime.listing()
        if listed is None:
            raise BusUnavailable(f"no registry from the broker at {self.config.bus.control}")
        return rows(listed.nodes, time.time()), listed.omitted

    def show(self, table: Sequence[Row], omitted: int = 0) -> None:
        """``table``, and ``omitted`` (the live nodes the broker left out of it) when there are any."""
        if self.as_json:
            shown = {"nodes": [asdict(r) for r in table], "omitted": omitted}
            self.out.write(json.dumps(json_safe(shown), allow_nan=False) + "\n")
        else:
            stamp = time.strftime("%H:%M:%S")
            title = (f"refbus top · cluster {self.config.cluster.name} · broker {self.config.bus.control} · "
                     f"{len(table)} nodes · {stamp}")
            cut = f"{omitted} nodes left out (registry answer over the body limit)\n" if omitted else ""
            self.out.write((_HOME_AND_CLEAR if self.redraw else "") + format_table(table, title) + cut
                           + ("" if self.redraw else "\n"))
        self.out.flush()

    def report(self, problem: str) -> None:
        """``problem`` in place of a table: with ``--json`` a JSON object, not text, so that a reader of the
        JSON lines can parse every one of them."""
        if self.as_json:
            self.out.write(json.dumps({"error": problem}) + "\n")
        else:
            self.out.write((_HOME_AND_CLEAR if self.redraw else "") + f"refbus top: {printable(problem)}\n")
        self.out.flush()

    def run(self, *, once: bool, interval_s: float) -> None:
        """Show the table once, or every ``interval_s`` until interrupted. While live, a broker that stops
        answering is reported in place of the table and asked again (it may be restarting)."""
        if not once and not 0 < interval_s < math.inf:  # NaN too: a negative sleep raises, zero floods the broker
            self.runtime.close()
            raise ValueError(f"the refresh interval must be a positive number of seconds, not {interval_s!r}")
        try:
            while True:
                try:
                    self.show(*self.fetch())
                except BusUnavailable as exc:
                    if once:
                        raise
                    self.report(str(exc))
                if once:
                    return
                time.sleep(interval_s)  # the refresh period of a display, not a wait for a condition
        finally:
            self.runtime.close()


def run_top(config: Config, args: argparse.Namespace) -> int:
    """``refbus top``: see the module docstring; returns 0 (errors raise :class:`BusUnavailable`)."""
    Top(config, as_json=args.json).run(once=args.once, interval_s=args.interval)
    return 0
