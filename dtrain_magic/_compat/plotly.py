"""plotly's private parts, written against plotly 7.1 (constraints.txt: 7.1.0). Used by ``ui/charts.py``.

- `FIGURE_WIDGET_MODULE`: the module ``go.FigureWidget`` lives in, to tell whether it is imported yet.
  **Fallback** if renamed: it is imported again (a no-op).
- `set_view_state`: ``FigureWidget._widget_data`` / ``_widget_layout``, the state a *new* front-end view starts
  from, set from ``_data`` / ``_layout_obj._props`` (for a chart displayed before its traces were added, or a
  notebook reopened). **Gated** (`can_set_view_state`): on an unknown version (without the opt-in) or without those
  attributes, not kept current (such a late view may start empty until the next update).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from . import Library

PLOTLY = Library(key="plotly", title="plotly", module="plotly", known=("7.1",), tested="7.1.0",
                 requirement="plotly==7.1.0")
FIGURE_WIDGET_MODULE = "plotly.graph_objs._figurewidget"


def can_set_view_state(figure: Any) -> bool:
    return PLOTLY.allowed() and all(
        hasattr(figure, name) for name in ("_widget_data", "_widget_layout", "_data", "_layout_obj")
    )


def set_view_state(figure: Any) -> None:
    """Make the state a new view of ``figure`` starts from equal to the figure now (see `can_set_view_state`)."""
    figure._widget_layout = deepcopy(figure._layout_obj._props)
    figure._widget_data = deepcopy(figure._data)
