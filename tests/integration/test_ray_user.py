"""``--backend ray`` on the notebook's own Ray (issue 33): a real kernel whose first cell is the user's ``ray.init``
(every CPU of it: 2, as ``ray.init()`` gives on this 2-core machine), then the magic's runs in the same kernel. The
next run's waiting workers give way to the notebook's own task and Ray Data and come back once Ray is quiet (a warm
re-run); a Ray Dataset with a map step on a Ray the workers fill trains (materialized first, said in the cell); a
worker killed from outside by SIGSEGV is named with it. One kernel, one Ray, for the module."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from hang_cells import module_kernel, wait_for_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("ray")

USER_RAY = """import ray, ray.data
ray.init(num_cpus=2, include_dashboard=False)
assert ray.cluster_resources()['CPU'] == 2
"""

WAITING = """
import time
from dtrain_magic.launchers import get_launcher
def standby_ready(within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        standby = get_launcher("ray").standbys.standby
        if standby is not None and standby.all_ready.wait(0.2):
            return True
        time.sleep(0.2)
    return False
"""

USER_WORK = """
import time
@ray.remote
def answer():
    return 42
started = time.monotonic()
assert ray.get(answer.remote(), timeout=60) == 42
task_s = time.monotonic() - started
started = time.monotonic()
rows = ray.data.range(2000).map_batches(lambda batch: {"id": batch["id"] * 2}).take_all()
data_s = time.monotonic() - started
assert sorted(row["id"] for row in rows) == [2 * i for i in range(2000)]
print(f"USER task {task_s:.2f} data {data_s:.2f} gave_way {get_launcher('ray').give_way.released}")
"""

TRAIN_CELL = """%%distribute --backend ray -n 2 --no-ui --result r
def train(ctx):
    ctx.log(x=1)
    return ctx.rank
"""

DATA_CELL = """%%distribute --backend ray -n 2 --no-ui --data train=ds --result r
def train(ctx):
    seen = []
    for batch in ctx.data("train", batch_size=100):
        seen += batch["id"].tolist()
    return seen
"""

KILLED_CELL = """%%distribute --backend ray -n 2 --no-ui --keep-warm 0
import os, time
def train(ctx):
    if ctx.rank == 1:
        with open(os.path.join({dir!r}, "pid_1"), "w") as handle:
            handle.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    generator = module_kernel(tmp_path_factory.mktemp("ray_user"))
    kernel = next(generator)
    assert kernel.run(USER_RAY, timeout=120).error is None
    assert kernel.run(WAITING).error is None
    yield kernel
    next(generator, None)  # the kernel's exit ends its Ray; no process of it may be left


def _number(text: str, name: str) -> float:
    return float(re.search(rf"{name} ([0-9.]+)", text).group(1))


def test_waiting_workers_give_way_to_the_notebooks_own_work_and_come_back_for_a_warm_rerun(kernel):
    first = kernel.run(TRAIN_CELL, timeout=300)
    assert first.error is None, first.text[-2000:] + str(first.error)
    assert "on this notebook's own Ray wait for the next run" in first.text
    ready = kernel.run("print('READY', standby_ready(240))", timeout=300)
    assert "READY True" in ready.text, ready.text  # they hold both CPUs now
    work = kernel.run(USER_WORK, timeout=150)
    assert work.error is None, work.text[-2000:] + str(work.error)
    task_s, data_s = _number(work.text, "task"), _number(work.text, "data")
    assert task_s < 10 and data_s < 10, work.text[-1000:]
    assert "gave_way 1" in work.text
    back = kernel.run("print('READY', standby_ready(240))", timeout=300)  # quiet again: they come back
    assert "READY True" in back.text, back.text
    rerun = kernel.run(TRAIN_CELL + "\n", timeout=120)
    assert rerun.error is None, rerun.text[-2000:] + str(rerun.error)
    assert "its workers were launched ahead and waiting" in rerun.text
    first_step = kernel.run("print('TTFS', r.time_to_first_step_s)")
    assert _number(first_step.text, "TTFS") < 3, first_step.text
    print(f"ray (user's): own task {task_s:.2f} s, Ray Data {data_s:.2f} s after a run; warm re-run's first step "
          f"{_number(first_step.text, 'TTFS'):.2f} s")


def test_a_ray_dataset_with_a_map_step_trains_on_a_ray_the_workers_fill(kernel):
    """-n 2 on the user's 2 CPUs: Ray Data's tasks would find none; the Dataset is materialized first, and says so.
    (The waiting workers of the last test go first: a run with --data takes none.)"""
    made = kernel.run("ds = ray.data.range(6000).map_batches(lambda batch: {'id': batch['id'] + 7})", timeout=60)
    assert made.error is None, made.error
    started = time.monotonic()
    run = kernel.submit(DATA_CELL)
    run.wait(240)
    seconds = time.monotonic() - started
    assert run.error is None, run.text[-3000:] + str(run.error)
    assert "materializing Ray Dataset ds" in run.text and "materialized 6,000 rows" in run.text, run.text[-2000:]
    rows = kernel.run("print('ROWS', sorted(x for seen in r.values for x in seen) == list(range(7, 6007)))")
    assert "ROWS True" in rows.text, rows.text  # every row exactly once
    materialized = re.search(r"materialized 6,000 rows in ([0-9.]+) s", run.text).group(1)
    print(f"ray (user's): a Ray Dataset with a map step on a full Ray trained in {seconds:.1f} s (materialized first, "
          f"in {materialized} s)")


def test_a_worker_killed_from_outside_by_sigsegv_is_named_with_it(kernel):
    pid_file = os.path.join(kernel.cwd, "pid_1")
    if os.path.exists(pid_file):
        os.unlink(pid_file)
    run = kernel.submit(KILLED_CELL.format(dir=kernel.cwd))
    wait_for_files(kernel.cwd, ["pid_1"], 240)
    time.sleep(0.5)
    os.kill(int(open(pid_file).read()), signal.SIGSEGV)  # kill -SEGV PID, from outside the worker
    run.wait(120)
    assert run.error is not None and run.error[0] == "WorkerError", run.text[-2000:] + str(run.error)
    assert "rank 1 failed: the Ray worker process died without reporting an error: killed by SIGSEGV" in run.error[1]
