"""The sweep's Optuna study: its sampler, pruner and storage, and what a resumed study still has to run.

Everything here is Optuna's: `optuna.samplers.GridSampler`/`RandomSampler`/`TPESampler`,
`optuna.pruners.MedianPruner`/`SuccessiveHalvingPruner`/`NopPruner`, an in-memory study, or an `RDBStorage` in
``optuna.db`` beside the MLflow store when the sweep has a name (``--sweep-name``: the same name loads the same
study). Trials are asked and told (`optuna.Study.ask`/`tell`), as the sweep runs them itself.

Resuming: a trial the study holds as COMPLETE, PRUNED or FAIL counts towards ``--trials`` and is not run again. A
trial stopped by an interrupt is told FAIL and listed in the study's user attribute ``interrupted``; one left RUNNING
by a notebook that died is too, when the sweep resumes (one notebook at a time per sweep name). Neither counts, and
their values are asked again first (`Study.enqueue_trial`), so a resumed grid still visits every point.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from .options import SweepOptions
from .space import Space

INTERRUPTED = "interrupted"  # a trial's user attribute: stopped by an interrupt, not by its own failure
STUDY_FILE = "optuna.db"


def make_sampler(options: SweepOptions, space: Space, seed: int | None) -> Any:
    """Optuna's sampler for ``--sampler`` (an Optuna sampler object given from Python is used as it is)."""
    import optuna

    name = options.sampler
    if not isinstance(name, str):
        return name
    if name == "auto":
        name = "grid" if space.all_grid else "tpe"
    if name == "grid":
        if not space.finite:
            loose = next(d.name for d in space.dimensions if d.values is None)
            raise ConfigError("--sampler", f"grid needs finite values for every word of the space (choice or grid); "
                                           f"{loose} is not: use --sampler tpe or random, or make it a grid(...)")
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(options: SweepOptions) -> Any:
    """Optuna's pruner for ``--pruner`` (an Optuna pruner object given from Python is used as it is)."""
    import optuna

    if not isinstance(options.pruner, str):
        return options.pruner
    return {"median": optuna.pruners.MedianPruner, "halving": optuna.pruners.SuccessiveHalvingPruner,
            "none": optuna.pruners.NopPruner}[options.pruner]()


def storage_url(tracking_uri: str, cwd: str | None = None) -> str:
    """Where a named study is kept: ``optuna.db`` beside an SQLite MLflow store, else in the working directory."""
    parts = urlsplit(tracking_uri)
    folder = cwd or os.getcwd()
    if parts.scheme == "sqlite" and tracking_uri.startswith("sqlite:///"):
        folder = os.path.dirname(tracking_uri[len("sqlite:///"):]) or folder
    return f"sqlite:///{os.path.join(os.path.abspath(folder), STUDY_FILE)}"


def open_study(options: SweepOptions, space: Space, tracking_uri: str, seed: int | None) -> Any:
    """The sweep's study: in memory, or loaded or created under ``--sweep-name`` in `storage_url`. A named study
    with another ``--mode`` is a `ConfigError`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints a line per trial itself
    storage = None
    if options.sweep_name:
        storage = optuna.storages.RDBStorage(storage_url(tracking_uri))
    name = options.sweep_name
    try:
        study = optuna.create_study(storage=storage, study_name=name, direction=options.direction,
                                    sampler=make_sampler(options, space, seed), pruner=make_pruner(options),
                                    load_if_exists=storage is not None)
    except ValueError as exc:  # Optuna refuses a loaded study's other direction
        raise ConfigError("--mode", f"sweep {name!r} ({storage_url(tracking_uri)}) was made with the other mode: "
                                    f"{exc}; use its mode or another --sweep-name") from None
    if storage is not None and study.direction.name.lower() != options.direction:
        raise ConfigError("--mode", f"sweep {name!r} was made to {study.direction.name.lower()}; "
                                    "use its --mode or another --sweep-name")
    return study


def counted(study: Any) -> int:
    """Trials that count towards ``--trials``: finished, and not stopped by an interrupt."""
    stopped = interrupted(study)
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.number not in stopped)


def interrupted(study: Any) -> set[int]:
    """The numbers of the study's trials stopped by an interrupt (a study user attribute: a finished trial's own
    attributes can no longer be set)."""
    return set(study.user_attrs.get(INTERRUPTED, []))


def mark_interrupted(study: Any, numbers: list[int]) -> None:
    """Record trials stopped by an interrupt (before they are told FAIL), so they neither count nor stay unrun."""
    if numbers:
        study.set_user_attr(INTERRUPTED, sorted(interrupted(study) | set(numbers)))


def resume(study: Any) -> list[int]:
    """Before a sweep runs: trials left RUNNING (a notebook that died) are told FAIL as interrupted, and the values of
    every interrupted trial not yet asked again are queued first. The interrupted trials queued again."""
    from optuna.trial import TrialState

    stale = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if stale:
        logging.getLogger(__name__).warning("trials %s were left running by an earlier session: told FAIL", stale)
        mark_interrupted(study, stale)
        for number in stale:
            study.tell(number, state=TrialState.FAIL)
    stopped = interrupted(study)
    trials = study.get_trials(deepcopy=False)
    asked = [t.params for t in trials if t.number not in stopped]
    queued = []
    for trial in trials:
        if trial.number in stopped and trial.params and trial.params not in asked:
            study.enqueue_trial(trial.params)
            asked.append(trial.params)
            queued.append(trial.number)
    return queued
