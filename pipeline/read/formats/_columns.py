"""Column values of Arrow data (Parquet, Arrow IPC) as the records' values.

Text and messages come out as Python objects (`to_pylist`). Token ids (`tokens_field`) in a
`list<int>` (large or fixed-size) column come out as numpy views of the column's values, one
per row, with no per-token Python objects; anything else falls back to Python objects, which the
token validator (pipeline/read/reading.py) then rejects with the type it found.

Booleans are not token ids: numpy reads `[1, true]` as `[1, 1]`, so a list of Python values
(JSON, an MDS `json` column, an Arrow union) that holds one is refused here (`bool_ids`),
before it reaches numpy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def bool_ids(value) -> str | None:
    """Why a list of Python values read as token ids is bad when it holds a boolean, else
    None. One C-speed pass over the element types (`map(type, ...)`), not a Python loop:
    ~25-30 ns an id, about a fifth of what `json.loads` spends on a line of 2,048 ids (the
    JSONL `tokens_field` path; Arrow and Parquet integer lists never come here)."""
    if isinstance(value, list | tuple) and bool in set(map(type, value)):
        at = next(i for i, v in enumerate(value) if isinstance(v, bool))
        return f"field holds a boolean ({value[at]!r} at index {at}): booleans are not token ids"
    return None


def column_records(col: pa.Array | pa.ChunkedArray, tokens: bool, first: int):
    """(record index, value, None) for each row of `col`, the first numbered `first`; a row
    of token ids holding a boolean is (index, None, why) instead."""
    for i, value in enumerate(column_values(col, tokens), first):
        bad = bool_ids(value) if tokens and isinstance(value, list) else None
        yield (i, None, bad) if bad else (i, value, None)


def column_values(col: pa.Array | pa.ChunkedArray, tokens: bool) -> list:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out: list = []
    for chunk in chunks:
        out += _token_rows(chunk) if tokens else chunk.to_pylist()
    return out


def _token_rows(arr: pa.Array) -> list:
    t = arr.type
    listy = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not listy or not pa.types.is_integer(t.value_type):
        return arr.to_pylist()
    if pa.types.is_fixed_size_list(t):
        flat = arr.flatten()
        if flat.null_count:
            return arr.to_pylist()
        values = flat.to_numpy()
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * t.list_size
    else:
        offsets = arr.offsets.to_numpy()
        values_arr = arr.values
        if values_arr.null_count:
            return arr.to_pylist()
        values = values_arr.to_numpy()
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(arr))]
