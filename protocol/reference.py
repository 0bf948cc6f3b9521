"""The body reference of docs/PROTOCOL.md, generated from the Structs themselves.

Each message kind and shared structure becomes a table (field, type, default, meaning): types as the source
spells them (aliases such as ``Name`` are explained once in the legend), defaults from the Struct, meanings
from the comment on the field's line, descriptions from the docstring. A test checks that the document holds
exactly this text, so the reference cannot drift from the code: after changing a Struct, regenerate it with
``python -c 'from refbus.protocol.reference import protocol_tables; print(protocol_tables(), end="")'``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable

import msgspec

from . import messages, messages_ps
from .envelope import Header
from .messages import KINDS, Body

LEGEND = (
    ("Name", "str of 1 to 256 characters"),
    ("Id", "str of at most 256 characters"),
    ("NonNegative", "int ≥ 0"),
    ("Major", "int 0 to 65535: a protocol major version"),
    ("Positive", "int ≥ 1"),
    ("Key", "str of at most 256 characters"),
    ("Text", "str of at most 4,096 characters"),
    ("Entries", "map of at most 64 `Key` → `Text` entries"),
    ("Readings", "map of at most 64 `Key` → float entries"),
    ("Seconds", "float ≥ 0"),
    ("Process", "array `[Key, NonNegative, float ≥ 0]`: a node's process (host, pid, wall-clock start time)"),
    ("Array", "an array: a msgpack ext value (code 1 numpy, 2 torch) holding its descriptor; its bytes travel "
              "in a buffer frame (see **Arrays**)"),
    ("Any", "any msgpack value (arrays inside it travel as frames too); depth bounded by `limits.max_depth`"),
)

_SHARED = (Header, messages.NodeInfo, messages.BlobRef, messages.SampleSlice, messages.MicroBatchRefs,
           messages.ReplayedEvent, messages.FetchedBlob, messages.HeldEpisode)
_PS_SHARED = (messages_ps.TensorSpec, messages_ps.ShardTensor, messages_ps.Location, messages_ps.ManifestEntry,
              messages_ps.WorkerInfo, messages_ps.Manifest, messages_ps.ByteRange, messages_ps.BatchEntry,
              messages_ps.InventoryBuffer)
_COMMENT = re.compile(r"^\s+(\w+)\s*:.*?\s#\s(.*)$")
_COMMENT_LINE = re.compile(r"^\s+#\s?(.*)$")
_FIELD = re.compile(r"^\s+(\w+)\s*:")


def protocol_tables() -> str:
    """The generated part of docs/PROTOCOL.md: legend, shared structures, every kind's body (core, then the
    parameter server's)."""
    lines = ["| type | meaning |", "| --- | --- |"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in LEGEND]
    lines += ["", "### Shared structures", ""]
    lines += _structs(_SHARED, heading=lambda cls: f"#### `{cls.__name__}`")
    lines += ["### Kinds", ""]
    lines += _structs(_kinds(messages.__name__), heading=lambda cls: f"#### `{cls.kind}` ({cls.__name__})")
    lines += ["### Parameter-server structures", ""]
    lines += _structs(_PS_SHARED, heading=lambda cls: f"#### `{cls.__name__}`")
    lines += ["### Parameter-server kinds", ""]
    lines += _structs(_kinds(messages_ps.__name__), heading=lambda cls: f"#### `{cls.kind}` ({cls.__name__})")
    return "\n".join(lines).rstrip("\n") + "\n"


def _kinds(module: str) -> list[type[Body]]:
    return [cls for cls in KINDS.values() if cls.__module__ == module]


def _structs(classes: Iterable[type[msgspec.Struct]], heading: Callable[[type], str]) -> list[str]:
    lines: list[str] = []
    for cls in classes:
        lines += [heading(cls), ""]
        if doc := cls.__dict__.get("__doc__"):  # its own, never msgspec.Struct's
            lines += [" ".join(doc.split()), ""]
        config = cls.__struct_config__
        if config.array_like:
            lines += ["Encoded as a msgpack **array**, fields in this order.", ""]
        fields = msgspec.structs.fields(cls)
        if not fields:
            lines += ["Empty body: `{}`.", ""]
            continue
        comments = _field_comments(cls)
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for field in fields:
            annotation = _type_text(cls.__annotations__[field.name])
            lines.append(f"| `{field.encode_name}` | `{annotation}` | {_default(field)} | "
                         f"{comments.get(field.name, '')} |")
        lines.append("")
    return lines


def _field_comments(cls: type) -> dict[str, str]:
    """What each field means: the comment on its line of the class body, else the comment lines just above it."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        if match := _COMMENT_LINE.match(line):
            above.append(match.group(1))
            continue
        if match := _COMMENT.match(line):
            comments[match.group(1)] = match.group(2).replace("|", "\\|")
        elif (match := _FIELD.match(line)) and above:
            comments[match.group(1)] = " ".join(above).replace("|", "\\|")
        above = []
    return comments


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    return f"`{msgspec.json.encode(value).decode()}`"


def _type_text(annotation: str) -> str:
    """The source annotation, with each ``Annotated[T, msgspec.Meta(...)]`` written ``T (...)``."""
    while (start := annotation.find("Annotated[")) >= 0:
        depth, comma, end = 0, -1, -1
        for pos in range(start + len("Annotated["), len(annotation)):
            char = annotation[pos]
            if char in "[(":
                depth += 1
            elif char in "])":
                if depth == 0:
                    end = pos
                    break
                depth -= 1
            elif char == "," and depth == 0 and comma < 0:
                comma = pos
        inner = annotation[start + len("Annotated["):comma]
        meta = annotation[comma + 1:end].strip().removeprefix("msgspec.Meta(").removesuffix(")")
        annotation = f"{annotation[:start]}{inner} ({meta}){annotation[end + 1:]}"
    return annotation.replace("|", "\\|")
