"""Durable-store restart figures: how long a restarted env server takes to re-adopt N blobs.

A keeper on a durable store keeps N episodes of one branch each (every field, ``--tokens`` tokens), has the
orchestrator claim half of them, then its store is let go as a killed process's is (the lock released,
nothing closed) and a fresh keeper re-adopts it: replay the journal, map and verify every blob's checksum,
compact. Timed is the re-adoption alone, best of ``--repeats`` (each from the same uncompacted journal), in
a temporary directory under ``--directory`` (a tmpfs, as in production).

    python -m bench.store [--blobs 10000] [--tokens 512] [--directory /dev/shm]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from refbus.nodes.payload.blob_journal import BlobJournal
from refbus.nodes.payload.branch import FIELDS
from refbus.nodes.payload.keeper import Keeper, pack_branches
from refbus.nodes.store.durable import DurableStore
from refbus.protocol.messages import EpisodeFinished


def branch(tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    counts = rng.integers(0, 4, tokens).astype(np.int32)
    arrays = {
        "routed_experts": rng.integers(1, 255, (tokens, 16, 2), dtype=np.uint8),
        "topk_ids": rng.integers(1, 50_000, (tokens, 4), dtype=np.int32),
        "topk_logprobs": -rng.random((tokens, 4), dtype=np.float32) - 0.01,
        "mask_ids": rng.integers(0, 50_000, int(counts.sum()), dtype=np.int32),
        "mask_counts": counts,
    }
    return {name: arrays[name] for name in FIELDS}


def keeper(budget: int) -> Keeper:
    return Keeper("env", "tcp://127.0.0.1:9", budget_bytes=budget, handover_lease_s=60.0, node="env-0")


def open_store(directory: Path, budget: int) -> BlobJournal:
    return BlobJournal(DurableStore(directory, "bench", "env-0", budget_bytes=budget, what="budget"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blobs", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", default="/dev/shm")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="refbus-bench-store-", dir=args.directory))
    try:
        budget = 4 << 30
        rng = np.random.default_rng(0)
        first, journal = keeper(budget), open_store(root, budget)
        journal.readopt(first)
        started = time.perf_counter()
        for i in range(args.blobs):
            packed = journal.write(pack_branches([branch(args.tokens, rng)]))
            refs = first.store(f"ep-{i}", packed)
            record = EpisodeFinished(episode_id=f"ep-{i}", source="env", refs=refs)
            first.record(record)
            journal.kept(record, packed)
            if i % 2:
                journal.claimed(first.claim([refs[0].blob_id], "orchestrator").claimed, "orchestrator")
        kept_s = time.perf_counter() - started
        journal.store.close(remove=False)
        saved = root / "saved"
        store_dir = journal.store.path
        shutil.copytree(store_dir, saved)
        best = float("inf")
        for _ in range(args.repeats):
            shutil.rmtree(store_dir)
            shutil.copytree(saved, store_dir)
            again, restarted = keeper(budget), open_store(root, budget)
            found = restarted.readopt(again)
            assert found.blobs == args.blobs and not found.lost, found
            best = min(best, found.seconds)
            restarted.store.close(remove=False)
        print(f"kept {args.blobs} blobs of {args.tokens} tokens ({first.bytes_held / 2**20:.1f} MiB) in "
              f"{kept_s:.2f} s ({kept_s / args.blobs * 1e6:.0f} us per keep, commit included)")
        print(f"re-adopted {found.blobs} blobs ({found.bytes / 2**20:.1f} MiB) in {best:.3f} s "
              f"({best / args.blobs * 1e6:.0f} us per blob, checksums verified)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
