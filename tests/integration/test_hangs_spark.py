"""Issue 25 on Spark (TorchDistributor, local mode), through a real Jupyter kernel whose SparkSession the module
shares: a collective only one rank calls (every rank's stack comes through its watchdog), the kernel's interrupt
repeated, a rank killed by SIGSEGV named with its signal and where it crashed."""

from __future__ import annotations

import pytest

from hang_cells import HANG_CELL, INTERRUPTS, assert_dead_within, interrupt_cycles, module_kernel, pids_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    yield from module_kernel(tmp_path_factory.mktemp("hangs_spark"))


def test_a_collective_only_one_rank_calls_fails_within_30_s_saying_where_both_ranks_are(kernel):
    """The module's first run (it starts the SparkSession too): --hang-timeout 4, the stacks through each worker's
    watchdog (Spark's way to reach a rank on any executor)."""
    run = kernel.run(HANG_CELL.format(backend="spark", flags="--hang-timeout 4", dir=kernel.cwd), timeout=180)
    assert run.error is not None and run.error[0] == "RunHung", run.text[-2000:] + str(run.error)
    assert "rank 0 waits in all_reduce at Cell In[" in run.error[1] and "rank 1 returned" in run.error[1]
    assert "dist.all_reduce(t)" in run.traceback and "_spark_train_fn" not in run.traceback  # the user's frames
    assert_dead_within(pids_of(kernel.cwd, 2), 10)
    print(f"spark: RunHung after {run.done_at - run.sent_at:.1f} s (with the SparkSession's start)")


def test_interrupts_give_the_cell_back_within_2_s_and_leave_nothing_of_the_run(kernel):
    timings = interrupt_cycles(kernel, "spark", INTERRUPTS["spark"])
    print(f"spark: cell back after the interrupt {', '.join(f'{t:.2f}' for t in timings['back_s'])} s; "
          f"runs started in {', '.join(f'{t:.1f}' for t in timings['start_s'])} s")


def test_a_rank_killed_by_a_signal_is_named_with_it_and_where_it_crashed(kernel):
    run = kernel.run(CRASH_CELL, timeout=120)
    assert run.error is not None and run.error[0] == "WorkerError", run.error
    assert "rank 1 failed: process was killed by SIGSEGV" in run.error[1], run.error[1]  # its watchdog's or torchrun's
    assert "ctypes.string_at(0)" in run.traceback, run.traceback  # where: its watchdog read the stack file


CRASH_CELL = """%%distribute --backend spark -n 2 --no-ui
import ctypes, time
def train(ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)  # a segmentation fault, in the thread that runs the function
    time.sleep(30)
"""
