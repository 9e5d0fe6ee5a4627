"""Keep a widget's buttons working while a cell blocks the kernel's main thread.

A ``%%distribute --ui`` cell runs the whole training in the cell (it returns the `RunResult`), so the
kernel's main thread is busy and front-end messages (a click on Stop) wait until the cell ends. ipykernel
>= 7 has kernel subshells (JEP 91): threads that handle shell messages on their own, and it routes a
comm's messages to ``comm._reply_subshell_for(data, default)``. We create one subshell per kernel and
route the few comms that must answer during a run (the Stop button) there. The handlers then run on
the subshell's thread; they only set a `threading.Event`.

Everything here is best effort: without a ZMQ kernel, or on an ipykernel without subshells (or one whose
private subshell parts `dtrain_magic._compat.ipykernel` does not know), nothing is routed
(`route_to_subshell` returns False) and the Stop button works only when the kernel is idle (the
``--configure`` panel runs in the background, so it works there); the kernel's interrupt always works.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .._compat import ipykernel as ipykernel_compat
from ..errors import log_dropped

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_subshell: dict[int, str] = {}


def _kernel() -> Any:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception as exc:  # no IPython, or a broken one: no kernel to route buttons through
        log_dropped(__name__, "_kernel", exc)
        return None
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not ipykernel_compat.supports_subshells(kernel):
        return None
    return kernel


def _subshell_id(kernel: Any, timeout: float = 5.0) -> str | None:
    with _lock:
        if id(kernel) in _subshell:
            return _subshell[id(kernel)]
        try:
            _subshell[id(kernel)] = ipykernel_compat.create_subshell(kernel, timeout)
        except Exception as exc:  # private ipykernel API: any failure means no subshell
            _log.debug("could not create a kernel subshell: %r", exc)
            return None
        return _subshell[id(kernel)]


def route_to_subshell(widget: Any) -> bool:
    """Have the kernel handle ``widget``'s front-end messages on a subshell thread. True if routed."""
    try:
        kernel = _kernel()
        comm = getattr(widget, "comm", None)
        if kernel is None or comm is None:
            return False
        subshell = _subshell_id(kernel)
        if subshell is None:
            return False
        ipykernel_compat.route_comm(comm, subshell)
        return True
    except Exception:  # private ipykernel API: never let it break a run
        _log.debug("routing a widget to a subshell failed", exc_info=True)
        return False
