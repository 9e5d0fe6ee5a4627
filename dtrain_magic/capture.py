"""Capture the cell's training function and ship it by value.

The cell runs in the notebook first (so imports and helpers exist there), compiled under a file name
IPython keeps in ``linecache`` and padded so line numbers are the cell's own (line 1 is the
``%%distribute`` line). The chosen function is pickled by value with cloudpickle, together with what
it uses from the notebook's namespace, and with the source of every notebook cell it refers to so a
worker's traceback can show the cell's lines.
"""

from __future__ import annotations

import ast
import inspect
import io
import linecache
import types
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from .errors import CaptureError
from .tracebacks import short_traceback, summary


@dataclass(frozen=True)
class Payload:
    """What travels to every worker: the pickled function and the source of the cells it came from."""

    function_bytes: bytes
    name: str
    takes_ctx: bool
    sources: dict[str, list[str]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # cell file name -> "Cell In[N]"

    def load(self) -> Callable[..., Any]:
        """Unpickle the function (in the worker) and make the cells' source visible to tracebacks."""
        for filename, lines in self.sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
        return cloudpickle.loads(self.function_bytes)


def _rebuild_code(rebuild: Callable[..., types.CodeType], args: tuple, filename: str) -> types.CodeType:
    return rebuild(*args).replace(co_filename=filename)


def _code_reduce_keeping_filename(code: types.CodeType) -> tuple:
    rebuild, args = cloudpickle.cloudpickle._code_reduce(code)
    return _rebuild_code, (rebuild, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects keep their file name (cloudpickle writes "<dynamic-code>"),
    so a worker's traceback can point at the notebook cell the function came from."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any) -> bytes:
    """cloudpickle.dumps, keeping code objects' file names."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def last_function_name(cell: str) -> str | None:
    """Name of the last top-level ``def`` in the cell source, or None."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return None
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return names[-1] if names else None


def run_cell(cell: str, namespace: dict, shell: Any = None) -> str:
    """Execute the cell body in ``namespace``, returning the file name its code was compiled under.

    A blank first line stands for the ``%%distribute`` line so tracebacks use the cell's line numbers.
    """
    source = "\n" + cell
    if shell is not None and hasattr(shell, "compile"):
        filename = shell.compile.cache(source, getattr(shell, "execution_count", 0))
    else:
        filename = f"<distribute-cell-{abs(hash(source)):x}>"
        linecache.cache[filename] = (len(source), None, [ln + "\n" for ln in source.splitlines()], filename)
    try:
        code = compile(source, filename, "exec")
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


def select_function(cell: str, namespace: dict, fn_name: str | None) -> Callable[..., Any]:
    """The function named by ``--fn``, else the last top-level ``def`` of the cell."""
    name = fn_name or last_function_name(cell)
    if name is None:
        raise CaptureError(
            "the cell defines no function to run. Define one, e.g. `def train(ctx): ...`, "
            "or name a function from an earlier cell with --fn NAME"
        )
    if name not in namespace:
        known = sorted(k for k, v in namespace.items() if inspect.isfunction(v) and not k.startswith("_"))
        raise CaptureError(
            f"--fn {name}: no function of that name in the notebook; functions defined: {', '.join(known) or 'none'}"
        )
    fn = namespace[name]
    if not callable(fn):
        raise CaptureError(f"--fn {name}: {name} is a {type(fn).__name__}, not a function")
    return fn


def takes_context(fn: Callable[..., Any]) -> bool:
    """True if ``fn`` is called as ``fn(ctx)``, False for ``fn()``; any other signature is an error."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    required = [
        p for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if any(p.kind == p.KEYWORD_ONLY for p in required) or len(required) > 1:
        raise CaptureError(
            f"{name}{sig}: the training function must take one parameter (ctx) or none; "
            f"it requires {', '.join(p.name for p in required)}"
        )
    return bool(required) or bool(positional) or has_varargs


def _notebook_sources(fn: Callable[..., Any], extra: tuple[str, ...]) -> dict[str, list[str]]:
    """Source lines of the notebook cells the function (and the cell) were compiled from.

    Every in-memory cell IPython keeps is included, so helpers from earlier cells show their lines too.
    """
    files = set(extra) | {name for name in linecache.cache if _is_cell_file(name)}
    code = getattr(fn, "__code__", None)
    if code is not None:
        files.add(code.co_filename)
    sources = {}
    for filename in files:
        entry = linecache.cache.get(filename)
        if entry and entry[1] is None:  # in-memory source (a notebook cell), absent on workers
            sources[filename] = list(entry[2])
    return sources


def _is_cell_file(filename: str) -> bool:
    return filename.startswith("<ipython-input-") or filename.startswith("<distribute-cell-") or (
        "ipykernel_" in filename and filename.endswith(".py")
    )


def cell_labels(shell: Any) -> dict[str, str]:
    """IPython's map of cell file names to ``Cell In[N]`` labels (what its own tracebacks show)."""
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    return {name: f"Cell In[{number}]" for name, number in mapping.items()}


def serialize(fn: Callable[..., Any], cell_files: tuple[str, ...] = (), labels: dict[str, str] | None = None) -> Payload:
    """Pickle ``fn`` by value; an object that cannot be pickled is named in the error."""
    takes_ctx = takes_context(fn)
    module = getattr(fn, "__module__", None)
    registered = None
    if module and module not in ("__main__", "builtins") and inspect.getmodule(fn) is not None:
        # A function from an importable module would be pickled by reference and fail on workers
        # that lack the module: ship that module by value too.
        mod = inspect.getmodule(fn)
        if mod is not None and not _is_installed(mod):
            cloudpickle.register_pickle_by_value(mod)
            registered = mod
    try:
        data = dumps(fn)
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        raise CaptureError(_unpicklable_message(fn, exc)) from None
    finally:
        if registered is not None:
            cloudpickle.unregister_pickle_by_value(registered)
    return Payload(data, getattr(fn, "__name__", "fn"), takes_ctx, _notebook_sources(fn, cell_files), labels or {})


def _is_installed(module: Any) -> bool:
    path = getattr(module, "__file__", "") or ""
    return "site-packages" in path or "dist-packages" in path or not path


def _unpicklable_message(fn: Callable[..., Any], exc: Exception) -> str:
    culprit = _find_unpicklable_global(fn)
    why = f"{type(exc).__name__}: {exc}"
    if culprit:
        name, obj = culprit
        return (
            f"cannot ship {fn.__name__} to the workers: it uses `{name}` ({type(obj).__name__}), which cannot be "
            f"pickled ({why}). Create it inside the function instead, so each worker builds its own."
        )
    return f"cannot ship {getattr(fn, '__name__', fn)} to the workers: it cannot be pickled ({why})"


def _find_unpicklable_global(fn: Callable[..., Any]) -> tuple[str, Any] | None:
    try:
        closure = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return None
    for name, obj in {**closure.globals, **closure.nonlocals}.items():
        try:
            cloudpickle.dumps(obj)
        except Exception:
            return name, obj
    return None


def capture(cell: str, namespace: dict, fn_name: str | None = None, shell: Any = None) -> tuple[Payload, Callable]:
    """Run the cell in the notebook, choose its function and serialize it."""
    filename = run_cell(cell, namespace, shell)
    fn = select_function(cell, namespace, fn_name)
    return serialize(fn, (filename,), cell_labels(shell)), fn
