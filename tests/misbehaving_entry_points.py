"""A score function that misbehaves as user code does, for an env-server process in tests: the prompt's first
token picks how. Node processes import it by name: the test puts tests/ on their ``PYTHONPATH``.

* :data:`EXITS` (``sys.exit()`` in the score), :data:`INTERRUPTS` (``KeyboardInterrupt`` raised by user code,
  not by a signal): a ``BaseException`` that is no ``Exception``;
* :data:`UNPRINTABLE`: an exception whose ``str()`` raises too;
* :data:`HANGS`: a score that does not return until the file named by ``$REFBUS_TEST_SCORE_RELEASE`` exists
  (at most :data:`MAX_HANG_S`: a test that failed first still lets its env server stop); it creates that name
  with :data:`HUNG_SUFFIX` added once it hangs;
* :data:`STRING` (the toy score as a string, ``"1.0"``), :data:`BOOL` (``True``): a score that is no number;
* any other prompt: the toy score.

Imports numpy only through the toy task (an env server never imports torch)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from refbus.nodes.toy import task

EXITS = 10
INTERRUPTS = 11
UNPRINTABLE = 12
HANGS = 13
STRING = 14
BOOL = 15
RELEASE_ENV = "REFBUS_TEST_SCORE_RELEASE"
HUNG_SUFFIX = ".hung"
MAX_HANG_S = 120.0


class Unprintable(ValueError):
    """An exception whose message cannot be made: ``str()`` and ``repr()`` of it raise."""

    def __str__(self) -> str:
        raise RuntimeError("no message")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def score(prompt: Sequence[int], completion: Sequence[int]) -> float:
    if prompt[0] == EXITS:
        sys.exit("the score gave up")
    if prompt[0] == INTERRUPTS:
        raise KeyboardInterrupt
    if prompt[0] == UNPRINTABLE:
        raise Unprintable
    if prompt[0] == HANGS:
        release = os.environ[RELEASE_ENV]
        Path(release + HUNG_SUFFIX).touch()
        deadline = time.monotonic() + MAX_HANG_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
    if prompt[0] == STRING:
        return str(task.score(prompt, completion))  # type: ignore[return-value]
    if prompt[0] == BOOL:
        return True
    return task.score(prompt, completion)
