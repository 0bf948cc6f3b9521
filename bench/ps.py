"""Parameter-server benchmarks: refbus against their baselines, measured in the same run.

1. **transfer**: push then pull of a state dict (1 GiB, ~200 tensors of mixed sizes and dtypes) on one host,
   through shared memory and through ZeroMQ frames, against a memcpy of the same bytes into buffers that are
   already mapped, and against ``torch.save`` + ``torch.load`` through /dev/shm and through the disk (the
   filesystem weight broadcast). Goals: same-host pull >= 50% of memcpy bandwidth; push + pull >= 3x the
   torch.save/load path. Pushes and pulls are steady state (segments and destination buffers reused, as a
   trainer and a rollout worker do every step); the first, cold push is reported too. Every timed pull into
   buffers starts from buffers zeroed outside the timer and is checked against the pushed state after, so a
   pull that wrote nothing fails instead of passing on an earlier pull's bytes; the memcpy baseline is timed
   the same way (the best of as many runs as a pull, after one warm-up dropped on both sides). The frames path (the one
   every pull from another host takes) is also set against raw TCP between this process and another one on
   the same host (``sendall`` / ``recv_into`` of the same bytes into a warm buffer, each way); goal: push and
   pull >= 80% of it. The ceiling row sets raw TCP push + pull against torch.save/load: no transport over
   this TCP beats it, so it says whether the 3x goal is reachable on the machine at all. With NIXL
   installed (the ``nixl`` extra), a pull over NIXL READs is set against the frames pull and raw TCP
   (skipped, saying why, without it).
2. **broadcast**: init of N = 2, 4, 8 workers from a 256 MiB safetensors file (N copies of every retained
   version must fit in this machine's 24 GiB), against every worker reading the file
   itself (N concurrent reader processes) and against the reader sending to each worker in turn (N - 1
   two-worker inits one after another). Reports file reads (goal: 1) and time.
3. **pull under push**: latency of a pull (shared memory, into reused buffers) while another process pushes
   the next versions back to back, against no push running (goal: within 1.2x).
4. **replicas**: a same-host push with ``ps.replicas`` 2 (the default: the pusher writes a copy to each of
   two workers) against ``ps.replicas`` 1, as a ratio of push times (no goal: the price of surviving a
   worker's death).

Sections 1-3 run with ``ps.replicas`` 1, so their figures compare with those before replicas existed.

Every process is a real node (``NodeProcess``) or a spawned worker (``bench.harness.workers``), every wait is
bounded, everything is stopped and no segment is left in /dev/shm.

Across hosts (``--hosts``, needs root; ``bench.hosts``, 1 + max N namespace hosts): the broker, the manager
and the client (a bench worker) on hostA, one ps-worker per other host. (a) Frames pull and push between
the worker on hostB and the client against raw TCP between the same two hosts, in interleaved rounds
(goal >= 80%). (b) Every host's link capped with ``tc`` at ``--cap-mbit`` each way; broadcast init over
N = 2, 4, 8 workers against the reader sending to each in turn (goal: faster for N >= 4) and against
``ceil(log2 N) x size / link rate`` (goal: within 1.2x). A table of ratios, like the other benches.

    python -m bench.ps [--quick] [--only SECTION ...] [--hosts [--cap-mbit M]] [--json PATH]
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from refbus.bus.logs import configure_logging
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import NodeProcess, start_bus
from refbus.nodes.ps.broadcast import rounds
from refbus.nodes.ps.client import PsClient
from refbus.nodes.ps.nixl import NixlError
from refbus.nodes.ps.shm import sweep_orphans
from refbus.protocol.messages_ps import InitResult
from safetensors.torch import save_file

from bench import hosts
from bench.harness import (
    GIB,
    MIB,
    RAW_BYTE,
    WAIT_S,
    BenchError,
    Channel,
    Row,
    Worker,
    best_seconds,
    figures,
    format_table,
    parse_args,
    raw_peer,
    recv_exactly,
    seconds_each,
    workers,
    write_json,
)

RETAIN = 2
SECTIONS = ("transfer", "broadcast", "pull-under-push", "replicas")
CAP_MBIT = 1000  # a link capped below what two cores move, so that the link is what limits a broadcast
TRANSFER_ROUNDS = 2  # across hosts: raw TCP and frames measured in turn, this many times
PUSHER_WAIT_S = 120.0  # a push of the full state with the machine saturated, plus the pusher's start-up


@dataclass(frozen=True)
class Settings:
    state_bytes: int
    tensors: int
    repeats: int
    broadcast_sizes: tuple[int, ...]
    broadcast_bytes: int  # smaller than state_bytes: 8 workers x retained versions must fit in RAM
    latency_pulls: int


FULL = Settings(GIB, 200, 3, (2, 4, 8), 256 * MIB, 20)
QUICK = Settings(32 * MIB, 50, 2, (2, 4), 16 * MIB, 10)


def make_state(total: int, count: int, seed: int = 0, prefix: str = "layers") -> dict[str, torch.Tensor]:
    """``count`` tensors totalling about ``total`` bytes: log-uniform sizes, 3/4 bfloat16 and 1/4 float32.

    Shapes depend only on ``total`` and ``count`` (every version of one model has the same), values on ``seed``.
    """
    weights = torch.exp(torch.rand(count, generator=torch.Generator().manual_seed(0)) * 9)  # ~4 decades of sizes
    gen = torch.Generator().manual_seed(seed)
    sizes = (weights / weights.sum() * total).long().clamp(min=64)
    state = {}
    for i, size in enumerate(sizes.tolist()):
        dtype = torch.float32 if i % 4 == 0 else torch.bfloat16
        numel = max(1, size // (4 if dtype == torch.float32 else 2))
        cols = 256 if numel >= 256 else 1
        state[f"{prefix}.{i}.weight"] = torch.randn(numel // cols, cols, generator=gen).to(dtype)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class Cluster:
    workdir: Path
    control: str
    manager: str
    prefix: str
    procs: list[NodeProcess]

    def client(self, name: str, **kwargs: Any) -> tuple[NodeRuntime, PsClient]:
        return client(self.control, self.manager, name, **kwargs)


@contextmanager
def cluster(ps_workers: int, replicas: int = 1, on: hosts.Hosts | None = None) -> Iterator[Cluster]:
    """A broker, a ps-manager and ``ps_workers`` ps-workers (``w0``, ``w1``, ...) on this host; or ``on``
    namespace hosts: the broker and the manager on the first, worker ``wI`` on host ``I + 1``, every node
    binding its host's interfaces and advertising its name, unencrypted (plain mode)."""
    workdir = Path(tempfile.mkdtemp(prefix="refbus-bench-ps-"))
    prefix = f"refbus-bench-{os.getpid()}"
    bind = "127.0.0.1" if on is None else "0.0.0.0"
    plain = [] if on is None else ["--security-insecure", "true"]

    def placed(index: int) -> list[str]:
        return [] if on is None else on[index].argv(())

    # A generous node timeout: the bench saturates both cores on purpose, and a starved loop must not be
    # mistaken for a dead node (liveness is what the tests check, not this). The longest the default request
    # retry schedule (14 s) allows.
    bus, control = start_bus(workdir, extra=["--bus-node-timeout-s", "12", *plain], bind=bind, prefix=placed(0))
    procs = [bus]
    try:
        flags = ["--bus-control", control, "--ps-shm-prefix", prefix, "--ps-retain-versions", str(RETAIN),
                 "--ps-max-free-segments", "1", "--node-log-level", "warning", "--ps-replicas", str(replicas),
                 *plain]
        manager = NodeProcess(["node", "ps-manager", "--node-id", "mgr", "--ps-manager", f"tcp://{bind}:0",
                               *flags], workdir=workdir, name="mgr", prefix=placed(0))
        procs.append(manager)
        endpoint = manager.wait_ready()["endpoints"]["ps"]
        started = [NodeProcess(["node", "ps-worker", "--node-id", f"w{i}", "--ps-manager", endpoint,
                                "--ps-worker", f"tcp://{bind}:0", *flags],
                               workdir=workdir, name=f"w{i}", prefix=placed(i + 1)) for i in range(ps_workers)]
        procs += started
        for proc in started:
            proc.wait_ready()
        yield Cluster(workdir, control, endpoint, prefix, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
        sweep_orphans("/dev/shm", prefix)
        shutil.rmtree(workdir, ignore_errors=True)


def client(control: str, manager: str, name: str, **kwargs: Any) -> tuple[NodeRuntime, PsClient]:
    """A PS client that does not register on the bus (the caller closes its runtime)."""
    runtime = NodeRuntime("bench", RuntimeSettings(bus=control, node_id=name, metrics_port=-1), register=False)
    return runtime, PsClient(runtime, manager, **kwargs)


# --- 1. transfer ------------------------------------------------------------------------------------


def filesystem(directory: str) -> str:
    """``type source`` of the mount holding ``directory`` (from /proc/self/mountinfo; "unknown" without it)."""
    best, found = -1, "unknown"
    target = os.path.realpath(directory)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        mount, rest = fields[4], fields[fields.index("-") + 1 :]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:
            best, found = len(mount), f"{rest[0]} {rest[1]}"
    return found


def raw_seconds(address: str, port: int, nbytes: int, repeats: int, direction: str) -> float:
    """Best seconds to move ``nbytes`` to or from a ``raw_peer`` at ``address:port`` over plain TCP (after one
    warm-up); a pull checks the bytes it got."""
    buffer = np.ones(nbytes, dtype=np.uint8)
    view = memoryview(buffer)
    with socket.create_connection((address, port), timeout=WAIT_S) as sock:
        def step() -> None:
            sock.sendall(b"g")
            if direction == "pull":
                recv_exactly(sock, view)
            else:
                sock.sendall(view)
                if sock.recv(1) != b"k":
                    raise BenchError("raw TCP peer did not acknowledge")

        seconds = min(seconds_each(step, repeats + 1)[1:])
    if direction == "pull" and np.count_nonzero(buffer != RAW_BYTE):
        raise BenchError("raw TCP delivered wrong bytes")
    return seconds


def raw_client(ch: Channel, address: str, port: int, nbytes: int, repeats: int, direction: str) -> float:
    """A task: :func:`raw_seconds` in a worker (on another host)."""
    return raw_seconds(address, port, nbytes, repeats, direction)


def raw_tcp(peer: Worker, nbytes: int, repeats: int, direction: str, *, by: Worker | None = None,
            address: str = "127.0.0.1") -> float:
    """Best seconds to move ``nbytes`` between ``peer`` and this process (or worker ``by``, which reaches
    the peer at ``address``) over plain TCP (after one warm-up)."""
    peer.submit(raw_peer, nbytes, repeats + 1, direction, "127.0.0.1" if by is None else "0.0.0.0")
    port = peer.message()
    if by is None:
        seconds = raw_seconds(address, port, nbytes, repeats, direction)
    else:
        seconds = by.call(raw_client, address, port, nbytes, repeats, direction, timeout_s=WAIT_S * (repeats + 1))
    peer.result()
    return seconds


def checked_pull_s(pull: Callable[[], object], out: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                   runs: int) -> float:
    """The fastest of ``runs`` calls of ``pull`` after one more as a warm-up (dropped, as raw TCP's is), each
    into ``out`` zeroed first and checked against ``state`` after (both outside the timer). Zeroed, so that a
    pull that wrote nothing, or only part, fails its check instead of passing on the bytes an earlier pull or
    the memcpy baseline left in ``out``. The memcpy baseline is timed by this too, so both sides take the
    best of as many runs, from the same zeroed buffers.

    Raises:
        BenchError: a pull left ``out`` other than ``state``.
    """
    seconds = []
    for _ in range(runs + 1):
        for t in out.values():
            t.zero_()
        start = time.perf_counter()
        pull()
        seconds.append(time.perf_counter() - start)
        if not all(torch.equal(out[n], t) for n, t in state.items()):
            raise BenchError("a pull delivered other bytes than were pushed")
    return min(seconds[1:])


def push_pull(ps: PsClient, state: dict[str, torch.Tensor], out: dict[str, torch.Tensor],
              repeats: int) -> tuple[list[float], float]:
    """Seconds of each push of ``state`` (the first cold; steady state needs ``RETAIN + 1`` segments, as the
    next version is written while ``RETAIN`` are kept) and the best pull into ``out``, each pull checked
    against it (:func:`checked_pull_s`)."""
    versions = itertools.count(ps.status().latest + 1)
    pushes = seconds_each(lambda: ps.push(state, next(versions)), RETAIN + 1 + repeats)
    return pushes, checked_pull_s(lambda: ps.pull(out=out), out, state, repeats)


def frames_push_pull(ch: Channel, control: str, manager: str, total: int, count: int,
                     repeats: int) -> dict[str, float]:
    """A task: :func:`push_pull` over frames of ``make_state(total, count)``, from a worker (on another host
    than the ps-worker)."""
    torch.set_num_threads(1)
    state = make_state(total, count)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    runtime, ps = client(control, manager, "bench-frames", transport="frames")
    try:
        pushes, pull_s = push_pull(ps, state, out, repeats)
    finally:
        runtime.close()
    return {"push_cold_s": pushes[0], "push_s": min(pushes[RETAIN + 1 :]), "pull_s": pull_s}


def best_of_rounds(best: dict[str, float], got: dict[str, float]) -> dict[str, float]:
    """The seconds of :func:`frames_push_pull` rounds so far (``best``) with one more (``got``): the best of
    each figure, but ``push_cold_s`` is the first round's, the only one that pushed into no segment yet."""
    return {k: best.get(k, v) if k == "push_cold_s" else min(best.get(k, v), v) for k, v in got.items()}


def bench_transfer(c: Cluster, settings: Settings, report: Callable[..., None]) -> dict[str, Any]:
    state = make_state(settings.state_bytes, settings.tensors)
    size = nbytes(state)
    gb = size / 1e9
    out = {name: torch.empty_like(t) for name, t in state.items()}
    for t in out.values():
        t.zero_()  # fault the destination in: a rollout's weights are mapped long before a pull

    def memcpy() -> None:
        for name, t in state.items():
            out[name].copy_(t)

    memcpy_s = checked_pull_s(memcpy, out, state, settings.repeats)
    results: dict[str, Any] = {"bytes": size, "tensors": len(state), "memcpy_s": memcpy_s}
    report(f"state: {len(state)} tensors, {size / MIB:.0f} MiB; memcpy {gb / memcpy_s:.2f} GB/s (baseline)")

    save_load = {}
    for where, directory in (("shm", "/dev/shm"), ("disk", tempfile.gettempdir())):
        path = Path(directory) / f"refbus-bench-{os.getpid()}.pt"
        results[f"torch_{where}_filesystem"] = filesystem(directory)
        try:
            def save(path: Path = path) -> None:
                torch.save(state, path)

            def load(path: Path = path) -> None:
                torch.load(path, mmap=False)

            save_load[where] = (best_seconds(save, settings.repeats), best_seconds(load, settings.repeats))
        finally:
            path.unlink(missing_ok=True)
        save_s, load_s = save_load[where]
        results[f"torch_save_{where}_s"], results[f"torch_load_{where}_s"] = save_s, load_s
        report(f"torch.save + torch.load via {where} ({path.parent}: {results[f'torch_{where}_filesystem']}): "
               f"{save_s:.3f} + {load_s:.3f} s = {save_s + load_s:.3f} s (baseline; no fsync: the file is "
               "written to and read from the page cache)")

    with workers("bench-raw-peer") as (peer,):
        raw = {direction: raw_tcp(peer, size, settings.repeats, direction) for direction in ("pull", "push")}
    results["raw_tcp_s"] = raw
    report(f"raw TCP to another process: pull {gb / raw['pull']:.2f} GB/s, push {gb / raw['push']:.2f} GB/s "
           "(baseline)")
    for where, (save_s, load_s) in save_load.items():
        # What no transport over this TCP can beat: whether the save/load goal is reachable here at all.
        ceiling = (save_s + load_s) / (raw["push"] + raw["pull"])
        results[f"ceiling_vs_torch_{where}"] = ceiling
        report(f"ceiling: raw TCP push + pull vs torch.save + torch.load via {where}: {ceiling:.1f}x")

    for transport in ("shm", "frames"):
        runtime, ps = c.client(f"bench-{transport}", transport=transport)
        try:
            pushes, pull_s = push_pull(ps, state, out, settings.repeats)
            push_s = min(pushes[RETAIN + 1 :])
            shared_s = best_seconds(lambda ps=ps: ps.pull(shared=True).release(), settings.repeats)
        finally:
            runtime.close()
        results[transport] = {"push_cold_s": pushes[0], "push_s": push_s, "pull_s": pull_s}
        ratio_pull = memcpy_s / pull_s
        report(f"{transport:>6}: push {push_s:.3f} s ({gb / push_s:.2f} GB/s, cold {pushes[0]:.3f} s), "
               f"pull into buffers {pull_s:.3f} s ({gb / pull_s:.2f} GB/s) = {ratio_pull:.0%} of memcpy"
               + (" [goal >= 50%]" if transport == "shm" else ""))
        if transport == "frames":
            results["frames"]["vs_raw_tcp"] = {"pull": raw["pull"] / pull_s, "push": raw["push"] / push_s}
            report(f"        vs raw TCP: pull {raw['pull'] / pull_s:.0%}, push {raw['push'] / push_s:.0%} "
                   "[goal >= 80%]")
        if transport == "shm":
            results["shm"]["pull_shared_s"] = shared_s
            report(f"        pull shared (views of the segments, no copy) {shared_s * 1e3:.1f} ms")
        for where, (save_s, load_s) in save_load.items():
            speedup = (save_s + load_s) / (push_s + pull_s)
            results[transport][f"speedup_vs_torch_{where}"] = speedup
            report(f"        push + pull vs torch.save + torch.load via {where}: {speedup:.1f}x [goal >= 3x]")
    results["nixl"] = bench_nixl_pull(c, settings, state, out, raw["pull"], results["frames"]["pull_s"], report)
    return results


def bench_nixl_pull(c: Cluster, settings: Settings, state: dict[str, torch.Tensor], out: dict[str, torch.Tensor],
                    raw_pull_s: float, frames_pull_s: float, report: Callable[..., None]) -> dict[str, Any]:
    """The latest version pulled over NIXL (``ps.transport = "nixl"``) into the same buffers, against the frames
    pull and raw TCP of the same bytes; skipped, saying why, where NIXL is not installed."""
    gb = nbytes(state) / 1e9
    runtime = NodeRuntime("bench", RuntimeSettings(bus=c.control, node_id="bench-nixl", metrics_port=-1),
                          register=False)
    try:
        try:
            ps = PsClient(runtime, c.manager, transport="frames", remote="nixl")
        except NixlError as exc:
            report(f"  nixl: skipped: {exc}")
            return {"skipped": str(exc)}
        ps.pull(out=out)  # a warm-up, untimed
        pull_s = checked_pull_s(lambda: ps.pull(out=out), out, state, settings.repeats)
    finally:
        runtime.close()
    report(f"  nixl: pull into buffers {pull_s:.3f} s ({gb / pull_s:.2f} GB/s) = {frames_pull_s / pull_s:.2f}x "
           f"frames, {raw_pull_s / pull_s:.0%} of raw TCP")
    return {"pull_s": pull_s, "vs_frames": frames_pull_s / pull_s, "vs_raw_tcp": raw_pull_s / pull_s}


# --- 2. broadcast init ------------------------------------------------------------------------------


def _read_file(path: str) -> None:
    """What a worker loading the checkpoint itself does: one open, the whole file into its own memory."""
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buffer)


def tree_and_star(ps: PsClient, path: str, n: int, repeats: int) -> tuple[InitResult, float, float, int]:
    """Broadcast init of ``path`` into workers ``w0 .. w(n-1)``: the first tree init's result, the best
    seconds of the tree (after that first one) and of the reader ``w0`` sending to each other worker in turn
    (``n - 1`` two-worker inits, one after another), and the file reads those took."""
    names = [f"w{i}" for i in range(n)]
    tree = ps.init(path, workers=names)
    tree_s = best_seconds(lambda: ps.init(path, workers=names), repeats)

    def star() -> int:
        return sum(sum(ps.init(path, workers=[names[0], w]).file_opens.values()) for w in names[1:])

    star_reads = star()
    return tree, tree_s, best_seconds(star, repeats), star_reads


def capped_inits(ch: Channel, control: str, manager: str, path: str, sizes: tuple[int, ...],
                 repeats: int) -> dict[str, Any]:
    """A task: :func:`tree_and_star` for each N of ``sizes``, from a worker on a host of its own."""
    runtime, ps = client(control, manager, "bench-init")
    try:
        results = {}
        for n in sizes:
            tree, tree_s, star_s, star_reads = tree_and_star(ps, path, n, repeats)
            results[str(n)] = {"tree_s": tree_s, "star_s": star_s, "rounds": tree.rounds,
                               "tree_reads": sum(tree.file_opens.values()), "star_reads": star_reads}
        return results
    finally:
        runtime.close()


def bench_broadcast(c: Cluster, settings: Settings, report: Callable[..., None]) -> dict[str, Any]:
    state = make_state(settings.broadcast_bytes, settings.tensors, seed=1, prefix="checkpoint")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.safetensors")
        save_file(state, path)
        size = os.path.getsize(path)
        runtime, ps = c.client("bench-init")
        try:
            for n in settings.broadcast_sizes:
                tree, tree_s, star_s, star_reads = tree_and_star(ps, path, n, settings.repeats - 1 or 1)

                def each_reads(n: int = n) -> None:
                    # Threads, not processes, so process start-up is not counted against the baseline;
                    # readinto releases the GIL, so the N reads run concurrently.
                    readers = [threading.Thread(target=_read_file, args=(path,)) for _ in range(n)]
                    for reader in readers:
                        reader.start()
                    for reader in readers:
                        reader.join()

                each_s = best_seconds(each_reads, settings.repeats - 1 or 1)
                reads = sum(tree.file_opens.values())
                results[str(n)] = {"tree_s": tree_s, "tree_reads": reads, "star_s": star_s,
                                   "star_reads": star_reads, "each_reads_s": each_s, "each_reads": n,
                                   "rounds": tree.rounds}
                report(f"N={n}: tree {tree_s:.3f} s ({tree.rounds} rounds, file reads {reads} [goal 1]) | "
                       f"each worker reads: {each_s:.3f} s, {n} reads ({each_s / tree_s:.2f}x) | "
                       f"reader sends in turn: {star_s:.3f} s, {star_reads} reads ({star_s / tree_s:.2f}x)")
        finally:
            runtime.close()
        results["bytes"] = size
    return results


# --- 3. pull latency under push ---------------------------------------------------------------------


def push_loop(ch: Channel, manager: str, control: str, total: int, count: int, first: int) -> int:
    """A task: push versions ``first``, ``first + 1``, ... back to back, reporting ``pushed`` after the first,
    until told to stop; returns how many were pushed."""
    torch.set_num_threads(1)
    runtime = NodeRuntime("bench-pusher", RuntimeSettings(bus=control, node_id="bench-pusher", metrics_port=-1),
                          register=False)
    ps = PsClient(runtime, manager)
    state = make_state(total, count, seed=2)
    version = first
    try:
        while not ch.poll():
            ps.push(state, version)
            if version == first:
                ch.send("pushed")
            version += 1
        return version - first
    finally:
        runtime.close()


def bench_pull_under_push(c: Cluster, settings: Settings, report: Callable[..., None]) -> dict[str, Any]:
    state = make_state(settings.state_bytes, settings.tensors, seed=2)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    runtime, ps = c.client("bench-reader")
    try:
        first = ps.status().latest + 1
        ps.push(state, first)

        def pulls() -> list[float]:
            return seconds_each(lambda: ps.pull(out=out), settings.latency_pulls)

        pulls()  # warm
        quiet = pulls()
        with workers("bench-pusher") as (pusher,):
            pusher.submit(push_loop, c.manager, c.control, settings.state_bytes, settings.tensors, first + 1)
            pusher.message(timeout_s=PUSHER_WAIT_S)  # pushed: a version is committed
            try:
                busy = pulls()
            finally:
                pusher.tell("stop")
                pusher.result(timeout_s=PUSHER_WAIT_S)
    finally:
        runtime.close()
    q, b = statistics.median(quiet), statistics.median(busy)
    report(f"pull latency p50: {b * 1e3:.1f} ms while pushing vs {q * 1e3:.1f} ms quiet = {b / q:.2f}x "
           f"[goal <= 1.2x]; p max {max(busy) * 1e3:.1f} vs {max(quiet) * 1e3:.1f} ms")
    return {"quiet_p50_s": q, "busy_p50_s": b, "ratio": b / q, "quiet_max_s": max(quiet), "busy_max_s": max(busy)}


# --- 4. replicas -------------------------------------------------------------------------------------


def steady_push_s(c: Cluster, state: dict[str, torch.Tensor], repeats: int) -> float:
    """The fastest steady-state push of ``state`` (after the segments of ``RETAIN + 1`` versions exist)."""
    runtime, ps = c.client("bench-replicas")
    try:
        versions = itertools.count(ps.status().latest + 1)
        return min(seconds_each(lambda: ps.push(state, next(versions)), RETAIN + 1 + repeats)[RETAIN + 1 :])
    finally:
        runtime.close()


def bench_replicas(settings: Settings, report: Callable[..., None]) -> dict[str, Any]:
    state = make_state(settings.state_bytes, settings.tensors, seed=3)
    gb = nbytes(state) / 1e9
    seconds = {}
    for replicas in (1, 2):
        with cluster(2, replicas=replicas) as c:
            seconds[replicas] = steady_push_s(c, state, settings.repeats)
        report(f"replicas {replicas}: push {seconds[replicas]:.3f} s ({gb / seconds[replicas]:.2f} GB/s)")
    ratio = seconds[2] / seconds[1]
    report(f"push with 2 replicas / 1 replica: {ratio:.2f}x")
    return {"push_1_s": seconds[1], "push_2_s": seconds[2], "ratio": ratio}


# --- across namespace hosts ------------------------------------------------------------------------


def broadcast_bound_s(n: int, nbytes: int, rate_bit: int) -> float:
    """The least time a tree init of ``nbytes`` over ``n`` workers can take when every link carries
    ``rate_bit``: the root sends the whole checkpoint to each of its ``ceil(log2 n)`` children."""
    return rounds(n) * nbytes * 8 / rate_bit


def run_across_hosts(settings: Settings, rate_bit: int) -> tuple[list[Row], dict[str, Any]]:
    """Frames push and pull between two namespace hosts against raw TCP between the same two hosts, then
    broadcast init with every host's link capped at ``rate_bit`` against the reader sending to each worker
    in turn and against the bound. ``1 + max(broadcast_sizes)`` hosts (``bench.hosts``, needs root): the
    broker, the manager and the client (a bench worker) on hostA, one ps-worker on each other host; the
    caps and the hosts are removed after."""
    on = hosts.build(1 + max(settings.broadcast_sizes))
    rows: list[Row] = []
    results: dict[str, Any] = {"hosts": [f"{h.name} {h.address}" for h in on], "cap_bit_s": rate_bit}
    try:
        a, b = on[0], on[1]
        with workers("bench-client", python=a.python()) as (by,):
            state_bytes = nbytes(make_state(settings.state_bytes, settings.tensors))
            gb = state_bytes / 1e9
            raw: dict[str, float] = {}
            frames: dict[str, float] = {}
            # Raw TCP between two hosts swings 1-3 GB/s run to run here: interleaved rounds, the best of each.
            with cluster(1, on=on) as c, workers("bench-raw-peer", python=b.python()) as (peer,):
                for _ in range(TRANSFER_ROUNDS):
                    for d in ("pull", "push"):
                        seconds = raw_tcp(peer, state_bytes, settings.repeats, d, by=by, address=b.name)
                        raw[d] = min(raw.get(d, seconds), seconds)
                    got = by.call(frames_push_pull, c.control, c.manager, settings.state_bytes, settings.tensors,
                                  settings.repeats, timeout_s=PUSHER_WAIT_S * (settings.repeats + RETAIN + 2))
                    frames = best_of_rounds(frames, got)
            results["transfer"] = {"bytes": state_bytes, "raw_tcp_s": raw, "frames": frames}
            section = f"frames {b.name} <-> {a.name}"
            rows += [
                Row(section, f"pull {state_bytes / MIB:.0f} MiB, {settings.tensors} tensors (vs raw TCP)", "GB/s",
                    gb / frames["pull_s"], gb / raw["pull"], 0.8),
                Row(section, f"push {state_bytes / MIB:.0f} MiB (vs raw TCP)", "GB/s", gb / frames["push_s"],
                    gb / raw["push"], 0.8),
            ]
            for host in on:
                host.cap(rate_bit)
            try:
                with tempfile.TemporaryDirectory() as tmp, cluster(max(settings.broadcast_sizes), on=on) as c:
                    path = str(Path(tmp) / "model.safetensors")
                    save_file(make_state(settings.broadcast_bytes, settings.tensors, seed=1, prefix="checkpoint"),
                              path)
                    size = os.path.getsize(path)
                    inits = by.call(capped_inits, c.control, c.manager, path, settings.broadcast_sizes,
                                    settings.repeats - 1 or 1, timeout_s=PUSHER_WAIT_S * 4 * settings.repeats)
            finally:
                for host in on:
                    host.uncap()
        results["broadcast"] = {"bytes": size, **inits}
        section = f"broadcast init, links capped at {rate_bit / 1e9:g} Gbit/s"
        for n in settings.broadcast_sizes:
            got = inits[str(n)]
            label = f"N={n}, {size / MIB:.0f} MiB, {got['rounds']} rounds"
            rows += [
                Row(section, f"{label}: tree (vs reader sending to each in turn)", "s", got["tree_s"], got["star_s"],
                    1.0 if n >= 4 else None, higher_is_better=False),
                Row(section, f"{label}: tree (vs ceil(log2 N) x size / link rate)", "s", got["tree_s"],
                    broadcast_bound_s(n, size, rate_bit), 1.2 if n > 1 else None, higher_is_better=False),
            ]
    finally:
        on.down()
    return rows, results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, prog="python -m bench.ps", description=__doc__.split("\n\n")[0],
                      quick_help="small sizes (a smoke run, well under 15 s)",
                      sections=SECTIONS,
                      hosts_help="across namespace hosts (needs root): frames push + pull between two hosts "
                                 "against raw TCP, broadcast init under capped links (--cap-mbit)",
                      more=lambda parser: parser.add_argument(
                          "--cap-mbit", type=int, default=CAP_MBIT,
                          help=f"with --hosts: every host's link rate, each way (default {CAP_MBIT} Mbit/s)"))
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    # One intra-op thread everywhere (baselines included): on a 2-core machine shared with other work,
    # torch's spinning OpenMP workers make a 2-thread copy ~40x slower than a 1-thread one.
    torch.set_num_threads(1)
    configure_logging(level="warning")  # the bench's own in-process nodes must not interleave log lines

    def report(line: str) -> None:
        print(line, flush=True)

    results: dict[str, Any] = {"settings": asdict(settings)}
    if args.hosts:
        rows, results["across_hosts"] = run_across_hosts(settings, args.cap_mbit * 1_000_000)
        print(format_table(rows), flush=True)
        if args.json:
            write_json(args.json, figures(settings, args.quick, time.monotonic() - started, rows, results))
        return 0
    only = args.only or SECTIONS
    with cluster(max(settings.broadcast_sizes)) as c:  # pushes go to w0; inits use w0..w(N-1)
        if "transfer" in only:
            print("== 1. push + pull on one host ==", flush=True)
            results["transfer"] = bench_transfer(c, settings, report)
        if "broadcast" in only:
            print("== 2. broadcast init ==", flush=True)
            results["broadcast"] = bench_broadcast(c, settings, report)
        if "pull-under-push" in only:
            print("== 3. pull latency while a push runs ==", flush=True)
            results["pull_under_push"] = bench_pull_under_push(c, settings, report)
    if "replicas" in only:
        print("== 4. replicas: push cost ==", flush=True)
        results["replicas"] = bench_replicas(settings, report)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
