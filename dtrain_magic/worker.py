"""What runs in every worker process, whichever backend started it.

``run_worker`` connects to the notebook's channel, sends its Python-level output there line by line,
joins (or reuses) the torch.distributed process group, builds the strategy and the `TrainContext`,
calls the user's function and sends back its result or its error (with a traceback trimmed to the
user's frames and labelled with the notebook's cell numbers). `run_job_file` is what the local
launcher's forked workers run; the Spark and Ray launchers call `run_worker` directly.
"""

from __future__ import annotations

import datetime
import io
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from . import integrations
from .capture import Payload
from .channel import ChannelAddress, Error, Hello, Output, Result, Status, WorkerLink
from .config import RunConfig
from .tracebacks import short_traceback, summary


@dataclass(frozen=True)
class WorkerJob:
    """Everything one run's workers need; pickled once and handed to every worker by the launcher."""

    payload: Payload
    config: RunConfig
    channel: ChannelAddress
    run_id: str | None = None
    checkpoint_root: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1


def rank_from_env() -> RankInfo:
    """Ranks as set by torchrun, TorchDistributor or the local launcher."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return RankInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


class _ChannelStream(io.TextIOBase):
    """A text stream that sends each complete line to the notebook, tagged with rank and stream name."""

    def __init__(self, link: WorkerLink, rank: int, name: str):
        self._link, self._rank, self._name, self._buffer = link, rank, name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buffer += text
        if "\n" in self._buffer:
            complete, _, self._buffer = self._buffer.rpartition("\n")
            self._link.send(Output(self._rank, self._name, complete + "\n"))
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self._link.send(Output(self._rank, self._name, self._buffer))
            self._buffer = ""

    def isatty(self) -> bool:
        return False


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


def _device(config: RunConfig, local_rank: int):
    return _device_for(config.use_gpu, local_rank)


def _device_for(use_gpu: bool, local_rank: int):
    import torch

    if use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("--gpu was given but CUDA is not available on this worker; use --cpu")
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _ensure_process_group(config: RunConfig, ranks: RankInfo) -> bool:
    """Join the process group unless the backend (Ray Train, a standby's waiting function) already did. True
    if we created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    _init_process_group(config.use_gpu, ranks, config.timeout)
    return True


def _init_process_group(use_gpu: bool, ranks: RankInfo, timeout: float | None = None) -> None:
    import torch.distributed as dist

    backend = "nccl" if use_gpu else "gloo"
    kwargs: dict[str, Any] = {}
    if timeout:
        kwargs["timeout"] = datetime.timedelta(seconds=max(timeout, 30))
    # The local launcher rendezvouses through a file in its private run directory (no TCPStore, which
    # listens on every interface); torchrun-based backends use the env:// variables they set.
    init_method = os.environ.get("DTRAIN_INIT_METHOD", "env://")
    dist.init_process_group(backend, init_method=init_method, rank=ranks.rank, world_size=ranks.world_size, **kwargs)


def join_process_group_ahead(use_gpu: bool) -> None:
    """For a worker that waits for its job (a standby's, on torchrun): join the process group now, with the
    ranks torchrun set, as `run_worker` would (its device first, then a barrier, so every peer is connected).
    `run_worker` then finds the group joined, as on Ray Train, and leaves it alone: `leave_process_group`
    after it. Its timeout is torch's default (the run's ``--timeout`` is not known yet; the notebook stops a
    run that outlives ``--timeout`` anyway)."""
    ranks = rank_from_env()
    device = _device_for(use_gpu, ranks.local_rank)
    _init_process_group(use_gpu, ranks)
    _barrier(device)


def leave_process_group(use_gpu: bool, finished: bool) -> None:
    """After `run_worker` on a group joined by `join_process_group_ahead`: when the run ``finished`` on this
    rank, leave together (a barrier, as `run_worker` does for the group it joins itself); then destroy it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if finished:
        try:
            _barrier(_device_for(use_gpu, rank_from_env().local_rank))
        except Exception:
            pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _barrier(device: Any) -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def run_worker(job: WorkerJob, ranks: RankInfo | None = None, checkpoints: Any = None) -> Any:
    """Run the user's function on this rank; returns its value, raises its exception after reporting it.

    ``checkpoints``: a backend's own checkpoint store for ``ctx`` (Ray Train's); default: plain files
    under ``job.checkpoint_root``.
    """
    import torch.distributed as dist

    from .context import TrainContext
    from .strategies import get_strategy

    ranks = ranks or rank_from_env()
    for key, value in job.env.items():
        os.environ.setdefault(key, value)
    link = WorkerLink(job.channel, ranks.rank)
    link.send(Hello(ranks.rank, os.getpid(), socket.gethostname()))
    streams = sys.stdout, sys.stderr
    sys.stdout = _ChannelStream(link, ranks.rank, "stdout")
    sys.stderr = _ChannelStream(link, ranks.rank, "stderr")
    strategy = None
    owns_group = False
    try:
        owns_group = _ensure_process_group(job.config, ranks)
        device = _device(job.config, ranks.local_rank)
        if owns_group:
            # init_process_group has no barrier of its own: without one, a rank whose function needs no
            # collective could finish and exit while a slower peer is still connecting to it.
            _barrier(device)
        if job.config.seed is not None:
            _seed_everything(job.config.seed)
        strategy = get_strategy(job.config.strategy)(
            job.config, ranks.rank, ranks.local_rank, ranks.world_size, device
        )
        from .checkpoints import checkpoint_store

        ctx = TrainContext(
            job.config, strategy, ranks.rank, ranks.local_rank, ranks.world_size, device,
            send=link.send,
            checkpoint_store=checkpoints if checkpoints is not None else checkpoint_store(job.checkpoint_root),
        )
        # Existing code runs unchanged: its own init/destroy_process_group adopt the run's group, and
        # Hugging Face / Ray Train metrics reach the run (dtrain_magic/integrations). Before the load:
        # names the cell imported (init_process_group, ray.train.report) resolve to the adapted ones.
        integrations.install(job.config, ctx, job.config.backend)
        fn = job.payload.load()
        link.send(Status(ranks.rank, "running", ""))
        value = fn(ctx) if job.payload.takes_ctx else fn()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            data = cloudpickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the function's return value ({type(value).__name__}) cannot be pickled to send it back: {exc}. "
                "Return plain Python data (lists, dicts, numbers) or tensors"
            ) from None
        link.send(Result(ranks.rank, data))
        link.send(Status(ranks.rank, "done", ""))
        if owns_group:
            # Leave together: a rank that finished its last collective first (a broadcast's sender) must
            # not close its connections while a peer is still reading from them. A peer that failed makes
            # the notebook stop this worker; its result is already sent.
            try:
                _barrier(device)
            except Exception:
                pass
        return value
    except BaseException as exc:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        link.send(Error(ranks.rank, summary(exc), short_traceback(exc, job.payload.labels), time.time()))
        link.send(Status(ranks.rank, "failed", summary(exc)))
        raise
    finally:
        sys.stdout, sys.stderr = streams
        integrations.uninstall()  # torch's own destroy_process_group again, for the teardown below
        if strategy is not None:
            try:
                strategy.teardown()
            except Exception:
                pass
        if owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        link.close()


def preload(strategies: tuple[str, ...] = ("ddp",)) -> None:
    """Import what a worker needs before its job comes, so the job does not pay it: torch, torch.distributed,
    this package's worker side, DDP's first-use imports (torch._dynamo, sympy: about 1 s on 2 cores) and the
    modules of ``strategies``. Imports only: no tensor op (a fork server forks after this: OpenMP's thread pool
    must not exist yet), no process group. Not DeepSpeed itself: imported inside the run, its logger writes to
    the run's channel (imported before, it would write to the process's own stdout)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    from . import context  # noqa: F401
    from ._compat import torch as torch_compat
    from .strategies import get_strategy

    torch_compat.preload_compiler()
    for name in strategies:
        try:
            get_strategy(name)
        except Exception:  # an optional speed-up only: the job imports it and reports what goes wrong
            pass


def run_job_file(path: str) -> int:
    """Run the pickled `WorkerJob` at ``path`` on this process's rank (from the environment); the exit code.

    What a local worker runs (forked by the local launcher's fork server, which then leaves with
    ``os._exit``: no interpreter teardown that could hang on a peer that is gone)."""
    with open(path, "rb") as handle:
        job: WorkerJob = cloudpickle.load(handle)
    try:
        run_worker(job)
    except BaseException:
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dtrain_magic.worker JOB_FILE``: one worker by hand (the launchers do not use this)."""
    argv = sys.argv[1:] if argv is None else argv
    code = run_job_file(argv[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
