"""Payload benchmarks: a trainer rank's fetch by reference, and the orchestrator's memory, against baselines
measured in the same run and process tree.

1. **fetch**: one step's arrays for a trainer rank from two env servers (real ``refbus node env-server``
   processes on a real broker), timed until the assembled torch tensors are ready (``StepFetcher`` start + finish:
   fetch, verify, assemble into reused buffers), in two shapes: 64 blobs of 4 MiB and 1024 blobs of 64 KiB
   of uint8 routing rows (``[tokens, 64 layers, top-8]``, 512 B per token), each blob with bytes of its own
   (seeded by its index). Every step of every side is checked: its buffers are filled with a sentinel before
   it and every sample's rows compared with its blob's after, both off the clock, so a fetch that wrote
   nothing or swapped two blobs fails the bench. Baselines:
   (a) raw: the same bytes over plain TCP into a preallocated buffer (``sendall`` / ``recv_into``), half from
   each of two server processes at once, as the blobs come from two env servers (across hosts: from their
   hosts), received by threads started before the clock; nothing assembled but checked;
   (b) http: a stdlib ``ThreadingHTTPServer`` per env server holding its blobs, speaking HTTP/1.1 without Nagle
   delays, a GET per blob from a thread pool whose every thread keeps one connection per server open across
   steps (``http.client``), then the same assembly into the same kind of reused buffers (so the comparison
   isolates the transport); its parallelism (1, 2, 4 or 8 threads) is chosen before it is timed, by one
   untimed warm-up and one step at each; (c) bare ZeroMQ: the same frames from two processes on a ROUTER each
   to a DEALER each in the trainer, as many to a message as a default ``fetch`` request asks for, received
   zero-copy and nothing done with them: the transport's own ceiling, beside raw TCP and beside refbus
   (informational rows: what refbus's decoding, verification and assembly cost on top of ZeroMQ, and what
   ZeroMQ costs on top of TCP). Goals: >= 80% of raw at 4 MiB and >= 50% at 64 KiB; >= 1.2x http
   at 4 MiB and >= 5x at 64 KiB (the http rows name the raw figure too). An informational row shows refbus
   until every blob is received and verified (before assembly copies the uint8 rows into the batch tensors).
2. **memory**: peak RSS of an orchestrator-like child (a request server on the refbus wire that holds what it
   receives) with 0 and with N GiB of arrays in flight, by reference (it receives ``episode-finished`` with
   one ``BlobRef`` per 1 MiB blob) and inline (it receives the arrays as frames). Goals: by reference grows
   < 5%; inline grows by the full amount (>= 95% of the bytes in flight). A fresh child per variant, whose
   peak is read as ``VmHWM`` (the high-water mark of its own address space, from its ``exec``), so it is that
   variant's alone (``ru_maxrss`` would carry over the bench parent's peak).

Every timing is the best of the repeats after one warm-up (steady state, as in training; best-of because the
machine may be shared), taken the same way and over as many steps for refbus and every baseline. Workers are
spawned processes (``bench.harness.workers``); every wait is bounded and every process reaped.

Across hosts (``--hosts``, needs root): the fetch comparison on three namespace hosts (``bench.hosts``): the
broker and the trainer on hostA, an env server and a baseline server (raw peer, HTTP) on each of hostB and
hostC, every baseline between the same hosts in the same run; the memory section is host-independent and
does not run.

    python -m bench.payload [--quick] [--hosts] [--json PATH]
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import TYPE_CHECKING, Any

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
    workers,
    write_json,
)

if TYPE_CHECKING:
    from refbus.bus.calls import Calls
    from refbus.nodes.payload.fetcher import StepFetcher

LAYERS, TOP_K = 64, 8
TOKEN_BYTES = LAYERS * TOP_K  # uint8 routing: 512 B per token
SEQ_LEN = 65_536  # tokens per micro batch: 32 MiB of uint8 routing in and out
HTTP_PARALLEL = (1, 2, 4, 8)  # the HTTP baseline's settings, tried once each before it is timed
SENTINEL = 0xFF  # what every checked buffer holds before a step: no routing byte (expert ids are below 128)
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


def blob_rows(nbytes: int, index: int) -> np.ndarray:
    """Blob ``index``'s routing rows: ``nbytes`` of ``[tokens, LAYERS, TOP_K]`` uint8 expert ids below 128,
    seeded by ``index``, so no two blobs hold the same bytes and a fetch that put one blob's rows where
    another's belong fails its check. (Random bytes masked to 7 bits: a fifth of the cost of drawing
    integers, which counts at hundreds of MiB per shape in every process that makes or checks them.)"""
    raw = np.frombuffer(np.random.default_rng(index).bytes(nbytes // TOKEN_BYTES * TOKEN_BYTES), dtype=np.uint8)
    return (raw & 0x7F).reshape(-1, LAYERS, TOP_K)


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


@contextlib.contextmanager
def step_fetcher(holder: str) -> Iterator[tuple[StepFetcher, Calls]]:
    """A ``StepFetcher`` and the ``Calls`` that drive it (no node loop: ``Calls.run_until``), as a trainer
    rank's; every client closed on exit."""
    from refbus.bus.calls import Calls
    from refbus.nodes.payload.fetcher import StepFetcher

    ctx = zmq.Context()
    codec = WireCodec(holder)
    clients: list[Client] = []

    def connect(endpoint: str) -> Client:
        clients.append(Client(ctx, endpoint, codec, policy=PATIENT))
        return clients[-1]

    calls = Calls(connect, PATIENT)
    try:
        yield StepFetcher(holder, calls), calls
    finally:
        for client in clients:
            client.close()
        ctx.destroy(linger=0)


def checked_fetches(fetcher: StepFetcher, calls: Calls, batches: Sequence[MicroBatchRefs],
                    expected: Mapping[str, np.ndarray], runs: int) -> list[tuple[float, float]]:
    """``runs`` steps of ``fetcher`` over ``batches`` (start, then finish while another thread drives the requests,
    as a rank's node loop does); (total, transfer) seconds of each, as the fetcher times them. Before each step
    every buffer its pool will reuse (the previous step's tensors) is filled with ``SENTINEL``, and after it every
    sample is checked against ``expected`` (blob id -> its rows): both off the clock, so a step that wrote
    nothing, or put one blob's rows in another's place, fails instead of passing on an earlier step's bytes.

    Raises:
        BenchError: a fetch failed or outlived its deadline, or a step assembled other rows than ``expected``.
    """
    from refbus.nodes.payload.assemble import AssembledBatch
    from refbus.nodes.payload.fetcher import FetchUnfinished

    seconds = []
    previous: Sequence[Any] = ()
    for step in range(runs):
        fill_sentinel(previous)
        in_flight = fetcher.start(step, batches)
        # As in a trainer rank: one thread drives the requests (its node loop), this one assembles what has come.
        driven: list[bool] = []
        loop = threading.Thread(target=lambda fetch=in_flight, ended=driven: ended.append(
            calls.run_until(lambda: fetch.done, 2 * PATIENT.deadline_s)), name="bench-loop")
        loop.start()
        try:
            result = fetcher.finish(in_flight, timeout_s=3 * PATIENT.deadline_s)
        except FetchUnfinished as exc:
            raise BenchError(f"refbus fetch: {exc}") from None
        finally:
            loop.join()
        if driven != [True]:
            raise BenchError("refbus fetch: requests outlived their deadline")
        if result.failed or not all(isinstance(b, AssembledBatch) for b in result.batches):
            raise BenchError(f"refbus fetch failed: {result.batches[result.failed[0]]}")
        check_assembled(batches, result.batches, expected)
        seconds.append((result.seconds, result.transfer_seconds))
        previous = result.batches
    return seconds


def expected_rows(indexes: Mapping[str, int], nbytes: int) -> dict[str, np.ndarray]:
    """Blob id -> the rows it was kept with (:func:`blob_rows` of its index)."""
    return {blob_id: blob_rows(nbytes, index) for blob_id, index in indexes.items()}


def refbus_fetch(ch: Channel, batches: list[MicroBatchRefs], indexes: dict[str, int], nbytes: int,
                 repeats: int) -> tuple[list[tuple[float, float]], int]:
    """``StepFetcher`` start + finish of the step ``repeats + 1`` times, every one checked
    (:func:`checked_fetches`); (total, transfer) seconds of the timed ones (the first is a warm-up) and how
    many samples were checked in all."""
    expected = expected_rows(indexes, nbytes)
    with step_fetcher("bench-trainer") as (fetcher, calls):
        seconds = checked_fetches(fetcher, calls, batches, expected, repeats + 1)
    return seconds[1:], (repeats + 1) * sum(len(mb.samples) for mb in batches)


def fill_sentinel(assembled: Sequence[Any]) -> None:
    """Every byte of every tensor of ``assembled`` (``AssembledBatch`` es) set to ``SENTINEL``."""
    import torch

    for batch in assembled:
        for field in dataclasses.fields(batch):
            value = getattr(batch, field.name)
            if isinstance(value, torch.Tensor):
                value.view(torch.uint8).fill_(SENTINEL)


def check_assembled(batches: Sequence[MicroBatchRefs], assembled: Sequence[Any],
                    expected: Mapping[str, np.ndarray]) -> None:
    """Every sample's routing rows in the assembled tensors are its blob's ``expected`` rows.

    Raises:
        BenchError: naming the first sample whose rows differ.
    """
    for refs, batch in zip(batches, assembled, strict=True):
        routing = batch.routed_experts[0].numpy()
        offset = 0
        for sample in refs.samples:
            rows = expected[sample.sample_id][: sample.tokens]
            if not np.array_equal(routing[offset : offset + sample.tokens], rows):
                raise BenchError(f"a fetch assembled wrong routing rows for {sample.sample_id}")
            offset += sample.tokens


def raw_fetch(ch: Channel, peers: list[tuple[str, int]], nbytes: int, repeats: int) -> list[float]:
    """The raw limit: ``nbytes`` per step over one TCP connection to each of ``peers`` (``raw_peer`` s, an equal
    share from each, received concurrently by threads started before the clock), into one preallocated (warm)
    buffer, ``repeats + 1`` times (the first a warm-up); before each step the buffer is filled with
    ``SENTINEL`` and after it every byte is checked, both off the clock, as the refbus fetch's are."""
    buffer = np.ones(nbytes, dtype=np.uint8)
    share = nbytes // len(peers)
    views = [memoryview(buffer)[i * share : (i + 1) * share] for i in range(len(peers))]
    received = buffer[: share * len(peers)]
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(peer, timeout=WAIT_S)) for peer in peers]
        receivers = stack.enter_context(ThreadPoolExecutor(len(socks)))  # recv_into releases the GIL
        seconds = []
        for _ in range(repeats + 1):
            received.fill(SENTINEL)
            start = time.perf_counter()
            for sock in socks:
                sock.sendall(b"g")
            list(receivers.map(recv_exactly, socks, views))
            seconds.append(time.perf_counter() - start)
            if np.count_nonzero(received != RAW_BYTE):
                raise BenchError("raw TCP delivered wrong bytes")
    return seconds[1:]


def zmq_fetch(ch: Channel, peers: list[tuple[str, int]], count: int, nbytes: int, repeats: int) -> list[float]:
    """The transport's own ceiling: ``count`` frames of ``nbytes`` per step, half from each of ``peers``
    (``zmq_peer`` s, a DEALER to each in one context, as a rank has one client per env server), received zero-copy
    and held to the end of the step as a fetch holds its frames, nothing else done with them; ``repeats + 1``
    steps (the first a warm-up), each one's frames checked off the clock as the raw pull's bytes are."""
    ctx = zmq.Context()
    socks = [make_socket(ctx, zmq.DEALER, connect=f"tcp://{host}:{port}") for host, port in peers]
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    share = count // len(peers)
    seconds = []
    try:
        for _ in range(repeats + 1):
            frames: list[zmq.Frame] = []
            start = time.perf_counter()
            for sock in socks:
                sock.send(b"g")
            while len(frames) < share * len(peers):
                ready = dict(poller.poll(WAIT_S * 1000))
                if not ready:
                    raise BenchError("bare ZeroMQ: no frames within the wait")
                for sock in ready:
                    frames += sock.recv_multipart(copy=False)
            seconds.append(time.perf_counter() - start)
            if any(len(frame) != nbytes or np.count_nonzero(np.frombuffer(frame, np.uint8) != RAW_BYTE)
                   for frame in frames):
                raise BenchError("bare ZeroMQ delivered wrong frames")
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    return seconds[1:]


def http_fetch(ch: Channel, batches: list[MicroBatchRefs], servers: dict[str, tuple[str, int]],
               indexes: dict[str, int], nbytes: int, parallel: int, repeats: int) -> list[float]:
    """The HTTP design at its best: one GET per blob (``servers``: blob id -> the server's address and port)
    from ``parallel`` threads, each holding one keep-alive connection per server for the whole task, then the
    same assembly into reused buffers; ``repeats + 1`` steps (the first a warm-up, which also opens the
    connections), each from buffers filled with ``SENTINEL`` and checked after, off the clock, as the refbus
    fetch's are. Seconds of the timed ones."""
    from refbus.nodes.payload.assemble import assemble
    from refbus.nodes.payload.branch import Branch
    from refbus.nodes.payload.fetcher import BufferPool, to_micro_batch

    plans = [to_micro_batch(mb) for mb in batches]
    expected = expected_rows(indexes, nbytes)
    pool = BufferPool()
    local = threading.local()
    opened: list[http.client.HTTPConnection] = []

    def get(blob_id: str) -> tuple[str, bytes]:
        connections = local.__dict__.setdefault("connections", {})
        server = servers[blob_id]
        if server not in connections:
            connections[server] = http.client.HTTPConnection(*server, timeout=WAIT_S)  # sets TCP_NODELAY
            opened.append(connections[server])
        connection = connections[server]
        connection.request("GET", f"/{blob_id}")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200 or response.will_close:
            raise BenchError(f"HTTP GET {blob_id}: status {response.status}, keep-alive {not response.will_close}")
        return blob_id, body

    seconds = []
    try:
        with ThreadPoolExecutor(parallel) as threads:
            assembled: list[Any] = []
            for _ in range(repeats + 1):
                fill_sentinel(assembled)
                start = time.perf_counter()
                pool.recycle()
                bodies = dict(threads.map(get, servers))
                branches = {blob_id: Branch(routed_experts=np.frombuffer(body, np.uint8).reshape(-1, LAYERS, TOP_K))
                            for blob_id, body in bodies.items()}
                assembled = [assemble(plan, [branches[s.ref.blob_id] for s in mb.samples if s.ref is not None],
                                      allocator=pool) for plan, mb in zip(plans, batches, strict=True)]
                seconds.append(time.perf_counter() - start)
                check_assembled(batches, assembled, expected)
    finally:
        for connection in opened:
            connection.close()
    return seconds[1:]


# --- tasks: baseline servers -----------------------------------------------------------------------------


def zmq_peer(ch: Channel, count: int, nbytes: int, runs: int, bind: str) -> None:
    """The bare-ZeroMQ ceiling's far end, a ROUTER on a port of ``bind`` (its port reported first): for each
    order, ``count`` frames of ``nbytes`` of ``RAW_BYTE`` sent zero-copy as refbus's replies carry them, as
    many to a message as a default ``fetch`` request asks for (``FetchSettings``: at most ``blobs_per_request``
    and about ``request_bytes``)."""
    from refbus.nodes.payload.fetcher import FetchSettings

    settings = FetchSettings()
    per_message = max(1, min(settings.blobs_per_request, -(-settings.request_bytes // nbytes)))
    frames = [np.full(nbytes, RAW_BYTE, dtype=np.uint8) for _ in range(count)]
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind=f"tcp://{bind}:0")
    sock.sndhwm = 0  # a step's frames go out at once, as a fetch's window of requests would have them
    try:
        ch.send(int(bound_endpoint(sock).rpartition(":")[2]))
        for _ in range(runs):
            if not sock.poll(WAIT_S * 1000):
                raise BenchError("bare ZeroMQ client went away")
            identity, _ = sock.recv_multipart()
            for first in range(0, count, per_message):
                part = frames[first : first + per_message]
                sock.send_multipart([identity, *part], copy=False)
    finally:
        sock.close(linger=int(WAIT_S * 1000))
        ctx.term()




class _BlobHandler(http.server.BaseHTTPRequestHandler):
    """GET /<blob id>: the blob's bytes (the design refbus replaces: stdlib threaded server, no checksum), at
    its best: HTTP/1.1, so a client's connection stays open across requests (the stdlib default, HTTP/1.0,
    closes it after each), and no Nagle delay between the headers and the body's last segment."""

    blobs: dict[str, bytes] = {}
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

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


def http_server(ch: Channel, indexes: dict[str, int], nbytes: int, bind: str) -> None:
    """Serve each blob of ``indexes`` (blob id -> index) with the bytes it was kept with (:func:`blob_rows`)
    on ``bind`` until told to stop."""
    blobs = {blob_id: blob_rows(nbytes, index).tobytes() for blob_id, index in indexes.items()}
    handler = type("Handler", (_BlobHandler,), {"blobs": blobs})
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
    rows = blob_rows(MEMORY_BLOB, index=3)
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
    """A task: keep ``count`` routing blobs, blob ``i`` holding :func:`blob_rows` of ``i``, alternating between
    the env servers; their references in step order (``i``'s ``i``-th)."""
    ctx = zmq.Context()
    codec = WireCodec("bench-producer")
    clients = [Client(ctx, endpoint, codec, policy=PATIENT) for endpoint in endpoints]
    try:
        calls = [(clients[i % len(clients)], Keep(episode_id=f"ep-{count}-{nbytes}-{i}",
                                                  branches=[{"routed_experts": blob_rows(nbytes, i)}]))
                 for i in range(count)]
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
    """Per shape: the refbus fetch, the raw baseline and the HTTP baseline, each ``repeats + 1`` checked steps
    of which the first is dropped and the best of the rest counts. Which parallelism the HTTP baseline runs
    with is chosen before it is timed, by one warm-up and one step at each of ``HTTP_PARALLEL`` (figures kept
    as ``http_calibration_s``), so its best is taken over as many steps as refbus's."""
    rows: list[Row] = []
    figures: dict[str, Any] = {}
    repeats = settings.repeats
    for count, nbytes in settings.shapes:
        label = f"{count} x {nbytes // 1024} KiB" if nbytes < MIB else f"{count} x {nbytes // MIB} MiB"
        total = count * nbytes
        batches = micro_batches(servers[0].call(keep_all, endpoints, count, nbytes, timeout_s=WAIT_S * 4))
        ids = [s.ref.blob_id for mb in batches for s in mb.samples if s.ref is not None]
        indexes = {blob_id: index for index, blob_id in enumerate(ids)}  # blob i was kept with blob_rows(i)
        timings, checked = trainer.call(refbus_fetch, batches, indexes, nbytes, repeats,
                                        timeout_s=WAIT_S * (repeats + 1))
        ours = min([total_s for total_s, _ in timings])
        transfer = min([transfer_s for _, transfer_s in timings])

        # The same bytes from two server processes, half from each at once, as the blobs come from the two env
        # servers (across hosts: from their hosts).
        for server in servers:
            server.submit(raw_peer, total // len(servers), repeats + 1, "pull", where.bind)
        peers = [(where.server_address(i), server.message()) for i, server in enumerate(servers)]
        raw = min(trainer.call(raw_fetch, peers, total, repeats, timeout_s=WAIT_S * (repeats + 1)))
        for server in servers:
            server.result()

        # The same frames over bare ZeroMQ from the same two processes: what the transport itself reaches.
        for server in servers:
            server.submit(zmq_peer, count // len(servers), nbytes, repeats + 1, where.bind)
        peers = [(where.server_address(i), server.message()) for i, server in enumerate(servers)]
        bare = min(trainer.call(zmq_fetch, peers, count, nbytes, repeats, timeout_s=WAIT_S * (repeats + 1)))
        for server in servers:
            server.result()

        # Each HTTP server holds the blobs its env server keeps (even indexes on the first, odd on the second).
        halves = ({i: n for i, n in indexes.items() if n % 2 == 0}, {i: n for i, n in indexes.items() if n % 2})
        addresses: dict[str, tuple[str, int]] = {}
        for server, half in zip(servers, halves, strict=True):
            server.submit(http_server, half, nbytes, where.bind)
        for index, (server, half) in enumerate(zip(servers, halves, strict=True)):
            port = server.message()
            addresses |= dict.fromkeys(half, (where.server_address(index), port))
        try:
            calibration = {p: min(trainer.call(http_fetch, batches, addresses, indexes, nbytes, p, 1,
                                               timeout_s=WAIT_S * 2)) for p in HTTP_PARALLEL}
            best_parallel = min(calibration, key=calibration.__getitem__)
            http_s = min(trainer.call(http_fetch, batches, addresses, indexes, nbytes, best_parallel, repeats,
                                      timeout_s=WAIT_S * (repeats + 1)))
        finally:
            for server in servers:
                server.tell("stop")
            for server in servers:
                server.result()
        big = nbytes >= MIB
        section = where.section
        rows += [
            Row(section, f"{label} → assembled (vs raw TCP from both servers, bytes only)", "GB/s",
                total / ours / 1e9, total / raw / 1e9, 0.80 if big else 0.50),
            Row(section, f"{label} → assembled (vs HTTP keep-alive, {best_parallel} parallel; raw TCP "
                         f"{total / raw / 1e9:.2f} GB/s)", "GB/s", total / ours / 1e9, total / http_s / 1e9,
                1.2 if big else 5.0),
            Row(section, f"{label} → received + verified (vs raw TCP)", "GB/s", total / transfer / 1e9,
                total / raw / 1e9, None),
            Row(section, f"{label} → bare ZeroMQ frames received, nothing done with them (vs raw TCP)", "GB/s",
                total / bare / 1e9, total / raw / 1e9, None),
            Row(section, f"{label} → assembled (vs bare ZeroMQ frames received)", "GB/s", total / ours / 1e9,
                total / bare / 1e9, None),
        ]
        figures[label] = {"refbus_s": ours, "refbus_transfer_s": transfer, "raw_s": raw, "zmq_s": bare,
                          "http_s": http_s,
                          "http_parallel": best_parallel,
                          "http_calibration_s": {str(p): s for p, s in calibration.items()},
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
