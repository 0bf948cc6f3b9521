"""A launcher for a node in tests (``NodeProcess(..., prefix=[sys.executable, THIS_FILE])``): the node runs in this
process (its pid, its signals), its store's journal compacted once more than ``$REFBUS_TEST_COMPACT_MIN_RECORDS``
records piled up (the ps-manager's limit, made small) and, with ``$REFBUS_TEST_PAUSE_COMPACTION`` set to
``N:POINT``, its N-th compaction stopped by a SIGSTOP to itself at POINT: ``rename`` (the new journal written whole,
not yet renamed over the old one) or ``flag:K`` (its K-th record's bytes written, not its commit flag). The test
finds it stopped there, inside the compaction's window, and kills it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any

from refbus.nodes.cli import main
from refbus.nodes.ps import manager_journal
from refbus.nodes.store.durable import DurableStore

COMPACT_ENV = "REFBUS_TEST_COMPACT_MIN_RECORDS"
PAUSE_ENV = "REFBUS_TEST_PAUSE_COMPACTION"


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _pausing(point: str) -> tuple[str, Callable[[], None]]:
    """The store's hook attribute to set for ``point``, and the hook: it stops this process where ``point`` says
    (at the K-th call of ``before_flag``)."""
    if point == "rename":
        return "before_rename", _stop
    where, count = point.split(":")
    assert where == "flag", point
    calls = iter(range(1, int(count) + 1))

    def flag() -> None:
        if next(calls, None) == int(count):
            _stop()

    return "before_flag", flag


def _install_pause(spec: str) -> None:
    """Wrap DurableStore.compact so that the ``spec`` (``N:POINT``) compaction in this process stops there: the
    N-th of those that write the record POINT names (``flag:K``: K records at least)."""
    nth, point = spec.split(":", 1)
    least = int(point.split(":")[1]) if point.startswith("flag:") else 0
    compact = DurableStore.compact
    done = iter(range(1, int(nth) + 1))

    def compacting(store: DurableStore, records: Iterable[dict[str, Any]]) -> None:
        records = list(records)
        if len(records) < least or next(done, None) != int(nth):
            compact(store, records)
            return
        hook, pause = _pausing(point)
        setattr(store, hook, pause)
        try:
            compact(store, records)
        finally:
            setattr(store, hook, None)

    DurableStore.compact = compacting  # type: ignore[method-assign]


if __name__ == "__main__":
    assert sys.argv[2:4] == ["-m", "refbus.nodes.cli"], sys.argv  # NodeProcess: [python, -m, refbus.nodes.cli, ...]
    manager_journal.COMPACT_MIN_RECORDS = int(os.environ.get(COMPACT_ENV, manager_journal.COMPACT_MIN_RECORDS))
    if os.environ.get(PAUSE_ENV):
        _install_pause(os.environ[PAUSE_ENV])
    sys.exit(main(sys.argv[4:]))
