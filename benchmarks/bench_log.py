"""What ``ctx.log`` every step costs a fast loop, on every backend, with 1 and 2 processes (issue 25).

The loop: a small MLP (16 → 32 → 1), batch 16, Adam, one step per iteration, each rank on its own copy (no
gradient all-reduce: a loop fast enough, at least 1500 steps/s per process on 2 cores, for a per-step cost to
show). The same loop is run with and without ``ctx.log(loss=...)`` every step, alternately, in one kernel per
backend (its workers warm, as a user's re-runs are); both log one value before the loop, so both have the MLflow
run and its system-metrics monitor open; each sample is rank 0's steps/s over ``--steps`` steps after 1.5 s of
warm-up. Cost = the median over pairs of 1 - (with ctx.log) / (without), each pair two runs back to back. Target:
at most 2 % (run_all.py's report).

    .venv/bin/python benchmarks/bench_log.py                         # local, spark, ray; -n 1 and -n 2; 9 pairs each
    .venv/bin/python benchmarks/bench_log.py --backends local --repeats 5 --json benchmarks/results/ctx_log.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from workload import write_json

BACKENDS = ("local", "spark", "ray")
WARMUP_S = 1.5  # the MLflow run open and its writer in its steady rhythm before the steps counted
# between runs: the last run's clean-up and the start of the next run's waiting workers are done (they took
# CPU for the first 2-3 s of a run started at once: rank 0's rate there was 900-1000 steps/s against 1600)
SETTLE_S = 3.0

LOOP = '''
import time
import torch
def train(ctx):
    torch.manual_seed(ctx.rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 16)
    log = LOG
    # both runs log once before the loop: the MLflow run opens at the first metric (else 10 s in), so without
    # this the run without ctx.log would be measured with no MLflow run or system-metrics monitor open at all
    ctx.log(started=1.0)
    began, started, warm = time.perf_counter(), None, 0
    step = 0
    while started is None or step < warm + STEPS:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.item()
        if log:
            ctx.log(loss=value)
        step += 1
        if started is None and time.perf_counter() - began > WARMUP_S:
            started, cpu, warm = time.perf_counter(), time.process_time(), step
    return STEPS / (time.perf_counter() - started), (time.process_time() - cpu) / STEPS
'''


def inner(backend: str, counts: list[int], steps: int, repeats: int) -> dict:
    """In a fresh process: one kernel, this backend; for each process count, ``repeats`` pairs (log, no log)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    shell.user_ns.update(STEPS=steps, WARMUP_S=WARMUP_S)
    out: dict = {}

    def once(n: int, log: bool) -> tuple[float, float, float]:
        """(rank 0's steady steps/s, its process's CPU seconds per step (training and reporter threads), the
        notebook process's CPU share of one core during the run)."""
        shell.user_ns["LOG"] = log
        time.sleep(SETTLE_S)
        cell = f"%%distribute --backend {backend} -n {n} --cpu --no-ui --experiment bench_log\n" + LOOP
        cpu0, wall0 = _own_cpu(), time.monotonic()
        with capture_output():
            result = shell.run_cell(cell, store_history=False)
        if result.error_in_exec is not None:
            raise result.error_in_exec
        rate, cpu_per_step = result.result.value
        return float(rate), float(cpu_per_step), (_own_cpu() - cpu0) / (time.monotonic() - wall0)

    for n in counts:
        once(n, True)  # warm: the backend up, its next workers waiting, MLflow imported
        samples: dict[str, list[float]] = {key: [] for key in ("log", "nolog", "worker_cpu_us_log",
                                                               "worker_cpu_us_nolog", "notebook_cpu_log",
                                                               "notebook_cpu_nolog")}
        for i in range(repeats):
            for log in ((True, False) if i % 2 == 0 else (False, True)):
                rate, cpu_per_step, notebook = once(n, log)
                which = "log" if log else "nolog"
                samples[which].append(rate)
                samples[f"worker_cpu_us_{which}"].append(1e6 * cpu_per_step)
                samples[f"notebook_cpu_{which}"].append(notebook)
        out[str(n)] = samples
    return out


def _own_cpu() -> float:
    """This process's CPU seconds (its threads; not its children: the workers)."""
    times = os.times()
    return times.user + times.system


def summarize(samples: dict[str, list[float]]) -> dict:
    """Medians, and the cost: the median over pairs of 1 - (with / without), each pair two runs back to back (in
    alternating order), so that the machine's drift between pairs cancels."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    pairs = zip(samples["log"], samples["nolog"], strict=True)
    pair_costs = sorted(1 - with_log / without for with_log, without in pairs)
    quartiles = statistics.quantiles(pair_costs, n=4) if len(pair_costs) >= 2 else pair_costs * 3
    return {"samples": samples, "median_log": med["log"], "median_nolog": med["nolog"],
            "pair_costs": pair_costs, "cost_q1": quartiles[0], "cost_q3": quartiles[-1],
            "notebook_cpu_log": med.get("notebook_cpu_log"), "notebook_cpu_nolog": med.get("notebook_cpu_nolog"),
            "worker_cpu_us_log": med.get("worker_cpu_us_log"), "worker_cpu_us_nolog": med.get("worker_cpu_us_nolog"),
            "min_nolog": min(samples["nolog"]), "max_nolog": max(samples["nolog"]),
            "min_log": min(samples["log"]), "max_log": max(samples["log"]),
            "cost_of_medians": 1 - med["log"] / med["nolog"], "cost": statistics.median(pair_costs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--counts", default="1,2", help="process counts (default 1,2)")
    parser.add_argument("--steps", type=int, default=6000,
                        help="steps measured per run, after the warm-up (default 6000: 3-4 s at this rate)")
    parser.add_argument("--repeats", type=int, default=9, help="pairs (with, without ctx.log) per count (default 9)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    if "MLFLOW_TRACKING_URI" not in os.environ:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tempfile.mkdtemp(prefix='bench_log_')}/bench.db"
    if args.inner:
        print(json.dumps(inner(args.inner, counts, args.steps, args.repeats)))
        return
    began = time.monotonic()
    report: dict = {"steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(), "backends": {}}
    for backend in args.backends.split(","):
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--inner", backend, "--counts", args.counts,
             "--steps", str(args.steps), "--repeats", str(args.repeats)],
            capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{backend}: {proc.stderr[-3000:]}")
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
        report["backends"][backend] = {n: summarize(samples) for n, samples in raw.items()}
        for n, data in report["backends"][backend].items():
            print(f"{backend} -n {n}: without ctx.log {data['median_nolog']:.0f} steps/s "
                  f"({data['min_nolog']:.0f}-{data['max_nolog']:.0f}), with {data['median_log']:.0f} "
                  f"({data['min_log']:.0f}-{data['max_log']:.0f}): ctx.log every step costs "
                  f"{100 * data['cost']:.1f} % (median of {len(data['pair_costs'])} pairs, quartiles "
                  f"{100 * data['cost_q1']:.1f} to {100 * data['cost_q3']:.1f} %; target <= 2 % at >= 1500 "
                  f"steps/s); rank 0's CPU per step "
                  f"{data['worker_cpu_us_log']:.0f} us with, {data['worker_cpu_us_nolog']:.0f} us without; the "
                  f"notebook process used {100 * data['notebook_cpu_log']:.1f} % of a core with, "
                  f"{100 * data['notebook_cpu_nolog']:.1f} % without", flush=True)
    report["seconds"] = time.monotonic() - began
    write_json(args.json, report)


if __name__ == "__main__":
    main()
