"""Stopping every rank after one step (issue #36, pruning): the pump's choice of the step (`StopPlan`, a given clock),
the notebook → rank message over a real channel, and a rank's pulse thread and ``check_stop`` (no process group)."""

from __future__ import annotations

import math
import time

import pytest

from dtrain_magic import channel as ch
from dtrain_magic.channel import Channel, WorkerLink
from dtrain_magic.driver.step_stop import GRACE_S, LEAD_S, MARGIN_STEPS, RATE_WAIT_S, StepStop, StopPlan
from dtrain_magic.errors import StopAtStep
from dtrain_magic.worker.pulse import Pulse


def plan_with(rates: dict[int, float], steps: dict[int, int], at: float = 10.0) -> StopPlan:
    """A plan fed two pulses per rank, one second apart, the second at ``at``."""
    plan = StopPlan(len(steps))
    for rank, count in steps.items():
        plan.pulse(rank, count - round(rates[rank]), at - 1.0)
        plan.pulse(rank, count, at)
    return plan


def test_the_step_is_beyond_where_the_furthest_rank_can_be_when_the_message_lands():
    plan = plan_with({0: 20.0, 1: 20.0}, {0: 40, 1: 39}, at=10.0)
    # 0.3 s after rank 0's last pulse at 20 steps/s it may be at 46; the message takes up to LEAD_S more
    target = plan.choose(now=10.3, asked_at=10.3)
    assert target == math.ceil(40 + 20 * (0.3 + LEAD_S) - 1e-6) + MARGIN_STEPS
    assert plan_with({0: 0.0}, {0: 7}).choose(now=11.0, asked_at=11.0) == 7 + MARGIN_STEPS  # a still rank


def test_no_step_is_picked_before_every_rank_reported_and_its_rate_is_known():
    plan = StopPlan(2)
    plan.pulse(0, 5, 1.0)
    plan.pulse(0, 10, 1.5)
    assert plan.choose(now=1.6, asked_at=1.6) is None  # rank 1 never reported
    plan.pulse(1, 9, 1.5)
    assert plan.choose(now=1.6, asked_at=1.6) is None  # rank 1's rate unknown: wait for its next pulse
    assert plan.choose(now=1.6 + RATE_WAIT_S, asked_at=1.6) is not None  # ... but not for ever


def test_a_rank_past_the_step_or_one_that_never_stops_falls_back_to_stop_at_once():
    plan = plan_with({0: 10.0, 1: 10.0}, {0: 20, 1: 20})
    plan.sent(25, now=10.0)
    assert plan.fallback(10.1, ended=set()) is None
    plan.missed(1, 26)
    assert "rank 1 was already at step 26 when asked to stop after step 25" in plan.fallback(10.1, set())

    late = plan_with({0: 10.0, 1: 10.0}, {0: 20, 1: 20})
    late.sent(25, now=10.0)  # half a second to reach it, then the grace
    assert late.fallback(10.0 + 0.5 + GRACE_S - 0.1, ended={0}) is None
    assert "rank 1 did not stop after step 25" in late.fallback(10.0 + 0.5 + GRACE_S + 0.1, ended={0})
    assert late.fallback(10.0 + 0.5 + GRACE_S + 0.1, ended={0, 1}) is None  # every rank ended: nothing to stop


def test_the_step_is_known_once_every_rank_stopped_after_the_same_one():
    plan = plan_with({0: 1.0, 1: 1.0}, {0: 3, 1: 3})
    plan.sent(6, now=10.0)
    plan.stopped(0, 6)
    assert plan.step is None
    plan.stopped(1, 6)
    assert plan.step == 6


def test_a_step_stop_is_a_stop_event_that_remembers_the_first_reason():
    stop = StepStop()
    assert not stop.wanted and not stop.is_set()
    stop.at_a_step("pruned at step 3")
    stop.at_a_step("pruned at step 4")
    assert stop.wanted and stop.reason == "pruned at step 3" and not stop.is_set()


def test_the_notebook_writes_to_each_rank_over_its_own_connection():
    with Channel() as channel:
        links = [WorkerLink(channel.address, rank) for rank in range(2)]
        assert not channel.send_to_ranks(ch.StopAt(5, "x"), 2)  # no Hello yet: nothing is sent
        for rank, link in enumerate(links):
            link.send(ch.Hello(rank, 100 + rank, "here"))
        for _ in links:
            assert isinstance(channel.get(timeout=5), ch.Hello)
        assert links[0].receive() is None
        assert channel.send_to_ranks(ch.StopAt(5, "pruned"), 2)
        for link in links:
            deadline = time.monotonic() + 5
            while (message := link.receive()) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert message == ch.StopAt(5, "pruned")
            link.close()


def test_a_ranks_pulse_thread_takes_the_step_and_the_training_thread_stops_after_it():
    with Channel() as channel:
        link = WorkerLink(channel.address, 0)
        link.send(ch.Hello(0, 1, "here"))
        assert isinstance(channel.get(timeout=5), ch.Hello)
        pulse = Pulse(0, link.send, inbox=link)
        try:
            pulse.step()
            pulse.check_stop()  # nothing asked: goes on
            assert channel.send_to_ranks(ch.StopAt(3, "pruned"), 1)
            deadline = time.monotonic() + 5
            while pulse.stop_at is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pulse.stop_at == 3  # taken at once, not at the next send (a quarter second)
            pulse.step()
            pulse.check_stop()
            pulse.step()
            with pytest.raises(StopAtStep) as stopped:
                pulse.check_stop()
            assert stopped.value.step == 3
        finally:
            started = time.monotonic()
            pulse.close()
            assert time.monotonic() - started < 1.0  # close wakes the thread's wait
            link.close()


def test_a_rank_already_past_the_step_says_so_once_and_goes_on():
    sent = []
    pulse = Pulse(1, sent.append, reporter=False)
    for _ in range(5):
        pulse.step()
    pulse.stop_at = 4
    pulse.check_stop()
    pulse.step()
    pulse.check_stop()
    assert [m for m in sent if isinstance(m, ch.StopMissed)] == [ch.StopMissed(1, 5, 4)]


def test_a_loop_that_never_steps_stops_at_its_log_count():
    pulse = Pulse(0, lambda message: None, reporter=False)
    pulse.stop_at = 2
    pulse.log_call()
    pulse.check_stop()
    pulse.log_call()
    with pytest.raises(StopAtStep):
        pulse.check_stop()
