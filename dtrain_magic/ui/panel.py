"""``%%distribute --configure``: a panel of controls prefilled from the flags, then Run in the background.

`PanelState` is the panel's logic with no widgets (unit-tested): which controls are enabled, what is
wrong with the current choice, the `RunConfig` that Run launches, the equivalent flag line and the
memory estimate (for the cell's own model when `memory.model_of_cell` can count it without training,
else a what-if for the size typed in the panel, said as such). `ConfigurePanel` wires ipywidgets to
it; `show_panel` (called by the magic) displays it.

Run prepares the run as the magic does (``runner.prepare``: the checks, the next run's workers ahead, the cell
captured in the notebook on the kernel's main thread, as any cell), then runs ``PreparedRun.execute`` in a
background thread with a `MonitorObserver`; the kernel stays responsive (other
cells run, Stop is handled at once). The monitor (status per rank, progress, Stop, live charts) is a
child of the panel's own widget tree, not display data inside an ``Output``: an ``Output`` that the
front-end also captures into (the cell's prints) syncs its outputs back to the kernel and would
overwrite a display appended from the kernel in between (the monitor vanished that way). The workers'
text goes to a separate ``Output`` that only the kernel writes. The `RunResult` is bound to
``--result NAME`` when given, and to ``_distribute_result`` (as every entry point in a notebook does:
`driver.runner.bind_result`).

Start session (when the magic gives ``start_session``) starts an interactive session with the chosen settings
(`dtrain_magic.session`) in a background thread; the session's monitor stays under the panel for its life.

"Write cell" (`CellWriter`, ``js/cell_writer.js``) puts the equivalent ``%%distribute`` line over the
cell's body into a new cell below: through the notebook's document in JupyterLab and Notebook 7 (at
once), else IPython's ``set_next_input``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Mapping

import anywidget
import traitlets

from ..config import RunConfig, cuda_available
from ..dataspec import as_text, from_text
from ..errors import ConfigError, DistributeError, log_dropped
from ..flagtable import APPEND, CHECKBOX, DROPDOWN, INT_BOX, TEXT, Flag, panel_rows
from ..payload import Payload
from ..registry import STRATEGIES
from ..strategies.memory import CellModel
from .panel_sweep import SweepBox

CONTROLS = tuple(row.field for row in panel_rows())  # the RunConfig fields the panel sets, from the flag table
TEXT_LISTS = tuple(row.field for row in panel_rows() if row.kind == APPEND)  # shown as one line: "a=x b=y"
DEFAULT_PARAMS = 125_000_000  # the memory estimate's what-if size when the cell's model is not known
OUTPUT_LINES = 400  # the panel keeps this many lines of worker text (the monitor shows a tail too)

def esm_source(name: str) -> str:
    """A front-end module of the package, ``dtrain_magic/js/<name>`` (a link to the repo's ``js/``)."""
    from importlib.resources import files

    return (files("dtrain_magic") / "js" / name).read_text(encoding="utf-8")


class PanelState:
    """The choice shown in the panel. ``checker(config)`` (default none) adds backend/strategy checks."""

    def __init__(
        self,
        config: RunConfig,
        checker: Callable[[RunConfig], None] | None = None,
        gpu_available: Callable[[], bool] = cuda_available,
        num_params: int | None = None,
        model: CellModel | None = None,
        describe_data: Callable[[RunConfig], list[str]] | None = None,
    ):
        """``model``: the cell's model as `memory.model_of_cell` found it (or why not); ``num_params``: a
        size typed by the user (a what-if), else the cell's model's, else `DEFAULT_PARAMS`. ``describe_data``:
        the ``--data`` sources of a config in words, one line each (raises a `ConfigError` for a bad one)."""
        self.base = config
        self.checker = checker
        self.describe_data = describe_data
        self.gpu_available = gpu_available
        self.model = model
        if num_params is not None:
            self.num_params, self.size_source = int(num_params), "typed"
        elif model is not None and model.found:
            self.num_params, self.size_source = int(model.num_params), "cell"
        else:
            self.num_params, self.size_source = DEFAULT_PARAMS, "default"
        if self.size_source == "typed" and model is not None and model.num_params == self.num_params:
            self.size_source = "cell"
        self.values: dict[str, Any] = {name: as_text(getattr(config, name)) if name in TEXT_LISTS
                                       else getattr(config, name) for name in CONTROLS}
        self._apply_strategy_fields()

    # -- controls --------------------------------------------------------------------------------
    def set(self, **changes: Any) -> "PanelState":
        unknown = set(changes) - set(CONTROLS) - {"num_params"}
        if unknown:
            raise KeyError(f"not a panel control: {', '.join(sorted(unknown))}")
        if "num_params" in changes:
            self.num_params = int(changes.pop("num_params"))
            known = self.model.num_params if self.model is not None else None
            self.size_source = "cell" if known is not None and self.num_params == known else "typed"
        self.values.update(changes)
        self._apply_strategy_fields()
        return self

    def _apply_strategy_fields(self) -> None:
        """A control that belongs to a strategy (its ``own_fields``: ZeRO to DeepSpeed) is unset and disabled under
        another, and shows the strategy's ``panel_defaults`` under its own."""
        chosen = self.values["strategy"]
        for name in CONTROLS:
            owner = STRATEGIES.owner_of(name)
            if owner is None:
                continue
            if owner != chosen:
                self.values[name] = None
            elif self.values[name] is None:
                self.values[name] = STRATEGIES.load(owner).panel_defaults.get(name)

    def enabled(self, name: str) -> bool:
        """Whether the control of ``name`` applies to the chosen strategy."""
        owner = STRATEGIES.owner_of(name)
        return owner is None or owner == self.values["strategy"]

    @property
    def zero_enabled(self) -> bool:
        return self.enabled("zero")

    def options(self) -> dict[str, list[tuple[str, Any]]]:
        """(label, value) choices per dropdown (from the flag table); choices that cannot work here are
        labelled, not hidden."""
        options = {row.field: row.panel.options(row.choices) for row in panel_rows() if row.panel.widget == DROPDOWN}
        if not self.values["use_gpu"]:
            options["precision"] = [(f"{label} (needs GPU)" if value == "fp16" else label, value)
                                    for label, value in options["precision"]]
        return options

    # -- what Run would do -----------------------------------------------------------------------
    def _build(self, **overrides: Any) -> RunConfig:
        values = dict(self.values, **overrides)
        for name in TEXT_LISTS:  # "train=df val=/p" → ((train, df), (val, /p)); a malformed one: a ConfigError
            if isinstance(values[name], str):
                values[name] = from_text(values[name])
        return self.base.replace(**values)

    def problems(self) -> list[str]:
        """Why Run is disabled: every reason, each naming the control (empty when the choice is valid)."""
        found = []
        if self.values["use_gpu"] and not self.gpu_available():
            found.append("GPU: no CUDA device on this machine; switch GPU off")
        try:
            config = self._build()
        except (ConfigError, TypeError, ValueError) as exc:
            found.append(str(exc))
            return found
        if self.checker is not None:
            try:
                self.checker(config)
            except DistributeError as exc:
                message = str(exc).splitlines()[0]
                if message not in found and not (found and "CUDA" in message):
                    found.append(message)
        try:
            self.data_lines(config)
        except DistributeError as exc:
            found.append(str(exc).splitlines()[0])
        return found

    def data_lines(self, config: RunConfig | None = None) -> list[str]:
        """The ``--data`` sources in words (kind, columns, how they reach the ranks); a `ConfigError` for a bad one."""
        if config is None:
            try:
                config = self._build()
            except (ConfigError, TypeError, ValueError):
                return []
        if not config.data or self.describe_data is None:
            return []
        return self.describe_data(config)

    @property
    def can_run(self) -> bool:
        return not self.problems()

    def to_config(self, ui: bool = True) -> RunConfig:
        """The `RunConfig` that Run launches (``ui`` on: the run shows its monitor in the panel)."""
        problems = self.problems()
        if problems:
            raise ConfigError("--configure", "; ".join(problems))
        return self._build(ui=ui, dry_run=False)

    def flag_line(self) -> str | None:
        """The ``%%distribute ...`` line that runs the current choice without the panel (None if invalid)."""
        try:
            return self._build(ui=True, dry_run=False).flag_line()
        except (ConfigError, TypeError, ValueError):
            return None

    def model_line(self) -> str:
        """Which model size the estimate is for: the cell's own (and how it was counted), or a what-if."""
        n = f"{self.num_params:,} parameters"
        if self.size_source == "cell":
            return f"model: {n}, {self.model.description}"
        known = self.model.num_params if self.model is not None and self.model.found else None
        if known is not None:
            why = f"the cell's model has {known:,}"
        elif self.model is not None:
            why = f"the cell's model is not known before training: {self.model.description}"
        else:
            why = "the cell's model was not looked at"
        if self.size_source == "typed":
            return f"what-if: {n}, a size typed in 'model (M params)' ({why})"
        return f"what-if: {n}, a default size ({why}); type your model's size in 'model (M params)'"

    def memory_line(self) -> str | None:
        """The model line, then the estimate of parameter + gradient + optimizer memory per process
        (``dtrain_magic.strategies.memory``), and a warning when it exceeds the device's memory."""
        try:
            from ..strategies import memory
        except ImportError:
            return None
        try:
            facts = getattr(self.model, "facts", None) if self.size_source == "cell" else None
            settings = None
            if facts is not None:  # the cell's own model: the strategy's buffers for it too
                try:
                    from ..strategies import get_strategy

                    settings = get_strategy(self.values["strategy"]).memory_settings(self._build(), facts)
                except Exception as exc:  # a combination the panel shows as a problem: states only
                    log_dropped(__name__, "memory_line", exc)
                    facts = None
            # the cell's sample batch, when known before training: one micro-batch's activations under the --ac chosen
            activations = getattr(self.model, "activations", None) if self.size_source == "cell" else None
            est = memory.estimate(self.num_params, self.values["strategy"], self.values["zero"],
                                  self.values["precision"], int(self.values["num_processes"]),
                                  tp=int(self.values["tp"]), pp=int(self.values["pp"]), facts=facts,
                                  settings=settings, activations=activations, ac=self.values.get("ac") or "none")
            line = self.model_line() + "\n" + est.line()
            device = "cuda" if self.values["use_gpu"] else None
            per_device = 1 if self.values["use_gpu"] else int(self.values["num_processes"])
            warning = memory.check_fits(est, memory.device_memory_bytes(device, per_device))
            if warning:
                line += "\n" + warning
            return line
        except Exception as exc:  # a half-written estimate module must not break the panel
            log_dropped(__name__, "memory_line", exc)
            return f"memory estimate unavailable: {type(exc).__name__}: {exc}"

    def cell_text(self, body: str, extra: str = "") -> str | None:
        """The cell "Write cell" creates: the equivalent flag line (with ``extra`` words: a sweep's) over ``body``
        (None while invalid)."""
        line = self.flag_line()
        if line is None:
            return None
        line += extra
        return f"{line}\n{body.strip(chr(10))}\n" if body.strip() else f"{line}\n"


class CellWriter(anywidget.AnyWidget):
    """The "Write cell" button (front-end: ``js/cell_writer.js``); see the module docstring."""

    _esm = traitlets.Unicode(esm_source("cell_writer.js")).tag(sync=True)
    text = traitlets.Unicode("").tag(sync=True)  # the new cell (empty while the choice is invalid)
    body = traitlets.Unicode("").tag(sync=True)  # the configured cell's body, to find that cell
    note = traitlets.Unicode("").tag(sync=True)  # what the last click did
    disabled = traitlets.Bool(False).tag(sync=True)


class ConfigurePanel:
    """The widgets of ``--configure`` around a `PanelState`."""

    def __init__(self, config: RunConfig, cell: str, shell: Any, checker: Callable[[RunConfig], None] | None = None,
                 model: CellModel | None = None, make_payload: Callable[[RunConfig], Payload] | None = None,
                 start_session: Callable[[RunConfig, Any], Any] | None = None,
                 held: Mapping[str, Any] | None = None, session_line: Callable[[RunConfig], str] | None = None):
        """``model``: the cell's model as the magic found it (`strategies.model_of_cell`), for the estimate;
        ``make_payload``: what Run calls on the kernel's thread to capture the cell for the chosen config (the
        magic gives `notebook.capture.payload_maker`); without it Run is off. ``start_session(config, monitor)``:
        what Start session calls (the magic gives `notebook.session_magic.session_starter`): an interactive session
        with the chosen settings, its monitor under the panel. ``held``: control values the line gave that are
        invalid here (`notebook.flags.config_for_panel`): set, so the panel opens with the problem shown and Run
        off. ``session_line(config)``: the panel configures a session (``%distribute_session start --configure``):
        its heading, its equivalent line (this function's), no Run and no Write cell."""
        import ipywidgets as w

        if checker is None:
            from ..driver.runner import check as checker
        from .charts import preload_plotly

        preload_plotly()  # the live charts' first figure costs seconds in a fresh kernel: meanwhile the user chooses
        self.cell, self.shell, self.make_payload, self.start_session = cell, shell, make_payload, start_session
        self._described: dict[tuple, list[str]] = {}
        self.state = PanelState(config, checker=checker, model=model, describe_data=self._describe_data)
        self.state.set(**(held or {}))
        self.session_line = session_line
        style = {"description_width": "150px"}
        self._make_controls(w, style)
        self._make_readouts(w, style)
        self._make_buttons(w)
        self._make_outputs(w)
        self.thread: threading.Thread | None = None
        self.running = False
        self.runs = 0
        self.observer: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        self._wire()
        self.widget = self._layout(w)
        self.refresh()

    def _make_controls(self, w: Any, style: dict) -> None:
        """One control per flag-table row the panel shows, and the model size for the estimate."""
        opts = self.state.options()
        v = self.state.values
        self.controls = {row.field: _control(w, row, v[row.field], opts.get(row.field), style) for row in panel_rows()}
        for name, control in self.controls.items():
            control.add_class(f"dtm-control-{name.replace('_', '-')}")
        self.params = w.FloatText(value=self.state.num_params / 1e6, description="model (M params)", style=style,
                                  tooltip="model size for the memory estimate, in millions of parameters")
        self.params.add_class("dtm-control-params")

    def _make_readouts(self, w: Any, style: dict) -> None:
        """What the panel says of the choice: the memory estimate, problems, the data, the equivalent line."""
        self.memory = w.HTML()
        self.memory.add_class("dtm-memory")
        self.problems = w.HTML()
        self.data = w.HTML()
        self.data.add_class("dtm-data")
        self.flag_line = w.Textarea(value="", disabled=False, layout=w.Layout(width="100%", height="48px"),
                                    description="equivalent", style=style)
        self.flag_line.add_class("dtm-flag-line")

    def _make_buttons(self, w: Any) -> None:
        """Run, Start session and Write cell, each shown only where it has something to do."""
        self.run_button = w.Button(description="Run", icon="play", button_style="success")
        self.run_button.add_class("dtm-run")
        no_cell_to_run = self.session_line is not None or (self.make_payload is None and self.start_session is not None)
        if no_cell_to_run:
            self.run_button.layout.display = "none"
        self.session_button = w.Button(description="Start session", icon="terminal", button_style="info",
                                       tooltip="start an interactive session with these settings: its ranks then "
                                               "run %%ranks cells and keep their state from cell to cell",
                                       layout=w.Layout(display="" if self.start_session else "none"))
        self.session_button.add_class("dtm-start-session")
        self.session: Any = None  # the session Start session started
        self.writer = CellWriter(body=self.cell)
        self.writer.add_class("dtm-writer")
        self.writer.on_msg(self._writer_message)
        if self.session_line is not None:  # a session has no cell to write
            self.writer.layout.display = "none"
        self.written: tuple[str, int | None] | None = None  # how the last "Write cell" was done
        self.sweep_box = SweepBox(w, {"description_width": "150px"})
        if no_cell_to_run or self.make_payload is None:
            self.sweep_box.widget.layout.display = "none"

    def _make_outputs(self, w: Any) -> None:
        self.monitor_box = w.VBox([], layout=w.Layout(width="100%"))  # the run's monitor: a child, not display data
        self.monitor_box.add_class("dtm-panel-monitor")
        self.cell_output = w.Output(layout=w.Layout(width="100%"))  # the cell's own output while it is captured
        self.output = w.Output(layout=w.Layout(width="100%"))  # worker text, written only from the kernel
        self.output.add_class("dtm-panel-text")

    def _wire(self) -> None:
        """Every control's change goes to `_changed`; the buttons to `run` and `start`."""
        for name, control in self.controls.items():
            control.observe(lambda change, name=name: self._changed(name, change["new"]), names="value")
        self.params.observe(lambda change: self._changed("num_params", int(round(max(0.0, change["new"] or 0) * 1e6))),
                            names="value")
        self.run_button.on_click(lambda _: self.run())
        self.session_button.on_click(lambda _: self.start())
        self.sweep_box.button.on_click(lambda _: self.run_sweep())
        for control in (self.sweep_box.space, self.sweep_box.metric, self.sweep_box.trials):
            control.observe(lambda _change: self.refresh(), names="value")

    def _layout(self, w: Any) -> Any:
        """The panel: heading, the two columns of controls, the readouts, the buttons, then the outputs."""
        columns = [[self.controls[row.field] for row in panel_rows() if row.panel.column == i] for i in (0, 1)]
        widget = w.VBox([
            w.HTML(f"<b>dtrain_magic · configure the {'session' if self.session_line else 'run'}</b>"),
            w.HBox([w.VBox(columns[0]), w.VBox(columns[1] + [self.params])]),
            self.memory, self.data, self.problems, self.flag_line,
            w.HBox([self.run_button, self.session_button, self.writer]), self.sweep_box.widget, self.cell_output,
            self.monitor_box,
            self.output,
        ])
        widget.add_class("dtm-configure")
        return widget

    def _describe_data(self, config: RunConfig) -> list[str]:
        """The sources in the notebook as the run would find them (not counted: that is for Run and --dry-run);
        kept per data line, so a 1 GB pandas DataFrame is not converted again at every click."""
        key = (config.data, config.backend)
        if key not in self._described:
            from ..driver.data_plan import describe

            self._described = {key: describe(config, getattr(self.shell, "user_ns", None) or {})}
        return self._described[key]

    def _changed(self, name: str, value: Any) -> None:
        self.state.set(**{name: value})
        self.refresh()

    def refresh(self) -> None:
        import html

        for name, control in self.controls.items():  # a strategy's own controls: greyed out under another
            owner = STRATEGIES.owner_of(name)
            if owner is None:
                continue
            control.disabled = not self.state.enabled(name)
            # The label stays short (a longer one was cut off); the tooltip says why it may be greyed out.
            control.tooltip = (control.description if not control.disabled
                               else f"{owner} only: choose strategy {owner} to set {control.description}")
        precision, allowed = self.controls["precision"], self.state.options()["precision"]
        if tuple(precision.options) != tuple(allowed):
            # only when they change: setting a Dropdown's options resets its index, a round trip to the browser
            # that can cross the user's next choice there
            precision.options = allowed
        if precision.value != self.state.values["precision"]:
            precision.value = self.state.values["precision"]
        memory = self.state.memory_line()
        self.memory.value = (f"<pre style='margin:0; white-space:pre-wrap'>{html.escape(memory)}</pre>" if memory
                             else "<i>memory estimate unavailable</i>")
        try:
            data = self.state.data_lines()
        except DistributeError:
            data = []  # listed among the problems
        self.data.value = ("<pre style='margin:0; white-space:pre-wrap'>" + html.escape("\n".join(data)) + "</pre>"
                           if data else "")
        problems = self.state.problems()
        self.problems.value = ("".join(f"<div style='color:#cf222e'>⚠ {html.escape(p)}</div>" for p in problems)
                               if problems else "<div style='color:#1a7f37'>✓ ready to run</div>")
        self.run_button.disabled = bool(problems) or self.running
        self.sweep_box.button.disabled = bool(problems) or self.running or not self.sweep_box.space.value.strip()
        self.session_button.disabled = bool(problems) or self.running or self.start_session is None
        line = self.equivalent_line()
        self.flag_line.value = line or "(fix the problems above to get the equivalent flag line)"
        self.writer.text = self.state.cell_text(self.cell, self.sweep_box.words()) or ""

    def equivalent_line(self) -> str | None:
        """The line that does what the panel would without it: ``%%distribute ...``, or for a session its
        ``%distribute_session start ...`` (None while the choice is invalid)."""
        if self.session_line is None:
            line = self.state.flag_line()
            return line + self.sweep_box.words() if line is not None else None
        try:
            return self.session_line(self.state.to_config(ui=True))
        except DistributeError:
            return None

    # -- Write cell ------------------------------------------------------------------------------
    def write_cell(self) -> str | None:
        """Put the equivalent cell below through IPython's ``set_next_input`` (what "Write cell" does in a
        front-end that does not give widgets the notebook); the text, or None while the choice is invalid.
        The front-end shows it with the kernel's next reply to a cell run: a comm message (a click) has
        no reply that could carry it."""
        text = self.state.cell_text(self.cell, self.sweep_box.words())
        if text is None:
            return None
        self.shell.set_next_input(text, replace=False)
        self.written = ("kernel", None)
        self.writer.note = ("the new cell appears below once you run a cell "
                            "(this front-end takes new cells from a cell's reply)")
        return text

    def _writer_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        event = content.get("event") if isinstance(content, dict) else None
        if event == "written":
            self.written = ("notebook", content.get("index"))
            self.writer.note = "written to a new cell below"
        elif event == "write":
            self.write_cell()

    # -- Run -------------------------------------------------------------------------------------
    def run(self, wait: bool = False) -> None:
        """Prepare the run as the magic does (check, the next run's workers ahead, the cell captured on this
        thread), then execute it in a background thread; the monitor appears under the panel."""
        from ..driver import runner
        from .monitor import MonitorObserver

        if self.running:
            return
        config, text = self._fresh_start()
        text.write(f"running: {config.flag_line()}\n")
        namespace = self.shell.user_ns
        try:
            with self.cell_output:  # the cell runs in the notebook first: its own prints land here
                prepared = runner.prepare(config, lambda: self.make_payload(config), namespace)
        except DistributeError as exc:
            text.write(f"{type(exc).__name__}: {exc}\n", stream="stderr")
            text.close()
            self.error = exc
            return
        self.observer = MonitorObserver(config, text_out=text, display=False)
        self.monitor_box.children = (self.observer.container,)
        self._in_background("dtrain-panel-run", lambda: prepared.execute(self.observer, self.observer.stop_event),
                            text, wait)

    def _fresh_start(self) -> tuple[RunConfig, "_OutputWriter"]:
        """Run's and Run sweep's start: the chosen config, the outputs of the last one cleared, a new text writer."""
        if self.make_payload is None:
            raise RuntimeError("this panel has no cell to run (make_payload); it configures and writes cells only")
        config = self.state.to_config(ui=True)
        self.output.outputs = ()
        self.cell_output.clear_output()
        return config, _OutputWriter(self.output)

    def _in_background(self, name: str, work: Callable[[], Any], text: "_OutputWriter", wait: bool) -> None:
        """Run's and Run sweep's background thread: ``work()``'s value is the panel's ``result``; an exception is
        ``error``, said in the panel's text (the kernel goes on); the buttons come back when it ends."""
        def body() -> None:
            try:
                self.result = work()
            except BaseException as exc:  # shown in the panel; the kernel goes on
                self.error = exc
                text.write(f"{type(exc).__name__}: {exc}\n", stream="stderr")
            finally:
                text.close()
                self.running = False
                self.refresh()

        self.error, self.runs = None, self.runs + 1
        self.thread = threading.Thread(target=body, name=name, daemon=True)
        self.running = True
        self.refresh()
        self.thread.start()
        if wait:
            self.thread.join()

    # -- Run sweep -------------------------------------------------------------------------------------------------
    def run_sweep(self, wait: bool = False) -> None:
        """Run the sweep box's sweep with the panel's settings as ``%%distribute --sweep`` would: the checks and the
        cell's capture on this thread, the trials in a background thread, the sweep's panel (curves, trials, Stop)
        under this one; the `SweepResult` bound to ``--result NAME`` and the best trial's to ``_distribute_result``."""
        import dataclasses
        import html

        from ..sweep.entry import bind_sweep_result, prepare_sweep

        if self.running:
            return
        config, text = self._fresh_start()
        try:
            settings = self.sweep_box.options()
            text.write(f"running: {self.equivalent_line()}\n")
            with self.cell_output:  # the cell runs in the notebook first: its own prints land here
                sweep = prepare_sweep(config, lambda options: dataclasses.replace(config, **options), settings,
                                      lambda: self.make_payload(config), self.shell.user_ns, out=text,
                                      show_panel=lambda widget: setattr(self.monitor_box, "children", (widget,)))
        except DistributeError as exc:
            self.sweep_box.problem.value = f"<span style='color:#cf222e'>⚠ {html.escape(str(exc))}</span>"
            text.close()
            self.error = exc
            return
        self.sweep_box.problem.value = ""

        def work() -> Any:
            result = sweep.run()
            bind_sweep_result(self.shell.user_ns, config, result)
            return result

        self._in_background("dtrain-panel-sweep", work, text, wait)

    # -- Start session ---------------------------------------------------------------------------------------------
    def start(self, wait: bool = False) -> None:
        """Start an interactive session with the chosen settings, in a background thread; its monitor (the ranks'
        states, its log, the live charts of its MLflow run) appears under the panel and stays for its life."""
        from .monitor import MonitorObserver

        if self.running:
            return
        if self.start_session is None:
            raise RuntimeError("this panel cannot start a session (no start_session was given)")
        config = self.state.to_config(ui=True)
        self.output.outputs = ()
        text = _OutputWriter(self.output)
        started_by = (self.session_line(config) if self.session_line is not None
                      else config.flag_line().replace('%%distribute', '%distribute_session start'))
        text.write(f"starting a session: {started_by}\n")
        self.observer = MonitorObserver(config, text_out=text, display=False)
        self.monitor_box.children = (self.observer.container,)

        def work() -> None:
            try:
                self.session = self.start_session(config, self.observer)
            except BaseException as exc:  # shown in the panel; the kernel goes on
                self.error = exc
                text.write(f"{type(exc).__name__}: {exc}\n", stream="stderr")
                text.close()
            finally:  # the writer stays open on success: the session's log goes on into it
                self.running = False
                self.refresh()

        self.error = None
        self.thread = threading.Thread(target=work, name="dtrain-panel-session", daemon=True)
        self.running = True
        self.refresh()
        self.thread.start()
        if wait:
            self.thread.join()


def _control(w: Any, row: Flag, value: Any, options: list[tuple[str, Any]] | None, style: dict) -> Any:
    """The ipywidgets control of a flag-table row (its `flagtable.PanelControl`), showing ``value``."""
    spec = row.panel
    if spec.widget == DROPDOWN:  # a disabled ZeRO stage (None) shows the first stage
        return w.Dropdown(options=options, value=options[0][1] if value is None else value, description=spec.label,
                          style=style)
    if spec.widget == INT_BOX:
        low, high = spec.bounds
        return w.BoundedIntText(value=value, min=low, max=high, description=spec.label, style=style)
    if spec.widget == CHECKBOX:
        return w.Checkbox(value=value, description=spec.label, indent=False)
    if spec.widget == TEXT:
        return w.Text(value=value, description=spec.label, style=style)
    raise ValueError(f"{row.name}: unknown panel widget {spec.widget!r}")


class _OutputWriter:
    """A text stream into an ipywidgets ``Output`` that only the kernel writes: the last `OUTPUT_LINES`
    lines, sent at most every ``every_s`` (a chatty run would otherwise resend the whole list per line)."""

    def __init__(self, output: Any, every_s: float = 0.25, max_lines: int = OUTPUT_LINES):
        self.output = output
        self._lines: deque[tuple[str, str]] = deque(maxlen=max_lines)
        self._partial = {"stdout": "", "stderr": ""}
        self._dropped = False
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._loop, name="dtrain-panel-text", daemon=True)
        self._thread.start()

    def write(self, text: str, stream: str = "stdout") -> int:
        with self._lock:
            data = self._partial[stream] + text
            *complete, self._partial[stream] = data.split("\n")
            for line in complete:
                self._dropped |= len(self._lines) == self._lines.maxlen
                self._lines.append((stream, line + "\n"))
        if complete:
            self._dirty.set()
        return len(text)

    def flush(self) -> None:
        """Send what was written so far (also sent by the background thread, at most every ``every_s``)."""
        with self._lock:
            lines = list(self._lines) + [(s, rest) for s, rest in self._partial.items() if rest]
            dropped = self._dropped
        outputs: list[dict] = []
        if dropped:
            outputs.append({"output_type": "stream", "name": "stdout", "text": "[earlier lines not kept]\n"})
        for stream, text in lines:  # consecutive lines of one stream are one output
            if outputs and outputs[-1]["name"] == stream:
                outputs[-1]["text"] += text
            else:
                outputs.append({"output_type": "stream", "name": stream, "text": text})
        self.output.outputs = tuple(outputs)

    def close(self) -> None:
        """The last flush; the writer sends nothing after it."""
        self._closed.set()
        self._dirty.set()
        self._thread.join(timeout=5)
        self.flush()

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(t for _, t in self._lines) + "".join(self._partial.values())

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._dirty.wait()
            if self._closed.is_set():
                return
            self._dirty.clear()
            try:
                self.flush()
            except Exception as exc:  # a thread with nobody to tell: the next change redraws the whole state
                log_dropped(__name__, "_loop", exc)
            self._closed.wait(self._every_s)


def show_panel(config: RunConfig, cell: str, shell: Any, model: CellModel | None = None,
               make_payload: Callable[[RunConfig], Payload] | None = None,
               start_session: Callable[[RunConfig, Any], Any] | None = None, held: Mapping[str, Any] | None = None,
               session_line: Callable[[RunConfig], str] | None = None) -> None:
    """Display the configure panel for ``cell`` (called by ``%%distribute --configure`` and ``%distribute_session
    start --configure``, see `ConfigurePanel`); the panel object is ``_distribute_panel`` in the notebook."""
    from IPython.display import display

    panel = ConfigurePanel(config, cell, shell, model=model, make_payload=make_payload, start_session=start_session,
                           held=held, session_line=session_line)
    display(panel.widget)
    shell.user_ns["_distribute_panel"] = panel
    return None
