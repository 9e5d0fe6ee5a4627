"""The quickstart notebook, executed through a real Jupyter kernel (nbclient), and its MLflow run."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_runs_through_a_real_kernel(tmp_path):
    env = dict(os.environ)
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
    assert_no_worker_left_in(tmp_path)


def assert_no_worker_left_in(directory: Path, within_s: float = 10.0) -> None:
    """The kernel is gone: so is every local worker it started (idle pool, or still tearing down)."""
    import time

    import psutil

    def left():
        found = []
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            try:
                if "dtrain_magic.worker" in " ".join(proc.info["cmdline"] or []) and (proc.info["cwd"] or "").startswith(
                    str(directory)
                ) and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
            except psutil.Error:
                pass
        return found

    deadline = time.monotonic() + within_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == [], "local workers outlived the notebook's kernel"
