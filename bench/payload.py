"""Payload benchmarks: a trainer rank's fetch by reference, and the orchestrator's memory, against baselines
measured in the same run and process tree.

1. **fetch**: one step's arrays for a trainer rank from two env servers (real ``refbus node env-server``
   processes on a real broker), timed until the assembled torch tensors are ready (``StepFetcher`` start + finish:
   fetch, verify, assemble into reused buffers), in two shapes: 64 blobs of 4 MiB and 1024 blobs of 64 KiB
   of uint8 routing rows (``[tokens, 64 layers, top-8]``, 512 B per token). Baselines:
   (a) raw: the same bytes over one plain TCP connection into a preallocated buffer (``sendall`` /
   ``recv_into``), nothing assembled but checked (across hosts: half from each env server's host at once);
   (b) http: a stdlib ``ThreadingHTTPServer`` per env server, ``urllib`` GET per blob, the best of 1, 2, 4 and 8
   parallel requests, then the same assembly into the same kind of reused buffers (so the comparison isolates the
   transport). Goals: >= 80% of raw at 4 MiB and >= 50% at 64 KiB; >= 1.2x http at 4 MiB and >= 5x at 64 KiB (the
   http rows name the raw figure too). An informational row shows refbus until every blob is received and verified
   (before assembly copies the uint8 rows into the batch tensors).
2. **memory**: peak RSS of an orchestrator-like child (a request server on the refbus wire that holds what it
   receives) with 0 and with N GiB of arrays in flight, by reference (it receives ``episode-finished`` with
   one ``BlobRef`` per 1 MiB blob) and inline (it receives the arrays as frames). Goals: by reference grows
   < 5%; inline grows by the full amount (>= 95% of the bytes in flight). A fresh child per variant, whose
   peak is read as ``VmHWM`` (the high-water mark of its own address space, from its ``exec``), so it is that
   variant's alone (``ru_maxrss`` would carry over the bench parent's peak).

Every timing is the best of the repeats after one warm-up (steady state, as in training; best-of because the
machine may be shared), taken the same way for refbus and every baseline. Workers are spawned processes
(``bench.harness.workers``); every wait is bounded and every process reaped.

Across hosts (``--hosts``, needs root): the fetch comparison on three namespace hosts (``bench.hosts``): the
broker and the trainer on hostA, an env server and a baseline server (raw peer, HTTP) on each of hostB and
hostC, every baseline between the same hosts in the same run; the memory section is host-independent and
does not run.

    python -m bench.payload [--quick] [--hosts] [--json PATH]
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np

# The spawned trainer worker is set up like a trainer rank's process, which always has the node runtime
# loaded. Without this import the 64 x 4 MiB fetch measured about 40% slower here with the same code under
# test (bisected to the commit that gave the harness its own module and stopped importing bench.bus); the
# cause is still to be found by profiling this path.
import refbus.bus.runtime  # noqa: F401
import zmq
from refbus.bus.logs import configure_logging
from refbus.bus.reqrep import Client, RetryPolicy, Server, gather
from refbus.bus.sockets import bound_endpoint, make_socket
from refbus.nodes.launch import NodeProcess, bus_flags, start_bus
from refbus.protocol.envelope import WireCodec
from refbus.protocol.messages import BlobRef, EpisodeFinished, Keep, Kept, MicroBatchRefs, Ok, SampleSlice

from bench import hosts
from bench.harness import (
    MIB,
    RAW_BYTE,
    WAIT_S,
    BenchError,
    Channel,
    Row,
    Worker,
    figures,
    format_table,
    parse_args,
    raw_peer,
    recv_exactly,
    run_line,
    seconds_each,
    workers,
    write_json,
)

LAYERS, TOP_K = 64, 8
TOKEN_BYTES = LAYERS * TOP_K  # uint8 routing: 512 B per token
SEQ_LEN = 65_536  # tokens per micro batch: 32 MiB of uint8 routing in and out
HTTP_PARALLEL = (1, 2, 4, 8)
MEMORY_BLOB = 1 * MIB
PATIENT = RetryPolicy(timeout_s=WAIT_S, attempts=1)
SERVE_S = 600.0  # the longest a baseline server waits to be told to stop


@dataclass(frozen=True)
class Settings:
    repeats: int  # timed steps per figure, after one warm-up
    shapes: tuple[tuple[int, int], ...]  # (blob count, blob bytes)
    in_flight_bytes: int  # arrays in flight at the orchestrator


FULL = Settings(repeats=5, shapes=((64, 4 * MIB), (1024, 64 << 10)), in_flight_bytes=4 << 30)
QUICK = Settings(repeats=1, shapes=((64, 4 * MIB), (1024, 64 << 10)), in_flight_bytes=256 * MIB)


def routing_rows(nbytes: int, seed: int) -> np.ndarray:
    """One routing array of ``nbytes``, ``[tokens, LAYERS, TOP_K]`` uint8. Every blob of a shape holds these
    bytes (content does not change the cost of moving or assembling them; generating GiBs would)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, (nbytes // TOKEN_BYTES, LAYERS, TOP_K), dtype=np.uint8)


def micro_batches(refs: Sequence[BlobRef]) -> list[MicroBatchRefs]:
    """The blobs packed in order into micro batches of at most ``SEQ_LEN`` tokens."""
    batches: list[list[SampleSlice]] = [[]]
    used = 0
    for ref in refs:
        if used + ref.tokens > SEQ_LEN:
            batches.append([])
            used = 0
        batches[-1].append(SampleSlice(sample_id=ref.blob_id, tokens=ref.tokens, ref=ref))
        used += ref.tokens
    return [MicroBatchRefs(samples=s, length=sum(x.tokens for x in s)) for s in batches]


# --- tasks: the trainer side (one worker) ----------------------------------------------------------------


def refbus_fetch(ch: Channel, batches: list[MicroBatchRefs], repeats: int, rows: np.ndarray
                 ) -> tuple[list[tuple[float, float]], int]:
    """``StepFetcher`` start + finish of the step ``repeats + 1`` times; (total, transfer) seconds of the timed
    ones, and how many samples of the last step were checked against ``rows`` (every blob's routing rows)."""
    from refbus.bus.calls import Calls
    from refbus.nodes.payload.assemble import AssembledBatch
    from refbus.nodes.payload.fetcher import StepFetcher

    ctx = zmq.Context()
    codec = WireCodec("bench-trainer")
    clients: list[Client] = []

    def connect(endpoint: str) -> Client:
        clients.append(Client(ctx, endpoint, codec, policy=PATIENT))
        return clients[-1]

    calls = Calls(connect, PATIENT)
    fetcher = StepFetcher("bench-trainer", calls)
    try:
        seconds = []
        for step in range(repeats + 1):
            in_flight = fetcher.start(step, batches)
            if not calls.run_until(lambda fetch=in_flight: fetch.done, 2 * PATIENT.deadline_s):
                raise BenchError("refbus fetch: requests outlived their deadline")
            result = fetcher.finish(in_flight)
            if result.failed or not all(isinstance(b, AssembledBatch) for b in result.batches):
                raise BenchError(f"refbus fetch failed: {result.batches[result.failed[0]]}")
            seconds.append((result.seconds, result.transfer_seconds))
        return seconds[1:], _check_assembled(batches, result.batches, rows)
    finally:
        for client in clients:
            client.close()
        ctx.destroy(linger=0)


def _check_assembled(batches: Sequence[MicroBatchRefs], assembled: Sequence[Any], rows: np.ndarray) -> int:
    """Every sample's routing rows in the assembled tensors are ``rows``; returns the samples checked."""
    checked = 0
    for refs, batch in zip(batches, assembled, strict=True):
        routing = batch.routed_experts[0].numpy()
        offset = 0
        for sample in refs.samples:
            if not np.array_equal(routing[offset : offset + sample.tokens], rows[: sample.tokens]):
                raise BenchError(f"refbus fetch assembled wrong routing rows for {sample.sample_id}")
            offset += sample.tokens
            checked += 1
    return checked


def raw_fetch(ch: Channel, peers: list[tuple[str, int]], nbytes: int, repeats: int) -> list[float]:
    """The raw limit: ``nbytes`` per step over one TCP connection to each of ``peers`` (``raw_peer`` s, an equal
    share from each, received concurrently), into one preallocated (warm) buffer; checks the bytes."""
    buffer = np.ones(nbytes, dtype=np.uint8)
    share = nbytes // len(peers)
    views = [memoryview(buffer)[i * share : (i + 1) * share] for i in range(len(peers))]
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(peer, timeout=WAIT_S)) for peer in peers]

        def step() -> None:
            for sock in socks:
                sock.sendall(b"g")
            with ThreadPoolExecutor(len(socks)) as receivers:  # recv_into releases the GIL
                list(receivers.map(recv_exactly, socks, views))

        seconds = seconds_each(step, repeats + 1)[1:]
    if np.count_nonzero(buffer[: share * len(peers)] != RAW_BYTE):
        raise BenchError("raw TCP delivered wrong bytes")
    return seconds


def http_fetch(ch: Channel, batches: list[MicroBatchRefs], urls: dict[str, str], parallel: int,
               repeats: int) -> list[float]:
    """One GET per blob with ``parallel`` threads, then the same assembly into reused buffers."""
    from refbus.nodes.payload.assemble import assemble
    from refbus.nodes.payload.branch import Branch
    from refbus.nodes.payload.fetcher import BufferPool, to_micro_batch

    plans = [to_micro_batch(mb) for mb in batches]
    refs = {s.ref.blob_id: s.ref for mb in batches for s in mb.samples if s.ref is not None}
    pool = BufferPool()
    # As the HTTP design fetches: no proxies, one request per blob.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(blob_id: str) -> tuple[str, bytes]:
        with opener.open(urls[blob_id], timeout=WAIT_S) as response:
            return blob_id, response.read()

    with ThreadPoolExecutor(parallel) as pool_threads:
        def step() -> None:
            pool.recycle()
            bodies = dict(pool_threads.map(get, refs))
            shape = (LAYERS, TOP_K)
            branches = {blob_id: Branch(routed_experts=np.frombuffer(body, np.uint8).reshape(-1, *shape))
                        for blob_id, body in bodies.items()}
            for plan, mb in zip(plans, batches, strict=True):
                assemble(plan, [branches[s.ref.blob_id] for s in mb.samples if s.ref is not None], allocator=pool)

        return seconds_each(step, repeats + 1)[1:]


# --- tasks: baseline servers -----------------------------------------------------------------------------


class _BlobHandler(http.server.BaseHTTPRequestHandler):
    """GET /<blob id>: the blob's bytes (the design refbus replaces: stdlib threaded server, no checksum)."""

    blobs: dict[str, bytes] = {}
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = self.blobs.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """One line per request would dominate the bench."""


def http_server(ch: Channel, blob_ids: list[str], nbytes: int, seed: int, bind: str) -> None:
    """Serve ``blob_ids`` (``nbytes`` each, distinct objects like separately kept blobs) on ``bind`` until told
    to stop."""
    rows = routing_rows(nbytes, seed)
    handler = type("Handler", (_BlobHandler,), {"blobs": {blob_id: rows.tobytes() for blob_id in blob_ids}})
    server = http.server.ThreadingHTTPServer((bind, 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        ch.send(server.server_address[1])
        ch.recv(timeout_s=SERVE_S)  # stop
    finally:
        server.shutdown()
        server.server_close()


# --- tasks: orchestrator memory --------------------------------------------------------------------------


def peak_rss() -> int:
    """This process's peak resident set size in bytes: Linux's ``VmHWM``, the high-water mark of this address
    space, which begins at the ``exec`` that started the process. Not ``ru_maxrss``: Linux carries that over
    from the parent across fork and exec, so a spawned worker would report at least the bench parent's peak.

    Raises:
        BenchError: no ``VmHWM`` (not Linux).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise BenchError("no VmHWM in /proc/self/status: the memory section needs Linux")


def orchestrator_like(ch: Channel) -> int:
    """Hold every request body it receives (as an orchestrator holds what is in flight) until told to stop;
    returns its peak RSS in bytes (:func:`peak_rss`)."""
    ctx = zmq.Context()
    held: list[Any] = []
    try:
        sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
        server = Server(sock, WireCodec("bench-orchestrator"))

        def hold(request: Any) -> Ok:
            held.append(request.body)
            return Ok()

        server.on(EpisodeFinished.kind, hold)
        server.on(Keep.kind, hold)
        ch.send(bound_endpoint(sock))
        while not ch.poll(0):
            if sock.poll(20, zmq.POLLIN):
                server.handle_one()
        return peak_rss()
    finally:
        ctx.destroy(linger=0)


def produce(ch: Channel, endpoint: str, count: int, inline: bool) -> int:
    """Send ``count`` episodes of one 1 MiB routing blob: the arrays (inline) or a reference; bytes sent."""
    ctx = zmq.Context()
    rows = routing_rows(MEMORY_BLOB, seed=3)
    client = Client(ctx, endpoint, WireCodec("bench-env"), policy=PATIENT)
    try:
        def body(index: int) -> Keep | EpisodeFinished:
            if inline:
                return Keep(episode_id=f"ep-{index}", branches=[{"routed_experts": rows}])
            ref = BlobRef(endpoint="tcp://127.0.0.1:1", source="bench-env", blob_id=f"ep-{index}-b0",
                          fields=["routed_experts"], tokens=rows.shape[0], nbytes=rows.nbytes, checksum=index,
                          routing_shape=[LAYERS, TOP_K])
            return EpisodeFinished(episode_id=f"ep-{index}", source="bench-env", refs=[ref])

        outcomes = gather([(client, body(i)) for i in range(count)], window=8)
        if any(isinstance(o, Exception) for o in outcomes):
            raise BenchError(f"orchestrator refused: {next(o for o in outcomes if isinstance(o, Exception))}")
        return count * rows.nbytes
    finally:
        client.close()
        ctx.destroy(linger=0)


# --- the comparisons (parent side) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a fetch comparison runs: every process on this host (loopback), or across namespace hosts (the
    broker and the trainer on hostA, one env server and one baseline server on each of hostB and hostC)."""

    cluster: hosts.Hosts | None = None

    @property
    def section(self) -> str:
        return "fetch" if self.cluster is None else "fetch across hosts"

    @property
    def bind(self) -> str:
        """What servers bind: loopback on one host, every interface of their own host across hosts."""
        return "127.0.0.1" if self.cluster is None else "0.0.0.0"

    def server_address(self, index: int) -> str:
        """Where the trainer reaches baseline server ``index`` (0 or 1)."""
        return "127.0.0.1" if self.cluster is None else self.cluster[1 + index].name

    def prefix(self, index: int) -> list[str]:
        """What starts a node on host ``index`` (nothing on one host)."""
        return [] if self.cluster is None else self.cluster[index].argv(())

    def python(self, index: int) -> str | None:
        """What spawns a bench worker on host ``index`` (None: this interpreter, on this host)."""
        return None if self.cluster is None else self.cluster[index].python()


@contextlib.contextmanager
def env_servers(workdir: Path, where: Placement) -> Iterator[list[str]]:
    """A broker (host 0) and two ``refbus node env-server`` processes (hosts 1 and 2); their blob endpoints.
    Across hosts they bind every interface of their host and advertise its name, unencrypted (plain mode)."""
    plain = [] if where.cluster is None else ["--security-insecure", "true"]
    bus, control = start_bus(workdir, bind=where.bind, prefix=where.prefix(0), extra=plain)
    started: list[NodeProcess] = []
    try:
        for index, name in ((1, "env-a"), (2, "env-b")):
            started.append(NodeProcess(
                ["node", "env-server", *bus_flags(control), "--node-id", name, "--env-server-handover-lease-s", "3600",
                 "--env-server-endpoint", f"tcp://{where.bind}:0", "--env-server-budget-bytes", str(8 << 30),
                 "--node-metrics-port", "-1", "--node-log-level", "warning", *plain],
                workdir=workdir, name=name, prefix=where.prefix(index)))
        yield [proc.wait_ready()["endpoints"]["blobs"] for proc in started]
    finally:
        for proc in started:
            proc.stop()
        bus.stop()


def keep_all(ch: Channel, endpoints: Sequence[str], count: int, nbytes: int) -> list[BlobRef]:
    """A task: keep ``count`` routing blobs, alternating between the env servers; their references in step
    order."""
    ctx = zmq.Context()
    codec = WireCodec("bench-producer")
    clients = [Client(ctx, endpoint, codec, policy=PATIENT) for endpoint in endpoints]
    try:
        rows = routing_rows(nbytes, seed=count)
        calls = [(clients[i % len(clients)], Keep(episode_id=f"ep-{count}-{nbytes}-{i}",
                                                  branches=[{"routed_experts": rows}])) for i in range(count)]
        refs = []
        for outcome in gather(calls, window=4):
            if isinstance(outcome, Exception):
                raise BenchError(f"keep failed: {outcome}")
            assert isinstance(outcome.body, Kept)
            refs += outcome.body.refs
        return refs
    finally:
        for client in clients:
            client.close()
        ctx.destroy(linger=0)


def bench_fetch(settings: Settings, where: Placement, trainer: Worker, servers: Sequence[Worker],
                endpoints: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    figures: dict[str, Any] = {}
    repeats = settings.repeats
    for count, nbytes in settings.shapes:
        label = f"{count} x {nbytes // 1024} KiB" if nbytes < MIB else f"{count} x {nbytes // MIB} MiB"
        total = count * nbytes
        batches = micro_batches(servers[0].call(keep_all, endpoints, count, nbytes, timeout_s=WAIT_S * 4))
        timings, checked = trainer.call(refbus_fetch, batches, repeats, routing_rows(nbytes, seed=count),
                                        timeout_s=WAIT_S * (repeats + 1))
        ours = min([total_s for total_s, _ in timings])
        transfer = min([transfer_s for _, transfer_s in timings])

        # Across hosts the same bytes come from both env servers' hosts, half from each at once, as the blobs
        # do; on one host from one process, as the loopback figures always were (comparable across runs).
        raw_servers = servers if where.cluster is not None else servers[:1]
        for server in raw_servers:
            server.submit(raw_peer, total // len(raw_servers), repeats + 1, "pull", where.bind)
        peers = [(where.server_address(i), server.message()) for i, server in enumerate(raw_servers)]
        raw = min(trainer.call(raw_fetch, peers, total, repeats))
        for server in raw_servers:
            server.result()

        ids = [s.ref.blob_id for mb in batches for s in mb.samples if s.ref is not None]
        halves = (ids[0::2], ids[1::2])
        urls: dict[str, str] = {}
        for server, half, seed in zip(servers, halves, (1, 2), strict=True):
            server.submit(http_server, half, nbytes, seed, where.bind)
        for index, (server, half) in enumerate(zip(servers, halves, strict=True)):
            port = server.message()
            urls |= {blob_id: f"http://{where.server_address(index)}:{port}/{blob_id}" for blob_id in half}
        try:
            http_by_parallel = {p: min(trainer.call(http_fetch, batches, urls, p, repeats,
                                                          timeout_s=WAIT_S * (repeats + 1)))
                                for p in HTTP_PARALLEL}
        finally:
            for server in servers:
                server.tell("stop")
            for server in servers:
                server.result()
        best_parallel = min(http_by_parallel, key=http_by_parallel.__getitem__)
        http_s = http_by_parallel[best_parallel]
        big = nbytes >= MIB
        section = where.section
        rows += [
            Row(section, f"{label} → assembled (vs raw TCP, bytes only)", "GB/s", total / ours / 1e9,
                total / raw / 1e9, 0.80 if big else 0.50),
            Row(section, f"{label} → assembled (vs HTTP, best: {best_parallel} parallel; raw TCP "
                         f"{total / raw / 1e9:.2f} GB/s)", "GB/s", total / ours / 1e9, total / http_s / 1e9,
                1.2 if big else 5.0),
            Row(section, f"{label} → received + verified (vs raw TCP)", "GB/s", total / transfer / 1e9,
                total / raw / 1e9, None),
        ]
        figures[label] = {"refbus_s": ours, "refbus_transfer_s": transfer, "raw_s": raw,
                          "http_s": {str(p): s for p, s in http_by_parallel.items()},
                          "bytes": total, "samples_checked": checked}
    return rows, figures


def bench_memory(settings: Settings, producer) -> tuple[list[Row], dict[str, Any]]:
    count = settings.in_flight_bytes // MEMORY_BLOB
    peaks: dict[str, int] = {}
    for mode in ("reference", "inline"):
        for n in (0, count):
            with workers(f"bench-orchestrator-{mode}-{n}") as (orchestrator,):
                orchestrator.submit(orchestrator_like)
                endpoint = orchestrator.message()
                if n:
                    producer.call(produce, endpoint, n, mode == "inline", timeout_s=WAIT_S * 4)
                orchestrator.tell("stop")
                peaks[f"{mode}-{n}"] = orchestrator.result()
    in_flight = count * MEMORY_BLOB
    size = f"{in_flight / (1 << 30):g} GiB" if in_flight >= 1 << 30 else f"{in_flight // MIB} MiB"
    by_ref_0, by_ref = peaks["reference-0"], peaks[f"reference-{count}"]
    inline_growth = peaks[f"inline-{count}"] - peaks["inline-0"]
    rows = [
        Row("memory", f"orchestrator peak RSS, {size} in flight by reference (vs none)", "MiB", by_ref / MIB,
            by_ref_0 / MIB, 1.05, higher_is_better=False),
        Row("memory", f"orchestrator RSS growth, {size} in flight inline (vs bytes in flight)", "MiB",
            inline_growth / MIB, in_flight / MIB, 0.95),
    ]
    return rows, {"peak_rss_bytes": peaks, "in_flight_bytes": in_flight}


def run(settings: Settings, sections: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    with workers("bench-trainer", "bench-server-a", "bench-server-b") as (trainer, server_a, server_b):
        if "fetch" in sections:
            where = Placement()
            with TemporaryDirectory(prefix="refbus-bench-") as workdir, \
                    env_servers(Path(workdir), where) as endpoints:
                fetch_rows, extra["fetch"] = bench_fetch(settings, where, trainer, (server_a, server_b), endpoints)
                rows += fetch_rows
            extra["env_servers"] = "refbus node env-server processes (real), one broker"
        if "memory" in sections:
            memory_rows, extra["memory"] = bench_memory(settings, server_b)
            rows += memory_rows
    return rows, extra


def run_across_hosts(settings: Settings) -> tuple[list[Row], dict[str, Any]]:
    """The fetch comparison on three namespace hosts (``bench.hosts``, needs root): the broker and the trainer
    on hostA, an env server and a baseline server on each of hostB and hostC; everything is torn down after."""
    cluster = hosts.build(3)
    try:
        where = Placement(cluster)
        with TemporaryDirectory(prefix="refbus-bench-") as workdir, env_servers(Path(workdir), where) as endpoints, \
                workers("bench-trainer", python=where.python(0)) as (trainer,), \
                workers("bench-server-b", python=where.python(1)) as (server_b,), \
                workers("bench-server-c", python=where.python(2)) as (server_c,):
            rows, fetch = bench_fetch(settings, where, trainer, (server_b, server_c), endpoints)
    finally:
        cluster.down()
    return rows, {"fetch": fetch, "env_servers": "refbus node env-server processes (real) on hostB and hostC, "
                  "one broker on hostA", "hosts": [f"{h.name} {h.address}" for h in cluster]}


SECTIONS = ("fetch", "memory")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, prog="python -m bench.payload", description=__doc__.split("\n\n")[0],
                      quick_help="fewer repeats and 256 MiB in flight (~20 s)", sections=SECTIONS,
                      hosts_help="fetch only, across three namespace hosts (needs root): env servers on hostB "
                                 "and hostC, the trainer on hostA, baselines between the same hosts")
    configure_logging(level="warning")
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    rows, extra = run_across_hosts(settings) if args.hosts else run(settings, args.only or SECTIONS)
    print(format_table(rows))
    if "env_servers" in extra:
        where = " on hostA" if args.hosts else ""
        print(f"\nenv servers: {extra['env_servers']}; trainer: StepFetcher in its own process{where}")
    elapsed = time.monotonic() - started
    print(run_line(args.quick, elapsed))
    if args.json:
        write_json(args.json, figures(settings, args.quick, elapsed, rows, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
