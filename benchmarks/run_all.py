"""Run every benchmark, side by side with the raw backends, and write a report a user can read.

    .venv/bin/python benchmarks/run_all.py                 # all of them (about 15-25 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --only local,strategies --repeats 3

Writes benchmarks/results/report.md (tables with the targets), results.json (every number) and
chart.html (a plotly chart of the time-to-first-step ratios). Each benchmark is its own script, run in
its own Python process so one's warm state (SparkSession, Ray, warm pool) never helps another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# name -> (script, extra arguments); every script accepts --json PATH.
BENCHMARKS = {
    "local": ("bench_local.py", ["--repeats", "{repeats}"]),
    "spark": ("bench_spark.py", ["--repeats", "{repeats}"]),
    "ray": ("bench_ray.py", ["--warm", "{repeats}"]),
    "chart_lag": ("bench_chart_lag.py", []),
    "strategies": ("bench_strategies.py", []),
}

TARGETS = {
    "ttfs_ratio": ("magic/raw time to first step", "<= 1.05"),
    "warm_local_ttfs": ("warm time to first step, local", "<= 0.8 s"),
    "steady_ratio": ("steady steps/s magic/raw", ">= 0.98"),
    "log_cost": ("cost of ctx.log every step", "<= 2 %"),
    "chart_lag": ("chart lag median", "<= 1 s"),
}


def run(name: str, repeats: int) -> dict:
    script, extra = BENCHMARKS[name]
    out = os.path.join(RESULTS, f"{name}.json")
    if os.path.exists(out):
        os.remove(out)
    args = [a.format(repeats=repeats) for a in extra]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args, "--json", out],
        capture_output=True, text=True, timeout=3600,
    )
    entry = {"script": script, "args": args, "seconds": round(time.monotonic() - started, 1), "rc": proc.returncode}
    summary = [line for line in proc.stdout.splitlines() if not line.startswith(("[rank", "dtrain_magic:", "step ", "Out["))]
    entry["summary"] = summary[-25:]
    if proc.returncode != 0:
        entry["error"] = proc.stderr[-3000:]
    if os.path.exists(out):
        with open(out) as handle:
            entry["data"] = json.load(handle)
    return entry


def markdown(results: dict) -> str:
    lines = ["# dtrain_magic benchmarks", "", f"Machine: {os.cpu_count()} CPU cores; "
             f"run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    lines += ["| target | wanted |", "|---|---|"] + [f"| {label} | {wanted} |" for label, wanted in TARGETS.values()]
    for name, entry in results.items():
        lines += ["", f"## {name} (`benchmarks/{entry['script']} {' '.join(entry['args'])}`, {entry['seconds']} s)", ""]
        if entry["rc"] != 0:
            lines += ["Failed:", "", "```", entry.get("error", "").strip()[-1500:], "```"]
        lines += ["```", *entry["summary"], "```"]
    return "\n".join(lines) + "\n"


def chart(results: dict, path: str) -> None:
    import plotly.graph_objects as go

    names, cold, warm = [], [], []
    for name, entry in results.items():
        data = entry.get("data")
        if isinstance(data, dict) and ("cold_ttfs_ratio" in data or "warm_ttfs_ratio" in data):
            names.append(name)
            cold.append(data.get("cold_ttfs_ratio"))
            warm.append(data.get("warm_ttfs_ratio"))
    figure = go.Figure([go.Bar(name="cold", x=names, y=cold), go.Bar(name="warm", x=names, y=warm)])
    figure.add_hline(y=1.05, line_dash="dash", annotation_text="target 1.05")
    figure.update_layout(title="time to first step: magic / raw backend (lower is better)", barmode="group")
    figure.write_html(path, include_plotlyjs="cdn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    results = {}
    for name in args.only.split(","):
        print(f"== {name}", flush=True)
        results[name] = run(name, args.repeats)
        print("\n".join(results[name]["summary"][-8:]), flush=True)
    with open(os.path.join(RESULTS, "results.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    with open(os.path.join(RESULTS, "report.md"), "w") as handle:
        handle.write(markdown(results))
    chart(results, os.path.join(RESULTS, "chart.html"))
    print(f"wrote {RESULTS}/report.md, results.json, chart.html")


if __name__ == "__main__":
    main()
