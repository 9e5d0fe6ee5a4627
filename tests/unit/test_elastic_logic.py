"""Issue #37 part A, the pure logic: atomic checkpoint naming and keep-K pruning, the generators' state, the batch
arithmetic of a resize (accumulation recomputed, the learning-rate factor where it does not divide), the data position
re-split over another number of ranks (every row once, the same global batches), the relaunch decisions of the
local launcher, and the steps a restart lost as the notebook counts them."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dtrain_magic.config import RunConfig
from dtrain_magic.data.reader import DataBatches
from dtrain_magic.data.split import epoch_rows, global_sequence, resplit, samples_read
from dtrain_magic.driver.resizes import ResizeLog
from dtrain_magic.elastic import grown_world, parse_elastic, recompute, survivors_world
from dtrain_magic.errors import ConfigError
from dtrain_magic.worker import checkpoints
from dtrain_magic.worker.checkpoints import CheckpointStore, load_rng, save_rng, to_prune


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_a_partial_checkpoint_is_never_the_latest_nor_written_into_again(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    first = store.next_dir()
    store.saved(first)
    crashed = store.next_dir()  # a save that died before every rank wrote its part
    (tmp_path / "run" / "checkpoint_000001" / "stale_shard").write_text("from a world of another size")
    assert store.latest() == first
    third = store.next_dir()
    assert os.path.basename(third) == "checkpoint_000002" and third != crashed  # numbered past the partial one
    store.saved(third)
    assert store.latest() == third
    assert not os.path.exists(crashed)  # the crash's leftovers go once a later save is complete


def test_keep_k_removes_older_numbered_checkpoints_once_a_newer_one_is_complete(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"), keep=2)
    saved = []
    for _ in range(4):
        path = store.next_dir()
        in_progress = store.next_dir() if len(saved) == 3 else None  # rank 0 never prunes a save in progress
        store.saved(path)
        saved.append(path)
    assert sorted(os.listdir(tmp_path / "run")) == ["LATEST", "checkpoint_000002", "checkpoint_000003",
                                                      "checkpoint_000004"]
    assert store.latest() == saved[-1] and in_progress and os.path.isdir(in_progress)


def test_to_prune_keeps_the_newest_k_and_partial_saves_newer_than_the_latest():
    numbered = {0: True, 1: False, 2: True, 3: True, 4: False}
    assert to_prune(numbered, 2) == [0, 1]
    assert to_prune(numbered, None) == [1]  # all complete ones kept, the crash's partial one goes
    assert to_prune({0: False}, 1) == []  # nothing complete yet: nothing goes


def test_the_generators_state_comes_back_per_rank(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_rng(str(tmp_path), rank=1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert load_rng(str(tmp_path), rank=1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert not load_rng(str(tmp_path), rank=0)  # no state for that rank (a grown world): it keeps its own
    assert os.path.exists(checkpoints.rng_path(str(tmp_path), 1))


# -- batch arithmetic -------------------------------------------------------------------------------------------
def test_the_accumulation_keeps_the_global_batch_or_says_the_nearest_and_the_lr_factor():
    shrink = recompute(2, 1, 1)
    assert (shrink.accum, shrink.lr_scale, shrink.exact) == (2, 1.0, True) and "global batch kept" in shrink.note()
    back = recompute(2, 2, 1)
    assert (back.accum, back.lr_scale) == (1, 1.0)
    odd = recompute(3, 2, 1)  # 3 micro-batches per step over 2 ranks: 2 x 2 = 4, the nearest
    assert odd.accum == 2 and odd.lr_scale == pytest.approx(4 / 3) and not odd.exact
    assert "1.33333" in odd.note() and "learning rate is scaled" in odd.note()
    assert recompute(4, 3, 3).accum == 4 and recompute(4, 3, 3).exact
    assert recompute(1, 4, 1).accum == 1 and recompute(1, 4, 1).lr_scale == 4.0  # never below one micro-batch


def test_elastic_bounds_and_worlds():
    assert parse_elastic("1:2") == (1, 2) and parse_elastic(None) is None
    for bad in ("2:1", "0:2", "a:b", "3", "1:2:3"):
        with pytest.raises(ConfigError) as info:
            parse_elastic(bad)
        assert info.value.flag == "--elastic" and "MIN:MAX" in str(info.value)
    assert survivors_world(2, 1, (1, 2)) == 1 and survivors_world(3, 2, (2, 4)) is None
    assert grown_world(1, (1, 2), room=8) == 2 and grown_world(1, (1, 4), room=3) == 3
    assert grown_world(3, (1, 4), room=2) == 3  # never below what runs


@pytest.mark.parametrize("kwargs, flag, words", [
    (dict(backend="spark", elastic="1:2"), "--elastic", "--backend local or ray"),
    (dict(backend="local", elastic="1:1"), "--elastic", "MIN <= -n <= MAX"),
    (dict(backend="local", elastic="1:2", tp=2), "--elastic", "--tp/--pp"),
    (dict(backend="local", preempt_grace=-1), "--preempt-grace", ">= 0"),
    (dict(backend="local", keep_checkpoints=0), "--keep-checkpoints", ">= 1"),
])
def test_bad_reliability_flags_name_the_flag_and_what_is_allowed(kwargs, flag, words):
    with pytest.raises(ConfigError) as info:
        RunConfig(use_gpu=False, **kwargs)
    assert info.value.flag == flag and words in str(info.value)


@pytest.mark.parametrize("backend", ["local", "spark", "ray"])
@pytest.mark.parametrize("grace", [0.0, 5.0])
def test_every_backend_acts_on_a_notice_or_none(backend, grace):
    """``--preempt-grace 0`` (what a session sets for its ranks) asks nothing of a backend; every backend acts on a
    notice (local and Spark: a SIGTERM; Ray: a drain)."""
    assert RunConfig(backend=backend, use_gpu=False, preempt_grace=grace).preempt_grace == grace


# -- the data position re-split ---------------------------------------------------------------------------------
@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resplit_epoch_reads_every_row_once_and_keeps_each_global_batch(old, new, shuffle):
    block_rows, batch = [24, 24, 24], 4  # 72 rows: no padding for these worlds
    rows = [epoch_rows(block_rows, r, old, 1, 3, shuffle, False, batch, 16) for r in range(old)]
    sequence = global_sequence(rows, batch)
    for done in (0, 1, 3):  # batches each old rank read before the checkpoint
        start = samples_read(old, done, batch, len(rows[0]))
        assert sorted(np.concatenate([r[: done * batch] for r in rows])) == sorted(sequence[:start])
        mine = [resplit(sequence[start:], r, new, batch) for r in range(new)]
        read = np.concatenate([np.concatenate(m) for m in mine if m] + [sequence[:start]])
        assert sorted(read.tolist()) == list(range(72))  # each row of the epoch exactly once
        # a global batch of old x batch rows (accumulation old/new on the new ranks) holds the same rows
        accum = old // new if old % new == 0 else None
        if accum:
            first_old_step = {int(i) for r in rows for i in r[done * batch:(done + 1) * batch]}
            first_new_step = {int(i) for m in mine for b in m[:accum] for i in b}
            assert first_new_step == first_old_step


def test_resplit_shares_a_last_partial_round_so_every_rank_has_as_many_batches():
    rest = np.arange(10)
    shared = [resplit(rest, r, 3, 2) for r in range(3)]  # a round of 6, then 4 rows over 3 ranks: 1, 2, 1
    assert [len(p) for p in shared] == [2, 2, 2]
    assert sorted(np.concatenate([np.concatenate(p) for p in shared]).tolist()) == list(range(10))
    assert [len(p) for p in (resplit(rest, r, 3, 2, drop_last=True) for r in range(3))] == [1, 1, 1]
    tiny = [resplit(np.arange(7), r, 3, 2) for r in range(3)]  # a last round of 1 row: two ranks pad with 1 row
    assert [len(p[-1]) for p in tiny] == [1, 1, 1] and sum(len(b) for p in tiny for b in p) == 9


@pytest.fixture
def source(tmp_path):
    from dtrain_magic.data.blocks import ArrowFileBlocks, StagedSource
    from dtrain_magic.data.columns import table_from_arrays
    from dtrain_magic.data.kinds import _write_arrow

    table = table_from_arrays({"id": np.arange(96, dtype=np.int64)})
    path = str(tmp_path / "data.arrow")
    _write_arrow(table, path, 20)
    return StagedSource("rows", "test", 96, table.schema, ArrowFileBlocks(path, (20, 20, 20, 20, 16)), ("id",))


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_reader_restored_on_fewer_ranks_resumes_at_the_global_sample(source, shuffle):
    options = dict(shuffle=shuffle, seed=2, shuffle_window=24)
    before = [DataBatches(source, r, 2, 4, **options) for r in range(2)]
    seen = []
    for reader in before:
        reader.set_epoch(1)
        for _, batch in zip(range(5), reader, strict=False):
            seen += batch["id"].tolist()
    state = before[0].state()
    assert state["samples"] == 2 * 5 * 4 and state["ranks"] == 2
    after = DataBatches(source, 0, 1, 4, with_ids=True, **options)
    after.restore(state)
    after.set_epoch(1)
    batches = list(after)
    assert all(torch.equal(b["row_id"], b["id"]) for b in batches)  # with_ids: the natural indices
    rest = [batch["id"].tolist() for batch in batches]
    assert sorted(seen + sum(rest, [])) == list(range(96))
    assert len(rest) == 14 and after.state()["epoch"] == 2 and after.state()["world"] == 1
    # later epochs keep the 2-rank global order: the one rank reads rank 0's batch j, then rank 1's batch j
    next_epoch = [b["id"].tolist() for b in after]
    rows = [epoch_rows(source.blocks.block_rows, r, 2, 2, 2, shuffle, False, 4, 24) for r in range(2)]
    assert next_epoch[:2] == [rows[0][:4].tolist(), rows[1][:4].tolist()] and len(next_epoch) == len(after) == 24
    # saved again mid-way through the re-split epoch: a restore on 2 ranks goes on from there
    again = DataBatches(source, 0, 1, 4, **options)
    again.restore(state)
    again.set_epoch(1)
    for _, _ in zip(range(3), again, strict=False):
        pass
    middle = again.state()
    assert middle["samples"] == 40 + 12 and middle["ranks"] == 2
    two = [DataBatches(source, r, 2, 4, **options) for r in range(2)]
    last = []
    for reader in two:
        reader.restore(middle)
        reader.set_epoch(1)
        last += sum((b["id"].tolist() for b in reader), [])
    assert sorted(seen + sum(rest[:3], []) + last) == list(range(96))


# -- the launcher's decisions and the notebook's count ----------------------------------------------------------
def _job(n, elastic=None, restarts=0):
    from dtrain_magic.launchers.local import LocalJob

    job = LocalJob.__new__(LocalJob)
    config = RunConfig(backend="local", num_processes=n, elastic=elastic, max_restarts=restarts, use_gpu=False)
    job._job, job._num_processes, job._restarts_left = SimpleNamespace(config=config), n, restarts
    return job


def test_the_local_launcher_shrinks_on_lost_workers_and_grows_back_at_a_restart():
    assert _job(2, "1:2")._next_world([0, -9]) == 1  # SIGKILLed rank 1: the survivor, no restart needed
    assert _job(1, "1:2")._next_world([-9]) is None  # below MIN, no restart left: the run fails
    assert _job(1, "1:2", restarts=1)._next_world([1]) == 2  # a restart grows back to MAX (room on this machine)
    assert _job(2, None, restarts=1)._next_world([0, 75]) == 2  # a preemption restart: same world
    assert _job(2, None)._next_world([0, -9]) is None
    assert _job(2, "2:2", restarts=1)._next_world([0, -9]) == 2  # too few survivors: a plain restart


def test_the_steps_a_restart_lost_are_counted_from_the_pulses_and_the_resume():
    log = ResizeLog(2)
    for steps in (3, 7, 6):
        log.pulse(steps)
    metrics = log.metrics({"resumed_at_step": 4.0, "world_size": 1.0})
    assert metrics["steps_lost"] == 3.0 and log.world == 1 and log.world_sizes == [2, 1]
    log.pulse(5)  # the new attempt's own count, from the step it resumed at
    assert log.metrics({"resumed_at_step": 9.0, "world_size": 1.0})["steps_lost"] == 0.0
    assert log.metrics({"loss": 1.0}) == {"loss": 1.0}


def test_relaunches_log_the_world_from_step_0_count_restarts_not_shrinks_and_lose_optimizer_steps():
    """2 ranks (accumulation 1) reach step 13 and lose one: the shrink (no restart) resumes on 1 rank at 12, with
    accumulation 2; that attempt's 14 ctx.step() calls reach step 19, a restart grows it back from 18."""
    log = ResizeLog(2, accum=1, start_ms=1_000)
    log.pulse(12)
    assert log.relaunched(1) == [(0, {"world_size": 2.0}, 1_000)]  # a shrink: the run's own world, no restart
    log.pulse(13)  # a stopped rank's last report comes after the relaunch: still the old attempt's
    resumed = log.metrics({"resumed_at_step": 12.0, "world_size": 1.0, "grad_accum": 2.0})
    assert (resumed["steps_lost"], resumed["steps_lost_total"]) == (1.0, 1.0)
    log.pulse(14)  # micro-steps: 7 optimizer steps at accumulation 2
    assert log.reached == 19
    assert log.relaunched(2) == [(19, {"restarts": 1.0}, None)]  # the grow used a restart, counted where it failed
    resumed = log.metrics({"resumed_at_step": 18.0, "world_size": 2.0, "grad_accum": 1.0})
    assert (resumed["steps_lost"], resumed["steps_lost_total"]) == (1.0, 2.0)
    assert log.world_sizes == [2, 1, 2] and log.restarts == 1 and log.world == 2
    same = ResizeLog(2)
    assert same.relaunched(None)[1] == (0, {"restarts": 1.0}, None)  # a restart on the same world (Spark)


# -- the context's side: a resize's state, and acting on an agreed notice ---------------------------------------
def _context(strategy, lr_scale=1.0, preemption=None, sent=None):
    from dtrain_magic.worker.context import TrainContext

    return TrainContext(RunConfig(backend="local", use_gpu=False), strategy, 0, 0, strategy.data_parallel_size,
                        torch.device("cpu"), send=(sent if sent is not None else []).append, lr_scale=lr_scale,
                        preemption=preemption)


def test_a_resumed_context_keeps_the_optimizer_steps_and_moves_the_learning_rate():
    weight = torch.nn.Parameter(torch.zeros(1))
    strategy = SimpleNamespace(accumulation=2, micro_step=12, data_parallel_size=2, model=object(),
                               optimizer=torch.optim.SGD([weight], lr=0.1))
    sent = []
    ctx = _context(strategy, lr_scale=4 / 3, sent=sent)  # 3 ranks x 1 -> 2 ranks x 2: 4/3 of the global batch
    ctx._restore_run_state({"steps": 12, "world": 3, "grad_accum": 1, "micro_step": 12, "lr_scale": 1.0})
    assert strategy.micro_step == 24 and ctx._steps == 12  # 12 optimizer steps, now 2 micro-batches each
    assert strategy.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 4 / 3)
    assert sent[0].metrics == {"resumed_at_step": 12.0, "world_size": 2.0, "grad_accum": 2.0,
                               "lr_scale": pytest.approx(4 / 3)}
    back = SimpleNamespace(accumulation=1, micro_step=24, data_parallel_size=3, model=object(),
                           optimizer=strategy.optimizer)
    _context(back, lr_scale=1.0)._restore_run_state({"steps": 30, "world": 2, "grad_accum": 2, "micro_step": 24,
                                                     "lr_scale": 4 / 3})
    assert back.micro_step == 12 and back.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # put back


def test_an_agreed_notice_checkpoints_with_the_last_state_and_the_step_then_stops():
    from dtrain_magic.worker.preempt import Preempted

    closed = []
    notice = SimpleNamespace(agreed=lambda: True, close=lambda: closed.append(True), source="SIGTERM")
    strategy = SimpleNamespace(data_parallel_size=1, model=object(), step=lambda: True)
    ctx = _context(strategy, preemption=notice)
    saved = []
    ctx.save_checkpoint = lambda **state: saved.append(state)
    ctx._last_state = {"epoch": 3}
    ctx._steps = 41
    with pytest.raises(Preempted, match="after step 41"):
        ctx.step()
    assert saved == [{"epoch": 3, "step": 41}] and closed == [True]
    ctx._preemption = SimpleNamespace(agreed=lambda: False)
    assert ctx.step() is True and ctx._steps == 43  # no notice: a step as any other


def test_a_backends_own_notice_is_polled_at_the_checks_and_installs_no_signal_handler():
    """On Ray the notice is Ray Train's (a node drained), asked at each check from the training thread; a SIGTERM
    keeps its own meaning there (no handler is installed)."""
    import signal
    import threading

    from dtrain_magic.worker.preempt import install

    asked = []
    config = SimpleNamespace(preempt_grace=30.0)
    before = signal.getsignal(signal.SIGTERM)
    notices = []
    thread = threading.Thread(target=lambda: notices.append(install(config, 1, True, lambda: asked.append(1) or
                                                                    len(asked) > 2, "Ray is draining a node")))
    thread.start()
    thread.join()
    notice = notices[0]
    assert notice is not None and signal.getsignal(signal.SIGTERM) is before  # (not the main thread, still one)
    assert [notice.agreed() for _ in range(4)] == [False, False, True, True] and notice.source.startswith("Ray")
    notice.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert install(SimpleNamespace(preempt_grace=0), 1, True, lambda: True) is None  # --preempt-grace 0: off


def test_the_ranks_check_on_the_gpu_under_nccl_alone(monkeypatch):
    """NCCL has no CPU tensors: a --gpu run's check (the local backend's and Ray Train's NCCL groups) goes on its GPU;
    gloo and the two-device form keep it on the CPU. (The GPU path itself needs a GPU: not run here.)"""
    import torch

    from dtrain_magic.worker.preempt import check_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert check_device("nccl") == "cuda:3"
    assert check_device("gloo") == "cpu" and check_device("cpu:gloo,cuda:nccl") == "cpu"


def test_a_session_refuses_elastic_and_takes_no_preemption_notice():
    from dtrain_magic.session import options

    with pytest.raises(ConfigError, match="--elastic.*relaunched on fewer workers"):
        options.refuse_run_only_flags("--backend local -n 2 --elastic 1:2")
    with pytest.raises(ConfigError, match="--preempt-grace"):
        options.refuse_run_only_flags("--preempt-grace 5")
    with pytest.raises(ConfigError, match="--elastic"):
        options.check_session_config(RunConfig(backend="local", elastic="1:2", use_gpu=False))


def test_a_backend_that_restarts_its_workers_itself_is_counted_as_a_restart():
    """Ray Train restarts the group under --max-restarts without the launcher: a second Hello from a rank says so."""
    from dtrain_magic import channel as ch
    from dtrain_magic.driver.pump import Pump

    retired = []
    channel = SimpleNamespace(retire_earlier_connections=lambda keep_last: retired.append(keep_last))
    pump = Pump(RunConfig(backend="local", num_processes=2, max_restarts=1, use_gpu=False), channel,
                SimpleNamespace(status=lambda *args: None), 0.0)
    for rank in (0, 1, 0, 1):  # the first attempt's ranks, then the restarted group's
        pump.handle(ch.Hello(rank, 100 + rank, "host"))
    assert retired == [True] and pump.restart_notes == ["the backend restarted every worker (--max-restarts)"]
    assert [metrics for _, metrics, _ in pump._restart_metrics] == [{"world_size": 2.0}, {"restarts": 1.0}]
    assert pump.resizes.restarts == 1


def test_a_run_results_world_size_is_its_last_attempts():
    from dtrain_magic.result import RunResult

    shrunk = RunResult(value=1, values=[1], run_id="r", config=RunConfig(num_processes=2), wall_time_s=1.0,
                       world_size=1)
    assert shrunk.world_size == 1 and "world_size=1," in repr(shrunk)
    plain = RunResult(value=1, values=[1, 1], run_id="r", config=RunConfig(num_processes=2), wall_time_s=1.0)
    assert plain.world_size == 2
    grown = RunResult(value=1, values=[1, 1], run_id="r", config=RunConfig(num_processes=1), wall_time_s=1.0,
                      world_size=2, printed={1: "hi"})
    assert grown.output(1) == "hi"  # rank 1 ran (after the run grew), though the run started on 1


# -- Ray: one fit() per attempt, sized to the Ray's nodes (launchers/ray/elastic.py) --------------------------------
class _Fit:
    """A `RayJob` as `ElasticRayRun` sees it: running until ``end`` is set, then these failures."""

    def __init__(self, job):
        self.job, self.end, self.cancelled = job, None, False

    def poll(self):
        from dtrain_magic.launchers.base import LaunchState

        return LaunchState(False, [], errors_final=False) if self.end is None else LaunchState(True, self.end)

    def cancel(self):
        self.cancelled = True


def _elastic_ray_run(room, max_restarts=0, n=2, bounds="1:2", run_dir="/nonexistent"):
    from dtrain_magic.launchers.ray.elastic import ElasticRayRun
    from dtrain_magic.worker import WorkerJob

    config = RunConfig(backend="ray", use_gpu=False, num_processes=n, elastic=bounds, max_restarts=max_restarts)
    fits, said = [], []
    job = WorkerJob(payload=b"", config=config, channel=("127.0.0.1", 0))
    run = ElasticRayRun(job, lambda message: said.append(message.text), lambda job: fits.append(_Fit(job)) or fits[-1],
                        lambda: room[0], run_dir)
    return run, fits, said


def test_a_ray_attempt_that_lost_a_node_goes_on_smaller_and_a_restart_grows_it_back():
    from dtrain_magic.launchers.base import Failure

    room = [2]
    run, fits, said = _elastic_ray_run(room, max_restarts=1)
    assert not run.poll().finished and not run.poll().errors_final  # running: Ray decides nothing, we wait
    room[0] = 1  # its node left the Ray
    fits[0].end = [Failure(1, "the Ray worker process died without reporting an error"), Failure(0, "gloo: closed")]
    state = run.poll()
    assert state.restarted and state.world_size == 1 and not state.finished
    assert fits[1].job.config.num_processes == 1 and fits[1].job.config.grad_accum == 2  # the global batch kept
    assert "rank 1 failed" in said[0] and "continuing on 1 of 2 worker(s)" in said[0] and "from the start" in said[0]
    assert said[1] == "dtrain_magic: world size 2 -> 1: gradient accumulation 1 -> 2 (global batch kept)\n"
    room[0] = 3  # a node came back (and more): the restart grows the run to MAX, no further
    fits[1].end = [Failure(0, "RuntimeError: a bug")]
    state = run.poll()
    assert state.restarted and state.world_size == 2 and fits[2].job.config.grad_accum == 1
    assert "restarting every worker on 2 from" in said[2] and "(restart 1, 0 left)" in said[2]
    fits[2].end = [Failure(0, "RuntimeError: again")]  # no restart left, no node lost: the run fails
    state = run.poll()
    assert state.finished and state.failures[0].reason == "RuntimeError: again" and len(fits) == 3
    run.cancel()
    assert fits[2].cancelled


@pytest.mark.parametrize("room, max_restarts, relaunched", [(0, 1, None), (2, 0, None), (1, 0, 1), (2, 1, 2)])
def test_a_ray_attempts_next_world(room, max_restarts, relaunched):
    """Fewer than MIN on the nodes fails; the same world needs a restart; a smaller one (>= MIN) needs none."""
    from dtrain_magic.launchers.base import Failure

    run, fits, _ = _elastic_ray_run([room], max_restarts=max_restarts)
    fits[0].end = [Failure(0, "x")]
    state = run.poll()
    assert (state.world_size if state.restarted else None) == relaunched
    assert len(fits) == (1 if relaunched is None else 2)


def test_the_resume_point_of_a_ray_run_is_ray_trains_latest_checkpoint_and_its_noted_step(tmp_path):
    """What a restart line names and what --resume continues from, on Ray: the latest in Ray Train's snapshot."""
    import json

    from dtrain_magic.worker.resume_point import note_step, resume_point

    assert resume_point(str(tmp_path)).words() == "the start (no complete checkpoint yet)"
    for name, step in (("checkpoint_2026-12-07_15-07-20.1", 8), ("checkpoint_2026-12-07_15-07-33.9", None)):
        (tmp_path / name).mkdir()
        note_step(str(tmp_path / name), {"step": step}, is_main=True)
        (tmp_path / "checkpoint_manager_snapshot.json").write_text(json.dumps(
            {"latest_checkpoint_result": {"checkpoint_dir_name": name}}))
        assert resume_point(str(tmp_path)).words() == (f"step {step}" if step is not None else name)
