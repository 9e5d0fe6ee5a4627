"""`RunResult`: what ``%%distribute`` returns to the cell."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any

from .config import RunConfig


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run.

    ``value``: rank 0's return value. ``values``: every rank's, indexed by rank. ``run_id``: the MLflow
    run. ``config``: the `RunConfig` used. ``wall_time_s``: launch to last result. ``metrics``: last
    value of each metric rank 0 logged. ``time_to_first_step_s``: launch to the first ``ctx.log``.
    ``checkpoint_root``: where ``ctx.save_checkpoint()`` without a directory saved (also the MLflow
    run's ``dtrain_magic.checkpoint_root`` tag). ``outputs``: what the function wrote with ``ctx.write``, by output
    name (`dtrain_magic.data.outputs.Output`: ``.path``, ``.rows``, ``.dataset()``, ``.to_pandas()``), committed
    once every rank returned. ``tables``: the outputs asked for by name (``run(..., outputs=["preds"])``,
    ``--output preds=VARIABLE``) as the backend's own table, by output name: a Spark DataFrame Spark reads from
    the parts on ``--backend spark``, a Ray Dataset on ``ray``, a pyarrow Dataset elsewhere. ``printed``: each
    rank's output (stdout and stderr as they came, the last 4 M characters), by rank: `output` gives one rank's; the
    MLflow run has each as ``logs/rank_N.txt``. ``world_size``: the ranks of the run's last attempt, those
    ``values`` come from (``--elastic`` may have shrunk or grown the run from ``config.num_processes``; None given:
    ``config.num_processes``).
    """

    value: Any
    values: list[Any]
    run_id: str | None
    config: RunConfig
    wall_time_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    time_to_first_step_s: float | None = None
    tracking_uri: str | None = None
    checkpoint_root: str | None = None
    printed: dict[int, str] = field(default_factory=dict, repr=False)
    outputs: dict[str, Any] = field(default_factory=dict, repr=False)
    world_size: int | None = None
    tables: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.world_size is None:
            object.__setattr__(self, "world_size", self.config.num_processes)

    def output(self, rank: int = 0) -> str:
        """What ``rank`` printed during the run (its stdout and stderr, in order), without the ``[rank N]`` prefix."""
        ranks = max(self.config.num_processes, self.world_size or 0)  # a grown run had more than it started with
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank}: this run had ranks 0 to {ranks - 1}")
        return self.printed.get(rank, "")

    def __repr__(self) -> str:
        short = reprlib.Repr()
        short.maxstring, short.maxother, short.maxlist, short.maxdict = 80, 80, 4, 6
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(self.metrics.items()))
        outputs = ", ".join(f"{name}={getattr(out, 'rows', '?'):,} rows" for name, out in self.outputs.items())
        return (
            f"RunResult(backend={self.config.backend}, strategy={self.config.strategy}, "
            f"world_size={self.world_size}, wall_time_s={self.wall_time_s:.2f}, "
            f"run_id={self.run_id!r}, metrics={{{metrics}}}, value={short.repr(self.value)}"
            + (f", outputs={{{outputs}}})" if outputs else ")")
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))
