"""Tensor parallelism for Hugging Face GPT-2 blocks (``transformers`` ``GPT2Attention`` / ``GPT2MLP``).

GPT-2 differs from the layers torch's ``ColwiseParallel`` / ``RowwiseParallel`` know, in three ways, each solved here:

- its projections are ``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b`` with ``W`` of shape (in, out), the
  transpose of ``nn.Linear``'s. `Conv1DColwiseParallel` shards ``W`` on dim 1 (and ``b``), `Conv1DRowwiseParallel`
  on dim 0 (``b`` replicated, added once after the all-reduce); both reuse torch's input/output handling;
- the query, key and value projections are fused in one ``c_attn`` of width 3 x hidden: cutting its columns in
  N would give rank 0 all of the queries and half of the keys. `SplitQKV` replaces ``c_attn`` by three
  projections ``q``, ``k``, ``v`` (same numbers) whose outputs it concatenates; each is sharded by columns, so
  rank r holds the query, key and value columns of its own heads, and its ``c_attn`` output is
  ``[q_r, k_r, v_r]``;
- the attention splits that output with ``split_size`` (the hidden size) and reads its head count: both are made
  per rank (hidden / N, heads / N).

`plain_state_dict` turns a gathered state dict back into GPT-2's own layout (``c_attn.weight`` of width 3 x hidden),
so ``ctx.full_state_dict()`` loads into a plain ``GPT2LMHeadModel``. Sharded checkpoints keep ``q``/``k``/``v``
apart (each an ordinary column shard, which torch.distributed.checkpoint can reshard). Dropout inside the sharded
attention draws each rank's own random numbers (as any parallel run): equal to one process only without dropout.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..weights.deferred import View

_QKV = ("q", "k", "v")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (recognised by shape, so transformers need not be imported)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


def _shard_parameter(module: nn.Module, name: str, placement: Any, mesh: Any, src_data_rank: int | None) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    distributed = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``Conv1D``: weight (in, out) sharded on its output columns, bias with them."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _shard_parameter(module, "weight", Shard(1), device_mesh, self.src_data_rank)
        _shard_parameter(module, "bias", Shard(0), device_mesh, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            raise NotImplementedError(f"Conv1DColwiseParallel shards transformers' Conv1D, not {type(module).__name__}")
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Conv1D``: weight (in, out) sharded on its input rows, bias replicated."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _shard_parameter(module, "weight", Shard(0), device_mesh, self.src_data_rank)
        _shard_parameter(module, "bias", Replicate(), device_mesh, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            raise NotImplementedError(f"Conv1DRowwiseParallel shards transformers' Conv1D, not {type(module).__name__}")
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class SplitQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three projections ``q``, ``k``, ``v``; ``forward`` concatenates their outputs,
    so the attention code that splits ``c_attn``'s output runs unchanged."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module):
        super().__init__()
        self.q, self.k, self.v = q, k, v

    @classmethod
    def from_fused(cls, fused: nn.Module, width: int) -> "SplitQKV":
        parts = []
        with torch.no_grad():
            for index in range(3):
                part = type(fused)(width, fused.nx)  # Conv1D(nf, nx)
                part.to(device=fused.weight.device, dtype=fused.weight.dtype)
                part.weight.copy_(fused.weight[:, index * width:(index + 1) * width])
                part.bias.copy_(fused.bias[index * width:(index + 1) * width])
                parts.append(part)
        return cls(*parts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden), self.k(hidden), self.v(hidden)], dim=-1)


def is_gpt2(model: nn.Module) -> bool:
    return any(type(m).__name__ == "GPT2Attention" for m in model.modules())


def gpt2_plan(model: nn.Module, tp: int) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, View]]:
    """Prepare ``model``'s GPT-2 blocks for ``tp``-way tensor parallelism (in place, before sharding) and return
    the ``parallelize_module`` plan, the parameter renames (``c_attn.weight`` -> its q, k, v parts) and each part as
    a slice of the fused parameter (columns of the weight, entries of the bias)."""
    styles: dict[str, Any] = {}
    renames: dict[str, list[str]] = {}
    views: dict[str, View] = {}
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind == "GPT2Attention":
            if getattr(module, "is_cross_attention", False) or hasattr(module, "q_attn"):
                raise ValueError(f"--tp: {name} is a cross-attention block, which the GPT-2 plan does not shard; "
                                 "give ctx.prepare(..., tp_plan=...) for this model")
            heads, hidden = module.num_heads, module.split_size
            if heads % tp:
                raise ValueError(f"--tp {tp}: {name} has {heads} attention heads, not divisible by {tp}; "
                                 f"use a --tp that divides {heads}")
            module.c_attn = SplitQKV.from_fused(module.c_attn, hidden)
            for part in _QKV:
                styles[f"{name}.c_attn.{part}"] = Conv1DColwiseParallel()
            styles[f"{name}.c_proj"] = Conv1DRowwiseParallel()
            for param in ("weight", "bias"):
                renames[f"{name}.c_attn.{param}"] = [f"{name}.c_attn.{part}.{param}" for part in _QKV]
                dim = 1 if param == "weight" else 0  # Conv1D's weight is (in, out): q, k, v are column blocks
                for index, part in enumerate(_QKV):
                    views[f"{name}.c_attn.{part}.{param}"] = View(f"{name}.c_attn.{param}", dim, index * hidden, hidden)
            # what the attention's forward reads, now per rank: its heads and its share of each of q, k, v
            module.num_heads = heads // tp
            module.split_size = hidden // tp
        elif kind == "GPT2MLP":
            inner = module.c_fc.nf
            if inner % tp:
                raise ValueError(f"--tp {tp}: {name} has an inner width of {inner}, not divisible by {tp}")
            styles[f"{name}.c_fc"] = Conv1DColwiseParallel()
            styles[f"{name}.c_proj"] = Conv1DRowwiseParallel()
    return styles, renames, views


def plain_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (gathered) state with ``...c_attn.{q,k,v}.{weight,bias}`` -> GPT-2's fused ``...c_attn.{weight,bias}``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        head, _, param = key.rpartition(".")
        prefix, _, part = head.rpartition(".")
        if part in _QKV and prefix.endswith("c_attn") and param in ("weight", "bias"):
            if part == "q":
                pieces = [state[f"{prefix}.{p}.{param}"] for p in _QKV]
                out[f"{prefix}.{param}"] = torch.cat(pieces, dim=1 if param == "weight" else 0)
            continue
        out[key] = value
    return out
