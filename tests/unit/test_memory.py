"""The ZeRO paper's memory model (pure arithmetic) and the optimizer-state measurement helper."""

import pytest
import torch

from dtrain_magic.strategies.memory import (
    MemoryEstimate,
    check_fits,
    count_parameters,
    estimate,
    format_bytes,
    optimizer_state_bytes,
    table,
)

PSI = 7_500_000_000  # the paper's 7.5B-parameter example (figure 1: N = 64, K = 12)


def gb(x: float) -> float:
    return x / 1e9


def test_paper_example_mixed_precision_adam():
    # ZeRO paper, figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device for Ψ = 7.5B, N = 64, K = 12
    dp = estimate(PSI, "deepspeed", 0, "bf16", 64)
    z1 = estimate(PSI, "deepspeed", 1, "bf16", 64)
    z2 = estimate(PSI, "deepspeed", 2, "fp16", 64)
    z3 = estimate(PSI, "deepspeed", 3, "bf16", 64)
    assert gb(dp.total) == pytest.approx(120.0)
    assert gb(z1.total) == pytest.approx(31.4, abs=0.05)
    assert gb(z2.total) == pytest.approx(16.6, abs=0.05)
    assert gb(z3.total) == pytest.approx(1.9, abs=0.05)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_formulas_per_stage(n):
    psi, k = 1000, 12
    assert estimate(psi, "deepspeed", 0, "bf16", n).total == (2 + 2 + k) * psi
    assert estimate(psi, "deepspeed", 1, "bf16", n).total == pytest.approx(4 * psi + k * psi / n)
    assert estimate(psi, "deepspeed", 2, "bf16", n).total == pytest.approx(2 * psi + (2 + k) * psi / n)
    assert estimate(psi, "deepspeed", 3, "bf16", n).total == pytest.approx((2 + 2 + k) * psi / n)
    assert estimate(psi, "deepspeed", None, "bf16", n) == estimate(psi, "deepspeed", 0, "bf16", n)


def test_fp32_equivalents():
    psi, n = 1000, 4
    ddp = estimate(psi, "ddp", None, "fp32", n)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    # autocast under DDP/FSDP keeps fp32 storage: same numbers as fp32
    assert estimate(psi, "ddp", None, "bf16", n) == MemoryEstimate(**{**ddp.__dict__, "precision": "bf16"})
    fsdp = estimate(psi, "fsdp", None, "fp32", n)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (psi, psi, 2 * psi)
    # DeepSpeed ZeRO keeps an fp32 partition copy even in fp32: K = 12, of which 8 are Adam's moments
    z1 = estimate(psi, "deepspeed", 1, "fp32", n)
    assert (z1.params, z1.grads, z1.optimizer, z1.optimizer_moments) == (4 * psi, 4 * psi, 3 * psi, 2 * psi)
    z0 = estimate(psi, "deepspeed", 0, "fp32", n)
    assert z0.optimizer == 8 * psi


def test_k_override_and_errors():
    assert estimate(100, "deepspeed", 3, "bf16", 2, k=4).optimizer == 200
    with pytest.raises(ValueError):
        estimate(100, "deepspeed", 5, "bf16", 2)
    with pytest.raises(ValueError):
        estimate(100, "tp", None, "bf16", 2)
    with pytest.raises(ValueError):
        estimate(100, "ddp", None, "int8", 2)
    with pytest.raises(ValueError):
        estimate(100, "ddp", None, "fp32", 0)


def test_line_table_and_warning():
    est = estimate(1_000_000, "deepspeed", 2, "bf16", 2)
    assert "deepspeed ZeRO-2" in est.line() and "1,000,000 parameters" in est.line()
    assert "per process" in est.line()
    text = table(1_000_000, "bf16", 2)
    for label in ("ddp", "fsdp", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        assert label in text
    assert check_fits(est, 10**12) is None
    warning = check_fits(est, 1000)
    assert warning and "exceeds the device's memory" in warning and "--zero" in warning
    assert format_bytes(512) == "512 B" and format_bytes(3 * 1024**3) == "3.0 GiB"


def test_count_and_measure_plain_adam():
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 1))
    assert count_parameters(model) == 10 * 5 + 5 + 5 + 1
    opt = torch.optim.Adam(model.parameters())
    assert optimizer_state_bytes(opt) == 0
    model(torch.ones(2, 10)).sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt) == estimate(61, "ddp", None, "fp32", 1).optimizer_moments == 61 * 8


def test_measure_unwraps_inner_optimizer():
    class Wrapper:  # like DeepSpeed's ZeRO optimizers: the torch optimizer is .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(4)
    opt.step()
    assert optimizer_state_bytes(Wrapper(opt)) == 32
