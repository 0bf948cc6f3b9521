"""Entry points that stall, for `refbus up` runs in tests: the toy train step and generate, except that the
first call in each process first blocks for ``$REFBUS_TEST_STALL_S`` seconds, as a long training step or
generation does. Node processes import it by name: the test puts tests/ on their ``PYTHONPATH``."""

from __future__ import annotations

import os
import time
from typing import Any

from refbus.nodes.toy import policy, train

STALL_ENV = "REFBUS_TEST_STALL_S"
_stalled: set[str] = set()


def _stall_once(what: str) -> None:
    if what not in _stalled:
        _stalled.add(what)
        time.sleep(float(os.environ[STALL_ENV]))


def train_step(*args: Any, **kwargs: Any) -> Any:
    _stall_once("train_step")
    return train.train_step(*args, **kwargs)


def generate(*args: Any, **kwargs: Any) -> Any:
    _stall_once("generate")
    return policy.generate(*args, **kwargs)
