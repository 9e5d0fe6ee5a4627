"""``--max-restarts N`` on ``--backend spark``: a new barrier job per attempt, resuming from the last checkpoint.

TorchDistributor runs torchrun inside one Spark job with a fixed ``--nnodes``, and Spark aborts a failed barrier
stage whole: nothing inside the job can bring a lost rank back. So the restart is the launcher's: when a rank dies
(its watchdog's connection drops: a kill, a crash, ``os._exit``), a rank's function raises (it says so over the
channel: `RunningJob.worker_failed`), or the job itself fails, `RestartingJob` cancels the attempt the way an
interrupt does (the job group cancelled, this machine's torchrun trees swept, the rank watch closed, so every
watchdog kills what is left of its worker on any host), then submits a new ``TorchDistributor.run`` of the same
`WorkerJob`, up to N times. The function resumes with ``ctx.load_checkpoint()`` from the run's checkpoint root (the
same for every attempt), as on the local backend. The cell says what happens::

    dtrain_magic: rank 1 lost (process was killed by SIGKILL): restarting from step 3, 1 of 2

A SIGTERM to a rank is a preemption notice (`worker.preempt`): every rank checkpoints at the same step boundary,
raises `Preempted` and returns; the job ends, and the restart resumes right after that checkpoint::

    dtrain_magic: every rank checkpointed for a preemption notice (SIGTERM): restarting from step 9, 1 of 1

The attempt's `LaunchState` says ``restarted`` once, with that line as its ``restart_note``: the pump forgets the
failed attempt (its connections are retired) and the MLflow run, the same for every attempt, gets a ``restarts``
metric and a ``dtrain_magic.restart_<n>`` tag per restart.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ...channel import Output
from ...errors import log_dropped
from ...worker.preempt import all_preempted, checkpointed_words
from ...worker.resume_point import resume_point
from ..base import Emit, Failure, LaunchState, RunningJob

# A rank's reported error restarts the run after this long, unless a rank's death is seen meanwhile (the cause then).
_REPORTED_WAIT_S = 6.0


class RestartingJob(RunningJob):
    """One run's attempts: ``first`` (a fresh launch or a claimed standby's), then ``relaunch()`` per restart."""

    early_release = True

    def __init__(self, first: RunningJob, relaunch: Callable[[], RunningJob], restarts: int, emit: Emit,
                 checkpoint_root: str | None):
        self.current = first
        self._relaunch, self._emit, self._root = relaunch, emit, checkpoint_root
        self.restarts, self.restarts_left = restarts, restarts
        self._reported: list[Failure] = []  # ranks whose function raised in this attempt (over the channel)
        self._reported_at = 0.0
        self._lock = threading.Lock()
        self._stopped = False

    def worker_failed(self, rank: int | None, summary: str) -> None:
        with self._lock:
            if not self._reported:
                self._reported_at = time.monotonic()
            self._reported.append(Failure(rank, summary))

    def poll(self) -> LaunchState:
        state = self.current.poll()
        with self._lock:
            cause = self._cause(state)
            if cause is None or self.restarts_left == 0 or self._stopped:
                return LaunchState(state.finished, state.failures, errors_final=self.restarts_left == 0)
            self.restarts_left -= 1
            preempted = self._preempted(state)
            self._reported = []
        note = self._restart(cause, preempted)
        return LaunchState(False, [], errors_final=False, restarted=True, restart_note=note)

    def _cause(self, state: LaunchState) -> Failure | None:
        """What failed this attempt, if anything did. A dead rank is the cause before any rank's reported error:
        its peers report theirs (gloo's "Connection closed by peer") the moment it dies, while its watchdog may take
        up to `SparkJob._SIGNAL_WAIT_S` to name its signal. So a reported error alone counts once it is older than
        that, or once the attempt has ended."""
        if state.failures:
            return state.failures[0]
        if self._reported and (state.finished or time.monotonic() - self._reported_at > _REPORTED_WAIT_S):
            return self._reported[0]
        return None

    def _preempted(self, state: LaunchState) -> bool:
        """Did this attempt end because every rank checkpointed for a preemption notice (`worker.preempt`)? Each
        rank then raised `Preempted` (said over the channel) and returned: no rank died, the job ended."""
        return state.finished and not state.failures and all_preempted([f.reason for f in self._reported])

    def _restart(self, cause: Failure, preempted: bool) -> str:
        """Stop the failed attempt (nothing of it left running), say so in the cell, launch the next one."""
        attempt = self.restarts - self.restarts_left
        who = f"rank {cause.rank}" if cause.rank is not None else "the job"
        why = checkpointed_words() if preempted else f"{who} lost ({_short(cause.reason)})"
        note = f"{why}: restarting from {resume_point(self._root).words()}, {attempt} of {self.restarts}"
        self._emit(Output(None, "stderr", f"dtrain_magic: {note}\n"))
        try:
            self.current.cancel()  # the job group, this machine's torchrun trees, the rank watch (remote workers)
        except Exception as exc:  # py4j's or Connect's errors while cancelling: the sweep and watchdogs still ran
            log_dropped(__name__, "_restart", exc)
        self.current = self._relaunch()
        return note

    def release(self) -> None:
        self._stop()
        self.current.release()

    def cancel(self) -> None:
        self._stop()
        self.current.cancel()

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True

    def dump_stacks(self, workers: Any, timeout: float) -> dict[int, tuple[str, str]]:
        return self.current.dump_stacks(workers, timeout)


def _short(reason: str) -> str:
    """A failure's first line, without the watch's long guess in parentheses."""
    line = (reason.strip().splitlines() or [""])[0]
    return line.split(" (killed by a signal", 1)[0] or "no reason given"


class RestartingClaim:
    """A claimed standby (`standby.Claim`) whose run restarts under ``--max-restarts``: its first attempt runs on
    the waiting workers, every later one is a fresh launch (``relaunch(job, emit)``)."""

    def __init__(self, claim: Any, relaunch: Callable[[Any, Emit], RunningJob]):
        self._claim, self._relaunch = claim, relaunch
        self.checkpoint_root = claim.checkpoint_root

    def start(self, job: Any, emit: Emit) -> RunningJob:
        first = self._claim.start(job, emit)
        return RestartingJob(first, lambda: self._relaunch(job, emit), job.config.max_restarts, emit,
                             job.checkpoint_root)

    def abandon(self) -> None:
        self._claim.abandon()
