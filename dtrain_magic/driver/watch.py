"""Is the run progressing? Per rank, from what the pump sees: the rules behind ``--hang-timeout`` and
``--stall-timeout`` (pure: the clock is given, so the rules are unit-tested without processes).

- **Progress** of a rank: its output, rank 0's metrics, its pulse counters moving (a ``ctx.step``, ``ctx.log``,
  ``ctx.backward`` call, a batch through the prepared model), or its process using CPU (`BUSY_CPU_NOW` of a core
  between two pulses, or `BUSY_CPU` over `BUSY_WINDOW_S`: it computes, say a long first step of a big model, or rank
  0 evaluating alone after the others returned; a rank waiting for its GPU spins or yields in CUDA's synchronize,
  which is CPU too). A rank blocked in a collective, a lock, a queue or a socket uses none; one whose native code
  holds the GIL sends no pulse at all.
- ``--stall-timeout`` (default `DEFAULT_STALL_TIMEOUT_S`, 0: never): no progress from any rank still running
  for that long is a stall, reported once per stall (with every rank's stack); progress again re-arms it.
- ``--hang-timeout``: once a rank has ended (returned, failed, died), every rank still running without progress
  for that long is hung.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..channel import Pulse
from ..flagtable import DEFAULT_STALL_TIMEOUT_S

# A blocked rank's own wake-ups (its pulse thread, its wait loop) cost about 0.003 of a core on a quiet machine, but
# up to 0.034 over a single 0.5-s pulse while the suite ran beside it (measured): a 0.05 test on one pulse left
# too little room, and a waiting rank seen "computing" for one pulse re-armed the stall report. CPU counts at once
# from `BUSY_CPU_NOW` of a core between two pulses (a computing rank: 0.3-1.0), and from `BUSY_CPU` averaged over
# at least `BUSY_WINDOW_S` (a slow step that computes a little), where one pulse's noise is averaged away.
BUSY_CPU_NOW = 0.25
BUSY_CPU = 0.05
BUSY_WINDOW_S = 2.0


@dataclass
class _Rank:
    seen_at: float
    last_progress: float
    pulse: Pulse | None = None
    window: Pulse | None = None  # the pulse its CPU window started at (`BUSY_WINDOW_S`)
    ended: str | None = None
    ended_at: float | None = None


@dataclass
class Watch:
    """Progress per rank; `hung` and `stalled` say when the rules fire (``now``: the pump's monotonic clock)."""

    hang_timeout: float | None
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S  # None or 0: no stall watch
    restartable: bool = False  # --max-restarts: a failed or dead rank is the backend's to restart, not a hang's start
    ranks: dict[int, _Rank] = field(default_factory=dict)
    stall_reported_at: float | None = None  # when the current stall was reported; progress since re-arms the rule

    def hello(self, rank: int, now: float) -> None:
        self.ranks[rank] = _Rank(now, now)

    def activity(self, rank: int | None, now: float) -> None:
        """Output or metrics from ``rank`` (None: the launcher's own note, no rank's activity). A rank that ended
        still sends its last words (its "done" status, a flushed line): they are not progress, or they would start
        a new stall for the ranks that still run, which have been quiet all along."""
        state = self.ranks.get(rank) if rank is not None else None
        if state is not None:
            self._progressed(state, now)

    def pulse(self, message: Pulse, now: float) -> None:
        """A rank's counters and CPU time: progress when a counter moved, or it used `BUSY_CPU_NOW` of a core since
        its last pulse, or `BUSY_CPU` over its window of at least `BUSY_WINDOW_S`."""
        state = self.ranks.get(message.rank)
        if state is None:
            return
        before, state.pulse = state.pulse, message
        if before is None:
            state.window = message
            return
        window = state.window or before
        busy_now = cpu_share(before, message) >= BUSY_CPU_NOW
        window_done = message.unix_time - window.unix_time >= BUSY_WINDOW_S
        busy_window = window_done and cpu_share(window, message) >= BUSY_CPU
        if busy_now or window_done:
            state.window = message
        if _counters_moved(before, message) or busy_now or busy_window:
            self._progressed(state, now)

    @staticmethod
    def _progressed(state: _Rank, now: float) -> None:
        if state.ended is None:
            state.last_progress = now

    def ended(self, rank: int, how: str, now: float) -> None:
        """``rank`` returned, failed or died (``how``: "returned", "failed: ...", "died: ..."). Under restarts a
        failure or death ends no rank: the backend restarts the group (its new workers say hello) or fails the run,
        and its peers, blocked until it does, are not hung."""
        if self.restartable and not how.startswith("returned"):
            return
        state = self.ranks.setdefault(rank, _Rank(now, now))
        if state.ended is None:
            state.ended, state.ended_at = how, now

    def forget(self) -> None:
        """The workers were restarted: start over."""
        self.ranks.clear()
        self.stall_reported_at = None

    def live(self) -> list[int]:
        return sorted(rank for rank, state in self.ranks.items() if state.ended is None)

    def ended_ranks(self) -> dict[int, str]:
        return {rank: state.ended for rank, state in sorted(self.ranks.items()) if state.ended is not None}

    def hung(self, now: float) -> list[int]:
        """The live ranks, when a rank has ended and none of them made progress for ``hang_timeout`` since (or
        since the end, whichever is later); else []."""
        if not self.hang_timeout:
            return []
        ends = [state.ended_at for state in self.ranks.values() if state.ended_at is not None]
        live = self.live()
        if not ends or not live:
            return []
        first_end = min(ends)
        for rank in live:
            if now - max(self.ranks[rank].last_progress, first_end) < self.hang_timeout:
                return []
        return live

    def stalled(self, now: float) -> bool:
        """True once per stall: the ranks still running made no progress (no step, metric, output or CPU use) for
        ``stall_timeout``. Once reported, only progress of a rank still running starts a new one (not the last
        words of a rank that ended since, whose peers are still in the stall reported)."""
        live = self.live()
        if not self.stall_timeout or not live:
            return False
        reported = self.stall_reported_at
        if reported is not None and max(self.ranks[rank].last_progress for rank in live) <= reported:
            return False
        if self.quiet_for(now) >= self.stall_timeout:
            self.stall_reported_at = now
            return True
        return False

    def quiet_for(self, now: float) -> float:
        """How long the ranks still running have all been without progress."""
        live = self.live()
        return min((now - self.ranks[rank].last_progress for rank in live), default=0.0)


def _counters_moved(before: Pulse, after: Pulse) -> bool:
    return (after.calls, after.steps, after.samples) != (before.calls, before.steps, before.samples)


def cpu_share(before: Pulse, after: Pulse) -> float:
    """The share of a core the rank's process used between two of its pulses (0 when no time passed)."""
    elapsed = after.unix_time - before.unix_time
    return (after.cpu_s - before.cpu_s) / elapsed if elapsed > 0 else 0.0
