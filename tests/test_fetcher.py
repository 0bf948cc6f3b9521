"""StepFetcher over real sockets: fake env servers (a ``Server`` on a bound ROUTER, serviced by a background
thread) answer ``fetch`` with real arrays as zero-copy frames and ``delete`` with ``deleted``; failures are
injected per blob (missing, wrong checksum, error reply, no reply).

Checks that assembled tensors are byte-identical to what the servers served (routing in its wire dtype
``[1, seq, layers, top_k]`` from uint8 and uint16, dense masks filled with -1, top-k heads), that requests
are batched and clients and buffers reused across steps, and that a failure marks exactly its micro batch.

The fake env server and the step builder are also used by ``test_trainer_rank``.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from polling import wait_for
from refbus.bus.calls import Calls
from refbus.bus.reqrep import Client, HandlerError, RetryPolicy
from refbus.nodes.payload.assemble import AssembledBatch
from refbus.nodes.payload.branch import FIELDS, Branch
from refbus.nodes.payload.fetcher import (
    BufferPool,
    FetchFailure,
    FetchInFlight,
    FetchSettings,
    FetchUnfinished,
    PlanError,
    StepFetch,
    StepFetcher,
    _verify,
    registry_locator,
    to_micro_batch,
)
from refbus.nodes.payload.keeper import blob_checksum, pack_branches
from refbus.nodes.payload.packing import SampleInfo, pack
from refbus.nodes.payload.restarts import StoreRestarts
from refbus.protocol.envelope import MAX_BUFFERS, Message, WireCodec
from refbus.protocol.messages import (
    BlobRef,
    Blobs,
    Delete,
    Deleted,
    Fetch,
    FetchedBlob,
    Keep,
    Kept,
    MicroBatchRefs,
    SampleSlice,
)

pytest_plugins = ["wire_fixtures"]

LAYERS, TOP_K, HEAD_K = 3, 2, 4
WAIT_S = 30.0  # bounds a process start or exit, never a measurement
FAST = RetryPolicy(timeout_s=0.3, attempts=2, backoff=1.0)


# --- fake env servers ------------------------------------------------------------------------------------


@dataclass
class FakeEnvServer:
    """Serves kept arrays like an env server: ``fetch`` → ``blobs`` (zero-copy frames, not cached),
    ``delete`` → ``deleted``. Injectable failures per blob id: ``missing`` (listed as missing), ``corrupt``
    (one byte flipped, so the checksum fails), ``refused`` (``unknown-blob`` error), ``silent`` (never
    answered: the client times out); ``missing_for[holder]`` fails only that holder's fetches; a delete of
    a ``reclaimed`` id is answered ``reclaimed`` (the store took it back from a holder that went down);
    ``hold``, once set to an event, keeps every fetch answer until the event is set (a slow store)."""

    source: str
    endpoint: str = ""
    blobs: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    missing_for: dict[str, set[str]] = field(default_factory=dict)
    reclaimed: set[str] = field(default_factory=set)
    fetches: list[Fetch] = field(default_factory=list)
    deletes: list[Delete] = field(default_factory=list)
    hold: threading.Event | None = None

    def setup(self, server) -> None:  # runs on the server thread
        server.on(Fetch.kind, self._fetch, cached=False)
        server.on(Delete.kind, self._delete)

    def keep(self, blob_id: str, branch: Branch) -> BlobRef:
        (kept,) = pack_branches([branch])
        self.blobs[blob_id] = dict(kept.arrays)
        return BlobRef(endpoint=self.endpoint, source=self.source, blob_id=blob_id, fields=list(kept.arrays),
                       tokens=kept.tokens, nbytes=kept.nbytes, checksum=kept.checksum,
                       routing_shape=list(kept.routing_shape) if kept.routing_shape else None)

    def _fetch(self, request: Message) -> Blobs | None:
        body = request.body
        assert isinstance(body, Fetch)
        self.fetches.append(body)
        if self.hold is not None:
            assert self.hold.wait(WAIT_S), "the test never let the held answer go"
        ids = set(body.blob_ids)
        if ids & self.silent:
            return None
        if ids & self.refused:
            raise HandlerError("unknown-blob", f"refused {sorted(ids & self.refused)}")
        absent = self.missing | self.missing_for.get(body.holder, set())
        found = []
        for blob_id in body.blob_ids:
            if blob_id in absent or blob_id not in self.blobs:
                continue
            arrays = self.blobs[blob_id]
            if blob_id in self.corrupt:
                arrays = {name: array.copy() for name, array in arrays.items()}
                first = next(iter(arrays.values()))
                first.reshape(-1).view(np.uint8)[0] ^= 0xFF
            found.append(FetchedBlob(blob_id=blob_id, arrays=arrays))
        served = {blob.blob_id for blob in found}
        return Blobs(blobs=found, missing=[i for i in body.blob_ids if i not in served])

    def _delete(self, request: Message) -> Deleted:
        body = request.body
        assert isinstance(body, Delete)
        self.deletes.append(body)
        return Deleted(blob_ids=[i for i in body.blob_ids if i not in self.reclaimed],
                       reclaimed=[i for i in body.blob_ids if i in self.reclaimed])


@dataclass
class ServedStore:
    """``make_step``'s env server played by a real one (an ``env-server`` node): each branch is kept there with
    a ``keep`` request; the store names its own blob ids."""

    client: Client

    def keep(self, blob_id: str, branch: Branch) -> BlobRef:
        arrays = {name: getattr(branch, name) for name in FIELDS if getattr(branch, name) is not None}
        kept = self.client.request(Keep(episode_id=blob_id, branches=[arrays])).body
        assert isinstance(kept, Kept), kept
        return kept.refs[0]


def start_env_server(serve: Callable, source: str) -> FakeEnvServer:
    env = FakeEnvServer(source)
    env.endpoint = serve(env.setup).endpoint
    return env


# --- steps -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleSpec:
    tokens: int
    routing: type | None = np.uint8  # dtype of routed_experts, None: no routing
    heads: bool = False
    mask: bool = False

    @property
    def has_arrays(self) -> bool:
        return self.routing is not None or self.heads or self.mask


def make_branch(rng: np.random.Generator, spec: SampleSpec, *, vocab: int = 50_000, experts: int | None = None
                ) -> Branch:
    """Random arrays for ``spec``: token ids below ``vocab``, expert ids below ``experts`` (default: any the
    routing dtype holds, 300 for uint16)."""
    arrays: dict[str, np.ndarray] = {}
    if spec.routing is not None:
        high = experts or (300 if spec.routing == np.uint16 else 256)
        arrays["routed_experts"] = rng.integers(0, high, (spec.tokens, LAYERS, TOP_K)).astype(spec.routing)
    if spec.heads:
        arrays["topk_ids"] = rng.integers(0, vocab, (spec.tokens, HEAD_K)).astype(np.int32)
        arrays["topk_logprobs"] = -rng.random((spec.tokens, HEAD_K), dtype=np.float32)
    if spec.mask:
        counts = rng.integers(0, 4, spec.tokens).astype(np.int32)
        arrays["mask_ids"] = rng.integers(0, vocab, int(counts.sum())).astype(np.int32)
        arrays["mask_counts"] = counts
    return Branch(**arrays)


@dataclass(frozen=True)
class Step:
    """One step as the orchestrator would ship it: ``ranks[r]`` are data rank ``r``'s micro batches."""

    ranks: tuple[tuple[MicroBatchRefs, ...], ...]
    branches: dict[str, Branch]  # blob id -> what the env server keeps
    owned: tuple[tuple[str, ...], ...]  # per data rank: blobs of its real micro batches


def make_step(
    envs: Sequence[FakeEnvServer],
    specs: Sequence[SampleSpec],
    *,
    seed: int = 0,
    data_ranks: int = 1,
    seq_len: int = 64,
    prefix: str = "s",
    vocab: int = 50_000,
    experts: int | None = None,
) -> Step:
    """Keep each spec's branch on ``envs`` (round robin), pack, and turn the plan into references (``vocab`` and
    ``experts``: see :func:`make_branch`)."""
    rng = np.random.default_rng(seed)
    refs: dict[str, BlobRef | None] = {}
    branches: dict[str, Branch] = {}
    infos = []
    for index, spec in enumerate(specs):
        sample_id = f"{prefix}{index}"
        ref = None
        if spec.has_arrays:
            branch = make_branch(rng, spec, vocab=vocab, experts=experts)
            ref = envs[index % len(envs)].keep(f"{prefix}-blob-{index}", branch)
            branches[ref.blob_id] = branch
        refs[sample_id] = ref
        infos.append(SampleInfo(sample_id, spec.tokens, tuple(ref.fields) if ref else (),
                                tuple(ref.routing_shape) if ref and ref.routing_shape else None))
    plan = pack(infos, seq_len=seq_len, data_ranks=data_ranks, pad_to_multiple_of=8)
    ranks = []
    owned = []
    for micro_batches in plan.ranks:
        ranks.append(tuple(
            MicroBatchRefs(samples=[SampleSlice(str(p.sample.sample_id), p.kept, refs[p.sample.sample_id])
                                    for p in mb.samples], length=mb.length, dummy=mb.dummy)
            for mb in micro_batches))
        owned.append(tuple(refs[p.sample.sample_id].blob_id for mb in micro_batches if not mb.dummy  # type: ignore[union-attr]
                           for p in mb.samples if refs[p.sample.sample_id] is not None))
    return Step(tuple(ranks), branches, tuple(owned))


def check_assembled(batch: AssembledBatch, refs: MicroBatchRefs, branches: dict[str, Branch]) -> None:
    """Every tensor of ``batch`` holds exactly the served bytes of its samples in packing order, and the
    documented padding elsewhere."""
    length = refs.length
    assert batch.length == length and batch.loss_mask.dtype == torch.bool
    routing = batch.routed_experts
    if routing is not None:
        assert routing.dtype in (torch.uint8, torch.uint16) and tuple(routing.shape) == (1, length, LAYERS, TOP_K)
    offset = 0
    for item in refs.samples:
        span = slice(offset, offset + item.tokens)
        assert bool(batch.loss_mask[0, span].all()) is (not refs.dummy)
        fields = item.ref.fields if item.ref is not None else []
        source = branches[item.ref.blob_id].slice_to(item.tokens) if item.ref is not None else None
        if "routed_experts" in fields:
            assert routing is not None and source is not None
            np.testing.assert_array_equal(routing[0, span].numpy(), source.routed_experts, strict=True)
        if "topk_ids" in fields and not refs.dummy:
            assert source is not None and batch.topk_ids is not None and batch.topk_logprobs is not None
            np.testing.assert_array_equal(batch.topk_ids[0, span].numpy(), source.topk_ids.astype(np.int64))
            assert batch.topk_logprobs[0, span].numpy().tobytes() == source.topk_logprobs.tobytes()
            assert bool(batch.topk_valid[0, span].all())
        if "mask_ids" in fields and not refs.dummy:
            assert source is not None and batch.sampling_mask is not None
            dense = batch.sampling_mask[0, span].numpy()
            flat = 0
            for row, count in zip(dense, source.mask_counts, strict=True):
                assert row[:count].tolist() == source.mask_ids[flat : flat + count].tolist()
                assert (row[count:] == -1).all()
                flat += count
        elif batch.sampling_mask is not None:
            assert (batch.sampling_mask[0, span] == -1).all()
        offset += item.tokens
    assert not bool(batch.loss_mask[0, offset:].any())
    if batch.sampling_mask is not None:
        assert (batch.sampling_mask[0, offset:] == -1).all()
    if routing is not None:
        assert (routing[0, offset:] == 0).all()


# --- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture
def envs(serve: Callable) -> tuple[FakeEnvServer, FakeEnvServer]:
    return start_env_server(serve, "env-a"), start_env_server(serve, "env-b")


@dataclass
class Loop:
    """What a node loop does for a fetcher, in the test's thread: asynchronous requests driven by a poll loop
    of their own. ``made``: every client made (one per endpoint, each closed at teardown)."""

    calls: Calls
    made: list[Client]

    @property
    def endpoints(self) -> list[str]:
        return [client.endpoint for client in self.made]

    def fetch(self, fetcher: StepFetcher, step: int, micro_batches: Sequence[MicroBatchRefs], *,
              driven: bool = False) -> StepFetch:
        """``start``, then ``finish``: once the requests were served here until every one had its outcome, or
        (``driven``) while another thread serves them, as a trainer rank's node loop does."""
        return self.finish(fetcher, fetcher.start(step, micro_batches), driven=driven)

    def finish(self, fetcher: StepFetcher, in_flight: FetchInFlight, *, driven: bool,
               deadline_s: float = 20 * FAST.deadline_s) -> StepFetch:
        """``finish`` a started fetch (see :meth:`fetch`); every request ends by its deadline, the window may queue
        a few behind each other: ``deadline_s`` bounds them all."""
        if not driven:
            assert self.calls.run_until(lambda: in_flight.done, deadline_s), "a request outlived its deadline"
            return fetcher.finish(in_flight)
        ended: list[bool] = []
        driver = threading.Thread(target=lambda: ended.append(self.calls.run_until(lambda: in_flight.done,
                                                                                   deadline_s)))
        driver.start()
        try:
            return fetcher.finish(in_flight, timeout_s=2 * deadline_s)
        finally:
            driver.join()
            assert ended == [True], "a request outlived its deadline"


@pytest.fixture
def loop(zmq_ctx: zmq.Context) -> Iterator[Loop]:
    made: list[Client] = []

    def connect(endpoint: str) -> Client:
        made.append(Client(zmq_ctx, endpoint, WireCodec("trainer-0"), policy=FAST))
        return made[-1]

    yield Loop(Calls(connect, FAST), made)
    for client in made:
        client.close()


MIXED = (
    SampleSpec(40, heads=True, mask=True),
    SampleSpec(90, heads=True, mask=True),  # truncated to seq_len
    SampleSpec(17),
    SampleSpec(23, routing=None, mask=True),
    SampleSpec(9, routing=None, mask=True),
    SampleSpec(12, routing=None),  # no arrays at all
    SampleSpec(30, routing=None, heads=True),
)


# --- tests -----------------------------------------------------------------------------------------------


DRIVEN = pytest.mark.parametrize("driven", [False, True], ids=["finished-after", "assembled-as-it-comes"])


@DRIVEN
@pytest.mark.parametrize("routing", [np.uint8, np.uint16], ids=["uint8", "uint16"])
def test_assembled_tensors_are_the_served_bytes(envs, loop, routing, driven) -> None:
    specs = [SampleSpec(s.tokens, routing if s.routing is not None else None, s.heads, s.mask) for s in MIXED]
    step = make_step(envs, specs)
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=2, window=2))
    result = loop.fetch(fetcher, 7, step.ranks[0], driven=driven)

    assert result.failed == ()
    for batch, refs in zip(result.batches, step.ranks[0], strict=True):
        assert isinstance(batch, AssembledBatch)
        check_assembled(batch, refs, step.branches)
    assert sorted(result.blob_ids) == sorted(step.branches)
    assert result.nbytes == sum(b.nbytes for b in step.branches.values())
    assert result.routing_rows is not None and result.routing_rows.numpy().dtype == routing
    assert result.topk_k == HEAD_K and result.seconds > 0
    for env in envs:
        kept = len(env.blobs)
        assert len(env.fetches) == -(-kept // 2), "blobs batched two per request"
        assert all(f.holder == "trainer-0" and f.step == 7 for f in env.fetches)


def test_dummies_borrow_routing_and_carry_no_loss(envs, loop) -> None:
    step = make_step(envs, [SampleSpec(60, heads=True, mask=True), SampleSpec(50), SampleSpec(40)], data_ranks=2)
    fetcher = StepFetcher("trainer-1", loop.calls)
    dummies = 0
    for refs_of_rank in step.ranks:
        result = loop.fetch(fetcher, 0, refs_of_rank)
        for batch, refs in zip(result.batches, refs_of_rank, strict=True):
            assert isinstance(batch, AssembledBatch)
            check_assembled(batch, refs, step.branches)
            dummies += refs.dummy
            if refs.dummy:
                assert batch.topk_ids is None and batch.sampling_mask is None
    assert dummies == 1


def test_clients_and_buffers_are_reused_across_steps(envs, loop) -> None:
    step = make_step(envs, MIXED)
    fetcher = StepFetcher("trainer-0", loop.calls)
    first = loop.fetch(fetcher, 0, step.ranks[0])
    allocated = fetcher.pool.allocated_bytes
    assert allocated > 0
    second = loop.fetch(fetcher, 1, step.ranks[0])
    assert fetcher.pool.allocated_bytes == allocated, "the second step allocated fresh memory"
    assert len(loop.endpoints) == 2, "one client per env server, kept across steps"
    for old, new, refs in zip(first.batches, second.batches, step.ranks[0], strict=True):
        assert isinstance(old, AssembledBatch) and isinstance(new, AssembledBatch)
        assert new.loss_mask.data_ptr() == old.loss_mask.data_ptr(), "the same buffer is handed out again"
        check_assembled(new, refs, step.branches)


@DRIVEN
@pytest.mark.parametrize("failure", ["missing", "corrupt", "refused", "silent"])
def test_a_failed_blob_fails_exactly_its_micro_batch(envs, loop, failure, driven) -> None:
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True), SampleSpec(45, heads=True)])
    victim_batch = step.ranks[0][1]
    victim = next(item.ref.blob_id for item in victim_batch.samples if item.ref is not None)
    env = next(e for e in envs if victim in e.blobs)
    getattr(env, failure).add(victim)
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1))
    result = loop.fetch(fetcher, 3, step.ranks[0], driven=driven)

    assert result.failed == (1,)
    failed = result.batches[1]
    assert isinstance(failed, FetchFailure) and failed.blob_ids == (victim,)
    expected = {"missing": "missing", "corrupt": "checksum", "refused": "remote-error", "silent": "timeout"}
    assert failed.reason == expected[failure], failed
    assert victim not in result.blob_ids
    for index in (0, 2):
        batch = result.batches[index]
        assert isinstance(batch, AssembledBatch)
        check_assembled(batch, step.ranks[0][index], step.branches)


def test_a_micro_batch_is_assembled_while_another_is_still_on_the_wire(envs, loop) -> None:
    """The copies overlap the transfer: with one store's answers held, ``finish`` has already verified and
    assembled the micro batches the other store served, and assembles the rest once the held answers come."""
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True), SampleSpec(45, heads=True)])
    slow = envs[1]
    slow.hold = threading.Event()
    waiting = [i for i, refs in enumerate(step.ranks[0])
               if any(item.ref is not None and item.ref.blob_id in slow.blobs for item in refs.samples)]
    assert waiting and len(waiting) < len(step.ranks[0]), "a micro batch on each store"
    patient = RetryPolicy(timeout_s=WAIT_S, attempts=1, backoff=1.0)
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1, policy=patient))
    in_flight = fetcher.start(0, step.ranks[0])
    results: list[StepFetch] = []
    finisher = threading.Thread(target=lambda: results.append(
        loop.finish(fetcher, in_flight, driven=True, deadline_s=2 * WAIT_S)))
    finisher.start()
    try:
        wait_for(lambda: fetcher.pool.allocated_bytes, WAIT_S, "the first micro batches assembled")
        assert not in_flight.done, "assembled only once every request had ended"
    finally:
        slow.hold.set()
        finisher.join(4 * WAIT_S)
    assert not finisher.is_alive() and len(results) == 1
    (result,) = results
    assert not result.failed
    for refs, batch in zip(step.ranks[0], result.batches, strict=True):
        assert isinstance(batch, AssembledBatch)
        check_assembled(batch, refs, step.branches)


def test_transfer_seconds_end_before_the_micro_batches_left_once_every_request_ended_are_assembled(
        envs, loop) -> None:
    """``transfer_seconds`` is the part of ``seconds`` until every blob was received and verified: what is
    assembled once the last request ended is not in it. Regression: ``finish`` assembled the micro batches the last
    replies completed before it took the time, so a fetch finished after its requests ended (all of them then)
    reported its whole assembly as transfer, ``transfer_seconds`` equal to ``seconds``."""
    step = make_step(envs, MIXED)
    fetcher = StepFetcher("trainer-0", loop.calls)
    assembled_at: list[float] = []
    assemble = fetcher._assemble

    def timed(*args: Any) -> Any:
        assembled_at.append(time.perf_counter())
        return assemble(*args)

    fetcher._assemble = timed  # type: ignore[method-assign]
    in_flight = fetcher.start(0, step.ranks[0])
    result = loop.finish(fetcher, in_flight, driven=False)
    assert not result.failed and len(assembled_at) == len(step.ranks[0])
    assert in_flight.started + result.transfer_seconds <= min(assembled_at), "assembly counted as transfer"


@pytest.mark.parametrize("why", ["timeout", "stopped"])
def test_finish_gives_up_on_requests_that_do_not_end_within_its_bound_or_once_their_driver_stopped(
        envs, loop, why) -> None:
    """``finish`` waits for the replies only as long as it is told: past ``timeout_s``, or once ``stopped()`` (the
    rank's node loop ended), it raises ``FetchUnfinished`` instead of waiting on requests nobody drives."""
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True)])
    fetcher = StepFetcher("trainer-0", loop.calls)
    in_flight = fetcher.start(0, step.ranks[0])  # nothing drives its requests: they never end
    bound = {"timeout": {"timeout_s": 0.2}, "stopped": {"stopped": lambda: True}}[why]
    with pytest.raises(FetchUnfinished, match="within" if why == "timeout" else "stopped"):
        fetcher.finish(in_flight, **bound)  # type: ignore[arg-type]
    assert loop.calls.run_until(lambda: in_flight.done, 20 * FAST.deadline_s)
    result = fetcher.finish(in_flight)  # the requests ended meanwhile: finished as any other
    assert not result.failed


class _NoMaskRoom(BufferPool):
    """A pool that cannot give the dense sampling mask (int32), as an allocator out of memory answers."""

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.int32:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory for {shape}")
        return super().__call__(shape, dtype)


def test_a_tensor_the_allocator_cannot_give_fails_its_micro_batch_not_the_rank(envs, loop) -> None:
    """An allocation that fails (a huge mask width) fails the micro batch that needed it, like any assembly
    failure: before, the RuntimeError escaped finish() and the rank died before its collective."""
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True, mask=True), SampleSpec(45)])
    fetcher = StepFetcher("trainer-0", loop.calls)
    fetcher.pool = _NoMaskRoom()
    result = loop.fetch(fetcher, 0, step.ranks[0])
    masked = [i for i, refs in enumerate(step.ranks[0]) if any(
        item.ref is not None and "mask_ids" in item.ref.fields for item in refs.samples)]
    assert masked and result.failed == tuple(masked)
    for index, batch in enumerate(result.batches):
        if index in masked:
            assert isinstance(batch, FetchFailure) and batch.reason == "assembly" and "allocate" in batch.detail
        else:
            assert isinstance(batch, AssembledBatch)
            check_assembled(batch, step.ranks[0][index], step.branches)


def test_blobs_on_an_env_server_reported_down_fail_at_once_without_a_request(envs, loop) -> None:
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True), SampleSpec(45, heads=True)])
    dead = envs[0]
    dead.silent.update(dead.blobs)  # were it asked, it would cost the whole retry schedule
    loop.calls.mark_down(dead.endpoint, "env-a reported down (timeout)")
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1))
    result = loop.fetch(fetcher, 0, step.ranks[0])
    dead_ids = set(dead.blobs)
    assert dead.fetches == [], "no request went to the dead env server"
    for refs, batch in zip(step.ranks[0], result.batches, strict=True):
        ids = {item.ref.blob_id for item in refs.samples if item.ref is not None}
        if ids & dead_ids:
            assert isinstance(batch, FetchFailure) and batch.reason == "peer-down" and "reported down" in batch.detail
        else:
            assert isinstance(batch, AssembledBatch)
    assert result.failed and not dead_ids & set(result.blob_ids)


def test_references_that_describe_no_micro_batch_are_rejected(envs) -> None:
    step = make_step(envs, [SampleSpec(20)])
    refs = step.ranks[0][0]
    item = refs.samples[0]
    too_long = MicroBatchRefs(samples=[SampleSlice(item.sample_id, item.ref.tokens + 1, item.ref)],  # type: ignore[union-attr]
                              length=refs.length + 8)
    with pytest.raises(PlanError, match="kept 21 tokens of a blob with 20"):
        to_micro_batch(too_long)
    overfull = MicroBatchRefs(samples=refs.samples, length=8)
    with pytest.raises(PlanError, match="more than its length"):
        to_micro_batch(overfull)


def test_a_blob_verifies_whatever_order_its_arrays_arrive_in_and_only_with_its_exact_fields() -> None:
    rng = np.random.default_rng(3)
    arrays = {"routed_experts": rng.integers(0, 9, (4, 3, 2), dtype=np.uint8),
              "topk_ids": rng.integers(0, 99, (4, 2), dtype=np.int32),
              "topk_logprobs": rng.standard_normal((4, 2)).astype(np.float32)}
    ref = BlobRef(endpoint="tcp://env-a:1", source="env-a", blob_id="b1", fields=list(arrays), tokens=4,
                  nbytes=sum(a.nbytes for a in arrays.values()), checksum=blob_checksum(arrays), routing_shape=[3, 2])
    expected = Branch.from_arrays(arrays)
    for order in (arrays, dict(reversed(arrays.items()))):
        branch = _verify(ref, FetchedBlob(blob_id="b1", arrays=order))
        assert isinstance(branch, Branch) and branch.equals(expected)
    # One per blob until the step ends, so the garbage collector does not track it.
    assert not gc.is_tracked(FetchedBlob(blob_id="b1", arrays=dict(arrays)))
    corrupt = dict(reversed(arrays.items())) | {"topk_ids": arrays["topk_ids"] + 1}
    assert _verify(ref, FetchedBlob(blob_id="b1", arrays=corrupt)) == \
        FetchFailure("checksum", "blob 'b1' from tcp://env-a:1 does not match the checksum of its reference", ("b1",))
    extra = arrays | {"mask_ids": np.zeros(0, np.int32)}
    for wrong in ({k: arrays[k] for k in ("topk_ids", "topk_logprobs")}, extra):
        failure = _verify(ref, FetchedBlob(blob_id="b1", arrays=wrong))
        assert isinstance(failure, FetchFailure) and failure.reason == "malformed", failure
        assert failure.detail == f"blob 'b1': fields {sorted(wrong)}, reference lists {ref.fields}"


def test_buffer_pool_hands_out_distinct_buffers_and_keeps_one_step() -> None:
    pool = BufferPool()
    a = pool((2, 8), torch.int32)
    b = pool((2, 8), torch.int32)
    assert a.data_ptr() != b.data_ptr()
    pool.recycle()
    c = pool((1, 10), torch.int32)  # fits in a recycled buffer of 16 elements
    assert c.is_contiguous() and tuple(c.shape) == (1, 10)
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr())
    assert pool.allocated_bytes == 2 * 16 * 4
    pool.recycle()  # the buffer unused in the last step is released
    assert pool.held_bytes == 16 * 4


def _moved(refs: MicroBatchRefs, store: FakeEnvServer, stale: str) -> MicroBatchRefs:
    """``refs`` as if ``store`` had kept them at ``stale`` before restarting where it listens now."""
    samples = [SampleSlice(item.sample_id, item.tokens, msgspec.structs.replace(item.ref, endpoint=stale,
                                                                                node=store.source))
               if item.ref is not None and item.ref.endpoint == store.endpoint else item for item in refs.samples]
    return msgspec.structs.replace(refs, samples=samples)


def test_a_store_that_moved_is_found_again_through_the_registry(envs, loop) -> None:
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True), SampleSpec(45, heads=True)])
    moved = envs[0]
    stale = "tcp://127.0.0.1:9"  # where the store listened before it restarted: nothing answers there
    refs = [_moved(mb, moved, stale) for mb in step.ranks[0]]
    assert any(item.ref is not None and item.ref.endpoint == stale for mb in refs for item in mb.samples)
    registry = {(moved.source, "blobs"): moved.endpoint}
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1),
                          locate=registry_locator(lambda node, name: registry.get((node, name))))
    result = loop.fetch(fetcher, 0, refs)
    assert not result.failed and stale not in loop.endpoints
    for mb_refs, batch in zip(step.ranks[0], result.batches, strict=True):
        assert isinstance(batch, AssembledBatch)
        check_assembled(batch, mb_refs, step.branches)


@pytest.mark.parametrize("back", [True, False], ids=["back", "never-back"])
def test_a_durable_store_down_mid_fetch_is_asked_again_until_it_is_back_or_the_wait_ends(envs, loop, back) -> None:
    """Its blobs fail (``peer-down``) while it is down; asked again, re-located, they are fetched once a
    restart re-adopted them; never back, they fail once the wait is over, as before."""
    step = make_step(envs, [SampleSpec(60, heads=True), SampleSpec(50, heads=True), SampleSpec(45, heads=True)])
    moved = envs[0]
    stale = "tcp://127.0.0.1:9"
    refs = [_moved(mb, moved, stale) for mb in step.ranks[0]]
    loop.calls.mark_down(stale, "env-a reported down (timeout)")
    registry: dict[tuple[str, str], str] = {}
    timers: list[tuple[float, Callable[[], None]]] = []
    asked: list[str] = []

    def durable(node: str) -> bool:
        asked.append(node)
        if back:  # its restart registers once the first attempt has failed
            registry[(moved.source, "blobs")] = moved.endpoint
        return True

    restarts = StoreRestarts(durable, lambda delay, callback: timers.append((time.monotonic() + delay, callback)),
                             wait_s=0.5, poll_s=0.05)
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1),
                          locate=registry_locator(lambda node, name: registry.get((node, name))), restarts=restarts)
    in_flight = fetcher.start(0, refs)

    deadline = time.monotonic() + 20 * FAST.deadline_s + restarts.wait_s
    while not in_flight.done:  # the node loop: its timers, and the calls between them
        assert time.monotonic() < deadline, "the fetch outlived its deadlines"
        for due in [t for t in timers if t[0] <= time.monotonic()]:
            timers.remove(due)
            due[1]()
        loop.calls.run_until(lambda: in_flight.done, restarts.poll_s / 2)
    result = fetcher.finish(in_flight)
    assert asked and set(asked) == {moved.source}
    if back:
        assert not result.failed
        for mb_refs, batch in zip(step.ranks[0], result.batches, strict=True):
            assert isinstance(batch, AssembledBatch)
            check_assembled(batch, mb_refs, step.branches)
    else:
        assert result.failed and len(asked) > 1
        assert {b.reason for b in result.batches if isinstance(b, FetchFailure)} == {"peer-down"}


def test_a_request_asks_for_no_more_arrays_than_one_answer_carries(loop: Loop) -> None:
    """An answer carries one frame per array, and no receiver takes a message of more than ``MAX_FRAMES``
    frames: requests are cut so that each answer's arrays stay within ``MAX_BUFFERS``, however many blobs
    ``blobs_per_request`` allows (a request of that many five-array blobs used to ask for one answer of them all)."""
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=10_000, request_bytes=1 << 40))
    refs = {f"b{i}": BlobRef(endpoint="tcp://127.0.0.1:7001", source="s", blob_id=f"b{i}", fields=list(FIELDS),
                             tokens=1, nbytes=8, checksum=0) for i in range(MAX_BUFFERS // len(FIELDS) + 10)}
    requests = fetcher._requests(refs)
    assert [blob for _, ids in requests for blob in ids] == list(refs)
    assert len(requests) > 1 and all(len(ids) * len(FIELDS) <= MAX_BUFFERS for _, ids in requests)


@pytest.mark.parametrize("node", ["", "no-such-node", "\x00" * 300])
def test_references_naming_no_live_store_keep_their_recorded_endpoint(node: str) -> None:
    ref = BlobRef(endpoint="tcp://127.0.0.1:7001", source="s", blob_id="b", fields=["topk_ids"], tokens=1, nbytes=8,
                  checksum=0, node=node)
    asked: list[tuple[str, str]] = []

    def endpoint_of(node_id: str, name: str) -> str | None:
        asked.append((node_id, name))
        return None

    assert registry_locator(endpoint_of)(ref) == "tcp://127.0.0.1:7001"
    assert asked == ([(node, "blobs")] if node else [])


@DRIVEN
def test_an_env_server_sigkilled_mid_fetch_fails_its_micro_batches_and_the_others_assemble(
    bus, spawn, zmq_ctx: zmq.Context, loop: Loop, driven: bool
) -> None:
    """Two real env-server processes; one is SIGKILLed once the step's first requests are out (one in flight
    per store, the rest queued behind it). Its micro batches fail with ``timeout`` within the requests'
    deadlines, naming only its blobs; the other store's assemble the bytes it kept, and the next step, from
    the survivor alone, fetches whole."""
    _, control = bus
    procs = [spawn(["node", "env-server", "--bus-control", control, "--node-id", name,
                    "--env-server-handover-lease-s", "600"], name) for name in ("env-victim", "env-survivor")]
    producers = [Client(zmq_ctx, proc.wait_ready()["endpoints"]["blobs"], WireCodec("producer"), policy=FAST)
                 for proc in procs]
    try:
        specs = [SampleSpec(40, heads=True), SampleSpec(30, heads=True), SampleSpec(20), SampleSpec(35)]
        victim, survivor = (make_step([ServedStore(client)], specs, prefix=prefix, seed=seed)
                            for seed, (client, prefix) in enumerate(zip(producers, ("k", "s"), strict=True)))
    finally:
        for client in producers:
            client.close()
    micro_batches = [*victim.ranks[0], *survivor.ranks[0]]
    fetcher = StepFetcher("trainer-0", loop.calls, FetchSettings(blobs_per_request=1, window=1))
    in_flight = fetcher.start(0, micro_batches)
    procs[0].proc.kill()
    assert procs[0].proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    # One request at a time per store: each of the victim's may take its whole deadline.
    result = loop.finish(fetcher, in_flight, driven=driven, deadline_s=2 * len(in_flight.requests) * FAST.deadline_s)

    victim_ids = set(victim.branches)
    branches = victim.branches | survivor.branches
    failures = [batch for batch in result.batches if isinstance(batch, FetchFailure)]
    assert failures and all(index < len(victim.ranks[0]) for index in result.failed)
    assert {f.reason for f in failures} == {"timeout"} and all(set(f.blob_ids) <= victim_ids for f in failures)
    for refs, batch in zip(micro_batches, result.batches, strict=True):
        if isinstance(batch, AssembledBatch):
            check_assembled(batch, refs, branches)
    again = loop.fetch(fetcher, 1, survivor.ranks[0])
    assert not again.failed
    for refs, batch in zip(survivor.ranks[0], again.batches, strict=True):
        check_assembled(batch, refs, survivor.branches)  # type: ignore[arg-type]
