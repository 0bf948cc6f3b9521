"""`refbus ledger`: account for every kept blob from the event stream alone.

The ledger replays ownership moves as the stream mirrors them:

* ``episode-finished`` — the source keeps the episode's blobs (owner: the env server, ``source``);
* ``claim`` — the orchestrator (``holder``) owns them;
* ``reference`` — a trainer rank (``holder``) owns them;
* ``fetch-ack`` — a trainer fetched them (a fetch of a deleted blob is a violation);
* ``delete`` — they are gone, by ``reason``;
* ``violation`` — a store refused something (counted as reported);
* ``node-down`` — a node left: blobs it still owns are *leaked* unless deleted later.

It reports, per source and in total: blobs kept, deleted by reason, still held (by whom), leaked,
violations. Violations it finds itself: a second delete of a blob, a delete by a node that does not own it
(except the store's own ``undelivered``/``shutdown`` clean-up), a fetch of a deleted blob. Input is the JSON
record that :func:`refbus.protocol.envelope.describe` makes (what ``refbus monitor --json`` prints), so a
file and a live subscription go through the same code.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STORE_REASONS = frozenset({"undelivered", "shutdown", "discarded"})
_STAGE = {"claim": 1, "reference": 2}  # env server (0) -> orchestrator -> trainer rank


@dataclass
class _Blob:
    source: str
    owner: str
    stage: int = 0  # how far along the hand-over chain the owner is (see _STAGE)
    deleted_by: str = ""
    reason: str = ""


@dataclass
class LedgerReport:
    kept: Counter[str] = field(default_factory=Counter)  # per source
    deleted: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # source -> reason
    held: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # source -> holder
    leaked: Counter[str] = field(default_factory=Counter)  # per source
    violations: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        deleted: Counter[str] = Counter()
        for reasons in self.deleted.values():
            deleted.update(reasons)
        return {
            "kept": sum(self.kept.values()),
            "deleted": dict(deleted),
            "deleted_total": sum(deleted.values()),
            "held": sum(sum(h.values()) for h in self.held.values()),
            "leaked": sum(self.leaked.values()),
            "violations": len(self.violations),
        }

    def as_dict(self) -> dict[str, Any]:
        sources = sorted(set(self.kept) | set(self.deleted) | set(self.held))
        return {
            "total": self.totals(),
            "sources": {
                s: {
                    "kept": self.kept[s],
                    "deleted": dict(self.deleted.get(s, {})),
                    "held": dict(self.held.get(s, {})),
                    "leaked": self.leaked[s],
                }
                for s in sources
            },
            "violations": self.violations,
        }


class Ledger:
    """Folds event records into blob ownership. Feed records in stream order with :meth:`apply`."""

    def __init__(self) -> None:
        self.blobs: dict[str, _Blob] = {}
        self.down: set[str] = set()
        self.violations: list[str] = []

    def apply(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "episode-finished":
            for ref in record["refs"]:
                self.blobs[ref["blob_id"]] = _Blob(source=ref["source"], owner=ref["source"])
        elif kind in _STAGE:
            # Moves come from different nodes (the env server mirrors a claim, the trainer a reference), so
            # the broker may relay them out of causal order: a blob only ever moves forward along the chain.
            stage = _STAGE[kind]
            for blob_id in record["blob_ids"]:
                blob = self.blobs.get(blob_id)
                if blob is not None and not blob.deleted_by and stage > blob.stage:
                    blob.owner, blob.stage = record["holder"], stage
        elif kind == "fetch-ack":
            for blob_id in record["blob_ids"]:
                blob = self.blobs.get(blob_id)
                if blob is not None and blob.deleted_by:
                    self._violation(f"{record['holder']} fetched {blob_id} after {blob.deleted_by} deleted it")
        elif kind == "delete":
            self._delete(record)
        elif kind == "violation":
            self.violations.append(
                f"{record['src']} refused {record['action']} of {record['blob_id']} by {record['holder']} "
                f"(owner {record['owner'] or '?'}): {record['detail']}"
            )
        elif kind == "node-down":
            self.down.add(record["node_id"])

    def _delete(self, record: dict[str, Any]) -> None:
        holder, reason = record["holder"], record["reason"]
        for blob_id in record["blob_ids"]:
            blob = self.blobs.get(blob_id)
            if blob is None:
                blob = self.blobs[blob_id] = _Blob(source=record["src"], owner=holder)
            if blob.deleted_by:
                self._violation(f"{holder} deleted {blob_id} again (first deleted by {blob.deleted_by})")
                continue
            store_cleanup = holder == blob.source and reason in STORE_REASONS
            if holder != blob.owner and not store_cleanup:
                self._violation(f"{holder} deleted {blob_id} owned by {blob.owner} ({reason})")
            blob.deleted_by, blob.reason = holder, reason

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    def report(self) -> LedgerReport:
        report = LedgerReport(violations=list(self.violations))
        for blob in self.blobs.values():
            report.kept[blob.source] += 1
            if blob.deleted_by:
                report.deleted[blob.source][blob.reason] += 1
            else:
                report.held[blob.source][blob.owner] += 1
                if blob.owner in self.down:
                    report.leaked[blob.source] += 1
        return report


def read_records(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    """Records from ``refbus monitor --json`` output; blank lines skipped, bad lines raise with their number."""
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number}: not a JSON event record ({exc})") from None


def format_report(report: LedgerReport) -> str:
    lines = []
    data = report.as_dict()
    for source, entry in data["sources"].items():
        deleted = ", ".join(f"{r}={n}" for r, n in sorted(entry["deleted"].items())) or "-"
        held = ", ".join(f"{h}={n}" for h, n in sorted(entry["held"].items())) or "-"
        lines.append(f"{source}: kept={entry['kept']} deleted[{deleted}] held[{held}] leaked={entry['leaked']}")
    total = data["total"]
    lines.append(
        f"total: kept={total['kept']} deleted={total['deleted_total']} held={total['held']} "
        f"leaked={total['leaked']} violations={total['violations']}"
    )
    lines.extend(f"violation: {v}" for v in report.violations)
    return "\n".join(lines)
