"""The one builder of random branch arrays for tests (every field a Branch may keep, consistent)."""

from __future__ import annotations

import numpy as np
from refbus.nodes.payload.branch import FIELDS


def random_arrays(
    tokens: int,
    *,
    seed: int = 0,
    layers: int = 3,
    top_k: int = 2,
    k: int = 4,
    max_count: int = 4,
    routing_dtype: type = np.uint8,
    fields: tuple[str, ...] = FIELDS,
) -> dict[str, np.ndarray]:
    """``fields`` of one branch of ``tokens`` tokens: routing ``[tokens, layers, top_k]`` (never 0, so padding
    rows stand out), top-k heads ``[tokens, k]`` (ids never 0, logprobs < 0), masks of 0..``max_count`` ids
    per token. Deterministic given ``seed``."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_count + 1, tokens).astype(np.int32)
    arrays = {
        "routed_experts": rng.integers(1, np.iinfo(routing_dtype).max, (tokens, layers, top_k), dtype=routing_dtype),
        "topk_ids": rng.integers(1, 50_000, (tokens, k), dtype=np.int32),
        "topk_logprobs": -rng.random((tokens, k), dtype=np.float32) - 0.01,
        "mask_ids": rng.integers(0, 50_000, int(counts.sum()), dtype=np.int32),
        "mask_counts": counts,
    }
    return {name: arrays[name] for name in fields}
