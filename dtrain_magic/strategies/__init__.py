"""Strategy registry: ``--strategy NAME`` → the class in ``dtrain_magic/strategies/NAME.py``.

Adding a strategy is one new module with a `Strategy` subclass and one line here. Modules are imported
lazily so ``import dtrain_magic`` never pays for DeepSpeed.
"""

from __future__ import annotations

from ..registry import load_class
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
    return load_class(_REGISTRY, name, "--strategy")


__all__ = ["Strategy", "available", "get_strategy"]
