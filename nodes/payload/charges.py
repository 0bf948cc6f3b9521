"""What an env server charges its budget for what it keeps: each blob its bytes in whole pages plus a fixed
overhead, each episode its ``info`` as the journal writes it. In a module of its own because the orchestrator's
replica router measures episodes in the same unit (its room under a store's high-water mark) and must not load
the keeper, the env server's own module.

No torch here: the env server and the orchestrator use it.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from ...protocol.messages import EpisodeFinished

PAGE_BYTES = mmap.PAGESIZE
BLOB_OVERHEAD_BYTES = 4096
"""What each blob costs beyond its pages, charged against the budget: the process memory of its entries, its
reference and (with a durable store) its mapping, about 3 KiB measured, and a segment header that may take
another page."""


def blob_charge(nbytes: int) -> int:
    """What a blob of ``nbytes`` array bytes is charged against the budget: its bytes in whole pages (at least
    one: a durable store's segment is a tmpfs file and a mapping, whole pages each) plus
    :data:`BLOB_OVERHEAD_BYTES`. So a store of tiny blobs is refused ``over-budget`` at its budget, long before
    their true cost would exhaust its memory or its mappings."""
    return max(1, -(-nbytes // PAGE_BYTES)) * PAGE_BYTES + BLOB_OVERHEAD_BYTES


def info_charge(info: Mapping[str, Any]) -> int:
    """What an episode's ``info`` is charged against the budget while its record is held (with its episode's
    blobs): its msgpack encoding with arrays (and numpy scalars) as lists, as a durable store journals it, plus
    the bytes of those arrays, held in memory as they came. One encode, with no copy kept.

    Raises:
        TypeError, ValueError, NotImplementedError: ``info`` holds what msgpack cannot encode."""
    if not info:
        return 0
    arrays = 0

    def plain(obj: Any) -> Any:
        nonlocal arrays
        if isinstance(obj, np.ndarray | np.generic):
            arrays += obj.nbytes
            return obj.tolist()
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")

    return len(msgspec.msgpack.encode(info, enc_hook=plain)) + arrays


def episode_charge(episode: EpisodeFinished) -> int:
    """What ``episode``'s store charged its budget for it while its blobs live: each ref's :func:`blob_charge`
    plus its ``info``'s :func:`info_charge`. An episode's ``episode-finished`` record came as msgpack, so its
    ``info`` encodes."""
    return sum(blob_charge(ref.nbytes) for ref in episode.refs) + info_charge(episode.info)
