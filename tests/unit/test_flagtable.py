"""The flag table (`dtrain_magic.flagtable`) is the one source of the flags: it covers every `RunConfig`
field, agrees with RunConfig's defaults, builds the parser, writes flag lines that read back to the same
config for every flag, and the generated docs are current."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from dtrain_magic import flagtable
from dtrain_magic.config import RunConfig, quote_flag_value
from dtrain_magic.errors import ConfigError
from dtrain_magic.flagtable import APPEND, FLAGS, NEVER, SWITCH, VALUE
from dtrain_magic.notebook import flags

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("flagdocs", REPO / "scripts" / "flagdocs.py")
flagdocs = importlib.util.module_from_spec(_SPEC)  # a script of the repository, not a module of the package
_SPEC.loader.exec_module(flagdocs)
FIELDS = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extra"]
MAGIC_ONLY = {"--configure"}  # flags the magic acts on itself: no RunConfig field (besides the sweep's own, SWEEP)

# Text that must survive a flag line: spaces, each quote kind, tabs, a leading dash (argparse would take
# it for a flag), unicode, padding. (Both quote kinds at once cannot be written: see the refusal test.)
TEXTS = ["plain", "two words", "a  b", "it's", 'say "hi"', "'quoted'", '"double"', "tab\there", "  padded  ",
         "-leading-dash", "--looks-like-a-flag", "-5", "x=y,z", "ünïcode ✓", "%%distribute", "$HOME"]
FREE_TEXT = {  # text fields, with what they need to be valid
    "experiment": {}, "tracking_uri": {}, "spark_master": {"backend": "spark"}, "ray_address": {"backend": "ray"},
    "storage": {}, "deepspeed_config": {"strategy": "deepspeed"}, "data_dir": {"data": {"train": "df"}},
}
# text fields that must be Python identifiers, or --resume's run ids (no spaces or quotes possible)
IDENTIFIERS = {"fn", "result", "ac_module", "resume"}

# Non-default values per RunConfig field (with what makes them valid). Every field needs at least one.
ROUND_TRIP: dict[str, list[dict]] = {
    "backend": [{"backend": "spark"}, {"backend": "ray"}, {"backend": "local"}],
    "strategy": [{"strategy": "fsdp"}, {"strategy": "deepspeed"}],
    "zero": [{"strategy": "deepspeed", "zero": stage} for stage in (0, 1, 2, 3)],
    "precision": [{"precision": "bf16"}, {"precision": "fp16", "use_gpu": True}],
    "num_processes": [{"num_processes": 1}, {"num_processes": 7}],
    "use_gpu": [{"use_gpu": True}, {"use_gpu": False}],
    "grad_accum": [{"grad_accum": 3}],
    "seed": [{"seed": 0}, {"seed": 12345}],
    "timeout": [{"timeout": 0.5}, {"timeout": 90.0}, {"timeout": 60}, {"timeout": 0.001}],
    "hang_timeout": [{"hang_timeout": 0.0}, {"hang_timeout": 4.5}, {"hang_timeout": 120}],
    "stall_timeout": [{"stall_timeout": 30.0}, {"stall_timeout": 2.5}, {"stall_timeout": 0.0}],
    "on_stall": [{"stall_timeout": 10.0, "on_stall": "fail"}, {"on_stall": "fail"}],
    "fn": [{"fn": "train2"}, {"fn": "_f"}],
    "result": [{"result": "out"}],
    "dry_run": [{"dry_run": True}],
    "ui": [{"ui": True}, {"ui": False}],
    "verbose": [{"verbose": True}],
    "local_mode": [{"backend": "spark", "local_mode": False}],
    "max_restarts": [{"max_restarts": 3}],
    "keep_checkpoints": [{"keep_checkpoints": 1}, {"keep_checkpoints": 5}],
    "preempt_grace": [{"backend": "local", "preempt_grace": 5.0}, {"backend": "local", "preempt_grace": 0.0}],
    "elastic": [{"backend": "local", "elastic": "1:2", "num_processes": 2}, {"backend": "local", "elastic": "2:4"}],
    "resume": [{"backend": "local", "resume": "latest"},
               {"backend": "spark", "resume": "0a1b2c3d4e5f60718293a4b5c6d7e8f9"}],
    "keep_warm": [{"backend": "spark", "keep_warm": 0.0}, {"backend": "ray", "keep_warm": 30},
                  {"backend": "ray", "keep_warm": 2.5}],
    "micro_batch": [{"micro_batch": 4}, {"micro_batch": 4, "grad_accum": 2, "num_processes": 2, "train_batch": 16}],
    "train_batch": [{"train_batch": 16}],
    "tp": [{"tp": 2}, {"tp": 2, "num_processes": 4, "strategy": "fsdp"}],
    "pp": [{"pp": 2}, {"pp": 2, "num_processes": 4}],
    "microbatches": [{"pp": 2, "microbatches": 4}],
    "pp_schedule": [{"pp": 2, "pp_schedule": "1f1b"}],
    "clip_grad": [{"clip_grad": 1.0}, {"clip_grad": 0.25}, {"clip_grad": 3}],
    "ac": [{"ac": "full"}, {"ac": "selective"}],
    "ac_module": [{"ac": "full", "ac_module": "Block"}, {"compile": True, "ac_module": "GPT2Block"}],
    "compile": [{"compile": True}, {"compile": True, "ac": "full"}],
    "offload": [{"offload": "params", "strategy": "fsdp", "use_gpu": True},
                {"offload": "optimizer", "strategy": "deepspeed", "zero": 2, "use_gpu": True}],
    "data": [{"data": {"train": "df_train"}}, {"data": (("train", "df[x,y]"), ("val", "/data/my runs/val.parquet"))},
             {"data": ["a=s3://bucket/part-*.parquet", "b=it's"]}, {"data": {"x": "ünïcode ✓", "y": "-odd"}}],
    "outputs": [{"outputs": {"preds": "df_preds"}}, {"outputs": ["preds=p", "scores=s"]}],
    **{field: [{**needs, field: text} for text in TEXTS] for field, needs in FREE_TEXT.items()},
}
ROUND_TRIP["tracking_uri"] += [{"tracking_uri": "sqlite:////tmp/my runs/mlflow.db"},
                               {"tracking_uri": "https://user:pw@mlflow.example.com/x"}]
ROUND_TRIP["storage"] += [{"backend": "ray", "storage": "s3://bucket/my runs"}]
ROUND_TRIP["deepspeed_config"] += [{"strategy": "deepspeed", "deepspeed_config": '{"zero_optimization": {"stage": 1}}'},
                                   {"strategy": "deepspeed", "deepspeed_config": "/tmp/ds config.json"}]


def from_line(line: str) -> RunConfig:
    return flags.config_from_line(line.removeprefix("%%distribute "), gpu_available=lambda: False,
                                  backend_detector=lambda: "local")


# -- the table covers RunConfig -------------------------------------------------------------------------

def test_every_runconfig_field_has_exactly_one_row_and_every_row_a_field():
    counts = collections.Counter(row.field for row in FLAGS if row.field is not None)
    assert [field for field, n in counts.items() if n > 1] == [], "a RunConfig field with several rows"
    assert set(FIELDS) - set(counts) == set(), "RunConfig fields without a flag row in dtrain_magic/flagtable.py"
    assert set(counts) - set(FIELDS) == set(), "flag rows whose field RunConfig does not have"
    assert {row.name for row in FLAGS if row.field is None and row.group != flagtable.SWEEP} == MAGIC_ONLY


def test_defaults_agree_with_runconfig_or_are_resolved():
    runconfig_defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    resolved = from_line("")
    for row in FLAGS:
        if row.field is None:
            continue
        if row.resolved:  # the parser's "not given"; config_from_args resolves it from the machine or other flags
            assert getattr(resolved, row.field) not in (None, "auto"), row.name
            assert row.default != runconfig_defaults[row.field], f"{row.name}: nothing to resolve, drop resolved=True"
        else:
            assert row.default == runconfig_defaults[row.field], row.name
            assert getattr(resolved, row.field) == row.default, row.name


def test_rows_are_well_formed():
    for row in FLAGS:
        assert row.kind in (VALUE, SWITCH, flagtable.STORE_TRUE, APPEND), row.name
        assert row.line in (flagtable.ALWAYS, flagtable.CHANGED, NEVER), row.name
        assert bool(row.off_options) == (row.kind == SWITCH), row.name
        assert row.field is not None or row.line == NEVER, row.name
        if row.panel is not None and row.panel.widget == flagtable.DROPDOWN:
            assert row.choices, row.name
    # a help group's rows stay together: the parser opens one argument group per run of rows
    runs = [group for i, group in enumerate(row.group for row in FLAGS) if i == 0 or FLAGS[i - 1].group != group]
    assert len(runs) == len(set(runs)), runs


def test_parser_is_built_from_the_table():
    actions = flags.distribute.parser._option_string_actions
    assert set(actions) == {option for row in FLAGS for option in row.all_options}
    for row in FLAGS:
        for option in row.options:
            action = actions[option]
            # a repeatable flag appends to argparse's list: its "not given" is None, RunConfig's default is empty
            default = None if row.kind == APPEND else row.default
            assert (action.dest, action.help, action.default) == (row.field or row.name[2:].replace("-", "_"),
                                                                   row.help, default), option
            assert action.choices == row.choices, option
        for option in row.off_options:
            off = actions[option]
            assert (off.dest, off.help, off.const) == (row.field, row.off_help, False), option
    for option in actions:
        assert option in flags.HELP, option


# -- flag lines ---------------------------------------------------------------------------------------

def test_every_field_has_round_trip_samples():
    missing = set(FIELDS) - set(ROUND_TRIP)
    assert not missing, f"add non-default samples for {sorted(missing)} to ROUND_TRIP in {__file__}"
    for row in FLAGS:
        if row.kind == VALUE and row.type is None and row.choices is None and row.field:
            assert row.field in FREE_TEXT or row.field in IDENTIFIERS, f"{row.name}: add it to FREE_TEXT or IDENTIFIERS"


@pytest.mark.parametrize("field, overrides", [(f, o) for f, samples in ROUND_TRIP.items() for o in samples],
                         ids=lambda v: repr(v)[:60] if isinstance(v, dict) else v)
def test_every_flag_round_trips_through_the_flag_line(field, overrides):
    row = flagtable.BY_FIELD[field]
    assert overrides[field] != row.default, "a sample must not be the flag's default"
    config = RunConfig(**overrides)
    line = config.flag_line()
    again = from_line(line)
    if row.line == NEVER:  # --dry-run: the equivalent line is the one that launches
        assert not set(line.split()) & set(row.all_options), line
        assert again == config.replace(**{field: row.default}), line
    else:
        assert again == config, line


def test_flag_line_follows_the_table_order():
    config = RunConfig(backend="ray", strategy="deepspeed", zero=3, precision="bf16", num_processes=3, grad_accum=4,
                       fn="t", result="r", experiment="my exp", seed=7, timeout=12.5, ray_address="127.0.0.1:6379",
                       max_restarts=2, storage="/tmp/s", deepspeed_config='{"a": 1}', micro_batch=8, train_batch=96)
    assert config.flag_line() == (
        "%%distribute --backend ray --strategy deepspeed --zero 3 --precision bf16 -n 3 --cpu --grad-accum 4 "
        "--seed 7 --timeout 12.5 --fn t --result r --experiment 'my exp' --no-ui --ray-address 127.0.0.1:6379 "
        "--max-restarts 2 --storage /tmp/s --deepspeed-config '{\"a\": 1}' --micro-batch 8 --train-batch 96")
    assert RunConfig().flag_line() == "%%distribute --backend local --strategy ddp --precision fp32 -n 2 --cpu --no-ui"


@pytest.mark.parametrize("field", sorted(FREE_TEXT))
def test_values_that_cannot_be_written_on_a_line_are_refused_naming_the_flag(field):
    flag = flagtable.BY_FIELD[field].name
    for text, why in [("a'b\"c", "both ' and \" quotes"), ("two\nlines", "line break"), ("cr\rhere", "line break"),
                      ("sep\u2028here", "line break")]:
        config = RunConfig(**{**FREE_TEXT[field], field: text})
        with pytest.raises(ConfigError, match=why) as info:
            config.flag_line()
        assert info.value.flag == flag


def test_quote_flag_value_leaves_plain_values_and_numbers_bare():
    assert quote_flag_value("--seed", -1) == "-1"  # argparse reads a negative number as a value
    assert quote_flag_value("--experiment", "plain") == "plain"
    assert quote_flag_value("--experiment", "-x") == "'-x'"
    assert quote_flag_value("--deepspeed-config", "ds.json", always=True) == "'ds.json'"


# -- generated docs -----------------------------------------------------------------------------------

def test_generated_docs_are_current():
    stale = [str(p.relative_to(REPO)) for p in flagdocs.stale_docs(REPO)]
    assert not stale, f"{stale} not generated from dtrain_magic/flagtable.py: run `.venv/bin/{flagdocs.DOCS_COMMAND}`"


def test_write_docs_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{flagdocs.README_BEGIN}\n| stale |\n{flagdocs.README_END}\nafter\n")
    assert flagdocs.main(["--check", "--root", str(tmp_path)]) == 1
    assert flagdocs.main(["--write-docs", "--root", str(tmp_path)]) == 0
    assert flagdocs.main(["--check", "--root", str(tmp_path)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\nbefore\n" + flagdocs.README_BEGIN)
    assert text.endswith(flagdocs.README_END + "\nafter\n")
    # the short table
    assert "| `--grad-accum N` |" in text and "| `--train-batch N` |" not in text and "| stale |" not in text
    assert (tmp_path / "docs" / "flags.md").read_text() == flagdocs.docs_page()
    assert flagdocs.write_docs(tmp_path) == []  # nothing to rewrite
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="BEGIN generated: flags"):
        flagdocs.write_docs(tmp_path)


def test_docs_list_every_flag():
    page = flagdocs.docs_page()
    for row in FLAGS:
        assert flagdocs.doc_flag(row) in page and (row.doc or row.help).replace("|", "\\|") in page, row.name
