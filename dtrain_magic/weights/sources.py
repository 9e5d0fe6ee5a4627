"""Where weights come from: the local checkpoint ``ctx.prepare(..., weights=PATH)`` names.

`open_weights` recognises, from the path alone:

- **safetensors**: a ``.safetensors`` file; a directory holding ``model.safetensors``, or the shards a
  ``model.safetensors.index.json`` names (a Hugging Face model directory), or any ``*.safetensors`` files; the
  index file itself;
- **a torch state-dict file**: ``.pt``/``.pth``/``.bin`` (or a dict holding one under ``"model"``, ``"state_dict"``
  or ``"module"``, as ``ctx.save_checkpoint`` under DDP writes ``checkpoint.pt``), a Hugging Face
  ``pytorch_model.bin`` or its ``.index.json``, or a directory with one of those;
- **the run's own sharded checkpoint**: a ``torch.distributed.checkpoint`` directory (``.metadata``), as
  ``ctx.save_checkpoint`` writes under FSDP, ``--tp`` and ``--pp``; its model part is read.

A source lists its tensors (`names`, `shape`) from the files' headers, and reads a region of one tensor
(`read(name, index)`) without reading the rest: safetensors' ``get_slice`` (the file memory-mapped for that one read),
a torch file loaded with ``mmap=True`` (mapped while the load lasts: the pages a rank reads count in its resident
memory until then, so safetensors gives the lower peak). A missing path, an index naming a missing shard, or a file
that is neither format is a `WeightsError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch

from ..errors import WeightsError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
RUN_CHECKPOINT = "checkpoint.pt"  # ctx.save_checkpoint under DDP
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint
_TORCH_WRAPPERS = ("model", "state_dict", "module")  # a state dict kept under one of these keys
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
ACCEPTED = ("a .safetensors file or a directory of them (a Hugging Face model directory, or its "
            "model.safetensors.index.json), a torch state-dict file (.pt, .pth, .bin), or a checkpoint "
            "ctx.save_checkpoint wrote")

Index = tuple[slice, ...]


class WeightSource(ABC):
    """A checkpoint's tensors: their names and shapes, and regions of them on demand."""

    kind: str

    def __init__(self, path: str):
        self.path = path

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor's name, as the model's ``state_dict`` keys would be."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        ...

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype:
        ...

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, Index], torch.Tensor]]:
        """Yields ``read(name, index)``: the region ``index`` (a tuple of slices) of tensor ``name``, valid inside the
        ``with``. Read names in `order` (each file is then opened once, and mapped only while its reads last)."""
        raise WeightsError(f"weights={self.path!r} ({self.kind}) cannot be read region by region here; "
                           "save the weights as safetensors (ctx.save_weights) to load them into this model")
        yield  # pragma: no cover

    def order(self, names: list[str]) -> list[str]:
        """``names`` in the order they are best read (grouped by file)."""
        return list(names)

    def describe(self) -> str:
        return f"{self.path} ({self.kind}, {len(self.names())} tensors)"


class SafetensorsSource(WeightSource):
    """One or more safetensors files; each tensor's file, shape and dtype come from the files' headers."""

    kind = "safetensors"

    def __init__(self, path: str, files: list[str]):
        super().__init__(path)
        from safetensors import safe_open

        self.file_of: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        part = handle.get_slice(name)
                        self.file_of[name] = file
                        self._shapes[name] = tuple(int(d) for d in part.get_shape())
                        self._dtypes[name] = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
            except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises SafetensorError (an OSError)
                raise WeightsError(f"weights={path!r}: {file} is not a readable safetensors file ({exc})") from None

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, Index], torch.Tensor]]:
        from safetensors import safe_open

        def read(name: str, index: Index) -> torch.Tensor:
            # The file is memory-mapped for this one read only: the pages a read touches count in the process's
            # resident memory while they are mapped, and a mapping held across reads would add up to every page
            # this rank reads (half the file for 2 ranks) on top of the shards it fills. Opening costs the header.
            with safe_open(self.file_of[name], framework="pt") as handle:
                return handle.get_slice(name)[index]

        yield read

    def order(self, names: list[str]) -> list[str]:
        """``names`` grouped by file (each file opened once when read in this order)."""
        files = list(dict.fromkeys(self.file_of[n] for n in names))
        return sorted(names, key=lambda n: files.index(self.file_of[n]))


class TorchFileSource(WeightSource):
    """One or more torch state-dict files, loaded memory-mapped (``mmap=True``): a region read touches only its
    pages. A file in torch's legacy (non-zip) format cannot be mapped and is read whole."""

    kind = "torch state dict"

    def __init__(self, path: str, files: list[str]):
        super().__init__(path)
        self.state: dict[str, torch.Tensor] = {}
        for file in files:
            self.state.update(_torch_state(path, file))

    def names(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, Index], torch.Tensor]]:
        yield lambda name, index: self.state[name][index]


class DistributedCheckpointSource(WeightSource):
    """A ``torch.distributed.checkpoint`` directory; ``prefix``: ``"model"`` when the model's tensors sit under that
    key, as ``ctx.save_checkpoint`` saves them beside the optimizer's."""

    kind = "torch.distributed.checkpoint"

    def __init__(self, path: str):
        super().__init__(path)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:
            raise WeightsError(f"weights={path!r}: cannot read its torch.distributed.checkpoint metadata "
                               f"({type(exc).__name__}: {exc})") from None
        tensors = {key: md for key, md in metadata.state_dict_metadata.items()
                   if isinstance(md, TensorStorageMetadata)}
        self.prefix = "model" if any(key.startswith("model.") for key in tensors) else ""
        self._tensors = {}
        for key, md in tensors.items():
            if self.prefix:
                if not key.startswith("model."):
                    continue  # the optimizer's state
                key = key[len("model."):]
            self._tensors[key] = md

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._tensors[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].properties.dtype


def _torch_state(path: str, file: str) -> dict[str, torch.Tensor]:
    """The state dict in the torch file ``file`` (memory-mapped when torch can), unwrapped from a checkpoint dict."""
    try:
        try:
            loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
            loaded = torch.load(file, map_location="cpu", weights_only=True)  # legacy format: read whole
    except Exception as exc:
        raise WeightsError(f"weights={path!r}: {file} is neither a safetensors nor a torch file torch.load can read "
                           f"with weights_only=True ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if isinstance(loaded, dict):
        for key in _TORCH_WRAPPERS:
            inner = loaded.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
        tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) == len(loaded):
            return tensors
    raise WeightsError(f"weights={path!r}: {file} holds a {type(loaded).__name__}, not a state dict (a dict of "
                       f"tensors, or one under {', '.join(repr(k) for k in _TORCH_WRAPPERS)})")


def _index_files(path: str, index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"weights={path!r}: {index} is not a checkpoint index (a JSON object with a "
                           f"'weight_map'): {exc}") from None
    folder = os.path.dirname(index)
    files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise WeightsError(f"weights={path!r}: {os.path.basename(index)} names {len(missing)} shard(s) that do not "
                           f"exist: {', '.join(missing[:5])}")
    return files


def open_weights(path: str | os.PathLike) -> WeightSource:
    """The `WeightSource` at ``path`` (see the module docstring); a `WeightsError` when there is none."""
    text = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(text):
        raise WeightsError(f"weights={os.fspath(path)!r}: no such file or directory (expected {ACCEPTED})")
    if os.path.isdir(text):
        return _open_directory(os.fspath(path), text)
    if text.endswith(".safetensors"):
        return SafetensorsSource(text, [text])
    if text.endswith(".index.json"):
        files = _index_files(text, text)
        if all(f.endswith(".safetensors") for f in files):
            return SafetensorsSource(text, files)
        return TorchFileSource(text, files)
    return TorchFileSource(text, [text])


def _open_directory(given: str, folder: str) -> WeightSource:
    if os.path.exists(os.path.join(folder, DCP_METADATA)):
        return DistributedCheckpointSource(folder)
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.exists(index):
        return SafetensorsSource(folder, _index_files(given, index))
    single = os.path.join(folder, SAFETENSORS_FILE)
    if os.path.exists(single):
        return SafetensorsSource(folder, [single])
    entries = sorted(os.listdir(folder))
    shards = [os.path.join(folder, e) for e in entries if e.endswith(".safetensors")]
    if shards:
        return SafetensorsSource(folder, shards)
    index = os.path.join(folder, TORCH_INDEX)
    if os.path.exists(index):
        return TorchFileSource(folder, _index_files(given, index))
    for name in (TORCH_FILE, RUN_CHECKPOINT):
        if os.path.exists(os.path.join(folder, name)):
            return TorchFileSource(folder, [os.path.join(folder, name)])
    shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "") if entries else "nothing"
    raise WeightsError(f"weights={given!r}: the directory holds no checkpoint (expected {ACCEPTED}); it holds "
                       f"{shown}")
