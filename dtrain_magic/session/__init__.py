"""Interactive distributed sessions: ranks that keep their state from cell to cell, on local, Spark and Ray.

A session is N ranks started once on a backend, as a run's workers are (the same flags, checks, launchers, waiting
workers, process group, ``ctx`` and MLflow run), that then serve the notebook's cells instead of one function:
``%distribute_session start --backend spark -n 2`` (or ``dtrain_magic.Session(backend="spark", num_processes=2)``),
``%%ranks`` cells, ``%distribute_pull`` / ``%distribute_push``, ``%distribute_session stop``. The design and the
user's view: docs/sessions.md.

- `driver`: the notebook's side, `Session` (start, run a cell, push, pull, interrupt, stop, idle release);
- `worker`: a rank's side, ``serve`` (the function every rank runs);
- `protocol`: the session's channel messages; `values`: values by rank (`PerRank`) and what travels;
- `options`: which flags apply, the idle timeout.

Imported lazily: a rank imports `worker` alone.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Session":
        from .driver import Session

        return Session
    if name in ("PerRank", "Unsent"):
        from . import values

        return getattr(values, name)
    raise AttributeError(name)


__all__ = ["PerRank", "Session", "Unsent"]
