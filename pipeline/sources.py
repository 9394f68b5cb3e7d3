"""Sources: what every format shares. Reaching files (local or fsspec, with the stream's
`storage_options`), resolving a stream's paths to files, `Piece`, and dispatching planning and
reading to the format plug-ins of `pipeline/formats/` (one module per format).

A *piece* is a contiguous run of records of one file: a line-aligned byte range of a JSONL file,
a Parquet row group, a run of Arrow record batches, an MDS shard, or a whole text file. Pieces
carry their first record index, so every record gets ``doc_id = (file_index << 32) |
record_index`` (SPEC §3.2) without reading what comes before it, which is also what lets a
resumed run seek instead of re-reading.

Reading yields ``(record_index, payload, error)``; bad records never raise here. Whether a bad
record stops the run or is counted and skipped is the feed's decision (`on_error`), made in
stream order so that the outcome is deterministic.

JSONL is read as a stream of lines, a chunk at a time, whatever the compression: memory per
reader is one chunk plus one record, and a line longer than `read.max_record_bytes` is read
past and rejected (a one-line decompression bomb costs time, not memory). What hostile files
turn into (issue 13: no bad input may lose good data):

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

Secrets: `storage_options` reach fsspec through `Access` and nowhere else; its `repr` shows
the keys only (pipeline/config.py `redact`). What fsspec, s3fs and botocore raise can quote an
option whole ("Could not connect to the endpoint URL: http://host:9000/bucket...",
"Provided region_name 'x' doesn't match"), so every message that leaves this module with
such an error in it, a reject's reason or an error resolving, planning or reading a stream,
goes through `Access.scrub`: each option's value is replaced by its key's name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec

from pipeline.config import MAX_RECORD_BYTES, redact

WHOLE_FILE = 0xFFFFFFFF  # record index used for errors that concern a whole file or piece
_GLOB_CHARS = set("*?[")
_MAGIC = {".gz": b"\x1f\x8b", ".bz2": b"BZh", ".zst": b"\x28\xb5\x2f\xfd"}


def _is_url(path: str) -> bool:
    return "://" in path


def _is_local_url(path: str) -> bool:
    return path.startswith(("file://", "local://"))


@dataclass(frozen=True, repr=False)
class Access:
    """How to reach a stream's files: fsspec `storage_options` for URLs (endpoint, keys...).

    Every open, size and listing goes through here, in planning (driver) and reading (Ray
    workers) alike; the options travel inside the stream's config. Local paths and `file://`
    URLs ignore them.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(stream) -> Access:
        return Access(dict(getattr(stream, "storage_options", None) or {}))

    def __repr__(self) -> str:
        return f"Access(storage_options={redact(self.storage_options)})"

    def scrub(self, message: str) -> str:
        """`message` with every storage option's value in it replaced by the option's name
        (`<storage_options.endpoint_url>`), longest first; an URL's host:port too, as
        botocore quotes it in its own URLs. Values shorter than 4 characters, numbers and
        booleans are left: they name nothing, and replacing them would garble the message."""
        for value, key in _secrets(self.storage_options):
            message = message.replace(value, f"<storage_options.{key}>")
        return message

    @contextlib.contextmanager
    def scrubbing(self, what: str):
        """Errors raised inside as ValueError(`what`: the error, scrubbed) when their message
        quotes a storage option; others as they were."""
        try:
            yield
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            clean = self.scrub(text)
            if clean == text:
                raise
            raise ValueError(f"{what}: {clean}") from None

    def _opts(self, path: str) -> dict:
        return {} if _is_local_url(path) else dict(self.storage_options)

    def url_to_fs(self, path: str) -> tuple[fsspec.AbstractFileSystem, str]:
        return fsspec.core.url_to_fs(path, **self._opts(path))

    def open(self, path: str, mode: str = "rb"):
        """A file object (the caller closes it); a file whose first bytes are a compression
        format's magic is decompressed, whatever its name."""
        if self._compressed(path):
            return fsspec.open(path, mode, compression="infer", **self._opts(path)).open()
        if _is_url(path):
            return fsspec.open(path, mode, **self._opts(path)).open()
        return open(path, mode)  # noqa: SIM115 - the caller closes it

    def size(self, path: str) -> int:
        if _is_url(path):
            fs, p = self.url_to_fs(path)
            return int(fs.size(p))
        return os.path.getsize(path)

    def _compressed(self, path: str) -> bool:
        """Whether a file named as compressed really is: its first bytes are the magic.

        A `.gz` (`.bz2`, `.zst`) file that holds plain text is read as the plain text it is.
        """
        magic = next((m for ext, m in _MAGIC.items() if path.endswith(ext)), None)
        if magic is None:
            return False
        if _is_url(path):
            with fsspec.open(path, "rb", **self._opts(path)).open() as f:
                return f.read(len(magic)) == magic
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic


def _secrets(options: Any, key: str = "") -> list[tuple[str, str]]:
    """(value, dotted key) for every string in `options` (nested: `config_kwargs`,
    `client_kwargs`), and the host:port of each URL among them, longest value first."""
    out: list[tuple[str, str]] = []
    if isinstance(options, Mapping):
        for k, v in options.items():
            out += _secrets(v, f"{key}.{k}" if key else str(k))
    elif isinstance(options, list | tuple):
        for i, v in enumerate(options):
            out += _secrets(v, f"{key}.{i}")
    elif isinstance(options, str) and len(options) >= 4:
        out.append((options, key))
        with contextlib.suppress(ValueError):
            host = urlsplit(options).netloc
            if len(host) >= 4 and host != options:
                out.append((host, f"{key} host"))
    return sorted(out, key=lambda pair: -len(pair[0]))


def open_file(path: str, mode: str = "rb", access: Access | None = None):
    return (access or Access()).open(path, mode)


@dataclass(frozen=True)
class Piece:
    """A contiguous run of records of one file; `fmt` names the format that reads it.

    What `start`/`end` mean is the format's (pipeline/formats/): jsonl: bytes [start, end);
    parquet: row group `start` (-1: the footer is unreadable, report it on read); arrow:
    record batches [start, end); mds: `start` unused, `meta` is the shard's index entry; text
    and export step files: the whole file. `first_record` is the record index of the piece's
    first record. `nbytes` estimates the work, for grouping pieces into read tasks.
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

    @property
    def work(self) -> int:
        """Its weight in grouping and pacing: `nbytes`, at least 1 (an empty piece is still
        a read)."""
        return max(self.nbytes, 1)


class PieceError(Exception):
    """A problem with a whole piece (unreadable file, corrupt footer, missing column): one
    reject at `WHOLE_FILE`, raised by a format's reader and caught by `read_piece`."""


def open_or_fail(path: str, access: Access):
    try:
        return access.open(path)
    except Exception as e:
        raise PieceError(f"unreadable file: {type(e).__name__}: {e}") from e


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
    from pipeline import formats

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
    from pipeline import formats

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
    from pipeline import formats

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
    from pipeline import formats

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
    from pipeline import formats

    access = access or Access()
    with access.scrubbing("cannot plan the stream's pieces"):
        return formats.get(fmt).plan(files, piece_bytes, max_record, access)


def read_piece(piece: Piece, spec) -> Iterator[tuple[int, Any, str | None]]:
    """Every record of `piece` as (record_index, value, error); `spec` is a
    `formats.ReadSpec` or just the field name. Errors for a whole piece use WHOLE_FILE."""
    from pipeline import formats

    if isinstance(spec, str):
        spec = formats.ReadSpec(spec)
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


def __getattr__(name: str):
    # Kept importable from here for callers and tests that predate pipeline/formats/.
    if name == "_jsonl_pieces":
        from pipeline.formats.jsonl import jsonl_pieces

        return jsonl_pieces
    if name == "list_mds_shards":
        from pipeline.formats.mds import list_mds_shards

        return list_mds_shards
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
