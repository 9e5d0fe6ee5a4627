"""A rank's pulse: what its training thread went through, reported by a thread of its own; and its stack file.

The training thread only bumps counters and appends ``ctx.log`` values to a queue (a few hundred nanoseconds
each); the reporter thread (`Pulse`) sends, four times a second, the values gathered (`channel.Metrics`, rank
0) and, twice a second, the counters with the process's CPU time (`channel.Pulse`). So ``ctx.log`` every step
costs no socket write per step, the notebook handles a few messages a second whatever the step rate, and the
notebook can tell a rank that progresses (counters or CPU moving) from one that is blocked (both still) from
one blocked even for Python (nothing at all: its native code holds the GIL).

A loop logging faster than MLflow can take (a SQLite store writes about 4000 values a second with a whole
core) is thinned as it logs, per set of metrics logged together (`Gate`): every value up to a burst, then at
most ``rate`` a second, evenly spread; a set's last value is always sent, and the count left out travels with
the batch. Thinning at the call keeps the queue to the values sent: a few attribute operations on the training
thread, no work per step for the reporter.

The reporter thread is also where the notebook's `channel.StopAt` arrives (it waits on the rank's connection
between its sends): it sets `Pulse.stop_at`, which the training thread checks after each counted step
(`Pulse.check_stop`, from ``ctx.step``): at that count it raises `errors.StopAtStep`, and every rank, given the
same count, stops after the same step.

`install_stack_dump`: ``faulthandler`` on `procfacts.STACK_SIGNAL` (and for fatal signals) with the rank's
stack file, whose first line names the training thread (`procfacts`).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable

from .. import procfacts
from ..channel import Message, Metrics, ModelFacts, StopAt, StopMissed
from ..channel import Pulse as PulseMessage
from ..errors import StopAtStep, log_dropped

METRICS_EVERY_S = 0.25
PULSE_EVERY_S = 0.5
BURST = 200  # values per set of metrics sent as they come before thinning starts (short runs keep every step)
RATE = 10.0  # values per set of metrics per second after the burst (env DTRAIN_MAGIC_METRIC_RATE): each costs
# the notebook 0.1-0.2 ms (MLflow's SQLite write), CPU the workers would miss on a small machine


class Gate:
    """One set of metrics logged together (``ctx.log(loss=..., lr=...)``'s keys): a token bucket of ``burst``
    values refilled at ``rate`` a second, on the training thread (which stamps each call anyway), so the values
    kept are evenly spread. The training thread holds the latest value it left out; the reporter sends it (so
    the last value always goes). Each attribute has one writer thread: no lock on the training thread."""

    __slots__ = ("tokens", "at", "held", "sent")

    def __init__(self, burst: float, now: float):
        self.tokens, self.at = burst, now
        self.held: tuple | None = None  # the latest value left out; None once a newer one was queued
        self.sent: tuple | None = None  # the held value the reporter sent last


def burst_for(rate: float, burst: int = BURST) -> float:
    """The bucket holds at least two flushes' worth at ``rate``: a higher rate is never capped by the burst."""
    return max(float(burst), 2 * METRICS_EVERY_S * rate)


def _metric_rate() -> float:
    try:
        return max(1.0, float(os.environ.get("DTRAIN_MAGIC_METRIC_RATE", RATE)))
    except ValueError:
        return RATE


class Pulse:
    """One rank's counters, metric queue and reporter thread. The training thread calls `step`, `log_call`
    (ranks other than 0), `record` (rank 0's ctx.log), and `batch`; `close` (before the result or the error is
    sent) sends what is left."""

    def __init__(self, rank: int, send: Callable[[Message], None], rate: float | None = None, burst: int = BURST,
                 reporter: bool = True, inbox: Any = None):
        """``rate``: values a second per set of metrics after the burst (default ``$DTRAIN_MAGIC_METRIC_RATE`` or
        `RATE`); ``reporter=False``: no thread (the caller flushes); ``inbox``: what the notebook writes to this
        rank (a `channel.WorkerLink`: ``fileno`` and ``receive``), read by the thread."""
        self.rank, self._send = rank, send
        self.stop_at: int | None = None  # the step count to stop after (`channel.StopAt`), set by the thread
        self._missed = False
        self._inbox = inbox if reporter else None
        self._wake = os.pipe() if self._inbox is not None else None  # `close` wakes the thread's wait through it
        self.steps = 0  # ctx.step / ctx.train_step calls
        self.log_calls = 0  # ctx.log calls (every rank counts them)
        self.samples = 0
        self.batch_tokens = 0  # from token-id inputs the prepared model saw
        self.logged_tokens = 0  # ``tokens`` values the function passed to ctx.log
        self.calls = 0  # anything at all that shows the training thread moved
        self._queue: deque = deque()  # the values to send (already thinned)
        self._rate = _metric_rate() if rate is None else rate
        self._burst = burst_for(self._rate, burst)
        self._gates: dict[tuple, Gate] = {}
        self._left_out = 0  # values not queued (the training thread); some are sent later as a gate's latest
        self._held_sent = self._left_out_told = 0  # (the reporter)
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one sender of metrics at a time (the thread, or close)
        self._thread = threading.Thread(target=self._loop, name="dtrain-pulse", daemon=True)
        if reporter:
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

    def record(self, step: int, values: dict[str, float]) -> None:
        """Rank 0's ``ctx.log``: count the call; queue the values if their set's bucket has a token, else hold
        them as the set's latest."""
        self.log_calls += 1
        self.calls += 1
        if "tokens" in values:
            self.logged_tokens += int(values["tokens"])
        now = time.time()
        entry = (step, values, int(now * 1000))
        keys = tuple(values)
        gate = self._gates.get(keys)
        if gate is None:
            gate = self._gates[keys] = Gate(self._burst, now)
        tokens = gate.tokens + (now - gate.at) * self._rate
        gate.at = now
        if tokens >= 1.0:
            gate.tokens = min(tokens, self._burst) - 1.0
            self._queue.append(entry)  # deque.append: safe against the reporter's popleft
            gate.held = None
        else:
            gate.tokens = tokens
            self._left_out += 1
            gate.held = entry

    def facts(self, facts: ModelFacts) -> None:
        self._send(facts)

    def check_stop(self) -> None:
        """After each counted step (``ctx.step``, ``ctx.train_step``; ``ctx.log`` in a loop without steps): raise
        `StopAtStep` at the count the notebook asked to stop after. A rank already past it (the request came late)
        says so once and goes on: the notebook then stops the run as Stop does."""
        target = self.stop_at
        if target is None:
            return
        done = self.steps or self.log_calls
        if done == target:
            raise StopAtStep(done)
        if done > target and not self._missed:
            self._missed = True
            self._send(StopMissed(self.rank, done, target))

    # -- the reporter ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_pulse = 0.0
        next_flush = time.monotonic() + METRICS_EVERY_S
        while not self._closed.is_set():
            self._wait(next_flush - time.monotonic())
            now = time.monotonic()
            if self._closed.is_set() or now < next_flush:
                continue  # closed (close sends the rest), or woken by the notebook's message before the next send
            next_flush = now + METRICS_EVERY_S
            try:
                self.flush_metrics()
                if now >= next_pulse:
                    self._send(self.message())
                    next_pulse = now + PULSE_EVERY_S
            except Exception as exc:  # the notebook went away: WorkerLink already stops sending
                log_dropped(__name__, "Pulse._loop", exc)

    def _wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less: until `close`, or until the notebook wrote to this rank (taken now:
        a `StopAt` must reach the training thread before it makes the step)."""
        timeout = max(0.0, timeout)
        if self._inbox is None or self._wake is None:
            self._closed.wait(timeout)
            return
        try:
            if self._inbox in wait([self._inbox, self._wake[0]], timeout):
                message = self._inbox.receive()
                if isinstance(message, StopAt):
                    self.stop_at = message.step
        except (EOFError, OSError) as exc:  # the notebook went away: nothing more comes; sleep as before
            log_dropped(__name__, "Pulse._wait", exc)
            self._inbox = None

    def message(self) -> PulseMessage:
        steps = self.steps or self.log_calls
        return PulseMessage(self.rank, steps, self.samples, self.logged_tokens or self.batch_tokens, self.calls,
                            time.process_time(), time.time())

    def flush_metrics(self) -> None:
        with self._lock:
            entries = [self._queue.popleft() for _ in range(len(self._queue))]
            held = False
            for gate in list(self._gates.values()):
                latest = gate.held
                if latest is not None and latest is not gate.sent:
                    gate.sent = latest
                    entries.append(latest)
                    self._held_sent += 1
                    held = True
            if held:
                entries.sort(key=_stamp)  # a held latest value after the queued values logged before it
            left_out = max(0, self._left_out - self._held_sent - self._left_out_told)
            self._left_out_told += left_out
            if entries or left_out:
                self._send(Metrics(self.rank, tuple(entries), left_out))

    def close(self) -> None:
        """Send what is queued and the last counters, and stop the thread (before the result or the error, so
        the notebook has every value when it has the result)."""
        self._closed.set()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread.ident is not None:
            self._thread.join(2.0)
        if self._wake is not None and not self._thread.is_alive():
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        self.flush_metrics()
        self._send(self.message())


def _stamp(entry: tuple) -> int:
    return entry[2]


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
