"""Fifty consecutive runs in one kernel, mixed success and failure, leave nothing growing."""

import gc
import threading
import time

import psutil
import pytest

from dtrain_magic.errors import WorkerError

pytestmark = pytest.mark.slow

CELL = """%%distribute --backend local -n 2 --no-ui
def train(ctx):
    import torch
    model, opt = ctx.prepare(torch.nn.Linear(4, 1), None)
    ctx.log(loss=float(ctx.rank))
    if FAIL and ctx.rank == 1:
        raise RuntimeError("planned failure")
    return ctx.rank
"""


def busy_children():
    from dtrain_magic.launchers.local import POOL

    idle = POOL.idle_pids()
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
    gc.collect()
    me = psutil.Process()
    children = busy_children()
    return {
        "children": len(children),
        "fds": me.num_fds(),
        "threads": threading.active_count(),
        "rss_mb": me.memory_info().rss / 2**20,
        "listening": len([c for c in me.net_connections("inet") if c.status == "LISTEN"]),
    }


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
    assert after["listening"] == before["listening"]
    assert after["fds"] <= before["fds"] + 5
    assert after["threads"] <= before["threads"] + 2
    assert after["rss_mb"] <= before["rss_mb"] + 150
