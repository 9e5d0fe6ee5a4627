"""DeepSpeed's JIT-compiled C++ ops: built once per environment, in a directory of its own, never stuck.

On CPU, DeepSpeed compiles ``deepspeed_shm_comm`` the first time a process group starts (26-60 s on 2
cores). Left to itself it does so inside the user's first cell, silently, in ``~/.cache/torch_extensions``
shared by every environment of the machine (each rebuilds it for its own paths), and a build killed
half-way (a Stop, a timeout, a notebook that exits) leaves torch's ``lock`` file behind, on which every
later build waits forever.

Here:
- the ops live in `extensions_dir()`, private to this Python environment (``<sys.prefix>/var/dtrain_magic/
  torch_extensions``, or a per-environment folder under ``~/.cache/dtrain_magic`` when the prefix is not
  writable), exported as ``TORCH_EXTENSIONS_DIR`` to the workers unless the user set it;
- ``python -m dtrain_magic.strategies.extensions`` builds them ahead of time (``scripts/setup.sh`` does), so no cell
  compiles C++;
- every load goes through `op_build_guard`: an ``flock`` (released by the kernel when its holder dies,
  however it dies) serialises builders, so a ``lock`` file found while holding it belongs to nobody and
  is removed; a build still needed is announced in the cell.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Iterator

from .._compat import torch as torch_compat

_WAIT_S = 900.0  # longest a rank waits for another process's build (a cold 2-core build is about a minute)
_CPU_OPS = ("ShareMemCommBuilder",)


def extensions_dir() -> str:
    """Where this environment's JIT-built torch extensions go: ``$TORCH_EXTENSIONS_DIR`` if set, else a
    folder of this environment's own."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return explicit
    inside = os.path.join(sys.prefix, "var", "dtrain_magic", "torch_extensions")
    try:
        os.makedirs(inside, exist_ok=True)
        if os.access(inside, os.W_OK):
            return inside
    except OSError:
        pass
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "dtrain_magic", f"torch_extensions-{tag}")


def use_private_extensions_dir() -> str:
    """Point torch's JIT builds at `extensions_dir()` in this process (and what it starts); returns it."""
    path = extensions_dir()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", path)
    return os.environ["TORCH_EXTENSIONS_DIR"]


def _built(build_dir: str, name: str) -> bool:
    return os.path.exists(os.path.join(build_dir, f"{name}.so"))


@contextlib.contextmanager
def op_build_guard(name: str, announce: bool = True, wait_s: float = _WAIT_S) -> Iterator[None]:
    """Hold this environment's build lock for op ``name`` while it is loaded (built if need be).

    Torch's own ``lock`` file inside the build directory is stale whenever we hold the flock (every
    builder of this directory takes the flock first, and the kernel drops a dead holder's flock): it is
    removed, so a build killed half-way never blocks a later run. Raises `TimeoutError` naming the file
    when another process keeps building for longer than ``wait_s``."""
    build_dir = os.path.join(use_private_extensions_dir(), name)
    os.makedirs(build_dir, exist_ok=True)
    guard_path = os.path.join(build_dir, ".dtrain_magic.flock")
    with open(guard_path, "a") as guard:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {wait_s:.0f} s for another process building DeepSpeed's {name} op (lock "
                        f"{guard_path}); if no such build is running, delete {build_dir} and run again"
                    ) from None
                if announce and not said and not _built(build_dir, name):  # a built op loads in well under a second
                    print(f"dtrain_magic: waiting for another process to finish building DeepSpeed's {name} op",
                          flush=True)
                    said = True
                time.sleep(0.2)
        try:
            stale = os.path.join(build_dir, torch_compat.EXTENSION_BUILD_LOCK)
            if os.path.exists(stale):
                os.remove(stale)  # left by a build that was killed: its owner no longer holds the flock
            if announce and not _built(build_dir, name):
                print(
                    f"dtrain_magic: compiling DeepSpeed's {name} op once for this environment (about a minute on "
                    f"2 cores; `python -m dtrain_magic.strategies.extensions` does it ahead of time) into {build_dir}",
                    flush=True,
                )
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_deepspeed_cpu_ops(announce: bool = True) -> list[str]:
    """Load (building once if needed) the ops DeepSpeed's CPU accelerator JIT-builds when a process group
    starts, under `op_build_guard`; DeepSpeed then finds them loaded. Names of the ops loaded."""
    from deepspeed.accelerator import get_accelerator

    loaded = []
    for builder_name in _CPU_OPS:
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or not builder.is_compatible(False):
            continue
        with op_build_guard(builder.NAME, announce=announce):
            builder.load(verbose=False)
        loaded.append(builder.NAME)
    return loaded


def main(argv: list[str] | None = None) -> int:
    """``python -m dtrain_magic.strategies.extensions``: build DeepSpeed's CPU ops for this environment now."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started = time.monotonic()
    try:
        names = load_deepspeed_cpu_ops(announce=False)
    except ImportError as exc:
        print(f"dtrain_magic.strategies.extensions: DeepSpeed is not installed ({exc}); nothing to build")
        return 0
    where = extensions_dir()
    print(f"dtrain_magic.strategies.extensions: {', '.join(names) or 'no ops'} ready in {where} "
          f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
