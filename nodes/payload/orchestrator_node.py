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
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ...bus.reqrep import RemoteError, RequestTimeout
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import EpisodeFinished, NodeList, Nodes, VersionBump
from .orchestrator import DeliveryError, EvalSink, ReferenceHolder, Sample, TrainerAddress, TrainSink

if TYPE_CHECKING:
    from ..config import Config

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class OrchestratorSettings:
    seq_len: int = 2048
    group_size: int = 4
    groups_per_step: int = 4
    max_staleness: int = 1
    max_steps: int = 0  # 0: no limit
    trainers: int = 1  # trainer ranks to wait for before the first step
    group_timeout_s: float = 120.0


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
        self.dropped: Counter[str] = Counter()
        self.episodes = 0
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
        elif self.settings.max_steps and self.step >= self.settings.max_steps:
            self._drop(samples, "max_steps")
        elif group_id in self.closed_groups:
            self.dropped["late"] += len(samples)
            self.holder.release(s.ref for s in samples if s.ref is not None)
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
                self.dropped["missing"] += 1
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
        if not self.sink.add_group(samples, per_sample):
            self.dropped["filtered"] += len(samples)

    def _drop(self, samples: list[Sample], reason: str) -> None:
        self.dropped[reason] += len(samples)
        self.holder.delete((s.ref for s in samples if s.ref is not None), reason)

    def _expire_groups(self) -> None:
        horizon = time.monotonic() - self.settings.group_timeout_s
        for group_id in [g for g, group in self.groups.items() if group.started < horizon]:
            group = self.groups.pop(group_id)
            self.closed_groups.add(group_id)
            self._drop([s for _, samples in group.episodes for s in samples], "incomplete")

    # --- steps --------------------------------------------------------------------------------------

    def _find_trainers(self) -> bool:
        """Ask the registry for the trainer ranks until ``settings.trainers`` of them are live."""
        if len(self.sink.trainers) >= self.settings.trainers:
            return True
        assert self.runtime.control is not None
        try:
            listed = self.runtime.control.request(Nodes(role="trainer")).body
        except (RemoteError, RequestTimeout) as exc:
            log.warning("trainers.lookup_failed", error=str(exc))
            return False
        assert isinstance(listed, NodeList)
        trainers = [TrainerAddress.from_node(node) for node in listed.nodes]
        if len(trainers) < self.settings.trainers:
            return False
        self.sink.use_trainers(trainers)
        log.info("trainers.found", ranks=[t.rank for t in self.sink.trainers])
        return True

    def _ship_ready(self) -> None:
        per_step = self.settings.group_size * self.settings.groups_per_step
        sink = self.sink
        while len(sink.queue) >= per_step and not (self.settings.max_steps and self.step >= self.settings.max_steps):
            if not self._find_trainers():
                return
            try:
                plan = sink.ship(self.step, self.policy_version, max_samples=per_step)
            except DeliveryError as exc:
                log.error("step.undelivered", step=self.step, error=str(exc))
                return
            if plan is None:
                continue
            log.info("step.shipped", step=self.step, version=self.policy_version,
                     micro_batches=plan.micro_batches_per_rank, dummies=plan.dummy_count)
            self.step += 1
        if self.settings.max_steps and self.step >= self.settings.max_steps and sink.queue:
            queued, sink.queue = sink.queue, []
            self._drop(queued, "max_steps")

    def close(self) -> None:
        """Shutdown: delete what is queued or still grouped."""
        for group in self.groups.values():
            self._drop([s for _, samples in group.episodes for s in samples], "shutdown")
        self.groups.clear()
        queued, self.sink.queue = self.sink.queue, []
        self._drop(queued, "shutdown")

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
                      lambda: {(reason,): float(n) for reason, n in self.dropped.items()}, labels=("reason",))


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node orchestrator``: serve until SIGINT/SIGTERM."""
    runtime = NodeRuntime("orchestrator", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    Orchestrator(runtime, OrchestratorSettings(**dataclasses.asdict(config.orchestrator)))
    runtime.run()
    return 0
