"""A client process for the cross-host tests, run inside one namespace host (bench/hosts.py):

    python host_probe.py blobs --endpoint EP --seed S   # keep, claim, fetch, delete on an env server
    python host_probe.py scrape --sd URL --node ID      # a node's metrics, found through the broker's /sd

Prints one JSON object on stdout; exits non-zero with the reason on stderr when a step fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import urllib.request
from typing import Any

import numpy as np
import zmq
from branches import random_arrays
from refbus.bus.reqrep import Client, RetryPolicy
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import Blobs, Claim, Claimed, Delete, Deleted, Fetch, Keep, Kept

TIMEOUT_S = 10.0
BRANCH_TOKENS = (300, 7)


def branches(seed: int) -> list[dict[str, np.ndarray]]:
    """The arrays a probe keeps (the test builds the same ones to compare)."""
    return [random_arrays(tokens, seed=seed + i, routing_dtype=np.uint16) for i, tokens in enumerate(BRANCH_TOKENS)]


def digest(arrays: dict[str, np.ndarray]) -> str:
    """Names, dtypes, shapes and bytes of a branch: equal digests mean byte-identical arrays."""
    h = hashlib.sha256()
    for name, array in arrays.items():
        h.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def blobs(endpoint: str, seed: int) -> dict[str, Any]:
    ctx = zmq.Context()
    client = Client(ctx, endpoint, WireCodec("probe"), policy=RetryPolicy(timeout_s=TIMEOUT_S, attempts=1))
    try:
        kept = client.request(Keep(episode_id=f"probe-{seed}", branches=branches(seed))).body
        assert isinstance(kept, Kept), kept
        ids = [ref.blob_id for ref in kept.refs]
        claimed = client.request(Claim(blob_ids=ids, holder="probe-orchestrator")).body
        assert claimed == Claimed(blob_ids=ids), claimed
        fetched = client.request(Fetch(blob_ids=ids, holder="probe-trainer")).body
        assert isinstance(fetched, Blobs) and not fetched.missing, fetched
        deleted = client.request(Delete(blob_ids=ids, holder="probe-trainer", reason="trained")).body
        assert deleted == Deleted(blob_ids=ids), deleted
        return {"endpoints": [ref.endpoint for ref in kept.refs],
                "digests": [digest(blob.arrays) for blob in fetched.blobs]}
    finally:
        client.close()
        ctx.destroy(linger=0)


def scrape(sd: str, node: str) -> dict[str, Any]:
    with urllib.request.urlopen(sd, timeout=TIMEOUT_S) as response:
        groups = json.loads(response.read())
    (group,) = [g for g in groups if g["labels"]["node"] == node]
    (target,) = group["targets"]
    with urllib.request.urlopen(f"http://{target}{group['labels']['__metrics_path__']}", timeout=TIMEOUT_S) as page:
        return {"target": target, "metrics": page.read().decode()}


def main() -> int:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    keep = commands.add_parser("blobs")
    keep.add_argument("--endpoint", required=True)
    keep.add_argument("--seed", type=int, default=0)
    sd = commands.add_parser("scrape")
    sd.add_argument("--sd", required=True)
    sd.add_argument("--node", required=True)
    args = parser.parse_args()
    result = blobs(args.endpoint, args.seed) if args.command == "blobs" else scrape(args.sd, args.node)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
