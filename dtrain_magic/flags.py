"""The ``%%distribute`` flags (IPython ``magic_arguments``) and their translation into a `RunConfig`."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import (
    MagicHelpFormatter,
    argument,
    argument_group,
    kwds,
    magic_arguments,
    parse_argstring,
)

from .config import (
    BACKENDS,
    DEFAULT_EXPERIMENT,
    PP_SCHEDULES,
    PRECISIONS,
    STRATEGIES,
    ZERO_STAGES,
    RunConfig,
    cuda_available,
    detect_backend,
)

USAGE_EXAMPLE = """\
Run the cell's training function on several processes, GPUs or nodes.

The whole cell runs in the notebook first; then its last top-level function (or the one named by --fn)
is shipped to every worker and called as fn(ctx) (or fn() if it takes no parameter). The cell's value
is a RunResult: .value (rank 0's return), .values (every rank's), .run_id (MLflow), .metrics.

Example::

    %%distribute --backend local --strategy ddp -n 2 --no-ui
    def train(ctx):
        model, opt = ctx.prepare(make_model(), make_opt())
        ...
"""


class _HelpFormatter(MagicHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """IPython's magic help layout, plus "(default: ...)" after every flag."""


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None


@magic_arguments()
@kwds(formatter_class=_HelpFormatter, description=USAGE_EXAMPLE)
@argument_group("Where and how")
@argument("--backend", choices=BACKENDS, default="auto",
          help="auto: spark with an active SparkSession, ray when Ray is initialised, else local")
@argument("--strategy", choices=STRATEGIES, default=None,
          help="parallelism strategy (None means ddp, or deepspeed when --zero is given)")
@argument("--zero", type=int, choices=ZERO_STAGES, default=None, help="DeepSpeed ZeRO stage (implies --strategy deepspeed)")
@argument("--precision", choices=PRECISIONS, default="fp32", help="numeric precision of training")
@argument("-n", "--num-processes", "--num-workers", dest="num_processes", type=int, default=None,
          help="number of worker processes (None means one per GPU with --gpu, else 2)")
@argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
          help="one GPU per process (None means GPU when CUDA is available)")
@argument("--cpu", dest="gpu", action="store_const", const=False, help="train on CPU even if CUDA is available")
@argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
@argument("--seed", type=int, default=None, help="seed torch/numpy/random on every rank before calling the function")
@argument("--timeout", type=_seconds, default=None, help="fail the run (and stop every worker) after this many seconds")
@argument_group("Model parallelism")
@argument("--tp", type=int, default=1,
          help="tensor-parallel degree: each layer's weights split over this many processes (ddp, fsdp)")
@argument("--pp", type=int, default=1, help="pipeline stages: the model split into this many consecutive parts (ddp, fsdp)")
@argument("--microbatches", type=int, default=None,
          help="micro-batches per pipeline step with --pp (None means 2 x --pp)")
@argument("--pp-schedule", choices=PP_SCHEDULES, default="gpipe", help="pipeline schedule with --pp")
@argument_group("The cell")
@argument("--fn", default=None, help="name of the function to ship (None means the last top-level def in the cell)")
@argument("--result", default=None, help="also bind the RunResult to this notebook variable")
@argument("--dry-run", action="store_true", default=False, help="validate and show the plan, launch nothing")
@argument_group("Tracking and display")
@argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
@argument("--tracking-uri", default=None,
          help="MLflow tracking URI (None means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
@argument("--ui", dest="ui", action="store_const", const=True, default=None,
          help="show the live panel (None means on in a notebook front-end)")
@argument("--no-ui", dest="ui", action="store_const", const=False, help="plain text progress only")
@argument("--configure", action="store_true", default=False, help="show the configuration panel instead of running")
@argument_group("Spark (TorchDistributor)")
@argument("--local-mode", dest="local_mode", action="store_const", const=True, default=True,
          help="run the processes on the driver node (TorchDistributor local_mode=True)")
@argument("--cluster", dest="local_mode", action="store_const", const=False,
          help="run the processes as barrier tasks on the executors (local_mode=False)")
@argument("--spark-master", default=None, help="master URL for a new SparkSession when none is active")
@argument_group("Ray (TorchTrainer)")
@argument("--ray-address", default=None, help="join this Ray cluster (None means $RAY_ADDRESS, else a local one)")
@argument("--max-restarts", type=int, default=0, help="restart failed workers up to N times (ray, local)")
@argument("--storage", default=None,
          help="where numbered checkpoints go, under dtrain_<run key>; Ray Train's run storage (None means ./dtrain_runs)")
@argument_group("DeepSpeed and batch arithmetic")
@argument("--deepspeed-config", default=None, help="a DeepSpeed config (JSON text or path) merged over the flags")
@argument("--micro-batch", type=int, default=None, help="micro batch per process (DeepSpeed train_micro_batch_size_per_gpu)")
@argument("--train-batch", type=int, default=None,
          help="global batch (DeepSpeed train_batch_size); must equal micro x grad-accum x processes")
def distribute(line: str, cell: str | None = None) -> None:  # pragma: no cover - holder of the parser only
    """Placeholder whose decorators define the flags; the real magic lives in dtrain_magic.magic."""


HELP: str = distribute.__doc__ or ""


def _unquote(value: Any) -> Any:
    # IPython splits magic lines without POSIX quote removal: `--experiment 'my exp'` keeps its quotes.
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_line(line: str) -> argparse.Namespace:
    """Parse the magic's line; argparse errors become IPython ``UsageError`` naming the flag."""
    try:
        args = parse_argstring(distribute, line)
    except UsageError as exc:
        message = str(exc)
        if not message.startswith("unrecognized arguments"):
            raise
        raise UsageError(message + _unknown_flag_hint(message)) from None
    for key, value in vars(args).items():
        setattr(args, key, _unquote(value))
    return args


def _unknown_flag_hint(message: str) -> str:
    """"; did you mean --x?" for near-misses, then where every flag is listed."""
    known = [opt for action in distribute.parser._actions for opt in action.option_strings]
    guesses = []
    for word in message.partition(":")[2].split():
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.75)
            if close and close[0] not in guesses:
                guesses.append(close[0])
    hint = f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    return f"{hint}; see %%distribute? for every flag"


def config_from_args(
    args: argparse.Namespace,
    *,
    gpu_available: Callable[[], bool] = cuda_available,
    backend_detector: Callable[[], str] = detect_backend,
    in_frontend: bool = False,
    gpu_count: Callable[[], int] | None = None,
) -> RunConfig:
    """Resolve the defaults that depend on the environment and build the validated `RunConfig`."""
    use_gpu = gpu_available() if args.gpu is None else args.gpu
    strategy = args.strategy or ("deepspeed" if args.zero is not None else "ddp")
    num_processes = args.num_processes
    if num_processes is None:
        count = (gpu_count or _cuda_device_count)() if use_gpu else 0
        num_processes = count if count > 0 else 2
    backend = backend_detector() if args.backend == "auto" else args.backend
    values: dict[str, Any] = dict(
        backend=backend,
        strategy=strategy,
        zero=args.zero,
        precision=args.precision,
        num_processes=num_processes,
        use_gpu=use_gpu,
        grad_accum=args.grad_accum,
        fn=args.fn,
        result=args.result,
        experiment=args.experiment,
        tracking_uri=args.tracking_uri,
        ui=in_frontend if args.ui is None else args.ui,
        dry_run=args.dry_run,
        seed=args.seed,
        timeout=args.timeout,
        local_mode=args.local_mode,
        spark_master=args.spark_master,
        ray_address=args.ray_address,
        max_restarts=args.max_restarts,
        storage=args.storage,
        deepspeed_config=args.deepspeed_config,
        micro_batch=args.micro_batch,
        train_batch=args.train_batch,
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        pp_schedule=args.pp_schedule,
    )
    return RunConfig(**values)


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def config_from_line(line: str, **kwargs: Any) -> RunConfig:
    """``%%distribute`` line → `RunConfig` (parse, resolve defaults, validate)."""
    return config_from_args(parse_line(line), **kwargs)
