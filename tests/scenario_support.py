"""Pieces of ``test_payload_scenario``: the episodes it feeds, the trainer-rank process it spawns (importable
by a ``multiprocessing`` "spawn" child), an env server whose fetches fail, and a registry poller.

Sample ids follow the orchestrator's rule: ``<episode_id>/<index>`` with ``index`` the sample's entry in
``info["samples"]``.
"""

from __future__ import annotations

import os
import pickle
import traceback
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq
from refbus.bus.reqrep import Client, HandlerError, RetryPolicy
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.payload.env_server import EnvServer
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Blobs, Fetch, Keep, NodeInfo, NodeList, Nodes, Ok, StepBatch

T = TypeVar("T")

WAIT_S = 30.0
POLL_S = 0.02
SEQ_LEN = 64
LAYERS, TOP_K = 3, 2  # routing shape of every routed sample
HEADS_K = 3  # sampler top-k width
TENSORS = ("loss_mask", "routed_experts", "sampling_mask", "topk_ids", "topk_logprobs", "topk_valid")
INLINE = ("input_ids", "loss_mask", "advantages")  # per-token inputs the orchestrator ships with a micro batch


# --- what the test feeds -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleSpec:
    """One trainable sequence and which arrays its env server keeps (none at all: no branch, ``ref: -1``)."""

    tokens: int
    routing: type[np.unsignedinteger] | None = None  # np.uint8 / np.uint16 routed_experts
    heads: bool = False  # sampler top-k ids and logprobs
    mask: bool = False  # sampling mask

    @property
    def keeps_arrays(self) -> bool:
        return self.routing is not None or self.heads or self.mask

    def arrays(self, sample_id: str) -> dict[str, np.ndarray]:
        """The branch for this sample, deterministic in ``sample_id``."""
        rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
        out: dict[str, np.ndarray] = {}
        if self.routing is not None:
            high = 1000 if self.routing is np.uint16 else 256
            out["routed_experts"] = rng.integers(0, high, (self.tokens, LAYERS, TOP_K)).astype(self.routing)
        if self.heads:
            out["topk_ids"] = rng.integers(0, 50_000, (self.tokens, HEADS_K)).astype(np.int32)
            out["topk_logprobs"] = -rng.random((self.tokens, HEADS_K), dtype=np.float32) * 5
        if self.mask:
            counts = rng.integers(0, 4, self.tokens).astype(np.int32)
            out["mask_ids"] = rng.integers(0, 50_000, int(counts.sum())).astype(np.int32)
            out["mask_counts"] = counts
        return out

    def inline(self, sample_id: str) -> tuple[list[int], list[int]]:
        """``input_ids`` and ``loss_mask`` lists for the episode record (prompt: the first 3 tokens)."""
        rng = np.random.default_rng(zlib.crc32(sample_id.encode()) + 1)
        ids = rng.integers(0, 50_000, self.tokens).tolist()
        return ids, [0] * min(3, self.tokens) + [1] * max(0, self.tokens - 3)


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    env: str  # node id of the env server that keeps it
    group: str
    reward: float
    samples: tuple[SampleSpec, ...]
    version: int = 0
    eval: bool = False

    def sample_ids(self) -> list[str]:
        return [f"{self.episode_id}/{index}" for index in range(len(self.samples))]

    def keep(self) -> Keep:
        """The ``keep`` request: one branch per sample that keeps arrays, the rest ``ref: -1``."""
        branches: list[dict[str, np.ndarray]] = []
        entries: list[dict[str, Any]] = []
        for sample_id, spec in zip(self.sample_ids(), self.samples, strict=True):
            ids, loss = spec.inline(sample_id)
            ref = -1
            if spec.keeps_arrays:
                ref = len(branches)
                branches.append(spec.arrays(sample_id))
            entries.append({"input_ids": ids, "loss_mask": loss, "ref": ref})
        info = {"group": self.group, "reward": self.reward, "eval": self.eval, "samples": entries}
        return Keep(episode_id=self.episode_id, branches=branches, policy_version=self.version, info=info)


@dataclass(frozen=True)
class Sent:
    """One sample as the test sent it, and the blob its env server kept for it (None: no arrays)."""

    sample_id: str
    spec: SampleSpec
    episode: EpisodeSpec
    blob_id: str | None

    @property
    def kept(self) -> int:
        return min(self.spec.tokens, SEQ_LEN)


# --- expected assembled rows ---------------------------------------------------------------------------------


def routing_dtype(sents: Iterable[Sent]) -> np.dtype:
    """The routing dtype a micro batch of ``sents`` is assembled in: its wire dtype, uint16 as soon as one
    routed sample carries it."""
    dtypes = {a["routed_experts"].dtype for s in sents if "routed_experts" in (a := s.spec.arrays(s.sample_id))}
    return np.dtype(np.uint16) if np.dtype(np.uint16) in dtypes else np.dtype(np.uint8)


def expected_rows(sent: Sent, name: str, shape: tuple[int, ...], *, dummy: bool, routing: np.dtype) -> np.ndarray:
    """What assembly must write for ``sent`` into tensor ``name`` (rows cut to the kept count; ``shape`` is
    the dumped rows' shape, which fixes the micro batch's mask width; ``routing`` the micro batch's routing
    dtype, :func:`routing_dtype`). Fields the sample lacks (all but routing in a dummy) are padding."""
    kept = sent.kept
    arrays = sent.spec.arrays(sent.sample_id)
    fields = set(arrays) & {"routed_experts"} if dummy else set(arrays)
    has = fields.__contains__
    if name == "loss_mask":
        return np.full(kept, not dummy)
    if name == "routed_experts":
        return arrays["routed_experts"][:kept].astype(routing) if has(name) else np.zeros(shape, routing)
    if name == "topk_ids":
        return arrays["topk_ids"][:kept].astype(np.int64) if has(name) else np.zeros(shape, np.int64)
    if name == "topk_logprobs":
        return arrays["topk_logprobs"][:kept] if has("topk_ids") else np.zeros(shape, np.float32)
    if name == "topk_valid":
        return np.full(kept, has("topk_ids"))
    if name == "sampling_mask":
        dense = np.full(shape, -1, np.int32)
        if has("mask_ids"):
            counts = arrays["mask_counts"][:kept]
            dense[np.arange(shape[1]) < counts[:, None]] = arrays["mask_ids"][: int(counts.sum())]
        return dense
    raise ValueError(f"unknown tensor {name!r}")


def expected_inline(sent: Sent, name: str, advantage: float) -> np.ndarray:
    ids, loss = sent.spec.inline(sent.sample_id)
    values = {"input_ids": np.array(ids, np.int64), "loss_mask": np.array(loss, np.bool_),
              "advantages": np.full(sent.spec.tokens, advantage, np.float32)}[name]
    return values[: sent.kept]


def advantages(rewards: list[float]) -> list[float]:
    """Group-normalised advantages, computed as `Orchestrator._complete` does."""
    values = np.array(rewards, dtype=np.float64)
    return [float(a) for a in (values - values.mean()) / (values.std() + 1e-6)]


# --- an env server whose fetches fail ------------------------------------------------------------------------


class FlakyEnvServer(EnvServer):
    """Keeps, claims and deletes like any env server, but answers every ``fetch`` with its ids as missing
    (a store that lost the bytes): the injected fetch failure. ``refused`` lists the ids it refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[str] = []
        self.server.on(Fetch.kind, self._refuse_fetch, cached=False)

    def _refuse_fetch(self, request: Message) -> Blobs:
        body = request.body
        assert isinstance(body, Fetch)
        self.refused.extend(body.blob_ids)
        return Blobs(blobs=[], missing=list(body.blob_ids))


class RecordingTrainer:
    """A stand-in trainer rank without torch: registers like a ``TrainerRank`` (``trainer`` endpoint, rank
    labels), acknowledges step batches as a ``TrainerRank`` does (another batch for a step it has is refused
    as ``duplicate-step``, an identical repeat of its latest is ok) and keeps each new one in ``batches``.
    ``refuse_first``: refuse the first step batch (``not-ready``), as a rank that is not ready yet. Runs in a
    background thread."""

    def __init__(self, control: str, rank: int = 0, *, refuse_first: bool = False) -> None:
        self.runtime = NodeRuntime("trainer", RuntimeSettings(bus=control, node_id=f"trainer-{rank}", metrics_port=-1))
        self.runtime.labels.update(rank=str(rank), data_rank=str(rank), leader="1")
        self.batches: list[StepBatch] = []
        self.refused: list[StepBatch] = []
        self.repeats = 0
        self.refuse_first = refuse_first
        self.runtime.serve("trainer", "tcp://127.0.0.1:0").on(StepBatch.kind, self._on_step_batch)
        # A TrainerRank's heartbeat status: the step it trains next (it trains none) and the last accepted.
        self.runtime.status = lambda: {"step": 0.0, "received": float(self.batches[-1].step if self.batches else -1)}

    def _on_step_batch(self, request: Message) -> Ok:
        batch = request.body
        assert isinstance(batch, StepBatch)
        if self.refuse_first and not self.refused:
            self.refused.append(batch)
            raise HandlerError("not-ready", f"rank {batch.rank} is not ready yet")
        if self.batches and _encoded(batch) == _encoded(self.batches[-1]):
            self.repeats += 1
            return Ok()
        if any(b.step == batch.step for b in self.batches):
            raise HandlerError("duplicate-step", f"rank {batch.rank} already has step {batch.step}")
        self.batches.append(batch)
        return Ok()


def _encoded(batch: StepBatch) -> bytes:
    """A step batch's content, comparable (its inline arrays as bytes)."""
    inputs = [{name: np.asarray(a).tobytes() for name, a in mb.inputs.items()} for mb in batch.micro_batches]
    samples = [mb.samples for mb in batch.micro_batches]
    return msgspec.msgpack.encode((batch.step, batch.rank, batch.owned, samples, inputs))


# --- the registry ---------------------------------------------------------------------------------------


class Registry:
    """Requests to the broker from the test thread (its own socket), and bounded polling."""

    def __init__(self, control: str) -> None:
        self.ctx = zmq.Context()
        self.client = Client(self.ctx, control, WireCodec("scenario-test"), policy=RetryPolicy(timeout_s=5, attempts=2))

    def nodes(self, role: str = "") -> dict[str, NodeInfo]:
        reply = self.client.request(Nodes(role=role)).body
        assert isinstance(reply, NodeList)
        return {node.node_id: node for node in reply.nodes}

    def close(self) -> None:
        self.client.close()
        self.ctx.destroy(linger=0)


# --- the trainer-rank process ----------------------------------------------------------------------------


@dataclass
class StepDump:
    """What one rank trained in one step (arrays copied out of the pool)."""

    step: int
    dropped: tuple[int, ...]
    dropped_global: int
    failures: list[str]  # reasons of this rank's local fetch failures
    micro_batches: list[dict[str, Any]] = field(default_factory=list)
    deleted: tuple[str, ...] = ()
    violations: tuple[str, ...] = ()
    failed_deletes: tuple[str, ...] = ()


@dataclass
class RankDump:
    rank: int
    steps: list[StepDump] = field(default_factory=list)
    error: str = ""
    dropped_metric: float | None = None
    held_metric: float | None = None


def _micro_batches(result: Any) -> list[dict[str, Any]]:
    """Per micro batch: dummy/dropped flags and, per sample, its span and rows of every tensor and input."""
    out = []
    for batch, inputs in zip(result.batches, result.inputs, strict=True):
        mb = batch.micro_batch
        samples = []
        for packed in mb.samples:
            span = slice(packed.offset, packed.stop)
            rows = {name: getattr(batch, name)[0, span].numpy().copy() for name in TENSORS
                    if getattr(batch, name) is not None}
            inline = {name: np.asarray(inputs[name])[span].copy() for name in INLINE if name in inputs}
            samples.append({"sample_id": packed.sample.sample_id, "offset": packed.offset, "kept": packed.kept,
                            "rows": rows, "inline": inline})
        out.append({"dummy": mb.dummy, "dropped": batch.dropped, "length": mb.length,
                    "loss_any": bool(batch.loss_mask.any()), "samples": samples})
    return out


def rank_main(rank: int, world: int, init: str, bus: str, steps: int, dump_path: str) -> None:
    """One trainer rank: join gloo and the bus, run ``steps`` steps, dump what it trained to ``dump_path``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    from prometheus_client import REGISTRY
    from refbus.bus.logs import configure_logging
    from refbus.bus.runtime import NodeRuntime, RuntimeSettings
    from refbus.nodes.payload.fetcher import FetchFailure, FetchSettings
    from refbus.nodes.payload.trainer_rank import TrainerRank
    from refbus.nodes.settings import TrainerSettings

    torch.set_num_threads(1)
    configure_logging(level="error")
    dump = RankDump(rank)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=WAIT_S))
        runtime = NodeRuntime("trainer", RuntimeSettings(bus=bus, node_id=f"trainer-{rank}", metrics_port=0,
                                                         connect_timeout_s=WAIT_S))
        policy = RetryPolicy(timeout_s=2.0, attempts=3)
        trainer = TrainerRank(runtime, settings=TrainerSettings(batch_timeout_s=WAIT_S), topk_k=HEADS_K,
                              fetch=FetchSettings(policy=policy))
        runtime.start_background()
        try:
            for step in range(steps):
                result = trainer.begin_step(step)
                record = StepDump(step, result.dropped, result.dropped_global,
                                  [b.reason for b in result.fetch.batches if isinstance(b, FetchFailure)],
                                  _micro_batches(result))
                release = trainer.end_step(step)
                record.deleted, record.violations, record.failed_deletes = (
                    release.deleted, release.violations, release.failed)
                dump.steps.append(record)
            dump.dropped_metric = REGISTRY.get_sample_value("refbus_dropped_micro_batches_total")
            dump.held_metric = REGISTRY.get_sample_value("refbus_trainer_blobs_held")
        finally:
            runtime.join(WAIT_S)
            dist.destroy_process_group()
    except BaseException:
        dump.error = traceback.format_exc()
        raise
    finally:
        tmp = Path(f"{dump_path}.tmp")
        tmp.write_bytes(pickle.dumps(dump))
        tmp.replace(dump_path)


def read_dump(path: Path) -> RankDump:
    dump = pickle.loads(path.read_bytes())
    assert isinstance(dump, RankDump)
    return dump
