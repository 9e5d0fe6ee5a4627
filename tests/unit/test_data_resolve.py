"""``--data`` before launch: the flag's values, the sources found in a namespace and every bad input (a clear error,
nothing launched), the dry-run lines, the CaptureError that points a Spark DataFrame at ``--data``, the panel's
data line and the observers' data progress. Pure: no backend starts (Spark and Ray sources: tests/integration)."""

from __future__ import annotations

import dataclasses
import io
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtrain_magic.api import data_option
from dtrain_magic.config import RunConfig
from dtrain_magic.data.usage import names_read
from dtrain_magic.driver.data_plan import check_data_dir, describe, resolve
from dtrain_magic.driver.observer import TextObserver
from dtrain_magic.errors import CaptureError, ConfigError
from dtrain_magic.payload import serialize


def config(backend="local", n=2, **data):
    return RunConfig(backend=backend, num_processes=n, data=data)


def plan(namespace=None, backend="local", n=2, shares_files=True, read=(), count=False, **data):
    return resolve(config(backend, n, **data), shares_files, namespace, read, "train(ctx)", count=count)


# -- the flag's values -----------------------------------------------------------------------------------

def test_the_flag_keeps_names_sources_and_order_and_refuses_malformed_ones():
    assert RunConfig(data={"train": "df", "val": "/v"}).data == (("train", "df"), ("val", "/v"))
    assert RunConfig(data=["train=df[x, y]"]).data == (("train", "df[x, y]"),)
    for bad, why in [(["train"], "not NAME=SOURCE"), (["1x=df"], "Python identifier"), ({"a": ""}, "source must"),
                     (["a=x", "a=y"], "a given twice"), (["a=df[]"], "name the columns"), ([("a",)], "NAME=SOURCE")]:
        with pytest.raises(ConfigError, match=why) as info:
            RunConfig(data=bad)
        assert info.value.flag == "--data"
    with pytest.raises(ConfigError, match="--data-dir: applies only with --data"):
        RunConfig(data_dir="/tmp")
    assert RunConfig(data={"a": "s3://u:pw@b/x"}).to_params()["data"] == "a=s3://***@b/x"  # no credentials in MLflow


def test_the_python_api_names_each_object_by_its_data_name():
    frame = pd.DataFrame({"x": [1.0]})
    values, objects = data_option({"data": {"train": frame, "val": "/data/val"}, "seed": 1})
    assert values == {"data": (("train", "train"), ("val", "/data/val")), "seed": 1}
    assert objects == {"train": frame}


# -- sources found, and every bad input --------------------------------------------------------------------

@pytest.fixture
def parquet_dir(tmp_path):
    table = pa.table({"id": np.arange(100, dtype=np.int64), "x": np.ones(100, np.float32), "name": ["a"] * 100})
    pq.write_table(table.slice(0, 60), tmp_path / "part-0.parquet", row_group_size=25)
    pq.write_table(table.slice(60), tmp_path / "part-1.parquet", row_group_size=25)
    (tmp_path / "_SUCCESS").write_text("")
    return tmp_path


def test_objects_and_paths_are_found_with_their_rows_and_schema(parquet_dir):
    ns = {"frame": pd.DataFrame({"id": np.arange(10), "y": np.zeros(10)}), "arr": np.zeros((8, 2, 3), np.float32),
          "tensor": torch.arange(6), "cols": {"a": np.arange(5), "b": torch.ones(5, 2)},
          "table": pa.table({"v": [[1.0, 2.0]] * 4}), "where": str(parquet_dir)}
    found = plan(ns, frame="frame", arr="arr", tensor="tensor", cols="cols", table="table", files="where[id,x]",
                 direct=f"{parquet_dir}[x]")
    kinds = {s.name: (s.kind, s.rows, s.schema.names) for s in found.sources}
    assert kinds == {"frame": ("pandas DataFrame", 10, ["id", "y"]), "arr": ("numpy array", 8, ["arr"]),
                     "tensor": ("torch tensor", 6, ["tensor"]), "cols": ("dict", 5, ["a", "b"]),
                     "table": ("pyarrow Table", 4, ["v"]), "files": ("Parquet", 100, ["id", "x"]),
                     "direct": ("Parquet", 100, ["x"])}
    assert found.sources[5].blocks.block_rows == (25, 25, 10, 25, 15)  # row groups of both files, _SUCCESS ignored
    lines = found.dry_run_lines()
    assert "  data frame: pandas DataFrame frame, 10 rows, 2 column(s): id: int64, y: double" in lines
    assert any("memory-maps" in line and "each of 2 data-parallel rank(s) reads 5 row(s)" in line for line in lines)
    assert any("each rank reads its row groups of 2 file(s), 5 row group(s)" in line for line in lines)
    sliced = plan({"t": pa.table({"x": np.arange(10.0)})}, a="t").sources[0]
    assert plan({"t": sliced.table.slice(0, 5)}, a="t").sources[0].identity() != plan(
        {"t": sliced.table.slice(5, 5)}, a="t").sources[0].identity()  # slices share buffers, not data
    assert plan({"s": pd.Series(np.arange(4.0))}, a="s").sources[0].schema.names == ["s"]
    on_ray = plan(ns, backend="ray", frame="frame")
    assert "Ray's object store" in on_ray.dry_run_lines()[1] and not on_ray.sources[0].needs_files("ray")


@pytest.mark.parametrize("namespace, spec, why", [
    ({}, "nope", r"nope is not defined \(no notebook variable and no file of that name\)"),
    (None, "nope", "the command line takes paths and URIs"),
    ({}, "/no/such/dir/x.parquet", "no file or directory"),
    ({"items": [1, 2]}, "items", "items is a list, which is not a data source; give a Spark DataFrame"),
    ({"f": pd.DataFrame({"id": [1, 2], "name": ["a", "b"]})}, "f",
     r"column 'name' \(string\) cannot become a tensor: keep only the numeric columns"),
    ({"f": pd.DataFrame({"d": pd.to_datetime(["2020-01-01"] * 3)})}, "f", r"'d' \(timestamp\[ns\]\).*a number"),
    ({"f": pd.DataFrame({"x": np.zeros(0)})}, "f", "has no rows: nothing to train on"),
    ({"f": pd.DataFrame({"x": np.zeros(1)})}, "f", "1 row.s. for 2 data-parallel ranks"),
    ({"f": pd.DataFrame({"x": np.zeros(3)})}, "f[y]", "no column 'y'; it has x"),
    ({"d": {"a": np.zeros(3), "b": np.zeros(4)}}, "d", "different lengths"),
    ({"s": np.array(["a", "b"])}, "s", r"column 's' \(<U1\) cannot become a tensor"),
])
def test_every_bad_source_is_a_clear_error_naming_it(namespace, spec, why):
    with pytest.raises(ConfigError, match=why) as info:
        plan(namespace, train=spec)
    assert info.value.flag == "--data" and f"train={spec}" in str(info.value) and "nothing was launched" in str(
        info.value)


def test_bad_parquet_sources_are_named(tmp_path, parquet_dir):
    with pytest.raises(ConfigError, match=r"column 'name' \(string\) cannot become a tensor"):
        plan({}, train=str(parquet_dir))
    pq.write_table(pa.table({"id": np.arange(3, dtype=np.int32)}), parquet_dir / "part-2.parquet")
    with pytest.raises(ConfigError, match="part-2.parquet has another schema"):
        plan({}, train=f"{parquet_dir}[id]")
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    pq.write_table(pa.table({"x": [1.0, None, 3.0]}), nulls / "a.parquet")
    with pytest.raises(ConfigError, match="column 'x' has 1 missing value"):
        plan({}, train=str(nulls))
    delta = tmp_path / "delta"
    (delta / "_delta_log").mkdir(parents=True)
    with pytest.raises(ConfigError, match="a Delta table.*spark.read.format"):
        plan({}, train=str(delta))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no Parquet file"):
        plan({}, train=str(tmp_path / "empty"))


def test_a_name_the_function_reads_must_be_given():
    def train(ctx):
        loader = ctx.data("train", batch_size=8)
        return [ctx.data("val", batch_size=8), loader]

    assert names_read(train) == ("train", "val")
    ns = {"f": pd.DataFrame({"x": np.zeros(4)})}
    with pytest.raises(ConfigError, match=r"reads ctx.data\('val'\), but the run has no data source named val: add "
                                          r"--data val=SOURCE \(this run's: train\)"):
        plan(ns, read=names_read(train), train="f")
    with pytest.raises(ConfigError, match="this run gives none"):
        resolve(RunConfig(), True, {}, ("train",), "train(ctx)")
    assert resolve(RunConfig(), True, {}, (), "train(ctx)") is None


def test_copies_must_go_where_every_worker_reads_them(tmp_path):
    ns = {"f": pd.DataFrame({"x": np.zeros(4)})}
    with pytest.raises(ConfigError, match="--data-dir: --data train=f .* do not share this machine's files") as info:
        plan(ns, backend="spark", shares_files=False, train="f")
    assert info.value.flag == "--data-dir"
    plan(ns, backend="ray", shares_files=False, train="f")  # Ray's object store reaches every node
    remote = RunConfig(backend="spark", local_mode=False, data={"train": "f"}, data_dir=str(tmp_path))
    assert resolve(remote, False, ns).data_dir == str(tmp_path)
    check_data_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="not an existing directory"):
        check_data_dir(str(tmp_path / "missing"))


def test_the_panel_describes_the_sources_without_counting_or_writing():
    ns = {"f": pd.DataFrame({"x": np.zeros(4)})}
    assert describe(config(train="f"), ns) == [
        "data train: pandas DataFrame f, 4 rows, 1 column(s): x: double; written once to an Arrow file that every "
        "rank memory-maps, reading its share (no pickled copy per rank)"]
    pytest.importorskip("ipywidgets")
    from dtrain_magic.ui.panel import PanelState

    state = PanelState(config(train="f"), gpu_available=lambda: False, describe_data=lambda c: describe(c, ns))
    assert state.values["data"] == "train=f" and state.data_lines()[0].startswith("data train: pandas DataFrame")
    state.set(data="train=f val=missing")
    assert any("missing is not defined" in p for p in state.problems()) and not state.can_run
    state.set(data="train=f train=f")
    assert any("train given twice" in p for p in state.problems())
    state.set(data="train=f")
    assert state.can_run and state.to_config().data == (("train", "f"),)
    assert state.flag_line().endswith("--data train=f --ui")


# -- the hint for a DataFrame in the function ------------------------------------------------------------

class DataFrame:
    """Stands for pyspark's (its module and name): cannot be pickled, as a real one cannot outside the driver."""

    __module__ = "pyspark.sql.classic.dataframe"

    def __init__(self):
        self.lock = threading.Lock()


def test_an_unpicklable_dataframe_in_the_function_points_at_data():
    ns = {"df_train": DataFrame()}
    exec("def train(ctx):\n    return df_train.count()\n", ns)
    with pytest.raises(CaptureError) as info:
        serialize(ns["train"])
    message = str(info.value)
    assert "`df_train` (DataFrame), which cannot be pickled" in message
    assert "add `--data df_train=df_train`" in message and "ctx.data('df_train', batch_size=...)" in message
    assert "data={'df_train': df_train}" in message and "inside the function instead" not in message


# -- progress ----------------------------------------------------------------------------------------------

def test_the_text_progress_line_says_where_the_data_is():
    out = io.StringIO()
    observer = TextObserver(out=out, every_s=0)
    observer.note("data train: staged 10 rows in 0.1 s")
    observer.data_progress("train", 2, 120, 500)
    observer.metric(0, {"loss": 1.0})
    text = out.getvalue()
    assert "dtrain_magic: data train: staged 10 rows in 0.1 s" in text
    assert "loss=1; train: epoch 2, batch 120/500" in text


def test_the_monitor_shows_data_progress_and_notes():
    pytest.importorskip("anywidget")
    from dtrain_magic.ui.monitor import MonitorObserver

    out = io.StringIO()
    observer = MonitorObserver(RunConfig(num_processes=2), text_out=out, display=False, charts=False)
    observer.note("data train: staged 10 rows")
    observer.data_progress("train", 1, 3, 8)
    observer._flush()
    assert observer.widget.data == {"train": {"epoch": 1, "batch": 3, "batches": 8}}
    assert observer.widget.log[-1] == "dtrain_magic: data train: staged 10 rows"
    observer.finished(None, None)


class Dataset:
    """Stands for a Ray Dataset (its module and name, and the methods the resolver calls): no Ray started."""

    __module__ = "ray.data.dataset"

    def columns(self):
        return ["id"]

    def schema(self):
        return type("Schema", (), {"names": ["id"], "types": [pa.int64()]})()

    def count(self):
        return 10


def test_a_ray_dataset_goes_to_ray_train_on_ray_and_is_staged_elsewhere_but_not_under_model_parallelism():
    ns = {"ds": Dataset()}
    on_ray = plan(ns, backend="ray", train="ds")
    # Ray Train's own split; counted when handed to it, at launch (where a full Ray has it materialized first)
    assert on_ray.sources[0].rows is None and not on_ray.sources[0].stages("ray")
    assert on_ray.worker_cpus == 2.0  # what Ray Train's 2 CPU workers take (-n 2), none left on a 2-CPU Ray
    assert "get_dataset_shard" in on_ray.dry_run_lines()[1] and "reads 5 row(s)" in on_ray.dry_run_lines()[1]
    elsewhere = plan(ns, backend="local", train="ds")
    assert elsewhere.sources[0].rows is None and elsewhere.sources[0].needs_files("local")  # counted when written
    with pytest.raises(ConfigError, match="Ray Train splits a Ray Dataset over every worker"):
        resolve(RunConfig(backend="ray", num_processes=2, tp=2, data={"train": "ds"}), True, ns)


def test_each_data_name_holds_one_staged_copy_reused_by_the_same_data(tmp_path):
    from dtrain_magic.data.blocks import ParquetBlocks, StagedSource
    from dtrain_magic.driver.staging import StagingArea

    def copy(name):
        (tmp_path / name).mkdir()
        return StagedSource(name, "test", 1, pa.schema([]), ParquetBlocks((), (), ())), str(tmp_path / name)

    area = StagingArea()
    staged_a, dir_a = copy("a")
    area.keep("train", "id-a", None, staged_a, dir_a, 1.0)
    staged_b, dir_b = copy("b")
    area.keep("small", "id-b", None, staged_b, dir_b, 2.0)  # another name: both kept
    assert area.reuse("train", "id-a", None) == (dataclasses.replace(staged_a, name="train"), 1.0)
    assert area.reuse("train", "id-a", "/elsewhere") is None  # a copy elsewhere is another copy
    # the same data under a second name: the copy as that name (what ctx.data("val") looks for)
    assert area.reuse("val", "id-a", None) == (dataclasses.replace(staged_a, name="val"), 1.0)
    staged_c, dir_c = copy("c")
    area.keep("train", "id-c", None, staged_c, dir_c, 3.0)  # train's new data: a is still val's
    assert (tmp_path / "a").exists()
    area.keep("val", "id-c", None, staged_c, dir_c, 3.0)  # val too: nobody holds a any more
    assert not (tmp_path / "a").exists() and (tmp_path / "b").exists()
    staged_d, dir_d = copy("d")
    area.keep("once", None, None, staged_d, dir_d, 0.1)  # no identity: gone when its run ends
    assert area.run_ended() == ["d"] and not (tmp_path / "d").exists()
    area.shutdown()
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
