"""Existing training code, unchanged, inside a ``%%distribute`` worker.

`install` runs in every worker once the run's process group exists and ``ctx`` is built, before the
user's function is unpickled; `uninstall` runs before the worker's own teardown. It sets up:

- `dtrain_magic.integrations.compat_dist`: the function's own ``init_process_group`` / ``destroy_process_group``
  (TorchDistributor / torchrun style) adopt the run's group; torchrun's rank variables.
- Hugging Face (`hf`): every ``transformers.Trainer`` logs to the magic's MLflow run and live charts
  (rank 0, through ``ctx.log``) instead of a second MLflow run of its own; ``--precision`` and
  ``--grad-accum`` fill in the Trainer's arguments the user left at their defaults (a conflict is an
  error). ``accelerate.Accelerator`` takes them as defaults too, and ``accelerator.log`` reaches the run.
- Ray Train (`ray_train`): on ``--backend ray``, what rank 0 gives ``ray.train.report`` also goes to the
  run's metrics; elsewhere ``ray.train``'s worker functions raise a short error saying to use
  ``--backend ray``.

Hooks on libraries run only when the user's code imports them (a post-import hook): transformers,
accelerate and ray are never imported by the magic itself, and need not be installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import sys
from typing import Any, Callable, Mapping

from ..errors import log_dropped
from ..registry import BACKENDS
from . import compat_dist

_hooks: "_PostImportHooks | None" = None
_undo: list[Callable[[], None]] = []
_sink: Callable[[Mapping[str, Any], int], None] | None = None


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics dict as floats (tensors and numpy scalars included); others dropped."""
    out = {}
    for key, value in (values or {}).items():
        if isinstance(value, bool) or value is None or isinstance(value, (str, bytes, dict, list, tuple)):
            continue
        try:
            if hasattr(value, "detach"):  # a tensor
                if value.numel() != 1:
                    continue
                value = value.detach().float().item()
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out


def log_metrics(values: Mapping[str, Any], step: int) -> None:
    """Send numeric metrics to the run (rank 0 only: the context drops other ranks' calls)."""
    if _sink is not None:
        found = numbers(values)
        if found:
            _sink(found, int(step))


def patch(owner: Any, name: str, replacement: Any) -> None:
    """Set ``owner.name`` for the rest of the user's call; `uninstall` puts the original back."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    _undo.append(lambda: setattr(owner, name, original))


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Run a function on a module right after it is first imported (by the user's code, in the worker)."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]):
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        self.hooks.pop(fullname, None)
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _run_hook(hook, module)

        loader.exec_module = exec_module
        return spec


def _run_hook(hook: Callable[[Any], None], module: Any) -> None:
    try:
        hook(module)
    except Exception as exc:  # an integration must never break an import of the user's
        print(f"dtrain_magic: could not set up {module.__name__} for this run: {exc}", file=sys.stderr)


def _when_imported(hooks: dict[str, Callable[[Any], None]]) -> None:
    global _hooks
    pending = {}
    for name, hook in hooks.items():
        if name in sys.modules:
            _run_hook(hook, sys.modules[name])
        else:
            pending[name] = hook
    if pending:
        _hooks = _PostImportHooks(pending)
        sys.meta_path.insert(0, _hooks)


def install(config: Any, ctx: Any, backend: str) -> None:
    """Prepare this worker for existing training code (see the module's docstring). Idempotent per call
    of `uninstall`. ``backend``: the run's ``--backend`` name (`in_ray_train` asks its facts)."""
    global _sink
    from . import hf, ray_train

    compat_dist.adopt(ctx.rank, ctx.local_rank, ctx.world_size,
                      int(os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world_size))))
    _sink = lambda values, step: ctx.log(values, step=step)  # noqa: E731 - ctx.log keeps rank 0's only
    hf.set_environment(config)
    hooks: dict[str, Callable[[Any], None]] = {
        "transformers.trainer": lambda module: hf.patch_trainer(module, config),
        "accelerate.accelerator": hf.patch_accelerator,
    }
    if in_ray_train(backend):
        ray_train.patch_report()
    else:
        hooks["ray.train"] = ray_train.refuse
        hooks["ray.train.torch"] = ray_train.refuse
    _when_imported(hooks)


def in_ray_train(backend: str) -> bool:
    """Are ``--backend backend``'s workers Ray Train's (`dtrain_magic.backends.Backend.ray_train`)? A backend
    registered only in the notebook is unknown to a worker's registry: it is not Ray Train (the base facts)."""
    return backend in BACKENDS.names() and BACKENDS.facts(backend).ray_train


def uninstall() -> None:
    """Undo `install` (before the worker destroys the process group itself). Idempotent."""
    global _hooks, _sink
    if _hooks is not None:
        try:
            sys.meta_path.remove(_hooks)
        except ValueError:
            pass
        _hooks = None
    while _undo:
        try:
            _undo.pop()()
        except Exception as exc:  # an integration's undo may raise anything: the others are still undone
            log_dropped(__name__, "uninstall", exc)
    _sink = None
    compat_dist.restore()
