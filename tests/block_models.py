"""The small residual block model the --ac and memory-estimate unit tests share: ``blocks`` repeated `Block`s (the
class --ac finds by repetition) between an input and an output layer. (tests/integration/test_activation_estimate.py
writes the same model in its cell's source: a worker cannot import this module; benchmarks/bench_ac.py has its own.)"""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    """One residual MLP block: ``x + down(gelu(up(x)))``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class BlockStack(torch.nn.Module):
    """``inputs`` features → ``blocks`` `Block`s of ``width`` (``hidden`` inside) → 1 output, times ``scale``."""

    def __init__(self, inputs: int, width: int, hidden: int, blocks: int = 8):
        super().__init__()
        self.embed = torch.nn.Linear(inputs, width)
        self.layers = torch.nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x, scale=1.0):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * scale
