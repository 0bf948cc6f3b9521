"""The ps-worker role (``refbus node ps-worker``): the parameter server's data plane on one host.

A worker holds shards (one segment each) in shared memory from a :class:`~.shm.SegmentPool`, so memory is
mapped once and reused version after version:

* **push**: ``ps-shard-open`` gives the pusher a segment, answered once it is made (a slice a loop turn), by
  name: a same-host pusher maps it and writes directly; a cross-host one sends ``ps-shard-write`` frames, hashed
  per tensor as they are copied in when the open named the tensors' ranges (:mod:`.streamed`).
  ``ps-shard-seal`` checks every tensor against the pusher's checksums (the streamed digest where it holds,
  else a hash of the segment, a slice a loop turn) and forwards the verified shard to the manager
  (``ps-shard-commit``). The pusher's answer is the manager's (the reply is deferred until it arrives), so
  "acknowledged" means "recorded".
* **pull**: same-host readers (proved by the kernel's boot id and a nonce file next to the segments,
  :mod:`.host_proof`) map segments themselves and never talk to the worker; ``ps-shard-read``
  serves cross-host readers with zero-copy frames that view the segment.
* **release**: the manager names shards that no version or push needs any more; their segments go back to
  the pool. Taken from that manager only: any other peer could free a copy readers hold.
* **broadcast init**: plan, header, chunks and end drive a :class:`~.broadcast.Relay` per init. The manager
  plans an init with every worker of its tree (plans are taken from the manager only): the root reads the
  checkpoint, every other worker takes that init's header only when it carries the planned tree and comes
  from the parent that tree names, so an init the manager never ran takes no memory; chunks and the end are
  taken only from the worker whose header made the relay. A planned init's segment is bounded by the
  filesystem's free space, checked before the segment is made (``no-room``), not by ``ps.max_open_bytes``.
* **unclaimed segments**: any peer may open a shard, and the manager releases only what it granted or
  planned. A segment is claimed by a verified seal (a push) or verification (an init); until then a push's
  (from the start of its making) counts against ``ps.max_open_bytes`` and ``MAX_OPEN_SHARDS`` (a further open
  is refused ``open-limit``), and one still unclaimed ``ps.push_timeout_s`` after its open (``ps.init_timeout_s``
  after its plan or header) goes back to the pool: by then the manager has aborted any push it granted (every
  rank commits within ``push_timeout_s`` of its version's first grant) and failed any init it ran. A plan whose
  header never came is forgotten as late.
* **a restarted manager**: the worker tracks the registry's ``node-up``/``node-down`` events; a ps-manager
  that comes up as another process than the one it knew (or after the bus reported it down) knows nothing of
  this worker, so it registers again, listing its segments (a finished init's verified copy among them), and
  abandons the broadcast inits still in progress (they belonged to the dead process, which will never commit
  or release them).

The worker never decides what is committed or freed: the manager does. Single-threaded on the node loop.
Tensors are moved as bytes (numpy uint8), so this process never imports torch unless a CUDA driver is
present (for pinning).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog

from ...bus.memory import keep_receive_memory
from ...bus.peers import incarnation
from ...bus.reqrep import SEND_ONCE, HandlerError, Outcome, Pending, RemoteError, RequestTimeout, RetryPolicy
from ...bus.runtime import NodeRuntime
from ...protocol.codec import SlicedChecksums, Unhashed
from ...protocol.envelope import NIL_CHECKSUM_SINCE, Message
from ...protocol.messages import Body, Error, NodeDown, NodeInfo, Ok
from ...protocol.messages_ps import (
    InitChunk,
    InitEnd,
    InitHeader,
    InitPlan,
    NixlOpen,
    PsRegister,
    Release,
    ShardCommit,
    ShardData,
    ShardOpen,
    ShardOpened,
    ShardRead,
    ShardSeal,
    ShardTensor,
    ShardWrite,
    WorkerInfo,
)
from ..config import Config, ConfigError
from ..settings import PsSettings, StoreSettings
from ..store.durable import DurableStore, StoreError, StoreLocked
from .broadcast import Relay, parent
from .host_proof import NonceFile, boot_id
from .nixl import NixlError, NixlExport, require_nixl
from .shard_journal import ShardJournal, ShardReadoption
from .shm import Allocation, OwnerLock, Segment, SegmentPool, segment_bytes, sweep_orphans
from .streamed import BadLayout, StreamedDigests

log = structlog.get_logger(__name__)

RELEASED_REMEMBERED = 65_536  # released leases an open is checked against (see PsWorker.released)
# Segments a worker holds unclaimed at once (see the module doc): a handful per rank of the version being pushed,
# and one mapping each, so a peer's empty opens cannot run the process into the kernel's map count (65,530).
MAX_OPEN_SHARDS = 4096


def served_pieces(pieces: list[np.ndarray], asked_in: tuple[int, int]) -> list[np.ndarray | Unhashed]:
    """The frames of a shard read asked in protocol ``asked_in``: unhashed, since the reader checks every
    tensor against the manifest's checksum (see .frames) and a frame checksum would cost this worker a pass
    over every byte served that nobody needs; hashed for a reader too old to read an unhashed frame."""
    if tuple(asked_in) < NIL_CHECKSUM_SINCE:
        return list(pieces)
    return [Unhashed(piece) for piece in pieces]


class PsWorker:
    """Serves the data plane on ``runtime``; call :meth:`register` before the runtime runs."""

    def __init__(self, runtime: NodeRuntime, settings: PsSettings, *, register_timeout_s: float = 15.0,
                 store: StoreSettings | None = None, run: str = "") -> None:
        self.runtime = runtime
        keep_receive_memory()  # pushed pieces land where the last push's were, not on fresh pages
        self.settings = settings
        self.register_timeout_s = register_timeout_s
        self.journal: ShardJournal | None = None
        self.readoption: ShardReadoption | None = None
        directory = Path(settings.shm_dir)
        # Without the durable store (whose own lock covers its directory), this process's names in the shared
        # directory are claimed by a lock file held for its life: the sweep of another worker (in any PID
        # namespace) leaves them alone while it lives, and removes them once it is dead.
        self.owner: OwnerLock | None = None
        if store is not None and store.durable:
            # Segments live in the durable store's directory: same-host peers map them there, before and
            # after a restart. The worker has no byte budget of its own: a full tmpfs refuses the next shard.
            self.journal = ShardJournal(DurableStore(store.directory, store.run or run, runtime.node_id,
                                                     budget_bytes=0, what="ps"))
            directory = self.journal.store.path
        else:
            self.owner = OwnerLock.take(settings.shm_dir, settings.shm_prefix)
            sweep_orphans(settings.shm_dir, settings.shm_prefix)
        token = self.owner.token if self.owner is not None else None
        self.pool = SegmentPool(directory, settings.shm_prefix, pin=settings.pin_memory,
                                max_free=settings.max_free_segments, token=token)
        self.shards: dict[str, Segment] = {}  # push lease or init id -> its segment
        self.streamed: dict[str, StreamedDigests] = {}  # push lease -> digests of its frames as written
        # Leases whose seal verified: their bytes are what readers are promised, so no write may change them.
        self.sealed: set[str] = set()
        # Leases released lately: an open that arrives after its release (queued behind it) would take a segment
        # nobody ever releases again. Leases are never reused, so remembering the last few thousand is enough.
        self.released: OrderedDict[str, None] = OrderedDict()
        # Shards whose segment is not claimed yet (see the module doc) -> when it goes back to the pool unclaimed.
        self.unclaimed: dict[str, float] = {}
        self.max_open_bytes = settings.max_open_bytes or _half_of(directory)
        if self.journal is not None:
            self._readopt(self.journal)
        # Made after re-adoption, whose sweep removes the proof file a killed process left in the directory.
        self.host_proof = NonceFile.create(directory, settings.shm_prefix, token)
        runtime.shutdown_hooks.append(self.host_proof.remove)
        self.relays: dict[str, Relay] = {}
        self._sealing: dict[str, list[Pending]] = {}  # push lease -> pushers waiting on its seal: hashing or commit
        self._hashing: set[str] = set()  # push leases whose seal is hashing the segment, a slice a loop turn
        self._parents: dict[str, str] = {}  # init id -> the node id its header came from: the one sender of its chunks
        # Init id -> the manager's plan of an init this worker is below the root of, until its header comes (and
        # when that plan is forgotten unheard): the one header it takes.
        self._planned: dict[str, tuple[InitPlan, float]] = {}
        self._making: dict[str, Allocation] = {}  # push lease or init id -> its segment, made a slice a loop turn
        self._opening: dict[str, list[Pending]] = {}  # push lease -> pushers waiting on its open while it is made

        self.server = runtime.serve("ps", settings.worker)
        self.server.on(ShardOpen.kind, self._open)
        # Pieces are not hashed on receipt: the seal verifies every tensor against the pusher's checksums.
        self.server.on(ShardWrite.kind, self._write, verify=False)
        self.server.on(ShardSeal.kind, self._seal, cached=False)
        self.server.on(ShardRead.kind, self._read, cached=False)
        self.nixl = NixlExport(runtime.node_id)
        self.server.on(NixlOpen.kind, self._nixl_open, cached=False)
        self.server.on(Release.kind, self._release)
        self.server.on(InitPlan.kind, self._plan)
        self.server.on(InitHeader.kind, self._header)
        self.server.on(InitChunk.kind, self._chunk)
        self.server.on(InitEnd.kind, self._end)
        self.manager = runtime.calls.client(settings.manager, held=True)  # kept here: never forgotten
        # The node id of the manager that answered this worker's last registration: the one sender of plans.
        self._manager_id = ""
        # The manager process registered with last (host, pid, start time; None until the bus names it), and
        # whether the bus reported it down since: either way a manager that comes up must hear from this worker.
        self._manager_seen: tuple[str, int, float] | None = None
        self._manager_lost = False
        peers = runtime.track_peers()
        peers.on_up(self._manager_up)
        peers.on_down(self._manager_down)
        runtime.shutdown_hooks.append(self._close)
        runtime.every(min(0.25, settings.lease_ttl_s / 4), self._expire_unclaimed)
        runtime.status = lambda: {"shards": float(len(self.shards)), "in_use_bytes": float(self.pool.in_use_bytes),
                                  "free_bytes": float(self.pool.free_bytes)}
        runtime.metric("refbus_ps_held_bytes", "Shared memory held by this ps-worker, in use or kept for reuse.",
                       lambda: {("in_use",): float(self.pool.in_use_bytes), ("free",): float(self.pool.free_bytes)},
                       labels=("state",), kind="gauge")
        runtime.metric("refbus_ps_segments_created_total", "Shared-memory segments created (not reused).",
                       lambda: {(): float(self.pool.created)})
        self.seal_hashed = {"streamed": 0, "segment": 0}
        runtime.metric("refbus_ps_sealed_tensors_total", "Tensors a seal verified, by where their digest came "
                       "from: streamed as frames were written, or hashed from the segment.",
                       lambda: {(how,): float(n) for how, n in self.seal_hashed.items()}, labels=("digest",))

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.runtime.node_id, self.runtime.endpoints["ps"], self.runtime.settings.host,
                          str(self.pool.directory), os.getpid(), boot_id(), self.host_proof.path.name,
                          self.host_proof.nonce, self.runtime.started)

    def register(self) -> None:
        """Join the parameter server (blocking, before the loop runs), telling it the sealed shards held (a
        restart's re-adopted ones); RequestTimeout if no manager answers."""
        policy = RetryPolicy(timeout_s=1.0, attempts=max(1, int(self.register_timeout_s)), backoff=1.0)
        self._manager_id = self.manager.request(self._registration(), policy=policy).header.src
        log.info("ps.worker_registered", manager=self.settings.manager, endpoint=self.runtime.endpoints["ps"])

    def _manager_down(self, down: NodeDown, last: NodeInfo | None) -> None:
        if down.role == "ps-manager":
            self._manager_lost = True
            if last is not None:
                self._manager_seen = incarnation(last)

    def _manager_up(self, node: NodeInfo) -> None:
        """A ps-manager's node-up: register again when it is not the process this worker registered with (see
        the module doc); the first one the bus names is taken to be that process."""
        if node.role != "ps-manager":
            return
        seen, self._manager_seen = self._manager_seen, incarnation(node)
        restarted = seen is not None and seen != self._manager_seen
        if not (restarted or self._manager_lost):
            return
        self._manager_lost = False
        if restarted:
            for init_id in [*(i for i, relay in self.relays.items() if not relay.verified), *self._planned]:
                log.warning("ps.init_abandoned", init_id=init_id, reason="the ps-manager restarted")
                self._drop(init_id)
        log.info("ps.manager_restarted" if restarted else "ps.manager_back", manager=node.node_id, pid=node.pid)
        self._reregister(self._manager_seen)

    def _reregister(self, manager: tuple[str, int, float]) -> None:
        """Register with the manager process ``manager`` on the loop; sent again after a request that went
        unanswered while that process is still the one known (its retry schedule paces the attempts). A manager
        reported down meanwhile is registered with at its next node-up."""
        def done(outcome: Outcome) -> None:
            if isinstance(outcome, Message):
                self._manager_id = outcome.header.src
                log.info("ps.worker_registered", manager=self.settings.manager, again=True)
                return
            retry = isinstance(outcome, RequestTimeout) and self._manager_seen == manager and not self._manager_lost
            log.warning("ps.register_failed", error=str(outcome), retrying=retry)
            if retry:
                self._reregister(manager)

        self.runtime.calls.request(self.settings.manager, self._registration(), done)

    def _registration(self) -> PsRegister:
        """This worker and the shards it holds: its broadcast inits' only once verified (one in progress is its
        manager's to release)."""
        held = {segment.name: lease for lease, segment in self.shards.items()
                if lease not in self.relays or self.relays[lease].verified}
        return PsRegister(self.info(), sorted(held), held)

    def _readopt(self, journal: ShardJournal) -> None:
        """Serve again the shards an earlier process of this worker sealed, each verified (a shard that fails
        is lost, named)."""
        self.readoption = found = journal.readopt()
        for shard in found.shards:
            self.shards[shard.lease] = self.pool.adopt(shard.segment)
            self.sealed.add(shard.lease)
        if not journal.store.fresh:
            log.info("store.readopted", store=str(journal.store.path), shards=len(found.shards),
                     versions=sorted({s.version for s in found.shards}), lost=len(found.lost), swept=found.swept,
                     seconds=round(found.seconds, 4))
        for lease, why in found.lost.items():
            log.error("store.shard_lost", shard=lease, detail=why)

    def _close(self) -> None:
        self.nixl.close()
        self.pool.close()
        if self.journal is not None:  # every segment is unlinked: nothing is left to re-adopt
            self.journal.close(remove=True)
        if self.owner is not None:  # last: the segments (and the nonce file, an earlier hook) are gone
            self.owner.release()

    # --- push ---------------------------------------------------------------------------------------

    def _shard(self, lease: str) -> Segment:
        segment = self.shards.get(lease)
        if segment is None:
            raise HandlerError("unknown-shard", f"no open shard for {lease!r} (aborted, released or never opened)")
        return segment

    def _open(self, request: Message) -> Body | None:
        """Give the push ``lease`` its segment. A new one is made ``ALLOCATE_SLICE_BYTES`` a loop turn, the first in
        this one (:meth:`_make`): a shard of tens of GiB stalls no heartbeat. The answer waits until it is made
        (a free segment of the pool, or one of a slice, is answered at once); it counts against
        ``ps.max_open_bytes`` from the start. A pusher's retry joins the open in progress; a release or the lease's
        end meanwhile answers every waiting pusher ``released`` and removes what was made; a failure midway
        (another process took the room) answers them ``no-room``."""
        ask = request.body
        assert isinstance(ask, ShardOpen)
        try:
            streamed = StreamedDigests(ask.tensors, ask.nbytes) if ask.tensors else None
        except BadLayout as exc:
            raise HandlerError("bad-layout", f"shard {ask.lease!r}: {exc}") from None
        if ask.lease in self.released:
            raise HandlerError("released", f"shard {ask.lease!r} was released: a push needs a new grant")
        segment = self.shards.get(ask.lease)
        making = self._making.get(ask.lease)
        if segment is None and making is None:
            self._bound_unclaimed(ask.lease, ask.nbytes)
            segment = self._make(ask.lease, ask.nbytes, self.settings.push_timeout_s,
                                 lambda made: self._opened(ask.lease, made),
                                 lambda why: self._not_opened(ask.lease, why))
        capacity = segment.capacity if segment is not None else self._making[ask.lease].capacity
        if capacity < ask.nbytes:
            raise HandlerError("bad-size", f"shard {ask.lease!r} is open with {capacity} bytes, not {ask.nbytes}")
        if streamed is not None:  # a repeated open keeps the first one's digests: they hold whatever came since
            self.streamed.setdefault(ask.lease, streamed)
        if segment is None:
            self._opening.setdefault(ask.lease, []).append(self.server.pending)
            return None
        return ShardOpened(segment.name, segment.capacity)

    def _opened(self, lease: str, segment: Segment) -> None:
        """The segment of push ``lease`` is made: every pusher waiting on its open hears its name."""
        for pending in self._opening.pop(lease, []):
            self.server.answer(pending, ShardOpened(segment.name, segment.capacity))

    def _not_opened(self, lease: str, why: str) -> None:
        """The segment of push ``lease`` could not be made (what was made is removed): its open is refused to
        every pusher waiting on it, and a later open starts again."""
        self.streamed.pop(lease, None)
        for pending in self._opening.pop(lease, []):
            self.server.answer(pending, Error("no-room", why, ShardOpen.kind))

    def _write(self, request: Message) -> Body:
        write = request.body
        assert isinstance(write, ShardWrite)
        segment = self._shard(write.lease)
        if write.lease in self.sealed:
            raise HandlerError("sealed", f"shard {write.lease!r} is sealed: its bytes are verified and may be served")
        if write.lease in self._hashing:
            raise HandlerError("sealed", f"shard {write.lease!r} is being sealed: its bytes are being verified")
        if len(write.offsets) != len(write.data):
            raise HandlerError("bad-write", f"{len(write.offsets)} offsets for {len(write.data)} buffers")
        streamed = self.streamed.get(write.lease)
        for offset, data in zip(write.offsets, write.data, strict=True):
            source = np.asarray(data).reshape(-1).view(np.uint8)
            try:
                target = np.frombuffer(segment.view(offset, source.nbytes), np.uint8)
            except ValueError as exc:
                raise HandlerError("out-of-bounds", str(exc)) from None
            if streamed is None:
                target[:] = source
            else:
                streamed.write(target, offset, source)
        return Ok()

    def _seal(self, request: Message) -> Body | None:
        """Verify every checksum, then let the manager's answer be the pusher's answer. The tensors not streamed
        are hashed from the segment ``HASH_SLICE_BYTES`` a loop turn (the first in this one): a shard of tens of
        GiB stalls no heartbeat. Meanwhile the shard takes no write (``sealed``) and is not readable (not sealed
        yet); a release or the unclaimed timeout stops the hashing (:meth:`_drop` answers ``released``). A
        pusher's retry joins the seal in progress, hashing or committing."""
        seal = request.body
        assert isinstance(seal, ShardSeal)
        segment = self._shard(seal.lease)
        waiting = self._sealing.get(seal.lease)
        if waiting is not None:
            waiting.append(self.server.pending)
            return None
        streamed = self.streamed.get(seal.lease)
        hashed: list[ShardTensor] = []  # the tensors hashed from the segment
        for t in seal.tensors:
            try:
                segment.view(t.offset, t.nbytes)
            except ValueError as exc:
                raise HandlerError("out-of-bounds", f"tensor {t.name!r}: {exc}") from None
            got = None if streamed is None else streamed.digest(t.offset, t.nbytes)
            if got is None:
                hashed.append(t)
                continue
            self.seal_hashed["streamed"] += 1
            if got != t.checksum:
                raise self._mismatch(seal, t, got)
        waiting = self._sealing[seal.lease] = [self.server.pending]
        self._hashing.add(seal.lease)
        hashing = SlicedChecksums(segment.view, [(t.offset, t.nbytes) for t in hashed])

        def step() -> None:
            if self._sealing.get(seal.lease) is not waiting:  # released: _drop answered the pushers
                return
            if not hashing.step():
                self.runtime.later(0.0, step)
                return
            self._hashing.discard(seal.lease)
            for t, got in zip(hashed, hashing.digests, strict=True):
                self.seal_hashed["segment"] += 1
                if got != t.checksum:
                    self._answer_sealing(seal.lease, self._mismatch(seal, t, got))
                    return
            self._verified(seal, segment)

        step()
        return None

    @staticmethod
    def _mismatch(seal: ShardSeal, t: ShardTensor, got: int) -> HandlerError:
        return HandlerError("checksum", f"tensor {t.name!r} of version {seal.version} rank {seal.rank}: the bytes "
                            f"written hash to {got:#x}, the pusher declared {t.checksum:#x}")

    def _verified(self, seal: ShardSeal, segment: Segment) -> None:
        """Every tensor of ``seal`` checked: the shard is sealed (journaled first, when durable) and committed at the
        manager, whose answer goes to every pusher waiting on the seal."""
        self.sealed.add(seal.lease)
        if self.journal is not None:  # durable before anyone is told: the manager, then the pusher
            self.journal.sealed(seal.lease, seal.version, seal.rank, segment.name, seal.tensors)
        commit = ShardCommit(seal.lease, seal.version, seal.rank, self.runtime.node_id, segment.name, seal.tensors)
        self.runtime.calls.request(self.settings.manager, commit, lambda outcome: self._committed(seal.lease, outcome))

    def _answer_sealing(self, lease: str, error: HandlerError) -> None:
        """Refuse the seal in progress of ``lease`` to every pusher waiting on it."""
        for pending in self._sealing.pop(lease, []):
            self.server.answer(pending, Error(error.code, str(error), ShardSeal.kind))

    def _committed(self, lease: str, outcome: Outcome) -> None:
        """The manager's answer to a commit is the answer to every pusher waiting on it."""
        if isinstance(outcome, Message):
            answer = outcome.body
        elif isinstance(outcome, RemoteError):
            answer = Error(outcome.code, outcome.detail, ShardCommit.kind)
        else:
            answer = Error("manager-unreachable", f"the commit was not recorded: {outcome}", ShardCommit.kind)
        for pending in self._sealing.pop(lease, []):
            self.server.answer(pending, answer)

    def _report(self, body: Body) -> None:
        self.runtime.calls.request(self.settings.manager, body, self._reported)

    @staticmethod
    def _reported(outcome: Outcome) -> None:
        if not isinstance(outcome, Message):
            log.warning("ps.manager_error", error=str(outcome))

    # --- pull and release ---------------------------------------------------------------------------

    def _serving(self, name: str) -> Segment:
        """The segment ``name`` that readers may read; HandlerError ``unknown-segment`` when it holds no shard."""
        segment = self.pool.get(name)
        if segment is None:
            raise HandlerError("unknown-segment", f"segment {name!r} holds no shard on {self.runtime.node_id}")
        return segment

    def _read(self, request: Message) -> Body:
        read = request.body
        assert isinstance(read, ShardRead)
        segment = self._serving(read.segment)
        try:
            # Zero-copy: the frames view the segment, which the reader's pull lease keeps from being reused.
            pieces = [np.frombuffer(segment.view(r.offset, r.nbytes), np.uint8) for r in read.ranges]
        except ValueError as exc:
            raise HandlerError("out-of-bounds", str(exc)) from None
        return ShardData(served_pieces(pieces, request.header.v))

    def _nixl_open(self, request: Message) -> Body:
        ask = request.body
        assert isinstance(ask, NixlOpen)
        segment = self._serving(ask.segment)
        try:  # registered until released, as the frames' views are: the reader's pull lease keeps it from reuse
            return self.nixl.open(segment.name, segment.address, segment.capacity)
        except NixlError as exc:
            raise HandlerError("nixl-unavailable", str(exc)) from None

    def _release(self, request: Message) -> Body:
        """The manager frees shards. Taken only from the manager this worker registered with (see
        :meth:`_from_manager`): a release from any other peer would take the bytes of a version readers hold, or of
        a copy being pushed, from under them."""
        release = request.body
        assert isinstance(release, Release)
        self._from_manager(request, "releases")
        if self.journal is not None:
            self.journal.released(release.shards)
        for shard in release.shards:
            self._drop(shard)
        return Ok()

    def _drop(self, shard: str) -> None:
        """Hand ``shard``'s segment back to the pool (its release is journaled by the caller, if it was sealed)
        and remember it released."""
        relay = self.relays.pop(shard, None)
        if relay is not None:  # before its segment goes back to the pool, which may hand it to a new shard
            relay.abandon()
        if shard in self._hashing:  # before the segment goes back too: the next step sees the seal is over
            self._hashing.discard(shard)
            self._answer_sealing(shard, HandlerError("released", f"shard {shard!r} was released while its seal "
                                                     "was verified"))
        self.streamed.pop(shard, None)
        self.sealed.discard(shard)
        self.unclaimed.pop(shard, None)
        self._parents.pop(shard, None)
        self._planned.pop(shard, None)
        self.released[shard] = None
        self.released.move_to_end(shard)
        while len(self.released) > RELEASED_REMEMBERED:
            self.released.popitem(last=False)
        allocation = self._making.pop(shard, None)
        if allocation is not None:
            allocation.abandon()
        for pending in self._opening.pop(shard, []):
            self.server.answer(pending, Error("released", f"shard {shard!r} was released while its segment was "
                                              "made: a push needs a new grant", ShardOpen.kind))
        segment = self.shards.pop(shard, None)
        if segment is not None:
            self.nixl.forget(segment.name)
            self.pool.release(segment)

    # --- broadcast init -----------------------------------------------------------------------------

    def _relay(self, init_id: str) -> Relay:
        """A new relay of ``init_id``, made by its plan or header; HandlerError ``released`` once the init was
        released here (a late header would make a relay nobody releases again), ``bad-init`` when it has one."""
        self._refuse_released(init_id)
        if init_id in self.relays:
            raise HandlerError("bad-init", f"init {init_id!r} has started on {self.runtime.node_id} already: a worker "
                               "takes one plan or header per init")
        relay = self.relays[init_id] = Relay(init_id, self.runtime.node_id, acquire=self._acquire,
                                             send=self._send_peer, report=self._report, later=self.runtime.later)
        return relay

    def _refuse_released(self, init_id: str) -> None:
        if init_id in self.released:
            raise HandlerError("released", f"init {init_id!r} was released on {self.runtime.node_id}")

    def _joined(self, init_id: str, src: str) -> Relay:
        """The relay of ``init_id`` for a chunk or end sent by ``src``: HandlerError ``released`` once the init was
        released here, ``unknown-init`` before its header, ``not-parent`` from any node but the header's sender."""
        relay = self.relays.get(init_id)
        if relay is None:
            self._refuse_released(init_id)
            raise HandlerError("unknown-init", f"no header of init {init_id!r} reached {self.runtime.node_id}: its "
                               "chunks and end follow it")
        sender = self._parents.get(init_id)
        if src != sender:
            raise HandlerError("not-parent", f"{src!r} is not the parent of {self.runtime.node_id} in init "
                               f"{init_id!r} ({sender or 'none: the root'!r}): only it sends chunks and the end")
        return relay

    def _acquire(self, shard: str, nbytes: int, then: Callable[[Segment], None]) -> None:
        """Make the segment of the planned init ``shard`` (:meth:`_make`), then ``then(segment)``. HandlerError
        ``released`` once the init was released here, ``no-room`` as :meth:`_make` says; a failure midway fails
        the init's relay."""
        if shard in self.released:  # a segment taken now would never be released
            raise HandlerError("released", f"init {shard!r} was released on {self.runtime.node_id}")
        segment = self._make(shard, nbytes, self.settings.init_timeout_s, then,
                             lambda why: self.relays[shard].fail(self.runtime.node_id, why))
        if segment is not None:
            then(segment)

    def _make(self, shard: str, nbytes: int, claim_within_s: float, then: Callable[[Segment], None],
              failed: Callable[[str], None]) -> Segment | None:
        """Make a segment of ``nbytes`` for ``shard``, ``ALLOCATE_SLICE_BYTES`` a loop turn, the first in this one:
        a segment of tens of GiB stalls no heartbeat. Returns it when that first step made it (a free segment of
        the pool that fits, or one slice); else it goes to ``then`` in a later turn. Once made it is the shard's,
        back to the pool unless claimed within ``claim_within_s`` of now (see the module doc).

        HandlerError ``no-room`` when the filesystem has not the room (checked before anything is made, see
        :meth:`_check_room`) or the first step fails; a later step that fails (another process took the room)
        passes why to ``failed``. Either way what was made is removed. A release meanwhile (:meth:`_drop`) stops
        it and removes what was made; neither callback is called then."""
        self._check_room(shard, nbytes)
        allocation = self._making[shard] = self.pool.allocate(nbytes)
        due = time.monotonic() + claim_within_s

        def step() -> Segment | None:
            try:
                segment = allocation.step()
            except OSError as exc:  # the allocation removed its file
                del self._making[shard]
                raise HandlerError("no-room", f"cannot make a segment of {allocation.capacity} bytes for {shard!r} "
                                   f"in {self.pool.directory}: {exc.strerror or exc}") from None
            if segment is not None:
                del self._making[shard]
                self.shards[shard] = segment
                self.unclaimed[shard] = due
            return segment

        def later() -> None:
            if self._making.get(shard) is not allocation:  # released: _drop abandoned it
                return
            try:
                segment = step()
            except HandlerError as exc:
                failed(str(exc))
                return
            if segment is None:
                self.runtime.later(0.0, later)
            else:
                then(segment)

        segment = step()
        if segment is None:
            self.runtime.later(0.0, later)
        return segment

    def _bound_unclaimed(self, lease: str, nbytes: int) -> None:
        """HandlerError ``open-limit`` when a segment of ``nbytes`` for push ``lease`` would pass the bounds on the
        pushes' unclaimed segments (see the module doc; a planned init's are not counted: the manager ran it)."""
        # Segments being made count from their start: opens made at once must not pass the bound together.
        made = [s for s in self._unclaimed() if s not in self.relays]
        making = [s for s in self._making if s not in self.relays]
        pushes = made + making
        held = sum(self.shards[s].capacity for s in made) + sum(self._making[s].capacity for s in making)
        more = segment_bytes(nbytes)
        if len(pushes) >= MAX_OPEN_SHARDS or held + more > self.max_open_bytes:
            raise HandlerError("open-limit", f"{self.runtime.node_id} holds {len(pushes)} segments ({held} bytes) "
                               f"for pushes not yet sealed; {lease!r} would pass its bound of {MAX_OPEN_SHARDS} "
                               f"segments and {self.max_open_bytes} bytes (ps.max_open_bytes) with {more} bytes "
                               "more: they are freed as they are sealed or released")

    def _check_room(self, shard: str, nbytes: int) -> None:
        """HandlerError ``no-room`` unless the pool holds a free segment of ``nbytes`` or the filesystem has room
        for a new one, less what the segments still being made will take: said before anything is made, where a
        full filesystem would fail the shard midway (or fail one admitted earlier, whose slices it would share)."""
        if self.pool.reusable(nbytes) is not None:
            return
        fs = os.statvfs(self.pool.directory)
        promised = sum(allocation.remaining for allocation in self._making.values())
        free, need = fs.f_bavail * fs.f_frsize - promised, segment_bytes(nbytes)
        if need > free:
            raise HandlerError("no-room", f"shard {shard!r} needs a segment of {need} bytes on "
                               f"{self.runtime.node_id}; {self.pool.directory} has {free} bytes free (less "
                               f"{promised} promised to segments still being made)")

    def _unclaimed(self) -> dict[str, float]:
        """:attr:`unclaimed`, less the shards claimed since: a push sealed, an init verified."""
        for shard in [s for s in self.unclaimed
                      if s in self.sealed or (s in self.relays and self.relays[s].verified)]:
            del self.unclaimed[shard]
        return self.unclaimed

    def _expire_unclaimed(self) -> None:
        """Hand back to the pool every segment still unclaimed at its deadline (see the module doc); a late open,
        header or chunk of it is refused ``released``."""
        now = time.monotonic()
        for shard in [s for s, due in self._unclaimed().items() if due <= now]:
            log.warning("ps.unclaimed_released", shard=shard, nbytes=self.shards[shard].capacity,
                        detail="neither sealed (or verified) nor released in time: a push or init the ps-manager "
                               "gave up, or one it never granted")
            self._drop(shard)
        for init_id in [i for i, (_, due) in self._planned.items() if due <= now]:
            log.warning("ps.plan_forgotten", init_id=init_id, detail="its header never came: an init the ps-manager "
                        "gave up")
            self._drop(init_id)

    def _send_peer(self, peer: WorkerInfo, body: Body, deadline_s: float, on_done: Callable[[Outcome], None]) -> None:
        # Sent once: the stream is pipelined over reliable connections; a child that misses its deadline fails
        # the init rather than being fed the chunk again.
        self.runtime.calls.request(peer.endpoint, body, on_done, deadline_s=deadline_s, policy=SEND_ONCE)

    def _plan(self, request: Message) -> Body:
        """A broadcast init's plan. Taken only from the manager this worker registered with
        (:meth:`_from_manager`): a plan makes its root open a file of the manager's choosing, and every other
        worker of the tree take that init's header (:meth:`_header`). HandlerError ``bad-init`` when the tree
        does not name this worker, or the init was planned or started here already."""
        plan = request.body
        assert isinstance(plan, InitPlan)
        self._from_manager(request, "plans")
        names = [w.worker for w in plan.workers]
        if self.runtime.node_id not in names:
            raise HandlerError("bad-init", f"the plan of init {plan.init_id!r} does not name {self.runtime.node_id}")
        if names.index(self.runtime.node_id):  # below the root: the plan names the one header taken
            self._refuse_released(plan.init_id)
            if plan.init_id in self._planned or plan.init_id in self.relays:
                raise HandlerError("bad-init", f"init {plan.init_id!r} was planned on {self.runtime.node_id} already")
            self._planned[plan.init_id] = (plan, time.monotonic() + self.settings.init_timeout_s)
            rank = names.index(self.runtime.node_id)
            log.info("ps.init_planned", init_id=plan.init_id, parent=names[parent(rank) or 0])
            return Ok()
        relay = self._relay(plan.init_id)

        # Answer the plan first, then stream on the loop: the manager learns at once that the root is alive.
        self.runtime.call_soon(lambda: relay.stream_from(plan))
        return Ok()

    def _from_manager(self, request: Message, what: str) -> None:
        """HandlerError ``not-manager`` unless ``request`` comes from the manager that answered this worker's last
        registration (its node id, which CURVE authenticates as the request's ``src``)."""
        if not self._manager_id or request.header.src != self._manager_id:
            raise HandlerError("not-manager", f"{request.header.src!r} is not the ps-manager this worker registered "
                               f"with ({self._manager_id or 'none yet'!r}): only it sends {what}")

    def _header(self, request: Message) -> Body | None:
        """A header makes this worker's relay of an init: taken only for an init the manager planned here
        (``not-planned`` otherwise), carrying the plan's tree (``bad-init`` otherwise), from the worker that tree
        names as this one's parent (its node id, which CURVE authenticates as the request's ``src``;
        ``not-parent`` otherwise). So a header nobody planned is refused before any memory is spent, and one
        refused or failing leaves nothing behind."""
        header = request.body
        assert isinstance(header, InitHeader)
        me, init_id = self.runtime.node_id, header.init_id
        self._refuse_released(init_id)
        if init_id in self.relays:
            raise HandlerError("bad-init", f"init {init_id!r} has started on {me} already: a worker takes one header "
                               "per init")
        planned = self._planned.get(init_id)
        if planned is None:
            raise HandlerError("not-planned", f"the ps-manager planned no init {init_id!r} on {me}: a header is taken "
                               "only for an init the manager's plan announced")
        plan, _ = planned
        names = [w.worker for w in plan.workers]
        if header.workers != plan.workers:
            raise HandlerError("bad-init", f"the header of init {init_id!r} carries another tree than the ps-manager's "
                               f"plan: {[w.worker for w in header.workers]}, planned {names}")
        sender = names[parent(names.index(me)) or 0]
        if request.header.src != sender:
            raise HandlerError("not-parent", f"{request.header.src!r} is not the parent of {me} in init {init_id!r} "
                               f"({sender!r}): only it sends the header")
        del self._planned[init_id]
        relay = self._relay(init_id)
        self._parents[init_id] = sender
        pending = self.server.pending
        try:  # answered once the segment is made: the parent sends chunks only then
            relay.on_header(header, lambda answer: self.server.answer(pending, answer))
        except BaseException:
            self._drop(init_id)
            raise
        return None

    def _chunk(self, request: Message) -> Body:
        chunk = request.body
        assert isinstance(chunk, InitChunk)
        self._joined(chunk.init_id, request.header.src).on_chunk(chunk)
        return Ok()

    def _end(self, request: Message) -> Body:
        end = request.body
        assert isinstance(end, InitEnd)
        self._joined(end.init_id, request.header.src).on_end(end)
        return Ok()


def _half_of(directory: Path) -> int:
    """Half the size of the filesystem holding ``directory``: the default bound on unclaimed segments, which
    leaves the other half to the versions retained (a worker holds at least the latest besides the pending one)."""
    fs = os.statvfs(directory)
    return fs.f_blocks * fs.f_frsize // 2


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node ps-worker``: serve shards until SIGINT/SIGTERM; every segment is unlinked at exit. Raises
    :class:`~..config.ConfigError` (final: exit status 2) without NIXL where ``ps.transport`` asks for it, or for a
    store that cannot be used, :class:`~..store.durable.StoreLocked` (exit 1: restarted) for a store another live
    process holds."""
    if config.ps.transport == "nixl":  # readers will ask for NIXL reads: refuse to start without it
        try:
            require_nixl()
        except NixlError as exc:
            log.error("ps.nixl_missing", error=str(exc))
            raise ConfigError(str(exc)) from None
    runtime = NodeRuntime("ps-worker", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    try:
        worker = PsWorker(runtime, config.ps, register_timeout_s=config.node.connect_timeout_s, store=config.store,
                          run=config.store_run())
    except StoreLocked:  # its predecessor, not yet dead, may hold it: status 1 (cli), restarted until it exits
        runtime.close()
        raise
    except StoreError as exc:
        log.error("ps.store_unusable", error=str(exc))
        runtime.close()
        raise ConfigError(str(exc)) from None  # final: said last on stderr (cli), exit status 2
    try:
        worker.register()
    except BaseException:
        runtime.close()
        raise
    runtime.run()
    return 0
