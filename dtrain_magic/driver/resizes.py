"""What the notebook keeps of a run's restarts and resizes (``--max-restarts``, ``--elastic``, a preemption notice).

Every relaunched attempt's rank 0 says, as it loads its checkpoint, where the run resumes: the ``resumed_at_step``
metric (the run's ``ctx.step()`` calls the checkpoint holds) with ``world_size``, ``grad_accum`` and ``lr_scale``
(`worker.context.TrainContext._restore_run_state`). The steps the earlier attempt had gone past that checkpoint are
the steps the restart lost: the attempt's furthest rank (its ``Pulse`` counts, twice a second, so a kill between
two pulses can make it up to half a second of steps short) plus where that attempt itself had resumed. They are
logged as ``steps_lost`` (this restart's) and ``steps_lost_total`` beside the resume's own metrics, so the MLflow
run shows the world size over time, each restart and what it cost. ``world`` is the current number of ranks
(the results the pump waits for).
"""

from __future__ import annotations

from typing import Any, Mapping

RESUMED = "resumed_at_step"  # `worker.context.RESUMED_METRIC` (the driver does not import the worker side)


class ResizeLog:
    """The run's world size and the steps its restarts lost, fed with every rank's pulse and rank 0's metrics."""

    def __init__(self, world: int):
        self.world = world
        self.world_sizes = [world]  # one per resume that changed it, the first the run's own
        self.steps_lost_total = 0
        self._attempt_start = 0  # the run's step the current attempt resumed from
        self._attempt_steps = 0  # the furthest rank's ctx.step() calls in the current attempt

    def launched(self, world: int | None) -> None:
        """The launcher's number of workers for its new attempt (`LaunchState.world_size`; None: unchanged)."""
        if world is not None and world != self.world:
            self.world = world
            self.world_sizes.append(world)

    def pulse(self, steps: int) -> None:
        """A rank's ``Pulse.steps`` (its ``ctx.step()`` calls in this attempt)."""
        self._attempt_steps = max(self._attempt_steps, steps)

    def metrics(self, metrics: Mapping[str, Any]) -> Mapping[str, Any]:
        """Rank 0's metrics, with ``steps_lost``/``steps_lost_total`` added to a resume's."""
        if RESUMED not in metrics:
            return metrics
        resumed = int(metrics[RESUMED])
        reached = self._attempt_start + self._attempt_steps
        lost = max(0, reached - resumed) if self._attempt_steps else 0
        self.steps_lost_total += lost
        self._attempt_start, self._attempt_steps = resumed, 0
        self.launched(int(metrics.get("world_size", self.world)))
        return {**metrics, "steps_lost": float(lost), "steps_lost_total": float(self.steps_lost_total)}
