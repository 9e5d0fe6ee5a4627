"""Every broad handler in dtrain_magic/ (``except Exception``, ``except BaseException``, a bare ``except:``) re-raises,
logs what it drops, or says on its ``except`` line why it must be broad (issue #35): an error nobody sees is how a
user's mistake or a lost metric goes unnoticed."""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import dtrain_magic

BROAD = {"Exception", "BaseException"}
LOGGING = {"log_dropped", "debug", "info", "warning", "error", "exception", "critical", "log", "warn"}


def _caught(node: ast.expr | None) -> set[str]:
    if node is None:
        return {"BaseException"}  # a bare except
    if isinstance(node, ast.Tuple):
        return set().union(*(_caught(item) for item in node.elts))
    if isinstance(node, ast.Name):
        return {node.id}
    return {node.attr} if isinstance(node, ast.Attribute) else set()


def _called(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in (n for statement in body for n in ast.walk(statement)):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def _comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {token.start[0] for token in tokens if token.type == tokenize.COMMENT}


def unexplained(source: str) -> list[int]:
    """The lines of the broad handlers in ``source`` that neither raise, nor log, nor carry a comment."""
    commented = _comment_lines(source)
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler) or not _caught(node.type) & BROAD:
            continue
        raises = any(isinstance(n, ast.Raise) for statement in node.body for n in ast.walk(statement))
        if not (raises or _called(node.body) & LOGGING or node.lineno in commented):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_a_silent_handler_and_accepts_the_three_ways_out():
    silent = "try:\n    f()\nexcept Exception:\n    pass\ntry:\n    g()\nexcept:\n    return_value = 1\n"
    assert unexplained(silent) == [3, 7]
    accepted = (
        "try:\n    f()\nexcept Exception:\n    raise\n"
        "try:\n    f()\nexcept BaseException as exc:\n    log_dropped(__name__, 'f', exc)\n"
        "try:\n    f()\nexcept (OSError, Exception):\n    logger.warning('lost')\n"
        "try:\n    f()\nexcept Exception:  # a probe: the caller falls back\n    pass\n"
        "try:\n    f()\nexcept OSError:\n    pass\n"
    )
    assert unexplained(accepted) == []


def test_no_broad_handler_in_the_package_drops_an_error_without_a_word():
    root = pathlib.Path(dtrain_magic.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{line}"
        for path in sorted(root.rglob("*.py"))
        for line in unexplained(path.read_text(encoding="utf-8"))
    ]
    assert not found, "broad except without a re-raise, a log call or a comment saying why:\n" + "\n".join(found)
