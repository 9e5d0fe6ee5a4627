"""cloudpickle's private parts, written against cloudpickle 3.1 (constraints.txt: 3.1.3).

- `code_reducer` (``capture.py``, pickling the cell's function): cloudpickle's own reducer for code objects
  (``_code_reduce``, found in its ``Pickler.dispatch_table``); the magic's pickler calls it, then puts the code's
  file name back (cloudpickle writes ``<dynamic-code>``). **Required** (`check`, when ``capture`` starts, before the
  cell runs): without it a worker's traceback cannot show the cell's own lines. An opted-in version without it
  pickles as plain cloudpickle does (tracebacks then name ``<dynamic-code>``).

Workers unpickle with plain ``cloudpickle.loads``: nothing private there.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from . import Library

CLOUDPICKLE = Library(key="cloudpickle", title="cloudpickle", module="cloudpickle", known=("3.1",), tested="3.1.3",
                      requirement="cloudpickle==3.1.3")


def check() -> None:
    """Before the cell is captured: a known cloudpickle, or the opt-in. Raises `UnsupportedVersionError`."""
    CLOUDPICKLE.require("its reducer of code objects, so a worker's traceback shows the cell's own lines")


def code_reducer() -> Callable[[types.CodeType], tuple[Callable[..., types.CodeType], tuple[Any, ...]]] | None:
    """cloudpickle's ``(rebuild, args)`` reducer for code objects; None when this cloudpickle has none."""
    import cloudpickle

    reducer = getattr(cloudpickle.Pickler, "dispatch_table", {}).get(types.CodeType)
    return reducer if callable(reducer) else None
