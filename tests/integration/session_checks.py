"""The checks of an interactive session, run in a real notebook process on one backend (`session_notebook.py`, driven
by test_sessions.py): one session per backend, started once, many checks on it, in the order of `plan`.

Each check is a function of the `Notebook` (a real IPython shell with the extension loaded, in its own directory,
with its own MLflow store); it raises AssertionError when the session does not do what it should, and may return a
short note (a measured time). The training the equivalence check splits over three cells (fp32, fixed data per rank)
is `TRAIN_PARTS`; `one_run` writes the same statements as one ``%%distribute`` function.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from dtrain_magic.errors import CellInterrupted, ConfigError, RankError, SessionError
from dtrain_magic.state import kernel_state

BUILD = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = ctx.prepare(model, opt)
gen = torch.Generator().manual_seed(100 + ctx.rank)
data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(12)]

def train_steps(steps):
    for step in steps:
        x, y = data[step]
        loss = torch.nn.functional.mse_loss(model(x), y)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
    return loss.item()
"""
WEIGHTS = "{k: v.detach().clone() for k, v in ctx.full_state_dict().items()}"
# The training in three session cells: build and prepare; 5 steps; 7 steps and the full weights.
TRAIN_PARTS = (BUILD, "train_steps(range(0, 5))", f"train_steps(range(5, 12))\nweights = {WEIGHTS}\nweights")
STEPS_LOGGED = 12


# Where the one %%distribute run of the same code runs: beside the session on local; on Spark before the session
# (whose start then takes the workers that run left waiting); on Ray on local (a Ray run costs about 30 s here,
# and runs on Ray equal runs on local: tests/integration/test_ray.py).
REFERENCE = {"local": "local", "spark": "spark", "ray": "local"}


def one_run(backend: str, keep_warm: bool = False) -> str:
    """The same statements as one ``%%distribute`` function (what the three cells do, in one run)."""
    body = "\n".join([BUILD, "train_steps(range(0, 5))", "train_steps(range(5, 12))", f"return {WEIGHTS}"])
    flags = f"--backend {backend} -n 2 --cpu --seed 0 --no-ui" + (
        " --keep-warm 0" if backend != "local" and not keep_warm else "")
    return f"%%distribute {flags}\ndef train(ctx):\n" + textwrap.indent(body, "    ")


@dataclass
class Notebook:
    """A real IPython shell with ``%load_ext dtrain_magic``, working in ``root`` with an MLflow store there."""

    shell: Any
    root: Path
    tracking_uri: str
    backend: str
    facts: dict = field(default_factory=dict)

    @classmethod
    def open(cls, root: Path, backend: str) -> "Notebook":
        from IPython.core.interactiveshell import InteractiveShell

        os.chdir(root)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        shell = InteractiveShell.instance()
        shell.run_cell("%load_ext dtrain_magic", store_history=False)
        return cls(shell, root, uri, backend)

    def run(self, source: str) -> Any:
        """Run a cell; its IPython result (``.result``, ``.error_in_exec``, ``.execution_count``)."""
        return self.shell.run_cell(source, store_history=True)

    def ok(self, source: str) -> Any:
        result = self.run(source)
        assert result.error_in_exec is None, f"{type(result.error_in_exec).__name__}: {result.error_in_exec}"
        return result.result

    def printed(self, source: str) -> tuple[Any, str]:
        """Run a cell that must succeed; (its value, what it printed)."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            value = self.ok(source)
        return value, out.getvalue()

    @property
    def session(self) -> Any:
        found = kernel_state().sessions()
        assert found, f"no session is open (the last one ended: {kernel_state().last_session_end})"
        return found[0]

    @property
    def mlflow(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri)


def reference_run_leaves_workers_waiting(notebook: Notebook) -> str:
    """Before the session: the one %%distribute run of the training; after it, the next run's workers are launched and
    wait (warm re-runs), and `start` then takes them."""
    from dtrain_magic.launchers import get_launcher

    started = time.monotonic()
    reference = notebook.run(one_run(notebook.backend, keep_warm=True))
    assert reference.error_in_exec is None, reference.error_in_exec
    notebook.facts["reference"] = reference.result.value
    slot = get_launcher(notebook.backend).standbys
    assert slot.standby is not None, "no workers were launched for the next run"
    notebook.facts["claims"] = slot.claims
    return f"the run took {time.monotonic() - started:.1f} s"


def start(notebook: Notebook, extra: str = "") -> str:
    started = time.monotonic()
    _, out = notebook.printed(f"%distribute_session start --backend {notebook.backend} -n 2 --cpu --seed 0 --no-ui "
                              + extra)
    session = notebook.session
    assert session.state == "open" and session.world_size == 2 and len(set(rank_pids(session))) == 2
    assert "dtrain_magic: session open: " in out and "held until it is idle for" in out, out
    assert "%distribute_session stop frees them now" in out, out
    if "claims" in notebook.facts:  # a run left workers waiting: the session took them
        from dtrain_magic.launchers import get_launcher

        assert get_launcher(notebook.backend).standbys.claims == notebook.facts.pop("claims") + 1
        assert "its workers were launched ahead and waiting" in out, out
    return f"started in {time.monotonic() - started:.1f} s"


def state_is_kept_and_output_comes_by_rank(notebook: Notebook) -> None:
    _, out = notebook.printed("%%ranks\nstate = {'rank': ctx.rank, 'cells': 1}\nprint(f'hello from rank {ctx.rank}')")
    assert "[rank 0] hello from rank 0\n" in out and "[rank 1] hello from rank 1\n" in out, out
    values = notebook.ok("%%ranks\nstate['cells'] += 1\nstate")
    assert dict(values) == {0: {"rank": 0, "cells": 2}, 1: {"rank": 1, "cells": 2}}, values
    assert "[rank 0] {'rank': 0, 'cells': 2}" in repr(values)  # shown by rank
    assert notebook.ok("%%ranks\nx = 1;") is None  # no value: nothing shown


def three_cells_train_like_one_run(notebook: Notebook) -> str:
    """The weights after the three cells equal one %%distribute run of the same code (`REFERENCE`: on local it runs
    beside the open session, which it never takes ranks from) within 1e-5 (fp32), on both ranks; the cells' steps are
    in the session's one MLflow run, which is still RUNNING."""
    started = time.monotonic()
    expected = notebook.facts.get("reference")
    if expected is None:
        reference = notebook.run(one_run(REFERENCE[notebook.backend]))
        assert reference.error_in_exec is None, reference.error_in_exec
        expected = reference.result.value
    run_s = time.monotonic() - started
    mlflow, session = notebook.mlflow, notebook.session
    before = len(mlflow.get_metric_history(session.run_id, "loss"))
    for part in TRAIN_PARTS[:-1]:
        notebook.ok("%%ranks\n" + part)
    weights = notebook.ok("%%ranks\n" + TRAIN_PARTS[-1])
    assert set(weights) == {0, 1}
    for rank in (0, 1):
        assert set(weights[rank]) == set(expected)
        for name, tensor in expected.items():
            assert (weights[rank][name] - tensor).abs().max().item() < 1e-5, (rank, name)
    deadline = time.monotonic() + 15
    while len(mlflow.get_metric_history(session.run_id, "loss")) < before + STEPS_LOGGED:
        assert time.monotonic() < deadline, "the cells' ctx.log steps did not reach the session's MLflow run"
        time.sleep(0.2)
    assert len(mlflow.get_metric_history(session.run_id, "loss")) == before + STEPS_LOGGED
    assert mlflow.get_run(session.run_id).info.status == "RUNNING"
    return f"the %%distribute run took {run_s:.1f} s" if run_s > 0.05 else ""


def a_subset_cell_runs_only_there(notebook: Notebook) -> None:
    values, out = notebook.printed("%%ranks 1\nonly_here = ctx.rank\nprint('subset ran on', ctx.rank)\nonly_here")
    assert dict(values) == {1: 1} and "[rank 1] subset ran on 1" in out and "[rank 0]" not in out, out
    assert dict(notebook.ok("%%ranks\n'only_here' in dir()")) == {0: False, 1: True}


def a_failing_cell_is_reported_and_the_next_works(notebook: Notebook) -> None:
    result = notebook.run("%%ranks\nvalue = 10 * ctx.rank\nif ctx.rank == 1:\n"
                          "    raise ValueError('rank one is unhappy')\nvalue")
    error = result.error_in_exec
    assert isinstance(error, RankError), error
    text = str(error)
    assert text.startswith("rank 1 failed: ValueError: rank one is unhappy"), text
    assert f"Cell In[{result.execution_count}], line 4, in <module>" in text and "The session goes on" in text, text
    assert set(error.failures) == {1}
    assert dict(notebook.ok("%%ranks\nvalue")) == {0: 0, 1: 10}  # both ranks ran the cell up to there


def interrupt_soon(when: Callable[[], bool], after_s: float = 0.5) -> dict:
    """The kernel's interrupt as Jupyter sends it (SIGINT to the notebook's whole process group; this process leads
    its own) once ``when()`` holds; the returned dict gets the time it was sent."""
    sent: dict = {}

    def interrupt() -> None:
        deadline = time.monotonic() + 120
        while not when() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(after_s)
        sent["at"] = time.monotonic()
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    return sent


def an_interrupt_stops_a_long_cell_everywhere(notebook: Notebook) -> str:
    """The kernel's interrupt while both ranks run a long loop: the cell ends with `CellInterrupted` within 5 s, each
    rank interrupted at the loop's line; the next cell sees the state (and the session was not hurt by the signal
    reaching the notebook's whole process group)."""
    marks = notebook.root / f"marks-{time.monotonic_ns()}"
    marks.mkdir()
    notebook.shell.user_ns["marks"] = str(marks)
    notebook.printed("%distribute_push marks")
    sent = interrupt_soon(lambda: len(list(marks.iterdir())) >= 2)
    result = notebook.run("%%ranks\nimport os, time\nopen(os.path.join(marks, str(ctx.rank)), 'w').close()\n"
                          "n = 0\nwhile n < 100000:\n    n += 1\n    time.sleep(0.01)")
    back = time.monotonic() - sent["at"]
    error = result.error_in_exec
    assert isinstance(error, CellInterrupted), error
    assert error.stuck == () and "The session and its state are kept" in str(error), error
    for rank in (0, 1):
        assert f"rank {rank} interrupted at Cell In[{result.execution_count}], line 7" in str(error), error
    assert back < 5.0, back
    counts = notebook.ok("%%ranks\nn")
    assert all(0 < counts[rank] < 100000 for rank in (0, 1)), counts
    return f"the cell came back {back:.2f} s after the interrupt"


def pull_and_push(notebook: Notebook) -> None:
    notebook.shell.user_ns.update(scale=3.0, offsets={"a": 1})
    notebook.printed("%distribute_push scale offsets")
    notebook.ok("%%ranks\nimport torch\nt = torch.full((2,), scale * ctx.rank + offsets['a'])")
    pulled = notebook.ok("%distribute_pull t")
    assert isinstance(pulled, list) and [p.tolist() for p in pulled] == [[1.0, 1.0], [4.0, 4.0]], pulled
    assert dict(notebook.ok("%distribute_pull t.sum().item() --ranks 1")) == {1: 8.0}
    notebook.ok("%distribute_pull offsets --to back")
    assert notebook.shell.user_ns["back"] == [{"a": 1}, {"a": 1}]
    notebook.ok("%%ranks\nimport threading\nlock = threading.Lock()")
    error = notebook.run("%distribute_pull lock").error_in_exec
    assert isinstance(error, RankError) and "cannot be pickled" in str(error), error


def a_cell_writes_an_output_the_notebook_reads(notebook: Notebook) -> None:
    """``ctx.write`` in a ``%%ranks`` cell (docs/data.md, the way back): committed at the cell's end, bound by
    ``--output`` and read in the notebook, every rank's rows once; a cell that fails after writing leaves nothing."""
    notebook.ok("%%ranks --output preds=preds\nimport torch\nids = torch.arange(10) + 10 * ctx.rank\n"
                "ctx.write('preds', {'id': ids, 'y': ids * 2.0});")
    table = notebook.shell.user_ns["preds"].to_table()  # a pyarrow Dataset on local
    assert sorted(table.column("id").to_pylist()) == list(range(20)), table
    assert table.column("y").to_pylist() == [2.0 * i for i in table.column("id").to_pylist()]
    outputs = os.path.dirname(os.path.dirname(notebook.session.outputs["preds"].path))
    error = notebook.run("%%ranks\nctx.write('scratch', {'id': torch.arange(3)})\nif ctx.rank == 1:\n"
                         "    raise ValueError('no')").error_in_exec
    assert isinstance(error, RankError), error
    left = [os.path.join(d, f) for d, _, files in os.walk(outputs) for f in files]
    assert left and all("/preds/" in path for path in left), left  # the failed cell's parts are gone


def a_rank_stuck_in_a_collective_is_named_and_a_restart_recovers(notebook: Notebook) -> str:
    """A collective on rank 0 alone: the interrupt cannot free it (it waits in gloo's native code for rank 1, which
    never joins); the cell says so and how to restart; rank 0 refuses cells until then (rank 1 still takes them);
    the restart starts every rank afresh, and the old ranks are gone."""
    old = rank_pids(notebook.session)
    interrupt_soon(lambda: True, after_s=1.0)
    result = notebook.run("%%ranks 0\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))")
    error = result.error_in_exec
    assert isinstance(error, CellInterrupted) and error.stuck == (0,), error
    assert "rank 0 did not stop within 5 s" in str(error) and "%distribute_session restart" in str(error), error
    busy = notebook.run("%%ranks\n1").error_in_exec
    assert isinstance(busy, SessionError) and f"rank 0 still runs Cell In[{result.execution_count}]" in str(busy)
    assert dict(notebook.ok("%%ranks 1\nctx.rank")) == {1: 1}  # the other rank is free
    assert "busy with Cell In[" in notebook.session.status()
    started = time.monotonic()
    notebook.printed("%distribute_session restart")
    restart_s = time.monotonic() - started
    assert_gone(old, 10.0)
    assert set(rank_pids(notebook.session)).isdisjoint(old)
    assert dict(notebook.ok("%%ranks\n'model' in dir(), ctx.rank")) == {0: (False, 0), 1: (False, 1)}
    return f"restarted in {restart_s:.1f} s"


def a_run_that_does_not_fit_beside_the_session_is_refused(notebook: Notebook) -> None:
    """On a pool of known size (the local Ray instance's CPUs): -n 3 beside the session's 2 ranks on 4 CPUs is a
    clear error before anything is launched, not a run waiting forever for CPUs."""
    result = notebook.run("%%distribute --backend ray -n 3 --cpu --no-ui\ndef train(ctx):\n    return ctx.rank\n")
    error = result.error_in_exec
    assert isinstance(error, ConfigError), error
    assert "-n 3 beside the open session's 2 ranks needs 5 of the 4 CPUs of the local Ray instance" in str(error)
    assert "use -n 2 or fewer" in str(error) and "nothing was launched" in str(error)
    assert notebook.ok("%%ranks\nctx.rank") == {0: 0, 1: 1}


def stop_frees_the_ranks_and_ends_the_mlflow_run(notebook: Notebook) -> str:
    session, mlflow = notebook.session, notebook.mlflow
    pids = rank_pids(session)
    started = time.monotonic()
    _, out = notebook.printed("%distribute_session stop")
    stop_s = time.monotonic() - started
    assert "dtrain_magic: session stopped; released " in out, out
    assert kernel_state().sessions() == []
    assert_gone(pids, 10.0)
    run = mlflow.get_run(session.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["dtrain_magic.session"] == "true"
    assert "session_cells.py" in [item.path for item in mlflow.list_artifacts(session.run_id)]
    error = notebook.run("%%ranks\n1").error_in_exec
    assert isinstance(error, SessionError) and "the last one ended: stopped by %distribute_session stop" in str(error)
    return f"stopped in {stop_s:.1f} s"


def an_idle_session_is_released(notebook: Notebook) -> None:
    notebook.printed(f"%distribute_session start --backend {notebook.backend} -n 2 --cpu --no-ui --idle-timeout 2")
    session = notebook.session
    pids = rank_pids(session)
    time.sleep(1.0)
    notebook.ok("%%ranks\n1")  # a cell starts the idle time again
    deadline = time.monotonic() + 30
    while session.state != "closed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session.state == "closed" and "idle" in session.ended, session.ended
    assert_gone(pids, 10.0)
    assert notebook.mlflow.get_run(session.run_id).info.status == "FINISHED"
    assert "released after 2 s idle" in str(notebook.run("%%ranks\n1").error_in_exec)


def an_fsdp_session_trains_like_an_fsdp_run(notebook: Notebook) -> str:
    """A session under another strategy (FSDP2 on CPU): the same three cells give the weights of one ``%%distribute
    --strategy fsdp`` run of the same code (fp32, 1e-5), gathered by ``ctx.full_state_dict()``; the notebook then exits
    with this session open."""
    reference = notebook.run(one_run("local").replace("--no-ui", "--no-ui --strategy fsdp", 1))
    assert reference.error_in_exec is None, reference.error_in_exec
    note = start(notebook, "--strategy fsdp")
    assert notebook.session.config.strategy == "fsdp"
    for part in TRAIN_PARTS[:-1]:
        notebook.ok("%%ranks\n" + part)
    weights = notebook.ok("%%ranks\n" + TRAIN_PARTS[-1])
    for rank in (0, 1):
        for name, tensor in reference.result.value.items():
            assert (weights[rank][name] - tensor).abs().max().item() < 1e-5, (rank, name)
    return note


def plan(backend: str) -> list[tuple[str, Callable[[Notebook], Any]]]:
    """The checks for ``backend``, in order; the notebook exits after the last one with its session open."""
    first = [reference_run_leaves_workers_waiting] if backend == "spark" else []
    shared = [start, state_is_kept_and_output_comes_by_rank, three_cells_train_like_one_run,
              a_subset_cell_runs_only_there, a_failing_cell_is_reported_and_the_next_works,
              an_interrupt_stops_a_long_cell_everywhere, pull_and_push]
    extra = {
        "local": [a_cell_writes_an_output_the_notebook_reads,
                  a_rank_stuck_in_a_collective_is_named_and_a_restart_recovers,
                  stop_frees_the_ranks_and_ends_the_mlflow_run, an_idle_session_is_released,
                  an_fsdp_session_trains_like_an_fsdp_run],
        "spark": [],
        "ray": [a_run_that_does_not_fit_beside_the_session_is_refused],
    }[backend]
    return [(check.__name__, check) for check in first + shared + extra]


def rank_pids(session: Any) -> list[int]:
    return [ready.pid for ready in session.links.ready.values()]


def assert_gone(pids: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (left := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"rank processes alive {within_s:g} s later: {left}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
