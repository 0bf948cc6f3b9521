"""Trainer side: turn a micro batch's fetched arrays into model-ready torch tensors, copying each byte once.

For every tensor the micro batch needs, :func:`assemble` allocates the ``[1, length, ...]`` result once and
writes each sample's rows straight into its span (``[offset, offset + kept)`` from packing), converting the
dtype in the same pass. There is no per-sample tensor and no concatenation afterwards.

Tensors and their padding (positions after the last sample, and rows of a sample that lacks the field):

- ``routed_experts``: ``[1, L, layers, top_k]`` in its wire dtype (uint8, or uint16 when any sample of the micro
  batch carries uint16); padding 0 (routes to expert 0; the loss mask excludes those rows).
- sampling mask: int32 ``[1, L, width]``; a token's ids first, then -1; padding -1 (count 0 = no mask).
- ``topk_ids``: int64 ``[1, L, k]``; padding 0, with ``topk_valid`` (bool ``[1, L]``) False.
- ``topk_logprobs``: float32 ``[1, L, k]``; padding 0.0 (not -inf, so padding cannot turn into NaN).
- loss mask: bool ``[1, L]``; True only on the kept tokens of real samples; False on padding, dummies and
  dropped micro batches.

Dtype choices: routing stays in its wire dtype, so assembly writes each received byte once instead of widening
it 4x into int32 (widening to an index dtype, e.g. ``.long()`` for ``gather``, is the consumer's, best done on
the device after the host-to-device copy of the narrow rows). Top-k ids are int64 because
``torch.gather``/``scatter`` index with int64 only and k is small. The dense sampling mask stays int32: it is
the widest tensor (width up to ``branch.MAX_MASK_WIDTH``) and vocabulary ids fit; cast on the device when an
int64 index is needed.

A micro batch whose arrays could not be fetched is never trained on zeros: :func:`assemble_dropped` gives it
the same tensors with a zero loss mask and routing made of repeated real rows, so the forward pass still
routes like real data and every rank runs the same operations.

This module imports torch; env servers must not import it (they use :mod:`.branch` only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .branch import MASK_IDS, ROUTED_EXPERTS, ROUTING_DTYPES, TOPK_IDS, Branch
from .packing import MicroBatch

ROUTING_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}
MASK_DTYPE = torch.int32
TOPK_IDS_DTYPE = torch.int64
TOPK_LOGPROBS_DTYPE = torch.float32
MASK_PAD = -1

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Returns a CPU tensor of exactly the given shape and dtype. Contents may be garbage: assembly writes every
element. Lets the caller hand out reused (already touched, possibly pinned) buffers instead of fresh pages."""


class AssemblyError(ValueError):
    """Fetched arrays disagree with the micro batch (missing field, too few tokens, mixed shapes)."""


class RoutingUnavailableError(AssemblyError):
    """A routed micro batch must be replaced but no real routing rows are available anywhere in the step."""


@dataclass(frozen=True, slots=True, eq=False)
class AssembledBatch:
    """Model-ready tensors of one micro batch, all ``[1, length, ...]`` on the CPU.

    A tensor is ``None`` when no sample of the micro batch lists its field. The tensors belong to the caller
    (or to the caller's allocator); they share no memory with the fetched frames, which may be released as
    soon as :func:`assemble` returns.

    ``loss_mask`` marks where this batch may carry loss; the caller ANDs it with its own per-token mask
    (prompt tokens and so on). It is all False for dummies and dropped micro batches.
    """

    micro_batch: MicroBatch
    loss_mask: torch.Tensor
    routed_experts: torch.Tensor | None = None
    sampling_mask: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_valid: torch.Tensor | None = None
    dropped: bool = False

    @property
    def length(self) -> int:
        """Sequence positions, padding included."""
        return int(self.loss_mask.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        tensors = (
            self.loss_mask,
            self.routed_experts,
            self.sampling_mask,
            self.topk_ids,
            self.topk_logprobs,
            self.topk_valid,
        )
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _default_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _allocate(allocator: Allocator, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    tensor = allocator(shape, dtype)
    if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device.type != "cpu":
        raise AssemblyError(
            f"allocator: expected a cpu {dtype} tensor of shape {shape}, "
            f"got {tensor.device} {tensor.dtype} {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise AssemblyError(f"allocator: expected a contiguous tensor of shape {shape}")
    # Writing through a numpy view lets np.copyto read read-only frame views (torch.from_numpy warns on
    # those) and widen dtypes in the same pass.
    return tensor, tensor.numpy()


def _fill_gaps(target: np.ndarray, covered: Sequence[tuple[int, int]], length: int, value: float) -> None:
    """Write ``value`` into every row of ``target[0]`` outside the ``covered`` spans (ascending, disjoint)."""
    position = 0
    for start, stop in covered:
        if start > position:
            target[0, position:start] = value
        position = max(position, stop)
    if position < length:
        target[0, position:length] = value


def _runs(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` with each one that starts where the one before it stops merged into it: packed samples are
    contiguous, so a micro batch's loss mask is one slice assignment instead of one per sample."""
    runs: list[tuple[int, int]] = []
    for start, stop in spans:
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs


def _routing_dtype(dtypes: Iterable[np.dtype]) -> torch.dtype:
    """The assembled routing dtype: the widest wire dtype among ``dtypes`` (all in ``ROUTING_DTYPES``)."""
    return ROUTING_TORCH_DTYPES[np.result_type(*set(dtypes))]  # distinct ones: a micro batch has hundreds


def _as_routing_rows(rows: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().cpu().numpy()
    if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.dtype not in ROUTING_DTYPES or rows.shape[0] < 1:
        raise AssemblyError(
            "routing_rows: expected a uint8 or uint16 array [rows >= 1, layers, top_k], "
            f"got {getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}"
        )
    return rows


def _declared_routing_shape(micro_batch: MicroBatch) -> tuple[int, int] | None:
    shapes = {p.sample.routing_shape for p in micro_batch.samples if p.sample.routing_shape is not None}
    if len(shapes) > 1:
        raise AssemblyError(f"micro batch declares several routing shapes: {sorted(shapes)}")
    return next(iter(shapes), None)


def assemble(
    micro_batch: MicroBatch,
    branches: Sequence[Branch | None],
    *,
    mask_width: int | None = None,
    allocator: Allocator | None = None,
) -> AssembledBatch:
    """Write a micro batch's fetched arrays into freshly allocated (or caller-provided) tensors.

    Args:
        micro_batch: from :func:`~.packing.pack`; its samples give each branch's span and needed fields.
        branches: one per ``micro_batch.samples``, in the same order: the sample's fetched branch, whole or
            already cut (it is cut here to the sample's ``kept`` tokens), e.g. ``Branch.from_arrays`` over
            received frames. ``None`` (or any value) is fine for a sample that lists no field. Only read.
        mask_width: fixed width of the dense sampling mask (static shapes); default: the widest kept
            token's count, at least 1.
        allocator: where the tensors come from; default ``torch.empty``.

    Returns:
        An :class:`AssembledBatch`. Nothing in it aliases ``branches``: the caller may release the frames.
        A dummy micro batch gets its borrowed routing and an all-False loss mask.

    Raises:
        AssemblyError: a branch lacks a field its sample lists, has fewer tokens than ``kept``, or branches
            disagree on routing shape or top-k width; ``mask_width`` is too narrow; the allocator returned
            a tensor of the wrong kind. The caller treats this like a failed fetch.
    """
    samples = micro_batch.samples
    if len(branches) != len(samples):
        raise AssemblyError(f"branches: expected {len(samples)} (one per sample), got {len(branches)}")
    allocate = allocator or _default_allocator
    length = micro_batch.length

    cut: list[Branch | None] = []
    for packed, branch in zip(samples, branches, strict=True):
        if not packed.fields:
            cut.append(None)
            continue
        if not isinstance(branch, Branch):
            raise AssemblyError(f"sample {packed.sample.sample_id!r}: expected a Branch with {packed.fields}, "
                                f"got {branch!r}")
        missing = [name for name in packed.fields if getattr(branch, name) is None]
        if missing:
            raise AssemblyError(f"sample {packed.sample.sample_id!r}: fetched branch lacks {missing}")
        tokens = branch.token_count
        if tokens < packed.kept:
            raise AssemblyError(
                f"sample {packed.sample.sample_id!r}: expected at least {packed.kept} tokens, fetched {tokens}"
            )
        cut.append(branch.slice_to(packed.kept))  # itself when nothing is cut; also checks kept is an int

    needed = micro_batch.fields()
    loss_mask, loss_np = _allocate(allocate, (1, length), torch.bool)
    loss_np[...] = False
    if not micro_batch.dummy:
        for start, stop in _runs((packed.offset, packed.stop) for packed in samples):
            loss_np[0, start:stop] = True
    routing: torch.Tensor | None = None
    sampling_mask: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    if ROUTED_EXPERTS in needed:
        # Every branch here has routing (checked above): [tokens, layers, top_k], so shape[1:] is its
        # routing_shape, read without the property's per-sample calls.
        rows = [(p, b.routed_experts) for p, b in zip(samples, cut, strict=True)
                if b is not None and ROUTED_EXPERTS in p.fields and b.routed_experts is not None]
        shapes = {r.shape[1:] for _, r in rows}
        declared = _declared_routing_shape(micro_batch)
        if declared is not None:
            shapes.add(declared)
        if len(shapes) != 1:
            raise AssemblyError(f"routed_experts: expected one (layers, top_k) per micro batch, got {shapes}")
        layers, top_k = shapes.pop()
        dtype = _routing_dtype({r.dtype for _, r in rows})
        tensor, target = _allocate(allocate, (1, length, layers, top_k), dtype)
        rows_target = target[0]
        spans = []
        for packed, routing_rows in rows:
            if routing_rows.dtype == rows_target.dtype:  # nothing to cast: a plain copy, without copyto's overhead
                rows_target[packed.offset : packed.stop] = routing_rows
            else:
                np.copyto(rows_target[packed.offset : packed.stop], routing_rows, casting="safe")
            spans.append((packed.offset, packed.stop))
        _fill_gaps(target, spans, length, 0)
        routing = tensor

    if MASK_IDS in needed:
        masked = [(p, b) for p, b in zip(samples, cut, strict=True) if MASK_IDS in p.fields]
        widest = 0
        for _, branch in masked:
            assert branch is not None and branch.mask_counts is not None
            if branch.mask_counts.size:
                widest = max(widest, int(branch.mask_counts.max()))
        if mask_width is not None and mask_width < max(widest, 1):
            raise AssemblyError(f"mask_width: expected at least {max(widest, 1)} (widest kept token), got {mask_width}")
        width = mask_width if mask_width is not None else max(widest, 1)
        tensor, target = _allocate(allocate, (1, length, width), MASK_DTYPE)
        # Few tokens carry a mask, so the tensor is mostly padding: one fill, then sparse writes.
        target[...] = MASK_PAD
        columns = np.arange(width)
        for packed, branch in masked:
            assert branch is not None and branch.mask_counts is not None and branch.mask_ids is not None
            # Row-major boolean selection visits (token, slot) pairs in exactly the flat order of mask_ids.
            selected = columns < branch.mask_counts[:, None]
            target[0, packed.offset : packed.stop][selected] = branch.mask_ids
        sampling_mask = tensor

    if TOPK_IDS in needed:
        headed = [(p, b) for p, b in zip(samples, cut, strict=True) if TOPK_IDS in p.fields]
        widths = {b.topk_k for _, b in headed if b is not None}
        if len(widths) != 1:
            raise AssemblyError(f"topk_ids: expected one k per micro batch, got {widths}")
        k = widths.pop()
        assert k is not None
        ids_tensor, ids_target = _allocate(allocate, (1, length, k), TOPK_IDS_DTYPE)
        lp_tensor, lp_target = _allocate(allocate, (1, length, k), TOPK_LOGPROBS_DTYPE)
        valid_tensor, valid_target = _allocate(allocate, (1, length), torch.bool)
        valid_target[...] = False
        spans = []
        for packed, branch in headed:
            assert branch is not None and branch.topk_ids is not None and branch.topk_logprobs is not None
            np.copyto(ids_target[0, packed.offset : packed.stop], branch.topk_ids, casting="safe")
            np.copyto(lp_target[0, packed.offset : packed.stop], branch.topk_logprobs, casting="no")
            valid_target[0, packed.offset : packed.stop] = True
            spans.append((packed.offset, packed.stop))
        _fill_gaps(ids_target, spans, length, 0)
        _fill_gaps(lp_target, spans, length, 0.0)
        topk = (ids_tensor, lp_tensor, valid_tensor)

    return _result(micro_batch, loss_mask, routing, sampling_mask, topk, dropped=False)


def _result(
    micro_batch: MicroBatch,
    loss_mask: torch.Tensor,
    routing: torch.Tensor | None,
    sampling_mask: torch.Tensor | None,
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    dropped: bool,
) -> AssembledBatch:
    ids, logprobs, valid = topk if topk is not None else (None, None, None)
    return AssembledBatch(
        micro_batch=micro_batch,
        loss_mask=loss_mask,
        routed_experts=routing,
        sampling_mask=sampling_mask,
        topk_ids=ids,
        topk_logprobs=logprobs,
        topk_valid=valid,
        dropped=dropped,
    )


def find_routing_rows(branches: Iterable[Branch | None]) -> np.ndarray | None:
    """Real routing rows to stand in for a dropped micro batch: those of the branch with the most tokens.

    Returns a read-only view into that branch (no copy), or ``None`` when no branch has a routing row.
    """
    best: np.ndarray | None = None
    for branch in branches:
        rows = None if branch is None else branch.routed_experts
        if rows is not None and rows.shape[0] > 0 and (best is None or rows.shape[0] > best.shape[0]):
            best = rows
    return best


def assemble_dropped(
    micro_batch: MicroBatch,
    routing_rows: np.ndarray | torch.Tensor | None,
    *,
    mask_width: int = 1,
    topk_k: int | None = None,
    allocator: Allocator | None = None,
) -> AssembledBatch:
    """Stand-in tensors for a micro batch that failed (on any rank) and must run without training.

    Produces the same set of tensors :func:`assemble` would, with an all-False loss mask and ``dropped``
    set. Routing repeats ``routing_rows`` cyclically over every position, so the MoE layers route real
    rows rather than zeros; masks are all -1 and top-k heads padding (``topk_valid`` all False).

    Args:
        micro_batch: the micro batch being dropped.
        routing_rows: ``[rows >= 1, layers, top_k]`` uint8 or uint16 real rows from anywhere in the step
            (e.g. :func:`find_routing_rows`, or a real span of another assembled batch); the routing tensor
            takes their dtype. Only read. Needed only when the micro batch has routing.
        mask_width: width of the all -1 sampling mask, when the micro batch has masks.
        topk_k: width of the top-k heads; required when the micro batch has them.
        allocator: as for :func:`assemble`.

    Raises:
        RoutingUnavailableError: the micro batch has routing and no rows were given. Per the design a step
            where nothing can be fetched stops the run; this is that signal.
        AssemblyError: rows of the wrong shape for the micro batch, or a missing ``topk_k``.
    """
    allocate = allocator or _default_allocator
    length = micro_batch.length
    needed = micro_batch.fields()
    loss_mask, loss_np = _allocate(allocate, (1, length), torch.bool)
    loss_np[...] = False
    routing: torch.Tensor | None = None
    sampling_mask: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    if ROUTED_EXPERTS in needed:
        if routing_rows is None:
            raise RoutingUnavailableError(
                "no real routing rows to stand in for a dropped routed micro batch: nothing in the step "
                "could be fetched"
            )
        rows = _as_routing_rows(routing_rows)
        declared = _declared_routing_shape(micro_batch)
        shape = (int(rows.shape[1]), int(rows.shape[2]))
        if declared is not None and declared != shape:
            raise AssemblyError(f"routing_rows: expected (layers, top_k) = {declared}, got {shape}")
        tensor, target = _allocate(allocate, (1, length, *shape), _routing_dtype([rows.dtype]))
        first = min(length, rows.shape[0])
        np.copyto(target[0, :first], rows[:first], casting="no")
        # Doubling: each pass copies everything written so far, so log2(length / rows) passes instead of one
        # per repetition.
        filled = first
        while filled < length:
            step = min(filled, length - filled)
            target[0, filled : filled + step] = target[0, :step]
            filled += step
        routing = tensor

    if MASK_IDS in needed:
        if mask_width < 1:
            raise AssemblyError(f"mask_width: expected >= 1, got {mask_width}")
        tensor, target = _allocate(allocate, (1, length, mask_width), MASK_DTYPE)
        target[...] = MASK_PAD
        sampling_mask = tensor

    if TOPK_IDS in needed:
        if topk_k is None or topk_k < 1:
            raise AssemblyError(f"topk_k: expected >= 1 for a micro batch with top-k heads, got {topk_k}")
        ids_tensor, ids_target = _allocate(allocate, (1, length, topk_k), TOPK_IDS_DTYPE)
        lp_tensor, lp_target = _allocate(allocate, (1, length, topk_k), TOPK_LOGPROBS_DTYPE)
        valid_tensor, valid_target = _allocate(allocate, (1, length), torch.bool)
        ids_target[...] = 0
        lp_target[...] = 0.0
        valid_target[...] = False
        topk = (ids_tensor, lp_tensor, valid_tensor)

    return _result(micro_batch, loss_mask, routing, sampling_mask, topk, dropped=True)


def packed_position_ids(lengths: Sequence[int], length: int) -> torch.Tensor:
    """int64 ``[1, length]`` position ids for samples of ``lengths`` packed from offset 0, then padding.

    Each sample counts from 0; the padding after them counts from 0 too (``range(pad)``), so it is a
    sequence of its own that no sample attends to.

    Raises:
        ValueError: a length below 1, or samples longer than ``length`` in total.
    """
    if any(n < 1 for n in lengths) or sum(lengths) > length:
        raise ValueError(f"lengths: expected each >= 1 and a total <= {length}, got {list(lengths)}")
    pad = length - sum(lengths)
    parts = [torch.arange(n) for n in lengths] + ([torch.arange(pad)] if pad else [])
    return torch.cat(parts).unsqueeze(0)
