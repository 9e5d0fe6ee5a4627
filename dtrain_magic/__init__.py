"""dtrain_magic: ``%%distribute`` runs a notebook cell's training function on many processes.

``%load_ext dtrain_magic`` registers the magics. The public API: `RunConfig`, `RunResult`,
`TrainContext`, and the errors in `dtrain_magic.errors`.
"""

from __future__ import annotations

from typing import Any

from .config import RunConfig
from .errors import (
    CaptureError,
    ConfigError,
    DistributeError,
    LaunchError,
    MissingDependencyError,
    RunInterrupted,
    RunTimeout,
    UnsupportedCodeError,
    UnsupportedVersionError,
    WorkerError,
)
from .result import RunResult

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext dtrain_magic``: register ``%%distribute``."""
    from .magic import DistributeMagics

    ipython.register_magics(DistributeMagics)
    try:  # %distribute_show and friends, when the UI extras (ipywidgets, plotly) are installed
        from .ui.magics import UIMagics
    except ImportError:
        return
    ipython.register_magics(UIMagics)


def __getattr__(name: str) -> Any:
    if name == "TrainContext":  # imports torch: only when asked for
        from .context import TrainContext

        return TrainContext
    raise AttributeError(name)


__all__ = [
    "CaptureError", "ConfigError", "DistributeError", "LaunchError", "MissingDependencyError", "RunConfig",
    "RunInterrupted", "RunResult", "RunTimeout", "TrainContext", "UnsupportedCodeError", "UnsupportedVersionError",
    "WorkerError",
    "load_ipython_extension",
]
