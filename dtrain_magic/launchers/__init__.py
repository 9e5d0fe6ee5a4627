"""Launcher registry: ``--backend NAME`` → the class in ``dtrain_magic/launchers/NAME.py``.

Adding a backend is one new module with a `Launcher` subclass and one line here; modules are imported
lazily so ``import dtrain_magic`` never pays for pyspark or ray.
"""

from __future__ import annotations

from ..registry import load_class
from ..state import kernel_state
from .base import Failure, Launcher, LaunchState, RunningJob

_REGISTRY: dict[str, str] = {
    "local": "dtrain_magic.launchers.local:LocalLauncher",
    "spark": "dtrain_magic.launchers.spark:SparkLauncher",
    "ray": "dtrain_magic.launchers.ray:RayLauncher",
}


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_launcher(name: str) -> Launcher:
    """The kernel's `Launcher` for ``name`` (kept on `dtrain_magic.state.kernel_state`, so sessions and pools
    are reused from run to run)."""
    cls = load_class(_REGISTRY, name, "--backend", extra_allowed=("auto",))
    return kernel_state().launcher(name, cls)


__all__ = ["Failure", "Launcher", "LaunchState", "RunningJob", "available", "get_launcher"]
