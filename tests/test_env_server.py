"""The env server as a real process on a real broker: keep, claim, fetch and delete over its ROUTER, the
events that mirror every move, violations, retries, lease expiry, shutdown, bad input, replicas; and the
embedded form driven from a framework's own thread. Events are observed by an in-process node."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import pause
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket, recv_frames
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ledger import Ledger
from refbus.nodes.payload.charges import PAGE_BYTES, blob_charge, info_charge
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.keeper import blob_checksum
from refbus.nodes.settings import EnvServerSettings
from refbus.protocol.envelope import Message, WireCodec, describe, incarnation
from refbus.protocol.messages import (
    Accounted,
    Accounts,
    Blobs,
    Body,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Discard,
    EpisodeFinished,
    Error,
    Fetch,
    Held,
    HoldingsQuery,
    Keep,
    Kept,
    NodeList,
    Nodes,
    Violation,
)

pytest_plugins = ["wire_fixtures"]  # zmq_ctx
WAIT_S = 10.0
PATIENT = RetryPolicy(timeout_s=WAIT_S, attempts=1)
OWNERSHIP_KINDS = frozenset({"episode-finished", "claim", "delete", "violation"})


def branch(tokens: int, *, routing: type = np.uint8, seed: int = 0) -> dict[str, np.ndarray]:
    """Every field of a branch: routing [tokens, 4, 2], top-k [tokens, 3], masks of 0..3 ids per token."""
    return random_arrays(tokens, seed=seed, layers=4, top_k=2, k=3, max_count=3, routing_dtype=routing)


class Observer:
    """An in-process node that queues every ownership event from the bus (its loop runs in a thread)."""

    def __init__(self, control: str) -> None:
        self.runtime = NodeRuntime("observer", RuntimeSettings(bus=control, node_id="observer", metrics_port=-1))
        self.events: queue.Queue[Message] = queue.Queue()
        self.runtime.subscribe(self.events.put, kinds=OWNERSHIP_KINDS)
        self.runtime.start_background()

    def next(self) -> Body:
        try:
            return self.events.get(timeout=WAIT_S).body
        except queue.Empty:
            raise AssertionError(f"no event within {WAIT_S}s") from None


@pytest.fixture
def observer(bus: tuple[NodeProcess, str]) -> Iterator[Observer]:
    watcher = Observer(bus[1])
    yield watcher
    watcher.runtime.join(timeout=WAIT_S)



@pytest.fixture
def peer(zmq_ctx: zmq.Context) -> Callable[[str], Client]:
    """``peer(endpoint)``: a request client (closed with the context)."""
    return lambda endpoint: Client(zmq_ctx, endpoint, WireCodec("tester"), policy=PATIENT)


EnvServerFactory = Callable[..., tuple[NodeProcess, dict[str, Any]]]


@pytest.fixture
def env_server(bus: tuple[NodeProcess, str], spawn: Callable[..., NodeProcess]) -> EnvServerFactory:
    """``env_server(node_id, *flags)``: a ready ``refbus node env-server`` process and its registry entry."""

    def start(node_id: str, *flags: str) -> tuple[NodeProcess, dict[str, Any]]:
        proc = spawn(["node", "env-server", "--bus-control", bus[1], "--node-id", node_id, *FAST_LIVENESS, *flags],
                     node_id)
        return proc, proc.wait_ready(timeout=WAIT_S * 3)

    return start


def ask(client: Client, body: Body) -> Body:
    return client.request(body).body


def refused(client: Client, body: Body) -> RemoteError:
    with pytest.raises(RemoteError) as err:
        client.request(body)
    return err.value


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        return response.read().decode()


def test_keep_claim_fetch_delete_and_violations(env_server: EnvServerFactory, observer: Observer, peer) -> None:
    proc, info = env_server("env-a")
    client = peer(info["endpoints"]["blobs"])
    branches = [branch(50), branch(40, routing=np.uint16, seed=1)]
    episode_info = {"reward": 0.5, "prompt": np.arange(7, dtype=np.int32)}
    kept = ask(client, Keep(episode_id="ep-1", branches=branches, policy_version=3, info=episode_info))
    assert isinstance(kept, Kept)
    ids = [ref.blob_id for ref in kept.refs]
    assert [(r.source, r.endpoint, r.tokens, r.routing_shape) for r in kept.refs] == [
        ("env-a", info["endpoints"]["blobs"], 50, [4, 2]), ("env-a", info["endpoints"]["blobs"], 40, [4, 2])]
    assert info["labels"]["source"] == "env-a"

    finished = observer.next()
    assert isinstance(finished, EpisodeFinished)
    assert (finished.episode_id, finished.source, finished.refs, finished.policy_version) == (
        "ep-1", "env-a", kept.refs, 3)
    assert finished.info["reward"] == 0.5 and finished.info["prompt"].tolist() == list(range(7))

    assert ask(client, Claim(blob_ids=ids, holder="orch")) == Claimed(blob_ids=ids)
    assert observer.next() == Claim(blob_ids=ids, holder="orch")

    fetched = ask(client, Fetch(blob_ids=ids, holder="trainer-0"))
    assert isinstance(fetched, Blobs) and not fetched.missing
    for ref, sent, got in zip(kept.refs, branches, fetched.blobs, strict=True):
        assert got.blob_id == ref.blob_id and list(got.arrays) == list(sent) == ref.fields
        for name, array in sent.items():
            assert got.arrays[name].dtype == array.dtype
            np.testing.assert_array_equal(got.arrays[name], array)
        assert blob_checksum(got.arrays) == ref.checksum

    assert ask(client, Delete(blob_ids=ids[:1], holder="trainer-0", reason="trained")) == Deleted(blob_ids=ids[:1])
    assert observer.next() == Delete(blob_ids=ids[:1], holder="trainer-0", reason="trained")

    again = ask(client, Delete(blob_ids=ids[:1], holder="trainer-1", reason="trained"))
    assert again == Deleted(blob_ids=[], violations=ids[:1])
    violation = observer.next()
    assert isinstance(violation, Violation)
    assert (violation.blob_id, violation.action, violation.holder, violation.owner) == (
        ids[0], "delete", "trainer-1", "trainer-0")

    assert ask(client, Fetch(blob_ids=ids[:1], holder="trainer-1")) == Blobs(blobs=[], missing=ids[:1])
    late = observer.next()
    assert isinstance(late, Violation) and (late.action, late.holder, late.owner) == ("fetch", "trainer-1", "trainer-0")

    metrics = scrape(info["metrics"])
    for line in ('refbus_ownership_violations_total{action="delete"} 1.0',
                 'refbus_ownership_violations_total{action="fetch"} 1.0',
                 'refbus_ownership_violations_total{action="claim"} 0.0',
                 'refbus_blobs_deleted_total{reason="trained"} 1.0', "refbus_blobs_kept_total 2.0",
                 "refbus_blobs_held 1.0",
                 # The live blob and its episode's record, held while a blob of it lives.
                 f"refbus_blob_bytes_held {float(blob_charge(kept.refs[1].nbytes) + info_charge(episode_info))}"):
        assert line in metrics.splitlines(), line
    assert "ownership.violation" in proc.log_tail() and "trainer-1" in proc.log_tail()


def test_a_retried_delete_is_answered_twice_and_executed_once(
    env_server: EnvServerFactory, observer: Observer, peer, zmq_ctx: zmq.Context
) -> None:
    _, info = env_server("env-a")
    endpoint = info["endpoints"]["blobs"]
    (ref,) = ask(peer(endpoint), Keep(episode_id="ep", branches=[branch(8)])).refs
    raw = make_socket(zmq_ctx, zmq.DEALER, connect=endpoint)
    codec = WireCodec("trainer-0")
    frames = codec.encode(Delete(blob_ids=[ref.blob_id], holder="trainer-0", reason="trained"))
    raw.send_multipart(frames)
    raw.send_multipart(frames)  # a retry: same frames, same message id
    replies = []
    for _ in range(2):
        assert raw.poll(WAIT_S * 1000), "no reply"
        replies.append(codec.decode(recv_frames(raw)).body)
    assert replies == [Deleted(blob_ids=[ref.blob_id])] * 2
    ask(peer(endpoint), Keep(episode_id="marker", branches=[branch(1)]))
    kinds = [type(observer.next()).__name__ for _ in range(3)]
    assert kinds == ["EpisodeFinished", "Delete", "EpisodeFinished"]  # one delete, no violation


def test_unclaimed_blobs_are_deleted_as_undelivered(env_server: EnvServerFactory, observer: Observer, peer) -> None:
    # The shortest lease the config allows: above a node timeout, the restart grace and the retry schedule.
    _, info = env_server("env-b", "--requests-timeout-s", "0.6", "--requests-attempts", "2",
                         "--node-restart-grace-s", "0.1", "--env-server-handover-lease-s", "3.0")
    client = peer(info["endpoints"]["blobs"])
    ids = [ref.blob_id for ref in ask(client, Keep(episode_id="ep", branches=[branch(4), branch(5)])).refs]
    assert isinstance(observer.next(), EpisodeFinished)
    assert observer.next() == Delete(blob_ids=ids, holder="env-b", reason="undelivered")
    assert ask(client, Claim(blob_ids=ids, holder="orch")) == Claimed(blob_ids=[], missing=ids)


LEASE_S = 3.0  # the shortest hand-over lease the config allows (see the test above)
STORE_PAUSE_S = 2 * LEASE_S


def test_a_store_stopped_past_the_hand_over_lease_hands_over_what_is_claimed_on_waking(
        env_server: EnvServerFactory, observer: Observer, peer) -> None:
    """An env server process stopped (SIGSTOP) for two hand-over leases right after a keep, then continued, and
    claimed from at once (its claimer paused with it: a host's processes stopped together). Before, its first pass
    on waking deleted the blobs ``undelivered`` and the claim found them missing. The time it did not run counts
    toward no lease (``store.stalled``, ``refbus_env_server_stalled_seconds_total``): the claim takes them all."""
    proc, info = env_server("env-p", "--requests-timeout-s", "0.6", "--requests-attempts", "2",
                            "--node-restart-grace-s", "0.1", "--env-server-handover-lease-s", str(LEASE_S))
    client = peer(info["endpoints"]["blobs"])
    ids = [ref.blob_id for ref in ask(client, Keep(episode_id="ep", branches=[branch(4), branch(5)])).refs]
    assert isinstance(observer.next(), EpisodeFinished)
    pause(proc, STORE_PAUSE_S, stop_within=LEASE_S)  # the lease's end passes meanwhile
    assert ask(client, Claim(blob_ids=ids, holder="orch")) == Claimed(blob_ids=ids, missing=[])
    assert isinstance(observer.next(), Claim)
    stalled = [line for line in scrape(info["metrics"]).splitlines()
               if line.startswith("refbus_env_server_stalled_seconds_total ")]
    assert len(stalled) == 1 and float(stalled[0].split()[1]) >= STORE_PAUSE_S - LEASE_S, stalled
    assert "store.stalled" in proc.log_tail(200)


def test_sigterm_deletes_what_is_held_and_announces_it(env_server: EnvServerFactory, observer: Observer, peer) -> None:
    proc, info = env_server("env-c")
    client = peer(info["endpoints"]["blobs"])
    first = [r.blob_id for r in ask(client, Keep(episode_id="a", branches=[branch(3), branch(4)])).refs]
    second = [r.blob_id for r in ask(client, Keep(episode_id="b", branches=[branch(5)])).refs]
    ask(client, Claim(blob_ids=first, holder="orch"))
    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=WAIT_S) == 0, proc.log_tail()
    assert [type(observer.next()) for _ in range(3)] == [EpisodeFinished, EpisodeFinished, Claim]
    assert observer.next() == Delete(blob_ids=first + second, holder="env-c", reason="shutdown")


def test_bad_input_is_answered_clearly_and_the_node_keeps_serving(
    env_server: EnvServerFactory, observer: Observer, peer, zmq_ctx: zmq.Context
) -> None:
    _, info = env_server("env-d", "--env-server-budget-bytes", str(4 * PAGE_BYTES))  # two blobs: see blob_charge
    endpoint = info["endpoints"]["blobs"]
    client = peer(endpoint)
    raw = make_socket(zmq_ctx, zmq.DEALER, connect=endpoint)
    raw.send_multipart([b"garbage"])
    assert raw.poll(WAIT_S * 1000)
    malformed = WireCodec("x").decode(recv_frames(raw)).body
    assert isinstance(malformed, Error) and malformed.code == "malformed"

    assert ask(client, Delete(blob_ids=["no-such-blob"], holder="orch", reason="filtered")) == Deleted(
        blob_ids=[], missing=["no-such-blob"])
    assert ask(client, Fetch(blob_ids=["no-such-blob"], holder="t")) == Blobs(blobs=[], missing=["no-such-blob"])
    assert ask(client, Claim(blob_ids=["no-such-blob"], holder="o")) == Claimed(blob_ids=[], missing=["no-such-blob"])

    bad_mask = branch(6)
    bad_mask["mask_counts"] = bad_mask["mask_counts"] + 1
    err = refused(client, Keep(episode_id="bad", branches=[branch(2), bad_mask]))
    assert err.code == "bad-branch" and "branch 1: mask_ids" in err.detail
    err = refused(client, Keep(episode_id="bad", branches=[{"routing": np.zeros(3, np.uint8)}]))
    assert err.code == "bad-branch" and "routing" in err.detail
    err = refused(client, Keep(episode_id="big", branches=[branch(64)] * 3))
    assert err.code == "over-budget" and str(4 * PAGE_BYTES) in err.detail and err.retry_after_s == 0  # never fits
    assert ask(client, Discard(episode_id="never-kept")) == Deleted(blob_ids=[])

    (ref,) = ask(client, Keep(episode_id="fits", branches=[branch(4)])).refs
    finished = observer.next()  # the refused keeps announced nothing
    assert isinstance(finished, EpisodeFinished) and finished.episode_id == "fits"
    err = refused(client, Keep(episode_id="later", branches=[branch(64), branch(32)]))  # fits an empty store
    assert err.code == "over-budget" and err.retry_after_s > 0, err
    # The loss reasons carry blame in the ledger: a peer may not use them to delete (or discard) what it does not
    # own without a violation. Refused whole, nothing deleted.
    for reason, node in (("holder-down", ""), ("lost", ""), ("lost", "env-other")):
        err = refused(client, Delete(blob_ids=[ref.blob_id], holder="rank-7", reason=reason, node=node))
        assert err.code == "bad-reason" and reason in err.detail, err
    for reason in ("holder-down", "lost", "undelivered", "shutdown"):
        err = refused(client, Discard(episode_id="fits", reason=reason))
        assert err.code == "bad-reason" and reason in err.detail, err
    # Every reason is one refbus gives deletes: a made-up one is refused whole, nothing deleted (each one counted
    # was a series of refbus_blobs_deleted_total and an entry of `accounted.deleted` for good).
    for made_up in ("fresh", "r000001-" + "x" * 240):
        err = refused(client, Delete(blob_ids=[ref.blob_id], holder="orch", reason=made_up))
        assert err.code == "bad-reason" and "none of refbus's delete reasons" in err.detail, err
        err = refused(client, Discard(episode_id="fits", reason=made_up))
        assert err.code == "bad-reason" and "none of refbus's delete reasons" in err.detail, err
    assert ask(client, Discard(episode_id="fits")) == Deleted(blob_ids=[ref.blob_id])
    assert observer.next() == Delete(blob_ids=[ref.blob_id], holder="env-d", reason="discarded")
    counted = ask(client, Accounts())
    assert isinstance(counted, Accounted) and counted.deleted == {"discarded": 1}, counted
    assert {line.split('"')[1] for line in scrape(info["metrics"]).splitlines()
            if line.startswith("refbus_blobs_deleted_total{")} == {"discarded", "holder-down"}
    # A holder deleting this store's blobs as lost names it (what an orchestrator does once the store is back).
    (lost,) = ask(client, Keep(episode_id="given-up", branches=[branch(4)])).refs
    assert isinstance(observer.next(), EpisodeFinished)
    assert ask(client, Delete(blob_ids=[lost.blob_id], holder="env-d", reason="lost", node="env-d")) == Deleted(
        blob_ids=[lost.blob_id])
    assert observer.next() == Delete(blob_ids=[lost.blob_id], holder="env-d", reason="lost", node="env-d")


def test_tiny_blobs_and_large_infos_meet_the_budget_as_over_budget(
    env_server: EnvServerFactory, peer, tmp_path
) -> None:
    """A durable env server of a 1 MiB budget: one-byte blobs are refused ``over-budget`` (retry later) once their
    pages and per-blob overhead fill the budget, and an episode whose ``info`` does not fit is refused too, an
    honest keep still taken once room comes back. Before, the budget counted array bytes only: 65,000 one-byte
    blobs later every keep failed ``store-failed`` (the process out of mappings), and any ``info`` up to the body
    limit was held, in memory and in the journal, without counting."""
    budget = 1 << 20
    _, info = env_server("env-t", "--env-server-budget-bytes", str(budget), "--store-directory",
                         str(tmp_path / "shm"), "--store-run", "tiny")
    client = peer(info["endpoints"]["blobs"])
    tiny = {"routed_experts": np.ones((1, 1, 1), np.uint8)}
    fits = budget // blob_charge(1)
    refs = ask(client, Keep(episode_id="tiny", branches=[tiny] * (fits - 1))).refs
    err = refused(client, Keep(episode_id="more", branches=[tiny] * 2))
    assert err.code == "over-budget" and err.retry_after_s > 0 and "2 array bytes in 2 blobs" in err.detail, err
    big = np.zeros(budget // 4, np.uint8)  # a quarter of the budget in bytes, more once journaled as a list
    err = refused(client, Keep(episode_id="info", branches=[tiny], info={"a": big}))
    assert err.code == "over-budget" and f"and {info_charge({'a': big})} of info" in err.detail, err
    account = ask(client, Accounts())
    assert isinstance(account, Accounted) and account.kept == fits - 1
    assert ask(client, Discard(episode_id="tiny")) == Deleted(blob_ids=[r.blob_id for r in refs])
    (kept,) = ask(client, Keep(episode_id="honest", branches=[branch(64)], info={"reward": 1.0})).refs
    assert kept.tokens == 64


def test_replicas_of_one_source_register_with_it_and_report_status(
    bus: tuple[NodeProcess, str], env_server: EnvServerFactory, peer
) -> None:
    replicas = {name: env_server(name, "--env-server-source", "rollouts")[1] for name in ("env-r0", "env-r1")}
    (ref,) = ask(peer(replicas["env-r0"]["endpoints"]["blobs"]), Keep(episode_id="ep", branches=[branch(9)])).refs
    assert (ref.source, ref.endpoint) == ("rollouts", replicas["env-r0"]["endpoints"]["blobs"])

    control = peer(bus[1])
    expected = {name: {"blobs": entry["endpoints"]["blobs"]} for name, entry in replicas.items()}
    deadline = time.monotonic() + WAIT_S
    while True:  # the status arrives with the next heartbeat (every 0.2 s): poll the registry
        listed = ask(control, Nodes(role="env-server"))
        assert isinstance(listed, NodeList)
        nodes = {n.node_id: n for n in listed.nodes}
        assert {name: n.endpoints for name, n in nodes.items()} == expected
        assert {n.labels["source"] for n in nodes.values()} == {"rollouts"}
        if (nodes["env-r0"].status.get("blobs_held") == 1.0 and nodes["env-r1"].status) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    budget = EnvServerSettings().budget_bytes
    charged = blob_charge(ref.nbytes)
    assert nodes["env-r0"].status == {"blobs_held": 1.0, "bytes_held": float(charged), "blobs_kept": 1.0,
                                      "blobs_deleted": 0.0, "fill": charged / budget, "full": 0.0,
                                      "budget_bytes": float(budget), "high_water": 0.8}
    assert nodes["env-r1"].status == {"blobs_held": 0.0, "bytes_held": 0.0, "blobs_kept": 0.0, "blobs_deleted": 0.0,
                                      "fill": 0.0, "full": 0.0, "budget_bytes": float(budget), "high_water": 0.8}


def test_embedded_env_server_keeps_from_framework_threads(bus: tuple[NodeProcess, str], observer: Observer) -> None:
    runtime = NodeRuntime("env-server", RuntimeSettings(bus=bus[1], node_id="env-embedded", metrics_port=-1))
    server = EnvServer(runtime, EnvServerSettings(source="embedded"))
    runtime.start_background()
    try:
        refs: dict[str, list[str]] = {}

        def framework_worker(episode: str) -> None:
            refs[episode] = [r.blob_id for r in server.keep(episode, [branch(3), branch(2)], info={"n": 1})]

        workers = [threading.Thread(target=framework_worker, args=(f"ep-{i}",)) for i in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(WAIT_S)
        announced = {}
        for _ in workers:
            event = observer.next()
            assert isinstance(event, EpisodeFinished) and event.source == "embedded"
            announced[event.episode_id] = [r.blob_id for r in event.refs]
        assert announced == refs
        with pytest.raises(ValueError, match="none of refbus's delete reasons"):
            server.discard("ep-0", "made-up")
        assert server.discard("ep-0") == refs["ep-0"]
        assert observer.next() == Delete(blob_ids=refs["ep-0"], holder="embedded", reason="discarded")
    finally:
        runtime.join(timeout=WAIT_S)
    shutdown = observer.next()
    assert isinstance(shutdown, Delete) and shutdown.reason == "shutdown"
    assert sorted(shutdown.blob_ids) == sorted(b for ep in ("ep-1", "ep-2", "ep-3") for b in refs[ep])


def test_the_env_server_path_never_imports_torch() -> None:
    # The role's entry point as the CLI loads it, plus the default score function it imports.
    code = ("import sys, refbus.nodes.cli as cli, refbus.nodes.payload.keeper, refbus.nodes.toy.task; "
            "cli.role_entry('env-server'); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); "
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_accounts_are_the_counters_the_stream_shows_and_hostile_asks_are_refused(
    env_server: EnvServerFactory, observer: Observer, peer, zmq_ctx: zmq.Context
) -> None:
    """The store's counters as of its last event's seq match the ledger's fold of its events exactly; a cap on
    holders folds the rest under ``*``; a malformed or out-of-range ``accounts`` is refused and the store
    goes on serving."""
    _, info = env_server("env-e")
    endpoint = info["endpoints"]["blobs"]
    client = peer(endpoint)
    ids = [r.blob_id for r in ask(client, Keep(episode_id="a", branches=[branch(3), branch(4), branch(2)])).refs]
    ask(client, Keep(episode_id="b", branches=[branch(5)]))
    ask(client, Claim(blob_ids=ids[:2], holder="orch"))
    ask(client, Claim(blob_ids=ids[2:], holder="orch-2"))
    ask(client, Delete(blob_ids=ids[:1], holder="orch", reason="filtered"))
    ask(client, Discard(episode_id="b"))

    reply = client.request(Accounts())
    account = reply.body
    assert account == Accounted(store="env-e", seq=6, kept=4, held=2, deleted={"filtered": 1, "discarded": 1},
                                held_by={"orch": 1, "orch-2": 1}, violations={})
    ledger = Ledger()
    for _ in range(6):
        ledger.apply(describe(observer.events.get(timeout=WAIT_S)))
    reconciled = ledger.reconcile("env-e", incarnation(reply.header.id), msgspec.to_builtins(account), final=False)
    assert reconciled == "agreed"
    assert ledger.report().ok and ledger.report().held["env-e"] == {"orch": 1, "orch-2": 1}

    assert ask(client, Accounts(holders=1)).held_by == {"*": 2}
    codec = WireCodec("hostile")
    raw = make_socket(zmq_ctx, zmq.DEALER, connect=endpoint)
    header = codec.encode(Accounts())[1]
    for frames, code, says in ((codec.encode(Accounts(holders=0)), "schema", "holders"),
                               (codec.encode(Accounts(holders=10**6)), "schema", "holders"),
                               ([b"accounts", header, b"\xc1not msgpack"], "malformed", "")):
        raw.send_multipart(frames)
        assert raw.poll(WAIT_S * 1000), "no reply"
        refusal = codec.decode(recv_frames(raw)).body
        assert isinstance(refusal, Error) and refusal.code == code and says in refusal.message, refusal
    assert ask(client, Accounts()) == account  # nothing changed, and it still serves


def test_holdings_page_through_what_a_holder_held_or_nobody_claimed_and_hostile_asks_are_refused(
    env_server: EnvServerFactory, peer, zmq_ctx: zmq.Context
) -> None:
    """Every episode with a blob held by the holder or unclaimed comes back once, with its record as kept,
    in pages cut by ``limit`` or by bytes (a quarter of the body limit); a malformed, out-of-range or oversized
    ``holdings`` is refused with a clear error and the store goes on serving."""
    _, info = env_server("env-h")
    endpoint = info["endpoints"]["blobs"]
    client = peer(endpoint)
    records = {}
    for index in range(6):
        pad = "x" * 150_000 if index >= 3 else ""  # records of ~150 KB: a page of 256 KB holds one of them
        body = {"group": f"g{index}", "reward": float(index), "pad": pad}
        kept = ask(client, Keep(episode_id=f"ep-{index}", branches=[branch(3), branch(2, seed=index)], info=body))
        assert isinstance(kept, Kept)
        records[f"ep-{index}"] = EpisodeFinished(episode_id=f"ep-{index}", source="env-h", refs=kept.refs, info=body)
    ids = {episode: [ref.blob_id for ref in record.refs] for episode, record in records.items()}
    ask(client, Claim(blob_ids=[*ids["ep-0"], *ids["ep-3"], *ids["ep-4"], ids["ep-5"][0]], holder="orch"))
    ask(client, Claim(blob_ids=ids["ep-1"], holder="orch-2"))
    ask(client, Delete(blob_ids=ids["ep-4"], holder="orch", reason="trained"))

    pages, after, more = [], 0, True
    while more:
        page = ask(client, HoldingsQuery(holder="orch", after=after, limit=3))
        assert isinstance(page, Held) and page.episodes
        pages.append([entry.episode.episode_id for entry in page.episodes])
        listed = {entry.episode.episode_id: entry for entry in page.episodes}
        for episode, entry in listed.items():
            assert entry.episode == records[episode]
        after, more = page.cursor, page.more
    assert pages == [["ep-0", "ep-2", "ep-3"], ["ep-5"]]  # ep-1 is another holder's, ep-4 is gone
    last = ask(client, HoldingsQuery(holder="orch", after=after))
    assert last == Held(episodes=[], cursor=after)
    split = ask(client, HoldingsQuery(holder="orch", after=5))
    assert [(e.held, e.unclaimed) for e in split.episodes] == [([ids["ep-5"][0]], [ids["ep-5"][1]])]
    by_bytes = ask(client, HoldingsQuery(holder="orch", after=3))
    assert [e.episode.episode_id for e in by_bytes.episodes] == ["ep-3"] and by_bytes.more  # 3 + 5: > 256 KB

    codec = WireCodec("hostile")
    raw = make_socket(zmq_ctx, zmq.DEALER, connect=endpoint)
    kind, header = codec.encode(HoldingsQuery(holder="orch"))[:2]
    encode = msgspec.msgpack.encode
    for frames, code, says in ((codec.encode(HoldingsQuery(holder="orch", limit=0)), "schema", "limit"),
                               (codec.encode(HoldingsQuery(holder="orch", limit=10**6)), "schema", "limit"),
                               (codec.encode(HoldingsQuery(holder="")), "schema", "holder"),
                               (codec.encode(HoldingsQuery(holder="x" * 300)), "schema", "holder"),
                               ([kind, header, encode({"after": -1, "holder": "o"})], "schema", "after"),
                               ([kind, header, encode({"after": 0})], "schema", "holder"),
                               ([kind, header, b"\xc1not msgpack"], "malformed", ""),
                               ([kind, header, b"\x81\xa6holder" + b"\xda\xff\xff" + b"o" * (17 << 20)],
                                "too-large", "limit")):
        raw.send_multipart(frames)
        assert raw.poll(WAIT_S * 1000), "no reply"
        refusal = codec.decode(recv_frames(raw)).body
        assert isinstance(refusal, Error) and refusal.code == code and says in refusal.message, refusal
    assert ask(client, HoldingsQuery(holder="orch", after=5)) == split  # nothing changed, and it still serves
    raw.close()
