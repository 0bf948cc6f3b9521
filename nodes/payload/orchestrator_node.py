"""`refbus node orchestrator`: turns finished episodes into trainer steps, holding references only.

Episodes arrive as ``episode-finished`` events (published by env servers when they keep an episode). The
orchestrator claims their blobs at once (so their hand-over lease does not run out), groups episodes,
computes advantages, and ships steps to the trainer ranks it finds in the broker's registry. Every drop
point deletes at that moment, with its reason:

============== ====================================================================================
reason         when
============== ====================================================================================
``filtered``   a complete group whose advantages are all zero (nothing to learn)
``stale``      a queued sample older than ``max_staleness`` versions when its step is packed
``eval``       every eval episode (scored, never trained)
``incomplete`` a group still incomplete after ``group_timeout_s``
``late``       an episode of a group that was already completed or dropped
``max_steps``  anything arriving after the last step was shipped
``missing``    (counted, nothing to delete) a sample whose blob was gone before it could be claimed
``shutdown``   what is still queued or grouped when the node stops
============== ====================================================================================

The episode record (``EpisodeFinished.info``), set by whoever keeps the episode:

* ``group`` (str, default: the episode id): episodes of one prompt; ``reward`` (float); ``eval`` (bool);
* ``samples``: one entry per trainable sequence: ``{"input_ids": [int], "loss_mask": [0|1], "ref": i}``
  where ``ref`` indexes ``refs`` (``-1``: a sample that kept no arrays). Lists, not arrays: the
  orchestrator must never receive an array frame.

The current policy version comes from ``version-bump`` events (the parameter server's commits).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from ...bus.reqrep import Client
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import EpisodeFinished, Error, Run, VersionBump
from ..config import Config
from ..entry_points import load_entry_point
from ..settings import OrchestratorSettings
from .orchestrator import (
    DeliveryError,
    EvalSink,
    ReferenceHolder,
    ReplicaRouter,
    Sample,
    TrainerAddress,
    TrainSink,
)

log = structlog.get_logger(__name__)


@dataclass
class _Group:
    started: float
    episodes: list[tuple[float, list[Sample]]] = field(default_factory=list)  # (reward, samples)


class Orchestrator:
    """The orchestrator role on a :class:`NodeRuntime` (all work on the loop thread)."""

    def __init__(self, runtime: NodeRuntime, settings: OrchestratorSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.holder = ReferenceHolder(runtime)
        self.eval_sink = EvalSink(self.holder)
        self.sink = TrainSink(self.holder, seq_len=settings.seq_len, max_staleness=settings.max_staleness)
        self.policy_version = 0
        self.step = 0
        self.groups: dict[str, _Group] = {}
        self.closed_groups: set[str] = set()
        self.episodes = 0
        self.abandoned_groups = 0
        runtime.subscribe(self._on_event, kinds=frozenset({EpisodeFinished.kind, VersionBump.kind}))
        runtime.every(min(1.0, settings.group_timeout_s / 4), self._expire_groups)
        runtime.shutdown_hooks.append(self.close)
        runtime.status = self.status
        self._register_metrics()

    # --- events -------------------------------------------------------------------------------------

    def _on_event(self, message: Message) -> None:
        body = message.body
        if isinstance(body, VersionBump):
            self.policy_version = max(self.policy_version, body.version)
        elif isinstance(body, EpisodeFinished):
            self._on_episode(body)
            self._ship_ready()

    def _on_episode(self, episode: EpisodeFinished) -> None:
        self.episodes += 1
        claimed = {ref.blob_id for ref in self.holder.claim(episode.refs)} if episode.refs else set()
        samples = self._samples(episode, claimed)
        info = episode.info
        group_id = str(info.get("group", episode.episode_id))
        if info.get("eval"):
            self.eval_sink.add(samples)
        elif self.finished:
            self.sink.drop(samples, "max_steps")
        elif group_id in self.closed_groups:
            self.sink.drop(samples, "late")
        else:
            group = self.groups.setdefault(group_id, _Group(started=time.monotonic()))
            group.episodes.append((float(info.get("reward", 0.0)), samples))
            if len(group.episodes) >= self.settings.group_size:
                self._complete(group_id)

    def _samples(self, episode: EpisodeFinished, claimed: set[str]) -> list[Sample]:
        """The episode's trainable samples; a sample whose blob could not be claimed is counted and left
        out (training it without its arrays would be training on something it did not do)."""
        samples = []
        for index, entry in enumerate(episode.info.get("samples", [])):
            ref_index = int(entry.get("ref", -1))
            ref = episode.refs[ref_index] if 0 <= ref_index < len(episode.refs) else None
            if ref is not None and ref.blob_id not in claimed:
                self.sink.dropped["missing"] += 1
                continue
            input_ids = np.asarray(entry["input_ids"], dtype=np.int64)
            inputs: dict[str, Any] = {"input_ids": input_ids}
            if "loss_mask" in entry:
                inputs["loss_mask"] = np.asarray(entry["loss_mask"], dtype=np.bool_)
            samples.append(Sample(f"{episode.episode_id}/{index}", len(input_ids), ref, episode.policy_version,
                                  inputs))
        return samples

    def _complete(self, group_id: str) -> None:
        group = self.groups.pop(group_id)
        self.closed_groups.add(group_id)
        rewards = np.array([reward for reward, _ in group.episodes], dtype=np.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        samples, per_sample = [], []
        for advantage, (_, episode_samples) in zip(advantages, group.episodes, strict=True):
            samples.extend(episode_samples)
            per_sample.extend([float(advantage)] * len(episode_samples))
        self.sink.add_group(samples, per_sample)

    def _expire_groups(self) -> None:
        horizon = time.monotonic() - self.settings.group_timeout_s
        for group_id in [g for g, group in self.groups.items() if group.started < horizon]:
            self.abandon(group_id)

    def abandon(self, group_id: str) -> None:
        """A group that will never complete (timed out, or one of its runs failed): delete what arrived;
        its stragglers are deleted as ``late`` when they come."""
        if group_id in self.closed_groups:
            return
        self.closed_groups.add(group_id)
        self.abandoned_groups += 1
        group = self.groups.pop(group_id, None)
        if group is not None:
            self.sink.drop((s for _, samples in group.episodes for s in samples), "incomplete")

    @property
    def groups_released(self) -> int:
        """Groups that will never train: their admission slots are free again."""
        return self.abandoned_groups + self.sink.dropped_groups

    @property
    def finished(self) -> bool:
        return bool(self.settings.max_steps) and self.step >= self.settings.max_steps

    # --- steps --------------------------------------------------------------------------------------

    def _find_trainers(self) -> bool:
        """Ask the registry for the trainer ranks until ``settings.trainers`` of them are live."""
        if len(self.sink.trainers) >= self.settings.trainers:
            return True
        trainers = [TrainerAddress.from_node(node) for node in self.runtime.lookup("trainer") or ()]
        if len(trainers) < self.settings.trainers:
            return False
        self.sink.use_trainers(trainers)
        log.info("trainers.found", ranks=[t.rank for t in self.sink.trainers])
        return True

    def _ship_ready(self) -> None:
        per_step = self.settings.groups_per_step
        sink = self.sink
        while len(sink.queue) >= per_step and not self.finished:
            if not self._find_trainers():
                return
            try:
                plan = sink.ship(self.step, self.policy_version, max_groups=per_step)
            except DeliveryError as exc:
                log.error("step.undelivered", step=self.step, error=str(exc))
                return
            if plan is None:
                continue
            log.info("step.shipped", step=self.step, version=self.policy_version,
                     micro_batches=plan.micro_batches_per_rank, dummies=plan.dummy_count)
            self.step += 1
        if self.finished and sink.queue:
            queued, sink.queue = sink.queue, []
            sink.drop((s for group in queued for s in group), "max_steps")

    def close(self) -> None:
        """Shutdown: delete what is queued, still grouped, or held for any other reason (a step batch that
        no trainer acknowledged)."""
        for group in self.groups.values():
            self.sink.drop((s for _, samples in group.episodes for s in samples), "shutdown")
        self.groups.clear()
        self.sink.close()
        self.holder.delete(list(self.holder.held.values()), "shutdown")

    def _dropped_samples(self) -> dict[tuple[str, ...], float]:
        counts = {(reason,): float(n) for reason, n in self.sink.dropped.items()}
        if self.eval_sink.samples:
            counts[("eval",)] = float(self.eval_sink.samples)
        return counts

    def status(self) -> dict[str, float]:
        return {"step": float(self.step), "version": float(self.policy_version),
                "blobs_held": float(len(self.holder.held)), "bytes_held": float(self.holder.held_bytes)}

    def _register_metrics(self) -> None:
        self.runtime.metric("refbus_orchestrator_blobs_held", "Blobs the orchestrator owns (references only).",
                      lambda: {(): float(len(self.holder.held))}, kind="gauge")
        self.runtime.metric("refbus_orchestrator_referenced_bytes", "Array bytes the orchestrator holds by reference.",
                      lambda: {(): float(self.holder.held_bytes)}, kind="gauge")
        self.runtime.metric("refbus_orchestrator_steps_total", "Steps shipped to the trainer ranks.",
                      lambda: {(): float(self.step)})
        self.runtime.metric("refbus_orchestrator_dropped_samples_total", "Samples not shipped, by reason.",
                            self._dropped_samples, labels=("reason",))


class RunDispatcher:
    """Sends runs (one prompt, ``group_size`` episodes) to env servers, within the staleness bound.

    Admission (AReaL's rule): at most ``(max_staleness + v + 1) * groups_per_step`` groups may be trained,
    queued or running while the trainer is at version ``v`` (groups dropped untrained give their slot
    back), and at most ``max_groups_in_flight`` run at once; so no episode can be more than
    ``max_staleness`` versions old when its step is packed, unless the trainer stalls. Sources take turns;
    each run goes to the least-loaded replica of its source (registry lookup every second). A failed run
    abandons its group. Every ``eval_every`` steps one eval group is sent.
    """

    def __init__(self, runtime: NodeRuntime, orchestrator: Orchestrator) -> None:
        self.runtime = runtime
        self.orchestrator = orchestrator
        self.settings = orchestrator.settings
        self.prompts = load_entry_point(self.settings.prompt)
        self.rng = np.random.default_rng(self.settings.seed)
        self.router = ReplicaRouter()
        self.running: dict[str, tuple[str, str]] = {}  # run msg id -> (group id, endpoint)
        self.groups_running: Counter[str] = Counter()
        self.groups_sent = 0
        self.train_groups_sent = 0
        self.eval_sent_at = -1
        self.failed_runs = 0
        self._clients: dict[str, Client] = {}
        runtime.every(1.0, self._refresh)
        runtime.every(0.02, self.dispatch)

    def _refresh(self) -> None:
        nodes = self.runtime.lookup("env-server")
        if nodes is not None:
            self.router.update(nodes)

    def dispatch(self) -> None:
        if self.orchestrator.finished or not self.router.replicas:
            return
        settings, orchestrator = self.settings, self.orchestrator
        step = orchestrator.step
        if settings.eval_every and step % settings.eval_every == 0 and step != self.eval_sent_at:
            self.eval_sent_at = step
            self._send_group(evaluation=True)
        bound = (settings.max_staleness + orchestrator.policy_version + 1) * settings.groups_per_step
        while (len(self.groups_running) < settings.max_groups_in_flight
               and self.train_groups_sent - orchestrator.groups_released < bound):
            self._send_group(evaluation=False)

    def _send_group(self, *, evaluation: bool) -> None:
        group_id = f"{'eval' if evaluation else 'g'}{self.groups_sent}"
        self.groups_sent += 1
        self.train_groups_sent += not evaluation
        prompt = [int(t) for t in self.prompts(self.rng)]
        sources = sorted(self.router.replicas)
        source = sources[self.groups_sent % len(sources)]  # sources in turn; replicas of one by load
        for member in range(self.settings.group_size):
            endpoint = self.router.pick(source)
            msg_id = self._client(endpoint).send(Run(episode_id=f"{group_id}-{member}", group=group_id,
                                                     prompt=prompt, eval=evaluation))
            self.running[msg_id] = (group_id, endpoint)
            self.groups_running[group_id] += 1

    def _client(self, endpoint: str) -> Client:
        if endpoint not in self._clients:
            client = self.runtime.client(endpoint)
            client.on_stray = self._on_reply
            self.runtime.watch(client.sock, lambda: self._drain(client))
            self._clients[endpoint] = client
        return self._clients[endpoint]

    def _drain(self, client: Client) -> None:
        while (reply := client.recv(0)) is not None:
            self._on_reply(reply)

    def _on_reply(self, reply: Message) -> None:
        entry = self.running.pop(reply.header.re, None)
        if entry is None:
            return
        group_id, endpoint = entry
        self.router.done(endpoint)
        self.groups_running[group_id] -= 1
        if self.groups_running[group_id] <= 0:
            del self.groups_running[group_id]
        if isinstance(reply.body, Error):
            self.failed_runs += 1
            log.warning("run.failed", group=group_id, code=reply.body.code, error=reply.body.message)
            self.orchestrator.abandon(group_id)


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node orchestrator``: serve until SIGINT/SIGTERM."""
    runtime = NodeRuntime("orchestrator", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    orchestrator = Orchestrator(runtime, config.orchestrator)
    if orchestrator.settings.dispatch:
        RunDispatcher(runtime, orchestrator)
    runtime.run()
    return 0
