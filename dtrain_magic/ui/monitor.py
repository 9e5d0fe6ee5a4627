"""The live panel of a ``--ui`` run: `MonitorObserver` (a `RunObserver`) and `MonitorWidget` (anywidget).

What it shows: the plan and the MLflow run id and link, per-rank status (starting, running, done,
failed) with each rank's steps/s and CPU use and a straggler flag, a progress bar with step, steps/s and
ETA once the function calls ``ctx.set_total(steps)``, where each ``ctx.data`` loader of rank 0 is in its
epoch (batches read of the epoch's), throughput (samples/s, tokens/s, model FLOP/s, MFU), the latest
metrics, a tail of the workers' output (all ranks, or one rank: the tabs above it), a Stop button, a Stacks
button (every rank's Python stack now, within 2 s, shown under the log; a stall shows there too), and the
live charts (training metrics, system, and the world size of a run that was relaunched:
`charts.RunCharts`: fed each metric as it arrives, merged with the MLflow run's history by a
background poller once the run is open; made at the first metric, in a background thread, after
plotly's first import).

Headless kernels: nbclient (and any ZMQ kernel without a widget manager) gets ``config.ui = True`` too,
and nothing tells the kernel whether a front-end will render widgets. So the observer does both: it
displays the panel *and* forwards everything to a plain `TextObserver`, which prints the rank-prefixed
worker output and a progress line every few seconds into the cell's output, exactly as ``--no-ui``
does. Without a front-end nothing waits on the widgets (they only send messages), and the text is there.

Threads: the observer's callbacks run in the driver loop (the cell's thread, or the panel's background
thread); they only update Python-side state. A small flusher thread pushes that state to the widget at
most every ``flush_s`` (0.2 s), so a chatty run does not flood the front-end with comm messages.

Stop: ``stop_event`` is the `threading.Event` given to ``PreparedRun.execute(..., stop=...)``; the driver loop
checks it every 50 ms, cancels every worker and raises ``RunInterrupted``. While a cell blocks the
kernel, the button's messages are routed to a kernel subshell thread (see `_kernel`) so the click is
seen during the run. The Stacks button's click is routed the same way; it collects the stacks in a thread
of its own (`driver.runner.stacks_of_live_runs`), so the driver loop is never held up.
"""

from __future__ import annotations

import html
import threading
import time
from collections import deque
from typing import Any, TextIO

import anywidget
import ipywidgets as w
import traitlets

from ..config import RunConfig
from ..driver.observer import RunObserver, TextObserver, plan_with_backend, prefix_lines
from ..errors import log_dropped
from . import _kernel
from .live_charts import LiveCharts

LOG_TAIL = 200
RANK_LOG_TAIL = 40  # lines kept per rank for the rank tabs (what the front-end shows: js/monitor.js LOG_LINES)


def esm_source() -> str:
    """The widget's front-end, ``dtrain_magic/js/monitor.js`` (a link to the repo's ``js/monitor.js``; wheels
    get the file itself)."""
    from importlib.resources import files

    return (files("dtrain_magic") / "js" / "monitor.js").read_text(encoding="utf-8")


def run_link_html(run_id: str, link: str) -> str:
    """The MLflow run beside the Stop button: a link to the server's run page for an http(s) tracking
    server, else the run id (the store's path and ``mlflow ui`` command are in the panel above)."""
    if link.startswith(("http://", "https://")):
        url = html.escape(link, quote=True)
        return f'<a href="{url}" target="_blank" rel="noopener noreferrer">MLflow run {html.escape(run_id)}</a>'
    return f"<code>MLflow run {html.escape(run_id)}</code>"


class MonitorWidget(anywidget.AnyWidget):
    """Status table, progress bar and log tail; drawn by ``js/monitor.js``."""

    _esm = traitlets.Unicode(esm_source()).tag(sync=True)
    state = traitlets.Unicode("starting").tag(sync=True)
    plan = traitlets.Unicode("").tag(sync=True)
    run_id = traitlets.Unicode("").tag(sync=True)
    link = traitlets.Unicode("").tag(sync=True)
    ranks = traitlets.List(traitlets.Dict()).tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)
    total = traitlets.Int(0).tag(sync=True)
    rate = traitlets.Float(0.0).tag(sync=True)
    eta = traitlets.Float(-1.0).tag(sync=True)
    elapsed = traitlets.Float(0.0).tag(sync=True)
    metrics = traitlets.Dict().tag(sync=True)
    log = traitlets.List(traitlets.Unicode()).tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    held = traitlets.Unicode("").tag(sync=True)  # the next run's workers waiting (Spark, Ray): where, until when
    rank_logs = traitlets.Dict().tag(sync=True)  # rank (as text) → its last lines, without the [rank N] prefix
    perf = traitlets.Unicode("").tag(sync=True)  # samples/s · tokens/s · FLOP/s · MFU, or why not
    stacks = traitlets.Unicode("").tag(sync=True)  # where every rank is: a title line, then the stacks
    data = traitlets.Dict().tag(sync=True)  # rank 0's ctx.data loaders: {name: {epoch, batch, batches}}


class MonitorObserver(RunObserver):
    """Panel + plain text for one run. ``text_out``: where the plain text goes (default: the cell's stdout)."""

    def __init__(
        self,
        config: RunConfig,
        text_out: TextIO | None = None,
        display: bool = True,
        charts: bool = True,
        flush_s: float = 0.2,
        poll_s: float = 0.5,
    ):
        self.config = config
        self.stop_event = threading.Event()
        self.text = TextObserver(out=text_out, err=text_out)
        self.widget = MonitorWidget(ranks=[{"rank": r, "state": "starting", "detail": ""}
                                           for r in range(config.num_processes)])
        self.widget.add_class("dtm-monitor-widget")
        self._make_buttons()
        self._want_charts = charts
        self.live = LiveCharts(w.Box([]), poll_s)
        self.container = w.VBox([self.widget, w.HBox([self.stop_button, self.stacks_button, self.link_html]),
                                 self.live.box])
        self.container.add_class("dtm-monitor-panel")
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"state": "starting",
                                       "ranks": {r: ("starting", "") for r in range(config.num_processes)},
                                       "step": 0, "total": 0, "metrics": {}, "message": "", "data": {}}
        self._log: deque[str] = deque(maxlen=LOG_TAIL)
        self._rank_logs: dict[int, deque[str]] = {}
        self._pending: dict[tuple[int, str], str] = {}
        self._t0 = time.monotonic()
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._flush_s = flush_s
        self._flusher = threading.Thread(target=self._flush_loop, name="dtrain-monitor-flush", daemon=True)
        self._flusher.start()
        self.routed = _kernel.route_to_subshell(self.stop_button)
        _kernel.route_to_subshell(self.stacks_button)
        self._stacks_thread: threading.Thread | None = None
        if display:
            from IPython.display import display as show

            show(self.container)

    def _make_buttons(self) -> None:
        """Stop, Stacks and the MLflow run's link beside them."""
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="Stop every worker (the cell raises RunInterrupted)")
        self.stop_button.add_class("dtm-stop")
        self.stop_button.on_click(lambda _: self.request_stop())
        self.stacks_button = w.Button(description="Stacks", icon="list",
                                      tooltip="Show where every rank is now (its Python stack)")
        self.stacks_button.add_class("dtm-stacks")
        self.stacks_button.on_click(lambda _: self.request_stacks())
        self.link_html = w.HTML("")

    @property
    def charts(self) -> Any:
        """The live charts (`charts.RunCharts`) once made, else None; see `wait_charts`."""
        return self.live.charts

    # -- RunObserver -----------------------------------------------------------------------------
    def launched(self, config: RunConfig, plan: str) -> None:
        """The workers are starting (the MLflow run may open later): the panel says what runs where."""
        self._t0 = time.monotonic()
        with self._lock:
            self._state.update(state="running", plan=plan_with_backend(plan, config))
        self._dirty.set()

    def started(self, config: RunConfig, run_id: str, link: str, plan: str) -> None:
        self.text.started(config, run_id, link, plan)
        with self._lock:
            if self._state["state"] == "starting":  # a runner that does not call `launched`
                self._t0 = time.monotonic()
            self._state.update(state="running", run_id=run_id, link=link, plan=plan_with_backend(plan, config))
        self.link_html.value = run_link_html(run_id, link)
        if self._want_charts:
            self.link_html.value += self.live.attach(config, run_id)
        self._dirty.set()

    def output(self, rank: int, stream: str, text: str) -> None:
        self.text.output(rank, stream, text)
        with self._lock:
            key = (rank, stream)
            lines, self._pending[key] = prefix_lines(rank, text, self._pending.get(key, ""))
            if lines:
                new = lines.rstrip("\n").split("\n")
                self._log.extend(new)
                if rank is not None:
                    tag = len(f"[rank {rank}] ")
                    self._rank_logs.setdefault(rank, deque(maxlen=RANK_LOG_TAIL)).extend(line[tag:] for line in new)
                self._dirty.set()

    def metric(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        self.text.metric(step, metrics)
        with self._lock:
            self._state["step"] = max(self._state["step"], step + 1)
            self._state["metrics"] = {**self._state["metrics"], **metrics}
        self._dirty.set()
        # The live chart gets the value now, even while the MLflow run is still opening; MLflow's
        # history replaces it once the tracker has written it (see `charts.RunCharts`).
        if self._want_charts:
            self.live.feed(step, metrics, timestamp_ms)

    def status(self, rank: int, state: str, detail: str) -> None:
        self.text.status(rank, state, detail)
        with self._lock:
            self._state["ranks"][rank] = (state, detail)
        self._dirty.set()

    def total(self, steps: int) -> None:
        self.text.total(steps)
        with self._lock:
            self._state["total"] = int(steps)
        self._dirty.set()

    def data_progress(self, name: str, epoch: int, batch: int, batches: int) -> None:
        """Rank 0's ``ctx.data`` loader: the panel shows the batches of the epoch read so far."""
        self.text.data_progress(name, epoch, batch, batches)
        with self._lock:
            self._state["data"] = {**self._state["data"], name: {"epoch": epoch, "batch": batch, "batches": batches}}
        self._dirty.set()

    def note(self, text: str) -> None:
        """The notebook's own line (staging the data): in the cell's text and the panel's log."""
        self.text.note(text)
        with self._lock:
            self._log.append(f"dtrain_magic: {text}")
        self._dirty.set()

    def finished(self, result: Any, error: BaseException | None) -> None:
        self.text.finished(result, error)
        with self._lock:
            self._keep_partial_lines()
            self._record_outcome(error)
            self._state["elapsed"] = time.monotonic() - self._t0
        self._show_outcome_on_buttons()
        self._closed.set()
        charts_starting = self.live.mark_ended()
        self._dirty.set()
        self._flush()
        self.live.finish(charts_starting)

    def _keep_partial_lines(self) -> None:
        """The last unterminated line of each rank's stream goes to the log as it is."""
        for (rank, _), rest in self._pending.items():
            if rest:
                self._log.append(f"[rank {rank}] {rest}")
                if rank is not None:
                    self._rank_logs.setdefault(rank, deque(maxlen=RANK_LOG_TAIL)).append(rest)
        self._pending.clear()

    def _record_outcome(self, error: BaseException | None) -> None:
        """finished (every rank still going is done), stopped or failed (with the error's first line)."""
        if error is None:
            self._state["state"] = "finished"
            ranks = self._state["ranks"]
            for rank, (state, detail) in list(ranks.items()):
                if state in ("starting", "running"):
                    ranks[rank] = ("done", detail)
        else:
            stopped = self.stop_event.is_set() or type(error).__name__ == "RunInterrupted"
            self._state["state"] = "stopped" if stopped else "failed"
            self._state["message"] = str(error).splitlines()[0] if str(error) else type(error).__name__

    def _show_outcome_on_buttons(self) -> None:
        self.stop_button.disabled = True
        self.stacks_button.disabled = True
        # The button now says how the run ended, in the colour of the status line (not a red "Done").
        outcome = self._state["state"]
        label, icon, style = {"finished": ("Finished", "check", "success"),
                              "stopped": ("Stopped", "stop", "warning")}.get(outcome, ("Failed", "times", "danger"))
        self.stop_button.description, self.stop_button.icon, self.stop_button.button_style = label, icon, style
        self.stop_button.tooltip = f"the run {outcome}"

    def perf(self, snapshot: Any) -> None:
        self.text.perf(snapshot)
        with self._lock:
            self._state["perf"] = " · ".join(part for part in (snapshot.line(), snapshot.note) if part)
            self._state["rank_perf"] = (dict(snapshot.steps_per_s), dict(snapshot.cpu_cores), set(snapshot.stragglers))
        self._dirty.set()

    def stacks(self, title: str, text: str) -> None:
        """A stall: every rank's stack, in the panel (and the cell's text)."""
        self.text.stacks(title, text)
        self._show_stacks(title, text)

    def _show_stacks(self, title: str, text: str) -> None:
        with self._lock:
            self._state["stacks"] = f"{title}\n\n{text}"
        self._dirty.set()

    def request_stacks(self) -> None:
        """What the Stacks button does: collect every rank's stack in a thread of its own and show it."""
        if self._stacks_thread is not None and self._stacks_thread.is_alive():
            return
        self._show_stacks("collecting every rank's stack…", "")

        def collect() -> None:
            from ..driver.runner import stacks_of_live_runs

            try:
                found = stacks_of_live_runs(observer=self)
            except Exception as exc:  # shown, never raised into the kernel
                found = [(f"could not collect the stacks: {type(exc).__name__}: {exc}", "")]
            title, text = found[0] if found else ("the run is not in progress: no stacks to show", "")
            self._show_stacks(title, text)
            self._flush()

        self._stacks_thread = threading.Thread(target=collect, name="dtrain-stacks", daemon=True)
        self._stacks_thread.start()

    def held(self, text: str) -> None:
        """After the run: the next run's workers wait (Spark, Ray); the panel says what, where, until when."""
        self.text.held(text)
        with self._lock:
            self._state["held"] = text
        self._flush()  # the flusher stopped at `finished`

    # -- Stop --------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """What the Stop button does: ask the driver loop to cancel every worker."""
        self.stop_event.set()
        with self._lock:
            self._state["message"] = "stopping: cancelling every worker…"
        self._dirty.set()

    # -- internals -------------------------------------------------------------------------------
    def wait_charts(self, timeout: float | None = None) -> Any:
        """Wait until the live charts exist (or failed); the `charts.RunCharts`, or None."""
        return self.live.wait(timeout)

    def snapshot(self) -> dict[str, Any]:
        """The state the widget shows, as plain data (used by the flusher and by tests)."""
        with self._lock:
            s = self._state
            elapsed = (s.get("elapsed", time.monotonic() - self._t0) if s["state"] != "running"
                       else time.monotonic() - self._t0)
            step, total = s["step"], s["total"]
            rate = step / elapsed if elapsed > 0 and step else 0.0
            return dict(
                state=s["state"], plan=s.get("plan", ""), run_id=s.get("run_id", ""), link=s.get("link", ""),
                ranks=_rank_rows(s), step=step, total=total, rate=rate, eta=_eta(step, total, rate), elapsed=elapsed,
                metrics=dict(s["metrics"]), log=list(self._log), message=s["message"], held=s.get("held", ""),
                rank_logs={str(r): list(lines) for r, lines in sorted(self._rank_logs.items())},
                perf=s.get("perf", ""), stacks=s.get("stacks", ""),
                data={name: dict(where) for name, where in s["data"].items()},
            )

    def _flush(self) -> None:
        snap = self.snapshot()
        with self.widget.hold_sync():
            for key, value in snap.items():
                if getattr(self.widget, key) != value:
                    setattr(self.widget, key, value)

    def _flush_loop(self) -> None:
        while True:
            self._dirty.wait(timeout=1.0)  # at least once a second: elapsed time and ETA move on
            if self._closed.is_set() and not self._dirty.is_set():
                return
            self._dirty.clear()
            try:
                self._flush()
            except Exception as exc:  # a thread with nobody to tell: the next flush sends the whole state again
                log_dropped(__name__, "_flush_loop", exc)
            if self._closed.is_set():
                return
            time.sleep(self._flush_s)


def _eta(step: int, total: int, rate: float) -> float:
    """Seconds left at ``rate`` steps/s (0 once every step is done; -1 while unknown)."""
    if total and rate > 0 and step < total:
        return (total - step) / rate
    return 0.0 if total and step >= total else -1.0


def _rank_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The status table's rows: each rank's state and detail, with its steps/s, CPU and straggler flag once known."""
    rates, cpus, stragglers = state.get("rank_perf", ({}, {}, set()))
    rows = []
    for r, (st, d) in sorted(state["ranks"].items()):
        row = {"rank": r, "state": st, "detail": d}
        if r in rates:
            row.update(rate=round(rates[r], 3), cpu=round(cpus.get(r, 0.0), 2), straggler=r in stragglers)
        rows.append(row)
    return rows
