"""MonitorObserver without a run: the widget's state follows the observer callbacks; Stop sets the event."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("anywidget")
from dtrain_magic.config import RunConfig  # noqa: E402
from dtrain_magic.errors import RunInterrupted  # noqa: E402
from dtrain_magic.ui.charts import default_metric, lag_summary, system_series  # noqa: E402
from dtrain_magic.ui.monitor import MonitorObserver, esm_source  # noqa: E402


def make() -> tuple[MonitorObserver, io.StringIO]:
    out = io.StringIO()
    return MonitorObserver(RunConfig(num_processes=2), text_out=out, display=False, charts=False), out


def test_callbacks_drive_the_widget_and_the_text():
    obs, out = make()
    obs.started(obs.config, "run123", "sqlite:///x.db (run run123)", "2 local processes")
    obs.status(0, "running", "")
    obs.total(10)
    obs.output(0, "stdout", "hello\nwor")
    for step in range(4):
        obs.metric(step, {"loss": 1.0 / (step + 1)})
    obs._flush()
    w = obs.widget
    assert (w.state, w.run_id, w.step, w.total) == ("running", "run123", 4, 10)
    assert w.ranks[0] == {"rank": 0, "state": "running", "detail": ""} and w.ranks[1]["state"] == "starting"
    assert w.log == ["[rank 0] hello"] and w.metrics == {"loss": 0.25}
    assert w.rate > 0 and w.eta >= 0
    obs.finished(None, None)
    assert w.state == "finished" and [r["state"] for r in w.ranks] == ["done", "done"]
    assert w.log[-1] == "[rank 0] wor"
    text = out.getvalue()
    assert "MLflow run run123" in text and "[rank 0] hello" in text  # plain text keeps going to the cell


def test_stop_button_sets_the_event_and_the_state_says_stopped():
    obs, _ = make()
    obs.started(obs.config, "r", "", "plan")
    obs.stop_button.click()
    assert obs.stop_event.is_set()
    obs.finished(None, RunInterrupted("the run was stopped from the panel; every worker was stopped"))
    assert obs.widget.state == "stopped" and obs.stop_button.disabled
    assert "stopped from the panel" in obs.widget.message


def test_the_next_runs_waiting_workers_show_after_the_run_in_the_panel_and_the_text():
    obs, out = make()
    obs.started(obs.config, "r", "", "plan")
    obs.finished(None, None)
    assert obs.widget.held == ""
    obs.held("2 TorchDistributor worker(s) (CPU, local mode: on this machine) wait for the next run until 12:10:00")
    assert "wait for the next run until 12:10:00" in obs.widget.held  # flushed at once: the flusher has stopped
    assert "dtrain_magic: 2 TorchDistributor worker(s)" in out.getvalue().splitlines()[-1]


def test_failed_run_shows_the_error():
    obs, _ = make()
    obs.status(1, "failed", "ValueError: boom")
    obs.finished(None, RuntimeError("rank 1 failed: ValueError: boom"))
    assert obs.widget.state == "failed" and (
        obs.widget.ranks[1] == {"rank": 1, "state": "failed", "detail": "ValueError: boom"})


def test_the_widget_loads_the_packaged_front_end():
    source = esm_source()
    assert "export default { render }" in source


def test_system_series_prefers_gpus_and_falls_back_to_cpu_ram():
    cpu = ["system/cpu_utilization_percentage", "system/system_memory_usage_percentage", "system/disk_usage_percentage"]
    assert system_series(cpu) == {"system/cpu_utilization_percentage": "CPU %",
                                  "system/system_memory_usage_percentage": "RAM %"}
    gpu = cpu + ["system/gpu_0_utilization_percentage", "system/gpu_1_memory_usage_percentage"]
    assert system_series(gpu) == {"system/gpu_0_utilization_percentage": "GPU 0 util %",
                                  "system/gpu_1_memory_usage_percentage": "GPU 1 memory %"}
    assert system_series(["system/node1/cpu_utilization_percentage"]) == {
        "system/node1/cpu_utilization_percentage": "node1 CPU %"}


def test_default_metric_and_lag_summary():
    assert default_metric(["acc", "train_loss", "lr"]) == "train_loss"
    assert default_metric(["acc", "loss"]) == "loss"
    assert default_metric([]) is None
    assert lag_summary([0.1, 0.2, 0.3])["median_s"] == 0.2


def test_run_link_is_clickable_for_a_tracking_server_only():
    from dtrain_magic.ui.monitor import run_link_html

    page = "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    html = run_link_html("abc", page)
    assert f'href="{page}"' in html and 'target="_blank"' in html and "MLflow run abc" in html
    assert run_link_html("abc", "sqlite:///x.db (run abc)") == "<code>MLflow run abc</code>"
    assert "<script>" not in run_link_html("<script>", 'http://h/"onmouseover="x')


# -- live charts: fed from the channel, MLflow the record --------------------------------------------

class _Metric:
    def __init__(self, key, value, timestamp, step):
        self.key, self.value, self.timestamp, self.step = key, value, timestamp, step


class _Store:
    """An MLflow client's two reads the charts use, over an in-memory run (pure logic, no MLflow)."""

    def __init__(self):
        self.history: dict[str, list[_Metric]] = {}
        self.status = "RUNNING"

    def log(self, key, step, value, stamp):
        self.history.setdefault(key, []).append(_Metric(key, value, stamp, step))

    def get_run(self, run_id):
        from types import SimpleNamespace

        metrics = {k: v[-1].value for k, v in self.history.items()}
        return SimpleNamespace(info=SimpleNamespace(status=self.status, start_time=1000),
                               data=SimpleNamespace(metrics=metrics))

    def get_metric_history(self, run_id, key):
        return list(self.history.get(key, []))


def _charts():
    pytest.importorskip("plotly")
    from dtrain_magic.ui.charts import RunCharts

    return RunCharts(None, None, interval_s=0.05)


def test_fed_points_are_drawn_before_mlflow_and_shown_once():
    charts = _charts()
    charts._live = True
    for step in range(3):
        charts.feed(step, {"loss": 1.0 / (step + 1)}, timestamp_ms=10_000 + step)
    assert charts.poll_once()  # no MLflow run yet: the fed points alone
    assert charts.trace_data(charts.metrics_figure, "loss") == ([0, 1, 2], [1.0, 0.5, 1 / 3])
    assert charts.fed_shown == 3 and len(charts.lags_s) == 3
    store = _Store()
    charts.attach(store, "run1")
    store.log("loss", 0, 1.0, 10_000)  # the tracker wrote the first two; the third is still queued
    store.log("loss", 1, 0.5, 10_001)
    charts.feed(3, {"loss": 0.25}, timestamp_ms=10_003)
    charts.poll_once()
    assert charts.trace_data(charts.metrics_figure, "loss") == ([0, 1, 2, 3], [1.0, 0.5, 1 / 3, 0.25])  # none twice
    assert len(charts.lags_s) == 4  # each point's lag counted once, when it first reached the chart
    store.log("loss", 2, 1 / 3, 10_002)
    store.log("loss", 3, 0.25, 10_003)
    charts.poll_once()
    assert charts.trace_data(charts.metrics_figure, "loss") == ([0, 1, 2, 3], [1.0, 0.5, 1 / 3, 0.25])
    assert charts.training.unrecorded("loss") == []  # everything fed is in MLflow now
    # a fed value that never reached MLflow is not in the final chart: MLflow is the record
    charts.feed(4, {"loss": 0.2}, timestamp_ms=10_004)
    charts.poll_once()
    assert charts.trace_data(charts.metrics_figure, "loss")[0] == [0, 1, 2, 3, 4]
    store.status = "KILLED"
    charts.poll_once()
    assert charts.trace_data(charts.metrics_figure, "loss") == ([0, 1, 2, 3], [1.0, 0.5, 1 / 3, 0.25])


def test_loss_spanning_decades_switches_to_log_y_and_the_toggle_overrides():
    from dtrain_magic.ui.charts import wants_log_y

    assert wants_log_y([1.0, 1e-6]) and not wants_log_y([1.0, 0.5]) and not wants_log_y([1.0, -1.0, 1e-6])
    charts = _charts()
    _ = charts.widget  # the toggle exists once the widget is built
    for step in range(40):
        charts.feed(step, {"loss": 10.0 ** (-step / 6)}, timestamp_ms=1 + step)
        if step == 10:
            charts.poll_once()
            assert charts.metrics_figure.layout.yaxis.type == "linear"  # 1 .. 0.02: linear is fine
    charts.poll_once()
    assert charts.metrics_figure.layout.yaxis.type == "log"  # 1 .. 2e-7: a flat line on a linear axis
    charts._scale_control.value = "linear"
    assert charts.y_scale == "linear" and charts.metrics_figure.layout.yaxis.type == "linear"
    charts.set_y_scale("log")
    assert charts._scale_control.value == "log" and charts.metrics_figure.layout.yaxis.type == "log"
    with pytest.raises(ValueError):
        charts.set_y_scale("symlog")


def test_system_chart_has_one_line_per_gpu_per_node():
    keys = [f"system/{node}/gpu_{dev}_{kind}_percentage" for node in ("node-a", "node-b") for dev in (0, 1)
            for kind in ("utilization", "memory_usage")] + ["system/node-a/cpu_utilization_percentage"]
    names = system_series(keys)
    assert len(names) == 8 and "system/node-a/cpu_utilization_percentage" not in names
    assert names["system/node-b/gpu_1_utilization_percentage"] == "node-b GPU 1 util %"
    assert names["system/node-a/gpu_0_memory_usage_percentage"] == "node-a GPU 0 memory %"


def test_the_plan_names_the_backend_in_use_and_the_finished_button_is_not_a_red_done():
    from dtrain_magic.driver.observer import plan_with_backend

    plan = "2 local process(es) on this machine (CPU, 127.0.0.1)"
    assert plan_with_backend(plan, RunConfig()) == f"{plan}, gloo process group"
    assert "nccl process group" in plan_with_backend(plan, RunConfig(use_gpu=True))
    obs, _ = make()
    obs.launched(obs.config, plan)
    obs._flush()
    assert obs.widget.state == "running" and obs.widget.plan.endswith("(CPU, 127.0.0.1), gloo process group")
    obs.finished(None, None)
    assert (obs.stop_button.description, obs.stop_button.button_style) == ("Finished", "success")
    failed, _ = make()
    failed.finished(None, RuntimeError("boom"))
    assert (failed.stop_button.description, failed.stop_button.button_style) == ("Failed", "danger")


def test_metrics_before_the_charts_exist_are_fed_to_them():
    pytest.importorskip("plotly")
    out = io.StringIO()
    obs = MonitorObserver(RunConfig(num_processes=2), text_out=out, display=False, poll_s=0.05)
    obs.launched(obs.config, "plan")
    for step in range(5):
        obs.metric(step, {"loss": 1.0 + step}, timestamp_ms=5_000 + step)
    charts = obs.wait_charts(timeout=60)
    assert charts is not None
    obs.finished(None, None)
    assert charts.wait(timeout=10)  # no MLflow run: stops after one last draw of what was fed
    assert charts.trace_data(charts.metrics_figure, "loss") == ([0, 1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0, 5.0])


def test_charts_show_plotly_bundles_redrawn_at_most_every_redraw_s_and_the_chosen_metric_stays():
    """What the front-end gets is plotly's MIME bundle in an Output (no FigureWidget: a saved notebook keeps the
    figure, not plotly's JavaScript); while the run goes it is redrawn at most every ``redraw_s``, at once on the
    user's choice of metric, and that choice survives every later redraw."""
    from dtrain_magic.ui.charts import PLOTLY_MIME

    charts = _charts()
    charts.redraw_s, charts._live = 3600.0, True
    charts.feed(0, {"loss": 1.0, "lr": 0.1}, timestamp_ms=1)
    charts.poll_once()
    metrics_output = charts.widget.children[1].children[0]

    def shown() -> dict:
        (output,) = metrics_output.outputs
        figure = output["data"][PLOTLY_MIME]
        assert figure["layout"]["title"]["text"] == "Training metrics" and "loss" in output["data"]["text/plain"]
        return {t["name"]: (t["x"], t.get("visible", True)) for t in figure["data"]}

    assert shown() == {"loss": ([0], True), "lr": ([0], "legendonly")}  # the widget starts complete
    charts.feed(1, {"loss": 0.5, "lr": 0.1}, timestamp_ms=2)
    charts.poll_once()
    assert charts.trace_data(charts.metrics_figure, "loss")[0] == [0, 1]
    assert shown()["loss"][0] == [0]  # held back until redraw_s passed
    charts._metric_control.value = "lr"  # the user's choice: drawn at once, with every point so far
    assert shown() == {"loss": ([0, 1], "legendonly"), "lr": ([0, 1], True)}
    charts.feed(2, {"loss": 0.25, "lr": 0.1}, timestamp_ms=3)
    charts.show_now()  # what the run's end does before the cell returns
    assert shown() == {"loss": ([0, 1, 2], "legendonly"), "lr": ([0, 1, 2], True)}
    assert charts._metric_control.options == ("loss", "lr") and charts._metric_control.value == "lr"


# -- the world size chart: a relaunched run's record in a real MLflow store -------------------------------------

def _mlflow_run(tmp_path, monkeypatch, entries):
    """A real MLflow file store in ``tmp_path`` holding one FINISHED run with ``entries`` (step, metrics, stamp) logged
    through MlflowClient, as the tracker writes them; (client, run id)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(client.create_experiment("world")).info.run_id
    client.log_batch(run_id, metrics=[Metric(key, value, stamp, step) for step, metrics, stamp in entries
                                      for key, value in metrics.items()])
    client.set_terminated(run_id, "FINISHED")
    return client, run_id


def _shrunk_and_grown() -> list:
    """What the pump logs for `test_elastic_local`'s run, from the real `ResizeLog`: 2 ranks reach step 13, one is
    lost, the survivor resumes at 12 (accumulation 2), reaches 19 and fails, a restart grows it back from 18."""
    from dtrain_magic.driver.resizes import ResizeLog

    log = ResizeLog(2, accum=1, start_ms=1_000)
    entries = [(step, {"loss": 1.0 / (step + 1)}, 1_000 + step) for step in range(24)]
    log.pulse(13)
    entries += [(s, m, t or 2_000) for s, m, t in log.relaunched(1)]
    entries.append((12, dict(log.metrics({"resumed_at_step": 12.0, "world_size": 1.0, "grad_accum": 2.0})), 2_100))
    log.pulse(14)
    entries += [(s, m, t or 3_000) for s, m, t in log.relaunched(2)]
    entries.append((18, dict(log.metrics({"resumed_at_step": 18.0, "world_size": 2.0, "grad_accum": 1.0})), 3_100))
    return entries


def test_a_relaunched_run_gets_a_world_size_chart_with_its_restart_and_the_steps_lost(tmp_path, monkeypatch):
    client, run_id = _mlflow_run(tmp_path, monkeypatch, _shrunk_and_grown())
    charts = _charts()
    charts.attach(client, run_id)
    assert charts.poll_once() and charts.world_shown
    figure = charts.world_figure
    assert figure.layout.title.text == "World size: 1 restart, 2 optimizer steps lost"
    # a step line: 2 ranks from step 0, 1 from the shrink's resume at 12, 2 again from 18 to the run's last step (23)
    (line,) = figure.data
    assert (line.name, line.line.shape, list(line.x), list(line.y)) == ("world size", "hv", [0, 12, 18, 23],
                                                                        [2.0, 1.0, 2.0, 2.0])
    assert [(shape.x0, shape.line.dash) for shape in figure.layout.shapes] == [(19, "dot")]  # not the shrink
    assert [(note.x, note.y, note.text) for note in figure.layout.annotations] == [
        (19, 1, "restart 1"), (12, 1.0, "1 lost"), (18, 2.0, "1 lost")]
    assert charts.training_keys() == ["grad_accum", "loss"] and charts.shown_metric() == "loss"
    assert "world size" not in {trace.name for trace in charts.metrics_figure.data}
    assert charts.widget.children[1].children[2].layout.display is None  # the third chart is shown
    client.log_metric(run_id, "loss", 0.01, step=30)  # training goes on after the last relaunch: the line with it
    assert charts.poll_once() and list(charts.world_figure.data[0].x) == [0, 12, 18, 30]


def test_a_run_never_relaunched_shows_no_world_size_chart(tmp_path, monkeypatch):
    client, run_id = _mlflow_run(tmp_path, monkeypatch, [(step, {"loss": 1.0 - step / 10}, 1_000 + step)
                                                         for step in range(5)])
    charts = _charts()
    charts.attach(client, run_id)
    assert charts.poll_once() and not charts.world_shown
    assert not charts.world_figure.data and charts.world_figure.layout.title.text == "World size"
    assert charts.widget.children[1].children[2].layout.display == "none"
    assert charts.trace_data(charts.metrics_figure, "loss")[0] == [0, 1, 2, 3, 4]
