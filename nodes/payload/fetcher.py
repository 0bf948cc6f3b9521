"""Trainer side of the fetch: every blob a rank's micro batches reference, fetched right before the step,
verified against its reference and assembled into reused torch buffers.

:class:`StepFetcher` does, for one step, in two halves: :meth:`~StepFetcher.start` (plan and fetch, on the
node loop thread, never blocking it) and :meth:`~StepFetcher.finish` (verify and assemble, on the caller's
thread, as the replies come):

1. **Plan.** Each :class:`~refbus.protocol.messages.MicroBatchRefs` becomes a packing
   :class:`~.packing.MicroBatch` (:func:`to_micro_batch`); the blobs its samples need are collected once
   (a dummy borrows real references, so the same blob may appear twice), grouped by env-server endpoint
   and cut into ``fetch`` requests of at most ``blobs_per_request`` ids and about ``request_bytes`` (a
   request is closed once it reaches that size), whose answer holds at most ``MAX_BUFFERS`` arrays (one frame
   each: no receiver takes a message of more): small blobs share a request, so the per-request cost is
   paid per few MiB, not per blob; large ones travel alone or in pairs, so replies pipeline.
2. **Fetch.** All requests run concurrently as asynchronous requests of the node loop
   (:meth:`refbus.bus.calls.Calls.gather`): at most ``window`` in flight per endpoint, each retried with
   backoff per the one :class:`~refbus.bus.reqrep.RetryPolicy` until its deadline, while the loop goes on
   serving heartbeats and requests. One client per endpoint, the loop's. An endpoint the registry reports
   down (``runtime.track_peers()`` marks it down in ``runtime.calls``) is not asked at all, and requests in
   flight to one reported down meanwhile end at once: their blobs fail (``peer-down``) instead of running the
   retry schedule against a dead node. Where a blob is asked for is ``locate(ref)``: by default its recorded
   endpoint; with :func:`registry_locator`, the blobs endpoint its store (``BlobRef.node``) advertises now,
   so a store restarted on another port is found again.
3. **Verify.** A blob counts as fetched only if it carries exactly its reference's fields and
   :func:`~.keeper.blob_checksum` of its arrays equals ``BlobRef.checksum``: an end-to-end check against
   what the env server hashed at ``keep`` time, not only against what it sent (so frames are not checksummed
   again on decode). Each reply is verified as soon as it comes (the loop thread hands it to the
   :class:`FetchInFlight`, ``finish`` takes it on its own thread), while the rest of the step is still on the
   wire: the hash and the copies below overlap the transfer instead of following it.
4. **Assemble.** Each micro batch whose blobs all verified goes through :func:`~.assemble.assemble`, which
   writes every sample's rows straight into tensors handed out by a :class:`BufferPool`: at once when its
   last blob verified while other requests are still on the wire, or else (a failed blob, which a restarting
   store may still serve, or one among the last replies) once every request has its last outcome, after the
   transfer is timed. A micro batch with any blob missing, refused (``RemoteError``),
   unanswered (``RequestTimeout``), on a store reported down (``PeerDown``), corrupt or malformed becomes a
   :class:`FetchFailure`: it is never assembled from partial data, never trained on zeros.
5. **Check against the model.** With :class:`ModelLimits` (the model's vocabulary and expert count), each
   assembled micro batch whose inline ``input_ids``, top-k head ids, sampling-mask ids or routing rows hold an
   id the model has no row for fails ``out-of-range`` (its samples named in the log): such an id would reach an
   embedding or a gather, where torch raises on the CPU and a CUDA device-side assert poisons the process's
   context, ending the rank mid-step and its world with it.

Memory ownership: received frames are held by the :class:`FetchInFlight` until :meth:`StepFetcher.finish`,
read once there (checksum, then the copy into the batch tensors) and released with it; nothing in the
result views a frame. The batch tensors belong to the fetcher's pool: they stay valid until the next
:meth:`StepFetcher.finish`, which reuses them (copy what must outlive the step). Why reuse: first touch of
fresh pages runs at ~1.5 GB/s on these machines against ~13 GB/s for a copy into memory already in use, so
the copy lands in warm buffers.

Threads: :meth:`StepFetcher.start` on the thread that drives ``calls`` (the node loop); :meth:`StepFetcher.finish`
and the pool on one other thread at a time (see :mod:`.trainer_rank`), the two meeting only in the
:class:`FetchInFlight`'s condition. Without a node loop, drive the calls with
:meth:`~refbus.bus.calls.Calls.run_until`: from another thread while ``finish`` runs (a benchmark, as a rank
does), or to ``done`` before calling ``finish`` (which then verifies and assembles all at once).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import structlog
import torch

from ...bus.calls import Calls
from ...bus.memory import keep_receive_memory
from ...bus.reqrep import Outcome, PeerDown, RemoteError, RequestTimeout, RetryPolicy, split_outcomes
from ...protocol.envelope import MAX_BUFFERS
from ...protocol.messages import BlobRef, Blobs, Body, Fetch, FetchedBlob, MicroBatchRefs
from .assemble import MASK_PAD, AssembledBatch, AssemblyError, assemble
from .branch import ROUTED_EXPERTS, Branch, BranchError
from .keeper import blob_checksum
from .packing import MicroBatch, PackedSample, PackingError, SampleInfo
from .restarts import Sent, StoreRestarts
from .shipping import registry_locator as registry_locator  # a trainer rank's ``locate``, shared with the orchestrator

log = structlog.get_logger(__name__)


class PlanError(ValueError):
    """A micro batch's references cannot describe a valid micro batch (the message says which and why)."""


# --- plan: wire references to packing's micro batch ------------------------------------------------------


def to_micro_batch(refs: MicroBatchRefs) -> MicroBatch:
    """The packing :class:`~.packing.MicroBatch` that ``refs`` describes, samples at contiguous offsets from 0.

    A sample's fields are its blob's fields, or routing only in a dummy (as :func:`~.packing.pack` makes
    them); a sample without a blob has none. ``SampleSlice.tokens`` is the kept count; the blob's token count
    is the sample's full length.

    Raises:
        PlanError: a kept count above the blob's tokens, invalid fields, samples longer than ``length``.
    """
    packed: list[PackedSample] = []
    offset = 0
    dummy = refs.dummy
    for item in refs.samples:
        ref = item.ref
        total = ref.tokens if ref is not None else item.tokens
        if item.tokens > total:
            raise PlanError(f"sample {item.sample_id!r}: kept {item.tokens} tokens of a blob with {total}")
        try:
            if ref is None:
                info = SampleInfo(item.sample_id, total)
            else:
                shape = tuple(ref.routing_shape) if ref.routing_shape else None
                info = SampleInfo(item.sample_id, total, tuple(ref.fields), shape)  # type: ignore[arg-type]
        except PackingError as exc:
            raise PlanError(str(exc)) from None
        # info.fields are the blob's fields (canonical order); a dummy keeps routing only.
        fields = info.fields
        if dummy:
            fields = (ROUTED_EXPERTS,) if ROUTED_EXPERTS in fields else ()
        packed.append(PackedSample(info, offset, item.tokens, fields))
        offset += item.tokens
    if offset > refs.length:
        raise PlanError(f"micro batch: samples hold {offset} tokens, more than its length {refs.length}")
    return MicroBatch(
        samples=tuple(packed),
        tokens=offset,
        length=refs.length,
        has_routing=any(ROUTED_EXPERTS in p.fields for p in packed),
        dummy=refs.dummy,
    )


def blob_refs(micro_batches: Iterable[MicroBatchRefs], *, fetched: bool) -> dict[str, BlobRef]:
    """The blobs the micro batches name, by id, first reference kept: with ``fetched``, those a fetch reads
    (samples that list a field; a dummy borrows routing only), else every one, a dummy's unrouted ones too (a rank
    deletes an owned blob, and repeats its hand-over, where its reference says it lives, so one named again in a
    dummy at another store must be refused, not deleted there).

    Raises:
        PlanError: one blob id referenced with two different references (endpoint, checksum, ...).
    """
    refs: dict[str, BlobRef] = {}
    for micro_batch in micro_batches:
        for item in micro_batch.samples:
            ref = item.ref
            if ref is None or (fetched and micro_batch.dummy and ROUTED_EXPERTS not in ref.fields):
                continue
            known = refs.setdefault(ref.blob_id, ref)
            if known is not ref and known != ref:
                raise PlanError(f"blob {ref.blob_id!r}: referenced as {known} and as {ref}")
    return refs


# --- buffers ---------------------------------------------------------------------------------------------


class BufferPool:
    """An :data:`~.assemble.Allocator` that hands out warm CPU tensors, reused from step to step.

    Storage is kept per dtype as flat tensors; a request takes the smallest free one with room and returns a
    contiguous view of exactly the asked shape, so buffers are reused across steps even when micro batch
    lengths and mask widths change (keying on the exact shape would miss most of them).

    Ownership: a tensor handed out belongs to the pool. It stays valid until :meth:`recycle`, which makes
    every handed-out buffer free again and releases those the previous step did not use, so the pool holds
    at most one step's worth of buffers. ``pin_memory`` allocates page-locked storage (faster H2D copies).
    """

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._free: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        self._used: list[torch.Tensor] = []
        self.allocated_bytes = 0  # fresh storage ever allocated: what first-touch cost was paid on

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape, dtype=np.int64))
        free = self._free[dtype]
        fits = [i for i, flat in enumerate(free) if flat.numel() >= numel]
        if fits:
            flat = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            flat = torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)
            self.allocated_bytes += flat.numel() * flat.element_size()
        self._used.append(flat)
        return flat[:numel].view(shape)

    def recycle(self) -> None:
        """Take back every buffer handed out; drop free buffers that went unused since the last recycle."""
        self._free = defaultdict(list)
        for flat in self._used:
            self._free[flat.dtype].append(flat)
        self._used = []

    @property
    def held_bytes(self) -> int:
        """Bytes of storage the pool holds, handed out or free."""
        flats = [*self._used, *(flat for free in self._free.values() for flat in free)]
        return sum(flat.numel() * flat.element_size() for flat in flats)


# --- results ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchFailure:
    """Why a micro batch could not be assembled. ``reason`` is stable: ``missing`` (unknown or deleted at
    the env server), ``remote-error``, ``timeout``, ``peer-down`` (its env server is reported down),
    ``checksum``, ``malformed`` (fields or shapes wrong), ``assembly`` or ``out-of-range`` (an id the model has
    no row for, :class:`ModelLimits`); ``blob_ids`` are the failed blobs of this micro batch."""

    reason: str
    detail: str
    blob_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class StepFetch:
    """One step's fetch on one rank.

    ``batches[i]`` is micro batch ``i``'s tensors (pool-owned, see :class:`BufferPool`) or its failure.
    ``blob_ids`` are the blobs fetched and verified, ``nbytes`` their array bytes, ``seconds`` the wall time
    until the last tensor was assembled, of which ``transfer_seconds`` until every blob was received and
    verified. ``routing_rows`` are real routing rows from this step (a view into
    an assembled batch, ``[rows, layers, top_k]`` in the wire dtype) to stand in for dropped micro batches, or ``None``;
    ``topk_k`` the top-k width seen in this step, or ``None``.
    """

    step: int
    micro_batches: tuple[MicroBatch, ...]
    batches: tuple[AssembledBatch | FetchFailure, ...]
    blob_ids: tuple[str, ...]
    nbytes: int
    seconds: float
    transfer_seconds: float
    routing_rows: torch.Tensor | None = None
    topk_k: int | None = None

    @property
    def failed(self) -> tuple[int, ...]:
        """Indices of the micro batches that could not be assembled."""
        return tuple(i for i, batch in enumerate(self.batches) if isinstance(batch, FetchFailure))


@dataclass(frozen=True, slots=True)
class FetchSettings:
    """How a rank fetches. ``blobs_per_request`` and ``request_bytes`` size each ``fetch`` request;
    ``window`` bounds requests in flight per endpoint (so received, not yet assembled frames stay under
    about ``window * request_bytes`` per endpoint); ``policy`` (None: the clients' own) sets timeouts,
    attempts and backoff; ``mask_width`` fixes the dense sampling-mask width (static shapes), default the
    widest kept token; ``pin_memory`` for the batch buffers."""

    blobs_per_request: int = 64
    request_bytes: int = 8 << 20
    window: int = 8
    policy: RetryPolicy | None = None
    mask_width: int | None = None
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if min(self.blobs_per_request, self.request_bytes, self.window) < 1:
            raise ValueError(f"blobs_per_request, request_bytes and window must be >= 1, got "
                             f"{self.blobs_per_request}, {self.request_bytes}, {self.window}")


INPUT_IDS = "input_ids"
"""The inline input holding a micro batch's token ids, as the orchestrator ships them."""
OUT_OF_RANGE = "out-of-range"


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The ids a model has rows for: token ids (inline ``input_ids``, top-k head ids, sampling-mask ids) in
    ``[0, vocab_size)``, expert ids of routing rows in ``[0, experts)``; None: that bound is not checked."""

    vocab_size: int | None = None
    experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "experts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected an int >= 1 or None, got {value!r}")

    def refused(self, batch: AssembledBatch, input_ids: object) -> str:
        """Why ``batch`` (its inline ``input_ids``, None without) cannot reach the model: the samples holding an id
        out of range and the first such id of each kind (an ``input_ids`` that is not ``length`` integers refuses
        every sample); empty when every id is in range. Padding rows count as ``padding``."""
        length = batch.length
        bad = np.zeros(length, dtype=np.bool_)
        found: list[str] = []
        vocab, experts = self.vocab_size, self.experts
        ids = None if input_ids is None else np.asarray(input_ids)
        if vocab is not None and ids is not None and not _are_token_ids(ids, length):
            bad[:] = True
            found.append(f"{INPUT_IDS}: expected {length} integers, got {ids.dtype} of shape {ids.shape}")
            ids = None
        checks = ((INPUT_IDS, ids, 0, vocab, "vocab_size"),
                  ("topk_ids", _rows(batch.topk_ids), 0, vocab, "vocab_size"),
                  ("sampling_mask", _rows(batch.sampling_mask), MASK_PAD, vocab, "vocab_size"),
                  (ROUTED_EXPERTS, _rows(batch.routed_experts), 0, experts, "experts"))
        for name, values, low, high, bound in checks:
            if values is None or high is None or not values.size:
                continue
            if low <= values.min() and values.max() < high:  # the common case, two passes without a temporary
                continue
            outside = (values < low) | (values >= high)
            rows = outside.reshape(length, -1).any(axis=1)
            if rows.any():
                bad |= rows
                found.append(f"{name} {values[outside][0]} (ids {low} to {high - 1}, the model's {bound})")
        if not found:
            return ""
        return f"samples {_holding(batch, bad)} hold ids the model has no row for: {'; '.join(found)}"

    def in_range(self, inputs: Mapping[str, Any], length: int) -> Mapping[str, Any]:
        """``inputs`` with each ``input_ids`` outside the vocabulary replaced by 0, the padding id (all of them
        when they are not ``length`` integers): what a dropped micro batch runs its forward pass on, its loss mask
        zero, so that the model never sees an id it has no row for."""
        ids = inputs.get(INPUT_IDS)
        if self.vocab_size is None or ids is None:
            return inputs
        ids = np.asarray(ids)
        if not _are_token_ids(ids, length):
            return {**inputs, INPUT_IDS: np.zeros(length, dtype=np.int64)}
        valid = (ids >= 0) & (ids < self.vocab_size)
        return inputs if valid.all() else {**inputs, INPUT_IDS: np.where(valid, ids, 0).astype(np.int64)}


def _are_token_ids(ids: np.ndarray, length: int) -> bool:
    """Whether ``ids`` are a micro batch's ``length`` integer token ids (one per position)."""
    return ids.shape == (length,) and ids.dtype.kind in "iu"


def _rows(tensor: torch.Tensor | None) -> np.ndarray | None:
    """An assembled ``[1, length, ...]`` tensor as a numpy ``[length, ...]`` view (numpy compares uint16, which
    torch does not)."""
    return None if tensor is None else tensor[0].numpy()


def _holding(batch: AssembledBatch, rows: np.ndarray) -> list[str]:
    """The ids of ``batch``'s samples with a True row in ``rows``, then ``padding`` for one past them all."""
    samples = batch.micro_batch.samples
    names = [str(p.sample.sample_id) for p in samples if rows[p.offset : p.stop].any()]
    covered = np.zeros(len(rows), dtype=np.bool_)
    for packed in samples:
        covered[packed.offset : packed.stop] = True
    return [*names, "padding"] if (rows & ~covered).any() else names


# --- the fetcher -----------------------------------------------------------------------------------------


class FetchUnfinished(RuntimeError):
    """:meth:`StepFetcher.finish` gave up waiting: the requests had not all ended within its ``timeout_s``, or its
    ``stopped()`` said the thread driving them has stopped. The fetch's blobs are the caller's as before."""


@dataclass(eq=False)
class FetchInFlight:
    """One step's fetch between :meth:`StepFetcher.start` and :meth:`StepFetcher.finish`: the plan, the replies
    as they come and the requests' outcomes once ``done``. The loop thread adds to it (:meth:`arrive`,
    :meth:`end`), the thread running ``finish`` takes from it (:meth:`take`): the two meet only under
    ``_changed``."""

    step: int
    micro_batches: tuple[MicroBatchRefs, ...]
    plans: tuple[MicroBatch, ...]
    refs: Mapping[str, BlobRef]
    started: float
    requests: list[tuple[str, Fetch]]
    outcomes: list[Outcome] | None = None
    _arrived: list[tuple[Fetch, Outcome]] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def done(self) -> bool:
        """Whether every request has its outcome."""
        return self.outcomes is not None

    def arrive(self, request: Body, outcome: Outcome) -> None:
        """A request ended (loop thread): its reply, if it is one, may be verified and used before the others."""
        if isinstance(request, Fetch) and not isinstance(outcome, Exception):
            with self._changed:
                self._arrived.append((request, outcome))
                self._changed.notify_all()

    def end(self, sent: list[Sent[Fetch]]) -> None:
        """Every request has its last outcome (loop thread): ``sent`` are the requests as last sent, with them."""
        with self._changed:
            self.requests = [request for request, _ in sent]
            self.outcomes = [outcome for _, outcome in sent]
            self._changed.notify_all()

    def take(self, timeout_s: float) -> tuple[list[tuple[Fetch, Outcome]], bool]:
        """The replies that came since the last call, and whether the fetch is ``done``; waits at most
        ``timeout_s`` for either when there is neither."""
        with self._changed:
            self._changed.wait_for(lambda: self._arrived or self.outcomes is not None, timeout_s)
            arrived, self._arrived = self._arrived, []
            return arrived, self.outcomes is not None


class StepFetcher:
    """Fetches, verifies and assembles one rank's micro batches for each step (see the module doc).

    ``calls`` sends the ``fetch`` requests (``runtime.calls``: the node loop's asynchronous requests, one
    client per endpoint; an endpoint it has marked down fails at once). ``holder`` names this rank in
    ``fetch`` requests. ``limits``: the ids the model takes; None (the default) checks none.
    """

    def __init__(self, holder: str, calls: Calls, settings: FetchSettings | None = None,
                 *, locate: Callable[[BlobRef], str] = lambda ref: ref.endpoint,
                 restarts: StoreRestarts | None = None, limits: ModelLimits | None = None) -> None:
        self.holder = holder
        self.limits = limits
        self.settings = settings or FetchSettings()
        self._calls = calls
        self._locate = locate
        self._restarts = restarts
        self.pool = BufferPool(pin_memory=self.settings.pin_memory)
        keep_receive_memory()  # every step's frames land where the last step's were, not on fresh pages

    def start(self, step: int, micro_batches: Sequence[MicroBatchRefs]) -> FetchInFlight:
        """Plan the fetch of ``micro_batches`` for ``step`` and send its requests: the returned
        :class:`FetchInFlight` gets each reply as it comes and is ``done`` once every request has its outcome (a
        reply, or the failure it ended with at its deadline). Loop thread only (it uses ``calls``); never blocks.

        Raises:
            PlanError: references that describe no valid micro batch (validate at hand-over to avoid this).
        """
        started = time.perf_counter()
        plans = tuple(to_micro_batch(mb) for mb in micro_batches)
        refs = blob_refs(micro_batches, fetched=True)
        requests = [(endpoint, Fetch(blob_ids=ids, holder=self.holder, step=step))
                    for endpoint, ids in self._requests(refs)]
        fetch = FetchInFlight(step, tuple(micro_batches), plans, refs, started, requests)
        self._send(fetch, requests)
        return fetch

    def _send(self, fetch: FetchInFlight, requests: list[tuple[str, Fetch]]) -> None:
        """Send ``requests``, each reply handed to ``fetch`` as it comes; once all have outcomes (what a
        restarting durable store could still serve asked again, :class:`StoreRestarts`), end ``fetch``."""

        def relocate(again: list[Fetch]) -> list[tuple[str, Fetch]]:
            ids = [i for request in again for i in request.blob_ids]
            return [(endpoint, Fetch(blob_ids=blob_ids, holder=self.holder, step=fetch.step))
                    for endpoint, blob_ids in self._requests({i: fetch.refs[i] for i in ids})]

        # Frames are not checksummed on decode: every blob is verified against its BlobRef in finish(), which
        # also proves it is what the env server hashed at keep time.
        options: dict[str, Any] = {"window": self.settings.window, "policy": self.settings.policy,
                                   "backend": "numpy", "verify": False,
                                   "retry_after": True, "on_each": fetch.arrive}
        if self._restarts is None:
            self._calls.gather(requests, lambda outcomes: fetch.end(list(zip(requests, outcomes, strict=True))),
                               **options)
        else:
            self._restarts.gather(self._calls, requests, fetch.end, again=lambda sent: self._retryable(fetch, sent),
                                  relocate=relocate, **options)

    def _retryable(self, fetch: FetchInFlight, done: list[Sent[Fetch]]) -> list[Fetch] | None:
        """The failed requests worth asking again (None: none): every blob on a durable store, time left."""
        if self._restarts is None:
            return None
        return self._restarts.waiting(done, lambda blob_id: fetch.refs[blob_id].node,
                                      time.perf_counter() - fetch.started)

    def finish(self, fetch: FetchInFlight, *, timeout_s: float | None = None,
               stopped: Callable[[], bool] = lambda: False) -> StepFetch:
        """Verify and assemble the step, waiting on this thread for the requests to end: each micro batch is
        assembled as soon as every blob it needs has come and verified, while the rest is still on the wire, so
        the copies overlap the transfer; the micro batches left (a blob failed, or came last) once every request
        has its outcome. Failures are reported per micro batch, never raised. Recycles the pool: tensors of the
        previous call are reused from here on. Runs on any one thread (the training loop's): it touches no
        socket; another thread drives the requests (the node loop), or the caller drove them to ``done`` before.

        Raises:
            FetchUnfinished: the requests had not all ended within ``timeout_s`` (None: no bound beyond their
                own deadlines), or ``stopped()``, asked at least every ``STOP_POLL_S``, turned true first.
        """
        self.pool.recycle()
        waited_until = None if timeout_s is None else time.monotonic() + timeout_s
        branches: dict[str, Branch] = {}
        failures: dict[str, FetchFailure] = {}
        batches: list[AssembledBatch | FetchFailure | None] = [None] * len(fetch.plans)
        needs = [_needed_ids(refs_mb, plan) for plan, refs_mb in zip(fetch.plans, fetch.micro_batches, strict=True)]
        while True:
            left_s = STOP_POLL_S if waited_until is None else min(STOP_POLL_S, waited_until - time.monotonic())
            arrived, done = fetch.take(max(left_s, 0.0))
            for request, outcome in arrived:
                self._verify_reply(fetch.refs, request, outcome, branches, failures)
            if done:
                break  # what is left is assembled after ``transferred``, which times the transfer alone
            for index, batch in enumerate(batches):
                if batch is None and all(blob_id in branches for blob_id in needs[index] if blob_id is not None):
                    batches[index] = self._assemble(fetch.plans[index], fetch.micro_batches[index], needs[index],
                                                    branches, failures)
            if stopped():
                raise FetchUnfinished(f"step {fetch.step}: the requests' driver stopped before they all ended")
            if waited_until is not None and time.monotonic() >= waited_until:
                raise FetchUnfinished(f"step {fetch.step}: the requests had not all ended within {timeout_s:.0f}s")
        assert fetch.outcomes is not None
        self._verify_outcomes(fetch, fetch.outcomes, branches, failures)
        transferred = time.perf_counter()
        for index, batch in enumerate(batches):
            if batch is None:
                batches[index] = self._assemble(fetch.plans[index], fetch.micro_batches[index], needs[index],
                                                branches, failures)
        assembled = cast(list[AssembledBatch | FetchFailure], batches)
        fetched = tuple(branches)
        result = StepFetch(
            step=fetch.step,
            micro_batches=fetch.plans,
            batches=tuple(assembled),
            blob_ids=fetched,
            nbytes=sum(branch.nbytes for branch in branches.values()),
            seconds=time.perf_counter() - fetch.started,
            transfer_seconds=transferred - fetch.started,
            routing_rows=_routing_rows(assembled),
            topk_k=next((int(b.topk_ids.shape[2]) for b in assembled
                         if isinstance(b, AssembledBatch) and b.topk_ids is not None), None),
        )
        if failures:
            log.warning("fetch.failed_blobs", step=fetch.step, failed=len(failures), fetched=len(fetched),
                        reasons=sorted({f.reason for f in failures.values()}))
        for index, batch in enumerate(assembled):
            if isinstance(batch, FetchFailure) and batch.reason == OUT_OF_RANGE:
                log.warning("fetch.out_of_range", step=fetch.step, micro_batch=index, detail=batch.detail,
                            blob_ids=list(batch.blob_ids))
        return result

    @staticmethod
    def _verify_reply(refs: Mapping[str, BlobRef], request: Fetch, outcome: Outcome,
                      branches: dict[str, Branch], failures: dict[str, FetchFailure]) -> None:
        """Verify the blobs of one reply to ``request`` that were asked and are not decided yet (the first copy of
        a blob decides): each goes to ``branches`` or ``failures``."""
        reply = outcome.body
        if not isinstance(reply, Blobs):
            return
        asked = set(request.blob_ids)
        for blob in reply.blobs:
            if blob.blob_id in asked and blob.blob_id not in branches and blob.blob_id not in failures:
                verified = _verify(refs[blob.blob_id], blob)
                if isinstance(verified, FetchFailure):
                    failures[blob.blob_id] = verified
                else:
                    branches[blob.blob_id] = verified

    def _verify_outcomes(self, fetch: FetchInFlight, outcomes: Sequence[Outcome], branches: dict[str, Branch],
                         failures: dict[str, FetchFailure]) -> None:
        """A failure for each blob no reply brought, from every request's last outcome (the request's error, a reply
        of another kind, or ``missing``). Every reply was verified as it came: each reaches the fetch
        (:meth:`FetchInFlight.arrive`) before its ``end``, so ``finish``'s last ``take`` held the last of them."""
        refs = fetch.refs
        replies, failed = split_outcomes(zip(fetch.requests, outcomes, strict=True))
        for (_, request), error in failed:
            reason = _FAILURE_REASONS[type(error)]
            failures.update({i: FetchFailure(reason, str(error), (i,)) for i in request.blob_ids if i not in branches})
        for (_, request), outcome in replies:
            reply = outcome.body
            if not isinstance(reply, Blobs):
                failures.update({i: FetchFailure("remote-error", f"expected blobs, got {reply.kind}", (i,))
                                 for i in request.blob_ids if i not in branches})
                continue
            for blob_id in set(request.blob_ids) - branches.keys() - failures.keys():
                failures[blob_id] = FetchFailure("missing", f"{request.holder}: not served by "
                                                 f"{refs[blob_id].endpoint}", (blob_id,))

    def _requests(self, refs: Mapping[str, BlobRef]) -> list[tuple[str, list[str]]]:
        """``(endpoint, blob ids)`` per request, cut by ``blobs_per_request``, ``request_bytes`` and the
        ``MAX_BUFFERS`` arrays its answer can hold."""
        requests: list[tuple[str, list[str]]] = []
        open_ids: dict[str, list[str]] = defaultdict(list)
        open_bytes: Counter[str] = Counter()
        open_arrays: Counter[str] = Counter()
        for blob_id, ref in refs.items():
            endpoint = self._locate(ref)
            if open_ids[endpoint] and open_arrays[endpoint] + len(ref.fields) > MAX_BUFFERS:
                requests.append((endpoint, open_ids.pop(endpoint)))
                del open_bytes[endpoint], open_arrays[endpoint]
            open_ids[endpoint].append(blob_id)
            open_arrays[endpoint] += len(ref.fields)
            open_bytes[endpoint] += ref.nbytes
            if len(open_ids[endpoint]) >= self.settings.blobs_per_request or \
                    open_bytes[endpoint] >= self.settings.request_bytes:
                requests.append((endpoint, open_ids.pop(endpoint)))
                del open_bytes[endpoint], open_arrays[endpoint]
        return requests + list(open_ids.items())

    def _assemble(self, plan: MicroBatch, refs: MicroBatchRefs, ids: Sequence[str | None],
                  branches: Mapping[str, Branch],
                  failures: Mapping[str, FetchFailure]) -> AssembledBatch | FetchFailure:
        """Micro batch ``plan`` (``refs`` on the wire) from its samples' blobs (``ids``, :func:`_needed_ids`), checked
        against :attr:`limits`, or why it cannot be."""
        failed = [failures[i] for i in ids if i is not None and i in failures]
        if failed:
            reasons = sorted({f.reason for f in failed})
            return FetchFailure(reasons[0] if len(reasons) == 1 else "+".join(reasons),
                                "; ".join(f.detail for f in failed[:3]), tuple(f.blob_ids[0] for f in failed))
        blob_ids = tuple(i for i in ids if i is not None)
        try:
            batch = assemble(plan, [branches[i] if i is not None else None for i in ids],
                             mask_width=self.settings.mask_width, allocator=self.pool)
        except AssemblyError as exc:
            return FetchFailure("assembly", str(exc), blob_ids)
        except (MemoryError, RuntimeError) as exc:  # a tensor the allocator cannot give: this batch fails, not the rank
            return FetchFailure("assembly", f"{type(exc).__name__}: {exc}", blob_ids)
        refused = self.limits.refused(batch, refs.inputs.get(INPUT_IDS)) if self.limits is not None else ""
        return FetchFailure(OUT_OF_RANGE, refused, blob_ids) if refused else batch


STOP_POLL_S = 0.1
"""How often :meth:`StepFetcher.finish` asks its ``stopped()`` while no reply comes (a reply wakes it at once)."""


def _needed_ids(refs: MicroBatchRefs, plan: MicroBatch) -> list[str | None]:
    """The blob each sample of a micro batch reads, None for a sample that reads none."""
    return [item.ref.blob_id if item.ref is not None and packed.fields else None
            for item, packed in zip(refs.samples, plan.samples, strict=True)]


_FAILURE_REASONS: dict[type, str] = {RemoteError: "remote-error", RequestTimeout: "timeout", PeerDown: "peer-down"}


def _verify(ref: BlobRef, blob: FetchedBlob) -> Branch | FetchFailure:
    """The blob as a validated branch, if it holds exactly ``ref``'s fields and matches its checksum."""
    ordered = blob.arrays
    # An env server sends a blob's arrays in its reference's order: then they are hashed in the order they came.
    if list(ordered) != ref.fields:
        if sorted(ordered) != sorted(ref.fields):
            return FetchFailure("malformed", f"blob {ref.blob_id!r}: fields {sorted(ordered)}, "
                                             f"reference lists {ref.fields}", (ref.blob_id,))
        ordered = {name: ordered[name] for name in ref.fields}
    if blob_checksum(ordered) != ref.checksum:
        return FetchFailure("checksum", f"blob {ref.blob_id!r} from {ref.endpoint} does not match the "
                                        "checksum of its reference", (ref.blob_id,))
    try:
        branch = Branch.from_arrays(ordered)
    except BranchError as exc:
        return FetchFailure("malformed", f"blob {ref.blob_id!r}: {exc}", (ref.blob_id,))
    if branch.token_count != ref.tokens:
        return FetchFailure("malformed", f"blob {ref.blob_id!r}: {branch.token_count} tokens, reference says "
                                         f"{ref.tokens}", (ref.blob_id,))
    return branch


def _routing_rows(batches: Sequence[AssembledBatch | FetchFailure]) -> torch.Tensor | None:
    """The longest real routing span of the step's assembled batches (a view, no copy)."""
    best: torch.Tensor | None = None
    for batch in batches:
        if not isinstance(batch, AssembledBatch) or batch.routed_experts is None:
            continue
        for packed in batch.micro_batch.samples:
            if ROUTED_EXPERTS in packed.fields and packed.kept and (best is None or packed.kept > best.shape[0]):
                best = batch.routed_experts[0, packed.offset : packed.stop]
    return best

