"""The DeepSpeed config the magic builds from the flags, and how --deepspeed-config merges or conflicts."""

import json
import sys

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.strategies.deepspeed import DeepSpeedStrategy, build_config, parse_user_config


def cfg(**kw) -> RunConfig:
    kw.setdefault("strategy", "deepspeed")
    return RunConfig(**kw)


def test_flags_map_to_keys():
    ds = build_config(cfg(zero=2, precision="bf16", grad_accum=4, micro_batch=8, num_processes=2))
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["train_batch_size"] == 64
    assert ds["gradient_clipping"] == 0.0  # DeepSpeed's default would clip at 1.0, unlike DDP
    assert "optimizer" not in ds  # the client torch optimizer is used (no FusedAdam JIT build)


def test_micro_batch_sources():
    # from --train-batch
    from_train_batch = build_config(cfg(zero=1, train_batch=32, grad_accum=2, num_processes=2))
    assert from_train_batch["train_micro_batch_size_per_gpu"] == 8
    # from the loader given to ctx.prepare
    ds = build_config(cfg(zero=1), world_size=4, loader_batch=5)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (5, 20)
    # the world size the workers really have wins over -n
    assert build_config(cfg(zero=1, micro_batch=2, num_processes=2), world_size=3)["train_batch_size"] == 6


def test_user_config_merges_on_top():
    user = {"zero_optimization": {"stage": 2, "overlap_comm": False}, "gradient_clipping": 1.0,
            "train_micro_batch_size_per_gpu": "auto"}
    ds = build_config(cfg(zero=2, micro_batch=4, deepspeed_config=json.dumps(user), num_processes=2))
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    assert ds["gradient_clipping"] == 1.0
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8


def test_user_stage_used_when_no_zero_flag(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}))
    ds = build_config(cfg(deepspeed_config=str(path), num_processes=2))
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_batch_size"] == 4


@pytest.mark.parametrize(
    "flags,user,message",
    [
        ({"zero": 1}, {"zero_optimization": {"stage": 2}}, "zero_optimization.stage is 2 but --zero 1"),
        ({"zero": 1}, {"bf16": {"enabled": True}}, "bf16.enabled is true but --precision fp32"),
        ({"zero": 1, "precision": "bf16"}, {"bf16": {"enabled": False}}, "bf16.enabled is false but --precision bf16"),
        ({"zero": 1, "grad_accum": 2}, {"gradient_accumulation_steps": 4},
         "gradient_accumulation_steps is 4 but --grad-accum 2"),
        ({"zero": 1, "micro_batch": 2}, {"train_micro_batch_size_per_gpu": 3}, "is 3 but --micro-batch 2"),
        ({"zero": 1, "micro_batch": 2, "train_batch": 4}, {"train_batch_size": 8},
         "train_batch_size is 8 but --train-batch 4"),
    ],
)
def test_conflicts_are_clear_errors(flags, user, message):
    with pytest.raises(ConfigError) as info:
        DeepSpeedStrategy.check(cfg(deepspeed_config=json.dumps(user), num_processes=2, **flags))
    assert message in str(info.value)
    assert "--deepspeed-config" in str(info.value)


def test_batch_mismatch_names_the_three_numbers_and_the_fix():
    user = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ConfigError) as info:
        DeepSpeedStrategy.check(cfg(zero=2, grad_accum=2, num_processes=2, deepspeed_config=json.dumps(user)))
    text = str(info.value)
    for part in ("train_batch_size 10", "micro_batch_per_gpu 4", "gradient_accumulation_steps 2",
                 "world_size 2", "(= 16)", "--train-batch 16"):
        assert part in text, text
    with pytest.raises(ConfigError, match="not divisible"):
        build_config(cfg(zero=1, deepspeed_config='{"train_batch_size": 7}', num_processes=2))


def test_loader_batch_must_match_micro_batch():
    with pytest.raises(ConfigError, match="batch_size 3 but train_micro_batch_size_per_gpu is 4"):
        build_config(cfg(zero=1, micro_batch=4), world_size=2, loader_batch=3)


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"), ("/no/such/file.json", "neither JSON text nor an existing file"),
    ('{"zero_optimization": {"stage": 7}}', "must be 0, 1, 2 or 3"),
])
def test_bad_user_config(text, message):
    with pytest.raises(ConfigError, match=message):
        DeepSpeedStrategy.check(cfg(deepspeed_config=text))


def test_json_array_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_user_config(str(path))


def test_optimizer_section_is_refused():
    with pytest.raises(ConfigError, match="optimizer"):
        DeepSpeedStrategy.check(cfg(zero=1, deepspeed_config='{"optimizer": {"type": "Adam"}}'))


def test_check_does_not_import_deepspeed():
    sys.modules.pop("deepspeed", None)
    DeepSpeedStrategy.check(cfg(zero=3, micro_batch=2, train_batch=4, num_processes=2))
    assert "deepspeed" not in sys.modules
