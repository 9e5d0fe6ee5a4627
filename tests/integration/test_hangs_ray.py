"""Issue 25 on Ray (Ray Train's TorchTrainer on the local instance the module's kernel starts): a collective only
one rank calls, the kernel's interrupt repeated (Ray Train's abort goes on in the background) with the stacks of
a worker on "another machine" through a task on its node, a rank killed by SIGSEGV named with its signal."""

from __future__ import annotations

import json

import pytest

from hang_cells import HANG_CELL, INTERRUPTS, assert_dead_within, interrupt_cycles, module_kernel, pids_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    yield from module_kernel(tmp_path_factory.mktemp("hangs_ray"))


def test_a_collective_only_one_rank_calls_fails_within_30_s_saying_where_both_ranks_are(kernel):
    """The module's first run (it starts Ray too): --hang-timeout 4."""
    run = kernel.run(HANG_CELL.format(backend="ray", flags="--hang-timeout 4", dir=kernel.cwd), timeout=240)
    assert run.error is not None and run.error[0] == "RunHung", run.text[-2000:] + str(run.error)
    assert "rank 0 waits in all_reduce at Cell In[" in run.error[1] and "rank 1 returned" in run.error[1]
    assert "dist.all_reduce(t)" in run.traceback
    assert_dead_within(pids_of(kernel.cwd, 2), 10)
    print(f"ray: RunHung after {run.done_at - run.sent_at:.1f} s (with Ray's start and a cold fit)")


REMOTE_DUMP = """
from dtrain_magic.driver.stacks import Worker, rank_stack
from dtrain_magic.state import kernel_state
run = kernel_state().live_runs()[0]
here = run.pump.collector.workers[1]
elsewhere = Worker(1, here.pid, "another-host", here.stack_file, here.node)  # as if rank 1 were on another node
state, text = run.launch.running.dump_stacks({1: elsewhere}, 1.5)[1]
print(json.dumps([state, rank_stack(1, state, text, elsewhere).where(run.pump.labels)]))
"""


def test_interrupts_give_the_cell_back_within_2_s_and_a_remote_workers_stacks_come_through_its_node(kernel):
    """The kernel's interrupt (once: each Ray run takes 13-16 s to start, the suite's time budget; the next
    test's run starts after it): the cell back within 2 s (Ray Train's abort goes on in the background),
    nothing of the run alive 10 s later. During the run, rank 1's stacks are asked for as if it ran on
    another machine: a Ray task pinned to its node dumps them."""
    timings = interrupt_cycles(kernel, "ray", INTERRUPTS["ray"], while_first_runs="import json" + REMOTE_DUMP)
    dump = timings["first"]
    assert dump.error is None, dump.error
    state, where = json.loads(dump.text.strip().splitlines()[-1])
    assert state == "dumped" and where.startswith("rank 1 is at Cell In["), where
    print(f"ray: cell back after the interrupt {', '.join(f'{t:.2f}' for t in timings['back_s'])} s; "
          f"runs started in {', '.join(f'{t:.1f}' for t in timings['start_s'])} s")


def test_a_rank_killed_by_a_signal_is_named_with_it(kernel):
    run = kernel.run(CRASH_CELL, timeout=180)
    assert run.error is not None and run.error[0] == "WorkerError", run.error
    assert "rank 1 failed: the Ray worker process died without reporting an error: killed by SIGSEGV" in run.error[1]
    assert "ctypes.string_at(0)" in run.traceback, run.traceback  # where, from its stack file


CRASH_CELL = """%%distribute --backend ray -n 2 --no-ui
import ctypes, time
def train(ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)  # a segmentation fault, in the thread that runs the function
    time.sleep(30)
"""
