"""In the notebook, after a run: its ``ctx.write`` outputs committed (or, for a run that failed, removed), and
``--output NAME=VARIABLE`` bound as what fits where the run went.

`finish` commits what the last attempt's ranks sealed (`dtrain_magic.data.outputs.commit`); `discard` removes the
staging folder of a run that did not finish. `bind` gives a notebook variable as the backend's
`Backend.output_table` says: on ``--backend spark`` a Spark DataFrame Spark reads from the committed parts
(``spark.read.parquet(path)``: never collected), on ``--backend ray`` a Ray Dataset (``ray.data.read_parquet(path)``),
elsewhere a pyarrow Dataset.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, MutableMapping, Sequence

from ..config import RunConfig
from ..data.outputs import Output, abort, commit, outputs_root
from ..errors import log_dropped
from ..registry import BACKENDS


def root_of(config: RunConfig, checkpoint_root: str | None) -> str | None:
    """Where this run's outputs go (None: a run without a run folder, which cannot write any)."""
    return outputs_root(checkpoint_root, config.data_dir) if checkpoint_root else None


def finish(root: str | None, written: Mapping[int, str], note: Callable[[str], None],
           earlier_attempts: bool = False) -> dict[str, Output]:
    """Commit at ``root`` (`root_of`) the outputs every rank of the last attempt sealed (``written``: rank →
    manifest); the cell says where each went. Nothing written (and no earlier attempt that could have left parts,
    ``earlier_attempts``: a run with restarts): no file is touched."""
    if root is None or (not any(written.values()) and not earlier_attempts):
        return {}
    outputs = commit(root, written)
    for name, output in outputs.items():
        note(f"output {name}: {output.rows:,} rows written by the ranks, committed at {output.path}")
    return outputs


def discard(root: str | None) -> None:
    """What did not finish (a run, a session's cell): its ranks' parts at ``root`` go (no output, no partial
    file); never raises."""
    if root is None:
        return
    try:
        abort(root)
    except Exception as exc:  # the run's own error is what the cell shows; a folder left over is logged
        log_dropped(__name__, f"removing the unfinished outputs at {root}", exc)


def discard_later(root: str | None, after_s: float) -> threading.Timer | None:
    """`discard` again ``after_s`` seconds from now: a run stopped early (an interrupt, Stop, a timeout) gives the cell
    back while its workers are still being stopped, and one of them may write a part after the first `discard`."""
    if root is None:
        return None
    timer = threading.Timer(after_s, discard, args=(root,))
    timer.daemon = True
    timer.start()
    return timer


def tables(backend: str, names: Sequence[str], outputs: Mapping[str, Output],
           unwritten: Callable[[str, str], None], spark_session: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Each output of ``names`` (``--output``'s, `dtrain_magic.run`'s ``outputs=``) as what fits the run's
    ``backend`` (`readable`), by name; one the run (or the cell) did not write is said, ``unwritten(name, why)``,
    ``why`` naming what it wrote."""
    found = {}
    for name in names:
        if name in outputs:
            found[name] = readable(backend, outputs[name], spark_session)
        else:
            unwritten(name, f"no output {name!r} was written (ctx.write({name!r}, batch)); written: "
                            f"{', '.join(outputs) or 'none'}")
    return found


def bind(namespace: MutableMapping[str, Any], backend: str, pairs: Sequence[tuple[str, str]],
         outputs: Mapping[str, Output], note: Callable[[str], None],
         spark_session: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``--output NAME=VARIABLE`` (``pairs``): each output bound in ``namespace`` as what fits the run's ``backend``
    (`tables`, which it returns); an output the run (or the cell) did not write is said (nothing bound)."""
    variables = dict(pairs)

    def unwritten(name: str, why: str) -> None:
        note(f"--output {name}={variables[name]}: {why}; {variables[name]} is not bound")

    found = tables(backend, list(variables), outputs, unwritten, spark_session)
    for name, table in found.items():
        namespace[variables[name]] = table
    return found


def readable(backend: str, output: Output, spark_session: Callable[[], Any] | None = None) -> Any:
    """``output`` as the backend's own table (its `Backend.output_table`): a Spark DataFrame, a Ray Dataset, else a
    pyarrow Dataset."""
    table = BACKENDS.facts(backend).output_table
    if table == "spark":
        return output.to_spark(spark_session() if spark_session is not None else None)
    if table == "ray":
        return output.to_ray()
    return output.dataset()


__all__ = ["bind", "discard", "discard_later", "finish", "readable", "root_of", "tables"]
