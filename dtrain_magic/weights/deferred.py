"""Deferred initialisation: build a model without storage, then give each rank only its part.

`parameters_on_meta` is what ``ctx.init_model()`` (and a model factory given to ``ctx.prepare``) uses for FSDP and
``--tp``/``--pp``: parameters created inside it live on torch's meta device (a shape and a dtype, no storage), while
buffers stay real, since models compute some in ``__init__`` (rotary frequencies, masks) and nothing could restore
them later (Accelerate's ``init_empty_weights`` makes the same choice). The strategy then cuts and shards the meta
model (``fully_shard``, ``parallelize_module``, the pipeline split all work on meta tensors), `materialize` gives
this rank's shards storage, and they are filled either from a checkpoint (`dtrain_magic.weights.loading`) or by
`initialise`: every module's own init (``reset_parameters``; a Hugging Face model's per-module init), run one module
at a time on a full-size copy whose slices this rank keeps. Modules are initialised in ``named_modules()`` order
with every rank holding rank 0's random state, so a model of torch layers gets the values a plain build with the same
seed gives (the order a module's ``__init__`` consumes random numbers is registration order for such models).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .._compat import transformers as transformers_compat
from ..errors import WeightsError


@dataclass(frozen=True)
class View:
    """A parameter of the prepared model that is a slice of one of the plain model's: ``plain`` narrowed on ``dim``
    from ``start`` for ``length`` (GPT-2's fused ``c_attn`` split into q, k, v under ``--tp``). ``dim`` None: the
    whole tensor under another name."""

    plain: str
    dim: int | None = None
    start: int = 0
    length: int = 0

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dim is None else tensor.narrow(self.dim, self.start, self.length)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device (no storage); buffers and plain tensors stay real.

    ``nn.Module.register_parameter`` (which ``module.weight = nn.Parameter(...)`` calls) is wrapped for the duration:
    the parameter is replaced by a meta one of the same class before it is registered. The empty tensor a layer
    creates first (``torch.empty``) is never written, so its pages are never touched."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = _meta_like(param)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _meta_like(param: nn.Parameter) -> nn.Parameter:
    meta = param.detach().to("meta")
    try:
        return type(param)(meta, requires_grad=param.requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        return nn.Parameter(meta, requires_grad=param.requires_grad)


def has_meta_parameters(module: nn.Module) -> bool:
    """True when ``module`` (or a part of it) was built without storage."""
    for param in module.parameters():
        local = getattr(param, "_local_tensor", None)  # a DTensor made from a meta tensor
        if param.is_meta or (local is not None and local.is_meta):
            return True
    return False


def refuse_meta_buffers(module: nn.Module) -> None:
    """A model built under ``torch.device("meta")`` has buffers without values (masks, rotary frequencies its
    ``__init__`` computed), which nothing could restore: a `WeightsError` names them."""
    names = [name for name, buffer in module.named_buffers() if buffer.is_meta]
    if names:
        raise WeightsError(
            f"{len(names)} buffer(s) of {type(module).__name__} are on the meta device, without values: "
            f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}. Build the model with ctx.init_model() or give "
            "ctx.prepare a factory (lambda: Net()): they put the parameters alone on the meta device"
        )


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give every parameter of ``module`` (this rank's shards) storage on ``device``, uninitialised. The real buffers
    keep their values and tied parameters stay tied (``to_empty`` alone would empty the one and untie the other)."""
    buffers = {name: buffer for name, buffer in module.named_buffers() if not buffer.is_meta}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((owner, name))
    module.to_empty(device=device)
    for group in holders.values():
        first = getattr(group[0][0], group[0][1])
        for owner, name in group[1:]:
            setattr(owner, name, first)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            kept = buffers.get(name)
            if kept is not None and kept is not buffer:
                buffer.copy_(kept)


def pristine_copy(model: nn.Module) -> nn.Module:
    """A copy of a model built without storage, kept whole and on meta to run its own init one module at a time
    (`initialise`) after the model itself is cut and sharded; copying meta parameters costs nothing (the real
    buffers are copied)."""
    import copy

    return copy.deepcopy(model)


def sync_random_state() -> None:
    """Every rank takes global rank 0's CPU random state, so the ranks' initialisations agree (and equal rank 0's
    plain build) even without ``--seed``."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    state = torch.get_rng_state()
    if dist.get_backend() == "nccl":
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    else:
        dist.broadcast(state, src=0)
    torch.set_rng_state(state)


def _init_function(module: nn.Module, root: nn.Module) -> Callable[[nn.Module], None] | None:
    """How ``module``'s own parameters get their initial values: its ``reset_parameters``, then (a Hugging Face
    model) the model's per-module init; None when neither exists."""
    steps = []
    if callable(getattr(module, "reset_parameters", None)):
        steps.append(lambda m: m.reset_parameters())
    model_init = transformers_compat.per_module_init(root)
    if model_init is not None:
        steps.append(model_init)
    if not steps:
        return None

    def run(m: nn.Module) -> None:
        for step in steps:
            step(m)

    return run


@torch.no_grad()
def initialise(target: nn.Module, pristine: nn.Module, views: Mapping[str, View] | None = None) -> None:
    """Fill ``target``'s parameters (this rank's shards and stages, any names ``views`` maps) with the values the
    model's own init gives ``pristine`` (the same model, unsharded, still on meta), one module at a time.

    A module with parameters and no init (no ``reset_parameters``, not a Hugging Face model) cannot be given values:
    a `WeightsError` lists them, before anything is written. A parameter two modules share is initialised by the
    first (as the tie of a plain build keeps one value)."""
    views = dict(views or {})
    targets = dict(target.named_parameters(remove_duplicate=False))
    wanted: dict[str, list[tuple[str, View | None]]] = {}
    for name in targets:
        view = views.get(name)
        wanted.setdefault(view.plain if view else name, []).append((name, view))
    modules = [(name, module, list(module.named_parameters(recurse=False)))
               for name, module in pristine.named_modules()]
    modules = [(name, module, direct) for name, module, direct in modules if direct]
    missing = [f"{name or type(pristine).__name__} ({type(module).__name__})"
               for name, module, _ in modules if _init_function(module, pristine) is None]
    if missing:
        raise WeightsError(
            f"cannot initialise {len(missing)} module(s) built without storage, which have parameters but no "
            f"reset_parameters(): {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}. Give them a "
            "reset_parameters() method, load the weights (ctx.prepare(..., weights=PATH)), or build the model without "
            "ctx.init_model() / a factory"
        )
    sync_random_state()
    done: set[int] = set()
    for module_name, module, direct in modules:
        fresh = [(name, param) for name, param in direct if id(param) not in done]
        if not fresh:
            continue
        done.update(id(param) for _, param in fresh)
        for name, param in fresh:  # full size, on the CPU (the plain build's random stream), for this module only
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                               requires_grad=param.requires_grad))
        _init_function(module, pristine)(module)
        for name, _ in fresh:
            full_name = f"{module_name}.{name}" if module_name else name
            value = getattr(module, name).detach()
            for target_name, view in wanted.get(full_name, []):
                copy_into(targets[target_name], view.of(value) if view else value)
            setattr(module, name, _meta_like(getattr(module, name)))  # its storage goes


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` (the whole tensor) into ``param``: a DTensor's local shard, else all."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.data.copy_(full)


def optimizer_for(optimizer: Any, params: Any) -> Any:
    """``optimizer`` as given to ``ctx.prepare``: an optimizer (returned as is), None, or a factory called with the
    prepared model's parameters (``lambda params: torch.optim.Adam(params, lr=1e-3)``,
    ``functools.partial(torch.optim.Adam, lr=1e-3)``): the trainable ones only (a peft model's frozen base weights
    get no optimizer state)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        return optimizer
    made = optimizer([param for param in params if param.requires_grad])
    if not isinstance(made, torch.optim.Optimizer) and not hasattr(made, "step"):
        raise TypeError(f"ctx.prepare: the optimizer factory returned {type(made).__name__}, not an optimizer; give "
                        "lambda params: torch.optim.Adam(params, lr=...)")
    return made


def is_factory(value: Any) -> bool:
    """A model factory (``ctx.prepare(lambda: Net(), ...)``): callable but not a module."""
    return callable(value) and not isinstance(value, nn.Module)
