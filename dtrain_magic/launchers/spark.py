"""``--backend spark``: the cell's function through ``pyspark.ml.torch.distributor.TorchDistributor``.

Exactly what a Databricks user writes: ``TorchDistributor(num_processes, local_mode, use_gpu).run(fn,
job)``, where ``fn`` is `_spark_train_fn`, a small module-level wrapper that calls
``dtrain_magic.worker.run_worker(job)`` in every torchrun process (ranks from the environment
TorchDistributor and torchrun set). Results, errors, output and metrics come back over the channel like
every other backend; TorchDistributor's own return value is ignored (it is one rank's, and not always
rank 0's).

- The SparkSession: the active one (Databricks, or the user's own) when there is one, otherwise one this
  launcher starts once (``local[*]`` or ``--spark-master``) and keeps for the next run, so a second
  ``%%distribute`` does not pay the JVM start again.
- ``start()`` returns at once: ``TorchDistributor.run`` runs in a background thread under
  ``SparkContext.setJobGroup(<run id>, ..., interruptOnCancel=True)``.
- ``cancel()`` cancels that job group (cluster mode: the barrier tasks) and kills the torchrun process
  trees this run started on this machine (local mode: they are children of the notebook). Every worker
  also watches the channel: when the notebook closes it (run over, cancelled, kernel died), a worker
  still running exits by itself, which is what stops workers on remote executors promptly.
- In cluster mode each node's first local rank runs MLflow's ``SystemMetricsMonitor`` with
  ``node_id="node<N>"`` so the run shows per-node CPU/memory (and GPU with nvidia-ml-py) use under
  ``system/node<N>/...``. In local mode the notebook's own monitor (``system/...``) covers the one node.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, LaunchError, MissingDependencyError
from ..worker import WorkerJob
from .base import Emit, Failure, Launcher, LaunchState, RunningJob, loopback_interface

MIN_JAVA = 17  # pyspark 4 runs on Java 17 and 21
_CANCEL_GRACE_S = 3.0
_EXECUTOR_WAIT_S = 60.0
_WRAPPER_MODULE = "pyspark.ml.torch.torch_run_process_wrapper"
_GPU_KEYS = ("spark.task.resource.gpu.amount", "spark.driver.resource.gpu.amount", "spark.executor.resource.gpu.amount")


# ----------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested without Spark)


def parse_java_version(text: str) -> int | None:
    """Major Java version from ``java -version`` output (``1.8.0_392`` → 8, ``17.0.9`` → 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        match = re.search(r"^\S+ (\d+)(?:\.(\d+))?", text.strip())  # e.g. 'openjdk 21.0.1 2023-10-17'
        if not match:
            return None
    major = int(match.group(1))
    if major == 1 and match.group(2):
        return int(match.group(2))
    return major


def java_command(environ: dict[str, str] | None = None) -> str | None:
    """The java Spark will use: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on PATH."""
    environ = os.environ if environ is None else environ
    home = environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.path.exists(candidate) else None
    return shutil.which("java", path=environ.get("PATH"))


def check_java(environ: dict[str, str] | None = None, minimum: int = MIN_JAVA) -> int:
    """Raise `MissingDependencyError` unless a Java >= ``minimum`` is there; returns its major version."""
    environ = os.environ if environ is None else environ
    java = java_command(environ)
    where = f"JAVA_HOME={environ['JAVA_HOME']}" if environ.get("JAVA_HOME") else "PATH"
    if java is None:
        raise MissingDependencyError(
            f"--backend spark needs Java {minimum} or newer (pyspark runs on the JVM) and no java was found "
            f"on {where}. Install a JDK {minimum}+ (e.g. `apt-get install openjdk-17-jre-headless`) and set "
            "JAVA_HOME; nothing was launched"
        )
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
        text = (proc.stderr or "") + (proc.stdout or "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MissingDependencyError(f"--backend spark: could not run `{java} -version`: {exc}; nothing was launched") from None
    major = parse_java_version(text)
    if major is None:
        raise MissingDependencyError(
            f"--backend spark: could not read the Java version from `{java} -version` "
            f"({text.strip().splitlines()[0] if text.strip() else 'no output'}); nothing was launched"
        )
    if major < minimum:
        raise MissingDependencyError(
            f"--backend spark needs Java {minimum} or newer for pyspark 4, but {java} (from {where}) is Java "
            f"{major}. Install a JDK {minimum}+ and point JAVA_HOME at it; nothing was launched"
        )
    return major


def is_loopback_master(master: str | None) -> bool:
    """``local``, ``local[*]``, ``local-cluster[...]`` or a master URL on this machine's loopback."""
    if not master:
        return True
    if master == "local" or master.startswith(("local[", "local-cluster[")):
        return True
    host = re.sub(r"^[a-z0-9+]+://", "", master).split("/")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def gpu_setting_error(message: str, local_mode: bool) -> str | None:
    """TorchDistributor's GPU RuntimeError → what to change (None when it is not a GPU setting problem)."""
    if "spark.task.resource.gpu.amount" in message:
        return (
            f"TorchDistributor refused --gpu --cluster: {message.strip()} Set the Spark config "
            "spark.task.resource.gpu.amount=1 (and spark.executor.resource.gpu.amount, plus a GPU discovery "
            "script, on the executors) on the cluster, or run with --cpu"
        )
    if "must be a multiple of" in message:
        return f"TorchDistributor refused --gpu: {message.strip()} Change -n or spark.task.resource.gpu.amount"
    if "GPU" in message and ("driver" in message or "configured" in message):
        return (
            f"TorchDistributor refused --gpu --local-mode: {message.strip()} Set the Spark config "
            "spark.driver.resource.gpu.amount=<GPUs on the driver> (with "
            "spark.driver.resource.gpu.discoveryScript) when the session starts, or run with --cpu"
        )
    return None


_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b:?.*)$")


def torchrun_root_cause(text: str) -> tuple[int, str] | None:
    """(rank, what happened) from torchrun's ChildFailedError report ("Root Cause" section), if present."""
    section = text.split("Root Cause", 1)[1] if "Root Cause" in text else ""
    rank = re.search(r"rank\s*:\s*(\d+)", section)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", section)
    if not (rank and code):
        return None
    exit_code = int(code.group(1))
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return int(rank.group(1)), f"process was killed by {name}"
    return int(rank.group(1)), f"process exited with code {exit_code}"


def one_line_reason(exc: BaseException) -> str:
    """A one-line account of a TorchDistributor/Spark exception that no worker reported itself."""
    text = str(exc)
    code = re.search(r"failed with return code (-?\d+)", text)
    errors = [m.group(1).strip() for line in text.splitlines() if (m := _ERROR_LINE.match(line))]
    errors = [e for e in errors if not e.startswith(("py4j.", "RuntimeError: Command", "org.apache.spark.SparkException: Job aborted"))]
    if code:
        reason = f"torchrun exited with code {code.group(1)}"
        return f"{reason}: {errors[-1][:300]}" if errors else reason
    if "cancelled" in text.lower() and "job" in text.lower():
        return "the Spark job was cancelled"
    if errors:
        return errors[-1][:300]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__


# ----------------------------------------------------------------------------------------------------
# What runs in every torchrun process (shipped by TorchDistributor, imported by reference)


def _spark_train_fn(job: WorkerJob, tracking_uri: str | None = None, watch: tuple | None = None) -> None:
    """TorchDistributor's train function: watchdog, per-node system metrics, then ``run_worker(job)``.

    Returns None: the user's value travels over the channel. The user's exception is swallowed after
    ``run_worker`` reported it over the channel, so torchrun and Spark end cleanly and the notebook shows
    the worker's own short error instead of a Spark traceback.
    """
    from ..worker import run_worker

    if os.environ.get("MASTER_ADDR", "").startswith("127.") or os.environ.get("MASTER_ADDR") == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    rank = int(os.environ.get("RANK", "0"))
    guard = _start_watchdog(watch, rank) if watch else None
    # Per-node system metrics in cluster mode; in local mode the workers run on the driver, whose own
    # monitor (started by the notebook) already samples this machine, and importing MLflow here would
    # only delay the first step.
    per_node = not job.config.local_mode and os.environ.get("LOCAL_RANK", "0") == "0"
    monitor = _start_node_metrics(job, tracking_uri) if per_node else None
    try:
        run_worker(job)
    except BaseException:
        pass  # already reported over the channel by run_worker
    finally:
        if guard is not None:
            try:  # ended in Python (result or reported error), not killed
                guard.stdin.write(b"done\n")
                guard.stdin.flush()
            except Exception:
                pass
        _finish_node_metrics(monitor)
    return None


def _start_watchdog(watch: tuple, rank: int) -> Any:
    """A watchdog process (`dtrain_magic.watchdog`, rank-watch mode) for this worker: it holds this rank's
    connection to the launcher's `_RankWatch` and SIGKILLs this process when the notebook closes it (run
    over, cancelled, notebook gone), whatever this process is doing, even blocked in native code."""
    from .. import watchdog

    host, port, authkey = watch
    return watchdog.start("rank-watch", host, str(port), str(rank), str(os.getpid()), secret=authkey)


class _NodeMetrics:
    def __init__(self) -> None:
        self.monitor: Any = None
        self.thread: threading.Thread | None = None


def _start_node_metrics(job: WorkerJob, tracking_uri: str | None) -> _NodeMetrics | None:
    """MLflow's SystemMetricsMonitor on this node's first local rank (started off the training path)."""
    if not job.run_id or not tracking_uri:
        return None
    node = _NodeMetrics()
    node_id = f"node{os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))}"

    def start() -> None:
        try:
            import logging

            for name in ("mlflow.system_metrics", "mlflow.tracking", "alembic", "mlflow.store.db.utils"):
                logging.getLogger(name).setLevel(logging.ERROR)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(
                job.run_id, sampling_interval=1.0, samples_before_logging=1, node_id=node_id,
                tracking_uri=tracking_uri,
            )
            monitor.start()
            node.monitor = monitor
        except Exception:
            node.monitor = None

    node.thread = threading.Thread(target=start, name="dtrain-node-metrics", daemon=True)
    node.thread.start()
    return node


def _finish_node_metrics(node: _NodeMetrics | None) -> None:
    if node is None:
        return
    if node.thread is not None:
        node.thread.join(30)
    monitor = node.monitor
    if monitor is None:
        return
    try:
        monitor.finish()
        if getattr(monitor, "_logging_step", 1) == 0:  # a run shorter than one interval: log one sample
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
    except Exception:
        pass


# ----------------------------------------------------------------------------------------------------
# Driver side


_DIED = "the process died without reporting an error (killed by a signal, or crashed below Python)"


class _RankWatch:
    """One connection per worker: a worker whose connection drops before it said "done" was killed or
    crashed (seen at once, before torchrun's report); closing it makes every remaining worker exit."""

    def __init__(self, host: str):
        from ..channel import AuthenticatedListener

        self.dead: dict[int, str] = {}
        self._listener = AuthenticatedListener(host, self._read, "dtrain-spark-watch")
        self.authkey = self._listener.authkey
        self.address = (host, self._listener.port, self.authkey)

    def _read(self, conn: Any, serial: int) -> None:
        rank, done = None, False
        try:
            while True:
                kind, rank = conn.recv()
                done = done or kind == "done"
        except Exception:
            pass
        if rank is not None and not done and not self._listener.closed.is_set():
            self.dead.setdefault(rank, _DIED)

    def close(self) -> None:
        self._listener.close()


class SparkJob(RunningJob):
    """One ``TorchDistributor.run`` in a background thread, under its own Spark job group.

    Early release: once every rank's result is in, `release` gives torchrun a few seconds to end by
    itself, then closes the rank watch, whose watchdogs kill a worker whose interpreter teardown hangs."""

    early_release = True
    _RELEASE_GRACE_S = 5.0

    def __init__(self, launcher: "SparkLauncher", spark: Any, job: WorkerJob, emit: Emit, tracking_uri: str | None):
        self._spark = spark
        self._sc = spark.sparkContext
        self._emit = emit
        self._config = job.config
        self.group = f"dtrain_magic-{job.run_id or uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._cancel_called = False
        self._cancelled = False  # cancelled while TorchDistributor.run was still going
        self._error: BaseException | None = None
        self._started_at = time.time()
        self._known_children = _child_pids()
        self._distributor = launcher._distributor(job.config)
        self._watch = _RankWatch(launcher.channel_host(job.config))
        self._thread = threading.Thread(
            target=self._run, args=(job, tracking_uri), name="dtrain-spark-run", daemon=True
        )
        self._thread.start()

    def _run(self, job: WorkerJob, tracking_uri: str | None) -> None:
        try:
            self._sc.setJobGroup(self.group, "dtrain_magic %%distribute run", interruptOnCancel=True)
            self._distributor.run(_spark_train_fn, job, tracking_uri, self._watch.address)
        except BaseException as exc:  # noqa: BLE001 - reported through poll()
            self._error = exc
        finally:
            try:
                self._sc.setLocalProperty("spark.jobGroup.id", None)
            except Exception:
                pass

    def poll(self) -> LaunchState:
        # In the order the deaths were seen, not by rank: the first is the cause (torchrun then SIGTERMs
        # the survivors, whose connections drop a moment later).
        died = [Failure(rank, reason) for rank, reason in list(self._watch.dead.items())]
        if self._thread.is_alive():
            return LaunchState(False, died)
        failures = []
        if self._error is not None and not self._cancelled:
            cause = torchrun_root_cause(str(self._error))
            if cause is not None:  # a worker died below Python (killed, crashed): name its rank and signal
                failures.append(Failure(cause[0], cause[1]))
            elif not died:
                failures.append(Failure(None, one_line_reason(self._error)))
        return LaunchState(True, failures or died)

    def active_jobs(self) -> list[int]:
        """Ids of this run's Spark jobs that are still running."""
        try:
            tracker = self._sc.statusTracker()
            jobs = tracker.getJobIdsForGroup(self.group)
            running = []
            for job_id in jobs:
                info = tracker.getJobInfo(job_id)
                if info is not None and info.status in ("RUNNING", "UNKNOWN"):
                    running.append(job_id)
            return running
        except Exception:
            return []

    def release(self) -> None:
        """Every rank's result is in: torchrun normally ends within a moment, and the cell waits for that
        (so no Spark job or process is left once it returns). Not `cancel`: its sweep of this machine's
        torchrun trees could reach another run's. A worker whose teardown hangs is killed by its watchdog
        when the rank watch closes, after a grace period, and torchrun then ends by itself."""
        self._thread.join(self._RELEASE_GRACE_S)
        if not self._claim_stop():
            return
        self._watch.close()
        self._thread.join(10.0)
        deadline = time.monotonic() + 10.0
        self._cancel_job_group()
        self._wait_for_jobs(deadline)

    def _claim_stop(self) -> bool:
        """The first of release/cancel to get here stops the run; later calls do nothing."""
        with self._lock:
            if self._cancel_called:
                return False
            self._cancel_called = True
            self._cancelled = self._thread.is_alive()
            return True

    def _cancel_job_group(self) -> None:
        if self._thread.is_alive() or self.active_jobs():
            try:
                self._sc.cancelJobGroup(self.group)
            except Exception:
                pass

    def _wait_for_jobs(self, deadline: float) -> None:
        while self.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.1)

    def cancel(self) -> None:
        if not self._claim_stop():
            return
        deadline = time.monotonic() + 10.0
        self._cancel_job_group()
        self._watch.close()  # every worker still running (here or on other hosts) exits by itself
        # torchrun trees started on this machine: the notebook's own children (local mode), or those of
        # a local-cluster's executors (descendants of the driver JVM).
        procs = _our_torchrun_trees(self._started_at, self._known_children)
        _terminate(procs, min(_CANCEL_GRACE_S, max(0.5, deadline - time.monotonic())))
        self._thread.join(max(0.5, deadline - time.monotonic() - 1.0))
        self._wait_for_jobs(deadline)
        # Anything started between the first sweep and the thread's end (a task that was just starting).
        _terminate(_our_torchrun_trees(self._started_at, self._known_children), 0.5)


def _child_pids() -> set[int]:
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:
        return set()


def _our_torchrun_trees(since: float, known: set[int]) -> list:
    """Processes of the torchrun trees this run started below this process (wrapper, torchrun, workers)."""
    try:
        import psutil
    except ImportError:
        return []
    found: dict[int, Any] = {}
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    for proc in descendants:
        try:
            if proc.pid in known or proc.create_time() < since - 1.0:
                continue
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if _WRAPPER_MODULE in cmdline or "torch.distributed.run" in cmdline:
            found[proc.pid] = proc
            try:
                for child in proc.children(recursive=True):
                    found[child.pid] = child
            except psutil.Error:
                pass
    return list(found.values())


def _terminate(procs: list, grace: float) -> None:
    """SIGTERM (the wrapper and torchrun stop their workers on it), then SIGKILL whatever is left."""
    if not procs:
        return
    import psutil

    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)


class SparkLauncher(Launcher):
    """TorchDistributor on the active SparkSession, or on one started (once) by this launcher."""

    name = "spark"

    def __init__(self) -> None:
        self._session: Any = None  # a session this launcher started (and may stop)
        self._lock = threading.Lock()
        self.session_start_s: float | None = None  # how long this launcher's last session start took
        self.session_starts = 0  # how many sessions this launcher started (a warm run starts none)
        self._exit_hook = False

    # -- the session ---------------------------------------------------------------------------------
    @staticmethod
    def _active_session() -> Any:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
        if session is None:
            return None
        try:
            if session.sparkContext._jsc is None:  # stopped
                return None
        except Exception:
            return None
        return session

    def session(self, config: RunConfig) -> Any:
        """The SparkSession a run uses (the active one, else ours, started once and reused)."""
        with self._lock:
            active = self._active_session()
            if active is not None and active is not self._session:
                return active  # Databricks, or the user's own session: never reconfigured or stopped by us
            if self._session is not None and self._alive(self._session):
                wanted = config.spark_master
                if wanted is None or self._session.sparkContext.master == wanted:
                    return self._session
                self._stop_own()  # --spark-master changed: our own session is restarted against it
            check_java()
            t0 = time.monotonic()
            self._session = self._build(config.spark_master or "local[*]")
            if not self._exit_hook:
                # Registered after pyspark's own hooks, so it runs before them: the session is stopped
                # while the JVM is still whole (a local-cluster stopped by the JVM's own shutdown prints
                # hundreds of lines of executor-launch stack traces).
                atexit.register(self.shutdown_quietly)
                self._exit_hook = True
            self.session_start_s = time.monotonic() - t0
            self.session_starts += 1
            return self._session

    @staticmethod
    def _alive(session: Any) -> bool:
        try:
            return session.sparkContext._jsc is not None
        except Exception:
            return False

    @staticmethod
    def _build(master: str) -> Any:
        from pyspark.sql import SparkSession

        # No console progress bar: it would interleave with the workers' rank-prefixed output in the cell.
        builder = SparkSession.builder.master(master).appName("dtrain_magic").config("spark.ui.showConsoleProgress", "false")
        if is_loopback_master(master):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # Executors (local-cluster, a standalone cluster on this machine) run this notebook's Python.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            builder = (
                builder.config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
            )
        try:
            session = builder.getOrCreate()
        except Exception as exc:
            raise LaunchError(f"could not start a SparkSession on {master}: {one_line_reason(exc)}") from None
        session.sparkContext.setLogLevel("ERROR")
        return session

    def _stop_own(self) -> None:
        if self._session is not None:
            try:
                self._session.stop()
            except Exception:
                pass
            self._session = None

    def shutdown(self) -> None:
        """Stop the SparkSession this launcher started (never a session it found active)."""
        with self._lock:
            self._stop_own()

    def shutdown_quietly(self) -> None:
        """At the kernel's exit: stop our session with the JVM's logging off (executors being torn down
        report every lost connection as an error otherwise)."""
        with self._lock:
            if self._session is not None and self._alive(self._session):
                try:
                    self._session.sparkContext.setLogLevel("OFF")
                except Exception:
                    pass
            self._stop_own()

    # -- Launcher interface -------------------------------------------------------------------------
    def check(self, config: RunConfig) -> None:
        try:
            import pyspark  # noqa: F401
            from pyspark.ml.torch.distributor import TorchDistributor  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"--backend spark needs pyspark with TorchDistributor (pyspark >= 3.4): {exc}. "
                "Install it with `pip install 'pyspark>=3.4'`; nothing was launched"
            ) from None
        spark = self.session(config)
        self._distributor(config, spark)  # TorchDistributor's own checks (GPU settings) before anything runs
        if not config.local_mode:
            self._wait_for_slots(spark, config.num_processes)

    def _distributor(self, config: RunConfig, spark: Any = None) -> Any:
        from pyspark.ml.torch.distributor import TorchDistributor

        try:
            return TorchDistributor(
                num_processes=config.num_processes, local_mode=config.local_mode, use_gpu=config.use_gpu
            )
        except RuntimeError as exc:
            message = gpu_setting_error(str(exc), config.local_mode)
            if message:
                raise ConfigError("--gpu", message) from None
            raise LaunchError(f"TorchDistributor refused the run: {str(exc).strip().splitlines()[0]}") from None

    @staticmethod
    def _wait_for_slots(spark: Any, needed: int) -> None:
        """Barrier tasks need one slot each at once; wait for executors to register, else say why not."""
        sc = spark.sparkContext
        cpus = sc.getConf().get("spark.task.cpus", "1")
        master = sc.master
        # local[N]: the tasks run in the driver JVM, whose N slots are all there already (no wait); too
        # many barrier tasks would otherwise sit in Spark's slot-check retries for minutes.
        in_driver = master == "local" or master.startswith("local[")
        deadline = time.monotonic() + _EXECUTOR_WAIT_S
        slots = 0
        while True:
            try:
                jsc = sc._jsc.sc()
                executors = max(0, len(jsc.statusTracker().getExecutorInfos()) - 1)  # minus the driver
                slots = jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile())
            except Exception:
                return  # cannot tell (Spark Connect, another Spark version): let Spark decide
            if slots >= needed or in_driver or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if slots < needed:
            where = "in the driver" if in_driver else f"{executors} executor(s)"
            raise ConfigError(
                "--num-processes",
                f"--cluster -n {needed} runs {needed} barrier tasks at once, but the cluster ({master}) has "
                f"{slots} task slot(s) ({where}, spark.task.cpus={cpus}); use -n {max(1, slots)} "
                "or add executors",
            )

    def starts_before_tracking(self, config: RunConfig) -> bool:
        return config.local_mode  # on a cluster, each node's first worker records system metrics in the run

    def channel_host(self, config: RunConfig) -> str:
        if config.local_mode:
            return "127.0.0.1"
        session = self._session if self._active_session() is None else self._active_session()
        master = session.sparkContext.master if session is not None else config.spark_master
        if is_loopback_master(master):
            return "127.0.0.1"
        host = session.conf.get("spark.driver.host", None) if session is not None else None
        return host or socket.gethostbyname(socket.gethostname())

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        spark = self.session(job.config)
        if job.config.tracking_uri:
            tracking_uri = job.config.tracking_uri
        else:
            from ..tracking import resolve_tracking_uri

            tracking_uri = resolve_tracking_uri(job.config)
        return SparkJob(self, spark, job, emit, tracking_uri)

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        where = "on the driver (local_mode=True)" if config.local_mode else "as barrier tasks on the executors"
        active = None
        try:
            active = self._active_session() if "pyspark" in sys.modules else None
        except Exception:
            pass
        if active is not None and active is self._session:
            master = f"dtrain_magic's SparkSession ({active.sparkContext.master}, reused)"
        elif active is not None:
            master = f"the active SparkSession ({active.sparkContext.master})"
        else:
            master = f"a new SparkSession ({config.spark_master or 'local[*]'})"
        return (
            f"TorchDistributor(num_processes={config.num_processes}, local_mode={config.local_mode}, "
            f"use_gpu={config.use_gpu}) {where}, {device}, on {master}"
        )
