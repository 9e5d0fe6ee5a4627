"""Per-process memory estimate for parameters, gradients and optimizer states (the ZeRO paper's model).

With Ψ parameters, N data-parallel processes and K bytes of optimizer state per parameter, the ZeRO
paper (Rajbhandari et al., 2020, section 3 and figure 1) gives, for mixed-precision Adam (2-byte
parameters and gradients, K = 12: fp32 master copy 4 + momentum 4 + variance 4):

    DP (DDP, ZeRO-0)   (2 + 2 + K) Ψ
    ZeRO-1             2Ψ + 2Ψ + KΨ/N
    ZeRO-2             2Ψ + (2 + K)Ψ/N
    ZeRO-3 (and FSDP)  (2 + 2 + K)Ψ/N

The fp32 equivalents use 4-byte parameters and gradients. Plain fp32 Adam holds only its two moments
(K = 8); DeepSpeed's ZeRO-1/2 optimizers also keep an fp32 copy of their partition as the "master"
weights even in fp32, so under ``--strategy deepspeed --zero 1/2 --precision fp32`` K = 12 again; ZeRO-3 steps
its fp32 partitions themselves (K = 8; ``_compat.deepspeed.share_fp32_partitions``).
DDP and FSDP with ``--precision bf16/fp16`` use autocast, which keeps the stored parameters,
gradients and optimizer states in fp32, so the fp32 numbers apply to them. FSDP (FULL_SHARD) shards
like ZeRO-3. Activations, temporary buffers and the framework's own overhead are not included.

Model parallelism (``--tp T``, ``--pp P``): each process holds 1/T of every layer and one of P stages, so its share
of the model is Ψ/(T·P) (assuming every layer is tensor-parallel and the stages are even); the formulas above then
apply to that share, with N = the data-parallel degree world/(T·P). Left out, beyond activations: layers a
tensor-parallel plan keeps replicated (embeddings, norms, biases of row-wise layers), uneven stages, and the
pipeline's in-flight micro-batches (a stage holds the activations of up to --microbatches of them, GPipe, or
about P, 1F1B) and its idle time (bubbles), which costs time rather than memory.

Beyond the model states, each strategy allocates buffers of its own, which set the peak a process really reaches:
DDP's gradient buckets (a second copy of every gradient), FSDP's unsharded blocks (the one in use, the next one
prefetched, and the unsharded gradient), DeepSpeed's reduce and all-gather buckets and ZeRO-3's gathered parameters,
and Adam's step temporaries (about two copies of the largest tensor it steps at once: a parameter, or ZeRO-1/2's
whole flat partition). Given the model's `ModelFacts` (its largest parameter and block, its hidden size), `estimate`
adds each strategy's `Strategy.memory_buffers` to the states; without them (a size typed in the panel) it gives the
states alone.

Activations, given a sample batch (``ctx.prepare(..., sample=batch)``): `Activations` holds the bytes one
micro-batch keeps from the forward for the backward under each ``--ac`` mode, measured on the meta device by
`dtrain_magic.worker.activations.measure`; `estimate` adds the run's mode, whole on every process (data parallelism
splits the batch, not a sample's activations; with ``--tp``/``--pp`` the whole model's, an upper bound). When the
total exceeds the device, `fit_options` gives what each knob (``--ac``, ``--zero 3``, ``--offload params``, a smaller
micro-batch) would make it, and `check_fits` names those that fit.

Everything here is pure arithmetic except :func:`device_memory_bytes`, :func:`optimizer_state_bytes`,
:func:`model_facts` and :func:`blocks` (which look at a model, real or on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .._compat import deepspeed as deepspeed_compat
from ..errors import ConfigError, log_dropped
from ..flagtable import BY_FIELD
from ..registry import STRATEGIES

ADAM_MIXED_K = 12  # fp32 master weights + momentum + variance, bytes per parameter
ADAM_MOMENTS_FP32 = 8  # momentum + variance in fp32
AC_MODES = ("none", "selective", "full")  # --ac, from the least saved to the most


@dataclass(frozen=True)
class Activations:
    """Bytes of activations one micro-batch of ``micro_batch`` rows holds, per ``--ac`` mode (``none``, ``selective``,
    ``full``): ``kept``, what the forward keeps for the backward (with checkpointing, a checkpointed block's input
    instead of its activations); ``recomputed``, the largest checkpointed block's activations, rebuilt in the
    backward while the rest is still kept (0 without checkpointing). Measured from a sample batch
    (`dtrain_magic.worker.activations.measure`); ``blocks``: the checkpointable blocks found (0: none, so every mode
    keeps the same)."""

    micro_batch: int
    kept: Mapping[str, float]
    recomputed: Mapping[str, float]
    blocks: int = 0

    def bytes(self, ac: str = "none") -> float:
        """The peak of activations under ``--ac ac``: what is kept plus one recomputed block."""
        return self.kept[ac] + self.recomputed[ac]

    def at(self, micro_batch: int) -> "Activations":
        """The same model at another micro-batch size: activations scale with the rows."""
        scale = micro_batch / self.micro_batch
        return replace(self, micro_batch=micro_batch, kept={m: v * scale for m, v in self.kept.items()},
                       recomputed={m: v * scale for m, v in self.recomputed.items()})


@dataclass(frozen=True)
class CellModel:
    """The parameter count of the model a cell's training function prepares, when it can be known
    without training (``num_params``), and where it came from or why it is unknown (``description``)."""

    num_params: int | None
    description: str
    facts: Any = None  # the model's `ModelFacts` (largest parameter and block, hidden size), when it was built
    # measured from ``ctx.prepare(..., sample=...)`` when the sample is known before training (every --ac mode)
    activations: Activations | None = None
    sample_note: str = ""  # where the sample came from, or why its activations are not known before training

    @property
    def found(self) -> bool:
        return self.num_params is not None


@dataclass(frozen=True)
class MemoryModel:
    """How a strategy stores one parameter (its `Strategy.memory_model`): which ZeRO stage its sharding is (0:
    replicated, 1: optimizer states sharded, 2: and gradients, 3: and parameters) and the bytes per parameter of
    the parameter, its gradient and the optimizer states (K), of which Adam's two moments."""

    stage: int
    param_bytes: int = 4
    grad_bytes: int = 4
    optimizer_bytes: int = ADAM_MOMENTS_FP32
    moment_bytes: int = ADAM_MOMENTS_FP32


@dataclass(frozen=True)
class ModelFacts:
    """What the buffers of the strategies depend on, read from a model (real, on meta, or ZeRO-3 partitioned):
    ``largest_param`` and ``largest_block`` in elements (a block: what FSDP wraps as a unit and ZeRO-3 gathers at
    once, see `blocks`), ``hidden`` (the model config's ``hidden_size``, else the largest smaller side of a 2-D
    parameter: the width DeepSpeed's buckets are sized by), ``blocks`` (how many)."""

    num_params: int
    largest_param: int
    largest_block: int
    hidden: int
    blocks: int = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected bytes per process for one strategy/stage/precision/world size."""

    strategy: str
    zero: int | None
    precision: str
    world_size: int
    num_params: int
    params: float
    grads: float
    optimizer: float
    optimizer_moments: float  # the part of ``optimizer`` that is Adam's momentum + variance
    tp: int = 1
    pp: int = 1
    strategy_label: str = ""  # as the strategy names itself (``deepspeed ZeRO-2``)
    buffer_parts: tuple[tuple[str, float], ...] = field(default=())  # (what, bytes): the strategy's own buffers
    activations: float = 0.0  # one micro-batch's, under ``ac`` (`Activations.bytes`); 0 without a sample batch
    ac: str = "none"
    sample: Activations | None = None  # what ``activations`` came from (every --ac mode), when measured

    @property
    def buffers(self) -> float:
        return sum(size for _, size in self.buffer_parts)

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer states (the ZeRO paper's model states)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The expected peak per process: the model states, the strategy's buffers and, when measured, the
        activations of one micro-batch."""
        return self.states + self.buffers + self.activations

    @property
    def label(self) -> str:
        label = self.strategy_label or self.strategy
        degrees = (("tp", self.tp), ("pp", self.pp))
        return label + "".join(f" x {name} {degree}" for name, degree in degrees if degree > 1)

    def line(self) -> str:
        """One line for the cell's output."""
        text = (
            f"memory estimate ({self.label}, {self.precision}, {self.world_size} process"
            f"{'es' if self.world_size != 1 else ''}, {self.num_params:,} parameters): "
            f"params {format_bytes(self.params)} + grads {format_bytes(self.grads)} + optimizer "
            f"{format_bytes(self.optimizer)}"
            + (f" + buffers {format_bytes(self.buffers)}" if self.buffer_parts else "")
            + (f" + activations {format_bytes(self.activations)}" if self.sample is not None else "")
            + f" = {format_bytes(self.total)} per process"
        )
        if self.sample is not None:
            others = ", ".join(f"{mode} {format_bytes(self.sample.bytes(mode))}"
                               for mode in AC_MODES if mode != self.ac)
            text += f" (activations: micro-batch {self.sample.micro_batch}, --ac {self.ac}; --ac {others})"
        if self.tp > 1 or self.pp > 1:
            text += (" (an even 1/" + str(self.tp * self.pp) + " of the model each; not counted: "
                     + ("activations, " if self.sample is None else "")
                     + "replicated layers" + (", the pipeline's in-flight micro-batches" if self.pp > 1 else "") + ")")
        return text


def strategy_class(strategy: str | type) -> Any:
    """A `Strategy` class, or the one registered under that name (`ValueError` when none is)."""
    if isinstance(strategy, type):
        return strategy
    try:
        return STRATEGIES.facts(strategy)
    except ConfigError:
        raise ValueError(f"unknown strategy {strategy!r}") from None


def memory_model(strategy: str | type, zero: int | None, precision: str) -> MemoryModel:
    """The strategy's `MemoryModel` for ``zero`` and ``precision`` (``strategy``: its class or registered name)."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    return strategy_class(strategy).memory_model(zero, precision)


def estimate(num_params: int, strategy: str | type | None = None, zero: int | None = None, precision: str = "fp32",
             world_size: int = 1, k: int | None = None, tp: int = 1, pp: int = 1, facts: ModelFacts | None = None,
             settings: Mapping[str, Any] | None = None, activations: Activations | None = None,
             ac: str = "none") -> MemoryEstimate:
    """Per-process bytes for parameters, gradients and optimizer states; ``k`` overrides K. With ``tp``/``pp``
    each process holds an even 1/(tp x pp) of the model, sharded further over the world/(tp x pp) replicas. With
    ``facts`` (the model's, `model_facts`), the strategy's own buffers too (`Strategy.memory_buffers`; ``settings``:
    the strategy's sizes, DeepSpeed's ``zero_optimization`` section). With ``activations`` (measured from a sample
    batch), one micro-batch's under ``--ac ac``, whole on every process. ``strategy`` None: the default one."""
    if ac not in AC_MODES:
        raise ValueError(f"unknown --ac mode {ac!r}; one of {', '.join(AC_MODES)}")
    strategy = STRATEGIES.default if strategy is None else strategy
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp {tp} x pp {pp}")
    psi, n = float(num_params) / (tp * pp), float(world_size // (tp * pp))
    model = memory_model(strategy, zero, precision)
    p, g, kk, moments, stage = (model.param_bytes, model.grad_bytes, model.optimizer_bytes, model.moment_bytes,
                                model.stage)
    if k is not None:
        kk = k
        moments = min(moments, k)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optimizer = kk * psi / (n if stage >= 1 else 1)
    optimizer_moments = moments * psi / (n if stage >= 1 else 1)
    cls = strategy_class(strategy)
    zero = (zero or 0) if "zero" in cls.own_fields else None  # ZeRO's stage, as DeepSpeed numbers it
    parts: tuple[tuple[str, float], ...] = ()
    if facts is not None:
        parts = tuple((what, float(size)) for what, size in cls.memory_buffers(
            facts, zero, precision, world_size, tp=tp, pp=pp, settings=settings or {}) if size > 0)
    return MemoryEstimate(cls.name, zero, precision, world_size, int(num_params), params, grads, optimizer,
                          optimizer_moments, tp, pp, cls.label(zero), parts,
                          activations.bytes(ac) if activations is not None else 0.0, ac, activations)


def table(num_params: int, precision: str = "fp32", world_size: int = 2, tp: int = 1, pp: int = 1) -> str:
    """A text table of the estimate for every strategy and stage (for the dry run or the docs); with ``tp``/``pp``,
    the strategies that support them (ddp, fsdp)."""
    rows = []
    for cls in STRATEGIES.all_facts().values():  # every registered strategy; each ZeRO stage of the --zero owner
        if (tp > 1 or pp > 1) and cls.model_parallel_refusal:
            continue
        stages = BY_FIELD["zero"].choices if "zero" in cls.own_fields else (None,)
        rows += [estimate(num_params, cls, stage, precision, world_size, tp=tp, pp=pp) for stage in stages]
    header = f"{'strategy':<22}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
    lines = [f"memory per process: {num_params:,} parameters, {precision}, {world_size} processes", header]
    for r in rows:
        lines.append(f"{r.label:<22}{format_bytes(r.params):>12}{format_bytes(r.grads):>12}"
                     f"{format_bytes(r.optimizer):>12}{format_bytes(r.total):>12}")
    return "\n".join(lines)


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def device_memory_bytes(device: Any = None, processes_per_device: int = 1) -> int | None:
    """Memory one process may use: the GPU's total memory, or the host's RAM shared by its processes."""
    try:
        import torch

        if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
            index = getattr(device, "index", None) or 0
            return int(torch.cuda.get_device_properties(index).total_memory)
    except Exception as exc:  # torch missing or a broken CUDA runtime: the host's memory instead
        log_dropped(__name__, "device_memory_bytes", exc)
    try:
        import psutil

        return int(psutil.virtual_memory().total // max(1, processes_per_device))
    except Exception as exc:  # psutil missing or refusing: no memory figure
        log_dropped(__name__, "device_memory_bytes", exc)
        return None


def check_fits(est: MemoryEstimate, available: int | None, options: Sequence[tuple[str, float]] = ()) -> str | None:
    """A warning line when the estimate exceeds ``available`` bytes, else None. ``options`` (`fit_options`): each
    knob and the estimate it gives; those that fit are named with their numbers, else the closest."""
    if available is None or est.total <= available:
        return None
    what = ("parameters, gradients, optimizer states, buffers and activations" if est.sample is not None
            else "parameters, gradients and optimizer states alone")
    text = (f"warning: the estimate ({format_bytes(est.total)} per process for {what}) exceeds the device's memory "
            f"({format_bytes(available)}); ")
    fitting = [f"{knob} ({format_bytes(size)})" for knob, size in options if size <= available]
    if fitting:
        return text + "it fits with " + ", or ".join(fitting)
    if options:
        knob, size = min(options, key=lambda option: option[1])
        text += f"no knob alone makes it fit (the closest: {knob}, {format_bytes(size)}); "
    return text + "consider a higher --zero stage, --strategy fsdp, --precision bf16, more processes, or --tp/--pp"


def fit_options(est: MemoryEstimate, facts: ModelFacts | None = None, on_gpu: bool = False,
                available: float | None = None) -> list[tuple[str, float]]:
    """What each knob alone would make ``est``'s total, as (knob, bytes per process): a stronger ``--ac`` (with a
    measured sample), ``--zero 3`` (where the strategy does not shard parameters already), ``--offload params`` on a
    GPU (the states move to the CPU: the device keeps the buffers and activations), and the largest smaller
    micro-batch (halving) that fits ``available``, else a micro-batch of 1."""
    options: list[tuple[str, float]] = []
    sample, rest = est.sample, est.total - est.activations
    if sample is not None and est.pp == 1:  # --ac is refused with --pp
        options += [(f"--ac {mode}", rest + sample.bytes(mode)) for mode in AC_MODES[AC_MODES.index(est.ac) + 1:]]
    sharded = memory_model(est.strategy, est.zero, est.precision).stage >= 3
    if not sharded and est.tp * est.pp == 1 and est.world_size > 1:
        zero3 = estimate(est.num_params, "deepspeed", 3, est.precision, est.world_size, facts=facts,
                         activations=sample, ac=est.ac)
        options.append(("--zero 3", zero3.total))
    if on_gpu:
        options.append(("--offload params" if sharded else "--strategy fsdp --offload params",
                        est.buffers + est.activations))
    if sample is not None and sample.micro_batch > 1:
        rows = sample.micro_batch // 2
        while rows > 1 and available is not None and rest + sample.at(rows).bytes(est.ac) > available:
            rows //= 2
        options.append((f"a micro-batch of {rows} row{'s' if rows > 1 else ''} (the sample has {sample.micro_batch})",
                        rest + sample.at(rows).bytes(est.ac)))
    return options


def count_parameters(model: Any) -> int:
    """Number of parameters of a plain (not yet sharded) module, counting shared tensors once (a ZeRO-3
    partitioned parameter by its whole shape)."""
    return sum(_numel(param) for param in {id(p): p for p in model.parameters()}.values())


def report(model: Any, strategy: str | type, zero: int | None, precision: str, world_size: int,
           device: Any = None, processes_per_device: int = 1, tp: int = 1, pp: int = 1,
           settings: Mapping[str, Any] | None = None, activations: Activations | None = None,
           ac: str = "none") -> tuple[MemoryEstimate, str]:
    """The estimate for ``model`` and its line (with the warning, naming the knobs that would fit, when it does
    not fit), as printed by wrap(). ``activations``: measured from ``ctx.prepare``'s sample, under ``--ac ac``."""
    facts = model_facts(model)
    est = estimate(facts.num_params, strategy, zero, precision, world_size, tp=tp, pp=pp, facts=facts,
                   settings=settings, activations=activations, ac=ac)
    available = device_memory_bytes(device, processes_per_device)
    on_gpu = getattr(device, "type", str(device)) == "cuda"
    warning = check_fits(est, available, fit_options(est, facts, on_gpu, available))
    return est, est.line() + (f"\n{warning}" if warning else "")


def _numel(tensor: Any) -> int:
    shape = deepspeed_compat.full_shape(tensor)  # a ZeRO-3 partitioned parameter
    if shape is None:
        return int(tensor.numel())
    n = 1
    for d in shape:
        n *= d
    return n


def blocks(model: Any) -> list[Any]:
    """The model's blocks: what FSDP wraps as units (then the root takes the rest) and what ZeRO-3 gathers at once.

    Every direct child with parameters, except that a ``ModuleList``/``ModuleDict`` gives each of its entries, and a
    child holding such a list (a Hugging Face ``GPT2Model`` inside ``GPT2LMHeadModel``) is looked into the same way,
    so that a transformer's blocks are units, not the whole trunk. A candidate sharing a parameter with another
    (tied embeddings) stays with the root."""
    import torch

    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)

    def has_params(module: Any) -> bool:
        return any(True for _ in module.parameters())

    def holds_list(module: Any) -> bool:
        return any(isinstance(m, containers) for m in module.modules())

    def candidates(module: Any) -> list[Any]:
        found = []
        for child in module.children():
            if not has_params(child):
                continue
            if isinstance(child, containers):
                found += [entry for entry in child.children() if has_params(entry)]
            elif holds_list(child):
                found += candidates(child)
            else:
                found.append(child)
        return found

    chosen = candidates(model)
    owners: dict[int, int] = {}
    for index, block in enumerate(chosen):
        for param in block.parameters():
            owners.setdefault(id(param), index)
    shared = {index for index, block in enumerate(chosen)
              for param in block.parameters() if owners[id(param)] != index}
    shared |= {owners[id(param)] for index in shared for param in chosen[index].parameters()}
    return [block for index, block in enumerate(chosen) if index not in shared]


def model_facts(model: Any) -> ModelFacts:
    """`ModelFacts` of a plain (not yet sharded) model: on meta, real, or ZeRO-3 partitioned."""
    params = {id(p): p for p in model.parameters()}
    sizes = [_numel(p) for p in params.values()]
    block_sizes = [sum(_numel(p) for p in {id(q): q for q in block.parameters()}.values()) for block in blocks(model)]
    block_sizes.append(sum(sizes) - sum(block_sizes))  # what stays with the root: a unit of its own
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int) or hidden <= 0:
        sides = [min(deepspeed_compat.full_shape(p) or tuple(p.shape)) for p in params.values()
                 if len(deepspeed_compat.full_shape(p) or tuple(p.shape)) == 2]
        hidden = max(sides, default=max(sizes, default=1))
    return ModelFacts(num_params=sum(sizes), largest_param=max(sizes, default=0),
                      largest_block=max(block_sizes + sizes, default=0), hidden=int(hidden),
                      blocks=len([size for size in block_sizes if size > 0]) or 1)


def _inner_optimizers(optimizer: Any):
    """The torch optimizers inside a wrapper (DeepSpeed's ZeRO/BF16 optimizers keep theirs in ``.optimizer``)."""
    import torch

    seen, current = set(), optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer) and not hasattr(current, "optimizer"):
            yield current
            return
        inner = getattr(current, "optimizer", None)
        if inner is None:
            if isinstance(current, torch.optim.Optimizer):
                yield current
            return
        current = inner


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes this process holds in the optimizer's state tensors (Adam's moments), local shards only."""
    total = 0
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            for value in state.values():
                total += _local_bytes(value)
    return total


def _local_bytes(value: Any) -> int:
    import torch

    if not isinstance(value, torch.Tensor):
        return 0
    local = getattr(value, "to_local", None)  # DTensor (FSDP2): count this rank's shard
    if callable(local):
        value = local()
    if value.dim() == 0:
        return 0  # Adam's step counter
    return value.numel() * value.element_size()

