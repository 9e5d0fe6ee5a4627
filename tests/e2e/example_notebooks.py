"""An example notebook of notebooks/ executed as a user runs it: through a real Jupyter kernel
(scripts/run_notebook.py, nbclient), in a fresh working directory, every process it starts tagged."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ExecutedNotebook:
    notebook: nbformat.NotebookNode  # the executed copy, with its outputs
    stdout: str  # run_notebook.py's: every cell's stream output, then where the results are
    tag: str  # in the environment of the kernel and everything it started (tests/leftovers.py)

    @property
    def code_cells(self) -> list:
        return [c for c in self.notebook.cells if c.cell_type == "code"]

    def errors(self) -> list:
        return [o for c in self.code_cells for o in c.outputs if o.output_type == "error"]

    def text(self) -> str:
        """What the cells printed, in order."""
        return "\n".join(o.get("text", "") for c in self.code_cells for o in c.outputs if o.output_type == "stream")

    def results(self, starts_with: str) -> list[str]:
        """The displayed values (execute_result) of the first cell whose source starts so."""
        cell = next(c for c in self.code_cells if c.source.startswith(starts_with))
        return [o["data"]["text/plain"] for o in cell.outputs if o.output_type == "execute_result"]


def execute_example(name: str, cwd: Path) -> ExecutedNotebook:
    """notebooks/NAME.ipynb copied to ``cwd`` and run there, the kernel's working directory; MLflow at its
    embedded default (./mlflow.db). A failing cell fails the test with the notebook's output."""
    from leftovers import new_tag, tagged_env

    tag = new_tag()  # inherited by the kernel and everything it starts
    env = tagged_env(tag)
    env.pop("MLFLOW_TRACKING_URI", None)
    notebook = cwd / f"{name}.ipynb"
    notebook.write_bytes((ROOT / "notebooks" / f"{name}.ipynb").read_bytes())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_notebook.py"), str(notebook), "--cwd", str(cwd)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "executed notebook" in proc.stdout
    return ExecutedNotebook(nbformat.read(cwd / f"{name}.out.ipynb", as_version=4), proc.stdout, tag)


def assert_nothing_left(tag: str, within_s: float = 10.0) -> None:
    """The kernel is gone: so is every process it started (the fork server, its workers, Spark's JVM)."""
    from leftovers import wait_until_none_left

    left = wait_until_none_left(tag, within_s)
    assert left == [], f"processes outlived the notebook's kernel: {left}"
