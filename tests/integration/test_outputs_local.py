"""``ctx.write`` on the local backend, really run (2 worker processes, a real MLflow store): 100,000 rows scored by
2 ranks come back exactly once, joined to the input by ``with_ids``, equal to one process scoring them (1e-6); a rank
killed half-way leaves no output and no file; a restart (``--max-restarts 1``) writes no row twice (docs/data.md, the
way back). Each bad write's clear error (naming the output and the column) is tests/unit/test_outputs.py's."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from dtrain_magic.errors import RunHung, WorkerError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 100_000

SCORE_CELL = """%%distribute --backend local -n 2 --seed 0 --no-ui --data val=val --output preds=preds {flags}
import os, torch
torch.manual_seed(0)
WEIGHTS = torch.nn.Linear(8, 2).state_dict()   # the fixed model, shipped with the function

def score(ctx):
    model = torch.nn.Linear(8, 2)
    model.load_state_dict(WEIGHTS)
    batches = 0
    with torch.no_grad():
        for batch in ctx.data("val", batch_size=5000, with_ids=True):
            ctx.write("preds", {{"id": batch["row_id"], "pred": model(batch["x"])}})
            batches += 1
            if ctx.rank == 1 and batches == 5 and {die}:
                os._exit(3)
    return batches
"""


@pytest.fixture
def val(shell):
    x = np.random.default_rng(0).standard_normal((ROWS, 8)).astype(np.float32)
    shell.user_ns["val"] = {"x": x}
    return x


def files_under(folder) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]


def assert_scored_once(table, x: np.ndarray) -> None:
    """Every input row once, its prediction equal to one process scoring the same rows (fp32, 1e-6)."""
    ids = table.column("id").to_numpy()
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    with torch.no_grad():
        expected = model(torch.from_numpy(x[ids])).numpy()
    got = np.stack(table.column("pred").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_a_rank_killed_half_way_leaves_no_output_and_file(shell, val, tmp_path):
    # rank 0 may return before rank 1 dies (no collective between them): then the run fails as hung (its peer gone)
    result = shell.run(SCORE_CELL.format(flags="--hang-timeout 5", die="True"))
    assert isinstance(result.error_in_exec, (WorkerError, RunHung)), result.error_in_exec
    assert "preds" not in shell.user_ns
    assert files_under(tmp_path / "dtrain_runs") == []  # no output, no partial file


def test_two_ranks_score_every_row_once_as_one_process_would_through_a_restart(shell, val, tmp_path):
    """--max-restarts 1: rank 1 dies once, after writing; only the second attempt's rows are committed."""
    die = "not os.path.exists('died') and not open('died', 'w').close()"
    result = shell.run(SCORE_CELL.format(flags="--max-restarts 1 --result run", die=die))
    assert result.error_in_exec is None, result.error_in_exec
    assert (tmp_path / "died").exists()
    run = shell.user_ns["run"]
    output = run.outputs["preds"]
    assert output.rows == ROWS and output.columns == (("id", "int64"), ("pred", "fixed_size_list<item: float>[2]"))
    assert isinstance(shell.user_ns["preds"], ds.Dataset)  # --output preds=preds off Spark and Ray
    assert_scored_once(shell.user_ns["preds"].to_table(), val)
    assert output.path == os.path.join(run.checkpoint_root, "outputs", "preds")
    names = sorted(os.listdir(output.path))  # one part per rank (of the last attempt), and the marker
    assert names[0] == "_SUCCESS" and [n[:12] for n in names[1:]] == ["part-r00000-", "part-r00001-"], names
    assert os.listdir(os.path.dirname(output.path)) == ["preds"]  # the staging folder is gone
    assert len(output.to_pandas()) == ROWS
