"""MosaicML MDS (`index.json` plus shards, as `streaming.MDSWriter` and LLM-Foundry write them).

The stream's entries are `index.json` files; `file_index` numbers their shards, sorted by path,
and a piece is one whole shard (`meta` is its index entry). Index entries are validated up front
(`list_mds_shards`): a malformed one, or a shard name that leaves the dataset directory, is an
error naming the index and shard. Shards are decoded by mosaicml-streaming's own reader, which is
imported only here and only when a shard is read (it pulls in torch), and never unpickles.

An MDS dataset written by `tokenmill export --format mds` (columns `input_ids`, `labels`,
`seq_lens`, ...) is read as `format: export` (pipeline/read/formats/export.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from pipeline.read.access import Access, Piece, PieceError
from pipeline.read.formats import Format, ReadSpec
from pipeline.read.formats._columns import bool_ids

INDEX = "index.json"
EXPORT_COLUMNS = ("input_ids", "labels", "seq_lens")  # what marks a tokenmill MDS export


class Mds(Format):
    name = "mds"
    metadata = (INDEX,)

    def claims(self, name: str) -> bool:
        return name == INDEX

    def recognizes(self, fs, directory: str) -> bool:
        return fs.exists(f"{directory.rstrip('/')}/{INDEX}")

    def expand(self, fs, directory: str) -> list[str]:
        return index_files(fs, directory)

    def refine(self, files: list[str], access: Access) -> str:
        return "export" if is_tokenmill_export(files, access) else self.name

    def check_files(self, files: list[str]) -> None:
        bad = [f for f in files if not f.endswith(INDEX)]
        if bad:
            raise ValueError(
                f"format mds needs index.json files or their directories, got {bad[0]!r}"
            )
        require_streaming()

    def data_files(self, files, access):
        return [path for path, _ in list_mds_shards(files, access)]

    def plan(self, files, piece_bytes, max_record, access):
        return shard_pieces(files, self.name, access)

    def read(self, piece: Piece, spec: ReadSpec):
        for i, sample, err in iter_samples(piece, (spec.field,), spec.access):
            value = None if sample is None else sample[spec.field]
            bad = bool_ids(value) if spec.tokens else None  # a `json` column's [1, true]
            yield (i, None, bad) if bad else (i, value, err)


FORMAT = Mds()


NO_STREAMING = (
    "MDS needs mosaicml-streaming, which is not installed here: pip install 'tokenmill[mds]' "
    "(it brings torch; the rest of the data plane does without)"
)


def require_streaming() -> None:
    """Refuse an MDS stream up front, at config load, where mosaicml-streaming is missing.

    It is an optional extra (`mds`), so that CPU data nodes need no torch."""
    import importlib.util

    try:
        found = importlib.util.find_spec("streaming") is not None
    except ImportError:  # a finder that refuses it (an environment that forbids the package)
        found = False
    if not found:
        raise ValueError(NO_STREAMING)


def index_files(fs, directory: str) -> list[str]:
    """The directory's own `index.json`, else every one below it."""
    idx = f"{directory.rstrip('/')}/{INDEX}"
    if fs.exists(idx):
        return [idx]
    return [f for f in fs.find(directory) if f.endswith(f"/{INDEX}")]


def is_tokenmill_export(index_files: list[str], access: Access) -> bool:
    """Whether every shard of these indexes has the columns `tokenmill export` writes."""
    try:
        shards = list_mds_shards(index_files, access)
    except ValueError:
        return False  # reported, with its context, when the stream is planned
    return bool(shards) and all(
        set(EXPORT_COLUMNS) <= set(meta.get("column_names") or ()) for _, meta in shards
    )


def shard_pieces(files: list[str], fmt: str, access: Access) -> list[list[Piece]]:
    return [
        [
            Piece(
                fi,
                path,
                fmt,
                0,
                0,
                -1,
                _int_or_0((meta.get("raw_data") or {}).get("bytes", 0)),
                meta,
            )
        ]
        for fi, (path, meta) in enumerate(list_mds_shards(files, access))
    ]


def _int_or_0(v: Any) -> int:
    return v if type(v) is int and v >= 0 else 0


def list_mds_shards(index_files: list[str], access: Access | None = None) -> list[tuple[str, dict]]:
    """All shards of the given MDS indexes, sorted by shard path: (path, index entry)."""
    access = access or Access()
    shards = []
    for idx in index_files:
        root = idx.rsplit("/", 1)[0]
        try:
            with access.open(idx) as f:
                obj = json.loads(f.read())
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
    infos: dict[str, Any] = {
        k: entry.get(k) for k in ("raw_data", "zip_data") if entry.get(k) is not None
    }
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


def iter_samples(
    piece: Piece, columns: tuple[str, ...], access: Access
) -> Iterator[tuple[int, dict | None, str | None]]:
    """Decode a shard with mosaicml-streaming's own reader (its `decode_sample`):
    (sample index, sample, error). A problem with the whole shard raises PieceError."""
    try:
        from streaming.base.format import reader_from_json
    except ImportError as e:  # a worker node without the `mds` extra
        raise PieceError(f"{NO_STREAMING} ({e})") from e

    meta = piece.meta or {}
    try:
        reader = reader_from_json("/nonexistent", None, meta)
    except Exception as e:
        raise PieceError(f"bad MDS index entry: {type(e).__name__}: {e}") from e
    try:
        reader.validate(allow_unsafe_types=False)  # never unpickle outside data
    except ValueError as e:
        raise PieceError(str(e)) from e
    # The base Reader that reader_from_json is annotated to return lacks column_names; the
    # MDSReader it builds has it.
    names = reader.column_names  # type: ignore[attr-defined]
    for field in columns:
        if field not in names:
            raise PieceError(f"missing column {field!r} (columns: {names})")
    data = _shard_bytes(piece.path, meta, access)
    n = int(meta.get("samples", 0))
    head = 4 * (n + 2)  # the sample count, then n + 1 offsets
    if len(data) < head:  # cut inside the offset table: no sample can be found
        for i in range(n):
            yield i, None, f"truncated MDS shard: {len(data)} bytes, its offset table needs {head}"
        return
    (count,) = np.frombuffer(data[:4], np.uint32)
    if count != n:
        raise PieceError(f"corrupt MDS shard: header says {count} samples, index.json says {n}")
    offsets = np.frombuffer(data[4:head], np.uint32).astype(np.int64)
    # A damaged shard (cut short, offsets overwritten) gives up only the samples whose bytes
    # are not there; each is a counted skip naming why, and the others are read.
    for i in range(n):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if not head <= lo <= hi <= len(data):
            why = "past the end of the shard (truncated?)" if hi > len(data) else "out of order"
            yield i, None, f"corrupt MDS shard: sample {i}'s bytes [{lo}, {hi}) are {why}"
            continue
        try:
            yield i, reader.decode_sample(data[lo:hi]), None
        except Exception as e:
            yield i, None, f"corrupt sample: {type(e).__name__}: {e}"


def _shard_bytes(path: str, meta: dict, access: Access) -> bytes:
    try:
        with access.open(path) as f:
            return f.read()
    except FileNotFoundError:
        zip_info = meta.get("zip_data")
        if not zip_info:
            raise PieceError(f"unreadable file: {path} does not exist") from None
        from streaming.base.compression import decompress

        zpath = path.rsplit("/", 1)[0] + "/" + zip_info["basename"]
        try:
            with access.open(zpath) as f:
                return decompress(meta["compression"], f.read())
        except Exception as e:
            raise PieceError(f"unreadable shard {zpath}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
