"""The command line: ``python -m dtrain_magic run TARGET [FLAGS] [-- ARGS]`` (also ``dtrain-magic run ...``), and
``python -m dtrain_magic sweep TARGET --sweep SPACE --metric NAME [FLAGS]`` (a run per trial: docs/sweeps.md).

For scripts and scheduled jobs, in the style of ``torchrun`` and ``ray job submit``::

    python -m dtrain_magic run my_pkg.train:main -n 4 --backend ray --zero 2 -- --lr 1e-3
    python -m dtrain_magic run train.py:fit --backend spark
    python -m dtrain_magic run train.py -n 2 -- --epochs 3      # the whole script, as __main__, on every rank

TARGET is ``module:function`` (imported with the working directory on ``sys.path``, as ``python -m`` does),
``path/to/file.py:function``, or ``path/to/file.py`` (the script runs as ``__main__`` on every worker, the way
torchrun runs it). The function is called as ``fn(ctx)`` or ``fn()``; ``ARGS`` after ``--`` are the workers'
``sys.argv[1:]``. The flags are the flag table's (`dtrain_magic.flagtable`; ``--help`` lists them). The exit
status: 0 when the run finished, 1 when it failed (a worker's error, a launch failure, ``--timeout``), 2 for bad
input (nothing was launched), 130 when interrupted (Ctrl-C stops every worker first).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import linecache
import os
import shlex
import sys
from typing import Any, Callable

from .config import RunConfig, resolve_config
from .errors import CaptureError, ConfigError, DistributeError, RunInterrupted
from .flagtable import CLI, FLAGS, SWEEP

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The flags' defaults after their help; the description as written."""


def parser() -> argparse.ArgumentParser:
    """``python -m dtrain_magic``'s parser, its ``run`` flags generated from the flag table."""
    top = argparse.ArgumentParser(prog="python -m dtrain_magic", description="Distributed PyTorch training: run a "
                                  "function or script on many processes, GPUs or nodes (local, Spark, Ray).")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run a function or script on every worker",
                              description=__doc__.split("\n\n", 1)[1], formatter_class=_HelpFormatter)
    run.add_argument("target", metavar="TARGET", help="module:function, file.py:function, or file.py (a script)")
    _add_flags(run, [row for row in FLAGS if CLI in row.entry_points])
    sweep = commands.add_parser("sweep", help="run it once per trial of a search space (docs/sweeps.md)",
                                description="Run TARGET once per trial of --sweep SPACE: each trial a run as `run` "
                                "makes it, its hyperparameters in ctx.params (docs/sweeps.md).",
                                formatter_class=_HelpFormatter)
    sweep.add_argument("target", metavar="TARGET", help="module:function, file.py:function, or file.py (a script)")
    _add_flags(sweep, [row for row in FLAGS if CLI in row.entry_points or row.group == SWEEP])
    return top


def _add_flags(command: argparse.ArgumentParser, rows: list[Any]) -> None:
    """A command's flags, generated from the flag table's rows, in their help groups."""
    groups: dict[str, Any] = {}
    for row in rows:
        group = groups.get(row.group) or groups.setdefault(row.group, command.add_argument_group(row.group))
        for options, keywords in row.argparse_calls():
            group.add_argument(*options, **keywords)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    argv, script_args = _split_at_dashes(argv)
    args = parser().parse_args(argv)  # argparse exits with 2 on bad flags, naming them
    try:
        if args.command == "sweep":
            return _sweep(args, tuple(script_args))
        config = _config(args)
        return _run(config, args.target, tuple(script_args))
    except RunInterrupted as exc:
        _say(exc)
        return EXIT_INTERRUPTED
    except (ConfigError, CaptureError) as exc:
        _say(exc)
        return EXIT_USAGE
    except DistributeError as exc:
        _say(exc)
        return EXIT_FAILED
    except KeyboardInterrupt:  # before the run started: nothing was launched
        print("dtrain_magic: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def _config(args: argparse.Namespace) -> RunConfig:
    values = {row.field: getattr(args, row.field) for row in FLAGS if row.field is not None and CLI in row.entry_points}
    values["ui"] = False
    return resolve_config(values)


def _run(config: RunConfig, target: str, script_args: tuple[str, ...]) -> int:
    from .api import execute_prepared, payload_of
    from .driver import runner
    from .payload import ScriptMain

    def make_payload() -> Any:
        fn, argv0 = load_target(target)
        files = (fn.filename,) if isinstance(fn, ScriptMain) else ()
        return payload_of(fn, (), {}, argv=(argv0, *script_args), source_files=files)

    prepared = runner.prepare(config, make_payload)
    result = execute_prepared(prepared, lambda: prepared.dry_run_text(
        equivalent=command_line(config, target, script_args)))  # ui is off here: plain text
    if result is not None and result.value is not None:
        print(f"dtrain_magic: rank 0 returned {result.value!r}")
    return EXIT_OK


def _sweep(args: argparse.Namespace, script_args: tuple[str, ...]) -> int:
    from .api import payload_of
    from .payload import ScriptMain
    from .sweep.entry import sweep_from_args

    def make_payload() -> Any:
        fn, argv0 = load_target(args.target)
        files = (fn.filename,) if isinstance(fn, ScriptMain) else ()
        return payload_of(fn, (), {}, argv=(argv0, *script_args), source_files=files)

    sweep_from_args(args, make_payload)  # prints a line per trial and the best
    return EXIT_OK


def command_line(config: RunConfig, target: str, script_args: tuple[str, ...] = ()) -> str:
    """The ``python -m dtrain_magic run ...`` command that runs ``config`` (the flags this command line takes, in
    the flag table's order, quoted for a POSIX shell): what its ``--dry-run`` shows as the equivalent."""
    def quote(_flag: str, value: Any, _always: bool) -> str:
        return shlex.quote(str(value))

    words = [word for row in FLAGS if row.field is not None and CLI in row.entry_points and row.field != "dry_run"
             for word in row.line_words(getattr(config, row.field), quote)]
    tail = ["--", *map(shlex.quote, script_args)] if script_args else []
    return " ".join(["python -m dtrain_magic run", shlex.quote(target), *words, *tail])


def load_target(target: str) -> tuple[Callable[..., Any], str]:
    """TARGET → (the callable to run on every worker, the workers' ``sys.argv[0]``); `CaptureError` when it
    cannot be found."""
    where, sep, name = target.rpartition(":") if ":" in target else (target, "", "")
    if where.endswith(".py") or (not sep and target.endswith(".py")):
        path = where if sep else target
        if not os.path.isfile(path):
            raise CaptureError(f"TARGET {target}: no file {path!r} (from {os.getcwd()})")
        if not sep:
            return _script(path), path
        module = _module_from_file(path)
    else:
        if not sep or not name:
            raise CaptureError(f"TARGET {target}: give module:function (e.g. my_pkg.train:main), "
                               "file.py:function, or file.py")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: the project's modules import from here
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise CaptureError(f"TARGET {target}: cannot import {where} ({exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise CaptureError(f"TARGET {target}: {where} has no function {name!r}; it has {', '.join(known) or 'none'}")
    return fn, where


def _module_from_file(path: str) -> Any:
    """Import ``path`` as a module named after the file (registered in ``sys.modules``, so its functions pickle
    by value with their module), its folder first on ``sys.path`` as for a script."""
    name = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaptureError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        from .errors import summary

        raise CaptureError(f"importing {path} failed, before anything was launched: {summary(exc)}") from None
    return module


def _script(path: str) -> Any:
    from .payload import ScriptMain

    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    filename = os.path.abspath(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # travels for tracebacks
    return ScriptMain(source, filename)


def _say(error: DistributeError) -> None:
    print("\n".join(error._render_traceback_()), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
