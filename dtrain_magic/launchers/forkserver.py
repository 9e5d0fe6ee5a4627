"""The local backend's worker factory: one idle interpreter (torch imported) that forks every run's workers.

Why a fork server rather than spawning interpreters per run:
- a re-run, even one started the instant the last one ended, gets its workers in milliseconds (a fork
  of an interpreter that already imported torch, torch.distributed and what DDP imports lazily), and
  every run still gets new processes: nothing leaks from one run into the next;
- the workers' lives do not depend on any Python thread in the notebook or in the worker. The server is
  a single-threaded select loop; when the notebook process goes (exits, is killed), its end of the
  socket closes and the server SIGKILLs every worker's process group at once, whatever the worker is
  doing (stuck in a C++ destructor that holds the GIL, in a collective whose peer is gone, in a tight
  loop). Every worker also has ``PR_SET_PDEATHSIG=SIGKILL`` towards the server's (only) thread, so a
  killed server takes its workers with it.

The server never runs a tensor operation, starts no thread and initialises no CUDA, so forking it is
safe (the same rule as multiprocessing's forkserver). Protocol: an AF_UNIX SOCK_SEQPACKET socket pair;
each message is one JSON object. Notebook → server: ``{"op": "spawn", "id", "job", "env", "cwd",
"sys_path"}`` with the worker's stdout and stderr pipe ends attached (SCM_RIGHTS). Server → notebook:
``{"op": "ready"}``, ``{"op": "started", "id", "pid"}``, ``{"op": "exit", "pid", "code"}`` (``code`` as
`subprocess.Popen.returncode`: negative for a signal), ``{"op": "failed", "id", "error"}``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from ..errors import log_dropped

_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------------------------------
# The server (``python -m dtrain_magic.launchers.forkserver FD PRELOAD``)


def _preload() -> None:
    """Import what every worker needs, so a forked worker starts with it (`worker.preload`: torch,
    torch.distributed, the magic's worker side, DDP's first-use imports). Imports only: no tensor op
    (OpenMP's thread pool must not exist before fork), no process group."""
    from ..worker import preload

    preload()


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the notebook is gone: the loop sees EOF next


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the server (its parent's only thread) goes, on Linux."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # no libc prctl: the parent check below and the server's last act still end this worker
    if os.getppid() != parent:  # the server died before prctl took effect
        os._exit(1)


def _reseed() -> None:
    """A fork shares its parent's random state; fresh interpreters would not: reseed from the OS."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:  # broad: a numpy the server half imported must not stop the worker; it keeps its state
            pass


def _child(request: dict, out_fd: int, err_fd: int, close: list[int], parent: int) -> None:
    """In the forked worker: become a fresh process of its own, then run the job. Never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: the notebook signals the group, which reaches its children
        _die_with_parent(parent)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:
            try:
                os.close(fd)
            except OSError:
                pass
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd):
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = request["sys_path"]
        sys.argv = [sys.argv[0], request["job"]]
        _reseed()
        torch = sys.modules.get("torch")
        threads = request["env"].get("OMP_NUM_THREADS", "")
        if torch is not None and threads.isdigit():
            torch.set_num_threads(int(threads))  # OpenMP read the variable when the server imported torch
        from ..worker import run_job_file

        code = run_job_file(request["job"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # broad: anything the job raised is printed to the rank's stderr, and the exit code says it
        try:
            traceback.print_exc()
        except (OSError, ValueError):
            pass  # stderr is closed or its reader gone: the exit code alone reports the failure
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # the reader is gone or the stream closed: nothing left to tell
        # Leave without interpreter teardown: the result and the output have been sent, and destructors
        # (a DDP reducer holding a gloo group whose peer is gone) can block forever.
        os._exit(code)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(fd: int, preload: bool) -> None:
    """The server's loop: fork on request, report exits, and take every worker along when the notebook goes."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's interrupt is for its cell, not for us
    wake_r, wake_w = _wake_on_signals()
    _announce(sock, preload)
    children: set[int] = set()
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            _drain(wake_r)
        _report_exits(sock, children)
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            break  # the notebook closed its end: it exited, was killed, or shut us down
        pid = _spawn(sock, json.loads(data), fds, [sock.fileno(), wake_r, wake_w], me)
        if pid is not None:
            children.add(pid)
    _kill_all(children)
    os._exit(0)


def _wake_on_signals() -> tuple[int, int]:
    """A non-blocking pipe that a signal (SIGCHLD above all) writes to, waking the server's select."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_r, wake_w


def _announce(sock: socket.socket, preload: bool) -> None:
    """Preload (torch and what DDP imports), then tell the notebook "ready", or "broken" and exit."""
    try:
        if preload:
            _preload()
        _send(sock, {"op": "ready", "pid": os.getpid()})
    except BaseException as exc:  # broad: whatever broke the preload, the notebook hears it as "broken"
        _send(sock, {"op": "broken", "error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)


def _drain(wake_r: int) -> None:
    try:
        while os.read(wake_r, 512):
            pass
    except BlockingIOError:
        pass


def _report_exits(sock: socket.socket, children: set[int]) -> None:
    """Reap every child that exited and tell the notebook its exit code."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        _send(sock, {"op": "exit", "pid": pid, "code": _exit_code(status)})


def _spawn(sock: socket.socket, request: dict, fds: list[int], close: list[int], me: int) -> int | None:
    """Fork one worker for a "spawn" request (its stdout and stderr: ``fds``); its pid, or None when there is none."""
    if request.get("op") != "spawn" or len(fds) != 2:
        for extra in fds:
            os.close(extra)
        return None
    try:
        pid = os.fork()
    except OSError as exc:
        for extra in fds:
            os.close(extra)
        _send(sock, {"op": "failed", "id": request["id"], "error": f"fork failed: {exc}"})
        return None
    if pid == 0:
        _child(request, fds[0], fds[1], close, me)
    for extra in fds:
        os.close(extra)
    _send(sock, {"op": "started", "id": request["id"], "pid": pid})
    return pid


def _kill_all(children: set[int]) -> None:
    """The notebook is gone: nothing it started may outlive it (SIGKILL each group, reap for up to 5 s)."""
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            children.discard(pid)
        else:
            time.sleep(0.02)


# ----------------------------------------------------------------------------------------------------
# The notebook's side


class ForkedProcess:
    """A worker forked by the server; quacks like the parts of `subprocess.Popen` the launcher uses."""

    def __init__(self, stdout: Any, stderr: Any):
        self.stdout, self.stderr = stdout, stderr
        self.pid: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None
        self._pending_signal: int | None = None
        self._cond = threading.Condition()

    def _started(self, pid: int) -> None:
        with self._cond:
            self.pid = pid
            sig, self._pending_signal = self._pending_signal, None
            self._cond.notify_all()
        if sig is not None:
            _killpg(pid, sig)

    def _exited(self, code: int, error: str | None = None) -> None:
        with self._cond:
            if self.returncode is None:
                self.returncode = code
                self.error = error
            self._cond.notify_all()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
            return self.returncode

    def signal_group(self, sig: int) -> None:
        """Signal the worker's process group (it and its children); a worker not forked yet gets it then."""
        with self._cond:
            if self.returncode is not None:
                return
            if self.pid is None:
                if self._pending_signal != signal.SIGKILL:
                    self._pending_signal = sig
                return
            pid = self.pid
        _killpg(pid, sig)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ForkServer:
    """The notebook's handle on one server process."""

    def __init__(self, env: dict[str, str], preload: bool):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: nobody must have to read it for it to go on
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dtrain_magic.launchers.forkserver", str(theirs.fileno()),
                 "1" if preload else "0"],
                env=env,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,  # the cell's interrupt (SIGINT to the notebook's group) is not for it
                cwd=os.getcwd(),
            )
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._sock = ours
        self._lock = threading.Lock()
        self._next_id = 0
        self._waiting: dict[int, ForkedProcess] = {}
        self._by_pid: dict[int, ForkedProcess] = {}
        self._closed = False
        self.broken: str | None = None
        self._reader = threading.Thread(target=self._read, name="dtrain-forkserver", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return not self._closed and self.broken is None and self.process.poll() is None

    def spawn(self, job_file: str, env: dict[str, str]) -> ForkedProcess:
        """Ask for one worker running ``job_file``; returns at once (the fork follows the server's preload)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        proc = ForkedProcess(os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
        request = {
            "op": "spawn", "job": job_file, "env": env, "cwd": os.getcwd(),
            # The notebook's imports: its working directory and sys.path, as a spawned interpreter would get.
            "sys_path": [p for p in [os.getcwd(), *sys.path] if p],
        }
        try:
            with self._lock:
                if self._closed or self.broken:
                    raise OSError(self.broken or "the worker fork server is shut down")
                request["id"] = self._next_id
                self._waiting[self._next_id] = proc
                self._next_id += 1
                socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
        except BaseException:
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return proc

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            op = message.get("op")  # "ready" needs no action: requests sent earlier simply wait in the socket
            if op == "broken":
                self.broken = message.get("error", "the fork server failed to start")
                break
            elif op == "started":
                with self._lock:
                    proc = self._waiting.pop(message["id"], None)
                    if proc is not None:
                        self._by_pid[message["pid"]] = proc
                if proc is not None:
                    proc._started(message["pid"])
            elif op == "exit":
                with self._lock:
                    proc = self._by_pid.pop(message["pid"], None)
                if proc is not None:
                    proc._exited(message["code"])
            elif op == "failed":
                with self._lock:
                    proc = self._waiting.pop(message["id"], None)
                if proc is not None:
                    proc._exited(1, message.get("error"))
        # The server is gone: its workers died with it (PR_SET_PDEATHSIG, or its last act killed them).
        if self.broken is None and not self._closed:
            self.broken = "the worker fork server exited"
            try:
                self._stderr.seek(0)
                tail = self._stderr.read().decode("utf-8", "replace").strip()
                if tail:
                    self.broken += ": " + tail.splitlines()[-1]
            except (OSError, ValueError) as exc:
                log_dropped(__name__, "the fork server's last stderr line", exc)
        with self._lock:
            left = [*self._waiting.values(), *self._by_pid.values()]
            self._waiting.clear()
            self._by_pid.clear()
        for proc in left:
            proc._exited(-signal.SIGKILL, self.broken)

    def pids(self) -> set[int]:
        """The workers this server forked that have not exited yet."""
        with self._lock:
            return set(self._by_pid)

    def shutdown(self) -> None:
        """Close our end: the server kills whatever it still runs and exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self._stderr.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2] == "1")
