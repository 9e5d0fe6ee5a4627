"""Model FLOPs and the device's peak, for model FLOP/s and MFU (model FLOPs utilisation).

Model FLOP/s is the FLOPs the model needs per sample (or per token) times the samples (tokens) per second the
run goes through; MFU divides it by the peak of every device in the run. The FLOPs come from
``ctx.set_model_flops(per_sample=..., per_token=...)``, or, for token inputs, from the usual estimate for a
decoder: 6 × parameters per token (forward 2, backward 4; attention's share left out). The peak is the dense
tensor-core figure of the GPU's data sheet for the run's precision (`PEAK_TFLOPS`; fp32 matmuls count as TF32
where torch allows TF32), or ``$DTRAIN_MAGIC_PEAK_FLOPS`` (FLOP/s per device). A CPU has no peak that means
anything here: MFU stays empty there, and the note says so.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import log_dropped

# Dense (no sparsity) peak TFLOP/s per device, from the vendors' data sheets: (bf16/fp16 tensor, tf32 tensor,
# fp32 without tensor cores). Matched against torch.cuda.get_device_name() by substring, first match wins.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("GB200", (2500.0, 1250.0, 80.0)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("H200", (989.0, 494.0, 67.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.0, 494.0, 67.0)),
    ("H800", (989.0, 494.0, 67.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("V100", (125.0, 15.7, 15.7)),  # fp16 tensor cores; no bf16, no tf32
    ("T4", (65.0, 8.1, 8.1)),
    ("MI300X", (1307.0, 654.0, 163.0)),
    ("MI250X", (383.0, 95.7, 95.7)),
)

DECODER_FLOPS_PER_PARAMETER_TOKEN = 6.0


def count_parameters(model: Any) -> int:
    """Every parameter of ``model`` (as given to ``ctx.prepare``, before any sharding; DeepSpeed's partitioned
    parameters count whole)."""
    try:
        return int(sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters()))
    except Exception as exc:  # any model object: a count that fails leaves model FLOP/s unknown, never the run
        log_dropped(__name__, "count_parameters", exc)
        return 0


def peak_flops(device: Any, precision: str) -> tuple[str, float, str]:
    """(device name, peak FLOP/s per device for ``precision``, a note when there is none)."""
    override = os.environ.get("DTRAIN_MAGIC_PEAK_FLOPS")
    kind = getattr(device, "type", str(device))
    if kind != "cuda":
        if override:
            return kind, _number(override), ""
        return kind, 0.0, ("no MFU on CPU: a CPU has no peak FLOP/s that means anything for training (set "
                           "$DTRAIN_MAGIC_PEAK_FLOPS to compare against one)")
    import torch

    name = torch.cuda.get_device_name(device)
    if override:
        return name, _number(override), ""
    for key, (half, tf32, fp32) in PEAK_TFLOPS:
        if key in name:
            if precision in ("bf16", "fp16"):
                return name, half * 1e12, ""
            tf32_on = bool(getattr(torch.backends.cuda.matmul, "allow_tf32", False))
            return name, (tf32 if tf32_on else fp32) * 1e12, ""
    return name, 0.0, f"peak FLOP/s of {name} unknown: set $DTRAIN_MAGIC_PEAK_FLOPS (per device) for MFU"


def _number(text: str) -> float:
    try:
        return max(0.0, float(text))
    except ValueError:
        return 0.0


def batch_size_and_tokens(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(samples, tokens) of one forward call's inputs: the first tensor's first dimension; tokens when the inputs
    are token ids (``input_ids``, or an integer tensor of two or more dimensions)."""
    import torch

    first = kwargs.get("input_ids")
    if not isinstance(first, torch.Tensor):
        first = _first_tensor(args)
    if first is None:
        first = _first_tensor(tuple(kwargs.values()))
    if first is None or first.dim() == 0:
        return 0, 0
    tokens = first.numel() if (first.dim() >= 2 and not first.is_floating_point() and not first.is_complex()) else 0
    return int(first.shape[0]), int(tokens)


def _first_tensor(values: tuple) -> Any:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value:
            found = _first_tensor(tuple(value))
            if found is not None:
                return found
        if isinstance(value, dict) and value:
            found = _first_tensor(tuple(value.values()))
            if found is not None:
                return found
    return None
