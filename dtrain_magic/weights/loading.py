"""Sharded loading: each rank reads, from a checkpoint, only the regions of the tensors it holds.

`match` compares the plain model (before any cutting or sharding; on meta, or partitioned by ZeRO-3) with the
checkpoint: every parameter must be there (a tied parameter under any of its names, as Hugging Face checkpoints
keep one), every checkpoint tensor must be the model's, shapes must agree; otherwise a `WeightsError` lists every
name that does not match, before anything is read. A persistent buffer the checkpoint lacks keeps its built value.

`load` fills a prepared module (FSDP or tensor-parallel DTensor shards, a pipeline stage, or whole tensors) through
``torch.distributed.checkpoint``: its planner works out each rank's region of each tensor (any placement: FSDP's,
tensor parallel's, both), and `SourceReader` reads those regions from the source (safetensors' ``get_slice``, a
memory-mapped torch file). The run's own DCP checkpoints are read by DCP's own ``FileSystemReader``.
`load_zero3_partitions` writes ZeRO-3's flat partitions (DeepSpeed's layout, not a DTensor) from the rows of each
tensor they cover.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.futures import Future

from .._compat import deepspeed as deepspeed_compat
from ..errors import WeightsError
from .deferred import View
from .sources import DistributedCheckpointSource, WeightSource

_SHOWN = 10  # names listed per kind of mismatch


@dataclass(frozen=True)
class LoadPlan:
    """How the plain model's state-dict keys map onto the checkpoint (``source_of``: model key -> checkpoint name)
    and which keys are not loaded (``kept``: persistent buffers the checkpoint lacks)."""

    source: WeightSource
    source_of: dict[str, str]
    kept: frozenset[str] = field(default_factory=frozenset)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    full = deepspeed_compat.full_shape(tensor)  # a ZeRO-3 partitioned parameter
    return full if full is not None else tuple(tensor.shape)


def _tensor_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor, bool]]:
    """The model's state-dict tensors, one entry per tensor: (its names, the tensor, is a parameter)."""
    state = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    groups: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for key, tensor in state.items():
        entry = groups.setdefault(id(tensor), ([], tensor, id(tensor) in params))
        entry[0].append(key)
    return list(groups.values())


def match(model: nn.Module, source: WeightSource) -> LoadPlan:
    """The `LoadPlan` for ``model`` and ``source``, or a `WeightsError` listing every mismatch."""
    names = source.names()
    available = set(names)
    source_of: dict[str, str] = {}
    kept: set[str] = set()
    missing: list[str] = []
    shapes: list[str] = []
    used: set[str] = set()
    for keys, tensor, is_param in _tensor_groups(model):
        present = [key for key in keys if key in available]
        used.update(present)
        if not present:
            if is_param:
                missing.append(keys[0])
            else:
                kept.update(keys)
            continue
        found = source.shape(present[0])
        if tuple(found) != _shape(tensor):
            shapes.append(f"{present[0]} (model {tuple(_shape(tensor))}, checkpoint {tuple(found)})")
        for key in keys:
            source_of[key] = present[0]
    unexpected = [name for name in names if name not in used]
    if missing or unexpected or shapes:
        raise WeightsError(_mismatch_message(model, source, missing, unexpected, shapes))
    return LoadPlan(source, source_of, frozenset(kept))


def _count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _be(items: list) -> str:
    return "is" if len(items) == 1 else "are"


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def _mismatch_message(model: nn.Module, source: WeightSource, missing: list[str], unexpected: list[str],
                      shapes: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"{_count(missing, 'parameter')} of the model {_be(missing)} not in the checkpoint: "
                     f"{_listed(missing)}")
    if unexpected:
        parts.append(f"{_count(unexpected, 'tensor')} of the checkpoint {_be(unexpected)} not in the model: "
                     f"{_listed(unexpected)}")
    if shapes:
        parts.append(f"{_count(shapes, 'shape')} differ{'s' if len(shapes) == 1 else ''}: {_listed(shapes)}")
    hint = _prefix_hint(missing, unexpected)
    return (f"weights={source.path!r} ({source.kind}, {len(source.names())} tensors) does not match "
            f"{type(model).__name__}: " + "; ".join(parts) + (f". {hint}" if hint else "")
            + ". Nothing was loaded or trained")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """When the two sides differ by a leading name part (a base model's checkpoint for a model with a head)."""
    if not missing or not unexpected:
        return ""
    for extra in {name.split(".", 1)[0] for name in unexpected if "." in name}:
        if all(f"{extra}.{name}" in unexpected for name in missing):
            return f"The checkpoint's names start with '{extra}.' where the model's do not"
    for extra in {name.split(".", 1)[0] for name in missing if "." in name}:
        if all(name.startswith(f"{extra}.") and name[len(extra) + 1:] in unexpected for name in missing):
            return f"The model's names start with '{extra}.' where the checkpoint's do not"
    return ""


class SourceReader(StorageReader):
    """A ``torch.distributed.checkpoint`` reader over a `WeightSource`: each requested state-dict key is one whole
    tensor of the source (possibly a `View` of one), and DCP asks only for this rank's regions of it."""

    def __init__(self, source: WeightSource, requests: Mapping[str, tuple[str, View | None]],
                 sizes: Mapping[str, torch.Size]):
        super().__init__()
        self.source, self.requests, self.sizes = source, dict(requests), dict(sizes)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        tensors, storage = {}, {}
        for key, size in self.sizes.items():
            origin = [0] * len(size)
            tensors[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=self.source.dtype(self.requests[key][0])), size=torch.Size(size),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(origin), sizes=torch.Size(size))])
            storage[MetadataIndex(fqn=key, offset=origin)] = key
        return Metadata(state_dict_metadata=tensors, storage_data=storage)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future:
        items = sorted(plan.items, key=lambda item: self._order.get(item.storage_index.fqn, 0))
        with self.source.reading() as read:
            for item in items:
                source_name, view = self.requests[item.storage_index.fqn]
                index = [slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True)]
                if view is not None and view.dim is not None:
                    shifted = index[view.dim]
                    index[view.dim] = slice(shifted.start + view.start, shifted.stop + view.start)
                target = planner.resolve_tensor(item).detach()
                target.copy_(read(source_name, tuple(index)))
                planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    @property
    def _order(self) -> dict[str, int]:
        ordered = self.source.order([name for name, _ in self.requests.values()])
        rank = {name: i for i, name in enumerate(ordered)}
        return {key: rank[name] for key, (name, _) in self.requests.items()}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def load(module: nn.Module, plan: LoadPlan, views: Mapping[str, View] | None = None) -> None:
    """Fill ``module`` (this rank's part, named as in the whole model, or by ``views``) from ``plan``'s checkpoint,
    each rank reading only its regions (a collective: every rank calls it)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    alone = not (dist.is_available() and dist.is_initialized())  # one process: no collective to plan with
    views = views or {}
    state = get_model_state_dict(module)
    requests: dict[str, tuple[str, View | None]] = {}
    for key in list(state):
        view = views.get(key)
        plain = view.plain if view else key
        if plain in plan.kept:
            del state[key]
            continue
        if plain not in plan.source_of:
            raise WeightsError(f"weights={plan.source.path!r}: the prepared model's {key} is not in the checkpoint")
        requests[key] = (plan.source_of[plain], view)
    with warnings.catch_warnings():  # one process: DCP warns that it assumes so, which is right
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        if isinstance(plan.source, DistributedCheckpointSource):
            renamed = sorted(key for key, (name, view) in requests.items() if name != key or view is not None)
            if renamed:
                raise WeightsError(f"weights={plan.source.path!r}: a torch.distributed.checkpoint is read under the "
                                   f"model's own names, and these differ: {_listed(renamed)}; save the weights as "
                                   "safetensors (ctx.save_weights) to load them into this model")
            dcp.load({plan.source.prefix: state} if plan.source.prefix else state, checkpoint_id=plan.source.path,
                     no_dist=alone)
        else:
            sizes = {key: value.size() for key, value in state.items()}
            dcp.load(state, storage_reader=SourceReader(plan.source, requests, sizes), no_dist=alone)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))  # the kept buffers are not in it


@torch.no_grad()
def load_zero3_partitions(model: nn.Module, plan: LoadPlan, rank: int) -> None:
    """Write each ZeRO-3 parameter's partition on this rank from the rows of the checkpoint tensor it covers (rows
    whole, then cut to the flat range); buffers, which ZeRO-3 does not partition, whole. Not a collective, unless a
    DeepSpeed without the partition attributes makes it gather (`deepspeed_compat.local_partition`)."""
    named = list(model.named_parameters()) + [(k, b) for k, b in model.named_buffers() if k in plan.source_of]
    order = plan.source.order([plan.source_of[name] for name, _ in named if name in plan.source_of])
    position = {name: i for i, name in enumerate(order)}
    named.sort(key=lambda item: position.get(plan.source_of.get(item[0], ""), 0))
    with plan.source.reading() as read:
        for name, tensor in named:
            source_name = plan.source_of.get(name)
            if source_name is None:
                continue  # a buffer the checkpoint lacks
            part = deepspeed_compat.local_partition(tensor, rank) if isinstance(tensor, nn.Parameter) else None
            if part is None:
                _load_whole(tensor, read, source_name, rank)
                continue
            flat, start, count = part
            if count <= 0:
                continue
            shape = _shape(tensor)
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            if not shape:
                block = read(source_name, ()).reshape(-1)
                first = 0
            else:
                first, last = start // row, -(-(start + count) // row)
                block = read(source_name, (slice(first, last),)).reshape(-1)
            flat.narrow(0, 0, count).copy_(block.narrow(0, start - first * row, count))


def _load_whole(tensor: torch.Tensor, read: Any, source_name: str, rank: int) -> None:
    """A buffer, or a ZeRO-3 parameter without DeepSpeed's partition attributes (gathered, written by rank 0)."""
    whole = (slice(None),) * len(_shape(tensor))
    if not deepspeed_compat.is_partitioned(tensor):
        tensor.copy_(read(source_name, whole))
        return
    from deepspeed import zero

    with zero.GatheredParameters([tensor], modifier_rank=0):
        if rank == 0:
            tensor.copy_(read(source_name, whole))
