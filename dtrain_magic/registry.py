"""Lazy name → class registries for ``--backend`` and ``--strategy`` (one module per entry)."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigError


def load_class(registry: dict[str, str], name: str, flag: str, extra_allowed: tuple[str, ...] = ()) -> Any:
    """Import ``registry[name]`` ("package.module:Class"); unknown or missing entries are ConfigErrors."""
    if name not in registry:
        allowed = ", ".join((*extra_allowed, *registry))
        raise ConfigError(flag, f"got {name!r}; allowed: {allowed}")
    module_name, _, class_name = registry[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise ConfigError(flag, f"{name} is not yet supported in this version of dtrain_magic") from None
        raise
    return getattr(module, class_name)
