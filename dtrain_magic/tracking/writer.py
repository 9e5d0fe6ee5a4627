"""The metric writer: a thread that sends queued metrics to MLflow with ``log_batch``."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any


class MetricWriter(threading.Thread):
    """Writes queued metrics with ``log_batch``, as many per call as are waiting; a queued callable (an artifact, a
    tag) runs in turn, after the metrics queued before it.

    Not MLflow's own ``synchronous=False`` queue: that one polls with a delay, which added about a
    second to every run's end (flush, then ``set_terminated`` shutting it down), and it is shared by
    every run of the process, so ending one run stopped the queue of a concurrent one.
    """

    MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch
    # Gather for this long after the first waiting metric: one SQLite write per step cost the workers
    # CPU on a small machine; a quarter second keeps the charts well inside their 1 s lag.
    COALESCE_S = 0.25
    # While metrics keep coming (ctx.log every step), one write every 2 s: each log_batch costs the notebook 5-10 ms
    # of CPU (SQLAlchemy) whatever its size, taken from the ranks on a small machine (1 s: 11 ms/s of the
    # notebook's CPU at 1500 steps/s; 2 s: 6.5 ms/s). The monitor's charts draw each value as the notebook
    # receives it (`RunCharts.feed`), not when MLflow has it; a reader of MLflow alone sees it within 2 s.
    MIN_INTERVAL_S = 2.0

    def __init__(self, client: Any, run_id: str):
        super().__init__(name="dtrain-mlflow-writer", daemon=True)
        self.client, self.run_id = client, run_id
        self.queue: "queue.Queue[list | None]" = queue.Queue()
        self.start()

    def run(self) -> None:
        try:  # Linux threads have their own nice value: let busy CPU workers on this machine go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        done = False
        last_write = float("-inf")
        while not done:
            batch = self.queue.get()
            if batch is None:
                return
            if callable(batch):
                self._call(batch)
                continue
            batch = list(batch)
            deadline = max(time.monotonic() + self.COALESCE_S, last_write + self.MIN_INTERVAL_S)
            after = None
            while len(batch) < self.MAX_BATCH:
                try:
                    more = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    done = True
                    break
                if callable(more):
                    after = more
                    break
                batch.extend(more)
            last_write = time.monotonic()
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception:  # a thread with nobody to tell: the batch is lost, the user hears it
                logging.getLogger(__name__).warning("could not log %d metrics to MLflow", len(batch), exc_info=True)
            if after is not None:
                self._call(after)

    @staticmethod
    def _call(action) -> None:
        try:
            action()
        except Exception:  # a thread with nobody to tell: this write is lost, the user hears it
            logging.getLogger(__name__).warning("could not write to MLflow", exc_info=True)

    def close(self, timeout: float = 30.0) -> None:
        """Write everything queued, then stop."""
        self.queue.put(None)
        self.join(timeout)
