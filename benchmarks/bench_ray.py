"""Time to first step and total time: ``%%distribute --backend ray`` vs a raw ``TorchTrainer(...).fit()``.

Both run the same training loop (a small MLP, STEPS Adam steps, 2 workers, CPU) in this process, on
the same kind of Ray instance (the one the launcher embeds: 127.0.0.1, no dashboard). Each mode gets a
fresh Ray instance: its first run is "cold" (no Ray worker processes yet), the next ones "warm"
(median). Time to first step is from the call (the cell, or ``fit()``) to the wall-clock moment rank 0
finished its first optimizer step, as the training function itself records it; total is the call's
duration. Prints a table and the magic/raw ratios.

    .venv/bin/python benchmarks/bench_ray.py [--warm 2] [--steps 200] [--order magic,raw]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

STEP_FILE = "first_step.txt"


MAGIC_CELL = """%%distribute --backend ray -n 2 --cpu --no-ui --seed 0
import time, torch
def train(ctx):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.prepare(model, opt)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    for step in range({steps}):
        loss = (model(x) - y).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        if step == 0 and ctx.rank == 0:
            open({step_file!r}, "w").write(repr(time.time()))
        if step % 20 == 0:
            ctx.log(loss=loss.item(), step=step)
    return loss.item()
"""


def raw_train(config: dict) -> None:
    import time

    import ray.train
    import torch
    from ray.train.torch import prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    rank = ray.train.get_context().get_world_rank()
    for step in range(config["steps"]):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0 and rank == 0:
            open(config["step_file"], "w").write(repr(time.time()))


def fresh_ray() -> float:
    """Shut down any embedded instance and start a new one the way the launcher does; seconds taken."""
    from dtrain_magic.config import RunConfig
    from dtrain_magic.launchers import ray as ray_launcher

    ray_launcher._shutdown_embedded()
    t0 = time.perf_counter()
    assert ray_launcher.connect(RunConfig(backend="ray")) == "embedded"
    return time.perf_counter() - t0


def run_magic(shell, steps: int, workdir: str) -> tuple[float, float]:
    step_file = os.path.join(workdir, STEP_FILE)
    if os.path.exists(step_file):
        os.remove(step_file)
    cell = MAGIC_CELL.format(steps=steps, step_file=step_file)
    t_wall, t0 = time.time(), time.perf_counter()
    result = shell.run_cell(cell, store_history=False)
    total = time.perf_counter() - t0
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return float(open(step_file).read()) - t_wall, total


def run_raw(steps: int, workdir: str, index: int) -> tuple[float, float]:
    import ray.train
    from ray.train.torch import TorchTrainer

    step_file = os.path.join(workdir, STEP_FILE)
    if os.path.exists(step_file):
        os.remove(step_file)
    t_wall, t0 = time.time(), time.perf_counter()
    TorchTrainer(
        raw_train,
        train_loop_config={"steps": steps, "step_file": step_file},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(name=f"raw_{os.getpid()}_{index}", storage_path=os.path.join(workdir, "raw_runs")),
    ).fit()
    total = time.perf_counter() - t0
    return float(open(step_file).read()) - t_wall, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=2, help="warm runs per mode after the cold one")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--order", default="magic,raw", help="which mode gets its fresh instance first")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="bench_ray_")
    os.chdir(workdir)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)

    rows: dict[str, dict[str, list[float] | float]] = {}
    for mode in args.order.split(","):
        init_s = fresh_ray()
        samples = []
        for i in range(1 + args.warm):
            if mode == "magic":
                import contextlib
                import io

                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress, rank output
                    samples.append(run_magic(shell, args.steps, workdir))
            else:
                samples.append(run_raw(args.steps, workdir, i))
            print(f"  {mode} run {i} ({'cold' if i == 0 else 'warm'}): first step {samples[-1][0]:.2f} s, "
                  f"total {samples[-1][1]:.2f} s", file=sys.stderr, flush=True)
        rows[mode] = {
            "init": init_s,
            "cold_first": samples[0][0], "cold_total": samples[0][1],
            "warm_first": statistics.median(s[0] for s in samples[1:]) if args.warm else float("nan"),
            "warm_total": statistics.median(s[1] for s in samples[1:]) if args.warm else float("nan"),
        }
    from dtrain_magic.launchers import ray as ray_launcher

    ray_launcher._shutdown_embedded()

    print(f"\nRay backend benchmark: 2 CPU workers, {args.steps} steps, warm = median of {args.warm} "
          f"(ray.init: magic's instance {rows['magic']['init']:.2f} s, raw's {rows['raw']['init']:.2f} s, not included)")
    print(f"{'':14}{'magic':>10}{'raw fit()':>11}{'ratio':>8}")
    for key, label in (("cold_first", "cold 1st step"), ("cold_total", "cold total"),
                       ("warm_first", "warm 1st step"), ("warm_total", "warm total")):
        magic, raw = rows["magic"][key], rows["raw"][key]
        print(f"{label:14}{magic:>9.2f}s{raw:>10.2f}s{magic / raw:>8.2f}")
    if args.json:
        import json

        ratios = {f"{key.split('_')[0]}_{'ttfs' if key.endswith('first') else 'total'}_ratio": rows["magic"][key] / rows["raw"][key]
                  for key in ("cold_first", "cold_total", "warm_first", "warm_total")}
        with open(args.json, "w") as handle:
            json.dump({"backend": "ray", "steps": args.steps, "warm_runs": args.warm, "raw_api": "TorchTrainer.fit",
                       "rows": rows, **ratios}, handle, indent=2)
    import shutil

    os.chdir("/")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
