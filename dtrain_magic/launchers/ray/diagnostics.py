"""Ray's exceptions turned into one line per failed rank."""

from __future__ import annotations

from ..._compat.ray import DriverLostActors
from ...errors import summary
from ..base import Failure

DIED = "the Ray worker process died"


def failures_from(error: BaseException) -> list[Failure]:
    """Ray's exception from fit() → one `Failure` per failed rank, each with a one-line reason."""
    failures = []
    worker_failures = getattr(error, "worker_failures", None)
    if isinstance(worker_failures, dict) and worker_failures:
        for rank in sorted(worker_failures):
            failures.append(Failure(rank, _worker_reason(worker_failures[rank])))
        # a rank that died comes first: its peers' errors (gloo's "connection closed by peer") are its consequences
        return sorted(failures, key=lambda failure: not failure.reason.startswith(DIED))
    if isinstance(error, DriverLostActors):  # what to do is in its message: no type name, no "Ray Train failed"
        return [Failure(None, str(error))]
    cause = getattr(error, "controller_failure", None) or error
    return [Failure(None, f"Ray Train failed: {summary(cause, limit=300)}")]


def _worker_reason(exc: BaseException) -> str:
    import ray.exceptions

    inner = getattr(exc, "health_check_failure", None)  # Ray Train's WorkerHealthCheckFailedError
    if isinstance(inner, BaseException):
        if not isinstance(inner, ray.exceptions.RayActorError):
            return f"the Ray worker stopped answering Ray Train's health checks: {summary(inner, limit=300)}"
        exc = inner
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return "the Ray worker process was killed by Ray's memory monitor (out of memory)"
    if isinstance(exc, ray.exceptions.RayActorError):
        # Ray cannot tell which signal it was (its message lists OOM, ray stop and SIGSEGV as guesses). The pump
        # replaces the guess in parentheses with what the worker's machine says, when it says something: a fatal
        # signal Python caught (its stack file), an out-of-memory kill (kernel log, cgroup).
        return (
            f"{DIED} without reporting an error "
            "(killed, e.g. by SIGKILL or the OOM killer, or crashed in native code: Ray does not say which)"
        )
    return summary(exc, limit=300)

