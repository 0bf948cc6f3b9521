"""Packing samples into micro batches per data rank (refbus.nodes.payload.packing)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from refbus.nodes.payload.packing import MicroBatch, PackingError, PackPlan, SampleInfo, pack

ROUTED = ("routed_experts",)
FIELD_SETS: list[tuple[str, ...]] = [
    (),
    ROUTED,
    ("routed_experts", "topk_ids", "topk_logprobs"),
    ("mask_ids", "mask_counts"),
    ("topk_ids", "topk_logprobs", "mask_ids", "mask_counts"),
    ("routed_experts", "topk_ids", "topk_logprobs", "mask_ids", "mask_counts"),
]


def check_plan(samples: Sequence[SampleInfo], plan: PackPlan, *, seq_len: int, data_ranks: int, multiple: int) -> None:
    """Assert every documented invariant of a plan; raises AssertionError naming the first one broken."""
    assert len(plan.ranks) == data_ranks, "one micro batch list per rank"
    counts = {len(rank) for rank in plan.ranks}
    assert len(counts) == 1, f"equal micro batch count per rank, got {counts}"
    assert plan.micro_batches_per_rank == counts.pop()
    for index in range(plan.micro_batches_per_rank):
        assert len({rank[index].has_routing for rank in plan.ranks}) == 1, f"routing differs at index {index}"

    by_id = {sample.sample_id: sample for sample in samples}
    placed = Counter(packed.sample.sample_id for packed in plan.real_samples())
    assert placed == Counter(sample.sample_id for sample in samples), "each sample placed once, in a real micro batch"

    every = [mb for rank in plan.ranks for mb in rank]
    real = [mb for mb in every if not mb.dummy]
    assert plan.dummy_count == len(every) - len(real)
    for mb in every:
        assert mb.samples, "no empty micro batch"
        offset = 0
        for packed in mb.samples:
            assert packed.offset == offset, "samples at contiguous offsets from 0"
            assert packed.kept == min(packed.sample.tokens, seq_len), "real length preserved, or cut to seq_len"
            assert packed.truncated == (packed.sample.tokens > seq_len)
            assert packed.sample.has_routing == mb.has_routing, "routed and unrouted never mixed"
            assert packed.sample is by_id[packed.sample.sample_id]
            offset = packed.stop
        assert mb.tokens == offset
        assert mb.tokens <= mb.length <= seq_len, "no micro batch over seq_len"
        assert mb.length % multiple == 0 and mb.padding < multiple, "padded to the next multiple only"
        kept = [packed.kept for packed in mb.samples]
        assert kept == sorted(kept, reverse=True), "packing order: longest first"
        if mb.dummy:
            assert all(p.fields == (ROUTED if mb.has_routing else ()) for p in mb.samples), "dummy fields"
            layout = [(p.sample.sample_id, p.offset, p.kept) for p in mb.samples]
            assert any(
                [(p.sample.sample_id, p.offset, p.kept) for p in other.samples] == layout and other.length == mb.length
                for other in real
            ), "a dummy copies a real micro batch's layout"
        else:
            assert all(p.fields == p.sample.fields for p in mb.samples)

    for routed in (True, False):
        group = [mb for mb in every if mb.has_routing == routed]
        dummies = [mb for mb in group if mb.dummy]
        assert len(group) % data_ranks == 0
        assert len(dummies) < data_ranks, "never a whole row of dummies"
        if dummies:
            assert all(len(mb.samples) == 1 for mb in group if not mb.dummy), "split before padding"


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[SampleInfo], int, int, int]:
    multiple = draw(st.sampled_from([1, 2, 4, 8]), label="multiple")
    seq_len = multiple * draw(st.integers(1, 12), label="seq_len / multiple")
    data_ranks = draw(st.integers(1, 5), label="data_ranks")
    count = draw(st.integers(0, 30), label="samples")
    samples = []
    for index in range(count):
        fields = draw(st.sampled_from(FIELD_SETS))
        shape = (48, 8) if "routed_experts" in fields and draw(st.booleans()) else None
        tokens = draw(st.integers(1, 2 * seq_len + 3))
        samples.append(SampleInfo(f"s{index}", tokens, fields, shape))
    return samples, seq_len, data_ranks, multiple


@settings(max_examples=300, deadline=None)
@given(problem=problems())
def test_random_steps_keep_every_invariant(problem: tuple[list[SampleInfo], int, int, int]) -> None:
    samples, seq_len, data_ranks, multiple = problem
    plan = pack(samples, seq_len=seq_len, data_ranks=data_ranks, pad_to_multiple_of=multiple)
    check_plan(samples, plan, seq_len=seq_len, data_ranks=data_ranks, multiple=multiple)
    assert plan.seq_len == seq_len and plan.pad_to_multiple_of == multiple
    assert pack(samples, seq_len=seq_len, data_ranks=data_ranks, pad_to_multiple_of=multiple) == plan


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40), seq_len=st.integers(1, 40))
def test_first_fit_leaves_at_most_one_micro_batch_half_empty(lengths: list[int], seq_len: int) -> None:
    # With one rank nothing is split, so this is pure first fit: a second bin at most half full would
    # have taken its items into the first one.
    samples = [SampleInfo(i, n) for i, n in enumerate(lengths)]
    (rank,) = pack(samples, seq_len=seq_len, data_ranks=1).ranks
    assert sum(1 for mb in rank if 2 * mb.tokens <= seq_len) <= 1


def test_first_fit_decreasing_on_a_known_case() -> None:
    samples = [SampleInfo(name, n) for name, n in [("c", 4), ("a", 6), ("e", 2), ("b", 5), ("d", 3)]]
    (rank,) = pack(samples, seq_len=10, data_ranks=1).ranks
    # a(6) opens bin 0, b(5) cannot join it, c(4) fills bin 0, d(3) and e(2) fill bin 1.
    assert [[p.sample.sample_id for p in mb.samples] for mb in rank] == [["a", "c"], ["b", "d", "e"]]
    assert [[p.offset for p in mb.samples] for mb in rank] == [[0, 6], [0, 5, 8]]


def test_equal_lengths_keep_input_order() -> None:
    samples = [SampleInfo(name, 3) for name in "xyz"]
    (rank,) = pack(samples, seq_len=9, data_ranks=1).ranks
    assert [p.sample.sample_id for p in rank[0].samples] == ["x", "y", "z"]


def test_truncation_shortens_the_kept_count_only() -> None:
    sample = SampleInfo("long", 25, ROUTED, (4, 2))
    (rank,) = pack([sample], seq_len=10, data_ranks=1).ranks
    (packed,) = rank[0].samples
    assert (packed.kept, packed.truncated, packed.sample, packed.fields) == (10, True, sample, ROUTED)
    assert rank[0].tokens == rank[0].length == 10


def test_routed_and_unrouted_are_packed_apart_and_aligned_across_ranks() -> None:
    samples = [SampleInfo(f"r{i}", 2, ROUTED) for i in range(3)] + [SampleInfo(f"u{i}", 2) for i in range(3)]
    plan = pack(samples, seq_len=100, data_ranks=2)
    for rank in plan.ranks:
        assert [mb.has_routing for mb in rank] == [True, False]
        for mb in rank:
            assert {p.sample.sample_id[0] for p in mb.samples} == ({"r"} if mb.has_routing else {"u"})
    assert plan.dummy_count == 0


def test_a_bin_is_split_rather_than_padded_with_a_dummy() -> None:
    samples = [SampleInfo("a", 3), SampleInfo("b", 3), SampleInfo("c", 2)]
    plan = pack(samples, seq_len=10, data_ranks=2)
    assert plan.dummy_count == 0
    assert sorted(mb.tokens for rank in plan.ranks for mb in rank) == [3, 5]


def test_dummies_borrow_routing_rows_of_a_real_micro_batch() -> None:
    samples = [SampleInfo("only", 7, ("routed_experts", "mask_ids", "mask_counts"), (48, 8))]
    plan = pack(samples, seq_len=16, data_ranks=3, pad_to_multiple_of=4)
    assert plan.micro_batches_per_rank == 1
    real, *dummies = sorted((rank[0] for rank in plan.ranks), key=lambda mb: mb.dummy)
    assert not real.dummy and real.samples[0].fields == samples[0].fields
    assert len(dummies) == 2
    for dummy in dummies:
        assert dummy.dummy
        assert dummy.length == real.length == 8
        assert [(p.sample, p.kept, p.fields) for p in dummy.samples] == [(samples[0], 7, ROUTED)]
    assert [p.sample.sample_id for p in plan.real_samples()] == ["only"]


def test_unrouted_dummies_list_no_field() -> None:
    plan = pack([SampleInfo("u", 3, ("topk_ids", "topk_logprobs"))], seq_len=8, data_ranks=2)
    dummy = next(rank[0] for rank in plan.ranks if rank[0].dummy)
    assert dummy.fields() == ()
    assert not dummy.has_routing


def test_dummies_copy_the_shortest_real_micro_batch() -> None:
    # No two of these fit together, so nothing can be split and one dummy fills the fourth rank.
    samples = [SampleInfo("long", 9, ROUTED), SampleInfo("short", 5, ROUTED), SampleInfo("mid", 7, ROUTED)]
    plan = pack(samples, seq_len=10, data_ranks=4)
    dummies = [mb for rank in plan.ranks for mb in rank if mb.dummy]
    assert [[p.sample.sample_id for p in mb.samples] for mb in dummies] == [["short"]]


def test_ranks_are_balanced_by_tokens() -> None:
    # Dealing these out in order would give 18 and 16 tokens; heaviest-first onto the lighter rank gives 17/17.
    samples = [SampleInfo(f"s{i}", n) for i, n in enumerate([10, 9, 8, 7])]
    plan = pack(samples, seq_len=10, data_ranks=2)
    assert [sum(mb.length for mb in rank) for rank in plan.ranks] == [17, 17]


def test_empty_step_gives_every_rank_nothing() -> None:
    plan = pack([], seq_len=8, data_ranks=3)
    assert plan.ranks == ((), (), ())
    assert plan.micro_batches_per_rank == 0 and plan.dummy_count == 0


def test_sample_info_normalises_fields_and_numpy_ints() -> None:
    info = SampleInfo("s", np.int64(5), ["mask_counts", "routed_experts", "mask_ids"], [np.int32(48), 8])
    assert info.fields == ("routed_experts", "mask_ids", "mask_counts")
    assert info.tokens == 5 and type(info.tokens) is int
    assert info.routing_shape == (48, 8)
    assert info.has_routing


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": 0}, "tokens"),
        ({"tokens": True}, "tokens"),
        ({"fields": ("logits",)}, "fields"),
        ({"fields": ("routed_experts", "routed_experts")}, "fields"),
        ({"fields": ("topk_ids",)}, "topk_logprobs"),
        ({"fields": ("mask_counts",)}, "mask_ids"),
        ({"fields": (), "routing_shape": (48, 8)}, "routing_shape"),
        ({"fields": ROUTED, "routing_shape": (48,)}, "routing_shape"),
        ({"fields": ROUTED, "routing_shape": (0, 8)}, "layers"),
    ],
)
def test_bad_sample_info_is_rejected(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"sample_id": "s", "tokens": 4, **kwargs}
    with pytest.raises(PackingError, match=match):
        SampleInfo(**arguments)  # type: ignore[arg-type]


def test_field_and_shape_checks_hold_for_every_sample_once_a_tuple_has_passed() -> None:
    """Valid field tuples are cached: a bad tuple is still refused every time, naming each sample, and a
    cached tuple or shape does not let an equal-comparing bad value (bool, numpy int) through unchanged."""
    for sample_id in ("bad-1", "bad-2"):
        with pytest.raises(PackingError, match=rf"topk_logprobs: .*\(sample '{sample_id}'\)"):
            SampleInfo(sample_id, 4, ("topk_ids",))
        with pytest.raises(PackingError, match=rf"sample '{sample_id}' fields"):
            SampleInfo(sample_id, 4, ("routed_experts", "routed_experts"))
    mixed = ("mask_counts", "routed_experts", "mask_ids")
    first, second = SampleInfo("a", 4, mixed, (48, 8)), SampleInfo("b", 4, mixed, (48, 8))
    assert first.fields == second.fields == ("routed_experts", "mask_ids", "mask_counts")
    assert SampleInfo("c", 4, list(mixed)).fields == first.fields
    with pytest.raises(PackingError, match="sample 'd' routing layers"):
        SampleInfo("d", 4, mixed, (True, 8))
    with pytest.raises(PackingError, match="sample 'e': routing_shape given without routed_experts"):
        SampleInfo("e", 4, ("mask_ids", "mask_counts"), (48, 8))
    with pytest.raises(PackingError, match="sample 'f' routing_shape: expected at most"):
        SampleInfo("f", 4, mixed, (48, 257))
    widened = SampleInfo("g", np.int64(4), mixed, (np.int32(48), 8))
    assert widened.routing_shape == (48, 8) and all(type(v) is int for v in (widened.tokens, *widened.routing_shape))


@pytest.mark.parametrize(
    ("samples", "kwargs", "match"),
    [
        ([SampleInfo("a", 1)], {"seq_len": 0, "data_ranks": 1}, "seq_len"),
        ([SampleInfo("a", 1)], {"seq_len": 4, "data_ranks": 0}, "data_ranks"),
        ([SampleInfo("a", 1)], {"seq_len": 10, "data_ranks": 1, "pad_to_multiple_of": 4}, "multiple"),
        ([SampleInfo("a", 1)], {"seq_len": 8, "data_ranks": 1, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        ([SampleInfo("a", 1), SampleInfo("a", 2)], {"seq_len": 8, "data_ranks": 1}, "duplicate"),
        (
            [SampleInfo("a", 1, ROUTED, (48, 8)), SampleInfo("b", 1, ROUTED, (40, 8))],
            {"seq_len": 8, "data_ranks": 1},
            "routing_shape",
        ),
        ([("a", 1)], {"seq_len": 8, "data_ranks": 1}, "SampleInfo"),
    ],
)
def test_bad_packing_input_is_rejected(samples: list[SampleInfo], kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(PackingError, match=match):
        pack(samples, **kwargs)


def _corruptions(plan: PackPlan) -> dict[str, PackPlan]:
    ranks = [list(rank) for rank in plan.ranks]
    first: MicroBatch = ranks[0][0]
    over = replace(first, length=plan.seq_len + 1)
    doubled = replace(first, samples=first.samples + first.samples)
    lossy_dummy = replace(next(mb for rank in ranks for mb in rank if mb.dummy), dummy=False)
    return {
        "uneven": replace(plan, ranks=(tuple(ranks[0][1:]), *map(tuple, ranks[1:]))),
        "over seq_len": replace(plan, ranks=((over, *ranks[0][1:]), *map(tuple, ranks[1:]))),
        "placed twice": replace(plan, ranks=((doubled, *ranks[0][1:]), *map(tuple, ranks[1:]))),
        "dummy with loss": replace(
            plan, ranks=tuple(tuple(lossy_dummy if mb.dummy else mb for mb in rank) for rank in ranks)
        ),
    }


@pytest.mark.parametrize("corruption", ["uneven", "over seq_len", "placed twice", "dummy with loss"])
def test_the_invariant_checker_catches_broken_plans(corruption: str) -> None:
    samples = [SampleInfo("a", 5, ROUTED), SampleInfo("b", 4, ROUTED), SampleInfo("c", 3)]
    plan = pack(samples, seq_len=8, data_ranks=2)
    check_plan(samples, plan, seq_len=8, data_ranks=2, multiple=1)
    with pytest.raises(AssertionError):
        check_plan(samples, _corruptions(plan)[corruption], seq_len=8, data_ranks=2, multiple=1)
