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

- `saved_dp_world`, `to_universal`, `loading_universal`: a ZeRO checkpoint written on another number of ranks (an
  ``--elastic`` resize) loads through DeepSpeed's universal checkpoint: its own conversion (the ``ds_to_universal``
  command line's ``main``, given the arguments its parser would make) and ``checkpoint.load_universal``, which the
  engine reads from its config object (``engine._config``) at load time, set for that one load. The files' names
  (``*zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt``) say how many ranks wrote a checkpoint. **No fallback**: the
  resized run fails with DeepSpeed's error at ``ctx.load_checkpoint()``.

Everything else (``deepspeed.initialize``, the engine, ``deepspeed.utils.safe_get_full_fp32_param``,
``deepspeed.zero.GatheredParameters``, ``get_accelerator().create_op_builder``) is public.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any, Iterator

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


def share_fp32_partitions(optimizer: Any) -> int:
    """Step ZeRO-3's fp32 partitions in place when the parameter partitions are fp32 already; the bytes freed.

    DeepSpeed 0.19's stage-3 optimizer means to skip its fp32 "master" copy when the flat parameter partitions have
    the master dtype and device (``_create_fp32_partitions``: "we don't need another copy of the weights"), but it
    compares the partition's ``torch.device`` with the accelerator's device *name*, a ``str``, which is never equal:
    an fp32 run kept a clone of every partition (Ψ/N × 4 bytes per rank). Before any step (no optimizer state yet),
    each sub-group's clone is replaced by the partition it was cloned from, as DeepSpeed's own branch would have
    done. Uses ``fp32_partitioned_groups_flat`` and ``fp16_partitioned_groups_flat`` (DeepSpeed's
    ``DeepSpeedZeroOptimizer_Stage3``). **Fallback**: anything unexpected (another optimizer, offload, a group
    already shared, optimizer state, a clone that differs from its partition) leaves that group as DeepSpeed made
    it: the run is right, only the copy stays."""
    import torch

    hp_groups = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    lp_groups = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(hp_groups, list) or not isinstance(lp_groups, list) or len(hp_groups) != len(lp_groups):
        return 0
    if getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "swap_optimizer", True):
        return 0
    state = getattr(inner, "state", None)
    if state is None:
        return 0
    freed = 0
    for index, (hp, lp) in enumerate(zip(hp_groups, lp_groups, strict=True)):  # lengths checked above
        if not isinstance(hp, torch.Tensor) or not isinstance(lp, torch.Tensor) or hp is lp:
            continue
        if (hp.dtype != lp.dtype or hp.device != lp.device or hp.shape != lp.shape or hp.grad is not None
                or hp.data_ptr() == lp.data_ptr() or hp in state or not torch.equal(hp, lp)):
            continue
        if hasattr(hp, "ds_id"):
            lp.ds_id = hp.ds_id
        lp.requires_grad = True  # as DeepSpeed marks its fp32 groups ("in case internal optimizer uses it")
        hp_groups[index] = lp
        freed += hp.numel() * hp.element_size()
    return freed


_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_dp_world(folder: str) -> int | None:
    """How many data-parallel ranks wrote the ZeRO checkpoint in ``folder`` (one DeepSpeed tag): its ranks' optimizer
    partition files. None without any (ZeRO-0: whole states, which load on any number of ranks)."""
    ranks = {m.group(1) for name in os.listdir(folder) if (m := _OPTIM_FILE.search(name))}
    return len(ranks) or None


def to_universal(folder: str, output: str) -> None:
    """Convert the checkpoint in ``folder`` into a universal one in ``output`` (loadable on any number of ranks), in
    this process (one worker: no process pool inside a training rank), DeepSpeed's printing and progress bars kept
    out of the cell."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(input_folder=folder, output_folder=output, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)


@contextlib.contextmanager
def loading_universal(engine: Any) -> Iterator[None]:
    """``engine.load_checkpoint`` inside reads a universal checkpoint (``checkpoint.load_universal``, for this load)."""
    settings = engine._config
    before = settings.load_universal_checkpoint
    settings.load_universal_checkpoint = True
    try:
        yield
    finally:
        settings.load_universal_checkpoint = before
