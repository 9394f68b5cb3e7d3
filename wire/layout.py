"""Export step files: the full batch schema, or a compact layout that a reader expands.

`full` writes every column of the batch schema (wire/schema.py), as served. `compact` (the
default of `tokenmill export`) leaves out what the other columns determine:

- `position_ids` and `segment_ids` follow from `seq_lens` (0,1,2… and 1..k per segment);
- `labels` follow from `input_ids` and `seq_lens` (-100 on each segment's first token and on
  padding), unless some token carries no loss (chat prompts, pre-tokenized chat); then
  `labels` is written as it is.

Writing a step in the full layout cost 4.4 ms against 1.7 ms compact (16 x 2048 tokens,
Parquet zstd, this 2-core machine), and twice the bytes (1.97 against 0.94 bytes/token):
about 3 core-seconds per 36M tokens taken from the tokenizer workers' two cores.
`expand` restores the full batch bit for bit; `read_step` reads either layout, and the
`format: export` source reads through it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wire.arrays import numeric, view
from wire.schema import IGNORE, batch_schema

LAYOUTS = ("compact", "full")
DERIVED = ("position_ids", "segment_ids")  # always derivable from seq_lens
LAYOUT_KEY = b"layout"


def compact(batch: pa.RecordBatch, keep_labels: bool) -> pa.RecordBatch:
    """The batch without its derivable columns.

    `labels` stays when `keep_labels` (the writer asks for it when a stream can mask tokens,
    so every file of the export has the same columns) or when this step's labels are not the
    derived ones: correctness never depends on the writer's guess.
    """
    if is_compact(batch):  # built compact
        return _with_labels(batch) if keep_labels else batch
    drop = set(DERIVED)
    if not keep_labels and _derivable_labels_equal(batch):
        drop.add("labels")
    keep = [i for i, name in enumerate(batch.schema.names) if name not in drop]
    meta = dict(batch.schema.metadata or {})
    meta[LAYOUT_KEY] = b"compact"
    return pa.RecordBatch.from_arrays(
        [batch.column(i) for i in keep],
        schema=pa.schema([batch.schema.field(i) for i in keep], metadata=meta),
    )


def expand(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch in the served schema, whichever layout it was stored in.

    Also normalizes what a file format renames (Parquet calls a list's values `element`), so
    a step read back equals the batch that was served, field names included.
    """
    L = batch.column("input_ids").type.list_size
    if not is_compact(batch):
        return batch.cast(batch_schema(L).with_metadata(batch.schema.metadata))
    cols = {name: _fixed(a, L) for name, a in tensor_columns(batch).items() if name != "input_ids"}
    meta = {k: v for k, v in (batch.schema.metadata or {}).items() if k != LAYOUT_KEY}
    schema = batch_schema(L).with_metadata(meta)
    return pa.RecordBatch.from_arrays(
        [cols[name] if name in cols else batch.column(name) for name in schema.names],
        names=schema.names,
    ).cast(schema)


def is_compact(batch: pa.RecordBatch) -> bool:
    return (batch.schema.metadata or {}).get(LAYOUT_KEY) == b"compact"


def tensor_columns(batch: pa.RecordBatch, dtype=np.int32) -> dict[str, np.ndarray]:
    """`input_ids`, `labels`, `position_ids`, `segment_ids` of a batch of either layout, each
    a flat numpy array of rows x L, without building Arrow arrays for the derived ones: what
    a trainer rank turns into tensors (trainer/feed.py). The columns stored are views of the
    batch (int32); the derived ones are made in `dtype`, so that a rank that wants int64
    makes them as such and copies only the stored ones: each copy is memory to fault in, and
    a rank's decode in fresh memory took ~4x the CPU of one in reused memory (a microbench)."""
    L = batch.column("input_ids").type.list_size
    n = batch.num_rows

    def flat(name: str) -> np.ndarray:
        col = batch.column(name)
        return view(col.values)[col.offset * L : (col.offset + n) * L]

    ids = flat("input_ids")
    if not is_compact(batch):
        return {name: flat(name) for name in ("input_ids", "labels", "position_ids", "segment_ids")}
    positions, segments, starts = _positions(batch.column("seq_lens"), n, L, dtype)
    labels = (
        flat("labels")
        if "labels" in batch.schema.names
        else _derived_labels(ids, segments, starts, dtype)
    )
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "segment_ids": segments}


def _with_labels(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A compact batch with its `labels` column (derived if it has none)."""
    if "labels" in batch.schema.names:
        return batch
    L = batch.column("input_ids").type.list_size
    labels = _fixed(tensor_columns(batch)["labels"], L)
    field = batch_schema(L).field("labels")
    return batch.add_column(1, field, labels)


def step_path(out: Path, step: int, rank: int, fmt: str) -> Path:
    """Where an export keeps rank `rank`'s rows of `step` (`fmt` parquet or arrow)."""
    ext = {"parquet": "parquet", "arrow": "arrow"}[fmt]  # mds: one dataset (service/export.py)
    return out / f"step-{step:08d}-rank-{rank}.{ext}"


def write_step(batch: pa.RecordBatch, path: Path, fmt: str) -> None:
    """One step file, whole or not at all (written aside, then renamed)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    if fmt == "parquet":
        # No dictionary pages: token ids barely repeat within a step, so dictionary encoding
        # is wasted work (measured: 8.1M -> 13.5M tokens/s written, 2.90 -> 2.25 bytes/token).
        # LZ4, not zstd: a compact step of 16 x 2048 man-page tokens took 1.19 ms against
        # 2.30 ms, at 1.10 against 0.81 bytes/token (uncompressed: 1.00 ms, 4.10 bytes/token).
        # The writer shares the tokenizer workers' cores; the disk is rarely what is short.
        pq.write_table(pa.Table.from_batches([batch]), tmp, compression="lz4", use_dictionary=False)
    else:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
    os.replace(tmp, path)


def read_step(path) -> pa.RecordBatch:
    """One export step file (Parquet or Arrow IPC, either layout) as a full-schema batch."""
    path = str(path)
    if path.endswith(".arrow"):
        with pa.memory_map(path) as source:
            table = pa.ipc.open_file(source).read_all()
    else:
        table = pq.read_table(path)
    return expand_table(table)


def expand_table(table: pa.Table) -> pa.RecordBatch:
    """A step file's table (one or more record batches, either layout) as one full batch."""
    batch = table.combine_chunks().to_batches()
    one = batch[0] if batch else pa.RecordBatch.from_pylist([], schema=table.schema)
    return expand(one.replace_schema_metadata(table.schema.metadata))


# -- derivation --------------------------------------------------------------------------------


def _positions(lens_col: pa.ListArray, n_rows: int, L: int, dtype=np.int32):
    """(position_ids, segment_ids, first-token flags) as flat `dtype`/bool arrays of
    n_rows * L.

    Every row is its documents, then its padding: one run per document and one per row's
    padding (possibly empty), laid end to end over all rows. A position is the distance to
    its run's start; a segment is the document's number in its row (1, 2, ...), 0 in padding.
    """
    lens = view(lens_col.flatten()).astype(np.int64)
    counts = np.diff(view(lens_col.offsets)).astype(np.int64)
    ends = np.cumsum(counts)  # where each row's documents end in `lens`
    pads = L - np.bincount(
        np.repeat(np.arange(n_rows), counts), weights=lens, minlength=n_rows
    ).astype(np.int64)
    runs = np.insert(lens, ends, pads)  # row r's padding after its documents
    number = (
        np.arange(len(runs), dtype=np.int64)
        - np.repeat(ends - counts + np.arange(n_rows), counts + 1)
        + 1
    )
    number[ends + np.arange(n_rows)] = 0  # the padding runs
    run_start = np.cumsum(runs) - runs
    positions = np.arange(n_rows * L, dtype=np.int64)
    positions -= np.repeat(run_start, runs)
    positions = positions.astype(dtype, copy=False)
    segments = np.repeat(number, runs).astype(dtype, copy=False)
    positions[segments == 0] = 0
    starts = np.zeros(n_rows * L, dtype=bool)
    starts[run_start[(number > 0) & (runs > 0)]] = True
    return positions, segments, starts


def _derived_labels(
    ids: np.ndarray, segments: np.ndarray, starts: np.ndarray, dtype=np.int32
) -> np.ndarray:
    labels = ids.astype(dtype, copy=True)
    labels[(segments == 0) | starts] = IGNORE
    return labels


def _derivable_labels_equal(batch: pa.RecordBatch) -> bool:
    """Whether `labels` is exactly what `expand` would derive (no token without loss).

    The feed's labels are -100 on every segment's first token and on padding, and on masked
    tokens besides (wire/schema.py). So they equal the derived ones exactly when they hold
    no more -100s than first tokens plus padding: one count, no derivation per step.
    """
    lens = view(batch.column("seq_lens").flatten())
    L = batch.column("input_ids").type.list_size
    expected = int(np.count_nonzero(lens)) + batch.num_rows * L - int(lens.sum())
    labels = view(batch.column("labels").flatten())
    return int(np.count_nonzero(labels == IGNORE)) == expected


def _fixed(a: np.ndarray, L: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(numeric(a), L)
