"""Throughput from every rank's pulse: steps/s per rank (stragglers), samples/s, tokens/s, model FLOP/s and MFU.

Rates are over the last `WINDOW_S` seconds of pulses (at least `MIN_SPAN_S` of them). A rank is a straggler
when its step rate stays below `STRAGGLER_RATIO` of the median over the ranks, two evaluations in a row. Under
synchronous data parallelism every rank waits for the slowest in each collective, so the step rates are equal
and the slow rank shows instead as the one busy while its peers wait: each rank's CPU use (cores, from the
same pulses) is shown beside its step rate.

Samples and tokens are summed over the ranks and divided by the ranks per model replica (ranks of one
tensor- or pipeline-parallel group see the same batch). Model FLOP/s: FLOPs per token × tokens/s when tokens
are counted, else FLOPs per sample × samples/s (`worker.flops`); MFU: that over the peak of every device.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ..channel import ModelFacts, Pulse

WINDOW_S = 10.0
MIN_SPAN_S = 2.0
STRAGGLER_RATIO = 0.7
MIN_MEDIAN_STEPS_PER_S = 0.2  # below this, steps are too rare to compare


@dataclass
class Snapshot:
    """What the monitor and MLflow get: rates per rank and for the run, stragglers, and why MFU is missing."""

    steps_per_s: dict[int, float] = field(default_factory=dict)
    cpu_cores: dict[int, float] = field(default_factory=dict)  # CPU use of each rank's process, in cores
    stragglers: list[int] = field(default_factory=list)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops_per_s: float | None = None
    mfu: float | None = None
    note: str = ""

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics of this snapshot (``perf/...``)."""
        out = {f"perf/steps_per_s/rank_{rank}": rate for rank, rate in self.steps_per_s.items()}
        for key in ("samples_per_s", "tokens_per_s", "flops_per_s", "mfu"):
            value = getattr(self, key)
            if value is not None:
                out[f"perf/{'model_flops_per_s' if key == 'flops_per_s' else key}"] = value
        return out

    def line(self) -> str:
        """``1,234 samples/s · 5.6 k tokens/s · 1.2 TFLOP/s · MFU 31 %`` (what is known)."""
        parts = []
        if self.samples_per_s:
            parts.append(_si(self.samples_per_s, " samples/s"))
        if self.tokens_per_s:
            parts.append(_si(self.tokens_per_s, " tokens/s"))
        if self.flops_per_s:
            parts.append(_si(self.flops_per_s, "FLOP/s"))
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f} %")
        return " · ".join(parts)


def _si(value: float, unit: str) -> str:
    """``1.23 k samples/s``, ``4.5 TFLOP/s``, ``420 samples/s``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit.lstrip()}"
    return f"{value:.3g} {unit.lstrip()}"


class Throughput:
    """Pulses in, `Snapshot` out (`snapshot`)."""

    def __init__(self, world_size: int, ranks_per_replica: int = 1):
        self.world_size, self.ranks_per_replica = world_size, max(1, ranks_per_replica)
        self._history: dict[int, deque] = {}
        self.facts: ModelFacts | None = None
        self._slow_before: set[int] = set()
        self.flagged: dict[int, str] = {}  # straggler → the words that flagged it (kept for the run's tag)

    def pulse(self, message: Pulse) -> None:
        history = self._history.setdefault(message.rank, deque())
        history.append((message.unix_time, message.steps, message.samples, message.tokens, message.cpu_s))
        while len(history) > 2 and history[0][0] < message.unix_time - WINDOW_S:
            history.popleft()

    def forget(self) -> None:
        self._history.clear()
        self._slow_before.clear()

    def _rates(self) -> dict[int, tuple[float, ...]]:
        """rank → (steps, samples, tokens, CPU seconds) per second over the window."""
        rates = {}
        for rank, history in self._history.items():
            first, last = history[0], history[-1]
            span = last[0] - first[0]
            if span >= MIN_SPAN_S:
                rates[rank] = tuple((b - a) / span for a, b in zip(first[1:], last[1:], strict=True))
        return rates

    def snapshot(self) -> Snapshot:
        rates = self._rates()
        snap = Snapshot(steps_per_s={rank: rate[0] for rank, rate in sorted(rates.items())},
                        cpu_cores={rank: rate[3] for rank, rate in sorted(rates.items())})
        snap.stragglers = self._stragglers(snap.steps_per_s)
        if rates:
            scale = 1.0 / self.ranks_per_replica
            samples = sum(rate[1] for rate in rates.values()) * scale
            tokens = sum(rate[2] for rate in rates.values()) * scale
            snap.samples_per_s = samples if samples > 0 else None
            snap.tokens_per_s = tokens if tokens > 0 else None
        self._flops(snap)
        return snap

    def _stragglers(self, steps: dict[int, float]) -> list[int]:
        if len(steps) < 2:
            return []
        median = statistics.median(steps.values())
        if median < MIN_MEDIAN_STEPS_PER_S:
            self._slow_before = set()
            return []
        slow = {rank for rank, rate in steps.items() if rate < STRAGGLER_RATIO * median}
        confirmed = sorted(slow & self._slow_before)
        self._slow_before = slow
        for rank in confirmed:
            self.flagged[rank] = (f"rank {rank}: {steps[rank]:.3g} steps/s, {steps[rank] / median:.2f}x the median "
                                  f"{median:.3g}")
        return confirmed

    def _flops(self, snap: Snapshot) -> None:
        facts = self.facts
        if facts is None:
            return
        if snap.tokens_per_s and facts.flops_per_token:
            snap.flops_per_s = facts.flops_per_token * snap.tokens_per_s
        elif snap.samples_per_s and facts.flops_per_sample:
            snap.flops_per_s = facts.flops_per_sample * snap.samples_per_s
        elif snap.samples_per_s:
            snap.note = ("model FLOP/s: FLOPs per sample unknown (ctx.set_model_flops(per_sample=...), or token-id "
                         "inputs for 6 x parameters per token)")
        if snap.flops_per_s and facts.peak_flops:
            snap.mfu = snap.flops_per_s / (facts.peak_flops * self.world_size)
        elif facts.note:
            snap.note = facts.note
