"""What `refbus up` prints while a run goes on: one line per new policy version, explaining the pace.

The line is a pure function of two snapshots of the run (the one at the previous line and now), so what it
says can be checked without a cluster::

    step  12/300  reward 0.412  18.3 eps/s  dropped +40 (filtered 36, stale 4)  fetch 3.1 ms
        held env-0=0.20MiB env-1=0.18MiB  task level=2 level_reward=0.53  0:42 elapsed, ~9:58 left

``dropped`` counts the samples deleted since the previous line for any reason but ``trained`` (in
`refbus up`'s loop each episode keeps one sample, one blob), by reason, most frequent first. The time left
extrapolates the mean time per step over the last :data:`PACE_WINDOW` lines, so a run that slows down says
so at once instead of averaging its fast start in. ``task`` shows the prompt source's numbers (a curriculum's
level), when it reports any.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

MiB = 1 << 20
TRAINED = "trained"
FILTERED = "filtered"  # a complete group whose advantages are all zero
PACE_WINDOW = 10  # steps whose mean duration projects the time left


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The run as one progress line sees it. ``deleted``: samples deleted so far, by reason."""

    at_s: float  # seconds since the run started
    version: int
    episodes: int
    deleted: Mapping[str, int]


def dropped_since(before: Snapshot, now: Snapshot) -> Counter[str]:
    """Samples deleted between the two snapshots for a reason other than ``trained``, by reason."""
    return Counter({reason: n - before.deleted.get(reason, 0) for reason, n in now.deleted.items()
                    if reason != TRAINED and n > before.deleted.get(reason, 0)})


def seconds_left(step_times: Sequence[float], version: int, steps: int) -> float | None:
    """The time left at ``version`` of ``steps``, from the recent pace (``step_times``: seconds since the run
    started at which each version appeared); None before two versions exist."""
    if len(step_times) < 2:
        return None
    recent = step_times[-(PACE_WINDOW + 1):]
    per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(0, steps - version) * per_step


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on)."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(before: Snapshot, now: Snapshot, *, steps: int, reward: float | None, fetch_s: float | None,
                  held: Sequence[tuple[str, float]], left_s: float | None,
                  task: Mapping[str, float] | None = None) -> str:
    """One progress line (see the module doc); ``held``: (node, bytes held) per store; ``task``: the prompt
    source's numbers (none: no ``task`` part)."""
    span = now.at_s - before.at_s
    rate = (now.episodes - before.episodes) / span if span > 0 else 0.0
    dropped = dropped_since(before, now)
    why = ", ".join(f"{reason} {n}" for reason, n in dropped.most_common())
    parts = [
        f"step {now.version:>3}/{steps}",
        f"reward {reward:.3f}" if reward is not None else "reward -",
        f"{rate:.1f} eps/s",
        f"dropped +{dropped.total()}" + (f" ({why})" if why else ""),
        f"fetch {fetch_s * 1000:.1f} ms" if fetch_s is not None else "fetch -",
        "held " + " ".join(f"{name}={nbytes / MiB:.2f}MiB" for name, nbytes in held),
        *(["task " + " ".join(f"{name}={value:g}" for name, value in task.items())] if task else []),
        f"{clock(now.at_s)} elapsed" + (f", ~{clock(left_s)} left" if left_s is not None else ""),
    ]
    return "  ".join(parts)


def shares(counts: Mapping[str, int]) -> dict[str, float]:
    """Each reason's share of the total (rounded to 4 places); empty when nothing was counted."""
    total = sum(counts.values())
    return {reason: round(n / total, 4) for reason, n in sorted(counts.items())} if total else {}
