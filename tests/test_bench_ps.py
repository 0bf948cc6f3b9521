"""The PS bench's checked pulls: each starts from zeroed buffers, so a pull that writes nothing fails its check
instead of passing on the bytes an earlier pull left (a real cluster: broker, ps-manager, one ps-worker); a pull
and the memcpy baseline are timed alike (one warm-up dropped, the best of the rest); across rounds the frames
figures keep the first round's cold push."""

from __future__ import annotations

import pytest
import torch

import bench.ps
from bench.harness import BenchError
from bench.ps import best_of_rounds, checked_pull_s, cluster, make_state, push_pull


def test_a_pull_that_writes_nothing_fails_its_check_after_a_real_pull_filled_the_buffers() -> None:
    state = make_state(256 << 10, 8)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    with cluster(1) as c:
        runtime, ps = c.client("bench-test-ps")
        try:
            pushes, pull_s = push_pull(ps, state, out, repeats=2)
            assert len(pushes) > 2 and pull_s > 0
            assert all(torch.equal(out[name], t) for name, t in state.items())  # the buffers hold the pushed bytes

            ps.pull = lambda **_: None  # type: ignore[method-assign]  # a pull that does nothing
            with pytest.raises(BenchError, match="other bytes than were pushed"):
                push_pull(ps, state, out, repeats=1)
        finally:
            runtime.close()


def test_a_checked_pull_and_the_memcpy_baseline_drop_one_warm_up_and_take_the_best_of_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each run's seconds on a clock the pull itself advances: 10 s cold, then 3, 1 and 2 s."""
    state = make_state(64 << 10, 2)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    now, costs = [0.0], [10.0, 3.0, 1.0, 2.0]

    def pull() -> None:
        now[0] += costs.pop(0)
        for name, t in state.items():
            out[name].copy_(t)

    monkeypatch.setattr(bench.ps.time, "perf_counter", lambda: now[0])
    assert checked_pull_s(pull, out, state, runs=3) == 1.0
    assert not costs  # runs + 1 pulls: the warm-up and three timed


def test_the_frames_rounds_keep_the_first_rounds_cold_push_and_the_best_of_the_rest() -> None:
    first = {"push_cold_s": 9.0, "push_s": 2.0, "pull_s": 1.0}  # the real cold push: no segment existed
    second = {"push_cold_s": 2.1, "push_s": 2.2, "pull_s": 0.9}  # its segments already existed
    assert best_of_rounds(best_of_rounds({}, first), second) == {"push_cold_s": 9.0, "push_s": 2.0, "pull_s": 0.9}
