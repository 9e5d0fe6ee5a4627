"""Strategies: ``--strategy NAME`` → its `Strategy` class, registered in `dtrain_magic.registry.STRATEGIES`.

Adding a strategy is one new module with a `Strategy` subclass and one line in the registry. Modules are
imported lazily so ``import dtrain_magic`` never pays for DeepSpeed.
"""

from __future__ import annotations

from ..registry import STRATEGIES
from .base import Strategy


def get_strategy(name: str) -> type[Strategy]:
    """The `Strategy` class for ``name``; a clear error when unknown or not implemented yet."""
    return STRATEGIES.load(name)


__all__ = ["Strategy", "get_strategy"]
