"""In the notebook, before launch: ``--data NAME=SOURCE`` → the sources found (`DataPlan`), every bad input a
`ConfigError` naming the data and what is allowed; then, at launch, the sources staged for the ranks.

A ``SOURCE`` that names a notebook variable is that object (a variable holding a path string is that path);
anything else is a path or URI of Parquet files. The checks: an unknown variable, a missing path, an unsupported
type, a column that cannot become a tensor (named with its type), an empty source, fewer rows than data-parallel
ranks, a name the function reads (``ctx.data("x")``) that the run does not give, and where copies must go
(``--data-dir`` when the workers do not share this machine's files).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..config import RunConfig, redact_uri
from ..data.blocks import StagedSource
from ..data.kinds import SUPPORTED, InMemory, ParquetPath, RayDataset, Source, SparkDataFrame, Staging, find_kind
from ..dataspec import FLAG, split_columns
from ..errors import ConfigError, log_dropped
from ..registry import BACKENDS

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NOTHING = "nothing was launched"


@dataclass
class Staged:
    """What staging did for one source: how long it took, or that an earlier run's copy was reused."""

    source: StagedSource
    seconds: float = 0.0
    reused: bool = False
    wrote: bool = False


@dataclass
class DataPlan:
    """The run's data sources, found and checked in the notebook."""

    sources: tuple[Source, ...]
    backend: str
    data_dir: str | None
    ranks: int  # data-parallel ranks (processes / (tp x pp))
    worker_cpus: float = 0.0  # the CPUs the run's workers take on Ray (Ray Train's default: 1 each, none with GPUs)
    staged: dict[str, Staged] = field(default_factory=dict)  # by name, once `stage` ran

    # -- before launch ----------------------------------------------------------------------------
    def dry_run_lines(self) -> list[str]:
        lines = []
        for source in self.sources:
            source.count()
            lines.append(f"  data {source.name}: {source.describe()}")
            lines.append(f"    {source.route(self.backend)}; {self._share(source)}")
        return lines

    def _share(self, source: Source) -> str:
        if source.rows is None:
            return "each rank reads an equal share"
        from ..data.split import Split

        per_rank = Split(source.rows, self.ranks).rows_per_rank
        if isinstance(source, RayDataset) and BACKENDS.facts(self.backend).ray_train:  # Ray Train's own split
            per_rank = source.rows // self.ranks
        ranks = f"{self.ranks} data-parallel rank(s)"
        return f"each of {ranks} reads {per_rank:,} row(s) per epoch"

    def check_rows(self, source: Source, rows: int) -> None:
        """An empty source, or fewer rows than data-parallel ranks: a `ConfigError` before launch."""
        if rows == 0:
            raise ConfigError(FLAG, f"{source.name}={source.where()}: the {source.kind} has no rows: nothing to "
                                    f"train on; {NOTHING}")
        if rows < self.ranks:
            raise ConfigError(FLAG, f"{source.name}={source.where()}: {rows} row(s) for {self.ranks} data-parallel "
                                    f"ranks: every rank needs at least one row; use fewer processes (-n) or more "
                                    f"data; {NOTHING}")

    # -- at launch -----------------------------------------------------------------------------------
    def stage(self, note: Callable[[str], None]) -> tuple[StagedSource, ...]:
        """Each source made readable by every rank: written once where it must be (or an earlier run's copy of the
        same data reused); then the row checks a count needed. Returns what the `WorkerJob` carries."""
        from .staging import staging_area

        area = staging_area()
        for source in self.sources:
            self.staged[source.name] = self._stage_one(area, source, note)
            self.check_rows(source, self.staged[source.name].source.rows)
        return tuple(self.staged[source.name].source for source in self.sources)

    def _stage_one(self, area: Any, source: Source, note: Callable[[str], None]) -> Staged:
        if not source.stages(self.backend):
            return Staged(source.stage(Staging(self.backend, _no_directory, note, self.worker_cpus)))
        identity, where = source.identity(), self._copy_place(source)
        # Runs at once (a sweep's trials) staging the same data: the first writes it, the others wait and reuse it
        with _one_writer((source.name, repr(identity), where)):
            return self._reuse_or_write(area, source, identity, where, note)

    def _reuse_or_write(self, area: Any, source: Source, identity: Any, where: str | None,
                        note: Callable[[str], None]) -> Staged:
        from .staging import remove

        found = area.reuse(source.name, identity, where)
        if found is not None:
            staged, seconds = found
            note(f"data {source.name}: reusing the copy of {source.kind} {source.where()} an earlier run staged "
                 f"({staged.rows:,} rows, written in {seconds:.1f} s then)")
            source.rows = staged.rows
            return Staged(staged, seconds, reused=True)
        directories: list[str] = []

        def new_directory() -> str:
            directories.append(area.new_directory(self.data_dir))
            return directories[-1]

        note(f"data {source.name}: staging {source.kind} {source.where()}: {source.route(self.backend)}")
        started = time.monotonic()
        try:
            staged = source.stage(Staging(self.backend, new_directory, note))
        except BaseException:  # interrupted or failed: no half-written copy stays behind
            for directory in directories:
                remove(directory)
            raise
        seconds = time.monotonic() - started
        area.keep(source.name, identity, where, staged, directories[0] if directories else None, seconds,
                  holds=getattr(source, "ds", None))
        note(f"data {source.name}: staged {staged.rows:,} rows in {seconds:.1f} s")
        return Staged(staged, seconds, wrote=True)

    def _copy_place(self, source: Source) -> str | None:
        """Where a copy of ``source`` lives (part of its key: a copy elsewhere is another copy)."""
        if source.needs_files(self.backend):
            return self.data_dir
        try:
            import ray

            context = ray.get_runtime_context()
            return f"ray:{context.get_node_id()}:{context.get_job_id()}"
        except Exception as exc:  # Ray absent, not started here, or refusing: the copy is keyed by backend alone
            log_dropped(__name__, "Ray's node and job for a staged copy's key", exc)
            return self.backend

    # -- records ---------------------------------------------------------------------------------------
    def tags(self) -> dict[str, str]:
        """The MLflow run's tags: each source's kind, source, rows, schema and staging."""
        from ..data.columns import schema_text

        tags = {}
        for source in self.sources:
            prefix = f"dtrain_magic.data.{source.name}"
            staged = self.staged.get(source.name)
            rows = staged.source.rows if staged is not None else source.rows
            tags.update({f"{prefix}.kind": source.kind, f"{prefix}.source": redact_uri(source.where()),
                         f"{prefix}.schema": schema_text(source.schema), f"{prefix}.reaches_ranks":
                         source.route(self.backend)})
            if rows is not None:
                tags[f"{prefix}.rows"] = str(rows)
            if staged is not None and staged.wrote:
                tags[f"{prefix}.staging_s"] = f"{staged.seconds:.3f}"
            elif staged is not None and staged.reused:
                tags[f"{prefix}.staging"] = f"reused the copy an earlier run staged in {staged.seconds:.3f} s"
        return tags

    def dataset_inputs(self) -> list[dict[str, str]]:
        """MLflow dataset inputs (``client.log_inputs``): name, digest, source type and source, schema, profile."""
        inputs = []
        for source in self.sources:
            staged = self.staged.get(source.name)
            rows = staged.source.rows if staged is not None else source.rows
            schema = {"columns": [{"name": f.name, "type": str(f.type)} for f in source.schema]}
            identity = (source.identity() if source.stages(self.backend) else None) or redact_uri(source.where())
            digest = hashlib.blake2b(f"{identity}:{rows}".encode(), digest_size=8).hexdigest()
            inputs.append({
                "name": source.name, "digest": digest, "source_type": source.tag,
                "source": json.dumps({"source": redact_uri(source.where()), "kind": source.kind}),
                "schema": json.dumps(schema), "profile": json.dumps({"num_rows": rows}),
            })
        return inputs


def _no_directory() -> str:
    raise AssertionError("this source writes nothing")


def resolve(config: RunConfig, shares_files: bool, namespace: Mapping[str, Any] | None,
            read_names: Sequence[str] = (), function: str = "the function", count: bool = False) -> DataPlan | None:
    """The run's sources (None without ``--data``), checked. ``shares_files``: the workers read this machine's
    files (`Launcher.workers_share_files`). ``namespace``: the notebook's (or `dtrain_magic.run`'s ``data=``
    objects); None on the command line. ``read_names``: the names the function passes to ``ctx.data``.
    ``count``: count sources whose rows are otherwise counted when they are written (``--dry-run``)."""
    given = [name for name, _ in config.data]
    missing = [name for name in read_names if name not in given]
    if missing:
        theirs = f"this run's: {', '.join(given)}" if given else "this run gives none"
        raise ConfigError(FLAG, f"{function} reads ctx.data({missing[0]!r}), but the run has no data source named "
                                f"{missing[0]}: add --data {missing[0]}=SOURCE ({theirs}); {NOTHING}")
    if not config.data:
        return None
    plan = DataPlan(tuple(_source(name, text, config.backend, namespace) for name, text in config.data),
                    config.backend, config.data_dir, config.data_parallel_size,
                    0.0 if config.use_gpu else float(config.num_processes))
    split_by_ray = [s for s in plan.sources if isinstance(s, RayDataset) and BACKENDS.facts(config.backend).ray_train]
    if split_by_ray and config.tp * config.pp > 1:
        first = split_by_ray[0]
        raise ConfigError(FLAG, f"{first.name}={first.where()}: Ray Train splits a Ray Dataset over every worker, "
                                f"and under --tp/--pp the workers of one model replica must read the same batches: "
                                f"write it once as Parquet (ds.write_parquet(dir)) and pass that path; {NOTHING}")
    needs_files = [s for s in plan.sources if s.needs_files(config.backend)]
    if needs_files and not shares_files and config.data_dir is None:
        first = needs_files[0]
        raise ConfigError("--data-dir", f"--data {first.name}={first.where()} ({first.kind}) is written once for the "
                          f"ranks, and this run's workers do not share this machine's files: give --data-dir DIR, "
                          "a directory every worker can read and the notebook (and Spark) can write (a shared mount "
                          f"such as /dbfs/tmp/..., or s3://bucket/prefix); {NOTHING}")
    for source in plan.sources:
        if count:
            _guarded(source.name, source.where(), source.count)
        if source.rows is not None:
            plan.check_rows(source, source.rows)
    return plan


def describe(config: RunConfig, namespace: Mapping[str, Any]) -> list[str]:
    """The ``--data`` sources of ``config`` in words, one line each, without counting or writing anything (the
    ``--configure`` panel); a `ConfigError` for a bad one."""
    plan = resolve(config, True, namespace)
    if plan is None:
        return []
    return [f"data {s.name}: {s.describe()}; {s.route(config.backend)}" for s in plan.sources]


def _source(name: str, text: str, backend: str, namespace: Mapping[str, Any] | None) -> Source:
    base, columns = split_columns(name, text)
    spec = f"{name}={text}"
    if namespace is not None and _IDENTIFIER.match(base) and base in namespace:
        obj = namespace[base]
        if isinstance(obj, (str, os.PathLike)):  # a variable holding a path
            return _guarded(name, text, lambda: ParquetPath(name, os.fspath(obj), columns))
        kind = find_kind(obj)
        if kind is None:
            module = type(obj).__module__
            shown = type(obj).__name__ if module == "builtins" else f"{module}.{type(obj).__name__}"
            raise ConfigError(FLAG, f"{spec}: {base} is a {shown}, which is not a data source; give {SUPPORTED}; "
                                    f"{NOTHING}")
        if kind is SparkDataFrame:
            return _guarded(name, text, lambda: SparkDataFrame(name, base, columns, obj))
        if kind is RayDataset:
            return _guarded(name, text, lambda: RayDataset(name, base, columns, obj, backend))
        return _guarded(name, text, lambda: InMemory(name, base, columns, obj, base))
    looks_like_path = "://" in base or os.sep in base or "." in base or os.path.exists(base)
    if _IDENTIFIER.match(base) and not looks_like_path:
        where = ("the command line takes paths and URIs" if namespace is None
                 else "no notebook variable and no file of that name")
        raise ConfigError(FLAG, f"{spec}: {base} is not defined ({where}); give {SUPPORTED}; {NOTHING}")
    return _guarded(name, text, lambda: ParquetPath(name, base, columns))


def _guarded(name: str, text: str, make: Callable[[], Any]) -> Any:
    """``make()``, its error as a `ConfigError` naming ``--data NAME=SOURCE``."""
    try:
        return make()
    except ConfigError:
        raise
    except (ValueError, OSError, TypeError) as exc:
        raise ConfigError(FLAG, f"{name}={text}: {exc}; {NOTHING}") from None
    except Exception as exc:  # a library's own error (pyarrow's ArrowInvalid is a ValueError; Spark's are not)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(FLAG, f"{name}={text}: {type(exc).__name__}: {first}; {NOTHING}") from None


def check_data_dir(data_dir: str) -> None:
    """``--data-dir``: an existing directory this process can write, or a URI pyarrow can open."""
    if "://" in data_dir:
        try:
            import pyarrow.fs as pafs

            pafs.FileSystem.from_uri(data_dir)
        except Exception as exc:
            raise ConfigError("--data-dir", f"got {redact_uri(data_dir)!r}, which pyarrow cannot open ({exc}); "
                                            f"{NOTHING}") from None
        return
    if not os.path.isdir(data_dir) or not os.access(data_dir, os.W_OK | os.X_OK):
        raise ConfigError("--data-dir", f"got {data_dir!r}: not an existing directory this notebook can write; "
                                        f"{NOTHING}")


_writers: dict[tuple, threading.Lock] = {}
_writers_lock = threading.Lock()


def _one_writer(key: tuple) -> threading.Lock:
    """The lock of one copy's key (source name, data identity, place): one run writes it at a time."""
    with _writers_lock:
        return _writers.setdefault(key, threading.Lock())


__all__ = ["DataPlan", "InMemory", "Staged", "check_data_dir", "describe", "resolve"]
