"""The `Strategy` interface: how a model and optimizer are wrapped, stepped and checkpointed.

A strategy knows nothing of the backend that started the process: it gets a process group that is
already initialised, its rank, world size and device. ``TorchStrategy`` holds what DDP and FSDP share:
autocast for bf16/fp16 (with a GradScaler for fp16), gradient accumulation that divides the loss
by the number of micro-steps, so N accumulated micro-batches give the update of one N-times bigger batch,
and model parallelism (``--tp``/``--pp``, `dtrain_magic.parallel.ModelParallel`). `Strategy.train_step` is the
one-call training step every strategy offers; under ``--pp`` it runs the pipeline schedule instead.

Models bigger than one process (`dtrain_magic.weights`): `Strategy.init_context` is how this strategy builds a model
without holding it whole (``ctx.init_model()``: parameters on the meta device for FSDP and ``--tp``/``--pp``,
``deepspeed.zero.Init`` for ZeRO-3, a plain build where every rank keeps a whole copy anyway); `wrap` takes such a
model and the checkpoint to fill it from (``weights``), and `stream_full_state` gives the whole model to rank 0 one
tensor at a time.

A strategy class is also its own facts, read by `RunConfig`'s validation and the notebook's plan (through
`dtrain_magic.registry.STRATEGIES`): so this package imports torch only inside the methods that run it (in a
worker, or for an estimate), and never imports `dtrain_magic.config` (which reads these facts).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Sequence

from . import sharded_checkpoint
from .memory import MemoryModel, ModelFacts

if TYPE_CHECKING:
    import torch

    from ..config import RunConfig

ADAM_TEMPORARIES = 2  # Adam's step: sqrt(exp_avg_sq), then its quotient, each the size of the tensor stepped
WHOLE_COPY_NOTE = (
    "a deferred build (ctx.init_model() or a model factory) under {what} builds the whole model on every rank: "
    "{why}. To build only this rank's part use --strategy fsdp, --zero 3, --tp or --pp"
)


class Strategy(ABC):
    """One way of training in parallel: its facts (class attributes and classmethods: the flags it owns, its
    rules, its memory model, its process-group backend, its panel defaults) and what it does in a worker.

    Subclasses set ``name`` and are found through `dtrain_magic.registry.STRATEGIES` (one line there).
    """

    name: ClassVar[str]
    #: `RunConfig` fields that apply only to this strategy (``--zero``): another strategy refuses them, the panel
    #: enables their controls only under it, and giving one without ``--strategy`` chooses it.
    own_fields: ClassVar[tuple[str, ...]] = ()
    #: what the panel shows in an own field's control when this strategy is chosen and the field is unset
    panel_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: why ``--tp``/``--pp`` cannot be used with this strategy (None: they can)
    model_parallel_refusal: ClassVar[str | None] = None

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        """Pure rules on the flags for this strategy (`RunConfig` calls it; raise `ConfigError`). Default: none."""

    @classmethod
    def process_group_backend(cls, use_gpu: bool) -> str:
        """The torch.distributed backend of the run's process group: nccl on GPUs, else gloo."""
        return "nccl" if use_gpu else "gloo"

    @classmethod
    def memory_model(cls, zero: int | None, precision: str) -> MemoryModel:
        """How this strategy stores each parameter (`memory.MemoryModel`): replicated, fp32 (DDP's)."""
        return MemoryModel(stage=0)

    @classmethod
    def memory_buffers(cls, facts: ModelFacts, zero: int | None, precision: str, world_size: int, tp: int = 1,
                       pp: int = 1, settings: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        """The buffers this strategy allocates beyond the model states, as (what, bytes per process) for a model
        with ``facts`` (`memory.estimate` adds them). Default (one process, plain torch): Adam's step temporaries."""
        return [("Adam's step temporaries", ADAM_TEMPORARIES * 4 * facts.largest_param / (tp * pp))]

    @classmethod
    def memory_settings(cls, config: RunConfig, facts: ModelFacts) -> Mapping[str, Any]:
        """The sizes this strategy would use for a model with ``facts`` under ``config`` (`memory_buffers`'s
        ``settings``), for an estimate made before launch. Default: none."""
        return {}

    @classmethod
    def label(cls, zero: int | None = None) -> str:
        """The strategy as messages and the memory estimate name it (``deepspeed ZeRO-2``)."""
        return cls.name

    def __init__(self, config: RunConfig, rank: int, local_rank: int, world_size: int, device: torch.device):
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self.model: Any = None
        self.optimizer: Any = None
        self.loaders: tuple = ()
        self.tp_plan: Mapping[str, Any] | None = None
        self.pp_split: Sequence[str | int] | None = None
        #: one micro-batch's activations per --ac mode (`memory.Activations`), measured by ``ctx.prepare`` from its
        #: ``sample=`` before `wrap`; `report_memory` adds them to the estimate it keeps in ``memory_estimate`` (rank 0)
        self.activations: Any = None
        self.memory_estimate: Any = None
        #: the global gradient norm (every shard's, before clipping) of the last optimizer step with ``--clip-grad``
        #: (``ctx.grad_norm``); None before the first such step, or without ``--clip-grad``
        self.grad_norm: float | None = None

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (``--grad-accum``; a strategy whose engine decides says its own): what a
        checkpoint keeps of the run (`TrainContext._run_state`)."""
        return self.config.grad_accum

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """Validate ``config`` for this strategy in the notebook, before launch (raise ConfigError)."""

    def set_loaders(self, loaders: tuple) -> None:
        """Called by ``ctx.prepare`` before `wrap` with the loaders it was given (DeepSpeed takes its
        ``train_micro_batch_size_per_gpu`` from the first one's batch size)."""
        self.loaders = tuple(loaders)

    def set_model_parallel_options(self, tp_plan: Mapping[str, Any] | None = None,
                                   pp_split: Sequence[str | int] | None = None) -> None:
        """Called by ``ctx.prepare`` before `wrap`: the user's tensor-parallel plan and pipeline split points. They
        apply only with ``--tp`` / ``--pp``; without them the same call runs unchanged and they are unused."""
        self.tp_plan, self.pp_split = tp_plan, pp_split

    @property
    def data_parallel_rank(self) -> int:
        """This rank's model replica: loaders are sharded over replicas (tensor-parallel shards and pipeline
        stages of one replica see the same batches)."""
        return self.rank

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    def report_memory(self, model: torch.nn.Module, settings: Mapping[str, Any] | None = None) -> None:
        """Print (rank 0) the per-process memory estimate for ``model`` under this run's settings (``settings``: the
        strategy's own sizes, for its buffers), with the activations of ``self.activations`` when measured, and keep
        it in ``self.memory_estimate``."""
        if self.rank != 0:
            return
        try:
            from .memory import report

            if self.device.type == "cuda":
                per_device = 1
            else:
                per_device = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
            self.memory_estimate, line = report(
                model, type(self), self.config.zero, self.config.precision, self.world_size, self.device, per_device,
                tp=self.config.tp, pp=self.config.pp, settings=settings, activations=self.activations,
                ac=self.config.ac)
            print(line, flush=True)
        except Exception as exc:  # an estimate must never break a run
            print(f"memory estimate unavailable: {exc}", flush=True)

    # -- models bigger than one process ------------------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager:
        """What ``ctx.init_model()`` enters: how this strategy builds a model without holding it whole. Default: a
        plain build (`note_whole_copy` says so)."""
        self.note_whole_copy()
        return contextlib.nullcontext()

    def note_whole_copy(self) -> None:
        """Say (rank 0, once) that a deferred build gives a whole model here, and why."""
        if self.rank == 0 and not getattr(self, "_noted_whole_copy", False):
            self._noted_whole_copy = True
            print(WHOLE_COPY_NOTE.format(what=self.label(self.config.zero), why=self.whole_copy_reason()), flush=True)

    def whole_copy_reason(self) -> str:
        return "every rank trains a whole copy of the model"

    def prepared_optimizer(self, optimizer: Any, model: torch.nn.Module, old_names: Mapping[int, str]) -> Any:
        """The optimizer for the prepared ``model``: a factory's, called with its parameters; or the user's, pointed
        at the new parameters when preparing replaced them (sharded, or given storage)."""
        import torch

        from ..parallel.state import repoint_optimizer
        from ..weights.deferred import optimizer_for

        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            current = {id(p) for p in model.parameters()}
            if optimizer is not None and any(id(p) not in current for g in optimizer.param_groups for p in g["params"]):
                repoint_optimizer(optimizer, old_names, model, strategy=f"--strategy {self.name}")
            return optimizer
        return optimizer_for(optimizer, model.parameters())

    def fill_whole(self, model: torch.nn.Module, weights: Any) -> None:
        """A whole model on this rank: parameters built without storage get it (then their values from the
        checkpoint or their own init), and a checkpoint is read whole."""
        from ..weights import deferred, loading

        if deferred.has_meta_parameters(model):
            self.note_whole_copy()
            pristine = None if weights is not None else deferred.pristine_copy(model)
            deferred.materialize(model, self.device)
            if pristine is not None:
                deferred.initialise(model, pristine)
        if weights is not None:
            loading.load(model, weights)

    def stream_full_state(self, include: Callable[[str], bool] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The whole model's fp32 state, ``(name, tensor)`` per state-dict key of the plain model, the tensor on rank
        0 only (None elsewhere); every rank must iterate it all (each item may be a collective). A tensor tied to
        another is the same object under both names. ``include``: only the names it accepts (a peft model's
        adapters), the others not gathered; the same on every rank. Default: the model is whole on every rank."""
        from ..weights.saving import stream

        module = getattr(self.model, "module", self.model)
        yield from stream(module.state_dict(keep_vars=True), lambda value: value, self.rank == 0, include)

    @abstractmethod
    def wrap(self, model: torch.nn.Module, optimizer: Any, weights: Any = None) -> tuple[Any, Any]:
        """Wrap ``model`` (and ``optimizer``) for this strategy; returns what user code should use.

        ``model`` may have been built by `init_context` (on the meta device, or partitioned by ZeRO-3): only this
        rank's part is then given storage. ``optimizer``: an optimizer, None, or a factory called with the prepared
        parameters (`weights.deferred.optimizer_for`). ``weights``: a `weights.loading.LoadPlan` to fill the model
        from, each rank reading only what it holds."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass of one micro-batch."""

    @abstractmethod
    def step(self) -> bool:
        """End of one micro-batch: step the optimizer at an accumulation boundary. True if it stepped."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass in the run's precision."""
        return contextlib.nullcontext()

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One training step: forward under `autocast`, ``loss_fn(outputs, targets)``, the strategy's backward, and
        the optimizer step at the accumulation boundary. Returns the (detached) loss.

        ``inputs``: a tensor (``model(inputs)``), a tuple (``model(*inputs)``) or a dict (``model(**inputs)``);
        tensors are moved to the run's device. Low-precision outputs reach ``loss_fn`` in fp32."""
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        with self.autocast():
            if isinstance(inputs, dict):
                outputs = self.model(**inputs)
            elif isinstance(inputs, tuple):
                outputs = self.model(*inputs)
            else:
                outputs = self.model(inputs)
        loss = loss_fn(_as_float(outputs), targets)
        self.backward(loss)
        self.step()
        return loss.detach()

    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        raise NotImplementedError(f"--strategy {self.name} does not support checkpoints yet")

    def load_checkpoint(self, directory: str) -> dict | None:
        raise NotImplementedError(f"--strategy {self.name} does not support checkpoints yet")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state dict, gathered on every rank (for shards), for saving on rank 0."""
        model = getattr(self.model, "module", self.model)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def rank0_state_dict(self) -> dict[str, torch.Tensor]:
        """`full_state_dict` on rank 0 only, streamed one tensor at a time (``{}`` on the other ranks)."""
        from ..weights.saving import collect

        return collect(self.stream_full_state())

    def teardown(self) -> None:
        """Release what the strategy holds (engines, hooks) before the process group goes."""


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh); a plain tensor as it is."""
    import torch

    full_tensor = getattr(value, "full_tensor", None)
    if not callable(full_tensor):
        return value
    with torch.no_grad():
        return full_tensor()


def _to_device(value: Any, device: torch.device) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _as_float(output: Any) -> Any:
    """bf16/fp16 outputs of an autocast forward in fp32 for the loss (as ``model(x).float()``); others as they are."""
    import torch

    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != torch.float32:
        return output.float()
    return output


class TorchStrategy(Strategy):
    """Shared by the strategies that use a plain torch optimizer (DDP, FSDP), including their model-parallel
    forms (``--tp``/``--pp``: `dtrain_magic.parallel.ModelParallel`, sharded checkpoints)."""

    _dtypes = {"bf16": "bfloat16", "fp16": "float16"}  # torch's dtype names (torch loads in the worker only)
    sharded_checkpoints: ClassVar[bool] = False  # DCP (every rank its shards) rather than rank 0's torch.save

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.micro_step = 0
        self.scaler = None
        if self.config.precision == "fp16":
            import torch

            self.scaler = torch.amp.GradScaler(self.device.type)
        self.parallel: Any = None
        if self.config.tp > 1 or self.config.pp > 1:
            from ..parallel.model_parallel import ModelParallel

            self.parallel = ModelParallel(self.config, self.rank, self.world_size, self.device, self.name)

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel.dp_rank if self.parallel is not None else self.rank

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.dp_size if self.parallel is not None else self.world_size

    @property
    def pipeline(self) -> Any:
        return self.parallel.pipeline if self.parallel is not None else None

    # -- models bigger than one process ------------------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager:
        """FSDP and ``--tp``/``--pp``: parameters on the meta device (`weights.deferred.parameters_on_meta`); each
        rank gives storage to its own shards or stage only, in `wrap`. Plain DDP: a whole build (every rank holds a
        whole copy to train it anyway), which it says."""
        if self.parallel is not None or self.sharded_checkpoints:
            from ..weights.deferred import parameters_on_meta

            return parameters_on_meta()
        return super().init_context()

    def whole_copy_reason(self) -> str:
        return "DDP keeps a whole copy of the parameters, gradients and optimizer states on every rank"

    def fill_shards(self, model: torch.nn.Module, weights: Any, pristine: torch.nn.Module | None,
                    views: Mapping[str, Any] | None = None) -> None:
        """After sharding: storage for this rank's shards of a model built without it, then their values (the
        checkpoint's regions this rank holds, or the model's own init through ``pristine``)."""
        from ..weights import deferred, loading

        if deferred.has_meta_parameters(model):
            deferred.materialize(model, self.device)
            if weights is None:
                deferred.initialise(model, pristine, views)
        if weights is not None:
            loading.load(model, weights, views)

    def _refuse_under_pipeline(self, call: str) -> None:
        if self.pipeline is not None:
            from ..errors import UnsupportedCodeError
            from ..parallel.pipeline import USE_TRAIN_STEP

            raise UnsupportedCodeError(USE_TRAIN_STEP.format(what=call))

    def _at_boundary(self) -> bool:
        return (self.micro_step + 1) % self.accumulation == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        dtype = self._dtypes.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=getattr(torch, dtype))

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on micro-batches that do not end an accumulation window."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self._refuse_under_pipeline("ctx.backward(loss)")
        loss = loss / self.accumulation
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        context = contextlib.nullcontext() if self._at_boundary() else self.no_sync()
        with context:
            loss.backward()

    def step(self) -> bool:
        self._refuse_under_pipeline("ctx.step()")
        return self._step()

    def _step(self) -> bool:
        stepped = self._at_boundary()
        self.micro_step += 1
        if not stepped or self.optimizer is None:
            return stepped
        if self.parallel is not None:
            self.parallel.finish_gradients(self.accumulation)
        if self.config.clip_grad is not None:
            self._clip_gradients()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _clip_gradients(self) -> None:
        """``--clip-grad``: the global norm over every shard and stage (`clipping`), on the true gradients (fp16's are
        unscaled first: the scaler then skips its own unscale at its step)."""
        from .clipping import clip_grad_norm

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        pp_group = self.pipeline.group if self.pipeline is not None else None  # the stages' norms combined
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # what the step updates
        self.grad_norm = clip_grad_norm(params, self.config.clip_grad, pp_group=pp_group)

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """As `Strategy.train_step`; under ``--pp``, the batch goes through the pipeline schedule in
        ``--microbatches`` micro-batches and the loss returned on every rank is the last stage's."""
        if self.pipeline is None:
            return super().train_step(inputs, targets, loss_fn)
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        with self.autocast():
            loss = self.pipeline.run(inputs, targets, lambda outputs, target: loss_fn(_as_float(outputs), target))
        self._step()
        return loss

    def wrap_model_parallel(
        self, model: torch.nn.Module, optimizer: Any,
        shard_data_parallel: Callable[[torch.nn.Module, Any], None] | None = None, weights: Any = None,
    ) -> tuple[Any, Any]:
        """``--tp``/``--pp``: split ``model`` for this rank (see `ModelParallel.prepare`)."""
        self.report_memory(model)
        model, optimizer = self.parallel.prepare(model, optimizer, self.tp_plan, self.pp_split, shard_data_parallel,
                                                 fill=self.fill_shards, weights=weights)
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def _sharded_module(self) -> torch.nn.Module | None:
        """The module whose (sharded) state DCP saves: this rank's part, named as in the whole model."""
        if self.parallel is not None:
            return self.parallel.module
        return self.model if self.sharded_checkpoints else None

    def _extra_state(self, client_state: dict | None) -> dict:
        extra = {"micro_step": self.micro_step, "client_state": dict(client_state or {})}
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        return extra

    def _restore_extra(self, extra: dict) -> dict | None:
        self.micro_step = extra.get("micro_step", 0)
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        return extra.get("client_state")

    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        """Full (unsharded) model and optimizer state, written by rank 0; sharded (every rank its shards, with
        torch.distributed.checkpoint) for FSDP and under ``--tp``/``--pp``."""
        module = self._sharded_module()
        if module is not None:
            sharded_checkpoint.save(directory, module, self.optimizer, self.rank, self._extra_state(client_state))
            return
        if self.rank == 0:
            import torch

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
        module = self._sharded_module()
        if module is not None:
            extra = sharded_checkpoint.load(directory, module, self.optimizer)
            return None if extra is None else self._restore_extra(extra)
        path = os.path.join(directory, "checkpoint.pt")
        if not os.path.exists(path):
            return None
        import torch

        state = torch.load(path, map_location=self.device, weights_only=False)
        getattr(self.model, "module", self.model).load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.micro_step = state.get("micro_step", 0)
        return state.get("client_state")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state dict on every rank: shards gathered and pipeline stages merged (a
        collective under FSDP and ``--tp``/``--pp``: every rank must call it), in the plain model's layout."""
        if self.parallel is not None:
            return self.parallel.full_state_dict()
        if self.sharded_checkpoints:
            from ..parallel.state import gather_full_state

            return gather_full_state(self.model)
        return super().full_state_dict()

    def stream_full_state(self, include: Callable[[str], bool] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """As `Strategy.stream_full_state`: shards gathered one tensor at a time (every rank holds that one tensor
        for the moment, rank 0 keeps it), pipeline stages sent to rank 0; only what ``include`` accepts is gathered."""
        if self.parallel is not None:
            yield from self.parallel.stream_full_state(include)
        elif self.sharded_checkpoints:
            from ..weights.saving import stream

            yield from stream(self.model.state_dict(keep_vars=True), _whole, self.rank == 0, include)
        else:
            yield from super().stream_full_state(include)

