"""The messages of an interactive session, added to the channel's protocol (`channel.extend_protocol`).

A session's ranks are a run's workers whose function is `session.worker.serve`: they talk to the notebook over two
connections. The run's channel (`channel.WorkerLink`, as every run) carries what a rank sends: its output, metrics
and status as in any run, and one `CellDone` per command it was given, sent after the command's output, so the
notebook has every line of a cell once its `CellDone` is in. The session's own listener (`session.driver`)
carries what the notebook sends: each rank connects there first (`SessionReady`), then reads `RunCell`,
`PushValues`, `PullValue`, `InterruptCell` and `StopSession`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..channel import Message, extend_protocol

# How a command ended on a rank (`CellDone.outcome`).
OK = "ok"
FAILED = "error"
INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class SessionReady(Message):
    """A rank connected to the session's listener and waits for commands: its rank, pid and host."""

    KIND: ClassVar[str] = "session-ready"
    rank: int
    pid: int
    host: str


@dataclass(frozen=True, slots=True)
class RunCell(Message):
    """Run ``source`` in the rank's namespace (``filename``: its name in tracebacks and ``linecache``, shown as
    ``label``, e.g. ``Cell In[7]``); the value of its last expression comes back."""

    KIND: ClassVar[str] = "session-cell"
    cell_id: int
    source: str
    filename: str
    label: str


@dataclass(frozen=True, slots=True)
class PushValues(Message):
    """Bind ``names`` in the rank's namespace to the values ``pickled`` holds (one cloudpickled dict, pickled once in
    the notebook for every rank)."""

    KIND: ClassVar[str] = "session-push"
    cell_id: int
    names: tuple[str, ...]
    pickled: bytes


@dataclass(frozen=True, slots=True)
class PullValue(Message):
    """Evaluate ``expression`` in the rank's namespace and send its value back (it must pickle)."""

    KIND: ClassVar[str] = "session-pull"
    cell_id: int
    expression: str


@dataclass(frozen=True, slots=True)
class InterruptCell(Message):
    """Stop command ``cell_id`` on the rank (a KeyboardInterrupt where it runs), if it still runs it."""

    KIND: ClassVar[str] = "session-interrupt"
    cell_id: int


@dataclass(frozen=True, slots=True)
class StopSession(Message):
    """Return from the session's function: the rank leaves as a finished run's worker does."""

    KIND: ClassVar[str] = "session-stop"
    reason: str


@dataclass(frozen=True, slots=True)
class CellDone(Message):
    """Command ``cell_id`` ended on ``rank``: ``outcome`` `OK` (``pickled_value``: its value, see
    `session.values.pack`; None when there is none), `FAILED` or `INTERRUPTED` (``summary`` in one line, then
    ``traceback``, trimmed to the cell's frames and labelled ``Cell In[N]``). ``outputs``: what the cell's
    ``ctx.write`` calls wrote, sealed (`dtrain_magic.data.outputs.OutputWriter.seal`), for the notebook to commit."""

    KIND: ClassVar[str] = "session-done"
    rank: int
    cell_id: int
    outcome: str
    pickled_value: bytes | None
    summary: str
    traceback: str
    outputs: str = ""


extend_protocol(SessionReady, RunCell, PushValues, PullValue, InterruptCell, StopSession, CellDone)
