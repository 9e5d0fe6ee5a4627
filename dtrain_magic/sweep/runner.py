"""The sweep loop: ask Optuna for a trial, run it as a run of the one captured payload, tell Optuna how it ended;
``--parallel-trials`` of them at once, each on a thread of its own that pumps its run.

The cell (or function) is captured once (`driver.runner.prepare`, by the entry point): each trial's run reuses that
payload with its own `RunConfig` (the base config with the trial's run options, checked by `driver.runner.prepare`
once per combination of options: every combination up front when the space's options are finite) and its own
``ctx.params`` and MLflow parent (`PreparedRun` ``params``/``parent_run_id``). A trial that fails is FAILED with
its one-line error and the sweep goes on until ``--max-failed-trials``; an interrupt stops every trial (each run's
stop event: the runner's own stop, so nothing is left) and raises `RunInterrupted`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, TextIO

from ..config import RunConfig
from ..driver import runner
from ..driver.step_stop import StepStop
from ..errors import ConfigError, DistributeError, RunInterrupted, log_dropped, summary
from .board import SweepBoard
from .fits import skip_reason
from .options import SweepOptions
from .parent import ParentRun
from .result import RUN_ID_ATTR, SweepResult
from .space import Space
from .study import counted, mark_interrupted, open_study, resume
from .trial import FAILED, FINISHED, INTERRUPTED, PRUNED, SKIPPED, Outcome, run_trial

_JOIN_AFTER_INTERRUPT_S = 1.5  # a stopped run gives its thread back within about a second (runner.STOP_WAIT_S)


class SweepError(DistributeError):
    """The sweep stopped: ``--max-failed-trials`` trials failed. ``result``: the `SweepResult` so far."""

    title = "SweepError"

    def __init__(self, message: str, result: SweepResult):
        self.result = result
        super().__init__(message)


class Sweep:
    """One sweep: the study, the parent run, the trials' runs. ``base``: the `PreparedRun` made by the entry point
    (the capture); ``make_config(options)``: the base config with a trial's run options (by field), resolved and
    validated as the entry point resolves its own; ``sources``: where ``--data`` sources are found (`prepare`'s)."""

    def __init__(self, base: Any, make_config: Callable[[Mapping[str, Any]], RunConfig], space: Space,
                 options: SweepOptions, sources: Mapping[str, Any] | None = None, out: TextIO | None = None,
                 cell_model: Callable[[], Any] | None = None, show_panel: Callable[[Any], None] | None = None):
        """``show_panel(widget)``: where the sweep's panel goes (the ``--configure`` panel's own box); default:
        displayed in the cell's output."""
        self.base, self.make_config, self.space, self.options = base, make_config, space, options
        self.sources, self._out = sources, out
        self._cell_model, self._model_lock = cell_model, threading.Lock()  # the model, counted once when first asked
        self._prepared: dict[tuple, Any] = {(): base}
        self._prepare_lock = threading.Lock()
        self._lock = threading.Lock()
        self._running: dict[int, StepStop] = {}
        self._stopping = threading.Event()
        self.results: dict[int, Any] = {}
        self.failures: list[str] = []
        self.board = SweepBoard(options.metric, options.mode == "min")  # what the panel draws
        self.panel: Any = None
        self._show_panel = show_panel
        self._stopped_from_panel = False
        self._stopped_by_hand: set[int] = set()  # trials stopped one by one from the panel
        self.check_options()

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    # -- before anything runs ------------------------------------------------------------------------

    def check_options(self) -> None:
        """Every combination of the space's run options made into a checked run now, when they are finite: an invalid
        one is a `ConfigError` naming it before any trial runs (else each trial's is checked when it is drawn); and
        ``--parallel-trials``."""
        combos = self.space.option_combinations()
        for combo in combos or ():
            if combo:
                self._prepare(combo)
        self.slots(1)  # --parallel-trials that cannot be: refused now

    def _prepare(self, options: Mapping[str, Any]) -> Any:
        """The `PreparedRun` for a trial's run options (one per combination; the payload is the base's)."""
        key = tuple(sorted(options.items()))
        with self._prepare_lock:
            if key not in self._prepared:
                words = " ".join(f"{k}={v}" for k, v in options.items())
                try:
                    config = self.make_config(options)
                    self._prepared[key] = runner.prepare(config, lambda: self.base.payload, None, self.sources)
                except ConfigError as exc:
                    raise ConfigError("--sweep", f"the trial's run options {words} make no valid run: {exc}; "
                                                 "drop that value from the space") from None
            return self._prepared[key]

    def slots(self, to_run: int) -> int:
        """How many trials run at once: ``--parallel-trials``, or auto: the backend's capacity (local CPU runs: this
        machine's cores) over the most processes a trial takes. Local GPU runs one trial at a time: each run numbers
        its GPUs from 0 (`worker.process_group.device_for`), so trials at once would share them."""
        wanted = self.options.parallel_trials
        config = self.base.config
        launcher = self.base.plan.launcher
        if launcher.ranks_on_this_machine and config.use_gpu:
            if wanted not in ("auto", 1):
                raise ConfigError("--parallel-trials", f"got {wanted}; local GPU trials run one at a time (each run's "
                                                       "ranks take GPUs from 0, so trials at once would share them)")
            return 1
        if wanted == "auto":
            capacity = launcher.capacity(config)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            size = capacity[1] if capacity else cores
            if capacity and not config.use_gpu and launcher.workers_share_files(config):
                # every worker on this machine (the magic's own Ray, started with more logical CPUs than cores so that
                # the next run's workers fit beside a run): its cores bound how many CPU trials run well at once
                size = min(size, cores)
            most = max([prepared.config.num_processes for prepared in self._prepared.values()] + [1])
            wanted = max(1, size // most)
        return max(1, min(int(wanted), to_run))

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self) -> SweepResult:
        """Run the trials the study still needs; the `SweepResult`. Raises `RunInterrupted` on an interrupt (every
        trial stopped) and `SweepError` once ``--max-failed-trials`` trials failed."""
        config = self.base.config
        study = open_study(self.options, self.space, self.base.plan.tracking_uri, config.seed)
        resume(study)
        total = self._total(study)
        to_run = max(0, total - counted(study))
        name = self.options.sweep_name or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
        self.parent = ParentRun(self.base.plan.tracking_uri, config.experiment, name, self._parent_params(total),
                                study if self.options.sweep_name else None)
        self.study, self.total, self._asked = study, total, 0
        self.result = SweepResult(study, self.parent.run_id, self.options.metric, self.results)
        slots = self.slots(to_run) if to_run else 0
        print(f"dtrain_magic: sweep {name}: {to_run} trial(s) to run of {total}, {slots} at once; "
              f"MLflow parent run {self.parent.run_id}", file=self.out)
        self.board.total = total
        self._open_panel(config)
        try:
            self._run_threads(to_run, slots)
        finally:
            self._release_reused()
            if self.panel is not None:
                self.panel.close()
        return self._end()

    def _open_panel(self, config: RunConfig) -> None:
        """With the UI on (``--ui``, a notebook's default): the sweep's panel (`ui.sweep_panel`), if the widget
        packages are there; the lines are printed either way."""
        if not config.ui:
            return
        try:
            from ..ui.sweep_panel import SweepPanel
        except ImportError:  # no ipywidgets/plotly (the ui extra): the printed lines are the sweep's record
            return
        self.panel = SweepPanel(self.board, on_stop=self.stop, on_stop_trial=self.stop_trial,
                                display=self._show_panel is None)
        if self._show_panel is not None:
            self._show_panel(self.panel.container)

    def _release_reused(self) -> None:
        """The trials' reused workers go (the launcher's spares) and, as after any run, the next run's are launched
        ahead: a run after the sweep gets fresh ones."""
        try:
            if self.base.plan.launcher.release_reused("the sweep ended") and not self._stopping.is_set():
                runner.keep_warm_ahead(self.base.plan)
        except Exception as exc:  # what stays is released at its idle time or the kernel's exit
            log_dropped(__name__, "release_reused", exc)

    def stop(self) -> None:
        """Stop the sweep from the panel: every running trial stopped, none started; `run` raises
        `RunInterrupted`."""
        self._stopped_from_panel = True
        self._stop_all()

    def stop_trial(self, number: int) -> None:
        """Stop one running trial from the panel (Optuna's number), as a pruned one stops: every rank after the same
        step; it is PRUNED (``user_attrs_stopped_from_panel``) and the sweep goes on."""
        with self._lock:
            stop = self._running.get(number)
            if stop is not None:
                self._stopped_by_hand.add(number)
                stop.at_a_step("stopped from the panel")

    def _total(self, study: Any) -> int:
        """``--trials``; with the grid sampler at most the grid's size, which is also the default."""
        import optuna

        size = self.space.size if isinstance(study.sampler, optuna.samplers.GridSampler) else None
        if self.options.trials is not None:
            return min(self.options.trials, size) if size else self.options.trials
        if size:
            return size
        raise ConfigError("--trials", "give how many trials to run (only a space of grid(...) words has a size of its "
                                      "own), e.g. --trials 12")

    def _parent_params(self, total: int) -> dict[str, Any]:
        o = self.options
        return {"sweep.space": self.space.text, "sweep.metric": o.metric, "sweep.mode": o.mode,
                "sweep.trials": total, "sweep.sampler": _named(o.sampler), "sweep.pruner": _named(o.pruner),
                "config": self.base.config.flag_line()}

    def _run_threads(self, to_run: int, slots: int) -> None:
        threads = [threading.Thread(target=self._slot, args=(to_run,), name=f"dtrain-sweep-{i}", daemon=True)
                   for i in range(slots)]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
            if self._stopped_from_panel:
                raise KeyboardInterrupt  # as an interrupt ends it (the trials are stopped already)
        except KeyboardInterrupt:
            self._stop_all()
            deadline = time.monotonic() + _JOIN_AFTER_INTERRUPT_S
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            self.parent.end("KILLED", self.result.best, self.options.metric)
            how = "stopped from the panel" if self._stopped_from_panel else "interrupted"
            raise RunInterrupted(f"the sweep was {how}; every trial was stopped (a named sweep continues where it "
                                 "was when run again)") from None

    def _stop_all(self) -> None:
        self._stopping.set()
        with self._lock:
            for stop in self._running.values():
                stop.set()

    def _slot(self, to_run: int) -> None:
        """One slot: ask, run, tell, until the sweep has asked for every trial or is stopped."""
        while not self._stopping.is_set():
            with self._lock:
                if self._asked >= to_run or self._stopping.is_set():  # stopped since: no new trial
                    return
                self._asked += 1
                trial = self.study.ask(self.space.distributions)
                stop = self._running[trial.number] = StepStop()
            self.board.trial_started(trial.number, trial.params)
            try:
                outcome = self._trial(trial, stop)
                if trial.number in self._stopped_by_hand and outcome.state in (INTERRUPTED, PRUNED):
                    outcome.state = PRUNED  # (stopped as Stop stops when the ranks could not agree on a step)
            except Exception as exc:  # not the trial's own failure (that is an Outcome): said, never a silent thread
                outcome = Outcome(FAILED, error=f"the sweep could not run it: {summary(exc, limit=300)}")
            finally:
                with self._lock:
                    self._running.pop(trial.number, None)
            self._tell(trial, outcome)

    def _trial(self, trial: Any, stop: StepStop) -> Outcome:
        options, params = self.space.split(trial.params)
        try:
            prepared = self._prepare(options)
        except DistributeError as exc:
            return Outcome(FAILED, error=str(exc).splitlines()[0])
        skipped = skip_reason(self._model(), prepared.config, self.base.plan.launcher.ranks_on_this_machine)
        if skipped is not None:
            return Outcome(SKIPPED, error=skipped)
        label = f"trial {trial.number + 1}/{self.total}"
        return run_trial(prepared, trial, params, self.parent.run_id, self.options.metric, label, stop, self._out,
                         on_value=lambda step, value: self.board.trial_value(trial.number, step, value))

    def _model(self) -> Any:
        """The cell's model counted without training (`memory.CellModel`), once; None when there is no way to."""
        with self._model_lock:
            if callable(self._cell_model):
                try:
                    self._cell_model = self._cell_model()
                except Exception as exc:  # counting is a nicety: the trials launch as they would without it
                    log_dropped(__name__, "the cell's model", exc)
                    self._cell_model = None
            return self._cell_model

    def _tell(self, trial: Any, outcome: Outcome) -> None:
        from optuna.trial import TrialState

        skipped = outcome.state == SKIPPED
        for key, value in ((RUN_ID_ATTR, outcome.run_id), ("pruned_at_step", outcome.pruned_at),
                           ("stopped_at_step", outcome.stopped_at), ("skipped" if skipped else "error", outcome.error),
                           ("steps", outcome.steps)):
            if value is not None:
                trial.set_user_attr(key, value)
        if trial.number in self._stopped_by_hand and outcome.state == PRUNED:
            trial.set_user_attr("stopped_from_panel", True)
        self._tag_child(trial, outcome)
        with self._lock:
            if outcome.state == INTERRUPTED:
                mark_interrupted(self.study, [trial.number])
            state = {FINISHED: TrialState.COMPLETE, PRUNED: TrialState.PRUNED}.get(outcome.state, TrialState.FAIL)
            tell(self.study, trial, outcome.value if state == TrialState.COMPLETE else None, state)
            if outcome.result is not None and outcome.state == FINISHED:
                self.results[trial.number] = outcome.result
            if outcome.state == FAILED:
                self.failures.append(f"trial {trial.number + 1}: {outcome.error}")
        note = _pruned(outcome) if outcome.state == PRUNED else (outcome.error or "")
        self.board.trial_ended(trial.number, outcome.state, outcome.value if outcome.state == FINISHED else None,
                               outcome.seconds, note[:200])
        print(self._line(trial, outcome), file=self.out, flush=True)
        if len(self.failures) >= self.options.max_failed_trials:
            self._stop_all()

    def _tag_child(self, trial: Any, outcome: Outcome) -> None:
        if outcome.run_id is None:
            return
        tags: dict[str, Any] = {"dtrain_magic.trial": trial.number}
        if outcome.pruned_at is not None:
            tags["dtrain_magic.pruned_at_step"] = outcome.pruned_at
        if outcome.stopped_at is not None:
            tags["dtrain_magic.stopped_at_step"] = outcome.stopped_at
        self.parent.tag_trial(outcome.run_id, tags)

    def _line(self, trial: Any, outcome: Outcome) -> str:
        """``trial 3/12 FINISHED val_loss=0.123 lr=0.01 batch=32 (4.2 s)``; ``trial 4/12 PRUNED at step 7, every rank
        stopped after step 9 ...``."""
        state = f"PRUNED {_pruned(outcome)}" if outcome.state == PRUNED else outcome.state
        if outcome.stopped_at is not None:
            state += f", every rank stopped after step {outcome.stopped_at}"
        value = f" {self.options.metric}={outcome.value:.4g}" if outcome.value is not None else ""
        params = " ".join(f"{k}={_shown(v)}" for k, v in trial.params.items())
        error = f": {outcome.error}" if outcome.error else ""
        return f"trial {trial.number + 1}/{self.total} {state}{value} {params} ({outcome.seconds:.1f} s){error}"

    def _end(self) -> SweepResult:
        best = self.result.best
        if len(self.failures) >= self.options.max_failed_trials:
            self.parent.end("FAILED", best, self.options.metric)
            raise SweepError(f"the sweep stopped: {len(self.failures)} trials failed (--max-failed-trials "
                             f"{self.options.max_failed_trials}); the last: {self.failures[-1]}", self.result)
        self.parent.end("FINISHED", best, self.options.metric)
        if best is not None:
            print(f"dtrain_magic: best trial {best.number + 1}: {self.options.metric}={best.value:.4g} "
                  + " ".join(f"{k}={_shown(v)}" for k, v in best.params.items()) + f"; MLflow run {best.run_id}",
                  file=self.out)
        return self.result


def tell(study: Any, trial: Any, value: float | None, state: Any) -> None:
    """`Study.tell`. Optuna's `GridSampler` asks the study to stop once its grid is done (`Study.stop`), which only an
    ``optimize`` loop may: a `RuntimeError` after the trial was stored (``_tell``'s ``finally``). The sweep stops by
    its own count of trials, so that request is dropped."""
    import optuna

    try:
        study.tell(trial, value, state=state)
    except RuntimeError:
        if not isinstance(study.sampler, optuna.samplers.GridSampler):
            raise


def _pruned(outcome: Outcome) -> str:
    """``at step 7`` (Optuna's pruner), or ``stopped from the panel`` (by hand)."""
    return f"at step {outcome.pruned_at}" if outcome.pruned_at is not None else "stopped from the panel"


def _named(setting: Any) -> str:
    """A sampler's or pruner's name, or an Optuna object's (given from Python) class."""
    return setting if isinstance(setting, str) else type(setting).__name__


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
