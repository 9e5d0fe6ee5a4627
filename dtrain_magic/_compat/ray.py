"""Ray's private parts, written against Ray 2.60 (constraints.txt: 2.60.0).

- `abortable_trainer_class` (``launchers/ray/driver.py``): overrides ``TorchTrainer._initialize_and_run_controller``
  with Ray 2.60's own body (``ray.train.v2._internal``'s ``TrainController`` and ``get_env_vars_to_propagate``,
  ``ray._raylet.RAY_NODE_ID_KEY``, ``ray._common.constants``) to keep the controller actor's handle; `abort` calls
  its ``abort`` and waits for it (it also removes the worker group's placement group: `ABORT_WAIT_S`).
  **Required** (`check`, from ``RayLauncher.check``): without it a run cannot be stopped (Stop, ``--timeout``, an
  interrupt, a failing rank). An opted-in version that lacks one of these parts is refused too.
- `init_local_instance` (``launchers/ray/instance.py``): ``ray.init(_node_ip_address=..., _temp_dir=...)``.
  **Required** (the same `check`): they keep the local instance on loopback, in a directory only the user reads.
- `init_local_instance` also sets ``ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` (the variable
  of that name, read when ``ray`` is imported) for that ``ray.init`` only: the kernel's core worker then installs no
  C++ failure-signal handler, which would print a stack trace to the kernel's fd 2 when Jupyter SIGTERMs a kernel
  whose exit takes over its 5 s (the Ray processes keep theirs: they read the variable, unset). **Gated**: on an
  unknown version, or when missing, Ray installs it.
- `started_by_this_process` (``launchers/ray/instance.py``): ``ray._private.worker._global_node.is_head()``, whether
  the notebook's own ``ray.init()`` started the Ray it is connected to (a head node on this machine, which ends
  with the notebook). **Gated**: on an unknown version, or when missing, the answer is "no" (the next run's
  workers are then held only when the cell asks, as on a cluster).
- `abortable_trainer_class` also gives a run without Ray Datasets a provider that starts nothing
  (``ray.train.v2._internal.callbacks.datasets.DatasetsCallback``): Ray's own starts a ``DatasetManager`` actor for
  every run, datasets or not (a Python process importing Ray Data: about 4 s of CPU, 3 s of each launch on 2 cores).
  **Gated**: when missing, Ray's own callback is kept.
- `cluster_demand` (``launchers/ray/yielding.py``): ``ray._private.worker.global_worker.gcs_client`` for
  ``ray.autoscaler.v2.sdk.get_cluster_resource_state`` (the GCS's view the autoscaler reads: queued tasks and actors
  by resource shape, pending placement groups, each node's available resources). **Gated**: on an unknown version,
  or when missing, the answer is None, and waiting workers are held on a Ray the notebook started only when the
  cell asks (``--keep-warm``), as on a cluster.
- `free_placement_groups` (``launchers/ray/driver.py``, for `yielding`): the GCS's placement group table
  (``ray._private.state.state``'s accessor, ``gcs_pb2.PlacementGroupTableData.creator_actor_id``) and an actor
  handle's ``_actor_id``, to remove the placement groups a standby's controller made (its CPUs free at once, even
  while Ray Train still starts the workers, when its own abort would wait for that). **Fallback**: when missing,
  nothing is removed and the standby's release frees them as before (seconds later).
- `unpatched_print` (``launchers/ray/worker.py``): ``ray.train.v2._internal.logging.patch_print._original_print``.
  **Fallback** when missing: Ray Train's own ``print``, which also tees each line into its logger (each worker
  line then shows twice).
- `preemption_noticed` (``launchers/ray/worker.py``, a run's ``ctx.step()``): the worker's own copy of Ray Train's
  preemption notice (``ray.train.v2._internal.execution.context.get_train_context().preemption_context``, which Ray
  Train's preemption watcher sets when Ray drains a node of the run), read without the barrier of the public
  ``ray.train.get_preemption_info()`` (every rank would have to call it together: the ranks agree through the
  magic's own all-reduce instead). **Gated**: on an unknown version, or when missing, no notice is seen (a drained
  node's workers die at its deadline, as without the notice).
- `draining_nodes` (``launchers/ray/driver.py``, an ``--elastic`` run's room): ``ray._private.state.state.
  get_draining_nodes()``. **Gated**: unknown, no node counts as draining.
- `reach` (``abortable_trainer_class``, before the controller's ``run``): ``ray._private.state.actors`` (the GCS's
  view of the controller actor), to tell an actor still being created from one this driver was never told of
  (`DriverLostActors`). **Gated**: unknown, the GCS's view counts as "not alive yet" and the run waits, as before.

The rest of Ray Train used (``TorchTrainer``, ``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
``ray.train.report`` / ``get_context`` / ``get_checkpoint``) is public.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

from ..errors import UnsupportedVersionError, log_dropped
from . import Library

RAY = Library(
    key="ray", title="Ray", module="ray", known=("2.60",), tested="2.60.0", requirement="ray[default,train]==2.60.0"
)
_USES = "Ray Train's controller actor, to stop a run; ray.init's _node_ip_address and _temp_dir"


def check() -> None:
    """Before a run on Ray: a known Ray (or the opt-in), which has every private part the backend needs.
    Raises `UnsupportedVersionError`; imports nothing ``ray.train.torch`` has not already imported."""
    RAY.require(_USES)
    _controller_parts()


def _controller_parts() -> SimpleNamespace:
    """What Ray 2.60's ``_initialize_and_run_controller`` uses, resolved now so a missing one is a clear error."""
    try:
        import ray._raylet
        from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
        from ray.train.torch import TorchTrainer
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            get_env_vars_to_propagate,
        )
        from ray.train.v2._internal.execution.controller import TrainController

        node_id_key = ray._raylet.RAY_NODE_ID_KEY
        if not callable(getattr(TorchTrainer, "_initialize_and_run_controller", None)):
            raise AttributeError("TorchTrainer._initialize_and_run_controller")
        if not callable(getattr(TrainController, "abort", None)):
            raise AttributeError("TrainController.abort")
    except (ImportError, AttributeError) as exc:
        if isinstance(exc, ModuleNotFoundError):
            what = f"module {exc.name}"
        else:  # "cannot import name 'x' from 'module' (path)", or our own "Class.method"
            what = str(exc).split(" (", 1)[0].replace("cannot import name ", "")
        raise UnsupportedVersionError(RAY.missing_message(what, "to stop a Ray Train run")) from None
    return SimpleNamespace(
        trainer=TorchTrainer, controller=TrainController, node_id_key=node_id_key,
        env_vars=get_env_vars_to_propagate, blocking_get_env=RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
        blocking_get_default=DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    )


def abortable_trainer_class(controller_env: Mapping[str, str] | None = None) -> type:
    """``TorchTrainer`` that keeps the handle of its controller actor (``.controller``), so a run can be
    aborted; ``cancel_requested`` set before the controller exists aborts it as soon as it does.
    ``controller_env``: Ray Train variables (``RAY_TRAIN_*``, which its controller hands on to the workers) for
    this trainer's controller, each unless the notebook's own environment sets it."""
    parts = _controller_parts()
    defaults = dict(controller_env or {})

    class AbortableTorchTrainer(parts.trainer):
        controller: Any = None
        cancel_requested = False

        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            without = _no_datasets_callback()
            if self.datasets or without is None:
                return callbacks
            return [without(train_run_context=self.train_run_context, datasets={})
                    if type(callback) is without.__base__ else callback for callback in callbacks]

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            # Ray 2.60's body, less its SIGINT handler (fit() runs in a background thread, where Ray skips it).
            import ray

            env_vars = parts.env_vars()
            env_vars.setdefault(parts.blocking_get_env, parts.blocking_get_default)
            for name, value in defaults.items():
                env_vars.setdefault(name, value)
            controller_cls = ray.remote(
                num_cpus=0,
                label_selector={parts.node_id_key: ray.get_runtime_context().get_node_id()},
                runtime_env={"env_vars": env_vars},
            )(parts.controller)
            self.controller = controller_cls.remote(**controller_init_kwargs)
            try:
                if self.cancel_requested:
                    abort(self.controller)
                elif not reach(self.controller, lambda: self.cancel_requested):
                    # (its abort, or kill, ends it; fit() ends here: a call to it might never be answered)
                    raise RuntimeError("the run was cancelled before Ray Train's controller started")
                ray.get(self.controller.run.remote())
                return ray.get(self.controller.get_result.remote())
            finally:
                # Ray's own code holds the handle in a local: once fit() is over, no handle is left and Ray ends
                # the controller actor (a kept handle kept one idle controller process alive per run).
                self.controller = None

    return AbortableTorchTrainer


class DriverLostActors(RuntimeError):
    """This process's Ray driver no longer learns that its actors started (see `reach`)."""


# Seen on Ray 2.60 (2 cores, a kernel that had run Ray Data and Spark): the GCS had the run's new controller ALIVE,
# but this driver was never told, so the controller's `run` call waited in the driver forever, and so did every actor
# made after it (tasks still ran). Nothing in Ray times out there; the run must say so instead of waiting silently.
REACH_GRACE_S = 30.0  # how long the GCS may say ALIVE while this driver still cannot call the actor


def reach(actor: Any, cancelled: Any = lambda: False, grace_s: float = REACH_GRACE_S) -> bool:
    """Wait until ``actor`` answers this driver (its creation done, as the driver sees it). False when
    ``cancelled()`` became true meanwhile. An actor still being created (no free worker process, a busy node) is
    waited for as long as it takes; one the GCS has had ALIVE for ``grace_s`` while this driver cannot reach it
    raises `DriverLostActors`."""
    import time

    import ray

    ref = actor.__ray_ready__.remote()  # Ray's own no-op method of every actor
    alive_since = None
    while not ray.wait([ref], timeout=1.0)[0]:
        if cancelled():
            return False
        if _gcs_actor_state(actor) != "ALIVE":
            alive_since = None
        elif alive_since is None:
            alive_since = time.monotonic()
        elif time.monotonic() - alive_since > grace_s:
            raise DriverLostActors(
                f"Ray Train did not start: its run controller started (Ray's GCS has had the actor ALIVE for "
                f"{grace_s:.0f} s) but this kernel's Ray driver was never told, so it cannot call it: the driver no "
                "longer learns that its actors started (a Ray core fault), and no Ray run can start from this "
                "kernel. Restart the kernel (its Ray connection with it)")
    return True


def _gcs_actor_state(actor: Any) -> str | None:
    """The actor's state as the GCS has it ("ALIVE", "PENDING_CREATION", ...), None when unknown."""
    try:
        from ray._private import state

        return (state.actors(actor_id=actor._actor_id.hex()) or {}).get("State")
    except Exception as exc:  # an unknown version, or the GCS busy: no answer (the caller keeps waiting)
        log_dropped(__name__, "_gcs_actor_state", exc)
        return None


class NoDatasetShards:
    """What ``ray.train.get_dataset_shard`` asks in a run given no Ray Dataset (no actor behind it)."""

    def get_dataset_shard(self, dataset_info: Any) -> Any:
        name = getattr(dataset_info, "dataset_name", dataset_info)
        raise KeyError(f"ray.train.get_dataset_shard({name!r}): this run was given no Ray Dataset; pass it with "
                       f"--data {name}=<the notebook's Dataset variable>")


@functools.cache
def _no_datasets_callback() -> type | None:
    """Ray Train's ``DatasetsCallback`` for a run without datasets: `NoDatasetShards` instead of a DatasetManager
    actor; None when this Ray has no such callback (its own is then kept). Made once per process."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError as exc:
        log_dropped(__name__, "_no_datasets_callback", exc)
        return None

    class NoDatasetsCallback(DatasetsCallback):
        def before_init_train_context(self, workers: list) -> dict[str, list]:
            return {"dataset_shard_provider": [NoDatasetShards()] * len(workers)}

    return NoDatasetsCallback


# The controller's own abort stops the workers (Ray Train gives them 5 s) and then removes the worker group's
# placement group. It runs only between the controller's steps: a worker group still starting (placement,
# actors, process group: seconds on a busy machine) finishes that first. Killing the controller before its abort
# is over leaves the placement group holding its CPUs/GPUs until the notebook's driver exits (a placement group
# made by an actor lives while its job does; Ray Train's own cleaner is stopped by the abort, or was never told
# of a group still starting), so the kill is the last resort.
ABORT_WAIT_S = 45.0


def abort(controller: Any, wait_s: float = ABORT_WAIT_S) -> bool:
    """Ask the run's controller actor to abort (it stops the worker actors and removes their placement group,
    then exits); kill it only if it is still there after ``wait_s``. Returns False when it had to be killed
    (its placement group may then stay until the driver exits)."""
    import ray

    if not ray.is_initialized():  # Ray was shut down, its actors with it; a call would start a new Ray (auto-init)
        return True
    finished = True
    try:
        ray.get(controller.abort.remote(), timeout=wait_s)  # returns at once when the run is already over
    except ray.exceptions.GetTimeoutError:
        finished = False
    except Exception as exc:  # RayActorError: it exited, as abort does once the workers and their group are gone
        log_dropped(__name__, "abort", exc)
        return True
    try:
        ray.kill(controller, no_restart=True)
    except Exception as exc:  # any Ray error: the run still ends, but the user learns what may stay behind
        import logging

        logging.getLogger(__name__).warning(
            "could not kill Ray Train's run controller: it and its workers' placement group may hold their CPUs "
            "until this kernel's Ray stops (%s)", exc)
    return finished


def init_local_instance(num_cpus: int, temp_dir: str) -> None:
    """``ray.init`` of this kernel's own instance: loopback only, its files under ``temp_dir``."""
    import ray

    with _no_failure_signal_handler():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,  # worker output comes over the run's channel
            configure_logging=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
        )


@contextlib.contextmanager
def _no_failure_signal_handler() -> Iterator[None]:
    """The core worker this process starts inside installs no C++ failure-signal handler (the kernel is the user's
    process: a signal meant to end it, Jupyter's SIGTERM, ends it without a stack trace printed on its way)."""
    constants = None
    if RAY.allowed():
        try:
            import ray._private.ray_constants as constants
        except ImportError as exc:
            log_dropped(__name__, "_no_failure_signal_handler", exc)
    saved = getattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    if saved is None:  # (an unknown version, or renamed)
        yield
        return
    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved


Shape = dict  # a resource request: {"CPU": 1.0, ...}


def cluster_demand() -> tuple[list[Shape], list[list[Shape]], Shape] | None:
    """What waits for resources on the Ray this process is connected to, as the GCS sees it (the raylets report
    their queues about every 100 ms): (the shape of each kind of queued task or actor, each pending placement
    group's bundles, the resources available summed over the alive nodes). None where this Ray's parts are unknown
    or fail."""
    reader = _demand_reader()
    if reader is None:
        return None
    try:
        state = reader()
    except Exception as exc:  # Ray shut down meanwhile, or the GCS does not answer
        log_dropped(__name__, "cluster_demand", exc)
        return None
    tasks = [dict(entry.request.resources_bundle) for entry in state.pending_resource_requests]
    gangs = [[dict(bundle.resources_bundle) for bundle in gang.requests]
             for gang in state.pending_gang_resource_requests]
    available: Shape = {}
    for node in state.node_states:
        for key, value in node.available_resources.items():
            available[key] = available.get(key, 0.0) + value
    return tasks, gangs, available


def _demand_reader() -> Any:
    """``get_cluster_resource_state`` bound to this process's GCS client; None on an unknown Ray or without it."""
    if not RAY.allowed():
        return None
    try:
        from ray._private.worker import global_worker
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
    except ImportError as exc:
        log_dropped(__name__, "_demand_reader", exc)
        return None
    client = getattr(global_worker, "gcs_client", None)
    return None if client is None else functools.partial(get_cluster_resource_state, client)


def free_placement_groups(actor: Any) -> int:
    """Remove the live placement groups ``actor`` created (Ray Train's controller: its worker group's), which kills
    the actors in them and frees their resources now; how many. 0 where this Ray's parts are missing."""
    import ray

    try:
        from ray._private.state import state
        from ray._raylet import PlacementGroupID
        from ray.core.generated import gcs_pb2
        from ray.util.placement_group import PlacementGroup

        creator = actor._actor_id.binary()
        table = state._connect_and_get_accessor().get_placement_group_table()
    except Exception as exc:  # Ray's private state API: any change or failure only skips this clean-up
        log_dropped(__name__, "free_placement_groups", exc)
        return 0
    removed = 0
    for raw in table:
        data = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if data.creator_actor_id != creator or data.state == gcs_pb2.PlacementGroupTableData.REMOVED:
            continue
        try:
            ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(data.placement_group_id)))
            removed += 1
        except Exception as exc:  # removed meanwhile (the controller's own clean-up)
            log_dropped(__name__, "free_placement_groups", exc)
    return removed


def unpatched_print() -> Any:
    """The ``print`` Ray Train replaced in its workers (it also logs each line); Ray's own when unknown."""
    import builtins

    try:
        from ray.train.v2._internal.logging.patch_print import _original_print

        return _original_print
    except ImportError:
        return builtins.print


def started_by_this_process() -> bool:
    """True when this process's ``ray.init()`` started the Ray head it is connected to (not joined a running one)."""
    if not RAY.allowed():
        return False
    try:
        from ray._private import worker

        node = worker._global_node
        return node is not None and bool(node.is_head())
    except Exception as exc:  # Ray's private worker module: any failure reads as joined, the safe answer
        log_dropped(__name__, "started_by_this_process", exc)
        return False


def preemption_noticed() -> bool:
    """In a Ray Train worker: has Ray Train's preemption watcher told this worker that a node of the run is being
    drained (a spot instance's reclaim)? False where this Ray's parts are unknown or missing."""
    if not RAY.allowed():
        return False
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info is not None
    except Exception as exc:  # not in a Ray Train worker, or Ray's private context changed: no notice
        log_dropped(__name__, "preemption_noticed", exc)
        return False


def draining_nodes() -> set[str]:
    """The ids (hex) of the nodes Ray is draining (a preemption, ``ray drain-node``): leaving soon. Empty where this
    Ray's parts are unknown or fail."""
    if not RAY.allowed():
        return set()
    try:
        from ray._private.state import state

        return set(state.get_draining_nodes())
    except Exception as exc:  # Ray's private state API: any change or failure reads as none draining
        log_dropped(__name__, "draining_nodes", exc)
        return set()
