"""A sweep's own options (the flag table's sweep rows: ``--trials``, ``--metric``, ``--mode``, ``--sampler``,
``--pruner``, ``--parallel-trials``, ``--sweep-name``, ``--max-failed-trials``), validated once, before anything runs.

They are not `RunConfig` fields: a trial is a run, the sweep is what runs them. Each error names the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError
from ..flagtable import FLAGS, SWEEP, Flag

ROWS: tuple[Flag, ...] = tuple(row for row in FLAGS if row.group == SWEEP)
# keyword option (``parallel_trials``) → the row, for `dtrain_magic.sweep` and the command line
KEYWORDS: dict[str, Flag] = {row.name.lstrip("-").replace("-", "_"): row for row in ROWS}
SAMPLERS: tuple[str, ...] = KEYWORDS["sampler"].choices or ()
PRUNERS: tuple[str, ...] = KEYWORDS["pruner"].choices or ()
MODES: tuple[str, ...] = KEYWORDS["mode"].choices or ()
_NAME = re.compile(r"^[\w.\-]{1,100}$")


@dataclass(frozen=True)
class SweepOptions:
    """What the sweep does besides the trials' runs. ``sampler``/``pruner``: a name, or (from Python) an Optuna
    sampler or pruner object, used as it is."""

    space: str
    metric: str
    trials: int | None = None  # None: the grid's size (grid sampler), else required
    mode: str = "min"
    sampler: Any = "auto"
    pruner: Any = "median"
    parallel_trials: int | str = "auto"
    sweep_name: str | None = None
    max_failed_trials: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric.strip():
            raise ConfigError("--metric", f"got {self.metric!r}; name the ctx.log metric the sweep compares, "
                                          "e.g. --metric val_loss")
        if self.trials is not None:
            _count("--trials", self.trials, 1)
        _choice("--mode", self.mode, MODES)
        if isinstance(self.sampler, str):
            _choice("--sampler", self.sampler, SAMPLERS)
        if isinstance(self.pruner, str):
            _choice("--pruner", self.pruner, PRUNERS)
        if self.parallel_trials != "auto":
            _count("--parallel-trials", self.parallel_trials, 1, also="or auto")
        _count("--max-failed-trials", self.max_failed_trials, 1)
        if self.sweep_name is not None and not _NAME.match(str(self.sweep_name)):
            raise ConfigError("--sweep-name", f"got {self.sweep_name!r}; use letters, digits, _ . - (at most 100)")

    @property
    def direction(self) -> str:
        """Optuna's study direction."""
        return "minimize" if self.mode == "min" else "maximize"


def options_from(values: Mapping[str, Any]) -> SweepOptions:
    """The sweep rows' values by keyword (``sweep``, ``trials``, ``parallel_trials``...; a value of None takes the
    row's default) → validated `SweepOptions`."""
    given = {key: (KEYWORDS[key].default if value is None else value) for key, value in values.items()}
    space = given.pop("sweep", None)
    if space is None:
        raise ConfigError("--sweep", "give the space, e.g. --sweep \"lr=loguniform(1e-4,1e-1) batch=choice(16,32)\"")
    metric = given.pop("metric", None)
    return SweepOptions(space=space, metric=metric, **given)


def _count(flag: str, value: Any, minimum: int, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(flag, f"got {value!r}; must be an integer >= {minimum}" + (f" {also}" if also else ""))


def _choice(flag: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(flag, f"got {value!r}; allowed: {', '.join(allowed)}")
