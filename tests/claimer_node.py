"""A holder that can be SIGKILLed: a registered node that claims blobs from an env server, prints what it was
granted (one JSON line), then serves heartbeats until it is killed or stopped.

``python tests/claimer_node.py CONTROL NODE_ID ENDPOINT BLOB_ID...``
"""

from __future__ import annotations

import json
import sys

from refbus.bus.logs import configure_logging
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.protocol.messages import Claim, Claimed

HEARTBEAT_S = 0.2  # the tests' FAST_LIVENESS heartbeat


def main(control: str, node_id: str, endpoint: str, blob_ids: list[str]) -> None:
    configure_logging(level="warning")  # stdout carries the one JSON line; logs go to stderr
    runtime = NodeRuntime("claimer", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                     heartbeat_interval_s=HEARTBEAT_S))
    with runtime.stop_on_signals():
        try:
            runtime.start()
            reply = runtime.client(endpoint).request(Claim(blob_ids=blob_ids, holder=node_id)).body
            assert isinstance(reply, Claimed)
            print(json.dumps({"granted": reply.blob_ids, "missing": reply.missing}), flush=True)
            runtime.loop()
        finally:
            runtime.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
