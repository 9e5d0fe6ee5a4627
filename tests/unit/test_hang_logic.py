"""Issue 25's pure parts: the hang and stall rules, metric thinning, stack dumps parsed and rendered, throughput
and stragglers, per-rank output, the new messages' wire forms, the monitor's per-rank state and Stacks button."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from dtrain_magic import channel as ch
from dtrain_magic import procfacts
from dtrain_magic.config import RunConfig
from dtrain_magic.driver.perf import Throughput
from dtrain_magic.driver.pump import OUTPUT_KEPT, Pump, RankOutputs
from dtrain_magic.driver.stacks import Worker, merge_ended, parse_dump, rank_stack, render_all, whereabouts
from dtrain_magic.driver.watch import Watch
from dtrain_magic.errors import ConfigError
from dtrain_magic.launchers import watchdog
from dtrain_magic.notebook import flags
from dtrain_magic.strategies.ddp import DDPStrategy
from dtrain_magic.worker import pulse as pulse_module
from dtrain_magic.worker.context import TrainContext
from dtrain_magic.worker.pulse import Pulse

CELL = "/tmp/ipykernel_1/123.py"
LABELS = {CELL: "Cell In[3]"}
SITE = "/venv/lib/python3.11/site-packages/torch/distributed"
DUMP = f"""{procfacts.HEADER}: rank 0 pid 42 thread 0x00007f0000000001
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/x/dtrain_magic/worker/pulse.py", line 120 in _loop

Current thread 0x00007f0000000001 (most recent call first):
  File "{SITE}/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/c10d_logger.py", line 83 in wrapper
  File "{CELL}", line 4 in train
  File "/x/dtrain_magic/worker/run.py", line 140 in _call
  File "/x/dtrain_magic/worker/run.py", line 60 in run_worker
"""


def pulse(rank: int, t: float, calls: int = 0, cpu: float = 0.0, steps: int = 0, samples: int = 0, tokens: int = 0):
    return ch.Pulse(rank, steps, samples, tokens, calls, cpu, t)


# -- the rules -------------------------------------------------------------------------------------------------

def test_a_rank_that_ended_and_a_peer_without_progress_is_a_hang_after_the_timeout_not_before():
    watch = Watch(hang_timeout=15, stall_timeout=None)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    watch.pulse(pulse(0, 1.0, calls=5), now=1)
    watch.ended(1, "returned", now=2)
    watch.pulse(pulse(0, 2.0, calls=5), now=2)
    assert watch.hung(now=16.9) == []  # 15 s counts from the end, not from rank 0's last progress
    assert watch.hung(now=17.1) == [0]
    assert watch.ended_ranks() == {1: "returned"}


def test_cpu_use_is_progress_for_the_hang_rule_and_for_the_stall_rule():
    watch = Watch(hang_timeout=5, stall_timeout=5)
    watch.hello(0, now=0)
    watch.hello(1, now=0)
    watch.ended(1, "returned", now=0)
    t, cpu = 0.0, 0.0
    for _ in range(20):  # rank 0 computes alone (evaluating, say): half a core, counters still
        t += 0.5
        cpu += 0.25
        watch.pulse(pulse(0, t, calls=3, cpu=cpu), now=t)
    assert watch.hung(now=t) == [] and not watch.stalled(now=t)
    for _ in range(12):  # then it waits: no CPU
        t += 0.5
        watch.pulse(pulse(0, t, calls=3, cpu=cpu), now=t)
    assert watch.stalled(now=t)  # no step, metric, output or CPU use for 5 s
    assert not watch.stalled(now=t + 1)  # once per stall
    watch.activity(0, now=t + 2)  # output again: a later silence is a new stall
    assert watch.stalled(now=t + 8)


def quiet_pulses(watch: Watch, ranks: tuple[int, ...], until: float, cpu_share: float = 0.0, start: float = 0.0,
                 cpu: float = 0.0) -> float:
    """Each rank's pulse every 0.5 s from ``start`` to ``until``, counters still, using ``cpu_share`` of a core;
    the CPU seconds reached."""
    t = start
    while t < until:
        t += 0.5
        cpu += 0.5 * cpu_share
        for rank in ranks:
            watch.pulse(pulse(rank, t, calls=1, cpu=cpu), now=t)
    return cpu


def test_by_default_every_rank_waiting_for_120_s_is_a_stall_reported_once():
    assert RunConfig().stall_timeout == 120.0
    watch = Watch(hang_timeout=15)  # the default stall timeout, as the pump builds it from RunConfig's
    for rank in (0, 1):
        watch.hello(rank, now=0)
    quiet_pulses(watch, (0, 1), until=119.5, cpu_share=0.003)  # the pulse thread's own CPU: a blocked rank's
    assert not watch.stalled(now=119.5)
    assert watch.stalled(now=120.0) and watch.quiet_for(120.0) == pytest.approx(120.0)
    assert not watch.stalled(now=300.0)  # once per stall
    assert watch.hung(now=300.0) == []  # no rank ended: no hang, the run goes on


def test_a_waiting_ranks_wake_up_noise_on_a_busy_machine_is_no_progress():
    """Measured beside the suite: a blocked rank's single 0.5-s pulse used up to 0.034 of a core, and in one suite
    run the default stall was reported three times (re-armed twice). A pulse at 0.08 of a core every 20 s (0.01
    between) neither delays the report nor re-arms it: once, at 120 s, none in the next 10 minutes (with the rule of
    0.05 over one pulse, each such pulse was progress: no report at all)."""
    watch = Watch(hang_timeout=15)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    t, cpu, reports = 0.0, 0.0, []
    while t < 720:
        t += 0.5
        cpu += 0.5 * (0.08 if t % 20 == 0 else 0.01)
        for rank in (0, 1):
            watch.pulse(pulse(rank, t, calls=1, cpu=cpu), now=t)
        if watch.stalled(now=t):
            reports.append(t)
    assert reports == [120.0]


def test_a_rank_computing_a_little_over_seconds_is_progress():
    """A slow step that computes 10 % of a core (mostly waiting on its reads): under `BUSY_CPU_NOW` on every pulse,
    but over `BUSY_WINDOW_S` it is computing: no stall in 10 minutes."""
    watch = Watch(hang_timeout=15)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    cpu = quiet_pulses(watch, (0, 1), until=600.0, cpu_share=0.1)
    assert not watch.stalled(now=600.0) and watch.quiet_for(600.0) <= 2.5
    quiet_pulses(watch, (0, 1), until=730.0, start=600.0, cpu=cpu)  # then both wait: a stall, 120 s on
    assert not watch.stalled(now=719.0) and watch.stalled(now=722.5)


def test_a_rank_that_speaks_and_ends_after_the_report_starts_no_second_report_for_its_waiting_peer():
    """Seen on Ray: both ranks waited, the stall was reported; rank 1 then printed and returned while rank 0 still
    waited: the same stall (rank 0's silence), not a new one."""
    watch = Watch(hang_timeout=None, stall_timeout=15)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    assert watch.stalled(now=15)
    watch.activity(1, now=45)  # its last line...
    watch.ended(1, "returned", now=45.1)  # ... and its result
    assert not watch.stalled(now=45.2) and not watch.stalled(now=100)
    watch.activity(0, now=101)  # rank 0 moves, then waits again: a new stall
    assert not watch.stalled(now=115.9) and watch.stalled(now=116)


def test_a_long_first_step_using_cpu_is_no_stall():
    """A big model's first step: no ctx.step, no metric, no output for minutes, but the rank computes."""
    watch = Watch(hang_timeout=15)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    cpu = quiet_pulses(watch, (0, 1), until=600.0, cpu_share=0.9)
    assert not watch.stalled(now=600.0)
    quiet_pulses(watch, (0, 1), until=719.5, start=600.0, cpu=cpu)  # then both wait
    assert not watch.stalled(now=719.5) and watch.stalled(now=720.0)


def test_one_busy_rank_keeps_the_others_waiting_for_it_from_being_a_stall():
    watch = Watch(hang_timeout=15, stall_timeout=120)
    for rank in (0, 1):
        watch.hello(rank, now=0)
    t, cpu = 0.0, 0.0
    while t < 300:  # rank 0 computes (a slow data step), rank 1 waits for it in a collective
        t += 0.5
        cpu += 0.4
        watch.pulse(pulse(0, t, calls=1, cpu=cpu), now=t)
        watch.pulse(pulse(1, t, calls=1, cpu=0.0), now=t)
    assert not watch.stalled(now=t)


@pytest.mark.parametrize("off", [0, 0.0, None])
def test_the_stall_watch_turned_off_never_reports(off):
    watch = Watch(hang_timeout=15, stall_timeout=off)
    watch.hello(0, now=0)
    quiet_pulses(watch, (0,), until=3600.0)
    assert not watch.stalled(now=3600.0)


class StackTitles:
    def __init__(self):
        self.titles = []

    def stacks(self, title: str, text: str) -> None:
        self.titles.append(title)


def test_a_sessions_cell_is_watched_from_its_start_and_the_time_between_cells_never_counts():
    """A session pumps only while a command runs (`Pump.command_started`, then `check_stall` each loop)."""
    seen = StackTitles()
    pump = Pump(RunConfig(stall_timeout=120), None, seen, 0.0)
    for rank in (0, 1):
        pump.watch.hello(rank, now=0)
    pump.command_started((0,), now=3600.0)  # an hour idle, then a %%ranks 0 cell
    pump.check_stall(now=3719.0)
    assert seen.titles == []
    pump.check_stall(now=3720.0)
    pump.check_stall(now=3900.0)
    assert len(seen.titles) == 1 and "for 120 s (--stall-timeout 120)" in seen.titles[0]  # once
    pump.command_started((0, 1), now=4000.0)  # the next cell starts afresh
    pump.check_stall(now=4119.0)
    assert len(seen.titles) == 1


def test_the_last_words_of_a_rank_that_ended_do_not_start_a_new_stall():
    watch = Watch(hang_timeout=None, stall_timeout=2)
    watch.hello(0, now=0)
    watch.hello(1, now=0)
    assert watch.stalled(now=2)  # both quiet
    watch.ended(0, "returned", now=4)
    watch.activity(0, now=4)  # rank 0's "done" status, after its result
    assert not watch.stalled(now=4.1)  # rank 1 is in the same stall, already reported
    watch.activity(1, now=5)
    assert watch.stalled(now=7)  # a new silence of a rank that runs: a new stall


def test_no_hang_while_every_rank_runs_and_none_when_turned_off():
    watch = Watch(hang_timeout=5, stall_timeout=None)
    watch.hello(0, now=0)
    assert watch.hung(now=100) == [] and not watch.stalled(now=100)
    off = Watch(hang_timeout=0, stall_timeout=None)
    off.hello(0, now=0)
    off.ended(1, "returned", now=0)
    assert off.hung(now=100) == []


def test_under_restarts_a_dead_or_failed_rank_starts_no_hang_but_a_returned_one_does():
    """--max-restarts: Ray Train or torchrun restart the group after a death, which takes longer than the hang
    timeout on a loaded machine; the blocked peer is waiting for that restart, not hung."""
    watch = Watch(hang_timeout=5, stall_timeout=None, restartable=True)
    watch.hello(0, now=0)
    watch.hello(1, now=0)
    watch.ended(1, "died: killed by SIGKILL", now=1)
    watch.ended(1, "failed: ValueError", now=1)
    assert watch.hung(now=60) == [] and watch.live() == [0, 1]
    watch.ended(1, "returned", now=60)
    assert watch.hung(now=66) == [0]


def test_a_restart_forgets_the_earlier_attempt():
    watch = Watch(hang_timeout=1, stall_timeout=None)
    watch.hello(0, now=0)
    watch.ended(1, "failed: ValueError", now=0)
    watch.forget()
    watch.hello(0, now=10)
    assert watch.hung(now=20) == []


def test_the_new_flags_are_checked():
    assert RunConfig().hang_timeout == 15.0 and RunConfig().stall_timeout == 120.0
    assert RunConfig(stall_timeout=None).stall_timeout == 0.0 and RunConfig(stall_timeout=0).stall_timeout == 0
    assert RunConfig(on_stall="fail").stall_timeout == 120.0  # the default watch: no --stall-timeout needed
    with pytest.raises(ConfigError, match="--hang-timeout"):
        RunConfig(hang_timeout=-1)
    with pytest.raises(ConfigError, match=r"--stall-timeout: got -1; must be a number of seconds >= 0 \(0 or off"):
        RunConfig(stall_timeout=-1)
    with pytest.raises(ConfigError, match="--stall-timeout"):
        RunConfig(stall_timeout="soon")
    with pytest.raises(ConfigError, match="--on-stall: fail needs the stall watch, which --stall-timeout 0"):
        RunConfig(on_stall="fail", stall_timeout=0)
    with pytest.raises(ConfigError, match="--on-stall"):
        RunConfig(on_stall="panic", stall_timeout=3)


def from_line(line: str) -> RunConfig:
    return flags.config_from_line(line.removeprefix("%%distribute "), gpu_available=lambda: False,
                                  backend_detector=lambda: "local")


@pytest.mark.parametrize("word", ["off", "OFF", "never", "none", "0", "0.0"])
def test_stall_timeout_off_is_spelled_off_or_0_on_the_line(word):
    config = from_line(f"--backend local --stall-timeout {word}")
    assert config.stall_timeout == 0
    assert "--stall-timeout 0" in config.flag_line()
    assert from_line(config.flag_line()).stall_timeout == 0
    assert from_line("--backend local").stall_timeout == 120.0
    assert "--stall-timeout" not in from_line("--backend local").flag_line()  # the default is not written


def test_a_stall_timeout_that_is_no_number_names_the_flag_and_off():
    with pytest.raises(Exception, match=r"invalid number of seconds: 'soon' \(or off\)"):
        from_line("--backend local --stall-timeout soon")


# -- metric thinning ---------------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now


def sent_entries(messages: list) -> tuple[list, int]:
    metrics = [m for m in messages if isinstance(m, ch.Metrics)]
    return [entry for m in metrics for entry in m.entries], sum(m.thinned for m in metrics)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(pulse_module, "time", SimpleNamespace(time=clock.time, monotonic=clock.time,
                                                              process_time=lambda: 0.0))
    return clock


def test_thinning_keeps_every_value_of_a_burst_then_the_rate_evenly_and_always_the_last(clock):
    messages: list = []
    pulse = Pulse(0, messages.append, rate=4, burst=10, reporter=False)
    for step in range(10):
        pulse.record(step, {"loss": float(step)})
    pulse.flush_metrics()
    kept, left_out = sent_entries(messages)
    assert [e[0] for e in kept] == list(range(10)) and left_out == 0
    messages.clear()
    for i, step in enumerate(range(10, 30), start=1):  # 20 values in 1 s: 4 allowed
        clock.now = i * 0.05
        pulse.record(step, {"loss": float(step)})
    pulse.flush_metrics()
    kept, left_out = sent_entries(messages)
    steps = [e[0] for e in kept]
    assert len(steps) == 4 and steps[-1] == 29 and left_out == 16, (steps, left_out)
    assert all(b - a >= 4 for a, b in zip(steps, steps[1:], strict=False)), steps  # spread, not the first four
    pulse.flush_metrics()  # nothing new: the last value is not sent twice
    assert sent_entries(messages)[0] == kept


def test_thinning_is_per_set_of_metrics_so_a_rare_metric_is_never_thinned(clock):
    messages: list = []
    pulse = Pulse(0, messages.append, rate=1, burst=5, reporter=False)
    for step in range(200):
        clock.now = step * 0.001
        pulse.record(step, {"loss": 1.0, **({"val_loss": 2.0} if step % 50 == 0 else {})})
    pulse.close()
    kept, left_out = sent_entries(messages)
    assert [e[0] for e in kept if "val_loss" in e[1]] == [0, 50, 100, 150]
    assert [e[0] for e in kept if "val_loss" not in e[1]] == [1, 2, 3, 4, 5, 199]
    assert [e[2] for e in kept] == sorted(e[2] for e in kept)  # the held last value in its place
    assert left_out == 200 - len(kept)


def test_ctx_log_turns_tensors_and_keys_into_floats_and_names_a_bad_metric():
    sent: list = []
    config = RunConfig(backend="local", num_processes=1)
    ctx = TrainContext(config, DDPStrategy(config, 0, 0, 1, torch.device("cpu")), 0, 0, 1, torch.device("cpu"),
                       send=sent.append)
    ctx.log({"loss": torch.tensor([1.0, 3.0]), 7: 2}, step=3)
    ctx.log(lr=0.5)
    assert [(m.step, m.metrics) for m in sent] == [(3, {"loss": 2.0, "7": 2.0}), (1, {"lr": 0.5})]
    with pytest.raises(TypeError, match="ctx.log: metric 'loss' must be a number, got str"):
        ctx.log(loss="high")


# -- stacks ------------------------------------------------------------------------------------------------------

def test_a_dump_is_parsed_to_the_training_thread_and_rendered_with_the_cells_labels():
    training, threads = parse_dump(DUMP)
    assert training == 0x7F0000000001 and set(threads) == {0x7F0000000001, 0x7F0000000002}
    stack = rank_stack(0, "dumped", DUMP, Worker(0, 42, "h", "/tmp/s"))
    assert stack.frames[0].function == "all_reduce" and len(stack.other_threads) == 1
    assert stack.where(LABELS) == "rank 0 waits in all_reduce at Cell In[3], line 4"
    text = stack.render(LABELS)
    assert "Cell In[3], line 4, in train" in text and "run_worker" not in text  # the harness is left out
    body = text.split("Traceback (most recent call last):")[1]
    assert body.index("Cell In[3]") < body.index("in all_reduce")  # outermost first, as Python's tracebacks
    assert "run_worker" in stack.render(LABELS, full=True) and "Thread 0x" in stack.render(LABELS, full=True)


def test_whereabouts_name_every_rank_including_those_that_ended_or_froze():
    stacks = {0: rank_stack(0, "dumped", DUMP, None), 2: rank_stack(2, "stopped", "", None)}
    merged = merge_ended(stacks, {1: "returned"})
    assert whereabouts(merged, LABELS) == ("rank 0 waits in all_reduce at Cell In[3], line 4; rank 1 returned; "
                                          "rank 2 is stopped (SIGSTOP, SIGTSTP or a debugger): frozen, no stack")
    assert "rank 1 returned" in render_all(merged, LABELS)


def test_a_rank_in_its_own_code_is_at_the_line():
    dump = f'Current thread 0x1 (most recent call first):\n  File "{CELL}", line 9 in train\n'
    assert rank_stack(3, "dumped", dump, None).where(LABELS) == "rank 3 is at Cell In[3], line 9 (in train)"


def test_fatal_signals_are_read_from_the_stack_file():
    text = DUMP + "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
    name, rest = procfacts.fatal_signal(text)
    assert name == "SIGSEGV" and "Current thread" in rest
    assert procfacts.fatal_signal(DUMP) is None


# -- throughput and stragglers -----------------------------------------------------------------------------------

def test_per_rank_step_rates_flag_a_straggler_on_the_second_look():
    perf = Throughput(world_size=3)
    for t in range(0, 5):
        for rank, rate in ((0, 10), (1, 10), (2, 3)):
            perf.pulse(pulse(rank, float(t), steps=rate * t, samples=32 * rate * t, cpu=0.5 * t))
    first = perf.snapshot()
    assert first.steps_per_s == pytest.approx({0: 10, 1: 10, 2: 3}) and first.stragglers == []
    second = perf.snapshot()
    assert second.stragglers == [2] and "rank 2: 3 steps/s, 0.30x the median 10" in perf.flagged[2]
    assert second.samples_per_s == pytest.approx(32 * 23) and second.cpu_cores[0] == pytest.approx(0.5)
    assert "perf/steps_per_s/rank_2" in second.metrics() and "perf/mfu" not in second.metrics()


def test_model_flops_and_mfu_from_tokens_and_the_devices_peak_and_a_clear_note_on_cpu():
    perf = Throughput(world_size=2, ranks_per_replica=2)  # two ranks of one tensor-parallel replica
    for t in range(4):
        for rank in (0, 1):
            perf.pulse(pulse(rank, float(t), steps=t, samples=8 * t, tokens=1000 * t))
    perf.facts = ch.ModelFacts(0, 1_000_000, 0.0, 6e6, "NVIDIA H100 80GB HBM3", 989e12, "")
    snap = perf.snapshot()
    assert snap.tokens_per_s == pytest.approx(1000)  # the replica's, not twice it
    assert snap.flops_per_s == pytest.approx(6e9) and snap.mfu == pytest.approx(6e9 / (2 * 989e12))
    assert "tokens/s" in snap.line() and "MFU" in snap.line()
    perf.facts = ch.ModelFacts(0, 1_000_000, 0.0, 6e6, "cpu", 0.0, "no MFU on CPU: ...")
    snap = perf.snapshot()
    assert snap.mfu is None and snap.flops_per_s == pytest.approx(6e9) and snap.note.startswith("no MFU on CPU")


def test_samples_without_known_flops_say_how_to_give_them():
    perf = Throughput(world_size=1)
    for t in range(4):
        perf.pulse(pulse(0, float(t), steps=t, samples=8 * t))
    perf.facts = ch.ModelFacts(0, 1000, 0.0, 6000.0, "cpu", 0.0, "")
    snap = perf.snapshot()
    assert snap.flops_per_s is None and "set_model_flops" in snap.note


def test_peak_flops_by_device_and_precision(monkeypatch):
    from dtrain_magic.worker import flops

    monkeypatch.delenv("DTRAIN_MAGIC_PEAK_FLOPS", raising=False)
    name, peak, note = flops.peak_flops("cpu", "fp32")
    assert peak == 0.0 and "no MFU on CPU" in note
    monkeypatch.setenv("DTRAIN_MAGIC_PEAK_FLOPS", "1e12")
    assert flops.peak_flops("cpu", "fp32")[1] == 1e12


def test_batch_sizes_and_tokens_from_a_forwards_inputs():
    import torch

    from dtrain_magic.worker.flops import batch_size_and_tokens

    assert batch_size_and_tokens((torch.zeros(16, 4),), {}) == (16, 0)
    assert batch_size_and_tokens((), {"input_ids": torch.zeros(4, 128, dtype=torch.long)}) == (4, 512)
    assert batch_size_and_tokens(([torch.zeros(8, 3)],), {}) == (8, 0)
    assert batch_size_and_tokens((3,), {}) == (0, 0)


# -- per-rank output ---------------------------------------------------------------------------------------------

def test_each_ranks_output_is_kept_apart_and_capped():
    outputs = RankOutputs()
    outputs.add(0, "a\n")
    outputs.add(1, "b\n")
    outputs.add(None, "launcher note\n")
    assert outputs.by_rank() == {0: "a\n", 1: "b\n"} and outputs.text(None) == "launcher note\n"
    big = "x" * (OUTPUT_KEPT // 2)
    for _ in range(4):
        outputs.add(0, big)
    assert outputs.text(0).startswith("[... ") and len(outputs.text(0)) <= OUTPUT_KEPT + 100


# -- wire forms --------------------------------------------------------------------------------------------------

NEW_KINDS = [
    ch.Hello(0, 4242, "node-a", "/tmp/dtrain_magic-stacks-0/4242.txt", "abc123"),
    ch.Metrics(0, ((1, {"loss": 0.5}, 1_700_000_000_123), (2, {"loss": 0.4}, 1_700_000_000_200)), 3),
    ch.Pulse(1, 10, 320, 0, 42, 1.25, 1_700_000_000.5),
    ch.ModelFacts(0, 1000, 0.0, 6000.0, "cpu", 0.0, "no MFU on CPU"),
    ch.RankDied(1, "killed by SIGSEGV\n..."),
    ch.StackRequest(7),
    ch.StackReply(1, 7, "dumped", DUMP),
]


def test_the_new_messages_cross_a_real_channel_as_themselves():
    with ch.Channel() as channel:
        link = ch.WorkerLink(channel.address, rank=0)
        for message in NEW_KINDS:
            link.send(message)
        link.close()
        assert [channel.get(timeout=5) for _ in NEW_KINDS] == NEW_KINDS
    assert ch.decode(ch.Hello(0, 1, "h").wire()) == ch.Hello(0, 1, "h", "", "")


def test_the_watchdog_writes_and_reads_the_rank_watch_wire_forms():
    assert ch.decode(watchdog.rank_died(1, "x")) == ch.RankDied(1, "x")
    assert watchdog.stack_request(7) == ch.StackRequest(7).wire()
    assert ch.decode(watchdog.stack_reply(1, 7, "dumped", "t")) == ch.StackReply(1, 7, "dumped", "t")


def test_procfacts_is_standard_library_only_for_the_watchdog():
    import ast
    import sys

    tree = ast.parse(open(procfacts.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__"}
    assert imported <= set(sys.stdlib_module_names)
    assert not any(isinstance(node, ast.ImportFrom) and node.level > 0 for node in ast.walk(tree))
    assert watchdog.procfacts().STACK_SIGNAL == procfacts.STACK_SIGNAL  # loaded by path, as the watchdog does


# -- the monitor ---------------------------------------------------------------------------------------------------

def test_the_monitor_keeps_each_ranks_lines_rates_and_straggler_flag():
    pytest.importorskip("anywidget")
    from dtrain_magic.driver.perf import Snapshot
    from dtrain_magic.ui.monitor import MonitorObserver

    obs = MonitorObserver(RunConfig(num_processes=2), text_out=io.StringIO(), display=False, charts=False)
    obs.output(0, "stdout", "zero\n")
    obs.output(1, "stderr", "one\nhalf")
    obs.perf(Snapshot(steps_per_s={0: 10.0, 1: 3.0}, cpu_cores={0: 0.4, 1: 1.0}, stragglers=[1],
                      samples_per_s=420.0))
    snap = obs.snapshot()
    assert snap["rank_logs"] == {"0": ["zero"], "1": ["one"]}
    assert snap["ranks"][1] == {"rank": 1, "state": "starting", "detail": "", "rate": 3.0, "cpu": 1.0,
                                "straggler": True}
    assert snap["perf"] == "420 samples/s"
    obs.finished(None, None)
    assert obs.snapshot()["rank_logs"]["1"] == ["one", "half"] and obs.stacks_button.disabled


def test_the_stacks_button_shows_a_note_when_no_run_is_in_progress():
    pytest.importorskip("anywidget")
    from dtrain_magic.ui.monitor import MonitorObserver

    obs = MonitorObserver(RunConfig(num_processes=2), text_out=io.StringIO(), display=False, charts=False)
    obs.stacks_button.click()
    obs._stacks_thread.join(5)
    assert obs.widget.stacks.startswith("the run is not in progress")


@pytest.mark.parametrize("line", [
    "6,1234,5678,-;Out of memory: Killed process 12345 (python) total-vm:1000kB, anon-rss:900kB",
    "6,1234,5678,-;Memory cgroup out of memory: Killed process 12345 (python) total-vm:1000kB",
    "6,1234,5678,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,task=python,pid=12345,uid=0",
])
def test_the_kernel_logs_oom_kill_lines_name_the_pid(line):
    assert [int(m.group(1)) for m in procfacts._KMSG_KILLED.finditer(line)] == [12345]


def test_a_process_state_and_its_signal_handlers_are_read_from_proc():
    import os
    import signal

    assert procfacts.process_state(os.getpid()) == "running"
    assert procfacts.process_state(2 ** 22 + 7) == "gone"
    assert procfacts.catches(os.getpid(), signal.SIGINT) is True  # Python's own KeyboardInterrupt handler
    assert procfacts.start_time(os.getpid()) == procfacts.start_time(os.getpid()) is not None


def test_a_dying_process_exit_signal_is_read_before_its_parent_reaps_it():
    """What the watchdogs rely on where the parent keeps the status (torchrun under pyspark's wrapper, the raylet):
    the kernel shows it in /proc to the same user until the parent reaps the process."""
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = procfacts.start_time(child.pid)
    assert procfacts.exit_status(child.pid, started) is None  # running
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while procfacts.process_state(child.pid) != "zombie" and time.monotonic() < deadline:
        time.sleep(0.01)  # not reaped: this test is its parent and waits
    assert procfacts.killed_by(procfacts.exit_status(child.pid, started)) == "SIGKILL"
    assert procfacts.exit_status(child.pid, started + 1) is None  # another process with the same pid
    child.wait()
    assert procfacts.exit_status(child.pid, started) is None  # reaped: nothing left to read
    assert procfacts.killed_by(3 << 8) is None  # exit(3): not a signal


@pytest.mark.parametrize("ends", ["killed", "in python"])
def test_the_exit_watch_records_a_workers_killing_signal_and_nothing_when_it_ended_in_python(tmp_path, ends):
    """A Ray worker's exit watch, with this test's child as the worker: SIGKILL is written next to its stack file
    for this very process; a worker that said ``done`` leaves no file."""
    import signal
    import subprocess
    import sys
    import time

    stack_file = str(tmp_path / "worker.txt")
    worker_code = (
        "import sys, time\nfrom dtrain_magic.launchers import watchdog\n"
        f"watch = watchdog.start('exit-watch', str(__import__('os').getpid()), {stack_file!r})\n"
        f"if {ends == 'in python'}:\n    watchdog.tell_done(watch, wait=True)\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    started = procfacts.start_time(worker.pid)
    worker.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5  # not reaped meanwhile, as torchrun and the raylet poll now and then
    while ends == "killed" and procfacts.read_exit_file(stack_file, started) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    worker.wait()
    expected = "killed by SIGKILL" if ends == "killed" else None
    assert procfacts.read_exit_file(stack_file, started) == expected
    assert procfacts.read_exit_file(stack_file, started + 1) is None  # recorded for another process


def test_a_reaped_process_exit_signal_is_read_from_a_pidfd_held_before():
    """Where the parent reaps at once (the raylet ignores SIGCHLD): the status is read through a pidfd opened while
    the process lived (Linux 6.15+; elsewhere the watchdogs have only /proc's zombie to read)."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = procfacts.open_pidfd(child.pid)
    try:
        if pidfd is None or not procfacts.reaped_status_readable():
            pytest.skip("this kernel has no PIDFD_GET_INFO (Linux 6.15+)")
        assert procfacts.pidfd_exit_status(pidfd) is None  # alive: no exit status yet
        child.send_signal(signal.SIGKILL)
        child.wait()  # reaped at once
        assert procfacts.exit_status(child.pid, None) is None  # nothing left in /proc
        assert procfacts.killed_by(procfacts.ended_status(child.pid, None, pidfd)) == "SIGKILL"
    finally:
        child.kill()
        child.wait()
        if pidfd is not None:
            import os

            os.close(pidfd)



def test_the_metric_writer_writes_a_steady_stream_once_a_second_and_a_lone_value_at_once():
    """ctx.log every step must not cost the notebook a log_batch (3-5 ms of CPU) four times a second; a value
    after a pause still reaches MLflow (and the charts) within a quarter second or so."""
    import threading
    import time

    from dtrain_magic.tracking.writer import MetricWriter

    class Client:
        def __init__(self):
            self.calls: list[tuple[float, int]] = []
            self.written = threading.Event()

        def log_batch(self, run_id, metrics):
            self.calls.append((time.monotonic(), len(metrics)))
            self.written.set()

    client = Client()
    writer = MetricWriter(client, "run")
    for i in range(40):  # every 50 ms for 2 s
        writer.queue.put([i])
        time.sleep(0.05)
    time.sleep(1.5)
    steady = len(client.calls)
    assert sum(n for _, n in client.calls) == 40 and steady <= 4, client.calls  # 8 or more at one per 0.25 s
    client.written.clear()
    sent = time.monotonic()
    writer.queue.put([40])
    assert client.written.wait(5.0)
    assert client.calls[-1][0] - sent < 1.0, client.calls
    writer.close()
