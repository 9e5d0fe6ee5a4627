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

With ``--tp N`` this is 2-D parallelism: the model is tensor-parallel over N ranks and FSDP shards it over the
``world / N`` data-parallel ranks (the ``dp`` dimension of a 2-D device mesh; `dtrain_magic.parallel`). With
``--pp`` each pipeline stage is FSDP-sharded over its replicas (torch's pipelining drives FSDP's reduce-scatter).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .base import TorchStrategy
from .memory import MemoryModel


class FSDPStrategy(TorchStrategy):
    name = "fsdp"

    @classmethod
    def memory_model(cls, zero: int | None, precision: str) -> MemoryModel:
        """Full sharding, like ZeRO-3; autocast keeps parameters, gradients and Adam's moments in fp32."""
        return MemoryModel(stage=3)

    sharded_checkpoints = True

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        if self.parallel is not None:
            return self.wrap_model_parallel(model, optimizer, shard_data_parallel=_fully_shard)
        from torch.distributed.device_mesh import init_device_mesh

        from ..parallel.state import repoint_optimizer

        self.report_memory(model)
        model = model.to(self.device)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        _fully_shard(model, init_device_mesh(self.device.type, (self.world_size,)))
        repoint_optimizer(optimizer, names, model, strategy="--strategy fsdp")
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


def _fully_shard(model: torch.nn.Module, mesh: Any) -> None:
    """Each direct child with parameters its own FSDP unit, then the root, over ``mesh`` (1-D)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
