"""The configure panel's state (pure logic) and its widgets, without a kernel or a run."""

from __future__ import annotations

import pytest

from dtrain_magic import flags
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError

pytest.importorskip("ipywidgets")
from dtrain_magic.ui.panel import ConfigurePanel, PanelState  # noqa: E402

NO_GPU = dict(gpu_available=lambda: False)


def state(line: str = "--backend local", **kwargs) -> PanelState:
    config = flags.config_from_line(line, gpu_available=lambda: False, backend_detector=lambda: "local")
    return PanelState(config, **{**NO_GPU, **kwargs})


def test_prefilled_from_the_flags():
    s = state("--backend local --strategy fsdp --precision bf16 -n 3 --grad-accum 4 --experiment exp1 --cpu")
    assert s.values == dict(backend="local", strategy="fsdp", zero=None, precision="bf16", num_processes=3,
                            grad_accum=4, use_gpu=False, experiment="exp1")
    assert s.to_config().flag_line() == (
        "%%distribute --backend local --strategy fsdp --precision bf16 -n 3 --cpu --grad-accum 4 --experiment exp1 --ui")


def test_zero_stage_only_enabled_for_deepspeed():
    s = state()
    assert not s.zero_enabled and s.values["zero"] is None
    s.set(strategy="deepspeed")
    assert s.zero_enabled and s.values["zero"] == 0
    s.set(zero=2)
    assert s.to_config().zero == 2
    s.set(strategy="ddp")
    assert not s.zero_enabled and s.values["zero"] is None
    assert s.to_config().zero is None  # the stale stage never reaches the RunConfig


def test_zero_flag_prefills_deepspeed():
    s = state("--backend local --zero 3")
    assert s.zero_enabled and s.values == {**s.values, "strategy": "deepspeed", "zero": 3}


def test_run_builds_the_right_runconfig():
    base = flags.config_from_line("--backend local --fn train --result res --seed 7 --timeout 60 --no-ui",
                                  gpu_available=lambda: False)
    s = PanelState(base, **NO_GPU).set(strategy="deepspeed", zero=1, precision="bf16", num_processes=4, grad_accum=2,
                                       experiment="panel")
    config = s.to_config()
    assert config == RunConfig(backend="local", strategy="deepspeed", zero=1, precision="bf16", num_processes=4,
                               grad_accum=2, use_gpu=False, experiment="panel", fn="train", result="res", seed=7,
                               timeout=60.0, ui=True)
    # the flag line shown in the panel reproduces exactly this config
    again = flags.config_from_line(config.flag_line().removeprefix("%%distribute "), gpu_available=lambda: False)
    assert again == config


def test_invalid_combinations_are_explained_and_block_run():
    s = state().set(precision="fp16")
    assert not s.can_run
    assert any("fp16 needs a GPU" in p for p in s.problems())
    assert s.flag_line() is None
    with pytest.raises(ConfigError):
        s.to_config()
    s.set(use_gpu=True)  # a GPU was asked for, but this machine has none
    assert any("no CUDA device" in p for p in s.problems())
    s.set(use_gpu=False, precision="bf16")
    assert s.can_run and s.problems() == []


def test_fp16_is_labelled_when_gpu_is_off():
    s = state()
    assert ("fp16 (needs GPU)", "fp16") in s.options()["precision"]
    assert ("fp16", "fp16") in PanelState(RunConfig(use_gpu=True), gpu_available=lambda: True).options()["precision"]


def test_checker_problems_are_shown():
    def checker(config):
        if config.num_processes > 2:
            raise ConfigError("--num-processes", "only 2 here")

    s = state(checker=checker)
    assert s.can_run
    s.set(num_processes=3)
    assert s.problems() == ["--num-processes: only 2 here"]


def test_memory_estimate_follows_the_choice():
    pytest.importorskip("dtrain_magic.memory")
    s = state(num_params=1_000_000).set(strategy="deepspeed", zero=0)
    zero0 = s.memory_line()
    s.set(zero=3)
    zero3 = s.memory_line()
    assert "ZeRO-0" in zero0 and "ZeRO-3" in zero3 and zero0 != zero3


def test_panel_widgets_follow_the_state():
    config = flags.config_from_line("--backend local", gpu_available=lambda: False)
    panel = ConfigurePanel(config, "def train(ctx):\n    return 1\n", shell=None, checker=lambda c: None)
    zero = panel.controls["zero"]
    assert zero.disabled
    panel.controls["strategy"].value = "deepspeed"
    assert not zero.disabled
    zero.value = 2
    assert "--strategy deepspeed --zero 2" in panel.flag_line.value
    panel.controls["strategy"].value = "fsdp"
    assert zero.disabled and "--zero" not in panel.flag_line.value
    panel.controls["precision"].value = "fp16"
    assert panel.run_button.disabled and "fp16 needs a GPU" in panel.problems.value
    panel.controls["precision"].value = "bf16"
    assert not panel.run_button.disabled
    assert panel.state.to_config().precision == "bf16"
