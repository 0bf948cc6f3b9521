"""The envelope: how a message becomes ZeroMQ frames and back.

    [kind, header, body, *buffers]            unsigned
    [kind, header, body, *buffers, mac]       signed
    [kind ‖ 0x00 ‖ len(header) ‖ header ‖ body] (+ [mac])   one frame, for a message without arrays
    [kind ‖ 0x01 ‖ msgpack [[header, body], ...]] (+ [mac])   a batch of events, one frame

The one-frame form carries the same kind, header and body in one ZeroMQ frame (``len(header)``: 4 bytes,
little-endian); it starts with the kind, so PUB/SUB topic prefixes still match, and a kind never holds a NUL
byte, so the first frame says which form a message has: its kind ends in 0x00 in the one-frame form, in 0x01
(with no 0x00 before it, one frame and perhaps its MAC) in the batch form. Events travel in one frame (pyzmq's
cost per message is most of the event path); every receiver accepts both forms for every message.

The batch form (protocol 2.2) carries several events of one kind from one source in one frame, each with its
own header (its own id and sequence number): a node's loop sends what it published in one turn together, so a
burst of events costs one ZeroMQ message, one MAC and one pass through the broker, and msgspec encodes and
decodes all of its headers and bodies in one call each. Only events travel so; a batch is read or refused
whole (:meth:`WireCodec.read_events` for headers, :meth:`WireCodec.decode_batch` for messages).

* ``kind``: ASCII name of the message kind; also the PUB/SUB topic prefix.
* ``header``: msgpack map :class:`Header` (protocol version, message id, source node, per-source
  sequence number, timestamp, optional reply-to id, whether a MAC frame follows).
* ``body``: msgpack map, validated against the kind's Struct from :mod:`refbus.protocol.messages`.
* ``buffers``: raw array bytes, one frame per array, described in the body (see :mod:`refbus.protocol.codec`).
* At most ``MAX_FRAMES`` (65,536) frames in all, the MAC frame included: a receiver reads a longer message off
  its socket without keeping its frames and refuses it ``malformed`` (:mod:`refbus.bus.sockets`).
* ``mac``: with a cluster secret, HMAC-SHA256 over every frame before it, each as its length (8 bytes,
  little-endian) then its bytes. It signs the frames exactly as they travel, so a receiver checks the bytes it
  received (never a re-encoding: a header with a field it does not know, keys in another order or an integer
  ``ts`` verifies as sent), and it sits outside what it signs. Length prefixes stop bytes from moving between
  frames. Checksums are xxh3, fast but not cryptographic, so the MAC covers the array bytes themselves: signing
  costs one SHA-256 pass over the arrays on each side.

A :class:`WireCodec` is not thread-safe: each thread that owns sockets keeps its own.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from .bounds import check_structure, depth_checks
from .codec import ArrayBackend, ArrayPacker, ArrayUnpacker, Buffer
from .errors import (
    BadSignature,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaError,
    UnknownKind,
    VersionMismatch,
    shown,
)
from .messages import KINDS, MAX_FRAMES, Body, Sync

PROTOCOL_VERSION: tuple[int, int] = (2, 2)
NIL_CHECKSUM_SINCE: tuple[int, int] = (2, 1)  # the first version whose decoders read an unhashed frame
MAJOR = PROTOCOL_VERSION[0]
SPOKEN_MAJORS: tuple[int, ...] = (MAJOR,)  # majors this build encodes and decodes
MIN_FRAMES = 3
MAC_BYTES = 32
MAX_BUFFERS = MAX_FRAMES - MIN_FRAMES - 1  # array frames one message carries at most, a MAC frame left room for
ONE_FRAME_MARK = b"\0"  # ends the kind in the one-frame form
BATCH_MARK = b"\1"  # ends the kind in the batch form
MAX_BATCH_EVENTS = 65_535  # events in one batch, at most (what a welcome's event_batch allows, at most)
MAX_KIND_BYTES = 256
_HEADER_LENGTH = struct.Struct("<I").unpack_from  # the one-frame form's len(header)
# A header holds ids and numbers: its size is bounded apart from the body's, since a receiver may keep its ids
# (a server remembers those it answered).
MAX_HEADER_BYTES = 4096
ONE_FRAME_OVERHEAD = MAX_KIND_BYTES + len(ONE_FRAME_MARK) + 4 + MAX_HEADER_BYTES
"""The most bytes a one-frame message holds beside its body (kind, mark, ``len(header)``, header); see
:func:`largest_frame`."""


def largest_frame(max_body_bytes: int, max_message_bytes: int) -> int:
    """The largest frame of a message limits of ``max_body_bytes`` and ``max_message_bytes`` admit: a one-frame
    message's (its body plus :data:`ONE_FRAME_OVERHEAD`), but no frame is larger than the whole message. A
    ZeroMQ frame cap (``limits.max_frame_bytes``) below it drops messages the limits admit."""
    return min(max_body_bytes + ONE_FRAME_OVERHEAD, max_message_bytes)
Id = Annotated[str, msgspec.Meta(max_length=256)]


# Not tracked by the garbage collector (gc=False): its fields are strings and numbers, so it can be in no
# reference cycle, and the events a subscriber holds ready are fewer objects for each collection to walk. Not
# in the docstring: that is the protocol reference's text.
class Header(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """The envelope's header frame: a msgpack map, default-valued fields omitted."""

    v: tuple[int, int]  # protocol (major, minor)
    id: Id  # "<incarnation>-<counter>": unique per sender process; retries reuse it (see incarnation())
    src: Id  # sending node id
    seq: int  # per-source sequence number (events), 0 for requests and replies
    ts: float  # wall-clock seconds at send (display only: nothing is judged by it)
    re: Id = ""  # id of the request this message answers
    signed: bool = False  # a MAC frame follows the last frame


BatchItem = tuple[Header, msgspec.Raw]
"""One event of a batch as a publisher holds it until the batch goes: its header and its encoded body."""


@dataclass(frozen=True)
class Limits:
    """Bounds checked before a body is decoded, so no peer can make a node allocate or recurse without end.

    ``max_items`` (list elements and map entries of one body, all together) is checked on the raw bytes of
    every body longer than ``max_items`` bytes (a shorter one cannot hold more values than it has bytes);
    ``max_depth`` on those bytes too, and after decoding on kinds with ``Any``-typed fields (typed fields
    bound their own depth). ``max_message_bytes`` also bounds the element count of every array, zero-sized
    ones included. See :mod:`refbus.protocol.bounds`.
    """

    max_body_bytes: int = 16 << 20
    max_message_bytes: int = 8 << 30
    max_depth: int = 32
    max_items: int = 1 << 20


class Message(msgspec.Struct, frozen=True, gc=False):
    """A decoded message. Array fields of ``body`` view ``buffers`` (the received frames).

    A Struct rather than a dataclass: one is built per message received, and this is ~7x cheaper. Not tracked
    by the garbage collector (``gc=False``): it is frozen and built after its body and frames, so only code
    that puts a message into a container inside its own body or buffers could make a cycle through it (which
    would then never be collected); a subscriber's batch of ready events costs the collector ~0.3 us less each.
    """

    kind: str
    header: Header
    body: Body
    buffers: Sequence[Any] = ()

    def __repr__(self) -> str:  # frames can be large; show how many there are
        return f"Message(kind={self.kind!r}, header={self.header!r}, body={self.body!r}, buffers=<{len(self.buffers)}>)"


class Received(msgspec.Struct, frozen=True):
    """An envelope whose kind, header and sizes are checked (and its MAC, when the codec signs), body unread.

    ``frames``: the parts in the multi-frame layout ``[kind, header, body, *buffers]`` (a one-frame message
    split), without the MAC frame. A Struct: one is built per message received, at half a NamedTuple's cost."""

    kind: str
    header: Header
    frames: Sequence[Any]


class MessageIds:
    """Cheap unique message ids: a random per-process prefix and a counter (uuid4 costs ~2 µs each).
    ``prefix`` pins the prefix (frozen test messages only: two processes must never share one)."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix or os.urandom(6).hex()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


class WireCodec:
    """Encodes and decodes envelopes for one node (``src``).

    ``secret`` turns on signing: outgoing messages carry a MAC and incoming ones without a valid MAC are
    rejected. Decoded array fields view the received frames; the caller owns them after decode.
    """

    def __init__(self, src: str, *, secret: bytes = b"", limits: Limits | None = None) -> None:
        self.src = src
        self.limits = limits or Limits()
        self._secret = secret
        self._ids = MessageIds()
        self._packer = ArrayPacker()
        self._unpacker = ArrayUnpacker(max_elements=self.limits.max_message_bytes)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._packer.enc_hook)
        self._header_decoder = msgspec.msgpack.Decoder(Header)
        self._body_decoders = {
            kind: msgspec.msgpack.Decoder(cls, ext_hook=self._unpacker.ext_hook) for kind, cls in KINDS.items()
        }
        self._depth_checks = depth_checks(KINDS)
        self._batch_header_decoder = msgspec.msgpack.Decoder(list[tuple[Header, msgspec.Raw]])
        self._batch_decoders = {
            kind: msgspec.msgpack.Decoder(list[tuple[Header, cls]], ext_hook=self._unpacker.ext_hook)  # type: ignore[valid-type]
            for kind, cls in KINDS.items()
        }
        self._kind_frames = {kind: kind.encode("ascii") for kind in KINDS}
        self._kind_names = {frame: kind for kind, frame in self._kind_frames.items()}
        self._signed = bool(secret)
        # A one-frame message's body bounds its whole size (it is the only frame): the tighter of both limits.
        self._max_one_frame_body = min(self.limits.max_body_bytes, self.limits.max_message_bytes)

    def new_id(self) -> str:
        return self._ids.next()

    # --- encode -------------------------------------------------------------------------------------

    def encode(
        self, body: Body, *, seq: int = 0, msg_id: str = "", reply_to: str = "", one_frame: bool = False
    ) -> list[Buffer]:
        """Frames for ``body``. Arrays in it are not copied: keep them unmodified until sent. ``one_frame``:
        the one-frame form when ``body`` has no arrays. :class:`MessageTooLarge` when ``body`` holds more than
        ``MAX_BUFFERS`` arrays (no receiver takes a message of more than ``MAX_FRAMES`` frames)."""
        frames = self._packer.begin()
        encode = self._encoder.encode
        body_bytes = encode(body)
        kind = self._kind_frames[body.kind]
        if len(frames) > MAX_BUFFERS:  # every receiver would refuse it: say so here, where it can be split
            raise MessageTooLarge(f"{len(frames)} arrays in one message, at most {MAX_BUFFERS} (one frame each, "
                                  f"{MAX_FRAMES} frames in all)", kind=body.kind)
        signed = self._signed
        header_bytes = encode(self._stamp(seq, msg_id, reply_to))
        if one_frame and not frames:
            out = [b"".join((kind, ONE_FRAME_MARK, len(header_bytes).to_bytes(4, "little"), header_bytes,
                             body_bytes))]
        else:
            out = [kind, header_bytes, body_bytes, *frames]
        if signed:
            out.append(self._mac(out))
        return out

    def batch_item(self, body: Body, seq: int) -> BatchItem | None:
        """``body`` as event ``seq`` of a batch (:meth:`encode_batch`): its header, stamped now, and its encoded
        body; None when ``body`` has arrays (such an event travels alone). Encoding here, not when the batch goes,
        is what lets the caller change ``body`` after publishing it."""
        arrays = self._packer.begin()
        body_bytes = self._encoder.encode(body)
        return None if arrays else (self._stamp(seq), msgspec.Raw(body_bytes))

    def _stamp(self, seq: int, msg_id: str = "", reply_to: str = "") -> Header:
        """The header of a message this codec sends now."""
        return Header(PROTOCOL_VERSION, msg_id or self._ids.next(), self.src, seq, time.time(), reply_to, self._signed)

    def encode_batch(self, kind: str, items: Sequence[BatchItem]) -> list[Buffer]:
        """Frames of the events ``items`` (from :meth:`batch_item`, all of ``kind``, in sequence order): the
        batch form, or the one-frame form for a single event (what every 2.x subscriber reads)."""
        raw_kind = self._kind_frames[kind]
        encode = self._encoder.encode
        if len(items) == 1:
            header, body = items[0]
            header_bytes = encode(header)
            out = [b"".join((raw_kind, ONE_FRAME_MARK, len(header_bytes).to_bytes(4, "little"), header_bytes,
                             body))]
        else:
            out = [b"".join((raw_kind, BATCH_MARK, encode(items)))]
        if self._signed:
            out.append(self._mac(out))
        return out

    def _mac(self, frames: Sequence[Buffer]) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for frame in frames:  # xxh3 checksums are not cryptographic: the MAC covers the bytes themselves
            view = memoryview(frame)
            mac.update(view.nbytes.to_bytes(8, "little"))
            mac.update(view)
        return mac.digest()

    # --- decode -------------------------------------------------------------------------------------

    def decode_header(self, frames: Sequence[Buffer], *, known: bool = True) -> Received:
        """Kind and header of an envelope, checked for shape, version, size and (when this codec signs) its MAC;
        the body is not read. ``known=False`` lets an ASCII kind this node does not define pass (what a
        forwarder needs). The version is checked before the MAC, so an older peer hears ``version``.
        ``Received.frames`` has the multi-frame form's layout whichever form arrived."""
        if len(frames) == 1:
            received = self.event_header(frames[0])
            if received is not None:
                return received
        first = frames[0] if frames else b""
        if type(first) is not bytes:
            first = bytes(first)
        mark = first.find(ONE_FRAME_MARK, 0, MAX_KIND_BYTES)
        if _batch_mark(frames) >= 0:
            raise MalformedMessage("a batch of events: only an event stream carries one (see read_events)")
        one_frame = mark >= 0
        if one_frame:
            parts = _split_one_frame(first, mark)
            raw_kind = parts[0]
        elif len(frames) < MIN_FRAMES:
            raise MalformedMessage(
                f"expected at least {MIN_FRAMES} frames [kind, header, body, *buffers] or one frame "
                f"kind ‖ 0x00 ‖ len(header) ‖ header ‖ body, got {len(frames)}"
            )
        elif len(first) > MAX_KIND_BYTES:  # refused before anything else is read, and never quoted whole
            raise MalformedMessage(f"kind frame is {len(first)} bytes, limit {MAX_KIND_BYTES}: {shown(first)}")
        else:
            parts = frames
            raw_kind = first
        kind = self._kind_of(raw_kind)
        header = self.read_header(parts[1], kind=kind)
        _check_version(header, kind)
        if known and kind not in KINDS:
            raise UnknownKind(f"unknown message kind {shown(kind)} from {header.src!r}", kind=kind)
        signed = frames[:-1] if header.signed else frames
        limits = self.limits
        if one_frame:
            _one_frame_and_mac(frames, header, kind, "one-frame message")
            body_size = total = len(parts[2])  # split from one bytes frame: bytes too
        elif len(signed) < MIN_FRAMES:
            raise MalformedMessage("a signed header, but no frame after the body for its MAC", kind=kind)
        else:
            body_size = memoryview(parts[2]).nbytes
            total = sum(memoryview(f).nbytes for f in frames) if len(frames) > MIN_FRAMES else body_size
        if body_size > limits.max_body_bytes:
            raise MessageTooLarge(f"body is {body_size} bytes, limit {limits.max_body_bytes}", kind=kind)
        if total > limits.max_message_bytes:
            raise MessageTooLarge(f"message is {total} bytes, limit {limits.max_message_bytes}", kind=kind)
        if self._secret:
            self._check_mac(kind, header, signed, frames[-1])
        return Received(kind, header, parts if one_frame else signed)

    def read_events(self, frames: Sequence[Buffer], *, known: bool = True) -> list[Received]:
        """The header of every event of an event message, each as :meth:`decode_header` returns one: a single
        event in the one-frame or multi-frame form, or each event of a batch in order (see
        :meth:`_read_batch`: a batch is read or refused whole; its events' ``frames`` hold no header bytes).
        ``known`` as in :meth:`decode_header`."""
        if len(frames) == 1:
            received = self.event_header(frames[0])
            if received is not None:
                return [received]
        mark = _batch_mark(frames)
        if mark < 0:
            return [self.decode_header(frames, known=known)]
        kind, raw_kind, events = self._read_batch(frames, mark, known)
        return [Received(kind, header, [raw_kind, b"", body]) for header, body in events]

    def decode_batch(self, frames: Sequence[Buffer]) -> list[Message] | None:
        """Every event of a batch, decoded and validated as :meth:`decode` validates one, or a
        :class:`ProtocolError` for the whole batch; None when ``frames`` is no batch. An unsigned batch of a kind
        this node defines is decoded in one step (all headers and bodies in one msgspec call); anything that step
        declines, every error included, goes through :meth:`_read_batch` and :meth:`decode_body`, which decide
        and word each refusal: the same checks either way."""
        mark = _batch_mark(frames)
        if mark < 0:
            return None
        if not self._signed and len(frames) == 1:
            messages = self._decode_batch_in_one_step(_as_bytes(frames[0]), mark)
            if messages is not None:
                return messages
        kind, raw_kind, events = self._read_batch(frames, mark, True)
        return [self.decode_body(Received(kind, header, [raw_kind, b"", body])) for header, body in events]

    def _decode_batch_in_one_step(self, frame: bytes, mark: int) -> list[Message] | None:
        kind = self._kind_names.get(frame[:mark])
        limits = self.limits
        if kind is None or kind == Sync.kind or len(frame) > self._max_one_frame_body or len(frame) > limits.max_items:
            return None  # a bounds walk, or an error to word: the general path's
        self._unpacker.begin((), "native", True, False)  # an array reference in a batch has no frame: refused
        try:
            events = self._batch_decoders[kind].decode(memoryview(frame)[mark + 1 :])
        except Exception:  # the general path says what is wrong
            return None
        if not events or len(events) > MAX_BATCH_EVENTS:
            return None
        lead = events[0][0]
        src, prefix = lead.src, incarnation(lead.id) + "-"
        depth_check = self._depth_checks.get(kind)
        for header, body in events:
            if header.v[0] != MAJOR or header.signed or header.src != src or not header.id.startswith(prefix):
                return None
            if depth_check is not None:
                try:
                    depth_check(body, limits.max_depth)
                except ProtocolError:
                    return None
        return [Message(kind, header, body) for header, body in events]

    def _read_batch(self, frames: Sequence[Buffer], mark: int, known: bool
                    ) -> tuple[str, bytes, list[tuple[Header, msgspec.Raw]]]:
        """Kind, kind bytes, and each event's header and raw body of the batch in ``frames`` (kind ending at
        ``mark``), checked whole: its kind and size; on a signed bus then its MAC, before a byte of the events is
        parsed (a forged batch costs one pass of SHA-256); its bounds and the event list (1 to
        ``MAX_BATCH_EVENTS`` ``[header, body]`` pairs); every header (the major first); one source, one
        incarnation (message ids ``<incarnation>-...``) and one MAC flag in all; the frames. Whatever is wrong
        refuses all of it, with a :class:`ProtocolError` as for one message (on a signed bus a batch of another
        major is refused ``signature``: events get no error reply, and no major sends batches but this one)."""
        first = _as_bytes(frames[0])
        if mark == 0:
            raise MalformedMessage("batch with an empty kind")
        raw_kind = first[:mark]
        kind = self._kind_of(raw_kind)
        if kind == Sync.kind:  # a probe carries the latest sequence number, none of its own
            raise MalformedMessage("sync probes travel alone, never in a batch", kind=kind)
        limits = self.limits
        if len(first) > self._max_one_frame_body:
            raise MessageTooLarge(f"batch is {len(first)} bytes, limit {self._max_one_frame_body}", kind=kind)
        if self._secret:
            if len(frames) != 2:
                raise BadSignature(f"batch of {shown(kind)} without its MAC frame on a signed bus", kind=kind)
            self._verify_mac(frames[:1], frames[1], "(a batch)", kind)
        payload = memoryview(first)[mark + 1 :]
        if len(payload) > limits.max_items:
            try:
                check_structure(bytes(payload), max_depth=limits.max_depth, max_items=limits.max_items)
            except ProtocolError as exc:
                exc.kind = kind
                raise
        try:
            events = self._batch_header_decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            raise MalformedMessage(f"batch: {exc}", kind=kind) from None
        except Exception as exc:  # RecursionError, MemoryError, ...: never the caller's
            raise MalformedMessage(f"batch: {type(exc).__name__}: {exc}", kind=kind) from None
        if not events or len(events) > MAX_BATCH_EVENTS:
            raise MalformedMessage(f"batch of {len(events)} events, 1 to {MAX_BATCH_EVENTS} expected", kind=kind)
        for header, _ in events:
            _check_version(header, kind)
        lead = events[0][0]
        if known and kind not in KINDS:
            raise UnknownKind(f"unknown message kind {shown(kind)} from {lead.src!r}", kind=kind)
        prefix = incarnation(lead.id) + "-"
        if any(header.src != lead.src or header.signed != lead.signed or not header.id.startswith(prefix)
               for header, _ in events):
            raise MalformedMessage(f"a batch from {lead.src!r} mixes sources, incarnations or MAC flags", kind=kind)
        _one_frame_and_mac(frames, lead, kind, "batch")
        return kind, raw_kind, events

    def _kind_of(self, raw_kind: bytes) -> str:
        kind = self._kind_names.get(raw_kind)
        if kind is None:
            try:
                kind = raw_kind.decode("ascii")
            except UnicodeDecodeError:
                raise MalformedMessage(f"kind frame is not ASCII: {shown(raw_kind)}") from None
        return kind

    def peek_id(self, frames: Sequence[Buffer]) -> str:
        """The message id in the header of ``frames`` (either form), "" when none can be read: what the error
        reply to a message that failed its checks answers, so its sender can match it."""
        first = _as_bytes(frames[0]) if frames else b""
        mark = first.find(ONE_FRAME_MARK, 0, MAX_KIND_BYTES)
        try:
            return self.read_header(_split_one_frame(first, mark)[1] if mark >= 0 else frames[1]).id
        except (IndexError, ProtocolError):
            return ""

    def event_header(self, frame: Buffer) -> Received | None:
        """:meth:`decode_header` of the common event, an unsigned one-frame message of a kind this node
        defines received as ``bytes`` by a codec that does not sign, in fewer steps; None for anything else,
        which :meth:`decode_header` then decodes or refuses with its own error. It checks what that path checks
        of such a message: kind, header length, header, version, no MAC announced and the body's size."""
        if self._signed or type(frame) is not bytes:
            return None
        mark = frame.find(ONE_FRAME_MARK, 0, MAX_KIND_BYTES)
        if mark <= 0:
            return None
        raw_kind = frame[:mark]
        kind = self._kind_names.get(raw_kind)
        start = mark + 5
        if kind is None or start > len(frame):
            return None
        header_end = start + _HEADER_LENGTH(frame, mark + 1)[0]
        if header_end > len(frame) or header_end - start > MAX_HEADER_BYTES:
            return None
        raw_header = frame[start:header_end]
        try:
            header = self._header_decoder.decode(raw_header)
        except Exception:  # the general path says what is wrong
            return None
        body = frame[header_end:]
        if header.v[0] != MAJOR or header.signed or len(body) > self._max_one_frame_body:
            return None
        return Received(kind, header, [raw_kind, raw_header, body])

    def read_header(self, frame: Buffer, *, kind: str | None = None) -> Header:
        """The header in ``frame``, or :class:`MalformedMessage` whatever is wrong with it."""
        if memoryview(frame).nbytes > MAX_HEADER_BYTES:
            raise MalformedMessage(f"header frame is {memoryview(frame).nbytes} bytes, limit {MAX_HEADER_BYTES}",
                                   kind=kind)
        try:
            return self._header_decoder.decode(frame)
        except msgspec.MsgspecError as exc:
            raise MalformedMessage(f"header frame: {exc}", kind=kind) from None
        except Exception as exc:  # RecursionError (deep unknown fields), MemoryError, ...: never the caller's
            raise MalformedMessage(f"header frame: {type(exc).__name__}: {exc}", kind=kind) from None

    def decode(
        self,
        frames: Sequence[Buffer],
        *,
        backend: ArrayBackend = "native",
        verify: bool = True,
        checked: Received | None = None,
    ) -> Message:
        """A validated :class:`Message`, or a :class:`ProtocolError` that says what was wrong.

        ``verify`` checks array checksums (always on when signing, for the frames that carry one);
        ``verify=False`` also accepts frames sent unhashed (see :class:`~.codec.Unhashed`). Array fields view
        ``frames``.
        ``checked``: the result of :meth:`decode_header` on these frames, when the caller already has it.
        """
        if checked is None:  # the common reply (one unsigned frame) read without decode_header's checks of forms
            checked = (self.event_header(frames[0]) if len(frames) == 1 else None) or self.decode_header(frames)
        return self.decode_body(checked, backend, verify)

    def decode_body(self, received: Received, backend: ArrayBackend = "native", verify: bool = True) -> Message:
        """The :class:`Message` of an envelope :meth:`decode_header` checked: the body's bounds, the array
        unpacker started on this message's buffer frames (none: no earlier message's frame can be referenced),
        the schema, the depth of ``Any``-typed fields and every buffer frame referenced once. :meth:`decode`
        with ``checked``, in fewer steps (what a subscriber calls per event); ``backend`` and ``verify`` as
        there (a signing codec verifies every checksum a frame carries whatever ``verify`` says).
        """
        kind = received.kind
        frames = received.frames
        buffers = frames[MIN_FRAMES:]
        raw_body = frames[2]
        limits = self.limits
        if (len(raw_body) if type(raw_body) is bytes else memoryview(raw_body).nbytes) > limits.max_items:
            try:
                check_structure(_as_bytes(raw_body), max_depth=limits.max_depth, max_items=limits.max_items)
            except ProtocolError as exc:
                exc.kind = kind
                raise
        self._unpacker.begin(buffers, backend, verify or self._signed, not verify)
        try:
            body = self._body_decoders[kind].decode(raw_body)
        except msgspec.ValidationError as exc:
            raise SchemaError(str(exc), kind=kind) from None
        except msgspec.DecodeError as exc:
            raise MalformedMessage(f"body frame: {exc}", kind=kind) from None
        except ProtocolError as exc:
            exc.kind = exc.kind or kind
            raise
        except RecursionError:  # unknown fields are skipped recursively, unchecked by the bounds above
            raise MalformedMessage("body frame nests deeper than the decoder can follow", kind=kind) from None
        except Exception as exc:  # whatever else a hostile body provokes is the peer's error, never ours
            raise MalformedMessage(f"body frame: {type(exc).__name__}: {exc}", kind=kind) from None
        depth_check = self._depth_checks.get(kind)
        if depth_check is not None:
            try:
                depth_check(body, limits.max_depth)
            except ProtocolError as exc:
                exc.kind = kind
                raise
        if buffers and self._unpacker.used != len(buffers):  # without buffers, a reference raised already
            raise MalformedMessage(
                f"{len(buffers)} buffer frames but the body describes {self._unpacker.used}", kind=kind
            )
        return Message(kind, received.header, body, buffers)

    def _check_mac(self, kind: str, header: Header, signed: Sequence[Buffer], mac: Buffer) -> None:
        if not header.signed:
            raise BadSignature(f"unsigned message from {header.src!r} on a signed bus", kind=kind)
        self._verify_mac(signed, mac, f"from {header.src!r}", kind)

    def _verify_mac(self, signed: Sequence[Buffer], mac: Buffer, sender: str, kind: str) -> None:
        size = memoryview(mac).nbytes  # before any copy: the last frame of a forged message may be of any size
        if size != MAC_BYTES:
            raise BadSignature(f"MAC frame of {size} bytes {sender}, expected {MAC_BYTES}", kind=kind)
        if not hmac.compare_digest(self._mac(signed), _as_bytes(mac)):
            raise BadSignature(f"bad MAC on message {sender}", kind=kind)


def _split_one_frame(frame: bytes, mark: int) -> list[bytes]:
    """``[kind, header, body]`` of a one-frame message whose kind ends at ``mark``, or
    :class:`MalformedMessage`. Slices copy, which for frames without arrays is cheaper than views."""
    if mark == 0:
        raise MalformedMessage("one-frame message with an empty kind")
    start = mark + 1 + 4
    if len(frame) < start:
        raise MalformedMessage(f"one-frame message of {len(frame)} bytes ends inside its header length")
    header_end = start + int.from_bytes(frame[mark + 1 : start], "little")
    if header_end > len(frame):
        raise MalformedMessage(
            f"one-frame message declares a {header_end - start}-byte header, {len(frame) - start} bytes follow"
        )
    return [frame[:mark], frame[start:header_end], frame[header_end:]]


def _one_frame_and_mac(frames: Sequence[Buffer], header: Header, kind: str, form: str) -> None:
    """A one-frame message or a batch is its frame and, when ``header`` says so, a MAC frame: nothing else."""
    if len(frames) != 1 + header.signed:
        raise MalformedMessage(f"{form} followed by {len(frames) - 1} frames ("
                               f"{'a MAC frame only' if header.signed else 'none'} expected)", kind=kind)


def _batch_mark(frames: Sequence[Buffer]) -> int:
    """Where the kind ends in a batch (one frame, perhaps with its MAC, whose kind ends in 0x01 with no 0x00
    before it), -1 for any other form. Reads the first ``MAX_KIND_BYTES`` bytes only."""
    if not frames or len(frames) > 2:
        return -1
    first = frames[0]
    head = first if type(first) is bytes else bytes(memoryview(first)[:MAX_KIND_BYTES])
    mark = head.find(BATCH_MARK, 0, MAX_KIND_BYTES)
    return -1 if mark < 0 or head.find(ONE_FRAME_MARK, 0, mark) >= 0 else mark


def _check_version(header: Header, kind: str) -> None:
    if header.v[0] != PROTOCOL_VERSION[0]:
        raise VersionMismatch(
            f"protocol {header.v[0]}.{header.v[1]} from {header.src!r}, this node speaks "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
            kind=kind,
        )


def negotiate(offered: Sequence[int]) -> int:
    """The protocol major to speak with a peer that offers ``offered`` (empty: the major of its header,
    already checked to be ours): the highest both speak, else :class:`VersionMismatch`."""
    if not offered:
        return PROTOCOL_VERSION[0]
    common = set(offered) & set(SPOKEN_MAJORS)
    if not common:
        raise VersionMismatch(
            f"peer speaks protocol majors {sorted(set(offered))}, this node {list(SPOKEN_MAJORS)}", kind="hello"
        )
    return max(common)


def _as_bytes(frame: Buffer) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(memoryview(frame))


def incarnation(msg_id: str) -> str:
    """The sender-process part of a message id: it changes when a node restarts, so a subscriber can tell a
    restarted source (its ``seq`` starts again at 1) from a replayed duplicate."""
    return msg_id.partition("-")[0]


def describe(message: Message) -> dict[str, Any]:
    """A JSON-ready view of a message (arrays shown by dtype and shape): what monitors print."""
    record: dict[str, Any] = {
        "type": message.kind,
        "src": message.header.src,
        "seq": message.header.seq,
        "ts": message.header.ts,
        "id": message.header.id,
    }
    record.update(msgspec.to_builtins(_with_defaults(message.body), enc_hook=_array_summary))
    return record


def _with_defaults(value: Any) -> Any:
    """Structs as dicts of *all* their fields: bodies omit defaults on the wire, a monitor shows them."""
    if isinstance(value, msgspec.Struct):
        return {name: _with_defaults(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, dict):
        return {key: _with_defaults(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_with_defaults(item) for item in value]
    return value


def _array_summary(obj: Any) -> str:
    shape = "x".join(str(d) for d in obj.shape)
    return f"<{str(obj.dtype).removeprefix('torch.')}[{shape}]>"
