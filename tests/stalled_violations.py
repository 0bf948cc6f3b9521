"""A launcher for ``refbus node env-server`` whose env server stops between deciding and publishing violations:
the first time a request's violations are about to be logged and published (the keeper has counted them, the
journal has committed them; no event is out, no reply sent), it creates ``MARKER`` and blocks, for the test to
SIGKILL it there.

``python tests/stalled_violations.py MARKER python -m refbus.nodes.cli node env-server ...``: a
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
from refbus.protocol.messages import Violation

STALL_S = 120.0  # how long the stalled node waits to be killed (a test that failed first stops it anyway)


def main(marker: Path, command: list[str]) -> int:
    report = EnvServer._report

    def stall_then_report(self: EnvServer, violations: Sequence[Violation]) -> None:
        if violations:
            marker.touch()
            time.sleep(STALL_S)
        report(self, violations)

    EnvServer._report = stall_then_report  # type: ignore[method-assign]
    return cli.main(command[command.index("refbus.nodes.cli") + 1:])


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), sys.argv[2:]))
