"""A holder on a host that gets cut off: a registered node that keeps one episode on an env server, claims its
blobs, and once the broker has forgotten it and it joined again (the same process, back from a partition)
claims and deletes those blobs once more, as a holder that never noticed it was away would.

``python tests/partition_holder.py CONTROL NODE_ID ENDPOINT``

Prints one JSON line when it holds the blobs (``{"held": [...]}``) and one with the store's answers to its
stale claim and delete after it joined again (``{"claim": {...}, "delete": {...}}``); logs go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
from branches import random_arrays
from refbus.bus.logs import configure_logging
from refbus.bus.reqrep import Outcome, RemoteError
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.protocol.messages import Claim, Claimed, Delete, Keep, Kept

HEARTBEAT_S = 0.2  # the tests' FAST_LIVENESS heartbeat
ANSWER_S = 5.0  # each stale request's deadline: the store is live again when they are sent
CHECK_S = 0.05


def _answer(outcome: Outcome) -> dict[str, Any]:
    if isinstance(outcome, RemoteError):
        return {"error": outcome.code, "detail": outcome.detail}
    if isinstance(outcome, Exception):
        return {"error": type(outcome).__name__, "detail": str(outcome)}
    return {"reply": outcome.kind, **msgspec.to_builtins(outcome.body)}


def main(control: str, node_id: str, endpoint: str) -> None:
    configure_logging(level="warning")  # stdout carries the JSON lines
    runtime = NodeRuntime("holder", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1,
                                                    heartbeat_interval_s=HEARTBEAT_S))
    answers: dict[str, dict[str, Any]] = {}

    def report(name: str, outcome: Outcome) -> None:
        answers[name] = _answer(outcome)
        if len(answers) == 2:
            print(json.dumps(answers), flush=True)

    with runtime.stop_on_signals():
        try:
            runtime.start()
            client = runtime.client(endpoint)
            kept = client.request(Keep(episode_id=f"{node_id}-episode",
                                       branches=[random_arrays(tokens, seed=tokens) for tokens in (40, 9)])).body
            assert isinstance(kept, Kept), kept
            ids = [ref.blob_id for ref in kept.refs]
            claimed = client.request(Claim(blob_ids=ids, holder=node_id)).body
            assert isinstance(claimed, Claimed) and claimed.blob_ids == ids, claimed
            print(json.dumps({"held": ids}), flush=True)
            joined = runtime.welcome

            def after_rejoin() -> None:
                nonlocal joined
                if joined is None or runtime.welcome is joined:
                    return
                joined = None  # once: the stale requests of a holder that never knew it was away
                runtime.calls.request(endpoint, Claim(blob_ids=ids, holder=node_id),
                                      lambda outcome: report("claim", outcome), deadline_s=ANSWER_S)
                runtime.calls.request(endpoint, Delete(blob_ids=ids, holder=node_id, reason="trained"),
                                      lambda outcome: report("delete", outcome), deadline_s=ANSWER_S)

            runtime.every(CHECK_S, after_rejoin)
            runtime.loop()
        finally:
            runtime.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
