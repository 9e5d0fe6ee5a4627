"""Sweeps (issue #36, docs/sweeps.md): many configurations of one distributed function from one cell.

``%%distribute --sweep "lr=loguniform(1e-4,1e-1) batch=choice(16,32) zero=choice(2,3)" --trials 12 --metric val_loss``,
`dtrain_magic.sweep(fn, space, trials=..., metric=...)` and ``python -m dtrain_magic sweep TARGET --sweep ...`` go
through `entry`: the function is captured once, and each trial is a run of it (`driver.runner`) with the trial's
``ctx.params`` and run options. Optuna does the sampling, pruning and study storage (`study`); the modules, in the
order a sweep uses them: `space` (the space string → Optuna distributions, run options apart), `options` (the
sweep's flags), `study` (sampler, pruner, storage, resume), `parent` (the MLflow parent run), `runner` (the loop:
ask, run, tell, ``--parallel-trials`` at once), `trial` (one trial's run, reported to the pruner and stopped when
pruned), `result` (`SweepResult`).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    """``dtrain_magic.sweep`` names both this package and the function ``dtrain_magic.sweep(fn, space, ...)``: once
    the package is imported, Python binds that name to it, so the package itself is callable (`entry.sweep`)."""

    def __call__(self, fn: Any, space: str, /, *args: Any, **kwargs: Any) -> Any:
        """``dtrain_magic.sweep(fn, space, trials=..., metric=..., **options)``: `dtrain_magic.sweep.entry.sweep`."""
        from .entry import sweep

        return sweep(fn, space, *args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage


def __getattr__(name: str) -> Any:
    # Imported when first asked for: Optuna's import is not paid by a plain run.
    if name == "sweep":
        from .entry import sweep

        return sweep
    if name in ("SweepResult", "BestTrial"):
        from . import result

        return getattr(result, name)
    if name == "SweepError":
        from .runner import SweepError

        return SweepError
    raise AttributeError(name)


__all__ = ["BestTrial", "SweepError", "SweepResult", "sweep"]
