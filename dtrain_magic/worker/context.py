"""`TrainContext`: the ``ctx`` every worker's training function receives.

It hides what differs between strategies (wrapping, backward, stepping, precision, checkpoints) and
between backends (ranks, devices, where metrics go). Metrics and status go to the notebook over the
run's channel; the notebook writes them to MLflow in the background. ``ctx.log`` only queues its values: the
rank's `pulse.Pulse` thread sends them a few times a second, with the counters the notebook watches for
progress, hangs and throughput (steps, samples and tokens the prepared model saw).
"""

from __future__ import annotations

import contextlib
import os
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ..channel import DataProgress, Message, Metric, ModelFacts, Total
from ..config import RunConfig
from ..errors import log_dropped
from ..strategies.base import Strategy
from ..weights import adapters
from ..weights.deferred import is_factory, refuse_meta_buffers
from ..weights.loading import match
from ..weights.saving import DEFAULT_SHARD_BYTES, collect, write_model_config, write_safetensors
from ..weights.sources import open_weights
from . import flops
from .blocks import prepare_blocks
from .pulse import Pulse
from .resume_point import note_step


class _ShardedLoader(DataLoader):
    """A DataLoader over this rank's shard that advances the sampler's epoch on every pass (like Accelerate)."""

    _epoch = 0

    def __iter__(self):  # type: ignore[override]
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return super().__iter__()


def shard_loader(loader: DataLoader, rank: int, world_size: int, seed: int = 0) -> DataLoader:
    """Rebuild ``loader`` over a DistributedSampler shard, keeping its per-process batch size."""
    if not isinstance(loader, DataLoader) or world_size <= 1:
        return loader
    if isinstance(loader.sampler, DistributedSampler) or loader.batch_size is None:
        return loader  # already sharded by the user, or a custom batch sampler we must not second-guess
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=loader.drop_last
    )
    return _ShardedLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )


RUN_STATE_KEY = "dtrain_magic.run"  # the run's own state in a checkpoint's client_state (`TrainContext._run_state`)
RESUMED_METRIC = "resumed_at_step"  # rank 0's metric on resuming: the optimizer steps the checkpoint holds


def _metric_value(key: Any, value: Any) -> float:
    """A ``ctx.log`` value as a float (a tensor's mean), or a TypeError naming the metric."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().mean().item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"ctx.log: metric {key!r} must be a number, got {type(value).__name__}") from None


class TrainContext:
    """What the training function sees as ``ctx``.

    Attributes: ``rank``, ``local_rank``, ``world_size``, ``is_main`` (rank 0), ``device``, ``config``
    (the run's `RunConfig`), ``strategy`` (the `Strategy` in use).
    """

    def __init__(
        self,
        config: RunConfig,
        strategy: Strategy,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        send: Callable[[Message], None] | None = None,
        checkpoint_store: Any = None,
        pulse: Pulse | None = None,
        data: Sequence[Any] = (),
        params: Mapping[str, Any] | None = None,
        outputs_root: str | None = None,
        lr_scale: float = 1.0,
        preemption: Any = None,
    ):
        self.config = config
        self.strategy = strategy
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self._send = send or (lambda message: None)
        self._log_calls = 0
        self._checkpoints = checkpoint_store
        self._pulse = pulse  # None: each ctx.log is sent at once (a context built outside run_worker)
        self._model_flops: dict[str, float] = {}
        self._parameters = 0
        self._data_sources = tuple(data)  # `dtrain_magic.data.blocks.StagedSource`s: what --data gave this run
        self._data_positions: Any = None  # `dtrain_magic.data.reader.DataPositions`, once ctx.data made a reader
        self._params = MappingProxyType(dict(params or {}))
        self._steps = 0  # ctx.step() calls over the run (restored by load_checkpoint): the preemption checkpoint's step
        self._optimizer_steps = 0  # optimizer steps over the run, whatever the accumulation of each attempt (--elastic)
        self._last_state: dict[str, Any] = {}  # the client_state of the last save: the preemption checkpoint keeps it
        self._lr_scale = lr_scale  # --elastic: the learning-rate factor of this world size (`elastic.Resize`)
        self._preemption = preemption  # `preempt.PreemptionNotice`, or None
        self._outputs_root = outputs_root  # where ctx.write's parts go (`dtrain_magic.data.outputs.outputs_root`)
        self._outputs_base = outputs_root  # the run's; a session's cells each write below it (`begin_outputs`)
        self._writer: Any = None  # `dtrain_magic.data.outputs.OutputWriter`, made by the first ctx.write
        self._peft_twin: Any = None  # a prepared peft model's modules on meta, for full_state_dict(merged=True)

    @property
    def params(self) -> Mapping[str, Any]:
        """This run's hyperparameters, read-only: a sweep trial's values (``ctx.params["lr"]``), the same on every
        rank; empty outside a sweep."""
        return self._params

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: ``world_size`` without ``--tp``/``--pp``, else ``world_size / (tp x pp)``. A function
        that sizes its per-process batch as ``global_batch // ctx.data_parallel_size`` keeps the global batch
        under every strategy."""
        return self.strategy.data_parallel_size

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps the run has made so far (``ctx.step()`` calls that stepped), over every attempt:
        `load_checkpoint` restores it, whatever each attempt's accumulation (``--elastic``), also from a checkpoint
        a preemption notice wrote. A loop that counts optimizer steps resumes at ``ctx.optimizer_steps``."""
        return self._optimizer_steps

    @property
    def data_parallel_rank(self) -> int:
        """This process's model replica (0 .. data_parallel_size - 1); its loaders' shard."""
        return self.strategy.data_parallel_rank

    # -- model, optimizer, data ------------------------------------------------------------------
    def init_model(self) -> contextlib.AbstractContextManager:
        """Build the model inside this to never hold it whole: ``with ctx.init_model(): model = Net()``.

        Under FSDP and ``--tp``/``--pp`` its parameters are created on torch's meta device (no storage; buffers stay
        real) and `prepare` gives each rank storage for its own shards or stage only, filled from ``weights=`` or by
        the model's own init (``reset_parameters``) one module at a time; under ZeRO-3 it is
        ``deepspeed.zero.Init`` (each module partitioned as it is built). Under DDP and ZeRO 0-2, which keep a whole
        copy on every rank, it builds the model whole (and says so).
        """
        return self.strategy.init_context()

    def prepare(self, model: torch.nn.Module | Callable[[], torch.nn.Module], optimizer: Any = None,
                *loaders: DataLoader, tp_plan: Mapping[str, Any] | None = None,
                pp_split: Sequence[str | int] | None = None, weights: str | os.PathLike | None = None,
                sample: Any = None):
        """Wrap model and optimizer for the strategy, move them to ``device``, shard each loader.

        Returns ``(model, optimizer, *loaders)``, or ``(model, optimizer)`` without loaders. Loaders are sharded
        over the model replicas: with ``--tp``/``--pp`` the ranks holding parts of one replica get the same batches.
        ``tp_plan`` (with ``--tp``): ``{"module.name": ColwiseParallel(), ...}`` as ``parallelize_module`` takes
        (default: an automatic plan). ``pp_split`` (with ``--pp``): the parts where stages 2, 3, ... begin
        (default: balanced by parameter count). Both are ignored without their flag.

        ``model`` may be a factory (``lambda: Net()``): it is then built inside `init_model`, so no rank holds the
        whole model under FSDP, ZeRO-3, ``--tp`` or ``--pp``; the optimizer is then a factory too, called with the
        prepared parameters (``lambda params: torch.optim.Adam(params, lr=1e-3)``). ``weights``: a local checkpoint
        to start from (safetensors file or directory, a Hugging Face model directory, a torch state-dict file, or a
        checkpoint of this run's), each rank reading only the slices it holds; its names and shapes are checked
        against the model first (`WeightsError` listing every mismatch, before anything is read or trained).

        ``--ac`` and ``--compile`` are applied here, to each block, before the strategy shards the model
        (`dtrain_magic.worker.blocks`: activation checkpointing, then torch.compile, then sharding).

        ``sample``: one micro-batch as the model takes it (a tensor, a tuple or a dict, as `train_step`'s ``inputs``):
        its activations, measured on the meta device under every ``--ac`` mode (`dtrain_magic.worker.activations`),
        join the memory estimate rank 0 prints, with the knobs that would make it fit when it does not.
        A peft model (``peft.get_peft_model(model, LoraConfig(...))``) trains only its adapters under every strategy:
        its frozen base weights are sharded like the rest but get no gradients and no optimizer state (an optimizer
        factory is given the trainable parameters only). Save the adapters with ``save_weights(dir,
        adapters_only=True)``; ``full_state_dict(merged=True)`` merges them into the base weights (docs/big-models.md).
        """
        if is_factory(model):
            if isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "ctx.prepare(factory, optimizer): the model does not exist before ctx.prepare builds it, so give "
                    "the optimizer as a factory too: lambda params: torch.optim.Adam(params, lr=...)")
            with self.init_model():
                built = model()
            if not isinstance(built, torch.nn.Module):
                raise TypeError(f"ctx.prepare: the model factory returned {type(built).__name__}, not a "
                                "torch.nn.Module")
            model = built
        refuse_meta_buffers(model)
        self._peft_twin = None
        if adapters.is_peft_model(model):
            adapters.refuse_deferred(model)
            self._peft_twin = adapters.meta_twin(model)
        plan = None
        if weights is not None:
            plan = match(model, open_weights(weights))  # on every rank alike, before any collective
        self.strategy.set_loaders(loaders)
        self.strategy.set_model_parallel_options(tp_plan=tp_plan, pp_split=pp_split)
        self._parameters = flops.count_parameters(model)
        if sample is not None and self.is_main:  # before --ac changes the blocks' forward; only rank 0 prints it
            from .activations import measure

            self.strategy.activations = measure(model, sample, self.config.ac_module)
        # --ac, then --compile, on each block, then the strategy shards (wrap): the one order that works (blocks.py)
        prepare_blocks(model, self.config.ac, self.config.ac_module, self.config.compile, announce=self._announce)
        # Without weights= the two-argument call: a strategy written before weights= (wrap(model, optimizer)) works.
        model, optimizer = (self.strategy.wrap(model, optimizer) if plan is None
                            else self.strategy.wrap(model, optimizer, plan))
        self._watch_batches(model)
        self._send_model_facts()
        seed = self.config.seed or 0
        sharded = [shard_loader(loader, self.data_parallel_rank, self.data_parallel_size, seed) for loader in loaders]
        return (model, optimizer, *sharded)

    def data(self, name: str, batch_size: int, *, shuffle: bool = False, columns: Sequence[str] | None = None,
             collate_fn: Callable[[dict], Any] | None = None, drop_last: bool = False, device: Any = None,
             shuffle_window: int | None = None, with_ids: bool | str = False, pad: bool = True) -> Any:
        """This rank's batches of the data source ``--data NAME=...`` (docs/data.md): iterate it once per epoch
        (``loader.set_epoch(epoch)`` first: the order, reshuffled per epoch with ``shuffle``, depends only on
        ``--seed`` and the epoch); ``len(loader)`` batches per epoch, the same on every rank. Each batch is a dict of
        tensors (one per column, or ``columns``), on ``device`` (default ``ctx.device``), or what
        ``collate_fn(batch)`` makes of it. Each epoch the data-parallel ranks read every row once between them
        (ranks of one model replica under ``--tp``/``--pp`` read the same batches); ``drop_last=False`` pads the
        last rank's share with fewer than ``ranks`` rows read twice, ``drop_last=True`` leaves out fewer than
        ``ranks x batch_size``. ``shuffle_window``: rows shuffled together (default about 64 MB of them).
        ``ctx.save_checkpoint`` records where the loader is; ``ctx.load_checkpoint`` resumes it there.
        ``with_ids=True`` adds each row's id, its position in the source (int64, the same on every run), as
        ``batch["row_id"]`` (a string: under that key), so what `write` writes of a batch joins back to the input.
        ``pad=False`` (scoring): the rows ``drop_last=False`` reads twice to even the ranks out are left out, so every
        row is read exactly once; a rank whose rows ran out gets empty batches (still ``len(loader)`` of them)."""
        from ..data.reader import DataPositions, ProgressSender, open_batches

        if self._data_positions is None:
            self._data_positions = DataPositions()
        progress = ProgressSender(lambda *args: self._send(DataProgress(self.rank, *args)), name) \
            if self.is_main else None
        reader = open_batches(
            self._data_sources, name, self.data_parallel_rank, self.data_parallel_size, batch_size=batch_size,
            shuffle=shuffle, seed=self.config.seed or 0, drop_last=drop_last, columns=columns, collate_fn=collate_fn,
            device=self.device if device is None else torch.device(device), shuffle_window=shuffle_window,
            progress=progress, with_ids=with_ids, pad=pad)
        return self._data_positions.add(name, reader)

    def write(self, name: str, batch: Mapping[str, Any]) -> None:
        """Append ``batch``'s rows to the run's output ``name`` (docs/data.md, the way back): a dict of column ->
        tensor, numpy array or list, one row per element along dim 0; every write of ``name`` has the same columns
        and types. Each rank writes its own Parquet parts; the driver commits them once every rank returned
        (``result.outputs[name]``, ``--output name=VARIABLE``): a failed or interrupted run leaves no output, a
        restarted one only its last attempt's rows. Under ``--tp``/``--pp`` call it on every rank: only the one
        rank of each model replica that holds its output (the first tensor-parallel shard of the last pipeline
        stage) writes."""
        if self._writer is None:
            from ..data.outputs import OutputWriter

            if self._outputs_root is None:
                raise RuntimeError(f"ctx.write({name!r}): this context has no output location (it was not built "
                                   "by a run)")
            self._writer = OutputWriter(self._outputs_root, self.rank, self._writes_outputs())
        self._writer.write(name, batch)

    def _writes_outputs(self) -> bool:
        """Whether this rank writes its replica's rows: the first shard (tp) of the last stage (pp)."""
        if self.config.tp * self.config.pp == 1:
            return True
        from ..parallel.mesh import ParallelDims

        coords = ParallelDims(self.world_size, self.config.tp, self.config.pp).coordinates(self.rank)
        return coords["tp"] == 0 and coords["pp"] == self.config.pp - 1

    def begin_outputs(self, folder: str) -> None:
        """A session's cell: its ``ctx.write`` parts go to their own ``folder`` below the run's outputs, committed at
        the cell's end (`seal_outputs`)."""
        if self._outputs_base is not None:
            from ..data.outputs import join

            self._outputs_root = join(self._outputs_base, folder)
        self._writer = None

    def seal_outputs(self, why: str = "the run has ended") -> str:
        """Close what `write` wrote (the function returned) and refuse later writes; the manifest for the driver
        (``""``: nothing written)."""
        if self._writer is None:
            from ..data.outputs import OutputWriter

            self._writer = OutputWriter(self._outputs_root or "", self.rank, False)
        return self._writer.seal(why)

    def abort_outputs(self, why: str = "the run has ended") -> None:
        """The function failed: close what `write` opened; nothing of it is committed."""
        if self._writer is not None:
            self._writer.abort(why)

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward (under `autocast`), ``loss_fn(outputs, targets)``, backward, and the optimizer step at the
        ``--grad-accum`` boundary, for any strategy; returns the loss (detached).

        ``inputs``: a tensor (``model(inputs)``), a tuple of positional arguments, or a dict of keyword arguments.
        Under ``--pp`` this is the only way to train (the batch runs through the pipeline schedule in
        ``--microbatches`` micro-batches) and the loss, the mean over micro-batches, is returned on every rank.
        """
        if self._pulse is not None:
            if self.config.pp > 1:  # the pipeline's stages call the model themselves: count the batch here
                self._pulse.batch(*flops.batch_size_and_tokens(inputs if isinstance(inputs, tuple) else (inputs,),
                                                               inputs if isinstance(inputs, dict) else {}))
            self._pulse.step()
        loss = self.strategy.train_step(inputs, targets, loss_fn)
        micro = getattr(self.strategy, "micro_step", None)  # DeepSpeed keeps its own: every call counts
        self._after_step(micro is None or micro % self.strategy.accumulation == 0)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass through the strategy (loss scaling, accumulation, DeepSpeed's engine). Not under ``--pp``:
        use `train_step`."""
        if self._pulse is not None:
            self._pulse.calls += 1
        self.strategy.backward(loss)

    def step(self) -> bool:
        """Optimizer step and zero_grad at each ``--grad-accum`` boundary. True if the optimizer stepped. Not under
        ``--pp`` (`train_step` steps).

        After a preemption notice (``--preempt-grace``: a SIGTERM to any rank on local and Spark, Ray draining a node
        of the run on Ray), the step boundary
        the ranks agree on writes a checkpoint (the last ``save_checkpoint``'s ``client_state``, ``step`` set to this
        call's index over the run) and raises `dtrain_magic.worker.preempt.Preempted`: the run restarts from there.

        When the notebook asked every rank to stop after this step (a pruned sweep trial, docs/sweeps.md), it
        raises `dtrain_magic.errors.StopAtStep` after the optimizer step: the run ends cleanly on every rank at the
        same step (``finally`` blocks run; ``except Exception`` does not catch it)."""
        if self._pulse is not None:
            self._pulse.step()
        stepped = self.strategy.step()
        self._after_step(stepped)
        return stepped

    def _after_step(self, stepped: bool) -> None:
        """Count the step; at an optimizer step boundary, act on a preemption notice every rank agreed on; then stop
        if this is the step the notebook asked every rank to stop after (raises `StopAtStep`)."""
        self._steps += 1
        self._optimizer_steps += int(stepped)
        if stepped and self._preemption is not None and self._preemption.agreed():
            from .preempt import Preempted

            self.save_checkpoint(**{**self._last_state, "step": self._steps - 1})
            self._preemption.close()
            raise Preempted(f"preempted ({self._preemption.source}): every rank checkpointed after step "
                            f"{self._steps - 1} "
                            f"(ctx.step() call {self._steps} of the run); the run continues from it when restarted")
        if self._pulse is not None:
            self._pulse.check_stop()

    @property
    def grad_norm(self) -> float | None:
        """With ``--clip-grad``: the global gradient norm of the last optimizer step, before clipping, over every
        shard, stage and rank (the norm one process training the plain model on the global batch would see), the
        same on every rank; log it with ``ctx.log(grad_norm=ctx.grad_norm)``. None before the first step and
        without ``--clip-grad``."""
        return self.strategy.grad_norm

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context manager for the forward pass in the run's ``--precision``."""
        return self.strategy.autocast()

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    # -- metrics and progress --------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any] | None = None, step: int | None = None, **more: Any) -> None:
        """Log metrics from rank 0 to the run (``ctx.log(loss=l)`` or ``ctx.log({"loss": l}, step=n)``).

        Without ``step``, each call is the next step (0, 1, 2, ...). Tensors are turned into floats.
        Other ranks' calls are ignored (MLflow records what rank 0 logs). The values travel to the notebook a
        few times a second; a loop logging the same metrics more than 10 times a second keeps every value for the
        first 200, then 10 a second (the last one always; ``$DTRAIN_MAGIC_METRIC_RATE``).
        A ``tokens`` value (the tokens this rank went through since its last ``ctx.log``) gives the run's tokens/s
        and, with the model's parameters, model FLOP/s and MFU (docs/ui.md#throughput-and-stragglers).
        """
        values = dict(metrics, **more) if metrics else more  # ``more`` is this call's own dict
        if step is None:
            step = self._log_calls
        self._log_calls += 1
        if not self.is_main:
            if self._pulse is not None:
                tokens = values.get("tokens")
                self._pulse.log_call(float(tokens) if isinstance(tokens, (int, float, torch.Tensor)) else None)
                if not self._pulse.steps:  # a loop that never calls ctx.step stops at a ctx.log count
                    self._pulse.check_stop()
            return
        # A loop may call this thousands of times a second: str keys and float values are taken as they are
        for key, value in values.items():
            if type(value) is not float or type(key) is not str:
                values = {str(key): _metric_value(key, value) for key, value in values.items()}
                break
        if self._pulse is None:
            self._send(Metric(self.rank, int(step), values, int(time.time() * 1000)))
            return
        self._pulse.record(int(step), values)
        if not self._pulse.steps:
            self._pulse.check_stop()

    def flush_metrics(self) -> None:
        """Send the ``ctx.log`` values gathered so far now, rather than with the next batch (a session's cell calls
        it before it ends; a loop may before a long pause)."""
        if self._pulse is not None:
            self._pulse.flush_metrics()

    def set_model_flops(self, per_sample: float | None = None, per_token: float | None = None) -> None:
        """The model's training FLOPs (forward and backward) per sample or per token, for model FLOP/s and MFU in
        the monitor and MLflow. Without it, token inputs use 6 x parameters per token (a decoder's estimate)."""
        if per_sample is not None:
            self._model_flops["per_sample"] = float(per_sample)
        if per_token is not None:
            self._model_flops["per_token"] = float(per_token)
        self._send_model_facts()

    def _announce(self, line: str) -> None:
        """A line for the cell, from rank 0 only (what ctx.prepare did to the model)."""
        if self.is_main:
            print(f"dtrain_magic: {line}", flush=True)

    def _send_model_facts(self) -> None:
        if not self.is_main or self._pulse is None:
            return
        name, peak, note = flops.peak_flops(self.device, self.config.precision)
        per_token = self._model_flops.get("per_token", flops.DECODER_FLOPS_PER_PARAMETER_TOKEN * self._parameters)
        self._pulse.facts(ModelFacts(self.rank, self._parameters, self._model_flops.get("per_sample", 0.0),
                                     per_token, name, peak, note))

    def _watch_batches(self, model: Any) -> None:
        """Count the samples (and token ids) each training forward of the prepared model takes: samples/s."""
        pulse = self._pulse
        if pulse is None or not isinstance(model, torch.nn.Module) or self.config.pp > 1:
            return

        def count(_module: Any, args: tuple, kwargs: dict) -> None:
            if torch.is_grad_enabled():
                try:
                    pulse.batch(*flops.batch_size_and_tokens(args, kwargs))
                except Exception as exc:  # counting must never break a forward
                    log_dropped(__name__, "count", exc)

        model.register_forward_pre_hook(count, with_kwargs=True)

    def set_total(self, steps: int) -> None:
        """Declare how many steps the run will take, for the progress bar and its ETA."""
        if self.is_main:
            self._send(Total(self.rank, int(steps)))

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, directory: str | None = None, **client_state: Any) -> None:
        """Save model, optimizer and ``client_state`` through the strategy (every rank must call it), with each rank's
        random generators, each ``ctx.data`` loader's position and the run's step count; without ``directory`` into
        the run's next numbered checkpoint, complete only once every rank wrote its part (docs/reliability.md)."""
        self._require_prepared("save_checkpoint")
        from .checkpoints import count_save, save_rng

        count_save()

        directory = self._checkpoint_dir(directory)
        self._last_state = {k: v for k, v in client_state.items() if k != "step"}
        if self._data_positions is not None:  # where each ctx.data loader is, to resume there
            client_state = self._data_positions.client_state(client_state)
        client_state = {**client_state, RUN_STATE_KEY: self._run_state()}
        self.strategy.save_checkpoint(directory, client_state)
        note_step(directory, client_state, self.is_main)  # the step a restart or --resume names in the cell
        save_rng(directory, self.rank)  # before the barrier: complete means every rank's generators are in
        self.barrier()
        if self._checkpoints is not None:
            self._checkpoints.saved(directory)

    def load_checkpoint(self, directory: str | None = None) -> dict | None:
        """Restore the latest checkpoint into the prepared model/optimizer; returns its ``client_state``
        (None when there is no checkpoint yet, so a fresh run starts from scratch). Restores this rank's random
        generators and the ``ctx.data`` positions too; on another world size (``--elastic``) the loaders re-split from
        the saved sample position and the learning rate follows the resize's factor."""
        if directory is None and self._checkpoints is not None:
            directory = self._checkpoints.latest()
        if directory is None or not os.path.isdir(directory):
            return None
        self._require_prepared("load_checkpoint")
        from .checkpoints import load_rng

        client_state = self.strategy.load_checkpoint(directory)
        load_rng(directory, self.rank)
        if client_state and RUN_STATE_KEY in client_state:
            client_state = dict(client_state)
            self._restore_run_state(client_state.pop(RUN_STATE_KEY))
        if client_state and "dtrain_magic.data" in client_state:  # ctx.data loaders resume where they were saved
            from ..data.reader import DataPositions

            if self._data_positions is None:
                self._data_positions = DataPositions()
            client_state = self._data_positions.restore(client_state)
        return client_state

    def _run_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run itself: steps, the world and accumulation, the learning-rate factor."""
        return {"steps": self._steps, "world": self.data_parallel_size, "grad_accum": self.strategy.accumulation,
                "micro_step": getattr(self.strategy, "micro_step", 0), "lr_scale": self._lr_scale,
                "optimizer_steps": self._optimizer_steps}

    def _restore_run_state(self, saved: Mapping[str, Any]) -> None:
        """Resume the step count; on another world size (``--elastic``) keep the optimizer steps' count under the
        new accumulation and move the learning rate from the saved factor to this world's."""
        self._steps = int(saved.get("steps", 0))
        accum, old_accum = self.strategy.accumulation, int(saved.get("grad_accum", 1))
        self._optimizer_steps = int(saved.get("optimizer_steps", self._steps // old_accum))  # older checkpoints
        if accum != old_accum and hasattr(self.strategy, "micro_step"):
            self.strategy.micro_step = (int(saved.get("micro_step", 0)) // old_accum) * accum
        ratio = self._lr_scale / float(saved.get("lr_scale", 1.0))
        optimizer = getattr(self.strategy, "optimizer", None)
        if ratio != 1.0 and optimizer is not None:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * ratio
        if self.is_main:  # at the optimizer step resumed from; the notebook counts the steps a restart lost from it
            facts = {RESUMED_METRIC: float(self._optimizer_steps), "world_size": float(self.data_parallel_size),
                     "grad_accum": float(accum), "lr_scale": float(self._lr_scale)}
            self._send(Metric(self.rank, self._optimizer_steps, facts, int(time.time() * 1000)))

    def full_state_dict(self, rank0_only: bool = False, merged: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's full-precision state dict (ZeRO-3/FSDP/tensor-parallel shards gathered, pipeline
        stages merged), loadable into the plain model; every rank must call it (it is a collective), save it on
        rank 0.

        Memory: the whole model in fp32 on the CPU of **every** rank, besides what training holds. With
        ``rank0_only=True`` it is assembled on rank 0 alone, one tensor at a time (each gathered, kept by rank 0,
        dropped by the others, who hold one tensor at most) and the other ranks get ``{}``. To write it to disk
        without holding it even on rank 0, use `save_weights`.

        ``merged=True`` (a peft model): the base model's state dict with the adapters merged into its weights (peft's
        ``merge_and_unload``), in the plain base model's names, loadable into it without peft.
        """
        if merged and self._peft_twin is None:  # on every rank alike, before any gather
            adapters.require_peft_model(self._plain_model(), "ctx.full_state_dict(merged=True)")
        state = self.strategy.rank0_state_dict() if rank0_only else self.strategy.full_state_dict()
        return adapters.merged(self._peft_twin, state) if merged and state else state

    def save_weights(self, directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     adapters_only: bool = False) -> list[str]:
        """Write the whole model's fp32 weights as safetensors under ``directory``, as Hugging Face does
        (``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` and
        ``model.safetensors.index.json``); every rank must call it. Rank 0 writes, holding at most one shard: each
        tensor is gathered in turn (the other ranks hold one tensor at a time). The files load into the plain model
        (``safetensors.torch.load_file``, ``load_state_dict``), a Hugging Face model (``from_pretrained``: rank 0 writes
        the model's ``config.json`` beside them) and ``ctx.prepare(..., weights=directory)`` under any strategy.
        Returns the files written (rank 0; ``[]`` elsewhere).

        ``adapters_only=True`` (a peft model): its trainable tensors, the adapters, gathered whole from every rank's
        shards and written by rank 0 with peft's own ``save_pretrained`` (``adapter_config.json``,
        ``adapter_model.safetensors``): ``PeftModel.from_pretrained(base_model, directory)`` loads them."""
        self._require_prepared("save_weights")
        if adapters_only:
            return self._save_adapters(os.fspath(directory))
        files = write_safetensors(os.fspath(directory), self.strategy.stream_full_state(), self.is_main,
                                  max_shard_bytes)
        if self.is_main:
            files += write_model_config(os.fspath(directory), self._plain_model())
        self.barrier()
        return files

    def _save_adapters(self, directory: str) -> list[str]:
        """`save_weights(adapters_only=True)`: only the trainable tensors gathered (on every rank), peft writes."""
        model = adapters.require_peft_model(self._plain_model(), "ctx.save_weights(adapters_only=True)")
        names = adapters.trainable_names(model)
        state = collect(self.strategy.stream_full_state(include=names.__contains__))
        files = adapters.save_adapters(directory, model, state) if self.is_main else []
        self.barrier()
        return files

    def _plain_model(self) -> Any:
        """The user's model inside the strategy's wrapper (DDP's and DeepSpeed's ``.module``; FSDP2 shards in place)."""
        return getattr(self.strategy.model, "module", self.strategy.model)

    def _require_prepared(self, method: str) -> None:
        if self.strategy.model is None:
            raise RuntimeError(
                f"ctx.{method}() saves and restores the prepared model: call ctx.prepare(model, optimizer) first"
            )

    def _checkpoint_dir(self, directory: str | None) -> str:
        if directory is not None:
            return directory
        if self._checkpoints is not None:
            return self._checkpoints.next_dir()
        raise ValueError("ctx.save_checkpoint: give a directory")

    def __repr__(self) -> str:
        return (
            f"TrainContext(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"strategy={self.strategy.name}, precision={self.config.precision})"
        )

