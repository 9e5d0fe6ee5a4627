"""Model state across the mesh: the same start on every rank, the optimizer pointed at the sharded parameters,
gradients averaged over model replicas, and the whole model gathered back from its shards and stages."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

AVERAGE_CHUNK_ELEMENTS = 1 << 22  # elements per flat buffer a collective runs on (16 MiB in fp32)


def _flat_groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors of one dtype together, in chunks of at most `AVERAGE_CHUNK_ELEMENTS` (a bigger tensor alone)."""
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    filled: dict[torch.dtype, int] = {}
    for tensor in tensors:
        chunks = by_dtype.setdefault(tensor.dtype, [[]])
        if chunks[-1] and filled.get(tensor.dtype, 0) + tensor.numel() > AVERAGE_CHUNK_ELEMENTS:
            chunks.append([])
            filled[tensor.dtype] = 0
        chunks[-1].append(tensor)
        filled[tensor.dtype] = filled.get(tensor.dtype, 0) + tensor.numel()
    return [chunk for chunks in by_dtype.values() for chunk in chunks if chunk]


def _coalesced(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Run ``collective`` on flat buffers of a few tensors each and copy the result back: few messages, and at most
    one chunk's extra memory rather than a second copy of them all."""
    for group in _flat_groups(tensors):
        if len(group) == 1 and group[0].is_contiguous():
            collective(group[0].view(-1))  # in place, no copy
            continue
        flat = torch.cat([t.reshape(-1) for t in group])
        collective(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Every rank takes global rank 0's parameters and buffers (as DDP does at construction): the replicated parts
    of a tensor-parallel model and the stages built on different ranks then start from the same model."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t.data for t in list(module.parameters()) + list(module.buffers())]
    _coalesced(tensors, lambda flat: dist.broadcast(flat, src=0))


@torch.no_grad()
def average_gradients(module: nn.Module, group: Any, size: int) -> None:
    """Average the gradients of ``module``'s parameters over the data-parallel ``group`` (this rank's shard of a
    tensor-parallel parameter: the same shard on every replica)."""
    if size <= 1:
        return
    from torch.distributed.tensor import DTensor

    grads = []
    for param in module.parameters():
        if param.grad is not None:
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)

    def reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat.div_(size)

    _coalesced(grads, reduce)


def repoint_optimizer(optimizer: torch.optim.Optimizer | None, old_names: Mapping[int, str], model: nn.Module,
                      renames: Mapping[str, Sequence[str]] | None = None, strategy: str = "") -> None:
    """Point ``optimizer`` (made on the plain model) at ``model``'s new parameters by name, in place: sharded
    (DTensor) ones, the parts a plan split a parameter into (``renames``), and only those of this pipeline stage.
    Hyper-parameters and param groups are kept; the (still empty) state is cleared."""
    if optimizer is None:
        return
    renames = renames or {}
    new = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        params: list[torch.Tensor] = []
        for param in group["params"]:
            name = old_names.get(id(param))
            if name is None:
                raise ValueError(
                    f"{strategy}: the optimizer holds parameters that are not the model's; "
                    "create it from model.parameters() before ctx.prepare"
                )
            for new_name in renames.get(name, [name]):
                if new_name in new:  # absent: it lives in another pipeline stage
                    params.append(new[new_name])
        group["params"] = list(dict.fromkeys(params))  # tied parameters once
    optimizer.state.clear()


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """Gathering FSDP x TP shards makes DTensor warn, on every rank, that two all-gathers are "suboptimal";
    for a one-off full state dict that is expected, and the warning would flood the cell."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def gather_full_state(module: nn.Module, pp_group: Any = None,
                      to_plain: Sequence[Callable[[dict], dict]] = ()) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank (a collective): tensor-parallel and FSDP shards gathered, the
    pipeline stages' parts merged (they keep the whole model's names), then turned back into the plain model's
    layout by ``to_plain``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with _quiet_redistribute():
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    state = {key: value.detach().cpu().clone() for key, value in state.items()}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, state, group=pp_group)
        state = {}
        for part in parts:
            state.update(part)
    for convert in to_plain:
        state = convert(state)
    return state
