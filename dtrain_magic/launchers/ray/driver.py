"""``--backend ray``: the cell's function through Ray Train's ``TorchTrainer``.

Each Ray Train worker runs `_train_loop`, which calls ``dtrain_magic.worker.run_worker`` with the ranks
from ``ray.train.get_context()``; Ray Train has already joined the torch process group. Output,
metrics, results and errors come back over the run's channel like on every backend; Ray's own
reporting (``ray.train.report``) is used only for checkpoints (`RayCheckpointStore`), because Ray
restores from those after a restart (``--max-restarts`` → ``FailureConfig(max_failures)``).

Which Ray: the instance this kernel is already connected to (``ray.is_initialized()``); else the
cluster at ``--ray-address`` / ``$RAY_ADDRESS``; else a local instance started once (127.0.0.1, no
dashboard, its own temp dir) and reused by later runs, shut down and removed when the kernel exits.

``start`` returns at once: ``trainer.fit()`` runs in a background thread. ``cancel`` asks Ray Train's
controller actor to abort (it stops the worker actors and removes their placement group) and waits for it,
killing the controller only if it has not gone within `ray_compat.ABORT_WAIT_S`; the Ray instance stays up
for the next run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
import weakref
from typing import Any

from ..._compat import ray as ray_compat
from ...backends import Ray
from ...channel import StandbyJob
from ...config import RunConfig, redact_uri
from ...data.blocks import without_trainer_datasets
from ...errors import ConfigError, LaunchError, MissingDependencyError, log_dropped, summary
from ...registry import STRATEGIES
from ...worker import WorkerJob
from ...worker.checkpoints import run_checkpoint_root, storage_path
from ..base import Emit, Launcher, LaunchState, RunningJob
from ..standby import Claim, Placement, Standby, StandbyLaunch, StandbySlot, default_keep_warm_s, keep_warm_s
from .diagnostics import failures_from
from .instance import RayInstance, _current_address, _host_port
from .worker import _standby_loop, _train_loop, dump_stacks_here
from .yielding import GiveWay

_LOOPBACK = ("127.0.0.1", "localhost", "::1")

# Ray Train's defaults for a Ray whose every node is this machine (the user's own settings win). Its controller polls
# the workers every 2 s, and a run's end, each ``ray.train.report`` and each checkpoint wait for the next poll: every
# 0.5 s instead, a few local calls more per second, ended two checkpoint tests here 22 s (18 %) sooner.
ONE_MACHINE_RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
# And on a Ray of one node: the preemption watcher (a Python process per launch, 3 s of CPU beside the starting workers
# on 2 cores) watches for nodes being drained (the preemption notice, docs/reliability.md), and a run cannot go on
# without its one node anyway.
ONE_NODE_RAY_TRAIN_ENV = {**ONE_MACHINE_RAY_TRAIN_ENV, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def _train_env(one_machine: bool) -> dict[str, str] | None:
    """The Ray Train settings of a trainer on this Ray (`ONE_MACHINE_RAY_TRAIN_ENV`, `ONE_NODE_RAY_TRAIN_ENV`)."""
    import ray

    if not one_machine:
        return None
    try:
        one_node = sum(1 for node in ray.nodes() if node["Alive"]) == 1
    except Exception as exc:  # cannot tell: keep the watcher
        log_dropped(__name__, "the Ray's nodes", exc)
        one_node = False
    return ONE_NODE_RAY_TRAIN_ENV if one_node else ONE_MACHINE_RAY_TRAIN_ENV


class RayJob(StandbyLaunch):
    """One ``TorchTrainer.fit()`` in a background thread: a run's (`for_job`), or a standby's (`for_standby`: its
    workers wait for a run's job, and `attach` makes it that run's)."""

    def __init__(self, config: RunConfig, emit: Emit | None, loop: Any, loop_config: dict, name: str, storage: str,
                 datasets: dict[str, Any] | None = None, one_machine: bool = False):
        """``datasets``: Ray Datasets for Ray Train to split among the workers (``--data NAME=ds``);
        ``one_machine``: every node of this Ray is this machine (`ONE_MACHINE_RAY_TRAIN_ENV`)."""
        import ray.train

        self._emit = emit
        self._config = config
        self._error: BaseException | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self.abort_wait_s = ray_compat.ABORT_WAIT_S  # shorter at kernel exit, where the driver's end frees it all
        self.at_exit = False  # cancelled by the kernel's exit: a killed controller's leftovers go with the driver
        self.storage, self.name = storage, name  # Ray Train's storage_path and run name
        if "://" not in self.storage:  # Ray Train would create it 0755: the run's files are the user's alone
            os.makedirs(os.path.join(self.storage, self.name), mode=0o700, exist_ok=True)
        self.trainer = ray_compat.abortable_trainer_class(_train_env(one_machine))(
            loop,
            train_loop_config=loop_config,
            scaling_config=ray.train.ScalingConfig(num_workers=config.num_processes, use_gpu=config.use_gpu),
            run_config=ray.train.RunConfig(
                name=self.name,
                storage_path=self.storage,
                # --elastic: each attempt is its own fit(), sized by the launcher (`ElasticRayRun`)
                failure_config=ray.train.FailureConfig(max_failures=0 if config.elastic else config.max_restarts),
            ),
            datasets=datasets or None,
        )
        self._thread = threading.Thread(target=self._fit, name="dtrain-ray-fit", daemon=True)
        self._thread.start()

    @classmethod
    def for_job(cls, job: WorkerJob, emit: Emit, one_machine: bool = False) -> "RayJob":
        """Launch ``job``'s workers now. Ray Train's run directory is the run's checkpoint root, so its
        checkpoints and ctx's are one place."""
        # (--resume: the resumed run's root, wherever its --storage was: the same name and storage make Ray Train
        # restore its latest checkpoint)
        name = os.path.basename(job.checkpoint_root) if job.checkpoint_root else f"dtrain_{uuid.uuid4().hex}"
        storage = os.path.dirname(job.checkpoint_root) if job.checkpoint_root else storage_path(job.config.storage)
        # Ray Datasets go to Ray Train itself (each worker reads ray.train.get_dataset_shard); the job keeps where
        # the rest is, never a Dataset object.
        sources, datasets = without_trainer_datasets(job.data)
        job = dataclasses.replace(job, data=sources)
        return cls(job.config, emit, _train_loop, {"job": job, "cwd": os.getcwd()}, name, storage, datasets,
                   one_machine)

    @classmethod
    def for_standby(cls, config: RunConfig, standby: Standby, strategies: tuple[str, ...],
                    one_machine: bool = False) -> "RayJob":
        """Launch workers with ``config``'s placement that wait on ``standby`` for a run's job; Ray Train's run
        is named after the standby's checkpoint root (the run that claims it keeps its checkpoints there)."""
        assert standby.checkpoint_root is not None
        return cls(config, None, _standby_loop, {"standby": standby.address, "strategies": strategies},
                   os.path.basename(standby.checkpoint_root), os.path.dirname(standby.checkpoint_root),
                   one_machine=one_machine)

    def attach(self, job: WorkerJob, emit: Emit) -> None:
        self._config, self._emit = job.config, emit

    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def aborting(self) -> bool:
        """Cancelled, and Ray Train's abort still going on (in the background of a stopped run)."""
        return self._cancelled and self._thread.is_alive()

    def wait_stopped(self, timeout: float) -> None:
        self._thread.join(timeout)

    def dump_stacks(self, workers: Any, timeout: float) -> dict[int, tuple[str, str]]:
        """The stacks of workers on other machines, by a task on each one's node (Ray's node affinity); those on
        this machine are left to the notebook, which signals them itself."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = {}
        for rank, worker in workers.items():
            if worker.here or not worker.node or not worker.stack_file:
                continue
            task = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                worker.node, soft=False))(dump_stacks_here)
            refs[rank] = task.remote(worker.pid, worker.stack_file, timeout)
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + 2.0)
        answers = {}
        for rank, ref in refs.items():
            if ref in ready:
                try:
                    answers[rank] = tuple(ray.get(ref))
                except Exception as exc:  # the stack task's own failure (its node gone): no stack for that rank
                    log_dropped(__name__, "RayJob.dump_stacks", exc)
            else:
                ray.cancel(ref, force=True)
        return answers

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported through poll()
            self._error = exc

    def poll(self) -> LaunchState:
        if self._thread.is_alive():
            # Ray Train decides when a worker's failure is final (restart or give up), and it always ends
            # fit() when it gives up: wait for that rather than cancelling on the first worker error.
            return LaunchState(False, [], errors_final=False)
        if self._error is None or self._cancelled:
            return LaunchState(True, [])
        return LaunchState(True, failures_from(self._error))

    def free_now(self) -> None:
        """End this launch now, its CPUs/GPUs back at once: its worker group's placement group removed (the workers
        die with it), then its controller killed (nothing of the run is left to stop). Ray Train's own abort would
        first wait for a worker group still starting (seconds to tens of seconds on a small machine)."""
        import ray

        with self._lock:
            self._cancelled = self._thread.is_alive()  # what fit() raises now is this, not a failure
        self.trainer.cancel_requested = True  # a controller not made yet aborts as soon as it is
        controller = self.trainer.controller
        if controller is None:
            return
        ray_compat.free_placement_groups(controller)
        try:
            ray.kill(controller, no_restart=True)
        except Exception as exc:  # gone already
            log_dropped(__name__, "RayJob.free_now", exc)

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = self._thread.is_alive()
        if not self._cancelled:
            return
        self.trainer.cancel_requested = True
        controller = self.trainer.controller  # (None again once fit() is over)
        if controller is not None and not ray_compat.abort(controller, self.abort_wait_s) and not self.at_exit:
            logging.getLogger(__name__).warning(
                "Ray Train's controller of %s did not stop within %.0f s and was killed: its workers' placement "
                "group may hold their CPUs/GPUs until this kernel exits", self.name, self.abort_wait_s)
        self._thread.join(self.abort_wait_s + 2)


class RayLauncher(Ray, Launcher):
    """Ray Train (``TorchTrainer``) on the connected, given or an embedded local Ray instance."""

    def __init__(self) -> None:
        self.instance = RayInstance()  # the Ray this kernel started or joined, kept between runs
        self.standbys = StandbySlot()  # the next run's workers, launched ahead (docs/warm-reruns.md)
        self._jobs: "weakref.WeakSet[RayJob]" = weakref.WeakSet()  # this kernel's fits (runs and standbys)
        self.give_way = GiveWay(self.standbys, self._in_use)  # on a Ray not the magic's own: the user's work first

    def check(self, config: RunConfig) -> None:
        try:
            import ray  # noqa: F401
            import ray.train.torch  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"--backend ray needs Ray Train: pip install 'ray[default,train]' ({exc})"
            ) from None
        ray_compat.check()  # a Ray whose private parts we know (or the opt-in): before anything starts
        default_keep_warm_s()  # a bad $DTRAIN_MAGIC_KEEP_WARM is a ConfigError now, not after the run
        import ray

        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        if config.use_gpu and not address and not ray.is_initialized():
            from ...config import cuda_available

            if not cuda_available():
                raise ConfigError(
                    "--gpu",
                    "CUDA is not available here and no Ray cluster is given; use --cpu, or --ray-address of a "
                    "cluster with GPUs",
                )

    def starts_before_tracking(self, config: RunConfig) -> bool:
        return True  # Ray Train's run is named after the checkpoint root, not the MLflow run

    def warm_up(self, config: RunConfig) -> None:
        how = self._connect(config)  # ray.init (seconds, cold) while the MLflow run opens
        if config.data:  # a Ray Dataset is staged before launch, for the CPUs the run will find: grow the instance now
            self._make_room(config, how)

    def _connect(self, config: RunConfig) -> str:
        if self.standbys.standby is not None and self.instance.connected_for(config) is None:
            self.standbys.release("the run uses another Ray")  # before leaving the Ray its workers are on
        return self.instance.connect(config)

    def channel_host(self, config: RunConfig) -> str:
        import ray

        self._connect(config)
        joined = self.instance.joined
        current = joined if ray.is_initialized() and joined else _current_address()
        if current is None or _host_port(current)[0] in _LOOPBACK:
            return "127.0.0.1"
        return ray.util.get_node_ip_address()

    def workers_share_files(self, config: RunConfig) -> bool:
        """A Ray whose every node is this machine (connected: its alive nodes; not yet: the local instance a run
        would start, or an address on loopback); starts nothing."""
        import sys

        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            import ray

            try:
                here = ray.util.get_node_ip_address()
                return all(node["NodeManagerAddress"] in (here, *_LOOPBACK) for node in ray.nodes() if node["Alive"])
            except Exception as exc:  # cannot tell: staged copies then need --data-dir
                log_dropped(__name__, "the Ray cluster's nodes", exc)
                return False
        address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
        return address is None or _host_port(address)[0] in _LOOPBACK

    def _make_room(self, config: RunConfig, how: str) -> None:
        """Enough CPUs/GPUs for ``config``'s workers, or a `LaunchError` now (the local instance grows)."""
        if not self.instance.has_capacity(config):  # the instance must grow: a stopped run's abort ends first
            for aborting in [other for other in list(self._jobs) if other.aborting]:
                aborting.wait_stopped(aborting.abort_wait_s + 2)
        self.instance.ensure_capacity(config, how, in_use=self._in_use())

    def _in_use(self) -> bool:
        return any(job.running() for job in list(self._jobs))

    def start(self, job: WorkerJob, emit: Emit) -> RunningJob:
        how = self._connect(job.config)
        self.standbys.make_way(self._placement(job.config))  # another placement's workers go first
        if job.config.elastic is not None or job.config.resume is not None:  # never claimed (`claim_standby`):
            self.standbys.release("an elastic or resumed run launches its own")  # their CPUs are this run's
        self._make_room(job.config, how)
        if job.config.elastic is None:
            return self._fit(job, emit)
        if without_trainer_datasets(job.data)[1]:
            raise ConfigError("--elastic", "a Ray Dataset given to --data goes to Ray Train, which reads it from its "
                                           "start in every fit(): an elastic run's relaunch would read rows twice; "
                                           "drop --elastic, or give the data as Parquet or a pandas/Spark DataFrame")
        from .elastic import ElasticRayRun

        return ElasticRayRun(job, emit, lambda attempt: self._fit(attempt, emit), lambda: self._room(job.config),
                             job.checkpoint_root)

    def _fit(self, job: WorkerJob, emit: Emit) -> RayJob:
        try:
            running = RayJob.for_job(job, emit, self.workers_share_files(job.config))
        except (ConfigError, LaunchError):
            raise
        except Exception as exc:
            raise LaunchError(f"could not start Ray Train: {summary(exc, limit=300)}") from None
        self._jobs.add(running)
        return running

    def _room(self, config: RunConfig) -> int:
        """How many of ``config``'s workers (one CPU, or one GPU with ``--gpu``, each: Ray Train's default) the Ray's
        alive nodes hold in all, whatever else they run now, those being drained left out (they leave soon): an elastic
        run's next attempt (`ElasticRayRun`)."""
        import ray

        resource, draining = ("GPU" if config.use_gpu else "CPU"), ray_compat.draining_nodes()
        return int(sum(node["Resources"].get(resource, 0) for node in ray.nodes()
                       if node["Alive"] and node["NodeID"] not in draining))

    # -- standbys (docs/warm-reruns.md) -------------------------------------------------------------------
    def _placement(self, config: RunConfig) -> Placement:
        """What a TorchTrainer fixes at construction and launch: world size, GPUs, the Ray it runs on, its
        storage_path and FailureConfig(max_failures)."""
        where = (f"local instance {os.path.basename(self.instance.temp_dir)}" if self.instance.temp_dir
                 else redact_uri(_current_address() or "?"))
        items: tuple[tuple[str, Any], ...] = (
            ("processes", config.num_processes), ("GPU", config.use_gpu), ("Ray", where),
            ("storage", redact_uri(storage_path(config.storage))), ("max restarts", config.max_restarts),
        )
        if config.data:  # Ray Train takes its datasets when the trainer is made: such a run launches afresh
            items += (("data", tuple(name for name, _ in config.data)),)
        return Placement(Ray.name, items)

    def claim_standby(self, config: RunConfig, reuse: bool = False) -> Claim | None:
        if (self.standbys.standby is None and not (reuse and self.standbys.spares)) \
                or self.instance.connected_for(config) is None:
            return None
        if config.data:  # never its placement; and Ray Data (the Dataset's count or tasks) needs the CPUs they hold
            self.standbys.release("a run with --data: Ray Data needs the CPUs they hold")
            return None
        if config.elastic is not None or config.resume is not None:  # each attempt a fit() of its own size
            return None  # (`ElasticRayRun`); a resumed run's fit() has its run's name (Ray Train restores by it)
        return self.standbys.claim(self._placement(config), reuse)

    def keep_warm(self, config: RunConfig) -> str | None:
        """Launch the next run's workers on the Ray this kernel is connected to (held by default on this machine's
        own Ray: the local instance the magic started, or one the notebook's own ``ray.init()`` started; on a
        cluster only with ``--keep-warm``); nothing before Ray is up (a kernel's first run starts it after the
        cell ran: the cell may call ray.init itself)."""
        how = self.instance.connected_for(config)
        if how is not None and config.data:  # Ray Train gets its datasets at launch: nothing ahead for such a run,
            # and Ray Data (the Dataset's count, its map tasks) needs the CPUs that other workers would hold
            self.give_way.stop()  # (nor do workers that gave way come back after it)
            self.standbys.release("a run with --data: Ray Data needs the CPUs they hold")
        if how is None or config.data or config.elastic is not None:  # (an elastic run launches each attempt)
            return None
        # On a Ray that is not the magic's own, waiting workers give way to its own work (`GiveWay`), which needs the
        # GCS's view of what waits: where that cannot be read, they are held only when the cell asks, as on a cluster.
        yields = how != "embedded"
        can_yield = yields and ray_compat.cluster_demand() is not None
        keep = keep_warm_s(config, holds_by_default=how == "embedded" or (how == "notebook" and can_yield))
        placement = self._placement(config)
        standby = self.standbys.ensure(placement, keep, lambda: self._launch_standby(config, placement))
        if standby is None:
            return None
        if can_yield:
            per_worker = {"GPU": 1.0} if config.use_gpu else {"CPU": 1.0}  # Ray Train's default per worker
            self.give_way.watch(per_worker, config.num_processes, lambda keep_s: self._relaunch(config, keep_s))
        return standby.describe()

    def _relaunch(self, config: RunConfig, keep_s: float) -> None:
        """Waiting workers that gave way come back (`GiveWay`), on the same Ray, for what is left of their time."""
        if self.instance.connected_for(config) is None:
            return
        placement = self._placement(config)
        self.standbys.ensure(placement, keep_s, lambda: self._launch_standby(config, placement))

    def release_reused(self, reason: str) -> int:
        return self.standbys.release_spares(reason)

    def release_standby(self, reason: str) -> str | None:
        self.give_way.stop()  # released on purpose: nothing comes back
        standby = self.standbys.release(reason)
        return None if standby is None else standby.where

    def _launch_standby(self, config: RunConfig, placement: Placement) -> Standby:
        if not self.instance.has_capacity(config):
            raise LaunchError(f"not enough {'GPUs' if config.use_gpu else 'CPUs'} on this Ray "
                              f"for {config.num_processes} workers")

        def order_for(job: WorkerJob) -> StandbyJob:
            import cloudpickle

            return StandbyJob(cloudpickle.dumps(job), os.getcwd(), {}, (), None)

        device = "GPU" if config.use_gpu else "CPU"
        on = ("the local Ray instance" if self.instance.temp_dir
              else "this notebook's own Ray" if self.instance.connected_for(config) == "notebook"
              else f"the Ray cluster at {redact_uri(_current_address() or '?')}")
        root = run_checkpoint_root(config.storage, uuid.uuid4().hex)
        standby = Standby(placement, config.num_processes, self.channel_host(config), root,
                          f"{config.num_processes} Ray Train worker(s) ({device}) on {on}", order_for)
        try:
            preload = tuple(dict.fromkeys((STRATEGIES.default, config.strategy)))
            standby.launch = RayJob.for_standby(config, standby, preload, self.workers_share_files(config))
        except BaseException:
            standby.release("its launch failed")
            raise
        self._jobs.add(standby.launch)
        return standby

    def shutdown(self, at_exit: bool = False) -> None:
        """Release the waiting workers, then shut down the local Ray instance this kernel started (a joined
        cluster is left as it is)."""
        if at_exit:  # what a killed controller leaves goes with the driver: no need to wait on its abort
            waiting = self.standbys.standby.launch if self.standbys.standby is not None else None
            for job in list(self._jobs):
                job.at_exit = True
                job.abort_wait_s = 0.0 if job is waiting else 4.0  # a run's workers get a moment to stop
        self.give_way.stop()
        self.standbys.release("the kernel exits" if at_exit else "the backend shuts down",
                              grace_s=3.0 if at_exit else 15.0)
        self.instance.shutdown()

    def capacity(self, config: RunConfig) -> tuple[str, int] | None:
        """The CPUs (GPUs with ``--gpu``) of the Ray this kernel is connected to, for ``config``'s Ray; None before
        it is connected (nothing of this kernel's runs there yet)."""
        if self.instance.connected_for(config) is None:
            return None
        import ray

        resource = "GPU" if config.use_gpu else "CPU"
        where = ("the local Ray instance" if self.instance.temp_dir
                 else f"the Ray at {redact_uri(_current_address() or '?')}")
        return f"{resource}s of {where}", int(ray.cluster_resources().get(resource, 0))

    def describe(self, config: RunConfig) -> str:
        device = "GPU" if config.use_gpu else "CPU"
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        where = f"the Ray cluster at {address}" if address else "the connected or a local Ray instance"
        restarts = f", up to {config.max_restarts} restart(s)" if config.max_restarts else ""
        return f"{config.num_processes} Ray Train worker(s) ({device}) on {where}{restarts}"
