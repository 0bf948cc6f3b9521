"""What the values of an ``episode-finished`` record must be to be trained: the rules the orchestrator checks
every record by (:meth:`~.orchestrator_core.OrchestratorCore._parse`), which the env server's episode runner
(:mod:`.episodes`) also checks what user code returned by, before it keeps anything, so that a run answered ok
never keeps an episode the orchestrator then deletes ``malformed``.

Imports numpy only: env servers import it, and they must never pull in torch.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)


class MalformedEpisode(ValueError):
    """An ``episode-finished`` record that cannot be trained as it came (the message names what is wrong)."""


def reward_of(value: object) -> float:
    """``value`` as a reward: a real number (an int or a float, numpy's included, never a bool) that is finite.

    Raises:
        MalformedEpisode: naming ``value``'s type when it is no real number (its ``repr`` is never asked for: a
            score function's object may raise there too), or its value when it is not finite.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise MalformedEpisode(f"type {type(value).__name__}, not a real number (an int or a float, never a bool)")
    reward = float(value)
    if not math.isfinite(reward):  # a NaN would make its whole group's advantages NaN, and the weights
        raise MalformedEpisode(f"{reward}, not a finite number")
    return reward


def column(where: str, values: object, kinds: str) -> np.ndarray:
    """``values`` as a 1-D array of one of numpy's dtype ``kinds`` (empty: any). Raises :class:`MalformedEpisode`
    naming ``where``."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise MalformedEpisode(f"{where}: {error}") from None
    if array.ndim != 1 or (array.dtype.kind not in kinds and array.size):
        raise MalformedEpisode(f"{where}: expected a list of numbers, got {array.dtype} of shape {array.shape}")
    return array


def token_ids(where: str, values: object) -> np.ndarray:
    """``values`` as a sample's token ids (int64): at least one, each from 0 to 2**63 - 1, since no vocabulary has
    a negative id (nor one int64 cannot hold), and every trainer rank's step would fail on it. Raises
    :class:`MalformedEpisode` naming ``where``."""
    ids = column(where, values, "iu")
    if not len(ids):
        raise MalformedEpisode(f"{where}: expected at least one token id")
    if ids.min() < 0 or ids.max() > INT64_MAX:
        raise MalformedEpisode(f"{where}: token ids run from 0 to 2**63 - 1, got {ids.min()} to {ids.max()}")
    return ids.astype(np.int64, copy=False)
