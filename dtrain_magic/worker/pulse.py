"""A rank's pulse: what its training thread went through, reported by a thread of its own; and its stack file.

The training thread only bumps counters and appends ``ctx.log`` values to a queue (a few hundred nanoseconds
each); the reporter thread (`Pulse`) sends, four times a second, the values gathered (`channel.Metrics`, rank
0) and, twice a second, the counters with the process's CPU time (`channel.Pulse`). So ``ctx.log`` every step
costs no socket write per step, the notebook handles a few messages a second whatever the step rate, and the
notebook can tell a rank that progresses (counters or CPU moving) from one that is blocked (both still) from
one blocked even for Python (nothing at all: its native code holds the GIL).

A loop logging faster than MLflow can take (a SQLite store writes about 4000 values a second with a whole
core) is thinned per metric (`Thinning`): every value up to a burst, then at most ``rate`` a second (`RATE`), evenly
spread; a metric's last value is always sent, and the count left out travels with the batch.

`install_stack_dump`: ``faulthandler`` on `procfacts.STACK_SIGNAL` (and for fatal signals) with the rank's
stack file, whose first line names the training thread (`procfacts`).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from .. import procfacts
from ..channel import Message, Metrics, ModelFacts
from ..channel import Pulse as PulseMessage
from ..errors import log_dropped

METRICS_EVERY_S = 0.25
PULSE_EVERY_S = 0.5
BURST = 200  # values per metric sent as they come before thinning starts (short runs keep every step)
RATE = 10.0  # values per metric per second after the burst (env DTRAIN_MAGIC_METRIC_RATE): each costs
# the notebook 0.1-0.2 ms (MLflow's SQLite write), CPU the workers would miss on a small machine


class Thinning:
    """Per metric: a token bucket of ``burst`` values refilled at ``rate`` a second. `select` keeps, of the
    steps that logged a metric since the last call, as many as the bucket holds, evenly spread, the last always."""

    def __init__(self, burst: int = BURST, rate: float = RATE):
        # the bucket holds at least two flushes' worth at ``rate``: a higher rate is never capped by the burst
        self.burst, self.rate = max(float(burst), 2 * METRICS_EVERY_S * rate), rate
        self._tokens: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def select(self, key: str, count: int, now: float) -> range | list[int]:
        """Indices (0 .. count-1) of the values of ``key`` to send."""
        tokens = self._tokens.get(key, self.burst)
        if key in self._at:
            tokens = min(self.burst, tokens + (now - self._at[key]) * self.rate)
        self._at[key] = now
        if count <= tokens:
            self._tokens[key] = tokens - count
            return range(count)
        keep = max(1, int(tokens))
        self._tokens[key] = tokens - keep
        # evenly spread, ending on the last one
        return sorted({count - 1 - round(i * (count - 1) / keep) for i in range(keep)})


def thin(entries: list, thinning: Thinning, now: float) -> tuple[list, int]:
    """``entries`` ((step, metrics, stamp), in order) with the values `thinning` leaves out removed; (kept
    entries, values left out). Steps that lose every value are dropped."""
    by_key: dict[str, list[int]] = {}
    for index, (_, metrics, _) in enumerate(entries):
        for key in metrics:
            by_key.setdefault(key, []).append(index)
    dropped: dict[int, set[str]] = {}
    left_out = 0
    for key, indices in by_key.items():
        keep = thinning.select(key, len(indices), now)
        if len(keep) == len(indices):
            continue
        kept = {indices[i] for i in keep}
        for index in indices:
            if index not in kept:
                dropped.setdefault(index, set()).add(key)
                left_out += 1
    if not dropped:
        return entries, 0
    out = []
    for index, (step, metrics, stamp) in enumerate(entries):
        gone = dropped.get(index)
        if gone:
            metrics = {k: v for k, v in metrics.items() if k not in gone}
            if not metrics:
                continue
        out.append((step, metrics, stamp))
    return out, left_out


def _metric_rate() -> float:
    try:
        return max(1.0, float(os.environ.get("DTRAIN_MAGIC_METRIC_RATE", RATE)))
    except ValueError:
        return RATE


class Pulse:
    """One rank's counters, metric queue and reporter thread. The training thread calls `step`, `log_call`,
    `batch` and `queue_metrics`; `close` (before the result or the error is sent) sends what is left."""

    def __init__(self, rank: int, send: Callable[[Message], None]):
        self.rank, self._send = rank, send
        self.steps = 0  # ctx.step / ctx.train_step calls
        self.log_calls = 0  # ctx.log calls (every rank counts them)
        self.samples = 0
        self.batch_tokens = 0  # from token-id inputs the prepared model saw
        self.logged_tokens = 0  # ``tokens`` values the function passed to ctx.log
        self.calls = 0  # anything at all that shows the training thread moved
        self._queue: deque = deque()
        self._thinning = Thinning(rate=_metric_rate())
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one sender of metrics at a time (the thread, or close)
        self._thread = threading.Thread(target=self._loop, name="dtrain-pulse", daemon=True)
        self._thread.start()

    # -- the training thread ----------------------------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        self.calls += 1

    def log_call(self, tokens: float | None = None) -> None:
        self.log_calls += 1
        self.calls += 1
        if tokens:
            self.logged_tokens += int(tokens)

    def batch(self, samples: int, tokens: int = 0) -> None:
        self.samples += samples
        self.batch_tokens += tokens
        self.calls += 1

    def queue_metrics(self, step: int, metrics: dict, stamp_ms: int) -> None:
        self._queue.append((step, metrics, stamp_ms))  # deque.append: safe against the thread's popleft

    def facts(self, facts: ModelFacts) -> None:
        self._send(facts)

    # -- the reporter ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_pulse = 0.0
        while not self._closed.wait(METRICS_EVERY_S):
            try:
                self.flush_metrics()
                now = time.monotonic()
                if now >= next_pulse:
                    self._send(self.message())
                    next_pulse = now + PULSE_EVERY_S
            except Exception as exc:  # the notebook went away: WorkerLink already stops sending
                log_dropped(__name__, "Pulse._loop", exc)

    def message(self) -> PulseMessage:
        steps = self.steps or self.log_calls
        return PulseMessage(self.rank, steps, self.samples, self.logged_tokens or self.batch_tokens, self.calls,
                            time.process_time(), time.time())

    def flush_metrics(self) -> None:
        with self._lock:
            count = len(self._queue)
            if not count:
                return
            entries = [self._queue.popleft() for _ in range(count)]
            entries, left_out = thin(entries, self._thinning, time.monotonic())
            if entries or left_out:
                self._send(Metrics(self.rank, tuple(entries), left_out))

    def close(self) -> None:
        """Send what is queued and the last counters, and stop the thread (before the result or the error, so
        the notebook has every value when it has the result)."""
        self._closed.set()
        self._thread.join(2.0)
        self.flush_metrics()
        self._send(self.message())


class StackDump:
    """This rank's stack file and its faulthandler registration (`install_stack_dump`)."""

    def __init__(self, path: str, handle: Any):
        self.path, self._handle = path, handle  # the file stays open: faulthandler writes to its descriptor

    def remove(self) -> None:
        """The run is over: remove the file (its descriptor stays valid for a late signal; nothing else reads it)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass


def install_stack_dump(rank: int) -> StackDump | None:
    """Dump every thread's Python stack into this rank's stack file on `procfacts.STACK_SIGNAL`, and on a fatal
    signal (SIGSEGV, SIGABRT, ...). The calling thread is the training thread, named in the file's first line.
    None when the file cannot be made (no private temp directory): the rank then has no stacks to show."""
    path = procfacts.stack_file_path(os.getpid())
    if path is None:
        return None
    try:
        handle = procfacts.open_stack_file(path)
        handle.write(f"{procfacts.HEADER}: rank {rank} pid {os.getpid()} thread 0x{threading.get_ident():016x}\n")
        handle.flush()
        faulthandler.register(procfacts.STACK_SIGNAL, file=handle, all_threads=True, chain=False)
        faulthandler.enable(file=handle, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        return None
    return StackDump(path, handle)
