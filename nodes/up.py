"""`refbus up`: start a local cluster from the config and show its event stream.

This is the foundation's version of the main job: it starts the broker on the config's endpoints, watches
the stream, and walks a short scripted lifecycle (nodes join, one leaves cleanly, one is killed and is
declared down by missed heartbeats), then stops everything and prints a summary. Each node is a separate
``refbus node``/``refbus monitor`` process started through :class:`~refbus.nodes.launch.NodeProcess`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from ..bus.runtime import NodeRuntime
from ..protocol.envelope import Message, describe
from .config import Config
from .launch import NodeProcess
from .monitor import format_line


def _config_flags(config: Config) -> list[str]:
    return ["--bus-control", config.bus.control, "--bus-heartbeat-interval-s", str(config.bus.heartbeat_interval_s),
            "--bus-node-timeout-s", str(config.bus.node_timeout_s)]


def run_up(config: Config, args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="refbus-up-"))
    flags = _config_flags(config)
    bus = NodeProcess(["node", "bus", *flags, "--bus-events-in", config.bus.events_in,
                       "--bus-events-out", config.bus.events_out], workdir=workdir, name="bus")
    nodes: list[NodeProcess] = []
    seen: list[Message] = []
    try:
        bus.wait_ready()
        watcher = NodeRuntime("monitor", config.runtime(node_id="up-watcher"))

        def show(message: Message) -> None:
            seen.append(message)
            print(format_line(describe(message)), flush=True)

        watcher.subscribe(show)
        watcher.start()
        for name in args.nodes.split(","):
            node = NodeProcess(["monitor", *flags, "--node-id", name, "--kind", "none"], workdir=workdir, name=name)
            nodes.append(node)
            node.wait_ready()
        expect = len(nodes)
        watcher.loop(until=lambda: sum(m.kind == "node-up" for m in seen) >= expect)
        nodes[0].stop()
        if len(nodes) > 1:
            nodes[1].proc.kill()
        downs = min(2, len(nodes))
        deadline = time.monotonic() + config.bus.node_timeout_s * 3
        watcher.loop(until=lambda: sum(m.kind == "node-down" for m in seen) >= downs or time.monotonic() > deadline)
        watcher.close()
    finally:
        for node in nodes:
            node.stop()
        bus.stop()
    kinds = Counter(m.kind for m in seen)
    print(f"summary: {dict(kinds)} events; logs in {workdir}")
    return 0 if kinds["node-down"] >= min(2, len(nodes)) else 1
