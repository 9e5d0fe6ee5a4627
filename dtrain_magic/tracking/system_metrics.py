"""System metrics (CPU, memory, disk, network; GPU with nvidia-ml-py) through MLflow's own
``SystemMetricsMonitor``, for the notebook's machine and, in Spark cluster mode, for each node."""

from __future__ import annotations

import logging
from typing import Any

from .._compat import mlflow as mlflow_compat

SYSTEM_METRICS_INTERVAL_S = 1.0
_NOISY_LOGGERS = ("alembic", "mlflow.store.db.utils", "mlflow.system_metrics", "mlflow.tracking")


def quiet_mlflow(level: int = logging.WARNING) -> None:
    """MLflow prints alembic migration chatter and system-metrics start/stop lines into the cell."""
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def gpu_metrics_note(use_gpu: bool) -> str | None:
    """Why GPU metrics will be missing, if they will (MLflow skips them silently without nvidia-ml-py)."""
    if not use_gpu:
        return None
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)
    except ImportError:
        return "GPU metrics are off: install nvidia-ml-py to record GPU utilisation and memory"
    return None


def start_monitor(run_id: str, tracking_uri: str, node_id: str | None = None,
                  interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> Any:
    """Start sampling this machine into ``run_id`` every ``interval_s`` seconds (``system/<node_id>/...``
    when ``node_id`` is given); returns the monitor for `finish_monitor`."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, samples_before_logging=1, node_id=node_id, tracking_uri=tracking_uri,
    )
    monitor.start()
    return monitor


def finish_monitor(monitor: Any) -> None:
    """Stop ``monitor``. MLflow's monitor publishes only after a whole interval: a run shorter than that (a
    warm re-run, or workers that finished while the run was opening) would have no system metrics at all, so
    one sample is logged then."""
    monitor.finish()
    mlflow_compat.publish_one_sample_if_none(monitor)
