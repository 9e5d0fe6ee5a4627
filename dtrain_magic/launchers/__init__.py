"""Launcher registry: ``--backend NAME`` → the class in ``dtrain_magic/launchers/NAME.py``.

Adding a backend is one new module with a `Launcher` subclass and one line here; modules are imported
lazily so ``import dtrain_magic`` never pays for pyspark or ray.
"""

from __future__ import annotations

from ..registry import load_class
from .base import Failure, Launcher, LaunchState, RunningJob

_REGISTRY: dict[str, str] = {
    "local": "dtrain_magic.launchers.local:LocalLauncher",
    "spark": "dtrain_magic.launchers.spark:SparkLauncher",
    "ray": "dtrain_magic.launchers.ray:RayLauncher",
}


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_launcher(name: str) -> Launcher:
    """A `Launcher` instance for ``name`` (cached per class so sessions and pools are reused)."""
    cls = load_class(_REGISTRY, name, "--backend", extra_allowed=("auto",))
    if name not in _INSTANCES or type(_INSTANCES[name]) is not cls:
        _INSTANCES[name] = cls()
    return _INSTANCES[name]


_INSTANCES: dict[str, Launcher] = {}

__all__ = ["Failure", "Launcher", "LaunchState", "RunningJob", "available", "get_launcher"]
