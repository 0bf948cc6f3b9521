"""Body nesting bounds: the per-kind depth checks refuse exactly what a walk over the whole body refuses."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from refbus.protocol.bounds import check_depth, depth_checks
from refbus.protocol.envelope import Limits, WireCodec
from refbus.protocol.errors import MalformedMessage
from refbus.protocol.messages import KINDS, Blobs, FetchedBlob

MAX_DEPTH = 8


class Inner(msgspec.Struct):
    value: Any
    tags: list[str] = []


class Outer(msgspec.Struct):
    name: str
    maybe: Inner | None = None
    by_key: dict[str, Inner] = {}
    either: int | list[Any] = 0
    plain: list[int] = []


def nested(levels: int) -> Any:
    """A list nested ``levels`` deep (1: a flat list)."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def refused(check: Any, body: Any) -> bool:
    try:
        check(body)
    except MalformedMessage as exc:
        assert "limits.max_depth" in str(exc)
        return True
    return False


def bodies() -> list[Any]:
    out: list[Any] = []
    for levels in range(MAX_DEPTH + 2):
        out += [
            Outer("a", maybe=Inner(nested(levels))),
            Outer("b", by_key={"k": Inner(nested(levels)), "j": Inner(1)}),
            Outer("c", either=nested(levels) if levels else 3),
            Outer("d", maybe=None, plain=[1, 2]),
            Blobs(blobs=[FetchedBlob(blob_id="x", arrays={"routed_experts": np.zeros(3, np.uint8)}),
                         FetchedBlob(blob_id="y", arrays={"routed_experts": nested(levels)})]),
        ]
    return out


@pytest.mark.parametrize("body", bodies(), ids=lambda body: f"{type(body).__name__}")
def test_the_schema_guided_check_refuses_what_the_whole_walk_refuses(body: Any) -> None:
    checks = depth_checks({"outer": Outer, "blobs": Blobs})
    kind = "blobs" if isinstance(body, Blobs) else "outer"
    whole = refused(lambda b: check_depth(b, max_depth=MAX_DEPTH), body)
    assert refused(lambda b: checks[kind](b, MAX_DEPTH), body) == whole


def test_only_kinds_with_open_fields_get_a_check() -> None:
    checks = depth_checks(KINDS)
    assert "blobs" in checks
    assert "heartbeat" not in checks  # typed all the way down: the decoder bounds it
    assert depth_checks({"plain": msgspec.defstruct("Plain", [("n", int), ("xs", list[int])])}) == {}


def test_a_blobs_reply_nesting_too_deep_in_an_array_slot_is_malformed() -> None:
    limits = Limits(max_depth=MAX_DEPTH)
    sender, receiver = WireCodec("store", limits=limits), WireCodec("trainer", limits=limits)
    deep = Blobs(blobs=[FetchedBlob(blob_id="x", arrays={"routed_experts": nested(MAX_DEPTH)})])
    with pytest.raises(MalformedMessage, match=r"limits\.max_depth"):
        receiver.decode(sender.encode(deep))
    # At the limit it decodes: the body, its list, a blob and its map are levels 1-4, the slot level 5.
    fits = Blobs(blobs=[FetchedBlob(blob_id="x", arrays={"routed_experts": nested(MAX_DEPTH - 5)})])
    assert receiver.decode(sender.encode(fits)).body == fits
