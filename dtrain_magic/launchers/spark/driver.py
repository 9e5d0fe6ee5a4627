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

import contextlib
import hashlib
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from ... import backend_log
from ..._compat import spark as spark_compat
from ...backends import Spark
from ...channel import (
    AuthenticatedListener,
    RankDied,
    RankDone,
    RankStarted,
    StackReply,
    StackRequest,
    StandbyJob,
    decode,
)
from ...config import RunConfig, redact_uri
from ...errors import ConfigError, LaunchError, MissingDependencyError, log_dropped
from ...registry import STRATEGIES
from ...state import kernel_state
from ...worker import WorkerJob
from ..base import IMPORT_TIME_ENV, Emit, Failure, Launcher, LaunchState, RunningJob, import_time_environment
from ..standby import (
    Claim,
    Placement,
    Standby,
    StandbyLaunch,
    StandbySlot,
    default_keep_warm_s,
    environment_changes,
    keep_warm_s,
)
from . import sessions
from .diagnostics import check_java, gpu_setting_error, is_loopback_master, one_line_reason, torchrun_root_cause
from .restarts import RestartingClaim, RestartingJob
from .worker import _spark_standby_fn, _spark_train_fn

_CANCEL_GRACE_S = 3.0
_EXECUTOR_WAIT_S = 60.0
_CANCEL_SWEEP_WAIT_S = 20.0


class _Cancels:
    """The cancels in progress on this launcher (`running`), which a new launch waits for (`wait_idle`)."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._idle:
            self._count += 1
        try:
            yield
        finally:
            with self._idle:
                self._count -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._count == 0, timeout)


_DIED = "the process died without reporting an error (killed by a signal, or crashed below Python)"


class _RankWatch:
    """One connection per worker, from its watchdog (`channel.RankStarted`, then `channel.RankDone` when the
    worker ended in Python): a worker whose connection drops before `RankDone` was killed or crashed (seen at
    once, before torchrun's report; `channel.RankDied` first says what its host knows); closing the watch makes
    every remaining worker's watchdog kill it. `dump_stacks` asks the watchdogs for their workers' stacks."""

    def __init__(self, host: str):
        self.dead: dict[int, str] = {}
        self.evidence: dict[int, str] = {}  # rank → what its watchdog found when it died (`RankDied`)
        self.died_at: float | None = None
        self._listener = AuthenticatedListener(host, self._read, "dtrain-spark-watch")
        self.authkey = self._listener.authkey
        self.address = (host, self._listener.port, self.authkey)
        self._lock = threading.Lock()
        self._conns: dict[int, Any] = {}
        self._serial = 0
        self._replies: dict[tuple[int, int], StackReply] = {}
        self._replied = threading.Condition(self._lock)

    def _read(self, conn: Any, serial: int) -> None:
        rank, done = None, False
        try:
            while True:
                message = decode(conn.recv())
                if isinstance(message, RankStarted):
                    rank = message.rank
                    with self._lock:
                        self._conns[rank] = conn
                elif isinstance(message, StackReply):
                    with self._lock:
                        self._replies[(message.rank, message.serial)] = message
                        self._replied.notify_all()
                elif isinstance(message, RankDied):
                    self.evidence[message.rank] = message.evidence
                done = done or isinstance(message, RankDone)
        except Exception as exc:  # the connection closed (or sent what no watchdog sends)
            log_dropped(__name__, "_read", exc)
        if rank is not None:
            with self._lock:
                if self._conns.get(rank) is conn:
                    del self._conns[rank]
        if rank is not None and not done and not self._listener.closed.is_set():
            if self.died_at is None:
                self.died_at = time.monotonic()
            self.dead.setdefault(rank, _DIED)

    def dump_stacks(self, ranks: Any, timeout: float) -> dict[int, tuple[str, str]]:
        """rank → (state, dump) from each connected worker's watchdog (on the worker's own host)."""
        with self._lock:
            self._serial += 1
            serial = self._serial
            targets = {rank: conn for rank, conn in self._conns.items() if rank in ranks}
        for rank, conn in list(targets.items()):
            try:
                conn.send(StackRequest(serial).wire())
            except (OSError, ValueError):  # its watchdog closed the watch: that rank gets no stack
                del targets[rank]
        deadline = time.monotonic() + timeout + 0.4  # the watchdog's own wait, plus the round trip
        with self._lock:
            while not all((rank, serial) in self._replies for rank in targets):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._replied.wait(left)
            replies = {rank: self._replies.pop((rank, serial)) for rank in targets if (rank, serial) in self._replies}
        return {rank: (reply.state, reply.text) for rank, reply in replies.items()}

    def close(self) -> None:
        self._listener.close()


class SparkJob(StandbyLaunch):
    """One ``TorchDistributor.run`` in a background thread, under its own Spark job group: a run's (`for_job`),
    or a standby's (`for_standby`: its workers wait for a run's job, and `attach` makes it that run's).

    Early release: once every rank's result is in, `release` gives torchrun a few seconds to end by
    itself, then closes the rank watch, whose watchdogs kill a worker whose interpreter teardown hangs."""

    early_release = True
    _RELEASE_GRACE_S = 5.0
    _SIGNAL_WAIT_S = 5.0  # after a worker died: how long torchrun may take to end and name the exit signal

    def __init__(self, launcher: "SparkLauncher", spark: Any, config: RunConfig, emit: Emit | None, group: str,
                 watch_host: str, call: Callable[[tuple], tuple[Callable, tuple]]):
        """``call(watch_address)``: the train function and its arguments (they name the rank watch)."""
        self._spark = spark
        self._sc = None if sessions.is_connect(spark) else spark.sparkContext  # (a Spark Connect session has none)
        self._emit = emit
        self._config = config
        self.group = group
        self._lock = threading.Lock()
        self._cancel_called = False
        self._cancelled = False  # cancelled while TorchDistributor.run was still going
        self._error: BaseException | None = None
        self._started_at = time.time()
        self._known_children = _child_pids()
        self._distributor = launcher._distributor(config)
        self._cancels = launcher.cancels
        self._watch = _RankWatch(watch_host)  # where the run's channel listens: reachable by every worker
        fn, args = call(self._watch.address)
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="dtrain-spark-run", daemon=True)
        self._thread.start()

    @classmethod
    def for_job(cls, launcher: "SparkLauncher", spark: Any, job: WorkerJob, emit: Emit,
                tracking_uri: str | None) -> "SparkJob":
        """Launch ``job``'s workers now."""
        # One job group per launch: a restarted run's attempts (--max-restarts) are cancelled one by one.
        group = f"dtrain_magic-{job.run_id or 'run'}-{uuid.uuid4().hex}"
        return cls(launcher, spark, job.config, emit, group,
                   job.channel.host, lambda watch: (_spark_train_fn, (job, tracking_uri, watch)))

    @classmethod
    def for_standby(cls, launcher: "SparkLauncher", spark: Any, config: RunConfig, standby: Standby,
                    strategies: tuple[str, ...]) -> "SparkJob":
        """Launch workers with ``config``'s placement that wait on ``standby`` for a run's job."""
        host = standby.address[0]
        return cls(launcher, spark, config, None, f"dtrain_magic-standby-{uuid.uuid4().hex}", host,
                   lambda watch: (_spark_standby_fn, (standby.address, watch, strategies, config.use_gpu,
                                                      config.local_mode, config.process_group_backend)))

    def attach(self, job: WorkerJob, emit: Emit) -> None:
        self._config, self._emit = job.config, emit

    def _run(self, fn: Callable, args: tuple) -> None:
        # A stopped run's clean-up goes on in the background and sweeps this machine's new torchrun trees: this
        # launch starts its own only once that sweep is over (a second or two), or it would be swept too.
        self._cancels.wait_idle(_CANCEL_SWEEP_WAIT_S)
        try:
            # A kernel interrupt is for the cell, not for torchrun.
            with spark_compat.job_group(self._spark, self.group, "dtrain_magic %%distribute run"), \
                    spark_compat.launches_in_own_session(), \
                    spark_compat.quiet_launches(backend_log.stream(), _torchrun_env(self._config)):
                self._distributor.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - reported through poll()
            self._error = exc

    def dump_stacks(self, workers: Any, timeout: float) -> dict[int, tuple[str, str]]:
        """Every worker's stacks through its watchdog, on whichever host it runs."""
        return self._watch.dump_stacks(set(workers), timeout)

    def poll(self) -> LaunchState:
        # In the order the deaths were seen, not by rank: the first is the cause (torchrun then SIGTERMs
        # the survivors, whose connections drop a moment later).
        died = [self._died(rank, reason) for rank, reason in list(self._watch.dead.items())]
        if self._thread.is_alive():
            unnamed = [f for f in died if "killed by" not in f.reason]  # no signal from the watchdog's evidence
            if unnamed and time.monotonic() - (self._watch.died_at or 0) < self._SIGNAL_WAIT_S:
                return LaunchState(False, [])  # torchrun reports the exit signal within moments: wait for it
            return LaunchState(False, died)
        failures = []
        if self._error is not None and not self._cancelled:
            cause = torchrun_root_cause(str(self._error))
            if cause is not None:  # a worker died below Python (killed, crashed): name its rank and signal
                failures.append(self._died(cause[0], cause[1]))
            elif not died:
                failures.append(Failure(None, one_line_reason(self._error)))
        return LaunchState(True, failures or died)

    def _died(self, rank: int, reason: str) -> Failure:
        """A dead worker's failure: torchrun's exit signal (or the watch's guess), with what its watchdog found on
        its host (an out-of-memory kill, where Python saw a fatal signal)."""
        evidence = self._watch.evidence.get(rank, "")
        headline, _, dump = evidence.partition("\n")
        if headline.startswith("killed by") and reason == _DIED:
            reason = f"process was {headline}"  # as torchrun's report says it
        elif headline and headline not in reason:
            reason = f"{reason.split(' (', 1)[0]}: {headline}"
        return Failure(rank, reason, dump)

    def active_jobs(self) -> list[int]:
        """Ids of this run's Spark jobs that are still running (none known on Spark Connect)."""
        return sessions.running_jobs(self._spark, self.group)

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
                spark_compat.cancel_group(self._spark, self.group)
            except Exception as exc:  # py4j's or Connect's errors, a session stopping: its jobs end with it
                log_dropped(__name__, "_cancel_job_group", exc)

    def _wait_for_jobs(self, deadline: float) -> None:
        while self.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.1)

    def cancel(self) -> None:
        with self._cancels.running():
            self._cancel()

    def _cancel(self) -> None:
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


# Variables of the notebook a standby's workers do not take from it at claim time: set for them by torchrun and
# TorchDistributor (CUDA_VISIBLE_DEVICES: TorchDistributor sets it in the notebook while a --gpu launch runs), or
# read at import time (part of the placement: a change there is a fresh launch).
_TORCHRUN_SETS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                  "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}


def _torchrun_env(config: RunConfig) -> dict[str, str]:
    """What a local-mode launch's torchrun gets where the notebook sets nothing: ``OMP_NUM_THREADS=1``, the value
    torchrun itself sets for more than one process, after printing a banner about it into the cell."""
    return {"OMP_NUM_THREADS": "1"} if config.local_mode and config.num_processes > 1 else {}


def _managed(key: str) -> bool:
    return key in _TORCHRUN_SETS or key.startswith(("TORCHELASTIC_", "TORCH_NCCL_", *IMPORT_TIME_ENV))


def _digest(values: Any) -> str:
    return hashlib.sha256(repr(values).encode()).hexdigest()[:12]


def _process_trees(worker_pids: Any) -> set[int]:
    """Each worker, the torchrun and wrapper processes above it, and everything below those."""
    try:
        import psutil
    except ImportError:
        return set()
    found: set[int] = set()
    for pid in worker_pids:
        try:
            top = psutil.Process(pid)
            while (parent := top.parent()) is not None and _is_torchrun(parent):
                top = parent
            found |= {top.pid, *(p.pid for p in top.children(recursive=True))}
        except psutil.Error:
            continue
    return found


def _data_needs_the_slots(config: RunConfig) -> bool:
    """Cluster mode with ``--data``: staging a DataFrame is a Spark job on the executors, whose task slots waiting
    barrier tasks would hold (the job would wait for them forever). Such runs hold no workers ahead."""
    return not config.local_mode and bool(config.data)


def _is_torchrun(proc: Any) -> bool:
    import psutil

    try:
        command = " ".join(proc.cmdline())
    except psutil.Error as exc:  # gone meanwhile, or not ours to read
        log_dropped(__name__, "_is_torchrun", exc)
        return False
    return spark_compat.TORCHRUN_WRAPPER_MODULE in command or "torch.distributed.run" in command


def _child_pids() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error as exc:  # a child's /proc entry unreadable meanwhile
        log_dropped(__name__, "_child_pids", exc)
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
        if spark_compat.TORCHRUN_WRAPPER_MODULE in cmdline or "torch.distributed.run" in cmdline:
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


class SparkLauncher(Spark, Launcher):
    """TorchDistributor on the active SparkSession, or on one started (once) by this launcher."""

    def __init__(self) -> None:
        self._session: Any = None  # a session this launcher started (and may stop)
        self._lock = threading.Lock()
        self.session_start_s: float | None = None  # how long this launcher's last session start took
        self.session_starts = 0  # how many sessions this launcher started (a warm run starts none)
        self.standbys = StandbySlot()  # the next run's workers, launched ahead (docs/warm-reruns.md)
        self.cancels = _Cancels()  # stopped runs still cleaning up (in the background)

    # -- the session ---------------------------------------------------------------------------------
    @staticmethod
    def _active_session() -> Any:
        session = spark_compat.default_session()
        return session if session is not None and sessions.alive(session) else None

    def session(self, config: RunConfig) -> Any:
        """The SparkSession a run uses (the active one, else ours, started once and reused)."""
        with self._lock:
            session = self._session_for(config)
        # The kernel's exit hook then runs before pyspark's own, registered when this session (ours, the user's or
        # Databricks') started: it is stopped, or its waiting workers released, while the JVM is still whole (a
        # local-cluster stopped by the JVM's own shutdown prints hundreds of lines of executor-launch stack traces).
        kernel_state().stop_first_at_exit()
        return session

    def _session_for(self, config: RunConfig) -> Any:
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
        self.session_start_s = time.monotonic() - t0
        self.session_starts += 1
        return self._session

    _alive = staticmethod(sessions.alive)

    @staticmethod
    def _build(master: str) -> Any:
        from pyspark.sql import SparkSession

        # No console progress bar: it would interleave with the workers' rank-prefixed output in the cell.
        builder = (SparkSession.builder.master(master).appName("dtrain_magic")
                   .config("spark.ui.showConsoleProgress", "false"))
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
            # The JVM inherits fds 1 and 2 as they are when it starts: pointed at the backend log meanwhile, its
            # start-up lines, log4j's, stage bars and its exit's go there for its whole life, not to the cell.
            with backend_log.fds_to_log():
                session = builder.getOrCreate()
        except Exception as exc:
            raise LaunchError(f"could not start a SparkSession on {master}: {one_line_reason(exc)} (the JVM's "
                              f"output: {backend_log.path()})") from None
        session.sparkContext.setLogLevel("ERROR")
        return session

    def _stop_own(self) -> None:
        if self._session is not None:
            self.standbys.release("dtrain_magic's SparkSession stops")
            try:
                self._session.stop()
            except Exception as exc:  # py4j's errors when the JVM is going already: nothing left to stop
                log_dropped(__name__, "_stop_own", exc)
            self._session = None

    def shutdown(self, at_exit: bool = False) -> None:
        """Stop the SparkSession this launcher started (never a session it found active). ``at_exit``: with
        the JVM's logging off (executors being torn down report every lost connection as an error otherwise;
        not before, as the level would stay off for a session started later in the same JVM)."""
        self.standbys.release("the kernel exits" if at_exit else "the backend shuts down",
                              grace_s=3.0 if at_exit else 15.0)
        with self._lock:
            if at_exit and self._session is not None and self._alive(self._session):
                try:
                    self._session.sparkContext.setLogLevel("OFF")
                except Exception as exc:  # the JVM may be going already: only its quiet exit is lost
                    log_dropped(__name__, "shutdown", exc)
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
        default_keep_warm_s()  # a bad $DTRAIN_MAGIC_KEEP_WARM is a ConfigError now, not after the run
        spark = self.session(config)
        self._distributor(config, spark)  # TorchDistributor's own checks (GPU settings) before anything runs
        if not config.local_mode:
            sessions.check_cluster_python(spark)
            self._wait_for_slots(spark, config.num_processes)

    # -- standbys (docs/warm-reruns.md) -------------------------------------------------------------------
    def _running_session(self, config: RunConfig) -> Any:
        """The SparkSession a run with ``config`` would use, if it runs now; never starts one."""
        if "pyspark" not in sys.modules:
            return None
        with self._lock:
            active = self._active_session()
            if active is not None and active is not self._session:
                return active
            own = self._session
            if own is not None and self._alive(own) and config.spark_master in (None, own.sparkContext.master):
                return own
            return None

    @staticmethod
    def _placement(config: RunConfig, spark: Any) -> Placement:
        """What a TorchDistributor launch fixes: world size, GPUs, mode, the session and its master; in local mode
        the import-time variables its torchrun workers inherited (a digest: values stay out of messages)."""
        items: list[tuple[str, Any]] = [
            ("processes", config.num_processes), ("GPU", config.use_gpu),
            ("process group", config.process_group_backend), ("mode", "local" if config.local_mode else "cluster"),
            ("SparkSession", sessions.identity(spark)), ("master", redact_uri(sessions.master(spark))),
        ]
        if config.local_mode:
            items.append(("import-time environment", _digest(import_time_environment())))
        return Placement(Spark.name, tuple(items))

    def claim_standby(self, config: RunConfig, reuse: bool = False) -> Claim | RestartingClaim | None:
        spark = self._running_session(config)
        if spark is not None and _data_needs_the_slots(config):
            self.release_standby("a run with --data on a cluster: writing a DataFrame needs the slots they hold")
            return None
        claim = None if spark is None else self.standbys.claim(self._placement(config, spark), reuse)
        if claim is None or not config.max_restarts:
            return claim
        return RestartingClaim(claim, self._launch)  # --max-restarts: later attempts are fresh launches

    def keep_warm(self, config: RunConfig) -> str | None:
        """Launch the next run's workers (local mode: on this machine, held by default; cluster mode: barrier
        tasks, held by default only on the SparkSession the magic started)."""
        spark = self._running_session(config)
        if spark is None or _data_needs_the_slots(config):
            return None
        keep = keep_warm_s(config, holds_by_default=config.local_mode or spark is self._session)
        placement = self._placement(config, spark)
        standby = self.standbys.ensure(placement, keep, lambda: self._launch_standby(config, spark, placement))
        return standby.describe() if standby is not None else None

    def release_reused(self, reason: str) -> int:
        return self.standbys.release_spares(reason)

    def release_standby(self, reason: str) -> str | None:
        standby = self.standbys.release(reason)
        return None if standby is None else standby.where

    def standby_processes(self) -> set[int]:
        """Pids of the waiting standby's processes on this machine (each waiting worker, its watchdog, torchrun
        and TorchDistributor's wrapper above it): what a test or a user may see left between runs, and nothing
        else of the magic's. Empty when no standby waits (or none of its workers connected yet)."""
        standby = self.standbys.standby
        return _process_trees(standby.pids.values()) if standby is not None else set()

    def _launch_standby(self, config: RunConfig, spark: Any, placement: Placement) -> Standby:
        launched_env = dict(os.environ)  # local mode: what torchrun's workers inherit now

        def order_for(job: WorkerJob) -> StandbyJob:
            import cloudpickle

            env_set, env_unset = (environment_changes(launched_env, os.environ, _managed) if config.local_mode
                                  else ({}, ()))
            return StandbyJob(cloudpickle.dumps(job), os.getcwd(), env_set, env_unset, self._tracking_uri(job.config))

        device = "GPU" if config.use_gpu else "CPU"
        where = (f"{config.num_processes} TorchDistributor worker(s) ({device}, local mode: on this machine)"
                 if config.local_mode else
                 f"{config.num_processes} TorchDistributor barrier task(s) ({device}) "
                 f"on {redact_uri(sessions.master(spark))}")
        standby = Standby(placement, config.num_processes, self.channel_host(config), None, where, order_for)
        try:
            standby.launch = SparkJob.for_standby(self, spark, config, standby,
                                                  tuple(dict.fromkeys((STRATEGIES.default, config.strategy))))
        except BaseException:
            standby.release("its launch failed")
            raise
        return standby

    def _distributor(self, config: RunConfig, spark: Any = None) -> Any:
        from pyspark.ml.torch.distributor import TorchDistributor

        try:
            distributor = TorchDistributor(
                num_processes=config.num_processes, local_mode=config.local_mode, use_gpu=config.use_gpu
            )
        except RuntimeError as exc:
            message = gpu_setting_error(str(exc), config.local_mode)
            if message:
                raise ConfigError("--gpu", message) from None
            raise LaunchError(f"TorchDistributor refused the run: {str(exc).strip().splitlines()[0]}") from None
        spark_compat.route_distributor_log(distributor, backend_log.logger("TorchDistributor"))
        return distributor

    @staticmethod
    def _wait_for_slots(spark: Any, needed: int) -> None:
        """Barrier tasks need one slot each at once; wait for executors to register, else say why not."""
        cpus = sessions.task_cpus(spark)
        master = sessions.master(spark)
        # local[N]: the tasks run in the driver JVM, whose N slots are all there already (no wait); too
        # many barrier tasks would otherwise sit in Spark's slot-check retries for minutes.
        in_driver = master == "local" or master.startswith("local[")
        deadline = time.monotonic() + _EXECUTOR_WAIT_S
        slots = 0
        while True:
            counted = sessions.task_slots(spark)
            if counted is None:
                return  # cannot tell (a cluster behind Spark Connect, another Spark version): let Spark decide
            executors, slots = counted
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

    def workers_share_files(self, config: RunConfig) -> bool:
        """Local mode, or a cluster on this machine (``local-cluster[...]``, a master on loopback)."""
        session = self._running_session(config)
        if session is not None and not sessions.writer_here(session):
            return False  # a remote Spark Connect server's executors write the staged data on their side
        if config.local_mode:
            return True
        return sessions.executors_here(session) if session is not None else is_loopback_master(config.spark_master)

    def channel_host(self, config: RunConfig) -> str:
        if config.local_mode:
            return "127.0.0.1"
        session = self._session if self._active_session() is None else self._active_session()
        here = sessions.executors_here(session) if session is not None else is_loopback_master(config.spark_master)
        if here:
            return "127.0.0.1"
        # A Connect server's spark.driver.host is the server's own address, not this notebook's.
        host = None if session is None or sessions.is_connect(session) else session.conf.get("spark.driver.host", None)
        return host or socket.gethostbyname(socket.gethostname())

    @staticmethod
    def _tracking_uri(config: RunConfig) -> str:
        if config.tracking_uri:
            return config.tracking_uri
        from ...tracking import resolve_tracking_uri

        return resolve_tracking_uri(config)

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        first = self._launch(job, emit)
        if not job.config.max_restarts:
            return first
        return RestartingJob(first, lambda: self._launch(job, emit), job.config.max_restarts, emit,
                             job.checkpoint_root)

    def _launch(self, job: WorkerJob, emit: Emit) -> SparkJob:
        """One ``TorchDistributor.run`` of ``job`` (a run's, or one attempt of a run under ``--max-restarts``)."""
        spark = self.session(job.config)
        tracking_uri = self._tracking_uri(job.config)
        self.standbys.make_way(self._placement(job.config, spark))  # another placement's workers go first
        return SparkJob.for_job(self, spark, job, emit, tracking_uri)

    def capacity(self, config: RunConfig) -> tuple[str, int] | None:
        """``--cluster``: the task slots of the running SparkSession's executors (each barrier task takes one); None in
        local mode (processes on the driver), before a session runs, or when Spark cannot tell."""
        spark = None if config.local_mode else self._running_session(config)
        counted = sessions.task_slots(spark) if spark is not None else None
        if counted is None:
            return None
        return f"task slots of {redact_uri(sessions.master(spark))}", counted[1]

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        where = "on the driver (local_mode=True)" if config.local_mode else "as barrier tasks on the executors"
        active = None
        try:
            active = self._active_session() if "pyspark" in sys.modules else None
        except Exception as exc:  # a description only: a session in trouble is described as none
            log_dropped(__name__, "describe", exc)
        if active is not None and active is self._session:
            master = f"dtrain_magic's SparkSession ({active.sparkContext.master}, reused)"
        elif active is not None and sessions.is_connect(active):
            master = f"the active Spark Connect session (server master {redact_uri(sessions.master(active))})"
        elif active is not None:
            master = f"the active SparkSession ({active.sparkContext.master})"
        else:
            master = f"a new SparkSession ({config.spark_master or 'local[*]'})"
        return (
            f"TorchDistributor(num_processes={config.num_processes}, local_mode={config.local_mode}, "
            f"use_gpu={config.use_gpu}) {where}, {device}, on {master}"
        )
