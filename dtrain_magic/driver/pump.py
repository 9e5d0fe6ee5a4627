"""`Pump`: moves one run's channel messages to the observer and the MLflow run until the launcher says it ended.

It dispatches on the message's class (`dtrain_magic.channel`): output to the observer, rank 0's metrics to
the tracker and the live charts (or kept until the MLflow run is open), results and errors collected by
rank. It also watches Stop, ``--timeout`` and restarts (a second ``Hello`` from a rank, or the launcher's
``restarted``), and turns the collected results into every rank's value or the error that explains why not.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import cloudpickle

from .. import channel as ch
from ..channel import Channel
from ..config import RunConfig
from ..errors import RunInterrupted, RunTimeout, WorkerError
from ..tracking import RunOpening, RunTracker
from .observer import RunObserver

_POLL_S = 0.05
_ERROR_GRACE_S = 1.0  # after the first worker error, let the others report before stopping them


def _raise_if_stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise RunInterrupted("the run was stopped from the panel; every worker was stopped")


class Pump:
    """Moves channel messages to the observer and the tracker until the launcher says the run ended."""

    def __init__(self, config: RunConfig, channel: Channel, observer: RunObserver, t0: float):
        self.config, self.channel, self.observer, self.t0 = config, channel, observer, t0
        self.t0_wall = time.time() - (time.monotonic() - t0)  # the workers stamp metrics with wall-clock time
        self.tracker: RunTracker | None = None
        self.results: dict[int, bytes] = {}  # rank -> its cloudpickled return value
        self.errors: list[ch.Error] = []
        self.failures: list = []
        self.hellos: set = set()
        self.first_metric_s: float | None = None
        self.waiting_metrics: list[tuple[int, dict, int]] = []  # (step, metrics, stamp) before the run opened

    def hold(self, running: Any, limit_s: float, stop: threading.Event | None) -> None:
        """Before the MLflow run may open: handle the workers' messages (output streams, metrics reach the
        observer and wait for the tracker) until the first metric, result or error, until the launcher sees
        the workers end or fail, or until ``limit_s`` passed: the workers are past their start."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            message = self.channel.get(timeout=_POLL_S)
            if message is not None:
                self.handle(message)
                if isinstance(message, (ch.Metric, ch.Result, ch.Error)):
                    break
            state = running.poll()
            if state.restarted:
                self._forget_attempt(keep_last=False)
            if state.finished or state.failures:
                break  # `run` sees it again and ends the run
            _raise_if_stopped(stop)
            self._raise_if_timed_out()

    def pump_while_opening(self, opening: RunOpening, running: Any, stop: threading.Event | None) -> RunTracker:
        """Open the MLflow run in the background and keep handling messages meanwhile (a kernel's first run
        imports MLflow for seconds): output streams, metrics reach the observer (the live charts) and wait
        for the tracker, results and errors are kept. What the launcher reports (the run ended, a worker
        failed) is left to `run`, which sees it again; Stop and ``--timeout`` work as in `run`."""
        opening.begin()
        while not opening.settled(timeout=0):
            message = self.channel.get(timeout=_POLL_S)
            while message is not None:
                self.handle(message)
                message = self.channel.get(timeout=0) if self.channel.pending() else None
            if running.poll().restarted:
                self._forget_attempt(keep_last=False)
            _raise_if_stopped(stop)
            self._raise_if_timed_out()
        return opening.wait()

    def attach(self, tracker: RunTracker) -> None:
        """The MLflow run is open: log the metrics that came before it, in arrival order, then every next one."""
        self.tracker = tracker
        waiting, self.waiting_metrics = self.waiting_metrics, []
        for step, metrics, stamp in waiting:
            tracker.log_metrics(step, metrics, stamp)

    def _raise_if_timed_out(self) -> None:
        if self.config.timeout and time.monotonic() - self.t0 > self.config.timeout:
            raise RunTimeout(
                f"--timeout {self.config.timeout:g}: the run took longer than {self.config.timeout:g} s; "
                "every worker was stopped"
            )

    def run(self, running: Any, stop: threading.Event | None) -> bool:
        """Pump until the run ends; True if it returned early with every rank's result in hand."""
        first_error_at = None
        while True:
            message = self.channel.get(timeout=_POLL_S)
            while message is not None:
                self.handle(message)
                message = self.channel.get(timeout=0) if self.channel.pending() else None
            state = running.poll()
            if state.restarted:
                self._forget_attempt(keep_last=False)
                first_error_at = None
            if state.finished:
                self.failures = state.failures
                return False
            if running.early_release and not self.errors and not state.failures and self._all_results():
                return True
            now = time.monotonic()
            if (self.errors or state.failures) and first_error_at is None and state.errors_final:
                first_error_at = now
                self.failures = state.failures
            if first_error_at is not None and now - first_error_at > _ERROR_GRACE_S:
                self.failures = state.failures or self.failures
                return False  # the caller cancels the remaining workers
            _raise_if_stopped(stop)
            self._raise_if_timed_out()

    def _forget_attempt(self, keep_last: bool) -> None:
        """The workers were restarted: the earlier attempt's results and errors no longer count."""
        self.hellos.clear()
        self.results.clear()
        self.errors.clear()
        self.channel.retire_earlier_connections(keep_last=keep_last)

    def _all_results(self) -> bool:
        return len(self.results) == self.config.num_processes

    def drain(self) -> None:
        self.channel.wait_readers(timeout=2.0)
        while (message := self.channel.get(timeout=0.01)) is not None:
            self.handle(message)

    def handle(self, message: ch.Message) -> None:
        match message:
            case ch.Output():
                self.observer.output(message.rank, message.stream, message.text)
            case ch.Metric():
                self._metric(message)
            case ch.Result():
                self.results[message.rank] = message.pickled_value
            case ch.Error():
                self.errors.append(message)
            case ch.Status():
                self.observer.status(message.rank, message.state, message.detail)
            case ch.Total():
                self.observer.total(message.steps)
            case ch.DataProgress():
                self.observer.data_progress(message.name, message.epoch, message.batch, message.batches)
            case ch.Hello():
                if message.rank in self.hellos:  # a second Hello from a rank: the backend restarted the workers
                    self._forget_attempt(keep_last=True)
                self.hellos.add(message.rank)
                self.observer.status(message.rank, "starting", message.host)

    def _metric(self, message: ch.Metric) -> None:
        step, metrics, stamp = message.step, message.metrics, message.timestamp_ms
        if self.first_metric_s is None:  # when the worker logged it: the loop may have started later
            self.first_metric_s = stamp / 1000 - self.t0_wall if stamp else time.monotonic() - self.t0
        stamp = stamp or int(time.time() * 1000)  # one stamp for MLflow and the live charts: they match on it
        if self.tracker is None:  # the MLflow run is still opening: `attach` logs these
            self.waiting_metrics.append((step, metrics, stamp))
        else:
            self.tracker.log_metrics(step, metrics, stamp)
        self.observer.metric(step, metrics, timestamp_ms=stamp)

    def collect(self) -> list[Any]:
        """Every rank's value, or the error that explains why not."""
        reported = {error.rank for error in self.errors}
        silent = [f for f in self.failures if f.rank not in reported]
        if silent:  # killed or crashed below Python: that is the root cause, the rest are consequences
            first = silent[0]
            raise WorkerError(first.rank, first.reason, first.detail)
        if self.errors:
            # The earliest error is the cause; later ones are peers noticing (connection reset by peer).
            first = min(self.errors, key=lambda error: error.unix_time)
            raise WorkerError(first.rank, first.summary, first.traceback)
        world = self.config.num_processes
        missing = [rank for rank in range(world) if rank not in self.results]
        if missing:
            raise WorkerError(missing[0], "the worker ended without returning a result (see its output above)")
        return [cloudpickle.loads(self.results[rank]) for rank in range(world)]
