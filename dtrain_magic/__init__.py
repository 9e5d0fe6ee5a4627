"""dtrain_magic: run a PyTorch training function on many processes, GPUs or nodes (local, Spark, Ray).

Three entry points, one path (`driver.runner`): ``%%distribute`` in a notebook (``%load_ext dtrain_magic``
registers the magics), `run` from Python (``dtrain_magic.run(train, backend="ray", num_processes=4)``), and the
command line (``python -m dtrain_magic run my_pkg.train:main -n 4``, `dtrain_magic.cli`).

The public API: `run`, `CTX` (stands for the worker's ``ctx`` among `run`'s arguments), `RunConfig`,
`RunResult`, `TrainContext`, `Session` (an interactive session: ranks that keep their state from cell to cell,
`dtrain_magic.session`), `sweep` (a run per trial of a search space, Optuna's samplers and pruners:
`dtrain_magic.sweep`), and the errors in `dtrain_magic.errors`. The layout follows the flow: `notebook`
(the magics), `api` and `cli` → `config` (one validated `RunConfig` from the flag table, `flagtable`) →
`driver` (check, launch, pump) → `launchers` (one per backend) → `worker` (every rank: the `TrainContext` for
the `strategies`) → `tracking` (MLflow) → `ui` (the panel and charts that read it).
"""

from __future__ import annotations

from typing import Any

from .config import RunConfig
from .errors import (
    CaptureError,
    CellInterrupted,
    CellTimeout,
    ConfigError,
    DistributeError,
    LaunchError,
    MissingDependencyError,
    RankError,
    RunHung,
    RunInterrupted,
    RunStalled,
    RunTimeout,
    SessionError,
    SessionLost,
    UnsupportedCodeError,
    UnsupportedVersionError,
    WorkerError,
)
from .result import RunResult

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext dtrain_magic``: register ``%%distribute`` and the session magics (``%distribute_session``,
    ``%%ranks``, ``%distribute_pull``, ``%distribute_push``)."""
    from .notebook.magic import DistributeMagics
    from .notebook.session_magic import SessionMagics

    ipython.register_magics(DistributeMagics)
    ipython.register_magics(SessionMagics)
    try:  # %distribute_show and friends, when the UI extras (ipywidgets, plotly) are installed
        from .ui.magics import UIMagics
    except ImportError:
        return
    ipython.register_magics(UIMagics)


def __getattr__(name: str) -> Any:
    # Imported when first asked for: `import dtrain_magic` (``%load_ext``) stays cheap.
    if name == "TrainContext":  # imports torch
        from .worker.context import TrainContext

        return TrainContext
    if name == "run":
        from .api import run

        return run
    if name == "CTX":
        from .payload import CTX

        return CTX
    if name == "sweep":  # a run per trial of a search space (docs/sweeps.md): the package is callable
        import importlib

        return importlib.import_module(".sweep", __name__)
    if name == "Session":  # an interactive session (docs/sessions.md)
        from .session.driver import Session

        return Session
    raise AttributeError(name)


__all__ = [
    "CTX", "CaptureError", "ConfigError", "DistributeError", "LaunchError", "MissingDependencyError", "RunConfig",
    "RunHung", "RunInterrupted", "RunResult", "RunStalled", "RunTimeout", "TrainContext", "UnsupportedCodeError",
    "UnsupportedVersionError",
    "WorkerError",
    "load_ipython_extension", "run",
]
# Sweeps (docs/sweeps.md): dtrain_magic.sweep(fn, space, trials=..., metric=...)
__all__ += ["sweep"]
# Interactive sessions (docs/sessions.md)
__all__ += ["CellInterrupted", "CellTimeout", "RankError", "Session", "SessionError", "SessionLost"]
