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

The units are the model's blocks (`memory.blocks`: each direct child with parameters, the entries of a
``ModuleList``, a transformer's blocks inside its trunk), then the root: all-gathering one unit at a time is what
keeps a rank from ever holding the whole model.

A model built on the meta device (``ctx.init_model()``, a factory given to ``ctx.prepare``) is sharded while it has
no storage; each rank then gives storage to its own shards only and fills them from the checkpoint (the regions it
holds) or with the model's own init, one module at a time (`dtrain_magic.weights`).

Checkpoints are sharded (``torch.distributed.checkpoint``: every rank writes its shards); ``full_state_dict``
gathers the whole fp32 model on every rank for a rank-0 ``torch.save`` that loads into the plain model, and
``stream_full_state`` gives it to rank 0 alone, one tensor at a time.

With ``--tp N`` this is 2-D parallelism: the model is tensor-parallel over N ranks and FSDP shards it over the
``world / N`` data-parallel ranks (the ``dp`` dimension of a 2-D device mesh; `dtrain_magic.parallel`). With
``--pp`` each pipeline stage is FSDP-sharded over its replicas (torch's pipelining drives FSDP's reduce-scatter).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError
from .base import ADAM_TEMPORARIES, TorchStrategy
from .memory import MemoryModel, ModelFacts, blocks

if TYPE_CHECKING:  # torch loads in the worker (`wrap`), not with the strategy's facts
    import torch

    from ..config import RunConfig

UNSHARDED_BLOCKS = 3  # the block in use, the next one prefetched, and the block's unsharded gradient


class FSDPStrategy(TorchStrategy):
    name = "fsdp"

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        """``--offload``: FSDP2's ``CPUOffloadPolicy`` keeps parameters, gradients and the optimizer step on the CPU
        together; it has no optimizer-only offload."""
        if config.offload == "optimizer":
            raise ConfigError("--offload", "optimizer is not supported with --strategy fsdp: FSDP2 offloads the "
                                           "parameters, gradients and optimizer step together (--offload params), "
                                           "or use --zero 2 --offload optimizer")

    @classmethod
    def memory_model(cls, zero: int | None, precision: str) -> MemoryModel:
        """Full sharding, like ZeRO-3; autocast keeps parameters, gradients and Adam's moments in fp32."""
        return MemoryModel(stage=3)

    @classmethod
    def memory_buffers(cls, facts: ModelFacts, zero: int | None, precision: str, world_size: int, tp: int = 1,
                       pp: int = 1, settings: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        """FSDP all-gathers one block at a time (and prefetches the next), and reduce-scatters its unsharded
        gradient; Adam steps each sharded parameter."""
        dp = world_size // (tp * pp)
        return [("unsharded blocks (in use, prefetched, gradient)", UNSHARDED_BLOCKS * 4 * facts.largest_block / tp),
                ("Adam's step temporaries", ADAM_TEMPORARIES * 4 * facts.largest_param / (tp * dp))]

    sharded_checkpoints = True

    def wrap(self, model: torch.nn.Module, optimizer: Any, weights: Any = None) -> tuple[Any, Any]:
        if self.parallel is not None:
            return self.wrap_model_parallel(model, optimizer, shard_data_parallel=_fully_shard, weights=weights)
        from torch.distributed.device_mesh import init_device_mesh

        from ..weights.deferred import has_meta_parameters, pristine_copy

        self.report_memory(model)
        deferred = has_meta_parameters(model)
        pristine = pristine_copy(model) if deferred and weights is None else None
        if not deferred:
            model = model.to(self.device)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        offload = self.config.offload == "params"  # CPUOffloadPolicy: shards, gradients and the step on the CPU
        _fully_shard(model, init_device_mesh(self.device.type, (self.world_size,)), offload=offload)
        self.fill_shards(model, weights, pristine)
        optimizer = self.prepared_optimizer(optimizer, model, names)
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def fill_shards(self, model: torch.nn.Module, weights: Any, pristine: torch.nn.Module | None,
                    views: Mapping[str, Any] | None = None) -> None:
        """As `TorchStrategy.fill_shards`; under ``--offload params`` a deferred model's shards get their storage in CPU
        memory, where ``CPUOffloadPolicy`` keeps them (FSDP copies each unit to the GPU for its forward and
        backward)."""
        if self.config.offload != "params":
            super().fill_shards(model, weights, pristine, views)
            return
        import torch

        device, self.device = self.device, torch.device("cpu")
        try:
            super().fill_shards(model, weights, pristine, views)
        finally:
            self.device = device

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


def _fully_shard(model: torch.nn.Module, mesh: Any, offload: bool = False) -> None:
    """Each of the model's blocks (`memory.blocks`) its own FSDP unit, then the root, over ``mesh`` (1-D); with
    ``offload`` (``--offload params``), each unit's shards kept in pinned CPU memory (FSDP2's ``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)

