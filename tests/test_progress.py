"""`refbus up`'s progress line, as a pure function of two snapshots of the run: the pace, the drops since the
previous line with their reasons, the time left from the recent pace."""

from __future__ import annotations

import pytest
from refbus.nodes.progress import Snapshot, clock, dropped_since, progress_line, seconds_left, shares


def test_line_explains_pace_drops_and_time() -> None:
    before = Snapshot(at_s=40.0, version=11, episodes=100, deleted={"trained": 60, "filtered": 20})
    now = Snapshot(at_s=42.0, version=12, episodes=136, deleted={"trained": 90, "filtered": 56, "stale": 4})
    line = progress_line(before, now, steps=300, reward=0.4123, fetch_s=0.0031,
                         held=[("env-0", 0.2 * (1 << 20)), ("env-1", 0.0)], left_s=598.0)
    assert line == ("step  12/300  reward 0.412  18.0 eps/s  dropped +40 (filtered 36, stale 4)  fetch 3.1 ms  "
                    "held env-0=0.20MiB env-1=0.00MiB  0:42 elapsed, ~9:58 left")


def test_line_before_anything_is_known() -> None:
    start = Snapshot(at_s=0.0, version=0, episodes=0, deleted={})
    line = progress_line(start, start, steps=5, reward=None, fetch_s=None, held=[], left_s=None)
    assert line == "step   0/5  reward -  0.0 eps/s  dropped +0  fetch -  held   0:00 elapsed"


def test_line_shows_the_prompt_sources_numbers_when_it_reports_any() -> None:
    start = Snapshot(at_s=0.0, version=0, episodes=0, deleted={})
    line = progress_line(start, start, steps=5, reward=None, fetch_s=None, held=[], left_s=None,
                         task={"level": 2.0, "level_reward": 0.53})
    assert line.endswith("held   task level=2 level_reward=0.53  0:00 elapsed")
    assert "task" not in progress_line(start, start, steps=5, reward=None, fetch_s=None, held=[], left_s=None, task={})


def test_trained_samples_are_not_drops() -> None:
    before = Snapshot(at_s=0.0, version=0, episodes=0, deleted={"trained": 5})
    now = Snapshot(at_s=1.0, version=1, episodes=8, deleted={"trained": 13, "late": 1})
    assert dropped_since(before, now) == {"late": 1}


def test_time_left_follows_the_recent_pace() -> None:
    assert seconds_left([0.0], 0, 10) is None
    # Fast at first (1 s a step), then 5 s a step: the last ten steps decide.
    times = [float(t) for t in range(11)] + [10.0 + 5 * k for k in range(1, 11)]
    assert seconds_left(times, 20, 30) == pytest.approx(10 * 5.0)
    assert seconds_left(times, 30, 30) == 0.0


def test_clock_and_shares() -> None:
    assert (clock(59.6), clock(61), clock(3725)) == ("1:00", "1:01", "1:02:05")
    assert shares({"trained": 3, "filtered": 1}) == {"filtered": 0.25, "trained": 0.75}
    assert shares({}) == {}
