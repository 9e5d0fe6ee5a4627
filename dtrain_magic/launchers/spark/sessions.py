"""What the Spark launcher asks of a SparkSession, for a classic session and a Spark Connect one alike.

A Connect session (``SparkSession.builder.remote(...)``, Databricks serverless and standard access) has no
SparkContext: whatever a classic session answers through it (master, application id, status tracker, task slots)
is read here from what Connect offers (``spark.conf``, ``session_id``), or reported as not known (None), in which
case the launcher lets Spark decide rather than guess.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any

from ..._compat import spark as spark_compat
from ...errors import ConfigError, log_dropped
from .diagnostics import is_loopback_master

is_connect = spark_compat.is_connect

_LOCAL_N = re.compile(r"local\[(\d+)(,\d+)?\]$")


def master(spark: Any) -> str:
    """The session's master URL (on Connect: the server's ``spark.master``; "" when it does not say)."""
    if is_connect(spark):
        return _connect_conf(spark, "spark.master") or ""
    return spark.sparkContext.master


def _connect_conf(spark: Any, key: str) -> str | None:
    """A setting of a Connect session's server, or None where it is unset or not readable (a managed server may
    refuse reads of its settings)."""
    try:
        return spark.conf.get(key, None)
    except Exception as exc:  # a managed Connect server may refuse the read with any error: unset
        log_dropped(__name__, "_connect_conf", exc)
        return None


def identity(spark: Any) -> str:
    """What tells this session from another: its application id, or a Connect session's id (a new Connect session,
    even on the same server, gets fresh workers: they were launched through the old one)."""
    if is_connect(spark):
        return f"connect:{spark.session_id}"
    return spark.sparkContext.applicationId


def alive(spark: Any) -> bool:
    """Not stopped (a Connect session: not closed)."""
    try:
        if is_connect(spark):
            return not spark.is_stopped
        return not spark_compat.context_stopped(spark.sparkContext)
    except Exception as exc:  # a session torn down meanwhile raises what its client does: not alive
        log_dropped(__name__, "alive", exc)
        return False


def executors_here(spark: Any) -> bool:
    """Whether the session's executors run on this machine (a loopback master, and on Connect a server here whose
    master it says)."""
    if not is_connect(spark):
        return is_loopback_master(master(spark))
    url = master(spark)
    return bool(url) and spark_compat.connect_server_here(spark) and is_loopback_master(url)


def writer_here(spark: Any) -> bool:
    """Whether what the session's executors write (a staged DataFrame) lands in this machine's files: a classic
    session's driver is this process; a Connect server may be anywhere."""
    return not is_connect(spark) or spark_compat.connect_server_here(spark)


def task_slots(spark: Any) -> tuple[int, int] | None:
    """(executors, barrier-task slots), or None when not known. On Connect only ``local[N]`` tells (N slots, in the
    server's driver); the executors of a cluster behind a Connect server cannot be counted from here."""
    if not is_connect(spark):
        return spark_compat.task_slots(spark.sparkContext)
    found = _LOCAL_N.match(master(spark))
    return (0, int(found.group(1))) if found else None


def task_cpus(spark: Any) -> str:
    """``spark.task.cpus`` (CPUs each task takes; "1" when unset or not readable)."""
    if is_connect(spark):
        return _connect_conf(spark, "spark.task.cpus") or "1"
    return spark.sparkContext.getConf().get("spark.task.cpus", "1")


def running_jobs(spark: Any, group: str) -> list[int]:
    """Ids of the jobs of ``group`` still running; always [] on Connect, which has no status tracker (there the end
    of the operation, which the launch's thread waits for, is what says the jobs ended)."""
    if is_connect(spark):
        return []
    try:
        tracker = spark.sparkContext.statusTracker()
        running = []
        for job_id in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job_id)
            if info is not None and info.status in ("RUNNING", "UNKNOWN"):
                running.append(job_id)
        return running
    except Exception as exc:  # a stopping SparkContext's tracker: no job left to wait for
        log_dropped(__name__, "running_jobs", exc)
        return []


def check_cluster_python(spark: Any) -> None:
    """``--cluster``: the barrier tasks run the executors' Python, which must import dtrain_magic. Checked before
    anything launches where that Python is on this machine (a Connect server this notebook started; a classic
    session whose master is local or on loopback), refused with the fix; a remote cluster's is not looked into."""
    if is_connect(spark):
        check_connect_cluster_python(spark)
        return
    context = getattr(spark, "sparkContext", None)
    if context is None or not is_loopback_master(getattr(context, "master", None)):
        return
    python = getattr(context, "pythonExec", None) or "python3"
    if not _imports_dtrain_magic(python):
        raise ConfigError(
            "--cluster",
            f"this SparkSession's Python workers run `{python}` (its PYSPARK_PYTHON when the SparkContext was "
            "created: read then and never again), which cannot import dtrain_magic; set os.environ['PYSPARK_PYTHON'] "
            "= sys.executable before building the SparkSession (stop this one and build it again), or leave out "
            "--cluster (local mode runs this notebook's Python); nothing was launched",
        )


_IMPORTS: dict[tuple[str, str], bool] = {}  # (python, cwd) -> whether it imports dtrain_magic (asked once each)


def _imports_dtrain_magic(python: str) -> bool:
    """Whether ``python`` (a path, or a name on the PATH) imports dtrain_magic, run where a local master's workers
    run (this process's directory). This interpreter itself is not asked."""
    found = shutil.which(python)
    if found and os.path.abspath(found) == os.path.abspath(sys.executable):  # not realpath: a venv's python links
        return True  # to its base interpreter, which another venv (without dtrain_magic) shares
    key = (python, os.getcwd())
    if key not in _IMPORTS:
        try:
            probe = subprocess.run([found or python, "-c", "import dtrain_magic"], capture_output=True, timeout=60)
            _IMPORTS[key] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):  # no such interpreter: its workers could not start either
            _IMPORTS[key] = False
    return _IMPORTS[key]


def check_connect_cluster_python(spark: Any) -> None:
    """``--cluster`` on a Spark Connect server this notebook started (``builder.remote("local[...]")``): its barrier
    tasks run the Python its JVM was started with, read from ``PYSPARK_PYTHON`` then and never again (a server stopped
    and started again in the same process runs in the same JVM). Without it they
    run ``python3`` from the PATH, which lacks pyarrow (the launch would fail in Spark's task with ``No module named
    'pyarrow'``): refused before anything is launched, with the fix."""
    if not is_connect(spark):
        return
    python = spark_compat.connect_server_python()
    if python is None:
        raise ConfigError(
            "--cluster",
            "the local Spark Connect server was started without PYSPARK_PYTHON, so its barrier tasks would run "
            "`python3` from the PATH (no pyarrow, no dtrain_magic); set os.environ['PYSPARK_PYTHON'] = sys.executable "
            "before the notebook's first SparkSession (restart the kernel: Spark's JVM keeps the environment it "
            "started with), or leave out --cluster (local mode); nothing was launched",
        )
