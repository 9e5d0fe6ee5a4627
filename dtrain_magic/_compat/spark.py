"""pyspark's private parts, written against pyspark 4.3 (constraints.txt: 4.3.0).

Every use (by ``launchers/spark/driver.py`` and ``sessions.py``) is a nicety with a fallback, so no pyspark version is
refused:

- `default_session`: ``SparkSession._instantiatedSession`` (a session built in another thread), only on pyspark
  < 3.5, which lacks the public ``SparkSession.active()``. **Fallback**: the thread's active session only.
- `context_stopped`: ``SparkContext._jsc is None`` after ``stop()`` (pyspark has no public "is stopped").
  **Fallback** when missing: taken as running (a stopped session then fails the run with Spark's own error).
- `task_slots`: the JVM SparkContext (``sc._jsc.sc()``): its executors and ``maxNumConcurrentTasks``, a
  ``private[spark]`` Scala method; ``--cluster`` waits for enough barrier-task slots. **Gated**: on an unknown
  version (without the opt-in) or when it fails, not counted (Spark decides, after its own retries).
- `clear_job_group`: the ``spark.jobGroup.id`` local property, reset after a run (pyspark has no
  ``clearJobGroup``). **Fallback**: left set until the next run's replaces it.
- `TORCHRUN_WRAPPER_MODULE`: the module TorchDistributor runs torchrun through, to find a cancelled run's process
  trees. **Fallback** if renamed: the trees are still found by ``torch.distributed.run``.
- `launches_in_own_session`: the ``subprocess`` module as ``pyspark.ml.torch.distributor`` sees it, so that the
  torchrun process tree a launch of ours starts in local mode gets a session of its own (``start_new_session``):
  Jupyter interrupts a kernel by signalling its whole process group, and a SIGINT there would end torchrun, so an
  interrupt meant for a cell would kill an interactive session's ranks or the next run's waiting workers (the
  notebook stops a run's workers itself when its cell is interrupted). **Gated**: on an unknown version the
  launch is left as pyspark makes it.
- `quiet_launches`: the ``sys`` module as ``pyspark.ml.torch.distributor`` sees it, so that what it writes to
  ``sys.stdout`` from a launch of ours (local mode: torchrun's merged output, copied line by line from the launch's
  thread) goes to the kernel's backend log instead of whichever cell runs then (a waiting launch's lines would land
  in the next cell); and, through the ``subprocess`` view above, environment variables the launch's processes get
  where the notebook has none (``OMP_NUM_THREADS``: torchrun prints a banner when it sets it itself). **Gated**: on
  an unknown version the launch prints as pyspark makes it.
- `route_distributor_log`: a TorchDistributor's ``logger`` attribute (pyspark gives it a logger of its own that
  prints "Started local training ..." to stderr), pointed at the kernel's backend log. **Fallback**: left as is
  when the attribute is missing.
- `connect_server_here` / `connect_server_python` (Spark Connect): whether the Connect server is on this machine (the
  ``SPARK_LOCAL_REMOTE`` variable pyspark sets when ``builder.remote("local[...]")`` started the server in this
  process, else the client's ``_builder.host``), and the ``PYSPARK_PYTHON`` that server's JVM was started with (read
  through the in-process SparkContext's py4j gateway, ``SparkContext._active_spark_context._jvm``): a Connect server
  takes the executors' Python from its own environment only, so a variable set later changes nothing.
  **Fallback**: not on this machine / not known (no refusal is made on what cannot be read).

Public API that differs between a classic session and a Spark Connect one lives here too, so that launchers and
data staging need not tell them apart: `is_connect`, `job_group` and `cancel_group` (a job group on a classic
session, an operation tag on a Connect one).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from typing import Any, Iterator, Mapping, TextIO

from ..errors import log_dropped
from . import Library

PYSPARK = Library(key="pyspark", title="pyspark", module="pyspark", known=("4.3",), tested="4.3.0",
                  requirement="pyspark==4.3.0")
TORCHRUN_WRAPPER_MODULE = "pyspark.ml.torch.torch_run_process_wrapper"
_MISSING = object()


def default_session() -> Any:
    """The SparkSession a notebook's ``SparkSession.builder.getOrCreate()`` would return: this thread's
    active one, else the process's default (built in another thread); None when there is none."""
    from pyspark.sql import SparkSession

    active = getattr(SparkSession, "active", None)  # pyspark >= 3.5
    if active is not None:
        try:
            return active()
        except Exception as exc:  # PySparkRuntimeError NO_ACTIVE_OR_DEFAULT_SESSION
            log_dropped(__name__, "default_session", exc)
            return None
    return SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)


def is_connect(session: Any) -> bool:
    """True for a Spark Connect session (``SparkSession.builder.remote(...)``, Databricks serverless), which has no
    SparkContext, no JVM on this side and no job groups."""
    return (type(session).__module__ or "").startswith("pyspark.sql.connect")


@contextlib.contextmanager
def job_group(session: Any, group: str, description: str) -> Iterator[None]:
    """The Spark jobs this thread starts inside belong to ``group``, which `cancel_group` cancels, interrupting their
    tasks: a job group (``interruptOnCancel``) on a classic session, an operation tag on a Connect one (thread-local
    there too)."""
    if is_connect(session):
        session.addTag(group)
        try:
            yield
        finally:
            session.removeTag(group)
        return
    context = session.sparkContext
    context.setJobGroup(group, description, interruptOnCancel=True)
    try:
        yield
    finally:
        clear_job_group(context)


def cancel_group(session: Any, group: str) -> None:
    """Cancel the jobs `job_group` tagged ``group`` (Connect: interrupt the operations with that tag)."""
    if is_connect(session):
        session.interruptTag(group)
    else:
        session.sparkContext.cancelJobGroup(group)


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def connect_server_here(session: Any) -> bool:
    """Whether a Connect session's server runs on this machine (its executors then write and read this machine's
    files, and reach its loopback)."""
    if "SPARK_LOCAL_REMOTE" in os.environ:  # pyspark started a local server in this process
        return True
    try:
        host = str(session.client._builder.host)
    except Exception as exc:  # private Connect client attributes: read as remote, the safe answer
        log_dropped(__name__, "connect_server_here", exc)
        return False
    return host in _LOOPBACK or host.startswith("127.")


UNKNOWN = object()


def connect_server_python() -> Any:
    """The ``PYSPARK_PYTHON`` of the local Connect server this process started (None when it was started without
    one), or `UNKNOWN` (no such server here, an unknown pyspark, or the JVM cannot be asked)."""
    if "SPARK_LOCAL_REMOTE" not in os.environ or not PYSPARK.allowed():
        return UNKNOWN
    try:
        from pyspark import SparkContext

        context = SparkContext._active_spark_context
        return UNKNOWN if context is None else context._jvm.java.lang.System.getenv("PYSPARK_PYTHON")
    except Exception as exc:  # private attributes and a py4j call: unknown
        log_dropped(__name__, "connect_server_python", exc)
        return UNKNOWN


def context_stopped(context: Any) -> bool:
    """True once ``context`` (a SparkContext) was stopped. Raises what its attributes raise (Spark Connect)."""
    return getattr(context, "_jsc", _MISSING) is None


def task_slots(context: Any) -> tuple[int, int] | None:
    """(executors registered, barrier-task slots of the default resource profile), or None when this
    cannot be told (an unknown pyspark, Spark Connect, another cluster manager)."""
    if not PYSPARK.allowed():
        return None
    try:
        jsc = context._jsc.sc()
        executors = max(0, len(jsc.statusTracker().getExecutorInfos()) - 1)  # minus the driver
        slots = jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile())
        return executors, int(slots)
    except Exception as exc:  # private JVM API through py4j: unknown
        log_dropped(__name__, "task_slots", exc)
        return None


def clear_job_group(context: Any) -> None:
    """Forget the job group ``setJobGroup`` set on this thread."""
    try:
        context.setLocalProperty("spark.jobGroup.id", None)
    except Exception as exc:  # a context stopped meanwhile: its job group went with it
        log_dropped(__name__, "clear_job_group", exc)


_own_session = threading.local()


class _SubprocessForDistributor:
    """``subprocess`` as pyspark's distributor module sees it: the same, except that a process started from a thread
    inside `launches_in_own_session` gets a session (and process group) of its own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - subprocess's own name
        if getattr(_own_session, "on", False):
            kwargs.setdefault("start_new_session", True)
        defaults = getattr(_own_session, "env", None)
        if defaults:
            kwargs["env"] = {**defaults, **(kwargs.get("env") or os.environ)}
        return subprocess.Popen(*args, **kwargs)


class _SysForDistributor:
    """``sys`` as pyspark's distributor module sees it: the same, except that ``sys.stdout`` is `quiet_launches`'s
    output for a thread inside it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    @property
    def stdout(self) -> Any:
        return getattr(_own_session, "output", None) or sys.stdout


@contextlib.contextmanager
def launches_in_own_session() -> Iterator[bool]:
    """While the calling thread runs ``TorchDistributor.run`` inside this, the processes it starts on this machine
    (local mode: TorchDistributor's torchrun wrapper, hence torchrun and its workers) are outside the notebook's
    process group. Yields whether that is so (False on an unknown pyspark)."""
    installed = _install_subprocess_view()
    _own_session.on = installed
    try:
        yield installed
    finally:
        _own_session.on = False


def _install_subprocess_view() -> bool:
    if not PYSPARK.allowed():
        return False
    try:
        import pyspark.ml.torch.distributor as distributor
    except ImportError as exc:
        log_dropped(__name__, "_install_subprocess_view", exc)
        return False
    if getattr(distributor, "subprocess", None) is subprocess:
        distributor.subprocess = _SubprocessForDistributor()
    return isinstance(getattr(distributor, "subprocess", None), _SubprocessForDistributor)


@contextlib.contextmanager
def quiet_launches(output: TextIO, env: Mapping[str, str]) -> Iterator[bool]:
    """While the calling thread runs ``TorchDistributor.run`` inside this, what pyspark writes to ``sys.stdout`` for
    it goes to ``output``, and the processes it starts get ``env``'s variables where their environment has none.
    Yields whether that is so (False on an unknown pyspark)."""
    installed = _install_subprocess_view() and _install_sys_view()
    if installed:
        _own_session.output, _own_session.env = output, dict(env)
    try:
        yield installed
    finally:
        _own_session.output = _own_session.env = None


def _install_sys_view() -> bool:
    import pyspark.ml.torch.distributor as distributor  # (imported already: `_install_subprocess_view`)

    if getattr(distributor, "sys", None) is sys:
        distributor.sys = _SysForDistributor()
    return isinstance(getattr(distributor, "sys", None), _SysForDistributor)


def route_distributor_log(distributor: Any, logger: Any) -> None:
    """``distributor`` (a TorchDistributor) logs through ``logger`` instead of the stderr handler pyspark gave it."""
    if hasattr(distributor, "logger"):
        distributor.logger = logger
