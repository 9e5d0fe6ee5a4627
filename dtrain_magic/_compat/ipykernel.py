"""ipykernel's private parts, written against ipykernel 7.4 (constraints.txt: 7.4.0).

Kernel subshells (JEP 91, ipykernel >= 7) let the Stop button of a ``--ui`` run answer while the cell keeps the
kernel's main thread busy (`dtrain_magic.ui._kernel`). Public ipykernel has no call to create a subshell from inside
the kernel, nor to route a comm's messages to one. All three uses are **gated**: on an unknown version (without the
opt-in), or when a part is missing, the kernel is taken to have no subshells:

- `supports_subshells`: ``kernel._supports_kernel_subshells``;
- `create_subshell`: ``kernel.shell_channel_thread.manager._create_subshell()``, run on its
  ``_shell_channel_io_loop``;
- `route_comm`: ``comm._reply_subshell_for``, which the kernel reads for every comm message.

Without a subshell the Stop button works when the kernel is idle (the ``--configure`` panel runs in the
background, so there it always works), and the kernel's interrupt always stops a run.
"""

from __future__ import annotations

import threading
from typing import Any

from . import Library

IPYKERNEL = Library(key="ipykernel", title="ipykernel", module="ipykernel", known=("7.4",), tested="7.4.0",
                    requirement="ipykernel==7.4.0")


def supports_subshells(kernel: Any) -> bool:
    """Whether ``kernel`` (an ipykernel kernel) can run subshells this module knows how to use."""
    return IPYKERNEL.allowed() and bool(getattr(kernel, "_supports_kernel_subshells", False))


def create_subshell(kernel: Any, timeout: float) -> str:
    """A new subshell's id. Raises (TimeoutError, AttributeError, the manager's own error) when it fails."""
    manager = kernel.shell_channel_thread.manager
    done = threading.Event()
    box: dict[str, Any] = {}

    def create() -> None:  # runs on the shell channel thread, as the manager requires
        try:
            box["id"] = manager._create_subshell()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    manager._shell_channel_io_loop.add_callback(create)
    if not done.wait(timeout):
        raise TimeoutError(f"no subshell within {timeout:g} s")
    if "id" not in box:
        raise box.get("error") or RuntimeError("no subshell id")
    return box["id"]


def route_comm(comm: Any, subshell_id: str) -> None:
    """Have the kernel handle ``comm``'s front-end messages on the subshell ``subshell_id``."""
    comm._reply_subshell_for = lambda data, default: subshell_id  # an instance attribute wins
