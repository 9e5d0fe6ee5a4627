"""Scoring rows/s (issue 39): ``ctx.write`` on 2 ranks against one process, Spark's ``predict_batch_udf`` and Ray
Data's ``map_batches``, the same small MLP on the same Parquet rows, on the same machine, in one run.

* **Data**: ``--gb`` of numeric Parquet as tensors (bench_data.py's generator: an ``id`` and 16 float32 feature
  columns, 32 files, row groups of 128 Ki rows), in ``--tmp``; kept there and reused by later runs of the same
  size (``--fresh`` writes it again). The page cache is warmed before the first method.
* **Model**: an MLP 16 → 64 → 64 → 1 built from a fixed seed (``make_model``): the same weights in every method.
* **Methods**, each end to end (read → forward → write Parquet), one after the other, each with its own engine up
  (SparkSession, Ray) and a warm-up job on a small file first, as in a notebook that ran before:
  ``one process`` (pyarrow ``iter_batches`` + torch with every core + one ``ParquetWriter``);
  ``ctx.write -n 2`` (``dtrain_magic.run(backend="local", num_processes=2)``: ``ctx.data(with_ids=True,
  pad=False)`` + ``ctx.write``, torch threads per rank = cores / ranks; the whole ``run()`` call is timed);
  ``Spark predict_batch_udf`` (``local[2]``, ``spark.read.parquet`` → the UDF → ``write.parquet``);
  ``Ray Data map_batches`` (``read_parquet`` → ``map_batches(<callable class>, concurrency=2)`` →
  ``write_parquet``).
* **Checked**: every output has exactly N rows, N distinct ids of the input's, and the sum of its predictions
  equals one process's (relative 1e-4): a method that loses or repeats rows cannot look fast.
* **Target**: ``ctx.write -n 2`` ≥ 1.6 × one process and ≥ the faster of Spark and Ray (rows/s, medians).

    .venv/bin/python benchmarks/bench_outputs.py                  # 1 GiB: about 6 min on a busy 2-core machine
    .venv/bin/python benchmarks/bench_outputs.py --gb 0.25 --repeats 2 --only one_process,magic
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_data import COLUMNS, ROW_BYTES, check_disk, du, write_parquet
from workload import write_json

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's Python workers: this venv's torch
FEATURES = [f"f{c}" for c in range(COLUMNS)]
METHODS = ("one_process", "magic", "spark", "ray")
LABELS = {"one_process": "one process (pyarrow + torch)", "magic": "ctx.write -n 2 (dtrain_magic)",
          "spark": "Spark predict_batch_udf local[2]", "ray": "Ray Data map_batches concurrency=2"}
RANKS = 2
TARGETS = {"vs_one_process": 1.6, "vs_faster_rival": 1.0}  # issue 39: ctx.write -n 2 / one process, / the faster
WARMUP_ROWS = 1 << 16


# -- the model, the same everywhere ------------------------------------------------------------------------------

def make_model():
    import torch

    torch.manual_seed(0)  # fixed weights: every method, in every process, builds the same model
    return torch.nn.Sequential(torch.nn.Linear(COLUMNS, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 1)).eval()


def predict(model, features):
    """float32 features (rows × 16, numpy) → float32 predictions (rows,), numpy."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(features)).squeeze(1).numpy()


def stack(columns):
    """Feature columns (numpy, one per feature) → one rows × 16 float32 array."""
    import numpy as np

    return np.stack(columns, axis=1)


# -- the four methods: each scores every file of `source` into `out`, returns its output folder ----------------------

def one_process(source: str, out: str, batch_size: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(os.cpu_count())  # one process may use every core
    model = make_model()
    writer = None
    for name in sorted(os.listdir(source)):
        for batch in pq.ParquetFile(os.path.join(source, name)).iter_batches(batch_size, columns=["id", *FEATURES]):
            pred = predict(model, stack([batch.column(f).to_numpy() for f in FEATURES]))
            table = pa.table({"id": batch.column("id"), "pred": pred})
            writer = writer or pq.ParquetWriter(os.path.join(out, "part-0.parquet"), table.schema)
            writer.write_table(table)
    writer.close()
    return out


def magic_score(ctx, batch_size: int) -> None:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() // ctx.world_size))
    model = make_model()
    with torch.no_grad():
        for batch in ctx.data("val", batch_size=batch_size, columns=FEATURES, with_ids=True, pad=False):
            pred = model(torch.stack([batch[f] for f in FEATURES], dim=1)).squeeze(1)
            ctx.write("preds", {"id": batch["row_id"], "pred": pred})


def magic(source: str, out: str, batch_size: int) -> str:
    import dtrain_magic

    result = dtrain_magic.run(magic_score, dtrain_magic.CTX, batch_size, backend="local", num_processes=RANKS,
                              data={"val": source}, data_dir=out, ui=False)
    return result.outputs["preds"].path


def spark_predict_fn():
    import torch

    torch.set_num_threads(1)  # local[2]: two tasks at once, one core each (spark.task.cpus=1)
    model = make_model()
    return lambda features: predict(model, features)


def spark_udf(source: str, out: str, batch_size: int) -> str:
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    session = SparkSession.getActiveSession()
    # A struct of the scalar feature columns reaches the predict function as one rows × 16 array (to_numpy of the
    # batch), the cheapest of predict_batch_udf's input forms (an array column is vstacked row by row).
    score = predict_batch_udf(spark_predict_fn, return_type=FloatType(), batch_size=batch_size,
                              input_tensor_shapes=[[COLUMNS]])
    frame = session.read.parquet(source)
    frame.select("id", score(F.struct(*FEATURES)).alias("pred")).write.mode("overwrite").parquet(out)
    return out


class RayScorer:
    """Ray Data's callable class: the model built once per actor."""

    def __init__(self):
        import torch

        torch.set_num_threads(1)  # concurrency=2 actors on a 2-core machine
        self.model = make_model()

    def __call__(self, batch: dict) -> dict:
        return {"id": batch["id"], "pred": predict(self.model, stack([batch[f] for f in FEATURES]))}


def ray_data(source: str, out: str, batch_size: int) -> str:
    import ray.data

    # Half a CPU per actor: with a whole one each, the 2 actors hold both of the 2-core machine's CPUs and Ray Data's
    # read tasks never start (seen here: a hang); torch uses one thread per actor either way.
    (ray.data.read_parquet(source)
     .map_batches(RayScorer, concurrency=RANKS, num_cpus=os.cpu_count() / (2 * RANKS), batch_size=batch_size,
                  batch_format="numpy")
     .write_parquet(out))
    return out


SCORERS = {"one_process": one_process, "magic": magic, "spark": spark_udf, "ray": ray_data}


def start_engine(method: str, batch_size: int) -> None:
    """What the method's notebook would have up before it scores: a SparkSession, a Ray instance (not timed)."""
    if method == "spark":
        from pyspark.sql import SparkSession

        session = (SparkSession.builder.master(f"local[{RANKS}]").appName("bench_outputs")
                   .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.memory", "2g")
                   # Arrow batches as large as the UDF's own: predict_batch_udf re-batches what arrives
                   .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(batch_size)).getOrCreate())
        session.sparkContext.setLogLevel("ERROR")
    elif method == "ray":
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False


def stop_engine(method: str) -> None:
    if method == "spark":
        from pyspark.sql import SparkSession

        SparkSession.getActiveSession().stop()
    elif method == "ray":
        import ray

        ray.shutdown()


# -- the data, the check -----------------------------------------------------------------------------------------

def dataset(directory: str, gigabytes: float, fresh: bool) -> int:
    """The cached dataset of ``gigabytes`` in ``directory`` (written when missing or ``fresh``); its rows."""
    marker = directory + ".rows"  # beside the folder: every reader lists the folder's files
    if fresh or not os.path.exists(marker):
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        check_disk(directory, 3 * gigabytes * 2**30)  # the input and up to two outputs at once
        _, rows = write_parquet(directory, gigabytes)
        with open(marker, "w") as handle:  # written last: a half-written dataset is never reused
            handle.write(str(rows))
    with open(marker) as handle:
        return int(handle.read())


def warm_page_cache(directory: str) -> None:
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            while handle.read(1 << 24):
                pass


def check(path: str, rows: int, reference: float | None) -> dict:
    """An output's rows, distinct ids, ids in range and prediction sum; ``ok`` when it has every input row once
    and (given a reference sum) the same predictions."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    table = ds.dataset(path, format="parquet").to_table(columns=["id", "pred"])
    ids = table.column("id")
    found = {"rows": table.num_rows, "distinct_ids": pc.count_distinct(ids).as_py(),
             "id_range": [pc.min(ids).as_py(), pc.max(ids).as_py()],
             "pred_sum": pc.sum(pc.cast(table.column("pred"), "float64")).as_py()}
    found["ok"] = (found["rows"] == rows == found["distinct_ids"] and found["id_range"] == [0, rows - 1]
                   and (reference is None or abs(found["pred_sum"] - reference) <= 1e-4 * max(1.0, abs(reference))))
    return found


# -- the run -----------------------------------------------------------------------------------------------------

def measure(method: str, source: str, warmup: str, work: str, rows: int, args, reference: float | None) -> dict:
    scorer = SCORERS[method]
    start_engine(method, args.batch_size)
    load = [os.getloadavg()[0]]
    try:
        scorer(warmup, tempfile.mkdtemp(prefix="warmup_", dir=work), args.batch_size)
        samples = []
        for repeat in range(args.repeats):
            out = tempfile.mkdtemp(prefix=f"{method}_{repeat}_", dir=work)  # --data-dir must exist
            started = time.perf_counter()
            path = scorer(source, out, args.batch_size)
            seconds = time.perf_counter() - started
            found = check(path, rows, reference)
            samples.append({"seconds": seconds, "rows_per_s": rows / seconds, **found})
            print(f"  {LABELS[method]}: {rows / seconds:,.0f} rows/s ({seconds:.1f} s), {found['rows']:,} rows out, "
                  f"{'ok' if found['ok'] else 'WRONG OUTPUT'}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            reference = found["pred_sum"] if reference is None else reference
    finally:
        stop_engine(method)
    load.append(os.getloadavg()[0])
    good = [s["rows_per_s"] for s in samples if s["ok"]]
    return {"samples": samples, "median_rows_per_s": statistics.median(good) if good else None,
            "ok": len(good) == len(samples), "load_average": load}


def summarize(methods: dict) -> dict:
    """Ratios and the target, from the methods' median rows/s (a method with a wrong output counts as none)."""
    rate = {name: m["median_rows_per_s"] for name, m in methods.items()}
    magic, one = rate.get("magic"), rate.get("one_process")
    rivals = {name: rate[name] for name in ("spark", "ray") if rate.get(name)}
    faster = max(rivals, key=rivals.get) if rivals else None
    found = {"vs_one_process": magic / one if magic and one else None,
             "faster_rival": faster, "vs_faster_rival": magic / rivals[faster] if magic and faster else None}
    for key, limit in TARGETS.items():
        found[f"met_{key}"] = None if found[key] is None else found[key] >= limit
    return {**found, "targets": TARGETS}


def print_table(methods: dict, ratios: dict) -> None:
    one = (methods.get("one_process") or {}).get("median_rows_per_s")
    print("\n| method | rows/s (median) | / one process | load average before → after |\n|---|---|---|---|")
    for name, m in methods.items():
        rate = m["median_rows_per_s"]
        cell = f"{rate:,.0f}" if rate else "WRONG OUTPUT"
        ratio = f"{rate / one:.2f}" if rate and one else "-"
        print(f"| {LABELS[name]} | {cell} | {ratio} | {m['load_average'][0]:.2f} → {m['load_average'][1]:.2f} |")

    rival = LABELS.get(ratios["faster_rival"], "?")
    for key, what in (("vs_one_process", "one process"), ("vs_faster_rival", f"the faster of Spark and Ray, {rival}")):
        met = "not measured" if ratios[key] is None else ("met" if ratios[f"met_{key}"] else "NOT MET")
        value = f"{ratios[key]:.2f}x" if ratios[key] is not None else "-"
        print(f"target: ctx.write -n {RANKS} ≥ {TARGETS[key]} × {what}: {value}, {met}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="input size as tensors (default 1.0 GiB)")
    parser.add_argument("--only", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--batch-size", type=int, default=32768, help="rows per forward, every method")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method (after a warm-up)")
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where the data (kept) and outputs go")
    parser.add_argument("--fresh", action="store_true", help="write the dataset again even when cached")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    args.json = args.json and os.path.abspath(args.json)  # the run changes directory
    wanted = [m for m in METHODS if m in args.only.split(",")]
    began = time.monotonic()
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    source = os.path.join(args.tmp, f"bench_outputs_data_{args.gb:g}gb")
    rows = dataset(source, args.gb, args.fresh)
    work = tempfile.mkdtemp(prefix="bench_outputs_", dir=args.tmp)
    os.chdir(work)  # MLflow's store, the runs' files: all under the temp dir
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work}/mlflow.db")
    report: dict = {"cpu_count": os.cpu_count(), "batch_size": args.batch_size, "repeats": args.repeats,
                    "dataset": {"rows": rows, "tensor_bytes": rows * ROW_BYTES, "parquet_bytes": du(source),
                                "files": len([n for n in os.listdir(source) if n.endswith(".parquet")])}}
    print(f"dataset: {rows:,} rows, {rows * ROW_BYTES / 2**30:.2f} GiB as tensors, {du(source) / 2**30:.2f} GiB of "
          f"Parquet in {source}; {uptime[0]}", flush=True)
    try:
        warmup = os.path.join(work, "warmup")
        os.makedirs(warmup)
        write_parquet(warmup, WARMUP_ROWS * ROW_BYTES / 2**30, files=2)
        warm_page_cache(source)
        methods, reference = {}, None
        for method in wanted:
            methods[method] = measure(method, source, warmup, work, rows, args, reference)
            if reference is None and methods[method]["ok"]:
                reference = methods[method]["samples"][0]["pred_sum"]
    finally:
        os.chdir(args.tmp)
        shutil.rmtree(work, ignore_errors=True)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    report.update(methods=methods, ratios=summarize(methods), uptime=uptime, seconds=time.monotonic() - began)
    print_table(methods, report["ratios"])
    print(f"uptime before: {uptime[0]}\nuptime after: {uptime[1]}\ndone in {report['seconds']:.0f} s", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
