"""How many parameters the cell's model has, found without training: `model_of_cell`.

It follows ``ctx.prepare``'s model argument back to a notebook module or an expression, and builds that on
torch's meta device (never ``from_pretrained``: no weights are read) to count its parameters, for the
memory estimate of ``--dry-run`` and the ``--configure`` panel. `CellModel` says what was found, or why not.
"""

from __future__ import annotations

import ast
import builtins
from typing import Any, Mapping

from .memory import CellModel, model_facts

_SAME_MODULE_METHODS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval",
                                  "requires_grad_", "type", "to_empty"})
# Calls that would read weights from disk or the network: not "known without training" cheaply.
_LOADS_WEIGHTS = frozenset({"from_pretrained", "load", "load_state_dict", "hf_hub_download"})
_EXPR_NODES = (ast.Call, ast.Attribute, ast.Name, ast.Constant, ast.keyword, ast.Tuple, ast.List, ast.Dict,
               ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load, ast.Starred, ast.Subscript, ast.Slice)


class _Unknown(Exception):
    """Why the model cannot be built here (shown to the user)."""


def model_of_cell(cell: str, namespace: Mapping[str, Any] | None = None, fn: str | None = None,
                  ac_module: str | None = None) -> CellModel:
    """Count the parameters of the model the cell's training function passes to ``ctx.prepare``.

    Static where it can be, without running the training: the function (``fn``, else the cell's last
    top-level ``def``) is read, the first argument of its first ``ctx.prepare(...)`` call is followed
    back through the function's own assignments (``model = Net(hidden).to(ctx.device)``, ``hidden = 64``)
    to a module of the notebook (counted as it is) or to an expression that builds one from the cell's
    imports, classes and helpers or the notebook's names (``make_model()``, ``torch.nn.Linear(8, 1)``).
    That expression is evaluated under ``torch.device("meta")``: parameters have shapes but no storage,
    so even a large model costs no memory. The cell's top-level imports, ``def``s, ``class``es and
    constant assignments run in a scratch copy of the namespace (nothing is added to the notebook's).
    Loading weights (``from_pretrained``) is not attempted. A ``sample=`` keyword of that call is followed back the
    same way (a notebook's tensor, or an expression built on the meta device) and one micro-batch's activations are
    measured from it (`worker.activations.measure`, blocks found as ``--ac-module ac_module`` finds them).
    """
    namespace = dict(namespace or {})
    try:
        tree = ast.parse(cell)
    except SyntaxError as exc:
        return CellModel(None, f"the cell does not parse ({exc.msg}, line {exc.lineno})")
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    func = next((d for d in reversed(defs) if d.name == fn), None) if fn else (defs[-1] if defs else None)
    if func is None:
        return CellModel(None, f"no function {fn!r} in the cell" if fn else "no training function in the cell")
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    ctx = params[0] if params else None
    prepares = sorted(
        (n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
         and n.func.attr == "prepare" and isinstance(n.func.value, ast.Name) and n.func.value.id == ctx and n.args),
        key=lambda n: (n.lineno, n.col_offset))
    if ctx is None or not prepares:
        return CellModel(None, f"{func.name}() does not call {ctx or 'ctx'}.prepare(model, ...)")
    call = prepares[0]
    scratch = namespace
    problems = _run_definitions(tree, func, scratch)
    resolver = _Resolver(func, call.lineno, ctx, set(params[1:]), scratch)
    try:
        model, how = resolver.model(call.args[0])
    except _Unknown as exc:
        extra = f" ({'; '.join(problems)})" if problems else ""
        return CellModel(None, f"{exc}{extra}")
    facts = model_facts(model)
    activations, note = _activations(resolver, call, model, ac_module)
    return CellModel(facts.num_params, how, facts, activations, note)


def _activations(resolver: "_Resolver", call: ast.Call, model: Any, ac_module: str | None) -> tuple[Any, str]:
    """One micro-batch's activations from ``ctx.prepare``'s ``sample=`` (followed back as the model is, built on the
    meta device: no memory used), measured as the workers measure them; (None, why) when there is no sample or it
    is known only when the function runs."""
    sample = next((k.value for k in call.keywords if k.arg == "sample"), None)
    if sample is None:
        return None, ""
    from ..worker.activations import measure

    source = ast.unparse(sample)
    try:
        value = resolver.value(sample)
        return measure(model, value, ac_module), f"activations from the sample `{source}`"
    except _Unknown as exc:
        return None, f"activations: not known before training ({exc})"
    except (ValueError, RuntimeError, TypeError) as exc:  # a sample the model cannot take, measured on meta
        return None, f"activations: the sample `{source}` did not go through the model on meta ({exc})"


def _run_definitions(tree: ast.Module, func: ast.AST, scratch: dict) -> list[str]:
    """Run the cell's imports, defs, classes and constant assignments in ``scratch``; what failed."""
    problems = []
    for node in tree.body:
        runnable = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                ast.literal_eval(node.value)
                runnable = True
            except ValueError:
                pass
        if not runnable or node is func:
            continue
        try:
            exec(compile(ast.Module([node], []), "<dtrain_magic model estimate>", "exec"), scratch)
        except Exception as exc:  # an import missing here, a decorator failing: say so if it matters
            problems.append(f"line {node.lineno}: {type(exc).__name__}: {exc}")
    return problems


class _Resolver:
    """Follows the model expression back through the training function's assignments (see `model_of_cell`)."""

    def __init__(self, func: ast.AST, before_line: int, ctx: str, other_params: set[str], scratch: dict):
        self.ctx, self.other_params, self.scratch = ctx, other_params, scratch
        self.assignments: dict[str, list[tuple[int, ast.expr]]] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and node.lineno < before_line:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assignments.setdefault(target.id, []).append((node.lineno, node.value))
                    elif isinstance(target, (ast.Tuple, ast.List)):
                        for element in target.elts:  # `model, opt = ...`: not followed (which element?)
                            if isinstance(element, ast.Name):
                                self.assignments.setdefault(element.id, []).append((node.lineno, None))
        self.depth = 0

    def local(self, name: str) -> ast.expr | None:
        found = self.assignments.get(name)
        if not found:
            return None
        value = max(found, key=lambda item: item[0])[1]
        if value is None:
            raise _Unknown(f"`{name}` comes from unpacking a tuple before ctx.prepare; cannot tell which part")
        return value

    def model(self, expr: ast.expr) -> tuple[Any, str]:
        """The module ``expr`` stands for, and how it was found."""
        import torch

        source = ast.unparse(expr)
        while (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
               and expr.func.attr in _SAME_MODULE_METHODS):
            expr = expr.func.value  # `.to(ctx.device)`: the same parameters
        if isinstance(expr, ast.Lambda) and not (expr.args.args or expr.args.posonlyargs or expr.args.vararg):
            return self.model(expr.body)  # a factory, ctx.prepare(lambda: Net(), ...): what it builds
        if isinstance(expr, ast.Name) and self.local(expr.id) is None and expr.id not in self.other_params:
            value = self.scratch.get(expr.id)
            if isinstance(value, torch.nn.Module):
                return value, f"the notebook's `{expr.id}` ({type(value).__name__})"
            if callable(value) and not isinstance(value, type):  # a factory function: ctx.prepare(make_model, ...)
                call = ast.fix_missing_locations(ast.copy_location(ast.Call(func=expr, args=[], keywords=[]), expr))
                return self.model(call)
        if isinstance(expr, ast.Name) and (local := self.local(expr.id)) is not None:
            self.depth += 1
            if self.depth > 10:
                raise _Unknown(f"could not follow `{source}` back to where the model is built")
            return self.model(local)
        with torch.device("meta"):
            value = self.evaluate(expr)
        if not isinstance(value, torch.nn.Module):
            raise _Unknown(f"`{source}` is a {type(value).__name__}, not a torch.nn.Module")
        built = ast.unparse(expr)
        return value, f"`{built}` from the cell, built on the meta device (no memory used, nothing trained)"

    def value(self, expr: ast.expr) -> Any:
        """What ``expr`` (not a model: a sample batch) stands for: a notebook's value, or built on the meta device."""
        import torch

        self.depth = 0
        while isinstance(expr, ast.Name) and (local := self.local(expr.id)) is not None:
            self.depth += 1
            if self.depth > 10:
                raise _Unknown(f"could not follow `{ast.unparse(expr)}` back to where it is made")
            expr = local
        with torch.device("meta"):
            return self.evaluate(expr)

    def evaluate(self, expr: ast.expr, depth: int = 0) -> Any:
        """Evaluate a plain expression (calls, names, attributes, constants) with the function's locals."""
        if depth > 10:
            raise _Unknown("the model's arguments depend on each other too deeply")
        source = ast.unparse(expr)
        local_values: dict[str, Any] = {}
        for node in ast.walk(expr):
            if not isinstance(node, _EXPR_NODES):
                raise _Unknown(f"`{source}` is more than calls and names ({type(node).__name__}); "
                               "it is known only when the function runs")
            if isinstance(node, ast.Attribute) and node.attr in _LOADS_WEIGHTS:
                raise _Unknown(f"`{source}` loads weights ({node.attr}); not done for an estimate")
            if isinstance(node, ast.Name) and node.id not in local_values:
                if node.id == self.ctx:
                    raise _Unknown(f"`{source}` uses {self.ctx}, which exists only on the workers")
                if node.id in self.other_params:
                    raise _Unknown(f"`{source}` uses the parameter `{node.id}`, known only when the function runs")
                local = self.local(node.id)
                if local is not None:
                    local_values[node.id] = self.evaluate(local, depth + 1)
                elif node.id not in self.scratch and not hasattr(builtins, node.id):
                    raise _Unknown(f"`{source}` needs `{node.id}`, which the notebook does not have yet "
                                   "(it exists once the cell runs)")
        try:
            compiled = compile(ast.Expression(expr), "<dtrain_magic model estimate>", "eval")
            return eval(compiled, self.scratch, local_values)
        except _Unknown:
            raise
        except Exception as exc:
            raise _Unknown(f"building `{source}` without training failed: {type(exc).__name__}: {exc}") from None
