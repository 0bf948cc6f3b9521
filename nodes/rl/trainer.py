"""`refbus node trainer`: one trainer rank of the RL loop (torch.distributed with gloo on CPU).

Each step: wait for this rank's step batch (references only), fetch and assemble the arrays
(:class:`~refbus.nodes.payload.trainer_rank.TrainerRank`), run the configured train step with router replay,
delete the step's blobs, then push this rank's share of the weights as the next version: the parameter
server commits the version once every rank's shard is in, and publishes ``version-bump``. A step every rank
agreed to skip (nothing of it fetched anywhere: its stores died with its blobs; or a data rank unable to stand
in for its dropped micro batches) trains nothing and pushes the same weights as the next version; the world
goes on, for at most ``trainer.skip_limit`` steps in a row.

Ranks come from the config or from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` with ``trainer.init_method = "env://"``). Every rank is its own data rank.

**Checkpoints and restarts.** With ``trainer.checkpoint_every`` N > 0, every rank writes its weights,
optimizer state and step every N steps (:mod:`.checkpoint`, under ``trainer.checkpoint_dir``). A world that
starts agrees on where to resume: each rank reads the newest checkpoint it has whole, and one ``all_gather``
then ``all_reduce(MIN)`` rounds (:func:`agreed_step`) give the newest step K that every rank has; every rank
loads K, moves its checkpoints above K aside (an earlier world's, or ones another rank lost or holds damaged,
which would outrank this world's: :func:`checkpoint.prune`, a warning per file naming the ranks that hold
less) and trains K, K+1, ... (K = 0 with no checkpoint: the initial weights). A checkpoint K that reads back
whole but is another model's or optimizer's (the configuration changed) is refused as a configuration error:
exit status 2, which ends the run rather than spend the restart budget agreeing on it again; so is a checkpoint
directory a rank may not list or write in (permission denied, a read-only filesystem, or a file where a directory
must be), naming it. A rank that cannot write its checkpoint (a full disk) exits 1 at once naming the file, as a
crash: the world restarts from the step every rank has (going on without it, the ranks' checkpoints would part
ways until none had a step in common). Before its first
step, every rank pushes its starting weights as version K declaring that it resumes (``resumes``), so the
parameter server starts a new lineage there (a dead world's versions above K are retired) and rollout workers
have something to serve. Its heartbeat status reports ``step`` K at once, for the orchestrator to continue
from. Every push names the world's token (:func:`world_token`, drawn at its start): a rank whose push starts
over after a ps-manager restart joins the ranks of its own world the manager restored, never a dead world's.

**A dead peer ends the world.** A rank that learns (``runtime.track_peers()``) that a rank of its own world
went down logs ``trainer.world_broken`` naming it and exits with status 1 at most half a
``bus.node_timeout_s`` later (stopping its node first, so its bye reaches the bus), whatever it was doing: a
collective with a dead peer would otherwise block until its timeout. The broker reports the dead rank
within a node timeout, so the world is gone within two. A rank reported down only because a restarted
broker's registry lacked it (late to re-join) ends the world if it is not back as the same process a node
timeout later. What the world held is reclaimed by the stores (``holder-down``)
unless a new world claims it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ...bus.peers import ABSENT_AFTER_RESTART
from ...bus.runtime import NodeRuntime, on_signals
from ...protocol.messages import NodeDown, NodeInfo
from ..config import Config, ConfigError
from ..entry_points import load_entry_point
from ..payload.assemble import AssembledBatch, packed_position_ids
from ..payload.fetcher import ModelLimits
from ..payload.trainer_rank import StepBatches, StepFailed, StepSkipped, TrainerRank
from ..ps.client import PsClient
from ..settings import TrainerSettings
from . import checkpoint

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


EXPERT_COUNTS = ("n_experts", "num_experts", "num_local_experts", "n_routed_experts")
"""Names a model's ``config`` gives its expert count under: the toy policy's, then Hugging Face MoE configs'."""


def model_limits(model: torch.nn.Module) -> ModelLimits:
    """The ids ``model`` has rows for, from its ``config`` (the toy policy's and Hugging Face models' convention):
    ``vocab_size``, and the expert count under the first of :data:`EXPERT_COUNTS` it has. A bound the model does
    not define (no such attribute, or not a positive int) is None: not checked."""
    config = getattr(model, "config", None)

    def bound(*names: str) -> int | None:
        value = next((getattr(config, name) for name in names if hasattr(config, name)), None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    return ModelLimits(vocab_size=bound("vocab_size"), experts=bound(*EXPERT_COUNTS))


def rank_and_world(section: TrainerSettings, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """This rank and its world size: ``trainer.rank`` and ``trainer.world_size``, each where -1 read from
    ``$RANK`` and ``$WORLD_SIZE`` (as torchrun sets them). :class:`ConfigError` naming what to set when one is
    in neither, or not a whole number, or the rank is not below the world size (torch would wait for the
    world's rendezvous until its timeout)."""

    def given(value: int, key: str, variable: str) -> int:
        if value >= 0:
            return value
        text = environ.get(variable, "")
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(f"{key} is -1 (read ${variable}) but ${variable} is "
                              f"{'not set' if variable not in environ else repr(text)}: run the rank under "
                              f"torchrun, or set ${variable} or give --{key.replace('.', '-').replace('_', '-')}")
        return int(text)

    rank = given(section.rank, "trainer.rank", "RANK")
    world = given(section.world_size, "trainer.world_size", "WORLD_SIZE")
    if not rank < world:
        raise ConfigError(f"trainer.rank {rank} is not below trainer.world_size {world}: ranks count from 0")
    return rank, world


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node trainer``: train ``trainer.steps`` steps, then exit."""
    section, rl = config.trainer, config.rl
    torch.set_num_threads(rl.torch_threads)
    rank, world = rank_and_world(section)
    dist.init_process_group("gloo", init_method=section.init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=section.batch_timeout_s))
    pids = world_pids(world)
    token = world_token()
    model = load_entry_point(rl.policy)(rl.seed)
    optimizer = load_entry_point(rl.optimizer)(model, rl.lr)
    train_step = load_entry_point(rl.train_step)
    first = resume(section, rank, model, optimizer)
    runtime = NodeRuntime("trainer", config.runtime(node_id=args.node_id or f"trainer-{rank}",
                                                    ready_file=args.ready_file))
    trainer = TrainerRank(runtime, settings=section, first_step=first, restart_grace_s=config.node.restart_grace_s,
                          max_staleness=config.orchestrator.max_staleness, seq_len=config.orchestrator.seq_len,
                          limits=model_limits(model))
    runtime.labels["steps"] = str(section.steps)  # this rank's budget: the orchestrator ships no more steps
    collectives_done = threading.Event()  # past the last step's collective: a peer that leaves breaks nothing
    broken = end_world_on_peer_death(runtime, trainer, pids, collectives_done,
                                     exit_within_s=config.bus.node_timeout_s)
    ps = PsClient(runtime, config.ps.manager)
    # SIGINT/SIGTERM end the run after the step in progress (its blobs deleted, its weights pushed): the node
    # loop keeps serving until then, and stops once the training loop is done with it. The shutdown clock
    # starts at the signal: a step that cannot finish in time (a peer rank gone, mid-collective) is cut off.
    with on_signals(lambda: (trainer.interrupt(), runtime.begin_shutdown())):
        try:
            runtime.start_background()
            if first >= section.steps:
                collectives_done.set()  # nothing left to train: the start-up collectives were the last ones
            ps.push(shard_of(model.state_dict(), rank, world), first, rank=rank, world=world, resumes=True,
                    world_token=token)
            for step in range(first, section.steps):
                try:
                    batches: StepBatches | None = trainer.begin_step(step)
                except StepSkipped:
                    batches = None  # every rank skips it (begin_step logged why): the weights stay as they are
                except StepFailed:
                    if trainer.interrupted and not trainer.broken:  # asked to stop while waiting: not a failure
                        break
                    raise
                if step == section.steps - 1:
                    # The last collective every rank is sure to make is begin_step's agreement; one inside a
                    # user's train_step cannot return on a peer before this rank entered it too. So a peer
                    # that trains faster and leaves from here on has finished, not died.
                    collectives_done.set()
                if batches is not None:
                    metrics = train_step(model, optimizer, micro_batches(batches), temperature=rl.temperature)
                trainer.end_step(step)
                # A skipped step still publishes its version (the same weights): rollouts and the orchestrator's
                # staleness count steps, and the next step's push must follow this one.
                ps.push(shard_of(model.state_dict(), rank, world), step + 1, rank=rank, world=world,
                        world_token=token)
                if section.checkpoint_every and (step + 1) % section.checkpoint_every == 0:
                    path = checkpoint.save(section.checkpoint_dir, rank, step + 1, model, optimizer)
                    log.info("checkpoint.written", step=step + 1, path=str(path))
                if batches is not None:
                    log.info("step.trained", step=step, dropped=batches.dropped_global,
                             fetch_s=round(batches.fetch.seconds, 4), **_rounded(metrics))
                if trainer.interrupted:
                    break
        except RuntimeError as exc:
            # gloo may see a dead peer first: the peer view names it, exits. A checkpoint that cannot be written
            # (a full disk) is this rank's own failure: it exits at once, naming the file. So does a rank whose node has
            # closed (its start failed): no peer view is left to name anyone, and only the exit watchdog would end the
            # wait.
            if not isinstance(exc, StepFailed | checkpoint.CheckpointError) and not runtime.closed:
                broken.wait(config.bus.node_timeout_s * 1.5)
            raise
        finally:
            runtime.join()
            dist.destroy_process_group()
    return 0


def world_pids(world: int) -> dict[int, int]:
    """Rank -> process id of every rank of this world (one ``all_gather`` of int64s): what tells this world's
    ranks from those of an earlier world that registered under the same node ids."""
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))
    return {rank: int(pid.item()) for rank, pid in enumerate(pids)}


def world_token() -> str:
    """A token every rank of this world shares and no other world has (collective: rank 0 draws 64 random bits
    and broadcasts them): the parameter server lets a resuming push join the ranks a restarted ps-manager
    restored only for the same token. Pids would not do: a world restarted in containers has the same ones."""
    token = torch.tensor([int.from_bytes(os.urandom(8), "little", signed=True)], dtype=torch.int64)
    dist.broadcast(token, src=0)
    return f"{int(token.item()) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def resume(section: TrainerSettings, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step this world starts at (collective: every rank calls it): the newest checkpoint step every rank
    has whole (:func:`agreed_step`), loaded into ``model`` and ``optimizer``; 0 (nothing loaded) when
    checkpoints are off or some rank has none. Once loaded, each rank's checkpoints above that step (an
    earlier lineage, or ones a rank holding less forces this world below) are moved aside
    (:func:`checkpoint.prune`, naming the ranks that hold less): left in place, they would be taken for this
    world's; removed, one rank's damaged disk would cost every rank its progress. A checkpoint agreed on that
    does not fit ``model`` and ``optimizer`` (another model's: the configuration changed) raises
    :class:`ConfigError` naming the file, before anything is moved: final, as a restart would refuse it again. So
    does a checkpoint directory this rank may not list or write in (:class:`checkpoint.CheckpointDirUnusable`),
    naming it."""
    if not section.checkpoint_every:
        return 0
    # Both refusals are final: a restarted world would meet them again, each time out of the restart budget.
    try:
        mine = checkpoint.latest_step(section.checkpoint_dir, rank)
        checkpoint.check_writable(section.checkpoint_dir, rank)  # before any collective: a peer waits on none
        agreement = agreed_step(section.checkpoint_dir, rank, mine)
        step = agreement.step
        if step:
            checkpoint.load(section.checkpoint_dir, rank, step, model, optimizer)
        checkpoint.prune(section.checkpoint_dir, rank, step, cause=agreement.cause())
    except checkpoint.CheckpointMismatch as exc:
        # A checkpoint of another model or optimizer than those configured (one that cannot be read now, after it
        # was checked for the agreement, is a crash: restarted).
        raise ConfigError(f"{exc}: rl.policy and rl.optimizer are not those that wrote trainer.checkpoint_dir "
                          f"{section.checkpoint_dir}; configure those, or another trainer.checkpoint_dir, or "
                          "move its files aside") from None
    except checkpoint.CheckpointDirUnusable as exc:
        raise ConfigError(f"{exc}: trainer.checkpoint_dir {section.checkpoint_dir} and its rank-<rank> directories "
                          f"must be directories this rank's user (uid {os.getuid()}) may list, read and write; "
                          "give it that access, or configure another trainer.checkpoint_dir") from None
    log.info("trainer.resumed" if step else "trainer.fresh_start", step=step, rank=rank, newest_here=mine,
             checkpoint_dir=section.checkpoint_dir)
    return step


@dataclass(frozen=True)
class Agreement:
    """Where a world resumes (``step``) and what each rank held (``held[r]``: rank r's newest whole
    checkpoint step and the newest step it has a file named for, readable or not)."""

    step: int
    held: tuple[tuple[int, int], ...]

    def cause(self) -> str:
        """Why the world resumes at ``step``, for a rank whose newer checkpoints are moved aside: the ranks
        holding the least, each with its newest whole step and its newest file when that one is newer
        (unreadable: torn, damaged or not a checkpoint)."""
        least = min(whole for whole, _ in self.held)
        behind = []
        for rank, (whole, named) in enumerate(self.held):
            if whole == least:
                unreadable = f", its step-{named} file unreadable (rank-{rank}/step-{named}.safetensors)" \
                    if named > whole else ""
                behind.append(f"rank {rank} has nothing whole above step {whole}{unreadable}")
        if least > self.step:
            behind.append(f"no step from {self.step + 1} to {least} is whole on every rank (the ranks hold "
                          "different lineages)")
        return "; ".join(behind)


def agreed_step(directory: str, rank: int, newest: int) -> Agreement:
    """The newest checkpoint step every rank has whole (collective: every rank calls it; ``newest``: this
    rank's own newest), with what each rank held. One ``all_gather`` of each rank's newest whole step (and
    newest file, to name it when the world goes below it) gives the lowest and the highest: equal, every
    rank has that step; else each round every rank proposes its newest step not above the lowest and one
    ``all_reduce(MIN)`` of (proposal, -proposal) gives the lowest and the highest again; the lowest falls
    every round (down to 0, which every rank has). Ranks of one lineage agree at once, or in one more round
    when some rank is a checkpoint behind; ranks holding an earlier world's files that got further take a
    round per step they disagree on."""
    mine = torch.tensor([newest, checkpoint.newest_file(directory, rank)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    held = tuple((int(t[0].item()), int(t[1].item())) for t in gathered)
    lowest, highest = min(whole for whole, _ in held), max(whole for whole, _ in held)
    while lowest != highest:
        proposal = checkpoint.latest_step(directory, rank, at_most=lowest)
        extremes = torch.tensor([proposal, -proposal], dtype=torch.int64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        lowest, highest = int(extremes[0].item()), -int(extremes[1].item())
    return Agreement(lowest, held)


def end_world_on_peer_death(runtime: NodeRuntime, trainer: TrainerRank, pids: Mapping[int, int],
                            collectives_done: threading.Event, *, exit_within_s: float) -> threading.Event:
    """When a rank of this world (``pids``: rank -> pid) is reported down, this process ends with status 1,
    naming it: the node is stopped (its bye reaches the bus) for up to half of ``exit_within_s``, then the
    process exits whatever the training loop is doing (it may be blocked in a collective with the dead
    rank). Down events of other processes (an earlier world's ranks, under the same node ids) are ignored,
    and so is every one once ``collectives_done`` is set (the last step's collective is behind this rank:
    a peer that finished first and left is no failure) or this rank is stopping itself. A rank a restarted
    broker's registry lacked (reason ``absent-after-broker-restart``: late to re-join, perhaps not dead) ends
    the world only if it is not back as the same process ``exit_within_s`` later; a dead one is noticed sooner
    by any collective with it. Returns the event set once the world is known broken."""
    broken = threading.Event()
    peers = runtime.track_peers()

    def rank_of(info: NodeInfo | None) -> int | None:
        """The rank of this world that ``info`` is (its process), None for anyone else or when it no longer
        matters (past the last collective, stopping, or already broken)."""
        if collectives_done.is_set() or trainer.interrupted or trainer.broken or info is None:
            return None
        if info.role != "trainer" or not info.labels.get("rank", "").isdigit():
            return None
        rank = int(info.labels["rank"])
        return rank if pids.get(rank) == info.pid else None

    def end_world(down: NodeDown, info: NodeInfo, dead: int) -> None:
        reason = f"trainer rank {dead} ({down.node_id}, pid {info.pid}) went down ({down.reason})"
        log.error("trainer.world_broken", rank=trainer.rank, dead_rank=dead, dead_node=down.node_id,
                  why=down.reason, exit_status=1)
        trainer.abort(reason)
        broken.set()
        threading.Thread(target=_exit_broken, args=(runtime, exit_within_s / 2), name="refbus-world-broken",
                         daemon=True).start()

    def still_absent(down: NodeDown, info: NodeInfo) -> None:
        back = peers.live.get(down.node_id)
        dead = rank_of(info)
        if back is not None and back.pid == info.pid:
            log.info("trainer.peer_back", node=down.node_id, pid=info.pid)
        elif dead is not None:
            end_world(down, info, dead)

    def on_down(down: NodeDown, info: NodeInfo | None) -> None:
        dead = rank_of(info)
        if dead is None or info is None:
            return
        if down.reason == ABSENT_AFTER_RESTART:
            log.warning("trainer.peer_unconfirmed", node=down.node_id, pid=info.pid, wait_s=exit_within_s)
            runtime.later(exit_within_s, lambda: still_absent(down, info))
            return
        end_world(down, info, dead)

    peers.on_down(on_down)
    return broken


def _exit_broken(runtime: NodeRuntime, grace_s: float) -> None:
    runtime.stop()
    loop = runtime.loop_thread
    if loop is not None:
        loop.join(grace_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _rounded(metrics: Mapping[str, float], digits: int = 4) -> dict[str, float]:
    return {key: round(float(value), digits) for key, value in metrics.items()}

