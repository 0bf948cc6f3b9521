"""Assembling fetched arrays into model-ready tensors (refbus.nodes.payload.assemble)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from branches import random_arrays
from hypothesis import given, settings
from hypothesis import strategies as st
from refbus.nodes.payload.assemble import (
    AssembledBatch,
    AssemblyError,
    RoutingUnavailableError,
    assemble,
    assemble_dropped,
    find_routing_rows,
)
from refbus.nodes.payload.branch import FIELDS, Branch
from refbus.nodes.payload.packing import MicroBatch, SampleInfo, pack

LAYERS, TOP_K, K = 3, 2, 4
TOPK = ("topk_ids", "topk_logprobs")
MASK = ("mask_ids", "mask_counts")


def make_branch(
    tokens: int, fields: tuple[str, ...] = FIELDS, *, seed: int = 0, routing_dtype: type = np.uint8, max_count: int = 4
) -> Branch:
    return Branch(**random_arrays(tokens, seed=seed, layers=LAYERS, top_k=TOP_K, k=K, max_count=max_count,
                                  routing_dtype=routing_dtype, fields=fields))


def as_frames(branch: Branch) -> Branch:
    """The branch as a receiver sees it: read-only arrays over immutable bytes."""
    return Branch.from_arrays(
        {name: np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape) for name, a in branch.to_arrays().items()}
    )


def info(sample_id: str, branch: Branch, fields: tuple[str, ...] | None = None) -> SampleInfo:
    return SampleInfo(
        sample_id, branch.token_count, branch.fields() if fields is None else fields, branch.routing_shape
    )


def reference(mb: MicroBatch, branches: list[Branch | None], width: int) -> dict[str, np.ndarray]:
    """Naive per-token construction, independent of the implementation's vectorised writes."""
    length = mb.length
    out = {
        "routed_experts": np.zeros((1, length, LAYERS, TOP_K), _routing_dtype(branches)),
        "sampling_mask": np.full((1, length, width), -1, np.int32),
        "topk_ids": np.zeros((1, length, K), np.int64),
        "topk_logprobs": np.zeros((1, length, K), np.float32),
        "topk_valid": np.zeros((1, length), bool),
        "loss_mask": np.zeros((1, length), bool),
    }
    for packed, branch in zip(mb.samples, branches, strict=True):
        for t in range(packed.kept):
            row = packed.offset + t
            out["loss_mask"][0, row] = not mb.dummy
            if branch is None:
                continue
            if "routed_experts" in packed.fields:
                out["routed_experts"][0, row] = branch.routed_experts[t]
            if "topk_ids" in packed.fields:
                out["topk_ids"][0, row] = branch.topk_ids[t]
                out["topk_logprobs"][0, row] = branch.topk_logprobs[t]
                out["topk_valid"][0, row] = True
            if "mask_ids" in packed.fields:
                start = int(branch.mask_counts[:t].sum())
                count = int(branch.mask_counts[t])
                out["sampling_mask"][0, row, :count] = branch.mask_ids[start : start + count]
    return out


def _routing_dtype(branches: list[Branch | None]) -> np.dtype:
    """The wire dtype assembly keeps: uint16 as soon as one branch carries it."""
    dtypes = [b.routed_experts.dtype for b in branches if b is not None and b.routed_experts is not None]
    return np.dtype(np.uint16) if np.dtype(np.uint16) in dtypes else np.dtype(np.uint8)


def assert_matches(got: AssembledBatch, expected: dict[str, np.ndarray]) -> None:
    fields = got.micro_batch.fields()
    present = {
        "routed_experts": "routed_experts" in fields,
        "sampling_mask": "mask_ids" in fields,
        "topk_ids": "topk_ids" in fields,
        "topk_logprobs": "topk_ids" in fields,
        "topk_valid": "topk_ids" in fields,
        "loss_mask": True,
    }
    dtypes = {
        "routed_experts": getattr(torch, str(expected["routed_experts"].dtype)),
        "sampling_mask": torch.int32,
        "topk_ids": torch.int64,
        "topk_logprobs": torch.float32,
        "topk_valid": torch.bool,
        "loss_mask": torch.bool,
    }
    for name, want in expected.items():
        tensor = getattr(got, name)
        assert (tensor is not None) == present[name], name
        if tensor is None:
            continue
        assert tensor.dtype == dtypes[name], name
        assert tuple(tensor.shape) == want.shape, name
        assert np.array_equal(tensor.numpy(), want), name


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=10),
    field_choice=st.lists(st.sampled_from([FIELDS, ("routed_experts",), ("routed_experts", *MASK), ()]), min_size=10),
    seq_len=st.sampled_from([8, 16, 32]),
    data_ranks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_packed_steps_assemble_like_the_naive_reference(
    lengths: list[int], field_choice: list[tuple[str, ...]], seq_len: int, data_ranks: int, seed: int
) -> None:
    branches: dict[str, Branch | None] = {}
    infos = []
    for index, tokens in enumerate(lengths):
        fields = field_choice[index]
        branch = as_frames(make_branch(tokens, fields, seed=seed + index)) if fields else None
        branches[f"s{index}"] = branch
        infos.append(SampleInfo(f"s{index}", tokens, fields))
    plan = pack(infos, seq_len=seq_len, data_ranks=data_ranks, pad_to_multiple_of=4)
    for rank in plan.ranks:
        for mb in rank:
            fetched = [branches[p.sample.sample_id] for p in mb.samples]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # e.g. torch's warning on non-writable numpy input
                got = assemble(mb, fetched)
            width = 1 if got.sampling_mask is None else got.sampling_mask.shape[2]
            kept_counts = [
                int(b.mask_counts[: p.kept].max(initial=0))
                for p, b in zip(mb.samples, fetched, strict=True)
                if b is not None and "mask_ids" in p.fields
            ]
            assert width == max([1, *kept_counts])
            assert_matches(got, reference(mb, fetched, width))
            assert got.length == mb.length and not got.dropped


def test_padding_rows_hold_the_documented_values() -> None:
    branch = make_branch(5)
    (rank,) = pack([info("a", branch)], seq_len=8, data_ranks=1, pad_to_multiple_of=8).ranks
    got = assemble(rank[0], [branch])
    assert got.length == 8
    assert got.routed_experts is not None and got.sampling_mask is not None
    assert got.topk_ids is not None and got.topk_logprobs is not None and got.topk_valid is not None
    assert got.loss_mask[0].tolist() == [True] * 5 + [False] * 3
    assert got.topk_valid[0].tolist() == [True] * 5 + [False] * 3
    assert torch.all(got.routed_experts[0, 5:] == 0)
    assert torch.all(got.routed_experts[0, :5] > 0)
    assert torch.all(got.sampling_mask[0, 5:] == -1)
    assert torch.all(got.topk_ids[0, 5:] == 0) and torch.all(got.topk_logprobs[0, 5:] == 0.0)
    assert torch.all(got.topk_logprobs[0, :5] < 0)


def test_mask_rows_are_ids_then_minus_one_and_kept_tokens_only() -> None:
    counts = np.array([2, 0, 3, 1], np.int32)
    ids = np.array([10, 11, 20, 21, 22, 30], np.int32)
    branch = Branch(mask_ids=ids, mask_counts=counts)
    sample = SampleInfo("m", 4, MASK)
    (rank,) = pack([sample], seq_len=3, data_ranks=1).ranks
    got = assemble(rank[0], [branch])
    assert got.sampling_mask is not None
    # Token 3 (one id) is cut by seq_len=3; the widest kept token has 3 ids.
    assert got.sampling_mask[0].tolist() == [[10, 11, -1], [-1, -1, -1], [20, 21, 22]]
    assert got.routed_experts is None and got.topk_ids is None


def test_routing_stays_in_its_wire_dtype_and_uint16_wins_in_a_mixed_micro_batch() -> None:
    narrow = Branch(routed_experts=np.array([[[7, 255]]], np.uint8))
    (rank,) = pack([info("n", narrow)], seq_len=2, data_ranks=1).ranks
    got = assemble(rank[0], [as_frames(narrow)])
    assert got.routed_experts is not None and got.routed_experts.dtype == torch.uint8
    assert got.routed_experts[0, :1].tolist() == [[[7, 255]]] and not bool(got.routed_experts[0, 1:].any())
    wide = Branch(routed_experts=np.array([[[300, 65_535]], [[256, 0]]], np.uint16))
    (rank,) = pack([info("w", wide), info("n", narrow)], seq_len=4, data_ranks=1).ranks
    (mb,) = rank
    by_id = {"w": wide, "n": narrow}
    got = assemble(mb, [as_frames(by_id[p.sample.sample_id]) for p in mb.samples])
    assert got.routed_experts is not None and got.routed_experts.dtype == torch.uint16
    rows = {p.sample.sample_id: got.routed_experts[0, p.offset : p.stop].tolist() for p in mb.samples}
    assert rows == {"w": [[[300, 65_535]], [[256, 0]]], "n": [[[7, 255]]]}


def test_fetched_branch_longer_than_kept_is_cut_here() -> None:
    branch = make_branch(12, seed=4)
    mb = pack([info("a", branch)], seq_len=8, data_ranks=1).ranks[0][0]
    assert mb.samples[0].kept == 8
    got = assemble(mb, [branch])
    assert_matches(got, reference(mb, [branch], got.sampling_mask.shape[2]))  # type: ignore[union-attr]
    assert got.routed_experts is not None and branch.routed_experts is not None
    assert np.array_equal(got.routed_experts[0].numpy(), branch.routed_experts[:8])


def test_a_sample_without_a_field_gets_padding_rows_in_that_tensor() -> None:
    with_all = make_branch(3, seed=1)
    routing_only = make_branch(4, ("routed_experts",), seed=2)
    (rank,) = pack([info("all", with_all), info("bare", routing_only)], seq_len=16, data_ranks=1).ranks
    (mb,) = rank
    order = [p.sample.sample_id for p in mb.samples]
    assert order == ["bare", "all"]
    got = assemble(mb, [routing_only, with_all])
    assert got.topk_valid is not None and got.sampling_mask is not None and got.topk_ids is not None
    assert got.topk_valid[0].tolist() == [False] * 4 + [True] * 3
    assert torch.all(got.sampling_mask[0, :4] == -1)
    assert torch.all(got.topk_ids[0, :4] == 0)
    assert got.loss_mask[0].tolist() == [True] * 7
    assert_matches(got, reference(mb, [routing_only, with_all], got.sampling_mask.shape[2]))


def test_result_shares_no_memory_with_the_frames() -> None:
    branch = as_frames(make_branch(6))
    mb = pack([info("a", branch)], seq_len=8, data_ranks=1).ranks[0][0]
    got = assemble(mb, [branch])
    for name in ("routed_experts", "topk_ids", "topk_logprobs"):
        tensor = getattr(got, name)
        assert not np.shares_memory(tensor.numpy(), getattr(branch, name)), name


def test_dummy_routes_borrowed_rows_and_carries_no_loss() -> None:
    branch = make_branch(5, seed=7)
    plan = pack([info("a", branch)], seq_len=8, data_ranks=2)
    dummy = next(rank[0] for rank in plan.ranks if rank[0].dummy)
    got = assemble(dummy, [branch])
    assert not bool(got.loss_mask.any())
    assert got.sampling_mask is None and got.topk_ids is None
    assert got.routed_experts is not None and branch.routed_experts is not None
    assert np.array_equal(got.routed_experts[0].numpy(), branch.routed_experts)


def test_unrouted_dummy_has_only_a_zero_loss_mask() -> None:
    plan = pack([SampleInfo("u", 3)], seq_len=8, data_ranks=2)
    dummy = next(rank[0] for rank in plan.ranks if rank[0].dummy)
    got = assemble(dummy, [None])
    assert got.loss_mask.shape == (1, 3) and not bool(got.loss_mask.any())
    assert got.routed_experts is None and got.sampling_mask is None and got.topk_ids is None


def test_fixed_mask_width_pads_extra_columns() -> None:
    branch = make_branch(4, MASK, max_count=2)
    mb = pack([info("a", branch)], seq_len=4, data_ranks=1).ranks[0][0]
    got = assemble(mb, [branch], mask_width=7)
    assert got.sampling_mask is not None
    assert got.sampling_mask.shape == (1, 4, 7)
    assert torch.all(got.sampling_mask[0, :, 2:] == -1)
    assert_matches(got, reference(mb, [branch], 7))


def test_every_element_is_written_even_into_dirty_buffers() -> None:
    branch = make_branch(6, seed=9)
    mb = pack([info("a", branch)], seq_len=16, data_ranks=1, pad_to_multiple_of=16).ranks[0][0]
    requested: list[tuple[tuple[int, ...], torch.dtype]] = []

    def dirty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        requested.append((shape, dtype))
        return torch.full(shape, True if dtype == torch.bool else 77, dtype=dtype)

    clean = assemble(mb, [branch])
    got = assemble(mb, [branch], allocator=dirty)
    assert len(requested) == 6
    for name in ("loss_mask", "routed_experts", "sampling_mask", "topk_ids", "topk_logprobs", "topk_valid"):
        assert torch.equal(getattr(got, name), getattr(clean, name)), name
    assert got.nbytes == clean.nbytes > 0


def test_allocator_returning_the_wrong_tensor_is_rejected() -> None:
    branch = make_branch(2, ("routed_experts",))
    mb = pack([info("a", branch)], seq_len=4, data_ranks=1).ranks[0][0]
    with pytest.raises(AssemblyError, match="allocator"):
        assemble(mb, [branch], allocator=lambda shape, dtype: torch.empty((1, 1), dtype=dtype))
    with pytest.raises(AssemblyError, match="allocator"):
        assemble(mb, [branch], allocator=lambda shape, dtype: torch.empty(shape, dtype=torch.float64))


TWO_WIDE_MASK = Branch(mask_ids=np.array([1, 2], np.int32), mask_counts=np.array([2, 0, 0, 0], np.int32))


def _one_sample(fields: tuple[str, ...] = FIELDS, tokens: int = 4) -> MicroBatch:
    return pack([SampleInfo("a", tokens, fields)], seq_len=8, data_ranks=1).ranks[0][0]


@pytest.mark.parametrize(
    ("mb", "branches", "kwargs", "match"),
    [
        (_one_sample(), [], {}, "one per sample"),
        (_one_sample(), [None], {}, "expected a Branch"),
        (_one_sample(), [make_branch(4, ("routed_experts", *TOPK))], {}, "lacks"),
        (_one_sample(), [make_branch(3)], {}, "at least 4 tokens"),
        (_one_sample(MASK), [TWO_WIDE_MASK], {"mask_width": 1}, "mask_width"),
        (
            pack([SampleInfo("a", 2, ("routed_experts",), (LAYERS, TOP_K + 1))], seq_len=8, data_ranks=1).ranks[0][0],
            [make_branch(2, ("routed_experts",))],
            {},
            "routed_experts",
        ),
    ],
    ids=["count", "none", "missing field", "too short", "narrow mask", "routing shape"],
)
def test_arrays_that_disagree_with_the_micro_batch_are_rejected(
    mb: MicroBatch, branches: list[Branch | None], kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(AssemblyError, match=match):
        assemble(mb, branches, **kwargs)


def test_branches_with_different_routing_shapes_cannot_share_a_micro_batch() -> None:
    a = make_branch(2, ("routed_experts",))
    b = Branch(routed_experts=np.zeros((2, LAYERS + 1, TOP_K), np.uint8))
    # Packing cannot see shapes that the references omit, so assembly is the last line of defence.
    routed = ("routed_experts",)
    plan = pack([SampleInfo("a", 2, routed), SampleInfo("b", 2, routed)], seq_len=8, data_ranks=1)
    with pytest.raises(AssemblyError, match="routed_experts"):
        assemble(plan.ranks[0][0], [a, b])


def test_dropped_micro_batch_repeats_real_rows_with_zero_loss() -> None:
    rows = make_branch(3, ("routed_experts",), seed=11).routed_experts
    assert rows is not None
    mb = _one_sample(FIELDS, tokens=7)
    got = assemble_dropped(mb, rows, mask_width=5, topk_k=K)
    assert got.dropped and got.length == 7
    assert not bool(got.loss_mask.any())
    assert got.routed_experts is not None and got.routed_experts.dtype == torch.uint8
    for position in range(7):
        assert np.array_equal(got.routed_experts[0, position].numpy(), rows[position % 3]), position
    assert got.sampling_mask is not None and got.sampling_mask.shape == (1, 7, 5)
    assert torch.all(got.sampling_mask == -1)
    assert got.topk_ids is not None and got.topk_logprobs is not None and got.topk_valid is not None
    assert got.topk_ids.shape == (1, 7, K) and torch.all(got.topk_ids == 0)
    assert torch.all(got.topk_logprobs == 0.0) and not bool(got.topk_valid.any())


def test_dropped_micro_batch_accepts_more_rows_than_positions_and_torch_rows() -> None:
    rows = torch.from_numpy(np.arange(10 * LAYERS * TOP_K, dtype=np.uint16).reshape(10, LAYERS, TOP_K))
    mb = _one_sample(("routed_experts",), tokens=4)
    got = assemble_dropped(mb, rows)
    assert got.routed_experts is not None
    assert got.routed_experts.dtype == torch.uint16
    assert np.array_equal(got.routed_experts[0].numpy(), rows[:4].numpy())
    assert got.sampling_mask is None and got.topk_ids is None


def test_dropped_routed_micro_batch_without_any_rows_stops_loudly() -> None:
    with pytest.raises(RoutingUnavailableError):
        assemble_dropped(_one_sample(("routed_experts",)), None)
    assert isinstance(RoutingUnavailableError("x"), AssemblyError)


def test_dropped_unrouted_micro_batch_needs_no_rows() -> None:
    got = assemble_dropped(_one_sample(MASK), None)
    assert got.routed_experts is None
    assert got.sampling_mask is not None and got.sampling_mask.shape == (1, 4, 1)
    assert not bool(got.loss_mask.any())


@pytest.mark.parametrize(
    ("rows", "kwargs", "match"),
    [
        (np.zeros((2, LAYERS, TOP_K + 1), np.uint8), {}, "routing_rows"),
        (np.zeros((0, LAYERS, TOP_K), np.uint8), {}, "routing_rows"),
        (np.zeros((2, LAYERS * TOP_K), np.uint8), {}, "routing_rows"),
        (np.zeros((2, LAYERS, TOP_K), np.float32), {}, "routing_rows"),
        (np.zeros((2, LAYERS, TOP_K), np.int32), {}, "routing_rows"),
        (np.zeros((2, LAYERS, TOP_K), np.uint8), {"topk_k": None}, "topk_k"),
    ],
)
def test_dropped_with_unusable_inputs_is_rejected(rows: np.ndarray, kwargs: dict[str, object], match: str) -> None:
    mb = pack([SampleInfo("a", 3, FIELDS, (LAYERS, TOP_K))], seq_len=4, data_ranks=1).ranks[0][0]
    with pytest.raises(AssemblyError, match=match):
        assemble_dropped(mb, rows, **kwargs)  # type: ignore[arg-type]


def test_find_routing_rows_takes_the_longest_real_routing() -> None:
    short = make_branch(2, ("routed_experts",), seed=1)
    long = make_branch(5, ("routed_experts",), seed=2)
    assert find_routing_rows([None, make_branch(9, MASK), short, long]) is long.routed_experts
    assert find_routing_rows([None, make_branch(3, TOPK)]) is None
    assert find_routing_rows([short.slice_to(0)]) is None
