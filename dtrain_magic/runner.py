"""The driver side of one run: check, open the MLflow run and the channel, launch, pump messages, end.

This is the only place that sees a launcher, the channel and the tracker together. The loop runs in
the calling thread (the cell's), so worker output printed here lands in the cell as it happens.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import cloudpickle

from . import channel as ch
from .capture import Payload
from .channel import Channel
from .checkpoints import run_checkpoint_root
from .config import RunConfig
from .errors import ConfigError, DistributeError, LaunchError, RunInterrupted, RunTimeout, WorkerError
from .launchers import Launcher, get_launcher
from .observer import RunObserver, TextObserver
from .result import RunResult
from .strategies import get_strategy
from .tracking import (
    RunOpening,
    RunTracker,
    check_tracking_uri,
    preload_mlflow,
    resolve_tracking_uri,
    sqlite_experiment_stage,
)
from .tracking.uri import deleted_experiment_error
from .worker import WorkerJob

_POLL_S = 0.05
_ERROR_GRACE_S = 1.0  # after the first worker error, let the others report before stopping them
# Workers started before the MLflow run: it opens once they are past their start (a metric, a result,
# an error), or after this long; their metrics wait for it (the live charts get them at once), their
# output does not.
_EARLY_START_HOLD_S = 10.0


@dataclass(frozen=True)
class RunPlan:
    """What `check` found out about one run, so that `execute` looks nothing up again.

    ``launcher``: the backend's (cached) `Launcher`. ``tracking_uri``: the MLflow store checked (``--tracking-uri``,
    else ``MLFLOW_TRACKING_URI``, else ``./mlflow.db``); ``store_stage``: what that store says of the experiment
    without MLflow (`tracking.sqlite_experiment_stage`: "active", "absent", or None when it cannot tell; "deleted"
    never gets this far). ``starts_before_tracking``: the workers start before the MLflow run exists (see `check`).
    A plan is for one run: the next run checks again (the store, a session may have changed meanwhile).
    """

    config: RunConfig
    launcher: Launcher
    tracking_uri: str
    store_stage: str | None
    starts_before_tracking: bool

    @cached_property
    def channel_host(self) -> str:
        """Where the run's channel listens (`Launcher.channel_host`), asked once, when the run starts: after
        `Launcher.warm_up`, which Ray's answer needs (its connection), so that a dry run never starts Ray."""
        return self.launcher.channel_host(self.config)


def check(config: RunConfig) -> RunPlan:
    """Everything that can be checked before launch, each looked up once; raises `DistributeError` subclasses.

    Returns the `RunPlan` that `execute` runs. The workers start before the MLflow run exists when the backend
    does not need the run's id and nothing can go wrong with the run that a look at the store did not already
    rule out (a writable SQLite file, the experiment not deleted): a kernel's first run then does not wait for
    MLflow's import (about 2 s of CPU here), which waits until the workers are past their start so it does not
    slow them either. Otherwise MLflow's import starts now, beside the rest of the check and the cell's capture.
    """
    launcher = get_launcher(config.backend)
    uri = resolve_tracking_uri(config)
    stage = sqlite_experiment_stage(uri, config.experiment)
    early = launcher.starts_before_tracking(config) and stage in ("active", "absent")
    if not early:
        preload_mlflow()  # the run will need MLflow first: import it meanwhile (a SparkSession start, the capture)
    launcher.check(config)
    get_strategy(config.strategy).check(config)
    check_tracking_uri(config)  # it may wait up to a few seconds for an http(s) server
    if stage == "deleted":
        raise deleted_experiment_error(config, uri)
    return RunPlan(config, launcher, uri, stage, early)


def check_payload(config: RunConfig, payload: Payload) -> None:
    """What the captured function needs of the backend, before launch: a Ray Train loop (it calls
    ``ray.train``) runs only under ``--backend ray``, where Ray Train's own session exists."""
    if payload.uses_ray_train and config.backend != "ray":
        raise ConfigError(
            "--backend",
            f"{payload.call_text or payload.name} calls Ray Train "
            "(ray.train.report / get_context / prepare_model ...), "
            f"which works only inside Ray Train: run it with --backend ray, where it runs unchanged, not --backend "
            f"{config.backend} (or use ctx.rank, ctx.prepare, ctx.log instead). Nothing was launched",
        )


def execute(
    config: RunConfig,
    payload: Payload,
    observer: RunObserver | None = None,
    stop: threading.Event | None = None,
    plan: RunPlan | None = None,
) -> RunResult:
    """Run ``payload`` under ``config`` and return its `RunResult`, or raise a short `DistributeError`.

    ``plan``: what `check` returned for this config (the magic checks before capturing the cell); without
    one, `execute` checks first.
    """
    observer = observer or TextObserver()
    if plan is None:
        plan = check(config)
    elif plan.config != config:
        raise ValueError("execute: the plan was made by check() for another config")
    launcher = plan.launcher
    check_payload(config, payload)
    # Workers launched ahead for this placement (a standby, docs/warm-reruns.md): this run takes them over.
    claim = launcher.claim_standby(config)
    # ctx.save_checkpoint() without a directory: one directory per run, the same on every backend (Ray
    # Train keeps its own checkpoints there); named before the MLflow run exists, recorded in a tag. A
    # standby named it at its launch (on Ray it is the TorchTrainer's run name, fixed there).
    root = ((claim.checkpoint_root if claim is not None else None)
            or run_checkpoint_root(config.storage, uuid.uuid4().hex))
    early = plan.starts_before_tracking
    opening = RunOpening(config, tags={"dtrain_magic.checkpoint_root": root}, deferred=early)
    started = time.monotonic()
    status, reason = "FAILED", None
    outcome: _Pump | None = None
    running = None
    held: str | None = None
    try:
        launcher.warm_up(config)
        with Channel(host=plan.channel_host) as channel:
            job = WorkerJob(payload, config, channel.address, checkpoint_root=root)
            tracker = None if early else opening.wait()
            outcome = _Pump(config, channel, observer, started)
            job = job if early else dataclasses.replace(job, run_id=tracker.run_id)
            running = claim.start(job, channel.put) if claim is not None else launcher.start(job, channel.put)
            released = False
            try:
                described = launcher.describe(config) + (
                    "; its workers were launched ahead and waiting" if claim else "")
                if hasattr(observer, "launched"):  # observers written before it existed lack it
                    observer.launched(config, described)
                if tracker is None:
                    outcome.hold(running, _EARLY_START_HOLD_S, stop)
                    opening.workers_started = True
                    tracker = outcome.pump_while_opening(opening, running, stop)
                observer.started(config, tracker.run_id, tracker.ui_link(), described)
                outcome.attach(tracker)
                released = outcome.run(running, stop)
            finally:
                running.release() if released else running.cancel()
                held = _keep_warm(launcher, config)  # the next run's workers, whatever became of this one
            outcome.drain()
            values = outcome.collect()
        result = RunResult(
            value=values[0], values=values, run_id=tracker.run_id, config=config,
            wall_time_s=time.monotonic() - started, metrics=dict(tracker.last_metrics),
            time_to_first_step_s=outcome.first_metric_s, tracking_uri=tracker.tracking_uri,
            checkpoint_root=root,
        )
        tracker.log_result(result.value)
        status = "FINISHED"
        observer.finished(result, None)
        return result
    except (KeyboardInterrupt, RunInterrupted) as exc:
        status, reason = "KILLED", "interrupted from the notebook"
        error = (exc if isinstance(exc, RunInterrupted)
                 else RunInterrupted("the run was interrupted; every worker was stopped"))
        observer.finished(None, error)
        raise error from None
    except DistributeError as exc:
        reason = str(exc).splitlines()[0]
        observer.finished(None, exc)
        raise
    except Exception as exc:  # a backend's own exception: keep its message, drop its 40-line traceback
        reason = f"{type(exc).__name__}: {exc}"
        error = LaunchError(f"the {config.backend} backend failed: {reason}")
        observer.finished(None, error)
        raise error from None
    finally:
        if claim is not None and running is None:
            claim.abandon()  # stopped before its launch: the standby waits for the next run
        # Stopped or failed while the run was opening: the metrics that came meanwhile are still recorded.
        waiting = outcome.waiting_metrics if outcome is not None else []
        opening.close(status, reason, {"dtrain_magic.wall_time_s": f"{time.monotonic() - started:.3f}"},
                      metrics=waiting)
        if held and hasattr(observer, "held"):  # observers written before it existed lack it
            observer.held(held)


def _keep_warm(launcher: Launcher, config: RunConfig) -> str | None:
    """`Launcher.keep_warm` after a run; a failure there is logged, never the run's."""
    try:
        return launcher.keep_warm(config)
    except Exception:
        logging.getLogger(__name__).warning("could not launch the next run's workers ahead", exc_info=True)
        return None


def keep_warm_ahead(plan: RunPlan) -> None:
    """Before a kernel's first run (the magic calls this once `check` passed, before the cell runs): launch the
    run's workers now, so their start overlaps the cell's capture; the run then claims them. Nothing for a dry
    run. Never raises: the run launches them itself if this could not."""
    if plan.config.dry_run:
        return
    _keep_warm(plan.launcher, plan.config)


def release_standbys(reason: str = "released by %distribute_release") -> list[str]:
    """Release every backend's waiting workers (``%distribute_release``); what was released."""
    from .state import kernel_state

    released = []
    for launcher in kernel_state().launchers().values():
        what = launcher.release_standby(reason) if isinstance(launcher, Launcher) else None
        if what:
            released.append(what)
    return released


def _accepts_keyword(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _raise_if_stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise RunInterrupted("the run was stopped from the panel; every worker was stopped")


class _Pump:
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
        self._metric_takes_stamp = _accepts_keyword(observer.metric, "timestamp_ms")

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
        if self._metric_takes_stamp:
            self.observer.metric(step, metrics, timestamp_ms=stamp)
        else:  # an observer written before metric() had a timestamp
            self.observer.metric(step, metrics)

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


def dry_run_text(plan: RunPlan, payload: Payload, model: Any = None) -> str:
    """What ``--dry-run`` prints for a checked ``plan``: the validated config and what would be launched; with
    ``model`` (a `memory.CellModel`), the memory estimate for the cell's own model, or why it is not known yet."""
    from .memory import estimate
    from .observer import plan_with_backend

    config, launcher = plan.config, plan.launcher
    call = payload.call_text or (f"{payload.name}(ctx)" if payload.takes_ctx else f"{payload.name}()")
    lines = [
        "dtrain_magic dry run: nothing launched.",
        f"  would run {call} on {plan_with_backend(launcher.describe(config), config)}",
        f"  strategy {config.strategy}" + (f" (ZeRO {config.zero_stage})" if config.strategy == "deepspeed" else "")
        + f", precision {config.precision}, grad accumulation {config.grad_accum}"
        + (f", model parallel tp {config.tp} x pp {config.pp} x dp {config.data_parallel_size}"
           if config.tp * config.pp > 1 else ""),
    ]
    if model is not None and model.found:
        est = estimate(model.num_params, config.strategy, config.zero, config.precision, config.num_processes,
                       tp=config.tp, pp=config.pp)
        lines += [f"  model: {model.num_params:,} parameters, {model.description}", f"  {est.line()}"]
    elif model is not None:
        lines.append(f"  memory estimate: the model is not known before training ({model.description}); "
                     "each worker prints it at ctx.prepare")
    lines.append(f"  equivalent: {config.flag_line()}")
    return "\n".join(lines)
