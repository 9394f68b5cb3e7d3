"""The batch schema and the vectorized assembly of packed rows into it.

Rows arrive as lists of segments; the assembly gathers every segment's tokens with one
`np.concatenate` and scatters them with index arithmetic (no per-token Python). Labels follow
the Hugging Face convention: they are aligned with `input_ids` and the model shifts them, so
-100 on a segment's first token means no token of another document is ever asked to predict
it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    a = _assemble(steps, seq_len, pad_id, full)
    L = seq_len
    stream_values = strings(stream_names)
    schema = batch_schema(L)
    out = []
    r0 = 0
    for j, step in enumerate(steps):
        r1 = r0 + len(step)
        s0, s1 = int(a.row_offsets[r0]), int(a.row_offsets[r1])
        # compact: labels only where a row of this step carries a loss mask
        names = list(FIXED) if full else ["input_ids", *(["labels"] if a.masked[j] else [])]
        arrays = [_fixed(a.cols[n][r0 * L : r1 * L], L) for n in names]
        offsets = numeric((a.row_offsets[r0 : r1 + 1] - s0).astype(np.int32))
        arrays += _segment_lists(a, offsets, s0, s1, stream_values)
        names += list(SEGMENT)
        out.append(pa.RecordBatch.from_arrays(
            arrays, schema=schema if full else pa.schema([schema.field(n) for n in names])
        ))  # fmt: skip
        r0 = r1
    return out


@dataclass(frozen=True)
class StepChunk:
    """Consecutive steps' rows in one record batch (`build_chunk`), and what each step
    counts: what a lane that holds its steps keeps (pipeline/lanes/worker.py `LaneWorker`).

    Built per step, a lane of 16 paid for ~12 Arrow objects and a receipt per step of two
    rows; as a chunk it pays them once per call, and a step's rows are sliced out when a
    rank takes them (`part`). `step(j)` is step j as `build_batches` and the feed make it:
    the same schema (in the compact layout, `labels` only where its rows carry a loss mask)
    and metadata, and the same bytes."""

    batch: pa.RecordBatch  # every step's rows; `labels` in the compact layout if any needs it
    first: int  # the first step's number
    starts: np.ndarray  # row where each step begins, and the end (n + 1)
    masked: np.ndarray  # per step: a row carries a loss mask (compact: it keeps `labels`)
    full: bool
    meta: dict[str, str]  # every step's metadata but its `global_step`
    real_tokens: np.ndarray  # per step
    tokens: np.ndarray  # per step and stream (n x S)
    docs: np.ndarray  # documents started, per step and stream (n x S)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def rows(self, j: int) -> int:
        return int(self.starts[j + 1] - self.starts[j])

    def labelled(self, j: int) -> bool:
        """Does step j's batch have a `labels` column?"""
        return self.full or bool(self.masked[j])

    def names(self, j: int) -> tuple[str, ...]:
        """Step j's columns."""
        names = tuple(self.batch.schema.names)
        return names if self.labelled(j) else tuple(n for n in names if n != "labels")

    def part(self, j: int, lo: int, hi: int) -> pa.RecordBatch:
        """Rows [lo, hi) of step j, in step j's schema, without metadata."""
        part = self.batch.slice(int(self.starts[j]) + lo, hi - lo)
        if not self.labelled(j) and "labels" in part.schema.names:
            part = part.drop_columns(["labels"])
        return part

    def metadata(self, j: int) -> dict[str, str]:
        return {"global_step": str(self.first + j), **self.meta}

    def step(self, j: int) -> pa.RecordBatch:
        """Step j, as it was made."""
        return self.part(j, 0, self.rows(j)).replace_schema_metadata(self.metadata(j))


def build_chunk(
    steps: list[list], seq_len: int, pad_id: int, stream_names: list[str], full: bool,
    first: int, meta: dict,
) -> StepChunk:  # fmt: skip
    """`steps` (each a list of rows, the first numbered `first`) as one StepChunk: the rows
    of `build_batches`, in one record batch, and each step's counts (`meta`: every step's
    metadata but its `global_step`)."""
    a = _assemble(steps, seq_len, pad_id, full)
    L, n = seq_len, len(steps)
    names = list(FIXED) if full else ["input_ids", *(["labels"] if a.masked.any() else [])]
    arrays = [_fixed(a.cols[c], L) for c in names]
    arrays += _segment_lists(a, numeric(a.row_offsets.astype(np.int32)), 0, len(a.lens),
                             strings(stream_names))  # fmt: skip
    schema = batch_schema(L)
    batch = pa.RecordBatch.from_arrays(
        arrays, schema=pa.schema([schema.field(c) for c in [*names, *SEGMENT]])
    )
    S = len(stream_names)
    step_of_seg = np.repeat(np.arange(n, dtype=np.int64), a.step_segs)
    key = step_of_seg * S + a.streams
    tokens = np.bincount(key, weights=a.lens, minlength=n * S).astype(np.int64).reshape(n, S)
    starts_doc = a.offs == 0
    docs = np.bincount(key[starts_doc], minlength=n * S).astype(np.int64).reshape(n, S)
    return StepChunk(batch, first, a.step_starts, a.masked, full,
                     {k: str(v) for k, v in meta.items()}, tokens.sum(axis=1), tokens, docs)  # fmt: skip


@dataclass(frozen=True)
class _Assembled:
    """The columns of consecutive steps' rows (`_assemble`), before they become Arrow."""

    cols: dict[str, np.ndarray]  # input_ids, and labels, position_ids, segment_ids if made
    row_offsets: np.ndarray  # each row's first segment, and the end (rows + 1)
    lens: np.ndarray  # per segment
    offs: np.ndarray
    doc_ids: np.ndarray
    streams: np.ndarray
    step_starts: np.ndarray  # each step's first row, and the end (steps + 1)
    step_segs: np.ndarray  # segments per step
    masked: np.ndarray  # per step: a segment carries a loss mask


def _assemble(steps: list[list], seq_len: int, pad_id: int, full: bool) -> _Assembled:
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

    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=row_offsets[1:])
    src_start = np.zeros(n_seg + 1, dtype=np.int64)  # each segment's first token, and the end
    np.cumsum(lens, out=src_start[1:])
    # A row's segments lie back to back from its first slot, the padding after them: the
    # slots a row fills are its first `row_lens` ones, in order. A boolean mask of them takes
    # the tokens in one assignment (an index per token took ~1.8x as long: 8.1 ms against
    # 4.6 ms for 32 steps of 32 rows of 2,048).
    row_lens = src_start[row_offsets[1:]] - src_start[row_offsets[:-1]]
    filled = np.arange(L, dtype=np.int64) < row_lens[:, None]
    src_start = src_start[:-1]

    tokens = (
        np.concatenate([s.doc.tokens[s.offset : s.offset + s.length] for s in segs])
        if n_seg
        else np.zeros(0, np.int32)
    )
    input_ids = np.full((n_rows, L), pad_id, dtype=np.int32)
    input_ids[filled] = tokens
    input_ids = input_ids.reshape(n_rows * L)
    masked = bool(has_loss.any())
    cols: dict[str, np.ndarray] = {"input_ids": input_ids}
    if full or masked:
        dest = np.flatnonzero(filled)  # each token's slot
        cols["labels"] = _labels(segs, n_rows * L, dest, tokens, src_start, lens, masked)
    if full:
        within = _index_within_groups(lens)  # each token's place in its segment
        position_ids = np.zeros(n_rows * L, dtype=np.int32)
        position_ids[dest] = within
        segment_ids = np.zeros(n_rows * L, dtype=np.int32)
        segment_ids[dest] = np.repeat(_index_within_groups(counts) + 1, lens)  # 1..k per row
        cols |= {"position_ids": position_ids, "segment_ids": segment_ids}

    step_starts = np.zeros(len(steps) + 1, dtype=np.int64)
    np.cumsum([len(step) for step in steps], out=step_starts[1:])
    seg_bounds = row_offsets[step_starts]
    loss_run = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(has_loss, out=loss_run[1:])
    return _Assembled(cols, row_offsets, lens, offs, doc_ids, streams, step_starts,
                      np.diff(seg_bounds), loss_run[seg_bounds[1:]] > loss_run[seg_bounds[:-1]])  # fmt: skip


def _segment_lists(a: _Assembled, offsets: pa.Array, s0: int, s1: int, stream_values: pa.Array
                   ) -> list[pa.Array]:  # fmt: skip
    """The per-segment list columns (SEGMENT) of segments [s0, s1), rows cut by `offsets`."""
    return [
        pa.ListArray.from_arrays(offsets, numeric(a.lens[s0:s1].astype(np.int32))),
        pa.ListArray.from_arrays(
            offsets, pa.DictionaryArray.from_arrays(numeric(a.streams[s0:s1]), stream_values)
        ),
        pa.ListArray.from_arrays(offsets, numeric(a.doc_ids[s0:s1])),
        pa.ListArray.from_arrays(offsets, numeric(a.offs[s0:s1].astype(np.int32))),
    ]


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


def with_metadata(batch: pa.RecordBatch, **meta) -> pa.RecordBatch:
    return batch.replace_schema_metadata({k: str(v) for k, v in meta.items()})
