import io

from dtrain_magic.config import RunConfig
from dtrain_magic.driver.observer import TextObserver, prefix_lines, progress_line


def test_prefix_lines_keeps_partial_lines_pending():
    out, pending = prefix_lines(1, "a\nb")
    assert out == "[rank 1] a\n" and pending == "b"
    out, pending = prefix_lines(1, "c\n", pending)
    assert out == "[rank 1] bc\n" and pending == ""


def test_interleaved_ranks_never_share_a_line():
    stdout = io.StringIO()
    obs = TextObserver(out=stdout, err=stdout)
    obs.started(RunConfig(), "rid", "link", "plan")
    obs.output(0, "stdout", "hel")
    obs.output(1, "stdout", "wor")
    obs.output(0, "stdout", "lo\n")
    obs.output(1, "stdout", "ld\n")
    lines = stdout.getvalue().splitlines()[1:]
    assert lines == ["[rank 0] hello", "[rank 1] world"]


def test_progress_line_with_total_has_eta():
    line = progress_line(50, 100, 10.0, {"loss": 0.5})
    assert line == "step 50/100 (5.0 steps/s, ETA 10.0 s) loss=0.5"


def test_a_gpu_plan_says_when_gpu_metrics_will_be_missing(monkeypatch):
    import builtins

    from dtrain_magic.config import RunConfig
    from dtrain_magic.driver.observer import plan_with_backend

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    gpu = plan_with_backend("2 local process(es) (GPU, 127.0.0.1)", RunConfig(use_gpu=True))
    assert gpu == ("2 local process(es) (GPU, 127.0.0.1), nccl process group (GPU metrics are off: install "
                   "nvidia-ml-py to record GPU utilisation and memory)")
    cpu = plan_with_backend("2 local process(es) (CPU, 127.0.0.1)", RunConfig(use_gpu=False))
    assert cpu == "2 local process(es) (CPU, 127.0.0.1), gloo process group"


def test_the_last_progress_line_is_the_runs_last_step_with_its_final_values():
    from types import SimpleNamespace

    stdout = io.StringIO()
    obs = TextObserver(out=stdout, every_s=3600)  # one progress line per hour: only the first and the final
    obs.started(RunConfig(), "rid", "link", "plan")
    obs._last_progress -= 3600
    obs.metric(0, {"loss": 12.49})
    for step in range(1, 36):
        obs.metric(step, {"loss": 12.49 - step * 0.1})
    obs.metric(35, {"acc": 0.5})  # logged apart: the final line holds each metric's last value
    obs.data_progress("train", 9, 4, 4)
    obs.finished(SimpleNamespace(wall_time_s=2.0, run_id="rid"), None)
    lines = stdout.getvalue().splitlines()
    assert lines[1].startswith("step 1 (") and lines[1].endswith("loss=12.49")
    assert lines[-2] == "step 36 (18.0 steps/s) acc=0.5, loss=8.99; train: epoch 9, batch 4/4"  # over the whole run
    assert lines[-1] == "dtrain_magic: finished in 2.00 s; MLflow run rid"
