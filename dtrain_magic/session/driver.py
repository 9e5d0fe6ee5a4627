"""The notebook's side of an interactive session: `Session`.

A session is a run whose function serves cells (`session.worker.serve`): started once, the way every run starts
(`driver.plan.check`, then the backend's launcher, or the workers it launched ahead, `Launcher.claim_standby`), with
one MLflow run for its whole life. Its ranks then run what the notebook sends: cells (`run`), values pushed
(`push`) and pulled (`pull`), one command at a time per rank, in each rank's own namespace. While a command runs,
the notebook pumps the run's channel on the caller's thread, as a run does (output, metrics, status go to that
cell's observer and to the session's monitor, metrics to MLflow), until every rank it went to sent its `CellDone`.

The kernel's interrupt (KeyboardInterrupt in that loop) interrupts the command on every rank running it and waits
`INTERRUPT_WAIT_S` for them: a rank that does not stop is blocked outside Python (a collective waiting for a rank
that is not in it): the error says so and how to restart. A rank that fails a cell: the others get
`ERROR_GRACE_S` to finish it, then are interrupted (as a run's workers are stopped when one fails); the cell raises
`RankError`, and the session goes on. The ranks are released by `stop`, after ``idle_timeout_s`` without a command,
and at the kernel's exit (`state.KernelState.shutdown` closes sessions before the launchers); whatever happens to
the notebook, the backend's own guards stop them (the fork server, the rank watch, the Ray sweeper).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable

from .. import backend_log
from ..channel import Message
from ..config import RunConfig
from ..driver.launch import Launch, backend_error
from ..driver.observer import RunObserver, TextObserver
from ..driver.plan import check
from ..errors import (
    CaptureError,
    CellInterrupted,
    ConfigError,
    DistributeError,
    LaunchError,
    SessionError,
    SessionLost,
    WorkerError,
    log_dropped,
)
from ..payload import CTX, CallForm, dumps, serialize
from ..state import kernel_state
from . import describe
from .links import RankLinks
from .observe import Both, CellText, Quiet
from .options import check_session_config, idle_timeout_s
from .protocol import (
    FAILED,
    CellDone,
    InterruptCell,
    PullValue,
    PushValues,
    RunCell,
    StopSession,
)
from .report import INTERRUPT_WAIT_S, duration, lost_reason, raise_for
from .values import PerRank, Unsent, unpack

ERROR_GRACE_S = 3.0  # after a rank failed a cell, the others' time to finish it before they are interrupted
STOP_WAIT_S = 30.0  # a stopped session's ranks end by themselves within this, or they are cancelled
_POLL_S = 0.05
_LOST_DETAIL_WAIT_S = 2.0  # a rank's connection dropped: the launcher's word on why (a signal, an exit code)
_log = logging.getLogger(__name__)


class Session:
    """N ranks started once on a backend (local, Spark, Ray), each with the process group joined and ``ctx`` for
    the chosen strategy and precision, running the notebook's cells in a namespace of its own until stopped.

    ``Session(backend="spark", num_processes=2, strategy="fsdp")`` (the flags of ``%%distribute`` as keywords,
    plus ``idle_timeout``) or ``Session(config)`` with a `RunConfig` starts it; ``run(code)`` runs code on every
    rank (or ``ranks=[0]``) and returns the value of its last expression by rank (`values.PerRank`); ``push(x=1)``
    binds notebook values on the ranks; ``pull("x")`` returns a rank's value per rank; ``stop()`` ends it (also
    ``with Session(...) as s:``). ``observer``: where the start's output goes (default: plain text);
    ``monitor``: an observer that sees the whole session (the ``--ui`` monitor).
    """

    def __init__(self, config: RunConfig | None = None, /, *, idle_timeout: float | None = None,
                 observer: RunObserver | None = None, monitor: RunObserver | None = None, **options: Any):
        if config is None:
            from .options import config_from_options

            config, idle = config_from_options(dict(options, idle_timeout=idle_timeout))
        elif options:
            raise ConfigError("Session()", f"give a RunConfig or options, not both ({', '.join(options)})")
        else:
            check_session_config(config)
            idle = idle_timeout_s(idle_timeout)
        if config.preempt_grace:  # a rank's state is its memory: a SIGTERM ends it at once, no checkpoint could keep it
            config = dataclasses.replace(config, preempt_grace=0.0)
        self.config = config
        self.idle_timeout_s = idle
        self.world_size = config.num_processes
        self.monitor = monitor
        self.state = "starting"  # then "open", "closing", "closed"
        self.ended: str | None = None  # why it ended
        self.cells_run = 0
        self.busy: dict[int, int] = {}  # rank → the command it runs (or ran when it could not be freed)
        self._labels: dict[int, str] = {}  # command → what the cell is called ("Cell In[7]")
        self._done: dict[int, dict[int, CellDone]] = {}  # command → its CellDone by rank
        self._sources: list[tuple[str, tuple[int, ...], str]] = []  # (label, ranks, source), for MLflow
        self.outputs: dict[str, Any] = {}  # what the cells wrote with ctx.write, by name (the latest cell's of each)
        self.cell_outputs: dict[str, Any] = {}  # what the last cell wrote (`data.outputs.Output` by name)
        self._next_id = 0
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self.idle_since = time.time()
        self._start(observer or TextObserver())

    # -- start -----------------------------------------------------------------------------------------------------
    def _start(self, observer: RunObserver) -> None:
        already = kernel_state().sessions()
        if already:
            raise SessionError(f"a session is already open ({already[0].describe()}); stop it first "
                               "(%distribute_session stop, or Session.stop()), or restart it with other settings")
        self.log_mark = backend_log.mark()  # before the check, which may start Spark's JVM: its lines are the session's
        self.plan = check(self.config)  # every check of a run, each once: a clear error before anything starts
        self.launcher = self.plan.launcher
        self.links: RankLinks | None = None
        observer = Both(observer, self.monitor)
        self.launch = Launch(self.plan, observer, tags={"dtrain_magic.session": "true"})
        self.started = self.launch.started
        try:
            self.launch.listen()
            self.links = RankLinks(self.plan.channel_host, self.world_size)
            self._launch()
        except BaseException as exc:
            self._abandon_start(exc)
            if isinstance(exc, KeyboardInterrupt):
                raise CellInterrupted("the session's start was interrupted; every rank was stopped") from None
            if isinstance(exc, DistributeError):
                raise
            raise backend_error(self.config.backend, exc) from None
        self.state = "open"
        kernel_state().session_opened(self)
        self._restart_idle_timer()
        observer.held(self.held_text())

    def _launch(self) -> None:
        """Start the ranks serving cells, wait until every one is ready, then the MLflow run beside them."""
        payload = serialize(_serve_function(), call=CallForm("session", (CTX, self.links.address), {}, True))
        self.launch.start(payload)
        self._pump(lambda: self.links.all_ready.is_set())  # every rank joined, ctx built, serving
        tracker = self.launch.track(past_start=lambda: None)  # past their start: serving
        self.run_id, self.tracking_uri = tracker.run_id, tracker.tracking_uri
        self.pump.observer = Quiet()

    # What the launch started, as the commands below use it.
    pump = property(lambda self: self.launch.pump)
    running = property(lambda self: self.launch.running)
    channel = property(lambda self: self.launch.channel)
    opening = property(lambda self: self.launch.opening)
    described = property(lambda self: self.launch.described)
    checkpoint_root = property(lambda self: self.launch.checkpoint_root)

    def _abandon_start(self, exc: BaseException) -> None:
        """The start failed or was interrupted: nothing of it stays (workers, listener, channel, MLflow run)."""
        self.state = "closed"
        self.ended = "its start failed"
        if self.links is not None:
            self.links.close()
        interrupted = isinstance(exc, KeyboardInterrupt)
        self.launch.abandon("KILLED" if interrupted else "FAILED",
                            "interrupted from the notebook" if interrupted else (str(exc).splitlines() or [""])[0])

    # -- commands ----------------------------------------------------------------------------------------------------
    def run(self, source: str, ranks: Iterable[int] | None = None, timeout: float | None = None,
            observer: RunObserver | None = None, filename: str | None = None, label: str | None = None
            ) -> PerRank | None:
        """Run ``source`` on ``ranks`` (default every rank), each in its own namespace; the value of its last
        expression by rank (None when no rank has one). Raises `RankError` when it raises on a rank, `CellInterrupted`
        on the kernel's interrupt, `CellTimeout` after ``timeout`` seconds (default ``--timeout``); the session goes
        on after each of them. ``filename``/``label``: how tracebacks name the cell (the magic gives IPython's)."""
        try:
            ast.parse(source)
        except SyntaxError as exc:
            raise CaptureError(f"the cell has a syntax error at line {exc.lineno}: {exc.msg}; it ran nowhere") from None
        chosen = self.ranks(ranks)
        if filename is None:
            filename, label = f"<session-cell-{self.cells_run + 1}>", f"session cell {self.cells_run + 1}"
        label = label or filename
        try:
            done = self._command(lambda cell_id: RunCell(cell_id, source, filename, label), chosen, label, timeout,
                                 observer)
        except BaseException:  # a cell that failed or was stopped: its ranks' ctx.write parts go
            self._end_outputs(self._next_id, {})
            raise
        self._sources.append((label, chosen, source))
        self.cells_run += 1
        self._end_outputs(self._next_id, {rank: done[rank].outputs for rank in chosen}, observer)
        values = PerRank({rank: _rebuilt(done[rank], strict=False) for rank in chosen})
        return values if any(value is not None for value in values.values()) else None

    def _end_outputs(self, cell_id: int, written: dict[int, str], observer: RunObserver | None = None) -> None:
        """A cell's end: what its ranks wrote with ``ctx.write`` (below the session's outputs, in ``cell_<id>``)
        committed and kept in `outputs` by name (``written``: their sealed parts); for a cell that failed or was
        stopped (nothing ``written``), removed."""
        from ..data.outputs import join
        from ..driver.outputs import discard, finish, root_of

        root = root_of(self.config, self.launch.checkpoint_root)
        cell_root = join(root, f"cell_{cell_id}") if root is not None else None
        self.cell_outputs = {}
        if not any(written.values()):
            discard(cell_root)
            return
        self.cell_outputs = finish(cell_root, written, (observer or CellText()).note)
        self.outputs.update(self.cell_outputs)

    def push(self, ranks: Iterable[int] | None = None, observer: RunObserver | None = None, **values: Any) -> None:
        """Bind each ``name=value`` on ``ranks`` (default every rank): the values are pickled once, here."""
        if not values:
            raise SessionError("push: give the values to push as name=value")
        try:
            pickled = dumps(values)
        except Exception as exc:
            raise SessionError(f"push: {', '.join(values)} cannot be pickled to send them to the ranks "
                               f"({type(exc).__name__}: {exc})") from None
        names = tuple(values)
        self._command(lambda cell_id: PushValues(cell_id, names, pickled), self.ranks(ranks),
                      f"push {', '.join(names)}", None, observer)

    def pull(self, expression: str, ranks: Iterable[int] | None = None,
             observer: RunObserver | None = None) -> list[Any] | PerRank:
        """The value of ``expression`` (a variable's name, or any expression) on every rank, as a list by rank; with
        ``ranks``, a `values.PerRank` of those ranks'. Tensors come to the CPU; what does not pickle is an error."""
        try:
            compile(expression, "<pull>", "eval")
        except SyntaxError as exc:
            raise SessionError(f"pull: {expression!r} is not an expression ({exc.msg})") from None
        chosen = self.ranks(ranks)
        done = self._command(lambda cell_id: PullValue(cell_id, expression), chosen, f"pull {expression}", None,
                             observer)
        values = {rank: _rebuilt(done[rank], strict=True) for rank in chosen}
        return [values[rank] for rank in range(self.world_size)] if ranks is None else PerRank(values)

    def ranks(self, ranks: Iterable[int] | None) -> tuple[int, ...]:
        """``ranks`` checked against the session's (None: every rank), sorted."""
        if ranks is None:
            return tuple(range(self.world_size))
        chosen = tuple(sorted(set(ranks)))
        wrong = [rank for rank in chosen if not isinstance(rank, int) or not 0 <= rank < self.world_size]
        if wrong or not chosen:
            raise SessionError(f"ranks {list(chosen)}: this session has ranks 0 to {self.world_size - 1}")
        return chosen

    def _command(self, make: Callable[[int], Message], chosen: tuple[int, ...], label: str, timeout: float | None,
                 observer: RunObserver | None) -> dict[int, CellDone]:
        """Send one command to ``chosen``, pump until each answered (or stop it there), return their `CellDone`s."""
        with self._lock:
            self._ensure_open()
            busy = sorted(rank for rank in chosen if rank in self.busy)
            if busy:
                raise SessionError(describe.busy_text({rank: self.doing(rank) for rank in busy}))
            self._cancel_idle_timer()
            self._next_id += 1
            cell_id = self._next_id
            for rank in chosen:
                self.busy[rank] = cell_id
            self._labels[cell_id] = label
            self._done[cell_id] = {}
            self.links.send(chosen, make(cell_id))
        cell_observer = observer or CellText()
        self.pump.observer = Both(cell_observer, self.monitor)
        try:
            done, stuck, why = self._wait(cell_id, chosen, timeout if timeout is not None else self.config.timeout)
        finally:
            self.pump.observer = Quiet()
            cell_observer.finished(None, None)  # a last line without its newline
            self._done.pop(cell_id, None)
            if self.state == "open":
                self._restart_idle_timer()
        raise_for(label, chosen, done, stuck, why, timeout or self.config.timeout)
        return done

    def _wait(self, cell_id: int, chosen: tuple[int, ...], timeout: float | None
              ) -> tuple[dict[int, CellDone], tuple[int, ...], str | None]:
        """Pump until every rank in ``chosen`` answered; on an interrupt, a timeout or a failed rank, interrupt the
        ones still running it. (what came back, the ranks that could not be freed, why it was stopped)."""
        done = self._done[cell_id]
        limit = time.monotonic() + timeout if timeout else None
        failed_at = None
        why = None
        self.pump.command_started(chosen, time.monotonic())
        try:
            while len(done) < len(chosen):
                self._pump_once()
                now = time.monotonic()
                self.pump.check_stall(now)  # --stall-timeout: where each rank waits, once per stall; the cell goes on
                if failed_at is None and any(answer.outcome == FAILED for answer in done.values()):
                    failed_at = now
                if failed_at is not None and now - failed_at > ERROR_GRACE_S:
                    why = "failed"
                    break
                if limit is not None and now > limit:
                    why = "timeout"
                    break
                stop = getattr(self.monitor, "stop_event", None)  # the monitor's Stop button
                if stop is not None and stop.is_set():
                    stop.clear()
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            why = "interrupt"
        stuck: tuple[int, ...] = ()
        if len(done) < len(chosen):
            stuck = self._interrupt(cell_id, chosen, done)
        return done, stuck, why

    def _interrupt(self, cell_id: int, chosen: tuple[int, ...], done: dict[int, CellDone]) -> tuple[int, ...]:
        """Interrupt command ``cell_id`` where it still runs; the ranks that did not stop within
        `INTERRUPT_WAIT_S` (they stay busy with it: a late `CellDone` frees them)."""
        self.links.send([rank for rank in chosen if rank not in done], InterruptCell(cell_id))
        deadline = time.monotonic() + INTERRUPT_WAIT_S
        try:
            while len(done) < len(chosen) and time.monotonic() < deadline:
                self._pump_once()
        except KeyboardInterrupt:  # interrupted again: stop waiting for them
            pass
        return tuple(rank for rank in chosen if rank not in done)

    # -- the channel -------------------------------------------------------------------------------------------------
    def _pump(self, until: Callable[[], bool]) -> None:
        while not until():
            self._pump_once()

    def _pump_once(self, watch: bool = True) -> None:
        """Handle what came (up to `_POLL_S` of waiting); with ``watch``, raise `SessionLost` if the ranks are gone."""
        message = self.channel.get(timeout=_POLL_S)
        while message is not None:
            self._dispatch(message)
            message = self.channel.get(timeout=0) if self.channel.pending() else None
        if watch:
            self._check_alive()

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, CellDone):
            if self.busy.get(message.rank) == message.cell_id:
                del self.busy[message.rank]
            answers = self._done.get(message.cell_id)
            if answers is not None:
                answers[message.rank] = message
            elif self.state == "open":  # a rank that could not be freed ended that command after all
                print(f"dtrain_magic: rank {message.rank} ended {self._labels.get(message.cell_id, 'its command')} "
                      f"({message.outcome}{': ' + message.summary if message.summary else ''}); it is free again")
            return
        self.pump.handle(message)

    def _check_alive(self) -> None:
        gone = sorted(self.links.gone)
        state = self.running.poll()
        if not (gone or state.finished or state.failures or self.pump.errors):
            return
        if gone and not (state.finished or state.failures or self.pump.errors):
            deadline = time.monotonic() + _LOST_DETAIL_WAIT_S
            while time.monotonic() < deadline and not (state.finished or state.failures):
                time.sleep(0.1)
                self._drain()
                state = self.running.poll()
        self._lose(lost_reason(gone, state.failures, self.pump.errors))

    def _drain(self) -> None:
        while (message := self.channel.get(timeout=0.0)) is not None:
            self._dispatch(message)

    def _lose(self, reason: str) -> None:
        """The ranks ended on their own: close what is left and say so."""
        if self.state == "starting":  # `_abandon_start` cleans up; a rank's own error comes with its traceback
            if self.pump.errors:
                first = min(self.pump.errors, key=lambda error: error.unix_time)
                raise WorkerError(first.rank, first.summary, first.traceback)
            raise LaunchError(f"the session could not start: {reason}")
        with self._lock:
            self.state = "closing"
            self._cancel_idle_timer()
        self._finish_closing(f"lost: {reason}", "FAILED", Quiet(), wait_s=0.0, polite=False)
        raise SessionLost(f"the session is over: {reason}. Its state is gone; %distribute_session start (or a new "
                          "Session) begins a new one")

    # -- stop ------------------------------------------------------------------------------------------------------
    def stop(self, reason: str = "stopped", observer: RunObserver | None = None, wait_s: float = STOP_WAIT_S) -> str:
        """End the session: every rank returns from its function and ends as a finished run's worker does (one that
        does not within ``wait_s``, or is still busy, is stopped), the MLflow run ends FINISHED. What was released."""
        with self._lock:
            if self.state in ("closing", "closed"):
                return f"the session was already {self.ended or 'stopping'}"
            self.state = "closing"
            self._cancel_idle_timer()
        return self._finish_closing(reason, "FINISHED", observer or Quiet(), wait_s, polite=not self.busy)

    def close(self, at_exit: bool = False) -> None:
        """Stop it, briefly at the kernel's exit (the launchers' shutdown that follows stops whatever is left)."""
        self.stop("the kernel exits" if at_exit else "closed", wait_s=3.0 if at_exit else STOP_WAIT_S)

    def restart(self, observer: RunObserver | None = None, monitor: RunObserver | None = None) -> "Session":
        """Stop this session (every rank's state is lost) and start a new one with the same settings."""
        self.stop("restarted", observer=observer)
        return Session(self.config, idle_timeout=self.idle_timeout_s, observer=observer, monitor=monitor)

    def _finish_closing(self, reason: str, status: str, observer: RunObserver, wait_s: float, polite: bool) -> str:
        what = self.described
        try:
            self.pump.observer = Both(observer, self.monitor)
            if polite and wait_s > 0:
                self.links.send(range(self.world_size), StopSession(reason))
                deadline = time.monotonic() + wait_s
                try:
                    while not self._ended() and time.monotonic() < deadline:
                        self._pump_once(watch=False)
                except KeyboardInterrupt:  # stop waiting: they are cancelled below
                    pass
            self._end_launch()
        finally:
            self.links.close()
            self.channel.close()
            self.ended = reason
            try:
                self._close_tracking(status, reason)
            except Exception:  # MLflow's trouble must not keep the session registered (or the ranks held)
                _log.warning("could not end the session's MLflow run", exc_info=True)
            self.state = "closed"  # only now: "closed" means its MLflow run has ended too
            kernel_state().session_closed(self, f"{reason} ({what})")
            if self.monitor is not None:
                error = None if status == "FINISHED" else SessionLost(reason)
                self.monitor.finished(None, error)
                self.monitor.held(f"session {reason}: its ranks were released")
        return what

    def _ended(self) -> bool:
        """Every rank returned: the launch ended, or (a backend that releases early: local, Spark) every rank's
        result is in. Ray Train's fit() ends by itself shortly after its workers returned: waited for, not aborted."""
        if self.running.poll().finished:
            return True
        return self.running.early_release and len(self.pump.results) >= self.world_size

    def _end_launch(self) -> None:
        try:
            if self.running.poll().finished:
                return
            if self.running.early_release and len(self.pump.results) >= self.world_size:
                self.running.release()
            else:
                self.running.cancel()
        except Exception as exc:  # the launch is gone already: nothing more to stop
            log_dropped(__name__, "_end_launch", exc)

    def _close_tracking(self, status: str, reason: str) -> None:
        tracker = self.pump.tracker
        try:
            if tracker is not None and self._sources:
                tracker.client.log_text(tracker.run_id, self.cells_text(), "session_cells.py")
        except Exception as exc:  # the cells are a bonus; the run still ends
            log_dropped(__name__, "_close_tracking", exc)
        self.opening.close(status, None if status == "FINISHED" else reason,
                           {"dtrain_magic.session_cells": str(self.cells_run), "dtrain_magic.session_end": reason,
                            "dtrain_magic.wall_time_s": f"{time.monotonic() - self.started:.3f}"},
                           metrics=self.pump.waiting_metrics, artifacts=backend_log.artifacts(self.log_mark))

    # -- idle release ------------------------------------------------------------------------------------------------
    def _restart_idle_timer(self) -> None:
        with self._lock:
            self._cancel_idle_timer()
            self.idle_since = time.time()
            if not self.idle_timeout_s or self.state != "open":
                return
            timer = threading.Timer(self.idle_timeout_s, lambda: self._idle_expired(timer))
            timer.name, timer.daemon = "dtrain-session-idle", True
            self._timer = timer
            timer.start()

    def _cancel_idle_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _idle_expired(self, timer: threading.Timer) -> None:
        with self._lock:
            if self._timer is not timer or self.busy or self.state != "open":
                return  # a command started meanwhile, or it was stopped
            self._timer = None
            self.state = "closing"
        try:
            self._finish_closing(f"released after {duration(self.idle_timeout_s)} idle (--idle-timeout)",
                                 "FINISHED", Quiet(), 15.0, polite=True)
        except Exception:  # a timer thread has nobody to tell
            _log.warning("could not release the idle session", exc_info=True)

    # -- what it is ---------------------------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self.state != "open":
            raise SessionError(f"the session is {'stopping' if self.state == 'closing' else 'over'}"
                               f"{': ' + self.ended if self.ended else ''}; %distribute_session start (or a new "
                               "Session) begins a new one")

    def check_beside(self, config: RunConfig) -> None:
        """A run with ``config`` fits beside this session's ranks, or a `ConfigError` says why not (checked before the
        run launches anything: `driver.plan.check`)."""
        if self.state in ("closing", "closed") or config.backend != self.config.backend:
            return
        mine, theirs = self.launcher.capacity(self.config), self.launcher.capacity(config)
        if mine is None or theirs is None or mine[0] != theirs[0]:
            return
        pool, total = theirs
        needed = config.num_processes + self.world_size
        if needed <= total:
            return
        room = total - self.world_size
        fix = f"use -n {room} or fewer, or stop the session" if room > 0 else "stop the session"
        raise ConfigError("--num-processes", f"-n {config.num_processes} beside the open session's {self.world_size} "
                                             f"ranks needs {needed} of the {total} {pool}; {fix} first "
                                             "(%distribute_session stop); nothing was launched")

    def describe(self) -> str:
        return (f"{self.world_size} rank(s), {self.config.backend}, {self.config.strategy} {self.config.precision}"
                + (f", MLflow run {self.run_id}" if getattr(self, "run_id", None) else ""))

    def held_text(self) -> str:
        """What the session holds and until when, for the cell that started it."""
        return describe.held_text(self.described, self.config, self.idle_timeout_s)

    def status(self) -> str:
        """The session in a few lines: where its ranks are and what each does, its MLflow run, how long it is held."""
        return describe.status_text(self)

    def doing(self, rank: int) -> str | None:
        """The command ``rank`` runs now ("Cell In[7]"), None when it is idle."""
        return self._labels.get(self.busy[rank], "a command") if rank in self.busy else None

    def cells_text(self) -> str:
        """Every command's source with where it ran, in order (the MLflow run's ``session_cells.py``)."""
        return describe.cells_text(self._sources, self.world_size)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop("closed")

    def __repr__(self) -> str:
        return f"Session({self.describe()}, {self.state})"


def _rebuilt(answer: CellDone, strict: bool) -> Any:
    """A rank's value, unpickled here. One that pickled there but cannot be rebuilt here (it needs the rank's process
    group, a GPU, a module the notebook lacks) is a `SessionError` for a pull, its stand-in for a cell's value."""
    try:
        return unpack(answer.pickled_value)
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if strict:
            raise SessionError(f"rank {answer.rank}'s value came back but cannot be rebuilt in the notebook ({why}); "
                               "pull what it holds instead (a tensor, a state_dict(), plain data)") from None
        return Unsent("?", f"<rank {answer.rank}'s value: cannot be rebuilt in the notebook ({why})>", why)


def _serve_function() -> Callable[..., None]:
    from .worker import serve  # pickled by reference: every rank imports dtrain_magic

    return serve



__all__ = ["Session"]
