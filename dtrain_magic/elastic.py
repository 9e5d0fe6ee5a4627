"""``--elastic MIN:MAX`` and the batch arithmetic of a resize (pure logic; no torch, no backend).

A run that loses workers continues on the survivors from its last checkpoint when at least MIN remain, through
the same launcher. The global batch (micro-batch x data-parallel ranks x gradient accumulation) is kept by
recomputing the accumulation: ``A' = A x D / D'`` (the micro-batch cancels out). Where that does not divide, the
nearest whole value is used and the learning rate is scaled by the ratio of the new global batch to the old one
(the linear scaling rule), and both are said in the cell and logged to MLflow (`Resize.note`; rank 0 logs
``world_size``, ``grad_accum`` and ``lr_scale`` as it resumes).

Growing back (the policy, docs/reliability.md): the size of every later relaunch of the run (a restart after a
failure or a preemption notice) is the largest world up to MAX the backend has room for; on the local backend the
room is this machine (its cores for CPU runs, its GPUs with ``--gpu``), so the next restart grows the run back to
MAX. A run that is merely running smaller is not stopped to grow: that would lose the steps since its last
checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


def parse_elastic(text: str | None) -> tuple[int, int] | None:
    """``"MIN:MAX"`` → ``(MIN, MAX)``; None stays None. A `ConfigError` naming ``--elastic`` otherwise."""
    if text is None:
        return None
    if isinstance(text, tuple):
        low, high = text
    else:
        parts = str(text).split(":")
        try:
            low, high = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (None, None)
        except ValueError:
            low = high = None
    if not isinstance(low, int) or not isinstance(high, int) or isinstance(low, bool) or not 1 <= low <= high:
        raise ConfigError("--elastic", f"got {text!r}; must be MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2): the fewest "
                                       "workers the run may continue on, and the most")
    return low, high


@dataclass(frozen=True)
class Resize:
    """One change of world size: from ``old`` to ``new`` ranks, the accumulation and the learning-rate factor
    that keep (or come nearest to) the global batch. ``lr_scale`` is relative to the run's own learning rate."""

    old: int
    new: int
    old_accum: int
    accum: int
    lr_scale: float = 1.0

    @property
    def exact(self) -> bool:
        """The run's global batch is kept exactly (no learning-rate scaling)."""
        return abs(self.lr_scale - 1.0) < 1e-12

    def note(self) -> str:
        """What the cell says about the resize."""
        head = f"dtrain_magic: world size {self.old} -> {self.new}: gradient accumulation {self.old_accum} -> " \
               f"{self.accum}"
        if self.exact:
            return f"{head} (global batch kept)\n"
        return (f"{head}: the run's global batch does not divide over {self.new} ranks, so it is {self.lr_scale:g} "
                f"times the run's own and the learning rate is scaled by {self.lr_scale:g} (linear scaling)\n")


def recompute(old: int, new: int, accum: int, lr_scale: float = 1.0) -> Resize:
    """The accumulation on ``new`` data-parallel ranks that keeps the global batch of ``old`` ranks x ``accum``
    (nearest whole value >= 1 where it does not divide), and the learning-rate factor then used (``lr_scale``:
    the factor already in use)."""
    total = accum * old
    new_accum = max(1, round(total / new)) if total % new else total // new
    factor = (new_accum * new) / total
    return Resize(old, new, accum, new_accum, lr_scale * factor)


def survivors_world(world: int, lost: int, bounds: tuple[int, int]) -> int | None:
    """The world a run continues on after losing ``lost`` of ``world`` workers: the survivors if at least MIN
    remain, else None (the run cannot continue)."""
    low, _ = bounds
    remaining = world - lost
    return remaining if remaining >= low else None


def grown_world(current: int, bounds: tuple[int, int], room: int | None) -> int:
    """The world of a relaunch that is free to grow: MAX, or as many as the backend has ``room`` for (None: no
    limit), never below ``current``."""
    _, high = bounds
    return max(current, high if room is None else min(high, room))


def resized_job(base_job: Any, current_job: Any, world: int) -> tuple[Any, Resize]:
    """The next attempt's `WorkerJob` on ``world`` ranks, from the run as asked (``base_job``) and as the current
    attempt runs it: the accumulation that keeps the run's global batch (``--train-batch`` with it), the
    learning-rate factor where it cannot; and the `Resize` (its `Resize.note` is the cell's line). Every launcher
    that resizes a run (local, Ray) builds its next job here."""
    base, current = base_job.config, current_job.config
    resize = recompute(base.num_processes, world, base.grad_accum)
    resize = dataclasses.replace(resize, old=current.num_processes, old_accum=current.grad_accum)
    train_batch = None if base.train_batch is None else (base.micro_batch or 0) * resize.accum * world or None
    config = dataclasses.replace(current, num_processes=world, grad_accum=resize.accum, train_batch=train_batch)
    return dataclasses.replace(base_job, config=config, lr_scale=resize.lr_scale), resize
