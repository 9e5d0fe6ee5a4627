"""One trial: a run of the prepared payload with the trial's ``ctx.params`` and run options, its ``--metric`` fed to
Optuna's pruner as rank 0 logs it, and when the pruner says so stopped with every rank after the same step (its
`driver.step_stop.StepStop`; Stop's way, every worker at once, when they cannot all stop there).

`run_trial` runs it on the calling thread (which pumps the run) and returns an `Outcome`; it never raises for the
trial's own failure (that is the trial's FAILED), only for nothing.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from ..config import RunConfig
from ..driver.observer import RunObserver, prefix_lines
from ..driver.step_stop import StepStop
from ..errors import DistributeError, RunInterrupted, RunStopped, summary

FINISHED, PRUNED, FAILED, INTERRUPTED = "FINISHED", "PRUNED", "FAILED", "INTERRUPTED"
SKIPPED = "SKIPPED"  # not launched: its memory estimate exceeds the device's (`fits`); told FAIL, not a failure


@dataclass
class Outcome:
    """How a trial ended. ``state``: FINISHED, PRUNED, FAILED, SKIPPED (not launched: ``error`` says why), or
    INTERRUPTED (the sweep was stopped)."""

    state: str
    value: float | None = None
    run_id: str | None = None
    result: Any = None  # the `RunResult` of a FINISHED trial
    error: str | None = None  # a FAILED trial's one line
    pruned_at: int | None = None  # the --metric step at which Optuna's pruner said prune
    stopped_at: int | None = None  # the ctx.step count every rank stopped after (None: stopped as Stop stops)
    steps: int = 0
    seconds: float = 0.0


class TrialObserver(RunObserver):
    """A trial's run as it happens: its workers' output prefixed with the trial, rank 0's ``--metric`` reported to the
    Optuna trial at each logged step, and the run's ``stop`` asked to stop every rank at one step once Optuna's
    pruner prunes it (`StepStop.at_a_step`)."""

    def __init__(self, trial: Any, metric: str, label: str, stop: StepStop, out: TextIO | None = None,
                 on_value: Callable[[int, float], None] | None = None):
        self.trial, self.metric_name, self.label, self.stop = trial, metric, label, stop
        self._out, self._on_value = out, on_value
        self.run_id: str | None = None
        self.pruned_at: int | None = None
        self.steps = 0
        self.last: float | None = None
        self._reported = -1
        self._pending: dict[tuple[int, str], str] = {}

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    def started(self, config: RunConfig, run_id: str, link: str, plan: str) -> None:
        self.run_id = run_id

    def output(self, rank: int, stream: str, text: str) -> None:
        lines, self._pending[(rank, stream)] = prefix_lines(rank, text, self._pending.get((rank, stream), ""))
        if lines:
            self.out.write("".join(f"[{self.label}] {line}\n" for line in lines.splitlines()))

    def note(self, text: str) -> None:
        print(f"[{self.label}] dtrain_magic: {text}", file=self.out)

    def stacks(self, title: str, text: str) -> None:
        print(f"[{self.label}] dtrain_magic: {title}\n{text}", file=self.out)

    def metric(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        self.steps = max(self.steps, step + 1)
        if self.metric_name not in metrics:
            return
        self.last = float(metrics[self.metric_name])
        if self._on_value is not None:
            self._on_value(step, self.last)  # the sweep's panel: this trial's curve
        if self.pruned_at is not None or step <= self._reported:
            return  # Optuna keeps one value per step
        self._reported = step
        self.trial.report(self.last, step)
        if self.trial.should_prune():
            self.pruned_at = step
            # Every rank stops after one step the pump picks; the run ends after its MLflow run opened (`started`).
            self.stop.at_a_step(f"pruned by Optuna at {self.metric_name} step {step}")


def run_trial(prepared: Any, trial: Any, params: dict[str, Any], parent_run_id: str | None, metric: str,
              label: str, stop: StepStop, out: TextIO | None = None,
              on_value: Callable[[int, float], None] | None = None) -> Outcome:
    """Run one trial (`PreparedRun.execute` with its params and parent run) and say how it ended; ``on_value(step,
    value)``: each ``--metric`` value as it arrives."""
    observer = TrialObserver(trial, metric, label, stop, out, on_value)
    started = time.monotonic()
    # log_mark=None: the trial's slice of the backend log starts with the trial, not with the sweep's prepare.
    # reuse_workers: on Spark and Ray the next trial runs on this one's workers (no launch: docs/sweeps.md).
    trial_run = dataclasses.replace(prepared, params=params, parent_run_id=parent_run_id, log_mark=None,
                                    reuse_workers=True)
    outcome = _execute(trial_run, observer, stop)
    outcome.run_id = outcome.run_id or observer.run_id
    outcome.steps, outcome.seconds = observer.steps, time.monotonic() - started
    return outcome


def _execute(prepared: Any, observer: TrialObserver, stop: StepStop) -> Outcome:
    try:
        result = prepared.execute(observer, stop)
    except RunStopped as stopped:  # every rank stopped after one step: pruned
        return Outcome(PRUNED, value=observer.last, pruned_at=observer.pruned_at, stopped_at=stopped.step)
    except RunInterrupted:
        if observer.pruned_at is not None:
            return Outcome(PRUNED, value=observer.last, pruned_at=observer.pruned_at)
        return Outcome(INTERRUPTED)
    except DistributeError as exc:
        return Outcome(FAILED, error=summary(exc, limit=300))
    except Exception as exc:  # noqa: BLE001 - the trial's, not the sweep's: it fails, the sweep goes on
        return Outcome(FAILED, error=summary(exc, limit=300))
    metric = observer.metric_name
    value = result.metrics.get(metric, observer.last)
    if value is None and isinstance(result.value, (int, float)) and not isinstance(result.value, bool):
        value = float(result.value)  # no --metric logged: rank 0's returned number
    if value is None:
        return Outcome(FAILED, run_id=result.run_id, result=result,
                       error=f"rank 0 never logged {metric} (ctx.log({metric}=...)) and returned no number")
    if not math.isfinite(value):
        return Outcome(FAILED, value=value, run_id=result.run_id, result=result,
                       error=f"{metric} ended as {value}")
    return Outcome(FINISHED, value=float(value), run_id=result.run_id, result=result)
