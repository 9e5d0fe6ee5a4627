"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes and reads its own shards.

Used for models whose parameters are DTensors (FSDP2, tensor parallel) or split into pipeline stages: DCP stores
each tensor under its name in the whole model with the shards' offsets, so a replica's copies are written once and
a load reshards to whatever layout the loading model has. What is not a tensor (the accumulation counter, the
function's ``client_state``, a GradScaler) goes to one small file written by rank 0, which also marks the
checkpoint as complete.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the worker's first checkpoint, not with the strategy's facts
    import torch

EXTRA = "dtrain_extra.pt"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # The optimizer's param groups keyed by parameter name, not as one list per rank: pipeline stages hold
    # different parameters, and DCP keeps one copy of a key that several ranks save.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _state(module: torch.nn.Module, optimizer: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(module, options=_options())}
    model_state, optim_state = get_state_dict(module, optimizer, options=_options())
    return {"model": model_state, "optim": optim_state}


def save(directory: str, module: torch.nn.Module, optimizer: Any, rank: int, extra: dict) -> None:
    """Write ``module``'s and ``optimizer``'s shards (a collective) and, from rank 0, ``extra``."""
    import torch
    import torch.distributed.checkpoint as dcp

    os.makedirs(directory, exist_ok=True)
    dcp.save(_state(module, optimizer), checkpoint_id=directory)
    if rank == 0:
        torch.save(extra, os.path.join(directory, EXTRA))


def load(directory: str, module: torch.nn.Module, optimizer: Any) -> dict | None:
    """Restore ``module`` and ``optimizer`` in place (a collective); the saved ``extra``, or None without one."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    extra_path = os.path.join(directory, EXTRA)
    if not os.path.exists(extra_path):
        return None
    state = _state(module, optimizer)
    dcp.load(state, checkpoint_id=directory)
    if "optim" in state:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options())
    else:
        set_model_state_dict(module, state["model"], options=_options())
    return torch.load(extra_path, map_location="cpu", weights_only=False)
