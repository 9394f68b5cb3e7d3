"""Reaching a file: `Access` (a stream's `storage_options`, local or fsspec), `Piece` (a
contiguous run of one file's records) and `PieceError` (a whole piece unreadable). Every format
of `formats/` reads through these, and nothing below them knows a format.

Secrets: `storage_options` reach fsspec through `Access` and nowhere else; its `repr` shows
the keys only (pipeline/config.py `redact`). What fsspec, s3fs and botocore raise can quote an
option whole ("Could not connect to the endpoint URL: http://host:9000/bucket...",
"Provided region_name 'x' doesn't match"), so every message that leaves the read layer with
such an error in it, a reject's reason or an error resolving, planning or reading a stream,
goes through `Access.scrub`: each option's value is replaced by its key's name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import fsspec

from pipeline.config import MAX_RECORD_BYTES, redact

WHOLE_FILE = 0xFFFFFFFF  # record index used for errors that concern a whole file or piece
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

    What `start`/`end` mean is the format's (pipeline/read/formats/): jsonl: bytes [start, end);
    parquet: row group `start` (-1: the footer is unreadable, report it on read); arrow:
    record batches [start, end); mds: `start` unused, `meta` is the shard's index entry; text
    and export step files: the whole file. `first_record` is the record index of the piece's
    first record. `nbytes` estimates the work, for grouping pieces into read tasks.
    `max_record`: a JSONL line or text file longer than this many bytes is rejected unread.
    `skip`, `take`: a *part* of the piece: its rows after the first `skip`, at most `take` of
    them (-1: the rest), counted as `read_piece` yields them, so the parts of a piece hold
    the rows of the whole piece, in order (the interleave's ramp reads a piece's first rows
    ahead of the rest: pipeline/stages/plan.py `ramp_parts`). `nbytes` is then the part's.
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
    skip: int = 0
    take: int = -1

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
