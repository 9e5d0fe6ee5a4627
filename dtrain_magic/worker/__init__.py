"""The worker side of a run: what runs in every worker process, whichever backend started it.

`run_worker` (`run`) is one rank: connect to the notebook's channel, join the process group
(`process_group`), build the strategy and the `TrainContext` (`context`), call the user's function, send
back its result or error. `WorkerJob` (`job`) is what the launcher hands every worker; `run_job_file` is
what the local launcher's forked workers run; the Spark and Ray launchers call `run_worker` directly.
"""

from __future__ import annotations

from .job import RankInfo, WorkerJob, rank_from_env
from .process_group import join_process_group_ahead, leave_process_group
from .run import preload, run_job_file, run_worker

__all__ = [
    "RankInfo", "WorkerJob", "join_process_group_ahead", "leave_process_group", "preload", "rank_from_env",
    "run_job_file", "run_worker",
]
