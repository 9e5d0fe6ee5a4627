"""DeepSpeed's undocumented parameter attributes, written against DeepSpeed 0.19 (constraints.txt: 0.19.8).

ZeRO-3 replaces each parameter's data by an empty partition and records what it was on the parameter itself;
DeepSpeed documents no accessor for that. Both uses fall back, so no DeepSpeed version is refused:

- `is_partitioned`: ``param.ds_id``, set on every ZeRO-3 parameter (``strategies/deepspeed.py``'s
  ``full_state_dict``, for a ZeRO-3 parameter without an fp32 master, i.e. no optimizer). **Fallback** when
  missing: the parameter's local data, as for ZeRO 0-2 (empty under ZeRO-3).
- `full_shape`: ``param.ds_shape``, a ZeRO-3 parameter's whole shape (``memory.py``, counting a model's
  parameters). **Fallback** when missing: its local size (0 under ZeRO-3: the estimate then counts too few).
- `local_partition`: ``param.ds_tensor`` (this rank's flat partition, ``ds_tensor.ds_numel`` elements long) and
  ``param.ds_numel`` (the whole parameter's), so that sharded loading (``weights/loading.py``) writes a ZeRO-3
  parameter's partition from the slice of the checkpoint it covers. **Fallback** when missing: the parameter is
  gathered with the public ``deepspeed.zero.GatheredParameters`` and rank 0 writes it whole (every rank holds that one
  parameter for the moment, and rank 0 reads it all).

Everything else (``deepspeed.initialize``, the engine, ``deepspeed.utils.safe_get_full_fp32_param``,
``deepspeed.zero.GatheredParameters``, ``get_accelerator().create_op_builder``) is public.
"""

from __future__ import annotations

from typing import Any

from . import Library

DEEPSPEED = Library(key="deepspeed", title="DeepSpeed", module="deepspeed", known=("0.19",), tested="0.19.8",
                    requirement="deepspeed==0.19.8")


def is_partitioned(param: Any) -> bool:
    """True for a parameter ZeRO-3 has partitioned."""
    return hasattr(param, "ds_id")


def full_shape(param: Any) -> tuple[int, ...] | None:
    """The whole shape of a ZeRO-3 partitioned parameter; None for any other."""
    shape = getattr(param, "ds_shape", None)
    return None if shape is None else tuple(int(d) for d in shape)


def local_partition(param: Any, rank: int) -> tuple[Any, int, int] | None:
    """This rank's part of a ZeRO-3 parameter: (its flat partition tensor, the first element of the flattened
    parameter it holds, how many it holds; the tail of the last partition is padding); None if unknown."""
    part, numel = getattr(param, "ds_tensor", None), getattr(param, "ds_numel", None)
    if part is None or numel is None:
        return None
    size = int(getattr(part, "ds_numel", part.numel()))
    start = size * rank
    return part, start, max(0, min(size, int(numel) - start))
