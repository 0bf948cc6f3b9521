"""The env server node (``refbus node env-server``, or embedded in a framework's env server process).

A :class:`~refbus.nodes.payload.keeper.Keeper` behind a ROUTER advertised as ``blobs``:

============ ============= ====================================================================================
request      reply         effect and events
============ ============= ====================================================================================
``keep``     ``kept``      keeps the branches; publishes ``episode-finished`` (references and ``info``, never
                           the branch arrays)
``discard``  ``deleted``   deletes the episode's unclaimed blobs; publishes ``delete`` (holder: the source).
                           Sent again to a restarted store: also those its earlier process discarded
``claim``    ``claimed``   moves unclaimed blobs to the claimer; publishes ``claim`` for what moved.
                           ``blob_ids``: now held by the claimer (also those it had claimed before);
                           ``missing``: deleted or never kept; ``violations``: held by another claimer;
                           ``reclaimed``: reclaimed from a holder that went down (stale, logged)
``fetch``    ``blobs``     the arrays as zero-copy frames; ``missing``: unknown or deleted ids (a fetch of a
                           deleted blob is also a violation, unless it was reclaimed from a holder that went
                           down: stale, logged). Not cached: a retry reads again
``delete``   ``deleted``   deletes live blobs once, whoever asks; publishes ``delete`` (with the request's
                           ``node``). ``violations``: ids already deleted; ``missing``: ids never kept here
                           (logged); ``reclaimed``: reclaimed from a holder that went down (stale, logged)
``accounts`` ``accounted`` the keeper's counters (kept, deleted by reason, held by claimer, reclaimed from
                           dead holders, violations) as of the sequence number of the last event published:
                           queued events are published first, so the counters and the stream agree up to it.
                           Counts only (per-holder maps cut to the request's ``holders``); not cached
``holdings`` ``held``      the ``episode-finished`` records of the episodes with a live blob held by
                           ``holder`` or unclaimed, with those blob ids, in keep order, paged (``limit``
                           episodes, about a quarter of the body limit in bytes; ``more`` and ``cursor``
                           to go on): what a restarted holder takes back. A read: no event; not cached
============ ============= ====================================================================================

Every violation is answered and counted per blob id, and logged with both holders and published as one
``violation`` event per request and (action, holder, owner) (:func:`~.violations.summarize`: ``count`` ids,
the first 16 as ``sample``), so a request naming many deleted ids costs the stream one event.
Unclaimed blobs are deleted when their hand-over lease ends (``delete``, reason ``undelivered``). A holder
the registry reports down (``node-down``) that is not back within ``node.restart_grace_s`` loses what it
held here (``delete``, reason ``holder-down``, ``node``: the holder), except blobs its restarted
incarnation (same node id) claimed again meanwhile; the same process re-registering (a holder that was
slow, not dead) keeps everything. A restarted incarnation reported down in turn within that grace starts a
fresh one, in which only what a later incarnation claims is kept (back as the same process after all, it
keeps what it claimed and the grace its report cut short goes on). A new process registering under the holder's id
that claims nothing back (label ``claims_back`` ``"0"``: a trainer rank) ends the grace at its ``node-up``, since
only one process holds a node id at a time: what the process reported down held is deleted then (``holder-down``,
logged ``blobs.holder_replaced``), not at the grace's end (:func:`claims_nothing_back`,
:meth:`~.keeper.Keeper.end_grace`). Requests that touch reclaimed blobs later
are stale, not violations: a holder cut off by a partition comes back as the same process without knowing it
was declared down, so its claims and deletes of what it held are answered ``reclaimed`` (per id, in
``claimed`` and ``deleted``; counted by action in ``refbus_stale_requests_total``) and logged, never counted
or published as violations. ``reference`` events tell the env server which blobs a trainer rank
took over from the orchestrator, so each holder loses only its own. Any peer may publish one, so a hand-over moves
a blob only when one of its two ends published it: the blob's holder here (the orchestrator that claimed it) or
the rank it names. One from any other node is refused for those blobs: logged (``reference.refused``, with its
publisher), counted (``refbus_bus_events_rejected_total``, code ``third-party-hand-over``), nothing moved, and the
node goes on. A hand-over that names a process of the rank that is
not its live one (gone, or followed by a new process) gives that process the grace a ``node-down`` would, so what
moved is reclaimed with the rank's. At
shutdown everything still held is deleted (reason ``shutdown``); the runtime then waits (bounded) until the
broker has those events before it leaves.

Durability (``store.durable``, the default in ``refbus node env-server``): blobs live in the node's durable
store (:mod:`refbus.nodes.store.durable`, :mod:`.blob_journal`), and ``kept``, ``claimed`` and ``deleted``
are answered (and their events published) only after their journal record is committed. A process
restarted under the same node id re-adopts what was committed (verified; losses deleted with reason
``lost``, ``node`` itself), continues the counters ``accounted`` reports, and registers with the store's
identity as label ``store``, by which the orchestrator, trainer ranks and the ledger know it as the same
store. It publishes ``claim`` again for every re-adopted blob a holder has (one event per holder and
:data:`REANNOUNCE_IDS` ids): a claim is answered once committed, and its event leaves with the loop turn's
batch, so a process killed in between took that event with it, and the stream would show the holder's later
delete of a blob it never saw claimed. For the same reason it publishes ``episode-finished`` again (``again``)
for every re-adopted episode none of whose blobs anyone claimed: a keep answered and killed before its event
left would otherwise be an episode no orchestrator ever hears of. A retried delete by the holder that deleted
the blob before the restart is answered as deleted; a retried keep of an episode it re-adopted, with the same
branches, ``kept`` with the first process's references; a retried discard with the ids the first process
discarded. Every change is journaled before the keeper makes it (:data:`~.keeper.Commit`): a journal that
cannot take the record (a full tmpfs) changes nothing, and the request is answered ``journal-failed`` with
``retry_after_s`` (not cached: the same request sent again runs again); a lease's or a grace's end is tried
again at the next tick. A change an
event asks for (a ``reference``'s hand-over, a holder's ``node-down`` or ``node-up``) waits instead, and is made
at a later tick, the changes of later events behind it in the order they came; until then claims and
``holdings`` (which depend on who holds what) are refused ``journal-failed`` and nothing is reclaimed. A trainer
rank repeats to the restarted process the ``reference`` events it published while the store was dead, and the
orchestrator those of every hand-over not yet reported deleted, naming the rank's process (a rank that died
meanwhile cannot repeat its own); the restarted process makes those that name a process once it has checked its
holders, claims and ``holdings`` refused ``journal-failed`` until then.

Replicas: several env-server processes may serve one source (``env_server.source``). Each registers with
the broker with ``endpoints == {"blobs": <endpoint>}`` and ``labels == {"source": <source>}``, so the
orchestrator finds every replica of a source with a ``nodes`` request. Heartbeats carry ``blobs_held``,
``bytes_held``, ``budget_bytes``, ``high_water``, ``fill`` (bytes held over the budget) and ``full`` (1.0 from
``env_server.high_water`` on).

Backpressure: the budget (``env_server.budget_bytes``) is never exceeded and nothing is evicted. It is charged
what a blob costs, not only its array bytes (:func:`~.charges.blob_charge`: whole pages, at least one, plus a
per-blob overhead), and each episode's ``info`` (:func:`~.charges.info_charge`) for as long as a blob of the
episode lives, so many tiny blobs or a large ``info`` meet ``over-budget`` like any other keep. With a durable
store the live blobs are also capped under the process's mapping limit (one segment mapped per blob:
:func:`~refbus.nodes.store.durable.segment_limit`), refused ``over-budget`` (too many blobs) beyond it, before
any segment is written. A store says how full it is, and the
orchestrator sends it only the runs whose episodes fit under its high-water mark; a keep that would exceed
the budget is refused with ``over-budget`` and ``retry_after_s`` (the error reply's field,
:attr:`KeepError.retry_after_s`), and a run's own keep waits for room (:class:`~.episodes.EpisodeRunner`)
instead of wasting its generation.

Embedding: build a :class:`NodeRuntime`, an :class:`EnvServer` on it, call ``runtime.start_background()``,
then :meth:`EnvServer.keep` / :meth:`EnvServer.discard` from the framework's own threads. A framework that
produces episodes itself slows down through :meth:`EnvServer.pressure` (start no new episode while it says
``full``) and retries a refused keep after ``KeepError.retry_after_s``.

Never imports torch, directly or through anything it imports.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import structlog

from ...bus.metrics import Readings
from ...bus.peers import incarnation
from ...bus.reqrep import HandlerError
from ...bus.runtime import NodeRuntime
from ...bus.stall import PassStalls
from ...protocol.envelope import Message
from ...protocol.errors import shown
from ...protocol.messages import (
    CLAIMS_BACK,
    DELETE_REASONS,
    THIRD_PARTY_HAND_OVER,
    Accounted,
    Accounts,
    BlobRef,
    Blobs,
    Body,
    Claim,
    Claimed,
    Delete,
    Deleted,
    Discard,
    EpisodeFinished,
    Fetch,
    FetchedBlob,
    Held,
    HeldEpisode,
    HoldingsQuery,
    Keep,
    Kept,
    NodeDown,
    NodeInfo,
    Reference,
    Violation,
)
from ..config import Config, ConfigError
from ..entry_points import UserCodeFailed
from ..settings import EnvServerSettings, StoreSettings
from ..store.durable import DurableStore, StoreError, StoreLocked, segment_limit
from .blob_journal import BlobJournal, Readoption, resumed_grace
from .branch import Branch
from .charges import info_charge
from .episodes import EpisodeRunner
from .keeper import (
    DISCARDED,
    HOLDER_DOWN,
    LOST,
    RETRY_AFTER_S,
    SHUTDOWN,
    UNDELIVERED,
    VIOLATION_ACTIONS,
    ClaimResult,
    DeleteResult,
    FetchResult,
    HandOverResult,
    Keeper,
    KeepError,
    KeeperStats,
    PackedBranch,
    pack_branches,
)
from .violations import summarize

log = structlog.get_logger(__name__)

ROLE = "env-server"
STORE_REASONS = frozenset({HOLDER_DOWN, LOST, UNDELIVERED, SHUTDOWN})
"""Delete reasons this store gives the deletes it decides itself: no peer's discard may claim one."""
HOLDER_CHECKS = 20  # registry lookups a restarted store tries before it leaves its holders unchecked
REANNOUNCE_IDS = 1024  # blob ids in one re-published claim: about 30 KiB, an event that travels alone
# Changes events asked for that may wait for their journal records at most, each counted by the blob ids it names
# (at least 1): ~20 MiB of ids. A journal that stays full past it (an operator who never frees the tmpfs) ends the
# node as a crash would, its store kept: its restarted process learns those changes again as any store back as a
# new process does (holders and the orchestrator publish their hand-overs again, the registry says who is down),
# where waiting on would grow its memory with the whole cluster's event rate until the kernel killed it.
WAITING_MAX = 1 << 18


def _unknown_reason(request: str, reason: str) -> str | None:
    """Why a ``request`` (``delete``, ``discard``) may not have ``reason``, or None when it is one refbus gives
    deletes (``DELETE_REASONS``). The keeper counts its deletes by reason, and the reasons a peer could make up
    would grow those counts (each a metric series and an ``accounted`` entry) without bound."""
    if reason in DELETE_REASONS:
        return None
    known = ", ".join(sorted(DELETE_REASONS))
    return f"a {request}'s reason may not be {shown(reason)}: it is none of refbus's delete reasons ({known})"


def claims_nothing_back(info: NodeInfo) -> bool:
    """Whether ``info`` registers a process that never claims back what earlier processes under its node id held
    (label :data:`~refbus.protocol.messages.CLAIMS_BACK` ``"0"``: a trainer rank) and that is a process at all: a
    host, a pid above 0, a start time that is a time. Only then does its registration prove the process a holder's
    grace waits for gone, and that the grace can spare nothing more; one with garbage process fields proves
    nothing, and the grace runs on."""
    host, pid, started = incarnation(info)
    return info.labels.get(CLAIMS_BACK) == "0" and bool(host) and pid > 0 and math.isfinite(started) and started > 0


@dataclass(frozen=True, slots=True)
class Pressure:
    """How full a store is, from its own counters: what it publishes and what a producer asks before it
    starts an episode."""

    bytes_held: int
    budget_bytes: int
    high_water: float

    @property
    def fill(self) -> float:
        """Bytes held over the budget (0 to 1)."""
        return self.bytes_held / self.budget_bytes

    @property
    def full(self) -> bool:
        """At or above the high-water mark: start no new episode for this store."""
        return self.fill >= self.high_water


class EnvServer:
    """Serves a :class:`Keeper` on ``runtime`` and mirrors every ownership move on the event stream.

    Construct before ``runtime.run()`` / ``runtime.start_background()``: it binds the ``blobs`` endpoint,
    labels the node with its source, tracks peers (``runtime.track_peers()``) and ``reference`` events,
    sets the heartbeat status, lease and reclaim timers, a shutdown hook and its metrics (exposed while the
    runtime serves metrics). ``restart_grace_s`` (``node.restart_grace_s``): how long a holder reported down
    has to come back before what it holds is deleted. ``clock`` times leases and graces in this process (a
    durable store journals a grace's end on the wall clock too: :class:`~.blob_journal.BlobJournal`).

    Threads: :meth:`keep` and :meth:`discard` may be called from any thread; the keeper is behind a lock
    and events are published on the loop thread only.
    """

    def __init__(
        self,
        runtime: NodeRuntime,
        settings: EnvServerSettings,
        *,
        restart_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        store: StoreSettings | None = None,
        run: str = "",
    ) -> None:
        self.runtime = runtime
        self.source = settings.source or runtime.node_id
        # numpy backend: torch tensors sent by a peer must not make this process import torch.
        self.server = runtime.serve("blobs", settings.endpoint)
        self.endpoint = runtime.endpoints["blobs"]
        runtime.labels["source"] = self.source
        # A durable store maps a segment per blob: their number is capped under the process's mapping limit.
        self.keeper = Keeper(self.source, self.endpoint, budget_bytes=settings.budget_bytes,
                             handover_lease_s=settings.handover_lease_s, tombstone_s=settings.tombstone_s,
                             clock=clock, node=runtime.node_id,
                             max_blobs=segment_limit() if store is not None and store.durable else None)
        if not 0 < settings.high_water <= 1:
            raise ValueError(f"env_server.high_water must be in (0, 1], got {settings.high_water}")
        self.high_water = settings.high_water
        self._lock = threading.Lock()
        # Events from other threads wait here for the loop thread; flushed before any other publish so the
        # stream never shows a claim before the episode-finished it refers to.
        self._outbox: deque[Body] = deque()
        self.restart_grace_s = restart_grace_s
        # What a restarted store's holders took (claims, hand-overs) before it checked them (holder -> blob ids):
        # a holder that restarted while the store was dead takes back what it wants meanwhile, and keeps it.
        self._taken_unchecked: dict[str, set[str]] | None = None
        # Changes events asked for (a hand-over, a holder down or back) whose journal records could not be committed
        # yet, oldest first, each with what it is for the log: made in that order before anything after them.
        self._waiting: deque[tuple[str, Callable[[], None], int]] = deque()
        self._waiting_weight = 0  # of _waiting and _after_check, in blob ids (see WAITING_MAX)
        # Why this node ends as a crash would (its durable store kept for its restarted process); "" while it serves.
        self.abandoned = ""
        # Hand-overs naming their taker's process that came before this restarted store checked its holders: made
        # after the check (see _on_reference).
        self._after_check: list[tuple[str, Callable[[], None], int]] = []
        self.journal: BlobJournal | None = None
        self.readoption: Readoption | None = None
        if store is not None and store.durable:
            self._open_store(store, run)

        self.server.on(Keep.kind, self._on_keep)
        self.server.on(Discard.kind, self._on_discard)
        self.server.on(Claim.kind, self._on_claim)
        self.server.on(Fetch.kind, self._on_fetch, cached=False)  # a read: large replies are not cached
        self.server.on(Delete.kind, self._on_delete)
        self.server.on(Accounts.kind, self._on_accounts, cached=False)  # a read: a retry counts again
        self.server.on(HoldingsQuery.kind, self._on_holdings, cached=False)  # a read: a retry reads again
        self._peers = peers = runtime.track_peers()
        peers.on_down(self._on_node_down)
        peers.on_up(self._on_node_up)
        # Hand-overs a third node published are refused, counted with the events this subscription refuses.
        self._references = runtime.subscribe(self._on_reference, kinds=frozenset({Reference.kind}))
        # Unclaimed blobs go within a quarter lease, what a dead holder held within a quarter grace, of their
        # deadlines (at most 1 s); the pass's stalls count toward neither (see _deadlines).
        self.passes = PassStalls(min(1.0, max(0.05, min(settings.handover_lease_s, restart_grace_s) / 4)))
        runtime.every(self.passes.period_s, self._deadlines)
        runtime.status = self.status
        runtime.shutdown_hooks.append(self._shutdown)
        self._register_metrics()
        if self.journal is not None:
            runtime.every(1.0, self._compact)

    def _open_store(self, settings: StoreSettings, run: str) -> None:
        """Open (or re-adopt) this node's durable store; its identity becomes the ``store`` label, by which
        peers tell a re-adopted store (same blobs) from a fresh one. What re-adoption lost is deleted with
        reason ``lost`` (``node``: this store) once the loop runs.

        Raises:
            StoreError: the store is held by another process, its tmpfs is smaller than the budget, or its
                journal is of another format.
        """
        durable = DurableStore(settings.directory, settings.run or run, self.runtime.node_id,
                               budget_bytes=self.keeper.budget_bytes, what="env_server.budget_bytes")
        self.journal = BlobJournal(durable)
        self.runtime.labels["store"] = durable.identity
        self.readoption = found = self.journal.readopt(self.keeper)
        if not durable.fresh:
            log.info("store.readopted", store=str(durable.path), blobs=found.blobs, bytes=found.bytes,
                     lost=len(found.lost), aborted=found.aborted, seconds=round(found.seconds, 4))
        for blob_id, why in found.lost.items():
            log.error("store.blob_lost", blob_id=blob_id, detail=why)
        if not durable.fresh:
            # Before the lost blobs' delete: an episode whose first event died with its process is kept, by the
            # ledger, only by its repeat, and a delete folded first would leave a lost blob of it kept nowhere.
            self._reannounce_episodes()
        if found.lost:
            self._post(Delete(blob_ids=list(found.lost), holder=self.source, reason=LOST, node=self.runtime.node_id))
        if not durable.fresh:
            self._reannounce_claims()
            self._taken_unchecked = {}
            self.runtime.call_soon(self._holders_after_restart)  # on the loop: the registry is asked there

    def _reannounce_episodes(self) -> None:
        """Publish ``episode-finished`` again (``again``) for each re-adopted episode nobody claimed: a keep is
        answered once committed and its event leaves with the loop turn's batch, so a process killed in between
        took the event with it, and no orchestrator would ever claim, train or drop the episode (it would expire
        unclaimed after the hand-over lease). Readers that had the first one ignore the repeat."""
        for record in self.keeper.unclaimed_records():
            self._post(msgspec.structs.replace(record, again=True))

    def _reannounce_claims(self) -> None:
        """Publish ``claim`` for the re-adopted blobs each holder has (see the module doc): repeats of claims the
        stream already carried change nothing for its readers, for whom a blob only moves forward."""
        for holder, blob_ids in sorted(self.keeper.claimed().items()):
            for start in range(0, len(blob_ids), REANNOUNCE_IDS):
                self._post(Claim(blob_ids=blob_ids[start:start + REANNOUNCE_IDS], holder=holder))

    def _holders_after_restart(self, attempt: int = 0) -> None:
        """Find the re-adopted blobs' holders that are gone (loop thread, first thing after start): asks the
        registry, again every quarter grace while the broker does not answer (:data:`HOLDER_CHECKS` times
        at most; a holder is never judged gone on an unanswered lookup)."""
        def answered(nodes: list[NodeInfo] | None) -> None:
            if nodes is not None:
                self._holders_gone(nodes)
            elif attempt + 1 < HOLDER_CHECKS:
                self.runtime.later(max(0.05, self.restart_grace_s / 4),
                                   lambda: self._holders_after_restart(attempt + 1))
            else:
                self._taken_unchecked = None
                log.error("holders.unchecked", attempts=HOLDER_CHECKS,
                          detail="the registry never answered: holders gone around this restart keep their blobs")
                self._checked()

        self.runtime.lookup_async("", answered)

    def _holders_gone(self, listed: list[NodeInfo]) -> None:
        """Node-downs this store heard before it died are in its journal; those it missed while dead show in
        the registry (``listed``: its live nodes): a holder it lacks, or one live as another process than the
        one that last took blobs here (the journal's ``holder-seen``: it restarted while this store was dead).
        Each such holder of re-adopted blobs is taken down as a ``node-down`` would, then, when it is live, up as
        a ``node-up`` would. One the journal records down gets what is left of the grace recorded, its deadline
        (:func:`~.blob_journal.resumed_grace`: at most a whole grace, at least a share of one, so a holder whose
        claims failed while this store was dead can send them again); any other the whole grace, from now: the
        grace it would have had. Back as the same process it keeps
        everything, a restarted incarnation what it claimed again, before this store's restart (the journal's
        ``again``) or after (what it claimed or was handed over before this check included). A holder recorded
        down a second time (its restarted incarnation died in the grace) gets the grace that report cut short
        first, then the fresh one, as the node-downs gave them. A holder whose grace ended before
        (``holder-settled``) is not recorded and, live as the process seen last (or none recorded), left alone.
        Without this, a holder that died around this store's own restart kept its blobs here until the store
        shut down; and before graces were resumed from their deadline, every restart of this store within a
        holder's grace gave it whole again."""
        found = self.readoption
        recorded = found.holders_down if found is not None else {}
        grace_ends = found.grace_ends if found is not None else {}
        seen = found.holders_seen if found is not None else {}
        cut_short = found.earlier_down if found is not None else {}
        live = {node.node_id: node for node in listed}
        self._peers.seed(listed)  # what the start-up lookup may have missed: the hand-overs after this check ask
        taken_since, self._taken_unchecked = self._taken_unchecked or {}, None
        with self._lock:
            holders = sorted(h for h in self.keeper.stats().held_by if h)
        given: list[str] = []
        for holder in holders:
            went_down = recorded.get(holder) or seen.get(holder)  # a down process not recorded: the one seen
            if holder not in recorded and holder in live and went_down in (None, incarnation(live[holder])):
                continue  # nothing says it went down
            again = set(found.claimed_again.get(holder, ())) if found else set()
            since = sorted(taken_since.get(holder, set()))
            grace_s = self._resumed_grace(grace_ends.get(holder))

            def down(holder: str = holder, went_down: tuple[str, int, float] | None = went_down,
                     again: set[str] = again, since: list[str] = since, grace_s: float = grace_s) -> None:
                if holder in cut_short:  # under the fresh grace, the one it cut short: resumes if that process is back
                    earlier, earlier_again, earlier_end = cut_short[holder]
                    with self._lock:  # replayed, not a change: made again, it is a repeat
                        self.keeper.holder_down(holder, self._resumed_grace(earlier_end), process=earlier,
                                                claimed_again=earlier_again)
                # ``since`` journaled too: a second restart within this grace keeps them as well
                self._holder_down(holder, went_down, journal=holder not in recorded, claimed_again=again.union(since),
                                  grace_s=grace_s, taken=since)

            def checked(holder: str = holder, grace_s: float = grace_s) -> None:
                with self._lock:
                    still_down = self.keeper.in_grace(holder)  # not back as the same process
                if still_down:
                    given.append(holder)
                    log.warning("holder.down_at_restart", holder=holder, live=holder in live,
                                grace_s=round(grace_s, 3))

            self._wait("holder-down", down)
            if holder in live:
                self._wait("holder-up", self._node_back(live[holder]))
            self._wait("holder-checked", checked)
        self._wait("holders-checked", lambda: log.info(
            "store.holders_checked", holders=len(holders), down_at_restart=len(given)))
        self._checked()

    def _checked(self) -> None:
        """This restarted store's holders are checked (or never will be): the hand-overs that waited for it follow
        the check's changes."""
        self._waiting.extend(self._after_check)
        self._after_check.clear()
        self._catch_up()

    def _resumed_grace(self, until: float | None) -> float:
        """The grace to give at this store's restart for one journaled to end at ``until`` (wall clock; None:
        none journaled, a whole grace from now)."""
        assert self.journal is not None  # only a restarted durable store resumes graces
        return resumed_grace(until, self.journal.wall_clock(), self.restart_grace_s)

    # --- the embedding API (any thread) -------------------------------------------------------------

    def keep(
        self,
        episode_id: str,
        branches: Sequence[Branch | Mapping[str, np.ndarray]],
        *,
        policy_version: int = 0,
        info: dict[str, Any] | None = None,
    ) -> list[BlobRef]:
        """Keep an episode's branches and announce it (``episode-finished``); one reference per branch.

        Ownership: the branch arrays are copied before this returns (the copy runs outside the lock), so
        the caller may reuse them at once. ``info`` is handed over: it is published as is from the loop
        thread (arrays in it zero-copy), so the caller must not modify it afterwards.

        Raises:
            KeepError: a bad branch, over budget, a duplicate episode id, shutting down, or (with a durable
                store) an ``info`` the journal cannot hold or a journal write that failed; nothing is kept.
        """
        if self.abandoned:  # ended as a crash would: its store is its restarted process's
            raise KeepError("closed", f"episode {episode_id!r}: the env server ended ({self.abandoned})")
        try:
            packed = pack_branches(branches)
            try:
                record_bytes = info_charge(info or {})
            except (ValueError, TypeError, NotImplementedError) as exc:
                raise KeepError("bad-info", f"episode {episode_id!r}: its info cannot be encoded: {exc}") from None
            if self.journal is not None:
                with self._lock:  # refused before its segments take room and mappings, not after
                    try:
                        self.keeper.check(episode_id, [p.nbytes for p in packed], record_bytes)
                    except KeepError as exc:
                        if exc.code == "duplicate-episode" and (kept := self._kept_before(episode_id, packed)):
                            log.info("keep.repeated", episode_id=episode_id, detail="kept by an earlier process")
                            return kept
                        raise
                packed = self.journal.write(packed)  # bytes first; the keep record commits them below
            with self._lock:
                try:
                    refs = self.keeper.store(episode_id, packed, record_bytes)
                except KeepError:
                    if self.journal is not None:
                        self.journal.discard(packed)
                    raise
                # Queued under the lock: a shutdown that deletes these blobs then finds this event queued
                # and publishes it first.
                record = EpisodeFinished(episode_id=episode_id, source=self.source, refs=refs,
                                         policy_version=policy_version, info=info or {})
                self.keeper.record(record)
                if self.journal is not None:
                    self._journal_kept(record, packed)
                self._post(record)
        except KeepError as exc:  # a refusal for want of room is backpressure working, not a fault
            (log.debug if exc.code == "over-budget" and exc.retry_after_s else log.warning)(
                "keep.refused", episode_id=episode_id, code=exc.code, error=str(exc))
            raise
        return refs

    def _kept_before(self, episode_id: str, packed: Sequence[PackedBranch]) -> list[BlobRef] | None:
        """The references of ``episode_id`` when an earlier process of this store kept it (re-adopted) with these
        very branches (the same checksums, in order): a keep whose answer died with that process, sent again to
        this one, which has no reply cache of it. None otherwise: another keep of the same id. Under the lock."""
        if self.readoption is None or episode_id not in self.readoption.episodes:
            return None
        record = self.keeper.record_of(episode_id)
        if record is None or [ref.checksum for ref in record.refs] != [branch.checksum for branch in packed]:
            return None
        return list(record.refs)

    def _journal_kept(self, record: EpisodeFinished, packed: Sequence[PackedBranch]) -> None:
        """Commit a keep just stored; when that fails (an ``info`` the journal cannot hold, a full disk), the
        keep is undone, so nothing unannounced stays held and no segment is left behind. Under the lock."""
        assert self.journal is not None
        try:
            self.journal.kept(record, packed, self.keeper.charge_of(record.episode_id))
        except Exception as exc:
            self.keeper.withdraw(record.episode_id)
            self.journal.discard(packed)
            if isinstance(exc, ValueError | TypeError | NotImplementedError):
                raise KeepError("bad-info", f"episode {record.episode_id!r} could not be journaled, nothing is kept: "
                                            f"{type(exc).__name__}: {exc}") from exc
            raise KeepError("journal-failed", f"episode {record.episode_id!r} could not be journaled, nothing is "
                            f"kept: {type(exc).__name__}: {exc}; retry after {RETRY_AFTER_S} s",
                            retry_after_s=RETRY_AFTER_S) from exc

    def discard(self, episode_id: str, reason: str = DISCARDED) -> list[str]:
        """Delete an abandoned episode's unclaimed blobs now (claimed ones are their holder's); their ids, and
        those an earlier process of this store discarded of it (a discard sent again across its restart).

        Raises:
            ValueError: ``reason`` is not one of ``DELETE_REASONS``; nothing deleted.
            KeepError: ``closed``, the node ended as a crash would (its store is its restarted process's).
            OSError: the durable store could not journal it (a full tmpfs); nothing deleted, call again.
        """
        if (refused := _unknown_reason("discard", reason)) is not None:
            raise ValueError(refused)
        with self._lock:
            if self.abandoned:
                raise KeepError("closed", f"episode {episode_id!r}: the env server ended ({self.abandoned})")
            result = self.keeper.discard(episode_id, reason, commit=self._journal_dropped())
            self._released(result)
            if result.deleted:
                self._post(Delete(blob_ids=list(result.deleted), holder=self.source, reason=reason))
        return [*result.deleted, *result.repeated]

    def stats(self) -> KeeperStats:
        """A consistent snapshot of the keeper's counters (any thread; metrics read it at scrape time)."""
        with self._lock:
            return self.keeper.stats()

    def pressure(self) -> Pressure:
        """How full this store is now (any thread)."""
        return Pressure(self.stats().bytes_held, self.keeper.budget_bytes, self.high_water)

    def status(self) -> dict[str, float]:
        """Heartbeat status: what the registry shows for this node."""
        stats = self.stats()
        pressure = Pressure(stats.bytes_held, self.keeper.budget_bytes, self.high_water)
        return {"blobs_held": float(stats.blobs_held), "bytes_held": float(stats.bytes_held),
                "blobs_kept": float(stats.kept_total), "blobs_deleted": float(sum(stats.deleted.values())),
                "fill": pressure.fill, "full": float(pressure.full), "budget_bytes": float(pressure.budget_bytes),
                "high_water": pressure.high_water}

    # --- request handlers (loop thread) -------------------------------------------------------------

    def _on_keep(self, request: Message) -> Kept:
        body = request.body
        assert isinstance(body, Keep)
        try:
            refs = self.keep(body.episode_id, body.branches, policy_version=body.policy_version, info=body.info)
        except KeepError as exc:
            raise HandlerError(exc.code, str(exc), retry_after_s=exc.retry_after_s) from None
        return Kept(refs=refs)

    def _on_discard(self, request: Message) -> Deleted:
        body = request.body
        assert isinstance(body, Discard)
        if (refused := _unknown_reason("discard", body.reason)) is not None:
            raise HandlerError("bad-reason", refused)
        if body.reason in STORE_REASONS:
            raise HandlerError("bad-reason", f"a discard's reason may not be {body.reason!r}: this store gives it "
                               "to the deletes it decides itself")
        try:
            return Deleted(blob_ids=self.discard(body.episode_id, body.reason))
        except OSError as exc:
            raise _journal_failed("discard", exc) from None

    def _on_claim(self, request: Message) -> Claimed:
        body = request.body
        assert isinstance(body, Claim)
        self._waited("claim")  # a holder's claim after its reported down, say, counts in the grace that report gave
        with self._lock:
            try:
                result = self.keeper.claim(body.blob_ids, body.holder,
                                           commit=self._journal_claim if self.journal is not None else None)
            except OSError as exc:
                raise _journal_failed("claim", exc) from None
        if self._taken_unchecked is not None:
            self._taken_unchecked.setdefault(result.holder, set()).update(result.claimed, result.already)
        if result.claimed:
            self._publish(Claim(blob_ids=list(result.claimed), holder=result.holder))
        self._report(result.violations)
        self._stale("claim", body.holder, result.reclaimed)
        return Claimed(blob_ids=[*result.claimed, *result.already], missing=[*result.gone, *result.unknown],
                       violations=[v.blob_id for v in result.violations], reclaimed=list(result.reclaimed))

    def _journal_claim(self, result: ClaimResult) -> None:
        """Commit a claim before the keeper makes it (:data:`~.keeper.Commit`): the process the holder is, the
        violations, what moved and what the holder, down and in its grace, took again."""
        assert self.journal is not None
        if result.claimed or result.again:
            self._seen(result.holder)
        self.journal.claimed(result.claimed, result.holder)
        self.journal.claimed_back(result.again, result.holder)
        self.journal.violated(result.violations)  # last: records before it are repeated harmlessly by a retry

    def _on_fetch(self, request: Message) -> Blobs:
        body = request.body
        assert isinstance(body, Fetch)

        def commit(result: FetchResult) -> None:
            assert self.journal is not None
            self.journal.violated(result.violations)

        with self._lock:
            try:
                result = self.keeper.fetch(body.blob_ids, body.holder,
                                           commit=commit if self.journal is not None else None)
            except OSError as exc:
                raise _journal_failed("fetch", exc) from None
        self._report(result.violations)
        self._stale("fetch", body.holder, result.reclaimed)
        return Blobs(
            blobs=[FetchedBlob(blob_id=blob_id, arrays=packed.sendable()) for blob_id, packed in result.blobs.items()],
            missing=[*result.unknown, *(v.blob_id for v in result.violations), *result.reclaimed],
        )

    def _on_delete(self, request: Message) -> Deleted:
        body = request.body
        assert isinstance(body, Delete)
        if (refused := _unknown_reason("delete", body.reason)) is not None:
            raise HandlerError("bad-reason", refused)
        # The loss reasons carry blame in the ledger: holder-down only from this store's own reclaim, lost only
        # for this store's blobs that a holder gave up while it was down (the delete names it).
        if body.reason == HOLDER_DOWN or (body.reason == LOST and body.node != self.runtime.node_id):
            raise HandlerError("bad-reason", f"a delete's reason may not be {body.reason!r} here"
                               + ("" if body.reason == HOLDER_DOWN else f" unless it names this store "
                                  f"({self.runtime.node_id!r}) as the node whose blobs were lost"))
        def commit(result: DeleteResult) -> None:
            assert self.journal is not None
            self.journal.dropped(result)
            self.journal.violated(result.violations)  # last: records before it are repeated harmlessly by a retry

        with self._lock:
            try:
                result = self.keeper.delete(body.blob_ids, body.holder, body.reason,
                                            commit=commit if self.journal is not None else None)
            except OSError as exc:
                raise _journal_failed("delete", exc) from None
            self._released(result)
        self._announce(result, node=body.node)
        self._report(result.violations)
        self._stale("delete", body.holder, result.reclaimed)
        if result.unknown:
            log.warning("delete.unknown", holder=body.holder, count=len(result.unknown), blob_ids=result.unknown[:8])
        return Deleted(blob_ids=[*result.deleted, *result.repeated], violations=[v.blob_id for v in result.violations],
                       missing=list(result.unknown), reclaimed=list(result.reclaimed))

    def _on_accounts(self, request: Message) -> Accounted:
        body = request.body
        assert isinstance(body, Accounts)
        with self._lock:
            # Under the lock no keep can queue an event between the flush and the count, and every other
            # event is published on this thread: the counters cover exactly the events up to ``seq``.
            self._flush_outbox()
            stats = self.keeper.stats()
            seq = self.runtime.publisher.seq if self.runtime.publisher is not None else 0
        return Accounted(store=self.runtime.node_id, seq=seq, kept=stats.kept_total, held=stats.blobs_held,
                         deleted=dict(stats.deleted), held_by=_largest(stats.held_by, body.holders),
                         reclaimed=_largest(stats.reclaimed, body.holders), violations=dict(stats.violations))

    def _on_holdings(self, request: Message) -> Held:
        body = request.body
        assert isinstance(body, HoldingsQuery)
        self._waited("holdings")  # what a rank took over is not listed as its orchestrator's
        limits = self.runtime.codec.limits
        # Records are small (references and lists), but a page of them must still fit a body and its item
        # bound with room to spare: a quarter of the smaller of the two, counted on each record encoded.
        budget = min(limits.max_body_bytes, limits.max_items) // 4
        episodes: list[HeldEpisode] = []
        cursor, more, size = body.after, False, 0
        with self._lock:
            for entry in self.keeper.holdings(body.holder, body.after):
                cost = len(_encode_record(entry.record))
                if episodes and (len(episodes) >= body.limit or size + cost > budget):
                    more = True
                    break
                episodes.append(HeldEpisode(episode=entry.record, held=list(entry.held),
                                            unclaimed=list(entry.unclaimed)))
                cursor, size = entry.position + 1, size + cost
        return Held(episodes=episodes, cursor=cursor, more=more)

    # --- timers and shutdown (loop thread) ----------------------------------------------------------

    def _deadlines(self) -> None:
        """The pass that ends hand-over leases and dead holders' graces. Time this store's loop did not run
        (stopped, swapped out, starved of CPU: the pass more than a period late) counts toward neither: the claims
        and returns of that time wait unread in its sockets, and judging on waking would delete what live holders
        claimed meanwhile (a soak that paused every process of a run for 4-10 s lost 180 blobs of a restarted
        orchestrator so). Logged ``store.stalled``, counted in ``refbus_env_server_stalled_seconds_total``."""
        stalled = self.passes.stall()
        if stalled:
            with self._lock:
                self.keeper.extend_deadlines(stalled)
            log.warning("store.stalled", seconds=round(stalled, 3), detail="leases and graces moved as much later")
        self._expire()
        self._reclaim()

    def _expire(self) -> None:
        with self._lock:
            try:
                result = self.keeper.expire(commit=self._journal_dropped())
            except OSError as exc:  # the leases end again at the next tick
                log.error("journal.commit_failed", action="expire", error=str(exc), detail="tried again next tick")
                return
            self._released(result)
        if result.deleted:
            log.warning("blobs.undelivered", count=len(result.deleted), lease_s=self.keeper.handover_lease_s)
            self._announce(result)

    def _reclaim(self) -> None:
        if not self._catch_up():  # a hand-over or a holder's return still to be made decides what is reclaimed
            return
        done: dict[str, DeleteResult] = {}  # the holders reclaimed, should a later one's commit fail

        def commit(holder: str, result: DeleteResult) -> None:
            self._commit_reclaim(holder, result)
            done[holder] = result

        with self._lock:
            try:
                self.keeper.reclaim(commit=commit)
            except OSError as exc:  # that holder's grace has ended still: reclaimed at the next tick
                log.error("journal.commit_failed", action="reclaim", error=str(exc), detail="tried again next tick")
            for result in done.values():
                self._released(result)
        for holder, result in done.items():
            if result.deleted:
                log.warning("blobs.holder_down", holder=holder, count=len(result.deleted),
                            grace_s=self.restart_grace_s)
                self._announce(result, node=holder)

    def _commit_reclaim(self, holder: str, result: DeleteResult) -> None:
        """Journal the end of ``holder``'s grace (durable stores): what it loses, then that it is settled. Under the
        lock, before the keeper deletes (:data:`~.keeper.Commit`)."""
        if self.journal is not None:
            self.journal.dropped(result)
            self.journal.holder_settled(holder)

    # --- liveness (loop thread) ---------------------------------------------------------------------

    def _on_node_down(self, down: NodeDown, info: NodeInfo | None) -> None:
        if info is not None:
            went_down: tuple[str, int, float] | None = incarnation(info)
        else:  # the registry entry is unknown here: the process that last took blobs here, if recorded
            went_down = self.journal.holders_seen.get(down.node_id) if self.journal is not None else None

        def change() -> None:
            if self._holder_down(down.node_id, went_down, journal=True):
                log.warning("holder.down", holder=down.node_id, reason=down.reason, grace_s=self.restart_grace_s)

        self._event_change("holder-down", change)

    def _holder_down(self, holder: str, went_down: tuple[str, int, float] | None, *, journal: bool,
                     claimed_again: Iterable[str] = (), grace_s: float | None = None,
                     taken: Sequence[str] = ()) -> bool:
        """``holder`` (its process ``went_down``, None when unknown) is down: unless it is back as that same
        process within the grace (``grace_s`` from now, by default ``restart_grace_s``; less for one this store
        resumes at its restart), what it holds here is reclaimed, except what its restarted incarnation claims
        again (``claimed_again``: what it did before this store restarted). A repeated report of the process
        recorded keeps its grace; one of another process (a restarted incarnation that died in the grace) starts
        the grace afresh (:meth:`Keeper.holder_down`). ``journal``: record a grace that starts, with its end,
        so a restart of this store resumes what is left of it; ``taken``: blobs its restarted incarnation took
        since this store's restart, journaled as claimed again in it. Journaled first: raises ``OSError`` with
        nothing changed when a record cannot be committed (a repeat of the call then commits them again). False
        when it holds nothing here."""
        grace_s = self.restart_grace_s if grace_s is None else grace_s

        def commit(started: bool) -> None:
            if self.journal is not None:
                if started and journal:
                    self.journal.holder_down(holder, went_down, grace_s)
                self.journal.claimed_back(taken, holder)

        with self._lock:
            if not self.keeper.holds(holder):
                return False
            self.keeper.holder_down(holder, grace_s, process=went_down, claimed_again=claimed_again, commit=commit)
        return True

    def _seen(self, holder: str, info: NodeInfo | None = None) -> None:
        """Journal the process ``holder`` is as it takes blobs here (``info``: its registry entry, by default
        the one this node tracks; unknown yet, its ``node-up`` records it). Under the keeper lock, durable
        stores only."""
        info = info or self._peers.live.get(holder)
        if info is not None and self.journal is not None and self.journal.holder_seen(holder, incarnation(info)):
            log.info("holder.seen", holder=holder, host=info.host, pid=info.pid)

    def _on_node_up(self, info: NodeInfo) -> None:
        self._event_change("holder-up", self._node_back(info))

    def _node_back(self, info: NodeInfo) -> Callable[[], None]:
        """The change a holder's ``node-up`` (``info``) makes: back as the process reported down (slow, not dead),
        it keeps what it holds; as another, it keeps what it claims again in the grace."""
        def change() -> None:
            with self._lock:
                if self.journal is not None and self.keeper.holds(info.node_id):
                    # A holder's new process is recorded at once, even in its grace: a restart of this store in
                    # the grace resumes it from the ``holder-down`` record, and after it (settled) knows the live
                    # process as the one that kept what it claimed again.
                    self._seen(info.node_id, info)

                def commit(back: bool) -> None:
                    if back and self.journal is not None:
                        self.journal.holder_back(info.node_id)

                back = self.keeper.holder_back(info.node_id, incarnation(info), commit=commit)
                restarted = not back and self.keeper.in_grace(info.node_id)
                # A new process that never claims back: the grace would spare nothing more, so it ends now.
                ended = self.keeper.end_grace(info.node_id, incarnation(info), commit=self._commit_reclaim) \
                    if restarted and claims_nothing_back(info) else None
                if ended is not None:
                    self._released(ended)
            if back:
                log.info("holder.back", holder=info.node_id)
            elif ended is not None and ended.deleted:
                log.warning("blobs.holder_replaced", holder=info.node_id, count=len(ended.deleted), pid=info.pid,
                            detail="a new process under its id, which claims nothing back: what the process reported "
                                   "down held is reclaimed now, not at the grace's end")
                self._announce(ended, node=info.node_id)
            elif restarted:  # it keeps what it claims again before the grace ends
                log.info("holder.restarted", holder=info.node_id)

        return change

    def _on_reference(self, message: Message) -> None:
        reference = message.body
        assert isinstance(reference, Reference)
        with self._lock:  # every store hears every hand-over: one of blobs never kept here changes nothing here
            blob_ids = self.keeper.known(reference.blob_ids)
        if not blob_ids:
            return
        # Only the rank's own event takes blobs for its restarted incarnation: the orchestrator repeats the
        # hand-over on the rank's answer, which may come after that rank died (see Keeper.hand_over).
        src = message.header.src
        by_holder = src == reference.holder
        holder, named = reference.holder, reference.process
        # For a hand-over to a process that is gone: that process, and what the holder's live process holds here
        late: list[tuple[tuple[str, int, float] | None, list[str]]] = []

        def commit(result: HandOverResult) -> None:
            assert self.journal is not None
            if result.moved and by_holder:
                self._seen(holder)
            self.journal.moved(result.moved, holder)
            self.journal.claimed_back(result.again, holder)  # a holder in its grace: kept
            if late and result.moved:
                self.journal.holder_down(holder, late[0][0], self.restart_grace_s)
                self.journal.claimed_back(late[0][1], holder)

        def change() -> None:
            late.clear()
            with self._lock:
                if not self.keeper.in_grace(holder) and (gone := self._gone_taker(holder, named)) is not None:
                    late.append(gone)
                result = self.keeper.hand_over(blob_ids, holder, by_holder=by_holder, publisher=src,
                                               commit=commit if self.journal is not None else None)
                if result.moved and late:
                    went_down, kept = late[0]
                    self.keeper.holder_down(holder, self.restart_grace_s, process=went_down, claimed_again=kept)
            if result.refused:
                self._references.rejected[THIRD_PARTY_HAND_OVER] += 1
                log.warning("reference.refused", src=src, holder=holder, step=reference.step,
                            blobs=len(result.refused), sample=list(result.refused[:4]),
                            detail="a hand-over published by neither its holder-to-be nor the blobs' holder here: "
                                   "nothing moved")
            if self._taken_unchecked is not None and result.again:
                self._taken_unchecked.setdefault(holder, set()).update(result.again)

        if named is not None and self._taken_unchecked is not None:
            # Whether the live holder is the process named, and what it holds here, is known once this restarted
            # store has checked its holders: made after that check, in order, claims and holdings refused till then.
            self._after_check.append(("reference", change, len(blob_ids)))
            self._weigh(len(blob_ids))
            return
        self._event_change("reference", change, len(blob_ids))

    def _gone_taker(self, holder: str, named: tuple[str, int, float] | None
                    ) -> tuple[tuple[str, int, float] | None, list[str]] | None:
        """For a hand-over to ``holder`` (``named``: the process that took it, None when not named) that is in no
        grace here: the process gone, whose grace starts with the hand-over, and what the holder holds here that the
        grace spares; None when the taker is live. Under the lock.

        A holder reported down already (the orchestrator's repeat of a dead rank's answer, or its own event, came
        late): the grace its node-down started nothing for, holding nothing then, or what moves would be held for
        good. A holder live as another process than the one named, or not live at all (the taker died while this
        store was dead: a restarted orchestrator or rank tells it again), likewise: the hand-over is to a process
        that is gone. What the live holder holds here is its own (a process that went before it was given its
        grace, here or at this store's restart check) and is spared. A named process this store has not seen
        register (its ``node-up`` still to come) is taken for gone too: coming up as that same process, it is back,
        and keeps everything. But only once a registry lookup of every role answered this store (at its start, or
        its restart's check of holders): before, a holder missing here may be live all the same, its node-up
        unheard, and is never judged gone on no answer."""
        if holder in self._peers.down:
            info = self._peers.down[holder]
            return named or (incarnation(info) if info is not None else None), []
        live = self._peers.live.get(holder)
        if named is None or (live is not None and incarnation(live) == named):
            return None
        if live is None and not self._peers.seeded:  # no registry answer yet: never judged gone on none
            return None
        return named, self.keeper.claimed().get(holder, []) if live is not None else []

    def _event_change(self, action: str, change: Callable[[], None], weight: int = 1) -> None:
        """Make ``change`` (``action``, for the log), which an event asks for: after those still waiting, in the
        order the events came (a hand-over before its holder's down, say). One whose journal records cannot be
        committed (a full tmpfs) raises ``OSError`` having changed nothing, and waits: an event cannot be answered
        ``journal-failed``, and dropped, its change would be lost (blobs a rank took would stay the orchestrator's,
        a holder's grace would never start or never end). ``weight``: the blob ids it names. Loop thread."""
        self._wait(action, change, weight)
        self._catch_up()

    def _wait(self, action: str, change: Callable[[], None], weight: int = 1) -> None:
        """Queue ``change`` behind the changes still waiting (see :meth:`_event_change`)."""
        self._waiting.append((action, change, weight))
        self._weigh(weight)

    def _weigh(self, weight: int) -> None:
        """Count ``weight`` more blob ids waiting; past :data:`WAITING_MAX` the node ends as a crash would."""
        self._waiting_weight += weight
        if self._waiting_weight > WAITING_MAX and not self.abandoned:
            behind = "this restarted store's check of its holders (the registry not answering)" \
                if self._after_check else "journal records that cannot be committed (free room in its tmpfs)"
            self.abandoned = (f"{self._waiting_weight} blob ids of changes wait for {behind}, at most {WAITING_MAX}: "
                              "the store is kept for this node's restarted process, which learns those changes again")
            log.critical("journal.waiting_overflow", waiting=len(self._waiting) + len(self._after_check),
                         weight=self._waiting_weight, detail=self.abandoned)
            self.runtime.stop()

    def _catch_up(self) -> bool:
        """Make the changes events asked for that are still waiting, in order, up to the first whose journal
        records still cannot be committed (tried again at the next reclaim tick); True when none is left."""
        while self._waiting and not self.abandoned:
            action, change, weight = self._waiting[0]
            try:
                change()
            except OSError as exc:  # nothing changed: the same change is made again later
                log.error("journal.commit_failed", action=action, waiting=len(self._waiting), error=str(exc),
                          detail="tried again next tick")
                return False
            self._waiting.popleft()
            self._waiting_weight -= weight
        return not self._waiting

    def _waited(self, action: str) -> None:
        """Before a request whose answer depends on the changes events asked for (who holds what, who is down):
        make those still waiting, or refuse it ``journal-failed`` (``retry_after_s``: the caller sends it again),
        as while hand-overs wait for this restarted store's check of its holders (the registry's answer, due
        within the request's retries)."""
        if not self._catch_up():
            raise _journal_failed(action, OSError(f"{len(self._waiting)} earlier changes wait for room"))
        if self._after_check:
            raise _journal_failed(action, OSError(f"{len(self._after_check)} hand-overs wait for this restarted "
                                                  "store's check of its holders"))

    def _journal_dropped(self) -> Callable[[DeleteResult], None] | None:
        """What commits the store's own deletes (:data:`~.keeper.Commit`; None without a durable store)."""
        return self.journal.dropped if self.journal is not None else None

    def _released(self, result: DeleteResult) -> None:
        """The segments of deletes the keeper made go (durable stores). Under the lock."""
        if self.journal is not None:
            self.journal.released(result)

    def _compact(self) -> None:
        with self._lock:
            if self.journal is not None and self.journal.compact_due(self.keeper):
                self.journal.compact(self.keeper)

    def _shutdown(self) -> None:
        if self.abandoned:  # as a crash would: nothing deleted, the store left for the restarted process
            with self._lock:
                if self.journal is not None:
                    self.journal.close(remove=False)
            if self.runtime.publisher is not None:
                self._flush_outbox()  # what was made before the end (a discard's delete) is told
            return
        with self._lock:
            result = self.keeper.close()
            if self.journal is not None:  # everything is deleted: nothing is left to re-adopt
                self.journal.close(remove=True)
        if self.runtime.publisher is None:
            if result.deleted:
                log.warning("blobs.shutdown_unannounced", count=len(result.deleted), detail="never joined")
            return
        self._flush_outbox()
        if result.deleted:
            log.info("blobs.shutdown", count=len(result.deleted))
            self._announce(result)

    # --- events -------------------------------------------------------------------------------------

    def _post(self, body: Body) -> None:
        """Publish from any thread: queue it and let the loop thread send it."""
        self._outbox.append(body)
        self.runtime.call_soon(self._flush_outbox)

    def _flush_outbox(self) -> None:
        while self._outbox:
            body = self._outbox.popleft()
            try:
                self.runtime.publish(body)
            except Exception:
                # Only a framework's ``info`` can fail to encode; the blobs stay kept and expire unclaimed.
                log.exception("event.publish_failed", kind=body.kind)

    def _publish(self, body: Body) -> None:
        self._flush_outbox()
        self.runtime.publish(body)

    def _announce(self, result: DeleteResult, *, node: str = "") -> None:
        if result.deleted:
            self._publish(Delete(blob_ids=list(result.deleted), holder=result.holder, reason=result.reason,
                                 node=node))

    def _stale(self, action: str, holder: str, reclaimed: Sequence[str]) -> None:
        if reclaimed:
            log.warning("request.stale", action=action, holder=holder, count=len(reclaimed), blob_ids=reclaimed[:8],
                        detail="reclaimed from a holder that went down")

    def _report(self, violations: Sequence[Violation]) -> None:
        """Log and publish one request's violations (one per refused id, already counted and journaled) as one
        event per (action, holder, owner)."""
        for violation in summarize(violations):
            log.warning("ownership.violation", blob_id=violation.blob_id, count=violation.count,
                        sample=violation.sample, action=violation.action, holder=violation.holder,
                        owner=violation.owner, detail=violation.detail)
            self._publish(violation)

    # --- metrics ------------------------------------------------------------------------------------

    def _register_metrics(self) -> None:
        def read(values: Callable[[KeeperStats], Readings]) -> Callable[[], Readings]:
            return lambda: values(self.stats())

        self.runtime.metric("refbus_blobs_held", "Blobs this env server holds.",
                            read(lambda s: {(): float(s.blobs_held)}), kind="gauge")
        self.runtime.metric("refbus_blob_bytes_held", "Bytes this env server holds against env_server.budget_bytes "
                            "(blobs in whole pages plus a per-blob overhead, and episode infos).",
                            read(lambda s: {(): float(s.bytes_held)}), kind="gauge")
        self.runtime.metric("refbus_env_server_fill_ratio", "Bytes held over env_server.budget_bytes.",
                            read(lambda s: {(): s.bytes_held / self.keeper.budget_bytes}), kind="gauge")
        self.runtime.metric("refbus_env_server_high_water_ratio",
                            "env_server.high_water: from this fill on, the store takes no new runs.",
                            lambda: {(): self.high_water}, kind="gauge")
        self.runtime.metric("refbus_env_server_stalled_seconds_total",
                            "Seconds this env server's deadline pass came late (its loop stopped, swapped out or "
                            "starved of CPU); counted toward no hand-over lease nor holder's grace.",
                            lambda: {(): self.passes.stalled_s})
        self.runtime.metric("refbus_blobs_kept_total", "Blobs kept (one per branch).",
                            read(lambda s: {(): float(s.kept_total)}))
        # The series alerts watch exist from the start at 0: increase() over a series that first appears at
        # 1 sees no increase, so a first violation or reclaim would never alert.
        self.runtime.metric("refbus_blobs_deleted_total", "Blobs deleted, by reason.",
                            read(lambda s: {(r,): float(n) for r, n in {HOLDER_DOWN: 0, **s.deleted}.items()}),
                            labels=("reason",))
        self.runtime.metric("refbus_ownership_violations_total", "Ownership violations refused, by action.",
                            read(lambda s: {(a,): float(s.violations.get(a, 0)) for a in VIOLATION_ACTIONS}),
                            labels=("action",))
        if self.readoption is not None:
            found = self.readoption
            self.runtime.metric("refbus_store_readopted_blobs",
                                "Blobs this env server's durable store held at its start, by what became of them: "
                                "readopted, lost (failed verification or over budget) or aborted (never committed).",
                                lambda: {("readopted",): float(found.blobs), ("lost",): float(len(found.lost)),
                                         ("aborted",): float(found.aborted)}, labels=("state",), kind="gauge")
        self.runtime.metric("refbus_stale_requests_total",
                            "Blob ids of claims, fetches and deletes answered reclaimed (reclaimed from a holder "
                            "that went down), by action.",
                            read(lambda s: {(action,): float(n) for action, n in s.stale.items()}),
                            labels=("action",))


def _journal_failed(action: str, exc: OSError) -> HandlerError:
    """The answer to a request whose journal records could not be committed (a full tmpfs, an I/O error): the
    keeper changed nothing, so the same request may succeed when sent again (``retry_after_s``: the reply cache
    keeps no such answer, and a retry under the same id runs again)."""
    log.error("journal.commit_failed", action=action, error=str(exc))
    return HandlerError("journal-failed", f"the store could not journal this {action}, nothing changed: {exc}; "
                        f"send it again after {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S)


def _encode_record(record: EpisodeFinished) -> bytes:
    """The record's msgpack body; arrays in ``info`` count nothing here (they travel as frames, outside the
    body and its bounds)."""
    return msgspec.msgpack.encode(record, enc_hook=lambda obj: 0)


def _largest(counts: Mapping[str, int], limit: int) -> dict[str, int]:
    """The ``limit`` largest entries of ``counts``; when there are more, the rest summed under ``*``."""
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    kept = dict(ranked[: limit - 1] if len(ranked) > limit else ranked)
    rest = sum(n for _, n in ranked[len(kept):])
    return {**kept, "*": rest} if rest else kept


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node env-server``: keep, serve and run episodes until SIGINT/SIGTERM. Raises
    :class:`~..config.ConfigError` (final: exit status 2) for a budget, lease, entry point or store that cannot be
    used, :class:`~..store.durable.StoreLocked` (exit 1: restarted) for a store another live process holds,
    :class:`~..entry_points.UserCodeFailed` (exit 1, a crash: restarted) for an entry point whose module raised
    at import."""
    runtime = NodeRuntime(ROLE, config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    env_server: EnvServer | None = None
    try:
        env_server = EnvServer(runtime, config.env_server, restart_grace_s=config.node.restart_grace_s,
                               store=config.store, run=config.store_run())
        EpisodeRunner(runtime, env_server, config.env_server)
    # Can clear by itself, status 1, restarted: a store its predecessor, not yet dead, may hold (cli says so) until
    # that exits; an entry point's module whose own code raised at import (a crash: its traceback).
    except (StoreLocked, UserCodeFailed):
        _close_unstarted(runtime, env_server)
        raise
    except (ValueError, StoreError) as exc:  # a budget, lease, entry point or store that cannot be used
        log.error("env_server.bad_config", error=str(exc))
        _close_unstarted(runtime, env_server)
        raise ConfigError(str(exc)) from None  # final: said last on stderr (cli), exit status 2
    runtime.run()
    return 1 if env_server.abandoned else 0  # logged journal.waiting_overflow: restartable, as a crash


def _close_unstarted(runtime: NodeRuntime, env_server: EnvServer | None) -> None:
    """Close a node that failed before it ran, keeping its journal: no shutdown, so a restart (with the config
    fixed, or once what failed cleared) re-adopts what it holds."""
    if env_server is not None and env_server.journal is not None:
        env_server.journal.close(remove=False)
    runtime.close()
