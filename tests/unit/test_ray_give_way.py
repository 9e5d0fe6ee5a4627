"""Waiting Ray workers giving way to the notebook's own Ray work (`launchers.ray.yielding`): the rule on what the GCS
says waits, and the watch thread over a real `StandbySlot` with fake workers (tests/unit/test_standby.py's); the
GCS's answers stand in for a Ray here. A real Ray: tests/integration/test_ray_user.py."""

from __future__ import annotations

import threading

import pytest
from test_standby import PLACEMENT, make_standby, wait_until

from dtrain_magic.launchers.ray import yielding
from dtrain_magic.launchers.ray.yielding import GiveWay, blocked_by_workers, enough_free
from dtrain_magic.launchers.standby import StandbySlot

CPU = {"CPU": 1.0}


def test_a_queued_task_or_actor_asking_for_a_cpu_they_hold_makes_them_go():
    assert "task or actor" in blocked_by_workers([{"CPU": 1.0}], [], CPU, 2, starting=False)
    assert "task or actor" in blocked_by_workers([{"CPU": 0.5, "memory": 1e6}], [], CPU, 2, starting=True)


def test_what_they_do_not_hold_or_a_placement_groups_own_bundle_does_not():
    assert blocked_by_workers([{"GPU": 1.0}], [], CPU, 2, starting=False) is None
    assert blocked_by_workers([{"CPU_group_0_abc": 1.0}], [], CPU, 2, starting=False) is None  # held by its group
    assert blocked_by_workers([{}], [], CPU, 2, starting=False) is None  # a zero-CPU actor (Ray Train's controller)
    assert blocked_by_workers([{"CPU": 1.0}], [], {"GPU": 1.0}, 2, starting=False) is None  # GPU workers, no CPU


def test_a_pending_placement_group_makes_them_go_unless_it_is_their_own_while_they_start():
    own = [[{"CPU": 1.0}, {"CPU": 1.0}]]
    assert blocked_by_workers([], own, CPU, 2, starting=True) is None  # Ray Train's, for the workers themselves
    assert "placement group" in blocked_by_workers([], own, CPU, 2, starting=False)  # they are up: someone else's
    assert "placement group" in blocked_by_workers([], [[{"CPU": 2.0}]], CPU, 2, starting=True)


def test_enough_free_counts_every_worker():
    assert enough_free({"CPU": 2.0}, CPU, 2) and not enough_free({"CPU": 1.0}, CPU, 2)
    assert not enough_free({}, {"GPU": 1.0}, 1)


class FakeRay:
    """What the GCS says waits: set ``tasks`` to queue something, ``available`` for the free resources."""

    def __init__(self) -> None:
        self.tasks: list[dict] = []
        self.available = {"CPU": 0.0}

    def __call__(self):
        return list(self.tasks), [], dict(self.available)


@pytest.fixture
def fake_ray(monkeypatch):
    ray = FakeRay()
    monkeypatch.setattr(yielding.ray_compat, "cluster_demand", ray)
    monkeypatch.setattr(yielding, "POLL_S", 0.02)
    monkeypatch.setattr(yielding, "IDLE_S", 0.3)
    return ray


def test_they_go_when_the_notebooks_task_waits_and_come_back_once_ray_is_quiet(fake_ray):
    slot = StandbySlot()
    first = slot.ensure(PLACEMENT, 60, make_standby)
    assert first.all_ready.wait(10)
    relaunched: list[float] = []
    busy = threading.Event()
    watch = GiveWay(slot, busy.is_set)

    def relaunch(keep_s: float) -> None:
        relaunched.append(keep_s)
        slot.ensure(PLACEMENT, keep_s, make_standby)

    watch.watch(CPU, 2, relaunch)
    assert wait_until(lambda: slot.standby is first and first.all_ready.is_set())
    fake_ray.tasks = [{"CPU": 1.0}]  # the notebook's ray.get(f.remote()) waits
    assert wait_until(lambda: first.released is not None, 5) and "gave way" in first.released
    assert wait_until(lambda: watch.released == 1) and slot.standby is None
    fake_ray.tasks, fake_ray.available = [], {"CPU": 2.0}  # it ran; the CPUs are free again
    busy.set()  # ... but a run of this kernel is on the Ray: nothing comes back meanwhile
    threading.Event().wait(0.6)
    assert relaunched == []
    busy.clear()
    # (counted once the relaunch returned, after the slot has its standby: wait for the count, not the standby)
    assert wait_until(lambda: watch.relaunched == 1, 5) and slot.standby is not None
    assert 50 < relaunched[0] <= 60  # for what was left of their idle time
    watch.stop()
    slot.release("the test ends", grace_s=0.0)


def test_after_stop_nothing_comes_back(fake_ray):
    slot = StandbySlot()
    first = slot.ensure(PLACEMENT, 60, make_standby)
    watch = GiveWay(slot, lambda: False)
    watch.watch(CPU, 2, lambda keep_s: slot.ensure(PLACEMENT, keep_s, make_standby))
    assert first.all_ready.wait(10)
    fake_ray.tasks = [{"CPU": 1.0}]
    assert wait_until(lambda: first.released is not None, 5)
    watch.stop()  # %distribute_release, or the kernel's exit
    fake_ray.tasks, fake_ray.available = [], {"CPU": 2.0}
    threading.Event().wait(0.6)
    assert slot.standby is None and watch.relaunched == 0


def test_a_relaunch_that_fails_is_a_warning(fake_ray, caplog):
    """The waiting workers do not come back (the next run starts cold): the user hears it, once (issue #35)."""
    slot = StandbySlot()
    first = slot.ensure(PLACEMENT, 60, make_standby)
    assert first.all_ready.wait(10)
    tried = threading.Event()

    def relaunch(keep_s: float) -> None:
        tried.set()
        raise RuntimeError("the placement group cannot be made")

    watch = GiveWay(slot, lambda: False)
    with caplog.at_level("WARNING", logger=yielding.__name__):
        watch.watch(CPU, 2, relaunch)
        fake_ray.tasks = [{"CPU": 1.0}]
        assert wait_until(lambda: first.released is not None, 5)
        fake_ray.tasks, fake_ray.available = [], {"CPU": 2.0}
        assert tried.wait(5) and wait_until(lambda: "could not bring back" in caplog.text, 5)
        watch.stop()
    assert watch.relaunched == 0 and "the placement group cannot be made" in caplog.text
    slot.release("the test ends", grace_s=0.0)
