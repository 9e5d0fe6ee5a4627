"""Per-process memory estimate for parameters, gradients and optimizer states (the ZeRO paper's model).

With Ψ parameters, N data-parallel processes and K bytes of optimizer state per parameter, the ZeRO
paper (Rajbhandari et al., 2020, section 3 and figure 1) gives, for mixed-precision Adam (2-byte
parameters and gradients, K = 12: fp32 master copy 4 + momentum 4 + variance 4):

    DP (DDP, ZeRO-0)   (2 + 2 + K) Ψ
    ZeRO-1             2Ψ + 2Ψ + KΨ/N
    ZeRO-2             2Ψ + (2 + K)Ψ/N
    ZeRO-3 (and FSDP)  (2 + 2 + K)Ψ/N

The fp32 equivalents use 4-byte parameters and gradients. Plain fp32 Adam holds only its two moments
(K = 8); DeepSpeed's ZeRO-1/2/3 optimizers also keep an fp32 copy of their partition as the "master"
weights even in fp32, so under ``--strategy deepspeed --zero 1..3 --precision fp32`` K = 12 again.
DDP and FSDP with ``--precision bf16/fp16`` use autocast, which keeps the stored parameters,
gradients and optimizer states in fp32, so the fp32 numbers apply to them. FSDP (FULL_SHARD) shards
like ZeRO-3. Activations, temporary buffers and the framework's own overhead are not included.

Model parallelism (``--tp T``, ``--pp P``): each process holds 1/T of every layer and one of P stages, so its share
of the model is Ψ/(T·P) (assuming every layer is tensor-parallel and the stages are even); the formulas above then
apply to that share, with N = the data-parallel degree world/(T·P). Left out, beyond activations: layers a
tensor-parallel plan keeps replicated (embeddings, norms, biases of row-wise layers), uneven stages, and the
pipeline's in-flight micro-batches (a stage holds the activations of up to --microbatches of them, GPipe, or
about P, 1F1B) and its idle time (bubbles), which costs time rather than memory.

Everything here is pure arithmetic except :func:`device_memory_bytes`, :func:`optimizer_state_bytes` and
:func:`model_of_cell` (which builds the cell's model on torch's meta device to count its parameters).
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass
from typing import Any, Mapping

from ._compat import deepspeed as deepspeed_compat

ADAM_MIXED_K = 12  # fp32 master weights + momentum + variance, bytes per parameter
ADAM_MOMENTS_FP32 = 8  # momentum + variance in fp32


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected bytes per process for one strategy/stage/precision/world size."""

    strategy: str
    zero: int | None
    precision: str
    world_size: int
    num_params: int
    params: float
    grads: float
    optimizer: float
    optimizer_moments: float  # the part of ``optimizer`` that is Adam's momentum + variance
    tp: int = 1
    pp: int = 1

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def label(self) -> str:
        label = f"deepspeed ZeRO-{self.zero or 0}" if self.strategy == "deepspeed" else self.strategy
        degrees = (("tp", self.tp), ("pp", self.pp))
        return label + "".join(f" x {name} {degree}" for name, degree in degrees if degree > 1)

    def line(self) -> str:
        """One line for the cell's output."""
        text = (
            f"memory estimate ({self.label}, {self.precision}, {self.world_size} process"
            f"{'es' if self.world_size != 1 else ''}, {self.num_params:,} parameters): "
            f"params {format_bytes(self.params)} + grads {format_bytes(self.grads)} + optimizer "
            f"{format_bytes(self.optimizer)} = {format_bytes(self.total)} per process"
        )
        if self.tp > 1 or self.pp > 1:
            text += (" (an even 1/" + str(self.tp * self.pp) + " of the model each; not counted: activations, "
                     "replicated layers" + (", the pipeline's in-flight micro-batches" if self.pp > 1 else "") + ")")
        return text


def _sharding(strategy: str, zero: int | None) -> int:
    """The ZeRO stage a strategy's sharding corresponds to (DDP = 0, FSDP full shard = 3)."""
    if strategy == "ddp":
        return 0
    if strategy == "fsdp":
        return 3
    if strategy == "deepspeed":
        stage = 0 if zero is None else int(zero)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
        return stage
    raise ValueError(f"unknown strategy {strategy!r}")


def bytes_per_param(strategy: str, zero: int | None, precision: str) -> tuple[int, int, int, int]:
    """(parameter bytes, gradient bytes, K optimizer bytes, of which Adam moments) per parameter."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    stage = _sharding(strategy, zero)
    if strategy == "deepspeed" and precision != "fp32":
        return 2, 2, ADAM_MIXED_K, ADAM_MOMENTS_FP32
    if strategy == "deepspeed" and stage >= 1:
        return 4, 4, ADAM_MIXED_K, ADAM_MOMENTS_FP32  # DeepSpeed keeps an fp32 partition copy even in fp32
    return 4, 4, ADAM_MOMENTS_FP32, ADAM_MOMENTS_FP32  # plain fp32 storage (DDP/FSDP autocast, ZeRO-0 fp32)


def estimate(num_params: int, strategy: str = "ddp", zero: int | None = None, precision: str = "fp32",
             world_size: int = 1, k: int | None = None, tp: int = 1, pp: int = 1) -> MemoryEstimate:
    """Per-process bytes for parameters, gradients and optimizer states; ``k`` overrides K. With ``tp``/``pp``
    each process holds an even 1/(tp x pp) of the model, sharded further over the world/(tp x pp) replicas."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp {tp} x pp {pp}")
    psi, n = float(num_params) / (tp * pp), float(world_size // (tp * pp))
    p, g, kk, moments = bytes_per_param(strategy, zero, precision)
    if k is not None:
        kk = k
        moments = min(moments, k)
    stage = _sharding(strategy, zero)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optimizer = kk * psi / (n if stage >= 1 else 1)
    optimizer_moments = moments * psi / (n if stage >= 1 else 1)
    return MemoryEstimate(strategy, stage if strategy == "deepspeed" else None, precision, world_size,
                          int(num_params), params, grads, optimizer, optimizer_moments, tp, pp)


def table(num_params: int, precision: str = "fp32", world_size: int = 2, tp: int = 1, pp: int = 1) -> str:
    """A text table of the estimate for every strategy and stage (for the dry run or the docs); with ``tp``/``pp``,
    the strategies that support them (ddp, fsdp)."""
    rows = [estimate(num_params, "ddp", None, precision, world_size, tp=tp, pp=pp),
            estimate(num_params, "fsdp", None, precision, world_size, tp=tp, pp=pp)]
    if tp == 1 and pp == 1:
        rows += [estimate(num_params, "deepspeed", s, precision, world_size) for s in (0, 1, 2, 3)]
    header = f"{'strategy':<22}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
    lines = [f"memory per process: {num_params:,} parameters, {precision}, {world_size} processes", header]
    for r in rows:
        lines.append(f"{r.label:<22}{format_bytes(r.params):>12}{format_bytes(r.grads):>12}"
                     f"{format_bytes(r.optimizer):>12}{format_bytes(r.total):>12}")
    return "\n".join(lines)


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def device_memory_bytes(device: Any = None, processes_per_device: int = 1) -> int | None:
    """Memory one process may use: the GPU's total memory, or the host's RAM shared by its processes."""
    try:
        import torch

        if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
            index = getattr(device, "index", None) or 0
            return int(torch.cuda.get_device_properties(index).total_memory)
    except Exception:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total // max(1, processes_per_device))
    except Exception:
        return None


def check_fits(est: MemoryEstimate, available: int | None) -> str | None:
    """A warning line when the estimate exceeds ``available`` bytes, else None."""
    if available is None or est.total <= available:
        return None
    return (
        f"warning: the estimate ({format_bytes(est.total)} per process for parameters, gradients and optimizer "
        f"states alone) exceeds the device's memory ({format_bytes(available)}); consider a higher --zero stage, "
        f"--strategy fsdp, --precision bf16, more processes, or --tp/--pp"
    )


def count_parameters(model: Any) -> int:
    """Number of parameters of a plain (not yet sharded) module, counting shared tensors once."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape = deepspeed_compat.full_shape(param)  # a ZeRO-3 partitioned parameter
        if shape is not None:
            n = 1
            for d in shape:
                n *= d
            total += n
        else:
            total += param.numel()
    return total


def report(model: Any, strategy: str, zero: int | None, precision: str, world_size: int,
           device: Any = None, processes_per_device: int = 1, tp: int = 1, pp: int = 1) -> str:
    """The estimate line for ``model`` (and the warning when it does not fit), as printed by wrap()."""
    est = estimate(count_parameters(model), strategy, zero, precision, world_size, tp=tp, pp=pp)
    warning = check_fits(est, device_memory_bytes(device, processes_per_device))
    return est.line() + (f"\n{warning}" if warning else "")


def _inner_optimizers(optimizer: Any):
    """The torch optimizers inside a wrapper (DeepSpeed's ZeRO/BF16 optimizers keep theirs in ``.optimizer``)."""
    import torch

    seen, current = set(), optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer) and not hasattr(current, "optimizer"):
            yield current
            return
        inner = getattr(current, "optimizer", None)
        if inner is None:
            if isinstance(current, torch.optim.Optimizer):
                yield current
            return
        current = inner


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes this process holds in the optimizer's state tensors (Adam's moments), local shards only."""
    total = 0
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            for value in state.values():
                total += _local_bytes(value)
    return total


def _local_bytes(value: Any) -> int:
    import torch

    if not isinstance(value, torch.Tensor):
        return 0
    local = getattr(value, "to_local", None)  # DTensor (FSDP2): count this rank's shard
    if callable(local):
        value = local()
    if value.dim() == 0:
        return 0  # Adam's step counter
    return value.numel() * value.element_size()


# -- the cell's own model, without training ------------------------------------------------------------

# Calls on a model that return the same module (or a copy of it) with the same parameters.
_SAME_MODULE_METHODS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval",
                                  "requires_grad_", "type", "to_empty"})
# Calls that would read weights from disk or the network: not "known without training" cheaply.
_LOADS_WEIGHTS = frozenset({"from_pretrained", "load", "load_state_dict", "hf_hub_download"})
_EXPR_NODES = (ast.Call, ast.Attribute, ast.Name, ast.Constant, ast.keyword, ast.Tuple, ast.List, ast.Dict,
               ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load, ast.Starred, ast.Subscript, ast.Slice)


@dataclass(frozen=True)
class CellModel:
    """The parameter count of the model a cell's training function prepares, when it can be known
    without training (``num_params``), and where it came from or why it is unknown (``description``)."""

    num_params: int | None
    description: str

    @property
    def found(self) -> bool:
        return self.num_params is not None


class _Unknown(Exception):
    """Why the model cannot be built here (shown to the user)."""


def model_of_cell(cell: str, namespace: Mapping[str, Any] | None = None, fn: str | None = None) -> CellModel:
    """Count the parameters of the model the cell's training function passes to ``ctx.prepare``.

    Static where it can be, without running the training: the function (``fn``, else the cell's last
    top-level ``def``) is read, the first argument of its first ``ctx.prepare(...)`` call is followed
    back through the function's own assignments (``model = Net(hidden).to(ctx.device)``, ``hidden = 64``)
    to a module of the notebook (counted as it is) or to an expression that builds one from the cell's
    imports, classes and helpers or the notebook's names (``make_model()``, ``torch.nn.Linear(8, 1)``).
    That expression is evaluated under ``torch.device("meta")``: parameters have shapes but no storage,
    so even a large model costs no memory. The cell's top-level imports, ``def``s, ``class``es and
    constant assignments run in a scratch copy of the namespace (nothing is added to the notebook's).
    Loading weights (``from_pretrained``) is not attempted.
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
    return CellModel(count_parameters(model), how)


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
        if isinstance(expr, ast.Name) and self.local(expr.id) is None and expr.id not in self.other_params:
            value = self.scratch.get(expr.id)
            if isinstance(value, torch.nn.Module):
                return value, f"the notebook's `{expr.id}` ({type(value).__name__})"
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
