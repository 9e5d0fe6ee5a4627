"""Strategy registry: ``--strategy NAME`` → the class in ``dtrain_magic/strategies/NAME.py``.

Adding a strategy is one new module with a `Strategy` subclass and one line here. Modules are imported
lazily so ``import dtrain_magic`` never pays for DeepSpeed.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import Strategy

_REGISTRY: dict[str, str] = {
    "ddp": "dtrain_magic.strategies.ddp:DDPStrategy",
    "fsdp": "dtrain_magic.strategies.fsdp:FSDPStrategy",
    "deepspeed": "dtrain_magic.strategies.deepspeed:DeepSpeedStrategy",
}


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_strategy(name: str) -> type[Strategy]:
    """The `Strategy` class for ``name``; a clear error when unknown or not implemented yet."""
    if name not in _REGISTRY:
        raise ConfigError("--strategy", f"got {name!r}; allowed: {', '.join(_REGISTRY)}")
    module_name, _, class_name = _REGISTRY[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise ConfigError("--strategy", f"{name} is not yet supported in this version of dtrain_magic") from None
        raise
    return getattr(module, class_name)


__all__ = ["Strategy", "available", "get_strategy"]
