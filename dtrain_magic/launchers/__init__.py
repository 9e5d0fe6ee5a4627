"""Launchers: ``--backend NAME`` → its `Launcher` class, registered in `dtrain_magic.registry.BACKENDS`.

Adding a backend is one new module with a `Launcher` subclass and one line in the registry; modules are
imported lazily so ``import dtrain_magic`` never pays for pyspark or ray.
"""

from __future__ import annotations

from ..registry import BACKENDS
from ..state import kernel_state
from .base import Failure, Launcher, LaunchState, RunningJob


def get_launcher(name: str) -> Launcher:
    """The kernel's `Launcher` for ``name`` (kept on `dtrain_magic.state.kernel_state`, so sessions and pools
    are reused from run to run)."""
    return kernel_state().launcher(name, BACKENDS.load(name))


__all__ = ["Failure", "Launcher", "LaunchState", "RunningJob", "get_launcher"]
