"""The ps-manager role (``refbus node ps-manager``): the parameter server's control plane.

It owns versions and their manifests (:mod:`.versions`), leases (:mod:`.leases`), the worker registry, the
staleness inventory (:mod:`.staleness`) and broadcast init coordination (:class:`.broadcast.InitRound`).
Tensor bytes never pass through it: it hands out placements and leases, records the shards workers verified,
and tells workers when a shard's memory may be recycled.

Requests (see :mod:`refbus.protocol.messages_ps`): ``ps-register``, ``ps-push-begin``, ``ps-shard-commit``
(from workers), ``ps-pull-begin``, ``ps-lease-renew``, ``ps-lease-release``, ``ps-manifest``, ``ps-status``,
``ps-init`` (+ ``ps-init-done``/``ps-init-failed`` from workers), ``ps-reserve``, ``ps-occupy``,
``ps-consume``, ``ps-abort``, ``ps-inventory``. Event: ``version-bump`` after every commit, never before.

Lineages: a push that declares it resumes (``PushBegin.resumes``: a trainer world restarted from its checkpoint
of step ``K`` pushes ``K`` first) starts a new lineage: a push of the old world still pending is aborted, the
old versions ``>= K`` are retired (readers' leases on them run out normally), and ``K``, ``K+1``, ... of the
new world commit without a conflict (:mod:`.versions`). The ``version-bump`` of the new ``K`` tells readers
the version went back. A resuming push joins the pending version of the new lineage that another rank began,
unless both name a trainer world token and they differ (that version is a dead world's: it is aborted).

Staleness inventory: a commit of ``V`` moves its trainer version up to ``V`` when it is behind (a trainer
that does not consume through it); a new lineage at ``K`` rewinds it to ``K`` (docs/STALENESS.md). The batch
the last ``consume`` handed out is answered again to a retry of that request or to a consume naming its
buffer, restarts included (it is journaled with the trainer version it moved): a reply lost with the process
does not leave the trainer with ``out-of-order`` and the batch gone.

Replicas: a push grant names ``ps.replicas`` workers (capped to the live ones), the pusher writes a copy to
each, and the version commits only once every copy is verified. A rank whose attempt fails on a worker asks
again (``PushBegin.retry``) and starts over on other workers; the version stays pending. The workers it could
not reach (``PushBegin.avoid``) are not granted again while registered as a process its attempts were granted
(recorded on their push leases): one restarted since is another process, and is granted again.

Restarts: with ``store.durable`` every commit, lineage start, consumed batch, rank of the pending version
done (and its replacement by a retry) and aborted push is committed to a journal (:mod:`.manager_journal`)
before anyone hears of it. A process restarted under the same node id replays it and comes back with the
versions it retained, the batch last handed out and the pending version's done ranks (their pushers have
returned; the other ranks start over and the version commits); the workers, told of the new process by the
bus, register again listing the segments they hold, and a version is served only from copies a registered
worker listed (or committed since). Attempts still being written, leases, reservations and an init round of
the dead process are unknown to the new one: a
commit or retry under such a push lease is refused ``push-aborted``, a release of such a lease
``unknown-lease``, both naming the restart (``leases.RESTARTED``; the pusher starts its push over on it), a
renewal lists it expired, a reservation is ``unknown-reservation``, and an init's request, which its client
sends again, is answered afresh. A reader may still read under a lease of the dead process, so a restarted
manager releases nothing for one lease TTL: what is to be released meanwhile (retention, orphans the workers
list) goes out once it has passed. Without a journal the restart shows in the workers' registrations (shards
this process never made: push leases it never granted, broadcast inits it never ran), and the same hold
applies from then on. A begin of
a rank of the pending version by the holder whose attempt of that rank is still being written replaces that
attempt, as a retry (a begin sent while this process was away, granted late with nobody reading the grant);
so does its begin of a rank restored done (it never heard the dead process's answer). A begin that resumes
does either, and joins a pending version with ranks restored done, only when it names the trainer world token
of those ranks (``PushBegin.world_token``: the same world, its push started over); otherwise it starts its
lineage afresh, since the world that pushed them may be gone.

Liveness: a timer expires leases (an expired pull lease unpins its version; an expired push lease aborts the
version being pushed), pushes past ``push_timeout_s``, leased staleness reservations, and overdue inits.
A ``node-down`` of a worker removes it: it is never granted again, pull grants leave its copies out (a pull
of a version with a tensor whose every copy is down fails at once, naming the workers), a pending push with
a rank whose every verified copy was there is aborted, and an init it takes part in fails. A worker that
registers again without a done rank's copy (restarted without its store) aborts that pending push the same
way when no registered worker holds another copy: the node-down of its earlier process may come later, and is
then ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

import msgspec
import structlog

from ...bus.peers import incarnation
from ...bus.reqrep import HandlerError, Outcome, PeerDown, Pending, RemoteError, RequestTimeout
from ...bus.runtime import NodeRuntime
from ...bus.sockets import connect_problem
from ...bus.stall import PassStalls
from ...protocol.envelope import Message
from ...protocol.messages import Body, Error, NodeDown, NodeInfo, Ok, VersionBump, id_problem
from ...protocol.messages_ps import (
    Abort,
    Aborted,
    Batch,
    BatchEntry,
    Committed,
    Consume,
    InitDone,
    InitFailed,
    InitPlan,
    InitRequest,
    InitResult,
    InventoryBuffer,
    InventoryQuery,
    InventoryState,
    LeaseRelease,
    LeaseRenew,
    LeaseState,
    Location,
    Manifest,
    ManifestEntry,
    ManifestInfo,
    ManifestQuery,
    Occupy,
    Placed,
    PsRegister,
    PsState,
    PsStatus,
    PullBegin,
    PullGrant,
    PushBegin,
    PushGrant,
    Release,
    Reserve,
    Reserved,
    ShardCommit,
    WorkerInfo,
)
from ..config import Config, ConfigError
from ..settings import PsSettings
from ..store.durable import DurableStore, StoreError, StoreLocked
from . import manifest as mf
from .broadcast import InitRound, rounds
from .leases import RESTARTED, Lease, LeaseTable
from .manager_journal import HandedOut, ManagerJournal
from .manifest import ManifestError
from .staleness import CloseReport, StalenessError, StalenessInventory
from .versions import Shard, VersionStore

log = structlog.get_logger(__name__)

INIT_RUNNING_RETRY_S = 1.0  # a push refused while a broadcast init runs may ask again after this long
RELEASE_ATTEMPTS = 4  # sends of a release that a live worker did not answer or refused, the first included
RELEASE_AGAIN_S = 1.0  # the pause before the first resend of such a release, doubling after each
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _error_code(exc: StalenessError) -> str:
    """``VersionAbortedError`` -> ``version-aborted``: the inventory's error classes name the codes."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", type(exc).__name__.removesuffix("Error")).lower()


@dataclasses.dataclass
class _Resend:
    """A release to send again at ``due``: its ``attempt``-th send failed while ``info`` was registered."""

    due: float
    info: WorkerInfo
    shards: list[str]
    attempt: int


def _same_process(worker: WorkerInfo, node: NodeInfo) -> bool:
    """Whether registry entry ``node`` is the process that registered as ``worker`` (:func:`bus.peers.incarnation`:
    host, pid, start time). A worker that names no pid (older than this field) is taken to be it."""
    if not worker.pid:
        return True
    started = worker.started or node.started  # an older worker names no start time: host and pid decide
    return incarnation(node) == (worker.host, worker.pid, started)


class PsManager:
    """The control plane on ``runtime`` (which must join the bus: commits are published). With ``journal`` its
    durable decisions are committed there, and what an earlier process committed is replayed first (raises
    StoreError for a journal that is not one)."""

    def __init__(self, runtime: NodeRuntime, settings: PsSettings, *, journal: ManagerJournal | None = None) -> None:
        if settings.replicas < 1:
            raise ValueError(f"ps.replicas must be >= 1, got {settings.replicas}")
        self.runtime = runtime
        self.settings = settings
        self.versions = VersionStore(settings.retain_versions)
        self.leases = LeaseTable(settings.lease_ttl_s)
        self.inventory: StalenessInventory[str] = StalenessInventory(settings.eta, settings.batch_size)
        self.journal = journal
        # The batch the last consume handed out: a retry of that consume, or another naming its buffer, gets it
        # again (after a restart its reply may never have left; the inventory is past it).
        self._handed_out: HandedOut | None = None
        if journal is not None:
            recovered = journal.replay(self.versions, time.monotonic())
            if recovered.trainer_version >= 0:
                self.inventory.advance(recovered.trainer_version)
            self._handed_out = recovered.handed_out
            if recovered.records:
                pending = self.versions.pending
                log.info("ps.manager_recovered", versions=recovered.versions, latest=self.versions.latest,
                         trainer_version=self.inventory.trainer_version, records=recovered.records,
                         pending=pending.version if pending else None,
                         ranks_done=sorted(pending.ranks) if pending else [])
            runtime.shutdown_hooks.append(lambda: journal.close(remove=True))  # a clean stop: nothing to come back to
        self.workers: dict[str, WorkerInfo] = {}
        # Worker -> segment -> its shard id ("" when its registration named none): the segments it holds, listed
        # at its registration, plus the copies it committed since, less the shards released to it since. A copy
        # is served only from there (a worker restarted without its store, or this manager restarted, must not
        # send readers to copies nobody holds).
        self.held: dict[str, dict[str, str]] = {}
        # Workers reported down since they last registered: only they have lost their copies for sure. Any other
        # unregistered worker (after a restart of this manager, one that has not registered again yet) may still
        # hold its copies.
        self._gone: set[str] = set()
        # After a restart (its store was there already) a reader may still hold a lease of the earlier process:
        # what that lease reads may be released only once the lease would have expired.
        # Without a journal a restart shows only in the workers' registrations (see _register).
        restarted = journal is not None and not journal.store.fresh
        self._started = time.monotonic()
        self._releases_from = self._started + settings.lease_ttl_s if restarted else 0.0
        self._held_back: list[Shard] = []
        self.init: InitRound | None = None
        self._inits_here: set[str] = set()  # ids of the inits this process ran (a few per run: never pruned)
        self._init_waiting: list[Pending] = []
        self._init_answers: OrderedDict[str, Body] = OrderedDict()  # ps-init request id -> its answer

        server = self.server = runtime.serve("ps", settings.manager)
        routes: dict[str, Callable[[Message], Body | None]] = {
            PsRegister.kind: self._register,
            PushBegin.kind: self._push_begin,
            ShardCommit.kind: self._shard_commit,
            PullBegin.kind: self._pull_begin,
            LeaseRelease.kind: self._lease_release,
            Reserve.kind: self._reserve,
            Occupy.kind: self._occupy,
            Consume.kind: self._consume,
            Abort.kind: self._abort,
            InitDone.kind: self._init_done,
            InitFailed.kind: self._init_failed,
        }
        for kind, handler in routes.items():
            server.on(kind, handler)
        # Reads and idempotent renewals; ps-init answers late and remembers its answers itself.
        for kind, handler in ((LeaseRenew.kind, self._lease_renew), (ManifestQuery.kind, self._manifest),
                              (PsStatus.kind, self._status), (InventoryQuery.kind, self._inventory),
                              (InitRequest.kind, self._init)):
            server.on(kind, handler, cached=False)
        peers = runtime.track_peers()
        peers.on_down(self._node_down)
        peers.on_up(self._node_up)
        # Shards whose release ended PeerDown while the same worker process stayed registered: a node-down of
        # its earlier process marked its fixed endpoint down meanwhile. Sent again at its node-up.
        self._unreleased: dict[str, list[str]] = {}
        # Releases a worker's registered process did not answer in time or refused: sent again from _expire.
        self._resends: list[_Resend] = []
        # The expiry passes' period and stalls: time no renewal could be read (see _credit_stall).
        self.passes = PassStalls(min(0.25, settings.lease_ttl_s / 4))
        runtime.every(self.passes.period_s, self._expire)
        runtime.status = lambda: {"version": float(self.versions.latest), "leases": float(len(self.leases)),
                                  "workers": float(len(self.workers))}
        self._metrics()

    # --- registry -----------------------------------------------------------------------------------

    def _register(self, request: Message) -> Body:
        assert isinstance(request.body, PsRegister)
        info = request.body.worker
        # Pushers, pullers and this manager connect to the endpoint a registration names, and name the worker in
        # logs, grants and manifests: one that is no address (a port over 65535 ZeroMQ takes modulo 65536) or no
        # node id is refused before anyone is sent there.
        if problem := id_problem(info.worker, "worker id"):
            raise HandlerError("schema", f"ps-register.worker.worker: {problem}")
        if problem := connect_problem(info.endpoint):
            raise HandlerError("schema", f"ps-register.worker.endpoint: {problem}")
        self.workers[info.worker] = info
        self._gone.discard(info.worker)
        held = self.held[info.worker] = {segment: request.body.shards.get(segment, "")
                                         for segment in request.body.segments}
        log.info("ps.worker_joined", worker=info.worker, endpoint=info.endpoint, host=info.host,
                 segments=len(request.body.segments))
        # A worker restarted under its id serves the shards it re-adopted from its durable store; a version
        # with a copy on it that it no longer holds has lost that copy: say which.
        lost = [v for v in self.versions.retained() if any(
            loc.worker == info.worker and loc.segment not in held
            for entry in self.versions.manifest(v).entries for loc in entry.locations)]
        if lost:
            log.error("ps.versions_lost_on_worker", worker=info.worker, versions=lost)
        # The registration proves the worker live: an endpoint a node-down of its earlier process marked down
        # (a fixed port) takes requests again before its node-up arrives.
        self.runtime.calls.mark_up(info.endpoint)
        # The node-down of its earlier process may come after this registration and is then ignored (see
        # _node_down): a done rank's copy it lost must be judged here.
        self._abort_if_copies_lost(info.worker, "registered again without its copy")
        # Shards it re-adopted that nothing needs any more (their release was lost while it was down): release
        # them now, or they would stay in its store for good.
        needed = self.versions.shards_on(info.worker)
        if self.init is not None and info.worker in self.init.names:
            needed.add(self.init.init_id)
        orphans = sorted({shard for segment, shard in request.body.shards.items()
                          if segment in held and shard not in needed})
        if orphans:
            self._release_orphans(info.worker, orphans)
        return Ok()

    def _release_orphans(self, worker: str, orphans: list[str]) -> None:
        """Release shards ``worker`` holds that nothing here needs."""
        # A shard this process never made (a push lease it never granted, an init it never ran): an earlier
        # manager process may have made it (this one may not know it restarted: it has no journal without
        # store.durable), and committed it as a version. A reader under that process's lease may read it for one
        # lease TTL after its death: hold every release until then, as a known restart does.
        foreign = [shard for shard in orphans if not self.leases.granted_here(shard) and shard not in self._inits_here]
        hold_until = self._started + self.settings.lease_ttl_s
        if foreign and self._releases_from < hold_until and time.monotonic() < hold_until:
            self._releases_from = hold_until
            log.warning("ps.restart_inferred", worker=worker, shards=len(foreign),
                        releases_from_s=round(hold_until - time.monotonic(), 3))
        log.warning("ps.orphans_released", worker=worker, shards=orphans)
        self._release([(worker, shard) for shard in orphans])

    def _send(self, worker: str, body: Body, on_done: Callable[[Outcome], None], *,
              deadline_s: float | None = None) -> None:
        """An asynchronous request to a registered worker (``runtime.calls``): ``on_done`` gets its outcome."""
        info = self.workers.get(worker)
        if info is None:
            log.warning("ps.worker_gone", worker=worker, kind=body.kind)
            return
        self.runtime.calls.request(info.endpoint, body, on_done, deadline_s=deadline_s)

    def _released(self, worker: str, ids: list[str], info: WorkerInfo | None, attempt: int,
                  outcome: Outcome) -> None:
        """The outcome of the ``attempt``-th send of a release of ``ids`` to ``info``, the process of ``worker``
        registered when it was sent. Unless that process is no longer the registered one (another process's
        registration releases what it re-adopted; a worker down holds nothing), a failed release is sent again:
        at that process's node-up after PeerDown, else from the timer up to ``RELEASE_ATTEMPTS`` sends in all,
        since the segments stay in use on the worker until it is told."""
        if isinstance(outcome, Message):
            return
        registered = info is not None and self.workers.get(worker) is info
        if isinstance(outcome, PeerDown) and registered:
            self._unreleased.setdefault(worker, []).extend(ids)  # see __init__: sent again at its node-up
            return
        if registered and attempt < RELEASE_ATTEMPTS:
            assert info is not None
            pause = RELEASE_AGAIN_S * 2 ** (attempt - 1)
            self._resends.append(_Resend(time.monotonic() + pause, info, ids, attempt))
            log.warning("ps.release_failed", worker=worker, shards=ids, error=str(outcome), attempt=attempt,
                        again_in_s=pause)
            return
        log.warning("ps.release_failed", worker=worker, shards=ids, error=str(outcome), attempt=attempt)

    def _release(self, shards: list[Shard]) -> None:
        if shards and time.monotonic() < self._releases_from:  # see __init__: sent once a lease TTL passed
            self._held_back += shards
            return
        by_worker: defaultdict[str, list[str]] = defaultdict(list)
        # Each shard once: releases held back (or lost to a node-down) add up, and a worker that registers twice
        # in that time lists its orphans twice.
        for worker, shard in dict.fromkeys(shards):
            by_worker[worker].append(shard)
        for worker, ids in by_worker.items():
            self._send_release(worker, ids, 1)

    def _send_release(self, worker: str, ids: list[str], attempt: int) -> None:
        """Send the ``attempt``-th release of ``ids`` to ``worker``, which no longer counts as holding them: nothing
        is served from a released shard, answered or not (a worker that missed it lists it at its next
        registration, and is told again)."""
        held = self.held.get(worker, {})
        released = set(ids)
        # By shard id, not segment name: a name the worker reused since for a live shard stays held.
        for segment in [segment for segment, shard in held.items() if shard in released]:
            del held[segment]
        info = self.workers.get(worker)
        self._send(worker, Release(ids), lambda outcome: self._released(worker, ids, info, attempt, outcome))

    def _node_up(self, node: NodeInfo) -> None:
        """A worker's node-up: the releases that ended PeerDown while this very process was registered go again."""
        info = self.workers.get(node.node_id)
        if info is not None and _same_process(info, node) and (ids := self._unreleased.pop(node.node_id, None)):
            self._release([(node.node_id, shard) for shard in ids])

    def _node_down(self, down: NodeDown, last: NodeInfo | None) -> None:
        """A worker reported down (its pending and new requests fail at once: the runtime's peer view).

        A worker registers before its runtime joins the bus, so the ``node-down`` of the process it replaced
        under the same id (``replaced``, or a ``timeout`` that came late) may arrive after the new one
        registered: news of another process than the registered one (``last``, the entry the event is about)
        changes nothing."""
        info = self.workers.get(down.node_id)
        if info is None:  # not registered since this manager started: its copies are gone now
            self._gone.add(down.node_id)
            self._abort_if_copies_lost(down.node_id, f"went down ({down.reason}) before it registered again")
            return
        if last is not None and not _same_process(info, last):
            log.info("ps.worker_down_of_earlier_process", worker=down.node_id, reason=down.reason,
                     down_pid=last.pid, registered_pid=info.pid)
            return
        del self.workers[down.node_id]
        self._gone.add(down.node_id)
        self.held.pop(down.node_id, None)
        self._unreleased.pop(down.node_id, None)  # a later process's registration releases what it re-adopted
        lost = [v for v in self.versions.retained() if self._dead_copies(self.versions.manifest(v))]
        (log.error if lost else log.warning)("ps.worker_down", worker=down.node_id, reason=down.reason,
                                             versions_lost=lost)
        if self.init is not None and down.node_id in self.init.names:
            self._fail_init(down.node_id, f"went down ({down.reason}) during the broadcast")
        self._abort_if_copies_lost(down.node_id, f"went down ({down.reason})")

    def _abort_if_copies_lost(self, worker: str, how: str) -> None:
        """Abort the pending version when ``worker`` lost its copy of a rank whose every copy was verified (it
        went down, or registered again without the copy: ``how``) and no other copy of that rank may still be
        held: none on a registered worker that holds it, none on a worker that has not registered since this
        manager started and was not reported down (it may register with it). That rank's pusher has returned
        and never writes it again, so the version would commit with a tensor nobody can read. A copy still being
        written is the pusher's to retry elsewhere, and a done rank that keeps a copy has its answer: it lost
        one copy as a committed version would."""
        pending = self.versions.pending
        if pending is None:
            return
        lost = [rank for rank, r in pending.ranks.items()
                if r.done and worker in r.segments and not any(self._may_hold(w, s) for w, s in r.segments.items())]
        if lost:
            self._abort_push(pending.version, f"worker {worker} {how}: it held the last verified copy of "
                             f"rank(s) {lost}")

    def _may_hold(self, worker: str, segment: str) -> bool:
        """Whether ``worker`` holds ``segment``, or may: unregistered and not reported down since it last
        registered (this manager restarted, and it has not registered again yet)."""
        return self._holds(worker, segment) or (worker not in self.workers and worker not in self._gone)

    def _holds(self, worker: str, segment: str) -> bool:
        """Whether ``worker`` is registered and holds ``segment`` (listed at its registration or committed since)."""
        return worker in self.workers and segment in self.held.get(worker, ())

    def _serves(self, location: Location) -> bool:
        """Whether a registered worker holds the copy at ``location``."""
        return self._holds(location.worker, location.segment)

    def _dead_copies(self, manifest: Manifest) -> dict[str, list[str]]:
        """Tensor -> its copies' workers, for each tensor with no copy a registered worker holds."""
        return {e.name: [loc.worker for loc in e.locations] for e in manifest.entries
                if e.locations and not any(self._serves(loc) for loc in e.locations)}

    def _live_copies(self, manifest: Manifest) -> Manifest:
        """The manifest narrowed to copies on live workers (a pull never reads from a worker known down), each
        worker as registered now. Raises HandlerError(``copies-down``) naming the workers when some tensor has no
        live copy left."""
        dead = self._dead_copies(manifest)
        if dead:
            workers = sorted({w for names in dead.values() for w in names})
            raise HandlerError("copies-down", f"version {manifest.version}: every copy of {len(dead)} tensor(s) "
                               f"(e.g. {next(iter(dead))!r}) is on a worker that is down or no longer holds it: "
                               f"{workers}")
        # Each worker as registered now, not as the manifest recorded it at the commit: one restarted under its
        # id re-adopted its shards but serves them on a new endpoint and proves its host with a new nonce, and a
        # reader sent to the dead process's endpoint would find no copy there. Every worker a served copy names,
        # not only those the manifest lists: a worker down at the commit (after it verified its copy) is left
        # out of the manifest's workers, yet serves that copy once it registers again.
        served = [[loc for loc in e.locations if self._serves(loc)] for e in manifest.entries]
        workers = [self.workers[w] for w in sorted({loc.worker for locations in served for loc in locations})]
        if all(len(locations) == len(e.locations) for e, locations in zip(manifest.entries, served, strict=True)):
            return manifest if workers == manifest.workers else msgspec.structs.replace(manifest, workers=workers)
        entries = [msgspec.structs.replace(e, locations=locations)
                   for e, locations in zip(manifest.entries, served, strict=True)]
        return msgspec.structs.replace(manifest, entries=entries, workers=workers)

    # --- push ---------------------------------------------------------------------------------------

    def _pick_workers(self, host: str, rank: int, avoid: set[str]) -> list[WorkerInfo]:
        """``ps.replicas`` live workers (fewer if fewer live), none in ``avoid``: the first on the pusher's
        host when there is one (its writes go through shared memory), the others in turn after it."""
        live = sorted((w for w in self.workers.values() if w.worker not in avoid), key=lambda w: w.worker)
        if not live:
            detail = f"all are down or unreachable by the pusher: {sorted(avoid)}" if avoid else "none is registered"
            raise HandlerError("no-workers", f"no ps-worker to push to ({detail})")
        local = [w for w in live if w.host == host]
        first = (local or live)[rank % len(local or live)]
        start = live.index(first)
        return (live[start:] + live[:start])[: self.settings.replicas]

    def _push_begin(self, request: Message) -> Body:
        begin = request.body
        assert isinstance(begin, PushBegin)
        if self.init is not None:  # the init commits the next version: a push of it would commit it twice
            raise HandlerError("init-running", f"broadcast init {self.init.init_id} of {self.init.path} is loading "
                               f"version {self.versions.next_version()}; push again once it ended",
                               retry_after_s=INIT_RUNNING_RETRY_S)
        retry = begin.retry or self._given_up(begin)
        tried = self._tried(retry)
        avoid = self._avoided(begin.avoid, tried)
        workers = self._pick_workers(begin.host, begin.rank, avoid)
        names = [w.worker for w in workers]
        if begin.resumes and not retry and not self.versions.joins_lineage(begin.version, begin.world,
                                                                            begin.world_token):
            try:  # a request refused must not have retired the old lineage's versions first
                self.versions.check_specs(begin.rank, begin.world, begin.tensors, lineage_at=begin.version)
            except ManifestError as exc:
                raise HandlerError(exc.code, str(exc)) from None
            self._start_lineage(begin.version, begin.holder)
        lease = self.leases.grant("push", begin.holder, begin.version, time.monotonic(), rank=begin.rank)
        lease.tried = tried | set(workers)
        replaces_done = bool(retry) and self.versions.rank_done(begin.version, begin.rank, retry)
        try:
            if retry:
                tensors, failed = self.versions.retry(begin.version, begin.rank, retry, names, lease.lease_id)
            else:
                tensors = self.versions.begin(begin.version, begin.rank, begin.world, begin.tensors, names,
                                              lease.lease_id, lease.granted, resumes=begin.resumes,
                                              holder=begin.holder, world_token=begin.world_token)
        except ManifestError as exc:
            self.leases.release(lease.lease_id)
            raise self._refusal(exc, retry) from None
        if replaces_done:
            # Journaled done: a restart must not restore the copies released below.
            self._journal(lambda journal: journal.retried(begin.version, begin.rank, retry))
        if retry:
            # Ended without aborting: the version goes on under the new lease.
            self.leases.release(retry)
            self._release([(w, shard) for w, shard in failed if w in self.workers])
            log.warning("ps.push_retried", version=begin.version, rank=begin.rank, avoid=begin.avoid, workers=names,
                        restarted=sorted(set(begin.avoid) - avoid))
        nbytes = max((t.offset + t.nbytes for t in tensors), default=0)
        return PushGrant(lease.lease_id, self.settings.lease_ttl_s, workers[0], nbytes, tensors, workers[1:])

    def _tried(self, retry: str) -> frozenset[WorkerInfo]:
        """The worker registrations granted to the live push lease ``retry`` and to the attempts it replaced;
        none for no lease (a first begin) or one no longer live (the retry is refused further on)."""
        lease = self.leases.get(retry) if retry else None
        return lease.tried if lease is not None else frozenset()

    def _avoided(self, avoid: list[str], tried: frozenset[WorkerInfo]) -> set[str]:
        """The workers of a pusher's ``avoid`` (those it could not reach) to leave out of its new grant: each one
        registered now as a process this push's attempts were granted (``tried``), and each name they were never
        granted (taken at the pusher's word; e.g. one this manager does not know). A worker they were granted
        only as other processes restarted since it failed the pusher (a new pid, start time or endpoint): the
        process registered now is not the one that failed, and may be the only worker left."""
        granted = {info.worker for info in tried}
        return {worker for worker in avoid if worker not in granted or self.workers.get(worker) in tried}

    def _given_up(self, begin: PushBegin) -> str:
        """The lease of the attempt ``begin`` replaces, when the same holder begins again the same rank of the
        pending version while that rank's attempt is still being written; "" otherwise. Its pusher gave that
        attempt up: a pusher starts a push over when this manager restarted or did not answer, and a begin
        it sent meanwhile may reach the manager late (queued while it was away) and be granted with nobody
        reading the grant. Likewise for a rank restored done from the journal: its pusher begins it again when
        the dead process's answer never reached it, and writes it again. The fresh begin goes on as a retry of
        it (the version stays pending), where a refusal would leave the rank unable to push until that grant's
        lease expires and aborts the version.
        A begin that ``resumes`` does so only when it names the trainer world token of that attempt (the same
        world started its push over): a trainer world restarted under the same node ids may find the dead
        world's attempt of that version still leased, and must start its lineage afresh, not write into it."""
        if begin.resumes and not self.versions.of_world(begin.version, begin.rank, begin.world_token):
            return ""
        holder, restored = self.versions.restored_holder(begin.version, begin.rank)
        if holder == begin.holder:  # done before this manager restarted; its pusher did not hear of it
            return restored
        shard = self.versions.pending_rank(begin.version, begin.rank)
        if shard is None or shard.done:
            return ""
        lease = self.leases.get(shard.lease)
        return shard.lease if lease is not None and lease.holder == begin.holder else ""

    def _start_lineage(self, version: int, holder: str) -> None:
        """A trainer world resumes at ``version``: abort the old world's pending push, retire its versions
        ``>= version`` (see the module doc)."""
        pending = self.versions.pending
        if pending is not None:
            self._abort_push(pending.version, f"{holder} resumes from version {version}: a new lineage")
        retired = [v for v in self.versions.retained() if v >= version]
        freed = self.versions.start_lineage(version)
        self._handed_out = None  # the new lineage's buffers start at version: none of them was handed out
        rewound = self.inventory.rewind(version)
        self._journal(lambda journal: journal.lineage(version))
        self._release(freed)
        self._inventory_dropped("rewound", version, rewound)
        (log.warning if retired else log.info)("ps.lineage_started", version=version, holder=holder,
                                               retired=retired, latest=self.versions.latest)

    def _shard_commit(self, request: Message) -> Body:
        commit = request.body
        assert isinstance(commit, ShardCommit)
        latest = self.versions.latest
        try:
            _, manifest, freed = self.versions.commit_shard(
                commit.version, commit.rank, commit.lease, commit.worker, commit.segment, commit.tensors,
                self.workers.values())
        except ManifestError as exc:
            raise self._refusal(exc, commit.lease) from None
        self.held.setdefault(commit.worker, {})[commit.segment] = commit.lease
        # The push lease lives until every copy of the rank is verified: while one is still being written, the
        # pusher's release of it (it gave that copy up) must abort the version, and its expiry too.
        if manifest is not None or self.versions.rank_done(commit.version, commit.rank, commit.lease):
            # Recorded the first time only (a repeated commit finds its lease released): its pusher returns on
            # this answer and never pushes it again, so a restart must keep it.
            done = self.versions.done_rank(commit.version, commit.rank) if self.leases.get(commit.lease) else None
            if done is not None:
                self._journal(lambda journal: journal.rank_done(done))
            lease = self.leases.release(commit.lease)
            if lease is not None:
                self._push_seconds.observe(time.monotonic() - lease.granted)
        if manifest is not None and self.versions.latest != latest:
            self._committed(manifest, freed)
        return Committed(commit.version, manifest is not None, manifest.digest if manifest else "")

    def _refusal(self, exc: ManifestError, lease: str) -> HandlerError:
        """``exc`` as the refusal of a request about push ``lease``, saying so when an earlier process of the
        manager granted it: the push it belonged to died with that process."""
        if exc.code == "push-aborted" and lease and not self.leases.granted_here(lease):
            return HandlerError("push-aborted", f"{exc}: lease {lease} was {RESTARTED}; the push it belonged to "
                                "was aborted: push again")
        return HandlerError(exc.code, str(exc))

    def _journal(self, write: Callable[[ManagerJournal], None]) -> None:
        """Commit a record to the journal, if any, then compact it when enough records piled up: after any record,
        not only a commit's, since aborted pushes and consumed batches pile up without commits too. Called once
        the decision it records is applied here (versions, inventory, the batch handed out): a compaction writes
        that state as it is now, in place of the records. A write that fails is logged, and the manager goes on
        serving what it decided: a restart would not know it."""
        if self.journal is None:
            return
        try:
            write(self.journal)
        except (OSError, ValueError) as exc:  # a full tmpfs, a record the journal cannot hold
            log.error("ps.journal_failed", error=str(exc), detail="a restart of this manager would not know it")
            return
        try:
            self.journal.compact_if_due(self.versions, self.inventory.trainer_version, self._handed_out)
        except (OSError, ValueError) as exc:  # the journal is replaced whole or not at all: it stays as it was
            log.error("ps.journal_compaction_failed", error=str(exc), detail="the journal is kept uncompacted; "
                      "the next record tries again")

    def _committed(self, manifest: Manifest, freed: list[Shard]) -> None:
        """A version is visible: move the inventory's trainer version up to it, record it, free what retention
        dropped, then (never before) publish the bump."""
        ((_, shards, leases),) = self.versions.stored([manifest.version])
        advanced = self.inventory.advance(manifest.version)
        self._journal(lambda journal: journal.committed(manifest, shards, leases))
        self._release(freed)
        self._inventory_dropped("advanced", manifest.version, advanced)
        log.info("ps.version_committed", version=manifest.version, nbytes=manifest.nbytes,
                 tensors=len(manifest.entries), digest=manifest.digest)
        self.runtime.publish(VersionBump(manifest.version, manifest.nbytes, manifest.digest))

    def _abort_push(self, version: int, reason: str) -> None:
        pending = self.versions.pending is not None and self.versions.pending.version == version
        shards = self.versions.abort(version)
        if pending:
            self._journal(lambda journal: journal.aborted(version))
        for _, lease_id in shards:
            self.leases.release(lease_id)
        self._release(shards)
        log.warning("ps.push_aborted", version=version, reason=reason, shards=len(shards))

    # --- pull and leases ----------------------------------------------------------------------------

    def _trainer_version(self) -> int:
        return max(self.versions.latest, self.inventory.trainer_version)

    def _pull_begin(self, request: Message) -> Body:
        begin = request.body
        assert isinstance(begin, PullBegin)
        try:
            manifest = self.versions.manifest(begin.version)
        except ManifestError as exc:
            raise HandlerError(exc.code, str(exc)) from None
        behind = self._trainer_version() - manifest.version
        if begin.max_staleness is not None and behind > begin.max_staleness:
            raise HandlerError("too-stale", f"version {manifest.version} is {behind} versions behind the trainer "
                               f"(version {self._trainer_version()}), more than max_staleness {begin.max_staleness}")
        live = self._live_copies(manifest)
        lease = self.leases.grant("pull", begin.holder, manifest.version, time.monotonic())
        self.versions.pin(manifest.version, lease.lease_id)
        return PullGrant(lease.lease_id, self.settings.lease_ttl_s, live)

    def _lease_renew(self, request: Message) -> Body:
        renew = request.body
        assert isinstance(renew, LeaseRenew)
        now = time.monotonic()
        expired = [lease for lease in renew.leases if not self.leases.renew(lease, now)]
        lost = []
        for prompt in renew.prompts:
            try:
                self.inventory.renew(prompt, now + self.settings.lease_ttl_s)
            except StalenessError:
                lost.append(prompt)
        return LeaseState(expired, lost)

    def _lease_release(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, LeaseRelease)
        lease = self.leases.release(ask.lease)
        if lease is None:
            if self.leases.ended(ask.lease) == "expired":
                raise HandlerError("lease-expired", f"lease {ask.lease} expired before it was released; what it "
                                   "held may have been reused")
            if not self.leases.granted_here(ask.lease):
                raise HandlerError("unknown-lease", f"lease {ask.lease} was {RESTARTED}: it is not held here, "
                                   "and what it held may have been reused")
            raise HandlerError("unknown-lease", f"lease {ask.lease} is not held")
        self._ended(lease, "released")
        return Ok()

    def _ended(self, lease: Lease, how: str) -> None:
        """Consequences of a lease ending: a read unpins its version; an unfinished push is aborted."""
        if lease.kind == "pull":
            self._pull_seconds.observe(time.monotonic() - lease.granted)
            self._release(self.versions.unpin(lease.version, lease.lease_id))
        else:
            self._abort_push(lease.version, f"push lease of rank {lease.rank} ({lease.holder}) {how} before its "
                             "shard was committed")

    def _expire(self) -> None:
        self._credit_stall()
        now = time.monotonic()
        if self._held_back and now >= self._releases_from:
            held_back, self._held_back = self._held_back, []
            log.info("ps.held_releases_sent", shards=len(held_back))
            self._release(held_back)
        if any(resend.due <= now for resend in self._resends):
            due = [resend for resend in self._resends if resend.due <= now]
            self._resends = [resend for resend in self._resends if resend.due > now]
            for resend in due:
                if self.workers.get(resend.info.worker) is resend.info:  # else: see _released
                    self._send_release(resend.info.worker, resend.shards, resend.attempt + 1)
        for lease in self.leases.expire(now):
            log.warning("ps.lease_expired", lease=lease.lease_id, kind=lease.kind, holder=lease.holder,
                        version=lease.version)
            self._ended(lease, "expired")
        pending = self.versions.pending
        if pending is not None and now - pending.started > self.settings.push_timeout_s:
            self._abort_push(pending.version, f"not every rank committed within {self.settings.push_timeout_s:g}s")
        for result in self.inventory.expire(now):
            log.warning("ps.reservation_expired", prompt=result.prompt_id, buffer=result.version,
                        evicted=len(result.evicted))
        self._check_init(now)

    def _credit_stall(self) -> None:
        """Count no time this manager's loop did not run (stopped, swapped out, starved of CPU) toward a lease's
        life or a pending push's: the renewals and commits of that time wait unread in its sockets, and expiring
        on waking would abort pushes and end reads their holders kept alive (a soak that paused every process of
        a run for 4-10 s: a rank's push aborted under it, the rank failed, its world restarted)."""
        stalled = self.passes.stall()
        if not stalled:
            return
        self.leases.extend(stalled)
        if self.versions.pending is not None:
            self.versions.pending.started += stalled
        log.warning("ps.stalled", seconds=round(stalled, 3), leases=len(self.leases),
                    detail="the manager's loop did not run: that time counts toward no lease's life")

    # --- inspection ---------------------------------------------------------------------------------

    def _manifest(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, ManifestQuery)
        try:
            return ManifestInfo(self.versions.manifest(ask.version))
        except ManifestError as exc:
            raise HandlerError(exc.code, str(exc)) from None

    def _status(self, request: Message) -> Body:
        pending = self.versions.pending
        return PsState(
            latest=self.versions.latest,
            retained=self.versions.retained(),
            pinned={str(v): n for v, n in self.versions.pinned().items()},
            pending=[pending.version] if pending else [],
            leases=len(self.leases),
            trainer_version=self._trainer_version(),
            workers=sorted(self.workers.values(), key=lambda w: w.worker),
            latest_digest=self.versions.manifest().digest if self.versions.latest >= 0 else "",
        )

    # --- broadcast init -----------------------------------------------------------------------------

    def _init(self, request: Message) -> Body | None:
        ask = request.body
        assert isinstance(ask, InitRequest)
        request_id = request.header.id
        if request_id in self._init_answers:
            return self._init_answers[request_id]
        if self.init is not None:
            if self.init.request_id != request_id:
                raise HandlerError("init-busy", f"broadcast init {self.init.init_id} of {self.init.path} is running")
            self._init_waiting.append(self.server.pending)
            return None
        pending = self.versions.pending
        if pending is not None:  # the init would commit the version being pushed
            raise HandlerError("init-busy", f"version {pending.version} is being pushed: an init commits the next "
                               "version, so it waits until that push committed or aborted")
        names = list(ask.workers) or sorted(self.workers)
        unknown = [n for n in names if n not in self.workers]
        if unknown or not names:
            raise HandlerError("unknown-worker", f"not registered: {unknown or 'no workers at all'}")
        if len(set(names)) != len(names):
            raise HandlerError("bad-init", f"a worker is named twice in {names}")
        now = time.monotonic()
        init_id = f"init-{os.urandom(6).hex()}"
        self._inits_here.add(init_id)
        workers = [self.workers[n] for n in names]
        plan = InitPlan(init_id, ask.path, workers, ask.chunk_bytes or self.settings.chunk_bytes,
                        self.settings.ack_timeout_s)
        # Every worker below the root first: each takes the init's header only once it holds the plan, so the root,
        # whose plan starts the stream, hears last.
        self.init = InitRound(init_id, ask.path, workers, request_id, now, now + self.settings.init_timeout_s, plan,
                              unplanned=set(names[1:]))
        self._init_waiting = [self.server.pending]
        for name in names[1:] or names[:1]:  # a lone root is planned at once
            self._send_plan(self.init, name)
        log.info("ps.init_started", init_id=init_id, path=ask.path, workers=names, rounds=rounds(len(names)))
        return None

    def _send_plan(self, init: InitRound, worker: str) -> None:
        self._send(worker, init.plan, lambda outcome: self._planned(init.init_id, worker, outcome),
                   deadline_s=self.settings.ack_timeout_s)

    def _planned(self, init_id: str, worker: str, outcome: Outcome) -> None:
        """``worker``'s answer to the plan: anything but ok fails the init; the root's plan goes once every other
        worker took its own."""
        init = self.init
        if init is None or init.init_id != init_id:
            return
        if isinstance(outcome, Message):
            if worker in init.unplanned:
                init.unplanned.discard(worker)
                if not init.unplanned:
                    self._send_plan(init, init.names[0])
            return
        if isinstance(outcome, RemoteError):
            reason = f"rejected the plan: {outcome.detail}"
        elif isinstance(outcome, RequestTimeout):
            reason = f"did not acknowledge the init plan within {self.settings.ack_timeout_s:g}s"
        else:
            reason = f"went down before acknowledging the init plan ({outcome.reason})"
        self._fail_init(worker, reason)

    def _init_done(self, request: Message) -> Body:
        """A worker verified its copy of an init. One of an init this process never ran (an earlier process's that
        no version names) is an orphan: nothing else would ever release it."""
        done = request.body
        assert isinstance(done, InitDone)
        if self.init is not None and self.init.init_id == done.init_id:
            self.init.on_done(done)
            if self.init.complete:
                self._finish_init(self.init)
        elif (done.init_id not in self._inits_here and done.worker in self.workers
              and done.init_id not in self.versions.shards_on(done.worker)):
            self._release_orphans(done.worker, [done.init_id])
        return Ok()

    def _init_failed(self, request: Message) -> Body:
        failed = request.body
        assert isinstance(failed, InitFailed)
        if self.init is not None and self.init.init_id == failed.init_id:
            reporter = "" if failed.reporter == failed.worker else f" (reported by {failed.reporter})"
            self._fail_init(failed.worker, failed.reason + reporter)
        return Ok()

    def _check_init(self, now: float) -> None:
        init = self.init
        if init is None:
            return
        if init.overdue(now):
            self._fail_init(init.names[0], "")  # overdue() recorded which workers did not finish

    def _finish_init(self, init: InitRound) -> None:
        entries = [
            ManifestEntry(t.name, t.dtype, t.shape, t.nbytes, t.checksum,
                          [Location(w, init.done[w].segment, t.offset) for w in init.names])
            for t in init.root_layout()
        ]
        for worker in init.names:
            self.held.setdefault(worker, {})[init.done[worker].segment] = init.init_id
        manifest = mf.build(self.versions.next_version(), entries, init.workers)
        try:
            freed = self.versions.commit_init(manifest, [(w, init.init_id) for w in init.names])
        except ManifestError as exc:
            self._fail_init(init.names[0], f"could not commit: {exc}")
            return
        self._committed(manifest, freed)
        result = InitResult(manifest.version, manifest.digest, init.names, rounds(len(init.names)),
                            {w: d.file_opens for w, d in init.done.items()}, time.monotonic() - init.started)
        self._end_init(init, result)

    def _fail_init(self, worker: str, reason: str) -> None:
        init = self.init
        if init is None:
            return
        message = init.error or init.fail(worker, reason)
        log.error("ps.init_failed", init_id=init.init_id, error=message)
        self._release([(w, init.init_id) for w in init.names if w in self.workers])
        self._end_init(init, Error("init-failed", message, InitRequest.kind))

    def _end_init(self, init: InitRound, answer: Body) -> None:
        for pending in self._init_waiting:
            self.server.answer(pending, answer)
        self._init_answers[init.request_id] = answer
        while len(self._init_answers) > 64:
            self._init_answers.popitem(last=False)
        self.init = None
        self._init_waiting = []

    # --- staleness inventory ------------------------------------------------------------------------

    def _inventory_dropped(self, how: str, version: int, report: CloseReport[str]) -> None:
        """The inventory's trainer version moved with the versions; say what that ended (callers learn it
        from their next occupy, ``unknown-reservation``)."""
        if report.aborted_prompts or report.discarded:
            log.warning("ps.inventory_dropped", how=how, trainer_version=version,
                        aborted_prompts=len(report.aborted_prompts), aborted_slots=report.aborted_slots,
                        discarded=len(report.discarded))

    def _staleness(self, call: Callable[[], Body]) -> Body:
        try:
            return call()
        except StalenessError as exc:
            raise HandlerError(_error_code(exc), str(exc)) from None

    def _reserve(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Reserve)
        deadline = time.monotonic() + self.settings.lease_ttl_s if ask.leased else None
        return self._staleness(lambda: Reserved(
            self.inventory.reserve(ask.prompt_id, ask.policy_version, ask.count, deadline=deadline)))

    def _occupy(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Occupy)

        def occupy() -> Body:
            placed = self.inventory.occupy(ask.prompt_id, ask.trajectory, ask.policy_version)
            if placed.aborted_versions:
                log.warning("ps.versions_aborted", versions=list(placed.aborted_versions))
            return Placed(placed.version, placed.staleness, placed.ready, list(placed.aborted_versions))

        return self._staleness(occupy)

    def _consume(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Consume)

        def consume() -> Body:
            request_key = (request.header.src, request.header.id)
            handed = self._handed_out
            if handed is not None and (request_key == handed.request or ask.version == handed.version):
                return Batch(handed.version, True, handed.entries)
            version = self.inventory.trainer_version
            batch = self.inventory.consume(ask.version)
            if batch is None:
                return Batch(version, False)
            taken = self._handed_out = HandedOut(request_key, batch.version, [
                BatchEntry(e.prompt_id, e.trajectory, e.policy_version) for e in batch.entries])
            trainer = self.inventory.trainer_version
            self._journal(lambda journal: journal.trainer(trainer, taken))
            return Batch(taken.version, True, taken.entries)

        return self._staleness(consume)

    def _abort(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, Abort)

        def abort() -> Body:
            result = self.inventory.abort(ask.prompt_id)
            return Aborted(result.version, result.aborted_slots,
                           [BatchEntry(e.prompt_id, e.trajectory, e.policy_version) for e in result.evicted])

        return self._staleness(abort)

    def _inventory(self, request: Message) -> Body:
        stats = self.inventory.stats()
        buffers = [InventoryBuffer(b.version, b.occupied, b.reserved, b.free, b.state.value)
                   for b in self.inventory.buffers()]
        return InventoryState(stats.eta, stats.batch_size, stats.trainer_version, stats.highest_aborted, buffers,
                              dataclasses.asdict(stats))

    # --- metrics ------------------------------------------------------------------------------------

    def _metrics(self) -> None:
        metric = self.runtime.metric
        self._push_seconds = self.runtime.histogram("refbus_ps_push_seconds",
                                                    "Push of one rank's shard, begin to commit.",
                                                    buckets=_SECONDS_BUCKETS)
        self._pull_seconds = self.runtime.histogram("refbus_ps_pull_seconds",
                                                    "Pull lease held, begin to release or expiry.",
                                                    buckets=_SECONDS_BUCKETS)
        metric("refbus_ps_versions_committed_total", "Versions committed (pushes and inits).",
               lambda: {(): float(self.versions.committed_total)})
        metric("refbus_ps_versions_aborted_total", "Pushes aborted before they became visible.",
               lambda: {(): float(self.versions.aborted_total)})
        metric("refbus_ps_current_version", "Latest committed version (-1 before the first).",
               lambda: {(): float(self.versions.latest)}, kind="gauge")
        metric("refbus_ps_version_bytes", "Bytes of every version the workers still hold, all copies.",
               lambda: {(): float(self.versions.held_bytes())}, kind="gauge")
        metric("refbus_ps_leases_active", "Live leases, by kind.",
               lambda: {(k,): float(len(self.leases.live(k))) for k in ("push", "pull")},  # type: ignore[arg-type]
               labels=("kind",), kind="gauge")
        metric("refbus_ps_leases_expired_total", "Leases that expired without being released, by kind.",
               lambda: {(k,): float(v) for k, v in self.leases.expired_total.items()},
               labels=("kind",))


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node ps-manager``: serve the control plane until SIGINT/SIGTERM. With ``store.durable`` its
    journal lives in the store directory under its node id: a process restarted under that id replays it. Raises
    :class:`~..config.ConfigError` (final: exit status 2) when the journal cannot be used (not a ps-manager journal,
    garbage after its records), naming it; :class:`~..store.durable.StoreLocked` (exit 1: restarted) when a live
    process holds it."""
    runtime = NodeRuntime("ps-manager", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    try:
        journal = None
        if config.store.durable:
            store = DurableStore(config.store.directory, config.store_run(), runtime.node_id, budget_bytes=0, what="ps",
                                 strict=True)
            journal = ManagerJournal(store)
        try:
            PsManager(runtime, config.ps, journal=journal)
        except StoreError:
            if journal is not None:
                journal.close(remove=False)  # refused as found: left for the operator to inspect
            raise
    except StoreLocked:  # its predecessor, not yet dead, may hold it: status 1 (cli), restarted until it exits
        runtime.close()
        raise
    except StoreError as exc:
        log.error("ps.journal_unusable", error=str(exc))
        runtime.close()
        raise ConfigError(str(exc)) from None  # final: said last on stderr (cli), exit status 2
    runtime.run()
    return 0
