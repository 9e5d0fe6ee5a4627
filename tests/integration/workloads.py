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


STEPS, EVERY, KILL_AT = 12, 4, 6

# One training function for every backend: checkpoints every EVERY steps (on Ray), resumes from the
# latest one, and rank 1 SIGKILLs itself once at KILL_AT when KILL is set (a marker file makes it once).
RESTART_CELL = """%%distribute --backend {backend} -n 2 --no-ui {flags}
import os, signal, torch
STEPS, EVERY, KILL_AT, KILL, SAVE = {steps}, {every}, {kill_at}, {kill}, {save}
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
            os.kill(os.getpid(), signal.SIGKILL)
        loss = (model(data[step, ctx.rank]) - target[step, ctx.rank]).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        ctx.log({{"loss": loss.item()}}, step=step)
        if SAVE and step % EVERY == EVERY - 1:
            ctx.save_checkpoint(step=step)
    return {{k: v.detach().clone() for k, v in ctx.strategy.full_state_dict().items()}}
"""


def restart_cell(backend: str, flags: str = "", kill: bool = False, save: bool = True, steps: int = STEPS) -> str:
    return RESTART_CELL.format(backend=backend, flags=flags, steps=steps, every=EVERY, kill_at=KILL_AT, kill=kill, save=save)



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
from dtrain_magic.memory import optimizer_state_bytes

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
