"""Runs that outlive a lost worker (issue 37): steps lost and seconds from a lost worker to the next step, per backend,
against Ray Train's own elastic restart on the same Ray.

The function (every side the same): a small MLP (32 → 64 → 1) on 2 ranks (DDP over gloo, CPU), ``--steps`` steps a
``--pause`` apart, a checkpoint every ``--every`` steps (model, optimizer, step); at step ``--kill-at`` rank 1
SIGKILLs itself once (a lost worker: no error, no notice). Every rank logs each step it finishes with its time.
Measured per side, from rank 0's log: **recovery** = the first step finished after the kill (by the relaunched
attempt) minus the time of the kill; **steps lost** = the steps rank 0 had finished past the checkpoint the next
attempt resumed from (computed again).

Sides, one after the other, in this process:

- ``local``: ``dtrain_magic.run(..., backend="local", max_restarts=1)`` (every worker restarted by the fork server);
- ``local_elastic``: the same with ``elastic="1:2"``: the survivor goes on alone (the global batch kept by
  accumulation), no restart used;
- ``spark``: ``backend="spark"`` in local mode, ``max_restarts=1`` (a new barrier job);
- ``ray``: ``backend="ray"``, ``max_restarts=1`` (Ray Train's ``FailureConfig`` restarting the group the run took
  over from the waiting workers), on the local Ray instance the magic starts;
- ``ray_elastic``: ``backend="ray"``, ``elastic="1:2"``, ``max_restarts=1``: a new ``fit()`` sized to the Ray's nodes
  (one machine: the killed worker's CPU is still there, so this is a restart on 2);
- ``ray_train``: raw Ray Train on the same Ray instance: ``TorchTrainer(ScalingConfig(num_workers=(1, 2)),
  FailureConfig(max_failures=1))`` (Ray Train's elastic scaling), ``prepare_model``, ``ray.train.report`` with a
  ``Checkpoint`` every ``--every`` steps and ``get_checkpoint()`` on start, Ray Train's own settings (its controller
  polls every 2 s; the magic's runs on a one-machine Ray poll every 0.5 s).

    .venv/bin/python benchmarks/bench_restart.py [--only local,local_elastic,spark,ray,ray_elastic,ray_train]
        [--steps 60] [--every 10] [--kill-at 25] [--pause 0.05] [--json PATH]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import close_report, create_tracking_db, settle  # noqa: E402

SIDES = ("local", "local_elastic", "spark", "ray", "ray_elastic", "ray_train")


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _step_once(out_dir: str, rank: int, step: int, kill_at: int) -> None:
    """Rank 1 dies once at ``kill_at`` (its time noted first)."""
    import os
    import signal
    import time

    marker = os.path.join(out_dir, "killed")
    if step == kill_at and rank == 1 and not os.path.exists(marker):
        with open(marker, "w") as handle:
            handle.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def magic_train(ctx, out_dir, steps, every, kill_at, pause):
    """The magic's side: ``ctx.save_checkpoint(step=)`` / ``ctx.load_checkpoint()``."""
    import os
    import time

    import torch

    model = _model()
    model, opt = ctx.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    state = ctx.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(ctx.rank))
    log = open(os.path.join(out_dir, f"steps_{ctx.rank}_{os.getpid()}.txt"), "a")
    for step in range(start, steps):
        _step_once(out_dir, ctx.rank, step, kill_at)
        ctx.backward(model(x).pow(2).mean())
        ctx.step()
        time.sleep(pause)
        log.write(f"{start} {step} {time.time()!r}\n")
        log.flush()
        if step % every == every - 1:
            ctx.save_checkpoint(step=step)


def ray_train_loop(config: dict) -> None:
    """Raw Ray Train's side: the same steps, its own checkpoints."""
    import os
    import tempfile
    import time

    import ray.train
    import torch
    from ray.train.torch import prepare_model

    out_dir, steps, every, kill_at, pause = (config[k] for k in ("out_dir", "steps", "every", "kill_at", "pause"))
    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"))
        getattr(model, "module", model).load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    log = open(os.path.join(out_dir, f"steps_{rank}_{os.getpid()}.txt"), "a")
    for step in range(start, steps):
        _step_once(out_dir, rank, step, kill_at)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        time.sleep(pause)
        log.write(f"{start} {step} {time.time()!r}\n")
        log.flush()
        if step % every == every - 1:
            with tempfile.TemporaryDirectory() as directory:
                if rank == 0:
                    torch.save({"model": getattr(model, "module", model).state_dict(), "opt": opt.state_dict(),
                                "step": step}, os.path.join(directory, "state.pt"))
                ray.train.report({"step": step},
                                 checkpoint=ray.train.Checkpoint.from_directory(directory) if rank == 0 else None)


def measure(out_dir: str) -> dict:
    """Recovery seconds and steps lost, from rank 0's step logs and the kill's time."""
    killed_at = float(open(os.path.join(out_dir, "killed")).read())
    lines = [line.split() for path in glob.glob(os.path.join(out_dir, "steps_0_*.txt")) for line in open(path)]
    rows = [(int(start), int(step), float(at)) for start, step, at in lines]
    before = [step for _, step, at in rows if at <= killed_at]
    after = sorted((at, start) for start, _, at in rows if at > killed_at and start > 0)
    if not before or not after:
        return {"error": "no step before the kill or none resumed after it"}
    first_at, resumed_from = after[0]
    return {"recovery_s": first_at - killed_at, "steps_lost": max(before) - (resumed_from - 1),
            "resumed_at_step": resumed_from, "reached_before_kill": max(before)}


def run_side(side: str, args: argparse.Namespace, workdir: str) -> dict:
    out_dir = os.path.join(workdir, side)
    os.makedirs(out_dir)
    began = time.monotonic()
    if side == "ray_train":
        import ray.train
        from ray.train.torch import TorchTrainer

        TorchTrainer(ray_train_loop, train_loop_config={"out_dir": out_dir, "steps": args.steps, "every": args.every,
                                                        "kill_at": args.kill_at, "pause": args.pause},
                     scaling_config=ray.train.ScalingConfig(num_workers=(1, 2)),
                     run_config=ray.train.RunConfig(name=f"bench_restart_{side}", storage_path=workdir,
                                                    failure_config=ray.train.FailureConfig(max_failures=1))).fit()
    else:
        import dtrain_magic

        backend = side.split("_")[0]
        options = {"elastic": "1:2"} if side.endswith("elastic") else {}
        dtrain_magic.run(magic_train, out_dir, args.steps, args.every, args.kill_at, args.pause, backend=backend,
                         num_processes=2, cpu=True, max_restarts=1, no_ui=True, storage=workdir, **options)
    result = measure(out_dir)
    result["wall_s"] = time.monotonic() - began
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SIDES), help=f"which sides (default all: {','.join(SIDES)})")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--kill-at", type=int, default=25, help="the step rank 1 is SIGKILLed at (default 25)")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds each step sleeps (default 0.05)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sides = args.only.split(",")
    if set(sides) - set(SIDES):
        parser.error(f"--only takes {', '.join(SIDES)}")
    args.json = os.path.abspath(args.json) if args.json else None
    began, load_start = time.monotonic(), os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="bench_restart_")
    os.chdir(workdir)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    create_tracking_db(os.environ["MLFLOW_TRACKING_URI"])
    report: dict = {"steps": args.steps, "every": args.every, "kill_at": args.kill_at, "pause": args.pause,
                    "cpu_count": os.cpu_count(), "sides": {}}
    try:
        if "ray_train" in sides and "ray" not in sides and "ray_elastic" not in sides:
            import dtrain_magic  # the magic's local Ray instance, as the ray sides use: started by a small run

            dtrain_magic.run(lambda: None, backend="ray", num_processes=2, cpu=True, no_ui=True)
        for side in [s for s in SIDES if s in sides]:
            settle(10.0)
            try:
                report["sides"][side] = run_side(side, args, workdir)
            except Exception as exc:  # one side's failure is reported, the others still run
                report["sides"][side] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{side:14s} {report['sides'][side]}", flush=True)
    finally:
        close_report(report, args.json, workdir, began, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
