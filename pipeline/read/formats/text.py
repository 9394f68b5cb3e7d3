"""Plain text (`.txt`, `.text`, `.md`, `.py`, `.rst`): a whole file is one record.

One piece per file; a file longer than `read.max_record_bytes` is a reject, read no further.
"""

from __future__ import annotations

from pipeline.read.access import Access, Piece, PieceError, open_or_fail
from pipeline.read.formats import Format, ReadSpec


class Text(Format):
    name = "text"
    extensions = (".txt", ".text", ".md", ".py", ".rst")

    def read(self, piece: Piece, spec: ReadSpec):
        return _read_text(piece, spec.access)


FORMAT = Text()


def _read_text(piece: Piece, access: Access):
    f = open_or_fail(piece.path, access)
    with f:
        try:
            data = f.read(piece.max_record + 1)
        except Exception as e:
            raise PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
    if len(data) > piece.max_record:
        yield 0, None, f"file is longer than read.max_record_bytes ({piece.max_record})"
        return
    try:
        yield 0, data.decode("utf-8"), None
    except UnicodeDecodeError as e:
        yield 0, None, f"invalid UTF-8 at byte {e.start}"
