"""Choosing and shipping the cell's function (pure logic: no workers are started here)."""

import threading

import cloudpickle
import pytest

from dtrain_magic.errors import CaptureError
from dtrain_magic.notebook.capture import capture, last_function_name
from dtrain_magic.payload import Payload, serialize, takes_context


def test_last_top_level_def_is_chosen():
    cell = ("def helper(x):\n    return x\n\nclass A:\n    def method(self): pass\n\n"
            "def train(ctx):\n    def inner(): pass\n")
    assert last_function_name(cell) == "train"
    assert last_function_name("x = 1") is None


def test_capture_runs_cell_and_ships_function_with_notebook_globals():
    ns = {}
    exec("SCALE = 3\nclass Box:\n    def __init__(self, v): self.v = v\n"
         "def helper(v):\n    return Box(v * SCALE)\n", ns)
    payload, fn = capture("def train(ctx):\n    return helper(ctx).v\n", ns)
    assert payload.name == "train" and payload.takes_ctx
    shipped = Payload(payload.function_bytes, payload.name, payload.takes_ctx).load()
    assert shipped(2) == 6  # helper, Box and SCALE travelled by value


def test_fn_flag_selects_a_function_from_an_earlier_cell():
    ns = {}
    exec("def earlier():\n    return 42\n", ns)
    payload, _ = capture("x = 1\n", ns, fn_name="earlier")
    assert payload.load()() == 42 and payload.takes_ctx is False


def test_fn_that_names_nothing_lists_known_functions():
    ns = {}
    with pytest.raises(CaptureError, match=r"--fn nope: no function of that name.*train"):
        capture("def train(ctx): pass\n", ns, fn_name="nope")


def test_fn_lists_the_notebooks_own_functions_not_ipythons_or_imported_ones():
    import os.path

    ns = {"__name__": "__main__", "open": open, "join": os.path.join, "_hidden": lambda: 0}
    exec("def helper():\n    pass\n", ns)  # an earlier cell's function
    with pytest.raises(CaptureError, match=r"functions defined: helper, train$"):
        capture("def train(ctx): pass\n", ns, fn_name="nothere")


def test_cell_without_function_is_a_clear_error():
    with pytest.raises(CaptureError, match="defines no function"):
        capture("x = 1\n", {})


def test_cell_that_raises_reports_cell_line_numbers():
    with pytest.raises(CaptureError) as info:
        capture("import math\n\nraise RuntimeError('bad cell')\n", {})
    text = str(info.value)
    assert "bad cell" in text and "before anything was launched" in text
    assert "line 4" in text  # line 1 is the %%distribute line, so the raise is on the cell's line 4


def test_syntax_error_is_a_clear_error():
    with pytest.raises(CaptureError, match="syntax error at line 2"):
        capture("def train(ctx)\n    pass\n", {})


@pytest.mark.parametrize(
    "source, expected",
    [("def f(ctx): pass", True), ("def f(): pass", False), ("def f(ctx=None): pass", True), ("def f(*a): pass", True)],
)
def test_signatures_that_work(source, expected):
    ns = {}
    exec(source, ns)
    assert takes_context(ns["f"]) is expected


@pytest.mark.parametrize("source", ["def f(a, b): pass", "def f(*, key): pass"])
def test_wrong_signature_is_a_clear_error(source):
    ns = {}
    exec(source, ns)
    with pytest.raises(CaptureError, match="one parameter"):
        takes_context(ns["f"])


def test_unpicklable_global_is_named():
    ns = {"LOCK": threading.Lock()}
    exec("def train(ctx):\n    with LOCK:\n        return 1\n", ns)
    with pytest.raises(CaptureError) as info:
        serialize(ns["train"])
    assert "`LOCK`" in str(info.value) and "lock" in str(info.value).lower()
    assert "inside the function" in str(info.value)


def test_code_keeps_its_cell_file_name_for_tracebacks():
    ns = {}
    payload, _ = capture("def train(ctx):\n    return 1\n", ns)
    fn = cloudpickle.loads(payload.function_bytes)
    assert fn.__code__.co_filename.startswith("<distribute-cell-")
    assert fn.__code__.co_filename in payload.sources
