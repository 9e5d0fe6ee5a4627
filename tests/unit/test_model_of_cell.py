"""`memory.model_of_cell`: the parameter count of the model a cell's training function prepares, found
without training (real torch modules built on the meta device), or a plain reason why not."""

from __future__ import annotations

import torch

from dtrain_magic.strategies.memory import count_parameters, estimate
from dtrain_magic.strategies.model_of_cell import model_of_cell

MLP = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def test_model_built_in_the_function_is_counted_like_the_real_one():
    cell = """
import torch
def train(ctx):
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
"""
    found = model_of_cell(cell, {})
    assert found.found and found.num_params == count_parameters(MLP) == 1153
    assert "meta device" in found.description and "torch.nn.Sequential" in found.description


def test_helper_class_and_local_constants_are_followed():
    cell = """
import torch
HIDDEN = 32
class Net(torch.nn.Module):
    def __init__(self, width, depth=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
def make_model(width):
    return Net(width, depth=3)
def train(ctx):
    width = HIDDEN * 2
    model = make_model(width).to(ctx.device)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
"""
    namespace = {"unrelated": 1}
    found = model_of_cell(cell, namespace)
    real = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
    assert found.num_params == count_parameters(real) == 3 * (64 * 64 + 64)
    assert "make_model(width)" in found.description
    assert set(namespace) == {"unrelated"}  # the cell's definitions ran in a scratch copy, not in the notebook


def test_a_module_in_the_notebook_is_counted_as_it_is():
    cell = "def train(ctx):\n    model, opt = ctx.prepare(my_model, None)\n"
    found = model_of_cell(cell, {"my_model": MLP})
    assert found.num_params == 1153 and "the notebook's `my_model`" in found.description


def test_a_large_model_costs_no_memory_to_count():
    cell = "import torch\ndef train(ctx):\n    ctx.prepare(torch.nn.Linear(200_000, 100_000))\n"
    found = model_of_cell(cell, {})  # 20 billion parameters: 80 GB if it were allocated
    assert found.num_params == 200_000 * 100_000 + 100_000
    assert estimate(found.num_params, "deepspeed", 3, "bf16", 8).total < estimate(found.num_params).total


def test_named_function_is_used():
    cell = ("import torch\ndef other(ctx):\n    ctx.prepare(torch.nn.Linear(2, 2))\n"
            "def train(ctx):\n    ctx.prepare(torch.nn.Linear(3, 1))\n")
    assert model_of_cell(cell, {}).num_params == 4
    assert model_of_cell(cell, {}, fn="other").num_params == 6


def test_unknown_models_say_why():
    cases = {
        "def train(ctx):\n    return 1\n": "does not call ctx.prepare",
        "x = 1\n": "no training function",
        "def train(ctx:\n": "does not parse",
        ("import torch\ndef train(ctx):\n"
         "    ctx.prepare(torch.nn.Linear(ctx.world_size, 1))\n"): "exists only on the workers",
        "import torch\ndef train(ctx):\n    ctx.prepare(torch.nn.Linear(dataset.dim, 1))\n": "needs `dataset`",
        "def train(ctx):\n    ctx.prepare(AutoModel.from_pretrained('gpt2'))\n": "loads weights",
        ("import torch\ndef train(ctx):\n"
         "    ctx.prepare(torch.nn.Linear(*[i for i in (2, 3)]))\n"): "more than calls and names",
        "import torch\ndef train(ctx):\n    ctx.prepare(torch.randn(3))\n": "not a torch.nn.Module",
        "import torch\ndef train(ctx):\n    ctx.prepare(torch.nn.Linear(-1, 2))\n": "without training failed",
    }
    for cell, reason in cases.items():
        found = model_of_cell(cell, {})
        assert not found.found and reason in found.description, (cell, found)


def test_dry_run_prints_the_estimate_for_the_cells_model(shell, capsys):
    cell = ("%%distribute --backend local -n 2 --zero 2 --precision bf16 --dry-run --no-ui\n"
            "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = torch.nn.Linear(100, 10)\n"
            "def train(ctx):\n    model, opt = ctx.prepare(Net(), None)\n")
    result = shell.run(cell)
    assert result.error_in_exec is None and result.result is None
    out = capsys.readouterr().out
    assert "nothing launched" in out and "model: 1,010 parameters, `Net()` from the cell" in out
    assert "memory estimate (deepspeed ZeRO-2, bf16, 2 processes, 1,010 parameters)" in out
    assert "(CPU, 127.0.0.1), gloo process group" in out
    unknown = shell.run("%%distribute --backend local -n 2 --dry-run --no-ui\ndef train(ctx):\n    return 1\n")
    assert unknown.error_in_exec is None
    assert "the model is not known before training (train() does not call ctx.prepare" in capsys.readouterr().out


EIGHT_BLOCKS = """
import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))
def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *(Block() for _ in range(8)), torch.nn.Linear(32, 1))
def train(ctx):
    model = make_model()
    batch = SAMPLE
    model, opt = ctx.prepare(model, torch.optim.Adam(model.parameters()), sample=batch)
"""


def test_a_sample_known_before_training_gives_the_activations_the_workers_measure():
    """``sample=`` followed back like the model (a local expression built on meta, or the notebook's tensor): one
    micro-batch's activations, every --ac mode, as `worker.activations.measure` gives them for the real model."""
    from dtrain_magic.worker.activations import measure

    scratch: dict = {}
    exec(EIGHT_BLOCKS.replace("SAMPLE", "0").split("def train")[0], scratch)
    expected = measure(scratch["make_model"](), torch.randn(64, 8))
    built = model_of_cell(EIGHT_BLOCKS.replace("SAMPLE", "torch.randn(64, 8)"), {})
    held = model_of_cell(EIGHT_BLOCKS.replace("SAMPLE", "my_batch"), {"my_batch": torch.randn(64, 8)})
    for found in (built, held):
        assert found.activations is not None and found.activations.micro_batch == 64
        assert dict(found.activations.kept) == dict(expected.kept) and found.activations.blocks == 8
        assert found.sample_note.startswith("activations from the sample `")
    assert expected.bytes("full") < 0.3 * expected.bytes("none")  # checkpointing keeps the blocks' inputs only
    unknown = model_of_cell(EIGHT_BLOCKS.replace("SAMPLE", "next(iter(ctx.data('rows')))"), {})
    assert unknown.found and unknown.activations is None and "exists only on the workers" in unknown.sample_note
    wrong = model_of_cell(EIGHT_BLOCKS.replace("SAMPLE", "torch.randn(64, 5)"), {})
    assert wrong.activations is None and "did not go through the model on meta" in wrong.sample_note


def test_the_dry_run_adds_the_samples_activations_under_the_runs_ac():
    from types import SimpleNamespace

    from dtrain_magic.config import RunConfig
    from dtrain_magic.driver.plan import check, dry_run_text

    model = model_of_cell(EIGHT_BLOCKS.replace("SAMPLE", "torch.randn(64, 8)"), {})
    payload = SimpleNamespace(call_text=None, name="train", takes_ctx=True)
    plain = dry_run_text(check(RunConfig(backend="local", num_processes=2, use_gpu=False)), payload, model=model)
    full = dry_run_text(check(RunConfig(backend="local", num_processes=2, use_gpu=False, ac="full")), payload,
                        model=model)
    assert "+ activations" in plain and "(activations: micro-batch 64, --ac none" in plain, plain
    assert "(activations: micro-batch 64, --ac full" in full and "activations from the sample `batch`" in full
