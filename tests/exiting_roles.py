"""A launcher for ``refbus node`` that adds roles whose process outlives its node, for the exit watchdog's status:
``fails-then-hangs`` (its role raises once the node has closed, then hangs in a ``finally``: a thread that never
joins), ``refused-then-hangs`` (likewise with a :class:`~refbus.nodes.config.ConfigError`, which ``refbus node``
exits 2 for: final), ``refused-unclosed`` (its role raises that while its node's loop, in a background thread, is
stuck in a callback, and then waits for the node to close), ``finishes-then-hangs`` (its node closes cleanly, then
the role hangs in teardown) and ``loop-fails`` (its node's loop, in a background thread, dies of an error while the
role's main thread waits on other work), each node's shutdown clock started at once; ``probes-then-serves``,
whose role makes and closes a second runtime (a probe) before its node serves until SIGTERM; and ``hangs-mid-step``,
whose node serves in a background thread until its stdin closes, when its shutdown clock starts as a trainer rank's
does at SIGTERM while the role's main thread (mid-step) never stops it. Every node is unregistered (no broker
needed).

``python tests/exiting_roles.py python -m refbus.nodes.cli node ROLE ...``: a
:class:`~refbus.nodes.launch.NodeProcess` ``prefix``. It runs the node command that follows in this process, so
the pid, the signals and the exit status are the node's own.
"""

from __future__ import annotations

import argparse
import sys
import threading

from refbus.bus.runtime import NodeRuntime
from refbus.nodes import cli
from refbus.nodes.config import Config, ConfigError

HANG_S = 120.0  # how long a role hangs: far beyond any shutdown timeout a test sets (its teardown kills it anyway)
FAILURE = "the role failed after its node closed"
LOOP_FAILURE = "a step of the node's loop failed"
REFUSAL = "the role refused its config after its node started"


class LoopStepFailed(BaseException):
    """What a loop step raises past the loop's own guards (those catch ``Exception`` only)."""


def _node(config: Config, args: argparse.Namespace) -> NodeRuntime:
    return NodeRuntime(args.role, config.runtime(node_id=args.node_id, ready_file=args.ready_file), register=False)


def _raise_then_hang(config: Config, args: argparse.Namespace, failure: Exception) -> int:
    """Run the node until it closes, then raise ``failure`` and hang in the ``finally`` clause."""
    runtime = _node(config, args)
    try:
        runtime.run(until=lambda: True)
        raise failure
    finally:
        threading.Event().wait(HANG_S)


def fails_then_hangs(config: Config, args: argparse.Namespace) -> int:
    return _raise_then_hang(config, args, RuntimeError(FAILURE))


def refused_then_hangs(config: Config, args: argparse.Namespace) -> int:
    return _raise_then_hang(config, args, ConfigError(REFUSAL))


def refused_unclosed(config: Config, args: argparse.Namespace) -> int:
    runtime = _node(config, args)
    runtime.start_background()
    stuck = threading.Event()

    def hang() -> None:
        stuck.set()
        threading.Event().wait(HANG_S)

    runtime.call_soon(hang)  # the loop never comes back to close the node
    stuck.wait(HANG_S)
    try:
        raise ConfigError(REFUSAL)
    finally:
        runtime.join()  # stops the node (its shutdown clock starts) and waits for a close that never comes


def finishes_then_hangs(config: Config, args: argparse.Namespace) -> int:
    runtime = _node(config, args)
    runtime.run(until=lambda: True)
    threading.Event().wait(HANG_S)
    return 0


def loop_fails(config: Config, args: argparse.Namespace) -> int:
    runtime = _node(config, args)
    runtime.start_background()

    def fail() -> None:
        raise LoopStepFailed(LOOP_FAILURE)

    runtime.call_soon(fail)
    threading.Event().wait(HANG_S)
    return 0


def probes_then_serves(config: Config, args: argparse.Namespace) -> int:
    runtime = _node(config, args)
    probe = NodeRuntime("probe", config.runtime(node_id="probe"), register=False)  # made after the node: not its
    probe.close()
    runtime.run()  # until SIGTERM
    return 0


def hangs_mid_step(config: Config, args: argparse.Namespace) -> int:
    runtime = _node(config, args)
    runtime.start_background()
    sys.stdin.readline()  # until the test closes it
    runtime.begin_shutdown()
    threading.Event().wait(HANG_S)
    return 0


def main(command: list[str]) -> int:
    for function in (fails_then_hangs, refused_then_hangs, refused_unclosed, finishes_then_hangs, loop_fails,
                     probes_then_serves, hangs_mid_step):
        cli.ROLES[function.__name__.replace("_", "-")] = (function.__name__, f"__main__:{function.__name__}")
    return cli.main(command[command.index("refbus.nodes.cli") + 1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
