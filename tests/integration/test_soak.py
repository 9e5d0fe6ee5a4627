"""Fifty consecutive runs in one kernel, mixed success and failure, leave nothing growing."""

import gc
import os
import threading

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


def snapshot():
    from dtrain_magic.launchers.local import POOL

    gc.collect()
    me = psutil.Process()
    idle = POOL.idle_pids()
    children = [c for c in me.children(recursive=True) if c.pid not in idle and c.status() != psutil.STATUS_ZOMBIE]
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
