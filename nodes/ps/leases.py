"""Leases: every hold on the parameter server (a push being written, a version being read) has a TTL.

A holder renews its leases while it lives; one that dies stops renewing and its leases expire, so a crashed
reader never blocks a later push and a crashed pusher never leaves a half-written version around. Pure
bookkeeping on the caller's monotonic clock; the manager drives :meth:`LeaseTable.expire` from a timer.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from ...protocol.messages_ps import WorkerInfo

# Said in every refusal about a lease an earlier process of the manager granted: the pusher starts its push over
# on this word (PsClient.push), so the manager's refusals and the client share it.
RESTARTED = "granted by an earlier process of the ps-manager, which restarted"

LeaseKind = Literal["push", "pull"]


@dataclass
class Lease:
    """One hold. ``version`` is what it holds; ``rank`` is the trainer rank of a push lease; ``tried``, of a push
    lease, the worker registrations granted to it and to the attempts of its rank it replaced (retries)."""

    lease_id: str
    kind: LeaseKind
    holder: str
    version: int
    deadline: float
    granted: float
    rank: int = 0
    tried: frozenset[WorkerInfo] = frozenset()


class LeaseTable:
    """Live leases by id, plus a bounded memory of ended ones so a late release is told "expired" rather
    than "unknown"."""

    def __init__(self, ttl_s: float, *, remember: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.expired_total: dict[LeaseKind, int] = {"push": 0, "pull": 0}
        self._live: dict[str, Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease id -> "expired" | "released"
        self._remember = remember
        self._prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._live)

    def live(self, kind: LeaseKind | None = None) -> list[Lease]:
        return [lease for lease in self._live.values() if kind is None or lease.kind == kind]

    def grant(self, kind: LeaseKind, holder: str, version: int, now: float, *, rank: int = 0) -> Lease:
        lease = Lease(f"{kind}-{self._prefix}-{next(self._ids)}", kind, holder, version, now + self.ttl_s, now, rank)
        self._live[lease.lease_id] = lease
        return lease

    def granted_here(self, lease_id: str) -> bool:
        """Whether this table granted ``lease_id`` (ids carry a prefix drawn per table: a lease of an earlier
        process of the manager is never one of this one's)."""
        return lease_id.startswith((f"push-{self._prefix}-", f"pull-{self._prefix}-"))

    def get(self, lease_id: str) -> Lease | None:
        """The live lease ``lease_id``, or None."""
        return self._live.get(lease_id)

    def ended(self, lease_id: str) -> str | None:
        """``expired``, ``released`` or None (live or never known)."""
        return self._ended.get(lease_id)

    def renew(self, lease_id: str, now: float) -> bool:
        """Push the deadline one TTL ahead; False when the lease is no longer live."""
        lease = self._live.get(lease_id)
        if lease is None:
            return False
        lease.deadline = now + self.ttl_s
        return True

    def release(self, lease_id: str) -> Lease | None:
        """End a live lease; returns it, or None when it is not live (see :meth:`ended` for why)."""
        lease = self._live.pop(lease_id, None)
        if lease is not None:
            self._end(lease_id, "released")
        return lease

    def extend(self, seconds: float) -> None:
        """Move every live lease's deadline ``seconds`` later: time its holder could not have renewed in (the
        manager's loop did not run)."""
        for lease in self._live.values():
            lease.deadline += seconds

    def expire(self, now: float) -> list[Lease]:
        """End and return every lease whose deadline has passed, oldest deadline first."""
        due = sorted((lease for lease in self._live.values() if lease.deadline <= now), key=lambda x: x.deadline)
        for lease in due:
            del self._live[lease.lease_id]
            self._end(lease.lease_id, "expired")
            self.expired_total[lease.kind] += 1
        return due

    def _end(self, lease_id: str, how: str) -> None:
        self._ended[lease_id] = how
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
