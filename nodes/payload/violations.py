"""Ownership violations as the stream reports them: one ``violation`` event per refused request and (action,
holder, owner), however many blob ids the request named.

A store refuses ids one by one (:class:`~.keeper.Keeper` returns a :class:`Violation` per id: its counters and
the request's reply name every id), but a request naming fifty thousand deleted ids must not become as many
events, each crossing the broker, taking a place in the replay ring and reaching every subscriber. Pure: no
state, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ...protocol.messages import VIOLATION_SAMPLE, Violation


def summarize(violations: Iterable[Violation]) -> list[Violation]:
    """One violation per (action, holder, owner) of ``violations``, in the order each group first appears: its
    ``count`` the sum of the group's counts, ``blob_id`` and ``detail`` those of its first violation, ``sample``
    its first ``VIOLATION_SAMPLE`` ids (a violation without a sample stands for its ``blob_id``). The counts'
    sum is kept, and summarizing a summary changes nothing."""
    groups: dict[tuple[str, str, str], tuple[Violation, int, list[str]]] = {}
    for violation in violations:
        key = (violation.action, violation.holder, violation.owner)
        first, count, sample = groups.get(key) or (violation, 0, [])
        if (room := VIOLATION_SAMPLE - len(sample)) > 0:
            sample.extend((violation.sample or [violation.blob_id])[:room])
        groups[key] = (first, count + violation.count, sample)
    return [msgspec.structs.replace(first, count=count, sample=sample) for first, count, sample in groups.values()]
