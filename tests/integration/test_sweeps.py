"""Sweeps on the local backend, really run (issue #36): real workers, a real MLflow SQLite store, real Optuna.

Kept cheap: a linear model on 64 points, a few steps; each trial a run of 1 or 2 processes.
"""

from __future__ import annotations

import time

import optuna
import pytest

import dtrain_magic
from sweep_checks import diverging_or_not, ended

pytestmark = pytest.mark.slow

STEPS = 24


def regression(ctx, pause=0.04):
    """y = 3x - 1 by SGD at ``ctx.params["lr"]``; both ranks must see the same params. A step every ``pause`` s, so
    that the pruner sees the loss while the trial runs (metrics reach the notebook four times a second)."""
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
    for _ in range(24):  # STEPS
        loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=min(loss.item(), 1e30))
        time.sleep(pause)
    return dict(ctx.params)


def client(tracking_uri):
    """An MlflowClient on the store, made after the sweep made the store (MLflow sets up a new one for seconds)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def children(mlflow, parent_run_id):
    return mlflow.search_runs([mlflow.get_run(parent_run_id).info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


def test_a_grid_sweep_finds_the_known_best_rate_records_it_in_mlflow_and_resumes(tmp_path, tracking_uri):
    space = "lr=grid(0.5,0.05,0.005)"  # 24 steps: 0.5 converges, the smaller rates are still far off
    result = dtrain_magic.sweep(regression, space, metric="loss", num_processes=2, cpu=True, seed=0,
                                tracking_uri=tracking_uri, sweep_name="grid", ui=False, pause=0)
    assert result.best.params == {"lr": 0.5}
    assert result.best.result.values == [{"lr": 0.5}, {"lr": 0.5}]  # each rank's own ctx.params
    assert sorted(result.trials["state"]) == ["COMPLETE"] * 3
    mlflow = client(tracking_uri)
    runs = children(mlflow, result.parent_run_id)
    assert {(run.data.params["lr"], run.info.status, run.data.params["num_processes"]) for run in runs} == {
        ("0.5", "FINISHED", "2"), ("0.05", "FINISHED", "2"), ("0.005", "FINISHED", "2")}
    parent = mlflow.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["dtrain_magic.best_run_id"] == result.best.run_id
    assert parent.data.params["sweep.space"] == space
    assert (tmp_path / "optuna.db").exists()

    again = dtrain_magic.sweep(regression, space, metric="loss", num_processes=2, cpu=True, tracking_uri=tracking_uri,
                               sweep_name="grid", ui=False, pause=0)
    assert len(again.study.trials) == 3 and again.results == {}  # no trial ran again
    assert again.parent_run_id == result.parent_run_id and len(children(mlflow, result.parent_run_id)) == 3
    assert again.best.number == result.best.number


def test_trials_of_one_process_are_packed_two_at_once_on_two_cores(tracking_uri):
    import os

    cores = len(os.sched_getaffinity(0))
    result = dtrain_magic.sweep(regression, "lr=grid(0.1,0.2,0.3,0.4)", metric="loss", num_processes=1, cpu=True,
                                tracking_uri=tracking_uri, ui=False)
    frame = result.trials
    assert set(frame["state"]) == {"COMPLETE"}
    spans = [(row.datetime_start.timestamp(), row.datetime_complete.timestamp()) for row in frame.itertuples()]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert peak == min(cores, 4), spans  # as many at once as there are cores (auto), never more
    assert_nothing_left()


_BEFORE: set[int] = set()  # this process's children when the test began (an earlier module's Spark JVM, say)


@pytest.fixture(autouse=True)
def children_before():
    import psutil

    _BEFORE.clear()
    _BEFORE.update(child.pid for child in psutil.Process().children(recursive=True))


def assert_nothing_left(timeout: float = 10.0) -> None:
    """No process the test started is left running (the local fork server's idle pool aside)."""
    import psutil

    from dtrain_magic.launchers import get_launcher

    def alive():
        idle = get_launcher("local").pool.idle_pids() | _BEFORE
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid not in idle and child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == []


def failing_for_negative_rates(ctx):
    if ctx.params["lr"] < 0:
        raise ValueError(f"a negative rate: {ctx.params['lr']}")
    ctx.log(loss=ctx.params["lr"])


def test_a_failing_trial_is_failed_with_its_error_and_the_sweep_goes_on(tracking_uri):
    result = dtrain_magic.sweep(failing_for_negative_rates, "lr=grid(0.1,-1.0)", metric="loss", num_processes=1,
                                cpu=True, tracking_uri=tracking_uri, ui=False)
    states = dict(zip(result.trials["params_lr"], result.trials["state"], strict=True))
    assert states == {0.1: "COMPLETE", -1.0: "FAIL"}
    error = result.trials.set_index("params_lr").loc[-1.0, "user_attrs_error"]
    assert error.startswith("WorkerError: rank 0 failed: ValueError: a negative rate: -1.0"), error
    runs = {run.data.params["lr"]: run.info.status for run in children(client(tracking_uri), result.parent_run_id)}
    assert runs == {"0.1": "FINISHED", "-1.0": "FAILED"}
    assert result.best.params == {"lr": 0.1}


PRUNE_STEPS = 60


def test_pruned_trials_stop_on_every_rank_after_the_same_step(tmp_path, tracking_uri):
    # 8 trials of 2 ranks, one at a time: 0.3 and 0.2 converge and come first (--seed 80 orders Optuna 4.6's grid),
    # the 6 above 1 diverge. Optuna's median pruner stops a trial whose best loss so far is worse than the median of
    # the completed trials' at the same step (after 2 completed, from step 3): each diverging one, early.
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3)
    out = tmp_path / "steps"
    out.mkdir()
    result = dtrain_magic.sweep(diverging_or_not, "lr=grid(0.3,0.2,1.5,1.6,1.7,1.8,1.9,2.0)", metric="loss",
                                num_processes=2, cpu=True, seed=80, tracking_uri=tracking_uri, pruner=pruner,
                                parallel_trials=1, ui=False, out_dir=str(out), steps=PRUNE_STEPS)
    frame = result.trials.sort_values("number")
    assert list(frame["params_lr"][:2]) == [0.3, 0.2], frame["params_lr"]  # the seed's order (Optuna 4.6)
    states = dict(zip(frame["params_lr"], frame["state"], strict=True))
    assert states == {0.3: "COMPLETE", 0.2: "COMPLETE", **{lr: "PRUNED" for lr in (1.5, 1.6, 1.7, 1.8, 1.9, 2.0)}}
    made = {lr: [ended(out, lr, rank)[0] for rank in (0, 1)] for lr in states}
    runs = {run.info.run_id: run for run in children(client(tracking_uri), result.parent_run_id)}
    for _, trial in frame[frame["state"] == "PRUNED"].iterrows():
        lr, stopped = trial["params_lr"], trial["user_attrs_stopped_at_step"]
        assert made[lr] == [stopped, stopped], (lr, made[lr], stopped)  # every rank: the same last step
        assert stopped > trial["user_attrs_pruned_at_step"]  # after the decision, never before it
        run = runs[trial["user_attrs_mlflow_run_id"]]
        assert run.info.status == "KILLED" and run.data.tags["dtrain_magic.stopped_at_step"] == str(int(stopped))
        assert run.data.tags["dtrain_magic.pruned_at_step"] == str(int(trial["user_attrs_pruned_at_step"]))
    assert made[0.3] == made[0.2] == [PRUNE_STEPS, PRUNE_STEPS]
    total = sum(steps[0] for steps in made.values())
    assert total <= len(made) * PRUNE_STEPS / 2, made  # at most half the unpruned budget
    assert_nothing_left()


def every_row_once(ctx):
    """Reads ``--data train`` in batches; every row exactly once across the trial's ranks (checked on every rank)."""
    import torch.distributed as dist

    seen = []
    for batch in ctx.data("train", batch_size=50):
        seen += batch["id"].tolist()
    every = [None] * ctx.world_size
    dist.all_gather_object(every, seen)
    assert sorted(i for part in every for i in part) == list(range(1000))
    ctx.log(loss=ctx.params["lr"])


def test_data_is_staged_once_for_trials_at_once_and_each_reads_every_row_once(tracking_uri, capsys):
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame({"x": np.arange(1000, dtype="float32"), "id": np.arange(1000)})
    result = dtrain_magic.sweep(every_row_once, "lr=grid(0.1,0.2,0.3,0.4)", metric="loss", num_processes=1, cpu=True,
                                tracking_uri=tracking_uri, ui=False, data={"train": frame}, parallel_trials=2)
    assert set(result.trials["state"]) == {"COMPLETE"}
    printed = capsys.readouterr().out
    assert printed.count("data train: staging pandas DataFrame train") == 1, printed  # once for the four trials
    assert printed.count("data train: reusing the copy") == 3, printed
