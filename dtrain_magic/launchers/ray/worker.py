"""What every Ray Train worker runs (`_train_loop`), and ``ctx``'s checkpoints on Ray Train's own
(`RayCheckpointStore`)."""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from ..._compat import ray as ray_compat
from ...errors import log_dropped
from ...worker import RankInfo
from .. import watchdog

DRAINING = "Ray is draining a node of the run"  # the preemption notice on Ray (Ray Train's preemption watcher)


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
    except (ImportError, AttributeError) as exc:  # no pyarrow, or a checkpoint without a filesystem: not local
        log_dropped(__name__, "_is_local_fs", exc)
        return False


def dump_stacks_here(pid: int, stack_file: str, timeout: float) -> tuple[str, str]:
    """On a worker's node (a Ray task pinned there): dump its stacks, (state, text with the file's header)."""
    from ... import procfacts

    state, text = procfacts.dump_stacks({0: (pid, stack_file)}, timeout)[0]
    if state == "dumped":
        with open(stack_file, errors="replace") as handle:
            text = handle.readline() + text
    return state, text


def _start_exit_watch() -> Any:
    """A watchdog (``exit-watch``) that records the signal this process dies of, if it dies before it ends in
    Python: the raylet reaps Ray's workers and Ray's error only guesses (SIGKILL, OOM, a crash)."""
    from ... import procfacts

    stack_file = procfacts.stack_file_path(os.getpid())
    if stack_file is None:
        return None
    try:
        return watchdog.start("exit-watch", str(os.getpid()), stack_file)
    except OSError:
        return None


def _train_loop(config: dict) -> None:
    """``train_loop_per_worker``: one Ray Train worker = one rank of the run."""
    exit_watch = _start_exit_watch()
    try:
        _run_job(config["job"], config.get("cwd"))
    finally:
        watchdog.tell_done(exit_watch, wait=True)


def _standby_loop(config: dict) -> None:
    """``train_loop_per_worker`` of a standby (`dtrain_magic.launchers.standby`): Ray Train placed this worker
    and joined the process group; import what every run needs, then wait for the run's job and run it as
    `_train_loop` does, or return at once when released. A worker group Ray Train restarts during the run
    (``--max-restarts``) runs this again: the standby hands it the same job, and it resumes from Ray's
    checkpoint as a restarted `_train_loop` would. While a sweep reuses the workers, the next job follows on the
    same worker (`serve_jobs`)."""
    import ray.train

    from ...worker import preload
    from ..waiting import serve_jobs

    def run(order: Any, job: Any) -> bool:
        _run_job(job, order.cwd)
        return True  # (a job that raised ends the loop with its exception)

    # Watched from the start: a signal that ends it between the job's arrival and run_worker's own handlers (the
    # job's unpickling, imports) is still named.
    exit_watch = _start_exit_watch()
    try:
        preload(tuple(config.get("strategies", ())))
        serve_jobs(config["standby"], ray.train.get_context().get_world_rank(), run)
    finally:
        watchdog.tell_done(exit_watch, wait=True)


def _run_job(job: Any, cwd: str | None) -> None:
    """``run_worker(job)`` on this Ray Train worker, in the notebook's working directory."""
    import ray.train

    from ...worker import run_worker

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
    builtins.print = ray_compat.unpatched_print()  # Ray Train tees print() into its logger too: each line came twice
    try:
        run_worker(job, ranks, checkpoints=store, preemption=(ray_compat.preemption_noticed, DRAINING))
    finally:
        builtins.print = printer
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
        store.cleanup()
