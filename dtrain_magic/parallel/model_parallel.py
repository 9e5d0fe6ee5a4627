"""`ModelParallel`: what ``--tp`` / ``--pp`` do to a model, for the strategies that support them (DDP, FSDP).

``prepare`` builds the (pp, dp, tp) device mesh once, gives every rank global rank 0's model, cuts this rank's
pipeline stage out of it (`pipeline_split`), shards it over the tensor-parallel ranks (`tensor_parallel`), lets the
strategy shard it over the data-parallel ranks (FSDP's ``fully_shard``; without one, gradients are averaged over
the replicas at the optimizer step, as DDP would) and points the optimizer at the result. The strategy keeps
what it owns (precision, accumulation, the optimizer step, checkpoints); this class knows no backend.

A model built on the meta device (``ctx.init_model()``) goes through the same steps without storage: no rank builds
or broadcasts it whole; the strategy's ``fill`` then gives this rank's shards of its stage storage and values (from a
checkpoint, or the model's own init run on an untouched copy, `weights.deferred`). `stream_full_state` gives the
whole plain model to rank 0 one tensor at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..weights import deferred
from . import pipeline_split, tensor_parallel
from .mesh import ParallelDims, build_mesh
from .pipeline import Pipeline, PipelineStageModel
from .state import average_gradients, broadcast_from_rank0, gather_full_state, repoint_optimizer

ShardFn = Callable[[nn.Module, Any], None]
FillFn = Callable[[nn.Module, Any, "nn.Module | None", Mapping[str, Any]], None]


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
        self.renames: dict[str, list[str]] = {}
        self.plain_keys: list[tuple[str, tuple[int, ...], torch.dtype]] = []  # the whole model's state, in order
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
        self, model: nn.Module, optimizer: Any, tp_plan: Mapping[str, Any] | None = None,
        pp_split: Sequence[str | int] | None = None, shard_data_parallel: ShardFn | None = None,
        fill: FillFn | None = None, weights: Any = None,
    ) -> tuple[nn.Module, Any]:
        """Split ``model`` for this rank; returns what user code holds (the model, or the pipeline stage wrapper)
        and the optimizer (re-pointed in place, or made by the factory given). ``fill(module, weights, pristine,
        views)``: gives the rank's part storage and values (a model built on meta, or ``weights`` to load)."""
        mesh = self._get_mesh()
        is_deferred = deferred.has_meta_parameters(model)
        pristine = deferred.pristine_copy(model) if is_deferred and weights is None else None
        self.plain_keys = [(key, tuple(value.shape), value.dtype) for key, value in model.state_dict().items()]
        if not is_deferred:
            model = model.to(self.device)
            broadcast_from_rank0(model)
        old_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        notes = [f"model parallel: {self.dims.describe()} (rank {self.rank}: stage {self.coords['pp']}, "
                 f"replica {self.coords['dp']}, shard {self.coords['tp']})"]
        check = self._cut_stage(model, tp_plan, pp_split, notes) if self.dims.pp > 1 else None
        views = self._shard_tensors(model, mesh, tp_plan, is_deferred, notes)
        self._shards_data_parallel = shard_data_parallel is not None
        if shard_data_parallel is not None:
            shard_data_parallel(model, mesh["dp"])
        if fill is not None and (is_deferred or weights is not None):
            fill(model, weights, pristine, views)
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            repoint_optimizer(optimizer, old_names, model, self.renames, f"--strategy {self.strategy}")
        else:
            optimizer = deferred.optimizer_for(optimizer, model.parameters())
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

    def _cut_stage(self, model: nn.Module, tp_plan: Mapping[str, Any] | None, pp_split: Sequence[str | int] | None,
                   notes: list[str]) -> Any:
        """Keep this rank's pipeline stage of ``model`` (in place); what `pipeline_split.ChainCheck` then checks
        (None when the model needs no check)."""
        if tp_plan is not None:
            tensor_parallel.user_styles(model, tp_plan)  # the keys are checked against the whole model
        links = pipeline_split.chain_of(model)
        starts = pipeline_split.split_starts(links, self.dims.pp, pp_split)
        pipeline_split.check_no_ties_across_stages(model, links, starts)
        notes.append("pipeline " + pipeline_split.describe_split(links, starts))
        keep = pipeline_split.stage_ranges(starts, len(links))[self.coords["pp"]]
        needs_check = pipeline_split.ChainCheck.needed(model)
        called = pipeline_split.cut_stage(model, links, keep)
        return called if needs_check else None

    def _shard_tensors(self, model: nn.Module, mesh: Any, tp_plan: Mapping[str, Any] | None, is_deferred: bool,
                       notes: list[str]) -> dict[str, Any]:
        """With ``--tp``: this rank's tensor-parallel shards (in place), setting ``renames`` and ``to_plain``;
        the plan's views (for filling a deferred model)."""
        self.renames, self.to_plain = {}, []
        if self.dims.tp <= 1:
            return {}
        with deferred.parameters_on_meta() if is_deferred else contextlib.nullcontext():  # GPT-2's q/k/v too
            plan = tensor_parallel.plan_for(model, self.dims.tp, tp_plan, skip_missing=self.dims.pp > 1)
        tensor_parallel.apply(model, mesh["tp"], plan)
        self.renames, self.to_plain = plan.renames, list(plan.to_plain)
        notes.append(f"tensor parallel: {plan.description}")
        return dict(plan.views)

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

    def stream_full_state(self, include: Callable[[str], bool] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The whole plain model to rank 0, one tensor at a time (see `Strategy.stream_full_state`): each stage's
        tensors gathered within the stage (its tensor-parallel and FSDP shards), stage 0's kept by rank 0, the other
        stages' sent to rank 0 by their first rank; every rank iterates it all. ``include``: only the plain names it
        accepts are gathered and sent (the same on every rank)."""
        leader = self.coords["dp"] == 0 and self.coords["tp"] == 0  # of stage 0: rank 0
        own = self._stage_items(keep=leader, include=include)
        # nccl sends only device tensors; gloo, CPU ones
        wire = self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        if self.coords["pp"] == 0:
            yield from own
        else:
            if leader:
                stage_keys = set(self._stage_keys(include))
                dist.send_object_list([[item for item in self.plain_keys if item[0] in stage_keys]], dst=0)
            for _, tensor in own:
                if leader:
                    dist.send(tensor.contiguous().to(wire), dst=0)
        if self.rank != 0:
            return
        for stage in range(1, self.dims.pp):
            source = self.dims.rank_of(stage, 0, 0)
            box: list[Any] = [None]
            dist.recv_object_list(box, src=source)
            for key, shape, dtype in box[0]:
                tensor = torch.empty(shape, dtype=dtype, device=wire)
                dist.recv(tensor, src=source)
                yield key, tensor.cpu()

    def _stage_keys(self, include: Callable[[str], bool] | None = None) -> list[str]:
        """The plain model's state keys this rank's stage holds (under their plain names; those ``include`` accepts)."""
        state = self.module.state_dict(keep_vars=True)
        return [key for key, _, _ in self.plain_keys if all(part in state for part in self.renames.get(key, [key]))
                and (include is None or include(key))]

    def _stage_items(self, keep: bool, include: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """This stage's tensors (those ``include`` accepts) gathered whole (a collective within the stage), in the
        plain layout; on the CPU where ``keep``, else None."""
        state = self.module.state_dict(keep_vars=True)
        for key in self._stage_keys(include):
            parts = {}
            for part in self.renames.get(key, [key]):
                value = state[part]
                with torch.no_grad():
                    whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                parts[part] = whole.detach().cpu() if keep else None
            if not keep:
                yield key, None
                continue
            for convert in self.to_plain:
                parts = convert(parts)
            yield key, parts[key]
