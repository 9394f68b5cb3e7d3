"""JSONL (`.jsonl`, `.ndjson`, `.json`, optionally `.gz`/`.zst`/`.bz2`): one JSON object a line.

Pieces are line-aligned byte ranges [`start`, `end`), found by one newline-counting pass over a
large file, so each knows its first record index. Compressed files and files whose lines end in
a bare CR are one piece. Reading is a stream of `_CHUNK`-byte reads: memory per reader is one
chunk plus one record, and an over-long line is read past and rejected (pipeline/read/sources.py
lists what each kind of hostile file turns into).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

from pipeline.config import MAX_RECORD_BYTES
from pipeline.read.access import Access, Piece, PieceError, open_or_fail
from pipeline.read.formats import Format, ReadSpec
from pipeline.read.formats._columns import bool_ids

_CHUNK = 1 << 20  # bytes read at a time: memory per reader is this plus one record
_COMPRESSED = (".gz", ".zst", ".bz2")  # read whole, as one piece (and never in parts)


class Jsonl(Format):
    name = "jsonl"
    extensions = (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2")
    parts = True

    def reads_in_parts(self, piece: Piece) -> bool:
        return not piece.path.endswith(_COMPRESSED)

    def plan_file(self, fi, path, size, piece_bytes, max_record, access):
        try:
            return jsonl_pieces(fi, path, size, piece_bytes, max_record, access)
        except OSError:  # the whole file, whose read reports the error
            return super().plan_file(fi, path, size, piece_bytes, max_record, access)

    def read(self, piece: Piece, spec: ReadSpec):
        return _read_jsonl(piece, spec.field, spec.access, spec.tokens)


FORMAT = Jsonl()


def jsonl_pieces(
    fi: int,
    path: str,
    size: int,
    piece_bytes: int,
    max_record: int = MAX_RECORD_BYTES,
    access: Access | None = None,
) -> list[Piece]:
    """Cut a JSONL file at line starts near every `piece_bytes`, counting lines on the way.

    Compressed files and files whose lines end in a bare CR are read whole, as one piece.
    """
    whole = [Piece(fi, path, "jsonl", 0, 0, -1, size, max_record=max_record)]
    if size <= piece_bytes or path.endswith(_COMPRESSED):
        return whole
    pieces, start, first, lines, pos = [], 0, 0, 0, 0
    next_cut = piece_bytes
    with (access or Access()).open(path) as f:
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


def _read_jsonl(piece: Piece, field: str, access: Access, tokens: bool = False):
    f = open_or_fail(piece.path, access)
    with f:
        try:
            if piece.start:
                f.seek(piece.start)
        except Exception as e:
            raise PieceError(f"unreadable file: {type(e).__name__}: {e}") from e
        limit = -1 if piece.end < 0 else piece.end - piece.start
        lines = _lines(f, limit, piece.max_record, detect_cr=piece.start == 0)
        skip = piece.first_record + piece.skip  # a part: the lines before it, undecoded
        for rec, (raw, bad) in enumerate(lines, piece.first_record):
            if rec < skip:
                yield rec, None, None  # dropped by read_piece, which counts it
                continue
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
            value = obj[field]
            why = bool_ids(value) if tokens else None
            yield (rec, None, why) if why else (rec, value, None)
