"""What a standby's worker does until a run comes (the notebook's side: `dtrain_magic.launchers.standby`).

A standby is a launch started before the run that will use it: its workers are a run's workers (ranks set, the
process group joined, torch imported) that do not know their job yet. Each connects to the standby's listener in
the notebook (authenticated like the run channel), sends `StandbyReady` and blocks until the notebook answers:
`StandbyJob` (run it: the backend's waiting function then calls ``run_worker`` as a freshly launched worker
does) or `StandbyRelease` (return: the launch ends). A notebook that went away (its side of the connection
closed, the listener gone) is a release too.
"""

from __future__ import annotations

import os
import socket
from multiprocessing.connection import Client
from typing import Any, Callable

from ..channel import StandbyJob, StandbyReady, decode
from ..errors import log_dropped

StandbyAddress = tuple  # (host, port, authkey): where a standby's listener is, and its secret


def wait_for_job(address: StandbyAddress, rank: int, done: str = "") -> StandbyJob | None:
    """Tell the standby's listener at ``address`` that ``rank`` is ready (``done``: the token of the job this
    process just finished, when it waits again); block until it answers. The run's `StandbyJob`, or None when there
    is nothing to run (released, or the notebook is gone)."""
    host, port, authkey = address
    try:
        conn = Client((host, port), authkey=authkey)
    except Exception as exc:  # the listener closed (released before this worker came up), or the notebook is gone
        log_dropped(__name__, "wait_for_job", exc)
        return None
    try:
        conn.send(StandbyReady(rank, os.getpid(), socket.gethostname(), done).wire())
        message = decode(conn.recv())
    except Exception as exc:  # EOF: the notebook closed its side
        log_dropped(__name__, "wait_for_job", exc)
        return None
    finally:
        try:
            conn.close()
        except OSError as exc:
            log_dropped(__name__, "wait_for_job", exc)
    return message if isinstance(message, StandbyJob) else None


def serve_jobs(address: StandbyAddress, rank: int, run: Callable[[StandbyJob, Any], bool]) -> bool:
    """A standby worker's life: wait for a job, ``run(order, job)`` it (True: it returned), and while the job asks
    for its workers to be reused (`WorkerJob.reuse_workers`: a sweep's trials) and saved no checkpoint, wait for the
    next one on the same listener. What the last ``run`` said (True when released before any job)."""
    from ..worker.checkpoints import saves_here

    order, returned = wait_for_job(address, rank), True
    while order is not None:
        job, saves = job_of(order), saves_here()
        returned = run(order, job)
        if not (returned and job.reuse_workers and saves_here() == saves):
            break  # the launch ends as a run's does
        order = wait_for_job(address, rank, done=order.token)
    return returned


def job_of(order: StandbyJob) -> Any:
    """The `WorkerJob` an order carries (unpickled here, in the worker, as a launched worker's job is)."""
    import cloudpickle

    return cloudpickle.loads(order.pickled_job)


def follow_notebook_environment(order: StandbyJob) -> None:
    """Apply what the notebook changed in its environment since the launch, for a worker that inherited the
    notebook's environment when it was launched (Spark local mode): a fresh launch would have seen it."""
    for key in order.env_unset:
        os.environ.pop(key, None)
    os.environ.update(order.env_set)


def follow_notebook_directory(order: StandbyJob) -> None:
    """Work in the notebook's current directory, as a worker launched now would (Spark local mode)."""
    if order.cwd and os.path.isdir(order.cwd) and os.getcwd() != order.cwd:
        os.chdir(order.cwd)

