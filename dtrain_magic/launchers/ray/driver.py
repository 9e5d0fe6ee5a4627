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

import os
import threading
import uuid

from ..._compat import ray as ray_compat
from ...checkpoints import storage_path
from ...config import RunConfig
from ...errors import ConfigError, LaunchError, MissingDependencyError
from ...tracebacks import summary
from ...worker import WorkerJob
from ..base import Emit, Launcher, LaunchState, RunningJob
from .diagnostics import failures_from
from .instance import RayInstance, _current_address, _host_port
from .worker import _train_loop

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
        self.trainer = ray_compat.abortable_trainer_class()(
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
            ray_compat.abort(self.trainer.controller)
        self._thread.join(ray_compat.ABORT_WAIT_S + 2)


class RayLauncher(Launcher):
    """Ray Train (``TorchTrainer``) on the connected, given or an embedded local Ray instance."""

    name = "ray"

    def __init__(self) -> None:
        self.instance = RayInstance()  # the Ray this kernel started or joined, kept between runs

    def check(self, config: RunConfig) -> None:
        try:
            import ray  # noqa: F401
            import ray.train.torch  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"--backend ray needs Ray Train: pip install 'ray[default,train]' ({exc})"
            ) from None
        ray_compat.check()  # a Ray whose private parts we know (or the opt-in): before anything starts
        import ray

        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        if config.use_gpu and not address and not ray.is_initialized():
            from ...config import cuda_available

            if not cuda_available():
                raise ConfigError(
                    "--gpu",
                    "CUDA is not available here and no Ray cluster is given; use --cpu, or --ray-address of a "
                    "cluster with GPUs",
                )

    def starts_before_tracking(self, config: RunConfig) -> bool:
        return True  # Ray Train's run is named after the checkpoint root, not the MLflow run

    def warm_up(self, config: RunConfig) -> None:
        self.instance.connect(config)  # ray.init (seconds, cold) while the MLflow run opens

    def channel_host(self, config: RunConfig) -> str:
        import ray

        self.instance.connect(config)
        joined = self.instance.joined
        current = joined if ray.is_initialized() and joined else _current_address()
        if current is None or _host_port(current)[0] in _LOOPBACK:
            return "127.0.0.1"
        return ray.util.get_node_ip_address()

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        how = self.instance.connect(job.config)
        self.instance.ensure_capacity(job.config, how)
        try:
            return RayJob(job, emit)
        except (ConfigError, LaunchError):
            raise
        except Exception as exc:
            raise LaunchError(f"could not start Ray Train: {summary(exc, limit=300)}") from None

    def shutdown(self, at_exit: bool = False) -> None:
        """Shut down the local Ray instance this kernel started (a joined cluster is left as it is)."""
        self.instance.shutdown()

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        where = f"the Ray cluster at {address}" if address else "the connected or a local Ray instance"
        restarts = f", up to {config.max_restarts} restart(s)" if config.max_restarts else ""
        return f"{config.num_processes} Ray Train worker(s) ({device}) on {where}{restarts}"
