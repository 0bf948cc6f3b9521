"""The orchestrator's decisions, pure: state in, actions out.

:class:`OrchestratorCore` is told what happened (an episode arrived with its claimed blobs, the policy
version moved, a rank acknowledged or refused its step batch, a run was answered) and what time it is
(``now``, monotonic seconds, passed in by the caller); it answers with the actions to take. It never touches
a socket or a clock: the executor (``orchestrator.Orchestrator``) does every request and feeds each
outcome back. So every decision is testable in-process on an injected clock.

Decisions and their rules:

* **Groups.** Episodes of one group (``info["group"]``) wait until ``group_size`` have arrived; their
  advantages are the group-normalised rewards (exactly zero when the rewards are all equal: the group is
  filtered, see :func:`group_advantages`). A group still incomplete ``group_timeout_s`` after its first
  episode, or one of whose runs failed, is abandoned (``incomplete``); its stragglers are deleted ``late``.
  A closed group is remembered for :attr:`~OrchestratorCore.closed_horizon_s` (past any straggler's
  arrival); a straggler after that opens a new group, which times out and is deleted ``incomplete``. An
  episode's ``episode-finished`` that comes again (any peer may publish one) is never grouped twice: ignored while
  its group is open or remembered closed (counted, logged ``episode.duplicate``; none of its samples counted
  ``missing``); and blobs held here already are never an episode's to take or drop (a claim repeated by its holder
  is answered ``already``: they are an earlier episode's, maybe queued for a step), so a repeat after its group
  was forgotten deletes nothing ``late``. A restarted store's
  repeat (``again``: its first process may have died before the event left) of which nothing new was granted is
  an episode taken here already, or gone: ignored.
* **Malformed records.** An episode's record is checked before its claimed blobs are taken (a finite
  reward; samples with integer ``input_ids``, a ``loss_mask`` of the same length (none: every token is
  trained), a ``ref`` index into its
  refs whose blob holds the sample's tokens): one that fails is deleted whole (``malformed``, counted,
  logged) and its group abandoned. A claimed blob that no sample of its record points to (more branches than
  samples, a record without samples) is deleted at once (``unreferenced``, counted, logged once per episode):
  nothing would ever ship or drop it. A group that makes a step's packing fail is left out and the step ships:
  one of another routing shape than the step's (a store of another model) waits to ship first at the next
  step; any other (a repeated sample id) is deleted ``malformed``.
* **Shipping.** Once ``groups_per_step`` groups are queued and the trainer ranks are known, the next step is
  packed and each rank gets its :class:`DeliverBatch`. One step is in delivery at a time: the next one is
  packed only when every rank acknowledged. A rank that refused or did not answer gets the *same* step
  batch again (same step number, same micro batches; a rank answers an identical repeat with ok) every
  ``redeliver_after_s``, because the ranks that acknowledged already wait in the step's collective. When
  ``delivery_s`` has passed since the step was packed, the core halts (:class:`Halt`, naming the ranks).
* **Admission.** At most ``(max_staleness + v + 1) * groups_per_step`` groups may be trained, queued or
  running while the trainer is at version ``v`` (groups dropped untrained give their slot back; an open group
  this incarnation did not send holds none: :attr:`~OrchestratorCore.slots_held`), and at most
  ``max_groups_in_flight`` run at once. Sources take turns; each run goes to the least-loaded replica.
* **Runs.** Every run has a deadline (``run_s``): unanswered by then, it counts as failed, its group is
  abandoned and its slot is free again (an eval run's group took no slot: nothing is given up). A run
  answered whose episode is not fed within :attr:`~OrchestratorCore.episode_wait_s` of its answer (its
  ``episode-finished`` lost: a store killed between its answer and its event, a broker restart) gives its room
  back, and its group, if still open, is abandoned (``incomplete``): a group none of whose episodes ever came
  never times out as a group, and would hold its admission slot and its runs' room for good.
* **Stores down.** An env server the registry reports down (:meth:`OrchestratorCore.store_down`) gets no
  new runs and no deletes (deletes decided meanwhile wait). Back as the same store within
  ``restart_grace_s`` (:meth:`OrchestratorCore.store_up`): the same process, or a restart that re-adopted
  its durable store (same ``store`` label, :func:`store_identity`), the waiting deletes go out (one the store
  went down before answering under the id of the request that carried it, :attr:`DeleteBlobs.request_id`: it
  may have been carried out); otherwise (the grace ends, or it comes back with a fresh store that starts empty)
  every reference held to its blobs is dropped as ``lost`` (:class:`LoseBlobs`, naming the node), and samples
  whose blobs are lost are never shipped (counted as dropped ``lost``). A store declared lost that comes back
  as the same process (it was cut off, not dead) still keeps those blobs: they are deleted there at once,
  reason ``lost`` (the store's ``delete`` event confirms the loss; the ledger counts each blob once), those of
  a delete it went down before answering under that request's id again. Claims the store went down before
  answering (it may have granted them) are named in its loss, or, when it is back as the same store, claimed
  again (:class:`ClaimAgain`: a claim repeated by its holder is answered ``already``); what that grants is
  deleted (``claim-failed``, :meth:`~OrchestratorCore.claimed_late`): their episodes went on without them.
* **Trainer worlds.** A trainer rank the steps go to reported down (:meth:`OrchestratorCore.trainer_down`)
  ends its world: nothing more ships, the step in delivery is given up (what ranks acknowledged, or took as
  their ``reference`` events say, is theirs, and the stores reclaim it once they are gone; what a rank
  refused is deleted, ``trainer-down``; a batch whose outcome is unknown, its request in flight or
  unanswered, may be its rank's already: acknowledged or referenced later it is the rank's, refused it is
  deleted, and what is still unknown once the stores have reclaimed the old world's blobs was never taken and
  is deleted then) and the core waits up to ``world_restart_s`` for a new world: ``trainers`` ranks, none of
  the old world's processes, all reporting the same ``step`` K in their status (a world resumed from its
  checkpoint of step K). New ranks usually take the old ones' node ids, so nothing ships to them before
  every old rank was reported down and ``restart_grace_s`` (plus a quarter of it, the stores' reclaim
  period) has passed since: the stores have reclaimed what the old world held by then, and cannot take
  the new world's blobs for it. It then continues at step K with policy version K (the new lineage's first
  version): the groups shipped in steps >= K give their admission slots back, and samples of versions
  above K (the retired lineage's), queued or arriving later, are dropped as ``stale``. No new world by then:
  it halts,
  naming the ranks. Ranks that leave once the last step's version is committed have finished: no wait.
* **Start and end.** No run is dispatched before a policy version exists (a ``version-bump``, or the
  parameter server's version learned otherwise: :meth:`~OrchestratorCore.on_version`). A run refused
  because the loop's other nodes are not up yet (``NOT_READY`` codes) pauses dispatch, for a pause that
  doubles with each refusal up to ``BACKOFF_MAX_S``, and until a run succeeds at most one group runs at a
  time; one warning per pause, not one per run. ``max_steps`` 0 takes the step budget the trainer ranks
  advertise (label ``steps``, the smallest): once that many steps shipped, nothing more ships or runs and
  whatever arrives is deleted (``max_steps``), so ranks that trained their steps and left are never sent
  another one.
* **Restart.** A started orchestrator may be a restart under the same node id: it rebuilds its state from the
  authorities, never from the event ring. The step number comes from the trainer ranks
  (:meth:`~OrchestratorCore.resume_step`): each reports the next step it trains (``step``) and the last step batch
  it accepted (``received``); shipping goes on at the highest of every rank's ``step`` and ``received + 1``, so no
  rank is sent a step it already holds (it would refuse it, ``duplicate-step``), and the steps before count as
  admitted groups. A rank that lacks a step before that one (the earlier incarnation died between delivering a
  step's batches to some ranks and to the others) is sent an empty batch for it first (a *fill*): every rank skips
  that step (the others delete what they hold of it as dropped), then training goes on in step; a fill refused
  ``duplicate-step`` found its rank holding the step after all (the rank's registry status lagged), which is what
  it was sent for. A status is the rank's last heartbeat's: nothing is decided before two heartbeat intervals
  after the executor's start (``statuses_fresh_at``), and a real batch refused ``duplicate-step`` all the same
  halts, not finally, for a restart that reads the statuses again. What the stores list for this node id or as
  unclaimed (:meth:`~OrchestratorCore.reclaimable`, then :meth:`~OrchestratorCore.recover`) is claimed and fed as
  if it had just finished, so groups and the queue are rebuilt; its own ``episode-finished`` event, if it comes
  too, is ignored. Episodes of groups this incarnation did not send (after a restart, the earlier one's runs still
  in flight or re-adopted by a restarted store; or any peer's) are grouped like any other; such a group holds no
  admission slot while open (a relaunched cluster's re-adopted episodes open dozens that can never complete, and
  would fill the bound until they time out: nothing would train), and takes one as it closes, given back when it
  closed untrained; incomplete, they are abandoned after ``group_timeout_s`` (deleted ``incomplete``, stragglers
  ``late``). Runs and groups are named with the incarnation's ``tag``, so they never collide with the earlier
  incarnation's.
* **Backpressure.** A group starts only when the room all its runs will keep can be reserved
  (:class:`~.shipping.ReplicaRouter`): each run reserves one episode (at the mean charge of those kept so far:
  an episode none of whose blobs a store granted, which any peer may publish, sizes nothing)
  at a replica of the group's source whose bytes held plus reservations stay under its high-water mark, and
  keeps it until its episode is counted as held there (or it keeps nothing: it failed, or its group was given
  up). So a group started can always complete: partial groups never hold the room the others need. Before the
  first episode's charge is known, one group runs at a time. When no source has room for a group, no new
  group starts (logged once per pause, counted in ``full_pauses``) until a store drains; stores drain as
  holders delete, so trainers slower than rollouts bound the work in flight instead of failing keeps. When
  nothing is in flight while no source has room for a group, what the stores hold waits for a step that needs
  more groups: one group at a time goes anyway (counted in ``starved``, with a warning that the budget holds
  less than two steps), reserving room under the stores' budgets instead; none has room, the core waits for
  the holders (trainer ranks) to delete (:meth:`~OrchestratorCore.idle_reason` says what it waits for: what
  the stores hold, stores down or not heard from since they registered again), unless the budgets hold fewer
  episodes than one step needs (``groups_per_step`` times ``group_size``), counted in whole groups at one
  source each (a group's runs all keep at its source): then no step could ever ship, and once that has
  lasted ``restart_grace_s`` with the same stores (``dispatch.budget_short``: a store registering late, a
  slow host's, is counted in that time) it halts (:class:`Halt`, ``dispatch.budget_below_step``) naming the
  budget that would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ...bus.peers import incarnation
from ...protocol.messages import BlobRef, EpisodeFinished, HeldEpisode, NodeInfo, Run, StepBatch
from .packing import PackingError
from .prompts import MakePrompt, PromptSource, as_prompt_source
from .records import MalformedEpisode, column, reward_of, token_ids
from .shipping import (
    MALFORMED,
    EvalSink,
    Holdings,
    ReplicaRouter,
    Sample,
    Taker,
    TrainerAddress,
    TrainSink,
    sample_info,
)

if TYPE_CHECKING:
    from ..settings import OrchestratorSettings

log = structlog.get_logger(__name__)

NOT_READY = frozenset({"no-rollout", "no-weights"})  # run refusals that mean "a peer is not up yet", not a fault
BACKOFF_FIRST_S = 0.25  # dispatch pause after the first not-ready refusal; doubles with each one after
BACKOFF_MAX_S = 8.0
# Steps whose shipped groups are kept one by one for a world's rewind (older ones as one total): a world resumes
# from its newest checkpoint, ``trainer.checkpoint_every`` steps back unless checkpoints were lost.
SHIPPED_STEPS_KEPT = 1024


# --- actions: what the executor does -------------------------------------------------------------------


@dataclass(frozen=True)
class DeleteBlobs:
    """Delete ``refs`` (held by the orchestrator until now) on their env servers, for ``reason``; ``node``: the
    store whose loss it carries out (reason ``lost``), else empty.

    ``request_id``: the id of a request that carried these refs to their store before it was reported down
    (empty: none did, send a new one). That store may have carried it out, so this goes out under that id, with
    the same refs, to where the store is now: the same process answers from its reply cache (or refuses a
    ``replay``) instead of deleting twice, which it would count a violation; another process that re-adopted
    the durable store has no cache and runs it, answering what its predecessor had deleted as done
    (``repeated``). Only the reason may differ from that request's: ``lost`` once the store was declared lost
    meanwhile (then it is carried out only where the request had not been)."""

    refs: tuple[BlobRef, ...]
    reason: str
    node: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class DeliverBatch:
    """Send ``batch`` (step ``step``) to the rank at ``endpoint``; report the outcome with
    :meth:`OrchestratorCore.on_delivered`. A re-delivery is the same batch, as a new request."""

    step: int
    endpoint: str
    batch: StepBatch


@dataclass(frozen=True)
class SendRun:
    """Send ``run`` to the env server at ``endpoint``; report the outcome with
    :meth:`OrchestratorCore.on_run_done` (keyed by ``run.episode_id``) within ``deadline_s``."""

    endpoint: str
    run: Run
    deadline_s: float


@dataclass(frozen=True)
class LoseBlobs:
    """The store ``node_id`` went down and was not back within the grace: ``refs`` (held until now) are
    gone with it. Nothing to delete: report the loss (a ``delete`` event with reason ``lost`` naming the
    node)."""

    refs: tuple[BlobRef, ...]
    node_id: str


@dataclass(frozen=True)
class ClaimAgain:
    """Claims whose outcome is unknown (no answer in time, an error answer, or their store went down before
    answering and is back as the same store): the store may have granted them. Claim ``refs`` again (a claim
    repeated by its holder is answered ``already``) and report what it grants with
    :meth:`OrchestratorCore.claimed_late`."""

    refs: tuple[BlobRef, ...]


@dataclass(frozen=True)
class Halt:
    """The run cannot go on (a step that could not be delivered): stop, loudly, with ``reason``. ``final``: a
    restart would only decide the same again (budgets that cannot hold a step, a batch no message can carry), so
    the node exits :data:`~..halting.HALTED_STATUS` and is never restarted; not final: a deadline ran out on peers
    that may yet come (a trainer world late to come back, ranks that did not acknowledge a step, delayed by their
    supervisor's backoff or a slow start), and the node exits 1, as a crash, for its supervisor to restart."""

    reason: str
    final: bool = True


Action = DeleteBlobs | DeliverBatch | SendRun | LoseBlobs | ClaimAgain | Halt

LOST = "lost"
TRAINER_DOWN = "trainer-down"
UNREFERENCED = "unreferenced"
CLAIM_FAILED = "claim-failed"


@dataclass(frozen=True)
class Deadlines:
    """How long the orchestrator waits for each peer, each derived from the setting of the peer it waits for.

    ``delivery_s``: a step batch is re-delivered until then (the trainer's ``batch_timeout_s``: a rank that
    has not received its batch by then has failed the step itself); ``redeliver_after_s``: the pause before
    re-delivering to a rank that refused (the request policy's first timeout); ``run_s``: how long a run
    may go unanswered (the env server's ``generate_timeout_s``, after which it answers with an error
    itself, plus the request policy's whole retry schedule as slack for a busy env server);
    ``restart_grace_s``: how long a store reported down has to come back before its blobs count as lost
    (``node.restart_grace_s``); ``world_restart_s``: how long a trainer world that went down has to be
    back (the restart grace plus the time a world takes to start); ``busy_store_s``: how long a request whose
    outcome must be known (a delete, a claim sent again to learn what an unanswered one did) is sent again,
    the same request, to an env server that is live but does not answer (as long as a run may take: the
    slack the orchestrator gives a busy env server).
    """

    delivery_s: float = 300.0
    redeliver_after_s: float = 2.0
    run_s: float = 44.0
    restart_grace_s: float = 10.0
    world_restart_s: float = 70.0
    busy_store_s: float = 44.0


# --- state ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One sample of an episode's record, checked (:meth:`OrchestratorCore._parse`)."""

    sample_id: str
    ref: BlobRef | None
    inputs: dict[str, Any]


@dataclass
class _Group:
    started: float
    episodes: list[tuple[float, list[Sample]]] = field(default_factory=list)  # (reward, samples)
    members: set[str] = field(default_factory=set)  # the ids of the episodes in ``episodes``
    unsent: bool = False  # not sent by this incarnation (an earlier one's, any peer's): no slot while open


@dataclass
class _Delivery:
    """The step being delivered: which ranks still owe an acknowledgement, and when each is re-sent."""

    step: int
    batches: Mapping[str, StepBatch]  # endpoint -> its batch
    deadline: float
    in_flight: set[str]  # endpoints with a request out
    retry_at: dict[str, float] = field(default_factory=dict)  # endpoint -> when to re-deliver
    errors: dict[str, str] = field(default_factory=dict)  # endpoint -> its last failure
    # Endpoints whose last outcome was a refusal (the rank answered: it took nothing of the batch); after a
    # failure without an answer (a timeout, the rank reported down) the rank may hold the batch.
    refused: set[str] = field(default_factory=set)
    referenced: set[str] = field(default_factory=set)  # endpoints whose rank's ``reference`` event came: taken

    @property
    def unacknowledged(self) -> list[str]:
        return sorted(self.in_flight | set(self.retry_at))


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """A group's advantages: its rewards less their mean, over their (population) standard deviation plus 1e-6.
    Rewards all equal give exactly 0.0 each, so the group is filtered: their mean can round off the one value
    (0.1 three times has a mean of 0.10000000000000002), and the tiny advantages that gives would ship the group,
    count its tokens in the step's token mean and train them on the entropy bonus alone. Finite rewards too large
    to normalise give non-finite advantages (the caller drops the group)."""
    if rewards.size and rewards.min() == rewards.max():
        return np.zeros_like(rewards)
    with np.errstate(over="ignore", invalid="ignore"):
        return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


def store_identity(node: NodeInfo) -> tuple[object, ...]:
    """What tells one store from another under a node id: a durable store's identity (label ``store``: the
    same across restarts that re-adopt it), else the process (an in-memory store dies with it)."""
    label = node.labels.get("store")
    return ("store", label) if label else incarnation(node)


@dataclass
class _StoreDown:
    """An env server reported down: its endpoints, which process it was, when its grace ends, and the deletes
    decided for its blobs meanwhile."""

    node_id: str
    endpoints: frozenset[str]
    incarnation: tuple[object, ...]  # store_identity()
    until: float
    deletes: list[DeleteBlobs] = field(default_factory=list)  # sent when it is back
    unsure: list[BlobRef] = field(default_factory=list)  # claims whose answer died with it (granted or not)

    def keeps(self, ref: BlobRef) -> bool:
        """Whether ``ref``'s blob is in this store: by node id (a store restarted on a re-adopted durable
        store serves its blobs at a new endpoint), by endpoint for references that name no node."""
        return ref.node == self.node_id if ref.node else ref.endpoint in self.endpoints


@dataclass(frozen=True)
class _WorldDown:
    """The trainer world went down: which rank died first, its processes (with when each was reported down),
    and when the wait ends."""

    node_id: str
    incarnations: frozenset[tuple[str, int, float]]
    until: float
    down_at: dict[tuple[str, int, float], float] = field(default_factory=dict)
    # The given-up step's batches whose outcome is unknown (endpoint -> batch): the rank may have taken them.
    unsettled: dict[str, StepBatch] = field(default_factory=dict)

    def reclaimed_by(self, grace_s: float) -> float | None:
        """When the stores have reclaimed what every old rank held; None while one is not reported down."""
        if set(self.down_at) != self.incarnations:
            return None
        return max(self.down_at.values()) + grace_s * 1.25


class _ShippedGroups:
    """The groups each step shipped, so that a world resumed at step K gives back the admission slots of the
    groups shipped in steps >= K (:meth:`rewind`). Steps ascend by one from the first shipped (a rewind forgets
    those above its step). The newest ``kept`` are kept one by one; older ones are folded into one total, so a
    run of any length holds ``kept`` entries. A rewind reaching into the folded steps gives back all of them
    when it goes past their first, else ``groups_per_step`` for each of those it reaches (the most a step
    ships), at most their total: an estimate, logged. The steps an earlier incarnation shipped are such a total
    (:meth:`resumed`)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._steps: dict[int, int] = {}  # step -> groups it shipped, in step order
        self._folded: tuple[int, int, int] = (0, 0, 0)  # (first step, one past the last, groups) of the folded ones

    def __len__(self) -> int:
        return len(self._steps)

    def shipped(self, step: int, groups: int) -> None:
        """Step ``step`` shipped ``groups`` groups."""
        self._steps[step] = groups
        while len(self._steps) > self.kept:
            oldest = next(iter(self._steps))
            first, end, total = self._folded
            self._folded = (first if end > first else oldest, oldest + 1, total + self._steps.pop(oldest))

    def resumed(self, start: int, groups_per_step: int) -> None:
        """Steps before ``start`` were shipped by an earlier incarnation: one total, of full steps (what admission
        counts them as)."""
        self._folded = (0, start, start * groups_per_step)

    def rewind(self, step: int, groups_per_step: int) -> int:
        """Forget the steps >= ``step``; the groups they shipped."""
        rewound = sum(n for s, n in self._steps.items() if s >= step)
        self._steps = {s: n for s, n in self._steps.items() if s < step}
        first, end, total = self._folded
        if step >= end:
            return rewound
        if step <= first:
            self._folded = (0, 0, 0)
            return rewound + total
        estimate = min(total, (end - step) * groups_per_step)
        self._folded = (first, step, total - estimate)
        log.warning("trainers.rewind_estimated", step=step, steps=end - step, groups=estimate,
                    detail=f"steps {step}..{end - 1} are known as one total only (older than the newest {self.kept}, "
                           "or shipped by an earlier incarnation): each counted as a full step")
        return rewound + estimate


@dataclass(frozen=True)
class _RunInFlight:
    group_id: str
    endpoint: str
    deadline: float
    sequence: int  # runs sent before this one
    evaluation: bool = False  # an eval group's: it took no admission slot, so its failure gives none back


class OrchestratorCore:
    """Every decision of the orchestrator (see the module doc). Not thread-safe: one caller.

    Every method that takes ``now`` returns the actions to take, in order; deletes decided along the way
    come first. Counters feed metrics and the summary. ``tag`` goes into every group and run name this
    incarnation sends (a restart under the same node id must not reuse the earlier one's names).
    """

    def __init__(self, settings: OrchestratorSettings, deadlines: Deadlines | None = None, *,
                 prompts: PromptSource | MakePrompt | None = None, tag: str = "") -> None:
        self.settings = settings
        self.deadlines = deadlines or Deadlines()
        self.holdings = Holdings()
        self.eval_sink = EvalSink(self.holdings)
        self.sink = TrainSink(self.holdings, seq_len=settings.seq_len, max_staleness=settings.max_staleness)
        self.policy_version = 0
        self.step = 0  # the next step number; a step counts once packed
        self.groups: dict[str, _Group] = {}
        # group id -> when it closed (completed or abandoned) and the episodes it had then: its stragglers are
        # deleted ``late``, its episodes' repeats ignored. Forgotten after closed_horizon_s (tick), so the map follows
        # the groups of the last few minutes, not the run.
        self.closed_groups: dict[str, tuple[float, frozenset[str]]] = {}
        self.episodes = 0
        self.abandoned_groups = 0
        self.malformed_episodes = 0  # records that could not be trained as they came: deleted ``malformed``
        self.duplicate_episodes = 0  # episodes fed again while their group was open or remembered closed: ignored
        self.unreferenced_blobs = 0  # claimed blobs no sample of their record points to: deleted ``unreferenced``
        self.delivery: _Delivery | None = None
        self.redeliveries = 0
        self.failure = ""  # why the run halted; empty while it goes on
        # Since when the stores seen (those node ids) cannot hold a step, nothing in flight: the budget halt waits
        # restart_grace_s for another store to register; None while they can, or while that is not the question.
        self._short_since: tuple[frozenset[str], float] | None = None
        # runs (dispatch)
        self.prompts = as_prompt_source(prompts) if prompts is not None else None
        self.rng = np.random.default_rng(settings.seed)
        self.router = ReplicaRouter()
        self.runs: dict[str, _RunInFlight] = {}  # episode id -> its run
        # episode id -> (its group, when its run was answered ok), until the episode is fed: see episode_wait_s
        self._answered: dict[str, tuple[str, float]] = {}
        self.groups_running: Counter[str] = Counter()
        self.groups_sent = 0
        self.train_groups_sent = 0
        self.eval_sent_at = -1
        self.failed_runs = 0
        self.expired_runs = 0
        # stores down
        self.stores_down: dict[str, _StoreDown] = {}  # node id -> its state
        self.lost: Counter[str] = Counter()  # blobs lost, by store node id
        # node id -> (the incarnation declared lost, the deletes of its blobs): sent if that same store comes back
        self.lost_stores: dict[str, tuple[tuple[object, ...], tuple[DeleteBlobs, ...]]] = {}
        self.version_known = False  # no run before a policy version exists
        self.stores_full = False  # every store at its high-water mark: no new group until one drains
        self.full_pauses = 0
        self.starved = 0  # groups sent though every store was full, since nothing else could free room
        self.max_steps = settings.max_steps or None  # None: the trainer ranks' budget, once they are known
        self.refused_runs = 0  # runs refused as not ready (NOT_READY)
        self._backoff_s = 0.0  # the current dispatch pause; 0 while runs succeed
        self._runs_sent = 0
        self._paused_after = 0  # refusals of the runs sent before the current pause are already paid for
        self._resume_at = float("-inf")
        self._refused_unlogged = 0
        # trainer worlds
        self.world: frozenset[tuple[str, int, float]] = frozenset()  # the processes of the ranks steps go to
        self._takers: dict[str, Taker] = {}  # the world's trainer endpoints -> their ranks (see HandedOver)
        self.world_down: _WorldDown | None = None
        self.world_restarts = 0
        self.rewound_groups = 0  # groups trained by a world that went down after its last checkpoint
        self._groups_of_step = _ShippedGroups(SHIPPED_STEPS_KEPT)
        # restart
        self.tag = tag
        self.step_resumed = False  # the step number was taken from the trainer ranks
        # From when (this core's clock) the ranks' registry statuses postdate any step batch an earlier incarnation
        # delivered: the executor's start plus two heartbeat intervals (see resume_step).
        self.statuses_fresh_at = 0.0
        self.resumed = False  # an earlier incarnation's steps or episodes were found: this is a restart
        self.recovered_episodes = 0  # fed from the stores' holdings at start
        self.adopted_groups = 0  # groups this incarnation did not send (an earlier incarnation's)
        self._recovered: set[str] = set()  # episode ids recovered whose own event may still come
        # step -> the ranks to send an empty batch for it: an earlier incarnation delivered it to the others only
        self._fills: dict[int, list[TrainerAddress]] = {}
        # Groups sent by this incarnation and not closed yet, with their prompts (told to the prompt source
        # with the group's rewards once it completes).
        self._admitted: dict[str, tuple[int, ...]] = {}

    # --- what the executor asks ----------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    @property
    def wants_trainers(self) -> bool:
        """A step is ready to pack but the trainer ranks are not all known: look them up and
        :meth:`use_trainers`."""
        return (len(self.sink.trainers) < self.settings.trainers and not self.finished
                and len(self.sink.queue) >= self.settings.groups_per_step)

    @property
    def groups_released(self) -> int:
        """Groups that will never train: their admission slots are free again."""
        return self.abandoned_groups + self.sink.dropped_groups + self.rewound_groups

    # --- events --------------------------------------------------------------------------------------

    def on_version(self, version: int) -> None:
        """A committed policy version (from a ``version-bump``, or the parameter server's registry entry)."""
        if version < 0:
            return
        self.policy_version = max(self.policy_version, version)
        self.version_known = True

    def on_episode(self, now: float, episode: EpisodeFinished, claimed: Collection[BlobRef]) -> list[Action]:
        """An episode arrived; ``claimed``: those of its refs the orchestrator now owns (the others' blobs
        were gone or their env server did not answer). An episode already recovered from its store is
        ignored (its claim was a repeat)."""
        if episode.episode_id in self._recovered:
            self._recovered.discard(episode.episode_id)
            return []
        # A blob held here already came with an earlier episode: a claim repeated by its holder is answered
        # ``already``, so a repeated event (or one naming another episode's blobs) is granted them again. They are
        # that episode's, never this one's to take, group or drop.
        claimed = [ref for ref in claimed if ref.blob_id not in self.holdings.held]
        if episode.again and not claimed:  # a restarted store's repeat of an episode taken here (or since gone)
            log.info("episode.repeat", episode_id=episode.episode_id, source=episode.source)
            return []
        info = episode.info
        group_id = str(info.get("group", episode.episode_id))
        if episode.episode_id in self._members(group_id):
            return self._duplicate(episode, group_id, claimed)
        self._answered.pop(episode.episode_id, None)
        self.episodes += 1
        if claimed:  # a store the registry lists granted its blobs: it keeps them, at the episode's charge
            self.router.kept(episode)
        else:  # nothing vouches for what it says it keeps (any peer may publish one): its size counts for nothing
            self.router.release(episode.episode_id)
        try:  # before anything is taken: a record that cannot be trained as it came is deleted whole
            reward, entries = self._parse(episode)
        except MalformedEpisode as error:
            return self._malformed(now, episode, claimed, group_id, str(error))
        self.holdings.take(claimed)
        samples = self._samples(episode, entries, {ref.blob_id for ref in claimed})
        self._unreferenced(episode, entries, claimed)
        if info.get("eval"):
            self.eval_sink.add(samples)
        elif self.finished:
            self.sink.drop(samples, "max_steps")
        elif group_id in self.closed_groups:
            self.sink.drop(samples, "late")
        else:
            group = self._open(now, group_id)
            group.episodes.append((reward, samples))
            group.members.add(episode.episode_id)
            if len(group.episodes) >= self.settings.group_size:
                self._complete(now, group_id)
        return self._ship_ready(now)

    def _members(self, group_id: str) -> Collection[str]:
        """The episodes group ``group_id`` has: open, or closed and still remembered (empty: neither)."""
        if (group := self.groups.get(group_id)) is not None:
            return group.members
        closed = self.closed_groups.get(group_id)
        return closed[1] if closed is not None else ()

    def _duplicate(self, episode: EpisodeFinished, group_id: str, claimed: Collection[BlobRef]) -> list[Action]:
        """``episode`` is in its group already, open or closed (its ``episode-finished`` came again): counted and
        logged, never grouped twice (its reward twice in the group's advantages, its samples twice in a step) nor
        taken as a straggler (its samples counted ``missing``, the blobs it holds here never its to drop). What its
        claims granted now that the first one's did not went on without it: deleted (``claim-failed``)."""
        self.duplicate_episodes += 1
        log.warning("episode.duplicate", episode_id=episode.episode_id, group=group_id, source=episode.source)
        return self.claimed_late(list(claimed))

    def _unreferenced(self, episode: EpisodeFinished, entries: Sequence[_Entry], claimed: Collection[BlobRef]) -> None:
        """Delete at once (``unreferenced``, counted, logged once per episode) the claimed blobs no sample of
        the record points to (more branches than samples, a record without samples): nothing would ever ship
        or drop them, so they would stay held here until shutdown."""
        referenced = {entry.ref.blob_id for entry in entries if entry.ref is not None}
        unreferenced = [ref for ref in claimed if ref.blob_id not in referenced]
        if not unreferenced:
            return
        self.unreferenced_blobs += len(unreferenced)
        self.holdings.delete(unreferenced, UNREFERENCED)
        log.warning("episode.unreferenced", episode_id=episode.episode_id, source=episode.source,
                    blobs=len(unreferenced), samples=len(entries))

    def _malformed(self, now: float, episode: EpisodeFinished, claimed: Collection[BlobRef], group_id: str,
                   error: str) -> list[Action]:
        """An episode whose record cannot be trained (see :meth:`_parse`): its claimed blobs are taken and
        deleted at once (``malformed``), and its group, which can never complete, is abandoned like one whose
        run failed (what arrived of it is deleted ``incomplete``, its stragglers ``late``)."""
        self.malformed_episodes += 1
        entries = episode.info.get("samples")
        self.sink.dropped[MALFORMED] += len(entries) if isinstance(entries, list) else 0
        self.holdings.take(claimed)
        self.holdings.delete(claimed, MALFORMED)
        log.warning("episode.malformed", episode_id=episode.episode_id, source=episode.source, group=group_id,
                    blobs=len(claimed), error=error)
        if not episode.info.get("eval") and not self.finished and group_id not in self.closed_groups:
            self._open(now, group_id)  # as its first episode would (see _open: slots stay even), then closed
            self.abandon(now, group_id)
        return self._ship_ready(now)

    def _open(self, now: float, group_id: str) -> _Group:
        """The open group ``group_id``, opened now if it is not. A group this incarnation did not send takes an
        admission slot too, held once it closes (:attr:`slots_held`), since closing it untrained (abandoned,
        filtered, stale) gives one back: an earlier
        incarnation's (after a restart, counted adopted; or before one was told, its runs' episodes coming to a
        restart at step 0 that recovered nothing), one it sent and forgot (a straggler of a group closed more than
        :attr:`closed_horizon_s` ago), any peer's. Otherwise each such group closed would admit one group more
        than the bound, for good."""
        group = self.groups.get(group_id)
        if group is None:
            unsent = group_id not in self._admitted
            if unsent:
                self.train_groups_sent += 1
                self.adopted_groups += self.resumed  # an earlier incarnation's
            group = self.groups[group_id] = _Group(started=now, unsent=unsent)
        return group

    def use_trainers(self, now: float, nodes: Iterable[NodeInfo]) -> list[Action]:
        """The trainer ranks from the registry; shipping starts once ``settings.trainers`` are known."""
        nodes = list(nodes)
        if self.world_down is not None:
            return self._new_world(now, nodes)
        trainers = [TrainerAddress.from_node(node) for node in nodes]
        if len(trainers) < self.settings.trainers or not self.resume_step(now, nodes):
            return []
        self.sink.use_trainers(trainers)
        self._use_world(nodes)
        budgets = [int(steps) for node in nodes if (steps := node.labels.get("steps", "")).isdigit()]
        if self.max_steps is None and budgets:
            self.max_steps = min(budgets)
        log.info("trainers.found", ranks=[t.rank for t in self.sink.trainers], max_steps=self.max_steps)
        return self._ship_ready(now)

    def _use_world(self, nodes: Sequence[NodeInfo]) -> None:
        """Steps go to the ranks ``nodes`` from now on (the old world's batches are all settled by then)."""
        self.world = frozenset(incarnation(node) for node in nodes)
        self._takers = {node.endpoints["trainer"]: Taker(node.node_id, incarnation(node)) for node in nodes}

    def taker(self, endpoint: str) -> Taker | None:
        """The rank of the current world (or of the one that went down, until a new one is taken) at ``endpoint``."""
        return self._takers.get(endpoint)

    def _hand_over(self, endpoint: str, batch: StepBatch) -> None:
        """The rank at ``endpoint`` took ``batch``: its owned blobs are that rank's (kept in ``holdings.handed``)."""
        self.holdings.hand_over(batch, self._takers.get(endpoint))

    def on_delivered(self, now: float, step: int, endpoint: str, error: str | None, *,
                     refused: bool = False, holds_step: bool = False) -> list[Action]:
        """The outcome of a :class:`DeliverBatch`: ``error`` None when the rank acknowledged; ``refused`` when
        the rank answered with an error (it took nothing of the batch), not when nothing answered (a timeout,
        the rank reported down: it may have taken the batch); ``holds_step`` when that refusal says the rank
        already holds a batch for ``step`` (``duplicate-step``)."""
        delivery = self.delivery
        if delivery is None or delivery.step != step or endpoint not in delivery.in_flight:
            return self._settle(step, endpoint, error, refused)  # a step given up, or one already settled
        delivery.in_flight.discard(endpoint)
        if holds_step:
            if not delivery.batches[endpoint].micro_batches:
                error = None  # a fill to a rank that holds the step: what it was sent for
            else:  # only a restart can send a step a rank holds: it resumed on statuses older than that batch
                self.delivery = None
                self.failure = (f"rank {delivery.batches[endpoint].rank} already holds step {step}: this incarnation "
                                "resumed on trainer statuses older than a batch the earlier one delivered; a restart "
                                "reads them again")
                log.error("step.held_already", step=step, rank=delivery.batches[endpoint].rank, error=error)
                return self._flush([Halt(self.failure, final=False)])
        if error is None:
            self._hand_over(endpoint, delivery.batches[endpoint])
            delivery.errors.pop(endpoint, None)
            if delivery.unacknowledged:
                return []
            self.delivery = None
            return self._ship_ready(now)
        if refused:
            delivery.refused.add(endpoint)
        else:
            delivery.refused.discard(endpoint)
        delivery.errors[endpoint] = error
        delivery.retry_at[endpoint] = now + self.deadlines.redeliver_after_s
        log.warning("step.redeliver", step=step, rank=delivery.batches[endpoint].rank, endpoint=endpoint,
                    error=error, in_s=self.deadlines.redeliver_after_s)
        return self._check_delivery(now)

    def credit_stall(self, seconds: float) -> None:
        """Count ``seconds`` the orchestrator's loop did not run (its caller measured them: a timer pass more than
        a period late) toward none of the deadlines that judge its peers: every group's and run's, the answered
        runs' wait for their episodes, the closed groups' memory, the stores' graces, the delivery's deadline and
        re-sends, the trainer world's wait and the stores' reclaim it derives. The answers, events and
        registrations of that time wait unread in its sockets; judged on waking, a store back within its grace
        would be declared lost, a delivery its ranks acknowledged would halt the run."""
        if seconds <= 0:
            return
        for group in self.groups.values():
            group.started += seconds
        for episode_id, run in self.runs.items():  # values replaced in place: each map keeps its order
            self.runs[episode_id] = replace(run, deadline=run.deadline + seconds)
        for episode_id, (group_id, at) in self._answered.items():
            self._answered[episode_id] = (group_id, at + seconds)
        for group_id, (at, members) in self.closed_groups.items():
            self.closed_groups[group_id] = (at + seconds, members)
        for down in self.stores_down.values():
            down.until += seconds
        if (delivery := self.delivery) is not None:
            delivery.deadline += seconds
            delivery.retry_at = {endpoint: at + seconds for endpoint, at in delivery.retry_at.items()}
        if (world := self.world_down) is not None:
            self.world_down = replace(world, until=world.until + seconds,
                                      down_at={process: at + seconds for process, at in world.down_at.items()})

    def tick(self, now: float) -> list[Action]:
        """Timers: expire groups and runs, re-deliver what is due, halt a delivery past its deadline."""
        horizon = now - self.settings.group_timeout_s
        for group_id in [g for g, group in self.groups.items() if group.started < horizon]:
            self.abandon(now, group_id)
        for episode_id in [e for e, run in self.runs.items() if run.deadline <= now]:
            self.expired_runs += 1
            self._run_done(now, episode_id, f"no answer within {self.deadlines.run_s:g}s")
        self._episodes_not_come(now)
        self._forget_closed(now)
        lost = [self._lose(node_id) for node_id, down in list(self.stores_down.items()) if down.until <= now]
        return self._flush([*lost, *self._check_delivery(now), *self._check_world(now)])

    # --- trainer worlds ------------------------------------------------------------------------------

    def on_reference(self, step: int, holder: str, blob_ids: Collection[str]) -> None:
        """Trainer rank ``holder``'s ``reference`` event: it took the step batch of ``step`` that hands over
        ``blob_ids`` (it publishes the event before it answers, and the stores hand blobs over on it), whether
        or not its answer ever comes. Decides a batch whose answer was unknown when its world went down (see
        :meth:`trainer_down`); only the batch shipped to ``holder`` (the caller took the event from an end of the
        hand-over only: any peer may publish one)."""
        named = set(blob_ids)
        delivery, down = self.delivery, self.world_down

        def took(endpoint: str, batch: StepBatch) -> bool:
            taker = self._takers.get(endpoint)
            return taker is not None and taker.node_id == holder and bool(named & set(batch.owned))

        if delivery is not None and delivery.step == step:
            delivery.referenced.update(ep for ep, batch in delivery.batches.items() if took(ep, batch))
        elif down is not None:
            taken = [ep for ep, batch in down.unsettled.items() if batch.step == step and took(ep, batch)]
            for endpoint in taken:
                self._hand_over(endpoint, down.unsettled.pop(endpoint))

    def trainer_down(self, now: float, node: NodeInfo) -> list[Action]:
        """A trainer rank was reported down: when it is one the steps go to, its world is over (see the
        module doc): give up the step in delivery and wait for a new world. Of the step's batches, those the
        ranks acknowledged, or whose ``reference`` event came (:meth:`on_reference`), are theirs; those a rank
        refused are deleted now (``trainer-down``). Those whose outcome is unknown (a request in flight, or one
        that got no answer) may be a rank's already (it takes a batch, publishes its ``reference`` and answers,
        and only the answer can be lost or late): they wait (acknowledged or referenced: the rank's, which it
        deletes or the stores reclaim from it; refused: deleted), and what is still unknown once the stores have
        reclaimed the old world's blobs was never taken (no rank can take it any more, and the stores hand blobs
        over only on the reference event): deleted then."""
        if self.world_down is not None and incarnation(node) in self.world_down.incarnations:
            self.world_down.down_at.setdefault(incarnation(node), now)
            return []
        if self.world_down is not None or incarnation(node) not in self.world or self._trained_all:
            return []
        self.world_down = _WorldDown(node.node_id, self.world, now + self.deadlines.world_restart_s,
                                     {incarnation(node): now})
        self._fills = {}  # the next world resumes from a checkpoint, every rank at one step
        delivery, self.delivery = self.delivery, None
        if delivery is not None:
            for endpoint in delivery.unacknowledged:
                batch = delivery.batches[endpoint]
                if endpoint in delivery.referenced:  # taken, its answer lost or still on its way
                    self._hand_over(endpoint, batch)
                elif endpoint in delivery.retry_at and endpoint in delivery.refused:
                    self._delete_owned([batch])
                elif batch.owned:
                    self.world_down.unsettled[endpoint] = batch
        log.error("trainers.world_down", node=node.node_id, rank=node.labels.get("rank"), step=self.step,
                  waiting_s=self.deadlines.world_restart_s,
                  undelivered_step=delivery.step if delivery is not None else None,
                  unsettled_ranks=sorted(b.rank for b in self.world_down.unsettled.values()))
        return self._flush([])

    def _settle(self, step: int, endpoint: str, error: str | None, refused: bool) -> list[Action]:
        """The outcome of a batch of the step given up when the world went down (see :meth:`trainer_down`);
        an outcome of any other settled step changes nothing."""
        down = self.world_down
        batch = down.unsettled.get(endpoint) if down is not None else None
        if down is None or batch is None or batch.step != step or (error is not None and not refused):
            return []
        del down.unsettled[endpoint]
        if error is None:  # the rank's now: the stores reclaim it from the rank if it is gone
            self._hand_over(endpoint, batch)
        else:
            self._delete_owned([batch])
        return self._flush([])

    def _give_up_unsettled(self, now: float) -> None:
        """Once the stores have reclaimed what the old world held, delete what is still unsettled: neither
        acknowledged nor referenced by then, no rank took it, so it is still this node's."""
        down = self.world_down
        if down is None or not down.unsettled:
            return
        reclaimed = down.reclaimed_by(self.deadlines.restart_grace_s)
        if reclaimed is None or now < reclaimed:
            return
        log.warning("trainers.unsettled_deleted", step=next(iter(down.unsettled.values())).step,
                    ranks=sorted(batch.rank for batch in down.unsettled.values()))
        self._delete_owned(down.unsettled.values())
        down.unsettled.clear()

    def _delete_owned(self, batches: Iterable[StepBatch]) -> None:
        """Delete (``trainer-down``) the blobs ``batches`` hand over that are still held here."""
        owned = {blob_id for batch in batches for blob_id in batch.owned}
        self.holdings.delete([self.holdings.held[b] for b in sorted(owned) if b in self.holdings.held], TRAINER_DOWN)

    def _new_world(self, now: float, nodes: list[NodeInfo]) -> list[Action]:
        """During a wait: take the new world once all its ranks report the same step."""
        down = self.world_down
        assert down is not None
        fresh = [node for node in nodes if incarnation(node) not in down.incarnations and "step" in node.status]
        steps = {int(node.status["step"]) for node in fresh}
        reclaimed = down.reclaimed_by(self.deadlines.restart_grace_s)
        if len(fresh) < self.settings.trainers or len(steps) != 1 or reclaimed is None or now < reclaimed:
            return []
        (step,) = steps
        self._give_up_unsettled(now)
        self.world_down = None
        self.world_restarts += 1
        self.sink.use_trainers([TrainerAddress.from_node(node) for node in fresh])
        self._use_world(fresh)
        rewound = self._groups_of_step.rewind(step, self.settings.groups_per_step)
        self.rewound_groups += rewound
        retired = [s for group in self.sink.queue for s in group if s.policy_version > step]
        if retired:
            self.sink.drop(retired, "stale")
            kept = [[s for s in group if s.policy_version <= step] for group in self.sink.queue]
            self.sink.dropped_groups += sum(1 for group in kept if not group)
            self.sink.queue = [group for group in kept if group]
        log.warning("trainers.world_resumed", step=step, previous_step=self.step, rewound_groups=rewound,
                    stale_samples=len(retired), ranks=sorted(node.node_id for node in fresh))
        self.step = step
        self.policy_version = step
        return self._ship_ready(now)

    @property
    def _trained_all(self) -> bool:
        """The ranks pushed the weights of the last step: ranks that leave now have finished."""
        return self.max_steps is not None and self.policy_version >= self.max_steps

    def _check_world(self, now: float) -> list[Action]:
        down = self.world_down
        if down is not None and self._trained_all:  # it had finished: its last version came after its bye
            for endpoint, batch in down.unsettled.items():  # every rank trained every step: each took its batch
                self._hand_over(endpoint, batch)
            self.world_down = None
            log.info("trainers.finished", node=down.node_id)
            return []
        self._give_up_unsettled(now)
        if down is None or now < down.until:
            return []
        self.failure = (f"the trainer world went down ({down.node_id} first) and no new world of "
                        f"{self.settings.trainers} ranks reported its step within {self.deadlines.world_restart_s:g}s")
        self.world_down = None
        log.error("trainers.world_not_back", error=self.failure)
        return [Halt(self.failure, final=False)]

    # --- stores down ---------------------------------------------------------------------------------

    def store_down(self, now: float, node: NodeInfo) -> list[Action]:
        """The env server ``node`` (its last registry entry) was reported down: no runs go to it from now
        on, and deletes of its blobs wait until it is back or its grace ends. Runs in flight on it end by
        their own outcomes (the executor's requests fail at once)."""
        endpoints = frozenset(node.endpoints.values())
        until = now + self.deadlines.restart_grace_s
        self.stores_down.setdefault(node.node_id, _StoreDown(node.node_id, endpoints, store_identity(node), until))
        self.router.drop(endpoints)
        log.warning("store.down", node=node.node_id, grace_s=self.deadlines.restart_grace_s,
                    blobs_held=sum(self.stores_down[node.node_id].keeps(ref) for ref in self.holdings.held.values()))
        return self._flush([])

    def store_up(self, node: NodeInfo) -> list[Action]:
        """The env server ``node`` registered again: the same store keeps its blobs (the deletes that
        waited go out now, found at its new endpoint); a new process under the same id with a fresh store
        starts empty, so the old one's blobs are lost. The same store back after its blobs were declared lost
        (a partition longer than the grace, or a restart that took longer) gets them deleted (reason
        ``lost``), so it does not keep them forever."""
        down = self.stores_down.get(node.node_id)
        if down is None:
            return self._delete_lost(node)
        if down.incarnation != store_identity(node):
            lost = self._lose(node.node_id)
            del self.lost_stores[node.node_id]  # a new process: nothing of the old one's is there to delete
            return self._flush([lost])
        del self.stores_down[node.node_id]
        log.info("store.back", node=node.node_id)
        return [*down.deletes, *([ClaimAgain(tuple(down.unsure))] if down.unsure else [])]

    def claim_unanswered(self, refs: Sequence[BlobRef]) -> None:
        """Claims whose store went down before answering (the store may have granted them): if that store's
        grace ends, they are named in its loss with the blobs this node held there; if it is back as the same
        store, they are claimed again (:class:`ClaimAgain`). Refs of a store that is not down are ignored."""
        for ref in refs:
            down = self._store_of(ref)
            if down is not None:
                down.unsure.append(ref)

    def claimed_late(self, refs: Sequence[BlobRef]) -> list[Action]:
        """A :class:`ClaimAgain` granted ``refs`` (now, or the unanswered claim did): their episode went on
        without them (counted ``missing``), so they are taken and deleted at once (``claim-failed``). Refs
        already held here (claimed again for another reason meanwhile) stay as they are."""
        late = [ref for ref in refs if ref.blob_id not in self.holdings.held]
        self.holdings.take(late)
        self.holdings.delete(late, CLAIM_FAILED)
        return self._flush([])

    def delete_undelivered(self, delete: DeleteBlobs) -> bool:
        """The executor sent ``delete`` (``request_id``: the request that carried it) and it ended with its store
        reported down: it waits with the store's other deletes, keeping its request id (see
        :class:`DeleteBlobs`): sent again when the store is back, lost when its grace ends. False when no store
        of its refs is down (the delete simply failed)."""
        return not self._defer([delete])

    def _delete_lost(self, node: NodeInfo) -> list[Action]:
        lost = self.lost_stores.pop(node.node_id, None)
        if lost is None or lost[0] != store_identity(node) or not lost[1]:
            return []
        log.warning("store.back_after_lost", node=node.node_id, blobs=sum(len(d.refs) for d in lost[1]))
        return list(lost[1])

    def _store_of(self, ref: BlobRef) -> _StoreDown | None:
        return next((down for down in self.stores_down.values() if down.keeps(ref)), None)

    def _lose(self, node_id: str) -> LoseBlobs:
        """Every reference to the store ``node_id``'s blobs is dropped: held ones, queued and grouped samples,
        and deletes that waited for it."""
        down = self.stores_down.pop(node_id)

        def on_store(sample: Sample) -> bool:
            return sample.ref is not None and down.keeps(sample.ref)

        refs = {ref.blob_id: ref for ref in self.holdings.held.values() if down.keeps(ref)}
        for blob_id in refs:
            del self.holdings.held[blob_id]
        self.holdings.handed.forget_store(node_id)
        refs.update((ref.blob_id, ref) for delete in down.deletes if delete.reason != LOST for ref in delete.refs)
        # A claim the store may have granted before it died is lost with it too: whether it was granted or not,
        # the blob is gone, and a loss that did not name it would leave it held by this node in the stream.
        refs.update((ref.blob_id, ref) for ref in down.unsure)
        # Should the same store come back, what was declared lost is deleted there, reason ``lost``. A delete
        # sent before it went down may have been carried out: its refs go under its request id (answered from the
        # store's reply cache if it was), the rest in one new request. Deletes of blobs declared lost before
        # (the store was back, then went down again) are not lost twice.
        sent = [replace(delete, reason=LOST, node=node_id) for delete in down.deletes if delete.request_id]
        in_sent = {ref.blob_id for delete in sent for ref in delete.refs}
        again = [ref for delete in down.deletes if delete.reason == LOST and not delete.request_id
                 for ref in delete.refs]
        rest = tuple(ref for ref in (*refs.values(), *again) if ref.blob_id not in in_sent)
        self.lost_stores[node_id] = (down.incarnation, (*sent, *([DeleteBlobs(rest, LOST, node_id)] if rest else [])))
        lost_samples = 0
        queue = []
        for group in self.sink.queue:
            kept = [s for s in group if not on_store(s)]
            lost_samples += len(group) - len(kept)
            if kept:
                queue.append(kept)
            else:
                self.sink.dropped_groups += 1
        self.sink.queue = queue
        for group in self.groups.values():
            for index, (reward, samples) in enumerate(group.episodes):
                kept = [s for s in samples if not on_store(s)]
                lost_samples += len(samples) - len(kept)
                group.episodes[index] = (reward, kept)
        if lost_samples:
            self.sink.dropped[LOST] += lost_samples
        self.lost[node_id] += len(refs)
        log.error("blobs.lost", node=node_id, blobs=len(refs), samples=lost_samples,
                  grace_s=self.deadlines.restart_grace_s)
        return LoseBlobs(tuple(refs.values()), node_id)

    # --- restart -------------------------------------------------------------------------------------

    def resume_step(self, now: float, trainers: Iterable[NodeInfo]) -> bool:
        """Take the step number from the trainer ranks' registry entries, once, before this incarnation
        ships anything: the highest of each rank's ``step`` (the next it trains) and ``received + 1`` (after
        the last step batch it accepted). The steps before it count as admitted groups (their slots are
        the ones the earlier incarnation used). A rank that needs an earlier step (the earlier incarnation died
        delivering it: some ranks took their batches, this one never got its own) is sent an empty batch for
        each step it lacks (a fill: every rank skips that step, the ranks that hold batches for it delete them
        as dropped), since a batch packed now could not match the micro batch count its peers hold, and without
        one the world waits for it for ever. Nothing is decided before ``statuses_fresh_at``: a rank's status is
        its last heartbeat's, and one sent before it took a batch the earlier incarnation delivered just before it
        died says the rank lacks that step. Returns whether the step is decided: before that time, fewer than
        ``settings.trainers`` ranks, or a rank whose heartbeat has not yet said its ``step``, decide nothing
        (a missing one may hold a later step; a world restored from a checkpoint registers before its first
        heartbeat says which step it resumes at, and step 0 sent to it would be refused ``duplicate-step``
        at every redelivery)."""
        nodes = list(trainers)
        if self.step_resumed or self.step or self.delivery is not None:
            return True
        if (now < self.statuses_fresh_at or len(nodes) < self.settings.trainers
                or any("step" not in node.status for node in nodes)):
            return False
        needs = {TrainerAddress.from_node(node): max(int(node.status["step"]), int(node.status.get("received", -1)) + 1)
                 for node in nodes}
        start = max(needs.values())
        self.step_resumed = True
        if start:
            self.resumed = True
            self.step = start
            self.train_groups_sent += start * self.settings.groups_per_step
            self._groups_of_step.resumed(start, self.settings.groups_per_step)  # a world may resume before it
            self._fills = {step: [rank for rank, need in needs.items() if need <= step]
                           for step in range(min(needs.values()), start)}
            log.warning("orchestrator.resumed", step=start, max_steps=self.max_steps,
                        ranks={node.labels.get("rank", node.node_id): dict(node.status) for node in nodes},
                        fills={step: [rank.rank for rank in ranks] for step, ranks in self._fills.items()})
        return True

    def reclaimable(self, entry: HeldEpisode) -> list[BlobRef]:
        """The refs of a store's ``held`` entry to claim (again): those it lists as held by this node id or
        unclaimed; the others are another holder's (a trainer rank's) and stay untouched."""
        mine = {*entry.held, *entry.unclaimed}
        return [ref for ref in entry.episode.refs if ref.blob_id in mine]

    def recover(self, now: float, episode: EpisodeFinished, claimed: Collection[BlobRef]) -> list[Action]:
        """An episode found on its store at start (held by an earlier incarnation, or unclaimed), with the
        refs now claimed: fed as if it had just finished; its own ``episode-finished``, if it still comes,
        is ignored."""
        if episode.episode_id in self._recovered:
            return []
        self.resumed = True
        actions = self.on_episode(now, episode, claimed)
        self._recovered.add(episode.episode_id)
        self.recovered_episodes += 1
        return actions

    # --- groups --------------------------------------------------------------------------------------

    def abandon(self, now: float, group_id: str) -> None:
        """A group that will never complete (timed out, one of its runs failed, a malformed episode): delete
        what arrived; its stragglers are deleted as ``late`` when they come."""
        if group_id in self.closed_groups:
            return
        self._admitted.pop(group_id, None)
        self.abandoned_groups += 1
        for member in range(self.settings.group_size):  # answered runs whose episodes will not be counted now
            if (episode_id := f"{group_id}-{member}") not in self.runs:
                self.router.release(episode_id)
                self._answered.pop(episode_id, None)
        group = self.groups.pop(group_id, None)
        self.closed_groups[group_id] = (now, frozenset(group.members) if group is not None else frozenset())
        if group is not None:
            self.sink.drop((s for _, samples in group.episodes for s in samples), "incomplete")

    def _parse(self, episode: EpisodeFinished) -> tuple[float, list[_Entry]]:
        """The episode's reward and its samples' inputs, checked so that nothing later can fail on them: a
        finite number as ``reward`` (0 when absent), ``samples`` a list of maps, each with ``input_ids`` (1-D
        integers from 0 to 2**63 - 1, at least one), a ``loss_mask`` of the same length (absent: every token is
        trained), and ``ref`` (an int: the index of one of ``episode.refs``, negative for none) whose blob holds
        at least the sample's tokens and whose fields and routing shape packing accepts. Raises
        :class:`MalformedEpisode` naming what is wrong."""
        info = episode.info
        try:
            reward = reward_of(info.get("reward", 0.0))
        except MalformedEpisode as error:
            raise MalformedEpisode(f"reward: {error}") from None
        listed = info.get("samples", [])
        if not isinstance(listed, list):
            raise MalformedEpisode(f"samples: expected a list, got {type(listed).__name__}")
        entries = []
        for index, entry in enumerate(listed):
            where = f"samples[{index}]"
            if not isinstance(entry, Mapping):
                raise MalformedEpisode(f"{where}: expected a map, got {type(entry).__name__}")
            input_ids = token_ids(f"{where}.input_ids", entry.get("input_ids", []))
            inputs: dict[str, Any] = {"input_ids": input_ids}
            loss_mask = column(f"{where}.loss_mask", entry["loss_mask"], "biuf") if "loss_mask" in entry else None
            if loss_mask is None:  # every token is the policy's: trained whole, never left out of its micro batch
                inputs["loss_mask"] = np.ones(len(input_ids), np.bool_)
            elif len(loss_mask) != len(input_ids):
                raise MalformedEpisode(f"{where}.loss_mask: {len(loss_mask)} values for {len(input_ids)} token ids")
            else:
                inputs["loss_mask"] = loss_mask.astype(np.bool_)
            ref_index = entry.get("ref", -1)
            if isinstance(ref_index, bool) or not isinstance(ref_index, Integral) or ref_index >= len(episode.refs):
                raise MalformedEpisode(f"{where}.ref: expected the index of one of the episode's "
                                       f"{len(episode.refs)} refs (negative: none), got {ref_index!r}")
            ref = episode.refs[ref_index] if ref_index >= 0 else None
            sample_id = f"{episode.episode_id}/{index}"
            if ref is not None:
                if ref.tokens < len(input_ids):
                    raise MalformedEpisode(f"{where}: {len(input_ids)} tokens, its blob {ref.blob_id!r} holds "
                                           f"{ref.tokens}")
                try:
                    sample_info(Sample(sample_id, len(input_ids), ref))
                except PackingError as error:
                    raise MalformedEpisode(f"{where}: {error}") from None
            entries.append(_Entry(sample_id, ref, inputs))
        return reward, entries

    def _samples(self, episode: EpisodeFinished, entries: Sequence[_Entry], claimed: set[str]) -> list[Sample]:
        """The episode's trainable samples; a sample whose blob could not be claimed is counted and left
        out (training it without its arrays would be training on something it did not do)."""
        samples = []
        for entry in entries:
            if entry.ref is not None and entry.ref.blob_id not in claimed:
                self.sink.dropped["missing"] += 1
                continue
            samples.append(Sample(entry.sample_id, len(entry.inputs["input_ids"]), entry.ref,
                                  episode.policy_version, entry.inputs))
        return samples

    @property
    def episode_wait_s(self) -> float:
        """How long after a run's ok answer its episode may take to be fed: its store publishes the event before it
        answers, and the event waits at most the stores' restart grace for its claims (a durable store restarting),
        so as long as an incomplete group is kept past its first episode (``group_timeout_s``) plus that grace."""
        return self.settings.group_timeout_s + self.deadlines.restart_grace_s

    def _episodes_not_come(self, now: float) -> None:
        """Answered runs whose episode was not fed within :attr:`episode_wait_s`: its event was lost (its store
        killed between its answer and the event, a broker restart). The room reserved for it is given back and its
        group, if this incarnation still waits for it (open, or sent with no episode fed yet), is abandoned: a group
        none of whose episodes came is in no timer else, and would hold its admission slot and its runs' room for
        good, stalling dispatch once the stores' room or the bound is used up."""
        horizon = now - self.episode_wait_s
        answered = self._answered  # in answering order: the oldest first
        while answered and (oldest := next(iter(answered.items())))[1][1] <= horizon:
            episode_id, (group_id, _) = oldest
            del answered[episode_id]
            log.warning("run.episode_not_come", episode_id=episode_id, group=group_id, waited_s=self.episode_wait_s)
            self.router.release(episode_id)
            if group_id in self.groups or group_id in self._admitted:
                self.abandon(now, group_id)

    @property
    def closed_horizon_s(self) -> float:
        """How long a closed group is remembered (its stragglers deleted ``late``). A straggler is fed within
        about its run's deadline (``run_s``: the env server answers by then) plus the stores' restart grace (a
        claim waits that long for a durable store restarting) after its group was sent, and a group closes at
        the latest ``group_timeout_s`` after its first episode: the sum of the three, doubled for what delays
        an event beyond them (a slow score function, a gap fill). A straggler later still opens a new group,
        which never completes: it is deleted ``incomplete`` when that one times out."""
        d = self.deadlines
        return 2 * (d.run_s + d.restart_grace_s + self.settings.group_timeout_s)

    def _forget_closed(self, now: float) -> None:
        """Drop the closed groups older than :attr:`closed_horizon_s` (oldest first: the map is in closing
        order)."""
        horizon = now - self.closed_horizon_s
        closed = self.closed_groups
        while closed:
            group_id = next(iter(closed))
            if closed[group_id][0] > horizon:
                break
            del closed[group_id]

    def _complete(self, now: float, group_id: str) -> None:
        group = self.groups.pop(group_id)
        self.closed_groups[group_id] = (now, frozenset(group.members))
        prompt = self._admitted.pop(group_id, None)
        rewards = np.array([reward for reward, _ in group.episodes], dtype=np.float64)
        if prompt is not None and self.prompts is not None:
            self.prompts.observe(prompt, rewards.tolist())
        advantages = group_advantages(rewards)
        samples, per_sample = [], []
        for advantage, (_, episode_samples) in zip(advantages, group.episodes, strict=True):
            samples.extend(episode_samples)
            per_sample.extend([float(advantage)] * len(episode_samples))
        if not np.isfinite(advantages).all():  # finite rewards too large to normalise: never ship a NaN
            log.warning("group.malformed", group=group_id, rewards=rewards.tolist(), error="advantages not finite")
            self.sink.drop(samples, MALFORMED)
            self.sink.dropped_groups += 1
            return
        self.sink.add_group(samples, per_sample)

    # --- steps ---------------------------------------------------------------------------------------

    def _ship_ready(self, now: float) -> list[Action]:
        per_step = self.settings.groups_per_step
        sink = self.sink
        actions: list[Action] = []
        if (self.delivery is None and self._fills and not self.failure and self.world_down is None
                and len(sink.trainers) >= self.settings.trainers):
            step = min(self._fills)
            fills = {rank.endpoint: StepBatch(step=step, rank=rank.rank, micro_batches=[], owned=[],
                                              policy_version=self.policy_version)
                     for rank in self._fills.pop(step)}
            log.warning("step.filled", step=step, ranks=sorted(batch.rank for batch in fills.values()),
                        detail="an earlier incarnation delivered this step to the other ranks only: every rank "
                               "skips it")
            self.delivery = _Delivery(step, fills, now + self.deadlines.delivery_s, in_flight=set(fills))
            actions += [DeliverBatch(step, endpoint, batch) for endpoint, batch in fills.items()]
        while (self.delivery is None and not self.failure and not self.finished and self.world_down is None
               and len(sink.queue) >= per_step and len(sink.trainers) >= self.settings.trainers):
            queued, dropped = len(sink.queue), sink.dropped_groups
            shipment = sink.ship(self.step, self.policy_version, max_groups=per_step)
            if shipment is None:
                continue
            self._groups_of_step.shipped(self.step, queued - len(sink.queue) - (sink.dropped_groups - dropped))
            log.info("step.shipped", step=self.step, version=self.policy_version,
                     micro_batches=shipment.plan.micro_batches_per_rank, dummies=shipment.plan.dummy_count)
            self.delivery = _Delivery(self.step, shipment.batches, now + self.deadlines.delivery_s,
                                      in_flight=set(shipment.batches))
            actions += [DeliverBatch(self.step, endpoint, batch) for endpoint, batch in shipment.batches.items()]
            self.step += 1
        if self.finished and sink.queue:
            queued, sink.queue = sink.queue, []
            sink.drop((s for group in queued for s in group), "max_steps")
        return self._flush(actions)

    def _check_delivery(self, now: float) -> list[Action]:
        delivery = self.delivery
        if delivery is None:
            return []
        if now >= delivery.deadline:
            ranks = sorted(delivery.batches[endpoint].rank for endpoint in delivery.unacknowledged)
            errors = "; ".join(f"rank {delivery.batches[ep].rank} ({ep}): {delivery.errors.get(ep, 'no answer')}"
                               for ep in delivery.unacknowledged)
            self.failure = (f"step {delivery.step} was not acknowledged by trainer ranks {ranks} within "
                            f"{self.deadlines.delivery_s:g}s: {errors}")
            self.delivery = None
            log.error("step.undeliverable", step=delivery.step, ranks=ranks, error=self.failure)
            return self._flush([Halt(self.failure, final=False)])
        due = sorted(endpoint for endpoint, at in delivery.retry_at.items() if at <= now)
        for endpoint in due:
            del delivery.retry_at[endpoint]
            delivery.in_flight.add(endpoint)
            self.redeliveries += 1
        return [DeliverBatch(delivery.step, endpoint, delivery.batches[endpoint]) for endpoint in due]

    # --- runs ----------------------------------------------------------------------------------------

    def use_replicas(self, nodes: Iterable[NodeInfo]) -> None:
        """The env servers from the registry (runs go to their ``blobs`` endpoints)."""
        self.router.update(nodes)

    def idle_reason(self, now: float) -> tuple[str, str]:
        """Why :meth:`dispatch` sends nothing now while no run is in flight: ``(kind, detail)``, or ``("", "")``
        when it would send or runs are in flight. What an operator asks of an orchestrator that sends nothing.
        A pure read of the state."""
        if self.runs:
            return "", ""
        if (stopped := self._stopped(now))[0]:
            return stopped
        if self._short_since is not None:
            return "budget-short", (f"the {len(self._short_since[0])} env servers seen cannot hold one step: halting "
                                    f"in {self._short_since[1] + self.deadlines.restart_grace_s - now:.1f}s unless "
                                    "another registers")
        bound = self.admission_bound
        if (admitted := self.slots_held) >= bound:
            return "admission", (f"{admitted} groups admitted and not released (sent {self.train_groups_sent}, "
                                 f"released {self.groups_released}, open and not sent here "
                                 f"{self.train_groups_sent - self.groups_released - admitted}) reach the bound "
                                 f"{bound} of policy version {self.policy_version} (max_staleness "
                                 f"{self.settings.max_staleness}, groups_per_step {self.settings.groups_per_step})")
        if self.stores_full:
            return "stores-full", (f"no source has room for a group of {self.settings.group_size} under its stores' "
                                   f"high-water marks or budgets: {self.router.blocked()}")
        return "", ""

    @property
    def slots_held(self) -> int:
        """Groups admission counts against :attr:`admission_bound`: those admitted and not released, less the
        open groups this incarnation did not send. Such a group (an earlier incarnation's, whose episodes a
        restart recovered or a restarted store announced ``again``; any peer's) may never complete: its other
        runs died with the processes of a relaunched cluster. Held open, it would hold a slot until
        ``group_timeout_s``, and enough of them (a relaunch re-adopts dozens) would fill the bound while nothing
        can ship, so nothing trains and the bound never widens. Once it closes it counts as any other: completed,
        it will train (so the count may pass the bound by the groups completed that way, until steps ship);
        abandoned or dropped, it gives back the slot its opening took."""
        unsent_open = sum(group.unsent for group in self.groups.values())
        return self.train_groups_sent - self.groups_released - unsent_open

    @property
    def admission_bound(self) -> int:
        """Groups that may be trained, queued or running at the current policy version (see the module doc)."""
        return (self.settings.max_staleness + self.policy_version + 1) * self.settings.groups_per_step

    def _stopped(self, now: float) -> tuple[str, str]:
        """Why :meth:`dispatch` sends nothing now whatever admission allows: ``(kind, detail)``, or ``("", "")``."""
        if self.finished:
            return "finished", f"the step budget is shipped (max_steps {self.max_steps})"
        if self.failure:
            return "halted", self.failure
        if not self.router.replicas:
            return "no-env-servers", "no env server is known from the registry"
        if not self.version_known:
            return "no-version", "no committed policy version is known yet (version-bump or the ps-manager's entry)"
        if now < self._resume_at:
            return "backing-off", f"runs were refused not-ready; trying again in {self._resume_at - now:.1f}s"
        return "", ""

    def dispatch(self, now: float) -> list[Action]:
        """The runs admission allows now (see the module doc); needs ``prompts``. Every ``eval_every`` steps
        one eval group goes first."""
        short_since, self._short_since = self._short_since, None  # still short: _starved says so again
        if self._stopped(now)[0]:
            return []
        settings = self.settings
        actions: list[Action] = []
        if settings.eval_every and self.step % settings.eval_every == 0 and self.step != self.eval_sent_at:
            self.eval_sent_at = self.step
            actions += self._send_group(now, evaluation=True)
        bound = self.admission_bound
        # Probing (runs refused not-ready, or no episode's charge known yet to reserve room by): one group at a time.
        in_flight = 1 if self._backoff_s or not self.router.measured else settings.max_groups_in_flight
        while len(self.groups_running) < in_flight and self.slots_held < bound:
            if not self._has_room():
                if not self.runs:
                    actions += self._starved(now, short_since)
                break
            actions += self._send_group(now, evaluation=False)
        return actions

    def _starved(self, now: float, short_since: tuple[frozenset[str], float] | None) -> list[Action]:
        """No source has room for a group under its stores' high-water marks and nothing is in flight, so
        nothing this node waits for will drain a store before a step ships, and the step needs more groups: one
        group goes where its runs can reserve room under the stores' budgets. None can: the holders (trainer
        ranks) free room as they train, unless the budgets of every store seen cannot hold one step's episodes
        in whole groups at one source each, which no admission could ever ship: halt, once that has lasted
        ``restart_grace_s`` with the same stores seen (``short_since``: since when, as the last dispatch found),
        the time a store that registers late (a slow host's env server) has to be counted."""
        settings, router = self.settings, self.router
        if router.with_room(settings.group_size, hard=True):
            if not self.starved:
                log.warning("dispatch.stores_full_without_runs", stores=sorted(router.replicas),
                            hint="the env servers' budgets together (to their high-water marks) should hold two "
                                 "steps' episodes, the one in training and the next: raise env_server.budget_bytes "
                                 "or lower orchestrator.groups_per_step")
            self.starved += 1
            return self._send_group(now, evaluation=False, hard=True)
        capacity, needed = router.capacity(settings.group_size), settings.groups_per_step * settings.group_size
        if capacity is None or capacity >= needed:
            return []
        seen = frozenset(router.stores_seen)
        if short_since is None or short_since[0] != seen:
            short_since = (seen, now)
            log.warning("dispatch.budget_short", capacity=capacity, needed=needed, stores=len(seen),
                        halt_in_s=self.deadlines.restart_grace_s,
                        detail="the env servers seen cannot hold one step: halting unless another registers")
        if now - short_since[1] < self.deadlines.restart_grace_s:
            self._short_since = short_since
            return []
        stores, sources = len(router.stores_seen), len({source for source, _ in router.stores_seen.values()})
        fit = capacity // settings.group_size
        self.failure = (
            f"the env servers' budgets hold {capacity} episodes in whole groups of {settings.group_size} at one "
            f"source each ({stores} stores, {sources} sources, an episode charged {router.episode_bytes:.0f} bytes "
            f"on average), one step needs {needed} (groups_per_step {settings.groups_per_step} x group_size "
            f"{settings.group_size}): no step can ever ship. Raise env_server.budget_bytes to at least "
            f"{router.budget_for(settings.groups_per_step, settings.group_size)}"
            + (f" or lower orchestrator.groups_per_step to at most {fit}" if fit else ""))
        log.error("dispatch.budget_below_step", capacity=capacity, needed=needed, error=self.failure)
        return self._flush([Halt(self.failure)])

    def _has_room(self) -> bool:
        """Backpressure: whether some store is below its high-water mark; a change is logged once."""
        room = bool(self.router.with_room(self.settings.group_size))
        if room == self.stores_full:
            self.stores_full = not room
            if room:
                log.info("dispatch.stores_drained", paused=self.full_pauses)
            else:
                self.full_pauses += 1
                log.info("dispatch.stores_full", stores=self.router.without_room())
        return room

    def on_run_done(self, now: float, episode_id: str, error: str | None, code: str = "") -> list[Action]:
        """A run was answered: ``error`` None for ok, else with the refusal's ``code`` when the env server
        gave one. An outcome after the run's deadline is ignored."""
        run = self.runs.get(episode_id)
        if run is not None and error is not None and code in NOT_READY:
            self._refused(now, run, code, error)
            self._run_done(now, episode_id, error, quiet=True)
        else:
            if run is not None and error is None and self._backoff_s:
                log.info("dispatch.resumed", after_refused=self.refused_runs)
                self._backoff_s = 0.0
            self._run_done(now, episode_id, error)
        return self._flush([])

    def _refused(self, now: float, run: _RunInFlight, code: str, error: str) -> None:
        """A not-ready refusal: the first one of runs sent since the last pause starts a longer pause."""
        self.refused_runs += 1
        self._refused_unlogged += 1
        if run.sequence < self._paused_after:
            return  # sent before the current pause: that pause already answers it
        self._backoff_s = min(BACKOFF_MAX_S, 2 * self._backoff_s or BACKOFF_FIRST_S)
        self._paused_after = self._runs_sent
        self._resume_at = now + self._backoff_s
        log.warning("dispatch.waiting", code=code, error=error, retry_in_s=self._backoff_s,
                    refused=self._refused_unlogged)
        self._refused_unlogged = 0

    def _send_group(self, now: float, *, evaluation: bool, hard: bool = False) -> list[Action]:
        """One group's runs, each reserving room (``hard``: under the stores' budgets, not their high-water
        marks) at its source's replicas."""
        assert self.prompts is not None, "dispatching needs prompts"
        group_id = f"{'eval' if evaluation else 'g'}{self.groups_sent}{self.tag}"
        self.groups_sent += 1
        prompt = [int(t) for t in self.prompts.make_prompt(self.rng)]
        if not evaluation:
            self._admitted[group_id] = tuple(prompt)
        self.train_groups_sent += not evaluation
        # An eval group goes even when every store is full.
        sources = self.router.with_room(self.settings.group_size, hard=hard) or sorted(self.router.replicas)
        source = sources[self.groups_sent % len(sources)]  # sources in turn; replicas of one by load
        actions: list[Action] = []
        for member in range(self.settings.group_size):
            run = Run(episode_id=f"{group_id}-{member}", group=group_id, prompt=prompt, eval=evaluation)
            endpoint = self.router.pick(source, run.episode_id, hard=hard)
            self.runs[run.episode_id] = _RunInFlight(group_id, endpoint, now + self.deadlines.run_s, self._runs_sent,
                                                     evaluation)
            self._runs_sent += 1
            self.groups_running[group_id] += 1
            actions.append(SendRun(endpoint, run, self.deadlines.run_s))
        return actions

    def _run_done(self, now: float, episode_id: str, error: str | None, *, quiet: bool = False) -> None:
        run = self.runs.pop(episode_id, None)
        if run is None:
            return
        self.router.done(run.endpoint)
        self.groups_running[run.group_id] -= 1
        if self.groups_running[run.group_id] <= 0:
            del self.groups_running[run.group_id]
        if error is None:
            if episode_id in self.router.reserved:  # its episode is on its way (not fed before the answer came)
                self._answered[episode_id] = (run.group_id, now)
        else:
            self.router.release(episode_id)  # it kept nothing
            self.failed_runs += 1
            if not quiet:
                log.warning("run.failed", group=run.group_id, episode_id=episode_id, error=error)
            if not run.evaluation:  # an eval group's episodes are scored one by one: nothing to give up
                self.abandon(now, run.group_id)

    # --- shutdown ------------------------------------------------------------------------------------

    def close(self) -> list[Action]:
        """Shutdown: delete what is queued, still grouped, or held for any other reason (a step batch that
        no trainer acknowledged); what is held on stores that are down now is lost."""
        for group in self.groups.values():
            self.sink.drop((s for _, samples in group.episodes for s in samples), "shutdown")
        self.groups.clear()
        self.sink.close()
        self.holdings.delete(list(self.holdings.held.values()), "shutdown")
        deletes = self._flush([])
        return [*deletes, *(self._lose(node_id) for node_id in list(self.stores_down))]

    def _flush(self, actions: list[Action]) -> list[Action]:
        """Deletes decided so far first (those for stores that are down wait for them), then ``actions``."""
        decided = [DeleteBlobs(tuple(refs), reason) for refs, reason in self.holdings.take_outbox()]
        return [*self._defer(decided), *actions]

    def _defer(self, deletes: list[DeleteBlobs]) -> list[DeleteBlobs]:
        """Park the refs of ``deletes`` whose store is down with that store; returns the rest. A delete parked
        whole with one store keeps its ``request_id``: a request went to one store."""
        if not self.stores_down:
            return deletes
        now: list[DeleteBlobs] = []
        for delete in deletes:
            live = []
            parked: dict[int, tuple[_StoreDown, list[BlobRef]]] = {}
            for ref in delete.refs:
                down = self._store_of(ref)
                if down is None:
                    live.append(ref)
                else:
                    parked.setdefault(id(down), (down, []))[1].append(ref)
            whole = not live and len(parked) == 1
            for down, mine in parked.values():
                down.deletes.append(replace(delete, refs=tuple(mine), request_id=delete.request_id if whole else ""))
            if live:
                now.append(replace(delete, refs=tuple(live), request_id=""))
        return now
