"""A toy task a tiny policy keeps learning for hundreds of policy-gradient steps: continue a prompt with the
successors of its tokens, cycling through them.

The prompt is ``k`` random tokens, ``k`` drawn uniformly from ``1..max_prompt_tokens``; completion token
``i`` should be the successor ``(prompt[i mod k] + 1) mod vocab_size``, and the reward is the fraction of
completion tokens that are. The difficulty of a prompt is its length, carried by the prompt itself, so the
prompt source (in the orchestrator) and the score (in the env servers) share no state: one-token prompts
are learned within tens of steps; longer ones need the policy to read the right prompt position through
attention (an in-context rule, not a table of answers), which it learns over hundreds of steps. Because the
targets come from random prompt contents, the policy cannot settle on memorised answers as it does when
every prompt is one token, so groups keep differing in reward (a group whose rewards are all equal has zero
advantage and trains nothing). An untrained policy scores about ``1 / vocab_size``; a perfect one scores 1.

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
    """The cyclic successor task over token ids ``[0, vocab_size)`` with prompts of 1 to ``max_prompt_tokens``
    tokens (``max_prompt_tokens=1``: every completion token is the one prompt token's successor)."""

    vocab_size: int = 16
    max_prompt_tokens: int = 4

    def __post_init__(self) -> None:
        for name, least in (("vocab_size", 2), ("max_prompt_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")

    def make_prompt(self, rng: np.random.Generator) -> list[int]:
        """One prompt: its length, then its tokens, drawn uniformly. Deterministic given the generator's state."""
        length = int(rng.integers(1, self.max_prompt_tokens + 1))
        return [int(token) for token in rng.integers(self.vocab_size, size=length)]

    def score(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """Reward in ``[0, 1]``: the fraction of ``completion`` whose token ``i`` is the successor of
        ``prompt[i mod len(prompt)]``. An empty completion scores 0.0.

        Raises:
            ValueError: ``prompt`` is not 1 to ``max_prompt_tokens`` tokens in ``[0, vocab_size)``.
        """
        if not 1 <= len(prompt) <= self.max_prompt_tokens or not all(0 <= int(t) < self.vocab_size for t in prompt):
            raise ValueError(
                f"prompt: expected 1 to {self.max_prompt_tokens} tokens in [0, {self.vocab_size}), got {list(prompt)!r}"
            )
        if len(completion) == 0:
            return 0.0
        targets = [(int(prompt[i % len(prompt)]) + 1) % self.vocab_size for i in range(len(completion))]
        return sum(int(token) == target for token, target in zip(completion, targets, strict=True)) / len(completion)


DEFAULT_TASK = SuccessorTask()


def make_prompt(rng: np.random.Generator) -> list[int]:
    """:meth:`SuccessorTask.make_prompt` of :data:`DEFAULT_TASK`."""
    return DEFAULT_TASK.make_prompt(rng)


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """:meth:`SuccessorTask.score` of :data:`DEFAULT_TASK`."""
    return DEFAULT_TASK.score(prompt, completion)
