"""A session's rank: `serve`, the function each rank runs the way a run's workers run theirs.

The notebook starts a session as a run whose function is ``serve(ctx, address)``: ``run_worker`` connects the rank
to the run's channel (its output goes there), joins the process group, seeds, builds the strategy and ``ctx``, then
calls ``serve``, which connects to the session's listener in the notebook (``address``: host, port, secret) and runs
what the notebook sends there until `StopSession`, in one namespace that lives as long as the rank (``ctx`` in it).

Each command runs on the rank's thread (the process's main thread on local and Spark, Ray Train's training thread
on Ray) while a reader thread keeps reading the connection: `InterruptCell` raises KeyboardInterrupt where the
command runs (a SIGINT to the main thread, which also ends a ``time.sleep``; on another thread an asynchronous
exception, seen at its next Python instruction). A rank blocked in native code (a collective waiting for a rank that
is not in it) cannot be freed this way: the notebook says so. Whatever a command does, its output, then one
`CellDone`, go over the run's channel; the rank then waits for the next command.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import linecache
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Client
from typing import Any, Callable

import cloudpickle

from ..channel import Message, Status, decode
from ..errors import log_dropped, short_traceback, summary
from .protocol import (
    FAILED,
    INTERRUPTED,
    OK,
    CellDone,
    InterruptCell,
    PullValue,
    PushValues,
    RunCell,
    SessionReady,
    StopSession,
)
from .values import pack


def serve(ctx: Any, address: tuple) -> None:
    """Serve the notebook's commands on this rank until the session stops (or the notebook goes)."""
    host, port, authkey = address
    # The run's channel is ctx's own link: a command's CellDone follows its output on the same connection.
    rank = RankSession(ctx, Client((host, port), authkey=authkey), ctx._send)
    try:
        rank.serve()
    finally:
        rank.close()


class RankSession:
    """One rank's side of a session: its namespace, the connection commands come on (``conn``), where its answers go
    (``send``: the run's channel), and the command in progress."""

    def __init__(self, ctx: Any, conn: Any, send: Callable[[Message], None]):
        self.ctx, self.rank = ctx, ctx.rank
        self.send = send
        self.conn = conn
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, "ctx": ctx}
        self.labels: dict[str, str] = {}  # cell file name → "Cell In[N]", for tracebacks
        self.commands: "queue.Queue[Message | None]" = queue.Queue()
        self._lock = threading.Lock()
        self.current: int | None = None  # the command running now
        self._interrupted: set[int] = set()  # commands interrupted before they started
        self._thread = threading.get_ident()
        self._by_signal = False  # SIGINT reaches the command (main thread) rather than an asynchronous exception
        self._previous_handler: Any = None
        self._reader: threading.Thread | None = None

    # -- the loop -----------------------------------------------------------------------------------------------
    def serve(self) -> None:
        self._thread = threading.get_ident()  # commands run on the thread that serves
        self.conn.send(SessionReady(self.rank, os.getpid(), socket.gethostname()).wire())
        self._reader = threading.Thread(target=self._read, name="dtrain-session-commands", daemon=True)
        self._reader.start()
        self._listen_for_sigint()
        while True:
            command = self.commands.get()
            if command is None or isinstance(command, StopSession):
                return
            self.execute(command)

    def _read(self) -> None:
        """Commands into the queue; an interrupt acts at once. The connection's end (a stop, or the notebook gone)
        ends the loop, after interrupting what still runs."""
        try:
            while True:
                command = decode(self.conn.recv())
                if isinstance(command, InterruptCell):
                    self.interrupt(command.cell_id)
                else:
                    self.commands.put(command)
        except Exception as exc:  # EOF: the notebook closed the session's connection
            log_dropped(__name__, "_read", exc)
        self.interrupt(None)
        self.commands.put(None)

    def close(self) -> None:
        if self._by_signal:
            try:
                signal.signal(signal.SIGINT, self._previous_handler)
            except (ValueError, TypeError) as exc:
                log_dropped(__name__, "close", exc)
        # The reader is blocked reading the connection: shut the socket down so its read ends (closing the descriptor
        # alone would leave it reading whatever connection gets that number next), then close it.
        try:
            with socket.fromfd(self.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError) as exc:  # closed already
            log_dropped(__name__, "close", exc)
        if self._reader is not None:
            self._reader.join(2.0)
        try:
            self.conn.close()
        except OSError as exc:
            log_dropped(__name__, "close", exc)

    # -- interrupts -----------------------------------------------------------------------------------------------
    def _listen_for_sigint(self) -> None:
        """On the main thread, a SIGINT (sent by `interrupt`, or the notebook's own interrupt reaching this process)
        stops the command in progress and nothing else."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            self._by_signal = True
        except (ValueError, OSError) as exc:
            log_dropped(__name__, "_listen_for_sigint", exc)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.current is not None:
            raise KeyboardInterrupt

    def interrupt(self, cell_id: int | None) -> None:
        """Raise KeyboardInterrupt in command ``cell_id`` (None: whatever runs) if it still runs."""
        with self._lock:
            if cell_id is not None and cell_id != self.current:
                self._interrupted.add(cell_id)  # still in the queue: it stops as it starts
                return
            if self.current is None:
                return
            if self._by_signal:
                signal.pthread_kill(self._thread, signal.SIGINT)
            else:
                _raise_in_thread(self._thread, KeyboardInterrupt)

    # -- commands ---------------------------------------------------------------------------------------------------
    def execute(self, command: Message) -> None:
        """Run one command and send its `CellDone` after its output."""
        cell_id = command.cell_id  # type: ignore[attr-defined]
        self.send(Status(self.rank, "running", getattr(command, "label", "") or type(command).__name__))
        outcome, value, said, where, written = OK, None, "", "", ""
        self.ctx.begin_outputs(f"cell_{cell_id}")  # its ctx.write parts: committed at its end, or never
        try:
            self._start(cell_id)
            try:
                result = self._do(command)
            finally:
                self._end()
            value = pack(result, strict=isinstance(command, PullValue))
            written = self.ctx.seal_outputs("the cell has ended")
        except KeyboardInterrupt as exc:
            outcome, said, where = INTERRUPTED, self._interrupted_at(exc), short_traceback(exc, self.labels)
        except BaseException as exc:  # SystemExit too: a cell's exit() must not end the rank
            outcome, said, where = FAILED, summary(exc), short_traceback(exc, self.labels)
        if outcome != OK:
            self.ctx.abort_outputs("the cell has ended")
        for stream in (sys.stdout, sys.stderr):  # a last line without its newline goes out now, before CellDone
            try:
                stream.flush()
            except (OSError, ValueError) as exc:  # the reader is gone or the stream closed
                log_dropped(__name__, "execute", exc)
        self.ctx.flush_metrics()  # the cell's ctx.log values reach the notebook before its end
        # idle before CellDone: the notebook stops handing messages to the monitor at the last CellDone
        self.send(Status(self.rank, "idle", ""))
        self.send(CellDone(self.rank, cell_id, outcome, value, said, where, written))

    def _start(self, cell_id: int) -> None:
        with self._lock:
            if cell_id in self._interrupted:
                self._interrupted.discard(cell_id)
                raise KeyboardInterrupt
            self.current = cell_id

    def _end(self) -> None:
        with self._lock:
            self.current = None
            if not self._by_signal:
                _raise_in_thread(self._thread, None)  # an interrupt that came too late for the command is dropped

    def _do(self, command: Message) -> Any:
        if isinstance(command, RunCell):
            return self.run_source(command.source, command.filename, command.label)
        if isinstance(command, PushValues):
            values = cloudpickle.loads(command.pickled)
            self.namespace.update({name: values[name] for name in command.names})
            return None
        if isinstance(command, PullValue):
            return eval(compile(command.expression, "<pull>", "eval"), self.namespace)
        raise TypeError(f"not a session command: {type(command).__name__}")

    def run_source(self, source: str, filename: str, label: str) -> Any:
        """Run a cell as IPython does: every statement, then the last one's value if it is an expression (None when
        the cell ends with ``;``)."""
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        self.labels[filename] = label
        tree = ast.parse(source, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), self.namespace)
        if last is None:
            return None
        value = eval(compile(ast.Expression(last.value), filename, "eval"), self.namespace)
        if source.rstrip().endswith(";"):
            return None
        if value is not None:
            self.namespace["_"] = value
        return value

    def _interrupted_at(self, exc: BaseException) -> str:
        """``interrupted at Cell In[5], line 4`` (the innermost line of a cell), or ``interrupted``."""
        frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename in self.labels]
        if not frames:
            return "interrupted"
        return f"interrupted at {self.labels[frames[-1].filename]}, line {frames[-1].lineno}"


def _raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise ``exception`` in the thread ``thread_id`` at its next Python instruction (None: cancel one pending);
    Python's C API ``PyThreadState_SetAsyncExc``, for a command on a thread a signal cannot reach."""
    argument = ctypes.py_object(exception) if exception is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), argument)
