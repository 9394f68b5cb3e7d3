"""Where one stream's documents are read from, and in what order (`StreamPlan`): its files,
their pieces, the lanes' shares of the pieces (`lane_shares`), each epoch's pieces in their
seeded order, and the read units that read them, from an epoch's start or from a resumed
position. A pure function of the files and the config (seed, lanes, shuffle and read
settings); the reading itself is documents.py's `DocSource`."""

from __future__ import annotations

from pipeline.config import Config
from pipeline.read.access import WHOLE_FILE, Access, Piece
from pipeline.read.reading import Unit, group_units
from pipeline.read.sources import data_files, plan_pieces
from pipeline.stages.shuffle import file_order, piece_order
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
        order, _ = self.order(epoch, keep)
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
        units = group_units([order[o] for o in todo], read.block_bytes, first)
        ords, at = [], 0
        for unit in units:
            ords.append(todo[at : at + len(unit.pieces)])
            at += len(unit.pieces)
        return units, ords
