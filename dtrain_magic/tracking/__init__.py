"""MLflow: one run per ``%%distribute``, through ``MlflowClient`` (no global active run in the kernel).

- `uri`: which tracking URI, and whether MLflow can use it (checked before anything is launched);
- `preload`: MLflow's import in the background, never beside another background import;
- `writer`: the thread that batches metrics into the store, so the notebook's message loop never waits on it;
- `system_metrics`: MLflow's own ``SystemMetricsMonitor`` (CPU, memory; GPU with nvidia-ml-py);
- `run`: `RunTracker` (one run's params, metrics, result, status) and `RunOpening` (opening it in the background).
"""

from __future__ import annotations

from .preload import import_in_background, preload_mlflow, wait_for_preload
from .run import RunOpening, RunTracker
from .system_metrics import gpu_metrics_note
from .uri import check_tracking_uri, resolve_tracking_uri, sqlite_experiment_stage

__all__ = [
    "RunOpening", "RunTracker", "check_tracking_uri", "gpu_metrics_note", "import_in_background", "preload_mlflow",
    "resolve_tracking_uri", "sqlite_experiment_stage", "wait_for_preload",
]
