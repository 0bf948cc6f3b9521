"""Durable-store benchmarks: what a keep costs and how long a restarted env server takes to re-adopt its store,
each as a ratio to a baseline measured in the same run.

1. **keep**: a keeper on a durable store keeps N episodes of one branch each (every field, ``--tokens`` tokens)
   the way an env server does (pack, write the segment, commit the journal record), and the orchestrator
   claims every other one (a commit of its own). Each branch's arrays are generated before its keep's clock
   starts. Baseline, interleaved blob by blob: the same packed bytes written to a fresh file of the same tmpfs
   (open, write, close: the bytes alone).
2. **re-adoption**: the store is let go as a killed process's is (lock released, nothing removed) and a fresh
   keeper re-adopts it. Timed here, from the store's open (its journal read and replayed) to the end of
   :meth:`BlobJournal.readopt` (every blob mapped and its checksum verified, strays swept, the journal
   compacted): what a restarted env server does before it serves. Best of ``--repeats``, each from a fresh
   copy of the same uncompacted store (the copy untimed). Baseline, in the same rounds: every segment file of
   the same copy opened, mapped and hashed (xxh3), without the journal.

Everything lives in a temporary directory under ``--directory`` (a tmpfs, as in production), removed after.

    python -m bench.store [--quick] [--json PATH] [--blobs 10000] [--tokens 512] [--repeats 3] [--directory D]
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from refbus.nodes.payload.blob_journal import BlobJournal
from refbus.nodes.payload.branch import FIELDS
from refbus.nodes.payload.keeper import Keeper, pack_branches
from refbus.nodes.store.durable import DATA_OFFSET, DurableStore
from refbus.protocol.codec import checksum
from refbus.protocol.messages import EpisodeFinished

from bench.harness import MIB, BenchError, Row, figures, format_table, parse_args, run_line, write_json

BUDGET = 4 << 30  # the keeper's and the store's budget: above any size this bench keeps


@dataclass(frozen=True)
class Settings:
    blobs: int
    tokens: int  # tokens of each blob's one branch
    repeats: int  # re-adoptions (and baseline passes); the best counts
    directory: str  # where the temporary stores live: a tmpfs


FULL = Settings(blobs=10_000, tokens=512, repeats=3, directory="/dev/shm")
QUICK = Settings(blobs=500, tokens=64, repeats=2, directory="/dev/shm")


def branch(tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One branch of ``tokens`` tokens, every field filled."""
    counts = rng.integers(0, 4, tokens).astype(np.int32)
    arrays = {
        "routed_experts": rng.integers(1, 255, (tokens, 16, 2), dtype=np.uint8),
        "topk_ids": rng.integers(1, 50_000, (tokens, 4), dtype=np.int32),
        "topk_logprobs": -rng.random((tokens, 4), dtype=np.float32) - 0.01,
        "mask_ids": rng.integers(0, 50_000, int(counts.sum()), dtype=np.int32),
        "mask_counts": counts,
    }
    return {name: arrays[name] for name in FIELDS}


def keeper() -> Keeper:
    return Keeper("env", "tcp://127.0.0.1:9", budget_bytes=BUDGET, handover_lease_s=60.0, node="env-0")


def open_store(directory: Path) -> BlobJournal:
    """The env server's store in ``directory``, opened as a (re)started env server opens it."""
    return BlobJournal(DurableStore(directory, "bench", "env-0", budget_bytes=BUDGET, what="budget"))


def write_file(path: Path, data: np.ndarray) -> None:
    """The keep's baseline: ``data``'s bytes into a new file, nothing else."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < view.nbytes:
            written += os.write(fd, view[written:])
    finally:
        os.close(fd)


def map_and_hash(paths: Sequence[Path]) -> None:
    """The re-adoption's baseline: every segment file opened, mapped and its bytes hashed, nothing else."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped)[DATA_OFFSET:] as data:
                checksum(data)
        finally:
            os.close(fd)


def keep_all(journal: BlobJournal, settings: Settings, raw_dir: Path,
             clock: Callable[[], float]) -> tuple[Keeper, float, float]:
    """Keep ``settings.blobs`` episodes through ``journal``, claiming every other one; the keeper and the
    seconds of the keeps and of their baseline writes (each branch generated off the clock)."""
    rng = np.random.default_rng(0)
    kept = keeper()
    journal.readopt(kept)  # a fresh store: nothing to re-adopt, as at an env server's first start
    keep_s = write_s = 0.0
    for i in range(settings.blobs):
        arrays = branch(settings.tokens, rng)
        start = clock()
        packed = journal.write(pack_branches([arrays]))
        refs = kept.store(f"ep-{i}", packed)
        record = EpisodeFinished(episode_id=f"ep-{i}", source="env", refs=refs)
        kept.record(record)
        journal.kept(record, packed, 0)  # no info: nothing charged for the record
        if i % 2:
            journal.claimed(kept.claim([refs[0].blob_id], "orchestrator").claimed, "orchestrator")
        middle = clock()
        write_file(raw_dir / f"blob-{i}", packed[0].buffer)
        write_s += clock() - middle
        keep_s += middle - start
    return kept, keep_s, write_s


def readopt_once(root: Path, saved: Path, store_dir: Path, settings: Settings,
                 clock: Callable[[], float]) -> tuple[float, float, int]:
    """One round from a fresh copy of ``saved``: the baseline's seconds, then the re-adoption's (open to end
    of readopt), and the bytes re-adopted. Raises :class:`BenchError` if a blob is not re-adopted."""
    shutil.rmtree(store_dir, ignore_errors=True)
    shutil.copytree(saved, store_dir)
    segments = sorted(p for p in store_dir.iterdir() if p.name.startswith("seg-"))
    start = clock()
    map_and_hash(segments)
    baseline_s = clock() - start
    start = clock()
    journal = open_store(root)
    found = journal.readopt(keeper())
    readopt_s = clock() - start
    journal.close(remove=False)
    if found.blobs != settings.blobs or found.lost or found.aborted:
        raise BenchError(f"re-adopted {found.blobs} of {settings.blobs} blobs, lost {len(found.lost)}, "
                         f"aborted {found.aborted}")
    return baseline_s, readopt_s, found.bytes


def measure(settings: Settings, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Both sections in a temporary directory under ``settings.directory`` (removed after); seconds and sizes.
    ``clock`` times every span (tests pass one they can move)."""
    root = Path(tempfile.mkdtemp(prefix="refbus-bench-store-", dir=settings.directory))
    try:
        raw_dir = root / "raw"
        raw_dir.mkdir()
        journal = open_store(root)
        kept, keep_s, write_s = keep_all(journal, settings, raw_dir, clock)
        journal.close(remove=False)  # let go as a killed process's store: lock released, everything left
        shutil.rmtree(raw_dir)
        saved, store_dir = root / "saved", journal.store.path
        shutil.copytree(store_dir, saved)
        rounds = [readopt_once(root, saved, store_dir, settings, clock) for _ in range(settings.repeats)]
        return {"blobs": settings.blobs, "bytes": kept.bytes_held, "keep_s": keep_s, "write_s": write_s,
                "map_hash_s": min(r[0] for r in rounds), "readopt_s": min(r[1] for r in rounds),
                "readopted_bytes": rounds[0][2]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def rows(settings: Settings, found: dict[str, Any]) -> list[Row]:
    """Per-blob microseconds of each section against its baseline."""
    per_blob = 1e6 / settings.blobs
    return [
        Row("keep", f"{settings.tokens} tokens, per blob, commit included (vs writing its bytes to a file)", "us",
            found["keep_s"] * per_blob, found["write_s"] * per_blob, None, higher_is_better=False),
        Row("re-adoption", f"{settings.blobs:,} blobs, per blob, open to verified (vs mapping and hashing each "
            "segment)", "us", found["readopt_s"] * per_blob, found["map_hash_s"] * per_blob, None,
            higher_is_better=False),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    def options(parser: Any) -> None:
        parser.add_argument("--blobs", type=int, help=f"episodes of one blob each (default {FULL.blobs})")
        parser.add_argument("--tokens", type=int, help=f"tokens a blob (default {FULL.tokens})")
        parser.add_argument("--repeats", type=int, help=f"re-adoptions, the best counts (default {FULL.repeats})")
        parser.add_argument("--directory", help=f"a tmpfs for the stores (default {FULL.directory})")

    args = parse_args(argv, prog="python -m bench.store", description=__doc__.split("\n\n")[0],
                      quick_help=f"{QUICK.blobs} blobs of {QUICK.tokens} tokens (a smoke run)", more=options)
    settings = QUICK if args.quick else FULL
    settings = replace(settings, **{name: getattr(args, name) for name in ("blobs", "tokens", "repeats", "directory")
                                    if getattr(args, name) is not None})
    started = time.monotonic()
    found = measure(settings)
    table = rows(settings, found)
    print(f"kept {settings.blobs:,} blobs of {settings.tokens} tokens ({found['bytes'] / MIB:.1f} MiB) in "
          f"{found['keep_s']:.2f} s; re-adopted them in {found['readopt_s']:.3f} s (best of {settings.repeats})")
    print(format_table(table))
    elapsed = time.monotonic() - started
    print(f"\n{run_line(args.quick, elapsed)}")
    if args.json:
        write_json(args.json, figures(settings, args.quick, elapsed, table, found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
