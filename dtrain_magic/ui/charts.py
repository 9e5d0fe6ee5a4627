"""Live charts of a run, read from MLflow: training metrics against step, system metrics over time.

`RunCharts` owns two plotly ``FigureWidget``s and a background poller (`start`) that reads the run with
``MlflowClient.get_run`` (which keys exist, the run's status) and ``get_metric_history`` per key, every
``interval_s`` (0.25 s by default; one history of a few hundred points costs 1-2 ms on SQLite). The
poller stops after the run is terminal in MLflow (the tracker flushes every queued metric before it
sets the status), after one last read, so the charts show the final state. `poll_once` is the same
read, synchronously: ``%distribute_show RUN_ID`` uses it for a finished run.

- Metrics chart: one trace per metric the function logged (``ctx.log``), x = step, y = value, sorted by
  (step, timestamp) as MLflow stores them. The first ``loss``-like metric is visible, the others are
  ``legendonly``: a click on the legend shows any of them (in the browser, no kernel round trip).
- System chart: GPU utilisation and memory per device (``system/gpu_N_utilization_percentage``,
  ``system/gpu_N_memory_usage_percentage``, nvidia-ml-py) when the run has them, else CPU and RAM
  (``system/cpu_utilization_percentage``, ``system/system_memory_usage_percentage``), in percent,
  x = seconds since the run started. Node-prefixed keys (``system/<node>/...``) get one trace per node.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_log = logging.getLogger(__name__)

TERMINAL = ("FINISHED", "FAILED", "KILLED")
_GPU = re.compile(r"^system/(?:(?P<node>[^/]+)/)?gpu_(?P<dev>\d+)_(?P<kind>utilization|memory_usage)_percentage$")
_CPU = re.compile(r"^system/(?:(?P<node>[^/]+)/)?(?P<kind>cpu_utilization|system_memory_usage)_percentage$")


def is_system(key: str) -> bool:
    return key.startswith("system/")


def system_series(keys: list[str]) -> dict[str, str]:
    """Which system metric keys to draw, and their trace names: GPUs when present, else CPU and RAM."""
    gpu, cpu = {}, {}
    for key in sorted(keys):
        if m := _GPU.match(key):
            node = f"{m['node']} " if m["node"] else ""
            gpu[key] = f"{node}GPU {m['dev']} {'util' if m['kind'] == 'utilization' else 'memory'} %"
        elif m := _CPU.match(key):
            node = f"{m['node']} " if m["node"] else ""
            cpu[key] = f"{node}{'CPU' if m['kind'] == 'cpu_utilization' else 'RAM'} %"
    return gpu or cpu


def default_metric(keys: list[str]) -> str | None:
    """The metric shown first: ``loss`` (or one containing it), else the first in name order."""
    names = sorted(keys)
    for key in names:
        if key == "loss":
            return key
    for key in names:
        if "loss" in key.lower():
            return key
    return names[0] if names else None


@dataclass
class Series:
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)


class RunCharts:
    """The two charts of one MLflow run and the poller that keeps them current."""

    def __init__(
        self,
        client: Any,
        run_id: str,
        interval_s: float = 0.25,
        on_update: Callable[["RunCharts"], None] | None = None,
        figure_factory: Callable[..., Any] | None = None,
    ):
        import plotly.graph_objects as go

        self.client, self.run_id, self.interval_s = client, run_id, interval_s
        self.on_update = on_update
        factory = self._factory = figure_factory or go.FigureWidget
        common = dict(height=320, width=480, margin=dict(l=50, r=10, t=40, b=40), template="plotly_white",
                      legend=dict(orientation="h", y=-0.2))
        self.metrics_figure = factory(layout=dict(
            title=dict(text="Training metrics"), xaxis=dict(title=dict(text="step")), **common))
        self.system_figure = factory(layout=dict(
            title=dict(text="System"), xaxis=dict(title=dict(text="seconds")),
            yaxis=dict(title=dict(text="%"), range=[0, 100]), **common))
        self.metrics: dict[str, Series] = {}
        self.system: dict[str, Series] = {}
        self.status: str | None = None
        self.start_time_ms: int | None = None
        self.lags_s: list[float] = []  # ctx.log on the worker (its timestamp) -> value in the chart data
        self.polls = 0
        self.error: str | None = None
        self._live = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._run_ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._widget: Any = None
        self._added: set[int] = set()
        self._frames: dict[int, Any] = {}
        self._synced: dict[int, float] = {}

    # -- display ---------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """Both figures side by side (an ipywidgets HBox)."""
        if self._widget is None:
            import ipywidgets as w

            self._frames = {id(f): w.Box([f]) for f in (self.metrics_figure, self.system_figure)}
            self._widget = w.HBox(list(self._frames.values()), layout=w.Layout(flex_flow="row wrap"))
            self._widget.add_class("dtm-charts")
        return self._widget

    def trace_data(self, figure: Any, name: str) -> tuple[list, list]:
        """(x, y) of the trace called ``name`` in ``figure``, as the front-end receives them."""
        for trace in figure.data:
            if trace.name == name:
                return list(trace.x or ()), list(trace.y or ())
        raise KeyError(name)

    # -- reading MLflow --------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Read the run once and update the figures; True if anything changed."""
        with self._lock:
            run = self.client.get_run(self.run_id)
            self.status = run.info.status
            self.start_time_ms = run.info.start_time
            keys = list(run.data.metrics.keys())
            changed_metrics, changed_system = [], []
            now = time.time()
            wanted = system_series([k for k in keys if is_system(k)])
            for key in keys:
                if is_system(key) and key not in wanted:
                    continue
                history = self.client.get_metric_history(self.run_id, key)
                target = self.system if is_system(key) else self.metrics
                old = target.get(key)
                if old is not None and len(old.timestamps) == len(history):
                    continue
                if is_system(key):
                    history = sorted(history, key=lambda m: (m.timestamp, m.step))
                    t0 = self.start_time_ms or (history[0].timestamp if history else 0)
                    series = Series([(m.timestamp - t0) / 1000.0 for m in history], [m.value for m in history],
                                    [m.timestamp for m in history])
                    changed_system.append(key)
                else:
                    history = sorted(history, key=lambda m: (m.step, m.timestamp))
                    series = Series([m.step for m in history], [m.value for m in history], [m.timestamp for m in history])
                    if self._live:
                        seen = set(old.timestamps) if old else set()
                        self.lags_s += [now - ts / 1000.0 for ts in series.timestamps if ts not in seen]
                    changed_metrics.append(key)
                target[key] = series
            self.polls += 1
            if changed_metrics:
                self._draw(self.metrics_figure, self.metrics, changed_metrics, visible_default=default_metric(list(self.metrics)))
            if changed_system:
                self._draw(self.system_figure, self.system, changed_system, names=wanted)
                title = "System (GPU)" if any("gpu_" in k for k in wanted) else "System (CPU / RAM, no GPU)"
                if self.system_figure.layout.title.text != title:
                    self.system_figure.layout.title.text = title
                    self._added.add(id(self.system_figure))
            for figure in (self.metrics_figure, self.system_figure):
                self._sync_initial_state(figure, final=self.status in TERMINAL)
            changed = bool(changed_metrics or changed_system)
        if changed and self.on_update is not None:
            self.on_update(self)
        return changed

    def _sync_initial_state(self, figure: Any, final: bool = False) -> None:
        """Keep the state a *new* front-end view starts from current (plotly sets it only at display time).

        Our figures live in a Box and get traces after the Box was displayed; a view created later (the
        browser loads plotly's large module slowly, or the notebook is reopened) would start from the
        empty initial state and miss the add-trace messages. Existing views ignore this state (they get
        restyle messages), so it is only sent when traces were added (then a fresh figure replaces it), every few seconds,
        and at the end.
        """
        if not hasattr(figure, "_widget_data"):
            return
        now = time.monotonic()
        key = id(figure)
        added = key in self._added
        if added or final or now - self._synced.get(key, 0.0) > 5.0:
            from copy import deepcopy

            figure._widget_layout = deepcopy(figure._layout_obj._props)
            figure._widget_data = deepcopy(figure._data)
            self._synced[key] = now
            self._added.discard(key)
        frame = self._frames.get(key)
        if added and frame is not None:
            # A view that was still starting when the traces were added may miss them for good (seen in
            # JupyterLab under load; mounting the same model again draws an empty plot). So show a fresh
            # FigureWidget built with every trace: its view starts from complete state.
            fresh = self._factory(data=figure.data, layout=figure.layout)
            if figure is self.metrics_figure:
                self.metrics_figure = fresh
            else:
                self.system_figure = fresh
            self._frames[id(fresh)] = self._frames.pop(key)
            self._synced[id(fresh)] = now
            frame.children = (fresh,)
            try:
                figure.close()
            except Exception:
                pass

    def _draw(self, figure: Any, source: dict[str, Series], keys: list[str], names: dict[str, str] | None = None,
              visible_default: str | None = None) -> None:
        existing = {trace.name: trace for trace in figure.data}
        with figure.batch_update():
            for key in keys:
                name = (names or {}).get(key, key)
                series = source[key]
                if name in existing:
                    existing[name].x, existing[name].y = list(series.x), list(series.y)
                else:
                    self._added.add(id(figure))
                    visible = True if names is not None or key == visible_default else "legendonly"
                    figure.add_scatter(x=list(series.x), y=list(series.y), name=name, mode="lines+markers",
                                       marker=dict(size=4), visible=visible)

    # -- the background poller -------------------------------------------------------------------
    def start(self) -> "RunCharts":
        """Poll in a background thread until the run is over in MLflow (see `run_ended`) or `stop`."""
        if self._thread is None:
            self._live = True
            self._thread = threading.Thread(target=self._loop, name=f"dtrain-charts-{self.run_id[:8]}", daemon=True)
            self._thread.start()
        return self

    def run_ended(self, grace_s: float = 30.0) -> None:
        """The driver is done: poll until MLflow marks the run terminal (at most ``grace_s``), then stop."""
        self._grace_until = time.monotonic() + grace_s
        self._run_ended.set()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the poller to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
                self.error = None
            except Exception as exc:  # a store hiccup must not kill the charts; try again next tick
                self.error = f"{type(exc).__name__}: {exc}"
                _log.debug("polling MLflow failed", exc_info=True)
            if self.status in TERMINAL or (self._run_ended.is_set() and time.monotonic() > self._grace_until):
                try:
                    self.poll_once()  # everything is flushed once the status is terminal: the final state
                except Exception:
                    _log.debug("final MLflow poll failed", exc_info=True)
                break
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        self._live = False


def lag_summary(lags_s: list[float]) -> dict[str, float]:
    """Median, p95 and max of the chart lag samples, in seconds."""
    if not lags_s:
        return {}
    ordered = sorted(lags_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"n": float(len(ordered)), "median_s": pick(0.5), "p95_s": pick(0.95), "max_s": ordered[-1]}
