"""Which Ray a run uses: the instance this kernel is connected to, the cluster at ``--ray-address`` /
``$RAY_ADDRESS``, or a local instance started once (127.0.0.1, no dashboard, its own temp dir, a watchdog that
removes every process of it when the kernel goes) and reused by later runs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from ..._compat import ray as ray_compat
from ...config import RunConfig
from ...errors import LaunchError
from ...tracebacks import summary


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

    from ... import watchdog

    temp_dir = tempfile.mkdtemp(prefix="dtr_ray_", dir="/tmp" if os.path.isdir("/tmp") else None)  # short: unix sockets
    marker = f"{_INSTANCE_ENV}={temp_dir}"
    # Started first, so that nothing of the instance can outlive this process, even if it is killed
    # while Ray starts: its stdin closes with this process, and it SIGKILLs every process carrying the mark.
    _Embedded.sweeper = watchdog.start("sweep", marker, "--rmtree", temp_dir)
    os.environ[_INSTANCE_ENV] = temp_dir  # inherited by the GCS, the raylet, and through it by every worker
    try:
        # Ray makes its temp dir world-writable (0777, for shared clusters); inside ours (0700, the
        # user's alone) nobody else can reach its sockets, logs or spilled objects.
        ray_compat.init_local_instance(num_cpus, os.path.join(temp_dir, "r"))
    except BaseException as exc:
        os.environ.pop(_INSTANCE_ENV, None)
        try:
            ray.shutdown()  # whatever half-started
        finally:
            _stop_sweeper()
            shutil.rmtree(temp_dir, ignore_errors=True)
        if isinstance(exc, Exception):
            raise LaunchError(f"could not start a local Ray instance: {summary(exc, limit=300)}") from None
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
            raise LaunchError(f"could not join the Ray cluster at {address}: {summary(exc, limit=300)}") from None
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
