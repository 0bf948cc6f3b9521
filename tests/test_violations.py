"""One ``violation`` event per refused request, however many ids it names: ``summarize`` (pure), the wire form
(older readers still parse it, bad counts are refused), a real env server refusing a delete of 50,000 deleted ids
(one event; its counters, its metric, the ledger and ``refbus up``'s summary all say 50,000), a durable env server
SIGKILLed between committing such a refusal (of 5,000 ids: every kept blob costs a durable store a segment file,
and the count changes nothing on that path) and publishing it (the ledger counts it once, from the restarted
store's counters), and garbage counts on the live stream (refused, the ledger goes on)."""

from __future__ import annotations

import json
import queue
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket, send_frames
from refbus.nodes.config import Config
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ledger import Ledger, reconcile_stores
from refbus.nodes.payload.violations import summarize
from refbus.nodes.up import SETTLE_S, RunRecord, _summary
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.errors import SchemaError
from refbus.protocol.messages import (
    VIOLATION_SAMPLE,
    Accounted,
    Accounts,
    Blobs,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Fetch,
    FetchAck,
    Keep,
    Kept,
    RunEnd,
    Violation,
)
from test_ledger import spawn_live_ledger

pytest_plugins = ["wire_fixtures"]  # zmq_ctx
WAIT_S = 10.0
PATIENT = RetryPolicy(timeout_s=WAIT_S * 3, attempts=1)
IDS = 50_000  # deleted ids one hostile delete names
CHUNK = 5_000  # blobs kept (and deleted) per request; the ids refused by the store that is killed
STALLER = Path(__file__).with_name("stalled_env_server.py")


def _violation(blob_id: str, owner: str = "trainer-0", action: str = "delete", holder: str = "trainer-1") -> Violation:
    return Violation(blob_id=blob_id, action=action, holder=holder, owner=owner, detail=f"{blob_id} of {owner}")


# --- summarize, the wire form ---------------------------------------------------------------------------


def test_summarize_makes_one_violation_per_action_holder_and_owner() -> None:
    ids = [f"b-{i:x}" for i in range(IDS)]
    (one,) = summarize([_violation(i) for i in ids])
    assert (one.blob_id, one.count, one.sample) == (ids[0], IDS, ids[:VIOLATION_SAMPLE])
    assert one.detail == f"{ids[0]} of trainer-0"
    assert (one.action, one.holder, one.owner) == ("delete", "trainer-1", "trainer-0")

    mixed = [_violation("a"), _violation("b", "trainer-2"), _violation("c"), _violation("d", action="fetch")]
    groups = summarize(mixed)
    assert [(g.action, g.owner, g.blob_id, g.count, g.sample) for g in groups] == [
        ("delete", "trainer-0", "a", 2, ["a", "c"]), ("delete", "trainer-2", "b", 1, ["b"]),
        ("fetch", "trainer-0", "d", 1, ["d"])]
    assert summarize(groups) == groups and summarize([]) == []
    # Summaries of summaries add their counts and fill the sample up to its bound, in order.
    halves = [*summarize([_violation(i) for i in ids[:10]]), *summarize([_violation(i) for i in ids[10:30]])]
    assert [(g.count, g.sample) for g in summarize(halves)] == [(30, ids[:VIOLATION_SAMPLE])]


class _OlderViolation(msgspec.Struct, frozen=True):
    """``violation`` as a reader older than ``count`` and ``sample`` declares it."""

    blob_id: str
    action: str
    holder: str
    owner: str
    detail: str


def test_a_summarized_violation_reads_as_one_of_its_first_blob_to_an_older_reader_and_bad_counts_are_refused() -> None:
    codec = WireCodec("env-0")
    (event,) = summarize([_violation(f"b{i}") for i in range(40)])
    message = codec.decode(codec.encode(event, seq=1))
    assert message.body == event and (event.count, len(event.sample)) == (40, VIOLATION_SAMPLE)
    older = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=_OlderViolation)
    assert (older.blob_id, older.owner) == ("b0", "trainer-0")
    # A single refusal encodes as before the fields existed: count and sample are left out at their defaults.
    plain = _violation("b0")
    assert set(msgspec.msgpack.decode(msgspec.msgpack.encode(plain))) == {"blob_id", "action", "holder", "owner",
                                                                          "detail"}
    for bad in (msgspec.structs.replace(plain, count=0), msgspec.structs.replace(plain, count=-1),
                msgspec.structs.replace(plain, count="many"),  # type: ignore[arg-type]
                msgspec.structs.replace(plain, sample=[str(i) for i in range(VIOLATION_SAMPLE + 1)])):
        with pytest.raises(SchemaError, match=r"count|sample"):
            codec.decode(codec.encode(bad, seq=2))


# --- a real env server ----------------------------------------------------------------------------------


def _keep_and_delete(client: Client, total: int) -> list[str]:
    """``total`` one-token blobs kept, claimed and deleted by trainer-0, ``CHUNK`` at a time: what a later delete
    by another holder names is then already deleted, a violation each, owned (first deleted) by trainer-0."""
    ids: list[str] = []
    block = np.ones((CHUNK, 1, 1, 1), np.uint8)
    for n in range(total // CHUNK):
        kept = client.request(Keep(episode_id=f"ep-{n}", branches=[{"routed_experts": block[i]} for i in range(CHUNK)]))
        assert isinstance(kept.body, Kept)
        batch = [ref.blob_id for ref in kept.body.refs]
        assert client.request(Claim(blob_ids=batch, holder="trainer-0")).body == Claimed(blob_ids=batch)
        deleted = client.request(Delete(blob_ids=batch, holder="trainer-0", reason="trained")).body
        assert deleted == Deleted(blob_ids=batch)
        ids += batch
    return ids


class _Watch:
    """What ``refbus up``'s launcher runs: a registered node folding the whole stream into a :class:`RunRecord`
    (its ledger bounded by the config's ``limits.max_items``), and a non-registering one that reads the stores'
    counters. Also queues every ``violation`` event."""

    def __init__(self, control: str) -> None:
        self.record = RunRecord(ledger=Ledger(max_count=Config().limits.max_items))
        self.violations: queue.Queue[Violation] = queue.Queue()
        self.watcher = NodeRuntime("monitor", RuntimeSettings(bus=control, node_id="watcher", metrics_port=-1))
        self.watcher.subscribe(self._on_event, since=0)
        self.watcher.start_background()
        self.probe = NodeRuntime("probe", RuntimeSettings(bus=control, node_id="probe", metrics_port=-1),
                                 register=False)

    def _on_event(self, message: Message) -> None:
        self.record.on_event(message)
        if isinstance(message.body, Violation):
            self.violations.put(message.body)

    def next_violation(self) -> Violation:
        try:
            return self.violations.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"no violation event within {WAIT_S}s") from None

    def saw(self, condition: Callable[[Ledger], bool], what: str) -> None:
        wait_for(lambda: self.record.saw(condition), WAIT_S * 3, what)

    def reconcile(self) -> list[str]:
        return reconcile_stores(self.probe, self.record.reconcile, lambda: time.sleep(SETTLE_S))

    def close(self) -> None:
        self.probe.close()
        self.watcher.join(timeout=WAIT_S)


@pytest.fixture
def watch(bus: tuple[NodeProcess, str]) -> Iterator[_Watch]:
    watching = _Watch(bus[1])
    yield watching
    watching.close()


def _summary_of(record: RunRecord) -> dict:
    return _summary(record, 0, Config(), interrupted=False, failed=[], problems=[])


def accounted(client: Client) -> Accounted:
    """An env server's counters (its ``accounted`` reply)."""
    reply = client.request(Accounts()).body
    assert isinstance(reply, Accounted)
    return reply


def test_a_delete_naming_50000_deleted_ids_is_one_event_and_every_count_says_50000(
        bus: tuple[NodeProcess, str], spawn, watch: _Watch, zmq_ctx: zmq.Context) -> None:
    proc = spawn(["node", "env-server", "--bus-control", bus[1], "--node-id", "env-v", *FAST_LIVENESS,
                  "--store-durable", "false"], "env-v")
    info = proc.wait_ready(timeout=WAIT_S * 3)
    client = Client(zmq_ctx, info["endpoints"]["blobs"], WireCodec("tester"), policy=PATIENT)
    ids = _keep_and_delete(client, IDS)

    reply = client.request(Delete(blob_ids=[*ids, "never-kept"], holder="trainer-1", reason="trained")).body
    assert reply == Deleted(blob_ids=[], violations=ids, missing=["never-kept"])  # the reply names every id
    # One fetch of a deleted blob after it: its event is the very next violation on the stream.
    assert client.request(Fetch(blob_ids=ids[:1], holder="trainer-2")).body == Blobs(blobs=[], missing=ids[:1])
    event = watch.next_violation()
    assert (event.action, event.holder, event.owner, event.blob_id) == ("delete", "trainer-1", "trainer-0", ids[0])
    assert (event.count, event.sample) == (IDS, ids[:VIOLATION_SAMPLE])
    after = watch.next_violation()
    assert (after.action, after.holder, after.count, after.sample) == ("fetch", "trainer-2", 1, ids[:1])

    assert accounted(client).violations == {"delete": IDS, "fetch": 1}
    with urllib.request.urlopen(info["metrics"], timeout=WAIT_S) as response:
        metrics = response.read().decode().splitlines()
    assert f'refbus_ownership_violations_total{{action="delete"}} {float(IDS)}' in metrics
    logged = [line for line in proc.log_tail(200).splitlines() if "ownership.violation" in line]
    assert len(logged) == 2 and f'"count": {IDS}' in logged[0], logged

    watch.saw(lambda ledger: ledger.violated == IDS + 1, "the ledger folding both violation events")
    assert watch.reconcile() == []
    report = watch.record.report()
    assert report.reconciled == {"env-v": "agreed"}  # the fold's count is the store's, in ids
    assert report.totals()["violations"] == IDS + 1 and len(report.violations) == 2
    assert f"refused delete of {IDS} blobs ({ids[0]} first) by trainer-1" in report.violations[0]
    assert _summary_of(watch.record)["blobs"]["violations"] == IDS + 1


def test_a_store_killed_between_committing_a_refusal_and_publishing_it_is_counted_once_after_its_restart(
        bus: tuple[NodeProcess, str], spawn, watch: _Watch, zmq_ctx: zmq.Context, tmp_path: Path) -> None:
    """The env server refuses a delete of 5,000 deleted ids, commits the refusal to its journal and is SIGKILLed
    before the event goes out (no reply either). Nothing is silently lost: the restarted process (same node id,
    same durable store) counts on from the journal, and reconciling adds the 5,000 the stream never showed to
    the ledger, named as such. Nothing is counted twice: the earlier process's fold and the restarted one's
    counters are one store, and the ledger says 5,000, not 10,000."""
    store = ["--bus-control", bus[1], "--node-id", "env-v", *FAST_LIVENESS, "--store-directory",
             str(tmp_path / "shm"), "--store-run", "violations", "--env-server-budget-bytes", str(64 << 20)]
    marker = tmp_path / "stalled"
    first = spawn(["node", "env-server", *store], "env-v",
                  prefix=[sys.executable, str(STALLER), "violations", str(marker)])
    info = first.wait_ready(timeout=WAIT_S * 3)
    client = Client(zmq_ctx, info["endpoints"]["blobs"], WireCodec("tester"), policy=PATIENT)
    ids = _keep_and_delete(client, CHUNK)
    watch.saw(lambda ledger: ledger.report().totals()["deleted_total"] == CHUNK, "the ledger folding the deletes")

    hostile = make_socket(zmq_ctx, zmq.DEALER, connect=info["endpoints"]["blobs"])
    send_frames(hostile, WireCodec("trainer-1").encode(Delete(blob_ids=ids, holder="trainer-1", reason="trained")))
    wait_for(marker.exists, WAIT_S * 3, "the env server stalled before publishing the refusal")
    first.proc.kill()
    first.proc.wait(timeout=WAIT_S)

    second = spawn(["node", "env-server", *store], "env-v")
    restarted = second.wait_ready(timeout=WAIT_S * 3)
    assert "store.readopted" in second.log_tail(200)
    again = Client(zmq_ctx, restarted["endpoints"]["blobs"], WireCodec("tester"), policy=PATIENT)
    assert accounted(again).violations == {"delete": CHUNK}  # committed before the kill, counted once
    # The ledger has folded the restarted process's node-up (same store label: the same store goes on).
    wait_for(lambda: watch.record.joined.get("env-v", (0, 0.0))[0] == second.pid, WAIT_S * 3,
             "the restarted store's node-up")
    assert watch.violations.empty()  # the killed process never published the refusal

    assert watch.reconcile() == []
    report = watch.record.report()
    assert report.violations == [f"env-v counted {CHUNK} violations the stream did not show"]
    totals = report.totals()
    assert (totals["violations"], totals["kept"], totals["deleted_total"], totals["lost"]) == (CHUNK, CHUNK, CHUNK, 0)
    assert report.reconciled["env-v"].startswith("corrected") and f"violations={CHUNK}" in report.reconciled["env-v"]
    assert _summary_of(watch.record)["blobs"]["violations"] == CHUNK


def test_a_store_killed_between_answering_a_claim_and_publishing_it_claims_again_after_its_restart(
        bus: tuple[NodeProcess, str], spawn, watch: _Watch, zmq_ctx: zmq.Context, tmp_path: Path) -> None:
    """The env server grants a claim, commits and answers it, and is SIGKILLed before the turn's batch with its
    ``claim`` event goes out. The restarted process (same node id and durable store) publishes the claims of
    what it re-adopted, so the holder's later deletes are no violations to the ledger. Before, the stream never
    showed the claim and the ledger reported every such delete as a violation (a chaos soak's two)."""
    store = ["--bus-control", bus[1], "--node-id", "env-c", *FAST_LIVENESS, "--store-directory",
             str(tmp_path / "shm"), "--store-run", "claims", "--env-server-budget-bytes", str(64 << 20),
             "--env-server-handover-lease-s", "600"]
    marker = tmp_path / "stalled"
    first = spawn(["node", "env-server", *store], "env-c",
                  prefix=[sys.executable, str(STALLER), "claimed", str(marker)])
    client = Client(zmq_ctx, first.wait_ready(timeout=WAIT_S * 3)["endpoints"]["blobs"], WireCodec("orch"),
                    policy=PATIENT)
    block = np.ones((3, 1, 1, 1), np.uint8)
    kept = client.request(Keep(episode_id="ep", branches=[{"routed_experts": row} for row in block])).body
    assert isinstance(kept, Kept)
    ids = [ref.blob_id for ref in kept.refs]
    watch.saw(lambda ledger: ledger.report().totals()["kept"] == 3, "the ledger folding the keep")
    assert client.request(Claim(blob_ids=ids[:2], holder="orchestrator")).body == Claimed(blob_ids=ids[:2])
    wait_for(marker.exists, WAIT_S * 3, "the env server stalled before publishing the claim")
    first.proc.kill()
    assert first.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    client.close()

    second = spawn(["node", "env-server", *store], "env-c")
    again = Client(zmq_ctx, second.wait_ready(timeout=WAIT_S * 3)["endpoints"]["blobs"], WireCodec("orch"),
                   policy=PATIENT)
    assert again.request(Delete(blob_ids=ids[:2], holder="orchestrator", reason="filtered")).body == \
        Deleted(blob_ids=ids[:2])
    watch.saw(lambda ledger: ledger.report().totals()["deleted_total"] == 2, "the ledger folding the deletes")
    assert watch.reconcile() == []
    report = watch.record.report()
    assert report.violations == [] and report.held == {"env-c": {"env-c": 1}}, report
    totals = report.totals()
    assert (totals["kept"], totals["deleted_total"], totals["held"], totals["violations"]) == (3, 2, 1, 0)


# --- garbage counts on the live stream ------------------------------------------------------------------


def test_garbage_counts_are_refused_and_the_live_ledger_goes_on(bus: tuple[NodeProcess, str], spawn,
                                                                tmp_path: Path) -> None:
    """A forged store publishes violations counting 0, -1, a string and 2**40 ids, then a valid one of 3. The
    decoder refuses the first three (``schema``: the ledger sees them as missing events of that source), the
    ledger refuses 2**40 (more ids than one request can name: ``ledger.violation_refused``, counted); the live
    ``refbus ledger`` keeps folding, counts the 3, and at run-end reports the refusal as unaccounted (exit 1)."""
    control = bus[1]
    out_path = tmp_path / "ledger.json"
    ledger = spawn_live_ledger(spawn, control, out_path)
    forger = NodeRuntime("forger", RuntimeSettings(bus=control, node_id="forger", metrics_port=-1))
    forger.start_background()
    try:
        events = []
        for count in (0, -1, "many", 2**40, 3):
            # A fetch-ack between them: each violation its own message (a batch is read or refused whole).
            events += [Violation(blob_id="b", action="delete", holder="t", owner="o", detail="forged", count=count),
                       FetchAck(step=0, holder="t", blob_ids=[])]

        def publish() -> None:
            for event in events:
                forger.publish(event)
            forger.publish(RunEnd(reason="done"))

        forger.call_soon(publish)
        assert ledger.proc.wait(timeout=WAIT_S * 3) == 1, ledger.log_tail()
    finally:
        forger.join(timeout=WAIT_S)
    report = json.loads(out_path.read_text())
    assert report["total"]["violations"] == 3 and report["refused"] == {"forger": 1}, report
    assert report["missed"] == {"forger": 3} and report["ended"] is True and report["ok"] is False
    assert any("violation events refused" in line for line in report["unaccounted"]), report["unaccounted"]
    log = ledger.log_tail(200)
    assert "ledger.violation_refused" in log and str(2**40) in log
    assert log.count('"code": "schema"') == log.count("at `$.count`") == 3, log  # each says what is wrong
