"""A sweep on a real Spark or Ray backend (issue #36), one check shared by test_spark.py and test_ray.py (each runs
it on its module's backend, on the workers its earlier tests left waiting).

Four trials of 2 ranks, one at a time, through `dtrain_magic.sweep`: two learning rates that converge, then two that
diverge, which Optuna's median pruner stops. What it checks: the known best rate wins; both ranks of every trial
hold the same ``ctx.params``; a pruned trial's ranks stop after the same step; one MLflow parent with a child per
trial; every trial after the first runs on the first trial's two worker processes (no launch between trials:
`Standby.reuse`), and none of them is left once the sweep ended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import psutil

import dtrain_magic

STEPS = 40
SPACE = "lr=grid(0.3,0.2,1.5,1.8)"
SEED = 5  # orders Optuna 4.6's grid 0.3, 0.2, 1.5, 1.8: the converging rates complete before the pruner decides


def diverging_or_not(ctx: Any, out_dir: str, pause: float = 0.05, steps: int = STEPS) -> None:
    """y = 3x - 1 by SGD at ``ctx.params["lr"]`` (above 1 it diverges), ``steps`` steps a ``pause`` apart; each rank
    checks that its peers hold the same params and writes how many ``ctx.step`` calls it made and its pid into
    ``out_dir`` as it ends, however it ends (`ended`)."""
    import os
    import time

    import torch
    import torch.distributed as dist

    seen = [None] * ctx.world_size
    dist.all_gather_object(seen, dict(ctx.params))
    assert all(params == seen[0] for params in seen), f"ranks disagree on ctx.params: {seen}"
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    model = torch.nn.Linear(1, 1)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=ctx.params["lr"]))
    made = 0
    try:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
            ctx.backward(loss)
            made += 1
            ctx.step()  # a pruned trial's ranks stop in here, after the same step
            ctx.log(loss=min(loss.item(), 1e30))
            time.sleep(pause)
    finally:
        with open(os.path.join(out_dir, f"lr{ctx.params['lr']}-rank{ctx.rank}"), "w") as handle:
            handle.write(f"{made} {os.getpid()}")


def ended(out_dir: Path, lr: float, rank: int) -> tuple[int, int]:
    """What rank ``rank`` of the trial at ``lr`` wrote as it ended: (``ctx.step`` calls, pid)."""
    made, pid = (out_dir / f"lr{lr}-rank{rank}").read_text().split()
    return int(made), int(pid)


def check_a_sweep_reuses_its_workers(backend: str, launcher: Any, out_dir: Path, tracking_uri: str) -> None:
    """Run the sweep on ``backend`` (``launcher``: its launcher) and check all of the above."""
    from mlflow import MlflowClient

    reuses = launcher.standbys.reuses
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3)
    result = dtrain_magic.sweep(diverging_or_not, SPACE, metric="loss", backend=backend, num_processes=2, cpu=True,
                                seed=SEED, tracking_uri=tracking_uri, pruner=pruner, parallel_trials=1, ui=False,
                                out_dir=str(out_dir))
    frame = result.trials.sort_values("number")
    assert list(frame["params_lr"]) == [0.3, 0.2, 1.5, 1.8], frame["params_lr"]  # the seed's order (Optuna 4.6)
    states = dict(zip(frame["params_lr"], frame["state"], strict=True))
    assert states == {0.3: "COMPLETE", 0.2: "COMPLETE", 1.5: "PRUNED", 1.8: "PRUNED"}, states
    assert result.best.params == {"lr": 0.3}

    ends = {lr: [ended(out_dir, lr, rank) for rank in (0, 1)] for lr in states}
    made = {lr: [steps for steps, _ in ranks] for lr, ranks in ends.items()}
    assert made[0.3] == made[0.2] == [STEPS, STEPS]
    for _, trial in frame[frame["state"] == "PRUNED"].iterrows():
        stopped = trial["user_attrs_stopped_at_step"]
        assert made[trial["params_lr"]] == [stopped, stopped], (made, stopped)  # every rank: the same last step
    # Every trial on the same two processes: the first trial's workers ran the next three (no launch between them)
    pids = {lr: tuple(pid for _, pid in ranks) for lr, ranks in ends.items()}
    assert len(set(pids.values())) == 1, pids
    assert launcher.standbys.reuses - reuses == 3

    mlflow = MlflowClient(tracking_uri)
    runs = mlflow.search_runs([mlflow.get_run(result.parent_run_id).info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert sorted((run.data.params["lr"], run.info.status) for run in runs) == [
        ("0.2", "FINISHED"), ("0.3", "FINISHED"), ("1.5", "KILLED"), ("1.8", "KILLED")]

    # The sweep's reused workers are released once it ended: their processes go (the next run's are fresh)
    assert launcher.standbys.spares == []
    reused = [psutil.Process(pid) for pid in pids[0.3] if psutil.pid_exists(pid)]
    _gone, alive = psutil.wait_procs(reused, timeout=30)
    assert [proc for proc in alive if proc.status() != psutil.STATUS_ZOMBIE] == [], alive
