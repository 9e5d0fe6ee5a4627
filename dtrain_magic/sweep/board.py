"""What a sweep's panel shows, as data: every trial's ``--metric`` curve, the trials' table and the best trial, and
at the end the parameters against the metric. Pure (no widget, no plotly import): the figures are plotly figure
dicts (``{"data": [...], "layout": {...}}``, what ``plotly.graph_objects.Figure`` takes and what the panel sends as
plotly's MIME bundle), built from what the sweep's runner feeds: `trial_started`, `trial_value` (rank 0's
``--metric`` as each value reaches the notebook), `trial_ended`. Thread-safe: each trial's thread feeds it, the
panel's thread reads it.
"""

from __future__ import annotations

import html
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

RUNNING = "RUNNING"
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")  # plotly's default sequence: a trial keeps its colour by number


@dataclass
class TrialRow:
    """One trial as the panel shows it. ``number``: Optuna's (from 0); ``value``: its result (FINISHED), else None."""

    number: int
    params: dict[str, Any]
    status: str = RUNNING
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    value: float | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float | None = None  # once ended
    note: str = ""  # PRUNED at step s, an error's line

    def best(self, minimize: bool) -> float | None:
        """Its best ``--metric`` value so far (finite values only)."""
        finite = [v for v in self.values if math.isfinite(v)]
        if self.value is not None and math.isfinite(self.value):
            finite.append(self.value)
        if not finite:
            return None
        return min(finite) if minimize else max(finite)

    def elapsed(self, now: float | None = None) -> float:
        return self.seconds if self.seconds is not None else (now or time.monotonic()) - self.started


def params_text(params: dict[str, Any]) -> str:
    """``lr=0.01 batch=32``: floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: plotly draws None as a gap."""
    return value if math.isfinite(value) else None


class SweepBoard:
    """The sweep as it goes. ``metric``: the ``--metric`` name; ``minimize``: ``--mode min``; ``total``: trials."""

    def __init__(self, metric: str, minimize: bool = True, total: int = 0):
        self.metric, self.minimize, self.total = metric, minimize, total
        self.trials: dict[int, TrialRow] = {}
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change: the panel redraws when it moved

    # -- fed by the sweep's runner (each trial's thread) ----------------------------------------------
    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        with self._lock:
            self.trials[number] = TrialRow(number, dict(params))
            self.version += 1

    def trial_value(self, number: int, step: int, value: float) -> None:
        """Rank 0's ``--metric`` at ``step``, as it reached the notebook."""
        with self._lock:
            row = self.trials.get(number)
            if row is not None:
                row.steps.append(int(step))
                row.values.append(float(value))
                self.version += 1

    def trial_ended(self, number: int, status: str, value: float | None, seconds: float, note: str = "") -> None:
        """``status``: FINISHED, PRUNED, FAILED or INTERRUPTED; ``value``: a FINISHED trial's result."""
        with self._lock:
            row = self.trials.get(number)
            if row is not None:
                row.status, row.value, row.seconds, row.note = status, value, seconds, note
                self.version += 1

    # -- read by the panel --------------------------------------------------------------------------
    def best_number(self) -> int | None:
        """The best FINISHED trial (by its value, as ``--mode`` says), else None."""
        with self._lock:
            done = [r for r in self.trials.values() if r.status == "FINISHED" and r.value is not None
                    and math.isfinite(r.value)]
        if not done:
            return None
        pick = min if self.minimize else max
        return pick(done, key=lambda r: r.value).number

    def rows(self) -> list[dict[str, Any]]:
        """The table: one dict per trial in number order (``trial`` from 1, ``status``, ``params``, ``best``: its best
        value so far, ``steps``: values received, ``seconds``, ``is_best``)."""
        best = self.best_number()
        now = time.monotonic()
        with self._lock:
            rows = sorted(self.trials.values(), key=lambda r: r.number)
            return [{"trial": r.number + 1, "status": r.status + (f" ({r.note})" if r.note else ""),
                     "params": params_text(r.params), "best": r.best(self.minimize),
                     "steps": (r.steps[-1] + 1) if r.steps else 0, "seconds": round(r.elapsed(now), 1),
                     "is_best": r.number == best} for r in rows]

    def table_html(self) -> str:
        """The table as HTML, the best trial's row highlighted."""
        head = "".join(f"<th>{h}</th>" for h in ("trial", "status", "params", f"best {html.escape(self.metric)}",
                                                 "steps", "time"))
        body = []
        for row in self.rows():
            best = "" if row["best"] is None else f"{row['best']:.4g}"
            style = ' class="dtm-best" style="font-weight:bold;background:#fff3b0"' if row["is_best"] else ""
            cells = (row["trial"], html.escape(row["status"]), html.escape(row["params"]), best, row["steps"],
                     f"{row['seconds']:.1f} s")
            body.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return (f'<table class="dtm-sweep-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
                "</table>")

    def curves_figure(self) -> dict[str, Any]:
        """Every trial's ``--metric`` against step, overlaid: a trace per trial named by its number and params
        (legend and hover), the best trial's line thicker; log y when the values span three decades."""
        best = self.best_number()
        with self._lock:
            rows = sorted(self.trials.values(), key=lambda r: r.number)
            data = [{"type": "scatter", "mode": "lines", "x": list(r.steps), "y": [_finite(v) for v in r.values],
                     "name": f"trial {r.number + 1}: {params_text(r.params)}",
                     "line": {"color": _COLOURS[r.number % len(_COLOURS)], "width": 4 if r.number == best else 1.5},
                     "hovertemplate": (f"trial {r.number + 1} ({html.escape(r.status)})<br>"
                                       f"{html.escape(params_text(r.params))}<br>step %{{x}}<br>"
                                       f"{html.escape(self.metric)} %{{y:.4g}}<extra></extra>")}
                    for r in rows]
            values = [v for r in rows for v in r.values if math.isfinite(v)]
        log_y = bool(values) and min(values) > 0 and max(values) / min(values) >= 1e3
        layout = {"title": {"text": f"{self.metric} per trial"}, "template": "plotly_white", "height": 360,
                  "xaxis": {"title": {"text": "step"}},
                  "yaxis": {"title": {"text": self.metric}, "type": "log" if log_y else "linear"},
                  "legend": {"title": {"text": "trials"}}, "margin": {"l": 60, "r": 20, "t": 40, "b": 40}}
        return {"data": data, "layout": layout}

    def params_figure(self) -> dict[str, Any] | None:
        """The FINISHED trials' parameters against the metric: plotly's parallel coordinates, a dimension per
        parameter (a categorical one by its values' order) and the metric last, coloured by the metric. None
        before any trial finished."""
        with self._lock:
            done = sorted((r for r in self.trials.values() if r.status == "FINISHED" and r.value is not None
                           and math.isfinite(r.value)), key=lambda r: r.number)
        if not done:
            return None
        names = list(dict.fromkeys(name for r in done for name in r.params))
        dimensions = [_dimension(name, [r.params.get(name) for r in done]) for name in names]
        values = [r.value for r in done]
        dimensions.append({"label": self.metric, "values": values})
        line = {"color": values, "colorscale": "Viridis", "reversescale": self.minimize, "showscale": True,
                "colorbar": {"title": {"text": self.metric}}}
        return {"data": [{"type": "parcoords", "line": line, "dimensions": dimensions}],
                "layout": {"title": {"text": f"parameters against {self.metric} ({len(done)} finished trials)"},
                           "template": "plotly_white", "height": 360, "margin": {"l": 60, "r": 60, "t": 60, "b": 30}}}


def _dimension(name: str, values: list[Any]) -> dict[str, Any]:
    """A parallel-coordinates axis: numbers as they are (log-scaled learning rates read best as they are too),
    anything else by its position among the distinct values, labelled with them."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return {"label": name, "values": [float(v) for v in values]}
    labels = list(dict.fromkeys(str(v) for v in values))
    return {"label": name, "values": [labels.index(str(v)) for v in values], "tickvals": list(range(len(labels))),
            "ticktext": labels}
