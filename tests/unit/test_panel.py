"""The configure panel's state (pure logic) and its widgets, without a kernel or a run."""

from __future__ import annotations

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.notebook import flags

pytest.importorskip("ipywidgets")
from dtrain_magic.ui.panel import ConfigurePanel, PanelState  # noqa: E402

NO_GPU = dict(gpu_available=lambda: False)


def state(line: str = "--backend local", **kwargs) -> PanelState:
    config = flags.config_from_line(line, gpu_available=lambda: False, backend_detector=lambda: "local")
    return PanelState(config, **{**NO_GPU, **kwargs})


def test_prefilled_from_the_flags():
    s = state("--backend local --strategy fsdp --precision bf16 -n 3 --grad-accum 4 --experiment exp1 --cpu")
    assert s.values == dict(backend="local", strategy="fsdp", zero=None, precision="bf16", num_processes=3,
                            grad_accum=4, use_gpu=False, tp=1, pp=1, experiment="exp1", data="", ac="none",
                            compile=False, offload="none")
    assert s.to_config().flag_line() == (
        "%%distribute --backend local --strategy fsdp --precision bf16 -n 3 --cpu --grad-accum 4 "
        "--experiment exp1 --ui")


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
    pytest.importorskip("dtrain_magic.strategies.memory")
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


# -- the flag line round trip, the cell's model, Write cell --------------------------------------------

def test_state_to_flag_line_to_config_round_trip_with_quoting():
    """Whatever the panel shows as the equivalent line parses back to the config Run launches."""
    base = flags.config_from_line("--backend local --fn train --result res --seed 3 --timeout 90 --no-ui",
                                  gpu_available=lambda: False)
    names = ["my experiment", "it's mine", 'say "hi"', "  padded  ", "plain", "tab\there"]
    for name in names:
        s = PanelState(base, **NO_GPU).set(strategy="deepspeed", zero=2, precision="bf16", num_processes=3,
                                           grad_accum=2, experiment=name)
        config = s.to_config()
        line = s.flag_line()
        assert line == config.flag_line()
        again = flags.config_from_line(line.removeprefix("%%distribute "), gpu_available=lambda: False)
        assert again == config and again.experiment == name, (name, line)
    both = PanelState(base, **NO_GPU).set(experiment="a'b\"c")
    assert both.flag_line() is None  # cannot be written on a line: no equivalent shown (Run still works)
    with pytest.raises(ConfigError, match="--experiment"):
        both.to_config().flag_line()


def test_paths_with_spaces_survive_the_flag_line():
    config = RunConfig(tracking_uri="sqlite:////tmp/my runs/mlflow.db", storage="/tmp/check points",
                       strategy="deepspeed", zero=1, deepspeed_config='{"zero_optimization": {"stage": 1}}')
    again = flags.config_from_line(config.flag_line().removeprefix("%%distribute "), gpu_available=lambda: False)
    assert again == config


def test_estimate_uses_the_cells_model_and_says_what_if_otherwise():
    from dtrain_magic.strategies.memory import CellModel

    model = CellModel(1153, "`Net()` from the cell, built on the meta device")
    s = state(model=model)
    assert s.num_params == 1153 and s.model_line().startswith("model: 1,153 parameters, `Net()` from the cell")
    assert "1,153 parameters" in s.memory_line()
    s.set(num_params=7_000_000)
    assert s.model_line().startswith("what-if: 7,000,000 parameters, a size typed")
    assert "the cell's model has 1,153" in s.model_line()
    assert "7,000,000 parameters" in s.memory_line()
    s.set(num_params=1153)  # typing the real size again is the real model again
    assert s.model_line().startswith("model: ")
    unknown = state(model=CellModel(None, "`Net(ctx.world_size)` uses ctx, which exists only on the workers"))
    assert unknown.num_params == 125_000_000
    assert unknown.model_line().startswith("what-if: 125,000,000 parameters, a default size")
    assert "not known before training: `Net(ctx.world_size)` uses ctx" in unknown.model_line()


def test_panel_counts_the_cells_model():
    cell = ("import torch\ndef train(ctx):\n    model = torch.nn.Linear(10, 5)\n"
            "    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n")
    config = flags.config_from_line("--backend local", gpu_available=lambda: False)
    from dtrain_magic.strategies.model_of_cell import model_of_cell

    # what %%distribute --configure gives the panel: the cell's model, counted on the meta device
    panel = ConfigurePanel(config, cell, shell=None, checker=lambda c: None, model=model_of_cell(cell, {}, config.fn))
    assert panel.state.num_params == 55 and panel.params.value == pytest.approx(55 / 1e6)
    assert "model: 55 parameters" in panel.memory.value
    panel.params.value = 2.0  # the user types 2 M: a what-if, said as such
    assert panel.state.num_params == 2_000_000 and "what-if: 2,000,000 parameters" in panel.memory.value


def test_panel_and_sweep_fit_add_the_samples_activations():
    """A cell whose ctx.prepare has a sample known before training: the panel's estimate and a sweep trial's fit count
    one micro-batch's activations too (issue #38)."""
    from dtrain_magic.strategies.model_of_cell import model_of_cell
    from dtrain_magic.sweep.fits import skip_reason

    cell = ("import torch\ndef train(ctx):\n    model = torch.nn.Linear(10, 5)\n"
            "    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "
            "sample=torch.randn(10_000_000_000, 10))\n")
    config = flags.config_from_line("--backend local", gpu_available=lambda: False)
    model = model_of_cell(cell, {}, config.fn)
    assert model.activations is not None and model.activations.micro_batch == 10_000_000_000
    panel = ConfigurePanel(config, cell, shell=None, checker=lambda c: None, model=model)
    assert "+ activations" in panel.memory.value and "micro-batch 10000000000" in panel.memory.value
    # 400 GB of inputs kept for the backward per process: a trial of it does not fit this machine
    reason = skip_reason(model, RunConfig(backend="local", num_processes=2, use_gpu=False), on_this_machine=True)
    assert reason is not None and "more than this machine's memory" in reason


class _Shell:
    def __init__(self):
        self.user_ns: dict = {}
        self.next_inputs: list[tuple[str, bool]] = []

    def set_next_input(self, text: str, replace: bool = False) -> None:
        self.next_inputs.append((text, replace))


def test_write_cell_puts_the_equivalent_line_over_the_body():
    body = "import torch\ndef train(ctx):\n    return 1\n"
    config = flags.config_from_line("--backend local -n 2", gpu_available=lambda: False)
    shell = _Shell()
    panel = ConfigurePanel(config, body, shell=shell, checker=lambda c: None)
    panel.controls["strategy"].value = "deepspeed"
    panel.controls["zero"].value = 2
    panel.controls["experiment"].value = "my exp"
    expected = ("%%distribute --backend local --strategy deepspeed --zero 2 --precision fp32 -n 2 --cpu "
                "--experiment 'my exp' --ui\n" + body)
    assert panel.writer.text == expected and panel.writer.body == body
    # a front-end with the notebook's document inserted the cell itself: nothing for the kernel to do
    panel._writer_message(panel.writer, {"event": "written", "how": "notebook", "index": 2}, [])
    assert panel.written == ("notebook", 2) and shell.next_inputs == [] and "written" in panel.writer.note
    # any other front-end: IPython's set_next_input, and the note says when the cell appears
    panel._writer_message(panel.writer, {"event": "write", "how": "kernel"}, [])
    assert shell.next_inputs == [(expected, False)] and panel.written == ("kernel", None)
    assert "once you run a cell" in panel.writer.note
    flag_line = expected.split("\n", 1)[0]
    again = flags.config_from_line(flag_line.removeprefix("%%distribute "), gpu_available=lambda: False)
    assert again == panel.state.to_config()
    panel.controls["precision"].value = "fp16"  # invalid: nothing to write
    assert panel.writer.text == "" and panel.write_cell() is None


def test_zero_label_is_short_and_explains_itself_when_disabled():
    config = flags.config_from_line("--backend local", gpu_available=lambda: False)
    panel = ConfigurePanel(config, "def train(ctx):\n    return 1\n", shell=None, checker=lambda c: None)
    zero = panel.controls["zero"]
    assert zero.disabled and zero.description == "ZeRO stage" and "deepspeed" in zero.tooltip
    panel.controls["strategy"].value = "deepspeed"
    assert not zero.disabled and zero.description == "ZeRO stage"


def test_panel_text_output_is_capped_and_kernel_written():
    from ipywidgets import Output

    from dtrain_magic.ui.panel import _OutputWriter

    out = Output()
    writer = _OutputWriter(out, every_s=0.01, max_lines=5)
    for i in range(8):
        writer.write(f"line {i}\n")
    writer.write("oops\n", stream="stderr")
    writer.write("partial")
    writer.close()
    kinds = [(o["name"], o["text"]) for o in out.outputs]
    assert kinds == [("stdout", "[earlier lines not kept]\nline 4\nline 5\nline 6\nline 7\n"),
                     ("stderr", "oops\n"), ("stdout", "partial")]


def test_controls_labels_and_options_come_from_the_flag_table():
    from dtrain_magic.flagtable import AC_MODES, BACKENDS, FLAGS, OFFLOAD, PRECISIONS, STRATEGIES, ZERO_STAGES
    from dtrain_magic.ui.panel import CONTROLS

    rows = [row for row in FLAGS if row.panel is not None]
    assert CONTROLS == tuple(row.field for row in rows)
    assert set(CONTROLS) == {"backend", "strategy", "zero", "precision", "num_processes", "grad_accum", "use_gpu",
                             "tp", "pp", "experiment", "data", "ac", "compile", "offload"}
    options = PanelState(RunConfig(use_gpu=True), gpu_available=lambda: True).options()
    assert options == {"backend": [(b, b) for b in BACKENDS if b != "auto"], "strategy": [(s, s) for s in STRATEGIES],
                       "zero": [(f"ZeRO-{z}", z) for z in ZERO_STAGES], "precision": [(p, p) for p in PRECISIONS],
                       "ac": [(m, m) for m in AC_MODES], "offload": [(m, m) for m in OFFLOAD]}
    config = flags.config_from_line("--backend local", gpu_available=lambda: False)
    panel = ConfigurePanel(config, "def train(ctx):\n    return 1\n", shell=None, checker=lambda c: None)
    assert [panel.controls[row.field].description for row in rows] == [row.panel.label for row in rows]
    left, right = panel.widget.children[1].children
    assert list(left.children) == [panel.controls[r.field] for r in rows if r.panel.column == 0]
    assert list(right.children) == [panel.controls[r.field] for r in rows if r.panel.column == 1] + [panel.params]
    assert (panel.controls["num_processes"].min, panel.controls["num_processes"].max) == (1, 4096)
    assert (panel.controls["grad_accum"].min, panel.controls["grad_accum"].max) == (1, 100000)


def test_tensor_and_pipeline_degrees_in_the_panel():
    s = state("--backend local --strategy fsdp -n 4 --cpu")
    s.set(tp=2)
    assert s.can_run and "--tp 2" in s.flag_line() and s.to_config().data_parallel_size == 2
    assert "fsdp x tp 2" in s.memory_line() and "1/2 of the model" in s.memory_line()
    s.set(tp=3)
    assert not s.can_run and any("--tp" in p and "multiple of 3" in p for p in s.problems())
    s.set(tp=1, pp=2, strategy="deepspeed")
    assert any("--pp" in p and "deepspeed" in p for p in s.problems())


def panel_of_cell(cell: str):
    """The configure panel a cell shows through a real IPython shell with the extension loaded (and the shell)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    shell.user_ns.pop("_distribute_panel", None)
    result = shell.run_cell(cell, store_history=False)
    assert result.error_in_exec is None, result.error_in_exec
    return shell.user_ns["_distribute_panel"], shell


def test_an_invalid_line_opens_the_panel_with_the_problem_shown_and_run_off():
    """docs/ui.md: a combination that is invalid here is explained in the panel and disables Run (no ConfigError)."""
    panel, shell = panel_of_cell("%%distribute --configure --precision fp16 --cpu -n 3\ndef train(ctx):\n    pass\n")
    assert panel.state.values["precision"] == "fp16" and panel.state.values["num_processes"] == 3
    assert panel.controls["precision"].value == "fp16" and panel.run_button.disabled
    assert "fp16 needs a GPU" in panel.problems.value
    panel.controls["precision"].value = "bf16"  # the user fixes it in the panel: Run is on
    assert not panel.run_button.disabled and panel.flag_line.value.startswith("%%distribute --backend")
    with pytest.raises(ConfigError, match="--timeout"):  # a bad value of a flag the panel does not show: an error
        shell.run_line_magic("distribute_session", "start --configure --timeout -3")


def test_the_session_panel_is_the_sessions():
    panel, _ = panel_of_cell("%distribute_session start --configure --backend local -n 2 --cpu --idle-timeout 60")
    assert "configure the session" in panel.widget.children[0].value
    assert panel.run_button.layout.display == "none" and panel.writer.layout.display == "none"
    assert panel.flag_line.value.startswith("%distribute_session start --backend local")
    assert panel.flag_line.value.endswith("--idle-timeout 60") and "%%distribute" not in panel.flag_line.value
    assert not panel.session_button.disabled


def test_the_sweep_box_gives_the_sweep_flags_and_refuses_a_bad_space_naming_the_flag():
    import ipywidgets as w

    from dtrain_magic.ui.panel_sweep import SweepBox

    box = SweepBox(w, {})
    assert box.words() == ""
    box.space.value, box.metric.value, box.trials.value = "lr=loguniform(1e-4,1e-1) batch=choice(16,32)", "val", 12
    assert box.words() == " --sweep 'lr=loguniform(1e-4,1e-1) batch=choice(16,32)' --metric val --trials 12"
    settings = box.options()
    assert (settings.space, settings.metric, settings.trials) == (box.space.value, "val", 12)
    box.metric.value = ""
    with pytest.raises(ConfigError, match="--metric"):
        box.options()
    box.metric.value, box.space.value = "val", "lr=banana(1)"
    with pytest.raises(ConfigError, match="--sweep"):
        box.options()
