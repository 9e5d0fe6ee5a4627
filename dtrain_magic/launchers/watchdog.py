"""A worker's (or a backend instance's) life, tied to the notebook's by a separate small process.

A Python thread cannot do this job: a worker can block forever in native code that holds the GIL (a DDP
reducer's destructor joining gloo threads whose peer is gone), and then no thread of that process runs
again. This module runs as its own interpreter (``python -S -I watchdog.py ...``: the standard library
only, no site packages, so it starts in a few milliseconds and never imports torch), so it acts
whatever the watched process is doing. Two modes:

``rank-watch HOST PORT RANK PID [STACK_FILE]`` (authkey as hex on the first stdin line)
    For a worker on any host (Spark's torchrun processes, local or on executors): connect to the
    notebook's rank watch (authenticated ``multiprocessing.connection``) and send `rank_started`. The
    worker writes ``done`` to our stdin when it ended in Python (result or reported error): we send
    `rank_done`; its exit closes our stdin. If the notebook's side closes (run over, cancelled, notebook
    process gone), the worker PID is SIGKILLed. If the worker dies first, we send `rank_died` with what its
    host says (the signal that killed it, which its parent keeps to itself: `procfacts.ended_status`; a
    fatal signal Python caught; an out-of-memory kill), and our connection closes without `rank_done`,
    which tells the notebook that the worker died without reporting. The notebook may
    ask for the worker's stacks (`stack_request`): we signal it and answer `stack_reply` with its dump, so
    the stacks of a worker on another host reach the notebook through us.

``exit-watch PID STACK_FILE``
    For a worker whose parent keeps its exit status to itself (a Ray Train worker: the raylet reaps it): the
    worker writes ``done`` to our stdin when it ended in Python; if its exit closes our stdin first, we write
    the signal that killed it next to its stack file (`procfacts.write_exit_file`), where the notebook looks
    when Ray reports the worker dead.

``sweep KEY=VALUE [--rmtree DIR]``
    For a backend instance the magic started on this machine (its local Ray): when our stdin closes
    (the notebook closed it at shutdown, or its process went away), SIGKILL every process started with
    ``KEY=VALUE`` in its environment (set while the instance starts, so all of its processes inherit it;
    their command lines are rewritten by setproctitle, their environments are not) and remove DIR.
    Ray's own fate-sharing stops its GCS and raylet with the notebook, but not its agents.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


# The rank watch's messages in the channel's wire form (``dtrain_magic.channel.RankStarted`` / ``RankDone``,
# `Message.wire`): this module runs without the package, so it writes the tuples itself; a unit test
# checks that they are what the channel's classes send and decode.
def rank_started(rank: int) -> tuple:
    return ("start", rank)


def rank_done(rank: int) -> tuple:
    return ("done", rank)


def rank_died(rank: int, evidence: str) -> tuple:
    return ("died", rank, evidence)


def stack_request(serial: int) -> tuple:
    return ("stacks?", serial)


def stack_reply(rank: int, serial: int, state: str, text: str) -> tuple:
    return ("stacks", rank, serial, state, text)


def procfacts():
    """``dtrain_magic/procfacts.py`` (standard library only), loaded by path: this process has no package."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "procfacts.py")
    spec = importlib.util.spec_from_file_location("dtrain_magic_procfacts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(*args: str) -> list[str]:
    """The command line that runs this watchdog with ``args``."""
    return [sys.executable, "-S", "-I", HERE, *args]


def start(*args: str, secret: bytes | None = None) -> subprocess.Popen:
    """Start a watchdog in its own session (no signal for the notebook's or the worker's group reaches
    it); its stdin is a pipe that only the caller holds (the pipe is not inherited by other children)."""
    proc = subprocess.Popen(
        command(*args), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    if secret is not None:
        proc.stdin.write(secret.hex().encode() + b"\n")
        proc.stdin.flush()
    return proc


def tell_done(proc: subprocess.Popen | None, wait: bool = False) -> None:
    """Tell a rank's watchdog (``rank-watch``, ``exit-watch``) that its worker ended in Python (a result or a
    reported error), not killed; ``wait``: for the watchdog to exit (no zombie left in a long-lived worker)."""
    if proc is None:
        return
    try:
        proc.stdin.write(b"done\n")
        proc.stdin.flush()
        if wait:
            proc.stdin.close()
            proc.wait(5.0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _rank_watch(host: str, port: int, rank: int, pid: int, stack_file: str) -> None:
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    stdin = sys.stdin.buffer
    secret = bytes.fromhex(stdin.readline().strip().decode())
    try:
        conn = Client((host, port), authkey=secret)
        conn.send(rank_started(rank))
    except (OSError, EOFError, AuthenticationError):
        _kill(pid)  # the notebook is not there (any more): nothing this worker does can reach it
        return
    facts = procfacts()
    oom_kills_before = facts.cgroup_oom_kills()
    started, pidfd = facts.start_time(pid), facts.open_pidfd(pid)
    fd = stdin.fileno()
    done = False
    try:
        while True:
            readable, _, _ = select.select([conn.fileno(), fd], [], [])
            if conn.fileno() in readable:
                try:
                    request = conn.recv()
                except Exception:  # the notebook's side closed: the run is over, or the notebook is gone
                    _kill(pid)
                    return
                if isinstance(request, tuple) and request[:1] == ("stacks?",):
                    _answer_stacks(conn, facts, rank, request[1], pid, stack_file)
                continue
            data = os.read(fd, 256)
            if not data:  # the worker exited: our connection closes (without rank_done if it died)
                if not done:
                    signame = facts.killed_by(facts.ended_status(pid, started, pidfd))
                    _report_death(conn, facts, rank, pid, stack_file, oom_kills_before, signame)
                return
            if b"done" in data:
                done = True
                try:
                    conn.send(rank_done(rank))
                except (OSError, ValueError):
                    pass  # the notebook closed the watch: the run is over, the next select sees it
    finally:
        if stack_file:
            try:
                os.unlink(stack_file)
            except OSError:
                pass


def _answer_stacks(conn, facts, rank: int, serial: int, pid: int, stack_file: str) -> None:
    state, text = facts.dump_stacks({0: (pid, stack_file)})[0]
    if state == "dumped":
        text = _first_line(stack_file) + text
    try:
        conn.send(stack_reply(rank, serial, state, text))
    except (OSError, ValueError):
        pass  # the notebook closed the watch while the stacks were read: nobody waits for them


def _report_death(conn, facts, rank: int, pid: int, stack_file: str, oom_kills_before, signame: str | None) -> None:
    evidence = facts.death_evidence(pid, stack_file, oom_kills_before, signame)
    fatal = facts.fatal_signal(facts.read_stack_file(stack_file)) if stack_file else None
    if fatal is not None:
        evidence += "\n" + _first_line(stack_file) + fatal[1]
    try:
        conn.send(rank_died(rank, evidence))
    except (OSError, ValueError):
        pass  # the notebook is gone: nobody to tell; the closed connection says the rank died anyway


def _first_line(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.readline()
    except OSError:
        return ""


def _exit_watch(pid: int, stack_file: str) -> None:
    facts = procfacts()
    started, pidfd = facts.start_time(pid), facts.open_pidfd(pid)
    fd = sys.stdin.buffer.fileno()
    while data := os.read(fd, 256):
        if b"done" in data:
            return  # ended in Python: its own report says how
    signame = facts.killed_by(facts.ended_status(pid, started, pidfd))
    if signame:
        facts.write_exit_file(stack_file, started, signame)


def processes_with_env(entry: str) -> list[int]:
    """Pids of this machine's processes started with ``entry`` (``KEY=VALUE``) in their environment."""
    found = []
    me = os.getpid()
    wanted = entry.encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/environ", "rb") as handle:
                    if wanted in handle.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    return found


def _sweep(entry: str, rmtree: str | None) -> None:
    while sys.stdin.buffer.read(4096):
        pass
    if os.path.isdir("/proc"):
        for _ in range(3):  # a process that was being started during the first pass
            for pid in processes_with_env(entry):
                _kill(pid)
            time.sleep(0.2)
    if rmtree:
        shutil.rmtree(rmtree, ignore_errors=True)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if argv[0] == "rank-watch":
        _rank_watch(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5] if len(argv) > 5 else "")
    elif argv[0] == "exit-watch":
        _exit_watch(int(argv[1]), argv[2])
    elif argv[0] == "sweep":
        rmtree = argv[3] if len(argv) > 3 and argv[2] == "--rmtree" else None
        _sweep(argv[1], rmtree)


if __name__ == "__main__":
    main(sys.argv[1:])
