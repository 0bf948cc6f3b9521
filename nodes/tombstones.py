"""The ids of every blob deleted so far, compact enough for the ledger to keep for a whole run.

A keeper names its blobs with a random per-incarnation prefix and a counter in lowercase hex
(``3f9a0c11d2e4-1a2``), issued in keep order. :class:`Tombstones` remembers a deleted id of that shape as its
counter, in its prefix's runs of consecutive deleted counters (:class:`CounterRuns`). Blobs are deleted
roughly in the order they were kept, so deletes fill the gaps between runs and the runs merge: memory follows
the blobs still live among deleted ones (at most one run more than there are live blobs), not the blobs ever
deleted. An id of another shape (not a keeper's) is kept as it is.

The trade-off, against a map from every deleted id to who deleted it and why:

* **exact forever**: whether an id was deleted is known for every id, however long ago (a second delete is
  told at any distance, where a count or time window would forget);
* **who and why for recent deletes only**: the last ``recent`` deletes keep their holder and reason; an
  older one answers :data:`FORGOTTEN` for both, except deletes for one of the ``always_named`` reasons
  (the ledger's: ``lost``, whose pairing of a holder's loss with its store's own delete needs the reason;
  losses are few, each one a failure the run reports).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

FORGOTTEN = "?"  # the holder and reason of a delete too old to be named
DEFAULT_RECENT = 4096  # deletes named in full: a step or two of a busy run, about 1 MB


class CounterRuns:
    """A set of non-negative integers as sorted, disjoint runs ``[start, end]`` of consecutive ones."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []  # inclusive

    def __len__(self) -> int:
        """The number of runs (the memory used), not of integers."""
        return len(self._starts)

    def __contains__(self, value: int) -> bool:
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and self._ends[i] >= value

    def add(self, value: int) -> bool:
        """Add ``value``; False when it was already in, True when it was added (merging runs it joins)."""
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, value) - 1  # the run starting at or before value
        if i >= 0 and ends[i] >= value:
            return False
        joins_left = i >= 0 and ends[i] == value - 1
        joins_right = i + 1 < len(starts) and starts[i + 1] == value + 1
        if joins_left and joins_right:
            ends[i] = ends.pop(i + 1)
            del starts[i + 1]
        elif joins_left:
            ends[i] = value
        elif joins_right:
            starts[i + 1] = value
        else:
            starts.insert(i + 1, value)
            ends.insert(i + 1, value)
        return True


def _counter_id(blob_id: str) -> tuple[str, int] | None:
    """``(prefix, counter)`` of a keeper's id; None for any other shape (the hex must be canonical, so no two
    spellings of one counter meet)."""
    prefix, dash, counter = blob_id.rpartition("-")
    if not dash or not prefix or not counter or not counter.isascii() or not counter.isalnum():
        return None
    try:
        value = int(counter, 16)
    except ValueError:
        return None
    return (prefix, value) if format(value, "x") == counter else None


class Tombstones:
    """Every deleted blob id (see the module doc). Not thread-safe."""

    def __init__(self, *, recent: int = DEFAULT_RECENT, always_named: frozenset[str] = frozenset()) -> None:
        if recent < 0:
            raise ValueError(f"recent must be >= 0, got {recent}")
        self.recent_limit = recent
        self.always_named = always_named
        self.recent: OrderedDict[str, tuple[str, str]] = OrderedDict()  # blob id -> (holder, reason), newest last
        self._runs: dict[str, CounterRuns] = {}  # prefix -> its deleted counters
        self._other: set[str] = set()  # ids not of a keeper's shape
        self._named: dict[str, tuple[str, str]] = {}  # blob id -> (holder, reason) for always_named reasons
        self.count = 0  # ids deleted

    def add(self, blob_id: str, holder: str, reason: str) -> None:
        """Remember ``blob_id`` as deleted by ``holder`` for ``reason``; a repeat changes nothing."""
        parsed = _counter_id(blob_id)
        if parsed is None:
            if blob_id in self._other:
                return
            self._other.add(blob_id)
        elif not self._runs.setdefault(parsed[0], CounterRuns()).add(parsed[1]):
            return
        self.count += 1
        if reason in self.always_named:
            self._named[blob_id] = (holder, reason)
        if self.recent_limit:
            self.recent[blob_id] = (holder, reason)
            if len(self.recent) > self.recent_limit:
                self.recent.popitem(last=False)

    def get(self, blob_id: str) -> tuple[str, str] | None:
        """``(holder, reason)`` of the id's delete (:data:`FORGOTTEN` for both when it is too old to be
        named, see the module doc); None when it was never deleted."""
        if (named := self.recent.get(blob_id) or self._named.get(blob_id)) is not None:
            return named
        parsed = _counter_id(blob_id)
        deleted = blob_id in self._other if parsed is None else (
            (runs := self._runs.get(parsed[0])) is not None and parsed[1] in runs)
        return (FORGOTTEN, FORGOTTEN) if deleted else None

    def runs(self) -> int:
        """Runs kept over every prefix (plus ids of another shape): what the memory follows."""
        return sum(len(runs) for runs in self._runs.values()) + len(self._other)
