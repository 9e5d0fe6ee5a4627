"""Run every benchmark, side by side with the raw backends, and write a report a user can read.

    .venv/bin/python benchmarks/run_all.py                 # all of them (about 12 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/run_all.py --only local_n2,strategies --repeats 3
    .venv/bin/python benchmarks/run_all.py --gpu -n 4      # a 4-GPU machine: local -n 1 and -n 4, spark, ray on GPUs

Writes benchmarks/results/report.md (the targets table: target | wanted | measured | met?, with how much
and why for every missed one, then each benchmark's numbers), results.json (every number, every sample,
and when, where and how they were measured) and chart.html (plotly: magic/raw ratios, absolute times with
min-max, the parts of the time to first step, steps/s at 1 and N processes). Each benchmark is its own script,
run in its own Python process so one's warm state (SparkSession, Ray, warm pool) never helps another; they run
one after the other.

    .venv/bin/python benchmarks/run_all.py --report-to docs/benchmark-report.md       # also write the committed report
    .venv/bin/python benchmarks/run_all.py --report-from benchmarks/results/results.json \\
        --report-to docs/benchmark-report.md
    # a part again, the other benchmarks' results kept from docs/benchmark-report.json:
    .venv/bin/python benchmarks/run_all.py --only ctx_log,sweep --merge --report-to docs/benchmark-report.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)
from workload import PART_LABELS, SUB_PARTS  # noqa: E402

ORDER = ("local_n2", "local_n1", "spark", "ray", "chart_lag", "strategies", "ctx_log", "interrupt", "data", "outputs",
         "sweep", "restart", "knobs", "big_mlp", "big_large")
LOG_COST_LIMIT, LOG_COST_RATE = 0.02, 1500.0  # issue 25: ctx.log every step costs <= 2 % at >= 1500 steps/s


def benchmarks(args: argparse.Namespace) -> dict[str, tuple[str, list[str], float]]:
    """name -> (script, arguments, expected seconds on a quiet 2-core machine). Every script takes --json."""
    r, n = args.repeats, args.num_processes
    gpu = ["--gpu"] if args.gpu else []
    spark_cold, ray_cold = args.spark_cold_runs, args.ray_cold_runs
    # -n 1 runs about 3500 steps/s on a core: 3000 steps give it as long a steady-state window as -n 2's 1000.
    local_steps = {n: [], 1: ["--steps", "3000"]}
    small = {"local": [], "backend": [], "chart": [], "strategies": [], "log": [], "data": [], "outputs": [],
             "sweep": [], "restart": [], "knobs": [], "big_mlp": [], "big_large": []}
    if args.quick:  # does everything run? (the numbers mean nothing)
        local_steps = {n: ["--steps", "200"], 1: ["--steps", "200"]}
        small = {"local": [], "backend": ["--steps", "50"], "chart": ["--steps", "40"],
                 "strategies": ["--only", "ddp,zero3", "--width", "256", "--steps", "4"],
                 "log": ["--seconds", "1", "--blocks", "4"],
                 "data": ["--gb", "0.05", "--ray-gb", "0.02", "--spark-rows", "300000", "--repeats", "1"],
                 "outputs": ["--gb", "0.02"], "sweep": ["--trials", "4", "--steps", "5", "--prune-steps", "30"],
                 "restart": ["--steps", "30", "--kill-at", "15"], "knobs": ["--steps", "3", "--only", "zero3"],
                 "big_mlp": ["--width", "512", "--steps", "2"], "big_large": ["--width", "512", "--steps", "2"]}
    return {
        # setup (tracking DB, imports alone) + cold pairs (two fresh interpreters) + 3 kinds of warm calls
        f"local_n{n}": ("bench_local.py", ["-n", str(n), "--repeats", str(r), *local_steps[n], *gpu],
                        20 + 16 * r + 15 * r),
        "local_n1": ("bench_local.py", ["-n", "1", "--repeats", str(r), *local_steps[1], *gpu], 20 + 14 * r + 12 * r),
        # cold pairs: a fresh interpreter + JVM each; warm: one session, a warm-up pair, then pairs
        "spark": ("bench_spark.py", ["-n", str(n), "--repeats", str(r), "--cold-runs", str(spark_cold),
                                     *small["backend"], *gpu],
                  20 + 38 * spark_cold + 11 * (r + 1)),
        # per side and cold run: ray.init + a cold fit (about 37 s); then warm fits of about 19 s each
        "ray": ("bench_ray.py", ["-n", str(n), "--repeats", str(r), "--cold-runs", str(ray_cold),
                                 *small["backend"], *gpu],
                10 + 74 * ray_cold + 38 * r),
        "chart_lag": ("bench_chart_lag.py", small["chart"], 25),
        "strategies": (("bench_strategies_gpu.py" if args.gpu else "bench_strategies.py"),
                       ["-n", str(n), *small["strategies"]],
                       30 if args.quick else 80),
        # per backend: its start, then for -n 1 and -n N a warm run, r + 2 pairs of ~10 s runs (with, without
        # ctx.log; 3 s apart) and one run of 120 pairs of 1 s blocks
        "ctx_log": ("bench_log.py", ["--repeats", str(r + 2), "--counts", f"1,{n}", *small["log"]],
                    (20 + 30 + 60) + 3 * 2 * ((1 + 2 * (r + 2)) * 10 + 250)),
        # per backend: a kernel, then 5 interrupted runs (each waits for the next run's workers: up to 16 s on Ray)
        "interrupt": ("bench_interrupt.py", ["--count", "2" if args.quick else "5"], 60 + 5 * (5 + 15 + 25)),
        # ≥ 1 GB of Parquet generated, read three ways; a Ray comparison; a ≥ 1 GB Spark DataFrame on every backend
        "data": ("bench_data.py", ["--repeats", str(r), *small["data"]], 120 if args.quick else 420),
        # issue 39: 1 GiB of Parquet scored 4 ways (one process, ctx.write -n 2, Spark, Ray), each after a warm-up
        "outputs": ("bench_outputs.py", small["outputs"], 120 if args.quick else 360),
        # issue 36: 8 trials on Ray (Ray's start + a first run ~30 s; the magic's sweep ~20 s, 8 back-to-back runs
        # ~17 s each, Ray Tune ~60 s a trial: 20 reports, each waiting up to 2 s for Ray Train's controller), then
        # two local sweeps of 8 trials (pruned and not, ~50 s)
        "sweep": ("bench_sweep.py", small["sweep"], 360 if args.quick else 750),
        # issue 37: rank 1 SIGKILLed once, six sides (local, local elastic, Spark, Ray, Ray elastic, raw Ray Train's
        # elastic restart), ~155 s with Spark's and Ray's starts
        "restart": ("bench_restart.py", small["restart"], 240 if args.quick else 300),
        # issue 38: each knob on a small GPT-2, 2 processes, the magic against itself without it and against
        # accelerate's FSDP / DeepSpeed plugins: 14 cases, two 2-process runs each (~4 min)
        "knobs": ("bench_knobs.py", small["knobs"], 120 if args.quick else 300),
        # issue 26: per-rank peak memory, CPU (8 runs of a 134 M-parameter MLP; 4 of a 0.5 B one, 8.5 GiB at -n 1)
        "big_mlp": ("bench_big_models.py", ["--part", "mlp", *small["big_mlp"]], 120 if args.quick else 600),
        "big_large": ("bench_big_models.py", ["--part", "large", *small["big_large"]], 120 if args.quick else 600),
    }


def run(name: str, script: str, extra: list[str]) -> dict:
    out = os.path.join(RESULTS, f"{name}.json")
    if os.path.exists(out):
        os.remove(out)
    started, measured_at, load_before = time.monotonic(), _now(), os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *extra, "--json", out],
        capture_output=True, text=True, timeout=3600,
    )
    entry = {"script": script, "args": extra, "seconds": round(time.monotonic() - started, 1), "rc": proc.returncode,
             "measured_at": measured_at, "load": [load_before, os.getloadavg()[0]]}
    summary = [line for line in proc.stdout.splitlines()
               if not line.startswith(("[rank", "dtrain_magic:", "step ", "Out[", "VBox("))]
    entry["summary"] = summary[-60:]
    if proc.returncode != 0:
        entry["error"] = proc.stderr[-3000:]
    if os.path.exists(out):
        with open(out) as handle:
            entry["data"] = json.load(handle)
    return entry


# -- targets ---------------------------------------------------------------------------------------------

RAW_NAMES = {"local": "elastic_launch", "spark": "TorchDistributor.run", "ray": "TorchTrainer.fit"}
NOTEBOOK_PARTS = ("check_capture", "notebook_other", "launch_call")


def _data(results: dict, name: str) -> dict | None:
    entry = results.get(name) or {}
    data = entry.get("data")
    return data if isinstance(data, dict) else None


def _median(data: dict, mode: str, via: str, key: str = "ttfs") -> float | None:
    try:
        return data[mode][via][key]["median"]
    except (KeyError, TypeError):
        return None


def _range(data: dict, mode: str, via: str, key: str = "ttfs") -> tuple[float, float] | None:
    try:
        s = data[mode][via][key]
        return s["min"], s["max"]
    except (KeyError, TypeError):
        return None


def _overlap(a: tuple | None, b: tuple | None) -> bool:
    return bool(a and b and a[0] <= b[1] and b[0] <= a[1])


def _top_parts(parts: dict, keys: tuple, count: int = 3) -> str:
    chosen = sorted(((parts[k], k) for k in keys if k in parts and k not in SUB_PARTS), reverse=True)[:count]
    text = ", ".join(f"{PART_LABELS[k].strip()} {v:.2f} s" for v, k in chosen if v >= 0.005)
    if parts.get("schema_migration", 0) >= 0.05:
        text += f" (of which a new DB's schema migration {parts['schema_migration']:.2f} s)"
    return text


def _worker_side(parts: dict, magic: bool) -> float:
    keys = (("worker_start", "prepare", "first_step") if magic
            else ("backend_launch", "imports_join", "prepare", "first_step"))
    return sum(parts.get(k, 0.0) for k in keys)


def ratio_reason(data: dict, backend: str, mode: str) -> str:
    """Why the magic's time to first step is above raw's, from the measured parts."""
    raw_name = RAW_NAMES[backend]
    m, r = _median(data, mode, "magic"), _median(data, mode, "raw")
    mp, rp = data[mode]["magic"].get("parts", {}), data[mode]["raw"].get("parts", {})
    notebook = sum(mp.get(k, 0.0) for k in NOTEBOOK_PARTS)
    mw, rw = _worker_side(mp, True), _worker_side(rp, False)
    text = (f"magic {m:.2f} s vs {raw_name} {r:.2f} s (+{m - r:.2f} s, medians). Before it launches anything the magic "
            f"spends {notebook:.2f} s in the notebook ({_top_parts(mp, NOTEBOOK_PARTS)}); from the launch to the first "
            f"step it takes {mw:.2f} s vs raw's {rw:.2f} s "
            "(launch → worker function entry with the process group joined: "
            f"{mp.get('worker_start', 0):.2f} s vs {rp.get('backend_launch', 0) + rp.get('imports_join', 0):.2f} s; "
            f"model + DDP wrap: {mp.get('prepare', 0):.2f} s vs {rp.get('prepare', 0):.2f} s)")
    if "spark_session" in mp or "spark_session" in rp:
        text += (f"; SparkSession start {mp.get('spark_session', 0):.2f} s (magic) vs "
                 f"{rp.get('spark_session', 0):.2f} s (raw), the same JVM start on both sides")
    if mp.get("mlflow_after_launch", 0) > 0.05:  # the run opened after the launch: MLflow was off the path
        text += (f". MLflow was off the critical path: the run opened {mp['mlflow_after_launch']:.2f} s after the "
                 f"launch (import {mp.get('mlflow_import', 0):.2f} s, run creation {mp.get('mlflow_run', 0):.2f} s, "
                 f"in the background), so the difference is the workers' own start")
    elif mode == "cold" and backend == "local" and mp.get("proc_start_vs_call") is not None:
        started = mp["proc_start_vs_call"]
        if started <= rp.get("proc_start_vs_call", 0) + 0.1:  # Launcher.warm_up spawned them at the call
            text += (f". The workers start {started:.2f} s after the call "
                     f"(raw's {rp.get('proc_start_vs_call', 0):.2f} s) "
                     f"and are ready when the launch comes, so the critical path is the notebook's own MLflow start "
                     f"(the import alone {mp.get('mlflow_import', 0):.2f} s, more than raw's whole launch): only "
                     f"opening the MLflow run after the launch, or importing MLflow before the first call, "
                     f"would cut it")
        else:
            text += (f". The workers start {started:.2f} s after the call (raw's "
                     f"{rp.get('proc_start_vs_call', 0):.2f} s): the magic imports MLflow and creates the run "
                     f"before it starts them, so those seconds are on the critical path instead of overlapping the "
                     f"workers' start")
    if _overlap(_range(data, mode, "magic"), _range(data, mode, "raw")):
        text += ". The min-max ranges of the two sides overlap: part of the gap is this machine's noise"
    return text + "."


def half_raw_reason(data: dict, backend: str) -> str:
    """Why the magic's warm time to first step is above half of raw's: the backend's own launch."""
    raw_name = RAW_NAMES[backend]
    r, m = _median(data, "warm", "raw"), _median(data, "warm", "magic")
    rp, mp = data["warm"]["raw"].get("parts", {}), data["warm"]["magic"].get("parts", {})
    launch, imports = rp.get("backend_launch", 0.0), rp.get("imports_join", 0.0)
    what = ("the torchrun wrapper, torchrun and fresh worker interpreters" if backend == "spark"
            else "Ray Train's controller, new worker actors and their process group")
    keep = ("a persistent worker pool on the executors: torchrun workers that outlive TorchDistributor.run"
            if backend == "spark" else "Ray Train worker actors kept alive between runs")
    imports_text = (f", and the fresh workers import torch and join the process group in {imports:.2f} s more"
                    if imports >= 0.05 else "")
    text = (f"{raw_name}'s own launch (call → worker function entry: {what}) takes {launch:.2f} s of raw's {r:.2f} s"
            f"{imports_text}"
            f": {launch + imports:.2f} s against a budget of {r / 2:.2f} s. The magic runs every cell through the same "
            f"{raw_name}, so it pays this on every run; only workers that outlive a run ({keep}) could "
            f"skip it. The magic's own additions: "
            f"{sum(mp.get(k, 0.0) for k in NOTEBOOK_PARTS):.2f} s in the notebook, and {m - r:+.2f} s in all vs raw.")
    return text


def local_warm_reason(data: dict) -> str:
    parts = data["warm"]["magic"]["parts"]
    text = "largest parts (medians): " + _top_parts(parts, tuple(PART_LABELS), 4)
    if parts.get("proc_start_vs_call", -1) > 0:
        text += (f"; the worker processes started {parts['proc_start_vs_call']:.2f} s after the call, "
                 "i.e. no warm-pool process was ready, and the run paid interpreter start and imports")
    return text + "."


def steady_reason(data: dict, key_magic: str) -> str:
    w = data["warm"]
    m, r = w[key_magic]["steps_per_s"], w["raw"]["steps_per_s"]
    share = data.get("driver_cpu_share", {})
    load = data.get("load_average", {})
    text = (f"magic {m['median']:.0f} steps/s ({m['min']:.0f}-{m['max']:.0f}) vs elastic_launch {r['median']:.0f} "
            f"({r['min']:.0f}-{r['max']:.0f}). During a run the notebook process used "
            f"{100 * share.get(key_magic, 0):.0f} % of a core (channel pump, MLflow writer, system-metrics sampling) "
            f"vs {100 * share.get('raw', 0):.0f} % for "
            f"elastic_launch's agent, while the {data.get('n')} workers want {data.get('n')} of the machine's "
            f"{data.get('cpu_count')} cores; load average {load.get('start', 0):.1f} → {load.get('end', 0):.1f}")
    if _overlap((m["min"], m["max"]), (r["min"], r["max"])):
        text += "; the min-max ranges overlap, so the gap is within this machine's noise"
    return text + "."


def log_reason(data: dict) -> str:
    w = data["warm"]
    m, q = w["magic"]["steps_per_s"], w["magic_nolog"]["steps_per_s"]
    share = data.get("driver_cpu_share", {})
    text = (f"with ctx.log every step {m['median']:.0f} steps/s ({m['min']:.0f}-{m['max']:.0f}), without "
            f"{q['median']:.0f} ({q['min']:.0f}-{q['max']:.0f}); the notebook process used "
            f"{100 * share.get('magic', 0):.0f} % of a core with logging vs {100 * share.get('magic_nolog', 0):.0f} % "
            f"without (MLflow writes), on {data.get('cpu_count')} cores that {data.get('n')} workers keep busy")
    if _overlap((m["min"], m["max"]), (q["min"], q["max"])):
        text += "; the min-max ranges overlap, so the gap is within this machine's noise"
    return text + "."


def immediate_reason(standby: dict) -> str:
    """Why a re-run started at once can be slower than a launch on an idle machine (both take over a launch)."""
    now, fresh = standby.get("magic_immediate") or {}, standby.get("magic_fresh") or {}
    ranges = [(s.get("ttfs") or {}) for s in (now, fresh)]
    overlap = _overlap(*[(r["min"], r["max"]) if r.get("min") is not None else None for r in ranges])
    return (f"re-run at once {_fmt(ranges[0])}, no workers waiting {_fmt(ranges[1])}; took waiting workers in "
            f"{now.get('claimed')} samples. The re-run takes over the next run's launch, started when the last run "
            "ended, so that launch shares the cores with the end of the last run (its workers' exit, the MLflow "
            "run's close); the launch with none waiting starts on an idle machine"
            + ("; the min-max ranges overlap, so the gap is within this machine's noise" if overlap else ""))


def targets(results: dict, n: int) -> list[dict]:
    rows: list[dict] = []

    def add(target: str, wanted: str, measured: float | None, limit: float | None, above_ok: bool, unit: str,
            reason: callable, fmt: str = "{:.2f}") -> None:
        row = {"target": target, "wanted": wanted, "measured": None, "met": None, "missed_by": None, "reason": None}
        if measured is not None and limit is not None:
            met = measured >= limit if above_ok else measured <= limit
            row.update(measured=measured, limit=limit, met=met, measured_text=fmt.format(measured) + unit)
            if not met:
                gap = (limit - measured) if above_ok else (measured - limit)
                row["missed_by"] = f"{fmt.format(gap)}{unit} ({100 * gap / limit:.0f} % of the target)"
                try:
                    row["reason"] = reason()
                except Exception as exc:  # a reason is a summary of numbers; never lose the row for it
                    row["reason"] = f"(no breakdown: {type(exc).__name__}: {exc})"
        rows.append(row)

    local = _data(results, f"local_n{n}")
    for backend, data in (("local", local), ("spark", _data(results, "spark")), ("ray", _data(results, "ray"))):
        for mode in ("cold", "warm"):
            ratio = (data or {}).get(mode, {}).get("ttfs_ratio") if data else None
            add(f"{backend}, {mode}: time to first step magic / {RAW_NAMES[backend]}", "≤ 1.05", ratio, 1.05, False, "",
                lambda b=backend, d=data, m=mode: ratio_reason(d, b, m))
    add(f"local, warm: time to first step (-n {n})", "≤ 0.8 s", _median(local, "warm", "magic") if local else None,
        0.8, False, " s", lambda: local_warm_reason(local))
    b2b = (local or {}).get("back_to_back_ttfs")
    later = max(b2b[1:]) if b2b and len(b2b) > 1 else None
    add("local, back to back: 2nd and 3rd run started the moment the last returned, "
        f"slowest time to first step (-n {n})",
        "≤ 0.8 s", later, 0.8, False, " s",
        lambda: f"back-to-back times to first step {', '.join(f'{t:.2f}' for t in b2b)} s")
    cold = _median(local, "cold", "magic") if local else None
    add(f"local, back to back: no run slower than the cold first run (-n {n})",
        f"≤ {cold:.2f} s" if cold else "≤ cold", max(b2b) if b2b else None, cold, False, " s",
        lambda: f"back-to-back times to first step {', '.join(f'{t:.2f}' for t in b2b)} s, cold {cold:.2f} s")
    for backend in ("spark", "ray"):
        data = _data(results, backend)
        raw = _median(data, "warm", "raw") if data else None
        add(f"{backend}, warm: magic's time to first step ≤ half of {RAW_NAMES[backend]}'s",
            f"≤ {raw / 2:.2f} s (half of {raw:.2f} s)" if raw else "≤ half of raw",
            _median(data, "warm", "magic") if data else None, raw / 2 if raw else None, False, " s",
            lambda b=backend, d=data: half_raw_reason(d, b))
    for backend, factor in (("spark", 0.15), ("ray", 0.05)):  # issue 15: re-runs on waiting workers
        data = _data(results, backend) or {}
        standby = data.get("standby") or {}
        raw_entries = [x["entry"] for x in (data.get("samples", {}).get("warm", {}).get("raw") or []) if "entry" in x]
        raw_entry = statistics.median(raw_entries) if raw_entries else None
        entry = (standby.get("magic") or {}).get("entry", {}).get("median")
        limit = min(0.5, factor * raw_entry) if raw_entry else None
        add(f"{backend}, warm re-run on waiting workers: call → function entry ≤ 0.5 s and ≤ {factor} × "
            f"{RAW_NAMES[backend]}'s", f"≤ {limit:.2f} s" if limit else "≤ 0.5 s", entry, limit, False, " s",
            lambda s=standby: f"took waiting workers in {(s.get('magic') or {}).get('claimed')} of "
            f"{(s.get('magic') or {}).get('entry', {}).get('n')} samples")
        immediate = (standby.get("magic_immediate") or {}).get("ttfs", {}).get("median")
        fresh = (standby.get("magic_fresh") or {}).get("ttfs", {}).get("median")
        cold = _median(data, "cold", "magic") if data else None
        add(f"{backend}: re-run started the moment the last returned, time to first step ≤ the cold first run",
            f"≤ {cold:.2f} s" if cold else "≤ cold", immediate, cold, False, " s",
            lambda s=standby, c=cold: f"re-run at once {_fmt((s.get('magic_immediate') or {}).get('ttfs'))}, "
            f"cold {c:.2f} s")
        add(f"{backend}: re-run started the moment the last returned, time to first step ≤ a launch with none waiting",
            f"≤ {fresh:.2f} s" if fresh else "≤ fresh", immediate, fresh, False, " s",
            lambda s=standby: immediate_reason(s))
        rates = [(standby.get(k) or {}).get("steps_per_s", {}).get("median") for k in ("magic", "magic_fresh")]
        add(f"{backend}: steady steps/s on waiting workers / on a fresh launch", "≥ 0.95",
            rates[0] / rates[1] if all(rates) else None, 0.95, True, "", lambda r=rates: f"steps/s {r}", "{:.3f}")
    own = (_data(results, "ray") or {}).get("own_ray") or {}
    own_magic, own_raw = (own.get("magic") or {}).get("entry", {}), (own.get("raw") or {}).get("entry", {})
    own_limit = min(0.5, 0.05 * own_raw["median"]) if own_raw.get("median") else None
    add("ray, after the notebook's own ray.init(): call → function entry ≤ 0.5 s and ≤ 0.05 × TorchTrainer.fit's "
        "(warm re-runs on the user's own Ray, issue 23)", f"≤ {own_limit:.2f} s" if own_limit else "≤ 0.5 s",
        own_magic.get("median"), own_limit, False, " s",
        lambda o=own: f"took waiting workers in {(o.get('magic') or {}).get('claimed')} of "
        f"{(o.get('magic') or {}).get('entry', {}).get('n')} runs")
    add(f"local: steady steps/s magic / raw (same loop, -n {n})", "≥ 0.98", (local or {}).get("steady_ratio"), 0.98,
        True, "", lambda: steady_reason(local, "magic_nolog"), "{:.3f}")
    log_cost = (local or {}).get("log_cost")
    add("local: cost of ctx.log every step", "≤ 2 %", 100 * log_cost if log_cost is not None else None, 2.0, False,
        " %", lambda: log_reason(local), "{:.1f}")
    log = _data(results, "ctx_log") or {}
    for backend, counts in (log.get("backends") or {}).items():
        for count, stat in counts.items():
            rate = stat["median_nolog"]
            cost = stat.get("block_cost", stat["cost"])  # within one run: the drift between runs gone
            wanted = f"≤ {100 * LOG_COST_LIMIT:.0f} % at ≥ {LOG_COST_RATE:.0f} steps/s"
            row = {"target": f"{backend} -n {count}: cost of ctx.log every step in a fast loop (without it "
                             f"{rate:.0f} steps/s)", "wanted": wanted, "measured": 100 * cost,
                   "limit": 100 * LOG_COST_LIMIT,
                   "measured_text": (f"{100 * stat['block_cost']:.1f} % (1 s blocks within one run, median of "
                                     f"{len(stat['block_costs'])} pairs; quartiles {100 * stat['block_cost_q1']:.1f} "
                                     f"to {100 * stat['block_cost_q3']:.1f} %); " if "block_cost" in stat else "")
                   + f"run pairs: {100 * stat['cost']:.1f} % (median of {len(stat['pair_costs'])}; quartiles "
                     f"{100 * stat['cost_q1']:.1f} to {100 * stat['cost_q3']:.1f} %)",
                   "met": cost <= LOG_COST_LIMIT and rate >= LOG_COST_RATE,
                   "missed_by": None, "reason": None}
            if not row["met"]:
                row["missed_by"] = (f"{100 * (cost - LOG_COST_LIMIT):.1f} %" if cost > LOG_COST_LIMIT
                                    else f"the loop ran {rate:.0f} steps/s, under {LOG_COST_RATE:.0f}")
                cpu = (f"; rank 0's own CPU per step {stat['worker_cpu_us_log']:.0f} µs with, "
                       f"{stat['worker_cpu_us_nolog']:.0f} µs without; the notebook process used "
                       f"{100 * stat['notebook_cpu_log']:.1f} % of a core with, "
                       f"{100 * stat['notebook_cpu_nolog']:.1f} % without" if stat.get("worker_cpu_us_log") is not None
                       else "")
                row["reason"] = (f"with ctx.log {stat['median_log']:.0f} steps/s ({stat['min_log']:.0f}-"
                                 f"{stat['max_log']:.0f}), without {rate:.0f} ({stat['min_nolog']:.0f}-"
                                 f"{stat['max_nolog']:.0f}){cpu}" + ("; the min-max ranges overlap, so the gap is "
                                 "within this machine's noise" if _overlap((stat["min_log"], stat["max_log"]),
                                                                          (stat["min_nolog"], stat["max_nolog"]))
                                                                   else "") + ".")
            rows.append(row)
    stops = _data(results, "interrupt") or {}
    for backend, stat in (stops.get("backends") or {}).items():
        backs, failure = stat["back_s"], stat.get("failure")
        add(f"{backend}: the kernel's interrupt → the cell back, slowest of {len(backs)} (of {stat['count']}), "
            "nothing of the run alive 10 s later", "< 2 s, every time", None if failure else max(backs, default=None),
            2.0, False, " s", lambda failure=failure: failure or "")
        if failure:
            rows[-1].update(met=False, measured_text=f"{len(backs)} of {stat['count']} passed",
                            missed_by="a failed cycle", reason=failure)
    data_targets(results, add)
    output_targets(results, add)
    sweep_targets(results, add)
    restart_targets(results, add)
    knob_targets(results, add)
    big_model_targets(results, add)
    lags = _data(results, "chart_lag") or {}
    for key, which in (("chart_lag", "a kernel's first run"), ("chart_lag_later", "later runs")):
        lag = lags.get(key, {})
        if key == "chart_lag_later" and not lag:
            continue
        add(f"live chart lag (ctx.log on a worker → chart data), median, {which}", "≤ 1 s", lag.get("median_s"), 1.0,
            False, " s", lambda lag=lag: f"p95 {lag.get('p95_s', 0):.2f} s, max {lag.get('max_s', 0):.2f} s over "
            f"{int(lag.get('n', 0))} points.")
    return rows


def data_targets(results: dict, add: callable) -> None:
    """Issue 24's targets, from bench_data.py: ctx.data against raw pyarrow and Ray Data, the notebook's RSS on a
    ≥ 1 GB Spark DataFrame on every backend, and no second write of a staged DataFrame."""
    data = _data(results, "data") or {}
    parquet, ray, rss = data.get("parquet") or {}, data.get("ray") or {}, data.get("rss") or {}
    size = (data.get("dataset") or {}).get("tensor_bytes", 0) / 2**30

    def rates(section: dict, key: str) -> str:
        return ", ".join(f"{name} {value:,.0f}" for name, value in (section.get(key) or {}).items()) + " rows/s"

    add(f"data: ctx.data rows/s per rank / raw pyarrow, {size:.2f} GiB numeric Parquet (-n 2, local, in order)",
        "≥ 0.8", parquet.get("ratio"), 0.8, True, "", lambda: rates(parquet, "median_rows_per_s"), "{:.2f}")
    add("data: ctx.data rows/s per rank / Ray Data's iter_torch_batches in a raw TorchTrainer (2nd epoch)", "≥ 0.9",
        ray.get("ratio"), 0.9, True, "", lambda: rates(ray, "median_last_epoch"), "{:.2f}")
    gib = rss.get("tensor_bytes", 0) / 2**30
    for label, run in (rss.get("runs") or {}).items():
        add(f"data: notebook RSS growth while a run trains on a {gib:.2f} GiB Spark DataFrame ({label})", "< 200 MB",
            run.get("rss_growth_mb"), 200.0, False, " MB",
            lambda run=run: f"RSS {run.get('rss_before_mb', 0):.0f} MB before the call", "{:.0f}")
    restaged = rss.get("restaged")
    add("data: later runs of the same DataFrame (any backend) that wrote it again", "0", len(restaged)
        if restaged is not None else None, 0, False, "", lambda: f"written again by {restaged}", "{:.0f}")


def output_targets(results: dict, add: callable) -> None:
    """Issue 39's targets, from bench_outputs.py: rows/s scoring Parquet with ctx.write on 2 ranks against one process
    and against the faster of Spark's predict_batch_udf and Ray Data's map_batches."""
    data = _data(results, "outputs") or {}
    ratios, methods = data.get("ratios") or {}, data.get("methods") or {}
    limits = ratios.get("targets") or {}  # bench_outputs.py's TARGETS
    size = (data.get("dataset") or {}).get("tensor_bytes", 0) / 2**30

    def rates() -> str:
        return ", ".join((f"{name} {m['median_rows_per_s']:,.0f}" if m.get("median_rows_per_s") else f"{name} WRONG")
                         + " (load average {:.1f} → {:.1f})".format(*m["load_average"])
                         for name, m in methods.items()) + " rows/s (medians)"

    for key, what in (("vs_one_process", "one process"),
                      ("vs_faster_rival", "the faster of Spark predict_batch_udf and Ray Data map_batches "
                                          f"({ratios.get('faster_rival') or '?'})")):
        limit = limits.get(key)
        add(f"outputs: rows/s scoring {size:.2f} GiB (as tensors) of Parquet, ctx.write -n 2 / {what}",
            f"≥ {limit}" if limit else "≥ target", ratios.get(key), limit, True, "", rates, "{:.2f}")


def sweep_targets(results: dict, add: callable) -> None:
    """Issue 36's targets, from bench_sweep.py: a sweep's wall time on Ray against Ray Tune driving Ray Train, and the
    optimizer steps a pruned sweep runs against the same sweep unpruned."""
    data = _data(results, "sweep") or {}
    ray, prune = data.get("ray") or {}, data.get("prune") or {}
    ray_trials, prune_trials = len(ray.get("lrs") or []) or "?", len(prune.get("grid") or []) or "?"

    def times() -> str:
        sides = "; ".join(f"{name} {ray[name]['wall_s']:.1f} s (per trial median {ray[name]['median_trial_s']:.2f} s, "
                          f"first {ray[name]['trial_s'][0]:.2f} s)"
                          for name in ("sweep", "runs", "tune") if name in ray)
        return (f"{sides}. The sweep launches Ray Train workers once (its first trial) and runs every later trial on "
                "them; Ray Tune starts a trial actor, a Train controller and new worker actors for every trial.")

    def steps() -> str:
        pruned = prune["pruned"]
        stopped = ", ".join(f"{lr}: {ranks[0]}" for lr, ranks in pruned["steps"].items())
        return (f"{pruned['total_steps']} steps per rank pruned vs {prune['unpruned']['total_steps']} unpruned "
                f"({prune['steps_per_trial']} a trial, {prune['pause_s']} s apart); steps per rate {stopped}; states "
                f"{', '.join(pruned['states'])}. A pruned trial's ranks stop some steps after the decision (docs/"
                "sweeps.md): the more steps a trial has, the more pruning saves.")

    add(f"sweep on Ray, {ray_trials} trials of 2 workers one at a time: wall time, dtrain_magic.sweep / Ray Tune "
        "driving Ray Train (a TorchTrainer.fit per trial)", "≤ 0.5", ray.get("sweep_vs_tune"), 0.5, False, "", times)
    add(f"sweep, {prune_trials} trials, all but 2 diverging: optimizer steps with MedianPruner / unpruned (local, "
        "2 ranks)", "≤ 0.5", prune.get("ratio"), 0.5, False, "", steps)


def restart_targets(results: dict, add: callable) -> None:
    """Issue 37's targets, from bench_restart.py: on the same Ray, the seconds from a lost worker to the next step and
    the steps lost, the magic's restart against Ray Train's own elastic restart."""
    sides = (_data(results, "restart") or {}).get("sides") or {}
    ray, raw = sides.get("ray") or {}, sides.get("ray_train") or {}

    def ratio(key: str) -> float | None:
        mine, theirs = ray.get(key), raw.get(key)
        return None if mine is None or not theirs else mine / theirs

    def every_side() -> str:
        return "; ".join(f"{name} {side['recovery_s']:.2f} s, {side['steps_lost']} steps lost (resumed at step "
                         f"{side['resumed_at_step']})" if "recovery_s" in side else f"{name}: {side.get('error')}"
                         for name, side in sides.items())

    add("a lost worker on Ray (2 workers, rank 1 SIGKILLed): seconds to the next step, the magic's restart / Ray "
        "Train's elastic restart", "≤ 1.0", ratio("recovery_s"), 1.0, False, "", every_side)
    add("a lost worker on Ray: steps lost, the magic / Ray Train (a checkpoint every 10 steps)", "≤ 1.0",
        ratio("steps_lost"), 1.0, False, "", every_side)


def knob_targets(results: dict, add: callable) -> None:
    """Issue 38's, from bench_knobs.py: what --ac full saves, and the magic's memory against accelerate's with the
    same settings (ZeRO-3: its DeepSpeed plugin; on a CPU its FSDP plugin runs DDP, no like-for-like)."""
    rows = {row["case"]: row for row in (_data(results, "knobs") or {}).get("rows", [])}

    def described(cases: list[str], key: str) -> str:
        return "; ".join(f"{case} {rows[case][key]:.2f}" for case in cases if (rows.get(case) or {}).get(key))

    ac = [case for case in ("fsdp:ac_full", "zero3:ac_full") if (rows.get(case) or {}).get("peak_vs_none")]
    add("GPT-2, 2 processes: --ac full peak per rank / the same strategy without it (FSDP, ZeRO-3: the larger)",
        "≤ 0.9", max((rows[case]["peak_vs_none"] for case in ac), default=None), 0.9, False, "",
        lambda: described(ac, "peak_vs_none"))
    same = [case for case in ("zero3:none", "zero3:ac_full", "zero3:clip_grad", "zero3:lora")
            if (rows.get(case) or {}).get("peak_vs_accelerate")]
    add("GPT-2, 2 processes, ZeRO-3 with the same settings (none, --ac full, --clip-grad, LoRA): peak per rank, the "
        "magic / accelerate's DeepSpeed plugin (the largest)", "≤ 1.05",
        max((rows[case]["peak_vs_accelerate"] for case in same), default=None), 1.05, False, "",
        lambda: described(same, "peak_vs_accelerate"))


def data_section(data: dict) -> list[str]:
    """bench_data.py's numbers as a table (the report's data section)."""
    lines = ["| measurement | value |", "|---|---|"]
    dataset, parquet, ray, rss = (data.get(k) or {} for k in ("dataset", "parquet", "ray", "rss"))
    if dataset:
        lines.append(f"| Parquet dataset | {dataset['rows']:,} rows, {dataset['tensor_bytes'] / 2**30:.2f} GiB as "
                     f"tensors, {dataset['parquet_bytes'] / 2**30:.2f} GiB in {dataset['files']} files |")
    for name, value in (parquet.get("median_rows_per_s") or {}).items():
        lines.append(f"| Parquet, rows/s per rank, {name} (median) | {value:,.0f} |")
    for name, value in (ray.get("median_last_epoch") or {}).items():
        lines.append(f"| Ray ({ray.get('bytes', 0) / 2**20:.0f} MB), rows/s per rank in the 2nd epoch, {name} | "
                     f"{value:,.0f} |")
    if rss:
        lines.append(f"| Spark DataFrame | {rss['rows']:,} rows, {rss['tensor_bytes'] / 2**30:.2f} GiB as tensors, "
                     f"{rss['parquet_bytes'] / 2**30:.2f} GiB as staged Parquet |")
        lines.append(f"| staging it (Spark writes Parquet once) | {rss['staging_s']:.1f} s |")
        for label, run in rss["runs"].items():
            staged = "reused the copy" if run["reused"] else f"staged in {run['staging_s']:.1f} s"
            lines.append(f"| {label}: notebook RSS growth, rows trained, run time | {run['rss_growth_mb']:.0f} MB, "
                         f"{run['rows_trained']:,}, {run['seconds']:.1f} s ({staged}) |")
    return lines
def _rows(results: dict, name: str) -> dict[str, dict]:
    data = _data(results, name) or {}
    return {row["name"]: row for row in data.get("rows", []) if "error" not in row}


def big_model_targets(results: dict, add: callable) -> None:
    """Issue 26: peak memory per rank (bench_big_models.py) against DDP / one process, and the estimate's error."""
    def ratio(rows: dict, name: str, base: str) -> float | None:
        return rows[name]["peak"] / rows[base]["peak"] if name in rows and base in rows else None

    def why(rows: dict, name: str) -> str:
        row = rows.get(name, {})
        parts = ", ".join(f"{what} {size / 2**20:.0f} MiB" for what, size in row.get("est_parts", []))
        return (f"peak {row.get('peak', 0) / 2**30:.2f} GiB against an estimate of {row.get('estimate', 0) / 2**30:.2f}"
                f" GiB (states {row.get('est_states', 0) / 2**30:.2f} GiB; buffers: {parts or 'none'})")

    def worst_estimate(rows: dict) -> tuple[float | None, str]:
        errors = {name: abs(row["estimate"] / row["peak"] - 1) for name, row in rows.items() if row.get("peak")}
        if not errors:
            return None, ""
        name = max(errors, key=errors.get)
        return 100 * errors[name], name

    mlp = _rows(results, "big_mlp")
    for name, wanted in (("zero3", 0.6), ("zero3_deferred", 0.6), ("fsdp", 0.55), ("fsdp_deferred", 0.55)):
        built = "built deferred" if name.endswith("deferred") else "built the plain way"
        add(f"134 M-param MLP, 2 processes: {name.split('_')[0].upper().replace('ZERO3', 'ZeRO-3')} peak per rank "
            f"({built}) / DDP's", f"≤ {wanted}", ratio(mlp, name, "ddp"), wanted, False, "",
            lambda n=name: why(mlp, n))
    worst, name = worst_estimate(mlp)
    add("134 M-param MLP: the estimate within ±25 % of the measured peak, every strategy (worst)", "≤ 25 %", worst,
        25.0, False, " %", lambda n=name: f"worst: {n}: {why(mlp, n)}", "{:.0f}")
    large = _rows(results, "big_large")
    for name, label, wanted in (("fsdp_deferred", "FSDP", 0.35), ("zero3_deferred", "ZeRO-3", 0.35),
                                ("tp2_deferred", "--tp 2", 0.6)):
        add(f"0.5 B-param MLP, 4 processes: {label} (deferred build, sharded load) peak per rank / one process's",
            f"≤ {wanted}", ratio(large, name, "one_process"), wanted, False, "", lambda n=name: why(large, n))
    worst, name = worst_estimate(large)
    add("0.5 B-param MLP: the estimate within ±25 % of the measured peak (worst)", "≤ 25 %", worst, 25.0, False,
        " %", lambda n=name: f"worst: {n}: {why(large, n)}", "{:.0f}")


# -- report ----------------------------------------------------------------------------------------------

def _fmt(stat: dict | None, unit: str = " s", digits: int = 2) -> str:
    if not stat or stat.get("median") is None:
        return "-"
    return f"{stat['median']:.{digits}f}{unit} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def comparison_table(data: dict, backend: str) -> list[str]:
    raw_name = RAW_NAMES[backend]
    lines = [f"| | magic | {raw_name} | magic / raw |", "|---|---|---|---|"]
    for mode in ("cold", "warm"):
        s = data.get(mode) or {}
        if "ttfs_ratio" not in s:
            continue
        runs = s["magic"]["ttfs"]["n"]
        lines.append(f"| {mode}, call → first step (n={runs}) | {_fmt(s['magic']['ttfs'])} | "
                     f"{_fmt(s['raw']['ttfs'])} | {s['ttfs_ratio']:.2f} |")
        lines.append(f"| {mode}, total | {_fmt(s['magic']['total'])} | {_fmt(s['raw']['total'])} | "
                     f"{s['total_ratio']:.2f} |")
    if backend == "local" and "magic_nolog" in data.get("warm", {}):
        w = data["warm"]
        lines.append(f"| warm, steady steps/s (no logging) | {_fmt(w['magic_nolog']['steps_per_s'], '', 0)} | "
                     f"{_fmt(w['raw']['steps_per_s'], '', 0)} | {data['steady_ratio']:.3f} |")
        lines.append(f"| warm, steady steps/s (ctx.log every step) | {_fmt(w['magic']['steps_per_s'], '', 0)} | | "
                     f"{data['steady_ratio_with_log']:.3f} |")
    return lines


def parts_table(data: dict, backend: str) -> list[str]:
    raw_name = RAW_NAMES[backend]
    columns = [(mode, via) for mode in ("cold", "warm") for via in ("magic", "raw")
               if (data.get(mode) or {}).get(via, {}).get("parts")]
    if not columns:
        return []
    keys = [k for k in PART_LABELS if any(k in data[m][v]["parts"] for m, v in columns)]
    header = " | ".join(f"{m} {'magic' if v == 'magic' else raw_name}" for m, v in columns)
    lines = [f"| part of the time to first step (medians, s) | {header} |", "|---|" + "---|" * len(columns)]
    for key in keys:
        cells = [f"{data[m][v]['parts'][key]:.2f}" if key in data[m][v]["parts"] else "" for m, v in columns]
        lines.append(f"| {PART_LABELS[key].strip()} | {' | '.join(cells)} |")
    cells = [f"{data[m][v]['parts']['proc_start_vs_call']:+.2f}" if "proc_start_vs_call" in data[m][v]["parts"] else ""
             for m, v in columns]
    lines.append(f"| (worker process start, relative to the call) | {' | '.join(cells)} |")
    return lines


def scaling_table(results: dict, n: int) -> list[str]:
    rows = []
    for count in sorted({1, n}):
        data = _data(results, f"local_n{count}")
        if not data:
            continue
        w, c = data["warm"], data["cold"]
        rows.append(f"| {count} | {_fmt(w['raw']['steps_per_s'], '', 0)} | "
                    f"{_fmt(w['magic_nolog']['steps_per_s'], '', 0)} | {_fmt(w['magic']['steps_per_s'], '', 0)} | "
                    f"{_fmt(c['magic']['ttfs'])} | {_fmt(c['raw']['ttfs'])} | "
                    f"{_fmt(w['magic']['ttfs'])} | {_fmt(w['raw']['ttfs'])} |")
    if not rows:
        return []
    return ["| processes | raw steps/s | magic steps/s | magic + ctx.log steps/s | cold first step, magic | "
            "cold first step, raw | warm first step, magic | warm first step, raw |",
            "|---|---|---|---|---|---|---|---|", *rows]


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def saved_results_path(report_to: str | None) -> str:
    """Where the results of the report being written are kept: beside the committed report (``--report-to X.md``:
    ``X.json``), else under benchmarks/results."""
    if report_to:
        return os.path.splitext(report_to)[0] + ".json"
    return os.path.join(RESULTS, "results.json")


def merged(new: dict, total_s: float, report_to: str | None) -> tuple[dict, float]:
    """``--merge``: the earlier results (`saved_results_path`) with this run's benchmarks replacing theirs: a report
    built in parts, each benchmark saying when it was measured."""
    path = saved_results_path(report_to)
    if not os.path.exists(path):
        return new, total_s
    with open(path) as handle:
        earlier = json.load(handle)
    kept = {name: entry for name, entry in earlier["benchmarks"].items() if name not in new}
    return {**kept, **new}, total_s + sum(entry.get("seconds", 0.0) for entry in kept.values())


def run_meta(args: argparse.Namespace) -> dict:
    """When, where and how the numbers are measured: kept in results.json, so a report rewritten from it
    (--report-from) says when the numbers were measured, not when the report was written."""
    return {"measured_at": _now(),
            "command": " ".join(["benchmarks/run_all.py", *sys.argv[1:]]),
            "cpu_count": os.cpu_count(), "gpu": bool(args.gpu), "quick": bool(args.quick),
            "num_processes": args.num_processes}


def kept_from_earlier(results: dict, meta: dict) -> dict:
    """The benchmarks of a merged report that an earlier run measured (before this run began)."""
    began = meta.get("measured_at") or ""
    return {name: entry for name, entry in results.items() if (entry.get("measured_at") or "") < began}


def took(results: dict, meta: dict, total_s: float) -> str:
    """How long the run took; for a merged report, also the time of every benchmark it reports."""
    kept_s = sum(entry.get("seconds", 0.0) for entry in kept_from_earlier(results, meta).values())
    if not kept_s:
        return f"took {total_s / 60:.1f} min"
    return (f"took {(total_s - kept_s) / 60:.1f} min ({total_s / 60:.1f} min with the benchmarks kept from earlier "
            "runs)")


def measured_in_parts(results: dict, meta: dict) -> str:
    """For a report merged from several runs (``--merge``): the benchmarks kept from earlier runs, when each was
    measured, and the load then (an entry measured before this run began is an earlier run's)."""
    kept = kept_from_earlier(results, meta)
    if not kept:
        return ""
    parts = [f"{name} at {entry.get('measured_at') or 'an unknown time'}"
             + (f" (load {entry['load'][0]:.1f} to {entry['load'][1]:.1f})" if entry.get("load") else "")
             for name, entry in kept.items()]
    return " Measured in parts (`--merge`); kept from earlier runs: " + "; ".join(parts) + "."


def markdown(results: dict, rows: list[dict], meta: dict, total_s: float, load: tuple) -> str:
    n = meta["num_processes"]
    measured_at = meta.get("measured_at") or "an unknown time (results.json written before run_all.py recorded it)"
    lines = ["# dtrain_magic benchmarks", "",
             "<!-- Generated by benchmarks/run_all.py; do not edit by hand: rerun it, or rewrite this file with "
             "`benchmarks/run_all.py --report-from results.json --report-to PATH`. -->", "",
             f"Machine: {meta.get('cpu_count') or '?'} CPU cores{', GPUs' if meta.get('gpu') else ''}; measured at "
             f"{measured_at}; `{meta.get('command') or 'benchmarks/run_all.py'}` "
             f"{took(results, meta, total_s)}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end. "
             "Values are medians with (min-max); a shared 2-core machine is noisy, so rerun before drawing conclusions."
             + (" **--quick: one sample of each and few steps, a check that everything runs; "
                "the numbers mean nothing.**" if meta.get("quick") else "")
             + measured_in_parts(results, meta),
             "", "## Targets", "", "| target | wanted | measured | met? |", "|---|---|---|---|"]
    for row in rows:
        met = "not measured" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['target']} | {row['wanted']} | {row.get('measured_text', '-')} | {met} |")
    missed = [row for row in rows if row["met"] is False]
    if missed:
        lines += ["", "Missed:", ""]
        for row in missed:
            lines.append(f"- **{row['target']}**: missed by {row['missed_by']}. Why: {row['reason']}")
    for backend, name in (("local", f"local_n{n}"), ("spark", "spark"), ("ray", "ray")):
        data = _data(results, name)
        if not data:
            continue
        lines += ["", f"## {backend}" + (f" (-n {n})" if backend == "local" else ""), ""]
        lines += comparison_table(data, backend) + [""] + parts_table(data, backend)
        if backend == "local":
            lines += ["", "Cold: the first call of a fresh Python process (no warm pool yet: the magic starts its "
                      "workers directly and fills the pool after the run); warm: later calls, after waiting for the "
                      f"machine to go idle. A new MLflow tracking DB costs {data.get('new_tracking_db_s', 0):.2f} s "
                      "once, on its first use (cold samples use an existing one, as after a kernel restart); a fresh "
                      f"worker's interpreter + imports alone take {data.get('worker_imports_s', 0):.2f} s. "
                      f"Steady steps/s: {data.get('steps')} steps per run, measured after the first 10."]
        elif backend == "spark":
            lines += ["", "Cold: each sample a fresh process that starts its own SparkSession "
                      f"({data['cold_runs']} per side); warm: {data['repeats']} per side on one session "
                      f"(started in {data['session_start_s']:.1f} s, not counted)."]
        else:
            init = data.get("ray_init_s", {})
            lines += ["", f"Cold: the first run on a fresh Ray instance, {data['cold_runs']} per side "
                      "(--cold-runs; each costs about 30 s on 2 cores); "
                      f"ray.init not included ({init.get('magic', 0):.1f} s / "
                      f"{init.get('raw', 0):.1f} s). Warm: {data['repeats']} per side."]
    data = _data(results, "data")
    if data:
        lines += ["", "## data (`--data`, `ctx.data`)", ""] + data_section(data)
    scaling = scaling_table(results, n)
    if scaling:
        lines += ["", "## Scaling (local backend, warm steps/s and time to first step)", ""] + scaling
    for name, entry in results.items():
        if entry["rc"] == 0 and name.startswith(("local_", "spark", "ray")):
            continue  # tabulated above; the whole output is in results.json
        lines += ["", f"### output of {name} (`benchmarks/{entry['script']} {' '.join(entry['args'])}`, "
                      f"{entry['seconds']} s)", ""]
        if entry["rc"] != 0:
            lines += ["Failed:", "", "```", entry.get("error", "").strip()[-1500:], "```"]
        lines += ["```", *entry["summary"], "```"]
    return "\n".join(lines) + "\n"


def chart(results: dict, n: int, path: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=2, cols=2, subplot_titles=(
        "time to first step: magic / raw (lower is better; target ≤ 1.05)",
        "time to first step, medians with min-max (s)",
        "parts of the time to first step (medians, s)",
        "steady steps/s, local backend (1 and N processes)"))
    backends = [(b, name, _data(results, name))
                for b, name in (("local", f"local_n{n}"), ("spark", "spark"), ("ray", "ray"))]
    backends = [(b, name, d) for b, name, d in backends if d]
    for mode in ("cold", "warm"):
        figure.add_trace(go.Bar(name=f"{mode} ratio", x=[b for b, _, _ in backends],
                                y=[(d.get(mode) or {}).get("ttfs_ratio") for _, _, d in backends]), row=1, col=1)
    figure.add_hline(y=1.05, line_dash="dash", row=1, col=1)
    for mode in ("cold", "warm"):
        for via in ("magic", "raw"):
            xs, ys, lo, hi = [], [], [], []
            for b, _, d in backends:
                stat = ((d.get(mode) or {}).get(via) or {}).get("ttfs")
                if stat and stat.get("median") is not None:
                    xs.append(b)
                    ys.append(stat["median"])
                    lo.append(stat["median"] - stat["min"])
                    hi.append(stat["max"] - stat["median"])
            figure.add_trace(go.Bar(name=f"{mode} {via}", x=xs, y=ys,
                                    error_y=dict(type="data", array=hi, arrayminus=lo)), row=1, col=2)
    labels, stacks = [], {}
    for b, _, d in backends:
        for mode in ("cold", "warm"):
            for via in ("magic", "raw"):
                parts = ((d.get(mode) or {}).get(via) or {}).get("parts") or {}
                if not parts:
                    continue
                labels.append(f"{b} {mode} {via}")
                for key in PART_LABELS:
                    if key not in SUB_PARTS:
                        stacks.setdefault(key, []).append(max(0.0, parts.get(key, 0.0)))
    base = [0.0] * len(labels)
    for key, values in stacks.items():
        if any(values):  # stacked by hand (same offsetgroup, each bar starting where the previous ended)
            figure.add_trace(go.Bar(name=PART_LABELS[key].strip(), x=labels, y=values, base=list(base),
                                    offsetgroup="parts"),
                             row=2, col=1)
            base = [b + v for b, v in zip(base, values, strict=True)]
    for via, key in (("raw", "raw"), ("magic", "magic_nolog"), ("magic + ctx.log", "magic")):
        xs, ys = [], []
        for count in sorted({1, n}):
            d = _data(results, f"local_n{count}")
            if d:
                xs.append(f"-n {count}")
                ys.append(d["warm"][key]["steps_per_s"]["median"])
        figure.add_trace(go.Bar(name=f"steps/s {via}", x=xs, y=ys), row=2, col=2)
    figure.update_layout(title="dtrain_magic vs the raw backends", barmode="group", height=950)
    figure.write_html(path, include_plotlyjs="cdn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {','.join(ORDER)} (local_nN with -n N)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="warm samples per side (and cold ones for local) (default 3)")
    parser.add_argument("-n", "--num-processes", type=int, default=2,
                        help="processes for the multi-process runs (default 2); local also runs with -n 1 (scaling)")
    parser.add_argument("--gpu", action="store_true",
                        help="run local, spark, ray and strategies on GPUs (one per process)")
    parser.add_argument("--spark-cold-runs", type=int, default=3,
                        help="Spark cold samples per side (default 3, ~17 s each)")
    parser.add_argument("--ray-cold-runs", type=int, default=1,
                        help="Ray cold samples per side (default 1: each costs ~33 s with its fresh Ray instance)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that everything runs: 1 sample of each, few steps "
                             "(about 5 min; the numbers mean nothing)")
    parser.add_argument("--report-from", metavar="RESULTS_JSON", default=None,
                        help="write report.md and chart.html again from a results.json, running nothing")
    parser.add_argument("--merge", action="store_true",
                        help="keep the earlier results of the benchmarks not run now (from the --report-to report's "
                             ".json beside it, else benchmarks/results/results.json): a report built in parts")
    parser.add_argument("--report-to", metavar="PATH", default=None,
                        help="also write the report (markdown) to PATH, "
                             "e.g. docs/benchmark-report.md (the committed one)")
    args = parser.parse_args()
    if args.report_from:
        with open(args.report_from) as handle:
            saved = json.load(handle)
        results, total_s = saved["benchmarks"], saved["seconds"]
        load = tuple(saved.get("load", (float("nan"), float("nan"))))
        # results.json from before "meta" existed: what the command line says (the time stays unknown)
        meta = saved.get("meta") or {**run_meta(args), "measured_at": None, "command": None}
        write_report(results, meta, total_s, load, args.report_to)
        return
    if args.quick:
        args.repeats, args.spark_cold_runs, args.ray_cold_runs = 1, 1, 1
    os.makedirs(RESULTS, exist_ok=True)
    plan = benchmarks(args)
    order = [name for name in (f"local_n{args.num_processes}", *ORDER[1:]) if name in plan]
    if args.only:
        wanted = args.only.split(",")
        unknown = [name for name in wanted if name not in plan]
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(order)}")
        order = [name for name in order if name in wanted]
    expected = sum(plan[name][2] for name in order)
    print(f"running {', '.join(order)}: expected about {expected / 60:.0f} min on a quiet 2-core machine "
          f"({', '.join(f'{name} ~{plan[name][2] / 60:.1f}' for name in order)} min); longer if the machine is busy",
          flush=True)
    meta = run_meta(args)
    load_start = os.getloadavg()[0]
    began = time.monotonic()
    results = {}
    for name in order:
        script, extra, estimate = plan[name]
        print(f"== {name}: benchmarks/{script} {' '.join(extra)} (expected ~{estimate:.0f} s)", flush=True)
        results[name] = run(name, script, extra)
        print("\n".join(results[name]["summary"][-12:]), flush=True)
        print(f"   ({results[name]['seconds']:.0f} s{', FAILED' if results[name]['rc'] else ''})", flush=True)
    total_s = time.monotonic() - began
    if args.merge:
        results, total_s = merged(results, total_s, args.report_to)
    write_report(results, meta, total_s, (load_start, os.getloadavg()[0]), args.report_to)


def write_report(results: dict, meta: dict, total_s: float, load: tuple, report_to: str | None = None) -> None:
    """results.json, report.md and chart.html under benchmarks/results (and the report at report_to), and the
    targets on stdout."""
    os.makedirs(RESULTS, exist_ok=True)
    n = meta["num_processes"]
    rows = targets(results, n)
    saved = {"benchmarks": results, "targets": rows, "seconds": total_s, "load": list(load), "meta": meta}
    for path in {os.path.join(RESULTS, "results.json"), saved_results_path(report_to)}:
        with open(path, "w") as handle:
            json.dump(saved, handle, indent=2)
    report = markdown(results, rows, meta, total_s, load)
    with open(os.path.join(RESULTS, "report.md"), "w") as handle:
        handle.write(report)
    if report_to:
        os.makedirs(os.path.dirname(os.path.abspath(report_to)), exist_ok=True)
        with open(report_to, "w") as handle:
            handle.write(report)
        print(f"wrote the report to {report_to}")
    chart(results, n, os.path.join(RESULTS, "chart.html"))
    print("\ntargets:")
    for row in rows:
        met = "not measured" if row["met"] is None else ("met" if row["met"] else f"MISSED by {row['missed_by']}")
        print(f"  {row['target']}: wanted {row['wanted']}, measured {row.get('measured_text', '-')}: {met}")
    print(f"wrote {RESULTS}/report.md, results.json, chart.html in {total_s / 60:.1f} min")


if __name__ == "__main__":
    main()
