"""Short tracebacks: the user's frames only, notebook cells shown as ``Cell In[N], line L``."""

from __future__ import annotations

import os
import re
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


def summary(exc: BaseException, limit: int | None = None, sentence: bool = False) -> str:
    """An exception in one line: ``TypeName: first line of its message`` (the only "exception to one line"
    helper; every backend's diagnostics use it). ``limit``: at most that many characters (ends with "…").
    ``sentence``: the message's first sentence instead, without the type name, for libraries whose
    messages name the problem themselves and run on over several lines (MLflow's)."""
    if sentence:
        text = " ".join(str(exc).split()) or type(exc).__name__
        line = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    else:
        lines = [part.strip() for part in str(exc).splitlines() if part.strip()]
        line = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if limit is not None and len(line) > limit:
        return line[: limit - 1] + "…"
    return line
