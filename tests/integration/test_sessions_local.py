"""An interactive session on ``--backend local``, really started: two forked ranks kept from cell to cell.

One session for the module (its checks run in file order on it), then the cases only this backend pays for cheaply:
a rank stuck in a collective the other rank never joins (named, and the restart offered and done), the idle
release, and a ``%%distribute`` run beside the session. The checks shared with Spark and Ray: session_checks.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import session_checks as checks
from dtrain_magic.errors import CellInterrupted, SessionError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    here = os.getcwd()
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    notebook = checks.Notebook.open(tmp_path_factory.mktemp("session_local"))
    checks.start(notebook, "local")
    yield notebook
    from dtrain_magic.state import kernel_state

    for session in kernel_state().sessions():  # a failed test may leave it open
        session.stop("the test module ends")
    os.chdir(here)
    os.environ.pop("MLFLOW_TRACKING_URI") if uri is None else os.environ.update(MLFLOW_TRACKING_URI=uri)


@pytest.fixture(scope="module")
def mlflow(notebook):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=notebook.tracking_uri)


@pytest.fixture(scope="module")
def reference(notebook):
    """One %%distribute run of the same code (beside the open session: a run never takes the session's ranks)."""
    result = notebook.run(checks.one_run("local"))
    assert result.error_in_exec is None, result.error_in_exec
    return result.result.value


def test_the_start_says_what_is_held(notebook):
    session = notebook.session
    assert session.state == "open" and session.config.backend == "local" and session.world_size == 2
    assert "held until it is idle for 30 min" in session.held_text()
    assert len(set(checks.rank_pids(session))) == 2


def test_state_is_kept_and_output_comes_by_rank(notebook, capsys):
    checks.check_state_is_kept_and_output_comes_by_rank(notebook, capsys)


def test_three_cells_train_like_one_run(notebook, reference, mlflow):
    checks.check_three_cells_train_like_one_run(notebook, reference, mlflow)


def test_a_subset_cell_runs_only_there(notebook, capsys):
    checks.check_a_subset_cell_runs_only_there(notebook, capsys)


def test_a_failing_cell_is_reported_and_the_next_works(notebook):
    checks.check_a_failing_cell_is_reported_and_the_next_works(notebook)


def test_an_interrupt_stops_a_long_cell_everywhere(notebook):
    back = checks.check_an_interrupt_stops_a_long_cell_everywhere(notebook)
    print(f"local: cell back {back:.2f} s after the interrupt")


def test_pull_and_push(notebook):
    checks.check_pull_and_push(notebook)


@pytest.fixture
def interrupt_after():
    """``interrupt_after(s)``: SIGINT this process (the kernel's interrupt) ``s`` seconds from now."""
    def arm(seconds: float) -> None:
        timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()

    return arm


def test_a_rank_stuck_in_a_collective_is_named_and_a_restart_recovers(notebook, interrupt_after):
    """A collective on rank 0 alone: the interrupt cannot free it (it waits in gloo's native code for rank 1, which
    never joins); the cell says so and how to restart; rank 0 refuses cells until then (rank 1 still takes them);
    the restart starts every rank afresh."""
    old = checks.rank_pids(notebook.session)
    interrupt_after(2.0)
    result = notebook.run("%%ranks 0\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))")
    error = result.error_in_exec
    assert isinstance(error, CellInterrupted) and error.stuck == (0,), error
    assert "rank 0 did not stop within 5 s" in str(error) and "%distribute_session restart" in str(error)
    busy = notebook.run("%%ranks\n1").error_in_exec
    assert isinstance(busy, SessionError) and f"rank 0 still runs Cell In[{result.execution_count}]" in str(busy)
    assert dict(notebook.ok("%%ranks 1\nctx.rank")) == {1: 1}  # the other rank is free
    assert "busy with Cell In[" in notebook.session.status()
    notebook.ok("%distribute_session restart")
    checks.assert_gone(old, 10.0)
    assert set(checks.rank_pids(notebook.session)).isdisjoint(old)
    assert dict(notebook.ok("%%ranks\n'model' in dir(), ctx.rank")) == {0: (False, 0), 1: (False, 1)}


def test_stop_frees_the_ranks_and_ends_the_mlflow_run(notebook, mlflow):
    checks.stop_and_check(notebook, mlflow, within_s=10.0)
    result = notebook.run("%%ranks\n1")
    assert isinstance(result.error_in_exec, SessionError)
    assert "no session is open in this kernel (the last one ended: stopped by %distribute_session stop" in str(
        result.error_in_exec)


def test_an_idle_session_is_released(notebook, mlflow):
    notebook.ok("%distribute_session start --backend local -n 2 --cpu --no-ui --idle-timeout 2")
    session = notebook.session
    pids = checks.rank_pids(session)
    time.sleep(1.0)
    notebook.ok("%%ranks\n1")  # a cell starts the idle time again
    deadline = time.monotonic() + 20
    while session.state != "closed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session.state == "closed" and "idle" in session.ended
    checks.assert_gone(pids, 10.0)
    assert mlflow.get_run(session.run_id).info.status == "FINISHED"
    assert "released after 2 s idle" in str(notebook.run("%%ranks\n1").error_in_exec)
