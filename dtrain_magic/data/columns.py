"""Which columns can become tensors, and how an Arrow column becomes a numpy array of batch rows.

Allowed: booleans, integers and floats (a 1-D tensor per batch), and lists of them whose rows all have the same
length, fixed-size lists, nested (a 2-D or N-D tensor). A column made from an N-D numpy array or tensor keeps its
shape in its field's metadata (``dtrain.shape``). Everything else (strings, binary, dates, timestamps, decimals,
structs, maps) is refused before launch, naming the column and its type.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

SHAPE_KEY = b"dtrain.shape"
_HINTS = {
    "decimal": "cast it to double",
    "string": "keep only the numeric columns, or encode it as numbers first",
    "timestamp": "turn it into a number first (e.g. seconds since the epoch)",
    "date": "turn it into a number first (e.g. days since the epoch)",
}


def hint_for(type_text: str) -> str:
    """What to do with a column of a type no tensor holds (``type_text``: Arrow's or Spark's name for it)."""
    text = type_text.lower()
    for kind, hint in _HINTS.items():
        if text.startswith(kind) or (kind == "string" and text.startswith(("large_string", "binary", "utf8"))):
            return hint
    return "only numbers, booleans and lists of them become tensors"


def refusal(arrow_type: pa.DataType) -> str | None:
    """Why a column of this type cannot become a tensor; None when it can."""
    t = arrow_type
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return refusal(t.value_type)
    return hint_for(str(t))


def check_schema(schema: pa.Schema) -> None:
    """A `ValueError` naming the first column that cannot become a tensor, its type and what to do."""
    for field in schema:
        why = refusal(field.type)
        if why is not None:
            raise ValueError(f"column {field.name!r} ({field.type}) cannot become a tensor: {why}")


def field_shape(field: pa.Field) -> tuple[int, ...] | None:
    """The per-row shape an N-D array column was stored with (None: as its Arrow type says)."""
    meta = field.metadata or {}
    return tuple(json.loads(meta[SHAPE_KEY])) if SHAPE_KEY in meta else None


def to_numpy(column: pa.ChunkedArray | pa.Array, field: pa.Field) -> np.ndarray:
    """One column of a window as a numpy array with the rows first (read-only when Arrow's own memory)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        raise ValueError(f"column {field.name!r} has {array.null_count} missing value(s) (nulls): fill or drop them "
                         "before training")
    values = _values(array, field.name)
    shape = field_shape(field)
    return values.reshape(len(array), *shape) if shape is not None else values


def _values(array: pa.Array, name: str) -> np.ndarray:
    t = array.type
    if pa.types.is_fixed_size_list(t):
        inner = _values(array.flatten(), name)
        return inner.reshape(len(array), t.list_size, *inner.shape[1:])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = np.asarray(array.offsets)
        lengths = np.diff(offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError(f"column {name!r} holds lists of different lengths ({lengths.min()} to {lengths.max()} "
                             "in one batch): a tensor needs rows of one shape; pad them to one length first")
        inner = _values(array.flatten(), name)
        width = int(lengths[0]) if len(lengths) else 0
        return inner.reshape(len(array), width, *inner.shape[1:])
    return array.to_numpy(zero_copy_only=False)


def schema_text(schema: pa.Schema) -> str:
    """``id: int64, x: fixed_size_list<float>[4]``: a schema in one line (dry run, MLflow)."""
    parts = []
    for field in schema:
        shape = field_shape(field)
        parts.append(f"{field.name}: {field.type}" + (f" (shape {list(shape)})" if shape else ""))
    return ", ".join(parts)


def row_bytes(schema: pa.Schema) -> int:
    """Bytes of one row as tensors (fixed-width types; a variable list counts as one value): for sizing windows."""
    total = 0
    for field in schema:
        t, count = field.type, 1
        while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            count *= t.list_size if pa.types.is_fixed_size_list(t) else 1
            t = t.value_type
        try:
            width = max(1, (t.bit_width + 7) // 8)
        except ValueError:  # not a fixed-width type (refused elsewhere): count 8 bytes
            width = 8
        total += count * width
    return max(1, total)


def table_from_arrays(columns: dict[str, Any]) -> pa.Table:
    """Named numpy arrays (rows first; N-D ones keep their shape in the field's metadata) as an Arrow table."""
    arrays, fields = [], []
    for name, values in columns.items():
        values = np.ascontiguousarray(values)
        if values.ndim == 0:
            raise ValueError(f"{name!r} is a scalar, not rows of data")
        if values.ndim == 1:
            array = pa.array(values)
            fields.append(pa.field(name, array.type))
        else:
            width = int(np.prod(values.shape[1:]))
            flat = pa.array(values.reshape(-1))
            array = pa.FixedSizeListArray.from_arrays(flat, width)
            meta = {SHAPE_KEY: json.dumps(list(values.shape[1:])).encode()} if values.ndim > 2 else None
            fields.append(pa.field(name, array.type, metadata=meta))
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
