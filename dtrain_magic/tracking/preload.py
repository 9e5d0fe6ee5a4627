"""Importing MLflow (and other slow imports) in the background, never two at once.

MLflow takes about 2 s of CPU to import on a small machine: a kernel's first run imports it beside other
start-up work. Two threads importing modules they share can deadlock on Python's import locks, so every
background import here waits for the earlier ones.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..errors import log_dropped

_import_thread: threading.Thread | None = None
_import_threads: list[threading.Thread] = []  # every background import, MLflow's and others', in start order
_import_lock = threading.RLock()


def preload_mlflow() -> None:
    """Start importing MLflow (about 2 s on a small machine) in a background thread, so a first run's
    other start-up work (a SparkSession, capturing the cell) goes on meanwhile. Imports only: no store is
    opened, no file or run created. Safe to call many times."""
    global _import_thread
    with _import_lock:
        if _import_thread is not None or "mlflow.system_metrics.system_metrics_monitor" in sys.modules:
            return
        _import_thread = import_in_background("dtrain-mlflow-import", _import_mlflow)


def import_in_background(name: str, target: Any) -> threading.Thread:
    """Run ``target`` (imports only) in a background thread, after every earlier background import has
    ended; MLflow's own import waits for it too (`wait_for_preload`). Two threads importing modules they
    share (numpy, pandas, ...) at once can deadlock on Python's import locks or see a half-initialised
    module, so background imports never overlap each other. Used for MLflow and for the live charts'
    plotly (whose first figure loads its classes and template: a second or more in a fresh kernel)."""
    with _import_lock:
        earlier = [t for t in _import_threads if t.is_alive()]

        def chained() -> None:
            for thread in earlier:
                thread.join()
            target()

        thread = threading.Thread(target=chained, name=name, daemon=True)
        _import_threads[:] = earlier + [thread]
        thread.start()
    return thread


def _import_mlflow() -> None:
    try:
        from mlflow import MlflowClient  # noqa: F401
        from mlflow.entities import Metric, Param  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # noqa: F401
    except Exception as exc:  # not installed or broken: the run's own import says so, in the notebook's thread
        log_dropped(__name__, "_import_mlflow", exc)


def wait_for_preload() -> None:
    """Let every running background import (`preload_mlflow`, `import_in_background`) finish before
    importing MLflow here: two threads importing the same package's modules at once can deadlock on
    Python's import locks."""
    with _import_lock:
        threads = list(_import_threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
