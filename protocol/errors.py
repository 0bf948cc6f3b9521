"""One error family for everything that can be wrong with a message on the wire.

Every error carries a stable machine-readable ``code`` (sent back in ``error`` replies and used as a
metric label) and a message that says what was wrong and where (frame, field, sizes).
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of all wire errors. ``code`` is stable and short; ``str(err)`` is for humans."""

    code = "protocol"

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        self.kind = kind
        self.detail = message
        super().__init__(message)

    def __str__(self) -> str:
        # Built at render time: the decoder learns the kind after some errors are raised.
        return f"{self.kind}: {self.detail}" if self.kind else self.detail


class MalformedMessage(ProtocolError):
    """Frames that cannot be an envelope: wrong frame count, undecodable header or body."""

    code = "malformed"


class UnknownKind(ProtocolError):
    """A kind this protocol version does not define."""

    code = "unknown-kind"


class SchemaError(ProtocolError):
    """A body that does not match its kind's schema: missing field, wrong type, bad value."""

    code = "schema"


class VersionMismatch(ProtocolError):
    """A header from an incompatible protocol major version."""

    code = "version"


class MessageTooLarge(ProtocolError):
    """A body or a whole message over the configured limit."""

    code = "too-large"


class BadSignature(ProtocolError):
    """A missing or wrong MAC on a signed deployment."""

    code = "signature"


class ArrayError(ProtocolError):
    """An array descriptor that does not match its frame: index, size, dtype or checksum."""

    code = "array"


class ChecksumMismatch(ArrayError):
    """Array bytes that do not hash to the checksum their descriptor carries."""

    code = "checksum"


class ReplayedMessage(ProtocolError):
    """A message its receiver has already taken from that source incarnation: a replay, not a retry."""

    code = "replay"
