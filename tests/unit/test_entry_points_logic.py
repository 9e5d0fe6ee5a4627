"""The entry points' pure logic: `dtrain_magic.run`'s options from the flag table, its payloads, the command
line's parser and targets, the registries, and the call form of a function the cell imports."""

from __future__ import annotations

import inspect
import shlex
import sys

import cloudpickle
import pytest

import dtrain_magic
from dtrain_magic import api, cli
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import CaptureError, ConfigError
from dtrain_magic.flagtable import CLI, FLAGS, MAGIC, PYTHON
from dtrain_magic.notebook.capture import call_statement, capture
from dtrain_magic.payload import CTX
from dtrain_magic.registry import BACKENDS, STRATEGIES, Registry

LOCAL = {"gpu_available": lambda: False, "backend_detector": lambda: "local"}


# -- dtrain_magic.run: options ---------------------------------------------------------------------------------


def test_every_python_option_is_a_flag_table_field_and_the_notebook_only_ones_are_not():
    fields = {row.field for row in FLAGS if row.field is not None and PYTHON in row.entry_points}
    assert set(api.OPTIONS.values()) == {row for row in FLAGS if row.field in fields}
    assert {"fn", "result"} & set(api.OPTIONS) == set()  # the cell's --fn and --result have no meaning here
    signature = inspect.signature(dtrain_magic.run)
    keyword_only = {name for name, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == fields | {"fn_kwargs"}
    assert signature.parameters["backend"].default == "auto"
    for row in FLAGS:
        if row.field in fields:
            assert f"{row.field}=" in dtrain_magic.run.__doc__, row.field


def test_options_take_the_flags_long_names_and_leave_the_rest_to_the_function():
    values, rest = api.split_options({"num_workers": 3, "gpu": False, "zero": 2, "lr": 0.1, "epochs": 2})
    assert values == {"num_processes": 3, "use_gpu": False, "zero": 2}
    assert rest == {"lr": 0.1, "epochs": 2}
    with pytest.raises(ConfigError, match="given twice, as num_processes= and num_workers="):
        api.split_options({"num_processes": 2, "num_workers": 3})


def test_every_long_flag_name_is_a_keyword_option_the_off_ones_too():
    for row in FLAGS:
        if PYTHON in row.entry_points and row.field is not None:
            for option in row.all_options:
                if option.startswith("--"):
                    assert api.OPTIONS[option[2:].replace("-", "_")] is row, option
    values, rest = api.split_options({"cpu": True, "cluster": True, "no_ui": True, "hang_timeout": 30,
                                      "stall_timeout": None})
    assert values == {"use_gpu": False, "local_mode": False, "ui": False, "hang_timeout": 30, "stall_timeout": None}
    assert rest == {}
    assert api.split_options({"cpu": False})[0] == {"use_gpu": True}
    assert api.config_from_options(api.split_options({"cpu": True})[0], **LOCAL).use_gpu is False
    with pytest.raises(ConfigError, match="given twice, as use_gpu= and cpu="):
        api.split_options({"use_gpu": True, "cpu": True})
    with pytest.raises(ConfigError, match=r"cpu=: got 'yes'; must be True or False \(cpu=True is --cpu\)"):
        api.split_options({"cpu": "yes"})


def train_ctx_only(ctx):
    return ctx


def train_taking_anything(ctx, **kwargs):
    return kwargs


def test_a_keyword_neither_option_nor_parameter_is_named_with_the_closest_option():
    with pytest.raises(ConfigError, match=r"cpux=: is neither an option of run\(\) nor a parameter of "
                                          r"train_ctx_only\(ctx\); did you mean cpu=\?"):
        dtrain_magic.run(train_ctx_only, cpux=True)  # before anything: no config, no launch
    with pytest.raises(ConfigError, match=r"num_proceses=: .* did you mean num_processes=\?"):
        dtrain_magic.run(train_ctx_only, num_proceses=2)
    with pytest.raises(ConfigError, match=r"epoch=: .* did you mean epochs=\?"):
        api.check_keywords(train_with_ctx, {"lr": 0.1, "epoch": 2})  # the function's own names are offered too
    api.check_keywords(train_with_ctx, {"lr": 0.1, "epochs": 2})  # its parameters: theirs
    api.check_keywords(train_taking_anything, {"cpux": True})  # **kwargs takes anything: passed on
    bound = api.payload_of(train_taking_anything, (), {"cpux": True})
    assert bound.load()("the ctx") == {"cpux": True}


def test_session_options_take_the_off_names_too():
    from dtrain_magic.session import options

    config, _ = options.config_from_options({"backend": "local", "cpu": True, "stall_timeout": None}, **LOCAL)
    assert config.use_gpu is False and config.stall_timeout == 0
    with pytest.raises(ConfigError, match="--on-stall: fail does not apply to a session"):
        options.config_from_options({"backend": "local", "on_stall": "fail"}, **LOCAL)


def test_options_resolve_and_validate_as_the_magic_does():
    config = api.config_from_options({"zero": 2}, **LOCAL)
    assert (config.backend, config.strategy, config.zero, config.num_processes, config.use_gpu) == (
        "local", "deepspeed", 2, 2, False)
    assert config == RunConfig(backend="local", strategy="deepspeed", zero=2, ui=False)
    with pytest.raises(ConfigError, match="--zero: got 5; allowed: 0, 1, 2, 3"):
        api.config_from_options({"zero": 5}, **LOCAL)
    with pytest.raises(ConfigError, match="unknown option num_proc=4; did you mean num_processes="):
        api.config_from_options({"num_proc": 4}, **LOCAL)


def train_with_ctx(ctx, lr, epochs=1):
    return lr * epochs


def train_without_ctx(lr):
    return lr


def test_payloads_bind_the_arguments_and_give_ctx_where_the_function_asks_for_it():
    bound = api.payload_of(train_with_ctx, (0.5,), {"epochs": 2})
    assert bound.takes_ctx and bound.call_text == "train_with_ctx(ctx, 0.5, epochs=2)"
    assert bound.load()("the ctx") == 1.0
    plain = api.payload_of(train_without_ctx, (0.25,), {})
    assert not plain.takes_ctx and plain.load()() == 0.25
    assert api.payload_of(train_with_ctx, (CTX, 0.5), {}).call_text == "train_with_ctx(ctx, 0.5)"
    with pytest.raises(ConfigError, match=r"the arguments do not fit train_without_ctx\(lr\)"):
        api.payload_of(train_without_ctx, (1, 2), {})
    with pytest.raises(ConfigError, match="must be the function to run, not a int"):
        api.payload_of(3, (), {})


def test_a_parameter_named_like_an_option_is_named_in_the_error_with_fn_kwargs():
    """``run(train, lr=0.1, gpu=False)`` with ``def train(ctx, lr, gpu)``: ``gpu=`` is run()'s option, so train misses
    it; the error says so (not "missing ctx": ctx is given) and how to pass it, before anything launches."""

    def train(ctx, lr, gpu):
        return lr

    with pytest.raises(ConfigError) as caught:
        api.run(train, lr=0.1, gpu=False, backend="local", dry_run=True)
    text = str(caught.value)
    assert "missing a required argument: 'gpu'" in text and "'ctx'" not in text.split(":", 2)[-1], text
    assert "gpu= is an option of run(), not passed to train: give it as fn_kwargs={'gpu': ...}" in text
    assert api.payload_of(train, (), {"lr": 0.1, "gpu": False}).call_text == "train(ctx, lr=0.1, gpu=False)"


# -- the command line -------------------------------------------------------------------------------------------


def test_the_command_lines_flags_are_the_flag_tables(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    for row in FLAGS:
        for option in row.all_options:
            assert (option in shown) == (CLI in row.entry_points), option
    assert "--configure" not in shown and "--result" not in shown


def test_bad_flags_and_targets_exit_2_before_anything_launches(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "x:y", "--zero", "7"])
    assert exit_.value.code == 2 and "--zero: invalid choice: 7" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj.py").write_text("def main(ctx):\n    return 1\n")
    for target, message in [("no_such_module:main", "cannot import no_such_module"),
                            ("proj:missing", "proj has no function 'missing'; it has main"),
                            ("absent.py", "no file 'absent.py'"), ("proj", "give module:function")]:
        assert cli.main(["run", target, "--backend", "local", "--cpu"]) == cli.EXIT_USAGE, target
        assert message in capsys.readouterr().err, target
    assert cli.main(["run", "proj:main", "--backend", "local", "--cpu", "--strategy", "ddp", "--zero", "1"]) == 2
    assert "--zero: applies only to --strategy deepspeed" in capsys.readouterr().err
    assert cli._split_at_dashes(["run", "a:b", "-n", "2", "--", "--lr", "1"]) == (["run", "a:b", "-n", "2"],
                                                                                  ["--lr", "1"])


def test_the_command_lines_dry_run_shows_the_equivalent_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj.py").write_text("def main(ctx):\n    return 1\n")
    argv = ["run", "proj:main", "--backend", "local", "--cpu", "-n", "3", "--experiment", "my exp", "--dry-run",
            "--", "--lr", "1e-3"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "dtrain_magic dry run: nothing launched." in out and "%%distribute" not in out
    line = next(text for text in out.splitlines() if text.startswith("  equivalent: "))
    command = line.removeprefix("  equivalent: ")
    assert command.startswith("python -m dtrain_magic run proj:main --backend local")
    assert "'my exp'" in command and command.endswith(" -- --lr 1e-3")
    words = shlex.split(command)[3:]  # the command, read back by the command line: the same config
    at = words.index("--")
    assert cli._config(cli.parser().parse_args(words[:at])) == cli._config(
        cli.parser().parse_args(argv[:argv.index("--")])).replace(dry_run=False)


def test_a_target_file_is_shipped_by_value_and_a_script_as_its_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj_by_file.py").write_text("def main():\n    return 41 + 1\n")
    fn, argv0 = cli.load_target("proj_by_file.py:main")
    payload = api.payload_of(fn, (), {}, argv=(argv0, "--x"))
    sys.modules.pop("proj_by_file")  # a worker without the file: the function travels by value
    assert cloudpickle.loads(payload.function_bytes)() == 42 and payload.argv == ("proj_by_file.py", "--x")
    (tmp_path / "script.py").write_text("import sys\nRESULT.append(sys.argv[1:])\n")
    script, argv0 = cli.load_target("script.py")
    assert argv0 == "script.py" and not api.payload_of(script, (), {}).takes_ctx


# -- registries ---------------------------------------------------------------------------------------------------


def test_a_registry_is_the_flags_choices_and_loads_lazily():
    assert list(BACKENDS) == ["auto", "local", "spark", "ray"] and BACKENDS.names() == ("local", "spark", "ray")
    assert "auto" in BACKENDS and "ray" in BACKENDS and "mpi" not in BACKENDS
    assert STRATEGIES.owner_of("zero") == "deepspeed" and STRATEGIES.owner_of("tp") is None
    assert BACKENDS.owner_of("spark_master") == "spark" and BACKENDS.owner_of("ray_address") == "ray"
    registry = Registry("--thing", {"gone": "dtrain_magic.no_such_module:Thing"})
    with pytest.raises(ConfigError, match="--thing: gone is not yet supported"):
        registry.load("gone")
    with pytest.raises(ConfigError, match="--thing: got 'other'; allowed: gone"):
        registry.load("other")
    with pytest.raises(ValueError):
        BACKENDS.register("auto", object)


def test_a_strategy_registered_in_one_line_is_a_choice_everywhere(monkeypatch):
    from dtrain_magic.strategies.ddp import DDPStrategy

    class Plain(DDPStrategy):
        name = "plain"
        own_fields = ("micro_batch",)

    STRATEGIES.register("plain", Plain)
    try:
        config = RunConfig(strategy="plain", micro_batch=4)
        assert config.process_group_backend == "gloo"
        with pytest.raises(ConfigError, match="--micro-batch: applies only to --strategy plain"):
            RunConfig(strategy="ddp", micro_batch=4)
        assert api.config_from_options({"micro_batch": 4}, **LOCAL).strategy == "plain"  # its flag implies it
        from dtrain_magic.notebook import flags

        assert flags.config_from_line("--strategy plain", gpu_available=lambda: False).strategy == "plain"
    finally:
        STRATEGIES.unregister("plain")
    with pytest.raises(ConfigError, match="--strategy: got 'plain'"):
        RunConfig(strategy="plain")


def test_backend_facts_generate_the_rules():
    from dtrain_magic.backends import Backend

    class Once(Backend):  # a backend that never restarts its workers (every built-in one does now)
        name = "once"

    BACKENDS.register("once", "dtrain_magic.no_such_module:Once", facts=Once)
    try:
        with pytest.raises(ConfigError, match="--max-restarts: --backend once does not restart failed workers; use "
                                              "--backend local or spark or ray"):
            RunConfig(backend="once", max_restarts=1)
    finally:
        BACKENDS.unregister("once")
    assert RunConfig(backend="spark", max_restarts=1).max_restarts == 1  # a new barrier job per attempt (#37)
    with pytest.raises(ConfigError, match="--keep-warm: applies only to --backend spark or ray"):
        RunConfig(backend="local", keep_warm=5)
    with pytest.raises(ConfigError, match="URLs .* are for --backend ray"):
        RunConfig(backend="local", storage="s3://bucket/x")
    with pytest.raises(ConfigError, match="--cluster: applies only to --backend spark, not --backend ray"):
        RunConfig(backend="ray", local_mode=False)


# -- the call form of an imported function --------------------------------------------------------------------


@pytest.mark.parametrize("cell,called", [
    ("from my_project.train import fit\nfit('out.pt')", True),
    ("import my_project.train as t\nfrom my_project import fit as go\ngo(1)", True),
    ("import my_project\nmy_project.fit(1)", False),  # an attribute call: not the call form
    ("def helper():\n    pass\ndef train(ctx):\n    pass\nhelper()", False),  # not the last def
    ("print(1)", False),
])
def test_a_function_the_cell_imports_is_the_call_form(cell, called):
    assert (call_statement(cell, {}) is not None) == called


def test_an_imported_function_is_never_called_in_the_notebook(tmp_path, monkeypatch):
    package = tmp_path / "my_project_x"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("CALLS = []\n\ndef fit(path, epochs=1):\n    CALLS.append(path)\n"
                                      "    return path, epochs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    payload, fn = capture("from my_project_x.train import fit\nfit('out.pt', epochs=2)\n", namespace)
    import my_project_x.train as module

    assert module.CALLS == [] and payload.call_text == "fit('out.pt', epochs=2)"
    assert payload.load()() == ("out.pt", 2)  # what a worker calls: the module travelled by value
    assert module.CALLS == []
    sys.modules.pop("my_project_x.train")
    sys.modules.pop("my_project_x")
    with pytest.raises(CaptureError, match="the arguments do not fit fit"):
        capture("from my_project_x.train import fit\nfit()\n", {})


def test_where_flags_apply_is_declared_per_row():
    magic_only = {"--fn", "--result", "--configure"}
    assert {row.name for row in FLAGS if row.entry_points == (MAGIC,)} == magic_only
    # --output binds a notebook variable, run()'s outputs= returns result.tables; the command line prints paths
    assert next(row for row in FLAGS if row.name == "--output").entry_points == (MAGIC, PYTHON)
