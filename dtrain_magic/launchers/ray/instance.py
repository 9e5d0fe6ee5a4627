"""Which Ray a run uses: the instance this kernel is connected to, the cluster at ``--ray-address`` /
``$RAY_ADDRESS``, or a local instance started once (127.0.0.1, no dashboard, its own temp dir, a watchdog that
removes every process of it when the kernel goes) and reused by later runs. `RayInstance` keeps that between
runs (on the kernel's `RayLauncher`, see `dtrain_magic.state`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from ... import backend_log
from ..._compat import ray as ray_compat
from ...config import RunConfig
from ...errors import LaunchError, log_dropped, summary
from ...state import kernel_state

_INSTANCE_ENV = "DTRAIN_RAY_INSTANCE"  # set while the local instance starts: every process of it inherits it


class RayInstance:
    """The local Ray instance this kernel started (at most one) and its private temp dir, or the cluster it
    joined."""

    def __init__(self) -> None:
        # One lock around connecting and the capacity check (which may restart our instance to grow it): two runs
        # started at once before Ray is up start one instance, and it is never restarted under the other.
        self.lock = threading.RLock()
        self.temp_dir: str | None = None  # the local instance's directory, while it runs
        self.num_cpus = 0
        self.joined: str | None = None  # the --ray-address / $RAY_ADDRESS this kernel joined, as given
        self.joined_gcs: str | None = None  # ... and the GCS address Ray reported for it
        self.joined_job: str | None = None  # ... and the driver job of that connection (a new ray.init() is a new job)
        self.sweeper: Any = None  # the watchdog process that removes the instance if this kernel's process goes

    def connect(self, config: RunConfig) -> str:
        """Make sure this kernel is connected to the right Ray; returns how (`_how`)."""
        with self.lock:
            how = self._connect(config)
        # Whoever called ray.init (the user, before any run, included) registered Ray's exit hook then: the
        # kernel's must run before it, so that the runs and waiting workers on Ray are released while Ray is
        # whole (after it, a release's Ray call would start a new local Ray through Ray's auto-init, at exit).
        kernel_state().stop_first_at_exit()
        return how

    def connected_for(self, config: RunConfig) -> str | None:
        """How this kernel is connected to the Ray ``config`` asks for (`_how`), or None
        when it is not connected to it now; connects, starts and stops nothing."""
        import sys

        if "ray" not in sys.modules:
            return None
        import ray

        with self.lock:
            if not ray.is_initialized():
                return None
            current = _current_address()
            if self.joined and (current != self.joined_gcs or _current_job() != self.joined_job):
                return None  # someone re-initialised Ray since: the next run sorts it out
            address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
            if not address or address == "auto" or address == self.joined or (
                current and _host_port(address) == _host_port(current)
            ):
                return self._how()
            return None

    def _connect(self, config: RunConfig) -> str:
        import ray

        address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
        if ray.is_initialized():
            current = _current_address()
            if self.joined and (current != self.joined_gcs or _current_job() != self.joined_job):
                # someone re-initialised Ray since (even against the same cluster): that connection is theirs
                self.joined = self.joined_gcs = self.joined_job = None
            if not address or address == "auto" or address == self.joined or (
                current and _host_port(address) == _host_port(current)
            ):
                return self._how()
            if self.joined:  # a cluster this launcher joined: leave it for the requested one
                ray.shutdown()
            elif self.temp_dir is None:
                raise LaunchError(
                    f"this kernel is already connected to Ray at {current}; call ray.shutdown() before using "
                    f"--ray-address {address}, or drop --ray-address to use the connected cluster"
                )
            self.shutdown()  # ours: switch to the requested cluster
        self.joined = self.joined_gcs = self.joined_job = None
        if address:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            except Exception as exc:
                raise LaunchError(f"could not join the Ray cluster at {address}: {summary(exc, limit=300)}") from None
            self.joined = address  # Ray reports a loopback address under the node's IP: remember ours
            self.joined_gcs = _current_address()
            self.joined_job = _current_job()
            return "joined"
        self._start(max(4, config.num_processes + 1))
        return "embedded"

    def _how(self) -> str:
        """How this kernel is connected to the Ray it is on now: "embedded" (the local instance the magic
        started), "joined" (a cluster the magic joined), "notebook" (a local Ray the notebook's own ``ray.init()``
        started: this machine's, it ends with the notebook) or "running" (a Ray someone else started)."""
        if self.temp_dir:
            return "embedded"
        if self.joined:
            return "joined"
        return "notebook" if ray_compat.started_by_this_process() else "running"

    def has_capacity(self, config: RunConfig) -> bool:
        """Does the cluster have (in total) the CPUs or GPUs a run with ``config`` asks for?"""
        import ray

        with self.lock:
            return ray.cluster_resources().get("GPU" if config.use_gpu else "CPU", 0) >= config.num_processes

    def ensure_capacity(self, config: RunConfig, how: str, in_use: bool = False) -> None:
        """A run that asks for more than the cluster has would wait forever: fail now (or grow our instance,
        unless ``in_use``: another run of this kernel is on it, and a restart would kill its workers)."""
        with self.lock:
            self._ensure_capacity(config, how, in_use)

    def _ensure_capacity(self, config: RunConfig, how: str, in_use: bool) -> None:
        import ray

        resource = "GPU" if config.use_gpu else "CPU"
        have = ray.cluster_resources().get(resource, 0)
        if have >= config.num_processes:
            return
        if how == "embedded" and not config.use_gpu and not in_use:
            self.shutdown()
            self._start(max(4, config.num_processes + 1))
            return
        if how == "embedded" and not config.use_gpu:
            raise LaunchError(
                f"{config.num_processes} workers need {config.num_processes} CPUs; the local Ray instance has "
                f"{have:g}, and growing it means restarting it under another run of this kernel: wait for that run "
                "to end, or use fewer --num-workers"
            )
        where = {"embedded": "the local Ray instance", "notebook": "the Ray your ray.init() started"}.get(
            how, f"the Ray cluster at {self.joined or _current_address()}")
        raise LaunchError(
            f"{config.num_processes} workers need {config.num_processes} {resource}s; {where} has {have:g}. "
            f"Use fewer --num-workers{'' if config.use_gpu else ''}, or a larger cluster"
        )

    def shutdown(self) -> None:
        """Shut down and remove the local instance this kernel started, if it runs (a joined cluster stays)."""
        with self.lock:
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        if self.temp_dir is None:
            return
        try:
            if ray.is_initialized():
                # The driver's core worker logs what fails as the instance stops (actor handles it cannot report
                # out of scope once the GCS is gone) on fd 2: to the backend log, with what Ray logs meanwhile.
                with backend_log.fds_to_log(), backend_log.logger_to_log("ray"):
                    ray.shutdown()
        finally:
            self._stop_sweeper()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
            self.num_cpus = 0

    def _stop_sweeper(self) -> None:
        """After ray.shutdown(): the watchdog removes whatever of the instance is left (Ray's agents) and exits."""
        sweeper, self.sweeper = self.sweeper, None
        if sweeper is None:
            return
        try:
            sweeper.stdin.close()
            sweeper.wait(10)
        except (OSError, subprocess.TimeoutExpired) as exc:  # it exits once the kernel is gone anyway
            log_dropped(__name__, "_stop_sweeper", exc)

    def _start(self, num_cpus: int, attempts: int = 2) -> None:
        """Start the local instance; one more try when a loaded machine makes Ray's 30 s raylet wait time out."""
        for attempt in range(attempts):
            try:
                return self._start_once(num_cpus)
            except LaunchError as exc:
                if attempt == attempts - 1 or "timed out during startup" not in str(exc):
                    raise

    def _start_once(self, num_cpus: int) -> None:
        import ray

        from .. import watchdog

        # short: unix sockets
        temp_dir = tempfile.mkdtemp(prefix="dtr_ray_", dir="/tmp" if os.path.isdir("/tmp") else None)
        marker = f"{_INSTANCE_ENV}={temp_dir}"
        # Started first, so that nothing of the instance can outlive this process, even if it is killed
        # while Ray starts: its stdin closes with this process, and it SIGKILLs every process carrying the mark.
        self.sweeper = watchdog.start("sweep", marker, "--rmtree", temp_dir)
        os.environ[_INSTANCE_ENV] = temp_dir  # inherited by the GCS, the raylet, and through it by every worker
        try:
            # Ray makes its temp dir world-writable (0777, for shared clusters); inside ours (0700, the
            # user's alone) nobody else can reach its sockets, logs or spilled objects.
            # What Ray says as it starts (its token-auth notice on the "ray" logger) and what the processes it
            # starts write outside their own log files (they inherit fds 1 and 2 now) go to the backend log.
            with backend_log.fds_to_log(), backend_log.logger_to_log("ray"):
                ray_compat.init_local_instance(num_cpus, os.path.join(temp_dir, "r"))
        except BaseException as exc:
            os.environ.pop(_INSTANCE_ENV, None)
            try:
                ray.shutdown()  # whatever half-started
            finally:
                self._stop_sweeper()
                shutil.rmtree(temp_dir, ignore_errors=True)
            if isinstance(exc, Exception):
                raise LaunchError(f"could not start a local Ray instance: {summary(exc, limit=300)}") from None
            raise
        os.environ.pop(_INSTANCE_ENV, None)  # only the instance's processes carry it, not what starts later
        self.temp_dir, self.num_cpus = temp_dir, num_cpus
        kernel_state().stop_first_at_exit()  # before Ray's own exit hook, registered by ray.init


def _current_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception as exc:  # Ray not connected, or shutting down: no address
        log_dropped(__name__, "_current_address", exc)
        return None


def _current_job() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_job_id()
    except Exception as exc:  # Ray not connected, or shutting down: no job
        log_dropped(__name__, "_current_job", exc)
        return None


def _host_port(address: str) -> tuple[str, str]:
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    return host, port
