"""The fixed small job every benchmark runs: an MLP, Adam, ``steps`` steps of 32 random samples per rank.

``raw_train`` is the plain torch.distributed DDP version (what a torchrun script, TorchDistributor or
TorchTrainer would run); ``MAGIC_BODY`` is the same loop written against ``ctx``. Both return rank's
unix time of its first optimizer step and its steady-state steps per second (after 10 warm-up steps),
so time to first step is measured the same way on both sides.
"""

from __future__ import annotations

import time

WARMUP_STEPS = 10


def raw_train(steps: int = 200, log: bool = True) -> dict:
    import torch
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        if dist.get_world_size() > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dist.get_rank())
        first = steady_from = None
        for step in range(steps):
            x = torch.randn(32, 32, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = loss.item()  # the magic's loop reads the loss for ctx.log; so does this one
            if first is None:
                first = time.time()
            if step == WARMUP_STEPS - 1:
                steady_from = time.perf_counter()
        rate = (steps - WARMUP_STEPS) / (time.perf_counter() - steady_from)
        return {"first_step": first, "steps_per_s": rate, "loss": value}
    finally:
        if owns:
            dist.destroy_process_group()


MAGIC_BODY = '''
import time
import torch
def train(ctx):
    steps, log = STEPS, LOG
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.prepare(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    first = steady_from = None
    for step in range(steps):
        x = torch.randn(32, 32, generator=g)
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        value = loss.item()
        if log:
            ctx.log(loss=value)
        if first is None:
            first = time.time()
        if step == 9:
            steady_from = time.perf_counter()
    rate = (steps - 10) / (time.perf_counter() - steady_from)
    return {"first_step": first, "steps_per_s": rate, "loss": value}
'''


def summarize(values: list[float]) -> dict:
    import statistics

    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def now() -> float:
    return time.time()
