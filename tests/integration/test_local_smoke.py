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
