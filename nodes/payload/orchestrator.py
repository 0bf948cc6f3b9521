"""`refbus node orchestrator`: turns finished episodes into trainer steps, holding references only.

Episodes arrive as ``episode-finished`` events (published by env servers when they keep an episode). The
orchestrator claims their blobs at once (so their hand-over lease does not run out; a claim that fails on
a durable store is sent again until its restarted process grants it, within ``node.restart_grace_s``, and past it
for one retry schedule while that store is back or still awaited, while later events wait their turn), at the
stores the registry lists only: a reference naming a node that is no env server the registry lists (after one
lookup) is not claimed, counted ``missing`` and logged (``claim.unregistered_store``), so no endpoint a peer
invents costs a socket. A restarted durable store's repeat of an episode's event (``again``: its first process may
have died before the event left) is claimed like any episode unless this node has it already (its blobs held here,
or its first event waiting its turn, whose claim goes on while the store is back): then it is ignored, nothing
claimed. It groups episodes, computes advantages, and ships steps to the trainer ranks it finds in the broker's
registry. Every drop point deletes at that moment, with its reason:

================ ====================================================================================
reason           when
================ ====================================================================================
``filtered``     a complete group whose advantages are all zero (nothing to learn)
``stale``        a queued sample more than ``max_staleness`` versions behind the weights that train its step
                 (version K trains step K) when the step is packed, or of a version above them (one a
                 restarted trainer world retired: above the step it resumed from)
``eval``         every eval episode (scored, never trained)
``incomplete``   a group still incomplete after ``group_timeout_s``, or whose answered runs' episodes did not
                 come within ``group_timeout_s`` plus ``node.restart_grace_s`` of their answers (events lost)
``late``         an episode of a group that was already completed or dropped (a repeat of one it had is ignored)
``max_steps``    anything arriving after the last step was shipped
``missing``      (counted, nothing to delete) a sample whose blob was gone before it could be claimed
``unreferenced`` a claimed blob no sample of its episode's record points to (more branches than samples, a
                 record without samples): deleted at once, counted, logged (``episode.unreferenced``)
``malformed``    an episode whose record fails the checks (:mod:`.records`: reward, samples, refs), deleted
                 whole, its group abandoned; a group whose samples make a step's packing fail (a repeated sample id)
``trainer-down`` a step batch a rank of a world that went down refused, or whose outcome was still unknown once
                 the stores reclaimed that world's blobs (see below)
``claim-failed`` a blob whose claim went unanswered (or was answered with an error) while its store was live,
                 or whose store went down before answering and came back as the same store, that a second
                 claim found granted after all: its episode went on without it (counted ``missing``)
``lost``         the env server keeping the blob went down and was not back within
                 ``node.restart_grace_s``: published as a ``delete`` event with reason ``lost`` and ``node``
                 the env server's node id; its samples are never shipped. Nothing to delete, unless that
                 same process comes back (it was cut off): then the blobs are deleted there, reason ``lost``
``shutdown``     what is still queued or grouped when the node stops
================ ====================================================================================

The episode record (``EpisodeFinished.info``), set by whoever keeps the episode:

* ``group`` (str, default: the episode id): episodes of one prompt; ``reward`` (float); ``eval`` (bool);
* ``samples``: one entry per trainable sequence: ``{"input_ids": [int], "loss_mask": [0|1], "ref": i}``
  where ``ref`` indexes ``refs`` (``-1``: a sample that kept no arrays) and ``loss_mask`` marks the tokens to
  train (absent: all of them). Lists, not arrays: the
  orchestrator must never receive an array frame.

The current policy version comes from ``version-bump`` events (the parameter server's commits: only those of a
node the registry lists as the ps-manager count, any other's is refused, logged ``version.refused``); a
dispatching orchestrator that starts after a commit learns it from the ps-manager's registry entry, and
runs nothing before a version exists. After a refused bump it reads that entry again (the ps-manager's own
bump is refused when the registry lookup goes unanswered, or while the manager is reported down after a stall:
its version would otherwise lag until its next bump, which a run at ``max_staleness`` 0 waits for in vain).
With ``max_steps`` 0 it ships the step budget the trainer ranks advertise (``refbus node trainer`` advertises
``trainer.steps``), so it stops once they trained theirs.

Every decision (grouping, shipping, re-delivery, admission, run and group deadlines) is
:class:`~.orchestrator_core.OrchestratorCore`'s; this module executes its actions with ``runtime.calls``
and feeds the outcomes back. An ``incomplete`` group also comes from a run that failed or went unanswered
past its deadline. It tracks peers (``runtime.track_peers()``): an env server reported down fails its runs
in flight at once (their groups are abandoned, new runs go to live replicas), and deletes for it wait for it
to come back or for its blobs to be lost. A step the trainer ranks do not all acknowledge by
``trainer.batch_timeout_s`` halts the node (``step.undeliverable``). A trainer rank reported
down ends its world: the orchestrator stops shipping and waits for a new world (restarted from its
checkpoints), then continues from the step its ranks report; no new world within ``node.restart_grace_s``
plus four ``node.connect_timeout_s`` halts it, naming the ranks. What a rank of the dead world refused is
deleted with reason ``trainer-down``; a batch whose outcome was unknown (in flight, or unanswered: the rank
may have taken it) is its rank's once acknowledged or once its ``reference`` event comes (a rank publishes it
before it answers; the orchestrator follows those events for this: only from an end of the hand-over, the rank
it names or this node, and only for the batch shipped to that rank; one from any other node is refused, logged
``reference.refused`` with its publisher, counted in ``refbus_bus_events_rejected_total`` under code
``third-party-hand-over``, and settles nothing), and deleted ``trainer-down`` when
refused, or when neither came by the time the stores have reclaimed the old world's blobs. Env servers whose
budgets cannot hold one step's episodes (in whole groups at one source each) halt it too
(``dispatch.budget_below_step``, naming the budget that would): no step could ever ship. So does a step batch
no message can carry. Those two halts exit with status :data:`~..halting.HALTED_STATUS` (4), the last words on
stderr the reason (:func:`~..halting.halt`): a restart would decide the same again, so ``refbus up`` ends the
run naming it and why instead of restarting it as it restarts a crash. The halts on deadlines (no new world in
time, a step its ranks did not acknowledge) exit 1, as a crash, deleting nothing at shutdown: the peers may yet
come (a world its supervisor's growing backoff holds back, ranks slow to start), and a restarted orchestrator
claims back what it held and waits for them again.

A claim that ends without an answer from a live store (none by its deadline, or an error answer) may still be
granted: a store works through a backlog in order. Its blobs are counted ``missing`` and the episode goes on
without them; they are claimed again (a claim repeated by its holder is answered ``already``) to learn what
the store did, and what that grants is deleted (``claim-failed``). A delete is sent again, the same request (a
store answers a repeat from its reply cache, so it never deletes twice), until a live store answers, within
``env_server.generate_timeout_s`` plus the request retry schedule (``Deadlines.busy_store_s``); a store
reported down meanwhile ends it, and the delete waits for the store as above, then goes out under its request
id again (the store may have carried it out before it was reported down: the same process answers from its
reply cache, a restarted one that re-adopted the store answers what its predecessor deleted as done). One that
still fails is logged (``delete.failed``) and given up: the store keeps those blobs as this node's until this
node is gone.

Every start is a possible restart (the same node id after a crash; no flag): before it feeds any event to
the core it rebuilds its state from the authorities, not from the event ring. It takes the step number
from the trainer ranks' registry entries (their ``step`` and ``received`` status), asks every env server
for the episodes whose blobs its node id holds or nobody claimed (``holdings``, paged), claims those blobs
(again: a store keeps what a down holder held for ``node.restart_grace_s`` when its restarted incarnation
claims it back) and feeds the episodes to the core as if they had just finished. Events that arrive
meanwhile wait their turn, and no run goes out (admission counts what comes back); the
``episode-finished`` of an episode already recovered is ignored. A store
that does not answer is logged (``recovery.store_failed``): what this node id held there goes
``holder-down`` after the grace, named by the store; so does what it held past a page whose cursor does
not advance (``more`` with a cursor not past the one asked: that store's recovery ends there, logged
``recovery.cursor_stuck``, instead of asking for the same page for ever); a blob whose claim fails is
counted ``missing``.
Episodes of the earlier incarnation's runs that finish later are grouped like any other (a group that
never completes is deleted ``incomplete``). Limits: a step the earlier incarnation had delivered to some
ranks and not others cannot be completed (its batches are gone with it); the ranks that hold it fail that
step when ``trainer.batch_timeout_s`` ends. A ``reference`` not yet applied by a store when the restarted
incarnation asks would list a blob a rank already took; the restart takes seconds, the event milliseconds.

Hand-overs outlive a store's restart: every ``reference`` it publishes names the rank's process that took the
batch, and it keeps each blob it handed over (:class:`~.shipping.HandedOver`: at most
:data:`~.shipping.HANDED_OVER_KEPT`, the oldest beyond dropped, logged ``handover.forgotten``) until a ``delete``
event names it or its store is lost. A durable store back as a new process re-adopted those blobs as this node's,
having missed the events published while it was dead: once it answers a read, this node publishes them again
(``reference.repeated``), so a rank that died meanwhile (it cannot repeat its own) has them reclaimed as its own,
not listed to a restarted orchestrator. What it keeps dies with this process.
"""

from __future__ import annotations

import argparse
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from ...bus.reqrep import (
    MIN_TIMEOUT_S,
    SEND_ONCE,
    Outcome,
    PeerDown,
    RemoteError,
    RequestTimeout,
    RetryPolicy,
    split_outcomes,
)
from ...bus.runtime import NodeRuntime
from ...bus.stall import PassStalls
from ...protocol.envelope import Message
from ...protocol.errors import MessageTooLarge
from ...protocol.messages import (
    THIRD_PARTY_HAND_OVER,
    BlobRef,
    Claim,
    Claimed,
    Delete,
    Deleted,
    EpisodeFinished,
    Held,
    HoldingsQuery,
    NodeDown,
    NodeInfo,
    Reference,
    VersionBump,
)
from ..config import Config
from ..halting import halt
from ..settings import OrchestratorSettings
from .orchestrator_core import (
    LOST,
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
from .prompts import TASK_PREFIX, load_prompt_source
from .restarts import Sent, StoreRestarts, StoreReturns, durable_store
from .shipping import group_by_endpoint, registry_locator

log = structlog.get_logger(__name__)

STORE_ROLE = "env-server"
MANAGER_ROLE = "ps-manager"  # the only node whose ``version-bump`` moves the policy version

IDLE_LOG_S = 5.0  # how long no run may go out, for one reason, before the reason is logged (dispatch.idle)


def deadlines_from(config: Config) -> Deadlines:
    """The orchestrator's waits, from the settings of the peers it waits for (see :class:`Deadlines`)."""
    policy = config.retry()
    # A new trainer world: the dead one is declared down, restarted (within the grace) and its ranks start
    # (torch import, rendezvous, checkpoint load) and register, each step bounded by the connect timeout.
    return Deadlines(delivery_s=config.trainer.batch_timeout_s, redeliver_after_s=policy.timeout_s,
                     run_s=config.env_server.generate_timeout_s + policy.deadline_s,
                     restart_grace_s=config.node.restart_grace_s,
                     world_restart_s=config.node.restart_grace_s + 4 * config.node.connect_timeout_s,
                     busy_store_s=config.env_server.generate_timeout_s + policy.deadline_s)


@dataclass
class _Arrival:
    """An event waiting its turn: events reach the core in arrival order, an episode once its claims are in.
    ``message`` None: the start-up recovery, ahead of every event, fed once every store answered."""

    message: Message | None
    claims_pending: int = 0
    claimed: list[BlobRef] = field(default_factory=list)
    refused: bool = False  # a ``version-bump`` of a node that is no ps-manager: ignored in its turn


class Orchestrator:
    """The orchestrator role on a :class:`NodeRuntime`: the executor of :class:`OrchestratorCore`'s actions.

    Every request goes out through ``runtime.calls`` (each with a deadline; the loop never waits on one) and
    its outcome is fed back to the core; only the deletes at shutdown, when the loop has stopped, wait
    (bounded by the retry policy). All work runs on the loop thread. ``clock`` is the core's time source.
    """

    def __init__(self, runtime: NodeRuntime, settings: OrchestratorSettings, deadlines: Deadlines | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self.settings = settings
        self.clock = clock
        prompts = load_prompt_source(settings.prompt) if settings.dispatch else None
        if settings.group_size < 2:  # allowed (a dispatch or eval exercise), but a training run would never train
            log.warning("orchestrator.group_of_one", group_size=settings.group_size,
                        detail="a group of one has advantage 0: every training group is filtered and no step ever "
                               "ships; set orchestrator.group_size to 2 or more to train")
        # Runs and groups carry a tag of this incarnation: a restart must not reuse the earlier one's names.
        self.core = OrchestratorCore(settings, deadlines, prompts=prompts, tag=f".{secrets.token_hex(3)}")
        # A rank heartbeats its status once an interval: two after this start, the registry's statuses tell of any
        # step batch an earlier incarnation delivered before it died (resume_step); the step is looked up then.
        self._fresh_in_s = 2 * runtime.heartbeat_interval_s
        self.core.statuses_fresh_at = clock() + self._fresh_in_s
        # No run goes out before that lookup is answered: dispatch before the step is resumed would count none of
        # the earlier incarnation's groups against admission.
        self._step_pending = True
        self.claimed = 0  # blobs newly granted to this node (not those a repeated claim is answered ``already`` for)
        self.missing = 0
        self.deleted: Counter[str] = Counter()
        self.failed_deletes = 0
        self.lost = 0  # references dropped because their store went down for good
        self._halted = ""  # the reason of the first Halt carried out
        self.halt_final = False  # whether that Halt was final (see Halt)
        self._arrivals: deque[_Arrival] = deque()
        self._recovery = _Arrival(None, claims_pending=1)  # done when the start-up recovery is
        self._recovery_begun = False
        self._recovered: list[tuple[EpisodeFinished, list[BlobRef]]] = []
        self._closing = False  # set by the shutdown: nothing more is fed to the core or sent
        self._delivering = 0  # step batches sent and not answered
        self._claiming_again = 0  # ClaimAgain requests sent and not answered
        # Why no run goes out (""): runs go out or are in flight), since when, and whether it was logged.
        self._idle: tuple[str, float, bool] = ("", 0.0, False)
        self._arrivals.append(self._recovery)
        runtime.call_soon(self._recover)  # first thing on the loop, once the subscriptions are live
        self._events = runtime.subscribe(self._on_event, kinds=frozenset({EpisodeFinished.kind, VersionBump.kind,
                                                                          Reference.kind, Delete.kind}))
        self._peers = runtime.track_peers()
        self._version_unsure = False  # a bump was refused since the ps-manager's registry entry was last read
        self._peers.on_down(self._on_node_down)
        self._peers.on_up(self._on_node_up)
        # A durable store that re-adopted its blobs as a new process missed the ``reference`` events published while
        # it was dead, and a rank that died meanwhile cannot repeat its own: this node does (_hand_over_again).
        StoreReturns(self._peers, runtime.calls, lambda node: bool(self.core.holdings.handed.at(node)),
                     self._hand_over_again)
        self._locate = registry_locator(self._peers.endpoint_of)  # a store restarted on another port is found
        # A claim that failed against a durable store is sent again until its restarted process answers: past the
        # grace too, for one retry schedule, while that store is back or still awaited (_store_back).
        self._restarts = StoreRestarts(lambda node: durable_store(self._peers, node), runtime.later,
                                       self.core.deadlines.restart_grace_s, back=self._store_back,
                                       back_s=runtime.calls.policy.deadline_s)
        d = self.core.deadlines
        # Deletes, and claims sent again to learn what an unanswered one did: the same request until a live store
        # answers (a repeat is answered from its reply cache), not only for the default retry schedule.
        self._settle_policy = runtime.calls.policy.lasting(d.busy_store_s)
        # The timer pass's period and stalls (see _tick).
        self.passes = PassStalls(min(1.0, settings.group_timeout_s / 4, d.redeliver_after_s / 2))
        runtime.every(self.passes.period_s, self._tick)
        if settings.dispatch:
            runtime.every(1.0, self._refresh_replicas)
            runtime.every(0.02, self._dispatch)
        runtime.shutdown_hooks.append(self.close)
        runtime.status = self.status
        self._register_metrics()

    @property
    def failure(self) -> str:
        """Why the run halted (the first :class:`~.orchestrator_core.Halt` carried out: the core's, or this
        executor's own, a step batch no message can carry); empty while it goes on."""
        return self._halted

    # --- events, in arrival order --------------------------------------------------------------------

    def _on_event(self, message: Message) -> None:
        if isinstance(message.body, Reference):  # not in turn: it settles a step batch, it claims nothing
            if not self._closing:
                self._on_reference(message.header.src, message.body)
            return
        if isinstance(message.body, Delete):  # not in turn either: gone from their store, nothing to hand over again
            self.core.holdings.handed.gone(message.body.blob_ids)
            return
        arrival = _Arrival(message)
        self._arrivals.append(arrival)
        body = message.body
        if isinstance(body, EpisodeFinished) and body.refs and not self._known_repeat(body):
            self._claim_registered(arrival, body)
        elif isinstance(body, VersionBump):
            self._vouch(arrival, message.header.src)
        self._feed()

    def _known_repeat(self, episode: EpisodeFinished) -> bool:
        """Whether ``episode`` is a restarted store's repeat (``again``) of one this node has: its blobs held
        here, or its first event still waiting its turn. It is fed with nothing claimed (the core ignores it):
        claiming again would only be answered ``already``."""
        if not episode.again:
            return False
        held = self.core.holdings.held
        return any(ref.blob_id in held for ref in episode.refs) or any(
            isinstance(first := arrival.message.body, EpisodeFinished) and first.episode_id == episode.episode_id
            for arrival in self._arrivals if arrival.message is not None and arrival.message.body is not episode)

    def _on_reference(self, src: str, reference: Reference) -> None:
        """A ``reference`` counts only from an end of its hand-over: the rank it names, or this node (the blobs'
        holder: its own repeat on the rank's answer). Any peer may publish one, and a third node's would mark a
        dead world's batch taken, never deleted (held for good at its stores); refused: logged, counted."""
        if src in (reference.holder, self.runtime.node_id):
            self.core.on_reference(reference.step, reference.holder, reference.blob_ids)
            return
        self._events.rejected[THIRD_PARTY_HAND_OVER] += 1
        log.warning("reference.refused", src=src, holder=reference.holder, step=reference.step,
                    blobs=len(reference.blob_ids), detail="a hand-over published by neither the rank it names nor "
                                                          "this node: ignored")

    def _vouch(self, arrival: _Arrival, src: str) -> None:
        """A ``version-bump`` counts only from a node the registry lists as the ps-manager: any peer may publish one,
        and the version sets the admission bound (a forged 50 admits 50 steps' groups more), which queued samples
        are stale against and when the trainer ranks have trained all. One not listed yet is looked up first (its
        ``node-up`` may still be on its way), the bump waiting its turn; one still not listed is refused, logged
        (``version.refused``)."""
        if self._is_manager(src):
            return
        arrival.claims_pending = 1

        def listed(nodes: list[NodeInfo] | None) -> None:
            self._peers.seed(nodes or (), MANAGER_ROLE)
            if not self._is_manager(src):
                arrival.refused = True
                self._version_unsure = True  # the ps-manager's entry is read again at the next refresh
                log.warning("version.refused", src=src, detail="a version-bump of a node the registry does not "
                                                              "list as the ps-manager: ignored")
            arrival.claims_pending = 0
            self._feed()

        self.runtime.lookup_async(MANAGER_ROLE, listed)

    def _is_manager(self, node_id: str) -> bool:
        node = self._peers.live.get(node_id)
        return node is not None and node.role == MANAGER_ROLE

    def _claim_registered(self, arrival: _Arrival, episode: EpisodeFinished) -> None:
        """Claim the episode's blobs at the stores the registry lists (:meth:`_registered`), never at an endpoint a
        reference merely names: any peer may publish ``episode-finished``, and a client kept for every endpoint it
        invents would take this node's file descriptors. A store not listed yet (its ``node-up`` still on its
        way) is looked up first; references to one still not listed are not claimed (logged, counted missing):
        the episode goes on with the rest, as with blobs a store no longer has."""
        refs = episode.refs
        if all(self._registered(ref) for ref in refs):
            self._claim(arrival, {ref.blob_id: ref for ref in refs})
            return
        arrival.claims_pending = 1

        def listed(nodes: list[NodeInfo] | None) -> None:
            self._peers.seed(nodes or (), STORE_ROLE)
            known = {ref.blob_id: ref for ref in refs if self._registered(ref)}
            refused = [ref for ref in refs if ref.blob_id not in known]
            if refused:
                self.missing += len(refused)
                log.warning("claim.unregistered_store", episode_id=episode.episode_id, blobs=len(refused),
                            nodes=sorted({ref.node for ref in refused})[:8],
                            detail="no env server the registry lists keeps them: not claimed")
            if known:
                self._claim(arrival, known)
            else:
                arrival.claims_pending = 0
                self._feed()

        self.runtime.lookup_async(STORE_ROLE, listed)

    def _registered(self, ref: BlobRef) -> bool:
        """Whether ``ref`` names a store the registry lists: a live env server (asked where it is now), or one
        down whose last ``blobs`` endpoint is the recorded one (a request to it fails at once without a socket,
        its endpoint marked down, until the store is back and asked where it is then)."""
        live = self._peers.live.get(ref.node)
        if live is not None:
            return live.role == STORE_ROLE and "blobs" in live.endpoints
        down = self._peers.down.get(ref.node)
        return down is not None and down.role == STORE_ROLE and down.endpoints.get("blobs") == ref.endpoint

    def _claim(self, arrival: _Arrival, refs: Mapping[str, BlobRef]) -> None:
        """Claim an episode's blobs, one request per store. A claim that failed (down, or unanswered) on a
        durable store is sent again, re-located, every 0.1 s until ``node.restart_grace_s`` after the first
        (:class:`StoreRestarts`), and past it for one retry schedule more while the store is back or still awaited
        (:meth:`_store_back`): a restarted process that re-adopted the store grants it (or answers ``already``
        when its predecessor had committed it), so a store killed around an episode's end costs no sample, even
        one whose restarted process registers as the grace ends (its repeat of the episode, ``again``, is
        ignored meanwhile: this claim is the episode's). The episode, and every event after it, waits for the
        outcome."""
        started = time.monotonic()

        def claims(blob_ids: Iterable[str]) -> list[tuple[str, Claim]]:
            return [(endpoint, Claim(blob_ids=[r.blob_id for r in group], holder=self.runtime.node_id))
                    for endpoint, group in group_by_endpoint([refs[i] for i in blob_ids], self._locate).items()]

        def again(sent: list[Sent[Claim]]) -> list[Claim] | None:
            return self._restarts.waiting(sent, lambda blob_id: refs[blob_id].node, time.monotonic() - started)

        waited: list[str] = []  # the stores waited for, logged once

        def relocate(failed: list[Claim]) -> list[tuple[str, Claim]]:
            ids = [i for claim in failed for i in claim.blob_ids]
            if not waited:
                waited.extend(sorted({refs[i].node for i in ids}))
                log.info("claim.waiting", blobs=len(ids), stores=waited, detail="a durable store restarting")
            return claims(ids)

        arrival.claims_pending = 1
        self._restarts.gather(self.runtime.calls, claims(refs), lambda sent: self._on_claimed(arrival, refs, sent),
                              again=again, relocate=relocate, retry_after=True)

    def _store_back(self, node: str) -> bool:
        """Whether store ``node`` is back (live in the registry, at an endpoint not marked down) or still awaited
        (reported down, within its grace): a claim that failed against it may yet be granted there."""
        if node in self.core.stores_down:
            return True
        endpoint = self._peers.endpoint_of(node, "blobs")
        return endpoint is not None and self.runtime.calls.down_reason(endpoint) is None

    def _on_claimed(self, arrival: _Arrival, refs: Mapping[str, BlobRef], sent: list[Sent[Claim]]) -> None:
        replies, failures = split_outcomes(sent)
        for (endpoint, claim), error in failures:
            log.warning("claim.failed", endpoint=endpoint, blobs=len(claim.blob_ids), error=str(error))
            self.missing += len(claim.blob_ids)
            failed = [refs[blob_id] for blob_id in claim.blob_ids if blob_id in refs]
            if isinstance(error, PeerDown):
                self.core.claim_unanswered(failed)
            else:  # a live store may still grant it (a backlog it works through): learn what it did
                self._claim_again(ClaimAgain(tuple(failed)))
        granted: set[str] = set()
        for _, reply in replies:
            claimed = reply.body
            assert isinstance(claimed, Claimed)
            granted.update(claimed.blob_ids)
            self.missing += len(claimed.missing) + len(claimed.reclaimed)
        self._count_granted(granted)
        arrival.claimed = [ref for blob_id, ref in refs.items() if blob_id in granted]
        arrival.claims_pending = 0
        self._feed()

    def _count_granted(self, granted: set[str]) -> None:
        """Count in ``claimed`` the blobs of a claim's answer that are new to this node: a claim repeated by its
        holder is answered ``already`` (a repeated event; a claim sent again after its answer was lost), and what
        this node holds, or an episode waiting its turn (or recovered at start) was granted, was counted then."""
        held = self.core.holdings.held  # looked up per blob: a copy of its keys would cost every claim all it holds
        new = {blob_id for blob_id in granted if blob_id not in held}
        if new and (self._arrivals or self._recovered):
            new -= {ref.blob_id for arrival in self._arrivals for ref in arrival.claimed}
            new -= {ref.blob_id for _, refs in self._recovered for ref in refs}
        self.claimed += len(new)

    def _feed(self) -> None:
        """Hand the core every event whose turn has come (claims answered, earlier events fed)."""
        while not self._closing and self._arrivals and self._arrivals[0].claims_pending == 0:
            arrival = self._arrivals.popleft()
            if arrival.message is None:
                self._feed_recovered()
                continue
            body = arrival.message.body
            if isinstance(body, VersionBump):
                if not arrival.refused:
                    self.core.on_version(body.version)
            elif isinstance(body, EpisodeFinished):
                self._execute(self.core.on_episode(self.clock(), body, arrival.claimed))

    # --- start-up recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild what an earlier incarnation of this node id left: the episodes it held (or nobody claimed) from
        every env server at once (its stores reclaim them when its grace ends), and the step from the trainer
        ranks once their statuses are fresh (:attr:`~.orchestrator_core.OrchestratorCore.statuses_fresh_at`),
        each registry lookup asynchronous. ``claims_pending`` of the recovery arrival counts the requests still
        out, plus one until the stores are known; no run is dispatched until it is 0 and the step lookup is
        answered."""
        self._recovery_begun = True
        self.runtime.lookup_async(STORE_ROLE, self._recover_holdings)
        self.runtime.later(self._fresh_in_s, lambda: self.runtime.lookup_async("trainer", self._recover_step))

    def _recover_step(self, trainers: list[NodeInfo] | None) -> None:
        if trainers:
            self.core.resume_step(self.clock(), trainers)
        self._step_pending = False

    def _recover_holdings(self, stores: list[NodeInfo] | None) -> None:
        if stores is None:
            log.error("recovery.no_registry", detail="what an earlier incarnation held goes holder-down")
        for node in stores or ():
            if endpoint := node.endpoints.get("blobs"):
                self._ask_holdings(endpoint, 0)
        self._recovery_done()

    def _ask_holdings(self, endpoint: str, after: int) -> None:
        self._recovery.claims_pending += 1
        # retry_after: a store with a hand-over to a rank it could not journal yet refuses to list until it has
        self.runtime.calls.request(endpoint, HoldingsQuery(holder=self.runtime.node_id, after=after),
                                   lambda outcome: self._on_held(endpoint, after, outcome), retry_after=True)

    def _on_held(self, endpoint: str, after: int, outcome: Outcome) -> None:
        """One page of a store's ``holdings`` (asked from keep position ``after``): claim what it lists, and ask
        for the next page while there is one. A page whose cursor does not move past ``after`` ends that store's
        recovery (logged): asked again, it would answer the same page for ever, and nothing would ever be
        dispatched."""
        replies, failures = split_outcomes([(endpoint, outcome)])
        for _, error in failures:
            log.error("recovery.store_failed", endpoint=endpoint, node=self._peers.node_of(endpoint),
                      error=str(error), detail="what this node id held there goes holder-down after the grace")
        for _, reply in replies:
            held = reply.body
            assert isinstance(held, Held)
            if held.more and held.cursor <= after:
                log.error("recovery.cursor_stuck", endpoint=endpoint, node=self._peers.node_of(endpoint),
                          after=after, cursor=held.cursor,
                          detail="the store's holdings pages do not advance: its recovery ends here; what this "
                                 "node id held there beyond this page goes holder-down after the grace")
            elif held.more:
                self._ask_holdings(endpoint, held.cursor)
            wanted = [(entry.episode, refs) for entry in held.episodes if (refs := self.core.reclaimable(entry))]
            if wanted:  # one claim per page: the store answers each id
                self._recovery.claims_pending += 1
                claim = Claim(blob_ids=[r.blob_id for _, refs in wanted for r in refs], holder=self.runtime.node_id)
                self.runtime.calls.request(endpoint, claim,
                                           lambda outcome, w=wanted: self._on_reclaimed(endpoint, w, outcome),
                                           retry_after=True)
        self._recovery_done()

    def _on_reclaimed(self, endpoint: str, wanted: Sequence[tuple[EpisodeFinished, list[BlobRef]]],
                      outcome: Outcome) -> None:
        replies, failures = split_outcomes([(endpoint, outcome)])
        blobs = sum(len(refs) for _, refs in wanted)
        for _, error in failures:
            log.warning("recovery.claim_failed", endpoint=endpoint, episodes=len(wanted), blobs=blobs,
                        error=str(error), detail="what this node id held there goes holder-down after the grace")
            self.missing += blobs
        for _, reply in replies:
            answer = reply.body
            assert isinstance(answer, Claimed)
            granted = set(answer.blob_ids)
            self._count_granted(granted)
            self.missing += len(answer.missing)
            for episode, refs in wanted:
                if claimed := [ref for ref in refs if ref.blob_id in granted]:
                    self._recovered.append((episode, claimed))
        self._recovery_done()

    def _recovery_done(self) -> None:
        self._recovery.claims_pending -= 1
        if self._recovery.claims_pending == 0:
            self._feed()

    def _feed_recovered(self) -> None:
        recovered, self._recovered = self._recovered, []
        if recovered:
            log.warning("recovery.episodes", episodes=len(recovered), blobs=sum(len(refs) for _, refs in recovered))
        for episode, claimed in recovered:
            self._execute(self.core.recover(self.clock(), episode, claimed))

    # --- timers --------------------------------------------------------------------------------------

    def _tick(self) -> None:
        """The core's timers. Time this loop did not run (stopped, swapped out, starved of CPU: this pass more than
        a period late) first counts toward none of the core's deadlines (:meth:`OrchestratorCore.credit_stall`);
        logged ``orchestrator.stalled``, counted in ``refbus_orchestrator_stalled_seconds_total``."""
        if stalled := self.passes.stall():
            self.core.credit_stall(stalled)
            log.warning("orchestrator.stalled", seconds=round(stalled, 3), runs=len(self.core.runs),
                        stores_down=len(self.core.stores_down), detail="its deadlines moved as much later")
        self._execute(self.core.tick(self.clock()))
        if self.core.world_down is not None:  # waiting for a new trainer world: is it registered yet?
            self.runtime.lookup_async("trainer", self._found_trainers)

    def _found_trainers(self, nodes: list[NodeInfo] | None) -> None:
        # Still wanted when the registry answers? A lookup joined by both callers is answered once.
        if nodes is None or (self.core.world_down is None and not self.core.wants_trainers):
            return
        # Too few ranks yet decides nothing: the next tick or dispatch asks again, not this answer at once
        # (that would chain lookups back to back while the ranks start).
        if actions := self.core.use_trainers(self.clock(), nodes):
            self._execute(actions)

    def _on_node_down(self, down: NodeDown, info: NodeInfo | None) -> None:
        if info is not None and info.role == STORE_ROLE:
            self._execute(self.core.store_down(self.clock(), info))
        elif info is not None and info.role == "trainer":
            self._execute(self.core.trainer_down(self.clock(), info))

    def _on_node_up(self, info: NodeInfo) -> None:
        if info.role == STORE_ROLE:
            self._execute(self.core.store_up(info))

    def _refresh_replicas(self) -> None:
        self.runtime.lookup_async(STORE_ROLE, self._found_replicas)
        if not self.core.version_known or self._version_unsure:  # started after a bump, or one was refused
            self.runtime.lookup_async(MANAGER_ROLE, self._found_managers)

    def _found_replicas(self, nodes: list[NodeInfo] | None) -> None:
        if nodes is not None:  # None: the broker did not answer, keep what we know
            self.core.use_replicas(nodes)

    def _found_managers(self, managers: list[NodeInfo] | None) -> None:
        for manager in managers or ():
            version = manager.status.get("version", -1.0)
            if math.isfinite(version):
                self.core.on_version(int(version))
                self._version_unsure = False

    def _dispatch(self) -> None:
        now = self.clock()
        if self._recovery.claims_pending or self._step_pending:  # admission counts what the recovery brings back
            self._say_idle(now, "recovering", f"{self._recovery.claims_pending} start-up recovery requests out"
                                              + (", the step not looked up yet" if self._step_pending else ""))
            return
        self._execute(self.core.dispatch(now))
        self._say_idle(now, *self.core.idle_reason(now))

    def _say_idle(self, now: float, kind: str, detail: str) -> None:
        """Log why no run goes out once one reason has held for :data:`IDLE_LOG_S` (an orchestrator that sends
        nothing is the first thing an operator asks about; shorter pauses, such as waiting for the next version
        between steps, are the normal rhythm)."""
        if kind != self._idle[0]:
            self._idle = (kind, now, False)
        elif kind and not self._idle[2] and now - self._idle[1] >= IDLE_LOG_S:
            self._idle = (kind, self._idle[1], True)
            log.info("dispatch.idle", reason=kind, detail=detail, idle_s=round(now - self._idle[1], 1))

    # --- actions -------------------------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, DeleteBlobs):
                self._delete(action)
            elif self._closing and isinstance(action, DeliverBatch | SendRun):
                continue  # what it would have handed out stays held here and is deleted with the rest
            elif isinstance(action, DeliverBatch):
                try:
                    self.runtime.calls.request(
                        action.endpoint, action.batch, lambda outcome, a=action: self._on_delivered(a, outcome))
                except MessageTooLarge as exc:  # no resend can carry it: the run cannot go on as configured
                    self._execute([Halt(f"step {action.step}'s batch for rank {action.batch.rank} cannot be sent "
                                        f"({exc}): fewer micro batches a step, or fewer inline inputs")])
                else:
                    self._delivering += 1
            elif isinstance(action, SendRun):
                # Sent once: a run is answered when its episode ends, and a resent run would run it twice.
                self.runtime.calls.request(
                    action.endpoint, action.run, lambda outcome, a=action: self._on_run_done(a, outcome),
                    deadline_s=action.deadline_s, policy=SEND_ONCE)
            elif isinstance(action, LoseBlobs):
                self._lose(action)
            elif isinstance(action, ClaimAgain):
                self._claim_again(action)
            elif isinstance(action, Halt):
                if not self._halted:
                    self._halted, self.halt_final = action.reason, action.final
                log.error("orchestrator.halted", reason=action.reason)
                self.runtime.stop()
        if self.core.wants_trainers:
            self.runtime.lookup_async("trainer", self._found_trainers)

    def _on_delivered(self, action: DeliverBatch, outcome: Outcome) -> None:
        self._delivering -= 1
        _, failures = split_outcomes([(action.endpoint, outcome)])
        error = str(failures[0][1]) if failures else None
        # A rank refuses a batch before it takes anything of it; an internal error may come after it took it.
        refused = isinstance(outcome, RemoteError) and outcome.code != "internal"
        holds_step = isinstance(outcome, RemoteError) and outcome.code == "duplicate-step"
        self._execute(self.core.on_delivered(self.clock(), action.step, action.endpoint, error, refused=refused,
                                             holds_step=holds_step))
        if error is None and action.batch.owned and (taker := self.core.taker(action.endpoint)) is not None:
            # The rank published this before it answered, but a rank killed right after answering may have
            # answered and lost the event: the stores hand the blobs over on it (a repeat of a move made moves
            # nothing), or they would stay this node's, which no longer knows them, and never be reclaimed with
            # the rank's. It names the rank's process: a store that hears of it once that process is gone
            # reclaims the blobs as the rank's.
            self.runtime.publish(Reference(step=action.step, holder=taker.node_id, blob_ids=list(action.batch.owned),
                                           process=taker.process))

    def _hand_over_again(self, node: str) -> None:
        """Publish again, one ``reference`` per step and rank, naming the rank's process, the hand-overs of blobs on
        store ``node`` that no ``delete`` event reported gone: ``node`` is back as a new process that re-adopted its
        blobs (:class:`~.restarts.StoreReturns`) and missed the events published while it was dead. A rank still
        live repeats its own; one that died meanwhile cannot, and without this its blobs stayed this node's there
        (held until the store's shutdown, listed to a restarted orchestrator to claim back and train again). A
        store takes a hand-over of a blob already the rank's, deleted or reclaimed as nothing, and one to a process
        that is gone as that rank's, reclaimed when its grace ends."""
        if self._closing:
            return
        handed = self.core.holdings.handed.at(node)
        for (step, taker), blob_ids in sorted(handed.items(), key=lambda item: item[0][0]):
            self.runtime.publish(Reference(step=step, holder=taker.node_id, blob_ids=blob_ids, process=taker.process))
        log.info("reference.repeated", store=node, blobs=sum(map(len, handed.values())), batches=len(handed),
                 detail="a restarted store missed the hand-overs published while it was dead")

    def _on_run_done(self, action: SendRun, outcome: Outcome) -> None:
        _, failures = split_outcomes([(action.endpoint, outcome)])
        error = str(failures[0][1]) if failures else None
        code = failures[0][1].code if failures and isinstance(failures[0][1], RemoteError) else ""
        self._execute(self.core.on_run_done(self.clock(), action.run.episode_id, error, code))

    def _delete(self, action: DeleteBlobs) -> None:
        """Delete ``action.refs``, one request per store. Its refs have left the holdings already, so a delete
        that went unanswered must not be dropped: the same request (same id: a store answers a repeat from its
        reply cache, so it never deletes twice) is sent again until a live store answers, within
        ``busy_store_s``; a store reported down meanwhile ends it at once (the delete then waits for the store,
        keeping its request id, see :meth:`_on_deleted`). One that waited so (``action.request_id``) goes out
        whole under that id, to where its store is now: its store may have carried it out already. One answered
        with ``retry_after_s`` (the store could not journal it: nothing changed) is sent again after it, within
        ``busy_store_s`` (``retry_after``), as are every claim of this node."""
        if action.request_id:
            groups = {self._locate(action.refs[0]): list(action.refs)}  # the core parked it with one store
        else:
            groups = group_by_endpoint(action.refs, self._locate)
        for endpoint, refs in groups.items():
            request = Delete(blob_ids=[r.blob_id for r in refs], holder=self.runtime.node_id, reason=action.reason,
                             node=action.node)
            # Chosen here, not by the call: the outcome's handler parks the delete under it.
            msg_id = action.request_id or self.runtime.codec.new_id()
            self.runtime.calls.request(
                endpoint, request,
                lambda outcome, e=endpoint, r=request, rs=refs, i=msg_id: self._on_deleted(e, r, outcome, rs, i),
                policy=self._settle_policy, deadline_s=self.core.deadlines.busy_store_s, msg_id=msg_id,
                retry_after=True)

    def _claim_again(self, action: ClaimAgain, *, fresh: bool = False) -> None:
        """Claim ``action.refs`` again, one request per store, sent again (the same request) until a live store
        answers, within ``busy_store_s``. A claim repeated by its holder is answered ``already``, so the answer
        says what the claim whose outcome was unknown did; what it grants is deleted
        (:meth:`~.orchestrator_core.OrchestratorCore.claimed_late`). A delete in its place would delete a blob
        that was never granted from under its store (the ledger's violation)."""
        for endpoint, refs in group_by_endpoint(action.refs, self._locate).items():
            self._claiming_again += 1
            claim = Claim(blob_ids=[r.blob_id for r in refs], holder=self.runtime.node_id)
            self.runtime.calls.request(
                endpoint, claim, lambda outcome, e=endpoint, rs=refs: self._on_claimed_again(e, rs, outcome, fresh),
                policy=self._settle_policy, deadline_s=self.core.deadlines.busy_store_s, retry_after=True)

    def _on_claimed_again(self, endpoint: str, refs: Sequence[BlobRef], outcome: Outcome, fresh: bool) -> None:
        self._claiming_again -= 1
        if isinstance(outcome, PeerDown):
            self.core.claim_unanswered(refs)  # named in the store's loss, or claimed again once it is back
            return
        replies, failures = split_outcomes([(endpoint, outcome)])
        if any(isinstance(error, RemoteError) and error.code == "replay" for _, error in failures) and not fresh:
            # A resend after the first answer left the store's reply cache: claims by one holder are idempotent
            # (a repeat is answered ``already``), so a new request asks the same question once more.
            self._claim_again(ClaimAgain(tuple(refs)), fresh=True)
            return
        for _, error in failures:
            log.error("claim.unsettled", endpoint=endpoint, blobs=len(refs), blob_ids=[r.blob_id for r in refs][:8],
                      error=str(error), detail="given up: if the store grants them after all, it keeps them as this "
                                               "node's until this node is gone (then reclaims them holder-down)")
        for _, reply in replies:
            answer = reply.body
            assert isinstance(answer, Claimed)
            granted = set(answer.blob_ids)
            late = [ref for ref in refs if ref.blob_id in granted]
            if not late:
                continue
            log.warning("claim.granted_late", endpoint=endpoint, blobs=len(late),
                        detail="their episode went on without them: deleted")
            if self._closing:
                self.core.holdings.take(late)  # deleted with the rest by the shutdown
            else:
                self._execute(self.core.claimed_late(late))

    def _lose(self, action: LoseBlobs) -> None:
        self.lost += len(action.refs)
        if action.refs:
            self.runtime.publish(Delete(blob_ids=[r.blob_id for r in action.refs], holder=self.runtime.node_id,
                                        reason=LOST, node=action.node_id))

    def _on_deleted(self, endpoint: str, request: Delete, outcome: Outcome, refs: Sequence[BlobRef] = (),
                    request_id: str = "") -> None:
        # Only a delete with its refs can wait for its store (the shutdown's cannot: nothing is sent after it).
        if refs and isinstance(outcome, PeerDown) and self.core.delete_undelivered(
                DeleteBlobs(tuple(refs), request.reason, request.node, request_id)):
            return  # waits for its store: sent again under request_id when it is back, lost when its grace ends
        replies, failures = split_outcomes([(endpoint, outcome)])
        for _, error in failures:
            if isinstance(error, RemoteError) and error.code == "replay":  # answered, its answer since evicted
                log.info("delete.answered_before", endpoint=endpoint, blobs=len(request.blob_ids),
                         reason=request.reason)
                continue
            self.failed_deletes += len(request.blob_ids)
            log.error("delete.failed", endpoint=endpoint, blobs=len(request.blob_ids), reason=request.reason,
                      blob_ids=request.blob_ids[:8], error=str(error),
                      detail="given up: the store keeps them as this node's until this node is gone (then "
                             "reclaims them holder-down)")
        for _, reply in replies:
            deleted = reply.body
            assert isinstance(deleted, Deleted)
            self.deleted[request.reason] += len(deleted.blob_ids)
            if deleted.reclaimed:  # held before this node was cut off and declared down: reclaimed meanwhile
                log.warning("delete.reclaimed", endpoint=endpoint, blobs=len(deleted.reclaimed), reason=request.reason)
            if deleted.violations:
                log.error("delete.violation", endpoint=endpoint, blob_ids=deleted.violations, reason=request.reason)

    # --- shutdown ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shutdown: delete what is queued, still grouped, or held for any other reason (a step batch that
        no trainer acknowledged); what is held on stores reported down is published as lost. The loop has
        stopped, so these deletes wait for their replies, all within the node's shutdown deadline
        (``runtime.shutdown_left``), one a store could not journal sent again after its ``retry_after_s``; a store
        the registry no longer lists is not asked at all: what it kept is reported lost, naming it. Claims (those
        sent again to learn what an unanswered one did included) and step batches still in flight are answered
        first (for at most half the time left, and only while a request is in flight), nothing new is sent
        meanwhile but claims sent again: a store grants a claim and a rank takes a batch whether or not this node
        still listens, so what the claims grant is deleted with the rest (as are the episodes whose claims were
        answered but whose turn had not come, and those recovered at start and not fed yet), and an acknowledged
        batch is its rank's to delete, not this node's. What is unanswered by then is decided as before: a claim is
        left to its store (reclaimed ``holder-down`` after this node's grace), a batch is deleted here. The start-up
        recovery is finished first too, begun here if the stop came before it did (a run's launcher restarts a
        dead orchestrator at the run's end only to stop it): what an earlier incarnation held is claimed back and
        deleted with the rest, not left held to the stores' own shutdown.

        After a halt that is not final (a deadline on peers that may yet come: see
        :class:`~.orchestrator_core.Halt`) nothing is deleted: the node ends as a crash would, and its restarted
        process claims back what it held (within ``node.restart_grace_s``) and feeds it once the peers are back."""
        self._closing = True
        if self._halted and not self.halt_final:
            log.warning("shutdown.holdings_kept", reason=self._halted, held=len(self.core.holdings.held),
                        detail="left to this node's restarted process, which claims them back")
            return

        def claims_out() -> list[_Arrival]:
            return [a for a in self._arrivals if a.message is not None and a.claims_pending]

        def settled() -> bool:
            # With no request in flight nothing can answer: a claim still out waits for a timer (its durable
            # store restarting), and timers no longer run.
            return (not (claims_out() or self._recovery.claims_pending or self._delivering or self._claiming_again)
                    or not self.runtime.calls.in_flight())

        if not self._recovery_begun:  # stopped before it began: what an earlier incarnation held is claimed now
            self._recover()
        if not settled():
            self.runtime.calls.run_until(settled, self.runtime.shutdown_left() / 2)
        if claims_out() or self._recovery.claims_pending or self._delivering or self._claiming_again:
            log.warning("shutdown.unanswered", claims=len(claims_out()), recovery=self._recovery.claims_pending,
                        step_batches=self._delivering, claims_again=self._claiming_again)
        for arrival in self._arrivals:
            if arrival.message is not None and not arrival.claims_pending:
                self.core.holdings.take(arrival.claimed)
        for _, claimed in self._recovered:
            self.core.holdings.take(claimed)
        actions = self.core.close()
        for action in actions:
            if isinstance(action, LoseBlobs):
                self._lose(action)
        deletes = [(endpoint, action.reason, refs) for action in actions if isinstance(action, DeleteBlobs)
                   for endpoint, refs in group_by_endpoint(action.refs, self._locate).items()]
        live = self._live_stores() if deletes else None
        reachable: list[tuple[str, Delete]] = []
        for endpoint, reason, refs in deletes:
            if live is None or endpoint in live:
                reachable.append((endpoint, Delete(blob_ids=[r.blob_id for r in refs],
                                                   holder=self.runtime.node_id, reason=reason)))
            else:  # gone from the registry: nothing to ask, what it kept is lost with it
                self._lose(LoseBlobs(tuple(refs), self._peers.node_of(endpoint) or endpoint))
        for endpoint, request, outcome in self._delete_now(reachable):
            self._on_deleted(endpoint, request, outcome)

    def _delete_now(self, deletes: Sequence[tuple[str, Delete]]) -> list[tuple[str, Delete, Outcome]]:
        """Send the shutdown's ``deletes`` (endpoint, request) and wait for their outcomes, the loop stopped, within
        the shutdown time left (a tenth of it stays for handling them before the hooks' share ends). Each is sent
        again after an answer with ``retry_after_s`` (the store could not journal it: nothing changed) while that
        is before the deadline, as every delete of this node is (``retry_after``)."""
        deadline_s = self.runtime.shutdown_left() * 0.9
        outcomes: dict[int, Outcome] = {}
        if deadline_s > 0:
            sent = [self.runtime.calls.request(endpoint, request, lambda outcome, i=i: outcomes.__setitem__(i, outcome),
                                               deadline_s=deadline_s, retry_after=True)
                    for i, (endpoint, request) in enumerate(deletes)]
            if not self.runtime.calls.run_until(lambda: len(outcomes) == len(deletes), deadline_s):
                for msg_id in sent:  # due by now: their deadline's tick did not come before the wait ended
                    self.runtime.calls.cancel(msg_id)
        late = RequestTimeout("no time left before the shutdown deadline")
        return [(endpoint, request, outcomes.get(i, late)) for i, (endpoint, request) in enumerate(deletes)]

    def _live_stores(self) -> set[str] | None:
        """The blob endpoints of the env servers the registry lists now; None when the broker does not
        answer within a quarter of the shutdown time left (then every store is tried)."""
        timeout = self.runtime.shutdown_left() / 4
        if timeout < MIN_TIMEOUT_S:
            return None
        nodes = self.runtime.lookup(STORE_ROLE, policy=RetryPolicy(timeout_s=timeout, attempts=1))
        if nodes is None:
            return None
        return {endpoint for node in nodes if (endpoint := node.endpoints.get("blobs"))}

    # --- observability -------------------------------------------------------------------------------

    def _dropped_samples(self) -> dict[tuple[str, ...], float]:
        counts = {(reason,): float(n) for reason, n in self.core.sink.dropped.items()}
        if self.core.eval_sink.samples:
            counts[("eval",)] = float(self.core.eval_sink.samples)
        return counts

    def status(self) -> dict[str, float]:
        """Heartbeat status: the next step and the policy version, the blobs held, the runs in flight and the
        episodes whose room is reserved at the stores (their runs', until each episode counts as held there),
        and the prompt source's numbers."""
        holdings = self.core.holdings
        return {"step": float(self.core.step), "version": float(self.core.policy_version),
                "blobs_held": float(len(holdings.held)), "bytes_held": float(holdings.held_bytes),
                "runs_in_flight": float(len(self.core.runs)),
                "episodes_reserved": float(len(self.core.router.reserved)),
                **{f"{TASK_PREFIX}{name}": value for name, value in self._task().items()}}

    def _task(self) -> dict[str, float]:
        """The prompt source's numbers (its ``status()``); none when not dispatching."""
        return self.core.prompts.numbers() if self.core.prompts is not None else {}

    def _register_metrics(self) -> None:
        holdings = self.core.holdings
        self.runtime.metric("refbus_orchestrator_blobs_held", "Blobs the orchestrator owns (references only).",
                            lambda: {(): float(len(holdings.held))}, kind="gauge")
        self.runtime.metric("refbus_orchestrator_referenced_bytes", "Array bytes the orchestrator holds by reference.",
                            lambda: {(): float(holdings.held_bytes)}, kind="gauge")
        self.runtime.metric("refbus_orchestrator_stalled_seconds_total",
                            "Seconds the orchestrator's timer pass came late (its loop stopped, swapped out or starved "
                            "of CPU); counted toward none of its deadlines on runs, groups, stores and deliveries.",
                            lambda: {(): self.passes.stalled_s})
        self.runtime.metric("refbus_orchestrator_steps_total", "Steps shipped to the trainer ranks.",
                            lambda: {(): float(self.core.step)})
        self.runtime.metric("refbus_orchestrator_dropped_samples_total", "Samples not shipped, by reason.",
                            self._dropped_samples, labels=("reason",))
        self.runtime.metric("refbus_orchestrator_backpressure_pauses_total",
                            "Times every env server was at its high-water mark, so no new group started.",
                            lambda: {(): float(self.core.full_pauses)})
        self.runtime.metric("refbus_orchestrator_task", "The prompt source's numbers (its status(), e.g. a "
                            "curriculum's level), by name.",
                            lambda: {(name,): value for name, value in self._task().items()}, labels=("name",),
                            kind="gauge")
        self.runtime.metric("refbus_orchestrator_blobs_lost_total",
                            "References dropped because their env server went down and was not back in time.",
                            lambda: {(): float(self.lost)})


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node orchestrator``: serve until SIGINT/SIGTERM; exit status :data:`~..halting.HALTED_STATUS`,
    the reason on stderr (:func:`~..halting.halt`), when the run halted for good (a step batch no message can
    carry, env servers whose budgets cannot hold a step); 1 when it halted on a deadline (a step the trainer ranks
    did not all acknowledge in time, no new trainer world in time: see :class:`~.orchestrator_core.Halt`)."""
    runtime = NodeRuntime("orchestrator", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    orchestrator = Orchestrator(runtime, config.orchestrator, deadlines_from(config))
    runtime.run()
    if orchestrator.failure and not orchestrator.halt_final:
        return 1  # logged orchestrator.halted: its supervisor restarts it, to wait for those peers again
    return halt(orchestrator.failure) if orchestrator.failure else 0
