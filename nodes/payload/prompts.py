"""Where a dispatching orchestrator's prompts come from, and how the source hears how they went.

``orchestrator.prompt`` names the prompt source as an entry point, in one of two forms:

* a **function** ``f(rng) -> token ids`` (``rng`` a ``numpy.random.Generator``): a fixed task; it never
  hears the rewards;
* a **class** with a ``make_prompt(rng) -> token ids`` method, built once per orchestrator process with no
  argument. It may also define ``observe(prompt, rewards)``, called once per completed training group with
  the group's prompt and its episodes' rewards (in arrival order; eval groups and abandoned groups are not
  observed), and ``status() -> {name: number}``, what it wants shown: the orchestrator reports it in its
  heartbeat status (keys prefixed ``task_``, seen in the registry and on `refbus up`'s progress lines) and in
  the metric ``refbus_orchestrator_task`` (a metrics scrape may call it from another thread: let it read
plain values, not walk state ``observe`` changes). A curriculum is such a class: it raises the difficulty of the
  prompts it makes from the rewards it observes.

Both run on the orchestrator's loop thread, one call at a time; a source's state lives in the orchestrator
process, so a restarted orchestrator starts a new one (a curriculum climbs again, as fast as the policy
passes its levels).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError
from ..entry_points import UserCodeFailed, load_entry_point

MakePrompt = Callable[[np.random.Generator], Sequence[int]]
Observe = Callable[[Sequence[int], Sequence[float]], None]
Status = Callable[[], Mapping[str, float]]

TASK_PREFIX = "task_"  # the orchestrator's heartbeat status keys that carry a source's status()


def _hears_nothing(prompt: Sequence[int], rewards: Sequence[float]) -> None:
    """The feedback of a source that does not learn from it."""


@dataclass(frozen=True)
class PromptSource:
    """A prompt source in one shape, whichever form was named (see the module doc)."""

    make_prompt: MakePrompt
    observe: Observe = _hears_nothing
    status: Status = field(default=dict)

    def numbers(self) -> dict[str, float]:
        """``status()``, its numeric entries only (bools and other values are left out), as floats."""
        return {str(name): float(value) for name, value in self.status().items()
                if isinstance(value, int | float) and not isinstance(value, bool)}


def as_prompt_source(target: object) -> PromptSource:
    """``target`` as a :class:`PromptSource`: a source as is, a class built once (its ``observe`` and
    ``status`` used where it has them), any other callable as a fixed ``make_prompt``.

    Raises:
        ConfigError: a class that cannot be built with no argument or has no callable ``make_prompt``, or
            something that is not callable (final: the config names what cannot work).
        UserCodeFailed: a class whose building raised (user code: it may have failed for a while only, so a
            node exits as a crash, restartable).
    """
    if isinstance(target, PromptSource):
        return target
    if inspect.isclass(target):
        try:
            inspect.signature(target).bind()
        except TypeError as exc:
            raise ConfigError(f"prompt source {target.__name__} cannot be built with no argument: {exc}") from None
        try:
            instance = target()
        except Exception as exc:  # user code: whatever it raises, none of it is a config error
            raise UserCodeFailed(f"prompt source {target.__name__}() could not be built: {exc!r}") from exc
        make_prompt = getattr(instance, "make_prompt", None)
        if not callable(make_prompt):
            raise ConfigError(f"prompt source {target.__name__} has no make_prompt(rng) method")
        return PromptSource(make_prompt, getattr(instance, "observe", _hears_nothing),
                            getattr(instance, "status", dict))
    if not callable(target):
        raise ConfigError(f"prompt source {target!r} is neither a function nor a class")
    return PromptSource(target)  # type: ignore[arg-type]


def load_prompt_source(spec: str) -> PromptSource:
    """The prompt source an ``orchestrator.prompt`` entry point names: :class:`~..config.ConfigError` when the
    config names none, :class:`~..entry_points.UserCodeFailed` when the user's code raised (see
    :func:`as_prompt_source`)."""
    return as_prompt_source(load_entry_point(spec))
