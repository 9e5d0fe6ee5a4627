"""``--strategy fsdp``: torch FSDP2 (``torch.distributed.fsdp.fully_shard``), full sharding.

FSDP1 (``FullyShardedDataParallel``) refuses CPU ("FSDP needs a non-CPU accelerator device"); FSDP2 on a
``init_device_mesh(device.type, (world_size,))`` mesh works on CPU (gloo) and GPU (NCCL), so this is FSDP2.
Each direct child module that has parameters becomes its own FSDP unit, then the root: parameters,
gradients and optimizer states are sharded across processes like ZeRO-3. Precision is autocast (and a
GradScaler for fp16) as under DDP: stored weights stay fp32. Gradient accumulation skips the
reduce-scatter on the micro-batches before a boundary (``set_requires_gradient_sync(False)``).

``fully_shard`` replaces the module's parameters with sharded DTensor parameters, so the user's optimizer
(created on the plain model before ``ctx.prepare``) is pointed at the new parameters in place; its
hyper-parameters and param groups are kept.

Checkpoints are sharded (``torch.distributed.checkpoint``: every rank writes its shards); ``full_state_dict``
gathers the whole fp32 model on every rank for a rank-0 ``torch.save`` that loads into the plain model.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .base import TorchStrategy

_EXTRA = "dtrain_extra.pt"


class FSDPStrategy(TorchStrategy):
    name = "fsdp"

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.report_memory(model)
        model = model.to(self.device)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if optimizer is not None:
            new = dict(model.named_parameters(remove_duplicate=False))
            for group in optimizer.param_groups:
                try:
                    group["params"] = [new[names[id(p)]] for p in group["params"]]
                except KeyError:
                    raise ValueError(
                        "--strategy fsdp: the optimizer holds parameters that are not the model's; "
                        "create it from model.parameters() before ctx.prepare"
                    ) from None
            optimizer.state.clear()
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    @contextlib.contextmanager
    def no_sync(self):
        model = self.model
        if model is None or not hasattr(model, "set_requires_gradient_sync"):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    # -- checkpoints -----------------------------------------------------------------------------
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        """Sharded checkpoint with torch.distributed.checkpoint (every rank writes its shards)."""
        import torch.distributed.checkpoint as dcp

        os.makedirs(directory, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=directory)
        if self.rank == 0:
            extra = {"micro_step": self.micro_step, "client_state": dict(client_state or {})}
            if self.scaler is not None:
                extra["scaler"] = self.scaler.state_dict()
            torch.save(extra, os.path.join(directory, _EXTRA))

    def load_checkpoint(self, directory: str) -> dict | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        extra_path = os.path.join(directory, _EXTRA)
        if not os.path.exists(extra_path):
            return None
        state = self._state()
        dcp.load(state, checkpoint_id=directory)
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        extra = torch.load(extra_path, map_location="cpu", weights_only=False)
        self.micro_step = extra.get("micro_step", 0)
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        return extra.get("client_state")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded fp32 state dict on every rank (a collective: every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in state.items()}
