"""Standbys without a backend: the real listener and the real waiting function (`launchers.waiting`) in threads
stand for a launch's workers, a fake launch for TorchDistributor.run / TorchTrainer.fit. The backends' own
standbys run for real in tests/integration/test_spark.py and test_ray.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import cloudpickle
import pytest

from dtrain_magic.channel import StandbyJob
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.launchers.base import LaunchState
from dtrain_magic.launchers.standby import (
    DEFAULT_KEEP_WARM_S,
    KEEP_WARM_ENV,
    ClaimedRun,
    Placement,
    Standby,
    StandbyLaunch,
    StandbySlot,
    default_keep_warm_s,
    environment_changes,
    keep_warm_s,
)
from dtrain_magic.launchers.waiting import job_of, serve_jobs, wait_for_job
from dtrain_magic.worker.checkpoints import count_save

PLACEMENT = Placement("fake", (("processes", 2), ("GPU", False)))
OTHER = Placement("fake", (("processes", 1), ("GPU", False)))


MADE: list[tuple[Standby, threading.Thread]] = []  # every fake worker of the running test, with its standby


@pytest.fixture(autouse=True)
def no_fake_worker_left():
    """After each test: its standbys released, every fake worker thread has returned."""
    MADE.clear()
    yield
    for standby, _ in MADE:
        standby.release("the test ends", grace_s=0.0)
    left = [thread for _, thread in MADE if (thread.join(5) or thread.is_alive())]
    MADE.clear()
    assert left == [], f"{len(left)} fake worker(s) still waiting after their standby was released"


class FakeLaunch(StandbyLaunch):
    """Workers as threads running the real waiting function; finished once every one returned (or cancelled)."""

    def __init__(self, standby: Standby, start_workers: bool = True):
        self.standby = standby
        self.orders: dict[int, StandbyJob | None] = {}
        self.threads: list[threading.Thread] = []
        self.cancelled = False
        self.attached = None
        if start_workers:
            for rank in range(standby.world_size):
                self.add_worker(rank)

    def add_worker(self, rank: int) -> threading.Thread:
        # daemon: a fake worker left waiting must not keep pytest's process from exiting (real workers are
        # processes the launch cancels); `no_fake_worker_left` still fails the test that leaves one.
        thread = threading.Thread(
            target=lambda: self.orders.__setitem__(rank, wait_for_job(self.standby.address, rank)), daemon=True)
        MADE.append((self.standby, thread))
        self.threads.append(thread)
        thread.start()
        return thread

    def attach(self, job, emit) -> None:
        self.attached = job

    def poll(self) -> LaunchState:
        returned = len(self.orders) >= self.standby.world_size and not any(t.is_alive() for t in self.threads)
        return LaunchState(self.cancelled or returned)

    def cancel(self) -> None:
        self.cancelled = True


def make_standby(world_size: int = 2, placement: Placement = PLACEMENT, start_workers: bool = True,
                 root: str | None = "/runs/dtrain_abc") -> Standby:
    standby = Standby(placement, world_size, "127.0.0.1", root, f"{world_size} fake worker(s)",
                      lambda job: StandbyJob(cloudpickle.dumps(job), "/tmp", {"A": "1"}, ("B",), None))
    standby.launch = FakeLaunch(standby, start_workers)
    return standby


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_ready_standby_is_claimed_and_every_worker_gets_the_runs_job():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    assert standby.all_ready.wait(10) and sorted(standby.pids) == [0, 1]
    claim = slot.claim(PLACEMENT)
    assert claim is not None and claim.checkpoint_root == "/runs/dtrain_abc" and slot.standby is None
    running = claim.start({"the": "job"}, emit=lambda message: None)
    launch = standby.launch
    assert wait_until(lambda: running.poll().finished)  # every worker got its job (and, here, returned)
    assert [job_of(launch.orders[rank]) for rank in (0, 1)] == [{"the": "job"}] * 2
    assert launch.attached == {"the": "job"} and launch.orders[0].env_set == {"A": "1"}
    assert slot.claims == 1 and slot.launches == 1
    assert slot.claim(PLACEMENT) is None  # one run per standby: a second run at once launches fresh


def test_a_run_takes_over_a_standby_still_starting():
    """A re-run started the moment the last one returned: the job waits for the workers, not the other way."""
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, lambda: make_standby(start_workers=False))
    claim = slot.claim(PLACEMENT)
    assert claim is not None
    claim.start("job", emit=lambda message: None)
    launch = standby.launch
    for rank in (1, 0):  # the workers come up after the claim, in any order
        launch.add_worker(rank).join(10)
    assert [job_of(launch.orders[rank]) for rank in (0, 1)] == ["job", "job"]


def test_a_restarted_worker_group_gets_the_same_job_again():
    """Ray Train restarts the group during the run (--max-restarts): the new workers run the waiting loop again."""
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    assert standby.all_ready.wait(10)
    slot.claim(PLACEMENT).start("job", emit=lambda message: None)
    launch = standby.launch
    assert wait_until(lambda: len(launch.orders) == 2)
    launch.orders.clear()
    for rank in (0, 1):
        launch.add_worker(rank).join(10)
    assert [job_of(launch.orders[rank]) for rank in (0, 1)] == ["job", "job"]


def test_another_placement_does_not_claim_and_make_way_releases_and_waits():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    assert standby.all_ready.wait(10)
    assert slot.claim(OTHER) is None and slot.standby is standby
    released = slot.make_way(OTHER)
    assert released is standby and slot.standby is None
    assert standby.launch.poll().finished and not standby.launch.cancelled  # the workers returned by themselves
    assert standby.launch.orders == {0: None, 1: None}  # released: nothing to run
    assert "processes 2 → 1" in standby.released
    assert slot.make_way(PLACEMENT) is None  # nothing left to release


def test_make_way_keeps_a_matching_standby():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    assert slot.make_way(PLACEMENT) is None and slot.standby is standby
    slot.release("test over")


def test_a_standby_still_starting_is_cancelled_at_once_when_released():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, lambda: make_standby(start_workers=False))
    started = time.monotonic()
    assert slot.release("released by %distribute_release") is standby
    assert standby.launch.cancelled and time.monotonic() - started < 1
    # a worker that comes up afterwards finds the listener closed and returns
    standby.launch.add_worker(0).join(10)
    assert standby.launch.orders[0] is None


def test_idle_standby_is_released_after_keep_warm_seconds():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 0.5, make_standby)
    assert standby.all_ready.wait(10) and 0.4 < standby.expires_at - standby.started_at < 0.6
    assert wait_until(lambda: slot.standby is None, 10)
    assert wait_until(lambda: standby.launch.poll().finished, 10)
    assert standby.released.startswith("idle for") and standby.launch.orders == {0: None, 1: None}


def test_ensure_keeps_the_standby_there_and_starts_its_idle_time_again():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 0.6, make_standby)
    time.sleep(0.4)
    assert slot.ensure(PLACEMENT, 0.6, lambda: pytest.fail("launched twice")) is standby
    time.sleep(0.4)  # past the first deadline: the restarted timer keeps it
    assert slot.standby is standby and standby.released is None
    assert slot.launches == 1
    slot.release("test over")


def test_keep_warm_zero_launches_nothing_and_leaves_a_waiting_standby_for_the_run():
    slot = StandbySlot()
    assert slot.ensure(PLACEMENT, 0, lambda: pytest.fail("launched")) is None
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    assert slot.ensure(PLACEMENT, 0, lambda: pytest.fail("launched")) is None and slot.standby is standby
    assert slot.claim(PLACEMENT) is not None


def test_ensure_with_another_placement_replaces_the_standby():
    slot = StandbySlot()
    first = slot.ensure(PLACEMENT, 60, make_standby)
    assert first.all_ready.wait(10)
    second = slot.ensure(OTHER, 60, lambda: make_standby(1, OTHER))
    assert second is not first and slot.standby is second and first.released and first.launch.poll().finished
    assert "differs" in first.released
    slot.release("test over")


def test_a_worker_lost_while_waiting_makes_the_standby_unclaimable():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, lambda: make_standby(start_workers=False))
    launch = standby.launch
    launch.add_worker(0)
    # rank 1 connects, says ready, then dies (its connection closes without an answer)
    from multiprocessing.connection import Client

    from dtrain_magic.channel import StandbyReady

    host, port, key = standby.address
    conn = Client((host, port), authkey=key)
    conn.send(StandbyReady(1, 99999, "h").wire())
    assert wait_until(lambda: standby.all_ready.is_set())
    conn.close()
    assert wait_until(lambda: standby.lost is not None)
    assert "rank 1" in standby.lost and not standby.usable()
    assert slot.claim(PLACEMENT) is None and slot.standby is None  # released: a fresh launch replaces it
    assert wait_until(lambda: launch.orders.get(0, "waiting") is None)


def test_an_abandoned_claim_waits_for_the_next_run_again():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    claim = slot.claim(PLACEMENT)
    claim.abandon()
    assert slot.standby is standby and not standby.claimed
    assert slot.claim(PLACEMENT).standby is standby


def test_a_run_that_ends_closes_the_standbys_listener():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, make_standby)
    running = slot.claim(PLACEMENT).start("job", emit=lambda message: None)
    assert wait_until(lambda: running.poll().finished)
    assert standby._listener.closed.is_set()


def test_a_client_without_the_secret_is_refused_and_a_wrong_secret_gets_no_job():
    from multiprocessing.connection import AuthenticationError, Client

    standby = make_standby(start_workers=False)
    host, port, _ = standby.address
    with pytest.raises(AuthenticationError):
        Client((host, port), authkey=b"x" * 32)
    assert wait_for_job((host, port, b"x" * 32), 0) is None
    assert standby.pids == {}
    standby.release("test over")


def test_the_description_says_what_waits_where_and_until_when():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 600, make_standby)
    text = standby.describe()
    until = time.strftime("%H:%M:%S", time.localtime(standby.expires_at))
    assert text.startswith("2 fake worker(s) wait for the next run with this placement until " + until)
    assert "idle 10 min" in text and "%distribute_release" in text
    slot.release("test over")


# -- the default: what is held, and for how long --------------------------------------------------------

def test_keep_warm_flag_wins_everywhere_and_the_default_holds_only_where_allowed(monkeypatch):
    monkeypatch.delenv(KEEP_WARM_ENV, raising=False)
    assert keep_warm_s(RunConfig(backend="ray"), holds_by_default=True) == DEFAULT_KEEP_WARM_S == 600
    assert keep_warm_s(RunConfig(backend="ray"), holds_by_default=False) == 0  # a cluster the user brought
    assert keep_warm_s(RunConfig(backend="ray", keep_warm=30), holds_by_default=False) == 30
    assert keep_warm_s(RunConfig(backend="spark", keep_warm=0), holds_by_default=True) == 0
    monkeypatch.setenv(KEEP_WARM_ENV, "120")
    assert keep_warm_s(RunConfig(backend="spark"), holds_by_default=True) == 120
    assert keep_warm_s(RunConfig(backend="spark"), holds_by_default=False) == 0  # the variable never opts a cluster in


@pytest.mark.parametrize("text", ["soon", "-1", "nan"])
def test_a_bad_keep_warm_variable_is_a_clear_error(monkeypatch, text):
    monkeypatch.setenv(KEEP_WARM_ENV, text)
    with pytest.raises(ConfigError, match=r"\$DTRAIN_MAGIC_KEEP_WARM: got .*must be a number of seconds >= 0"):
        default_keep_warm_s()


@pytest.mark.parametrize("value", [-1, "x", True])
def test_keep_warm_flag_values_are_checked(value):
    with pytest.raises(ConfigError, match="--keep-warm"):
        RunConfig(backend="spark", keep_warm=value)


def test_keep_warm_is_refused_on_the_local_backend():
    with pytest.raises(ConfigError, match="--keep-warm: applies only to --backend spark or ray"):
        RunConfig(backend="local", keep_warm=10)


def test_environment_changes_leave_out_what_the_launchers_manage():
    before = {"A": "1", "B": "2", "CUDA_VISIBLE_DEVICES": "0", "GONE": "x"}
    now = {"A": "1", "B": "3", "NEW": "4", "CUDA_VISIBLE_DEVICES": "1", "RANK": "0"}
    changed, removed = environment_changes(before, now, lambda key: key in ("CUDA_VISIBLE_DEVICES", "RANK"))
    assert changed == {"B": "3", "NEW": "4"} and removed == ("GONE",)


def test_placement_difference_names_what_changed():
    assert PLACEMENT.difference(OTHER) == "processes 2 → 1"
    assert PLACEMENT.difference(PLACEMENT) == "the backend"


# -- a sweep's trials reuse the workers (`Standby.reuse`, `launchers.waiting.serve_jobs`) ---------------------------
@dataclass
class Job:
    name: str
    reuse_workers: bool
    fails: bool = False
    saves_checkpoint: bool = False  # (Ray Train would hand it to the next job as that job's own)


class ServingLaunch(FakeLaunch):
    """Workers as threads running the real `serve_jobs`: each job's name is recorded per rank, with the thread."""

    def __init__(self, standby: Standby):
        self.ran: dict[int, list[tuple[str, int]]] = {}
        super().__init__(standby)

    def add_worker(self, rank: int) -> threading.Thread:
        def run(order, job) -> bool:
            self.ran.setdefault(rank, []).append((job.name, threading.get_ident()))
            if job.saves_checkpoint:
                count_save()
            return not job.fails

        thread = threading.Thread(target=lambda: self.orders.__setitem__(
            rank, serve_jobs(self.standby.address, rank, run)), daemon=True)
        MADE.append((self.standby, thread))
        self.threads.append(thread)
        thread.start()
        return thread


def serving_standby() -> Standby:
    standby = make_standby(start_workers=False)
    standby.launch = ServingLaunch(standby)
    return standby


def test_a_sweeps_trials_run_one_after_another_on_the_same_workers():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, serving_standby)
    first = slot.claim(PLACEMENT).start(Job("trial 1", reuse_workers=True), emit=lambda message: None)
    assert first.early_release  # the run returns on its results: the workers do not end
    launch = standby.launch
    assert wait_until(lambda: all(len(launch.ran.get(rank, ())) == 1 for rank in (0, 1)))
    first.release()  # every worker waits again: a spare, claimed before any new launch
    assert slot.spares == [standby] and not launch.poll().finished
    assert slot.ensure(PLACEMENT, 60, lambda: pytest.fail("launched beside a spare")) is standby
    assert slot.claim(PLACEMENT) is None  # a run that is not a sweep's trial gets fresh processes
    second = slot.claim(PLACEMENT, reuse=True)
    assert second is not None and second.standby is standby and slot.reuses == 1 and slot.spares == []
    running = second.start(Job("trial 2", reuse_workers=False), emit=lambda message: None)
    assert wait_until(lambda: running.poll().finished)  # a job that does not ask for reuse ends them
    assert {rank: [name for name, _ in ran] for rank, ran in launch.ran.items()} == {
        0: ["trial 1", "trial 2"], 1: ["trial 1", "trial 2"]}  # each job once per rank, never the last one again
    assert all(len({thread for _, thread in ran}) == 1 for ran in launch.ran.values())  # on the same worker
    assert slot.launches == 1


@pytest.mark.parametrize("how", [{"fails": True}, {"saves_checkpoint": True}], ids=["raised", "saved a checkpoint"])
def test_workers_that_do_not_wait_again_end_the_launch_as_a_runs_and_no_spare_is_kept(how):
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, serving_standby)
    running = slot.claim(PLACEMENT).start(Job("trial", reuse_workers=True, **how), emit=lambda message: None)
    assert wait_until(lambda: standby.launch.poll().finished)  # a job that raised: its workers return
    running.release()
    assert slot.spares == [] and standby.released is not None
    assert slot.claim(PLACEMENT) is None


def test_the_spares_are_released_when_the_sweep_ends_and_their_workers_return():
    slot = StandbySlot()
    standby = slot.ensure(PLACEMENT, 60, serving_standby)
    slot.claim(PLACEMENT).start(Job("trial", reuse_workers=True), emit=lambda message: None)
    launch = standby.launch
    assert wait_until(lambda: len(launch.ran) == 2)
    ClaimedRun(standby, slot.take_back).release()
    assert slot.release_spares("the sweep ended") == 1 and slot.spares == []
    assert wait_until(lambda: launch.poll().finished) and standby.released == "the sweep ended"
