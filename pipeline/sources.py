"""Sources: resolve a stream's paths to files, cut files into pieces, and read records.

A *piece* is a contiguous run of records of one file: a line-aligned byte range of a JSONL file,
a Parquet row group, an MDS shard, or a whole text file. Pieces carry their first record index,
so every record gets ``doc_id = (file_index << 32) | record_index`` (SPEC §3.2) without reading
what comes before it, which is also what lets a resumed run seek instead of re-reading.

Reading yields ``(record_index, payload, error)``; bad records never raise here. Whether a bad
record stops the run or is counted and skipped is the feed's decision (`on_error`), made in
stream order so that the outcome is deterministic.

JSONL is read as a stream of lines, `_CHUNK` bytes at a time, whatever the compression: memory
per reader is one chunk plus one record, and a line longer than `read.max_record_bytes` is
read past and rejected (a one-line decompression bomb costs time, not memory). What hostile
files turn into (issue 13: no bad input may lose good data):

- A damaged stream (a truncated or corrupt `.gz`, a read error) keeps every complete line
  before the damage; the damage is one reject at the record index where it happened.
- A file whose first MiB holds a CR and no LF (classic Mac line endings) has its lines split
  at CRs; such files, like compressed ones, are read whole (one piece). Any other file is
  split at LF only: in CRLF files and inside records the CR is JSON whitespace.
- A `.gz`/`.bz2`/`.zst` file that does not start with its format's magic bytes is read as the
  plain file it is (the content decides, not the name).
- JSON that the parser cannot take (invalid, nested too deeply for its recursion limit, ...)
  is a reject naming the record, never an exception out of the reader.
- Text with a lone surrogate (JSON can spell one as "\\ud800"; no UTF-8 file can) is
  rejected by the validators in `reading`/`chat`, so check, stats and export agree.
- MDS `index.json` entries are validated up front (`list_mds_shards`): a malformed entry or a
  shard name that leaves the dataset directory is an error naming the index and shard number.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec

from pipeline.config import MAX_RECORD_BYTES

WHOLE_FILE = 0xFFFFFFFF  # record index used for errors that concern a whole file or piece
_CHUNK = 1 << 20  # JSONL bytes read at a time: memory per reader is this plus one record
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


_MAGIC = {".gz": b"\x1f\x8b", ".bz2": b"BZh", ".zst": b"\x28\xb5\x2f\xfd"}


def _compressed(path: str) -> bool:
    """Whether a file named as compressed really is: its first bytes are the format's magic.

    A `.gz` (`.bz2`, `.zst`) file that holds plain text is read as the plain text it is.
    """
    magic = next((m for ext, m in _MAGIC.items() if path.endswith(ext)), None)
    if magic is None:
        return False
    with fsspec.open(path, "rb").open() if _is_url(path) else open(path, "rb") as f:
        return f.read(len(magic)) == magic


def open_file(path: str, mode: str = "rb"):
    if _compressed(path):
        return fsspec.open(path, mode, compression="infer").open()
    if _is_url(path):
        return fsspec.open(path, mode).open()
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
    `max_record`: a JSONL line or text file longer than this many bytes is rejected unread.
    """

    file_index: int
    path: str
    fmt: str
    first_record: int = 0
    start: int = 0
    end: int = -1
    nbytes: int = 0
    meta: dict | None = None
    max_record: int = MAX_RECORD_BYTES  # read.max_record_bytes

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
        if not isinstance(entries, list):
            raise ValueError(f"{idx}: 'shards' is a {type(entries).__name__}, expected a list")
        for n, entry in enumerate(entries):
            shards.append((f"{root}/{_shard_basename(idx, n, entry)}", entry))
    shards.sort(key=lambda s: s[0])
    return shards


def _shard_basename(idx: str, n: int, entry: Any) -> str:
    """Validate shard `n` of MDS index `idx`; its file name, relative to the index's directory.

    A name that would leave the dataset directory (absolute, or with a `..` component) is
    refused, as is an entry without a usable `raw_data`/`zip_data` basename or sample count.
    """
    where = f"{idx}: shard {n}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: entry is a JSON {type(entry).__name__}, expected an object")
    infos = {k: entry.get(k) for k in ("raw_data", "zip_data") if entry.get(k) is not None}
    if not infos:
        raise ValueError(f"{where}: has neither 'raw_data' nor 'zip_data'")
    for key, info in infos.items():
        name = info.get("basename") if isinstance(info, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: {key}.basename must be a file name, got {name!r}")
        if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
            raise ValueError(f"{where}: {key}.basename {name!r} leaves the dataset directory")
    samples = entry.get("samples")
    if type(samples) is not int or samples < 0:
        raise ValueError(f"{where}: 'samples' must be a count >= 0, got {samples!r}")
    return (infos.get("raw_data") or infos["zip_data"])["basename"]


def _jsonl_pieces(
    fi: int, path: str, size: int, piece_bytes: int, max_record: int = MAX_RECORD_BYTES
) -> list[Piece]:
    """Cut a JSONL file at line starts near every `piece_bytes`, counting lines on the way.

    Compressed files and files whose lines end in a bare CR are read whole, as one piece.
    """
    whole = [Piece(fi, path, "jsonl", 0, 0, -1, size, max_record=max_record)]
    if size <= piece_bytes or path.endswith((".gz", ".zst", ".bz2")):
        return whole
    pieces, start, first, lines, pos = [], 0, 0, 0, 0
    next_cut = piece_bytes
    with open_file(path) as f:
        while True:
            chunk = f.read(4 << 20)
            if not chunk:
                break
            if pos == 0 and _cr_lines(chunk):
                return whole
            search_from = 0
            while pos + len(chunk) > next_cut:
                nl = chunk.find(b"\n", max(search_from, next_cut - pos))
                if nl < 0:
                    break
                lines += chunk.count(b"\n", search_from, nl + 1)
                cut = pos + nl + 1
                if cut < size:
                    pieces.append(
                        Piece(fi, path, "jsonl", first, start, cut, cut - start, None, max_record)
                    )
                    start, first = cut, lines
                search_from = nl + 1
                next_cut = cut + piece_bytes
            lines += chunk.count(b"\n", search_from)
            pos += len(chunk)
    pieces.append(Piece(fi, path, "jsonl", first, start, -1, size - start, None, max_record))
    return pieces


def _cr_lines(head: bytes) -> bool:
    """Whether a file starting with `head` has classic Mac line endings (bare CRs).

    Decided on the first `_CHUNK` bytes alone, by the planner and the reader alike: a CR and
    no LF there. (A CR inside a record of a valid LF file is JSON whitespace; an LF follows
    within the first chunk unless that record is longer than a chunk.)
    """
    head = head[:_CHUNK]
    return b"\r" in head and b"\n" not in head


def plan_pieces(
    files: list[str], fmt: str, piece_bytes: int, max_record: int = MAX_RECORD_BYTES
) -> list[list[Piece]]:
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
                    _int_or_0((meta.get("raw_data") or {}).get("bytes", 0)),
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
            out.append([Piece(fi, path, fmt, max_record=max_record)])
            continue
        if fmt == "jsonl":
            try:
                out.append(_jsonl_pieces(fi, path, size, piece_bytes, max_record))
            except OSError:
                out.append([Piece(fi, path, fmt, nbytes=size, max_record=max_record)])
        elif fmt == "parquet":
            out.append(_parquet_pieces(fi, path, size))
        else:
            out.append([Piece(fi, path, fmt, nbytes=size, max_record=max_record)])
    return out


def _int_or_0(v: Any) -> int:
    return v if type(v) is int and v >= 0 else 0


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


def _chunks(f, limit: int, failed: list[Exception]) -> Iterator[bytes]:
    """`f`'s bytes, up to `limit` (-1: all), a chunk at a time; a read error ends them, kept
    in `failed`."""
    # read1 where there is one: a decompressor's read(n) that hits damage raises and drops
    # what it had decompressed of those n bytes; read1 returns that data first.
    read = getattr(f, "read1", f.read)
    left = limit
    while left:
        try:
            chunk = read(_CHUNK if left < 0 else min(_CHUNK, left))
        except Exception as e:
            failed.append(e)
            return
        if not chunk:
            return
        if left > 0:
            left -= len(chunk)
        yield chunk


def _lines(f, limit: int, max_record: int, detect_cr: bool) -> Iterator[tuple[bytes | None, str]]:
    """The records of a byte stream, one per line: (line, "") or (None, why it is bad).

    Reads at most `limit` bytes (-1: to the end) in `_CHUNK`s, never holding more than one
    record: a line longer than `max_record` is read past and reported. A read error (a
    truncated or corrupt compressed stream) ends the records with one reported as damaged;
    every complete line before it is kept. With `detect_cr`, a stream whose first `_CHUNK`
    bytes hold a CR and no LF is split at CRs (`_cr_lines`).
    """
    failed: list[Exception] = []
    chunks, sep, pos = _chunks(f, limit, failed), b"\n", 0
    head: list[bytes] = []
    if detect_cr:  # read the first chunk's worth to decide the separator
        for chunk in chunks:
            head.append(chunk)
            if sum(map(len, head)) >= _CHUNK:
                break
        if head and _cr_lines(b"".join(head)):
            sep = b"\r"
    carry: list[bytes] = []
    carried, skipping = 0, False  # bytes of the line so far; whether it is over the cap

    def too_long(n: int) -> tuple[None, str]:
        return None, f"record of {n} bytes is longer than read.max_record_bytes ({max_record})"

    for chunk in itertools.chain(head, chunks):
        pos += len(chunk)
        parts = chunk.split(sep)
        if len(parts) > 1:
            first = parts[0]
            n = carried + len(first)
            if skipping or n > max_record:
                yield too_long(n)
            elif carry:
                carry.append(first)
                yield b"".join(carry), ""
            else:
                yield first, ""
            carry, carried, skipping = [], 0, False
            for line in parts[1:-1]:
                yield (line, "") if len(line) <= max_record else too_long(len(line))
        last = parts[-1]
        carried += len(last)
        if skipping:
            continue
        if carried > max_record:
            carry, skipping = [], True
        elif last:
            carry.append(last)
    if failed:  # the damaged line, if any, and whatever followed it: one bad record
        e = failed[0]
        yield None, f"damaged input after {pos} bytes ({type(e).__name__}: {e})"
    elif skipping:
        yield too_long(carried)
    elif carried:
        yield b"".join(carry), ""  # a last line without a line ending


def _read_jsonl(piece: Piece, field: str):
    f = _open_or_fail(piece.path)
    with f:
        try:
            if piece.start:
                f.seek(piece.start)
        except Exception as e:
            raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
        limit = -1 if piece.end < 0 else piece.end - piece.start
        lines = _lines(f, limit, piece.max_record, detect_cr=piece.start == 0)
        for rec, (raw, bad) in enumerate(lines, piece.first_record):
            if raw is None:
                yield rec, None, bad
                continue
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
            except RecursionError:
                yield rec, None, "invalid JSON: nested too deeply"
                continue
            except Exception as e:  # whatever else hostile bytes make the parser raise
                yield rec, None, f"invalid JSON: {type(e).__name__}: {e}"
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
            data = f.read(piece.max_record + 1)
        except Exception as e:
            raise _PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
    if len(data) > piece.max_record:
        yield 0, None, f"file is longer than read.max_record_bytes ({piece.max_record})"
        return
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
    try:
        reader = reader_from_json("/nonexistent", None, meta)
    except Exception as e:
        raise _PieceError(f"bad MDS index entry: {type(e).__name__}: {e}") from e
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

    from pipeline.exports import expand_table

    f = _open_or_fail(piece.path)
    with f:
        try:
            if piece.path.endswith(".arrow"):
                table = pa.ipc.open_file(pa.BufferReader(f.read())).read_all()
            else:
                table = pq.read_table(f)
            need = ["input_ids", "seq_lens", "stream", "doc_id", "doc_offset"]
            missing = [c for c in need if c not in table.column_names]
            if missing:
                raise _PieceError(f"not a tokenmill export step file: no column {missing[0]!r}")
            table = expand_table(table)  # either layout (pipeline/exports.py)
            if "labels" not in table.schema.names:
                raise _PieceError("not a tokenmill export step file: no column 'labels'")
            ids = table.column("input_ids")
            L = ids.type.list_size
            ids = ids.values.to_numpy().reshape(-1, L)
            labels = table.column("labels").values.to_numpy().reshape(-1, L)
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
