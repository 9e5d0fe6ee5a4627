"""The kernel's backend log: where what the backends the magic started print goes, instead of the cell.

A cell shows the ranks' output and the magic's own lines. What Spark's JVM (start-up lines, log4j, stage bars, its
exit), TorchDistributor's logger and torchrun's launch, and the Ray the magic starts print is neither, and goes to
one file per kernel process, `path()`: ``$DTRAIN_MAGIC_LOG_DIR/backend-<pid>.log``, by default under
``<temp dir>/dtrain_magic-logs-<uid>/`` (docs/reliability.md). A run takes its slice of it (`mark` when it starts,
`since` when it ends): attached to its MLflow run as ``logs/backend.txt``, its last lines shown in the cell when
the run fails, all of it with ``--verbose`` (`shown`).

Nothing here starts a backend: `fds_to_log` is what a launcher wraps around starting a process whose output
should land here for its whole life (the JVM inherits fds 1 and 2 when it starts), `logger` and `stream` what it
hands to a library that would print.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterator, TextIO

LOG_DIR_ENV = "DTRAIN_MAGIC_LOG_DIR"
FAILURE_LINES = 20  # lines of the run's slice shown in the cell when it fails
_SLICE_LIMIT = 2_000_000  # bytes of a run's slice kept (the MLflow artifact); the rest is in the file

_lock = threading.Lock()
_streams: dict[str, TextIO] = {}  # path → its appending stream (one per log; a new one if $DTRAIN_MAGIC_LOG_DIR moves)
_handlers: dict[str, logging.Handler] = {}  # path → the handler writing records there


def path() -> str:
    """This kernel process's backend log (the file may not exist yet: nothing was written to it)."""
    directory = os.environ.get(LOG_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"dtrain_magic-logs-{os.getuid()}")
    return os.path.join(directory, f"backend-{os.getpid()}.log")


def _open_fd() -> int:
    """The log opened for appending: created 0600 in a 0700 directory of the user's (a JVM's or Ray's lines are the
    user's alone). OSError when that directory is someone else's, open to others or a link."""
    file = path()
    directory = os.path.dirname(file)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if os.path.islink(directory) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{directory} is not private to this user: no backend log there")
    return os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)


def _appending(fallback: TextIO) -> TextIO:
    """The log as a line-buffered text stream; ``fallback`` (where the output went before) when it cannot be had."""
    try:
        return open(_open_fd(), "a", buffering=1, encoding="utf-8", errors="replace")
    except OSError as exc:
        logging.getLogger(__name__).warning("the backends' output stays in the cell: %s", exc)
        return fallback


def stream() -> TextIO:
    """A line-buffered text stream appending to the log (for a library's ``sys.stdout`` writes)."""
    file = path()
    with _lock:
        if file not in _streams:
            _streams[file] = _appending(sys.stdout)
        return _streams[file]


def logger(name: str) -> logging.Logger:
    """``dtrain_magic.backend.<name>``: a logger whose records go to the log only (not to the notebook's handlers,
    nor to Python's last-resort handler, which prints to stderr)."""
    file = path()
    log = logging.getLogger(f"dtrain_magic.backend.{name}")
    with _lock:
        if file not in _handlers:
            _handlers[file] = logging.StreamHandler(_appending(sys.stderr))
            _handlers[file].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.handlers = [_handlers[file]]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


@contextlib.contextmanager
def logger_to_log(name: str) -> Iterator[None]:
    """While inside, the records of the logger ``name`` (a library's, say ``ray``) go to the log only, instead of
    that logger's own handlers (restored after); so do those Python's last-resort handler would print to stderr
    (records of a logger without handlers): ``ray.init(configure_logging=False)`` clears the ``ray`` logger's
    handlers before it warns."""
    library = logging.getLogger(name)
    saved = (library.handlers[:], library.propagate, logging.lastResort)
    ours = logger(name).handlers[0]
    last_resort = logging.StreamHandler(stream())
    last_resort.setLevel(logging.WARNING)  # as Python's own
    last_resort.setFormatter(ours.formatter)
    library.handlers, library.propagate, logging.lastResort = [ours], False, last_resort
    try:
        yield
    finally:
        library.handlers, library.propagate, logging.lastResort = saved


@contextlib.contextmanager
def fds_to_log() -> Iterator[bool]:
    """While inside, this process's fds 1 and 2 point at the log: a process started meanwhile (Spark's JVM) inherits
    them and writes there for its whole life. Restored after; Python's own buffered output is flushed on both sides,
    so what the notebook printed before stays in the cell. Yields False (nothing redirected) when fds 1 and 2
    cannot be duplicated (closed, as in a daemon)."""
    _flush_std()
    try:
        log_fd = _open_fd()
    except OSError as exc:
        logging.getLogger(__name__).debug("backend log not opened (%s): output left where it goes", exc)
        yield False
        return
    saved: list[int] = []
    try:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
    except OSError as exc:
        logging.getLogger(__name__).debug("fds 1/2 not redirected (%s)", exc)
        _restore(saved, log_fd)
        yield False
        return
    try:
        yield True
    finally:
        _flush_std()
        _restore(saved, log_fd)


def _restore(saved: list[int], log_fd: int) -> None:
    for fd, original in zip((1, 2), saved, strict=False):  # (only fd 1 was saved when dup(2) failed)
        os.dup2(original, fd)
    for fd in (*saved, log_fd):
        os.close(fd)


def _flush_std() -> None:
    for std in (sys.stdout, sys.stderr):
        try:
            std.flush()
        except (AttributeError, OSError, ValueError):  # closed, or replaced by an object without flush
            pass


@dataclass(frozen=True)
class Mark:
    """Where the log ended when a run started: its slice is what was written after (`since`)."""

    file: str
    offset: int


def mark() -> Mark:
    """The log's current end, for a run that starts now."""
    file = path()
    try:
        return Mark(file, os.path.getsize(file))
    except OSError:
        return Mark(file, 0)


def since(start: Mark, limit: int = _SLICE_LIMIT) -> str:
    """What was written to the log since ``start`` (text; "" when nothing was). A slice over ``limit`` bytes keeps
    its last ``limit`` bytes, after a line that says how much was left out and where all of it is. The slice holds
    whatever the kernel's backends wrote meanwhile: another run's lines too, when two runs overlap."""
    try:
        with open(start.file, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = start.offset if start.offset <= size else 0  # the file was replaced since: all of the new one
            skipped = max(0, size - offset - limit)
            file.seek(offset + skipped)
            data = file.read(size - offset - skipped)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if skipped:
        text = text.split("\n", 1)[-1]  # from the first whole line
        return f"[{skipped} bytes before this left out; the whole log is {start.file}]\n{text}"
    return text


def artifacts(start: Mark) -> dict[str, str]:
    """The slice since ``start`` as the MLflow artifact a run or session keeps (``logs/backend.txt``); {} when the
    backends wrote nothing meanwhile."""
    text = since(start)
    return {"logs/backend.txt": text} if text else {}


def shown(start: Mark, failed: bool, verbose: bool, lines: int = FAILURE_LINES) -> str | None:
    """What the cell shows of a run's slice: all of it with ``--verbose``, its last ``lines`` when the run failed,
    else nothing (None); also None when the backends wrote nothing during the run."""
    if not (failed or verbose):
        return None
    text = since(start).rstrip("\n")
    if not text.strip():
        return None
    every = text.split("\n")
    if verbose:
        return f"what the backends printed during this run (in {start.file}):\n" + "\n".join(every)
    last = every[-lines:]
    which = f"the last {len(last)} lines" if len(every) > len(last) else "the lines"
    return (f"{which} the backends printed during this run (in {start.file}; --verbose shows them all):\n"
            + "\n".join(last))
