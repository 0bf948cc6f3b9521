"""How late a node's periodic pass runs, so deadlines judged on it count no time the node's loop did not run.

A process that is stopped, swapped out or starved of CPU reads nothing meanwhile: its peers' heartbeats and lease
renewals wait unread in its sockets. On waking, its timers run before those messages are read, and a deadline
that passed meanwhile says nothing about the peer. A pass that comes more than a whole period late measures that
stall, and the owner of the deadlines moves them by it (the broker its nodes' last heartbeats, the ps-manager its
leases); a deadline that passes after the wake-up counts as ever."""

from __future__ import annotations

import time
from collections.abc import Callable


class PassStalls:
    """The stalls of one periodic pass on ``clock``: :meth:`stall` at each pass. Loop thread only."""

    def __init__(self, period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not period_s > 0:
            raise ValueError(f"a pass's period must be above 0 seconds, got {period_s!r}")
        self.period_s = period_s
        self.clock = clock
        self.stalled_s = 0.0  # every stall measured so far
        self._ran = clock()

    def stall(self) -> float:
        """Record a pass now; the seconds the loop did not run since the last one: how much more than a period
        late this pass comes, when more than a whole period late (less is a busy turn, not a stall), else 0."""
        now = self.clock()
        late = now - self._ran - self.period_s
        self._ran = now
        if late <= self.period_s:
            return 0.0
        self.stalled_s += late
        return late
