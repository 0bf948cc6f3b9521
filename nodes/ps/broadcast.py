"""Broadcast init: one worker reads a safetensors checkpoint, the others receive it over a binomial tree.

Tree (ranks 0..N-1, the root is 0): rank ``r`` receives from ``r - 2**(bitlen(r) - 1)`` and sends to
``r + 2**k`` for every ``k >= bitlen(r)`` below N, so every rank has the data after ``ceil(log2 N)``
rounds. The stream is chunked and pipelined: the root forwards each chunk as soon as it is read and every
interior worker forwards it as soon as it has copied it, so the rounds overlap instead of running one after
another. Each child has at most ``WINDOW`` chunks in flight (sent, not yet acknowledged); the others wait in
the sender's segment, which holds the whole checkpoint anyway, and go out as acknowledgements come back. So
an acknowledgement's deadline covers a few chunks on the sender's link, never the whole checkpoint queued at
once (which, on a link slower than ``children x size / ack_timeout_s``, failed inits that were progressing).

Verification: every chunk frame carries the sender's xxh3 checksum and is verified on receipt; at the end the
root's per-tensor checksums travel down the tree and every worker hashes its own copy against them.

The loop thread is never held for long, however large the checkpoint: the root reads one chunk a loop turn, each
worker makes its segment one slice a turn (:class:`~refbus.nodes.ps.shm.Allocation`), and hashing (the root's
checksums, each worker's check of its copy) goes one slice a turn (:class:`~refbus.protocol.codec.SlicedChecksums`),
so heartbeats, acknowledgements and requests are served in between and no worker is reported down for loading a
large checkpoint. A child acknowledges the header once its segment is made; its chunks wait for that.

Authentication: the manager sends its plan to every worker of the tree (the root last, once the others
acknowledged theirs); a worker below the root takes the init's header only as its plan names it (see the
ps-worker), so no peer makes a worker spend memory on an init the manager did not run.

Failure is loud and bounded: every message to a child is a request whose deadline is ``ack_timeout_s`` (the
header's, that plus :func:`~refbus.nodes.ps.shm.allocation_allowance_s` of the checkpoint: its answer waits for
the child's segment, the rule a pusher's ``ps-shard-open`` allows too); a child that does not answer by then
(dead, stuck), goes down or answers with an error is reported to the manager by name, and the manager fails the
whole init. Nothing waits without a deadline.

:class:`Relay` is one worker's part in one init (worker side); :class:`InitRound` is the manager's view of
one init. Both are single-threaded state machines driven by their node's loop.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import structlog

from ...bus.reqrep import Outcome, PeerDown, RemoteError, RequestTimeout
from ...protocol.codec import SlicedChecksums
from ...protocol.envelope import Message
from ...protocol.messages import Body, Error, Ok
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
from .shm import Segment, allocation_allowance_s

log = structlog.get_logger(__name__)

WINDOW = 4  # chunks in flight to one child: keeps a fast link busy, and bounds what an ack deadline covers


def _named(exc: BaseException) -> str:
    """An error as a reason: its message, with its type when that is not one of the expected ones."""
    return str(exc) if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: {exc}"


def _open_checkpoint(path: str) -> BinaryIO:
    """The checkpoint file at ``path``, for reading. The open never waits (``O_NONBLOCK``: a FIFO's would wait
    for a writer, blocking the loop thread for good) and anything but a regular file (a FIFO, a device, a
    directory) is refused with an OSError naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


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


Acquire = Callable[[str, int, Callable[[Segment], None]], None]
"""``acquire(init_id, nbytes, then)``: make a segment the worker records as shard ``init_id`` and pass it to
``then`` on the loop thread (in a later loop turn when it is made in slices); raises when refused at once. The
worker fails the relay when the segment cannot be made midway, and stops making it when the init is released."""
Send = Callable[[WorkerInfo, Body, float, Callable[[Outcome], None]], None]
"""``send(peer, body, deadline_s, on_done)``: an asynchronous request to a peer worker; its outcome goes to
``on_done`` (on the loop thread)."""
Report = Callable[[Body], None]
"""``report(body)``: an asynchronous request to the manager (``ps-init-done``/``ps-init-failed``)."""
Later = Callable[[float, Callable[[], None]], None]
"""``later(delay_s, callback)``: run ``callback`` on the loop thread, in a later loop turn (``runtime.later``)."""


@dataclass
class _Child:
    """What a relay has sent one child: the first ``sent`` chunks, of which ``in_flight`` are unacknowledged."""

    info: WorkerInfo
    headed: bool = False  # it acknowledged the header: its segment is made, chunks may go
    sent: int = 0
    in_flight: int = 0
    ended: bool = False


class Relay:
    """One worker's part in broadcast ``init_id``: receive (or read) the checkpoint, forward it to its
    children, verify it, report to the manager.

    Ownership: the segment belongs to the worker (shard ``init_id``), which frees it when the manager says
    so (``ps-release``); a relay only writes into it. Chunks forwarded to children are zero-copy views of
    the segment, which stays mapped until then.
    """

    def __init__(self, init_id: str, me: str, *, acquire: Acquire, send: Send, report: Report, later: Later) -> None:
        self.init_id = init_id
        self.me = me
        self.file_opens = 0
        self.failed = False
        self.verified = False
        self._acquire = acquire
        self._send = send
        self._report = report
        self._later = later
        self._children: list[_Child] = []
        self._ack_timeout_s = 0.0
        self._segment: Segment | None = None
        self._tensors: list[ShardTensor] = []
        self._chunks: list[tuple[int, int]] = []  # (offset, nbytes) of every chunk this worker holds, in order
        self._end: InitEnd | None = None  # passed on to each child once it has every chunk
        self._segment_bytes = 0
        # The root's checkpoint while it reads it: the file, its name, the chunk size and the bytes read.
        self._file: BinaryIO | None = None
        self._path = ""
        self._chunk_bytes = 0
        self._read = 0
        self._reading = False  # the next chunk's read is asked for (one a loop turn)
        # The answer to this worker's header (a child's), until its segment is made or the relay fails.
        self._answer_header: Callable[[Body], None] | None = None

    # --- the stream ---------------------------------------------------------------------------------

    def stream_from(self, plan: InitPlan) -> None:
        """Root: open ``plan.path``, send the header, and start reading it into the segment (:meth:`_read_on`).

        Reads go only as far ahead as the fastest child takes them, one chunk a loop turn, so the loop thread
        stays free to take acknowledgements (and to answer heartbeats) however large the checkpoint is.
        """
        if self.failed:  # abandoned (released) before the loop got to it
            return
        try:
            self._file = _open_checkpoint(plan.path)
            self.file_opens += 1
            layout = read_layout(self._file, plan.path)
            self._file.seek(layout.data_start)
            self._path, self._chunk_bytes = plan.path, plan.chunk_bytes
            self._start(plan.workers, plan.ack_timeout_s, layout.nbytes, layout.tensors, self._read_on)
        except Exception as exc:  # whatever it is, the manager hears it now, not at the init timeout
            self._close_file()
            self.fail(self.me, f"cannot read checkpoint {plan.path}: {_named(exc)}")

    def _read_on(self) -> None:
        """Root: ask for the next chunk's read (:meth:`_read_chunk`, in a later loop turn) while some child has
        room for one it does not have yet (always when it has no children), or for the end of the file."""
        if self._file is None or self.failed or self._reading:
            return
        if self._read < self._segment_bytes and self._children and not any(
                c.sent == len(self._chunks) and c.in_flight < WINDOW for c in self._children):
            return  # an acknowledgement asks again
        self._reading = True
        self._later(0.0, self._read_chunk)

    def _read_chunk(self) -> None:
        """Root: read one chunk into the segment and pass it on, then ask for the next; at the end of the file,
        checksum every tensor (a slice a loop turn) and finish."""
        self._reading = False
        if self._file is None or self.failed:
            return
        assert self._segment is not None
        nbytes = self._segment_bytes
        try:
            if self._read < nbytes:
                view = self._segment.view(self._read, min(self._chunk_bytes, nbytes - self._read))
                got = self._file.readinto(view)
                if not got:
                    raise OSError(f"{self._path} ends {nbytes - self._read} bytes early")
                self._read += got
                self._hold(self._read - got, got)
        except Exception as exc:  # reported (the manager fails the init by name), the file closed
            self._close_file()
            self.fail(self.me, f"cannot read checkpoint {self._path}: {_named(exc)}")
            return
        if self._read < nbytes:
            self._read_on()
            return
        self._close_file()

        def checksummed(digests: list[int]) -> None:
            self._finish([ShardTensor(t.name, t.dtype, t.shape, t.offset, t.nbytes, digest)
                          for t, digest in zip(self._tensors, digests, strict=True)])

        self._hash(self._tensors, checksummed)

    def _hash(self, tensors: list[ShardTensor], then: Callable[[list[int]], None]) -> None:
        """Checksum ``tensors`` in the segment, a slice a loop turn, then ``then(checksums)``. Stops as soon as
        the relay failed or was abandoned: its segment may be another shard's by then."""
        assert self._segment is not None
        hashing = SlicedChecksums(self._segment.view, [(t.offset, t.nbytes) for t in tensors])

        def step() -> None:
            if self.failed:
                return
            if hashing.step():
                then(hashing.digests)
            else:
                self._later(0.0, step)

        step()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_header(self, header: InitHeader, answer: Callable[[Body], None]) -> None:
        """Make this worker's segment (a slice a loop turn), then ``answer`` the header ``ok`` (only then does the
        parent send chunks); an ``Error`` when the relay fails or is abandoned first."""
        self._answer_header = answer

        def made() -> None:
            self._answer_header = None
            answer(Ok())

        try:
            self._start(header.workers, header.ack_timeout_s, header.nbytes, header.tensors, made)
        except BaseException:
            self._answer_header = None  # refused at once: the caller answers that
            raise

    def on_chunk(self, chunk: InitChunk) -> None:
        """Copy a verified chunk (the codec checked its frame checksum) and pass it on."""
        if self._segment is None:
            raise ValueError(f"init {self.init_id}: chunk before header")
        data = np.asarray(chunk.data).reshape(-1)
        view = self._segment.view(chunk.offset, data.nbytes)
        np.frombuffer(view, np.uint8)[:] = data
        self._hold(chunk.offset, data.nbytes)

    def on_end(self, end: InitEnd) -> None:
        """Pass the root's checksums on, then verify this worker's copy against them."""
        self._finish(end.tensors)

    def abandon(self) -> None:
        """The worker is releasing this init's segment (the manager freed the init): nothing more is read into
        it, sent from it or reported, whatever acknowledgements are still in flight; the file is closed."""
        self._stop("released", f"init {self.init_id} was released on {self.me} before its segment was made")

    def fail(self, worker: str, reason: str) -> None:
        self._stop("init-failed", f"init {self.init_id} failed on {self.me}: {reason}")
        log.error("ps.init_failed", init_id=self.init_id, worker=worker, reason=reason)
        self._report(InitFailed(self.init_id, self.me, worker, reason))

    def _stop(self, code: str, why: str) -> None:
        """Fail the relay and close the file; a header still waiting for its segment is answered ``code``."""
        self.failed = True
        self._close_file()
        answer, self._answer_header = self._answer_header, None
        if answer is not None:
            answer(Error(code, why, InitHeader.kind))

    # --- internals ----------------------------------------------------------------------------------

    def _start(self, workers: list[WorkerInfo], ack_timeout_s: float, nbytes: int, tensors: list[ShardTensor],
               then: Callable[[], None]) -> None:
        """Make the segment, then send each child the header and go on with ``then``. A child's chunks and end wait
        for its acknowledgement of the header: its segment is made by then."""
        names = [w.worker for w in workers]
        rank = names.index(self.me)
        self._children = [_Child(workers[c]) for c in children(rank, len(workers))]
        self._ack_timeout_s = ack_timeout_s
        self._tensors = list(tensors)

        def made(segment: Segment) -> None:
            self._segment = segment
            self._segment_bytes = nbytes
            for child in self._children:
                self._send_to(child, InitHeader(self.init_id, workers, ack_timeout_s, nbytes, self._tensors), "header")
            then()

        self._acquire(self.init_id, nbytes, made)

    def _hold(self, offset: int, nbytes: int) -> None:
        """Chunk ``[offset, offset + nbytes)`` of the segment is written: send it to every child with room."""
        self._chunks.append((offset, nbytes))
        for child in self._children:
            self._pump(child)

    def _pump(self, child: _Child) -> None:
        """Send ``child`` its next chunks while it has fewer than ``WINDOW`` in flight, then the end once it
        has them all. Chunks are zero-copy views of the segment, which stays mapped until it is released."""
        assert self._segment is not None
        if not child.headed:  # its segment may not be made yet: its acknowledgement of the header pumps
            return
        while not self.failed and child.in_flight < WINDOW and child.sent < len(self._chunks):
            offset, nbytes = self._chunks[child.sent]
            child.sent += 1
            child.in_flight += 1
            self._send_to(child, InitChunk(self.init_id, offset, np.frombuffer(self._segment.view(offset, nbytes),
                                                                               np.uint8)), "chunk")
        if self._end is not None and not self.failed and not child.ended and child.sent == len(self._chunks):
            child.ended = True
            self._send_to(child, self._end, "end")

    def _send_to(self, child: _Child, body: Body, what: str) -> None:
        self._send(child.info, body, self._deadline_s(what),
                   lambda outcome: self._acknowledged(child, what, outcome))

    def _deadline_s(self, what: str) -> float:
        """How long a child has to acknowledge ``what``: ``ack_timeout_s``; for the header, which it answers only
        once its segment is made, that plus the allowance for making a segment of the checkpoint's size."""
        if what == "header":
            return self._ack_timeout_s + allocation_allowance_s(self._segment_bytes)
        return self._ack_timeout_s

    def _acknowledged(self, child: _Child, what: str, outcome: Outcome) -> None:
        """A child's answer to a forwarded message: ok makes room for the next chunk; anything else fails the
        init (the first failure wins)."""
        if self.failed:
            return
        name = child.info.worker
        if isinstance(outcome, Message):
            if what == "header":
                child.headed = True
            elif what == "chunk":
                child.in_flight -= 1
            self._pump(child)
            self._read_on()
        elif isinstance(outcome, RemoteError):
            self.fail(name, f"rejected the {what}: [{outcome.code}] {outcome.detail}")
        elif isinstance(outcome, RequestTimeout):
            self.fail(name, f"did not acknowledge the {what} within {self._deadline_s(what):g}s (dead or stuck)")
        elif isinstance(outcome, PeerDown):
            self.fail(name, f"went down before acknowledging the {what} ({outcome.reason})")

    def _finish(self, tensors: list[ShardTensor]) -> None:
        """Every chunk is here and ``tensors`` carry the root's checksums: pass them on, then report this copy
        done, verified. The root computed them from its own segment; every other copy is hashed against them
        first (a slice a loop turn)."""
        if self.failed:
            return
        self._end = InitEnd(self.init_id, tensors)
        for child in self._children:
            self._pump(child)
        if self.file_opens:
            self._done(tensors)
            return

        def check(digests: list[int]) -> None:
            for t, digest in zip(tensors, digests, strict=True):
                if digest != t.checksum:
                    self.fail(self.me, f"tensor {t.name!r} does not match the root's checksum after the broadcast")
                    return
            self._done([])

        self._hash(tensors, check)

    def _done(self, root_layout: list[ShardTensor]) -> None:
        """This worker's copy is verified: tell the manager (the root with the layout and its checksums)."""
        assert self._segment is not None
        self.verified = True
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
    plan: InitPlan  # what every worker of the tree is sent
    done: dict[str, InitDone] = field(default_factory=dict)
    error: str = ""
    unplanned: set[str] = field(default_factory=set)  # workers below the root that have not acknowledged the plan

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
