"""The `Strategy` interface: how a model and optimizer are wrapped, stepped and checkpointed.

A strategy knows nothing of the backend that started the process: it gets a process group that is
already initialised, its rank, world size and device. ``TorchStrategy`` holds what DDP and FSDP share:
autocast for bf16/fp16 (with a GradScaler for fp16) and gradient accumulation that divides the loss
by the number of micro-steps, so N accumulated micro-batches give the update of one N-times bigger batch.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..config import RunConfig


class Strategy(ABC):
    """One way of training in parallel. Subclasses register themselves by ``name`` (see the registry)."""

    name: ClassVar[str]

    def __init__(self, config: RunConfig, rank: int, local_rank: int, world_size: int, device: torch.device):
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self.model: Any = None
        self.optimizer: Any = None
        self.loaders: tuple = ()

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """Validate ``config`` for this strategy in the notebook, before launch (raise ConfigError)."""

    def set_loaders(self, loaders: tuple) -> None:
        """Called by ``ctx.prepare`` before `wrap` with the loaders it was given (DeepSpeed takes its
        ``train_micro_batch_size_per_gpu`` from the first one's batch size)."""
        self.loaders = tuple(loaders)

    def report_memory(self, model: torch.nn.Module) -> None:
        """Print (rank 0) the per-process memory estimate for ``model`` under this run's settings."""
        if self.rank != 0:
            return
        try:
            from ..memory import report

            per_device = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size))) if self.device.type != "cuda" else 1
            print(report(model, self.config.strategy, self.config.zero, self.config.precision, self.world_size,
                         self.device, per_device), flush=True)
        except Exception as exc:  # an estimate must never break a run
            print(f"memory estimate unavailable: {exc}", flush=True)

    @abstractmethod
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        """Wrap ``model`` (and ``optimizer``) for this strategy; returns what user code should use."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass of one micro-batch."""

    @abstractmethod
    def step(self) -> bool:
        """End of one micro-batch: step the optimizer at an accumulation boundary. True if it stepped."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass in the run's precision."""
        return contextlib.nullcontext()

    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        raise NotImplementedError(f"--strategy {self.name} does not support checkpoints yet")

    def load_checkpoint(self, directory: str) -> dict | None:
        raise NotImplementedError(f"--strategy {self.name} does not support checkpoints yet")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state dict, gathered on every rank (for shards), for saving on rank 0."""
        model = getattr(self.model, "module", self.model)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def teardown(self) -> None:
        """Release what the strategy holds (engines, hooks) before the process group goes."""


class TorchStrategy(Strategy):
    """Shared by the strategies that use a plain torch optimizer (DDP, FSDP)."""

    _dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.micro_step = 0
        self.scaler = None
        if self.config.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    @property
    def accumulation(self) -> int:
        return self.config.grad_accum

    def _at_boundary(self) -> bool:
        return (self.micro_step + 1) % self.accumulation == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self._dtypes.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on micro-batches that do not end an accumulation window."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.accumulation
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        context = contextlib.nullcontext() if self._at_boundary() else self.no_sync()
        with context:
            loss.backward()

    def step(self) -> bool:
        stepped = self._at_boundary()
        self.micro_step += 1
        if not stepped or self.optimizer is None:
            return stepped
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        """Full (unsharded) model and optimizer state, written by rank 0."""
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            state = {
                "model": getattr(self.model, "module", self.model).state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "micro_step": self.micro_step,
                "client_state": client_state or {},
            }
            if self.scaler is not None:
                state["scaler"] = self.scaler.state_dict()
            torch.save(state, os.path.join(directory, "checkpoint.pt"))

    def load_checkpoint(self, directory: str) -> dict | None:
        path = os.path.join(directory, "checkpoint.pt")
        if not os.path.exists(path):
            return None
        state = torch.load(path, map_location=self.device, weights_only=False)
        getattr(self.model, "module", self.model).load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.micro_step = state.get("micro_step", 0)
        return state.get("client_state")

