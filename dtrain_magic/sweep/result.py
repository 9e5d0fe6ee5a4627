"""What a sweep returns: `SweepResult` (the best trial, every trial as a DataFrame, the Optuna study)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..result import RunResult

RUN_ID_ATTR = "mlflow_run_id"  # a trial's user attribute: its MLflow child run


@dataclass(frozen=True)
class BestTrial:
    """The best trial: its Optuna number (from 0: the line "trial 3/12" is number 2), its hyperparameters
    (``ctx.params`` and run options, by the space's names), its ``--metric`` value, its MLflow run and (when it ran in
    this session) its `RunResult`."""

    number: int
    params: dict[str, Any]
    value: float | None
    run_id: str | None
    result: RunResult | None = None


@dataclass(frozen=True)
class SweepResult:
    """A sweep's outcome. ``best``: the best COMPLETE trial (None when none completed); ``study``: the Optuna study;
    ``parent_run_id``: the sweep's MLflow parent run; ``results``: the `RunResult` of each trial run in this session
    that finished, by Optuna number."""

    study: Any
    parent_run_id: str | None
    metric: str
    results: dict[int, RunResult] = field(default_factory=dict)

    @property
    def best(self) -> BestTrial | None:
        from optuna.trial import TrialState

        if not self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            return None
        trial = self.study.best_trial
        return BestTrial(trial.number, dict(trial.params), trial.value, trial.user_attrs.get(RUN_ID_ATTR),
                         self.results.get(trial.number))

    @property
    def trials(self) -> Any:
        """Every trial as a pandas DataFrame (Optuna's `trials_dataframe`: number, value, state, params_*,
        duration, and user_attrs_mlflow_run_id, user_attrs_pruned_at_step, user_attrs_error)."""
        return self.study.trials_dataframe(attrs=("number", "value", "state", "params", "user_attrs", "duration",
                                                  "datetime_start", "datetime_complete"))

    def __repr__(self) -> str:
        best = self.best
        counts: dict[str, int] = {}
        for trial in self.study.get_trials(deepcopy=False):
            counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        shown = (f"best=trial {best.number + 1} {self.metric}={best.value:.4g} "
                 + " ".join(f"{k}={v!r}" for k, v in best.params.items()) if best and best.value is not None
                 else "best=None")
        return f"SweepResult({states}; {shown}; MLflow parent run {self.parent_run_id})"
