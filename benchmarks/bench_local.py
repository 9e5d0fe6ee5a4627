"""``%%distribute --backend local`` against torch's own launcher (``elastic_launch``, what torchrun runs).

Same job (benchmarks/workload.py), same process count, in the same run. Cold: the first call in a
fresh Python process (each sample in its own subprocess). Warm: later calls in the same process (the
magic's warm pool is filled by then). Time to first step: from the call to rank 0's first optimizer
step. Also steady-state steps/s (magic vs raw) and the cost of ``ctx.log`` every step.

    .venv/bin/python benchmarks/bench_local.py --repeats 3 --json benchmarks/results/local.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import MAGIC_BODY, raw_train, summarize  # noqa: E402


def raw_once(n: int, steps: int) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    start = time.time()
    results = elastic_launch(config, raw_train)(steps, True)
    end = time.time()
    first = results[0]
    return {"ttfs": first["first_step"] - start, "total": end - start, "steps_per_s": first["steps_per_s"]}


_SHELL = None


def magic_once(n: int, steps: int, log: bool = True) -> dict:
    global _SHELL
    if _SHELL is None:
        from IPython.core.interactiveshell import InteractiveShell

        _SHELL = InteractiveShell.instance()
        _SHELL.run_cell("%load_ext dtrain_magic", store_history=False)
    _SHELL.user_ns.update(STEPS=steps, LOG=log)
    cell = f"%%distribute --backend local -n {n} --cpu --no-ui --experiment bench_local\n" + MAGIC_BODY
    from IPython.utils.capture import capture_output

    start = time.time()
    with capture_output():  # keep the cell's output out of the report (silent=True would drop .result)
        outcome = _SHELL.run_cell(cell, store_history=False)
    end = time.time()
    if outcome.error_in_exec is not None:
        raise outcome.error_in_exec
    first = outcome.result.value
    return {"ttfs": first["first_step"] - start, "total": end - start, "steps_per_s": first["steps_per_s"]}


def cold_sample(n: int, steps: int) -> dict:
    """One magic call and one raw call, each as the first call of a fresh interpreter."""
    out = {}
    for which in ("magic", "raw"):
        proc = subprocess.run(
            [sys.executable, __file__, "--inner", which, "-n", str(n), "--steps", str(steps)],
            capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        out[which] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--pause", type=float, default=6.0, help="seconds between warm calls (default 6)")
    parser.add_argument("--inner", choices=["magic", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    if args.inner:
        sample = magic_once(args.n, args.steps) if args.inner == "magic" else raw_once(args.n, args.steps)
        print(json.dumps(sample))
        return

    cold = [cold_sample(args.n, args.steps) for _ in range(args.repeats)]
    magic_once(args.n, args.steps)  # fill the warm pool, load MLflow
    raw_once(args.n, args.steps)
    warm = {"magic": [], "raw": [], "magic_nolog": []}
    for _ in range(args.repeats):
        # A pause before each call, as between cells: the magic's warm pool refills in the background
        # after a run, and neither side should pay for the other's background work.
        for key, call in (("magic", lambda: magic_once(args.n, args.steps)), ("raw", lambda: raw_once(args.n, args.steps)),
                          ("magic_nolog", lambda: magic_once(args.n, args.steps, log=False))):
            time.sleep(args.pause)
            warm[key].append(call())

    def stats(samples: list[dict], key: str) -> dict:
        return summarize([s[key] for s in samples])

    report = {"backend": "local", "n": args.n, "steps": args.steps, "repeats": args.repeats, "raw_api": "elastic_launch"}
    for mode, data in (("cold", {k: [c[k] for c in cold] for k in ("magic", "raw")}), ("warm", warm)):
        for via, samples in data.items():
            report[f"{mode}_{via}_ttfs"] = stats(samples, "ttfs")
            report[f"{mode}_{via}_total"] = stats(samples, "total")
            report[f"{mode}_{via}_steps_per_s"] = stats(samples, "steps_per_s")
        report[f"{mode}_ttfs_ratio"] = report[f"{mode}_magic_ttfs"]["median"] / report[f"{mode}_raw_ttfs"]["median"]
        report[f"{mode}_total_ratio"] = report[f"{mode}_magic_total"]["median"] / report[f"{mode}_raw_total"]["median"]
    report["steady_ratio"] = report["warm_magic_steps_per_s"]["median"] / report["warm_raw_steps_per_s"]["median"]
    report["log_cost"] = 1 - report["warm_magic_steps_per_s"]["median"] / report["warm_magic_nolog_steps_per_s"]["median"]
    for mode in ("cold", "warm"):
        print(
            f"local {mode}: time to first step magic {report[f'{mode}_magic_ttfs']['median']:.2f} s vs "
            f"elastic_launch {report[f'{mode}_raw_ttfs']['median']:.2f} s (ratio {report[f'{mode}_ttfs_ratio']:.2f}); "
            f"total {report[f'{mode}_magic_total']['median']:.2f} s vs {report[f'{mode}_raw_total']['median']:.2f} s "
            f"(ratio {report[f'{mode}_total_ratio']:.2f})"
        )
    print(f"steady steps/s magic/raw {report['steady_ratio']:.3f}; ctx.log every step costs {100 * report['log_cost']:.1f} %")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
