"""The preemption notice (``--preempt-grace S``): a SIGTERM to one rank makes every rank checkpoint at the same step.

A cloud announces a preemption with a SIGTERM and kills the machine S seconds later; a SIGTERM by default kills the
step in progress. Here a rank's SIGTERM only sets a flag (and arms a timer that ends the process after S seconds, the
grace the notice gives). The ranks agree on the step through a two-integer all-reduce (MAX) of that flag, started
without waiting at an optimizer step boundary (``ctx.step()`` returning True) about every 50 ms (every boundary of a
slow step; an interval rank 0 proposes inside the same all-reduce for fast ones) and read at the next such check,
where it has long completed: every rank runs the same sequence of these all-reduces, so every rank sees the flag at the
same boundary, checkpoints there (``ctx.save_checkpoint``) and leaves with `Preempted`; the launcher then restarts
the run from that checkpoint (``--max-restarts``). The all-reduce costs no wait on the training thread. With one rank
there is nothing to agree on: the flag is read directly. The local launcher's own SIGTERMs (a stop, an interrupt) are
told apart by a file it creates first (``$DTRAIN_MAGIC_STOP_FILE``): they end the worker at once. The Spark launcher
stops its ranks through their watchdogs (a SIGKILL); a notice a rank got from torchrun on the way changes nothing.

A backend that tells its workers of a preemption its own way gives a ``poll`` instead of the SIGTERM handler: on Ray,
Ray Train's preemption watcher marks every worker of a run when Ray drains one of its nodes (`_compat.ray.
preemption_noticed`); the flag is then this rank's SIGTERM or the poll's answer, agreed on the same way.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

CHECK_EVERY_S = 0.05  # how often the ranks check for a notice together (a tiny all-reduce: no cost to speak of)
MAX_INTERVAL = 1000  # boundaries between two checks at most
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: what a rank that checkpointed for a preemption notice exits with
# A file the launcher creates before it SIGTERMs its own workers (a stop, an interrupt, a restart's survivors): that
# SIGTERM is no notice, and ends the worker at once as it always did
STOP_FILE_ENV = "DTRAIN_MAGIC_STOP_FILE"
PREEMPTION_SOURCE = "SIGTERM"  # the notice where the backend has none of its own, in words


class Preempted(BaseException):
    """Raised by ``ctx.step()`` once every rank checkpointed for a preemption notice: the run stops here, to be
    restarted from that checkpoint. A BaseException, so a loop's ``except Exception`` does not swallow it."""


def all_preempted(reasons: list[str]) -> bool:
    """Do these reported failures (the ranks' error summaries) all say `Preempted`: every rank checkpointed for a
    notice, no rank failed?"""
    return bool(reasons) and all(reason.startswith(Preempted.__name__) for reason in reasons)


def checkpointed_words(source: str = PREEMPTION_SOURCE) -> str:
    """What a relaunch line says when every rank checkpointed for a notice (``source``: what the notice was)."""
    return f"every rank checkpointed for a preemption notice ({source})"


class PreemptionNotice:
    """This rank's SIGTERM flag and the ranks' agreement on it (see the module docstring)."""

    def __init__(self, grace_s: float, world_size: int, poll: Callable[[], bool] | None = None,
                 source: str = PREEMPTION_SOURCE):
        """``poll``: the backend's own notice, asked at each check (None: a SIGTERM handler, main thread only);
        ``source``: what the notice is, in the `Preempted` message."""
        self.grace_s = grace_s
        self.world_size = world_size
        self.source = source
        self._poll = poll
        self.noticed = False  # this rank got a SIGTERM (or the backend's notice)
        self._pending: Any = None  # (work, tensor) of the all-reduce started at the last check
        self._boundary = 0  # optimizer step boundaries so far (the same count on every rank)
        self._next_check = 1
        self._checked_at, self._checked_boundary = time.monotonic(), 0
        self._timer: threading.Timer | None = None
        self._device: str | None = None  # where the check's tensor lives (`check_device`), found at the first check
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm) if poll is None else None

    def _noticed(self) -> bool:
        if not self.noticed and self._poll is not None and self._poll():
            self.noticed = True
        return self.noticed

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if os.path.exists(os.environ.get(STOP_FILE_ENV) or "\0"):  # the launcher stopping the run: die as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.noticed:
            return
        self.noticed = True
        # The notice's grace: a rank that never reaches a step boundary (blocked, or not training) still ends.
        self._timer = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
        self._timer.daemon = True
        self._timer.start()

    def agreed(self) -> bool:
        """At an optimizer step boundary, on every rank: did any rank get the notice (as of the last check)?

        The ranks check together every ``interval`` boundaries, about every `CHECK_EVERY_S` seconds: rank 0 proposes
        the interval from its step time inside the check itself (the all-reduce is a MAX over ``[flag, proposal]``,
        the others proposing 0), so every rank counts the same boundaries to the next check."""
        if self.world_size <= 1:
            return self._noticed()
        self._boundary += 1
        if self._boundary < self._next_check:
            return False
        import torch
        import torch.distributed as dist

        seen, interval = False, 1
        if self._pending is not None:
            work, values = self._pending
            work.wait()
            seen, interval = bool(values[0].item()), max(1, int(values[1].item()))
        if self._device is None:  # (the process group's, fixed for the run)
            self._device = check_device(dist.get_backend())
        values = torch.tensor([1 if self._noticed() else 0, self._proposal()], dtype=torch.int64, device=self._device)
        self._pending = (dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True), values)
        self._next_check = self._boundary + interval
        return seen

    def _proposal(self) -> int:
        """Rank 0's boundaries to the next check: about `CHECK_EVERY_S` of its steps (others: 0, MAX keeps 0's)."""
        import torch.distributed as dist

        now = time.monotonic()
        elapsed, boundaries = now - self._checked_at, self._boundary - self._checked_boundary
        self._checked_at, self._checked_boundary = now, self._boundary
        if dist.get_rank() != 0 or elapsed <= 0 or boundaries <= 0:
            return 0
        return max(1, min(MAX_INTERVAL, int(CHECK_EVERY_S * boundaries / elapsed)))

    def close(self) -> None:
        """Put the previous SIGTERM handler back and disarm the timer (the checkpoint is written)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._poll is not None:
            return
        try:
            signal.signal(signal.SIGTERM, self._previous)
        except (ValueError, TypeError):  # not the main thread, or a handler Python did not install: leave ours
            pass


def check_device(process_group_backend: str) -> str:
    """Where the check's tensor lives: on the GPU under an NCCL-only process group (NCCL has no CPU tensors; the
    local backend's and Ray Train's ``--gpu`` groups), else on the CPU (gloo, or ``cpu:gloo,cuda:nccl``)."""
    if process_group_backend == "nccl":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def install(config: Any, world_size: int, backend_notice: bool, poll: Callable[[], bool] | None = None,
            source: str = PREEMPTION_SOURCE) -> PreemptionNotice | None:
    """The rank's notice when the backend acts on one and ``--preempt-grace`` is not 0: a SIGTERM handler (main
    thread only), or the backend's ``poll`` (any thread)."""
    if not backend_notice or not config.preempt_grace:
        return None
    if poll is None and threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set there
    return PreemptionNotice(float(config.preempt_grace), world_size, poll, source)
