"""When is a re-run instant? Per backend: how long after a run ends the next run's workers are up (Spark and Ray:
the standby's workers all waiting, `StandbySlot.standby.all_ready`; local: the fork server, up all along), and
how long a re-run takes to start (the call to the function running on every rank) started the moment the last
one ended versus once they are up.

    .venv/bin/python benchmarks/bench_standby_ready.py local spark ray

Prints one line per backend and a JSON line (``RESULT {...}``). A tiny function, 2 CPU processes, no UI; the
MLflow store is a SQLite file in a temporary directory.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import dtrain_magic
from dtrain_magic.launchers import get_launcher

REPEATS = 3
READY_LIMIT_S = 120.0


def tiny(ctx):
    import time

    return time.time()


def one_run(backend: str) -> float:
    """One run; seconds from the call until the function runs on every rank."""
    called = time.time()
    return max(dtrain_magic.run(tiny, backend=backend, num_processes=2, cpu=True, no_ui=True).values) - called


def ready_after(backend: str, ended: float) -> float | None:
    """Seconds from ``ended`` until the next run's workers all wait (None: none came within the limit)."""
    if backend == "local":
        return 0.0  # the fork server imported torch once and forks each run's workers in milliseconds
    slot = get_launcher(backend).standbys
    while time.monotonic() - ended < READY_LIMIT_S:
        standby = slot.standby
        if standby is not None and standby.all_ready.is_set():
            return time.monotonic() - ended
        time.sleep(0.05)
    return None


def measure(backend: str) -> dict:
    one_run(backend)  # cold: the backend starts (SparkSession, Ray), the first workers come up
    ready, at_once, when_up = [], [], []
    for _ in range(REPEATS):
        one_run(backend)
        ready.append(ready_after(backend, time.monotonic()))
        when_up.append(one_run(backend))  # its workers were up: claimed at once
        at_once.append(one_run(backend))  # started the moment the last run ended: its workers still coming up
    return {"ready_s": ready, "rerun_when_up_s": when_up, "rerun_at_once_s": at_once}


def main(backends: list[str]) -> None:
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    results = {}
    for backend in backends:
        results[backend] = found = measure(backend)
        shown = {k: ", ".join("-" if v is None else f"{v:.2f}" for v in vs) for k, vs in found.items()}
        print(f"{backend}: next run's workers up {shown['ready_s']} s after a run ends; a re-run starts (every rank "
              f"in the function) in {shown['rerun_when_up_s']} s once they are up, {shown['rerun_at_once_s']} s "
              "when started at once", flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["local", "spark", "ray"])
