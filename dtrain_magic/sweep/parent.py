"""The sweep's MLflow parent run: one per sweep (a resumed sweep reopens its own), every trial's run its child
(``mlflow.parentRunId``, set by the runner from `PreparedRun.parent_run_id`), the best trial tagged on it at the end.

Its own `MlflowClient` run: no fluent active run, so nothing in the notebook's own MLflow use is touched.
"""

from __future__ import annotations

from typing import Any, Mapping

PARENT_ATTR = "mlflow_parent_run_id"  # the study's user attribute naming its parent run (a resumed sweep reopens it)


class ParentRun:
    """Open (create, or reopen a resumed sweep's) and end the parent run; tag a trial's child run."""

    def __init__(self, tracking_uri: str, experiment: str, name: str, params: Mapping[str, Any],
                 study: Any = None):
        from ..tracking import wait_for_preload
        from ..tracking.system_metrics import quiet_mlflow

        wait_for_preload()  # MLflow imported in the background meanwhile (`plan.check`): two imports could deadlock
        quiet_mlflow()  # a new store's set-up lines are not the cell's
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        known = study.user_attrs.get(PARENT_ATTR) if study is not None else None
        self.run_id = self._reopen(known) if known else None
        if self.run_id is None:
            self.run_id = self._create(experiment, name, params)
            if study is not None:
                study.set_user_attr(PARENT_ATTR, self.run_id)

    def _reopen(self, run_id: str) -> str | None:
        try:
            self.client.get_run(run_id)
        except Exception:  # deleted, or another store: a new parent
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _create(self, experiment: str, name: str, params: Mapping[str, Any]) -> str:
        from mlflow.entities import Param

        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        run = self.client.create_run(experiment_id, run_name=name, tags={"dtrain_magic.sweep": name})
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        return run.info.run_id

    def tag_trial(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Tags on a trial's child run (its number, the step it was pruned at)."""
        for key, value in tags.items():
            self.client.set_tag(run_id, key, str(value))

    def end(self, status: str, best: Any = None, metric: str | None = None) -> None:
        """End it (FINISHED, FAILED or KILLED), tagged with the best trial (`result.BestTrial`) when there is one."""
        if best is not None:
            for key, value in {"dtrain_magic.best_trial": best.number, "dtrain_magic.best_run_id": best.run_id,
                               "dtrain_magic.best_value": best.value,
                               "dtrain_magic.best_params": " ".join(f"{k}={v}" for k, v in best.params.items())
                               }.items():
                if value is not None:
                    self.client.set_tag(self.run_id, key, str(value))
            if metric is not None and best.value is not None:
                self.client.log_metric(self.run_id, f"best_{metric}", float(best.value))
        self.client.set_terminated(self.run_id, status=status)
