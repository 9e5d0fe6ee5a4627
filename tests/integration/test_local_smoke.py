"""The local backend really starts processes and trains (quick smoke; the full suite is test_local.py)."""

import pytest

pytestmark = pytest.mark.slow


def test_two_processes_train_and_return_every_rank(shell, mlflow):
    result = shell.run(
        """%%distribute --backend local -n 2 --no-ui
import torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.prepare(model, opt)
    for step in range(3):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        ctx.backward(loss); ctx.step()
        ctx.log(loss=loss.item())
    return ctx.rank
"""
    )
    assert result.error_in_exec is None, result.error_in_exec
    run = result.result
    assert run.values == [0, 1] and run.value == 0
    assert mlflow.get_run(run.run_id).info.status == "FINISHED"
    assert [m.step for m in mlflow.get_metric_history(run.run_id, "loss")] == [0, 1, 2]


def test_a_fast_loops_metrics_are_thinned_per_set_keeping_the_last_and_the_rare(shell, mlflow):
    """3000 values of ``loss`` in well under a second: the first 200 and the last reach MLflow, not all; a
    metric logged with it every 1000 steps is never thinned; the run's tag counts what was left out."""
    result = shell.run(
        """%%distribute --backend local -n 1 --no-ui
def train(ctx):
    for step in range(3000):
        ctx.log(loss=float(step), **({"val_loss": 1.0} if step % 1000 == 0 else {}))
"""
    )
    assert result.error_in_exec is None, result.error_in_exec
    run_id = result.result.run_id
    steps = [m.step for m in mlflow.get_metric_history(run_id, "loss")]
    assert steps[:200] == list(range(200)) and steps[-1] == 2999 and len(steps) < 500, (len(steps), steps[-5:])
    assert [m.step for m in mlflow.get_metric_history(run_id, "val_loss")] == [0, 1000, 2000]
    tag = mlflow.get_run(run_id).data.tags["dtrain_magic.metrics_thinned"]
    assert tag.startswith(f"{3000 - len(steps)} values left out"), (tag, len(steps))
