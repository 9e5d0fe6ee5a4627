"""An interactive session against the run it replaces for one look at the ranks' state (docs/sessions.md).

    .venv/bin/python benchmarks/bench_session.py --backend local      # or spark, ray; --json out.json

In one process (a notebook's), on one backend, -n 2, CPU: the session's start; then, repeated, the time a cell takes
from the notebook's call to its value back (an empty cell, and one printing a line per rank), a pull of a 1M-float
tensor from each rank, and the kernel's interrupt of a long cell (SIGINT to this process) until the cell is back;
against one ``%%distribute`` run of a no-op function on the same backend, beside the session (what a look at the
ranks costs without a session: Spark and Ray launch their workers afresh, the run's waiting workers are not kept).
Medians with min-max.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

from workload import write_json


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples),
            "samples": samples}


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return (f"{value['median'] * 1000:.1f} ms (min {value['min'] * 1000:.1f}, max {value['max'] * 1000:.1f}, "
                f"n {value['n']})")
    return f"{value:.2f} s" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "spark", "ray"), default="local")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.chdir(tempfile.mkdtemp(prefix="bench_session_"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.getcwd()}/mlflow.db"
    from dtrain_magic.driver.observer import TextObserver
    from dtrain_magic.errors import CellInterrupted
    from dtrain_magic.session.driver import Session
    from dtrain_magic.session.observe import Quiet

    quiet = TextObserver(out=open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
    started = time.perf_counter()
    session = Session(backend=args.backend, num_processes=2, use_gpu=False, ui=False, observer=quiet)
    results: dict = {"backend": args.backend, "start_s": time.perf_counter() - started}

    def timed(call, repeats: int) -> dict:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        return _stats(samples)

    results["empty_cell_s"] = timed(lambda: session.run("1", observer=Quiet()), args.repeats)
    results["printing_cell_s"] = timed(lambda: session.run("print('x', ctx.rank)\nctx.rank", observer=Quiet()),
                                       args.repeats)
    session.run("import torch\nbig = torch.ones(1 << 20)", observer=Quiet())
    results["pull_4MB_per_rank_s"] = timed(lambda: session.pull("big", observer=Quiet()), max(3, args.repeats // 4))

    def interrupted() -> float:
        def send() -> None:
            time.sleep(1.0)
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

        sent: list[float] = []
        threading.Thread(target=send, daemon=True).start()
        try:
            session.run("import time\nwhile True:\n    time.sleep(0.01)", observer=Quiet())
        except CellInterrupted:
            return time.perf_counter() - sent[0]
        raise AssertionError("the cell was not interrupted")

    results["interrupt_to_cell_back_s"] = _stats([interrupted() for _ in range(3)])
    import dtrain_magic

    def no_op_run() -> None:
        hold = {"keep_warm": 0} if args.backend != "local" else {}  # nothing left waiting after it
        dtrain_magic.run(lambda: None, backend=args.backend, num_processes=2, use_gpu=False, ui=False, **hold)

    results["run_beside_s"] = timed(no_op_run, 2)
    session.stop("the benchmark ends")
    for key, value in results.items():
        print(f"{key}: {_shown(value)}")
    write_json(args.json, results, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
