"""What the workers are handed for each data source (`StagedSource`): its rows as *blocks*, read where they are.

- `ParquetBlocks`: the row groups of Parquet files (a path the user gave, or what Spark or Ray Data wrote once);
  a rank opens only the files of its row groups and decodes only those row groups.
- `ArrowFileBlocks`: the record batches of an Arrow IPC file written once from a notebook object; memory-mapped
  when it is a local file, so every rank on this machine shares the same pages.
- `ObjectStoreBlocks`: an Arrow table put once in Ray's object store; each rank gets it without a copy on its
  node and reads slices of it.
- `TrainerDataset`: a Ray Dataset handed to Ray Train (``TorchTrainer(datasets=...)``); each rank reads
  ``ray.train.get_dataset_shard(name)``. The Dataset object itself stays in the notebook
  (`without_trainer_datasets`).

These are small, picklable descriptions: what travels in the `WorkerJob` is where the rows are, never the rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa


class Blocks:
    """A source's rows as blocks of rows, each readable on its own."""

    block_rows: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.block_rows)

    @property
    def block_offsets(self) -> tuple[int, ...]:
        """The natural index of each block's first row (blocks read one after the other)."""
        offsets, total = [], 0
        for count in self.block_rows:
            offsets.append(total)
            total += count
        return tuple(offsets)

    def read(self, index: int, columns: Sequence[str]) -> pa.Table:
        """Block ``index`` with ``columns``."""
        raise NotImplementedError

    def describe(self) -> str:
        """Where the rows are, in words."""
        raise NotImplementedError

    def __getstate__(self) -> dict:  # open files and fetched tables stay in the process that opened them
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def _filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


@dataclass
class ParquetBlocks(Blocks):
    """Row groups of Parquet files: ``groups[i]`` is (index into ``files``, row group), ``block_rows[i]`` its rows."""

    files: tuple[str, ...]
    groups: tuple[tuple[int, int], ...]
    block_rows: tuple[int, ...]
    origin: str = "Parquet files"

    def _file(self, index: int) -> Any:
        import pyarrow.parquet as pq

        opened = self.__dict__.setdefault("_opened", {})
        if index not in opened:
            path = self.files[index]
            if "://" in path:
                fs, inner = _filesystem(path)
                opened[index] = pq.ParquetFile(fs.open_input_file(inner))
            else:
                opened[index] = pq.ParquetFile(path, memory_map=True)
        return opened[index]

    def read(self, index: int, columns: Sequence[str]) -> pa.Table:
        file_index, group = self.groups[index]
        return self._file(file_index).read_row_group(group, columns=list(columns))

    def describe(self) -> str:
        return f"{self.origin}: {len(self.files)} file(s), {len(self.groups)} row group(s)"


def parquet_blocks(files: Sequence[str], origin: str) -> tuple[ParquetBlocks, pa.Schema]:
    """The row groups of ``files`` (read from their footers) and their common schema; a `ValueError` naming the
    first file whose schema differs."""
    import pyarrow.parquet as pq

    groups, rows = [], []
    schema = None
    for index, path in enumerate(files):
        if "://" in path:
            fs, inner = _filesystem(path)
            with fs.open_input_file(inner) as handle:
                meta = pq.ParquetFile(handle).metadata
                file_schema = meta.schema.to_arrow_schema()
        else:
            meta = pq.read_metadata(path)
            file_schema = meta.schema.to_arrow_schema()
        file_schema = file_schema.remove_metadata()
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            raise ValueError(f"{path} has another schema than {files[0]} ({file_schema} vs {schema}): every file of a "
                             "source must have the same columns and types")
        for group in range(meta.num_row_groups):
            count = meta.row_group(group).num_rows
            if count:
                groups.append((index, group))
                rows.append(count)
        _check_nulls(meta, path)
    return ParquetBlocks(tuple(files), tuple(groups), tuple(rows), origin), schema or pa.schema([])


def _check_nulls(meta: Any, path: str) -> None:
    """Missing values, from the footer's statistics (when the writer kept them): no tensor holds a null."""
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        for index in range(row_group.num_columns):
            column = row_group.column(index)
            stats = column.statistics
            if stats is not None and stats.has_null_count and stats.null_count:
                raise ValueError(f"{path}: column {column.path_in_schema!r} has {stats.null_count} missing value(s) "
                                 "(nulls): fill or drop them first")


@dataclass
class ArrowFileBlocks(Blocks):
    """The record batches of an Arrow IPC file (``path``: a local path, memory-mapped, or a URI)."""

    path: str
    block_rows: tuple[int, ...]

    def _reader(self) -> Any:
        reader = self.__dict__.get("_reader_")
        if reader is None:
            if "://" in self.path:
                fs, inner = _filesystem(self.path)
                source = fs.open_input_file(inner)
            else:
                source = pa.memory_map(self.path, "r")
            reader = self.__dict__["_reader_"] = pa.ipc.open_file(source)
        return reader

    def read(self, index: int, columns: Sequence[str]) -> pa.Table:
        return pa.Table.from_batches([self._reader().get_batch(index)]).select(list(columns))

    def describe(self) -> str:
        return f"an Arrow file ({'memory-mapped' if '://' not in self.path else 'read'} by each rank)"


@dataclass
class ObjectStoreBlocks(Blocks):
    """An Arrow table in Ray's object store (``ref``), read as slices of ``block_size`` rows."""

    ref: Any
    block_size: int
    block_rows: tuple[int, ...]

    def read(self, index: int, columns: Sequence[str]) -> pa.Table:
        table = self.__dict__.get("_table")
        if table is None:
            import ray

            table = self.__dict__["_table"] = ray.get(self.ref)
        return table.slice(index * self.block_size, self.block_rows[index]).select(list(columns))

    def describe(self) -> str:
        return "Ray's object store (each rank fetches it once, without a copy on its own node)"


@dataclass
class TrainerDataset(Blocks):
    """A Ray Dataset Ray Train splits among the ranks (``ray.train.get_dataset_shard(name)``)."""

    dataset: Any = None
    block_rows: tuple[int, ...] = ()

    def describe(self) -> str:
        return "Ray Train's dataset shards (TorchTrainer(datasets=...), ray.train.get_dataset_shard)"


@dataclass(frozen=True)
class StagedSource:
    """One data source as the workers get it: ``ctx.data(name)`` reads it."""

    name: str
    kind: str  # the source's kind, in words ("Spark DataFrame")
    rows: int
    schema: pa.Schema
    blocks: Blocks
    columns: tuple[str, ...] = field(default=())  # the columns the ranks read (all of the schema's by default)

    @property
    def column_names(self) -> tuple[str, ...]:
        return self.columns or tuple(self.schema.names)


def without_trainer_datasets(sources: Sequence[StagedSource]) -> tuple[tuple[StagedSource, ...], dict[str, Any]]:
    """(the sources with every Ray Dataset object taken out, ``{name: dataset}`` for ``TorchTrainer(datasets=)``)."""
    datasets, kept = {}, []
    for source in sources:
        if isinstance(source.blocks, TrainerDataset) and source.blocks.dataset is not None:
            datasets[source.name] = source.blocks.dataset
            source = dataclasses.replace(source, blocks=TrainerDataset())
        kept.append(source)
    return tuple(kept), datasets
