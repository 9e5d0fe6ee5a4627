"""Capture the cell's training function and ship it by value.

The cell runs in the notebook first (so imports and helpers exist there), compiled under a file name
IPython keeps in ``linecache`` and padded so line numbers are the cell's own (line 1 is the
``%%distribute`` line). The chosen function is pickled by value with cloudpickle, together with what
it uses from the notebook's namespace, and with the source of every notebook cell it refers to so a
worker's traceback can show the cell's lines.

The call form: a cell whose last statement calls the function to ship, ``train(1e-3, use_gpu=False)``,
runs it with those arguments on every worker, as ``TorchDistributor.run(train, 1e-3, use_gpu=False)``
would. That last statement is never run in the notebook; its arguments are evaluated there (after the
rest of the cell), checked against the function's signature and pickled; the bare name ``ctx`` as an
argument stands for the worker's `TrainContext`. It applies when the called name is the ``--fn`` name, the
cell's last top-level ``def``, a name the cell imports (``from my_project.train import fit`` then
``fit("out.pt")``: how most projects keep their code), or (in a cell with no ``def``) a function from earlier
cells.
"""

from __future__ import annotations

import ast
import inspect
import linecache
from typing import Any, Callable

from .._compat import cloudpickle as cloudpickle_compat
from ..config import RunConfig
from ..errors import CaptureError, short_traceback, summary
from ..payload import CTX, CallForm, Payload, serialize


def last_function_name(cell: str) -> str | None:
    """Name of the last top-level ``def`` in the cell source, or None."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return None
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return names[-1] if names else None


def run_cell(cell: str, namespace: dict, shell: Any = None, drop_last: bool = False) -> str:
    """Execute the cell body in ``namespace``, returning the file name its code was compiled under.

    A blank first line stands for the ``%%distribute`` line so tracebacks use the cell's line numbers.
    ``drop_last``: do not run the last statement (the call form's call, which runs on the workers).
    """
    source = "\n" + cell
    if shell is not None and hasattr(shell, "compile"):
        filename = shell.compile.cache(source, cell_number(shell))
    else:
        filename = f"<distribute-cell-{abs(hash(source)):x}>"
        linecache.cache[filename] = (len(source), None, [ln + "\n" for ln in source.splitlines()], filename)
    try:
        tree = ast.parse(source, filename)
        if drop_last and tree.body:
            tree.body = tree.body[:-1]
        code = compile(tree, filename, "exec")
    except SyntaxError as exc:
        raise CaptureError(f"the cell has a syntax error at line {exc.lineno}: {exc.msg}") from None
    try:
        exec(code, namespace)
    except Exception as exc:
        labels = cell_labels(shell)
        raise CaptureError(
            f"the cell raised while running in the notebook, before anything was launched: {summary(exc)}\n\n"
            + short_traceback(exc, labels)
        ) from None
    return filename


def cell_number(shell: Any) -> int:
    """The number of the cell running now (its ``In[N]``). IPython 9 counts the cell before running it, so its
    ``execution_count`` is already the next cell's; the input history holds the current cell as its last entry
    (entry 0 is empty) whichever IPython it is."""
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history:
        return len(history) - 1
    return getattr(shell, "execution_count", 0)


def _functions_defined(namespace: dict) -> str:
    """"functions defined: a, b": the notebook's own functions (defined in its cells), not IPython's (``open``) or
    what was imported by name."""
    module = namespace.get("__name__")
    known = sorted(name for name, value in namespace.items()
                   if inspect.isfunction(value) and not name.startswith("_") and value.__module__ == module)
    return f"functions defined: {', '.join(known) or 'none'}"


def select_function(cell: str, namespace: dict, fn_name: str | None) -> Callable[..., Any]:
    """The function named by ``--fn``, else the last top-level ``def`` of the cell."""
    name = fn_name or last_function_name(cell)
    if name is None:
        raise CaptureError(
            "the cell defines no function to run. Define one, e.g. `def train(ctx): ...`, "
            "or name a function from an earlier cell with --fn NAME"
        )
    if name not in namespace:
        raise CaptureError(f"--fn {name}: no function of that name in the notebook; {_functions_defined(namespace)}")
    fn = namespace[name]
    if not callable(fn):
        raise CaptureError(f"--fn {name}: {name} is a {type(fn).__name__}, not a function")
    return fn


def cell_labels(shell: Any) -> dict[str, str]:
    """The ``Cell In[N]`` label IPython's own tracebacks show for each cell file it compiled (its public
    ``CachingCompiler.format_code_name``); empty without a shell."""
    format_code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if format_code_name is None:
        return {}
    labels = {}
    for name in list(linecache.cache):
        label = format_code_name(name)
        if label:
            labels[name] = " ".join(label)
    return labels


def payload_maker(cell: str, shell: Any) -> Callable[[RunConfig], Payload]:
    """What the ``--configure`` panel's Run calls (on the kernel's thread): ``cell`` captured for the config."""
    return lambda config: capture(cell, shell.user_ns, config.fn, shell)[0]


def capture(cell: str, namespace: dict, fn_name: str | None = None, shell: Any = None) -> tuple[Payload, Callable]:
    """Run the cell in the notebook, choose its function and serialize it (with the call form's
    arguments when the cell ends with a call of it)."""
    cloudpickle_compat.check()  # before the cell runs: a cloudpickle whose code reducer we know
    call_node = call_statement(cell, namespace, fn_name)
    filename = run_cell(cell, namespace, shell, drop_last=call_node is not None)
    if call_node is None:
        fn = select_function(cell, namespace, fn_name)
        return serialize(fn, (filename,), cell_labels(shell)), fn
    name = call_node.func.id  # type: ignore[attr-defined]
    fn = select_function(cell, namespace, name)
    call = evaluate_call(call_node, cell, fn, namespace)
    return serialize(fn, (filename,), cell_labels(shell), call), fn


def call_statement(cell: str, namespace: dict, fn_name: str | None = None) -> ast.Call | None:
    """The cell's last statement when it is the call form (see the module's docstring), else None."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return None  # run_cell reports it
    if not tree.body:
        return None
    last = tree.body[-1]
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)):
        return None
    name = last.value.func.id
    defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if fn_name is not None:
        return last.value if name == fn_name else None
    if (defs and name == defs[-1]) or name in imported_names(tree):
        return last.value
    if not defs and inspect.isfunction(namespace.get(name)):
        return last.value
    return None


def imported_names(tree: ast.Module) -> set[str]:
    """The names the cell's top-level imports bind (``from my_project.train import fit`` → ``fit``)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.partition(".")[0] for alias in node.names)
    return names


def evaluate_call(node: ast.Call, cell: str, fn: Callable[..., Any], namespace: dict) -> CallForm:
    """Evaluate the call's arguments in the notebook (``ctx`` stands for the worker's context) and check
    them against ``fn``'s signature, so a wrong call fails before anything is launched."""
    text = ast.get_source_segment(cell, node) or ast.unparse(node)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}

    def value(expr: ast.expr) -> Any:
        if isinstance(expr, ast.Name) and expr.id == "ctx":
            return CTX
        source = ast.get_source_segment(cell, expr) or ast.unparse(expr)
        try:
            return eval(compile(ast.Expression(expr), "<distribute-call>", "eval"), namespace)
        except Exception as exc:
            hint = " (ctx can be passed only as a bare argument, `ctx`)" if "ctx" in source else ""
            raise CaptureError(f"{text}: evaluating the argument `{source}` failed: {summary(exc)}{hint}") from None

    for arg in node.args:
        if isinstance(arg, ast.Starred):
            args.extend(value(arg.value))
        else:
            args.append(value(arg))
    for keyword in node.keywords:
        if keyword.arg is None:
            kwargs.update(value(keyword.value))
        else:
            kwargs[keyword.arg] = value(keyword.value)
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(
            f"{text}: the arguments do not fit {getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}: {exc}; "
            "nothing was launched"
        ) from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    takes_ctx = any(a is CTX for a in args) or any(v is CTX for v in kwargs.values())
    return CallForm(text, tuple(args), kwargs, takes_ctx)
