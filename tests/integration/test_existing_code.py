"""Existing training code runs unchanged on ``--backend local`` (issue #13): TorchDistributor-style
functions, Hugging Face Trainer, accelerate and Lightning, really started (2 spawned workers, gloo, a
real MLflow store). The same styles on Spark and Ray: test_spark.py / test_ray.py (their shared
session / instance). Tolerance: fp32 final weights within atol 1e-5 of one plain process."""

import pytest

from dtrain_magic.errors import ConfigError, WorkerError
from workloads import (
    EXISTING_HELPERS,
    accelerate_cell,
    assert_close,
    existing_reference,
    hf_trainer_cell,
    lightning_cell,
    loss_fell,
    ray_loop_cell,
    torchdistributor_cell,
)

pytestmark = pytest.mark.slow


def all_runs(mlflow):
    experiments = [e.experiment_id for e in mlflow.search_experiments()]
    return mlflow.search_runs(experiment_ids=experiments)


def assert_torchdistributor_run(result) -> dict:
    """Every rank's value came back, torchrun's variables were there, the loss fell, and the final weights
    are one process's (fp32, 1e-5)."""
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["env"]["RANK"] for v in values] == ["0", "1"]
    assert [v["env"]["LOCAL_RANK"] for v in values] == ["0", "1"]
    assert {v["env"]["WORLD_SIZE"] for v in values} == {"2"}
    assert len({(v["env"]["MASTER_ADDR"], v["env"]["MASTER_PORT"]) for v in values}) == 1
    assert int(values[0]["env"]["MASTER_PORT"]) > 0
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    assert_close(values[0]["weights"], existing_reference(), atol=1e-5, rtol=0)
    assert_close(values[1]["weights"], values[0]["weights"], atol=0, rtol=0)
    # the function's destroy_process_group() was deferred: the magic still needed the group
    assert all(v["group_alive"] for v in values)
    return values[0]


def test_torchdistributor_style_function_runs_unchanged_and_matches_one_process(shell, mlflow):
    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(torchdistributor_cell("local"))
    values = result.result.values
    assert_torchdistributor_run(result)
    # its init_process_group started no TCPStore on MASTER_PORT: the private FileStore rendezvous stayed
    # the only one, and nothing in the workers listens beyond loopback
    for value in values:
        assert set(value["listening"]) <= {"127.0.0.1"}, value["listening"]
    assert mlflow.get_run(result.result.run_id).info.status == "FINISHED"
    assert result.result.config.backend == "local"


def test_init_process_group_with_nccl_on_cpu_is_a_short_error(shell):
    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(torchdistributor_cell("local", init='dist.init_process_group(backend="nccl", init_method="env://")'))
    error = result.error_in_exec
    assert isinstance(error, WorkerError), error
    assert "UnsupportedCodeError" in error.summary and "NCCL needs CUDA" in error.summary, error.summary
    assert "backend='gloo'" in error.summary and "--gpu" in error.summary
    assert "dist.init_process_group(backend=\"nccl\"" in error.remote_traceback  # the user's own line
    assert len(str(error).splitlines()) < 12, str(error)


def test_ray_train_loop_off_ray_is_refused_before_launch(shell, mlflow, capsys):
    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(ray_loop_cell().replace("--backend ray", "--backend local"))
    error = result.error_in_exec
    assert isinstance(error, ConfigError), error
    assert "--backend ray" in str(error) and "Ray Train" in str(error) and "Nothing was launched" in str(error)
    assert all_runs(mlflow).__len__() == 0  # nothing launched, no MLflow run


def test_hf_trainer_logs_into_the_magics_run_and_takes_the_flags(shell, mlflow):
    """report_to="mlflow" in the cell: no second MLflow run; loss, learning_rate, epoch land in the
    magic's run; --precision bf16 and --grad-accum 2 became TrainingArguments (left at their defaults)."""
    result = shell.run(hf_trainer_cell("local", flags="--precision bf16 --grad-accum 2"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["world_size"] == 2
    assert values[0]["bf16"] is True and values[0]["accum"] == 2
    losses = values[0]["losses"]
    assert losses[-1] < losses[0] * 0.7, losses
    # 64 samples / (4 per device x 2 processes x 2 accumulated) = 4 steps per epoch, 4 epochs
    assert values[0]["steps"] == 16
    runs = all_runs(mlflow)
    assert len(runs) == 1 and runs[0].info.run_id == result.result.run_id, [r.info.run_name for r in runs]
    history = {
        name: mlflow.get_metric_history(result.result.run_id, name) for name in ("loss", "learning_rate", "epoch")
    }
    assert [m.step for m in history["loss"]] == list(range(1, 17))
    assert [m.value for m in history["loss"]] == pytest.approx(losses, rel=1e-4)
    assert history["learning_rate"] and history["epoch"][-1].value == pytest.approx(4.0)


def test_hf_trainer_argument_conflicting_with_a_flag_is_a_clear_error(shell):
    result = shell.run(hf_trainer_cell("local", flags="--grad-accum 2", args="gradient_accumulation_steps=4,"))
    error = result.error_in_exec
    assert isinstance(error, WorkerError), error
    assert "--grad-accum 2 conflicts with TrainingArguments(gradient_accumulation_steps=4)" in error.summary


def test_accelerate_loop_matches_one_process_and_logs(shell, mlflow):
    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(accelerate_cell("local"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["num_processes"] == 2
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    assert_close(values[0]["weights"], existing_reference(), atol=1e-5, rtol=0)
    history = mlflow.get_metric_history(result.result.run_id, "loss")
    assert [m.step for m in history] == list(range(12))  # accelerator.log reached the run (rank 0)


def test_lightning_ddp_runs_in_the_magics_processes(shell):
    assert shell.run(EXISTING_HELPERS).error_in_exec is None
    result = shell.run(lightning_cell("local"))
    assert result.error_in_exec is None, result.error_in_exec
    values = result.result.values
    assert [v["rank"] for v in values] == [0, 1] and values[0]["world_size"] == 2
    assert values[0]["pid"] != values[1]["pid"]  # two magic workers, no processes of Lightning's own
    assert loss_fell(values[0]["losses"]), values[0]["losses"]
    # DDP kept the replicas identical (Lightning's own sampler and step order: not compared with one process)
    assert_close(values[1]["weights"], values[0]["weights"], atol=0, rtol=0)


def test_plain_ctx_runs_import_none_of_the_optional_libraries(shell):
    """transformers, accelerate, lightning and ray are hooked only when the user's code imports them: a
    plain run imports none of them (so it works as before where they are not installed)."""
    result = shell.run(
        "%%distribute --backend local -n 2 --no-ui\nimport sys\ndef train(ctx):\n"
        "    return sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'ray')"
        " if m in sys.modules)\n"
    )
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result.values == [[], []]


def test_ray_train_called_from_an_imported_module_fails_short_in_the_worker(shell, tmp_path, monkeypatch):
    """The notebook cannot see ray.train calls inside an imported module: the worker's ray.train
    functions themselves then raise the short error, before any training."""
    (tmp_path / "ray_loop_module.py").write_text(
        "def loop():\n    import ray.train\n    rank = ray.train.get_context().get_world_rank()\n    return rank\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # importable in the notebook, hence on the workers' path
    result = shell.run("%%distribute --backend local -n 2 --no-ui\nimport ray_loop_module\ndef train():\n"
                       "    return ray_loop_module.loop()\n")
    error = result.error_in_exec
    assert isinstance(error, WorkerError), error
    assert "UnsupportedCodeError: ray.train.get_context() works only inside Ray Train" in error.summary
    assert "--backend ray" in error.summary
