"""Two runs started at once on a fresh kernel, before Ray is up (the panel's Run, twice): one local Ray instance
is started, and both runs succeed.

In a notebook process of its own (as test_notebook_exit.py's): starting Ray from nothing here cannot shut down
the Ray instance that test_ray.py's module shares (what got the earlier attempt at this reverted).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from leftovers import kill_tagged, new_tag, tagged_env, wait_until_none_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("ray")

NOTEBOOK = textwrap.dedent('''
    import os
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from dtrain_magic.driver import runner
    from dtrain_magic.notebook.capture import capture
    from dtrain_magic.config import RunConfig
    from dtrain_magic.launchers import get_launcher
    from dtrain_magic.driver.observer import RunObserver

    assert not ray.is_initialized()
    payload, _ = capture("import os, time\\ndef train(ctx):\\n    time.sleep(1)\\n"
                         "    return ctx.rank, os.getpid()\\n", {})
    config = RunConfig(backend="ray", num_processes=2, tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda: runner.prepare(config, lambda: payload).execute(RunObserver()))
                   for _ in range(2)]
        outcomes = []
        for future in futures:
            try:
                result = future.result(timeout=420)
                outcomes.append(([rank for rank, _ in result.values], result.run_id, {pid for _, pid in result.values}))
            except Exception as exc:
                outcomes.append(repr(exc))
    ok = all(not isinstance(o, str) and o[0] == [0, 1] for o in outcomes)
    separate = ok and outcomes[0][1] != outcomes[1][1] and not outcomes[0][2] & outcomes[1][2]
    instance = get_launcher("ray").instance
    print("VERDICT", "ok" if ok and separate else outcomes, "instance", instance.temp_dir is not None, flush=True)
''')


def test_two_runs_at_once_before_ray_is_up_both_succeed(tmp_path):
    tag = new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=540)
        assert "VERDICT ok instance True" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
        # Its Ray instance goes with it; Ray's dashboard and runtime-env agents notice their raylet is gone on
        # their own poll, which once took over 20 s here (right after another Ray test module): 45 s.
        assert wait_until_none_left(tag, within_s=45) == []
    finally:
        kill_tagged(tag)
