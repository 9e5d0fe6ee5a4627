"""The batch arithmetic DeepSpeed insists on: global batch = per-process batch x accumulation x world size.

`RunConfig` checks it on the flags, and `strategies.deepspeed.build_config` again on the DeepSpeed config they build
with ``--deepspeed-config`` merged in. It lives apart from both so that the strategy never imports the config (the
config reads the strategies' facts: that would be a circle).
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
