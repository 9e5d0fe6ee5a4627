"""``--resume`` (issue #37), the logic: the flag in every entry point, the function's identity across kernels, and
which MLflow run a cell continues (on a fake store: the real one is the integration test's).
tests/integration/test_resume.py kills a real notebook process and resumes in a new one."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

import dtrain_magic
from dtrain_magic import api, cli
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.notebook import flags
from dtrain_magic.payload import function_key
from dtrain_magic.tracking.resume import FUNCTION_TAG, ROOT_TAG, find_resume_target
from dtrain_magic.worker.resume_point import note_step


def train(ctx):
    return ctx.rank


def test_the_flag_alone_is_this_cells_last_run_and_a_value_is_a_run_id():
    line = lambda text: flags.config_from_line(text, gpu_available=lambda: False)  # noqa: E731
    assert line("--backend local --resume").resume == "latest"
    assert line("--backend local --resume 0a1b2c").resume == "0a1b2c"
    assert line("--backend local").resume is None
    assert line("--backend local --resume").flag_line().endswith(" --resume")
    assert RunConfig(backend="local", resume=True).resume == "latest" and RunConfig(resume=False).resume is None
    assert api.config_from_options({"resume": True, "backend": "local", "use_gpu": False}).resume == "latest"
    with pytest.raises(ConfigError, match="--resume: got 'a b'; give it alone"):
        RunConfig(backend="local", resume="a b")
    assert RunConfig(backend="ray", use_gpu=False, resume=True).resume == "latest"  # Ray Train restores by run name
    assert cli.parser().parse_args(["run", "m:f", "--resume"]).resume == "latest"
    with pytest.raises(ConfigError, match="--resume: continues one run, not a sweep's trials"):
        dtrain_magic.sweep(train, "lr=uniform(0.1,1)", trials=1, metric="loss", backend="local", resume=True)


def test_the_function_key_is_its_name_and_its_texts_digest():
    key = function_key(train)
    assert key.startswith("train:") and len(key) == len("train:") + 16
    namespace: dict = {}
    exec("def train(ctx):\n    return ctx.rank\n", namespace)  # the same text, no source file: its code's digest
    other = function_key(namespace["train"])
    assert other.startswith("train:") and other == function_key(namespace["train"]) != key


class FakeStore:
    """MlflowClient's calls the finder makes, on runs kept here (the real store, its filter syntax and a run's
    reopening are tests/integration/test_resume.py's: the finder there finds the killed kernel's run by its tag)."""

    tracking_uri = "sqlite:///fake/mlflow.db"

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.runs = tmp_path, []

    def get_experiment_by_name(self, name: str):
        return SimpleNamespace(experiment_id="1") if name == "dtrain_magic" else None

    def search_runs(self, experiment_ids, filter_string, order_by, max_results):
        assert experiment_ids == ["1"] and order_by == ["attributes.start_time DESC"]
        key = re.fullmatch(r"tags\.`dtrain_magic\.function` = '(.*)'", filter_string).group(1)
        found = [run for run in reversed(self.runs) if run.data.tags[FUNCTION_TAG] == key]
        return found[:max_results]

    def get_run(self, run_id: str):
        for run in self.runs:
            if run.info.run_id == run_id:
                return run
        raise LookupError(f"Run '{run_id}' not found")

    def run(self, status: str, key: str = "train:0123456789abcdef", step: int | None = 3) -> str:
        """A run of ``key``'s function, newer than every other, with a complete checkpoint at ``step`` (None: none)."""
        root = str(self.tmp_path / f"dtrain_{len(self.runs)}")
        if step is not None:
            done = os.path.join(root, "checkpoint_000000")
            os.makedirs(done)
            note_step(done, {"step": step}, is_main=True)
            open(os.path.join(done, ".complete"), "w").close()
        run_id = f"{len(self.runs):032x}"
        self.runs.append(SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=status),
                                         data=SimpleNamespace(tags={FUNCTION_TAG: key, ROOT_TAG: root})))
        return run_id


def test_the_newest_unfinished_run_of_this_function_with_a_checkpoint_is_continued(tmp_path):
    store = FakeStore(tmp_path)
    run, config = store.run, RunConfig(backend="local", resume=True)
    find = lambda: find_resume_target(config, "train:0123456789abcdef", store)  # noqa: E731
    assert find()[0] is None  # no run yet: a fresh one
    run("KILLED", step=7)
    newest = run("RUNNING")
    run("KILLED", key="other:fedcba9876543210")  # another function's: never this cell's
    target, words = find()
    assert target.run_id == newest and target.status == "RUNNING" and target.point.step == 3
    assert words.startswith(f"--resume: continuing MLflow run {newest} (RUNNING before) from step 3 (")
    run("FINISHED")
    target, words = find()
    assert target is None and "finished: a fresh run" in words
    run("FAILED", step=None)
    target, words = find()
    assert target is None and "saved no complete checkpoint under" in words and words.endswith("a fresh run")


def test_a_named_run_is_continued_or_refused_before_anything_launches(tmp_path):
    store = FakeStore(tmp_path)
    killed, finished, empty = store.run("KILLED", step=11), store.run("FINISHED"), store.run("FAILED", step=None)
    named = lambda run_id: find_resume_target(RunConfig(resume=run_id), "any:0", store)  # noqa: E731
    assert named(killed)[0].point.step == 11
    with pytest.raises(ConfigError, match=f"--resume: MLflow run {finished} finished: nothing to resume"):
        named(finished)
    with pytest.raises(ConfigError, match=f"--resume: MLflow run {empty} has no complete checkpoint"):
        named(empty)
    with pytest.raises(ConfigError, match="--resume: no MLflow run 0000 in sqlite:///fake/mlflow.db: Run '0000' not"):
        named("0000")
