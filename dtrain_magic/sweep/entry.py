"""The sweep's entry points, one path: ``%%distribute --sweep SPACE`` (`sweep_from_args`, from the magic's parsed
line), ``python -m dtrain_magic sweep TARGET --sweep SPACE ...`` (the same, from the command line's) and
`sweep` (``dtrain_magic.sweep(fn, space, trials=..., **options)``).

Each builds the base `RunConfig` as its run would, captures the function once (`driver.runner.prepare`: a cell runs
once in the notebook, whatever the number of trials), and hands the `runner.Sweep` a way to make each trial's
config from the same given values plus the trial's run options, resolved the same way.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable, Mapping, MutableMapping

from ..config import RunConfig, resolve_config
from ..driver import runner
from ..errors import ConfigError
from ..flagtable import FLAGS
from ..payload import Payload
from .options import KEYWORDS, SweepOptions, options_from
from .result import SweepResult
from .runner import Sweep
from .space import parse_space


def sweep(fn: Callable[..., Any], space: str, /, *args: Any, trials: int | None = None,
          fn_kwargs: Mapping[str, Any] | None = None, **options: Any) -> SweepResult | None:
    """Run ``fn`` once per trial of ``space`` (``"lr=loguniform(1e-4,1e-1) batch=choice(16,32)"``) and return the
    `SweepResult`; each trial is a run as `dtrain_magic.run` makes it, ``ctx.params`` holding its hyperparameters.

    ``options``: the sweep's (``metric=`` needed, ``mode=``, ``sampler=``, ``pruner=``, ``parallel_trials=``,
    ``sweep_name=``, ``max_failed_trials=``: the flags of docs/sweeps.md; ``sampler``/``pruner`` also take an Optuna
    sampler or pruner object), then `dtrain_magic.run`'s (``num_processes=2``, ``backend=``, ``seed=`` also seeds the
    sampler...), then keyword arguments of ``fn``. Raises `ConfigError` before anything runs, `RunInterrupted` on
    Ctrl-C (every trial stopped), `runner.SweepError` once ``max_failed_trials`` trials failed.
    """
    from ..api import check_keywords, config_from_options, data_option, payload_of, split_options

    sweep_values = {key: options.pop(key) for key in list(options) if key in KEYWORDS and key != "sweep"}
    settings = options_from({**sweep_values, "sweep": space, "trials": trials})
    config_values, call_kwargs = split_options(options)
    check_keywords(fn, call_kwargs)
    call_kwargs.update(fn_kwargs or {})
    config_values, data_objects = data_option(config_values)
    config = config_from_options(config_values)

    def make_config(trial_options: Mapping[str, Any]) -> RunConfig:
        return config_from_options({**config_values, "backend": config.backend, **trial_options})

    return _run(config, make_config, settings, lambda: payload_of(fn, args, call_kwargs), None, data_objects,
                lambda name: model_of_function(fn))


def sweep_from_args(args: Any, make_payload: Callable[[], Payload],
                    namespace: MutableMapping[str, Any] | None = None,
                    cell_model: Callable[[str], Any] | None = None, **environment: Any) -> SweepResult | None:
    """A parsed ``%%distribute --sweep`` line (or ``python -m dtrain_magic sweep``'s arguments) → the sweep's result;
    ``make_payload``: the capture (run once); ``namespace``: the notebook's (``--data`` sources, ``--result NAME``
    bound to the `SweepResult`, ``_distribute_result`` to the best trial's `RunResult`); ``cell_model(name)``: the
    cell's model counted without training (`strategies.model_of_cell`), for the trials' memory check (`fits`)."""
    given = {row.field: getattr(args, row.field, row.default) for row in FLAGS if row.field is not None}
    settings = options_from({key: getattr(args, key, None) for key in KEYWORDS})
    config = resolve_config(given, **environment)

    def make_config(trial_options: Mapping[str, Any]) -> RunConfig:
        return resolve_config({**given, "backend": config.backend, **trial_options}, **environment)

    result = _run(config, make_config, settings, make_payload, namespace, namespace, cell_model)
    if namespace is not None and result is not None:
        bind_sweep_result(namespace, config, result)
    return result


def bind_sweep_result(namespace: MutableMapping[str, Any], config: RunConfig, result: SweepResult) -> None:
    """A notebook's names for a sweep's result: ``_distribute_result`` the best trial's `RunResult`, ``--result NAME``
    the `SweepResult`."""
    best = result.best
    if best is not None and best.result is not None:
        namespace[runner.LAST_RESULT_NAME] = best.result
    if config.result:
        namespace[config.result] = result


def prepare_sweep(config: RunConfig, make_config: Callable[[Mapping[str, Any]], RunConfig], settings: SweepOptions,
                  make_payload: Callable[[], Payload], sources: Mapping[str, Any] | None,
                  model: Callable[[str], Any] | None = None, **panel: Any) -> Sweep:
    """Everything before the trials, in the one order every entry point uses: the space parsed (a bad one runs
    nothing), the run checked and the cell captured once (`runner.prepare`), every combination of the space's run
    options checked (`Sweep`). ``panel``: `Sweep`'s ``out`` and ``show_panel`` (the ``--configure`` panel's)."""
    space = parse_space(settings.space)  # before the capture: a bad space runs nothing
    if config.resume is not None:  # every trial would continue the same run
        raise ConfigError("--resume", "continues one run, not a sweep's trials; a sweep resumes by --sweep-name (its "
                                      "finished trials are not run again)")
    base = runner.prepare(config, make_payload, None, sources)
    cell_model = (lambda: model(base.payload.name)) if model is not None else None
    return Sweep(base, make_config, space, settings, sources, cell_model=cell_model, **panel)


def _run(config: RunConfig, make_config: Callable[[Mapping[str, Any]], RunConfig], settings: SweepOptions,
         make_payload: Callable[[], Payload], namespace: MutableMapping[str, Any] | None,
         sources: Mapping[str, Any] | None, model: Callable[[str], Any] | None = None) -> SweepResult | None:
    sweep_run = prepare_sweep(config, make_config, settings, make_payload, sources, model)
    space, base = sweep_run.space, sweep_run.base
    if config.dry_run:
        print(base.dry_run_text())
        trials = settings.trials or space.size or "?"
        print(f"  sweep: {settings.space} ({space.size or 'unbounded'} configurations), {trials} trial(s), --metric "
              f"{settings.metric} --mode {settings.mode}; every combination of its run options checked")
        return None
    return sweep_run.run()


def model_of_function(fn: Callable[..., Any]) -> Any:
    """The model ``fn`` prepares, counted without training as a cell's is (`strategies.model_of_cell` on its source,
    with the names it refers to); None when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):  # a builtin, or defined where no source is kept
        return None
    from ..strategies.model_of_cell import model_of_cell

    try:
        names = {**getattr(fn, "__globals__", {}), **inspect.getclosurevars(fn).nonlocals}  # what it refers to
    except TypeError:  # not a Python function
        return None
    return model_of_cell(source, names, getattr(fn, "__name__", None))
