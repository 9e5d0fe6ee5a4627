"""Model parallelism through the real magic on the local backend (CPU, gloo): tensor parallel, pipeline parallel,
2-D FSDP x TP with 4 processes, Hugging Face GPT-2 and Llama under --tp, and misuse under --pp (bad flag mixes
are in test_strategies.py's test_invalid_combinations_fail_before_launch).

One training function (workloads.MODEL_PARALLEL_CELL, written with ctx.train_step) runs under every flag line;
each run is compared with one process on the same data, seed and global batch (fp32, weights and losses within
1e-5), its ctx.full_state_dict() loads into the plain model, and a second model resumed from the half-way
checkpoint ends equal to the uninterrupted run (1e-6). The Spark and Ray runs of the same function are in
test_spark.py / test_ray.py (they share those modules' Spark session and Ray instance).
"""

from __future__ import annotations

import pytest
import torch

from workloads import (
    HF_TP_CELL,
    HF_TP_HELPERS,
    PP_WIDTHS,
    TP_WIDTHS,
    assert_model_parallel_run,
    hf_reference,
    model_parallel_cell,
)

pytestmark = pytest.mark.slow

CASES = [
    # (id, flags, widths, grad accumulation, processes, every step's loss is the whole global batch's)
    ("tp", "--tp 2", TP_WIDTHS, 1, 2, True),
    ("pp", "--pp 2 --microbatches 4", PP_WIDTHS, 1, 2, True),
    ("pp_1f1b_accum", "--pp 2 --pp-schedule 1f1b --grad-accum 2", PP_WIDTHS, 2, 2, True),
    ("fsdp_x_tp_4", "--strategy fsdp --tp 2", TP_WIDTHS, 1, 4, False),
    ("ddp_x_pp_4", "--pp 2", PP_WIDTHS, 1, 4, False),  # 2 pipelines: gradients averaged over the replicas
    # the same function, flag line only: plain data parallelism and DeepSpeed run it too
    ("ddp", "--strategy ddp", TP_WIDTHS, 1, 2, False),
    ("zero3", "--zero 3", TP_WIDTHS, 1, 2, False),
]


@pytest.mark.parametrize("flags,widths,accum,n,global_losses", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_train_step_function_matches_one_process_and_resumes(shell, tmp_path, capsys, flags, widths, accum, n,
                                                                  global_losses):
    result = shell.run(model_parallel_cell("local", flags, tmp_path / "ckpt", widths, n))
    worst = assert_model_parallel_run(result, widths, accum, global_losses)
    out = capsys.readouterr().out
    print(f"{flags} -n {n}: max |w - w_1proc| = {worst:.2e}")
    if "--tp" in flags or "--pp" in flags:
        assert "[rank 0] model parallel: " in out, out
    if "--pp" in flags:
        assert "[rank 0] pipeline stage 0: 0..3" in out, out  # balanced: 2 Linears per stage
    if flags == "--strategy fsdp --tp 2":
        assert "dp 2 x tp 2" in out and "[rank 0] memory estimate (fsdp x tp 2, fp32, 4 processes" in out, out


BLOCKS_CELL = """%%distribute --backend local -n 2 --no-ui --pp 2
import torch

class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

def make():
    torch.manual_seed(0)
    return Blocks()

def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)

def train(ctx):
    X, Y = data()
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
    for i in range(0, 64, 16):
        ctx.train_step(X[i:i + 16], Y[i:i + 16], torch.nn.functional.mse_loss)
    balanced = sorted(model.module.state_dict())
    final = ctx.full_state_dict()
    picked = [(k, v) for k, v in ctx.strategy.stream_full_state(include=lambda k: k.startswith(("embed.", "head.")))]
    split = make()
    split, _ = ctx.prepare(split, torch.optim.Adam(split.parameters()), pp_split=["layers.3"])
    return {"final": final, "balanced": balanced, "split": sorted(split.module.state_dict()), "picked": picked}
"""


def test_a_module_list_model_is_split_balanced_or_where_asked_and_matches_one_process(shell):
    result = shell.run(BLOCKS_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    model, (X, Y) = shell.user_ns["make"](), shell.user_ns["data"]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(0, 64, 16):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X[i:i + 16]), Y[i:i + 16]).backward()
        opt.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(result.result.value["final"][key], value, atol=1e-5, rtol=0, msg=key)
    first, second = (v["balanced"] for v in result.result.values)
    assert first == sorted(f"{p}.{w}" for p in ("embed", "layers.0.0", "layers.1.0") for w in ("bias", "weight"))
    assert second[0] == "head.bias" and "layers.2.0.weight" in second  # names as in the whole model
    split_layers = [n for n in result.result.values[1]["split"] if n.startswith("layers")]
    assert split_layers == ["layers.3.0.bias", "layers.3.0.weight"]
    # only the names asked for are gathered and sent: stage 0's embed and stage 1's head, on rank 0 (None elsewhere)
    picked = dict(result.result.values[0]["picked"])
    assert sorted(picked) == ["embed.bias", "embed.weight", "head.bias", "head.weight"]
    for key, value in picked.items():
        torch.testing.assert_close(value, result.result.value["final"][key], atol=0, rtol=0, msg=key)
    assert all(value is None for _, value in result.result.values[1]["picked"])


def test_hugging_face_gpt2_and_llama_tensor_parallel_match_one_process(shell):
    shell.run_cell(HF_TP_HELPERS)
    result = shell.run(HF_TP_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    out = result.result.value
    # GPT-2: 4 heads of 8 over 2 ranks; each rank's c_attn.q holds the 16 columns of its 2 heads
    assert out["gpt2_attention"] == (2, 16, (32, 16))
    for kind in ("gpt2", "llama"):
        reference, losses, plain = hf_reference(kind)
        got = out[kind]
        print(f"{kind}: losses {got['losses']} vs one process {losses}")
        assert got["losses"] == pytest.approx(losses, abs=1e-4)
        assert got["losses"][-1] < got["losses"][0]  # it trains
        plain.load_state_dict(got["state"])  # the fused c_attn is back: loads into the plain model, strictly
        for key, value in reference.items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=0, msg=key)


PP_MISUSE_CELL = """%%distribute --backend local -n 2 --no-ui --pp 2
import torch
def train(ctx):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.prepare(model, opt)
    loss = model(torch.randn(4, 4)).pow(2).mean()
    ctx.backward(loss)
"""


def test_the_five_call_loop_under_pp_is_a_short_error_pointing_at_train_step(shell, capsys):
    result = shell.run(PP_MISUSE_CELL)
    error = result.error_in_exec
    assert error is not None and type(error).__name__ == "WorkerError"
    text = str(error)
    assert "UnsupportedCodeError: under --pp" in text and "calling the model directly (model(x))" in text
    assert "loss = ctx.train_step(inputs, targets, loss_fn)" in text
    assert "line 7, in train" in text  # the cell's own line numbers
    assert len(text.splitlines()) < 25, text


def test_dry_run_shows_the_model_parallel_estimate(shell, capsys):
    cell = "%%distribute --backend local -n 4 --no-ui --dry-run --strategy fsdp --tp 2\n" + model_parallel_cell(
        "local", "", "ckpt").split("\n", 1)[1]
    assert shell.run(cell).error_in_exec is None
    out = capsys.readouterr().out
    assert "memory estimate (fsdp x tp 2, fp32, 4 processes, 884 parameters)" in out, out
    assert "--tp 2" in out  # the equivalent flag line
