"""Short tracebacks: the user's frames only, notebook cells shown as ``Cell In[N], line L``."""

from __future__ import annotations

import os
import traceback

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def short_traceback(exc: BaseException, labels: dict[str, str] | None = None) -> str:
    """The exception's traceback without dtrain_magic's own leading frames (the harness around user code)."""
    labels = labels or {}
    frames = traceback.extract_tb(exc.__traceback__)
    while frames and frames[0].filename.startswith(_PACKAGE_DIR):
        frames.pop(0)
    from .errors import DistributeError

    if isinstance(exc, DistributeError):  # raised by dtrain_magic's own adapters: the user's line is the point
        while len(frames) > 1 and frames[-1].filename.startswith(_PACKAGE_DIR):
            frames.pop()
    lines = ["Traceback (most recent call last):\n"]
    for frame in frames:
        where = labels.get(frame.filename)
        if where:
            lines.append(f"  {where}, line {frame.lineno}, in {frame.name}\n")
        else:
            lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n')
        if frame.line:
            lines.append(f"    {frame.line.strip()}\n")
    lines.extend(traceback.format_exception_only(type(exc), exc))
    return "".join(lines)


def summary(exc: BaseException) -> str:
    """``TypeName: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
