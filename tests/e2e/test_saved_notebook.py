"""A notebook with the panel on, executed headless by ``jupyter nbconvert --execute`` (a real kernel), saves
small: the charts' data once, never plotly's JavaScript bundle (4.9 MB per copy). Its saved widget state holds
the run's final charts, reachable from what the cell displays, so a front-end that reopens it without the
run's kernel draws them (tests/e2e/test_browser.py opens such a notebook in JupyterLab)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

REPO = Path(__file__).resolve().parents[2]
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STEPS = 20
MAX_BYTES = 3_000_000

CELL = f"""%%distribute --ui --backend local -n 2 --cpu
def train(ctx):
    for step in range({STEPS}):
        ctx.log(loss=1.0 / (step + 1), lr=0.1)
    return ctx.rank
"""


def logged_losses() -> list[float]:
    return [1.0 / (step + 1) for step in range(STEPS)]


def execute_headless(folder: Path, env: dict[str, str] | None = None) -> Path:
    """Write the notebook to ``folder`` and execute it with ``jupyter nbconvert --execute --to notebook``;
    the executed notebook's path."""
    source = folder / "panel_headless.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%load_ext dtrain_magic"),
                                               nbformat.v4.new_code_cell(CELL)])
    notebook.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nbformat.write(notebook, source)
    env = dict(env or os.environ)
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{folder / 'mlflow.db'}")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = folder / "panel_headless.out.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--execute", "--to", "notebook",
         "--ExecutePreprocessor.timeout=300", "--output", out.name, str(source)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def widget_states(notebook) -> dict[str, dict]:
    """model id -> the saved state of each widget (nbclient's ``metadata.widgets``)."""
    saved = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return {model_id: entry["state"] for model_id, entry in saved.items()}


def displayed_models(notebook, states: dict[str, dict]) -> set[str]:
    """Every widget a front-end draws for the cells' outputs: the displayed views and their descendants."""
    todo = [o["data"][WIDGET_VIEW]["model_id"] for cell in notebook.cells for o in cell.get("outputs", [])
            if WIDGET_VIEW in o.get("data", {})]
    seen: set[str] = set()
    while todo:
        model_id = todo.pop()
        if model_id in seen or model_id not in states:
            continue
        seen.add(model_id)
        for child in states[model_id].get("children", []):
            todo.append(child.removeprefix("IPY_MODEL_"))
    return seen


def saved_figures(states: dict[str, dict], models: set[str]) -> dict[str, dict]:
    """Chart title -> the plotly figure (mime bundle) an Output widget among ``models`` shows."""
    figures = {}
    for model_id in models:
        for output in states[model_id].get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY_MIME)
            if figure is not None:
                figures[figure["layout"]["title"]["text"]] = figure
    return figures


def test_headless_run_saves_a_small_notebook_with_its_final_charts(headless_notebook):
    """(The notebook is executed once per session by the ``headless_notebook`` fixture, tests/e2e/conftest.py.)"""
    from leftovers import wait_until_none_left

    out = headless_notebook.path
    size = out.stat().st_size
    print(f"saved notebook: {size / 1e6:.2f} MB, executed in {headless_notebook.executed_s:.1f} s")
    assert size < MAX_BYTES, f"the executed notebook is {size / 1e6:.1f} MB"

    notebook = nbformat.read(out, as_version=4)
    assert not [o for c in notebook.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    states = widget_states(notebook)
    # no widget carries a JavaScript library: the largest state is the charts' data or the panel's own module
    biggest = max(len(json.dumps(state)) for state in states.values())
    assert biggest < 200_000, f"a saved widget state of {biggest} characters"

    figures = saved_figures(states, displayed_models(notebook, states))
    assert set(figures) >= {"Training metrics"} and any(t.startswith("System") for t in figures), set(figures)
    traces = {trace["name"]: trace for trace in figures["Training metrics"]["data"]}
    assert traces["loss"]["x"] == list(range(STEPS))
    assert traces["loss"]["y"] == pytest.approx(logged_losses())
    assert traces["loss"].get("visible", True) is True and traces["lr"]["visible"] == "legendonly"
    assert wait_until_none_left(headless_notebook.tag, 10.0) == []
