"""``--max-restarts`` on Spark (issue #37), the logic alone: `RestartingJob` decides when an attempt failed, says so,
stops it and launches the next; `resume_point` names where the function resumes. Fake attempts stand for
TorchDistributor launches (tests/integration/test_spark.py runs the real ones)."""

from __future__ import annotations

import os

from dtrain_magic.channel import Output
from dtrain_magic.launchers.base import Failure, LaunchState, RunningJob
from dtrain_magic.launchers.spark import restarts
from dtrain_magic.launchers.spark.restarts import RestartingJob
from dtrain_magic.worker.resume_point import checkpoint_step, note_step, resume_point


class Attempt(RunningJob):
    """One launch: what its poll says is set by the test."""

    def __init__(self) -> None:
        self.state = LaunchState(False)
        self.cancelled = self.released = 0

    def poll(self) -> LaunchState:
        return self.state

    def cancel(self) -> None:
        self.cancelled += 1

    def release(self) -> None:
        self.released += 1


def checkpoint(root, index: int, step: int | None) -> str:
    directory = os.path.join(root, f"checkpoint_{index:06d}")
    os.makedirs(directory)
    note_step(directory, {} if step is None else {"step": step}, is_main=True)
    open(os.path.join(directory, ".complete"), "w").close()
    return directory


def job(tmp_path, restarts_allowed: int = 2):
    attempts = [Attempt()]
    said: list[Output] = []

    def relaunch() -> Attempt:
        attempts.append(Attempt())
        return attempts[-1]

    return RestartingJob(attempts[0], relaunch, restarts_allowed, said.append, str(tmp_path)), attempts, said


def test_a_dead_rank_stops_the_attempt_and_launches_the_next_from_the_newest_checkpoint(tmp_path):
    checkpoint(tmp_path, 0, 3)
    running, attempts, said = job(tmp_path)
    assert running.poll() == LaunchState(False, [], errors_final=False)  # running: nothing to do
    attempts[0].state = LaunchState(False, [Failure(1, "process was killed by SIGKILL")])
    state = running.poll()
    note = "rank 1 lost (process was killed by SIGKILL): restarting from step 3, 1 of 2"
    assert state.restarted and not state.finished and not state.errors_final and state.restart_note == note
    assert [m.text for m in said] == [f"dtrain_magic: {note}\n"] and said[0].rank is None
    assert attempts[0].cancelled == 1 and len(attempts) == 2 and running.current is attempts[1]
    assert not running.poll().restarted  # the new attempt runs
    attempts[1].state = LaunchState(True, [Failure(0, "process was killed by SIGTERM")])
    assert running.poll().restarted and len(attempts) == 3 and "2 of 2" in said[-1].text
    attempts[2].state = LaunchState(True, [Failure(0, "process exited with code 1")])
    final = running.poll()  # no restart left: the failure is the run's
    assert final == LaunchState(True, [Failure(0, "process exited with code 1")], errors_final=True)
    assert len(attempts) == 3


def test_a_reported_error_waits_for_a_death_which_is_the_cause(tmp_path, monkeypatch):
    running, attempts, said = job(tmp_path, 1)
    running.worker_failed(0, "RuntimeError: Connection closed by peer")  # rank 1's death, seen from rank 0
    assert not running.poll().restarted  # its watchdog may still be naming rank 1's signal
    attempts[0].state = LaunchState(False, [Failure(1, "process exited with code 1")])
    state = running.poll()
    assert state.restart_note.startswith("rank 1 lost (process exited with code 1): restarting from the start")
    assert running.poll() == LaunchState(False, [], errors_final=True)  # the old attempt's error is forgotten


def test_a_reported_error_alone_restarts_once_the_attempt_ended_or_after_the_wait(tmp_path, monkeypatch):
    checkpoint(tmp_path, 0, None)
    running, attempts, _ = job(tmp_path)
    running.worker_failed(1, "ValueError: boom")
    attempts[0].state = LaunchState(True)  # TorchDistributor returned: the raising rank exited cleanly
    assert running.poll().restart_note == "rank 1 lost (ValueError: boom): restarting from checkpoint_000000, 1 of 2"
    running.worker_failed(None, "an unreadable message")
    monkeypatch.setattr(restarts, "_REPORTED_WAIT_S", 0.0)
    assert running.poll().restart_note.startswith("the job lost (an unreadable message)")


def test_every_rank_preempted_is_a_notice_not_a_lost_rank(tmp_path):
    """Every rank checkpointed for a preemption notice and returned (`Preempted` over the channel, the job ended):
    the restart line says so; one rank's `Preempted` beside another's failure is that failure's."""
    checkpoint(tmp_path, 0, 8)
    running, attempts, said = job(tmp_path)
    for rank in (1, 0):
        running.worker_failed(rank, "Preempted: preempted (SIGTERM): every rank checkpointed after step 8")
    attempts[0].state = LaunchState(True)
    note = "every rank checkpointed for a preemption notice (SIGTERM): restarting from step 8, 1 of 2"
    assert running.poll().restart_note == note and said[-1].text == f"dtrain_magic: {note}\n"
    running.worker_failed(0, "Preempted: preempted (SIGTERM): every rank checkpointed after step 8")
    attempts[1].state = LaunchState(True, [Failure(1, "process was killed by SIGKILL")])
    assert running.poll().restart_note.startswith("rank 1 lost (process was killed by SIGKILL)")


def test_nothing_restarts_once_the_run_is_released_or_cancelled(tmp_path):
    running, attempts, _ = job(tmp_path)
    running.release()
    attempts[0].state = LaunchState(True, [Failure(1, "killed")])
    assert not running.poll().restarted and attempts[0].released == 1
    running.cancel()
    assert attempts[0].cancelled == 1 and len(attempts) == 1


def test_the_resume_point_is_the_stores_latest_and_its_noted_step(tmp_path):
    assert resume_point(str(tmp_path)).words() == "the start (no complete checkpoint yet)"
    assert resume_point(None).directory is None
    checkpoint(tmp_path, 0, 3)
    newest = checkpoint(tmp_path, 1, 7)
    os.makedirs(tmp_path / "checkpoint_000002")  # a save that crashed half-way: never the resume point
    point = resume_point(str(tmp_path))
    assert (point.directory, point.step, point.words()) == (newest, 7, "step 7")
    note_step(newest, {"step": 9}, is_main=False)  # only rank 0 writes it
    note_step(newest, {"step": True}, is_main=True)  # not an integer step: nothing noted
    assert checkpoint_step(newest) == 7 and checkpoint_step(str(tmp_path)) is None
