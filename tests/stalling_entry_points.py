"""Entry points that stall, for node processes in tests: the toy train step and generate, except that the first call
in each process first blocks for ``$REFBUS_TEST_STALL_S`` seconds, as a long training step or generation does (or,
with ``$REFBUS_TEST_STALL_UNTIL`` set to a path, until that file exists: the test decides when the stall ends;
each process stalled so creates ``<path>.<pid>`` first); and the toy policy, except that one weight pull into it
stops half-way (``policy``). Node processes import it by name: the test puts tests/ on their ``PYTHONPATH``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from refbus.nodes.toy import policy as toy_policy
from refbus.nodes.toy import train

STALL_ENV = "REFBUS_TEST_STALL_S"
STALL_UNTIL_ENV = "REFBUS_TEST_STALL_UNTIL"
FREEZE_ENV = "REFBUS_TEST_FREEZE_PULL"  # "N:PATH": the N-th pull into the policy stops half-way
FROZEN_S = 120.0  # how long a frozen pull waits to be killed (a test that failed first stops the node anyway)
_stalled: set[str] = set()


def _stall_once(what: str) -> None:
    if what in _stalled:
        return
    _stalled.add(what)
    until = os.environ.get(STALL_UNTIL_ENV)
    if not until:
        time.sleep(float(os.environ[STALL_ENV]))
        return
    Path(f"{until}.{os.getpid()}").touch()
    deadline = time.monotonic() + FROZEN_S  # a test that failed first stops the node anyway
    while not Path(until).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def train_step(*args: Any, **kwargs: Any) -> Any:
    _stall_once("train_step")
    return train.train_step(*args, **kwargs)


def generate(*args: Any, **kwargs: Any) -> Any:
    _stall_once("generate")
    return toy_policy.generate(*args, **kwargs)


class _FreezingOut(Mapping[str, torch.Tensor]):
    """A rollout worker's ``out=`` for one pull: the pull writes the first tensor it asks for, then, asking for
    the second one, creates ``marker`` (naming the tensor written) and blocks, its lease held and renewed, the
    model half-written: a refresh in the middle, for the test to kill."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], marker: Path) -> None:
        self._tensors = tensors
        self._marker = marker
        self._asked: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, name: str, default: Any = None) -> Any:
        self._asked.append(name)
        if len(self._asked) == 2:
            self._marker.write_text(self._asked[0])
            time.sleep(FROZEN_S)
        return self._tensors.get(name, default)


def policy(seed: int) -> torch.nn.Module:
    """The toy policy; with ``$REFBUS_TEST_FREEZE_PULL`` (``N:PATH``), its ``N``-th weight pull freezes half-way
    (see :class:`_FreezingOut`). A rollout worker pulls into ``model.state_dict()`` once per pull."""
    model = toy_policy.make_policy(seed)
    count, _, marker = os.environ.get(FREEZE_ENV, "0:").partition(":")
    state_dict = model.state_dict
    pulls = 0

    def freezing_state_dict(*args: Any, **kwargs: Any) -> Any:
        nonlocal pulls
        pulls += 1
        state = state_dict(*args, **kwargs)
        return _FreezingOut(state, Path(marker)) if pulls == int(count) else state

    model.state_dict = freezing_state_dict  # type: ignore[method-assign]
    return model
