"""Broadcast init from a safetensors checkpoint across real ps-worker processes.

One cluster of 8 workers serves every N in {1, 2, 3, 5, 8} (an init names the workers it loads); every
worker reports how often it opened the file, and the test hashes every worker's copy itself. A separate
cluster loses an interior worker of the tree, which must fail the init loudly, by name, without hanging.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from polling import wait_for
from ps_support import PsCluster, make_state, segment_file, segments, start_cluster
from refbus.bus.reqrep import RemoteError
from refbus.nodes.ps.broadcast import children, parent, rounds
from refbus.nodes.ps.shm import sweep_orphans
from refbus.protocol.codec import checksum
from safetensors.torch import save_file

CHUNK = ["--ps-chunk-bytes", "4096"]  # many chunks even for a small checkpoint: the stream is pipelined


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = make_state(seed=11, tensors=16, scale=8)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path, state


def _stop(cluster: PsCluster) -> None:
    for proc in [*cluster.workers.values(), cluster.manager_proc]:
        assert proc is not None
        proc.stop()


def test_broadcast_init_over_1_2_3_5_8_workers(bus, spawn, checkpoint) -> None:
    path, state = checkpoint
    _, control = bus
    cluster = start_cluster(spawn, control, "bcast", workers=8, extra=CHUNK)
    runtime, ps = cluster.client()
    try:
        for n in (1, 2, 3, 5, 8):
            names = [f"w{i}" for i in range(n)]
            result = ps.init(str(path), workers=names, timeout_s=30)
            assert result.workers == names and result.rounds == math.ceil(math.log2(n))
            assert sum(result.file_opens.values()) == 1 and result.file_opens["w0"] == 1  # only the root read it
            manifest = ps.manifest(result.version)
            assert manifest.digest == result.digest
            for entry in manifest.entries:
                assert sorted(loc.worker for loc in entry.locations) == sorted(names)
                want = checksum(state[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy())
                assert entry.checksum == want, entry.name
                for loc in entry.locations:  # every worker's own copy, read from its segment
                    with open(segment_file(loc.segment), "rb") as f:
                        f.seek(loc.offset)
                        assert checksum(f.read(entry.nbytes)) == want, (entry.name, loc.worker)
            pulled = ps.pull(result.version, verify=True)
            assert all(torch.equal(pulled[name], t) for name, t in state.items())
        assert ps.status().retained == [3, 4]  # inits are versions too, retained like pushes
    finally:
        runtime.close()
        _stop(cluster)
    assert segments(cluster.prefix) == []


def test_a_dead_interior_worker_fails_init_by_name(bus, spawn, checkpoint) -> None:
    path, _ = checkpoint
    _, control = bus
    # The init starts at once, before the broker declares w1 down: the manager still believes w1 alive, so
    # the tree itself must notice.
    cluster = start_cluster(spawn, control, "bdead", workers=4, extra=[*CHUNK, "--ps-ack-timeout-s", "3.0"])
    runtime, ps = cluster.client()
    try:
        victim = cluster.workers["w1"]  # rank 1 of 4 relays to rank 3
        assert children(1, 4) == [3]
        victim.proc.kill()
        victim.proc.wait(10)
        started = time.monotonic()
        with pytest.raises(RemoteError) as err:
            ps.init(str(path), timeout_s=30)
        assert time.monotonic() - started < 20  # bounded by the ack timeout, never the 30 s init timeout
        message = str(err.value)
        assert err.value.code == "init-failed" and "'w1'" in message and "rank 1" in message
        # The survivors' partial copies are released, and the failed init committed nothing.
        assert ps.status().latest == -1
        wait_for(lambda: all(cluster.held(w) == 0 for w in ("w0", "w2", "w3")), 10, "partial copies to be freed")
    finally:
        runtime.close()
        _stop(cluster)
    # The victim never allocated a segment: its host-proof nonce file is all the sweep finds.
    assert [n for n in sweep_orphans("/dev/shm", cluster.prefix) if not n.endswith(".nonce")] == []
    assert segments(cluster.prefix) == []


@pytest.mark.parametrize("n", range(1, 40))
def test_tree_reaches_every_worker_once_in_ceil_log2_rounds(n: int) -> None:
    received = {0: 0}  # rank -> round it receives in
    for rank in range(n):
        for k, child in enumerate(children(rank, n)):
            assert child not in received and parent(child) == rank
            received[child] = rank.bit_length() + k + 1
    assert sorted(received) == list(range(n))
    assert max(received.values()) == rounds(n) == (math.ceil(math.log2(n)) if n > 1 else 0)
