"""The payload bench's memory figures: the orchestrator child's peak RSS is its own, not its parent's."""

from __future__ import annotations

import numpy as np

from bench import payload
from bench.harness import MIB, workers


def test_the_orchestrator_childs_peak_rss_is_its_own_not_its_parents() -> None:
    ballast = np.ones(384 * MIB, dtype=np.uint8)  # this process's peak: far above a fresh child's
    with workers("bench-test-orchestrator") as (child,):
        child.submit(payload.orchestrator_like)
        child.message()  # its endpoint: it is serving
        child.tell("stop")
        assert child.result() < ballast.nbytes // 2
    del ballast
