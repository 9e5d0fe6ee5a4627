"""The ``%%distribute`` cell magic: flags → `RunConfig` → the cell's function → a run → `RunResult`."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from . import flags, runner
from .capture import capture
from .errors import MissingDependencyError
from .observer import RunObserver, TextObserver
from .result import RunResult


def _in_frontend(shell: Any) -> bool:
    """True in a kernel that a notebook front-end (JupyterLab, VS Code, Databricks) talks to."""
    return type(shell).__name__ == "ZMQInteractiveShell"


def make_observer(config: Any) -> RunObserver:
    """The live panel when ``--ui`` and widgets are available, else plain text."""
    if config.ui:
        try:
            from .ui.monitor import MonitorObserver
        except ImportError:
            return TextObserver()
        return MonitorObserver(config)
    return TextObserver()


@magics_class
class DistributeMagics(Magics):
    """IPython magics of dtrain_magic."""

    @cell_magic
    def distribute(self, line: str, cell: str) -> RunResult | None:
        args = flags.parse_line(line)
        config = flags.config_from_args(args, in_frontend=_in_frontend(self.shell))
        if args.configure:
            try:
                from .ui.panel import show_panel
            except ImportError as exc:
                raise MissingDependencyError(
                    f"--configure shows an ipywidgets panel, and the widget packages are missing ({exc}). "
                    "Install them with `pip install ipywidgets plotly anywidget` (or dtrain_magic[ui]), or run "
                    "with flags only; nothing was launched"
                ) from None
            return show_panel(config, cell, self.shell)
        plan = runner.check(config)  # bad input: a clear error before the cell runs or anything launches
        runner.keep_warm_ahead(plan)  # Spark/Ray: the run's workers start now, beside the cell's capture
        payload, _ = capture(cell, self.shell.user_ns, config.fn, self.shell)
        runner.check_payload(config, payload)  # e.g. a Ray Train loop off --backend ray: before --dry-run too
        if config.dry_run:
            from .memory import model_of_cell  # the cell ran: its helpers and globals are in the namespace

            print(runner.dry_run_text(plan, payload, model=model_of_cell(cell, self.shell.user_ns, payload.name)))
            return None
        observer = make_observer(config)
        result = runner.execute(config, payload, observer, stop=getattr(observer, "stop_event", None), plan=plan)
        if config.result:
            self.shell.user_ns[config.result] = result
        return result

    distribute.__doc__ = flags.HELP

    @line_magic
    def distribute_release(self, line: str) -> None:
        """Release the workers ``%%distribute`` keeps waiting for the next run on Spark and Ray (launched after
        each run, held for ``--keep-warm`` seconds): their processes end, their executor slots or Ray CPUs/GPUs
        are free again. The next run launches its workers afresh."""
        if line.strip():
            raise UsageError("%distribute_release takes no arguments")
        released = runner.release_standbys()
        if not released:
            print("dtrain_magic: no workers were waiting")
        for what in released:
            print(f"dtrain_magic: released {what}")
