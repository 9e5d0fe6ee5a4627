"""Ray Datasets as ``--data``, really run on one embedded Ray instance for the module: an existing Ray Train loop
(``ray.train.get_dataset_shard``) runs unchanged; ``ctx.data`` reads Ray Train's shards of a Ray Dataset and a
pandas DataFrame put once in Ray's object store, each row once per epoch (up to the rule); off Ray, Ray Data
writes the Dataset once as Parquet and the ranks read that."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from data_workloads import assert_exactly_once, read_cell

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")

ROWS = 301


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    """One embedded Ray instance for the module (what a notebook gets), shut down at the end."""
    from dtrain_magic.config import RunConfig
    from dtrain_magic.data.staging import staging_area
    from dtrain_magic.launchers import get_launcher

    assert not ray.is_initialized(), "another test left Ray running in this process"
    os.environ.pop("RAY_ADDRESS", None)
    launcher = get_launcher("ray")
    assert launcher.instance.connect(RunConfig(backend="ray")) == "embedded"
    yield
    staging_area().shutdown()  # (the object store's copies go before Ray)
    launcher.shutdown()
    if ray.is_initialized():
        ray.shutdown()


EXISTING_LOOP = """%%distribute --backend ray -n 2 --no-ui --data train=ds
import ray.train, torch

def train_func(config):
    shard = ray.train.get_dataset_shard("train")
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for epoch in range(config["epochs"]):
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=torch.float32):
            loss = torch.nn.functional.mse_loss(model(batch["id"].reshape(-1, 1)), batch["id"].reshape(-1, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += batch["id"].long().tolist()
        ray.train.report({"epoch": epoch, "loss": loss.item()})
    return {"rank": ray.train.get_context().get_world_rank(), "seen": seen}

train_func({"epochs": 1, "batch_size": 50})
"""


def test_an_existing_ray_train_loop_reads_its_dataset_shard_unchanged(shell, mlflow):
    shell.user_ns["ds"] = ray.data.range(ROWS)
    result = shell.run(EXISTING_LOOP)
    assert result.error_in_exec is None, result.error_in_exec
    seen = [row for value in result.result.values for row in value["seen"]]
    assert len(seen) == len(set(seen)) and ROWS - len(seen) < 2  # Ray's equal split: fewer than the ranks dropped
    assert len(result.result.values[0]["seen"]) == len(result.result.values[1]["seen"])
    assert [m.step for m in mlflow.get_metric_history(result.result.run_id, "loss")] == [0]  # its report: MLflow


def test_ctx_data_reads_ray_trains_shards_and_the_object_store(shell, mlflow):
    shell.user_ns.update(ds=ray.data.range(ROWS), frame=pd.DataFrame({"id": np.arange(ROWS) + 5000}))
    options = {"train": dict(batch_size=20, shuffle=True), "objects": dict(batch_size=16, shuffle=True)}
    result = shell.run(read_cell("ray", options, flags="--data train=ds --data objects=frame"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    seen = [[row for value in values for row in value["sources"]["train"]["epochs"][epoch]] for epoch in (0, 1)]
    for rows in seen:  # Ray Train's streaming split, equal: each row at most once, fewer than the ranks left out
        assert len(rows) == len(set(rows)) and set(rows) <= set(range(ROWS)) and ROWS - len(rows) < 2
    assert seen[0] != seen[1]  # reshuffled per epoch (Ray's local shuffle buffer, seeded by --seed and the epoch)
    assert_exactly_once(values, "objects", list(range(5000, 5000 + ROWS)))
    tags = mlflow.get_run(result.result.run_id).data.tags
    assert tags["dtrain_magic.data.train.kind"] == "Ray Dataset" and tags["dtrain_magic.data.train.rows"] == "301"
    assert "Ray Train" in tags["dtrain_magic.data.train.reaches_ranks"]
    assert "object store" in tags["dtrain_magic.data.objects.reaches_ranks"]


def test_off_ray_a_ray_dataset_is_written_once_as_parquet(shell, capsys):
    shell.user_ns["ds"] = ray.data.range(ROWS)
    result = shell.run(read_cell("local", {"train": dict(batch_size=32, shuffle=True)}, flags="--data train=ds",
                                 epochs=1))
    assert result.error_in_exec is None, result.error_in_exec
    assert_exactly_once(result.result.values, "train", list(range(ROWS)))
    assert "data train: staging Ray Dataset ds: written once as Parquet by Ray Data" in capsys.readouterr().out
