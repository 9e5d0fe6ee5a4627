"""A session's settings: the flags of ``%%distribute`` (one flag table, `dtrain_magic.flagtable`) that apply to
ranks kept from cell to cell, and the session's own idle timeout.

Not for sessions: ``--fn`` and ``--result`` (no function is shipped: cells are), ``--max-restarts`` (a restarted
rank would have lost its state: ``%distribute_session restart`` starts every rank afresh, saying so) and
``--keep-warm`` (nothing waits after a session). ``--timeout S`` limits each cell (and is the process group's
timeout, as in a run); ``--seed`` seeds every rank once, when the session starts.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Mapping

from ..config import RunConfig, resolve_config
from ..errors import ConfigError
from ..flagtable import FLAGS, PYTHON, SWEEP, Flag

NOT_FOR_SESSIONS = ("fn", "result", "keep_warm", "max_restarts", "resume", "outputs", "elastic", "preempt_grace")
WHY_NOT = {
    "max_restarts": "a session's ranks keep their state in their processes, which a restart would lose; "
                    "%distribute_session restart starts every rank afresh when you want that",
    "keep_warm": "nothing waits after a session: its ranks are held until it stops or is idle for --idle-timeout",
    "fn": "a session runs cells (%%ranks), not a function",
    "resume": "a session's state is its ranks' memory, not a checkpoint: there is no run to resume",
    "elastic": "a session's state is its ranks' memory: ranks relaunched on fewer workers would have lost it",
    "preempt_grace": "a session's state is its ranks' memory, not a checkpoint: a preemption notice cannot keep it",
    "result": "a session runs cells (%%ranks), not a function; a cell's value comes back by rank",
    "outputs": "each cell's ctx.write outputs are committed at the cell's end: bind one with %%ranks --output "
               "NAME=VARIABLE",
}
# The flag table's rows a session takes (``--configure`` included: it shows the panel, whose Start session starts it).
# A sweep starts many runs; a session is one (its own rows leave the Sweeps group out: the parser refuses them).
ROWS: tuple[Flag, ...] = tuple(row for row in FLAGS if row.field not in NOT_FOR_SESSIONS and row.group != SWEEP)

DEFAULT_IDLE_TIMEOUT_S = 1800.0
IDLE_ENV = "DTRAIN_MAGIC_SESSION_IDLE"


def idle_timeout_s(value: Any = None, environ: Mapping[str, str] | None = None) -> float:
    """``--idle-timeout`` (seconds a session may stay idle before its ranks are released; 0: until it is stopped):
    the value given, else ``$DTRAIN_MAGIC_SESSION_IDLE``, else 30 min. Anything but a number >= 0 is a
    `ConfigError` naming where it came from."""
    flag = "--idle-timeout"
    if value is None:
        text = (os.environ if environ is None else environ).get(IDLE_ENV, "").strip()
        if not text:
            return DEFAULT_IDLE_TIMEOUT_S
        value, flag = text, f"${IDLE_ENV}"
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(flag, f"got {value!r}; must be a number of seconds >= 0 (0: never released while idle)")
    return seconds


def check_session_config(config: RunConfig) -> None:
    """What a run may have but a session may not: a `ConfigError` naming the flag and why; nothing was started."""
    for name in ("max_restarts", "keep_warm", "elastic"):
        if getattr(config, name) not in (None, 0):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(flag, f"does not apply to a session: {WHY_NOT[name]}; nothing was started")
    if config.on_stall == "fail":
        raise ConfigError("--on-stall", "fail does not apply to a session: a cell's stall is reported (where each "
                                        "rank waits) and the cell goes on; --timeout S limits each cell, the kernel's "
                                        "interrupt stops it; nothing was started")


def refuse_run_only_flags(line: str) -> None:
    """A ``%distribute_session start`` line with a flag of runs only (``--max-restarts``, ``--keep-warm``, ``--fn``,
    ``--result``): a `ConfigError` naming it and why, rather than argparse's "unrecognized arguments"."""
    words = [word.split("=", 1)[0] for word in line.split() if word.startswith("-")]
    for row in FLAGS:
        if row.field in NOT_FOR_SESSIONS:
            used = next((word for word in words if word in row.all_options), None)
            if used is not None:
                raise ConfigError(used, f"does not apply to a session: {WHY_NOT[row.field]}; nothing was started")


def config_from_options(options: Mapping[str, Any], **environment: Any) -> tuple[RunConfig, float]:
    """`dtrain_magic.Session`'s keyword options (the flags as keywords, as `dtrain_magic.run` takes them, plus
    ``idle_timeout``) → the validated `RunConfig` and the idle timeout."""
    options = dict(options)
    idle = idle_timeout_s(options.pop("idle_timeout", None))
    by_name = {name: row for row in ROWS if row.field is not None and PYTHON in row.entry_points
               for name in row.keywords + row.off_keywords}
    values: dict[str, Any] = {row.field: row.default for row in FLAGS if row.field is not None}
    given: dict[str, str] = {}
    for name, value in options.items():
        row = by_name.get(name)
        if row is None:
            field = next((f for f in NOT_FOR_SESSIONS if name == f or name in _keywords(f)), None)
            if field in WHY_NOT:
                raise ConfigError(f"{name}=", f"does not apply to a session: {WHY_NOT[field]}")
            close = difflib.get_close_matches(name, list(by_name) + ["idle_timeout"], n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            raise ConfigError("Session()", f"unknown option {name}={value!r}{hint} (options: docs/flags.md, "
                                           "docs/sessions.md)")
        if row.field in given:
            raise ConfigError(row.name, f"given twice, as {given[row.field]}= and {name}=; give it once")
        given[row.field] = name
        values[row.field] = row.keyword_value(name, value)
    config = resolve_config(values, **environment)
    check_session_config(config)
    return config, idle


def _keywords(field: str) -> tuple[str, ...]:
    return next((row.keywords for row in FLAGS if row.field == field), ())


def start_line(config: RunConfig, idle_s: float) -> str:
    """The ``%distribute_session start ...`` line that starts a session like this one (`RunConfig.flag_line`'s
    flags; ``--idle-timeout`` when it is not the default)."""
    line = "%distribute_session start " + config.flag_line().split(" ", 1)[1]
    if idle_s != DEFAULT_IDLE_TIMEOUT_S:
        line += f" --idle-timeout {idle_s:g}"
    return line
