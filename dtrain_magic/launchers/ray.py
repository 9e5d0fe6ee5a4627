"""``--backend ray``: the cell's function through Ray Train's ``TorchTrainer``.

Each Ray Train worker runs `_train_loop`, which calls ``dtrain_magic.worker.run_worker`` with the ranks
from ``ray.train.get_context()``; Ray Train has already joined the torch process group. Output,
metrics, results and errors come back over the run's channel like on every backend; Ray's own
reporting (``ray.train.report``) is used only for checkpoints (`RayCheckpointStore`), because Ray
restores from those after a restart (``--max-restarts`` → ``FailureConfig(max_failures)``).

Which Ray: the instance this kernel is already connected to (``ray.is_initialized()``); else the
cluster at ``--ray-address`` / ``$RAY_ADDRESS``; else a local instance started once (127.0.0.1, no
dashboard, its own temp dir) and reused by later runs, shut down and removed when the kernel exits.

``start`` returns at once: ``trainer.fit()`` runs in a background thread. ``cancel`` asks Ray Train's
controller actor to abort (it kills the worker actors), then kills the controller if it has not gone
within a few seconds; the Ray instance stays up for the next run.
"""

from __future__ import annotations

import atexit
import builtins
import logging
import os
import shutil
import sys
import tempfile
import threading
import uuid
from typing import Any

from ..checkpoints import storage_path
from ..config import RunConfig
from ..errors import ConfigError, LaunchError, MissingDependencyError
from ..worker import RankInfo, WorkerJob
from .base import Emit, Failure, Launcher, LaunchState, RunningJob

_ABORT_WAIT_S = 4.0  # controller.abort() before we kill the controller actor outright
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


# -- worker side ---------------------------------------------------------------------------------------
class RayCheckpointStore:
    """``ctx.save_checkpoint()`` / ``ctx.load_checkpoint()`` on Ray Train checkpoints.

    ``next_dir``: a fresh local directory for this rank's part. ``saved``: every rank calls
    ``ray.train.report`` once (Ray needs the same number of calls on every rank); ranks that wrote
    files attach them as a ``Checkpoint`` (Ray merges the parts in its run storage), then the local
    copy is removed. ``latest``: ``ray.train.get_checkpoint()``, the checkpoint a restarted worker
    group resumes from (None on a fresh run).
    """

    def __init__(self) -> None:
        self._created: set[str] = set()
        self._downloads: list[str] = []

    def next_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="dtrain_ckpt_")
        self._created.add(path)
        return path

    def saved(self, directory: str) -> None:
        import ray.train

        try:
            has_files = os.path.isdir(directory) and any(os.scandir(directory))
            checkpoint = ray.train.Checkpoint.from_directory(directory) if has_files else None
            ray.train.report({}, checkpoint=checkpoint)
            # Ray registers a reported checkpoint only when its controller next polls the workers (every
            # ~2 s): if a worker died before that, a restart would not see it. Wait until it is committed,
            # on every rank, so no rank runs ahead of a checkpoint Ray does not yet know about.
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        finally:
            if directory in self._created:
                self._created.discard(directory)
                shutil.rmtree(directory, ignore_errors=True)

    def latest(self) -> str | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        path = checkpoint.path
        if _is_local_fs(checkpoint) and os.path.isdir(path):
            return path
        target = tempfile.mkdtemp(prefix="dtrain_restore_")  # remote storage (s3://, gs://): download once
        self._downloads.append(target)
        return checkpoint.to_directory(target)

    def cleanup(self) -> None:
        for path in [*self._created, *self._downloads]:
            shutil.rmtree(path, ignore_errors=True)
        self._created.clear()
        self._downloads.clear()


def _is_local_fs(checkpoint: Any) -> bool:
    try:
        import pyarrow.fs

        return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)
    except Exception:
        return False


def _train_loop(config: dict) -> None:
    """``train_loop_per_worker``: one Ray Train worker = one rank of the run."""
    import ray.train

    from ..worker import run_worker

    cwd = config.get("cwd")
    if cwd and os.path.isdir(cwd):  # same relative paths and imports as the notebook (and as --backend local)
        os.chdir(cwd)
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
    context = ray.train.get_context()
    ranks = RankInfo(
        rank=context.get_world_rank(),
        local_rank=context.get_local_rank(),
        world_size=context.get_world_size(),
        local_world_size=context.get_local_world_size(),
    )
    store = RayCheckpointStore()
    printer = builtins.print
    # Ray Train's worker logging reaches the root logger's console handler (which writes to our stream):
    # keep INFO chatter ("Reporting training result ...") out of the cell; as on --backend local, the
    # user's function sees WARNING and above unless it configures logging itself.
    quiet = [logging.getLogger(), logging.getLogger("ray.train")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    builtins.print = _unpatched_print()  # Ray Train tees print() into its logger too: each line came twice
    try:
        run_worker(config["job"], ranks, checkpoints=store)
    finally:
        builtins.print = printer
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
        store.cleanup()


def _unpatched_print():
    try:
        from ray.train.v2._internal.logging.patch_print import _original_print

        return _original_print
    except ImportError:
        return builtins.print


# -- the Ray instance ----------------------------------------------------------------------------------
class _Embedded:
    """The local Ray instance this kernel started (at most one), and its private temp dir."""

    temp_dir: str | None = None
    num_cpus: int = 0
    joined: str | None = None  # the --ray-address / $RAY_ADDRESS this kernel joined, as given
    joined_gcs: str | None = None  # ... and the GCS address Ray reported for it
    joined_job: str | None = None  # ... and the driver job of that connection (a new ray.init() is a new job)
    registered = False
    sweeper: Any = None  # the watchdog process that removes the instance if this kernel's process goes


_INSTANCE_ENV = "DTRAIN_RAY_INSTANCE"  # set while the local instance starts: every process of it inherits it


def _shutdown_embedded() -> None:
    import ray

    if _Embedded.temp_dir is None:
        return
    try:
        if ray.is_initialized():
            ray.shutdown()
    finally:
        _stop_sweeper()
        shutil.rmtree(_Embedded.temp_dir, ignore_errors=True)
        _Embedded.temp_dir = None
        _Embedded.num_cpus = 0


def _stop_sweeper() -> None:
    """After ray.shutdown(): the watchdog removes whatever of the instance is left (Ray's agents) and exits."""
    sweeper, _Embedded.sweeper = _Embedded.sweeper, None
    if sweeper is None:
        return
    try:
        sweeper.stdin.close()
        sweeper.wait(10)
    except Exception:
        pass


def _start_embedded(num_cpus: int, attempts: int = 2) -> None:
    """Start the local instance; one more try when a loaded machine makes Ray's 30 s raylet wait time out."""
    for attempt in range(attempts):
        try:
            return _start_embedded_once(num_cpus)
        except LaunchError as exc:
            if attempt == attempts - 1 or "timed out during startup" not in str(exc):
                raise


def _start_embedded_once(num_cpus: int) -> None:
    import ray

    from .. import watchdog

    temp_dir = tempfile.mkdtemp(prefix="dtr_ray_", dir="/tmp" if os.path.isdir("/tmp") else None)  # short: unix sockets
    marker = f"{_INSTANCE_ENV}={temp_dir}"
    # Started first, so that nothing of the instance can outlive this process, even if it is killed
    # while Ray starts: its stdin closes with this process, and it SIGKILLs every process carrying the mark.
    _Embedded.sweeper = watchdog.start("sweep", marker, "--rmtree", temp_dir)
    os.environ[_INSTANCE_ENV] = temp_dir  # inherited by the GCS, the raylet, and through it by every worker
    try:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,  # worker output comes over the run's channel
            configure_logging=False,
            _node_ip_address="127.0.0.1",
            # Ray makes its temp dir world-writable (0777, for shared clusters); inside ours (0700, the
            # user's alone) nobody else can reach its sockets, logs or spilled objects.
            _temp_dir=os.path.join(temp_dir, "r"),
        )
    except BaseException as exc:
        os.environ.pop(_INSTANCE_ENV, None)
        try:
            ray.shutdown()  # whatever half-started
        finally:
            _stop_sweeper()
            shutil.rmtree(temp_dir, ignore_errors=True)
        if isinstance(exc, Exception):
            raise LaunchError(f"could not start a local Ray instance: {_one_line(exc)}") from None
        raise
    os.environ.pop(_INSTANCE_ENV, None)  # only the instance's processes carry it, not what starts later
    _Embedded.temp_dir, _Embedded.num_cpus = temp_dir, num_cpus
    if not _Embedded.registered:
        atexit.register(_shutdown_embedded)
        _Embedded.registered = True


def _current_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _current_job() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:
        return None


def _host_port(address: str) -> tuple[str, str]:
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    return host, port


def connect(config: RunConfig) -> str:
    """Make sure this kernel is connected to the right Ray; returns how ("running", "joined", "embedded")."""
    import ray

    address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        current = _current_address()
        if _Embedded.joined and (current != _Embedded.joined_gcs or _current_job() != _Embedded.joined_job):
            # someone re-initialised Ray since (even against the same cluster): that connection is theirs
            _Embedded.joined = _Embedded.joined_gcs = _Embedded.joined_job = None
        if not address or address == "auto" or address == _Embedded.joined or (
            current and _host_port(address) == _host_port(current)
        ):
            return "embedded" if _Embedded.temp_dir else ("joined" if _Embedded.joined else "running")
        if _Embedded.joined:  # a cluster this launcher joined: leave it for the requested one
            ray.shutdown()
        elif _Embedded.temp_dir is None:
            raise LaunchError(
                f"this kernel is already connected to Ray at {current}; call ray.shutdown() before using "
                f"--ray-address {address}, or drop --ray-address to use the connected cluster"
            )
        _shutdown_embedded()  # ours: switch to the requested cluster
    _Embedded.joined = _Embedded.joined_gcs = _Embedded.joined_job = None
    if address:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as exc:
            raise LaunchError(f"could not join the Ray cluster at {address}: {_one_line(exc)}") from None
        _Embedded.joined = address  # Ray reports a loopback address under the node's IP: remember ours
        _Embedded.joined_gcs = _current_address()
        _Embedded.joined_job = _current_job()
        return "joined"
    _start_embedded(max(4, config.num_processes + 1))
    return "embedded"


def _ensure_capacity(config: RunConfig, how: str) -> None:
    """A run that asks for more than the cluster has would wait forever: fail now (or grow our instance)."""
    import ray

    resource = "GPU" if config.use_gpu else "CPU"
    have = ray.cluster_resources().get(resource, 0)
    if have >= config.num_processes:
        return
    if how == "embedded" and not config.use_gpu:
        _shutdown_embedded()
        _start_embedded(max(4, config.num_processes + 1))
        return
    where = "the local Ray instance" if how == "embedded" else f"the Ray cluster at {_Embedded.joined or _current_address()}"
    raise LaunchError(
        f"{config.num_processes} workers need {config.num_processes} {resource}s; {where} has {have:g}. "
        f"Use fewer --num-workers{'' if config.use_gpu else ''}, or a larger cluster"
    )


# -- the run -------------------------------------------------------------------------------------------
def _make_trainer_class():
    from ray.train.torch import TorchTrainer

    class _Trainer(TorchTrainer):
        """TorchTrainer that keeps the handle of its controller actor, so a run can be aborted."""

        controller = None
        cancel_requested = False

        def _initialize_and_run_controller(self, **controller_init_kwargs):  # mirrors Ray 2.60's
            import ray
            from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
            from ray.train.v2._internal.constants import (
                DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                get_env_vars_to_propagate,
            )
            from ray.train.v2._internal.execution.controller import TrainController

            env_vars = get_env_vars_to_propagate()
            env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
            controller_cls = ray.remote(
                num_cpus=0,
                label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
                runtime_env={"env_vars": env_vars},
            )(TrainController)
            self.controller = controller_cls.remote(**controller_init_kwargs)
            if self.cancel_requested:
                _abort(self.controller)
            ray.get(self.controller.run.remote())
            return ray.get(self.controller.get_result.remote())

    return _Trainer


def _abort(controller: Any) -> None:
    import ray

    try:
        ray.get(controller.abort.remote(), timeout=_ABORT_WAIT_S)
    except Exception:  # RayActorError: it exited (as abort does); GetTimeoutError: kill it below
        pass
    try:
        ray.kill(controller, no_restart=True)  # its worker actors fate-share with it
    except Exception:
        pass


class RayJob(RunningJob):
    def __init__(self, job: WorkerJob, emit: Emit):
        import ray.train

        config = job.config
        self._emit = emit
        self._error: BaseException | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self.storage = storage_path(config.storage)  # Ray Train's storage_path
        # Ray Train's run directory is the run's checkpoint root, so its checkpoints and ctx's are one place.
        self.name = os.path.basename(job.checkpoint_root) if job.checkpoint_root else f"dtrain_{uuid.uuid4().hex}"
        if "://" not in self.storage:  # Ray Train would create it 0755: the run's files are the user's alone
            os.makedirs(os.path.join(self.storage, self.name), mode=0o700, exist_ok=True)
        self.trainer = _make_trainer_class()(
            _train_loop,
            train_loop_config={"job": job, "cwd": os.getcwd()},
            scaling_config=ray.train.ScalingConfig(num_workers=config.num_processes, use_gpu=config.use_gpu),
            run_config=ray.train.RunConfig(
                name=self.name,
                storage_path=self.storage,
                failure_config=ray.train.FailureConfig(max_failures=config.max_restarts),
            ),
        )
        self._thread = threading.Thread(target=self._fit, name="dtrain-ray-fit", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported through poll()
            self._error = exc

    def poll(self) -> LaunchState:
        if self._thread.is_alive():
            # Ray Train decides when a worker's failure is final (restart or give up), and it always ends
            # fit() when it gives up: wait for that rather than cancelling on the first worker error.
            return LaunchState(False, [], errors_final=False)
        if self._error is None or self._cancelled:
            return LaunchState(True, [])
        return LaunchState(True, failures_from(self._error))

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = self._thread.is_alive()
        if not self._cancelled:
            return
        self.trainer.cancel_requested = True
        if self.trainer.controller is not None:
            _abort(self.trainer.controller)
        self._thread.join(_ABORT_WAIT_S + 2)


def failures_from(error: BaseException) -> list[Failure]:
    """Ray's exception from fit() → one `Failure` per failed rank, each with a one-line reason."""
    failures = []
    worker_failures = getattr(error, "worker_failures", None)
    if isinstance(worker_failures, dict) and worker_failures:
        for rank in sorted(worker_failures):
            failures.append(Failure(rank, _worker_reason(worker_failures[rank])))
        return failures
    cause = getattr(error, "controller_failure", None) or error
    return [Failure(None, f"Ray Train failed: {_one_line(cause)}")]


def _worker_reason(exc: BaseException) -> str:
    import ray.exceptions

    inner = getattr(exc, "health_check_failure", None)  # Ray Train's WorkerHealthCheckFailedError
    if isinstance(inner, BaseException):
        if not isinstance(inner, ray.exceptions.RayActorError):
            return f"the Ray worker stopped answering Ray Train's health checks: {_one_line(inner)}"
        exc = inner
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return "the Ray worker process was killed by Ray's memory monitor (out of memory)"
    if isinstance(exc, ray.exceptions.RayActorError):
        # Ray cannot tell which signal it was (its message lists OOM, ray stop and SIGSEGV as guesses).
        return (
            "the Ray worker process died without reporting an error "
            "(killed, e.g. by SIGKILL or the OOM killer, or crashed in native code)"
        )
    return _one_line(exc)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


class RayLauncher(Launcher):
    """Ray Train (``TorchTrainer``) on the connected, given or an embedded local Ray instance."""

    name = "ray"

    def check(self, config: RunConfig) -> None:
        try:
            import ray  # noqa: F401
            import ray.train.torch  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"--backend ray needs Ray Train: pip install 'ray[default,train]' ({exc})"
            ) from None
        import ray

        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        if config.use_gpu and not address and not ray.is_initialized():
            from ..config import cuda_available

            if not cuda_available():
                raise ConfigError(
                    "--gpu",
                    "CUDA is not available here and no Ray cluster is given; use --cpu, or --ray-address of a "
                    "cluster with GPUs",
                )

    def starts_before_tracking(self, config: RunConfig) -> bool:
        return True  # Ray Train's run is named after the checkpoint root, not the MLflow run

    def warm_up(self, config: RunConfig) -> None:
        connect(config)  # ray.init (seconds, cold) while the MLflow run opens

    def channel_host(self, config: RunConfig) -> str:
        import ray

        connect(config)
        current = _Embedded.joined if ray.is_initialized() and _Embedded.joined else _current_address()
        if current is None or _host_port(current)[0] in _LOOPBACK:
            return "127.0.0.1"
        return ray.util.get_node_ip_address()

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        how = connect(job.config)
        _ensure_capacity(job.config, how)
        try:
            return RayJob(job, emit)
        except (ConfigError, LaunchError):
            raise
        except Exception as exc:
            raise LaunchError(f"could not start Ray Train: {_one_line(exc)}") from None

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        where = f"the Ray cluster at {address}" if address else "the connected or a local Ray instance"
        restarts = f", up to {config.max_restarts} restart(s)" if config.max_restarts else ""
        return f"{config.num_processes} Ray Train worker(s) ({device}) on {where}{restarts}"
