"""How a node halts the run on purpose, and how its supervisor reads why: one exit status and one last line.

A node that decides the run cannot go on (a restart would only decide it again) says why on stderr with
:func:`halt` and exits with the status it returns; ``refbus up``'s supervisor recognizes that status and ends the
run, naming the reason :func:`halt_reason` reads back from the node's log.
"""

from __future__ import annotations

import sys

HALTED_STATUS = 4
"""The exit status of a node that halted the run on purpose: it decided that the run cannot go on (the orchestrator's
final halts: a step batch no message can carry, env servers whose budgets cannot hold a step), which a restart would
only decide again (its halts on deadlines, peers that may yet come, exit 1 as a crash). Its last words on stderr are
:func:`halt`'s line, the reason; ``refbus up`` ends the run naming the node and that reason instead of restarting it
(``supervisor``). Other statuses: 0 done, 1 failed (a crash: restartable), 2 a configuration that cannot work."""
HALTED_PREFIX = "refbus: halted: "


def halt(reason: str) -> int:
    """Say ``reason`` on stderr, on one line that starts with :data:`HALTED_PREFIX`, as a halting node's last
    words; :data:`HALTED_STATUS`, the exit status it returns."""
    print(HALTED_PREFIX + " ".join(reason.split()), file=sys.stderr, flush=True)
    return HALTED_STATUS


def halt_reason(log: str) -> str:
    """The reason the last :func:`halt` line of ``log`` (a node's log, or its tail) gives; empty when none."""
    said = [line for line in log.splitlines() if line.startswith(HALTED_PREFIX)]
    return said[-1].removeprefix(HALTED_PREFIX) if said else ""
