"""Where one stream's documents are read from, and in what order (`StreamPlan`): its files,
their pieces, the lanes' shares of the pieces (`lane_shares`), each epoch's pieces in their
seeded order, and the read units that read them, from an epoch's start or from a resumed
position. A pure function of the files and the config (seed, lanes, shuffle and read
settings); the reading itself is documents.py's `DocSource`."""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from pipeline.config import Config
from pipeline.read import formats
from pipeline.read.access import WHOLE_FILE, Access, Piece
from pipeline.read.reading import Unit, group_units
from pipeline.read.sources import data_files, plan_pieces
from pipeline.stages.shuffle import OPEN_EVERY, file_order, piece_order
from pipeline.stages.stage import StateError


def lane_shares(works: list[int], lanes: int) -> list[int]:
    """Which lane reads each piece: a balanced, deterministic partition by work (bytes).

    Largest first, each to the lane with the least work so far (ties: the lower lane, then
    the earlier piece): every lane's work is within one piece of the mean. A pure function of
    the pieces' sizes and order, so of the files and the config; never of the world size."""
    if lanes == 1:
        return [0] * len(works)
    load = [0] * lanes
    out = [0] * len(works)
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        lane = min(range(lanes), key=lambda k: (load[k], k))
        out[i] = lane
        load[lane] += works[i]
    return out


class StreamPlan:
    """Stream `name`'s plan for lane `lane` of `lanes` (0 of 1: the stream whole, with the
    orders it always had). A lane's seeded orders are its own (`salt`). `interleaved`: the
    pieces are read in a seeded order across files and interleaved (shuffle.py), else the
    files one after another, each file's pieces in order."""

    def __init__(self, name: str, cfg: Config, lane: int = 0, lanes: int = 1):
        self.name, self.cfg = name, cfg
        self.stream = cfg.streams[name]
        self.lane, self.lanes = lane, lanes
        self.salt = name if lanes == 1 else f"{name}/lane{lane}"
        self.interleaved = cfg.shuffle.interleaved
        self._pieces: list[list[Piece]] | None = None
        self._files: list[str] | None = None
        self._orders: dict[int, tuple[list[Piece], list[int]]] = {}  # per epoch, see order

    def in_file_order(self) -> None:
        """Read the pieces in file order from now on, at the read's piece size (a resume state
        written before pieces were interleaved)."""
        self.interleaved, self._pieces = False, None

    @property
    def files(self) -> list[str]:
        """The sorted file list that `file_index` refers to (MDS: shards, not indexes)."""
        if self._files is None:
            access = Access.of(self.stream)
            assert self.stream.format is not None  # load_config resolves every stream's format
            self._files = data_files(list(self.stream.paths), self.stream.format, access)
        return self._files

    def pieces(self) -> list[list[Piece]]:
        if self._pieces is None:
            read, shuffle = self.cfg.read, self.cfg.shuffle
            assert self.stream.format is not None  # load_config resolves every stream's format
            size = read.piece_bytes
            if self.interleaved:  # finer pieces mix better for the same memory (shuffle.py)
                size = min(size, shuffle.piece_bytes)
            plan = plan_pieces(self.stream.paths, self.stream.format, size,
                               read.max_record_bytes, Access.of(self.stream))  # fmt: skip
            pieces = sum(len(per_file) for per_file in plan)
            if self.lanes > 1 and 0 < pieces < 2 * self.lanes:
                # Too few pieces to share among the lanes (a small stream): cut finer, to
                # about two per lane where the format can (JSONL, Arrow; a row group or a
                # shard stays whole). One lane never re-plans.
                total = sum(p.work for per_file in plan for p in per_file)
                finer = max(4 << 10, total // (2 * self.lanes))
                if finer < size:
                    plan = plan_pieces(self.stream.paths, self.stream.format, finer,
                                       read.max_record_bytes, Access.of(self.stream))  # fmt: skip
            self._pieces = plan
        return self._pieces

    def piece_lanes(self) -> list[int]:
        """Each piece's lane, over every file's pieces in plan order (`lane_shares`)."""
        flat = [p for per_file in self.pieces() for p in per_file]
        lanes = lane_shares([p.work for p in flat], self.lanes)
        if self.lanes > 1 and len(set(lanes)) < self.lanes:
            raise ValueError(
                f"stream {self.name!r}: {len(flat)} piece(s) cannot feed {self.lanes} lanes "
                "(each lane reads whole pieces): use fewer lanes, more files, or a smaller "
                "read.first_block_bytes / shuffle.piece_bytes"
            )
        return lanes

    def share_bytes(self) -> int:
        """The bytes (work) of the pieces this lane reads: the whole stream with one lane."""
        return sum(p.work for per_file in self._lane_files() for p in per_file)

    def _lane_files(self) -> list[list[Piece]]:
        """Every file's pieces that this lane reads (all of them with one lane)."""
        if self.lanes == 1:
            return self.pieces()
        lanes, at, out = self.piece_lanes(), 0, []
        for per_file in self.pieces():
            out.append([p for i, p in enumerate(per_file) if lanes[at + i] == self.lane])
            at += len(per_file)
        return out

    def _lane_only(self, flat: list[Piece], ends: list[int]) -> tuple[list[Piece], list[int]]:
        """This lane's pieces of the flat plan, each keeping its end in its file."""
        if self.lanes == 1:
            return flat, ends
        mine = [i for i, lane in enumerate(self.piece_lanes()) if lane == self.lane]
        return [flat[i] for i in mine], [ends[i] for i in mine]

    def units(self, epoch: int, keep: bool = True) -> list[Unit]:
        """The read units of a whole epoch, in the order they are read (`keep`: see `order`)."""
        if self.interleaved:
            return self.plan(epoch, (), 0, keep)[0]
        per_file = self._lane_files()
        order = file_order(len(per_file), self.cfg.seed, self.salt, epoch, self.cfg.shuffle.files)
        flat = [p for i in order for p in per_file[i]]
        # Only the first epoch ramps up from small units (for the first batch); later epochs
        # are read ahead (see `_blocks`), so their units are full size from the start.
        read = self.cfg.read
        return group_units(
            flat, read.block_bytes, read.first_block_bytes if epoch == 0 else read.block_bytes
        )

    def order(self, epoch: int, keep: bool = True) -> tuple[list[Piece], list[int]]:
        """The epoch's pieces in their seeded order (shuffle.piece_order over every file's
        pieces), and each one's end: the first record of the next piece of its file, or
        WHOLE_FILE (a piece holds records [first_record, end)). Kept for the epoch being read
        (`keep`); an epoch only planned ahead (a chain's) is computed again when read."""
        if epoch in self._orders:
            return self._orders[epoch]
        flat: list[Piece] = []
        ends: list[int] = []
        for per_file in self.pieces():
            flat += per_file
            ends += [p.first_record for p in per_file[1:]] + [WHOLE_FILE]
        flat, ends = self._lane_only(flat, ends)
        perm = piece_order(len(flat), self.cfg.seed, self.salt, epoch)
        ordered = ([flat[i] for i in perm], [ends[i] for i in perm])
        if keep:
            for old in [e for e in self._orders if e < epoch - 1]:
                del self._orders[old]  # the current epoch and the one before are kept
            self._orders[epoch] = ordered
        return ordered

    def plan(
        self, epoch: int, open_pieces: tuple[tuple[int, int], ...], next_piece: int,
        keep: bool = True,
    ) -> tuple[list[Unit], list[list[int]]]:  # fmt: skip
        """The units that read `epoch` from a position: the open pieces (re-read on a
        resume), then every piece from `next_piece` on; and each unit's piece ordinals."""
        order, ends = self.order(epoch, keep)
        late = [o for o, _ in open_pieces if o >= min(next_piece, len(order))]
        if late:
            raise StateError(
                f"resume state: stream {self.name!r}: open piece {late[0]} was not opened yet "
                f"(next piece {next_piece}, {len(order)} pieces in epoch {epoch}): a state of "
                "other files or settings?"
            )
        todo = [o for o, _ in open_pieces] + list(range(next_piece, len(order)))
        read = self.cfg.read
        first = read.first_block_bytes if epoch == 0 else read.block_bytes  # as `units`
        pieces = [order[o] for o in todo]
        ramp = pieces[: self.cfg.shuffle.pieces]
        parts = RAMP_PARTS if read.ramp_parts is None else read.ramp_parts
        if (
            epoch == 0 and not open_pieces and next_piece == 0 and parts > 1
            and sum(p.work for p in ramp) > 2 * first
        ):  # fmt: skip
            # The first epoch from its start, whose ramp asks more than its first units: its
            # first pieces in parts (`ramp_parts`). Later epochs are read ahead of their draws,
            # a resume re-reads its open pieces whole.
            todo, pieces = ramp_parts(order, ends, self.cfg.shuffle.pieces, parts)
            # Up to the last part, units of at most RAMP_UNIT_BYTES: a part is there when its
            # unit is whole, so a part needed early waits for less.
            last = max((k for k, p in enumerate(pieces) if p.skip or p.take >= 0), default=-1)
            small = (last + 1, RAMP_UNIT_BYTES)
        else:
            small = (0, 0)
        units = group_units(pieces, read.block_bytes, first, keys=todo, small=small)
        ords, at = [], 0
        for unit in units:
            ords.append(todo[at : at + len(unit.pieces)])
            at += len(unit.pieces)
        return units, ords


RAMP_PARTS = 5  # read.ramp_parts's default where ranks wait (config.py)
RAMP_UNIT_BYTES = 2 << 20  # the read units' size up to the last part (see `plan`)
RAMP_FIRST = 2  # rows of a ramp piece's first part; each next part is twice the one before
# Reads are ordered as if each piece's draws ran this many standard deviations ahead of their
# mean. By the mean alone (0), a piece drawn more often than its mean needs its next part
# before its turn, and the reads run ahead to it: on the bench corpus (`python -m bench
# ramp-reads`, seed 0) 19.7 MiB were read by draw 100, where with 2.5 5.7 were (3.5: 6.9).
RAMP_Z = 2.5


def _early(rows: float) -> float:
    """The expected draws x of a piece by which its draws reach `rows`, `RAMP_Z` standard
    deviations early: its draws are about Poisson, so x + z·sqrt(x) = rows."""
    return ((np.sqrt(RAMP_Z * RAMP_Z + 4 * rows) - RAMP_Z) / 2) ** 2


def ramp_parts(order: list[Piece], ends: list[int], limit: int,
               max_parts: int) -> tuple[list[int], list[Piece]]:  # fmt: skip
    """The pieces of an epoch read from its start, the first `limit` in parts, in the order
    the interleave's draws need them: (each one's ordinal, the piece or part).

    Why: the interleave opens piece i at draw 2i (shuffle.OPEN_EVERY), so its first `limit`
    pieces (256 of 256 KiB) open within the first 512 documents, and a piece opens with all
    its rows: 64 MiB tokenized before the 512th document, where the ranks' first steps take a
    few MiB (`python -m bench first-steps`: the ranks waited ~40-50% of their first 32 steps).
    Read in parts, a piece opens with its first rows, the rest come when its draws near them
    (shuffle.Interleave `needs`), and the draws are the same as with whole pieces.

    The parts of piece i < `limit` hold rows [0, 2), [2, 4), [4, 8), [8, 16), ... of it
    (`RAMP_FIRST`, each part twice the one before), at most `max_parts`, the last one the
    rest. A piece that cannot be read in parts cheaply (`Format.reads_in_parts`), or with no
    more rows than its first part, is read whole. Each part is placed at the draw by which
    its first row is drawn, `RAMP_Z` standard deviations early (`_early`): piece i is open
    from draw 2i, among min(limit, d/2 + 1) open pieces at draw d, one draw in `limit` after
    the ramp. Each later piece (read whole) is placed where it opens: at the draw by which a
    piece open before it ends (its last row drawn), and not before its turn (draw 2j). Parts
    and pieces are read in that order, so the reads keep ahead of the draws by a margin, not
    by the ramp's pieces whole. A part's work (its bytes, for `group_units`) is its share of
    the piece's rows; a piece whose row count is unknown (its file's last) is taken to have
    the known pieces' mean row size.

    What it reads (the 128 MiB bench corpus, 471 pieces, seeds 0-2; the MiB read, in reading
    order, before the draw that needs them): by draw 100, 5-6 MiB where whole pieces read 14;
    by draw 200, 10-17 (27-30); by draw 512, 29-49 (71-73). A piece drawn far more often than
    its mean (1 in a few hundred) still has the reads run ahead to its next part."""
    n_ramp = min(limit, len(order))
    opens = np.arange(n_ramp) * OPEN_EVERY  # the draw at which each ramp piece opens
    n_draws = OPEN_EVERY * n_ramp
    open_now = np.minimum(n_ramp, np.arange(n_draws) // OPEN_EVERY + 1)
    h = np.concatenate([[0.0], np.cumsum(1.0 / open_now)])  # draws per open piece, by draw

    def need(i: int, row: int) -> float:
        """The draw by which ramp piece i's row `row` is drawn (`_early`)."""
        if row == 0:
            return float(opens[i])
        t = h[opens[i]] + _early(row)
        if t <= h[-1]:
            return float(np.searchsorted(h, t))
        return n_draws + (t - h[-1]) * n_ramp

    rows = [
        e - p.first_record if e != WHOLE_FILE else None for p, e in zip(order, ends, strict=True)
    ]
    known = [(p.nbytes, n) for p, n in zip(order, rows, strict=True) if n]
    mean = sum(b for b, _ in known) / sum(n for _, n in known) if known else 4096.0
    n_est = [
        n if n is not None else max(1, round(p.nbytes / mean))
        for p, n in zip(order, rows, strict=True)
    ]
    timed: list[tuple[float, int, Piece]] = []
    for i in range(n_ramp):
        p, n = order[i], n_est[i]
        cuts = [0]  # each part's first row: 0, 2, 4, 8, 16, ...
        while cuts[-1] < n and len(cuts) < max_parts:
            cuts.append(cuts[-1] + (RAMP_FIRST << max(0, len(cuts) - 2)))
        cuts = [c for c in cuts if c < n] + [-1]  # the last part: the rest
        if len(cuts) <= 2 or not formats.get(p.fmt).reads_in_parts(p):  # read whole (or empty)
            timed.append((need(i, 0), i, p))
            continue
        for a, b in zip(cuts, cuts[1:], strict=False):
            take = -1 if b < 0 else b - a
            share = (n - a if b < 0 else take) / n
            part = replace(p, skip=a, take=take, nbytes=max(1, round(p.nbytes * share)))
            timed.append((need(i, a), i, part))
    closing = sorted(need(i, n_est[i]) for i in range(n_ramp))  # when each open piece ends
    for j in range(n_ramp, len(order)):  # each opens as the first open piece ends
        t = max(heapq.heappop(closing), OPEN_EVERY * j)  # and not before its turn (draw 2j)
        timed.append((t, j, order[j]))
        heapq.heappush(closing, t + _early(n_est[j]) * n_ramp)
    timed.sort(key=lambda t: (t[0], t[1]))
    return [i for _, i, _ in timed], [p for *_, p in timed]
