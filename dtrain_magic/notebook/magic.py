"""The ``%%distribute`` cell magic: flags → `RunConfig` → the cell's function → a run → `RunResult`.

The run goes the one way every entry point goes (`driver.runner.prepare`, then `PreparedRun.execute`); the
magic parses the line (`flags`) and runs the cell in the notebook (`capture`)."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..api import execute_prepared
from ..driver import runner
from ..magic_line import takes_comments
from ..result import RunResult
from . import flags
from .capture import capture, payload_maker
from .session_magic import panel_shower, session_starter


def _in_frontend(shell: Any) -> bool:
    """True in a kernel that a notebook front-end (JupyterLab, VS Code, Databricks) talks to."""
    return type(shell).__name__ == "ZMQInteractiveShell"


@magics_class
class DistributeMagics(Magics):
    """IPython magics of dtrain_magic."""

    @cell_magic
    @takes_comments
    def distribute(self, line: str, cell: str) -> RunResult | None:
        args = flags.parse_line(line)
        if args.configure:
            return self._configure(args, cell)
        namespace = self.shell.user_ns
        if args.sweep is not None:  # a run per trial of the space (docs/sweeps.md); the cell is captured once
            from ..strategies.model_of_cell import model_of_cell
            from ..sweep.entry import sweep_from_args

            return sweep_from_args(args, lambda: capture(cell, namespace, args.fn, self.shell)[0], namespace,
                                   cell_model=lambda name: model_of_cell(cell, namespace, name),
                                   in_frontend=_in_frontend(self.shell))
        config = flags.config_from_args(args, in_frontend=_in_frontend(self.shell))
        prepared = runner.prepare(config, lambda: capture(cell, namespace, config.fn, self.shell)[0], namespace)

        def dry_run_text() -> str:
            # the cell ran: its helpers and globals are in the namespace
            from ..strategies.model_of_cell import model_of_cell

            return prepared.dry_run_text(model=model_of_cell(cell, namespace, prepared.payload.name,
                                                             prepared.config.ac_module))

        return execute_prepared(prepared, dry_run_text)

    def _configure(self, args: Any, cell: str) -> None:
        """``--configure``: the panel, opened even when the line's choice is invalid here (the problem shown in it)."""
        config, held = flags.config_for_panel(args, in_frontend=_in_frontend(self.shell))
        show_panel = panel_shower()
        from ..strategies.model_of_cell import model_of_cell

        model = model_of_cell(cell, self.shell.user_ns, config.fn)
        return show_panel(config, cell, self.shell, model=model, make_payload=payload_maker(cell, self.shell),
                          start_session=session_starter(self.shell), held=held)

    distribute.__doc__ = flags.HELP

    @line_magic
    @takes_comments
    def distribute_stacks(self, line: str) -> None:
        """Print where every rank of the runs in progress in this kernel is: each rank's Python stack, with the
        notebook's cell lines, within 2 s, without disturbing the training. For a run started by a cell that keeps
        the kernel busy, run it in a subshell console (JupyterLab: "New Subshell Console for Notebook"); for
        the ``--configure`` panel's runs, from any cell. A ``--ui`` run's monitor has a Stacks button."""
        if line.strip():
            raise UsageError("%distribute_stacks takes no arguments")
        found = runner.stacks_of_live_runs()
        if not found:
            print("dtrain_magic: no run is in progress in this kernel")
        for title, text in found:
            print(f"dtrain_magic: {title}\n{text}")

    @line_magic
    @takes_comments
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
