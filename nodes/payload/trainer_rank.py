"""The trainer-rank side of the payload path, embedded in the user's trainer process (one per torch rank).

Protocol of one step, for one rank::

    orchestrator ──step-batch──▶ rank          ack = ownership of ``owned`` moves here; ``reference`` mirrored
    rank ──fetch──▶ env servers ──blobs──▶     begin_step: fetch, verify, assemble (StepFetcher); ``fetch-ack``
    ranks ──all-reduce(failure flags)──        begin_step: agree on what failed; drop it everywhere it is trained
    ... forward / backward / optimizer step ...
    leader ──delete(trained|dropped)──▶ env    end_step: the step's owned blobs, once per data rank

**Data ranks.** Ranks that train the same micro batches (tensor or context parallel peers) form one data
rank. ``data_rank``/``data_ranks`` default to the torch rank and world size (every rank is its own data
rank). With model parallelism pass e.g. ``data_rank=dp_rank, data_ranks=dp_size, leader=(tp_rank == 0)``:
peers receive the same micro batches, and the orchestrator gives ``owned`` to the leader only (a non-leader
refuses a step batch with owned blobs, so a mistake is loud instead of a double delete).

**Agreement.** One ``all_reduce(MAX)`` over an int32 vector of ``data_ranks * M + data_ranks`` entries
(``M`` = micro batches per rank, equal on every rank by packing's invariant, which an ``all_reduce`` of
``(M, -M)`` checks first: ranks entering one collective with vectors of different sizes abort in gloo, so step
batches that break it make every rank skip the step instead): entry ``d * M + i`` is 1 when
micro batch ``i`` of data rank ``d`` failed on any of its ranks, entry ``data_ranks * M + d`` when data rank
``d`` could not stand in for a dropped micro batch (no real routing rows or top-k width in its step).
Every rank reads the same reduced vector, so every rank takes the same decision: drop exactly the flagged
micro batches of its data rank (zero loss, routing repeating real rows, counted), or skip the step on all
ranks (:class:`StepSkipped`) when nothing of the step was fetched anywhere or a data rank is stuck. A
rank enters the all-reduce only after its fetch returned, so it is also the point after which every rank
has fetched: ``end_step`` needs no further collective before deleting. The group must hold every rank
that may fetch a blob of the step (dummies borrow other ranks' blobs): the default world group does.

**Threading.** Sockets belong to the thread that runs the :class:`NodeRuntime` loop, and that loop runs in
its own thread (``runtime.start_background()``), so step batches, heartbeats and events are served while
the training loop computes: the step batch for step N+1 is acknowledged while step N trains, and a step
longer than the broker's ``node_timeout_s`` does not make the rank look dead. ``begin_step``/``end_step``
hand their requests (fetch, delete) to the loop thread (``runtime.call_soon``), which sends them as
asynchronous requests with deadlines (``runtime.calls``) and goes on serving while they are in flight, so a
store that stops answering mid-fetch costs this rank no heartbeat and no step batch; the caller's thread
waits until the last outcome is in, then verifies and assembles the fetched blobs itself (no socket work);
torch.distributed collectives run on the caller's thread. Call them from one thread (the training loop's),
never from the loop thread. :meth:`TrainerRank.interrupt` (safe from signal handlers) makes a waiting
``begin_step`` give up, for a clean shutdown; stop the node with ``runtime.join()`` once the training loop
is done with it.

**Restarted stores.** A durable env server killed and restarted re-adopts its blobs but never sees the
``reference`` events published while it was dead: at its ``node-up`` as a new process, a rank that holds blobs
there asks it a read and, once answered (its subscriptions are live by then), publishes those hand-overs again
(:class:`~.restarts.StoreReturns`; the orchestrator does too, for a rank that died meanwhile). A rank's
``reference`` always names itself: a hand-over counts only when one of its two ends published it (the rank it
names, or the blobs' holder, the orchestrator that claimed them); the stores, the orchestrator and the ledger
refuse one from any other node (logged ``reference.refused``, counted, nothing moved).

Memory ownership: tensors returned by :meth:`TrainerRank.begin_step` live in the fetcher's buffer pool
and are reused by the next ``begin_step``; the caller copies (or moves to the device) what it keeps.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np
import structlog
import torch
import torch.distributed as dist

from ...bus.peers import incarnation
from ...bus.reqrep import HandlerError, split_outcomes
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import (
    CLAIMS_BACK,
    BlobRef,
    Delete,
    Deleted,
    FetchAck,
    NodeInfo,
    Ok,
    Reference,
    StepBatch,
)
from ..settings import OrchestratorSettings, TrainerSettings
from .assemble import AssembledBatch, assemble_dropped
from .branch import TOPK_IDS
from .fetcher import (
    FetchSettings,
    FetchUnfinished,
    ModelLimits,
    PlanError,
    StepFetch,
    StepFetcher,
    blob_refs,
    registry_locator,
    to_micro_batch,
)
from .restarts import Sent, StoreRestarts, StoreReturns, durable_store

log = structlog.get_logger(__name__)

T = TypeVar("T")

FETCH_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TRAINED = "trained"
# Step batches received and not yet begun, at most: the orchestrator ships about max_staleness + 1 steps ahead
# of training, so this is never reached in a run; it bounds what a misbehaving peer can make a rank hold.
RECEIVED_STEPS = 256
# Steps past ``orchestrator.max_staleness`` a step batch may lead the step this rank trains next (see
# TrainerRank._on_step_batch): the orchestrator admits at most ``max_staleness + v + 1`` steps' groups while
# the trainer is at policy version ``v``, and ``v`` never leads the rank's next step, so the last step it ships
# is at most ``max_staleness`` ahead; the margin covers a version that leads by one (published before the
# rank began its next step).
STEPS_AHEAD_MARGIN = 2
ORCHESTRATOR_ROLE = "orchestrator"
DROPPED_REASON = "dropped"


class StepFailed(RuntimeError):
    """The step cannot run: on this rank, its step batch never came (the other ranks see a collective
    timeout), it was interrupted, or the node loop stopped; on every rank, more than ``trainer.skip_limit``
    steps in a row had to be skipped. Stop the run. See :class:`StepSkipped` for the one kind the world
    survives."""


class StepSkipped(StepFailed):
    """Every rank agreed that the step cannot be trained: nothing of it could be fetched anywhere (its stores
    died or lost its blobs), a data rank cannot stand in for its dropped micro batches, or the ranks' step batches
    hold different numbers of micro batches. Raised by
    ``begin_step`` on every rank of the group at once, from the one agreement, so no rank waits in a collective
    the others skip: call ``end_step`` for the step (its owned blobs deleted ``dropped``) and go on with the
    next one, the weights unchanged. Stopping the world instead would cost every step since its last
    checkpoint for one step whose data is gone. At most ``trainer.skip_limit`` steps in a row: the next one
    raises a plain :class:`StepFailed` on every rank (a cause that persists ends the world, loudly)."""


@dataclass(frozen=True, slots=True, eq=False)
class StepBatches:
    """What one rank trains in a step.

    ``batches[i]``: micro batch ``i``'s tensors (``dropped`` set and an all-False loss mask for dropped
    ones); ``inputs[i]``: its inline arrays as the orchestrator sent them (but a dropped one's ``input_ids``
    outside the rank's ``limits``, replaced by 0); ``dropped``: indices this rank
    runs as dropped; ``dropped_global``: micro batches dropped across all data ranks (the run's figure);
    ``fetch``: this rank's fetch (timing, bytes, failure reasons).
    """

    step: int
    batches: tuple[AssembledBatch, ...]
    inputs: tuple[Mapping[str, Any], ...]
    dropped: tuple[int, ...]
    dropped_global: int
    fetch: StepFetch


@dataclass(frozen=True, slots=True)
class StepRelease:
    """What ``end_step`` deleted: ``deleted`` acknowledged; ``violations`` refused by the env server as
    already deleted (logged); ``failed`` not confirmed (no reply, or an error reply: logged; the store
    reclaims them once this rank is gone);
    ``reclaimed`` already reclaimed by the env server from a holder that went down (logged, no longer held);
    ``missing`` never kept by the env server asked (logged)."""

    deleted: tuple[str, ...] = ()
    violations: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    reclaimed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Received:
    batch: StepBatch
    refs: Mapping[str, BlobRef]  # every blob id its micro batches name -> its reference, borrowed ones too (only
    # ``batch.owned`` are this rank's to delete; each is located again when it is deleted)


class TrainerRank:
    """One torch rank's end of the payload path: serves ``step-batch``, fetches before each step, agrees
    on failures with the other ranks, deletes what it owns after the step (see the module doc).

    Construct before ``runtime.start_background()`` (the ``trainer`` endpoint is advertised at registration)
    and after ``dist.init_process_group``. ``group`` defaults to the world. ``settings``: the ``[trainer]``
    section (``endpoint``: where the ``trainer`` ROUTER binds; ``batch_timeout_s``: how long ``begin_step``
    waits for its step batch, and either call for the loop thread to do its socket work). Not user config:
    ``fetch`` (how the fetcher batches and retries), ``blobs_per_delete``, ``topk_k`` (the top-k width, needed
    to stand in for a dropped micro batch with top-k heads when no other micro batch of the step has them).
    ``first_step``: the step this world starts at (a world resumed from its checkpoint of step K starts at
    K); reported as ``step`` in the heartbeat status until the first step batch arrives.
    ``restart_grace_s`` (``node.restart_grace_s``): how long a fetch or a delete waits for a durable store to come
    back. ``max_staleness`` (``orchestrator.max_staleness``): how far ahead of training the orchestrator ships,
    so a step batch further ahead than that (plus :data:`STEPS_AHEAD_MARGIN`) is refused ``step-too-far``.
    ``seq_len`` (``orchestrator.seq_len``): the longest micro batch packing makes, padding included, so one longer
    is refused ``bad-step-batch`` (the rank allocates its tensors, and a stand-in's when it is dropped: a length
    no allocation can hold would end the rank mid-step); None (the default) bounds no length, since only the
    orchestrator's config knows it: a bound of the rank's own would refuse every step batch of an orchestrator
    that packs longer micro batches. The trainer role passes its config's; an embedding framework passes its
    orchestrator's. ``limits``: the ids the model has rows for (:class:`~.fetcher.ModelLimits`); a micro batch
    holding another fails ``out-of-range`` and is dropped on every rank like one that could not be fetched, its
    inline ``input_ids`` given outside the vocabulary replaced by 0 (so its forward takes only ids the model
    can: on CUDA one out of range is a device-side assert that poisons the process's context); None (the default)
    checks none. The trainer role passes its model's.

    Step batches are taken only from a node the registry lists live with role ``orchestrator`` (``src``, which
    CURVE authenticates); any other sender is refused ``not-orchestrator``. A sender this rank has not seen
    register yet (its ``node-up`` still on its way) is refused with ``retry_after_s`` while a registry lookup
    learns of it: the orchestrator sends the batch again.
    """

    def __init__(
        self,
        runtime: NodeRuntime,
        *,
        settings: TrainerSettings | None = None,
        group: dist.ProcessGroup | None = None,
        data_rank: int | None = None,
        data_ranks: int | None = None,
        leader: bool = True,
        fetch: FetchSettings | None = None,
        blobs_per_delete: int = 1024,
        topk_k: int | None = None,
        first_step: int = 0,
        restart_grace_s: float = 10.0,
        max_staleness: int = OrchestratorSettings.max_staleness,
        seq_len: int | None = None,
        limits: ModelLimits | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = settings or TrainerSettings()
        self.fetch_settings = fetch or FetchSettings()
        self.blobs_per_delete = blobs_per_delete
        self.topk_k = topk_k
        self.group = group
        self.rank = dist.get_rank()
        self.data_rank = self.rank if data_rank is None else data_rank
        self.data_ranks = dist.get_world_size(group) if data_ranks is None else data_ranks
        if not 0 <= self.data_rank < self.data_ranks:
            raise ValueError(f"data_rank must be in [0, {self.data_ranks}), got {self.data_rank}")
        self.leader = leader
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.steps_ahead = max_staleness + STEPS_AHEAD_MARGIN
        if seq_len is not None and seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        # A fetch from an env server the registry reports down fails at once (the micro batch is dropped),
        # unless its store is durable: then it is asked again until a restart re-adopted it, within the grace.
        # Deletes outlive a restart of a durable store the same way (see _delete).
        self._peers = peers = runtime.track_peers()
        self._locate = registry_locator(peers.endpoint_of)
        self._restarts = StoreRestarts(lambda node: durable_store(peers, node), runtime.later, restart_grace_s)
        # A durable store restarted re-adopts its blobs but missed the ``reference`` events published while it was
        # dead: this rank repeats its hand-overs to each new process (see _hand_over_again).
        StoreReturns(peers, runtime.calls, lambda node: bool(self._held_at(node)), self._hand_over_again)
        self.limits = limits
        self.fetcher = StepFetcher(runtime.node_id, runtime.calls, self.fetch_settings, locate=self._locate,
                                   restarts=self._restarts, limits=limits)
        self.held: set[str] = set()
        self._received: dict[int, _Received] = {}
        self._running: dict[int, tuple[_Received, frozenset[str]]] = {}  # step -> (batch, trained blob ids)
        self._next_step = first_step
        self._accepted: StepBatch | None = None  # the last step batch taken: an identical repeat is answered ok
        self._interrupted = False
        self._broken = ""  # why this world cannot go on (a peer rank died); empty while it can
        self._loop_ended = False
        self._cond = threading.Condition()
        self.server = runtime.serve("trainer", self.settings.endpoint)
        self.server.on(StepBatch.kind, self._on_step_batch)
        # ``received``: the last step batch accepted (-1: none), so a restarted orchestrator never sends a
        # step a rank already holds.
        runtime.status = lambda: {"blobs_held": float(len(self.held)), "step": float(self._next_step),
                                  "received": float(self._accepted.step if self._accepted is not None else -1)}
        self.fetched_bytes = 0
        self.dropped_micro_batches = 0
        self.skipped_steps = 0
        self._skipped_in_a_row = 0  # the same on every rank: each skip is one agreement of the whole world
        self._fetch_seconds = runtime.histogram(
            "refbus_fetch_seconds", "Seconds from the start of a step's fetch until its tensors are assembled.",
            buckets=FETCH_SECONDS_BUCKETS)
        runtime.metric("refbus_fetch_bytes_total", "Array bytes fetched and verified by this trainer rank.",
                       lambda: {(): float(self.fetched_bytes)})
        runtime.metric("refbus_dropped_micro_batches_total", "Micro batches this rank ran as dropped (zero loss).",
                       lambda: {(): float(self.dropped_micro_batches)})
        runtime.metric("refbus_trainer_steps_skipped_total",
                       "Steps every rank skipped: nothing of them fetched anywhere, or a data rank stuck.",
                       lambda: {(): float(self.skipped_steps)})
        runtime.metric("refbus_trainer_blobs_held", "Blobs owned by this trainer rank and not yet deleted.",
                       lambda: {(): float(len(self.held))}, kind="gauge")
        # What the orchestrator needs to address this rank: its data rank, and whether it deletes.
        runtime.labels.update(rank=str(self.rank), data_rank=str(self.data_rank), leader=str(int(leader)))
        # A restarted rank trains new data from a checkpoint, never claiming back what its predecessor held: stores
        # reclaim that as soon as this process registers, not when the predecessor's grace ends.
        runtime.labels[CLAIMS_BACK] = "0"
        runtime.shutdown_hooks.append(self._on_loop_ended)

    # --- the training loop's API ---------------------------------------------------------------------

    def begin_step(self, step: int) -> StepBatches:
        """Wait for this rank's step batch, fetch and assemble it, agree with every rank on what failed.

        Collective: every rank of the group calls it for the same step. Raises :class:`StepSkipped` on every
        rank when the ranks agreed to skip the step, :class:`StepFailed` on this rank when its step batch never
        came, it was interrupted or the node stopped.
        """
        if self.runtime.loop_thread is None:
            raise RuntimeError("TrainerRank needs the node loop in its own thread: call runtime.start_background()")
        # From here on this rank owns the step's blobs: end_step deletes them (``dropped``) whatever fails below.
        received = self._wait_for(step)
        in_flight = self._on_loop(lambda sent: sent(self.fetcher.start(step, received.batch.micro_batches)))
        try:  # assembled here as the replies come, while the loop thread receives the rest
            fetch = self.fetcher.finish(in_flight, timeout_s=self.settings.batch_timeout_s,
                                        stopped=lambda: self._loop_ended)
        except FetchUnfinished as exc:
            raise StepFailed(f"rank {self.rank}: {exc}") from None
        ack = FetchAck(step=step, holder=self.runtime.node_id, blob_ids=list(fetch.blob_ids), nbytes=fetch.nbytes,
                       seconds=fetch.seconds, failed=len(fetch.failed))
        self.runtime.call_soon(lambda: self.runtime.publish(ack))
        self._fetch_seconds.observe(fetch.seconds)
        self.fetched_bytes += fetch.nbytes
        dropped, dropped_global = self._agree(step, fetch)
        batches: list[AssembledBatch] = []
        for index, batch in enumerate(fetch.batches):
            if index in dropped:
                batch = assemble_dropped(
                    fetch.micro_batches[index],
                    fetch.routing_rows,
                    mask_width=self.fetch_settings.mask_width or 1,
                    topk_k=self.topk_k or fetch.topk_k,
                    allocator=self.fetcher.pool,
                )
            # Every local failure was flagged for this data rank, so it is in the agreed drop set.
            assert isinstance(batch, AssembledBatch)
            batches.append(batch)
        if dropped:
            self.dropped_micro_batches += len(dropped)
            log.warning("step.dropped_micro_batches", step=step, dropped=len(dropped), dropped_global=dropped_global,
                        local_failures=_reasons(fetch))
        trained = frozenset(
            item.ref.blob_id
            for index, mb in enumerate(received.batch.micro_batches)
            if not mb.dummy and index not in dropped
            for item in mb.samples
            if item.ref is not None
        )
        with self._cond:  # the loop thread looks at the running steps (_held_at); a hook that took it keeps it
            if step in self._running:
                self._running[step] = (received, trained)
        inputs = [mb.inputs for mb in received.batch.micro_batches]
        if self.limits is not None:  # a dropped micro batch may be one refused for an id the model has no row for
            for index in dropped:
                inputs[index] = self.limits.in_range(inputs[index], batches[index].length)
        return StepBatches(
            step=step,
            batches=tuple(batches),
            inputs=tuple(inputs),
            dropped=dropped,
            dropped_global=dropped_global,
            fetch=fetch,
        )

    def end_step(self, step: int) -> StepRelease:
        """After the optimizer step: delete the step's owned blobs (reason ``trained``, or ``dropped`` for
        blobs of dropped micro batches), grouped per env server. Not collective: ``begin_step``'s all-reduce
        already proved that every rank fetched. Also call it after ``begin_step`` raised :class:`StepFailed`
        (:class:`StepSkipped` included) for the step, whatever raised it: the rank still owns the blobs and
        deletes them (reason ``dropped``); nothing, when the step batch never came.

        Every owned blob leaves ``held`` here (the ``blobs_held`` status): those deleted, and those whose
        delete ends otherwise, which this rank never asks for again: ``violations`` (deleted already),
        ``missing`` and ``reclaimed`` (the store holds them for nobody), ``failed`` (the store reclaims them
        from this rank once it has gone, ``holder-down``, or they went with a store that died)."""
        with self._cond:  # never under the loop thread's look at the running steps (_held_at)
            running = self._running.pop(step, None)
        if running is None:
            return StepRelease()
        received, trained = running
        owned = received.batch.owned
        if not owned:
            return StepRelease()
        reasons = {blob_id: TRAINED if blob_id in trained else DROPPED_REASON for blob_id in owned}
        try:
            release = self._on_loop(lambda done: self._delete(received.refs, reasons, done))
        finally:  # never asked for again, even when the loop did not answer (StepFailed)
            with self._cond:
                self.held.difference_update(owned)
        return release

    def interrupt(self) -> None:
        """A shutdown was asked for: a ``begin_step`` waiting for its step batch raises :class:`StepFailed`
        now, and so does every later one whose step batch has not arrived. Safe from any thread and from
        signal handlers (the loop thread wakes the waiter)."""
        self._interrupted = True
        self.runtime.call_soon(self._wake)

    @property
    def interrupted(self) -> bool:
        """Whether :meth:`interrupt` was called."""
        return self._interrupted

    def abort(self, reason: str) -> None:
        """The world is broken (a peer rank died): a ``begin_step`` waiting for its step batch, and every later
        one, raises :class:`StepFailed` with ``reason``. Safe from any thread."""
        self._broken = reason
        self.runtime.call_soon(self._wake)

    @property
    def broken(self) -> str:
        """Why the world cannot go on (:meth:`abort`); empty while it can."""
        return self._broken

    # --- requests (loop thread) ----------------------------------------------------------------------

    def _on_step_batch(self, request: Message) -> Ok:
        batch = request.body
        assert isinstance(batch, StepBatch)
        self._check_orchestrator(request.header.src)
        if batch.rank != self.rank:
            raise HandlerError("wrong-rank", f"step batch for rank {batch.rank} sent to rank {self.rank}")
        if batch.owned and not self.leader:
            raise HandlerError("not-leader", f"rank {self.rank} does not delete for data rank {self.data_rank}; "
                                             "send owned blobs to its leader")
        bound = self.seq_len
        too_long = [i for i, mb in enumerate(batch.micro_batches) if bound is not None and mb.length > bound]
        if too_long:
            raise HandlerError("bad-step-batch", f"step {batch.step}: micro batch {too_long[0]} is "
                               f"{batch.micro_batches[too_long[0]].length} tokens long, more than "
                               f"orchestrator.seq_len = {bound} ({len(too_long)} such)")
        try:
            for mb in batch.micro_batches:
                to_micro_batch(mb)
            refs = blob_refs(batch.micro_batches, fetched=False)
        except PlanError as exc:
            raise HandlerError("bad-step-batch", f"step {batch.step}: {exc}") from None
        unknown = [blob_id for blob_id in batch.owned if blob_id not in refs]
        if unknown:
            raise HandlerError("bad-step-batch", f"step {batch.step}: owned blobs {unknown[:4]} are referenced "
                                                 "by no micro batch, so their env server is unknown")
        with self._cond:
            if self._accepted is not None and _same_batch(batch, self._accepted):
                return Ok(detail="repeat")  # a re-delivery whose first acknowledgement was lost or late
            if batch.step < self._next_step or batch.step in self._received:
                raise HandlerError("duplicate-step", f"rank {self.rank} already has step {batch.step}")
            if batch.step > self._next_step + self.steps_ahead:
                raise HandlerError("step-too-far", f"step {batch.step} is more than {self.steps_ahead} steps ahead of "
                                   f"step {self._next_step}, which rank {self.rank} trains next (max_staleness + "
                                   f"{STEPS_AHEAD_MARGIN}): the orchestrator never ships so far ahead",
                                   retry_after_s=1.0)
            if len(self._received) >= RECEIVED_STEPS:
                raise HandlerError("too-many-steps", f"rank {self.rank} holds {len(self._received)} step batches not "
                                   f"yet begun (at most {RECEIVED_STEPS}); training is at step {self._next_step}",
                                   retry_after_s=1.0)
            self._received[batch.step] = _Received(batch, refs)
            self._accepted = batch
            self.held.update(batch.owned)
            self._cond.notify_all()
        self.runtime.publish(Reference(step=batch.step, holder=self.runtime.node_id, blob_ids=list(batch.owned)))
        publisher = self.runtime.publisher
        assert publisher is not None  # publish() above raised otherwise
        publisher.flush()  # out before the answer, not after it at the end of the turn
        return Ok()

    # --- internals -----------------------------------------------------------------------------------

    def _check_orchestrator(self, src: str) -> None:
        """Raise ``not-orchestrator`` unless ``src`` is a live orchestrator in the registry as this rank sees it.
        One not seen yet is looked up (one lookup at a time), so the orchestrator's next send finds it."""
        node = self._peers.live.get(src)
        if node is not None and node.role == ORCHESTRATOR_ROLE:
            return
        if node is None:
            self.runtime.lookup_async(ORCHESTRATOR_ROLE, self._orchestrators_found)
        raise HandlerError("not-orchestrator", f"{src!r} is no orchestrator the registry lists live: only the "
                           "orchestrator sends step batches", retry_after_s=1.0 if node is None else 0.0)

    def _orchestrators_found(self, nodes: list[NodeInfo] | None) -> None:
        self._peers.seed(nodes or (), ORCHESTRATOR_ROLE)

    def _wait_for(self, step: int) -> _Received:
        with self._cond:
            self._cond.wait_for(lambda: (step in self._received or self._interrupted or self._loop_ended
                                         or bool(self._broken)), self.settings.batch_timeout_s)
            received = None if self._broken else self._received.pop(step, None)
            if received is None:
                waited = f"nothing within {self.settings.batch_timeout_s:.0f}s"
                why = self._broken or ("interrupted" if self._interrupted else
                                       "the node stopped" if self._loop_ended else waited)
                raise StepFailed(f"rank {self.rank}: no step batch for step {step} ({why})")
            self._next_step = step + 1
            # Running in the same breath: a look at what this rank holds (_held_at) never misses it in between.
            self._running[step] = (received, frozenset())
        return received

    def _hand_over_again(self, node: str) -> None:
        """Publish again, one ``reference`` per step, the hand-over of every blob this rank holds on store ``node``,
        back as a new process that re-adopted its blobs (:class:`~.restarts.StoreReturns`): the ``reference``
        events this rank published while it was dead never reached it, so it would hold those blobs for the
        orchestrator (never reclaimed with this rank's; a restarted orchestrator would take them back and ship them
        again). A store takes a hand-over of a blob already the holder's, deleted or reclaimed as nothing."""
        held = self._held_at(node)
        for step, blob_ids in sorted(held.items()):
            self.runtime.publish(Reference(step=step, holder=self.runtime.node_id, blob_ids=blob_ids))
        log.info("reference.repeated", store=node, blobs=sum(map(len, held.values())), steps=len(held),
                 detail="a restarted store missed the hand-overs published while it was dead")

    def _held_at(self, node: str) -> dict[int, list[str]]:
        """Step -> the ids of the blobs this rank holds (received or running, not yet deleted) on store ``node``."""
        with self._cond:
            batches = [*self._received.values(), *(received for received, _ in self._running.values())]
            held = set(self.held)
        steps: dict[int, list[str]] = {}
        for received in batches:
            ids = [blob_id for blob_id in received.batch.owned
                   if blob_id in held and received.refs[blob_id].node == node]
            if ids:
                steps[received.batch.step] = ids
        return steps

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _on_loop_ended(self) -> None:
        """A shutdown hook (the loop has stopped; its sockets are this thread's now): a waiting ``begin_step``
        gives up, and the blobs of a step begun and never ended (its world broke, or the node was stopped
        mid-step) are deleted ``dropped`` here, their answers awaited within the hooks' share of the
        shutdown. No one else would delete them (the orchestrator had this rank's acknowledgement long
        before): their stores would reclaim them ``holder-down`` once this node's grace ended, counted lost.
        Step batches received and never begun are left so: the acknowledgement of one that came just now may
        not have left this node, and the orchestrator would then deal with its blobs itself."""
        with self._cond:
            self._loop_ended = True
            self._cond.notify_all()
            left: dict[str, BlobRef] = {}
            for step in list(self._running):  # one at a time: an end_step racing this takes its own
                running = self._running.pop(step, None)
                if running is not None:  # what it owns only: the other refs are a peer's (a dummy borrows them)
                    refs = running[0].refs
                    left.update((blob_id, refs[blob_id]) for blob_id in running[0].batch.owned)
            self.held.difference_update(left)
        if not left:
            return
        released: list[StepRelease] = []
        self._delete(left, dict.fromkeys(left, DROPPED_REASON), released.append)
        self.runtime.calls.run_until(lambda: bool(released), self.runtime.shutdown_left() * 0.9)
        log.warning("shutdown.owned_deleted", blobs=len(left),
                    deleted=len(released[0].deleted) if released else 0, answered=bool(released))

    def _agree(self, step: int, fetch: StepFetch) -> tuple[tuple[int, ...], int]:
        """The agreement: which micro batches of this data rank to drop, and how many across all."""
        per_rank = len(fetch.batches)
        self._agree_on_count(step, per_rank)
        width = self.data_ranks * per_rank
        flags = torch.zeros(width + self.data_ranks, dtype=torch.int32)
        for index in fetch.failed:
            flags[self.data_rank * per_rank + index] = 1
        flags[width + self.data_rank] = int(self._stuck(fetch))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        failed = flags[:width].view(self.data_ranks, per_rank)
        stuck = flags[width:].nonzero().flatten().tolist()
        if width and bool(failed.all()):
            self._skip(step, f"step {step}: no micro batch could be fetched on any rank ({_reasons(fetch)} here)",
                       failed_global=int(failed.sum()))
        elif stuck:
            self._skip(step, f"step {step}: data ranks {stuck} cannot stand in for their dropped micro batches "
                             "(no real routing rows or top-k width fetched there)", failed_global=int(failed.sum()))
        self._skipped_in_a_row = 0
        dropped = tuple(failed[self.data_rank].nonzero().flatten().tolist())
        return dropped, int(failed.sum())

    def _agree_on_count(self, step: int, per_rank: int) -> None:
        """Skip the step on every rank unless every rank has ``per_rank`` micro batches (packing's invariant, which
        sizes the agreement's vector): ranks entering one all-reduce with vectors of different sizes abort in
        gloo, killing the process, so step batches that break it must be found by a collective of fixed size.
        A rank sent no micro batch at all got a restarted orchestrator's fill (its earlier incarnation died
        delivering the step: the other ranks got theirs, this one never did): every rank skips the step."""
        counts = torch.tensor([per_rank, -per_rank], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        most, least = int(counts[0]), -int(counts[1])
        if least == 0:
            self._skip(step, f"step {step}: a rank was sent an empty batch for it (a restarted orchestrator's fill: "
                             "its earlier incarnation delivered the step to only some ranks before it died)",
                       failed_global=0)
        if most != least:
            self._skip(step, f"step {step}: the ranks' step batches hold from {least} to {most} micro batches "
                             f"({per_rank} here), where every rank must have as many", failed_global=0)

    def _skip(self, step: int, reason: str, *, failed_global: int) -> NoReturn:
        """Raise :class:`StepSkipped` for ``reason`` (the same on every rank: it follows an agreement), or
        :class:`StepFailed` past ``trainer.skip_limit`` skips in a row."""
        if self._skipped_in_a_row >= self.settings.skip_limit:
            raise StepFailed(f"{reason}; {self._skipped_in_a_row} steps in a row were skipped before it, "
                             f"trainer.skip_limit = {self.settings.skip_limit}: the cause persists")
        self._skipped_in_a_row += 1
        self.skipped_steps += 1
        log.warning("step.skipped", step=step, reason=reason, failed_global=failed_global,
                    in_a_row=self._skipped_in_a_row)
        raise StepSkipped(reason)

    def _stuck(self, fetch: StepFetch) -> bool:
        """Whether a dropped micro batch of this rank could not be stood in for. Exact before agreement:
        rows and width come from this rank's assembled micro batches, so a rank lacks them only when every
        micro batch that would need them failed here, and those are dropped whatever the others report."""
        plans = fetch.micro_batches
        no_rows = fetch.routing_rows is None and any(plan.has_routing for plan in plans)
        no_k = (self.topk_k or fetch.topk_k) is None and any(TOPK_IDS in plan.fields() for plan in plans)
        return no_rows or no_k

    def _delete(self, refs: Mapping[str, BlobRef], reasons: Mapping[str, str], done: Callable[[StepRelease], None]
                ) -> None:
        """Delete the blobs of ``reasons`` (id -> reason) per store and reason (loop thread); ``done`` gets what
        became of them once every request has its outcome.

        A store killed before it answered is restarted under its node id, re-adopts its durable store and may
        listen elsewhere. A delete to a durable store that failed (down, or unanswered) waits for another
        process to serve the store, then is sent there, re-located, until ``node.restart_grace_s`` after the
        first (:class:`StoreRestarts`); that process answers a delete its predecessor had committed as done
        (``repeated``). Never again to the process it went to: that one may have deleted them already, and a
        second delete is a violation. A delete the store answered with ``retry_after_s`` (it could not journal
        it: nothing changed) is the exception, sent again, the same request, by ``calls`` (``retry_after``)."""
        started = time.monotonic()
        sent_to: dict[str, tuple[str, int, float] | None] = {}  # store node -> the process its deletes went to

        def requests(blob_ids: Iterable[str]) -> list[tuple[str, Delete]]:
            # Located now: a store restarted since the step batch came (re-adopting its blobs) has moved.
            groups: dict[tuple[str, str], list[str]] = defaultdict(list)
            for blob_id in blob_ids:
                node = refs[blob_id].node
                sent_to[node] = self._process(node)
                groups[self._locate(refs[blob_id]), reasons[blob_id]].append(blob_id)
            size = self.blobs_per_delete
            return [(endpoint, Delete(blob_ids=ids[i : i + size], holder=self.runtime.node_id, reason=reason))
                    for (endpoint, reason), ids in groups.items() for i in range(0, len(ids), size)]

        def again(sent: list[Sent[Delete]]) -> list[Delete] | None:
            waiting = self._restarts.waiting(sent, lambda blob_id: refs[blob_id].node, time.monotonic() - started)
            if waiting is None:
                return None
            return [request for request in waiting
                    if (node := refs[request.blob_ids[0]].node) in self._peers.live
                    and self._process(node) != sent_to.get(node)]

        def relocate(failed: list[Delete]) -> list[tuple[str, Delete]]:
            ids = [i for request in failed for i in request.blob_ids]
            if ids:
                log.info("delete.sent_again", blobs=len(ids), stores=sorted({refs[i].node for i in ids}),
                         detail="a restarted process serves the store")
            return requests(ids)

        self._restarts.gather(self.runtime.calls, requests(reasons), lambda sent: done(self._released(sent)),
                              again=again, relocate=relocate, window=self.fetch_settings.window,
                              policy=self.fetch_settings.policy, retry_after=True)

    def _process(self, node: str) -> tuple[str, int, float] | None:
        """The process serving ``node`` as this rank last heard (live or down; None: none known)."""
        info = self._peers.live.get(node) or self._peers.down.get(node)
        return incarnation(info) if info is not None else None

    def _released(self, sent: list[Sent[Delete]]) -> StepRelease:
        deleted: list[str] = []
        violations: list[str] = []
        failed: list[str] = []
        reclaimed: list[str] = []
        missing: list[str] = []
        replies, failures = split_outcomes(sent)
        for (endpoint, request), error in failures:
            log.error("delete.failed", endpoint=endpoint, blobs=len(request.blob_ids), error=str(error))
            failed += request.blob_ids
        for (endpoint, request), outcome in replies:
            reply = outcome.body
            if not isinstance(reply, Deleted):
                log.error("delete.failed", endpoint=endpoint, blobs=len(request.blob_ids),
                          error=f"expected deleted, got {reply.kind}")
                failed += request.blob_ids
                continue
            deleted += reply.blob_ids
            if reply.violations:
                log.warning("delete.violations", endpoint=endpoint, holder=self.runtime.node_id,
                            reason=request.reason, blob_ids=reply.violations[:16], count=len(reply.violations))
                violations += reply.violations
            if reply.reclaimed:
                log.warning("delete.reclaimed", endpoint=endpoint, holder=self.runtime.node_id,
                            reason=request.reason, count=len(reply.reclaimed))
                reclaimed += reply.reclaimed
            if reply.missing:
                log.warning("delete.missing", endpoint=endpoint, holder=self.runtime.node_id,
                            reason=request.reason, blob_ids=reply.missing[:16], count=len(reply.missing))
                missing += reply.missing
        return StepRelease(tuple(deleted), tuple(violations), tuple(failed), tuple(reclaimed), tuple(missing))

    def _on_loop(self, start: Callable[[Callable[[T], None]], object]) -> T:
        """Run ``start(done)`` on the loop thread, which sends requests and returns; wait here until the loop
        calls ``done(result)`` and return that result (or raise what ``start`` raised). The loop serves
        heartbeats and requests meanwhile: only this thread waits."""
        outcome: list[tuple[bool, Any]] = []

        def finish(result: tuple[bool, Any]) -> None:
            with self._cond:
                if not outcome:
                    outcome.append(result)
                self._cond.notify_all()

        def run() -> None:
            try:
                start(lambda value: finish((True, value)))
            except BaseException as exc:  # re-raised on the caller's thread
                finish((False, exc))

        self.runtime.call_soon(run)
        with self._cond:
            if not self._cond.wait_for(lambda: outcome or self._loop_ended, self.settings.batch_timeout_s):
                raise StepFailed(f"rank {self.rank}: the node loop did not end the requests within "
                                 f"{self.settings.batch_timeout_s:.0f}s")
            if not outcome:
                raise StepFailed(f"rank {self.rank}: the node stopped before its requests ended")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def _same_batch(a: StepBatch, b: StepBatch) -> bool:
    """Whether two step batches are the same (inline arrays compared by value)."""
    if (a.step, a.rank, a.owned, a.policy_version, len(a.micro_batches)) != (
            b.step, b.rank, b.owned, b.policy_version, len(b.micro_batches)):
        return False
    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
        if (x.samples, x.length, x.dummy, sorted(x.inputs)) != (y.samples, y.length, y.dummy, sorted(y.inputs)):
            return False
        if not all(_same_array(x.inputs[name], y.inputs[name]) for name in x.inputs):
            return False
    return True


def _same_array(a: Any, b: Any) -> bool:
    """Equal by value, NaN equal to NaN where the dtype has NaN (an identical re-delivery is the same)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc")


def _reasons(fetch: StepFetch) -> str:
    reasons = sorted({b.reason for b in fetch.batches if not isinstance(b, AssembledBatch)})
    return ", ".join(reasons) or "none failed"
