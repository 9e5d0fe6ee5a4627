"""The way back (docs/data.md): ``ctx.write(name, batch)`` on the ranks, committed once by the driver.

Each rank appends its rows of output ``name`` to one Parquet file of its own in the run's staging folder,
``<outputs root>/_staging/<name>/part-r<rank>-<token>.parquet`` (``token``: this process's, so a restarted group's
files never collide with an earlier attempt's). Nothing there is an output yet. When a rank's function returned, it
*seals* its files (`OutputWriter.seal`: closed, footers written) and its `Result` carries the list of what it wrote
(a manifest); the driver commits once every rank's `Result` of the last attempt is in (`commit`): the listed files,
and only those, become ``<outputs root>/<name>/`` with a ``_SUCCESS`` marker. On a local file system the folder
appears with one rename, whole or not at all; on an object store (``s3://``) the files are moved one by one and the
marker is written last. A run that fails, or is interrupted, or a rank that dies, commits nothing: `abort` removes
the staging folder, and files of an earlier attempt, listed by no manifest of the last one, go with it.

The outputs root: ``<--data-dir>/dtrain_<run key>/outputs`` with ``--data-dir``, else the run's storage,
``<--storage>/dtrain_<run key>/outputs`` (`outputs_root`). Pure pyarrow: no backend, no strategy.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from ..errors import DistributeError
from .columns import table_from_arrays

STAGING = "_staging"
SUCCESS = "_SUCCESS"
ROW_GROUP_ROWS = 1 << 16  # rows gathered before a row group is written: readers split and skip by row group
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OutputError(DistributeError, ValueError):
    """A bad ``ctx.write`` (or outputs the ranks wrote that cannot be one table): names the output and column."""


def outputs_root(checkpoint_root: str, data_dir: str | None = None) -> str:
    """Where a run's outputs go: beside its checkpoints (``<storage>/dtrain_<key>/outputs``), or under
    ``--data-dir`` (``<data-dir>/dtrain_<key>/outputs``) when it is given."""
    if data_dir:
        return join(data_dir, os.path.basename(checkpoint_root.rstrip("/")), "outputs")
    return join(checkpoint_root, "outputs")


def join(base: str, *names: str) -> str:
    """``base/name/...`` for a path or a URI."""
    return "/".join([base.rstrip("/"), *names]) if "://" in base else os.path.join(base, *names)


def _filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


# -- the rows of one ctx.write ---------------------------------------------------------------------------------------
def to_table(name: str, batch: Mapping[str, Any]) -> pa.Table:
    """``batch`` (column → tensor, numpy array or list; rows along dim 0) as an Arrow table; an `OutputError` naming
    the output and the column for anything else."""
    if not isinstance(batch, Mapping) or not batch:
        raise OutputError(f"ctx.write({name!r}, batch): batch must be a non-empty dict of column name -> tensor, numpy "
                          f"array or list (one row per element along dim 0), got {type(batch).__name__}")
    arrays = {str(column): _column(name, str(column), value) for column, value in batch.items()}
    lengths = {column: len(values) for column, values in arrays.items()}
    if len(set(lengths.values())) > 1:
        first, *_ = lengths
        other = next(c for c in lengths if lengths[c] != lengths[first])
        raise OutputError(f"ctx.write({name!r}): column {other!r} has {lengths[other]} row(s) but column {first!r} "
                          f"has {lengths[first]}: every column needs one value per row")
    return table_from_arrays(arrays)


def _column(name: str, column: str, value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        import torch

        if not isinstance(value, torch.Tensor):
            raise OutputError(f"ctx.write({name!r}): column {column!r} is a {type(value).__name__}; give a tensor, "
                              "numpy array or list")
        value = value.detach()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: its values are exactly float32's
            value = value.float()
        value = value.cpu().numpy()
    elif isinstance(value, (list, tuple)):
        value = np.asarray(value)
    elif not isinstance(value, np.ndarray):
        raise OutputError(f"ctx.write({name!r}): column {column!r} is a {type(value).__name__}; give a tensor, numpy "
                          "array or list (one row per element along dim 0)")
    if value.ndim == 0:
        raise OutputError(f"ctx.write({name!r}): column {column!r} is a single value (0-d); give one value per row")
    if value.dtype == object or value.dtype.kind not in "biuf":
        raise OutputError(f"ctx.write({name!r}): column {column!r} holds {value.dtype} values; only numbers and "
                          "booleans (and arrays of them) are written")
    return value


def columns_of(schema: pa.Schema) -> tuple[tuple[str, str], ...]:
    """(column, type) pairs: what must agree between writes of one output."""
    return tuple((f.name, str(f.type)) for f in schema)


def check_same(name: str, before: tuple[tuple[str, str], ...], now: tuple[tuple[str, str], ...],
               where: str = "earlier writes") -> None:
    """An `OutputError` naming the output and the first column that differs from ``before``."""
    if before == now:
        return
    old, new = dict(before), dict(now)
    for column, kind in now:
        if column not in old:
            raise OutputError(f"ctx.write({name!r}): column {column!r} is new; {where} of output {name!r} had the "
                              f"columns {', '.join(old)}: every write of an output has the same columns")
        if old[column] != kind:
            raise OutputError(f"ctx.write({name!r}): column {column!r} is {kind}; {where} of output {name!r} wrote it "
                              f"as {old[column]}: every write of an output has the same types (cast it)")
    missing = [column for column in old if column not in new]
    raise OutputError(f"ctx.write({name!r}): column {missing[0]!r} is missing; {where} of output {name!r} had the "
                      f"columns {', '.join(old)}: every write of an output has the same columns")


# -- one rank's writer -----------------------------------------------------------------------------------------------
class _Part:
    """One rank's Parquet file of one output: rows gathered into row groups of `ROW_GROUP_ROWS`."""

    def __init__(self, root: str, name: str, rank: int, token: str, schema: pa.Schema):
        import pyarrow.parquet as pq

        folder = join(root, STAGING, name)
        self.relative = f"part-r{rank:05d}-{token}.parquet"
        fs, inner = _filesystem(folder)
        fs.create_dir(inner, recursive=True)
        self.writer = pq.ParquetWriter(join(inner, self.relative), schema, filesystem=fs)
        self.pending: list[pa.Table] = []
        self.pending_rows = self.rows = 0

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.pending_rows:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=max(self.pending_rows, 1))
        self.pending, self.pending_rows = [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


class OutputWriter:
    """This rank's ``ctx.write``: parts in the staging folder, sealed when the function returned.

    ``writes=False``: a rank whose rows another rank of its model replica writes (``--tp``/``--pp``): its batches
    are checked as anywhere else, and nothing is written."""

    def __init__(self, root: str, rank: int, writes: bool = True):
        self.root, self.rank, self.writes = root, rank, writes
        self.token = uuid.uuid4().hex[:12]
        self.parts: dict[str, _Part] = {}
        self.columns: dict[str, tuple[tuple[str, str], ...]] = {}
        self.ended: str | None = None  # why writes are refused now: the run (or the cell) ended

    def write(self, name: str, batch: Mapping[str, Any]) -> None:
        """Append ``batch``'s rows to output ``name``."""
        if self.ended is not None:
            raise OutputError(f"ctx.write({name!r}): {self.ended}; a write must happen while the function (or the "
                              "session's cell) runs")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OutputError(f"ctx.write({name!r}): an output's name must be a Python identifier (letters, digits, "
                              "_), as --output NAME=VARIABLE and result.outputs[NAME] name it")
        table = to_table(name, batch)
        columns = columns_of(table.schema)
        if name in self.columns:
            check_same(name, self.columns[name], columns)
        self.columns[name] = columns
        if not self.writes or table.num_rows == 0:
            return
        if name not in self.parts:
            self.parts[name] = _Part(self.root, name, self.rank, self.token, table.schema)
        self.parts[name].add(table)

    def seal(self, why: str = "the run has ended") -> str:
        """Close every part (its footer written) and refuse writes from now on; the manifest the rank's `Result`
        carries (JSON: ``{name: {"file", "rows", "columns"}}``; ``""`` when it wrote nothing)."""
        self.ended = why
        manifest = {}
        for name, part in self.parts.items():
            part.close()
            manifest[name] = {"file": part.relative, "rows": part.rows, "columns": [list(c) for c in
                                                                                     self.columns[name]]}
        self.parts = {}
        return json.dumps({"root": self.root, "outputs": manifest}) if manifest else ""

    def abort(self, why: str = "the run has ended") -> None:
        """The function failed: refuse writes; the files stay in the staging folder, which the driver removes."""
        self.ended = why
        for part in self.parts.values():
            try:
                part.writer.close()
            except Exception:  # noqa: BLE001 - a half-written part is never committed: only its handle must go
                pass
        self.parts = {}


# -- the driver: commit or abort -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Output:
    """A committed output: ``path`` (a folder of Parquet files, or a URI), ``rows``, ``columns`` ((name, type)
    pairs). `dataset` is a pyarrow Dataset over it, `to_spark` a Spark DataFrame and `to_ray` a Ray Dataset read from
    it where they run; `to_pandas` reads it whole into this process (only when asked)."""

    name: str
    path: str
    rows: int
    columns: tuple[tuple[str, str], ...]

    def dataset(self) -> Any:
        """A ``pyarrow.dataset.Dataset`` over the committed parts (nothing read yet)."""
        import pyarrow.dataset as ds

        fs, inner = _filesystem(self.path)
        return ds.dataset(inner, format="parquet", filesystem=fs)

    def to_table(self) -> pa.Table:
        return self.dataset().to_table()

    def to_pandas(self) -> Any:
        """Every row, in the notebook's memory, as a pandas DataFrame."""
        return self.to_table().to_pandas()

    def to_spark(self, spark: Any = None) -> Any:
        """A Spark DataFrame Spark reads from the parts (``spark.read.parquet``: nothing comes to the notebook);
        ``spark``: the SparkSession (default: the active one)."""
        if spark is None:
            from .._compat.spark import default_session

            spark = default_session()
            if spark is None:
                raise RuntimeError(f"output {self.name!r}: no active SparkSession to read it with; give one: "
                                   "to_spark(spark)")
        return spark.read.parquet(self.path)

    def to_ray(self) -> Any:
        """A Ray Dataset over the parts (``ray.data.read_parquet``), read by Ray Data where it runs."""
        import ray.data

        return ray.data.read_parquet(self.path)

    def __repr__(self) -> str:
        columns = ", ".join(f"{name} {kind}" for name, kind in self.columns)
        return f"Output({self.name!r}: {self.rows:,} rows ({columns}) at {self.path})"


def commit(root: str, manifests: Mapping[int, str]) -> dict[str, Output]:
    """Every rank's sealed parts (``manifests``: rank → `OutputWriter.seal`'s text, from the last attempt) made the
    run's outputs, ``<root>/<name>``; the staging folder removed. An `OutputError` (nothing committed) when the ranks
    wrote one output with different columns or types."""
    by_name: dict[str, list[tuple[int, dict]]] = {}
    for rank, text in sorted(manifests.items()):
        if text:
            for name, entry in json.loads(text)["outputs"].items():
                by_name.setdefault(name, []).append((rank, entry))
    for name, entries in by_name.items():
        first_rank, first = entries[0]
        for _rank, entry in entries[1:]:
            columns = tuple(tuple(c) for c in entry["columns"])
            check_same(name, tuple(tuple(c) for c in first["columns"]), columns, where=f"rank {first_rank}'s writes")
    committed = {name: _commit_one(root, name, entries) for name, entries in by_name.items()}
    abort(root, keep=bool(committed))
    return committed


def _commit_one(root: str, name: str, entries: list[tuple[int, dict]]) -> Output:
    staged, final = join(root, STAGING, name), join(root, name)
    fs, inner = _filesystem(staged)
    listed = {entry["file"] for _, entry in entries}
    columns = tuple(tuple(c) for c in entries[0][1]["columns"])
    rows = sum(entry["rows"] for _, entry in entries)
    if "://" not in root:  # the folder holds the listed files only, then appears whole with one rename
        for leftover in set(os.listdir(staged)) - listed:  # an earlier attempt's, or a dead rank's
            os.remove(os.path.join(staged, leftover))
        with open(os.path.join(staged, SUCCESS), "w"):
            pass
        os.rename(staged, final)
        return Output(name, final, rows, columns)
    _, final_inner = _filesystem(final)
    fs.create_dir(final_inner, recursive=True)
    for relative in sorted(listed):  # an object store has no folder rename: file by file, the marker last
        fs.move(join(inner, relative), join(final_inner, relative))
    with fs.open_output_stream(join(final_inner, SUCCESS)):
        pass
    return Output(name, final, rows, columns)


def abort(root: str, keep: bool = False) -> None:
    """Remove the run's staging folder (a failed or interrupted run: nothing of its outputs stays), and ``root``
    itself when nothing else is in it (``keep``: outputs were committed there)."""
    fs, inner = _filesystem(root)
    import pyarrow.fs as pafs

    staging = join(inner, STAGING)
    if fs.get_file_info(staging).type == pafs.FileType.Directory:
        fs.delete_dir(staging)
    if not keep and "://" not in root and os.path.isdir(root) and not os.listdir(root):
        os.rmdir(root)
        parent = os.path.dirname(root)  # the run's own folder (dtrain_<key>), when the outputs were all it held
        if os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)


__all__ = ["Output", "OutputError", "OutputWriter", "abort", "commit", "join", "outputs_root", "to_table"]
