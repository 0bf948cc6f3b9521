"""`refbus node trainer`: one trainer rank of the RL loop (torch.distributed with gloo on CPU).

Each step: wait for this rank's step batch (references only), fetch and assemble the arrays
(:class:`~refbus.nodes.payload.trainer_rank.TrainerRank`), run the configured train step with router replay,
delete the step's blobs, then push this rank's share of the weights as the next version: the parameter
server commits the version once every rank's shard is in, and publishes ``version-bump``.

Ranks come from the config or from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` with ``trainer.init_method = "env://"``). Every rank is its own data rank. Before the
first step, every rank pushes the initial weights as version 0, so rollout workers have something to
serve.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ...bus.runtime import NodeRuntime, on_signals
from ..config import Config
from ..entry_points import load_entry_point
from ..payload.assemble import AssembledBatch, packed_position_ids
from ..payload.trainer_rank import StepBatches, StepFailed, TrainerRank
from ..ps.client import PsClient

log = structlog.get_logger(__name__)


def shard_of(state: Mapping[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's share of a replicated state dict: every ``world``-th tensor from ``rank`` (in name
    order), so the ranks push disjoint shards that together make the whole version."""
    names = sorted(state)
    return {name: state[name].detach() for name in names[rank::world]}


def micro_batches(step: StepBatches) -> list[dict[str, Any]]:
    """The train step's micro batches: assembled arrays plus the orchestrator's inline inputs.

    The loss mask is the assembly's (no loss on padding, dummies, dropped micro batches) AND the sample's
    own completion mask; position ids restart at every packed sample.
    """
    return [_micro_batch(batch, inputs) for batch, inputs in zip(step.batches, step.inputs, strict=True)]


def _micro_batch(batch: AssembledBatch, inputs: Mapping[str, Any]) -> dict[str, Any]:
    length = batch.length
    completion = torch.as_tensor(inputs["loss_mask"], dtype=torch.bool).reshape(1, length)
    return {
        "input_ids": torch.as_tensor(inputs["input_ids"], dtype=torch.long).reshape(1, length),
        "advantages": torch.as_tensor(inputs["advantages"], dtype=torch.float32).reshape(1, length),
        "loss_mask": batch.loss_mask & completion,
        "position_ids": packed_position_ids([packed.kept for packed in batch.micro_batch.samples], length),
        "routed_experts": batch.routed_experts,
        "topk_ids": batch.topk_ids,
        "topk_logprobs": batch.topk_logprobs,
        "topk_valid": batch.topk_valid,
        "sampling_mask": batch.sampling_mask,
    }


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node trainer``: train ``trainer.steps`` steps, then exit."""
    section, rl = config.trainer, config.rl
    torch.set_num_threads(rl.torch_threads)
    rank = section.rank if section.rank >= 0 else int(os.environ["RANK"])
    world = section.world_size if section.world_size >= 0 else int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=section.init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=section.batch_timeout_s))
    runtime = NodeRuntime("trainer", config.runtime(node_id=args.node_id or f"trainer-{rank}",
                                                    ready_file=args.ready_file))
    trainer = TrainerRank(runtime, settings=section)
    runtime.labels["steps"] = str(section.steps)  # this rank's budget: the orchestrator ships no more steps
    ps = PsClient(runtime, config.ps.manager)
    model = load_entry_point(rl.policy)(rl.seed)
    optimizer = load_entry_point(rl.optimizer)(model, rl.lr)
    train_step = load_entry_point(rl.train_step)
    # SIGINT/SIGTERM end the run after the step in progress (its blobs deleted, its weights pushed): the node
    # loop keeps serving until then, and stops once the training loop is done with it. The shutdown clock
    # starts at the signal: a step that cannot finish in time (a peer rank gone, mid-collective) is cut off.
    with on_signals(lambda: (trainer.interrupt(), runtime.begin_shutdown())):
        try:
            runtime.start_background()
            ps.push(shard_of(model.state_dict(), rank, world), 0, rank=rank, world=world)
            for step in range(section.steps):
                try:
                    batches = trainer.begin_step(step)
                except StepFailed:
                    if trainer.interrupted:  # asked to stop while waiting for work: not a failure
                        break
                    raise
                metrics = train_step(model, optimizer, micro_batches(batches), temperature=rl.temperature)
                trainer.end_step(step)
                ps.push(shard_of(model.state_dict(), rank, world), step + 1, rank=rank, world=world)
                log.info("step.trained", step=step, dropped=batches.dropped_global,
                         fetch_s=round(batches.fetch.seconds, 4), **_rounded(metrics))
                if trainer.interrupted:
                    break
        finally:
            runtime.join()
            dist.destroy_process_group()
    return 0


def _rounded(metrics: Mapping[str, float], digits: int = 4) -> dict[str, float]:
    return {key: round(float(value), digits) for key, value in metrics.items()}

