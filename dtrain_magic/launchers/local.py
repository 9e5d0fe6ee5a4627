"""``--backend local``: N fresh worker processes on this machine, forked by a fork server.

Each worker runs with torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT) in its own process group. The process group rendezvous goes
through a file in the run's private directory (a FileStore: no port listening on every interface, no
port race); the process group's sockets are bound to the loopback interface. Output written below Python (C
extensions, crashes) is read from the processes' pipes and shown with the rank prefix; Python-level
output travels over the channel. Cancel = SIGTERM to every process group, then SIGKILL after a grace
period; once every rank has sent its result the workers are killed at once (nothing of theirs is
needed, and their teardown can hang).

Workers come from `forkserver`: one idle interpreter per kernel that imported torch (and what DDP
imports lazily) and forks each run's workers in milliseconds, so a re-run, even one started the moment
the last one ended, does not pay interpreter start-up and ``import torch`` again; every run still gets
new processes, so no state leaks between runs. When the notebook's process goes, the server kills every
worker it forked. ``DTRAIN_MAGIC_WARM_POOL=0`` makes the server import nothing (each worker imports
torch itself).
"""

from __future__ import annotations

import dataclasses
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

from ..backends import Local
from ..channel import Output
from ..config import RunConfig
from ..errors import ConfigError, LaunchError
from ..state import kernel_state
from ..worker import WorkerJob
from ..worker.preempt import STOP_FILE_ENV
from .base import (
    Emit,
    Failure,
    Launcher,
    LaunchState,
    RunningJob,
    describe_exit,
    import_time_environment,
    loopback_interface,
)
from .forkserver import ForkedProcess, ForkServer

_GRACE_S = 3.0
_MAX_PROCESSES_PER_CORE = 4


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def base_environment(threads: int | None = None) -> dict[str, str]:
    """The notebook's environment plus what every local worker needs, whatever its rank."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        # Same imports as the notebook: its sys.path (working directory, editable installs) first.
        PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p)),
    )
    if threads is not None:
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


class WorkerPool:
    """The fork server this kernel's local runs take their workers from (started on first use, kept between
    runs on the kernel's `LocalLauncher`).

    ``DTRAIN_MAGIC_WARM_POOL=0``: the server imports nothing, so every worker imports torch itself, like
    a freshly spawned interpreter (slower; for debugging import-time effects)."""

    def __init__(self) -> None:
        self._server: ForkServer | None = None
        self._key: tuple | None = None
        self._lock = threading.Lock()

    @staticmethod
    def preload() -> bool:
        return os.environ.get("DTRAIN_MAGIC_WARM_POOL", "1") not in ("0", "false", "no")

    def _wanted_key(self) -> tuple:
        # the fork server imported torch: a change in what is read at import time means a new server
        return (sys.executable, self.preload(), import_time_environment())

    def server(self) -> ForkServer:
        """The running server, (re)started when there is none or what it imported at start has changed."""
        key = self._wanted_key()
        with self._lock:
            if self._server is not None and self._server.alive() and self._key == key:
                return self._server
            old, self._server, self._key = self._server, ForkServer(base_environment(), self.preload()), key
        kernel_state().stop_first_at_exit()
        if old is not None:
            threading.Thread(target=old.shutdown, name="dtrain-forkserver-stop", daemon=True).start()
        return self._server

    def idle_pids(self) -> set[int]:
        """The server's own pid (it runs no training itself)."""
        with self._lock:
            return {self._server.pid} if self._server is not None and self._server.alive() else set()

    def server_pid(self) -> int | None:
        with self._lock:
            return self._server.pid if self._server is not None else None

    def shutdown(self) -> None:
        with self._lock:
            server, self._server, self._key = self._server, None, None
        if server is not None:
            server.shutdown()


def _room(config: RunConfig) -> int:
    """How many workers this machine takes for ``config``: its GPUs with ``--gpu``, else the processes per core
    `LocalLauncher.check` allows (the capacity an ``--elastic`` run grows back to)."""
    if config.use_gpu:
        import torch

        return torch.cuda.device_count()
    return _MAX_PROCESSES_PER_CORE * (os.cpu_count() or 1)


def _stop(proc: ForkedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
    proc.signal_group(signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass



class LocalJob(RunningJob):
    """The N processes of one run. With ``--max-restarts N``, a failed group is stopped and started
    again up to N times (as torch elastic's agent does: every rank restarts, from the last checkpoint
    the function saved with ``ctx.save_checkpoint()``). With ``--elastic MIN:MAX``, a group that lost
    workers (killed by a signal) is started again on the survivors, from the same checkpoint, while at least
    MIN remain (no restart used); a later restart grows it back to MAX (`dtrain_magic.elastic`). A group whose
    ranks all checkpointed for a preemption notice (`worker.preempt`) is restarted from that checkpoint."""

    early_release = True

    def __init__(self, job: WorkerJob, emit: Emit, run_dir: str, pool: WorkerPool):
        self._emit = emit
        self._pool = pool
        self._run_dir = run_dir
        self._cancelled = False
        self._lock = threading.Lock()
        self._num_processes = job.config.num_processes
        self._restarts_left = job.config.max_restarts
        self._attempt = 0
        if job.checkpoint_root is None:  # a job not from the runner: ctx.save_checkpoint() still has a place
            job = dataclasses.replace(job, checkpoint_root=os.path.join(run_dir, "checkpoints"))
        self._base_job = self._job = job  # the run as asked, and as the current attempt runs it (--elastic)
        self._note = ""  # the last relaunch's line
        self._job_file = os.path.join(run_dir, "job.pkl")
        self._write_job(job)
        self.processes: list[ForkedProcess] = []
        self._pumps: list[threading.Thread] = []
        self._launch()

    def _write_job(self, job: WorkerJob) -> None:
        fd = os.open(self._job_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            cloudpickle.dump(job, handle)

    def _launch(self) -> None:
        n = self._num_processes
        store_file = os.path.join(self._run_dir, f"rendezvous_{self._attempt}")
        port = free_port()  # MASTER_PORT for user code that reads it; the rendezvous itself is the file
        envs = [worker_environment(rank, n, port, _threads(n), store_file) for rank in range(n)]
        stop_file = os.path.join(self._run_dir, "stopping")  # created before the launcher's own SIGTERMs
        if os.path.exists(stop_file):
            os.unlink(stop_file)  # a new attempt: a SIGTERM is a preemption notice again
        for env in envs:
            env[STOP_FILE_ENV] = stop_file
        server = self._pool.server()
        processes: list[ForkedProcess] = []
        try:
            for env in envs:
                processes.append(server.spawn(self._job_file, env))
        except BaseException:
            for proc in processes:
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
            self._emit(Output(rank, name, raw.decode("utf-8", "replace")))
        stream.close()

    def release(self) -> None:
        """Every rank sent its result (after its output): nothing of the run is needed any more, so the
        workers are killed now rather than left to tear down (which can hang on a peer that is gone)."""
        threading.Thread(target=self._kill_now, name="dtrain-local-release", daemon=True).start()

    def _kill_now(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
        for proc in self.processes:
            proc.signal_group(signal.SIGKILL)
        self._reap_all(5.0)
        self._cleanup()

    def poll(self) -> LaunchState:
        codes = [proc.poll() for proc in self.processes]
        failures = [
            Failure(rank, proc.error or describe_exit(code))
            for rank, (proc, code) in enumerate(zip(self.processes, codes, strict=True)) if code not in (None, 0)
        ]
        # a rank killed by a signal first: its peers' exits (gloo's "connection closed by peer") are its consequences
        failures.sort(key=lambda failure: not (codes[failure.rank] or 0) < 0)
        if failures and not self._cancelled:
            world = self._next_world(codes)
            if world is not None:
                self._restart(failures[0], codes, world)
                return LaunchState(False, [], errors_final=False, restarted=True, world_size=world,
                                   restart_note=self._note)
        finished = all(code is not None for code in codes)
        if finished:
            for pump in self._pumps:
                pump.join(2)
            self._cleanup()
        return LaunchState(finished, failures, errors_final=self._restarts_left == 0 and not self._may_shrink())

    def _may_shrink(self) -> bool:
        bounds = self._job.config.elastic_bounds
        return bounds is not None and self._num_processes > bounds[0]

    def _next_world(self, codes: list[int | None]) -> int | None:
        """The world of the relaunch these exit codes call for, or None (the run fails): the survivors when
        workers were lost to a signal under ``--elastic`` (no restart used); else, with a restart left, the same
        world, or under ``--elastic`` as many as this machine has room for up to MAX (growing back)."""
        from ..elastic import grown_world, survivors_world

        bounds = self._job.config.elastic_bounds
        lost = sum(1 for code in codes if code is not None and code < 0)
        if bounds is not None and lost:
            survivors = survivors_world(self._num_processes, lost, bounds)
            if survivors is not None and survivors < self._num_processes:
                return survivors
        if self._restarts_left <= 0:
            return None
        if bounds is None:
            return self._num_processes
        return grown_world(self._num_processes, bounds, _room(self._job.config))

    def _restart(self, failure: Failure, codes: list[int | None], world: int) -> None:
        from ..worker.preempt import PREEMPTED_EXIT, checkpointed_words
        from ..worker.resume_point import resume_point

        preempted = all(code in (None, 0, PREEMPTED_EXIT) for code in codes)
        shrink = world < self._num_processes
        if not shrink:
            self._restarts_left -= 1
        self._attempt += 1
        why = checkpointed_words() if preempted else f"rank {failure.rank} failed ({failure.reason})"
        where = resume_point(self._job.checkpoint_root).words()  # as Spark's restart line says it
        what = (f"continuing on the {world} survivor(s) from {where} (--elastic {self._job.config.elastic})" if shrink
                else f"restarting every worker from {where} (restart "
                     f"{self._job.config.max_restarts - self._restarts_left}, {self._restarts_left} left)")
        self._emit(Output(None, "stderr", f"dtrain_magic: {why}; {what}\n"))
        self._note = f"{why}; {what}"  # the MLflow run's tag for this relaunch (`LaunchState.restart_note`)
        self._stop_all()
        if world != self._num_processes:
            self._resize(world)
        self._launch()

    def _resize(self, world: int) -> None:
        """The next attempt's job on ``world`` ranks: the accumulation that keeps the run's global batch, and the
        learning-rate factor where it cannot (said in the cell)."""
        from ..elastic import resized_job

        self._job, resize = resized_job(self._base_job, self._job, world)
        self._num_processes = world
        self._emit(Output(None, "stderr", resize.note()))
        self._note += "; " + resize.note().removeprefix("dtrain_magic: ").strip()
        self._job_file = os.path.join(self._run_dir, f"job_{self._attempt}.pkl")
        self._write_job(self._job)

    def _stop_all(self) -> None:
        if os.path.isdir(self._run_dir):  # this SIGTERM is a stop, not a preemption notice (`worker.preempt`)
            open(os.path.join(self._run_dir, "stopping"), "w").close()
        alive = [p for p in self.processes if p.poll() is None]
        for proc in alive:
            proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.processes:
            proc.signal_group(signal.SIGKILL)  # also reaches grandchildren left in the group
        self._reap_all(5.0)

    def _reap_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
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


class LocalLauncher(Local, Launcher):
    """torch.distributed on this machine; needs neither Spark nor Ray."""

    def __init__(self) -> None:
        self.pool = WorkerPool()  # its fork server starts with the first run (or warm_up)

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
        # The first run in a kernel has no fork server yet: start it now, so it imports torch while the
        # notebook captures the cell and imports MLflow.
        self.pool.server()

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        run_dir = tempfile.mkdtemp(prefix="dtrain_run_")  # mode 0700: the pickled job is private
        try:
            return LocalJob(job, emit, run_dir, self.pool)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise LaunchError(f"could not start local workers: {exc}") from None

    def shutdown(self, at_exit: bool = False) -> None:
        """Stop the fork server (it SIGKILLs any worker still alive)."""
        self.pool.shutdown()

    def capacity(self, config: RunConfig) -> tuple[str, int] | None:
        """With ``--gpu`` this machine's GPUs (one per process); CPU processes are not limited."""
        if not config.use_gpu:
            return None
        import torch

        return "GPUs of this machine", torch.cuda.device_count()

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        return (f"{config.num_processes} local process(es) on this machine "
                f"({device}, 127.0.0.1)")
