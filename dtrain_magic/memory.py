"""Per-process memory estimate for parameters, gradients and optimizer states (the ZeRO paper's model).

With Ψ parameters, N data-parallel processes and K bytes of optimizer state per parameter, the ZeRO
paper (Rajbhandari et al., 2020, section 3 and figure 1) gives, for mixed-precision Adam (2-byte
parameters and gradients, K = 12: fp32 master copy 4 + momentum 4 + variance 4):

    DP (DDP, ZeRO-0)   (2 + 2 + K) Ψ
    ZeRO-1             2Ψ + 2Ψ + KΨ/N
    ZeRO-2             2Ψ + (2 + K)Ψ/N
    ZeRO-3 (and FSDP)  (2 + 2 + K)Ψ/N

The fp32 equivalents use 4-byte parameters and gradients. Plain fp32 Adam holds only its two moments
(K = 8); DeepSpeed's ZeRO-1/2/3 optimizers also keep an fp32 copy of their partition as the "master"
weights even in fp32, so under ``--strategy deepspeed --zero 1..3 --precision fp32`` K = 12 again.
DDP and FSDP with ``--precision bf16/fp16`` use autocast, which keeps the stored parameters,
gradients and optimizer states in fp32, so the fp32 numbers apply to them. FSDP (FULL_SHARD) shards
like ZeRO-3. Activations, temporary buffers and the framework's own overhead are not included.

Everything here is pure arithmetic except :func:`device_memory_bytes` and :func:`optimizer_state_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ADAM_MIXED_K = 12  # fp32 master weights + momentum + variance, bytes per parameter
ADAM_MOMENTS_FP32 = 8  # momentum + variance in fp32


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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def label(self) -> str:
        if self.strategy == "deepspeed":
            return f"deepspeed ZeRO-{self.zero or 0}"
        return self.strategy

    def line(self) -> str:
        """One line for the cell's output."""
        return (
            f"memory estimate ({self.label}, {self.precision}, {self.world_size} process"
            f"{'es' if self.world_size != 1 else ''}, {self.num_params:,} parameters): "
            f"params {format_bytes(self.params)} + grads {format_bytes(self.grads)} + optimizer "
            f"{format_bytes(self.optimizer)} = {format_bytes(self.total)} per process"
        )


def _sharding(strategy: str, zero: int | None) -> int:
    """The ZeRO stage a strategy's sharding corresponds to (DDP = 0, FSDP full shard = 3)."""
    if strategy == "ddp":
        return 0
    if strategy == "fsdp":
        return 3
    if strategy == "deepspeed":
        stage = 0 if zero is None else int(zero)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
        return stage
    raise ValueError(f"unknown strategy {strategy!r}")


def bytes_per_param(strategy: str, zero: int | None, precision: str) -> tuple[int, int, int, int]:
    """(parameter bytes, gradient bytes, K optimizer bytes, of which Adam moments) per parameter."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    stage = _sharding(strategy, zero)
    if strategy == "deepspeed" and precision != "fp32":
        return 2, 2, ADAM_MIXED_K, ADAM_MOMENTS_FP32
    if strategy == "deepspeed" and stage >= 1:
        return 4, 4, ADAM_MIXED_K, ADAM_MOMENTS_FP32  # DeepSpeed keeps an fp32 partition copy even in fp32
    return 4, 4, ADAM_MOMENTS_FP32, ADAM_MOMENTS_FP32  # plain fp32 storage (DDP/FSDP autocast, ZeRO-0 fp32)


def estimate(num_params: int, strategy: str = "ddp", zero: int | None = None, precision: str = "fp32",
             world_size: int = 1, k: int | None = None) -> MemoryEstimate:
    """Per-process bytes for parameters, gradients and optimizer states; ``k`` overrides K."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    psi, n = float(num_params), float(world_size)
    p, g, kk, moments = bytes_per_param(strategy, zero, precision)
    if k is not None:
        kk = k
        moments = min(moments, k)
    stage = _sharding(strategy, zero)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optimizer = kk * psi / (n if stage >= 1 else 1)
    optimizer_moments = moments * psi / (n if stage >= 1 else 1)
    return MemoryEstimate(strategy, stage if strategy == "deepspeed" else None, precision, world_size,
                          int(num_params), params, grads, optimizer, optimizer_moments)


def table(num_params: int, precision: str = "fp32", world_size: int = 2) -> str:
    """A text table of the estimate for every strategy and stage (for the dry run or the docs)."""
    rows = [estimate(num_params, "ddp", None, precision, world_size), estimate(num_params, "fsdp", None, precision, world_size)]
    rows += [estimate(num_params, "deepspeed", s, precision, world_size) for s in (0, 1, 2, 3)]
    header = f"{'strategy':<18}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
    lines = [f"memory per process: {num_params:,} parameters, {precision}, {world_size} processes", header]
    for r in rows:
        lines.append(f"{r.label:<18}{format_bytes(r.params):>12}{format_bytes(r.grads):>12}"
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
    except Exception:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total // max(1, processes_per_device))
    except Exception:
        return None


def check_fits(est: MemoryEstimate, available: int | None) -> str | None:
    """A warning line when the estimate exceeds ``available`` bytes, else None."""
    if available is None or est.total <= available:
        return None
    return (
        f"warning: the estimate ({format_bytes(est.total)} per process for parameters, gradients and optimizer "
        f"states alone) exceeds the device's memory ({format_bytes(available)}); consider a higher --zero stage, "
        f"--strategy fsdp, --precision bf16 or more processes"
    )


def count_parameters(model: Any) -> int:
    """Number of parameters of a plain (not yet sharded) module, counting shared tensors once."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape = getattr(param, "ds_shape", None)  # a ZeRO-3 partitioned parameter
        if shape is not None:
            n = 1
            for d in shape:
                n *= int(d)
            total += n
        else:
            total += param.numel()
    return total


def report(model: Any, strategy: str, zero: int | None, precision: str, world_size: int,
           device: Any = None, processes_per_device: int = 1) -> str:
    """The estimate line for ``model`` (and the warning when it does not fit), as printed by wrap()."""
    est = estimate(count_parameters(model), strategy, zero, precision, world_size)
    warning = check_fits(est, device_memory_bytes(device, processes_per_device))
    return est.line() + (f"\n{warning}" if warning else "")


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
