"""A trainer rank as the env server sees it, that can be SIGKILLed: a registered node (role ``trainer``, the
labels given) that takes blobs the orchestrator claimed by publishing their hand-over (``reference``), as a rank
does, prints its process (one JSON line), then serves heartbeats until it is killed or stopped.

``python tests/hand_over_holder.py CONTROL NODE_ID LABELS_JSON BLOB_ID...`` (no blob id: it takes nothing)
"""

from __future__ import annotations

import json
import sys

from refbus.bus.logs import configure_logging
from refbus.bus.peers import incarnation
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.protocol.messages import Reference

HEARTBEAT_S = 0.2  # the tests' FAST_LIVENESS heartbeat


def main(control: str, node_id: str, labels: dict[str, str], blob_ids: list[str]) -> None:
    configure_logging(level="warning")  # stdout carries the one JSON line; logs go to stderr
    runtime = NodeRuntime("trainer", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                     heartbeat_interval_s=HEARTBEAT_S))
    runtime.labels.update(labels)
    with runtime.stop_on_signals():
        try:
            runtime.start()
            if blob_ids:
                runtime.publish(Reference(step=0, holder=node_id, blob_ids=blob_ids))
            print(json.dumps({"process": incarnation(runtime.info())}), flush=True)
            runtime.loop()
        finally:
            runtime.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:])
