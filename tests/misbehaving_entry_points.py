"""A score function that misbehaves as user code does, for an env-server process in tests: the prompt's first
token picks how. Node processes import it by name: the test puts tests/ on their ``PYTHONPATH``.

* :data:`EXITS` (``sys.exit()`` in the score), :data:`INTERRUPTS` (``KeyboardInterrupt`` raised by user code,
  not by a signal): a ``BaseException`` that is no ``Exception``;
* any other prompt: the toy score.

Imports numpy only through the toy task (an env server never imports torch)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from refbus.nodes.toy import task

EXITS = 10
INTERRUPTS = 11


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    if prompt[0] == EXITS:
        sys.exit("the score gave up")
    if prompt[0] == INTERRUPTS:
        raise KeyboardInterrupt
    return task.score(prompt, completion)
