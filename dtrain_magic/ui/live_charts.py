"""The monitor's live charts over a run's life: `LiveCharts` makes the `charts.RunCharts` in a background thread
(at the first metric or when the MLflow run opens, whichever is first: nothing of it competes with the workers'
start; plotly's first figure takes seconds in a fresh kernel), keeps the values fed until then, attaches the
MLflow run once it is open, and at the run's end waits a while for charts still in the making."""

from __future__ import annotations

import html
import threading
from typing import Any

import ipywidgets as w

from ..config import RunConfig
from .charts import preload_plotly

CHARTS_WAIT_S = 20.0  # at the run's end, how long to wait for charts still being made (a fresh kernel's plotly import)


class LiveCharts:
    """The charts of one run, shown in ``box`` once made (or why they are not)."""

    def __init__(self, box: Any, poll_s: float):
        self.box = box
        self.charts: Any = None  # the `charts.RunCharts` once made
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self._done = threading.Event()
        self._ended = threading.Event()
        self._failed = False
        self._early_metrics: list[tuple[int, dict, int | None]] = []  # fed before the charts existed
        self._mlflow_run: tuple[Any, str] | None = None  # (client, run_id) once the MLflow run is open

    def feed(self, step: int, metrics: dict[str, float], timestamp_ms: int | None) -> None:
        """A metric from the channel: to the charts, or kept for them until they exist."""
        with self._lock:
            charts = self.charts
            if charts is None and not self._failed:
                self._early_metrics.append((step, dict(metrics), timestamp_ms))
        if charts is not None:
            charts.feed(step, metrics, timestamp_ms)
        elif not self._failed:
            self._ensure_started()

    def attach(self, config: RunConfig, run_id: str) -> str:
        """The MLflow run opened: the charts merge its history. An HTML note when MLflow cannot be read, else ""."""
        try:
            from mlflow import MlflowClient

            from ..tracking import resolve_tracking_uri

            client = MlflowClient(tracking_uri=resolve_tracking_uri(config))
        except Exception as exc:  # the fed points stay; MLflow's copy is not read
            return f" <i>(MLflow history unavailable: {html.escape(type(exc).__name__)})</i>"
        with self._lock:
            self._mlflow_run = (client, run_id)
            charts = self.charts
        if charts is not None:
            charts.attach(client, run_id)
        self._ensure_started()
        return ""

    def mark_ended(self) -> bool:
        """The run ended; whether the charts are still being made (then `finish` waits for them)."""
        with self._lock:
            self._ended.set()
            return self.charts is None and self._starter is not None

    def finish(self, still_starting: bool) -> None:
        """Every value drawn before the cell returns (what a headless run saves)."""
        if still_starting:  # a short run: its charts may still be in the making (plotly's first import)
            self._done.wait(CHARTS_WAIT_S)
        charts = self.charts
        if charts is not None:
            charts.run_ended()
            charts.show_now()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until the charts exist (or failed); the `charts.RunCharts`, or None."""
        self._done.wait(timeout)
        return self.charts

    def _ensure_started(self) -> None:
        with self._lock:
            if self._starter is not None:
                return
            preload_plotly()
            self._starter = threading.Thread(target=self._make, name="dtrain-charts-start", daemon=True)
            self._starter.start()

    def _make(self) -> None:
        from .charts import RunCharts, wait_for_plotly

        try:
            wait_for_plotly()
            charts = RunCharts(None, None, interval_s=self._poll_s)
        except Exception as exc:  # charts are a bonus: the run goes on without them
            self._unavailable(exc)
            return
        self._hand_over(charts)
        try:
            # Draw what came so far *before* the figures are displayed: their first views then start
            # from complete state (a view that starts while traces are being added may miss them).
            charts.start(first_poll=True)
            self.box.children = (charts.widget,)
        except Exception as exc:  # charts are a bonus: the panel says why they are missing, the run goes on
            self._unavailable(exc)
            return
        if self._ended.is_set():
            charts.run_ended()
        self._done.set()

    def _hand_over(self, charts: Any) -> None:
        """The new charts get what was fed so far and the MLflow run if it is open; from now on, `feed` feeds them."""
        with self._lock:
            for step, metrics, stamp in self._early_metrics:
                charts.feed(step, metrics, stamp)
            self._early_metrics = []
            if self._mlflow_run is not None:
                charts.attach(*self._mlflow_run)
            self.charts = charts

    def _unavailable(self, exc: BaseException) -> None:
        with self._lock:
            self._failed, self._early_metrics = True, []
        self.box.children = (w.HTML(f"<i>live charts unavailable: {type(exc).__name__}: {exc}</i>"),)
        self._done.set()
