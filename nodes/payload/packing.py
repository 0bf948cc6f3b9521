"""Packing a step's samples into micro batches for the data ranks (orchestrator side, no arrays touched).

Algorithm (:func:`pack`):

1. **Truncate.** A sample longer than ``seq_len`` keeps its first ``seq_len`` tokens. Truncation shortens the
   kept count and nothing else: the sample still points at the same blob, and the trainer cuts the arrays.
2. **Group.** Samples with routing and samples without are packed separately and never share a micro batch:
   a micro batch's routing tensor exists for every token or for none.
3. **First fit decreasing.** Within a group, samples are taken by descending kept length (ties: input order)
   and each goes into the first micro batch it fits in (``tokens + kept <= seq_len``), else a new one.
4. **Split before padding.** While a group's micro batch count is not a positive multiple of ``data_ranks``,
   the micro batch with the most tokens that holds at least two samples is split in two (longest sample to
   the lighter half). This turns would-be dummies into real work; it stops when only single-sample micro
   batches are left.
5. **Dummies.** The rest of the gap is filled with dummy micro batches. A dummy copies the layout of the
   group's shortest real micro batch (same samples, offsets and length) but lists only the routing field
   (routed group) or no field at all (unrouted group): the forward pass then routes real rows, and the
   dummy carries no loss.
6. **Distribute.** Each group is spread over the ranks, an equal count per rank, heaviest first onto the
   rank with the fewest tokens so far. Each rank runs its routed micro batches, then its unrouted ones.

Invariants of the returned :class:`PackPlan` (the tests check each one):

- every rank has the same number of micro batches, and at each index either all ranks have routing or none;
- every input sample appears in exactly one real (non-dummy) micro batch, with
  ``kept == min(tokens, seq_len)``;
- a micro batch's samples are in packing order (non-increasing kept length) at contiguous offsets from 0;
- ``tokens <= length <= seq_len``, and ``length`` is a multiple of ``pad_to_multiple_of``;
- all samples of a micro batch agree with its ``has_routing``;
- dummies carry no loss and list no field other than ``routed_experts``.

Ownership: a dummy *borrows* its samples' references from a real micro batch, possibly on another rank.
The real micro batch's rank owns (and later deletes) those blobs; a dummy's references must never be deleted
or counted as trained. :meth:`PackPlan.real_samples` yields each owned sample exactly once.

This module is pure Python (it imports numpy-only :mod:`.branch`); it never imports torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral

from .branch import FIELDS, MAX_ROUTING_LAYERS, MAX_ROUTING_TOP_K, ROUTED_EXPERTS, BranchError, check_pairs


class PackingError(ValueError):
    """The samples or packing parameters are invalid (the message names which and why)."""


def _positive_int(name: str, value: object) -> int:
    if type(value) is int and value >= 1:  # the common case, without the ABC check (a step plans thousands)
        return value
    # Integral admits numpy integers (token counts often come out of arrays); bool is excluded on purpose.
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise PackingError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class SampleInfo:
    """What packing needs to know about one trainable sequence; the arrays stay where they are.

    Attributes:
        sample_id: unique within a step; the caller maps it back to its reference (endpoint, blob id).
        tokens: the sequence's full token count (>= 1), before any truncation.
        fields: names of the arrays kept for it (subset of :data:`~.branch.FIELDS`, pairs complete);
            normalised to canonical order. Empty for a sample without arrays.
        routing_shape: ``(layers, top_k)`` when it has routing and the reference says so, else ``None``;
            bounded like a branch's (:data:`~.branch.MAX_ROUTING_LAYERS`, :data:`~.branch.MAX_ROUTING_TOP_K`).
    """

    sample_id: Hashable
    tokens: int
    fields: tuple[str, ...] = ()
    routing_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        tokens = self.tokens
        if type(tokens) is not int or tokens < 1:  # the common case sets nothing (a step plans thousands)
            object.__setattr__(self, "tokens", _positive_int(f"sample {self.sample_id!r} tokens", tokens))
        # Valid field tuples are few (the subsets of FIELDS), so their check is done once per tuple; a tuple
        # not in the cache, valid or not, goes through every check and is refused naming this sample.
        canonical = _CANONICAL_FIELDS.get(self.fields) if type(self.fields) is tuple else None
        if canonical is None:
            canonical = _canonical_fields(self.sample_id, self.fields)
        object.__setattr__(self, "fields", canonical)
        shape = self.routing_shape
        if shape is None:
            return
        if type(shape) is tuple and len(shape) == 2 and ROUTED_EXPERTS in canonical:
            layers, top_k = shape
            # Plain ints within bounds: already what the checks below would make of them.
            if type(layers) is int and type(top_k) is int and 1 <= layers <= MAX_ROUTING_LAYERS and \
                    1 <= top_k <= MAX_ROUTING_TOP_K:
                return
        if ROUTED_EXPERTS not in canonical:
            raise PackingError(f"sample {self.sample_id!r}: routing_shape given without {ROUTED_EXPERTS}")
        if not isinstance(shape, tuple | list) or len(shape) != 2:
            raise PackingError(f"sample {self.sample_id!r} routing_shape: expected (layers, top_k), got {shape!r}")
        layers = _positive_int(f"sample {self.sample_id!r} routing layers", shape[0])
        top_k = _positive_int(f"sample {self.sample_id!r} routing top_k", shape[1])
        if layers > MAX_ROUTING_LAYERS or top_k > MAX_ROUTING_TOP_K:
            raise PackingError(
                f"sample {self.sample_id!r} routing_shape: expected at most ({MAX_ROUTING_LAYERS}, "
                f"{MAX_ROUTING_TOP_K}), got {shape!r}"
            )
        object.__setattr__(self, "routing_shape", (layers, top_k))

    @property
    def has_routing(self) -> bool:
        """Whether the sample has router-replay rows."""
        return ROUTED_EXPERTS in self.fields


_CANONICAL_FIELDS: dict[tuple[str, ...], tuple[str, ...]] = {}
"""Field tuples that passed :func:`_canonical_fields`, to their canonical order. Only valid tuples get in, and
their number is bounded by the orderings of :data:`~.branch.FIELDS`' subsets (at most a few hundred)."""


def _canonical_fields(sample_id: Hashable, fields: Sequence[str]) -> tuple[str, ...]:
    """``fields`` in canonical order, or :class:`PackingError` naming ``sample_id`` and what is wrong."""
    names = set(fields)
    unknown = sorted(names - set(FIELDS))
    if unknown or len(names) != len(fields):
        raise PackingError(f"sample {sample_id!r} fields: expected distinct names from {FIELDS}, got {fields!r}")
    try:
        check_pairs(names, where=f"sample {sample_id!r}")
    except BranchError as error:
        raise PackingError(str(error)) from error
    canonical = tuple(name for name in FIELDS if name in names)
    if type(fields) is tuple and all(type(name) is str for name in fields):
        _CANONICAL_FIELDS[fields] = canonical
    return canonical


@dataclass(frozen=True, slots=True)
class PackedSample:
    """One sample's place in a micro batch.

    ``offset`` and ``kept`` give its token span ``[offset, offset + kept)`` in the micro batch; ``fields`` are
    the arrays to fetch and assemble for it (the sample's fields, or routing only in a dummy).
    """

    sample: SampleInfo
    offset: int
    kept: int
    fields: tuple[str, ...]

    @property
    def stop(self) -> int:
        """End (exclusive) of the sample's span in the micro batch."""
        return self.offset + self.kept

    @property
    def truncated(self) -> bool:
        """Whether packing cut the sample to fit ``seq_len``."""
        return self.kept < self.sample.tokens


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward pass of one data rank: ``[1, length]`` tokens.

    ``tokens`` real tokens (the samples' spans) then ``length - tokens`` padding positions. A ``dummy``
    borrows a real micro batch's samples to keep every rank running the same operations; it trains nothing.
    """

    samples: tuple[PackedSample, ...]
    tokens: int
    length: int
    has_routing: bool
    dummy: bool = False

    @property
    def padding(self) -> int:
        """Positions after the last sample, filled with padding."""
        return self.length - self.tokens

    def fields(self) -> tuple[str, ...]:
        """Fields listed by at least one sample, in canonical order: which tensors assembly produces."""
        listed = {name for packed in self.samples for name in packed.fields}
        return tuple(name for name in FIELDS if name in listed)


@dataclass(frozen=True, slots=True)
class PackPlan:
    """The result of :func:`pack`: ``ranks[r]`` is the ordered micro batches of data rank ``r``."""

    seq_len: int
    pad_to_multiple_of: int
    ranks: tuple[tuple[MicroBatch, ...], ...] = field(default=())

    @property
    def micro_batches_per_rank(self) -> int:
        """The count every rank runs (0 for an empty step)."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def dummy_count(self) -> int:
        """Dummy micro batches across all ranks."""
        return sum(mb.dummy for rank in self.ranks for mb in rank)

    def real_samples(self) -> Iterator[PackedSample]:
        """Each input sample exactly once, from the real micro batch that owns its reference."""
        for rank in self.ranks:
            for mb in rank:
                if not mb.dummy:
                    yield from mb.samples


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(slots=True)
class _Bin:
    """A micro batch under construction: indices into the group's sample list, in packing order."""

    members: list[int]
    tokens: int


def _first_fit_decreasing(kept: Sequence[int], order: Sequence[int], seq_len: int) -> list[_Bin]:
    bins: list[_Bin] = []
    for index in sorted(order, key=lambda i: (-kept[i], i)):
        for candidate in bins:
            if candidate.tokens + kept[index] <= seq_len:
                candidate.members.append(index)
                candidate.tokens += kept[index]
                break
        else:
            bins.append(_Bin([index], kept[index]))
    return bins


def _split_until_multiple(bins: list[_Bin], kept: Sequence[int], data_ranks: int) -> None:
    target = _round_up(len(bins), data_ranks)
    while len(bins) < target:
        splittable = [i for i, candidate in enumerate(bins) if len(candidate.members) > 1]
        if not splittable:
            return
        victim = max(splittable, key=lambda i: (bins[i].tokens, -i))
        halves = (_Bin([], 0), _Bin([], 0))
        # Members are already longest first, so a greedy "onto the lighter half" balances well and each
        # half keeps packing order.
        for index in bins[victim].members:
            half = halves[0] if halves[0].tokens <= halves[1].tokens else halves[1]
            half.members.append(index)
            half.tokens += kept[index]
        bins[victim] = halves[0]
        bins.append(halves[1])


def _micro_batch(
    samples: Sequence[SampleInfo], kept: Sequence[int], members: Sequence[int], multiple: int
) -> MicroBatch:
    packed: list[PackedSample] = []
    offset = 0
    for index in members:
        packed.append(PackedSample(samples[index], offset, kept[index], samples[index].fields))
        offset += kept[index]
    return MicroBatch(
        samples=tuple(packed),
        tokens=offset,
        length=_round_up(offset, multiple),
        has_routing=samples[members[0]].has_routing,
    )


def _dummy_like(source: MicroBatch) -> MicroBatch:
    keep = (ROUTED_EXPERTS,) if source.has_routing else ()
    return replace(source, samples=tuple(replace(p, fields=keep) for p in source.samples), dummy=True)


def _distribute(group: Sequence[MicroBatch], data_ranks: int) -> list[list[MicroBatch]]:
    quota = len(group) // data_ranks
    per_rank: list[list[MicroBatch]] = [[] for _ in range(data_ranks)]
    load = [0] * data_ranks
    for index in sorted(range(len(group)), key=lambda i: (-group[i].length, i)):
        rank = min((r for r in range(data_ranks) if len(per_rank[r]) < quota), key=lambda r: (load[r], r))
        per_rank[rank].append(group[index])
        load[rank] += group[index].length
    return per_rank


def pack(samples: Sequence[SampleInfo], *, seq_len: int, data_ranks: int, pad_to_multiple_of: int = 1) -> PackPlan:
    """Pack one step's samples into micro batches for ``data_ranks`` ranks (algorithm in the module doc).

    Args:
        samples: the step's trainable sequences; ids must be unique. Not modified.
        seq_len: most tokens per micro batch, padding included.
        data_ranks: number of data-parallel ranks that each run a share of the micro batches.
        pad_to_multiple_of: each micro batch's length is rounded up to this; must divide ``seq_len``.

    Returns:
        A new :class:`PackPlan` owned by the caller. An empty ``samples`` gives every rank zero micro batches.

    Raises:
        PackingError: for a non-positive parameter, ``seq_len`` not a multiple of ``pad_to_multiple_of``,
            duplicate sample ids, or routed samples that disagree on ``routing_shape``.
    """
    _positive_int("seq_len", seq_len)
    _positive_int("data_ranks", data_ranks)
    _positive_int("pad_to_multiple_of", pad_to_multiple_of)
    if seq_len % pad_to_multiple_of:
        raise PackingError(f"seq_len: expected a multiple of pad_to_multiple_of={pad_to_multiple_of}, got {seq_len}")
    seen: set[Hashable] = set()
    shapes: set[tuple[int, int]] = set()
    for sample in samples:
        if not isinstance(sample, SampleInfo):
            raise PackingError(f"samples: expected SampleInfo, got {type(sample).__name__}")
        if sample.sample_id in seen:
            raise PackingError(f"samples: duplicate sample_id {sample.sample_id!r}")
        seen.add(sample.sample_id)
        if sample.routing_shape is not None:
            shapes.add(sample.routing_shape)
    if len(shapes) > 1:
        raise PackingError(f"routing_shape: expected one (layers, top_k) per step, got {sorted(shapes)}")

    kept = [min(sample.tokens, seq_len) for sample in samples]
    per_rank: list[list[MicroBatch]] = [[] for _ in range(data_ranks)]
    # Routed group first: at each index every rank then has routing, or none has.
    for routed in (True, False):
        order = [i for i, sample in enumerate(samples) if sample.has_routing == routed]
        if not order:
            continue
        bins = _first_fit_decreasing(kept, order, seq_len)
        _split_until_multiple(bins, kept, data_ranks)
        group = [_micro_batch(samples, kept, b.members, pad_to_multiple_of) for b in bins]
        missing = _round_up(len(group), data_ranks) - len(group)
        if missing:
            shortest = min(range(len(group)), key=lambda i: (group[i].length, i))
            group.extend([_dummy_like(group[shortest])] * missing)
        for rank, share in enumerate(_distribute(group, data_ranks)):
            per_rank[rank].extend(share)
    return PackPlan(
        seq_len=seq_len,
        pad_to_multiple_of=pad_to_multiple_of,
        ranks=tuple(tuple(rank) for rank in per_rank),
    )
