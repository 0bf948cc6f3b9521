"""A tiny causal mixture-of-experts language model with router replay, and a sampler that records what a
:class:`~refbus.nodes.payload.branch.Branch` keeps.

Model (:class:`TinyMoEPolicy`): token plus learned position embeddings, then ``n_layers`` pre-norm blocks of
causal multi-head attention and a top-k mixture of experts, then a linear head. Every decoder layer is an MoE
layer, so routing rows have one entry per layer: ``routed_experts`` is ``[batch, tokens, layers, top_k]``, and
layer ``i`` reads ``[:, :, i, :]``.

Router replay: :meth:`TinyMoEPolicy.forward` takes ``routed_experts``. Where given, each layer uses exactly
those experts; the router's softmax still supplies the gate weights of the chosen experts (renormalised
over them), so the router keeps receiving gradients while training sees the experts the rollout used.

Packed sequences: ``position_ids`` restart at 0 at each sample; attention never crosses a restart, so a
packed row computes exactly what its samples would compute alone (up to float rounding).

Sampler (:func:`generate`): a loop without a KV cache that records, per token of the returned sequence
(prompt included, because the trainer's forward pass covers the whole sequence):

- ``routed_experts`` uint8 ``[tokens, layers, top_k]``: the experts used when that token was the model's
  input. The prefix is replayed at every step, so each row is fixed once computed, as with a KV cache. The
  final token is never fed to the model; its row repeats the previous one (the usual convention for routing replay).
- ``topk_ids`` int32 / ``topk_logprobs`` float32 ``[tokens, k]``: the ``k`` most likely tokens of the
  temperature-scaled distribution (before top-k/top-p filtering) that produced this token, descending.
- ``mask_ids`` int32 flat / ``mask_counts`` int32 ``[tokens]``: the ascending ids the sampler allowed for this
  token after top-k/top-p filtering; count 0 when nothing was filtered out (no mask).

Prompt rows carry padding in the sampler fields: top-k ids 0, logprobs 0.0, mask count 0, the same padding
the trainer's assembly uses; a loss mask keeps them out of training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..payload.branch import Branch


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Shape of a :class:`TinyMoEPolicy`. The defaults train in seconds on two CPU cores."""

    vocab_size: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 64
    max_seq_len: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_expert", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: expected a multiple of n_heads = {self.n_heads}, got {self.d_model}")
        # With top_k == n_experts the renormalised gates no longer depend on which experts were chosen, but
        # they still depend on the router, so replay stays meaningful; only top_k > n_experts is impossible.
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k: expected <= n_experts = {self.n_experts}, got {self.top_k}")
        if self.n_experts > 65536:
            raise ValueError(f"n_experts: expected <= 65536 (uint16 routing rows), got {self.n_experts}")


class PolicyOutput(NamedTuple):
    """What a forward pass returns."""

    logits: torch.Tensor
    """float32 ``[batch, seq, vocab]``: next-token logits at each position."""
    routed_experts: torch.Tensor
    """int64 ``[batch, seq, layers, top_k]``: the experts each layer used at each position."""


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, width))


class _MixtureOfExperts(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        experts, width, hidden = config.n_experts, config.d_model, config.d_expert
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix the chosen experts' outputs; ``replay`` (int64 ``[batch, r, top_k]``) fixes the first ``r`` positions."""
        probs = self.router(x).softmax(dim=-1)
        chosen = probs.topk(self.top_k, dim=-1).indices
        if replay is not None:
            chosen = torch.cat([replay, chosen[:, replay.shape[1] :]], dim=1)
        gates = probs.gather(-1, chosen)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # Every expert runs on every token: at this size one dense einsum is faster than a dispatch, and the
        # result is the same because only the chosen experts' outputs are mixed.
        hidden = F.gelu(torch.einsum("bsd,edh->bseh", x, self.w_in))
        outputs = torch.einsum("bseh,ehd->bsed", hidden, self.w_out)
        picked = outputs.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
        return (gates.unsqueeze(-1) * picked).sum(dim=2), chosen


class _Block(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.d_model)
        self.attention = _CausalSelfAttention(config)
        self.moe_norm = nn.LayerNorm(config.d_model)
        self.moe = _MixtureOfExperts(config)

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, replay: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), allowed)
        mixed, chosen = self.moe(self.moe_norm(x), replay)
        return x + mixed, chosen


class TinyMoEPolicy(nn.Module):
    """Causal MoE language model; see the module docstring for the architecture and router replay."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__()
        self.config = config or PolicyConfig()
        c = self.config
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.position_embedding = nn.Embedding(c.max_seq_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        routed_experts: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> PolicyOutput:
        """Next-token logits and the routing used.

        Args:
            input_ids: integer ``[batch, seq]`` token ids in ``[0, vocab_size)``.
            routed_experts: integer ``[batch, r, layers, top_k]`` with ``r <= seq`` and ids in
                ``[0, n_experts)``: positions ``< r`` use exactly these experts, later positions route by
                the router. ``None`` routes every position by the router.
            position_ids: integer ``[batch, seq]`` in ``[0, max_seq_len)``; each 0 starts a new sample that
                attends only to itself. Default ``0..seq-1`` (one sample per row).

        Raises:
            ValueError: a shape or value out of the ranges above.
        """
        batch, seq = self._check_inputs(input_ids, position_ids)
        replay = self._check_routing(routed_experts, batch, seq)
        if position_ids is None:
            position_ids = torch.arange(seq).expand(batch, seq)
        position_ids = position_ids.long()
        segments = (position_ids == 0).cumsum(dim=-1)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal & (segments.unsqueeze(-1) == segments.unsqueeze(-2))).unsqueeze(1)

        x = self.token_embedding(input_ids.long()) + self.position_embedding(position_ids)
        routes = []
        for index, block in enumerate(self.blocks):
            x, chosen = block(x, allowed, None if replay is None else replay[:, :, index])
            routes.append(chosen)
        return PolicyOutput(self.head(self.norm(x)), torch.stack(routes, dim=2))

    def _check_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[int, int]:
        c = self.config
        if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.dtype.is_floating_point:
            raise ValueError(
                f"input_ids: expected integer [batch, seq >= 1], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < c.vocab_size:
            raise ValueError(f"input_ids: expected ids in [0, {c.vocab_size})")
        if position_ids is None:
            if input_ids.shape[1] > c.max_seq_len:
                raise ValueError(f"input_ids: expected seq <= max_seq_len = {c.max_seq_len}, got {input_ids.shape[1]}")
        elif position_ids.shape != input_ids.shape or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"position_ids: expected integer {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}"
            )
        elif position_ids.numel() and not 0 <= int(position_ids.min()) <= int(position_ids.max()) < c.max_seq_len:
            raise ValueError(f"position_ids: expected values in [0, {c.max_seq_len})")
        return int(input_ids.shape[0]), int(input_ids.shape[1])

    def _check_routing(self, routed_experts: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
        if routed_experts is None:
            return None
        c = self.config
        shape = tuple(routed_experts.shape)
        if (
            routed_experts.ndim != 4
            or routed_experts.dtype.is_floating_point
            or shape[0] != batch
            or shape[1] > seq
            or shape[2:] != (c.n_layers, c.top_k)
        ):
            raise ValueError(
                f"routed_experts: expected integer [{batch}, <= {seq}, {c.n_layers}, {c.top_k}], "
                f"got {routed_experts.dtype} {shape}"
            )
        replay = routed_experts.long()
        if replay.numel() and not 0 <= int(replay.min()) <= int(replay.max()) < c.n_experts:
            raise ValueError(f"routed_experts: expected expert ids in [0, {c.n_experts})")
        return replay


def make_policy(seed: int = 0, **overrides: int) -> TinyMoEPolicy:
    """A freshly initialised policy, identical for the same ``seed`` and config whatever the global RNG state.

    ``overrides`` replace :class:`PolicyConfig` fields (e.g. ``n_experts=8``).
    """
    config = replace(PolicyConfig(), **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyMoEPolicy(config)


@dataclass(frozen=True, slots=True)
class Rollout:
    """One generated sequence with its per-token arrays, row ``i`` describing ``tokens[i]``.

    The five array fields are exactly :class:`~refbus.nodes.payload.branch.Branch`'s; see the module
    docstring for what each row holds, prompt rows included.
    """

    tokens: np.ndarray
    """int64 ``[tokens]``: prompt then completion."""
    prompt_length: int
    routed_experts: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    mask_ids: np.ndarray
    mask_counts: np.ndarray

    @property
    def completion(self) -> np.ndarray:
        """The generated tokens."""
        return self.tokens[self.prompt_length :]

    def branch(self) -> Branch:
        """The arrays as a validated branch (views, no copy)."""
        return Branch(
            routed_experts=self.routed_experts,
            topk_ids=self.topk_ids,
            topk_logprobs=self.topk_logprobs,
            mask_ids=self.mask_ids,
            mask_counts=self.mask_counts,
        )


def sampling_filter(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits ``[batch, vocab]`` and the bool ``[batch, vocab]`` set the sampler may draw.

    Top-k keeps the ``top_k`` largest; top-p then keeps the smallest prefix of the remaining tokens, by
    descending probability renormalised over them, whose mass reaches ``top_p`` (at least one token).
    """
    scaled = logits / temperature
    ordered, order = scaled.sort(dim=-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k is not None:
        keep[:, top_k:] = False
    if top_p is not None:
        probs = ordered.masked_fill(~keep, -math.inf).softmax(dim=-1)
        keep &= probs.cumsum(dim=-1) - probs < top_p
    return scaled, torch.zeros_like(keep).scatter(-1, order, keep)


def _check_sampling(
    model: TinyMoEPolicy,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k_logprobs: int,
    sampling_top_k: int | None,
    sampling_top_p: float | None,
) -> None:
    c = model.config
    if prompts.ndim != 2 or prompts.shape[0] < 1 or prompts.shape[1] < 1:
        raise ValueError(f"prompts: expected [batch >= 1, prompt >= 1], got {tuple(prompts.shape)}")
    if max_new_tokens < 1 or prompts.shape[1] + max_new_tokens > c.max_seq_len:
        raise ValueError(f"max_new_tokens: expected 1..{c.max_seq_len - prompts.shape[1]}, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if not 1 <= top_k_logprobs <= c.vocab_size:
        raise ValueError(f"top_k_logprobs: expected 1..{c.vocab_size}, got {top_k_logprobs}")
    if sampling_top_k is not None and not 1 <= sampling_top_k <= c.vocab_size:
        raise ValueError(f"sampling_top_k: expected 1..{c.vocab_size} or None, got {sampling_top_k}")
    if sampling_top_p is not None and not 0 < sampling_top_p <= 1:
        raise ValueError(f"sampling_top_p: expected in (0, 1] or None, got {sampling_top_p}")


@torch.no_grad()
def generate(
    model: TinyMoEPolicy,
    prompts: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k_logprobs: int = 4,
    sampling_top_k: int | None = None,
    sampling_top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[Rollout]:
    """Sample ``max_new_tokens`` tokens after each prompt and record the branch arrays.

    Args:
        model: the policy; used as is (no mode switch: it has no dropout).
        prompts: integer ``[batch, prompt]``, equal-length prompts.
        max_new_tokens: completion length (no stop token); ``prompt + max_new_tokens <= max_seq_len``.
        temperature: divides the logits before filtering, sampling and the top-k heads.
        top_k_logprobs: width ``k`` of the recorded top-k heads.
        sampling_top_k, sampling_top_p: filters as in :func:`sampling_filter`; ``None`` disables one.
            With ``sampling_top_k <= top_k_logprobs`` every allowed token appears in the heads, which lets
            the trainer recover the sampler's exact (renormalised) probability of each sampled token.
        generator: source of randomness for reproducible sampling.

    Returns:
        One :class:`Rollout` per prompt, in order, each ready for :meth:`Rollout.branch`.
    """
    _check_sampling(model, prompts, max_new_tokens, temperature, top_k_logprobs, sampling_top_k, sampling_top_p)
    tokens = prompts.long()
    routing: torch.Tensor | None = None
    head_ids, head_logprobs, allowed_sets = [], [], []
    for _ in range(max_new_tokens):
        output = model(tokens, routed_experts=routing)
        # The recorded prefix is replayed, so this only appends the newest position's own routing.
        routing = output.routed_experts
        scaled, allowed = sampling_filter(output.logits[:, -1], temperature, sampling_top_k, sampling_top_p)
        heads = scaled.log_softmax(dim=-1).topk(top_k_logprobs, dim=-1)
        probs = scaled.masked_fill(~allowed, -math.inf).softmax(dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        head_ids.append(heads.indices)
        head_logprobs.append(heads.values)
        allowed_sets.append(allowed)
    assert routing is not None  # max_new_tokens >= 1
    routing = torch.cat([routing, routing[:, -1:]], dim=1)
    return [
        _rollout(
            tokens[row],
            prompts.shape[1],
            routing[row],
            torch.stack([ids[row] for ids in head_ids]),
            torch.stack([lp[row] for lp in head_logprobs]),
            torch.stack([allowed[row] for allowed in allowed_sets]),
            model.config.n_experts,
        )
        for row in range(tokens.shape[0])
    ]


def _rollout(
    tokens: torch.Tensor,
    prompt_length: int,
    routing: torch.Tensor,
    head_ids: torch.Tensor,
    head_logprobs: torch.Tensor,
    allowed: torch.Tensor,
    n_experts: int,
) -> Rollout:
    """Convert one row's records (completion rows only for the sampler fields) to the branch layout."""
    k = head_ids.shape[1]
    ids = np.zeros((tokens.shape[0], k), dtype=np.int32)
    logprobs = np.zeros((tokens.shape[0], k), dtype=np.float32)
    ids[prompt_length:] = head_ids.numpy()
    logprobs[prompt_length:] = head_logprobs.numpy()

    allowed_np = allowed.numpy().copy()
    # Nothing filtered out means no restriction, recorded as count 0 rather than the whole vocabulary.
    allowed_np[allowed_np.all(axis=1)] = False
    counts = np.zeros(tokens.shape[0], dtype=np.int32)
    counts[prompt_length:] = allowed_np.sum(axis=1)
    # np.nonzero walks row-major, which is exactly the flat (token, then ascending id) order of mask_ids.
    mask_ids = np.nonzero(allowed_np)[1].astype(np.int32)

    routing_dtype = np.uint8 if n_experts <= 256 else np.uint16
    return Rollout(
        tokens=tokens.numpy().copy(),
        prompt_length=prompt_length,
        routed_experts=routing.numpy().astype(routing_dtype),
        topk_ids=ids,
        topk_logprobs=logprobs,
        mask_ids=mask_ids,
        mask_counts=counts,
    )
