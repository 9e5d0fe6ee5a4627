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


def test_failed_run_shows_the_error():
    obs, _ = make()
    obs.status(1, "failed", "ValueError: boom")
    obs.finished(None, RuntimeError("rank 1 failed: ValueError: boom"))
    assert obs.widget.state == "failed" and obs.widget.ranks[1] == {"rank": 1, "state": "failed", "detail": "ValueError: boom"}


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
    assert system_series(["system/node1/cpu_utilization_percentage"]) == {"system/node1/cpu_utilization_percentage": "node1 CPU %"}


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
