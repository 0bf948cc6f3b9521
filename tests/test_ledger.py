"""The ledger folds event records into blob ownership and finds violations and leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from refbus.nodes.ledger import Ledger, format_report, read_records


def _ref(blob_id: str, source: str = "env-0") -> dict:
    return {"blob_id": blob_id, "source": source}


def _run(records: list[dict]) -> Ledger:
    ledger = Ledger()
    for record in records:
        ledger.apply(record)
    return ledger


LIFECYCLE = [
    {"type": "episode-finished", "src": "env-0", "refs": [_ref("a"), _ref("b"), _ref("c")]},
    {"type": "episode-finished", "src": "env-1", "refs": [_ref("d", "env-1")]},
    {"type": "claim", "src": "env-0", "holder": "orch", "blob_ids": ["a", "b"]},
    {"type": "claim", "src": "env-1", "holder": "orch", "blob_ids": ["d"]},
    {"type": "delete", "src": "env-0", "holder": "orch", "reason": "filtered", "blob_ids": ["b"]},
    {"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["a", "d"]},
    {"type": "fetch-ack", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["a", "d"]},
    {"type": "delete", "src": "env-0", "holder": "trainer-0", "reason": "trained", "blob_ids": ["a"]},
    {"type": "delete", "src": "env-1", "holder": "trainer-0", "reason": "trained", "blob_ids": ["d"]},
    {"type": "delete", "src": "env-0", "holder": "env-0", "reason": "undelivered", "blob_ids": ["c"]},
]


def test_clean_lifecycle_has_everything_deleted_once() -> None:
    report = _run(LIFECYCLE).report()
    assert report.totals() == {
        "kept": 4, "deleted": {"filtered": 1, "trained": 2, "undelivered": 1}, "deleted_total": 4,
        "held": 0, "leaked": 0, "violations": 0,
    }
    assert report.as_dict()["sources"]["env-1"] == {"kept": 1, "deleted": {"trained": 1}, "held": {}, "leaked": 0}


def test_moves_relayed_out_of_order_still_end_with_the_last_holder() -> None:
    # The trainer's reference can reach the broker before the env server's mirror of the claim.
    claim, reference = LIFECYCLE[2], LIFECYCLE[5]
    reordered = [*LIFECYCLE[:2], reference, claim, *LIFECYCLE[3:5], *LIFECYCLE[6:]]
    report = _run(reordered).report()
    assert report.violations == []
    assert report.totals()["deleted_total"] == 4 and report.totals()["held"] == 0


def test_second_delete_non_owner_delete_and_late_fetch_are_violations() -> None:
    ledger = _run([
        *LIFECYCLE[:5],
        {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["b"]},
        {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["a"]},
        {"type": "fetch-ack", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["b"]},
        {"type": "violation", "src": "env-0", "blob_id": "b", "action": "delete", "holder": "trainer-1",
         "owner": "orch", "detail": "already deleted"},
    ])
    violations = ledger.report().violations
    assert len(violations) == 4
    assert "trainer-1 deleted b again (first deleted by orch)" in violations[0]
    assert "trainer-1 deleted a owned by orch (trained)" in violations[1]
    assert "trainer-0 fetched b after orch deleted it" in violations[2]
    assert violations[3].startswith("env-0 refused delete of b by trainer-1")


def test_blobs_held_by_a_node_that_went_down_are_leaked() -> None:
    report = _run([*LIFECYCLE[:6], {"type": "node-down", "node_id": "trainer-0", "reason": "timeout"}]).report()
    assert report.held["env-0"] == {"trainer-0": 1, "env-0": 1}
    assert report.held["env-1"] == {"trainer-0": 1}
    assert report.leaked == {"env-0": 1, "env-1": 1}
    assert "leaked=2" in format_report(report)


def test_cli_reads_a_monitor_file_and_exits_nonzero_on_violations(tmp_path: Path) -> None:
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps(r) for r in LIFECYCLE) + "\n")
    run = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "ledger", str(clean), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["total"]["deleted_total"] == 4

    dirty = tmp_path / "dirty.jsonl"
    dirty.write_text(clean.read_text() + json.dumps(LIFECYCLE[-1]) + "\n")
    run = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "ledger", str(dirty)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "violations=1" in run.stdout and "deleted c again" in run.stdout


def test_bad_lines_name_their_number() -> None:
    records = read_records(['{"type": "delete"}', "", "not json"])
    assert next(records)["type"] == "delete"
    with pytest.raises(ValueError, match="line 3"):
        next(records)
