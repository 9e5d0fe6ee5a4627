"""`RunConfig`: the one validated, immutable description of a run.

Every entry point ends here: the magic's flags (`dtrain_magic.notebook.flags`), the panel, `dtrain_magic.run`
and the command line. Validation is pure logic, runs before anything is launched, and every error names the
flag, the value and what is allowed. The rules that belong to one backend or one strategy live with its class
(``validate``, ``own_fields``: `dtrain_magic.registry`); the rules here are the ones that hold for all of them.
They are read as facts (`Registry.facts`), which load neither torch nor a backend's library, and nothing they
load imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

from .batch_arithmetic import check_batch_arithmetic
from .dataspec import normalize as normalize_data
from .dataspec import normalize_outputs
from .elastic import parse_elastic
from .errors import ConfigError, log_dropped
from .flagtable import (
    BY_FIELD,
    DEFAULT_EXPERIMENT,
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_PREEMPT_GRACE_S,
    DEFAULT_STALL_TIMEOUT_S,
    FLAGS,
    SWITCH,
)
from .registry import BACKENDS, STRATEGIES

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RUN_ID = re.compile(r"^[A-Za-z0-9-]+$")  # --resume's value: an MLflow run id (or "latest")


def _choice(flag: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise ConfigError(flag, f"got {value!r}; allowed: {shown}")


def _positive_int(flag: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(flag, f"got {value!r}; must be an integer >= {minimum}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs to know, validated on construction.

    Field names are the flag names with dashes turned into underscores (``--grad-accum`` →
    ``grad_accum``). Build one with keywords; invalid values raise :class:`ConfigError`.
    """

    backend: str = BACKENDS.default
    strategy: str = STRATEGIES.default
    zero: int | None = None
    precision: str = "fp32"
    num_processes: int = 2
    use_gpu: bool = False
    grad_accum: int = 1
    fn: str | None = None
    result: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    tracking_uri: str | None = None
    ui: bool = False
    verbose: bool = False  # the run's slice of the backend log shown in the cell (dtrain_magic.backend_log)
    dry_run: bool = False
    seed: int | None = None
    timeout: float | None = None
    # Hangs and stalls (docs/reliability.md): a rank ended and the others stand still; no rank progresses
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S  # None or 0: never (kept as 0)
    on_stall: str = "report"
    # Spark (TorchDistributor)
    local_mode: bool = True
    spark_master: str | None = None
    # Ray (TorchTrainer)
    ray_address: str | None = None
    max_restarts: int = 0
    # --resume: RESUME_LATEST (this cell's last unfinished run) or an MLflow run id; None: a fresh run
    resume: str | None = None
    storage: str | None = None
    # Checkpoints, preemption, elasticity (docs/reliability.md): numbered checkpoints kept (None: all), seconds a
    # SIGTERMed rank has to reach a step boundary and checkpoint with every rank (0: off), "MIN:MAX" workers
    keep_checkpoints: int | None = None
    preempt_grace: float = DEFAULT_PREEMPT_GRACE_S
    elastic: str | None = None
    # Warm re-runs (Spark, Ray): how long the next run's workers may wait for it (None: the backend's default)
    keep_warm: float | None = None
    # DeepSpeed / batch arithmetic
    deepspeed_config: str | None = None
    micro_batch: int | None = None
    train_batch: int | None = None
    # Model parallelism: tensor-parallel degree, pipeline stages, micro-batches per pipeline step, schedule
    tp: int = 1
    pp: int = 1
    microbatches: int | None = None
    pp_schedule: str = "gpipe"
    # Big-model knobs (docs/big-models.md): gradient clipping, activation checkpointing, torch.compile per block
    clip_grad: float | None = None
    ac: str = "none"
    ac_module: str | None = None
    compile: bool = False
    offload: str = "none"  # CPU offload (needs --gpu): "optimizer" or "params"
    # Data sources (docs/data.md): ((name, source), ...) in the order given, and where staged copies go
    data: tuple[tuple[str, str], ...] = ()
    data_dir: str | None = None
    # What ctx.write writes (docs/data.md, the way back): ((output name, notebook variable), ...) to bind
    outputs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for row in FLAGS:  # every flag with a fixed set of values: backend, strategy, precision, zero, ...
            value = getattr(self, row.field) if row.field else None
            if row.choices is not None and value is not None:
                _choice(row.name, value, tuple(row.choices))
        _positive_int("--num-processes", self.num_processes)
        _positive_int("--grad-accum", self.grad_accum)
        _positive_int("--max-restarts", self.max_restarts, minimum=0)
        self._check_resume()
        if self.seed is not None:
            _positive_int("--seed", self.seed, minimum=0)
        for flag, value in (("--micro-batch", self.micro_batch), ("--train-batch", self.train_batch)):
            if value is not None:
                _positive_int(flag, value)
        for flag, value in (("--fn", self.fn), ("--result", self.result)):
            if value is not None and not _IDENTIFIER.match(value):
                raise ConfigError(flag, f"got {value!r}; must be a Python identifier")
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            raise ConfigError("--experiment", f"got {self.experiment!r}; must be a non-empty name")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not self.timeout > 0):
            raise ConfigError("--timeout", f"got {self.timeout!r}; must be a number of seconds > 0")
        if isinstance(self.hang_timeout, bool) or not isinstance(self.hang_timeout, (int, float)) or not (
                self.hang_timeout >= 0):
            raise ConfigError("--hang-timeout",
                              f"got {self.hang_timeout!r}; must be a number of seconds >= 0 (0: never)")
        self._check_stall_watch()
        self._check_reliability()
        if self.keep_warm is not None and (isinstance(self.keep_warm, bool)
                                           or not isinstance(self.keep_warm, (int, float))
                                           or not self.keep_warm >= 0):
            raise ConfigError("--keep-warm",
                              f"got {self.keep_warm!r}; must be a number of seconds >= 0 (0: hold nothing)")
        if self.precision == "fp16" and not self.use_gpu:
            raise ConfigError(
                "--precision",
                "fp16 needs a GPU (CPU kernels and loss scaling for fp16 are not supported); "
                "use --precision bf16 on CPU, or --gpu on a machine with CUDA",
            )
        object.__setattr__(self, "data", normalize_data(self.data))  # a mapping, NAME=SOURCE strings or pairs
        object.__setattr__(self, "outputs", normalize_outputs(self.outputs))  # NAME=VARIABLE, as data
        if self.data_dir is not None and (not isinstance(self.data_dir, str) or not self.data_dir.strip()):
            raise ConfigError("--data-dir", f"got {self.data_dir!r}; must be a directory or URI")
        if self.data_dir is not None and not self.data:
            raise ConfigError("--data-dir", "applies only with --data NAME=SOURCE (where sources are written once "
                                            "for the ranks); drop it or add --data")
        self._check_owned_fields()
        check_batch_arithmetic(self.train_batch, self.micro_batch, self.grad_accum, self.num_processes)
        self._check_model_parallel()
        self._check_big_model_knobs()
        if self.backend != "auto":
            BACKENDS.facts(self.backend).validate(self)
        STRATEGIES.facts(self.strategy).validate(self)

    def _check_stall_watch(self) -> None:
        """``--stall-timeout``: seconds >= 0, None and 0 both "never" (kept as 0); ``--on-stall fail`` needs it on."""
        if self.stall_timeout is None:
            object.__setattr__(self, "stall_timeout", 0.0)
        value = self.stall_timeout
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError("--stall-timeout", f"got {value!r}; must be a number of seconds >= 0 (0 or off: never)")
        if self.on_stall == "fail" and not value:
            raise ConfigError("--on-stall", "fail needs the stall watch, which --stall-timeout 0 (off) turns off: "
                                            f"drop --stall-timeout 0 (the default is {DEFAULT_STALL_TIMEOUT_S:g} s), "
                                            "or drop --on-stall")

    def _check_reliability(self) -> None:
        """``--keep-checkpoints`` >= 1, ``--preempt-grace`` seconds >= 0, ``--elastic MIN:MAX`` around ``-n``."""
        if self.keep_checkpoints is not None:
            _positive_int("--keep-checkpoints", self.keep_checkpoints)
        grace = self.preempt_grace
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ConfigError("--preempt-grace", f"got {grace!r}; must be a number of seconds >= 0 (0: a SIGTERM "
                                                 "stops a worker at once, as without the notice)")
        bounds = parse_elastic(self.elastic)
        if bounds is None:
            return
        object.__setattr__(self, "elastic", f"{bounds[0]}:{bounds[1]}")
        if not bounds[0] <= self.num_processes <= bounds[1]:
            raise ConfigError("--elastic", f"{self.elastic} does not hold -n {self.num_processes}: the run starts on "
                                           f"-n workers, so MIN <= -n <= MAX; use -n {bounds[1]} or widen the range")
        if self.tp > 1 or self.pp > 1:
            raise ConfigError("--elastic", "is not supported with --tp/--pp yet (a resize must keep whole model "
                                           "replicas); drop --elastic or --tp/--pp")

    @property
    def elastic_bounds(self) -> tuple[int, int] | None:
        """``--elastic MIN:MAX`` as numbers (None without it)."""
        return parse_elastic(self.elastic)

    def _check_owned_fields(self) -> None:
        """A flag that belongs to one backend or strategy (its class's ``own_fields``) is an error with another."""
        chosen = {"--backend": self.backend, "--strategy": self.strategy}
        for registry in (BACKENDS, STRATEGIES):
            if chosen[registry.flag] == "auto":
                continue  # resolved before the run: the owner's own checks run then
            for owner, cls in registry.all_facts().items():
                for name in cls.own_fields:
                    value = getattr(self, name)
                    if owner == chosen[registry.flag] or value == _FIELD_DEFAULTS[name]:
                        continue
                    flag = flag_for(name, value)
                    raise ConfigError(flag, f"applies only to {registry.flag} {owner}, not {registry.flag} "
                                            f"{chosen[registry.flag]}; drop {flag} or use {registry.flag} {owner}")

    def _check_model_parallel(self) -> None:
        _positive_int("--tp", self.tp)
        _positive_int("--pp", self.pp)
        if self.microbatches is not None:
            _positive_int("--microbatches", self.microbatches)
        if self.pp == 1:
            if self.microbatches is not None:
                raise ConfigError("--microbatches",
                                  "applies only to pipeline parallelism: add --pp N (N >= 2) or drop it")
            if self.pp_schedule != "gpipe":
                raise ConfigError("--pp-schedule",
                                  "applies only to pipeline parallelism: add --pp N (N >= 2) or drop it")
        if self.tp == 1 and self.pp == 1:
            return
        degrees = " x ".join(f"--{name} {value}" for name, value in (("tp", self.tp), ("pp", self.pp)) if value > 1)
        strategy = STRATEGIES.facts(self.strategy)
        if strategy.model_parallel_refusal:
            raise ConfigError("--tp" if self.tp > 1 else "--pp", f"{degrees} is not supported with "
                              f"{strategy.label(self.zero)}: {strategy.model_parallel_refusal}")
        model_parallel = self.tp * self.pp
        if self.num_processes % model_parallel:
            lower = (self.num_processes // model_parallel) * model_parallel
            options = " or ".join(str(n) for n in (lower, lower + model_parallel) if n > 0)
            raise ConfigError(
                "--tp" if self.tp > 1 else "--pp",
                f"-n {self.num_processes} processes cannot be arranged as {degrees} (= {model_parallel} processes per "
                f"model replica): the number of processes must be a multiple of {model_parallel}; use -n {options}, "
                "or change the degrees",
            )
        if self.precision == "fp16":
            raise ConfigError("--precision", f"fp16 with {degrees} is not supported (no loss scaling across "
                              "tensor-parallel shards or pipeline stages); use --precision bf16")
        if self.pp > 1:
            microbatches = self.pipeline_microbatches
            if self.pp_schedule == "1f1b" and microbatches < self.pp:
                raise ConfigError(
                    "--microbatches",
                    f"--pp-schedule 1f1b needs at least as many micro-batches as stages: got --microbatches "
                    f"{microbatches} for --pp {self.pp}; use --microbatches {self.pp} or more, or --pp-schedule gpipe",
                )

    def _check_big_model_knobs(self) -> None:
        """``--clip-grad``: a positive, finite norm; ``--ac-module`` needs ``--ac`` or ``--compile``; the knobs
        that the installed torch cannot combine with pipeline parallelism are refused, naming both flags."""
        value = self.clip_grad
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ConfigError("--clip-grad", f"got {value!r}; must be a gradient norm > 0 (e.g. 1.0), or left out "
                                             "for no clipping")
        module = self.ac_module
        if module is not None and (not isinstance(module, str) or not _IDENTIFIER.match(module)):
            raise ConfigError("--ac-module", f"got {self.ac_module!r}; must be a module class name (e.g. Block)")
        if self.ac_module is not None and self.ac == "none" and not self.compile:
            raise ConfigError("--ac-module", "names the blocks --ac and --compile apply to: add --ac full (or "
                                             "selective) or --compile, or drop it")
        if self.pp > 1:
            # torch.distributed.pipelining runs each stage's forward and backward itself (and cuts the model into
            # stages after ctx.prepare has seen it): a checkpointed or compiled block there is untested and unsupported
            for flag, on in (("--ac", self.ac != "none"), ("--compile", self.compile)):
                if on:
                    raise ConfigError(flag, f"is not supported with --pp {self.pp} (pipeline parallelism): the "
                                            f"pipeline schedule runs each stage itself; drop {flag} or --pp")
        if self.offload != "none":
            self._check_offload()

    def _check_offload(self) -> None:
        """``--offload``: only from a GPU (a CPU run's tensors are in CPU memory already), and not with
        ``--tp``/``--pp``; which strategies offload what is theirs to say (their ``validate``)."""
        if not self.use_gpu:
            raise ConfigError("--offload", f"{self.offload} moves GPU memory to the CPU, but this run is on CPU "
                                           "(--cpu, or no CUDA here): there is nothing to offload to; drop --offload "
                                           "or run with --gpu")
        if self.tp > 1 or self.pp > 1:
            flag = "--tp" if self.tp > 1 else "--pp"
            raise ConfigError("--offload", f"is not supported with {flag} (model parallelism's DTensor/pipeline "
                                           f"stages are not offloaded by the installed torch); drop --offload or "
                                           f"{flag}")

    def _check_resume(self) -> None:
        """``--resume``: alone (``resume=True`` from Python), or an MLflow run id."""
        from .flagtable import RESUME_LATEST

        value = {True: RESUME_LATEST, False: None}.get(self.resume, self.resume) if isinstance(self.resume, bool) \
            else self.resume
        object.__setattr__(self, "resume", value)
        if value is not None and (not isinstance(value, str) or not _RUN_ID.match(value)):
            raise ConfigError("--resume", f"got {value!r}; give it alone (this cell's last unfinished run; "
                                          "resume=True from Python) or with an MLflow run id (letters, digits, '-')")

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: processes / (tensor-parallel degree x pipeline stages)."""
        return self.num_processes // (self.tp * self.pp)

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per pipeline step: ``--microbatches``, else twice the stages."""
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    @property
    def process_group_backend(self) -> str:
        """The torch.distributed backend of the run's process group, as the strategy chooses it (nccl/gloo)."""
        return STRATEGIES.facts(self.strategy).process_group_backend(self.use_gpu)

    @property
    def zero_stage(self) -> int:
        """ZeRO stage for DeepSpeed (0 when not given)."""
        return 0 if self.zero is None else self.zero

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def to_params(self) -> dict[str, str]:
        """Every field as an MLflow parameter (strings), with credentials removed from URIs."""
        params = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("tracking_uri", "ray_address", "spark_master", "data_dir") and isinstance(value, str):
                value = redact_uri(value)
            if f.name == "data":
                value = " ".join(f"{name}={redact_uri(source)}" for name, source in value) or "()"
            params[f.name] = str(value)
        return params

    def flag_line(self) -> str:
        """The ``%%distribute`` line that reproduces this config (``flags.config_from_line`` reads it back to
        an equal config, ``dry_run`` aside: the line is the one that launches). Written from the flag table
        (`dtrain_magic.flagtable`), in its order; values with spaces or quotes are quoted (`quote_flag_value`)."""
        words = [word for row in FLAGS if row.field is not None
                 for word in row.line_words(getattr(self, row.field), quote_flag_value)]
        return "%%distribute " + " ".join(words)


_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def flag_for(field: str, value: Any = None) -> str:
    """The flag that sets a `RunConfig` field to ``value``, as messages name it (``--cluster`` for local_mode=False)."""
    row = BY_FIELD[field]
    if row.kind == SWITCH and value is False:
        return row.off_options[0]
    return row.name


def resolve_config(
    values: Mapping[str, Any],
    *,
    gpu_available: Callable[[], bool] | None = None,
    backend_detector: Callable[[], str] | None = None,
    in_frontend: bool = False,
    gpu_count: Callable[[], int] | None = None,
) -> RunConfig:
    """Every entry point's last step: ``values`` (each `RunConfig` field, as given or the flag table's "not
    given" default) with the defaults that depend on the environment resolved (the rows with ``resolved=True``:
    backend, strategy, processes, GPU, UI), validated into a `RunConfig`."""
    values = dict(values)
    if values.get("use_gpu") is None:
        values["use_gpu"] = (gpu_available or cuda_available)()
    if values.get("strategy") is None:
        values["strategy"] = default_strategy(values)
    if values.get("num_processes") is None:
        count = (gpu_count or cuda_device_count)() if values["use_gpu"] else 0
        values["num_processes"] = count if count > 0 else 2
    if values.get("backend", "auto") == "auto":
        values["backend"] = (backend_detector or detect_backend)()
    if values.get("ui") is None:
        values["ui"] = in_frontend
    return RunConfig(**values)


def default_strategy(given: Mapping[str, Any]) -> str:
    """``--strategy`` when not given: the strategy that owns a flag that was given (``--zero`` → deepspeed), else
    the default one (`Registry.default`: the first registered)."""
    for name, cls in STRATEGIES.all_facts().items():
        if any(given.get(field) not in (None, _FIELD_DEFAULTS[field]) for field in cls.own_fields):
            return name
    return STRATEGIES.default


_NEEDS_QUOTES = re.compile(r"[\s'\"]")


def quote_flag_value(flag: str, value: Any, always: bool = False) -> str:
    """``value`` as one token of a ``%%distribute`` line.

    IPython splits magic lines with ``shlex`` in non-POSIX mode: quotes group words but are kept, and
    there are no escapes (``flags.parse_line`` strips one pair of surrounding quotes). So a value with
    whitespace or a quote, or one starting with ``-`` (argparse would take it for a flag), is wrapped in
    the quote character it does not contain. A value with both kinds of quotes, or a line break (the magic's
    line would end there), cannot be written on the line: a `ConfigError` naming the flag. (A line pasted
    into a cell is also expanded by IPython before parsing: a value with ``$name`` or ``{expr}`` in it may change.)
    """
    text = str(value)
    if len(f"x{text}x".splitlines()) > 1:
        raise ConfigError(flag, f"got {text!r}, which has a line break: it cannot be written on a %%distribute line")
    flag_like = isinstance(value, str) and text.startswith("-")  # numbers stay bare: argparse takes -1 as a value
    if not always and text and not flag_like and not _NEEDS_QUOTES.search(text):
        return text
    for quote in ("'", '"'):
        if quote not in text:
            return f"{quote}{text}{quote}"
    raise ConfigError(
        flag,
        f"got {text!r}, which has both ' and \" quotes: it cannot be written on a %%distribute line "
        "(IPython's line splitting has no escapes); use a value without one of them",
    )


def redact_uri(uri: str) -> str:
    """Drop a ``user:password@`` part from a URI so it can be shown or logged."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        return urlunsplit((parts.scheme, "***@" + host, parts.path, parts.query, parts.fragment))
    return uri


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception as exc:  # torch missing or broken CUDA runtime: treat as no GPU
        log_dropped(__name__, "cuda_available", exc)
        return False


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception as exc:  # torch missing or a broken CUDA runtime: no GPU, as cuda_available says
        log_dropped(__name__, "cuda_device_count", exc)
        return 0


def detect_backend(modules: Mapping[str, Any] | None = None) -> str:
    """``--backend auto``: the first registered backend whose class says it is in use in this process
    (``in_use``: spark with an active SparkSession, ray when Ray is initialised), else the default one (local).

    Backends look only at libraries the notebook has already imported, so ``auto`` never pays their import time.
    """
    import sys

    modules = sys.modules if modules is None else modules
    for name, cls in BACKENDS.all_facts().items():
        if cls.in_use(modules):
            return name
    return BACKENDS.default


def default_tracking_uri(cwd: str | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else an SQLite file ``mlflow.db`` in the working directory."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    path = os.path.abspath(os.path.join(cwd or os.getcwd(), "mlflow.db"))
    return f"sqlite:///{path}"
