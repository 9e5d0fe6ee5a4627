"""The sweep loop with real Optuna and fake runs (dtrain_magic/sweep/runner.py, study.py, trial.py, options.py): the
best trial, pruning through the run's stop event, failures, run options checked up front, packing, resume."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import optuna
import pytest

from dtrain_magic.backends import Local
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError, RunInterrupted, RunStopped, WorkerError
from dtrain_magic.result import RunResult
from dtrain_magic.sweep import runner as sweep_runner
from dtrain_magic.sweep import study as sweep_study
from dtrain_magic.sweep.options import SweepOptions, options_from
from dtrain_magic.sweep.runner import Sweep, SweepError
from dtrain_magic.sweep.space import parse_space


class FakeLauncher:
    name = "ray"
    ranks_on_this_machine = False

    def __init__(self, capacity=None, one_machine=False):
        self._capacity, self.one_machine = capacity, one_machine

    def capacity(self, config):
        return self._capacity

    def workers_share_files(self, config):
        return self.one_machine

    def release_reused(self, reason):
        return 0


@dataclass(frozen=True)
class FakePlan:
    config: RunConfig
    launcher: Any = field(default_factory=FakeLauncher)
    tracking_uri: str = "sqlite:////tmp/not-used/mlflow.db"


@dataclass(frozen=True)
class FakeRun:
    """A `PreparedRun` stand-in: ``train(params, step)`` gives the metric at each step, or raises. Asked to stop at a
    step (`StepStop.at_a_step`), it makes one more step and ends `RunStopped` after it, as the pump and ranks do."""

    plan: FakePlan
    train: Any
    steps: int = 10
    payload: Any = "payload"
    params: Any = field(default_factory=dict)
    parent_run_id: str | None = None
    log_mark: Any = None
    reuse_workers: bool = False
    log: list = field(default_factory=list)  # (event, trial params, time)

    @property
    def config(self):
        return self.plan.config

    def execute(self, observer, stop):
        run_id = f"run-{id(self.params)}"
        observer.started(self.config, run_id, "", "")
        self.log.append(("start", dict(self.params), time.monotonic()))
        try:
            value, stop_after = None, None
            for step in range(self.steps):
                if stop.is_set():
                    raise RunInterrupted("stopped")
                if stop_after is None and stop.wanted:
                    stop_after = step + 1  # a ctx.step count beyond this one
                if stop_after is not None and step == stop_after:
                    raise RunStopped(f"every rank stopped after step {stop_after}", stop_after)
                try:
                    value = self.train(dict(self.params), step, self.config)
                except ZeroDivisionError as exc:  # as a worker's failure comes back
                    raise WorkerError(0, f"ZeroDivisionError: {exc}") from None
                observer.metric(step, {"loss": value})
            return RunResult(value=None, values=[None], run_id=run_id, config=self.config, wall_time_s=0.1,
                             metrics={"loss": value})
        finally:
            self.log.append(("end", dict(self.params), time.monotonic()))


class FakeParent:
    made: list = []

    def __init__(self, tracking_uri, experiment, name, params, study=None):
        self.run_id, self.name, self.params, self.tags, self.status = "parent", name, params, {}, None
        FakeParent.made.append(self)

    def tag_trial(self, run_id, tags):
        self.tags[run_id] = dict(tags)

    def end(self, status, best=None, metric=None):
        self.status, self.best = status, best


@pytest.fixture(autouse=True)
def fake_parent(monkeypatch):
    FakeParent.made = []
    monkeypatch.setattr(sweep_runner, "ParentRun", FakeParent)


def sweep(space, train, steps=10, make_config=None, capacity=None, **options):
    config = RunConfig(num_processes=1)
    base = FakeRun(FakePlan(config, FakeLauncher(capacity)), train, steps)
    options.setdefault("metric", "loss")
    out = io.StringIO()
    return Sweep(base, make_config or (lambda o: config.replace(**o)), parse_space(space),
                 SweepOptions(space=space, **options), out=out), base, out


def quadratic(params, step, config):
    return (params["lr"] - 0.01) ** 2 + 1.0 / (step + 1)


def test_a_grid_sweep_runs_every_point_once_and_finds_the_best(monkeypatch):
    s, base, out = sweep("lr=grid(0.1,0.01,0.001,0.05)", quadratic, parallel_trials=1)
    result = s.run()
    assert result.best.params == {"lr": 0.01} and result.best.value == pytest.approx(0.1)
    frame = result.trials
    assert sorted(frame["params_lr"]) == [0.001, 0.01, 0.05, 0.1]
    assert set(frame["state"]) == {"COMPLETE"}
    lines = [line for line in out.getvalue().splitlines() if line.startswith("trial ")]
    assert len(lines) == 4 and all(" FINISHED loss=" in line for line in lines)
    assert FakeParent.made[0].status == "FINISHED" and FakeParent.made[0].best.params == {"lr": 0.01}
    assert {tags["dtrain_magic.trial"] for tags in FakeParent.made[0].tags.values()} == {0, 1, 2, 3}
    rows = s.board.rows()  # what the panel draws, fed as the trials ran
    assert [r["status"] for r in rows] == ["FINISHED"] * 4 and [r["steps"] for r in rows] == [10] * 4
    assert [r["params"] for r in rows if r["is_best"]] == ["lr=0.01"]


def test_the_median_pruner_stops_diverging_trials_at_a_step_through_their_stop_event():
    def train(params, step, config):
        return 1.0 / (step + 1) if params["lr"] < 0.5 else 10.0 * (step + 1)  # lr >= 0.5 diverges

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)
    s, base, out = sweep("lr=grid(0.1,0.2,0.6,0.7,0.8)", train, steps=20, pruner=pruner, parallel_trials=1)
    result = s.run()
    frame = result.trials.sort_values("number")
    completed, expected = 0, []
    for lr in frame["params_lr"]:  # a diverging trial is pruned once two trials completed (n_startup_trials)
        expected.append("PRUNED" if lr > 0.5 and completed >= 2 else "COMPLETE")
        completed += expected[-1] == "COMPLETE"
    assert list(frame["state"]) == expected and expected.count("PRUNED") >= 2
    pruned = frame[frame["state"] == "PRUNED"]
    assert set(pruned["user_attrs_pruned_at_step"]) == {2}  # the first step after the warm-up
    assert set(pruned["user_attrs_stopped_at_step"]) == {4}  # the step the run stopped after: one more was made
    assert set(pruned["user_attrs_steps"]) == {4}
    tags = [t for t in FakeParent.made[0].tags.values() if "dtrain_magic.pruned_at_step" in t]
    steps = [(t["dtrain_magic.pruned_at_step"], t["dtrain_magic.stopped_at_step"]) for t in tags]
    assert steps == [(2, 4)] * len(pruned)
    assert "PRUNED at step 2, every rank stopped after step 4" in out.getvalue()


def test_failing_trials_are_failed_and_the_sweep_stops_at_max_failed_trials():
    def train(params, step, config):
        if params["lr"] > 0.5:
            raise ZeroDivisionError("boom")
        return 1.0

    s, base, out = sweep("lr=uniform(0,1)", train, trials=20, max_failed_trials=2, parallel_trials=1, sampler="random")
    with pytest.raises(SweepError, match=r"2 trials failed \(--max-failed-trials 2\); the last: trial \d+: "
                                         r"WorkerError: rank 0 failed: ZeroDivisionError: boom") as info:
        s.run()
    frame = info.value.result.trials
    assert (frame["state"] == "FAIL").sum() == 2 and (frame["params_lr"] <= 0.5).sum() == len(frame) - 2
    assert FakeParent.made[0].status == "FAILED"
    assert "FAILED" in out.getvalue()


def test_a_trial_that_never_logs_the_metric_fails_saying_so():
    s, base, out = sweep("lr=grid(0.1)", quadratic, metric="val_loss", max_failed_trials=5)
    result = s.run()
    assert list(result.trials["state"]) == ["FAIL"]
    assert "never logged val_loss" in result.trials["user_attrs_error"][0]


def test_every_combination_of_run_options_is_checked_before_any_trial_runs():
    def make_config(options):
        return RunConfig(num_processes=1, **options)  # zero without deepspeed is refused by RunConfig

    with pytest.raises(ConfigError, match=r"--sweep: the trial's run options zero=2 make no valid run: --zero"):
        sweep("zero=choice(2,3) lr=uniform(0,1)", quadratic, make_config=make_config, trials=2)


def test_parallel_trials_auto_is_the_capacity_over_the_processes_a_trial_takes():
    s, *_ = sweep("lr=uniform(0,1)", quadratic, trials=8, capacity=("GPUs", 8))
    assert s.slots(8) == 8 and s.slots(3) == 3
    s, *_ = sweep("lr=uniform(0,1)", quadratic, trials=8, parallel_trials=2)
    assert s.slots(8) == 2


def test_parallel_trials_auto_on_a_backend_that_is_this_machine_is_bounded_by_its_cores(monkeypatch):
    """The magic's own Ray has more logical CPUs than the machine's cores (room for the next run's workers):
    CPU trials at once are as many as the cores hold."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    s, *_ = sweep("lr=uniform(0,1)", quadratic, trials=8, capacity=("CPUs of the local Ray instance", 4))
    s.base = dataclasses.replace(s.base, plan=FakePlan(s.base.config, FakeLauncher(("CPUs", 4), one_machine=True)))
    assert s.slots(8) == 2
    s.base = dataclasses.replace(s.base, plan=FakePlan(s.base.config, FakeLauncher(("CPUs", 4), one_machine=False)))
    assert s.slots(8) == 4  # a cluster's CPUs are its own


def test_local_gpu_trials_run_one_at_a_time():
    s, *_ = sweep("lr=uniform(0,1)", quadratic, trials=8)
    s.base = dataclasses.replace(s.base, plan=FakePlan(RunConfig(num_processes=1).replace(use_gpu=True),
                                                         type("Local", (Local, FakeLauncher), {})()))
    assert s.slots(8) == 1
    s.options = dataclasses.replace(s.options, parallel_trials=2)
    with pytest.raises(ConfigError, match="--parallel-trials: got 2; local GPU trials run one at a time"):
        s.slots(8)


def test_parallel_trials_run_at_once_never_more_than_the_slots():
    def slow(params, step, config):
        time.sleep(0.02)
        return params["lr"]

    s, base, out = sweep("lr=grid(1,2,3,4,5,6)", slow, steps=5, parallel_trials=2)
    s.run()
    events = sorted((t, +1 if kind == "start" else -1) for kind, _, t in base.log)
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert peak == 2


def test_trials_is_needed_unless_the_space_is_a_grid():
    s, *_ = sweep("lr=uniform(0,1)", quadratic)
    with pytest.raises(ConfigError, match="--trials: give how many trials"):
        s.run()
    s, base, out = sweep("lr=grid(1,2,3)", quadratic, trials=10)
    assert len(s.run().study.trials) == 3  # the grid sampler has no more points


def test_the_grid_sampler_refuses_a_continuous_word():
    with pytest.raises(ConfigError, match="--sampler: grid needs finite values .* lr is not"):
        sweep_study.make_sampler(SweepOptions(space="", metric="m", sampler="grid"),
                                 parse_space("lr=uniform(0,1) b=choice(1,2)"), None)
    assert isinstance(sweep_study.make_sampler(SweepOptions(space="", metric="m"), parse_space("b=choice(1,2)"), 0),
                      optuna.samplers.TPESampler)


@pytest.mark.parametrize("values, says", [
    ({"sweep": "x=grid(1)"}, "--metric: got None"),
    ({"sweep": "x=grid(1)", "metric": "m", "trials": 0}, "--trials: got 0"),
    ({"sweep": "x=grid(1)", "metric": "m", "mode": "up"}, "--mode: got 'up'; allowed: min, max"),
    ({"sweep": "x=grid(1)", "metric": "m", "pruner": "asha"}, "--pruner: got 'asha'; allowed: median, halving, none"),
    ({"sweep": "x=grid(1)", "metric": "m", "parallel_trials": 0}, "--parallel-trials: got 0"),
    ({"sweep": "x=grid(1)", "metric": "m", "sweep_name": "a b"}, "--sweep-name: got 'a b'"),
    ({"metric": "m"}, "--sweep: give the space"),
])
def test_sweep_options_are_checked_naming_the_flag(values, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        options_from(values)


def test_a_named_study_resumes_without_running_finished_trials_again(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    plan = FakePlan(RunConfig(num_processes=1), tracking_uri=uri)

    def run(trials):
        base = FakeRun(plan, quadratic, 3)
        s = Sweep(base, lambda o: base.config, parse_space("lr=grid(0.1,0.01,0.001)"),
                  SweepOptions(space="", metric="loss", trials=trials, sweep_name="again", parallel_trials=1),
                  out=io.StringIO())
        return s.run(), base

    first, base = run(2)
    assert len([e for e in base.log if e[0] == "start"]) == 2
    again, base = run(3)
    assert len([e for e in base.log if e[0] == "start"]) == 1  # only the grid point not yet run
    assert sorted(again.trials["params_lr"]) == [0.001, 0.01, 0.1]
    assert (tmp_path / "optuna.db").exists()
    assert FakeParent.made[1].status == "FINISHED"
    again, base = run(3)
    assert base.log == []


def test_interrupted_trials_are_run_again_when_the_sweep_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(storage=storage, study_name="s")
    done = study.ask({"lr": optuna.distributions.CategoricalDistribution([1, 2])})
    study.tell(done, 1.0)
    stopped = study.ask({"lr": optuna.distributions.CategoricalDistribution([1, 2])})
    stale = study.ask({"lr": optuna.distributions.CategoricalDistribution([1, 2])})
    sweep_study.mark_interrupted(study, [stopped.number])
    study.tell(stopped, state=optuna.trial.TrialState.FAIL)
    queued = sweep_study.resume(study)  # the stale RUNNING one is told FAIL as interrupted too
    assert study.trials[stale.number].state == optuna.trial.TrialState.FAIL
    assert sweep_study.counted(study) == 1
    wanted = {stopped.params["lr"], stale.params["lr"]} - {done.params["lr"]}
    assert {study.trials[n].params["lr"] for n in queued} == wanted


def test_an_interrupt_stops_every_running_trial(monkeypatch):
    started = threading.Event()

    def slow(params, step, config):
        started.set()
        time.sleep(0.05)
        return 1.0

    s, base, out = sweep("lr=grid(1,2,3,4)", slow, steps=1000, parallel_trials=2)
    real_join = threading.Thread.join
    calls = []

    def join(self, timeout=None):  # the cell's thread gets the kernel's interrupt while it waits
        if self.name.startswith("dtrain-sweep") and not calls:
            started.wait(5)
            calls.append(1)
            raise KeyboardInterrupt
        return real_join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", join)
    t0 = time.monotonic()
    with pytest.raises(RunInterrupted, match="the sweep was interrupted"):
        s.run()
    assert time.monotonic() - t0 < 3
    time.sleep(0.3)
    ends = [e for e in base.log if e[0] == "end"]
    assert len(ends) == len([e for e in base.log if e[0] == "start"]) == 2
    assert FakeParent.made[0].status == "KILLED"
    assert set(sweep_study.interrupted(s.study)) == {t.number for t in s.study.trials}


def test_each_combination_of_run_options_is_prepared_once_with_the_base_payload(monkeypatch):
    prepared = []

    def prepare(config, make_payload, namespace=None, sources=None):
        payload = make_payload()
        prepared.append((config.precision, payload))
        return FakeRun(FakePlan(config), quadratic, 2, payload=payload)

    monkeypatch.setattr(sweep_runner.runner, "prepare", prepare)
    s, base, out = sweep("precision=grid(fp32,bf16) lr=grid(0.1,0.01)", quadratic, parallel_trials=2)
    assert sorted(p for p, _ in prepared) == ["bf16", "fp32"]  # up front, before any trial
    result = s.run()
    assert len(result.study.trials) == 4 and len(prepared) == 2  # no capture, no check again per trial
    assert all(payload is base.payload for _, payload in prepared)


def test_a_trial_the_sweep_itself_cannot_run_is_failed_and_said_not_left_running(monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("an unexpected keyword")

    monkeypatch.setattr(sweep_runner, "run_trial", broken)
    s, base, out = sweep("lr=grid(0.1,0.01)", quadratic, parallel_trials=2, max_failed_trials=5)
    result = s.run()
    assert set(result.trials["state"]) == {"FAIL"}
    assert out.getvalue().count("the sweep could not run it: TypeError: an unexpected keyword") == 2


def test_a_trial_whose_memory_estimate_exceeds_the_device_is_skipped_with_the_reason_not_launched(monkeypatch):
    from dtrain_magic.strategies import memory

    made = {}

    def prepare(config, make_payload, namespace=None, sources=None):
        made[config.strategy] = FakeRun(FakePlan(config, base.plan.launcher), quadratic, 2, payload=make_payload())
        return made[config.strategy]

    # a billion parameters on 4 processes: ddp keeps 14.9 GiB of states per process, fsdp 3.7 GiB; 8 GiB each here
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None, per=1: (32 << 30) // per)
    monkeypatch.setattr(sweep_runner.runner, "prepare", prepare)
    base = FakeRun(FakePlan(RunConfig(num_processes=4), FakeLauncher()), quadratic, 2)
    base.plan.launcher.ranks_on_this_machine = True  # as on --backend local: this machine's memory is theirs
    model = memory.CellModel(10**9, "a fake billion-parameter model")
    out = io.StringIO()
    s = Sweep(base, lambda o: base.config.replace(**o), parse_space("strategy=grid(ddp,fsdp) lr=grid(0.01)"),
              SweepOptions(space="", metric="loss", max_failed_trials=1), out=out, cell_model=lambda: model)
    result = s.run()
    frame = result.trials.set_index("params_strategy")
    assert frame.loc["fsdp", "state"] == "COMPLETE" and frame.loc["ddp", "state"] == "FAIL"
    reason = frame.loc["ddp", "user_attrs_skipped"]
    assert reason.startswith("not launched: its memory estimate (ddp, fp32, 4 processes, 1,000,000,000 parameters) "
                             "is 14.9 GiB per process, more than this machine's memory over 4 process(es) (8.0 GiB)")
    assert [event for event, _, _ in made["fsdp"].log] == ["start", "end"] and made["ddp"].log == []  # not launched
    assert "SKIPPED" in out.getvalue() and s.failures == []  # no failure: --max-failed-trials 1 did not stop it
    assert sorted(r["status"].split(" (")[0] for r in s.board.rows()) == ["FINISHED", "SKIPPED"]


def test_one_trial_stopped_from_the_panel_stops_at_a_step_and_is_pruned_while_the_sweep_goes_on():
    def train(params, step, config):
        if params["lr"] == 0.1 and step == 3:
            s.stop_trial(next(iter(s._running)))  # one trial at a time: the running one is this one
        return 1.0

    s, base, out = sweep("lr=grid(0.1,0.01)", train, steps=10, parallel_trials=1, pruner="none")
    result = s.run()
    frame = result.trials.set_index("params_lr")
    assert frame.loc[0.1, "state"] == "PRUNED" and frame.loc[0.01, "state"] == "COMPLETE"
    assert frame.loc[0.1, "user_attrs_stopped_from_panel"] == True  # noqa: E712 (a pandas cell)
    assert frame.loc[0.1, "user_attrs_stopped_at_step"] == 5  # (the fake run makes one more step)
    assert "PRUNED stopped from the panel, every rank stopped after step 5" in out.getvalue()
    assert [r["status"] for r in s.board.rows() if r["params"] == "lr=0.1"] == ["PRUNED (stopped from the panel)"]
