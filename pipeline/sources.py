"""Sources: resolve a stream's paths to files, cut files into pieces, and read records.

A *piece* is a contiguous run of records of one file: a line-aligned byte range of a JSONL file,
a Parquet row group, an MDS shard, or a whole text file. Pieces carry their first record index,
so every record gets ``doc_id = (file_index << 32) | record_index`` (SPEC §3.2) without reading
what comes before it, which is also what lets a resumed run seek instead of re-reading.

Reading yields ``(record_index, payload, error)``; bad records never raise here. Whether a bad
record stops the run or is counted and skipped is the feed's decision (`on_error`), made in
stream order so that the outcome is deterministic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec

WHOLE_FILE = 0xFFFFFFFF  # record index used for errors that concern a whole file or piece
_EXTENSIONS = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl", ".jsonl.bz2": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".rst": "text",
}  # fmt: skip
_GLOB_CHARS = set("*?[")


def _is_url(path: str) -> bool:
    return "://" in path


def infer_format(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1].lower()
    if name == "index.json":
        return "mds"
    for ext in sorted(_EXTENSIONS, key=len, reverse=True):
        if name.endswith(ext):
            return _EXTENSIONS[ext]
    return None


def _fs_and_path(path: str, base: Path) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    """The filesystem, its path, and whether to present matches as URLs."""
    if _is_url(path):
        fs, p = fsspec.core.url_to_fs(path)
        return fs, p, not path.startswith("file://")
    p = Path(path).expanduser()
    if not p.is_absolute():
        # Relative to the working directory when that matches, else to the config's directory.
        cwd_hit = Path.cwd() / p
        p = cwd_hit if (cwd_hit.exists() or _matches_glob(cwd_hit)) else base / p
    fs = fsspec.filesystem("file")
    return fs, str(p.resolve() if not _GLOB_CHARS & set(str(p)) else p), False


def _matches_glob(p: Path) -> bool:
    s = str(p)
    if not _GLOB_CHARS & set(s):
        return False
    return bool(fsspec.filesystem("file").glob(s))


def resolve_stream_files(stream, base: Path) -> tuple[list[str], str]:
    """Expand a stream's `paths` (globs, directories, URLs) into a sorted, de-duplicated list.

    For MDS the entries are `index.json` files; their shards are listed by `plan_pieces`.
    Raises ValueError naming the pattern that matched nothing, or an unknown format.
    """
    found: set[str] = set()
    for pattern in stream.paths:
        fs, p, as_url = _fs_and_path(pattern, base)
        protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
        if _GLOB_CHARS & set(p):
            matches = [m for m in fs.glob(p) if fs.isfile(m)]
            dirs = [m for m in fs.glob(p) if fs.isdir(m)]
        elif fs.isdir(p):
            matches, dirs = [], [p]
        elif fs.exists(p):
            matches, dirs = [p], []
        else:
            raise ValueError(f"{pattern!r} matches no files")
        for d in dirs if stream.format == "export" else []:
            matches += [f for f in fs.find(d) if _is_export_step(f)]
        for d in dirs if stream.format != "export" else []:
            idx = d.rstrip("/") + "/index.json"
            if stream.format == "mds" or (stream.format is None and fs.exists(idx)):
                if fs.exists(idx):
                    matches.append(idx)
                else:
                    matches += [f for f in fs.find(d) if f.endswith("/index.json")]
            else:
                for f in fs.find(d):
                    name = f.rsplit("/", 1)[-1]
                    if name.startswith("."):
                        continue
                    if stream.format is not None or infer_format(f) is not None:
                        matches.append(f)
        matches = [m for m in matches if not m.rsplit("/", 1)[-1].startswith(".")]
        if not matches:
            raise ValueError(f"{pattern!r} matches no files")
        for m in matches:
            found.add(f"{protocol}://{m}" if as_url else m)
    files = sorted(found)
    fmt = stream.format
    if fmt is None:
        kinds = {infer_format(f) for f in files}
        if None in kinds or len(kinds) != 1:
            example = next(f for f in files if infer_format(f) is None or len(kinds) > 1)
            raise ValueError(
                f"cannot infer one format from the extensions (e.g. {example!r}); set 'format'"
            )
        fmt = kinds.pop()
    if fmt == "export":
        bad = [f for f in files if not _is_export_step(f)]
        if bad:
            raise ValueError(
                "format export needs an export directory or its step-*-rank-*.parquet/.arrow "
                f"files, got {bad[0]!r}"
            )
    if fmt == "mds":
        bad = [f for f in files if not f.endswith("index.json")]
        if bad:
            raise ValueError(
                f"format mds needs index.json files or their directories, got {bad[0]!r}"
            )
    if len(files) >= 1 << 32:
        raise ValueError(f"too many files ({len(files)}) for 32-bit file indices")
    return files, fmt


def _is_export_step(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("step-") and name.endswith((".parquet", ".arrow"))


def open_file(path: str, mode: str = "rb"):
    if _is_url(path):
        return fsspec.open(path, mode, compression="infer").open()
    if path.endswith((".gz", ".zst", ".bz2")):
        return fsspec.open(path, mode, compression="infer").open()
    return open(path, mode)  # noqa: SIM115 - the caller closes it


def _size(path: str) -> int:
    if _is_url(path):
        fs, p = fsspec.core.url_to_fs(path)
        return int(fs.size(p))
    return os.path.getsize(path)


@dataclass(frozen=True)
class Piece:
    """A contiguous run of records of one file.

    jsonl: bytes [start, end) beginning at line `first_record`; text: the whole file;
    parquet: row group `start` whose first row is `first_record`; mds: shard `path` with its
    index entry `meta`. `nbytes` estimates the work, for grouping pieces into read tasks.
    """

    file_index: int
    path: str
    fmt: str
    first_record: int = 0
    start: int = 0
    end: int = -1
    nbytes: int = 0
    meta: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _read_json(path: str) -> Any:
    with open_file(path) as f:
        return json.loads(f.read())


def list_mds_shards(index_files: list[str]) -> list[tuple[str, dict]]:
    """All shards of the given MDS indexes, sorted by shard path: (path, index entry)."""
    shards = []
    for idx in index_files:
        root = idx.rsplit("/", 1)[0]
        try:
            obj = _read_json(idx)
            entries = obj["shards"]
        except Exception as e:
            raise ValueError(f"{idx}: not a readable MDS index.json: {e}") from e
        for entry in entries:
            raw = entry.get("raw_data") or entry.get("zip_data")
            shards.append((f"{root}/{raw['basename']}", entry))
    shards.sort(key=lambda s: s[0])
    return shards


def _jsonl_pieces(fi: int, path: str, size: int, piece_bytes: int) -> list[Piece]:
    """Cut a JSONL file at line starts near every `piece_bytes`, counting lines on the way."""
    if size <= piece_bytes or path.endswith((".gz", ".zst", ".bz2")):
        return [Piece(fi, path, "jsonl", 0, 0, -1, size)]
    pieces, start, first, lines, pos = [], 0, 0, 0, 0
    next_cut = piece_bytes
    with open_file(path) as f:
        while True:
            chunk = f.read(4 << 20)
            if not chunk:
                break
            search_from = 0
            while pos + len(chunk) > next_cut:
                nl = chunk.find(b"\n", max(search_from, next_cut - pos))
                if nl < 0:
                    break
                lines += chunk.count(b"\n", search_from, nl + 1)
                cut = pos + nl + 1
                if cut < size:
                    pieces.append(Piece(fi, path, "jsonl", first, start, cut, cut - start))
                    start, first = cut, lines
                search_from = nl + 1
                next_cut = cut + piece_bytes
            lines += chunk.count(b"\n", search_from)
            pos += len(chunk)
    pieces.append(Piece(fi, path, "jsonl", first, start, -1, size - start))
    return pieces


def plan_pieces(files: list[str], fmt: str, piece_bytes: int) -> list[list[Piece]]:
    """Per file (in file_index order), the pieces it is read in.

    Metadata that cannot be read (a corrupt Parquet footer, say) becomes a single piece whose
    read reports the error, so the decision to skip or fail stays with the feed.
    """
    if fmt == "mds":
        return [
            [
                Piece(
                    fi,
                    path,
                    "mds",
                    0,
                    0,
                    -1,
                    int((meta.get("raw_data") or {}).get("bytes", 0)),
                    meta,
                )
            ]
            for fi, (path, meta) in enumerate(list_mds_shards(files))
        ]
    out = []
    for fi, path in enumerate(files):
        try:
            size = _size(path)
        except OSError:
            out.append([Piece(fi, path, fmt)])
            continue
        if fmt == "jsonl":
            try:
                out.append(_jsonl_pieces(fi, path, size, piece_bytes))
            except OSError:
                out.append([Piece(fi, path, fmt, nbytes=size)])
        elif fmt == "parquet":
            out.append(_parquet_pieces(fi, path, size))
        else:
            out.append([Piece(fi, path, fmt, nbytes=size)])
    return out


def _parquet_pieces(fi: int, path: str, size: int) -> list[Piece]:
    import pyarrow.parquet as pq

    try:
        with open_file(path) as f:
            md = pq.ParquetFile(f).metadata
    except Exception:
        return [Piece(fi, path, "parquet", 0, -1, -1, size)]  # start=-1: report on read
    pieces, first = [], 0
    for rg in range(md.num_row_groups):
        g = md.row_group(rg)
        pieces.append(Piece(fi, path, "parquet", first, rg, rg + 1, int(g.total_byte_size)))
        first += g.num_rows
    return pieces or [Piece(fi, path, "parquet", 0, 0, 0, 0)]


# ---------------------------------------------------------------------------------------------
# Reading records. Each reader yields (record_index, value, error): value is the raw field value
# (validated by `extract`), error a short reason. Errors for a whole piece use WHOLE_FILE.


def read_piece(piece: Piece, field: str) -> Iterator[tuple[int, Any, str | None]]:
    try:
        if piece.fmt == "jsonl":
            yield from _read_jsonl(piece, field)
        elif piece.fmt == "text":
            yield from _read_text(piece)
        elif piece.fmt == "parquet":
            yield from _read_parquet(piece, field)
        elif piece.fmt == "mds":
            yield from _read_mds(piece, field)
        elif piece.fmt == "export":
            yield from _read_export(piece)
        else:  # pragma: no cover - config validation forbids this
            raise ValueError(f"unknown format {piece.fmt}")
    except _PieceError as e:
        yield WHOLE_FILE, None, str(e)


class _PieceError(Exception):
    pass


def _open_or_fail(path: str):
    try:
        return open_file(path)
    except Exception as e:
        raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e


def _read_jsonl(piece: Piece, field: str):
    f = _open_or_fail(piece.path)
    with f:
        try:
            if piece.start:
                f.seek(piece.start)
            data = f.read() if piece.end < 0 else f.read(piece.end - piece.start)
        except Exception as e:
            raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last record; it does not start a new one
    for i, raw in enumerate(lines):
        rec = piece.first_record + i
        if not raw.strip():
            yield rec, None, "empty line"
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as e:
            yield rec, None, f"invalid UTF-8 at byte {e.start}"
            continue
        except ValueError as e:
            yield rec, None, f"invalid JSON: {e}"
            continue
        if not isinstance(obj, dict):
            yield rec, None, f"record is a JSON {type(obj).__name__}, expected an object"
            continue
        if field not in obj:
            yield rec, None, f"missing field {field!r}"
            continue
        yield rec, obj[field], None


def _read_text(piece: Piece):
    f = _open_or_fail(piece.path)
    with f:
        try:
            data = f.read()
        except Exception as e:
            raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
    try:
        yield 0, data.decode("utf-8"), None
    except UnicodeDecodeError as e:
        yield 0, None, f"invalid UTF-8 at byte {e.start}"


def _read_parquet(piece: Piece, field: str):
    import pyarrow.parquet as pq

    f = _open_or_fail(piece.path)
    with f:
        try:
            pf = pq.ParquetFile(f)
            if piece.start < 0:
                pf.metadata  # noqa: B018 - raises the footer error we want to report
            if field not in pf.schema_arrow.names:
                raise _PieceError(f"missing column {field!r} (columns: {pf.schema_arrow.names})")
            col = pf.read_row_group(piece.start, columns=[field]).column(0)
        except _PieceError:
            raise
        except Exception as e:
            raise _PieceError(f"corrupt or unreadable Parquet: {type(e).__name__}: {e}") from e
    for i, value in enumerate(col.to_pylist()):
        yield piece.first_record + i, value, None


def _read_mds(piece: Piece, field: str):
    """Decode an MDS shard with mosaicml-streaming's own reader (its `decode_sample`)."""
    import numpy as np
    from streaming.base.format import reader_from_json

    meta = piece.meta or {}
    reader = reader_from_json("/nonexistent", None, meta)
    try:
        reader.validate(allow_unsafe_types=False)  # never unpickle outside data
    except ValueError as e:
        raise _PieceError(str(e)) from e
    if field not in reader.column_names:
        raise _PieceError(f"missing column {field!r} (columns: {reader.column_names})")
    path = piece.path
    try:
        with open_file(path) as f:
            data = f.read()
    except FileNotFoundError:
        zip_info = meta.get("zip_data")
        if not zip_info:
            raise _PieceError(f"unreadable file: {path} does not exist") from None
        from streaming.base.compression import decompress

        zpath = path.rsplit("/", 1)[0] + "/" + zip_info["basename"]
        try:
            with open_file(zpath) as f:
                data = decompress(meta["compression"], f.read())
        except Exception as e:
            raise _PieceError(f"unreadable shard {zpath}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
    n = int(meta.get("samples", 0))
    try:
        if len(data) < 4 * (n + 2):
            raise ValueError(f"{len(data)} bytes is too short for {n} samples")
        (count,) = np.frombuffer(data[:4], np.uint32)
        if count != n:
            raise ValueError(f"header says {count} samples, index.json says {n}")
        offsets = np.frombuffer(data[4 : 4 * (n + 2)], np.uint32).astype(np.int64)
        if offsets[-1] > len(data) or np.any(np.diff(offsets) < 0):
            raise ValueError("sample offsets run past the end of the shard (truncated?)")
    except ValueError as e:
        raise _PieceError(f"corrupt MDS shard: {e}") from e
    for i in range(n):
        try:
            sample = reader.decode_sample(data[offsets[i] : offsets[i + 1]])
            yield i, sample[field], None
        except Exception as e:
            yield i, None, f"corrupt sample: {type(e).__name__}: {e}"


def _read_export(piece: Piece):
    """Documents of one export step file: its rows' segments, in order (SPEC §3.2 schema).

    Value: (tokens int32, loss int8) where loss is 1 where `labels` is not -100. Consecutive
    segments of one document (same `stream` and `doc_id`, contiguous `doc_offset`: a document
    split across rows of this file) are joined back into one. The record index counts the documents of
    the file. A segment's first token always has label -100 (SPEC §3.2), so its loss flag is
    0 here; re-packing masks it again anyway.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = _open_or_fail(piece.path)
    with f:
        try:
            if piece.path.endswith(".arrow"):
                table = pa.ipc.open_file(pa.BufferReader(f.read())).read_all()
            else:
                table = pq.read_table(f)
            need = ["input_ids", "labels", "seq_lens", "stream", "doc_id", "doc_offset"]
            missing = [c for c in need if c not in table.column_names]
            if missing:
                raise _PieceError(f"not a tokenmill export step file: no column {missing[0]!r}")
            ids = table.column("input_ids").combine_chunks()
            L = ids.type.list_size
            ids = ids.values.to_numpy().reshape(-1, L)
            labels = table.column("labels").combine_chunks().values.to_numpy().reshape(-1, L)
            lens = table.column("seq_lens").to_pylist()
            docs = table.column("doc_id").to_pylist()
            streams = table.column("stream").to_pylist()
            offsets = table.column("doc_offset").to_pylist()
        except _PieceError:
            raise
        except Exception as e:
            raise _PieceError(f"corrupt or unreadable export file: {type(e).__name__}: {e}") from e
    record, pending, last = 0, None, None
    for r in range(len(lens)):
        a = 0
        for n, name, doc, off in zip(lens[r], streams[r], docs[r], offsets[r], strict=True):
            tokens = ids[r, a : a + n]
            loss = (labels[r, a : a + n] != -100).astype(np.int8)
            a += n
            if pending is not None and last == (name, doc, off):
                pending = (np.concatenate([pending[0], tokens]), np.concatenate([pending[1], loss]))
            else:
                if pending is not None:
                    yield piece.first_record + record, pending, None
                    record += 1
                pending = (tokens.astype(np.int32), loss)
            last = (name, doc, off + n)
    if pending is not None:
        yield piece.first_record + record, pending, None
