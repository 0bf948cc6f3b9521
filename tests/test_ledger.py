"""The ledger folds event records into blob ownership and per-store counters: violations, leaks, losses named
with the node whose death caused them, gaps in the stream, reconciliation with the stores' own counters, the
launcher's run-end."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.config import Config
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ledger import STORE_ROLE, Ledger, format_report, read_records, reconcile_stores
from refbus.protocol.envelope import PROTOCOL_VERSION, Header, Message, WireCodec, describe, incarnation
from refbus.protocol.messages import (
    CLAIMS_BACK,
    Accounted,
    BlobRef,
    Body,
    Claim,
    Delete,
    EpisodeFinished,
    FetchAck,
    Keep,
    NodeDown,
    NodeInfo,
    NodeList,
    Nodes,
    NodeUp,
    Reference,
    RunEnd,
)
from structlog.testing import capture_logs

WAIT_S = 10.0

INCARNATION = "a1b2c3"


def spawn_live_ledger(spawn, control: str, report_path: Path) -> NodeProcess:
    """A live ``refbus ledger --json`` on the broker at ``control``, ready; its report goes to ``report_path``
    when it stops (the run-end)."""
    with open(report_path, "wb") as out:
        ledger = spawn(["ledger", "--json", "--bus-control", control, "--node-id", "ledger", *FAST_LIVENESS],
                       "ledger", stdout=out)
    ledger.wait_ready(timeout=WAIT_S * 3)
    return ledger


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
        "held": 0, "leaked": 0, "lost": 0, "violations": 0, "refused_events": 0, "unaccounted": 0,
        "missed_events": 0,
    }
    assert report.as_dict()["stores"]["env-1"] == {"kept": 1, "deleted": {"trained": 1}, "held": {}, "reconciled": ""}
    assert report.ok


@pytest.mark.parametrize("order", ["claim-first", "references-first", "before-its-episode"])
def test_a_reference_a_third_node_publishes_moves_nothing_as_at_its_store(order: str) -> None:
    """A ``reference`` counts only from an end of its hand-over, as at the stores (which refuse the rest): the
    rank it names, or the blob's claimer (the orchestrator's repeat). A third node's moves nothing: refused,
    logged and counted by source, so the orchestrator's later delete of its own blob is no violation; whatever
    order the broker relays the claim, the references and the episode in. Before, the third node's event made
    the blob the named rank's, and the orchestrator's delete a non-owner delete."""
    kept = {"type": "episode-finished", "src": "env-0", "refs": [_ref("a"), _ref("b")]}
    claim = {"type": "claim", "src": "env-0", "holder": "orch", "blob_ids": ["a", "b"]}
    references = [{"type": "reference", "src": "intruder", "holder": "trainer-0", "blob_ids": ["a", "b"]},
                  {"type": "reference", "src": "orch", "holder": "trainer-1", "blob_ids": ["b"]}]
    deletes = [{"type": "delete", "src": "env-0", "holder": "orch", "reason": "filtered", "blob_ids": ["a"]},
               {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["b"]}]
    stream = {"claim-first": [kept, claim, *references], "references-first": [kept, *references, claim],
              "before-its-episode": [*references, claim, kept]}[order]
    with capture_logs() as logs:
        ledger = _run([*stream, *deletes])
    report = ledger.report()
    assert report.violations == [] and report.ok, report.as_dict()
    assert report.references_refused == {"intruder": 2}
    assert "references refused: 2 blob ids handed over by intruder" in format_report(report)
    assert [(e["src"], e["holder"]) for e in logs if e["event"] == "ledger.reference_refused"] == \
        [("intruder", "trainer-0")]  # once per source


def test_moves_relayed_out_of_order_still_end_with_the_last_holder() -> None:
    # The trainer's reference can reach the broker before the env server's mirror of the claim.
    claim, reference = LIFECYCLE[2], LIFECYCLE[5]
    reordered = [*LIFECYCLE[:2], reference, claim, *LIFECYCLE[3:5], *LIFECYCLE[6:]]
    report = _run(reordered).report()
    assert report.violations == []
    assert report.totals()["deleted_total"] == 4 and report.totals()["held"] == 0


def test_second_delete_non_owner_delete_and_a_refused_fetch_are_violations() -> None:
    """A fetch-ack relayed after a delete of its blob is only relay order (the store served the fetch, so
    before the delete); a fetch after a delete is the store's to refuse and report."""
    ledger = _run([
        *LIFECYCLE[:5],
        {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["b"]},
        {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["a"]},
        {"type": "fetch-ack", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["b"]},
        {"type": "violation", "src": "env-0", "blob_id": "b", "action": "delete", "holder": "trainer-1",
         "owner": "orch", "detail": "already deleted"},
    ])
    violations = ledger.report().violations
    assert len(violations) == 3
    assert "trainer-1 deleted b again (first deleted by orch)" in violations[0]
    assert violations[1].startswith("env-0 refused delete of b by trainer-1")
    # While the orchestrator owns it, a rank's delete waits for that rank's reference: none came.
    assert violations[2] == "trainer-1 deleted a owned by orch (trained; no reference by trainer-1 folded)"


def test_a_ranks_delete_relayed_before_its_reference_is_no_violation_unless_another_rank_was_referenced() -> None:
    """The store mirrors a rank's delete, the rank publishes its reference: the broker may relay either first."""
    delete_a, delete_d = LIFECYCLE[7], LIFECYCLE[8]
    reordered = [*LIFECYCLE[:5], delete_a, delete_d, LIFECYCLE[5], LIFECYCLE[9]]
    ledger = _run(reordered[:7])
    assert len(ledger.report().violations) == 2  # until the reference comes, the deletes are not the owner's
    ledger = _run(reordered)
    assert ledger.report().violations == [] and ledger.report().ok and not ledger.awaiting_reference
    other = _run([*reordered[:7], {**LIFECYCLE[5], "holder": "trainer-1", "src": "trainer-1"}])
    assert other.report().violations == ["trainer-0 deleted a owned by trainer-1 (trained)",
                                         "trainer-0 deleted d owned by trainer-1 (trained)"]


# What a watcher started before the run records first: its own node-up (the broker's first event) was published
# before its subscription was live, so the broker's stream starts at 2 there.
WATCHER_JOINED = {"type": "node-up", "src": "bus", "seq": 2, "id": "b0b0b0-2",
                  "node": {"node_id": "orch", "role": "orchestrator", "host": "h", "pid": 1, "endpoints": {},
                           "labels": {}}}


def test_a_gap_in_a_stream_that_carries_no_hand_over_leaves_a_ranks_early_delete_to_its_reference() -> None:
    """Before, any gap anywhere (the broker's node-up of the watcher recording the stream, missing from every such
    record) made a rank's delete relayed before its reference unverified at once, and the run's report not ok
    though the reference came."""
    delete_a, delete_d = LIFECYCLE[7], LIFECYCLE[8]
    reordered = [WATCHER_JOINED, *LIFECYCLE[:5], delete_a, delete_d, LIFECYCLE[5], LIFECYCLE[9]]
    ledger = _run(reordered)
    report = ledger.report()
    assert report.missed == {"bus": 1}
    assert report.violations == [] and report.unaccounted == [] and report.ok, report.as_dict()
    # A non-owner's delete of a blob no reference ever explains is still a violation: that gap cannot hide it.
    stray = _run([WATCHER_JOINED, *LIFECYCLE[:5],
                  {"type": "delete", "src": "env-0", "holder": "trainer-1", "reason": "trained", "blob_ids": ["c"]}])
    assert stray.report().violations == ["trainer-1 deleted c owned by env-0 (trained)"]


def test_a_ranks_early_delete_whose_reference_may_be_in_a_gap_of_an_end_is_unverified() -> None:
    """The delete waits for the deleter's reference; never folded, it is a violation unless events of either end
    of the hand-over (the rank, the orchestrator) went missing: then it is unverified, and the report not ok."""
    gap = _seq([{"type": "fetch-ack", "holder": "trainer-0", "blob_ids": ["a"]}], "trainer-0", 3)
    early = [*LIFECYCLE[:5], LIFECYCLE[7]]
    assert _run(early).report().violations == [
        "trainer-0 deleted a owned by orch (trained; no reference by trainer-0 folded)"]
    report = _run([*early, *gap]).report()
    assert report.violations == [] and not report.ok
    assert ("1 deletes by a node the stream did not show as the owner, after events went missing: a violation "
            "cannot be told from a missed hand-over") in report.unaccounted, report.unaccounted


@pytest.mark.parametrize("forged_for", ["another-rank", "the-deleter"])
def test_a_third_nodes_reference_after_a_ranks_early_delete_neither_makes_nor_hides_a_violation(
        forged_for: str) -> None:
    """trainer-0's delete of a (mirrored by env-0) is relayed while the orchestrator still owns it: it waits for
    trainer-0's reference. A third node's ``reference`` of a, published by neither end of the hand-over, is refused
    there too (counted by source): naming another rank it reported trainer-0's delete a violation, and naming
    trainer-0 it settled a delete that no reference of an end ever explained."""
    forged = {"type": "reference", "src": "intruder", "holder": "trainer-1" if forged_for == "another-rank"
              else "trainer-0", "blob_ids": ["a"]}
    early = [*LIFECYCLE[:5], LIFECYCLE[7], forged]
    waiting = _run(early).report()
    assert waiting.violations == ["trainer-0 deleted a owned by orch (trained; no reference by trainer-0 folded)"]
    assert waiting.references_refused == {"intruder": 1}
    ledger = _run([*early, {**LIFECYCLE[5], "blob_ids": ["a"]}])  # trainer-0's own reference comes
    assert ledger.report().violations == [] and not ledger.awaiting_reference


def test_blobs_held_by_a_node_that_went_down_are_leaked() -> None:
    report = _run([*LIFECYCLE[:6], {"type": "node-down", "node_id": "trainer-0", "reason": "timeout"}]).report()
    assert report.held["env-0"] == {"trainer-0": 1, "env-0": 1}
    assert report.held["env-1"] == {"trainer-0": 1}
    assert report.leaked == {"trainer-0": 2}  # named with the holder that went down
    assert "leaked=2" in format_report(report) and "2 held by trainer-0 (down)" in format_report(report)
    assert not report.ok


def test_a_replica_deletes_its_own_blobs_in_its_source_s_name() -> None:
    """Replicas env-0 and env-1 serve source "env": their own clean-up deletes name the source as holder."""
    report = _run([
        {"type": "episode-finished", "src": "env-1", "refs": [_ref("x", "env"), _ref("y", "env")]},
        {"type": "delete", "src": "env-1", "holder": "env", "reason": "shutdown", "blob_ids": ["x"]},
        {"type": "delete", "src": "env-1", "holder": "env-0", "reason": "shutdown", "blob_ids": ["y"]},
    ]).report()
    assert report.violations == ["env-0 deleted y owned by env-1 (shutdown)"]
    assert report.deleted["env-1"] == {"shutdown": 2}


def test_a_store_that_leaves_after_deleting_everything_lost_nothing() -> None:
    report = _run([*LIFECYCLE, {"type": "node-down", "node_id": "env-0", "reason": "bye"}]).report()
    assert report.lost == {} and report.ok


def test_a_holders_own_delete_relayed_before_its_fetch_ack_is_no_late_fetch() -> None:
    """The store mirrors the trainer's delete while the trainer's fetch-ack is still on its way (two nodes, two
    paths to the broker): the fetch came first."""
    report = _run([*LIFECYCLE[:6], LIFECYCLE[8], LIFECYCLE[6], LIFECYCLE[7]]).report()
    assert report.violations == [] and report.totals()["deleted"] == {"filtered": 1, "trained": 2}


def test_a_holder_back_under_its_id_holds_again() -> None:
    report = _run([*LIFECYCLE[:6], {"type": "node-down", "node_id": "trainer-0", "reason": "timeout"},
                   {"type": "node-up", "node": {"node_id": "trainer-0"}}]).report()
    assert report.leaked == {} and report.totals()["held"] == 3


# trainer-0, holding a (env-0) and d (env-1), is killed; its new process registers under its id (a world restart)
# and the stores reclaim both at once, naming it.
RANK_RECLAIMED = [
    {"type": "node-down", "node_id": "trainer-0", "reason": "timeout"},
    {"type": "node-up", "node": {"node_id": "trainer-0", "labels": {CLAIMS_BACK: "0"}}},
    {"type": "delete", "src": "env-0", "holder": "env-0", "node": "trainer-0", "reason": "holder-down",
     "blob_ids": ["a"]},
    {"type": "delete", "src": "env-1", "holder": "env-1", "node": "trainer-0", "reason": "holder-down",
     "blob_ids": ["d"]},
]


def test_a_ranks_blobs_reclaimed_as_its_new_process_registers_are_a_loss_named_with_it_not_held_at_run_end() -> None:
    """A rank is killed holding a (env-0) and d (env-1); its new process registers under its id (a world restart)
    and the stores reclaim both at once, after that ``node-up``, then the run ends: each is a loss named with the
    rank, once, none held at the run's end, no violation."""
    report = _run([
        *LIFECYCLE[:6],
        *RANK_RECLAIMED,
        {"type": "run-end", "reason": "done", "steps": 1},
    ]).report()
    assert report.lost == {"trainer-0": 2} and report.held_at_end == {} and report.leaked == {}
    assert report.violations == [] and report.unaccounted == [] and report.inherited == {}
    assert report.held == {"env-0": {"env-0": 1}, "env-1": {}}  # c: unclaimed, its store's own


def test_a_ranks_blobs_reclaimed_before_its_reference_is_relayed_are_still_a_loss_named_with_it() -> None:
    """The store reclaims what it knows the dead rank held (holder-down, ``node`` the rank) once it heard of the
    hand-over, but the watcher's copy of the ``reference`` may come later (dropped at a slow subscriber, filled from
    the ring when the gap shows): the loss is the rank's whatever the order. Before, the fold named the
    orchestrator, the owner it had shown until then."""
    reclaimed = RANK_RECLAIMED
    in_order = _run([*LIFECYCLE[:6], *reclaimed]).report()
    reference_last = _run([*LIFECYCLE[:5], *reclaimed, LIFECYCLE[5]]).report()
    assert reference_last.lost == in_order.lost == {"trainer-0": 2}
    assert reference_last == in_order


def test_a_dead_store_loses_what_it_kept_named_with_the_store() -> None:
    """env-1 dies holding d (claimed by the orchestrator), which then drops its reference (reason lost); env-0
    reclaims from a dead holder (holder-down). Each loss names the node whose death caused it, once."""
    report = _run([
        *LIFECYCLE[:6],
        {"type": "node-down", "node_id": "env-1", "reason": "timeout"},
        {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "blob_ids": ["d"]},
        {"type": "node-down", "node_id": "trainer-0", "reason": "timeout"},
        {"type": "delete", "src": "env-0", "holder": "env-0", "reason": "holder-down", "blob_ids": ["a"]},
    ]).report()
    assert report.lost == {"env-1": 1, "trainer-0": 1}
    assert report.violations == [] and report.leaked == {}
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (4, 1, 1, 2)
    assert report.held == {"env-0": {"env-0": 1}}  # c: unclaimed, still with its live store
    assert "lost: 1 with env-1" in format_report(report) and not report.ok


CUT_OFF = [  # env-1 is cut off (not dead) past the grace, then back as the same process
    {"type": "episode-finished", "src": "env-1", "refs": [_ref("d", "env-1"), _ref("e", "env-1"), _ref("f", "env-1")]},
    {"type": "claim", "src": "env-1", "holder": "orch", "blob_ids": ["d", "e"]},
    {"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["e"]},
    {"type": "node-down", "node_id": "env-1", "reason": "timeout"},
    {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "node": "env-1", "blob_ids": ["d"]},
    # published while cut off, relayed once the link is back, before it registers again: still down
    {"type": "delete", "src": "env-1", "holder": "env-1", "reason": "undelivered", "blob_ids": ["f"]},
]


def test_a_store_cut_off_past_the_grace_and_back_counts_each_lost_blob_once_with_the_store() -> None:
    ledger = _run(CUT_OFF)
    assert ledger.report().lost == {"env-1": 2}  # what it still kept while down: d (declared lost) and e
    for record in [
        {"type": "node-up", "node": {"node_id": "env-1"}},
        # The orchestrator deletes there what it declared lost: the store's side of the same loss.
        {"type": "delete", "src": "env-1", "holder": "orch", "reason": "lost", "node": "env-1", "blob_ids": ["d"]},
        {"type": "delete", "src": "env-1", "holder": "trainer-0", "reason": "trained", "blob_ids": ["e"]},
    ]:
        ledger.apply(record)
    report = ledger.report()
    assert report.lost == {"env-1": 1} and report.violations == [] and report.leaked == {}
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (3, 2, 0, 1)
    assert totals["deleted"] == {"undelivered": 1, "trained": 1}


def test_a_holder_declaring_lost_what_its_store_had_deleted_is_no_second_delete() -> None:
    """The store carried out the orchestrator's delete of b, and its answer died with a store reported down
    until its grace ended: the orchestrator then declares b lost with the store. b was deleted once. A blob the
    orchestrator had handed over and the rank deleted is another matter."""
    report = _run([
        *LIFECYCLE,
        {"type": "node-down", "node_id": "env-0", "reason": "timeout"},
        {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "node": "env-0", "blob_ids": ["b"]},
    ]).report()
    assert report.violations == [] and report.lost == {}
    assert report.totals()["deleted"] == {"filtered": 1, "trained": 2, "undelivered": 1}
    # Deleted by the rank it was handed to: the orchestrator still listed a blob it no longer held.
    handed = _run([
        *LIFECYCLE,
        {"type": "node-down", "node_id": "env-0", "reason": "timeout"},
        {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "node": "env-0", "blob_ids": ["a"]},
    ]).report()
    assert handed.violations == ["orch deleted a again (first deleted by trainer-0)"]


def test_a_store_back_from_a_cut_that_deletes_a_lost_blob_itself_counts_it_once() -> None:
    """The store shut down before the holder's delete of what it declared lost reached it: its own delete is
    the blob's one count (a shutdown, not a second delete), and a repeat of the holder's event changes nothing."""
    report = _run([
        *CUT_OFF,
        {"type": "node-up", "node": {"node_id": "env-1"}},
        {"type": "delete", "src": "env-1", "holder": "trainer-0", "reason": "trained", "blob_ids": ["e"]},
        {"type": "delete", "src": "env-1", "holder": "env-1", "reason": "shutdown", "blob_ids": ["d"]},
        {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "node": "env-1", "blob_ids": ["d"]},
    ]).report()
    assert report.lost == {} and report.violations == []
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"]) == (3, 3, 0)
    # A real second delete of a blob deleted by its owner is still a violation.
    again = _run([*LIFECYCLE, {"type": "delete", "src": "env-0", "holder": "orch", "reason": "lost",
                              "node": "env-0", "blob_ids": ["a"]}]).report()
    assert again.violations == ["orch deleted a again (first deleted by trainer-0)"]


def _seq(records: list[dict], src: str, start: int = 1, incarnation: str = INCARNATION) -> list[dict]:
    """``records`` as one source's stream: src, consecutive seq from ``start``, ids of one incarnation."""
    return [{**r, "src": src, "seq": start + i, "id": f"{incarnation}-{start + i:x}"} for i, r in enumerate(records)]


STORE_STREAM = _seq([
    {"type": "episode-finished", "refs": [_ref("a"), _ref("b")]},
    {"type": "claim", "holder": "orch", "blob_ids": ["a", "b"]},
    {"type": "episode-finished", "refs": [_ref("c")]},
    {"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["a"]},
    {"type": "delete", "holder": "env-0", "reason": "undelivered", "blob_ids": ["c"]},
], "env-0")
# What env-0 itself counted after publishing those five events.
ACCOUNT = {"store": "env-0", "seq": 5, "kept": 3, "held": 1, "deleted": {"filtered": 1, "undelivered": 1},
           "held_by": {"orch": 1}, "reclaimed": {}, "violations": {}}


def test_a_store_that_agrees_with_the_fold_is_exact() -> None:
    ledger = _run(STORE_STREAM)
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 6}, final=False) == "behind"
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 4}, final=False) == "ahead"
    assert ledger.reconcile("env-0", INCARNATION, ACCOUNT, final=False) == "agreed"
    report = ledger.report()
    assert report.reconciled == {"env-0": "agreed"} and report.held["env-0"] == {"orch": 1}
    assert report.totals()["missed_events"] == 0 and report.unaccounted == []


# A restarted broker gets each node's held events when that node re-joins it, so the order across sources follows
# the re-join order (a gap fill reorders the same way): a rank and the orchestrator re-joining before the store
# put their references of its blobs ahead of the store's episode-finished and claim.
REF_FIRST = [
    {"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["a", "b"]},
    {"type": "reference", "src": "orch", "holder": "trainer-0", "blob_ids": ["a", "b"]},
    *_seq([{"type": "episode-finished", "refs": [_ref("a"), _ref("b")]},
           {"type": "claim", "holder": "orch", "blob_ids": ["a", "b"]},
           {"type": "delete", "holder": "trainer-0", "reason": "trained", "blob_ids": ["a", "b"]}], "env-0"),
]


def test_moves_relayed_before_their_blobs_episode_finished_wait_for_it() -> None:
    """Before, a move of a blob not yet kept was dropped: the claim then left the blobs with the orchestrator
    and the rank's delete waited for a reference that had come already (a violation, not ok)."""
    ledger = _run([*REF_FIRST, {"type": "run-end", "reason": "done", "steps": 1}])
    report = ledger.report()
    assert report.violations == [] and report.held_at_end == {} and report.ok, report
    account = {"seq": 3, "kept": 2, "deleted": {"trained": 2}, "violations": {}}
    assert ledger.reconcile("env-0", INCARNATION, account, final=False) == "agreed"
    assert not ledger.awaiting_reference and ledger.blobs == {}


def test_a_delete_relayed_before_the_episode_finished_drops_its_waiting_moves() -> None:
    """The orchestrator's ``lost`` delete of a comes before the store's episode-finished too: a is gone, so the
    episode-finished keeps it in the store's counters (lost with the store) but not in the fold, where the rank's
    waiting reference would have it held by the rank at run end."""
    ledger = _run([
        REF_FIRST[0],
        {"type": "node-down", "node_id": "env-0", "reason": "timeout"},
        {"type": "delete", "src": "orch", "holder": "orch", "reason": "lost", "node": "env-0", "blob_ids": ["a"]},
        REF_FIRST[2],
        {"type": "run-end", "reason": "done", "steps": 1},
    ])
    assert "a" not in ledger.blobs and set(ledger.blobs) == {"b"}
    report = ledger.report()
    assert report.lost == {"env-0": 2} and report.held_at_end == {} and report.violations == []


def test_moves_waiting_for_their_blob_are_bounded_per_source_and_a_drop_is_counted() -> None:
    """Moves of ids never kept (garbage, or kept before the stream's window) must not hold memory for ever: past
    ``pending_moves`` ids of a source its oldest is dropped, logged and counted; a delete that the dropped move
    would have explained is then unverified, not a violation."""
    ledger = Ledger(pending_moves=2)
    with capture_logs() as logs:
        for record in [{"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": [blob]}
                       for blob in ("x", "a", "b", "y")]:
            ledger.apply(record)
    assert ledger.moves_dropped == {"trainer-0": 2}
    assert [entry["src"] for entry in logs if entry["event"] == "ledger.moves_dropped"] == ["trainer-0"]
    for record in REF_FIRST[2:]:
        ledger.apply(record)
    report = ledger.report()
    assert report.violations == [] and report.totals()["deleted_total"] == 2
    assert report.unaccounted == ["1 deletes by a node the stream did not show as the owner, after events went "
                                  "missing: a violation cannot be told from a missed hand-over"]
    with pytest.raises(ValueError, match="pending_moves must be >= 1"):
        Ledger(pending_moves=0)


class _Registry:
    """What :func:`reconcile_stores` asks of a runtime, scripted: each lookup lists the next of ``listings``
    (the last one from then on; None: the broker did not answer), and every listed store answers its
    counters."""

    def __init__(self, *listings: list[str] | None) -> None:
        self.listings = listings
        self.lookups = 0

    def lookup(self, role: str) -> list[NodeInfo] | None:
        assert role == STORE_ROLE
        listing = self.listings[min(self.lookups, len(self.listings) - 1)]
        self.lookups += 1
        if listing is None:
            return None
        return [NodeInfo(node_id=name, role=role, host="h", pid=1, endpoints={"blobs": name}) for name in listing]

    def client(self, endpoint: str) -> SimpleNamespace:
        reply = SimpleNamespace(body=Accounted(store=endpoint, seq=0, kept=0, held=0),
                                header=SimpleNamespace(id=f"{INCARNATION}-1"))
        return SimpleNamespace(request=lambda request: reply)


def _reconcile_with(registry: _Registry, **kwargs: object) -> tuple[list[str], list[str]]:
    """The problems :func:`reconcile_stores` returns and the stores it reconciled."""
    reconciled: list[str] = []

    def reconcile(node_id: str, incarnation: str, account: dict, *, final: bool) -> str:
        reconciled.append(node_id)
        return "agreed"

    return reconcile_stores(registry, reconcile, lambda: None, **kwargs), reconciled  # type: ignore[arg-type]


def test_a_registry_the_broker_did_not_give_or_a_store_missing_from_it_is_a_problem() -> None:
    """Before, a lookup the broker did not answer read as no store at all, and a store absent from the
    registry was never asked: the accounting vouched for stores it had not read."""
    assert _reconcile_with(_Registry(None)) == (
        ["stores: the broker did not answer the registry lookup: no store's counters read"], [])
    assert _reconcile_with(_Registry(["env-0"]), expected={"env-0", "env-1"}, wait_s=0.2) == (
        ["store env-1: not in the registry: its counters not read"], ["env-0"])
    # One re-joining a restarted broker is waited for, and read.
    late = _Registry(["env-0"], ["env-0", "env-1"])
    assert _reconcile_with(late, expected={"env-0", "env-1"}, wait_s=WAIT_S) == ([], ["env-0", "env-1"])
    assert late.lookups == 2


def test_duplicated_records_count_once() -> None:
    report = _run([*STORE_STREAM, STORE_STREAM[3], STORE_STREAM[0]]).report()
    assert report.totals()["kept"] == 3 and report.violations == []


def test_a_gap_is_unaccounted_until_the_store_corrects_it() -> None:
    """Events 2 (the claim) and 3 (episode c) never arrived: the fold alone says too little and says so; the
    store's counters make the account exact again, and later events add on top of them. The orchestrator's
    delete of a blob the fold never saw it claim stays unverifiable, and is said to be."""
    ledger = _run([STORE_STREAM[0], *STORE_STREAM[3:]])
    before = ledger.report()
    assert before.missed == {"env-0": 2}
    assert before.unaccounted and "env-0: 2 of its events missing" in before.unaccounted[0] and not before.ok

    assert ledger.reconcile("env-0", INCARNATION, ACCOUNT, final=False) == "corrected"
    ledger.apply(_seq([{"type": "delete", "holder": "env-0", "reason": "shutdown", "blob_ids": ["b"]}], "env-0", 6)[0])
    report = ledger.report()
    totals = report.totals()
    assert (totals["kept"], totals["deleted"], totals["held"]) == (3, {"filtered": 1, "undelivered": 1,
                                                                       "shutdown": 1}, 0)
    assert report.reconciled["env-0"].startswith("corrected") and report.violations == []
    assert report.unaccounted == ["1 deletes by a node the stream did not show as the owner, after events went "
                                  "missing: a violation cannot be told from a missed hand-over"]
    # The missing events arriving late move blobs but are not counted twice.
    ledger.apply(STORE_STREAM[2])
    assert ledger.report().totals()["kept"] == 3


def test_events_missing_at_the_stream_start_are_counted_and_a_final_reconcile_adopts_the_store() -> None:
    ledger = _run(STORE_STREAM[3:])  # a ring that no longer holds the run's first events
    assert ledger.report().missed == {"env-0": 3}
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 7, "kept": 3}, final=True) == "corrected"
    report = ledger.report()
    assert report.missed == {"env-0": 5} and report.totals()["kept"] == 3
    assert report.held["env-0"] == {"orch": 1}  # attributed by the store's own view


def test_a_restarted_source_starts_a_new_stream() -> None:
    restarted = [{**r, "id": "ffeedd-1"} for r in _seq([{"type": "episode-finished", "refs": [_ref("z")]}], "env-0")]
    report = _run([*STORE_STREAM, *restarted]).report()
    assert report.missed == {} and report.totals()["kept"] == 4


def test_run_end_names_what_holders_still_hold() -> None:
    ended = _run([*LIFECYCLE[:6], {"type": "run-end", "reason": "done", "steps": 1}]).report()
    assert ended.ended and ended.held_at_end == {"trainer-0": 2}
    assert "held at run end: 2 by trainer-0" in format_report(ended) and not ended.ok
    # What its store still keeps unclaimed is the store's to delete (lease or shutdown): no leak.
    unclaimed = _run([LIFECYCLE[1], {"type": "run-end", "reason": "done"}]).report()
    assert unclaimed.held_at_end == {} and unclaimed.ok


def test_a_store_killed_before_publishing_its_deletes_holds_nothing_at_run_end_by_its_own_counters() -> None:
    """The orchestrator's delete of b reached the store, which counted it and was killed before publishing it:
    the fold alone still names the orchestrator as b's holder, the store's own counters (read at the run's
    end) say nobody holds anything, and they win, as they do for what the report says is held."""
    ledger = _run(STORE_STREAM)
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 6, "held": 0, "held_by": {},
                                                   "deleted": {"filtered": 2, "undelivered": 1}},
                            final=True) == "corrected"
    ledger.apply({"type": "run-end", "reason": "done", "steps": 1})
    report = ledger.report()
    assert report.held_at_end == {} and report.held["env-0"] == {}
    assert report.missed == {"env-0": 1} and report.totals()["deleted"] == {"filtered": 2, "undelivered": 1}
    # A corrected store that still has a blob out names its holder itself.
    still_out = _run(STORE_STREAM[:4])
    assert still_out.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 5}, final=True) == "corrected"
    still_out.apply({"type": "run-end", "reason": "done", "steps": 1})
    assert still_out.report().held_at_end == {"orch": 1}


def _refusal(count: object, seq: int) -> dict:
    """env-0's ``violation`` record after STORE_STREAM: ``count`` ids of trainer-0's refused (None: no count, as an
    older store's event reads)."""
    record = {"type": "violation", "action": "delete", "blob_id": "a", "holder": "trainer-1", "owner": "orch",
              "detail": "trainer-1 deleted it after orch"}
    return _seq([record if count is None else {**record, "count": count, "sample": ["a"]}], "env-0", seq)[0]


def test_a_violation_event_counts_its_ids_as_the_store_does() -> None:
    """One event of 50,000 refused ids is 50,000 violations (one line), agreeing with the store's counters;
    an event without a count (an older store's) is one."""
    ledger = _run([*STORE_STREAM, _refusal(50_000, 6), _refusal(None, 7)])
    report = ledger.report()
    assert report.totals()["violations"] == 50_001 and len(report.violations) == 2 and not report.ok
    assert report.violations[0] == ("env-0 refused delete of 50000 blobs (a first) by trainer-1 (owner orch): "
                                    "trainer-1 deleted it after orch")
    assert report.violations[1].startswith("env-0 refused delete of a by trainer-1")
    account = {**ACCOUNT, "seq": 7, "violations": {"delete": 50_001}}
    assert ledger.reconcile("env-0", INCARNATION, account, final=False) == "agreed"
    assert "violations=50001" in format_report(ledger.report())


@pytest.mark.parametrize("violation_first", [True, False], ids=["violation first", "delete first"])
def test_a_violation_that_is_a_restarted_stores_first_event_counts_once(violation_first: bool) -> None:
    """The restarted process of a durable store refuses a second delete before anything else it publishes: the
    fold counts the refusal under that process, so its counters (going on from the journal) agree, and the
    violation is reported once."""
    first = _seq([{"type": "episode-finished", "refs": [_ref("d", "env-1"), _ref("e", "env-1")]},
                  {"type": "claim", "holder": "orch", "blob_ids": ["d", "e"]},
                  {"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["d"]}], "env-1", 1, "p1")
    violation = {"type": "violation", "blob_id": "d", "action": "delete", "holder": "orch", "owner": "orch",
                 "detail": "already deleted", "count": 1}
    delete = {"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["e"]}
    restarted = _seq([violation, delete] if violation_first else [delete, violation], "env-1", 1, "p2")
    ledger = _run([_store_up("s1"), *first, {"type": "node-down", "node_id": "env-1", "reason": "replaced"},
                   _store_up("s1"), *restarted])
    account = {"seq": 2, "kept": 2, "deleted": {"filtered": 2}, "held": 0, "violations": {"delete": 1}}
    assert ledger.reconcile("env-1", "p2", account, final=False) == "agreed"
    report = ledger.report()
    assert report.violations == ["env-1 refused delete of d by orch (owner orch): already deleted"]
    assert report.totals()["violations"] == 1


def test_violations_a_store_counted_that_the_stream_missed_count_once_in_ids() -> None:
    """The store refused 50,000 ids and was killed before publishing the event: its counters say so, and the
    ledger adds exactly the difference (named), never the stream's and the store's both."""
    ledger = _run([*STORE_STREAM, _refusal(2, 6)])
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 6, "violations": {"delete": 50_002}},
                            final=True) == "corrected"
    report = ledger.report()
    assert report.totals()["violations"] == 50_002
    assert report.violations[1] == "env-0 counted 50000 violations the stream did not show"
    assert report.reconciled["env-0"].endswith("violations=2, store kept=3 deleted=2 violations=50002")


@pytest.mark.parametrize("count", [0, -1, 2**40, (1 << 20) + 1, "7", 1.0, True, None, [3]], ids=repr)
def test_a_violation_with_a_bad_count_is_refused_logged_and_counted_and_the_fold_goes_on(count: object) -> None:
    """Not an integer from 1 to ``limits.max_items`` (no request can name more ids): refused with a clear error,
    counted by source and unaccounted (the report is not ok); the events after it fold as usual."""
    record = {**_refusal(1, 6), "count": count}
    with capture_logs() as logs:
        ledger = _run([*STORE_STREAM, record, _refusal(3, 7)])
    (refused,) = [entry for entry in logs if entry["event"] == "ledger.violation_refused"]
    assert (refused["src"], refused["seq"], refused["count"]) == ("env-0", 6, repr(count))
    assert "integer from 1 to 1048576 (limits.max_items" in refused["error"]
    report = ledger.report()
    assert report.refused == {"env-0": 1} and report.totals()["refused_events"] == 1
    assert report.totals()["violations"] == 3 and len(report.violations) == 1 and not report.ok
    assert report.unaccounted == ["env-0: 1 violation events refused for their count (not an integer from 1 to "
                                  "1048576): the violations they report are not counted"]
    assert ledger.reconcile("env-0", INCARNATION, {**ACCOUNT, "seq": 7, "violations": {"delete": 3}},
                            final=False) == "agreed"  # the store's counter never held the refused count


def test_the_count_bound_is_the_configured_one(tmp_path: Path) -> None:
    assert _run([]).max_count == Config().limits.max_items
    small = Ledger(max_count=100)
    for record in [*STORE_STREAM, _refusal(100, 6), _refusal(101, 7)]:
        small.apply(record)
    assert (small.report().totals()["violations"], small.report().refused) == (100, {"env-0": 1})
    # `refbus ledger` takes it from the config's limits.max_items.
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(json.dumps(r) for r in [*STORE_STREAM, _refusal(100, 6), _refusal(101, 7),
                                                        _refusal("x", 8), _refusal(5, 9)]) + "\n")
    run = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "ledger", str(events), "--json",
                          "--limits-max-items", "100"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    assert (report["total"]["violations"], report["refused"]) == (105, {"env-0": 2}), report
    assert run.stderr.count("ledger.violation_refused") == 2 and "'x'" in run.stderr, run.stderr


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
    delete = {"type": "delete", "src": "orch", "seq": 1, "blob_ids": ["a"], "holder": "orch", "reason": "trained"}
    records = read_records([json.dumps(delete), "", "not json"])
    assert next(records)["type"] == "delete"
    with pytest.raises(ValueError, match="line 3"):
        next(records)
    with pytest.raises(ValueError, match=r"line 1: not a JSON event record \(a list, not an object\)"):
        next(read_records(["[1, 2]"]))


@pytest.mark.parametrize("record", [
    {"type": "episode-finished", "src": "env-0", "seq": 1},  # no refs
    {"type": "episode-finished", "src": "env-0", "seq": 1, "episode_id": "e", "source": "env-0", "refs": [{}]},
    {"type": "claim", "src": "env-0", "seq": 1, "blob_ids": "abc", "holder": "orch"},  # a string, not ids
    {"type": "reference", "src": "trainer-0", "seq": 1, "blob_ids": ["a"]},  # no holder
    {"type": "delete", "src": "env-0", "seq": 1, "blob_ids": [1, 2], "holder": "orch", "reason": "trained"},
    {"type": "node-up", "src": "bus", "seq": 1, "node": 5},
    {"type": "node-down", "src": "bus", "seq": 1},
    {"type": "violation", "src": "env-0", "seq": 1, "blob_id": "a", "holder": "t"},  # no action, owner, detail
    {"type": "claim", "src": 3, "seq": 1, "blob_ids": ["a"], "holder": "orch"},  # a source that is no name
    {"type": "claim", "src": "env-0", "seq": -1, "blob_ids": ["a"], "holder": "orch"},
    {"type": "claim", "src": "env-0", "seq": "1", "blob_ids": ["a"], "holder": "orch"},
    {"src": "env-0", "seq": 1},  # no type
], ids=lambda record: json.dumps(record)[:60])
def test_a_record_that_does_not_fit_its_kind_names_its_line_where_the_fold_raised(record: dict[str, object]) -> None:
    """Before, such a record reached the fold and raised KeyError or TypeError from inside it (a traceback from
    `refbus ledger FILE`); now the reader checks the fields the fold reads, naming the line."""
    with pytest.raises(ValueError, match=r"^line 2: not an? .*event record"):
        list(read_records(['{"type": "heartbeat", "src": "x"}', json.dumps(record)]))


def test_kinds_the_fold_ignores_and_a_violation_count_pass_the_reader_for_the_fold_to_judge() -> None:
    violation = {"type": "violation", "src": "env-0", "seq": 6, "id": "1-6", "blob_id": "a", "action": "delete",
                 "holder": "trainer-1", "owner": "orch", "detail": "already deleted", "count": 0}
    other = {"type": "episode-progress", "src": "env-0", "seq": 5, "whatever": [1, {"x": None}]}
    assert list(read_records([json.dumps(other), json.dumps(violation)])) == [other, violation]
    ledger = Ledger()
    for record in read_records([json.dumps(violation)]):
        ledger.apply(record)
    assert ledger.report().refused == {"env-0": 1}


def test_a_file_the_ledger_cannot_read_is_a_message_and_exit_2_not_1(tmp_path: Path) -> None:
    """Before, a missing, unreadable or non-JSON file was a traceback with exit 1, the status that says some
    blob is not accounted for."""
    (not_json := tmp_path / "bad.jsonl").write_text("not json\n")
    (not_utf8 := tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    (a_list := tmp_path / "list.jsonl").write_text("[1]\n")
    (no_refs := tmp_path / "no-refs.jsonl").write_text('{"type": "episode-finished", "src": "env-0"}\n')
    for path, says in ((tmp_path / "missing.jsonl", "No such file"), (tmp_path, "Is a directory"),
                       (not_json, "line 1: not a JSON event record"), (not_utf8, "codec can't decode"),
                       (a_list, "not an object"), (no_refs, "line 1: not a episode-finished event record")):
        run = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "ledger", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stdout == "", (path, run)
        assert run.stderr.startswith(f"refbus: cannot read the events file {path}: ") and says in run.stderr, run.stderr


def _branch(tokens: int) -> dict[str, np.ndarray]:
    return random_arrays(tokens, seed=tokens, layers=2, top_k=2, k=3, max_count=2, routing_dtype=np.uint8)


def test_a_store_killed_mid_run_is_named_and_the_live_ledger_exits_1(
    bus: tuple[NodeProcess, str], spawn, tmp_path: Path
) -> None:
    """Two env servers; the orchestrator's part played by this test. env-1 is SIGKILLed holding three blobs
    (two claimed): the live `refbus ledger` reports them lost with env-1, reconciles env-0 with its own
    counters, stops at the launcher's run-end and exits 1."""
    control = bus[1]
    stores = {}
    for name in ("env-0", "env-1"):
        proc = spawn(["node", "env-server", "--bus-control", control, "--node-id", name, *FAST_LIVENESS], name)
        stores[name] = (proc, proc.wait_ready(timeout=WAIT_S * 3)["endpoints"]["blobs"])
    report_path = tmp_path / "ledger.json"
    ledger = spawn_live_ledger(spawn, control, report_path)
    launcher = NodeRuntime("launcher", RuntimeSettings(bus=control, node_id="launcher", metrics_port=-1))
    launcher.start_background()
    ctx = zmq.Context()
    try:
        clients = {name: Client(ctx, endpoint, WireCodec("orch"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))
                   for name, (_, endpoint) in stores.items()}
        kept = {name: [r.blob_id for r in client.request(Keep(episode_id="ep", branches=[_branch(n) for n in sizes]))
                       .body.refs] for (name, client), sizes in zip(clients.items(), ([3, 4], [5, 6, 7]), strict=True)}
        clients["env-0"].request(Claim(blob_ids=kept["env-0"][:1], holder="orch"))
        clients["env-0"].request(Delete(blob_ids=kept["env-0"][:1], holder="orch", reason="filtered"))
        clients["env-1"].request(Claim(blob_ids=kept["env-1"][:2], holder="orch"))

        stores["env-1"][0].proc.kill()
        registry = Client(ctx, control, WireCodec("probe"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1))

        def env_1_gone() -> bool:
            listed = registry.request(Nodes(role="env-server")).body
            assert isinstance(listed, NodeList)
            return "env-1" not in {n.node_id for n in listed.nodes}

        node_timeout_s = float(FAST_LIVENESS[FAST_LIVENESS.index("--bus-node-timeout-s") + 1])
        wait_for(env_1_gone, node_timeout_s * 5, "the broker declared env-1 down")
        launcher.call_soon(lambda: launcher.publish(RunEnd(reason="failed", steps=0)))
        assert ledger.proc.wait(timeout=WAIT_S * 3) == 1, ledger.log_tail()
        for client in (*clients.values(), registry):
            client.close()
    finally:
        launcher.join(timeout=WAIT_S)
        ctx.destroy(linger=0)
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["ended"] is True
    assert report["lost"] == {"env-1": 3} and report["leaked"] == {} and report["held_at_end"] == {}
    assert report["stores"]["env-0"] == {"kept": 2, "deleted": {"filtered": 1}, "held": {"env-0": 1},
                                         "reconciled": "agreed"}
    totals = report["total"]
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (5, 1, 1, 3)
    assert totals["violations"] == totals["unaccounted"] == totals["missed_events"] == 0


def test_a_decoded_event_folds_as_its_monitor_record_does() -> None:
    """The live fold reads only what it needs from each message; the account is the same as from the JSON."""
    codec = WireCodec("env-0")
    ref = BlobRef(endpoint="tcp://x", source="env", blob_id="a", fields=[], tokens=1, nbytes=1, checksum=0)
    bodies = [EpisodeFinished(episode_id="e", source="env", refs=[ref], info={"tokens": np.arange(4)}),
              Claim(blob_ids=["a"], holder="orch"), NodeUp(node=NodeInfo(node_id="orch", role="o", host="h", pid=1)),
              NodeDown(node_id="orch", role="o", reason="timeout", last_seen=0.0), RunEnd(reason="done")]
    messages = [codec.decode(codec.encode(body, seq=seq)) for seq, body in enumerate(bodies, 1)]
    live, recorded = Ledger(), Ledger()
    for message in messages:
        live.apply_message(message)
        recorded.apply(describe(message))
    assert live.report() == recorded.report()
    assert live.report().held_at_end == {"orch": 1} and live.report().leaked == {"orch": 1}


def _store_up(identity: str) -> dict:
    return {"type": "node-up", "node": {"node_id": "env-1", "labels": {"store": identity}}}


READOPTED = [  # env-1 is killed holding d and e; its restarted process re-adopts its durable store
    _store_up("s1"),
    {"type": "episode-finished", "src": "env-1", "id": "p1-1", "seq": 1,
     "refs": [_ref("d", "env-1"), _ref("e", "env-1")]},
    {"type": "claim", "src": "env-1", "id": "p1-2", "seq": 2, "holder": "orch", "blob_ids": ["d", "e"]},
    {"type": "node-down", "node_id": "env-1", "reason": "replaced"},
    _store_up("s1"),
    {"type": "delete", "src": "env-1", "id": "p2-1", "seq": 1, "holder": "orch", "reason": "filtered",
     "blob_ids": ["d"]},
]


def test_a_store_readopted_by_its_restarted_process_loses_nothing_and_its_counters_go_on() -> None:
    ledger = _run(READOPTED)
    report = ledger.report()
    assert report.lost == {} and report.violations == [] and report.held == {"env-1": {"orch": 1}}
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (2, 1, 1, 0)
    # the restarted process counts on from what its store committed: the fold agrees with it
    account = {"seq": 1, "kept": 2, "deleted": {"filtered": 1}, "violations": {}}
    assert ledger.reconcile("env-1", "p2", account, final=False) == "agreed"


def test_claims_a_restarted_store_publishes_again_move_only_what_the_fold_missed() -> None:
    """The killed process answered a claim of f and g and died before their ``claim`` event went out; the
    restarted one publishes the claims of everything re-adopted: f and g move to the orchestrator (so its deletes
    are no violations), h's repeat moves nothing (a trainer rank has it: a blob only moves forward), and ids the
    fold never saw kept (x) or saw deleted (d) change nothing."""
    before = [
        _store_up("s1"),
        {"type": "episode-finished", "src": "env-1", "id": "p1-1", "seq": 1,
         "refs": [_ref(b, "env-1") for b in ("d", "f", "g", "h")]},
        {"type": "claim", "src": "env-1", "id": "p1-2", "seq": 2, "holder": "orch", "blob_ids": ["d", "h"]},
        {"type": "delete", "src": "env-1", "id": "p1-3", "seq": 3, "holder": "orch", "reason": "filtered",
         "blob_ids": ["d"]},
        {"type": "reference", "src": "orch", "holder": "trainer-0", "blob_ids": ["h"]},
        {"type": "node-down", "node_id": "env-1", "reason": "replaced"},
        _store_up("s1"),
    ]
    again = [{"type": "claim", "holder": "orch", "blob_ids": ["f", "g", "d", "x"]},
             {"type": "claim", "holder": "trainer-0", "blob_ids": ["h"]}]
    delete_f = {"type": "delete", "holder": "orch", "reason": "late", "blob_ids": ["f"]}

    def restarted(events: list[dict]) -> list[dict]:
        return [*before, *({**event, "src": "env-1", "id": f"p2-{seq}", "seq": seq}
                           for seq, event in enumerate(events, 1))]

    report = _run(restarted([*again, delete_f])).report()
    assert report.violations == [] and report.held == {"env-1": {"orch": 1, "trainer-0": 1}}, report
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (4, 2, 2, 0)
    # without the claims published again, the orchestrator's delete of f is reported
    assert _run(restarted([delete_f])).report().violations == ["orch deleted f owned by env-1 (late)"]


@pytest.mark.parametrize("first_published", [True, False])
def test_an_episode_a_restarted_store_announces_again_is_kept_once_whether_or_not_its_first_event_came(
        first_published: bool) -> None:
    """The killed process answered the keep of k1 and k2 and may have died before its ``episode-finished`` went
    out; the restarted one publishes it again (``again``), and the orchestrator claims and deletes them. Kept
    once either way, and the fold agrees with the store's counters, which count the keep once (before, a repeat
    counted it twice: the fold disagreed with the store and was corrected from it)."""
    episode = {"type": "episode-finished", "refs": [_ref("k1", "env-1"), _ref("k2", "env-1")]}
    first = [{**episode, "src": "env-1", "id": "p1-1", "seq": 1}] if first_published else []
    after = [{**episode, "again": True},
             {"type": "claim", "holder": "orch", "blob_ids": ["k1", "k2"]},
             {"type": "delete", "holder": "orch", "reason": "late", "blob_ids": ["k1"]}]
    ledger = _run([_store_up("s1"), *first, {"type": "node-down", "node_id": "env-1", "reason": "replaced"},
                   _store_up("s1"), *({**event, "src": "env-1", "id": f"p2-{seq}", "seq": seq}
                                      for seq, event in enumerate(after, 1))])
    report = ledger.report()
    assert report.violations == [] and report.lost == {} and report.held == {"env-1": {"orch": 1}}, report
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"]) == (2, 1, 1)
    account = {"seq": 3, "kept": 2, "deleted": {"late": 1}, "violations": {}}
    assert ledger.reconcile("env-1", "p2", account, final=False) == "agreed"


def test_a_claim_lost_from_the_stream_leaves_its_holder_held_at_run_end_though_the_counters_agree() -> None:
    """env-0's claim of a and b by the orchestrator never arrived (a gap no replay filled) and the orchestrator's
    shutdown delete failed: it still holds them at run end. A claim moves no count, so the store's counters
    agree with the fold, which still shows them as the store's own: the store's view by claimer names the
    holder, and the run is not ok."""
    stream = _seq([{"type": "episode-finished", "refs": [_ref("a"), _ref("b")]},
                   {"type": "claim", "holder": "orch", "blob_ids": ["a", "b"]},
                   {"type": "episode-finished", "refs": [_ref("c")]},
                   {"type": "delete", "holder": "env-0", "reason": "undelivered", "blob_ids": ["c"]}], "env-0")
    account = {"seq": 4, "kept": 3, "deleted": {"undelivered": 1}, "held": 2, "held_by": {"orch": 2},
               "violations": {}}
    run_end = {"type": "run-end", "reason": "done", "steps": 1}
    for lost_claim in (False, True):
        ledger = _run([stream[0], *stream[2 if lost_claim else 1:]])
        assert ledger.reconcile("env-0", INCARNATION, account, final=False) == "agreed"
        ledger.apply(run_end)
        report = ledger.report()
        assert report.missed == ({"env-0": 1} if lost_claim else {})
        assert report.held_at_end == {"orch": 2} and report.held["env-0"] == {"orch": 2} and not report.ok


def _process(incarnation: str, records: list[dict], lost: int = 0) -> list[dict]:
    """One non-durable process of env-0 as the stream shows it: its node-up and ``records`` (seq from 1), but
    for the one with seq ``lost``, lost from the stream."""
    stream = _seq(records, "env-0", 1, incarnation)
    return [{"type": "node-up", "node": {"node_id": "env-0"}}, *(e for e in stream if e["seq"] != lost)]


def _kept(blob_id: str, store: str = "env-0") -> dict:
    return {"type": "episode-finished", "refs": [_ref(blob_id, store)]}


def _dropped(blob_id: str) -> dict:
    return {"type": "delete", "holder": "env-0", "reason": "undelivered", "blob_ids": [blob_id]}


def test_events_missing_are_vouched_for_by_the_counters_of_the_process_that_published_them() -> None:
    """store.durable off: env-0's first process p1 publishes everything it did and is killed holding nothing;
    its restart p2 has one event no replay recovered, and p2's counters, read at the end, correct the fold.
    The gap was p2's, so p1 needs no counters of its own: the run is ok. A gap in p1's stream is another
    matter: p1's counters died with it."""
    down = {"type": "node-down", "node_id": "env-0", "reason": "timeout"}
    p2_account = {"seq": 3, "kept": 2, "deleted": {"undelivered": 1}, "held": 1, "held_by": {"": 1},
                  "violations": {}}
    ledger = _run([*_process("p1", [_kept("a"), _dropped("a")]), down,
                   *_process("p2", [_kept("b"), _kept("c"), _dropped("b")], lost=2)])
    assert ledger.reconcile("env-0", "p2", p2_account, final=False) == "corrected"
    report = ledger.report()
    assert report.missed == {"env-0": 1} and report.unaccounted == [] and report.ok, report

    ledger = _run([*_process("p1", [_kept("a"), _kept("z"), _dropped("a")], lost=2), down,
                   *_process("p2", [_kept("b"), _kept("c"), _dropped("b")])])
    assert ledger.reconcile("env-0", "p2", p2_account, final=False) == "agreed"
    assert ledger.report().unaccounted == ["store env-0: 1 of its events missing from the stream and its counters "
                                           "not read: its figures are a lower bound"]


def test_a_gap_before_a_restart_is_vouched_for_by_the_process_that_readopted_the_store() -> None:
    """With a durable store the restarted process's counters go on from the journal: they cover its earlier
    process's events too, missing ones included."""
    first = _seq([_kept("d", "env-1"), {"type": "claim", "holder": "orch", "blob_ids": ["d"]}, _kept("e", "env-1")],
                 "env-1", 1, "p1")
    ledger = _run([_store_up("s1"), first[0], first[2], {"type": "node-down", "node_id": "env-1", "reason": "killed"},
                   _store_up("s1"), *_seq([_kept("f", "env-1")], "env-1", 1, "p2")])
    assert "store env-1: 1 of its events missing" in ledger.report().unaccounted[0]
    account = {"seq": 1, "kept": 3, "deleted": {}, "held": 3, "held_by": {"": 2, "orch": 1}, "violations": {}}
    assert ledger.reconcile("env-1", "p2", account, final=False) == "agreed"
    report = ledger.report()
    assert report.unaccounted == [] and report.held["env-1"] == {"env-1": 2, "orch": 1}, report


def test_a_fresh_store_under_the_same_node_id_does_not_continue_the_dead_one() -> None:
    report = _run([*READOPTED[:4], _store_up("s2"), {"type": "episode-finished", "src": "env-1", "id": "p2-1",
                                                      "seq": 1, "refs": [_ref("x", "env-1")]}]).report()
    assert report.lost == {"env-1": 2} and report.totals()["kept"] == 3


# The broker publishes a node's node-up once it saw the node's first probe, and the node may publish the moment
# it was answered: the broker's forwarder may relay the node's first events before its node-up, at its first
# start and after a restart. A re-adopted store's account must not depend on that order.
A_UP, A_KEEPS = _store_up("s1"), [
    {"type": "episode-finished", "src": "env-1", "id": "p1-1", "seq": 1,
     "refs": [_ref("d", "env-1"), _ref("e", "env-1"), _ref("f", "env-1")]},
    {"type": "claim", "src": "env-1", "id": "p1-2", "seq": 2, "holder": "orch", "blob_ids": ["d", "e"]},
    {"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["d", "e"]},
]
A_DOWN = {"type": "node-down", "node_id": "env-1", "reason": "timeout"}
B_DELETES = [{"type": "delete", "src": "env-1", "id": "p2-1", "seq": 1, "holder": "trainer-0", "reason": "trained",
              "blob_ids": ["d", "e"]}]
RACES = {
    "in order": [A_UP, *A_KEEPS, A_DOWN, _store_up("s1"), *B_DELETES],
    "restarted store's deletes before its node-up": [A_UP, *A_KEEPS, A_DOWN, *B_DELETES, _store_up("s1")],
    "first events before the first node-up": [*A_KEEPS, A_UP, A_DOWN, _store_up("s1"), *B_DELETES],
    "both": [*A_KEEPS, A_UP, A_DOWN, *B_DELETES, _store_up("s1")],
}


@pytest.mark.parametrize("order", RACES)
def test_a_readopted_store_is_accounted_the_same_whatever_the_order_of_its_node_ups(order: str) -> None:
    ledger = _run([*RACES[order], {"type": "run-end", "reason": "done", "steps": 1}])
    report = ledger.report()
    assert report.held_at_end == {} and report.lost == {} and report.violations == [], report
    assert report.held == {"env-1": {"env-1": 1}} and report.ok  # f: unclaimed, still with its live store
    account = {"seq": 1, "kept": 3, "deleted": {"trained": 2}, "violations": {}}
    assert ledger.reconcile("env-1", "p2", account, final=False) == "agreed"


@pytest.mark.parametrize("fresh_first", [True, False], ids=["node-up first", "deletes first"])
def test_a_fresh_store_whose_events_overtake_its_node_up_does_not_continue_the_dead_one(fresh_first: bool) -> None:
    fresh = [_store_up("s2"), {"type": "episode-finished", "src": "env-1", "id": "p2-1", "seq": 1,
                               "refs": [_ref("x", "env-1")]}]
    report = _run([A_UP, *A_KEEPS, A_DOWN, *(fresh if fresh_first else fresh[::-1])]).report()
    assert report.lost == {"env-1": 3} and report.totals()["kept"] == 4 and report.held == {"env-1": {"env-1": 1}}


def _durable_restart(events: list[dict]) -> list[dict]:
    """env-1's second process p2, re-adopting durable store s1 after p1 (READOPTED's, holding d and e) died."""
    return [{**event, "src": "env-1", "id": f"p2-{seq:x}", "seq": seq} for seq, event in enumerate(events, 1)]


@pytest.mark.parametrize("node_up_first", [True, False], ids=["node-up, then reconcile", "reconcile, then node-up"])
def test_a_readopted_store_reconciled_before_its_node_up_counts_the_earlier_process_once(node_up_first: bool) -> None:
    """The restarted process's first events may come before its node-up, and the launcher may reconcile in that
    window: the store's counters, carried on by its journal, hold the earlier process's counts already. Before,
    the node-up then added them once more (kept 5 where the store kept 3) and named the re-adopted blobs' holder
    '?'; a violation the earlier process showed was counted again as one the stream did not show."""
    ledger = _run([
        *READOPTED[:3],
        {"type": "violation", "src": "env-1", "id": "p1-3", "seq": 3, "blob_id": "d", "action": "claim",
         "holder": "orch-2", "owner": "orch", "detail": "orch-2 claimed it after orch had claimed it"},
        READOPTED[3],
        *_durable_restart([{"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["d"]},
                           {"type": "episode-finished", "refs": [_ref("g", "env-1")]}]),
    ])
    account = {"seq": 2, "kept": 3, "deleted": {"filtered": 1}, "held": 2, "held_by": {"orch": 1, "": 1},
               "violations": {"claim": 1}}
    if node_up_first:
        ledger.apply(_store_up("s1"))
    assert ledger.reconcile("env-1", "p2", account, final=False) == ("agreed" if node_up_first else "corrected")
    if not node_up_first:
        ledger.apply(_store_up("s1"))
    ledger.apply({"type": "run-end", "reason": "done", "steps": 1})
    report = ledger.report()
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (3, 1, 2, 0)
    assert report.held == {"env-1": {"orch": 1, "env-1": 1}} and report.unaccounted == []
    assert report.violated == 1 and len(report.violations) == 1 and report.held_at_end == {"orch": 1}


def test_events_a_forced_reconcile_adopted_before_they_arrived_still_move_blobs_once() -> None:
    """The fold lagged: the store's counters were adopted while its delete of b (seq 6) and a refusal (seq 7)
    were still on their way. Before, both were then refused as repeats: b stayed in the fold, held by the
    orchestrator, and counted missed for ever."""
    late_delete, refusal = _seq([{"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["b"]}],
                                "env-0", 6)[0], _refusal(1, 7)
    ledger = _run(STORE_STREAM)
    account = {**ACCOUNT, "seq": 7, "held": 0, "held_by": {}, "deleted": {"filtered": 2, "undelivered": 1},
               "violations": {"delete": 1}}
    assert ledger.reconcile("env-0", INCARNATION, account, final=True) == "corrected"
    assert ledger.report().missed == {"env-0": 2}
    for record in [late_delete, refusal, late_delete, refusal]:  # each folded once, the repeats ignored
        ledger.apply(record)
    assert "b" not in ledger.blobs
    report = ledger.report()
    assert report.missed == {} and report.totals()["deleted"] == {"filtered": 2, "undelivered": 1}
    assert report.violations == ["env-0 counted 1 violations the stream did not show"] and report.violated == 1
    later = _seq([{"type": "episode-finished", "refs": [_ref("z")]}], "env-0", 8)[0]
    ledger.apply(later)  # after the adopted ones: counted on top
    assert ledger.report().totals()["kept"] == 4 and ledger.report().held["env-0"] == {"env-0": 1}


LATER = {  # env-0's own events after the reconcile, and who holds what at run end
    "a lease expires": ([{"type": "delete", "holder": "env-0", "reason": "undelivered", "blob_ids": ["b"]}], {}),
    "one more claimed": ([{"type": "episode-finished", "refs": [_ref("c")]},
                          {"type": "claim", "holder": "orch", "blob_ids": ["c"]},
                          {"type": "delete", "holder": "env-0", "reason": "undelivered", "blob_ids": ["b"]}],
                         {"orch": 1}),
}


@pytest.mark.parametrize("later", LATER)
def test_a_corrected_stores_own_view_of_its_holders_follows_its_later_events(later: str) -> None:
    """env-0 deleted a for trainer-0 and the event never arrived: the reconcile's view by claimer says trainer-0
    holds nothing. Before, that view stayed as of the reconcile: one more event of the store made its sum differ
    from the store's counters, and the fold's stale view named trainer-0 at run end (not ok); events that kept
    the sum left c, held by the orchestrator, named as the store's own (a leak missed)."""
    stream = _seq([
        {"type": "episode-finished", "refs": [_ref("a"), _ref("b")]},
        {"type": "claim", "holder": "orch", "blob_ids": ["a"]},
    ], "env-0")
    missing_delete = 3  # trainer-0's delete of a: never delivered
    ledger = _run([*stream, {"type": "reference", "src": "trainer-0", "holder": "trainer-0", "blob_ids": ["a"]}])
    assert ledger.reconcile("env-0", INCARNATION, {"seq": missing_delete, "kept": 2, "deleted": {"trained": 1},
                                                   "held": 1, "held_by": {"": 1}, "violations": {}},
                            final=True) == "corrected"
    events, held_at_end = LATER[later]
    for record in _seq(events, "env-0", missing_delete + 1):
        ledger.apply(record)
    ledger.apply({"type": "run-end", "reason": "done", "steps": 1})
    report = ledger.report()
    assert report.held_at_end == held_at_end and report.held == {"env-0": held_at_end}
    assert report.unaccounted == [] and report.missed == {"env-0": 1}


def _relaunched(*, holder_reported_down: bool) -> list[dict]:
    """A relaunch's stream (a fresh ledger): env-1's process p2 re-adopts durable store s1, which an earlier
    launcher's run filled; it announces again its unclaimed episode u and the claims of d and f (by the earlier
    orchestrator ``orch``) and of h (by its rank); the relaunched orchestrator claims u and drops it; the holders of
    d, f and h never take them back, and env-1 reclaims them when their grace ends."""
    down = [{"type": "node-down", "node_id": "trainer-0", "reason": "timeout"}] if holder_reported_down else []
    return [_store_up("s1"), *_durable_restart([
        {"type": "episode-finished", "again": True, "refs": [_ref("u", "env-1")]},
        {"type": "claim", "holder": "orch", "blob_ids": ["d", "f"]},
        {"type": "claim", "holder": "trainer-0", "blob_ids": ["h"]},
        {"type": "claim", "holder": "orch", "blob_ids": ["u"]},
        {"type": "delete", "holder": "orch", "reason": "filtered", "blob_ids": ["u"]},
    ]), *({"type": "node-up", "node": {"node_id": node, "labels": {}}} for node in ("orch", "trainer-0")), *down,
        *({**event, "src": "env-1", "id": f"p2-{seq:x}", "seq": seq} for seq, event in enumerate([
            {"type": "delete", "holder": "env", "node": "orch", "reason": "holder-down", "blob_ids": ["d", "f"]},
            {"type": "delete", "holder": "env", "node": "trainer-0", "reason": "holder-down", "blob_ids": ["h"]},
        ], 6)), {"type": "run-end", "reason": "done", "steps": 1}]


def test_blobs_a_relaunched_store_kept_before_the_stream_reclaimed_from_holders_dead_before_it_are_no_loss() -> None:
    """The re-announced claims name blobs the fold never saw kept, from a store process whose every event it
    folded and no earlier process of which it knows: kept before the stream. Reclaimed from holders the stream
    never showed down, they are deleted ``holder-down-before``, named by holder, and the run is ok; the store's
    counters, which carry on the earlier launcher's, are the authority. Before, the fold never placed them and
    reported them lost by '?', unaccounted: every relaunch after a kill said NOT ok."""
    ledger = _run(_relaunched(holder_reported_down=False))
    history = {"seq": 7, "kept": 50, "deleted": {"trained": 40, "filtered": 7, "holder-down": 3}, "violations": {}}
    assert ledger.reconcile("env-1", "p2", history, final=False) == "corrected"
    report = ledger.report()
    assert report.ok and report.lost == {} and report.unaccounted == [] and report.violations == [], report
    assert report.inherited == {"orch": 2, "trainer-0": 1}
    assert report.deleted["env-1"] == {"trained": 40, "filtered": 7, "holder-down-before": 3}
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["lost"]) == (50, 50, 0, 0)
    assert "inherited: 2 kept before the stream, reclaimed from orch (dead before it)" in format_report(report)


def test_a_kept_before_blob_reclaimed_from_a_holder_reported_down_in_the_stream_is_still_a_loss() -> None:
    """h's rank was reported down in this stream: whichever process held h, its death is the run's, and the
    reclaim is a loss named with it (d and f stay inherited). A partial stream (its first events missing) or a
    store the fold saw before proves nothing: their unplaced claims wait as before, and a reclaim is '?'."""
    report = _run(_relaunched(holder_reported_down=True)).report()
    assert report.lost == {"trainer-0": 1} and report.inherited == {"orch": 2} and not report.ok
    partial = [r for r in _relaunched(holder_reported_down=False) if r.get("seq") != 1]
    report = _run(partial).report()
    assert report.lost == {"?": 3} and report.inherited == {} and not report.ok
    # The fold saw env-1's first process (merged into p2 by p2's first event): x was not kept before the stream.
    seen_first = [*READOPTED[:4], _store_up("s1"), *_durable_restart([
        {"type": "episode-finished", "again": True, "refs": [_ref("d", "env-1")]},
        {"type": "claim", "holder": "orch", "blob_ids": ["x"]},
        {"type": "delete", "holder": "env", "node": "orch", "reason": "holder-down", "blob_ids": ["x"]}])]
    report = _run(seen_first).report()
    assert report.lost == {"?": 1} and report.inherited == {}


# --- the account does not depend on how the broker interleaves sources -------------------------------------------

ORCH, RANKS, WATCHER = "orch", ("trainer-0", "trainer-1"), "up"
ENV_STORES = ("env-0", "env-1")


@dataclass
class _Published:
    """One run's events by source, each list in its publisher's order, with the process (0, 1, ...: a restart)
    that published each; ``order``: (source, index) of every event in the order they were published; ``ended``: how
    many of each source's come before the launcher's ``run-end`` (nodes/up.py's ``_account``: holders stopped,
    stores' counters read, then ``run-end``, then the stores stop: their ``shutdown`` deletes and node-downs come
    after it); ``lost``: by holder, the blobs stores reclaimed from it when it died."""

    events: dict[str, list[tuple[int, Body]]] = field(default_factory=lambda: defaultdict(list))
    order: list[tuple[str, int]] = field(default_factory=list)
    process: Counter[str] = field(default_factory=Counter)  # node -> its current process
    ended: dict[str, int] = field(default_factory=dict)
    lost: Counter[str] = field(default_factory=Counter)

    def publish(self, src: str, body: Body) -> None:
        self.order.append((src, len(self.events[src])))
        self.events[src].append((self.process[src], body))


def _blob_ref(blob_id: str, store: str, source: str) -> BlobRef:
    return BlobRef(endpoint="tcp://198.18.0.1:5555", source=source, blob_id=blob_id, fields=[], tokens=1, nbytes=1,
                   checksum=0, node=store)


def _published_run(rng: random.Random) -> _Published:
    """A run's events as its nodes publish them, its concurrent parts (episodes, step batches, a store's restart, a
    rank's death) advanced in a random order. A store publishes an episode's ``episode-finished``, then (on the
    orchestrator's requests) its ``claim`` by the orchestrator or its ``discarded`` delete, the deletes of what the
    orchestrator filters and of what the ranks train, and its own deletes (``undelivered`` when a lease ends,
    ``holder-down`` when a holder dies, ``shutdown`` at its close). A rank publishes its ``reference`` before it
    answers the step batch (the orchestrator repeats it once answered), then its ``fetch-ack``, then asks the stores
    to delete. The broker publishes node-ups, its watcher's first, and node-downs: the holders' before the
    ``run-end``, or after it, the stores' after it."""
    run, ids = _Published(), itertools.count()
    source = dict.fromkeys(ENV_STORES, "env") if rng.random() < 0.5 else {s: s for s in ENV_STORES}
    pool: list[tuple[str, str]] = []  # (store, blob id) the orchestrator claimed and holds
    left: dict[str, list[str]] = defaultdict(list)  # store -> unclaimed blob ids its close deletes
    episodes_running = [0]
    steps = dict.fromkeys(RANKS, 0)
    # store -> episode -> blob id -> its holder as the store knows it ("": unclaimed), while it lives
    live: dict[str, dict[str, dict[str, str]]] = {s: {} for s in ENV_STORES}
    handed: dict[str, tuple[str, int]] = {}  # blob id -> (rank, step) while the rank holds it

    def publish(store: str, body: Body) -> None:
        """``store`` publishes ``body``: its view of who holds what follows."""
        run.publish(store, body)
        for blobs in live[store].values():
            for blob_id in set(blobs) & set(getattr(body, "blob_ids", ())):
                if isinstance(body, Delete):
                    del blobs[blob_id]
                    handed.pop(blob_id, None)
                else:
                    blobs[blob_id] = body.holder

    def later(src: str, body: Body) -> Iterator[None]:
        run.publish(src, body)
        yield

    def episode(store: str) -> Iterator[None]:
        blob_ids = [f"{store}-{next(ids)}" for _ in range(rng.randint(1, 3))]
        live[store][blob_ids[0]] = dict.fromkeys(blob_ids, "")
        publish(store, EpisodeFinished(episode_id=blob_ids[0], source=source[store],
                                       refs=[_blob_ref(b, store, source[store]) for b in blob_ids]))
        yield
        if rng.random() < 0.1:
            publish(store, Delete(blob_ids=blob_ids, holder=source[store], reason="discarded"))
        else:
            claimed = blob_ids[:rng.randint(0, len(blob_ids))] if rng.random() < 0.3 else blob_ids
            if claimed:
                publish(store, Claim(blob_ids=claimed, holder=ORCH))
                pool.extend((store, blob_id) for blob_id in claimed)
            if unclaimed := blob_ids[len(claimed):]:
                yield
                if rng.random() < 0.5:
                    publish(store, Delete(blob_ids=unclaimed, holder=source[store], reason="undelivered"))
                else:
                    left[store] += unclaimed
        episodes_running[0] -= 1

    def restart(store: str) -> Iterator[None]:
        """``store`` is killed and restarted: its new process re-adopts its durable store, publishes the claims of
        what a holder has again and the episodes nobody claimed again; the holders repeat their hand-overs there
        (env_server.py's module docstring; the orchestrator's and the rank's ``_hand_over_again``)."""
        for _ in range(rng.randint(1, 60)):
            yield
        run.process[store] += 1
        run.publish("bus", NodeDown(node_id=store, role=STORE_ROLE, reason="timeout", last_seen=0.0))
        run.publish("bus", NodeUp(node=NodeInfo(node_id=store, role=STORE_ROLE, host="h", pid=2, labels=labels[store])))
        episodes = [blobs for blobs in live[store].values() if blobs]
        by_holder: dict[str, list[str]] = defaultdict(list)
        for blobs in episodes:
            for blob_id, holder in blobs.items():
                if holder:  # a hand-over its earlier process had not heard of yet is the orchestrator's
                    by_holder[holder if rng.random() < 0.8 else ORCH].append(blob_id)
        for holder, blob_ids in by_holder.items():
            run.publish(store, Claim(blob_ids=blob_ids, holder=holder))
        for blobs in episodes:
            if not any(blobs.values()):
                run.publish(store, EpisodeFinished(episode_id=next(iter(blobs)), source=source[store], again=True,
                                                   refs=[_blob_ref(b, store, source[store]) for b in blobs]))
        again: dict[tuple[str, int], list[str]] = defaultdict(list)
        for blobs in episodes:
            for blob_id in set(blobs) & set(handed):
                again[handed[blob_id]].append(blob_id)
        for (rank, step), blob_ids in again.items():
            tasks.append(later(rank, Reference(step=step, holder=rank, blob_ids=blob_ids)))
            tasks.append(later(ORCH, Reference(step=step, holder=rank, blob_ids=blob_ids)))

    def by_store(blobs: list[tuple[str, str]]) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = defaultdict(list)
        for store, blob_id in blobs:
            grouped[store].append(blob_id)
        return grouped

    def step_batch(rank: str, step: int, blobs: list[tuple[str, str]]) -> Iterator[None]:
        """``rank`` takes a step batch, trains and deletes it, unless its process dies meanwhile."""
        owned, process = [blob_id for _, blob_id in blobs], run.process[rank]
        run.publish(rank, Reference(step=step, holder=rank, blob_ids=owned))
        handed.update(dict.fromkeys(owned, (rank, step)))
        for store, blob_id in blobs:  # the stores hear of it: the blobs are the rank's there
            for episode_blobs in live[store].values():
                if blob_id in episode_blobs:
                    episode_blobs[blob_id] = rank
        run.publish(ORCH, Reference(step=step, holder=rank, blob_ids=owned))
        yield
        if run.process[rank] != process:
            return
        run.publish(rank, FetchAck(step=step, holder=rank, blob_ids=owned))
        for store, at in by_store(blobs).items():
            yield
            if run.process[rank] != process:
                return
            publish(store, Delete(blob_ids=at, holder=rank, reason=rng.choice(["trained", "dropped"])))

    def rank_dies(rank: str) -> Iterator[None]:
        """``rank`` is killed holding what it took; its new process registers under its id (it claims nothing back),
        and each store reclaims at once what it knew the rank held (holder-down, ``node`` the rank: env_server.py's
        ``blobs.holder_replaced``)."""
        for _ in range(rng.randint(1, 60)):
            yield
        run.process[rank] += 1
        run.publish("bus", NodeDown(node_id=rank, role="trainer", reason="timeout", last_seen=0.0))
        run.publish("bus", NodeUp(node=NodeInfo(node_id=rank, role="trainer", host="h", pid=3,
                                                labels={CLAIMS_BACK: "0"})))
        for store in ENV_STORES:
            if held := [b for blobs in live[store].values() for b, holder in blobs.items() if holder == rank]:
                publish(store, Delete(blob_ids=held, holder=source[store], reason="holder-down", node=rank))
                run.lost[rank] += len(held)

    def orchestrate() -> Iterator[None]:
        while episodes_running[0] or pool:
            if pool:
                rng.shuffle(pool)
                taken = pool[:rng.randint(1, 4)]
                del pool[:len(taken)]
                if rng.random() < 0.2:
                    for store, at in by_store(taken).items():
                        publish(store, Delete(blob_ids=at, holder=ORCH, reason="filtered"))
                else:
                    rank = rng.choice(RANKS)
                    steps[rank] += 1
                    tasks.append(step_batch(rank, steps[rank], taken))
            yield

    labels = {s: {"source": source[s], "store": f"durable-{s}"} for s in ENV_STORES}
    nodes = [(ORCH, "orchestrator", {}), *((r, "trainer", {}) for r in RANKS),
             *((s, STORE_ROLE, labels[s]) for s in ENV_STORES)]
    for node_id, role, its_labels in [(WATCHER, "launcher", {}), *rng.sample(nodes, len(nodes))]:
        run.publish("bus", NodeUp(node=NodeInfo(node_id=node_id, role=role, host="h", pid=1, labels=its_labels)))
    count = rng.randint(4, 12)
    episodes_running[0] = count
    tasks: list[Iterator[None]] = [orchestrate(), *(episode(rng.choice(ENV_STORES)) for _ in range(count)),
                                   *(restart(store) for store in ENV_STORES if rng.random() < 0.25),
                                   *(rank_dies(rank) for rank in RANKS if rng.random() < 0.4)]
    while tasks:
        task = rng.choice(tasks)
        if next(task, StopIteration) is StopIteration:
            tasks.remove(task)
    holders = [ORCH, *RANKS]
    for node_id in rng.sample(holders, len(holders)):
        role = "orchestrator" if node_id == ORCH else "trainer"
        run.publish("bus", NodeDown(node_id=node_id, role=role, reason="bye", last_seen=0.0))
    run.ended = {src: len(events) for src, events in run.events.items()}
    run.ended["bus"] -= rng.randint(0, len(holders))  # the broker's node-down of a holder may follow the run-end
    run.publish(WATCHER, RunEnd(reason="done", steps=max(steps.values())))
    for store in ENV_STORES:
        if left[store]:
            publish(store, Delete(blob_ids=left[store], holder=source[store], reason="shutdown"))
        run.publish("bus", NodeDown(node_id=store, role=STORE_ROLE, reason="bye", last_seen=0.0))
    return run


def _as_messages(run: _Published) -> dict[str, list[Message]]:
    """Each source's events as its processes send them: each process's seq from 1, its ids of one incarnation."""
    messages: dict[str, list[Message]] = defaultdict(list)
    seqs: Counter[tuple[str, int]] = Counter()
    for src, events in run.events.items():
        for process, body in events:
            seq = seqs[src, process] = seqs[src, process] + 1
            header = Header(PROTOCOL_VERSION, f"{process + 1:012x}-{seq:x}", src, seq, 0.0)
            messages[src].append(Message(body.kind, header, body))
    return messages


def _relayed(rng: random.Random, streams: dict[str, list[Message]]) -> list[Message]:
    """One order the broker may relay ``streams`` in: each source's in its own order, sources mixed at random,
    some much slower than others (their events come after the rest, as after a broker restart)."""
    queues = {src: deque(stream) for src, stream in streams.items() if stream}
    pace = {src: rng.random() ** 3 + 1e-3 for src in queues}
    relayed = []
    while queues:
        src = rng.choices(list(queues), [pace[s] for s in queues])[0]
        for _ in range(rng.randint(1, 3)):
            relayed.append(queues[src].popleft())
            if not queues[src]:
                del queues[src]
                break
    return relayed


def _replayed(rng: random.Random, relayed: list[Message]) -> list[Message]:
    """``relayed`` with some events delivered again later, before their source's next process publishes (a
    subscriber keeps each incarnation's sequence: a dead process's event never comes after its successor's)."""
    out = list(relayed)
    for _ in range(rng.randint(0, 3)):
        first = rng.randrange(len(out))
        src, process = out[first].header.src, incarnation(out[first].header.id)
        until = next((i for i in range(first + 1, len(out)) if out[i].header.src == src
                      and incarnation(out[i].header.id) != process), len(out))
        out.insert(rng.randint(first + 1, until), out[first])
    return out


def _one_order(rng: random.Random, messages: dict[str, list[Message]], run: _Published, *, run_end: bool,
               late_by: int) -> list[Message]:
    """``messages`` in one relay order, the broker's first ``late_by`` events unseen (a watcher that joined late);
    with ``run_end``, the events before the launcher's ``run-end`` all come before it (it waited for them)."""
    streams = {src: ms[late_by:] if src == "bus" else ms for src, ms in messages.items() if src != WATCHER}
    if not run_end:
        return _replayed(rng, _relayed(rng, streams))
    before = {src: ms[:max(0, run.ended.get(src, 0) - (late_by if src == "bus" else 0))] for src, ms in streams.items()}
    after = {src: ms[len(before[src]):] for src, ms in streams.items()}
    return _replayed(rng, [*_relayed(rng, before), *messages[WATCHER], *_relayed(rng, after)])


def _published_order(messages: dict[str, list[Message]], run: _Published, *, run_end: bool,
                     late_by: int) -> list[Message]:
    """``messages`` in the order they were published (no relay reordered them), as :func:`_one_order` leaves
    them out: the broker's first ``late_by``, and the ``run-end`` unless ``run_end``."""
    dropped = {("bus", index) for index in range(late_by)} | (set() if run_end else {(WATCHER, 0)})
    return [messages[src][index] for src, index in run.order if (src, index) not in dropped]


def _fold(events: Iterable[Any], fold: Callable[[Ledger, Any], None]) -> Ledger:
    ledger = Ledger()
    for event in events:
        fold(ledger, event)
    return ledger


def test_the_account_does_not_depend_on_how_the_broker_interleaves_sources() -> None:
    """Realistic runs (stores restarted, ranks killed), each source's events in its publisher's order, relayed in
    many cross-source orders, with replays and a watcher that missed the broker's first events: the report is the
    one of the order they were published in. Every blob kept is deleted once by its owner or lost with the rank
    whose death lost it, nothing held or unaccounted; ok but for those losses. A file of the records and the live
    fold of the decoded messages give the same report."""
    for seed in range(300):
        rng = random.Random(seed)
        run = _published_run(rng)
        messages = _as_messages(run)
        run_end = rng.random() < 0.5
        # A watcher that joined once the nodes had registered, before they published: it missed their node-ups.
        late_by = rng.choice([0, 0, 1, rng.randint(1, len((WATCHER, ORCH, *RANKS, *ENV_STORES)))])
        order = _one_order(rng, messages, run, run_end=run_end, late_by=late_by)
        records = [describe(message) for message in order]
        report = _fold(records, Ledger.apply).report()
        totals = report.totals()
        trace = [(r["src"], r["seq"], r["type"], r.get("holder", ""), r.get("blob_ids", "")) for r in records]
        published = _fold(_published_order(messages, run, run_end=run_end, late_by=late_by), Ledger.apply_message)
        assert report == published.report(), (seed, report.as_dict(), published.report().as_dict(), trace)
        assert report.violations == [] and report.lost == run.lost, (seed, report.as_dict(), trace)
        assert totals["kept"] == totals["deleted_total"] + totals["lost"] > 0, (seed, totals, trace)
        assert totals["held"] == 0 and report.held_at_end == {} and report.ended == run_end, (seed, totals, trace)
        assert report.missed == ({"bus": late_by} if late_by else {}), (seed, report.as_dict(), trace)
        # With the broker's events missing, the report cannot vouch for who lost what, and says so.
        misnamed = [f"bus: {late_by} events missing from the stream: who holds or lost the {totals['lost']} blobs not "
                    "deleted may be misnamed"] if late_by and run.lost else []
        assert report.unaccounted == misnamed and report.ok == (not run.lost), (seed, report.as_dict(), trace)
        if seed % 10 == 0:
            lines = [json.dumps(record) for record in records]
            assert _fold(read_records(lines), Ledger.apply).report() == report
            assert _fold(order, Ledger.apply_message).report() == report
