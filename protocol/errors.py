"""One error family for everything that can be wrong with a message on the wire.

Every error carries a stable machine-readable ``code`` (sent back in ``error`` replies and used as a
metric label) and a message that says what was wrong and where (frame, field, sizes).
"""

from __future__ import annotations

SHOWN_CHARS = 48  # of a value a peer sent (a kind, a dtype, a field), what an error or a log line quotes
MAX_DETAIL_CHARS = 1024  # of an error's text, what is kept (a library's message may quote a value whole)


def shown(value: str | bytes, limit: int = SHOWN_CHARS) -> str:
    """``value``, something a peer sent, as error texts and logs quote it: its repr, of its first ``limit``
    characters only, with its whole length when it is cut. What a peer sends is bounded by the body limit,
    not by what an error should carry: quoting it whole would make every error reply and log line as large
    as the request that provoked it."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} {'bytes' if isinstance(value, bytes) else 'characters'})"


class ProtocolError(Exception):
    """Base of all wire errors. ``code`` is stable and short; ``str(err)`` is for humans. The text is kept to
    ``MAX_DETAIL_CHARS`` (a decoder's message may quote a value whole); the kind, which may be one a peer
    made up, shows as :func:`shown` does unless it is short and printable."""

    code = "protocol"

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        if len(message) > MAX_DETAIL_CHARS:
            message = f"{message[:MAX_DETAIL_CHARS]}... ({len(message)} characters)"
        self.kind = kind
        self.detail = message
        super().__init__(message)

    def __str__(self) -> str:
        # Built at render time: the decoder learns the kind after some errors are raised.
        kind = self.kind
        if not kind:
            return self.detail
        return f"{kind if len(kind) <= SHOWN_CHARS and kind.isprintable() else shown(kind)}: {self.detail}"


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
