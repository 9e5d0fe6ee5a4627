"""The driver side of one run: prepare (check, workers ahead, capture), then execute (launch, pump, end).

Every entry point goes through here: the ``%%distribute`` magic, the ``--configure`` panel's Run,
`dtrain_magic.run` and the command line. `prepare` is the one sequence before launch (`plan.check`, the next
run's workers launched ahead on Spark and Ray, the payload made and checked); `PreparedRun.execute` runs it.
The workers start the way every run and session starts them (`launch.Launch`); the pump runs in the calling
thread (the cell's), so worker output printed here lands in the cell as it happens.

A run that ends by an exception (an interrupt, Stop, ``--timeout``, a hang or a stall) gives the cell back at
once: the backend's clean-up (`RunningJob.cancel`: Ray Train's abort, Spark's job group) goes on in the
background, and `reap_later` SIGKILLs whatever of the run's processes on this machine is still alive after
`REAP_AFTER_S`. A run in progress is listed on the kernel's state (`live_runs`), for ``%distribute_stacks``
and the monitor's Stacks button (`stacks_of_live_runs`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping

from .. import backend_log, procfacts
from ..config import RunConfig
from ..errors import DistributeError, RunInterrupted, RunStopped, log_dropped
from ..launchers import Launcher
from ..payload import Payload
from ..result import RunResult
from ..tracking import RunTracker
from ..tracking.resume import FUNCTION_TAG
from .launch import Launch, backend_error
from .observer import RunObserver, TextObserver
from .plan import RunPlan, check, check_data, check_payload, dry_run_text
from .pump import Pump

# Where every entry point binds the last run's `RunResult` in a notebook (besides ``--result NAME``).
LAST_RESULT_NAME = "_distribute_result"
# A run stopped by an exception: how long the cell waits for the backend's clean-up before it goes on in the
# background, and when what is left of the run's processes on this machine is killed.
STOP_WAIT_S = 1.0
REAP_AFTER_S = 6.0


@dataclass(frozen=True)
class PreparedRun:
    """A run checked and captured, ready to launch: what `prepare` returns.

    ``params``: hyperparameters (a sweep trial's): every rank's ``ctx.params``, logged as MLflow params;
    ``parent_run_id``: the MLflow run this one is a child of (a sweep's); ``reuse_workers``: its workers wait for the
    next run of the same placement after it (a sweep's trials, `launch.Launch`). Set them with `dataclasses.replace`.
    """

    plan: RunPlan
    payload: Payload
    namespace: MutableMapping[str, Any] | None = None  # a notebook's: binds the result (`bind_result`)
    params: Mapping[str, Any] = field(default_factory=dict)
    parent_run_id: str | None = None
    reuse_workers: bool = False
    log_mark: backend_log.Mark | None = None  # where the kernel's backend log stood when `prepare` began

    @property
    def config(self) -> RunConfig:
        return self.plan.config

    def execute(self, observer: RunObserver | None = None, stop: threading.Event | None = None) -> RunResult:
        """Launch, pump and return the `RunResult` (bound in the notebook's namespace when there is one), or raise
        a short `DistributeError`. ``stop``: set it to stop the run (it raises `RunInterrupted`)."""
        tags = {"mlflow.parentRunId": self.parent_run_id} if self.parent_run_id else {}
        result = _Run(self.plan, self.payload, observer or TextObserver(), stop, tags, self.params,
                      self.log_mark, self.reuse_workers).execute()
        session = getattr(self.plan.launcher, "session", None)
        if self.namespace is not None:
            bind_result(self.namespace, self.config, result, session)
        elif self.config.outputs:
            return_tables(self.config, result, session)
        return result

    def dry_run_text(self, model: Any = None, equivalent: str | None = None) -> str:
        """What ``--dry-run`` prints (`plan.dry_run_text`); ``equivalent``: the line that runs it (default: the
        ``%%distribute`` line)."""
        return dry_run_text(self.plan, self.payload, model=model, equivalent=equivalent)


def prepare(config: RunConfig, make_payload: Callable[[], Payload],
            namespace: MutableMapping[str, Any] | None = None,
            sources: Mapping[str, Any] | None = None) -> PreparedRun:
    """Everything before launch, in the one order every entry point uses: check the config (a clear error
    before anything runs), launch the run's workers ahead on Spark and Ray (their start overlaps the capture),
    make the payload (``make_payload``: a notebook cell runs here, on the caller's thread), check it, find the
    ``--data`` sources (in ``sources``, else the notebook's ``namespace``: the cell has run, its variables exist)."""
    log_mark = backend_log.mark()  # before the check, which may start Spark's JVM: its lines are this run's
    plan = check(config)
    keep_warm_ahead(plan)
    payload = make_payload()
    check_payload(config, payload)  # e.g. a Ray Train loop off --backend ray: before --dry-run too
    plan = check_data(plan, payload, sources if sources is not None else namespace)
    return PreparedRun(plan, payload, namespace, log_mark=log_mark)


def bind_result(namespace: MutableMapping[str, Any], config: RunConfig, result: RunResult,
                spark_session: Callable[[RunConfig], Any] | None = None) -> None:
    """A notebook's names for the result: ``_distribute_result`` always, ``--result NAME`` when given, and each
    ``--output NAME=VARIABLE`` as the backend's own table (``spark_session``: the Spark launcher's, for a Spark
    DataFrame), also in ``result.tables``."""
    namespace[LAST_RESULT_NAME] = result
    if config.result:
        namespace[config.result] = result
    if config.outputs:
        from . import outputs

        result.tables.update(outputs.bind(namespace, config.backend, config.outputs, result.outputs, print,
                                          _session_of(config, spark_session)))


def return_tables(config: RunConfig, result: RunResult,
                  spark_session: Callable[[RunConfig], Any] | None = None) -> None:
    """`dtrain_magic.run`'s ``outputs=``: each output it names in ``result.tables``, as the backend's own table; one
    the run did not write is said, naming what it wrote."""
    from . import outputs

    def unwritten(name: str, why: str) -> None:
        print(f"dtrain_magic: outputs={name!r}: {why}; result.tables has no {name!r}", flush=True)

    names = [name for name, _ in config.outputs]
    result.tables.update(outputs.tables(config.backend, names, result.outputs, unwritten,
                                        _session_of(config, spark_session)))


def _session_of(config: RunConfig, spark_session: Callable[[RunConfig], Any] | None) -> Callable[[], Any] | None:
    """The Spark session the outputs' DataFrames are read with, asked for only when one is built (None: none)."""
    return (lambda: spark_session(config)) if spark_session is not None else None


class _Run:
    """One run's steps: start its workers (`launch.Launch`), pump them to their end, collect, end the MLflow run."""

    def __init__(self, plan: RunPlan, payload: Payload, observer: RunObserver, stop: threading.Event | None,
                 tags: Mapping[str, str], params: Mapping[str, Any], log_mark: backend_log.Mark | None = None,
                 reuse_workers: bool = False):
        self.plan, self.config, self.launcher = plan, plan.config, plan.launcher
        self.log_mark = log_mark or backend_log.mark()
        self.payload, self.observer, self.stop = payload, observer, stop
        data_tags = plan.data.tags() if plan.data is not None else {}
        if payload.function_key:  # what --resume finds this cell's run by, in a new kernel
            data_tags = {**data_tags, FUNCTION_TAG: payload.function_key}
        self.launch = Launch(plan, observer, tags={**tags, **data_tags}, params=params, resume=self._resume_target(),
                             reuse_workers=reuse_workers)
        self.started = self.launch.started
        self.status, self.reason = "FAILED", None
        self.held: str | None = None
        self.stopped_early = False

    def _resume_target(self) -> Any:
        """``--resume``: the unfinished run this one continues (`tracking.resume.find_resume_target`), said in the cell;
        None for a fresh run."""
        if self.config.resume is None:
            return None
        from ..tracking.resume import find_resume_target

        target, words = find_resume_target(self.config, self.payload.function_key)
        if words:
            self.observer.note(words)
        return target

    @property
    def pump(self) -> Pump | None:
        return self.launch.pump

    def execute(self) -> RunResult:
        from ..state import kernel_state

        kernel_state().run_started(self)
        try:
            return self._execute()
        finally:
            kernel_state().run_ended(self)

    def stacks_now(self) -> tuple[str, str] | None:
        """Where every rank of this run is now (`Pump.stacks_now`); None before its workers started."""
        pump = self.pump
        return pump.stacks_now() if pump is not None else None

    def _execute(self) -> RunResult:
        try:
            with self.launch.listen():
                tracker, values = self._launch_and_pump()
            result = self._result(tracker, values)
            self._name_unread_data()
            self.status = "FINISHED"
            self.observer.finished(result, None)
            return result
        except (KeyboardInterrupt, RunInterrupted) as exc:
            self.status, self.reason = "KILLED", ("interrupted from the notebook" if type(exc) is not RunStopped
                                                  else str(exc))
            error = (exc if isinstance(exc, RunInterrupted)
                     else RunInterrupted("the run was interrupted; every worker was stopped"))
            self.observer.finished(None, error)
            raise error from None
        except DistributeError as exc:
            self.reason = str(exc).splitlines()[0]
            self.observer.finished(None, exc)
            raise
        except Exception as exc:
            error = backend_error(self.config.backend, exc)
            self.reason = f"{type(exc).__name__}: {exc}"
            self.observer.finished(None, error)
            raise error from None
        finally:
            self._close()

    def _launch_and_pump(self) -> tuple[RunTracker, list[Any]]:
        """Start the workers, pump until they end; the tracker and every rank's value. The next run's workers are
        launched ahead whatever became of this one."""
        self.launch.start(self.payload, self._stage_data())
        running, pump = self.launch.running, self.launch.pump
        released = ended = False
        try:
            tracker = self.launch.track(self.stop)
            released = pump.run(running, self.stop)
            ended = True
        finally:
            if released:
                running.release()
            elif ended:
                running.cancel()
            else:  # interrupted, stopped, timed out, hung: the cell goes on, the clean-up in the background
                self.stopped_early = True
                stop_soon(running, pump.collector.workers)
            self.held = _keep_warm(self.launcher, self.config)
        pump.drain()
        return tracker, pump.collect()

    def _name_unread_data(self) -> None:
        """A ``--data`` source the function never read a batch of was staged for nothing: say so, naming it."""
        unread = [name for name, _ in self.config.data if name not in self.pump.data_read]
        for name in unread:
            self.observer.note(f"--data {name}: given, but rank 0 read no batch of it "
                               f"(ctx.data({name!r}, batch_size=...)); drop it from the line if it is not needed")

    def _stage_data(self) -> tuple:
        """The ``--data`` sources made readable by every rank (written once where they must be, or an earlier run's
        copy reused), before anything is launched; what the `WorkerJob` carries of them."""
        if self.plan.data is None:
            return ()
        return self.plan.data.stage(self.observer.note)

    def _result(self, tracker: RunTracker, values: list[Any]) -> RunResult:
        from . import outputs

        written = outputs.finish(outputs.root_of(self.config, self.launch.checkpoint_root), self.pump.written,
                                 self.observer.note, earlier_attempts=self.config.max_restarts > 0)
        result = RunResult(
            value=values[0], values=values, run_id=tracker.run_id, config=self.config,
            wall_time_s=time.monotonic() - self.started, metrics=dict(tracker.last_metrics),
            time_to_first_step_s=self.pump.first_metric_s, tracking_uri=tracker.tracking_uri,
            checkpoint_root=self.launch.checkpoint_root, printed=self.pump.outputs.by_rank(), outputs=written,
            world_size=self.pump.resizes.world,
        )
        tracker.log_result(result.value)
        return result

    def _close(self) -> None:
        """Whatever happened: a claimed standby not started goes back; the MLflow run ends with the metrics
        that came while it was opening; the cell says what waits for the next run."""
        self.launch.give_back_unstarted()
        pump = self.pump
        if self.status != "FINISHED" and pump is not None:  # its ranks' ctx.write parts go: no partial output
            from . import outputs

            root = outputs.root_of(self.config, self.launch.checkpoint_root)
            outputs.discard(root)
            if self.stopped_early:  # its workers are still being stopped: what one writes meanwhile goes too
                outputs.discard_later(root, REAP_AFTER_S + 1.0)
        waiting = pump.waiting_metrics if pump is not None else []
        tags = {"dtrain_magic.wall_time_s": f"{time.monotonic() - self.started:.3f}"}
        artifacts = {}
        if pump is not None:
            artifacts = {**pump.artifacts, **{f"logs/rank_{rank}.txt": text for rank, text in
                                              pump.outputs.by_rank().items()}}
            if None in pump.outputs.chunks:
                artifacts["logs/launcher.txt"] = pump.outputs.text(None)
            if pump.thinned:
                tags["dtrain_magic.metrics_thinned"] = (f"{pump.thinned} values left out (logged faster than "
                                                        "$DTRAIN_MAGIC_METRIC_RATE a second after a burst)")
            if pump.perf.flagged:
                tags["dtrain_magic.stragglers"] = "; ".join(pump.perf.flagged.values())
            if pump.restart_notes:  # each relaunch's reason in the launcher's words; the restarts among them
                tags["dtrain_magic.restarts"] = str(pump.resizes.restarts)
                tags.update({f"dtrain_magic.restart_{n}": note for n, note in enumerate(pump.restart_notes, 1)})
            pump.collector.cleanup()
        inputs: list = []
        if self.plan.data is not None:
            from .staging import staging_area

            tags.update(self.plan.data.tags())
            inputs = self.plan.data.dataset_inputs()
            staging_area().run_ended()  # copies that cannot be reused go; the others wait for a run of the same data
        artifacts.update(backend_log.artifacts(self.log_mark))  # what the backends printed meanwhile (not in the cell)
        # A stopped run does not wait for MLflow still opening (it ends the run itself once open).
        self.launch.opening.close(self.status, self.reason, tags, metrics=waiting, artifacts=artifacts,
                                  inputs=inputs, timeout=0 if self.stopped_early else 30.0)
        shown = backend_log.shown(self.log_mark, failed=self.status == "FAILED", verbose=self.config.verbose)
        if shown:
            self.observer.note(shown)
        if self.held:
            self.observer.held(self.held)


def stop_soon(running: Any, workers: dict) -> None:
    """Cancel ``running`` in the background, waiting `STOP_WAIT_S` for it (the usual case: it is quick); then
    make sure none of ``workers`` (rank → `stacks.Worker`) on this machine outlives `REAP_AFTER_S`."""
    done = threading.Event()

    def cancel() -> None:
        try:
            running.cancel()
        except Exception:  # a backend's own clean-up failing must not hide the run's outcome: logged, reaped below
            logging.getLogger(__name__).warning("stopping the run's workers failed", exc_info=True)
        finally:
            done.set()

    threading.Thread(target=cancel, name="dtrain-stop", daemon=True).start()
    done.wait(STOP_WAIT_S)
    reap_later(list(workers.values()))


def reap_later(workers: list, after_s: float = REAP_AFTER_S) -> threading.Thread | None:
    """SIGKILL each of ``workers`` (`stacks.Worker`) on this machine that is still alive ``after_s`` seconds from now,
    and its children: the backstop for a backend whose own stop leaves a process (a Ray worker still in its
    graceful shutdown, a worker a torchrun sweep missed). Returns at once; the watching thread, if any."""
    here = [w for w in workers if w.here and w.start is not None]
    if not here:
        return None

    def reap() -> None:
        deadline = time.monotonic() + after_s
        while any(_alive(w) for w in here):
            if time.monotonic() >= deadline:
                for worker in here:
                    if _alive(worker):
                        logging.getLogger(__name__).warning("rank %d's process %d outlived the run's stop by %.0f "
                                                            "s: killed", worker.rank, worker.pid, after_s)
                        _kill_tree(worker.pid)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=reap, name="dtrain-reap", daemon=True)
    thread.start()
    return thread


def _alive(worker: Any) -> bool:
    return procfacts.start_time(worker.pid) == worker.start and procfacts.process_state(worker.pid) != "zombie"


def _kill_tree(pid: int) -> None:
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception as exc:  # gone meanwhile, or no psutil: the process itself is still killed
        log_dropped(__name__, "_kill_tree", exc)
        children = []
    for target in [pid, *(child.pid for child in children)]:
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def stacks_of_live_runs(observer: Any = None) -> list[tuple[str, str]]:
    """(title, stacks) of every run in progress in this kernel (only the one whose observer is ``observer``, when
    given): ``%distribute_stacks`` and the monitor's Stacks button."""
    from ..state import kernel_state

    found = []
    for run in kernel_state().live_runs():
        if observer is not None and getattr(run, "observer", None) is not observer:
            continue
        stacks = run.stacks_now()
        if stacks is not None:
            found.append(stacks)
    return found


def _keep_warm(launcher: Launcher, config: RunConfig) -> str | None:
    """`Launcher.keep_warm` after a run; a failure there is logged, never the run's."""
    try:
        return launcher.keep_warm(config)
    except Exception:  # launching ahead is an optimisation: the next run launches fresh
        logging.getLogger(__name__).warning("could not launch the next run's workers ahead", exc_info=True)
        return None


def keep_warm_ahead(plan: RunPlan) -> None:
    """Before a run (`prepare` calls this once `check` passed, before the payload is made): warm the backend up
    (the local fork server imports torch while the cell runs and imports it too) and launch the run's workers now,
    so their start overlaps the capture; the run then claims them. Nothing for a dry run. Never raises: the run
    warms up and launches them itself if this could not (and says why then)."""
    if plan.config.dry_run:
        return
    try:
        plan.launcher.warm_up(plan.config)
    except Exception as exc:  # the launch's own warm_up raises it again, as the run's error
        log_dropped(__name__, "keep_warm_ahead", exc)
        return
    _keep_warm(plan.launcher, plan.config)


def release_standbys(reason: str = "released by %distribute_release") -> list[str]:
    """Release every backend's waiting workers (``%distribute_release``); what was released."""
    from ..state import kernel_state

    released = []
    for launcher in kernel_state().launchers().values():
        what = launcher.release_standby(reason) if isinstance(launcher, Launcher) else None
        if what:
            released.append(what)
    return released


__all__ = ["LAST_RESULT_NAME", "PreparedRun", "RunPlan", "bind_result", "check", "check_payload", "keep_warm_ahead",
           "prepare", "release_standbys", "return_tables", "stacks_of_live_runs"]
