"""torch's private parts, written against torch 2.13 (requirements.txt: 2.13.0).

Both are optimisations with a fallback, so no torch version is refused:

- `preload_compiler`: ``import torch._dynamo``, what DDP imports on first use (about 1 s on 2 cores), done by the
  local backend's fork server so forked workers start with it. **Fallback**: each worker imports it on its first
  DDP step.
- `EXTENSION_BUILD_LOCK`: the file ``torch.utils.cpp_extension`` locks a JIT build with (a ``FileBaton`` named
  ``lock`` in the build directory); ``extensions.py`` removes a stale one under its own flock. **Fallback** if
  renamed: a build killed half-way leaves a lock a later build waits on (torch's own behaviour).
"""

from __future__ import annotations

from ..errors import log_dropped
from . import Library

TORCH = Library(key="torch", title="torch", module="torch", known=("2.13",), tested="2.13.0",
                requirement="torch==2.13.0")
EXTENSION_BUILD_LOCK = "lock"


def preload_compiler() -> None:
    """Import ``torch._dynamo`` now (and sympy, which it needs); nothing when that fails."""
    try:
        import sympy  # noqa: F401
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # an optional speed-up only
        log_dropped(__name__, "preload_compiler", exc)
