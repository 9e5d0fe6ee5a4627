"""Saving without gathering on every rank: the whole model streamed to rank 0, one tensor at a time.

A strategy's ``stream_full_state()`` yields ``(name, tensor)`` for every state-dict key of the plain model, in the
plain model's layout and in fp32; the tensor is there on rank 0 only (None elsewhere). Each item is a collective
(FSDP's or tensor parallel's all-gather of that one tensor, ZeRO's gather of its fp32 partitions, a pipeline stage
sending it to rank 0), so every rank iterates the whole stream and the other ranks hold one tensor at a time.

`write_safetensors` writes that stream as Hugging Face does (``save_pretrained``): ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` of at most ``max_shard_bytes`` each with ``model.safetensors.index.json``; a
tensor tied to another is written once, under its first name. Rank 0 holds at most one shard. The files load into
the plain model (``safetensors.torch.load_file`` per shard, then ``load_state_dict``), into a Hugging Face model
(``from_pretrained``), and into a sharded run (``ctx.prepare(..., weights=DIR)``).
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from .sources import SAFETENSORS_FILE, SAFETENSORS_INDEX

DEFAULT_SHARD_BYTES = 2 * 1024**3


def collect(stream: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """The whole stream as a state dict on rank 0 (every rank must iterate it); ``{}`` on the other ranks."""
    return {name: tensor for name, tensor in stream if tensor is not None}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors that share storage (a view into a flat buffer): such a one is copied."""
    tensor = tensor.detach().contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def write_safetensors(directory: str, stream: Iterable[tuple[str, torch.Tensor | None]], is_writer: bool,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write ``stream`` under ``directory`` (see the module docstring); every rank iterates it, ``is_writer`` (rank
    0) writes. Returns the files written (on the writer; ``[]`` elsewhere)."""
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"ctx.save_weights: max_shard_bytes must be positive, got {max_shard_bytes}")
    if is_writer:
        os.makedirs(directory, exist_ok=True)
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0
    seen: dict[int, weakref.ref] = {}  # weak: a written tensor's id may be reused once it is freed

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, os.path.join(directory, f".part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(shard))
            shard, size = {}, 0

    for name, tensor in stream:
        if tensor is None or not is_writer:
            continue
        earlier = seen.get(id(tensor))
        if earlier is not None and earlier() is tensor:
            continue  # a tied tensor, yielded again under another name as the same object: written once
        seen[id(tensor)] = weakref.ref(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = _own_storage(tensor)
        size += nbytes
    if not is_writer:
        return []
    flush()
    return _name_shards(directory, shards)


def write_model_config(directory: str, model: Any) -> list[str]:
    """Beside the weights, the model's own Hugging Face config (``config.json``, and ``generation_config.json`` where
    it has one), so that ``from_pretrained(directory)`` loads them; nothing for a model without one. Returns the files
    written."""
    written = []
    for attribute, file_name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        config = getattr(model, attribute, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(directory)
            written.append(os.path.join(directory, file_name))
    return written


def _name_shards(directory: str, shards: list[list[str]]) -> list[str]:
    """The temporary part files renamed as Hugging Face names them (their count is known only at the end)."""
    if not shards:  # a model without tensors: an empty file still loads
        from safetensors.torch import save_file

        save_file({}, os.path.join(directory, SAFETENSORS_FILE))
        return [os.path.join(directory, SAFETENSORS_FILE)]
    if len(shards) == 1:
        final = [SAFETENSORS_FILE]
    else:
        final = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in (SAFETENSORS_FILE, SAFETENSORS_INDEX):
        if os.path.exists(os.path.join(directory, stale)) and stale not in final:
            os.remove(os.path.join(directory, stale))  # a single file and an index would both claim the model
    paths = []
    for i, name in enumerate(final):
        os.replace(os.path.join(directory, f".part-{i:05d}.safetensors"), os.path.join(directory, name))
        paths.append(os.path.join(directory, name))
    if len(shards) > 1:
        weight_map = {key: final[i] for i, keys in enumerate(shards) for key in keys}
        total = sum(os.path.getsize(p) for p in paths)
        with open(os.path.join(directory, SAFETENSORS_INDEX), "w", encoding="utf-8") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
        paths.append(os.path.join(directory, SAFETENSORS_INDEX))
    return paths


def tied_ids(state: dict[str, torch.Tensor]) -> set[int]:
    """Ids of the tensors that appear under more than one name in ``state`` (tied parameters): a stream gathers
    each once and yields the same object for every name."""
    counts: dict[int, int] = {}
    for tensor in state.values():
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    return {key for key, count in counts.items() if count > 1}


def stream(state: Mapping[str, Any], gather: Callable[[Any], torch.Tensor], keep: bool,
           include: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(key, whole tensor on the CPU)`` for each entry of ``state`` (``keep``: this rank keeps it; else None):
    ``gather`` turns an entry into the whole tensor (a collective for shards, called on every rank); a tensor under
    several keys is gathered once and yielded as the same object. ``include``: only the keys it accepts (the same on
    every rank), the others never gathered."""
    if include is not None:
        state = {key: value for key, value in state.items() if include(key)}
    tied, done = tied_ids(dict(state)), {}
    for key, value in state.items():
        if id(value) in done:
            yield key, done[id(value)]
            continue
        whole = gather(value)
        out = whole.detach().cpu() if keep else None
        del whole  # not alive beside the next tensor's gather
        if id(value) in tied:
            done[id(value)] = out
        yield key, out
