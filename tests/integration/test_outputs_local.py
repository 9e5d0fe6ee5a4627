"""``ctx.write`` on the local backend, really run (2 worker processes, a real MLflow store): 100,000 rows scored by
2 ranks come back exactly once, joined to the input by ``with_ids``, equal to one process scoring them (1e-6); a rank
killed half-way leaves no output and no file; a restart (``--max-restarts 1``) writes no row twice (docs/data.md, the
way back). A model sharded by FSDP, ``--tp 2`` or ZeRO-3 (no optimizer: scoring) scores every row once (no padding
row, no row from a second tensor-parallel shard), as the unsharded model does in one process. Each bad write's clear
error (naming the output and the column) is tests/unit/test_outputs.py's."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from data_workloads import SCORE_ROWS as ROWS
from data_workloads import assert_scored_once, files_under, score_cell, score_input
from dtrain_magic.errors import RunHung, WorkerError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

@pytest.fixture
def val(shell):
    x = score_input()
    shell.user_ns["val"] = {"x": x}
    return x


def test_a_rank_killed_half_way_leaves_no_output_and_file(shell, val, tmp_path):
    # rank 0 may return before rank 1 dies (no collective between them): then the run fails as hung (its peer gone)
    result = shell.run(score_cell("local", flags="--hang-timeout 5", die="True"))
    assert isinstance(result.error_in_exec, (WorkerError, RunHung)), result.error_in_exec
    assert "preds" not in shell.user_ns
    assert files_under(tmp_path / "dtrain_runs") == []  # no output, no partial file


def test_two_ranks_score_every_row_once_as_one_process_would_through_a_restart(shell, val, tmp_path):
    """--max-restarts 1: rank 1 dies once, after writing; only the second attempt's rows are committed."""
    die = "not os.path.exists('died') and not open('died', 'w').close()"
    result = shell.run(score_cell("local", flags="--max-restarts 1 --result run", die=die))
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


# -- sharded models: every rank takes part in the forward, each row is written once -------------------------------
SHARDED_ROWS, SHARDED_BATCH = 3_001, 500  # odd: the even split pads rank 1's share with one row, left out (pad=False)
WIDTHS = (8, 32, 16, 4)  # Linear-ReLU-Linear-ReLU-Linear: --tp's automatic plan shards a pair and gathers the last

SHARDED_CELL = """%%distribute --backend local -n 2 --seed 0 --no-ui --data val=val --output preds=preds {flags}
import torch

def make_model():
    torch.manual_seed(0)
    widths, layers = {widths}, []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])

def score(ctx):
    model, _ = ctx.prepare(make_model())
    model.eval()
    loader = ctx.data("val", batch_size={batch}, with_ids=True, pad=False)
    sizes = []
    with torch.no_grad():
        for batch in loader:   # every rank the same number of forwards: FSDP gathers its weights in each
            ctx.write("preds", {{"id": batch["row_id"], "pred": model(batch["x"])}})
            sizes.append(len(batch["row_id"]))
    return {{"sizes": sizes, "batches": len(loader), "replicas": ctx.data_parallel_size}}
"""


def sharded_reference(x: np.ndarray) -> np.ndarray:
    """The unsharded model scoring every row in this one process."""
    namespace: dict = {}
    exec(SHARDED_CELL.split("\n", 1)[1].format(widths=WIDTHS, batch=SHARDED_BATCH), namespace)
    with torch.no_grad():
        return namespace["make_model"]()(torch.from_numpy(x)).numpy()


SHARDINGS = [("--strategy fsdp", 2, 2), ("--tp 2", 1, 1), ("--strategy deepspeed --zero 3", 2, 2)]


@pytest.mark.parametrize("flags,replicas,parts", SHARDINGS, ids=["fsdp", "tp", "zero3"])
def test_a_sharded_model_scores_every_row_once_as_the_unsharded_model(shell, tmp_path, flags, replicas, parts):
    """FSDP: each replica its share, rank 1's last batch empty (its one row was the even split's padding) and still
    run through the forward. --tp 2: one replica, both shards read the same batches, only shard 0 writes them."""
    x = np.random.default_rng(1).standard_normal((SHARDED_ROWS, WIDTHS[0])).astype(np.float32)
    shell.user_ns["val"] = {"x": x}
    result = shell.run(SHARDED_CELL.format(flags=flags, widths=WIDTHS, batch=SHARDED_BATCH))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["replicas"] for v in values] == [replicas] * 2
    assert all(len(v["sizes"]) == v["batches"] == values[0]["batches"] for v in values), values
    if replicas == 2:  # 1,501 rows each by the even split, rank 1's last one padding: left out, an empty batch
        assert values[0]["sizes"] == [500, 500, 500, 1] and values[1]["sizes"] == [500, 500, 500, 0], values
    else:  # both shards of the one replica read every row, in the same batches
        assert values[0]["sizes"] == values[1]["sizes"] and sum(values[0]["sizes"]) == SHARDED_ROWS, values
    output = result.result.outputs["preds"]
    assert len([n for n in os.listdir(output.path) if n.endswith(".parquet")]) == parts  # tp: shard 1 wrote none
    assert result.result.tables["preds"] is shell.user_ns["preds"]  # --output's table, also in result.tables
    table = shell.user_ns["preds"].to_table()
    ids = table.column("id").to_numpy()
    assert output.rows == len(ids) == SHARDED_ROWS and np.array_equal(np.sort(ids), np.arange(SHARDED_ROWS))
    got = np.stack(table.column("pred").to_numpy(zero_copy_only=False))
    # fp32; --tp sums each row-wise layer's two halves in another order than one process: 1e-6 holds (observed below)
    worst = float(np.abs(got - sharded_reference(x)[ids]).max())
    print(f"{flags}: max |pred - pred_1proc| = {worst:.2e}")
    assert worst <= 1e-6
