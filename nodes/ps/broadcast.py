"""Broadcast init: one worker reads a safetensors checkpoint, the others receive it over a binomial tree.

Tree (ranks 0..N-1, the root is 0): rank ``r`` receives from ``r - 2**(bitlen(r) - 1)`` and sends to
``r + 2**k`` for every ``k >= bitlen(r)`` below N, so every rank has the data after ``ceil(log2 N)``
rounds. The stream is chunked and pipelined: the root forwards each chunk as soon as it is read and every
interior worker forwards it as soon as it has copied it, so the rounds overlap instead of running one after
another.

Verification: every chunk frame carries the sender's xxh3 checksum and is verified on receipt; at the end the
root's per-tensor checksums travel down the tree and every worker hashes its own copy against them.

Failure is loud and bounded: every message to a child is a request whose deadline is ``ack_timeout_s``; a
child that does not answer by then (dead, stuck), goes down or answers with an error is reported to the
manager by name, and the manager fails the whole init. Nothing waits without a deadline.

:class:`Relay` is one worker's part in one init (worker side); :class:`InitRound` is the manager's view of
one init. Both are single-threaded state machines driven by their node's loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from ...bus.reqrep import Outcome, PeerDown, RemoteError, RequestTimeout
from ...protocol.codec import checksum
from ...protocol.envelope import Message
from ...protocol.messages import Body
from ...protocol.messages_ps import (
    InitChunk,
    InitDone,
    InitEnd,
    InitFailed,
    InitHeader,
    InitPlan,
    ShardTensor,
    WorkerInfo,
)
from .checkpoint import read_layout
from .shm import Segment

log = structlog.get_logger(__name__)


def rounds(n: int) -> int:
    """ceil(log2 n): rounds of the binomial tree over ``n`` workers (0 for one worker)."""
    return (n - 1).bit_length() if n > 1 else 0


def children(rank: int, n: int) -> list[int]:
    """Ranks that ``rank`` sends to, in the order it sends (its nearest subtree root first)."""
    out = []
    k = rank.bit_length()
    while rank + (1 << k) < n:
        out.append(rank + (1 << k))
        k += 1
    return out


def parent(rank: int) -> int | None:
    return rank - (1 << (rank.bit_length() - 1)) if rank else None


Acquire = Callable[[str, int], Segment]
"""``acquire(init_id, nbytes)``: a segment the worker records as shard ``init_id``."""
Send = Callable[[WorkerInfo, Body, float, Callable[[Outcome], None]], None]
"""``send(peer, body, deadline_s, on_done)``: an asynchronous request to a peer worker; its outcome goes to
``on_done`` (on the loop thread)."""
Report = Callable[[Body], None]
"""``report(body)``: an asynchronous request to the manager (``ps-init-done``/``ps-init-failed``)."""


class Relay:
    """One worker's part in broadcast ``init_id``: receive (or read) the checkpoint, forward it to its
    children, verify it, report to the manager.

    Ownership: the segment belongs to the worker (shard ``init_id``), which frees it when the manager says
    so (``ps-release``); a relay only writes into it. Chunks forwarded to children are zero-copy views of
    the segment, which stays mapped until then.
    """

    def __init__(self, init_id: str, me: str, *, acquire: Acquire, send: Send, report: Report) -> None:
        self.init_id = init_id
        self.me = me
        self.file_opens = 0
        self.failed = False
        self.verified = False
        self._acquire = acquire
        self._send = send
        self._report = report
        self._children: list[WorkerInfo] = []
        self._ack_timeout_s = 0.0
        self._segment: Segment | None = None
        self._tensors: list[ShardTensor] = []

    # --- the stream ---------------------------------------------------------------------------------

    def stream_from(self, plan: InitPlan) -> None:
        """Root: read ``plan.path`` into a segment, forwarding each chunk, then verify and report.

        Runs to completion on the loop thread (children acknowledge into their sockets meanwhile).
        """
        try:
            with open(plan.path, "rb", buffering=0) as f:
                self.file_opens += 1
                layout = read_layout(f, plan.path)
                self._start(plan.workers, plan.ack_timeout_s, layout.nbytes, layout.tensors)
                assert self._segment is not None
                f.seek(layout.data_start)
                offset = 0
                while offset < layout.nbytes:
                    view = self._segment.view(offset, min(plan.chunk_bytes, layout.nbytes - offset))
                    got = f.readinto(view)
                    if not got:
                        raise OSError(f"{plan.path} ends {layout.nbytes - offset} bytes early")
                    self._forward(InitChunk(self.init_id, offset, np.frombuffer(view[:got], np.uint8)), "chunk")
                    offset += got
        except (OSError, ValueError) as exc:
            self.fail(self.me, f"cannot read checkpoint {plan.path}: {exc}")
            return
        tensors = [
            ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, checksum(self._segment.view(t.offset, t.nbytes)))
            for t in self._tensors
        ]
        self._finish(tensors)

    def on_header(self, header: InitHeader) -> None:
        self._start(header.workers, header.ack_timeout_s, header.nbytes, header.tensors)

    def on_chunk(self, chunk: InitChunk) -> None:
        """Copy a verified chunk (the codec checked its frame checksum) and pass it on."""
        if self._segment is None:
            raise ValueError(f"init {self.init_id}: chunk before header")
        data = np.asarray(chunk.data).reshape(-1)
        view = self._segment.view(chunk.offset, data.nbytes)
        np.frombuffer(view, np.uint8)[:] = data
        self._forward(InitChunk(self.init_id, chunk.offset, np.frombuffer(view, np.uint8)), "chunk")

    def on_end(self, end: InitEnd) -> None:
        """Pass the root's checksums on, then verify this worker's copy against them."""
        self._finish(end.tensors)

    def fail(self, worker: str, reason: str) -> None:
        self.failed = True
        log.error("ps.init_failed", init_id=self.init_id, worker=worker, reason=reason)
        self._report(InitFailed(self.init_id, self.me, worker, reason))

    # --- internals ----------------------------------------------------------------------------------

    def _start(self, workers: list[WorkerInfo], ack_timeout_s: float, nbytes: int, tensors: list[ShardTensor]) -> None:
        names = [w.worker for w in workers]
        rank = names.index(self.me)
        self._children = [workers[c] for c in children(rank, len(workers))]
        self._ack_timeout_s = ack_timeout_s
        self._tensors = list(tensors)
        self._segment = self._acquire(self.init_id, nbytes)
        self._forward(InitHeader(self.init_id, workers, ack_timeout_s, nbytes, self._tensors), "header")

    def _forward(self, body: Body, what: str) -> None:
        for child in self._children:
            self._send(child, body, self._ack_timeout_s,
                       lambda outcome, child=child.worker: self._acknowledged(child, what, outcome))

    def _acknowledged(self, child: str, what: str, outcome: Outcome) -> None:
        """A child's answer to a forwarded message: anything but ok fails the init (the first failure wins)."""
        if self.failed or isinstance(outcome, Message):
            return
        if isinstance(outcome, RemoteError):
            self.fail(child, f"rejected the {what}: [{outcome.code}] {outcome.detail}")
        elif isinstance(outcome, RequestTimeout):
            self.fail(child, f"did not acknowledge the {what} within {self._ack_timeout_s:g}s (dead or stuck)")
        elif isinstance(outcome, PeerDown):
            self.fail(child, f"went down before acknowledging the {what} ({outcome.reason})")

    def _finish(self, tensors: list[ShardTensor]) -> None:
        if self.failed:
            return
        self._forward(InitEnd(self.init_id, tensors), "end")
        assert self._segment is not None
        # The root computed the checksums from its own segment; every other copy is checked against them.
        for t in tensors if not self.file_opens else ():
            if checksum(self._segment.view(t.offset, t.nbytes)) != t.checksum:
                self.fail(self.me, f"tensor {t.name!r} does not match the root's checksum after the broadcast")
                return
        self.verified = True
        root_layout = tensors if self.file_opens else []
        self._report(InitDone(self.init_id, self.me, self._segment.name, self.file_opens, root_layout))


@dataclass
class InitRound:
    """The manager's view of one broadcast init: who takes part, who finished, and whether it failed."""

    init_id: str
    path: str
    workers: list[WorkerInfo]
    request_id: str
    started: float
    deadline: float
    done: dict[str, InitDone] = field(default_factory=dict)
    error: str = ""

    @property
    def names(self) -> list[str]:
        return [w.worker for w in self.workers]

    @property
    def complete(self) -> bool:
        return not self.error and len(self.done) == len(self.workers)

    def on_done(self, done: InitDone) -> None:
        if done.worker in self.names:
            self.done[done.worker] = done

    def fail(self, worker: str, reason: str) -> str:
        """Record the first failure; returns the message the requester gets."""
        if not self.error:
            rank = self.names.index(worker) if worker in self.names else -1
            self.error = (
                f"broadcast init of {self.path} over {len(self.workers)} worker(s) failed: worker {worker!r} "
                f"(rank {rank}) {reason}"
            )
        return self.error

    def overdue(self, now: float) -> str:
        """Fail (and return the message) when the deadline passed, naming the workers not done."""
        if self.error or now < self.deadline:
            return self.error
        missing = [n for n in self.names if n not in self.done]
        return self.fail(missing[0], f"and {len(missing) - 1} other(s) did not finish before the init timeout")

    def root_layout(self) -> list[ShardTensor]:
        return next((d.tensors for d in self.done.values() if d.file_opens), [])
