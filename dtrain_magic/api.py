"""`dtrain_magic.run`: the Python entry point, for scripts, jobs, tests and notebooks alike.

``run(train, 1e-3, backend="ray", num_processes=4, zero=2)`` runs ``train(1e-3)`` on every worker, as
``%%distribute --backend ray -n 4 --zero 2`` would run a cell ending in ``train(1e-3)``: the same flags (its
keyword options are the flag table's, `dtrain_magic.flagtable`), the same validated `RunConfig`, the same
sequence (`driver.runner.prepare`, then `PreparedRun.execute`: warm re-runs and all). Output streams to
stdout as ``[rank N]`` lines; Ctrl-C stops every worker and raises `RunInterrupted`.
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Callable, Mapping

from .config import RunConfig, resolve_config
from .driver import runner
from .driver.observer import RunObserver, TextObserver
from .errors import ConfigError
from .flagtable import FLAGS, PYTHON, Flag
from .payload import CTX, CallForm, Payload, serialize
from .result import RunResult

_ROWS: tuple[Flag, ...] = tuple(row for row in FLAGS if PYTHON in row.entry_points and row.field is not None)
# keyword option → the flag-table row it sets (field names and long option names, the off ones too: ``cpu=True``)
OPTIONS: dict[str, Flag] = {name: row for row in _ROWS for name in row.keywords + row.off_keywords}


def run(fn: Callable[..., Any], /, *args: Any, fn_kwargs: Mapping[str, Any] | None = None,
        **options: Any) -> RunResult | None:
    """Run ``fn`` on every worker and return its `RunResult` (None with ``dry_run=True``).

    ``fn`` is called as ``fn(*args, **kwargs)``, where ``kwargs`` are the keywords that are not options (and
    ``fn_kwargs``, for a keyword whose name is an option, such as ``seed``); ``dtrain_magic.CTX`` among the
    arguments stands for the worker's `TrainContext`, and a first parameter named ``ctx`` that the arguments
    leave out gets it. Without arguments, ``fn(ctx)`` or ``fn()``, as in a cell. Options are the flags as
    keywords, by any of their long names (``num_processes=4`` or ``num_workers=4``, ``backend="spark"``,
    ``zero=2``, ``gpu=False`` or ``cpu=True``, ``cluster=True``, ``stall_timeout=None``): see ``docs/flags.md``;
    their defaults resolve as the magic's do (``backend="auto"``, one process per GPU...). A keyword that is
    neither an option nor a parameter of ``fn`` (which takes no ``**kwargs``) is a `ConfigError` naming it and
    the closest option.

    Raises the same short errors as the magic: `ConfigError` before anything launches, `WorkerError` with the
    failing rank, `RunInterrupted` on Ctrl-C, `RunTimeout`.
    """
    config_values, call_kwargs = split_options(options)
    check_keywords(fn, call_kwargs)
    call_kwargs.update(fn_kwargs or {})
    config_values, data_objects = data_option(config_values)
    config = config_from_options(config_values)
    return execute_prepared(runner.prepare(config, lambda: payload_of(fn, args, call_kwargs), sources=data_objects))


def execute_prepared(prepared: runner.PreparedRun, dry_run_text: Callable[[], str] | None = None) -> RunResult | None:
    """What every entry point does once `runner.prepare` returned: a dry run prints what would run
    (``dry_run_text()``, default `PreparedRun.dry_run_text`) and returns None; any other run executes with the
    observer its config asks for (`make_observer`) and that observer's Stop."""
    if prepared.config.dry_run:
        print(dry_run_text() if dry_run_text is not None else prepared.dry_run_text())
        return None
    observer = make_observer(prepared.config)
    return prepared.execute(observer, stop=getattr(observer, "stop_event", None))


def split_options(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run``'s keywords → (`RunConfig` values by field, the keyword arguments for the function)."""
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    rest: dict[str, Any] = {}
    for name, value in keywords.items():
        row = OPTIONS.get(name)
        if row is None:
            rest[name] = value
            continue
        if row.field in given_as:
            raise ConfigError(row.name, f"given twice, as {given_as[row.field]}= and {name}=; give it once")
        given_as[row.field] = name
        values[row.field] = row.keyword_value(name, value)
    return values, rest


def check_keywords(fn: Callable[..., Any], keywords: Mapping[str, Any]) -> None:
    """A keyword that is no option must be one ``fn`` takes (a parameter of that name, or ``**kwargs``): else a
    `ConfigError` naming it and the closest option (``cpux=`` → ``cpu=``) before anything launches."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to check against (a builtin): `payload_of` binds what it can
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    takes = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [name for name in keywords if name not in takes]
    if not unknown:
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    close = difflib.get_close_matches(unknown[0], list(OPTIONS) + takes, n=1)
    hint = f"did you mean {close[0]}=? " if close else ""
    raise ConfigError(f"{unknown[0]}=", f"is neither an option of run() nor a parameter of {name}"
                                        f"{inspect.signature(fn)}; {hint}(options: docs/flags.md); "
                                        "nothing was launched")


def data_option(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``data={"train": df, "val": "/data/val"}`` → (the option values with each object named by its data name, as
    ``--data train=train`` would name a notebook variable; those objects by name). Strings and paths stay paths."""
    values = dict(values)
    given = values.get("data")
    if not isinstance(given, Mapping):
        return values, {}
    specs, objects = [], {}
    for name, value in given.items():
        if isinstance(value, (str, os.PathLike)):
            specs.append((name, os.fspath(value)))
        else:
            specs.append((name, name))
            objects[name] = value
    values["data"] = tuple(specs)
    return values, objects


def config_from_options(values: Mapping[str, Any], **environment: Any) -> RunConfig:
    """Option values by field (unknown fields are `ConfigError`s with a near match) → the validated `RunConfig`,
    the defaults that depend on the environment resolved as the magic resolves them."""
    unknown = [name for name in values if name not in {row.field for row in _ROWS}]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(OPTIONS), n=1)
        hint = f"; did you mean {close[0]}=?" if close else ""
        raise ConfigError("run()", f"unknown option {unknown[0]}={values[unknown[0]]!r}{hint} (options: docs/flags.md)")
    given = {row.field: row.default for row in FLAGS if row.field is not None}
    given.update(values)
    return resolve_config(given, **environment)


def payload_of(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any],
               argv: tuple[str, ...] | None = None, source_files: tuple[str, ...] = ()) -> Payload:
    """``fn`` and its arguments, checked against its signature (a mismatch is an error before launch) and
    pickled for the workers. Without arguments: ``fn(ctx)`` or ``fn()``, as a cell's function. ``source_files``:
    files in ``linecache`` whose lines travel with it, for the workers' tracebacks."""
    if not callable(fn):
        raise ConfigError("run()", f"the first argument must be the function to run, not a {type(fn).__name__}")
    name = getattr(fn, "__name__", type(fn).__name__)
    if not args and not kwargs:
        return serialize(fn, source_files, argv=argv)
    args = _with_ctx_first(fn, tuple(args), dict(kwargs))
    shown = ", ".join([_shown(a) for a in args] + [f"{k}={_shown(v)}" for k, v in kwargs.items()])
    call = CallForm(f"{name}({shown})", args, dict(kwargs),
                    any(a is CTX for a in args) or any(v is CTX for v in kwargs.values()))
    return serialize(fn, source_files, call=call, argv=argv)


def _with_ctx_first(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """The arguments as given; with ``CTX`` in front when they leave out a first parameter named ``ctx``."""
    name = getattr(fn, "__name__", "fn")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return args
    try:
        signature.bind(*args, **kwargs)
        return args
    except TypeError as exc:
        error = exc
        first = next(iter(signature.parameters.values()), None)
        if first is not None and first.name == "ctx" and CTX not in args and "ctx" not in kwargs:
            try:
                signature.bind(CTX, *args, **kwargs)
                return (CTX, *args)
            except TypeError as with_ctx:
                error = with_ctx  # ctx is given to it: what is missing is something else
        taken = [p for p in signature.parameters if p in OPTIONS and f"'{p}'" in str(error)]
        hint = (f" ({taken[0]}= is an option of run(), not passed to {name}: give it as "
                f"fn_kwargs={{{taken[0]!r}: ...}})" if taken else "")
        raise ConfigError("run()", f"the arguments do not fit {name}{signature}: {error}{hint}; nothing was "
                                   "launched") from None


def _shown(value: Any) -> str:
    text = "ctx" if value is CTX else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def make_observer(config: RunConfig) -> RunObserver:
    """The live panel when ``ui`` and the widget packages are available, else plain text."""
    if config.ui:
        try:
            from .ui.monitor import MonitorObserver
        except ImportError:
            return TextObserver()
        return MonitorObserver(config)
    return TextObserver()


def _signature() -> inspect.Signature:
    """``run(fn, /, *args, fn_kwargs=None, <every option>=<its default>, **kwargs)``, from the flag table."""
    params = [inspect.Parameter("fn", inspect.Parameter.POSITIONAL_ONLY),
              inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
              inspect.Parameter("fn_kwargs", inspect.Parameter.KEYWORD_ONLY, default=None)]
    params += [inspect.Parameter(row.field, inspect.Parameter.KEYWORD_ONLY, default=row.default) for row in _ROWS]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params, return_annotation="RunResult | None")


def _options_doc() -> str:
    lines = ["", "Options (the flag table; each also takes its flag's other long names):", ""]
    for row in _ROWS:
        aliases = ", ".join([f"{name}=" for name in row.keywords[1:]] + [f"{name}=True for False"
                                                                          for name in row.off_keywords])
        lines.append(f"    {row.field}={row.default!r}: {row.keyword_help or row.help}"
                     + (f" (also {aliases})" if aliases else ""))
    return "\n".join(lines)


run.__signature__ = _signature()  # type: ignore[attr-defined]
run.__doc__ = (run.__doc__ or "") + _options_doc()

__all__ = ["OPTIONS", "check_keywords", "config_from_options", "data_option", "execute_prepared", "make_observer",
           "payload_of", "run", "split_options"]
