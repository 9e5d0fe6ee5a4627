"""``--elastic MIN:MAX`` on Ray: each attempt is one ``TorchTrainer.fit()`` sized to what the Ray has room for.

Ray Train's own elastic scaling (``ScalingConfig(num_workers=(MIN, MAX))``) was tried first, on a Ray of two one-CPU
nodes on this machine: when a node left, its controller asked again for MAX workers (its view of the cluster, through
Ray Data's autoscaling coordinator, still had the node) and went on with the survivor only after its 60 s worker-group
start timeout. And it keeps neither the global batch nor a data position across a resize. So the launcher resizes:
an attempt's ``fit()`` runs with ``FailureConfig(max_failures=0)``; when it fails, the next attempt is as many workers
as the Ray's alive nodes hold (its CPUs, or GPUs with ``--gpu``; one each), up to MAX. Fewer than the attempt had is
a shrink (no restart of ``--max-restarts`` used) if at least MIN; as many or more is a restart (one of
``--max-restarts``, growing back toward MAX when nodes came back). The next ``fit()`` has the same run name and
storage, so Ray Train restores its latest checkpoint (its checkpoint manager's snapshot in the run's directory) and
``ctx.load_checkpoint()`` resumes from it; its job carries the accumulation and learning-rate factor of the new world
(`dtrain_magic.elastic.resized_job`), as on the local backend.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ...channel import Output
from ...elastic import resized_job
from ...worker import WorkerJob
from ...worker.preempt import all_preempted, checkpointed_words
from ...worker.resume_point import resume_point
from ..base import Emit, Failure, LaunchState, RunningJob
from .worker import DRAINING


class ElasticRayRun(RunningJob):
    """A run's attempts, one ``fit()`` each (`RayJob`): ``launch(job)`` starts one; ``room()`` is how many workers
    the Ray's alive nodes hold now."""

    def __init__(self, job: WorkerJob, emit: Emit, launch: Callable[[WorkerJob], Any], room: Callable[[], int],
                 run_dir: str):
        self._base_job = self._job = job
        self._emit, self._launch, self._room, self._run_dir = emit, launch, room, run_dir
        self._restarts_left = job.config.max_restarts
        self._cancelled = False
        self.current = launch(job)

    def poll(self) -> LaunchState:
        state = self.current.poll()
        if not state.finished or not state.failures or self._cancelled:
            return LaunchState(state.finished, state.failures, errors_final=state.finished)
        world = self._next_world()
        if world is None:
            return state
        note = self._relaunch(state.failures, world)
        return LaunchState(False, [], errors_final=False, restarted=True, world_size=world, restart_note=note)

    def _next_world(self) -> int | None:
        """As many workers as the Ray holds, up to MAX: a shrink if fewer (at least MIN), else a restart if one is
        left; None: the run fails."""
        low, high = self._job.config.elastic_bounds
        world = min(high, self._room())
        if world < low:
            return None
        if world < self._job.config.num_processes or self._restarts_left > 0:
            return world
        return None

    def _relaunch(self, failures: list[Failure], world: int) -> str:
        current = self._job.config.num_processes
        shrink = world < current
        if not shrink:
            self._restarts_left -= 1
        where = resume_point(self._run_dir).words()
        what = (f"continuing on {world} of {current} worker(s) (the Ray's nodes hold {world}) from {where} "
                f"(--elastic {self._job.config.elastic})" if shrink
                else f"restarting every worker{f' on {world}' if world != current else ''} from {where} (restart "
                     f"{self._job.config.max_restarts - self._restarts_left}, {self._restarts_left} left)")
        failure = failures[0]
        rank = "a rank" if failure.rank is None else f"rank {failure.rank}"
        preempted = all_preempted([f.reason for f in failures])
        why = checkpointed_words(DRAINING) if preempted else f"{rank} failed ({failure.reason})"
        note = f"{why}; {what}"
        self._emit(Output(None, "stderr", f"dtrain_magic: {note}\n"))
        if world != current:
            self._job, resize = resized_job(self._base_job, self._job, world)
            self._emit(Output(None, "stderr", resize.note()))
            note += "; " + resize.note().removeprefix("dtrain_magic: ").strip()
        self.current = self._launch(self._job)
        return note

    def cancel(self) -> None:
        self._cancelled = True
        self.current.cancel()

    def dump_stacks(self, workers: Mapping[int, Any], timeout: float) -> dict[int, tuple[str, str]]:
        return self.current.dump_stacks(workers, timeout)
