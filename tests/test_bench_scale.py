"""The scale bench: its model's arithmetic, its headroom rule, its simulated subscribers (every one a live
subscription that hears what it subscribed to) and a tiny sweep end to end, topic-filtered and whole-stream in
one pool, each count against the bare proxy (real broker, simulated nodes, orchestrator and fan-out processes,
all reaped)."""

from __future__ import annotations

import dataclasses
import math

from refbus.bus.runtime import NodeRuntime, RuntimeSettings

from bench.harness import WAIT_S, workers
from bench.scale import (
    Model,
    Point,
    Settings,
    broker_cost,
    broker_task,
    compare,
    fanout_task,
    format_comparison,
    format_report,
    headroom,
)


def point(nodes: int, p99_ms: float, delivered_share: float = 1.0) -> Point:
    return Point(nodes=nodes, offered_per_s=100.0 * nodes, delivered_per_s=100.0 * nodes * delivered_share,
                 broker_cpu_us=3.0, broker_core=0.01 * nodes, subscribers=nodes + 18, peer_trackers=0, fanout_core=0.1,
                 nodes_core=0.1, p50_ms=1.0, p99_ms=p99_ms, orchestrator_cpu_us_per_episode=100.0, proxy_cpu_us=1.5,
                 proxy_forwarded=1000)


def test_the_model_runs_rates_follow_from_its_documented_arithmetic() -> None:
    model = Model()
    # 1,024 episodes a step over 64 nodes every 26 s, 4 blobs x 5 events an episode, bursts of 4x the average.
    assert math.isclose(model.events_per_node_s, 1024 / 64 / 26 * 20 * 4)
    assert model.events_per_episode == 20


def test_headroom_is_the_largest_count_sustained_with_p99_under_50_ms_and_the_events_delivered() -> None:
    points = [point(64, 5.0), point(128, 20.0), point(192, 49.0, delivered_share=0.9), point(256, 80.0)]
    assert headroom(points, 64) == 2.0  # 192 delivered too little, 256 was too slow
    assert headroom(points, 256) == 0.5
    assert headroom([point(16, 60.0)], 64) == 0.0
    assert points[0].vs_proxy == 2.0


def test_the_brokers_cost_is_fitted_to_event_copies_over_the_counts_sustained() -> None:
    def on_the_line(nodes: int) -> Point:  # 5% of a core idle, 2 us per copy of an event sent
        copies = 100.0 * nodes * (nodes + 18)
        return dataclasses.replace(point(nodes, 5.0), broker_core=0.05 + 2e-6 * copies)

    starved = dataclasses.replace(point(128, 900.0), broker_core=0.01)  # not sustained: left out of the fit
    idle, per_copy = broker_cost([on_the_line(16), on_the_line(32), on_the_line(64), starved])
    assert math.isclose(idle, 0.05, abs_tol=1e-9) and math.isclose(per_copy, 2e-6)


def test_every_simulated_subscription_is_live_and_hears_what_it_subscribed_to() -> None:
    """Three whole-stream subscriptions and four peer trackers in one process: each one must be a socket of its
    own that stays open (not one survivor), and each tracker must hear a node-up (subscribed to every topic it
    names, not only the last one set)."""
    with workers("scale-test-broker", "scale-test-fanout") as (broker, fanout):
        broker.submit(broker_task)
        endpoints = broker.message()
        fanout.submit(fanout_task, endpoints["events_in"], endpoints["events_out"], 3, 4, True)
        assert fanout.message(WAIT_S + 5) == "ready"  # every subscription received a probe (or its error)
        node = NodeRuntime("orchestrator", RuntimeSettings(bus=endpoints["control"], node_id="scale-test-node",
                                                           metrics_port=-1))
        try:
            node.start()  # joins: its sync probes and the broker's node-up for it go to the subscriptions
        finally:
            node.close()  # its node-down too
        fanout.tell("stop")
        heard = fanout.result()
        broker.tell("go")
        broker.tell("stop")
        broker.result()
    assert heard["whole_heard"] == 3
    assert len(heard["registry_heard"]) == 4 and min(heard["registry_heard"]) >= 1


def test_a_tiny_sweep_measures_every_figure_against_the_bare_proxy_and_compares_the_trackers() -> None:
    model = Model()
    filtered, whole = compare(model, Settings(sizes=(2,), warmup_s=0.1, window_s=0.3))
    (measured,) = filtered
    assert measured.nodes == 2 and measured.delivered_per_s > 0 and measured.fanout_core > 0 < measured.nodes_core
    assert (measured.subscribers, measured.peer_trackers) == (2, 2 + model.trainer_ranks)
    assert 0 < measured.p50_ms <= measured.p99_ms and measured.broker_core > 0
    assert measured.orchestrator_cpu_us_per_episode > 0
    assert measured.proxy_forwarded > 0  # the baseline ran: the same nodes through the bare proxy
    assert math.isfinite(measured.vs_proxy) and measured.vs_proxy > 0  # both read CPU spent after go
    report = format_report(filtered, model)
    assert "projected to 64 nodes" in report and "projected to 256 nodes" in report and "x proxy" in report
    assert (whole[0].subscribers, whole[0].peer_trackers) == (2 + 2 + model.trainer_ranks, 0)
    assert whole[0].proxy_forwarded > 0
    assert "on the whole stream" in format_report(whole, model, filtered=False)
    comparison = format_comparison(filtered, whole)
    assert "whole / filtered" in comparison and "headroom over 64" in comparison
