"""keep_receive_memory: frames received step after step land in memory already faulted in.

Each check runs in a fresh interpreter, since the settings are process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

WAIT_S = 60.0  # a fresh interpreter that moves 512 MiB over loopback, on a loaded machine

PROBE = r"""
import json, os, sys
import zmq
from refbus.bus.memory import keep_receive_memory

def io_faults():
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("ZMQbg/IO"):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt
    raise RuntimeError("no ZeroMQ I/O thread")

kept = keep_receive_memory() if sys.argv[1] == "keep" else None
again = keep_receive_memory() if sys.argv[1] == "keep" else None
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.linger = 0
port = pull.bind_to_random_port("tcp://127.0.0.1")
push = ctx.socket(zmq.PUSH)
push.linger = 0
push.connect(f"tcp://127.0.0.1:{port}")
payload = memoryview(bytearray(os.urandom(1 << 20)) * 4)  # 4 MiB, as blob frames and pieces are
rounds = []
for _ in range(4):
    before = io_faults()
    for _ in range(32):
        push.send(payload, copy=False)
    held = [pull.recv(copy=False) for _ in range(32)]  # a step's frames, all held, then all released
    rounds.append(io_faults() - before)
    del held
ctx.destroy(linger=0)
print(json.dumps({"kept": kept, "again": again, "faults": rounds, "pages": 32 * (4 << 20) // 4096}))
"""


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_frames_of_later_steps_reuse_the_memory_of_earlier_ones() -> None:
    got = probe("keep")
    assert got["kept"] is True and got["again"] is True
    # The first step faults its memory in (the receive path touches both sides' pages); the later ones
    # land in the freed heap: at most a few pages each, against one fault per page when memory is returned.
    assert got["faults"][0] > got["pages"] // 2, got
    assert max(got["faults"][1:]) < got["pages"] // 20, got
