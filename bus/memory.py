"""Receive memory that stays warm: how a process that takes in large frames every step keeps them off fresh pages.

ZeroMQ's I/O thread allocates every received frame with ``malloc`` in the thread's own glibc arena. By default
glibc hands blocks above an adaptive threshold out as fresh ``mmap``s, and gives an arena's 64 MiB heaps back
to the kernel as soon as they are entirely free, which is exactly what happens after a step's frames are
released. Every byte of the next step then lands on a page the kernel has to fault in and zero: measured
here, 65k faults and most of the I/O thread's time per 256 MiB fetched, against none once memory is kept.

:func:`keep_receive_memory` sets three process-wide ``mallopt`` values: blocks up to 32 MiB (glibc's ceiling;
pieces and blob frames are at most a few MiB) come from the heap, free memory at a heap's top is not trimmed,
and the top pad (64 MiB, the size of a heap) stops glibc from deleting heaps that are entirely free. Cost: the
process keeps the largest amount it has ever had in flight at once (a trainer rank: one step's frames) as
free heap memory instead of returning it. Only a process that receives large frames repeatedly should call
it (a trainer rank's fetcher, a parameter-server reader). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (half its heap size)
TOP_PAD = 64 << 20  # a whole heap: a free heap never qualifies for deletion
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int: the largest, more than any heap's top ever holds

_lock = threading.Lock()
_kept: list[bool] = []


def keep_receive_memory() -> bool:
    """Keep freed heap memory in this process for the next frames (see the module doc); idempotent.
    Returns whether the allocator took the settings (False: not glibc)."""
    with _lock:
        if not _kept:
            _kept.append(_apply())
        return _kept[0]


def _apply() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TOP_PAD, TOP_PAD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all(mallopt(option, value) == 1 for option, value in settings)
