"""The parameter server's lineage rule, in-process: a trainer world resumed from its checkpoint of step K pushes
K, K+1, ... after the dead world committed versions above K; the old versions >= K are retired (a reader's
lease on one runs out normally and frees exactly that version's shards), the new ones commit without a
conflict, and a push that does not declare it resumes is still refused."""

from __future__ import annotations

import pytest
from refbus.nodes.ps.manifest import ManifestError
from refbus.nodes.ps.versions import VersionStore
from refbus.protocol.messages_ps import TensorSpec, WorkerInfo

WORKERS = [WorkerInfo("w0", "tcp://x", "h", "/dev/shm")]
SPECS = [TensorSpec("a", "float32", [2]), TensorSpec("b", "int8", [3])]


def _push(store: VersionStore, version: int, lineage: str, *, resumes: bool = False) -> None:
    """Both ranks of a world of two push and commit ``version`` (leases named after the lineage); a resuming
    push after :meth:`VersionStore.start_lineage`, as the manager calls it for the first rank."""
    for rank in (0, 1):
        assert store.joins_lineage(version, 2) == (resumes and rank == 1)
        layout = store.begin(version, rank, 2, SPECS[rank:rank + 1], ["w0"], f"{lineage}{version}.{rank}", now=0.0,
                             resumes=resumes)
        store.commit_shard(version, rank, f"{lineage}{version}.{rank}", "w0", f"s{rank}", layout, WORKERS)
    assert store.latest == version


def _shards(lineage: str, version: int) -> list[tuple[str, str]]:
    return [("w0", f"{lineage}{version}.0"), ("w0", f"{lineage}{version}.1")]


def test_a_resumed_world_starts_a_new_lineage_and_readers_of_the_old_one_free_exactly_their_version() -> None:
    store = VersionStore(retain=3)
    for version in range(5):
        _push(store, version, "old")
    store.pin(3, "R3")
    store.pin(4, "R4")
    with pytest.raises(ManifestError) as err:  # without declaring it resumes, K is a conflict as before
        store.begin(2, 0, 2, SPECS[:1], ["w0"], "x", now=0.0)
    assert err.value.code == "version-conflict"

    freed = store.start_lineage(2)
    assert freed == _shards("old", 2)  # unread: freed at once; 3 and 4 are read: freed when their readers go
    assert store.retained() == [] and store.latest == -1 and store.pinned() == {3: 1, 4: 1}
    with pytest.raises(ManifestError, match="not retained"):
        store.pin(3)  # a retired lineage takes no new reader

    _push(store, 2, "new", resumes=True)  # the second rank joins the lineage the first one started
    _push(store, 3, "new")
    assert store.retained() == [2, 3] and store.manifest().version == 3 and store.lineages == 1
    store.pin(3, "N3")
    assert store.pinned() == {3: 2, 4: 1}
    assert store.unpin(3, "R3") == _shards("old", 3)  # the old lineage's version 3, not the new one
    assert store.unpin(4, "R4") == _shards("old", 4)
    assert store.pinned() == {3: 1} and store.held_bytes() == 2 * (8 + 3)
    _push(store, 4, "new")
    _push(store, 5, "new")
    assert store.retained() == [3, 4, 5]
    assert store.unpin(3, "N3") == []  # still retained: kept
    _push(store, 6, "new")
    assert store.retained() == [4, 5, 6]  # 3 retired unread (its reader went), 2 before it


def test_a_resumed_push_never_joins_an_old_worlds_pending_push() -> None:
    store = VersionStore(retain=2)
    for version in range(3):
        _push(store, version, "old")
    store.begin(3, 0, 2, SPECS[:1], ["w0"], "old3.0", now=0.0)  # the old world died while pushing 3
    assert not store.joins_lineage(3, 2)  # not a resuming push: the caller aborts it first
    assert store.abort(3) == [("w0", "old3.0")]
    assert store.start_lineage(1) == _shards("old", 1) + _shards("old", 2)
    _push(store, 1, "new", resumes=True)
    assert store.latest == 1 and store.retained() == [1]
    with pytest.raises(AssertionError):
        store.begin(2, 0, 2, SPECS[:1], ["w0"], "new2.0", now=0.0)
        store.start_lineage(2)  # a pending push must be aborted before a lineage starts


def test_a_resuming_push_joins_the_pending_version_of_its_own_world_only() -> None:
    """A resuming push joins the new lineage another rank began, unless both name a world token and the tokens
    differ: a dead world's attempt at the same version (still leased) is no part of a new world's."""
    store = VersionStore(retain=2)
    store.start_lineage(0)
    store.begin(0, 0, 2, SPECS[:1], ["w0"], "a0.0", now=0.0, resumes=True, world_token="world-a")
    assert store.joins_lineage(0, 2, "world-a") and store.joins_lineage(0, 2)  # naming none: as before tokens
    assert not store.joins_lineage(0, 2, "world-b")
    assert store.of_world(0, 0, "world-a") and not store.of_world(0, 0, "world-b") and not store.of_world(0, 0, "")
