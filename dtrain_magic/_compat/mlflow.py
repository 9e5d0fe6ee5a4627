"""MLflow's private parts, written against MLflow 3.17 (constraints.txt: 3.17.2).

Both are niceties, so no MLflow version is refused:

- `has_store_for` (``tracking/uri.py``, before launch, for URI schemes other than file, sqlite and http(s)):
  ``mlflow.tracking._tracking_service.utils._tracking_store_registry``, which schemes MLflow or a plugin can open.
  **Gated**: on an unknown version (without the opt-in), or when it is gone, not asked (None); creating the run
  then says whether the store works, after the workers started.
- `publish_one_sample_if_none` (``tracking/system_metrics.py``, when a run's monitor stops):
  ``SystemMetricsMonitor._logging_step``, how many samples the monitor published. **Fallback** when missing: no
  extra sample (a run shorter than one sampling interval then has no system metrics).
"""

from __future__ import annotations

from typing import Any

from ..errors import log_dropped
from . import Library

MLFLOW = Library(key="mlflow", title="MLflow", module="mlflow", known=("3.17",), tested="3.17.2",
                 requirement="mlflow==3.17.2")


def has_store_for(uri: str) -> bool | None:
    """Whether MLflow (with its plugins) has a tracking store for ``uri``'s scheme; None when this MLflow
    cannot be asked. Imports MLflow: wait for `tracking.preload` first."""
    if not MLFLOW.allowed():
        return None
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:
        return None
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception as exc:  # a private registry: any failure means no store for this scheme
        log_dropped(__name__, "has_store_for", exc)
        return False
    return True


def publish_one_sample_if_none(monitor: Any) -> None:
    """After ``monitor.finish()``: if it never published (it does so once per whole interval), sample and
    publish once now, through its own public methods."""
    if getattr(monitor, "_logging_step", None) != 0:
        return
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    monitor.mlflow_logger.flush()
