"""A registered node that serves requests and can be SIGKILLed: binds its ``rpc`` endpoint on an ephemeral port
(as ``refbus up`` nodes do, so every restart advertises a new endpoint), prints that endpoint (one JSON line) once
it is registered, then answers ``claim`` requests (nothing is ever kept: every id is ``missing``) until it is
killed or stopped.

``python tests/served_peer.py CONTROL NODE_ID``
"""

from __future__ import annotations

import json
import sys

from refbus.bus.logs import configure_logging
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.protocol.envelope import Message
from refbus.protocol.messages import Claimed

HEARTBEAT_S = 0.2  # the tests' FAST_LIVENESS heartbeat


def nothing_kept(request: Message) -> Claimed:
    return Claimed(blob_ids=[], missing=list(request.body.blob_ids))


def main(control: str, node_id: str) -> None:
    configure_logging(level="warning")  # stdout carries the one JSON line; logs go to stderr
    runtime = NodeRuntime("served-peer", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                         heartbeat_interval_s=HEARTBEAT_S))
    server = runtime.serve("rpc", "tcp://127.0.0.1:0")
    server.on("claim", nothing_kept)
    with runtime.stop_on_signals():
        try:
            runtime.start()
            print(json.dumps({"endpoint": runtime.endpoints["rpc"]}), flush=True)
            runtime.loop()
        finally:
            runtime.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
