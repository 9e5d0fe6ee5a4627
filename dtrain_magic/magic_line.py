"""A magic's line as people write it: flags, then perhaps a ``#`` comment (``-n 4   # one per GPU``), read alike by
every magic of dtrain_magic (IPython hands a magic the line as typed, comment and all)."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar


def strip_comment(line: str) -> str:
    """``line`` without its ``#`` comment: a ``#`` that starts a word outside quotes, to the end of the line (as a
    shell reads it). People annotate flags on the line (``-n 4   # one per GPU``); a quoted ``'#'`` or a ``#``
    inside a word (``--experiment run#2``) is kept."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


_Magic = TypeVar("_Magic", bound=Callable[..., Any])


def takes_comments(magic: _Magic) -> _Magic:
    """Decorate a magic method (under IPython's ``@line_magic``/``@cell_magic``) so its line loses its ``#`` comment
    before anything reads it: every magic of dtrain_magic reads its line the same way."""
    @functools.wraps(magic)
    def wrapper(self: Any, line: str, *rest: Any) -> Any:
        return magic(self, strip_comment(line), *rest)

    return wrapper  # type: ignore[return-value]
