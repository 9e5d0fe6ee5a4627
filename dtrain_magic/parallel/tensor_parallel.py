"""Tensor-parallel plans (``--tp``): which submodule is sharded how, as torch's ``parallelize_module`` takes them.

``ctx.prepare(..., tp_plan=...)`` takes the user's plan: a dict of module names (``*`` matches any one name part,
as in ``parallelize_module``) to a ``ParallelStyle`` or one of the style names of Hugging Face's plans
(``"colwise"``, ``"rowwise"``, ``"colwise_rep"``, ``"rowwise_rep"``). Without one, `plan_for` picks, in this order:

1. Hugging Face GPT-2 (``GPT2Attention``/``GPT2MLP`` blocks): `hf_gpt2.gpt2_plan` (fused q/k/v split per head
   group, ``Conv1D`` styles, per-rank head counts);
2. a Hugging Face model whose config has a ``base_model_tp_plan`` (Llama, Mistral, Qwen, ...): that plan, reused,
   when it only uses column/row styles; head counts must divide by the degree;
3. consecutive ``nn.Linear`` layers inside every ``nn.Sequential``: pairs separated only by element-wise layers
   (activations, dropout) become column-wise then row-wise (one all-reduce per pair); a Linear left without a
   partner is column-wise with its output gathered.

Everything else stays replicated on the tensor-parallel ranks (embeddings, norms, other layers): still correct,
only not sharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Callable, Mapping

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from . import hf_gpt2

# Hugging Face plan names that mean torch's column/row styles (transformers.distributed.tensor_parallel)
HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}

# Layers that act on each feature alone: a column-sharded activation can pass through them unchanged.
ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Mish,
    nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Dropout, nn.Identity,
)


@dataclass
class TensorParallelPlan:
    """``styles`` for ``parallelize_module``; ``renames``: parameter names of the user's model that the plan's
    module changes replaced (old name -> new names, for the optimizer); ``views``: each new name as a slice of the
    old one (`weights.deferred.View`: for loading a checkpoint of the user's model, and initialising); ``to_plain``:
    turns a gathered state dict back into the user's model's layout; ``description`` for the run's output."""

    styles: dict[str, ParallelStyle]
    description: str
    renames: dict[str, list[str]] = field(default_factory=dict)
    to_plain: list[Callable[[dict], dict]] = field(default_factory=list)
    views: dict[str, Any] = field(default_factory=dict)


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the submodules ``pattern`` selects, as ``parallelize_module`` resolves it (``fnmatch`` per part)."""
    tokens = pattern.split(".")
    found = []
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) != len(tokens):
            continue
        if all(fnmatch(part, token) for part, token in zip(parts, tokens, strict=True)):
            found.append(name)
    return found


def user_styles(model: nn.Module, plan: Mapping[str, Any], skip_missing: bool = False) -> dict[str, ParallelStyle]:
    """The user's ``tp_plan`` with style names turned into styles; every key must name a submodule."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"ctx.prepare(tp_plan=...) must be a dict of module name -> ParallelStyle, "
                        f"got {type(plan).__name__}")
    styles: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if isinstance(style, str):
            if style not in HF_STYLES:
                raise ValueError(f"tp_plan[{key!r}] = {style!r}: unknown style name; allowed: {', '.join(HF_STYLES)} "
                                 "or a torch ParallelStyle")
            style = HF_STYLES[style]()
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"tp_plan[{key!r}] must be a ParallelStyle (ColwiseParallel(), ...), "
                            f"got {type(style).__name__}")
        if not matching_modules(model, key):
            if skip_missing:
                continue  # a part of another pipeline stage
            names = [n for n, _ in model.named_modules() if n][:12]
            raise ValueError(f"tp_plan key {key!r} matches no submodule of {type(model).__name__}; its modules: "
                             f"{', '.join(names)}...")
        styles[key] = style
    return styles


def sequential_styles(model: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """Column/row pairs of consecutive Linears in every nn.Sequential (see the module docstring)."""
    styles: dict[str, ParallelStyle] = {}
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())

        def full(n: str, p: str = prefix) -> str:
            return f"{p}.{n}" if p else n

        i = 0
        while i < len(children):
            name, child = children[i]
            if not isinstance(child, nn.Linear) or child.out_features % tp:
                i += 1
                continue
            j = i + 1
            while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                j += 1
            if j < len(children) and isinstance(children[j][1], nn.Linear):
                styles[full(name)] = ColwiseParallel()
                styles[full(children[j][0])] = RowwiseParallel()
                i = j + 1
            else:
                styles[full(name)] = ColwiseParallel(output_layouts=Replicate())
                i += 1
    return styles


def hf_config_styles(model: nn.Module, tp: int) -> dict[str, ParallelStyle] | None:
    """The model's own Hugging Face ``base_model_tp_plan``, prefixed to where the base model sits; None if none."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    prefix = prefix if isinstance(base, nn.Module) and base is not model else ""
    for attribute in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"--tp {tp}: the model's {attribute} is {value}, not divisible by {tp}; "
                             f"use a --tp that divides it")
    unknown = sorted({style for style in plan.values() if style not in HF_STYLES})
    if unknown:
        raise ValueError(f"--tp: {type(model).__name__}'s Hugging Face tensor-parallel plan uses {', '.join(unknown)}, "
                         "which this plan reader does not map; give ctx.prepare(..., tp_plan=...)")
    return {(f"{prefix}.{key}" if prefix else key): HF_STYLES[style]() for key, style in plan.items()}


def plan_for(model: nn.Module, tp: int, user_plan: Mapping[str, Any] | None = None,
             skip_missing: bool = False) -> TensorParallelPlan:
    """The plan for ``model`` (changing GPT-2 blocks in place, see `hf_gpt2`); raises ValueError when there is
    nothing to shard."""
    kind = type(model).__name__
    if user_plan is not None:
        styles = user_styles(model, user_plan, skip_missing)
        return TensorParallelPlan(styles, f"tp_plan from ctx.prepare: {len(styles)} entries")
    if hf_gpt2.is_gpt2(model):
        styles, renames, views = hf_gpt2.gpt2_plan(model, tp)
        return TensorParallelPlan(styles, f"GPT-2 plan: {len(styles)} projections sharded (q/k/v per head group)",
                                  renames, [hf_gpt2.plain_state_dict], views)
    styles = hf_config_styles(model, tp)
    if styles is not None:
        return TensorParallelPlan(styles, f"{kind}'s Hugging Face base_model_tp_plan ({len(styles)} entries)")
    styles = sequential_styles(model, tp)
    if not styles:
        raise ValueError(
            f"--tp {tp}: no automatic tensor-parallel plan for {kind} (it has no nn.Sequential of Linear layers with "
            f"widths divisible by {tp}, and is not a GPT-2 or Hugging Face model with a tp plan); give "
            "ctx.prepare(model, opt, ..., tp_plan={'layer.name': ColwiseParallel(), ...}) as parallelize_module takes"
        )
    return TensorParallelPlan(styles, f"consecutive Linear layers: {_summary(styles)}")


def _summary(styles: Mapping[str, ParallelStyle]) -> str:
    names = {ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}
    return ", ".join(f"{key} {names.get(type(style), type(style).__name__)}" for key, style in styles.items())


def apply(model: nn.Module, tp_mesh: Any, plan: TensorParallelPlan) -> nn.Module:
    """Shard ``model`` on ``tp_mesh`` (rank 0's values of the tensor-parallel group are the ones kept)."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, plan.styles)


__all__ = ["HF_STYLES", "TensorParallelPlan", "apply", "matching_modules", "plan_for"]
