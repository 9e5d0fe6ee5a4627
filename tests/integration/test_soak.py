"""Fifty consecutive runs in one kernel, mixed success and failure, leave nothing growing."""

import time

import psutil
import pytest

from dtrain_magic.errors import WorkerError
from workloads import MIXED_CELL, assert_nothing_grew, notebook_snapshot

pytestmark = pytest.mark.slow

CELL = MIXED_CELL.format(backend="local")


def busy_children():
    from dtrain_magic.launchers import get_launcher

    idle = get_launcher("local").pool.idle_pids()
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in idle and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


def snapshot():
    deadline = time.monotonic() + 15  # the last run's workers are reaped in the background
    while busy_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"children": len(busy_children()), **notebook_snapshot()}


def test_fifty_runs_leave_processes_fds_threads_and_memory_flat(shell):
    outcomes = []
    for i in range(52):
        shell.user_ns["FAIL"] = i % 3 == 2
        result = shell.run(CELL)
        outcomes.append(type(result.error_in_exec).__name__ if result.error_in_exec else "ok")
        if i == 1:  # after warm-up (imports, MLflow store, async logging thread)
            before = snapshot()
    after = snapshot()
    assert outcomes.count("ok") == 35 and outcomes.count(WorkerError.__name__) == 17, outcomes
    print("before", before, "after", after)
    assert after["children"] == before["children"] == 0
    assert_nothing_grew(before, after)
