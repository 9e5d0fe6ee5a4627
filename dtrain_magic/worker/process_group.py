"""The worker's device and its torch.distributed process group: join (or adopt), barrier, leave."""

from __future__ import annotations

import datetime
import os
from typing import Any

from ..errors import log_dropped
from .job import RankInfo, rank_from_env


def device_for(use_gpu: bool, local_rank: int):
    import torch

    if use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("--gpu was given but CUDA is not available on this worker; use --cpu")
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def ensure_process_group(backend: str, ranks: RankInfo, timeout: float | None) -> bool:
    """Join the process group unless the backend (Ray Train, a standby's waiting function) already did. True
    if we created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    init_process_group(backend, ranks, timeout)
    return True


def init_process_group(backend: str, ranks: RankInfo, timeout: float | None = None) -> None:
    """Join the group with ``backend`` (the strategy's choice: `RunConfig.process_group_backend`)."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout:
        kwargs["timeout"] = datetime.timedelta(seconds=max(timeout, 30))
    # The local launcher rendezvouses through a file in its private run directory (no TCPStore, which
    # listens on every interface); torchrun-based backends use the env:// variables they set.
    init_method = os.environ.get("DTRAIN_INIT_METHOD", "env://")
    dist.init_process_group(backend, init_method=init_method, rank=ranks.rank, world_size=ranks.world_size, **kwargs)


def join_process_group_ahead(backend: str, use_gpu: bool) -> None:
    """For a worker that waits for its job (a standby's, on torchrun): join the process group now, with the
    ranks torchrun set, as `run_worker` would (its device first, then a barrier, so every peer is connected).
    `run_worker` then finds the group joined, as on Ray Train, and leaves it alone: `leave_process_group`
    after it. Its timeout is torch's default (the run's ``--timeout`` is not known yet; the notebook stops a
    run that outlives ``--timeout`` anyway)."""
    ranks = rank_from_env()
    device = device_for(use_gpu, ranks.local_rank)
    init_process_group(backend, ranks)
    barrier(device)


def leave_process_group(use_gpu: bool, finished: bool) -> None:
    """After `run_worker` on a group joined by `join_process_group_ahead`: when the run ``finished`` on this
    rank, leave together (a barrier, as `run_worker` does for the group it joins itself); then destroy it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if finished:
        try:
            barrier(device_for(use_gpu, rank_from_env().local_rank))
        except Exception as exc:  # a peer gone breaks the barrier with any backend's error: leave anyway
            log_dropped(__name__, "leave_process_group", exc)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # peers gone: any error here; the process ends anyway
        log_dropped(__name__, "leave_process_group", exc)


def barrier(device: Any) -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
