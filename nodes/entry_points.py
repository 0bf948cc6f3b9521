"""How a config names user code: ``"package.module:attribute"`` (the env task, the policy, the train step).

One rule for every node that loads user code (env server, orchestrator, rollout worker, trainer rank), so its exit
status tells its supervisor the same whatever the role: an entry point the config names wrongly is a
:class:`~.config.ConfigError` (exit status 2, final: a restart would read the same config and fail the same way);
an exception the user's code raises while it is imported or built is :class:`UserCodeFailed` (a crash, exit
status 1: restarted within the restart budget, as what failed may clear by itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .config import ConfigError


class UserCodeFailed(RuntimeError):
    """User code an entry point names raised while it was imported or built: a crash, not a refused config. It
    may have failed for a while only (a data file it reads still being written, a service it asks not up yet),
    so a node lets it end the process with status 1 and the traceback (the user's own, chained), which its
    supervisor restarts. Not a ``ValueError``: a node that takes a ``ValueError`` for a config it cannot use
    never takes this for one."""


def load_entry_point(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names.

    Raises:
        ConfigError: (a ``ValueError``; final, ``halting.CONFIG_STATUS``) ``spec`` is malformed, its module cannot
            be imported (``ImportError``: it does not exist, or a module it imports does not, or lacks what it
            imports from it: a missing or mismatched dependency never clears by itself, so it is the config's
            to change as a missing module is), the module has no such attribute, or it is not callable.
        UserCodeFailed: importing the module raised anything else (its top-level code failed: restartable).
            A ``SyntaxError`` counts so too: a module file being written may be read half-way.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"entry point {spec!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"entry point {spec!r} cannot be loaded: {exc}") from None
    except Exception as exc:  # the module's own code failed: whatever it raised, it is no config error
        raise UserCodeFailed(f"entry point {spec!r}: importing {module_name} raised {exc!r}") from exc
    try:
        target = getattr(module, attribute)
    except AttributeError as exc:
        raise ConfigError(f"entry point {spec!r} cannot be loaded: {exc}") from None
    if not callable(target):
        raise ConfigError(f"entry point {spec!r} is not callable")
    return target
