"""How a config names user code: ``"package.module:attribute"`` (the env task, the policy, the train step)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .config import ConfigError


def load_entry_point(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names; a clear :class:`~.config.ConfigError` (a ``ValueError``) when it is malformed,
    missing or not callable: the config names what cannot work, so a node exits with the final status 2
    (``halting.CONFIG_STATUS``), never restarted to fail the same way again."""
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise ConfigError(f"entry point {spec!r} must look like 'package.module:attribute'")
    try:
        target = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"entry point {spec!r} cannot be loaded: {exc}") from None
    if not callable(target):
        raise ConfigError(f"entry point {spec!r} is not callable")
    return target
