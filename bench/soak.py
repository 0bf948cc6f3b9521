"""A soak: one long `refbus up` run, every node's resident memory sampled at every step.

``python -m bench.soak --steps 1000`` (``make soak``) runs the embedded job on ephemeral ports and records
each node's RSS (``VmRSS`` of the pids in the run's ready files, the launcher's own included) every time a
new step shows on its progress line. It reports, per node, the RSS when the warm-up ends (``--warmup``, a
share of the steps), at the end, and the growth between: a node whose growth after warm-up stays under
``--limit`` (5%) levels off. A node restarted meanwhile is reported from its latest process. Not part of
``make test``: a soak is long on purpose.

``--slow-trainer F`` makes every training step take F times as long (:func:`slowed_train_step`, the
configured train step followed by a sleep), so rollouts outrun the trainers: what bounds the work in flight
is then the orchestrator's admission and the stores' backpressure (give the env servers a small
``--env-server-budget-bytes`` after ``--`` to see it), and the run must still end with zero losses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent  # bench/ is importable from here (the slowed train step)
STEP_LINE = re.compile(rb"^step +(\d+)/")
EPHEMERAL = ["--bus-control", "tcp://127.0.0.1:0", "--bus-events-in", "tcp://127.0.0.1:0",
             "--bus-events-out", "tcp://127.0.0.1:0", "--bus-metrics-port", "0", "--ps-manager", "tcp://127.0.0.1:0"]
LAUNCHER = "up"
POLL_S = 0.5
SERIES_EVERY = 50  # steps between the RSS samples kept in the JSON result
SLOWDOWN_ENV = "REFBUS_SOAK_SLOWDOWN"
TRAIN_STEP = "refbus.nodes.toy.train:train_step"


def slowed_train_step(*args: Any, **kwargs: Any) -> Any:
    """The toy train step, then a sleep that makes the whole step ``$REFBUS_SOAK_SLOWDOWN`` times as long
    (an entry point for ``rl.train_step``: the trainer ranks import it by name)."""
    from refbus.nodes.entry_points import load_entry_point

    started = time.monotonic()
    result = load_entry_point(TRAIN_STEP)(*args, **kwargs)
    time.sleep((float(os.environ[SLOWDOWN_ENV]) - 1) * (time.monotonic() - started))
    return result


@dataclass
class NodeMemory:
    """One node's RSS (bytes) by step; ``pid`` is its latest process."""

    pid: int
    by_step: dict[int, int] = field(default_factory=dict)

    def at_or_after(self, step: int) -> int | None:
        later = [s for s in sorted(self.by_step) if s >= step]
        return self.by_step[later[0]] if later else None


def rss(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def node_pids(run_dir: Path) -> dict[str, int]:
    """Node name -> pid, from the ready files that exist now (a node removes its own when it stops)."""
    pids = {}
    for path in run_dir.glob("*.ready.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids[path.name.removesuffix(".ready.json")] = int(json.loads(path.read_text())["pid"])
    return pids


def new_steps(output: Path, offset: int) -> tuple[list[int], bytes, int]:
    """Steps shown on progress lines written since ``offset``, the last complete line, and the offset after
    it."""
    with open(output, "rb") as f:
        f.seek(offset)
        data = f.read()
    lines = data[: data.rfind(b"\n") + 1].splitlines(keepends=True)
    steps = [int(m.group(1)) for line in lines if (m := STEP_LINE.match(line))]
    return steps, lines[-1] if lines else b"", offset + sum(map(len, lines))


def soak(steps: int, workdir: Path, extra: list[str], slowdown: float) -> tuple[dict[str, NodeMemory], int, float]:
    """Run `refbus up` for ``steps`` steps; returns the memory by node, its exit code and its seconds."""
    run_dir, output = workdir / "run", workdir / "up.out"
    memory: dict[str, NodeMemory] = {}
    env = dict(os.environ)
    if slowdown != 1:
        env[SLOWDOWN_ENV] = str(slowdown)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        extra = ["--rl-train-step", "bench.soak:slowed_train_step", *extra]
    started = time.monotonic()
    with open(output, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "refbus.nodes.cli", "up", "--up-steps", str(steps),
                                 *EPHEMERAL, "--run-dir", str(run_dir), *extra],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    offset = 0
    try:
        while proc.poll() is None:
            shown, last, offset = new_steps(output, offset)
            if shown:
                for name, pid in {**node_pids(run_dir), LAUNCHER: proc.pid}.items():
                    if (value := rss(pid)) is not None:
                        node = memory.setdefault(name, NodeMemory(pid))
                        node.pid = pid
                        node.by_step[shown[-1]] = value
                print(last.decode(errors="replace").rstrip("\n"), flush=True)
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    return memory, proc.returncode, time.monotonic() - started


def rows(memory: dict[str, NodeMemory], warm_step: int, limit: float) -> Iterator[dict[str, object]]:
    for name in sorted(memory):
        node = memory[name]
        warm, end = node.at_or_after(warm_step), node.by_step[max(node.by_step)]
        growth = (end - warm) / warm if warm else None
        yield {"node": name, "warm_mib": round(warm / MIB, 1) if warm else None, "end_mib": round(end / MIB, 1),
               "growth": None if growth is None else round(growth, 4),
               "levels_off": growth is not None and growth < limit,
               "mib_by_step": {step: round(value / MIB, 1) for step, value in sorted(node.by_step.items())
                               if step % SERIES_EVERY == 0}}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="steps of the run (default 1000)")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="share of the steps that warms up (0.5: bounded caches fill first, e.g. the broker's "
                             "ring and the stores' tombstone window)")
    parser.add_argument("--limit", type=float, default=0.05, help="growth after warm-up that still levels off")
    parser.add_argument("--slow-trainer", type=float, default=1.0, metavar="F",
                        help="make every training step F times as long (default 1: as configured)")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    parser.add_argument("up_flags", nargs="*", help="more `refbus up` flags (after --)")
    args = parser.parse_args()
    # SIGTERM ends the soak like Ctrl-C: through the finally that stops `refbus up` (which stops its nodes).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="refbus-soak-") as tmp:
        memory, code, seconds = soak(args.steps, Path(tmp), args.up_flags, args.slow_trainer)
        summary_tail = (Path(tmp) / "up.out").read_text(errors="replace").split("\nsummary\n")[-1]
    warm_step = max(1, int(args.steps * args.warmup))
    table = list(rows(memory, warm_step, args.limit))
    print(f"\nsoak: {args.steps} steps in {seconds:.0f} s, refbus up exit {code}; RSS from step {warm_step} to the end")
    print(f"  {'node':<14} {'warm MiB':>9} {'end MiB':>9} {'growth':>8}  levels off")
    for row in table:
        growth = "-" if row["growth"] is None else f"{row['growth']:+.1%}"
        print(f"  {row['node']:<14} {row['warm_mib'] or '-':>9} {row['end_mib']:>9} {growth:>8}  {row['levels_off']}")
    print("summary of the run:\n" + summary_tail.rstrip())
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "seconds": round(seconds, 1), "exit": code,
                                         "warm_step": warm_step, "nodes": table}, indent=2) + "\n")
    return 0 if code == 0 and all(row["levels_off"] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
