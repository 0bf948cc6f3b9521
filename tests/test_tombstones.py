"""The ledger's deleted ids: exact forever in runs of a keeper's id counters, named for recent deletes only."""

from __future__ import annotations

import numpy as np
import pytest
from refbus.nodes.ledger import Ledger
from refbus.nodes.tombstones import FORGOTTEN, CounterRuns, Tombstones
from refbus.protocol.envelope import MessageIds


def test_counter_runs_are_the_set_they_were_given_as_maximal_runs() -> None:
    rng = np.random.default_rng(0)
    values = [int(v) for v in rng.permutation(200)[:150]]
    runs, seen = CounterRuns(), set()
    for value in values:
        assert runs.add(value) == (value not in seen)
        assert runs.add(value) is False  # a repeat changes nothing
        seen.add(value)
    assert all((v in runs) == (v in seen) for v in range(-2, 205))
    starts = [v for v in seen if v - 1 not in seen]
    assert len(runs) == len(starts)  # no two runs touch: every join merged
    for value in range(200):
        runs.add(value)
    assert len(runs) == 1 and 199 in runs and 200 not in runs


def test_ids_deleted_in_keep_order_cost_one_run_however_many() -> None:
    ids = MessageIds()
    kept = [ids.next() for _ in range(10_000)]
    tombs = Tombstones(recent=2)
    for index, blob_id in enumerate(kept):
        if index % 100 != 7:  # every hundredth blob still live: one gap each
            tombs.add(blob_id, "trainer-0", "trained")
    assert tombs.count == 9_900 and tombs.runs() == 101
    for blob_id in kept[7::100]:
        tombs.add(blob_id, "orchestrator", "filtered")
    assert tombs.runs() == 1 and tombs.count == 10_000
    assert tombs.get(kept[0]) == (FORGOTTEN, FORGOTTEN)  # deleted long ago: known, no longer named
    assert tombs.get(kept[-93]) == ("orchestrator", "filtered")  # the last delete: named
    assert tombs.get(ids.next()) is None  # never deleted


def test_other_shapes_of_id_are_kept_as_they_are_and_never_meet_a_counter() -> None:
    tombs = Tombstones(recent=0, always_named=frozenset({"lost"}))
    for blob_id in ("abc-1f", "plain", "abc-01f", "abc-1F", "abc-+1f", "abc-1_f", "-1f", "abc-", "abc-1f "):
        tombs.add(blob_id, "h", "trained")
    assert tombs.count == 9 and tombs.get("abc-1f") == (FORGOTTEN, FORGOTTEN)
    assert tombs.get("abc-1e") is None and tombs.get("abc-0x1f") is None
    tombs.add("abc-20", "orchestrator", "lost")
    assert tombs.get("abc-20") == ("orchestrator", "lost")  # a loss is always named
    with pytest.raises(ValueError):
        Tombstones(recent=-1)


def test_the_ledger_tells_a_second_delete_long_after_the_first() -> None:
    ids = MessageIds()
    ledger = Ledger(recent_tombstones=4)
    kept = [ids.next() for _ in range(50)]
    ledger.apply({"type": "episode-finished", "src": "env-0", "refs": [{"blob_id": b} for b in kept]})
    for blob_id in kept:
        ledger.apply({"type": "delete", "src": "env-0", "holder": "env-0", "reason": "undelivered",
                      "blob_ids": [blob_id]})
    ledger.apply({"type": "delete", "src": "env-0", "holder": "orch", "reason": "filtered", "blob_ids": [kept[0]]})
    ledger.apply({"type": "delete", "src": "env-0", "holder": "orch", "reason": "filtered", "blob_ids": [kept[-1]]})
    assert ledger.report().violations == [f"orch deleted {kept[0]} again (first deleted long before)",
                                          f"orch deleted {kept[-1]} again (first deleted by env-0)"]
    assert ledger.tombstones.runs() == 1
