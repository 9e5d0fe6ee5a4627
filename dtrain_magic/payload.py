"""What travels to every worker: the training function pickled by value, with its arguments (`Payload`).

The function is pickled with cloudpickle, together with what it uses from the notebook's namespace (or
its own module, when that module is not installed on the workers), and with the source of every notebook
cell it refers to, so a worker's traceback can show the cell's lines. Code objects keep their file name
(cloudpickle writes ``<dynamic-code>``). The call form's arguments travel pickled beside it, the bare
``ctx`` standing for the worker's `TrainContext` (`CTX`). Every entry point makes its payload here: the
notebook's cell (`dtrain_magic.notebook.capture`), `dtrain_magic.run` and the command line.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import linecache
import textwrap
import types
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from ._compat import cloudpickle as cloudpickle_compat
from .data.usage import names_read
from .errors import CaptureError, log_dropped


@dataclass(frozen=True)
class Payload:
    """What travels to every worker: the pickled function and the source of the cells it came from."""

    function_bytes: bytes
    name: str
    takes_ctx: bool
    sources: dict[str, list[str]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # cell file name -> "Cell In[N]"
    call_args: bytes | None = None  # the call form's pickled (args, kwargs), `CTX` standing for ctx
    call_text: str | None = None  # the call as written in the cell, e.g. "train(1e-3, use_gpu=False)"
    uses_ray_train: bool = False  # the function (or a notebook helper it calls) refers to ray.train
    argv: tuple[str, ...] | None = None  # sys.argv on the workers while the function runs (the command line's)
    data_names: tuple[str, ...] = ()  # the data names the function reads with ctx.data("...") (checked before launch)
    # The function's identity across kernels (`function_key`): its name and a digest of its source. The MLflow run's
    # ``dtrain_magic.function`` tag, by which ``--resume`` finds this cell's last unfinished run after a restart.
    function_key: str = ""

    def load(self) -> Callable[..., Any]:
        """Unpickle the function (in the worker) and make the cells' source visible to tracebacks.

        With the call form, the result is the function bound to the cell's arguments, called as
        ``fn(ctx)`` when ``ctx`` is one of them (``takes_ctx``), else ``fn()``."""
        for filename, lines in self.sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
        fn = cloudpickle.loads(self.function_bytes)
        if self.call_args is None:
            return fn
        args, kwargs = cloudpickle.loads(self.call_args)
        return BoundCall(fn, tuple(args), dict(kwargs))


class _CtxPlaceholder:
    """Stands for the worker's ``ctx`` among the call form's arguments (pickled by reference)."""

    def __reduce__(self) -> str:
        return "CTX"

    def __repr__(self) -> str:
        return "ctx"


CTX = _CtxPlaceholder()


class BoundCall:
    """The shipped function with the cell's arguments; ``CTX`` among them becomes the worker's ctx."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.__name__ = getattr(fn, "__name__", "fn")

    def __call__(self, ctx: Any = None) -> Any:
        args = [ctx if a is CTX else a for a in self.args]
        kwargs = {k: ctx if v is CTX else v for k, v in self.kwargs.items()}
        return self.fn(*args, **kwargs)


class ScriptMain:
    """A whole script run as ``__main__`` on every worker (``python -m dtrain_magic run train.py -- ARGS``), the way
    torchrun runs one: its source travels, so a worker on another host needs no copy of the file."""

    def __init__(self, source: str, filename: str):
        self.source, self.filename = source, filename
        self.__name__ = filename

    def __call__(self) -> None:
        import builtins

        code = compile(self.source, self.filename, "exec")
        exec(code, {"__name__": "__main__", "__file__": self.filename, "__builtins__": builtins})


def _rebuild_code(rebuild: Callable[..., types.CodeType], args: tuple, filename: str) -> types.CodeType:
    return rebuild(*args).replace(co_filename=filename)


def _code_reduce_keeping_filename(reduce: Callable[[types.CodeType], tuple], code: types.CodeType) -> tuple:
    rebuild, args = reduce(code)
    return _rebuild_code, (rebuild, args, code.co_filename)


@functools.lru_cache(maxsize=None)
def _pickler_class() -> type:
    """cloudpickle's Pickler, except that code objects keep their file name (cloudpickle writes
    "<dynamic-code>"), so a worker's traceback can point at the notebook cell the function came from."""
    reduce = cloudpickle_compat.code_reducer()
    ours = {types.CodeType: functools.partial(_code_reduce_keeping_filename, reduce)} if reduce else {}
    table = ChainMap(ours, cloudpickle.Pickler.dispatch_table)
    return type("_Pickler", (cloudpickle.Pickler,), {"dispatch_table": table})


def dumps(obj: Any) -> bytes:
    """cloudpickle.dumps, keeping code objects' file names."""
    buffer = io.BytesIO()
    _pickler_class()(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


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
            f"it requires {', '.join(p.name for p in required)}. To pass arguments, end the cell with the "
            f"call, e.g. `{name}({', '.join(p.name for p in required)})`"
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


def serialize(
    fn: Callable[..., Any],
    cell_files: tuple[str, ...] = (),
    labels: dict[str, str] | None = None,
    call: "CallForm | None" = None,
    argv: tuple[str, ...] | None = None,
) -> Payload:
    """Pickle ``fn`` by value (and the call form's arguments); an object that cannot be pickled is named."""
    takes_ctx = takes_context(fn) if call is None else call.takes_ctx
    call_args = None if call is None else _pickle_arguments(call)
    try:
        data = dumps_by_value(fn)
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        raise CaptureError(_unpicklable_message(fn, exc)) from None
    return Payload(
        data, getattr(fn, "__name__", "fn"), takes_ctx, _notebook_sources(fn, cell_files), labels or {},
        call_args=call_args, call_text=None if call is None else call.text, uses_ray_train=refers_to_ray_train(fn),
        argv=argv, data_names=names_read(fn), function_key=function_key(fn),
    )


def function_key(fn: Callable[..., Any]) -> str:
    """``NAME:DIGEST``: the function's name and the first 16 hex digits of the SHA-256 of its source (dedented; its
    code's bytes and constants when the source is not to be had). The same in a new kernel as long as the function's
    text is the same: a cell's file name and the pickled bytes change with every kernel, this does not."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "fn")
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):  # no source (a lambda built by exec, a C function): what the code itself is
        code = getattr(fn, "__code__", None)
        text = repr((code.co_code, code.co_consts, code.co_names)) if code is not None else repr(fn)
    return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def dumps_by_value(obj: Any) -> bytes:
    """`dumps`, with ``obj``'s own module pickled by value when the workers may lack it: a function or class from an
    importable module would be pickled by reference and fail on a worker without that module (the notebook's
    project, a test file). Installed libraries and dtrain_magic itself, which every worker imports, stay by
    reference."""
    module = getattr(obj, "__module__", None)
    ours = module == __package__ or (module or "").startswith(__package__ + ".")
    mod = inspect.getmodule(obj) if module and module not in ("__main__", "builtins") and not ours else None
    if mod is None or _is_installed(mod):
        return dumps(obj)
    cloudpickle.register_pickle_by_value(mod)
    try:
        return dumps(obj)
    finally:
        cloudpickle.unregister_pickle_by_value(mod)


def _is_installed(module: Any) -> bool:
    path = getattr(module, "__file__", "") or ""
    return "site-packages" in path or "dist-packages" in path or not path


def _unpicklable_message(fn: Callable[..., Any], exc: Exception) -> str:
    culprit = _find_unpicklable_global(fn)
    why = f"{type(exc).__name__}: {exc}"
    if culprit:
        name, obj = culprit
        if _is_data_source(obj):
            return (
                f"cannot ship {fn.__name__} to the workers: it uses `{name}` ({type(obj).__name__}), which cannot be "
                f"pickled ({why}). Hand it to the run as data instead: add `--data {name}={name}` to the %%distribute "
                f"line (dtrain_magic.run(..., data={{{name!r}: {name}}})) and read this rank's share inside the "
                f"function with `ctx.data({name!r}, batch_size=...)`: each rank reads only its part, nothing is "
                "collected to the notebook (docs/data.md)."
            )
        return (
            f"cannot ship {fn.__name__} to the workers: it uses `{name}` ({type(obj).__name__}), which cannot be "
            f"pickled ({why}). Create it inside the function instead, so each worker builds its own."
        )
    return f"cannot ship {getattr(fn, '__name__', fn)} to the workers: it cannot be pickled ({why})"


def _is_data_source(obj: Any) -> bool:
    """A Spark DataFrame (or another distributed dataset) no worker can rebuild from a pickle."""
    module = type(obj).__module__ or ""
    return type(obj).__name__ == "DataFrame" and module.startswith("pyspark.sql")


def _find_unpicklable_global(fn: Callable[..., Any]) -> tuple[str, Any] | None:
    try:
        closure = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return None
    for name, obj in {**closure.globals, **closure.nonlocals}.items():
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:  # whatever pickling raises, this global is the culprit: the caller names it
            log_dropped(__name__, "_find_unpicklable_global", exc)
            return name, obj
    return None


# -- the call form ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallForm:
    """The cell's last line ``fn(args...)``, its arguments evaluated in the notebook."""

    text: str
    args: tuple
    kwargs: dict
    takes_ctx: bool


def _pickle_arguments(call: CallForm) -> bytes:
    try:
        return dumps((call.args, call.kwargs))
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, RecursionError...: find which one fails
        together = exc
    named = [(f"argument {i + 1}", a) for i, a in enumerate(call.args)] + [(k, v) for k, v in call.kwargs.items()]
    for label, obj in named:
        try:
            dumps(obj)
        except Exception as exc:
            raise CaptureError(
                f"{call.text}: the {label} ({type(obj).__name__}) cannot be pickled to send it to the workers "
                f"({type(exc).__name__}: {exc}); pass something that can (data, paths, numbers), or build it "
                "inside the function"
            ) from None
    raise CaptureError(f"{call.text}: the arguments cannot be pickled to send them to the workers "
                       f"({type(together).__name__}: {together})")


# -- which backend a function needs -------------------------------------------------------------------


def refers_to_ray_train(fn: Callable[..., Any], _seen: set | None = None) -> bool:
    """True when ``fn`` (or a notebook function it uses, or one defined inside it) refers to ``ray.train``:
    ``ray.train.report(...)``, ``from ray.train import ...``, ``import ray.train.torch``, or a global
    bound to ray.train's module or functions. Such a Ray Train loop runs only under ``--backend ray``."""
    seen = set() if _seen is None else _seen
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    globals_ = getattr(fn, "__globals__", {}) or {}
    closure = {}
    try:
        closure = dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        pass
    for each in _code_objects(code):
        names = each.co_names
        if any(n == "ray.train" or n.startswith("ray.train.") for n in names):
            return True  # import ray.train / from ray.train import ...
        if _loads_ray_dot_train(each, closure, globals_):
            return True  # ray.train.<x> through `import ray`
        for name in names:
            obj = closure.get(name, globals_.get(name))
            if obj is None:
                continue
            module = getattr(obj, "__name__", "") if inspect.ismodule(obj) else getattr(obj, "__module__", "") or ""
            if module == "ray.train" or module.startswith("ray.train."):
                return True
            if inspect.isfunction(obj) and obj.__module__ == "__main__" and refers_to_ray_train(obj, seen):
                return True
    return False


def _loads_ray_dot_train(code: types.CodeType, closure: dict, globals_: dict) -> bool:
    """The bytecode reads ``.train`` off the ``ray`` module (``ray.train.report(...)``)."""
    import dis

    previous = None
    local_ray: set[str] = set()  # local names bound by `import ray` inside the function
    for instruction in dis.get_instructions(code):
        if previous is not None and previous.opname == "IMPORT_NAME" and previous.argval == "ray" \
                and instruction.opname in ("STORE_FAST", "STORE_NAME", "STORE_DEREF", "STORE_GLOBAL"):
            local_ray.add(instruction.argval)
        loads_train = instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval == "train"
        if loads_train and previous is not None:
            loads_name = previous.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_NAME", "LOAD_GLOBAL")
            if loads_name and previous.argval in local_ray:
                return True
            if previous.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF"):
                obj = closure.get(previous.argval, globals_.get(previous.argval))
                if inspect.ismodule(obj) and obj.__name__ == "ray":
                    return True
        previous = instruction
    return False


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)
