"""Parquet (`.parquet`, `.pq`): a record is a row; `text_field`, `messages_field` or
`tokens_field` names the column.

A piece is one row group (`start`), whose first row's index (`first_record`) comes from the
footer. A footer that cannot be read becomes one piece with `start = -1`, whose read reports it.
"""

from __future__ import annotations

from pipeline.read.access import Access, Piece, PieceError, open_or_fail
from pipeline.read.formats import Format, ReadSpec
from pipeline.read.formats._columns import column_records


class Parquet(Format):
    name = "parquet"
    extensions = (".parquet", ".pq")
    parts = True

    def plan_file(self, fi, path, size, piece_bytes, max_record, access):
        return _row_groups(fi, path, size, access)

    def read(self, piece: Piece, spec: ReadSpec):
        import pyarrow.parquet as pq

        field = spec.field
        f = open_or_fail(piece.path, spec.access)
        with f:
            try:
                pf = pq.ParquetFile(f)
                if piece.start < 0:
                    pf.metadata  # noqa: B018 - raises the footer error we want to report
                names = pf.schema_arrow.names
                if field not in names:
                    raise PieceError(f"missing column {field!r} (columns: {names})")
                col = pf.read_row_group(piece.start, columns=[field]).column(0)
            except PieceError:
                raise
            except Exception as e:
                raise PieceError(f"corrupt or unreadable Parquet: {type(e).__name__}: {e}") from e
        yield from column_records(col, spec.tokens, piece.first_record)


FORMAT = Parquet()


def _row_groups(fi: int, path: str, size: int, access: Access) -> list[Piece]:
    import pyarrow.parquet as pq

    try:
        with access.open(path) as f:
            md = pq.ParquetFile(f).metadata
    except Exception:
        return [Piece(fi, path, "parquet", 0, -1, -1, size)]  # start=-1: report on read
    pieces, first = [], 0
    for rg in range(md.num_row_groups):
        g = md.row_group(rg)
        pieces.append(Piece(fi, path, "parquet", first, rg, rg + 1, int(g.total_byte_size)))
        first += g.num_rows
    return pieces or [Piece(fi, path, "parquet", 0, 0, 0, 0)]
