"""The notebook front-end of dtrain_magic (needs the ``ui`` extras: ipywidgets, plotly, anywidget).

- `panel.show_panel`: ``%%distribute --configure`` (controls prefilled from the flags, memory estimate,
  Run in the background, the equivalent flag line). `panel.PanelState` is its pure, testable logic.
- `monitor.MonitorObserver`: the `RunObserver` of ``--ui`` runs (per-rank status, progress, Stop,
  MLflow link, live charts) — it also keeps printing plain text, so headless kernels (nbclient) still
  get the worker output in the cell.
- `charts.RunCharts`: plotly charts (MIME bundles in ``Output``s) fed from the MLflow run by a background poller.
- `magics.UIMagics`: ``%distribute_show RUN_ID``.

Importing this package imports ipywidgets (not plotly/anywidget); a missing extra raises ImportError,
which ``dtrain_magic.notebook.magic.make_observer`` turns into the plain-text observer.
"""

from __future__ import annotations

import ipywidgets  # noqa: F401  (fail early, as ImportError, when the ui extras are missing)
