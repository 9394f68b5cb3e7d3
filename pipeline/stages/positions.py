"""Where one stream stands (pipeline/stages/documents.py `DocSource`): its read position and
counters (`SourcePos`), with its open pieces when pieces are interleaved (`OpenPos`), and the
state keys they are written under. Positions only: a resume re-reads from them."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.stages.stage import StateError


@dataclass(frozen=True, slots=True)
class SourcePos:
    """A read position in one stream, with the stream's counters as of that position.

    (`unit`, `row`) is the next row to read in epoch `epoch`'s units. Resuming there re-reads
    the rest of one unit (a block), never the prefix of the epoch.
    """

    epoch: int = 0
    unit: int = 0
    row: int = 0
    docs: int = 0
    tokens: int = 0
    skipped: int = 0

    def to_json(self) -> list[int]:
        return [self.epoch, self.unit, self.row, self.docs, self.tokens, self.skipped]

    @staticmethod
    def from_json(v: list[int]) -> SourcePos:
        return SourcePos(*(int(x) for x in v))


@dataclass(frozen=True, slots=True)
class OpenPos:
    """Where an interleaved stream stands (`shuffle.pieces` > 0): `pos` holds the epoch, the
    next piece to open (as `unit`), the rows drawn in the epoch (as `row`) and the counters;
    the open pieces are `ords`, with `done` rows drawn of each. Positions only: a resume
    re-reads the open pieces and draws on."""

    pos: SourcePos
    ords: tuple[int, ...] = ()
    done: tuple[int, ...] = ()

    @property
    def epoch(self) -> int:
        return self.pos.epoch

    @property
    def open(self) -> list[list[int]]:
        """[[piece ordinal, rows drawn], ...] (the state's OPEN)."""
        return [[o, d] for o, d in zip(self.ords, self.done, strict=True)]


# DocSource state keys
POSITION = "position"  # SourcePos.to_json(); interleaved: (epoch, next piece, draws, counters)
# The last record read: (epoch, unit, row), interleaved (epoch, draw, 0); rejects up to it were
# reported.
REPORTED = "reported"
OPEN = "open"  # interleaved only: [[piece ordinal, rows drawn], ...] of the open pieces


def open_pieces(value, stream: str) -> tuple[tuple[int, int], ...]:
    """A state's open pieces: [[ordinal, rows drawn], ...], ordinals increasing (they open in
    order). What a writer produces; anything else is a ValueError naming the stream."""
    ok = isinstance(value, list) and all(
        isinstance(pair, list) and len(pair) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
        for pair in value
    )  # fmt: skip
    if ok and all(a[0] < b[0] for a, b in zip(value, value[1:], strict=False)):
        return tuple((int(o), int(d)) for o, d in value)
    raise StateError(
        f"resume state: stream {stream!r}: {OPEN} must be [[piece, rows drawn], ...] with "
        f"increasing pieces, got {value!r:.80}"
    )
