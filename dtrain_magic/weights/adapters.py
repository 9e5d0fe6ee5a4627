"""LoRA / PEFT adapters of a prepared peft model: saved in peft's own format, or merged into the base weights.

A peft model (``peft.get_peft_model(model, LoraConfig(...))``) freezes its base weights; only the adapters are
trainable. Under FSDP2 and ZeRO-3 every rank holds a shard of them, so the model's own ``save_pretrained`` writes
rank 0's shard, or empty tensors (peft#2892, accelerate#3508, accelerate#4206). Here the trainable tensors are
gathered whole first (the strategy's `stream_full_state`, restricted to their names), then peft writes them
(``save_pretrained(dir, state_dict=...)``: ``adapter_config.json`` and ``adapter_model.safetensors``, which
``PeftModel.from_pretrained`` loads).

Merging (``ctx.full_state_dict(merged=True)``) is peft's ``merge_and_unload`` on a twin of the model: a copy of its
modules made at ``ctx.prepare`` with every parameter on the meta device (no storage), filled from the gathered state
dict, so the base model's weights come out with the adapters added, in the plain base model's names.

peft is imported only here, only when asked: a missing peft is a `MissingDependencyError` naming the install.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Mapping

import torch

from .._compat import deepspeed as deepspeed_compat
from ..errors import MissingDependencyError, UnsupportedCodeError

PEFT_INSTALL = "pip install peft (or pip install 'dtrain_magic[peft]')"


def require_peft(what: str) -> Any:
    """The ``peft`` module, or a `MissingDependencyError` saying that ``what`` needs it and how to install it."""
    try:
        import peft
    except ImportError:
        raise MissingDependencyError(f"{what} needs peft, which is not installed: {PEFT_INSTALL}") from None
    return peft


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (without importing peft: a model can be one only once it is
    imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def require_peft_model(model: Any, what: str) -> Any:
    """``model`` if it is a ``PeftModel``; else a TypeError saying what ``what`` needs."""
    require_peft(what)
    if not is_peft_model(model):
        raise TypeError(f"{what} is for a peft model: ctx.prepare was given a {type(model).__name__}; give it "
                        "peft.get_peft_model(model, LoraConfig(...)) (or build that in the model factory)")
    return model


def refuse_deferred(model: torch.nn.Module) -> None:
    """An `UnsupportedCodeError` for a peft model built without its values (its parameters on the meta device, or its
    adapters partitioned as ``deepspeed.zero.Init`` built them): each module's own init would then give the adapters
    their first values, not peft's (LoRA's B starts at zero, so the model starts as the base model)."""
    from .deferred import has_meta_parameters

    if has_meta_parameters(model):
        how = "on the meta device (ctx.init_model() or a model factory under FSDP, --tp or --pp)"
    elif any(deepspeed_compat.is_partitioned(p) for p in model.parameters() if p.requires_grad):
        how = "inside deepspeed.zero.Init (ctx.init_model() or a model factory under --zero 3)"
    else:
        return
    raise UnsupportedCodeError(
        f"ctx.prepare: this peft model was built {how}: its adapters would start from each layer's default init, not "
        "peft's. Build the model whole, apply peft.get_peft_model to it, and give ctx.prepare that model")


def trainable_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of ``model``'s trainable parameters (a peft model's adapters), tied names included."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if param.requires_grad}


def save_adapters(directory: str, model: Any, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Write ``state`` (the gathered trainable tensors, in ``model``'s names) with peft's ``save_pretrained``; returns
    the files written. Refuses an empty or a hollow tensor (what a ZeRO-3 partition is before it is gathered)."""
    hollow = sorted(name for name, tensor in state.items() if tensor.numel() == 0)
    if not state or hollow:
        raise RuntimeError(f"ctx.save_weights(adapters_only=True): the gathered adapters are empty "
                           f"({', '.join(hollow[:4]) or 'no trainable parameters'}); nothing was written")
    model.save_pretrained(directory, state_dict=dict(state), safe_serialization=True)
    written = []
    for root, _, files in os.walk(directory):
        written += [os.path.join(root, f) for f in files if f.startswith("adapter_")]
    return sorted(written)


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules whose parameters are on the meta device (shape and dtype only; a ZeRO-3
    partitioned parameter's whole shape), ties kept: what `merged` fills and merges. Buffers are copied."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        shape = deepspeed_compat.full_shape(param) or param.shape  # ZeRO-3: the data is an empty placeholder
        memo[id(param)] = torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                                             requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


def merged(twin: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapters merged (peft's ``merge_and_unload``), from ``state``, the whole
    peft model's gathered state dict; ``twin`` (from `meta_twin`) is left as it was."""
    model = copy.deepcopy(twin)  # merge_and_unload changes the model it merges: a second call needs the twin intact
    model.load_state_dict(dict(state), assign=True)
    # safe_merge: each merged weight is a new tensor; ``state``'s may be the live model's own (a whole model on the CPU)
    return dict(model.merge_and_unload(safe_merge=True).state_dict())
