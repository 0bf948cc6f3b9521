"""Shared-memory segments: files in a tmpfs directory (``/dev/shm``) mapped once and reused across versions.

First touch of fresh memory is the slow path on these machines (~1.5 GB/s against ~13 GB/s for a copy into
memory already mapped), so a ps-worker never frees a segment when a version goes away: it returns it to a
:class:`SegmentPool` and the next version of the same shard lands in memory that is already faulted in.
Clients on the same host keep their mappings in :class:`SegmentMaps` for the same reason.

Names are ``<prefix>.<token>.<n>``, the token the worker process's pid (``<pid>-<k>`` when another PID
namespace's live worker holds that pid's names in the same directory): unique per worker process, never reused
while it lives. Without the durable store the worker holds an exclusive ``flock`` on ``<prefix>.<token>.lock``
(:class:`OwnerLock`) for its life, and :func:`sweep_orphans` removes a token's files only when it can take
that lock: the kernel drops it when the process dies however it dies, in whatever PID namespace, so neither a
pid that looks dead (another namespace) nor a pid reused by another process misleads it. The directory may be
shared with other users (``/dev/shm`` is): files another user owns are never removed, opened or taken as a
token's, so nothing planted there stops a worker from starting.

Pinned memory: with CUDA, segments are registered with ``cudaHostRegister`` (through torch) so
host-to-device copies run at full speed; without CUDA the first segment logs one warning and memory stays
pageable. torch is imported only where a CUDA driver exists (a ps-worker otherwise never loads it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import mmap
import os
import stat
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import structlog

from ..store.durable import map_file

log = structlog.get_logger(__name__)

_PAGE = mmap.PAGESIZE
_pin_warned = False


def _cuda_torch() -> Any | None:
    """torch when CUDA is usable here, else None. Without a CUDA driver torch is not imported just to
    learn that (the import costs seconds)."""
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return None
    import torch

    return torch if torch.cuda.is_available() else None


def _pin(address: int, size: int) -> bool:
    """Page-lock ``size`` bytes mapped at ``address`` for fast device copies; warn once (per process) and return
    False without CUDA."""
    global _pin_warned
    torch = _cuda_torch()
    if torch is None:
        if not _pin_warned:
            _pin_warned = True
            log.warning("ps.pinned_memory_unavailable", reason="no CUDA device; shards stay in pageable memory")
        return False
    err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(err) != 0:
        log.warning("ps.pin_failed", error=int(err), nbytes=size)
        return False
    return True


def segment_bytes(nbytes: int) -> int:
    """The size of a segment made for ``nbytes``: whole pages, at least one."""
    return max(_PAGE, -(-nbytes // _PAGE) * _PAGE)


class Segment:
    """One shared-memory file, mapped read-write by its owner (a ps-worker) until :meth:`close`.

    The mapping holds no file descriptor (:func:`~refbus.nodes.store.durable.map_file`): a worker holds as many
    segments as its memory allows, whatever its descriptor limit.
    """

    def __init__(self, path: Path, capacity: int, *, pin: bool) -> None:
        """Map the file at ``path``, whose ``capacity`` bytes are allocated already (an :class:`Allocation` made it,
        or it is a shard a restarted worker re-adopts)."""
        self.path = path
        self.capacity = capacity
        fd = os.open(path, os.O_RDWR)
        try:
            memory = map_file(fd, capacity, writable=True)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name stays for same-host readers
        # Every view is cut from this one (memoryview keeps the mapping alive): dropping it at close unmaps the
        # segment as soon as no view is left.
        self._bytes: memoryview | None = memoryview(memory).cast("B")
        self.address = ctypes.addressof(memory)  # the mapping's first byte in this process (valid until close)
        self.pinned = pin and _pin(self.address, capacity)

    @property
    def name(self) -> str:
        return self.path.name

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of ``[offset, offset + nbytes)``; raises ValueError outside the segment."""
        end = self.capacity if nbytes is None else offset + nbytes
        if offset < 0 or end > self.capacity or end < offset:
            raise ValueError(f"bytes [{offset}, {end}) are outside segment {self.name} of {self.capacity} bytes")
        assert self._bytes is not None, f"segment {self.name} is closed"
        return self._bytes[offset:end]

    def close(self) -> None:
        """Unlink the name and unmap (once). Views still exported (arrays in flight to ZeroMQ) keep the memory
        mapped until they go; the name is gone at once, so nothing leaks past this process."""
        if self._bytes is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self.pinned:
            torch = _cuda_torch()
            if torch is not None:
                torch.cuda.cudart().cudaHostUnregister(self.address)
        self._bytes = None


# What one Allocation.step allocates: about 55 ms of posix_fallocate on tmpfs here (~0.22 s/GiB, pages zeroed), so
# a ps-worker making a segment of tens of GiB answers heartbeats and requests between the steps.
ALLOCATE_SLICE_BYTES = 256 << 20

ALLOCATE_ALLOWANCE_S_PER_GIB = 1.0
"""What a peer waiting for a worker to make a segment allows for it, per GiB (:func:`allocation_allowance_s`): four
times the ~0.25 s/GiB of ``posix_fallocate`` on tmpfs, for a worker serving other work between the slices."""


def allocation_allowance_s(nbytes: int) -> float:
    """Seconds a peer allows a worker for making a segment of ``nbytes`` before it answers, on top of the peer's own
    deadline for the answer: a pusher's ``ps-shard-open`` (beyond its retry schedule) and a broadcast parent's
    ``ps-init-header`` (beyond ``ack_timeout_s``). The one rule for both, so no configured timeout needs raising
    for a large shard, and every such wait stays bounded by the shard's size."""
    return ALLOCATE_ALLOWANCE_S_PER_GIB * nbytes / (1 << 30)


class Allocation:
    """A segment of a :class:`SegmentPool` being made, ``slice_bytes`` a :meth:`step`: ``posix_fallocate`` of the
    next slice of its file, then the mapping. The memory is allocated whole before anyone writes a byte, so a full
    tmpfs fails a step (``ENOSPC``) instead of a later write into the mapping (``SIGBUS``).

    Its file carries the pool's name from the first step (a sweep of a dead worker's token removes it) and is
    held open until the last step or :meth:`abandon`, which unlinks it; a step that fails unlinks it too. A free
    segment of the pool that fits is handed over by the first step."""

    def __init__(self, pool: SegmentPool, capacity: int, *, slice_bytes: int,
                 reused: Segment | None = None) -> None:
        self.pool = pool
        self.capacity = capacity
        self.allocated = 0
        self._slice_bytes = slice_bytes
        self._reused = reused
        self._fd: int | None = None
        self.path: Path | None = None
        pool._making.add(self)

    @property
    def remaining(self) -> int:
        """Bytes its steps still take from the filesystem (none for a free segment handed over)."""
        return 0 if self._reused is not None else self.capacity - self.allocated

    def step(self) -> Segment | None:
        """Allocate the next slice; the segment (in use in the pool, owned by the caller until it releases it)
        once it is whole, else None. Raises OSError (``ENOSPC`` when the tmpfs has no room), the file removed."""
        segment = self._reused
        if segment is not None:
            self._reused = None
            self.pool._making.discard(self)
            self.pool._in_use[segment.name] = segment
            return segment
        try:
            if self._fd is None:
                self.pool.created += 1
                self.path = self.pool.directory / f"{self.pool.prefix}.{self.pool.token}.{self.pool.created}"
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            take = min(self._slice_bytes, self.capacity - self.allocated)
            os.posix_fallocate(self._fd, self.allocated, take)
            self.allocated += take
            if self.allocated < self.capacity:
                return None
            path, self.path = self.path, None  # the pool's from here on: abandon leaves it be
            assert path is not None
            try:
                segment = Segment(path, self.capacity, pin=self.pool.pin)
            except BaseException:
                os.unlink(path)
                raise
        except BaseException:
            self.abandon()
            raise
        self.abandon()  # closes the file, which the mapping does not need
        self.pool._in_use[segment.name] = segment
        return segment

    def abandon(self) -> None:
        """Stop making the segment: its file is closed and unlinked (a free segment not handed over yet goes back to
        the free list). Safe at any time, and twice; nothing once the segment was handed over."""
        if self._reused is not None:
            self.pool._free[self._reused.name] = self._reused
            self._reused = None
        self.pool._making.discard(self)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None


class SegmentPool:
    """A worker's segments: in use (holding a shard) or free (kept mapped for the next version).

    :meth:`allocate` reuses the smallest free segment that fits, else makes a new one a step at a time
    (:class:`Allocation`); :meth:`release` returns
    a segment to the free list, unlinking the oldest free ones beyond ``max_free``. :meth:`close` unlinks
    everything. Not thread-safe: the worker's loop owns it.
    """

    def __init__(self, directory: str | Path, prefix: str, *, pin: bool = True, max_free: int = 4,
                 token: str | None = None) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self.token = token or str(os.getpid())  # the middle of every name: an OwnerLock's token, or the pid
        self.pin = pin
        self.max_free = max_free
        self.created = 0
        self.reused = 0
        self._in_use: dict[str, Segment] = {}
        self._free: OrderedDict[str, Segment] = OrderedDict()
        self._making: set[Allocation] = set()  # allocations under way: their files go at close too

    @property
    def in_use_bytes(self) -> int:
        return sum(s.capacity for s in self._in_use.values())

    @property
    def free_bytes(self) -> int:
        return sum(s.capacity for s in self._free.values())

    def get(self, name: str) -> Segment | None:
        """The in-use segment called ``name`` (free segments hold nothing readable)."""
        return self._in_use.get(name)

    def reusable(self, nbytes: int) -> Segment | None:
        """The free segment :meth:`allocate` would hand out for ``nbytes`` (the smallest that fits), if any."""
        return min((s for s in self._free.values() if s.capacity >= nbytes), key=lambda s: s.capacity, default=None)

    def allocate(self, nbytes: int, *, slice_bytes: int = ALLOCATE_SLICE_BYTES) -> Allocation:
        """A segment of at least ``nbytes``, to make a step at a time (:class:`Allocation`): the smallest free one
        that fits, else a new one of :func:`segment_bytes` ``(nbytes)``."""
        segment = self.reusable(nbytes)
        if segment is not None:
            del self._free[segment.name]
            self.reused += 1
            return Allocation(self, segment.capacity, slice_bytes=slice_bytes, reused=segment)
        return Allocation(self, segment_bytes(nbytes), slice_bytes=slice_bytes)

    def adopt(self, name: str) -> Segment:
        """Map the existing segment file ``name`` (a shard an earlier process of this worker sealed) as in use."""
        path = self.directory / name
        segment = Segment(path, os.stat(path).st_size, pin=self.pin)
        self._in_use[segment.name] = segment
        # An earlier process under this token (a durable worker restarted with its pid: a container's first
        # process) named it: new names must start past it, or the next allocation collides with it.
        ours, _, number = name.rpartition(".")
        if ours == f"{self.prefix}.{self.token}" and number.isdigit():
            self.created = max(self.created, int(number))
        return segment

    def release(self, segment: Segment) -> None:
        """Return a segment to the free list (its bytes are garbage from now on)."""
        if self._in_use.pop(segment.name, None) is None:
            return
        self._free[segment.name] = segment
        while len(self._free) > self.max_free:
            _, oldest = self._free.popitem(last=False)
            oldest.close()

    def close(self) -> None:
        """Unlink and unmap every segment, in use or free, and the files of allocations under way."""
        for allocation in list(self._making):
            allocation.abandon()
        for segment in [*self._in_use.values(), *self._free.values()]:
            segment.close()
        self._in_use.clear()
        self._free.clear()


LOCK_SUFFIX = "lock"
_MAX_TOKENS = 64  # pids of other PID namespaces sharing one directory that a worker steps around


class OwnerLock:
    """A worker process's claim on the names ``<prefix>.<token>.*`` of a segment directory: an exclusive
    ``flock`` on ``<prefix>.<token>.lock``, held until :meth:`release` or the process's death (the kernel drops
    it then). Taken before the first segment is created; :func:`sweep_orphans` leaves a token alone while its
    lock is held."""

    def __init__(self, path: Path, token: str, fd: int) -> None:
        self.path = path
        self.token = token
        self._fd: int | None = fd

    @classmethod
    def take(cls, directory: str | Path, prefix: str, *, pid: int | None = None) -> OwnerLock:
        """Lock the token ``<pid>`` (this process's), or ``<pid>-1``, ... while a live process of another PID
        namespace holds it. Whatever an earlier, dead holder of the token left (its pid reused by this process)
        is removed first: it is orphaned.

        Raises:
            OSError: no token could be locked (``_MAX_TOKENS`` live holders of this pid).
        """
        directory = Path(directory)
        pid = os.getpid() if pid is None else pid
        for k in range(_MAX_TOKENS):
            token = str(pid) if k == 0 else f"{pid}-{k}"
            path = directory / f"{prefix}.{token}.{LOCK_SUFFIX}"
            if any(_foreign(p) for p in directory.glob(f"{glob.escape(prefix)}.{glob.escape(token)}.*")):
                continue  # another user's names: not ours to remove, and our new files would collide with them
            fd = _try_lock(path)
            if fd is None:
                continue
            stale = _remove_token(directory, prefix, token)
            if stale:
                log.warning("ps.orphan_segments_removed", count=len(stale), directory=str(directory), token=token)
            return cls(path, token, fd)
        raise OSError(f"no name token for pid {pid} in {directory}: {_MAX_TOKENS} live holders")

    def release(self) -> None:
        """Remove the lock file and drop the lock (after every segment of the token is gone). Safe twice."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on the lock file ``path`` (created if missing), or None when another
    open file (another process, or another fd of this one) holds it. Raises OSError (``ELOOP``) for a symlink:
    a lock is never taken through one."""
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # a sweep removed the file between our open and our lock: lock the one there now
    return None


def _foreign(path: Path) -> bool:
    """True when ``path`` (itself, not what a symlink names) belongs to another user."""
    try:
        return path.lstat().st_uid != os.geteuid()
    except FileNotFoundError:
        return False


def _unlink(path: Path) -> bool:
    """Unlink a leftover file; False (logged, never raised) when it is another user's or cannot be removed, or
    gone already. A sweep is cleanup: one file it cannot remove must not stop a worker from starting."""
    if _foreign(path):
        log.warning("ps.foreign_file_skipped", path=str(path), reason="owned by another user")
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("ps.foreign_file_skipped", path=str(path), reason=exc.strerror)
        return False
    return True


def _remove_token(directory: Path, prefix: str, token: str) -> list[str]:
    """Unlink every file of ``token`` but its lock file (the caller holds that lock); the names removed."""
    return [path.name for path in directory.glob(f"{glob.escape(prefix)}.{glob.escape(token)}.*")
            if not path.name.endswith(f".{LOCK_SUFFIX}") and _unlink(path)]


def sweep_orphans(directory: str | Path, prefix: str) -> list[str]:
    """Unlink the files ``<prefix>.<token>.*`` (segments, host-proof nonce files) of every token whose
    :class:`OwnerLock` no process holds, and then that lock file; returns the names removed (lock files not
    listed). Files of a token without a lock file (a worker of an earlier build, which took none) are judged by
    the old rule, the pid alone: removed when no process of that pid is alive here. Files of other users, and
    tokens whose lock file is another user's, are left alone (logged)."""
    directory = Path(directory)
    tokens: dict[str, list[Path]] = {}
    for path in directory.glob(f"{glob.escape(prefix)}.*.*"):
        token, _, rest = path.name[len(prefix) + 1 :].partition(".")
        if token and rest:
            tokens.setdefault(token, []).append(path)
    removed = []
    for token, paths in sorted(tokens.items()):
        lock = directory / f"{prefix}.{token}.{LOCK_SUFFIX}"
        if lock in paths:
            if _foreign(lock):
                log.warning("ps.foreign_file_skipped", path=str(lock), reason="owned by another user")
                continue
            try:
                fd = _try_lock(lock)
            except OSError as exc:
                log.warning("ps.foreign_file_skipped", path=str(lock), reason=exc.strerror)
                continue
            if fd is None:
                continue  # its process lives (in whatever PID namespace)
            try:
                removed += _remove_token(directory, prefix, token)
                _unlink(lock)
            finally:
                os.close(fd)
        elif token.isdigit() and not _alive(int(token)):
            removed += [path.name for path in paths if _unlink(path)]
    if removed:
        log.warning("ps.orphan_segments_removed", count=len(removed), directory=str(directory))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SegmentMaps:
    """A client's mappings of workers' segments, kept across calls because segments are reused.

    ``readonly`` mappings are for pullers: tensors viewing them cannot be written (writing faults), so a
    reader can never corrupt the version every other reader holds. Mappings are dropped least recently used
    beyond ``max_maps``; a mapping still viewed by tensors stays alive until they go.
    """

    def __init__(self, *, readonly: bool, max_maps: int = 256) -> None:
        self.readonly = readonly
        self.max_maps = max_maps
        self._maps: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()

    def view(self, path: str, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` at ``offset`` of the segment file ``path``. Raises OSError if it does not exist, is a symlink
        (a worker's directory may hold one naming a file of this process's user) or is not a regular file."""
        mm = self._map(path)
        if offset + nbytes > len(mm):
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside {path} ({len(mm)} bytes)")
        return memoryview(mm)[offset : offset + nbytes]

    def _map(self, path: str) -> mmap.mmap:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
        flags = (os.O_RDONLY if self.readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file: no segment", path)
            # Keyed by inode too: a name reappearing after a worker restart is a different segment.
            key = (path, os.fstat(fd).st_ino)
            mm = self._maps.get(key)
            if mm is None:
                access = mmap.ACCESS_READ if self.readonly else mmap.ACCESS_WRITE
                mm = self._maps[key] = mmap.mmap(fd, 0, access=access)
                while len(self._maps) > self.max_maps:
                    self._maps.popitem(last=False)
            else:
                self._maps.move_to_end(key)
            return mm
        finally:
            os.close(fd)

    def clear(self) -> None:
        """Forget every mapping (each is unmapped once no tensor views it)."""
        self._maps.clear()
