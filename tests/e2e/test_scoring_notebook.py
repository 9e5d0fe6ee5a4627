"""The scoring notebook (issue #39's example), executed through a real Jupyter kernel (nbclient): a model trained
on a Spark DataFrame scores the validation DataFrame, whose rows come back as Parquet joined to it in Spark."""

import math
import re
from pathlib import Path

import pytest
from example_notebooks import assert_nothing_left, execute_example

pytestmark = pytest.mark.slow


def test_scoring_notebook_joins_every_validation_row_to_its_prediction_in_spark(tmp_path):
    executed = execute_example("scoring", tmp_path)
    assert not executed.errors(), executed.errors()
    text = executed.text()
    assert "[rank 0] epoch 2" in text  # the training ran on the ranks, printing into its cell
    assert (tmp_path / "scoring_model" / "model.safetensors").exists()  # what the scoring run loaded

    # The notebook's own join and metric, computed by Spark in the kernel, against the rows the ranks were given.
    val_rows = int(re.search(r"data val: staged ([\d,]+) rows", text).group(1).replace(",", ""))
    assert 800 < val_rows < 1200  # about a fifth of the 5000 rows
    scored, rows, ids = map(int, re.search(r"(\d+) of (\d+) validation rows scored, (\d+) distinct ids",
                                           text).groups())
    assert scored == rows == ids == val_rows  # the left join: every validation row has exactly one prediction
    rmse, label_std = map(float, re.search(r"RMSE (\S+) \(predicting the mean: (\S+)\)", text).groups())
    assert math.isfinite(rmse) and rmse < 0.2 * label_std  # an untrained model scores about label_std

    # What Spark read: the committed Parquet, read here without Spark: the same rows, each id once, nothing staged.
    written, path = re.search(r"output preds: ([\d,]+) rows written by the ranks, committed at (\S+)", text).groups()
    assert int(written.replace(",", "")) == val_rows
    assert_committed_once(Path(path), val_rows)
    assert executed.results("%%distribute --backend spark -n 2 --data val")[0].endswith(
        f"outputs={{preds={val_rows:,} rows}})")
    assert_nothing_left(executed.tag)


def assert_committed_once(path: Path, rows: int) -> None:
    import pyarrow.parquet as pq

    ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == rows
    assert (path / "_SUCCESS").exists()
    assert not (path.parent / "_staging").exists()  # the ranks' staging folder went with the commit
