"""Arrow arrays from numpy buffers, zero-copy, without `pa.array`.

`pa.array` (and `pa.table` of a dict) imports pandas on its first call when pandas is
installed, to ask whether the input is a pandas object: 294 modules, 0.35-0.5 s here, on the
path to an export's first step (the first block the driver tokenizes, then the first batch).
Building arrays from their buffers never asks, and copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def numeric(a: np.ndarray) -> pa.Array:
    """A 1-D integer or float numpy array as an Arrow array (no nulls), sharing its memory."""
    a = np.ascontiguousarray(a)
    assert a.ndim == 1 and a.dtype.kind in "iuf", a.dtype  # bool is bit-packed in Arrow
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def strings(values: Sequence[str | None]) -> pa.Array:
    """Python strings (None: null) as an Arrow string array."""
    valid = np.array([v is not None for v in values], dtype=bool)
    if not valid.any():
        return pa.nulls(len(values), pa.string())
    data = [v.encode() for v in values if v is not None]
    lengths = np.zeros(len(values), dtype=np.int32)
    lengths[valid] = [len(d) for d in data]
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    bitmap = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))],
                                 null_count=int((~valid).sum()))  # fmt: skip


def view(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numpy view of an integer or float Arrow array without nulls (what `to_numpy()`
    gives, without its pandas import). A chunked array of several chunks is copied once."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    assert arr.null_count == 0, "view() is for arrays without nulls"
    dtype = np.dtype(str(arr.type))
    data = arr.buffers()[1]
    if data is None:  # an empty array
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def valid(arr: pa.Array) -> np.ndarray:
    """Which entries of `arr` are not null, as a bool numpy array."""
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return np.full(len(arr), arr.null_count == 0, dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def to_ipc(batch: pa.RecordBatch) -> bytes:
    """One record batch as an Arrow IPC stream: its schema (metadata included) and only the
    rows it shows, also when it is a slice of a larger batch.

    What the batch service sends a rank. Pickling a record batch goes through Ray's Arrow
    reducer, which rebuilt the schema per call: with the copy that made a slice own its
    rows, ~15% of the server actor's time with 8 ranks (py-spy, bench/serve_ranks.py)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def own(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with buffers of its own, exactly its rows. Arrow's IPC writer writes a slice's
    buffers rounded up (to 8 or 64 bytes) from the memory after its rows, so a slice of a
    larger batch carries some of its neighbours' bytes in its padding: equal data, other
    bytes. A file must be the same bytes however the rows were held (`pipeline/lanes/worker.py`
    `LaneWorker._write`)."""
    return pa.concat_batches([batch])


def from_ipc(data: bytes) -> pa.RecordBatch:
    """The record batch `to_ipc` wrote, reading `data` in place."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
