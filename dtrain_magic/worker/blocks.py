"""``--ac`` and ``--compile``: what ``ctx.prepare`` does to each of the model's blocks before the strategy shards it.

The order is fixed here, in `prepare_blocks`, because only this order works (torchtitan applies the same one, see
its issues #268 and #472):

1. **activation checkpointing** first: it wraps a block's forward so its activations are recomputed in the backward
   instead of kept; compiling first would hide the block's operations inside a compiled graph the checkpoint can
   only treat as one opaque call;
2. **torch.compile** of each checkpointed block (not of the whole model): the checkpoint is traced as part of the
   block's graph, and each block compiles alone, so a graph break or a recompile stays inside one block;
3. **sharding** last (FSDP's ``fully_shard``, DeepSpeed's engine, DDP's buckets, in the strategy's ``wrap``): its
   hooks run around each block's call, outside both, so parameters are gathered before the compiled, checkpointed
   forward runs and again before its recomputation in the backward.

Both change a block's ``forward`` on the instance only (``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``, and ``torch.compile`` of that function): module names, the state dict, ``weights=`` and
checkpoints are those of the plain model (torch's ``checkpoint_wrapper`` and ``torch.compile(module)`` would add
``_checkpoint_wrapped_module.`` / ``_orig_mod.`` to every name).

The blocks: the module class named by ``--ac-module``, else the class repeated most among the model's blocks (what
FSDP makes its units, `strategies.memory.blocks`: a transformer's layers), else among all its modules with parameters.
``--ac full`` checkpoints every block; ``--ac selective`` every other one (blocks 0, 2, 4, ...), torchtitan's
layer-selective checkpointing with frequency 2: about half the activation memory saved for about half the extra
forward compute.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
SELECTIVE_EVERY = 2  # --ac selective: every second block, as torchtitan's selective_ac_option "2"


def find_blocks(model: nn.Module, class_name: str | None = None) -> list[nn.Module]:
    """The blocks ``--ac``/``--compile`` apply to, in model order (outermost instances only: a block inside another
    is left to it). ``class_name``: a class's ``__name__`` (``--ac-module``); a `ConfigError` naming the flag when the
    model has no such module, or no repeated module class to pick by itself."""
    if class_name is not None:
        found = _outermost([m for m in model.modules() if type(m).__name__ == class_name and m is not model])
        if not found:
            raise ConfigError("--ac-module", f"got {class_name!r}, but the model ({type(model).__name__}) has no "
                                             f"module of that class; its repeated classes: {_repeated_names(model)}")
        return found
    from ..strategies.memory import blocks

    for candidates in (blocks(model), [m for m in model.modules() if m is not model and _has_params(m)
                                       and not isinstance(m, CONTAINERS)]):
        counts = collections.Counter(type(m) for m in candidates)
        if counts and counts.most_common(1)[0][1] >= 2:
            chosen = counts.most_common(1)[0][0]
            return _outermost([m for m in candidates if type(m) is chosen])
    raise ConfigError("--ac", f"found no repeated module class in {type(model).__name__} to treat as its blocks; "
                              "name the block class with --ac-module NAME")


def checkpoint_blocks(blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """``--ac full``: every block's forward recomputed in the backward (non-reentrant checkpoint); ``selective``:
    every `SELECTIVE_EVERY`-th block; ``none``: none. Returns the blocks checkpointed."""
    chosen = checkpointed(blocks, mode)
    for block in chosen:
        block.forward = _checkpointed(block.forward)
    return chosen


def checkpointed(blocks: list[Any], mode: str) -> list[Any]:
    """The blocks ``--ac mode`` checkpoints (`checkpoint_blocks`, and the estimate's `worker.activations`)."""
    if mode == "none":
        return []
    return list(blocks) if mode == "full" else list(blocks[::SELECTIVE_EVERY])


def compile_blocks(blocks: list[nn.Module]) -> None:
    """``--compile``: each block's forward (checkpointed or not) compiled by ``torch.compile``, with its default
    backend, inductor, unless ``$DTRAIN_MAGIC_COMPILE_BACKEND`` names another (``aot_eager``: traced and
    differentiated by torch's compiler without generating code, a check that costs seconds instead of a minute)."""
    backend = os.environ.get("DTRAIN_MAGIC_COMPILE_BACKEND", "inductor")
    for block in blocks:
        _expose_shipped_globals(block)
        block.forward = torch.compile(block.forward, backend=backend)


def _expose_shipped_globals(block: nn.Module) -> None:
    """A class defined in the notebook reaches the worker by value (cloudpickle): its ``forward`` keeps its own
    globals dict, but names ``__main__`` as its module, and dynamo's guards look globals up in the module
    (``sys.modules["__main__"].torch``: "module '__main__' has no attribute 'torch'"). The names that dict holds are
    given to that module where it lacks them (never replacing one), as they were in the notebook."""
    for module in block.modules():
        forward = getattr(type(module).forward, "__globals__", None)
        home = sys.modules.get(getattr(type(module).forward, "__module__", None) or "")
        if forward is None or home is None or forward is vars(home):
            continue
        for name, value in forward.items():
            if not name.startswith("__"):
                vars(home).setdefault(name, value)


def prepare_blocks(model: nn.Module, ac: str = "none", ac_module: str | None = None, compile: bool = False,
                   announce: Callable[[str], None] | None = None) -> list[nn.Module]:
    """Activation checkpointing, then torch.compile, on ``model``'s blocks, in place, before the strategy shards it
    (the module docstring says why in this order). Returns the blocks (none when both are off)."""
    if ac == "none" and not compile:
        return []
    blocks = find_blocks(model, ac_module)
    checkpointed = checkpoint_blocks(blocks, ac)
    if compile:
        compile_blocks(blocks)
    if announce is not None:
        what = [f"activation checkpointing ({ac}) on {len(checkpointed)} of {len(blocks)}"] if ac != "none" else []
        what += [f"torch.compile on {len(blocks)}"] if compile else []
        announce(f"{' and '.join(what)} {type(blocks[0]).__name__} blocks, before sharding")
    return blocks


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward_checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing would be saved, nothing to recompute
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return forward_checkpointed


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _repeated_names(model: nn.Module) -> str:
    counts = collections.Counter(type(m).__name__ for m in model.modules() if m is not model and _has_params(m)
                                 and not isinstance(m, CONTAINERS))
    repeated = [f"{name} ({count})" for name, count in counts.most_common() if count >= 2]
    return ", ".join(repeated) or "none"
