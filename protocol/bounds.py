"""Nesting and size bounds of message bodies, so that no peer makes a node recurse or allocate without end.

A schema bounds the depth of typed fields, but a field typed ``Any`` (an episode's ``info``, an array slot)
takes whatever a peer sends: 100,000 nested lists make the decoder recurse past Python's limit (it raises
``RecursionError``, which the codec turns into a ``malformed`` error), a few hundred levels decode but
break whatever walks them later, and 16 MiB of empty maps become ~1 GiB of Python objects.

* :func:`check_structure` walks encoded bytes without recursion or allocation: too many values are refused
  before the decoder builds them. It costs ~0.5 µs per value, so it runs on large bodies only (a body
  cannot hold more values than it has bytes).
* :func:`check_depth` walks a decoded value without recursion; scalar lists are passed over at C speed
  (their element types are collected with ``map``). :func:`depth_checks` applies it, per kind, only to
  the values its schema leaves open (typed ``Any``), so typed parts of a body cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .errors import MalformedMessage

# First byte -> how the value continues: (fixed payload bytes, bytes of a length prefix, container code).
# container code: 0 scalar (skip fixed + the length the prefix gives), 1 array, 2 map. ext values carry a
# type byte after their length, counted in "fixed".
_ARRAY, _MAP = 1, 2
_LAYOUT: list[tuple[int, int, int] | None] = [None] * 256
for _b in range(0x00, 0x80):
    _LAYOUT[_b] = (0, 0, 0)  # positive fixint
for _b in range(0xE0, 0x100):
    _LAYOUT[_b] = (0, 0, 0)  # negative fixint
for _b in range(0xA0, 0xC0):
    _LAYOUT[_b] = (_b & 0x1F, 0, 0)  # fixstr
for _b in range(0x80, 0x90):
    _LAYOUT[_b] = (_b & 0x0F, 0, _MAP)  # fixmap: the count lives in the byte
for _b in range(0x90, 0xA0):
    _LAYOUT[_b] = (_b & 0x0F, 0, _ARRAY)  # fixarray
_LAYOUT[0xC0] = _LAYOUT[0xC2] = _LAYOUT[0xC3] = (0, 0, 0)  # nil, false, true
for _b, _layout in {
    0xC4: (0, 1, 0), 0xC5: (0, 2, 0), 0xC6: (0, 4, 0),  # bin 8/16/32
    0xC7: (1, 1, 0), 0xC8: (1, 2, 0), 0xC9: (1, 4, 0),  # ext 8/16/32 (+ type byte)
    0xCA: (4, 0, 0), 0xCB: (8, 0, 0),  # float 32/64
    0xCC: (1, 0, 0), 0xCD: (2, 0, 0), 0xCE: (4, 0, 0), 0xCF: (8, 0, 0),  # uint 8..64
    0xD0: (1, 0, 0), 0xD1: (2, 0, 0), 0xD2: (4, 0, 0), 0xD3: (8, 0, 0),  # int 8..64
    0xD4: (2, 0, 0), 0xD5: (3, 0, 0), 0xD6: (5, 0, 0), 0xD7: (9, 0, 0), 0xD8: (17, 0, 0),  # fixext
    0xD9: (0, 1, 0), 0xDA: (0, 2, 0), 0xDB: (0, 4, 0),  # str 8/16/32
    0xDC: (0, 2, _ARRAY), 0xDD: (0, 4, _ARRAY),  # array 16/32
    0xDE: (0, 2, _MAP), 0xDF: (0, 4, _MAP),  # map 16/32
}.items():
    _LAYOUT[_b] = _layout


def check_structure(body: bytes, *, max_depth: int, max_items: int) -> None:
    """Raise :class:`MalformedMessage` if ``body`` nests lists and maps deeper than ``max_depth`` or holds
    more than ``max_items`` list elements and map entries in all. Truncated or invalid bytes are left to the
    decoder, which says what is wrong with them; this check only refuses what the decoder should not try."""
    end = len(body)
    pos = 0
    items = 0
    pending = [1]  # values still to read at each open level; the bottom one is the body itself
    while pending:
        if not pending[-1]:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= end:
            return
        layout = _LAYOUT[body[pos]]
        if layout is None:
            return
        fixed, prefix, container = layout
        pos += 1
        length = int.from_bytes(body[pos : pos + prefix], "big") if prefix else 0
        pos += prefix
        if not container:
            pos += fixed + length
            continue
        count = (length if prefix else fixed) * (2 if container == _MAP else 1)
        items += count
        if items > max_items:
            raise MalformedMessage(f"body holds more than {max_items} list elements and map entries (limits.max_items)")
        if len(pending) > max_depth:
            raise MalformedMessage(f"body nests lists and maps deeper than {max_depth} (limits.max_depth)")
        pending.append(count)


_CONTAINERS = (list, tuple, dict, msgspec.Struct)


def check_depth(value: Any, *, max_depth: int) -> None:
    """Raise :class:`MalformedMessage` if lists, maps and Structs nest deeper than ``max_depth`` in
    ``value`` (the body itself is level 1). Arrays and other values are leaves."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise MalformedMessage(f"body nests lists and maps deeper than {max_depth} (limits.max_depth)")
        if isinstance(value, msgspec.Struct):
            children: Any = [getattr(value, name) for name in value.__struct_fields__]
        elif isinstance(value, dict):
            children = [*value.keys(), *value.values()] if any(map(_is_container, value)) else value.values()
        else:
            children = value
        if any(issubclass(t, _CONTAINERS) for t in set(map(type, children))):
            stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))


def _is_container(value: Any) -> bool:
    return isinstance(value, _CONTAINERS)


DepthCheck = Callable[[Any, int], None]  # (decoded body, max_depth): raises MalformedMessage


def depth_checks(kinds: dict[str, type[Any]]) -> dict[str, DepthCheck]:
    """Per kind whose schema reaches a field typed ``Any`` (its bodies can nest without bound), a check
    equivalent to :func:`check_depth` on the whole body that walks only the values the schema leaves open:
    typed parts are bounded by the decoder, so a ``blobs`` reply costs one pass over its array slots instead
    of a visit to every struct, list and map of it."""
    checks = {}
    for kind, cls in kinds.items():
        walk = _open_walker(msgspec.inspect.type_info(cls), set())
        if walk is not None:
            checks[kind] = _depth_check(walk)
    return checks


# A walker visits a value of its type at a depth, calling ``visit(value, depth)`` on every value the schema
# leaves open (typed ``Any``, or too intricate to follow: recursive types, unions of containers).
Walker = Callable[[Any, int, Callable[[Any, int], None]], None]


def _depth_check(walk: Walker) -> DepthCheck:
    def check(body: Any, max_depth: int) -> None:
        def visit(value: Any, depth: int) -> None:
            if depth > max_depth or isinstance(value, _CONTAINERS):
                check_depth(value, max_depth=max_depth - depth + 1)

        walk(body, 1, visit)

    return check


def _open_walker(info: msgspec.inspect.Type, seen: set[int]) -> Walker | None:
    """A walker for values of ``info``, or None when no value of it is open."""
    if not _reaches_any(info, set()):
        return None
    if isinstance(info, msgspec.inspect.AnyType) or id(info) in seen:
        return _open
    seen = seen | {id(info)}
    if isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType | msgspec.inspect.TypedDictType):
        fields = [(f.name, w) for f in info.fields if (w := _open_walker(f.type, seen)) is not None]
        getter = (lambda value, name: value[name]) if isinstance(info, msgspec.inspect.TypedDictType) else getattr

        def struct(value: Any, depth: int, visit: Callable[[Any, int], None]) -> None:
            for name, walk in fields:
                walk(getter(value, name), depth + 1, visit)

        return struct
    if isinstance(info, msgspec.inspect.UnionType):
        typed = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(typed) != 1:
            return _open
        inner = _open_walker(typed[0], seen)
        assert inner is not None  # the union reaches Any through its one typed member

        def optional(value: Any, depth: int, visit: Callable[[Any, int], None]) -> None:
            if value is not None:
                inner(value, depth, visit)

        return optional
    if isinstance(info, msgspec.inspect.DictType):
        keys, values = _open_walker(info.key_type, seen), _open_walker(info.value_type, seen)

        def mapping(value: Any, depth: int, visit: Callable[[Any, int], None]) -> None:
            for key, item in value.items():
                if keys is not None:
                    keys(key, depth + 1, visit)
                if values is not None:
                    values(item, depth + 1, visit)

        return mapping
    if isinstance(info, msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.FrozenSetType |
                  msgspec.inspect.VarTupleType):
        items = _open_walker(info.item_type, seen)
        assert items is not None

        def sequence(value: Any, depth: int, visit: Callable[[Any, int], None]) -> None:
            for item in value:
                items(item, depth + 1, visit)

        return sequence
    return _open  # fixed tuples and anything else: checked whole


def _open(value: Any, depth: int, visit: Callable[[Any, int], None]) -> None:
    visit(value, depth)


def _reaches_any(info: msgspec.inspect.Type, seen: set[int]) -> bool:
    if isinstance(info, msgspec.inspect.AnyType):
        return True
    if id(info) in seen:
        return False
    seen.add(id(info))
    if isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType | msgspec.inspect.TypedDictType):
        return any(_reaches_any(f.type, seen) for f in info.fields)
    if isinstance(info, msgspec.inspect.UnionType):
        return any(_reaches_any(t, seen) for t in info.types)
    if isinstance(info, msgspec.inspect.DictType):
        return _reaches_any(info.key_type, seen) or _reaches_any(info.value_type, seen)
    if isinstance(info, msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.FrozenSetType |
                  msgspec.inspect.VarTupleType):
        return _reaches_any(info.item_type, seen)
    if isinstance(info, msgspec.inspect.TupleType):
        return any(_reaches_any(t, seen) for t in info.item_types)
    return False
