"""``--clip-grad NORM``: clip the global gradient norm, over every shard, before the optimizer step.

The norm is torch's (``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``, as in
``clip_grad_norm_``), taken so that every rank gets the norm of the *whole* model's gradient, as one process
training the plain model would:

- plain tensors (DDP: every rank holds the whole, already averaged gradient) give it directly;
- DTensor gradients (FSDP2's shards, tensor-parallel shards, both on a 2-D mesh) give a DTensor norm that is a
  partial value on each rank: ``full_tensor()`` reduces it over its mesh (torchtitan's ``clip_grad_norm_`` does
  the same). Gradients on different meshes (a tensor-parallel model with some layers left plain) are normed per
  mesh, then together;
- pipeline stages (``--pp``) each hold their own layers: the stages' norms are combined over the pipeline group.

DeepSpeed clips inside its engine (its ``gradient_clipping`` config key, `deepspeed.build_config`), so this module
serves the torch strategies (DDP, FSDP, ``--tp``/``--pp``). torch is imported by the functions (worker side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch


def total_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of ``parameters`` together, the same plain tensor on every rank
    (a collective under FSDP, ``--tp`` and ``--pp``: every rank must call it)."""
    import torch
    import torch.distributed as dist

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False)
        full_tensor = getattr(norm, "full_tensor", None)
        norms.append(full_tensor() if callable(full_tensor) else norm)  # a DTensor's partial norm, reduced
    if not norms:
        norm = torch.zeros(())
    elif len(norms) == 1:
        norm = norms[0]
    else:  # the p-norm of the groups' p-norms is the p-norm of them all
        norm = torch.nn.utils.get_total_norm([n.reshape(1).to(norms[0].device) for n in norms], norm_type)
    if pp_group is not None:  # each stage holds its own layers: combine the stages' norms
        norm = norm.clone()
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm ** norm_type
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
            norm = norm ** (1.0 / norm_type)
    return norm


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   pp_group: Any = None) -> float:
    """Scale every gradient of ``parameters`` so that their global norm is at most ``max_norm`` (torch's
    ``clip_grads_with_norm_``: by ``max_norm / (norm + 1e-6)`` when that is below 1); returns the global norm before
    clipping, as a float, the same on every rank."""
    import torch

    params = [p for p in parameters if p.grad is not None]
    norm = total_norm(params, norm_type, pp_group)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
