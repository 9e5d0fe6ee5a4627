"""The sweep's entry points (dtrain_magic/sweep/entry.py): the magic's line and `dtrain_magic.sweep`'s keywords make
the sweep's options, the base config and each trial's config, resolved as a run's (no run here: `_run` is faked)."""

from __future__ import annotations

import pytest

from dtrain_magic.errors import ConfigError
from dtrain_magic.notebook import flags
from dtrain_magic.sweep import entry


@pytest.fixture
def captured(monkeypatch):
    seen = {}

    def fake_run(config, make_config, settings, make_payload, namespace, sources, model=None):
        seen.update(config=config, make_config=make_config, settings=settings, make_payload=make_payload,
                    sources=sources, model=model)
        return None

    monkeypatch.setattr(entry, "_run", fake_run)
    return seen


def test_the_magic_line_makes_the_sweep_and_its_trials_configs(captured):
    args = flags.parse_line('--backend local -n 2 --cpu --sweep "lr=loguniform(1e-4,1e-1) zero=choice(2,3)" '
                            "--trials 12 --metric val_loss --mode max --sampler random --pruner halving "
                            "--parallel-trials 2 --sweep-name s1 --max-failed-trials 5")
    entry.sweep_from_args(args, lambda: None, None, gpu_available=lambda: False)
    settings = captured["settings"]
    assert (settings.space, settings.trials, settings.metric, settings.mode, settings.sampler, settings.pruner,
            settings.parallel_trials, settings.sweep_name, settings.max_failed_trials) == (
        "lr=loguniform(1e-4,1e-1) zero=choice(2,3)", 12, "val_loss", "max", "random", "halving", 2, "s1", 5)
    assert captured["config"].strategy == "ddp" and captured["config"].num_processes == 2
    trial = captured["make_config"]({"zero": 3})  # resolved again: --zero makes the strategy deepspeed
    assert (trial.strategy, trial.zero, trial.num_processes, trial.backend) == ("deepspeed", 3, 2, "local")


def test_the_magic_line_defaults_and_auto():
    args = flags.parse_line('--sweep "lr=grid(1,2)" --metric loss')
    assert (args.trials, args.mode, args.sampler, args.pruner, args.parallel_trials, args.sweep_name,
            args.max_failed_trials) == (None, "min", "auto", "median", "auto", None, 3)


def test_python_keywords_split_into_the_sweeps_the_runs_and_the_functions(captured):
    def train(ctx, scale=1):
        return scale

    entry.sweep(train, "lr=uniform(0,1)", trials=4, metric="loss", parallel_trials=1, num_workers=2, cpu=True,
                backend="local", scale=3, ui=False)
    assert captured["settings"].trials == 4 and captured["settings"].parallel_trials == 1
    assert captured["config"].num_processes == 2 and captured["config"].use_gpu is False
    payload = captured["make_payload"]()
    assert payload.call_text == "train(ctx, scale=3)"
    assert captured["make_config"]({"precision": "bf16"}).precision == "bf16"


def test_python_refuses_an_unknown_keyword_and_a_missing_metric():
    def train(ctx):
        pass

    with pytest.raises(ConfigError, match="trails=: is neither an option of run"):
        entry.sweep(train, "lr=uniform(0,1)", trails=4, metric="loss")
    with pytest.raises(ConfigError, match="--metric: got None"):
        entry.sweep(train, "lr=uniform(0,1)", trials=4)


def test_the_command_line_has_a_sweep_command_and_run_takes_no_sweep_flag(captured, tmp_path, monkeypatch):
    from dtrain_magic import cli

    script = tmp_path / "job.py"
    script.write_text("def main(ctx):\n    ctx.log(loss=ctx.params['lr'])\n")
    monkeypatch.chdir(tmp_path)
    status = cli.main(["sweep", "job.py:main", "-n", "1", "--cpu", "--sweep", "lr=grid(0.1,0.2)", "--metric", "loss"])
    assert status == cli.EXIT_OK
    assert captured["settings"].space == "lr=grid(0.1,0.2)" and captured["config"].num_processes == 1
    assert captured["config"].ui is False
    assert captured["make_payload"]().name == "main"
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["run", "job.py:main", "--sweep", "lr=grid(1)"])


def test_the_magic_sends_a_sweep_line_to_the_sweep(captured, shell):
    cell = shell.run('%%distribute --no-ui -n 1 --cpu --sweep "lr=grid(1,2)" --metric loss\n'
                     "import torch\n"
                     "def train(ctx):\n    model, opt = ctx.prepare(torch.nn.Linear(3, 2), None)\n")
    assert cell.error_in_exec is None
    assert captured["settings"].space == "lr=grid(1,2)" and captured["make_payload"]().name == "train"
    assert captured["model"]("train").num_params == 8  # the cell's model, counted for the trials' memory check


def test_a_python_sweep_counts_its_functions_model_for_the_memory_check(captured):
    import torch

    def train(ctx):
        model, opt = ctx.prepare(torch.nn.Linear(4, 4), None)

    entry.sweep(train, "lr=grid(1)", metric="loss", num_processes=1, cpu=True)
    assert captured["model"]("train").num_params == 20
