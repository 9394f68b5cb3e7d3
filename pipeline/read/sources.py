"""Sources: a stream's paths resolved to files, its files planned into pieces, a piece read
into records, each step dispatched to the format plug-ins of `formats/` (one module per format).
How a file is reached (`Access`, `Piece`, `PieceError`) is `access.py`.

A *piece* is a contiguous run of records of one file: a line-aligned byte range of a JSONL file,
a Parquet row group, a run of Arrow record batches, an MDS shard, or a whole text file. Pieces
carry their first record index, so every record gets ``doc_id = (file_index << 32) |
record_index`` (the batch schema) without reading what comes before it, which is also what lets a
resumed run seek instead of re-reading.

Reading yields ``(record_index, payload, error)``; bad records never raise here. Whether a bad
record stops the run or is counted and skipped is the feed's decision (`on_error`), made in
stream order so that the outcome is deterministic.

JSONL is read as a stream of lines, a chunk at a time, whatever the compression: memory per
reader is one chunk plus one record, and a line longer than `read.max_record_bytes` is read
past and rejected (a one-line decompression bomb costs time, not memory). What hostile files
turn into (no bad input may lose good data):

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
- Metadata files (MDS `index.json`, a `save_to_disk` directory's `state.json` and
  `dataset_info.json`, an export's `summary.json`) are never read as records of another format.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import fsspec

from pipeline.config import MAX_RECORD_BYTES
from pipeline.read import formats
from pipeline.read.access import WHOLE_FILE, Access, Piece, PieceError, _is_local_url, _is_url

_GLOB_CHARS = set("*?[")


# ---------------------------------------------------------------------------------------------
# Resolving a stream's paths.


def _fs_and_path(
    path: str, base: Path, access: Access
) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    """The filesystem, its path, and whether to present matches as URLs."""
    if _is_url(path):
        fs, fs_path = access.url_to_fs(path)
        return fs, fs_path, not _is_local_url(path)
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


def infer_format(path: str) -> str | None:
    return formats.infer_format(path)


def resolve_stream_files(stream, base: Path) -> tuple[list[str], str]:
    """Expand a stream's `paths` (globs, directories, URLs) into an ordered, de-duplicated list.

    Files are sorted by name, except that a directory a format recognizes as one dataset and
    orders itself (a `save_to_disk` directory: `state.json` order) keeps its order, at its
    directory's place in the sort. The format is the stream's, else the one a recognized
    directory or every file's name says; the format may then refine it (an MDS dataset
    written by `tokenmill export` is read as `export`). For MDS the entries are `index.json`
    files; their shards are listed when planning. Raises ValueError naming the pattern that
    matched nothing, or files of no single known format.
    """
    access = Access.of(stream)
    with access.scrubbing("cannot resolve the stream's paths"):
        return _resolve(stream, base, access)


def _resolve(stream, base: Path, access: Access) -> tuple[list[str], str]:
    given = None if stream.format is None else formats.get(stream.format)
    groups: dict[str, tuple[list[str], str | None]] = {}  # sort key -> (files, format)
    for pattern in stream.paths:
        fs, p, as_url = _fs_and_path(pattern, base, access)
        protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol

        def shown(m: str, as_url=as_url, protocol=protocol) -> str:
            return f"{protocol}://{m}" if as_url else m

        if _GLOB_CHARS & set(p):
            hits = fs.glob(p)
            matches = [m for m in hits if fs.isfile(m)]
            dirs = [m for m in hits if fs.isdir(m)]
        elif fs.isdir(p):
            matches, dirs = [], [p]
        elif fs.exists(p):
            matches, dirs = [p], []
        else:
            raise ValueError(f"{pattern!r} matches no files")
        found = 0
        for m in matches:
            if not _hidden(m):
                groups.setdefault(shown(m), ([shown(m)], None))
                found += 1
        for d in dirs:
            files, fmt, ordered = _expand_dir(fs, d, given)
            files = [shown(f) for f in files if not _hidden(f)]
            found += len(files)
            if ordered:
                groups.setdefault(shown(d), (files, fmt))
            else:
                for f in files:
                    groups.setdefault(f, ([f], fmt))
        if not found:
            raise ValueError(f"{pattern!r} matches no files")
    files, guesses = [], []
    seen: set[str] = set()
    for key in sorted(groups):
        members, fmt = groups[key]
        for f in members:
            if f not in seen:
                seen.add(f)
                files.append(f)
                guesses.append(fmt or formats.infer_format(f))
    if given is None:
        kinds = set(guesses)
        if None in kinds or len(kinds) != 1:
            example = next(f for f, g in zip(files, guesses, strict=True)
                           if g is None or len(kinds) > 1)  # fmt: skip
            raise ValueError(
                f"cannot infer one format from the extensions (e.g. {example!r}); set 'format'"
            )
        kind = kinds.pop()
        assert kind is not None  # a None guess raised above
        chosen = formats.get(kind)
    else:
        chosen = given
    chosen = formats.get(chosen.refine(files, access))
    chosen.check_files(files)
    if len(files) >= 1 << 32:
        raise ValueError(f"too many files ({len(files)}) for 32-bit file indices")
    return files, chosen.name


def _hidden(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(".")


def _expand_dir(fs, d: str, given) -> tuple[list[str], str | None, bool]:
    """A directory's data files, the format they are (None: infer per file), and whether
    their order is the dataset's own (kept) rather than to be sorted."""
    fmt = given
    if fmt is None:
        fmt = next((f for f in formats.registry().values() if f.recognizes(fs, d)), None)
    listed = fmt.expand(fs, d) if fmt is not None else None
    if listed is not None:
        return listed, fmt.name, fmt.dir_order
    meta = formats.metadata_names()
    out = []
    for f in fs.find(d):
        name = f.rsplit("/", 1)[-1].lower()
        if name.startswith("."):
            continue
        owner = given if given is not None else formats.get_or_none(formats.infer_format(f))
        if owner is None or (name in meta and name not in owner.metadata):
            continue  # no format, or another format's metadata (state.json is not JSONL)
        out.append(f)
    return out, None if given is None else given.name, False


# ---------------------------------------------------------------------------------------------
# Planning and reading, dispatched to the formats.


def data_files(files: list[str], fmt: str, access: Access | None = None) -> list[str]:
    """The files that `file_index` numbers (MDS: the shards of the listed indexes)."""
    access = access or Access()
    with access.scrubbing("cannot list the data files"):
        return formats.get(fmt).data_files(files, access)


def plan_pieces(
    files: list[str],
    fmt: str,
    piece_bytes: int,
    max_record: int = MAX_RECORD_BYTES,
    access: Access | None = None,
) -> list[list[Piece]]:
    """Per file (in file_index order), the pieces it is read in.

    Metadata that cannot be read (a corrupt Parquet footer, say) becomes a single piece whose
    read reports the error, so the decision to skip or fail stays with the feed.
    """
    access = access or Access()
    with access.scrubbing("cannot plan the stream's pieces"):
        return formats.get(fmt).plan(files, piece_bytes, max_record, access)


def read_piece(piece: Piece, spec) -> Iterator[tuple[int, Any, str | None]]:
    """Every record of `piece` as (record_index, value, error); `spec` is a
    `formats.ReadSpec` or just the field name. Errors for a whole piece use WHOLE_FILE.
    A part of a piece (`skip`, `take`) is those rows of the whole piece's (a format may pass
    over the skipped ones without decoding them: `Format.parts`)."""
    if isinstance(spec, str):
        spec = formats.ReadSpec(spec)
    if piece.skip or piece.take >= 0:
        yield from _read_part(piece, spec)
        return
    yield from _read_piece(piece, spec)


def _read_part(piece: Piece, spec: formats.ReadSpec) -> Iterator[tuple[int, Any, str | None]]:
    """Rows [skip, skip + take) of the piece's. A whole-piece error among the rows passed
    over (the piece could not be read up to the part: a file gone or unreadable since it was
    planned, a storage error) is the part's one row, never dropped: the rows it held are lost,
    and that is reported (a piece unreadable from its start has its first part fail the
    same way, so it reports once per part)."""
    stop = None if piece.take < 0 else piece.skip + piece.take
    rows = _read_piece(piece, spec)
    try:
        for k, row in enumerate(rows):
            if k < piece.skip:
                if row[0] == WHOLE_FILE and row[2] is not None:
                    yield row
                    return
                continue
            yield row
            if stop is not None and k + 1 >= stop:
                return
    finally:
        rows.close()  # a head part: the file closes here, not when collected


def _read_piece(piece: Piece, spec: formats.ReadSpec) -> Generator[tuple[int, Any, str | None]]:
    access = spec.access
    if not access.storage_options:  # nothing to hide: the records as they come
        try:
            yield from formats.get(piece.fmt).read(piece, spec)
        except PieceError as e:
            yield WHOLE_FILE, None, str(e)
        return
    with access.scrubbing(f"cannot read {piece.path}"):
        try:
            for rec, value, err in formats.get(piece.fmt).read(piece, spec):
                yield rec, value, err if err is None else access.scrub(err)
        except PieceError as e:
            yield WHOLE_FILE, None, access.scrub(str(e))
