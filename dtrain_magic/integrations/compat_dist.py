"""Run code that sets up ``torch.distributed`` itself (written for ``TorchDistributor.run`` or torchrun).

The worker joins the run's process group before it calls the user's function (every backend, and Ray
Train, need that). A function written for TorchDistributor calls ``dist.init_process_group("gloo")``
itself and ends with ``dist.destroy_process_group()``; unchanged, the first call fails with "trying to
initialize the default process group twice!". During the user's call this module replaces both:

- ``init_process_group(...)`` while the run's group exists **adopts** it: nothing is created (so the
  local backend's private FileStore rendezvous stays the only one, and no TCPStore listens on
  MASTER_PORT), provided the request is compatible: the backend ("gloo", "nccl", ``Backend.GLOO``,
  "cpu:gloo,cuda:nccl", or none), and ``rank``/``world_size`` if given, must match this process's.
  ``init_method``, ``store``, ``timeout``, ``device_id``, ``group_name`` and ``pg_options`` are
  accepted and ignored (the run's group is already set up). An incompatible request, such as "nccl"
  on a machine without CUDA, is a short `UnsupportedCodeError` naming what to change.
- ``destroy_process_group()`` of the default group is **deferred** to the worker's own teardown (the
  magic still needs the group to send results); destroying a sub-group is passed through.

The rank variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK) are
filled in where the backend has not set them; MASTER_ADDR/MASTER_PORT come from the launchers.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnsupportedCodeError

_KNOWN_BACKENDS = ("gloo", "nccl")


def requested_backends(backend: Any) -> set[str]:
    """The torch.distributed backends a ``backend=`` argument asks for (lower case); empty for none.

    Accepts what torch accepts: None, "gloo", "nccl", ``dist.Backend.GLOO`` (a str subclass) and the
    per-device form "cpu:gloo,cuda:nccl".
    """
    if backend is None:
        return set()
    text = str(backend).strip().lower()
    if text in ("", "undefined"):
        return set()
    names = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        names.add(part.split(":", 1)[1].strip() if ":" in part else part)
    return names


def check_request(
    backend: Any,
    *,
    current_backend: str,
    cuda_available: bool,
    rank: int,
    world_size: int,
    requested_rank: int | None = None,
    requested_world_size: int | None = None,
) -> None:
    """Raise `UnsupportedCodeError` unless an ``init_process_group`` call can adopt the run's group.

    ``current_backend``: the run's group's backend as ``dist.get_backend()`` reports it ("gloo",
    "nccl", or a per-device string). Pure logic, unit-tested.
    """
    wanted = requested_backends(backend)
    have = requested_backends(current_backend)
    shown = f"init_process_group(backend={str(backend)!r})" if backend is not None else "init_process_group()"
    unknown = sorted(wanted - set(_KNOWN_BACKENDS))
    if unknown:
        raise UnsupportedCodeError(
            f"{shown}: the backend {unknown[0]!r} is not available in %%distribute runs; "
            "use 'gloo' (CPU) or 'nccl' (GPU, with --gpu), or leave the backend out"
        )
    if "nccl" in wanted and not cuda_available:
        raise UnsupportedCodeError(
            f"{shown}: NCCL needs CUDA GPUs and this worker has none (the run's process group is "
            f"{current_backend} on CPU). Use backend='gloo' (or leave it out), or run with --gpu on "
            "machines with GPUs"
        )
    if "nccl" in wanted and "nccl" not in have:
        raise UnsupportedCodeError(
            f"{shown}: this run's process group is {current_backend} (--cpu); run with --gpu for NCCL, "
            "or use backend='gloo'"
        )
    if "gloo" in wanted and "gloo" not in have:
        raise UnsupportedCodeError(
            f"{shown}: this run's process group is {current_backend} (--gpu); use backend='nccl' "
            "(or leave it out), or run with --cpu for gloo"
        )
    if requested_rank is not None and requested_rank >= 0 and int(requested_rank) != rank:
        raise UnsupportedCodeError(
            f"init_process_group(rank={requested_rank}): this process is rank {rank}; read the rank from "
            "os.environ['RANK'] (as torchrun sets it) or leave rank= out"
        )
    if requested_world_size is not None and requested_world_size >= 0 and int(requested_world_size) != world_size:
        raise UnsupportedCodeError(
            f"init_process_group(world_size={requested_world_size}): this run has {world_size} processes "
            f"(-n {world_size}); read it from os.environ['WORLD_SIZE'] or leave world_size= out"
        )


def set_rank_environment(rank: int, local_rank: int, world_size: int, local_world_size: int) -> None:
    """What torchrun gives every process, where the backend has not set it already."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_world_size))
    os.environ.setdefault("GROUP_RANK", str(rank // max(1, local_world_size)))


class _Adoption:
    """The installed replacements and what they replaced."""

    def __init__(self, rank: int, world_size: int):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.rank, self.world_size = rank, world_size
        self.real_init = c10d.init_process_group
        self.real_destroy = c10d.destroy_process_group
        self.destroy_requested = False
        self.adopted = 0
        self._modules = (dist, c10d)

        def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                               world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                               pg_options: Any = None, device_id: Any = None, **extra: Any) -> None:
            """torch.distributed.init_process_group, adopting the run's group (see this module's docstring)."""
            if not dist.is_initialized():  # the user destroyed it for real (cannot happen here) or never had one
                return self.real_init(
                    backend=backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank,
                    store=store, group_name=group_name, pg_options=pg_options, device_id=device_id, **extra,
                )
            import torch

            check_request(
                backend, current_backend=str(dist.get_backend()), cuda_available=torch.cuda.is_available(),
                rank=dist.get_rank(), world_size=dist.get_world_size(), requested_rank=rank,
                requested_world_size=world_size,
            )
            if device_id is not None and getattr(device_id, "type", None) == "cuda" and not torch.cuda.is_available():
                raise UnsupportedCodeError(
                    f"init_process_group(device_id={device_id}): this worker has no CUDA device; drop device_id or "
                    "run with --gpu"
                )
            self.adopted += 1
            self.destroy_requested = False

        def destroy_process_group(group: Any = None) -> None:
            """torch.distributed.destroy_process_group; the run's default group is destroyed by the worker."""
            if group is None or group is dist.GroupMember.WORLD:
                self.destroy_requested = True
                return None
            return self.real_destroy(group)

        self.init, self.destroy = init_process_group, destroy_process_group
        for module in self._modules:
            module.init_process_group = init_process_group
            module.destroy_process_group = destroy_process_group

    def restore(self) -> None:
        for module in self._modules:
            if module.init_process_group is self.init:
                module.init_process_group = self.real_init
            if module.destroy_process_group is self.destroy:
                module.destroy_process_group = self.real_destroy


_current: _Adoption | None = None


def adopt(rank: int, local_rank: int, world_size: int, local_world_size: int) -> None:
    """Install the replacements (call once the run's group exists, before the user's function is
    unpickled: ``from torch.distributed import init_process_group`` in the cell resolves to them)."""
    global _current
    set_rank_environment(rank, local_rank, world_size, local_world_size)
    if _current is None:
        _current = _Adoption(rank, world_size)


def restore() -> None:
    """Put torch's own functions back (before the worker destroys the group itself). Idempotent."""
    global _current
    if _current is not None:
        _current.restore()
        _current = None
