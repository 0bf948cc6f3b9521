"""A durable store: bytes in tmpfs files that outlive the process that wrote them, and a journal of what
they mean.

One directory per store per run, ``<directory>/refbus-store.<run>.<node>``, holds:

* ``lock``: held with ``fcntl.flock`` for as long as a process serves the store, with that process's pid in
  it. A second process (a replacement started while an old one, cut off by a partition, still runs) is
  refused with :class:`StoreLocked`, naming the holder: never two processes serving one store.
* ``id``: the store's identity, random, written once when the store is made, after its journal: a store
  with an ``id`` is whole (see :meth:`DurableStore._make`). A restarted process that re-adopts the store
  keeps it (peers tell a re-adopted store from a fresh one by it).
* ``journal``: the commit journal (:mod:`.journal`). What a record means is the owner's business.
* segments: ``seg-*`` (:meth:`DurableStore.write`) are a header (magic, format version, byte count, xxh3-64
  of the bytes) then the bytes; an owner may also keep raw files of its own layout here (a ps-worker's
  shards, mapped by same-host peers at tensor offsets: their format version and checksums are in the
  journal record that names them). A segment means nothing until a committed journal record names it;
  :meth:`DurableStore.sweep` removes those none does (a write cut off before its record was committed).

Contract (*acknowledged = durable*): a caller answers a request only after :meth:`DurableStore.commit`
returned for its record, and the segments the record names were written (:meth:`DurableStore.write`)
before. The commit flag is the last byte written, so a process killed at any point leaves either the
committed record or nothing the next process will act on.

Room: at open the tmpfs size is checked against the owner's budget (:func:`check_capacity`); a segment is
allocated whole (``posix_fallocate``) before any byte is written, so a full tmpfs is a clean
:class:`StoreFull` (never a ``SIGBUS`` on a mapped page), which the owner turns into a refusal.

A host failure (reboot, power) loses everything here: tmpfs lives in memory. The store survives its
process, not its machine.

Other users: ``/dev/shm`` is shared by every user and a store's name is predictable, so a store directory is
made mode 0700, and one found there is used only when it is a directory (not a symlink) this user owns
(:class:`StoreError` otherwise, naming it); one group or others may reach is made 0700 again (logged
``store.directory_made_private``). Its own files are opened without following symlinks. :func:`gc` leaves
other users' directories alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import re
import shutil
import stat
import struct
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ...protocol.codec import checksum
from ...protocol.errors import shown
from ..halting import Transient
from . import journal

log = structlog.get_logger(__name__)

PREFIX = "refbus-store."
SEGMENT_MAGIC = b"RBSEGM\0\0"
FORMAT_VERSION = journal.FORMAT_VERSION
_SEGMENT_HEADER = struct.Struct("<8sIIQQ")
DATA_OFFSET = 64  # segment bytes start here: aligned for any dtype
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
NAME_MAX = 255  # bytes of a file name (Linux, tmpfs included)
_OWN_FILES = frozenset({"lock", "id", "id.new", "journal", "journal.new"})
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class StoreError(RuntimeError):
    """The store cannot be opened or used as configured; the message says why and what to change."""


class StoreLocked(StoreError, Transient):
    """Another live process serves this store (``pid``): transient, since that may be the predecessor of a restarted
    process, not yet dead (``refbus node`` exits 1 on it, and is restarted, where other refusals of a store are
    final; it exits 2 when the broker says a live process holds the node's id)."""

    def __init__(self, path: Path, pid: int) -> None:
        self.pid = pid
        super().__init__(f"store {path} is held by process {pid or '?'}: a store is served by one process only "
                         "(the old one must exit first, or the node id is used twice)")


class StoreFull(StoreError):
    """The tmpfs has no room for a segment: refuse the write, retry once room comes back."""


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """One segment's bytes, a read-only view of its mapping (valid after the file is unlinked, for as long
    as a view of it lives)."""

    name: str
    nbytes: int
    checksum: int
    data: np.ndarray = field(repr=False)


MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
DEFAULT_MAX_MAP_COUNT = 65_530  # Linux's default, when the file cannot be read
MAP_HEADROOM = 8192  # mappings left, at least, to the rest of the process: libraries, thread stacks, arenas


def segment_limit(path: str = MAX_MAP_COUNT) -> int:
    """How many segments one process may keep mapped (:meth:`DurableStore.write` maps each): ``vm.max_map_count``
    (read from ``path``) less an eighth of it, at least :data:`MAP_HEADROOM`, for the rest of the process and the
    mappings of segments already deleted that a send still reads. Past the limit every ``mmap`` of the process
    fails (ENOMEM), its thread starts too, so an owner refuses new segments first."""
    try:
        with open(path) as file:
            count = int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        count = DEFAULT_MAX_MAP_COUNT
    return max(1, count - max(MAP_HEADROOM, count // 8))


def store_path(directory: str | Path, run: str, node: str) -> Path:
    """The directory of ``node``'s store in ``run``. Raises :class:`StoreError` when its name is longer than a
    file name may be (:data:`NAME_MAX`), which the filesystem would refuse as a bare ``OSError``: the message
    names the node id and the run id, whose lengths add up."""
    name = f"{PREFIX}{_SAFE.sub('_', run)}.{_SAFE.sub('_', node)}"
    if len(name) > NAME_MAX:  # ASCII only: characters are bytes
        raise StoreError(f"the store directory of node {shown(node)} in run {shown(run)} would be named with "
                         f"{len(name)} bytes, more than a file name holds ({NAME_MAX}): give the node a shorter id "
                         "or set a shorter store.run")
    return Path(directory) / name


def check_capacity(directory: str | Path, budget_bytes: int, what: str) -> None:
    """Raise :class:`StoreError` when the filesystem at ``directory`` is smaller than ``budget_bytes``
    (``what`` names the setting): a store that can never hold its budget fails at start, not mid-run."""
    stat = os.statvfs(directory)
    size = stat.f_blocks * stat.f_frsize
    if budget_bytes > size:
        raise StoreError(
            f"{directory} holds {size / 2**20:.0f} MiB, less than {what} = {budget_bytes / 2**20:.0f} MiB: "
            "lower the budget, give the tmpfs more room (docker --shm-size; a container's default /dev/shm is "
            "64 MiB), point store.directory at a larger tmpfs, or set store.durable = false")


class DurableStore:
    """One store directory, open and locked by this process (see the module doc) until :meth:`close`.

    Opening replays the journal: :attr:`replay` holds the committed records in order (the owner rebuilds its
    state from them), the uncommitted tail and any damage. :attr:`fresh` is True when the store was made now
    (anew, or again over a making a killed process left unfinished: nothing in that was ever committed).
    Not thread-safe: the owner serialises :meth:`commit`; :meth:`write` of a new segment may run on any
    thread (it takes a fresh name from an atomic counter and shares nothing else).

    Raises (from the constructor): :class:`StoreLocked`, :class:`StoreError` (capacity, a journal of
    another format version or that is not a journal; with ``strict``, a journal with garbage after its last good
    record, which is otherwise logged and cut off: an owner whose every record matters refuses it instead).
    """

    before_flag: Any = None  # a test's crash point between a record's bytes and its commit flag (compactions too)
    before_rename: Any = None  # a test's crash point: a new journal (a compaction's, a store's) not yet in place

    def __init__(self, directory: str | Path, run: str, node: str, *, budget_bytes: int, what: str,
                 strict: bool = False) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        check_capacity(directory, budget_bytes, what)
        self.path = store_path(directory, run, node)
        _private_directory(self.path)
        self._dir = str(self.path)
        self._lock_fd = _lock(self.path)
        self._prefix = f"seg-{os.urandom(4).hex()}-"
        self._names = itertools.count(1)  # next() is atomic: writers on several threads never share a name
        self._verified: dict[str, Segment | str] = {}
        try:
            with _own_files(self.path):
                made = _made(self.path)
            self.fresh = made is None
            if made is None:
                self.identity, self._fd = self._make()
                self.replay = journal.Replay([], None, "", 0)
            else:
                self.identity, data = made
                journal_path = self.path / "journal"
                try:
                    self.replay = journal.replay(data, str(journal_path))
                except journal.FormatError as exc:
                    raise StoreError(f"{exc}; remove {self.path} (refbus shm gc, once no process holds it)") from None
                if strict and self.replay.damaged:  # refused before the cut below: the file stays as found
                    raise StoreError(f"{journal_path}: {self.replay.damaged}; this journal is refused whole, "
                                     f"left as it is: inspect or remove {self.path}")
                with _own_files(self.path):
                    _discard_compaction(self.path)
                    self._fd = os.open(journal_path, os.O_RDWR | os.O_NOFOLLOW)
                os.ftruncate(self._fd, self.replay.end)
                os.lseek(self._fd, self.replay.end, os.SEEK_SET)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.records_since_compact = len(self.replay.records)
        if self.replay.damaged:
            log.error("store.journal_damaged", store=str(self.path), detail=self.replay.damaged,
                      records=len(self.replay.records))

    # --- segments -----------------------------------------------------------------------------------

    def write(self, data: np.ndarray) -> Segment:
        """Copy ``data`` (any contiguous array; its bytes) into a new segment; a read-only view of it.
        Nothing names the segment until a committed record does.

        Raises:
            StoreFull: the tmpfs has no room (nothing is left behind).
        """
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        name = f"{self._prefix}{next(self._names)}"
        path = self.path / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = DATA_OFFSET + raw.nbytes
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise StoreFull(f"no room in {self.path.parent} for {raw.nbytes} bytes") from None
            digest = checksum(memoryview(raw))
            _pwrite_all(fd, _SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, raw.nbytes, digest), 0)
            _pwrite_all(fd, raw, DATA_OFFSET)
            segment = Segment(name, raw.nbytes, digest, _map(fd, size))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._verified[name] = segment
        return segment

    def segment(self, name: str) -> Segment | str:
        """The segment ``name``, its bytes verified against its checksum (once per process), or why it
        cannot be used (missing, another format, cut short, bytes that do not match): a loss to name."""
        found = self._verified.get(name)
        if found is None:
            found = self._verified[name] = _read_segment(os.path.join(self._dir, name))
        return found

    def unlink(self, names: Iterable[str]) -> None:
        """Remove segments (their records were committed as dropped); views of them stay valid."""
        for name in names:
            self._verified.pop(name, None)
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()

    def sweep(self, keep: Iterable[str]) -> list[str]:
        """Remove every segment (any file but the store's own) not in ``keep``: none of its records
        committed, or dropped; their names."""
        keep = {*keep, *_OWN_FILES}
        removed = sorted(p.name for p in self.path.iterdir() if p.name not in keep)
        self.unlink(removed)
        return removed

    # --- journal ------------------------------------------------------------------------------------

    def commit(self, record: dict[str, Any]) -> None:
        """Append ``record`` and its commit flag: once this returns, a restart replays it. When it raises (a
        record too large, a full disk), the journal is cut back to where it was: a torn record left at its end
        would end every later replay there, losing the records appended after it."""
        start = os.lseek(self._fd, 0, os.SEEK_CUR)
        try:
            journal.append(self._fd, record, before_flag=self.before_flag)
        except Exception:  # not BaseException: a test's crash point stands for the process dying there
            os.ftruncate(self._fd, start)
            os.lseek(self._fd, start, os.SEEK_SET)
            raise
        self.records_since_compact += 1

    def compact_due(self, live: int, least: int) -> bool:
        """Whether the journal is worth rewriting: more records since the last compaction than ``least`` and
        than four times the ``live`` records a compaction would keep (it costs a pass over the live state)."""
        return self.records_since_compact > max(least, 4 * live)

    def compact(self, records: Iterable[dict[str, Any]]) -> None:
        """Replace the journal by ``records`` (the owner's state now), atomically: a kill at any point leaves
        the old journal or the new one, never a mix."""
        fd = self._install(records)
        os.close(self._fd)
        self._fd = fd
        self.records_since_compact = 0

    def _make(self) -> tuple[str, int]:
        """Make the store: its new identity and its journal's descriptor. What an unfinished making left is
        removed first (nothing in it was committed: commits start once the store is made).

        The journal goes in whole (:meth:`_install`: header only), then the ``id``, each by a rename, so an
        ``id`` means a whole journal and a kill at any point leaves either a made store or no ``id``, which
        the next open makes again. (An ``id`` first would mean nothing: killed before the journal was
        whole, it marks a store that cannot be opened. Older builds wrote it first; what such a kill left,
        an ``id`` beside a journal missing or cut inside its header, :func:`_made` takes for an unfinished
        making too.)
        """
        # The id first: an old one left beside the new journal would pass for a made store.
        for stale in [self.path / "id", self.path / "journal", *self.path.glob("seg-*")]:
            stale.unlink(missing_ok=True)
        fd = self._install(())
        try:
            identity = os.urandom(8).hex()
            tmp = self.path / "id.new"
            tmp.write_text(identity + "\n")
            os.rename(tmp, self.path / "id")
        except BaseException:
            os.close(fd)
            raise
        return identity, fd

    def _install(self, records: Iterable[dict[str, Any]]) -> int:
        """Put a journal of ``records`` in place whole; its descriptor, at its end. It is written as
        ``journal.new`` (each record committed as usual) and renamed over ``journal``: a kill at any point
        leaves the journal that was there (or none) and at most a ``journal.new``, which no open reads.

        No fsync: the store outlives its process, not its host (tmpfs), and the rename alone is atomic against
        the death of a process.
        """
        new_path = self.path / "journal.new"
        fd = os.open(new_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            journal.write_header(fd)
            for record in records:
                journal.append(fd, record, before_flag=self.before_flag)
            if self.before_rename is not None:
                self.before_rename()
            os.rename(new_path, self.path / "journal")
        except BaseException:
            os.close(fd)
            new_path.unlink(missing_ok=True)
            raise
        return fd

    def close(self, *, remove: bool) -> None:
        """Release the store; ``remove``: delete its directory too (a clean shutdown deleted everything in
        it). Idempotent."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)


def gc(directory: str | Path, run: str = "") -> list[Path]:
    """Remove the store directories under ``directory`` (of ``run`` only, when given) that no live process
    holds; the paths removed. A directory whose lock is held is left alone, and so is anything but a directory
    of this user's (another user's, or a symlink)."""
    pattern = f"{PREFIX}{_SAFE.sub('_', run)}.*" if run else f"{PREFIX}*"
    return [path for path in sorted(Path(directory).glob(pattern)) if _owned_directory(path) and remove_unheld(path)]


def _owned_directory(path: Path) -> bool:
    """Whether ``path`` itself (not what a symlink names) is a directory this user owns."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _private_directory(path: Path) -> None:
    """Make the store directory ``path`` (mode 0700), or check the one there: a directory, not a symlink, of
    this user's. Anything else may be another user's (the name is predictable): the store's files would be
    theirs to replace, or would follow their symlinks. One of this user's that group or others may reach (an
    earlier version made it with the umask's mode, 0775 under umask 002) is made 0700, and that is logged.

    Raises:
        StoreError: naming ``path`` and why it is refused.
    """
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"store directory {path} is not a directory (a symlink, or a file): remove it, or set "
                         "another store.directory or store.run")
    if st.st_uid != os.geteuid():
        raise StoreError(f"store directory {path} is owned by uid {st.st_uid}, not by this user (uid "
                         f"{os.geteuid()}): another user made it; remove it, or set another store.directory or "
                         "store.run")
    if st.st_mode & 0o077:
        path.chmod(0o700)  # lstat said a directory, not a symlink: chmod changes this directory itself
        log.warning("store.directory_made_private", store=str(path), mode=f"{stat.S_IMODE(st.st_mode):o}")


def remove_unheld(path: Path) -> bool:
    """Remove the store directory ``path`` unless a live process holds its lock; whether it was removed."""
    try:
        fd = _lock(path)
    except StoreLocked:
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _lock(path: Path) -> int:
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreLocked(path, int(holder) if holder.isdigit() else 0) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def _own_files(path: Path) -> Iterator[None]:
    """Turn an OSError on one of the store's own files at ``path`` into a :class:`StoreError` naming the file: one
    that cannot be read or opened as a file of the store's (a directory or a symlink in its place, no permission)
    refuses the store as found, never made again over it (that would drop every committed record) nor left to
    fail as an error that a supervisor restarts into again."""
    try:
        yield
    except OSError as exc:
        raise StoreError(f"{exc.filename or path}: {exc.strerror}, where the store keeps a file of its own; this "
                         f"store is refused, left as it is: inspect or remove {path}") from None


def _made(path: Path) -> tuple[str, bytes] | None:
    """The identity and journal bytes of the store at ``path`` when it was made; None when its making never
    finished (see :meth:`DurableStore._make`): no ``id``, or one beside a journal that is missing or cut
    inside its header (:func:`journal.header_cut`), which only a making killed mid-way leaves, and is logged.
    A journal whose header is wrong is returned as it is: the replay refuses it."""
    try:
        identity = (path / "id").read_text().strip()
    except FileNotFoundError:
        return None
    if not identity:
        return None
    try:
        data = (path / "journal").read_bytes()
    except FileNotFoundError:
        data = b""
    if journal.header_cut(data):
        log.warning("store.making_unfinished", store=str(path), journal_bytes=len(data),
                    detail="a process killed while making the store: nothing was committed, it is made again")
        return None
    return identity, data


def _discard_compaction(path: Path) -> None:
    """Remove a compaction's new journal a dead process left unfinished (it only takes effect by its rename
    over ``journal``, so the old journal stands whole); whatever its bytes, they are never read."""
    new = path / "journal.new"
    try:
        size = new.stat().st_size
    except FileNotFoundError:
        return
    new.unlink()
    log.warning("store.compaction_discarded", store=str(path), bytes=size,
                detail="a compaction cut short by the death of its process: the journal it was to replace stands")


def _pwrite_all(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``. One write may write less than it was given (Linux moves
    at most 0x7ffff000 bytes per call), and a segment's tail left as ``posix_fallocate``'s zeros would pass
    for written until its checksum is checked. Raises OSError for a write that writes nothing."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"a write of {len(view)} bytes at offset {offset} wrote nothing")
        view, offset = view[written:], offset + written


def map_file(fd: int, size: int, *, writable: bool = False) -> ctypes.Array[ctypes.c_uint8]:
    """The first ``size`` bytes of the file open as ``fd``, mapped shared (read-only unless ``writable``): unmapped
    once the last reference to the array (a view of it included) is gone. ``fd`` may be closed at once.

    Mapped through libc, not :class:`mmap.mmap`: that keeps a duplicate of the file descriptor per mapping,
    and a store holds one mapping per blob (tens of thousands), a ps-worker one per segment, far past any
    descriptor limit. Mappings are bounded too (``vm.max_map_count``, 65,530 by default, for the whole process):
    an owner caps its live segments with :func:`segment_limit`. Raises OSError when the kernel refuses the mapping.
    """
    protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc.mmap(None, size, protection, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    memory = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(memory, _libc.munmap, addr, size)
    return memory


def _map(fd: int, size: int) -> np.ndarray:
    """A read-only view of a segment's bytes (:func:`map_file`)."""
    view = np.frombuffer(map_file(fd, size), dtype=np.uint8, offset=DATA_OFFSET)
    view.flags.writeable = False
    return view


def _read_segment(path: str) -> Segment | str:
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return f"segment {name} is missing"
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _SEGMENT_HEADER.size, 0)
        if len(head) < _SEGMENT_HEADER.size:
            return f"segment {name}: {size} bytes, shorter than its header"
        magic, version, _, nbytes, digest = _SEGMENT_HEADER.unpack(head)
        if magic != SEGMENT_MAGIC:
            return f"segment {name}: not a refbus segment (magic {magic!r})"
        if version != FORMAT_VERSION:
            return f"segment {name}: format version {version}, this build reads version {FORMAT_VERSION}"
        if size != DATA_OFFSET + nbytes:
            return f"segment {name}: {size - DATA_OFFSET} bytes, its header says {nbytes}"
        data = _map(fd, size)
        if checksum(memoryview(data)) != digest:
            return f"segment {name}: its bytes do not match their checksum"
        return Segment(name, nbytes, digest, data)
    finally:
        os.close(fd)
