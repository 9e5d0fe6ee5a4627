"""The `Launcher` interface: how a backend starts N workers that each call ``run_worker``.

A launcher knows nothing of strategies. It gets a `WorkerJob` (the pickled function, the config, the
channel address) and must start ``config.num_processes`` workers that call
``dtrain_magic.worker.run_worker(job, ranks)`` with torch.distributed rendezvous information in their
environment (or a process group already joined). Results, errors, output and metrics come back over
the channel, never through the backend's own return value, so every backend behaves the same.
"""

from __future__ import annotations

import os
import signal
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from ..backends import Backend
from ..channel import Message
from ..config import RunConfig
from ..worker import WorkerJob

# Variables read once, when torch and numpy load (thread pools, preloaded libraries, hashing): a process that
# imported them ahead of its job (the local fork server, a standby's workers) was started with the values of
# that time, so a change in the notebook's value means new processes. (Not every TORCH_* variable: most are
# read when used, and launchers such as torch elastic set some in the calling process.)
IMPORT_TIME_ENV = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED")


def import_time_environment(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The notebook's variables that torch and numpy read when they are imported, sorted."""
    environ = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in environ.items() if k.startswith(IMPORT_TIME_ENV)))


def loopback_interface() -> str:
    """This machine's loopback interface name (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    try:
        return next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    except (OSError, StopIteration):
        return "lo"


# A launcher reports what only it can see (process output written below Python) with this: a channel
# `Message` (`channel.Output`), handed to the run's channel as if a worker had sent it.
Emit = Callable[[Message], None]


def describe_exit(code: int) -> str:
    """A worker process's exit status in words (``code`` as `subprocess.Popen.returncode`: negative for a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process was killed by {name}"
    return f"process exited with code {code}"


@dataclass
class Failure:
    """A worker that died without reporting an error itself (killed, crashed in C, backend error)."""

    rank: int | None
    reason: str
    detail: str = ""


@dataclass
class LaunchState:
    """What `RunningJob.poll` sees: finished or not, and failures the launcher observed."""

    finished: bool
    failures: list[Failure] = field(default_factory=list)
    # False while the backend may still restart failed workers (Ray's FailureConfig, torch elastic): the
    # runner then waits for ``finished`` instead of cancelling the run after the first worker error.
    errors_final: bool = True
    # True once, on the poll right after the launcher restarted every worker itself (local --max-restarts):
    # the runner forgets the failed attempt's results and errors.
    restarted: bool = False
    # With ``restarted``: the new attempt's number of workers (it may differ under ``--elastic``); None: unknown.
    world_size: int | None = None
    # With ``restarted``: what was restarted and why, in the launcher's words (the MLflow run keeps it as a tag).
    restart_note: str = ""


class RunningJob(ABC):
    """A started run: poll it until finished, cancel it on error, interrupt or timeout."""

    #: True if the run may return as soon as every rank has sent its result, before the worker
    #: processes have exited (their interpreter teardown is seconds); `release` then reaps them.
    early_release: bool = False

    def release(self) -> None:
        """After an early return: make sure every worker ends and nothing is left. Default: cancel."""
        self.cancel()

    @abstractmethod
    def poll(self) -> LaunchState:
        """Non-blocking: has every worker ended, and did any fail in a way only the launcher sees?"""

    @abstractmethod
    def cancel(self) -> None:
        """Stop every worker now and release what the run holds (processes, jobs, ports). Idempotent."""

    def worker_failed(self, rank: int | None, summary: str) -> None:
        """A rank reported an error over the channel (the pump tells every job): a backend whose workers end
        cleanly after their function raised (TorchDistributor's, Spark) restarts on it under ``--max-restarts``.
        Default: nothing (the launcher sees the failure itself, as an exit code)."""

    def dump_stacks(self, workers: Mapping[int, Any], timeout: float) -> dict[int, tuple[str, str]]:
        """The Python stacks of ``workers`` (rank → `driver.stacks.Worker`) that this backend reaches its own way,
        rank → (state, dump), within about ``timeout``: the ranks the notebook cannot signal itself (another
        machine). Default: none (the notebook signals the ranks on its own machine)."""
        return {}


class StandbyClaim(Protocol):
    """Workers launched ahead, reserved for one run (`standby.Claim` is the one implementation)."""

    checkpoint_root: str

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        """Send the run's job to the waiting workers; the run's `RunningJob`."""

    def abandon(self) -> None:
        """Give the workers back (the run stopped before its launch): they wait for the next run."""


class Launcher(Backend, ABC):
    """One backend: how it starts a run's workers. Its facts (name, own fields, capabilities, `validate`, `in_use`)
    are its `dtrain_magic.backends.Backend` class, which a subclass inherits (``class RayLauncher(Ray, Launcher)``).

    Subclasses are found through `dtrain_magic.registry.BACKENDS` (one line there, naming both classes).
    """

    def check(self, config: RunConfig) -> None:
        """Validate in the notebook, before any MLflow run or process exists (deps, resources)."""

    def warm_up(self, config: RunConfig) -> None:
        """Called after `check`, while the MLflow run opens in the background: start what the workers
        need before the run exists (interpreters importing torch, a Ray connection), so a cold run pays
        the MLflow start and the backend's start side by side, not one after the other. Default: nothing."""

    def starts_before_tracking(self, config: RunConfig) -> bool:
        """May the workers start before the MLflow run exists (they never read ``WorkerJob.run_id``)? The
        runner then opens the run once they are past their start instead of before it. Default: no."""
        return False

    def channel_host(self, config: RunConfig) -> str:
        """The address the notebook's channel listens on: loopback unless workers are on other hosts."""
        return "127.0.0.1"

    def workers_share_files(self, config: RunConfig) -> bool:
        """Do the workers read this machine's files (a ``--data`` source written once to a temp dir here)? Asked
        before launch, after `check`; starts nothing. Default: yes (every worker on this machine)."""
        return True

    @abstractmethod
    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        """Start the workers and return at once."""

    def claim_standby(self, config: RunConfig, reuse: bool = False) -> "StandbyClaim | None":
        """A launch started ahead for a run with ``config``'s placement (a standby, docs/warm-reruns.md), now
        reserved for the caller's run; None when there is none. The runner names the run after it
        (`Claim.checkpoint_root`) and starts it with `Claim.start` instead of `start`, or gives it back
        (`Claim.abandon`). ``reuse``: a sweep's trial, which may also take workers an earlier trial ran on (a
        spare, `StandbySlot.spares`); any other run gets fresh processes. Default: this backend launches nothing
        ahead."""
        return None

    def keep_warm(self, config: RunConfig) -> str | None:
        """After a run with ``config`` (and ahead of a kernel's first run, once the checks passed): make sure the
        next run's workers with its placement are launched and wait for it, for as long as ``--keep-warm`` and
        the backend's default allow. Returns quickly (the launch goes on in the background); one line for the
        cell saying what waits where until when, or None when nothing is held. Default: nothing."""
        return None

    def release_reused(self, reason: str) -> int:
        """Release the workers a sweep's trials reused (`standby.StandbySlot.spares`): the sweep ended, later runs get
        fresh ones. How many launches were released. Default: none (fresh workers per run)."""
        return 0

    def release_standby(self, reason: str) -> str | None:
        """Release the workers `keep_warm` holds (``%distribute_release``) and wait until they are gone; what was
        released, or None when nothing was held."""
        return None

    def capacity(self, config: RunConfig) -> tuple[str, int] | None:
        """What a run with ``config`` takes its workers from, when that is limited and known now: (the pool in words,
        how many workers it holds in all), such as ("CPUs of the local Ray instance", 4). An interactive session
        (`dtrain_magic.session`) asks it whether a run fits beside the ranks it holds. Default: None (not limited
        by the backend, such as processes on this machine, or not known)."""
        return None

    def describe(self, config: RunConfig) -> str:
        """One line for ``--dry-run`` and the panel: what would be started where."""
        return f"{config.num_processes} worker(s) via {self.name}"

    def shutdown(self, at_exit: bool = False) -> None:
        """Stop what this launcher keeps between runs (a fork server, a Ray instance, a SparkSession it
        started); a later run starts it again. ``at_exit``: the kernel is exiting (`dtrain_magic.state`
        calls this once for every launcher). Default: nothing kept."""
