"""``--backend spark`` on a Spark Connect session, really started: a local Connect server
(``SparkSession.builder.remote("local[2]")``, what pyspark starts from the jar it ships) in a notebook process of its
own (`spark_connect_notebook.py`: a local Connect server runs a classic SparkContext in its client's process, which
cannot coexist with the suite's SparkSession). One notebook runs every check on one server, in order; the tests read
what it recorded. (``--cluster`` on a server started without ``PYSPARK_PYTHON`` is refused on what the server says, a
JVM's environment that only a fresh process can change: the refusal is tests/unit/test_spark_connect_logic.py's,
the reading of the server's value is here.)

Every process either notebook starts carries a tag in its environment (tests/leftovers.py): once it exited, none is
left (the Connect server's JVM, its Python workers, torchrun, the ranks, the watchdogs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from data_workloads import assert_exactly_once
from leftovers import kill_tagged, new_tag, tagged_env, wait_until_none_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark_connect_notebook.py")
DATA_ROWS = 101  # as the notebook's DataFrame


def notebook(tmp_path_factory) -> dict:
    """Run the notebook script (one Connect server) to its end; what it recorded, and the seconds it took."""
    cwd = tmp_path_factory.mktemp("connect")
    out, tag = cwd / "out.json", new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{cwd}/mlflow.db", SPARK_LOCAL_IP="127.0.0.1",
                     DS_ACCELERATOR="cpu")
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, SCRIPT, str(out)], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=480)
        seconds = time.monotonic() - started
        left = wait_until_none_left(tag, within_s=20)
    finally:
        kill_tagged(tag)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found.get("done"), (found, done.stderr[-3000:])
    return {**found, "seconds": seconds, "left": left}


@pytest.fixture(scope="module")
def connect(tmp_path_factory) -> dict:
    found = notebook(tmp_path_factory)
    times = {name: found[name].get("seconds") for name in ("local", "warm", "data", "cluster")}
    print(f"\nspark connect: server start {found['server_start_s'][0]} s; runs (s) {times}; "
          f"the notebook {found['seconds']:.0f} s in all")
    return found


def ok(check: dict) -> dict:
    assert check.get("error") is None, check.get("error")
    return check


def test_auto_picks_spark_and_a_local_mode_run_trains(connect):
    local = ok(connect["local"])
    assert local["backend"] == "spark"  # --backend auto, with only a Connect session active
    assert sorted(value["rank"] for value in local["values"]) == [0, 1]
    assert {value["world"] for value in local["values"]} == {2}
    assert len({value["weight"] for value in local["values"]}) == 1  # DDP: the ranks agree
    assert "on the active Spark Connect session (server master local[2])" in local["out"]


def test_a_re_run_takes_over_the_waiting_workers(connect):
    warm = ok(connect["warm"])
    assert warm["waiting"] and warm["claimed"] == 1
    assert sorted(value["pid"] for value in warm["values"]) == warm["waiting"]  # the waiting workers ran it
    assert "its workers were launched ahead and waiting" in warm["out"]
    assert warm["session_starts"] == 0  # the user's Connect session, never one of the magic's own
    assert warm["values"][0]["weight"] == connect["local"]["values"][0]["weight"]


def test_a_connect_dataframe_is_staged_by_the_server_and_read_once_per_epoch(connect):
    data = ok(connect["data"])
    assert "data train: staging Spark DataFrame df[id,x]: written once as Parquet by Spark's executors" in data["out"]
    assert_exactly_once(data["values"], "train", list(range(DATA_ROWS)))


def test_an_interrupt_stops_the_run_and_leaves_no_torchrun(connect):
    for name in ("interrupt", "cluster_interrupt"):
        stopped = connect[name]
        assert stopped["error"] == "RunInterrupted", stopped
        assert stopped["run_pids"], f"{name}: no torchrun process was running when the interrupt came"
        assert stopped["cell_back_s"] < 10 and stopped["left_after_10s"] == [], stopped


def test_cluster_mode_runs_barrier_tasks_on_the_server_and_a_re_run_takes_them_over(connect):
    cluster = ok(connect["cluster"])
    assert sorted(value["rank"] for value in cluster["values"]) == [0, 1]
    assert cluster["values"][0]["weight"] == connect["local"]["values"][0]["weight"]
    interrupted = connect["cluster_interrupt"]
    assert interrupted["waiting"] and interrupted["taken_over"]  # the plan line said so
    assert not interrupted["standby_left"]  # --keep-warm 0: nothing held after it


def test_the_servers_python_is_read_from_its_jvm(connect):
    assert connect["server_python"] == sys.executable  # what --cluster's refusal reads (None: refused)


def test_nothing_is_left_once_the_notebook_ends(connect):
    assert connect["released"]["left"] == []  # %distribute_release, spark.stop(): no torchrun below the notebook
    assert connect["left"] == []  # and once it exited, no process it started (JVM, Python workers, ranks, watchdogs)
