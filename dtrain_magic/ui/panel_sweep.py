"""The ``--configure`` panel's sweep box: a space, the metric it compares and how many trials; Run sweep runs the
cell's function once per trial with the panel's settings (docs/sweeps.md), the sweep's panel under it.

`SweepBox` holds the widgets and reads them into validated `sweep.options.SweepOptions` (a bad space or a missing
metric is said in the box, nothing runs); the configure panel (`ui.panel.ConfigurePanel.run_sweep`) does the rest as
its Run does: the capture on the kernel's thread, the trials in the background.
"""

from __future__ import annotations

import shlex
from typing import Any

from ..sweep.options import SweepOptions, options_from
from ..sweep.space import parse_space


class SweepBox:
    """The sweep box's widgets (``widget``) and what they say (`options`, `words`)."""

    def __init__(self, w: Any, style: dict):
        self.space = w.Text(description="sweep", placeholder="lr=loguniform(1e-4,1e-1) batch=choice(16,32)",
                            style=style, layout=w.Layout(width="60%"))
        self.space.add_class("dtm-sweep-space")
        self.metric = w.Text(description="metric", placeholder="val_loss", style={"description_width": "50px"},
                             layout=w.Layout(width="20%"))
        self.metric.add_class("dtm-sweep-metric")
        self.trials = w.IntText(value=0, description="trials", style={"description_width": "50px"},
                                tooltip="how many trials; 0: the grid's size (a space of grid(...) words)",
                                layout=w.Layout(width="15%"))
        self.trials.add_class("dtm-sweep-trials")
        self.button = w.Button(description="Run sweep", icon="sliders", button_style="warning",
                               tooltip="run the cell once per trial of the space, with the settings above")
        self.button.add_class("dtm-run-sweep")
        self.problem = w.HTML()
        self.widget = w.VBox([w.HBox([self.space, self.metric, self.trials]), w.HBox([self.button, self.problem])])
        self.widget.add_class("dtm-sweep-box")

    def options(self) -> SweepOptions:
        """The box's sweep, validated (`ConfigError` naming the flag: a bad space, no metric)."""
        space = self.space.value.strip()
        settings = options_from({"sweep": space or None, "metric": self.metric.value.strip() or None,
                                 "trials": self.trials.value or None})
        parse_space(settings.space)  # a bad space is said before anything runs
        return settings

    def words(self) -> str:
        """The sweep's flags for the equivalent line (empty when no space is given)."""
        space = self.space.value.strip()
        if not space:
            return ""
        words = f" --sweep {shlex.quote(space)}"
        if self.metric.value.strip():
            words += f" --metric {self.metric.value.strip()}"
        if self.trials.value:
            words += f" --trials {self.trials.value}"
        return words
