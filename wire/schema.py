"""The batch schema (SPEC §3.2) and the vectorized assembly of packed rows into it.

Rows arrive as lists of segments; the assembly gathers every segment's tokens with one
`np.concatenate` and scatters them with index arithmetic (no per-token Python). Labels follow
the Hugging Face convention: they are aligned with `input_ids` and the model shifts them, so
-100 on a segment's first token means no token of another document is ever asked to predict
it.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa

from wire.arrays import numeric, strings
from wire.protocol import IGNORE_LABEL

IGNORE = IGNORE_LABEL


@functools.lru_cache(maxsize=16)
def batch_schema(seq_len: int) -> pa.Schema:
    ids = pa.list_(pa.int32(), seq_len)
    return pa.schema(
        [
            ("input_ids", ids),
            ("labels", ids),
            ("position_ids", ids),
            ("segment_ids", ids),
            ("seq_lens", pa.list_(pa.int32())),
            ("stream", pa.list_(pa.dictionary(pa.int32(), pa.string()))),
            ("doc_id", pa.list_(pa.uint64())),
            ("doc_offset", pa.list_(pa.int32())),
        ]
    )


def build_batch(
    rows, seq_len: int, pad_id: int, stream_names: list[str], full: bool = True
) -> pa.RecordBatch:
    """Assemble packed rows (lists of `packing.Segment`) into one record batch.

    With `full=False`, the columns that `input_ids` and `seq_lens` determine are left out
    (wire/layout.py, the compact layout): `position_ids`, `segment_ids`, and `labels`
    when no segment carries a loss mask. The export writes that, and skips computing them."""
    return build_batches([rows], seq_len, pad_id, stream_names, full)[0]


def build_batches(
    steps: list[list], seq_len: int, pad_id: int, stream_names: list[str], full: bool = True
) -> list[pa.RecordBatch]:
    """One record batch per entry of `steps` (each a list of rows), as `build_batch` makes
    it, assembled in one pass over all their rows.

    The assembly's cost is mostly per call (~40 numpy and Arrow calls), not per row: a lane of
    16 makes 2 rows of a 32-row step, and building each step alone was a fifth of its time
    (py-spy, `bench.lane_rates --lanes 16`). Each batch's columns are views of the pass's
    numpy arrays at offset 0 (no Arrow slice, so `.values` and IPC see only its rows), and
    each keeps its own schema: in the compact layout, `labels` only where its rows carry a
    loss mask, as built alone."""
    L = seq_len
    rows = [row for step in steps for row in step]
    n_rows = len(rows)
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n_rows)
    segs = [seg for row in rows for seg in row]
    n_seg = len(segs)
    lens = np.fromiter((s.length for s in segs), dtype=np.int64, count=n_seg)
    offs = np.fromiter((s.offset for s in segs), dtype=np.int64, count=n_seg)
    doc_ids = np.fromiter((s.doc.doc_id for s in segs), dtype=np.uint64, count=n_seg)
    streams = np.fromiter((s.doc.stream for s in segs), dtype=np.int32, count=n_seg)
    has_loss = np.fromiter((s.doc.loss is not None for s in segs), dtype=bool, count=n_seg)

    row_of_seg = np.repeat(np.arange(n_rows, dtype=np.int64), counts)
    seg_start_in_row = _starts_within_groups(lens, counts)
    total = int(lens.sum())
    src_start = np.zeros(n_seg, dtype=np.int64)
    np.cumsum(lens[:-1], out=src_start[1:])
    within = np.arange(total, dtype=np.int64) - np.repeat(src_start, lens)
    dest = np.repeat(row_of_seg * L + seg_start_in_row, lens) + within

    tokens = (
        np.concatenate([s.doc.tokens[s.offset : s.offset + s.length] for s in segs])
        if n_seg
        else np.zeros(0, np.int32)
    )
    input_ids = np.full(n_rows * L, pad_id, dtype=np.int32)
    input_ids[dest] = tokens
    masked = bool(has_loss.any())
    cols: dict[str, np.ndarray] = {"input_ids": input_ids}
    if full or masked:
        cols["labels"] = _labels(segs, n_rows * L, dest, tokens, src_start, lens, masked)
    if full:
        position_ids = np.zeros(n_rows * L, dtype=np.int32)
        position_ids[dest] = within
        segment_ids = np.zeros(n_rows * L, dtype=np.int32)
        segment_ids[dest] = np.repeat(_index_within_groups(counts) + 1, lens)  # 1..k per row
        cols |= {"position_ids": position_ids, "segment_ids": segment_ids}

    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=row_offsets[1:])
    seg_lens, seg_offs = lens.astype(np.int32), offs.astype(np.int32)
    stream_values = strings(stream_names)
    schema = batch_schema(L)
    out = []
    r0 = 0
    for step in steps:
        r1 = r0 + len(step)
        s0, s1 = int(row_offsets[r0]), int(row_offsets[r1])
        if full:
            names = list(FIXED)
        else:  # compact: labels only where a row of this step carries a loss mask
            names = ["input_ids", *(["labels"] if has_loss[s0:s1].any() else [])]
        arrays = [_fixed(cols[n][r0 * L : r1 * L], L) for n in names]
        offsets = numeric((row_offsets[r0 : r1 + 1] - s0).astype(np.int32))
        arrays += [
            pa.ListArray.from_arrays(offsets, numeric(seg_lens[s0:s1])),
            pa.ListArray.from_arrays(
                offsets, pa.DictionaryArray.from_arrays(numeric(streams[s0:s1]), stream_values)
            ),
            pa.ListArray.from_arrays(offsets, numeric(doc_ids[s0:s1])),
            pa.ListArray.from_arrays(offsets, numeric(seg_offs[s0:s1])),
        ]
        names += list(SEGMENT)
        out.append(pa.RecordBatch.from_arrays(
            arrays, schema=schema if full else pa.schema([schema.field(n) for n in names])
        ))  # fmt: skip
        r0 = r1
    return out


FIXED = ("input_ids", "labels", "position_ids", "segment_ids")  # seq_len per row
SEGMENT = ("seq_lens", "stream", "doc_id", "doc_offset")  # one entry per segment of a row


def _labels(segs, size, dest, tokens, src_start, lens, masked) -> np.ndarray:
    label_values = tokens.copy()
    if masked:
        loss = np.concatenate(
            [
                s.doc.loss[s.offset : s.offset + s.length]
                if s.doc.loss is not None
                else np.ones(s.length, np.int8)
                for s in segs
            ]
        )
        label_values[loss == 0] = IGNORE
    label_values[src_start[lens > 0]] = IGNORE  # each segment's first token
    labels = np.full(size, IGNORE, dtype=np.int32)
    labels[dest] = label_values
    return labels


def _fixed(a: np.ndarray, L: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(numeric(a), L)


def _index_within_groups(counts: np.ndarray) -> np.ndarray:
    """For groups of the given sizes, each element's 0-based index within its group."""
    n = int(counts.sum())
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return np.arange(n, dtype=np.int64) - np.repeat(starts, counts)


def _starts_within_groups(lens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Exclusive running sum of `lens`, restarting at every group."""
    run = np.zeros(len(lens), dtype=np.int64)
    if len(lens):
        np.cumsum(lens[:-1], out=run[1:])
    group_starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=group_starts[1:])
    nonempty = counts > 0
    base = np.zeros(len(counts), dtype=np.int64)
    base[nonempty] = run[group_starts[nonempty]]
    return run - np.repeat(base, counts)


def with_metadata(batch: pa.RecordBatch, **meta) -> pa.RecordBatch:
    return batch.replace_schema_metadata({k: str(v) for k, v in meta.items()})
