"""``--strategy deepspeed --zero {0,1,2,3}``: DeepSpeed's engine with a config the magic builds.

The flags map onto DeepSpeed's config keys (see docs/strategies.md)::

    --zero S                   zero_optimization.stage = S
    --precision fp16 / bf16    fp16.enabled / bf16.enabled
    --grad-accum G             gradient_accumulation_steps = G
    --micro-batch M            train_micro_batch_size_per_gpu = M (else the first loader's batch size)
    --train-batch T            train_batch_size = T (= M x G x world size, checked before launch)

``--deepspeed-config`` (JSON text or a path to a JSON file) is merged on top; a key that disagrees with
a flag is a `ConfigError` before anything launches. ``gradient_clipping`` is 0.0 unless the user's config
sets it (DeepSpeed clips at 1.0 by default, which DDP and FSDP do not). The user's torch optimizer is
passed to ``deepspeed.initialize`` as the client optimizer (a config ``optimizer`` section would make
DeepSpeed JIT-compile FusedAdam, ~40 s on CPU).

``import deepspeed`` happens only inside the worker (in `wrap`), never when the notebook imports this
module; ``DS_ACCELERATOR=cpu`` is set before it when the run is not on GPUs.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
import re
import sys
import warnings
from types import MappingProxyType
from typing import Any

import torch

from .._compat import deepspeed as deepspeed_compat
from ..config import RunConfig, check_batch_arithmetic
from ..errors import ConfigError, MissingDependencyError
from .base import Strategy
from .extensions import load_deepspeed_cpu_ops, use_private_extensions_dir
from .memory import ADAM_MIXED_K, MemoryModel

# "DeepSpeed deepspeed_shm_comm built successfully": printed by DeepSpeed's comm start whether it compiled or loaded
_OP_LOADED = re.compile(r"^DeepSpeed \S+ built successfully$")

_FLAG_KEYS = (
    "zero_optimization.stage", "fp16.enabled", "bf16.enabled", "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu", "train_batch_size",
)


def parse_user_config(text: str | None) -> dict:
    """``--deepspeed-config``: JSON text (starting with ``{``) or the path of a JSON file."""
    if text is None:
        return {}
    stripped = text.strip()
    if stripped.startswith("{"):
        source = "the JSON text"
        raw = stripped
    else:
        path = os.path.expanduser(stripped)
        if not os.path.isfile(path):
            raise ConfigError("--deepspeed-config", f"{text!r} is neither JSON text nor an existing file")
        source = path
        with open(path, encoding="utf-8") as handle:
            raw = handle.read()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError("--deepspeed-config", f"{source} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--deepspeed-config", f"{source} must be a JSON object, got {type(value).__name__}")
    return value


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_config(config: RunConfig, world_size: int | None = None, loader_batch: int | None = None) -> dict:
    """The DeepSpeed config for ``config``: the flags' keys, then ``--deepspeed-config`` merged on top.

    Raises `ConfigError` when the user's config contradicts a flag or the batch arithmetic does not hold.
    """
    world = world_size or config.num_processes
    user = parse_user_config(config.deepspeed_config)
    accum = config.grad_accum

    # conflicts between the flags and the user's config
    conflicts = []
    stage = _get(user, "zero_optimization.stage")
    if stage is not None and config.zero is not None and stage != config.zero:
        conflicts.append(f"zero_optimization.stage is {stage} but --zero {config.zero}")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ConfigError("--deepspeed-config", f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for name in ("fp16", "bf16"):
        enabled = _get(user, f"{name}.enabled")
        if enabled is None or enabled == "auto":
            continue
        if bool(enabled) != (config.precision == name):
            conflicts.append(f"{name}.enabled is {json.dumps(enabled)} but --precision {config.precision}")
    user_accum = user.get("gradient_accumulation_steps")
    if user_accum not in (None, "auto") and user_accum != accum:
        conflicts.append(f"gradient_accumulation_steps is {user_accum} but --grad-accum {accum}")
    user_micro = user.get("train_micro_batch_size_per_gpu")
    if user_micro in ("auto",):
        user_micro = None
    if user_micro is not None and config.micro_batch is not None and user_micro != config.micro_batch:
        conflicts.append(f"train_micro_batch_size_per_gpu is {user_micro} but --micro-batch {config.micro_batch}")
    user_train = user.get("train_batch_size")
    if user_train in ("auto",):
        user_train = None
    if user_train is not None and config.train_batch is not None and user_train != config.train_batch:
        conflicts.append(f"train_batch_size is {user_train} but --train-batch {config.train_batch}")
    if conflicts:
        raise ConfigError(
            "--deepspeed-config",
            "conflicts with the flags: " + "; ".join(conflicts)
            + ". Remove the key from the DeepSpeed config or change the flag so they agree",
        )

    # batch sizes: flags, then the user's config, then the loader's batch size
    micro = config.micro_batch or user_micro
    train = config.train_batch or user_train
    if micro is None and train is not None:
        if train % (accum * world):
            raise ConfigError(
                "--train-batch",
                f"train_batch_size {train} is not divisible by gradient_accumulation_steps {accum} x world_size "
                f"{world} (= {accum * world}); pick a multiple of {accum * world} or give --micro-batch",
            )
        micro = train // (accum * world)
    if micro is None:
        micro = loader_batch or 1
    if train is None:
        train = micro * accum * world
    check_batch_arithmetic(train, micro, accum, world)
    if loader_batch is not None and loader_batch != micro:
        raise ConfigError(
            "--micro-batch",
            f"the DataLoader given to ctx.prepare has batch_size {loader_batch} but train_micro_batch_size_per_gpu "
            f"is {micro}; make them equal (each process's loader yields one micro batch)",
        )

    built: dict[str, Any] = {
        "train_batch_size": train,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": config.zero if config.zero is not None else (stage or 0)},
        "fp16": {"enabled": config.precision == "fp16"},
        "bf16": {"enabled": config.precision == "bf16"},
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if config.precision == "fp16":
        built["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if built["zero_optimization"]["stage"] > 0:
        # the magic passes plain torch optimizers; DeepSpeed only "tests" its own under ZeRO
        built["zero_allow_untested_optimizer"] = True
    merged = _merge(built, user)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        merged[key] = built[key]  # "auto" and agreeing values resolve to the checked numbers
    return merged


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    own_fields = ("zero", "deepspeed_config")
    panel_defaults = MappingProxyType({"zero": 0})
    model_parallel_refusal = (
        "DeepSpeed's own tensor/pipeline engines need models written for them. Use --strategy fsdp with it (FSDP "
        "over the data-parallel ranks, ZeRO-3-like) or --strategy ddp"
    )

    @classmethod
    def memory_model(cls, zero: int | None, precision: str) -> MemoryModel:
        """ZeRO's sharding by stage; mixed precision stores 2-byte parameters and gradients beside an fp32 master
        copy (K = 12), and from stage 1 DeepSpeed keeps that fp32 copy of its partition even in fp32."""
        stage = 0 if zero is None else int(zero)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
        if precision != "fp32":
            return MemoryModel(stage, param_bytes=2, grad_bytes=2, optimizer_bytes=ADAM_MIXED_K)
        if stage >= 1:
            return MemoryModel(stage, optimizer_bytes=ADAM_MIXED_K)
        return MemoryModel(stage)

    @classmethod
    def label(cls, zero: int | None = None) -> str:
        return f"deepspeed ZeRO-{zero or 0}"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not self.config.use_gpu:
            os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported in this process
            use_private_extensions_dir()  # its CPU op is built once per environment, not per machine
        elif os.environ.get("DS_ACCELERATOR") == "cpu":
            os.environ["DS_ACCELERATOR"] = "cuda"  # a CPU setting inherited from the notebook (tests set it)
        # DeepSpeed 0.19 calls collectives torch 2.13 deprecated; one warning per call floods the cell
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+ is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        self.engine: Any = None
        self.ds_config: dict | None = None
        self._hooks: list = []

    @classmethod
    def check(cls, config: RunConfig) -> None:
        try:
            installed = importlib.util.find_spec("deepspeed") is not None  # without paying its 3 s import
        except (ImportError, ValueError):
            installed = False
        if not installed:
            raise MissingDependencyError(
                "--strategy deepspeed needs DeepSpeed, which is not installed: pip install deepspeed "
                "(or pip install 'dtrain_magic[deepspeed]'); nothing was launched"
            )
        user = parse_user_config(config.deepspeed_config)
        if "optimizer" in user:
            raise ConfigError(
                "--deepspeed-config",
                "has an 'optimizer' section; the magic passes the optimizer your function gives to ctx.prepare "
                "(DeepSpeed would JIT-compile its own). Remove 'optimizer' from the DeepSpeed config",
            )
        build_config(config, config.num_processes)

    # -- wrapping --------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        import deepspeed

        self._release_engine()
        self.report_memory(model)
        loader_batch = None
        for loader in self.loaders:
            loader_batch = getattr(loader, "batch_size", None)
            if loader_batch:
                break
        self.ds_config = build_config(self.config, self.world_size, loader_batch)
        if optimizer is None:
            raise ValueError("--strategy deepspeed needs an optimizer: ctx.prepare(model, optimizer, ...)")
        if not self.config.use_gpu:
            load_deepspeed_cpu_ops()  # what initialize would JIT-build, under a lock that cannot go stale
        with dropping_lines(_OP_LOADED):  # DeepSpeed prints it on every start, even for the op built at set-up
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=copy.deepcopy(self.ds_config), dist_init_required=False
            )
        self.engine = engine
        self.model = engine
        self.optimizer = ds_optimizer
        if self.config.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
            self._hooks.append(engine.module.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))
        return engine, ds_optimizer

    # -- training --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self) -> bool:
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        self.engine.step()  # steps the optimizer and zeroes grads only at the boundary
        return boundary

    def autocast(self) -> contextlib.AbstractContextManager:
        """DeepSpeed holds bf16/fp16 weights itself; autocast keeps mixed-dtype user code (fp32 losses) working."""
        if self.config.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        if self.config.precision == "fp16":
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, directory: str, client_state: dict | None = None) -> None:
        """DeepSpeed's own (sharded) checkpoint: every rank writes its partition under ``directory``."""
        self.engine.save_checkpoint(directory, client_state={"dtrain_client_state": dict(client_state or {})})

    def load_checkpoint(self, directory: str) -> dict | None:
        if not os.path.exists(os.path.join(directory, "latest")):
            return None
        path, client = self.engine.load_checkpoint(directory)
        if path is None:
            return None
        return (client or {}).get("dtrain_client_state", {})

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights of the whole model on every rank: ZeRO partitions and ZeRO-3 shards are gathered
        from the optimizer's fp32 master copy (a collective: every rank must call it)."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.engine.module
        out: dict[str, torch.Tensor] = {}
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, value in module.state_dict(keep_vars=True).items():
            param = params.get(name)
            if param is not None:
                full = safe_get_full_fp32_param(param)
                if full is None:
                    if deepspeed_compat.is_partitioned(param):  # ZeRO-3 param without an fp32 master (no optimizer)
                        from deepspeed import zero

                        with zero.GatheredParameters([param]):
                            full = param.detach().clone()
                    else:
                        full = param.detach()
                out[name] = full.detach().float().cpu().clone()
            else:
                out[name] = value.detach().cpu().clone()
        return out

    def teardown(self) -> None:
        self._release_engine()

    def _release_engine(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.destroy()
            finally:
                self.model = self.optimizer = None
                del engine
                import gc

                gc.collect()


def _cast_inputs(dtype: torch.dtype):
    """A forward pre-hook that casts floating-point inputs to the engine's bf16/fp16 weights' dtype."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
        return cast(args), cast(kwargs)

    return hook


class _LineFilter(io.TextIOBase):
    """A text stream that passes whole lines to ``target`` unless they match ``pattern``."""

    def __init__(self, target: Any, pattern: re.Pattern):
        self.target, self.pattern, self.pending = target, pattern, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        complete, _, self.pending = self.pending.rpartition("\n")
        if _:
            kept = [line for line in complete.split("\n") if not self.pattern.match(line)]
            if kept:
                self.target.write("\n".join(kept) + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.pattern.match(self.pending):
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()


@contextlib.contextmanager
def dropping_lines(pattern: re.Pattern) -> Any:
    """Within the block, drop the lines of ``sys.stdout`` that match ``pattern`` (a library's noise)."""
    original = sys.stdout
    sys.stdout = _LineFilter(original, pattern)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = original
