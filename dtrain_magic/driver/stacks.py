"""Where each rank is: its Python stack, collected while it runs, and the one line that says it.

Every worker registers a stack file before its `Hello` (`worker.pulse.install_stack_dump`; the `Hello` names
the file). `StackCollector.collect` dumps the ranks at once, in parallel, and waits at most ``timeout``:

- a rank on this machine (the local backend, Spark local mode, a local Ray): the notebook signals the pid and
  reads what ``faulthandler`` appended to the file (`procfacts.dump_stacks`);
- a rank the backend reaches its own way: the launcher's ``dump_stacks`` (`RunningJob.dump_stacks`): Spark asks
  each worker's watchdog, on the worker's host, over the rank watch; Ray runs a task on the worker's node. What
  neither reaches is said so ("on host h: out of this notebook's reach").

`parse_dump` turns a dump into threads of frames (faulthandler prints the innermost call first); `RankStack`
renders a rank as a traceback with the notebook's cell labels (``Cell In[3], line 4, in train``) and the source
lines, and says in one line where it is (``rank 0 waits in all_reduce at Cell In[3], line 4``).
"""

from __future__ import annotations

import linecache
import os
import re
import socket
import sysconfig
import threading
from dataclasses import dataclass, field
from typing import Callable

from .. import procfacts
from ..channel import Hello
from ..errors import log_dropped

DUMP_TIMEOUT_S = 1.2  # with the round trip, a collection stays within 2 s even when a rank does not answer
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<fn>.*?)\s*$')
_HEADER = re.compile(rf"^{re.escape(procfacts.HEADER)}: rank (\d+) pid (\d+) thread (0x[0-9a-fA-F]+)")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                      if p)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


@dataclass(frozen=True)
class Worker:
    """What a rank's `Hello` said about its process."""

    rank: int
    pid: int
    host: str
    stack_file: str
    node: str = ""
    start: int | None = None  # its start time (clock ticks), when on this machine: pids are reused

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()


def parse_dump(text: str) -> tuple[int | None, dict[int, list[Frame]]]:
    """(the training thread's id from the file's header, thread id → frames innermost first)."""
    training = None
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            training = int(header.group(3), 16)
            continue
        thread = _THREAD.match(line)
        if thread:
            current = threads.setdefault(int(thread.group(2), 16), [])
            current.clear()  # a later dump of the same thread replaces an earlier one
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(frame.group("file"), int(frame.group("line")), frame.group("fn")))
        elif not line.strip():
            current = None
    return training, threads


_INSTALLED = re.compile(r"[/\\](?:site-packages|dist-packages|lib[/\\]python3\.\d+|dtrain_magic)[/\\]")


def is_library(file: str) -> bool:
    """A frame of the standard library, an installed package or dtrain_magic itself, not the user's code (paths
    from another machine too: its installation may be elsewhere)."""
    if not file or file.startswith("<"):
        return file.startswith("<frozen")
    path = os.path.abspath(file)
    return (path.startswith(_PACKAGE_DIR) or any(path.startswith(d) for d in _LIBRARY_DIRS)
            or _INSTALLED.search(file) is not None)


@dataclass
class RankStack:
    """One rank's stack as collected: ``state`` is ``dumped`` (``frames`` innermost first), ``stopped``, ``no
    answer``, ``gone``, ``no handler``, ``unreachable``, or what ended it (``ended``: ``detail`` says how)."""

    rank: int
    state: str
    frames: list[Frame] = field(default_factory=list)
    other_threads: dict[int, list[Frame]] = field(default_factory=dict)
    detail: str = ""
    worker: Worker | None = None
    raw: str = ""

    def user_frame(self, labels: dict[str, str]) -> Frame | None:
        """The innermost frame of the user's code: a notebook cell, else a file outside the libraries."""
        for frame in self.frames:
            if frame.file in labels:
                return frame
        for frame in self.frames:
            if not is_library(frame.file):
                return frame
        return None

    def where(self, labels: dict[str, str]) -> str:
        """``rank 0 waits in all_reduce at Cell In[3], line 4``, ``rank 1 returned``, ..."""
        who = f"rank {self.rank}"
        if self.state == "ended":
            return f"{who} {self.detail}"
        if self.state != "dumped":
            return f"{who} {_STATE_WORDS.get(self.state, self.state)}{': ' + self.detail if self.detail else ''}"
        if not self.frames:
            return f"{who}: no Python frame on its training thread (it is in native code, or between calls)"
        inner, user = self.frames[0], self.user_frame(labels)
        if user is None:
            return f"{who} waits in {inner.function} ({os.path.basename(inner.file)}, line {inner.line})"
        place = _place(user, labels)
        if user is inner:
            return f"{who} is at {place} (in {user.function})"
        return f"{who} waits in {inner.function} at {place}"

    def render(self, labels: dict[str, str], full: bool = False) -> str:
        """The rank's stack as a traceback (outermost call first, from the user's code on; ``full``: every frame
        and every other thread)."""
        head = self.where(labels)
        if self.worker is not None and self.state != "ended":
            head += f"  [pid {self.worker.pid} on {self.worker.host}]"
        if self.state != "dumped" or not self.frames:
            return head
        lines = [head, "  Traceback (most recent call last):"]
        lines += _frame_lines(self.frames if full else _trimmed(self.frames, labels), labels, "    ")
        if full:
            for ident, frames in sorted(self.other_threads.items()):
                lines.append(f"  Thread 0x{ident:016x} (most recent call last):")
                lines += _frame_lines(frames, labels, "    ")
        return "\n".join(lines)


_STATE_WORDS = {
    "stopped": "is stopped (SIGSTOP, SIGTSTP or a debugger): frozen, no stack",
    "no answer": f"did not answer within {DUMP_TIMEOUT_S:g} s (frozen, or its process blocks signals)",
    "gone": "has no process any more",
    "no handler": "has no stack dump (its stack file could not be made)",
    "unreachable": "is out of this notebook's reach",
}


def _place(frame: Frame, labels: dict[str, str]) -> str:
    label = labels.get(frame.file)
    return f"{label}, line {frame.line}" if label else f"{frame.file}, line {frame.line}"


def _trimmed(frames: list[Frame], labels: dict[str, str]) -> list[Frame]:
    """The user's call tree: the frames inside the worker's call of the function (``run.py``'s `_call`), as a
    worker's traceback shows (dtrain_magic's harness and the backend's frames above it left out); without that
    frame, from the outermost notebook cell frame."""
    for index, frame in enumerate(frames):  # innermost first
        if frame.function == _HARNESS_CALL and frame.file.replace("\\", "/").endswith(_HARNESS_FILE):
            return frames[:index] or frames
    cells = [index for index, frame in enumerate(frames) if frame.file in labels]
    return frames[: cells[-1] + 1] if cells else frames


_HARNESS_FILE, _HARNESS_CALL = "dtrain_magic/worker/run.py", "_call"  # where run_worker calls the user's function


def _frame_lines(frames: list[Frame], labels: dict[str, str], indent: str) -> list[str]:
    out = []
    for frame in reversed(frames):  # outermost first, as Python's tracebacks
        label = labels.get(frame.file)
        out.append(f"{indent}{label}, line {frame.line}, in {frame.function}" if label
                   else f'{indent}File "{frame.file}", line {frame.line}, in {frame.function}')
        source = linecache.getline(frame.file, frame.line).strip()
        if source:
            out.append(f"{indent}  {source}")
    return out


def rank_stack(rank: int, state: str, text: str, worker: Worker | None) -> RankStack:
    """A `RankStack` from a dump's text (the training thread's frames, the others apart)."""
    if state != "dumped":
        return RankStack(rank, state, worker=worker)
    training, threads = parse_dump(text)
    if training is None and worker is not None and worker.stack_file and worker.here:
        training, _ = parse_dump(_header(worker.stack_file))
    frames = threads.pop(training, None) if training is not None else None
    if frames is None and threads:  # no header: the thread that runs the user's code, else the first
        ident = next((i for i, f in threads.items() if any(not is_library(x.file) for x in f)), next(iter(threads)))
        frames = threads.pop(ident)
    return RankStack(rank, "dumped", frames or [], threads, worker=worker, raw=text)


def _header(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.readline()
    except OSError:
        return ""


RemoteDump = Callable[[dict[int, Worker], float], dict[int, tuple[str, str]]]


class StackCollector:
    """Every rank's stack on demand (`collect`), from the `Hello`s of the run's workers (`saw`)."""

    def __init__(self, labels: dict[str, str] | None = None, remote: RemoteDump | None = None):
        self.labels = dict(labels or {})
        self.remote = remote  # the launcher's way to reach ranks (RunningJob.dump_stacks), or None
        self.workers: dict[int, Worker] = {}
        self._lock = threading.Lock()  # one collection at a time: dumps append to the same files
        self.cgroup_kills_at_start = procfacts.cgroup_oom_kills()

    def saw(self, hello: Hello) -> None:
        start = procfacts.start_time(hello.pid) if hello.host == socket.gethostname() else None
        self.workers[hello.rank] = Worker(hello.rank, hello.pid, hello.host, hello.stack_file, hello.node, start)

    def collect(self, ranks: list[int] | None = None, timeout: float = DUMP_TIMEOUT_S) -> dict[int, RankStack]:
        """Dump ``ranks`` (default: every rank that said hello) at once; rank → `RankStack`, within ``timeout``
        (plus the launcher's round trip for ranks it reaches)."""
        wanted = {rank: worker for rank, worker in dict(self.workers).items() if ranks is None or rank in ranks}
        with self._lock:
            answers: dict[int, tuple[str, str]] = {}
            if self.remote is not None and wanted:
                try:
                    answers.update(self.remote(wanted, timeout))
                except Exception as exc:  # a launcher's way failing leaves the direct one
                    log_dropped(__name__, "StackCollector.collect", exc)
            direct = {rank: (worker.pid, worker.stack_file) for rank, worker in wanted.items()
                      if rank not in answers and worker.here and self._same_process(worker)}
            for rank, (state, text) in procfacts.dump_stacks(direct, timeout).items():
                if state == "dumped":
                    text = _header(wanted[rank].stack_file) + text
                answers[rank] = (state, text)
        stacks = {}
        for rank, worker in sorted(wanted.items()):
            state, text = answers.get(rank, ("unreachable" if not worker.here else "gone", ""))
            stack = rank_stack(rank, state, text, worker)
            if state == "unreachable":
                stack.detail = f"on host {worker.host}, which neither this notebook nor the backend can signal"
            stacks[rank] = stack
        return stacks

    @staticmethod
    def _same_process(worker: Worker) -> bool:
        return worker.start is None or procfacts.start_time(worker.pid) in (worker.start, None)

    def death_evidence(self, rank: int) -> tuple[str, RankStack | None] | None:
        """For a rank whose process ended without reporting, on this machine: what its stack file and the kernel
        say (a fatal signal with where it happened, an out-of-memory kill, the signal its exit watch saw), ("",
        None) when nothing; None when the rank is not on this machine (nothing could be looked at)."""
        worker = self.workers.get(rank)
        if worker is None or not worker.here:
            return None
        text = procfacts.read_stack_file(worker.stack_file)
        fatal = procfacts.fatal_signal(text)
        if fatal is not None:
            stack = rank_stack(rank, "dumped", _header(worker.stack_file) + fatal[1], worker)
            return f"killed by {fatal[0]}", stack
        oom = procfacts.oom_evidence(worker.pid, self.cgroup_kills_at_start)
        return oom or procfacts.read_exit_file(worker.stack_file, worker.start) or "", None

    def cleanup(self) -> None:
        """Remove the stack files on this machine of ranks whose process is gone (a rank that returned removed
        its own; one that was killed could not)."""
        for worker in self.workers.values():
            if worker.here and worker.stack_file and procfacts.process_state(worker.pid) in ("gone", "zombie"):
                for path in (worker.stack_file, procfacts.exit_file_path(worker.stack_file)):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass


def whereabouts(stacks: dict[int, RankStack], labels: dict[str, str]) -> str:
    """Every rank in one line: ``rank 0 waits in all_reduce at Cell In[3], line 4; rank 1 returned``."""
    return "; ".join(stacks[rank].where(labels) for rank in sorted(stacks))


def render_all(stacks: dict[int, RankStack], labels: dict[str, str], full: bool = False) -> str:
    return "\n\n".join(stacks[rank].render(labels, full) for rank in sorted(stacks))


def ended_stack(rank: int, how: str) -> RankStack:
    return RankStack(rank, "ended", detail=how)


def merge_ended(stacks: dict[int, RankStack], ended: dict[int, str]) -> dict[int, RankStack]:
    """``stacks`` with the ranks that ended (rank → "returned", "failed: ...") said so, in rank order."""
    merged = dict(stacks)
    for rank, how in ended.items():
        merged[rank] = ended_stack(rank, how)
    return dict(sorted(merged.items()))


__all__ = ["Frame", "RankStack", "StackCollector", "Worker", "merge_ended", "parse_dump", "render_all",
           "whereabouts"]
