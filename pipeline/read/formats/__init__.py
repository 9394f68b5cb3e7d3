"""Source formats as plug-ins: one module per format, found by the registry on its own.

A format answers four questions, and nothing outside its module asks them by name:

- **which files** (`claims`, `recognizes`, `expand`, `check_files`): does a file name say this
  format; is a directory a dataset of it (an MDS `index.json`, a `save_to_disk` `state.json`);
  which data files a directory holds, and in what order;
- **which pieces** (`data_files`, `plan`): the files `file_index` numbers (MDS: the shards, not
  the indexes) and, per file, the pieces it is read in. What `Piece.start`/`end` mean is the
  format's own business (a byte range, a row group, a run of record batches);
- **which records** (`read`): `(record_index, value, error)` for every record of a piece;
- **whether they are token ids** (`pretokenized`): records that are already documents of
  tokens (a tokenmill export), read with no tokenizer.

Adding a format is adding one module here that defines `FORMAT`, an instance of a `Format`
subclass. The registry imports every module of this package on first use, so `format: NAME`
is then accepted by the config and inferred from the extensions the module claims.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.read.access import Access, Piece

Record = tuple[int, Any, "str | None"]  # (record_index, value, error)


@dataclass(frozen=True)
class ReadSpec:
    """What to take from each record, and how to reach the files.

    `field`: the key or column whose value is the record (text, messages or token ids).
    `tokens`: the field holds token ids (`tokens_field`), read into arrays, not text.
    `tokens_dtype`: how to read a raw `bytes` value of token ids (numpy dtype name).
    """

    field: str
    tokens: bool = False
    tokens_dtype: str | None = None
    # dataclasses.field, not `field`: the `field` attribute above shadows the name here.
    access: Access = dataclasses.field(default_factory=Access)


class Format:
    """The interface, with the defaults most formats need (one piece per file)."""

    name: str = ""
    extensions: tuple[str, ...] = ()  # lower-case file-name endings that infer this format
    metadata: tuple[str, ...] = ()  # file names of this format that hold no records
    pretokenized: bool = False  # records are whole token documents (a tokenmill export)
    dir_order: bool = False  # a recognized directory's files keep `expand`'s order (not sorted)
    # A piece can be read in parts (Piece.skip/take) at little more than the part's own cost:
    # the records before a part are passed over, not decoded again (JSONL), or the piece's
    # decode is cheap beside tokenizing its records (a Parquet row group, Arrow batches). The
    # interleave's ramp then reads a piece's first rows ahead of the rest (stages/plan.py);
    # one record per piece (text) or pre-tokenized records (export) gain nothing from it.
    parts: bool = False

    def reads_in_parts(self, piece: Piece) -> bool:
        """Whether this piece can be read in parts at little more than their own cost
        (`parts`; JSONL: not a compressed file, which each part would decompress again)."""
        return self.parts

    def claims(self, name: str) -> bool:
        """Whether a file name (lower case, no directory) says this format."""
        return name.endswith(self.extensions)

    def recognizes(self, fs, directory: str) -> bool:
        """Whether `directory` (on fsspec filesystem `fs`) is a dataset of this format,
        decided by its metadata files."""
        return False

    def expand(self, fs, directory: str) -> list[str] | None:
        """The entry files of a directory given with this format (None: the directory is not
        one dataset, so its files are listed and sorted like any others)."""
        return None

    def refine(self, files: list[str], access: Access) -> str:
        """The format these files really are (an MDS dataset that `tokenmill export` wrote
        is an export); by default this one."""
        return self.name

    def check_files(self, files: list[str]) -> None:
        """Raise ValueError naming a file this format cannot read as given."""

    def data_files(self, files: list[str], access: Access) -> list[str]:
        """The files that `file_index` numbers, in order."""
        return files

    def plan(
        self, files: list[str], piece_bytes: int, max_record: int, access: Access
    ) -> list[list[Piece]]:
        """Per data file, in file_index order, the pieces it is read in.

        Metadata that cannot be read becomes one piece whose read reports the error, so the
        decision to skip or fail stays with the feed.
        """
        out = []
        for fi, path in enumerate(files):
            try:
                size = access.size(path)
            except OSError:  # one piece, whose read reports the error
                out.append([Piece(fi, path, self.name, max_record=max_record)])
                continue
            out.append(self.plan_file(fi, path, size, piece_bytes, max_record, access))
        return out

    def plan_file(
        self, fi: int, path: str, size: int, piece_bytes: int, max_record: int, access: Access
    ) -> list[Piece]:
        """The pieces of one data file of `size` bytes; by default the whole file."""
        return [Piece(fi, path, self.name, nbytes=size, max_record=max_record)]

    def read(self, piece: Piece, spec: ReadSpec) -> Iterator[Record]:
        """Every record of `piece`; a problem with the whole piece raises `PieceError`."""
        raise NotImplementedError


_REGISTRY: dict[str, Format] = {}


def registry() -> Mapping[str, Format]:
    """Every format of this package, by name (modules imported on first use)."""
    if not _REGISTRY:
        found = {}
        for mod in pkgutil.iter_modules(__path__):
            fmt = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "FORMAT", None)
            if isinstance(fmt, Format):
                found[fmt.name] = fmt
        _REGISTRY.update(found)
    return _REGISTRY


def get(name: str) -> Format:
    try:
        return registry()[name]
    except KeyError:
        known = ", ".join(sorted(registry()))
        raise ValueError(f"unknown format {name!r} (known: {known})") from None


def get_or_none(name: str | None) -> Format | None:
    return None if name is None else registry().get(name)


def metadata_names() -> frozenset[str]:
    """File names that hold some format's metadata, never records (`state.json`, ...)."""
    return frozenset(n for f in registry().values() for n in f.metadata)


def infer_format(path: str) -> str | None:
    """The format a file name says, longest claim first (`step-…-rank-0.arrow` is an export,
    `x.arrow` Arrow, `x.jsonl.gz` JSONL)."""
    name = path.rsplit("/", 1)[-1].lower()
    best, best_len = None, 0
    for fmt in registry().values():
        n = _claim_length(fmt, name)
        if n > best_len:
            best, best_len = fmt.name, n
    return best


def _claim_length(fmt: Format, name: str) -> int:
    """How specific `fmt`'s claim on `name` is: the matched ending's length (0: none); a
    format that claims by its own rule (export step names, MDS indexes) outranks endings."""
    if type(fmt).claims is not Format.claims:
        return 1000 if fmt.claims(name) else 0
    return max((len(e) for e in fmt.extensions if name.endswith(e)), default=0)


def is_pretokenized(fmt: str, tokens_field: str | None) -> bool:
    """Whether a stream's records are token ids: its format's, or a `tokens_field`'s."""
    return tokens_field is not None or get(fmt).pretokenized
