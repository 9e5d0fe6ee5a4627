"""What the run shows while it happens. `TextObserver` is the plain-text one (``--no-ui``, scripts,
nbclient); the widget panel implements the same interface."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ..config import RunConfig


class RunObserver:
    """Callbacks from the driver loop; every method is optional to override.

    Order: `launched` once the workers are being started (the MLflow run may not exist yet), then
    `output`/`status`/`total`/`metric` as they come, `started` once the MLflow run is open (with a SQLite
    store the workers start first, so metrics and output may come before it), `perf` every few seconds and
    `stacks` on a stall, `finished` at the end, then `held` when the next run's workers wait for it (Spark, Ray).
    """

    def launched(self, config: RunConfig, plan: str) -> None: ...

    def started(self, config: RunConfig, run_id: str, link: str, plan: str) -> None: ...

    def output(self, rank: int, stream: str, text: str) -> None: ...

    def metric(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        """Rank 0's ``ctx.log``; ``timestamp_ms`` is the worker's clock when it logged (the one MLflow records)."""

    def status(self, rank: int, state: str, detail: str) -> None: ...

    def total(self, steps: int) -> None: ...

    def data_progress(self, name: str, epoch: int, batch: int, batches: int) -> None:
        """Rank 0's ``ctx.data(name)`` loader has read ``batch`` of the ``batches`` batches of ``epoch``."""

    def note(self, text: str) -> None:
        """A line from the notebook's side of the run (staging ``--data`` sources, before the launch)."""

    def finished(self, result: Any, error: BaseException | None) -> None: ...

    def held(self, text: str) -> None:
        """After `finished`: the next run's workers wait (Spark, Ray): ``text`` says what, where, until when."""

    def perf(self, snapshot: Any) -> None:
        """Every few seconds: steps/s and CPU use per rank, stragglers, samples/s, tokens/s, model FLOP/s, MFU
        (`driver.perf.Snapshot`)."""

    def stacks(self, title: str, text: str) -> None:
        """Every rank's stack (a stall, or asked for): ``title`` says where each rank is in one line."""


def plan_with_backend(plan: str, config: RunConfig) -> str:
    """A launcher's one-line plan with the run's process-group backend (the strategy's choice, which launchers do
    not know), saying when a GPU run will have no GPU metrics (MLflow skips them silently without nvidia-ml-py)."""
    from ..tracking.system_metrics import gpu_metrics_note

    note = gpu_metrics_note(config.use_gpu)
    return f"{plan}, {config.process_group_backend} process group" + (f" ({note})" if note else "")


def prefix_lines(rank: int | None, text: str, pending: str = "") -> tuple[str, str]:
    """Prefix each complete line of ``pending + text`` with ``[rank N]``; returns (output, new pending)."""
    data = pending + text
    complete, _, rest = data.rpartition("\n")
    if not _:
        return "", data
    tag = f"[rank {rank}] " if rank is not None else "[worker] "
    return "".join(f"{tag}{line}\n" for line in complete.split("\n")), rest


class TextObserver(RunObserver):
    """Worker output with rank prefixes, and a progress line at most every ``every_s`` seconds."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, every_s: float = 5.0):
        self._out, self._err = out, err
        self._pending: dict[tuple[int, str], str] = {}
        self._every_s = every_s
        self._last_progress = 0.0
        self._total: int | None = None
        self._t0 = time.monotonic()
        self._steps_seen = 0
        self._steps_shown = 0
        self._latest: dict[str, float] = {}  # each metric's last value, for the final progress line
        self._perf = ""
        self._stragglers: set[int] = set()
        self._data: dict[str, tuple[int, int, int]] = {}  # name -> (epoch, batch, batches) of rank 0's loader

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def started(self, config: RunConfig, run_id: str, link: str, plan: str) -> None:
        self._t0 = self._last_progress = time.monotonic()
        plan = plan_with_backend(plan, config)
        print(f"dtrain_magic: {plan}; strategy {config.strategy}, {config.precision}; MLflow run {run_id}",
              file=self.out)

    def output(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        lines, self._pending[key] = prefix_lines(rank, text, self._pending.get(key, ""))
        if lines:
            target = self.err if stream == "stderr" else self.out
            target.write(lines)
            target.flush()

    def total(self, steps: int) -> None:
        self._total = steps

    def data_progress(self, name: str, epoch: int, batch: int, batches: int) -> None:
        self._data[name] = (epoch, batch, batches)

    def note(self, text: str) -> None:
        print(f"dtrain_magic: {text}", file=self.out, flush=True)

    def metric(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        self._steps_seen = max(self._steps_seen, step + 1)
        self._latest.update(metrics)
        now = time.monotonic()
        if now - self._last_progress < self._every_s:
            return
        self._last_progress = now
        self._print_progress(now - self._t0, metrics)

    def _print_progress(self, elapsed_s: float, metrics: dict[str, float]) -> None:
        self._steps_shown = self._steps_seen
        line = progress_line(self._steps_seen, self._total, elapsed_s, metrics)
        line += "".join(f"; {data_line(name, *where)}" for name, where in self._data.items())
        print(f"{line} · {self._perf}" if self._perf else line, file=self.out)

    def perf(self, snapshot: Any) -> None:
        self._perf = snapshot.line()
        for rank in snapshot.stragglers:
            if rank not in self._stragglers:
                self._stragglers.add(rank)
                rates = ", ".join(f"rank {r} {v:.3g}" for r, v in snapshot.steps_per_s.items())
                print(f"dtrain_magic: rank {rank} is a straggler (steps/s: {rates})", file=self.out)

    def stacks(self, title: str, text: str) -> None:
        print(f"dtrain_magic: {title}\n{text}", file=self.out, flush=True)

    def finished(self, result: Any, error: BaseException | None) -> None:
        for (rank, stream), rest in list(self._pending.items()):
            if rest:
                (self.err if stream == "stderr" else self.out).write(f"[rank {rank}] {rest}\n")
        self._pending.clear()
        if result is not None and self._steps_seen > self._steps_shown:
            self._print_progress(result.wall_time_s, self._latest)  # the last line shown is the run's last step
        if result is not None:
            print(f"dtrain_magic: finished in {result.wall_time_s:.2f} s; MLflow run {result.run_id}", file=self.out)

    def held(self, text: str) -> None:
        print(f"dtrain_magic: {text}", file=self.out)


def progress_line(steps: int, total: int | None, elapsed_s: float, metrics: dict[str, float]) -> str:
    """``step 40/100 (12.3 steps/s, ETA 4.9 s) loss=0.123``."""
    rate = steps / elapsed_s if elapsed_s > 0 else 0.0
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
    if total:
        eta = (total - steps) / rate if rate > 0 else float("nan")
        return f"step {steps}/{total} ({rate:.1f} steps/s, ETA {eta:.1f} s) {shown}"
    return f"step {steps} ({rate:.1f} steps/s) {shown}"


def data_line(name: str, epoch: int, batch: int, batches: int) -> str:
    """``train: epoch 2, batch 120/500``: where rank 0's ``ctx.data`` loader is."""
    return f"{name}: epoch {epoch}, batch {batch}/{batches}"
