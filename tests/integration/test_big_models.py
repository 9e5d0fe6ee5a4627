"""Models bigger than one process, through the real magic on the local backend (CPU, gloo; issue #26).

One training function (BIG_CELL) builds its model with a factory (``ctx.prepare(make_model, ...)``: on the meta
device under FSDP and --tp/--pp, inside deepspeed.zero.Init under ZeRO-3), loads one saved full checkpoint sharded
(``weights=``: a Hugging Face style sharded safetensors directory, a torch .pt file, one .safetensors file, a
torch.distributed.checkpoint directory), trains, and saves with ``ctx.save_weights`` (rank 0 writes, one tensor at a
time). Each flag line must give the weights of one process that starts from the same checkpoint and trains on the
same global batches (fp32, 1e-5); the saved files must load into the plain model; and no rank may hold more than
3/4 of the model's parameter bytes (two ranks: a sharded rank holds about half).

Also: a small Hugging Face GPT-2 built from a config and saved with save_pretrained (safetensors, the tied lm_head
left out) loads sharded under --tp 2 (its fused c_attn read as q, k, v slices) and equals ``from_pretrained``; peak
memory per rank while a 256 MiB model is built and loaded under FSDP stays under 3/4 of the model, and the rank
that is not rank 0 stays under 1/4 of it while rank 0 assembles and writes the whole model; a checkpoint whose names
do not match fails before training with every mismatch listed.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from workloads import assert_close

pytestmark = pytest.mark.slow

WIDTHS = (8, 32, 32, 16, 4)  # Linear-ReLU x 3, Linear: two column/row pairs under --tp, two stages under --pp
SAMPLES, GLOBAL, LR = 64, 16, 0.01

HELPERS = f"""
import torch

WIDTHS, SAMPLES, GLOBAL, LR = {WIDTHS}, {SAMPLES}, {GLOBAL}, {LR}

def make_model():
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])

def make_data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(SAMPLES, WIDTHS[0], generator=g)
    return X, torch.sin(X @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=g))
"""

BIG_CELL = """%%distribute --backend local -n {n} --no-ui {flags}
WEIGHTS, OUT = {weights!r}, {out!r}

def local_bytes(model):
    module = getattr(model, "module", model)  # DeepSpeed's engine, a pipeline stage
    total = 0
    for param in module.parameters():
        part = getattr(param, "ds_tensor", None)  # ZeRO-3's partition
        local = part if part is not None else (param.to_local() if hasattr(param, "to_local") else param)
        total += local.numel() * local.element_size()
    return total

def train(ctx):
    X, Y = make_data()
    model, opt = ctx.prepare(make_model, lambda params: torch.optim.Adam(params, lr=LR), weights=WEIGHTS)
    held = local_bytes(model)
    per = GLOBAL // ctx.data_parallel_size
    for start in range(0, SAMPLES, GLOBAL):
        rows = slice(start + ctx.data_parallel_rank * per, start + (ctx.data_parallel_rank + 1) * per)
        ctx.train_step(X[rows], Y[rows], torch.nn.functional.mse_loss)
    files = ctx.save_weights(OUT, max_shard_bytes=2048)
    return {{"state": ctx.full_state_dict(rank0_only=True), "held": held, "files": files}}
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One model, seeded, saved as: sharded safetensors with an index, one .safetensors file, a torch .pt file and a
    torch.distributed.checkpoint directory (as ctx.save_checkpoint writes under FSDP); and its training by one
    process on the same global batches (the reference)."""
    import torch.distributed.checkpoint as dcp

    namespace: dict = {}
    exec(HELPERS, namespace)
    root = tmp_path_factory.mktemp("big")
    torch.manual_seed(7)
    model = namespace["make_model"]()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    keys = list(state)
    (root / "hf").mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[:4], "model-00002-of-00002.safetensors": keys[4:]}
    for file, part in halves.items():
        save_file({k: state[k] for k in part}, root / "hf" / file)
    weight_map = {k: file for file, part in halves.items() for k in part}
    (root / "hf" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file(state, root / "one.safetensors")
    torch.save(state, root / "weights.pt")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": dict(state)}, checkpoint_id=str(root / "dcp"), no_dist=True)

    opt = torch.optim.Adam(model.parameters(), lr=LR)
    X, Y = namespace["make_data"]()
    for start in range(0, SAMPLES, GLOBAL):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X[start:start + GLOBAL]), Y[start:start + GLOBAL]).backward()
        opt.step()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return root, namespace, state, reference


CASES = [
    # (id, flags, processes, checkpoint under the fixture's directory)
    ("fsdp", "--strategy fsdp", 2, "hf"),
    ("zero3", "--zero 3", 2, "weights.pt"),
    ("tp", "--tp 2", 2, "one.safetensors"),
    ("pp", "--pp 2 --microbatches 2", 2, "dcp"),
]


@pytest.mark.parametrize("flags,n,source", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_deferred_build_and_sharded_load_train_like_one_process_and_save_for_the_plain_model(
        shell, tmp_path, checkpoint, flags, n, source):
    root, namespace, start, reference = checkpoint
    shell.run_cell(HELPERS)
    out = tmp_path / "saved"
    result = shell.run(BIG_CELL.format(n=n, flags=flags, weights=str(root / source), out=str(out)))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    worst = assert_close(values[0]["state"], reference, 1e-5, 0)
    print(f"{flags} from {source}: max |w - w_1proc| = {worst:.2e}, bytes held per rank "
          f"{[v['held'] for v in values]}")
    assert all(v["state"] == {} for v in values[1:])  # rank0_only: the other ranks assemble nothing

    whole = sum(t.numel() * t.element_size() for t in start.values())
    for rank, value in enumerate(values):
        assert 0 < value["held"] < 0.75 * whole, (rank, value["held"], whole)  # never the whole model

    # Hugging Face style shards (max_shard_bytes=2048), written by rank 0 only, load into the plain model
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(values[0]["files"]) == sorted(str(p) for p in out.iterdir()) and values[1]["files"] == []
    saved = {}
    for file in set(index["weight_map"].values()):
        saved.update(load_file(out / file))
    plain = namespace["make_model"]()
    plain.load_state_dict(saved)  # strict
    assert_close(dict(plain.state_dict()), values[0]["state"], 0, 0)


HF_CELL = """%%distribute --backend local -n 2 --no-ui --tp 2
def train(ctx):
    config = GPT2Config.from_pretrained(SAVED)
    model, opt = ctx.prepare(lambda: GPT2LMHeadModel(config), lambda params: torch.optim.Adam(params), weights=SAVED)
    with torch.no_grad():
        logits = model(IDS).logits
    q = model.transformer.h[0].attn.c_attn.q.weight
    return {"state": ctx.full_state_dict(rank0_only=True), "logits": logits, "q_local": tuple(q.to_local().shape)}
"""


def test_a_hugging_face_model_saved_as_safetensors_loads_sharded_and_equals_its_plain_load(shell, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")  # safetensors; the tied lm_head is left out
    assert "lm_head.weight" not in load_file(tmp_path / "gpt2" / "model.safetensors")
    shell.user_ns.update(SAVED=str(tmp_path / "gpt2"), IDS=torch.arange(16).reshape(2, 8) % 64, torch=torch,
                         GPT2Config=GPT2Config, GPT2LMHeadModel=GPT2LMHeadModel)
    result = shell.run(HF_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    out = result.result.value
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    assert out["q_local"] == (32, 16)  # rank 0 read only its 2 heads' query columns (of 4 x 8) of the fused c_attn
    assert_close(out["state"], dict(plain.state_dict()), 0, 0)  # the same numbers, fused back into c_attn
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], plain(torch.arange(16).reshape(2, 8) % 64).logits, atol=1e-5,
                                   rtol=0)


MEMORY_CELL = """%%distribute --backend local -n 2 --no-ui --strategy fsdp
import torch

def peak_since_reset():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:  # the peak (VmHWM) starts again from the current RSS
        handle.write("5")
    return peak_since_reset()[1]

def hold_nothing_freed():
    # glibc keeps freed blocks of up to 32 MiB for reuse once it has freed one (its dynamic mmap threshold), so the
    # resident size would count memory the process no longer holds; a fixed threshold returns it when freed
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD

def train(ctx):
    import safetensors.torch, torch.distributed.checkpoint  # imported before the baseline: not the model's memory
    hold_nothing_freed()
    base = reset_peak()
    model, _ = ctx.prepare(lambda: torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]),
                           None, weights=WEIGHTS)
    build_and_load = peak_since_reset()[0] - base
    base = reset_peak()
    files = ctx.save_weights(OUT, max_shard_bytes=WIDTH * WIDTH * 4 * 4)
    saving = peak_since_reset()[0] - base
    return {"build_and_load": build_and_load, "saving": saving, "files": len(files)}
"""


def test_no_rank_holds_the_whole_model_while_building_loading_or_saving(shell, tmp_path):
    """256 MiB of parameters (16 x Linear(2048, 2048)), FSDP over 2 ranks: building on meta and loading sharded
    must peak under 3/4 of the model (a rank's half, one block, the reads), where building it whole would exceed it;
    saving streams it to rank 0, so rank 1's peak stays under 1/4 of it (one tensor at a time) and rank 0's under
    1/2 (one 64 MiB shard and a tensor). Peaks are resident memory with glibc returning what is freed (see
    MEMORY_CELL), so that they measure what the process holds."""
    width, layers = 2048, 16
    torch.manual_seed(0)
    state = {}
    for i in range(layers):
        state[f"{i}.weight"] = torch.randn(width, width) * 0.01
        state[f"{i}.bias"] = torch.zeros(width)
    save_file(state, tmp_path / "model.safetensors")
    whole = sum(t.numel() * 4 for t in state.values())
    del state
    shell.user_ns.update(WIDTH=width, LAYERS=layers, WEIGHTS=str(tmp_path / "model.safetensors"),
                         OUT=str(tmp_path / "out"))
    result = shell.run(MEMORY_CELL)
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    mib = 2 ** 20
    print(f"model {whole / mib:.0f} MiB; build + load peak per rank "
          f"{[round(v['build_and_load'] / mib) for v in values]} MiB; saving peak "
          f"{[round(v['saving'] / mib) for v in values]} MiB")
    for rank, value in enumerate(values):
        assert value["build_and_load"] < 0.75 * whole, (rank, value)
    assert values[1]["saving"] < 0.25 * whole, values[1]
    assert values[0]["saving"] < 0.5 * whole, values[0]
    assert values[0]["files"] > 1  # 16 MiB per tensor, 64 MiB shards: several files


MISMATCH_CELL = """%%distribute --backend local -n 2 --no-ui --strategy fsdp
def train(ctx):
    model, opt = ctx.prepare(lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                                         torch.nn.Linear(32, 5)),
                             lambda params: torch.optim.Adam(params), weights=WEIGHTS)
    print("TRAINING STARTED")
"""


def test_a_checkpoint_that_does_not_match_fails_before_training_listing_every_name(shell, checkpoint, capsys):
    root = checkpoint[0]
    shell.user_ns.update(WEIGHTS=str(root / "one.safetensors"), torch=torch)
    error = shell.run(MISMATCH_CELL).error_in_exec
    assert type(error).__name__ == "WorkerError", error
    text = str(error)
    assert "WeightsError: weights=" in text and "does not match Sequential" in text
    assert "2 parameters of the model" not in text  # names differ only in shape here: listed as shapes
    assert "2 shapes differ: 2.weight (model (5, 32), checkpoint (32, 32)), 2.bias (model (5,), checkpoint (32,))" \
        in text
    assert "4 tensors of the checkpoint are not in the model: 4.bias, 4.weight, 6.bias, 6.weight" in text
    assert "line 3, in train" in text, text  # the cell's own line: the ctx.prepare call
    assert "TRAINING STARTED" not in capsys.readouterr().out
