"""The ``%%distribute`` flags, declared once: one `Flag` row per flag in `FLAGS`.

Everything else about the flags comes from this table:

- the magic's parser and the ``%%distribute?`` help (`dtrain_magic.notebook.flags` applies IPython's
  ``argument``/``argument_group`` for each row, in table order, one help group per run of rows);
- `flags.config_from_args`: each row's parsed value goes to its `RunConfig` field; the defaults that depend
  on the environment or on other flags (rows with ``resolved=True``) are resolved there explicitly;
- `RunConfig.flag_line`: rows are written in table order, as their ``line`` says, every value through
  `config.quote_flag_value`;
- the ``--configure`` panel's controls, labels and options (`dtrain_magic.ui.panel`): rows with a `PanelControl`;
- the flag tables of ``docs/flags.md`` and README.md: ``python scripts/flagdocs.py --write-docs``
  (``--check`` says whether they are current; ``tests/unit/test_flagtable.py`` fails when they are not).

Adding a flag (say ``--tp N``)
------------------------------
1. `RunConfig` (config.py): add the field with its default, and its validation in ``__post_init__``; errors
   name the flag (``ConfigError("--tp", "got 0; must be an integer >= 1")``).
2. Here: add one row where it belongs in the help, the docs and flag lines (its group's rows stay together)::

       Flag(("--tp",), "tp", WHERE, type=int, default=1, placeholder="N",
            help="tensor-parallel degree (processes per model replica)"),

   ``default`` is the RunConfig field's default, except for a default that depends on the environment:
   then ``default`` is the parser's "not given" value (None), ``resolved=True``, ``default_doc`` says how it
   is resolved, and `flags.config_from_args` resolves it. Give ``panel=PanelControl(...)`` to show it in the
   ``--configure`` panel, ``line=NEVER`` for a flag an equivalent line must not repeat (``--dry-run``).
3. Add non-default sample values for the field to ``ROUND_TRIP`` in tests/unit/test_flagtable.py.
4. ``python scripts/flagdocs.py --write-docs`` and commit docs/flags.md and README.md with it.

tests/unit/test_flagtable.py fails until each of these is done (a field without a row or a row without a
field, a default that disagrees with RunConfig, a field without round-trip samples, stale docs).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .dataspec import output_names
from .dataspec import parse_item as data_item
from .dataspec import parse_output as output_item
from .errors import ConfigError
from .registry import BACKENDS, STRATEGIES

PRECISIONS = ("fp32", "fp16", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
PP_SCHEDULES = ("gpipe", "1f1b")
AC_MODES = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer", "params")
ON_STALL = ("report", "fail")
DEFAULT_HANG_TIMEOUT_S = 15.0
DEFAULT_STALL_TIMEOUT_S = 120.0
DEFAULT_PREEMPT_GRACE_S = 30.0
OFF_WORDS = ("off", "never", "none")  # what ``--stall-timeout`` takes for "never", besides 0
DEFAULT_EXPERIMENT = "dtrain_magic"
RESUME_LATEST = "latest"  # --resume alone: this cell's last unfinished run

# How a flag takes its value.
VALUE = "value"  # --flag VALUE
SWITCH = "switch"  # an on/off pair setting one boolean: --gpu / --cpu
STORE_TRUE = "store_true"  # --flag alone sets True
APPEND = "append"  # --flag VALUE, repeatable: a tuple of values (--data a=x --data b=y)

# How `RunConfig.flag_line` writes a row.
ALWAYS = "always"  # every time (a default resolved on this machine is pinned, so the line means the same elsewhere)
CHANGED = "changed"  # when the value differs from the row's default
NEVER = "never"  # not at all

# Help groups, in the order ``%%distribute?`` shows them (the table keeps each group's rows together).
WHERE = "Where and how"
CELL = "The cell"
TRACKING = "Tracking and display"
SPARK = "Spark (TorchDistributor)"
RAY = "Ray (TorchTrainer)"
RELIABILITY = "Checkpoints, preemption, elasticity (docs/reliability.md)"
DEEPSPEED = "DeepSpeed and batch arithmetic"
MODEL_PARALLEL = "Model parallelism"
BIG_MODELS = "Big-model knobs (docs/big-models.md)"
DATA = "Data (docs/data.md)"
SWEEP = "Sweeps (docs/sweeps.md)"  # the sweep's own options: no RunConfig field (`dtrain_magic.sweep.options`)

# Where a flag applies: the ``%%distribute`` magic (and its panel), `dtrain_magic.run`'s keyword options, the command
# line (``python -m dtrain_magic run``).
MAGIC = "magic"
PYTHON = "python"
CLI = "cli"
EVERYWHERE = (MAGIC, PYTHON, CLI)

# How the ``--configure`` panel shows a row.
DROPDOWN = "dropdown"
INT_BOX = "int"
CHECKBOX = "checkbox"
TEXT = "text"


@dataclass(frozen=True)
class PanelControl:
    """How the ``--configure`` panel shows a flag: the widget, its label and where it goes."""

    widget: str  # DROPDOWN (the row's choices), INT_BOX, CHECKBOX or TEXT
    label: str
    column: int = 0  # 0: left, 1: right; within a column, table order
    option_label: str = "{}"  # DROPDOWN: each choice's label, ``.format(choice)``
    hidden: tuple[Any, ...] = ()  # DROPDOWN: choices not offered (``auto`` is resolved before the panel opens)
    bounds: tuple[int, int] = (1, 4096)  # INT_BOX: (min, max)

    def options(self, choices: tuple[Any, ...]) -> list[tuple[str, Any]]:
        """(label, value) pairs of a dropdown."""
        return [(self.option_label.format(choice), choice) for choice in choices if choice not in self.hidden]


@dataclass(frozen=True)
class Flag:
    """One ``%%distribute`` flag: how it parses, where it goes, how it is written, shown and documented."""

    options: tuple[str, ...]  # option strings; flag lines write the first (``-n``)
    field: str | None  # the RunConfig field and parser dest; None: a magic-only flag, not in RunConfig
    group: str  # help group
    help: str  # ``%%distribute?`` text (argparse appends "(default: ...)")
    kind: str = VALUE  # VALUE, SWITCH, STORE_TRUE or APPEND
    const: Any = None  # VALUE: the value of the flag given alone (its value is then optional: ``--resume``)
    type: Callable[[str], Any] | None = None  # VALUE, APPEND: converts the text (None: kept as text)
    choices: tuple[Any, ...] | None = None  # VALUE: the allowed values
    default: Any = None  # when the flag is not given; RunConfig's default unless ``resolved``
    resolved: bool = False  # the default depends on the environment or other flags: config_from_args resolves it
    off_options: tuple[str, ...] = ()  # SWITCH: the flags that set False (``--cpu``)
    off_help: str = ""  # SWITCH: the off flags' help
    line: str = CHANGED  # how RunConfig.flag_line writes it: ALWAYS, CHANGED or NEVER
    quote_always: bool = False  # flag_line quotes the value even without spaces or quotes in it
    placeholder: str | None = None  # VALUE: the value's name in the docs (``N``, ``URI``)
    doc: str | None = None  # markdown meaning in the docs (None: ``help``)
    default_doc: str | None = None  # markdown default in the docs (None: written from ``default``)
    panel: PanelControl | None = None  # shown in the --configure panel
    cheatsheet: bool = False  # also in README's short table (docs/flags.md has every flag)
    entry_points: tuple[str, ...] = EVERYWHERE  # where it applies (MAGIC, PYTHON, CLI)
    keyword_type: Callable[[Any], Any] | None = None  # PYTHON: a keyword's value → the field's (None: as given)
    keyword_help: str | None = None  # PYTHON: its meaning in ``help(dtrain_magic.run)`` (None: ``help``)

    @property
    def name(self) -> str:
        """The flag's name in messages and docs: its first long option (``--num-processes``)."""
        return next((o for o in self.options if o.startswith("--")), self.options[0])

    @property
    def all_options(self) -> tuple[str, ...]:
        return self.options + self.off_options

    @property
    def keywords(self) -> tuple[str, ...]:
        """Its names as keyword options of `dtrain_magic.run`: the `RunConfig` field, then each long option that
        sets it True or to a value (``num_processes``, ``num_workers``; ``use_gpu``, ``gpu``), dashes as underscores."""
        if self.field is None:
            return ()
        names = [self.field] + [_keyword(o) for o in self.options if o.startswith("--")]
        return tuple(dict.fromkeys(names))

    @property
    def off_keywords(self) -> tuple[str, ...]:
        """A SWITCH's off flags as keyword options (``cpu``, ``cluster``, ``no_ui``): ``cpu=True`` is ``--cpu``."""
        return tuple(_keyword(o) for o in self.off_options if o.startswith("--"))

    def keyword_value(self, keyword: str, value: Any) -> Any:
        """The field's value for ``keyword=value`` (one of `keywords` or `off_keywords`): an off keyword's
        True/False is the field's False/True (``cpu=True`` → ``use_gpu=False``); None leaves the default;
        ``keyword_type`` converts the others (``outputs="preds"``)."""
        if self.keyword_type is not None and keyword not in self.off_keywords:
            return self.keyword_type(value)
        if keyword not in self.off_keywords or value is None:
            return value
        if not isinstance(value, bool):
            raise ConfigError(f"{keyword}=", f"got {value!r}; must be True or False ({keyword}=True is "
                                             f"{self.off_options[0]})")
        return not value

    def argparse_calls(self) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
        """The ``add_argument`` calls (positional, keywords) that declare this flag."""
        dest = {"dest": self.field} if self.field else {}
        if self.kind == VALUE:
            extra = {k: v for k, v in (("type", self.type), ("choices", self.choices)) if v is not None}
            if self.const is not None:
                extra.update(nargs="?", const=self.const)
            yield self.options, {**dest, **extra, "default": self.default, "help": self.help}
        elif self.kind == SWITCH:
            on = {**dest, "action": "store_const", "const": True, "default": self.default, "help": self.help}
            yield self.options, on
            yield self.off_options, {"dest": self.field, "action": "store_const", "const": False, "help": self.off_help}
        elif self.kind == STORE_TRUE:
            yield self.options, {**dest, "action": "store_true", "default": self.default, "help": self.help}
        elif self.kind == APPEND:  # argparse appends to a list: its "not given" is None (RunConfig's default: empty)
            extra = {"type": self.type} if self.type is not None else {}
            yield self.options, {**dest, **extra, "action": "append", "default": None, "help": self.help}
        else:
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")

    def line_words(self, value: Any, quote: Callable[[str, Any, bool], str]) -> list[str]:
        """This flag's words in a ``%%distribute`` line for ``value`` (none when the line leaves it out);
        ``quote(flag, value, always)`` writes a value as one token."""
        if self.line == NEVER or (self.line == CHANGED and value == self.default):
            return []
        if self.kind == VALUE and self.const is not None and value == self.const:
            return [self.options[0]]
        if self.kind == VALUE:
            return [self.options[0], quote(self.name, value, self.quote_always)]
        if self.kind == SWITCH:
            return [self.options[0] if value else self.off_options[0]]
        if self.kind == APPEND:  # (name, value) pairs: one NAME=VALUE per occurrence
            return [word for name, item in value for word in (self.options[0],
                                                              quote(self.name, f"{name}={item}", self.quote_always))]
        return [self.options[0]] if value else []


def _keyword(option: str) -> str:
    """``--num-workers`` → ``num_workers``: a long option as a keyword option of `dtrain_magic.run`."""
    return option.lstrip("-").replace("-", "_")


def seconds(text: str) -> float:
    """``--timeout`` values: a number of seconds."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None


def count_or_auto(text: str) -> int | str:
    """``--parallel-trials`` values: an integer, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r} (or auto)") from None


def seconds_or_off(text: str) -> float:
    """``--stall-timeout`` values: a number of seconds, or ``off`` (also ``never``, ``none``): 0, never."""
    if text.strip().lower() in OFF_WORDS:
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r} (or off)") from None


FLAGS: tuple[Flag, ...] = (
    # -- where and how ---------------------------------------------------------------------------------
    Flag(("--backend",), "backend", WHERE, cheatsheet=True, choices=BACKENDS, default="auto", resolved=True,
         line=ALWAYS,
         help="auto: spark with an active SparkSession, ray when Ray is initialised, else local",
         doc="`auto`: spark when a SparkSession is active, ray when Ray is initialised, else local",
         panel=PanelControl(DROPDOWN, "backend", hidden=("auto",))),
    Flag(("--strategy",), "strategy", WHERE, cheatsheet=True, choices=STRATEGIES, default=None, resolved=True,
         line=ALWAYS,
         help="parallelism strategy (None means ddp, or deepspeed when --zero is given)",
         doc="parallelism strategy", default_doc="ddp (deepspeed if `--zero` is given)",
         panel=PanelControl(DROPDOWN, "strategy")),
    Flag(("--zero",), "zero", WHERE, cheatsheet=True, type=int, choices=ZERO_STAGES, default=None,
         help="DeepSpeed ZeRO stage (implies --strategy deepspeed)",
         doc="DeepSpeed ZeRO stage; implies `--strategy deepspeed`", default_doc="none (DeepSpeed's 0)",
         panel=PanelControl(DROPDOWN, "ZeRO stage", option_label="ZeRO-{}")),
    Flag(("--precision",), "precision", WHERE, cheatsheet=True, choices=PRECISIONS, default="fp32", line=ALWAYS,
         help="numeric precision of training", doc="fp16 needs a GPU (on CPU: an error suggesting bf16)",
         panel=PanelControl(DROPDOWN, "precision")),
    Flag(("-n", "--num-processes", "--num-workers"), "num_processes", WHERE, cheatsheet=True, type=int, default=None,
         resolved=True, line=ALWAYS, placeholder="N",
         help="number of worker processes (None means one per GPU with --gpu, else 2)",
         doc="number of worker processes", default_doc="one per GPU with `--gpu`, else 2",
         panel=PanelControl(INT_BOX, "processes", column=1, bounds=(1, 4096))),
    Flag(("--gpu",), "use_gpu", WHERE, cheatsheet=True, kind=SWITCH, off_options=("--cpu",), default=None,
         resolved=True, line=ALWAYS,
         help="one GPU per process (None means GPU when CUDA is available)",
         off_help="train on CPU even if CUDA is available",
         doc="one GPU per process, or CPU only", default_doc="GPU when CUDA is available",
         panel=PanelControl(CHECKBOX, "GPU", column=1)),
    Flag(("--grad-accum",), "grad_accum", WHERE, cheatsheet=True, type=int, default=1, placeholder="N",
         help="micro-batches per optimizer step (gradient accumulation)", doc="micro-batches per optimizer step",
         panel=PanelControl(INT_BOX, "grad accumulation", column=1, bounds=(1, 100000))),
    Flag(("--seed",), "seed", WHERE, cheatsheet=True, type=int, default=None, placeholder="N",
         help="seed torch/numpy/random on every rank before calling the function",
         doc="seed `random`, numpy and torch on every rank before the call"),
    Flag(("--timeout",), "timeout", WHERE, cheatsheet=True, type=seconds, default=None, placeholder="S",
         help="fail the run (and stop every worker) after this many seconds",
         doc="stop every worker and fail the run after S seconds"),
    Flag(("--hang-timeout",), "hang_timeout", WHERE, type=seconds, default=DEFAULT_HANG_TIMEOUT_S, placeholder="S",
         help="once a rank has ended, fail the run when every other rank made no progress (no step, output or CPU "
              "use) for S seconds, saying where each one is blocked (0: never)",
         doc="once a rank has returned or failed, fail the run when every other rank made no progress for S "
             "seconds (no step, metric, output or CPU use), with each rank's stack and the cell's line; 0: never "
             "(see [hangs](reliability.md#hangs-stalls-and-stacks))"),
    Flag(("--stall-timeout",), "stall_timeout", WHERE, type=seconds_or_off, default=DEFAULT_STALL_TIMEOUT_S,
         placeholder="S",
         help="no step, metric, output or CPU use from any rank for S seconds: show where every rank waits and its "
              "stack in the cell and the MLflow run, once per stall; the run goes on (see --on-stall; 0 or off: "
              "never)",
         doc="no step, metric, output or CPU use from any rank for S seconds: where every rank waits (the cell's "
             "line) and its stack, in the cell and as an MLflow artifact, once per stall; the run goes on unless "
             "`--on-stall fail`; `0` or `off`: never (see [hangs](reliability.md#hangs-stalls-and-stacks))"),
    Flag(("--on-stall",), "on_stall", WHERE, choices=ON_STALL, default="report",
         help="what a stall (--stall-timeout) does: report the stacks and go on, or fail the run",
         doc="`report`: show the stacks, go on; `fail`: stop every worker and fail the run with `RunStalled`"),
    Flag(("--keep-warm",), "keep_warm", WHERE, type=seconds, default=None, placeholder="S",
         help="spark, ray: keep the next run's workers waiting S seconds for it (0: hold nothing; None means 600 s "
              "on what the magic or the notebook's own ray.init() started, or what runs on this machine; 0 on a "
              "cluster you brought)",
         doc="spark, ray: the next run's workers, launched after each run, wait S seconds for it (0: hold nothing; "
             "see [warm re-runs](backends.md#warm-re-runs-standbys))",
         default_doc="600 s (`$DTRAIN_MAGIC_KEEP_WARM`) on what the magic started or what runs on this machine; "
                     "0 on a SparkSession's executors or a Ray cluster you brought (a local Ray your `ray.init()` "
                     "started is this machine's: held)"),
    # -- model parallelism (docs/model-parallel.md) ---------------------------------------------------
    Flag(("--tp",), "tp", MODEL_PARALLEL, type=int, default=1, placeholder="N",
         help="tensor-parallel degree: each layer's weights split over this many processes (ddp, fsdp)",
         doc="tensor-parallel degree: each layer's weights split over N processes (ddp, fsdp; with fsdp and more "
             "processes: 2-D, FSDP over the replicas)",
         panel=PanelControl(INT_BOX, "tensor parallel", column=1, bounds=(1, 4096))),
    Flag(("--pp",), "pp", MODEL_PARALLEL, type=int, default=1, placeholder="N",
         help="pipeline stages: the model split into this many consecutive parts (ddp, fsdp)",
         doc="pipeline stages: the model split into N consecutive parts (ddp, fsdp); train with `ctx.train_step`",
         panel=PanelControl(INT_BOX, "pipeline stages", column=1, bounds=(1, 4096))),
    Flag(("--microbatches",), "microbatches", MODEL_PARALLEL, type=int, default=None, placeholder="M",
         help="micro-batches per pipeline step with --pp (None means 2 x --pp)",
         doc="micro-batches per pipeline step with `--pp`", default_doc="2 × `--pp`"),
    Flag(("--pp-schedule",), "pp_schedule", MODEL_PARALLEL, choices=PP_SCHEDULES, default="gpipe",
         help="pipeline schedule with --pp", doc="pipeline schedule with `--pp`"),
    # -- big-model knobs (docs/big-models.md) ---------------------------------------------------------
    Flag(("--clip-grad",), "clip_grad", BIG_MODELS, type=float, default=None, placeholder="NORM",
         help="clip the global gradient norm (over every shard, stage and rank) to NORM before each optimizer step; "
              "ctx.grad_norm is the norm before clipping",
         doc="clip the global gradient norm (every shard's, stage's and rank's together, as one process would) to "
             "NORM before each optimizer step (deepspeed: its `gradient_clipping`); `ctx.grad_norm` is the last "
             "norm before clipping, the same on every rank", default_doc="no clipping"),
    Flag(("--ac",), "ac", BIG_MODELS, choices=AC_MODES, default="none",
         help="activation checkpointing per block (recompute its activations in the backward): full = every block, "
              "selective = every other block",
         doc="activation checkpointing per block (non-reentrant; its activations recomputed in the backward): `full` "
             "every block, `selective` every other block (torchtitan's layer-selective AC); applied before "
             "`--compile` and sharding",
         panel=PanelControl(DROPDOWN, "activation checkpointing", column=1)),
    Flag(("--ac-module",), "ac_module", BIG_MODELS, default=None, placeholder="NAME",
         help="the block class --ac and --compile apply to (None means the module class the model repeats most)",
         doc="the block class (`__name__`) `--ac` and `--compile` apply to",
         default_doc="the class the model repeats most among its blocks"),
    Flag(("--compile",), "compile", BIG_MODELS, kind=STORE_TRUE, default=False,
         help="torch.compile each block (after --ac, before sharding)",
         doc="`torch.compile` each block, after `--ac` and before sharding (the first step pays the compile: about a "
             "minute per block class on a 2-core CPU)",
         panel=PanelControl(CHECKBOX, "torch.compile blocks", column=1)),
    Flag(("--offload",), "offload", BIG_MODELS, choices=OFFLOAD, default="none",
         help="keep in CPU memory (needs --gpu): optimizer = the optimizer states and step (deepspeed ZeRO 1-3), "
              "params = parameters, gradients and optimizer (fsdp, deepspeed ZeRO-3)",
         doc="keep in CPU memory, needs `--gpu`: `optimizer` the optimizer states and step (deepspeed ZeRO 1-3: "
             "`offload_optimizer`), `params` the parameters, gradients and optimizer states too (fsdp: "
             "`CPUOffloadPolicy`; deepspeed ZeRO-3: `offload_param` and `offload_optimizer`); a step can be several "
             "times slower",
         panel=PanelControl(DROPDOWN, "CPU offload", column=1)),
    # -- data (docs/data.md) ---------------------------------------------------------------------------
    Flag(("--data",), "data", DATA, kind=APPEND, cheatsheet=True, type=data_item, default=(), placeholder="NAME=SOURCE",
         help="a data source the function reads with ctx.data(NAME, batch_size): a notebook variable (Spark or pandas "
              "DataFrame, Ray Dataset, pyarrow Table, numpy array, torch tensor, dict of arrays) or a Parquet "
              "path/URI; SOURCE[col,...] keeps those columns; repeatable",
         doc="a data source the function reads with `ctx.data(NAME, batch_size)`: a notebook variable (Spark or pandas "
             "DataFrame, Ray Dataset, pyarrow Table, numpy array, torch tensor, dict of arrays) or a Parquet path/URI; "
             "`SOURCE[col,...]` keeps those columns; repeatable. Each rank reads only its share (docs/data.md)",
         default_doc="none",
         panel=PanelControl(TEXT, "data (NAME=SOURCE ...)")),
    Flag(("--data-dir",), "data_dir", DATA, default=None, placeholder="DIR",
         help="where sources written once for the ranks go (Spark DataFrames, Ray Datasets off Ray, notebook objects); "
              "needed when the workers do not share this machine's files (None means a temp dir on this machine)",
         doc="where sources written once for the ranks go (Spark DataFrames, Ray Datasets off Ray, notebook "
             "objects): a directory or URI every worker reads; needed when the workers do not share this machine's "
             "files", default_doc="a private temp dir on this machine, removed with the kernel"),
    # run() has no notebook variable: outputs="preds" (or a list) comes back as result.tables["preds"]
    Flag(("--output",), "outputs", DATA, kind=APPEND, type=output_item, default=(), placeholder="NAME=VARIABLE",
         entry_points=(MAGIC, PYTHON), keyword_type=output_names,
         keyword_help="the outputs the function writes with ctx.write(NAME, batch) to return as result.tables[NAME]: a "
                      "Spark DataFrame on backend='spark', a Ray Dataset on 'ray', a pyarrow Dataset otherwise (a name "
                      "or a list of names; result.outputs has every output)",
         help="bind the output the function writes with ctx.write(NAME, batch) to this notebook variable: a Spark "
              "DataFrame on --backend spark, a Ray Dataset on ray, a pyarrow Dataset otherwise; repeatable",
         doc="bind the output the function writes with `ctx.write(NAME, batch)` to this notebook variable once the run "
             "committed it: a Spark DataFrame (`spark.read.parquet`, never collected) on `--backend spark`, a Ray "
             "Dataset on `ray`, a pyarrow Dataset otherwise; repeatable (`result.outputs[NAME]` has every output, "
             "docs/data.md). `dtrain_magic.run` takes names, `outputs=[\"preds\"]`, and returns each as "
             "`result.tables[\"preds\"]`", default_doc="none"),
    # -- the cell --------------------------------------------------------------------------------------
    Flag(("--fn",), "fn", CELL, default=None, placeholder="NAME", entry_points=(MAGIC,),
         help="name of the function to ship (None means the last top-level def in the cell)",
         doc="the function to ship", default_doc="last top-level def"),
    Flag(("--result",), "result", CELL, default=None, placeholder="NAME", entry_points=(MAGIC,),
         help="also bind the RunResult to this notebook variable",
         doc="also bind the `RunResult` to this notebook variable"),
    # Never on an equivalent line: the line shown by --dry-run's plan and the panel is the one that launches.
    Flag(("--dry-run",), "dry_run", CELL, cheatsheet=True, kind=STORE_TRUE, default=False, line=NEVER,
         help="validate and show the plan, launch nothing",
         doc="validate, show the plan and the equivalent flag line; launch nothing"),
    # -- tracking and display --------------------------------------------------------------------------
    Flag(("--experiment",), "experiment", TRACKING, default=DEFAULT_EXPERIMENT, placeholder="NAME",
         help="MLflow experiment name", doc="MLflow experiment",
         panel=PanelControl(TEXT, "experiment", column=1)),
    Flag(("--tracking-uri",), "tracking_uri", TRACKING, default=None, placeholder="URI",
         help="MLflow tracking URI (None means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)",
         doc="MLflow tracking store", default_doc="`$MLFLOW_TRACKING_URI`, else `sqlite:///./mlflow.db`"),
    Flag(("--ui",), "ui", TRACKING, kind=SWITCH, off_options=("--no-ui",), default=None, resolved=True, line=ALWAYS,
         entry_points=(MAGIC, PYTHON),
         help="show the live panel (None means on in a notebook front-end)", off_help="plain text progress only",
         doc="live panel, or plain-text progress", default_doc="ui in a notebook front-end"),
    Flag(("--verbose",), "verbose", TRACKING, kind=STORE_TRUE, default=False,
         help="also show what the backends printed during the run (Spark's JVM, TorchDistributor, torchrun, Ray); "
              "it is always in the kernel's backend log and the MLflow run's logs/backend.txt",
         doc="also show the backends' own lines from the run (Spark's JVM, TorchDistributor, torchrun, Ray); "
             "otherwise only in the kernel's backend log and the MLflow run's `logs/backend.txt`, and their last "
             "lines in the cell when the run fails (docs/reliability.md)"),
    # The magic itself acts on it (shows the panel): no RunConfig field, never on a line.
    Flag(("--configure",), None, TRACKING, cheatsheet=True, kind=STORE_TRUE, default=False, line=NEVER,
         entry_points=(MAGIC,),
         help="show the configuration panel instead of running"),
    # -- Spark -----------------------------------------------------------------------------------------
    Flag(("--local-mode",), "local_mode", SPARK, kind=SWITCH, off_options=("--cluster",), default=True,
         help="run the processes on the driver node (TorchDistributor local_mode=True)",
         off_help="run the processes as barrier tasks on the executors (local_mode=False)",
         doc="Spark: processes on the driver, or barrier tasks on executors", default_doc="local mode"),
    Flag(("--spark-master",), "spark_master", SPARK, default=None, placeholder="URL",
         help="master URL for a new SparkSession when none is active",
         doc="master for a new SparkSession when none is active", default_doc="`local[*]`"),
    # -- Ray -------------------------------------------------------------------------------------------
    Flag(("--ray-address",), "ray_address", RAY, default=None, placeholder="ADDR",
         help="join this Ray cluster (None means $RAY_ADDRESS, else a local one)",
         doc="join an existing Ray cluster", default_doc="`$RAY_ADDRESS`, else a local Ray"),
    Flag(("--max-restarts",), "max_restarts", RAY, type=int, default=0, placeholder="N",
         help="restart failed workers up to N times, from the last checkpoint (local, spark, ray)"),
    Flag(("--storage",), "storage", RAY, default=None, placeholder="PATH",
         help="where numbered checkpoints go, under dtrain_<run key>; Ray Train's run storage "
              "(None means ./dtrain_runs)",
         doc="where `ctx.save_checkpoint()` puts numbered checkpoints (`<PATH>/dtrain_<run key>/`, every backend; "
             "the MLflow run's `dtrain_magic.checkpoint_root` tag and `RunResult.checkpoint_root` name it); "
             "Ray Train's run storage (ray also takes `s3://`, `gs://`)",
         default_doc="`./dtrain_runs`"),
    # A bare --resume is RESUME_LATEST; a value names the MLflow run (run(..., resume=True) is the bare flag).
    Flag(("--resume",), "resume", RAY, default=None, const=RESUME_LATEST, placeholder="[RUN_ID]",
         help="continue this cell's last unfinished run (or the MLflow run RUN_ID) from its newest complete checkpoint "
              "in --storage, into the same MLflow run, e.g. after the kernel died or was restarted",
         doc="continue this cell's last unfinished MLflow run (RUNNING, FAILED or KILLED; or the run `RUN_ID`) from "
             "its newest complete checkpoint in `--storage`, into the same MLflow run, after the kernel died or was "
             "restarted; none (or no checkpoint): a fresh run, said in the cell "
             "(see [resume](reliability.md#resume-in-a-new-kernel---resume))", default_doc="off"),
    # -- checkpoints, preemption, elasticity (docs/reliability.md) ------------------------------------------
    Flag(("--keep-checkpoints",), "keep_checkpoints", RELIABILITY, type=int, default=None, placeholder="K",
         help="keep only the newest K numbered checkpoints of ctx.save_checkpoint() (older ones removed once a newer "
              "one is complete; None means all)",
         doc="keep only the newest K numbered checkpoints (older ones removed once a newer one is complete)",
         default_doc="all"),
    Flag(("--preempt-grace",), "preempt_grace", RELIABILITY, type=seconds, default=DEFAULT_PREEMPT_GRACE_S,
         placeholder="S",
         help="local, spark: a SIGTERM to a worker (a preemption notice) makes every rank checkpoint at the next step "
              "boundary, within S seconds, then the run restarts from it when it may restart; 0: a SIGTERM stops it; "
              "ray: the notice is Ray draining a node (its deadline), 0 turns it off",
         doc="local, spark: a SIGTERM to a worker (the cloud's preemption notice) makes every rank checkpoint at "
             "the next optimizer step boundary within S seconds, then the run restarts (`--max-restarts`) or shrinks "
             "(`--elastic`) from it: no step lost; `0`: a SIGTERM stops the worker at once; ray: the notice is Ray "
             "draining a node of the run (the drain's deadline applies), `0` turns it off "
             "(see [preemption](reliability.md#preemption-notice))"),
    Flag(("--elastic",), "elastic", RELIABILITY, type=str, default=None, placeholder="MIN:MAX",
         help="local, ray: a run that loses workers (local: its processes; ray: its nodes) continues from its last "
              "checkpoint on the survivors if at least MIN remain (global batch kept through gradient "
              "accumulation); later restarts grow it back toward MAX",
         doc="local, ray: a run that loses workers (local: processes killed by a signal; ray: nodes that left the "
             "Ray) continues from its last checkpoint on the survivors if at least MIN remain, the global batch "
             "kept by recomputing gradient accumulation and `ctx.data` re-split from the checkpoint's sample "
             "position; later restarts grow it back toward MAX "
             "(see [elastic runs](reliability.md#elastic-runs---elastic-minmax))", default_doc="off"),
    # -- DeepSpeed -------------------------------------------------------------------------------------
    # JSON text nearly always has spaces or quotes that a reader would trip over: always quoted on a line.
    Flag(("--deepspeed-config",), "deepspeed_config", DEEPSPEED, default=None, quote_always=True,
         placeholder="JSON_OR_PATH", help="a DeepSpeed config (JSON text or path) merged over the flags",
         doc="a DeepSpeed config merged over the flags; conflicts are errors"),
    Flag(("--micro-batch",), "micro_batch", DEEPSPEED, type=int, default=None, placeholder="N",
         help="micro batch per process (DeepSpeed train_micro_batch_size_per_gpu)",
         doc="per-process batch (DeepSpeed `train_micro_batch_size_per_gpu`)"),
    Flag(("--train-batch",), "train_batch", DEEPSPEED, type=int, default=None, placeholder="N",
         help="global batch (DeepSpeed train_batch_size); must equal micro x grad-accum x processes",
         doc="global batch (DeepSpeed `train_batch_size`); must equal micro × grad-accum × processes"),
    # -- sweeps (docs/sweeps.md): the sweep's own options, no RunConfig field; --sweep sends the cell to a sweep ---
    # Not `python -m dtrain_magic run`'s (`... sweep` adds this group's rows); from Python, dtrain_magic.sweep()'s.
    Flag(("--sweep",), None, SWEEP, cheatsheet=True, default=None, line=NEVER, placeholder="SPACE",
         entry_points=(MAGIC, PYTHON),
         help="run the function once per trial of this space, e.g. \"lr=loguniform(1e-4,1e-1) batch=choice(16,32) "
              "zero=choice(2,3)\" (kinds: loguniform, uniform, int, choice, grid); run options set the trial's run, "
              "other names are ctx.params",
         doc="run the function once per trial of this space (`lr=loguniform(1e-4,1e-1) batch=choice(16,32)`; kinds "
             "`loguniform`, `uniform`, `int`, `choice`, `grid`): a run option's name (`zero`, `strategy`, `-n`'s "
             "`num_processes`) sets the trial's run, any other is `ctx.params[NAME]`; Optuna samples and prunes "
             "(docs/sweeps.md)"),
    Flag(("--trials",), None, SWEEP, type=int, default=None, line=NEVER, entry_points=(MAGIC, PYTHON), placeholder="N",
         help="how many trials the sweep's study holds (None means the grid's size with the grid sampler)",
         doc="how many trials the sweep's study holds (a resumed sweep runs only the rest)",
         default_doc="the grid's size (grid sampler); else needed"),
    Flag(("--metric",), None, SWEEP, default=None, line=NEVER, entry_points=(MAGIC, PYTHON), placeholder="NAME",
         help="the ctx.log metric the sweep compares and prunes on (its last value is the trial's)",
         doc="the `ctx.log` metric the sweep compares and prunes on (its last value is the trial's)",
         default_doc="needed with `--sweep`"),
    Flag(("--mode",), None, SWEEP, choices=("min", "max"), default="min", line=NEVER, entry_points=(MAGIC, PYTHON),
         help="whether the best trial has the lowest or highest --metric"),
    Flag(("--sampler",), None, SWEEP, choices=("auto", "tpe", "random", "grid"), default="auto", line=NEVER,
         entry_points=(MAGIC, PYTHON),
         help="Optuna's sampler (auto means grid when every word is grid(...), else tpe)",
         doc="Optuna's sampler: `tpe` (model-based), `random`, `grid` (a space of choice/grid words)",
         default_doc="grid when every word is `grid(...)`, else tpe"),
    Flag(("--pruner",), None, SWEEP, choices=("median", "halving", "none"), default="median", line=NEVER,
         entry_points=(MAGIC, PYTHON),
         help="Optuna's pruner, fed rank 0's --metric at each ctx.log: median, successive halving, or none",
         doc="Optuna's pruner, fed rank 0's `--metric` as it is logged: `median`, `halving` (successive halving), "
             "`none`; a pruned trial is stopped, status PRUNED"),
    Flag(("--parallel-trials",), None, SWEEP, type=count_or_auto, default="auto", line=NEVER, placeholder="N",
         entry_points=(MAGIC, PYTHON),
         help="trials at once (auto means the backend's capacity / processes per trial; local CPU: the cores)",
         doc="trials run at once, each its own run", default_doc="`auto`: the backend's capacity / processes per "
                                                                  "trial (local CPU runs: the cores)"),
    Flag(("--sweep-name",), None, SWEEP, default=None, line=NEVER, entry_points=(MAGIC, PYTHON), placeholder="NAME",
         help="keep the study in optuna.db beside the MLflow store under this name: the same name continues it "
              "(None means in memory, not resumable)",
         doc="keep the study in `optuna.db` beside the MLflow store: the same name continues it, finished trials "
             "are not run again", default_doc="in memory"),
    Flag(("--max-failed-trials",), None, SWEEP, type=int, default=3, line=NEVER, placeholder="N",
         entry_points=(MAGIC, PYTHON),
         help="stop the sweep once this many trials failed",
         doc="stop the sweep (every trial) once N trials failed"),
)

BY_FIELD: dict[str, Flag] = {row.field: row for row in FLAGS if row.field is not None}


def panel_rows() -> tuple[Flag, ...]:
    """The rows the ``--configure`` panel shows, in table order."""
    return tuple(row for row in FLAGS if row.panel is not None)
