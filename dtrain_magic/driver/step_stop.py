"""Stopping every rank of a run after the same step (a pruned sweep trial), rather than all at once as Stop does.

Stop (`threading.Event`) ends a run by stopping its workers wherever each one is: one rank may be inside an
all-reduce its peers never join. A `StepStop` is a run's stop event that can also be asked to end the run at a step
(`StepStop.at_a_step`): the pump (`driver.pump.Pump`) picks a ``ctx.step`` count ``T`` beyond where any rank can be
when the request reaches it (`StopPlan.choose`: each rank's last reported count, extrapolated at its step rate to
the moment the message lands, plus `MARGIN_STEPS`), writes `channel.StopAt(T)` to every rank's connection, and every
rank's ``ctx.step`` raises `errors.StopAtStep` after its ``T``-th step: the run ends `errors.RunStopped`, each rank
having made the same steps. Under synchronous data parallelism the ranks are within a step of each other, so a rank
already past ``T`` when the message lands (`channel.StopMissed`) means they cannot all stop there, and a rank that
has not stopped `GRACE_S` after it should have (a loop that stopped calling ``ctx.step``) neither: both fall back to
Stop (`StopPlan.fallback`), which the caller applies.

`StopPlan` is pure (the clock is given): unit-tested without processes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

MARGIN_STEPS = 2  # beyond the extrapolated count: the last step's own spread between ranks, and rounding
LEAD_S = 0.2  # how long the request takes to reach a rank's pulse thread, at most, on a loaded machine
RATE_WAIT_S = 1.5  # a rank's step rate unknown (one pulse so far): wait at most this long for a second pulse
GRACE_S = 5.0  # beyond the time the slowest rank should need to reach the stop step


class StepStop(threading.Event):
    """A run's stop event (`PreparedRun.execute`'s ``stop``): `set` stops every worker at once, as Stop does;
    `at_a_step` asks every rank to stop after one ``ctx.step`` count, the same on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None  # set by `at_a_step`

    def at_a_step(self, reason: str) -> None:
        """Ask the run to end with every rank stopped after the same step (the pump picks it); ``reason``: why
        (a pruned trial), said to the ranks."""
        if self.reason is None:
            self.reason = reason

    @property
    def wanted(self) -> bool:
        """Whether `at_a_step` was asked."""
        return self.reason is not None


@dataclass
class _Progress:
    steps: int
    at: float  # the pump's monotonic clock when the pulse arrived
    rate: float | None = None  # steps a second between its last two pulses


@dataclass
class StopPlan:
    """One run's stop at a step, on the pump's side: fed every rank's pulse (`pulse`), it picks the step (`choose`),
    then hears which ranks stopped or missed it (`stopped`, `missed`) and says when to give up (`fallback`)."""

    world_size: int
    ranks: dict[int, _Progress] = field(default_factory=dict)
    target: int | None = None
    sent_at: float | None = None
    deadline: float | None = None
    stopped_ranks: dict[int, int] = field(default_factory=dict)  # rank → the step it stopped after
    missed_ranks: dict[int, int] = field(default_factory=dict)  # rank → its count when it found it had passed

    def pulse(self, rank: int, steps: int, now: float) -> None:
        """A rank's ``ctx.step`` count (`channel.Pulse.steps`) as it arrived at ``now``."""
        last = self.ranks.get(rank)
        rate = None
        if last is not None and now > last.at:
            rate = max(0.0, (steps - last.steps) / (now - last.at))
            rate = rate if last.rate is None else max(rate, 0.5 * (rate + last.rate))  # a burst is not missed
        self.ranks[rank] = _Progress(steps, now, rate)

    def forget(self) -> None:
        """The workers restarted: their counts start again."""
        self.ranks.clear()

    def choose(self, now: float, asked_at: float) -> int | None:
        """The step to stop after: beyond the count any rank can have when `channel.StopAt` reaches it. None while a
        rank has not reported, or its rate is still unknown (for at most `RATE_WAIT_S` after ``asked_at``)."""
        if len(self.ranks) < self.world_size:
            return None
        waited = now - asked_at >= RATE_WAIT_S
        if not waited and any(progress.rate is None for progress in self.ranks.values()):
            return None
        furthest = max(progress.steps + (progress.rate or 0.0) * (now - progress.at + LEAD_S)
                       for progress in self.ranks.values())
        return math.ceil(furthest - 1e-9) + MARGIN_STEPS  # (a clock's float noise is no step)

    def sent(self, target: int, now: float) -> None:
        """`channel.StopAt(target)` went to every rank at ``now``: the grace runs from the slowest rank's time to
        reach it."""
        self.target, self.sent_at = target, now
        slowest = 0.0
        for progress in self.ranks.values():
            left = max(0, target - progress.steps)
            slowest = max(slowest, left / progress.rate if progress.rate else 0.0)
        self.deadline = now + slowest + GRACE_S

    def stopped(self, rank: int, step: int) -> None:
        self.stopped_ranks[rank] = step

    def missed(self, rank: int, steps: int) -> None:
        self.missed_ranks[rank] = steps

    def fallback(self, now: float, ended: set[int]) -> str | None:
        """Why every worker must now be stopped at once, as Stop does (None: wait on). ``ended``: the ranks that
        returned, failed or stopped (a rank that returned before the step is no reason)."""
        if self.missed_ranks:
            rank, steps = min(self.missed_ranks.items())
            return (f"rank {rank} was already at step {steps} when asked to stop after step {self.target}, so the "
                    "ranks could not all stop at one step")
        if self.deadline is not None and now > self.deadline and len(ended) < self.world_size:
            waiting = sorted(set(range(self.world_size)) - ended)
            return (f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} did not stop after step "
                    f"{self.target} within {self.deadline - self.sent_at:.0f} s (no ctx.step call since?)")
        return None

    @property
    def step(self) -> int | None:
        """The step every rank stopped after, once each did and all agree; else None."""
        steps = set(self.stopped_ranks.values())
        return steps.pop() if len(self.stopped_ranks) == self.world_size and len(steps) == 1 else None
