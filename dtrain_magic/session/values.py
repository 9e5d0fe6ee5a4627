"""Values that travel between a session's ranks and the notebook.

A cell's value (the last expression) comes back from every rank it ran on: pickled with cloudpickle, tensors moved
to the CPU first (the notebook may have no GPU). A value that cannot come back (it does not pickle, such as a
module wrapped for DDP, which holds the process group; or it is larger than `MAX_CELL_VALUE_BYTES`) comes back as
`Unsent`: its repr on the rank and why. A pull is strict: what does not pickle is an error naming it.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

MAX_CELL_VALUE_BYTES = 64 << 20  # a cell's value larger than this is shown, not sent (pull it to get it)
_REPR_CHARS = 2000


class Unsent:
    """Stands for a rank's value that did not come back: ``text`` is its repr on the rank, ``reason`` why."""

    def __init__(self, type_name: str, text: str, reason: str):
        self.type_name, self.text, self.reason = type_name, text, reason

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unsent) and (self.type_name, self.text, self.reason) == (
            other.type_name, other.text, other.reason)

    __hash__ = None  # type: ignore[assignment]


class PerRank(dict):
    """A cell's values by rank (``{0: value, 1: value}``), shown one line per rank: ``[rank 0] value``."""

    def __repr__(self) -> str:
        lines = []
        for rank in sorted(self):
            text = repr(self[rank])
            lines.append(f"[rank {rank}] " + text.replace("\n", "\n" + " " * len(f"[rank {rank}] ")))
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if not cycle else "PerRank(...)")


def to_cpu(value: Any, depth: int = 0) -> Any:
    """``value`` with every tensor in it (in lists, tuples and dicts, a few levels deep) moved to the CPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if depth > 4:
        return value
    if isinstance(value, dict):
        return type(value)((key, to_cpu(item, depth + 1)) for key, item in value.items()) if _rebuildable(value) \
            else value
    if isinstance(value, (list, tuple)) and _rebuildable(value):
        items = [to_cpu(item, depth + 1) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _rebuildable(value: Any) -> bool:
    return type(value) in (dict, list, tuple) or hasattr(value, "_fields")


def pack(value: Any, strict: bool = False, limit: int | None = MAX_CELL_VALUE_BYTES) -> bytes | None:
    """The bytes a rank sends for ``value`` (None for None). Not ``strict`` (a cell's value): what cannot be sent
    becomes `Unsent`. ``strict`` (a pull): a `TypeError` that says what did not pickle."""
    if value is None:
        return None
    try:
        data = cloudpickle.dumps(to_cpu(value))
    except Exception as exc:
        if strict:
            raise TypeError(f"the value ({type(value).__name__}) cannot be pickled to send it to the notebook: "
                            f"{type(exc).__name__}: {exc}. Pull what it holds instead (a tensor, a state_dict(), "
                            "plain data)") from None
        return cloudpickle.dumps(_unsent(value, f"it cannot be pickled ({type(exc).__name__})"))
    if limit is not None and len(data) > limit and not strict:
        return cloudpickle.dumps(_unsent(value, f"it is {len(data) / (1 << 20):.0f} MB; pull it to get it"))
    return data


def _unsent(value: Any, reason: str) -> Unsent:
    try:
        text = repr(value)
    except Exception as exc:  # a repr that fails: say so instead of failing the cell
        text = f"<{type(value).__name__} (repr failed: {type(exc).__name__})>"
    if len(text) > _REPR_CHARS:
        text = text[:_REPR_CHARS - 1] + "…"
    return Unsent(type(value).__name__, text, reason)


def unpack(data: bytes | None) -> Any:
    """What `pack` made, in the notebook."""
    return None if data is None else cloudpickle.loads(data)
