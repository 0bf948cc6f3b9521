"""`refbus ledger`: account for every kept blob, from the event stream and the stores' own counters.

The ledger replays ownership moves as the stream mirrors them:

* ``episode-finished`` — the store (the env-server node that published it, ``src``) keeps the episode's
  blobs; it owns them until a claim. A restarted durable store publishes it again (``again``) for each
  re-adopted episode nobody claimed (its process may have died between answering the keep and publishing the
  event): the repeat keeps only the blobs the fold never saw, counted once;
* ``claim`` — the orchestrator (``holder``) owns them. A restarted durable store publishes the claims of what
  it re-adopted again (its process may have died between answering a claim and publishing its event): a
  repeat moves nothing, a blob only moves forward. One naming a blob the fold never saw kept, by a store process
  whose every event up to it was folded and no earlier process of which the fold knows (a relaunch's store,
  re-adopting what an earlier launcher's run kept), shows a blob kept before the stream: the fold keeps it then,
  counted kept, with that holder. Reclaimed from a holder the stream never showed down (``holder-down``), it is
  deleted ``holder-down-before`` (:data:`INHERITED`; by holder in the report's ``inherited``), no loss of this
  stream's run: that holder's process died before it;
* ``reference`` — a trainer rank (``holder``) owns them, when one of the hand-over's two ends published it, as
  at the stores: the rank itself, or the blob's claimer (the orchestrator repeats it); one from any other node
  moves nothing (logged ``ledger.reference_refused``, counted by source in ``references_refused``; one by a
  non-holder folded before the blob's claim waits for the claim to be judged). The rank publishes it, and the
  store mirrors the rank's delete, so the broker may relay the delete first: a delete by a node other than the
  owner while the blob is still the orchestrator's waits for that node's ``reference`` (it names the blob and that node:
  nothing was wrong); until it comes, the report lists the delete as a violation, or as unverified where events of
  either end of that hand-over went missing (gaps in other sources' streams, such as the broker's ``node-up`` of
  the watcher that recorded the stream, cannot hide it). A ``claim`` or
  ``reference`` may also come before the blob's ``episode-finished`` (after a broker restart, each node's held
  events reach the new ring when that node re-joins; a gap fill reorders alike): it waits for it, and moves the
  blob then, in order (at most ``pending_moves`` blob ids per source wait; past that the oldest are dropped,
  counted by source, and a delete they would explain is unverified). A delete relayed before the
  ``episode-finished`` too ends the blob there: its waiting moves go, and the ``episode-finished`` counts it
  kept in its store's counters without keeping it in the fold;
* ``fetch-ack`` — a trainer fetched them. It says nothing about ownership: a fetch-ack means the store
  served the fetch, so before any delete there, whatever order the broker relays the two in (they come from
  different nodes); a fetch after a delete is refused by the store, which publishes the ``violation``;
* ``delete`` — they are gone, by ``reason``. Reasons in :data:`LOSS_REASONS` are losses, named with the
  node whose death caused them: ``holder-down`` (a store reclaimed what a dead holder held: the holder its
  ``node`` names, whatever owner the fold has shown, since the hand-over to that holder may come later) and
  ``lost`` (a holder dropped references to a dead store's blobs: the store). A store declared lost that
  comes back as the same process (it was cut off) deletes those blobs itself when the holder asks, with
  reason ``lost`` and ``node`` itself: the holder's event and the store's are one loss, counted once, by
  the store;
* ``violation`` — a store refused ``count`` blob ids of one request alike (1 when absent: an older store's
  event), counted as that many violations: the report counts violations in blob ids, as the stores'
  counters do, not in events or lines. An event whose count is not an integer from 1 to ``max_count`` (the
  configured ``limits.max_items``: no request can name more ids) is refused, logged as
  ``ledger.violation_refused`` and counted by source; the fold goes on, and the report is then not ok (what
  the event reported is unaccounted);
* ``node-down`` / ``node-up`` — a node left / came back. A holder that is down *leaks* what it still owns
  (until its store reclaims it or the node comes back); a store that goes down *loses* every blob it
  still kept, named with that store, unless the same incarnation publishes again after its node came back
  up (a partition, not a death), or a restarted process re-adopted its durable store (``node-up`` with the
  same ``store`` label): then it holds them again, and the store's counters go on under the new process. A
  node's first events may be relayed before its ``node-up`` (the broker announces a node when the node may
  already publish): a store incarnation seen first after the last ``node-up`` was taken is the process the
  next ``node-up`` announces, so the account does not depend on that order;
* ``run-end`` — the launcher finished the run: what is then still held by anyone but its store is a leak
  (named by the store's own view by claimer, read when reconciled, where events of that store process went
  missing or the fold names other holders: a lost claim moves no count, so counters that agree do not
  show it).

The accounting contract: ``kept = deleted + held + lost`` exactly, per store and in total, where
``deleted`` counts reasons outside :data:`LOSS_REASONS`. Stores are the authority: each env server counts
what it kept, deleted (by reason) and holds, and reports it with the sequence number of its last published
event (``accounts`` → ``accounted``). The ledger keeps the same counters per store incarnation from that
store's own events and finds gaps itself (per source process, from sequence numbers). :meth:`Ledger.reconcile`
compares a store's counters with the fold at the store's sequence number: equal is *agreed*; different (a
gap, an event that never made it) is *corrected*: the store's counters replace the fold's from then on, and
its own view of who holds what (``held_by``) follows its later events. A store whose events the fold still
waits for is *behind*; a forced (final) reconcile adopts its counters anyway, and those events, when they come,
move blobs only (no longer counted missed). A restarted durable store reconciled before its ``node-up`` was
folded is not added to again by that node-up: its counters already continue the earlier process's.
What neither can vouch for — a store process with missing events whose counters could not be read (it died;
a restart that re-adopted its durable store counts on from it, so its counters vouch for it), or
events missing from other sources while blobs are still held or lost — is listed as *unaccounted*, and the
report is then not ok.

Input is the JSON record that :func:`refbus.protocol.envelope.describe` makes (what ``refbus monitor
--json`` prints), so a file and a live subscription go through the same code.
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog

from ..bus.reqrep import RemoteError, RequestTimeout
from ..bus.runtime import NodeRuntime
from ..protocol.envelope import Limits, Message, incarnation
from ..protocol.messages import Accounted, Accounts, EpisodeFinished, NodeUp, NonNegative
from .tombstones import DEFAULT_RECENT, FORGOTTEN, CounterRuns, Tombstones

log = structlog.get_logger(__name__)

STORE_ROLE = "env-server"
SETTLE_TRIES = 40  # a store's answer waits at most this many settles for its events to arrive
LOST = "lost"
HOLDER_DOWN = "holder-down"
LOSS_REASONS = frozenset({LOST, HOLDER_DOWN})
STORE_REASONS = frozenset({"undelivered", "shutdown", "discarded", HOLDER_DOWN})  # a store's own deletes
RUN_END = "run-end"
UNKNOWN = "?"  # the holder or node of blobs the stream did not show
# The deletes of blobs kept before the stream began, by a store process it never showed, reclaimed from a holder
# that died before it (one it never showed down): reason ``holder-down`` in the store's counters, no loss of the run.
INHERITED = "holder-down-before"
_STAGE = {"claim": 1, "reference": 2}  # store (0) -> orchestrator -> trainer rank
# Per source: blob ids whose moves wait for their episode-finished (a few steps of a busy run's references
# relayed ahead of their store's events; about 5 MB). The oldest go first, counted.
PENDING_MOVES = 16_384

Reconciled = Literal["agreed", "corrected", "ahead", "behind"]


@dataclass
class _Blob:
    store: str  # node id of the env server that keeps it
    source: str  # the source it keeps for (replicas share one): the holder named in the store's own deletes
    key: tuple[str, str]  # its store incarnation
    owner: str
    stage: int = 0  # how far along the hand-over chain the owner is (see _STAGE)
    before: bool = False  # kept by an earlier process of its store the stream never showed (see Ledger._adopt)


@dataclass
class _Store:
    """Counters of one store incarnation, folded from its own events (or adopted from its ``accounted``)."""

    node_id: str
    identity: str = ""  # a durable store's identity (label ``store``): restarts that re-adopt it continue it
    labeled: bool = False  # its process's node-up was folded (``identity`` is that node-up's label)
    kept: int = 0
    deleted: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    covered: int = 0  # events with seq <= covered are in adopted counters: they move blobs, not counts
    # seq ranges (after, upto] a forced reconcile adopted before their events arrived, and those that came since
    awaited: list[tuple[int, int]] = field(default_factory=list)
    arrived: CounterRuns = field(default_factory=CounterRuns)
    unseen: int = 0  # violations its store counted that the stream had not shown when they were adopted
    down: bool = False  # reported down and not heard from since its node came back
    reconciled: str = ""  # "", "agreed", or what the correction changed
    # a reconciled store's own view (by claimer; unclaimed: its node id) of what it holds: as of ``covered``,
    # then moved by its own events
    held_by: dict[str, int] | None = None

    @property
    def held(self) -> int:
        return self.kept - self.deleted.total()

    def counts(self, seq: int) -> bool:
        """Whether an event of this store with ``seq`` (0: unknown, a record without one) changes its counters."""
        return not seq or seq > self.covered

    def late(self, seq: int) -> bool:
        """Whether an event with ``seq``, at or below the last one folded of this incarnation, is one a forced
        reconcile adopted before it arrived, arriving now for the first time (it moves blobs): not a repeat."""
        return any(after < seq <= upto for after, upto in self.awaited) and self.arrived.add(seq)

    def move_held(self, holder: str, to: str | None, seq: int) -> None:
        """Keep ``held_by`` valid after its store's own event ``seq`` moved a blob out of ``holder``'s and into
        ``to``'s (None: deleted). Events the adopted view covers moved it already; moves other nodes publish
        (a rank's ``reference``) are left out: whether the store's view has them is unknown."""
        if self.held_by is None or not self.counts(seq):
            return
        left = self.held_by.get(holder, 0) - 1
        if left < 0:  # the view gives ``holder`` none: it and the fold disagree on who held that blob (a move
            self.held_by = None  # one of them missed), so the view can no longer say which: the fold's stands
            return
        if not left:
            self.held_by.pop(holder, None)
        else:
            self.held_by[holder] = left
        if to is not None:
            self.held_by[to] = self.held_by.get(to, 0) + 1


@dataclass
class LedgerReport:
    """Per store node and in total. ``held`` includes ``leaked`` (held by a node that is down)."""

    kept: Counter[str] = field(default_factory=Counter)  # store -> blobs
    deleted: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # store -> reason
    held: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # store -> holder
    leaked: Counter[str] = field(default_factory=Counter)  # holder that is down -> blobs it still holds
    lost: Counter[str] = field(default_factory=Counter)  # node whose death lost them -> blobs
    violations: list[str] = field(default_factory=list)  # one line per finding, for people
    violated: int = 0  # blob ids the violations cover (a store's event of ``count`` ids is one line)
    refused: Counter[str] = field(default_factory=Counter)  # source -> violation events refused (bad count)
    # source -> blob ids of its ``reference`` events refused (published by neither end: not folded, as at the stores)
    references_refused: Counter[str] = field(default_factory=Counter)
    unaccounted: list[str] = field(default_factory=list)
    missed: Counter[str] = field(default_factory=Counter)  # source -> events missing from the stream
    reconciled: dict[str, str] = field(default_factory=dict)  # store -> agreed / the correction
    ended: bool = False
    held_at_end: Counter[str] = field(default_factory=Counter)  # holder -> blobs not their store's at run-end
    # holder -> blobs kept before the stream and reclaimed from it, dead before the stream (deleted ``INHERITED``)
    inherited: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        """Every blob deleted once by its owner, or still with its live store; nothing lost, leaked,
        unaccounted or held by a holder when the run ended."""
        return not (self.violations or self.unaccounted or self.leaked.total() or self.lost.total()
                    or self.held_at_end.total())

    def totals(self) -> dict[str, Any]:
        deleted: Counter[str] = Counter()
        for reasons in self.deleted.values():
            deleted.update(reasons)
        return {
            "kept": self.kept.total(),
            "deleted": dict(deleted),
            "deleted_total": deleted.total(),
            "held": sum(h.total() for h in self.held.values()),
            "leaked": self.leaked.total(),
            "lost": self.lost.total(),
            "violations": self.violated,
            "refused_events": self.refused.total(),
            "unaccounted": len(self.unaccounted),
            "missed_events": self.missed.total(),
        }

    def as_dict(self) -> dict[str, Any]:
        stores = sorted(set(self.kept) | set(self.deleted) | set(self.held))
        return {
            "ok": self.ok,
            "total": self.totals(),
            "stores": {
                s: {"kept": self.kept[s], "deleted": dict(self.deleted.get(s, {})), "held": dict(self.held.get(s, {})),
                    "reconciled": self.reconciled.get(s, "")}
                for s in stores
            },
            "leaked": dict(self.leaked),
            "lost": dict(self.lost),
            "held_at_end": dict(self.held_at_end),
            "inherited": dict(self.inherited),
            "ended": self.ended,
            "missed": dict(self.missed),
            "refused": dict(self.refused),
            "references_refused": dict(self.references_refused),
            "violations": self.violations,
            "unaccounted": self.unaccounted,
        }


class Ledger:
    """Folds event records into blob ownership and per-store counters. Feed records in stream order with
    :meth:`apply`; feed stores' ``accounted`` replies to :meth:`reconcile`. Not thread-safe.

    Memory follows the blobs still held, not the blobs ever kept: every deleted id is remembered for the whole
    run, exactly (a second delete is a violation however long after the first), in compact runs of a store's
    id counters (:class:`~refbus.nodes.tombstones.Tombstones`). The price: who deleted an id first, and why,
    is kept for the latest deletes (and every ``lost`` one) only, so a second delete of an older id is
    reported without naming the first deleter.

    ``max_count``: the most blob ids one ``violation`` event may report (``limits.max_items``).
    ``pending_moves``: per source, the most blob ids whose ``claim``/``reference`` wait for the blob's
    ``episode-finished``; past it the oldest are dropped, counted by source (:attr:`moves_dropped`).
    """

    def __init__(self, *, recent_tombstones: int = DEFAULT_RECENT, max_count: int = Limits.max_items,
                 pending_moves: int = PENDING_MOVES) -> None:
        if pending_moves < 1:
            raise ValueError(f"pending_moves must be >= 1, got {pending_moves}")
        self.max_count = max_count
        self.pending_moves = pending_moves
        self.blobs: dict[str, _Blob] = {}
        self.tombstones = Tombstones(recent=recent_tombstones, always_named=frozenset({LOST}))
        self.stores: dict[tuple[str, str], _Store] = {}
        self.down: set[str] = set()
        self.violations: list[str] = []
        self.violated = 0  # blob ids covered by ``violations``
        self.refused: Counter[str] = Counter()  # source -> violation events refused for their count
        self.lost_by: Counter[str] = Counter()  # holder-down losses by the holder (UNKNOWN: blob not seen)
        # store node -> holder -> holder-down deletes of blobs kept before the stream, their holder dead before it
        self.inherited: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.went_down: set[str] = set()  # every node a node-down named, back up since or not
        # (source, incarnation) -> events missing from the stream: a store is reconciled per process, so a
        # gap is vouched for only by the counters of the process that published around it
        self.missed: Counter[tuple[str, str]] = Counter()
        self.unverified = 0  # deletes by a node not shown as the owner, after events went missing or moves dropped
        # blob id -> its moves (source, stage, holder) folded before its episode-finished, in order
        self._pending: dict[str, list[tuple[str, int, str]]] = {}
        self._pending_of: defaultdict[str, OrderedDict[str, None]] = defaultdict(OrderedDict)  # source -> ids
        self.moves_dropped: Counter[str] = Counter()  # source -> blob ids whose waiting moves it dropped
        # blob id -> (deleter, owner, reason): deleted by a node before its reference to the blob was folded
        self.awaiting_reference: dict[str, tuple[str, str, str]] = {}
        # blob id -> {source: holder}: references by a non-holder folded before the blob's claim (see _by_an_end)
        self._unjudged: dict[str, dict[str, str]] = {}
        self.references_refused: Counter[str] = Counter()  # source -> blob ids of its references refused
        self.ended = False
        self.held_at_end: Counter[str] = Counter()
        self._last: dict[str, tuple[str, int]] = {}  # src -> (incarnation, last seq)
        # node id -> the store label of its latest node-up, until a store incarnation of that node takes it
        self._unclaimed: dict[str, str] = {}
        self._newest: dict[str, tuple[str, str]] = {}  # node id -> its store incarnation seen first most recently
        self._processes: set[tuple[str, str]] = set()  # every store incarnation seen, merged into a later or not

    # --- folding the stream ---------------------------------------------------------------------------

    def apply(self, record: Mapping[str, Any]) -> None:
        """Fold one event record. A record repeated (same source incarnation, seq not above the last) is
        ignored; a jump in a source's seq counts the events between as missed."""
        src, incarnation = record.get("src", ""), str(record.get("id", "")).partition("-")[0]
        seq = record.get("seq", 0)
        if seq and not self._in_order(src, incarnation, seq):
            return
        if (back := self.stores.get((src, incarnation))) is not None and back.down and src not in self.down:
            back.down = False  # its node came back up and this same process publishes: it was cut off, not dead
        kind = record.get("type")
        if kind == "episode-finished":
            key = (src, incarnation)
            store = self._store(key)
            refs = record["refs"]
            if record.get("again"):  # a restarted store's repeat: only what the first event never brought is new
                refs = [ref for ref in refs if ref["blob_id"] not in self.blobs
                        and self.tombstones.get(ref["blob_id"]) is None]
            if store.counts(seq):
                store.kept += len(refs)
                if store.held_by is not None:
                    store.held_by[src] = store.held_by.get(src, 0) + len(refs)
            for ref in refs:
                blob_id = ref["blob_id"]
                moves = self._unpend(blob_id)
                if self.tombstones.get(blob_id) is not None:
                    continue  # its delete was relayed first (by another node): it is gone, not kept again
                blob = self.blobs[blob_id] = _Blob(store=src, source=ref.get("source", src), key=key, owner=src)
                for mover, stage, holder in sorted(moves, key=lambda move: move[1]):  # its claim before its reference
                    if stage > blob.stage and self._by_an_end(mover, stage, holder, blob_id, blob):
                        blob.owner, blob.stage = holder, stage
                        self._judge_waiting(blob_id, blob)
        elif kind in _STAGE:
            # Moves come from different nodes (the store mirrors a claim, the trainer a reference), so the
            # broker may relay them out of causal order: a blob only ever moves forward along the chain, and a
            # move of a blob whose episode-finished is still on its way waits for it.
            stage = _STAGE[kind]
            for blob_id in record["blob_ids"]:
                blob = self.blobs.get(blob_id)
                if blob is not None and stage > blob.stage:
                    if not self._by_an_end(src, stage, record["holder"], blob_id, blob):
                        continue
                    if blob.key == (src, incarnation):  # a claim its store mirrors
                        self.stores[blob.key].move_held(blob.owner, record["holder"], seq)
                    blob.owner, blob.stage = record["holder"], stage
                    self._judge_waiting(blob_id, blob)
                elif blob is None and kind == "reference" and blob_id in self.awaiting_reference:
                    deleter, owner, reason = self.awaiting_reference[blob_id]
                    if src not in (record["holder"], owner):  # neither end: it neither explains nor condemns
                        self._refuse_reference(src, record["holder"], blob_id, owner)
                        continue
                    del self.awaiting_reference[blob_id]
                    if deleter != record["holder"]:  # handed to another rank: the delete was not the owner's
                        self._violation(f"{deleter} deleted {blob_id} owned by {record['holder']} ({reason})")
                elif blob is None and self.tombstones.get(blob_id) is None:
                    if kind == "claim" and self._first_process(src, incarnation, seq):
                        self._adopt(src, incarnation, seq, blob_id, record["holder"])
                    else:
                        self._pend(src, blob_id, stage, record["holder"])
        elif kind == "delete":
            self._delete(record, (src, incarnation), seq)
        elif kind == "violation":
            if (src, incarnation) not in self.stores or self.stores[src, incarnation].counts(seq):
                self._refusal(record, (src, incarnation), seq)
            # else: a late one a forced reconcile adopted: its violations are counted among the store's unseen
        elif kind == "node-down":
            self.down.add(record["node_id"])
            self.went_down.add(record["node_id"])
            for key, store in self.stores.items():
                if key[0] == record["node_id"]:
                    store.down = True  # an incarnation that is down never comes back: its blobs are lost
        elif kind == "node-up":
            node = record["node"]
            self.down.discard(node["node_id"])  # a holder restarted under its id holds again
            self._up(node["node_id"], node.get("labels", {}).get("store", ""))
        elif kind == RUN_END:
            self.ended = True
            self.held_at_end = self._held_at_end()

    def _held_at_end(self) -> Counter[str]:
        """Holder -> blobs it holds as the run ends, a store's own unclaimed blobs left out. Per live store, as
        :meth:`report` names its holders: the fold's owners, or the store's own view by claimer where
        :meth:`_own_view` says it wins. A store killed after deleting blobs but before publishing those
        deletes said so in its counters, a claim lost from the stream moved no count: the fold alone would
        name the last holder it saw for ever."""
        by_key: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        for blob in self.blobs.values():
            by_key[blob.key][blob.owner] += 1
        held: Counter[str] = Counter()
        for key, store in self.stores.items():
            if store.down:
                continue
            owners = self._own_view(key, store, by_key.get(key, Counter()))
            held.update({holder: n for holder, n in owners.items() if holder != store.node_id})
        return +held

    def _own_view(self, key: tuple[str, str], store: _Store, owners: Counter[str]) -> Counter[str]:
        """Who holds the blobs of store incarnation ``key``: the fold's ``owners`` (by owner, the store itself
        by its node id), or the store's own view by claimer where it was read, still adds up to what the
        store holds, and the fold cannot vouch for its owners: events of that process went missing (a lost
        claim moves no count, so even counters that agree say nothing of who holds what) or the fold names
        other holders than the store does."""
        view = store.held_by
        if view is None or sum(view.values()) != store.held:
            return owners
        if self.missed[key] or +owners != Counter(view):
            return Counter(view)
        return owners

    def apply_message(self, message: Message) -> None:
        """Fold one decoded event: :meth:`apply` on the fields the ledger reads only (an episode's ``info``
        and arrays are never converted), so a live fold keeps up with a busy stream."""
        body = message.body
        record: dict[str, Any] = {"type": message.kind, "src": message.header.src, "seq": message.header.seq,
                                  "id": message.header.id}
        if isinstance(body, EpisodeFinished):
            record["refs"] = [{"blob_id": ref.blob_id, "source": ref.source} for ref in body.refs]
            record["again"] = body.again
        elif isinstance(body, NodeUp):
            record["node"] = {"node_id": body.node.node_id, "labels": body.node.labels}
        else:
            record.update(msgspec.structs.asdict(body))
        self.apply(record)

    def _refusal(self, record: Mapping[str, Any], key: tuple[str, str], seq: int) -> None:
        """Fold a store's ``violation`` event: ``count`` blob ids refused alike, or refuse the event (logged,
        counted) when its count is not an integer from 1 to :attr:`max_count`."""
        count = record.get("count", 1)
        if type(count) is not int or not 1 <= count <= self.max_count:
            self.refused[key[0]] += 1
            log.error("ledger.violation_refused", src=key[0], seq=seq, count=repr(count)[:64],
                      error=f"a violation's count must be an integer from 1 to {self.max_count} (limits.max_items, "
                      "the most ids one request can name): its violations are not counted")
            return
        # The store's entry is made here too: a refusal may be a restarted process's first event, and the
        # fold must count it for the store's own count of it to agree.
        store = self._store(key)
        if store.counts(seq):
            store.violations += count
        what = record["blob_id"] if count == 1 else f"{count} blobs ({record['blob_id']} first)"
        self._violation(f"{key[0]} refused {record['action']} of {what} by {record['holder']} "
                        f"(owner {record['owner'] or '?'}): {record['detail']}", count)

    def _violation(self, line: str, ids: int = 1) -> None:
        self.violations.append(line)
        self.violated += ids

    def _by_an_end(self, src: str, stage: int, holder: str, blob_id: str, blob: _Blob) -> bool:
        """Whether ``src``'s move of ``blob`` to ``holder`` (``stage``) is folded now. A claim is (its store
        mirrors it). A ``reference`` counts only from an end of its hand-over, as at the stores: ``holder`` itself,
        or the blob's claimer (the orchestrator's repeat); one from a third node is refused (counted by source in
        :attr:`references_refused`, logged at a source's first), as the store refused it. One by a non-holder
        before the blob's claim is folded (relay order across nodes is not causal order) waits for it: one per
        source and blob, gone with the blob."""
        if stage != _STAGE["reference"] or src == holder or (blob.stage == _STAGE["claim"] and src == blob.owner):
            return True
        if blob.stage < _STAGE["claim"]:
            self._unjudged.setdefault(blob_id, {})[src] = holder
            return False
        self._refuse_reference(src, holder, blob_id, blob.owner)
        return False

    def _refuse_reference(self, src: str, holder: str, blob_id: str, owner: str) -> None:
        """``src``'s ``reference`` of ``blob_id`` to ``holder`` is by neither end of the hand-over (``owner``, the
        blob's claimer, or ``holder``): not folded, counted by source in :attr:`references_refused`, logged at a
        source's first."""
        if not self.references_refused[src]:  # once per source: a forged event may name many ids
            log.warning("ledger.reference_refused", src=src, holder=holder, blob_id=blob_id, owner=owner,
                        detail="a hand-over published by neither the blob's holder nor its holder-to-be: not folded, "
                               "as its store refused it; later ones of this source are counted only")
        self.references_refused[src] += 1

    def _judge_waiting(self, blob_id: str, blob: _Blob) -> None:
        """``blob`` moved: the references by non-holders that waited for its claim are judged now."""
        for src, holder in self._unjudged.pop(blob_id, {}).items():
            if blob.stage < _STAGE["reference"] and self._by_an_end(src, _STAGE["reference"], holder, blob_id, blob):
                blob.owner, blob.stage = holder, _STAGE["reference"]

    def _pend(self, src: str, blob_id: str, stage: int, holder: str) -> None:
        """Keep ``src``'s move of ``blob_id`` until the blob's episode-finished comes (relay order across
        nodes is not causal order); past :attr:`pending_moves` ids of ``src``, its oldest is dropped, counted:
        an id never kept (or kept before the stream's window) must not hold memory for ever."""
        ids = self._pending_of[src]
        self._pending.setdefault(blob_id, []).append((src, stage, holder))
        ids[blob_id] = None
        if len(ids) <= self.pending_moves:
            return
        dropped, _ = ids.popitem(last=False)
        if left := [move for move in self._pending.pop(dropped) if move[0] != src]:
            self._pending[dropped] = left  # other sources' moves of it still wait
        if not self.moves_dropped[src]:
            log.warning("ledger.moves_dropped", src=src, limit=self.pending_moves,
                        error="more blob ids moved by this source wait for their episode-finished than the limit: "
                        "the oldest are dropped, and deletes of them by another node are unverified")
        self.moves_dropped[src] += 1

    def _unpend(self, blob_id: str) -> list[tuple[str, int, str]]:
        """The moves of ``blob_id`` waiting for its episode-finished, in order, forgotten here."""
        moves = self._pending.pop(blob_id, [])
        for src in {move[0] for move in moves}:
            del self._pending_of[src][blob_id]
            if not self._pending_of[src]:
                del self._pending_of[src]
        return moves

    def _in_order(self, src: str, incarnation: str, seq: int) -> bool:
        """Whether to fold an event of ``src``'s ``incarnation`` numbered ``seq``: one after the last folded
        (a jump counts what lies between as missed), or one a forced reconcile adopted before it arrived
        (no longer missed; it only moves blobs). A repeat is not."""
        last = self._last.get(src)
        if last is not None and last[0] == incarnation:
            if seq <= last[1]:
                if (store := self.stores.get((src, incarnation))) is None or not store.late(seq):
                    return False
                self.missed[src, incarnation] = max(0, self.missed[src, incarnation] - 1)
                return True
            self.missed[src, incarnation] += seq - last[1] - 1
        else:
            self.missed[src, incarnation] += seq - 1  # a source seen first mid-stream: what came before is missing
        self._last[src] = (incarnation, seq)
        return True

    def _delete(self, record: Mapping[str, Any], key: tuple[str, str], seq: int) -> None:
        holder, reason = record["holder"], record["reason"]
        # Every delete but a holder's ``lost`` event is a store's mirror of its own removal (a lost store back
        # from a partition deletes what was declared lost there: reason ``lost``, ``node`` itself).
        if reason != LOST or record.get("node") == key[0]:
            store = self._store(key)
            if store.counts(seq):
                store.deleted[reason] += len(record["blob_ids"])
        for blob_id in record["blob_ids"]:
            if (tomb := self.tombstones.get(blob_id)) is not None:
                if tomb[1] == LOST and (reason == LOST or reason in STORE_REASONS):
                    continue  # the holder's and the store's side of one loss
                if reason == LOST and record.get("node") != key[0] and tomb[0] in (holder, FORGOTTEN):
                    # A holder declaring lost what its store had deleted at its own request: the request was
                    # carried out, but the answer died with a store reported down until its grace ended. Nothing
                    # was deleted twice. Deleted by anyone else, the holder still listed a blob it had handed over.
                    continue
                first = f"first deleted by {tomb[0]}" if tomb[0] != FORGOTTEN else "first deleted long before"
                self._violation(f"{holder} deleted {blob_id} again ({first})")
                continue
            blob = self.blobs.pop(blob_id, None)
            self._unjudged.pop(blob_id, None)
            self.tombstones.add(blob_id, holder, reason)
            if blob is None:
                self._unpend(blob_id)  # its episode-finished, still on its way, keeps nothing
                if reason == HOLDER_DOWN:
                    self.lost_by[UNKNOWN] += 1
                continue  # kept before the stream's window (a gap): the store's counters cover it
            if blob.key == key:  # its store's own mirror
                self.stores[key].move_held(blob.owner, None, seq)
            if reason == HOLDER_DOWN:
                self._reclaimed(blob, record.get("node") or blob.owner)
            elif reason != LOST and holder != blob.owner and not self._stores_own(blob, holder, reason, key):
                if blob.stage == _STAGE["claim"]:  # the deleter's reference may still be on its way
                    self.awaiting_reference[blob_id] = (holder, blob.owner, reason)
                elif self._move_may_be_missing(holder, blob.owner):
                    self.unverified += 1
                else:
                    self._violation(f"{holder} deleted {blob_id} owned by {blob.owner} ({reason})")

    def _reclaimed(self, blob: _Blob, holder: str) -> None:
        """``blob``'s store reclaimed it from ``holder``, which died (``holder-down``): a loss named with that holder,
        or inherited where the blob was kept before the stream and the stream never showed ``holder`` down. The
        delete's ``node`` names it, as the store knew it, not the fold's owner: the hand-over to a dead rank that
        the store reclaimed from may be relayed after the reclaim (a watcher's copy dropped and filled from the
        ring once the gap showed), and the loss would be named with the orchestrator until it came."""
        if blob.before and holder not in self.went_down:
            self.inherited[blob.store][holder] += 1
        else:
            self.lost_by[holder] += 1

    def _move_may_be_missing(self, deleter: str, owner: str) -> bool:
        """Whether the hand-over that would make ``deleter`` the owner of a blob ``owner`` holds in the fold may be
        among what the fold never got: events missing from either end's stream, or moves of theirs dropped while
        waiting. Gaps elsewhere (a broker's ``node-up`` a watcher joined after, another store's events) cannot
        hide it: one of the hand-over's two ends publishes every move."""
        ends = (deleter, owner)
        return any(n and src in ends for (src, _), n in self.missed.items()) or any(
            self.moves_dropped[end] for end in ends)

    @staticmethod
    def _stores_own(blob: _Blob, holder: str, reason: str, key: tuple[str, str]) -> bool:
        """Whether a delete of ``blob`` naming ``holder`` for ``reason``, published by process ``key``, is its store's
        own removal: a store's reason, naming the store (its source, for replicas) as the holder; for a blob kept
        before the stream (its source never shown), published by the store process that re-adopted it."""
        return reason in STORE_REASONS and (holder in (blob.store, blob.source) or (blob.before and blob.key == key))

    def _first_process(self, src: str, incarnation: str, seq: int) -> bool:
        """Whether every event of ``src``'s ``incarnation`` up to ``seq`` was folded (numbered, none missed) and the
        fold never saw another process of node ``src``: then a blob its own ``claim`` names that the fold never saw
        kept was kept by an earlier process of its store, before the stream began (a durable store re-adopted it
        and publishes its claims again: see :meth:`_adopt`), never by an event still on its way."""
        return bool(seq) and not self.missed[src, incarnation] and all(
            key == (src, incarnation) for key in self._processes if key[0] == src)

    def _adopt(self, src: str, incarnation: str, seq: int, blob_id: str, holder: str) -> None:
        """Store ``src`` (process ``incarnation``) repeats the claim of ``blob_id`` by ``holder``, kept before the
        stream began (see :meth:`_first_process`): the fold keeps it as that process's, counted kept (as a
        re-adopted episode it publishes ``again`` is), with ``holder``. Its store's own deletes of it are no
        violations; one reclaiming it from ``holder``, dead before the stream (never reported down in it), is
        ``INHERITED``, no loss of this run: the stream never showed that holder's process."""
        store = self._store((src, incarnation))
        if store.counts(seq) and not store.reconciled:  # a reconciled store's counters hold it already
            store.kept += 1
        self.blobs[blob_id] = _Blob(store=src, source=src, key=(src, incarnation), owner=holder,
                                    stage=_STAGE["claim"], before=True)

    def _store(self, key: tuple[str, str]) -> _Store:
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = _Store(key[0], down=key[0] in self.down)
            self._processes.add(key)
            self._newest[key[0]] = key
            if key[0] in self._unclaimed:  # its node-up came first: it is that node-up's process
                self._label(key, self._unclaimed.pop(key[0]))
        return store

    def _up(self, node_id: str, identity: str) -> None:
        """A node-up of ``node_id``, labeled ``identity`` (its durable store; "" for none). A node publishes
        once the broker has seen its probe, and the broker publishes the node-up then too, so the node's first
        events may come before it: a store incarnation first seen since the last node-up was taken is the
        process this one announces. Else the next incarnation to publish takes it."""
        newest = self._newest.get(node_id)
        if newest is not None and not self.stores[newest].labeled:
            self._label(newest, identity)
        else:
            self._unclaimed[node_id] = identity

    def _label(self, key: tuple[str, str], identity: str) -> None:
        """``key``'s process serves ``identity`` and its node is up. When an earlier process of the node served
        the same durable store, ``key``'s process re-adopted it: the earlier counters and blobs go on under
        ``key`` (added to what ``key`` counted already), nothing of it is lost. Counters ``key`` already
        reconciled with its store (its node-up folded after the reconcile) are that store's, which its journal
        carried on from the earlier process: they hold the earlier counts already, and nothing is added."""
        store = self.stores[key]
        store.identity, store.labeled = identity, True
        store.down = key[0] in self.down
        earlier = next((k for k, s in self.stores.items()
                        if identity and k != key and k[0] == key[0] and s.labeled and s.identity == identity), None)
        if earlier is None:
            return
        old = self.stores.pop(earlier)
        self.missed[key] += self.missed.pop(earlier, 0)  # the re-adopted counters go on, so they vouch for them
        if store.reconciled:  # the store's counters: the earlier process's violations the stream showed are in
            store.unseen = max(0, store.unseen - (old.violations - old.unseen))
        else:
            store.kept += old.kept
            store.deleted.update(old.deleted)
            store.violations += old.violations
            store.unseen += old.unseen
            store.reconciled = old.reconciled
        for blob in self.blobs.values():
            if blob.key == earlier:
                blob.key = key

    # --- reconciling with the stores ------------------------------------------------------------------

    def reconcile(self, node_id: str, incarnation: str, account: Mapping[str, Any], *, final: bool) -> Reconciled:
        """Compare a store's own counters (an ``accounted`` body as a dict; ``incarnation`` from its reply's
        message id) with the fold of that store's events up to the store's ``seq``.

        Returns ``agreed`` (the fold matches), ``corrected`` (it does not: the store's counters replace the
        fold's, and what changed is recorded), ``ahead`` (the fold already holds later events of the store:
        ask again) or ``behind`` (events up to ``seq`` may still be on their way: try again shortly, or pass
        ``final=True`` to adopt the store's counters now, the missing events counted as missed).
        """
        seq = account["seq"]
        last = self._last.get(node_id)
        seen = last[1] if last is not None and last[0] == incarnation else 0
        if seen > seq:
            return "ahead"
        key = (node_id, incarnation)
        store = self._store(key)
        deleted = Counter({r: n for r, n in account.get("deleted", {}).items() if n})
        violations = sum(account.get("violations", {}).values())
        held_by = {h or node_id: n for h, n in account.get("held_by", {}).items() if n}
        same = store.kept == account["kept"] and store.deleted == deleted and store.violations == violations
        if same and seen == seq:
            store.reconciled = store.reconciled or "agreed"
            # Kept even so: a lost claim or reference moves no count, so agreeing counters say nothing of
            # who holds what.
            store.held_by = held_by
            return "agreed"
        if seen < seq and not final:
            return "behind"
        if seen < seq:  # the events between may still come: they then move blobs, no longer missed
            self.missed[key] += seq - seen
            self._last[node_id] = (incarnation, seq)
            if store.awaited and store.awaited[-1][1] == seen:
                store.awaited[-1] = (store.awaited[-1][0], seq)
            else:
                store.awaited.append((seen, seq))
        store.unseen += max(0, violations - store.violations)
        store.reconciled = (f"corrected: stream kept={store.kept} deleted={store.deleted.total()} "
                            f"violations={store.violations}, store kept={account['kept']} deleted={deleted.total()} "
                            f"violations={violations}")
        store.kept, store.deleted, store.violations = account["kept"], deleted, violations
        store.held_by = held_by
        store.covered = seq
        return "corrected"

    # --- the report -----------------------------------------------------------------------------------

    def report(self) -> LedgerReport:
        early, unverified = [], self.unverified
        for blob_id, (deleter, owner, reason) in self.awaiting_reference.items():
            if self._move_may_be_missing(deleter, owner):
                unverified += 1
            else:
                early.append(f"{deleter} deleted {blob_id} owned by {owner} ({reason}; no reference by {deleter} "
                             "folded)")
        missed: Counter[str] = Counter()
        for (src, _), n in self.missed.items():
            missed[src] += n
        unseen: Counter[str] = Counter()
        for store in self.stores.values():
            unseen[store.node_id] += store.unseen
        report = LedgerReport(violations=[*self.violations,
                                          *(f"{node} counted {n} violations the stream did not show"
                                            for node, n in (+unseen).items()), *early],
                              violated=self.violated + unseen.total() + len(early),
                              refused=+self.refused, references_refused=+self.references_refused,
                              missed=+missed, ended=self.ended,
                              held_at_end=+self.held_at_end)
        by_key: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        for blob in self.blobs.values():
            by_key[blob.key][blob.owner] += 1
        for key, store in self.stores.items():
            node = store.node_id
            report.kept[node] += store.kept
            report.deleted[node].update({r: n for r, n in store.deleted.items() if r not in LOSS_REASONS})
            if store.reconciled:
                report.reconciled[node] = store.reconciled
            held = self._own_view(key, store, by_key.get(key, Counter()))
            report.lost[node] += store.deleted[LOST]
            if store.down:
                report.lost[node] += store.held
                continue
            if held.total() != store.held:  # the stream missed moves of this store, and its own view is not read
                held = Counter({UNKNOWN: store.held})
            report.held[node].update(+held)
            for holder, n in held.items():
                if holder in self.down:
                    report.leaked[holder] += n
        for node, holders in self.inherited.items():
            report.deleted[node][INHERITED] += holders.total()
            report.inherited.update(holders)
        holder_down = sum(s.deleted[HOLDER_DOWN] for s in self.stores.values()) - report.inherited.total()
        report.lost.update(self.lost_by)
        if holder_down > self.lost_by.total():
            report.lost[UNKNOWN] += holder_down - self.lost_by.total()
        report.lost, report.leaked = +report.lost, +report.leaked  # nodes that lost nothing are not named
        report.unaccounted = self._unaccounted(report, unverified)
        return report

    def _unaccounted(self, report: LedgerReport, unverified: int) -> list[str]:
        """What neither the stream nor a store vouches for; ``unverified``: deletes by a node the fold did not show
        as the owner that a missing hand-over may explain."""
        lines = []
        store_nodes = {key[0] for key in self.stores}
        for key, n in sorted(self.missed.items()):
            store = self.stores.get(key)
            if n and key[0] in store_nodes and not (store is not None and store.reconciled):
                lines.append(f"store {key[0]}: {n} of its events missing from the stream and its counters not read: "
                             "its figures are a lower bound")
        for src, n in sorted(self.refused.items()):
            lines.append(f"{src}: {n} violation events refused for their count (not an integer from 1 to "
                         f"{self.max_count}): the violations they report are not counted")
        if unverified:
            lines.append(f"{unverified} deletes by a node the stream did not show as the owner, after events "
                         "went missing: a violation cannot be told from a missed hand-over")
        totals = report.totals()
        if totals["held"] or totals["lost"]:
            for src, n in sorted(report.missed.items()):
                if src not in store_nodes:
                    lines.append(f"{src}: {n} events missing from the stream: who holds or lost the "
                                 f"{totals['held'] + totals['lost']} blobs not deleted may be misnamed")
            if report.lost.get(UNKNOWN) or any(UNKNOWN in h for h in report.held.values()):
                lines.append("blobs whose holder the stream never showed (named '?')")
        return lines


def reconcile_stores(
    runtime: NodeRuntime,
    reconcile: Callable[..., Reconciled],
    settle: Callable[[], None],
    *,
    expected: Collection[str] = (),
    wait_s: float = 0.0,
) -> list[str]:
    """Ask every live store in the registry for its counters (``accounts``, blocking, the runtime's retry
    policy) and reconcile each with ``reconcile(node_id, incarnation, account, final=...)`` (a
    :meth:`Ledger.reconcile`, behind whatever lock the caller's fold needs). ``settle()`` lets the stream
    catch up (a short wait or a turn of the loop that folds it) while a store's events are still on their way;
    a store whose counters run ahead of the fold is asked again. ``expected``: the node ids of the stores that
    must be among them (those a launcher started); the registry is asked again, between settles, for up to
    ``wait_s`` until it lists them all (a store re-joins a restarted broker only at its next heartbeat).
    Returns what could not be done, one line per store (it did not answer, kept changing, or an expected one
    is not in the registry), or one line for a registry the broker did not give: an empty list means every
    store the registry (and ``expected``) named was reconciled."""
    problems = []
    deadline = time.monotonic() + wait_s
    while True:
        stores = runtime.lookup(STORE_ROLE)
        listed = {node.node_id for node in stores or ()}
        if (stores is not None and listed >= set(expected)) or time.monotonic() >= deadline:
            break
        settle()
    if stores is None:
        problems.append("stores: the broker did not answer the registry lookup: no store's counters read")
    else:
        problems += [f"store {name}: not in the registry: its counters not read"
                     for name in sorted(set(expected) - listed)]
    for node in stores or ():
        endpoint = node.endpoints.get("blobs")
        if not endpoint:
            continue
        client = runtime.client(endpoint)
        result: Reconciled = "behind"
        for attempt in range(SETTLE_TRIES):
            if attempt == 0 or result == "ahead":
                try:
                    reply = client.request(Accounts())
                except (RemoteError, RequestTimeout) as exc:
                    problems.append(f"store {node.node_id}: counters not read ({exc})")
                    break
                if not isinstance(reply.body, Accounted):
                    problems.append(f"store {node.node_id}: answered {reply.kind}, not {Accounted.kind}")
                    break
                account = msgspec.to_builtins(reply.body)
            result = reconcile(node.node_id, incarnation(reply.header.id), account, final=attempt == SETTLE_TRIES - 1)
            if result in ("agreed", "corrected"):
                break
            settle()
        else:
            problems.append(f"store {node.node_id}: its counters kept running ahead of the stream")
    for problem in problems:
        log.warning("ledger.store_unread", problem=problem)
    return problems


class _RecordHeader(msgspec.Struct):
    """The header fields of a ``refbus monitor --json`` record the fold reads (the rest are the body's)."""

    type: str
    src: str = ""
    seq: NonNegative = 0
    id: str = ""


class _Ref(msgspec.Struct):
    blob_id: str
    source: str = ""


class _Node(msgspec.Struct):
    node_id: str
    labels: dict[str, str] = {}


class _Finished(msgspec.Struct):
    refs: list[_Ref]
    again: bool = False


class _Moved(msgspec.Struct):
    blob_ids: list[str]
    holder: str


class _Deleted(msgspec.Struct):
    blob_ids: list[str]
    holder: str
    reason: str
    node: str = ""


class _Refused(msgspec.Struct):  # its ``count`` is the fold's to judge: a bad one is a refused event, counted
    blob_id: str
    action: str
    holder: str
    owner: str
    detail: str


class _Down(msgspec.Struct):
    node_id: str


class _Up(msgspec.Struct):
    node: _Node


# What the fold reads of each kind it folds (extra fields are the reader's to ignore: a record filtered down
# to these, by hand or with jq, is folded alike).
_READ: dict[str, type[msgspec.Struct]] = {"episode-finished": _Finished, "claim": _Moved, "reference": _Moved,
                                          "delete": _Deleted, "violation": _Refused, "node-down": _Down,
                                          "node-up": _Up}
_HEADER_KEYS = ("type", "src", "seq", "id")


def read_records(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    """Records from ``refbus monitor --json`` output; blank lines skipped. A line that is not a JSON object, or
    a record whose header or whose fields the fold reads do not have the types it reads them as, raises
    ``ValueError`` with its number: the fold never meets a field it cannot read."""
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number}: not a JSON event record ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"line {number}: not a JSON event record (a {type(record).__name__}, not an object)")
            _check_record(record, number)
            yield record


def _check_record(record: dict[str, Any], number: int) -> None:
    try:
        header = msgspec.convert({k: record[k] for k in _HEADER_KEYS if k in record}, _RecordHeader)
    except msgspec.ValidationError as exc:
        raise ValueError(f"line {number}: not an event record ({exc})") from None
    read = _READ.get(header.type)
    if read is None:
        return
    try:
        msgspec.convert(record, read)
    except msgspec.ValidationError as exc:
        raise ValueError(f"line {number}: not a {header.type} event record ({exc})") from None


def format_report(report: LedgerReport) -> str:
    lines = []
    data = report.as_dict()
    for store, entry in data["stores"].items():
        deleted = ", ".join(f"{r}={n}" for r, n in sorted(entry["deleted"].items())) or "-"
        held = ", ".join(f"{h}={n}" for h, n in sorted(entry["held"].items())) or "-"
        note = f" ({entry['reconciled']})" if entry["reconciled"] else ""
        lines.append(f"{store}: kept={entry['kept']} deleted[{deleted}] held[{held}]{note}")
    total = data["total"]
    lines.append(
        f"total: kept={total['kept']} deleted={total['deleted_total']} held={total['held']} lost={total['lost']} "
        f"leaked={total['leaked']} violations={total['violations']} missed_events={total['missed_events']}"
    )
    lines.extend(f"lost: {n} with {node}" for node, n in sorted(report.lost.items()))
    lines.extend(f"leaked: {n} held by {node} (down)" for node, n in sorted(report.leaked.items()))
    lines.extend(f"inherited: {n} kept before the stream, reclaimed from {holder} (dead before it)"
                 for holder, n in sorted(report.inherited.items()))
    if report.ended:
        lines.extend(f"held at run end: {n} by {holder}" for holder, n in sorted(report.held_at_end.items()))
    lines.extend(f"unaccounted: {u}" for u in report.unaccounted)
    lines.extend(f"references refused: {n} blob ids handed over by {src}, neither end of the hand-over"
                 for src, n in sorted(report.references_refused.items()))
    lines.extend(f"violation: {v}" for v in report.violations)
    lines.append("ok" if report.ok else "NOT ok")
    return "\n".join(lines)
