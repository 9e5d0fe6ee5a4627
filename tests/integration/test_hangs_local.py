"""Issue 25 on the local backend, through a real Jupyter kernel (one for the module): a collective only one rank
calls, a rank frozen by SIGSTOP, ``%distribute_stacks`` from a subshell on a live run, the kernel's interrupt
repeated (the cell back within 2 s, nothing of the run alive 10 s later), a rank killed by SIGSEGV, per-rank
output, throughput and a straggler in MLflow.

Every process the kernel starts carries the module's tag (tests/leftovers.py); each test also checks the pids
its own run's workers wrote down.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from hang_cells import (
    FROZEN_CELL,
    HANG_CELL,
    INTERRUPTS,
    assert_dead_within,
    interrupt_cycles,
    module_kernel,
    pids_of,
    wait_for_files,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    yield from module_kernel(tmp_path_factory.mktemp("hangs_local"))


def last_run(kernel):
    experiment = kernel.mlflow.get_experiment_by_name("dtrain_magic")
    return kernel.mlflow.search_runs(experiment_ids=[experiment.experiment_id], max_results=1)[0]


def test_a_collective_only_one_rank_calls_fails_within_30_s_saying_where_both_ranks_are(kernel):
    """The default --hang-timeout (15 s): rank 0 waits in all_reduce, rank 1 returned; the cell says so with the
    cell's line, the MLflow run is FAILED with every rank's stacks, and no worker is left."""
    run = kernel.run(HANG_CELL.format(backend="local", flags="", dir=kernel.cwd), timeout=90)
    took = run.done_at - run.sent_at
    assert run.error is not None and run.error[0] == "RunHung", run.text[-2000:] + str(run.error)
    where = run.error[1]
    assert "rank 0 waits in all_reduce at Cell In[" in where and "rank 1 returned" in where, where
    assert "--hang-timeout 15" in where
    assert "Cell In[" in run.traceback and "dist.all_reduce(t)" in run.traceback  # the stack, with the cell's source
    assert took < 30, took
    assert_dead_within(pids_of(kernel.cwd, 2), 10)
    mlflow_run = last_run(kernel)
    assert mlflow_run.info.status == "FAILED" and "rank 0 waits in all_reduce" in mlflow_run.data.tags[
        "dtrain_magic.failure"]
    stacks = [a.path for a in kernel.mlflow.list_artifacts(mlflow_run.info.run_id, "stacks")]
    assert len(stacks) == 1 and stacks[0].startswith("stacks/hang_"), stacks
    print(f"local: collective by one rank -> RunHung in {took:.1f} s (default --hang-timeout 15)")


def test_a_rank_frozen_by_sigstop_is_named_and_its_peers_stack_shown(kernel):
    run = kernel.run(FROZEN_CELL.format(backend="local", dir=kernel.cwd), timeout=90)
    assert run.error is not None and run.error[0] == "RunStalled", run.text[-2000:] + str(run.error)
    assert "rank 1 is stopped (SIGSTOP" in run.error[1] and "rank 0 waits in all_reduce at Cell In[" in run.error[1]
    assert "--stall-timeout 3" in run.error[1]
    assert_dead_within(pids_of(kernel.cwd, 2), 10)  # a stopped process takes SIGKILL (after SIGTERM's grace)
    stacks = [a.path for a in kernel.mlflow.list_artifacts(last_run(kernel).info.run_id, "stacks")]
    assert len(stacks) == 1 and stacks[0].startswith("stacks/stall_"), stacks


QUIET_CELL = """%%distribute --backend local -n 2 --no-ui --stall-timeout 2
import time
def train(ctx):
    ctx.log(loss=1.0)
    time.sleep(4)  # quiet: no step, metric or output
    return ctx.rank
"""


def test_a_stall_shows_every_ranks_stack_and_the_run_goes_on(kernel):
    run = kernel.run(QUIET_CELL, timeout=90)
    assert run.error is None, run.error
    assert re.search(r"dtrain_magic: no step, metric, output or CPU use from any rank for \d+ s \(--stall-timeout 2\)",
                     run.text), run.text
    assert run.text.count(" is at Cell In[") >= 2 and "the run goes on" in run.text, run.text
    mlflow_run = last_run(kernel)
    assert mlflow_run.info.status == "FINISHED"
    kept = [a.path for a in kernel.mlflow.list_artifacts(mlflow_run.info.run_id, "stacks")]
    assert [path.split("_")[0] for path in kept] == ["stacks/stall"], (kept, run.text)


BLOCKED_CELL = """%%distribute --backend local -n 2 --no-ui
import os, threading
def train(ctx):
    record_pids(ctx.rank, {dir!r})
    release, nothing = os.path.join({dir!r}, "release"), threading.Event()
    while not os.path.exists(release):  # a source that never answers: every rank waits, without CPU
        nothing.wait(0.5)
    return ctx.rank
"""
STALL_TITLE = "no step, metric, output or CPU use from any rank for"


class DefaultStallRun:
    """BLOCKED_CELL in a kernel of its own, watched from a thread of this process from the moment it is sent: its
    ranks idle (no CPU) for the 120 s of the default --stall-timeout, which the suite spends on other tests meanwhile
    (`start_early`)."""

    def __init__(self, cwd):
        self._kernel = module_kernel(cwd)
        self.kernel = next(self._kernel)
        self.run = self.kernel.submit(BLOCKED_CELL.format(dir=self.kernel.cwd))
        self.took: float | None = None  # from both ranks in the loop to the report in the cell
        self.report = ""  # the cell's output 2 s after the report (the stacks below its line)
        self.ended_by_then = False
        self.failure: Exception | None = None
        self._watch = threading.Thread(target=self._watching, name="default-stall-watch", daemon=True)
        self._watch.start()

    def _watching(self) -> None:
        try:
            wait_for_files(self.kernel.cwd, ["pids_0.json", "pids_1.json"], 120)
            blocked = time.monotonic()  # both ranks are in the loop now
            while STALL_TITLE not in self.run.text and not self.run.done.is_set():
                if time.monotonic() - blocked > 150:
                    break
                time.sleep(0.2)
            self.took = time.monotonic() - blocked
            time.sleep(2)  # the stacks below the line
            self.report, self.ended_by_then = self.run.text, self.run.done.is_set()
        except Exception as error:  # the test raises it
            self.failure = error

    def watched(self) -> None:
        self._watch.join(300)  # the ranks' start (at most 120 s) and the report (at most 150 s more)
        assert not self._watch.is_alive(), "the watch did not end"
        if self.failure is not None:
            raise self.failure

    def release(self) -> None:
        open(os.path.join(self.kernel.cwd, "release"), "w").close()

    def close(self) -> None:
        """Release the ranks, shut the kernel down: no process of it may be left (`module_kernel`). Idempotent."""
        self.release()
        next(self._kernel, None)


def start_default_stall(tmp_path_factory):
    stall = DefaultStallRun(tmp_path_factory.mktemp("default_stall"))
    try:
        yield stall
    finally:
        stall.close()


@pytest.mark.start_early.with_args(start_default_stall)  # with_args: the one argument is a function
def test_by_default_a_run_where_every_rank_waits_says_where_each_waits_within_150_s_and_goes_on(started_early):
    """No flag: the default --stall-timeout (120 s) reports, once, each rank's line and stack in the cell and MLflow,
    and the run goes on (here until the test releases the ranks). The suite's one 120-s wait: it starts with the
    session (`start_early`, in a kernel of its own) and is checked here, as strictly as if it had started now."""
    stall = started_early
    try:  # its kernel goes with the test, passed or not: test_local counts every child of this process
        try:
            stall.watched()
            assert STALL_TITLE in stall.report and stall.took < 150, (stall.took, stall.report[-3000:])
            assert not stall.ended_by_then, "the run ended at the stall: it must go on"
        finally:
            stall.release()
        kernel, run, report, took = stall.kernel, stall.run, stall.report, stall.took
        run.wait(60)
        assert run.error is None, (run.error, run.text[-3000:])
        title = re.search(STALL_TITLE + r" (\d+) s \(--stall-timeout 120\): (.*)", report)
        assert title, report
        assert 120 <= int(title.group(1)) < 150, title.group(0)
        for rank in (0, 1):
            assert re.search(rf"rank {rank} waits in wait at Cell In\[\d+\], line \d+", title.group(2)), title.group(2)
        assert report.count("nothing.wait(0.5)") >= 2, report  # each rank's stack, with the cell's source line
        assert "the run goes on" in report and run.text.count(STALL_TITLE) == 1, run.text  # once
        mlflow_run = last_run(kernel)
        assert mlflow_run.info.status == "FINISHED"
        kept = [a.path for a in kernel.mlflow.list_artifacts(mlflow_run.info.run_id, "stacks")]
        assert [path.split("_")[0] for path in kept] == ["stacks/stall"], kept
        assert_dead_within(pids_of(kernel.cwd, 2), 10)
    finally:
        stall.close()
    print(f"local: every rank waiting -> the default stall report in the cell {took:.1f} s after both blocked")


def test_distribute_stacks_and_interrupts_through_the_kernel(kernel):
    """%distribute_stacks from a subshell shows one stack per rank with the cell's line within 2 s; then the
    kernel's interrupt, {INTERRUPTS} times: the cell back within 2 s with RunInterrupted, the run KILLED, no
    process of it alive 10 s later."""
    timings = interrupt_cycles(kernel, "local", INTERRUPTS["local"], stacks_on_first=True)
    assert last_run(kernel).info.status == "KILLED"
    print(f"local: %distribute_stacks {timings['stacks_s']:.2f} s; cell back after the interrupt "
          f"{', '.join(f'{t:.2f}' for t in timings['back_s'])} s")


def test_a_rank_killed_by_sigsegv_is_named_with_where_it_crashed(kernel):
    run = kernel.run(CRASH_CELL, timeout=90)
    assert run.error is not None and run.error[0] == "WorkerError", run.error
    assert "rank 1 failed: process was killed by SIGSEGV" in run.error[1], run.error[1]
    assert "Cell In[" in run.traceback and "ctypes.string_at(0)" in run.traceback, run.traceback


CRASH_CELL = """%%distribute --backend local -n 2 --no-ui
import ctypes, time
def train(ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)  # a segmentation fault, in the thread that runs the function
    time.sleep(30)
"""

STRAGGLER_CELL = """%%distribute --backend local -n 2 --no-ui --result straggled
import time, torch
def train(ctx):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 8)
    ctx.set_model_flops(per_token=6 * 9)  # the model is not prepared (no all-reduce): its FLOPs given
    print(f"rank {ctx.rank} starts")
    # no collective: each rank at its own pace, 9 s each: a straggler is flagged by two evaluations in a row
    # (every 2 s) of rates over at least 2 s of pulses; 6 s left no margin when a rank started late (CI)
    for step in range(90 if ctx.rank == 0 else 18):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss.item(), tokens=32 * 128)
        time.sleep(0.1 if ctx.rank == 0 else 0.5)
    return ctx.rank
"""


def test_per_rank_output_throughput_and_a_straggler_reach_the_result_and_mlflow(kernel):
    run = kernel.run(STRAGGLER_CELL, timeout=120)
    assert run.error is None, run.error
    result = kernel.run("import json; print(json.dumps([straggled.output(0), straggled.output(1), straggled.run_id]))",
                        timeout=30)
    out0, out1, run_id = json.loads(result.text.strip().splitlines()[-1])
    assert out0 == "rank 0 starts\n" and out1 == "rank 1 starts\n"
    mlflow_run = kernel.mlflow.get_run(run_id)
    logs = {a.path for a in kernel.mlflow.list_artifacts(run_id, "logs")}
    assert logs == {"logs/rank_0.txt", "logs/rank_1.txt"}
    assert "rank 1: " in mlflow_run.data.tags.get("dtrain_magic.stragglers", ""), mlflow_run.data.tags
    metrics = mlflow_run.data.metrics
    assert metrics["perf/steps_per_s/rank_0"] > 3 * metrics["perf/steps_per_s/rank_1"]
    assert metrics["perf/tokens_per_s"] > 0
    assert metrics["perf/model_flops_per_s"] == pytest.approx(54 * metrics["perf/tokens_per_s"])
    assert "perf/mfu" not in metrics  # CPU: no peak to compare with
    assert "loss" in metrics
    assert kernel.run("print(sorted(straggled.metrics))").text.strip() == "['loss', 'tokens']"  # the function's own


GPU_DECODER_CELL = """%%distribute --backend local -n 1 --gpu --precision bf16 --no-ui --result on_gpu
import time, torch
def train(ctx):
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 1000))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.prepare(model, opt)
    ids = torch.randint(0, 1000, (8, 128), device=ctx.device)  # token ids: 6 x parameters per token
    started = time.monotonic()
    while time.monotonic() - started < 8:
        with ctx.autocast():
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
    return torch.cuda.get_device_name()
"""


@pytest.mark.gpu
def test_mfu_against_the_gpus_peak(kernel):
    """On a GPU: model FLOP/s from 6 x parameters x tokens/s, and MFU against the GPU's bf16 peak (its data
    sheet's, or $DTRAIN_MAGIC_PEAK_FLOPS); never run on this project's CPU machines."""
    run = kernel.run(GPU_DECODER_CELL, timeout=180)
    assert run.error is None, run.error
    run_id = kernel.run("print(on_gpu.run_id)").text.strip()
    metrics = kernel.mlflow.get_run(run_id).data.metrics
    parameters = 1000 * 256 + 256 * 1000 + 1000
    assert metrics["perf/model_flops_per_s"] == pytest.approx(6 * parameters * metrics["perf/tokens_per_s"], rel=0.2)
    assert 0 < metrics["perf/mfu"] < 1, metrics
