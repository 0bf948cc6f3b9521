"""How a node's exit status tells its supervisor whether a restart can help, and how the supervisor reads why.

Final exits, never restarted (a restart would decide the same again): :data:`HALTED_STATUS`, a node that
decided the run cannot go on (its reason on stderr with :func:`halt`), and :data:`CONFIG_STATUS`, a node whose
configuration or arguments cannot work. ``refbus up``'s supervisor ends the run at once on either, naming the
node and the reason :func:`final_reason` reads back from its log. A failure that can clear by itself (a
:class:`Transient` one: a store a dying predecessor still holds) exits 1 as a crash does, and is restarted.
"""

from __future__ import annotations

import sys

CONFIG_STATUS = 2
"""The exit status of a node whose configuration or arguments cannot work: argparse's usage errors, a
:class:`~.config.ConfigError` at load or from its role (an entry point that cannot be loaded, a budget or a
durable store that cannot be used, a trainer rank without ``$RANK``), a ``SecurityError`` (a key file that cannot
be used, an address other hosts reach with nothing to protect it), a ``NodeIdInUse`` (another live process holds
its node id), a ``BindRefused`` (an address the operating
system refuses to bind for good: an ipc directory that does not exist, a privileged port). Final, as a halt: a
restart reads the same config and decides the same again. Its last line on stderr says why (``refbus: `` and the
error, or argparse's usage error)."""
HALTED_STATUS = 4
"""The exit status of a node that halted the run on purpose: it decided that the run cannot go on (the orchestrator's
final halts: a step batch no message can carry, env servers whose budgets cannot hold a step), which a restart would
only decide again (its halts on deadlines, peers that may yet come, exit 1 as a crash). Its last words on stderr are
:func:`halt`'s line, the reason; ``refbus up`` ends the run naming the node and that reason instead of restarting it
(``supervisor``). Other statuses: 0 done, 1 failed (a crash, or a :class:`Transient` failure: restartable),
:data:`CONFIG_STATUS` a configuration that cannot work (final)."""
FINAL_STATUSES: dict[int, str] = {CONFIG_STATUS: "config", HALTED_STATUS: "halted"}
"""The exit statuses a node is never restarted after, each with the word its death is described with."""
HALTED_PREFIX = "refbus: halted: "
SAID_PREFIX = "refbus: "  # how `refbus node` starts the line that says why it failed


class Transient(RuntimeError):
    """A node cannot start for a reason that can clear by itself (its durable store still held by its predecessor,
    not yet dead): ``refbus node`` says so on stderr and exits 1, which its supervisor restarts, where a refusal
    of its configuration (:data:`CONFIG_STATUS`) would end the run. Unless the broker finds the node's id held by
    another live process, whose hold never clears: then :data:`CONFIG_STATUS`, the holder named (``cli``)."""


def halt(reason: str) -> int:
    """Say ``reason`` on stderr, on one line that starts with :data:`HALTED_PREFIX`, as a halting node's last
    words; :data:`HALTED_STATUS`, the exit status it returns."""
    print(HALTED_PREFIX + " ".join(reason.split()), file=sys.stderr, flush=True)
    return HALTED_STATUS


def halt_reason(log: str) -> str:
    """The reason the last :func:`halt` line of ``log`` (a node's log, or its tail) gives; empty when none."""
    said = [line for line in log.splitlines() if line.startswith(HALTED_PREFIX)]
    return said[-1].removeprefix(HALTED_PREFIX) if said else ""


def final_reason(status: int, log: str) -> str:
    """Why a node that exited with the final ``status`` (one of :data:`FINAL_STATUSES`) ended the run, from ``log``
    (its log, or its tail, earlier incarnations' lines included): a halt's reason (:func:`halt_reason`), or the
    last line of a configuration's refusal (its last words); empty when there is none."""
    if status == HALTED_STATUS:
        return halt_reason(log)
    said = [line for line in log.splitlines() if line.strip()]
    return said[-1].removeprefix(SAID_PREFIX) if said else ""
