"""CURVE's cost: the same traffic plain and CURVE-encrypted in one run, each figure as a ratio curve / plain.

Three figures, each measured both ways in interleaved rounds (the best of each kept):

1. **events**: events/s of ~100-byte ``delete`` events encoded and sent by a connecting PUB (a node's side
   of the broker's ``events_in``), received and decoded by a bound SUB over a fixed window.
2. **fetch**: GB/s of ``fetch`` round trips whose reply carries one 4 MiB array, ``Client`` -> ``Server``
   (under CURVE the server is ``authenticated``: the ``src`` check is in the figure).
3. **ps pull**: GB/s of a 64 MiB pull as ``ps-shard-read`` requests answered by 8 MiB ``ps-shard-data`` frames
   (``ps.chunk_bytes``), 4 in flight, as ``PsClient`` reads another host's shard (``gather``).

Servers run in a spawned worker process with their ZAP handler, clients in another, over loopback TCP on
ephemeral ports; the keys are made for the run in a temporary directory. The speed goals of other benches
are for plain mode; this one has none: it reports the price.

    python -m bench.curve [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from refbus.bus.pubsub import Publisher
from refbus.bus.reqrep import Client, RetryPolicy, Server, gather
from refbus.bus.security import Curve, ZapHandler, generate, load_curve
from refbus.bus.sockets import EVENT_OPTIONS, SocketOptions, bound_endpoint, make_socket, recv_frames
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Blobs, Delete, Fetch, FetchedBlob
from refbus.protocol.messages_ps import ByteRange, ShardData, ShardRead

from bench.harness import (
    MIB,
    WAIT_S,
    Channel,
    Rate,
    Row,
    best_rates,
    figures,
    format_table,
    parse_args,
    run_line,
    workers,
    write_json,
)

FETCH_BYTES = 4 * MIB
CHUNK_BYTES = 8 * MIB  # ps.chunk_bytes
PULL_BYTES = 64 * MIB
WINDOW = 4  # frame messages in flight, as PsClient
NODES = {"server": "bench", "client": "bench"}


@dataclass(frozen=True)
class Settings:
    rounds: int = 3
    window_s: float = 1.0  # events counted per round
    fetches: int = 40  # 4 MiB round trips per round
    pulls: int = 4  # 64 MiB pulls per round


QUICK = Settings(rounds=2, window_s=0.5, fetches=10, pulls=2)


def _curve(key_dir: str, node_id: str) -> Curve | None:
    return load_curve(key_dir, "", node_id, NODES[node_id]) if key_dir else None


# --- the server worker --------------------------------------------------------------------------------------


def serve(ch: Channel, key_dir: str) -> int:
    """Bind a request server and an event SUB (CURVE when ``key_dir``), report their endpoints, then answer
    ``fetch`` and ``ps-shard-read`` and count events per order until told to stop. Returns requests served."""
    curve = _curve(key_dir, "server")
    ctx = zmq.Context()
    zap = ZapHandler(ctx, curve.allowed) if curve else None
    codec = WireCodec("server")
    server = Server(make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0", options=SocketOptions(curve=curve)),
                    codec, backend="numpy", authenticated=curve is not None)
    fetched = np.random.default_rng(0).integers(0, 255, FETCH_BYTES, dtype=np.uint8)
    chunk = np.random.default_rng(1).integers(0, 255, CHUNK_BYTES, dtype=np.uint8)
    server.on(Fetch.kind, lambda m: Blobs(blobs=[FetchedBlob(m.body.blob_ids[0], {"x": fetched})]), cached=False)
    server.on(ShardRead.kind, lambda m: ShardData([chunk]), cached=False)
    sub = make_socket(ctx, zmq.SUB, bind="tcp://127.0.0.1:0",
                      options=SocketOptions(sndhwm=EVENT_OPTIONS.sndhwm, rcvhwm=EVENT_OPTIONS.rcvhwm, curve=curve))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    ch.send((bound_endpoint(server.sock), bound_endpoint(sub)))
    poller = zmq.Poller()
    poller.register(server.sock, zmq.POLLIN)
    poller.register(sub, zmq.POLLIN)
    window_s: float | None = None
    counted = 0
    until = 0.0
    try:
        while True:
            if ch.poll():
                order = ch.recv()
                if order == "stop":
                    return sum(server.handled.values())
                window_s, counted, until = order, 0, 0.0
            for sock, _ in poller.poll(10):
                if sock is server.sock:
                    server.handle_one()
                    continue
                codec.decode(recv_frames(sub))
                if window_s is not None:
                    now = time.perf_counter()
                    if not until:
                        until = now + window_s
                    elif now < until:
                        counted += 1
                    else:
                        ch.send(Rate(counted, window_s))
                        window_s = None
    finally:
        server.sock.close()
        sub.close()
        if zap is not None:
            zap.close()
        ctx.term()


# --- the client worker ---------------------------------------------------------------------------------------


def publish(ch: Channel, key_dir: str, endpoint: str) -> int:
    """Publish events to ``endpoint`` until told to stop; returns how many."""
    ctx = zmq.Context()
    pub = make_socket(ctx, zmq.PUB, connect=endpoint, options=SocketOptions(
        sndhwm=EVENT_OPTIONS.sndhwm, rcvhwm=EVENT_OPTIONS.rcvhwm, curve=_curve(key_dir, "client")))
    publisher = Publisher(pub, WireCodec("client"))
    body = Delete(blob_ids=[f"env-0-ep-{i:06d}-b0" for i in range(3)], holder="trainer-0", reason="trained")
    sent = 0
    try:
        while not ch.poll():
            for _ in range(256):
                publisher.publish(body)
            sent += 256
        return sent
    finally:
        pub.close()
        ctx.term()


def request(ch: Channel, key_dir: str, endpoint: str, what: str, count: int) -> Rate:
    """``count`` fetches (4 MiB replies) or 64 MiB pulls (8 MiB frames, ``WINDOW`` in flight) from
    ``endpoint``; their byte rate."""
    ctx = zmq.Context()
    client = Client(ctx, endpoint, WireCodec("client"), policy=RetryPolicy(timeout_s=WAIT_S, attempts=1),
                    options=SocketOptions(curve=_curve(key_dir, "client")))
    reads = [(client, ShardRead("segment", [ByteRange(0, CHUNK_BYTES)]))] * (PULL_BYTES // CHUNK_BYTES)

    def once() -> Any:
        if what == "fetch":
            return client.request(Fetch(blob_ids=["b"], holder="client"), backend="numpy")
        outcomes = gather(reads, window=WINDOW, backend="numpy")
        bad = [o for o in outcomes if not isinstance(o, Message)]
        if bad:
            raise RuntimeError(f"pull failed: {bad[0]}")
        return outcomes

    try:
        once()  # connect and warm up
        start = time.perf_counter()
        for _ in range(count):
            once()
        return Rate(count, time.perf_counter() - start, FETCH_BYTES if what == "fetch" else PULL_BYTES)
    finally:
        client.close()
        ctx.term()


# --- the run --------------------------------------------------------------------------------------------


def run(settings: Settings) -> tuple[list[Row], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="refbus-bench-keys-") as tmp:
        key_dir = f"{tmp}/keys"
        for node_id, role in NODES.items():
            generate(key_dir, node_id, role)
        with workers("plain-server", "curve-server", "plain-client", "curve-client", "curve-publisher",
                     "plain-publisher") as pool:
            servers = {"plain": pool[0], "curve": pool[1]}
            clients = {"plain": pool[2], "curve": pool[3]}
            publishers = {"curve": pool[4], "plain": pool[5]}
            keys = {"plain": "", "curve": key_dir}
            endpoints = {}
            for mode, worker in servers.items():
                worker.submit(serve, keys[mode])
                endpoints[mode] = worker.message()

            def events(mode: str) -> Callable[[], Rate]:
                def measure() -> Rate:
                    publishers[mode].submit(publish, keys[mode], endpoints[mode][1])
                    servers[mode].tell(settings.window_s)
                    rate = servers[mode].message(WAIT_S)
                    publishers[mode].tell("stop")
                    publishers[mode].result()
                    return rate
                return measure

            def requests(mode: str, what: str, count: int) -> Callable[[], Rate]:
                return lambda: clients[mode].call(request, keys[mode], endpoints[mode][0], what, count,
                                                  timeout_s=WAIT_S * 4)

            measures: dict[str, Callable[[], Rate]] = {}
            for mode in ("plain", "curve"):
                measures[f"events {mode}"] = events(mode)
                measures[f"fetch {mode}"] = requests(mode, "fetch", settings.fetches)
                measures[f"pull {mode}"] = requests(mode, "pull", settings.pulls)
            best = best_rates(measures, settings.rounds)
            for worker in servers.values():
                worker.tell("stop")
                worker.result()
    rows = [
        Row("curve", "events (100-byte delete, PUB -> SUB)", "events/s", best["events curve"].per_s,
            best["events plain"].per_s, None),
        Row("curve", "fetch 4 MiB (Client -> Server)", "GB/s", best["fetch curve"].gb_s, best["fetch plain"].gb_s,
            None),
        Row("curve", "ps pull 64 MiB (8 MiB frames, 4 in flight)", "GB/s", best["pull curve"].gb_s,
            best["pull plain"].gb_s, None),
    ]
    return rows, {}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, prog="python -m bench.curve", description=__doc__.split("\n\n")[0],
                      quick_help="fewer, shorter rounds (a smoke run)")
    settings = QUICK if args.quick else Settings()
    start = time.perf_counter()
    rows, extra = run(settings)
    seconds = time.perf_counter() - start
    print("CURVE against plain, same run (refbus column: CURVE; baseline: plain)")
    print(format_table(rows))
    print(run_line(args.quick, seconds))
    if args.json:
        write_json(args.json, figures(settings, args.quick, seconds, rows, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
