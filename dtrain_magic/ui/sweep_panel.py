"""The live panel of a sweep (``%%distribute --sweep`` with the UI on): every trial's ``--metric`` curve overlaid in
one chart, the trials' table with the best trial highlighted, Stop for the sweep and for one trial, and at the end a
parallel-coordinates figure of the parameters against the metric. It draws a `sweep.board.SweepBoard` (the data) and
holds no state of its own.

Like the run monitor's charts (`charts`), each figure is sent as plotly's MIME bundle in an ``ipywidgets.Output``
(not a ``FigureWidget``, whose saved state carries plotly's whole bundle), replaced when the board changed, at most
every ``redraw_s`` by a thread of its own, and once more at the end. The trials' lines are printed as well (a
headless kernel shows no widget; the text is there either way).

Stop: the button's click reaches the kernel while the cell blocks it through a subshell (`_kernel`), and calls
``on_stop`` (the sweep stops every trial and raises `RunInterrupted`); Stop trial calls ``on_stop_trial`` with the
trial chosen among the running ones (it stops as a pruned trial stops: every rank after the same step).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import ipywidgets as w

from . import _kernel
from .charts import PLOTLY_MIME


def bundle(figure: dict[str, Any], text: str) -> dict[str, Any]:
    """A plotly figure dict as a display_data output (``text``: what a front-end without plotly shows); checked to
    be plain JSON (no NaN: the board leaves gaps as None)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: json.loads(json.dumps(figure, allow_nan=False)), "text/plain": text}}


class SweepPanel:
    """The sweep's panel, shown at once (``display``), redrawn from ``board`` (a `sweep.board.SweepBoard`, handed in by
    the sweep that opens the panel: the UI does not import the sweep above it) until `close`."""

    def __init__(self, board: Any, on_stop: Callable[[], None] | None = None, display: bool = True,
                 redraw_s: float = 0.5, on_stop_trial: Callable[[int], None] | None = None):
        self.board, self.on_stop, self.on_stop_trial = board, on_stop, on_stop_trial
        self.title = w.HTML(f"<b>sweep</b>: {board.total} trial(s), --metric {board.metric}")
        self.curves = w.Output()
        self.table = w.HTML(board.table_html())
        self.params = w.Output()
        self.stop_button = w.Button(description="Stop sweep", button_style="danger", icon="stop")
        self.stop_button.on_click(self._stop_clicked)
        self.trial_choice = w.Dropdown(options=[], description="trial", layout=w.Layout(width="160px"))
        self.stop_trial_button = w.Button(description="Stop trial", icon="stop", disabled=True)
        self.stop_trial_button.on_click(self._stop_trial_clicked)
        buttons = w.HBox([self.stop_button, self.trial_choice, self.stop_trial_button])
        self.container = w.VBox([self.title, buttons, self.curves, self.table, self.params])
        self.container.add_class("dtm-sweep-panel")
        self._shown = -1
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._redraw_s = redraw_s
        for control in (self.stop_button, self.trial_choice, self.stop_trial_button):
            _kernel.route_to_subshell(control)  # seen while the cell keeps the kernel busy
        self._thread = threading.Thread(target=self._loop, name="dtrain-sweep-panel", daemon=True)
        self._thread.start()
        if display:
            from IPython.display import display as show

            show(self.container)

    def _stop_clicked(self, _button: Any) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping..."
        if self.on_stop is not None:
            self.on_stop()

    def _stop_trial_clicked(self, _button: Any) -> None:
        number = self.trial_choice.value
        if number is not None and self.on_stop_trial is not None:
            self.on_stop_trial(number)

    def _running_choices(self) -> None:
        """The Stop trial dropdown: the trials running now (label: the table's number and params)."""
        options = [(f"{r['trial']}: {r['params']}", r["trial"] - 1) for r in self.board.rows()
                   if r["status"] == "RUNNING"]
        if options != list(self.trial_choice.options):
            chosen = self.trial_choice.value
            self.trial_choice.options = options
            if options and chosen not in [number for _, number in options]:
                self.trial_choice.index = 0  # (new options leave no choice: the first running trial is chosen)
        self.stop_trial_button.disabled = not options

    def _loop(self) -> None:
        while not self._closed.wait(self._redraw_s):
            self.draw()

    def draw(self, final: bool = False) -> None:
        """Redraw what changed since the last draw (``final``: also the parameters' figure, and the Stop button off)."""
        with self._lock:
            version = self.board.version
            if version != self._shown:
                self._shown = version
                rows = self.board.rows()
                text = "\n".join(f"trial {r['trial']} {r['status']} {r['params']} best={r['best']}" for r in rows)
                self.curves.outputs = (bundle(self.board.curves_figure(), text),)
            self._running_choices()
            table = self.board.table_html()  # a running trial's time moves even when no value came
            if table != self.table.value:
                self.table.value = table
            if final:
                figure = self.board.params_figure()
                if figure is not None:
                    self.params.outputs = (bundle(figure, figure["layout"]["title"]["text"]),)
                self.stop_button.disabled = self.stop_trial_button.disabled = True

    def close(self) -> None:
        """The sweep ended: the last draw, the parameters' figure, the thread stopped."""
        self._closed.set()
        self._thread.join(2.0)
        self.draw(final=True)
