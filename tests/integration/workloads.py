"""Training cells shared by the backend tests, so every backend is compared on the same function."""

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
