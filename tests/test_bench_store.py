"""The store bench at tiny sizes: generating the data is off the keep's clock, the re-adoption is timed by the
bench from the store's open, and each figure comes with a baseline measured in the same run.

The bench times everything with the clock it is given; these tests give it one that jumps a known amount
where the work it must not time (or must) happens, so what each span holds shows in its figure."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench import store
from bench.harness import format_table

JUMP_S = 1000.0
TINY = store.Settings(blobs=12, tokens=16, repeats=2, directory="")


@pytest.fixture
def settings() -> Iterator[store.Settings]:
    """Tiny sizes, the stores in a directory of their own on the tmpfs, removed after."""
    directory = tempfile.mkdtemp(prefix="refbus-test-store-", dir="/dev/shm")
    try:
        yield dataclasses.replace(TINY, directory=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class JumpingClock:
    """``time.perf_counter`` plus ``JUMP_S`` for each :meth:`jump`."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset

    def jump(self) -> None:
        self.offset += JUMP_S


def test_each_figure_has_its_baseline_from_the_same_run_and_every_blob_is_readopted(
        settings: store.Settings) -> None:
    found = store.measure(settings)
    assert found["blobs"] == settings.blobs and found["bytes"] == found["readopted_bytes"] > 0
    keep, readopt = store.rows(settings, found)
    assert keep.refbus > 0 < keep.baseline and readopt.refbus > 0 < readopt.baseline
    assert keep.refbus == pytest.approx(found["keep_s"] * 1e6 / settings.blobs)
    assert readopt.baseline == pytest.approx(found["map_hash_s"] * 1e6 / settings.blobs)
    table = format_table([keep, readopt])
    assert "keep: " in table and "re-adoption: " in table
    assert not list(Path(settings.directory).iterdir())  # nothing left behind


def test_generating_a_branch_is_not_on_the_keeps_clock(monkeypatch: pytest.MonkeyPatch,
                                                       settings: store.Settings) -> None:
    clock = JumpingClock()
    generate = store.branch

    def slow_branch(tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        clock.jump()
        return generate(tokens, rng)

    monkeypatch.setattr(store, "branch", slow_branch)
    found = store.measure(settings, clock=clock)
    assert clock.offset == JUMP_S * settings.blobs  # every branch was generated through the jumping clock
    assert found["keep_s"] < JUMP_S and found["write_s"] < JUMP_S


def test_the_readoption_is_timed_from_the_stores_open(monkeypatch: pytest.MonkeyPatch,
                                                     settings: store.Settings) -> None:
    clock = JumpingClock()
    opened = store.DurableStore

    def slow_open(*args: object, **kwargs: object) -> store.DurableStore:
        clock.jump()  # the journal is read and replayed here: part of what a restart waits for
        return opened(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "DurableStore", slow_open)
    found = store.measure(settings, clock=clock)
    assert found["readopt_s"] >= JUMP_S  # the open is inside the re-adoption's span
    assert found["map_hash_s"] < JUMP_S and found["keep_s"] < JUMP_S  # and inside no other
