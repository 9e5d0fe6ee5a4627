"""The memory estimate's activations (issue #38): `worker.activations.measure` on the meta device against a real
forward counted the same way, the arithmetic `strategies.memory` adds per process, and the knobs it names when the
estimate does not fit (the 2-rank comparison with measured runs is tests/integration/test_activation_estimate.py)."""

from __future__ import annotations

import pytest
import torch

from block_models import BlockStack
from dtrain_magic.strategies import memory
from dtrain_magic.worker.activations import measure
from dtrain_magic.worker.blocks import prepare_blocks

WIDTH, HIDDEN, ROWS, BLOCKS = 16, 64, 32, 8


def net() -> torch.nn.Module:
    return BlockStack(4, WIDTH, HIDDEN, BLOCKS)


def real_kept(ac: str) -> int:
    """What a real forward keeps: every tensor autograd saves, once by storage, parameters left out, plus the inputs
    checkpointed blocks hold (the checkpoint's own saved tensors are hidden from outer hooks)."""
    torch.manual_seed(0)
    model = net()
    blocks = prepare_blocks(model, ac)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in params:
            kept[key] = tensor.untyped_storage().nbytes()
        return tensor

    for block in blocks if ac != "none" else []:
        block.register_forward_pre_hook(lambda m, args: kept.update({args[0].data_ptr(): args[0].nbytes}))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randn(ROWS, 4)).sum().backward()
    return sum(kept.values())


def test_the_meta_forward_counts_what_a_real_forward_keeps_under_every_ac_mode():
    found = measure(net(), torch.randn(ROWS, 4))
    assert found.micro_batch == ROWS and found.blocks == BLOCKS
    per_block = 4 * ROWS * (WIDTH + 2 * HIDDEN)  # up's input, gelu's input, down's input (weights are states)
    assert found.kept["none"] == 4 * ROWS * 4 + BLOCKS * per_block + 4 * ROWS * WIDTH  # + embed's and head's inputs
    assert found.kept["full"] == 4 * ROWS * 4 + BLOCKS * 4 * ROWS * WIDTH + 4 * ROWS * WIDTH
    assert found.recomputed == {"none": 0.0, "selective": 4 * ROWS * 2 * HIDDEN, "full": 4 * ROWS * 2 * HIDDEN}
    for mode in memory.AC_MODES:
        assert found.kept[mode] == real_kept(mode), mode
    assert found.bytes("full") < 0.3 * found.bytes("none") and found.bytes("selective") < 0.7 * found.bytes("none")


def test_the_sample_may_be_a_tuple_or_keywords_and_the_model_is_left_as_it_was():
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(ROWS, 4)
    assert measure(model, (x, 2.0)).kept == measure(model, {"x": x, "scale": 2.0}).kept == measure(model, x).kept
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match="sample=.*first dimension"):
        measure(model, {"scale": 2.0})


def test_a_model_without_repeated_blocks_keeps_the_same_under_every_mode():
    found = measure(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), torch.randn(5, 4))
    assert found.blocks == 0 and len(set(found.kept.values())) == 1 and set(found.recomputed.values()) == {0.0}


SAMPLE = memory.Activations(8, {"none": 800.0, "selective": 500.0, "full": 200.0},
                            {"none": 0.0, "selective": 50.0, "full": 50.0}, blocks=4)


def test_activations_are_whole_on_every_process_and_scale_with_the_micro_batch():
    for world in (2, 4):
        est = memory.estimate(1000, "fsdp", None, "fp32", world, activations=SAMPLE, ac="selective")
        assert est.activations == 550.0 and est.total == est.states + 550.0
    assert SAMPLE.at(2).bytes("full") == 250.0 / 4
    plain = memory.estimate(1000, "ddp", None, "fp32", 2)
    assert plain.activations == 0 and "activations" not in plain.line()
    line = memory.estimate(1000, "ddp", None, "fp32", 2, activations=SAMPLE, ac="full").line()
    assert "+ activations 250 B" in line and "micro-batch 8, --ac full; --ac none 800 B, selective 550 B" in line
    with pytest.raises(ValueError, match="--ac mode 'some'"):
        memory.estimate(1000, ac="some")


def test_when_it_does_not_fit_the_warning_names_each_knob_that_would_with_its_number():
    facts = memory.ModelFacts(num_params=1000, largest_param=500, largest_block=500, hidden=10, blocks=2)
    est = memory.estimate(1000, "ddp", None, "fp32", 2, facts=facts, activations=SAMPLE)
    rest = est.total - 800
    options = dict(memory.fit_options(est, facts, on_gpu=False, available=rest + 300))
    assert options["--ac selective"] == rest + 550 and options["--ac full"] == rest + 250
    zero3 = memory.estimate(1000, "deepspeed", 3, "fp32", 2, facts=facts, activations=SAMPLE).total
    assert options["--zero 3"] == zero3
    assert options["a micro-batch of 2 rows (the sample has 8)"] == rest + 200  # 4 rows: 400 B, over the budget
    warning = memory.check_fits(est, rest + 300, list(options.items()))
    assert f"it fits with --ac full ({memory.format_bytes(rest + 250)}), or a micro-batch of 2 rows" in warning
    assert "--ac selective" not in warning
    gpu = dict(memory.fit_options(est, facts, on_gpu=True, available=rest + 300))
    assert gpu["--strategy fsdp --offload params"] == est.buffers + est.activations
    sharded = memory.estimate(1000, "fsdp", None, "fp32", 2, facts=facts, activations=SAMPLE, ac="full")
    assert "--zero 3" not in dict(memory.fit_options(sharded, facts))  # it shards parameters already
    none_fit = memory.check_fits(est, 10, memory.fit_options(est, facts, available=10))
    assert "no knob alone makes it fit (the closest: a micro-batch of 1 row (the sample has 8)" in none_fit
