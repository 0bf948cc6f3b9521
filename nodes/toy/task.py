"""A toy task a tiny policy keeps learning for hundreds of policy-gradient steps: continue a prompt with the
successors of its tokens, cycling through them, with a curriculum that lengthens the prompts as they are
learned.

Completion token ``i`` of a prompt of ``k`` tokens should be the successor ``(prompt[i mod k] + 1) mod
vocab_size``, and the reward is the fraction of completion tokens that are. The difficulty of a prompt is its
length, carried by the prompt itself, so the prompt source (in the orchestrator) and the score (in the env
servers) share no state: one-token prompts are learned within about a hundred steps; longer ones need the
policy to read the right prompt position through attention (an in-context rule, not a table of answers).
Because the targets come from random prompt contents, the policy cannot settle on memorised answers, so
groups keep differing in reward (a group whose rewards are all equal has zero advantage and trains
nothing). An untrained policy scores about ``1 / vocab_size``; a perfect one scores 1.

Entry points ``refbus up`` names in its config:

* :class:`Curriculum` (the default ``orchestrator.prompt``): a prompt source that hears the rewards (see
  :mod:`refbus.nodes.payload.prompts`). Level ``L`` makes prompts of exactly ``L`` tokens; once the groups of
  the current level score well on average (:func:`next_level`) it moves to ``L + 1``, up to
  :data:`TASK`'s ``max_prompt_tokens``. Prompts of one length only: a mixture would be ambiguous to the
  policy (it cannot tell where a prompt ends) and its mastered short prompts would be filtered groups.
* :func:`make_prompt`: the fixed mixture (1 to 4 tokens, uniformly), which never hears the rewards.
* :func:`score`: the reward of either (:data:`TASK`, which accepts every length the curriculum reaches).

This module imports numpy only (env servers load it and must not pull in torch).
"""

from __future__ import annotations

import statistics
from collections import deque
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

    def make_prompt(self, rng: np.random.Generator, length: int | None = None) -> list[int]:
        """One prompt of ``length`` tokens (None: a length drawn uniformly from 1 to ``max_prompt_tokens``
        first), its tokens drawn uniformly. Deterministic given the generator's state."""
        if length is None:
            length = int(rng.integers(1, self.max_prompt_tokens + 1))
        elif not 1 <= length <= self.max_prompt_tokens:
            raise ValueError(f"length: expected 1 to {self.max_prompt_tokens}, got {length!r}")
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


@dataclass(frozen=True, slots=True)
class CurriculumRule:
    """When a curriculum moves on: once the last ``window`` groups of the current level scored at least
    ``threshold`` on average (each group counted by its mean reward)."""

    threshold: float = 0.7
    window: int = 32  # two steps of `refbus up`'s default 16 groups: one lucky step does not move it

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold: expected a reward in [0, 1], got {self.threshold!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window: expected an int >= 1, got {self.window!r}")


def next_level(level: int, recent: Sequence[float], rule: CurriculumRule, top: int) -> int:
    """The level after hearing ``recent`` (the mean rewards of the latest groups made at ``level``, oldest
    first): ``level + 1`` once the last ``rule.window`` of them average at least ``rule.threshold``, never
    above ``top``; else ``level``. Fewer than ``rule.window`` groups never move it."""
    window = recent[-rule.window:]
    if level >= top or len(window) < rule.window or statistics.fmean(window) < rule.threshold:
        return level
    return level + 1


TASK = SuccessorTask(max_prompt_tokens=8)  # every length the curriculum reaches (8 + 6 new tokens fit the policy)
FIXED_MIX = SuccessorTask(max_prompt_tokens=4)


class Curriculum:
    """The successor task with prompts that lengthen as they are learned: a prompt source in class form (see
    :mod:`refbus.nodes.payload.prompts`). Level ``L`` makes prompts of ``L`` tokens; :meth:`observe` hears
    each completed group and moves to the next level by :func:`next_level`. A subclass may set another
    :attr:`rule` or :attr:`task`."""

    rule = CurriculumRule()
    task = TASK

    def __init__(self) -> None:
        self.level = 1
        self.level_reward = 0.0
        self._recent: deque[float] = deque(maxlen=self.rule.window)  # mean rewards of this level's groups

    def make_prompt(self, rng: np.random.Generator) -> list[int]:
        return self.task.make_prompt(rng, length=self.level)

    def observe(self, prompt: Sequence[int], rewards: Sequence[float]) -> None:
        """A completed group: its prompt and its episodes' rewards. Groups of an earlier level (made before
        the last move, completed after it) do not count."""
        if len(prompt) != self.level or not rewards:
            return
        self._recent.append(statistics.fmean(rewards))
        level = next_level(self.level, list(self._recent), self.rule, self.task.max_prompt_tokens)
        if level != self.level:
            self.level = level
            self._recent.clear()
        self.level_reward = statistics.fmean(self._recent) if self._recent else 0.0

    def status(self) -> dict[str, float]:
        """``level`` and ``level_reward``, the mean reward of the last ``rule.window`` groups heard at this
        level (0 before any). Plain reads: a metrics scrape may call it from another thread."""
        return {"level": float(self.level), "level_reward": round(self.level_reward, 4)}


def make_prompt(rng: np.random.Generator) -> list[int]:
    """:meth:`SuccessorTask.make_prompt` of :data:`FIXED_MIX` (1 to 4 tokens; no curriculum)."""
    return FIXED_MIX.make_prompt(rng)


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """:meth:`SuccessorTask.score` of :data:`TASK` (prompts of 1 to 8 tokens)."""
    return TASK.score(prompt, completion)
