"""The arrays-by-reference path end to end, every role a real process on loopback.

Cast: a broker; env servers ``env-0`` and ``env-1`` (``refbus node env-server``); ``env-flaky``, an env
server embedded in this process whose fetches all come back missing; ``refbus node orchestrator`` (2 trainer
ranks, ``seq_len`` 64, groups of 2 episodes, 4 samples a step, staleness bound 1); two trainer ranks
(spawned processes joined by gloo) that run ``TrainerRank.begin_step``/``end_step`` and dump what they
trained; and this test, which keeps episodes on the env servers (``keep`` requests) and moves the policy
version (``version-bump`` from an in-process node).

Story, at policy version 0: an eval episode (deleted, ``eval``) and a group whose rewards are all equal
(deleted, ``filtered``); then step 0: routed samples with and without top-k heads and masks, one longer than
``seq_len`` (truncated), a mask-with-logprobs sample and an episode that kept no arrays at all. Version 1:
step 1 trains version-0 samples (one version behind is within the bound); one of them lives on
``env-flaky``, so its micro batch fails on the rank that trains it and is dropped on both ranks
(``dropped``). Then a group whose episodes are at versions 0 and 1 waits; version 2 arrives, and step 2
drops the version-0 sample (``stale``) while training the version-1 one next to fresh samples and a dummy.
Last, a complete group too small for a step and a group that never completes; the orchestrator is
stopped with SIGTERM and deletes them (``shutdown``).

Checked from the outside: the event stream (``refbus monitor --json --since 0`` into ``Ledger``) shows every
kept blob deleted exactly once, by its owner, for the reason the story gives it, with no violation, nothing
held and nothing leaked; every row the ranks assembled is byte-identical to what was kept, cut to the kept
count; the failed micro batch is dropped and counted on both ranks; and the orchestrator's Prometheus
endpoint shows it never received an array frame. The scenario runs once per module (fixture ``outcome``);
each check is its own test.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import signal
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.ledger import Ledger, read_records
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.settings import EnvServerSettings
from refbus.nodes.up import rendezvous
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Accounted, Accounts, Kept, Run, StepBatch, VersionBump
from scenario_support import (
    INLINE,
    SEQ_LEN,
    WAIT_S,
    EpisodeSpec,
    FlakyEnvServer,
    RankDump,
    RecordingTrainer,
    Registry,
    SampleSpec,
    Sent,
    advantages,
    expected_inline,
    expected_rows,
    rank_main,
    read_dump,
    routing_dtype,
)

pytest_plugins = ["wire_fixtures"]

R8, R16 = np.uint8, np.uint16
STEPS = 3
MAX_STEPS = STEPS + 1  # one step more than the ranks run, so the last small group stays queued until SIGTERM
ORCHESTRATOR = "orchestrator"
FLAKY = "env-flaky"


def episode(episode_id: str, env: str, group: str, reward: float, *samples: SampleSpec, version: int = 0,
            eval: bool = False) -> EpisodeSpec:
    return EpisodeSpec(episode_id, env, group, reward, samples, version, eval)


# The story's phases. FATE: what must become of an episode's blobs when it is not shipped (the delete
# reason); every other episode's blobs ship in a step and are deleted "trained", or "dropped" with the
# micro batch that failed.
AT_VERSION_0 = (
    episode("eval-0", "env-1", "eval-0", 1.0, SampleSpec(30, R8, mask=True), SampleSpec(20, heads=True, mask=True),
            eval=True),
    episode("flat-a", "env-0", "g-flat", 0.5, SampleSpec(24, R8)),
    episode("flat-b", "env-1", "g-flat", 0.5, SampleSpec(16, mask=True)),
    episode("s0-a", "env-0", "g-0", 1.0, SampleSpec(40, R8, heads=True, mask=True)),
    episode("s0-b", "env-1", "g-0", 0.0, SampleSpec(80, R8)),  # longer than seq_len: truncated to 64
    episode("s0-c", "env-1", "g-1", 1.0, SampleSpec(30, heads=True, mask=True)),  # mask with sampler logprobs
    episode("s0-d", "env-0", "g-1", 0.0, SampleSpec(20)),  # keeps no arrays: zero branches, ref -1
)
AT_VERSION_1 = (  # version-0 samples, one version behind: within the bound
    episode("s1-a", FLAKY, "g-2", 1.0, SampleSpec(24, mask=True)),  # its fetch fails
    episode("s1-b", "env-0", "g-2", 0.0, SampleSpec(50, R16, mask=True)),  # uint16 routing, mask without heads
    episode("s1-c", "env-1", "g-3", 0.2, SampleSpec(36, R8, heads=True)),
    episode("s1-d", "env-0", "g-3", 0.9, SampleSpec(28, heads=True, mask=True)),
)
WAITING = (  # queued before version 2 arrives
    episode("old-a", "env-0", "g-4", 1.0, SampleSpec(20, R8), version=0),  # two behind at step 2: stale
    episode("old-b", "env-1", "g-4", 0.0, SampleSpec(12, mask=True), version=1),  # one behind: trained
)
AT_VERSION_2 = (
    episode("s2-a", "env-0", "g-5", 0.3, SampleSpec(44, R8, heads=True, mask=True), version=2),
    episode("s2-b", "env-1", "g-5", 0.7, SampleSpec(18, heads=True, mask=True), version=2),
)
TAIL = (  # never shipped: deleted at shutdown
    episode("tail-a", "env-0", "g-6", 1.0, SampleSpec(10, R8), version=2),
    episode("tail-b", "env-1", "g-6", 0.0, SampleSpec(10, mask=True), version=2),
    episode("lone", "env-0", "g-7", 1.0, SampleSpec(8, R8), version=2),  # its group never completes
)
FATE = {"eval-0": "eval", "flat-a": "filtered", "flat-b": "filtered", "old-a": "stale",
        **{e.episode_id: "shutdown" for e in TAIL}}  # every other episode: "step"
EPISODES = (*AT_VERSION_0, *AT_VERSION_1, *WAITING, *AT_VERSION_2, *TAIL)
# Kept blobs per delete reason (trained and dropped are checked per blob against the ranks' dumps).
EXPECTED_REASONS = Counter(eval=2, filtered=2, stale=1, trained=9, dropped=1, shutdown=3)


# --- running the scenario ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Everything the checks read, gathered once for the module."""

    sent: dict[str, Sent]  # by sample id
    kept: dict[str, str]  # blob id -> env server node id
    dumps: list[RankDump]
    rank_exits: list[int | None]
    ledger: Ledger
    orchestrator_metrics: str
    env_metrics: str
    orchestrator_exit: int
    refused_fetches: list[str]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        return response.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (``labels`` as written, e.g. ``reason="stale"``)."""
    series = f"{name}{{{labels}}}" if labels else name
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    exported = [line for line in text.splitlines() if line.startswith(name)]
    assert match, f"{series} not exported; {name} samples: {exported}"
    return float(match.group(1))


class Driver:
    """The test's side of the run: keeps episodes on the env servers, moves the policy version, and polls
    the orchestrator's registry status (``step``, ``version``, ``blobs_held``) to know what it has seen."""

    def __init__(self, registry: Registry, endpoints: dict[str, str], version_node: NodeRuntime | None = None) -> None:
        self.registry = registry
        self.version_node = version_node
        self.ctx = zmq.Context()
        codec = WireCodec("scenario-driver")
        self.clients = {env: Client(self.ctx, ep, codec, policy=RetryPolicy(timeout_s=5, attempts=2))
                        for env, ep in endpoints.items()}
        self.sent: dict[str, Sent] = {}
        self.kept: dict[str, str] = {}

    def feed(self, *episodes: EpisodeSpec) -> None:
        for spec in episodes:
            request = spec.keep()
            reply = self.clients[spec.env].request(request).body
            assert isinstance(reply, Kept) and len(reply.refs) == len(request.branches), reply
            refs = iter(reply.refs)
            for sample_id, sample in zip(spec.sample_ids(), spec.samples, strict=True):
                blob_id = next(refs).blob_id if sample.keeps_arrays else None
                self.sent[sample_id] = Sent(sample_id, sample, spec, blob_id)
                if blob_id is not None:
                    self.kept[blob_id] = spec.env

    def bump(self, version: int) -> None:
        """Publish ``version-bump`` and wait until the orchestrator reports the version."""
        node = self.version_node
        assert node is not None, "no in-process node to publish from"
        node.call_soon(lambda: node.publish(VersionBump(version=version, nbytes=0, manifest_digest="scenario")))
        self.wait_orchestrator(f"policy version {version}", version=version)

    def wait_orchestrator(self, what: str, **expected: float) -> None:
        def reached() -> bool:
            node = self.registry.nodes("orchestrator").get(ORCHESTRATOR)
            return node is not None and all(node.status.get(k) == float(v) for k, v in expected.items())

        wait_for(reached, WAIT_S, f"the orchestrator to report {what} ({expected})")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.ctx.destroy(linger=0)


def play(driver: Driver) -> None:
    """Feed the story, waiting at each point where the orchestrator must have caught up."""
    driver.feed(*AT_VERSION_0)
    driver.wait_orchestrator("step 0 shipped, eval and filtered deleted", step=1, blobs_held=0)
    driver.bump(1)
    driver.feed(*AT_VERSION_1)
    driver.wait_orchestrator("step 1 shipped", step=2, blobs_held=0)
    driver.feed(*WAITING)
    driver.wait_orchestrator("a group waiting in the queue", step=2, blobs_held=2)
    driver.bump(2)
    driver.feed(*AT_VERSION_2)
    driver.wait_orchestrator("step 2 shipped, the stale sample deleted", step=3, blobs_held=0)
    driver.feed(*TAIL)
    driver.wait_orchestrator("the tail held", step=3, blobs_held=3)


def node_command(role: str, control: str, node_id: str, *flags: str) -> list[str]:
    return ["node", role, "--bus-control", control, "--node-id", node_id, *FAST_LIVENESS, *flags]


def capture_ledger(control: str, workdir: Path) -> Ledger:
    """Replay the broker's whole ring through ``refbus monitor --json`` and fold it into a ledger."""
    out = workdir / "events.jsonl"
    with open(out, "wb") as sink:
        monitor = NodeProcess(["monitor", "--json", "--since", "0", "--duration", "0.5", "--bus-control", control],
                              workdir=workdir, name="monitor", stdout=sink)
        try:
            assert monitor.proc.wait(WAIT_S) == 0, monitor.log_tail()
        finally:
            monitor.stop()
    ledger = Ledger()
    with open(out) as lines:
        for record in read_records(lines):
            ledger.apply(record)
    return ledger


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    workdir = tmp_path_factory.mktemp("scenario")
    with contextlib.ExitStack() as stack:
        bus, control = start_bus(workdir, extra=FAST_LIVENESS)
        stack.callback(_stop_cleanly, bus)
        registry = Registry(control)
        stack.callback(registry.close)

        # Trainer ranks first: importing torch is the slowest start.
        ctx = multiprocessing.get_context("spawn")
        init = rendezvous(workdir, "test", 0)  # a file: no port to pick that another process could take first
        dump_paths = [workdir / f"rank-{rank}.pickle" for rank in (0, 1)]
        ranks = [ctx.Process(target=rank_main, args=(rank, 2, init, control, STEPS, str(path)), daemon=True)
                 for rank, path in enumerate(dump_paths)]
        for proc in ranks:
            proc.start()
            stack.callback(_reap, proc)

        nodes = {name: NodeProcess(node_command("env-server", control, name), workdir=workdir, name=name)
                 for name in ("env-0", "env-1")}
        nodes[ORCHESTRATOR] = NodeProcess(
            node_command("orchestrator", control, ORCHESTRATOR, "--node-metrics-port", "0",
                         "--orchestrator-trainers", "2", "--orchestrator-seq-len", str(SEQ_LEN),
                         "--orchestrator-group-size", "2", "--orchestrator-groups-per-step", "2",
                         "--orchestrator-max-staleness", "1", "--orchestrator-max-steps", str(MAX_STEPS)),
            workdir=workdir, name=ORCHESTRATOR)
        for proc in nodes.values():
            stack.callback(_stop_cleanly, proc)

        flaky_node = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id=FLAKY, metrics_port=-1))
        flaky = FlakyEnvServer(flaky_node, EnvServerSettings())
        version_node = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="versions", metrics_port=-1))
        for node in (flaky_node, version_node):
            node.start_background()
            stack.callback(node.join, WAIT_S)

        entries = {name: proc.wait_ready(WAIT_S) for name, proc in nodes.items()}
        endpoints = {name: entries[name]["endpoints"]["blobs"] for name in ("env-0", "env-1")}
        endpoints[FLAKY] = flaky.endpoint
        wait_for(lambda: len(registry.nodes("trainer")) == 2, 60, "both trainer ranks in the registry")

        driver = Driver(registry, endpoints, version_node)
        stack.callback(driver.close)
        play(driver)

        for proc in ranks:
            proc.join(WAIT_S)
        orchestrator_metrics = scrape(entries[ORCHESTRATOR]["metrics"])
        env_metrics = scrape(entries["env-0"]["metrics"])
        nodes[ORCHESTRATOR].signal(signal.SIGTERM)
        orchestrator_exit = nodes[ORCHESTRATOR].proc.wait(WAIT_S)

        yield Outcome(
            sent=driver.sent,
            kept=driver.kept,
            dumps=[read_dump(path) for path in dump_paths],
            rank_exits=[proc.exitcode for proc in ranks],
            ledger=capture_ledger(control, workdir),
            orchestrator_metrics=orchestrator_metrics,
            env_metrics=env_metrics,
            orchestrator_exit=orchestrator_exit,
            refused_fetches=list(flaky.refused),
        )


def _stop_cleanly(proc: NodeProcess) -> None:
    assert proc.stop() == 0, proc.log_tail()


def _reap(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(WAIT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join(5)


# --- what the ranks trained ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trained:
    """One real (non-dummy) sample as a rank ran it."""

    rank: int
    step: int
    dropped: bool
    sample: dict[str, Any]


def trained(outcome: Outcome) -> dict[str, Trained]:
    """Every real sample the ranks ran, by sample id (each must appear once)."""
    seen: dict[str, Trained] = {}
    for dump in outcome.dumps:
        for step in dump.steps:
            for mb in step.micro_batches:
                if mb["dummy"]:
                    continue
                for sample in mb["samples"]:
                    assert sample["sample_id"] not in seen, f"{sample['sample_id']} ran twice"
                    seen[sample["sample_id"]] = Trained(dump.rank, step.step, mb["dropped"], sample)
    return seen


def fate(outcome: Outcome, blob_id: str) -> tuple[str, str]:
    """(reason, deleter) the story gives a blob."""
    sent = next(s for s in outcome.sent.values() if s.blob_id == blob_id)
    story = FATE.get(sent.episode.episode_id, "step")
    if story != "step":
        return story, ORCHESTRATOR
    ran = trained(outcome)[sent.sample_id]
    return ("dropped" if ran.dropped else "trained"), f"trainer-{ran.rank}"


def assert_identical(actual: np.ndarray, expected: np.ndarray, where: str) -> None:
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
        f"{where}: {actual.dtype}{actual.shape}, expected {expected.dtype}{expected.shape}")
    assert actual.tobytes() == expected.tobytes(), f"{where}: bytes differ\n{actual}\nexpected\n{expected}"


def group_advantages() -> dict[str, float]:
    """Each training episode's advantage within its group (episode id -> advantage)."""
    groups: dict[str, list[EpisodeSpec]] = {}
    for spec in EPISODES:
        groups.setdefault(spec.group, []).append(spec)
    return {spec.episode_id: value for members in groups.values()
            for spec, value in zip(members, advantages([m.reward for m in members]), strict=True)}


# --- checks ------------------------------------------------------------------------------------------------


def test_every_process_ran_the_story_and_stopped_cleanly(outcome: Outcome) -> None:
    for dump in outcome.dumps:
        assert not dump.error, f"rank {dump.rank} failed:\n{dump.error}"
        assert [s.step for s in dump.steps] == list(range(STEPS))
        assert dump.held_metric == 0
        for step in dump.steps:
            assert not step.violations and not step.failed_deletes, (dump.rank, step.step)
    assert outcome.rank_exits == [0, 0]
    assert outcome.orchestrator_exit == 0
    assert metric(outcome.orchestrator_metrics, "refbus_orchestrator_steps_total") == STEPS
    shipped = {sid for e in EPISODES if FATE.get(e.episode_id, "step") == "step" for sid in e.sample_ids()}
    assert set(trained(outcome)) == shipped


def test_every_kept_blob_is_deleted_exactly_once_by_its_owner(outcome: Outcome) -> None:
    report = outcome.ledger.report()
    totals = report.totals()
    assert totals["violations"] == 0, report.violations
    assert totals["kept"] == len(outcome.kept) == sum(EXPECTED_REASONS.values())
    assert totals["deleted_total"] == totals["kept"]
    assert (totals["held"], totals["leaked"]) == (0, 0), report.as_dict()
    assert {"filtered", "stale", "eval", "trained", "shutdown", "dropped"} <= set(totals["deleted"])
    assert Counter(totals["deleted"]) == EXPECTED_REASONS
    assert outcome.ledger.blobs == {}  # nothing still held
    deleted = {blob_id: (reason, deleter) for blob_id, (deleter, reason) in outcome.ledger.tombstones.recent.items()}
    assert deleted == {blob_id: fate(outcome, blob_id) for blob_id in outcome.kept}
    assert report.kept == Counter(outcome.kept.values())  # each blob counted with the env server that kept it
    assert report.ok, report.as_dict()


def test_every_fetched_row_is_byte_identical_to_what_was_kept(outcome: Outcome) -> None:
    advantage = group_advantages()
    checked: Counter[str] = Counter()
    for dump in outcome.dumps:
        for step in dump.steps:
            for index, mb in enumerate(step.micro_batches):
                if mb["dropped"]:
                    continue
                routing = routing_dtype(outcome.sent[sample["sample_id"]] for sample in mb["samples"])
                for sample in mb["samples"]:
                    sent = outcome.sent[sample["sample_id"]]
                    where = f"rank {dump.rank} step {step.step} micro batch {index} {sent.sample_id}"
                    assert sample["kept"] == sent.kept, where
                    expected_tensors = set(sample["rows"]) - {"loss_mask"}
                    fields = set(sent.spec.arrays(sent.sample_id))
                    assert ("routed_experts" in expected_tensors) == ("routed_experts" in fields), where
                    for name, rows in sample["rows"].items():
                        assert_identical(rows, expected_rows(sent, name, rows.shape, dummy=mb["dummy"],
                                                             routing=routing), f"{where} {name}")
                        checked[name] += 1
                    # A dummy borrows its samples' token ids (so it routes like real data); it trains nothing,
                    # which its all-False loss mask (checked above) says.
                    for name in ("input_ids",) if mb["dummy"] else INLINE:
                        expected = expected_inline(sent, name, advantage[sent.episode.episode_id])
                        assert_identical(sample["inline"][name], expected, f"{where} inline {name}")
    assert set(checked) == {"loss_mask", "routed_experts", "sampling_mask", "topk_ids", "topk_logprobs", "topk_valid"}
    assert any(mb["dummy"] for d in outcome.dumps for s in d.steps for mb in s.micro_batches)
    truncated = trained(outcome)["s0-b/0"]
    assert not truncated.dropped and truncated.sample["rows"]["routed_experts"].shape[0] == SEQ_LEN


def test_a_failed_fetch_drops_its_micro_batch_and_both_ranks_count_it(outcome: Outcome) -> None:
    flaky_sample = outcome.sent["s1-a/0"]
    assert set(outcome.refused_fetches) == {flaky_sample.blob_id}
    ran = trained(outcome)[flaky_sample.sample_id]
    assert ran.step == 1 and ran.dropped
    for dump in outcome.dumps:
        assert [s.dropped_global for s in dump.steps] == [0, 1, 0], f"rank {dump.rank}"
        local = dump.rank == ran.rank  # only the rank that trains it fetches it
        failed_step = dump.steps[1]
        assert failed_step.failures == (["missing"] if local else [])
        assert len(failed_step.dropped) == int(local)
        assert dump.dropped_metric == float(local)
        for index in failed_step.dropped:
            mb = failed_step.micro_batches[index]
            assert mb["dropped"] and not mb["loss_any"]
            (sample,) = mb["samples"]
            assert sample["sample_id"] == flaky_sample.sample_id
            assert (sample["rows"]["sampling_mask"] == -1).all()  # never trained on zeros or on stale bytes


def test_the_orchestrator_never_receives_an_array_frame(outcome: Outcome) -> None:
    assert metric(outcome.orchestrator_metrics, "refbus_wire_array_frames_received_total") == 0
    assert metric(outcome.orchestrator_metrics, "refbus_wire_array_received_bytes_total") == 0
    # The counter is live: env-0 received its episodes' arrays as frames.
    assert metric(outcome.env_metrics, "refbus_wire_array_frames_received_total") > 0
    # ... while the orchestrator held the tail's arrays by reference.
    tail = sum(1 for e in TAIL for s in e.samples if s.keeps_arrays)
    assert metric(outcome.orchestrator_metrics, "refbus_orchestrator_blobs_held") == tail
    assert metric(outcome.orchestrator_metrics, "refbus_orchestrator_referenced_bytes") > 0
    assert metric(outcome.orchestrator_metrics, "refbus_orchestrator_dropped_samples_total", 'reason="filtered"') == 2


def test_the_orchestrator_counts_the_stale_samples_it_drops(outcome: Outcome) -> None:
    assert metric(outcome.orchestrator_metrics, "refbus_orchestrator_dropped_samples_total", 'reason="stale"') == 1


@dataclass
class RecordedRun:
    """An in-process env server (``env-0``), stand-in trainer ranks that record their step batches, a spawned
    orchestrator and a driver feeding episodes: see :func:`recorded_run`."""

    env: EnvServer
    ranks: list[RecordingTrainer]
    orchestrator: Any
    driver: Driver


@contextlib.contextmanager
def recorded_run(bus, spawn, ranks: list[RecordingTrainer], groups_per_step: int, *flags: str) -> Iterator[RecordedRun]:
    """The orchestrator shipping to ``ranks`` (group size 2, ``groups_per_step``, more orchestrator ``flags``)
    from one env server in this process; everything stopped at the end, the orchestrator first (it deletes from
    the env server)."""
    _, control = bus
    env_node = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-0", metrics_port=-1))
    env = EnvServer(env_node, EnvServerSettings())
    orchestrator = spawn(node_command("orchestrator", control, ORCHESTRATOR, "--node-metrics-port", "-1",
                                      "--orchestrator-trainers", str(len(ranks)), "--orchestrator-seq-len",
                                      str(SEQ_LEN), "--orchestrator-group-size", "2",
                                      "--orchestrator-groups-per-step", str(groups_per_step), *flags),
                         ORCHESTRATOR)
    registry = Registry(control)
    driver: Driver | None = None
    try:
        for node in (env_node, *(rank.runtime for rank in ranks)):
            node.start_background()
        orchestrator.wait_ready(WAIT_S)
        driver = Driver(registry, {"env-0": env.endpoint})
        yield RecordedRun(env, ranks, orchestrator, driver)
    finally:
        orchestrator.stop()
        if driver is not None:
            driver.close()
        registry.close()
        for node in (*(rank.runtime for rank in ranks), env_node):
            node.join(WAIT_S)


def test_a_step_ships_whole_groups_when_episodes_keep_several_samples(bus, spawn) -> None:
    """``groups_per_step`` is "complete groups shipped per trainer step". Group A has an episode with two
    samples (a routed branch and a mask-only one) and one with one; group B two one-sample episodes. Once
    both groups are complete, the first step must hold both, whole: all five samples."""
    rank = RecordingTrainer(bus[1])
    with recorded_run(bus, spawn, [rank], 2) as run:
        run.driver.feed(episode("a1", "env-0", "A", 1.0, SampleSpec(20, R8), SampleSpec(16, mask=True)),
                        episode("a2", "env-0", "A", 0.0, SampleSpec(12, R8)),
                        episode("b1", "env-0", "B", 1.0, SampleSpec(10, R8)),
                        episode("b2", "env-0", "B", 0.0, SampleSpec(8, mask=True)))
        (step,) = wait_for(lambda: list(rank.batches), WAIT_S, "the first step batch")
        shipped = sorted(s.sample_id for mb in step.micro_batches if not mb.dummy for s in mb.samples)
        assert shipped == sorted(run.driver.sent), "a step must ship complete groups, groups_per_step of them"


def test_a_step_batch_a_rank_acknowledged_is_its_own_at_the_store_even_if_its_reference_never_left(
        bus, spawn, zmq_ctx: zmq.Context) -> None:
    """A rank answers a step batch, then publishes its ``reference`` (the event the stores hand blobs over on);
    a rank killed between the two left the blobs with the orchestrator at the store, which no longer knew them
    (never deleted, never reclaimed with the rank's). The orchestrator now publishes the hand-over too, on the
    answer. The stand-in rank here answers and never publishes: the store must still list the step's blobs as
    the rank's."""
    rank = RecordingTrainer(bus[1])
    with recorded_run(bus, spawn, [rank], 1) as run:
        store = Client(zmq_ctx, run.env.endpoint, WireCodec("scenario-accounts"),
                       policy=RetryPolicy(timeout_s=5, attempts=2))

        def held_by() -> dict[str, int]:
            reply = store.request(Accounts(holders=4)).body
            assert isinstance(reply, Accounted)
            return dict(reply.held_by)

        try:
            run.driver.feed(episode("a1", "env-0", "A", 1.0, SampleSpec(20, R8)),
                            episode("a2", "env-0", "A", 0.0, SampleSpec(12, R8)))
            (step,) = wait_for(lambda: list(rank.batches), WAIT_S, "the first step batch")
            assert len(step.owned) == 2
            wait_for(lambda: held_by() == {"trainer-0": 2}, WAIT_S, "the step's blobs held by trainer-0 at the store")
        finally:
            store.close()


def test_a_step_a_rank_refused_is_redelivered_to_it_and_the_next_step_follows(bus, spawn) -> None:
    """Regression: when one rank refused its step batch, the step's groups left the queue, its blobs stayed
    held and the step number was reused, so the rank that had accepted refused every later step as
    ``duplicate-step``. Now the same step goes again to the rank that refused it (after one request
    timeout), and only once every rank has it does the next step ship."""
    ranks = [RecordingTrainer(bus[1], 0), RecordingTrainer(bus[1], 1, refuse_first=True)]
    with recorded_run(bus, spawn, ranks, 1, "--requests-timeout-s", "0.5") as run:
        run.driver.feed(episode("a1", "env-0", "A", 1.0, SampleSpec(20, R8)),
                        episode("a2", "env-0", "A", 0.0, SampleSpec(12, R8)))
        wait_for(lambda: [b.step for b in ranks[1].batches] == [0], WAIT_S, "step 0 re-delivered to rank 1")
        run.driver.feed(episode("b1", "env-0", "B", 1.0, SampleSpec(10, R8)),
                        episode("b2", "env-0", "B", 0.0, SampleSpec(8, R8)))
        run.driver.wait_orchestrator("step 1 acknowledged by both ranks", step=2, blobs_held=0)
        for rank in ranks:
            assert [b.step for b in rank.batches] == [0, 1], rank.runtime.node_id
        (refused,) = ranks[1].refused
        assert _content(refused) == _content(ranks[1].batches[0]), "the same step batch, re-delivered"
        assert ranks[0].repeats == 0, "the rank that acknowledged got nothing twice"
        assert run.orchestrator.proc.poll() is None


def _content(batch: StepBatch) -> tuple:
    return batch.step, batch.rank, batch.owned, [[s.sample_id for s in mb.samples] for mb in batch.micro_batches]


def test_runs_never_answered_expire_so_dispatch_goes_on(bus, spawn) -> None:
    """Regression: a run never answered held its admission slot forever, so after ``max_groups_in_flight``
    such runs dispatch stopped. Here an env server takes every run and answers none: each run expires
    after ``env_server.generate_timeout_s`` plus the request retry schedule, its group is abandoned, and
    new runs keep coming, each sent once."""
    _, control = bus
    silent = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-silent", metrics_port=-1))
    runs: list[Run] = []

    def never_answer(request: Message) -> None:
        assert isinstance(request.body, Run)
        runs.append(request.body)

    silent.serve("blobs", "tcp://127.0.0.1:0").on(Run.kind, never_answer)
    # Runs go only once a weights version exists: the orchestrator reads it from the ps-manager's entry.
    manager = NodeRuntime("ps-manager", RuntimeSettings(bus=control, node_id="ps-version-0", metrics_port=-1,
                                                        heartbeat_interval_s=0.2))
    manager.status = lambda: {"version": 0.0}
    orchestrator = spawn(node_command("orchestrator", control, ORCHESTRATOR, "--node-metrics-port", "-1",
                                      "--orchestrator-dispatch", "true", "--orchestrator-group-size", "1",
                                      "--orchestrator-max-groups-in-flight", "2",
                                      "--env-server-generate-timeout-s", "0.3", "--requests-timeout-s", "0.5",
                                      "--requests-attempts", "2"),
                         ORCHESTRATOR)
    try:
        silent.start_background()
        manager.start_background()
        orchestrator.wait_ready(WAIT_S)
        wait_for(lambda: len(runs) >= 3 * 2, WAIT_S, "runs beyond max_groups_in_flight, three times over")
        seen = list(runs)
        assert len({r.episode_id for r in seen}) == len(seen), "a run is sent once, never resent"
        assert orchestrator.proc.poll() is None
    finally:
        orchestrator.stop()
        silent.join(WAIT_S)
        manager.join(WAIT_S)
