"""Standbys: the next run's workers, launched through the backend's own API before the run (issue 15).

A standby is one launch (``TorchDistributor.run`` / ``TorchTrainer.fit``) whose workers run a waiting function
(`dtrain_magic.launchers.waiting`): ranks set, process group joined, torch imported, connected to the standby's
listener here, waiting for a job. A run whose `Placement` equals the standby's *claims* it (`StandbySlot.claim`):
every waiting worker gets the run's `WorkerJob` (`channel.StandbyJob`) and calls ``run_worker`` as a freshly
launched worker does; the launch then *is* the run's `RunningJob`. A standby nobody claims is released: its
workers get `channel.StandbyRelease` and return, and the launch ends (or is cancelled after a grace period).

This module knows no backend: a launcher gives its `StandbySlot` a placement, the idle time, a description and
a function that starts the launch. The design: docs/warm-reruns.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..channel import AuthenticatedListener, Message, StandbyJob, StandbyReady, StandbyRelease, decode
from ..config import RunConfig
from ..errors import ConfigError, log_dropped
from .base import Emit, LaunchState, RunningJob

DEFAULT_KEEP_WARM_S = 600.0
KEEP_WARM_ENV = "DTRAIN_MAGIC_KEEP_WARM"
_RELEASE_GRACE_S = 15.0  # a released standby's launch ends by itself within this, or it is cancelled
# A reused standby's workers wait again within moments of their results (their teardown, one connection): this
# long at most, or the launch ends as a run's does (`ClaimedRun.release`)
_REUSE_WAIT_S = 5.0
_log = logging.getLogger(__name__)


def default_keep_warm_s(environ: Mapping[str, str] | None = None) -> float:
    """The idle time where holding is the default: ``$DTRAIN_MAGIC_KEEP_WARM`` seconds, else 600 s. A value
    that is not a number of seconds >= 0 is a `ConfigError` naming the variable."""
    text = (os.environ if environ is None else environ).get(KEEP_WARM_ENV, "").strip()
    if not text:
        return DEFAULT_KEEP_WARM_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"${KEEP_WARM_ENV}", f"got {text!r}; must be a number of seconds >= 0 (0: hold nothing)")
    return value


def keep_warm_s(config: RunConfig, holds_by_default: bool) -> float:
    """How long workers may wait for the next run after a run with ``config``: ``--keep-warm`` when given
    (anywhere); else, where the magic holds by default (what it started, or what runs on the notebook's own
    machine: ``holds_by_default``), `default_keep_warm_s`; else 0: nothing is held on a cluster the user
    brought unless the cell says so."""
    if config.keep_warm is not None:
        return float(config.keep_warm)
    if not holds_by_default:
        return 0.0
    try:
        return default_keep_warm_s()
    except ConfigError:  # checked before the run (runner.check); changed since: the default
        return DEFAULT_KEEP_WARM_S


@dataclass(frozen=True)
class Placement:
    """What a launch fixes before it knows its job, as (name, value) pairs: a standby serves only a run with an
    equal placement. Values are shown in messages: nothing secret in them (redacted URLs, digests)."""

    backend: str
    items: tuple[tuple[str, Any], ...]

    def difference(self, other: "Placement") -> str:
        """What differs, for the cell: ``processes 2 → 1, GPU False → True``."""
        mine, theirs = dict(self.items), dict(other.items)
        changed = [f"{name} {mine.get(name)} → {theirs.get(name)}" for name in dict.fromkeys([*mine, *theirs])
                   if mine.get(name) != theirs.get(name)]
        return ", ".join(changed) or "the backend"


class StandbyLaunch(RunningJob):
    """A backend's launch that can start without its job (a standby's): `attach` hands it the run's job and
    emit once a run claimed it; from then on it is that run's `RunningJob`."""

    def attach(self, job: Any, emit: Emit) -> None:
        """The run this launch now runs (its config, where the launcher's own notes go)."""


@dataclass
class _Waiting:
    """A connected waiting worker."""

    conn: Any
    ready: StandbyReady
    answered: bool = False  # sent its job or its release


class Standby:
    """One launch whose ``world_size`` workers wait for a job, and the listener they wait on.

    ``checkpoint_root``: the run's checkpoint root, named at launch (on Ray, the TorchTrainer's run name).
    ``where``: what waits where, for the cell (no secrets). ``order_for(job)``: the `StandbyJob` that sends
    ``job`` (the launcher adds what changed in the notebook since the launch).
    """

    def __init__(self, placement: Placement, world_size: int, host: str, checkpoint_root: str | None, where: str,
                 order_for: Callable[[Any], StandbyJob]):
        self.placement, self.world_size, self.checkpoint_root, self.where = (
            placement, world_size, checkpoint_root, where)
        self._order_for = order_for
        self.launch: StandbyLaunch | None = None
        self.started_at = time.time()
        self.expires_at = self.started_at
        self.claimed = False
        self.released: str | None = None  # why, once released
        self.lost: str | None = None  # a worker lost while waiting: not claimable
        self.pids: dict[int, int] = {}  # rank -> pid of its waiting worker (the latest, after a restart)
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}
        self._parked: dict[int, _Waiting] = {}  # reused workers that finished the current job: the next one's
        self._order: StandbyJob | None = None
        self.all_ready = threading.Event()
        self._listener = AuthenticatedListener(host, self._serve, "dtrain-standby")
        self.address = (host, self._listener.port, self._listener.authkey)

    # -- the listener's side -----------------------------------------------------------------------------
    def _serve(self, conn: Any, serial: int) -> None:
        try:
            ready = decode(conn.recv())
        except Exception:  # not a waiting worker, or the listener closed (the listener closes conn)
            return
        if not isinstance(ready, StandbyReady):
            return
        entry = _Waiting(conn, ready)
        with self._lock:
            self.pids[ready.rank] = ready.pid
            if self._order is not None and ready.done and ready.done == self._order.token:
                self._parked[ready.rank] = entry  # it finished this job and waits for the next (`reuse`)
            elif self._order is not None:  # claimed: a late worker, or a restarted group's (Ray), gets the job
                self._answer(entry, self._order)
            elif self.released is not None:
                self._answer(entry, StandbyRelease(self.released))
            else:
                if ready.rank in self._waiting:  # Ray restarted the group while it waited: restarts were used up
                    self.lost = self.lost or f"rank {ready.rank}'s worker was restarted while waiting"
                self._waiting[ready.rank] = entry
                if len(self._waiting) >= self.world_size:
                    self.all_ready.set()
        try:
            conn.recv()  # a waiting worker never sends more: this returns (EOF) when it closes or dies
        except (EOFError, OSError) as exc:
            log_dropped(__name__, "_serve", exc)
        with self._lock:
            if not entry.answered and self.released is None and entry in (self._waiting.get(ready.rank),
                                                                          self._parked.get(ready.rank)):
                self.lost = self.lost or f"rank {ready.rank}'s worker ended while waiting"

    @staticmethod
    def _answer(entry: _Waiting, message: Message) -> None:
        entry.answered = True
        try:
            entry.conn.send(message.wire())
        except Exception as exc:  # it died meanwhile: the launch reports it (a run's failure, or a lost standby)
            log_dropped(__name__, "_answer", exc)

    # -- the launcher's side ------------------------------------------------------------------------------
    def usable(self) -> bool:
        """Not released, no worker lost, its launch still running: a run may claim it."""
        if self.released is not None or self.lost is not None or self.launch is None:
            return False
        try:
            state = self.launch.poll()
        except Exception as exc:  # a backend's poll may raise its own errors: the run starts fresh
            log_dropped(__name__, "usable", exc)
            return False
        return not state.finished and not state.failures

    def deliver(self, job: Any) -> None:
        """Send ``job`` to every waiting worker, now and to any that connects later (a worker still starting,
        or a restarted group's)."""
        order = dataclasses.replace(self._order_for(job), token=uuid.uuid4().hex)
        with self._lock:
            self._order = order
            for entry in self._waiting.values():
                if not entry.answered:
                    self._answer(entry, order)

    def release(self, reason: str, grace_s: float = _RELEASE_GRACE_S) -> None:
        """No run for this standby. Every worker waiting is told to return and the launch ends by itself; one
        still starting (not every worker connected yet) is cancelled at once, as is one that does not end
        within ``grace_s``. Returns once the launch ended."""
        with self._lock:
            if self.released is not None:
                return
            self.released = reason
            waiting = list(self._waiting.values())
            every_worker_waits = len(waiting) >= self.world_size
            for entry in waiting:
                if not entry.answered:
                    self._answer(entry, StandbyRelease(reason))
        self._listener.close()
        launch = self.launch
        if launch is None:
            return
        if not _ends_within(launch, grace_s if every_worker_waits else 0.0):
            launch.cancel()

    def close(self) -> None:
        """The run that claimed it ended: no more workers may connect."""
        self._listener.close()

    def reuse(self, wait_s: float = _REUSE_WAIT_S) -> bool:
        """The run that claimed it ended well and its job asked for its workers to be reused (a sweep's trial,
        `WorkerJob.reuse_workers`): wait until every worker waits again for a job (within ``wait_s``), then it is
        a standby again, claimable by the next run of its placement. False when they do not (a job that saved a
        checkpoint ends its workers; one lost, the launch ended): the caller ends the launch as a run's."""
        with self._lock:
            if self.released is not None or self.lost is not None or self.launch is None:
                return False
            self._order, self.claimed = None, False
            self._waiting, self._parked = self._parked, {}
            self.all_ready.clear()
            if len(self._waiting) >= self.world_size:
                self.all_ready.set()
        deadline = time.monotonic() + wait_s
        while not self.all_ready.wait(0.02):
            if time.monotonic() > deadline or _finished(self.launch):
                return False
        self.started_at = time.time()
        return self.usable()

    def end_reuse(self, reason: str) -> None:
        """Its workers were not all reused: those that wait again are told to return, no more may connect."""
        with self._lock:
            self.released = self.released or reason
            for entry in [*self._waiting.values(), *self._parked.values()]:
                if not entry.answered:
                    self._answer(entry, StandbyRelease(reason))
        self._listener.close()

    def describe(self) -> str:
        """What waits, where, and until when: one line for the cell."""
        until = time.strftime("%H:%M:%S", time.localtime(self.expires_at))
        return (f"{self.where} wait for the next run with this placement until {until} (idle "
                f"{_seconds(self.expires_at - self.started_at)}; --keep-warm S changes it, %distribute_release "
                "frees them now)")


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


def _finished(launch: RunningJob) -> bool:
    try:
        return launch.poll().finished
    except Exception as exc:  # a backend's poll may raise its own errors: taken as ended
        log_dropped(__name__, "_finished", exc)
        return True


def _ends_within(launch: RunningJob, seconds: float) -> bool:
    """Whether ``launch`` ends by itself within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _finished(launch):
        time.sleep(0.05)
    return _finished(launch)


def _release_in_background(standby: Standby, reason: str, grace_s: float = _RELEASE_GRACE_S) -> None:
    """`Standby.release` on a thread of its own: the caller goes on while the launch ends."""
    threading.Thread(target=standby.release, args=(reason, grace_s), name="dtrain-standby-release",
                     daemon=True).start()


class ClaimedRun(RunningJob):
    """A claimed standby's launch as the run's `RunningJob`: the launch's own poll, release and cancel; the
    standby's listener closes when the run ends. ``reused(standby)``: where a standby whose workers wait again
    after the run goes (a sweep's trials: `Standby.reuse`); the run then returns once every rank's result is in."""

    def __init__(self, standby: Standby, reused: Callable[[Standby], None] | None = None):
        assert standby.launch is not None
        self.standby, self.launch, self._reused = standby, standby.launch, reused
        self.early_release = standby.launch.early_release or reused is not None

    def poll(self) -> LaunchState:
        state = self.launch.poll()
        if state.finished:
            self.standby.close()
        return state

    def release(self) -> None:
        if self._reused is not None:
            if self.standby.reuse():
                self._reused(self.standby)
                return
            self.standby.end_reuse("its workers were not all reused")
            if not self.launch.early_release and _ends_within(self.launch, _RELEASE_GRACE_S):
                return  # (Ray's) its workers returned: the launch ended by itself
        try:
            self.launch.release()
        finally:
            self.standby.close()

    def cancel(self) -> None:
        try:
            self.launch.cancel()
        finally:
            self.standby.close()

    def dump_stacks(self, workers: Any, timeout: float) -> dict[int, tuple[str, str]]:
        return self.launch.dump_stacks(workers, timeout)


class Claim:
    """A standby reserved for one run (`StandbySlot.claim`). The runner names the run after it
    (`checkpoint_root`), then `start` sends the run's job to its workers, or `abandon` gives it back."""

    def __init__(self, slot: "StandbySlot", standby: Standby):
        self._slot, self.standby = slot, standby
        self.checkpoint_root = standby.checkpoint_root
        self._used = False

    def start(self, job: Any, emit: Emit) -> RunningJob:
        """The standby's workers run ``job``: the launch becomes the run's `RunningJob`."""
        self._used = True
        assert self.standby.launch is not None
        self.standby.launch.attach(job, emit)
        self.standby.deliver(job)
        return ClaimedRun(self.standby, self._slot.take_back if getattr(job, "reuse_workers", False) else None)

    def abandon(self) -> None:
        """The run never started (an error before its launch): the standby waits for the next one again."""
        if not self._used:
            self._used = True
            self._slot.give_back(self.standby)


class StandbySlot:
    """A launcher's standby: at most one launched ahead and unclaimed, for the placement of the latest run, and the
    *spares*: standbys whose workers a sweep's trial used and that wait for its next trial (`Standby.reuse`), one
    per trial that ran at once (thread-safe: runs, idle timers, ``%distribute_release`` and the kernel's exit come
    from different threads).

    ``claims``: runs that took a standby; ``launches``: standbys launched; ``reuses``: runs that took a spare
    (tests and benchmarks read them)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.standby: Standby | None = None
        self._timer: threading.Timer | None = None
        self.spares: list[Standby] = []
        self._spare_timers: dict[int, threading.Timer] = {}
        self.claims = 0
        self.launches = 0
        self.reuses = 0

    def claim(self, placement: Placement, reuse: bool = False) -> Claim | None:
        """Reserve the standby for a run with ``placement``: it may still be starting (the run's job then goes
        to each worker as it connects). None when there is none, it is another placement's, or it is lost (then
        it is released: a fresh launch replaces it). ``reuse`` (a sweep's trial): a spare of that placement first."""
        with self._lock:
            spare = self._take_spare(placement) if reuse else None
            if spare is not None:
                spare.claimed = True
                self.claims += 1
                self.reuses += 1
                return Claim(self, spare)
            standby = self.standby
            if standby is None or standby.placement != placement:
                return None
            if not standby.usable():
                self._release_locked(standby.lost or "its launch ended while waiting", wait=False)
                return None
            self._cancel_timer()
            self.standby, standby.claimed = None, True
            self.claims += 1
            return Claim(self, standby)

    def take_back(self, standby: Standby) -> None:
        """A standby whose workers wait again after a sweep's trial (`ClaimedRun.release`): a spare, until the next
        trial claims it, `release_spares`, or its idle time (the latest run's keep-warm time, `ensure`)."""
        with self._lock:
            self.spares.append(standby)
            self._start_spare_timer(standby, max(0.0, standby.expires_at - time.time()) or DEFAULT_KEEP_WARM_S)

    def release_spares(self, reason: str) -> int:
        """Release every spare (a sweep ended: later runs get fresh workers); how many."""
        with self._lock:
            spares = self._remove_spares(lambda spare: True)
        for spare in spares:
            _release_in_background(spare, reason)
        return len(spares)

    def _remove_spares(self, which: Callable[[Standby], bool]) -> list[Standby]:
        """The spares ``which`` picks, no longer spares (their idle timers stopped); under the lock."""
        removed = [spare for spare in self.spares if which(spare)]
        for spare in removed:
            self._drop_spare(spare)
        return removed

    def _drop_spare(self, spare: Standby) -> None:
        self.spares.remove(spare)
        self._cancel_spare_timer(spare)

    def _take_spare(self, placement: Placement) -> Standby | None:
        """The first usable spare of ``placement``, no longer a spare; an unusable one met on the way is released."""
        for spare in list(self.spares):
            if not spare.usable():
                self._drop_spare(spare)
                _release_in_background(spare, spare.lost or "its launch ended while waiting")
            elif spare.placement == placement:
                self._drop_spare(spare)
                return spare
        return None

    def _start_spare_timer(self, spare: Standby, keep_s: float) -> None:
        self._cancel_spare_timer(spare)
        spare.expires_at = time.time() + keep_s
        timer = threading.Timer(keep_s, lambda: self._expire_spare(spare, timer))
        timer.name, timer.daemon = "dtrain-standby-idle", True
        self._spare_timers[id(spare)] = timer
        timer.start()

    def _cancel_spare_timer(self, spare: Standby) -> None:
        timer = self._spare_timers.pop(id(spare), None)
        if timer is not None:
            timer.cancel()

    def _expire_spare(self, spare: Standby, timer: threading.Timer) -> None:
        with self._lock:
            if spare not in self.spares or self._spare_timers.get(id(spare)) is not timer:
                return
            self._drop_spare(spare)  # (cancelling the timer that fired is harmless)
        spare.release(f"idle for {_seconds(time.time() - spare.started_at)}")

    def give_back(self, standby: Standby) -> None:
        """An abandoned claim: the standby waits again, unless another took its place meanwhile."""
        with self._lock:
            if self.standby is None and standby.usable():
                standby.claimed = False
                self.standby = standby
                self._start_timer(standby, max(0.0, standby.expires_at - time.time()))
                return
        standby.release("its run did not start")

    def ensure(self, placement: Placement, keep_s: float, launch: Callable[[], Standby]) -> Standby | None:
        """Make sure a standby with ``placement`` waits for ``keep_s`` seconds from now: the one there (its idle
        time starts again), or a new one (``launch()``) in place of another placement's or a lost one. ``keep_s``
        0: launch nothing (a standby already there is left as it is: a run may still take it)."""
        if keep_s <= 0:
            return None
        with self._lock:
            spare = next((s for s in self.spares if s.placement == placement and s.usable()), None)
            if spare is not None:  # a sweep's trial's workers wait for its next trial
                self._start_spare_timer(spare, keep_s)
                return spare
            standby = self.standby
            if standby is not None and standby.placement == placement and standby.usable():
                self._start_timer(standby, keep_s)
                return standby
            if standby is not None:
                why = (f"the next run's placement differs ({standby.placement.difference(placement)})"
                       if standby.placement != placement else (standby.lost or "its launch ended while waiting"))
                self._release_locked(why, wait=True)
            standby = launch()
            self.standby = standby
            self.launches += 1
            self._start_timer(standby, keep_s)
            return standby

    def make_way(self, placement: Placement) -> Standby | None:
        """Before a fresh launch with ``placement``: release a standby of another placement and wait until its
        launch ended, so the run never waits for what it holds (executor slots, Ray CPUs). A matching one stays
        (a second run at once launches beside it). The released standby, or None."""
        with self._lock:
            for spare in self._remove_spares(lambda spare: spare.placement != placement):
                spare.release(f"a run with another placement ({spare.placement.difference(placement)})")
            standby = self.standby
            if standby is None or standby.placement == placement:
                return None
            self._release_locked(f"a run with another placement ({standby.placement.difference(placement)})", wait=True)
            return standby

    def release(self, reason: str, grace_s: float = _RELEASE_GRACE_S) -> Standby | None:
        """Release the waiting standby and the spares (``%distribute_release``, the kernel's exit, a session restart);
        the standby."""
        with self._lock:
            for spare in self._remove_spares(lambda spare: True):
                spare.release(reason, grace_s)
            standby = self.standby
            if standby is None:
                return None
            self._release_locked(reason, wait=True, grace_s=grace_s)
            return standby

    def release_if(self, standby: Standby, reason: str, free: Callable[[], Any] | None = None) -> bool:
        """Release ``standby`` if it is still the one waiting (not claimed or replaced meanwhile); whether it was.
        ``free()`` runs first, once no run can claim it any more (a launcher freeing its resources at once); the
        launch then ends in the background."""
        with self._lock:
            if self.standby is not standby:
                return False
            self.standby = None
            self._cancel_timer()
            if free is not None:
                try:
                    free()
                except Exception as exc:  # the release below frees them anyway, later
                    log_dropped(__name__, "release_if", exc)
        # Its launch ends in the background (a run may claim the slot's next standby meanwhile)
        _release_in_background(standby, reason)
        return True

    def _release_locked(self, reason: str, wait: bool, grace_s: float = _RELEASE_GRACE_S) -> None:
        standby, self.standby = self.standby, None
        self._cancel_timer()
        if standby is None:
            return
        if wait:
            standby.release(reason, grace_s)
        else:
            _release_in_background(standby, reason, grace_s)

    def _start_timer(self, standby: Standby, keep_s: float) -> None:
        self._cancel_timer()
        standby.expires_at = time.time() + keep_s
        timer = threading.Timer(keep_s, lambda: self._expire(standby, timer))
        timer.name, timer.daemon = "dtrain-standby-idle", True
        self._timer = timer
        timer.start()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _expire(self, standby: Standby, timer: threading.Timer) -> None:
        with self._lock:
            if self.standby is not standby or self._timer is not timer:  # claimed, released or kept since
                return
            self._timer = None
            try:
                self._release_locked(f"idle for {_seconds(time.time() - standby.started_at)}", wait=True)
            except Exception:  # a timer thread has nobody to tell
                _log.warning("could not release the idle standby", exc_info=True)


def environment_changes(before: Mapping[str, str], now: Mapping[str, str],
                        managed: Callable[[str], bool]) -> tuple[dict[str, str], tuple[str, ...]]:
    """What the notebook set and removed in its environment between ``before`` (a launch) and ``now``, except
    the variables ``managed`` says the launchers set themselves."""
    changed = {key: value for key, value in now.items() if before.get(key) != value and not managed(key)}
    removed = tuple(sorted(key for key in before if key not in now and not managed(key)))
    return changed, removed
