"""User-facing errors.

Every error the magic raises on purpose derives from :class:`DistributeError`. IPython calls
``_render_traceback_`` when an exception defines it, so these errors show as a short paragraph in the
cell instead of a long traceback through IPython, Spark or Ray internals, while the cell still fails
(nbclient and "Run all" stop on it).
"""

from __future__ import annotations

import os
import re
import traceback


class DistributeError(Exception):
    """Base class of the errors ``%%distribute`` shows to the user."""

    title = "DistributeError"

    def _render_traceback_(self) -> list[str]:
        return [f"{self.title}: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class ConfigError(DistributeError, ValueError):
    """A flag or value is invalid. Raised before anything is launched."""

    title = "ConfigError"

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


class CaptureError(DistributeError):
    """The cell does not define a function that can be shipped to workers."""

    title = "CaptureError"


class MissingDependencyError(DistributeError):
    """An optional dependency (pyspark, ray, deepspeed, Java) is not installed or too old."""

    title = "MissingDependencyError"


class UnsupportedVersionError(DistributeError):
    """An installed library is at a version whose private parts the magic does not know (`dtrain_magic._compat`);
    the message says which versions it knows and how to try this one anyway. Raised before anything is launched."""

    title = "UnsupportedVersionError"


class LaunchError(DistributeError):
    """The backend could not start or place the workers."""

    title = "LaunchError"


class WorkerError(DistributeError):
    """A worker failed. Carries the failing rank and the worker's own (already shortened) traceback."""

    title = "WorkerError"

    def __init__(self, rank: int | None, summary: str, remote_traceback: str = ""):
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        who = "a worker" if rank is None else f"rank {rank}"
        text = f"{who} failed: {summary}"
        if remote_traceback:
            text += "\n\n" + remote_traceback.rstrip()
        super().__init__(text)


class RunInterrupted(DistributeError):
    """The run was interrupted from the notebook (kernel interrupt or the Stop button)."""

    title = "RunInterrupted"


class RunStopped(RunInterrupted):
    """Every rank stopped at one step, as the notebook asked (a pruned sweep trial: `driver.step_stop`): the run
    ended cleanly, no rank left in a collective, with no value. ``step``: the ``ctx.step`` count every rank
    stopped after."""

    title = "RunStopped"

    def __init__(self, message: str, step: int):
        self.step = step
        super().__init__(message)


class StopAtStep(BaseException):
    """Raised in a worker by ``ctx.step()`` (``ctx.train_step``, or ``ctx.log`` in a loop that never steps) once
    the rank made the step the notebook asked every rank to stop at; `worker.run.run_worker` ends the rank
    cleanly on it. A BaseException, like KeyboardInterrupt, so that a loop's ``except Exception`` does not keep
    training past it (``finally`` blocks still run). ``step``: the rank's ``ctx.step`` count."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"stopped after step {step}, as the notebook asked every rank")


class RunTimeout(DistributeError):
    """The run exceeded ``--timeout``."""

    title = "RunTimeout"


class RunHung(DistributeError):
    """A rank ended and the others made no progress for ``--hang-timeout`` seconds (a collective only some ranks
    called, a peer that left): the message says where each rank is; every worker was stopped. ``stacks``: the
    rendered stack of each rank."""

    title = "RunHung"

    def __init__(self, message: str, stacks: str = ""):
        self.stacks = stacks
        super().__init__(message + (f"\n\n{stacks}" if stacks else ""))


class RunStalled(RunHung):
    """No rank made progress (no step, metric, output or CPU use) for ``--stall-timeout`` seconds (default 120) and
    ``--on-stall fail`` was given."""

    title = "RunStalled"


class UnsupportedCodeError(DistributeError, RuntimeError):
    """The user's function does something that cannot work in this run (raised in the worker, e.g.
    ``init_process_group("nccl")`` on CPU, or ``ray.train`` outside ``--backend ray``), or the cell's
    call line cannot be used; the message says what to change."""

    title = "UnsupportedCodeError"


class WeightsError(DistributeError, ValueError):
    """Weights given to ``ctx.prepare(..., weights=PATH)`` cannot be loaded: the path is missing or holds no
    checkpoint, or its tensor names or shapes do not match the model (all of them are listed). Raised in every
    worker before anything is loaded or trained."""

    title = "WeightsError"


class SessionError(DistributeError):
    """An interactive session (`dtrain_magic.session`) cannot do what was asked (none is open, a rank is still busy,
    ranks out of range), or it ended; the message says what to do instead."""

    title = "SessionError"


class SessionLost(SessionError):
    """The session's ranks ended without being stopped (a rank died, or its backend ended the launch): its state is
    gone; a new session starts afresh."""

    title = "SessionLost"


class RankError(DistributeError):
    """A session cell raised on one or more ranks: each rank's error with the cell's line (``Cell In[N], line L``).
    The session goes on; ``failures`` maps each failing rank to its (summary, traceback)."""

    title = "RankError"

    def __init__(self, message: str, failures: dict[int, tuple[str, str]]):
        self.failures = failures
        super().__init__(message)


class CellInterrupted(RunInterrupted):
    """A session cell was interrupted (the kernel's interrupt, the monitor's Stop) on every rank running it; the
    session and its state are kept, unless a rank could not be freed (the message says which, and how to restart)."""

    title = "CellInterrupted"

    def __init__(self, message: str, stuck: tuple[int, ...] = ()):
        self.stuck = stuck
        super().__init__(message)


class CellTimeout(RunTimeout):
    """A session cell ran longer than its ``--timeout`` and was interrupted on every rank running it."""

    title = "CellTimeout"

    def __init__(self, message: str, stuck: tuple[int, ...] = ()):
        self.stuck = stuck
        super().__init__(message)


# -- short tracebacks: the user's frames only, notebook cells shown as ``Cell In[N], line L`` --------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def short_traceback(exc: BaseException, labels: dict[str, str] | None = None) -> str:
    """The exception's traceback without dtrain_magic's own leading frames (the harness around user code)."""
    labels = labels or {}
    frames = traceback.extract_tb(exc.__traceback__)
    while frames and frames[0].filename.startswith(_PACKAGE_DIR):
        frames.pop(0)
    if isinstance(exc, DistributeError):  # raised by dtrain_magic's own adapters: the user's line is the point
        while len(frames) > 1 and frames[-1].filename.startswith(_PACKAGE_DIR):
            frames.pop()
    lines = ["Traceback (most recent call last):\n"]
    for frame in frames:
        where = labels.get(frame.filename)
        if where:
            lines.append(f"  {where}, line {frame.lineno}, in {frame.name}\n")
        else:
            lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n')
        if frame.line:
            lines.append(f"    {frame.line.strip()}\n")
    lines.extend(traceback.format_exception_only(type(exc), exc))
    return "".join(lines)


def summary(exc: BaseException, limit: int | None = None, sentence: bool = False) -> str:
    """An exception in one line: ``TypeName: first line of its message`` (the only "exception to one line"
    helper; every backend's diagnostics use it). ``limit``: at most that many characters (ends with "…").
    ``sentence``: the message's first sentence instead, without the type name, for libraries whose
    messages name the problem themselves and run on over several lines (MLflow's)."""
    if sentence:
        text = " ".join(str(exc).split()) or type(exc).__name__
        line = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    else:
        lines = [part.strip() for part in str(exc).splitlines() if part.strip()]
        line = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if limit is not None and len(line) > limit:
        return line[: limit - 1] + "…"
    return line


def log_dropped(module: str, where: str, exc: BaseException) -> None:
    """An error deliberately not raised (cleanup after a peer is gone, a best-effort probe with a fallback): logged
    at debug level with its reason, under the module's logger (``logging.getLogger("dtrain_magic").setLevel(
    logging.DEBUG)`` shows them all)."""
    import logging

    logging.getLogger(module).debug("%s: ignored %s", where, summary(exc))
