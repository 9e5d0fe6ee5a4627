"""The quickstart notebook, executed through a real Jupyter kernel (nbclient), and its MLflow run."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_runs_through_a_real_kernel(tmp_path):
    from leftovers import new_tag, tagged_env

    tag = new_tag()  # inherited by the kernel and everything it starts
    env = tagged_env(tag)
    env.pop("MLFLOW_TRACKING_URI", None)  # the notebook must use the embedded default: ./mlflow.db
    notebook = tmp_path / "quickstart.ipynb"
    notebook.write_bytes((ROOT / "notebooks" / "quickstart.ipynb").read_bytes())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_notebook.py"), str(notebook), "--cwd", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "executed notebook" in proc.stdout and "MLflow store: sqlite:///" in proc.stdout

    executed = nbformat.read(tmp_path / "quickstart.out.ipynb", as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "[rank 0] epoch 4" in text  # worker output streamed into the cell with its rank
    assert "FINISHED 40 loss points" in text
    run_cell = next(c for c in code if c.source.startswith("%%distribute"))
    reprs = [o["data"]["text/plain"] for o in run_cell.outputs if o.output_type == "execute_result"]
    assert reprs and reprs[0].startswith("RunResult(backend=local, strategy=ddp, world_size=2")

    from mlflow import MlflowClient

    assert (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert len(history) == 40 and history[-1].value < history[0].value
    assert_nothing_left(tag)


def assert_nothing_left(tag: str, within_s: float = 10.0) -> None:
    """The kernel is gone: so is every process it started (the fork server, its workers)."""
    from leftovers import wait_until_none_left

    left = wait_until_none_left(tag, within_s)
    assert left == [], f"processes outlived the notebook's kernel: {left}"
