"""plotly's private parts, written against plotly 7.1 (constraints.txt: 7.1.0). Used by ``ui/charts.py``.

- `FIGURE_MODULE`: the module ``go.Figure`` lives in, to tell whether plotly's figure classes are imported yet
  (`charts.preload_plotly`). **Fallback** if renamed: they are imported again in the background (a no-op).

The charts use plotly's public API only otherwise (``go.Figure``, ``plotly.io.to_json``, the
``application/vnd.plotly.v1+json`` MIME type); no ``FigureWidget`` internals.
"""

from __future__ import annotations

from . import Library

PLOTLY = Library(key="plotly", title="plotly", module="plotly", known=("7.1",), tested="7.1.0",
                 requirement="plotly==7.1.0")
FIGURE_MODULE = "plotly.graph_objs._figure"
