"""``--data`` on the local backend, really run (2 worker processes, a real MLflow store): every kind of notebook
object and a Parquet directory read exactly once per epoch in the documented order, the staged copy reused by a
re-run and removed once unused, DDP through ``ctx.data`` equal to one process on the same rows (fp32, 1e-5), a
restart resuming the data position where the checkpoint left it, and bad input stopped before launch."""

from __future__ import annotations

import os
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_workloads import assert_documented_order, assert_exactly_once, read_cell
from dtrain_magic.data.split import epoch_rows
from dtrain_magic.driver.staging import staging_area
from dtrain_magic.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 203  # not a multiple of the ranks nor of the batches: the rule pads or drops


@pytest.fixture
def sources(shell, tmp_path):
    """Notebook objects of every in-memory kind, and a Parquet directory of two files, all with an ``id`` column."""
    ids = np.arange(ROWS, dtype=np.int64)
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    table = pa.table({"id": ids + 1000, "x": np.ones(ROWS, np.float32), "name": ["row"] * ROWS})
    pq.write_table(table.slice(0, 120), parquet / "part-0.parquet", row_group_size=30)
    pq.write_table(table.slice(120), parquet / "part-1.parquet", row_group_size=30)
    shell.user_ns.update(
        frame=pd.DataFrame({"id": ids, "y": ids * 0.5}), table=pa.table({"id": ids, "v": [[1.0, 2.0]] * ROWS}),
        arrays={"id": ids, "image": np.zeros((ROWS, 2, 2), np.float32)}, row_ids=torch.from_numpy(ids.copy()),
        path=str(parquet))
    return ids


OPTIONS = {"frame": dict(batch_size=16, shuffle=True), "table": dict(batch_size=10, drop_last=True),
           "arrays": dict(batch_size=7, shuffle=True, drop_last=True), "tensor": dict(batch_size=50),
           "files": dict(batch_size=8, shuffle=True)}


def test_every_kind_is_read_once_per_epoch_in_the_documented_order_and_recorded(shell, sources, mlflow, capsys):
    flags = "--data frame=frame --data table=table --data arrays=arrays --data tensor=row_ids --data files=path[id,x]"
    result = shell.run(read_cell("local", OPTIONS, flags=flags))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    for name, options in OPTIONS.items():
        ids = list(range(1000, 1000 + ROWS)) if name == "files" else list(range(ROWS))
        assert_exactly_once(values, name, ids, options.get("drop_last", False), options["batch_size"])
        assert_documented_order(values, name, ids, options)
    assert values[0]["sources"]["arrays"]["columns"] == ["id", "image"]
    assert values[0]["sources"]["files"]["columns"] == ["id", "x"]  # the [id,x] selection left the strings out
    out = capsys.readouterr().out
    assert "data frame: staging pandas DataFrame frame" in out and "memory-maps" in out
    run = mlflow.get_run(result.result.run_id)
    tags = run.data.tags
    assert tags["dtrain_magic.data.frame.kind"] == "pandas DataFrame" and tags["dtrain_magic.data.frame.rows"] == "203"
    assert tags["dtrain_magic.data.files.schema"] == "id: int64, x: float"
    assert float(tags["dtrain_magic.data.frame.staging_s"]) >= 0 and "dtrain_magic.data.files.staging_s" not in tags
    inputs = {each.dataset.name: each.dataset for each in run.inputs.dataset_inputs}
    assert set(inputs) == set(OPTIONS) and inputs["files"].source_type == "parquet"
    assert '"num_rows": 203' in inputs["tensor"].profile

    # A re-run of the same data reuses the staged copy; a name given other data lets its old copy go.
    copies = {name: copy.location for copy in staging_area().copies.values() for name in copy.names}
    assert sorted(copies) == ["arrays", "frame", "table", "tensor"]  # the Parquet files are read where they are
    assert all(os.path.isfile(os.path.join(p, "data.arrow")) for p in copies.values())
    again = shell.run(read_cell("local", {"frame": OPTIONS["frame"]}, flags="--data frame=frame --data table=table",
                                epochs=1))
    assert again.error_in_exec is None, again.error_in_exec
    out = capsys.readouterr().out
    assert "data frame: reusing the copy of pandas DataFrame frame an earlier run staged" in out
    # a source given but never read is named after the run (the one read is not)
    assert "--data table: given, but rank 0 read no batch of it (ctx.data('table', batch_size=...))" in out
    assert "--data frame: given, but" not in out
    assert "reused" in mlflow.get_run(again.result.run_id).data.tags["dtrain_magic.data.frame.staging"]
    shell.user_ns["frame"].loc[0, "y"] = -1.0  # changed in place: new data, staged again
    assert shell.run(read_cell("local", {"frame": OPTIONS["frame"]}, flags="--data frame=frame",
                               epochs=1)).error_in_exec is None
    assert "data frame: staged 203 rows" in capsys.readouterr().out
    assert not os.path.exists(copies.pop("frame")) and all(os.path.exists(p) for p in copies.values())
    root = staging_area().root(None)
    staging_area().shutdown()
    assert not os.path.exists(root)


DDP_CELL = """%%distribute --backend local -n 2 --seed 0 --no-ui --data train=regression
import torch

def train(ctx):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.prepare(model, opt)
    loader = ctx.data("train", batch_size=16, shuffle=True, drop_last=True, shuffle_window=48)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            ctx.backward(loss)
            ctx.step()
    plain = getattr(model, "module", model)
    return {"weights": {k: v.detach().clone() for k, v in plain.state_dict().items()},
            "block_rows": list(loader.source.blocks.block_rows), "steps": len(loader)}
"""


def test_ddp_through_ctx_data_trains_the_weights_of_one_process_on_the_same_rows(shell):
    """Two ranks with batches of 16 from ctx.data == one process whose batch at each step is the two ranks' batches
    together, taken in the documented order (`epoch_rows`): DDP averages the two ranks' mean gradients. fp32, 1e-5."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(301, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3
    shell.user_ns["regression"] = {"x": x.numpy(), "y": y.numpy()}
    result = shell.run(DDP_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    value = result.result.value
    torch.manual_seed(0)  # the workers' --seed 0, then the model first: the same initial weights
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        orders = [epoch_rows(value["block_rows"], rank, 2, epoch, 0, True, True, 16, 48) for rank in range(2)]
        for step in range(value["steps"]):
            rows = np.concatenate([order[step * 16:(step + 1) * 16] for order in orders])
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
    for name, weight in model.state_dict().items():
        assert torch.allclose(value["weights"][name], weight, atol=1e-5, rtol=0), name
        assert torch.equal(result.result.values[1]["weights"][name], value["weights"][name])


RESTART_CELL = """%%distribute --backend local -n 2 --seed 0 --no-ui --max-restarts 1 --data train=frame
import os, torch

def train(ctx):
    model, opt = ctx.prepare(torch.nn.Linear(1, 1), None)
    loader = ctx.data("train", batch_size=8, shuffle=True)
    state = ctx.load_checkpoint() or {"epoch": 0}
    first, seen = None, []
    for epoch in range(state["epoch"], 3):
        loader.set_epoch(epoch)
        for batch in loader:
            done = loader.position[1]
            first = first or (epoch, done)
            seen.append((epoch, done, batch["id"].tolist()))
            if done % 3 == 0:
                ctx.save_checkpoint(epoch=epoch)
            if (epoch, done) == (1, 5) and ctx.rank == 1 and not os.path.exists("killed"):
                open("killed", "w").close()
                os._exit(3)
    return {"first": first, "seen": seen, "block_rows": list(loader.source.blocks.block_rows),
            "window": loader.shuffle_window}
"""


def test_a_restarted_run_resumes_its_data_position_from_the_checkpoint(shell, tmp_path):
    ids = np.arange(100, dtype=np.int64)
    shell.user_ns["frame"] = pd.DataFrame({"id": ids})
    result = shell.run(RESTART_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    assert (tmp_path / "killed").exists()
    for rank, value in enumerate(result.result.values):
        assert value["first"] == (1, 4), value["first"]  # the checkpoint at batch 3 of epoch 1: on from the 4th
        for epoch, done, got in value["seen"]:
            order = epoch_rows(value["block_rows"], rank, 2, epoch, 0, True, False, 8, value["window"])
            assert got == order[(done - 1) * 8:done * 8].tolist(), (rank, epoch, done)
        assert [(e, d) for e, d, _ in value["seen"]][-1] == (2, 7)  # 50 rows per rank: 7 batches per epoch


def test_ranks_of_one_model_replica_read_the_same_batches(shell):
    shell.user_ns["frame"] = pd.DataFrame({"id": np.arange(ROWS)})
    result = shell.run(read_cell("local", {"frame": dict(batch_size=16, shuffle=True)},
                                 flags="--tp 2 --data frame=frame", epochs=1))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values  # -n 2 --tp 2: one replica, two tensor-parallel shards
    assert values[0]["rank"] == values[1]["rank"] == 0
    assert values[0]["sources"] == values[1]["sources"]
    assert_exactly_once(values[:1], "frame", list(range(ROWS)), ranks=1)


def test_bad_input_is_refused_before_anything_is_launched(shell):
    shell.user_ns["frame"] = pd.DataFrame({"id": np.arange(10), "name": ["x"] * 10})
    for line, why in [("--data train=frame", r"column 'name' \(string\) cannot become a tensor"),
                      ("--data train=missing", "missing is not defined"),
                      ("--data train=frame[id] -n 2", "reads ctx.data\\('val'\\)")]:
        cell = f"%%distribute --backend local -n 2 --no-ui {line}\ndef train(ctx):\n    return ctx.data('val', 1)\n"
        if "reads" not in why:
            cell = cell.replace("'val'", "'train'")
        result = shell.run(cell)
        assert isinstance(result.error_in_exec, ConfigError), result.error_in_exec
        assert re.search(why, str(result.error_in_exec)), result.error_in_exec
        assert "nothing was launched" in str(result.error_in_exec)
