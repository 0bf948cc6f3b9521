"""Branch validation, wire conversion and slicing (refbus.nodes.payload.branch)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from branches import random_arrays
from hypothesis import given, settings
from hypothesis import strategies as st
from refbus.nodes.payload.branch import FIELDS, MAX_MASK_WIDTH, Branch, BranchError


def make_branch(tokens: int, *, max_count: int = 5, **shape: object) -> Branch:
    return Branch(**random_arrays(tokens, max_count=max_count, **shape))  # type: ignore[arg-type]


def test_helpers_report_shape_and_size() -> None:
    branch = make_branch(7, layers=5, top_k=3, k=4)
    assert branch.token_count == 7
    assert branch.routing_shape == (5, 3)
    assert branch.topk_k == 4
    assert branch.fields() == FIELDS
    assert branch.mask_counts is not None
    expected = 7 * 5 * 3 + 7 * 4 * 4 * 2 + 4 * int(branch.mask_counts.sum()) + 7 * 4
    assert branch.nbytes == expected


@pytest.mark.parametrize(
    "fields",
    [("routed_experts",), ("topk_ids", "topk_logprobs"), ("mask_ids", "mask_counts")],
)
def test_any_single_group_of_fields_is_a_branch(fields: tuple[str, ...]) -> None:
    branch = make_branch(6, fields=fields)
    assert branch.fields() == fields
    assert branch.token_count == 6
    assert (branch.routing_shape is None) == ("routed_experts" not in fields)
    assert (branch.topk_k is None) == ("topk_ids" not in fields)


def test_fields_come_back_in_canonical_order_whatever_the_keyword_order() -> None:
    full = make_branch(3)
    reordered = Branch.from_arrays(dict(reversed(list(full.to_arrays().items()))))
    assert reordered.fields() == FIELDS
    assert list(reordered.to_arrays()) == list(FIELDS)


def test_uint16_routing_keeps_indices_above_255() -> None:
    rows = np.array([[[300, 1]], [[511, 256]], [[2, 65_535]]], dtype=np.uint16)
    branch = Branch(routed_experts=rows)
    assert branch.routing_shape == (1, 2)
    cut = branch.slice_to(2)
    assert cut.routed_experts is not None
    assert cut.routed_experts.dtype == np.uint16
    assert cut.routed_experts.tolist() == [[[300, 1]], [[511, 256]]]


def test_arrays_are_read_only_views_and_callers_arrays_stay_writable() -> None:
    rows = np.zeros((4, 2, 2), dtype=np.uint8)
    branch = Branch(routed_experts=rows)
    assert branch.routed_experts is not None
    assert np.shares_memory(branch.routed_experts, rows)
    assert not branch.routed_experts.flags.writeable
    assert rows.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        branch.routed_experts[0, 0, 0] = 1


def test_non_contiguous_input_is_stored_contiguous() -> None:
    wide = np.arange(24, dtype=np.int32).reshape(3, 8)
    ids = wide[:, ::2]
    logprobs = np.zeros((3, 4), dtype=np.float32)
    branch = Branch(topk_ids=ids, topk_logprobs=logprobs)
    assert branch.topk_ids is not None
    assert branch.topk_ids.flags.c_contiguous
    assert np.array_equal(branch.topk_ids, ids)


def test_wire_round_trip_through_read_only_frames_is_byte_identical() -> None:
    branch = make_branch(9, seed=3, routing_dtype=np.uint16)
    arrays = branch.to_arrays()
    frames = {name: (array.tobytes(), array.dtype, array.shape) for name, array in arrays.items()}
    received = {name: np.frombuffer(data, dtype=dtype).reshape(shape) for name, (data, dtype, shape) in frames.items()}
    assert not any(array.flags.writeable for array in received.values())
    rebuilt = Branch.from_arrays(received)
    assert rebuilt.equals(branch)
    assert rebuilt.nbytes == branch.nbytes


def test_equals_detects_a_single_changed_byte_and_a_changed_dtype() -> None:
    branch = make_branch(5, seed=1)
    arrays = {name: array.copy() for name, array in branch.to_arrays().items()}
    arrays["topk_logprobs"][4, 3] += 1.0
    assert not Branch.from_arrays(arrays).equals(branch)
    rows = np.ones((2, 1, 1), dtype=np.uint8)
    assert not Branch(routed_experts=rows).equals(Branch(routed_experts=rows.astype(np.uint16)))
    assert not Branch(routed_experts=rows).equals(make_branch(2, fields=("topk_ids", "topk_logprobs")))
    assert Branch(routed_experts=rows).equals(Branch(routed_experts=rows.copy()))


def test_unknown_wire_field_is_rejected_by_name() -> None:
    with pytest.raises(BranchError) as caught:
        Branch.from_arrays({"routed_experts": np.zeros((1, 1, 1), np.uint8), "logits": np.zeros(1)})
    assert caught.value.field == "logits"


def _valid() -> dict[str, np.ndarray]:
    return {name: array.copy() for name, array in make_branch(4, seed=2, max_count=3).to_arrays().items()}


def _with(**changes: object) -> dict[str, object]:
    arrays: dict[str, object] = dict(_valid())
    for name, value in changes.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    return arrays


def _counts_and_ids(counts: list[int], ids: list[int]) -> dict[str, object]:
    return _with(mask_counts=np.array(counts, np.int32), mask_ids=np.array(ids, np.int32))


BAD_BRANCHES: list[tuple[str, dict[str, object], str, str]] = [
    ("routing int32", _with(routed_experts=np.zeros((4, 3, 2), np.int32)), "routed_experts", "int32"),
    ("routing 2-D", _with(routed_experts=np.zeros((4, 6), np.uint8)), "routed_experts", "(4, 6)"),
    ("routing zero layers", _with(routed_experts=np.zeros((4, 0, 2), np.uint8)), "routed_experts", "(4, 0, 2)"),
    ("routing as list", _with(routed_experts=[[[1]]] * 4), "routed_experts", "list"),
    ("topk ids int64", _with(topk_ids=np.zeros((4, 4), np.int64)), "topk_ids", "int64"),
    ("logprobs float64", _with(topk_logprobs=np.zeros((4, 4), np.float64)), "topk_logprobs", "float64"),
    ("logprobs other k", _with(topk_logprobs=np.zeros((4, 3), np.float32)), "topk_logprobs", "(4, 3)"),
    (
        "topk k = 0",
        _with(topk_ids=np.zeros((4, 0), np.int32), topk_logprobs=np.zeros((4, 0), np.float32)),
        "topk_ids",
        "(4, 0)",
    ),
    ("ids without logprobs", _with(topk_logprobs=None), "topk_logprobs", "missing"),
    ("logprobs without ids", _with(topk_ids=None), "topk_ids", "missing"),
    ("mask ids without counts", _with(mask_counts=None), "mask_counts", "missing"),
    ("counts without ids", _with(mask_ids=None), "mask_ids", "missing"),
    ("mask ids int64", _with(mask_ids=np.zeros(0, np.int64)), "mask_ids", "int64"),
    ("counts int64", _with(mask_counts=np.zeros(4, np.int64)), "mask_counts", "int64"),
    ("counts 2-D", _with(mask_counts=np.zeros((4, 1), np.int32)), "mask_counts", "(4, 1)"),
    ("ids short of counts", _counts_and_ids([1, 2, 0, 0], [5, 6]), "mask_ids", "length 2"),
    ("ids beyond counts", _counts_and_ids([1, 0, 0, 0], [5, 6]), "mask_ids", "length 2"),
    ("negative count", _counts_and_ids([2, -1, 0, 0], [5]), "mask_counts", "-1"),
    ("negative id", _counts_and_ids([1, 0, 0, 0], [-1]), "mask_ids", "-1"),
    # One count past the bound would size a trainer's whole dense mask (tokens x count int32).
    ("count past the mask width", _counts_and_ids([MAX_MASK_WIDTH + 1, 0, 0, 0], list(range(MAX_MASK_WIDTH + 1))),
     "mask_counts", f"maximum {MAX_MASK_WIDTH + 1}"),
    (
        "topk fewer tokens",
        _with(topk_ids=np.zeros((3, 4), np.int32), topk_logprobs=np.zeros((3, 4), np.float32)),
        "topk_ids",
        "3 tokens",
    ),
    ("mask more tokens", _counts_and_ids([0, 0, 0, 0, 0], []), "mask_counts", "5 tokens"),
    ("no field", {}, "branch", "no field"),
]


@pytest.mark.parametrize(
    ("arrays", "field", "actual"), [case[1:] for case in BAD_BRANCHES], ids=[case[0] for case in BAD_BRANCHES]
)
def test_bad_branch_is_rejected_naming_field_expected_and_actual(
    arrays: dict[str, object], field: str, actual: str
) -> None:
    with pytest.raises(BranchError) as caught:
        Branch(**arrays)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field
    assert actual in caught.value.actual
    assert caught.value.expected
    assert str(caught.value).startswith(f"{field}: expected ")


def test_valid_fixture_is_accepted() -> None:
    # The bad cases above differ from this one field at a time; it must itself be valid.
    assert Branch(**_valid()).token_count == 4


@settings(max_examples=120, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=0, max_size=40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_slice_to_cuts_every_field_to_the_kept_prefix(counts: list[int], seed: int, data: st.DataObject) -> None:
    tokens = len(counts)
    rng = np.random.default_rng(seed)
    mask_counts = np.array(counts, dtype=np.int32)
    mask_ids = rng.integers(0, 1000, int(mask_counts.sum()), dtype=np.int32)
    routing = rng.integers(0, 255, (tokens, 2, 3), dtype=np.uint8)
    topk_ids = rng.integers(0, 1000, (tokens, 2), dtype=np.int32)
    logprobs = rng.random((tokens, 2), dtype=np.float32)
    branch = Branch(
        routed_experts=routing, topk_ids=topk_ids, topk_logprobs=logprobs, mask_ids=mask_ids, mask_counts=mask_counts
    )
    cut = data.draw(st.integers(0, tokens), label="cut")

    sliced = branch.slice_to(cut)

    assert sliced.token_count == cut
    assert sliced.fields() == branch.fields()
    assert np.array_equal(sliced.routed_experts, routing[:cut])
    assert np.array_equal(sliced.topk_ids, topk_ids[:cut])
    assert np.array_equal(sliced.topk_logprobs, logprobs[:cut])
    assert np.array_equal(sliced.mask_counts, mask_counts[:cut])
    # The ids that survive are exactly those of the surviving tokens, token by token.
    starts = np.concatenate([[0], np.cumsum(counts)])
    expected_ids = [mask_ids[starts[t] : starts[t + 1]].tolist() for t in range(cut)]
    assert sliced.mask_ids is not None
    got = sliced.mask_ids.tolist()
    assert [got[starts[t] : starts[t + 1]] for t in range(cut)] == expected_ids
    assert len(got) == int(starts[cut])
    # Slicing is a view: no byte is copied.
    for name, array in sliced.to_arrays().items():
        if array.size:
            assert np.shares_memory(array, getattr(branch, name)), name


def test_slice_to_full_length_returns_the_branch_itself() -> None:
    branch = make_branch(5)
    assert branch.slice_to(5) is branch
    assert branch.slice_to(np.int64(3)).token_count == 3


@pytest.mark.parametrize("kept", [-1, 6, 2.0, True])
def test_slice_to_out_of_range_or_non_int_is_rejected(kept: object) -> None:
    with pytest.raises(BranchError) as caught:
        make_branch(5).slice_to(kept)  # type: ignore[arg-type]
    assert caught.value.field == "kept_tokens"


def test_branch_and_packing_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import refbus.nodes.payload.branch, refbus.nodes.payload.packing\n"
        "assert 'refbus.nodes.payload.packing' in sys.modules\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
