"""Where a restarted or resumed run picks up: the newest complete checkpoint of a run's checkpoint root, and its step.

A restart (``--max-restarts``) and a resume in a new kernel (``--resume``) both say in the cell where the function
will resume (``restarting from step 40``). The step is what the function passed as ``ctx.save_checkpoint(step=...)``:
rank 0 notes it beside the checkpoint (`note_step`, a few bytes of JSON), so the notebook reads it without loading a
checkpoint (which may be a big model's shards). The newest complete checkpoint is the checkpoint store's own
`CheckpointStore.latest` (`dtrain_magic.worker.checkpoints`), which the workers' ``ctx.load_checkpoint()`` resumes from.
Standard library only on the notebook's side (no torch).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .checkpoints import CheckpointStore

STEP_FILE = "dtrain_step.json"


def note_step(directory: str, client_state: Mapping[str, Any], is_main: bool) -> None:
    """Rank 0 (``is_main``): write the checkpoint's ``step`` (``client_state["step"]``, when an integer) beside it."""
    step = client_state.get("step")
    if not is_main or isinstance(step, bool) or not isinstance(step, int):
        return
    try:
        with open(os.path.join(directory, STEP_FILE), "w") as handle:
            json.dump({"step": step}, handle)
    except OSError as exc:  # only the restart line's step is lost: the checkpoint itself is whole
        logging.getLogger(__name__).debug("could not note the checkpoint's step in %s: %s", directory, exc)


def checkpoint_step(directory: str) -> int | None:
    """The step `note_step` wrote beside ``directory``'s checkpoint; None when none was noted."""
    try:
        with open(os.path.join(directory, STEP_FILE)) as handle:
            step = json.load(handle).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint under a run's checkpoint root (``directory`` None: there is none yet)."""

    root: str
    directory: str | None
    step: int | None

    def words(self) -> str:
        """Where the function resumes, for the cell: ``step 40``, ``checkpoint_000003``, or ``the start``."""
        if self.directory is None:
            return "the start (no complete checkpoint yet)"
        if self.step is not None:
            return f"step {self.step}"
        return os.path.basename(self.directory.rstrip("/"))


def resume_point(root: str | None) -> ResumePoint:
    """The newest complete checkpoint under ``root`` and its noted step: the checkpoint store's own
    (`CheckpointStore.latest`), or on Ray the one Ray Train restores in a new ``fit()`` of the same run
    (`ray_train_latest`: the root is Ray Train's run directory)."""
    directory = None
    if root and "://" not in root:
        directory = CheckpointStore(root).latest() or ray_train_latest(root)
    return ResumePoint(root or "", directory, checkpoint_step(directory) if directory else None)


RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's checkpoint manager's state in its run directory


def ray_train_latest(run_dir: str) -> str | None:
    """The latest checkpoint Ray Train's snapshot in ``run_dir`` lists (it lists committed ones only): the checkpoint
    a new ``TorchTrainer.fit()`` with this run's name and storage restores; None without one."""
    try:
        with open(os.path.join(run_dir, RAY_TRAIN_SNAPSHOT)) as handle:
            latest = (json.load(handle).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    except (OSError, ValueError, AttributeError):
        return None
    directory = os.path.join(run_dir, latest) if isinstance(latest, str) and latest else None
    return directory if directory and os.path.isdir(directory) else None
