"""The batch arithmetic DeepSpeed insists on: global batch = micro batch x grad accumulation x world size.

Checked in the notebook twice over, each time before launch: on the flags alone (`RunConfig`), and on the
DeepSpeed config they build with ``--deepspeed-config`` merged in (`strategies.deepspeed.build_config`).
"""

from __future__ import annotations

from .errors import ConfigError


def check_batch_arithmetic(train: int | None, micro: int | None, accum: int, world: int) -> None:
    """Raise a `ConfigError` on ``--train-batch`` naming the numbers and the fix unless ``train`` (global batch)
    equals ``micro`` (per process) x ``accum`` x ``world``; nothing to check while either batch is unknown."""
    if train is None or micro is None:
        return
    expected = micro * accum * world
    if train != expected:
        raise ConfigError(
            "--train-batch",
            f"train_batch_size {train} != micro_batch_per_gpu {micro} x gradient_accumulation_steps {accum} x "
            f"world_size {world} (= {expected}); set --train-batch {expected} (train_batch_size in a DeepSpeed "
            "config), or change --micro-batch (train_micro_batch_size_per_gpu), --grad-accum or --num-processes "
            "so the product matches",
        )
