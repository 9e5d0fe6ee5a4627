"""The session magics: ``%distribute_session start|stop|restart|status``, ``%%ranks``, ``%distribute_pull``,
``%distribute_push`` (`dtrain_magic.session`; docs/sessions.md).

``%distribute_session start`` takes the flags of ``%%distribute`` that apply to a session (its parser is made from
the one flag table, as ``%%distribute``'s is, plus ``--idle-timeout``); the other magics act on the session open in
this kernel. A ``%%ranks`` cell is compiled under IPython's own name for it, so a rank's traceback says
``Cell In[N], line L`` as the notebook's own tracebacks do.
"""

from __future__ import annotations

import io
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..dataspec import parse_output as output_item
from ..driver.observer import TextObserver, plan_with_backend
from ..errors import CellInterrupted, CellTimeout, MissingDependencyError, SessionError
from ..flagtable import seconds
from ..magic_line import takes_comments
from ..session.options import (
    DEFAULT_IDLE_TIMEOUT_S,
    IDLE_ENV,
    ROWS,
    idle_timeout_s,
    refuse_run_only_flags,
    start_line,
)
from ..state import kernel_state
from . import flags
from .capture import cell_number

SESSION_DESCRIPTION = """\
Start, stop or look at this kernel's interactive session: ranks that keep their state from cell to cell.

    %distribute_session start [flags]   start N ranks (the flags of %%distribute below, plus --idle-timeout)
    %distribute_session status          where the ranks are, what each does, its MLflow run, until when it is held
    %distribute_session stop            end it: the ranks end, their processes and slots are free again
    %distribute_session restart         stop it and start it again with the same flags (the ranks' state is lost)

Then %%ranks cells run on every rank (%%ranks 0, %%ranks 0,1 for some), each rank in a namespace of its own with
ctx in it; %distribute_pull NAME brings a value back by rank, %distribute_push NAME sends one to every rank.

Example::

    %distribute_session start --backend spark -n 2 --strategy fsdp
"""

IDLE_ARGUMENT = ("Session", (("--idle-timeout",), dict(
    dest="idle_timeout", type=seconds, default=None,
    help=f"release the session's ranks after S seconds without a cell (0: only when stopped; None means "
         f"${IDLE_ENV}, else {DEFAULT_IDLE_TIMEOUT_S:g})")))


@flags.declared(ROWS, SESSION_DESCRIPTION, extra=(IDLE_ARGUMENT,))
def _session_parser(line: str) -> None:  # pragma: no cover - holder of the parser only
    """Placeholder whose decorators define the session's flags."""


@magic_arguments()
@argument("ranks", nargs="*", help="the ranks to run on: 0, 0,1, 1-3 or all (default: every rank)")
@argument("--timeout", type=seconds, default=None,
          help="interrupt the cell on every rank after S seconds (None means the session's --timeout)")
@argument("--output", action="append", type=output_item, default=[], metavar="NAME=VARIABLE",
          help="bind the output the cell writes with ctx.write(NAME, batch), committed at the cell's end, to this "
               "notebook variable (a Spark DataFrame on spark, a Ray Dataset on ray, else a pyarrow Dataset)")
def _ranks_parser(line: str, cell: str) -> None:  # pragma: no cover - holder of the parser only
    """Run the cell on the session's ranks (every rank, or those named), each in its own namespace with ``ctx``.

    The value of the cell's last expression comes back by rank; the ranks' output is shown as ``[rank N]`` lines.
    The kernel's interrupt stops the cell on every rank; the session and its state are kept. What the cell writes
    with ``ctx.write`` is committed at its end (``session.outputs[NAME]``, ``--output NAME=VARIABLE``)."""


@magic_arguments()
@argument("expression", nargs="+", help="a name (or any expression) to evaluate on the ranks")
@argument("--ranks", default=None, help="only these ranks (0, 0,1, 1-3): a dict by rank instead of a list")
@argument("--to", default=None, help="also bind the result to this notebook variable")
def _pull_parser(line: str) -> None:  # pragma: no cover - holder of the parser only
    """Bring a value from the session's ranks into the notebook: a list by rank (tensors on the CPU)."""


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to send (each keeps its name on the ranks)")
@argument("--ranks", default=None, help="only these ranks (0, 0,1, 1-3)")
def _push_parser(line: str) -> None:  # pragma: no cover - holder of the parser only
    """Send notebook variables to the session's ranks, each pickled once, bound under the same names."""


def parse_ranks(words: list[str] | str | None, world_size: int) -> tuple[int, ...] | None:
    """``0``, ``0,2``, ``1-3``, ``all`` (or nothing: every rank) → the ranks, or None for every rank."""
    text = ",".join(words) if isinstance(words, list) else (words or "")
    text = text.replace(" ", "")
    if text in ("", "all"):
        return None
    chosen: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            low, dash, high = part.partition("-")
            chosen.update(range(int(low), int(high) + 1) if dash else (int(low),))
    except ValueError:
        raise SessionError(f"ranks {text!r}: write them as 0, 0,1, 1-3 or all") from None
    wrong = sorted(rank for rank in chosen if not 0 <= rank < world_size)
    if wrong or not chosen:
        raise SessionError(f"ranks {text!r}: this session has ranks 0 to {world_size - 1}")
    return tuple(sorted(chosen))


def current_session() -> Any:
    """The session open in this kernel, or a `SessionError` saying how to start one (and why the last one ended)."""
    found = kernel_state().sessions()
    if found:
        return found[0]
    last = kernel_state().last_session_end
    why = f" (the last one ended: {last})" if last else ""
    raise SessionError(f"no session is open in this kernel{why}; start one with %distribute_session start "
                       "[flags], e.g. %distribute_session start --backend local -n 2")


def _in_frontend(shell: Any) -> bool:
    return type(shell).__name__ == "ZMQInteractiveShell"


class _Discard(io.TextIOBase):
    """Where the session monitor's own text goes: the cells print theirs."""

    def write(self, text: str) -> int:
        return len(text)


def _monitor(config: Any) -> Any:
    """The session's live monitor (ranks' states, the log tail, Stop, live charts) in a front-end, else None."""
    if not config.ui:
        return None
    try:
        from ..ui.monitor import MonitorObserver
    except ImportError:
        return None
    return MonitorObserver(config, text_out=_Discard())


def start_session(config: Any, idle_s: float, observer: Any = None, monitor: Any = None) -> Any:
    """Start the kernel's session (what ``%distribute_session start`` and the panel's Start session do)."""
    from ..session.driver import Session

    return Session(config, idle_timeout=idle_s, observer=observer or TextObserver(), monitor=monitor)


@magics_class
class SessionMagics(Magics):
    """``%distribute_session``, ``%%ranks``, ``%distribute_pull``, ``%distribute_push``."""

    @line_magic
    @takes_comments
    def distribute_session(self, line: str) -> Any:
        action, _, rest = line.strip().partition(" ")
        if action == "start":
            return self._start(rest)
        if rest.strip():
            raise UsageError(f"%distribute_session {action} takes no arguments")
        if action == "stop":
            session = current_session()
            what = session.stop("stopped by %distribute_session stop", observer=TextObserver())
            print(f"dtrain_magic: session stopped; released {what}")
            return None
        if action == "restart":
            old = current_session()
            config = old.config
            session = old.restart(observer=TextObserver(), monitor=_monitor(config))
            self.shell.user_ns["_distribute_session"] = session
            print("dtrain_magic: session restarted: every rank starts afresh (their state was lost)")
            return None
        if action == "status":
            found = kernel_state().sessions()
            print(found[0].status() if found else "dtrain_magic: no session is open in this kernel"
                  + (f" (the last one ended: {kernel_state().last_session_end})"
                     if kernel_state().last_session_end else ""))
            return None
        raise UsageError("%distribute_session start [flags] | status | stop | restart (see %distribute_session?)")

    distribute_session.__doc__ = _session_parser.__doc__

    def _start(self, rest: str) -> Any:
        refuse_run_only_flags(rest)
        args = flags.parse_line(rest, holder=_session_parser, rows=ROWS, help_name="%distribute_session?")
        idle = idle_timeout_s(args.idle_timeout)
        if args.configure:
            return self._configure(args, idle)
        config = flags.config_from_args(args, in_frontend=_in_frontend(self.shell))
        if config.dry_run:
            from ..driver.plan import check
            from ..session.options import check_session_config

            check_session_config(config)
            plan = check(config)
            print("dtrain_magic dry run: nothing started.\n"
                  f"  would start a session of {plan_with_backend(plan.launcher.describe(config), config)}\n"
                  f"  strategy {config.strategy}, precision {config.precision}, held until idle for {idle:g} s\n"
                  f"  equivalent: {start_line(config.replace(dry_run=False), idle)}")
            return None
        session = start_session(config, idle, monitor=_monitor(config))
        self.shell.user_ns["_distribute_session"] = session
        return None

    def _configure(self, args: Any, idle: float) -> None:
        config, held = flags.config_for_panel(args, in_frontend=_in_frontend(self.shell))
        show_panel = panel_shower()
        show_panel(config, "", self.shell, start_session=session_starter(self.shell, idle), held=held,
                   session_line=lambda chosen: start_line(chosen.replace(dry_run=False), idle))

    @cell_magic
    @takes_comments
    def ranks(self, line: str, cell: str) -> Any:
        args = parse_argstring(_ranks_parser, line)
        session = current_session()
        chosen = parse_ranks(args.ranks, session.world_size)
        source = "\n" + cell  # line 1 is the %%ranks line: a rank's traceback gives the cell's own line numbers
        filename, label = _cell_name(self.shell, source)
        try:
            value = session.run(source, chosen, timeout=args.timeout, filename=filename, label=label)
        except (CellInterrupted, CellTimeout) as exc:
            if exc.stuck and session.config.ui:
                _offer_restart(self.shell)
            raise
        if args.output:
            from ..driver.outputs import bind

            bind(self.shell.user_ns, session.config.backend, args.output, session.cell_outputs, print)
        return value

    ranks.__doc__ = _ranks_parser.__doc__

    @line_magic
    @takes_comments
    def distribute_pull(self, line: str) -> Any:
        args = parse_argstring(_pull_parser, line)
        session = current_session()
        values = session.pull(" ".join(args.expression), parse_ranks(args.ranks, session.world_size))
        if args.to:
            if not args.to.isidentifier():
                raise UsageError(f"--to {args.to}: must be a Python identifier")
            self.shell.user_ns[args.to] = values
        return values

    distribute_pull.__doc__ = _pull_parser.__doc__

    @line_magic
    @takes_comments
    def distribute_push(self, line: str) -> None:
        args = parse_argstring(_push_parser, line)
        session = current_session()
        missing = [name for name in args.names if name not in self.shell.user_ns]
        if missing:
            raise SessionError(f"push: no notebook variable {', '.join(missing)}")
        session.push(parse_ranks(args.ranks, session.world_size), **{name: self.shell.user_ns[name]
                                                                      for name in args.names})
        print(f"dtrain_magic: pushed {', '.join(args.names)} to "
              + ("every rank" if args.ranks is None else f"ranks {args.ranks}"))

    distribute_push.__doc__ = _push_parser.__doc__


def _cell_name(shell: Any, source: str) -> tuple[str, str]:
    """The file name IPython compiles this cell under, and its ``Cell In[N]`` label."""
    compiler = getattr(shell, "compile", None)
    if compiler is None or not hasattr(compiler, "cache"):
        return "<ranks-cell>", "the cell"
    filename = compiler.cache(source, cell_number(shell))
    named = getattr(compiler, "format_code_name", lambda name: None)(filename)
    return filename, " ".join(named) if named else filename


def panel_shower() -> Any:
    """`ui.panel.show_panel`, for ``--configure`` (the run's and the session's); a clear error naming the missing
    widget packages when the ``ui`` extra is not installed (nothing was started)."""
    try:
        from ..ui.panel import show_panel
    except ImportError as exc:
        raise MissingDependencyError(
            f"--configure shows an ipywidgets panel, and the widget packages are missing ({exc}). Install them with "
            "`pip install ipywidgets plotly anywidget` (or dtrain_magic[ui]), or run with flags only; nothing was "
            "started") from None
    return show_panel


def session_starter(shell: Any, idle: float | None = None) -> Any:
    """What the configure panel's Start session calls: ``start(config, monitor)`` → the kernel's session."""
    def start(config: Any, monitor: Any) -> Any:
        session = start_session(config, idle_timeout_s(idle), observer=TextObserver(out=_Discard()), monitor=monitor)
        shell.user_ns["_distribute_session"] = session
        return session

    return start


def _offer_restart(shell: Any) -> None:
    """A rank could not be freed: a button that restarts the session (its output under it)."""
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError:
        return
    button = w.Button(description="Restart the session", icon="refresh", button_style="warning",
                      tooltip="stop every rank (their state is lost) and start the session again with its flags")
    button.add_class("dtm-session-restart")
    out = w.Output()

    def restart(_: Any) -> None:
        button.disabled = True
        with out:
            try:
                old = current_session()
                shell.user_ns["_distribute_session"] = old.restart(observer=TextObserver(),
                                                                   monitor=_monitor(old.config))
                print("dtrain_magic: session restarted: every rank starts afresh (their state was lost)")
            except Exception as exc:  # a button has no cell to raise into: its output shows the error
                print(f"{type(exc).__name__}: {exc}")

    button.on_click(restart)
    display(w.VBox([button, out]))
