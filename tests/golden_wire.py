"""Golden wire fixtures: the messages frozen in ``tests/fixtures/wire_v<major>/`` and the bodies they hold.

One JSON file per message: ``{"version": [major, minor], "kind", "secret", "frames": [hex, ...]}``, encoded by
``WireCodec("golden-node")`` with message id :data:`MSG_ID` at time :data:`TS`, unsigned and signed with
``golden-secret``. Fixtures of an earlier major are never rewritten: they are what an old peer sends. Those of
the current major pin the wire: after a deliberate wire change, bump the version and freeze the new ones with
``python tests/golden_wire.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from refbus.protocol.envelope import PROTOCOL_VERSION, MessageIds, WireCodec
from refbus.protocol.messages import BlobRef, Body, Claim, Delete, EpisodeFinished, Hello, Keep, NodeInfo
from refbus.protocol.messages_ps import ByteRange, ShardOpen

FIXTURES = Path(__file__).parent / "fixtures"
MSG_ID = "0123456789ab-1"
TS = 1_800_000_000.5
SECRET = b"golden-secret"
SRC = "golden-node"

_INFO = NodeInfo(node_id="env-0", role="env-server", host="h1", pid=4242,
                 endpoints={"blobs": "tcp://127.0.0.1:7001"}, labels={"source": "env"}, started=TS)
_REF = BlobRef(endpoint="tcp://127.0.0.1:7001", source="env", blob_id="e1-0", fields=["topk_ids"], tokens=3,
               nbytes=24, checksum=12345)

CASES: dict[str, tuple[Body, dict[str, Any]]] = {
    "hello": (Hello(node=_INFO, token="tok-1"), {}),
    "keep": (Keep(episode_id="e1", branches=[{"topk_ids": np.arange(6, dtype=np.int32).reshape(3, 2),
                                              "mask_counts": np.array([1, 2, 3], dtype=np.uint8)}],
                  policy_version=7, info={"reward": 1.5}), {}),
    "claim": (Claim(blob_ids=["e1-0", "e1-1"], holder="orchestrator"), {}),
    "delete": (Delete(blob_ids=["e1-0"], holder="trainer-0", reason="trained"), {}),
    "episode-finished": (EpisodeFinished(episode_id="e1", source="env", refs=[_REF]), {"seq": 3, "one_frame": True}),
    # With its optional tensor ranges: older workers ignore them (docs/PROTOCOL.md, "Versions and negotiation").
    "ps-shard-open": (ShardOpen(lease="L-1", nbytes=4096, tensors=[ByteRange(0, 1024), ByteRange(1024, 3072)]), {}),
    # Three events of one kind in the batch form (protocol 2.2), numbered seq, seq + 1, ...; ids MSG_ID's
    # incarnation with counters 1, 2, 3.
    "delete-batch": (Delete(blob_ids=["e1-0"], holder="trainer-0", reason="trained"), {"seq": 5, "batch": 3}),
}


def name(case: str, signed: bool) -> str:
    return f"{case}-signed" if signed else case


def load(major: int, case: str, signed: bool = False) -> list[bytes]:
    record = json.loads((FIXTURES / f"wire_v{major}" / f"{name(case, signed)}.json").read_text())
    return [bytes.fromhex(frame) for frame in record["frames"]]


def encode(case: str, signed: bool) -> list[bytes]:
    """``case`` as this build encodes it (the caller pins ``time.time`` to :data:`TS`)."""
    body, options = CASES[case]
    codec = WireCodec(SRC, secret=SECRET if signed else b"")
    if "batch" in options:
        codec._ids = MessageIds(MSG_ID.partition("-")[0])
        items = [codec.batch_item(body, options["seq"] + n) for n in range(options["batch"])]
        frames = codec.encode_batch(body.kind, [item for item in items if item is not None])
    else:
        frames = codec.encode(body, msg_id=MSG_ID, **options)
    return [bytes(memoryview(frame)) for frame in frames]


def freeze() -> Path:
    """Write the current major's fixtures (``time.time`` pinned to :data:`TS` while encoding)."""
    from refbus.protocol import envelope

    out = FIXTURES / f"wire_v{PROTOCOL_VERSION[0]}"
    out.mkdir(parents=True, exist_ok=True)
    clock, envelope.time.time = envelope.time.time, lambda: TS
    try:
        for case, (body, _) in CASES.items():
            for signed in (False, True):
                record = {"version": list(PROTOCOL_VERSION), "kind": body.kind, "secret": SECRET.decode() if signed
                          else "", "frames": [frame.hex() for frame in encode(case, signed)]}
                (out / f"{name(case, signed)}.json").write_text(json.dumps(record, indent=1) + "\n")
    finally:
        envelope.time.time = clock
    return out


if __name__ == "__main__":
    sys.exit(print(f"froze {freeze()}"))
