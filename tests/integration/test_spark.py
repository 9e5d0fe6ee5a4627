"""The Spark backend, really started: TorchDistributor on a real local SparkSession, then on a real
``local-cluster[2,1,1024]`` (two executor JVMs on loopback) with barrier tasks.

One SparkSession is shared by the module (the launcher's own, reused run after run) and stopped at the
end; the cluster test, last, restarts it against the local-cluster master. After every run the launcher keeps
the next run's workers waiting (a standby, docs/warm-reruns.md), so most runs here go through workers launched
ahead: "nothing left" means nothing of the finished run, and only the standby's processes, which the launcher
names (`SparkLauncher.standby_processes`); tests that prove clean-up release the standby and check that
nothing at all is left.
Measured times to first step are printed (``pytest -s``) and kept in ``TIMES``. ``--data`` with a Spark DataFrame
(docs/data.md) runs on the local session and, last, on the local-cluster, where each barrier task reads its share.
"""

import os
import re
import signal
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from data_workloads import SCORE_ROWS, assert_exactly_once, files_under, read_cell, score_cell, scored_by_one_process
from dtrain_magic.config import RunConfig
from dtrain_magic.driver.staging import staging_area
from dtrain_magic.errors import CaptureError, ConfigError, RunInterrupted, RunTimeout, WorkerError
from dtrain_magic.launchers import get_launcher
from interpreters import bare_python
from sweep_checks import check_a_sweep_reuses_its_workers
from workloads import (
    EVERY,
    KILL_AT,
    KILL_RANK1_CELL,
    MIXED_CELL,
    PP_WIDTHS,
    STEPS,
    TP_WIDTHS,
    TRAIN_HELPERS,
    assert_model_parallel_run,
    assert_nothing_grew,
    assert_strategy_run,
    ended_run,
    everything_stored,
    model_parallel_cell,
    notebook_snapshot,
    restart_cell,
    strategy_cell,
    train_cell,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLUSTER_MASTER = "local-cluster[2,1,1024]"
TIMES: dict[str, float] = {}
RESTART_REFERENCE: dict = {}  # restart_cell's final weights on the local backend, uninterrupted (set once)


EXECUTOR_HELPER = """
import os, time, psutil

def executor_pid():
    \"\"\"The pid of the executor JVM this worker runs under (the one whose command is the executor backend).\"\"\"
    time.sleep(1.5)  # long enough for one system-metrics sample on each node
    proc = psutil.Process()
    while proc is not None:
        if "CoarseGrainedExecutorBackend" in " ".join(proc.cmdline()):
            return proc.pid
        proc = proc.parent()
    return None
"""


@pytest.fixture(scope="module")
def spark_launcher():
    """The cached SparkLauncher (its SparkSession lives across the module's tests), stopped at the end."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    launcher = get_launcher("spark")
    yield launcher
    launcher.shutdown()


def torchrun_processes():
    """torchrun trees (TorchDistributor's wrapper, torchrun, its workers) still alive below this process."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "torch_run_process_wrapper" in cmdline or "torch.distributed.run" in cmdline or cmdline.endswith("train.py"):
            alive.append(proc)
    return alive


def held(launcher) -> set[int]:
    """The processes of the workers ``launcher`` keeps waiting for the next run (its standby), once they are all up."""
    standby = launcher.standbys.standby
    if standby is None:
        return set()
    deadline = time.monotonic() + 180
    while not standby.all_ready.wait(0.1) and standby.released is None and time.monotonic() < deadline:
        pass
    if standby.released is not None:  # (released meanwhile: its idle time is over)
        return set()
    assert standby.all_ready.is_set(), "the standby's workers did not come up"
    processes = launcher.standby_processes()
    assert {p for p in processes if "train.py" in " ".join(psutil.Process(p).cmdline())} >= set(standby.pids.values())
    return processes


def assert_no_torchrun_left(launcher=None, timeout=10.0):
    """No torchrun process of a finished run is alive; with ``launcher``, only its standby's (named by it)."""
    keep = held(launcher) if launcher is not None else set()
    deadline = time.monotonic() + timeout
    while (left := [p for p in torchrun_processes() if p.pid not in keep]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [" ".join(p.cmdline())[:120] for p in left]


def held_jobs(launcher) -> tuple[set[int], set[int]]:
    """The Spark jobs and stages of the launcher's standby (its barrier job in cluster mode; none in local mode)."""
    standby = launcher.standbys.standby
    if standby is None:
        return set(), set()
    tracker = standby.launch._sc.statusTracker()  # (the user's session, or the launcher's own)
    jobs = set(standby.launch.active_jobs())
    stages = {stage for job in jobs if (info := tracker.getJobInfo(job)) is not None for stage in info.stageIds}
    return jobs, stages


def assert_no_spark_job_running(launcher):
    """No Spark job or stage of a finished run runs: only the standby's, if any."""
    tracker = launcher._session.sparkContext.statusTracker()
    jobs, stages = held_jobs(launcher)
    assert set(tracker.getActiveJobsIds()) - jobs == set() and set(tracker.getActiveStageIds()) - stages == set()


def interrupt_when_running(marker, wait_s: float) -> dict:
    """SIGINT this process (as Jupyter's interrupt does) once ``marker`` exists; returns when it was sent."""
    sent: dict = {}

    def interrupt():
        deadline = time.monotonic() + wait_s
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        sent["run"] = {p.pid for p in torchrun_processes()}  # the running run's (no standby waits during a run)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    sent["thread"] = threading.Thread(target=interrupt, daemon=True)
    sent["thread"].start()
    return sent


def assert_stopped_within_10_s(result, sent, launcher):
    """The cell ended with RunInterrupted and every torchrun process of the run was gone within 10 s of the
    SIGINT; afterwards only the next run's standby (launched after the interrupt) has processes."""
    returned = time.monotonic()
    sent["thread"].join(5)
    assert isinstance(result.error_in_exec, RunInterrupted), result.error_in_exec
    assert "at" in sent and returned - sent["at"] < 10.0, returned - sent.get("at", 0)
    assert sent["run"], "no torchrun process was running when the interrupt came"
    deadline = sent["at"] + 10.0
    while (left := [pid for pid in sent["run"] if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"processes of the interrupted run alive 10 s after the SIGINT: {left}"
    assert_no_torchrun_left(launcher)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_local_mode_trains_and_matches_the_local_backend(spark_launcher, shell, mlflow):
    assert shell.run(TRAIN_HELPERS).error_in_exec is None
    starts = spark_launcher.session_starts
    started = time.monotonic()
    spark = shell.run(train_cell("spark", extra="--seed 0"))
    assert spark.error_in_exec is None, spark.error_in_exec
    cold = spark.result
    TIMES["cold_total_s"] = time.monotonic() - started
    if spark_launcher.session_starts > starts:  # this run started the session (it is the module's first)
        TIMES["cold_session_start_s"] = spark_launcher.session_start_s
    # From the cell's start (session start, checks and MLflow run included) to rank 0's first ctx.log.
    TIMES["cold_first_step_s"] = TIMES["cold_total_s"] - cold.wall_time_s + cold.time_to_first_step_s
    local = shell.run(train_cell("local", extra="--seed 0"))
    assert local.error_in_exec is None, local.error_in_exec
    assert cold.config.backend == "spark" and cold.config.local_mode
    assert len(cold.values) == 2
    for name, weight in local.result.value.items():
        assert (cold.value[name] - weight).abs().max().item() < 1e-5, name
        assert (cold.values[1][name] - weight).abs().max().item() < 1e-5, name  # every rank's value comes back
    run = mlflow.get_run(cold.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["local_mode"] == "True" and run.data.tags["dtrain_magic.backend"] == "spark"
    assert len(mlflow.get_metric_history(cold.run_id, "loss")) == 12
    assert "system/cpu_utilization_percentage" in run.data.metrics  # the driver is the one node here
    assert_no_torchrun_left(spark_launcher)


def test_second_run_reuses_the_session_and_takes_over_the_waiting_workers(spark_launcher, shell, capsys):
    """The first run left the next run's workers waiting (TorchDistributor.run of a waiting function, launched
    after it): the re-run takes them over (its job over the standby's connection), trains to the same weights as
    one plain process (fp32, 1e-5), and leaves a new standby with new processes."""
    from workloads import train_reference

    session, starts = spark_launcher._session, spark_launcher.session_starts
    assert session is not None
    standby = spark_launcher.standbys.standby
    assert standby is not None and standby.placement == spark_launcher._placement(
        RunConfig(backend="spark", seed=0), session)
    held(spark_launcher)  # every waiting worker is up: this is the warm re-run
    waiting = set(standby.pids.values())
    claims = spark_launcher.standbys.claims
    capsys.readouterr()
    shell.run(TRAIN_HELPERS)
    started = time.monotonic()
    result = shell.run(train_cell("spark", extra="--seed 0"))
    assert result.error_in_exec is None, result.error_in_exec
    TIMES["warm_total_s"] = time.monotonic() - started
    TIMES["warm_first_step_s"] = TIMES["warm_total_s"] - result.result.wall_time_s + result.result.time_to_first_step_s
    assert spark_launcher._session is session and spark_launcher.session_starts == starts
    assert spark_launcher.standbys.claims == claims + 1 and standby.claimed
    out = capsys.readouterr().out
    assert "reused" in out and "its workers were launched ahead and waiting" in out  # the plan line says both
    # the cell says what waits for the next run, where and until when
    assert "dtrain_magic: 2 TorchDistributor worker(s) (CPU, local mode: on this machine) wait for the next run" in out
    for name, weight in train_reference().items():
        assert (result.result.value[name] - weight).abs().max().item() < 1e-5, name
        assert (result.result.values[1][name] - weight).abs().max().item() < 1e-5, name
    assert not any(alive(pid) for pid in waiting)  # the standby's workers ran the job, then ended with it
    assert waiting.isdisjoint(held(spark_launcher))  # the next standby: fresh processes
    with capsys.disabled():
        print(f"\nspark local mode: cold {TIMES.get('cold_total_s', float('nan')):.1f} s total, first step "
              f"{TIMES.get('cold_first_step_s') or float('nan'):.1f} s (session start "
              f"{TIMES.get('cold_session_start_s') or 0:.1f} s); warm (waiting workers) {TIMES['warm_total_s']:.1f} s "
              f"total, first step {TIMES['warm_first_step_s']:.2f} s")


def test_a_placement_change_releases_the_waiting_workers_and_launches_fresh(spark_launcher, shell, capsys):
    """-n 2 then -n 1: the two waiting workers are released (gone before the run's own start), the run gets one
    fresh worker (launched for it once its checks passed, as for a kernel's first run), and one worker waits
    after it."""
    held(spark_launcher)
    before = spark_launcher.standbys.standby
    assert before is not None and dict(before.placement.items)["processes"] == 2
    waiting = set(before.pids.values())
    claims, launches = spark_launcher.standbys.claims, spark_launcher.standbys.launches
    capsys.readouterr()
    result = shell.run("%%distribute --backend spark -n 1 --no-ui\nimport os\ndef train(ctx):\n"
                       "    return ctx.world_size, os.getpid()\n")
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result.values == [(1, result.result.value[1])] and result.result.value[1] not in waiting
    assert "processes 2 → 1" in before.released and not any(alive(pid) for pid in waiting)
    # one launch for the run (its own placement), one for the next run after it; none of the released workers ran
    assert spark_launcher.standbys.claims == claims + 1 and spark_launcher.standbys.launches == launches + 2
    after = spark_launcher.standbys.standby
    assert after is not before and dict(after.placement.items)["processes"] == 1
    assert "1 TorchDistributor worker(s)" in capsys.readouterr().out
    assert len(held(spark_launcher)) >= 3  # wrapper, torchrun, the worker (and its watchdog)
    assert_no_torchrun_left(spark_launcher)


def test_secrets_are_not_logged_and_run_files_are_private(spark_launcher, shell, mlflow, monkeypatch, capsys):
    """A planted token in the notebook's environment reaches no param, tag or artifact (the backend log's slice,
    shown by --verbose, included); TorchDistributor's directory (the pickled function) and the run's checkpoints
    are the user's alone (0700)."""
    monkeypatch.setenv("MY_API_TOKEN", "tok-planted-secret-spark")
    shell.run("%distribute_release")  # a fresh launch: TorchDistributor's "Started" line is this run's
    result = shell.run(
        "%%distribute --backend spark -n 2 --no-ui --verbose\nimport os, stat, sys, torch\ndef train(ctx):\n"
        "    ctx.prepare(torch.nn.Linear(2, 1))\n    ctx.save_checkpoint(step=1)\n"
        "    return oct(stat.S_IMODE(os.stat(os.path.dirname(os.path.abspath(sys.argv[0]))).st_mode))\n"
    )
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result.value == "0o700"  # where TorchDistributor put the pickled function and its script
    assert oct(os.stat(result.result.checkpoint_root).st_mode & 0o777) == "0o700"
    run_id = result.result.run_id
    artifacts = mlflow.list_artifacts(run_id)
    assert artifacts  # the result is one: the scan below reads what the run stored
    # TorchDistributor's own lines went to the kernel's backend log, not the cell: the run's slice is in MLflow, and
    # --verbose shows it in the cell.
    backend = mlflow.download_artifacts(run_id, "logs/backend.txt")
    assert "Started local training" in open(backend).read()
    assert "what the backends printed during this run" in capsys.readouterr().out
    everything = everything_stored(mlflow, run_id)
    assert "tok-planted-secret-spark" not in everything


def take_over(launcher, config=None) -> tuple[int, set[int]]:
    """Make sure workers with ``config``'s placement (default: -n 2, local mode, CPU) wait, all up: the previous
    run's standby, or one launched now when this test runs alone. (claims so far, their pids): the test's run
    must take exactly these over (`assert_taken_over`)."""
    launcher.session(config or RunConfig(backend="spark"))
    launcher.keep_warm(config or RunConfig(backend="spark"))
    held(launcher)
    return launcher.standbys.claims, set(launcher.standbys.standby.pids.values())


def assert_taken_over(launcher, before: tuple[int, set[int]]) -> None:
    """The run took the waiting workers over, and none of them outlived it."""
    claims, pids = before
    assert launcher.standbys.claims == claims + 1
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def capture_line_magic(shell, capsys, line: str) -> str:
    capsys.readouterr()
    assert shell.run(line).error_in_exec is None
    return capsys.readouterr().out


def test_checkpoints_land_where_every_backend_puts_them(spark_launcher, shell):
    """ctx.save_checkpoint() without a directory works on Spark as on local and Ray: numbered checkpoints
    under ./dtrain_runs/dtrain_<run key>, the same function trains to the same weights on both backends."""
    import torch

    spark = shell.run(restart_cell("spark", save=True))
    assert spark.error_in_exec is None, spark.error_in_exec
    local = shell.run(restart_cell("local", save=True))
    assert local.error_in_exec is None, local.error_in_exec
    RESTART_REFERENCE.update(local.result.value)  # the uninterrupted run's weights (the restart test compares)
    for name, value in local.result.value.items():
        assert torch.allclose(value, spark.result.value[name], atol=1e-5, rtol=0), name
    for result in (spark.result, local.result):
        root = result.checkpoint_root
        assert os.path.dirname(root) == os.path.join(os.getcwd(), "dtrain_runs"), root
        saved = sorted(d for d in os.listdir(root) if d.startswith("checkpoint_"))
        assert saved == [f"checkpoint_{i:06d}" for i in range(STEPS // EVERY)], saved
        assert all(os.path.exists(os.path.join(root, d, ".complete")) for d in saved)
        assert open(os.path.join(root, "LATEST")).read() == os.path.join(root, saved[-1])


# The strategies' own training function (tests/integration/test_strategies.py), unchanged, through
# TorchDistributor's torchrun: DeepSpeed and FSDP2 match one process (fp32) and resume from a checkpoint.
@pytest.mark.parametrize("flags,accum", [("--zero 3 --grad-accum 2", 2), ("--strategy fsdp", 1)], ids=["zero3", "fsdp"])
def test_strategies_run_unchanged_through_torchdistributor(spark_launcher, shell, tmp_path, flags, accum):
    assert_strategy_run(shell.run(strategy_cell("spark", flags, tmp_path / "ckpt")), accum)
    assert_no_torchrun_left(spark_launcher)


# Model parallelism (issue #16) through TorchDistributor's torchrun: the local backend's ctx.train_step function
# (tests/integration/test_model_parallel.py) under --tp 2 and --pp 2 matches one process (fp32, 1e-5) and resumes.
@pytest.mark.parametrize("flags,widths", [("--tp 2", TP_WIDTHS), ("--pp 2 --microbatches 4", PP_WIDTHS)],
                         ids=["tp", "pp"])
def test_tensor_and_pipeline_parallel_through_torchdistributor(spark_launcher, shell, tmp_path, flags, widths):
    assert_model_parallel_run(shell.run(model_parallel_cell("spark", flags, tmp_path / "ckpt", widths)), widths)
    assert_no_torchrun_left(spark_launcher)


# -- existing code, unchanged (issue #13; the local backend's: test_existing_code.py) -------------------
def test_a_function_the_cell_imports_runs_through_torchdistributor(spark_launcher, shell, tmp_path, monkeypatch):
    """``from my_project.train import fit`` / ``fit(...)``: the call runs on the torchrun workers,
    never in the notebook, and trains one process's weights (fp32, 1e-5)."""
    from workloads import assert_imported_call_run, imported_call_cell, write_project

    monkeypatch.syspath_prepend(write_project(tmp_path))
    assert_imported_call_run(shell.run(imported_call_cell("spark")), tmp_path)


def test_torchdistributor_style_and_accelerate_run_unchanged(spark_launcher, shell, mlflow):
    """A function as written for TorchDistributor.run (its own init_process_group("gloo", env://), DDP,
    destroy_process_group, arguments from the cell's call), then an accelerate loop: both on the shared
    session, both matching one plain process (fp32, 1e-5)."""
    from workloads import (
        EXISTING_HELPERS,
        accelerate_cell,
        assert_close,
        existing_reference,
        loss_fell,
        torchdistributor_cell,
    )

    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(torchdistributor_cell("spark", init='dist.init_process_group(backend="gloo", init_method="env://")'))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["env"]["RANK"] for v in values] == ["0", "1"] and [v["env"]["LOCAL_RANK"] for v in values] == ["0", "1"]
    assert {v["env"]["WORLD_SIZE"] for v in values} == {"2"} and int(values[0]["env"]["MASTER_PORT"]) > 0
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    assert_close(values[0]["weights"], existing_reference(), atol=1e-5, rtol=0)
    assert all(v["group_alive"] for v in values)
    assert_no_torchrun_left(spark_launcher)

    result = shell.run(accelerate_cell("spark"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["num_processes"] == 2
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    assert_close(values[0]["weights"], existing_reference(), atol=1e-5, rtol=0)
    assert [m.step for m in mlflow.get_metric_history(result.result.run_id, "loss")] == list(range(12))


def test_hf_trainer_runs_into_the_magics_run(spark_launcher, shell, mlflow):
    from workloads import hf_trainer_cell

    result = shell.run(hf_trainer_cell("spark", flags="--grad-accum 2"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["world_size"] == 2 and values[0]["accum"] == 2
    assert values[0]["losses"][-1] < 0.7 * values[0]["losses"][0], values[0]["losses"]
    experiments = [e.experiment_id for e in mlflow.search_experiments()]
    assert [r.info.run_id for r in mlflow.search_runs(experiment_ids=experiments)] == [result.result.run_id]
    assert [m.step for m in mlflow.get_metric_history(result.result.run_id, "loss")] == list(range(1, 17))


def test_lightning_ddp_runs_without_launching_its_own(spark_launcher, shell):
    from workloads import EXISTING_HELPERS, assert_close, lightning_cell, loss_fell

    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(lightning_cell("spark"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["world_size"] == 2
    assert values[0]["pid"] != values[1]["pid"]  # torchrun's two processes, no processes of Lightning's own
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    assert_close(values[1]["weights"], values[0]["weights"], atol=0, rtol=0)
    assert_no_torchrun_left(spark_launcher)


def test_worker_failure_is_short_and_leaves_nothing_running(spark_launcher, shell, mlflow, capsys):
    waiting = take_over(spark_launcher)  # a failing run through workers launched ahead behaves as a fresh one
    started = time.monotonic()
    result = shell.run(
        "%%distribute --backend spark -n 2 --no-ui\n"
        "def train(ctx):\n"
        "    print('before the crash', flush=True)\n"
        "    if ctx.rank == 1:\n"
        "        raise ValueError('boom on rank one')\n"
        "    ctx.barrier()\n"
    )
    error = result.error_in_exec
    assert isinstance(error, WorkerError) and error.rank == 1, error
    assert "ValueError: boom on rank one" in str(error)
    assert "line 5, in train" in error.remote_traceback and "Cell In[" in error.remote_traceback
    rendered = "\n".join(error._render_traceback_())
    assert len(rendered.splitlines()) < 15 and "py4j" not in rendered and "Spark" not in rendered, rendered
    assert "[rank 1] before the crash" in capsys.readouterr().out
    run = ended_run(mlflow)
    assert run.info.status == "FAILED" and "rank 1" in run.data.tags["dtrain_magic.failure"]
    assert time.monotonic() - started < 120  # no waiting on Spark retries (about 10 s on an idle machine)
    assert_taken_over(spark_launcher, waiting)
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)


def test_killed_worker_names_its_rank_and_signal(spark_launcher, shell, mlflow):
    waiting = take_over(spark_launcher)
    result = shell.run(KILL_RANK1_CELL.format(backend="spark"))
    error = result.error_in_exec
    assert isinstance(error, WorkerError) and error.rank == 1, error
    # The worker's watchdog reads the signal from /proc before torchrun reaps the worker (pyspark's wrapper exits 0
    # whatever torchrun says, so TorchDistributor.run never reports it).
    assert "process was killed by SIGKILL" in str(error) and "Traceback" not in str(error), str(error)
    assert ended_run(mlflow).info.status == "FAILED"
    assert_taken_over(spark_launcher, waiting)
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)


def ensure_restart_reference(shell) -> None:
    """RESTART_REFERENCE, set by the checkpoint test; run here when a restart test runs without it (alone)."""
    if not RESTART_REFERENCE:
        reference = shell.run(restart_cell("local"))
        assert reference.error_in_exec is None, reference.error_in_exec
        RESTART_REFERENCE.update(reference.result.value)


def assert_restarted_once_from_step_3(restarted, said: str, mlflow):
    """A RESTART_CELL run with --max-restarts 1 whose rank 1 died once at step 6: the cell's restart line, the resume
    from step 3's checkpoint, the uninterrupted run's weights (1e-6), one MLflow run FINISHED with one restart."""
    import torch

    assert restarted.error_in_exec is None, restarted.error_in_exec
    assert "dtrain_magic: rank 1 lost (" in said and f"restarting from step {EVERY - 1}, 1 of 1" in said, said
    assert f"[rank 0] resumed at step {EVERY}" in said, said
    for name, value in RESTART_REFERENCE.items():
        assert torch.allclose(value, restarted.result.value[name], atol=1e-6, rtol=0), name
    run = mlflow.get_run(restarted.result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["dtrain_magic.restarts"] == "1"
    return run


def test_max_restarts_resubmits_the_job_and_resumes_from_the_last_checkpoint(spark_launcher, shell, mlflow, capsys):
    """--max-restarts 1 on Spark (issue #37): rank 1's process exits (os._exit(1)) once mid-run; the launcher cancels
    the failed barrier job, sweeps its torchrun processes and submits a new one, which resumes from the newest
    complete checkpoint (step 3) and ends with the uninterrupted run's weights, in the same MLflow run."""

    ensure_restart_reference(shell)
    waiting = take_over(spark_launcher)  # the first attempt runs on the waiting workers, the second is fresh
    capsys.readouterr()
    cell = restart_cell("spark", flags="--max-restarts 1", kill=True).replace("os.kill(os.getpid(), signal.SIGKILL)",
                                                                             "os._exit(1)")
    restarted = shell.run(cell)
    run = assert_restarted_once_from_step_3(restarted, "".join(capsys.readouterr()), mlflow)
    assert run.data.tags["dtrain_magic.restart_1"].startswith("rank 1 lost (")
    assert [m.value for m in mlflow.get_metric_history(run.info.run_id, "restarts")] == [1.0]
    assert {m.step for m in mlflow.get_metric_history(run.info.run_id, "loss")} == set(range(STEPS))
    first_attempt = [int(open(f"pid_{rank}").read().split()[0]) for rank in (0, 1)]
    assert not any(alive(pid) for pid in first_attempt), first_attempt  # the failed attempt's workers are gone
    assert_taken_over(spark_launcher, waiting)
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)


def test_a_sigterm_to_a_rank_checkpoints_every_rank_and_the_restart_loses_no_step(spark_launcher, shell, mlflow,
                                                                                  capsys):
    """The preemption notice on Spark (issue #37): rank 1 gets a SIGTERM before step 6 (between the checkpoints of
    steps 3 and 7) with a 5 s grace: every rank checkpoints at the boundary they agree on, the job ends, and the
    restart resumes right after it: 0 steps lost, the uninterrupted run's weights (1e-6), nothing of the first
    attempt left."""
    import torch

    ensure_restart_reference(shell)
    capsys.readouterr()
    cell = restart_cell("spark", flags="--max-restarts 1 --preempt-grace 5", kill=True, signal="SIGTERM", pause=0.05)
    result = shell.run(cell)
    said = "".join(capsys.readouterr())
    assert result.error_in_exec is None, result.error_in_exec
    found = re.search(r"every rank checkpointed for a preemption notice \(SIGTERM\): restarting from step (\d+), "
                      r"1 of 1", said)
    assert found, said
    saved_at = int(found.group(1))
    assert KILL_AT <= saved_at < STEPS - 1 and f"[rank 0] resumed at step {saved_at + 1}" in said, said
    for name, value in RESTART_REFERENCE.items():
        assert torch.allclose(value, result.result.value[name], atol=1e-6, rtol=0), name
    run_id = result.result.run_id
    assert [m.value for m in mlflow.get_metric_history(run_id, "steps_lost")] == [0.0]
    assert [m.value for m in mlflow.get_metric_history(run_id, "restarts")] == [1.0]
    first_attempt = [int(open(f"pid_{rank}").read().split()[0]) for rank in (0, 1)]
    assert not any(alive(pid) for pid in first_attempt), first_attempt
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)


def test_timeout_stops_every_torchrun_process(spark_launcher, shell, mlflow, tmp_path):
    waiting = take_over(spark_launcher)
    started = time.monotonic()
    result = shell.run(
        "%%distribute --backend spark -n 2 --no-ui --timeout 10\nimport os, time\ndef train(ctx):\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'pid_{{ctx.rank}}'), 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
    )
    error = result.error_in_exec
    assert isinstance(error, RunTimeout) and "--timeout 10" in str(error), error
    assert 10 <= time.monotonic() - started < 30
    pids = [int((tmp_path / f"pid_{rank}").read_text()) for rank in (0, 1)]  # the workers were running
    assert set(pids) == waiting[1]  # ... the ones that were waiting for it
    assert_taken_over(spark_launcher, waiting)
    assert_no_torchrun_left(spark_launcher)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert_no_spark_job_running(spark_launcher)
    run = ended_run(mlflow)
    assert run.info.status == "FAILED" and "--timeout 10" in run.data.tags["dtrain_magic.failure"]


def test_runs_in_a_row_leave_nothing_growing(spark_launcher, shell):
    """Six runs through TorchDistributor in one kernel, every third failing: no torchrun process, open file,
    thread or listening socket accumulates in the notebook (the local backend's 50-run soak: test_soak.py;
    Ray: its interrupt test)."""
    outcomes = []
    for i in range(6):
        shell.user_ns["FAIL"] = i % 3 == 2
        result = shell.run(MIXED_CELL.format(backend="spark"))
        outcomes.append(type(result.error_in_exec).__name__ if result.error_in_exec else "ok")
        if i == 1:  # after the first runs' one-off imports and threads
            assert_no_torchrun_left(spark_launcher)
            before = notebook_snapshot()
    assert_no_torchrun_left(spark_launcher)
    after = notebook_snapshot()
    assert outcomes == ["ok", "ok", "WorkerError"] * 2, outcomes
    assert_nothing_grew(before, after)
    assert_no_spark_job_running(spark_launcher)


def test_a_sweep_runs_every_trial_on_the_first_trials_workers(spark_launcher, shell, tracking_uri, tmp_path_factory):
    """Issue #36 through TorchDistributor: four trials of 2 ranks, two pruned, the best rate found; trials 2-4 on trial
    1's torchrun workers (sweep_checks.py)."""
    check_a_sweep_reuses_its_workers("spark", spark_launcher, tmp_path_factory.mktemp("sweep"), tracking_uri)
    assert_no_torchrun_left(spark_launcher)


# -- --data: a Spark DataFrame, never collected (docs/data.md) ---------------------------------------------------
DATA_ROWS = 1001
DATA_OPTIONS = {"train": dict(batch_size=32, shuffle=True)}


def data_frame(spark_launcher, master=None):
    """A DataFrame of DATA_ROWS ids (3 partitions) with a float and a string column, on the module's session."""
    from pyspark.sql import functions as F

    spark = spark_launcher.session(RunConfig(backend="spark", spark_master=master))
    return (spark.range(DATA_ROWS, numPartitions=3).withColumn("x", F.col("id").cast("float") / 10)
            .withColumn("label", F.lit("text")))


def test_a_dataframe_as_data_is_written_once_read_once_per_epoch_then_reused_on_local(spark_launcher, shell,
                                                                                      capsys):
    """Spark's executors write the DataFrame once as Parquet; each epoch the ranks read every row once (up to the
    even-split rule); the same DataFrame built again, on the local backend, is read from that copy, not written."""
    shell.user_ns["df"] = data_frame(spark_launcher)
    result = shell.run(read_cell("spark", DATA_OPTIONS, flags="--data train=df[id,x]"))
    assert result.error_in_exec is None, result.error_in_exec
    assert_exactly_once(result.result.values, "train", list(range(DATA_ROWS)))
    out = capsys.readouterr().out
    assert "data train: staging Spark DataFrame df[id,x]: written once as Parquet by Spark's executors" in out
    copy = next(iter(staging_area().copies.values())).location
    written = sorted(os.listdir(copy))
    assert any(name.endswith(".parquet") for name in written)
    shell.user_ns["df"] = data_frame(spark_launcher)
    result = shell.run(read_cell("local", DATA_OPTIONS, flags="--data train=df[id,x]", epochs=1))
    assert result.error_in_exec is None, result.error_in_exec
    assert_exactly_once(result.result.values, "train", list(range(DATA_ROWS)))
    assert "data train: reusing the copy of Spark DataFrame df[id,x] an earlier run staged" in capsys.readouterr().out
    assert sorted(os.listdir(copy)) == written


def scoring_frame(spark_launcher):
    """SCORE_ROWS ids, each with 8 seeded normal features as one array column ``x``, made by Spark itself; built
    again, the same plan (so a later run reuses the copy the first one staged)."""
    from pyspark.sql import functions as F

    spark = spark_launcher.session(RunConfig(backend="spark"))
    features = F.array(*[F.randn(seed).cast("float") for seed in range(8)])
    return spark.range(SCORE_ROWS, numPartitions=2).withColumn("x", features)


def test_scored_rows_come_back_as_a_spark_dataframe_that_joins_to_the_input(spark_launcher, shell, tmp_path):
    """``ctx.write`` on Spark (docs/data.md, the way back): 100,000 rows scored by 2 ranks; ``--output preds=preds``
    is a DataFrame Spark reads from the committed parts (never collected), which joins to the input by its own id
    column: every row once on each side, each prediction equal to one process scoring the same rows (1e-6)."""
    import pyarrow.dataset as ds
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    df = scoring_frame(spark_launcher)
    shell.user_ns["df"] = df
    result = shell.run(score_cell("spark", data="df", id_column="id"))
    assert result.error_in_exec is None, result.error_in_exec
    preds = shell.user_ns["preds"]
    assert isinstance(preds, DataFrame)
    # One Spark job: a duplicated or missing row on either side changes one of these counts.
    joined = df.join(preds, "id", "full_outer")
    found = joined.agg(F.count("*"), F.countDistinct("id"), F.count("x"), F.count("pred")).first()
    assert tuple(found) == (SCORE_ROWS,) * 4, found
    output = result.result.outputs["preds"]
    assert output.path.startswith(str(tmp_path / "dtrain_runs")) and output.path.endswith("/outputs/preds")
    assert output.rows == SCORE_ROWS
    # The values: the input collected once, the predictions read from the parts (ids 0..N-1: an id is its row).
    source = df.toArrow()
    x = np.empty((SCORE_ROWS, 8), np.float32)
    x[source.column("id").to_numpy()] = np.stack(source.column("x").to_numpy(zero_copy_only=False))
    written = ds.dataset(output.path).to_table()
    got = np.stack(written.column("pred").to_numpy(zero_copy_only=False))
    worst = float(np.abs(got - scored_by_one_process(x[written.column("id").to_numpy()])).max())
    assert worst <= 1e-6, worst


def test_a_rank_killed_half_way_leaves_no_output_and_no_file(spark_launcher, shell, tmp_path):
    """Rank 1 exits (os._exit) after writing 5 of its 10 batches, with no --max-restarts: the run fails naming it,
    no ``preds`` is bound, and nothing is left under the run's folder (no output, no partial part)."""
    shell.user_ns["df"] = scoring_frame(spark_launcher)  # the copy the test above staged is reused (not rewritten)
    result = shell.run(score_cell("spark", data="df", id_column="id", die="True"))
    error = result.error_in_exec
    assert isinstance(error, WorkerError) and error.rank == 1, error
    assert "rank 1" in str(error), str(error)
    assert "preds" not in shell.user_ns
    assert files_under(tmp_path / "dtrain_runs") == []


def test_bad_dataframes_as_data_are_refused_before_launch(spark_launcher, shell):
    df = data_frame(spark_launcher)
    shell.user_ns.update(df=df, empty=df.limit(0).select("id"))
    cell = "%%distribute --backend spark -n 2 --no-ui {flags}\ndef train(ctx):\n    return {body}\n"
    result = shell.run(cell.format(flags="--data train=df", body="1"))
    assert isinstance(result.error_in_exec, ConfigError)
    assert "column 'label' (string) cannot become a tensor" in str(result.error_in_exec)
    assert "--data train=df[col,...] or df.select(...)" in str(result.error_in_exec)
    result = shell.run(cell.format(flags="--data train=empty", body="1"))
    assert isinstance(result.error_in_exec, ConfigError) and "has no rows" in str(result.error_in_exec)
    result = shell.run(cell.format(flags="", body="df.count()"))  # the DataFrame inside the function
    assert isinstance(result.error_in_exec, CaptureError)
    assert "add `--data df=df`" in str(result.error_in_exec) and "ctx.data('df'" in str(result.error_in_exec)
    staging_area().shutdown()  # (the module's copies; at a kernel's exit)


def test_gpu_setting_problems_are_clear_errors(spark_launcher, shell, mlflow):
    result = shell.run("%%distribute --backend spark --cluster --gpu -n 2 --no-ui\ndef train(ctx): pass\n")
    error = result.error_in_exec
    assert isinstance(error, ConfigError), error
    assert "spark.task.resource.gpu.amount" in str(error) and "Traceback" not in str(error)
    result = shell.run("%%distribute --backend spark --local-mode --gpu -n 2 --no-ui\ndef train(ctx): pass\n")
    assert (isinstance(result.error_in_exec, ConfigError)
            and "spark.driver.resource.gpu.amount" in str(result.error_in_exec))
    assert mlflow.get_experiment_by_name("dtrain_magic") is None  # nothing launched, no run


def test_more_barrier_tasks_than_slots_is_a_clear_error(spark_launcher, shell, mlflow):
    """--cluster on the local[*] session: more tasks than slots fails at once instead of sitting in Spark's
    barrier slot-check retries."""
    started = time.monotonic()
    result = shell.run("%%distribute --backend spark --cluster -n 99 --no-ui\ndef train(ctx): pass\n")
    error = result.error_in_exec
    assert isinstance(error, ConfigError) and error.flag == "--num-processes", error
    assert "99 barrier tasks" in str(error) and f"{os.cpu_count()} task slot(s)" in str(error)
    assert time.monotonic() - started < 10
    assert mlflow.get_experiment_by_name("dtrain_magic") is None  # nothing launched, no run
    assert shell.run("1 + 1").result == 2


def test_kernel_interrupt_stops_every_torchrun_process_within_10_s(spark_launcher, shell, mlflow, tmp_path):
    waiting = take_over(spark_launcher)
    marker = tmp_path / "running"
    sent = interrupt_when_running(marker, wait_s=120)
    result = shell.run(
        "%%distribute --backend spark -n 2 --no-ui\nimport time, pathlib\ndef train(ctx):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('x')\n    time.sleep(300)\n"
    )
    assert_stopped_within_10_s(result, sent, spark_launcher)
    assert_taken_over(spark_launcher, waiting)
    assert_no_spark_job_running(spark_launcher)
    assert ended_run(mlflow).info.status == "KILLED"


# Here, not beside the placement tests above: its first run takes the workers the test before left waiting, and it
# leaves none, so the next test's shutdown of the module's session releases nothing launched in vain.
def test_idle_release_and_distribute_release_free_everything(spark_launcher, shell, capsys):
    """--keep-warm S: the waiting workers go after S idle seconds (no torchrun process, no Spark job left);
    %distribute_release frees them at once."""
    result = shell.run("%%distribute --backend spark -n 2 --keep-warm 3 --no-ui\n"
                       "def train(ctx):\n    return ctx.rank\n")
    assert result.error_in_exec is None and result.result.values == [0, 1], result.error_in_exec
    standby = spark_launcher.standbys.standby
    assert standby is not None and round(standby.expires_at - standby.started_at) == 3
    processes: set[int] = set()  # (it may go before all its workers are up on a loaded machine)
    deadline = time.monotonic() + 30
    while spark_launcher.standbys.standby is standby and time.monotonic() < deadline:
        processes |= spark_launcher.standby_processes()
        time.sleep(0.1)
    assert spark_launcher.standbys.standby is None and standby.released.startswith("idle for")
    assert not any(alive(pid) for pid in processes)
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)
    assert "no workers were waiting" in capture_line_magic(shell, capsys, "%distribute_release")

    result = shell.run("%%distribute --backend spark -n 2 --no-ui\ndef train(ctx):\n    return ctx.rank\n")
    assert result.error_in_exec is None, result.error_in_exec
    processes = held(spark_launcher)
    text = capture_line_magic(shell, capsys, "%distribute_release")
    assert "released 2 TorchDistributor worker(s) (CPU, local mode: on this machine)" in text
    assert spark_launcher.standbys.standby is None and not any(alive(pid) for pid in processes)
    assert_no_torchrun_left(spark_launcher)


def test_the_users_own_session_is_used_and_never_stopped(spark_launcher, shell, capsys, monkeypatch, tmp_path):
    """Databricks, or a notebook that built its own SparkSession: the magic uses it as it is, starts none,
    and never stops it. (Its Python workers' interpreter, fixed when it was built, must import dtrain_magic for
    --cluster: one that cannot is refused before anything launches.)"""
    from pyspark.sql import SparkSession

    spark_launcher.shutdown()  # the module's session was the launcher's own
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # what the refusal below tells a user to do
    user = (
        SparkSession.builder.master("local[2]").appName("the-users-own")
        .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate()
    )
    try:
        # --backend auto (the default) sees the active session
        assert shell.run("%%distribute --dry-run -n 2 --no-ui\ndef train(ctx): pass\n").error_in_exec is None
        assert "TorchDistributor(num_processes=2" in capsys.readouterr().out
        starts = spark_launcher.session_starts
        shell.run(TRAIN_HELPERS)
        result = shell.run(train_cell("spark", extra="--seed 0"))
        assert result.error_in_exec is None, result.error_in_exec
        assert len(result.result.values) == 2
        assert spark_launcher.session_starts == starts and spark_launcher._session is None
        out = capsys.readouterr().out
        assert "on the active SparkSession (local[2])" in out
        # Local mode runs on this machine (the driver): its next workers wait by default, on the user's session.
        standby = spark_launcher.standbys.standby
        assert standby is not None and dict(standby.placement.items)["SparkSession"] == user.sparkContext.applicationId
        assert "wait for the next run" in out
        # Barrier tasks hold executor slots of the user's session: not held unless the cell says so.
        cluster = "%%distribute --backend spark --cluster -n 2 --no-ui {}\ndef train(ctx):\n    return ctx.rank\n"
        # as if the session had been built without PYSPARK_PYTHON: its workers' Python lacks dtrain_magic
        user.sparkContext.pythonExec = str(bare_python(tmp_path))
        try:
            refused = shell.run(cluster.format("")).error_in_exec
        finally:
            user.sparkContext.pythonExec = sys.executable
        assert isinstance(refused, ConfigError) and "cannot import dtrain_magic" in str(refused), refused
        assert user.sparkContext.statusTracker().getActiveJobsIds() == []  # nothing launched
        result = shell.run(cluster.format(""))
        assert result.error_in_exec is None and result.result.values == [0, 1], result.error_in_exec
        assert spark_launcher.standbys.standby is None and "wait for the next run" not in capsys.readouterr().out
        assert standby.released and not held_jobs(spark_launcher)[0]
        result = shell.run(cluster.format("--keep-warm 60"))
        assert result.error_in_exec is None, result.error_in_exec
        held(spark_launcher)
        jobs, _ = held_jobs(spark_launcher)
        assert len(jobs) == 1 and "2 TorchDistributor barrier task(s) (CPU) on local[2]" in capsys.readouterr().out
        assert shell.run("%distribute_release").error_in_exec is None
        assert spark_launcher.standbys.standby is None
        deadline = time.monotonic() + 10
        while user.sparkContext.statusTracker().getActiveJobsIds() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert user.sparkContext.statusTracker().getActiveJobsIds() == []  # the barrier job ended: slots free
        spark_launcher.shutdown()
        assert user.sparkContext._jsc is not None  # still running: the user's to stop
        assert_no_torchrun_left(spark_launcher)
    finally:
        user.stop()


def test_cluster_mode_trains_on_two_executors(spark_launcher, shell, mlflow):
    shell.run(TRAIN_HELPERS)
    cell = train_cell("spark", extra=f"--seed 0 --cluster --spark-master {CLUSTER_MASTER}").replace(
        "    return {", "    return executor_pid(), {"
    )
    shell.run(EXECUTOR_HELPER)
    result = shell.run(cell)
    assert result.error_in_exec is None, result.error_in_exec
    run_result = result.result
    assert spark_launcher._session.sparkContext.master == CLUSTER_MASTER
    executors = [value[0] for value in run_result.values]
    assert None not in executors and len(set(executors)) == 2, executors  # one barrier task per executor
    assert run_result.values[0][1].keys() == run_result.values[1][1].keys()
    for name, weight in run_result.values[0][1].items():
        assert (run_result.values[1][1][name] - weight).abs().max().item() == 0  # DDP replicas agree
    run = mlflow.get_run(run_result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["local_mode"] == "False"
    for node in ("node0", "node1"):  # system metrics from each node's first local rank
        assert any(key.startswith(f"system/{node}/") for key in run.data.metrics), sorted(run.data.metrics)
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)
    # dtrain_magic's own session: the next run's barrier tasks wait by default, one running job holding both slots
    assert len(held_jobs(spark_launcher)[0]) == 1


def test_cluster_mode_max_restarts_resubmits_after_a_killed_rank_and_ends_with_the_same_weights(spark_launcher, shell,
                                                                                                 mlflow, capsys,
                                                                                                 tmp_path):
    """--max-restarts 1 with --cluster (issue #37): rank 1's process (a torchrun worker in an executor JVM's Python
    worker) is SIGKILLed mid-run; the launcher cancels the barrier job, has every rank's watchdog end its worker,
    and submits a new job, which resumes from the step-3 checkpoint and ends with the uninterrupted run's weights;
    nothing of the failed attempt is left running."""

    ensure_restart_reference(shell)
    capsys.readouterr()
    # (an executor's working directory is its own: the markers go where every attempt's ranks find them)
    cell = restart_cell("spark", flags=f"--max-restarts 1 --cluster --spark-master {CLUSTER_MASTER}", kill=True)
    cell = cell.replace('"killed"', repr(str(tmp_path / "killed"))).replace('f"pid_', f'f"{tmp_path}/pid_')
    assert str(tmp_path / "killed") in cell and f"{tmp_path}/pid_" in cell
    restarted = shell.run(cell)
    assert_restarted_once_from_step_3(restarted, "".join(capsys.readouterr()), mlflow)
    assert spark_launcher._session.sparkContext.master == CLUSTER_MASTER
    first_attempt = [int(open(tmp_path / f"pid_{rank}").read().split()[0]) for rank in (0, 1)]
    assert not any(alive(pid) for pid in first_attempt), first_attempt
    assert_no_torchrun_left(spark_launcher)
    assert_no_spark_job_running(spark_launcher)


def test_cluster_mode_interrupt_cancels_the_job_group_within_10_s(spark_launcher, shell, mlflow, tmp_path):
    marker = tmp_path / "running"
    sent = interrupt_when_running(marker, wait_s=240)
    result = shell.run(
        f"%%distribute --backend spark --cluster -n 2 --spark-master {CLUSTER_MASTER} --no-ui\n"
        "import time, pathlib\ndef train(ctx):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('x')\n    time.sleep(300)\n"
    )
    assert spark_launcher._session.sparkContext.master == CLUSTER_MASTER
    assert_stopped_within_10_s(result, sent, spark_launcher)
    assert_no_spark_job_running(spark_launcher)
    assert ended_run(mlflow).info.status == "KILLED"


def test_cluster_mode_barrier_tasks_read_their_share_of_a_dataframe_from_data_dir(spark_launcher, shell, tmp_path):
    """--cluster with --data-dir (a directory every node mounts, here on this machine): the executors write the
    DataFrame there once; each barrier task reads its share on its own executor, every row once."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shell.user_ns["df"] = data_frame(spark_launcher, CLUSTER_MASTER)
    shell.run(EXECUTOR_HELPER)
    cell = read_cell("spark", DATA_OPTIONS, flags=f"--cluster --spark-master {CLUSTER_MASTER} --data train=df[id,x] "
                                                  f"--data-dir {shared}", epochs=1)
    result = shell.run(cell.replace('return {"rank"', 'return {"executor": executor_pid(), "rank"'))
    assert result.error_in_exec is None, result.error_in_exec
    executors = [value["executor"] for value in result.result.values]
    assert None not in executors and len(set(executors)) == 2, executors  # one barrier task per executor
    assert_exactly_once(result.result.values, "train", list(range(DATA_ROWS)))
    staged = list(shared.iterdir())
    assert len(staged) == 1 and staged[0].name.startswith("dtrain_data_") and any(staged[0].rglob("*.parquet"))
    staging_area().shutdown()  # (at the kernel's exit)
    assert not any(shared.iterdir())
