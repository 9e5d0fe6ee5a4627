"""`ModelParallel`: what ``--tp`` / ``--pp`` do to a model, for the strategies that support them (DDP, FSDP).

``prepare`` builds the (pp, dp, tp) device mesh once, gives every rank global rank 0's model, cuts this rank's
pipeline stage out of it (`pipeline_split`), shards it over the tensor-parallel ranks (`tensor_parallel`), lets the
strategy shard it over the data-parallel ranks (FSDP's ``fully_shard``; without one, gradients are averaged over
the replicas at the optimizer step, as DDP would) and points the optimizer at the result. The strategy keeps
what it owns (precision, accumulation, the optimizer step, checkpoints); this class knows no backend.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..config import RunConfig
from . import pipeline_split, tensor_parallel
from .mesh import ParallelDims, build_mesh
from .pipeline import Pipeline, PipelineStageModel
from .state import average_gradients, broadcast_from_rank0, gather_full_state, repoint_optimizer

ShardFn = Callable[[nn.Module, Any], None]


class ModelParallel:
    """This rank's place in the (pp, dp, tp) mesh and the model part it trains."""

    def __init__(self, config: RunConfig, rank: int, world_size: int, device: torch.device, strategy: str):
        self.config, self.rank, self.device, self.strategy = config, rank, device, strategy
        self.dims = ParallelDims(world_size, config.tp, config.pp)
        self.coords = self.dims.coordinates(rank)
        self.mesh: Any = None
        self.module: nn.Module | None = None  # this rank's part, named as in the whole model
        self.pipeline: Pipeline | None = None
        self.to_plain: list[Callable[[dict], dict]] = []
        self._shards_data_parallel = False

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def _get_mesh(self) -> Any:
        if self.mesh is None:
            self.mesh = build_mesh(self.device.type, self.dims)
        return self.mesh

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, tp_plan: Mapping[str, Any] | None = None,
        pp_split: Sequence[str | int] | None = None, shard_data_parallel: ShardFn | None = None,
    ) -> tuple[nn.Module, Any]:
        """Split ``model`` for this rank; returns what user code holds (the model, or the pipeline stage wrapper)
        and the optimizer, re-pointed in place."""
        mesh = self._get_mesh()
        model = model.to(self.device)
        broadcast_from_rank0(model)
        old_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        notes = [f"model parallel: {self.dims.describe()} (rank {self.rank}: stage {self.coords['pp']}, "
                 f"replica {self.coords['dp']}, shard {self.coords['tp']})"]
        check = None
        if self.dims.pp > 1:
            if tp_plan is not None:
                tensor_parallel.user_styles(model, tp_plan)  # the keys are checked against the whole model
            links = pipeline_split.chain_of(model)
            starts = pipeline_split.split_starts(links, self.dims.pp, pp_split)
            pipeline_split.check_no_ties_across_stages(model, links, starts)
            notes.append("pipeline " + pipeline_split.describe_split(links, starts))
            keep = pipeline_split.stage_ranges(starts, len(links))[self.coords["pp"]]
            needs_check = pipeline_split.ChainCheck.needed(model)
            called = pipeline_split.cut_stage(model, links, keep)
            if needs_check:
                check = called
        renames: dict[str, list[str]] = {}
        self.to_plain = []
        if self.dims.tp > 1:
            plan = tensor_parallel.plan_for(model, self.dims.tp, tp_plan, skip_missing=self.dims.pp > 1)
            tensor_parallel.apply(model, mesh["tp"], plan)
            renames, self.to_plain = plan.renames, list(plan.to_plain)
            notes.append(f"tensor parallel: {plan.description}")
        self._shards_data_parallel = shard_data_parallel is not None
        if shard_data_parallel is not None:
            shard_data_parallel(model, mesh["dp"])
        repoint_optimizer(optimizer, old_names, model, renames, f"--strategy {self.strategy}")
        self.module = model
        if self.rank == 0:
            print("\n".join(notes), flush=True)
        if self.dims.pp == 1:
            self.pipeline = None
            return model, optimizer
        if check is not None:
            pipeline_split.ChainCheck(model, check)
        self.pipeline = Pipeline(model, self.coords["pp"], self.dims.pp, self.device, mesh["pp"].get_group(),
                                 self.config.pipeline_microbatches, self.config.pp_schedule)
        return PipelineStageModel(model, self.coords["pp"], self.dims.pp), optimizer

    def finish_gradients(self, accumulation: int) -> None:
        """Before the optimizer step: pipeline gradients to their mean; replicas averaged unless the strategy's own
        data-parallel sharding (FSDP) reduced them already."""
        if self.pipeline is not None:
            self.pipeline.finish(accumulation)
        if not self._shards_data_parallel and self.module is not None:
            average_gradients(self.module, self._get_mesh()["dp"].get_group(), self.dims.dp)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, in the plain model's layout, on every rank (a collective)."""
        pp_group = self._get_mesh()["pp"].get_group() if self.dims.pp > 1 else None
        return gather_full_state(self.module, pp_group, self.to_plain)
