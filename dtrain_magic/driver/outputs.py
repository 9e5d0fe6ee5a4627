"""In the notebook, after a run: its ``ctx.write`` outputs committed (or, for a run that failed, removed), and
``--output NAME=VARIABLE`` bound as what fits where the run went.

`finish` commits what the last attempt's ranks sealed (`dtrain_magic.data.outputs.commit`); `discard` removes the
staging folder of a run that did not finish. `bind` gives a notebook variable: on ``--backend spark`` a Spark
DataFrame Spark reads from the committed parts (``spark.read.parquet(path)``: never collected), on ``--backend ray``
a Ray Dataset (``ray.data.read_parquet(path)``), elsewhere a pyarrow Dataset.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, MutableMapping

from ..config import RunConfig
from ..data.outputs import Output, abort, commit, outputs_root
from ..errors import log_dropped


def root_of(config: RunConfig, checkpoint_root: str | None) -> str | None:
    """Where this run's outputs go (None: a run without a run folder, which cannot write any)."""
    return outputs_root(checkpoint_root, config.data_dir) if checkpoint_root else None


def finish(config: RunConfig, checkpoint_root: str | None, written: Mapping[int, str],
           note: Callable[[str], None]) -> dict[str, Output]:
    """Commit the outputs every rank of the last attempt sealed (``written``: rank → manifest); the cell says where
    each went. Runs that wrote nothing (and could not have: no restart) touch no file."""
    root = root_of(config, checkpoint_root)
    if root is None or (not any(written.values()) and config.max_restarts == 0):
        return {}
    outputs = commit(root, written)
    for name, output in outputs.items():
        note(f"output {name}: {output.rows:,} rows written by the ranks, committed at {output.path}")
    return outputs


def discard(config: RunConfig, checkpoint_root: str | None) -> None:
    """A run that did not finish: its ranks' parts go (no output, no partial file); never raises."""
    root = root_of(config, checkpoint_root)
    if root is None:
        return
    try:
        abort(root)
    except Exception as exc:  # the run's own error is what the cell shows; a folder left over is logged
        log_dropped(__name__, f"removing the unfinished outputs at {root}", exc)


def bind(namespace: MutableMapping[str, Any], config: RunConfig, outputs: Mapping[str, Output],
         note: Callable[[str], None], spark_session: Callable[[], Any] | None = None) -> None:
    """``--output NAME=VARIABLE``: each output bound in ``namespace`` as what fits the run's backend; an output the
    run did not write is said in the cell (nothing bound)."""
    for name, variable in config.outputs:
        output = outputs.get(name)
        if output is None:
            written = ", ".join(outputs) or "none"
            note(f"--output {name}={variable}: the run wrote no output {name!r} (ctx.write({name!r}, batch)); it "
                 f"wrote: {written}; {variable} is not bound")
            continue
        namespace[variable] = readable(config.backend, output, spark_session)


def readable(backend: str, output: Output, spark_session: Callable[[], Any] | None = None) -> Any:
    """``output`` as the backend's own table: a Spark DataFrame, a Ray Dataset, else a pyarrow Dataset."""
    if backend == "spark":
        session = spark_session() if spark_session is not None else None
        if session is None:
            from .._compat.spark import default_session

            session = default_session()
        return session.read.parquet(output.path)
    if backend == "ray":
        import ray.data

        return ray.data.read_parquet(output.path)
    return output.dataset()


__all__ = ["bind", "discard", "finish", "readable", "root_of"]
