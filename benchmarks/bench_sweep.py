"""Sweeps (issue 36): ``dtrain_magic.sweep`` on Ray against back-to-back runs and Ray Tune, and what pruning saves.

The function: linear regression y = 3x - 1 on 64 points, SGD at the trial's learning rate, ``--steps`` steps, the
loss logged every step, 2 ranks (DDP over gloo, CPU).

``ray``: ``--trials`` learning rates (all converging), one trial at a time, on the local Ray instance the magic
starts itself (started, and warmed by one small run, before anything is timed), three ways, in this order, each
beginning with no workers waiting (the magic's waiting workers released before each):

a. the magic's sweep: ``dtrain_magic.sweep(fn, "lr=grid(...)", backend="ray", parallel_trials=1, pruner="none")``
   (trials after the first run on the first trial's Ray Train workers: no launch between trials);
b. the same configurations as ``--trials`` back-to-back ``dtrain_magic.run(fn, lr=..., backend="ray")`` calls, as
   that many notebook cells would run them (each run's next workers are launched as it ends);
c. Ray Tune driving Ray Train the way Ray 2.60 documents it for Train V2 (its default): a ``Tuner`` over a function
   trainable that builds a ``TorchTrainer`` (``ScalingConfig(num_workers=2)``, ``prepare_model``,
   ``ray.train.report`` every step, ``TuneReportCallback``) and calls ``fit()``; ``tune.grid_search`` over the same
   rates, ``TuneConfig(max_concurrent_trials=1)``; on the same Ray instance, in this process. A report waits for
   Ray Train's controller to take the last one (polled every 2 s by default): ``--tune-report-every 20`` reports
   the last step only, leaving Ray Tune's own cost per trial.

Per side: the wall time of all trials and each trial's duration (a: Optuna's start → complete; b: each call; c:
Tune's trial start → complete, from a Tune callback). The issue's target: a / c ≤ 0.5.

``prune``: the local backend, ``--trials`` trials of 2 ranks one at a time, 2 learning rates that converge first
(the seed orders the grid) and the rest diverging, ``--prune-steps`` steps a ``--pause`` apart, with Optuna's
``MedianPruner(n_startup_trials=2, n_warmup_steps=3)`` and with ``pruner="none"``: the optimizer steps every trial
made (each rank writes its count as it ends, however it ends) and their ratio (target: ≤ 0.5).

    .venv/bin/python benchmarks/bench_sweep.py [--trials 8] [--steps 20] [--only ray,prune] [--json PATH]
    .venv/bin/python benchmarks/bench_sweep.py --only ray --tune-report-every 20     # Ray Tune's cost without reports
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import close_report, create_tracking_db, settle, summarize  # noqa: E402

WORKERS = 2
# lr=grid(...) and the seed that makes Optuna 4.6's grid sampler run the 2 converging rates first (test_sweeps.py,
# sweep_checks.py); other trial counts: 2 converging rates, the rest diverging, seed 80 (the order is printed)
PRUNE_GRIDS = {8: ((0.3, 0.2, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0), 80), 4: ((0.3, 0.2, 1.5, 1.8), 5)}


# -- the workloads (run on the workers: self-contained, pickled by value) ------------------------------------------

def regression(ctx, lr=None, steps=20, pause=0.0, out_dir=None):
    """y = 3x - 1 by SGD at ``lr`` (a sweep's trial: ``ctx.params["lr"]``); above 1 it diverges. With ``out_dir``,
    each rank writes how many optimizer steps it made as it ends, however it ends (a pruned trial stops in
    ``ctx.step``)."""
    import os
    import time

    import torch

    lr = ctx.params["lr"] if lr is None else lr
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    model = torch.nn.Linear(1, 1)
    model, _opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    made = 0
    try:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
            ctx.backward(loss)
            made += 1
            ctx.step()
            ctx.log(loss=min(loss.item(), 1e30))
            if pause:
                time.sleep(pause)
    finally:
        if out_dir:
            with open(os.path.join(out_dir, f"lr{lr}-rank{ctx.rank}"), "w") as handle:
                handle.write(str(made))


def tune_train_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: the same regression in plain torch DDP, the loss reported every
    ``report_every`` steps (1: every step, as the magic's function logs it) and after the last."""
    import ray.train
    import ray.train.torch
    import torch

    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for step in range(1, config["steps"] + 1):
        loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % config["report_every"] == 0 or step == config["steps"]:
            ray.train.report({"loss": min(loss.item(), 1e30)})


def tune_driver(config: dict) -> None:
    """Ray Tune's function trainable: one Ray Train run per trial (Ray's documented Train V2 + Tune pattern)."""
    import ray.train
    import ray.tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    TorchTrainer(
        tune_train_loop,
        train_loop_config=config["train_loop_config"],
        scaling_config=ray.train.ScalingConfig(num_workers=config["workers"]),
        run_config=ray.train.RunConfig(name=f"train-{ray.tune.get_context().get_trial_id()}",
                                       storage_path=config["storage"], callbacks=[TuneReportCallback()]),
    ).fit()


# -- the Ray comparison -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet():
    """The runs' own output (trial lines, ``[rank N]`` lines, Tune's tables) into a buffer: the summary stays
    readable."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


def ray_lrs(trials: int) -> list[float]:
    """``trials`` learning rates from 0.05 to 0.5, every one converging."""
    return [round(0.05 + 0.45 * i / max(1, trials - 1), 4) for i in range(trials)]


def fresh_start(launcher) -> None:
    """No workers waiting (their CPUs given back to Ray), the machine idle: each side starts the same."""
    launcher.release_standby("benchmark: the next side starts with no workers waiting")
    settle(10.0)


def magic_sweep(lrs: list[float], steps: int, uri: str) -> dict:
    import dtrain_magic

    space = "lr=grid(" + ",".join(str(lr) for lr in lrs) + ")"
    t0 = time.perf_counter()
    with quiet() as buffer:
        result = dtrain_magic.sweep(regression, space, metric="loss", backend="ray", num_processes=WORKERS, cpu=True,
                                    parallel_trials=1, pruner="none", ui=False, tracking_uri=uri, seed=0, steps=steps)
    wall = time.perf_counter() - t0
    frame = result.trials.sort_values("number")
    durations = [(row.datetime_complete - row.datetime_start).total_seconds() for row in frame.itertuples()]
    return {"wall_s": wall, "trial_s": durations, "states": list(frame["state"]),
            "lines": [line for line in buffer.getvalue().splitlines() if line.startswith("trial ")]}


def magic_runs(lrs: list[float], steps: int, uri: str, launcher) -> dict:
    import dtrain_magic

    durations, claimed = [], 0
    t0 = time.perf_counter()
    with quiet():
        for lr in lrs:
            claims = launcher.standbys.claims
            started = time.perf_counter()
            dtrain_magic.run(regression, lr=lr, steps=steps, backend="ray", num_processes=WORKERS, cpu=True,
                             ui=False, tracking_uri=uri)
            durations.append(time.perf_counter() - started)
            claimed += launcher.standbys.claims > claims
    return {"wall_s": time.perf_counter() - t0, "trial_s": durations, "claimed_waiting_workers": claimed}


def ray_tune(lrs: list[float], steps: int, report_every: int, storage: str) -> dict:
    import ray.tune

    class TrialTimes(ray.tune.Callback):
        """Tune's own view of each trial: started (its actor up) → complete."""

        def __init__(self):
            self.start, self.end = {}, {}

        def on_trial_start(self, iteration, trials, trial, **info):
            self.start[trial.trial_id] = time.perf_counter()

        def on_trial_complete(self, iteration, trials, trial, **info):
            took = self.end[trial.trial_id] = time.perf_counter()
            took -= self.start[trial.trial_id]
            print(f"  tune: trial {len(self.end)}/{len(lrs)} took {took:.1f} s", file=sys.stderr, flush=True)

    times = TrialTimes()
    tuner = ray.tune.Tuner(
        tune_driver,
        param_space={"train_loop_config": {"lr": ray.tune.grid_search(lrs), "steps": steps,
                                           "report_every": report_every},
                     "workers": WORKERS, "storage": storage},
        tune_config=ray.tune.TuneConfig(max_concurrent_trials=1, metric="loss", mode="min"),
        run_config=ray.tune.RunConfig(name="bench_sweep_tune", storage_path=storage, verbose=0, callbacks=[times]),
    )
    t0 = time.perf_counter()
    with quiet():  # Tune's experiment table, even at verbose=0
        grid = tuner.fit()
    wall = time.perf_counter() - t0
    order = sorted(times.start, key=times.start.get)
    return {"wall_s": wall, "trial_s": [times.end[t] - times.start[t] for t in order if t in times.end],
            "errors": [str(r.error)[:300] for r in grid if r.error is not None],
            "best_lr": grid.get_best_result().config["train_loop_config"]["lr"]}


def ray_part(args, workdir: str, uri: str) -> dict:
    import dtrain_magic
    from dtrain_magic.launchers import get_launcher

    lrs = ray_lrs(args.trials)
    launcher = get_launcher("ray")
    out: dict = {"lrs": lrs, "order": "sweep, runs, tune", "tune_report_every": args.tune_report_every}
    t0 = time.perf_counter()
    with quiet():  # the magic starts its Ray instance; this run's workers warm Ray's worker processes
        dtrain_magic.run(regression, lr=0.1, steps=1, backend="ray", num_processes=WORKERS, cpu=True, ui=False,
                         tracking_uri=uri)
    out["ray_start_and_first_run_s"] = time.perf_counter() - t0
    import ray.train.torch  # noqa: F401  (Tune's and Train's imports in this process: not timed)
    import ray.tune  # noqa: F401

    try:
        for name, side in (("sweep", lambda: magic_sweep(lrs, args.steps, uri)),
                           ("runs", lambda: magic_runs(lrs, args.steps, uri, launcher)),
                           ("tune", lambda: ray_tune(lrs, args.steps, args.tune_report_every,
                                                     os.path.join(workdir, "tune")))):
            fresh_start(launcher)
            out[name] = side()
            out[name]["median_trial_s"] = statistics.median(out[name]["trial_s"])
            out[name]["trial_stats"] = summarize(out[name]["trial_s"])
            print(f"  {name}: {out[name]['wall_s']:.1f} s; trials "
                  f"{', '.join(f'{s:.2f}' for s in out[name]['trial_s'])} s", file=sys.stderr, flush=True)
    finally:
        launcher.shutdown()
    out["sweep_vs_runs"] = out["sweep"]["wall_s"] / out["runs"]["wall_s"]
    out["sweep_vs_tune"] = out["sweep"]["wall_s"] / out["tune"]["wall_s"]
    return out


# -- pruning ------------------------------------------------------------------------------------------------------

def prune_grid(trials: int) -> tuple[tuple[float, ...], int]:
    if trials in PRUNE_GRIDS:
        return PRUNE_GRIDS[trials]
    return (0.3, 0.2, *[round(1.5 + 0.1 * i, 2) for i in range(trials - 2)]), 80


def read_count(path: str) -> int:
    with open(path) as handle:
        return int(handle.read())


def one_prune_sweep(pruner, grid: tuple, seed: int, args, workdir: str, uri: str, label: str) -> dict:
    import dtrain_magic

    out_dir = os.path.join(workdir, f"steps_{label}")
    os.makedirs(out_dir)
    t0 = time.perf_counter()
    with quiet():
        result = dtrain_magic.sweep(regression, "lr=grid(" + ",".join(map(str, grid)) + ")", metric="loss",
                                    backend="local", num_processes=WORKERS, cpu=True, seed=seed, parallel_trials=1,
                                    pruner=pruner, ui=False, tracking_uri=uri, steps=args.prune_steps,
                                    pause=args.pause, out_dir=out_dir)
    wall = time.perf_counter() - t0
    frame = result.trials.sort_values("number")
    made = {lr: [read_count(os.path.join(out_dir, f"lr{lr}-rank{rank}")) for rank in range(WORKERS)]
            for lr in frame["params_lr"]}
    return {"wall_s": wall, "order": list(frame["params_lr"]), "states": list(frame["state"]),
            "steps": {str(lr): ranks for lr, ranks in made.items()},
            "total_steps": sum(ranks[0] for ranks in made.values())}


def prune_part(args, workdir: str, uri: str) -> dict:
    import optuna

    grid, seed = prune_grid(args.trials)
    out: dict = {"grid": list(grid), "seed": seed, "steps_per_trial": args.prune_steps, "pause_s": args.pause}
    out["unpruned"] = one_prune_sweep("none", grid, seed, args, workdir, uri, "unpruned")
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3)
    out["pruned"] = one_prune_sweep(pruner, grid, seed, args, workdir, uri, "pruned")
    out["ratio"] = out["pruned"]["total_steps"] / out["unpruned"]["total_steps"]
    out["converging_first"] = sorted(out["pruned"]["order"][:2]) == [0.2, 0.3]
    return out


# -- report -------------------------------------------------------------------------------------------------------

def print_ray(r: dict, steps: int) -> None:
    print(f"Ray: {len(r['lrs'])} trials of {steps} steps, {WORKERS} CPU workers each, one at a time, on the magic's "
          f"local Ray (started + first run {r['ray_start_and_first_run_s']:.1f} s, not counted); order {r['order']}")
    for name, label in (("sweep", "a. dtrain_magic.sweep"), ("runs", "b. back-to-back dtrain_magic.run"),
                        ("tune", f"c. Ray Tune + Ray Train (report every {r['tune_report_every']} step(s))")):
        s, t = r[name], r[name]["trial_stats"]
        print(f"  {label:55s} wall {s['wall_s']:6.1f} s; per trial median {t['median']:.2f} s "
              f"({t['min']:.2f}-{t['max']:.2f}), first {s['trial_s'][0]:.2f} s")
    print(f"  runs: took waiting workers in {r['runs']['claimed_waiting_workers']} of {len(r['lrs'])} runs; "
          f"sweep states {sorted(set(r['sweep']['states']))}; tune errors {len(r['tune']['errors'])}")
    print(f"  a / b = {r['sweep_vs_runs']:.2f}; a / c = {r['sweep_vs_tune']:.2f} (target ≤ 0.5)")


def print_prune(p: dict) -> None:
    u, q = p["unpruned"], p["pruned"]
    print(f"Pruning (local, {WORKERS} ranks, one trial at a time, {p['steps_per_trial']} steps {p['pause_s']} s "
          f"apart): lr=grid{tuple(p['grid'])}, seed {p['seed']}, order {q['order']}"
          + ("" if p["converging_first"] else " (the converging rates did NOT come first)"))
    for label, s in (("pruner none", u), ("MedianPruner(2, 3)", q)):
        steps = ", ".join(f"{lr}: {ranks[0]}" for lr, ranks in s["steps"].items())
        print(f"  {label:19s} {s['total_steps']:4d} steps per rank in all ({steps}); {s['wall_s']:.1f} s; states "
              f"{', '.join(f'{st}' for st in s['states'])}")
    print(f"  pruned / unpruned steps = {p['ratio']:.2f} (target ≤ 0.5)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8, help="trials per sweep (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="steps per trial of the Ray comparison (default 20)")
    parser.add_argument("--tune-report-every", type=int, default=1,
                        help="Ray Tune side: ray.train.report every N steps (default 1, as ctx.log every step; each "
                             "report waits for Ray Train's controller to take the last, polled every 2 s by default)")
    parser.add_argument("--prune-steps", type=int, default=60,
                        help="steps per trial of the pruning comparison (default 60: a trial pruned at step 3 "
                             "stops after step 11-15 on 2 cores)")
    parser.add_argument("--pause", type=float, default=0.05,
                        help="seconds between steps in the pruning comparison (default 0.05), so the pruner "
                             "sees the loss while a trial runs")
    parser.add_argument("--only", default="ray,prune", help="which parts: ray, prune (default both)")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    parts = args.only.split(",")
    args.json = os.path.abspath(args.json) if args.json else None  # before the chdir below
    if set(parts) - {"ray", "prune"} or args.trials < 3:
        parser.error("--only takes ray and/or prune; --trials at least 3")

    began, load_start = time.monotonic(), os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="bench_sweep_")
    os.chdir(workdir)  # the sweeps' optuna.db and anything else they write
    uri = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    create_tracking_db(uri)
    report: dict = {"trials": args.trials, "steps": args.steps, "workers": WORKERS, "cpu_count": os.cpu_count()}
    try:
        if "ray" in parts:
            report["ray"] = ray_part(args, workdir, uri)
            print_ray(report["ray"], args.steps)
        if "prune" in parts:
            report["prune"] = prune_part(args, workdir, uri)
            print_prune(report["prune"])
    finally:
        close_report(report, args.json, workdir, began, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
