"""The quickstart notebook, executed through a real Jupyter kernel (nbclient), and its MLflow run."""

import pytest
from example_notebooks import assert_nothing_left, execute_example

pytestmark = pytest.mark.slow


def test_quickstart_notebook_runs_through_a_real_kernel(tmp_path):
    executed = execute_example("quickstart", tmp_path)
    assert "MLflow store: sqlite:///" in executed.stdout  # the notebook used the embedded default: ./mlflow.db
    assert not executed.errors(), executed.errors()
    text = executed.text()
    assert "[rank 0] epoch 4" in text  # worker output streamed into the cell with its rank
    assert "FINISHED 40 loss points" in text
    reprs = executed.results("%%distribute")
    assert reprs and reprs[0].startswith("RunResult(backend=local, strategy=ddp, world_size=2")

    from mlflow import MlflowClient

    assert (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert len(history) == 40 and history[-1].value < history[0].value
    assert_nothing_left(executed.tag)
