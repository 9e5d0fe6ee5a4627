"""What a session shows: each cell's own text (`CellText`), the session's monitor beside it (`Both`), nothing while
no cell runs (`Quiet`)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..driver.observer import RunObserver, TextObserver


class Quiet(RunObserver):
    """Sees nothing: what the ranks say while no cell runs (an idle release) goes nowhere."""


class Both:
    """One observer made of several: every callback goes to each that has it (the cell's, the session's monitor)."""

    def __init__(self, *observers: Any):
        self._observers = [observer for observer in observers if observer is not None]

    def __getattr__(self, name: str) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            for observer in self._observers:
                method = getattr(observer, name, None)
                if method is not None:
                    method(*args, **kwargs)

        return call


class CellText(TextObserver):
    """A session cell's plain text: every rank's output as ``[rank N]`` lines, and a progress line every few
    seconds while the cell logs metrics (its rate counted from the cell's own first step)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._first_step: int | None = None

    def metric(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        if self._first_step is None:
            self._first_step = step
            self._t0 = self._last_progress = time.monotonic()
        super().metric(step - self._first_step, metrics, timestamp_ms)
