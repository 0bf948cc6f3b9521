"""The bus bench's broker figures: the bare ``zmq_proxy`` baseline counts what it forwards from ``go``, CPU is
split by thread correctly and read finer than clock ticks, and a quick events section prints the broker's CPU
as a ratio to the baseline's, each forwarder having forwarded at least what its subscriber counted."""

from __future__ import annotations

import threading
import time

import zmq
from refbus.bus.pubsub import BATCH_EVENTS

from bench import bus
from bench.harness import workers

POLL_MS = 5000


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_charges_a_busy_thread_to_its_role_and_not_to_the_loop() -> None:
    before = bus.thread_cpu()
    busy = threading.Thread(target=_burn, args=(0.3,))
    busy.start()
    busy.join()  # ended: its CPU is not in a later reading (nor should it be: it ended before "after")
    burnt, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (_burn(0.3), burnt.set(), release.wait(POLL_MS / 1000)))
    worker.start()
    assert burnt.wait(POLL_MS / 1000), "the worker thread never finished burning"
    spent = bus._spent(before, bus.thread_cpu())  # burnt, still alive
    release.set()
    worker.join()
    assert spent["proxy"] >= 0.25
    assert spent["loop"] < 0.25


def test_thread_cpu_reads_a_few_milliseconds_not_whole_clock_ticks() -> None:
    """A thread that burns 3 ms reads about 3 ms: clock ticks (10 ms) would read 0 or 10 ms."""
    before = bus.thread_cpu()
    burnt, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (_burn(0.003), burnt.set(), release.wait(POLL_MS / 1000)))
    worker.start()
    assert burnt.wait(POLL_MS / 1000), "the worker thread never finished burning"
    spent = bus._spent(before, bus.thread_cpu())
    release.set()
    worker.join()
    assert 0.003 <= spent["proxy"] < 0.008


def test_the_bare_proxy_forwards_every_event_and_counts_each_once() -> None:
    with workers("bench-proxy") as (worker,):
        worker.submit(bus.bare_proxy_node)
        endpoints = worker.message()
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.subscribe(b"")
            sub.connect(endpoints["events_out"])
            pub = ctx.socket(zmq.PUB)
            pub.linger = 0
            pub.connect(endpoints["events_in"])
            probes = 0
            while True:  # until the subscription reached the publisher through the proxy
                pub.send(b"probe")
                probes += 1
                if sub.poll(20):
                    break
                assert probes < POLL_MS // 20, "the subscription never came through the proxy"
            for order in ("quiesce", "go", "quiesce"):  # every probe forwarded before go; go taken before the events
                worker.tell(order)
            for _ in range(2):
                assert worker.message() == "quiet"
            received: list[bytes] = []
            for index in range(500):
                pub.send(b"event-%d" % index)
            while len([m for m in received if m.startswith(b"event-")]) < 500:
                assert sub.poll(POLL_MS), "the proxy stopped forwarding"
                received.append(sub.recv())
            worker.tell("quiesce")
            assert worker.message() == "quiet"
            worker.tell("stop")
            figures = worker.result()
        finally:
            ctx.destroy(linger=0)
    assert [m for m in received if m.startswith(b"event-")] == [b"event-%d" % i for i in range(500)]
    assert figures["forwarded"] == 500  # counted from go: none of the probes before it
    assert "loop" not in figures["threads_s"]  # the bench's own orders are not the proxy's cost
    assert figures["threads_s"]["proxy"] > 0 and figures["threads_s"]["zmq-io"] > 0  # each forwarded the 500


def test_a_quick_events_section_prints_the_broker_against_the_bare_proxy() -> None:
    rows, extra = bus.run(bus.QUICK, ["events"])
    row = next(r for r in rows if r.metric == "CPU per forwarded event (vs bare zmq_proxy)")
    assert row.refbus == extra["broker"]["cpu_us_per_event"] and row.baseline == extra["proxy"]["cpu_us_per_event"]
    # Each forwarder forwarded at least what the subscriber counted through it (the rate windows only).
    counted = {name: sum(extra["rates"][f"{name}{pubs}"]["count"] for pubs in ("", "2"))
               for name in ("brokered", "proxied")}
    assert extra["broker"]["forwarded"] >= counted["brokered"] > 0
    assert extra["proxy"]["forwarded"] >= counted["proxied"] > 0
    assert {"loop", "proxy", "zmq-io"} <= extra["broker"]["threads_us_per_event"].keys()
    # The batch form twice: against raw single frames (the goal's baseline) and raw batched the same way.
    batch_form = f"events/s, 1 pub -> 1 sub, {BATCH_EVENTS} a turn"
    against_frames, against_batches = (r for r in rows if r.metric.startswith(batch_form))
    assert against_frames.goal == 0.25 and against_frames.baseline == extra["rates"]["raw"]["per_s"]
    assert against_batches.goal is None and against_batches.refbus == against_frames.refbus
    assert against_batches.baseline == extra["rates"]["raw_batched"]["per_s"] > 0
    printed = bus.format_cpu(extra)
    assert "x the bare zmq_proxy's" in printed and "goal <= 3 us" in printed
    assert "proxy  by thread" in printed and "broker by thread" in printed
