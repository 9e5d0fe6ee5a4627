"""The kinds of data source a run can be handed, one class each, owning its facts: what it matches, its schema
and rows, what makes two of them the same data (so a re-run reuses a staged copy), and how its rows reach the
ranks on each backend (`Source.stage`). Nothing here collects a source's rows into the notebook's memory,
except an object that already is there (a pandas DataFrame, an array), which is written out once.

============================  ==================================  ==========================================
kind                          ``--backend ray``                   ``local``, ``spark``
============================  ==================================  ==========================================
Parquet path or URI           each rank reads its row groups      each rank reads its row groups
Spark DataFrame               Spark writes Parquet once           Spark writes Parquet once (executors)
Ray Dataset                   Ray Train's shards (datasets=)      Ray Data writes Parquet once
pandas / pyarrow / numpy /    put once in Ray's object store      one Arrow file, written once (memory-
torch / dict of arrays                                            mapped by every rank on this machine)
============================  ==================================  ==========================================
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
from typing import Any, Callable, ClassVar

import pyarrow as pa

from .._compat import spark as spark_compat
from ..registry import BACKENDS
from .blocks import ArrowFileBlocks, ObjectStoreBlocks, ParquetBlocks, StagedSource, TrainerDataset, parquet_blocks
from .columns import check_schema, hint_for, refusal, schema_text, table_from_arrays

# Staged Parquet row groups of about this size: small enough that a shuffled epoch reads them in many orders.
STAGED_ROW_GROUP_BYTES = 16 << 20
STAGED_BATCH_BYTES = 4 << 20  # record batches of a staged Arrow file (the blocks a shuffle permutes)


class Staging:
    """What `Source.stage` may use: where copies go, the backend, and a note for the cell."""

    def __init__(self, backend: str, new_directory: Callable[[], str], note: Callable[[str], None],
                 worker_cpus: float = 0.0):
        """``worker_cpus``: the CPUs the run's workers take on Ray (a Ray Dataset's tasks need some left)."""
        self.backend, self.new_directory, self.note = backend, new_directory, note
        self.worker_cpus = worker_cpus


class Source:
    """A data source found for ``--data NAME=SOURCE``."""

    kind: ClassVar[str]  # in words, for the cell and MLflow ("Spark DataFrame")
    tag: ClassVar[str]  # short, for MLflow's dataset source type ("spark_dataframe")

    def __init__(self, name: str, text: str, columns: tuple[str, ...] | None):
        self.name, self.text, self.selected = name, text, columns
        self.schema: pa.Schema = pa.schema([])
        self.rows: int | None = None  # None until counted (a DataFrame is counted when it is written)

    @classmethod
    def matches(cls, obj: Any) -> bool:
        return False

    def where(self) -> str:
        """``df_train`` or the path (with the columns kept, ``df[x,y]``), as the cell should say it."""
        return self.text + (f"[{','.join(self.selected)}]" if self.selected else "")

    def stages(self, backend: str) -> bool:
        """Is the source copied once for the ranks on ``backend`` (files, Ray's object store)?"""
        return False

    def needs_files(self, backend: str) -> bool:
        """Is that copy files every worker reads (so they must reach them, or ``--data-dir``)?"""
        return False

    def identity(self) -> str | None:
        """What makes a later run's source the same data (its staged copy is then reused); None: no copy."""
        return None

    def count(self) -> int:
        """The rows, counting them if need be (``--dry-run``)."""
        assert self.rows is not None
        return self.rows

    def route(self, backend: str) -> str:
        """How the rows reach the ranks on ``backend``, for ``--dry-run``."""
        raise NotImplementedError

    def stage(self, staging: Staging) -> StagedSource:
        """Make the source readable by every rank (write it once where needed) and say where it is."""
        raise NotImplementedError

    def _selected_schema(self, schema: pa.Schema) -> pa.Schema:
        if self.selected is None:
            return schema
        missing = [c for c in self.selected if c not in schema.names]
        if missing:
            raise ValueError(f"no column {missing[0]!r}; it has {', '.join(schema.names)}")
        return pa.schema([schema.field(c) for c in self.selected])

    def describe(self) -> str:
        rows = f"{self.rows:,} rows" if self.rows is not None else "rows counted when it is written"
        return f"{self.kind} {self.where()}, {rows}, {len(self.schema)} column(s): {schema_text(self.schema)}"


# -- Parquet ------------------------------------------------------------------------------------------------

class ParquetPath(Source):
    """Parquet files: a file, a directory (every ``*.parquet`` below it), a glob, or a URI pyarrow reads (s3://,
    gs://, hdfs://). Each rank opens only the files of its row groups."""

    kind, tag = "Parquet", "parquet"

    def __init__(self, name: str, text: str, columns: tuple[str, ...] | None):
        super().__init__(name, text, columns)
        files = _parquet_files(text)
        self.blocks, schema = parquet_blocks(files, f"Parquet at {text}")
        self.schema = self._selected_schema(schema)
        check_schema(self.schema)
        self.rows = self.blocks.rows

    def route(self, backend: str) -> str:
        return f"each rank reads its row groups of {self.blocks.describe().split(': ', 1)[1]}"

    def stage(self, staging: Staging) -> StagedSource:
        return StagedSource(self.name, self.kind, self.blocks.rows, self.schema, self.blocks, tuple(self.schema.names))


def _parquet_files(text: str) -> list[str]:
    """The Parquet files a path, directory, glob or URI names, sorted (the blocks' natural order)."""
    if "://" in text and not text.startswith("file://"):
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(text)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{text} does not exist")
        if info.type == pafs.FileType.File:
            return [text]
        if fs.get_file_info(path.rstrip("/") + "/_delta_log").type == pafs.FileType.Directory:
            raise ValueError(_DELTA)
        scheme = text.split("://", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        found = sorted(f"{scheme}://{i.path}" for i in infos if i.type == pafs.FileType.File and _is_data_file(i.path))
    else:
        path = os.path.expanduser(text.removeprefix("file://"))
        if any(ch in path for ch in "*?["):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        elif os.path.isfile(path):
            return [os.path.abspath(path)]
        elif os.path.isdir(path):
            if os.path.isdir(os.path.join(path, "_delta_log")):
                raise ValueError(_DELTA)
            found = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                           if _is_data_file(os.path.join(root, f)))
        else:
            raise FileNotFoundError(f"no file or directory {path!r} (from {os.getcwd()})")
        found = [os.path.abspath(p) for p in found]
    if not found:
        raise FileNotFoundError(f"{text} holds no Parquet file")
    return found


def _is_data_file(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return not any(p.startswith(("_", ".")) for p in parts[-1:]) and not path.endswith((".crc", ".json"))


_DELTA = ("a Delta table: its directory also holds files of earlier versions, so it is not read as plain Parquet; "
          "read it with Spark (spark.read.format('delta').load(path)) and pass the DataFrame (--data NAME=df)")


# -- objects in the notebook -----------------------------------------------------------------------------------

class InMemory(Source):
    """A pandas DataFrame, pyarrow Table, numpy array, torch tensor, dict of arrays/tensors (or any object with
    the Arrow C stream interface: polars, duckdb) already in the notebook's memory: written out once, never
    pickled per rank. A single array or tensor is one column named after its variable (N-D: per-row shape kept)."""

    kind, tag = "in-memory table", "in_memory"

    def __init__(self, name: str, text: str, columns: tuple[str, ...] | None, obj: Any, column: str):
        super().__init__(name, text, columns)
        self.kind = _type_name(obj)
        table = _to_table(obj, column)
        if columns is not None:
            self.schema = self._selected_schema(table.schema)
            table = table.select(list(columns))
        check_schema(table.schema)
        self.table = table
        self.schema, self.rows = table.schema, table.num_rows
        self._identity: str | None = None

    @classmethod
    def matches(cls, obj: Any) -> bool:
        module = type(obj).__module__ or ""
        return (isinstance(obj, (pa.Table, pa.RecordBatch, dict)) or module.startswith(("pandas", "numpy", "torch"))
                or hasattr(obj, "__arrow_c_stream__"))

    def stages(self, backend: str) -> bool:
        return True

    def needs_files(self, backend: str) -> bool:
        return not BACKENDS.facts(backend).object_store

    def identity(self) -> str:
        """A digest of the table's content (its buffers) and schema: an object changed in place is new data."""
        if self._identity is None:
            digest = hashlib.blake2b(str(self.table.schema).encode(), digest_size=16)
            for column in self.table.columns:
                for chunk in column.chunks:
                    digest.update(f"{chunk.offset}:{len(chunk)}".encode())  # a slice shares its parent's buffers
                    for buffer in chunk.buffers():
                        if buffer is not None:
                            digest.update(buffer)
            self._identity = f"object:{digest.hexdigest()}"
        return self._identity

    def route(self, backend: str) -> str:
        if BACKENDS.facts(backend).object_store:
            return "put once in Ray's object store; each rank fetches it (no copy on its own node) and reads its share"
        return "written once to an Arrow file that every rank memory-maps, reading its share (no pickled copy per rank)"

    def stage(self, staging: Staging) -> StagedSource:
        block = max(1, STAGED_BATCH_BYTES // max(1, self.table.nbytes // max(1, self.rows or 1)))
        sizes = tuple(min(block, self.table.num_rows - start) for start in range(0, self.table.num_rows, block))
        if BACKENDS.facts(staging.backend).object_store:
            import ray

            blocks: Any = ObjectStoreBlocks(ray.put(self.table), block, sizes)
        else:
            path = os.path.join(staging.new_directory(), "data.arrow")
            _write_arrow(self.table, path, block)
            blocks = ArrowFileBlocks(path, sizes)
        return StagedSource(self.name, self.kind, self.table.num_rows, self.schema, blocks, tuple(self.schema.names))


def _type_name(obj: Any) -> str:
    module = (type(obj).__module__ or "").split(".")[0]
    name = type(obj).__name__
    return {"pandas": f"pandas {name}", "numpy": "numpy array", "torch": "torch tensor",
            "pyarrow": f"pyarrow {name}"}.get(module, name)


def _to_table(obj: Any, column: str) -> pa.Table:
    module = (type(obj).__module__ or "").split(".")[0]
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    if module == "pandas":
        frame = obj if hasattr(obj, "columns") else obj.to_frame(name=obj.name if obj.name is not None else column)
        return pa.Table.from_pandas(frame, preserve_index=False)
    if module in ("numpy", "torch"):
        return table_from_arrays({column: _as_numpy(obj, column)})
    if isinstance(obj, dict):
        if not obj:
            raise ValueError("an empty dict: no columns")
        arrays = {str(k): _as_numpy(v, str(k)) for k, v in obj.items()}
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"its arrays have different lengths ({lengths}): each column needs one value per row")
        return table_from_arrays(arrays)
    return pa.table(obj)  # the Arrow C stream interface (polars, duckdb, ...)


def _as_numpy(value: Any, name: str) -> Any:
    import numpy as np

    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USMm":
        raise ValueError(f"column {name!r} ({array.dtype}) cannot become a tensor: only numbers and booleans do")
    return array


def _write_arrow(table: pa.Table, path: str, block: int) -> None:
    """``table`` as an Arrow IPC file of record batches of ``block`` rows, written beside and renamed into place
    (a reader never sees half a file)."""
    partial = path + ".partial"
    if "://" in path:
        import pyarrow.fs as pafs

        fs, inner = pafs.FileSystem.from_uri(partial)
        sink: Any = fs.open_output_stream(inner)
    else:
        sink = pa.OSFile(partial, "wb")
    with sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=block):
            writer.write_batch(batch)
    if "://" in path:
        fs.move(inner, pafs.FileSystem.from_uri(path)[1])
    else:
        os.replace(partial, path)


# -- Spark ---------------------------------------------------------------------------------------------------

_SPARK_ARROW = {"boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(),
                "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64()}


class SparkDataFrame(Source):
    """A Spark DataFrame: never collected. Spark's executors write it once as Parquet to the run's staging
    directory (a temp directory on this machine, or ``--data-dir`` for a cluster), and the ranks read that.
    ML vector columns become float32 arrays (``vector_to_array``). The same DataFrame in a later run (equal
    ``semanticHash()`` and input files) reuses the copy."""

    kind, tag = "Spark DataFrame", "spark_dataframe"

    def __init__(self, name: str, text: str, columns: tuple[str, ...] | None, df: Any):
        super().__init__(name, text, columns)
        if columns is not None:
            missing = [c for c in columns if c not in df.columns]
            if missing:
                raise ValueError(f"no column {missing[0]!r}; it has {', '.join(df.columns)}")
            df = df.select(*columns)
        self.df, self.vectors = df, []
        fields = []
        for field in df.schema.fields:
            arrow_type = _spark_to_arrow(field.dataType)
            if arrow_type is None and type(field.dataType).__name__ == "VectorUDT":
                self.vectors.append(field.name)
                arrow_type = pa.list_(pa.float32())
            if arrow_type is None:
                simple = field.dataType.simpleString()
                raise ValueError(f"column {field.name!r} ({simple}) cannot become a tensor: {hint_for(simple)}; "
                                 f"keep the others with --data {name}={text}[col,...] or {text}.select(...)")
            fields.append(pa.field(field.name, arrow_type))
        self.schema = pa.schema(fields)

    @classmethod
    def matches(cls, obj: Any) -> bool:
        return type(obj).__name__ == "DataFrame" and (type(obj).__module__ or "").startswith("pyspark.sql")

    def stages(self, backend: str) -> bool:
        return True

    def needs_files(self, backend: str) -> bool:
        return True

    def identity(self) -> str | None:
        try:
            key = f"{self.df.semanticHash()}:{sorted(self.df.inputFiles())}"
        except Exception:  # a Spark without them (Connect, an older one): no reuse
            return None
        return "spark:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def count(self) -> int:
        if self.rows is None:
            self.rows = int(self.df.count())
        return self.rows

    def route(self, backend: str) -> str:
        return ("written once as Parquet by Spark's executors (a re-run of the same DataFrame reuses it); each rank "
                "reads its row groups")

    def stage(self, staging: Staging) -> StagedSource:
        from pyspark.ml.functions import vector_to_array

        directory = staging.new_directory()
        df = self.df
        for column in self.vectors:
            df = df.withColumn(column, vector_to_array(column, "float32"))
        target = directory if "://" in directory else "file://" + os.path.abspath(directory)
        session = df.sparkSession
        group = f"dtrain_magic-staging-{os.path.basename(directory)}"
        # A classic session's job group or a Spark Connect session's operation tag: an interrupt cancels the write.
        with spark_compat.job_group(session, group, f"dtrain_magic: writing --data {self.name} once as Parquet"):
            try:
                df.write.mode("overwrite").option("parquet.block.size", str(STAGED_ROW_GROUP_BYTES)).parquet(target)
            except BaseException:
                spark_compat.cancel_group(session, group)
                raise
        return _staged_parquet(self, directory, "Parquet written by Spark")


def _spark_to_arrow(spark_type: Any) -> pa.DataType | None:
    simple = spark_type.simpleString()
    if simple in _SPARK_ARROW:
        return _SPARK_ARROW[simple]
    if type(spark_type).__name__ == "ArrayType":
        inner = _spark_to_arrow(spark_type.elementType)
        return pa.list_(inner) if inner is not None else None
    return None


def _staged_parquet(source: Source, directory: str, origin: str) -> StagedSource:
    files = _parquet_files(directory) if _has_parquet(directory) else []
    if not files:  # nothing written: an empty source (refused before launch)
        source.rows = 0
        return StagedSource(source.name, source.kind, 0, source.schema, ParquetBlocks((), (), ()), ())
    blocks, schema = parquet_blocks(files, origin)
    source.rows = blocks.rows
    return StagedSource(source.name, source.kind, blocks.rows, schema, blocks, tuple(schema.names))


def _has_parquet(directory: str) -> bool:
    try:
        return bool(_parquet_files(directory))
    except FileNotFoundError:
        return False


# -- Ray Data ------------------------------------------------------------------------------------------------

class RayDataset(Source):
    """A Ray Dataset. On ``--backend ray`` it goes to Ray Train as it is (``TorchTrainer(datasets=...)``), so
    ``ray.train.get_dataset_shard(name)`` works in an existing loop and ``ctx.data(name)`` reads the same shard;
    elsewhere Ray Data writes it once as Parquet (the same Dataset object in a later run reuses the copy)."""

    kind, tag = "Ray Dataset", "ray_dataset"

    def __init__(self, name: str, text: str, columns: tuple[str, ...] | None, ds: Any, backend: str):
        super().__init__(name, text, columns)
        if columns is not None:
            missing = [c for c in columns if c not in ds.columns()]
            if missing:
                raise ValueError(f"no column {missing[0]!r}; it has {', '.join(ds.columns())}")
            ds = ds.select_columns(list(columns))
        self.ds = ds
        schema = ds.schema()
        fields = []
        for column, arrow_type in zip(schema.names, schema.types, strict=True):
            if not isinstance(arrow_type, pa.DataType):
                arrow_type = pa.from_numpy_dtype(arrow_type) if hasattr(arrow_type, "kind") else pa.null()
            extension = isinstance(arrow_type, pa.ExtensionType)
            if extension and not BACKENDS.facts(backend).ray_train:
                raise ValueError(f"column {column!r} ({arrow_type}) is one of Ray's tensor columns: it is read "
                                 "through Ray Train on --backend ray; elsewhere keep plain numeric columns")
            if not extension and refusal(arrow_type) is not None:
                raise ValueError(f"column {column!r} ({arrow_type}) cannot become a tensor: {refusal(arrow_type)}")
            fields.append(pa.field(column, arrow_type))
        self.schema = pa.schema(fields)
        self.backend = backend

    @classmethod
    def matches(cls, obj: Any) -> bool:
        return (type(obj).__module__ or "").startswith("ray.data") and type(obj).__name__ in ("Dataset",
                                                                                              "MaterializedDataset")

    def stages(self, backend: str) -> bool:
        return not BACKENDS.facts(backend).ray_train  # Ray Train reads the Dataset itself

    def needs_files(self, backend: str) -> bool:
        return not BACKENDS.facts(backend).ray_train

    def identity(self) -> str | None:
        return f"ray-dataset:{id(self.ds)}"  # the staging area holds the Dataset while its copy is kept

    def count(self) -> int:
        if self.rows is None:
            self.rows = int(self.ds.count())
        return self.rows

    def route(self, backend: str) -> str:
        if BACKENDS.facts(backend).ray_train:
            return ("given to Ray Train (TorchTrainer(datasets=...)): each rank reads its shard "
                    "(ray.train.get_dataset_shard, streaming)")
        return "written once as Parquet by Ray Data; each rank reads its row groups"

    def stage(self, staging: Staging) -> StagedSource:
        if BACKENDS.facts(staging.backend).ray_train:
            ds = self._for_trainer(staging)
            return StagedSource(self.name, self.kind, self.count(), self.schema, TrainerDataset(ds),
                                tuple(self.schema.names))
        directory = staging.new_directory()
        self.ds.write_parquet(directory)
        return _staged_parquet(self, directory, "Parquet written by Ray Data")


    def _for_trainer(self, staging: Staging) -> Any:
        """The Dataset Ray Train streams to the ranks. Its read and map tasks need CPUs beside the workers': on a Ray
        whose CPUs the workers take (``ray.init()`` or Ray Data's own start: every core, -n as many), the ranks would
        wait in ``iter_batches`` forever. There it is materialized first, while every CPU is free, and said so."""
        import ray

        left = ray.cluster_resources().get("CPU", 0.0) - staging.worker_cpus
        if left >= 1 or type(self.ds).__name__ == "MaterializedDataset":
            return self.ds
        total = ray.cluster_resources().get("CPU", 0.0)
        staging.note(f"data {self.name}: the run's workers take {staging.worker_cpus:g} of this Ray's {total:g} CPUs, "
                     f"none left for Ray Data's tasks, which would make the ranks wait for their first batch forever: "
                     f"materializing Ray Dataset {self.where()} now, into Ray's object store (spilled to disk when it "
                     "does not fit), before launch; to stream it instead, give Ray more CPUs than workers "
                     "(ray.init(num_cpus=...)) or use fewer workers (-n)")
        started = time.monotonic()
        materialized = self.ds.materialize()  # (not kept here: its blocks go once the run's trainer is gone)
        self.rows = int(materialized.count())  # from the blocks' metadata: nothing runs again
        staging.note(f"data {self.name}: materialized {self.rows:,} rows in {time.monotonic() - started:.1f} s")
        return materialized


def find_kind(obj: Any) -> type[Source] | None:
    """The kind of a notebook object, or None when it is none of them."""
    for kind in (SparkDataFrame, RayDataset, InMemory):
        if kind.matches(obj):
            return kind
    return None


SUPPORTED = ("a Spark DataFrame, a Ray Dataset, a pandas DataFrame, a pyarrow Table, a numpy array, a torch tensor, "
             "a dict of arrays or tensors, or a path/URI of Parquet files")


__all__ = ["InMemory", "ParquetPath", "RayDataset", "SUPPORTED", "Source", "SparkDataFrame", "Staging", "find_kind"]
