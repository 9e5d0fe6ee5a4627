"""A run's training metrics as the live chart draws them, from two sources: MLflow's history (the record) and the
values fed from the workers before MLflow has them (`TrainingSeries`, used by `charts.RunCharts`).

A fed point is identified by (step, worker timestamp), the same pair MLflow stores, so it is drawn once: it leaves
the fed list when MLflow's history has it, and none is left once the run is terminal (MLflow is the record)."""

from __future__ import annotations

import threading
import time

Point = tuple[int, float, int]  # (step, value, timestamp in ms): one logged value of a training metric


class TrainingSeries:
    """The fed and the recorded points of every training metric, and how late each point reached the chart."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []  # ctx.log on the worker (its timestamp) -> value in the chart data
        self.fed_shown = 0  # points that reached the chart from `feed` before MLflow had them
        self._recorded: dict[str, list[Point]] = {}  # MLflow's history per training metric, sorted
        self._fed: dict[str, list[Point]] = {}  # received from the workers, not yet seen in MLflow
        self._lock = threading.Lock()  # `feed` runs in the driver's thread, the poller in its own
        self._fed_changed: set[str] = set()
        self._seen: dict[str, set[tuple[int, int]]] = {}  # (step, timestamp) already in the chart data

    def feed(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        """One ``ctx.log`` as the notebook received it; without the worker's timestamp the point is stamped now."""
        stamp = int(timestamp_ms) if timestamp_ms else int(time.time() * 1000)
        with self._lock:
            for key, value in metrics.items():
                self._fed.setdefault(key, []).append((int(step), float(value), stamp))
                self._fed_changed.add(key)

    def unrecorded(self, key: str) -> list[Point]:
        """The fed points of ``key`` that MLflow's history did not have at the last merge."""
        with self._lock:
            return list(self._fed.get(key, []))

    def merge(self, histories: dict[str, list[Point]], final: bool, live: bool) -> dict[str, list[Point]]:
        """Each changed metric's points: MLflow's ``histories`` (sorted) + the fed points MLflow does not have yet
        (none when ``final``). While ``live``, each point's lag is counted once, when it first reaches the chart."""
        merged = self._merged(histories, final)
        if live:
            self._count_lags(merged)
        for key, points in merged.items():
            self._seen.setdefault(key, set()).update((p[0], p[2]) for p in points)
        return merged

    def _merged(self, histories: dict[str, list[Point]], final: bool) -> dict[str, list[Point]]:
        with self._lock:
            fed_changed, self._fed_changed = self._fed_changed, set()
            keys = set(histories) | fed_changed | (set(self._fed) if final else set())
            merged: dict[str, list[Point]] = {}
            for key in keys:
                recorded = histories.get(key, self._recorded.get(key, []))
                new_record = key in histories and len(recorded) != len(self._recorded.get(key, ()))
                if not (new_record or key in fed_changed or final):
                    continue
                self._recorded[key] = recorded
                fed = self._fed.get(key, [])
                if fed:
                    ids = {(p[0], p[2]) for p in recorded}
                    fed = [] if final else [p for p in fed if (p[0], p[2]) not in ids]
                    self._fed[key] = fed
                merged[key] = sorted(recorded + fed, key=lambda p: (p[0], p[2])) if fed else recorded
        return merged

    def _count_lags(self, merged: dict[str, list[Point]]) -> None:
        now = time.time()
        for key, points in merged.items():
            seen = self._seen.get(key, set())
            fresh = [p for p in points if (p[0], p[2]) not in seen]
            self.lags_s += [now - p[2] / 1000.0 for p in fresh]
            recorded_ids = {(p[0], p[2]) for p in self._recorded.get(key, ())}
            self.fed_shown += sum(1 for p in fresh if (p[0], p[2]) not in recorded_ids)
