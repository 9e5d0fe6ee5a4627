"""Flag parsing and validation: every bad value is a clear error naming the flag, before any launch."""

from dataclasses import FrozenInstanceError

import pytest
from IPython.core.error import UsageError

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.notebook import flags


def parse(line, **kw):
    kw.setdefault("gpu_available", lambda: False)
    kw.setdefault("backend_detector", lambda: "local")
    return flags.config_from_line(line, **kw)


def test_defaults_on_a_cpu_machine():
    config = parse("")
    assert (config.backend, config.strategy, config.zero, config.precision) == ("local", "ddp", None, "fp32")
    assert (config.num_processes, config.use_gpu, config.grad_accum) == (2, False, 1)
    assert config.experiment == "dtrain_magic" and config.ui is False and config.dry_run is False


def test_defaults_with_gpus_use_one_process_per_gpu():
    config = parse("", gpu_available=lambda: True, gpu_count=lambda: 4)
    assert config.use_gpu and config.num_processes == 4


def test_every_flag_is_parsed():
    config = parse(
        "--backend ray --strategy deepspeed --zero 3 --precision bf16 --num-workers 3 --cpu --grad-accum 4 "
        "--fn train2 --result out --experiment exp --tracking-uri sqlite:///x.db --no-ui --dry-run --seed 7 "
        "--timeout 12.5 --ray-address 127.0.0.1:6379 --max-restarts 2 --storage /tmp/s "
        "--deepspeed-config '{\"a\": 1}' --micro-batch 8 --train-batch 96"
    )
    assert config == RunConfig(
        backend="ray", strategy="deepspeed", zero=3, precision="bf16", num_processes=3, use_gpu=False,
        grad_accum=4, fn="train2", result="out", experiment="exp", tracking_uri="sqlite:///x.db", ui=False,
        dry_run=True, seed=7, timeout=12.5, ray_address="127.0.0.1:6379", max_restarts=2, storage="/tmp/s",
        deepspeed_config='{"a": 1}', micro_batch=8, train_batch=96,
    )


def test_short_and_alias_flags():
    assert parse("-n 5").num_processes == 5
    assert parse("--num-processes 3").num_processes == 3
    assert parse("--num-workers 4").num_processes == 4


def test_zero_without_strategy_means_deepspeed():
    assert parse("--zero 2").strategy == "deepspeed"


def test_auto_backend_uses_detector():
    assert parse("--backend auto", backend_detector=lambda: "spark").backend == "spark"
    assert parse("--backend local", backend_detector=lambda: "spark").backend == "local"


def test_spark_flags():
    config = parse("--backend spark --cluster --spark-master spark://127.0.0.1:7077")
    assert config.local_mode is False and config.spark_master == "spark://127.0.0.1:7077"
    assert parse("--backend spark --local-mode").local_mode is True


@pytest.mark.parametrize(
    "line, flag, allowed",
    [
        ("--backend yarn", "--backend", "auto"),
        ("--strategy horovod", "--strategy", "ddp"),
        ("--zero 4", "--zero", "0, 1, 2, 3"),
        ("--precision fp8", "--precision", "fp32"),
        ("-n two", "-n", "int"),
        ("--grad-accum x", "--grad-accum", "int"),
        ("--timeout soon", "--timeout", "seconds"),
        ("--no-such-flag", "--no-such-flag", "unrecognized"),
    ],
)
def test_argparse_errors_name_the_flag_and_allowed_values(line, flag, allowed):
    with pytest.raises(UsageError) as info:
        parse(line)
    message = str(info.value)
    assert flag in message or flag.lstrip("-") in message
    assert allowed in message


@pytest.mark.parametrize(
    "line, guess",
    [("--no-such-flag", None), ("--num-proceses 3", "--num-processes"), ("--tracking_uri x", "--tracking-uri")],
)
def test_unknown_flag_points_at_the_flag_list(line, guess):
    with pytest.raises(UsageError) as info:
        parse(line)
    message = str(info.value)
    assert message.startswith(f"unrecognized arguments: {line}")
    assert message.endswith("see %%distribute? for every flag")
    assert (f"did you mean {guess}?" in message) if guess else ("did you mean" not in message)


def test_other_argparse_errors_get_no_flag_list_hint():
    with pytest.raises(UsageError) as info:
        parse("--backend yarn")
    assert "%%distribute?" not in str(info.value)


@pytest.mark.parametrize(
    "line, flag, fragment",
    [
        ("-n 0", "--num-processes", ">= 1"),
        ("--grad-accum 0", "--grad-accum", ">= 1"),
        ("--strategy ddp --zero 1", "--zero", "--strategy deepspeed"),
        ("--strategy fsdp --zero 3", "--zero", "--strategy deepspeed"),
        ("--precision fp16", "--precision", "bf16"),
        ("--precision fp16 --cpu", "--precision", "bf16"),
        ("--max-restarts -1", "--max-restarts", ">= 0"),
        ("--timeout 0", "--timeout", "> 0"),
        ("--timeout -3", "--timeout", "> 0"),
        ("--fn 2bad", "--fn", "identifier"),
        ("--result a-b", "--result", "identifier"),
        ("--experiment ''", "--experiment", "non-empty"),
        ("--backend local --cluster", "--cluster", "spark"),
        ("--backend local --spark-master local[2]", "--spark-master", "spark"),
        ("--backend local --ray-address auto", "--ray-address", "ray"),
        ("--strategy ddp --deepspeed-config {}", "--deepspeed-config", "deepspeed"),
        ("--seed -1", "--seed", ">= 0"),
        ("--micro-batch 0 --train-batch 8", "--micro-batch", ">= 1"),
        ("--zero 2 -n 2 --grad-accum 2 --micro-batch 4 --train-batch 32", "--train-batch", "--train-batch 16"),
    ],
)
def test_validation_errors_name_flag_and_fix(line, flag, fragment):
    with pytest.raises(ConfigError) as info:
        parse(line)
    assert info.value.flag == flag
    assert fragment in str(info.value)
    assert str(info.value).startswith(flag)


def test_batch_arithmetic_names_the_three_numbers():
    with pytest.raises(ConfigError) as info:
        parse("--zero 1 -n 4 --grad-accum 2 --micro-batch 8 --train-batch 32")
    text = str(info.value)
    assert "train_batch_size 32" in text and "micro_batch_per_gpu 8" in text
    assert "gradient_accumulation_steps 2" in text and "world_size 4" in text and "64" in text


def test_help_lists_every_flag_with_its_default():
    help_text = flags.HELP
    for flag in [
        "--backend", "--strategy", "--zero", "--precision", "-n", "--num-processes", "--num-workers", "--gpu",
        "--cpu", "--grad-accum", "--fn", "--result", "--experiment", "--tracking-uri", "--ui", "--no-ui",
        "--dry-run", "--seed", "--timeout", "--local-mode", "--cluster", "--spark-master", "--ray-address",
        "--max-restarts", "--storage", "--deepspeed-config", "--micro-batch", "--train-batch", "--configure",
    ]:
        assert flag in help_text, flag
    assert "(default: auto)" in help_text and "(default: fp32)" in help_text and "(default: dtrain_magic)" in help_text


def test_flag_line_round_trips():
    config = parse("--backend ray --zero 2 --precision bf16 -n 3 --grad-accum 2 --experiment e --max-restarts 1")
    line = config.flag_line()
    assert line.startswith("%%distribute ")
    assert parse(line[len("%%distribute "):]) == config


def test_config_is_immutable_and_revalidated_on_replace():
    config = parse("")
    with pytest.raises(FrozenInstanceError):
        config.num_processes = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        config.replace(num_processes=0)


def test_params_redact_credentials_and_cover_every_field():
    config = RunConfig(tracking_uri="https://user:s3cret@mlflow.example.com/path")
    params = config.to_params()
    assert "s3cret" not in params["tracking_uri"] and "mlflow.example.com" in params["tracking_uri"]
    import dataclasses

    assert set(params) == {f.name for f in dataclasses.fields(RunConfig)}
