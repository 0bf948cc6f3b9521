"""A toy task a tiny policy learns in about a hundred policy-gradient steps: continue a token with its successor.

The prompt is one random token ``t``; the reward is the fraction of completion tokens equal to
``(t + 1) mod vocab_size``. An untrained policy scores about ``1 / vocab_size``; a perfect one scores 1. The
policy must read the prompt through attention, so the task exercises the whole model, not only the head.

:func:`make_prompt` and :func:`score` are the entry points ``refbus up`` names in its config; they use
:data:`DEFAULT_TASK`, whose vocabulary matches the default :class:`~.policy.PolicyConfig`. This module imports
numpy only (env servers load it and must not pull in torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SuccessorTask:
    """The successor task over token ids ``[0, vocab_size)``."""

    vocab_size: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"vocab_size: expected an int >= 2, got {self.vocab_size!r}")

    def make_prompt(self, rng: np.random.Generator) -> list[int]:
        """One prompt: a single token drawn uniformly. Deterministic given the generator's state."""
        return [int(rng.integers(self.vocab_size))]

    def score(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """Reward in ``[0, 1]``: the fraction of ``completion`` equal to the prompt token's successor.

        An empty completion scores 0.0.

        Raises:
            ValueError: ``prompt`` is not exactly one token in ``[0, vocab_size)``.
        """
        if len(prompt) != 1 or not 0 <= int(prompt[0]) < self.vocab_size:
            raise ValueError(f"prompt: expected one token in [0, {self.vocab_size}), got {list(prompt)!r}")
        if len(completion) == 0:
            return 0.0
        target = (int(prompt[0]) + 1) % self.vocab_size
        return sum(int(token) == target for token in completion) / len(completion)


DEFAULT_TASK = SuccessorTask()


def make_prompt(rng: np.random.Generator) -> list[int]:
    """:meth:`SuccessorTask.make_prompt` of :data:`DEFAULT_TASK`."""
    return DEFAULT_TASK.make_prompt(rng)


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """:meth:`SuccessorTask.score` of :data:`DEFAULT_TASK`."""
    return DEFAULT_TASK.score(prompt, completion)
