"""``--data`` / ``ctx.data`` (issue 24) against the raw readers, and the notebook's memory while a run trains on a
Spark DataFrame of more than 1 GB.

* **Parquet**: a ≥ 1 GB numeric Parquet dataset (generated here, in a temp dir, deleted at the end; an ``id``
  and 16 float32 columns, row groups of 128 Ki rows) read by each rank of one ``-n 2`` local run three ways,
  alternately, in the same processes: raw pyarrow (``ParquetFile.iter_batches`` over the rank's files, each batch
  made tensors with ``torch.from_numpy``), ``ctx.data`` in order, ``ctx.data`` shuffled. The page cache is warmed
  first, so every side reads from memory. Target: ctx.data rows/s per rank ≥ 0.8 × raw.
* **Ray**: a part of the same files (``--ray-gb``) as ``ray.data.read_parquet``, read per epoch by a raw
  ``TorchTrainer(datasets={"train": ds})`` whose loop iterates ``get_dataset_shard("train").iter_torch_batches``,
  then by ``--backend ray --data train=ds`` with ``ctx.data("train")``; rows/s per rank of the second epoch (the
  first also pays Ray Data's start). Target: ≥ 0.9 × raw.
* **Spark DataFrame, notebook memory**: a DataFrame of ≥ 1 GB of tensors (``--spark-rows`` rows of an ``id``, a
  16-float array and a float: 76 B of tensors a row), built with ``spark.range`` in the notebook, trained on for
  one epoch by ``-n 2`` runs on every backend (local, spark, ray, with their session and Ray already up and a
  small warm-up run first, as in a notebook that ran before). The notebook process's RSS is sampled every 50 ms
  from just before the call to its return: growth = peak - before. Target: < 200 MB on each backend. The first run
  writes the DataFrame once as Parquet (its staging time is reported apart, from the MLflow run's tags); every
  later run, on any backend, reuses that copy (target: no second write).

    .venv/bin/python benchmarks/bench_data.py                       # everything (about 6 min on 2 cores)
    .venv/bin/python benchmarks/bench_data.py --only parquet,rss --gb 1.1

Generated data goes to a temp dir under ``--tmp`` (default: the system's), after checking its free space.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from workload import write_json

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
COLUMNS = 16
ROW_BYTES = 8 + 4 * COLUMNS  # the Parquet benchmark's rows as tensors: id int64 + 16 float32
SPARK_ROW_BYTES = 8 + 4 * COLUMNS + 4  # id, x: 16 floats, y: a float


# -- data ------------------------------------------------------------------------------------------------------

def check_disk(directory: str, needed_bytes: float) -> None:
    free = shutil.disk_usage(directory).free
    print(f"free disk under {directory}: {free / 2**30:.1f} GiB (this benchmark writes about "
          f"{needed_bytes / 2**30:.1f} GiB there)", flush=True)
    if free < 2 * needed_bytes:
        sys.exit(f"not enough free disk under {directory}: {free / 2**30:.1f} GiB, want {2 * needed_bytes / 2**30:.1f}")


def write_parquet(directory: str, gigabytes: float, files: int = 32) -> tuple[list[str], int]:
    """≥ ``gigabytes`` of numeric rows (as tensors) in ``files`` Parquet files; (paths, rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = int(gigabytes * 2**30 / ROW_BYTES) + 1
    per_file = -(-rows // files)
    paths = []
    for index in range(files):
        start = index * per_file
        count = min(per_file, rows - start)
        values = np.random.default_rng(index).random((count, COLUMNS), dtype=np.float32)
        table = pa.table({"id": np.arange(start, start + count, dtype=np.int64),
                          **{f"f{c}": values[:, c] for c in range(COLUMNS)}})
        path = os.path.join(directory, f"part-{index:05d}.parquet")
        pq.write_table(table, path, row_group_size=128 * 1024)
        paths.append(path)
    return paths, rows


def du(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, names in os.walk(directory) for f in names)


# -- Parquet: ctx.data against raw pyarrow, in the same processes ------------------------------------------------

def parquet_throughput(ctx, files: list, batch_size: int, repeats: int) -> dict:
    import time
    import warnings

    import pyarrow.parquet as pq
    import torch

    mine = files[ctx.rank::ctx.world_size]

    def raw() -> float:
        rows, started = 0, time.perf_counter()
        with warnings.catch_warnings():  # torch.from_numpy of Arrow's read-only memory warns once
            warnings.simplefilter("ignore")
            for path in mine:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
                    tensors = {name: torch.from_numpy(batch.column(i).to_numpy())
                               for i, name in enumerate(batch.schema.names)}
                    rows += len(tensors["id"])
        return rows / (time.perf_counter() - started)

    def through(loader) -> float:
        rows, started = 0, time.perf_counter()
        for batch in loader:
            rows += len(batch["id"])
        return rows / (time.perf_counter() - started)

    plain = ctx.data("train", batch_size=batch_size)
    shuffled = ctx.data("train", batch_size=batch_size, shuffle=True)
    for path in mine:  # warm the page cache (both ranks together read every file)
        pq.read_table(path)
    ctx.barrier()
    found: dict = {"raw": [], "ctx.data": [], "ctx.data shuffled": []}
    for _ in range(repeats):
        for name, measure in (("raw", raw), ("ctx.data", lambda: through(plain)),
                              ("ctx.data shuffled", lambda: through(shuffled))):
            ctx.barrier()
            found[name].append(measure())
    return {"rows_per_s": found, "rank_rows": len(plain) * batch_size, "window": shuffled.shuffle_window}


def bench_parquet(paths: list[str], batch_size: int, repeats: int) -> dict:
    import dtrain_magic

    directory = os.path.dirname(paths[0])
    result = dtrain_magic.run(parquet_throughput, dtrain_magic.CTX, paths, batch_size, repeats, backend="local",
                              num_processes=2, data={"train": directory}, ui=False)
    per_rank = [value["rows_per_s"] for value in result.values]
    summary = {name: statistics.median([r for rank in per_rank for r in rank[name]]) for name in per_rank[0]}
    return {"samples": per_rank, "median_rows_per_s": summary, "batch_size": batch_size,
            "ratio": summary["ctx.data"] / summary["raw"],
            "ratio_shuffled": summary["ctx.data shuffled"] / summary["raw"], "window_rows": result.value["window"]}


# -- Ray: ctx.data against Ray Data's iter_torch_batches in a raw TorchTrainer -------------------------------------

def _rows_per_s(batches, key: str = "id") -> float:
    rows, started = 0, None
    for batch in batches:
        if started is None:  # from the first batch on: both sides' per-epoch start is Ray Data's
            started = time.perf_counter()
            continue
        rows += len(batch[key])
    return rows / (time.perf_counter() - started) if started and rows else 0.0


def ray_raw_loop(config: dict) -> None:
    import json as json_

    import ray.train

    shard = ray.train.get_dataset_shard("train")
    rates = [_rows_per_s(shard.iter_torch_batches(batch_size=config["batch_size"])) for _ in range(config["epochs"])]
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"raw_{rank}.json"), "w") as handle:
        json_.dump(rates, handle)


def ray_magic_loop(ctx, batch_size: int, epochs: int) -> list:
    loader = ctx.data("train", batch_size=batch_size)
    rates = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        rates.append(_rows_per_s(loader))
    return rates


def bench_ray(paths: list[str], gigabytes: float, batch_size: int, epochs: int = 2) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import dtrain_magic
    from dtrain_magic.config import RunConfig as MagicConfig
    from dtrain_magic.launchers import get_launcher

    get_launcher("ray").instance.connect(MagicConfig(backend="ray", num_processes=2))
    size = sum(os.path.getsize(p) for p in paths) / len(paths)
    subset = paths[:max(2, int(gigabytes * 2**30 / size))]
    out = tempfile.mkdtemp(prefix="bench_ray_data_")
    storage = tempfile.mkdtemp(prefix="bench_ray_runs_")
    try:
        TorchTrainer(ray_raw_loop, train_loop_config={"batch_size": batch_size, "epochs": epochs, "out": out},
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=storage, name="raw"),
                     datasets={"train": ray.data.read_parquet(subset)}).fit()
        raw = [json.load(open(os.path.join(out, f"raw_{rank}.json"))) for rank in range(2)]
        result = dtrain_magic.run(ray_magic_loop, dtrain_magic.CTX, batch_size, epochs, backend="ray",
                                  num_processes=2, data={"train": ray.data.read_parquet(subset)}, ui=False,
                                  storage=storage)
        magic = result.values
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    last = {"raw": statistics.median([r[-1] for r in raw]), "ctx.data": statistics.median([r[-1] for r in magic])}
    return {"files": len(subset), "bytes": sum(os.path.getsize(p) for p in subset), "batch_size": batch_size,
            "raw_rows_per_s": raw, "magic_rows_per_s": magic, "median_last_epoch": last,
            "ratio": last["ctx.data"] / last["raw"]}


# -- a Spark DataFrame of > 1 GB: the notebook's RSS on every backend ------------------------------------------------

def rss_train(ctx, batch_size: int, name: str = "train") -> int:
    import torch

    model = torch.nn.Linear(COLUMNS, 1)
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    rows = 0
    for batch in ctx.data(name, batch_size=batch_size):
        ctx.backward(torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
        ctx.step()
        rows += len(batch["y"])
    return rows


class RssSampler:
    """This process's peak RSS while a call runs (sampled every ``every_s``)."""

    def __init__(self, every_s: float = 0.05):
        import psutil

        self._process, self._every_s = psutil.Process(), every_s
        self.before = self.peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._done.wait(self._every_s):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> "RssSampler":
        import gc

        gc.collect()
        self.before = self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / 2**20


def bench_rss(rows: int, batch_size: int, staging_dir: str) -> dict:
    from mlflow import MlflowClient
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import dtrain_magic
    from dtrain_magic.config import RunConfig
    from dtrain_magic.launchers import get_launcher
    from dtrain_magic.tracking import resolve_tracking_uri

    spark = (SparkSession.builder.master("local[2]").appName("bench_data").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    get_launcher("ray").instance.connect(RunConfig(backend="ray", num_processes=2))
    df = (spark.range(rows, numPartitions=8)
          .withColumn("x", F.array(*[F.rand(seed).cast("float") for seed in range(COLUMNS)]))
          .withColumn("y", F.rand(99).cast("float")))
    small = spark.range(64).withColumn("x", F.array(*[F.lit(0.0).cast("float")] * COLUMNS)).withColumn(
        "y", F.lit(0.0).cast("float"))
    client = MlflowClient(tracking_uri=resolve_tracking_uri(RunConfig()))
    os.environ["TMPDIR"] = staging_dir  # the staged copy goes here (tempfile's default dir)
    tempfile.tempdir = None
    found = {}
    for label, backend in (("local", "local"), ("local, re-run", "local"), ("spark", "spark"), ("ray", "ray")):
        # A notebook that ran before: the backend is up and its modules are imported (a small run, other data).
        dtrain_magic.run(rss_train, dtrain_magic.CTX, 16, "warmup", backend=backend, num_processes=2,
                         data={"warmup": small}, ui=False)
        started = time.monotonic()
        with RssSampler() as rss:
            result = dtrain_magic.run(rss_train, dtrain_magic.CTX, batch_size, backend=backend, num_processes=2,
                                      data={"train": df}, ui=False)
        tags = client.get_run(result.run_id).data.tags
        staged = tags.get("dtrain_magic.data.train.staging_s")
        found[label] = {"rss_growth_mb": rss.growth_mb, "rss_before_mb": rss.before / 2**20,
                        "rows_trained": sum(result.values), "seconds": time.monotonic() - started,
                        "staging_s": float(staged) if staged is not None else None,
                        "reused": "dtrain_magic.data.train.staging" in tags,
                        "rows": int(tags["dtrain_magic.data.train.rows"])}
        run = found[label]
        staging = "reused the staged copy" if run["reused"] else f"staged in {run['staging_s']:.1f} s"
        print(f"  {label}: notebook RSS +{rss.growth_mb:.0f} MB (from {rss.before / 2**20:.0f} MB), "
              f"{run['rows_trained']:,} rows trained in {run['seconds']:.1f} s, {staging}", flush=True)
    from dtrain_magic.driver.staging import staging_area

    copies = [copy for copy in staging_area().copies.values() if copy.staged.rows == rows]
    on_disk = du(copies[0].location) if copies else 0
    staging_area().shutdown()
    for name in ("ray", "spark"):
        get_launcher(name).shutdown()
    spark.stop()
    return {"rows": rows, "tensor_bytes": rows * SPARK_ROW_BYTES, "parquet_bytes": on_disk, "runs": found,
            "staging_s": found["local"]["staging_s"],
            "restaged": [label for label, run in found.items() if label != "local" and not run["reused"]],
            "max_rss_growth_mb": max(run["rss_growth_mb"] for run in found.values())}


def bench_rss_in_a_new_process(args: argparse.Namespace, work: str) -> dict:
    """`bench_rss` in a fresh Python, as a new notebook: after the Ray Data runs above, this process's Ray driver
    can stop hearing of its new actors (a Ray core fault, docs/backends.md), and the RSS runs would only measure
    that error."""
    import subprocess

    out = os.path.join(work, "rss.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--only", "rss", "--spark-rows", str(args.spark_rows),
                    "--batch-size", str(args.batch_size), "--tmp", work, "--json", out], check=True)
    with open(out) as handle:
        return json.load(handle)["rss"]


# -- main ----------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="parquet,ray,rss", help="comma-separated subset of parquet,ray,rss")
    parser.add_argument("--gb", type=float, default=1.05, help="Parquet dataset size, as tensors (default 1.05 GiB)")
    parser.add_argument("--ray-gb", type=float, default=0.25, help="the part of it the Ray comparison reads")
    parser.add_argument("--spark-rows", type=int, default=int(1.05 * 2**30 / SPARK_ROW_BYTES) + 1,
                        help=f"rows of the Spark DataFrame ({SPARK_ROW_BYTES} B of tensors each; default ≥ 1 GiB)")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where the generated data goes")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    began = time.monotonic()
    work = tempfile.mkdtemp(prefix="bench_data_", dir=args.tmp)
    os.chdir(work)  # MLflow's store, checkpoints: all under the temp dir
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work}/mlflow.db")
    report: dict = {"cpu_count": os.cpu_count()}
    try:
        check_disk(work, (args.gb if wanted & {"parquet", "ray"} else 0) * 2**30
                   + (args.spark_rows * SPARK_ROW_BYTES if "rss" in wanted else 0))
        if wanted & {"parquet", "ray"}:
            data = os.path.join(work, "parquet")
            os.makedirs(data)
            started = time.monotonic()
            paths, rows = write_parquet(data, args.gb)
            report["dataset"] = {"rows": rows, "tensor_bytes": rows * ROW_BYTES, "parquet_bytes": du(data),
                                 "files": len(paths), "generated_s": time.monotonic() - started}
            print(f"dataset: {rows:,} rows, {rows * ROW_BYTES / 2**30:.2f} GiB as tensors, "
                  f"{du(data) / 2**30:.2f} GiB of Parquet in {len(paths)} files", flush=True)
            if "parquet" in wanted:
                report["parquet"] = parquet = bench_parquet(paths, args.batch_size, args.repeats)
                m = parquet["median_rows_per_s"]
                print(f"parquet, rows/s per rank (medians): raw pyarrow {m['raw']:,.0f}, ctx.data {m['ctx.data']:,.0f} "
                      f"({parquet['ratio']:.2f}x), ctx.data shuffled {m['ctx.data shuffled']:,.0f} "
                      f"({parquet['ratio_shuffled']:.2f}x)", flush=True)
            if "ray" in wanted:
                report["ray"] = ray_report = bench_ray(paths, args.ray_gb, args.batch_size)
                m = ray_report["median_last_epoch"]
                print(f"ray, rows/s per rank in the 2nd epoch ({ray_report['bytes'] / 2**20:.0f} MB of Parquet): raw "
                      f"iter_torch_batches {m['raw']:,.0f}, ctx.data {m['ctx.data']:,.0f} ({ray_report['ratio']:.2f}x)",
                      flush=True)
            shutil.rmtree(data, ignore_errors=True)
        if "rss" in wanted and "ray" in wanted:
            report["rss"] = bench_rss_in_a_new_process(args, work)  # (which prints the lines below itself)
        elif "rss" in wanted:
            print(f"spark dataframe: {args.spark_rows:,} rows, {args.spark_rows * SPARK_ROW_BYTES / 2**30:.2f} GiB as "
                  "tensors; notebook RSS while training on it, every backend:", flush=True)
            report["rss"] = rss = bench_rss(args.spark_rows, args.batch_size, work)
            print(f"staging (Spark writes it once as Parquet, {rss['parquet_bytes'] / 2**30:.2f} GiB): "
                  f"{rss['staging_s']:.1f} s; staged again by a later run: {rss['restaged'] or 'never'}; "
                  f"largest RSS growth {rss['max_rss_growth_mb']:.0f} MB", flush=True)
    finally:
        os.chdir(args.tmp)
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = time.monotonic() - began
    print(f"done in {report['seconds']:.0f} s", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
