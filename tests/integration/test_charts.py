"""After a real local run, the live charts hold exactly the MLflow metric history (and so does %distribute_show)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

CELL = """%%distribute --backend local -n 2 --ui
import time, torch
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
    print("done on rank", ctx.rank)
    return ctx.rank
"""


def _history(mlflow, run_id, key, system=False):
    hist = mlflow.get_metric_history(run_id, key)
    hist = sorted(hist, key=(lambda m: (m.timestamp, m.step)) if system else (lambda m: (m.step, m.timestamp)))
    return hist


def test_live_charts_equal_the_mlflow_history(shell, mlflow, capsys):
    from dtrain_magic.ui import monitor
    from dtrain_magic.ui.charts import lag_summary

    created = []
    original = monitor.MonitorObserver.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monitor.MonitorObserver.__init__ = spy
    try:
        result = shell.run(CELL.replace("STEPS", "40").replace("SLEEP", "0.1"))
    finally:
        monitor.MonitorObserver.__init__ = original
    assert result.error_in_exec is None, result.error_in_exec
    run = result.result
    (obs,) = created
    charts = obs.charts
    assert charts is not None and charts.wait(timeout=30), "the poller did not stop after the run"
    assert charts.status == "FINISHED"

    # the training metrics chart: one trace per logged metric, exactly MLflow's history
    for key in ("loss", "lr"):
        hist = _history(mlflow, run.run_id, key)
        assert len(hist) == 40
        assert charts.trace_data(charts.metrics_figure, key) == ([m.step for m in hist], [m.value for m in hist])
    visible = {t.name: t.visible for t in charts.metrics_figure.data}
    assert visible == {"loss": True, "lr": "legendonly"}

    # the system chart: CPU and RAM on this GPU-less machine, sampled about every second
    names = {t.name for t in charts.system_figure.data}
    assert names == {"CPU %", "RAM %"}, names
    start = mlflow.get_run(run.run_id).info.start_time
    cpu = _history(mlflow, run.run_id, "system/cpu_utilization_percentage", system=True)
    assert len(cpu) >= 2
    assert charts.trace_data(charts.system_figure, "CPU %") == ([(m.timestamp - start) / 1000 for m in cpu], [m.value for m in cpu])

    # the widget shows the final state, and the plain text still reached the cell's output
    assert obs.widget.state == "finished" and obs.widget.step == 40 and obs.widget.total == 40
    assert [r["state"] for r in obs.widget.ranks] == ["done", "done"]
    assert "[rank 0] done on rank 0" in capsys.readouterr().out

    lag = lag_summary(charts.lags_s)
    print(f"chart lag (ctx.log on the worker -> chart data): {lag}")
    assert lag["n"] >= 30  # most points were seen live, not only in the final read
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
        result = shell.run(CELL.replace("STEPS", "1000").replace("SLEEP", "0.05"))
        elapsed = time.monotonic() - t0
    finally:
        monitor.MonitorObserver.__init__ = original
    assert isinstance(result.error_in_exec, RunInterrupted)
    (obs,) = created
    assert obs.widget.state == "stopped"
    assert elapsed < 40
    assert obs.charts.wait(timeout=30)
    assert mlflow.get_run(obs.widget.run_id).info.status == "KILLED"


def test_configure_panel_runs_in_the_background(shell, mlflow):
    """Run in the --configure panel: the chosen RunConfig, launched in a background thread, result bound."""
    from dtrain_magic import flags
    from dtrain_magic.ui.panel import ConfigurePanel

    cell = CELL.split("\n", 1)[1].replace("STEPS", "5").replace("SLEEP", "0.01")
    config = flags.config_from_line("--backend local -n 2 --result res", gpu_available=lambda: False)
    panel = ConfigurePanel(config, cell, shell)
    panel.controls["num_processes"].value = 3
    panel.controls["grad_accum"].value = 2
    assert panel.flag_line.value == "%%distribute --backend local --strategy ddp --precision fp32 -n 3 --cpu --grad-accum 2 --result res --ui"
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
