"""One path for every entry point (issue #23), really started: `dtrain_magic.run` from a plain ``python`` process
on local, Spark and Ray (a real SparkSession, the script's own ``ray.init()``), Ctrl-C of that process, the command
line, a backend and a strategy registered from this file in one line each, the panel's Run and the magic sharing
the warm-up path, and a function the cell imports called on its last line.

Tolerance: fp32 final weights within atol 1e-5 of one plain process (`workloads.train_reference`), and of the
magic's own run of the same function.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import cloudpickle
import pytest
import torch

from dtrain_magic.launchers.base import Failure, Launcher, LaunchState, RunningJob, describe_exit
from dtrain_magic.registry import BACKENDS, STRATEGIES
from dtrain_magic.strategies.base import Strategy
from leftovers import kill_tagged, new_tag, tagged_env, wait_until_none_left
from workloads import (
    TRAIN_HELPERS,
    assert_close,
    assert_imported_call_run,
    imported_call_cell,
    train_cell,
    train_reference,
    write_project,
)

pytestmark = pytest.mark.slow

PYTHON = sys.executable
# TRAIN_CELL's function as a script defines it, then the same function through dtrain_magic.run on each backend.
API_SCRIPT = TRAIN_HELPERS + train_cell("local").split("\n", 1)[1] + textwrap.dedent("""
    import json
    import dtrain_magic

    def train_and_say(ctx):
        print(f"hello from rank {ctx.rank}")
        return {k: v.tolist() for k, v in train(ctx).items()}

    out = {}
    out["local"] = dtrain_magic.run(train_and_say, backend="local", num_workers=2, gpu=False).value
    out["spark"] = dtrain_magic.run(train_and_say, backend="spark", num_processes=2, use_gpu=False,
                                    keep_warm=0).value
    import ray

    ray.init(num_cpus=3, include_dashboard=False)  # the user's own Ray, as Ray's docs start
    out["ray"] = dtrain_magic.run(train_and_say, backend="ray", num_processes=2, use_gpu=False).value
    print("RESULT " + json.dumps(out), flush=True)

    # a probe: is Ray still up when dtrain_magic's exit hook releases the workers waiting on it?
    from dtrain_magic.state import kernel_state

    state, shutdown = kernel_state(), kernel_state().shutdown
    def shutdown_seeing_ray(at_exit=False):
        print(f"AT EXIT Ray up: {ray.is_initialized()}", flush=True)
        shutdown(at_exit=at_exit)
    state.shutdown = shutdown_seeing_ray
""")


def tensors(weights: dict) -> dict:
    return {k: torch.tensor(v) for k, v in weights.items()}


def test_run_from_a_plain_python_process_matches_the_magic_on_every_backend(shell, tmp_path):
    assert shell.run(TRAIN_HELPERS).error_in_exec is None
    magic = shell.run(train_cell("local"))
    assert magic.error_in_exec is None, magic.error_in_exec
    (tmp_path / "job.py").write_text(API_SCRIPT)
    tag = new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'api.db'}")
    try:
        done = subprocess.run([PYTHON, "-X", "faulthandler", "job.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=420)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = done.stdout
        result = json.loads(out.partition("RESULT ")[2].splitlines()[0])
        reference = train_reference()
        assert list(result) == ["local", "spark", "ray"]
        for weights in result.values():
            assert_close(tensors(weights), magic.result.value, atol=1e-5, rtol=0)
            assert_close(tensors(weights), reference, atol=1e-5, rtol=0)
        # worker output streamed as [rank N] lines, from every rank, on every backend
        assert out.count("[rank 1] hello from rank 1") == 3 and out.count("[rank 0] hello from rank 0") == 3
        # on the Ray the script's own ray.init() started (this machine's), the run's workers were launched ahead
        # while the script made its payload, and the run took them over (before the fix: held only with --keep-warm)
        started = [line for line in out.splitlines() if line.startswith("dtrain_magic: ") and "MLflow run" in line
                   and "Ray Train" in line]
        assert len(started) == 1 and "launched ahead and waiting" in started[0], started
        # the workers left waiting were released before Ray's own exit hook shut Ray down (the user's ray.init()
        # registered it before the run): after it, a release started a new local Ray at exit, which crashed
        # the process with SIGSEGV in 1 of many CI runs
        assert "AT EXIT Ray up: True" in out, out[-2000:]
        assert done.stderr.count("Started a local Ray instance") == 1, done.stderr[-3000:]
        assert not wait_until_none_left(tag, within_s=45)  # the process exited: nothing of it is left
    finally:
        kill_tagged(tag)


LOOP_SCRIPT = textwrap.dedent("""
    import sys, time
    import dtrain_magic

    def loop(ctx):
        print(f"looping on rank {ctx.rank}", flush=True)
        while True:
            time.sleep(0.05)

    try:
        dtrain_magic.run(loop, backend="local", num_processes=2, use_gpu=False)
    except dtrain_magic.RunInterrupted as exc:
        print(f"INTERRUPTED: {exc}", flush=True)
        sys.exit(3)
""")


def test_ctrl_c_of_a_plain_python_process_stops_every_worker(tmp_path):
    (tmp_path / "loop.py").write_text(LOOP_SCRIPT)
    tag = new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'api.db'}", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([PYTHON, "loop.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while "looping on rank 1" not in seen or "looping on rank 0" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stdout.readline()
        workers = [pid for pid, _ in wait_until_none_left(tag, within_s=0) if pid != proc.pid]
        assert len(workers) >= 2, workers  # the fork server and its two workers are up
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 3, seen + rest
        assert "INTERRUPTED: the run was interrupted; every worker was stopped" in rest
        assert time.monotonic() - sent < 10
        assert not wait_until_none_left(tag, within_s=10)
    finally:
        proc.kill()
        kill_tagged(tag)


KEYWORDS_SCRIPT = textwrap.dedent("""
    import dtrain_magic
    from dtrain_magic.errors import ConfigError

    def train(ctx):
        ctx.write("preds", {"rank": [ctx.rank]})
        return {"rank": ctx.rank, "device": str(ctx.device)}

    try:
        dtrain_magic.run(train, backend="local", cpux=True)
    except ConfigError as exc:
        print("REFUSED", exc, flush=True)
    result = dtrain_magic.run(train, backend="local", num_workers=2, cpu=True, stall_timeout=None,
                              outputs=["preds", "nope"])
    print("VALUES", result.values, result.config.use_gpu, result.config.stall_timeout, flush=True)
    preds = result.tables["preds"]
    print("TABLES", sorted(result.tables), type(preds).__name__, sorted(preds.to_table().column("rank").to_pylist()),
          result.outputs["preds"].path, flush=True)
""")


def test_run_takes_the_flags_long_names_as_keywords_cpu_true_included(tmp_path):
    """``run(train, cpu=True)`` is ``--cpu`` (it used to reach train(ctx) as a keyword: "missing ... 'ctx'"); a
    keyword that is neither is refused naming it and the closest option, before anything starts. ``outputs=``
    returns what ``ctx.write`` wrote as ``result.tables[NAME]`` (a pyarrow Dataset on local), and says which name it
    asked for the run did not write."""
    (tmp_path / "keywords.py").write_text(KEYWORDS_SCRIPT)
    tag = new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'api.db'}", PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run([PYTHON, "keywords.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "REFUSED cpux=: is neither an option of run() nor a parameter of train(ctx); did you mean cpu=?" in out
        assert ("VALUES [{'rank': 0, 'device': 'cpu'}, {'rank': 1, 'device': 'cpu'}] False 0.0" in out), out
        tables = out.partition("TABLES ")[2].splitlines()[0]
        assert tables.startswith("['preds'] FileSystemDataset [0, 1] "), out
        assert os.path.isfile(os.path.join(tables.rsplit(" ", 1)[1], "_SUCCESS"))
        assert ("dtrain_magic: outputs='nope': no output 'nope' was written (ctx.write('nope', batch)); written: "
                "preds; result.tables has no 'nope'") in out, out
        assert not wait_until_none_left(tag, within_s=10)
    finally:
        kill_tagged(tag)


CLI_MODULE = textwrap.dedent("""
    import sys

    def main(ctx):
        print(f"argv {sys.argv[1:]} on rank {ctx.rank}")
        ctx.write("preds", {"rank": [ctx.rank]})
        return {"rank": ctx.rank, "scale": float(sys.argv[sys.argv.index("--scale") + 1])}

    def boom(ctx):
        if ctx.rank == 1:
            raise ValueError("rank 1 has no data")
        return 0
""")


def test_the_command_line_runs_a_module_function_and_exits_with_the_runs_status(tmp_path):
    (tmp_path / "cli_job.py").write_text(CLI_MODULE)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'cli.db'}"}
    command = [PYTHON, "-m", "dtrain_magic", "run"]
    ok = subprocess.run(command + ["cli_job:main", "-n", "2", "--backend", "local", "--cpu", "--", "--scale", "3"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "[rank 1] argv ['--scale', '3'] on rank 1" in ok.stdout
    assert "dtrain_magic: rank 0 returned {'rank': 0, 'scale': 3.0}" in ok.stdout
    # what ctx.write wrote: its path, where the run's outputs are committed
    said = "dtrain_magic: output preds: 2 rows written by the ranks, committed at "
    assert said in ok.stdout, ok.stdout
    path = ok.stdout.partition(said)[2].splitlines()[0]
    assert path.endswith(os.path.join("outputs", "preds")) and os.path.isfile(os.path.join(path, "_SUCCESS"))
    failed = subprocess.run(command + ["cli_job:boom", "-n", "2", "--backend", "local", "--cpu"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "WorkerError: rank 1 failed: ValueError: rank 1 has no data" in failed.stderr
    # the worker's short traceback, with the file's line
    assert 'cli_job.py", line 11, in boom\n    raise ValueError("rank 1 has no data")' in failed.stderr
    assert "Traceback (most recent call last)" in failed.stderr and "pyspark" not in failed.stderr


# -- a backend and a strategy registered from here in one line each ---------------------------------------------


class SubprocessJob(RunningJob):
    def __init__(self, processes: list[subprocess.Popen], job_file: str):
        self.processes, self.job_file = processes, job_file

    def poll(self) -> LaunchState:
        codes = [p.poll() for p in self.processes]
        failures = [Failure(rank, describe_exit(code)) for rank, code in enumerate(codes) if code not in (None, 0)]
        return LaunchState(finished=all(code is not None for code in codes), failures=failures)

    def cancel(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        if os.path.exists(self.job_file):
            os.remove(self.job_file)


class SubprocessLauncher(Launcher):
    """The least a backend needs: N fresh interpreters that each run `dtrain_magic.worker.run_job_file`, with
    torchrun's variables set; it records when it was asked to launch ahead (`keep_warm`) and to start."""

    name = "subprocess"
    events: list = []

    def keep_warm(self, config):
        self.events.append("keep_warm")
        return None

    def start(self, job, emit):
        self.events.append("start")
        handle, path = tempfile.mkstemp(prefix="dtrain-job-")
        with os.fdopen(handle, "wb") as out:
            cloudpickle.dump(job, out)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        world = job.config.num_processes
        code = "import sys; from dtrain_magic.worker import run_job_file; sys.exit(run_job_file(sys.argv[1]))"
        processes = [
            subprocess.Popen([PYTHON, "-c", code, path], env={
                **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(world)
        ]
        return SubprocessJob(processes, path)


class AveragingStrategy(Strategy):
    """The least a strategy needs: the plain model, gradients averaged over the ranks by hand at each step."""

    name = "averaging"

    def wrap(self, model, optimizer):
        self.model, self.optimizer = model.to(self.device), optimizer
        return self.model, optimizer

    def backward(self, loss):
        loss.backward()

    def step(self) -> bool:
        import torch.distributed as dist

        for param in self.model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= self.world_size
        self.optimizer.step()
        self.optimizer.zero_grad()
        return True


@pytest.fixture(scope="module")
def registered():
    BACKENDS.register("subprocess", SubprocessLauncher)  # the one line each
    STRATEGIES.register("averaging", AveragingStrategy)
    yield
    BACKENDS.unregister("subprocess")
    STRATEGIES.unregister("averaging")


def test_a_backend_and_a_strategy_registered_in_one_line_run_end_to_end(registered, shell, mlflow):
    assert shell.run(TRAIN_HELPERS).error_in_exec is None
    result = shell.run(train_cell("subprocess", extra="--strategy averaging"))
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result.config.strategy == "averaging"
    assert_close(result.result.value, train_reference(), atol=1e-5, rtol=0)  # the class travelled by value
    assert mlflow.get_run(result.result.run_id).data.params["strategy"] == "averaging"


def test_the_panel_and_the_magic_launch_ahead_before_the_cell_runs(registered, shell):
    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.capture import payload_maker
    from dtrain_magic.ui.panel import ConfigurePanel

    events = SubprocessLauncher.events
    shell.user_ns["EVENTS"] = events
    body = "EVENTS.append('cell ran')\ndef train(ctx):\n    return ctx.rank\n"
    events.clear()
    result = shell.run("%%distribute --backend subprocess -n 1 --no-ui\n" + body)
    assert result.error_in_exec is None, result.error_in_exec
    assert events == ["keep_warm", "cell ran", "start", "keep_warm"], events
    assert shell.user_ns["_distribute_result"] is result.result
    events.clear()
    config = flags.config_from_line("--backend subprocess -n 1 --result from_panel", gpu_available=lambda: False)
    panel = ConfigurePanel(config, body, shell, checker=lambda c: None, make_payload=payload_maker(body, shell))
    panel.run(wait=True)
    assert panel.error is None, panel.error
    assert events == ["keep_warm", "cell ran", "start", "keep_warm"], events
    assert shell.user_ns["from_panel"] is panel.result is shell.user_ns["_distribute_result"]


def test_a_function_the_cell_imports_runs_on_the_workers_only(shell, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(write_project(tmp_path))
    assert_imported_call_run(shell.run(imported_call_cell("local")), tmp_path)
