"""``--backend local``: N fresh Python processes on this machine (spawn semantics, never fork).

Each worker is ``python -m dtrain_magic.worker`` in its own process group, with torchrun's
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT). The
process group rendezvous goes through a file in the run's private directory (a FileStore: no port
listening on every interface, no port race); gloo/nccl sockets are bound to the loopback interface.
Output written below Python (C extensions, crashes) is read from the processes' pipes and shown with
the rank prefix; Python-level output travels over the channel. Cancel = SIGTERM to every process
group, then SIGKILL after a grace period.

Warm pool: after a run, N fresh interpreters are started in the background that import torch and
wait for the next job on stdin, so a re-run does not pay interpreter start-up and ``import torch``
again (the same idea as a spawn-safe worker pool; every run still gets new processes, so no state
leaks between runs). Idle pool processes exit when the notebook goes away (stdin closes).
``DTRAIN_MAGIC_WARM_POOL=0`` turns the pool off.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

from .. import channel as ch
from ..config import RunConfig
from ..errors import ConfigError, LaunchError
from ..worker import WorkerJob
from .base import Emit, Failure, Launcher, LaunchState, RunningJob, loopback_interface

_GRACE_S = 3.0
_MAX_PROCESSES_PER_CORE = 4


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def base_environment(threads: int) -> dict[str, str]:
    """The notebook's environment plus what every local worker needs, whatever its rank."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        # Same imports as the notebook: its sys.path (working directory, editable installs) first.
        PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p)),
    )
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    env.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    return env


def worker_environment(rank: int, world_size: int, port: int, threads: int, store_file: str = "") -> dict[str, str]:
    env = base_environment(threads)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if store_file:
        env["DTRAIN_INIT_METHOD"] = f"file://{store_file}"
    return env


def _threads(num_processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_processes)


def _spawn(args: list[str], env: dict[str, str], stdin: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain_magic.worker", *args],
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, so cancel reaches its children too
        cwd=os.getcwd(),
    )


class WarmPool:
    """Idle worker interpreters (torch already imported), keyed by what they were started with."""

    def __init__(self) -> None:
        self._idle: dict[tuple, list[subprocess.Popen]] = {}
        self._lock = threading.Lock()
        atexit.register(self.shutdown)

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("DTRAIN_MAGIC_WARM_POOL", "1") not in ("0", "false", "no")

    @staticmethod
    def key(num_processes: int) -> tuple:
        return (num_processes, sys.executable, os.getcwd(), tuple(sys.path), os.environ.get("OMP_NUM_THREADS"))

    def take(self, num_processes: int) -> list[subprocess.Popen] | None:
        with self._lock:
            procs = self._idle.pop(self.key(num_processes), None)
        if procs and all(p.poll() is None for p in procs):
            return procs
        for proc in procs or []:
            _stop(proc)
        return None

    def refill(self, num_processes: int) -> None:
        """Start the next run's interpreters now, in the background; at most one idle set is kept."""
        if not self.enabled():
            return
        key = self.key(num_processes)
        env = base_environment(_threads(num_processes))
        with self._lock:
            if key in self._idle:
                return
            stale = [p for procs in self._idle.values() for p in procs]
            self._idle.clear()
            self._idle[key] = [_spawn(["--pool"], env, subprocess.PIPE) for _ in range(num_processes)]
        for proc in stale:
            _stop(proc)

    def idle_pids(self) -> set[int]:
        with self._lock:
            return {p.pid for procs in self._idle.values() for p in procs}

    def shutdown(self) -> None:
        with self._lock:
            procs = [p for group in self._idle.values() for p in group]
            self._idle.clear()
        for proc in procs:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if stream:
                stream.close()
        except OSError:
            pass
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


POOL = WarmPool()


class LocalJob(RunningJob):
    """The N processes of one run. With ``--max-restarts N``, a failed group is stopped and started
    again up to N times (as torch elastic's agent does: every rank restarts, from the last checkpoint
    the function saved with ``ctx.save_checkpoint()``)."""

    early_release = True

    def __init__(self, job: WorkerJob, emit: Emit, run_dir: str):
        self._emit = emit
        self._run_dir = run_dir
        self._cancelled = False
        self._lock = threading.Lock()
        self._num_processes = job.config.num_processes
        self._restarts_left = job.config.max_restarts
        self._attempt = 0
        if job.checkpoint_root is None:  # a job not from the runner: ctx.save_checkpoint() still has a place
            job = dataclasses.replace(job, checkpoint_root=os.path.join(run_dir, "checkpoints"))
        self._job_file = os.path.join(run_dir, "job.pkl")
        fd = os.open(self._job_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            cloudpickle.dump(job, handle)
        self.processes: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._launch()

    def _launch(self) -> None:
        n = self._num_processes
        store_file = os.path.join(self._run_dir, f"rendezvous_{self._attempt}")
        port = free_port()  # MASTER_PORT for user code that reads it; the rendezvous itself is the file
        envs = [worker_environment(rank, n, port, _threads(n), store_file) for rank in range(n)]
        warm = POOL.take(n) if POOL.enabled() and self._attempt == 0 else None
        processes: list[subprocess.Popen] = []
        try:
            if warm is not None:
                for proc, env in zip(warm, envs):
                    proc.stdin.write((json.dumps({"job": self._job_file, "env": env}) + "\n").encode())
                    proc.stdin.close()
                processes = warm
            else:
                for env in envs:
                    processes.append(_spawn([self._job_file], env, subprocess.DEVNULL))
        except BaseException:
            for proc in [*(warm or []), *processes]:
                _stop(proc)
            raise
        self.processes = processes
        for rank, proc in enumerate(processes):
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                pump = threading.Thread(target=self._pump, args=(stream, rank, name), daemon=True)
                pump.start()
                self._pumps.append(pump)

    def _pump(self, stream, rank: int, name: str) -> None:
        for raw in iter(stream.readline, b""):
            self._emit((ch.OUTPUT, rank, name, raw.decode("utf-8", "replace")))
        stream.close()

    def release(self) -> None:
        """Every rank sent its result: let the interpreters finish tearing down in the background,
        then reap them (SIGKILL after a grace period) and clean up, off the cell's critical path."""
        POOL.refill(self._num_processes)  # the next run's interpreters start importing torch now
        threading.Thread(target=self._reap, name="dtrain-local-reaper", daemon=True).start()

    def _reap(self) -> None:
        deadline = time.monotonic() + 10.0
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.cancel()

    def poll(self) -> LaunchState:
        codes = [proc.poll() for proc in self.processes]
        failures = [
            Failure(rank, _describe_exit(code)) for rank, code in enumerate(codes) if code not in (None, 0)
        ]
        if failures and self._restarts_left > 0 and not self._cancelled:
            self._restart(failures[0])
            return LaunchState(False, [], errors_final=False, restarted=True)
        finished = all(code is not None for code in codes)
        if finished:
            for pump in self._pumps:
                pump.join(2)
            self._cleanup()
        return LaunchState(finished, failures, errors_final=self._restarts_left == 0)

    def _restart(self, failure: Failure) -> None:
        self._restarts_left -= 1
        self._attempt += 1
        self._emit((ch.OUTPUT, None, "stderr",
                    f"dtrain_magic: rank {failure.rank} failed ({failure.reason}); restarting every worker "
                    f"(restart {self._attempt}, {self._restarts_left} left)\n"))
        self._stop_all()
        self._launch()

    def _stop_all(self) -> None:
        alive = [p for p in self.processes if p.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.processes:
            _signal_group(proc, signal.SIGKILL)  # also reaches grandchildren left in the group
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for pump in self._pumps:
            pump.join(2)
        self._pumps = []

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
        self._stop_all()
        self._cleanup()

    def _cleanup(self) -> None:
        if os.path.isdir(self._run_dir):
            shutil.rmtree(self._run_dir, ignore_errors=True)
            POOL.refill(self._num_processes)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process was killed by {name}"
    return f"process exited with code {code}"


class LocalLauncher(Launcher):
    """torch.distributed on this machine; needs neither Spark nor Ray."""

    name = "local"

    def starts_before_tracking(self, config: RunConfig) -> bool:
        return True

    def check(self, config: RunConfig) -> None:
        if config.use_gpu:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--gpu", "CUDA is not available on this machine; use --cpu")
            if config.num_processes > torch.cuda.device_count():
                raise ConfigError(
                    "--num-processes",
                    f"{config.num_processes} processes need {config.num_processes} GPUs; this machine has "
                    f"{torch.cuda.device_count()}",
                )
        elif config.num_processes > _MAX_PROCESSES_PER_CORE * (os.cpu_count() or 1):
            cores = os.cpu_count() or 1
            raise ConfigError(
                "--num-processes",
                f"{config.num_processes} local processes on {cores} CPU core(s) would thrash (each needs a core "
                f"to make progress); use at most {_MAX_PROCESSES_PER_CORE * cores}, or a cluster backend "
                "(--backend spark --cluster, --backend ray --ray-address ...)",
            )

    def warm_up(self, config: RunConfig) -> None:
        # The first run in a kernel has no warm interpreters yet: start them now; `start` takes them from
        # the pool, and they import torch while the notebook imports MLflow and opens the run.
        POOL.refill(config.num_processes)

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        run_dir = tempfile.mkdtemp(prefix="dtrain_run_")  # mode 0700: the pickled job is private
        try:
            return LocalJob(job, emit, run_dir)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise LaunchError(f"could not start local workers: {exc}") from None

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        return f"{config.num_processes} local process(es) on this machine ({device}, gloo/nccl on 127.0.0.1)"
