"""Live charts of a run, read from MLflow: training metrics against step, system metrics over time, and the world size
of a run that was relaunched.

`RunCharts` owns three plotly figures and a background poller (`start`) that reads the run with
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
- World size chart, only for a run that was relaunched or resumed (`WORLD_KEYS`, logged by `driver.resizes`): the
  world size against the optimizer step (a step line), each restart a dotted vertical line, the optimizer steps each
  relaunch lost beside the point it resumed from and in the title (`draw_world`). A run without one has no such
  metric, and the chart stays hidden.

How they reach the front-end: each figure is shown as plotly's MIME bundle (``application/vnd.plotly.v1+json``,
the figure's data and layout) in an ``ipywidgets.Output``, replaced when the figure changed (at most every
``redraw_s`` while the run goes, and once at its end). JupyterLab draws the bundle with the jupyterlab-plotly
extension plotly's wheel installs, VS Code natively. Not a ``FigureWidget``: that is an anywidget whose saved
state carries plotly's whole JavaScript bundle (4.9 MB), and a notebook executed headless (nbclient keeps the
state of every widget ever opened) saved 15 MB for one run. An Output's state is the last bundle only: a few KB,
which a front-end reopening the notebook without its kernel draws as the run's final charts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .._compat import plotly as plotly_compat
from .training_series import Point, TrainingSeries

_log = logging.getLogger(__name__)

TERMINAL = ("FINISHED", "FAILED", "KILLED")
_GPU = re.compile(r"^system/(?:(?P<node>[^/]+)/)?gpu_(?P<dev>\d+)_(?P<kind>utilization|memory_usage)_percentage$")
_CPU = re.compile(r"^system/(?:(?P<node>[^/]+)/)?(?P<kind>cpu_utilization|system_memory_usage)_percentage$")


_preload: threading.Thread | None = None
_preload_lock = threading.Lock()


def preload_plotly() -> threading.Thread | None:
    """Import what the first figure needs in the background (`tracking.import_in_background`, so it never
    overlaps MLflow's import), once per kernel; the thread, or None when already imported.

    In a fresh kernel that first figure costs a second or more of CPU (plotly's figure classes, its
    validators and the template); done here, the driver's message loop goes on meanwhile."""
    global _preload
    with _preload_lock:
        if _preload is None:
            if plotly_compat.FIGURE_MODULE in sys.modules:
                return None
            from ..tracking import import_in_background

            _preload = import_in_background("dtrain-plotly-import", _import_plotly)
        return _preload


def _import_plotly() -> None:
    try:
        import plotly.graph_objects as go
        import plotly.io  # noqa: F401  (what `figure_bundle` serialises with)

        go.Figure(layout=dict(template=TEMPLATE))  # the first figure loads the classes and the template
        # plotly's validators and JSON encoder look at sys.modules["pandas"] without importing it: while
        # MLflow's import (next in line, in another thread) is half-way through pandas, they would meet a
        # half-initialised module ("partially initialized module 'pandas' has no attribute 'Series'").
        # Imported here, in the same queue of background imports, it is complete before either begins.
        if importlib.util.find_spec("pandas") is not None:
            importlib.import_module("pandas")
    except Exception:  # missing or broken: creating the charts says so in the panel
        _log.debug("importing plotly failed", exc_info=True)


def wait_for_plotly(timeout: float | None = None) -> bool:
    """Wait for `preload_plotly`'s import (if one runs); True when it is over."""
    thread = _preload
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)
        return not thread.is_alive()
    return True


# The magic's own record of a run's relaunches (`driver.resizes`): drawn in the world size chart, not with the
# function's metrics. (``grad_accum`` and ``lr_scale`` stay there: a function may log those names itself.)
WORLD_KEYS = ("world_size", "restarts", "steps_lost", "steps_lost_total", "resumed_at_step")


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


PLOTLY_MIME = "application/vnd.plotly.v1+json"
TEMPLATE = "plotly_white"
LOG_Y_DECADES = 3.0  # automatic log y once the shown metric spans this many powers of ten (all values > 0)
Y_SCALES = ("auto", "linear", "log")


def wants_log_y(values: list[float], decades: float = LOG_Y_DECADES) -> bool:
    """Automatic y scale of the metrics chart: log when every value is > 0 and they span ``decades``
    powers of ten (a loss falling from 1 to 1e-6 is a flat line on a linear axis after a few steps)."""
    finite = [v for v in values if v == v and v not in (float("inf"), float("-inf"))]
    if len(finite) < 2 or min(finite) <= 0:
        return False
    return max(finite) / min(finite) >= 10.0 ** decades


def figure_bundle(figure: Any) -> dict[str, Any]:
    """``figure`` as a display_data output: plotly's MIME bundle (its JSON: NaN as null, as plotly writes it)
    and, for a front-end without a plotly renderer, a line of text per trace."""
    import plotly.io as pio

    lines = [figure.layout.title.text or "chart"]
    for trace in figure.data:
        y = list(trace.y or ())
        lines.append(f"  {trace.name}: {len(y)} points" + (f", last {y[-1]:.6g}" if y else ""))
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: json.loads(pio.to_json(figure, validate=False)), "text/plain": "\n".join(lines)}}


def _world_at(world: Series, stamp: int) -> float:
    """The world size the run had at ``stamp`` (ms): the last ``world`` point logged by then."""
    earlier = [y for y, t in zip(world.y, world.timestamps, strict=True) if t <= stamp]
    return earlier[-1] if earlier else world.y[0]


def draw_world(figure: Any, series: dict[str, Series], trained_to: float | None = None) -> bool:
    """Draw the world size chart of a run's `WORLD_KEYS` series into ``figure`` (its traces, shapes and annotations
    replaced); False, and nothing drawn, when the run has no world size or restart (it was never relaunched). The
    line goes on to ``trained_to`` (the last step of the run's own metrics), not only to its last relaunch."""
    if "world_size" not in series and "restarts" not in series:
        return False
    world = series.get("world_size") or Series([0], [float("nan")], [0])  # restarts alone: an unknown world
    restarts, lost = series.get("restarts", Series()), series.get("steps_lost", Series())
    last = max([*world.x, *restarts.x, *lost.x, *([] if trained_to is None else [trained_to])])
    shapes = [dict(type="line", x0=step, x1=step, y0=0, y1=1, xref="x", yref="paper",
                   line=dict(dash="dot", color="firebrick")) for step in restarts.x]
    notes = [dict(x=step, y=1, xref="x", yref="paper", text=f"restart {count:g}", showarrow=False, xanchor="left",
                  yanchor="top", font=dict(color="firebrick"))
             for step, count in zip(restarts.x, restarts.y, strict=True)]
    notes += [dict(x=step, y=_world_at(world, stamp), text=f"{value:g} lost", showarrow=True, arrowhead=2, ay=-30)
              for step, value, stamp in zip(lost.x, lost.y, lost.timestamps, strict=True) if value]
    total, count = sum(lost.y), int(restarts.y[-1]) if restarts.y else 0
    figure.data = ()
    figure.add_scatter(x=[*world.x, last], y=[*world.y, world.y[-1]], name="world size", mode="lines+markers",
                       line=dict(shape="hv"), marker=dict(size=6))
    figure.layout.update(shapes=shapes, annotations=notes, title=dict(
        text=f"World size: {count} restart{'s' * (count != 1)}, {total:g} optimizer step{'s' * (total != 1)} lost"))
    return True


class RunCharts:
    """The charts of one run (training metrics, system, a relaunched run's world size) and the poller that keeps
    them current.

    Training metrics come from two places. MLflow's history is the record: what the chart holds once the
    run is terminal is exactly that history. While the run goes, `feed` adds each value as the notebook
    receives it from the workers (``RunObserver.metric``), before MLflow has it: a kernel's first run can
    draw its first points while the MLflow run is still opening (``client``/``run_id`` None until
    `attach`), and later points do not wait for the writer and the poll. A fed point is identified by
    (step, worker timestamp), the same pair MLflow stores, so it is shown once: it leaves the fed list
    when the poll finds it in MLflow's history. System metrics are MLflow's only.

    ``metrics_figure``, ``system_figure`` and ``world_figure`` are plain plotly figures (the Python side's copy); the
    widget shows them as plotly MIME bundles (see the module's docstring), redrawn at most every ``redraw_s``.
    """

    def __init__(
        self,
        client: Any = None,
        run_id: str | None = None,
        interval_s: float = 0.25,
        on_update: Callable[["RunCharts"], None] | None = None,
        figure_factory: Callable[..., Any] | None = None,
        redraw_s: float = 1.0,
    ):
        import plotly.graph_objects as go

        self.client, self.run_id, self.interval_s, self.redraw_s = client, run_id, interval_s, redraw_s
        self.on_update = on_update
        factory = figure_factory or go.Figure
        common = dict(height=320, width=480, margin=dict(l=50, r=10, t=40, b=40), template=TEMPLATE,
                      legend=dict(orientation="h", y=-0.2))
        self.metrics_figure = factory(layout=dict(
            title=dict(text="Training metrics"), xaxis=dict(title=dict(text="step")),
            yaxis=dict(type="linear"), **common))
        self.system_figure = factory(layout=dict(
            title=dict(text="System"), xaxis=dict(title=dict(text="seconds")),
            yaxis=dict(title=dict(text="%"), range=[0, 100]), **common))
        self.world_figure = factory(layout=dict(
            title=dict(text="World size"), xaxis=dict(title=dict(text="optimizer step")),
            yaxis=dict(title=dict(text="ranks"), rangemode="tozero", dtick=1), showlegend=False, **common))
        self.world_shown = False  # the run was relaunched or resumed: the world size chart has something to show
        self.metrics: dict[str, Series] = {}
        self.system: dict[str, Series] = {}
        self.status: str | None = None
        self.start_time_ms: int | None = None
        self.training = TrainingSeries()  # MLflow's history and the fed points of each training metric
        self.polls = 0
        self.error: str | None = None
        self.y_scale = "auto"  # the metrics chart's y axis: auto (log for a wide positive range), linear, log
        self._live = False
        self._lock = threading.RLock()  # the y-scale control's callback takes it while `set_y_scale` may hold it
        self._stop = threading.Event()
        self._run_ended = threading.Event()
        self._grace_until = float("inf")
        self._thread: threading.Thread | None = None
        self._widget: Any = None
        self._scale_control: Any = None
        self._metric_control: Any = None
        self._chosen_metric: str | None = None  # the metric menu's choice (None: `default_metric`)
        self._syncing: int | None = None  # the thread updating the metric menu (its own notifications: no choice)
        self._outputs: dict[str, Any] = {}  # "metrics" / "system" -> the Output showing that figure
        self._stale: set[str] = set()  # figures changed since they were last shown
        self._shown_at: dict[str, float] = {}  # figure -> time.monotonic() of its last redraw

    # -- display ---------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """Both figures side by side (an ipywidgets HBox of two Outputs), under the y-scale control of the
        metrics chart. Built showing the figures as they are now."""
        with self._lock:
            if self._widget is None:
                self._widget = self._build_widget()
                self._stale = {"metrics", "system"}
                self._show(force=True)
        return self._widget

    def _build_widget(self) -> Any:
        import ipywidgets as w

        # The minimum size keeps the chart's place while an Output is emptied and refilled: no jump.
        size = w.Layout(min_width="480px", min_height="320px")
        self._outputs = {"metrics": w.Output(layout=size), "system": w.Output(layout=size),
                         "world": w.Output(layout=w.Layout(min_width="480px", min_height="320px",
                                                           display=None if self.world_shown else "none"))}
        for name, output in self._outputs.items():
            output.add_class(f"dtm-chart-{name}")
        self._scale_control = w.ToggleButtons(
            options=[(name, name) for name in Y_SCALES], value=self.y_scale, description="loss y axis",
            tooltips=["log when the values span 1000x or more", "linear", "logarithmic"],
            style={"button_width": "60px", "description_width": "80px"})
        self._scale_control.add_class("dtm-y-scale")
        self._scale_control.observe(lambda change: self.set_y_scale(change["new"]), names="value")
        # Which metric the chart shows: kept here, so each redraw keeps it (a click on a live chart's legend
        # lasts only until the next redraw: the front-end's plotly tells the kernel nothing).
        self._metric_control = w.Dropdown(description="metric", style={"description_width": "50px"},
                                          layout=w.Layout(width="260px"))
        self._metric_control.add_class("dtm-metric")
        self._sync_metric_control()
        self._metric_control.observe(self._metric_chosen, names="value")
        figures = w.HBox(list(self._outputs.values()), layout=w.Layout(flex_flow="row wrap"))
        widget = w.VBox([w.HBox([self._scale_control, self._metric_control]), figures])
        widget.add_class("dtm-charts")
        return widget

    def _sync_metric_control(self) -> None:
        """The metric menu lists the metrics logged so far and shows the one drawn (caller holds ``_lock``)."""
        control = self._metric_control
        if control is None:
            return
        options, value = tuple(self.training_keys()), self.shown_metric()
        if control.options != options or control.value != value:
            self._syncing = threading.get_ident()  # observers run in the thread that sets the value
            try:
                control.options = options  # first: a value is checked against the options it has
                control.value = value
            finally:
                self._syncing = None

    def _metric_chosen(self, change: dict) -> None:
        if self._syncing != threading.get_ident() and change["new"]:
            self.show_metric(change["new"])

    def training_keys(self) -> list[str]:
        """The function's metrics (those of the training metrics chart), in name order."""
        return sorted(key for key in self.metrics if key not in WORLD_KEYS)

    def shown_metric(self) -> str | None:
        """The training metric drawn (the others are in the legend, hidden): the one chosen in the menu, else
        `default_metric`."""
        if self._chosen_metric in self.metrics:
            return self._chosen_metric
        return default_metric(self.training_keys())

    def show_metric(self, name: str) -> None:
        """Draw ``name`` in the training metrics chart, hide the others (the metric menu's choice)."""
        with self._lock:
            self._chosen_metric = name
            self._apply_visibility()
            self._apply_y_scale()
            self._sync_metric_control()
            self._show(force=True)  # the user's choice: at once

    def _apply_visibility(self) -> None:
        shown = self.shown_metric()
        for trace in self.metrics_figure.data:
            wanted = True if trace.name == shown else "legendonly"
            if trace.visible != wanted:
                trace.visible = wanted
                self._stale.add("metrics")

    def _show(self, force: bool = False) -> None:
        """Redraw the figures that changed (caller holds ``_lock``): at most every ``redraw_s`` (the system
        chart every 2 x ``redraw_s``) unless ``force``. Replacing the Output's one output is the redraw: a
        front-end renders the new bundle, and the widget's state (what a saved notebook keeps) is the latest
        figure only."""
        if not self._outputs or not self._stale:
            return
        now = time.monotonic()
        figures = {"metrics": self.metrics_figure, "system": self.system_figure, "world": self.world_figure}
        # Each redraw is a new plot in the browser (plotly's renderer also makes a PNG of it): the system
        # chart, sampled once a second, is redrawn half as often as the training metrics.
        every = {"metrics": self.redraw_s, "system": 2 * self.redraw_s, "world": self.redraw_s}
        for name in sorted(self._stale):
            if force or now - self._shown_at.get(name, float("-inf")) >= every[name]:
                self._outputs[name].outputs = (figure_bundle(figures[name]),)
                self._stale.discard(name)
                self._shown_at[name] = now

    def trace_data(self, figure: Any, name: str) -> tuple[list, list]:
        """(x, y) of the trace called ``name`` in ``figure``, as the front-end receives them."""
        for trace in figure.data:
            if trace.name == name:
                return list(trace.x or ()), list(trace.y or ())
        raise KeyError(name)

    def set_y_scale(self, scale: str) -> None:
        """The metrics chart's y axis: ``auto`` (log once the shown metric spans 1000x, all > 0), ``linear``,
        ``log``."""
        if scale not in Y_SCALES:
            raise ValueError(f"y scale must be one of {', '.join(Y_SCALES)}, got {scale!r}")
        with self._lock:
            self.y_scale = scale
            self._apply_y_scale()
            self._show(force=True)  # the user's click: at once
        if self._scale_control is not None and self._scale_control.value != scale:
            self._scale_control.value = scale

    def _apply_y_scale(self) -> None:
        if self.y_scale == "auto":
            shown = self.shown_metric()
            log = wants_log_y(self.metrics[shown].y) if shown else False
        else:
            log = self.y_scale == "log"
        wanted = "log" if log else "linear"
        if self.metrics_figure.layout.yaxis.type != wanted:
            self.metrics_figure.layout.yaxis.type = wanted
            self._stale.add("metrics")

    # -- values from the workers, before MLflow has them ------------------------------------------
    def feed(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        """One ``ctx.log`` as the notebook received it (cheap: the poller draws it at its next tick).

        ``timestamp_ms`` is the worker's, the one the tracker gives MLflow; without it the point is stamped
        now and stays beside MLflow's copy until the run's final read."""
        self.training.feed(step, metrics, timestamp_ms)

    @property
    def lags_s(self) -> list[float]:
        """Each point's lag, from ``ctx.log`` on the worker (its timestamp) to the chart data."""
        return self.training.lags_s

    @property
    def fed_shown(self) -> int:
        """The points that reached the chart from `feed` before MLflow had them."""
        return self.training.fed_shown

    def attach(self, client: Any, run_id: str) -> None:
        """The MLflow run exists now: poll it from the next tick on."""
        with self._lock:
            self.client, self.run_id = client, run_id

    # -- reading MLflow --------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Read the run once (or, before `attach`, only what `feed` gave) and update the figures; True if
        anything changed."""
        with self._lock:
            changed_metrics, changed_system, wanted = [], [], {}
            histories: dict[str, list[Point]] = {}
            final = False
            if self.client is not None and self.run_id is not None:
                run = self.client.get_run(self.run_id)
                self.status = run.info.status
                self.start_time_ms = run.info.start_time
                final = self.status in TERMINAL  # every metric is flushed before the status is set
                keys = list(run.data.metrics.keys())
                wanted = system_series([k for k in keys if is_system(k)])
                for key in keys:
                    if is_system(key) and key not in wanted:
                        continue
                    history = self.client.get_metric_history(self.run_id, key)
                    if is_system(key):
                        if self._update_system(key, history):
                            changed_system.append(key)
                    else:
                        histories[key] = sorted(((m.step, m.value, m.timestamp) for m in history),
                                                key=lambda p: (p[0], p[2]))
            changed_metrics = self._merge_metrics(histories, final)
            self.polls += 1
            self._draw_metrics(changed_metrics)
            if changed_system:
                self._draw(self.system_figure, self.system, changed_system, names=wanted)
                title = "System (GPU)" if any("gpu_" in k for k in wanted) else "System (CPU / RAM, no GPU)"
                if self.system_figure.layout.title.text != title:
                    self.system_figure.layout.title.text = title
                self._stale.add("system")
            # The final read, and a read outside the poller (%distribute_show), are shown at once.
            self._show(force=final or not self._live)
            changed = bool(changed_metrics or changed_system)
        if changed and self.on_update is not None:
            self.on_update(self)
        return changed

    def _draw_metrics(self, changed: list[str]) -> None:
        training = [key for key in changed if key not in WORLD_KEYS]
        if training:
            self._draw(self.metrics_figure, self.metrics, training, visible_default=self.shown_metric())
            self._stale.add("metrics")
            self._apply_visibility()
            self._apply_y_scale()
            self._sync_metric_control()
        if len(training) < len(changed) or (training and self.world_shown):  # its line follows the training
            self._draw_world()

    def _draw_world(self) -> None:
        """The world size chart from the run's `WORLD_KEYS` series, shown from its first point on."""
        trained_to = max((max(series.x) for key, series in self.metrics.items() if key not in WORLD_KEYS and series.x),
                         default=None)
        world = {key: self.metrics[key] for key in WORLD_KEYS if key in self.metrics}
        if draw_world(self.world_figure, world, trained_to):
            self.world_shown = True
            self._stale.add("world")
            if "world" in self._outputs:
                self._outputs["world"].layout.display = None

    def _update_system(self, key: str, history: list) -> bool:
        old = self.system.get(key)
        if old is not None and len(old.timestamps) == len(history):
            return False
        history = sorted(history, key=lambda m: (m.timestamp, m.step))
        t0 = self.start_time_ms or (history[0].timestamp if history else 0)
        self.system[key] = Series([(m.timestamp - t0) / 1000.0 for m in history], [m.value for m in history],
                                  [m.timestamp for m in history])
        return True

    def _merge_metrics(self, histories: dict[str, list[Point]], final: bool) -> list[str]:
        """Training metric series = MLflow's history + fed points MLflow does not have yet (none once the
        run is terminal: MLflow is the record). Returns the keys whose series changed."""
        changed = []
        for key, points in self.training.merge(histories, final, self._live).items():
            series = Series([p[0] for p in points], [p[1] for p in points], [p[2] for p in points])
            old = self.metrics.get(key)
            if old is None or old.x != series.x or old.y != series.y:
                self.metrics[key] = series
                changed.append(key)
        return changed

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
                    visible = True if names is not None or key == visible_default else "legendonly"
                    figure.add_scatter(x=list(series.x), y=list(series.y), name=name, mode="lines+markers",
                                       marker=dict(size=4), visible=visible)

    # -- the background poller -------------------------------------------------------------------
    def start(self, first_poll: bool = False) -> "RunCharts":
        """Poll in a background thread until the run is over in MLflow (see `run_ended`) or `stop`;
        ``first_poll``: poll once here first (before the widget is displayed, its views start complete)."""
        if self._thread is None:
            self._live = True
            if first_poll:
                try:
                    self.poll_once()
                except Exception as exc:  # the poller tries again
                    self.error = f"{type(exc).__name__}: {exc}"
            name = f"dtrain-charts-{(self.run_id or 'live')[:8]}"
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()
        return self

    def show_now(self) -> None:
        """Draw at once, in the caller's thread, every value the workers sent (and what MLflow gave so far),
        so it is drawn before the cell returns: a headless executor (nbclient) keeps only the widget messages
        sent while a cell runs, so this is what a notebook executed headless saves. No MLflow read here (a
        dead tracking server is retried for minutes): the poller's final read still reaches a live front-end."""
        with self._lock:
            self._draw_metrics(self._merge_metrics({}, final=False))
            self._show(force=True)

    def run_ended(self, grace_s: float = 30.0) -> None:
        """The driver is done: poll until MLflow marks the run terminal (at most ``grace_s``), then stop.
        A run that never opened in MLflow stops after one last draw of what was fed."""
        self._grace_until = time.monotonic() + (grace_s if self.client is not None else 0.0)
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
                except Exception:  # the poller has nobody to tell: what was drawn stays
                    _log.debug("final MLflow poll failed", exc_info=True)
                break
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        with self._lock:
            self._show(force=True)  # a change held back by `redraw_s` (or a stop before the final read)
            self._live = False


def lag_summary(lags_s: list[float]) -> dict[str, float]:
    """Median, p95 and max of the chart lag samples, in seconds."""
    if not lags_s:
        return {}
    ordered = sorted(lags_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"n": float(len(ordered)), "median_s": pick(0.5), "p95_s": pick(0.95), "max_s": ordered[-1]}
