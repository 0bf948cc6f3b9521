"""The orchestrator's pieces of arrays by reference, all pure bookkeeping (no sockets, no clock): it holds
references, never array bytes.

* :class:`Holdings` — every blob the orchestrator owns, and the only two ways it lets go of one: hand it to
  a trainer rank (an acknowledged ``step-batch``) or delete it (a delete it decides, sent by the executor to
  the env server that keeps it). Ownership arrives by ``claim`` (acknowledged by the env server).
* :class:`HandedOver` — what it handed to trainer ranks and no store has reported gone yet, with the rank's
  process that took it: published again to a durable store that comes back as a new process.
* :class:`TrainSink` — the one place that decides what ships. Whatever it will not ship is deleted at that
  moment with its reason: filtered groups (zero advantage), dropped traces, pruned samples, samples too
  stale for the bound, what is still queued at shutdown. :class:`EvalSink` deletes every eval episode's
  arrays.
* :class:`ReplicaRouter` — picks, for a source, the env-server replica with the fewest runs in flight.

Samples carry small inline arrays (``inputs``: token ids, advantages, loss masks: a few bytes per token) that
travel with the micro batch; the kept kinds (routing, top-k heads, sampling masks: hundreds of bytes per
token) only ever appear here as :class:`~refbus.protocol.messages.BlobRef`.

This module never imports torch.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog

from ...protocol.messages import (
    BlobRef,
    EpisodeFinished,
    MicroBatchRefs,
    NodeInfo,
    SampleSlice,
    StepBatch,
)
from .charges import episode_charge
from .packing import MicroBatch, PackingError, PackPlan, SampleInfo, pack

log = structlog.get_logger(__name__)

MALFORMED = "malformed"  # the reason for deleting what cannot be trained as it came (see TrainSink.ship)
# Blobs handed to trainer ranks kept for a store's restart (:class:`HandedOver`): a few hundred bytes each (tens of
# MiB at most), where a run keeps those of the few steps its ranks hold at a time.
HANDED_OVER_KEPT = 1 << 16


@dataclass(frozen=True)
class Sample:
    """One trainable sequence: its reference (None when it kept no arrays) and small per-token inputs.

    Every array in ``inputs`` has ``tokens`` rows; they are cut and padded like the kept arrays.
    """

    sample_id: str
    tokens: int
    ref: BlobRef | None = None
    policy_version: int = 0
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Taker:
    """A trainer rank as it took a step batch: its node id and its process (host, pid, start time)."""

    node_id: str
    process: tuple[str, int, float]


class HandedOver:
    """The blobs handed to trainer ranks that no store has reported gone yet, each with its store (``BlobRef.node``),
    its step and the :class:`Taker`. A durable store killed while the ``reference`` events of a hand-over went out
    re-adopts those blobs as the orchestrator's; a rank still live publishes its hand-overs again to the restarted
    process, a dead one cannot, so the orchestrator does (:meth:`at`), naming the process that took them.

    A blob leaves when a ``delete`` event names it (:meth:`gone`: its store deleted or reclaimed it, so nothing is
    left to hand over) or when its store is lost (:meth:`forget_store`). At most ``limit`` blobs are kept: beyond
    it the oldest are dropped and logged (``handover.forgotten``, an error: a store restarted after that hands
    them to nobody, and they stay this node's there until it is gone)."""

    def __init__(self, limit: int = HANDED_OVER_KEPT) -> None:
        self.limit = limit
        self._blobs: dict[str, tuple[str, int, Taker]] = {}  # blob id -> (store node id, step, taker), oldest first
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._blobs)

    def add(self, step: int, taker: Taker, refs: Iterable[BlobRef]) -> None:
        """``taker`` took ``refs`` (those of stores known by node id) with the step batch of ``step``."""
        for ref in refs:
            if ref.node:
                self._blobs.pop(ref.blob_id, None)
                self._blobs[ref.blob_id] = (ref.node, step, taker)
        over = len(self._blobs) - self.limit
        if over > 0:
            for blob_id in list(self._blobs)[:over]:
                del self._blobs[blob_id]
            self.forgotten += over
            log.error("handover.forgotten", blobs=over, kept=self.limit,
                      detail="more hand-overs than kept: a store restarted after this hands them to nobody")

    def gone(self, blob_ids: Iterable[str]) -> None:
        """A ``delete`` event named ``blob_ids``: gone from their store."""
        for blob_id in blob_ids:
            self._blobs.pop(blob_id, None)

    def forget_store(self, node_id: str) -> None:
        """The store ``node_id`` was lost for good: nothing of it to hand over."""
        for blob_id in [b for b, (node, _, _) in self._blobs.items() if node == node_id]:
            del self._blobs[blob_id]

    def at(self, node_id: str) -> dict[tuple[int, Taker], list[str]]:
        """(step, taker) -> the ids of the blobs handed over on store ``node_id``."""
        handed: dict[tuple[int, Taker], list[str]] = defaultdict(list)
        for blob_id, (node, step, taker) in self._blobs.items():
            if node == node_id:
                handed[step, taker].append(blob_id)
        return dict(handed)


class Holdings:
    """The blobs the orchestrator owns, and the deletes it decided on. Pure bookkeeping: ``outbox`` collects
    each delete (refs, reason) for the executor to send; nothing here touches a socket.

    Ownership arrives by an acknowledged ``claim`` (:meth:`take`) and leaves by a decided delete
    (:meth:`delete`) or an acknowledged ``step-batch`` (:meth:`hand_over`, kept in :attr:`handed`).
    """

    def __init__(self) -> None:
        self.held: dict[str, BlobRef] = {}
        self.handed_over = 0
        self.handed = HandedOver()
        self.outbox: list[tuple[list[BlobRef], str]] = []

    @property
    def held_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.held.values())

    def take(self, refs: Iterable[BlobRef]) -> None:
        """Own ``refs`` (their claims were granted)."""
        for ref in refs:
            self.held[ref.blob_id] = ref

    def delete(self, refs: Iterable[BlobRef], reason: str) -> None:
        """Delete blobs held here for ``reason``: they leave ``held`` now and go to ``outbox``. Refs not held
        are ignored (a sample without a claimed blob), so callers can pass whatever they drop."""
        mine = [self.held.pop(ref.blob_id) for ref in refs if ref.blob_id in self.held]
        if mine:
            self.outbox.append((mine, reason))

    def hand_over(self, batch: StepBatch, taker: Taker | None) -> None:
        """A trainer rank (``taker``; None: not known) acknowledged ``batch``: its ``owned`` blobs are that rank's
        now."""
        refs = [ref for blob_id in batch.owned if (ref := self.held.pop(blob_id, None)) is not None]
        if taker is not None:
            self.handed.add(batch.step, taker, refs)
        self.handed_over += len(batch.owned)

    def take_outbox(self) -> list[tuple[list[BlobRef], str]]:
        outbox, self.outbox = self.outbox, []
        return outbox


def registry_locator(endpoint_of: Callable[[str, str], str | None]) -> Callable[[BlobRef], str]:
    """Where to ask for a blob: the ``blobs`` endpoint the reference's store advertises now
    (``endpoint_of(node_id, name)``, e.g. ``runtime.track_peers().endpoint_of``), else the recorded one (a
    reference without a node, or a store the registry does not list live)."""

    def locate(ref: BlobRef) -> str:
        return (endpoint_of(ref.node, "blobs") if ref.node else None) or ref.endpoint

    return locate


def group_by_endpoint(
    refs: Iterable[BlobRef], locate: Callable[[BlobRef], str] = lambda ref: ref.endpoint
) -> dict[str, list[BlobRef]]:
    """``refs`` by the endpoint of the env server that keeps them (``locate(ref)``: by default the one
    recorded at keep time; :func:`registry_locator` finds a store that moved), in first-seen order."""
    by_endpoint: dict[str, list[BlobRef]] = defaultdict(list)
    for ref in refs:
        by_endpoint[locate(ref)].append(ref)
    return dict(by_endpoint)


@dataclass(frozen=True)
class Shipment:
    """One packed step: the plan, and each trainer endpoint's step batch (non-leaders' carry no ``owned``)."""

    plan: PackPlan
    batches: Mapping[str, StepBatch]


@dataclass(frozen=True)
class TrainerAddress:
    """One trainer rank as the orchestrator addresses it (from its registry entry)."""

    endpoint: str
    rank: int
    data_rank: int
    leader: bool = True

    @classmethod
    def from_node(cls, node: NodeInfo) -> TrainerAddress:
        labels = node.labels
        return cls(node.endpoints["trainer"], int(labels["rank"]), int(labels["data_rank"]),
                   labels.get("leader", "1") == "1")


class TrainSink:
    """Decides what ships to the trainer ranks; deletes, at that moment, everything it will not ship.

    ``trainers``: every trainer rank. Ranks of one data rank get the same micro batches; only the data
    rank's leader gets ``owned`` (it deletes them after the step).
    """

    def __init__(
        self,
        holder: Holdings,
        trainers: Sequence[TrainerAddress] = (),
        *,
        seq_len: int,
        max_staleness: int,
        pad_to_multiple_of: int = 1,
    ) -> None:
        self.holder = holder
        self.seq_len = seq_len
        self.max_staleness = max_staleness
        self.pad_to_multiple_of = pad_to_multiple_of
        self.queue: list[list[Sample]] = []  # whole groups, oldest first: a group is never split across steps
        self.dropped: Counter[str] = Counter()  # samples, by reason
        self.dropped_groups = 0  # groups that will never train (filtered, or stale to the last sample)
        self.trainers: list[TrainerAddress] = []
        self.data_ranks = 0
        if trainers:
            self.use_trainers(trainers)

    def use_trainers(self, trainers: Sequence[TrainerAddress]) -> None:
        """Set the ranks steps go to (checked: data ranks 0..n-1, one leader each)."""
        ordered = sorted(trainers, key=lambda t: (t.data_rank, not t.leader, t.rank))
        data_ranks = sorted({t.data_rank for t in ordered})
        if data_ranks != list(range(len(data_ranks))):
            raise ValueError(f"trainer data ranks must be 0..n-1, got {data_ranks}")
        if any(sum(t.leader for t in ordered if t.data_rank == d) != 1 for d in data_ranks):
            raise ValueError("every data rank needs exactly one leader rank")
        self.trainers = ordered
        self.data_ranks = len(data_ranks)

    def add_group(self, samples: Sequence[Sample], advantages: Sequence[float]) -> bool:
        """Queue a group with its advantages (added to each sample's ``inputs`` as ``advantages``), or
        delete it now when every advantage is zero (nothing to learn). Returns whether it was queued."""
        if not any(advantages):
            self.drop(samples, "filtered")
            self.dropped_groups += 1
            return False
        self.queue.append([
            Sample(sample.sample_id, sample.tokens, sample.ref, sample.policy_version,
                   {**sample.inputs, "advantages": np.full(sample.tokens, advantage, dtype=np.float32)})
            for sample, advantage in zip(samples, advantages, strict=True)
        ])
        return True

    def drop(self, samples: Iterable[Sample], reason: str) -> None:
        """Not shipping these (dropped trace, untrained branch, pruned sample): delete their arrays now."""
        samples = list(samples)
        self.dropped[reason] += len(samples)
        self.holder.delete((s.ref for s in samples if s.ref is not None), reason)

    def ship(self, step: int, policy_version: int, *, max_groups: int | None = None) -> Shipment | None:
        """Pack the queued groups (oldest first, at most ``max_groups``) for ``step``: one step batch per rank.
        Samples more than ``max_staleness`` versions behind the weights that train the step are deleted first
        (reason ``stale``): those weights are version ``step`` (every step pushes the next version; a world
        resumed at step K pushes version K), or ``policy_version`` (the latest known) if that is ahead. Measured
        against ``policy_version`` alone, which lags the step while earlier steps still train, a sample could
        train up to twice ``max_staleness`` versions behind. A sample of a version above those weights is stale
        too: no weights of this lineage made it (a world resumed at K retired the versions above K; a run in
        flight then, or a group still open, brings samples of them later). Returns the
        shipment (the caller delivers it), or None when nothing is left to ship. The shipped groups leave
        the queue; their blobs stay held until a rank acknowledges its batch.

        The queue changes only once the step batches are built. A group that makes packing fail is left out
        and the others ship (:meth:`_without_malformed`): deleted, reason ``malformed``, when it cannot be packed
        even alone (a sample id repeats, an input's length is not its token count); kept at the head of the
        queue for the next step when it only disagrees with the groups before it (another routing shape: one
        step carries one)."""
        trains_from = max(step, policy_version)
        fresh_groups = []
        for group in self.queue:
            fresh = [s for s in group if 0 <= trains_from - s.policy_version <= self.max_staleness]
            self.drop((s for s in group if not 0 <= trains_from - s.policy_version <= self.max_staleness), "stale")
            if fresh:
                fresh_groups.append(fresh)
            else:
                self.dropped_groups += 1
        self.queue = fresh_groups  # the stale samples are deleted already
        groups = fresh_groups if max_groups is None else fresh_groups[:max_groups]
        if not groups:
            return None
        if not self.trainers:
            raise RuntimeError("no trainer ranks known: call use_trainers() first")
        deferred: list[Sequence[Sample]] = []
        try:
            shipment: Shipment | None = self._shipment(step, policy_version, groups)
        except Exception as error:  # whatever a group's data breaks, the others ship
            shipment, deferred = self._without_malformed(step, policy_version, groups, error)
        self.queue = [*deferred, *fresh_groups[len(groups):]]
        return shipment

    def _shipment(self, step: int, policy_version: int, groups: Sequence[Sequence[Sample]]) -> Shipment:
        """The step batches of ``groups``; raises what packing or building them raises. Each blob is owned by
        exactly one data rank's leader (samples of one episode may share a blob and land on several ranks:
        the others only reference it)."""
        take = [sample for group in groups for sample in group]
        refs: dict[str, BlobRef] = {}
        for sample in take:  # a trainer rank refuses a step naming one blob id with two references
            if sample.ref is not None and refs.setdefault(sample.ref.blob_id, sample.ref) != sample.ref:
                raise PackingError(f"sample {sample.sample_id!r}: blob {sample.ref.blob_id!r} named by two "
                                   "different references")
        plan = pack([sample_info(s) for s in take], seq_len=self.seq_len, data_ranks=self.data_ranks,
                    pad_to_multiple_of=self.pad_to_multiple_of)
        by_id = {s.sample_id: s for s in take}
        assigned: set[str] = set()  # blob ids a leader owns already
        batches = {}
        for trainer in self.trainers:
            batch = _step_batch(step, trainer.rank, plan.ranks[trainer.data_rank], by_id, policy_version,
                                assigned if trainer.leader else set())
            batches[trainer.endpoint] = batch if trainer.leader else msgspec.structs.replace(batch, owned=[])
        return Shipment(plan, batches)

    def _without_malformed(self, step: int, policy_version: int, groups: Sequence[Sequence[Sample]],
                           error: Exception) -> tuple[Shipment | None, list[Sequence[Sample]]]:
        """Packing ``groups`` failed with ``error``: take them one at a time, oldest first, keeping each that
        packs with those kept before it. One that does not waits for the next step (returned, oldest first: it
        then ships first) when it carries a routing shape the kept ones do not and packs alone; any other is
        malformed (deleted, logged): a sample id it repeats, data that cannot be packed at all. Bounded: at
        most two packings per group, only on this rare path."""
        kept: list[Sequence[Sample]] = []
        deferred: list[Sequence[Sample]] = []
        shipment: Shipment | None = None
        for group in groups:
            try:
                shipment = self._shipment(step, policy_version, [*kept, group])
            except Exception as cause:  # see ship()
                if _routing_shapes([group]) - _routing_shapes(kept) and self._packs(step, policy_version, group):
                    log.info("group.deferred", step=step, samples=[s.sample_id for s in group][:8],
                             error=f"{type(cause).__name__}: {cause}")
                    deferred.append(group)
                    continue
                log.warning("group.malformed", step=step, samples=[s.sample_id for s in group][:8],
                            error=f"{type(cause).__name__}: {cause}", step_error=str(error))
                self.drop(group, MALFORMED)
                self.dropped_groups += 1
                continue
            kept.append(group)
        if not kept:  # every group was deferred or malformed; ship() built nothing
            shipment = None
        return shipment, deferred

    def _packs(self, step: int, policy_version: int, group: Sequence[Sample]) -> bool:
        try:
            self._shipment(step, policy_version, [group])
        except Exception:  # see ship()
            return False
        return True

    def close(self) -> None:
        """Shutdown: delete whatever is still queued."""
        queued, self.queue = self.queue, []
        self.drop((s for group in queued for s in group), "shutdown")


class EvalSink:
    """Eval episodes are scored, never trained: their arrays are deleted as soon as they arrive."""

    def __init__(self, holder: Holdings) -> None:
        self.holder = holder
        self.episodes = 0
        self.samples = 0

    def add(self, samples: Iterable[Sample]) -> None:
        samples = list(samples)
        self.episodes += 1
        self.samples += len(samples)
        self.holder.delete((s.ref for s in samples if s.ref is not None), "eval")


def _routing_shapes(groups: Iterable[Sequence[Sample]]) -> set[tuple[int, ...]]:
    return {tuple(s.ref.routing_shape) for group in groups for s in group
            if s.ref is not None and s.ref.routing_shape is not None}


def sample_info(sample: Sample) -> SampleInfo:
    """What packing knows of ``sample``; raises :class:`~.packing.PackingError` for fields or a routing shape
    packing refuses."""
    ref = sample.ref
    if ref is None:
        return SampleInfo(sample.sample_id, sample.tokens)
    shape = tuple(ref.routing_shape) if ref.routing_shape else None
    return SampleInfo(sample.sample_id, sample.tokens, tuple(ref.fields), shape)  # type: ignore[arg-type]


def _step_batch(
    step: int, rank: int, micro_batches: Sequence[MicroBatch], samples: Mapping[str, Sample], policy_version: int,
    assigned: set[str],
) -> StepBatch:
    """``rank``'s step batch; ``owned`` lists each blob of its real micro batches not in ``assigned`` yet (and
    adds it there), so a blob two samples share is owned, and deleted, once."""
    refs: list[MicroBatchRefs] = []
    owned: list[str] = []
    for mb in micro_batches:
        slices = []
        for packed in mb.samples:
            sample = samples[packed.sample.sample_id]  # type: ignore[index]
            slices.append(SampleSlice(str(sample.sample_id), packed.kept, sample.ref))
            if not mb.dummy and sample.ref is not None and sample.ref.blob_id not in assigned:
                assigned.add(sample.ref.blob_id)
                owned.append(sample.ref.blob_id)
        refs.append(MicroBatchRefs(samples=slices, length=mb.length, dummy=mb.dummy,
                                   inputs=_inputs(mb, samples)))
    return StepBatch(step=step, rank=rank, micro_batches=refs, owned=owned, policy_version=policy_version)


def _inputs(mb: MicroBatch, samples: Mapping[str, Sample]) -> dict[str, np.ndarray]:
    """Concatenate the samples' inline inputs in packing order, cut to each kept count, zero-padded."""
    names = sorted({name for p in mb.samples for name in samples[p.sample.sample_id].inputs})  # type: ignore[index]
    out: dict[str, np.ndarray] = {}
    for name in names:
        parts = [samples[p.sample.sample_id].inputs.get(name) for p in mb.samples]  # type: ignore[index]
        dtype = next(a.dtype for a in parts if a is not None)
        column = np.zeros(mb.length, dtype=dtype)
        for packed, part in zip(mb.samples, parts, strict=True):
            if part is not None:
                column[packed.offset : packed.stop] = part[: packed.kept]
        out[name] = column
    return out


class ReplicaRouter:
    """Sends each run to the replica of its source with the fewest runs in flight, among those with room, and
    reserves room there for the episode it will keep.

    Replicas are env-server nodes from the broker's registry; a node's source is its ``source`` label when
    it has one, else its node id. Room is counted in episodes, each at the mean charge of the episodes seen so
    far (:attr:`episode_bytes`), under a store's high-water mark (``budget_bytes`` times ``high_water`` from its
    heartbeat status) or, ``hard``, under its budget: what it holds, less the reservations. What it holds comes
    from the registry (read every second or so) plus the episodes kept since the read before it (:meth:`kept`:
    the status a read brings may predate them, so a burst of runs finishing between two reads cannot overfill
    it; counted twice for a read at most, which errs on the side of fewer runs). A run's reservation
    (:meth:`pick`) lasts until its episode is counted as held (:meth:`kept`) or it keeps nothing
    (:meth:`release`: it failed, or its group was given up, or its episode did not come in time after its
    answer), not until its answer, which comes before its episode's event. Episodes are counted at what the store
    charges for them (:func:`~.charges.episode_charge`: whole pages and a per-blob overhead, and the info), the unit
    of its ``bytes_held`` and budget: their raw array bytes would admit far more small episodes than fit. Before the
    first episode's charge is known (:attr:`measured`), and at a replica that publishes no budget, room is
    unbounded, unless the status says ``full`` (under the high-water mark only); a store that published a budget
    before and registered again has none until its first heartbeat says what it holds.
    """

    def __init__(self) -> None:
        self.replicas: dict[str, list[str]] = {}
        self.in_flight: Counter[str] = Counter()
        self.held: dict[str, float] = {}  # endpoint -> bytes held, as of the last registry read plus kept()
        self.limit: dict[str, float] = {}  # endpoint -> its high-water mark in bytes (absent: unknown)
        self.budget: dict[str, float] = {}  # endpoint -> its budget in bytes (absent: unknown)
        self.full: set[str] = set()  # endpoints whose status says they are at their high-water mark
        # endpoints of stores that published a budget before and no status since they registered again (a
        # restart that re-adopted a durable store holds what it held): no room until their first heartbeat
        self.unheard: set[str] = set()
        # node id -> (its source, its budget in bytes: None when it publishes none), of every store seen: one down
        # may come back
        self.stores_seen: dict[str, tuple[str, float | None]] = {}
        self._node_of: dict[str, str] = {}  # endpoint -> the node id of the live store there
        self.episode_bytes = 0.0  # mean charge of an episode (its episode_charge), as kept so far
        self.reserved: dict[str, str] = {}  # episode id -> the endpoint reserved for it
        self._reserved_at: Counter[str] = Counter()  # endpoint -> reservations
        self._since_read: Counter[str] = Counter()  # endpoint -> charges kept since the last registry read
        self._episodes = 0

    @property
    def measured(self) -> bool:
        """Whether room can be counted: an episode's charge is known, or no replica publishes a budget."""
        return self.episode_bytes > 0 or not self.limit

    def update(self, nodes: Iterable[NodeInfo]) -> None:
        replicas: dict[str, list[str]] = defaultdict(list)
        self.held, self.limit, self.budget, self.full, self.unheard = {}, {}, {}, set(), set()
        self._node_of = {}
        for node in nodes:
            if node.role == "env-server" and "blobs" in node.endpoints:
                endpoint, source = node.endpoints["blobs"], node.labels.get("source", node.node_id)
                replicas[source].append(endpoint)
                self._node_of[endpoint] = node.node_id
                status = node.status
                self.held[endpoint] = status.get("bytes_held", 0.0) + self._since_read[endpoint]
                budget = self.stores_seen.get(node.node_id, (source, None))[1]
                if "budget_bytes" in status and "high_water" in status:
                    budget = self.budget[endpoint] = status["budget_bytes"]
                    self.limit[endpoint] = status["budget_bytes"] * status["high_water"]
                elif not status and budget is not None:
                    self.unheard.add(endpoint)
                else:
                    budget = None
                self.stores_seen[node.node_id] = (source, budget)
                if status.get("full"):
                    self.full.add(endpoint)
        self._since_read = Counter()
        self.replicas = {source: sorted(endpoints) for source, endpoints in replicas.items()}

    def kept(self, episode: EpisodeFinished) -> None:
        """``episode`` was kept at its first ref's endpoint (none: nothing was kept): that store holds its
        :func:`~.charges.episode_charge` more until the read after the next registry read; the room reserved
        for it is its own no longer."""
        self.release(episode.episode_id)
        if not episode.refs:
            return
        endpoint, charge = episode.refs[0].endpoint, episode_charge(episode)
        self._episodes += 1
        self.episode_bytes += (charge - self.episode_bytes) / self._episodes
        self._since_read[endpoint] += charge
        if endpoint in self.held:
            self.held[endpoint] += charge

    def room(self, endpoint: str, *, hard: bool = False) -> int:
        """How many more episodes ``endpoint`` can take beyond those reserved there: under its high-water mark,
        or ``hard``, under its budget."""
        if endpoint in self.unheard or (endpoint in self.full and not hard):
            return 0
        cap = (self.budget if hard else self.limit).get(endpoint)
        if cap is None or self.episode_bytes <= 0:
            return 1 << 30
        return max(0, int((cap - self.held.get(endpoint, 0.0)) // self.episode_bytes) - self._reserved_at[endpoint])

    def without_room(self) -> list[str]:
        """The endpoints (sorted) that can take no more run now."""
        return sorted(ep for endpoints in self.replicas.values() for ep in endpoints if self.room(ep) <= 0)

    def with_room(self, runs: int = 1, *, hard: bool = False) -> list[str]:
        """The sources (sorted) whose replicas together have room (``hard``: under their budgets) for ``runs``
        more runs."""
        return sorted(source for source, endpoints in self.replicas.items()
                      if sum(self.room(ep, hard=hard) for ep in endpoints) >= runs)

    def capacity(self, group_size: int) -> int | None:
        """How many episodes the budgets of every store seen (by node id, live or not: one down may come back)
        hold in whole groups of ``group_size``, each episode at the mean charge: a group's runs all keep at one
        source, so per source the episodes its stores' budgets hold together, rounded down to whole groups, summed
        over the sources. None while that cannot be told (no charge known yet, or a store that publishes no
        budget)."""
        budgets = [(source, budget) for source, budget in self.stores_seen.values() if budget is not None]
        if self.episode_bytes <= 0 or not budgets or len(budgets) < len(self.stores_seen):
            return None
        per_source: Counter[str] = Counter()
        for source, budget in budgets:
            per_source[source] += int(budget // self.episode_bytes)
        return sum(episodes // group_size * group_size for episodes in per_source.values())

    def budget_for(self, groups: int, group_size: int) -> int:
        """The smallest budget in bytes (whole episodes at the mean charge, rounded up) which, given to every
        store seen, lets :meth:`capacity` hold ``groups`` groups of ``group_size``; needs a charge known and a
        store seen."""
        stores: Counter[str] = Counter(source for source, _ in self.stores_seen.values())
        episodes = 1  # a store's, in whole episodes: at most groups * group_size (one source of one store)
        while sum(count * episodes // group_size for count in stores.values()) < groups:
            episodes += 1
        return episodes * math.ceil(self.episode_bytes)

    def blocked(self) -> str:
        """What the orchestrator waits for while no source has room for a group under its stores' budgets,
        for an operator: the holders' deletes while the live stores hold episodes, runs whose episodes are not
        counted as held yet, the first heartbeat of stores that registered again, stores seen that are down."""
        live = [endpoint for endpoints in self.replicas.values() for endpoint in endpoints]
        held = sum(self.held.get(endpoint, 0.0) for endpoint in live)
        waits = [f"holders to delete what the stores hold ({held:.0f} bytes)"] if held > 0 else []
        if self.reserved:
            waits.append(f"{len(self.reserved)} answered runs' episodes to be counted as held")
        if unheard := sorted(self.unheard.intersection(live)):
            waits.append(f"the first heartbeat of {', '.join(unheard)} (registered again)")
        up = {self._node_of[endpoint] for endpoint in live}
        if down := sorted(node for node in self.stores_seen if node not in up):
            waits.append(f"{', '.join(down)} to come back (down; their budgets count)")
        return "waiting for " + "; ".join(waits) if waits else "no store reports room"

    def pick(self, source: str, episode_id: str, *, hard: bool = False) -> str:
        """The endpoint of ``source``'s least-loaded replica with room (``hard``: under its budget; then the
        least-loaded one; ties: stable order); counts the run in flight and reserves room there for
        ``episode_id``'s episode."""
        candidates = self.replicas.get(source)
        if not candidates:
            raise LookupError(f"no live env-server replica for source {source!r}")
        endpoint = min(candidates, key=lambda ep: (self.room(ep, hard=hard) <= 0, self.in_flight[ep]))
        self.in_flight[endpoint] += 1
        self.release(episode_id)
        self.reserved[episode_id] = endpoint
        self._reserved_at[endpoint] += 1
        return endpoint

    def release(self, episode_id: str) -> None:
        """Free the room reserved for ``episode_id``'s episode (none: nothing to free)."""
        endpoint = self.reserved.pop(episode_id, None)
        if endpoint is not None:
            self._reserved_at[endpoint] -= 1

    def drop(self, endpoints: Iterable[str]) -> None:
        """Replicas at ``endpoints`` went down: no run goes to them until the registry lists them again."""
        gone = set(endpoints)
        self.replicas = {source: live for source, candidates in self.replicas.items()
                         if (live := [ep for ep in candidates if ep not in gone])}

    def done(self, endpoint: str) -> None:
        """A run sent to ``endpoint`` was answered (its reservation lasts until :meth:`kept` or :meth:`release`)."""
        if self.in_flight[endpoint] > 0:
            self.in_flight[endpoint] -= 1
