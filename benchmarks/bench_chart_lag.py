"""Live-plot latency: from ``ctx.log`` on a worker to the value being in the monitor's chart data.

A real ``%%distribute --backend local -n 2 --ui`` run in an IPython shell logs a metric every 50 ms;
the monitor's chart poller (reading MLflow) records, for every point, the time it first saw it minus
the worker's timestamp for it. Reports median, p95 and max, for the first run of a fresh process (its
MLflow run opens only once the workers are past their start, so its first points wait for MLflow's
import) and for a second run (MLflow loaded: the lag of every later run).

    .venv/bin/python benchmarks/bench_chart_lag.py --steps 200 --json benchmarks/results/chart_lag.json
"""

from __future__ import annotations

import argparse
import os
import tempfile

from workload import write_json

CELL = """%%distribute --backend local -n 2 --ui --experiment bench_chart_lag
import time, torch
def train(ctx):
    model = torch.nn.Linear(8, 1)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.set_total(STEPS)
    for step in range(STEPS):
        ctx.log(loss=1.0 / (step + 1))
        time.sleep(0.05)
    return step
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/bench.db")

    from IPython.core.interactiveshell import InteractiveShell

    from dtrain_magic.ui import monitor
    from dtrain_magic.ui.charts import lag_summary

    observers = []
    original = monitor.MonitorObserver.__init__

    def keep(self, *a, **k):
        original(self, *a, **k)
        observers.append(self)

    monitor.MonitorObserver.__init__ = keep
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    shell.user_ns["STEPS"] = args.steps
    lags = {}
    for which in ("first", "later"):
        outcome = shell.run_cell(CELL, store_history=False, silent=True)
        if outcome.error_in_exec is not None:
            raise outcome.error_in_exec
        charts = observers[-1].wait_charts(timeout=60)
        charts.wait(timeout=30)
        lags[which] = lag = lag_summary(charts.lags_s)
        print(f"chart lag, {which} run, over {int(lag['n'])} points: median {lag['median_s']:.3f} s, p95 "
              f"{lag['p95_s']:.3f} s, max {lag['max_s']:.3f} s (poll interval {charts.interval_s} s)")
    write_json(args.json, {"chart_lag": lags["first"], "chart_lag_later": lags["later"],
                           "poll_interval_s": charts.interval_s})


if __name__ == "__main__":
    main()
