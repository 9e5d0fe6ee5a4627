"""What can be learnt about a worker process from outside it, on its own machine: its Python stacks, whether it
is stopped, whether the kernel killed it for memory. Standard library only: the watchdog (``python -S -I``,
no package) loads this file by path, and the notebook imports it as ``dtrain_magic.procfacts``.

Stacks: every worker registers ``faulthandler`` on `STACK_SIGNAL` (and for fatal signals) with a file of its
own, `stack_file_path` (a 0700 directory of the user's under the temp dir; the first line names the rank,
the pid and the training thread). `faulthandler` writes from a C signal handler, without the GIL, so a rank
blocked in native code that holds the GIL (a gloo collective, a destructor joining threads) still answers;
one stopped by SIGSTOP does not, and its state says so. `dump_stacks` sends the signal and reads what was
appended. SIGUSR1 is left alone: SLURM and Lightning use it.

Kills: a process's exit status goes to its parent alone (torchrun, Ray's raylet, the local fork server), so
when the parent does not say, a fatal signal Python caught is read from the stack file (``Fatal Python
error: Segmentation fault``), and an out-of-memory kill from the kernel log (``/dev/kmsg``, when readable) or
the cgroup's ``oom_kill`` counter (`oom_evidence`).
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time

STACK_SIGNAL = signal.SIGUSR2
HEADER = "dtrain_magic stacks"
_SETTLE_S = 0.1  # a dump is written in one go, in well under this: the file stopped growing


def stack_dir() -> str | None:
    """``<temp dir>/dtrain_magic-stacks-<uid>``, private (0700) and ours; None when it cannot be had safely."""
    path = os.path.join(tempfile.gettempdir(), f"dtrain_magic-stacks-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not os.path.isdir(path) or os.path.islink(path) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # someone else's, or open to others: no stacks rather than a file others can replace
    return path


def stack_file_path(pid: int) -> str | None:
    """Where the process ``pid`` writes its stacks (the same path for the worker and its watchdog)."""
    directory = stack_dir()
    return os.path.join(directory, f"{pid}.txt") if directory else None


def open_stack_file(path: str):
    """The stack file, created anew (0600, no symlink followed), opened for appending: each dump is added at the
    end, so a reader takes what follows the size it saw before signalling."""
    try:
        os.unlink(path)  # a file of an earlier process with the same pid
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)
    return os.fdopen(fd, "a", buffering=1)


def process_state(pid: int) -> str:
    """``running``, ``stopped`` (SIGSTOP, SIGTSTP, a debugger), ``zombie`` or ``gone``, from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process: pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def catches(pid: int, signum: int) -> bool | None:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt`` in ``/proc``): sending it a signal nobody handles
    would kill it. None when ``/proc`` cannot say (not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        return None
    return None


def dump_stacks(targets: dict, timeout: float = 1.2, signum: int = STACK_SIGNAL) -> dict:
    """Dump the stacks of several processes at once. ``targets``: key → (pid, stack file). Returns key → (state,
    text): ``dumped`` with the new part of the file, or ``stopped``, ``gone``, ``no handler`` (the process never
    registered one: not signalled), ``no answer`` (nothing within ``timeout``: blocked with signals masked)."""
    results: dict = {}
    waiting: dict = {}
    for key, (pid, path) in targets.items():
        state = process_state(pid)
        if state in ("gone", "zombie"):
            results[key] = ("gone", "")
            continue
        if catches(pid, signum) is False or not path:
            results[key] = ("no handler", "")
            continue
        if state == "stopped":  # a signal would wait for SIGCONT: nothing will be written
            results[key] = ("stopped", "")
            continue
        try:
            size = os.path.getsize(path)
            os.kill(pid, signum)
        except OSError:
            results[key] = ("gone", "")
            continue
        waiting[key] = (pid, path, size, None, size)  # (pid, path, size before, when it last grew, last size)
    deadline = time.monotonic() + timeout
    while waiting:
        now = time.monotonic()
        for key, (pid, path, before, grew_at, last) in list(waiting.items()):
            try:
                size = os.path.getsize(path)
            except OSError:
                size = last
            if size != last:
                waiting[key] = (pid, path, before, now, size)
            elif grew_at is not None and now - grew_at >= _SETTLE_S:
                results[key] = ("dumped", _read_from(path, before))
                del waiting[key]
        if now > deadline:
            for key, (pid, path, before, grew_at, _) in waiting.items():
                if grew_at is not None:
                    results[key] = ("dumped", _read_from(path, before))
                else:
                    results[key] = ("stopped" if process_state(pid) == "stopped" else "no answer", "")
            break
        time.sleep(0.02)
    return results


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def read_stack_file(path: str) -> str:
    """The whole file (its header, then every dump and fatal error appended since the worker registered)."""
    return _read_from(path, 0) if path else ""


_FATAL = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
_FATAL_NAMES = {"Segmentation fault": "SIGSEGV", "Floating point exception": "SIGFPE", "Aborted": "SIGABRT",
                "Bus error": "SIGBUS", "Illegal instruction": "SIGILL"}


def fatal_signal(text: str) -> tuple[str, str] | None:
    """(signal name, the dump that follows) when the file holds Python's report of a fatal signal."""
    matches = list(_FATAL.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    what = last.group(1).strip()
    return _FATAL_NAMES.get(what, what), text[last.end():]


# -- out-of-memory kills --------------------------------------------------------------------------------------

_KMSG_KILLED = re.compile(r"(?:Killed process|oom-kill:.*?\bpid=)\s*(\d+)")


def kernel_oom_kills(pids: set, max_records: int = 20000) -> set:
    """Which of ``pids`` the kernel log says the OOM killer killed (``/dev/kmsg``; an empty set when the log is
    not readable, as for most unprivileged users)."""
    found: set = set()
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return found
    try:
        for _ in range(max_records):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not record:
                break
            text = record.decode("utf-8", "replace")
            if "Killed process" in text or "oom-kill" in text:
                for match in _KMSG_KILLED.finditer(text):
                    if int(match.group(1)) in pids:
                        found.add(int(match.group(1)))
    finally:
        os.close(fd)
    return found


def cgroup_oom_kills(pid: int | str = "self") -> int | None:
    """The ``oom_kill`` counter of ``pid``'s memory cgroup (v2 ``memory.events``, v1 ``memory.oom_control``);
    None when there is none to read."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    for candidate in candidates:
        try:
            with open(candidate) as handle:
                for line in handle:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def oom_evidence(pid: int, cgroup_kills_before: int | None) -> str:
    """Why we think the kernel killed ``pid`` for memory, or "": the kernel log names it, or the cgroup's OOM kill
    count grew since ``cgroup_kills_before``."""
    if pid in kernel_oom_kills({pid}):
        return "out of memory: the kernel's OOM killer killed it (kernel log)"
    after = cgroup_oom_kills()
    if cgroup_kills_before is not None and after is not None and after > cgroup_kills_before:
        return (f"out of memory: its memory cgroup's OOM killer killed {after - cgroup_kills_before} process(es) "
                "during the run (oom_kill counter)")
    return ""


def death_evidence(pid: int, stack_file: str, cgroup_kills_before: int | None) -> str:
    """What the machine says about a worker that ended without reporting: a fatal signal Python caught (with
    where), an out-of-memory kill, or ""."""
    fatal = fatal_signal(read_stack_file(stack_file)) if stack_file else None
    if fatal is not None:
        return f"killed by {fatal[0]}"
    return oom_evidence(pid, cgroup_kills_before)
