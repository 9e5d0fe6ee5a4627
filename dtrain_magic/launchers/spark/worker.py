"""What runs in every torchrun process that TorchDistributor starts (shipped by reference: this module must
be importable on every executor, as dtrain_magic is)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from ...errors import log_dropped
from ...worker import WorkerJob
from .. import watchdog
from ..base import loopback_interface


def _spark_train_fn(job: WorkerJob, tracking_uri: str | None = None, watch: tuple | None = None) -> None:
    """TorchDistributor's train function: watchdog, per-node system metrics, then ``run_worker(job)``.

    Returns None: the user's value travels over the channel. The user's exception is swallowed after
    ``run_worker`` reported it over the channel, so torchrun and Spark end cleanly and the notebook shows
    the worker's own short error instead of a Spark traceback.
    """
    _gloo_on_loopback()
    guard = _start_watchdog(watch, int(os.environ.get("RANK", "0"))) if watch else None
    try:
        _run_job(job, tracking_uri)
    finally:
        watchdog.tell_done(guard)
    _skip_teardown_at_exit()
    return None


def _spark_standby_fn(standby: tuple, watch: tuple, strategies: tuple[str, ...], use_gpu: bool,
                      follows_notebook: bool, process_group_backend: str) -> None:
    """TorchDistributor's train function for a standby (`dtrain_magic.launchers.standby`): the watchdog, the
    imports every run needs, the process group joined, then wait for the run's job and run it as
    `_spark_train_fn` does (and the next, while a sweep reuses them: `serve_jobs`); return at once when released.
    ``follows_notebook`` (local mode: the workers inherited the notebook's environment and working directory at
    launch): apply what changed since."""
    from ...worker import join_process_group_ahead, leave_process_group, preload
    from ..waiting import follow_notebook_directory, follow_notebook_environment, serve_jobs

    def run(order: Any, job: WorkerJob) -> bool:
        if follows_notebook:
            follow_notebook_environment(order)
            follow_notebook_directory(order)
        return _run_job(job, order.tracking_uri)

    _gloo_on_loopback()
    rank = int(os.environ.get("RANK", "0"))
    guard = _start_watchdog(watch, rank)
    finished = False
    try:
        preload(strategies)
        join_process_group_ahead(process_group_backend, use_gpu)
        finished = serve_jobs(standby, rank, run)
    finally:
        leave_process_group(use_gpu, finished)
        watchdog.tell_done(guard)
    _skip_teardown_at_exit()
    return None


def _gloo_on_loopback() -> None:
    if os.environ.get("MASTER_ADDR", "").startswith("127.") or os.environ.get("MASTER_ADDR") == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())


def _run_job(job: WorkerJob, tracking_uri: str | None) -> bool:
    """``run_worker(job)``, with per-node system metrics in cluster mode; True when it returned."""
    from ...worker import run_worker

    # Per-node system metrics in cluster mode; in local mode the workers run on the driver, whose own
    # monitor (started by the notebook) already samples this machine, and importing MLflow here would
    # only delay the first step.
    per_node = not job.config.local_mode and os.environ.get("LOCAL_RANK", "0") == "0"
    monitor = _start_node_metrics(job, tracking_uri) if per_node else None
    try:
        run_worker(job)
        return True
    except BaseException as exc:  # the rank's own failure: run_worker reported it over the channel
        log_dropped(__name__, "_run_job", exc)
        return False
    finally:
        _finish_node_metrics(monitor)


def _skip_teardown_at_exit() -> None:
    """Once TorchDistributor's script has written this function's (None) return value, end the process without
    the interpreter's teardown: with torch loaded it takes seconds (the cell waits for torchrun to end), and a
    DDP reducer's destructor can block forever on a peer that is gone (docs/stack-notes.md). Registered last,
    this exit hook runs first."""
    import atexit

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError) as exc:  # the reader is gone or the stream closed
                log_dropped(__name__, "leave", exc)
        os._exit(0)

    atexit.register(leave)


def _start_watchdog(watch: tuple, rank: int) -> Any:
    """A watchdog process (`dtrain_magic.launchers.watchdog`, rank-watch mode) for this worker: it holds this rank's
    connection to the launcher's `_RankWatch` and SIGKILLs this process when the notebook closes it (run
    over, cancelled, notebook gone), whatever this process is doing, even blocked in native code; it dumps this
    process's stacks when the notebook asks, and says what killed it when it dies."""
    from ... import procfacts

    host, port, authkey = watch
    stack_file = procfacts.stack_file_path(os.getpid()) or ""  # where run_worker's stack dump will write
    return watchdog.start("rank-watch", host, str(port), str(rank), str(os.getpid()), stack_file, secret=authkey)


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
        import logging

        try:
            from ...tracking.system_metrics import quiet_mlflow, start_monitor

            quiet_mlflow(logging.ERROR)
            node.monitor = start_monitor(job.run_id, tracking_uri, node_id)
        except Exception as exc:  # broad: the training runs on without this node's system metrics, but says so
            logging.getLogger(__name__).warning("%s's system metrics are not recorded: %s", node_id, exc)
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
        from ...tracking.system_metrics import finish_monitor

        finish_monitor(monitor)
    except Exception as exc:  # MLflow's monitor thread: its last samples at most
        log_dropped(__name__, "_finish_node_metrics", exc)
