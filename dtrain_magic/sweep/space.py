"""A sweep's search space: ``"lr=loguniform(1e-4,1e-1) batch=choice(16,32,64) zero=choice(2,3)"`` → Optuna
distributions.

Each word is ``NAME=KIND(ARGS)``. The kinds: ``loguniform(lo,hi)``, ``uniform(lo,hi)``, ``int(lo,hi[,step])`` (also
``intuniform``), ``choice(a,b,...)`` and ``grid(a,b,...)`` (a choice whose every value the grid sampler visits).
A name that is a run option (a `RunConfig` field of the flag table, by any of its keyword names: ``zero``,
``strategy``, ``num_processes`` or ``num_workers``, ``precision``...) sets that option for the trial; any other
name is a hyperparameter the function reads as ``ctx.params[NAME]``. The distributions are Optuna's own, so its
samplers draw from them unchanged. Anything else is a one-line `ConfigError` naming the word and what is allowed.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..errors import ConfigError
from ..flagtable import FLAGS

FLAG = "--sweep"
KINDS = ("loguniform(lo,hi)", "uniform(lo,hi)", "int(lo,hi[,step])", "intuniform(lo,hi[,step])", "choice(a,b,...)",
         "grid(a,b,...)")
# Run options a space may not set, and why: one backend and one record per sweep (its capacity packs the trials,
# its MLflow parent holds them), and the cell's own choices.
NOT_SWEPT = {
    **dict.fromkeys(("backend", "ray_address", "spark_master", "local_mode", "keep_warm"),
                    "a sweep runs every trial on one backend (whose capacity packs them)"),
    **dict.fromkeys(("experiment", "tracking_uri", "storage", "data", "data_dir"),
                    "every trial of a sweep is recorded and reads its data in one place"),
    **dict.fromkeys(("fn", "result", "dry_run", "ui"), "it is the cell's, not a trial's"),
}
_WORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([A-Za-z_]+)\s*\(([^()]*)\)")
_WORDS = {"true": True, "false": False, "none": None}


def option_names() -> dict[str, str]:
    """Every name a space may use for a run option → its `RunConfig` field, from the flag table (``num_workers`` →
    ``num_processes``, ``gpu`` → ``use_gpu``)."""
    return {name: row.field for row in FLAGS if row.field is not None for name in row.keywords}


@dataclass(frozen=True)
class Dimension:
    """One word of the space: its name, Optuna distribution, whether it is ``grid(...)``, and the `RunConfig` field it
    sets (None: a ``ctx.params`` hyperparameter)."""

    name: str
    distribution: Any  # optuna.distributions.BaseDistribution
    grid: bool = False
    field: str | None = None

    @property
    def values(self) -> tuple[Any, ...] | None:
        """Its finite values (a choice or grid), else None."""
        return tuple(getattr(self.distribution, "choices", ())) or None


@dataclass(frozen=True)
class Space:
    """The parsed space, in the order written."""

    text: str
    dimensions: tuple[Dimension, ...]

    @property
    def distributions(self) -> dict[str, Any]:
        """Name → Optuna distribution: what ``study.ask(fixed_distributions=...)`` samples."""
        return {d.name: d.distribution for d in self.dimensions}

    @property
    def all_grid(self) -> bool:
        """Every word is ``grid(...)``: the default sampler is then Optuna's `GridSampler`."""
        return all(d.grid for d in self.dimensions)

    @property
    def finite(self) -> bool:
        """Every word has finite values (choice or grid): the grid sampler can run it."""
        return all(d.values is not None for d in self.dimensions)

    def grid(self) -> dict[str, list[Any]]:
        """Name → its values, for `optuna.samplers.GridSampler` (only when `finite`)."""
        return {d.name: list(d.values or ()) for d in self.dimensions}

    @property
    def size(self) -> int | None:
        """How many configurations the space holds when finite, else None."""
        return math.prod(len(d.values or ()) for d in self.dimensions) if self.finite else None

    def split(self, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A trial's sampled values → (its run options by `RunConfig` field, its ``ctx.params``)."""
        options = {d.field: values[d.name] for d in self.dimensions if d.field is not None}
        params = {d.name: values[d.name] for d in self.dimensions if d.field is None}
        return options, params

    def option_combinations(self) -> Iterator[dict[str, Any]] | None:
        """Every combination of the run options the space sets (by field), when each has finite values; None when
        one does not (a ``uniform`` timeout): then each trial's options are checked when it is drawn."""
        options = [d for d in self.dimensions if d.field is not None]
        if any(d.values is None for d in options):
            return None
        return (dict(zip([d.field for d in options], combo, strict=True)) for combo in
                itertools.product(*[d.values or () for d in options]))


def parse_space(text: str) -> Space:
    """Parse a space string; a `ConfigError` on ``--sweep`` naming the bad word and what is allowed."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(FLAG, f"got {text!r}; give the space as NAME=KIND(ARGS) words, e.g. "
                                "\"lr=loguniform(1e-4,1e-1) batch=choice(16,32)\" (kinds: " + ", ".join(KINDS) + ")")
    fields = option_names()
    dimensions: list[Dimension] = []
    at = 0
    while text[at:].strip():
        match = _WORD.match(text, at)
        if match is None:
            bad = text[at:].split()[0]
            raise ConfigError(FLAG, f"cannot read {bad!r}: each word is NAME=KIND(ARGS), e.g. "
                                    "lr=loguniform(1e-4,1e-1); kinds: " + ", ".join(KINDS))
        name, kind, args = match.groups()
        if any(d.name == name for d in dimensions):
            raise ConfigError(FLAG, f"{name} is given twice; give each name once")
        dimensions.append(_dimension(match.group(0).strip(), name, kind, args, fields))
        at = match.end()
    _no_field_twice(dimensions)
    return Space(text, tuple(dimensions))


def _dimension(word: str, name: str, kind: str, args: str, fields: Mapping[str, str]) -> Dimension:
    field = fields.get(name)
    if field in NOT_SWEPT:
        raise ConfigError(FLAG, f"{word!r}: {name} cannot vary between trials: {NOT_SWEPT[field]}; set it on the line")
    values = [_value(part, word) for part in args.split(",")] if args.strip() else []
    return Dimension(name, _distribution(word, kind.lower(), values), grid=kind.lower() == "grid", field=field)


def _distribution(word: str, kind: str, values: list[Any]) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if kind in ("choice", "grid"):
        if not values:
            raise ConfigError(FLAG, f"{word!r}: {kind} needs at least one value, e.g. {kind}(16,32)")
        if len(set(map(repr, values))) != len(values):
            raise ConfigError(FLAG, f"{word!r}: a value is given twice; give each value once")
        return CategoricalDistribution(values)
    if kind in ("loguniform", "uniform"):
        low, high = _bounds(word, values, float, 2)
        if kind == "loguniform" and low <= 0:
            raise ConfigError(FLAG, f"{word!r}: loguniform needs lo > 0 (got {low:g}); use uniform for 0 or below")
        return FloatDistribution(low, high, log=kind == "loguniform")
    if kind in ("int", "intuniform"):
        low, high, *step = _bounds(word, values, int, 3)
        if step and step[0] < 1:
            raise ConfigError(FLAG, f"{word!r}: the step must be an integer >= 1")
        return IntDistribution(low, high, step=step[0] if step else 1)
    raise ConfigError(FLAG, f"{word!r}: unknown kind {kind!r}; kinds: " + ", ".join(KINDS))


def _bounds(word: str, values: list[Any], number: type, most: int) -> list[Any]:
    """(lo, hi[, step]) as numbers of ``number``'s type, lo < hi."""
    ok = 2 <= len(values) <= most and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if ok and number is int:
        ok = all(float(v).is_integer() for v in values)
    if not ok:
        shape = "(lo,hi)" if most == 2 else "(lo,hi[,step]) of integers"
        raise ConfigError(FLAG, f"{word!r}: needs {shape}, e.g. {word.split('=')[0]}="
                                f"{word.split('=')[1].split('(')[0]}{'(1e-4,1e-1)' if most == 2 else '(1,8)'}")
    bounds = [number(v) for v in values]
    if not bounds[0] < bounds[1]:
        raise ConfigError(FLAG, f"{word!r}: needs lo < hi (got {bounds[0]} and {bounds[1]})")
    return bounds


def _value(part: str, word: str) -> Any:
    """One argument: a number, true/false/none, a quoted or bare word (``ddp``)."""
    text = part.strip()
    if not text:
        raise ConfigError(FLAG, f"{word!r}: an empty value between commas")
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: ddp, bf16
    if not isinstance(value, (int, float, str)):
        raise ConfigError(FLAG, f"{word!r}: {text!r} is not a number or a word")
    return value


def _no_field_twice(dimensions: list[Dimension]) -> None:
    """``num_processes`` and ``num_workers`` are one option: given both is an error."""
    seen: dict[str, str] = {}
    for d in dimensions:
        if d.field is not None and d.field in seen:
            raise ConfigError(FLAG, f"{seen[d.field]} and {d.name} set the same run option; give one")
        if d.field is not None:
            seen[d.field] = d.name
