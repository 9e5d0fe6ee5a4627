"""After a real local run, the live charts hold exactly the MLflow metric history (and so does %distribute_show)."""

from __future__ import annotations

import time

import pytest

from workloads import ended_run

pytestmark = pytest.mark.slow
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

CELL = """%%distribute --backend local -n 2 --ui
import os, time, torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ctx.prepare(model, opt)
    ctx.set_total(STEPS)
    x = torch.randn(16, 8)
    for step in range(STEPS):
        loss = model(x).pow(2).mean()
        ctx.backward(loss); ctx.step()
        ctx.log(loss=loss.item(), lr=0.05)
        time.sleep(SLEEP)
    deadline = time.monotonic() + 120
    while RELEASE and not os.path.exists(RELEASE) and time.monotonic() < deadline:
        time.sleep(0.05)  # the test says when it has seen what it needs while the run goes
    print("done on rank", ctx.rank)
    return ctx.rank
"""


def _cell(steps: int, sleep: float, release: str | None = None) -> str:
    return CELL.replace("STEPS", str(steps)).replace("SLEEP", str(sleep)).replace("RELEASE", repr(release))


def _release_when_sampled(mlflow, flag, samples: int = 2, timeout: float = 120.0):
    """Create ``flag`` once the (only) run of the test's store has ``samples`` CPU samples: the training
    then ends, however long MLflow took to open on a loaded machine (no race with the training's length)."""
    import threading

    def watch():
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                experiment = mlflow.get_experiment_by_name("dtrain_magic")
                runs = mlflow.search_runs([experiment.experiment_id]) if experiment else []
                cpu = "system/cpu_utilization_percentage"
                if runs and len(mlflow.get_metric_history(runs[0].info.run_id, cpu)) >= samples:
                    return
                time.sleep(0.2)
        finally:
            open(flag, "w").close()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _history(mlflow, run_id, key, system=False):
    hist = mlflow.get_metric_history(run_id, key)
    hist = sorted(hist, key=(lambda m: (m.timestamp, m.step)) if system else (lambda m: (m.step, m.timestamp)))
    return hist


def test_live_charts_equal_the_mlflow_history(shell, mlflow, capsys, tmp_path):
    from dtrain_magic.ui import monitor
    from dtrain_magic.ui.charts import lag_summary

    created = []
    original = monitor.MonitorObserver.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monitor.MonitorObserver.__init__ = spy
    _release_when_sampled(mlflow, str(tmp_path / "release"))
    try:
        result = shell.run(_cell(40, 0.1, str(tmp_path / "release")))
    finally:
        monitor.MonitorObserver.__init__ = original
    assert result.error_in_exec is None, result.error_in_exec
    run = result.result
    (obs,) = created
    charts = obs.wait_charts(timeout=30)
    assert charts is not None and charts.wait(timeout=30), "the poller did not stop after the run"
    assert charts.status == "FINISHED"

    # the training metrics chart: one trace per logged metric, exactly MLflow's history
    for key in ("loss", "lr"):
        hist = _history(mlflow, run.run_id, key)
        assert len(hist) == 40
        assert charts.trace_data(charts.metrics_figure, key) == ([m.step for m in hist], [m.value for m in hist])
    visible = {t.name: t.visible for t in charts.metrics_figure.data}
    perf = {name: shown for name, shown in visible.items() if name.startswith("perf/")}  # the run's own, hidden
    assert {name: shown for name, shown in visible.items() if name not in perf} == {"loss": True, "lr": "legendonly"}
    assert set(perf.values()) <= {"legendonly"}, perf

    # the system chart: CPU and RAM on this GPU-less machine, sampled about every second
    names = {t.name for t in charts.system_figure.data}
    assert names == {"CPU %", "RAM %"}, names
    start = mlflow.get_run(run.run_id).info.start_time
    cpu = _history(mlflow, run.run_id, "system/cpu_utilization_percentage", system=True)
    assert len(cpu) >= 2
    assert charts.trace_data(charts.system_figure, "CPU %") == (
        [(m.timestamp - start) / 1000 for m in cpu], [m.value for m in cpu],
    )

    # the widget shows the final state, and the plain text still reached the cell's output
    assert obs.widget.state == "finished" and obs.widget.step == 40 and obs.widget.total == 40
    assert [r["state"] for r in obs.widget.ranks] == ["done", "done"]
    assert "[rank 0] done on rank 0" in capsys.readouterr().out

    lag = lag_summary(charts.lags_s)
    print(f"chart lag (ctx.log on the worker -> chart data): {lag}, "
          f"{charts.fed_shown} points drawn before MLflow had them")
    assert lag["n"] >= 30  # most points were seen live, not only in the final read
    assert charts.fed_shown >= 1  # the channel fed the chart before MLflow's copy was read (and no point twice: above)
    # Measured in benchmarks/bench_chart_lag.py (median about 0.3 s here); this only guards against
    # a poller that stopped polling live (lag of the whole run), with room for a loaded machine.
    assert lag["median_s"] < 3.0, lag

    # %distribute_show draws the same charts from MLflow alone
    shell.run(f"%distribute_show {run.run_id}")
    shown = shell.user_ns["_distribute_charts"]
    assert shown.trace_data(shown.metrics_figure, "loss") == charts.trace_data(charts.metrics_figure, "loss")
    assert shown.trace_data(shown.system_figure, "CPU %") == charts.trace_data(charts.system_figure, "CPU %")
    assert not shown.running


def test_stop_event_stops_the_run_cleanly(shell, mlflow):
    import threading

    from dtrain_magic.errors import RunInterrupted
    from dtrain_magic.ui import monitor

    created = []
    original = monitor.MonitorObserver.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)
        # press Stop once the run has logged a few steps
        def press():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.snapshot()["step"] < 3:
                time.sleep(0.05)
            self.stop_button.click()
        threading.Thread(target=press, daemon=True).start()

    monitor.MonitorObserver.__init__ = spy
    try:
        t0 = time.monotonic()
        result = shell.run(_cell(1000, 0.05))
        elapsed = time.monotonic() - t0
    finally:
        monitor.MonitorObserver.__init__ = original
    assert isinstance(result.error_in_exec, RunInterrupted)
    (obs,) = created
    assert obs.widget.state == "stopped"
    assert elapsed < 40
    assert obs.wait_charts(timeout=30).wait(timeout=30)
    # Stopped before its MLflow run was open (the run opens beside the workers once they are past their start),
    # the run is recorded and ended in the background: not necessarily by the time the cell is back.
    assert ended_run(mlflow).info.status == "KILLED"


def test_configure_panel_runs_in_the_background(shell, mlflow):
    """Run in the --configure panel: the chosen RunConfig, launched in a background thread, result bound."""
    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.capture import payload_maker
    from dtrain_magic.ui.panel import ConfigurePanel

    cell = _cell(5, 0.01).split("\n", 1)[1]
    config = flags.config_from_line("--backend local -n 2 --result res", gpu_available=lambda: False)
    panel = ConfigurePanel(config, cell, shell, make_payload=payload_maker(cell, shell))
    panel.controls["num_processes"].value = 3
    panel.controls["grad_accum"].value = 2
    assert panel.flag_line.value == (
        "%%distribute --backend local --strategy ddp --precision fp32 -n 3 --cpu --grad-accum 2 --result res --ui"
    )
    panel.run()
    assert panel.thread is not None and panel.thread.is_alive()  # the kernel is not blocked
    panel.thread.join(timeout=120)
    assert panel.error is None, panel.error
    result = shell.user_ns["res"]
    assert result.values == [0, 1, 2] and result.config.grad_accum == 2 and result.config.num_processes == 3
    assert panel.observer.widget.state == "finished"
    assert not panel.run_button.disabled
    texts = "".join(o.get("text", "") for o in panel.output.outputs)
    assert "[rank 0] done on rank 0" in texts and "dtrain_magic: finished in" in texts  # worker output in the panel
    assert mlflow.get_run(result.run_id).data.params["num_processes"] == "3"


def test_first_points_are_charted_while_the_mlflow_run_opens(shell, mlflow, monkeypatch, tmp_path):
    """A kernel's first run opens its MLflow run seconds after the first step (MLflow's import): the live
    chart draws the values from the channel meanwhile; at the end it holds exactly MLflow's history."""
    from dtrain_magic import tracking
    from dtrain_magic.ui import monitor
    from dtrain_magic.ui.charts import Series

    release = tmp_path / "release"
    slow_start = tracking.RunTracker.start.__func__

    def start_slowly(cls, *args, **kwargs):
        # MLflow opens the run only once the live chart shows 20 points (at most 60 s): as late as a fresh
        # kernel's MLflow import on a busy machine, and without a race with the training's speed.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            charts = created[0].charts if created else None
            if charts is not None and len(charts.metrics.get("loss", Series()).x) >= 20:
                break
            time.sleep(0.05)
        return slow_start(cls, *args, **kwargs)

    monkeypatch.setattr(tracking.RunTracker, "start", classmethod(start_slowly))
    seen_at_open = {}
    created = []
    original_init, original_started = monitor.MonitorObserver.__init__, monitor.MonitorObserver.started

    def spy_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(self)

    def spy_started(self, *args, **kwargs):
        charts = self.charts
        seen_at_open["points"] = len(charts.metrics["loss"].x) if charts is not None and "loss" in charts.metrics else 0
        seen_at_open["step"] = self.snapshot()["step"]
        release.touch()  # the training may end now
        return original_started(self, *args, **kwargs)

    monkeypatch.setattr(monitor.MonitorObserver, "__init__", spy_init)
    monkeypatch.setattr(monitor.MonitorObserver, "started", spy_started)
    result = shell.run(_cell(30, 0.05, str(release)))
    assert result.error_in_exec is None, result.error_in_exec
    (obs,) = created
    charts = obs.wait_charts(timeout=30)
    assert charts is not None and charts.wait(timeout=30)
    # the chart showed the workers' values before the run opened (the old flow drew nothing until then)
    assert seen_at_open["points"] >= 20 and seen_at_open["step"] >= 20, seen_at_open
    hist = _history(mlflow, result.result.run_id, "loss")
    assert len(hist) == 30  # none lost on the way to MLflow
    # none twice
    assert charts.trace_data(charts.metrics_figure, "loss") == ([m.step for m in hist], [m.value for m in hist])


def test_configure_panel_shows_the_monitor_stops_and_runs_again(shell, mlflow):
    """Run in the panel: the monitor (with its live charts) is part of the panel's own widgets; Stop ends
    the run as KILLED; Run works again after it."""
    from dtrain_magic.errors import RunInterrupted
    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.capture import payload_maker
    from dtrain_magic.ui.panel import ConfigurePanel

    config = flags.config_from_line("--backend local -n 2", gpu_available=lambda: False)
    cell = _cell(1000, 0.05).split("\n", 1)[1]
    panel = ConfigurePanel(config, cell, shell, make_payload=payload_maker(cell, shell))
    panel.run()
    obs = panel.observer
    assert panel.monitor_box.children == (obs.container,)  # a child of the panel, not display data in an Output
    charts = obs.wait_charts(timeout=60)
    assert charts is not None and obs.live.box.children == (charts.widget,)
    deadline = time.monotonic() + 120
    counts = []
    while time.monotonic() < deadline and (len(counts) < 2 or counts[-1] <= counts[0]):
        points = len(charts.metrics["loss"].x) if "loss" in charts.metrics else 0
        if points and (not counts or points != counts[-1]):
            counts.append(points)
        time.sleep(0.2)
    assert len(counts) >= 2 and counts[-1] > counts[0], f"the loss chart did not grow while training: {counts}"
    assert panel.thread.is_alive() and obs.widget.state == "running"
    obs.stop_button.click()
    panel.thread.join(timeout=60)
    assert not panel.thread.is_alive()
    assert isinstance(panel.error, RunInterrupted)
    assert obs.widget.state == "stopped" and obs.stop_button.description == "Stopped"
    run_id = obs.widget.run_id
    assert charts.wait(timeout=30) and mlflow.get_run(run_id).info.status == "KILLED"
    assert not panel.run_button.disabled  # the panel can run again

    panel.cell = _cell(5, 0.01).split("\n", 1)[1]
    panel.make_payload = payload_maker(panel.cell, shell)  # Run captures through it: the short cell, not 1000 steps
    panel.run(wait=True)
    assert panel.error is None, panel.error
    assert panel.observer is not obs and panel.monitor_box.children == (panel.observer.container,)
    assert panel.observer.widget.state == "finished" and panel.observer.stop_button.description == "Finished"
    assert shell.user_ns["_distribute_result"].values == [0, 1]
    assert len(mlflow.get_metric_history(panel.observer.widget.run_id, "loss")) == 5  # the new cell ran


SWEEP_BODY = """import torch

def train(ctx):
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    model = torch.nn.Linear(1, 1)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=ctx.params["lr"]))
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
"""


def test_configure_panel_runs_a_sweep_from_its_sweep_box(shell, mlflow):
    """The panel's sweep box (issue #36): its space and metric make the equivalent line's --sweep words; Run sweep
    runs the trials with the panel's settings, the sweep's panel under the configure panel, the results bound as the
    magic binds them; a bad space is said in the box and runs nothing."""
    from dtrain_magic.errors import ConfigError
    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.capture import payload_maker
    from dtrain_magic.ui.panel import ConfigurePanel

    config = flags.config_from_line("--backend local -n 2 --cpu --seed 0 --result swept", gpu_available=lambda: False)
    panel = ConfigurePanel(config, SWEEP_BODY, shell, make_payload=payload_maker(SWEEP_BODY, shell))
    box = panel.sweep_box
    assert box.button.disabled  # no space yet
    box.space.value, box.metric.value = "lr=grid(0.5,0.05)", "loss"
    assert not box.button.disabled
    assert panel.equivalent_line().endswith(" --sweep 'lr=grid(0.5,0.05)' --metric loss")
    assert panel.writer.text.startswith(panel.equivalent_line() + "\n")

    panel.run_sweep(wait=True)
    assert panel.error is None, panel.error
    result = shell.user_ns["swept"]
    assert result is panel.result and result.best.params == {"lr": 0.5}
    assert shell.user_ns["_distribute_result"] is result.best.result
    assert result.best.result.config.num_processes == 2 and len(result.trials) == 2
    (sweep_panel,) = panel.monitor_box.children
    assert "dtm-sweep-panel" in sweep_panel._dom_classes  # the sweep's panel, a child of the configure panel
    assert mlflow.get_run(result.parent_run_id).info.status == "FINISHED"

    box.space.value = "lr=banana(1)"
    panel.run_sweep(wait=True)
    assert isinstance(panel.error, ConfigError) and "--sweep" in box.problem.value and "banana" in box.problem.value
    assert panel.result is result  # nothing ran
