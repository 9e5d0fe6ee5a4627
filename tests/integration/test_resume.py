"""``--resume`` in a new kernel (issue #37): a notebook process killed mid-run, a new one continues the cell's run.

Real notebook processes (an IPython shell in a subprocess, as tests/integration/test_notebook_exit.py starts them),
the local backend, one MLflow store on disk shared by both: the first is SIGKILLed (no atexit, no clean-up: a kernel
that died) while its run waits after its step-3 checkpoint; the second runs the same cell with ``--resume``. The
uninterrupted run's weights are one plain process's (`uninterrupted_weights`).
"""

from __future__ import annotations

import signal
import textwrap

import pytest

from leftovers import kill_tagged, new_tag, wait_until_none_left
from test_notebook_exit import run_notebook

pytestmark = pytest.mark.slow

STEPS, EVERY, PAUSE_AT = 12, 4, 6

CELL = '''%%distribute --backend local -n 2 --no-ui @FLAGS@
import os, time, torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, opt = ctx.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    data = torch.randn({steps}, 2, 4, 8, generator=torch.Generator().manual_seed(1))  # step, rank, batch, x
    state = ctx.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    print(f"starting at step {{start}}")
    for step in range(start, {steps}):
        if step == {pause_at} and not os.path.exists("paused"):  # the first kernel dies here
            open("paused", "w").close() if ctx.rank == 0 else None
            time.sleep(600)
        loss = (model(data[step, ctx.rank]) - data[step, ctx.rank].sum(-1, keepdim=True)).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        ctx.log({{"loss": loss.item()}}, step=step)
        if step % {every} == {every} - 1:
            ctx.save_checkpoint(step=step)
    return {{k: v.detach().clone() for k, v in ctx.strategy.full_state_dict().items()}}
'''

HEAD = textwrap.dedent('''
    import os, sys, time, threading, signal
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic")
    def cell(flags):
        return {cell!r}.replace("@FLAGS@", flags)
''')

FIRST = HEAD + textwrap.dedent('''
    from dtrain_magic.state import kernel_state
    def die_when_paused():
        # Paused at step 6 (the step-3 checkpoint complete), and the MLflow run open (local workers start before it)
        while not os.path.exists("paused") or not any(run.launch.tracker for run in kernel_state().live_runs()):
            time.sleep(0.1)
        time.sleep(1.0)  # the MLflow writer flushes what it has (it writes every second)
        print("VERDICT killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no clean-up: a kernel that died
    threading.Thread(target=die_when_paused, daemon=True).start()
    shell.run_cell(cell(""))
    print("VERDICT returned", flush=True)
''')

SECOND = HEAD + textwrap.dedent('''
    import torch
    resumed = shell.run_cell(cell("--resume"))
    if resumed.error_in_exec is not None:
        print("VERDICT failed", repr(resumed.error_in_exec), flush=True)
        sys.exit(1)
    torch.save(resumed.result.value, "resumed.pt")
    print(f"VERDICT ok {{resumed.result.run_id}}", flush=True)
''')


def uninterrupted_weights() -> dict:
    """CELL's final weights in one plain process: each step's two ranks' batches together (DDP averages the two
    ranks' gradients of their means: the gradient of the mean over both), Adam, fp32."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(STEPS, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        x = data[step].reshape(8, 8)
        loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def test_a_killed_kernels_run_resumes_in_a_new_kernel_into_the_same_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    cell = CELL.format(steps=STEPS, every=EVERY, pause_at=PAUSE_AT)
    tag = new_tag()
    try:
        first = run_notebook(FIRST.format(cell=cell), tag, tmp_path, timeout=240, merged=True)
        assert first.returncode == -signal.SIGKILL and "VERDICT killed" in first.stdout, first.stdout[-4000:]
        assert wait_until_none_left(tag, within_s=10) == []  # the dead kernel's workers went with it
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        (killed,) = client.search_runs([client.get_experiment_by_name("dtrain_magic").experiment_id])
        assert killed.info.status == "RUNNING"  # its kernel died with it: nobody ended it
        second = run_notebook(SECOND.format(cell=cell), tag, tmp_path, timeout=240, merged=True)
        verdict = second.stdout.rpartition("VERDICT ")[2].split()
        assert verdict[:1] == ["ok"], second.stdout[-4000:]
        resumed_id = verdict[1]
        assert wait_until_none_left(tag, within_s=15) == []
    finally:
        kill_tagged(tag)
    said = second.stdout
    assert f"--resume: continuing MLflow run {killed.info.run_id} (RUNNING before) from step {EVERY - 1}" in said, said
    assert f"[rank 0] starting at step {EVERY}" in said, said
    assert resumed_id == killed.info.run_id
    import torch

    resumed = torch.load(tmp_path / "resumed.pt")
    for name, value in uninterrupted_weights().items():  # fp32, one process: within 1e-5
        assert torch.allclose(resumed[name], value, atol=1e-5, rtol=0), (name, resumed[name] - value)
    run = client.get_run(resumed_id)
    assert run.info.status == "FINISHED" and run.data.tags["dtrain_magic.resumes"] == "1"
    history = client.get_metric_history(resumed_id, "loss")
    assert {m.step for m in history} == set(range(STEPS))  # one history: the first kernel's steps, then the rest
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run: the first one went on
