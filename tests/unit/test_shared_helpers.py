"""Helpers that used to be written several times, now one function each: an exception in one line, a worker's
exit status in words, the DeepSpeed batch arithmetic."""

from __future__ import annotations

import signal

import pytest

from dtrain_magic.config import RunConfig, check_batch_arithmetic
from dtrain_magic.errors import ConfigError, summary
from dtrain_magic.launchers.base import describe_exit
from dtrain_magic.launchers.spark import one_line_reason, torchrun_root_cause
from dtrain_magic.strategies.deepspeed import build_config


def test_summary_is_the_type_and_the_first_line():
    assert summary(ValueError("bad batch")) == "ValueError: bad batch"
    assert summary(RuntimeError("\n  first  \nsecond")) == "RuntimeError: first"
    assert summary(KeyError()) == "KeyError"
    long = summary(RuntimeError("x" * 500), limit=300)
    assert len(long) == 300 and long.endswith("…") and "\n" not in long


def test_summary_first_sentence_for_libraries_that_name_the_problem():
    exc = Exception("Could not open the store at\n/x/y. Check permissions. More detail follows")
    assert summary(exc, sentence=True) == "Could not open the store at /x/y"
    assert summary(Exception(""), sentence=True) == "Exception"


def test_backends_use_the_same_one_line():
    """Spark's fallback (no torchrun report, no error line) is the shared summary."""
    exc = OSError("connection to the JVM lost\nTraceback ...")
    assert one_line_reason(exc) == summary(exc, limit=300) == "OSError: connection to the JVM lost"


@pytest.mark.parametrize("code, words", [
    (-signal.SIGKILL, "process was killed by SIGKILL"), (-signal.SIGSEGV, "process was killed by SIGSEGV"),
    (-200, "process was killed by signal 200"), (3, "process exited with code 3"), (0, "process exited with code 0"),
])
def test_exit_status_in_words(code, words):
    assert describe_exit(code) == words


def test_torchrun_root_cause_uses_the_same_words():
    report = "Root Cause (first observed failure):\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 42)\n"
    assert torchrun_root_cause(report) == (1, describe_exit(-9))


def test_batch_arithmetic_is_one_check_for_flags_and_deepspeed_config():
    check_batch_arithmetic(16, 4, 2, 2)
    check_batch_arithmetic(None, 4, 2, 2)  # nothing to check until both batches are known
    check_batch_arithmetic(16, None, 2, 2)
    with pytest.raises(ConfigError) as from_flags:
        RunConfig(strategy="deepspeed", num_processes=2, grad_accum=2, micro_batch=4, train_batch=32)
    with pytest.raises(ConfigError) as from_config:
        build_config(RunConfig(strategy="deepspeed", num_processes=2, grad_accum=2,
                               deepspeed_config='{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}'))
    assert str(from_flags.value) == str(from_config.value)
    text = str(from_flags.value)
    assert text.startswith(
        "--train-batch: train_batch_size 32 != micro_batch_per_gpu 4 x gradient_accumulation_steps 2"
    )
    assert "world_size 2 (= 16)" in text and "set --train-batch 16" in text and "--micro-batch" in text
