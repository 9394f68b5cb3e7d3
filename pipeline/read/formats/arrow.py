"""Arrow IPC (`.arrow`), file or stream format, and Hugging Face `datasets` directories.

`Dataset.save_to_disk` writes `data-0000i-of-0000N.arrow` in the IPC *stream* format plus
`state.json` (whose `_data_files` list their order) and `dataset_info.json`. Such a directory is
recognized as one dataset and read in `_data_files` order; its metadata files are never records.
A record is a row; `text_field`, `messages_field` or `tokens_field` names the column.

A piece is a row range [`start`, `end`) of a file (`first_record == start`), so files split
however they were batched: consecutive record batches are grouped to about `read.piece_bytes`,
and a larger batch is cut into row ranges of about that size. `meta` holds where to begin
(`batch`, and `row`, that batch's first row): the file format seeks straight to that batch,
the stream format reads past the ones before it. Planning reads each file once to count rows
per batch (memory-mapped when local, so only the headers are touched; a remote file is read).

A damaged file keeps its complete batches, as a truncated `.jsonl.gz` keeps its complete lines:
planning covers the batches read before the damage, and one more piece, `meta["damage"]`,
whose read is one reject at the first row not read, naming what went wrong. A file-format file
whose footer cannot be read (a truncated copy) is read as the IPC stream it begins with (the
file format is "ARROW1", padding, a stream, a footer), and its missing footer is that reject:
batches after the cut, if any, are lost, and the count says so.
"""

from __future__ import annotations

import contextlib
import json

import pyarrow as pa

from pipeline.read.access import Access, Piece, PieceError, _is_url
from pipeline.read.formats import Format, ReadSpec
from pipeline.read.formats._columns import column_records

STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"  # a DatasetDict: one save_to_disk directory per split
_FILE_MAGIC = b"ARROW1"
_FILE_STREAM_AT = 8  # the file format's stream begins after the magic and its padding


class Arrow(Format):
    name = "arrow"
    extensions = (".arrow",)
    parts = True
    metadata = (STATE, INFO, DICT)
    dir_order = True

    def recognizes(self, fs, directory: str) -> bool:
        d = directory.rstrip("/")
        return fs.exists(f"{d}/{DICT}") or (fs.exists(f"{d}/{STATE}") and fs.exists(f"{d}/{INFO}"))

    def expand(self, fs, directory: str) -> list[str] | None:
        d = directory.rstrip("/")
        if fs.exists(f"{d}/{DICT}"):  # reading every split as one stream would mix them
            splits = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(d) if fs.isdir(p))
            raise ValueError(
                f"{d} is a datasets DatasetDict; give one split's directory "
                f"({', '.join(f'{d}/{s}' for s in splits)})"
            )
        if not fs.exists(f"{d}/{STATE}"):
            return None
        return [f"{d}/{name}" for name in _data_files(fs, f"{d}/{STATE}")]

    def plan(self, files, piece_bytes, max_record, access):
        return [_plan_file(fi, path, piece_bytes, access) for fi, path in enumerate(files)]

    def read(self, piece: Piece, spec: ReadSpec):
        if piece.meta is None:  # planning could not read the file: say why
            with _reader(piece.path, spec.access):
                raise PieceError("Arrow IPC file could not be read when the stream was planned")
        if "damage" in piece.meta:  # the rest of a damaged file: one reject
            yield piece.start, None, piece.meta["damage"]
            return
        field = spec.field
        with _reader(piece.path, spec.access) as (reader, is_file, _):
            names = reader.schema.names
            if field not in names:
                raise PieceError(f"missing column {field!r} (columns: {names})")
            row = piece.meta["row"]
            batches = _batches_from(reader, is_file, piece.meta["batch"])
            while row < piece.end:  # never read the batch past the piece: it may be the damage
                batch = next(batches, None)
                if batch is None:
                    break
                lo, hi = max(piece.start, row), min(piece.end, row + batch.num_rows)
                if hi > lo:
                    col = batch.slice(lo - row, hi - lo).column(field)
                    yield from column_records(col, spec.tokens, lo)
                row += batch.num_rows


FORMAT = Arrow()


def _data_files(fs, state_path: str) -> list[str]:
    """`state.json`'s `_data_files` names, validated to stay inside the dataset directory."""
    try:
        with fs.open(state_path, "rb") as f:
            entries = json.loads(f.read())["_data_files"]
        names = [e["filename"] for e in entries]
    except Exception as e:
        raise ValueError(f"{state_path}: not a readable datasets state.json: {e!r}") from e
    for n, name in enumerate(names):
        if (
            not isinstance(name, str)
            or not name
            or name.startswith(("/", "\\"))
            or ".." in (name.replace("\\", "/").split("/"))
        ):
            raise ValueError(f"{state_path}: _data_files {n}: bad file name {name!r}")
    if not names:
        raise ValueError(f"{state_path}: _data_files is empty")
    return names


@contextlib.contextmanager
def _reader(path: str, access: Access):
    """(reader, whether it is the IPC file format, why a file-format file is read as its
    stream or None); any failure is a PieceError."""
    with contextlib.ExitStack() as stack:
        try:
            if _is_url(path):
                source = stack.enter_context(access.open(path))
            else:
                source = stack.enter_context(pa.memory_map(path))
            is_file = source.read(len(_FILE_MAGIC)) == _FILE_MAGIC
            source.seek(0)
            footer = None
            if is_file:
                try:
                    reader = pa.ipc.open_file(source)
                except (pa.ArrowException, OSError, ValueError) as e:
                    footer = f"{type(e).__name__}: {e}"
                    is_file = False
                    source.seek(_FILE_STREAM_AT)
                    reader = pa.ipc.open_stream(source)
            else:
                reader = pa.ipc.open_stream(source)
        except Exception as e:
            raise PieceError(f"corrupt or unreadable Arrow IPC: {type(e).__name__}: {e}") from e
        try:
            yield reader, is_file, footer
        except PieceError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise PieceError(f"corrupt Arrow IPC: {type(e).__name__}: {e}") from e


def _batches_from(reader, is_file: bool, first: int):
    if is_file:
        for i in range(first, reader.num_record_batches):
            yield reader.get_batch(i)
        return
    for i, batch in enumerate(reader):
        if i >= first:
            yield batch


def _plan_file(fi: int, path: str, piece_bytes: int, access: Access) -> list[Piece]:
    try:
        sizes, damage = _batch_sizes(path, access)
    except PieceError:
        return [Piece(fi, path, "arrow", 0, 0, -1, 0)]  # meta None: the read reports it
    pieces: list[Piece] = []
    row = 0
    # [start row, nbytes, batch, batch's first row] of the piece being grown
    open_piece: list[int] | None = None

    def close(end: int) -> None:
        assert open_piece is not None  # both callers check that a piece is open
        start, nbytes, batch, batch_row = open_piece
        meta = {"batch": batch, "row": batch_row}
        pieces.append(Piece(fi, path, "arrow", start, start, end, nbytes, meta))

    for b, (rows, nbytes) in enumerate(sizes):
        per_row = nbytes / rows if rows else 0
        cut = 0  # rows of this batch already in pieces
        while cut < rows:
            if open_piece is None:
                open_piece = [row + cut, 0, b, row]
            room = piece_bytes - open_piece[1]
            take = rows - cut if per_row == 0 else max(1, min(rows - cut, int(room // per_row)))
            open_piece[1] += int(take * per_row)
            cut += take
            if open_piece[1] >= piece_bytes:
                close(row + cut)
                open_piece = None
        row += rows
    if open_piece is not None:
        close(row)
    if damage is not None:  # the complete batches are pieces above; the rest is one reject
        meta = {"batch": len(sizes), "row": row, "damage": damage}
        pieces.append(Piece(fi, path, "arrow", row, row, row, 0, meta))
    return pieces or [Piece(fi, path, "arrow", 0, 0, 0, 0, {"batch": 0, "row": 0})]


def _batch_sizes(path: str, access: Access) -> tuple[list[tuple[int, int]], str | None]:
    """(rows, bytes) of every complete record batch, and why the file ends early (None: it
    does not). A schema that cannot be read raises PieceError: no batch is complete."""
    sizes: list[tuple[int, int]] = []
    cut: str | None = None
    with _reader(path, access) as (reader, is_file, footer):
        batches = _batches_from(reader, is_file, 0)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError, ValueError) as e:
                cut = f"{type(e).__name__}: {e}"
                break
            if batch is None:
                break
            sizes.append((batch.num_rows, batch.nbytes))
    if cut is None and footer is None:
        return sizes, None
    rows = sum(n for n, _ in sizes)
    why = (f"the batch after them is damaged ({cut})" if cut is not None
           else f"no readable footer ({footer}), so any batches after them are lost")  # fmt: skip
    return sizes, (
        f"truncated or corrupt Arrow IPC: {len(sizes)} complete record batches ({rows} rows) "
        f"were read, then {why}"
    )
