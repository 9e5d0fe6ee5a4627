"""The MLflow run of a ``%%distribute``, opened beside the workers' start: a real SQLite store, real runs."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.tracking import RunOpening, RunTracker, sqlite_experiment_stage

pytestmark = pytest.mark.slow


def test_store_is_read_without_mlflow_as_mlflow_wrote_it(tmp_path, mlflow, tracking_uri):
    """The look at a SQLite store that lets workers start before MLflow is imported agrees with MLflow."""
    missing = tmp_path / "sub" / "new.db"
    missing.parent.mkdir()
    assert sqlite_experiment_stage(f"sqlite:///{missing}", "x") == "absent"  # no database yet: MLflow creates it
    assert not missing.exists()  # ... and the look created nothing
    mlflow.create_experiment("kept")
    mlflow.delete_experiment(mlflow.create_experiment("gone"))
    assert sqlite_experiment_stage(tracking_uri, "kept") == "active"
    assert sqlite_experiment_stage(tracking_uri, "gone") == "deleted"
    assert sqlite_experiment_stage(tracking_uri, "new") == "absent"
    # cannot tell: another kind of store, not MLflow's schema, a folder this user cannot write
    assert sqlite_experiment_stage("http://127.0.0.1:5000", "kept") is None
    assert sqlite_experiment_stage(f"{tracking_uri}?timeout=5", "kept") is None
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    assert sqlite_experiment_stage(f"sqlite:///{other}", "kept") is None
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        if not os.access(locked, os.W_OK):  # root can write anywhere
            assert sqlite_experiment_stage(f"sqlite:///{locked}/m.db", "kept") is None
    finally:
        locked.chmod(0o700)


def test_a_run_closed_before_it_opened_still_ends(tracking_uri, mlflow):
    """An interrupt while MLflow is still opening the run: the run ends KILLED when it opens, never RUNNING."""
    opening = RunOpening(RunConfig(tracking_uri=tracking_uri, experiment="early"), system_metrics=False)
    opening.close("KILLED", "interrupted from the notebook", {"dtrain_magic.wall_time_s": "0.001"})
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("early").experiment_id])
    assert run.info.status == "KILLED"
    assert run.data.tags["dtrain_magic.failure"] == "interrupted from the notebook"
    assert run.data.tags["dtrain_magic.wall_time_s"] == "0.001"


def test_local_workers_start_while_mlflow_opens_the_run(shell, mlflow, monkeypatch):
    """A kernel's first run imports MLflow for seconds: the local workers (no idle interpreters: spawned at
    the call) start and train meanwhile, and every metric they logged before the run existed is in it.
    (MLflow is already imported in this test process: a 6 s delay in opening the run stands in for it.)"""
    from dtrain_magic.launchers import get_launcher

    get_launcher("local").shutdown()
    real_start = RunTracker.start.__func__
    opened = {}

    def slow_start(cls, *args, **kwargs):
        time.sleep(6.0)
        tracker = real_start(cls, *args, **kwargs)
        opened["at"] = time.time()
        return tracker

    monkeypatch.setattr(RunTracker, "start", classmethod(slow_start))
    cell = (
        "%%distribute --backend local -n 2 --no-ui\nimport time\n"
        "def train(ctx):\n    entered = time.time()\n"
        "    for step in range(20):\n        ctx.log(loss=float(step))\n    return entered\n"
    )
    called = time.time()
    result = shell.run(cell)
    assert result.error_in_exec is None, result.error_in_exec
    run = result.result
    assert max(run.values) < opened["at"], "the workers waited for the MLflow run"
    assert run.time_to_first_step_s < opened["at"] - called  # the workers' own clock, not when the notebook saw it
    assert [m.value for m in mlflow.get_metric_history(run.run_id, "loss")] == [float(s) for s in range(20)]
    info = mlflow.get_run(run.run_id)
    assert info.info.status == "FINISHED"
    assert info.data.tags["dtrain_magic.checkpoint_root"] == run.checkpoint_root
    assert time.time() - called < 30


def test_store_that_fails_after_the_workers_started_stops_them(shell, tmp_path):
    """The look at the store passed (an ``experiments`` table), MLflow then refuses the file: the workers
    that had started are stopped, the cell says so, and no run exists."""

    fake = tmp_path / "not_mlflow.db"
    db = sqlite3.connect(fake)
    db.execute("CREATE TABLE experiments (name TEXT, lifecycle_stage TEXT)")
    db.commit()
    db.close()
    assert sqlite_experiment_stage(f"sqlite:///{fake}", "dtrain_magic") == "absent"
    started = time.monotonic()
    result = shell.run(
        f"%%distribute --backend local -n 2 --no-ui --tracking-uri sqlite:///{fake}\n"
        "import time\ndef train(ctx):\n    ctx.log(loss=1.0)\n    time.sleep(60)\n"
    )
    error = result.error_in_exec
    assert isinstance(error, ConfigError), error
    text = "\n".join(error._render_traceback_())
    assert "--tracking-uri" in text and "MLflow cannot use this store" in text and "were stopped" in text, text
    assert "Nothing was launched" not in text
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while local_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert local_workers() == []


def local_workers() -> list:
    """This process's local-backend workers still alive, other than the idle warm pool (an earlier test
    module's JVM or Ray processes are not ours to count here)."""
    import psutil

    from dtrain_magic.launchers import get_launcher

    server = get_launcher("local").pool.server_pid()
    found = []
    for child in psutil.Process().children(recursive=True):
        try:  # the workers: the fork server's children
            if server is not None and child.ppid() == server and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            pass
    return found
