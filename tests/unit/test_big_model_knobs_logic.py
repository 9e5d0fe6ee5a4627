"""The big-model knobs' pure logic (issue #38): their validation before launch, DeepSpeed's config keys, and the
one-process arithmetic of gradient clipping (the 2-rank runs are tests/integration/test_big_model_knobs.py)."""

from __future__ import annotations

import json

import pytest
import torch

from block_models import BlockStack
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.strategies.clipping import clip_grad_norm, total_norm
from dtrain_magic.strategies.deepspeed import build_config
from dtrain_magic.worker.blocks import checkpoint_blocks, find_blocks, prepare_blocks


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "1.0"])
def test_clip_grad_must_be_a_positive_norm(value):
    with pytest.raises(ConfigError, match="--clip-grad") as error:
        RunConfig(clip_grad=value)
    assert "must be a gradient norm > 0" in str(error.value)


def test_clip_grad_is_deepspeeds_gradient_clipping_and_a_disagreeing_config_is_refused():
    assert build_config(RunConfig(strategy="deepspeed", clip_grad=0.5), 2)["gradient_clipping"] == 0.5
    assert build_config(RunConfig(strategy="deepspeed"), 2)["gradient_clipping"] == 0.0  # no clipping by default
    auto = json.dumps({"gradient_clipping": "auto"})
    assert build_config(RunConfig(strategy="deepspeed", clip_grad=2.0, deepspeed_config=auto), 2)[
        "gradient_clipping"] == 2.0
    own = json.dumps({"gradient_clipping": 3.0})  # the user's own clipping, without the flag, stays
    assert build_config(RunConfig(strategy="deepspeed", deepspeed_config=own), 2)["gradient_clipping"] == 3.0
    with pytest.raises(ConfigError, match="gradient_clipping is 3.0 but --clip-grad 1"):
        build_config(RunConfig(strategy="deepspeed", clip_grad=1.0, deepspeed_config=own), 2)


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model(torch.randn(4, 6)).pow(2).sum().mul(10).backward()
    return model


def test_clip_grad_norm_is_torchs_on_plain_tensors():
    ours, theirs = _model_with_grads(), _model_with_grads()
    theirs_norm = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.3))
    assert theirs_norm > 0.3  # it clips
    assert clip_grad_norm(ours.parameters(), 0.3) == pytest.approx(theirs_norm, rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


def test_total_norm_skips_parameters_without_gradients_and_is_zero_without_any():
    model = _model_with_grads()
    frozen = torch.nn.Parameter(torch.ones(3))  # no gradient: not counted
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total_norm([*model.parameters(), frozen])) == pytest.approx(float(expected), rel=1e-6)
    assert float(total_norm([frozen])) == 0.0


# -- --ac / --compile (dtrain_magic.worker.blocks) -----------------------------------------------------------------
def eight_blocks() -> torch.nn.Module:
    return BlockStack(8, 32, 128)


def _activation_bytes(ac: str) -> tuple[int, torch.Tensor, dict]:
    """Bytes of the activations one forward keeps for the backward: what autograd saves (saved_tensors_hooks see what
    is saved outside a checkpoint) plus each checkpointed block's input (the checkpoint holds it to recompute)."""
    torch.manual_seed(0)
    model = eight_blocks()
    checkpointed = prepare_blocks(model, ac)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    def held_input(module, args):
        saved[0] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    for block in checkpointed if ac != "none" else []:
        block.register_forward_pre_hook(held_input)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x).pow(2).mean()
    loss.backward()
    return saved[0], loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_activation_checkpointing_saves_activation_memory_and_changes_no_number():
    plain, loss, grads = _activation_bytes("none")
    for mode, least_saved in (("full", 0.70), ("selective", 0.30)):
        kept, mode_loss, mode_grads = _activation_bytes(mode)
        print(f"--ac {mode}: {kept} activation bytes kept of {plain} ({1 - kept / plain:.0%} lower)")
        assert kept <= (1 - least_saved) * plain, (mode, kept, plain)
        torch.testing.assert_close(mode_loss, loss, atol=1e-6, rtol=0)
        for name in grads:
            torch.testing.assert_close(mode_grads[name], grads[name], atol=1e-6, rtol=0, msg=name)


def test_the_blocks_are_the_repeated_class_or_the_one_named_and_names_do_not_change():
    model = eight_blocks()
    keys = list(model.state_dict())
    assert find_blocks(model) == list(model.layers)
    assert len(checkpoint_blocks(find_blocks(model), "selective")) == 4  # blocks 0, 2, 4, 6
    assert list(model.state_dict()) == keys  # weights=, checkpoints and save_weights see the plain model's names
    assert find_blocks(model, "Linear") == [model.embed, *(m for b in model.layers for m in (b.up, b.down)), model.head]
    with pytest.raises(ConfigError, match="--ac-module.*'Attention'.*repeated classes: Linear \\(18\\), Block \\(8\\)"):
        find_blocks(model, "Attention")
    with pytest.raises(ConfigError, match="--ac.*no repeated module class.*--ac-module"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))


@pytest.mark.parametrize("values,flag,words", [
    ({"ac_module": "Block"}, "--ac-module", "add --ac full"),
    ({"ac": "full", "pp": 2}, "--ac", "--pp 2"),
    ({"compile": True, "pp": 2}, "--compile", "--pp 2"),
])
def test_ac_and_compile_refusals_name_both_flags(values, flag, words):
    with pytest.raises(ConfigError, match=flag) as error:
        RunConfig(**values)
    assert words in str(error.value)


# -- --offload, and the combinations refused before launch -----------------------------------------------------
@pytest.mark.parametrize("values,flag,words", [
    ({"offload": "params", "strategy": "fsdp"}, "--offload", "nothing to offload to"),  # a CPU run
    ({"offload": "optimizer", "strategy": "deepspeed", "zero": 2}, "--offload", "this run is on CPU"),
    ({"offload": "params", "strategy": "ddp", "use_gpu": True}, "--offload", "--strategy ddp"),
    ({"offload": "optimizer", "strategy": "fsdp", "use_gpu": True}, "--offload", "--strategy fsdp"),
    ({"offload": "params", "strategy": "deepspeed", "zero": 2, "use_gpu": True}, "--offload", "--zero 3"),
    ({"offload": "optimizer", "strategy": "deepspeed", "zero": 0, "use_gpu": True}, "--offload", "--zero 1, 2 or 3"),
    ({"offload": "params", "strategy": "fsdp", "tp": 2, "use_gpu": True}, "--offload", "--tp"),
    ({"offload": "params", "strategy": "fsdp", "pp": 2, "use_gpu": True}, "--offload", "--pp"),
])
def test_combinations_that_cannot_work_are_refused_naming_both_flags(values, flag, words):
    with pytest.raises(ConfigError) as error:
        RunConfig(**values)
    assert str(error.value).startswith(flag) and words in str(error.value), str(error.value)


def test_offload_is_deepspeeds_offload_keys_and_fsdps_policy_where_allowed():
    zero2 = build_config(RunConfig(strategy="deepspeed", zero=2, offload="optimizer", use_gpu=True), 2)
    assert zero2["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero2["zero_optimization"] and zero2["zero_force_ds_cpu_optimizer"] is False
    zero3 = build_config(RunConfig(strategy="deepspeed", zero=3, offload="params", use_gpu=True), 2)
    assert zero3["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" in zero3["zero_optimization"]
    assert "offload_optimizer" not in build_config(RunConfig(strategy="deepspeed", zero=3), 2)["zero_optimization"]
    RunConfig(strategy="fsdp", offload="params", use_gpu=True)  # accepted: FSDP2's CPUOffloadPolicy
    RunConfig(strategy="deepspeed", zero=1, offload="optimizer", use_gpu=True)
