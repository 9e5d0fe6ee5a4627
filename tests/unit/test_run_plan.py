"""`runner.check` returns the plan `execute` runs: each fact looked up once (stub launcher, SQLite files)."""

import sqlite3

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.driver import plan as planning
from dtrain_magic.driver import runner
from dtrain_magic.errors import ConfigError
from dtrain_magic.launchers.base import Launcher


class StubLauncher(Launcher):
    """Counts what the runner asks of it; starts nothing."""

    name = "stub"

    def __init__(self, early: bool = True):
        self.early = early
        self.asked = {"check": 0, "starts_before_tracking": 0, "channel_host": 0}

    def check(self, config):
        self.asked["check"] += 1

    def starts_before_tracking(self, config):
        self.asked["starts_before_tracking"] += 1
        return self.early

    def channel_host(self, config):
        self.asked["channel_host"] += 1
        return "127.0.0.1"

    def start(self, job, emit):
        raise AssertionError("a check starts nothing")


@pytest.fixture
def stub(monkeypatch):
    launcher = StubLauncher()
    lookups = []
    monkeypatch.setattr(planning, "get_launcher", lambda name: lookups.append(name) or launcher)
    launcher.lookups = lookups
    return launcher


@pytest.fixture
def preloads(monkeypatch):
    calls = []
    monkeypatch.setattr(planning, "preload_mlflow", lambda: calls.append(1))  # no MLflow import in a unit test
    return calls


def store(tmp_path, experiments=()):
    """A SQLite file with MLflow's experiments table (only the columns the stage read uses)."""
    path = tmp_path / "mlflow.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE experiments (name TEXT, lifecycle_stage TEXT)")
        db.executemany("INSERT INTO experiments VALUES (?, ?)", experiments)
    return f"sqlite:///{path}"


def test_check_looks_each_thing_up_once_and_returns_the_plan(tmp_path, count_calls, stub, preloads):
    from dtrain_magic.tracking import uri as tracking_uri

    stage_reads = count_calls(tracking_uri, "sqlite_experiment_stage")
    uri = store(tmp_path, [("dtrain_magic", "active")])
    config = RunConfig(tracking_uri=uri)
    plan = runner.check(config)
    assert (plan.config, plan.launcher, plan.tracking_uri, plan.store_stage, plan.starts_before_tracking) == (
        config, stub, uri, "active", True)
    assert len(stage_reads) == 1 and len(stub.lookups) == 1 and preloads == []
    assert stub.asked == {"check": 1, "starts_before_tracking": 1, "channel_host": 0}  # no Ray started by a dry run
    assert plan.channel_host == "127.0.0.1" and plan.channel_host == "127.0.0.1"
    assert stub.asked["channel_host"] == 1


def test_workers_wait_for_the_run_when_the_store_cannot_be_read_without_mlflow(tmp_path, stub, preloads):
    plan = runner.check(RunConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db?timeout=5"))
    assert plan.store_stage is None and plan.starts_before_tracking is False and preloads == [1]


def test_workers_wait_for_the_run_when_the_backend_needs_its_id(tmp_path, stub, preloads):
    stub.early = False
    plan = runner.check(RunConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"))
    assert plan.store_stage == "absent" and plan.starts_before_tracking is False and preloads == [1]


def test_a_deleted_experiment_is_refused_by_check(tmp_path, stub, preloads):
    uri = store(tmp_path, [("gone", "deleted")])
    with pytest.raises(ConfigError, match="--experiment: the experiment 'gone' was deleted"):
        runner.check(RunConfig(experiment="gone", tracking_uri=uri))
