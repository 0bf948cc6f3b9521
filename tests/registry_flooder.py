"""A peer flooding the broker's registry: registers node ids ``flood-0``, ``flood-1``, ... (role ``flood``) as fast
as the broker answers, proves them all live with one PUB probe (they share one sync token) and heartbeats every
one it registered, until it is killed. Prints one JSON line once the broker refused a hello (the registry is
full): ``{"registered": n, "refused": code}``; it goes on flooding after that.

``python tests/registry_flooder.py CONTROL``
"""

from __future__ import annotations

import itertools
import json
import sys

import zmq
from refbus.bus.sockets import make_socket
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Error, Heartbeat, Hello, NodeInfo, Sync, Welcome

WINDOW = 64  # hellos in flight at once
ANSWER_MS = 10_000
TOKEN = "flood-token"


def main(control: str) -> None:
    ctx = zmq.Context()
    codec = WireCodec("flooder")
    sock = make_socket(ctx, zmq.DEALER, connect=control)
    registered: list[str] = []
    told = False
    ids = (f"flood-{i}" for i in itertools.count())
    pub = None
    while True:
        asked: dict[str, str] = {}  # hello's message id -> the node id it registers
        for node_id in itertools.islice(ids, WINDOW):
            asked[msg_id := codec.new_id()] = node_id
            sock.send_multipart(codec.encode(Hello(node=NodeInfo(node_id=node_id, role="flood", host="flood", pid=1),
                                                   token=TOKEN), msg_id=msg_id))
        for node_id in registered:
            sock.send_multipart(codec.encode(Heartbeat(node_id=node_id)))
        refused = ""
        for _ in range(WINDOW + len(registered)):
            if not sock.poll(ANSWER_MS):
                raise SystemExit("the broker did not answer")
            reply = codec.decode(sock.recv_multipart())
            body = reply.body
            if isinstance(body, Welcome):
                registered.append(asked[reply.header.re])
                if pub is None:
                    pub = make_socket(ctx, zmq.PUB, connect=body.events_in)
            elif isinstance(body, Error) and body.request_kind == Hello.kind:
                refused = body.code
        if pub is not None:
            pub.send_multipart(codec.encode(Sync(token=TOKEN), seq=0))
        if refused and not told:
            told = True
            print(json.dumps({"registered": len(registered), "refused": refused}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
