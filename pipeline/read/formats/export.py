"""`format: export`: a `tokenmill export` directory read back as pre-tokenized documents.

The step files (`step-*-rank-*.parquet|.arrow`, either layout, in name order: global order) are
one piece each; an MDS export (`DIR/mds/index.json`, columns `input_ids`, `labels`, `seq_lens`)
is read shard by shard. A record is a document: `(tokens int32, loss int8)`, where the loss is
1 where `labels` is not -100. Step files carry `stream`/`doc_id`/`doc_offset`, so the segments
of a document split across rows of one file are joined again; MDS rows carry no document ids,
so there each segment is a document. The ids are used as they are (EOS included, nothing added).
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.read.access import Access, Piece, PieceError, open_or_fail
from pipeline.read.formats import Format, ReadSpec, mds

_STEP = re.compile(r"step-\d+-rank-\d+\.(parquet|arrow)")
SUMMARY = "summary.json"


def is_step(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("step-") and name.endswith((".parquet", ".arrow"))


class Export(Format):
    name = "export"
    metadata = (SUMMARY,)
    pretokenized = True

    def claims(self, name: str) -> bool:
        return _STEP.fullmatch(name) is not None

    def recognizes(self, fs, directory: str) -> bool:
        d = directory.rstrip("/")
        return fs.exists(f"{d}/{SUMMARY}") and bool(self.expand(fs, directory))

    def expand(self, fs, directory: str) -> list[str]:
        """The step files below `directory`, else its MDS export (`mds/index.json`)."""
        found = fs.find(directory)
        steps = [f for f in found if is_step(f)]
        if steps:
            return steps
        return [f for f in found if f.endswith(f"/{mds.INDEX}")]

    def check_files(self, files: list[str]) -> None:
        indexes = [f for f in files if f.endswith(mds.INDEX)]
        bad = [f for f in files if not is_step(f)] if len(indexes) != len(files) else []
        if bad:
            raise ValueError(
                "format export needs an export directory or its step-*-rank-*.parquet/.arrow "
                f"files (or its MDS index.json), got {bad[0]!r}"
            )

    def data_files(self, files, access):
        return mds.FORMAT.data_files(files, access) if _is_mds(files) else files

    def plan(self, files, piece_bytes, max_record, access):
        if _is_mds(files):
            return mds.shard_pieces(files, self.name, access)
        return super().plan(files, piece_bytes, max_record, access)

    def read(self, piece: Piece, spec: ReadSpec):
        if piece.meta is not None:
            return _read_mds_rows(piece, spec.access)
        return _read_steps(piece, spec.access)


FORMAT = Export()


def _is_mds(files: list[str]) -> bool:
    return bool(files) and all(f.endswith(mds.INDEX) for f in files)


def _read_mds_rows(piece: Piece, access: Access):
    """The segments of an MDS export shard's rows, each a document, in order."""
    record = 0
    for i, sample, err in mds.iter_samples(piece, mds.EXPORT_COLUMNS, access):
        if sample is None:
            yield record, None, f"row {i}: {err}"
            record += 1
            continue
        ids = np.asarray(sample["input_ids"])
        labels = np.asarray(sample["labels"])
        a = 0
        for n in np.asarray(sample["seq_lens"]).tolist():
            if n <= 0 or a + n > len(ids):
                yield record, None, f"row {i}: seq_lens {sample['seq_lens'].tolist()} do not fit"
                record += 1
                break
            loss = (labels[a : a + n] != -100).astype(np.int8)
            yield record, (ids[a : a + n].astype(np.int32), loss), None
            record += 1
            a += n


def _read_steps(piece: Piece, access: Access):
    """Documents of one export step file: its rows' segments, in order (the batch schema, wire/schema.py).

    Value: (tokens int32, loss int8) where loss is 1 where `labels` is not -100. Consecutive
    segments of one document (same `stream` and `doc_id`, contiguous `doc_offset`: a document
    split across rows of this file) are joined back into one. The record index counts the documents of
    the file. A segment's first token always has label -100 (wire/schema.py), so its loss flag is
    0 here; re-packing masks it again anyway.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from wire.layout import is_compact

    f = open_or_fail(piece.path, access)
    with f:
        try:
            if piece.path.endswith(".arrow"):
                table = pa.ipc.open_file(pa.BufferReader(f.read())).read_all()
            else:  # one file: pq.read_table would plan a dataset for it (~1.4x the time)
                table = pq.ParquetFile(f).read()
            need = ["input_ids", "seq_lens", "stream", "doc_id", "doc_offset"]
            missing = [c for c in need if c not in table.column_names]
            if missing:
                raise PieceError(f"not a tokenmill export step file: no column {missing[0]!r}")
            # Either layout (wire/layout.py), read as stored: only the loss flags are needed of
            # what a full batch derives, so none of the derived columns is built here.
            derived = "labels" not in table.column_names
            if derived and not is_compact(table):
                raise PieceError("not a tokenmill export step file: no column 'labels'")
            L = table.schema.field("input_ids").type.list_size
            ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
            ids = ids.reshape(-1, L).astype(np.int32, copy=False)
            if derived:  # -100 only on each segment's first token (and padding): set below
                flags = np.ones(ids.shape, dtype=np.int8)
            else:
                labels = table.column("labels").combine_chunks().flatten().to_numpy()
                flags = (labels != -100).view(np.int8).reshape(-1, L)
            lens = table.column("seq_lens").to_pylist()
            docs = table.column("doc_id").to_pylist()
            streams = table.column("stream").to_pylist()
            offsets = table.column("doc_offset").to_pylist()
        except PieceError:
            raise
        except Exception as e:
            raise PieceError(f"corrupt or unreadable export file: {type(e).__name__}: {e}") from e
    record, pending, last = 0, None, None
    for r in range(len(lens)):
        a = 0
        for n, name, doc, off in zip(lens[r], streams[r], docs[r], offsets[r], strict=True):
            if derived and n:
                flags[r, a] = 0  # the segment's first token has no loss
            tokens, loss = ids[r, a : a + n], flags[r, a : a + n]
            a += n
            if pending is not None and last == (name, doc, off):
                pending = (np.concatenate([pending[0], tokens]), np.concatenate([pending[1], loss]))
            else:
                if pending is not None:
                    yield piece.first_record + record, pending, None
                    record += 1
                pending = (tokens, loss)
            last = (name, doc, off + n)
    if pending is not None:
        yield piece.first_record + record, pending, None
