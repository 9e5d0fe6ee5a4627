"""The ``%%distribute`` flags (IPython ``magic_arguments``) and their translation into a `RunConfig`.

The flags themselves are declared once, in `dtrain_magic.flagtable`; this module turns that table into the
magic's parser and help, and parsed arguments into a validated `RunConfig`.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import (
    MagicHelpFormatter,
    argument,
    argument_group,
    kwds,
    magic_arguments,
    parse_argstring,
)

from ..config import RunConfig, resolve_config
from ..errors import ConfigError
from ..flagtable import APPEND, FLAGS, Flag, panel_rows
from ..magic_line import strip_comment

USAGE_EXAMPLE = """\
Run the cell's training function on several processes, GPUs or nodes.

The whole cell runs in the notebook first; then its last top-level function (or the one named by --fn)
is shipped to every worker and called as fn(ctx) (or fn() if it takes no parameter). The cell's value
is a RunResult: .value (rank 0's return), .values (every rank's), .run_id (MLflow), .metrics.

Example::

    %%distribute --backend local --strategy ddp -n 2 --no-ui
    def train(ctx):
        model, opt = ctx.prepare(make_model(), make_opt())
        ...
"""


class _HelpFormatter(MagicHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """IPython's magic help layout, plus "(default: ...)" after every flag."""


def declared(rows: tuple[Flag, ...] = FLAGS, description: str = USAGE_EXAMPLE,
             extra: tuple[tuple[str, tuple[tuple[str, ...], dict[str, Any]]], ...] = ()
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator giving a function the IPython ``magic_arguments`` of ``rows`` (default: every row of
    `flagtable.FLAGS`), as if decorated by hand: one ``argument_group`` per run of rows of a help group, then the
    rows' ``argument`` calls; then ``extra`` arguments, as (group, (options, keywords)) pairs (a session's own)."""
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        decorators: list[Callable[[Any], Any]] = [magic_arguments(), kwds(formatter_class=_HelpFormatter,
                                                                           description=description)]
        group = None
        calls = [(row.group, call) for row in rows for call in row.argparse_calls()] + list(extra)
        for name, (options, keywords) in calls:
            if name != group:
                group = name
                decorators.append(argument_group(group))
            decorators.append(argument(*options, **keywords))
        for decorator in reversed(decorators):  # the decorator written first is applied last
            func = decorator(func)
        return func

    return decorate


@declared()
def distribute(line: str, cell: str | None = None) -> None:  # pragma: no cover - holder of the parser only
    """Placeholder whose decorators define the flags; the real magic lives in dtrain_magic.notebook.magic."""


HELP: str = distribute.__doc__ or ""


def _unquote(value: Any) -> Any:
    # IPython splits magic lines without POSIX quote removal: `--experiment 'my exp'` keeps its quotes.
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_line(line: str, holder: Callable[..., Any] = distribute, rows: tuple[Flag, ...] = FLAGS,
               help_name: str = "%%distribute?") -> argparse.Namespace:
    """Parse the magic's line (``holder``: the function `declared` gave the parser; default ``%%distribute``'s);
    argparse errors become IPython ``UsageError`` naming the flag."""
    try:
        args = parse_argstring(holder, strip_comment(line))
    except UsageError as exc:
        message = str(exc)
        if not message.startswith("unrecognized arguments"):
            raise
        raise UsageError(message + _unknown_flag_hint(message, rows, help_name)) from None
    for key, value in vars(args).items():
        setattr(args, key, _unquote(value))
    return args


def _unknown_flag_hint(message: str, rows: tuple[Flag, ...] = FLAGS, help_name: str = "%%distribute?") -> str:
    """"; did you mean --x?" for near-misses, then where every flag is listed."""
    known = [option for row in rows for option in row.all_options]
    guesses = []
    for word in message.partition(":")[2].split():
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.75)
            if close and close[0] not in guesses:
                guesses.append(close[0])
    hint = f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    return f"{hint}; see {help_name} for every flag"


def config_from_args(args: argparse.Namespace, **environment: Any) -> RunConfig:
    """Parsed flags → the validated `RunConfig`: every row of the flag table with a `RunConfig` field passes its
    parsed value on, and `config.resolve_config` resolves the defaults that depend on the environment
    (``environment``: its keyword arguments, for tests)."""
    return resolve_config({row.field: getattr(args, row.field, row.default) for row in FLAGS if row.field is not None},
                          **environment)


def config_for_panel(args: argparse.Namespace, **environment: Any) -> tuple[RunConfig, dict[str, Any]]:
    """For ``--configure``: the `RunConfig` the panel starts from, and the panel controls' values it could not take.
    A choice that is invalid here (``--precision fp16`` on a CPU machine) opens the panel with that value set, the
    problem explained and Run disabled, rather than a `ConfigError` and no panel; a bad value of a flag the panel
    does not show is still a `ConfigError`."""
    try:
        return config_from_args(args, **environment), {}
    except ConfigError:
        given = {row.field: getattr(args, row.field, row.default) for row in FLAGS if row.field is not None}
        held = {row.field: given[row.field] for row in panel_rows()
                if row.kind != APPEND and given[row.field] != row.default}
        defaults = {row.field: row.default for row in panel_rows() if row.field in held}
        return resolve_config({**given, **defaults}, **environment), held


def config_from_line(line: str, **kwargs: Any) -> RunConfig:
    """``%%distribute`` line → `RunConfig` (parse, resolve defaults, validate)."""
    return config_from_args(parse_line(line), **kwargs)
