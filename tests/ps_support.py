"""Support for the parameter-server tests: a PS cluster of real processes, and trainer/rollout actors.

Run as a script, this module is one actor process (a trainer rank or a rollout worker):

    python ps_support.py push --manager EP --version V --rank R --world W [--seed S] [--pause]
    python ps_support.py pull --manager EP [--version V] [--hold]

It prints one JSON object per line (``{"event": ...}``; a pull also reports the array frames it received).
``--pause`` stops a push after half of its tensors and ``--hold`` keeps a shared pull's lease; both wait for
a line on stdin (or to be killed).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from refbus.bus.logs import configure_logging
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import FrameCounter
from refbus.nodes.launch import NodeProcess
from refbus.nodes.ps.client import PsClient
from refbus.nodes.store.durable import PREFIX as STORE_PREFIX
from refbus.protocol.codec import checksum

HERE = Path(__file__).resolve()
# The ps lease TTL of every test cluster: short, yet above the request timeout as the config requires.
LEASE_TTL_S = 2.5


def make_state(seed: int, *, tensors: int = 12, scale: int = 1) -> dict[str, torch.Tensor]:
    """A deterministic small model: mixed dtypes and shapes, a scalar and an empty tensor included."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for i in range(tensors):
        shape = (8 * scale + i, 4 + i % 5)
        kind = i % 4
        if kind == 0:
            state[f"layer{i}.weight"] = torch.randn(shape, generator=gen)
        elif kind == 1:
            state[f"layer{i}.norm.weight"] = torch.randn(shape[1:], generator=gen)
        elif kind == 2:
            state[f"layer{i}.bias"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        else:
            state[f"layer{i}.index"] = torch.randint(0, 1000, shape, generator=gen)
    state["scale"] = torch.tensor(float(seed))
    state["empty"] = torch.empty(0, 3)
    return state


def rank_part(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """The tensors trainer rank ``rank`` owns (round robin over names)."""
    return {name: t for i, (name, t) in enumerate(sorted(state.items())) if i % world == rank}


def checksums(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in state.items()}


def scrape(url: str, name: str, **labels: str) -> float:
    """One sample of a node's Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(f"{name}{labels} not exposed at {url}")


def segments(prefix: str, directory: str = "/dev/shm") -> list[str]:
    """Shared-memory segments named ``<prefix>.*``: in ``directory`` itself or in a ps-worker's durable store
    directory under it (where workers keep them with ``store.durable``); not the workers' host-proof nonce
    files or lock files, which share the prefix."""
    return sorted(p.name for pattern in (f"{prefix}.*", f"{STORE_PREFIX}*/{prefix}.*")
                  for p in Path(directory).glob(pattern) if not p.name.endswith((".nonce", ".lock")))


def segment_file(name: str, directory: str = "/dev/shm") -> Path:
    """The file of the segment ``name`` (see :func:`segments`)."""
    found = [*Path(directory).glob(name), *Path(directory).glob(f"{STORE_PREFIX}*/{name}")]
    assert len(found) == 1, f"segment {name}: {found or 'no file'}"
    return found[0]


@dataclass
class PsCluster:
    """A bus, a ps-manager and ps-workers as processes; every process is stopped by the ``spawn`` fixture."""

    control: str
    manager: str
    prefix: str
    workers: dict[str, NodeProcess] = field(default_factory=dict)
    worker_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    manager_proc: NodeProcess | None = None
    manager_metrics: str = ""
    flags: list[str] = field(default_factory=list)

    def client(self, name: str = "test-client", **kwargs: Any) -> tuple[NodeRuntime, PsClient]:
        """An in-process client (its runtime does not join the bus); close the runtime when done."""
        runtime = NodeRuntime("ps-client", RuntimeSettings(bus=self.control, node_id=name, metrics_port=-1),
                              register=False)
        return runtime, PsClient(runtime, self.manager, **kwargs)

    def held(self, worker: str, state: str = "in_use") -> float:
        return scrape(self.worker_info[worker]["metrics"], "refbus_ps_held_bytes", state=state)


def start_cluster(spawn: Callable[..., NodeProcess], control: str, tag: str, *, workers: int = 2,
                  extra: list[str] | None = None) -> PsCluster:
    """Start a ps-manager and ``workers`` ps-workers (w0, w1, ...) on the broker at ``control``."""
    prefix = f"refbus-test-{tag}-{os.getpid()}"
    flags = ["--bus-control", control, "--bus-heartbeat-interval-s", "0.2", "--ps-shm-prefix", prefix,
             "--ps-lease-ttl-s", str(LEASE_TTL_S), *(extra or [])]
    manager = spawn(["node", "ps-manager", "--node-id", "ps-manager", "--ps-manager", "tcp://127.0.0.1:0", *flags],
                    "ps-manager")
    ready = manager.wait_ready()
    endpoint = ready["endpoints"]["ps"]
    cluster = PsCluster(control, endpoint, prefix, manager_proc=manager, manager_metrics=ready["metrics"],
                        flags=flags)
    procs = {f"w{i}": spawn(["node", "ps-worker", "--node-id", f"w{i}", "--ps-manager", endpoint, *flags], f"w{i}")
             for i in range(workers)}
    for name, proc in procs.items():
        cluster.worker_info[name] = proc.wait_ready()
        cluster.workers[name] = proc
    return cluster


def restart_worker(spawn: Callable[..., NodeProcess], cluster: PsCluster, name: str) -> NodeProcess:
    """Start ps-worker ``name`` again under its node id (after the test killed it); it re-adopts its durable
    store and is registered with the manager once this returns."""
    new = spawn(["node", "ps-worker", "--node-id", name, "--ps-manager", cluster.manager, *cluster.flags], name)
    cluster.worker_info[name] = new.wait_ready()
    cluster.workers[name] = new
    return new


def restart_manager(spawn: Callable[..., NodeProcess], cluster: PsCluster, **kwargs: Any) -> NodeProcess:
    """Start the ps-manager again under its node id, on the endpoint the first one bound (after the test killed
    it); it replays its journal and serves once this returns (the workers register again on their own).
    ``kwargs`` go to ``spawn`` (a launcher ``prefix``, an ``env``)."""
    new = spawn(["node", "ps-manager", "--node-id", "ps-manager", "--ps-manager", cluster.manager, *cluster.flags],
                "ps-manager", **kwargs)
    cluster.manager_metrics = new.wait_ready()["metrics"]
    cluster.manager_proc = new
    return new


def stop_cluster_after_kills(cluster: PsCluster) -> None:
    """A test's end: every live process stops with exit 0, every dead one was SIGKILLed (by the test), and the
    killed workers' segments are removed (a restart would have swept them)."""
    for name, proc in cluster.workers.items():
        if proc.proc.poll() is None:
            assert proc.stop() == 0, proc.log_tail()
        else:
            assert proc.proc.returncode == -signal.SIGKILL, name
    assert cluster.manager_proc is not None and cluster.manager_proc.stop() == 0
    for stale in segments(cluster.prefix):
        segment_file(stale).unlink()


class Actor:
    """An actor process (this file run as a script) with line-based stdin/stdout; :meth:`stop` reaps it."""

    def __init__(self, *args: str, prefix: Sequence[str] = ()) -> None:
        """``prefix``: a launcher that execs the actor (e.g. into a namespace host)."""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*prefix, sys.executable, str(HERE), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log)
        self._pending = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]

    def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next line's record, which must be ``event``; fails with the actor's stderr otherwise."""
        deadline = time.monotonic() + timeout
        # Lines are split here, not by a buffered reader: a reader could swallow the next line into its
        # buffer, where the selector no longer sees it.
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise AssertionError(f"actor never reported {event!r}: {self._stderr()}")
            data = os.read(self.proc.stdout.fileno(), 1 << 20)  # type: ignore[union-attr]
            if not data:
                raise AssertionError(f"actor exited before reporting {event!r}: {self._stderr()}")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        record = json.loads(line)
        assert record["event"] == event, (record, self._stderr())
        return record

    def resume(self) -> None:
        self.proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self._log):
            stream.close()  # type: ignore[union-attr]
        self._selector.close()

    def _stderr(self) -> str:
        self._log.seek(0)
        state = "running" if self.proc.poll() is None else f"exit {self.proc.returncode}"
        return f"({state}) " + self._log.read()[-3000:].decode(errors="replace")


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=("push", "pull"))
    parser.add_argument("--manager", required=True)
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", action="store_true")
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    configure_logging("warning", "json")  # stderr: stdout carries only this actor's records
    runtime = NodeRuntime("ps-actor", RuntimeSettings(metrics_port=-1), register=False)
    ps = PsClient(runtime, args.manager)
    try:
        if args.action == "push":
            part = rank_part(make_state(args.seed), args.rank, args.world)
            with ps.begin_push(part, args.version, rank=args.rank, world=args.world) as session:
                for i, (name, tensor) in enumerate(part.items()):
                    if args.pause and i == len(part) // 2:
                        _emit("paused")
                        sys.stdin.readline()
                    session.write(name, tensor)
                result = session.commit()
            _emit("pushed", committed=result.committed, digest=result.digest)
        else:
            pulled = ps.pull(args.version, shared=args.hold, verify=True)
            _emit("pulled", version=pulled.version, digest=pulled.digest,
                  checksums=checksums(dict(pulled)), frames=FrameCounter.frames)
            if args.hold:
                _emit("holding")
                sys.stdin.readline()
                pulled.release()
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
