"""What the notebook keeps of a run's restarts and resizes (``--max-restarts``, ``--elastic``, a preemption notice).

Every relaunched attempt's rank 0 says, as it loads its checkpoint, where the run resumes: the ``resumed_at_step``
metric (the optimizer steps the checkpoint holds), with ``world_size``, ``grad_accum`` and ``lr_scale``, logged at that
step (`worker.context.TrainContext._restore_run_state`). The optimizer steps the earlier attempt had gone past that
checkpoint are the steps the restart lost: the attempt's furthest rank (its ``Pulse`` counts ``ctx.step()`` calls,
twice a second, so a kill between two pulses can make it up to half a second of steps short), divided by the
attempt's accumulation, plus where that attempt itself had resumed. They are logged as ``steps_lost`` (this
relaunch's) and ``steps_lost_total`` beside the resume's own metrics. At the run's first relaunch the run's own world
size is logged at step 0 (stamped with the run's start), so ``world_size`` is the run's whole history; a relaunch that
used one of ``--max-restarts`` (not an elastic shrink, which uses none) adds to the ``restarts`` metric, logged at the
step the failed attempt reached. So the MLflow run shows the world size over time, each restart and what it cost; a
run never relaunched or resumed logs none of these. ``world`` is the current number of ranks (the results the pump
waits for).
"""

from __future__ import annotations

from typing import Any, Mapping

RESUMED = "resumed_at_step"  # `worker.context.RESUMED_METRIC` (the driver does not import the worker side)

Entry = tuple[int, dict[str, float], "int | None"]  # (step, metrics, timestamp in ms; None: now) to log


class ResizeLog:
    """The run's world size, restarts and the steps its relaunches lost, fed with every rank's pulse, the launcher's
    relaunches and rank 0's metrics."""

    def __init__(self, world: int, accum: int = 1, start_ms: int | None = None):
        self.world = world
        self.world_sizes = [world]  # one per relaunch or resume that changed it, the first the run's own
        self.restarts = 0  # relaunches that used one of --max-restarts
        self.steps_lost_total = 0
        self._accum = max(1, accum)  # the current attempt's gradient accumulation: ctx.step() calls per step
        self._start_ms = start_ms
        self._relaunched = False
        self._attempt_start = 0  # the optimizer step the current attempt resumed from
        # the furthest rank's ctx.step() calls in the current attempt, until the next one resumes: the stopped ranks'
        # last reports come after the launcher relaunched
        self._attempt_steps = 0

    @property
    def reached(self) -> int:
        """The optimizer steps the current attempt has reached (as far as its pulses said)."""
        return self._attempt_start + self._attempt_steps // self._accum

    def launched(self, world: int | None) -> None:
        """The number of ranks of the current attempt (None: unchanged)."""
        if world is not None and world != self.world:
            self.world = world
            self.world_sizes.append(world)

    def relaunched(self, world: int | None) -> list[Entry]:
        """The launcher started a new attempt on ``world`` ranks (`LaunchState.world_size`; None: the same): what to
        log for it. Fewer ranks is an elastic shrink; anything else used a restart."""
        entries: list[Entry] = []
        if not self._relaunched:
            entries.append((0, {"world_size": float(self.world_sizes[0])}, self._start_ms))
            self._relaunched = True
        if world is None or world >= self.world:
            self.restarts += 1
            entries.append((self.reached, {"restarts": float(self.restarts)}, None))
        self.launched(world)
        return entries

    def pulse(self, steps: int) -> None:
        """A rank's ``Pulse.steps`` (its ``ctx.step()`` calls in this attempt)."""
        self._attempt_steps = max(self._attempt_steps, steps)

    def metrics(self, metrics: Mapping[str, Any]) -> Mapping[str, Any]:
        """Rank 0's metrics, with ``steps_lost``/``steps_lost_total`` added to a resume's."""
        if RESUMED not in metrics:
            return metrics
        resumed = int(metrics[RESUMED])
        lost = max(0, self.reached - resumed)
        self.steps_lost_total += lost
        self._attempt_start, self._attempt_steps = resumed, 0
        self._accum = max(1, int(metrics.get("grad_accum", self._accum)))
        self.launched(int(metrics.get("world_size", self.world)))
        return {**metrics, "steps_lost": float(lost), "steps_lost_total": float(self.steps_lost_total)}
