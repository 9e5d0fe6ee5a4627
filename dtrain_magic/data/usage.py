"""The data names a function reads with ``ctx.data("name", ...)`` (a literal name), found in its bytecode, so a
name the run does not give is an error before launch rather than on every rank after it."""

from __future__ import annotations

import dis
import types
from typing import Any, Callable

_LOADS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")


def names_read(fn: Callable[..., Any]) -> tuple[str, ...]:
    """``("train", "val")`` for a function that calls ``ctx.data("train", ...)`` and ``ctx.data("val")``: calls on
    a name ``ctx`` or on the function's first parameter, in it and the functions defined inside it."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    first = code.co_varnames[0] if code.co_argcount else None
    holders = {"ctx"} | ({first} if first else set())
    found: list[str] = []
    for each in _code_objects(code):
        previous: list[dis.Instruction] = []
        for instruction in dis.get_instructions(each):
            if (len(previous) >= 2 and instruction.opname == "LOAD_CONST" and isinstance(instruction.argval, str)
                    and previous[-1].opname in ("LOAD_ATTR", "LOAD_METHOD") and previous[-1].argval == "data"
                    and previous[-2].opname in _LOADS and previous[-2].argval in holders):
                found.append(instruction.argval)
            previous = (previous + [instruction])[-2:]
    return tuple(dict.fromkeys(found))


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)
