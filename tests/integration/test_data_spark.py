"""Spark DataFrames as ``--data``, really run on one real ``local-cluster[2,1,1024]`` (two executor JVMs, the
launcher's own SparkSession for the module): never collected, written once as Parquet by the executors and read by
the ranks, each epoch every row once (up to the even-split rule): under TorchDistributor in local mode (torchrun on
the driver), on the local backend (the same DataFrame's copy reused, not written again), then as barrier tasks
(``--cluster``) with ``--data-dir``, where each rank reads its share on its own executor. Bad DataFrames are
refused before launch."""

from __future__ import annotations

import os

import pytest

from data_workloads import assert_exactly_once, read_cell
from dtrain_magic.config import RunConfig
from dtrain_magic.data.staging import staging_area
from dtrain_magic.errors import CaptureError, ConfigError
from dtrain_magic.launchers import get_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = 1001
CLUSTER_MASTER = "local-cluster[2,1,1024]"
OPTIONS = {"train": dict(batch_size=32, shuffle=True)}


@pytest.fixture(scope="module")
def spark_launcher():
    """The launcher's own SparkSession on a local-cluster for the module, stopped at the end."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    launcher = get_launcher("spark")
    yield launcher
    launcher.release_standby("the test module ends")
    staging_area().shutdown()
    launcher.shutdown()


def dataframe(spark_launcher):
    from pyspark.sql import functions as F

    spark = spark_launcher.session(RunConfig(backend="spark", spark_master=CLUSTER_MASTER))
    return (spark.range(ROWS, numPartitions=3).withColumn("x", F.col("id").cast("float") / 10)
            .withColumn("label", F.lit("text")))


def test_a_dataframe_is_written_once_and_read_once_per_epoch_on_spark_then_reused_on_local(spark_launcher, shell,
                                                                                           capsys):
    shell.user_ns["df"] = dataframe(spark_launcher)
    result = shell.run(read_cell("spark", OPTIONS, flags=f"--spark-master {CLUSTER_MASTER} --data train=df[id,x]"))
    assert result.error_in_exec is None, result.error_in_exec
    assert_exactly_once(result.result.values, "train", list(range(ROWS)))
    out = capsys.readouterr().out
    assert "data train: staging Spark DataFrame df[id,x]: written once as Parquet by Spark's executors" in out
    copy = next(iter(staging_area().copies.values())).location
    written = sorted(os.listdir(copy))
    assert any(name.endswith(".parquet") for name in written)
    # the same DataFrame, built again in a cell, on another backend: its copy is read, not written again
    shell.user_ns["df"] = dataframe(spark_launcher)
    result = shell.run(read_cell("local", OPTIONS, flags="--data train=df[id,x]", epochs=1))
    assert result.error_in_exec is None, result.error_in_exec
    assert_exactly_once(result.result.values, "train", list(range(ROWS)))
    assert "data train: reusing the copy of Spark DataFrame df[id,x] an earlier run staged" in capsys.readouterr().out
    assert sorted(os.listdir(copy)) == written


def test_bad_dataframes_are_refused_before_launch(spark_launcher, shell):
    df = dataframe(spark_launcher)
    shell.user_ns.update(df=df, empty=df.limit(0).select("id"))
    cell = (f"%%distribute --backend spark -n 2 --no-ui --spark-master {CLUSTER_MASTER} {{flags}}\n"
            "def train(ctx):\n    return {body}\n")
    result = shell.run(cell.format(flags="--data train=df", body="1"))
    assert isinstance(result.error_in_exec, ConfigError)
    assert "column 'label' (string) cannot become a tensor" in str(result.error_in_exec)
    assert "--data train=df[col,...] or df.select(...)" in str(result.error_in_exec)
    result = shell.run(cell.format(flags="--data train=empty", body="1"))
    assert isinstance(result.error_in_exec, ConfigError) and "has no rows" in str(result.error_in_exec)
    result = shell.run(cell.format(flags="", body="df.count()"))  # the DataFrame inside the function
    assert isinstance(result.error_in_exec, CaptureError)
    assert "add `--data df=df`" in str(result.error_in_exec) and "ctx.data('df'" in str(result.error_in_exec)


EXECUTOR = """
import os, psutil

def executor_pid():
    proc = psutil.Process()
    while proc is not None and "CoarseGrainedExecutorBackend" not in " ".join(proc.cmdline()):
        proc = proc.parent()
    return proc.pid if proc is not None else None
"""


def test_on_a_cluster_each_barrier_task_reads_its_share_from_data_dir(spark_launcher, shell, tmp_path):
    shared = tmp_path / "shared"  # stands for a directory every node mounts
    shared.mkdir()
    shell.user_ns["df"] = dataframe(spark_launcher)
    assert shell.run(EXECUTOR).error_in_exec is None
    cell = read_cell("spark", OPTIONS, flags=f"--cluster --spark-master {CLUSTER_MASTER} --data train=df[id,x] "
                                             f"--data-dir {shared}", epochs=1)
    cell = cell.replace('return {"rank"', 'return {"executor": executor_pid(), "rank"')
    result = shell.run(cell)
    assert result.error_in_exec is None, result.error_in_exec
    assert spark_launcher._session.sparkContext.master == CLUSTER_MASTER
    executors = [value["executor"] for value in result.result.values]
    assert None not in executors and len(set(executors)) == 2, executors  # one barrier task per executor
    assert_exactly_once(result.result.values, "train", list(range(ROWS)))
    staged = list(shared.iterdir())
    assert len(staged) == 1 and staged[0].name.startswith("dtrain_data_") and any(staged[0].rglob("*.parquet"))
    staging_area().shutdown()  # (at the kernel's exit)
    assert not any(shared.iterdir())
