"""pyspark's private parts, written against pyspark 4.3 (constraints.txt: 4.3.0).

Every use, all by ``launchers/spark/driver.py``, is a nicety with a fallback, so no pyspark version is refused:

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
"""

from __future__ import annotations

from typing import Any

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
    except Exception as exc:
        log_dropped(__name__, "task_slots", exc)
        return None


def clear_job_group(context: Any) -> None:
    """Forget the job group ``setJobGroup`` set on this thread."""
    try:
        context.setLocalProperty("spark.jobGroup.id", None)
    except Exception as exc:
        log_dropped(__name__, "clear_job_group", exc)
