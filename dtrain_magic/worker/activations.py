"""The activations one micro-batch holds, measured from a sample batch (``ctx.prepare(..., sample=batch)``) without
memory or compute: one forward of the model on torch's meta device (`torch.func.functional_call` with a meta
tensor of the full shape for every parameter and buffer, the sample on meta too), counting what autograd saves for
the backward with `torch.autograd.graph.saved_tensors_hooks`.

Each saved tensor is counted once (by its storage), parameters not at all (they are the model states), and each is
attributed to the block (`blocks.find_blocks`, as ``--ac`` finds them) whose forward saved it, with each block's
input. From that one forward every ``--ac`` mode follows (`blocks.checkpointed` picks the blocks): a checkpointed
block keeps its input instead of what it saved, and its activations come back one block at a time in the backward.
Not counted: the loss function's own, the output, temporaries freed inside an operation, and autocast (the forward
runs in the parameters' dtype: under ``--precision bf16/fp16`` activations are about half of it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._compat import deepspeed as deepspeed_compat
from ..errors import ConfigError
from ..strategies.memory import AC_MODES, Activations
from .blocks import checkpointed, find_blocks


def measure(model: nn.Module, sample: Any, ac_module: str | None = None) -> Activations:
    """`Activations` of ``model`` for ``sample`` (a tensor, a tuple of positional arguments or a dict of keyword
    arguments, as ``ctx.train_step`` takes; its first tensor's first dimension is the micro-batch). ``model``: plain,
    on meta (deferred) or ZeRO-3 partitioned; it is not run, changed or moved."""
    rows = _rows(sample)
    try:
        blocks = find_blocks(model, ac_module)
    except ConfigError:  # no repeated block: --ac has nothing to checkpoint, every mode keeps the same
        blocks = []
    saved, inputs = _saved_on_meta(model, sample, blocks)
    kept, recomputed = {}, {}
    for mode in AC_MODES:
        chosen = {id(b) for b in checkpointed(blocks, mode)}
        held = [i for i, b in enumerate(blocks) if id(b) in chosen]
        keep = {key: size for key, (size, owner) in saved.items() if owner not in held}
        for i in held:
            keep.update(inputs[i])
        own = [sum(size for key, (size, owner) in saved.items() if owner == i and key not in keep) for i in held]
        kept[mode], recomputed[mode] = float(sum(keep.values())), float(max(own, default=0))
    return Activations(rows, kept, recomputed, len(blocks))


def _saved_on_meta(model: nn.Module, sample: Any, blocks: list[nn.Module]) -> tuple[dict, list[dict]]:
    """One forward on meta: each saved storage's (bytes, the index of the block that saved it first, or None), and
    each block's input storages and their bytes."""
    params = dict(model.named_parameters())
    meta = {name: _on_meta(t) for name, t in [*params.items(), *model.named_buffers()]}
    param_keys = {_key(meta[name]) for name in params}
    saved: dict[int, tuple[int, int | None]] = {}
    inputs: list[dict[int, int]] = [{} for _ in blocks]
    current: list[int | None] = [None]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if _key(tensor) not in param_keys:  # a parameter (or a view of one) is a model state, not an activation
            saved.setdefault(_key(tensor), (_nbytes(tensor), current[0]))
        return tensor

    def enter(index: int) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            current[0] = index
            inputs[index].update({_key(t): _nbytes(t) for t in _tensors((args, kwargs))})
        return hook

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        current[0] = None

    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(enter(i), with_kwargs=True),
                                                         b.register_forward_hook(leave))]
    args, kwargs = _call_args(tree_map(lambda x: _on_meta(x) if isinstance(x, torch.Tensor) else x, sample))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            torch.func.functional_call(model, meta, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return saved, inputs


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    shape = deepspeed_compat.full_shape(tensor) or tuple(tensor.shape)  # a ZeRO-3 partition: its whole shape
    return torch.empty(shape, dtype=tensor.dtype, device="meta").requires_grad_(tensor.requires_grad)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # views share it: a tensor saved as a view is counted once


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else tensor.numel() * tensor.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


def _call_args(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, dict):
        return (), dict(sample)
    return (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), {}


def _rows(sample: Any) -> int:
    tensors = _tensors(sample)
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("ctx.prepare(sample=...): the sample batch must hold a tensor whose first dimension is its "
                         f"rows (a tensor, a tuple or a dict of them); got {type(sample).__name__}")
    return int(tensors[0].shape[0])
