"""``--strategy deepspeed --zero {0,1,2,3}``: DeepSpeed's engine with a config the magic builds.

The flags map onto DeepSpeed's config keys (see docs/strategies.md)::

    --zero S                   zero_optimization.stage = S
    --precision fp16 / bf16    fp16.enabled / bf16.enabled
    --grad-accum G             gradient_accumulation_steps = G
    --micro-batch M            train_micro_batch_size_per_gpu = M (else the first loader's batch size)
    --train-batch T            train_batch_size = T (= M x G x world size, checked before launch)

``--deepspeed-config`` (JSON text or a path to a JSON file) is merged on top; a key that disagrees with
a flag is a `ConfigError` before anything launches. ``gradient_clipping`` is ``--clip-grad``'s norm, else 0.0
unless the user's config sets it (DeepSpeed clips at 1.0 by default, which DDP and FSDP do not); DeepSpeed takes
the global norm over every partition itself and ``ctx.grad_norm`` reads it back. The user's torch optimizer is
passed to ``deepspeed.initialize`` as the client optimizer (a config ``optimizer`` section would make
DeepSpeed JIT-compile FusedAdam, ~40 s on CPU).

Buffer sizes follow the model (`model_sizes`), as Hugging Face's integration sizes its ``"auto"`` values: with the
model's hidden size H, ``reduce_bucket_size`` and ``allgather_bucket_size`` H², ZeRO-3's
``stage3_prefetch_bucket_size`` 0.9·H² and ``stage3_param_persistence_threshold`` 10·H; besides, ZeRO-3's
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` H² (DeepSpeed's 1e9 keeps every parameter a
backward pass will reuse gathered, so ZeRO-3 peaked above DDP) and ``sub_group_size`` H² (Adam's step temporaries
are the size of the flat group it steps at once). DeepSpeed's defaults (5e8-element buckets, 1e9) are sized for
billion-parameter models. A key given in ``--deepspeed-config`` wins; one set to ``"auto"`` takes the derived value.

Under ZeRO-3, ``ctx.init_model()`` (and a model factory given to ``ctx.prepare``) builds the model inside
``deepspeed.zero.Init``: each module is partitioned as soon as it is built, so no rank holds the whole model, and
``weights=`` writes each rank's flat partitions from the rows of the checkpoint they cover before
``deepspeed.initialize``. ZeRO 0-2 keep whole parameters on every rank: a deferred build is a whole one there.

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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from .._compat import deepspeed as deepspeed_compat
from ..batch_arithmetic import check_batch_arithmetic
from ..errors import ConfigError, MissingDependencyError
from .base import ADAM_TEMPORARIES, Strategy
from .extensions import load_deepspeed_cpu_ops, use_private_extensions_dir
from .memory import ADAM_MIXED_K, MemoryModel, ModelFacts

if TYPE_CHECKING:  # torch loads in the worker (`wrap`), not with the strategy's facts (base.py says why)
    import torch

    from ..config import RunConfig

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), for the estimate when a size is not set
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9,
}
MIN_BUCKET = 1 << 20  # elements: a tiny model's H² would mean one collective per few parameters


def model_sizes(hidden: int, stage: int) -> dict[str, int]:
    """The ``zero_optimization`` sizes derived from the model's hidden size (see the module docstring)."""
    square = max(MIN_BUCKET, hidden * hidden)
    sizes = {"reduce_bucket_size": square, "allgather_bucket_size": square}
    if stage == 3:
        sizes.update(stage3_prefetch_bucket_size=int(0.9 * square), stage3_param_persistence_threshold=10 * hidden,
                     stage3_max_live_parameters=square, stage3_max_reuse_distance=square, sub_group_size=square)
    return sizes

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


def build_config(config: RunConfig, world_size: int | None = None, loader_batch: int | None = None,
                 hidden: int | None = None) -> dict:
    """The DeepSpeed config for ``config``: the flags' keys, the buffer sizes for a model of ``hidden`` size
    (`model_sizes`; DeepSpeed's defaults without it), then ``--deepspeed-config`` merged on top.

    Raises `ConfigError` when the user's config contradicts a flag or the batch arithmetic does not hold.
    """
    world = world_size or config.num_processes
    user = parse_user_config(config.deepspeed_config)
    _refuse_conflicts(config, user)
    train, micro = _batch_sizes(config, user, world, loader_batch)
    built = _flag_keys(config, train, micro, _get(user, "zero_optimization.stage"))
    sizes = model_sizes(hidden, built["zero_optimization"]["stage"]) if hidden else {}
    built["zero_optimization"].update(sizes)
    return _resolve_auto(_merge(built, user), built, sizes)


def _user_batch(user: dict, key: str) -> Any:
    """A batch size the user's config gives (None for "auto" or missing: the flags or the loader decide)."""
    value = user.get(key)
    return None if value == "auto" else value


def _refuse_conflicts(config: RunConfig, user: dict) -> None:
    """A `ConfigError` listing every key of the user's config that contradicts a flag (or a stage out of range)."""
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
    user_clip = user.get("gradient_clipping")
    if user_clip not in (None, "auto") and config.clip_grad is not None and user_clip != config.clip_grad:
        conflicts.append(f"gradient_clipping is {user_clip} but --clip-grad {config.clip_grad:g}")
    user_accum = user.get("gradient_accumulation_steps")
    if user_accum not in (None, "auto") and user_accum != config.grad_accum:
        conflicts.append(f"gradient_accumulation_steps is {user_accum} but --grad-accum {config.grad_accum}")
    user_micro = _user_batch(user, "train_micro_batch_size_per_gpu")
    if user_micro is not None and config.micro_batch is not None and user_micro != config.micro_batch:
        conflicts.append(f"train_micro_batch_size_per_gpu is {user_micro} but --micro-batch {config.micro_batch}")
    user_train = _user_batch(user, "train_batch_size")
    if user_train is not None and config.train_batch is not None and user_train != config.train_batch:
        conflicts.append(f"train_batch_size is {user_train} but --train-batch {config.train_batch}")
    if conflicts:
        raise ConfigError(
            "--deepspeed-config",
            "conflicts with the flags: " + "; ".join(conflicts)
            + ". Remove the key from the DeepSpeed config or change the flag so they agree",
        )


def _batch_sizes(config: RunConfig, user: dict, world: int, loader_batch: int | None) -> tuple[int, int]:
    """(train batch, micro batch): from the flags, then the user's config, then the loader's batch size."""
    accum = config.grad_accum
    micro = config.micro_batch or _user_batch(user, "train_micro_batch_size_per_gpu")
    train = config.train_batch or _user_batch(user, "train_batch_size")
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
    return train, micro


def _flag_keys(config: RunConfig, train: int, micro: int, user_stage: int | None) -> dict[str, Any]:
    """The keys the flags decide (the user's config is merged over them)."""
    built: dict[str, Any] = {
        "train_batch_size": train,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": config.grad_accum,
        "zero_optimization": {"stage": config.zero if config.zero is not None else (user_stage or 0)},
        "fp16": {"enabled": config.precision == "fp16"},
        "bf16": {"enabled": config.precision == "bf16"},
        "gradient_clipping": float(config.clip_grad or 0.0),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if config.precision == "fp16":
        built["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if built["zero_optimization"]["stage"] > 0:
        # the magic passes plain torch optimizers; DeepSpeed only "tests" its own under ZeRO
        built["zero_allow_untested_optimizer"] = True
    if config.offload != "none":
        # the user's torch optimizer steps the offloaded fp32 partitions on the CPU (DeepSpeed would otherwise insist
        # on its own DeepSpeedCPUAdam, a C++ op it JIT-builds)
        built["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        built["zero_force_ds_cpu_optimizer"] = False
    if config.offload == "params":
        built["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return built


def _resolve_auto(merged: dict, built: dict, sizes: dict) -> dict:
    """The merged config with every "auto" resolved: the batch keys to the checked numbers, a ZeRO size to the
    model's, or dropped for DeepSpeed's own default."""
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        merged[key] = built[key]  # "auto" and agreeing values resolve to the checked numbers
    zero = merged.get("zero_optimization", {})
    for key in [k for k, v in zero.items() if v == "auto"]:
        if key in sizes:
            zero[key] = sizes[key]  # "auto": the size derived from the model
        else:
            del zero[key]  # not known (no model yet, or not a size): DeepSpeed's own default
    if merged.get("gradient_clipping") == "auto":
        merged["gradient_clipping"] = built["gradient_clipping"]  # --clip-grad's norm, or none
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
    def validate(cls, config: RunConfig) -> None:
        """What DeepSpeed cannot combine (before launch, naming both flags): ``--offload optimizer`` without ZeRO 1-3
        (only ZeRO's partitioned optimizer offloads), ``--offload params`` without ZeRO-3 (only ZeRO-3 partitions
        parameters). (``--compile``, compiled blocks inside ZeRO-3's hooks, runs on DeepSpeed 0.19: not refused.)"""
        if config.offload == "none":
            return
        stage = config.zero  # else the stage --deepspeed-config gives (parsed only here: `check` reports its errors)
        if stage is None:
            stage = _get(parse_user_config(config.deepspeed_config), "zero_optimization.stage", 0)
        if config.offload == "optimizer" and not stage:
            raise ConfigError("--offload", "optimizer needs --zero 1, 2 or 3 (DeepSpeed offloads ZeRO's partitioned "
                                           f"optimizer states), not ZeRO-{stage or 0}")
        if config.offload == "params" and stage != 3:
            raise ConfigError("--offload", f"params needs --zero 3 (only ZeRO-3 partitions the parameters), not "
                                           f"--zero {stage or 0}; or use --offload optimizer")

    @classmethod
    def memory_model(cls, zero: int | None, precision: str) -> MemoryModel:
        """ZeRO's sharding by stage; mixed precision stores 2-byte parameters and gradients beside an fp32 master
        copy (K = 12), and from stage 1 DeepSpeed keeps that fp32 copy of its partition even in fp32."""
        stage = 0 if zero is None else int(zero)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
        if precision != "fp32":
            return MemoryModel(stage, param_bytes=2, grad_bytes=2, optimizer_bytes=ADAM_MIXED_K)
        if stage in (1, 2):
            return MemoryModel(stage, optimizer_bytes=ADAM_MIXED_K)
        # ZeRO-3 in fp32 steps its fp32 parameter partitions themselves: DeepSpeed 0.19 means to keep no second copy
        # when the dtypes agree, and `wrap` makes it so (`share_fp32_partitions`); ZeRO-0 is plain Adam
        return MemoryModel(stage)

    @classmethod
    def memory_buffers(cls, facts: ModelFacts, zero: int | None, precision: str, world_size: int, tp: int = 1,
                       pp: int = 1, settings: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        """What DeepSpeed allocates beside the model states, from its ``zero_optimization`` sizes (``settings``;
        DeepSpeed's defaults where unset), each capped by the model: ZeRO-0 flattens gradients into all-reduce
        buckets; ZeRO-1/2 keep a reduce bucket and an all-gather bucket, and step one flat partition (Adam's
        temporaries are its size); ZeRO-3 keeps a reduce bucket, up to ``stage3_max_live_parameters`` gathered (at
        least one block, and the next prefetched), a block's unsharded gradient, and steps sub-groups of
        ``sub_group_size`` elements of this rank's partition (at least one parameter's partition): each step
        flattens the sub-group's gradient into a new fp32 tensor, and Adam's temporaries are the sub-group's size,
        not 1/N of it."""
        stage = 0 if zero is None else int(zero)
        sizes = {**DEEPSPEED_DEFAULTS, **{k: v for k, v in (settings or {}).items() if isinstance(v, (int, float))}}
        n, psi = max(1, world_size), facts.num_params
        low = 2 if precision != "fp32" else 4  # bytes of a gathered parameter or a gradient
        bucket = min(sizes["reduce_bucket_size"], psi)
        if stage == 0:
            return [("all-reduce bucket", low * bucket),
                    ("Adam's step temporaries", ADAM_TEMPORARIES * 4 * facts.largest_param)]
        if stage in (1, 2):
            return [("reduce bucket", low * bucket),
                    ("all-gather bucket", low * min(sizes["allgather_bucket_size"], psi)),
                    ("Adam's step temporaries (one flat partition)", ADAM_TEMPORARIES * 4 * psi / n)]
        live = max(min(sizes["stage3_max_live_parameters"], psi), facts.largest_block)
        prefetch = min(sizes["stage3_prefetch_bucket_size"], psi)
        group = min(max(sizes["sub_group_size"], facts.largest_param / n), psi / n)  # elements of the partition
        return [("reduce bucket", low * bucket),
                ("gathered parameters (live, prefetched)", low * min(psi, live + prefetch)),
                ("a block's unsharded gradient", low * facts.largest_block),
                ("a sub-group's flat fp32 gradient", 4 * group),
                ("Adam's step temporaries (one sub-group)", ADAM_TEMPORARIES * 4 * group)]

    @classmethod
    def memory_settings(cls, config: RunConfig, facts: ModelFacts) -> Mapping[str, Any]:
        """The ``zero_optimization`` section the run would use for this model (derived sizes, the user's keys)."""
        return build_config(config, config.num_processes, hidden=facts.hidden).get("zero_optimization", {})

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
    @property
    def stage(self) -> int:
        stage = self.config.zero
        if stage is None:
            stage = _get(parse_user_config(self.config.deepspeed_config), "zero_optimization.stage", 0)
        return int(stage or 0)

    def init_context(self) -> contextlib.AbstractContextManager:
        """ZeRO-3: ``deepspeed.zero.Init``, each module partitioned over the ranks as soon as it is built (its own
        init run on rank 0's values, broadcast); ZeRO 0-2 keep whole parameters, so a plain build."""
        if self.stage != 3:
            return super().init_context()
        import deepspeed

        if not self.config.use_gpu:
            load_deepspeed_cpu_ops()  # DeepSpeed's communication would JIT-build it
        # zero.Init reads the config before it joins DeepSpeed's communication, which deepspeed.initialize would
        # join anyway: joined first, the config's batch arithmetic sees the run's world size, not 1
        with dropping_lines(_OP_LOADED):
            deepspeed.init_distributed(dist_backend=self.process_group_backend(self.config.use_gpu),
                                       dist_init_required=False)
        # mem_efficient_linear=False: DeepSpeed would otherwise replace torch.nn.functional.linear for the process
        return deepspeed.zero.Init(config_dict_or_path=build_config(self.config, self.world_size),
                                   mem_efficient_linear=False)

    def whole_copy_reason(self) -> str:
        if self.stage == 3:  # a model built on the meta device by hand, not inside deepspeed.zero.Init
            return ("a model built on the meta device outside ctx.init_model() is not partitioned as it is built; "
                    "build it in ctx.init_model() or give ctx.prepare a factory")
        return "ZeRO 0-2 keep the whole parameters on every rank (only gradients and optimizer states are sharded)"

    def wrap(self, model: torch.nn.Module, optimizer: Any, weights: Any = None) -> tuple[Any, Any]:
        import deepspeed
        import torch

        from ..weights import deferred, loading
        from .memory import model_facts

        self._release_engine()
        loader_batch = None
        for loader in self.loaders:
            loader_batch = getattr(loader, "batch_size", None)
            if loader_batch:
                break
        self.ds_config = build_config(self.config, self.world_size, loader_batch, hidden=model_facts(model).hidden)
        self.report_memory(model, settings=self.ds_config.get("zero_optimization"))
        partitioned = any(deepspeed_compat.is_partitioned(p) for p in model.parameters())
        if deferred.has_meta_parameters(model):  # built on meta by hand: ZeRO needs it whole first
            old_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
            self.fill_whole(model, weights)
            optimizer = self.prepared_optimizer(optimizer, model, old_names)
        elif weights is not None and partitioned:
            loading.load_zero3_partitions(model, weights, self.rank)
        elif weights is not None:
            loading.load(model, weights)
        if optimizer is not None:  # None: scoring or inference, an engine without optimizer (ZeRO-3 still shards)
            optimizer = deferred.optimizer_for(optimizer, model.parameters())
        if not self.config.use_gpu:
            load_deepspeed_cpu_ops()  # what initialize would JIT-build, under a lock that cannot go stale
        with dropping_lines(_OP_LOADED):  # DeepSpeed prints it on every start, even for the op built at set-up
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=copy.deepcopy(self.ds_config), dist_init_required=False
            )
        if self.stage == 3:  # DeepSpeed 0.19 keeps an fp32 copy of fp32 partitions by mistake (see the compat note)
            deepspeed_compat.share_fp32_partitions(ds_optimizer)
        self.engine = engine
        self.model = engine
        self.optimizer = ds_optimizer
        if self.config.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
            self._hooks.append(engine.module.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))
        return engine, ds_optimizer

    # -- training --------------------------------------------------------------------------------
    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step, as the engine accumulates them (its ``gradient_accumulation_steps``):
        what a checkpoint keeps of the run (`TrainContext._run_state`)."""
        return int((self.ds_config or {}).get("gradient_accumulation_steps", self.config.grad_accum))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self) -> bool:
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        own_norm = None
        if boundary and self.config.clip_grad is not None and self.stage == 0:
            # ZeRO-0 clips with torch's helper and keeps no norm (the engine's stays None): the same norm, taken here
            # from the gradients the engine averaged in its backward
            from .clipping import total_norm

            own_norm = float(total_norm(self.engine.module.parameters()))
        self.engine.step()  # steps the optimizer and zeroes grads only at the boundary
        if boundary and self.config.clip_grad is not None:
            norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
            self.grad_norm = None if norm is None else float(norm)
        return boundary

    def autocast(self) -> contextlib.AbstractContextManager:
        """DeepSpeed holds bf16/fp16 weights itself; autocast keeps mixed-dtype user code (fp32 losses) working."""
        import torch

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
        """DeepSpeed's own load; a ZeRO checkpoint written on another number of ranks (an ``--elastic`` resize)
        through its universal checkpoint (`_load_resharded`)."""
        latest = os.path.join(directory, "latest")
        if not os.path.exists(latest):
            return None
        with open(latest) as handle:
            tag = handle.read().strip()
        saved = deepspeed_compat.saved_dp_world(os.path.join(directory, tag))
        if saved is not None and saved != self.world_size:
            path, client = self._load_resharded(directory, tag)
        else:
            path, client = self.engine.load_checkpoint(directory)
        if path is None:
            return None
        return (client or {}).get("dtrain_client_state", {})

    def _load_resharded(self, directory: str, tag: str) -> tuple[Any, Any]:
        """Rank 0 converts the checkpoint ``tag`` into DeepSpeed's universal format once (``<tag>_universal`` beside
        it, complete before it gets that name), then every rank loads it: DeepSpeed repartitions the fp32 weights
        and the optimizer state for this world."""
        import shutil

        import torch.distributed as dist

        universal = f"{tag}_universal"
        target = os.path.join(directory, universal)
        if self.rank == 0 and not os.path.isdir(target):
            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            deepspeed_compat.to_universal(os.path.join(directory, tag), partial)
            os.rename(partial, target)
        dist.barrier()
        with deepspeed_compat.loading_universal(self.engine):
            return self.engine.load_checkpoint(directory, tag=universal)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights of the whole model on every rank: ZeRO partitions and ZeRO-3 shards are gathered
        from the optimizer's fp32 master copy (a collective: every rank must call it)."""
        module = self.engine.module
        params = dict(module.named_parameters(remove_duplicate=False))
        out: dict[str, torch.Tensor] = {}
        for name, value in module.state_dict(keep_vars=True).items():
            param = params.get(name)
            out[name] = (self._full_fp32(param) if param is not None else value.detach()).cpu().clone()
        return out

    def stream_full_state(self, include: Callable[[str], bool] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """As `Strategy.stream_full_state`: one parameter's fp32 master gathered at a time, kept by rank 0."""
        from ..weights.saving import stream

        module = self.engine.module
        params = dict(module.named_parameters(remove_duplicate=False))
        state = {name: params.get(name, value) for name, value in module.state_dict(keep_vars=True).items()}
        is_param = {id(p) for p in params.values()}
        yield from stream(state, lambda value: self._full_fp32(value) if id(value) in is_param else value.detach(),
                          self.rank == 0, include)

    @staticmethod
    def _full_fp32(param: torch.nn.Parameter) -> torch.Tensor:
        """One parameter whole in fp32, from the optimizer's master partitions (a collective under ZeRO 1-3)."""
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        if full is None:
            if deepspeed_compat.is_partitioned(param):  # ZeRO-3 param without an fp32 master (no optimizer)
                from deepspeed import zero

                with zero.GatheredParameters([param]):
                    full = param.detach().clone()
            else:
                full = param.detach()
        return full.detach().float()

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
    import torch

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
