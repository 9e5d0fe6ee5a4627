"""``--strategy ddp``: torch DistributedDataParallel.

With ``--tp``/``--pp`` the model is split by `dtrain_magic.parallel.ModelParallel` instead of wrapped in DDP (whose
buckets do not take tensor-parallel DTensor parameters or a pipeline's manual backward): the replicas' gradients
are averaged over the data-parallel ranks once per optimizer step, which is what DDP's all-reduce (and ``no_sync``
during accumulation) amounts to.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError
from .base import TorchStrategy
from .memory import ModelFacts

if TYPE_CHECKING:  # torch loads in the worker (`wrap`), not with the strategy's facts
    import torch

    from ..config import RunConfig


class DDPStrategy(TorchStrategy):
    name = "ddp"

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        """``--offload``: DDP keeps whole parameters, gradients and optimizer states on every rank's GPU and its
        buckets all-reduce them there; nothing in it can live on the CPU."""
        if config.offload != "none":
            raise ConfigError("--offload", f"{config.offload} is not supported with --strategy ddp (it keeps a whole "
                                           "copy of everything on each GPU); use --strategy fsdp --offload params, or "
                                           "--zero 2 --offload optimizer, or --zero 3 --offload params")

    @classmethod
    def memory_buffers(cls, facts: ModelFacts, zero: int | None, precision: str, world_size: int, tp: int = 1,
                       pp: int = 1, settings: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        """DDP's reducer keeps its gradient buckets beside the gradients (``gradient_as_bucket_view`` off): a second
        copy of every gradient. With ``--tp``/``--pp`` the replicas' gradients are averaged in chunks instead."""
        from ..parallel.state import AVERAGE_CHUNK_ELEMENTS  # here: that module imports torch

        share = facts.num_params / (tp * pp)
        parts = super().memory_buffers(facts, zero, precision, world_size, tp, pp, settings)
        if world_size // (tp * pp) > 1:
            if tp * pp == 1:
                parts.append(("DDP's gradient buckets", 4 * share))
            else:
                parts.append(("gradient averaging chunk", 4 * min(share, AVERAGE_CHUNK_ELEMENTS)))
        return parts

    def wrap(self, model: torch.nn.Module, optimizer: Any, weights: Any = None) -> tuple[Any, Any]:
        if self.parallel is not None:
            return self.wrap_model_parallel(model, optimizer, weights=weights)
        self.report_memory(model)
        old_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.fill_whole(model, weights)
        model = model.to(self.device)
        optimizer = self.prepared_optimizer(optimizer, model, old_names)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()
