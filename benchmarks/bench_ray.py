"""``%%distribute --backend ray`` against a raw ``TorchTrainer(...).fit()``: time to first step and total.

Both run the same job (benchmarks/workload.py: a small MLP, plain DDP, ``--steps`` Adam steps, ``-n``
workers) in this process, on the same kind of Ray instance (the one the launcher embeds: 127.0.0.1, no
dashboard). Cold: the first run on a fresh Ray instance (no Ray worker processes yet; ``ray.init`` itself
is timed apart, not included); ``--cold-runs`` samples of each, each on its own fresh instance (default 1:
a cold sample costs about 30 s on 2 cores with the instance start; use 3 for min/median/max). Warm: the
next ``--repeats`` runs on the last instance of each side (default 3); the magic's three ways
(workload.STANDBY_SERIES: a warm re-run on the next run's workers launched ahead and waiting, a re-run
started the moment the previous one returned, a launch with no workers waiting), its call → train function
entry against raw's (issue 15's target: ≤ 0.05 × raw, ≤ 0.5 s). Time to first step is from the
call (the cell, or building the ``TorchTrainer`` and ``fit()``) to rank 0's first optimizer step, split
into parts (workload.py); the raw side's "backend launch" (call → train loop entry: Ray Train's
controller, the worker actors, their process group) is what the magic, which goes through the same
``TorchTrainer.fit``, cannot skip without worker actors kept alive between runs.

    .venv/bin/python benchmarks/bench_ray.py [--repeats 3] [--cold-runs 1] [--steps 200] [--order magic,raw]
    .venv/bin/python benchmarks/bench_ray.py -n 4 --gpu        # 4 GPU workers, unchanged otherwise
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
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
    standby_section,
    standby_series,
    write_json,
)


def ray_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: the shared job; rank 0 writes its marks to a file."""
    import json

    device = None
    if config["gpu"]:
        import ray.train.torch

        device = ray.train.torch.get_device()
    result = raw_train(config["steps"], config["gpu"], device)
    if result["rank"] == 0:
        with open(config["out"], "w") as handle:
            json.dump(result, handle)


def fresh_ray(n: int) -> float:
    """Shut down any embedded instance and start a new one the way the launcher does; seconds taken."""
    from dtrain_magic.config import RunConfig
    from dtrain_magic.launchers import get_launcher

    instance = get_launcher("ray").instance
    get_launcher("ray").release_standby("benchmark: a fresh Ray instance")  # its workers hold the instance's CPUs
    instance.shutdown()
    t0 = time.perf_counter()
    assert instance.connect(RunConfig(backend="ray", num_processes=n)) == "embedded"
    return time.perf_counter() - t0


_PROBES: Probes | None = None


def run_magic(shell, args) -> dict:
    global _PROBES
    if _PROBES is None:
        _PROBES = Probes("ray")
    shell.user_ns.update(STEPS=args.steps, LOG=True)
    device = "--gpu" if args.gpu else "--cpu"
    # no --keep-warm: the next run's workers wait by default on this machine's Ray (docs/backends.md#warm-re-runs)
    flags = f"-n {args.n} {device} --no-ui --experiment bench_ray"
    cell = f"%%distribute --backend ray {flags}\n" + MAGIC_BODY
    _PROBES.reset()
    start = time.time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress, rank output
        result = shell.run_cell(cell, store_history=False)
    end = time.time()
    if result.error_in_exec is not None:
        raise result.error_in_exec
    first = result.result.value
    return {"ttfs": first["first_step"] - start, "total": end - start, "entry": first["entered"] - start,
            "steps_per_s": first["steps_per_s"], "parts": magic_parts(start, _PROBES.reset(), first)}


def run_raw(args, workdir: str, index: int) -> dict:
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(workload)  # Ray's workers cannot import benchmarks/workload.py
    out = os.path.join(workdir, "first_step.json")
    if os.path.exists(out):
        os.remove(out)
    start = time.time()
    TorchTrainer(
        ray_loop,
        train_loop_config={"steps": args.steps, "gpu": args.gpu, "out": out},
        scaling_config=ray.train.ScalingConfig(num_workers=args.n, use_gpu=args.gpu),
        run_config=ray.train.RunConfig(
            name=f"raw_{os.getpid()}_{index}", storage_path=os.path.join(workdir, "raw_runs"),
        ),
    ).fit()
    end = time.time()
    with open(out) as handle:
        first = json.load(handle)
    return {"ttfs": first["first_step"] - start, "total": end - start, "entry": first["entered"] - start,
            "steps_per_s": first["steps_per_s"], "parts": raw_parts(start, first)}


def notebook_own_ray(shell, args, workdir: str, one) -> dict:
    """The notebook's own ``ray.init()`` first (Ray's docs' first line), then the magic's cells with no flag about
    waiting workers, against raw ``TorchTrainer.fit`` on that same Ray: call → function entry of each re-run. The
    magic's first run takes over the workers it launched while the cell was captured (a whole launch); each re-run,
    those launched after the previous run (issue 23: before, a Ray the notebook started itself held nothing unless
    ``--keep-warm``)."""
    import ray

    from dtrain_magic.launchers import get_launcher

    launcher = get_launcher("ray")
    ray.init(num_cpus=max(4, args.n + 1), include_dashboard=False, log_to_driver=False)
    out: dict[str, list] = {"magic": [], "raw": []}
    try:
        first = one("magic")  # the kernel's first run on it: its workers launched while the cell was captured
        print(f"  notebook's own ray.init(), the first run: function entry {first['entry']:.2f} s", file=sys.stderr,
              flush=True)
        standby = launcher.standbys.standby
        if standby is not None:
            standby.all_ready.wait(300)
        for _ in range(args.repeats):
            claims = launcher.standbys.claims
            sample = one("magic")
            sample["claimed"] = launcher.standbys.claims > claims
            out["magic"].append(sample)
            standby = launcher.standbys.standby
            if standby is not None:
                standby.all_ready.wait(300)
        launcher.release_standby("benchmark: raw runs on the notebook's own Ray")
        for _ in range(args.repeats):
            out["raw"].append(one("raw"))
    finally:
        launcher.shutdown()
        ray.shutdown()
    for side, samples in out.items():
        entries = ", ".join(f"{s['entry']:.2f}" for s in samples)
        print(f"  notebook's own ray.init(), {side}: function entry {entries} s", file=sys.stderr, flush=True)
    own = {side: {"entry": workload.summarize([s["entry"] for s in samples]),
                  "claimed": sum(1 for s in samples if s.get("claimed"))} for side, samples in out.items()}
    own["first_entry_s"] = first["entry"]
    return own


def print_own_ray(own: dict) -> None:
    magic, raw = own["magic"]["entry"], own["raw"]["entry"]
    print(f"  after the notebook's own ray.init(): call → function entry of a re-run, magic {magic['median']:.2f} s "
          f"({magic['min']:.2f}-{magic['max']:.2f}; took waiting workers {own['magic']['claimed']}/{magic['n']}) vs "
          f"TorchTrainer.fit {raw['median']:.2f} s = {magic['median'] / raw['median']:.3f} × raw (the first run "
          f"{own['first_entry_s']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-processes", "--num-workers", dest="n", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (default: CPU)")
    parser.add_argument("--repeats", "--warm", dest="repeats", type=int, default=3,
                        help="warm runs of each (default 3)")
    parser.add_argument("--cold-runs", type=int, default=1,
                        help="cold runs of each, each on a fresh Ray instance "
                             "(default 1: about 30 s a sample on 2 cores)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--order", default="magic,raw", help="which side gets its fresh instance first")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)

    began = time.monotonic()
    load_start = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="bench_ray_")
    os.chdir(workdir)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    new_db_s = create_tracking_db(os.environ["MLFLOW_TRACKING_URI"])
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)

    order = args.order.split(",")
    samples: dict[str, dict[str, list]] = {"cold": {m: [] for m in order}, "warm": {m: [] for m in order}}
    inits: dict[str, list[float]] = {m: [] for m in order}
    index = 0

    def one(mode: str) -> dict:
        nonlocal index
        index += 1
        return run_magic(shell, args) if mode == "magic" else run_raw(args, workdir, index)

    for c in range(args.cold_runs):
        for mode in order:
            inits[mode].append(fresh_ray(args.n))
            samples["cold"][mode].append(one(mode))
            print(f"  {mode} cold run {c + 1}: first step {samples['cold'][mode][-1]['ttfs']:.2f} s, total "
                  f"{samples['cold'][mode][-1]['total']:.2f} s (ray.init {inits[mode][-1]:.1f} s)",
                  file=sys.stderr, flush=True)
            if c == args.cold_runs - 1 and mode == "magic":  # the last fresh instance of this side: its warm runs
                from dtrain_magic.launchers import get_launcher

                series = standby_series(lambda: one("magic"), get_launcher("ray"), args.repeats,
                                        lambda line: print(line, file=sys.stderr, flush=True))
                samples["warm"]["magic"] = series["magic"]
            elif c == args.cold_runs - 1:
                for i in range(args.repeats):
                    samples["warm"][mode].append(one(mode))
                    print(f"  {mode} warm run {i + 1}: first step {samples['warm'][mode][-1]['ttfs']:.2f} s, total "
                          f"{samples['warm'][mode][-1]['total']:.2f} s", file=sys.stderr, flush=True)
    from dtrain_magic.launchers import get_launcher

    get_launcher("ray").shutdown()
    own = notebook_own_ray(shell, args, workdir, one)

    report = {
        "backend": "ray", "n": args.n, "gpu": args.gpu, "steps": args.steps, "repeats": args.repeats,
        "warm_runs": args.repeats, "cold_runs": args.cold_runs, "raw_api": "TorchTrainer.fit",
        "cpu_count": os.cpu_count(),
        "ray_init_s": {m: statistics.median(v) for m, v in inits.items()}, "new_tracking_db_s": new_db_s,
        "samples": samples, "standby": standby_section(series), "own_ray": own,
    }
    finish_report(report, {"cold": samples["cold"], "warm": samples["warm"]}, began, load_start)

    device = f"{args.n} GPU worker(s)" if args.gpu else f"{args.n} CPU worker(s) on {os.cpu_count()} cores"
    print(f"\nRay backend, {device}, {args.steps} steps; min/median/max over {args.cold_runs} cold run(s) (each on a "
          f"fresh Ray instance; --cold-runs {args.cold_runs}, about 30 s more per extra sample and side) and "
          f"{args.repeats} warm runs")
    print_comparison(report, "TorchTrainer.fit")
    print_backend_launch(report, "Ray Train's own launch")
    print_standby(report, "TorchTrainer.fit", 0.05)
    print_own_ray(own)
    print(f"  (ray.init, not included: magic's instance {report['ray_init_s'].get('magic', 0):.1f} s, raw's "
          f"{report['ray_init_s'].get('raw', 0):.1f} s; "
          f"load average {load_start:.1f} → {report['load_average']['end']:.1f})")
    write_json(args.json, report)
    import shutil

    os.chdir("/")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
