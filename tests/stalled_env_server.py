"""A launcher for ``refbus node env-server`` whose env server stops in the middle of a request, for a test to
SIGKILL it there. ``AT`` says where: ``violations``, the first time a request's violations are about to be
logged and published (the keeper has counted them, the journal has committed them; no event is out, no reply
sent); ``claim``, on the first claim, before the keeper sees it (nothing granted, no reply sent); ``claimed``,
after the first claim is answered, at the start of the loop's next turn (granted, committed and answered; its
``claim`` event still in the turn's batch, not yet published); ``deleted``, on the first delete once the keeper
has carried it out (committed, no reply sent); ``reclaiming``, as a holder's blobs are about to be reclaimed
(nothing journaled, nothing deleted); ``reclaimed``, once that reclaim is journaled (the keeper still holds the
blobs, no event is out). There it creates ``MARKER`` and blocks.

``python tests/stalled_env_server.py AT MARKER python -m refbus.nodes.cli node env-server ...``: a
:class:`~refbus.nodes.launch.NodeProcess` ``prefix``. It runs the node command that follows in this process, so
the pid, the signals and the ready file are the node's own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from refbus.nodes import cli
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.keeper import DeleteResult
from refbus.protocol.envelope import Message
from refbus.protocol.messages import Claimed, Deleted, Violation

STALL_S = 120.0  # how long the stalled node waits to be killed (a test that failed first stops it anyway)


def _stall(marker: Path) -> None:
    marker.touch()
    time.sleep(STALL_S)


def stall_at_violations(marker: Path) -> None:
    report = EnvServer._report

    def stall_then_report(self: EnvServer, violations: Sequence[Violation]) -> None:
        if violations:
            _stall(marker)
        report(self, violations)

    EnvServer._report = stall_then_report  # type: ignore[method-assign]


def stall_at_claim(marker: Path) -> None:
    claim = EnvServer._on_claim

    def stall_then_claim(self: EnvServer, request: Message) -> Claimed:
        _stall(marker)
        return claim(self, request)

    EnvServer._on_claim = stall_then_claim  # type: ignore[method-assign]


def stall_after_claim(marker: Path) -> None:
    claim = EnvServer._on_claim

    def claim_then_stall(self: EnvServer, request: Message) -> Claimed:
        claimed = claim(self, request)
        # Calls queued now run first thing in the loop's next turn: after this reply is sent, before the turn
        # publishes its batch of events.
        self.runtime.call_soon(lambda: _stall(marker))
        return claimed

    EnvServer._on_claim = claim_then_stall  # type: ignore[method-assign]


def stall_after_delete(marker: Path) -> None:
    delete = EnvServer._on_delete

    def delete_then_stall(self: EnvServer, request: Message) -> Deleted:
        deleted = delete(self, request)
        _stall(marker)
        return deleted

    EnvServer._on_delete = delete_then_stall  # type: ignore[method-assign]


def stall_at_reclaim(marker: Path) -> None:
    commit = EnvServer._commit_reclaim

    def stall_then_commit(self: EnvServer, holder: str, result: DeleteResult) -> None:
        _stall(marker)
        commit(self, holder, result)

    EnvServer._commit_reclaim = stall_then_commit  # type: ignore[method-assign]


def stall_after_reclaim(marker: Path) -> None:
    commit = EnvServer._commit_reclaim

    def commit_then_stall(self: EnvServer, holder: str, result: DeleteResult) -> None:
        commit(self, holder, result)
        _stall(marker)

    EnvServer._commit_reclaim = commit_then_stall  # type: ignore[method-assign]


def main(at: str, marker: Path, command: list[str]) -> int:
    {"violations": stall_at_violations, "claim": stall_at_claim, "claimed": stall_after_claim,
     "deleted": stall_after_delete, "reclaiming": stall_at_reclaim, "reclaimed": stall_after_reclaim}[at](marker)
    return cli.main(command[command.index("refbus.nodes.cli") + 1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
