"""The ``train_step`` entry point: a token-level clipped policy-gradient step with router replay.

Batch contract: ``batch`` is a non-empty sequence of micro batches (:class:`TrainMicroBatch`), the same
count on every rank. Each is a mapping of CPU tensors, ``S`` = the micro batch length (the assembly's
``[1, S, ...]`` layout; any leading batch size works as long as every tensor shares it):

- ``input_ids`` (required) integer ``[1, S]``: the packed token ids, padding included (any valid id).
- ``advantages`` (required) float ``[1, S]``: the advantage of each token (a sample's advantage repeated
  over its completion tokens for GRPO); read only where the token is trained.
- ``loss_mask`` (required) bool ``[1, S]``: True on completion tokens to train; False on prompts, padding,
  dummies and dropped micro batches (the assembly's loss mask ANDed with the caller's completion mask).
- ``position_ids`` integer ``[1, S]``: restart at 0 at each packed sample (:func:`packed_position_ids`);
  attention never crosses a restart and a sample's first token is never trained (nothing predicts it).
  Absent or ``None``: the row is one sequence.
- ``routed_experts`` integer ``[1, S, layers, top_k]``: router replay; absent or ``None`` routes freely.
- ``topk_ids`` integer and ``topk_logprobs`` float ``[1, S, k]`` (both or neither): the sampler's top-k
  heads for token ``i`` (the distribution that sampled it), as :func:`~.policy.generate` records them.
  They give the importance ratio of each trained token; absent, the ratio is 1 (plain REINFORCE).
- ``topk_valid`` bool ``[1, S]``: False where the heads are padding; absent means all valid.
- ``sampling_mask`` integer ``[1, S, W]``: the dense sampling mask, token ids then -1. Where a row has ids,
  the policy's distribution for that token is restricted (and renormalised) to them, as the sampler's was.

Token ``i`` is predicted by the logits at position ``i - 1``; every per-token key above describes token
``i`` at index ``i``, exactly as the assembled tensors do.

Loss: for each trained token, ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A) - c * H`` with
``r = exp(logp - logp_old)``, ``H`` the entropy of the policy's (possibly masked) distribution for that token
and ``c = entropy_coef``; summed and divided by the number of trained tokens in the whole step (all micro
batches, all ranks), so the gradient is the token mean however the tokens are spread. ``logp_old`` is the
sampler's probability of the token, renormalised over the sampling mask when there is one; where the heads
cannot give it (token not in the heads, or a mask id missing from them) the ratio is 1 for that token and
the token is counted in ``ratio_unavailable_fraction``.

A micro batch with no trained token still runs forward and backward (zero loss, zero gradient), so every
rank runs the same operations; a step with no trained token on any rank runs them and skips the update.

Distributed: when ``torch.distributed`` is initialised with more than one rank in ``process_group``, the
step all-reduces the trained-token count, the summed gradients and the metrics itself: do not also wrap
the model in DistributedDataParallel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NotRequired, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ..payload.assemble import packed_position_ids
from .policy import TinyMoEPolicy

__all__ = ["TrainMicroBatch", "make_optimizer", "packed_position_ids", "train_step"]


class TrainMicroBatch(TypedDict):
    """One micro batch; the keys are described in the module docstring."""

    input_ids: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: NotRequired[torch.Tensor | None]
    routed_experts: NotRequired[torch.Tensor | None]
    topk_ids: NotRequired[torch.Tensor | None]
    topk_logprobs: NotRequired[torch.Tensor | None]
    topk_valid: NotRequired[torch.Tensor | None]
    sampling_mask: NotRequired[torch.Tensor | None]


# Order of the per-step sums that train_step accumulates (and all-reduces in one call).
_LOSS, _RATIO, _CLIPPED, _UNAVAILABLE, _ENTROPY = range(5)


def make_optimizer(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    """The optimizer the toy recipe was tuned with (Adam, no weight decay)."""
    return torch.optim.Adam(model.parameters(), lr=lr)


def train_step(
    model: TinyMoEPolicy,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[TrainMicroBatch],
    *,
    temperature: float = 1.0,
    clip_epsilon: float = 0.2,
    max_grad_norm: float = 1.0,
    entropy_coef: float = 0.3,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """One optimizer step over ``batch`` (see the module docstring for the contract and the loss).

    Args:
        temperature: the sampler's temperature; the policy's logits are divided by it, as the sampler's were.
        clip_epsilon: the ratio's clip range.
        max_grad_norm: gradients are clipped to this global norm after the cross-rank reduction.
        entropy_coef: weight of the entropy bonus. Without it group-normalised policy gradient drives the
            policy to one answer per prompt (entropy near 0 within about a hundred steps of the toy task);
            every group then has equal rewards, trains nothing and is dropped, and the loop stalls.
        process_group: the data-parallel group; default the default group when distributed is initialised.

    Returns:
        ``loss`` (token mean), ``tokens`` (trained, all ranks), ``ratio_mean``, ``clip_fraction``,
        ``ratio_unavailable_fraction``, ``entropy`` (mean over trained tokens, of the possibly masked
        distribution), ``grad_norm`` (before clipping), ``micro_batches`` and ``empty_micro_batches``
        (this rank), and ``stepped`` (1.0, or 0.0 when no rank had a trained token).

    Raises:
        ValueError: an empty batch, a missing key, mismatched shapes, a bad temperature or clip range, or a
            trained token outside its sampling mask (the arrays do not describe the sampled tokens).
    """
    if not batch:
        raise ValueError("batch: expected at least one micro batch")
    if not temperature > 0 or not clip_epsilon >= 0 or not entropy_coef >= 0:
        raise ValueError(
            f"expected temperature > 0, clip_epsilon >= 0 and entropy_coef >= 0, "
            f"got {temperature}, {clip_epsilon}, {entropy_coef}"
        )
    trained = [_trained_tokens(micro_batch, index) for index, micro_batch in enumerate(batch)]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1

    tokens = torch.tensor(float(sum(int(mask.sum()) for mask in trained)), dtype=torch.float64)
    if distributed:
        dist.all_reduce(tokens, group=process_group)
    total = max(float(tokens), 1.0)

    optimizer.zero_grad(set_to_none=False)
    sums = torch.zeros(5, dtype=torch.float64)
    for micro_batch, mask in zip(batch, trained, strict=True):
        loss, micro_sums = _micro_batch_loss(model, micro_batch, mask, temperature, clip_epsilon, entropy_coef)
        (loss / total).backward()
        sums += micro_sums

    parameters = [p for p in model.parameters() if p.requires_grad]
    if distributed:
        _all_reduce_gradients(parameters, process_group)
        dist.all_reduce(sums, group=process_group)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    stepped = float(tokens) > 0
    if stepped:
        optimizer.step()
    return {
        "loss": float(sums[_LOSS]) / total,
        "tokens": float(tokens),
        "ratio_mean": float(sums[_RATIO]) / total,
        "clip_fraction": float(sums[_CLIPPED]) / total,
        "ratio_unavailable_fraction": float(sums[_UNAVAILABLE]) / total,
        "entropy": float(sums[_ENTROPY]) / total,
        "grad_norm": grad_norm,
        "micro_batches": float(len(batch)),
        "empty_micro_batches": float(sum(not bool(mask.any()) for mask in trained)),
        "stepped": float(stepped),
    }


def _optional(micro_batch: TrainMicroBatch, key: str) -> torch.Tensor | None:
    return micro_batch.get(key)  # type: ignore[return-value]


def _trained_tokens(micro_batch: TrainMicroBatch, index: int) -> torch.Tensor:
    """Validate shapes; return bool ``[B, S - 1]``: which of tokens ``1..S-1`` carry loss."""
    for key in ("input_ids", "advantages", "loss_mask"):
        if key not in micro_batch:
            raise ValueError(f"micro batch {index}: missing {key!r}")
    input_ids = micro_batch["input_ids"]
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"micro batch {index} input_ids: expected [B, S >= 1], got {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    expected = {
        "advantages": (batch, seq),
        "loss_mask": (batch, seq),
        "position_ids": (batch, seq),
        "topk_valid": (batch, seq),
    }
    for key, shape in expected.items():
        tensor = _optional(micro_batch, key)
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"micro batch {index} {key}: expected shape {shape}, got {tuple(tensor.shape)}")
    for key in ("routed_experts", "topk_ids", "topk_logprobs", "sampling_mask"):
        tensor = _optional(micro_batch, key)
        if tensor is not None and (tensor.ndim < 3 or tuple(tensor.shape[:2]) != (batch, seq)):
            raise ValueError(
                f"micro batch {index} {key}: expected shape ({batch}, {seq}, ...), got {tuple(tensor.shape)}"
            )
    heads = _optional(micro_batch, "topk_ids"), _optional(micro_batch, "topk_logprobs")
    if (heads[0] is None) != (heads[1] is None) or (heads[0] is not None and heads[0].shape != heads[1].shape):
        raise ValueError(f"micro batch {index}: expected topk_ids and topk_logprobs of one shape, or neither")

    mask = micro_batch["loss_mask"].bool()[:, 1:]
    position_ids = _optional(micro_batch, "position_ids")
    if position_ids is not None:
        mask = mask & (position_ids[:, 1:] > 0)
    return mask


def _micro_batch_loss(
    model: TinyMoEPolicy,
    micro_batch: TrainMicroBatch,
    trained: torch.Tensor,
    temperature: float,
    clip_epsilon: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro batch's summed per-token loss (with its graph) and its float64 sums for the metrics."""
    input_ids = micro_batch["input_ids"]
    output = model(
        input_ids,
        routed_experts=_optional(micro_batch, "routed_experts"),
        position_ids=_optional(micro_batch, "position_ids"),
    )
    targets = input_ids[:, 1:].long()
    sampling_mask = _optional(micro_batch, "sampling_mask")
    allowed = None if sampling_mask is None else sampling_mask[:, 1:].long()
    logprobs, entropy = _policy_logprobs(output.logits[:, :-1] / temperature, targets, allowed)
    if bool((trained & ~torch.isfinite(logprobs)).any()):
        raise ValueError("a trained token lies outside its sampling mask")

    old, available = _sampler_logprobs(micro_batch, targets, allowed)
    available = available & trained
    # Where the sampler's probability is unknown, logp_old = logp (detached): ratio 1, gradient of logp.
    old = torch.where(available, old, logprobs.detach())
    ratio = torch.exp(logprobs - old)
    advantages = micro_batch["advantages"][:, 1:].float()
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    # where (not a product with the mask): padding positions may hold inf/NaN terms that must not leak.
    loss = torch.where(trained, per_token - entropy_coef * entropy, 0.0).sum()

    with torch.no_grad():
        weights = trained.double()
        sums = torch.stack(
            [
                loss.detach().double(),
                (ratio.double() * weights).sum(),
                (((ratio - 1).abs() > clip_epsilon).double() * weights).sum(),
                ((~available).double() * weights).sum(),
                torch.where(trained, entropy.detach(), 0.0).double().sum(),
            ]
        )
    return loss, sums


def _policy_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` and entropies (both with their graphs), restricted to the sampling
    mask's ids."""
    if allowed is not None:
        valid = allowed >= 0
        in_mask = torch.zeros_like(logits, dtype=torch.int8).scatter_reduce(
            -1, allowed.clamp(min=0), valid.to(torch.int8), reduce="amax"
        )
        restricted = valid.any(dim=-1, keepdim=True) & (in_mask == 0)
        logits = logits.masked_fill(restricted, -math.inf)
    logprobs = logits.log_softmax(dim=-1)
    # Ids outside the mask have probability 0 and log-probability -inf: 0 * -inf would poison the gradient.
    finite = logprobs.masked_fill(~torch.isfinite(logprobs), 0.0)
    entropy = -(finite.exp() * finite).sum(dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _sampler_logprobs(
    micro_batch: TrainMicroBatch, targets: torch.Tensor, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's log-probability of each target, from the heads, and where it is known (bool)."""
    head_ids, head_logprobs = _optional(micro_batch, "topk_ids"), _optional(micro_batch, "topk_logprobs")
    if head_ids is None or head_logprobs is None:
        return torch.zeros(targets.shape), torch.zeros(targets.shape, dtype=torch.bool)
    head_ids, head_logprobs = head_ids[:, 1:].long(), head_logprobs[:, 1:].float()
    hit = head_ids == targets.unsqueeze(-1)
    available = hit.any(dim=-1)
    old = torch.where(hit, head_logprobs, 0.0).sum(dim=-1)
    valid_rows = _optional(micro_batch, "topk_valid")
    if valid_rows is not None:
        available = available & valid_rows[:, 1:].bool()
    if allowed is not None:
        # The sampler drew from its distribution renormalised over the mask: subtract the log of the mask's
        # mass, which the heads give only when every allowed id is among them.
        masked = (allowed >= 0).any(dim=-1)
        head_allowed = (head_ids.unsqueeze(-1) == allowed.unsqueeze(-2)).any(dim=-1)
        covered = head_allowed.sum(dim=-1) == (allowed >= 0).sum(dim=-1)
        mass = torch.where(head_allowed, head_logprobs, -math.inf).logsumexp(dim=-1)
        old = torch.where(masked & covered, old - mass, old)
        available = available & (~masked | covered)
    return old, available


def _all_reduce_gradients(parameters: Sequence[nn.Parameter], process_group: dist.ProcessGroup | None) -> None:
    """Sum every gradient over the group in one collective (gradients are already scaled by the global count)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=process_group)
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.grad = flat[offset : offset + size].view_as(parameter).clone()
        offset += size
