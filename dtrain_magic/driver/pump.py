"""`Pump`: moves one run's channel messages to the observer and the MLflow run until the launcher says it ended.

It dispatches on the message's class (`dtrain_magic.channel`): output to the observer (and kept per rank:
`RunResult.output`, MLflow's ``logs/rank_N.txt``), rank 0's metrics to the tracker and the live charts (or
kept until the MLflow run is open), every rank's pulse to the progress watch (`watch.Watch`: ``--hang-timeout``,
``--stall-timeout``) and the throughput (`perf.Throughput`: steps/s per rank, stragglers, samples/s, MFU),
results and errors collected by rank. It also watches Stop, ``--timeout`` and restarts (a second ``Hello`` from
a rank, or the launcher's ``restarted``), collects every rank's stack on a hang, a stall or a request
(`stacks.StackCollector`, `Pump.stacks_now`), and turns the collected results into every rank's value or the
error that explains why not.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import cloudpickle

from .. import channel as ch
from .. import procfacts
from ..channel import Channel
from ..config import RunConfig
from ..errors import RunHung, RunInterrupted, RunStalled, RunStopped, RunTimeout, WorkerError
from ..tracking import RunOpening, RunTracker
from .observer import RunObserver
from .perf import Throughput
from .resizes import ResizeLog
from .stacks import StackCollector, merge_ended, rank_stack, render_all, whereabouts
from .step_stop import StepStop, StopPlan
from .watch import Watch

_POLL_S = 0.05
_ERROR_GRACE_S = 1.0  # after the first worker error, let the others report before stopping them
_PERF_EVERY_S = 2.0  # throughput to the observer
_PERF_METRICS_EVERY_S = 5.0  # ... and to MLflow
OUTPUT_KEPT = 4 << 20  # characters of each rank's output kept for RunResult.output and the MLflow artifact


class RankOutputs:
    """Each rank's output as it came (stdout and stderr together), the last `OUTPUT_KEPT` characters of it."""

    def __init__(self) -> None:
        self.chunks: dict[int | None, list[str]] = {}
        self.sizes: dict[int | None, int] = {}
        self.dropped: dict[int | None, int] = {}

    def add(self, rank: int | None, text: str) -> None:
        chunks = self.chunks.setdefault(rank, [])
        chunks.append(text)
        size = self.sizes.get(rank, 0) + len(text)
        while size > OUTPUT_KEPT and len(chunks) > 1:
            gone = chunks.pop(0)
            size -= len(gone)
            self.dropped[rank] = self.dropped.get(rank, 0) + len(gone)
        self.sizes[rank] = size

    def text(self, rank: int | None) -> str:
        dropped = self.dropped.get(rank, 0)
        head = f"[... {dropped} earlier characters left out]\n" if dropped else ""
        return head + "".join(self.chunks.get(rank, []))

    def by_rank(self) -> dict[int, str]:
        return {rank: self.text(rank) for rank in sorted(r for r in self.chunks if r is not None)}


def _raise_if_stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise RunInterrupted("the run was stopped from the panel; every worker was stopped")


class Pump:
    """Moves channel messages to the observer and the tracker until the launcher says the run ended."""

    def __init__(self, config: RunConfig, channel: Channel, observer: RunObserver, t0: float,
                 labels: dict[str, str] | None = None):
        self.config, self.channel, self.observer, self.t0 = config, channel, observer, t0
        self.t0_wall = time.time() - (time.monotonic() - t0)  # the workers stamp metrics with wall-clock time
        self.tracker: RunTracker | None = None
        self.results: dict[int, bytes] = {}  # rank -> its cloudpickled return value
        self.written: dict[int, str] = {}  # rank -> what its ctx.write calls wrote (`Result.outputs`), to commit
        self.errors: list[ch.Error] = []
        self.failures: list = []
        self.hellos: set = set()
        self.first_metric_s: float | None = None
        self.waiting_metrics: list[tuple[int, dict, int]] = []  # (step, metrics, stamp) before the run opened
        self.labels = dict(labels or {})  # the workers' file names of notebook cells → "Cell In[N]"
        self.watch = Watch(config.hang_timeout, config.stall_timeout, restartable=config.max_restarts > 0)
        self.perf = Throughput(config.num_processes, config.tp * config.pp)
        self.collector = StackCollector(self.labels)
        self.outputs = RankOutputs()
        # world size, restarts and steps lost over the run's relaunches (--max-restarts, --elastic)
        self.resizes = ResizeLog(config.num_processes, config.grad_accum, int(self.t0_wall * 1000))
        self.data_read: set[str] = set()  # the --data names rank 0 read batches of (ctx.data), to name the unread
        self.artifacts: dict[str, str] = {}  # MLflow artifacts waiting for the run (stacks), path → text
        self.thinned = 0  # metric values the workers left out (a loop logging faster than MLflow takes)
        self.last_step = 0
        self.stop_plan = StopPlan(config.num_processes)  # fed every pulse: a `StepStop` picks its step from them
        self._stop_asked_at: float | None = None
        self.restart_notes: list[str] = []  # one per restart the launcher made (`LaunchState.restart_note`)
        self._restart_metrics: list[tuple[int, dict, int | None]] = []  # relaunches before the MLflow run was open
        self._running: Any = None
        self._perf_at = self._perf_metrics_at = 0.0

    def watch_job(self, running: Any) -> None:
        """The launched job: its own way to reach the workers' stacks (`RunningJob.dump_stacks`)."""
        self.collector.remote = running.dump_stacks
        self._running = running

    def hold(self, running: Any, limit_s: float, stop: threading.Event | None) -> None:
        """Before the MLflow run may open: handle the workers' messages (output streams, metrics reach the
        observer and wait for the tracker) until the first metric, result or error, until the launcher sees
        the workers end or fail, or until ``limit_s`` passed: the workers are past their start."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            message = self.channel.get(timeout=_POLL_S)
            if message is not None:
                self.handle(message)
                if isinstance(message, (ch.Metric, ch.Metrics, ch.Result, ch.Error, ch.Stopped)):
                    break
            state = running.poll()
            if state.restarted:
                self._restarted(state)
            if state.finished or state.failures:
                break  # `run` sees it again and ends the run
            self._check_stop(stop)
            self._raise_if_timed_out()
            self._tick(time.monotonic())

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
            self._check_stop(stop)
            state = running.poll()
            if state.restarted:
                self._restarted(state)
            self._raise_if_timed_out()
            self._tick(time.monotonic())
        return opening.wait()

    def attach(self, tracker: RunTracker) -> None:
        """The MLflow run is open: log the metrics that came before it, in arrival order, then every next one."""
        self.tracker = tracker
        waiting, self.waiting_metrics = self.waiting_metrics, []
        for step, metrics, stamp in waiting:
            tracker.log_metrics(step, metrics, stamp)
        for step, metrics, stamp in self._restart_metrics:
            tracker.log_metrics(step, metrics, stamp, logged=False)
        self._restart_metrics = []

    def _check_stop(self, stop: threading.Event | None) -> None:
        """Stop (the event set) raises `RunInterrupted`; a `StepStop` asked to stop at a step sends every rank the
        step once the pump can pick it (`StopPlan.choose`), and falls back to Stop when they cannot all stop there
        (`StopPlan.fallback`)."""
        _raise_if_stopped(stop)
        if not isinstance(stop, StepStop) or not stop.wanted:
            return
        now, plan = time.monotonic(), self.stop_plan
        if plan.target is None:
            self._stop_asked_at = self._stop_asked_at or now
            target = plan.choose(now, self._stop_asked_at)
            if target is not None and self.channel.send_to_ranks(ch.StopAt(target, stop.reason or ""),
                                                                 self.config.num_processes):
                plan.sent(target, now)
            return
        ended = set(self.results) | set(plan.stopped_ranks) | {e.rank for e in self.errors if e.rank is not None}
        why = plan.fallback(now, ended)
        if why is not None:
            raise RunInterrupted(f"the run was stopped: {why}; every worker was stopped")

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
                self._restarted(state)
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
            for failure in state.failures:
                if failure.rank is not None:
                    self.watch.ended(failure.rank, f"died: {failure.reason}", now)
            self._check_stop(stop)
            self._raise_if_timed_out()
            self._tick(now)

    def _restarted(self, state: Any) -> None:
        """The launcher relaunched every worker (`LaunchState.restarted`; under ``--elastic`` maybe on another number
        of ranks, the results to wait for): forget the failed attempt; the MLflow run gets what `ResizeLog.relaunched`
        says (the world size, the ``restarts`` counter) and, at its end, a tag per relaunch (`restart_notes`)."""
        self._forget_attempt(keep_last=False)
        self._relaunched(state.world_size, state.restart_note or "every worker restarted")

    def _relaunched(self, world: int | None, note: str) -> None:
        self.restart_notes.append(note)
        for step, metrics, stamp in self.resizes.relaunched(world):
            if self.tracker is not None:
                self.tracker.log_metrics(step, metrics, stamp, logged=False)
            else:
                self._restart_metrics.append((step, metrics, stamp))

    def _forget_attempt(self, keep_last: bool) -> None:
        """The workers were restarted: the earlier attempt's results and errors no longer count."""
        self.hellos.clear()
        self.results.clear()
        self.written.clear()  # an earlier attempt's parts are never committed
        self.errors.clear()
        self.watch.forget()
        self.perf.forget()
        self.stop_plan.forget()
        self.channel.retire_earlier_connections(keep_last=keep_last)

    # -- progress, hangs, stalls, throughput -----------------------------------------------------------------
    def _tick(self, now: float) -> None:
        """Once per loop: the hang and stall rules, and the throughput every few seconds."""
        hung = self.watch.hung(now)
        if hung:
            self._hung(hung)
        if self.watch.stalled(now):
            self._stalled(now)
        if now - self._perf_at >= _PERF_EVERY_S:
            self._perf_at = now
            self._report_perf(now)

    def command_started(self, ranks: tuple[int, ...], now: float) -> None:
        """A session's command went to ``ranks``: their quiet time counts from now (idle between cells is no stall)."""
        for rank in ranks:
            self.watch.activity(rank, now)

    def check_stall(self, now: float) -> None:
        """The stall rule alone (a session's command: its ranks end no run, so no hang rule): report a stall."""
        if self.watch.stalled(now):
            self._stalled(now)

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _hung(self, live: list[int]) -> None:
        ended = self.watch.ended_ranks()
        stacks = merge_ended(self.collector.collect(live), ended)
        where = whereabouts(stacks, self.labels)
        timeout = self.config.hang_timeout
        first = min(ended)
        self._keep_stacks("hang", stacks)
        raise RunHung(
            f"the run hung: {where}. No progress from rank{'s' if len(live) > 1 else ''} "
            f"{', '.join(map(str, live))} for {timeout:g} s since rank {first} ended (--hang-timeout {timeout:g}); "
            "every worker was stopped",
            render_all(stacks, self.labels))

    def _stalled(self, now: float) -> None:
        stacks = merge_ended(self.collector.collect(self.watch.live()), self.watch.ended_ranks())
        quiet = self.watch.quiet_for(now)
        title = (f"no step, metric, output or CPU use from any rank for {quiet:.0f} s (--stall-timeout "
                 f"{self.config.stall_timeout:g}): {whereabouts(stacks, self.labels)}")
        path = self._keep_stacks("stall", stacks)
        text = render_all(stacks, self.labels)
        if self.config.on_stall == "fail":
            raise RunStalled(f"the run stalled: {title}; every worker was stopped (--on-stall fail)", text)
        self._tell_stacks(f"{title} (every rank's stacks: MLflow artifact {path}; the run goes on)", text)

    def stacks_now(self) -> tuple[str, str]:
        """Every rank's stack right now (the Stacks button, ``%distribute_stacks``): (one line per rank, the
        stacks). Kept for the MLflow run too. Callable from another thread while the pump runs."""
        stacks = merge_ended(self.collector.collect(self.watch.live() or None), self.watch.ended_ranks())
        self._keep_stacks("requested", stacks)
        title = f"{self._elapsed():.1f} s into the run: {whereabouts(stacks, self.labels) or 'no rank has started'}"
        return title, render_all(stacks, self.labels)

    def _keep_stacks(self, why: str, stacks: dict) -> str:
        path = f"stacks/{why}_{self._elapsed():.0f}s.txt"
        text = render_all(stacks, self.labels, full=True) + "\n"
        if self.tracker is not None:
            self.tracker.log_text_soon(text, path)
        else:
            self.artifacts[path] = text
        return path

    def _tell_stacks(self, title: str, text: str) -> None:
        stacks = getattr(self.observer, "stacks", None)
        if stacks is not None:
            stacks(title, text)

    def _report_perf(self, now: float) -> None:
        snap = self.perf.snapshot()
        if not snap.steps_per_s:
            return
        show = getattr(self.observer, "perf", None)
        if show is not None:
            show(snap)
        if self.tracker is not None and now - self._perf_metrics_at >= _PERF_METRICS_EVERY_S:
            self._perf_metrics_at = now
            self.tracker.log_metrics(self.last_step, snap.metrics(), logged=False)
            if self.perf.flagged:
                self.tracker.set_tags_soon({"dtrain_magic.stragglers": "; ".join(self.perf.flagged.values())})

    def death_details(self, failure: Any) -> tuple[str, str]:
        """(reason, detail) of a rank that died without reporting: the launcher's words, with what its stack file
        and the kernel say (a fatal signal and where, an out-of-memory kill), its last stack rendered."""
        reason, detail = failure.reason, failure.detail or ""
        if failure.rank is None:
            return reason, detail
        if detail.startswith(procfacts.HEADER):  # a dump from the rank's watchdog (Spark)
            stack = rank_stack(failure.rank, "dumped", detail, self.collector.workers.get(failure.rank))
            return reason, stack.render(self.labels)
        found = self.collector.death_evidence(failure.rank)
        if found is None:  # on another machine: the launcher's words are all there is
            return reason, detail
        evidence, stack = found
        base = reason.split(" (", 1)[0]  # without the launcher's guess in parentheses, if any
        if evidence and not (evidence.startswith("killed by") and evidence.removeprefix("killed by ") in base):
            reason = f"{base}: {evidence}"
        elif not evidence and "without reporting" in reason:
            reason = (f"{base} (no fatal signal caught by Python, no out-of-memory kill in the kernel log or its "
                      "cgroup: killed by SIGKILL, or it ended below Python)")
        if stack is not None and not detail:
            detail = stack.render(self.labels)
        return reason, detail

    def _all_results(self) -> bool:
        """Every rank returned, or stopped at the step asked (`StepStop`)."""
        return len(self.results) + len(self.stop_plan.stopped_ranks) >= self.resizes.world

    def drain(self) -> None:
        self.channel.wait_readers(timeout=2.0)
        while (message := self.channel.get(timeout=0.01)) is not None:
            self.handle(message)

    def handle(self, message: ch.Message) -> None:
        now = time.monotonic()
        match message:
            case ch.Output():
                self.outputs.add(message.rank, message.text)
                self.watch.activity(message.rank, now)
                self.observer.output(message.rank, message.stream, message.text)
            case ch.Metrics():
                self.watch.activity(message.rank, now)
                self.thinned += message.thinned
                for step, metrics, stamp in message.entries:
                    self._metric(step, metrics, stamp)
            case ch.Pulse():
                self.watch.pulse(message, now)
                self.resizes.pulse(message.steps)
                self.perf.pulse(message)
                self.stop_plan.pulse(message.rank, message.steps, now)
            case ch.Stopped():
                self.stop_plan.stopped(message.rank, message.step)
                self.watch.ended(message.rank, f"stopped after step {message.step}", now)
            case ch.StopMissed():
                self.stop_plan.missed(message.rank, message.steps)
            case ch.Metric():
                self.watch.activity(message.rank, now)
                self._metric(message.step, message.metrics, message.timestamp_ms)
            case ch.Result():
                self.results[message.rank] = message.pickled_value
                self.written[message.rank] = message.outputs
                self.watch.ended(message.rank, "returned", now)
            case ch.Error():
                self.errors.append(message)
                failed = getattr(self._running, "worker_failed", None)  # a backend restarting on it (Spark)
                if failed is not None:
                    failed(message.rank, message.summary)
                if message.rank is not None:
                    self.watch.ended(message.rank, f"failed: {message.summary}", now)
            case ch.Status():
                self.watch.activity(message.rank, now)
                self.observer.status(message.rank, message.state, message.detail)
            case ch.Total():
                self.observer.total(message.steps)
            case ch.ModelFacts():
                self.perf.facts = message
            case ch.DataProgress():
                self.data_read.add(message.name)
                self.observer.data_progress(message.name, message.epoch, message.batch, message.batches)
            case ch.Hello():
                if message.rank in self.hellos:  # a second Hello from a rank: the backend restarted the workers
                    self._forget_attempt(keep_last=True)
                    self._relaunched(None, "the backend restarted every worker (--max-restarts)")  # Ray Train's
                self.hellos.add(message.rank)
                self.collector.saw(message)
                self.watch.hello(message.rank, now)
                self.observer.status(message.rank, "starting", message.host)

    def _metric(self, step: int, metrics: dict, stamp: int) -> None:
        metrics = self.resizes.metrics(metrics)  # a resume's: the steps its restart lost added
        self.last_step = max(self.last_step, step)
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
            raise WorkerError(first.rank, *self.death_details(first))
        if self.errors:
            # The earliest error is the cause; later ones are peers noticing (connection reset by peer).
            first = min(self.errors, key=lambda error: error.unix_time)
            raise WorkerError(first.rank, first.summary, first.traceback)
        stopped = self.stop_plan.stopped_ranks
        if stopped:  # asked to stop at a step: no value, whatever ranks that ended the loop right there returned
            step = max(stopped.values())
            ranks = ", ".join(f"rank {rank} after {at}" for rank, at in sorted(stopped.items()))
            raise RunStopped(f"the run was stopped at a step, as asked (step {self.stop_plan.target}): {ranks}", step)
        world = self.resizes.world  # the last attempt's ranks (--elastic may have changed them)
        missing = [rank for rank in range(world) if rank not in self.results]
        if missing:
            raise WorkerError(missing[0], "the worker ended without returning a result (see its output above)")
        return [cloudpickle.loads(self.results[rank]) for rank in range(world)]
