"""The big-model knobs (issue #38), through the real magic on the local backend (CPU, gloo, fp32, 2 ranks).

``--clip-grad``: under DDP, FSDP2, ``--tp 2`` and DeepSpeed ZeRO-2 every rank sees the same global gradient
norm at each step, and it equals the norm one process sees training the plain model on the same global batch
with ``torch.nn.utils.clip_grad_norm_``; the weights equal that process's (1e-5), and differ from unclipped
training (the clipping really happened). One launch per flag line.
"""

from __future__ import annotations

import pytest
import torch

from workloads import assert_close

pytestmark = pytest.mark.slow

WIDTHS, SAMPLES, GLOBAL, LR, CLIP = (8, 32, 32, 4), 64, 16, 0.2, 0.5

HELPERS = f"""
import torch

WIDTHS, SAMPLES, GLOBAL, LR, CLIP = {WIDTHS}, {SAMPLES}, {GLOBAL}, {LR}, {CLIP}

def make_model():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])

def make_data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(SAMPLES, WIDTHS[0], generator=g)
    return X, 3 * torch.sin(X @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=g))
"""

CLIP_CELL = """%%distribute --backend local -n 2 --no-ui --clip-grad {clip} {flags}
def train(ctx):
    X, Y = make_data()
    model, opt = ctx.prepare(make_model, lambda params: torch.optim.SGD(params, lr=LR))
    per = GLOBAL // ctx.data_parallel_size
    norms = []
    for start in range(0, SAMPLES, GLOBAL):
        rows = slice(start + ctx.data_parallel_rank * per, start + (ctx.data_parallel_rank + 1) * per)
        loss = torch.nn.functional.mse_loss(model(X[rows]), Y[rows])
        ctx.backward(loss)
        ctx.step()
        norms.append(ctx.grad_norm)
    return {{"norms": norms, "state": ctx.full_state_dict(rank0_only=True)}}
"""


def one_process(clip: float | None) -> tuple[list[float], dict]:
    """The plain model trained by one process on the global batches, clipped with torch's clip_grad_norm_."""
    namespace: dict = {}
    exec(HELPERS, namespace)
    model = namespace["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    X, Y = namespace["make_data"]()
    norms = []
    for start in range(0, SAMPLES, GLOBAL):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X[start:start + GLOBAL]), Y[start:start + GLOBAL]).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ZeRO-2 and ZeRO-3 clip in different DeepSpeed code (a flat partition's norm; every partitioned parameter's): both
CLIP_CASES = [("ddp", "--strategy ddp"), ("fsdp", "--strategy fsdp"), ("tp", "--tp 2"), ("zero2", "--zero 2"),
              ("zero3", "--zero 3")]


@pytest.mark.parametrize("flags", [c[1] for c in CLIP_CASES], ids=[c[0] for c in CLIP_CASES])
def test_clip_grad_is_the_global_norm_on_every_rank_and_trains_like_one_process(shell, flags):
    norms, reference = one_process(CLIP)
    _, unclipped = one_process(None)
    assert max(norms) > 2 * CLIP  # the clipping changes the steps: a run that ignored it would fail below
    assert max((reference[k] - unclipped[k]).abs().max().item() for k in reference) > 1e-3

    shell.run_cell(HELPERS)
    result = shell.run(CLIP_CELL.format(clip=CLIP, flags=flags))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    for rank, value in enumerate(values):
        assert value["norms"] == pytest.approx(norms, rel=1e-5, abs=1e-6), (rank, value["norms"], norms)
    assert values[0]["norms"] == values[1]["norms"]  # the same number on every rank
    worst = assert_close(values[0]["state"], reference, 1e-5, 0)
    print(f"{flags}: norms {values[0]['norms']} (one process {norms}); max |w - w_1proc| = {worst:.2e}")


# ``--ac full --compile --strategy fsdp``: checkpointed, compiled blocks under FSDP2 train as one eager process does.
# torch.compile's code generation (inductor) takes about 67 s per process on this 2-core CPU the first time (5.7 s
# from its disk cache): too slow for the suite, so the run compiles with the aot_eager backend
# ($DTRAIN_MAGIC_COMPILE_BACKEND): dynamo traces each checkpointed block and AOTAutograd differentiates it, as with
# inductor, without generating code.
AC_HELPERS = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

def make_blocks():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), *(Block() for _ in range(4)), torch.nn.Linear(16, 1))

def block_data():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(32, 4, generator=g)
    return X, torch.sin(X.sum(1, keepdim=True))
"""

AC_STEPS = 20

AC_CELL = """%%distribute --backend local -n 2 --no-ui --strategy fsdp --ac full --compile
def train(ctx):
    X, Y = block_data()
    model, opt = ctx.prepare(make_blocks, lambda params: torch.optim.Adam(params, lr=0.01))
    per = len(X) // ctx.data_parallel_size
    rows = slice(ctx.data_parallel_rank * per, (ctx.data_parallel_rank + 1) * per)
    losses = []
    for _ in range({steps}):
        loss = ctx.train_step(X[rows], Y[rows], torch.nn.functional.mse_loss)
        losses.append(loss)
    full = []
    for loss in losses:  # each rank's half-batch mean -> the global batch's mean, as one process computes it
        torch.distributed.all_reduce(loss)
        full.append(loss.item() / ctx.world_size)
    return full
"""


def test_checkpointed_compiled_blocks_under_fsdp_train_as_one_eager_process(shell, monkeypatch, capsys):
    namespace: dict = {}
    exec(AC_HELPERS, namespace)
    model = namespace["make_blocks"]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    X, Y = namespace["block_data"]()
    eager = []
    for _ in range(AC_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        eager.append(loss.item())
    assert eager[-1] < 0.5 * eager[0]  # it learns: 20 steps that did nothing would not match

    monkeypatch.setenv("DTRAIN_MAGIC_COMPILE_BACKEND", "aot_eager")
    shell.run_cell(AC_HELPERS)
    result = shell.run(AC_CELL.format(steps=AC_STEPS))
    assert result.error_in_exec is None, result.error_in_exec
    assert "activation checkpointing (full) on 4 of 4 and torch.compile on 4 Block blocks" in capsys.readouterr().out
    losses = result.result.value
    worst = max(abs(a - b) for a, b in zip(losses, eager, strict=True))
    print(f"--ac full --compile --strategy fsdp: max |loss - eager one process| over {AC_STEPS} steps = {worst:.2e}")
    assert worst <= 1e-4, (losses, eager)


# ``--offload`` (CUDA only: on a CPU run it is refused before launch, tests/unit/test_big_model_knobs_logic.py): the
# step runs and the GPU's peak drops. 8 x 1024² Linear layers: 32 MiB of fp32 weights, 64 MiB of Adam's moments.
OFFLOAD_CELL = """%%distribute --backend local -n 1 --no-ui --gpu {flags}
def train(ctx):
    torch.cuda.reset_peak_memory_stats()
    model, opt = ctx.prepare(lambda: torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))),
                             lambda params: torch.optim.Adam(params, lr=1e-3))
    x, y = torch.randn(8, 1024, device=ctx.device), torch.zeros(8, 1024, device=ctx.device)
    losses = [ctx.train_step(x, y, torch.nn.functional.mse_loss).item() for _ in range(3)]
    return {{"peak": torch.cuda.max_memory_allocated(), "losses": losses}}
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--offload moves GPU memory to the CPU: needs CUDA")
@pytest.mark.parametrize("flags,offload", [("--strategy fsdp", "params"), ("--zero 3", "params"),
                                           ("--zero 2", "optimizer")], ids=["fsdp", "zero3", "zero2"])
def test_offload_steps_and_lowers_the_gpu_peak(shell, flags, offload):
    shell.run_cell("import torch")
    peaks = {}
    for extra in ("", f"--offload {offload}"):
        result = shell.run(OFFLOAD_CELL.format(flags=f"{flags} {extra}"))
        assert result.error_in_exec is None, result.error_in_exec
        value = result.result.value
        assert value["losses"][-1] < value["losses"][0]  # it trains
        peaks[extra] = value["peak"]
    print(f"{flags}: GPU peak {peaks[''] / 2**20:.0f} MiB, with --offload {offload} "
          f"{peaks[f'--offload {offload}'] / 2**20:.0f} MiB")
    assert peaks[f"--offload {offload}"] < 0.8 * peaks[""], peaks
