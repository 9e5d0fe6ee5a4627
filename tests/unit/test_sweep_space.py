"""The sweep's space string → Optuna distributions, run options apart from ``ctx.params`` (sweep/space.py)."""

from __future__ import annotations

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from dtrain_magic.errors import ConfigError
from dtrain_magic.sweep.space import option_names, parse_space


def test_the_issue_example_parses_into_optunas_distributions():
    space = parse_space("lr=loguniform(1e-4,1e-1) batch=choice(16,32,64) zero=choice(2,3)")
    assert space.distributions == {"lr": FloatDistribution(1e-4, 1e-1, log=True),
                                   "batch": CategoricalDistribution([16, 32, 64]),
                                   "zero": CategoricalDistribution([2, 3])}
    assert space.split({"lr": 0.01, "batch": 32, "zero": 3}) == ({"zero": 3}, {"lr": 0.01, "batch": 32})
    assert not space.finite and space.size is None


def test_every_kind_and_value_form():
    space = parse_space(" a=uniform(-1, 1)  b=int(1,9,2) c=intuniform(0,3) d=grid(ddp, 'fsdp') "
                        "e=choice(true,none,0.5) ")
    d = space.distributions
    assert d["a"] == FloatDistribution(-1.0, 1.0)
    assert d["b"] == IntDistribution(1, 9, step=2) and d["c"] == IntDistribution(0, 3)
    assert d["d"].choices == ("ddp", "fsdp") and d["e"].choices == (True, None, 0.5)
    assert [dim.grid for dim in space.dimensions] == [False, False, False, True, False]


def test_run_option_names_come_from_the_flag_table_by_any_keyword():
    names = option_names()
    assert names["num_processes"] == names["num_workers"] == "num_processes"
    assert names["zero"] == "zero" and names["gpu"] == "use_gpu" and names["precision"] == "precision"
    space = parse_space("num_workers=grid(1,2) strategy=grid(ddp,fsdp) lr=grid(0.1,0.01)")
    assert space.split({"num_workers": 2, "strategy": "ddp", "lr": 0.1}) == (
        {"num_processes": 2, "strategy": "ddp"}, {"lr": 0.1})
    assert space.all_grid and space.finite and space.size == 8
    assert space.grid() == {"num_workers": [1, 2], "strategy": ["ddp", "fsdp"], "lr": [0.1, 0.01]}


def test_option_combinations_only_when_every_option_is_finite():
    space = parse_space("zero=choice(2,3) precision=grid(fp32,bf16) lr=loguniform(1e-3,1e-1)")
    assert list(space.option_combinations()) == [
        {"zero": 2, "precision": "fp32"}, {"zero": 2, "precision": "bf16"},
        {"zero": 3, "precision": "fp32"}, {"zero": 3, "precision": "bf16"}]
    assert parse_space("timeout=uniform(10,20)").option_combinations() is None
    assert list(parse_space("lr=uniform(0,1)").option_combinations()) == [{}]


@pytest.mark.parametrize("text, says", [
    ("", "give the space as NAME=KIND(ARGS)"),
    ("lr=loguniform(1e-4,1e-1) batch:choice(1,2)", "cannot read 'batch:choice(1,2)'"),
    ("lr=logunifrm(1e-4,1e-1)", "unknown kind 'logunifrm'; kinds: loguniform(lo,hi)"),
    ("lr=loguniform(0,1)", "loguniform needs lo > 0"),
    ("lr=uniform(1,0)", "needs lo < hi"),
    ("lr=uniform(1)", "needs (lo,hi)"),
    ("n=int(1,2.5)", "needs (lo,hi[,step]) of integers"),
    ("n=int(1,5,0)", "the step must be an integer >= 1"),
    ("b=choice()", "choice needs at least one value"),
    ("b=choice(1,1)", "a value is given twice"),
    ("b=choice(1,,2)", "an empty value between commas"),
    ("b=choice([1],2)", "is not a number or a word"),
    ("lr=uniform(0,1) lr=uniform(0,2)", "lr is given twice"),
    ("num_processes=choice(1,2) num_workers=choice(2,4)", "num_processes and num_workers set the same run option"),
    ("backend=choice(local,ray)", "backend cannot vary between trials: a sweep runs every trial on one backend"),
    ("experiment=choice(a,b)", "cannot vary between trials"),
])
def test_a_bad_space_is_one_line_naming_the_word_and_what_is_allowed(text, says):
    with pytest.raises(ConfigError) as info:
        parse_space(text)
    assert info.value.flag == "--sweep"
    assert says in str(info.value)
    assert len(str(info.value).splitlines()) == 1
