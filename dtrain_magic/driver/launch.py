"""Starting a run's workers: the one sequence a run (`runner`), a session (`session.driver`) and a sweep's trials
share.

`Launch` claims the workers launched ahead for this placement (a standby) or lets the launcher start fresh ones,
names the run's checkpoint root, opens the MLflow run beside the workers (before them, or once they are past their
start when `RunPlan.starts_before_tracking`), listens on the run's channel and hands the `WorkerJob` over. What
happens after the start differs (a run pumps to its end, a session serves cells) and stays with the caller, which
reads `pump`, `running` and `opening` here. `backend_error` is how a backend's own exception reaches the notebook.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any, Callable, Mapping

from ..channel import Channel
from ..errors import LaunchError
from ..payload import Payload, dumps_by_value
from ..tracking import RunOpening, RunTracker
from ..worker import WorkerJob
from ..worker.checkpoints import run_checkpoint_root
from .observer import RunObserver
from .plan import RunPlan
from .pump import Pump

# Workers started before the MLflow run: it opens once they are past their start (a metric, a result,
# an error), or after this long; their metrics wait for it (the live charts get them at once), their
# output does not.
EARLY_START_HOLD_S = 10.0


class Launch:
    """One start of ``plan``'s workers, reporting to ``observer``.

    ``tags`` and ``params`` go to the MLflow run (``params``: hyperparameters, also every rank's ``ctx.params``).
    Construct, then `listen`, `start` and `track`;
    `abandon` undoes a start that failed. Nothing here catches: the caller decides what a failure means.
    """

    def __init__(self, plan: RunPlan, observer: RunObserver, *, tags: Mapping[str, str] | None = None,
                 params: Mapping[str, Any] | None = None, resume: Any = None, reuse_workers: bool = False):
        """``resume``: a `tracking.resume.ResumeTarget` (``--resume``): its checkpoint root and MLflow run, reopened.
        ``reuse_workers`` (a sweep's trials): run on workers launched ahead (launched now when none wait) that then
        wait for the next trial (`WorkerJob.reuse_workers`)."""
        self.plan, self.config, self.launcher, self.observer = plan, plan.config, plan.launcher, observer
        self.params = dict(params or {})
        self.started = time.monotonic()
        # Workers launched ahead for this placement (docs/warm-reruns.md): this launch takes them over.
        reuse_workers = reuse_workers and not self.config.max_restarts  # (a restart launches afresh)
        self.claim = self.launcher.claim_standby(self.config, reuse_workers)
        if self.claim is None and reuse_workers and self.launcher.keep_warm(self.config) is not None:
            self.claim = self.launcher.claim_standby(self.config, True)  # launched now: the next trial reuses them
        self.reuse_workers = reuse_workers and self.claim is not None
        self.checkpoint_root = resume.checkpoint_root if resume is not None else self._checkpoint_root()
        self.early = plan.starts_before_tracking
        self.opening = RunOpening(self.config, tags={"dtrain_magic.checkpoint_root": self.checkpoint_root,
                                                     **(tags or {})},
                                  deferred=self.early, params=self.params,
                                  reopen=resume.run_id if resume is not None else None)
        self.channel: Channel | None = None
        self.pump: Pump | None = None
        self.running: Any = None
        self.tracker: RunTracker | None = None
        self.described = ""

    def _checkpoint_root(self) -> str:
        """ctx.save_checkpoint() without a directory: one directory per run, the same on every backend (Ray
        Train keeps its own checkpoints there); named before the MLflow run exists, recorded in a tag. A standby
        named it at its launch (on Ray it is the TorchTrainer's run name, fixed there)."""
        named = self.claim.checkpoint_root if self.claim is not None else None
        return named or run_checkpoint_root(self.config.storage, uuid.uuid4().hex)

    def listen(self) -> Channel:
        """Warm the backend up (`Launcher.warm_up`) and open the run's channel; returns it."""
        self.launcher.warm_up(self.config)
        self.channel = Channel(host=self.plan.channel_host)
        return self.channel

    def start(self, payload: Payload, data: tuple = ()) -> None:
        """Start the workers (on the claimed standby, or fresh) running ``payload`` with the run's ``data`` sources,
        after the MLflow run unless they may start before it; the observer hears `launched`."""
        channel = self.channel or self.listen()
        job = WorkerJob(payload, self.config, channel.address, checkpoint_root=self.checkpoint_root,
                        strategy=dumps_by_value(self.plan.strategy), data=data, params=self.params,
                        preemption_notice=self.launcher.preemption_notice, reuse_workers=self.reuse_workers)
        self.tracker = None if self.early else self.opening.wait()
        if self.tracker is not None:
            job = dataclasses.replace(job, run_id=self.tracker.run_id)
        self.pump = Pump(self.config, channel, self.observer, self.started, labels=payload.labels)
        start = self.claim.start if self.claim is not None else self.launcher.start
        self.running = start(job, channel.put)
        self.pump.watch_job(self.running)
        self.described = self.launcher.describe(self.config) + (
            "; its workers were launched ahead and waiting" if self.claim else "")
        self.observer.launched(self.config, self.described)

    def track(self, stop: threading.Event | None = None,
              past_start: Callable[[], None] | None = None) -> RunTracker:
        """The MLflow run, attached to the pump; the observer hears `started`. Workers that started first are let
        past their start before it opens (``past_start``; default: until their first metric, result or error, or
        `EARLY_START_HOLD_S`), and their messages keep flowing while it opens."""
        if self.tracker is None:
            if past_start is not None:
                past_start()
            else:
                self.pump.hold(self.running, EARLY_START_HOLD_S, stop)
            self.opening.workers_started = True
            self.tracker = self.pump.pump_while_opening(self.opening, self.running, stop)
        self.observer.started(self.config, self.tracker.run_id, self.tracker.ui_link(), self.described)
        self.pump.attach(self.tracker)
        return self.tracker

    def give_back_unstarted(self) -> None:
        """Stopped before the workers started: a claimed standby waits for the next run."""
        if self.claim is not None and self.running is None:
            self.claim.abandon()

    def abandon(self, status: str, reason: str) -> None:
        """A start that failed or was interrupted: nothing of it stays (workers, channel, MLflow run)."""
        self.give_back_unstarted()
        if self.running is not None:
            self.running.cancel()
        if self.channel is not None:
            self.channel.close()
        self.opening.close(status, reason)


def backend_error(backend: str, exc: BaseException) -> LaunchError:
    """A backend's own exception as the notebook shows it: its message kept, its 40-line traceback dropped."""
    return LaunchError(f"the {backend} backend failed: {type(exc).__name__}: {exc}")


__all__ = ["EARLY_START_HOLD_S", "Launch", "backend_error"]
