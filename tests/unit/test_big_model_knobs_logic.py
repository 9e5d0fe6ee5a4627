"""The big-model knobs' pure logic (issue #38): their validation before launch, DeepSpeed's config keys, and the
one-process arithmetic of gradient clipping (the 2-rank runs are tests/integration/test_big_model_knobs.py)."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.strategies.clipping import clip_grad_norm, total_norm
from dtrain_magic.strategies.deepspeed import build_config


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
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


def test_total_norm_skips_parameters_without_gradients_and_is_zero_without_any():
    model = _model_with_grads()
    frozen = torch.nn.Parameter(torch.ones(3))  # no gradient: not counted
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total_norm([*model.parameters(), frozen])) == pytest.approx(float(expected), rel=1e-6)
    assert float(total_norm([frozen])) == 0.0
