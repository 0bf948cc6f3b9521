"""Entry points for a run whose env server gets cut off (tests/test_partition.py): prompts unique to their
group, a score that holds the groups of its env server open, and a train step the test can keep waiting.

:func:`make_prompt` (the orchestrator's) gives every group its own prompt: its number in four base-16 digits,
a valid prompt of the toy task. :func:`score` is the toy score, except that while the file named by
``$REFBUS_TEST_HOLD`` exists, a score whose prompt this process scored before (its group's first episode
was kept here) appends ``{"held": prompt}`` to ``$REFBUS_TEST_HOLD_LOG`` and waits until the file is gone.
So, once held, no group running there completes: the orchestrator holds their first episodes' blobs and
their other runs stay in flight. :func:`train_step` is the toy train step, except that it waits while the
file named by ``$REFBUS_TEST_STEPS`` holds a number of steps this process has already trained. The env
server loads this module too, and never imports torch: only :func:`train_step` does, when called.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from refbus.nodes.toy import task

HOLD_ENV = "REFBUS_TEST_HOLD"
LOG_ENV = "REFBUS_TEST_HOLD_LOG"
STEPS_ENV = "REFBUS_TEST_STEPS"
POLL_S = 0.02
MAX_HOLD_S = 120.0  # a test that never releases the hold still lets its env server finish
PROMPT_TOKENS = 4

_groups = itertools.count()
_seen: set[tuple[int, ...]] = set()
_trained = 0


def make_prompt(rng: np.random.Generator) -> list[int]:
    number = next(_groups)
    vocab = task.TASK.vocab_size
    return [(number // vocab**i) % vocab for i in range(PROMPT_TOKENS)]


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    key = tuple(int(t) for t in prompt)
    hold = os.environ[HOLD_ENV]
    if key in _seen and os.path.exists(hold):
        with open(os.environ[LOG_ENV], "a") as log:
            log.write(json.dumps({"held": list(key)}) + "\n")
        deadline = time.monotonic() + MAX_HOLD_S
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    _seen.add(key)
    return task.score(prompt, completion)


def _allowed(path: str) -> float:
    try:
        with open(path) as file:
            return int(file.read())
    except (FileNotFoundError, ValueError):  # no limit, or one being written: the next poll reads it
        return math.inf


def train_step(*args: Any, **kwargs: Any) -> dict[str, float]:
    from refbus.nodes.toy import train  # torch: only in the trainer rank that calls it

    global _trained
    limit = os.environ[STEPS_ENV]
    deadline = time.monotonic() + MAX_HOLD_S
    while _allowed(limit) <= _trained and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _trained += 1
    return train.train_step(*args, **kwargs)
