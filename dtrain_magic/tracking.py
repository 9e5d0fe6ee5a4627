"""MLflow: one run per ``%%distribute``, through ``MlflowClient`` (no global active run in the kernel).

Params are the `RunConfig` fields; metrics are what rank 0 logs, batched by a writer thread so the
notebook's message loop never waits on the store; system metrics come from MLflow's own
``SystemMetricsMonitor`` (CPU, memory, and GPU through nvidia-ml-py where present).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import sqlite3
import sys
import threading
import time
from typing import Any, Mapping
from urllib.parse import quote, urlsplit

from .config import RunConfig, default_tracking_uri, redact_uri
from .errors import ConfigError

SYSTEM_METRICS_INTERVAL_S = 1.0
# An http(s) tracking server must answer within this long; MLflow itself retries a dead one for minutes.
PROBE_TIMEOUT_S = 3.0
ALLOWED_URIS = (
    "sqlite:///path/to/mlflow.db, a directory (a path or file:///path; MLflow 3 wants MLFLOW_ALLOW_FILE_STORE=true), "
    "or http(s)://host:port of an MLflow server"
)
_NOTHING_LAUNCHED = "Nothing was launched and no MLflow run was created."
_WORKERS_STOPPED = "The workers, started while MLflow opened the run, were stopped; no MLflow run was created."
_PLAIN_SCHEMES = {"", "file", "sqlite", "http", "https"}  # MLflow always has these; others: ask its registry


def resolve_tracking_uri(config: RunConfig) -> str:
    """``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///./mlflow.db``."""
    return config.tracking_uri or default_tracking_uri()


def check_tracking_uri(config: RunConfig, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The tracking URI, or a short `ConfigError` when MLflow cannot use it: an unknown scheme, or an
    http(s) server that does not answer within ``timeout_s``. Creates nothing (no database, no run)."""
    uri = resolve_tracking_uri(config)
    bare = uri.strip().lower()
    scheme = bare if bare in {"databricks", "databricks-uc", "uc"} else urlsplit(uri).scheme.lower()
    if scheme not in _PLAIN_SCHEMES and not _mlflow_has_store_for(uri):
        raise tracking_uri_error(config, f"MLflow has no tracking store for the scheme {scheme + '://'!r}")
    if scheme in ("http", "https"):
        problem = _probe_http(uri, timeout_s)
        if problem:
            raise tracking_uri_error(
                config, f"no working MLflow server there ({problem})", "Start one (`mlflow server --port PORT`) or use"
            )
    if sqlite_experiment_stage(uri, config.experiment) == "deleted":
        raise deleted_experiment_error(config, uri)
    return uri


def tracking_uri_error(config: RunConfig, problem: str, fix: str = "Use") -> ConfigError:
    """``--tracking-uri: <problem>`` naming the URI (credentials removed), where it came from, and what works."""
    uri = redact_uri(resolve_tracking_uri(config))
    origin = "" if config.tracking_uri else " (from $MLFLOW_TRACKING_URI)"
    return ConfigError("--tracking-uri", f"{uri!r}{origin}: {problem}. {fix} {ALLOWED_URIS}. {_NOTHING_LAUNCHED}")


def deleted_experiment_error(config: RunConfig, uri: str) -> ConfigError:
    return ConfigError(
        "--experiment",
        f"the experiment {config.experiment!r} was deleted in {redact_uri(uri)}; restore it "
        f"(`mlflow experiments restore`) or choose another name. {_NOTHING_LAUNCHED}",
    )


def sqlite_experiment_stage(uri: str, experiment: str) -> str | None:
    """What a plain ``sqlite:///path`` store says of ``experiment``, read without importing MLflow (which
    takes seconds): ``"active"``, ``"deleted"``, ``"absent"`` (no such experiment or no database yet:
    MLflow creates them), or None when this cannot tell (another kind of store, a file this user cannot
    write, not MLflow's schema). Read-only: creates nothing."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    path = os.path.abspath(os.path.expanduser(uri[len("sqlite:///"):]))  # sqlite:////abs or sqlite:///relative
    folder = os.path.dirname(path)
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # SQLite writes its journal beside the file
        return None
    if not os.path.exists(path):
        return "absent"
    if not os.access(path, os.R_OK | os.W_OK):
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=2.0)) as db:
            row = db.execute("SELECT lifecycle_stage FROM experiments WHERE name = ?", (experiment,)).fetchone()
    except sqlite3.Error:
        return None
    if row is None:
        return "absent"
    return row[0] if row[0] in ("active", "deleted") else None


def _mlflow_has_store_for(uri: str) -> bool:
    wait_for_preload()
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:  # MLflow moved its registry: let creating the run decide
        return True
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:
        return False
    return True


def _probe_http(uri: str, timeout_s: float) -> str | None:
    """Why nothing answers HTTP at ``uri`` within ``timeout_s`` (one request, no retry), or None.

    Any answer below 500 counts, even 401 or 404: creating the run then says what is wrong with it. A 5xx
    (a proxy in front of a dead server, an unhealthy server) does not: MLflow would retry it for minutes.
    """
    import requests

    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1")
    verify: Any = False if insecure else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    cert = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH") or None
    try:
        answer = requests.get(
            f"{uri.rstrip('/')}/health", timeout=timeout_s, verify=verify, cert=cert, allow_redirects=False
        )
    except requests.exceptions.SSLError as exc:
        return f"TLS failed: {_os_reason(exc)}"
    except requests.exceptions.Timeout:
        return f"no answer within {timeout_s:g} s"
    except (requests.exceptions.RequestException, ValueError) as exc:
        return _os_reason(exc)
    if answer.status_code >= 500:
        return f"/health answers HTTP {answer.status_code} {answer.reason or ''}".rstrip()
    return None


def _os_reason(exc: Exception) -> str:
    """"Connection refused" out of requests' nested "Max retries exceeded ... [Errno 111] ..." text."""
    found = re.search(r"\[(?:Errno|SSL[^\]]*)[^\]]*\]\s*([^'\")]+)", str(exc))
    return found.group(1).strip().rstrip(".:") if found else type(exc).__name__


def gpu_metrics_note(use_gpu: bool) -> str | None:
    """Why GPU metrics will be missing, if they will (MLflow skips them silently)."""
    if not use_gpu:
        return None
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)
    except ImportError:
        return "GPU metrics are off: install nvidia-ml-py to record GPU utilisation and memory"
    return None


_import_thread: threading.Thread | None = None
_import_threads: list[threading.Thread] = []  # every background import, MLflow's and others', in start order
_import_lock = threading.RLock()


def preload_mlflow() -> None:
    """Start importing MLflow (about 2 s on a small machine) in a background thread, so a first run's
    other start-up work (a SparkSession, capturing the cell) goes on meanwhile. Imports only: no store is
    opened, no file or run created. Safe to call many times."""
    global _import_thread
    with _import_lock:
        if _import_thread is not None or "mlflow.system_metrics.system_metrics_monitor" in sys.modules:
            return
        _import_thread = import_in_background("dtrain-mlflow-import", _import_mlflow)


def import_in_background(name: str, target: Any) -> threading.Thread:
    """Run ``target`` (imports only) in a background thread, after every earlier background import has
    ended; MLflow's own import waits for it too (`wait_for_preload`). Two threads importing modules they
    share (numpy, pandas, ...) at once can deadlock on Python's import locks or see a half-initialised
    module, so background imports never overlap each other. Used for MLflow and for the live charts'
    plotly (whose first FigureWidget imports nbformat and jsonschema: seconds in a fresh kernel)."""
    with _import_lock:
        earlier = [t for t in _import_threads if t.is_alive()]

        def chained() -> None:
            for thread in earlier:
                thread.join()
            target()

        thread = threading.Thread(target=chained, name=name, daemon=True)
        _import_threads[:] = earlier + [thread]
        thread.start()
    return thread


def _import_mlflow() -> None:
    try:
        from mlflow import MlflowClient  # noqa: F401
        from mlflow.entities import Metric, Param  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # noqa: F401
    except Exception:  # not installed or broken: the run's own import says so, in the notebook's thread
        pass


def wait_for_preload() -> None:
    """Let every running background import (`preload_mlflow`, `import_in_background`) finish before
    importing MLflow here: two threads importing the same package's modules at once can deadlock on
    Python's import locks."""
    with _import_lock:
        threads = list(_import_threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class _MetricWriter(threading.Thread):
    """Writes queued metrics with ``log_batch``, as many per call as are waiting.

    Not MLflow's own ``synchronous=False`` queue: that one polls with a delay, which added about a
    second to every run's end (flush, then ``set_terminated`` shutting it down), and it is shared by
    every run of the process, so ending one run stopped the queue of a concurrent one.
    """

    MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch
    # Gather for this long after the first waiting metric: one SQLite write per step cost the workers
    # CPU on a small machine; a quarter second keeps the charts well inside their 1 s lag.
    COALESCE_S = 0.25

    def __init__(self, client: Any, run_id: str):
        super().__init__(name="dtrain-mlflow-writer", daemon=True)
        self.client, self.run_id = client, run_id
        self.queue: "queue.Queue[list | None]" = queue.Queue()
        self.start()

    def run(self) -> None:
        try:  # Linux threads have their own nice value: let busy CPU workers on this machine go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        done = False
        while not done:
            batch = self.queue.get()
            if batch is None:
                return
            batch = list(batch)
            deadline = time.monotonic() + self.COALESCE_S
            while len(batch) < self.MAX_BATCH:
                try:
                    more = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    done = True
                    break
                batch.extend(more)
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception:
                logging.getLogger(__name__).warning("could not log %d metrics to MLflow", len(batch), exc_info=True)

    def close(self, timeout: float = 30.0) -> None:
        """Write everything queued, then stop."""
        self.queue.put(None)
        self.join(timeout)


class RunTracker:
    """The MLflow run of one ``%%distribute``."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, tracking_uri: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self._monitors: list[Any] = []
        self._writer = _MetricWriter(client, run_id)
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def start(cls, config: RunConfig, tags: Mapping[str, str] | None = None) -> "RunTracker":
        """Create the run (and the experiment if new); a store MLflow cannot use is a `ConfigError`."""
        wait_for_preload()
        from mlflow import MlflowClient
        from mlflow.entities import Param

        _quiet_mlflow()
        uri = resolve_tracking_uri(config)
        try:
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(config.experiment)
        except Exception as exc:  # e.g. an unwritable path, a file store MLflow refuses, not an MLflow server
            raise tracking_uri_error(config, f"MLflow cannot use this store: {_first_sentence(exc)}") from None
        if experiment is not None and experiment.lifecycle_stage == "deleted":
            raise deleted_experiment_error(config, uri)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.experiment)
        run_tags = {"dtrain_magic.backend": config.backend, "dtrain_magic.strategy": config.strategy}
        run_tags.update(tags or {})
        run = client.create_run(experiment_id, tags=run_tags)
        params = [Param(key, value[:6000]) for key, value in config.to_params().items()]
        client.log_batch(run.info.run_id, params=params)
        return cls(client, run.info.run_id, experiment_id, uri)

    # -- during the run ---------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: Mapping[str, float], timestamp_ms: int | None = None) -> None:
        from mlflow.entities import Metric

        stamp = timestamp_ms or int(time.time() * 1000)
        batch = [Metric(key, float(value), stamp, int(step)) for key, value in metrics.items()]
        self.last_metrics.update({key: float(value) for key, value in metrics.items()})
        self._writer.queue.put(batch)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)[:5000]) for key, value in tags.items()])

    def start_system_metrics(self, node_id: str | None = None, interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> None:
        """Sample CPU/memory (and GPU) of this machine into the run every ``interval_s`` seconds."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            self.run_id, sampling_interval=interval_s, samples_before_logging=1,
            node_id=node_id, tracking_uri=self.tracking_uri,
        )
        monitor.start()
        self._monitors.append(monitor)

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

    def finish(self, status: str, reason: str | None = None, tags: Mapping[str, Any] | None = None) -> None:
        """Stop system metrics, flush every queued metric, set ``tags`` and the status (FINISHED, FAILED,
        KILLED); ``reason`` goes to the ``dtrain_magic.failure`` tag."""
        for monitor in self._monitors:
            try:
                monitor.finish()
                _publish_one_sample_if_none(monitor)
            except Exception:
                pass
        self._monitors.clear()
        self.flush()
        tags = dict(tags or {})
        if reason:
            tags["dtrain_magic.failure"] = reason
        self.set_tags(tags)
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
                 deferred: bool = False):
        self._config, self._tags, self._system_metrics = config, dict(tags or {}), system_metrics
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
            tracker = RunTracker.start(self._config, self._tags)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by wait()
            self._error = exc
            return
        try:
            if self._system_metrics:
                tracker.start_system_metrics()
        except Exception:
            logging.getLogger(__name__).warning("system metrics are off for this run", exc_info=True)
        with self._lock:
            closing = self._closing
            if closing is None:
                self._tracker = tracker
                return
        status, reason, tags, metrics = closing
        for step, values, stamp in metrics:
            tracker.log_metrics(step, values, stamp)
        tracker.finish(status, reason, tags)  # the caller gave up waiting (an interrupt): end the run it asked for

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
            message = str(error)[len(error.flag) + 2:].replace(_NOTHING_LAUNCHED, _WORKERS_STOPPED)
            raise ConfigError(error.flag, message) from None
        if error is not None:
            raise error
        assert self._tracker is not None
        return self._tracker

    def close(self, status: str, reason: str | None = None, tags: Mapping[str, Any] | None = None,
              timeout: float = 30.0, metrics: list[tuple[int, Mapping[str, float], int]] = ()) -> None:
        """End the run with ``status`` (and ``tags``): now if it is open, else when it opens. ``metrics``
        ((step, values, timestamp_ms), received while it was opening) are logged first."""
        metrics = list(metrics)
        with self._lock:
            self._closing = (status, reason, tags, metrics)
            tracker, self._tracker = self._tracker, None
        self._go.set()  # a run that never opened is still recorded, with this status
        if tracker is not None:
            for step, values, stamp in metrics:
                tracker.log_metrics(step, values, stamp)
            tracker.finish(status, reason, tags)
        else:
            self._thread.join(timeout)  # it ends the run itself if it opens after this


def _publish_one_sample_if_none(monitor: Any) -> None:
    """MLflow's monitor publishes only after a whole interval: a run shorter than that (a warm re-run, or
    workers that finished while the run was opening) would have no system metrics at all. Log one sample."""
    if getattr(monitor, "_logging_step", 1) != 0:
        return
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    monitor.mlflow_logger.flush()


def _first_sentence(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")[:300]


def _json_default(value: Any) -> Any:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
    except ImportError:
        pass
    raise TypeError(type(value).__name__)


def _quiet_mlflow() -> None:
    # MLflow prints alembic migration chatter and system-metrics start/stop lines into the cell.
    for name in ("alembic", "mlflow.store.db.utils", "mlflow.system_metrics", "mlflow.tracking"):
        logging.getLogger(name).setLevel(logging.WARNING)
