"""The durable store alone, an env server's keeper and a ps-worker's shards on it: commit, abort,
re-adoption with verified checksums, the lock, gc (and `refbus shm gc`), capacity, format versions,
garbage, and a process killed between a record's bytes and its commit flag or in the middle of a compaction."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from branches import random_arrays
from pool_support import acquire
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.stall import PassStalls
from refbus.nodes.ledger import Ledger
from refbus.nodes.payload.blob_journal import MIN_RESUMED_GRACE_SHARE, BlobJournal, resumed_grace
from refbus.nodes.payload.charges import info_charge
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.keeper import LOST, DeleteResult, Keeper, KeepError, pack_branches
from refbus.nodes.ps.shard_journal import ShardJournal
from refbus.nodes.ps.shm import SegmentPool
from refbus.nodes.settings import EnvServerSettings, StoreSettings
from refbus.nodes.store import journal
from refbus.nodes.store.durable import (
    DEFAULT_MAX_MAP_COUNT,
    MAP_HEADROOM,
    DurableStore,
    Segment,
    StoreError,
    StoreLocked,
    gc,
    segment_limit,
    store_path,
)
from refbus.protocol.codec import checksum
from refbus.protocol.envelope import PROTOCOL_VERSION, Header, Message
from refbus.protocol.messages import Claim, EpisodeFinished, NodeDown, NodeInfo, Reference
from refbus.protocol.messages_ps import ShardTensor
from structlog.testing import capture_logs

BUDGET = 1 << 20
GRACE_S = 5.0
WALL = 1_700_000_000.0  # where a test's wall clock starts (seconds since the epoch)


class _Clock:
    """A clock a test sets: the keeper's (monotonic) or a journal's wall clock."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def open_store(directory: Path, *, budget: int = BUDGET, node: str = "env-0") -> DurableStore:
    return DurableStore(directory, "run-a", node, budget_bytes=budget, what="env_server.budget_bytes")


def keeper(budget: int = BUDGET, max_blobs: int | None = None) -> Keeper:
    return Keeper("env", "tcp://127.0.0.1:9", budget_bytes=budget, handover_lease_s=60.0, node="env-0",
                  max_blobs=max_blobs)


def keep(journal_: BlobJournal, keeper_: Keeper, episode_id: str, seeds: tuple[int, ...]) -> list[str]:
    """What the env server does for a keep: bytes to segments, the keeper, then one commit."""
    packed = journal_.write(pack_branches([random_arrays(5 + s, seed=s) for s in seeds]))
    info = {"reward": np.float32(0.5)}
    refs = keeper_.store(episode_id, packed, info_charge(info))
    record = EpisodeFinished(episode_id=episode_id, source="env", refs=refs, info=info)
    keeper_.record(record)
    journal_.kept(record, packed, info_charge(info))
    return [ref.blob_id for ref in refs]


def dropped(journal_: BlobJournal, result: DeleteResult) -> None:
    """What the env server does for a delete the keeper made: commit it, then release its segments."""
    journal_.dropped(result)
    journal_.released(result)


def restart(directory: Path, dead: BlobJournal | None, *, budget: int = BUDGET,
            max_blobs: int | None = None) -> tuple[Keeper, BlobJournal]:
    """A new process's keeper on the store ``dead`` served (its lock let go as a dying process's is, nothing
    else done)."""
    if dead is not None:
        dead.store.close(remove=False)
    restarted = keeper(budget, max_blobs)
    durable = BlobJournal(open_store(directory, budget=budget))
    durable.readoption = durable.readopt(restarted)  # type: ignore[attr-defined]
    return restarted, durable


def test_commit_then_reopen_replays_records_and_verified_segments(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert store.fresh
    segment = store.write(np.arange(100, dtype=np.int64))
    store.commit({"op": "x", "segment": segment.name})
    store.close(remove=False)

    again = open_store(tmp_path)
    assert not again.fresh and again.identity == store.identity
    assert again.replay.records == [{"op": "x", "segment": segment.name}]
    found = again.segment(segment.name)
    assert not isinstance(found, str)
    assert np.array_equal(found.data.view(np.int64), np.arange(100))
    again.close(remove=True)
    assert not store.path.exists()


def test_keeper_state_survives_a_restart_exactly(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    a = keep(durable, first, "ep-a", (1, 2))
    b = keep(durable, first, "ep-b", (3,))
    c = keep(durable, first, "ep-c", (4,))
    claim = first.claim([*a, *b, *c], "orchestrator")
    durable.claimed(claim.claimed, "orchestrator")
    durable.moved(first.hand_over(b, "trainer-0").moved, "trainer-0")
    deleted = first.delete(c, "orchestrator", "consumed")
    dropped(durable, deleted)
    again = first.delete(c, "orchestrator", "consumed")  # a second delete in one process: a violation
    durable.violated(again.violations)
    before = first.stats()
    held = {blob_id: {k: v.copy() for k, v in first.fetch([blob_id], "x").arrays[blob_id].items()} for blob_id in a + b}

    second, restarted = restart(tmp_path, durable)  # the first process "died": its store was never closed
    assert second.stats() == before
    assert restarted.readoption.blobs == 3 and not restarted.readoption.lost  # type: ignore[attr-defined]
    for blob_id, fields in held.items():
        for name, array in second.fetch([blob_id], "x").arrays[blob_id].items():
            assert np.array_equal(array, fields[name])
    # Retries across the restart are answered from what was committed, never refused:
    assert second.claim(a, "orchestrator").already == tuple(a)
    repeat = second.delete(c, "orchestrator", "consumed")
    assert repeat.repeated == tuple(c) and not repeat.violations and not repeat.deleted
    assert second.delete(c, "trainer-0", "consumed").violations  # by another holder it still is one
    records = [h.record.episode_id for h in second.holdings("orchestrator")]
    assert records == ["ep-a"]
    assert [h.record.info for h in second.holdings("trainer-0")] == [{"reward": 0.5}]


def test_a_keep_cut_before_its_commit_flag_is_aborted(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    kept = keep(durable, first, "ep-a", (1,))

    def crash() -> None:
        raise KeyboardInterrupt  # stands for the process dying here; the SIGKILL test below kills it for real

    durable.store.before_flag = crash
    with pytest.raises(KeyboardInterrupt):
        keep(durable, first, "ep-b", (2, 3))
    second, restarted = restart(tmp_path, durable)
    assert restarted.readoption.aborted == 2  # type: ignore[attr-defined]
    assert [b for b, *_ in second.blobs()] == kept
    assert second.kept_total == 1
    assert restarted.store.replay.uncommitted is not None and restarted.store.replay.uncommitted["ep"] == "ep-b"
    assert [p.name for p in restarted.store.path.glob("seg-*")] == [p.segment for *_, p in second.blobs()]


def test_a_blob_failing_its_checksum_is_lost_and_named_never_served(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    good = keep(durable, first, "ep-a", (1,))
    bad = keep(durable, first, "ep-b", (2,))
    segment = next(p for b, _, _, p in first.blobs() if b == bad[0]).segment
    path = durable.store.path / segment
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    second, restarted = restart(tmp_path, durable)
    lost = restarted.readoption.lost  # type: ignore[attr-defined]
    assert list(lost) == bad and "checksum" in lost[bad[0]]
    assert second.fetch(bad, "trainer").arrays == {} and second.fetch(bad, "trainer").reclaimed == tuple(bad)
    assert list(second.fetch(good, "trainer").arrays) == good
    assert second.stats().deleted == {LOST: 1} and second.kept_total == 2


def test_a_smaller_budget_after_the_restart_drops_and_names_the_newest(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    old = keep(durable, first, "ep-a", (1,))
    new = keep(durable, first, "ep-b", (2,))
    second, restarted = restart(tmp_path, durable, budget=first.bytes_held - 1)
    assert list(restarted.readoption.lost) == new  # type: ignore[attr-defined]
    assert [b for b, *_ in second.blobs()] == old


def test_a_smaller_blob_cap_after_the_restart_drops_and_names_the_newest(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    old = keep(durable, first, "ep-a", (1, 2))
    charged = first.bytes_held
    new = keep(durable, first, "ep-b", (3,))
    second, restarted = restart(tmp_path, durable, max_blobs=2)
    lost = restarted.readoption.lost  # type: ignore[attr-defined]
    assert lost == {new[0]: "over the store's cap of 2 blobs after the restart"}
    assert [b for b, *_ in second.blobs()] == old
    assert second.bytes_held == charged  # the dropped blob's charge and its episode record's are gone


def test_the_segment_limit_leaves_the_process_mappings_of_its_own(tmp_path: Path) -> None:
    """A store maps one segment per blob; past vm.max_map_count every mapping of the process fails (keeps
    ``store-failed``, threads that cannot start), so its blobs are capped below it, with room for the rest."""
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    assert segment_limit(str(limit)) == 65530 - MAP_HEADROOM
    limit.write_text("1048576\n")
    assert segment_limit(str(limit)) == 1048576 - 1048576 // 8
    assert segment_limit(str(tmp_path / "absent")) == DEFAULT_MAX_MAP_COUNT - MAP_HEADROOM
    assert 0 < segment_limit() < int(Path("/proc/sys/vm/max_map_count").read_text())


def test_a_second_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(StoreLocked, match=f"held by process {os.getpid()}") as refused:
        open_store(tmp_path)
    assert refused.value.pid == os.getpid()
    store.close(remove=False)
    open_store(tmp_path).close(remove=False)  # free again once the holder let go


@pytest.mark.parametrize("role", ["env-server", "ps-manager"])
def test_a_store_whose_name_no_file_name_holds_is_refused_naming_the_ids_and_the_node_exits_2(
        tmp_path: Path, role: str) -> None:
    """A node id a registration takes (up to 256 characters) and the run id together name the store directory:
    past 255 bytes, before, the node died of a bare ``OSError: File name too long`` traceback (status 1, so it
    was restarted into it again). Now its last words name both ids, status 2, and nothing is made; a name of
    exactly 255 bytes is taken."""
    result = subprocess.run(
        [sys.executable, "-m", "refbus.nodes.cli", "node", role, f"--node-id={'e' * 241}", "--store-run", "r",
         "--store-directory", str(tmp_path), "--bus-control", "tcp://127.0.0.1:9", "--node-connect-timeout-s", "1",
         "--node-metrics-port", "-1"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    said = result.stderr.splitlines()[-1]
    assert said.startswith("refbus: the store directory of node 'eee") and "(241 characters) in run 'r'" in said, said
    assert "256 bytes, more than a file name holds (255)" in said, said
    assert list(tmp_path.iterdir()) == []
    for node in ("\u00e9" * 241, "x" * 300):  # the name is refused whole, however its characters read
        with pytest.raises(StoreError, match="more than a file name holds"):
            store_path(tmp_path, "r", node)
    DurableStore(tmp_path, "r", "e" * 240, budget_bytes=BUDGET, what="b").close(remove=True)


def test_gc_removes_only_stores_no_live_process_holds(tmp_path: Path) -> None:
    held = open_store(tmp_path, node="env-0")
    open_store(tmp_path, node="env-1").close(remove=False)
    DurableStore(tmp_path, "run-b", "env-1", budget_bytes=BUDGET, what="b").close(remove=False)
    assert gc(tmp_path, "run-a") == [store_path(tmp_path, "run-a", "env-1")]
    assert gc(tmp_path) == [store_path(tmp_path, "run-b", "env-1")]
    assert held.path.exists()
    held.close(remove=False)
    assert gc(tmp_path) == [held.path]


OTHER_UID = 65534  # nobody


def test_a_new_store_directory_is_private_and_a_symlink_in_its_place_is_refused(tmp_path: Path) -> None:
    """A new directory is made 0700; a symlink in place of the directory is refused (its target may be another
    user's to replace files in)."""
    made = open_store(tmp_path, node="env-0")
    assert stat.S_IMODE(made.path.stat().st_mode) == 0o700
    made.close(remove=True)
    path = store_path(tmp_path, "run-a", "env-0")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StoreError, match=re.escape(f"store directory {path} is not a directory")):
        open_store(tmp_path, node="env-0")
    assert gc(tmp_path) == [] and path.is_symlink()


def test_a_store_directory_an_earlier_version_made_under_umask_002_is_reopened_private(tmp_path: Path) -> None:
    """An earlier version made the directory with a plain mkdir (0775 under umask 002, the default login umask
    where each user has a private group); a restarted node refused it and could never re-adopt its store."""
    umask = os.umask(0o002)
    try:
        path = store_path(tmp_path, "run-a", "env-0")
        earlier = open_store(tmp_path, node="env-0")
        earlier.commit({"op": "kept", "n": 1})
        earlier.close(remove=False)
        path.chmod(0o775)  # what the earlier version's mkdir left
        with capture_logs() as logs:
            reopened = open_store(tmp_path, node="env-0")
        assert reopened.replay.records == [{"op": "kept", "n": 1}]
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert any(e["event"] == "store.directory_made_private" and e["mode"] == "775" for e in logs)
        reopened.close(remove=True)
    finally:
        os.umask(umask)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root (os.chown)")
def test_a_store_directory_another_user_made_is_refused_and_its_symlinks_never_followed(tmp_path: Path) -> None:
    """Another user who made the (predictable) store directory first and planted symlinks at ``lock`` and
    ``journal.new`` had the node truncate and overwrite the files they named; ``refbus shm gc`` removed it."""
    victim = tmp_path / "precious.txt"
    victim.write_text("the node user's own file\n")
    path = store_path(tmp_path, "run-a", "env-0")
    path.mkdir(mode=0o700)
    for name in ("lock", "journal.new"):
        (path / name).symlink_to(victim)
        os.lchown(path / name, OTHER_UID, OTHER_UID)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreError, match=re.escape(f"store directory {path} is owned by uid {OTHER_UID}")):
        open_store(tmp_path, node="env-0")
    assert victim.read_text() == "the node user's own file\n"
    assert gc(tmp_path) == [] and path.is_dir()


def test_a_budget_larger_than_the_tmpfs_is_a_clear_error(tmp_path: Path) -> None:
    size = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    with pytest.raises(StoreError, match=r"env_server.budget_bytes = .* store.durable = false"):
        open_store(tmp_path, budget=size + 1)


def test_no_room_refuses_the_keep_with_a_retry_and_leaves_nothing(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(KeepError) as refused:
        durable.write(pack_branches([random_arrays(5, seed=1)]))
    assert refused.value.code == "over-budget" and refused.value.retry_after_s > 0
    assert not list(durable.store.path.glob("seg-*"))


def test_a_keep_the_file_system_fails_midway_is_refused_and_leaves_nothing(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other error of the file system than a full one (EIO, EMFILE, ENOMEM from a mapping) on the second
    branch of a keep: refused ``store-failed``, and the first branch's segment is not left on the tmpfs outside
    the budget (it was, until the process restarted)."""
    durable = BlobJournal(open_store(tmp_path))
    durable.readopt(keeper())
    pwrite, calls = os.pwrite, []

    def failing(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(KeepError) as refused:
        durable.write(pack_branches([random_arrays(5, seed=1), random_arrays(5, seed=2)]))
    assert refused.value.code == "store-failed" and "Input/output error" in str(refused.value)
    assert len(calls) == 2 and not list(durable.store.path.glob("seg-*"))


def test_a_segment_the_kernel_writes_in_short_writes_is_written_whole(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One write may write less than it was given (Linux: at most 0x7ffff000 bytes, so any blob over 2 GiB):
    the rest is written too, so the live view and a restart's verified segment hold every byte."""
    durable = open_store(tmp_path)
    data = np.random.default_rng(7).integers(0, 256, 10_000, dtype=np.uint8)
    pwrite, offsets = os.pwrite, []

    def short(fd: int, data: memoryview, offset: int) -> int:
        offsets.append(offset)
        return pwrite(fd, memoryview(data)[:4096], offset)

    monkeypatch.setattr(os, "pwrite", short)
    segment = durable.write(data)
    monkeypatch.undo()
    assert np.array_equal(segment.data, data)
    assert offsets == [0, 64, 64 + 4096, 64 + 8192]  # the header, then the bytes in three writes
    durable.commit({"op": "keep", "segment": segment.name})
    durable.close(remove=False)
    found = open_store(tmp_path).segment(segment.name)
    assert isinstance(found, Segment) and np.array_equal(found.data, data)


def test_a_segment_write_that_writes_nothing_fails_and_leaves_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    durable = open_store(tmp_path)
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0 if offset else pwrite(fd, data, offset))
    with pytest.raises(OSError, match="wrote nothing"):
        durable.write(np.arange(100, dtype=np.float32))
    assert not list(durable.path.glob("seg-*"))


def test_another_format_version_is_refused_clearly(tmp_path: Path) -> None:
    open_store(tmp_path).close(remove=False)
    path = store_path(tmp_path, "run-a", "env-0") / "journal"
    data = bytearray(path.read_bytes())
    data[8] = journal.FORMAT_VERSION + 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"format version {journal.FORMAT_VERSION + 1}, this build reads"):
        open_store(tmp_path)
    path.write_bytes(b"garbage!" * 4)
    with pytest.raises(StoreError, match="not a refbus store journal"):
        open_store(tmp_path)


def made_store(directory: Path, *, strict: bool = False) -> DurableStore:
    """Open the store at the state a test left, check it is made and works: a record committed now is
    replayed by the next open of the same store (same identity, no longer fresh)."""
    durable = DurableStore(directory, "run-a", "env-0", budget_bytes=BUDGET, what="x", strict=strict)
    assert durable.fresh and durable.replay.records == [] and not durable.replay.damaged
    assert not list(durable.path.glob("seg-*")) and not (durable.path / "journal.new").exists()
    durable.commit({"op": "x"})
    durable.close(remove=False)
    again = open_store(directory)
    assert (again.identity, again.fresh, again.replay.records) == (durable.identity, False, [{"op": "x"}])
    again.close(remove=False)
    return durable


# What a process killed while making a store leaves (besides the lock), by the step it was killed at. An
# older build wrote the id first, then the journal in two writes (created, then its header).
UNFINISHED = {
    "old: the id, no journal yet": {"id": b"0123abcd\n"},
    "old: the id and an empty journal": {"id": b"0123abcd\n", "journal": b""},
    "old: the id and part of the header": {"id": b"0123abcd\n", "journal": journal.header()[:8]},
    "old: the id and all but a byte of the header": {"id": b"0123abcd\n", "journal": journal.header()[:-1]},
    "the new journal cut": {"journal.new": journal.header()[:5]},
    "the new journal whole, not in place": {"journal.new": journal.header()},
    "the journal in place, no id": {"journal": journal.header(), "id.new": b"0123"},
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("left", list(UNFINISHED))
def test_a_store_whose_making_was_cut_short_is_made_again(tmp_path: Path, left: str, strict: bool) -> None:
    """Every state a kill mid-way through making a store leaves opens as a fresh, empty store (a strict owner,
    the ps-manager, too): nothing in it was committed. One the older build left (an id beside no whole header)
    is logged; no restart refuses it (which, under a supervisor, crash-looped the node)."""
    path = store_path(tmp_path, "run-a", "env-0")
    path.mkdir()
    for name, data in {**UNFINISHED[left], "seg-dead-1": b"never committed"}.items():
        (path / name).write_bytes(data)
    with capture_logs() as logs:
        made = made_store(tmp_path, strict=strict)
    unfinished = [e for e in logs if e["event"] == "store.making_unfinished"]
    if "id" in UNFINISHED[left]:
        (event,) = unfinished
        assert event["log_level"] == "warning" and event["journal_bytes"] == len(UNFINISHED[left].get("journal", b""))
        assert made.identity != "0123abcd"  # never published: the process died before it served
    else:
        assert unfinished == []
    assert not [e for e in logs if e["event"] == "store.compaction_discarded"]


@pytest.mark.parametrize("journal_bytes", [b"RBJ\xff", b"garbage", journal.header()[:8] + b"\x07"])
def test_a_short_journal_that_is_not_a_cut_header_is_still_refused_as_found(tmp_path: Path,
                                                                             journal_bytes: bytes) -> None:
    open_store(tmp_path).close(remove=False)
    path = store_path(tmp_path, "run-a", "env-0")
    identity = (path / "id").read_bytes()
    (path / "journal").write_bytes(journal_bytes)
    with pytest.raises(StoreError, match="shorter than a journal header"):
        open_store(tmp_path)
    assert (path / "journal").read_bytes() == journal_bytes and (path / "id").read_bytes() == identity


MAKING_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from refbus.nodes.store.durable import DurableStore

    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "journal":  # the new journal written, not yet renamed into place
        DurableStore.before_rename = staticmethod(kill)
    else:  # the journal in place, the id written, not yet renamed into place
        rename = os.rename
        os.rename = lambda src, dst: kill() if os.path.basename(dst) == "id" else rename(src, dst)
    DurableStore(Path(sys.argv[1]), "run-a", "env-0", budget_bytes=1, what="x")
""")


@pytest.mark.parametrize("point", ["journal", "id"])
def test_sigkill_while_making_a_store_leaves_no_id_and_the_restart_makes_it(tmp_path: Path, point: str) -> None:
    """A process SIGKILLed at each rename of making a store: the journal goes in first, the id last, so no
    id is left beside a journal that is not whole, and the restart makes the store again."""
    child = subprocess.run([sys.executable, "-c", MAKING_CHILD, str(tmp_path), point], capture_output=True,
                           timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    path = store_path(tmp_path, "run-a", "env-0")
    assert not (path / "id").exists()
    assert (path / ("journal.new" if point == "journal" else "journal")).read_bytes() == journal.header()
    made_store(tmp_path)


@pytest.mark.parametrize("garbage", [b"\x00", b"\xff" * 13, os.urandom(64)])
def test_garbage_after_the_journal_keeps_what_came_before(tmp_path: Path, garbage: bytes) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    kept = keep(durable, first, "ep-a", (1,))
    with open(durable.store.path / "journal", "ab") as out:
        out.write(garbage)
    second, restarted = restart(tmp_path, durable)
    assert [b for b, *_ in second.blobs()] == kept
    keep(restarted, second, "ep-b", (2,))  # the journal was cut after the last good record: appends go on
    third, _ = restart(tmp_path, restarted)
    assert third.blobs_held == 2


def test_a_segment_of_another_format_is_named_as_lost(tmp_path: Path) -> None:
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    kept = keep(durable, first, "ep-a", (1,))
    segment = next(iter(durable.store.path.glob("seg-*")))
    data = bytearray(segment.read_bytes())
    data[8] = 9
    segment.write_bytes(bytes(data))
    _, restarted = restart(tmp_path, durable)
    assert "format version 9" in restarted.readoption.lost[kept[0]]  # type: ignore[attr-defined]


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_store import keep, keeper, open_store
    from refbus.nodes.payload.blob_journal import BlobJournal
    from pathlib import Path
    k, durable = keeper(), BlobJournal(open_store(Path(sys.argv[1])))
    durable.readopt(k)
    keep(durable, k, "ep-a", (1,))
    durable.store.before_flag = lambda: os.kill(os.getpid(), signal.SIGKILL)
    keep(durable, k, "ep-b", (2, 3, 4))
""")


def test_sigkill_between_the_bytes_and_the_commit_flag_aborts_that_keep_only(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(Path(__file__).parent)],
                           capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    second, restarted = restart(tmp_path, None)
    assert restarted.readoption.aborted == 3  # type: ignore[attr-defined]
    assert second.blobs_held == 1 and second.kept_total == 1
    assert len(list(restarted.store.path.glob("seg-*"))) == 1


def test_a_discard_sent_again_across_a_restart_answers_what_it_deleted_even_after_a_compaction(
        tmp_path: Path) -> None:
    """A discard's ``drop`` record names its episode, and so do the tombstones a compaction keeps of it: the
    restarted store answers the same discard with the ids the first process deleted (``repeated``). Before, it
    answered nothing (the ids were deleted, but the restarted store could not tell of which episode)."""
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    dropped = keep(durable, first, "ep-dropped", (1, 2))
    (other,) = keep(durable, first, "ep-other", (3,))
    assert first.discard("ep-dropped", commit=durable.dropped).deleted == tuple(dropped)
    durable.compact(first)  # the discarded episode's keep record goes; its tombstones stay
    second, _ = restart(tmp_path, durable)
    again = second.discard("ep-dropped")
    assert (again.deleted, again.repeated) == ((), tuple(dropped))
    assert (second.discard("ep-other").deleted, second.discard("unknown").repeated) == ((other,), ())


def busy_store(directory: Path) -> tuple[Keeper, BlobJournal]:
    """A store with every kind of record: blobs unclaimed, claimed and handed over, deletes, a violation."""
    k, durable = keeper(), BlobJournal(open_store(directory))
    durable.readopt(k)
    a, b, c, d = (keep(durable, k, f"ep-{n}", seeds) for n, seeds in enumerate(((1, 2), (3,), (4,), (5, 6))))
    keep(durable, k, "ep-unclaimed", (7,))
    durable.claimed(k.claim([*a, *b, *c, *d], "orchestrator").claimed, "orchestrator")
    durable.moved(k.hand_over([*b, d[0]], "trainer-0").moved, "trainer-0")
    dropped(durable, k.delete(c, "orchestrator", "consumed"))
    dropped(durable, k.delete(d[:1], "trainer-0", "trained"))
    durable.violated(k.delete(c, "orchestrator", "consumed").violations)
    return k, durable


def state(k: Keeper) -> dict:
    """What a restart must re-adopt exactly: counters, live blobs (holder, bytes' checksum), tombstones."""
    stats = k.stats()
    return {"stats": [stats.blobs_held, stats.bytes_held, stats.kept_total, dict(stats.deleted),
                      dict(stats.violations), dict(stats.held_by)],
            "blobs": [[blob_id, episode, holder, packed.checksum] for blob_id, episode, holder, packed in k.blobs()],
            "tombstones": [list(t) for t in k.tombstones()]}


COMPACTING_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_store import busy_store, state

    directory, point, at = Path(sys.argv[1]), sys.argv[3], int(sys.argv[4])
    k, durable = busy_store(directory)
    (directory / "expected.json").write_text(json.dumps(state(k)))
    calls = iter(range(1, 1000))
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if point == "flag":  # between the bytes and the flag of the compaction's record number ``at``
        durable.store.before_flag = lambda: kill() if next(calls) == at else None
    elif point == "rename":
        durable.store.before_rename = kill
    durable.compact(k)
    kill()  # "after": the compacted journal is in place
""")


@pytest.mark.parametrize(("point", "at"), [("flag", 1), ("flag", 5), ("flag", 9), ("rename", 0), ("after", 0)])
def test_sigkill_mid_compaction_loses_nothing_committed(tmp_path: Path, point: str, at: int) -> None:
    """The journal is rewritten from the live state (compaction) and the process is SIGKILLed at a chosen
    point of it: before a record of the new journal is committed (the first, one in the middle, the last),
    with the new journal whole but not yet in place, or just after. The restart re-adopts exactly what was
    committed; a new journal left unfinished is removed, logged; appends and restarts go on from there."""
    child = subprocess.run([sys.executable, "-c", COMPACTING_CHILD, str(tmp_path), str(Path(__file__).parent),
                            point, str(at)], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    expected = json.loads((tmp_path / "expected.json").read_text())
    path = store_path(tmp_path, "run-a", "env-0")
    assert (path / "journal.new").exists() == (point != "after")
    with capture_logs() as logs:
        second, restarted = restart(tmp_path, None)
    discarded = [e for e in logs if e["event"] == "store.compaction_discarded"]
    assert len(discarded) == (point != "after") and not (path / "journal.new").exists()
    assert state(second) == expected
    assert restarted.readoption.lost == {} and restarted.readoption.aborted == 0  # type: ignore[attr-defined]
    consumed = [blob_id for blob_id, _, reason, _ in second.tombstones() if reason == "consumed"]
    assert second.delete(consumed, "orchestrator", "consumed").repeated == tuple(consumed)  # a retry is answered
    more = keep(restarted, second, "ep-after", (8,))
    third, _ = restart(tmp_path, restarted)
    assert [b for b, *_ in third.blobs()] == [*(b[0] for b in expected["blobs"]), *more]
    assert third.kept_total == expected["stats"][2] + 1


@pytest.mark.parametrize("garbage", [b"", os.urandom(40), journal.header() + os.urandom(100)])
def test_a_garbage_new_journal_left_behind_is_removed_with_a_log_and_the_journal_stands(
        tmp_path: Path, garbage: bytes) -> None:
    first, durable = busy_store(tmp_path)
    expected = state(first)
    (durable.store.path / "journal.new").write_bytes(garbage)
    with capture_logs() as logs:
        second, restarted = restart(tmp_path, durable)
    (discarded,) = [e for e in logs if e["event"] == "store.compaction_discarded"]
    assert discarded["bytes"] == len(garbage) and discarded["log_level"] == "warning"
    assert state(second) == expected and not (restarted.store.path / "journal.new").exists()


def _journal_of(records: list[dict[str, Any]]) -> tuple[bytes, list[int]]:
    """A journal's bytes holding ``records``, committed, and where each record starts."""
    data, starts = journal.header(), []
    for record in records:
        body, flag = journal.encode(record)
        starts.append(len(data))
        data += body + flag
    return data, starts


def test_a_record_length_garbled_mid_journal_is_damage_where_a_torn_last_record_is_not() -> None:
    """A length that runs past the end of the file is a record cut by a crash only when it is the last: with a
    committed record after it, it is damage, named, not a tail that would end the replay there silently (every
    record after it dropped, the journal cut). A big last record cut short is still only a torn tail. The
    record 1 here spans more than one window of the scan that tells the two apart."""
    records = [{"op": "keep", "n": 0}, {"op": "keep", "n": 1, "blob": bytes(range(256)) * 6144}, {"op": "keep", "n": 2}]
    data, starts = _journal_of(records)
    garbled = bytearray(data)
    garbled[starts[1] + 2] ^= 0x40  # record 1's length now runs 4 MiB past the end
    found = journal.replay(bytes(garbled), "j")
    length = int.from_bytes(garbled[starts[1] : starts[1] + 4], "little")
    assert found.records == records[:1] and found.end == starts[1]
    assert found.damaged == (f"garbage at byte {starts[1]}: record length {length} runs past the end, yet a "
                             f"committed record follows at byte {starts[2]}")
    torn = journal.replay(data[: starts[2] - 10], "j")
    assert (torn.records, torn.damaged, torn.end) == (records[:1], "", starts[1])


@pytest.mark.parametrize(("name", "kind"), [("journal", "directory"), ("journal.new", "directory"),
                                            ("id", "directory"), ("journal", "symlink")])
def test_a_store_file_that_is_not_a_file_refuses_the_store_naming_it(tmp_path: Path, name: str, kind: str) -> None:
    """A directory in place of the journal, of a compaction's new journal or of the id, or a symlink in place of
    the journal: a StoreError names it and the store is left as found (before, an OSError: a crash its supervisor
    restarted into again, or the store made again over its journal)."""
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    keep(durable, first, "ep-a", (1,))
    durable.store.close(remove=False)
    path = store_path(tmp_path, "run-a", "env-0")
    target = path / name
    if kind == "symlink":
        target.rename(tmp_path / "elsewhere")
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.unlink(missing_ok=True)
        target.mkdir()
    found = sorted((p.name, p.is_symlink(), p.is_dir()) for p in path.iterdir())
    with pytest.raises(StoreError, match=rf"^{re.escape(str(target))}: .*this store is refused, left as it is"):
        open_store(tmp_path)
    assert sorted((p.name, p.is_symlink(), p.is_dir()) for p in path.iterdir()) == found


def test_cli_gc_removes_what_no_live_process_holds(tmp_path: Path) -> None:
    held = open_store(tmp_path, node="env-0")  # held by this process: a live store
    open_store(tmp_path, node="env-1").close(remove=False)
    gc_cli = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "shm", "gc", "--store-directory", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert gc_cli.returncode == 0, gc_cli.stderr
    assert gc_cli.stdout.split() == ["removed", str(store_path(tmp_path, "run-a", "env-1"))]
    assert held.path.exists()
    held.close(remove=True)


def sealed_shard(directory: Path, pool: SegmentPool, journal_: ShardJournal, lease: str, version: int) -> str:
    """What a ps-worker does for a push: a segment written by the pusher, then the verified seal committed."""
    segment = acquire(pool, 4096)
    data = np.frombuffer(segment.view(0, 4096), np.uint8)
    data[:] = np.arange(4096) % 251
    tensors = [ShardTensor("w", "uint8", [4096], 0, 4096, checksum(segment.view(0, 4096)))]
    journal_.sealed(lease, version, 0, segment.name, tensors)
    return segment.name


def test_a_restarted_ps_worker_readopts_its_sealed_shards_and_names_a_corrupt_one(tmp_path: Path) -> None:
    store = open_store(tmp_path, node="ps-worker-0", budget=0)
    shards, pool = ShardJournal(store), SegmentPool(store.path, "refbus-ps", pin=False)
    assert shards.readopt().shards == ()
    kept = sealed_shard(tmp_path, pool, shards, "lease-a", 1)
    corrupt = sealed_shard(tmp_path, pool, shards, "lease-b", 2)
    released = sealed_shard(tmp_path, pool, shards, "lease-c", 3)
    shards.released(["lease-c"])
    unsealed = acquire(pool, 4096).name  # opened by a pusher, never sealed
    with open(store.path / corrupt, "r+b") as out:
        out.write(b"\xff")
    store.close(remove=False)  # the process died: the mappings and the files stay

    again = ShardJournal(open_store(tmp_path, node="ps-worker-0", budget=0))
    found = again.readopt()
    assert [(s.lease, s.version, s.segment) for s in found.shards] == [("lease-a", 1, kept)]
    assert list(found.lost) == ["lease-b"] and "checksum" in found.lost["lease-b"]
    assert found.swept == 3  # the corrupt, the released and the unsealed segments
    left = {p.name for p in again.store.path.iterdir()}
    assert kept in left and not {corrupt, released, unsealed} & left
    adopted = SegmentPool(again.store.path, "refbus-ps", pin=False).adopt(kept)
    assert np.array_equal(np.frombuffer(adopted.view(0, 4096), np.uint8), np.arange(4096) % 251)
    pool.close()


def test_a_release_naming_a_shard_twice_releases_it_once_and_replays_the_same(tmp_path: Path) -> None:
    """A release may name a shard twice (garbage, or an older manager's held-back releases adding up): the
    journal commits it once and raised ``KeyError`` before, failing the whole release ``internal``."""
    store = open_store(tmp_path, node="ps-worker-0", budget=0)
    shards, pool = ShardJournal(store), SegmentPool(store.path, "refbus-ps", pin=False)
    shards.readopt()
    kept = sealed_shard(tmp_path, pool, shards, "lease-a", 1)
    sealed_shard(tmp_path, pool, shards, "lease-b", 2)
    shards.released(["lease-b", "lease-b", "lease-unknown", "lease-b"])
    shards.released(["lease-b"])  # again, once more: nothing left to release
    store.close(remove=False)
    again = ShardJournal(open_store(tmp_path, node="ps-worker-0", budget=0)).readopt()
    assert [(s.lease, s.segment) for s in again.shards] == [("lease-a", kept)] and again.lost == {}
    pool.close()


def test_a_record_over_the_limit_is_refused_unwritten_and_later_records_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record a replay could not read back (over MAX_RECORD_BYTES) is refused before a byte is written: before,
    it was committed and every restart stopped at it as garbage, cutting off every record after it."""
    monkeypatch.setattr(journal, "MAX_RECORD_BYTES", 4096)
    store = open_store(tmp_path)
    store.commit({"op": "x", "n": 1})
    size = (store.path / "journal").stat().st_size
    with pytest.raises(journal.RecordTooLarge, match=r"'big' record of \d+ bytes: .* at most 4096"):
        store.commit({"op": "big", "pad": "y" * 5000})
    assert (store.path / "journal").stat().st_size == size
    store.commit({"op": "x", "n": 2})
    store.close(remove=False)
    again = open_store(tmp_path)
    assert again.replay.records == [{"op": "x", "n": 1}, {"op": "x", "n": 2}] and not again.replay.damaged
    again.close(remove=True)


def test_a_commit_that_fails_midway_is_cut_back_and_later_records_replay(tmp_path: Path) -> None:
    """A write that fails between a record's bytes and its flag (a full disk) leaves no torn record for later
    appends to follow: the journal is cut back, the next commit replays."""
    store = open_store(tmp_path)
    store.commit({"op": "x", "n": 1})
    size = (store.path / "journal").stat().st_size

    def disk_full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store.before_flag = disk_full
    with pytest.raises(OSError, match="No space"):
        store.commit({"op": "x", "n": 2})
    assert (store.path / "journal").stat().st_size == size
    store.before_flag = None
    store.commit({"op": "x", "n": 3})
    store.close(remove=False)
    again = open_store(tmp_path)
    assert again.replay.records == [{"op": "x", "n": 1}, {"op": "x", "n": 3}] and not again.replay.damaged
    assert again.replay.uncommitted is None
    again.close(remove=True)


def test_id_lists_go_in_runs_of_bounded_records_and_replay_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims, moves and drops of many blobs are several records of at most IDS_PER_RECORD ids each (so none can
    pass the record limit), and a restart replays them all, compacted or not."""
    from refbus.nodes.payload import blob_journal

    monkeypatch.setattr(blob_journal, "IDS_PER_RECORD", 2)
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    ids = keep(durable, first, "ep-a", (1, 2, 3, 4, 5))
    durable.claimed(first.claim(ids[:4], "orchestrator").claimed, "orchestrator")
    dropped(durable, first.delete(ids[:3], "orchestrator", "consumed"))
    assert durable.store.records_since_compact == 1 + 2 + 2  # the keep, two claim runs, two drop runs
    second, restarted = restart(tmp_path, durable)
    assert sorted((b, h) for b, _, h, _ in second.blobs()) == [(ids[3], "orchestrator"), (ids[4], "")]
    restarted.compact(second)
    third, _ = restart(tmp_path, restarted)
    assert sorted((b, h) for b, _, h, _ in third.blobs()) == [(ids[3], "orchestrator"), (ids[4], "")]


def test_holders_reported_down_survive_a_restart_and_a_compaction_and_garbage_ones_are_skipped(
        tmp_path: Path) -> None:
    """``holder-down`` records replay into the readoption (the latest per holder) with what each holder claimed
    again since (``again``); a settled holder (``holder-settled``: back as the same process, or its grace over)
    is not down after a restart (before, only a compaction dropped it, and a restart before one gave the holder,
    by then a newer live process, the grace anew and reclaimed what it held); a compaction keeps the records of
    holders that still hold blobs, each with when its grace ends on the wall clock; records whose fields do not
    parse are skipped (they only time a reclaim) and the rest of the journal still replays."""
    wall = _Clock(WALL)
    first, durable = keeper(), BlobJournal(open_store(tmp_path), wall_clock=wall)
    durable.readopt(first)
    blobs = keep(durable, first, "ep-a", (1, 2, 3, 4))
    for holder, blob_id in zip(("trainer-0", "trainer-1", "orchestrator", "trainer-0"), blobs, strict=True):
        durable.claimed(first.claim([blob_id], holder).claimed, holder)
    durable.holder_down("trainer-0", ("h", 11, 5.0), GRACE_S)
    durable.claimed_back([blobs[3]], "trainer-0")  # its restarted incarnation took one of its two back
    durable.claimed_back([blobs[1]], "rollout-0")  # not down: nothing to record
    wall.now += 1.5
    durable.holder_down("trainer-1", None, GRACE_S)
    durable.holder_down("orchestrator", ("h", 12, 6.0), GRACE_S)
    durable.holder_settled("orchestrator")  # back as the same process
    for garbage in ({"op": "holder-down"}, {"op": "holder-down", "holder": "x", "inc": [1, 2]},
                    {"op": "holder-down", "holder": 5, "inc": None}, {"op": "holder-down", "holder": "y", "inc": "z"},
                    {"op": "again"}, {"op": "again", "holder": "trainer-0", "ids": "b"},
                    {"op": "again", "holder": "trainer-1", "ids": [7]}, {"op": "again", "holder": 3, "ids": []},
                    {"op": "holder-settled"}, {"op": "holder-settled", "holder": ["trainer-0"]}):
        durable.store.commit(garbage)
    second, restarted = restart(tmp_path, durable)
    down = {"trainer-0": ("h", 11, 5.0), "trainer-1": None}
    ends = {"trainer-0": WALL + GRACE_S, "trainer-1": WALL + 1.5 + GRACE_S}
    assert restarted.readoption.holders_down == down  # type: ignore[attr-defined]
    assert restarted.readoption.grace_ends == ends  # type: ignore[attr-defined]
    assert restarted.readoption.claimed_again == {  # type: ignore[attr-defined]
        "trainer-0": frozenset({blobs[3]}), "trainer-1": frozenset()}
    assert second.stats().held_by == {"trainer-0": 2, "trainer-1": 1, "orchestrator": 1}
    restarted.compact(second)
    _, compacted = restart(tmp_path, restarted)
    assert compacted.readoption.holders_down == down  # type: ignore[attr-defined]
    assert compacted.readoption.grace_ends == ends  # type: ignore[attr-defined]
    assert compacted.readoption.claimed_again["trainer-0"] == {blobs[3]}  # type: ignore[attr-defined]
    compacted.holder_settled("trainer-0")
    compacted.holder_settled("trainer-1")
    _, settled = restart(tmp_path, compacted)
    assert settled.readoption.holders_down == settled.readoption.claimed_again == {}  # type: ignore[attr-defined]
    assert settled.readoption.grace_ends == {}  # type: ignore[attr-defined]
    settled.store.close(remove=True)


def test_the_process_each_holder_was_survives_a_restart_and_a_compaction_and_garbage_ones_are_skipped(
        tmp_path: Path) -> None:
    """``holder-seen`` records (the process a holder was when it took blobs here) replay into the readoption, the
    latest per holder; one is committed only when the process changed; a compaction keeps those of holders that
    still hold blobs; records whose fields do not parse, or name no process, are skipped (they only decide
    whether a holder restarted while the store was dead) and the rest of the journal still replays."""
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    blobs = keep(durable, first, "ep-a", (1, 2, 3))
    for holder, blob_id in zip(("orchestrator", "trainer-0", "trainer-1"), blobs, strict=True):
        durable.claimed(first.claim([blob_id], holder).claimed, holder)
    assert durable.holder_seen("orchestrator", ("h", 11, 5.0))
    records = durable.store.records_since_compact
    assert not durable.holder_seen("orchestrator", ("h", 11, 5.0))  # the same process: nothing committed
    assert durable.store.records_since_compact == records
    assert durable.holder_seen("orchestrator", ("h", 12, 6.0))  # restarted: the newer process is recorded
    assert durable.holder_seen("trainer-0", ("g", 7, 1.5))
    assert durable.holder_seen("trainer-1", ("g", 8, 1.5))
    dropped(durable, first.delete([blobs[2]], "trainer-1", "trained"))  # trainer-1 holds nothing any more
    for garbage in ({"op": "holder-seen"}, {"op": "holder-seen", "holder": "x", "inc": [1, 2]},
                    {"op": "holder-seen", "holder": "y", "inc": None}, {"op": "holder-seen", "holder": 5,
                                                                         "inc": ["h", 1, 1.0]},
                    {"op": "holder-seen", "holder": "trainer-0", "inc": ["h", "pid", 1.0]}):
        durable.store.commit(garbage)
    second, restarted = restart(tmp_path, durable)
    seen = {"orchestrator": ("h", 12, 6.0), "trainer-0": ("g", 7, 1.5), "trainer-1": ("g", 8, 1.5)}
    assert restarted.readoption.holders_seen == seen  # type: ignore[attr-defined]
    assert second.stats().held_by == {"orchestrator": 1, "trainer-0": 1}
    restarted.compact(second)
    _, compacted = restart(tmp_path, restarted)
    del seen["trainer-1"]
    assert compacted.readoption.holders_seen == seen  # type: ignore[attr-defined]
    compacted.store.close(remove=True)


def test_a_holder_reported_down_again_as_another_process_replays_as_a_fresh_grace_that_can_resume_the_earlier(
        tmp_path: Path) -> None:
    """A second ``holder-down`` for a holder already down (its restarted process died in the grace) replays as a
    fresh grace with nothing claimed again, the grace it cut short kept beside it, through a restart and a
    compaction, each with its own end (one for the process already down is a repeat, not written);
    ``holder-back`` (that process back after all) resumes the earlier grace, with its end and what was claimed
    again in either, and ``holder-settled`` ends both."""
    wall = _Clock(WALL)
    first, durable = keeper(), BlobJournal(open_store(tmp_path), wall_clock=wall)
    durable.readopt(first)
    blobs = keep(durable, first, "ep-a", (1, 2, 3))
    durable.claimed(first.claim(blobs, "orchestrator").claimed, "orchestrator")
    a, b = ("h", 11, 5.0), ("h", 12, 6.0)
    a_ends, b_ends = WALL + GRACE_S, WALL + 2.0 + GRACE_S
    durable.holder_down("orchestrator", a, GRACE_S)
    durable.claimed_back(blobs[:1], "orchestrator")  # b, the restart, took one back
    records = durable.store.records_since_compact
    durable.holder_down("orchestrator", a, GRACE_S)  # a repeat (a change sent again): nothing written or lost
    assert durable.store.records_since_compact == records
    wall.now += 2.0
    durable.holder_down("orchestrator", b, GRACE_S)  # and died
    second, restarted = restart(tmp_path, durable)
    found = restarted.readoption  # type: ignore[attr-defined]
    assert (found.holders_down, found.claimed_again) == ({"orchestrator": b}, {"orchestrator": frozenset()})
    assert found.grace_ends == {"orchestrator": b_ends}
    assert found.earlier_down == {"orchestrator": (a, frozenset(blobs[:1]), a_ends)}
    restarted.claimed_back(blobs[1:2], "orchestrator")
    restarted.compact(second)
    _, compacted = restart(tmp_path, restarted)
    found = compacted.readoption  # type: ignore[attr-defined]
    assert (found.holders_down, found.claimed_again) == ({"orchestrator": b}, {"orchestrator": {blobs[1]}})
    assert found.grace_ends == {"orchestrator": b_ends}
    assert found.earlier_down == {"orchestrator": (a, frozenset(blobs[:1]), a_ends)}
    compacted.holder_back("orchestrator")  # b was slow, not dead
    _, back = restart(tmp_path, compacted)
    found = back.readoption  # type: ignore[attr-defined]
    assert (found.holders_down, found.claimed_again) == ({"orchestrator": a}, {"orchestrator": set(blobs[:2])})
    assert (found.grace_ends, found.earlier_down) == ({"orchestrator": a_ends}, {})
    back.holder_down("orchestrator", b, GRACE_S)
    back.holder_settled("orchestrator")
    _, settled = restart(tmp_path, back)
    found = settled.readoption  # type: ignore[attr-defined]
    assert found.holders_down == found.claimed_again == found.earlier_down == found.grace_ends == {}
    settled.store.close(remove=True)


@pytest.mark.parametrize("until", ["soon", math.nan, math.inf, -math.inf, -1.0, -1, True, False, None, [WALL]],
                         ids=repr)
def test_a_holder_down_record_whose_grace_end_does_not_parse_is_skipped_and_an_earlier_builds_gets_a_whole_grace(
        tmp_path: Path, until: Any) -> None:
    """A ``holder-down`` record's ``until`` (when its grace ends, seconds since the epoch) is a finite number, not
    negative and not a bool: with any other value the record is garbage, skipped as any holder record whose
    fields do not parse (it neither starts a grace nor cuts short the one running, and the records after it
    replay). A record without ``until`` (an earlier build's, in a store it left) replays with its end unknown,
    which a restarted store resumes as a whole grace. Before ``until`` existed, every one of these records started
    a grace, each given whole by every restart of the store."""
    first, durable = keeper(), BlobJournal(open_store(tmp_path))
    durable.readopt(first)
    blobs = keep(durable, first, "ep-a", (1, 2, 3))
    for holder, blob_id in zip(("trainer-0", "trainer-1", "trainer-2"), blobs, strict=True):
        durable.claimed(first.claim([blob_id], holder).claimed, holder)
    for record in ({"holder": "trainer-0", "inc": ["h", 11, 5.0], "until": WALL + GRACE_S},
                   {"holder": "trainer-0", "inc": ["h", 12, 6.0], "until": until},  # would cut the grace short
                   {"holder": "trainer-1", "inc": None, "until": until},
                   {"holder": "trainer-2", "inc": ["h", 13, 7.0]}):  # an earlier build's
        durable.store.commit({"op": "holder-down", **record})
    durable.store.commit({"op": "again", "ids": blobs[:1], "holder": "trainer-0"})
    _, restarted = restart(tmp_path, durable)
    found = restarted.readoption  # type: ignore[attr-defined]
    assert found.holders_down == {"trainer-0": ("h", 11, 5.0), "trainer-2": ("h", 13, 7.0)}
    assert found.grace_ends == {"trainer-0": WALL + GRACE_S, "trainer-2": None}
    assert (found.claimed_again, found.earlier_down) == ({"trainer-0": {blobs[0]}, "trainer-2": set()}, {})
    restarted.store.close(remove=True)


def test_a_resumed_grace_is_what_is_left_of_it_never_more_than_a_whole_one_nor_less_than_a_share() -> None:
    """What a restarted store gives of a journaled grace (ends at ``WALL + GRACE_S``): what is left of it by the
    wall clock; a whole grace at most, however far the wall clock was set back since it was written; a share of
    one at least, past its end or however far the clock was set forward (the holder's last chance to claim back
    what it could not while the store was dead); a whole grace for a record without its end."""
    least = GRACE_S * MIN_RESUMED_GRACE_SHARE
    ends = WALL + GRACE_S
    assert 0 < least < GRACE_S
    assert resumed_grace(ends, WALL + 2.0, GRACE_S) == GRACE_S - 2.0
    assert resumed_grace(ends, WALL, GRACE_S) == GRACE_S
    assert resumed_grace(ends, WALL - 1.0, GRACE_S) == GRACE_S  # set back a second
    assert resumed_grace(ends, WALL - 86_400.0, GRACE_S) == GRACE_S  # set back a day
    assert resumed_grace(ends, ends - least / 2, GRACE_S) == least
    assert resumed_grace(ends, ends + 1.0, GRACE_S) == least  # the store was dead past its end
    assert resumed_grace(ends, WALL + 86_400.0, GRACE_S) == least  # set forward a day
    assert resumed_grace(None, WALL, GRACE_S) == GRACE_S





EnvServers = Callable[..., EnvServer]


@pytest.fixture
def env_server(tmp_path: Path) -> Iterator[EnvServers]:
    """``env_server(clock, wall=None)``: a durable env server on ``tmp_path`` in this process, never joined to a
    bus (its handlers and liveness listeners are called directly, and what it publishes is dropped), timing on
    ``clock`` and journaling graces' ends on ``wall`` (None: ``time.time``); each one still open is closed at
    teardown."""
    made: list[NodeRuntime] = []

    def make(clock: _Clock, wall: _Clock | None = None) -> EnvServer:
        runtime = NodeRuntime("env-server", RuntimeSettings(node_id="env-0", metrics_port=-1))
        made.append(runtime)
        runtime.publish = lambda body: 0  # type: ignore[method-assign]
        env = EnvServer(runtime, EnvServerSettings(budget_bytes=BUDGET, handover_lease_s=600.0),
                        restart_grace_s=GRACE_S, clock=clock,
                        store=StoreSettings(directory=str(tmp_path), run="run-a"))
        if wall is not None:
            assert env.journal is not None
            env.journal.wall_clock = wall
        return env

    yield make
    for runtime in made:
        if not runtime.closed:
            runtime.close()


def _claim(env: EnvServer, blob_ids: list[str]) -> None:
    claim = Message(kind=Claim.kind, header=None, body=Claim(blob_ids=blob_ids, holder="orch"))  # type: ignore[arg-type]
    assert sorted(env._on_claim(claim).blob_ids) == sorted(blob_ids)


def _killed_and_restarted(env: EnvServer, env_server: EnvServers, clock: _Clock,
                          wall: _Clock | None = None) -> EnvServer:
    """``env``'s process killed (its store stays, its lock let go) and the next one started on its store."""
    assert env.journal is not None
    env.journal.close(remove=False)
    env.runtime.close()
    return env_server(clock, wall)


def test_a_stall_of_the_store_counts_toward_no_holders_grace(env_server: EnvServers) -> None:
    """The orchestrator dies holding two blobs here and its grace starts; then this store's loop does not run for
    longer than the grace (every process of the host paused). Before, its first pass on waking reclaimed both,
    though the restarted orchestrator, paused too, had its claims still to send (a soak lost 180 blobs so). The
    stall now counts toward no grace: the pass reclaims nothing, the restart claims one back, and the other goes
    at the grace's end moved by the stall, not before."""
    clock = _Clock()
    env = env_server(clock)
    env.passes = PassStalls(env.passes.period_s, clock)  # the stall measured on the test's clock
    period = env.passes.period_s
    held = [ref.blob_id for ref in env.keep("ep-held", [random_arrays(5, seed=1), random_arrays(6, seed=2)])]
    _claim(env, held)
    a, b = (NodeInfo(node_id="orch", role="orchestrator", host="h", pid=pid, started=float(pid)) for pid in (1, 2))
    down_at = clock.now
    env._on_node_down(NodeDown(node_id="orch", role="orchestrator", reason="timeout", last_seen=0.0), a)
    clock.now += period
    env._deadlines()  # on time: no stall
    stall = GRACE_S + 3.0
    clock.now += period + stall
    with capture_logs() as logs:
        env._deadlines()
    assert [e["seconds"] for e in logs if e["event"] == "store.stalled"] == [stall]
    assert env.stats().reclaimed == {} and env.keeper.in_grace("orch") and env.passes.stalled_s == stall
    env._on_node_up(b)
    _claim(env, held[:1])
    ends = down_at + GRACE_S + stall
    while clock.now + period < ends:  # passes on time up to the moved end
        clock.now += period
        env._deadlines()
        assert env.stats().reclaimed == {}, clock.now
    clock.now = ends
    env._deadlines()
    assert (env.stats().reclaimed, env.stats().held_by) == ({"orch": 1}, {"orch": 1})


@pytest.mark.parametrize("then", ["no-restart", "restart-gone", "restart-live"])
def test_a_restarted_holder_that_died_in_its_grace_gets_a_fresh_one_that_a_store_restart_resumes(
        env_server: EnvServers, then: str) -> None:
    """Process A of a holder dies holding two blobs; its restarted process B claims one back and a new one within
    A's grace, and is reported down too: a fresh grace starts, journaled. At its end all three are reclaimed (B
    is gone for good), by this store or by one restarted in that grace, which resumes it with nothing claimed
    again. Were B live after all at the restart (slow, not dead), the grace B's report cut short resumes: B keeps
    what it claimed and only A's other blob goes. Before, B's report kept A's grace, which spared what B had
    claimed (and a restarted store resumed A's grace likewise): B's two blobs stayed held by a process that was
    gone, until the store shut down."""
    clock = _Clock()
    env = env_server(clock)
    held = [ref.blob_id for ref in env.keep("ep-held", [random_arrays(5, seed=1), random_arrays(6, seed=2)])]
    (new,) = [ref.blob_id for ref in env.keep("ep-new", [random_arrays(7, seed=3)])]
    _claim(env, held)
    a, b = (NodeInfo(node_id="orch", role="orchestrator", host="h", pid=pid, started=float(pid)) for pid in (1, 2))
    down = NodeDown(node_id="orch", role="orchestrator", reason="timeout", last_seen=0.0)
    env._on_node_down(down, a)
    env._on_node_up(b)
    clock.now += 1.0
    _claim(env, [held[0], new])
    env._on_node_down(down, b)
    if then != "no-restart":
        env = _killed_and_restarted(env, env_server, clock)
        env._holders_gone([b] if then == "restart-live" else [])
    clock.now += GRACE_S
    env._reclaim()
    stats = env.stats()
    assert (stats.reclaimed, stats.held_by) == (({"orch": 1}, {"orch": 2}) if then == "restart-live" else
                                                ({"orch": 3}, {}))


def test_a_hand_over_the_orchestrator_repeats_for_a_dead_rank_is_reclaimed_with_the_ranks_blobs(
        env_server: EnvServers) -> None:
    """The orchestrator repeats a rank's ``reference`` on the rank's answer, which may come after the rank was
    reported down (it took a step and died before its own event went out). The repeat moves the blobs to the
    rank, so its grace's end reclaims them; it does not make them the restarted incarnation's, which never knew
    them (they were kept, under the rank's id, until the store shut down); and when the rank held nothing here
    at its node-down (its own event never came), the hand-over starts the grace that node-down did not (they
    were held for good). The restarted rank's own event in the grace takes blobs for its new process, those the
    repeat moved first as any other."""
    clock = _Clock()
    env = env_server(clock)
    dead_step, new_step = ([ref.blob_id for ref in env.keep(f"ep-{n}", [random_arrays(5, seed=n)])] for n in (1, 2))
    _claim(env, [*dead_step, *new_step])

    def message(kind: str, src: str, body: Any) -> Message:
        return Message(kind=kind, header=Header(v=PROTOCOL_VERSION, id=f"{src}-1", src=src, seq=1, ts=0.0),
                       body=body)

    def reference(src: str, blob_ids: list[str]) -> Message:
        return message(Reference.kind, src, Reference(step=3, holder="trainer-0", blob_ids=blob_ids))

    env._peers.seed([NodeInfo(node_id="trainer-0", role="trainer", host="h", pid=7, started=7.0)])
    env._peers.handle(message(NodeDown.kind, "bus", NodeDown(node_id="trainer-0", role="trainer", reason="timeout",
                                                             last_seen=0.0)))
    assert not env.keeper.in_grace("trainer-0")  # it held nothing here
    env._on_reference(reference("orch", dead_step))  # the dead process's step, answered before it died
    env._on_reference(reference("orch", new_step))  # the restarted rank's step: the repeat came first
    env._on_reference(reference("trainer-0", new_step))
    clock.now += GRACE_S
    env._reclaim()
    stats = env.stats()
    assert (stats.reclaimed, stats.held_by) == ({"trainer-0": 1}, {"trainer-0": 1}), stats
    assert env.keeper.fetch(new_step, "trainer-0").arrays.keys() == set(new_step)


def test_a_hand_over_naming_a_process_no_registry_answer_has_shown_is_never_taken_for_gone(
        env_server: EnvServers) -> None:
    """A hand-over names the rank's process that took it; a process not live here is gone (its grace starts), but
    only once a registry lookup of every role answered this store. Before one did (its start-up lookup unanswered:
    a busy broker), a rank live since before the store started was never heard coming up, and the orchestrator's
    hand-overs to it started a grace whose end reclaimed its blobs in the middle of its training."""
    clock = _Clock()
    env = env_server(clock)
    first, second = ([ref.blob_id for ref in env.keep(f"ep-{n}", [random_arrays(5, seed=n)])] for n in (1, 2))
    _claim(env, [*first, *second])

    def reference(blob_ids: list[str]) -> Message:
        return Message(kind=Reference.kind, header=Header(v=PROTOCOL_VERSION, id="orch-1", src="orch", seq=1, ts=0.0),
                       body=Reference(step=3, holder="trainer-0", blob_ids=blob_ids, process=("h", 7, 7.0)))

    assert not env._peers.seeded
    env._on_reference(reference(first))
    assert not env.keeper.in_grace("trainer-0")
    clock.now += GRACE_S
    env._reclaim()
    assert (env.stats().reclaimed, env.stats().held_by) == ({}, {"trainer-0": 1, "orch": 1})
    env._peers.seed([])  # the registry answered: trainer-0 is live nowhere
    env._on_reference(reference(second))
    assert env.keeper.in_grace("trainer-0")
    clock.now += GRACE_S
    env._reclaim()
    assert (env.stats().reclaimed, env.stats().held_by) == ({"trainer-0": 2}, {})


LEAST_S = GRACE_S * MIN_RESUMED_GRACE_SHARE


@pytest.mark.parametrize(("restarts", "left", "earlier_build"), [
    pytest.param([(2.0, 0.0)], GRACE_S - 2.0, False, id="resumed"),
    pytest.param([(2.0, 0.0), (1.0, 0.0)], GRACE_S - 3.0, False, id="resumed-twice"),
    pytest.param([(2.0, -3600.0)], GRACE_S, False, id="wall-clock-set-back"),
    pytest.param([(2.0, 3600.0)], LEAST_S, False, id="wall-clock-set-forward"),
    pytest.param([(GRACE_S + 2.0, 0.0)], LEAST_S, False, id="restarted-past-its-end"),
    pytest.param([(2.0, 0.0)], GRACE_S, True, id="earlier-builds-record"),
])
def test_a_store_restarted_in_a_holders_grace_resumes_what_is_left_of_it(
        env_server: EnvServers, restarts: list[tuple[float, float]], left: float, earlier_build: bool) -> None:
    """A holder of two blobs is reported down; the store's process is killed and restarted (``restarts``: each
    after that many seconds, its wall clock set that far off besides), and the last one reclaims both blobs
    ``left`` seconds after its start: what was left of the grace by the wall clock; a whole grace at most (a wall
    clock set back), a share of one at least (set forward, or the store dead past the grace's end); a whole grace
    for a record an earlier build wrote (``earlier_build``), without its end. Before, each restart gave the grace
    whole again."""
    clock, wall = _Clock(), _Clock(WALL)
    env = env_server(clock, wall)
    held = [ref.blob_id for ref in env.keep("ep-held", [random_arrays(5, seed=1), random_arrays(6, seed=2)])]
    _claim(env, held)
    if earlier_build:
        assert env.journal is not None
        env.journal.store.commit({"op": "holder-down", "holder": "orch", "inc": ["h", 1, 1.0]})
    else:
        gone = NodeInfo(node_id="orch", role="orchestrator", host="h", pid=1, started=1.0)
        env._on_node_down(NodeDown(node_id="orch", role="orchestrator", reason="timeout", last_seen=0.0), gone)
    for elapsed, off in restarts:
        clock.now += elapsed
        wall.now += elapsed + off
        env = _killed_and_restarted(env, env_server, clock, wall)
        env._holders_gone([])
    clock.now += left - 0.25
    env._reclaim()
    assert env.stats().reclaimed == {}
    clock.now += 0.25
    env._reclaim()
    assert (env.stats().reclaimed, env.stats().held_by) == ({"orch": 2}, {})


def test_a_restarted_stores_repeat_of_an_unheard_episode_one_of_whose_blobs_it_lost_agrees_with_its_counters(
        env_server: EnvServers) -> None:
    """The killed process kept an episode of two blobs and died before its ``episode-finished`` left; one blob fails
    its checksum at re-adoption (deleted ``lost``). The restarted process's events alone, folded by the ledger,
    agree with its counters: the repeat (``again``) keeps both, the delete ends one. Before, the delete went first,
    so the ledger took the lost blob for one deleted since an earlier event, kept it nowhere, and disagreed."""
    clock = _Clock()
    env = env_server(clock)
    refs = env.keep("ep", [random_arrays(5, seed=1), random_arrays(5, seed=2)])
    assert env.journal is not None
    bad = refs[1].blob_id
    path = env.journal.store.path / next(p for b, _, _, p in env.keeper.blobs() if b == bad).segment
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = _killed_and_restarted(env, env_server, clock)
    assert list(restarted.readoption.lost) == [bad]  # type: ignore[union-attr]
    ledger = Ledger()
    for seq, body in enumerate(restarted._outbox, 1):
        ledger.apply_message(Message(kind=body.kind, body=body,
                                     header=Header(v=PROTOCOL_VERSION, id=f"p2-{seq}", src="env-0", seq=seq, ts=0.0)))
    stats = restarted.stats()
    assert (stats.kept_total, stats.deleted, stats.blobs_held) == (2, {LOST: 1}, 1)
    account = {"seq": len(restarted._outbox), "kept": stats.kept_total, "deleted": dict(stats.deleted),
               "violations": dict(stats.violations)}
    assert ledger.reconcile("env-0", "p2", account, final=False) == "agreed", ledger.report().totals()
    assert (ledger.report().totals()["lost"], ledger.report().totals()["held"]) == (1, 1)
