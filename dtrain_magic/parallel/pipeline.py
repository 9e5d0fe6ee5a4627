"""Running one pipeline stage (``--pp``): torch.distributed.pipelining's ``PipelineStage`` and schedule.

Every rank of a pipeline calls `Pipeline.run` with the same whole batch (the loaders are sharded over model
replicas only): the first stage feeds the inputs in micro-batches, the last computes ``loss_fn`` on each
micro-batch's output, the schedule (GPipe, or 1F1B with ``--pp-schedule 1f1b``) runs the forward and backward
passes, sending activations and their gradients between stages. Gradients are summed over micro-batches
(``scale_grads=False``) and divided once at the optimizer step (`finish`), by micro-batches x ``--grad-accum``, so a
step's update equals one process's on the same global batch with a mean loss. The loss (mean over micro-batches)
is broadcast from the last stage, so every rank returns it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedCodeError

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}

USE_TRAIN_STEP = (
    "under --pp the model runs as a pipeline schedule across processes, so {what} is not available; write the "
    "training step as loss = ctx.train_step(inputs, targets, loss_fn) (forward, loss, backward and optimizer step "
    "over --microbatches micro-batches; the same function runs unchanged without --pp)"
)


class PipelineStageModel(nn.Module):
    """What ``ctx.prepare`` returns under ``--pp``: this rank's stage (``.module``, parameters named as in the
    whole model). Calling it is an error pointing at ``ctx.train_step``: the stage alone cannot run the model."""

    def __init__(self, stage: nn.Module, stage_index: int, num_stages: int):
        super().__init__()
        self.module = stage
        self.stage_index, self.num_stages = stage_index, num_stages

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedCodeError(USE_TRAIN_STEP.format(what="calling the model directly (model(x))"))

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}"


def _batch_size(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    if isinstance(value, (tuple, list)) and value:
        return _batch_size(value[0])
    return None


class Pipeline:
    """This rank's ``PipelineStage`` in a ``group`` of ``num_stages`` ranks, and its schedule."""

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device: torch.device, group: Any,
                 microbatches: int, schedule: str = "gpipe"):
        from torch.distributed import pipelining

        self.stage_index, self.num_stages, self.microbatches, self.group = stage_index, num_stages, microbatches, group
        self.module = module
        self.stage = pipelining.PipelineStage(module, stage_index, num_stages, device, group=group)
        schedule_class = getattr(pipelining, SCHEDULES[schedule])
        self.schedule = schedule_class(self.stage, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._last_group_rank = dist.get_global_rank(group, num_stages - 1)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        return self._loss_fn(output, target)  # type: ignore[misc]  # the schedule's loss_fn is fixed at construction

    def run(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one batch over the pipeline; the mean micro-batch loss, on every stage."""
        if isinstance(inputs, dict):
            raise UnsupportedCodeError("ctx.train_step under --pp takes the inputs as a tensor or a tuple of tensors "
                                       "(positional arguments of the model), not a dict")
        size = _batch_size(inputs)
        if size is not None and size % self.microbatches:
            raise ValueError(
                f"ctx.train_step: a batch of {size} samples cannot be split into --microbatches {self.microbatches} "
                f"equal micro-batches; make the per-process batch size a multiple of {self.microbatches}"
            )
        self._loss_fn = loss_fn
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        losses: list[torch.Tensor] = []
        if self.is_first:
            self.schedule.step(*args)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        if self.is_last:
            loss = torch.stack([value.detach().float() for value in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.stage.device)
        dist.broadcast(loss, src=self._last_group_rank, group=self.group)
        return loss

    def finish(self, accumulation: int) -> None:
        """Before the optimizer step: gradients summed over micro-batches and accumulated steps -> their mean."""
        self.stage.scale_grads(self.microbatches * accumulation)
