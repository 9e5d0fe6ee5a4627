"""Time to first step and total time: ``%%distribute --backend spark`` vs a raw ``TorchDistributor(...).run(fn)``.

Both run the same training (a small MLP, plain DDP over gloo, ``--steps`` Adam steps on each of 2 CPU
processes) in the same Python process and on the same SparkSession, alternating, ``--repeats`` times
each after one untimed warm-up of each. Times are measured from the call (the cell's start, or the
``.run`` call) to rank 0's first optimizer step, and to the call's return. The magic's extra cost is
what it adds around TorchDistributor: the cell's capture, the MLflow run (params, metrics, system
metrics), the channel, and the per-node system-metrics monitor in the workers.

    .venv/bin/python benchmarks/bench_spark.py                      # local mode, 2 processes
    .venv/bin/python benchmarks/bench_spark.py --cluster            # barrier tasks on local-cluster[2,1,1024]
    .venv/bin/python benchmarks/bench_spark.py --repeats 5 --steps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

RAW_TRAIN = '''
def raw_train(steps):
    import os, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dist.get_rank())
        first = None
        for step in range(steps):
            x = torch.randn(32, 32, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if first is None:
                first = time.time()
        return first
    finally:
        dist.destroy_process_group()
'''

MAGIC_CELL = '''%%distribute --backend spark -n 2 --cpu --no-ui {extra}
import time
import torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.prepare(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    first = None
    for step in range({steps}):
        x = torch.randn(32, 32, generator=g)
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        if first is None:
            first = time.time()
        if step % 20 == 0:
            ctx.log(loss=loss.item())
    return first
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cluster", action="store_true", help="local_mode=False on a local-cluster master")
    parser.add_argument("--master", default=None, help="master URL (default local[*], or local-cluster[2,1,1024])")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    master = args.master or ("local-cluster[2,1,1024]" if args.cluster else "local[*]")

    workdir = tempfile.mkdtemp(prefix="bench_spark_")
    os.chdir(workdir)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir}/mlflow.db"

    from IPython.core.interactiveshell import InteractiveShell

    from dtrain_magic.config import RunConfig
    from dtrain_magic.launchers import get_launcher

    launcher = get_launcher("spark")
    t0 = time.monotonic()
    spark = launcher.session(RunConfig(backend="spark", spark_master=master))
    if args.cluster:
        launcher._wait_for_slots(spark, 2)
    print(f"SparkSession on {master}: started in {time.monotonic() - t0:.1f} s (not counted below)", flush=True)

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    namespace: dict = {}
    exec(RAW_TRAIN, namespace)
    raw_train = namespace["raw_train"]
    extra = "--cluster" if args.cluster else ""
    cell = MAGIC_CELL.format(extra=extra, steps=args.steps)

    def run_raw() -> tuple[float, float]:
        from pyspark.ml.torch.distributor import TorchDistributor

        start = time.time()
        first = TorchDistributor(num_processes=2, local_mode=not args.cluster, use_gpu=False).run(raw_train, args.steps)
        return first - start, time.time() - start

    def run_magic() -> tuple[float, float]:
        start = time.time()
        result = shell.run_cell(cell, store_history=True)
        if result.error_in_exec is not None:
            raise SystemExit(f"the magic failed: {result.error_in_exec}")
        return result.result.value - start, time.time() - start

    devnull = open(os.devnull, "w")
    timings: dict[str, list[tuple[float, float]]] = {"raw": [], "magic": []}
    for i in range(args.repeats + 1):
        for name, fn in (("raw", run_raw), ("magic", run_magic)):
            real_stdout = sys.stdout
            sys.stdout = devnull  # keep the workers' and the magic's output out of the table
            try:
                first, total = fn()
            finally:
                sys.stdout = real_stdout
            label = "warm-up" if i == 0 else f"run {i}"
            print(f"{label:8s} {name:5s}: first step {first:6.2f} s, total {total:6.2f} s", flush=True)
            if i > 0:
                timings[name].append((first, total))

    raw_first = statistics.median(t[0] for t in timings["raw"])
    raw_total = statistics.median(t[1] for t in timings["raw"])
    magic_first = statistics.median(t[0] for t in timings["magic"])
    magic_total = statistics.median(t[1] for t in timings["magic"])
    mode = "cluster (barrier tasks)" if args.cluster else "local mode"
    print(f"\nmedians over {args.repeats} runs, {args.steps} steps, 2 processes, {mode}, {os.cpu_count()} CPU cores:")
    print(f"  raw TorchDistributor.run : first step {raw_first:6.2f} s, total {raw_total:6.2f} s")
    print(f"  %%distribute --backend spark: first step {magic_first:6.2f} s, total {magic_total:6.2f} s")
    print(f"  ratio magic/raw          : first step {magic_first / raw_first:5.2f}x, total {magic_total / raw_total:5.2f}x")
    try:
        os.getloadavg()
        print(f"  load average during the run: {os.getloadavg()[0]:.1f}")
    except OSError:
        pass
    if args.json:
        import json

        with open(args.json, "w") as handle:
            json.dump({
                "backend": "spark", "mode": mode, "repeats": args.repeats, "steps": args.steps, "raw_api": "TorchDistributor.run",
                "samples": timings, "warm_ttfs_ratio": magic_first / raw_first, "warm_total_ratio": magic_total / raw_total,
                "warm_magic_ttfs_median": magic_first, "warm_raw_ttfs_median": raw_first,
            }, handle, indent=2)
    launcher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
