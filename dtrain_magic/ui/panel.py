"""``%%distribute --configure``: a panel of controls prefilled from the flags, then Run in the background.

`PanelState` is the panel's logic with no widgets (unit-tested): which controls are enabled, what is
wrong with the current choice, the `RunConfig` that Run launches, the equivalent flag line and the
memory estimate. `ConfigurePanel` wires ipywidgets to it; `show_panel` (called by the magic) displays it.

Run captures the cell in the notebook (on the kernel's main thread, as any cell), then runs
``runner.execute`` in a background thread with a `MonitorObserver` whose panel and text output land
in the panel's own Output area; the kernel stays responsive (other cells run, Stop is handled at once).
The `RunResult` is bound to ``--result NAME`` when given, else to ``_distribute_result``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..config import BACKENDS, PRECISIONS, STRATEGIES, ZERO_STAGES, RunConfig, cuda_available
from ..errors import ConfigError, DistributeError

CONTROLS = ("backend", "strategy", "zero", "precision", "num_processes", "grad_accum", "use_gpu", "experiment")
DEFAULT_PARAMS = 125_000_000  # the memory estimate's model size until the user types theirs
RESULT_NAME = "_distribute_result"


class PanelState:
    """The choice shown in the panel. ``checker(config)`` (default none) adds backend/strategy checks."""

    def __init__(
        self,
        config: RunConfig,
        checker: Callable[[RunConfig], None] | None = None,
        gpu_available: Callable[[], bool] = cuda_available,
        num_params: int = DEFAULT_PARAMS,
    ):
        self.base = config
        self.checker = checker
        self.gpu_available = gpu_available
        self.num_params = int(num_params)
        self.values: dict[str, Any] = {name: getattr(config, name) for name in CONTROLS}
        if self.values["strategy"] == "deepspeed" and self.values["zero"] is None:
            self.values["zero"] = 0

    # -- controls --------------------------------------------------------------------------------
    def set(self, **changes: Any) -> "PanelState":
        unknown = set(changes) - set(CONTROLS) - {"num_params"}
        if unknown:
            raise KeyError(f"not a panel control: {', '.join(sorted(unknown))}")
        if "num_params" in changes:
            self.num_params = int(changes.pop("num_params"))
        self.values.update(changes)
        if self.values["strategy"] != "deepspeed":
            self.values["zero"] = None  # ZeRO applies to DeepSpeed only: the control is disabled
        elif self.values["zero"] is None:
            self.values["zero"] = 0
        return self

    @property
    def zero_enabled(self) -> bool:
        return self.values["strategy"] == "deepspeed"

    def options(self) -> dict[str, list[tuple[str, Any]]]:
        """(label, value) choices per dropdown; choices that cannot work here are labelled, not hidden."""
        precisions = [(p if p != "fp16" or self.values["use_gpu"] else "fp16 (needs GPU)", p) for p in PRECISIONS]
        return {
            "backend": [(b, b) for b in BACKENDS if b != "auto"],
            "strategy": [(s, s) for s in STRATEGIES],
            "zero": [(f"ZeRO-{z}", z) for z in ZERO_STAGES],
            "precision": precisions,
        }

    # -- what Run would do -----------------------------------------------------------------------
    def _build(self, **overrides: Any) -> RunConfig:
        return self.base.replace(**dict(self.values, **overrides))

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
        return found

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

    def memory_line(self) -> str | None:
        """The estimate of parameter + gradient + optimizer memory per process (``dtrain_magic.memory``)."""
        try:
            from .. import memory
        except ImportError:
            return None
        try:
            est = memory.estimate(self.num_params, self.values["strategy"], self.values["zero"],
                                  self.values["precision"], int(self.values["num_processes"]))
            line = est.line()
            if hasattr(memory, "check_fits") and hasattr(memory, "device_memory_bytes"):
                device = "cuda" if self.values["use_gpu"] else None
                per_device = 1 if self.values["use_gpu"] else int(self.values["num_processes"])
                warning = memory.check_fits(est, memory.device_memory_bytes(device, per_device))
                if warning:
                    line += "\n" + warning
            return line
        except Exception as exc:  # a half-written estimate module must not break the panel
            return f"memory estimate unavailable: {type(exc).__name__}: {exc}"


class ConfigurePanel:
    """The widgets of ``--configure`` around a `PanelState`."""

    def __init__(self, config: RunConfig, cell: str, shell: Any, checker: Callable[[RunConfig], None] | None = None):
        import ipywidgets as w

        if checker is None:
            from ..runner import check as checker
        self.cell, self.shell = cell, shell
        self.state = PanelState(config, checker=checker)
        opts = self.state.options()
        v = self.state.values
        style = {"description_width": "150px"}
        self.controls = {
            "backend": w.Dropdown(options=opts["backend"], value=v["backend"], description="backend", style=style),
            "strategy": w.Dropdown(options=opts["strategy"], value=v["strategy"], description="strategy", style=style),
            "zero": w.Dropdown(options=opts["zero"], value=v["zero"] if v["zero"] is not None else 0,
                               description="ZeRO stage", style=style, disabled=not self.state.zero_enabled),
            "precision": w.Dropdown(options=opts["precision"], value=v["precision"], description="precision", style=style),
            "num_processes": w.BoundedIntText(value=v["num_processes"], min=1, max=4096, description="processes", style=style),
            "grad_accum": w.BoundedIntText(value=v["grad_accum"], min=1, max=100000, description="grad accumulation", style=style),
            "use_gpu": w.Checkbox(value=v["use_gpu"], description="GPU", indent=False),
            "experiment": w.Text(value=v["experiment"], description="experiment", style=style),
        }
        self.params = w.FloatText(value=self.state.num_params / 1e6, description="model (M params)", style=style,
                                  tooltip="model size for the memory estimate, in millions of parameters")
        self.memory = w.HTML()
        self.problems = w.HTML()
        self.flag_line = w.Textarea(value="", disabled=False, layout=w.Layout(width="100%", height="48px"),
                                    description="equivalent", style=style)
        self.run_button = w.Button(description="Run", icon="play", button_style="success")
        self.run_button.add_class("dtm-run")
        self.output = w.Output(layout=w.Layout(width="100%"))
        self.thread: threading.Thread | None = None
        self.running = False
        self.observer: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        for name, control in self.controls.items():
            control.observe(lambda change, name=name: self._changed(name, change["new"]), names="value")
        self.params.observe(lambda change: self._changed("num_params", int(max(0.0, change["new"] or 0) * 1e6)), names="value")
        self.run_button.on_click(lambda _: self.run())
        c = self.controls
        self.widget = w.VBox([
            w.HTML("<b>dtrain_magic · configure the run</b>"),
            w.HBox([w.VBox([c["backend"], c["strategy"], c["zero"], c["precision"]]),
                    w.VBox([c["num_processes"], c["grad_accum"], c["use_gpu"], c["experiment"], self.params])]),
            self.memory, self.problems, self.flag_line, self.run_button, self.output,
        ])
        self.widget.add_class("dtm-configure")
        self.refresh()

    def _changed(self, name: str, value: Any) -> None:
        self.state.set(**{name: value})
        self.refresh()

    def refresh(self) -> None:
        import html

        zero = self.controls["zero"]
        zero.disabled = not self.state.zero_enabled
        zero.description = "ZeRO stage" if self.state.zero_enabled else "ZeRO (deepspeed only)"
        self.controls["precision"].options = self.state.options()["precision"]
        self.controls["precision"].value = self.state.values["precision"]
        memory = self.state.memory_line()
        self.memory.value = (f"<pre style='margin:0'>{html.escape(memory)}</pre>" if memory
                             else "<i>memory estimate unavailable (dtrain_magic.memory is not installed)</i>")
        problems = self.state.problems()
        self.problems.value = ("".join(f"<div style='color:#cf222e'>⚠ {html.escape(p)}</div>" for p in problems)
                               if problems else "<div style='color:#1a7f37'>✓ ready to run</div>")
        self.run_button.disabled = bool(problems) or self.running
        self.flag_line.value = self.state.flag_line() or "(fix the problems above to get the equivalent flag line)"

    def run(self, wait: bool = False) -> None:
        """Capture the cell, then run it in a background thread; the monitor appears under the panel."""
        from ..capture import capture
        from ..runner import execute
        from .monitor import MonitorObserver

        if self.running:
            return
        config = self.state.to_config(ui=True)
        self.output.clear_output()
        with self.output:
            print(f"running: {config.flag_line()}")
            payload, _ = capture(self.cell, self.shell.user_ns, config.fn, self.shell)
        text = _OutputWriter(self.output)
        self.observer = MonitorObserver(config, text_out=text, display=False)
        self.output.append_display_data(self.observer.container)

        def work() -> None:
            try:
                self.result = execute(config, payload, self.observer, stop=self.observer.stop_event)
                self.shell.user_ns[config.result or RESULT_NAME] = self.result
            except BaseException as exc:  # shown in the panel; the kernel goes on
                self.error = exc
                self.output.append_stderr(f"{type(exc).__name__}: {exc}\n")
            finally:
                text.flush()
                self.running = False
                self.refresh()

        self.thread = threading.Thread(target=work, name="dtrain-panel-run", daemon=True)
        self.running = True
        self.run_button.disabled = True
        self.thread.start()
        if wait:
            self.thread.join()


class _OutputWriter:
    """A text stream into an ipywidgets Output (thread-safe enough: whole lines, appended)."""

    def __init__(self, output: Any):
        self.output = output
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            if "\n" in self._buffer:
                complete, _, self._buffer = self._buffer.rpartition("\n")
                self.output.append_stdout(complete + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._buffer:
                self.output.append_stdout(self._buffer)
                self._buffer = ""


def show_panel(config: RunConfig, cell: str, shell: Any) -> None:
    """Display the configure panel for ``cell`` (called by ``%%distribute --configure``)."""
    from IPython.display import display

    panel = ConfigurePanel(config, cell, shell)
    display(panel.widget)
    shell.user_ns["_distribute_panel"] = panel
    return None
