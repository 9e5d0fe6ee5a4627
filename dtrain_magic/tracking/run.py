"""The MLflow run of one ``%%distribute``: `RunTracker` (params, metrics, result, status) and `RunOpening`
(opening it in a background thread while the workers start)."""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from typing import Any, Mapping

from ..config import RunConfig, redact_uri
from ..errors import ConfigError, log_dropped, summary
from .preload import wait_for_preload
from .system_metrics import SYSTEM_METRICS_INTERVAL_S, finish_monitor, quiet_mlflow, start_monitor
from .uri import NOTHING_LAUNCHED, WORKERS_STOPPED, deleted_experiment_error, resolve_tracking_uri, tracking_uri_error
from .writer import MetricWriter


class RunTracker:
    """The MLflow run of one ``%%distribute``."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, tracking_uri: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self._monitors: list[Any] = []
        self._writer = MetricWriter(client, run_id)
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def start(cls, config: RunConfig, tags: Mapping[str, str] | None = None,
              params: Mapping[str, Any] | None = None, reopen: str | None = None) -> "RunTracker":
        """Create the run (and the experiment if new); a store MLflow cannot use is a `ConfigError`. ``params``:
        hyperparameters logged beside the config's (a sweep trial's). ``reopen``: continue that run instead
        (``--resume``, `reopen`)."""
        wait_for_preload()
        from mlflow import MlflowClient
        from mlflow.entities import Param

        quiet_mlflow()
        uri = resolve_tracking_uri(config)
        try:
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(config.experiment)
        except Exception as exc:  # e.g. an unwritable path, a file store MLflow refuses, not an MLflow server
            reason = summary(exc, limit=300, sentence=True)
            raise tracking_uri_error(config, f"MLflow cannot use this store: {reason}") from None
        if experiment is not None and experiment.lifecycle_stage == "deleted":
            raise deleted_experiment_error(config, uri)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.experiment)
        if reopen is not None:
            return cls.reopen(client, reopen, uri, tags)
        run_tags = {"dtrain_magic.backend": config.backend, "dtrain_magic.strategy": config.strategy}
        run_tags.update(tags or {})
        run = client.create_run(experiment_id, tags=run_tags)
        logged = {**config.to_params(), **{key: str(value) for key, value in (params or {}).items()}}
        client.log_batch(run.info.run_id, params=[Param(key, value[:6000]) for key, value in logged.items()])
        return cls(client, run.info.run_id, experiment_id, uri)

    @classmethod
    def reopen(cls, client: Any, run_id: str, uri: str, tags: Mapping[str, str] | None) -> "RunTracker":
        """``--resume``: the unfinished run ``run_id`` RUNNING again, its metrics going on in the same history. Its
        params stay as logged (MLflow refuses a param's new value); ``tags`` are set, a failure tag of the attempt
        before is removed, and ``dtrain_magic.resumes`` counts the resumes."""
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        if "dtrain_magic.failure" in run.data.tags:
            client.delete_tag(run_id, "dtrain_magic.failure")
        resumes = int(run.data.tags.get("dtrain_magic.resumes", "0") or 0) + 1
        tracker = cls(client, run_id, run.info.experiment_id, uri)
        tracker.set_tags({**(tags or {}), "dtrain_magic.resumes": resumes,
                          f"dtrain_magic.resumed_{resumes}": f"after {run.info.status}"})
        return tracker

    # -- during the run ---------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: Mapping[str, float], timestamp_ms: int | None = None,
                    logged: bool = True) -> None:
        """Queue ``metrics`` at ``step``; ``logged``: the function's own (``ctx.log``: `RunResult.metrics` has the
        last of each), not the magic's (``perf/...``)."""
        from mlflow.entities import Metric

        stamp = timestamp_ms or int(time.time() * 1000)
        batch = [Metric(key, float(value), stamp, int(step)) for key, value in metrics.items()]
        if logged:
            self.last_metrics.update({key: float(value) for key, value in metrics.items()})
        self._writer.queue.put(batch)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)[:5000]) for key, value in tags.items()])

    def set_tags_soon(self, tags: Mapping[str, Any]) -> None:
        """`set_tags` on the writer's thread (the caller does not wait for the store)."""
        tags = dict(tags)
        self._writer.queue.put(lambda: self.set_tags(tags))

    def log_text_soon(self, text: str, path: str) -> None:
        """An artifact, written on the writer's thread."""
        self._writer.queue.put(lambda: self.client.log_text(self.run_id, text, path))

    def log_texts(self, texts: Mapping[str, str]) -> None:
        """Artifacts (path → text) now; one that cannot be written is logged and skipped."""
        for path, text in texts.items():
            try:
                self.client.log_text(self.run_id, text, path)
            except Exception:  # each store fails its own way: this artifact is skipped, the user hears it
                logging.getLogger(__name__).warning("could not write the MLflow artifact %s", path, exc_info=True)

    def log_inputs(self, inputs: list[Mapping[str, str]]) -> None:
        """The run's data sources as MLflow dataset inputs (name, digest, source type and source, schema, profile:
        the "Datasets used" of the run's page)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        if inputs:
            self.client.log_inputs(self.run_id, [
                DatasetInput(Dataset(**each), tags=[InputTag("mlflow.data.context", "training")]) for each in inputs])

    def start_system_metrics(self, node_id: str | None = None, interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> None:
        """Sample CPU/memory (and GPU) of this machine into the run every ``interval_s`` seconds."""
        self._monitors.append(start_monitor(self.run_id, self.tracking_uri, node_id, interval_s))

    def log_result(self, value: Any) -> None:
        """The run's result as an artifact: ``result.json`` when it is JSON data, else ``result.txt``."""
        try:
            text = json.dumps(value, indent=2, default=_json_default)
            self.client.log_text(self.run_id, text, "result.json")
        except (TypeError, ValueError):
            self.client.log_text(self.run_id, repr(value)[:100_000], "result.txt")

    # -- at the end ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every metric queued so far."""
        self._writer.close()

    def finish(self, status: str, reason: str | None = None, tags: Mapping[str, Any] | None = None,
               inputs: list[Mapping[str, str]] = ()) -> None:
        """Stop system metrics, flush every queued metric, set ``tags`` (and the data ``inputs``) and the status
        (FINISHED, FAILED, KILLED); ``reason`` goes to the ``dtrain_magic.failure`` tag."""
        for monitor in self._monitors:
            try:
                finish_monitor(monitor)
            except Exception as exc:  # MLflow's monitor thread: its last samples at most; the run's status matters more
                log_dropped(__name__, "finish", exc)
        self._monitors.clear()
        self.flush()
        tags = dict(tags or {})
        if reason:
            tags["dtrain_magic.failure"] = reason
        self.set_tags(tags)
        try:
            self.log_inputs(list(inputs))
        except Exception:  # a record of the data, never the run's failure
            logging.getLogger(__name__).warning("could not record the run's data sources", exc_info=True)
        self.client.set_terminated(self.run_id, status=status)

    def ui_link(self) -> str:
        """Where to see the run: an http(s) tracking server's page, else the store's location."""
        base = redact_uri(self.tracking_uri)
        if base.startswith("http"):
            return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{base} (run {self.run_id}; view with `mlflow ui --backend-store-uri {base}`)"


class RunOpening:
    """`RunTracker.start` and its system-metrics monitor, in a background thread.

    A kernel's first run imports MLflow (about 2 s of CPU here, as long as torch's whole launch): opened
    this way, the backend can start meanwhile. ``deferred``: do nothing, not even import MLflow, until
    `wait` or `close` is called (workers started first get the machine's cores to themselves). `wait` gives the tracker
    (or raises what opening it raised); `close` ends the run whether or not anyone waited for it, so no
    run is left RUNNING.
    """

    def __init__(self, config: RunConfig, tags: Mapping[str, str] | None = None, system_metrics: bool = True,
                 deferred: bool = False, params: Mapping[str, Any] | None = None, reopen: str | None = None):
        self._config, self._tags, self._system_metrics = config, dict(tags or {}), system_metrics
        self._params = dict(params or {})
        self._reopen = reopen  # --resume: the MLflow run to continue
        self.workers_started = False  # set by the caller before waiting: it changes what an error says
        self._tracker: RunTracker | None = None
        self._error: BaseException | None = None
        self._closing: tuple | None = None
        self._lock = threading.Lock()
        self._go = threading.Event()
        if not deferred:
            self._go.set()
        self._thread = threading.Thread(target=self._open, name="dtrain-mlflow-open", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        self._go.wait()
        try:
            tracker = RunTracker.start(self._config, self._tags, self._params, reopen=self._reopen)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by wait()
            self._error = exc
            return
        try:
            if self._system_metrics:
                tracker.start_system_metrics()
        except Exception:  # MLflow's monitor fails in many ways: the run goes on, the user hears it
            logging.getLogger(__name__).warning("system metrics are off for this run", exc_info=True)
        with self._lock:
            closing = self._closing
            if closing is None:
                self._tracker = tracker
                return
        status, reason, tags, metrics, artifacts, inputs = closing
        for step, values, stamp in metrics:
            tracker.log_metrics(step, values, stamp)
        tracker.log_texts(artifacts)
        tracker.finish(status, reason, tags, inputs)  # the caller gave up waiting (an interrupt): end its run
        atexit.unregister(self._finish_at_exit)

    def begin(self) -> None:
        """Start opening a deferred run now, in the background (`wait` also does)."""
        self._go.set()

    def settled(self, timeout: float | None = None) -> bool:
        """True once opening has ended, with a run or an error (waits up to ``timeout`` seconds)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self) -> RunTracker:
        """The open run's tracker; raises the `ConfigError` (or other error) that opening it raised."""
        self._go.set()
        self._thread.join()
        error = self._error
        if isinstance(error, ConfigError) and self.workers_started:
            message = str(error)[len(error.flag) + 2:].replace(NOTHING_LAUNCHED, WORKERS_STOPPED)
            raise ConfigError(error.flag, message) from None
        if error is not None:
            raise error
        assert self._tracker is not None
        return self._tracker

    def close(self, status: str, reason: str | None = None, tags: Mapping[str, Any] | None = None,
              timeout: float = 30.0, metrics: list[tuple[int, Mapping[str, float], int]] = (),
              artifacts: Mapping[str, str] | None = None, inputs: list[Mapping[str, str]] = ()) -> None:
        """End the run with ``status`` (and ``tags``, and the data ``inputs``): now if it is open, else when it
        opens (waiting up to ``timeout`` for that; 0: not at all, it ends by itself). ``metrics`` ((step, values,
        timestamp_ms), received while it was opening) and ``artifacts`` (path → text: each rank's log, stacks) are
        logged first."""
        metrics, artifacts, inputs = list(metrics), dict(artifacts or {}), list(inputs)
        with self._lock:
            self._closing = (status, reason, tags, metrics, artifacts, inputs)
            tracker, self._tracker = self._tracker, None
        self._go.set()  # a run that never opened is still recorded, with this status
        if tracker is not None:
            for step, values, stamp in metrics:
                tracker.log_metrics(step, values, stamp)
            tracker.log_texts(artifacts)
            tracker.finish(status, reason, tags, inputs)
        elif timeout:
            self._thread.join(timeout)  # it ends the run itself if it opens after this
        elif self._thread.is_alive():  # not waited for now: at the latest when the process exits (a script)
            atexit.register(self._finish_at_exit)

    def _finish_at_exit(self) -> None:
        self._thread.join(30.0)



def _json_default(value: Any) -> Any:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
    except ImportError:
        pass
    raise TypeError(type(value).__name__)
