"""The orchestrator's decisions in-process, on an injected clock, without sockets: state in, actions out.

Each test plays the executor: it feeds :class:`OrchestratorCore` what happened (episodes with the blobs
claimed for them, hand-over and run outcomes, the time) and checks the actions that come back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from refbus.nodes.config import ConfigError
from refbus.nodes.entry_points import UserCodeFailed
from refbus.nodes.payload.charges import episode_charge, info_charge
from refbus.nodes.payload.keeper import Keeper, KeepError, pack_branches
from refbus.nodes.payload.orchestrator_core import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    Action,
    ClaimAgain,
    Deadlines,
    DeleteBlobs,
    DeliverBatch,
    Halt,
    LoseBlobs,
    OrchestratorCore,
    SendRun,
)
from refbus.nodes.payload.prompts import PromptSource, as_prompt_source, load_prompt_source
from refbus.nodes.settings import OrchestratorSettings
from refbus.protocol.messages import BlobRef, EpisodeFinished, HeldEpisode, NodeInfo
from structlog.testing import capture_logs

DEADLINES = Deadlines(delivery_s=30.0, redeliver_after_s=2.0, run_s=44.0)
T0 = 1000.0  # the injected clock's start: anything but zero, so no decision leans on it


def settings(**overrides: object) -> OrchestratorSettings:
    base = dict(seq_len=64, group_size=2, groups_per_step=1, max_staleness=1, trainers=2, group_timeout_s=10.0,
                max_groups_in_flight=4, prompt="refbus.nodes.toy.task:make_prompt")
    return OrchestratorSettings(**{**base, **overrides})  # type: ignore[arg-type]


def trainer(rank: int) -> NodeInfo:
    """A fresh rank's registry entry once it heartbeats: it trains step 0 next."""
    return NodeInfo(node_id=f"trainer-{rank}", role="trainer", host="h", pid=rank, endpoints={"trainer": f"tcp://t{rank}"},
                    labels={"rank": str(rank), "data_rank": str(rank), "leader": "1"}, status={"step": 0.0})


def env_server(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="env-server", host="h", pid=9, endpoints={"blobs": f"tcp://{node_id}"})


def episode(episode_id: str, group: str, reward: float, *, env: str = "env-a") -> EpisodeFinished:
    """One episode with one 8-token routed sample kept on ``env``."""
    ref = BlobRef(endpoint=f"tcp://{env}", source=env, blob_id=f"b-{episode_id}", fields=["routed_experts"],
                  tokens=8, nbytes=96, checksum=1, routing_shape=[3, 2], node=env)
    info = {"group": group, "reward": reward,
            "samples": [{"input_ids": list(range(8)), "loss_mask": [0, 0, 0] + [1] * 5, "ref": 0}]}
    return EpisodeFinished(episode_id=episode_id, source=env, refs=[ref], info=info)


def feed_group(core: OrchestratorCore, now: float, group: str, *, claim: bool = True) -> list[Action]:
    """Both episodes of ``group`` (rewards 1 and 0), each with its blob claimed unless ``claim`` is false."""
    actions: list[Action] = []
    for member, reward in enumerate((1.0, 0.0)):
        ep = episode(f"{group}-{member}", group, reward)
        actions += core.on_episode(now, ep, ep.refs if claim else [])
    return actions


def of(kind: type, actions: Sequence[Action]) -> list:
    return [a for a in actions if isinstance(a, kind)]


def deletes(actions: Sequence[Action]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for action in of(DeleteBlobs, actions):
        out.setdefault(action.reason, []).extend(ref.blob_id for ref in action.refs)
    return out


def shipping_core() -> tuple[OrchestratorCore, list[DeliverBatch]]:
    """A core with two ranks known and step 0 packed: returns its two deliveries."""
    core = OrchestratorCore(settings(), DEADLINES)
    assert core.use_trainers(T0, [trainer(0), trainer(1)]) == []
    deliveries = of(DeliverBatch, feed_group(core, T0, "g0"))
    assert [(d.step, d.endpoint) for d in deliveries] == [(0, "tcp://t0"), (0, "tcp://t1")]
    return core, deliveries


def test_a_failed_hand_over_is_redelivered_as_the_same_step_to_the_rank_that_did_not_acknowledge() -> None:
    core, (to0, to1) = shipping_core()
    owned = set(to0.batch.owned) | set(to1.batch.owned)
    assert owned == set(core.holdings.held)
    assert core.on_delivered(T0 + 0.1, 0, "tcp://t0", None) == []
    assert set(core.holdings.held) == set(to1.batch.owned)  # rank 0 owns its part now
    assert core.on_delivered(T0 + 0.2, 0, "tcp://t1", "[duplicate-step] rank 1 already has step 0") == []
    # While step 0 is undelivered, the next complete group waits: no second step reuses or skips a number.
    assert of(DeliverBatch, feed_group(core, T0 + 0.3, "g1")) == []
    assert core.tick(T0 + 0.2 + DEADLINES.redeliver_after_s - 0.01) == []
    again = core.tick(T0 + 0.2 + DEADLINES.redeliver_after_s)
    assert again == [DeliverBatch(0, "tcp://t1", to1.batch)]  # the same batch, to rank 1 only
    assert again[0].batch is to1.batch
    assert core.redeliveries == 1
    assert core.tick(T0 + 10.0) == []  # in flight: nothing re-sent twice
    next_step = core.on_delivered(T0 + 10.1, 0, "tcp://t1", None)
    assert [(d.step, d.endpoint) for d in of(DeliverBatch, next_step)] == [(1, "tcp://t0"), (1, "tcp://t1")]
    assert not owned & set(core.holdings.held)
    assert core.holdings.handed_over == len(owned)
    assert core.step == 2 and not core.failure


def test_a_step_acknowledged_by_some_ranks_only_halts_at_its_deadline_naming_the_ranks() -> None:
    core, (_, to1) = shipping_core()
    core.on_delivered(T0 + 0.1, 0, "tcp://t0", None)
    now = T0 + 0.1
    while now < T0 + DEADLINES.delivery_s - DEADLINES.redeliver_after_s:
        core.on_delivered(now, 0, "tcp://t1", "no reply from tcp://t1 to step-batch after 3 attempts")
        now += DEADLINES.redeliver_after_s
        assert core.tick(now) == [DeliverBatch(0, "tcp://t1", to1.batch)]
    core.on_delivered(now, 0, "tcp://t1", "no reply")
    actions = core.tick(T0 + DEADLINES.delivery_s)
    # On a deadline, not final: ranks held back by their supervisor may yet come; a restart waits for them again.
    assert of(Halt, actions) == [Halt(core.failure, final=False)]
    assert "trainer ranks [1]" in core.failure and "step 0" in core.failure and "tcp://t1" in core.failure
    # Halted: nothing more ships or runs; what rank 1 never took is still held, deleted at shutdown.
    assert of(DeliverBatch, feed_group(core, T0 + 31, "g1")) == []
    core.use_replicas([env_server("env-a")])
    assert core.dispatch(T0 + 31) == []
    assert core.tick(T0 + 100) == []
    assert core.on_delivered(T0 + 100, 0, "tcp://t1", None) == []  # too late: ignored
    closing = deletes(core.close())
    assert set(closing["shutdown"]) == set(to1.batch.owned) | {"b-g1-0", "b-g1-1"}
    assert not core.holdings.held


def test_an_env_server_that_disappears_loses_its_unclaimed_samples_and_runs_but_not_the_run() -> None:
    core = OrchestratorCore(settings(group_size=1, max_staleness=2), DEADLINES,
                            prompts=lambda rng: [int(rng.integers(9))])
    core.use_trainers(T0, [trainer(0), trainer(1)])
    core.on_version(0)
    # Its claims fail: the samples are counted missing and left out; nothing is held for them.
    gone = episode("lost", "g-lost", 1.0, env="env-gone")
    assert core.on_episode(T0, gone, []) == []
    assert core.sink.dropped["missing"] == 1 and not core.holdings.held
    # Its runs fail (peer down): their groups are abandoned and their slots come back.
    core.use_replicas([env_server("env-gone"), env_server("env-b")])
    sent = of(SendRun, core.dispatch(T0))  # bound: 3 groups (the one filtered above gave back what it took)
    assert [s.endpoint for s in sent] == ["tcp://env-gone", "tcp://env-b", "tcp://env-gone"]  # sources in turn
    core.use_replicas([env_server("env-b")])
    for run in [s for s in sent if s.endpoint == "tcp://env-gone"]:
        core.on_run_done(T0, run.run.episode_id, "tcp://env-gone went down: node-down")
    assert core.failed_runs == 2 and core.abandoned_groups == 2
    resent = of(SendRun, core.dispatch(T0 + 0.1))
    assert [s.endpoint for s in resent] == ["tcp://env-b"] * 2
    assert len(core.groups_running) == 3


def test_runs_never_answered_expire_and_give_their_slots_back() -> None:
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [int(rng.integers(9))])
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    first = of(SendRun, core.dispatch(T0))
    assert len(first) == 2 * 2  # admission: (max_staleness + 0 + 1) * groups_per_step groups of 2 runs
    assert all(s.deadline_s == DEADLINES.run_s for s in first)
    for _ in range(5):  # nothing answers: the bound holds, no slot frees by itself
        assert core.dispatch(T0 + 1) == []
    assert core.tick(T0 + DEADLINES.run_s - 0.01) == []
    core.tick(T0 + DEADLINES.run_s)
    assert core.expired_runs == 4 and not core.runs and not core.groups_running and core.abandoned_groups == 2
    assert core.router.in_flight["tcp://env-a"] == 0
    second = of(SendRun, core.dispatch(T0 + DEADLINES.run_s))
    assert len(second) == 4 and {s.run.group for s in second}.isdisjoint({s.run.group for s in first})
    # The late episodes of an expired run are deleted as late, and its late answer changes nothing.
    late = episode(first[0].run.episode_id, first[0].run.group, 1.0)
    assert deletes(core.on_episode(T0 + 50, late, late.refs)) == {"late": [late.refs[0].blob_id]}
    assert core.on_run_done(T0 + 50, first[0].run.episode_id, None) == [] and core.failed_runs == 4


def test_more_unanswered_runs_than_slots_never_stop_dispatch() -> None:
    """Regression: a run never answered held its slot forever; after ``max_groups_in_flight`` such runs
    dispatch stopped for good."""
    core = OrchestratorCore(settings(max_staleness=100, max_groups_in_flight=16), DEADLINES,
                            prompts=lambda rng: [1])
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    now, groups = T0, 0
    for _ in range(4):
        sent = of(SendRun, core.dispatch(now))
        assert len({s.run.group for s in sent}) == 16
        groups += 16
        now += DEADLINES.run_s
        core.tick(now)
    assert groups == 64 and core.abandoned_groups == 64


def test_an_incomplete_group_expires_and_a_version_bump_widens_admission() -> None:
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1])
    first = episode("a-0", "a", 1.0)
    core.on_episode(T0, first, first.refs)
    assert core.tick(T0 + 10.0) == []
    assert deletes(core.tick(T0 + 10.01)) == {"incomplete": ["b-a-0"]}
    late = episode("a-1", "a", 0.0)
    assert deletes(core.on_episode(T0 + 11, late, late.refs)) == {"late": ["b-a-1"]}
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    assert len(of(SendRun, core.dispatch(T0))) == 2 * 2  # bound 2 groups: the expired one gave back what it took
    assert core.dispatch(T0) == []
    core.on_version(3)
    assert len(of(SendRun, core.dispatch(T0))) == 2 * 2  # max_groups_in_flight (4) stops it now
    core.on_version(1)  # versions only move forward
    assert core.policy_version == 3


def test_why_nothing_is_dispatched_is_said_while_no_run_is_in_flight() -> None:
    """``idle_reason``: what an operator asks of an orchestrator that sends no run, one reason at a time."""
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1])
    assert core.idle_reason(T0)[0] == "no-env-servers"
    core.use_replicas([env_server("env-a")])
    assert core.idle_reason(T0)[0] == "no-version"
    core.on_version(0)
    assert core.idle_reason(T0) == ("", "")  # it would send
    sent = of(SendRun, core.dispatch(T0))
    assert sent and core.idle_reason(T0) == ("", "")  # runs in flight
    for run in sent:  # every group completes and waits for trainer ranks: admitted, not released
        finished = episode(run.run.episode_id, run.run.group, float(run.run.episode_id.endswith("0")))
        core.on_episode(T0 + 1, finished, finished.refs)
        core.on_run_done(T0 + 1, run.run.episode_id, None, "")
    kind, detail = core.idle_reason(T0 + 1)
    assert kind == "admission" and "bound 2 of policy version 0" in detail, detail
    core.on_version(1)
    assert core.idle_reason(T0 + 1) == ("", "")


def test_a_group_whose_blobs_are_all_missing_still_completes_and_ships_without_them() -> None:
    core = OrchestratorCore(settings(trainers=1), DEADLINES)
    core.use_trainers(T0, [trainer(0)])
    ok = episode("m-0", "m", 1.0)
    core.on_episode(T0, ok, ok.refs)
    (deliver,) = of(DeliverBatch, core.on_episode(T0, episode("m-1", "m", 0.0), []))
    assert deliver.batch.owned == ["b-m-0"]
    assert core.sink.dropped["missing"] == 1


@pytest.mark.parametrize("max_steps", [1])
def test_after_the_last_step_the_queue_and_late_episodes_are_dropped(max_steps: int) -> None:
    core = OrchestratorCore(settings(trainers=1, max_steps=max_steps), DEADLINES)
    core.use_trainers(T0, [trainer(0)])
    assert len(of(DeliverBatch, feed_group(core, T0, "g0"))) == 1
    assert core.finished
    assert set(deletes(feed_group(core, T0, "g1"))) == {"max_steps"}
    assert np.isclose(core.sink.dropped["max_steps"], 2)


GRACE = Deadlines(delivery_s=30.0, redeliver_after_s=2.0, run_s=44.0, restart_grace_s=5.0)


def test_a_store_down_past_its_grace_loses_its_blobs_naming_it_and_they_never_ship() -> None:
    core = OrchestratorCore(settings(groups_per_step=2), GRACE)
    feed_group(core, T0, "g0")  # queued (no trainers yet): b-g0-0 and b-g0-1 on env-a
    kept = episode("b0", "gb", 1.0, env="env-b")
    core.on_episode(T0, kept, kept.refs)  # env-b: grouped, waiting for its second member
    assert core.store_down(T0, env_server("env-a")) == []
    # A delete decided while env-a is down waits for it instead of failing against a dead peer.
    stale = episode("late", "g0", 1.0)
    assert core.on_episode(T0 + 1, stale, stale.refs) == []
    assert core.tick(T0 + GRACE.restart_grace_s - 0.01) == []
    lost = of(LoseBlobs, core.tick(T0 + GRACE.restart_grace_s))
    assert [(a.node_id, sorted(r.blob_id for r in a.refs)) for a in lost] == [
        ("env-a", ["b-g0-0", "b-g0-1", "b-late"])]
    assert core.lost == {"env-a": 3} and core.sink.dropped["lost"] == 2
    assert set(core.holdings.held) == {"b-b0"} and core.sink.queue == []
    assert core.groups_released == 1  # the emptied group gives its admission slot back
    assert of(LoseBlobs, core.tick(T0 + 100)) == []  # lost once
    core.use_trainers(T0 + 100, [trainer(0), trainer(1)])
    shipped = of(DeliverBatch, feed_group(core, T0 + 100, "g1") + feed_group(core, T0 + 100, "g2"))
    names = {s.sample_id for d in shipped for mb in d.batch.micro_batches for s in mb.samples}
    assert names and not any(name.startswith("g0-") for name in names)


def test_claims_a_store_died_before_answering_are_named_in_its_loss() -> None:
    """The store may have granted them (its claim event says so) before the reply died with it: its loss names
    them with the held ones, so nothing stays held by this node in the stream."""
    core = OrchestratorCore(settings(), GRACE)
    core.store_down(T0, env_server("env-a"))
    unanswered = episode("u0", "gu", 1.0)
    elsewhere = episode("u1", "gv", 1.0, env="env-b")
    core.claim_unanswered([*unanswered.refs, *elsewhere.refs])  # env-b is up: its failed claim is not unsure
    lost = of(LoseBlobs, core.tick(T0 + GRACE.restart_grace_s))
    assert [(a.node_id, sorted(r.blob_id for r in a.refs)) for a in lost] == [("env-a", ["b-u0"])]
    assert core.lost == {"env-a": 1}


def test_claims_a_store_went_down_before_answering_are_claimed_again_when_it_is_back_and_granted_ones_deleted() -> None:
    """The store may have granted them before it was cut off: back as the same store, it keeps them as this
    node's, so they are claimed again (a repeat is answered ``already``) and what that grants is deleted
    ``claim-failed`` (their episode went on without them). Before, they were forgotten and stayed held there
    for this node, which knew nothing of them."""
    core = OrchestratorCore(settings(), GRACE)
    core.store_down(T0, env_server("env-a"))
    unanswered = episode("u0", "gu", 1.0)
    core.claim_unanswered(unanswered.refs)
    assert core.on_episode(T0, unanswered, []) == []  # fed without its blob: counted missing
    assert core.store_up(env_server("env-a")) == [ClaimAgain(tuple(unanswered.refs))]
    assert deletes(core.claimed_late(unanswered.refs)) == {"claim-failed": ["b-u0"]}
    assert not core.holdings.held and of(LoseBlobs, core.tick(T0 + 100)) == []
    held = episode("h0", "gh", 1.0)
    core.on_episode(T0 + 100, held, held.refs)
    assert core.claimed_late(held.refs) == [] and set(core.holdings.held) == {"b-h0"}  # held here: not a leak


def test_a_store_back_as_the_same_process_keeps_its_blobs_and_gets_the_deletes_that_waited() -> None:
    core = OrchestratorCore(settings(), GRACE)
    feed_group(core, T0, "g0")
    core.store_down(T0, env_server("env-a"))
    late = episode("late", "g0", 1.0)
    assert core.on_episode(T0, late, late.refs) == []
    sent = [DeleteBlobs(tuple(late.refs), "late")]
    assert core.store_up(env_server("env-a")) == sent
    assert of(LoseBlobs, core.tick(T0 + 100)) == [] and not core.lost
    assert set(core.holdings.held) == {"b-g0-0", "b-g0-1"}


def test_a_store_restarted_as_a_new_process_loses_the_old_ones_blobs_at_once() -> None:
    core = OrchestratorCore(settings(), GRACE)
    feed_group(core, T0, "g0")
    core.store_down(T0, env_server("env-a"))
    restarted = NodeInfo(node_id="env-a", role="env-server", host="h", pid=10, endpoints={"blobs": "tcp://env-b2"})
    lost = of(LoseBlobs, core.store_up(restarted))
    assert [(a.node_id, len(a.refs)) for a in lost] == [("env-a", 2)] and not core.holdings.held


def test_a_store_restarted_on_its_readopted_durable_store_keeps_the_blobs_and_gets_the_deletes() -> None:
    core = OrchestratorCore(settings(), GRACE)
    feed_group(core, T0, "g0")
    durable = {"source": "env-a", "store": "s1"}
    core.store_down(T0, msgspec.structs.replace(env_server("env-a"), labels=durable))
    late = episode("late", "g0", 1.0)
    assert core.on_episode(T0, late, late.refs) == []
    restarted = NodeInfo(node_id="env-a", role="env-server", host="h", pid=10, endpoints={"blobs": "tcp://env-b2"},
                         labels=durable)
    assert core.store_up(restarted) == [DeleteBlobs(tuple(late.refs), "late")]
    assert of(LoseBlobs, core.tick(T0 + 100)) == [] and not core.lost
    assert set(core.holdings.held) == {"b-g0-0", "b-g0-1"}
    # a fresh durable store under the same id (another identity) is a new store: the old one's blobs are lost
    core.store_down(T0 + 100, restarted)
    fresh = msgspec.structs.replace(restarted, pid=11, labels={"source": "env-a", "store": "s2"})
    assert [(a.node_id, len(a.refs)) for a in of(LoseBlobs, core.store_up(fresh))] == [("env-a", 2)]


def test_a_store_back_as_the_same_process_after_its_blobs_were_lost_gets_them_deleted_once() -> None:
    """A partition longer than the grace: the store never died, so it still keeps what was declared lost."""
    core = OrchestratorCore(settings(groups_per_step=2), GRACE)
    feed_group(core, T0, "g0")
    core.store_down(T0, env_server("env-a"))
    late = episode("late", "g0", 1.0)
    core.on_episode(T0, late, late.refs)  # a delete that waits for env-a: lost with the rest
    lost = of(LoseBlobs, core.tick(T0 + GRACE.restart_grace_s))
    assert [(a.node_id, len(a.refs)) for a in lost] == [("env-a", 3)]
    back = core.store_up(env_server("env-a"))
    assert [(a.reason, a.node, sorted(r.blob_id for r in a.refs)) for a in of(DeleteBlobs, back)] == [
        ("lost", "env-a", ["b-g0-0", "b-g0-1", "b-late"])]
    assert core.store_up(env_server("env-a")) == []  # once
    # Reported down again while that delete was in flight: it waits, and is not declared lost a second time; back,
    # the store gets it as the request it may have carried out (its id kept).
    core.store_down(T0 + 10, env_server("env-a"))
    assert core.delete_undelivered(dataclasses.replace(of(DeleteBlobs, back)[0], request_id="r-1"))
    assert of(LoseBlobs, core.tick(T0 + 10 + GRACE.restart_grace_s)) == [LoseBlobs((), "env-a")]
    assert core.lost == {"env-a": 3}
    again = of(DeleteBlobs, core.store_up(env_server("env-a")))
    assert [(a.reason, a.node, len(a.refs), a.request_id) for a in again] == [("lost", "env-a", 3, "r-1")]


def test_a_delete_its_store_went_down_before_answering_goes_out_under_its_request_id_when_the_store_is_back() -> None:
    """The store may have carried out the delete before it was reported down: back as the same process (or a
    restart that re-adopted its durable store), it gets that request again, its id kept, and answers it from its
    reply cache. A delete decided while it was down was never sent: a new request. Declared lost first, the
    store gets the refs of that request under its id still (reason ``lost``), the others in a new request.
    Before, every waiting delete went out as a new request: a second delete of blobs the store had deleted,
    which it counts as a violation."""
    core = OrchestratorCore(settings(groups_per_step=2), GRACE)
    feed_group(core, T0, "g0")
    core.store_down(T0, env_server("env-a"))
    sent = episode("sent", "gs", 1.0)
    assert core.delete_undelivered(DeleteBlobs(tuple(sent.refs), "eval", request_id="r-1"))
    late = episode("late", "g0", 1.0)
    assert core.on_episode(T0, late, late.refs) == []
    assert core.store_up(env_server("env-a")) == [DeleteBlobs(tuple(sent.refs), "eval", request_id="r-1"),
                                                  DeleteBlobs(tuple(late.refs), "late")]
    durable = msgspec.structs.replace(env_server("env-a"), labels={"store": "s1"})
    core.store_down(T0, durable)
    assert core.delete_undelivered(DeleteBlobs(tuple(sent.refs), "eval", request_id="r-1"))
    restarted = msgspec.structs.replace(durable, pid=10, endpoints={"blobs": "tcp://env-a2"})
    assert core.store_up(restarted) == [DeleteBlobs(tuple(sent.refs), "eval", request_id="r-1")]
    core.store_down(T0 + 10, restarted)
    assert core.delete_undelivered(DeleteBlobs(tuple(sent.refs), "eval", request_id="r-1"))
    lost = of(LoseBlobs, core.tick(T0 + 10 + GRACE.restart_grace_s))
    assert [(a.node_id, sorted(r.blob_id for r in a.refs)) for a in lost] == [
        ("env-a", ["b-g0-0", "b-g0-1", "b-sent"])]
    back = core.store_up(restarted)
    assert [(a.reason, a.node, sorted(r.blob_id for r in a.refs), a.request_id) for a in back] == [
        ("lost", "env-a", ["b-sent"], "r-1"), ("lost", "env-a", ["b-g0-0", "b-g0-1"], "")]


def test_a_lost_store_back_as_a_new_process_has_nothing_to_delete() -> None:
    core = OrchestratorCore(settings(), GRACE)
    feed_group(core, T0, "g0")
    core.store_down(T0, env_server("env-a"))
    core.tick(T0 + GRACE.restart_grace_s)
    restarted = NodeInfo(node_id="env-a", role="env-server", host="h", pid=10, endpoints={"blobs": "tcp://env-a"})
    assert core.store_up(restarted) == [] and core.store_up(env_server("env-a")) == []


def test_no_run_goes_to_a_store_reported_down_and_a_store_down_at_shutdown_is_lost() -> None:
    core = OrchestratorCore(settings(group_size=1), GRACE, prompts=lambda rng: [int(rng.integers(9))])
    core.use_replicas([env_server("env-a"), env_server("env-b")])
    core.on_version(0)
    core.store_down(T0, env_server("env-a"))
    assert {s.endpoint for s in of(SendRun, core.dispatch(T0))} == {"tcp://env-b"}
    ep = episode("e", "g", 1.0)
    core.on_episode(T0, ep, ep.refs)
    closing = core.close()
    assert deletes(closing) == {} and [(a.node_id, len(a.refs)) for a in of(LoseBlobs, closing)] == [("env-a", 1)]
def ranks_with_budget(steps: Sequence[str]) -> list[NodeInfo]:
    """Trainer ranks as ``refbus node trainer`` registers them: each advertises its ``trainer.steps``."""
    return [msgspec.structs.replace(trainer(rank), labels={**trainer(rank).labels, "steps": budget})
            for rank, budget in enumerate(steps)]


def test_no_run_before_a_version_exists_and_a_committed_version_starts_dispatch() -> None:
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1])
    core.use_replicas([env_server("env-a")])
    assert core.dispatch(T0) == [] and core.dispatch(T0 + 100) == []
    core.on_version(-1)  # the ps-manager's registry entry before its first commit
    assert core.dispatch(T0 + 101) == [] and not core.version_known
    core.on_version(0)
    assert len(of(SendRun, core.dispatch(T0 + 102))) == 2 * 2


def test_not_ready_refusals_back_off_doubling_probe_one_group_and_resume_on_success() -> None:
    core = OrchestratorCore(settings(max_staleness=100), DEADLINES, prompts=lambda rng: [1])
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    sent = of(SendRun, core.dispatch(T0))
    assert len({s.run.group for s in sent}) == 4  # max_groups_in_flight
    # Every run of the burst is refused: one pause (not one per run), no dispatch until it ends.
    for run in sent:
        core.on_run_done(T0 + 0.01, run.run.episode_id, "[no-rollout] no rollout worker", "no-rollout")
    assert core.refused_runs == 8 and core.failed_runs == 8 and not core.groups_running
    assert core.dispatch(T0 + 0.01 + BACKOFF_FIRST_S - 0.001) == []
    pause, now = BACKOFF_FIRST_S, T0 + 0.01
    for _ in range(8):  # each probe is one group, refused again: the pause doubles, up to its bound
        now += pause
        probe = of(SendRun, core.dispatch(now))
        assert len({s.run.group for s in probe}) == 1 and core.dispatch(now) == []
        for run in probe:
            core.on_run_done(now, run.run.episode_id, "[no-weights] no committed weights", "no-weights")
        pause = min(BACKOFF_MAX_S, 2 * pause)
        assert core.dispatch(now + pause - 0.001) == []
    assert pause == BACKOFF_MAX_S
    now += pause
    probe = of(SendRun, core.dispatch(now))
    core.on_run_done(now, probe[0].run.episode_id, None)  # a run went through: full admission again
    assert len({s.run.group for s in of(SendRun, core.dispatch(now))}) == 3
    # Other failures neither pause dispatch nor count as refusals.
    core.on_run_done(now, probe[1].run.episode_id, "[timeout] no generation", "timeout")
    assert len({s.run.group for s in of(SendRun, core.dispatch(now))}) == 1 and core.refused_runs == 8 + 8 * 2


def test_the_step_budget_comes_from_the_trainer_ranks_and_nothing_ships_or_runs_after_it() -> None:
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1])
    assert core.max_steps is None
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    assert core.wants_trainers is False
    assert of(DeliverBatch, feed_group(core, T0, "g0")) == []
    assert core.wants_trainers
    (step0_to0, step0_to1) = of(DeliverBatch, core.use_trainers(T0, ranks_with_budget(["2", "x"])))  # garbage: ignored
    assert core.max_steps == 2
    core.on_delivered(T0, 0, step0_to0.endpoint, None)
    assert of(DeliverBatch, core.on_delivered(T0, 0, step0_to1.endpoint, None)) == []  # no group queued yet
    (_, last) = of(DeliverBatch, feed_group(core, T0, "g1"))
    core.on_delivered(T0, 1, "tcp://t0", None)
    core.on_delivered(T0, 1, last.endpoint, None)
    assert core.finished and core.step == 2
    # The ranks trained their two steps and left: nothing more ships to them and no run starts.
    assert set(deletes(feed_group(core, T0 + 1, "g2"))) == {"max_steps"}
    assert core.dispatch(T0 + 2) == [] and core.tick(T0 + 3) == []


def test_a_configured_max_steps_wins_over_the_ranks_budget() -> None:
    core = OrchestratorCore(settings(max_steps=1), DEADLINES)
    feed_group(core, T0, "g0")
    assert len(of(DeliverBatch, core.use_trainers(T0, ranks_with_budget(["5", "5"])))) == 2
    assert core.max_steps == 1 and core.finished


def ranked(rank: int, **status: float) -> NodeInfo:
    """A trainer rank's registry entry with its heartbeat status."""
    return msgspec.structs.replace(trainer(rank), status=status)


def test_a_restarted_core_waits_for_every_ranks_heartbeat_before_it_takes_its_step() -> None:
    """A trainer world restored from a checkpoint registers before its first heartbeat says the step it resumes
    at. Taking step 0 from those bare entries would ship step 0, refused ``duplicate-step`` at every
    redelivery: the run would stall. Nothing is decided or shipped until every rank has said its step."""
    core = OrchestratorCore(settings(), DEADLINES)
    feed_group(core, T0, "g0")
    bare = [msgspec.structs.replace(trainer(rank), status={}) for rank in (0, 1)]
    assert core.resume_step(bare) is False
    assert core.use_trainers(T0, bare) == [] and core.wants_trainers
    assert core.use_trainers(T0, [ranked(0, step=9), bare[1]]) == []  # one rank has not said yet
    assert (core.step, core.step_resumed) == (0, False)
    deliveries = of(DeliverBatch, core.use_trainers(T0, [ranked(0, step=9), ranked(1, step=9)]))
    assert [d.step for d in deliveries] == [9, 9] and core.resumed


def test_a_restarted_core_resumes_at_the_ranks_step_and_rebuilds_its_groups_from_what_it_held() -> None:
    """Step: the highest of each rank's next step and last received + 1, taken once. Recovered episodes are
    grouped as if they had just finished (their own events, if they come, ignored); only the refs a store
    lists as this holder's or unclaimed are claimed. Groups of the earlier incarnation take admission slots;
    one that never completes is deleted ``incomplete`` with its stragglers ``late``; the budget still ends
    the run at its step; this incarnation's runs carry its tag."""
    core = OrchestratorCore(settings(max_steps=6, max_groups_in_flight=1), DEADLINES,
                            prompts=lambda rng: [1], tag=".new")
    # Rank 0 accepted step 3 and trains it next; rank 1 already started it: 4 comes next, 4 steps admitted.
    core.resume_step([ranked(1, step=4, received=3)])  # not every rank listed: nothing decided yet
    assert (core.step, core.step_resumed) == (0, False)
    core.resume_step([ranked(0, step=3, received=3), ranked(1, step=4, received=3)])
    assert (core.step, core.train_groups_sent, core.resumed) == (4, 4, True)
    core.resume_step([ranked(0, step=9), ranked(1, step=9)])  # once
    assert core.step == 4

    # A store lists one episode of which only the second blob is still this holder's (a rank took the first).
    first, second = episode("x-0", "g7", 1.0), episode("x-0b", "g7", 1.0)
    split = msgspec.structs.replace(first, refs=[*first.refs, *second.refs])
    assert core.reclaimable(HeldEpisode(episode=split, held=["b-x-0b"])) == second.refs
    assert core.reclaimable(HeldEpisode(episode=first, unclaimed=["b-x-0"])) == first.refs
    assert core.reclaimable(HeldEpisode(episode=first)) == []

    # Both episodes of the earlier incarnation's group g7 were held: the group completes again.
    done = [episode("g7-0", "g7", 1.0), episode("g7-1", "g7", 0.0)]
    assert core.recover(T0, done[0], done[0].refs) == []
    assert core.recover(T0, done[1], done[1].refs) == []  # queued: no trainers known yet
    assert core.on_episode(T0, done[0], done[0].refs) == []  # its own event, late: ignored
    assert (core.recovered_episodes, core.episodes, core.adopted_groups) == (2, 2, 1)
    # One episode of g8 was held, the other's run was in flight in the earlier incarnation.
    half = episode("g8-0", "g8", 1.0)
    core.recover(T0, half, half.refs)
    assert core.train_groups_sent == 4 + 2
    (deliver, _) = of(DeliverBatch, core.use_trainers(T0, [ranked(0, step=3, received=3), ranked(1, step=4)]))
    assert deliver.step == 4 and {"b-g7-0", "b-g7-1"} <= set(core.holdings.held)
    # A late episode of an unknown earlier group is grouped too, and deleted once its group times out.
    stray = episode("g9-0", "g9", 0.5)
    core.on_episode(T0 + 1, stray, stray.refs)
    assert core.adopted_groups == 3
    expired = deletes(core.tick(T0 + 1 + settings().group_timeout_s + 0.1))
    assert sorted(expired["incomplete"]) == ["b-g8-0", "b-g9-0"]
    straggler = episode("g9-1", "g9", 0.5)
    assert deletes(core.on_episode(T0 + 20, straggler, straggler.refs)) == {"late": ["b-g9-1"]}

    # This incarnation's runs carry its tag, so they never collide with the earlier one's names.
    core.use_replicas([env_server("env-a")])
    core.on_version(4)
    (run, _) = of(SendRun, core.dispatch(T0 + 20))
    assert (run.run.group, run.run.episode_id) == ("g0.new", "g0.new-0")
    # Step 4 acknowledged, one more group ships step 5, the last of the budget of 6; then nothing ships.
    for endpoint in ("tcp://t0", "tcp://t1"):
        core.on_delivered(T0 + 20, 4, endpoint, None)
    fresh = [msgspec.structs.replace(episode(f"g10-{m}", "g10", float(m)), policy_version=4) for m in (0, 1)]
    shipped = [a for ep in fresh for a in core.on_episode(T0 + 20, ep, ep.refs)]
    assert [d.step for d in of(DeliverBatch, shipped)] == [5, 5]
    assert core.finished and set(deletes(feed_group(core, T0 + 20, "g11"))) == {"max_steps"}


def test_backpressure_no_run_goes_to_a_full_store_and_no_group_starts_while_every_store_is_full() -> None:
    core = OrchestratorCore(settings(max_staleness=100), DEADLINES, prompts=lambda rng: [1])
    full_a = NodeInfo(node_id="env-a", role="env-server", host="h", pid=9, endpoints={"blobs": "tcp://env-a"},
                      labels={"source": "env"}, status={"fill": 0.85, "full": 1.0})
    roomy_b = NodeInfo(node_id="env-b", role="env-server", host="h", pid=9, endpoints={"blobs": "tcp://env-b"},
                       labels={"source": "env"}, status={"fill": 0.1, "full": 0.0})
    core.use_replicas([full_a, roomy_b])
    core.on_version(0)
    sent = of(SendRun, core.dispatch(T0))
    assert sent and {s.endpoint for s in sent} == {"tcp://env-b"}  # the replica with room takes every run
    for run in sent[:-1]:  # the last one stays in flight: it may still free room, so waiting makes sense
        core.on_run_done(T0 + 1, run.run.episode_id, None)

    full_b = NodeInfo(**{**msgspec.structs.asdict(roomy_b), "status": {"fill": 0.9, "full": 1.0}})
    core.use_replicas([full_a, full_b])
    assert core.dispatch(T0 + 2) == [] and core.stores_full and core.full_pauses == 1
    assert core.dispatch(T0 + 3) == [] and core.full_pauses == 1  # one pause, however long
    core.use_replicas([full_a, roomy_b])  # a holder deleted: env-b drained below its high-water mark
    resumed = of(SendRun, core.dispatch(T0 + 4))
    assert resumed and {s.endpoint for s in resumed} == {"tcp://env-b"} and not core.stores_full


def test_backpressure_runs_in_flight_count_against_the_room_under_the_high_water_mark() -> None:
    """Episodes of one charge each, a store whose high-water mark is 8 charges: 8 episodes' worth. With 2
    episodes held (one kept since the last registry read), the next dispatch sends 3 groups of 2 runs, and no
    more until runs finish and their episodes are deleted. An answered run keeps its room until its episode
    counts as held (its answer comes before its episode's event), and an episode kept since the read before
    the last one still counts (the status a read brings may predate it)."""
    core = OrchestratorCore(settings(max_staleness=100, max_groups_in_flight=16), DEADLINES, prompts=lambda rng: [1])
    early = episode("early-0", "early", 1.0)
    charge = float(episode_charge(early))
    status = {"bytes_held": charge, "budget_bytes": 10 * charge, "high_water": 0.8, "full": 0.0}
    store = NodeInfo(node_id="env-a", role="env-server", host="h", pid=9, endpoints={"blobs": "tcp://env-a"},
                     status=status)
    core.use_replicas([store])
    core.on_version(0)
    core.on_episode(T0, early, early.refs)  # kept on env-a
    assert core.router.held["tcp://env-a"] == 2 * charge and core.router.room("tcp://env-a") == 6
    sent = of(SendRun, core.dispatch(T0))
    assert len(sent) == 6 and core.router.room("tcp://env-a") == 0 and core.stores_full
    assert core.dispatch(T0 + 1) == []
    for run in sent[:2]:  # one group's runs came back
        core.on_run_done(T0 + 2, run.run.episode_id, None)
    assert core.router.room("tcp://env-a") == 0 and core.dispatch(T0 + 2) == []  # their episodes are on their way
    for run in sent[:2]:
        kept = episode(run.run.episode_id, run.run.group, 1.0)
        core.on_episode(T0 + 2, kept, kept.refs)
    assert core.router.room("tcp://env-a") == 0  # held now, no longer reserved
    core.use_replicas([store])  # their episodes were deleted meanwhile: the registry still says one held
    assert core.router.room("tcp://env-a") == 0  # but this status may predate the three episodes kept since
    core.use_replicas([store])
    assert len(of(SendRun, core.dispatch(T0 + 3))) == 2 and core.full_pauses == 2  # full again at once


def test_backpressure_counts_an_episode_at_what_its_store_charges_not_its_array_bytes() -> None:
    """Small episodes (a 64-token routing row set, 256 array bytes) against a 1 MiB store: its budget and
    ``bytes_held`` count each blob in whole pages plus an overhead, and each episode's info. The room the
    orchestrator sees after one kept episode matches what the store's keeper still accepts, within one episode,
    not the hundreds of times more that the raw array bytes would admit."""
    budget = 1 << 20
    keeper = Keeper("env-a", "tcp://env-a", budget_bytes=budget, handover_lease_s=60.0)
    branch = {"routed_experts": np.zeros((64, 2, 2), np.uint8)}
    info = {"group": "g0", "reward": 1.0, "samples": [{"input_ids": list(range(64)), "loss_mask": [1] * 64, "ref": 0}]}
    refs = keeper.store("ep-0", pack_branches([branch]), info_charge(info))
    accepted = 0
    with pytest.raises(KeepError) as refused:
        while True:
            keeper.store(f"more-{accepted}", pack_branches([branch]), info_charge(info))
            accepted += 1
    assert refused.value.code == "over-budget"
    core = OrchestratorCore(settings(), DEADLINES)
    core.use_replicas([NodeInfo(node_id="env-a", role="env-server", host="h", pid=9, endpoints={"blobs": "tcp://env-a"},
                                status={"bytes_held": 0.0, "budget_bytes": float(budget), "high_water": 1.0})])
    core.on_episode(T0, EpisodeFinished(episode_id="ep-0", source="env-a", refs=refs, info=info), refs)
    assert abs(core.router.room("tcp://env-a") - accepted) <= 1


def test_backpressure_never_deadlocks_when_the_stores_hold_less_than_a_step() -> None:
    """Every store full, nothing in flight, and the step still needs groups: waiting would free nothing, so
    one group at a time goes (the stores' hard budget still decides what is kept)."""
    core = OrchestratorCore(settings(max_staleness=100, groups_per_step=8), DEADLINES, prompts=lambda rng: [1])
    full = NodeInfo(node_id="env-a", role="env-server", host="h", pid=9, endpoints={"blobs": "tcp://env-a"},
                    status={"bytes_held": 900.0, "budget_bytes": 1000.0, "high_water": 0.8, "full": 1.0})
    core.use_replicas([full])
    core.on_version(0)
    sent = of(SendRun, core.dispatch(T0))
    assert len(sent) == 2 and core.starved == 1  # one group of 2 runs
    assert core.dispatch(T0 + 1) == []  # its runs are in flight: they may still free room
    for run in sent:
        core.on_run_done(T0 + 2, run.run.episode_id, None)
    assert len(of(SendRun, core.dispatch(T0 + 3))) == 2 and core.starved == 2


def _budgeted(node_id: str, held: float, budget: float) -> NodeInfo:
    """An env server of source ``env`` holding ``held`` bytes of ``budget`` (high-water mark 0.8)."""
    return NodeInfo(node_id=node_id, role="env-server", host="h", pid=9, endpoints={"blobs": f"tcp://{node_id}"},
                    labels={"source": "env"}, status={"bytes_held": held, "budget_bytes": budget, "high_water": 0.8})


def test_a_group_started_on_full_stores_reserves_room_under_their_budgets_so_it_can_complete() -> None:
    """Two stores of 3 episodes' budget (2 under the high-water mark): env-a holds 3, env-b 1, nothing in flight.
    Before, the group went one run a store in turn, so env-a, at its budget, took runs that could never keep.
    Now its 3 runs must reserve room under the budgets: env-a has none and env-b room for 2, so none goes (the
    holders free room as they train); with env-a at 2, one goes there and two to env-b."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))
    core = OrchestratorCore(settings(max_staleness=100, group_size=3, groups_per_step=2), DEADLINES,
                            prompts=lambda rng: [1])
    core.router.kept(episode("g-0", "g", 1.0))  # an episode's charge is known
    core.use_replicas([_budgeted("env-a", 3 * charge, 3.2 * charge), _budgeted("env-b", charge, 3.2 * charge)])
    core.on_version(0)
    assert core.dispatch(T0) == [] and core.starved == 0 and not core.failure  # waits for holders to delete
    core.use_replicas([_budgeted("env-a", 2 * charge, 3.2 * charge), _budgeted("env-b", charge, 3.2 * charge)])
    sent = of(SendRun, core.dispatch(T0 + 1))
    assert sorted(s.endpoint for s in sent) == ["tcp://env-a", "tcp://env-b", "tcp://env-b"] and core.starved == 1
    assert core.router.room("tcp://env-a", hard=True) == core.router.room("tcp://env-b", hard=True) == 0


def test_a_store_registered_again_has_no_room_until_its_first_heartbeat_says_what_it_holds() -> None:
    """A store restarted on its durable store holds what it held, but registers before its first heartbeat: with
    no status it would seem to publish no budget (room without bound). It gets none until its status comes."""
    core = OrchestratorCore(settings(), DEADLINES)
    core.router.kept(episode("g-0", "g", 1.0))
    charge = core.router.episode_bytes
    core.use_replicas([_budgeted("env-a", 3 * charge, 3.2 * charge)])
    restarted = NodeInfo(node_id="env-a", role="env-server", host="h", pid=10, endpoints={"blobs": "tcp://env-a2"})
    core.use_replicas([restarted])
    assert core.router.room("tcp://env-a2") == core.router.room("tcp://env-a2", hard=True) == 0
    assert core.router.capacity(3) == 3  # its budget still counts
    core.use_replicas([NodeInfo(**{**msgspec.structs.asdict(restarted), "status": {
        "bytes_held": 0.0, "budget_bytes": 3.2 * charge, "high_water": 0.8}})])
    assert core.router.room("tcp://env-a2", hard=True) == 3


def test_before_an_episodes_charge_is_known_one_group_runs_at_a_time() -> None:
    """Room cannot be reserved without an episode's charge: the first group runs alone, and once its episodes
    are in, as many groups start as the stores' room holds."""
    charge = float(episode_charge(episode("g0-0", "g0", 1.0)))
    core = OrchestratorCore(settings(max_staleness=100, max_groups_in_flight=8), DEADLINES, prompts=lambda rng: [1])
    core.use_replicas([_budgeted("env-a", 0.0, 10 * charge)])
    core.on_version(0)
    first = of(SendRun, core.dispatch(T0))
    assert {s.run.group for s in first} == {"g0"} and core.dispatch(T0) == []
    for send, reward in zip(first, (1.0, 0.0), strict=True):
        core.on_run_done(T0 + 1, send.run.episode_id, None)
        kept = episode(send.run.episode_id, "g0", reward)
        core.on_episode(T0 + 1, kept, kept.refs)
    assert len(of(SendRun, core.dispatch(T0 + 1))) == 6  # 8 episodes under the high-water mark, 2 held


def test_stores_whose_budgets_cannot_hold_one_step_halt_the_run_saying_what_would() -> None:
    """Two stores of 3 episodes' budget, a step of 4 groups of 2: once they hold all they can and nothing is in
    flight, no step could ever ship. It halts, naming the numbers and the budget that would hold a step; a store
    reported down still counts (it may come back), and stores that hold a step together only wait."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))
    full = [_budgeted(name, 3 * charge, 3.2 * charge) for name in ("env-a", "env-b")]
    roomy = OrchestratorCore(settings(max_staleness=100, groups_per_step=3), DEADLINES, prompts=lambda rng: [1])
    core = OrchestratorCore(settings(max_staleness=100, groups_per_step=4), DEADLINES, prompts=lambda rng: [1])
    for c in (roomy, core):
        c.router.kept(episode("g-0", "g", 1.0))
        c.use_replicas(full)
        c.on_version(0)
    assert roomy.dispatch(T0) == [] and not roomy.failure  # 6 episodes hold a step of 3 groups of 2
    roomy.store_down(T0, full[1])
    assert roomy.dispatch(T0 + 1) == [] and not roomy.failure  # env-b may come back: 6 still
    grace = DEADLINES.restart_grace_s  # for a store registering late to be counted
    assert core.dispatch(T0 + 1) == [] and core.dispatch(T0 + 1 + grace - 0.01) == [] and not core.failure
    kind, detail = core.idle_reason(T0 + 1 + grace - 0.01)
    assert kind == "budget-short" and detail.startswith("the 2 env servers seen cannot hold one step"), detail
    (halt,) = core.dispatch(T0 + 1 + grace)
    assert isinstance(halt, Halt) and halt.reason == core.failure and halt.final  # a restart decides it again
    assert core.failure.startswith("the env servers' budgets hold 6 episodes in whole groups of 2 at one source "
                                   "each (2 stores, 1 sources, an episode charged ")
    assert "one step needs 8 (groups_per_step 4 x group_size 2): no step can ever ship" in core.failure
    assert core.failure.endswith(f"Raise env_server.budget_bytes to at least {4 * math.ceil(charge)} or lower "
                                 "orchestrator.groups_per_step to at most 3")
    assert core.dispatch(T0 + 2 + grace) == [] and core.idle_reason(T0 + 2 + grace) == ("halted", core.failure)


def test_a_store_that_registers_within_the_grace_after_the_budgets_seen_fell_short_is_counted_and_nothing_halts(
        ) -> None:
    """A step of 4 groups of 2 and one store of 3 episodes seen, full, nothing in flight: the budgets seen hold 3
    episodes of the 8 a step needs. Before, the run halted at once, for good, though a second and third env
    server (a slow host's) were only late to register. Now the halt waits ``restart_grace_s``; a store that
    registers within it is counted (here enough: none halts), and a shortfall that lasts it still halts."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))
    grace = DEADLINES.restart_grace_s
    core = OrchestratorCore(settings(max_staleness=100, groups_per_step=4), DEADLINES, prompts=lambda rng: [1])
    core.router.kept(episode("g-0", "g", 1.0))
    core.on_version(0)
    first = _budgeted("env-a", 3 * charge, 3.2 * charge)
    core.use_replicas([first])
    assert core.dispatch(T0) == [] and core.idle_reason(T0)[0] == "budget-short"
    late = [_budgeted(name, 0.0, 3.2 * charge) for name in ("env-b", "env-c")]
    core.use_replicas([first, *late])  # registered before the grace ended
    sent = of(SendRun, core.dispatch(T0 + grace - 0.5))
    assert sent and not core.failure and core.idle_reason(T0 + grace)[0] != "budget-short"
    assert not of(Halt, core.dispatch(T0 + 2 * grace)) and not core.failure  # counted: nothing halts

    alone = OrchestratorCore(settings(max_staleness=100, groups_per_step=4), DEADLINES, prompts=lambda rng: [1])
    alone.router.kept(episode("g-0", "g", 1.0))
    alone.on_version(0)
    alone.use_replicas([first])
    assert alone.dispatch(T0) == []
    alone.use_replicas([first, _budgeted("env-b", 3 * charge, 3.2 * charge)])  # a store late, full too: short still
    assert alone.dispatch(T0 + grace - 0.01) == [] and not alone.failure  # the set changed: its grace starts over
    assert alone.dispatch(T0 + 2 * grace - 0.02) == [] and not alone.failure
    (halt,) = alone.dispatch(T0 + 2 * grace)
    assert isinstance(halt, Halt) and "(2 stores, 1 sources" in alone.failure, alone.failure


def test_a_step_halts_when_no_source_can_hold_a_group_though_the_stores_together_hold_a_step() -> None:
    """A group's runs all keep at one source. Three empty stores, each its own source, of 2.5 episodes' budget;
    groups of 3, 2 a step: together they hold 6 episodes, one step's worth, but no source holds one group, so no
    group could ever start. Before, the halt counted the budgets together: dispatch sent nothing, forever, and
    its idle reason blamed holders that held nothing. It halts, counting per source in whole groups, and names
    a budget that holds a step."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))

    def empty(node_id: str) -> NodeInfo:
        return NodeInfo(node_id=node_id, role="env-server", host="h", pid=9, endpoints={"blobs": f"tcp://{node_id}"},
                        labels={"source": node_id},
                        status={"bytes_held": 0.0, "budget_bytes": 2.5 * charge, "high_water": 0.8})

    core = OrchestratorCore(settings(max_staleness=100, group_size=3, groups_per_step=2), DEADLINES,
                            prompts=lambda rng: [1])
    core.router.kept(episode("g-0", "g", 1.0, env="elsewhere"))  # its charge is known; held at no store here
    core.use_replicas([empty(name) for name in ("env-a", "env-b", "env-c")])
    core.on_version(0)
    assert core.dispatch(T0) == []  # short: another store may yet register
    (halt,) = core.dispatch(T0 + DEADLINES.restart_grace_s)
    assert isinstance(halt, Halt) and halt.reason == core.failure
    assert core.router.capacity(3) == 0 and core.router.capacity(2) == 6
    assert core.failure.startswith("the env servers' budgets hold 0 episodes in whole groups of 3 at one source "
                                   "each (3 stores, 3 sources, an episode charged ")
    # 3 episodes a store: two sources hold the step's two groups, and no lower groups_per_step would do
    assert core.failure.endswith(f"no step can ever ship. Raise env_server.budget_bytes to at least "
                                 f"{3 * math.ceil(charge)}")
    assert core.idle_reason(T0 + DEADLINES.restart_grace_s + 1) == ("halted", core.failure)


def test_stores_that_hold_a_step_only_counted_per_source_in_whole_groups_wait_saying_for_what() -> None:
    """Per source in whole groups: two replicas of one source, 2.5 episodes' budget each, hold 5 episodes
    together, one group of 3 (not 5 of the 6 a step of 2 groups needs: it halts); a third store, its own source,
    of 3.2 episodes holds the other group, so the run waits. What it waits for is said: holders to delete what
    the stores hold, or a store down to come back, never holders when nothing is held."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))

    def store(node_id: str, source: str, held: float, budget: float) -> NodeInfo:
        return NodeInfo(node_id=node_id, role="env-server", host="h", pid=9, endpoints={"blobs": f"tcp://{node_id}"},
                        labels={"source": source},
                        status={"bytes_held": held * charge, "budget_bytes": budget * charge, "high_water": 0.8})

    pair = [store("env-a1", "a", 1, 2.5), store("env-a2", "a", 1, 2.5)]  # room for 1 + 1 under the budgets
    short = OrchestratorCore(settings(max_staleness=100, group_size=3, groups_per_step=2), DEADLINES,
                             prompts=lambda rng: [1])
    short.router.kept(episode("g-0", "g", 1.0, env="elsewhere"))
    short.use_replicas(pair)
    short.on_version(0)
    assert short.dispatch(T0) == []  # short: another store may yet register
    (halt,) = short.dispatch(T0 + DEADLINES.restart_grace_s)
    assert isinstance(halt, Halt)
    assert short.failure.endswith("Raise env_server.budget_bytes to at least "
                                  f"{3 * math.ceil(charge)} or lower orchestrator.groups_per_step to at most 1")

    core = OrchestratorCore(settings(max_staleness=100, group_size=3, groups_per_step=2), DEADLINES,
                            prompts=lambda rng: [1])
    core.router.kept(episode("g-0", "g", 1.0, env="elsewhere"))
    env_b = store("env-b", "b", 1, 3.2)  # room for 2
    core.use_replicas([*pair, env_b])
    core.on_version(0)
    assert core.dispatch(T0) == [] and not core.failure
    kind, detail = core.idle_reason(T0)
    assert kind == "stores-full" and detail.startswith("no source has room for a group of 3 under its stores' ")
    assert detail.endswith(f"waiting for holders to delete what the stores hold ({3 * charge:.0f} bytes)")
    core.store_down(T0, env_b)  # it may come back: its budget counts
    core.use_replicas([store("env-a1", "a", 0, 2.5)])  # env-a2 is gone from the registry too; nothing held
    assert core.dispatch(T0 + 1) == [] and not core.failure
    kind, detail = core.idle_reason(T0 + 1)
    assert kind == "stores-full" and "holders" not in detail
    assert detail.endswith("waiting for env-a2, env-b to come back (down; their budgets count)")
    assert core.router.capacity(3) == 6 and short.router.capacity(3) == 3


class _Heard:
    """A prompt source in class form that records what the core tells it."""

    def __init__(self) -> None:
        self.heard: list[tuple[tuple[int, ...], list[float]]] = []
        self.made = 0

    def make_prompt(self, rng: np.random.Generator) -> list[int]:
        self.made += 1
        return [self.made]

    def observe(self, prompt: Sequence[int], rewards: Sequence[float]) -> None:
        self.heard.append((tuple(prompt), list(rewards)))


def test_the_prompt_source_hears_each_completed_training_group_with_its_prompt_and_rewards() -> None:
    heard = _Heard()
    core = OrchestratorCore(settings(eval_every=1, max_groups_in_flight=3), DEADLINES,
                            prompts=PromptSource(heard.make_prompt, heard.observe))
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    runs = of(SendRun, core.dispatch(T0))
    groups: dict[str, list[SendRun]] = {}
    for send in runs:
        groups.setdefault(send.run.group, []).append(send)
    evaluation, done, failed = groups  # the eval group first, then the two training groups admission allows
    assert [groups[g][0].run.prompt for g in groups] == [[1], [2], [3]]
    for send, reward in zip(groups[done], (0.25, 0.75), strict=True):
        ep = episode(send.run.episode_id, done, reward)
        core.on_episode(T0 + 1, ep, ep.refs)
    for send in groups[evaluation]:
        ep = episode(send.run.episode_id, evaluation, 1.0)
        ep.info["eval"] = True
        core.on_episode(T0 + 1, ep, ep.refs)
    core.on_run_done(T0 + 1, groups[failed][0].run.episode_id, "boom")  # abandoned: nothing to hear
    assert heard.heard == [((2,), [0.25, 0.75])]


def test_a_prompt_function_is_a_source_that_hears_nothing_and_a_class_must_make_prompts() -> None:
    source = as_prompt_source(lambda rng: [7])
    assert source.make_prompt(np.random.default_rng(0)) == [7]
    source.observe([7], [1.0])  # heard by nobody
    assert source.numbers() == {}

    class Noisy:
        def make_prompt(self, rng: np.random.Generator) -> list[int]:
            return [1]

        def status(self) -> dict[str, object]:
            return {"level": 3, "name": "x", "on": True, "share": 0.5}

    assert as_prompt_source(Noisy).numbers() == {"level": 3.0, "share": 0.5}  # numbers only
    assert as_prompt_source(source) is source

    class NoPrompts:
        pass

    class NeedsArguments:
        def __init__(self, level: int) -> None:
            self.level = level

        def make_prompt(self, rng: np.random.Generator) -> list[int]:
            return [self.level]

    class Unready:
        def __init__(self) -> None:
            raise ValueError("its data file is still being written")

        def make_prompt(self, rng: np.random.Generator) -> list[int]:
            return [1]

    for bad in (NoPrompts, NeedsArguments, 42):
        with pytest.raises(ConfigError, match="prompt source"):
            as_prompt_source(bad)
    # What the user's code raises while built is a crash, never a config error (a ValueError): restartable.
    with pytest.raises(UserCodeFailed, match="still being written") as failed:
        as_prompt_source(Unready)
    assert not isinstance(failed.value, ValueError)
    for spec in ("no-colon", "refbus.nodes.toy.task:missing", "refbus.nodes.toy.task:TASK"):
        with pytest.raises(ValueError):
            load_prompt_source(spec)
    assert isinstance(load_prompt_source("refbus.nodes.toy.task:Curriculum").make_prompt(np.random.default_rng(0)),
                      list)


def with_info(ep: EpisodeFinished, **changes: object) -> EpisodeFinished:
    """``ep`` with ``changes`` applied to its first sample's entry (key ``reward``/``samples``: to the record)."""
    info = dict(ep.info)
    sample = dict(info["samples"][0])
    for key, value in changes.items():
        if key in ("reward", "samples"):
            info[key] = value
        elif value is None:
            del sample[key]
        else:
            sample[key] = value
    if "samples" not in changes:
        info["samples"] = [sample]
    return msgspec.structs.replace(ep, info=info)


MALFORMED_RECORDS = {
    "loss_mask shorter than input_ids": {"loss_mask": [0, 0, 0, 1, 1, 1, 1]},
    "loss_mask longer than input_ids": {"loss_mask": [1] * 9},
    "no token ids": {"input_ids": [], "loss_mask": []},
    "token ids not integers": {"input_ids": ["a"] * 8},
    "token ids nested": {"input_ids": [[1, 2]] * 8},
    "ref out of range": {"ref": 1},
    "ref not an index": {"ref": "0"},
    "more tokens than the blob": {"input_ids": list(range(9)), "loss_mask": [1] * 9},
    "reward not a number": {"reward": "high"},
    "reward NaN": {"reward": float("nan")},
    "reward infinite": {"reward": float("-inf")},
    "samples not a list": {"samples": {"input_ids": [1]}},
    "sample not a map": {"samples": [[1, 2, 3]]},
}


@pytest.mark.parametrize("changes", list(MALFORMED_RECORDS.values()), ids=list(MALFORMED_RECORDS))
def test_a_malformed_record_is_deleted_malformed_before_training_and_its_group_abandoned(changes: dict) -> None:
    """Regression: a record packing or batching could not use (a loss_mask of another length than its token
    ids) was taken and queued, then made the step's packing raise after its groups had left the queue: they
    were never shipped nor deleted and their admission slots never came back."""
    core = OrchestratorCore(settings(groups_per_step=2), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    assert of(DeliverBatch, feed_group(core, T0, "A")) == []  # queued: the step needs two groups
    good = episode("B-0", "B", 1.0)
    assert core.on_episode(T0, good, good.refs) == []
    bad = with_info(episode("B-1", "B", 0.0), **changes)
    assert deletes(core.on_episode(T0, bad, bad.refs)) == {"malformed": ["b-B-1"], "incomplete": ["b-B-0"]}
    assert core.malformed_episodes == 1 and core.abandoned_groups == 1 and "B" in core.closed_groups
    assert set(core.holdings.held) == {"b-A-0", "b-A-1"}
    straggler = episode("B-2", "B", 0.0)
    assert deletes(core.on_episode(T0, straggler, straggler.refs)) == {"late": ["b-B-2"]}
    # Shipping goes on: the next complete group makes the step.
    (to0, to1) = of(DeliverBatch, feed_group(core, T0 + 1, "C"))
    assert set(to0.batch.owned) | set(to1.batch.owned) == {"b-A-0", "b-A-1", "b-C-0", "b-C-1"}
    # An eval episode's malformed record is deleted the same way, and abandons nothing.
    evaluation = msgspec.structs.replace(bad, episode_id="E-0", info={**bad.info, "eval": True},
                                         refs=[msgspec.structs.replace(bad.refs[0], blob_id="b-E-0")])
    assert deletes(core.on_episode(T0 + 2, evaluation, evaluation.refs)) == {"malformed": ["b-E-0"]}
    assert core.malformed_episodes == 2 and core.abandoned_groups == 1


def with_branches(ep: EpisodeFinished, branches: int) -> EpisodeFinished:
    """``ep`` keeping ``branches`` blobs (``b-<id>``, ``b-<id>.1``, ...) on its store; its samples unchanged."""
    extra = [msgspec.structs.replace(ep.refs[0], blob_id=f"{ep.refs[0].blob_id}.{index}")
             for index in range(1, branches)]
    return msgspec.structs.replace(ep, refs=[ep.refs[0], *extra])


def test_claimed_blobs_no_sample_points_to_are_deleted_unreferenced_at_once() -> None:
    """Regression: every claimed blob was taken, but only those a sample points to ever shipped or dropped; a
    blob of an episode with more branches than samples, of a record without samples, or of an eval episode
    without samples stayed held by the orchestrator (and kept in its store) until shutdown."""
    core = OrchestratorCore(settings(), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    actions: list[Action] = []
    for member, reward in enumerate((1.0, 0.0)):  # each episode kept two branches, its one sample points to one
        ep = with_branches(episode(f"A-{member}", "A", reward), 2)
        actions += core.on_episode(T0, ep, ep.refs)
    assert deletes(actions) == {"unreferenced": ["b-A-0.1", "b-A-1.1"]}
    deliveries = of(DeliverBatch, actions)
    assert sorted(blob_id for d in deliveries for blob_id in d.batch.owned) == ["b-A-0", "b-A-1"]
    for d in deliveries:
        core.on_delivered(T0, 0, d.endpoint, None)
    assert not core.holdings.held
    # A training record without samples: its blob goes, the episode still counts in its group.
    bare = with_info(episode("B-0", "B", 1.0), samples=[])
    assert deletes(core.on_episode(T0 + 1, bare, bare.refs)) == {"unreferenced": ["b-B-0"]}
    assert "B" in core.groups and not core.holdings.held
    # An eval episode without samples.
    scored = msgspec.structs.replace(episode("E-0", "E", 1.0), info={"group": "E", "eval": True})
    assert deletes(core.on_episode(T0 + 2, scored, scored.refs)) == {"unreferenced": ["b-E-0"]}
    assert not core.holdings.held and core.unreferenced_blobs == 4


def test_a_group_that_makes_packing_fail_waits_for_the_next_step_or_is_deleted_malformed() -> None:
    """Regression: groups of a step whose packing raised (routed samples of two routing shapes, a sample id
    twice) had left the queue already: never shipped nor deleted. Now the step ships without the group that
    broke it: one of another routing shape (a store of another model) ships at the next step, first; one that
    repeats a sample id is deleted ``malformed`` and gives its admission slot back."""
    core = OrchestratorCore(settings(groups_per_step=3), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])

    def shaped(group: str, shape: list[int]) -> list[Action]:
        actions: list[Action] = []
        for member, reward in enumerate((1.0, 0.0)):
            ep = episode(f"{group}-{member}", group, reward)
            ep = msgspec.structs.replace(ep, refs=[msgspec.structs.replace(ep.refs[0], routing_shape=shape)])
            actions += core.on_episode(T0, ep, ep.refs)
        return actions

    assert shaped("A", [3, 2]) == [] and shaped("B", [4, 2]) == []  # a store of another model
    actions = feed_group(core, T0, "C")
    assert deletes(actions) == {}
    (to0, to1) = of(DeliverBatch, actions)
    assert set(to0.batch.owned) | set(to1.batch.owned) == {"b-A-0", "b-A-1", "b-C-0", "b-C-1"}
    assert [[s.sample_id for s in group] for group in core.sink.queue] == [["B-0/0", "B-1/0"]]  # next, first
    assert core.sink.dropped["malformed"] == 0 and core.groups_released == 0
    assert set(core.holdings.held) == {f"b-{g}-{m}" for g in "ABC" for m in (0, 1)}
    for endpoint in ("tcp://t0", "tcp://t1"):
        core.on_delivered(T0 + 1, 0, endpoint, None)
    assert shaped("G", [4, 2]) == []
    actions = shaped("H", [4, 2])  # B ships at the next step, first, with the groups of its own shape
    owned = {b for d in of(DeliverBatch, actions) for b in d.batch.owned}
    assert owned == {f"b-{g}-{m}" for g in "BGH" for m in (0, 1)} and deletes(actions) == {}
    assert core.sink.queue == []
    for endpoint in ("tcp://t0", "tcp://t1"):
        core.on_delivered(T0 + 2, 1, endpoint, None)

    # The same episode twice (its sample ids repeat): the later group is deleted, the step ships.
    feed_group(core, T0 + 2, "D")
    again = with_info(msgspec.structs.replace(episode("D-0", "E", 1.0), refs=[]), ref=-1)  # no arrays
    assert core.on_episode(T0 + 1, again, []) == []
    other = episode("E-1", "E", 0.0)
    assert core.on_episode(T0 + 1, other, other.refs) == []  # the step waits for a third group
    actions = feed_group(core, T0 + 1, "F")
    assert deletes(actions) == {"malformed": ["b-E-1"]}
    shipped = {s.sample_id for d in of(DeliverBatch, actions) for mb in d.batch.micro_batches for s in mb.samples}
    assert shipped == {"D-0/0", "D-1/0", "F-0/0", "F-1/0"}
    assert core.sink.dropped["malformed"] == 2 and core.groups_released == 1  # E only: B shipped


def test_a_nan_reward_never_reaches_the_trainer_ranks() -> None:
    """Regression: one NaN reward made its whole group's advantages NaN, and they shipped (the weights went
    NaN and were pushed to every rollout worker). Rewards too large to normalise are refused the same way."""
    core = OrchestratorCore(settings(group_size=4), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    actions: list[Action] = []
    for member, reward in enumerate((1.0, 0.0, float("nan"), 0.5)):
        ep = episode(f"A-{member}", "A", reward)
        actions += core.on_episode(T0, ep, ep.refs)
    assert deletes(actions) == {"malformed": ["b-A-2"], "incomplete": ["b-A-0", "b-A-1"], "late": ["b-A-3"]}
    assert of(DeliverBatch, actions) == []
    actions = []
    for member in range(4):
        ep = episode(f"H-{member}", "H", 1.7e308 if member % 2 else 1.6e308)
        actions += core.on_episode(T0, ep, ep.refs)
    assert deletes(actions) == {"malformed": [f"b-H-{member}" for member in range(4)]}
    assert of(DeliverBatch, actions) == [] and core.groups_released == 2
    actions = []
    for member, reward in enumerate((1.0, 0.0, 0.0, 0.5)):
        ep = episode(f"C-{member}", "C", reward)
        actions += core.on_episode(T0, ep, ep.refs)
    (to0, to1) = of(DeliverBatch, actions)
    advantages = [mb.inputs["advantages"] for d in (to0, to1) for mb in d.batch.micro_batches]
    assert all(np.isfinite(a).all() for a in advantages)


@pytest.mark.parametrize("reward", [0.1, 0.2, 0.7])
def test_a_group_whose_rewards_are_all_equal_is_filtered_whatever_their_value(reward: float) -> None:
    """Regression: the mean of three equal rewards rounds off them (0.1 three times has a mean of
    0.10000000000000002), so the group's advantages were about 1e-11 instead of 0: it shipped as a whole step
    that learns nothing, its tokens diluting the token mean and trained on the entropy bonus alone."""
    core = OrchestratorCore(settings(group_size=3), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    actions: list[Action] = []
    for member in range(3):
        ep = episode(f"Q-{member}", "Q", reward)
        actions += core.on_episode(T0, ep, ep.refs)
    assert of(DeliverBatch, actions) == []
    assert deletes(actions) == {"filtered": [f"b-Q-{member}" for member in range(3)]}
    assert core.sink.dropped["filtered"] == 3 and not core.holdings.held


@pytest.mark.parametrize("seq_len", [8, 64], ids=["on-two-ranks", "on-one-rank"])
def test_a_blob_two_samples_share_is_owned_by_one_leader_once(seq_len: int) -> None:
    """Regression: samples of one episode may share a blob (the same ``ref`` index); packed onto two data ranks,
    both leaders owned it and both deleted it (the second delete is an ownership violation); on one rank it
    was listed twice."""
    core = OrchestratorCore(settings(seq_len=seq_len), DEADLINES)
    core.use_trainers(T0, [trainer(0), trainer(1)])
    actions: list[Action] = []
    for member, reward in enumerate((1.0, 0.0)):
        ep = episode(f"A-{member}", "A", reward)
        ep = with_info(ep, samples=[ep.info["samples"][0], dict(ep.info["samples"][0])])
        actions += core.on_episode(T0, ep, ep.refs)
    deliveries = of(DeliverBatch, actions)
    owned = [blob_id for d in deliveries for blob_id in d.batch.owned]
    assert sorted(owned) == ["b-A-0", "b-A-1"]
    referenced = {s.ref.blob_id for d in deliveries for mb in d.batch.micro_batches for s in mb.samples}
    assert referenced == {"b-A-0", "b-A-1"}
    for d in deliveries:
        core.on_delivered(T0, 0, d.endpoint, None)
    assert not core.holdings.held and core.holdings.handed_over == 2


def test_closed_groups_are_forgotten_after_the_horizon_and_a_later_straggler_is_still_deleted() -> None:
    """Regression: every closed group id was kept for the whole run (~92 MiB per million groups). Now each is
    kept for ``closed_horizon_s``, derived from the run deadline, the restart grace and the group timeout; a
    straggler within it is deleted ``late``, one after it opens a group that times out ``incomplete``. Either
    way the admission slots stay even."""
    core = OrchestratorCore(settings(), DEADLINES, prompts=lambda rng: [1], tag=".t")
    horizon = core.closed_horizon_s
    assert horizon == 2 * (DEADLINES.run_s + DEADLINES.restart_grace_s + settings().group_timeout_s)
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    runs = of(SendRun, core.dispatch(T0))
    assert [r.run.group for r in runs] == ["g0.t", "g0.t", "g1.t", "g1.t"]
    first = episode("g0.t-0", "g0.t", 1.0)
    core.on_episode(T0 + 1, first, first.refs)
    abandoned = core.on_run_done(T0 + 1, "g0.t-1", "boom")  # g0 abandoned at T0 + 1
    assert deletes(abandoned) == {"incomplete": ["b-g0.t-0"]}
    for member, reward in enumerate((1.0, 0.0)):  # g1 complete at T0 + 2 (queued: no trainers)
        ep = episode(f"g1.t-{member}", "g1.t", reward)
        core.on_episode(T0 + 2, ep, ep.refs)
    assert list(core.closed_groups) == ["g0.t", "g1.t"]
    outstanding = core.train_groups_sent - core.groups_released
    late = episode("g0.t-1", "g0.t", 0.0)
    assert deletes(core.on_episode(T0 + 1 + horizon - 1, late, late.refs)) == {"late": ["b-g0.t-1"]}
    core.tick(T0 + 1 + horizon)
    assert list(core.closed_groups) == ["g1.t"]
    core.tick(T0 + 2 + horizon)
    assert core.closed_groups == {}
    # Forgotten: a straggler opens its group again, which never completes and is deleted when it times out.
    later = episode("g1.t-2", "g1.t", 0.5)
    now = T0 + 3 + horizon
    assert deletes(core.on_episode(now, later, later.refs)) == {}
    assert core.tick(now + settings().group_timeout_s) == []
    assert deletes(core.tick(now + settings().group_timeout_s + 0.01)) == {"incomplete": ["b-g1.t-2"]}
    assert core.train_groups_sent - core.groups_released == outstanding
    # Many groups later, only those of the last horizon are remembered.
    for index in range(1000):
        core.abandon(now + index, f"old{index}")
    core.tick(now + 1000 + horizon / 2)
    assert len(core.closed_groups) == int(horizon / 2) - 1  # those closed within the horizon before the tick


def test_answered_runs_whose_episodes_never_come_give_their_room_and_slot_back() -> None:
    """A group's runs all answered ok, their episodes never fed (the events lost): once ``episode_wait_s`` passed
    since the answers, their room is free and the group abandoned (its slot back), so the next group starts.
    Before, the group was in no timer (one times out from its first episode): room and slot stayed taken and
    dispatch waited for good. An episode fed before its run's answer changes nothing: its group still waits."""
    charge = float(episode_charge(episode("g-0", "g", 1.0)))
    core = OrchestratorCore(settings(max_staleness=0, group_size=2), DEADLINES, prompts=lambda rng: [1])
    core.router.kept(episode("x-0", "x", 1.0, env="elsewhere"))
    core.use_replicas([_budgeted("env-a", 0.0, 3 * charge)])  # room for one group under the high-water mark
    core.on_version(0)
    wait_s = core.settings.group_timeout_s + DEADLINES.restart_grace_s  # episode_wait_s
    sent = of(SendRun, core.dispatch(T0))
    assert len(sent) == 2 and core.router.room("tcp://env-a") == 0
    for run in sent:
        core.on_run_done(T0 + 1, run.run.episode_id, None)
    core.tick(T0 + 1 + wait_s - 0.01)
    assert len(core.router.reserved) == 2 and core.dispatch(T0 + 20) == []
    core.tick(T0 + 1 + wait_s)
    assert not core.router.reserved and core.abandoned_groups == 1
    again = of(SendRun, core.dispatch(T0 + 30))
    assert len(again) == 2 and {s.run.group for s in again} != {s.run.group for s in sent}
    first, second = again
    core.on_episode(T0 + 31, episode(first.run.episode_id, first.run.group, 1.0), [])  # before its answer
    core.on_run_done(T0 + 31, first.run.episode_id, None)
    with capture_logs() as logs:
        core.tick(T0 + 31 + wait_s)
    assert [entry["episode_id"] for entry in logs if entry["event"] == "run.episode_not_come"] == []
    assert list(core.router.reserved) == [second.run.episode_id]  # in flight: its deadline decides


def test_an_episode_finished_that_comes_again_is_never_grouped_twice_nor_deletes_what_it_brought() -> None:
    """The same ``episode-finished`` fed twice, its claim granted again (a repeat by its holder is answered
    ``already``). Into its open group: ignored, so the group still waits for its other member. After its group
    completed and queued for a step: its blob is the queued sample's, not deleted ``late``. Before, the first
    completed the group with the episode twice (one reward twice, its other member dropped ``late``), the second
    deleted a blob still queued to ship."""
    core = OrchestratorCore(settings(groups_per_step=2), DEADLINES)
    first = episode("g1-0", "g1", 1.0)
    assert core.on_episode(T0, first, first.refs) == []
    assert deletes(core.on_episode(T0, first, first.refs)) == {} and "g1" in core.groups
    assert core.duplicate_episodes == 1
    second = episode("g1-1", "g1", 0.0)
    core.on_episode(T0, second, second.refs)
    assert [[s.sample_id for s in group] for group in core.sink.queue] == [["g1-0/0", "g1-1/0"]]
    assert deletes(core.on_episode(T0 + 1, first, first.refs)) == {}
    assert sorted(core.holdings.held) == ["b-g1-0", "b-g1-1"] and not core.sink.dropped["late"]


def test_an_episode_with_no_blob_granted_never_halts_the_run_on_the_size_it_claims() -> None:
    """A store of 10 episodes' budget, steps of 2 groups of 2. An episode whose blobs no store granted (a forged
    one: a TiB at that store's endpoint) is fed: admission still counts the charge the kept episodes had, and runs
    go. Before, its size became the mean charge: no group fit anywhere, and the run halted for good (budgets that
    cannot hold a step)."""
    core = OrchestratorCore(settings(max_staleness=100, groups_per_step=2), DEADLINES, prompts=lambda rng: [1])
    charge = float(episode_charge(episode("y-0", "y", 1.0)))
    core.router.kept(episode("y-0", "y", 1.0, env="elsewhere"))
    core.use_replicas([_budgeted("env-a", 0.0, 10 * charge)])
    core.on_version(0)
    forged = episode("forged-0", "f", 1.0, env="ghost")
    forged = msgspec.structs.replace(forged, refs=[msgspec.structs.replace(forged.refs[0], nbytes=1 << 40,
                                                                           endpoint="tcp://env-a")])
    core.on_episode(T0, forged, [])
    assert core.router.episode_bytes == charge and core.router.room("tcp://env-a") == 8
    actions = core.dispatch(T0 + 1)
    assert not of(Halt, actions) and len(of(SendRun, actions)) == 8 and not core.failure


def test_groups_this_core_did_not_send_take_the_admission_slot_their_closing_gives_back() -> None:
    """Episodes of groups this core never sent (any peer's, or an earlier incarnation's runs finishing at a restart
    that found nothing to recover) are grouped; each takes an admission slot, which its closing (expired,
    filtered) gives back, so five of them closed leave the bound of one group as it was. Before, they took none
    and gave one back each: five groups more than the bound went out, for good."""
    core = OrchestratorCore(settings(max_staleness=0, groups_per_step=1), DEADLINES, prompts=lambda rng: [1],
                            tag=".me")
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    assert len(of(SendRun, core.dispatch(T0))) == 2  # the bound: one group
    for n in range(5):
        foreign = episode(f"x{n}-0", f"x{n}", 1.0)
        core.on_episode(T0, foreign, foreign.refs)
    core.tick(T0 + settings().group_timeout_s + 0.1)
    assert core.abandoned_groups == 5 and of(SendRun, core.dispatch(T0 + 11)) == []


def test_an_eval_run_that_fails_gives_no_training_slot_back() -> None:
    """An eval group takes no admission slot, so its runs failing (answered with an error, or expired) give none
    back: at a bound of one group, the training group in flight stays the only one. Before, each failed eval
    group was counted abandoned, and one training group more than the bound went out, for good."""
    core = OrchestratorCore(settings(max_staleness=0, eval_every=1), DEADLINES, prompts=lambda rng: [1])
    core.use_replicas([env_server("env-a")])
    core.on_version(0)
    sent = of(SendRun, core.dispatch(T0))
    evals = [s for s in sent if s.run.eval]
    assert len(evals) == 2 and len(sent) == 4
    for run in evals:
        core.on_run_done(T0 + 1, run.run.episode_id, "boom")
    assert core.failed_runs == 2 and core.abandoned_groups == 0
    assert of(SendRun, core.dispatch(T0 + 2)) == []
