"""Bus benchmarks: refbus against raw pyzmq doing the same, measured in the same run.

Four comparisons, each printed as refbus / baseline with its goal:

1. **envelope**: events/s of ``Publisher.publish`` (encode, send) -> ``Subscriber.recv`` (decode and
   validate each event) with a ~100-byte ``delete`` body, against raw pyzmq PUB->SUB of 100-byte single
   frames: as a node's loop sends them (``BATCH_EVENTS`` events published in one turn travel as one message
   in the batch form; goal >= 25%, set against that baseline), and one event a message (what a publisher
   outside a loop turn sends; no goal). The batch form again, without a goal, against raw pyzmq batched the
   same way: ``BATCH_EVENTS`` 100-byte events sent as one frame, which the receiver splits into its events,
   so the row shows the envelope's cost apart from what batching saves. A stage profile says where the
   microseconds of one event a message go.
2. **broker**: events/s of N = 1 and 2 publishers (``NodeRuntime`` nodes that completed the broker
   handshake) through a broker process (``NodeRuntime`` + ``Broker``, as ``refbus node bus`` runs it) to a
   subscriber, against the same publishers sending the same envelopes straight to the subscriber
   (goal >= 80%); and the broker process's CPU per forwarded event over the whole section (goal <= 3 us),
   as a ratio to a bare ``zmq_proxy`` process (XSUB -> XPUB with the broker's socket options, nothing else)
   that forwards the same publishers' events to the same subscriber in the same run, with each process's
   CPU split by thread (loop, ZeroMQ I/O, proxy).
   Publishers run at the lowest CPU priority: on a 2-core machine a PUB socket that never
   blocks would otherwise take a core from the broker or the subscriber and the ratio would measure the
   scheduler, not the broker.
3. **rpc**: round-trip p50/p99 of ``Client.request`` (``fetch`` -> ``ok``) against a ``Server``, plain and
   hosted in a ``NodeRuntime`` loop, against a raw DEALER->ROUTER round trip of the same byte counts on
   sockets with the same options (goal p50 <= 1.2x). The three are interleaved in small blocks so they see
   the same machine; each side's CPU per round trip is printed too (less distorted by other load).
4. **bulk**: GB/s of one 1, 16 and 64 MiB array per message (encode with checksum, zero-copy send,
   ``recv_frames``, decode with checksum verify) against raw zero-copy send/recv of the same buffer
   (goal >= 80%).

Senders and receivers run in separate spawned worker processes over loopback TCP on ephemeral ports; every
wait is bounded and every worker is reaped. Event rates are counted by the receiver over a fixed window
after a warm-up, so a PUB socket dropping at its high-water mark only shows the slower side's capacity.
Throughputs are the best of several interleaved rounds (other load on the machine only ever slows a run).
Workers, timing and the table come from ``bench.harness``.

    python -m bench.bus [--quick] [--json PATH] [--only events|rpc|bulk]
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import zmq
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.pubsub import BATCH_EVENTS, Publisher, Subscriber
from refbus.bus.reqrep import Client, Server
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import (
    EVENT_HWM,
    EVENT_OPTIONS,
    SocketOptions,
    bound_endpoint,
    make_socket,
    readable,
    recv_frames,
    recv_routed,
    send_frames,
    wildcard_port,
)
from refbus.protocol.envelope import MIN_FRAMES, Message, WireCodec
from refbus.protocol.messages import Blobs, Body, Bye, Delete, Fetch, FetchedBlob, Ok, Sync

from bench.harness import (
    MIB,
    WAIT_S,
    BenchError,
    Channel,
    Rate,
    Row,
    Worker,
    best_rates,
    figures,
    format_table,
    gc_paused,
    lower_priority,
    parse_args,
    run_line,
    seconds_each,
    timed_us,
    workers,
    write_json,
)

Flavor = Literal["raw", "refbus"]
RpcFlavor = Literal["raw", "refbus", "runtime"]

LOOPBACK = "tcp://127.0.0.1:0"
RAW_EVENT_BYTES = 100
BATCH = 256  # messages between clock reads / stop checks in hot loops
WAIT_MS = int(WAIT_S * 1000)
QUIET_S = 0.1  # a broker that forwarded nothing for this long has drained its backlog
BULK_HWM = 2  # messages queued per bulk socket: bounds memory at 64 MiB messages
BULK_MIN_MESSAGES = 4
BULK_SIZES_MIB = (1, 16, 64)
CPU = time.thread_time
RPC_GOAL = 1.2  # p50 round trip, at most this multiple of raw pyzmq's
BROKER_CPU_GOAL_US = 3.0  # broker process CPU per forwarded event


@dataclass(frozen=True)
class Settings:
    """How long each measurement runs."""

    rounds: int  # interleaved repetitions of each throughput measurement; the best counts
    warmup_s: float  # events received and discarded before a rate window opens
    window_s: float  # length of an event-rate window
    rtt_warmup: int  # untimed round trips per flavor
    rtt_samples: int  # timed round trips per flavor
    rtt_block: int  # consecutive round trips of one flavor before switching to the next
    bulk_bytes: int  # bytes per bulk measurement (at least BULK_MIN_MESSAGES messages)
    profile_events: int


FULL = Settings(rounds=2, warmup_s=0.2, window_s=1.0, rtt_warmup=200, rtt_samples=3000, rtt_block=100,
                bulk_bytes=768 * MIB, profile_events=20_000)
QUICK = Settings(rounds=1, warmup_s=0.05, window_s=0.2, rtt_warmup=20, rtt_samples=300, rtt_block=50,
                 bulk_bytes=64 * MIB, profile_events=2_000)


# --- the workers of one run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """The workers of one run: ``rx`` receives (or serves), ``tx`` sends (or calls); ``pubs`` are the
    low-priority publishers of the broker comparison; ``broker`` runs the broker and ``aux`` the bare proxy
    (its baseline), then each one of the rpc servers."""

    rx: Worker
    tx: Worker
    pubs: tuple[Worker, Worker]
    broker: Worker
    aux: Worker


@contextlib.contextmanager
def pool() -> Iterator[Pool]:
    """A :class:`Pool` of freshly spawned workers, reaped on exit."""
    with workers("bench-rx", "bench-tx", "bench-pub0", "bench-pub1", "bench-broker", "bench-aux") as started:
        rx, tx, pub0, pub1, broker, aux = started
        for pub in (pub0, pub1):
            pub.call(lower_priority)
        yield Pool(rx, tx, (pub0, pub1), broker, aux)


# --- sockets and bodies ------------------------------------------------------------------------------


def _event_body() -> Delete:
    """A realistic small event: ~100 bytes of msgpack body."""
    return Delete(blob_ids=[f"env-0-ep-{i:06d}-b0" for i in range(3)], holder="trainer-0", reason="trained")


def _fetch_body() -> Fetch:
    return Fetch(blob_ids=["env-0-ep-000001-b0"], holder="trainer-0")


def _raw_socket(ctx: zmq.Context, socket_type: int, hwm: int) -> zmq.Socket:
    sock = ctx.socket(socket_type)
    sock.linger = 0
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    return sock


def _socket(ctx: zmq.Context, flavor: Flavor, socket_type: int, hwm: int = EVENT_HWM) -> zmq.Socket:
    """A raw pyzmq socket, or one from refbus's factory, with the same high-water marks."""
    if flavor == "raw":
        return _raw_socket(ctx, socket_type, hwm)
    return make_socket(ctx, socket_type, options=SocketOptions(sndhwm=hwm, rcvhwm=hwm))


def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
    """Bind (ephemeral ports allowed) or connect ``sock``; returns the endpoint peers should use."""
    if bind:
        sock.bind(wildcard_port(endpoint))
        return bound_endpoint(sock)
    sock.connect(endpoint)
    return endpoint


# --- tasks: events -----------------------------------------------------------------------------------


def event_receiver(ch: Channel, flavor: Flavor, endpoint: str, bind: bool, warmup_s: float, window_s: float,
                   batch: int = 1) -> Rate:
    """Subscribe, report the endpoint, then count events over ``window_s`` after ``warmup_s``. ``batch`` > 1
    (raw only): each message holds that many ``RAW_EVENT_BYTES`` events in one frame, split into its events."""
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.SUB)
        sock.subscribe(b"")
        ch.send(_attach(sock, endpoint, bind))
        if flavor == "raw":
            sock.rcvtimeo = WAIT_MS

            def split() -> None:
                frame = sock.recv()
                if len([frame[i : i + RAW_EVENT_BYTES] for i in range(0, len(frame), RAW_EVENT_BYTES)]) != batch:
                    raise BenchError(f"a raw message of {len(frame)} bytes, not {batch} events")

            return _count_window(split if batch > 1 else sock.recv, warmup_s, window_s, batch)
        subscriber = Subscriber(sock, WireCodec("bench-sub"))

        def receive() -> None:
            if subscriber.recv(WAIT_MS) is None:
                raise BenchError(f"no event within {WAIT_S}s")

        return _count_window(receive, warmup_s, window_s)
    finally:
        ctx.destroy(linger=0)


def _count_window(receive: Callable[[], object], warmup_s: float, window_s: float, per_call: int = 1) -> Rate:
    """Events ``receive`` returns within ``window_s``, once ``warmup_s`` has passed since the first one.

    ``receive`` blocks for the next ``per_call`` events and raises if the stream stalls.
    """
    clock = time.perf_counter
    receive()
    count, elapsed, cpu = 0, 0.0, 0.0
    for length in (warmup_s, window_s):
        count, start, cpu = 0, clock(), time.process_time()
        while (elapsed := clock() - start) < length:
            for _ in range(BATCH):
                receive()
            count += BATCH * per_call
    return Rate(count, elapsed, cpu_s=time.process_time() - cpu)


def event_sender(ch: Channel, flavor: Flavor, endpoint: str, node_id: str, via_broker: bool, batch: int = 1) -> int:
    """Connect (or join the broker whose control endpoint is ``endpoint``), say ready, wait for go, then
    publish until stopped; returns how many were sent. ``batch`` > 1: a publisher publishes ``batch`` events
    per turn, as a node's loop turn does (:meth:`Publisher.batching`), so they travel as one message; raw, one
    frame of ``batch`` ``RAW_EVENT_BYTES`` events."""
    if via_broker:
        runtime = NodeRuntime("bench", RuntimeSettings(bus=endpoint, node_id=node_id, metrics_port=-1))
        try:
            runtime.start()  # hello + sync handshake: this node's PUB is proven live at the broker
            return _publish_until_stopped(ch, functools.partial(runtime.publish, _event_body()))
        finally:
            runtime.close()
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.PUB)
        sock.connect(endpoint)
        if flavor == "raw":
            return _publish_until_stopped(ch, functools.partial(sock.send, b"x" * RAW_EVENT_BYTES * batch), batch)
        publisher = Publisher(sock, WireCodec(node_id), batch_events=batch)
        body = _event_body()

        def turn() -> None:
            with publisher.batching():
                for _ in range(batch):
                    publisher.publish(body)

        return _publish_until_stopped(ch, turn if batch > 1 else functools.partial(publisher.publish, body), batch)
    finally:
        ctx.destroy(linger=0)


def _publish_until_stopped(ch: Channel, send: Callable[[], object], per_send: int = 1) -> int:
    """``send`` (``per_send`` events each call) until told to stop; returns how many events were sent."""
    ch.send("ready")
    ch.recv()  # go
    sent = 0
    calls = max(1, BATCH // per_send)
    while not ch.poll():
        for _ in range(calls):
            send()
        sent += calls * per_send
    return sent


def broker_node(ch: Channel) -> dict[str, Any]:
    """Run a broker (``NodeRuntime`` + ``Broker``, as ``refbus node bus`` does) until told to stop.

    The order ``quiesce`` runs it until its backlog is forwarded (nothing for ``QUIET_S``), then reports
    ``quiet``: a publisher that outran the subscriber leaves events queued in the broker's XSUB socket.
    Returns events forwarded, the broker process's CPU seconds and their split by thread (start-up excluded).
    """
    runtime = NodeRuntime("bus", RuntimeSettings(node_id="bench-bus", metrics_port=-1), register=False)
    # Publishers in this bench run no loop, so they never heartbeat: keep them registered throughout.
    settings = BrokerSettings(control=LOOPBACK, events_in=LOOPBACK, events_out=LOOPBACK, node_timeout_s=3600)
    broker = Broker(runtime, settings)
    try:
        runtime.start()
        cpu, threads = time.process_time(), thread_cpu()
        ch.send(dict(runtime.endpoints))
        while True:
            runtime.loop(until=ch.poll)
            if ch.recv() != "quiesce":
                return {"forwarded": broker.forwarded, "cpu_s": time.process_time() - cpu,
                        "threads_s": _spent(threads, thread_cpu())}
            runtime.loop(until=_quiet(lambda: broker.forwarded))
            ch.send("quiet")
    finally:
        runtime.close()


def bare_proxy_node(ch: Channel) -> dict[str, Any]:
    """The broker's baseline: ``zmq_proxy`` from an XSUB to an XPUB made with the broker's event socket
    options, on a thread of its own (as the broker's forwarder runs it) and nothing else: no capture, no ring,
    no loop. Steered only to count (``STATISTICS``) and to end. Same orders and result as :func:`broker_node`,
    but its CPU is the proxy's and ZeroMQ's threads only: the main thread runs this bench's orders. Counts
    from its start, or from the latest ``go`` order (as ``bench.scale``'s broker counts from its ``go``): what
    came before (subscribers' probes, connections being made) is not forwarding the run's events."""
    ctx = zmq.Context()
    try:
        xsub, xpub = (make_socket(ctx, kind, bind=LOOPBACK, options=EVENT_OPTIONS) for kind in (zmq.XSUB, zmq.XPUB))
        control, steer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        control.bind("inproc://bench-proxy-control")
        steer.connect("inproc://bench-proxy-control")
        proxy = threading.Thread(target=zmq.proxy_steerable, args=(xsub, xpub, None, control), daemon=True)
        proxy.start()

        def forwarded() -> int:
            steer.send(b"STATISTICS")
            return struct.unpack("=Q", steer.recv_multipart()[0])[0]  # frontend messages in

        threads, counted = thread_cpu(), forwarded()
        ch.send({"events_in": bound_endpoint(xsub), "events_out": bound_endpoint(xpub)})
        try:
            while True:
                while not ch.poll(QUIET_S):
                    pass
                order = ch.recv()
                if order == "go":
                    threads, counted = thread_cpu(), forwarded()
                    continue
                if order != "quiesce":
                    spent = _spent(threads, thread_cpu())
                    del spent["loop"]  # this bench's orders and counts, which a bare proxy would not run
                    return {"forwarded": forwarded() - counted, "cpu_s": sum(spent.values()), "threads_s": spent}
                quiet = _quiet(forwarded)
                while not quiet():
                    time.sleep(QUIET_S / 10)
                ch.send("quiet")
        finally:
            steer.send(b"TERMINATE")
            proxy.join(WAIT_S)
    finally:
        ctx.destroy(linger=0)


def _quiet(forwarded: Callable[[], int]) -> Callable[[], bool]:
    """True once the ``forwarded`` count has not moved for ``QUIET_S``."""
    last = [forwarded(), time.monotonic()]

    def quiet() -> bool:
        now, count = time.monotonic(), forwarded()
        if count != last[0]:
            last[:] = [count, now]
        return now - last[1] >= QUIET_S

    return quiet


def thread_cpu() -> dict[int, tuple[str, float]]:
    """This process's threads (Linux ``/proc``): native id -> (role, CPU seconds so far). Roles: ``loop``
    (the main thread), ``zmq-io`` (ZeroMQ's I/O threads), ``zmq-other`` (its reaper), ``proxy`` (any other:
    here the ``zmq_proxy`` thread). CPU is the scheduler's run time in nanoseconds (``schedstat``'s first
    field), not ``stat``'s utime + stime: those count 10 ms clock ticks, coarser than a small run's whole
    cost."""
    found: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            with open(f"/proc/self/task/{tid}/comm") as comm_file:
                comm = comm_file.read().rstrip("\n")
            with open(f"/proc/self/task/{tid}/schedstat") as schedstat:
                run_ns = int(schedstat.read().split()[0])
            role = ("loop" if int(tid) == os.getpid() else "zmq-io" if comm.startswith("ZMQbg/IO")
                    else "zmq-other" if comm.startswith("ZMQbg") else "proxy")
            found[int(tid)] = role, run_ns / 1e9
    if os.getpid() not in found:  # this thread is alive: its file is missing only without schedstats
        raise BenchError("no /proc/self/task/<tid>/schedstat: per-thread CPU needs Linux with schedstats")
    return found


def _spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two :func:`thread_cpu` readings."""
    spent: dict[str, float] = {}
    for tid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(tid, (role, 0.0))[1]
    return spent


# --- tasks: event path profile -----------------------------------------------------------------------


def profile_sender(ch: Channel, flavor: Flavor, endpoint: str, count: int) -> dict[str, float]:
    """Probe until the receiver is live, then time encode and send of ``count`` events (µs per event)."""
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.PUB)
        sock.connect(endpoint)
        codec = WireCodec("bench-prof")
        publisher = Publisher(sock, codec)
        probe = (functools.partial(sock.send, b"probe") if flavor == "raw"
                 else functools.partial(publisher.publish_raw, Sync(token="probe")))
        while not ch.poll(0.005):
            probe()
        ch.recv()  # live
        with gc_paused():
            stages = _profile_send(sock, codec, flavor, count)
        ch.send("sent")
        ch.recv()  # the receiver has everything: closing (linger 0) earlier would discard queued events
        return stages
    finally:
        ctx.destroy(linger=0)


def _profile_send(sock: zmq.Socket, codec: WireCodec, flavor: Flavor, count: int) -> dict[str, float]:
    if flavor == "raw":
        return {"send": timed_us(sock.send, [b"x" * RAW_EVENT_BYTES] * count, CPU)}
    body = _event_body()
    encoded: list[list[Any]] = []
    return {
        "encode": timed_us(lambda seq: encoded.append(codec.encode(body, seq=seq, one_frame=True)), range(1, count + 1),
                           CPU),
        "send": timed_us(lambda frames: send_frames(sock, frames), encoded, CPU),
    }


def profile_receiver(ch: Channel, flavor: Flavor, count: int) -> dict[str, float]:
    """Time receive, decode and sequence tracking of ``count`` queued events (µs per event)."""
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.SUB)
        sock.subscribe(b"")
        sock.rcvtimeo = WAIT_MS
        ch.send(_attach(sock, LOOPBACK, bind=True))
        receive = sock.recv if flavor == "raw" else functools.partial(recv_frames, sock)
        probe = b"probe" if flavor == "raw" else Sync.kind.encode()
        receive()
        ch.send("live")
        ch.recv()  # go: every event was sent (fewer than the high-water mark); waits are not CPU time
        first = receive()
        while (first if flavor == "raw" else first[0]) == probe:
            first = receive()
        received = [first]
        with gc_paused():
            stages = {"recv": timed_us(lambda _: received.append(receive()), range(count - 1), CPU)}
            if flavor == "refbus":  # a second batch of ``count`` goes through the subscriber's own path
                subscriber = Subscriber(sock, WireCodec("bench-sub"))
                stages["drain"] = timed_us(lambda _: _drain(subscriber), range(count), CPU)
                stages |= _profile_decode(sock, received)
        return stages
    finally:
        ctx.destroy(linger=0)


def _drain(subscriber: Subscriber) -> None:
    """What ``Subscriber.recv`` does for an event that is waiting, less its ``poll``."""
    subscriber.drain_one()
    if subscriber.pop() is None:
        raise BenchError("the subscriber delivered nothing for a queued event")


def _profile_decode(sock: zmq.Socket, received: list[list[Any]]) -> dict[str, float]:
    """Decode-side stages of the refbus path, and the costs inside them that stand out."""
    codec = WireCodec("bench-sub")
    checked = [codec.decode_header(frames) for frames in received]
    return {
        "poll": timed_us(lambda _: readable(sock), received, CPU),
        "decode_header": timed_us(codec.decode_header, received, CPU),
        "decode_body": timed_us(codec.decode_body, checked, CPU),
    }


# --- tasks: request/reply ----------------------------------------------------------------------------


def rpc_server(ch: Channel, flavor: RpcFlavor, reply_bytes: int) -> tuple[int, float]:
    """Serve round trips until the client says stop; returns how many were served and the CPU seconds this
    process spent (all its threads, ZeroMQ's I/O thread included) from the first request on."""
    if flavor == "runtime":
        return _runtime_server(ch)
    ctx = zmq.Context()
    try:
        # Raw or not, the same socket options (refbus's factory): the baseline differs only in what runs on them.
        sock = make_socket(ctx, zmq.ROUTER)
        sock.rcvtimeo = WAIT_MS
        ch.send(_attach(sock, LOOPBACK, bind=True))
        if flavor == "raw":
            return _raw_serve(sock, b"r" * reply_bytes)
        server = Server(sock, WireCodec("bench-server"))
        stopped: list[bool] = []
        _bench_routes(server, lambda: stopped.append(True))
        server.handle_one()
        started = time.process_time()
        while not stopped:
            server.handle_one()
        return server.handled[Fetch.kind], time.process_time() - started
    finally:
        ctx.destroy(linger=0)


def _raw_serve(sock: zmq.Socket, reply: bytes) -> tuple[int, float]:
    identity, request = sock.recv_multipart()
    started = time.process_time()
    served = 0
    while request:
        sock.send_multipart([identity, reply])
        served += 1
        identity, request = sock.recv_multipart()
    return served, time.process_time() - started


def _runtime_server(ch: Channel) -> tuple[int, float]:
    """The same routes, served the way every node serves them: from a ``NodeRuntime`` loop."""
    runtime = NodeRuntime("bench-rpc", RuntimeSettings(node_id="bench-rpc", metrics_port=-1), register=False)
    try:
        server = runtime.serve("rpc", LOOPBACK)
        _bench_routes(server, runtime.stop)
        runtime.start()
        ch.send(runtime.endpoints["rpc"])
        runtime.loop(until=lambda: bool(server.handled))
        started = time.process_time()
        runtime.loop()
        return server.handled[Fetch.kind] - 1, time.process_time() - started
    finally:
        runtime.close()


def _bench_routes(server: Server, stop: Callable[[], None]) -> None:
    def on_bye(_: Message) -> Body:
        stop()
        return Ok()

    server.on(Fetch.kind, lambda _: Ok(), cached=False)  # a read, as fetch is in refbus
    server.on(Bye.kind, on_bye)


def rpc_client(
    ch: Channel, endpoints: dict[str, str], request_bytes: int, settings: Settings
) -> dict[str, tuple[list[float], float]]:
    """Round trips in µs to every server in ``endpoints`` (flavor -> endpoint), interleaved in blocks of
    ``settings.rtt_block``, and this thread's CPU seconds over the timed ones; then tells each server to
    stop."""
    ctx = zmq.Context()
    try:
        callers = {flavor: _rpc_caller(ctx, flavor, endpoint, request_bytes) for flavor, endpoint in endpoints.items()}
        latencies: dict[str, list[float]] = {flavor: [] for flavor in callers}
        cpu = dict.fromkeys(callers, 0.0)
        for round_trip, _ in callers.values():
            for _ in range(settings.rtt_warmup):
                round_trip()
        for _ in range(settings.rtt_samples // settings.rtt_block):
            for flavor, (round_trip, _) in callers.items():
                started = CPU()
                latencies[flavor] += _latencies_us(round_trip, settings.rtt_block)
                cpu[flavor] += CPU() - started
        for _, stop in callers.values():
            stop()
        return {flavor: (latencies[flavor], cpu[flavor]) for flavor in callers}
    finally:
        ctx.destroy(linger=0)


def _latencies_us(round_trip: Callable[[], object], count: int) -> list[float]:
    return [seconds * 1e6 for seconds in seconds_each(round_trip, count)]


def _rpc_caller(
    ctx: zmq.Context, flavor: str, endpoint: str, request_bytes: int
) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(round_trip, stop_server)`` for one server."""
    if flavor == "raw":
        sock = make_socket(ctx, zmq.DEALER, connect=endpoint)  # the options a Client's socket has
        sock.rcvtimeo = WAIT_MS
        request = b"q" * request_bytes

        def round_trip() -> None:
            sock.send(request)
            sock.recv()

        return round_trip, functools.partial(sock.send, b"")
    client = Client(ctx, endpoint, WireCodec(f"bench-client-{flavor}"))
    return functools.partial(client.request, _fetch_body()), functools.partial(client.request, Bye(node_id="bench"))


# --- tasks: request/reply profile --------------------------------------------------------------------

RPC_CLIENT_STAGES = ("encode", "send", "wait", "decode")
RPC_SERVER_STAGES = ("recv", "decode_header", "decode", "handler", "encode", "send")


def rpc_profile_server(ch: Channel, count: int) -> dict[str, float]:
    """Serve ``count`` round trips through the stages ``Server.handle_one`` runs (one-frame requests, the
    reply in the form asked), timing each; returns mean wall µs per stage ("recv" from the moment the
    request could be received, so it excludes the wait but includes the wake-up's cache misses)."""
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.ROUTER)
        sock.rcvtimeo = WAIT_MS
        ch.send(_attach(sock, LOOPBACK, bind=True))
        codec = WireCodec("bench-server")
        totals = dict.fromkeys(RPC_SERVER_STAGES, 0.0)
        clock = time.perf_counter
        with gc_paused():
            for _ in range(count):
                sock.poll(WAIT_MS, zmq.POLLIN)
                t0 = clock()
                identity, envelope, _ = recv_routed(sock)
                t1 = clock()
                checked = codec.decode_header(envelope)
                t2 = clock()
                request = codec.decode(envelope, checked=checked)
                t3 = clock()
                reply = Ok() if request.kind == Fetch.kind else None
                t4 = clock()
                frames = codec.encode(reply, reply_to=checked.header.id, one_frame=len(envelope) < MIN_FRAMES)
                t5 = clock()
                send_frames(sock, [identity, *frames], zmq.NOBLOCK)
                t6 = clock()
                for stage, start, end in zip(RPC_SERVER_STAGES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6),
                                             strict=True):
                    totals[stage] += end - start
        return {stage: 1e6 * seconds / count for stage, seconds in totals.items()}
    finally:
        ctx.destroy(linger=0)


def rpc_profile_client(ch: Channel, endpoint: str, count: int) -> dict[str, float]:
    """``count`` round trips through the stages of ``Client.request``, timing each (mean wall µs; "wait"
    holds the whole time the reply travels and the server works)."""
    ctx = zmq.Context()
    try:
        client = Client(ctx, endpoint, WireCodec("bench-client-profile"))
        body = _fetch_body()
        totals = dict.fromkeys(RPC_CLIENT_STAGES, 0.0)
        clock = time.perf_counter
        with gc_paused():
            for _ in range(count):
                t0 = clock()
                _, frames = client.encode(body)
                t1 = clock()
                send_frames(client.sock, frames)
                t2 = clock()
                if not readable(client.sock, WAIT_MS):
                    raise BenchError(f"no reply within {WAIT_S}s")
                received = recv_frames(client.sock, zmq.NOBLOCK)
                t3 = clock()
                client.codec.decode(received)
                t4 = clock()
                for stage, start, end in zip(RPC_CLIENT_STAGES, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
                    totals[stage] += end - start
        return {stage: 1e6 * seconds / count for stage, seconds in totals.items()}
    finally:
        ctx.destroy(linger=0)


# --- tasks: bulk frames ------------------------------------------------------------------------------


def bulk_receiver(ch: Channel, flavor: Flavor, nbytes: int, count: int) -> Rate:
    """Receive ``count`` messages of one ``nbytes`` array; rate from the first one's arrival to the last's."""
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.PULL, hwm=BULK_HWM)
        sock.rcvtimeo = WAIT_MS
        ch.send(_attach(sock, LOOPBACK, bind=True))
        if flavor == "raw":
            def receive() -> int:
                return len(sock.recv(copy=False))
        else:
            codec = WireCodec("bench-bulk-rx")

            def receive() -> int:
                body = codec.decode(recv_frames(sock), verify=True).body
                assert isinstance(body, Blobs)
                return int(body.blobs[0].arrays["data"].nbytes)

        if receive() != nbytes:
            raise BenchError(f"received a message of the wrong size (expected {nbytes} bytes)")
        start = time.perf_counter()
        for _ in range(count - 1):
            receive()
        return Rate(count - 1, time.perf_counter() - start, nbytes=nbytes)
    finally:
        ctx.destroy(linger=0)


def bulk_sender(ch: Channel, flavor: Flavor, endpoint: str, nbytes: int, count: int) -> None:
    """Send ``count`` messages of one ``nbytes`` array, zero-copy (refbus: encoded with checksum each time)."""
    array = np.full(nbytes, 7, dtype=np.uint8)
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, flavor, zmq.PUSH, hwm=BULK_HWM)
        sock.connect(endpoint)
        codec = WireCodec("bench-bulk-tx")
        body = Blobs(blobs=[FetchedBlob(blob_id="bench-blob", arrays={"data": array})])
        for _ in range(count):
            if flavor == "raw":
                sock.send(memoryview(array), copy=False)
            else:
                send_frames(sock, codec.encode(body))
        ch.recv()  # the receiver has everything: closing (linger 0) earlier would discard queued frames
    finally:
        ctx.destroy(linger=0)


# --- the comparisons (parent side) -------------------------------------------------------------------


def measure_events(pool: Pool, settings: Settings, flavor: Flavor, senders: Sequence[Worker],
                   via: tuple[Worker, dict[str, str]] | None = None, batch: int = 1) -> Rate:
    """Events/s at one subscriber from ``senders``: straight, or through the forwarder ``via`` (its worker and
    endpoints): a broker (``control`` among them: publishers join it as nodes) or the bare proxy. ``batch``:
    events a publisher's turn sends as one message (direct senders only; raw: one frame the receiver splits)."""
    forwarder, endpoints = via if via else (None, {})
    brokered = "control" in endpoints
    endpoint = endpoints["events_out"] if via else LOOPBACK
    pool.rx.submit(event_receiver, flavor, endpoint, via is None, settings.warmup_s, settings.window_s, batch)
    subscribed = pool.rx.message()
    target = endpoints["control"] if brokered else endpoints["events_in"] if via else subscribed
    run = secrets.token_hex(3)  # fresh node ids: the broker may still hold an earlier run's events
    for index, worker in enumerate(senders):
        worker.submit(event_sender, flavor, target, f"bench-pub-{run}-{index}", brokered, batch)
    for worker in senders:
        if worker.message() != "ready":
            raise BenchError(f"{worker.name} did not get ready")
    for worker in senders:
        worker.tell("go")
    try:
        return pool.rx.result(settings.warmup_s + settings.window_s + WAIT_S)
    finally:
        for worker in senders:
            worker.tell("stop")
        for worker in senders:
            worker.result()
        if forwarder is not None:
            forwarder.tell("quiesce")
            forwarder.message()


def profile_events(pool: Pool, flavor: Flavor, count: int) -> dict[str, dict[str, float]]:
    """Per-stage µs of one event: sender stages timed in the sender process, receiver stages in the
    receiver process, each over ``count`` events queued ahead."""
    sender = pool.tx
    pool.rx.submit(profile_receiver, flavor, count)
    sender.submit(profile_sender, flavor, pool.rx.message(), 2 * count if flavor == "refbus" else count)
    pool.rx.message()  # live: the subscription reached the publisher
    sender.tell("live")
    sender.message()  # sent
    pool.rx.tell("go")
    try:
        received = pool.rx.result()
    finally:
        sender.tell("done")
    return {"sender": sender.result(), "receiver": received}


def bench_events(pool: Pool, settings: Settings) -> tuple[list[Row], dict[str, Any]]:
    """Envelope and broker comparisons (the broker's CPU against the bare proxy's), then the event-path
    profile."""
    pool.broker.submit(broker_node)
    broker = pool.broker, pool.broker.message()
    pool.aux.submit(bare_proxy_node)
    proxy = pool.aux, pool.aux.message()
    cpu: dict[str, dict[str, Any]] = {}
    try:
        one, two = pool.pubs[:1], pool.pubs
        rates = best_rates({
            "raw": lambda: measure_events(pool, settings, "raw", (pool.tx,)),
            "raw_batched": lambda: measure_events(pool, settings, "raw", (pool.tx,), batch=BATCH_EVENTS),
            "refbus": lambda: measure_events(pool, settings, "refbus", (pool.tx,)),
            "batched": lambda: measure_events(pool, settings, "refbus", (pool.tx,), batch=BATCH_EVENTS),
            "direct": lambda: measure_events(pool, settings, "refbus", one),
            "brokered": lambda: measure_events(pool, settings, "refbus", one, broker),
            "proxied": lambda: measure_events(pool, settings, "refbus", one, proxy),
            "direct2": lambda: measure_events(pool, settings, "refbus", two),
            "brokered2": lambda: measure_events(pool, settings, "refbus", two, broker),
            "proxied2": lambda: measure_events(pool, settings, "refbus", two, proxy),
        }, settings.rounds)
    finally:
        for name, (worker, _) in (("broker", broker), ("proxy", proxy)):
            worker.tell("stop")
            cpu[name] = worker.result()
    for figures_of in cpu.values():
        figures_of["cpu_us_per_event"] = 1e6 * figures_of["cpu_s"] / max(1, figures_of["forwarded"])
        figures_of["threads_us_per_event"] = {role: 1e6 * seconds / max(1, figures_of["forwarded"])
                                              for role, seconds in figures_of["threads_s"].items()}
    rows = [
        Row("envelope", f"events/s, 1 pub -> 1 sub, {BATCH_EVENTS} a turn (vs raw 100 B frames)", "events/s",
            rates["batched"].per_s, rates["raw"].per_s, 0.25),
        Row("envelope", "events/s, 1 pub -> 1 sub, one a message (vs raw 100 B frames)", "events/s",
            rates["refbus"].per_s, rates["raw"].per_s, None),
        Row("envelope", f"events/s, 1 pub -> 1 sub, {BATCH_EVENTS} a turn (vs raw {BATCH_EVENTS} x 100 B a message, "
                        "split per event)", "events/s", rates["batched"].per_s, rates["raw_batched"].per_s, None),
        Row("broker", "events/s, 1 pub via broker (vs direct)", "events/s",
            rates["brokered"].per_s, rates["direct"].per_s, 0.80),
        Row("broker", "events/s, 2 pubs via broker (vs direct)", "events/s",
            rates["brokered2"].per_s, rates["direct2"].per_s, 0.80),
        Row("broker", "CPU per forwarded event (vs bare zmq_proxy)", "us",
            cpu["broker"]["cpu_us_per_event"], cpu["proxy"]["cpu_us_per_event"], None, higher_is_better=False),
    ]
    profile = {flavor: profile_events(pool, flavor, settings.profile_events) for flavor in ("refbus", "raw")}
    extra = {
        "profile": profile,
        "rates": {name: asdict(rate) | {"per_s": rate.per_s, "cpu_us": rate.cpu_us} for name, rate in rates.items()},
        **cpu,
    }
    return rows, extra


def _envelope_bytes(body: Body, **encode: Any) -> int:
    """Bytes of ``body``'s envelope in the form requests and their replies travel (one frame)."""
    return sum(len(frame) for frame in WireCodec("bench-client-refbus").encode(body, one_frame=True, **encode))


def bench_rpc(pool: Pool, settings: Settings) -> tuple[list[Row], dict[str, Any]]:
    """Round trips from one client process to three server processes (raw, refbus ``Server``, ``Server`` in
    a ``NodeRuntime`` loop), interleaved in blocks; the CPU each side spent per round trip."""
    request_bytes = _envelope_bytes(_fetch_body())
    reply_bytes = _envelope_bytes(Ok(), reply_to=WireCodec("bench-server").new_id())
    servers: dict[str, Worker] = {"raw": pool.rx, "refbus": pool.aux, "runtime": pool.broker}
    for flavor, worker in servers.items():
        worker.submit(rpc_server, flavor, reply_bytes)
    endpoints = {flavor: worker.message() for flavor, worker in servers.items()}
    measured = pool.tx.call(rpc_client, endpoints, request_bytes, settings,
                            timeout_s=WAIT_S + 3 * settings.rtt_samples * 0.005)
    served = {flavor: worker.result() for flavor, worker in servers.items()}
    samples = {flavor: latencies for flavor, (latencies, _) in measured.items()}
    cpu_us = {flavor: {"client": 1e6 * client_s / len(samples[flavor]),
                       "server": 1e6 * served[flavor][1] / max(1, served[flavor][0])}
              for flavor, (_, client_s) in measured.items()}
    raw = np.percentile(samples["raw"], [50, 99])
    rows = []
    for flavor, label in (("refbus", "Server"), ("runtime", "Server in NodeRuntime loop")):
        ours = np.percentile(samples[flavor], [50, 99])
        rows += [
            Row("rpc", f"round trip p50, {label}", "us", float(ours[0]), float(raw[0]), RPC_GOAL,
                higher_is_better=False),
            Row("rpc", f"round trip p99, {label}", "us", float(ours[1]), float(raw[1]), None, higher_is_better=False),
        ]
    pool.rx.submit(rpc_profile_server, settings.rtt_samples)
    profile_client = pool.tx.call(rpc_profile_client, pool.rx.message(), settings.rtt_samples,
                                  timeout_s=WAIT_S + settings.rtt_samples * 0.005)
    profile = {"client": profile_client, "server": pool.rx.result()}
    return rows, {"rpc_cpu_us": cpu_us, "rpc_profile_us": profile}


def measure_bulk(pool: Pool, flavor: Flavor, nbytes: int, count: int) -> Rate:
    pool.rx.submit(bulk_receiver, flavor, nbytes, count)
    sender = pool.tx
    sender.submit(bulk_sender, flavor, pool.rx.message(), nbytes, count)
    try:
        return pool.rx.result(WAIT_S + count * nbytes / 0.1e9)
    finally:
        sender.tell("done")
        sender.result()


def bench_bulk(pool: Pool, settings: Settings) -> list[Row]:
    rows = []
    for mib in BULK_SIZES_MIB:
        nbytes = mib * MIB
        count = max(BULK_MIN_MESSAGES, settings.bulk_bytes // nbytes)
        best = best_rates({flavor: functools.partial(measure_bulk, pool, flavor, nbytes, count)
                           for flavor in ("raw", "refbus")}, settings.rounds)
        rows.append(Row("bulk", f"one {mib} MiB array per message", "GB/s",
                        best["refbus"].gb_s, best["raw"].gb_s, 0.80))
    return rows


# --- report ------------------------------------------------------------------------------------------


PROFILE_LINES = (
    ("sender", "encode", "WireCodec.encode"),
    ("sender", "send", "send_frames (1 frame)            [raw: sock.send]"),
    ("receiver", "poll", "sockets.readable() (Subscriber.recv waits only when idle)"),
    ("receiver", "drain", "Subscriber.drain_one: recv_frames, decode, seq check"),
    ("receiver", "recv", "  recv_frames (1 frame)           [raw: sock.recv]"),
    ("receiver", "decode_header", "  WireCodec.decode_header"),
    ("receiver", "decode_body", "  WireCodec.decode_body (validates)"),
)
TOTALS = {
    "refbus": {"sender": ("encode", "send"), "receiver": ("drain",)},
    "raw": {"sender": ("send",), "receiver": ("recv",)},
}


def format_profile(profile: dict[str, dict[str, dict[str, float]]], count: int) -> str:
    ours, raw = profile["refbus"], profile["raw"]
    lines = [
        f"Event path profile, CPU us per event (batches of {count} queued events; sender stages timed in the",
        "sender process, receiver stages in the receiver; refbus = 1 frame, ~170 B; raw = 1 frame, 100 B):",
        f"  {'stage':56s} {'refbus':>7s} {'raw':>7s}",
    ]
    for side, key, label in PROFILE_LINES:
        raw_value = raw[side].get(key)
        lines.append(f"  {label:56s} {ours[side][key]:7.2f} {'' if raw_value is None else f'{raw_value:7.2f}'}")
    for side in ("sender", "receiver"):
        ours_total, raw_total = (sum(profile[flavor][side][key] for key in TOTALS[flavor][side])
                                 for flavor in ("refbus", "raw"))
        lines.append(f"  {side + ' total (capacity ' + f'{1e6 / ours_total / 1e3:.0f}k/s)':56s} "
                     f"{ours_total:7.2f} {raw_total:7.2f}")
    return "\n".join(lines)


def format_cpu(extra: dict[str, Any]) -> str:
    """CPU per event of the subscriber process (all threads) in each best window, and of the broker and the
    bare proxy per forwarded event, split by thread: figures that other load on the machine distorts less
    than the rates."""
    cells = ", ".join(f"{name} {rate['cpu_us']:.2f}" for name, rate in extra["rates"].items())
    broker_us, proxy_us = extra["broker"]["cpu_us_per_event"], extra["proxy"]["cpu_us_per_event"]
    verdict = "met" if broker_us <= BROKER_CPU_GOAL_US else "NOT MET"
    lines = [f"CPU us per event, subscriber process (all threads): {cells}",
             f"CPU us per forwarded event, broker process: {broker_us:.2f} = {broker_us / proxy_us:.2f}x the bare "
             f"zmq_proxy's {proxy_us:.2f} (goal <= {BROKER_CPU_GOAL_US:.0f} us: {verdict})"]
    for name in ("broker", "proxy"):
        figures_of = extra[name]
        split = ", ".join(f"{role} {us:.2f}" for role, us in sorted(figures_of["threads_us_per_event"].items()))
        lines.append(f"  {name:6s} by thread, us per event ({figures_of['forwarded']:,} events): {split}")
    return "\n".join(lines)


def format_rpc_cpu(cpu_us: dict[str, dict[str, float]]) -> str:
    """CPU per round trip of each side, which other load on the machine distorts less than latencies."""
    cells = {side: ", ".join(f"{flavor} {sides[side]:.1f}" for flavor, sides in cpu_us.items())
             for side in ("client", "server")}
    return (f"CPU us per round trip, client thread: {cells['client']}\n"
            f"CPU us per round trip, server process (all threads): {cells['server']}")


def format_rpc_profile(profile: dict[str, dict[str, float]]) -> str:
    """Wall µs of each stage of a round trip, between processes as in the measurement (one wake-up per side:
    what a stage costs there, cold caches included, is several times what a loop in one process shows)."""
    lines = ["Round trip stages, wall us (mean; client, then server; `wait` holds the server's stages):"]
    for side in ("client", "server"):
        lines.append(f"  {side:6s} " + ", ".join(f"{stage} {us:.1f}" for stage, us in profile[side].items()))
    return "\n".join(lines)


def run(settings: Settings, sections: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    """The chosen sections, in order; ``extra`` holds the profile, raw rates and seconds per section."""
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    started = time.monotonic()
    with pool() as bench_pool:
        seconds["start"] = time.monotonic() - started
        for section in sections:
            started = time.monotonic()
            if section == "events":
                event_rows, events_extra = bench_events(bench_pool, settings)
                rows += event_rows
                extra |= events_extra
            elif section == "rpc":
                rpc_rows, rpc_extra = bench_rpc(bench_pool, settings)
                rows += rpc_rows
                extra |= rpc_extra
            else:
                rows += bench_bulk(bench_pool, settings)
            seconds[section] = time.monotonic() - started
    return rows, extra | {"section_seconds": seconds}


SECTIONS = ("events", "rpc", "bulk")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv, prog="python -m bench.bus", sections=SECTIONS,
        description="refbus bus benchmarks: envelope, broker, request/reply and bulk frames, each printed as a "
                    "ratio to raw pyzmq (or to direct delivery) measured in the same run, in separate processes.",
        quick_help="short windows and few samples (smoke test, < 10 s)",
    )
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    rows, extra = run(settings, args.only or SECTIONS)
    print(format_table(rows))
    if "profile" in extra:
        print()
        print(format_profile(extra["profile"], settings.profile_events))
        print(format_cpu(extra))
    if "rpc_cpu_us" in extra:
        print()
        print(format_rpc_cpu(extra["rpc_cpu_us"]))
        print(format_rpc_profile(extra["rpc_profile_us"]))
    elapsed = time.monotonic() - started
    print(f"\n{run_line(args.quick, elapsed, extra['section_seconds'])}")
    if args.json:
        write_json(args.json, figures(settings, args.quick, elapsed, rows, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
