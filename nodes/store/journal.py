"""The store's journal: an append-only file of records, each committed by a flag byte written last.

Layout (all integers little-endian)::

    file header   8 bytes magic ``RBJRNL\\0\\0``, u32 format version, u32 zero
    record        u32 payload length, u64 xxh3-64 of the payload, payload (msgpack map), u8 commit flag (1)

A record is written in two system calls: length, checksum and payload, then the flag. A process killed
between the two leaves an *uncommitted* record at the end; :func:`replay` hands it back apart (decoded
when its bytes are whole) and the journal is cut before it, so the next append follows the last committed
record. Bytes that do not parse as a record (a checksum that does not match, a length past the end) end
the replay there: what follows is named in :attr:`Replay.damaged`, never applied. A record whose length runs
past the end of the file is a tail cut by a crash only when no committed record follows it: one that does is
a length garbled in the middle, damage too.

Pure file handling: no sockets, no threads; the store (:mod:`.durable`) owns the file descriptor.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ...protocol.codec import checksum

MAGIC = b"RBJRNL\0\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sII")
_RECORD = struct.Struct("<IQ")
COMMITTED = b"\x01"
MAX_RECORD_BYTES = 64 << 20  # a length above this is garbage, not a record
_SCAN_WINDOW = 1 << 20  # offsets sifted at once when telling a torn tail from a garbled length (~30 MiB of arrays)


class FormatError(ValueError):
    """A journal or segment file this build cannot read (wrong magic or format version)."""


class RecordTooLarge(ValueError):
    """A record whose payload is over :data:`MAX_RECORD_BYTES`: a replay would read it as garbage and stop there,
    losing every record after it, so it is refused before a byte of it is written."""


@dataclass(frozen=True, slots=True)
class Replay:
    """What :func:`replay` read: the committed records in order; the uncommitted tail record (decoded, or
    None when there was none or its bytes were cut); ``damaged``: why the replay stopped early ("" when it
    read to the end); ``end``: the offset the journal is cut at."""

    records: list[dict[str, Any]]
    uncommitted: dict[str, Any] | None
    damaged: str
    end: int


def header() -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0)


def write_header(fd: int) -> None:
    """Write a new journal's header at ``fd``'s position (its start), every byte of it."""
    _write_all(fd, header())


def header_cut(data: bytes) -> bool:
    """Whether ``data`` is a journal header cut short: fewer bytes than a header, each the header's own. That
    is what a journal's making cut off leaves, and it holds nothing committed (a record follows a whole
    header); any other short or wrong start is not this build's journal (:func:`check_header`)."""
    return len(data) < _HEADER.size and header().startswith(data)


def check_header(data: bytes, what: str) -> None:
    """Raise :class:`FormatError` naming ``what`` unless ``data`` starts with this build's journal header."""
    if len(data) < _HEADER.size:
        raise FormatError(f"{what}: {len(data)} bytes, shorter than a journal header")
    magic, version, _ = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{what}: not a refbus store journal (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise FormatError(f"{what}: journal format version {version}, this build reads version {FORMAT_VERSION}")


def encode(record: dict[str, Any]) -> tuple[bytes, bytes]:
    """A record's bytes before its flag, and the flag: the two writes of an append. Raises
    :class:`RecordTooLarge` for a payload a replay could not read back."""
    payload = msgspec.msgpack.encode(record)
    if len(payload) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"a {record.get('op', '?')!r} record of {len(payload)} bytes: a journal record holds "
                             f"at most {MAX_RECORD_BYTES}")
    return _RECORD.pack(len(payload), checksum(payload)) + payload, COMMITTED


def append(fd: int, record: dict[str, Any], *, before_flag: Callable[[], None] | None = None) -> int:
    """Append ``record`` to the journal open at ``fd`` (positioned at its end); the bytes appended.
    ``before_flag`` runs between the record's bytes and its flag (a test's crash point)."""
    body, flag = encode(record)
    _write_all(fd, body)
    if before_flag is not None:
        before_flag()
    _write_all(fd, flag)
    return len(body) + len(flag)


def replay(data: bytes, what: str) -> Replay:
    """Parse a whole journal file's bytes (see the module doc). Raises :class:`FormatError` for a header
    this build cannot read; any other damage is reported in the result, never raised."""
    check_header(data, what)
    records: list[dict[str, Any]] = []
    offset = _HEADER.size
    while offset < len(data):
        if len(data) - offset < _RECORD.size:
            return Replay(records, None, "", offset)  # a record cut inside its length: never committed
        length, digest = _RECORD.unpack_from(data, offset)
        start, stop = offset + _RECORD.size, offset + _RECORD.size + length
        if length > MAX_RECORD_BYTES:
            return Replay(records, None, f"garbage at byte {offset}: record length {length}", offset)
        if stop > len(data):
            follows = _committed_after(data, offset + 1)
            if follows is not None:  # not a tail cut by a crash: a length garbled, the records after it hidden
                return Replay(records, None, f"garbage at byte {offset}: record length {length} runs past the "
                              f"end, yet a committed record follows at byte {follows}", offset)
            return Replay(records, None, "", offset)  # cut inside its payload: never committed
        payload = data[start:stop]
        if checksum(payload) != digest:
            return Replay(records, None, f"garbage at byte {offset}: record checksum does not match", offset)
        try:
            record = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            return Replay(records, None, f"garbage at byte {offset}: {exc}", offset)
        if not isinstance(record, dict):
            return Replay(records, None, f"garbage at byte {offset}: a record is a map", offset)
        flag = data[stop : stop + 1]
        if flag != COMMITTED:
            if flag or stop + 1 < len(data):  # a flag byte that is not 1, or bytes after the tail
                return Replay(records, None, f"garbage at byte {stop}: commit flag {flag!r}", offset)
            return Replay(records, record, "", offset)
        records.append(record)
        offset = stop + 1
    return Replay(records, None, "", offset)


def _committed_after(data: bytes, start: int) -> int | None:
    """The offset of the first whole committed record in ``data`` at or after ``start`` (a map's payload that its
    checksum matches, then its commit flag), None when there is none. A record cut by a crash is the journal's
    last: one whose length runs past the end with a committed record after it was garbled, and taking it for a
    cut tail would drop every record after it. Candidates are sifted with numpy (their length fits, a flag byte
    follows, the payload starts as a map) before any checksum, :data:`_SCAN_WINDOW` offsets at a time (memory
    stays bounded whatever the tail's size): this runs once per open, on a journal's tail."""
    end = len(data) - _RECORD.size - 1  # past the last offset a header and a flag fit after
    raw = np.frombuffer(data, dtype=np.uint8)
    for first in range(start, end, _SCAN_WINDOW):
        size = min(_SCAN_WINDOW, end - first)
        lengths = np.ndarray((size,), dtype="<u4", buffer=data, offset=first, strides=(1,)).astype(np.int64)
        offsets = np.arange(first, first + size, dtype=np.int64)
        stops = offsets + _RECORD.size + lengths
        fits = (lengths > 0) & (stops < len(data))
        offsets, stops = offsets[fits], stops[fits]
        head = raw[offsets + _RECORD.size]
        maps = ((head >= 0x80) & (head <= 0x8F)) | (head == 0xDE) | (head == 0xDF)  # fixmap, map16, map32
        flagged = maps & (raw[stops] == COMMITTED[0])
        for offset, stop in zip(offsets[flagged].tolist(), stops[flagged].tolist(), strict=True):
            _, digest = _RECORD.unpack_from(data, offset)
            if checksum(data[offset + _RECORD.size : stop]) == digest:
                return offset
    return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
