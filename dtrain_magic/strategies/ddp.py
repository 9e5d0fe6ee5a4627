"""``--strategy ddp``: torch DistributedDataParallel.

With ``--tp``/``--pp`` the model is split by `dtrain_magic.parallel.ModelParallel` instead of wrapped in DDP (whose
buckets do not take tensor-parallel DTensor parameters or a pipeline's manual backward): the replicas' gradients
are averaged over the data-parallel ranks once per optimizer step, which is what DDP's all-reduce (and ``no_sync``
during accumulation) amounts to.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .base import TorchStrategy


class DDPStrategy(TorchStrategy):
    name = "ddp"

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        if self.parallel is not None:
            return self.wrap_model_parallel(model, optimizer)
        self.report_memory(model)
        model = model.to(self.device)
        if self.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()
