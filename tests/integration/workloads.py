"""Training cells shared by the backend tests, so every backend is compared on the same function."""

import torch

TRAIN_HELPERS = """
import torch

def make_data(n=64, features=8):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True) + 0.1)
"""

# Global batch 16; each rank gets 16 / world_size samples of every global batch (DistributedSampler).
# Returns the final weights (fp32) of rank's model.
TRAIN_CELL = """%%distribute --backend {backend} -n {n} --no-ui {extra}
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=16 // ctx.world_size)
    model, opt, loader = ctx.prepare(model, opt, loader)
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            ctx.backward(loss)
            ctx.step()
            ctx.log(loss=loss.item())
    plain = getattr(model, "module", model)
    return {{k: v.detach().clone() for k, v in plain.state_dict().items()}}
"""


def train_cell(backend: str, n: int = 2, extra: str = "") -> str:
    return TRAIN_CELL.format(backend=backend, n=n, extra=extra)


def train_reference() -> dict:
    """TRAIN_CELL's final weights in one plain process: global batches of 16 in order (the sharded runs' ranks
    see the same 16 samples per step, unshuffled), Adam, 3 epochs, fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(64, 8, generator=g)
    Y = X.sum(1, keepdim=True) + 0.1
    for _ in range(3):
        for start in range(0, 64, 16):
            loss = torch.nn.functional.mse_loss(model(X[start:start + 16]), Y[start:start + 16])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


STEPS, EVERY, KILL_AT = 12, 4, 6

# One training function for every backend: checkpoints every EVERY steps (on Ray), resumes from the
# latest one, and rank 1 SIGKILLs itself once at KILL_AT when KILL is set (a marker file makes it once).
RESTART_CELL = """%%distribute --backend {backend} -n 2 --no-ui {flags}
import os, signal, time, torch
STEPS, EVERY, KILL_AT, KILL, SAVE, PAUSE = {steps}, {every}, {kill_at}, {kill}, {save}, {pause}
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
    data = torch.randn(STEPS, 2, 4, 8, generator=torch.Generator().manual_seed(1))  # step, rank, batch, x
    target = data.sum(-1, keepdim=True)
    open(f"pid_{{ctx.rank}}", "a").write(f"{{os.getpid()}}\\n")
    state = ctx.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    if state is not None:
        print(f"resumed at step {{start}}")
    for step in range(start, STEPS):
        if KILL and step == KILL_AT and ctx.rank == 1 and not os.path.exists("killed"):
            open("killed", "w").close()
            os.kill(os.getpid(), signal.{signal})
        loss = (model(data[step, ctx.rank]) - target[step, ctx.rank]).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        time.sleep(PAUSE)
        ctx.log({{"loss": loss.item()}}, step=step)
        if SAVE and step % EVERY == EVERY - 1:
            ctx.save_checkpoint(step=step)
    return {{k: v.detach().clone() for k, v in ctx.strategy.full_state_dict().items()}}
"""


def restart_cell(backend: str, flags: str = "", kill: bool = False, save: bool = True, steps: int = STEPS,
                 signal: str = "SIGKILL", pause: float = 0.0) -> str:
    """``kill``: rank 1 sends itself ``signal`` before step KILL_AT (once); ``pause``: seconds after each step (a
    step as long as the ranks' preemption check interval, `worker.preempt.CHECK_EVERY_S`: a SIGTERM is acted on
    within the run)."""
    return RESTART_CELL.format(backend=backend, flags=flags, steps=steps, every=EVERY, kill_at=KILL_AT, kill=kill,
                               save=save, signal=signal, pause=pause)



# Rank 1 SIGKILLs itself after logging one metric; rank 0 waits in a barrier (the killed-worker tests).
KILL_RANK1_CELL = (
    "%%distribute --backend {backend} -n 2 --no-ui\n"
    "import os, signal, time\n"
    "def train(ctx):\n"
    "    ctx.log(loss=1.0)\n"
    "    if ctx.rank == 1:\n"
    "        time.sleep(0.5)\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    ctx.barrier()\n"
)

# ----------------------------------------------------------------------------------------------------
# The strategies' training function (tests/integration/test_strategies.py, and the same function on
# Spark and Ray). Rank 0 returns the full fp32 weights (ctx.full_state_dict()), its per-rank optimizer
# state bytes, the losses, and the weights of a second model resumed from the half-way checkpoint.
# Tolerance (fp32): final weights within atol 1e-5 / rtol 1e-4 of one process on the same data and seed.

N_SAMPLES = 64
WORLD = 2
ATOL, RTOL = 1e-5, 1e-4

STRATEGY_CELL = '''
import os
import torch
from dtrain_magic.strategies.memory import optimizer_state_bytes

def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

def make_data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn({n}, 16, generator=g)
    return X, X.sum(1, keepdim=True).sin()

def train(ctx):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    X, Y = make_data()
    data = torch.utils.data.TensorDataset(X, Y)
    loader = torch.utils.data.DataLoader(data, batch_size={micro})
    model, opt, loader = ctx.prepare(model, opt, loader)
    batches = list(loader)
    half = len(batches) // 2
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == half:
            ctx.save_checkpoint("{ckpt}", note=half)
        with ctx.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
        losses.append(loss.item())
    final = ctx.full_state_dict()
    opt_bytes = optimizer_state_bytes(opt)

    # resume: a fresh model (other init) and optimizer, restored from the half-way checkpoint
    torch.manual_seed(123)
    model2 = make_model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    model2, opt2 = ctx.prepare(model2, opt2)
    client = ctx.load_checkpoint("{ckpt}")
    for x, y in batches[half:]:
        with ctx.autocast():
            loss = torch.nn.functional.mse_loss(model2(x).float(), y)
        ctx.backward(loss)
        ctx.step()
    resumed = ctx.full_state_dict()
    return {{"final": final, "resumed": resumed, "opt_bytes": opt_bytes, "losses": losses, "client": client}}
'''


def reference_weights(micro: int, accum: int, samples: int = N_SAMPLES) -> dict[str, torch.Tensor]:
    """One process, batches of micro x accum x WORLD contiguous samples (what the sharded runs see per step),
    over the first ``samples`` samples."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N_SAMPLES, 16, generator=g)
    Y = X.sum(1, keepdim=True).sin()
    big = micro * accum * WORLD
    for start in range(0, samples, big):
        loss = torch.nn.functional.mse_loss(model(X[start:start + big]), Y[start:start + big])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def strategy_cell(backend: str, flags: str, checkpoint_dir, micro: int = 4) -> str:
    """STRATEGY_CELL on ``backend`` with ``WORLD`` processes; only the flag line differs between strategies."""
    return f"%%distribute --backend {backend} -n {WORLD} --no-ui {flags}\n" + STRATEGY_CELL.format(
        n=N_SAMPLES, micro=micro, ckpt=checkpoint_dir
    )


def assert_strategy_run(result, accum: int) -> None:
    """A STRATEGY_CELL run on another backend: one process's weights (fp32) and a checkpoint resume."""
    assert result.error_in_exec is None, result.error_in_exec
    out = result.result.value
    assert_close(out["final"], reference_weights(4, accum), ATOL, RTOL)
    assert_close(out["resumed"], out["final"], 1e-6, 0)  # checkpoint save -> load -> continue


def assert_close(a: dict, b: dict, atol: float, rtol: float) -> float:
    assert set(a) == set(b)
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert a[key].numel() > 0, f"{key} is empty (a ZeRO-3/FSDP shard, not the gathered tensor)"
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=rtol, msg=key)
        worst = max(worst, (a[key].float() - b[key].float()).abs().max().item())
    return worst




# A cell that succeeds or, with FAIL set in the notebook, fails on rank 1: runs in a row must leave nothing growing.
MIXED_CELL = """%%distribute --backend {backend} -n 2 --no-ui
def train(ctx):
    import torch
    model, opt = ctx.prepare(torch.nn.Linear(4, 1), None)
    ctx.log(loss=float(ctx.rank))
    if FAIL and ctx.rank == 1:
        raise RuntimeError("planned failure")
    return ctx.rank
"""


def notebook_snapshot() -> dict:
    """What a long-lived kernel must not accumulate: its open files, threads, listening sockets, memory."""
    import gc
    import threading

    import psutil

    gc.collect()
    me = psutil.Process()
    return {
        "fds": me.num_fds(),
        "threads": threading.active_count(),
        "rss_mb": me.memory_info().rss / 2**20,
        "listening": len([c for c in me.net_connections("inet") if c.status == "LISTEN"]),
    }


def assert_nothing_grew(before: dict, after: dict, rss_mb: float = 150) -> None:
    assert after["listening"] == before["listening"], (before, after)
    assert after["fds"] <= before["fds"] + 5, (before, after)
    assert after["threads"] <= before["threads"] + 2, (before, after)
    assert after["rss_mb"] <= before["rss_mb"] + rss_mb, (before, after)


# ----------------------------------------------------------------------------------------------------
# Existing code, unchanged (issue #13): functions written for TorchDistributor / torchrun, Ray Train
# loops, Hugging Face Trainer, accelerate and Lightning. Every style trains the same tiny regression
# (EXISTING_HELPERS) where it can, with a global batch of 16, so its final weights can be compared with
# one plain process (`existing_reference`, fp32, atol 1e-5).

EXISTING_HELPERS = """
import torch

def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

def make_data(n=64):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(X, 0.5 * X.sum(1, keepdim=True) + 0.1)
"""

GLOBAL_BATCH, EXISTING_LR, EXISTING_EPOCHS = 16, 0.02, 3

# Written as TorchDistributor's examples are: its own init_process_group ({init}), DDP, a
# DistributedSampler from RANK/WORLD_SIZE, destroy_process_group at the end; called with arguments.
TORCHDISTRIBUTOR_CELL = """%%distribute --backend {backend} -n 2 --no-ui
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

def train(lr, epochs=1):
    {init}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    env = {{k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}}
    import psutil
    listening = sorted({{c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}})
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=16 // world, sampler=sampler)
    losses = []
    for epoch in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    weights = {{k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    dist.destroy_process_group()
    return {{"env": env, "losses": losses, "weights": weights, "group_alive": dist.is_initialized(),
            "listening": listening}}

train({lr}, epochs={epochs})
"""


def torchdistributor_cell(backend: str, init: str = 'dist.init_process_group("gloo")') -> str:
    return TORCHDISTRIBUTOR_CELL.format(backend=backend, init=init, lr=EXISTING_LR, epochs=EXISTING_EPOCHS)


# A Ray Train loop as Ray's docs write it: get_context, prepare_model, prepare_data_loader, report with a
# checkpoint from rank 0, get_checkpoint to resume; rank 1 SIGKILLs itself once at epoch KILL_EPOCH when
# KILL is set (a marker file makes it once). Called with its config dict, as TorchTrainer would.
RAY_LOOP_CELL = """%%distribute --backend ray -n 2 --no-ui {flags}
import os, signal, tempfile, time
import torch
import ray.train
import ray.train.torch
from torch.utils.data import DataLoader

KILL, KILL_EPOCH = {kill}, 2

def train_loop_per_worker(config):
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loader = ray.train.torch.prepare_data_loader(DataLoader(make_data(), batch_size=16 // world))
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
        print(f"resumed at epoch {{start}}")
    for epoch in range(start, config["epochs"]):
        if KILL and epoch == KILL_EPOCH and rank == 1 and not os.path.exists("killed"):
            # Ray Train registers a reported checkpoint when its controller next polls the workers (every
            # 2 s): die after that, as a failure later in an epoch would, so the restart is handed it.
            time.sleep(5)
            open("killed", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if rank == 0:
                torch.save({{"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}},
                           os.path.join(directory, "state.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({{"loss": total / len(loader), "epoch": epoch}}, checkpoint=checkpoint)
    return {{"rank": rank, "weights": {{k: v.detach().clone() for k, v in model.module.state_dict().items()}}}}

train_loop_per_worker({{"lr": {lr}, "epochs": {epochs}}})
"""


def ray_loop_cell(flags: str = "", kill: bool = False, epochs: int = 4) -> str:
    return RAY_LOOP_CELL.format(flags=flags, kill=kill, lr=EXISTING_LR, epochs=epochs)


def existing_reference(epochs: int = EXISTING_EPOCHS, lr: float = EXISTING_LR) -> dict:
    """One plain process on the same model, data and seed, batches of GLOBAL_BATCH contiguous samples."""
    namespace: dict = {}
    exec(EXISTING_HELPERS, namespace)
    torch.manual_seed(0)
    model = namespace["make_model"]()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    X, Y = namespace["make_data"]().tensors
    for _ in range(epochs):
        for start in range(0, len(X), GLOBAL_BATCH):
            loss = torch.nn.functional.mse_loss(model(X[start:start + GLOBAL_BATCH]), Y[start:start + GLOBAL_BATCH])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# A Hugging Face Trainer on a tiny GPT-2 built from a config (no download), on a learnable token pattern
# made in code; report_to="mlflow" on purpose: the magic must keep it out of a second MLflow run.
HF_TRAINER_CELL = """%%distribute --backend {backend} -n 2 --no-ui {flags}
import os
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

def train():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=32, n_positions=16))
    starts = torch.randint(0, 32, (64,), generator=torch.Generator().manual_seed(1))
    ids = (starts[:, None] + torch.arange(16)[None, :]) % 32  # each next token is the last + 1
    data = [{{"input_ids": row, "labels": row}} for row in ids]
    args = TrainingArguments(
        output_dir="hf_out", per_device_train_batch_size=4, num_train_epochs=4, learning_rate=5e-3,
        logging_steps=1, save_strategy="no", report_to="mlflow", use_cpu=True, disable_tqdm=True, seed=0,
        {args}
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    output = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {{"losses": losses, "world_size": trainer.args.world_size, "rank": int(os.environ["RANK"]),
            "bf16": trainer.args.bf16, "accum": trainer.args.gradient_accumulation_steps,
            "steps": trainer.state.global_step, "train_loss": output.training_loss}}
"""


def hf_trainer_cell(backend: str, flags: str = "", args: str = "") -> str:
    return HF_TRAINER_CELL.format(backend=backend, flags=flags, args=args)


# An accelerate loop as its docs write it (Accelerator(cpu=True), prepare, accelerator.backward, log).
ACCELERATE_CELL = """%%distribute --backend {backend} -n 2 --no-ui {flags}
import torch
from accelerate import Accelerator

def train():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=16 // accelerator.num_processes)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
            accelerator.log({{"loss": loss.item()}}, step=len(losses) - 1)
    weights = {{k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}}
    return {{"losses": losses, "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "rank": accelerator.process_index, "weights": weights}}
"""


def accelerate_cell(backend: str, flags: str = "") -> str:
    return ACCELERATE_CELL.format(backend=backend, flags=flags)


# Lightning's Trainer(strategy="ddp", devices=2): in the magic's processes, it must not launch its own.
LIGHTNING_CELL = """%%distribute --backend {backend} -n 2 --no-ui
import os
import torch
import lightning as L

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)

def train():
    torch.manual_seed(0)
    module = Regression()
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(make_data(), batch_size=8))
    return {{"losses": module.losses, "world_size": trainer.world_size, "rank": trainer.global_rank, "pid": os.getpid(),
            "weights": {{k: v.detach().clone() for k, v in module.net.state_dict().items()}}}}
"""


def lightning_cell(backend: str) -> str:
    return LIGHTNING_CELL.format(backend=backend)


def loss_fell(losses: list, per_epoch: int = 4) -> bool:
    """The last epoch's mean loss is under half the first epoch's."""
    first, last = losses[:per_epoch], losses[-per_epoch:]
    return sum(last) / len(last) < 0.5 * sum(first) / len(first)


# ----------------------------------------------------------------------------------------------------
# Model parallelism (issue #16): one training function written with ctx.train_step, run under --tp, --pp,
# 2-D FSDP x TP and the data-parallel strategies by changing the %%distribute line only. The per-process batch
# is GLOBAL // ctx.data_parallel_size, so every run takes steps of the same global batch (x --grad-accum) as the
# one-process reference. Rank 0 returns the final full state (ctx.full_state_dict()), the losses, and the state
# of a second model resumed from the checkpoint saved half-way. Tolerance (fp32): 1e-5 against one process.

TP_WIDTHS = (8, 32, 16, 4)  # Linear-ReLU-Linear-ReLU-Linear
PP_WIDTHS = (8, 32, 32, 16, 4)  # a 4-layer nn.Sequential (Linear-ReLU x 3, Linear)
MP_SAMPLES, MP_GLOBAL_BATCH = 64, 16

MODEL_PARALLEL_CELL = '''
import torch

GLOBAL, WIDTHS = {global_batch}, {widths}

def make_model():
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])

def make_data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn({samples}, WIDTHS[0], generator=g)
    return X, torch.sin(X @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=g))

def train(ctx):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    X, Y = make_data()
    data = torch.utils.data.TensorDataset(X, Y)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL // ctx.data_parallel_size)
    model, opt, loader = ctx.prepare(model, opt, loader)
    batches = list(loader)
    half = len(batches) // 2
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == half:
            ctx.save_checkpoint("{ckpt}", note=half)
        losses.append(ctx.train_step(x, y, torch.nn.functional.mse_loss).item())
        ctx.log(loss=losses[-1])
    final = ctx.full_state_dict()

    torch.manual_seed(123)  # another start, overwritten by the checkpoint
    model2 = make_model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    model2, opt2 = ctx.prepare(model2, opt2)
    client = ctx.load_checkpoint("{ckpt}")
    for x, y in batches[half:]:
        ctx.train_step(x, y, torch.nn.functional.mse_loss)
    return {{"final": final, "resumed": ctx.full_state_dict(), "losses": losses, "client": client}}
'''


def model_parallel_cell(backend: str, flags: str, checkpoint_dir, widths=TP_WIDTHS, n: int = 2) -> str:
    return f"%%distribute --backend {backend} -n {n} --no-ui {flags}\n" + MODEL_PARALLEL_CELL.format(
        global_batch=MP_GLOBAL_BATCH, widths=tuple(widths), samples=MP_SAMPLES, ckpt=checkpoint_dir
    )


def _model_parallel_namespace(widths) -> dict:
    namespace: dict = {}
    exec(MODEL_PARALLEL_CELL.format(global_batch=MP_GLOBAL_BATCH, widths=tuple(widths), samples=MP_SAMPLES, ckpt=""),
         namespace)
    return namespace


def model_parallel_reference(widths=TP_WIDTHS, accum: int = 1) -> tuple[dict, list[float]]:
    """One process, one optimizer step per MP_GLOBAL_BATCH x accum contiguous samples: the final weights, and the
    loss of every MP_GLOBAL_BATCH samples (what each train_step call returns) before its step."""
    namespace = _model_parallel_namespace(widths)
    torch.manual_seed(0)
    model = namespace["make_model"]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    X, Y = namespace["make_data"]()
    losses, big = [], MP_GLOBAL_BATCH * accum
    for start in range(0, MP_SAMPLES, big):
        opt.zero_grad()
        chunks = [torch.nn.functional.mse_loss(model(X[i:i + MP_GLOBAL_BATCH]), Y[i:i + MP_GLOBAL_BATCH])
                  for i in range(start, start + big, MP_GLOBAL_BATCH)]
        torch.stack(chunks).mean().backward()
        opt.step()
        losses += [chunk.item() for chunk in chunks]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def assert_model_parallel_run(result, widths=TP_WIDTHS, accum: int = 1, global_losses: bool = True) -> float:
    """A MODEL_PARALLEL_CELL run: one process's weights (fp32, 1e-5), the state loadable into the plain model, the
    checkpoint resume equal to the uninterrupted run, and (``global_losses``: one model replica, so each step's
    loss is the whole global batch's) one process's losses. Returns the largest weight difference."""
    import pytest

    assert result.error_in_exec is None, result.error_in_exec
    out = result.result.value
    reference, losses = model_parallel_reference(widths, accum)
    worst = assert_close(out["final"], reference, 1e-5, 0)
    _model_parallel_namespace(widths)["make_model"]().load_state_dict(out["final"])  # the plain model takes it
    if global_losses:
        assert out["losses"] == pytest.approx(losses, abs=1e-5), (out["losses"], losses)
    assert_close(out["resumed"], out["final"], 1e-6, 0)
    assert out["client"] == {"note": MP_SAMPLES // MP_GLOBAL_BATCH // 2}
    return worst


# Tensor parallelism of Hugging Face models built from a config (no download): GPT-2 (its own plan: Conv1D, fused
# q/k/v split per head group) and Llama (its base_model_tp_plan). No dropout, so one process is the reference.
HF_TP_HELPERS = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 64

def make_hf(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=16))

def tokens():
    starts = torch.randint(0, VOCAB, (32, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(16)) % VOCAB  # each next token is the last + 1: learnable

def next_token_loss(output, ids):
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
"""

HF_TP_CELL = """%%distribute --backend local -n 2 --no-ui --tp 2
def train(ctx):
    out = {}
    for kind in ("gpt2", "llama"):
        model = make_hf(kind)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt = ctx.prepare(model, opt)
        ids = tokens()
        losses = [ctx.train_step(ids[i:i + 8], ids[i:i + 8], next_token_loss).item() for i in range(0, 32, 8)]
        out[kind] = {"losses": losses, "state": ctx.full_state_dict()}
        if kind == "gpt2":
            attn = model.transformer.h[0].attn
            out["gpt2_attention"] = (attn.num_heads, attn.split_size, tuple(attn.c_attn.q.weight.to_local().shape))
    return out
"""


def hf_reference(kind: str) -> tuple[dict, list[float], object]:
    """One process: the final state and the per-step losses of HF_TP_CELL's training, and the model."""
    namespace: dict = {}
    exec(HF_TP_HELPERS, namespace)
    model = namespace["make_hf"](kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = namespace["tokens"]()
    losses = []
    for i in range(0, 32, 8):
        loss = namespace["next_token_loss"](model(ids[i:i + 8]), ids[i:i + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, namespace["make_hf"](kind)


# The way most projects keep their code (issue #23): the training function lives in the project's own module and the
# cell imports it, then calls it on its last line. The call form ships it; it must never run in the notebook (there
# RANK is unset: the function then leaves a marker file instead of training).
PROJECT_MODULE = EXISTING_HELPERS + '''
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def fit(lr, epochs=1):
    if "RANK" not in os.environ:  # the notebook process: the call form must never get here
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RAN_IN_NOTEBOOK"), "w").close()
        return None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = make_data()
    loader = DataLoader(data, batch_size=16 // world, sampler=DistributedSampler(data, world, rank, shuffle=False))
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
'''


def write_project(root) -> str:
    """``root/my_project/train.py`` with `PROJECT_MODULE`; the folder to put on ``sys.path``."""
    package = root / "my_project"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(PROJECT_MODULE)
    return str(root)


def imported_call_cell(backend: str, flags: str = "") -> str:
    return (f"%%distribute --backend {backend} -n 2 --no-ui {flags}\nfrom my_project.train import fit\n"
            f"fit({EXISTING_LR}, epochs={EXISTING_EPOCHS})\n")


def assert_imported_call_run(result, root) -> None:
    """Every rank trained one process's weights (fp32, 1e-5), and nothing ran in the notebook."""
    assert result.error_in_exec is None, result.error_in_exec
    assert not (root / "my_project" / "RAN_IN_NOTEBOOK").exists(), "the imported function ran in the notebook"
    assert result.result.config.backend and result.result.values[1] is not None
    assert_close(result.result.value, existing_reference(), atol=1e-5, rtol=0)
    assert_close(result.result.values[1], result.result.value, atol=0, rtol=0)


def ended_run(mlflow, experiment: str = "dtrain_magic", within: float = 30.0):
    """The experiment's latest MLflow run once it has ended. A stopped run (interrupt, timeout, hang) gives the
    cell back at once; an MLflow run still opening then is recorded and ended in the background."""
    import time

    deadline = time.monotonic() + within
    while True:
        found = mlflow.get_experiment_by_name(experiment)
        runs = mlflow.search_runs(experiment_ids=[found.experiment_id], max_results=1) if found else []
        if runs and runs[0].info.status != "RUNNING":
            return runs[0]
        assert time.monotonic() < deadline, f"no ended run in {experiment!r} after {within} s: {runs}"
        time.sleep(0.2)


def everything_stored(mlflow, run_id: str) -> str:
    """An MLflow run's params, tags and every artifact's text (each rank's log under logs/, stacks, the result):
    what a secret must not reach."""
    import os
    import tempfile

    run = mlflow.get_run(run_id)
    text = repr(run.data.params) + repr(run.data.tags)
    with tempfile.TemporaryDirectory() as where:
        root = mlflow.download_artifacts(run_id, "", where)
        for folder, _, files in os.walk(root):
            for name in files:
                with open(os.path.join(folder, name), errors="replace") as handle:
                    text += handle.read()
    return text


def committed_reads(directory: str = ".") -> dict[int, list[int]]:
    """An elastic run's ``read_*.txt`` logs (each line: the optimizer step its attempt began at, the step a batch went
    into, the epoch, the batch's row ids) → per epoch, the row ids read into optimizer steps that count: each
    attempt's up to where the next one resumed (its later ones were redone), the last attempt's all."""
    import collections
    import glob
    import os

    lines = [list(map(int, line.split())) for path in glob.glob(os.path.join(directory, "read_*.txt"))
             for line in open(path)]
    starts = sorted({line[0] for line in lines})
    per_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for start, step, epoch, *ids in lines:
        later = [s for s in starts if s > start]
        if not later or step <= later[0]:
            per_epoch[epoch] += ids
    return per_epoch
