"""Seeded shuffles: the order pieces are read in, how open pieces interleave, and windows.

Every generator is derived from (seed, stream name, epoch, counter), never from global state,
so a run is a pure function of its config (STYLE §3).

Three layers, each cheap to resume:

1. **Piece order** (`piece_order`). Every file of a stream is cut into pieces (byte ranges,
   row groups, record-batch runs, shards: pipeline/read/sources.py). Each epoch reads all pieces of
   all files in one seeded permutation, so a corpus that is one file sorted by source is read
   from all over the file, not front to back.
2. **Interleave** (`Interleave`). `shuffle.pieces` pieces are open at once and their
   documents are merged by a seeded schedule. While pieces remain to be opened, each draw
   picks an open piece uniformly, so every open piece drains at the same rate and the output
   is an even mix of `shuffle.pieces` pieces; when a piece runs out, the next piece in the
   epoch's order opens. Once every piece is open (the end of the epoch), a draw picks a piece
   with probability proportional to the documents it has left: a uniformly random merge of
   what is left, so the open pieces end together and the epoch's last windows stay mixed
   (picking uniformly there would end the epoch on its last-opened pieces alone; mosaicml
   streaming 796). It is the idea of Mosaic streaming's block shuffles (py1br/py1e: shuffle
   shards, then spread each shard's samples over a block of the output), with a fixed number
   of open pieces instead of a block of samples, so the memory is bounded by pieces, not by
   samples. Piece i of an epoch opens no earlier than draw `OPEN_EVERY`·i: the first
   documents of an epoch wait for a few pieces, not for `shuffle.pieces` of them; and the
   first epoch's ramp gives a piece its rows in parts, first rows first (`needs`: the next
   part before a draw could take the last row given; stages/plan.py `ramp_parts`), so the
   ramp does not ask its pieces whole. State: the next piece to open, the draw count and,
   per open piece, how many of its rows were drawn; a resume re-reads the open pieces.

   Why this many: a 5% window that mixes M pieces of a corpus sorted by 10 sources has a top
   share of about 0.1 + 2·sqrt(0.09/M) in its worst window, so 0.15 takes M of a few hundred
   (bench/shuffle_quality.py); pieces of `shuffle.piece_bytes` (256 KiB) rather than the
   read's 1 MiB give 256 open pieces for the memory of 64.
3. **Window** (`WindowShuffle`): a permutation inside consecutive windows of documents.

`shuffle.files: false` reads files and their pieces in order (no piece order, no interleave);
`shuffle.pieces: 0` is the window-only shuffle of the first releases (seeded file order, each file's pieces in
order, one at a time).

The document shuffle permutes each run of `window` consecutive documents. A sliding shuffle
buffer mixes a little further, but its state is the buffer itself; a fixed window is resumed
from "window k, position j" by re-reading one window, which is what makes exact, cheap resume
possible (the trade-off grain makes for its windowed shuffle too).
"""

from __future__ import annotations

import bisect
import itertools
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.read.access import WHOLE_FILE
from pipeline.stages.stage import StateError

if TYPE_CHECKING:
    from pipeline.read.access import Piece
    from pipeline.stages.stage import Doc, Stage

FILE_ORDER, DOC_WINDOW, PIECE_ORDER, INTERLEAVE = 1, 2, 3, 4  # stream-of-randomness tags


def rng_for(seed: int, stream: str, epoch: int, tag: int, counter: int = 0) -> np.random.Generator:
    key = [
        seed & 0xFFFFFFFF,
        seed >> 32 & 0xFFFFFFFF,
        zlib.crc32(stream.encode()),
        epoch,
        tag,
        counter,
    ]
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in key]))


def file_order(
    n_files: int, seed: int, stream: str, epoch: int, enabled: bool = True
) -> np.ndarray:
    """The order in which a stream's files are read in `epoch` (`shuffle.pieces: 0`)."""
    if not enabled:
        return np.arange(n_files)
    return rng_for(seed, stream, epoch, FILE_ORDER).permutation(n_files)


def piece_order(n_pieces: int, seed: int, stream: str, epoch: int) -> np.ndarray:
    """The order in which a stream's pieces (of every file, numbered file by file) are opened
    in `epoch`: a fresh permutation per epoch."""
    return rng_for(seed, stream, epoch, PIECE_ORDER).permutation(n_pieces)


def window_permutation(size: int, seed: int, stream: str, epoch: int, window: int) -> np.ndarray:
    return rng_for(seed, stream, epoch, DOC_WINDOW, window).permutation(size)


DRAW_CHUNK = 4096  # draws drawn at once: draw n is element n % 4096 of chunk n // 4096
OPEN_EVERY = 2  # piece i of an epoch opens no earlier than draw OPEN_EVERY * i (the ramp)


class Interleave:
    """Which open piece gives each next document of one stream's epoch (see module, 2).

    Pieces are numbered by their place in the epoch's `piece_order` (ordinals). The caller
    opens pieces when asked (`to_open`, then `opened` with the piece's row count, bad records
    included) and takes draws (`draw`: the ordinal and the row of that piece). Everything is
    a function of the state (`snapshot`: next piece, draws, open pieces with rows drawn), so
    a resumed schedule is the uninterrupted one. One thread owns an Interleave.

    Cost per draw: O(open pieces) for the cumulative sums (a few microseconds at 64).
    """

    def __init__(self, limit: int, seed: int, stream: str, epoch: int, n_pieces: int,
                 next_piece: int = 0, draws: int = 0,
                 open_pieces: tuple[tuple[int, int], ...] = ()):  # fmt: skip
        self.limit, self.n_pieces = max(1, limit), n_pieces
        self.seed, self.stream, self.epoch = seed, stream, epoch
        self.next_piece, self.draws = next_piece, draws
        self.ords: list[int] = []  # open pieces, in the order they opened
        self.done: list[int] = []  # rows drawn, per open piece
        self.left: list[int] = []  # rows left, per open piece
        self.more: list[bool] = []  # per open piece: rows of it are still to come (`extended`)
        self._partial = 0  # open pieces with rows still to come
        # Open pieces of a resumed state whose row counts are not known yet, in order.
        self._pending = [(int(o), int(d)) for o, d in open_pieces]
        self._chunk = -1
        self._uniform = np.zeros(0)
        self._ords: tuple[int, ...] | None = ()  # `ords` as a tuple, until it changes

    def to_open(self) -> int | None:
        """The piece to open (read) before the next draw, or None: draw (or `finished`)."""
        if self._pending:
            return self._pending[0][0]
        if self.next_piece >= self.n_pieces or len(self.ords) >= self.limit:
            return None
        if self.ords and self.next_piece * OPEN_EVERY > self.draws:
            return None  # the ramp: not yet
        return self.next_piece

    def opened(self, ordinal: int, rows: int, more: bool = False) -> int | None:
        """Piece `ordinal` (what `to_open` named) has `rows` rows. Returns how many of them
        were drawn before (a resumed piece), or None if it has none left to draw.

        `more`: these are its first rows (at least one), the rest are still to be read; the
        caller reads them when `needs` names the piece and gives them to `extended`. Only the
        ends of pieces and the last phase's weights depend on the row counts, so the draws
        are the same as with the whole count given here."""
        if self._pending:
            _, drawn = self._pending.pop(0)
            if drawn >= rows:
                raise StateError(
                    f"piece {ordinal} of epoch {self.epoch} has {rows} rows, the state has "
                    f"drawn {drawn} of them: the stream's files changed since the state"
                )
        else:
            drawn = 0
            self.next_piece += 1
        if rows <= drawn:
            return None
        self.ords.append(ordinal)
        self.done.append(drawn)
        self.left.append(rows - drawn)
        self.more.append(more)
        self._partial += more
        self._ords = None
        return drawn

    def needs(self) -> int | None:
        """An open piece whose further rows must be given (`extended`) before the next draw,
        or None. While pieces remain to open, the piece the next draw picks if that draw
        could take its last row known so far; after that, every piece with rows to come
        (the draws weigh the rows left)."""
        if not self._partial:
            return None
        if self.next_piece < self.n_pieces:
            s = self._uniform_pick(self._u(self.draws))
            return self.ords[s] if self.more[s] and self.left[s] <= 1 else None
        return next(o for o, more in zip(self.ords, self.more, strict=True) if more)

    def extended(self, ordinal: int, rows: int, more: bool) -> None:
        """Open piece `ordinal` has `rows` rows more; `more`: and rows after those."""
        s = self.ords.index(ordinal)
        self.left[s] += rows
        if not more and self.more[s]:
            self.more[s] = False
            self._partial -= 1

    @property
    def finished(self) -> bool:
        """Every piece of the epoch was drawn to its end."""
        return not self.ords and not self._pending and self.next_piece >= self.n_pieces

    def snapshot(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """(next piece, draws, open pieces' ordinals, rows drawn of each): the state, positions
        only. Cheap enough per document: the ordinals' tuple is shared until a piece opens or
        ends, the counts are one tuple copy."""
        if self._pending:
            ords = tuple(self.ords) + tuple(o for o, _ in self._pending)
            done = tuple(self.done) + tuple(d for _, d in self._pending)
            return self.next_piece, self.draws, ords, done
        if self._ords is None:
            self._ords = tuple(self.ords)
        return self.next_piece, self.draws, self._ords, tuple(self.done)

    def _u(self, n: int) -> float:
        chunk = n // DRAW_CHUNK
        if chunk != self._chunk:
            rng = rng_for(self.seed, self.stream, self.epoch, INTERLEAVE, chunk)
            self._chunk, self._uniform = chunk, rng.random(DRAW_CHUNK)
        return float(self._uniform[n % DRAW_CHUNK])

    def draw(self) -> tuple[int, int, bool]:
        """The next row: (piece ordinal, row in that piece, whether it was the piece's last).
        Only when `to_open()` is None and not `finished`. Uniform over the open pieces while
        pieces remain to open, then proportional to the rows they have left (module, 2)."""
        u = self._u(self.draws)
        if self.next_piece < self.n_pieces:
            s = self._uniform_pick(u)
        else:
            total = sum(self.left)
            pick = min(int(u * total), total - 1)
            s = bisect.bisect_right(list(itertools.accumulate(self.left)), pick)
        ordinal, row = self.ords[s], self.done[s]
        self.draws += 1
        self.done[s] += 1
        self.left[s] -= 1
        last = self.left[s] == 0
        if last:
            assert not self.more[s], f"piece {ordinal} drawn past its rows known (see needs)"
            del self.ords[s], self.done[s], self.left[s], self.more[s]
            self._ords = None
        return ordinal, row, last

    def _uniform_pick(self, u: float) -> int:
        return min(int(u * len(self.ords)), len(self.ords) - 1)


# -- an open piece's rows (what the DocSource reads into the interleave) ----------------------


class PieceRows:
    """An open piece's rows, [(batch, first, stop)], taken one at a time in order; a piece
    read in parts gets its later rows by `extend`."""

    __slots__ = ("segments", "n", "_seg", "_row")

    def __init__(self, segments: list):
        self.segments = list(segments)
        self.n = sum(z - a for _, a, z in segments)
        self._seg, self._row = 0, segments[0][1] if segments else 0

    def extend(self, segments: list) -> int:
        """Append rows (the piece's next part); returns how many."""
        if not self.segments and segments:
            self._row = segments[0][1]
        self.segments += segments
        added = sum(z - a for _, a, z in segments)
        self.n += added
        return added

    def skip(self, k: int) -> PieceRows:
        for _ in range(k):
            self.take()
        return self

    def take(self) -> tuple[Any, int]:
        batch, _, stop = self.segments[self._seg]
        if self._row == stop:  # this segment is used up: the next one (perhaps extended since)
            self._seg += 1
            batch, self._row, stop = self.segments[self._seg]
        i = self._row
        self._row += 1
        return batch, i


def by_piece(ords: list[int], parts: list, order: list[Piece], ends: list[int]):
    """One unit's rows, [(batch, first, stop)] in read order, split into its pieces: (ordinal,
    segments) for each of `ords` (the unit's pieces, in order; [] for an empty one).

    A row's piece is the one of its file whose records [first_record, end) hold its record
    (vectorized, one comparison per piece of the unit); a whole-piece error (WHOLE_FILE) goes
    to the first piece of its file, from the piece of the row before it on, that has no row
    yet (the piece whose read failed gives just that row), else to the first of its file from
    there. Pieces are read in order, so the rows' pieces never go back. (The rule looks only
    at the unit's pieces and rows, so a failed piece gets its own error however the pieces
    are grouped into units: whole, or in parts, plan.ramp_parts.)"""
    out: dict[int, list] = {o: [] for o in ords}
    files = [order[o].file_index for o in ords]
    k = 0  # the piece of the last row seen (its index in `ords`)
    for batch, a, z in parts:
        ids = batch.ids[a:z]
        fi, rec = (ids >> 32).astype(np.int64), (ids & 0xFFFFFFFF).astype(np.int64)
        which = np.full(z - a, -1, dtype=np.int64)
        for j, o in enumerate(ords):
            hit = (fi == files[j]) & (rec >= order[o].first_record) & (rec < ends[o])
            which[hit] = j
        whole = np.flatnonzero(rec == WHOLE_FILE).tolist()
        seen = {j for j, o in enumerate(ords) if out[o]} if whole else set()
        for i in whole:
            before = int(which[i - 1]) if i else k
            same = [j for j in range(before, len(ords)) if files[j] == fi[i]]
            had = seen | {int(w) for w in which[:i]}
            fresh = [j for j in same if j not in had]
            which[i] = fresh[0] if fresh else same[0] if same else -1
        if (which < 0).any() or which[0] < k or (np.diff(which) < 0).any():
            bad = int(np.flatnonzero(which < 0)[0]) if (which < 0).any() else 0
            raise ValueError(
                f"record {int(rec[bad])} of file {int(fi[bad])} is out of its read unit's "
                "pieces or order (did the file change while it was read?)"
            )
        cuts = [0, *(np.flatnonzero(which[1:] != which[:-1]) + 1).tolist(), z - a]
        for s, e in zip(cuts, cuts[1:], strict=False):
            out[ords[int(which[s])]].append((batch, a + s, a + e))
        k = int(which[-1])
    return [(o, out[o]) for o in ords]


FIRST_WINDOW = 8

# WindowShuffle state keys
WINDOW = "window"  # k: the window's number in its epoch
OFFSET = "offset"  # how many of the window's documents were emitted
EPOCH = "epoch"  # the window's epoch (a window that would begin a new epoch is window 0)
INPUT = "input"  # the input's state at the window's first document


def window_size(window: int, k: int) -> int:
    """Window k of an epoch holds min(window, 8 * 2^k) documents.

    The ramp lets the first documents of an epoch out after 8 are read instead of `window`
    (the first batch comes sooner); from the fifth or so window on, windows are full size.
    """
    return min(window, FIRST_WINDOW << min(k, 40))


@dataclass(frozen=True, slots=True)
class WindowPos:
    """Where a WindowShuffle stands: `offset` documents into window `k`, which began at the
    input's cursor `start` (the cursor of the window's first document, in read order)."""

    k: int
    offset: int
    start: Any


class WindowShuffle:
    """Shuffle one stream's documents within consecutive windows, epoch by epoch.

    Window k of epoch e takes the next window_size(window, k) documents of epoch e in read
    order and emits them in a permutation seeded by (seed, stream, e, k). A window never spans
    two epochs, and the window count restarts at 0 with each epoch. State: window k of epoch
    e, `offset` documents emitted, and the input's state at the window's first document;
    resuming re-reads that one window. Between windows the state names the next window, so a
    stream that has ended resumes as ended.
    """

    def __init__(self, docs: Stage[Doc], window: int, seed: int, stream: str):
        self.docs, self.window, self.seed, self.stream = docs, window, seed, stream
        self._k = 0  # the current window's number in its epoch
        self._window: list[Doc] = []  # the current window, in emission order
        self._start: Any = None  # the input's cursor at the current window's first document
        self._offset = 0  # documents of the current window emitted
        self._resumed = True  # the next window is window `_k` itself (start, or set_state)
        self._carry: Doc | None = None  # read ahead: the first document of the next epoch
        self._epoch = 0  # the current window's epoch

    def __iter__(self) -> WindowShuffle:
        return self

    def __next__(self) -> Doc:
        while self._resumed or self._offset == len(self._window):
            self._fill()
        doc = self._window[self._offset]
        doc.cursor = WindowPos(self._k, self._offset, self._start)
        self._offset += 1
        return doc

    def _fill(self) -> None:
        """Read the next window (StopIteration when the input has ended). The input's cursors
        carry the epoch: a window never spans two epochs."""
        first = self._carry or next(self.docs)  # StopIteration: the stream has ended
        self._carry = None
        epoch = first.cursor.epoch
        if epoch != self._epoch:
            self._k = 0
        elif not self._resumed:
            self._k += 1
        skip, self._resumed = (self._offset if self._resumed else 0), False
        self._epoch, self._start = epoch, first.cursor
        window = [first]
        while len(window) < window_size(self.window, self._k):
            doc = next(self.docs, None)
            if doc is None:
                break
            if doc.cursor.epoch != epoch:
                self._carry = doc
                break
            window.append(doc)
        if self.window > 1:
            order = window_permutation(len(window), self.seed, self.stream, epoch, self._k)
            window = [window[i] for i in order]
        self._window, self._offset = window, skip

    def get_state(self, at: WindowPos | None = None) -> dict:
        if at is not None:
            k, offset, epoch, inner = at.k, at.offset, at.start.epoch, self.docs.get_state(at.start)
        elif self._resumed:  # no window read since the start or set_state
            k, offset, epoch, inner = self._k, self._offset, self._epoch, self.docs.get_state()
        elif self._offset == len(self._window):  # between windows: the next one, unread
            carry = self._carry and self._carry.cursor
            k, offset, epoch, inner = self._k + 1, 0, self._epoch, self.docs.get_state(carry)
        else:
            return self.get_state(WindowPos(self._k, self._offset, self._start))
        return {WINDOW: k, OFFSET: offset, EPOCH: epoch, INPUT: inner}

    def set_state(self, state: dict) -> None:
        self.docs.set_state(state[INPUT])
        self._k, self._offset, self._epoch = (int(state[k]) for k in (WINDOW, OFFSET, EPOCH))
        self._window, self._resumed, self._carry = [], True, None
