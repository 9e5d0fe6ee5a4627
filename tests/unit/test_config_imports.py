"""Validating a `RunConfig` reads the backends' and strategies' facts without importing torch or a backend's library,
and nothing those facts load imports the config back (issue #35). Each check runs in a fresh interpreter: this
test process has long imported torch."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap

from dtrain_magic.registry import BACKENDS, STRATEGIES

HEAVY = ("torch", "deepspeed", "pyspark", "ray")


def _run(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_backend_and_strategy_validates_without_torch():
    _run(f"""
        import sys
        import dtrain_magic.config as c
        from dtrain_magic.errors import ConfigError
        from dtrain_magic.registry import BACKENDS, STRATEGIES

        for backend in BACKENDS.names():
            for strategy in STRATEGIES.names():
                c.RunConfig(backend=backend, strategy=strategy).process_group_backend
        c.RunConfig(backend="ray", strategy="deepspeed", zero=3, precision="bf16", ray_address="auto")
        c.RunConfig(backend="spark", strategy="fsdp", tp=2, num_processes=4, local_mode=False)
        c.RunConfig(backend="local", strategy="ddp", pp=2, microbatches=4, max_restarts=1)
        c.default_strategy({{"zero": 2}}), c.detect_backend()
        for refused in ({{"backend": "spark", "max_restarts": -1}}, {{"strategy": "deepspeed", "tp": 2}},
                        {{"backend": "local", "ray_address": "auto"}}, {{"strategy": "ddp", "zero": 1}}):
            try:
                c.RunConfig(**refused)
            except ConfigError:
                pass
            else:
                raise AssertionError(f"{{refused}} was not refused")
        loaded = [name for name in {HEAVY!r} if name in sys.modules]
        assert not loaded, f"validating a RunConfig imported {{loaded}}"
    """)


def _module_level_imports(name: str) -> set[str]:
    """The dtrain_magic modules ``name`` imports when it is imported (not in functions nor under TYPE_CHECKING)."""
    spec = importlib.util.find_spec(name)
    package = name if spec.submodule_search_locations else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import module`
            visit([child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)])

    visit(ast.parse(open(spec.origin, encoding="utf-8").read()).body)
    return {module for module in found if module.startswith("dtrain_magic.") and _is_module(module)}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # ``from .registry import BACKENDS``: a name in a module, not a module
        return False


def _imported_with(name: str) -> set[str]:
    """Every dtrain_magic module importing ``name`` imports, its packages' ``__init__`` included (the root's aside:
    it is the public facade, which imports the config for every submodule alike)."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))] + sorted(_module_level_imports(module))
    return seen


def test_the_facts_do_not_import_the_config_that_reads_them():
    modules = {cls.__module__ for registry in (BACKENDS, STRATEGIES) for cls in registry.all_facts().values()}
    assert {"dtrain_magic.backends", "dtrain_magic.strategies.deepspeed"} <= modules
    for module in sorted(modules):
        assert "dtrain_magic.config" not in _imported_with(module), f"{module} imports dtrain_magic.config"
    assert "dtrain_magic.config" in _imported_with("dtrain_magic.launchers.local")  # the walk does see imports
