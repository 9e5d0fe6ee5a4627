"""``--resume``: which MLflow run a cell continues in a new kernel, and from which checkpoint.

Every run is tagged with its function's identity (``dtrain_magic.function``: `payload.function_key`, the function's
name and a digest of its source, the same in every kernel) and its checkpoint root (``dtrain_magic.checkpoint_root``).
After the kernel died or was restarted, ``--resume`` (``resume=True``) looks in the run's experiment for the newest
run with this function's tag: when it did not finish (RUNNING: its kernel died with it; FAILED; KILLED) and its
checkpoint root holds a complete checkpoint, the new run writes its checkpoints there and resumes from the newest
(`ctx.load_checkpoint()` finds it, as after a restart), into the same MLflow run, reopened (`RunTracker.start` with
``reopen``): its metrics go on in one history. ``--resume RUN_ID`` names the run instead (any function).

Nothing to resume (no run of this function, its newest run FINISHED, or no complete checkpoint under its root):
``--resume`` alone runs afresh and the cell says why; ``--resume RUN_ID`` that names no run, a finished run or a run
of no dtrain_magic checkpoint root is a `ConfigError` before anything launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import RunConfig, redact_uri
from ..errors import ConfigError
from ..flagtable import RESUME_LATEST
from ..worker.resume_point import ResumePoint, resume_point
from .uri import resolve_tracking_uri

FUNCTION_TAG = "dtrain_magic.function"
ROOT_TAG = "dtrain_magic.checkpoint_root"
RESUMES_TAG = "dtrain_magic.resumes"


@dataclass(frozen=True)
class ResumeTarget:
    """The run a ``--resume`` continues: its MLflow run (reopened), status before, and where it resumes from."""

    run_id: str
    status: str
    point: ResumePoint
    resumes: int  # how many times it was resumed before this one

    @property
    def checkpoint_root(self) -> str:
        return self.point.root

    def words(self) -> str:
        """The cell's line."""
        return (f"--resume: continuing MLflow run {self.run_id} ({self.status} before) from {self.point.words()} "
                f"({self.point.directory}); its metrics go on in the same run")


def find_resume_target(config: RunConfig, function_key: str, client: Any = None) -> tuple[ResumeTarget | None, str]:
    """(the run to continue, or None for a fresh run; what to say in the cell). A ``--resume RUN_ID`` that cannot be
    continued is a `ConfigError`. ``client``: an ``MlflowClient`` (default: one on the run's tracking URI)."""
    if client is None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=resolve_tracking_uri(config))
    if config.resume != RESUME_LATEST:
        return _named_run(client, config.resume), ""
    name = function_key.split(":", 1)[0]
    run = _newest_of(client, config.experiment, function_key)
    if run is None:
        return None, (f"--resume: no earlier run of {name} (this function's text, {function_key}) in experiment "
                      f"{config.experiment!r}: a fresh run")
    if run.info.status == "FINISHED":
        return None, f"--resume: the last run of {name} ({run.info.run_id}) finished: a fresh run"
    target = _target(run)
    if target.point.directory is None:
        return None, (f"--resume: the last run of {name} ({run.info.run_id}, {run.info.status}) saved no complete "
                      f"checkpoint under {target.checkpoint_root or 'its checkpoint root'}: a fresh run")
    return target, target.words()


def _newest_of(client: Any, experiment: str, function_key: str) -> Any:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`{FUNCTION_TAG}` = '{function_key}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _named_run(client: Any, run_id: str) -> ResumeTarget:
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # MLflow's RESOURCE_DOES_NOT_EXIST (its exception classes vary by store)
        raise ConfigError("--resume", f"no MLflow run {run_id} in {redact_uri(str(client.tracking_uri))}: "
                                      f"{str(exc).splitlines()[0][:200]}") from None
    if run.info.status == "FINISHED":
        raise ConfigError("--resume", f"MLflow run {run_id} finished: nothing to resume (drop --resume for a fresh "
                                      "run)")
    target = _target(run)
    if target.point.directory is None:
        raise ConfigError("--resume", f"MLflow run {run_id} has no complete checkpoint under "
                                      f"{target.checkpoint_root or '(no dtrain_magic.checkpoint_root tag)'}: "
                                      "nothing to resume from (drop --resume for a fresh run)")
    return target


def _target(run: Any) -> ResumeTarget:
    tags = run.data.tags
    resumes = int(tags.get(RESUMES_TAG, "0") or 0)
    return ResumeTarget(run.info.run_id, run.info.status, resume_point(tags.get(ROOT_TAG)), resumes)
