"""--tp, --pp, --microbatches, --pp-schedule: parsed, round-tripped, and bad mixes refused before launch."""

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.notebook import flags


def parse(line: str) -> RunConfig:
    return flags.config_from_line(line, gpu_available=lambda: False, backend_detector=lambda: "local")


def test_defaults_are_no_model_parallelism():
    config = parse("")
    assert (config.tp, config.pp, config.microbatches, config.pp_schedule) == (1, 1, None, "gpipe")
    assert config.data_parallel_size == 2


def test_flags_parse_and_round_trip_through_the_flag_line():
    config = parse("-n 8 --strategy fsdp --tp 2 --pp 2 --microbatches 6 --pp-schedule 1f1b")
    assert (config.tp, config.pp, config.microbatches, config.pp_schedule) == (2, 2, 6, "1f1b")
    assert config.data_parallel_size == 2 and config.pipeline_microbatches == 6
    line = config.flag_line()
    assert "--tp 2 --pp 2 --microbatches 6 --pp-schedule 1f1b" in line
    assert flags.config_from_line(line.removeprefix("%%distribute "), gpu_available=lambda: False) == config
    assert "--tp" not in parse("").flag_line() and "--pp" not in parse("").flag_line()


def test_microbatches_default_to_twice_the_stages():
    assert parse("-n 2 --pp 2").pipeline_microbatches == 4
    assert parse("-n 4 --pp 4").pipeline_microbatches == 8


@pytest.mark.parametrize(
    "line,flag,expected",
    [
        ("-n 3 --tp 2", "--tp", "-n 3 processes cannot be arranged as --tp 2 (= 2 processes per model replica)"),
        ("-n 3 --tp 2", "--tp", "use -n 2 or 4"),
        ("-n 6 --tp 2 --pp 2", "--tp", "--tp 2 x --pp 2 (= 4 processes"),
        ("-n 1 --pp 2", "--pp", "use -n 2,"),
        ("--zero 2 --pp 2", "--pp", "--pp 2 is not supported with deepspeed ZeRO-2"),
        ("--strategy deepspeed --tp 2", "--tp", "Use --strategy fsdp"),
        ("--microbatches 4", "--microbatches", "add --pp N"),
        ("--pp-schedule 1f1b", "--pp-schedule", "add --pp N"),
        ("-n 4 --pp 4 --microbatches 2 --pp-schedule 1f1b", "--microbatches",
         "got --microbatches 2 for --pp 4; use --microbatches 4 or more"),
        ("--pp 2 --microbatches 0", "--microbatches", "must be an integer >= 1"),
        ("--tp 0", "--tp", "got 0; must be an integer >= 1"),
    ],
)
def test_bad_mixes_are_config_errors_naming_the_numbers(line, flag, expected):
    with pytest.raises(ConfigError) as info:
        parse(line)
    assert info.value.flag == flag
    assert expected in str(info.value), str(info.value)


def test_fp16_with_model_parallelism_is_refused_even_on_gpus():
    with pytest.raises(ConfigError, match="use --precision bf16"):
        RunConfig(use_gpu=True, precision="fp16", tp=2)


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert parse("-n 4 --pp 4 --microbatches 2").pipeline_microbatches == 2


def test_help_lists_the_model_parallel_flags():
    assert all(name in flags.HELP for name in ("--tp", "--pp", "--microbatches", "--pp-schedule"))
