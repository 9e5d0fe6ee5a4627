"""Waiting workers that give way to the notebook's own Ray work (issue 33; docs/backends.md, "Warm re-runs").

On a Ray the notebook started or joined itself, the next run's waiting workers (a standby) hold CPUs (GPUs with
``--gpu``) that the notebook's own tasks, actors, placement groups and Ray Datasets may need: on a small Ray they
hold every CPU, and ``ray.get(f.remote())`` would wait for them forever. `GiveWay` is one thread per Ray launcher
that reads what waits for resources as the GCS sees it (`dtrain_magic._compat.ray.cluster_demand`, four times a
second: one small RPC) and releases the standby as soon as anything else waits for what it holds; once the Ray
has been quiet for `IDLE_S` (nothing queued, what the workers need free, no run of this kernel going on), it
launches them again, for what was left of their idle time, so a later re-run is still warm.

Not used on the local instance the magic started (sized for the workers plus one CPU; its own, not the user's).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..._compat import ray as ray_compat
from ..standby import Standby, StandbySlot

POLL_S = 0.25  # the GCS hears of a raylet's queue within about 0.1 s: a user's task waits at most ~0.4 s more
IDLE_S = 3.0  # quiet this long before the waiting workers come back
Shape = dict  # resources, {"CPU": 1.0}

_log = logging.getLogger(__name__)


def plain(shape: Shape) -> Shape:
    """The shape's plain resources (a placement group's bundle resources, ``CPU_group_...``, are already held by
    that group: nothing the waiting workers could give)."""
    return {key: value for key, value in shape.items() if value > 0 and "_group_" not in key}


def blocked_by_workers(tasks: list[Shape], gangs: list[list[Shape]], per_worker: Shape, workers: int,
                       starting: bool) -> str | None:
    """Why waiting workers that hold ``per_worker`` each should go: a queued task or actor, or a pending placement
    group, asks for a resource they hold. While they start, a placement group of exactly their bundles is taken for
    their own (Ray Train's, waiting for the last run's CPUs). None when nothing waits for what they hold."""
    held = {key for key, value in per_worker.items() if value > 0}
    for shape in tasks:
        wanted = held & set(plain(shape))
        if wanted:
            return f"a task or actor of this Ray waits for {', '.join(sorted(wanted))}"
    own = [dict(per_worker)] * workers
    for bundles in gangs:
        if starting and [plain(bundle) for bundle in bundles] == own:
            continue
        wanted = held & {key for bundle in bundles for key in plain(bundle)}
        if wanted:
            return f"a placement group of this Ray waits for {', '.join(sorted(wanted))}"
    return None


def enough_free(available: Shape, per_worker: Shape, workers: int) -> bool:
    """Are the resources ``workers`` waiting workers take free now (so their start takes nobody's)?"""
    return all(available.get(key, 0.0) + 1e-9 >= value * workers for key, value in per_worker.items())


class GiveWay:
    """The thread that releases a launcher's standby when the notebook's own Ray work waits for it, and launches it
    again once that Ray is quiet. `watch` after each standby launch; `stop` when the launcher shuts down or
    ``%distribute_release`` frees the workers (nothing comes back then)."""

    def __init__(self, slot: StandbySlot, busy: Callable[[], bool]):
        """``busy()``: a run (or a released launch still ending) of this kernel is on the Ray: nothing comes back."""
        self._slot, self._busy = slot, busy
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._per_worker: Shape = {}
        self._workers = 0
        self._relaunch: Callable[[float], object] | None = None  # launches the workers again for S seconds
        self._until = 0.0  # ... until this time (the released workers' own expiry)
        self.released = 0  # standbys given way so far, and launched again (tests read them)
        self.relaunched = 0

    def watch(self, per_worker: Shape, workers: int, relaunch: Callable[[float], object]) -> None:
        """Watch the slot's standby (workers holding ``per_worker`` each); ``relaunch(keep_s)`` brings it back."""
        with self._lock:
            self._per_worker, self._workers, self._relaunch = dict(per_worker), workers, relaunch
            self._until = 0.0
            self._stopped.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dtrain-ray-give-way", daemon=True)
                self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        """Nothing more to watch or bring back."""
        with self._lock:
            self._relaunch, self._until = None, 0.0
            self._stopped.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _run(self) -> None:
        quiet_since: float | None = None
        while not self._stopped.wait(POLL_S):
            try:
                demand = ray_compat.cluster_demand()
                standby = self._slot.standby
                if demand is None:  # Ray is down, or will not say: nothing to do, maybe never again
                    if standby is None and not self._until:
                        return
                    continue
                if standby is not None:
                    quiet_since = None
                    self._give_way(standby, *demand[:2])
                    continue
                if not self._until:
                    return  # nothing waits and nothing is to come back
                quiet_since = self._maybe_relaunch(demand, quiet_since)
            except Exception:  # a watcher has nobody to tell; the next poll tries again
                _log.debug("giving way to this Ray's own work failed once", exc_info=True)

    def _give_way(self, standby: Standby, tasks: list[Shape], gangs: list[list[Shape]]) -> None:
        why = blocked_by_workers(tasks, gangs, self._per_worker, self._workers, not standby.all_ready.is_set())
        if why is None:
            return
        until = standby.expires_at
        free = getattr(standby.launch, "free_now", None)  # their CPUs free at once, even while they still start
        if self._slot.release_if(standby, f"{why}: they gave way (they come back once this Ray is quiet)", free):
            self.released += 1
            with self._lock:
                if self._relaunch is not None:
                    self._until = until

    def _maybe_relaunch(self, demand: tuple, quiet_since: float | None) -> float | None:
        tasks, gangs, available = demand
        now = time.monotonic()
        left = self._until - time.time()
        if left < 2 * IDLE_S:  # (nearly) expired meanwhile: nothing comes back
            self._until = 0.0
            return None
        if (blocked_by_workers(tasks, gangs, self._per_worker, self._workers, False)
                or not enough_free(available, self._per_worker, self._workers) or self._busy()):
            return None
        if quiet_since is None:
            return now
        if now - quiet_since < IDLE_S:
            return quiet_since
        with self._lock:
            relaunch, self._until = self._relaunch, 0.0
        if relaunch is not None:
            try:
                relaunch(left)
                self.relaunched += 1
            except Exception as exc:  # a watcher thread: the user hears it, and the next run starts its workers anew
                _log.warning("could not bring back the next run's workers after giving way to this Ray's work: %s",
                             exc)
        return None
