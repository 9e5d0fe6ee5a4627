"""What ``--ac`` and ``--compile`` save and cost on one process (docs/big-models.md#knobs): activation bytes kept for
the backward and the time of a forward and backward, for an 8-block residual MLP (the unit test's ``EightBlocks``).

    .venv/bin/python benchmarks/bench_ac.py [--batch 512] [--steps 30] [--compile]

Bytes: what autograd saves (``torch.autograd.graph.saved_tensors_hooks``) plus the block inputs a checkpoint holds.
Time: the best of two rounds of ``--steps`` steps, one thread. ``--compile`` adds the compiled runs (inductor; the
first compile of a block class takes about a minute on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from dtrain_magic.worker.blocks import prepare_blocks


class Block(torch.nn.Module):
    def __init__(self, width: int = 32, hidden: int = 128):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def eight_blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *(Block() for _ in range(8)), torch.nn.Linear(32, 1))


def kept_bytes(model: torch.nn.Module, blocks: list, checkpointed: bool, x: torch.Tensor) -> int:
    kept = [0]

    def pack(tensor):
        kept[0] += tensor.numel() * tensor.element_size()
        return tensor

    hooks = [b.register_forward_pre_hook(lambda m, args: kept.__setitem__(0, kept[0] + args[0].numel() * 4))
             for b in blocks] if checkpointed else []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x).sum()
    loss.backward()
    for hook in hooks:
        hook.remove()
    return kept[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.batch, 8)
    for mode, compiled in [(m, False) for m in ("none", "selective", "full")] + (
            [("none", True), ("full", True)] if args.compile else []):
        model = eight_blocks()
        started = time.perf_counter()
        blocks = prepare_blocks(model, mode, compile=compiled)
        model(x).sum().backward()  # the first step (compiles with --compile)
        first = time.perf_counter() - started
        chosen = blocks if mode == "full" else blocks[::2]
        kept = kept_bytes(model, chosen, mode != "none" and not compiled, x)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            for _ in range(args.steps):
                model(x).sum().backward()
            best = min(best, (time.perf_counter() - started) / args.steps)
        print(f"--ac {mode:9s}{' --compile' if compiled else '':10s} kept {kept:>9,} B  step {best * 1e3:7.2f} ms  "
              f"first step {first:6.2f} s")


if __name__ == "__main__":
    main()
