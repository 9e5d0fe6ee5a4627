"""``%%distribute --backend spark`` against a raw ``TorchDistributor(...).run(fn)``: time to first step and total.

Both run the same job (benchmarks/workload.py: a small MLP, plain DDP, ``--steps`` Adam steps on each
of ``-n`` processes). Time to first step is from the call (the cell's start, or the raw cell's start) to
rank 0's first optimizer step; total is the call's duration.

* Cold: each sample is a fresh Python process (magic and raw alternately), so each pays its own
  SparkSession (JVM) start: the magic's first cell starts it itself, the raw cell builds the same session
  (same settings as the launcher's) and then calls ``TorchDistributor.run``. ``--cold-runs`` samples of
  each (default 3; about 20 s each on 2 cores).
* Warm: in this process, on one SparkSession (its start not counted), after one untimed warm-up of each;
  ``--repeats`` raw samples, then the magic's ``--repeats`` samples three ways (workload.STANDBY_SERIES):
  a warm re-run on the next run's workers, launched ahead and waiting (docs/warm-reruns.md); a re-run
  started the moment the previous one returned; a launch with no workers waiting. Call → worker function
  entry of each against the raw ``TorchDistributor.run``'s (issue 15's target: ≤ 0.15 × raw, ≤ 0.5 s).

Each side's time to first step is split into parts (workload.py); the raw side's "backend launch"
(call → worker function entry: the torchrun wrapper, torchrun, the worker interpreters) is what the magic,
which goes through the same ``TorchDistributor.run``, cannot skip without a persistent worker pool on the
executors.

    .venv/bin/python benchmarks/bench_spark.py                      # local mode, 2 CPU processes
    .venv/bin/python benchmarks/bench_spark.py -n 4 --gpu           # 4 GPUs on the driver (local mode)
    .venv/bin/python benchmarks/bench_spark.py --cluster            # barrier tasks on local-cluster[2,1,1024]
    .venv/bin/python benchmarks/bench_spark.py --repeats 5 --cold-runs 1 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402
from workload import (  # noqa: E402
    MAGIC_BODY,
    Probes,
    create_tracking_db,
    finish_report,
    magic_parts,
    print_backend_launch,
    print_comparison,
    print_standby,
    raw_parts,
    raw_train,
    settle,
    standby_section,
    standby_series,
    write_json,
)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def build_session(master: str, gpu: bool, workdir: str, cluster: bool = False):
    """A SparkSession with the launcher's own settings (plus GPUs with ``gpu``).

    With ``gpu`` the notebook has to build the session itself (TorchDistributor needs
    ``spark.driver.resource.gpu.*`` in local mode, ``spark.executor/task.resource.gpu.*`` for barrier
    tasks); the magic then uses it, as it uses any active session."""
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName("dtrain_magic_bench")
               .config("spark.ui.showConsoleProgress", "false").config("spark.ui.enabled", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if gpu:
        count = gpu_count()
        script = os.path.join(workdir, "gpus.sh")
        with open(script, "w") as handle:
            addresses = ", ".join(f'"{i}"' for i in range(count))
            handle.write(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
        os.chmod(script, 0o755)
        builder = (builder.config("spark.driver.resource.gpu.amount", str(count))
                   .config("spark.driver.resource.gpu.discoveryScript", script))
        if cluster:  # local-cluster executors on this machine: one GPU each, one per barrier task
            builder = (builder.config("spark.executor.resource.gpu.amount", "1")
                       .config("spark.executor.resource.gpu.discoveryScript", script)
                       .config("spark.task.resource.gpu.amount", "1"))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def run_raw(args, master: str) -> dict:
    from pyspark import cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor

    cloudpickle.register_pickle_by_value(workload)  # the torchrun workers cannot import benchmarks/workload.py
    start = time.time()
    result = TorchDistributor(num_processes=args.n, local_mode=not args.cluster, use_gpu=args.gpu).run(
        raw_train, args.steps, args.gpu)
    end = time.time()
    # TorchDistributor returns one rank's value (not always rank 0's); the ranks' first steps meet at
    # DDP's first all-reduce, so any rank's first step is the run's.
    return {"ttfs": result["first_step"] - start, "total": end - start, "entry": result["entered"] - start,
            "steps_per_s": result["steps_per_s"], "parts": raw_parts(start, result)}


_SHELL = None
_PROBES: Probes | None = None


def run_magic(args, master: str) -> dict:
    global _SHELL, _PROBES
    if _SHELL is None:
        from IPython.core.interactiveshell import InteractiveShell

        _SHELL = InteractiveShell.instance()
        _SHELL.run_cell("%load_ext dtrain_magic", store_history=False)
        _PROBES = Probes("spark")
    _SHELL.user_ns.update(STEPS=args.steps, LOG=True)
    flags = [f"-n {args.n}", "--gpu" if args.gpu else "--cpu", "--no-ui", "--experiment bench_spark"]
    if args.cluster:
        flags += ["--cluster", f"--spark-master {master}"]
    cell = "%%distribute --backend spark " + " ".join(flags) + "\n" + MAGIC_BODY
    from IPython.utils.capture import capture_output

    from dtrain_magic.launchers import get_launcher

    launcher = get_launcher("spark")
    sessions_before = launcher.session_starts
    _PROBES.reset()
    start = time.time()
    with capture_output():  # the workers' and the magic's output stay out of the table
        outcome = _SHELL.run_cell(cell, store_history=False)
    end = time.time()
    if outcome.error_in_exec is not None:
        raise SystemExit(f"the magic failed: {outcome.error_in_exec}")
    first = outcome.result.value
    session_s = launcher.session_start_s if launcher.session_starts > sessions_before else None
    return {"ttfs": first["first_step"] - start, "total": end - start, "entry": first["entered"] - start,
            "steps_per_s": first["steps_per_s"],
            "parts": magic_parts(start, _PROBES.reset(), first, session_s=session_s)}


def inner(args, master: str, workdir: str) -> dict:
    """One cold sample, in this fresh process: the first cell of a new kernel."""
    if args.inner == "magic" and not args.gpu:
        return run_magic(args, master)  # the magic starts its own SparkSession (and waits for executors)
    start = time.time()
    session = build_session(master, args.gpu, workdir, args.cluster)
    if args.cluster:
        from dtrain_magic.launchers.spark import SparkLauncher

        SparkLauncher._wait_for_slots(session, args.n)
    session_s = time.time() - start
    sample = run_raw(args, master) if args.inner == "raw" else run_magic(args, master)
    # The session start is part of this cold cell: count it from the cell's start.
    sample["ttfs"] += session_s
    sample["total"] += session_s
    sample["parts"] = {"spark_session": session_s, **sample["parts"]}
    if "proc_start_vs_call" in sample["parts"]:
        sample["parts"]["proc_start_vs_call"] += session_s
    return sample


def run_inner_process(which: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--inner", which],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"cold {which} sample failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", dest="n", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one process per GPU on the driver (default: CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="warm samples of each (default 3)")
    parser.add_argument("--cold-runs", type=int, default=3,
                        help="cold samples of each, each a fresh process with its own SparkSession "
                             "(default 3, ~20 s each)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cluster", action="store_true", help="local_mode=False on a local-cluster master")
    parser.add_argument("--master", default=None, help="master URL (default local[*], or local-cluster[2,1,1024])")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    parser.add_argument("--inner", choices=["magic", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    master = args.master or (f"local-cluster[{args.n},1,1024]" if args.cluster else "local[*]")

    if args.inner:  # run by the parent in its work directory, with its MLFLOW_TRACKING_URI
        print(json.dumps(inner(args, master, os.getcwd())))
        return 0

    began = time.monotonic()
    load_start = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="bench_spark_")
    os.chdir(workdir)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir}/mlflow.db"
    new_db_s = create_tracking_db(os.environ["MLFLOW_TRACKING_URI"])
    passthrough = ["-n", str(args.n), "--steps", str(args.steps), "--master", master,
                   *(["--gpu"] if args.gpu else []), *(["--cluster"] if args.cluster else [])]

    cold: dict[str, list] = {"magic": [], "raw": []}
    for i in range(args.cold_runs):
        for which in (("magic", "raw") if i % 2 == 0 else ("raw", "magic")):
            settle(5.0)
            cold[which].append(run_inner_process(which, passthrough))
            print(f"cold {which:5s}: first step {cold[which][-1]['ttfs']:6.2f} s, "
                  f"total {cold[which][-1]['total']:6.2f} s", flush=True)

    t0 = time.monotonic()
    spark = build_session(master, args.gpu, workdir, args.cluster)
    if args.cluster:
        from dtrain_magic.launchers.spark import SparkLauncher

        SparkLauncher._wait_for_slots(spark, args.n)
    session_s = time.monotonic() - t0
    print(f"SparkSession on {master}: started in {session_s:.1f} s (not counted in the warm runs)", flush=True)

    devnull = open(os.devnull, "w")

    def quiet(fn):
        real_stdout = sys.stdout
        sys.stdout = devnull  # keep the workers' output out of the table
        try:
            return fn(args, master)
        finally:
            sys.stdout = real_stdout

    warm: dict[str, list] = {"magic": [], "raw": []}
    for name, fn in (("magic", run_magic), ("raw", run_raw)):
        settle(5.0)
        sample = quiet(fn)
        print(f"warm-up  {name:5s}: first step {sample['ttfs']:6.2f} s, total {sample['total']:6.2f} s", flush=True)
    for i in range(args.repeats):
        settle(5.0)
        warm["raw"].append(quiet(run_raw))
        print(f"warm {i + 1}   raw  : function entry {warm['raw'][-1]['entry']:6.2f} s, first step "
              f"{warm['raw'][-1]['ttfs']:6.2f} s, total {warm['raw'][-1]['total']:6.2f} s", flush=True)
    from dtrain_magic.launchers import get_launcher

    series = standby_series(lambda: quiet(run_magic), get_launcher("spark"), args.repeats, print)
    warm["magic"] = series["magic"]

    mode = "cluster (barrier tasks)" if args.cluster else "local mode"
    report = {
        "backend": "spark", "mode": mode, "master": master, "n": args.n, "gpu": args.gpu, "steps": args.steps,
        "repeats": args.repeats, "cold_runs": args.cold_runs, "raw_api": "TorchDistributor.run",
        "cpu_count": os.cpu_count(), "session_start_s": session_s, "new_tracking_db_s": new_db_s,
        "samples": {"cold": cold, "warm": warm, "standby": series}, "standby": standby_section(series),
    }
    finish_report(report, {"cold": cold, "warm": warm}, began, load_start)

    device = f"{args.n} GPU process(es)" if args.gpu else f"{args.n} CPU process(es) on {os.cpu_count()} cores"
    print(f"\nSpark backend, {mode}, {device}, {args.steps} steps; min/median/max over {args.cold_runs} cold "
          f"(fresh process + SparkSession each) and {args.repeats} warm samples")
    print_comparison(report, "TorchDistributor.run")
    print_backend_launch(report, "TorchDistributor's own launch")
    print_standby(report, "TorchDistributor.run", 0.15)
    print(f"  (SparkSession start in this process {session_s:.1f} s; a new MLflow tracking DB {new_db_s:.2f} s once; "
          f"load average {load_start:.1f} → {report['load_average']['end']:.1f})")
    write_json(args.json, report)
    try:
        spark.stop()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
