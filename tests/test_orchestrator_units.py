"""Orchestrator pieces without a cluster: replica routing, trainer addressing, where a blob's store is asked."""

from __future__ import annotations

import pytest
from refbus.nodes.payload.shipping import ReplicaRouter, TrainerAddress, TrainSink, group_by_endpoint, registry_locator
from refbus.protocol.messages import BlobRef, NodeInfo


def _env(node_id: str, source: str | None, endpoint: str) -> NodeInfo:
    labels = {"source": source} if source else {}
    return NodeInfo(node_id=node_id, role="env-server", host="h", pid=1, endpoints={"blobs": endpoint},
                    labels=labels)


def test_runs_go_to_the_replica_of_their_source_with_the_fewest_in_flight() -> None:
    router = ReplicaRouter()
    router.update([
        _env("a0", "A", "tcp://a0"), _env("a1", "A", "tcp://a1"), _env("solo", None, "tcp://solo"),
        NodeInfo(node_id="r", role="rollout", host="h", pid=2, endpoints={"generate": "tcp://r"}),
    ])
    assert router.replicas == {"A": ["tcp://a0", "tcp://a1"], "solo": ["tcp://solo"]}
    picks = [router.pick("A") for _ in range(4)]
    assert sorted(picks) == ["tcp://a0", "tcp://a0", "tcp://a1", "tcp://a1"]
    router.done("tcp://a1")
    assert router.pick("A") == "tcp://a1"  # a1 has one in flight now, a0 two
    router.done("tcp://never-picked")  # harmless
    assert router.in_flight["tcp://never-picked"] == 0
    with pytest.raises(LookupError, match="no live env-server replica for source 'B'"):
        router.pick("B")


def test_trainer_addresses_come_from_registry_labels_and_are_checked() -> None:
    node = NodeInfo(node_id="t1", role="trainer", host="h", pid=3, endpoints={"trainer": "tcp://t1"},
                    labels={"rank": "1", "data_rank": "0", "leader": "0"})
    assert TrainerAddress.from_node(node) == TrainerAddress("tcp://t1", 1, 0, leader=False)
    sink = TrainSink(holder=None, seq_len=64, max_staleness=1)  # type: ignore[arg-type]
    sink.use_trainers([TrainerAddress("tcp://t1", 1, 0, leader=False), TrainerAddress("tcp://t0", 0, 0)])
    assert [t.endpoint for t in sink.trainers] == ["tcp://t0", "tcp://t1"]  # leader first
    assert sink.data_ranks == 1
    with pytest.raises(ValueError, match="exactly one leader"):
        sink.use_trainers([TrainerAddress("tcp://t0", 0, 0), TrainerAddress("tcp://t1", 1, 0)])
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        sink.use_trainers([TrainerAddress("tcp://t0", 0, 1)])


def _ref(blob_id: str, endpoint: str, node: str = "") -> BlobRef:
    return BlobRef(endpoint=endpoint, source="s", blob_id=blob_id, fields=["topk_ids"], tokens=1, nbytes=4, checksum=0,
                   node=node)


def test_claims_and_deletes_go_to_where_the_registry_says_the_store_is_now() -> None:
    """A store restarted on another port is asked at its new endpoint; a reference without a node, or whose store
    the registry does not list live, at the endpoint recorded at keep time."""
    moved, kept, unnamed = _ref("a", "tcp://old:1", "env-0"), _ref("b", "tcp://old:2", "env-1"), _ref("c", "tcp://old:3")
    also_moved = _ref("d", "tcp://old:1", "env-0")
    registry = {("env-0", "blobs"): "tcp://new:9"}
    locate = registry_locator(lambda node, name: registry.get((node, name)))
    assert group_by_endpoint([moved, kept, unnamed, also_moved], locate) == {
        "tcp://new:9": [moved, also_moved], "tcp://old:2": [kept], "tcp://old:3": [unnamed]}
    assert group_by_endpoint([moved, kept]) == {"tcp://old:1": [moved], "tcp://old:2": [kept]}
