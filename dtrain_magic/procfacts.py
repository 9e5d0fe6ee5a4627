"""What can be learnt about a worker process from outside it, on its own machine: its Python stacks, whether it
is stopped, whether the kernel killed it for memory. Standard library only: the watchdog (``python -S -I``,
no package) loads this file by path, and the notebook imports it as ``dtrain_magic.procfacts``.

Stacks: every worker registers ``faulthandler`` on `STACK_SIGNAL` (and for fatal signals) with a file of its
own, `stack_file_path` (a 0700 directory of the user's under the temp dir; the first line names the rank,
the pid and the training thread). `faulthandler` writes from a C signal handler, without the GIL, so a rank
blocked in native code that holds the GIL (a gloo collective, a destructor joining threads) still answers;
one stopped by SIGSTOP does not, and its state says so. `dump_stacks` sends the signal and reads what was
appended. SIGUSR1 is left alone: SLURM and Lightning use it.

Kills: a process's exit status goes to its parent alone (torchrun, Ray's raylet, the local fork server), and
neither pyspark's torchrun wrapper nor Ray passes it on. So a worker's watchdog reads it as the worker dies:
the kernel shows the status in ``/proc/PID/stat`` from the moment the process starts to exit until its parent
reaps it (`exit_status`: the watchdog wakes when the worker's descriptors close, before torchrun's next poll),
and after that to whoever holds a pidfd of it (`pidfd_exit_status`, Linux 6.15+: the raylet ignores SIGCHLD,
so its workers are reaped the moment they die). Besides, a fatal signal Python caught is read from the stack
file (``Fatal Python error: Segmentation fault``, with where it happened), and an out-of-memory kill from the
kernel log (``/dev/kmsg``, when readable) or the cgroup's ``oom_kill`` counter (`oom_evidence`).
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


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (the state first, field 3 of proc(5)); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_state(pid: int) -> str:
    """``running``, ``stopped`` (SIGSTOP, SIGTSTP, a debugger), ``zombie`` or ``gone``, from ``/proc``."""
    fields = _stat_fields(pid)
    if not fields:
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(fields[0], "running")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process: pids are reused)."""
    try:
        return int(_stat_fields(pid)[19])
    except (IndexError, ValueError):
        return None


def exit_status(pid: int, start: int | None) -> int | None:
    """``pid``'s wait status (as `os.waitpid` gives it) while it exits or waits as a zombie for its parent:
    ``/proc/PID/stat``'s ``exit_code`` (Linux 3.5+; readable by the same user, not only by the parent). None
    while it runs, once its parent reaped it, or when ``start`` (`start_time`) says the pid is another process."""
    fields = _stat_fields(pid)
    try:
        if len(fields) < 50 or (start is not None and int(fields[19]) != start):
            return None
        code = int(fields[49])
    except ValueError:
        return None
    return code if code or fields[0] in ("Z", "X") else None


# ioctl(pidfd, PIDFD_GET_INFO) (Linux 6.15+): a pidfd's holder reads the process's exit status after it was reaped,
# as under a parent that ignores SIGCHLD (Ray's raylet), where no zombie is left to read in /proc.
_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info), its first version: 64 bytes
_PIDFD_INFO_EXIT = 0x8
_PIDFD_EXIT_CODE_AT = 60  # after mask, cgroupid (u64 each) and 11 u32 ids


def open_pidfd(pid: int) -> int | None:
    """A pidfd for the live process ``pid`` (to read its exit status later), or None where there are none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pidfd_info(pidfd: int, mask: int) -> bytearray | None:
    """``struct pidfd_info`` for ``pidfd`` asked with ``mask``; None where the kernel has no PIDFD_GET_INFO."""
    try:
        import fcntl
        import struct

        info = bytearray(64)
        struct.pack_into("Q", info, 0, mask)
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
        return info
    except (ImportError, OSError, ValueError):
        return None


def pidfd_exit_status(pidfd: int | None) -> int | None:
    """The wait status of the process behind ``pidfd`` once it was reaped; None before that or where the
    kernel cannot say."""
    import struct

    info = _pidfd_info(pidfd, _PIDFD_INFO_EXIT) if pidfd is not None else None
    if info is None or not struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("i", info, _PIDFD_EXIT_CODE_AT)[0]


def reaped_status_readable() -> bool:
    """Whether this kernel gives a reaped process's status through a pidfd (PIDFD_GET_INFO, Linux 6.15+)."""
    pidfd = open_pidfd(os.getpid())
    if pidfd is None:
        return False
    try:
        return _pidfd_info(pidfd, _PIDFD_INFO_EXIT) is not None
    finally:
        os.close(pidfd)


def ended_status(pid: int, start: int | None, pidfd: int | None, timeout: float = 1.0) -> int | None:
    """For a watchdog whose worker's descriptors just closed: its wait status, from ``/proc`` before its parent
    reaps it, or from its pidfd after; None when neither says within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        status = exit_status(pid, start)
        if status is None:
            status = pidfd_exit_status(pidfd)
        if status is not None or pidfd is None or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def killed_by(status: int | None) -> str | None:
    """The signal's name (``SIGKILL``) when the wait status says a signal ended the process."""
    if not status or not os.WIFSIGNALED(status):
        return None
    signum = os.WTERMSIG(status)
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_file_path(stack_file: str) -> str:
    """Where a worker's exit watch (`dtrain_magic.launchers.watchdog`, ``exit-watch``) writes how it died."""
    return os.path.splitext(stack_file)[0] + ".exit"


def write_exit_file(stack_file: str, start: int | None, signame: str) -> None:
    """Record that the worker started at ``start`` was killed by ``signame``, next to its stack file."""
    try:
        fd = os.open(exit_file_path(stack_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{start} killed by {signame}\n")
    except OSError:
        pass


def read_exit_file(stack_file: str, start: int | None) -> str | None:
    """``killed by SIGKILL`` when the worker's exit watch recorded it for this very process (same start time)."""
    if not stack_file:
        return None
    try:
        with open(exit_file_path(stack_file)) as handle:
            recorded, _, how = handle.read().strip().partition(" ")
    except OSError:
        return None
    return how if how.startswith("killed by") and (start is None or recorded == str(start)) else None


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


def death_evidence(pid: int, stack_file: str, cgroup_kills_before: int | None, signame: str | None = None) -> str:
    """What the machine says about a worker that ended without reporting: a fatal signal Python caught (with
    where), an out-of-memory kill, the signal that ended it (``signame``, from `exit_status`), or ""."""
    fatal = fatal_signal(read_stack_file(stack_file)) if stack_file else None
    if fatal is not None:
        return f"killed by {fatal[0]}"
    return oom_evidence(pid, cgroup_kills_before) or (f"killed by {signame}" if signame else "")
