"""One stream's tokenized documents, in their deterministic order, across epochs.

Per epoch: the stream's files are cut into pieces, the pieces put in a seeded order across all
files (shuffle.piece_order), grouped into units in that order, and read and tokenized by an
executor (Ray Data, with or without a head start, or in-process for `check` and tests), which
hands blocks back in unit order whatever the workers' timing. This stage owns the document
order, so the interleave of open pieces happens here (shuffle.Interleave): its schedule is a
function of the seed, the epoch, the draw count and the pieces' row counts, never of when a
block arrived. The windowed document shuffle comes next, in its own stage
(shuffle.WindowShuffle). Bad records are handled here, in stream order, so the error raised
(`on_error: fail`) or the rejects written (`skip`) are the same on every run.

`shuffle.pieces: 0` or `shuffle.files: false` read as the first releases did: files in a seeded order
(or their own), each file's pieces in order, one after another.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.config import Config
from pipeline.read.access import WHOLE_FILE, Piece
from pipeline.read.chain import EpochChain, epochs_per_chain
from pipeline.read.reading import Executor, Unit
from pipeline.stages.plan import StreamPlan
from pipeline.stages.positions import OPEN, POSITION, REPORTED, OpenPos, SourcePos, open_pieces
from pipeline.stages.shuffle import Interleave, PieceRows, by_piece
from pipeline.stages.stage import Doc, StateError
from pipeline.tokenize.encoders import BACKEND_NAMES
from wire.arrays import valid, view


class BadRecordError(ValueError):
    """A bad record under `on_error: fail`; the message names stream, file and record."""


@dataclass
class StreamCounters:
    docs: int = 0
    tokens: int = 0
    skipped: int = 0
    epochs_started: int = 0
    capped: bool = False
    # tokens read per tokenizer backend (encoders.BACKEND_NAMES); this run only, not state
    backend_tokens: list[int] = field(default_factory=lambda: [0] * len(BACKEND_NAMES))
    lengths: list[int] = field(default_factory=list, repr=False)  # sampled doc lengths


@dataclass(frozen=True)
class Reject:
    stream: str
    file: str
    record: int | None
    reason: str

    def as_dict(self) -> dict:
        return {
            "stream": self.stream,
            "file": self.file,
            "record": self.record,
            "reason": self.reason,
        }


def _share(total: int, lane: int, lanes: int) -> int:
    """Lane `lane`'s part of `total` split over `lanes`: the remainder goes to the first."""
    return total // lanes + (1 if lane < total % lanes else 0)


class DocSource:
    """One stream's good documents in their shuffled order: `repeat` epochs, stopping early at
    `max_tokens`. A stage (pipeline/stages/stage.py): each doc's `cursor` is where the stream stood
    before it: an OpenPos when pieces are interleaved, else a SourcePos (read order).

    Reading runs ahead in the executor (Ray Data or in-process); `start()` begins it before
    the first document is asked for, so that every stream of a feed reads concurrently.
    """

    LENGTH_SAMPLE = 100_000  # doc lengths kept for the length distribution

    def __init__(
        self,
        name: str,
        index: int,
        cfg: Config,
        executor: Executor,
        on_reject: Callable[[Reject], None] | None = None,
        first_executor: Executor | None = None,
        lane: int | None = None,
    ):
        self.name, self.index, self.cfg = name, index, cfg
        self.stream = cfg.streams[name]
        # Lane `lane` of `cfg.lanes` reads its share of the stream's pieces (plan.py `lane_shares`)
        # and caps at its share of `max_tokens`; its seeded orders are its own (`salt`).
        # No lane (stats, check) or one lane is the stream whole, with the orders it always had.
        self.lane, self.lanes = (0, 1) if lane is None else (lane, cfg.lanes)
        # Where its documents are read from, in what order (pieces in a seeded order across
        # files, interleaved (shuffle.py); else read order).
        self.plan = StreamPlan(name, cfg, self.lane, self.lanes)
        cap = self.stream.max_tokens
        self.max_tokens = None if cap is None else _share(cap, self.lane, self.lanes)
        self.executor = executor
        self.first_executor = first_executor or executor  # the read `start()` begins
        self.on_reject = on_reject
        self.counters = StreamCounters()
        self._early: Iterator[pa.Table] | None = None
        # The read of the epochs after the current one (a chain: chain.py), started ahead.
        self._ahead: EpochChain | None = None
        self._chain: EpochChain | None = None  # the chain the current epoch came from
        self._current: Iterator[pa.Table] | None = None
        self._rows: Iterator[Doc] | None = None  # the current epoch's good documents
        self.start_pos = self.pos = SourcePos()
        self.done = False
        # Rejects at read positions up to this mark were reported (also before a resume).
        self.reported: tuple[int, ...] = (-1, -1, -1)
        self.read_mark = self.reported
        self.first_block_at: float | None = None  # time.monotonic() of the first block in
        self.first_reads: Iterator[pa.Table] | None = None
        self._open0: tuple[tuple[int, int], ...] = ()  # the open pieces at `start_pos`
        self._il: Interleave | None = None  # the current epoch's schedule, while it is read
        # The current epoch is read from its start (not a resume inside it), and the documents
        # counted when it began: an epoch read whole with no good document ends the stream.
        self._whole_epoch = False
        self._docs_at_epoch = 0

    # -- state (pipeline/stages/stage.py) ------------------------------------------------------------

    def get_state(self, at: SourcePos | OpenPos | None = None) -> dict:
        if not self.interleaved:
            assert not isinstance(at, OpenPos)
            return {POSITION: (at or self.pos).to_json(), REPORTED: list(self.read_mark)}
        if at is None:
            if self._il is None:
                ords, done = (tuple(p[k] for p in self._open0) for k in (0, 1))
                at = OpenPos(self.pos, ords, done)
            else:
                at = OpenPos(self.pos, *self._il.snapshot()[2:])
        assert isinstance(at, OpenPos)
        return {POSITION: at.pos.to_json(), REPORTED: list(self.read_mark), OPEN: at.open}

    def set_state(self, state: dict) -> None:
        assert self._early is None and self._rows is None, "set_state after reading began"
        if self.interleaved and OPEN not in state:
            # Written by the window-only shuffle (pieces in file order): that run goes on
            # exactly as it began, in that order, for the rest of its epochs.
            logging.getLogger("tokenmill").warning(
                "stream %r: the resume state reads pieces in file order (written before "
                "pieces were interleaved); the run continues in that order",
                self.name,
            )
            self.plan.in_file_order()
        elif not self.interleaved and OPEN in state:
            how = "files in order" if not self.cfg.shuffle.files else "shuffle.pieces: 0"
            raise StateError(
                f"stream {self.name!r}: the resume state interleaves pieces (shuffle.pieces > 0)"
                f" but this config reads them one at a time ({how}); resume with the shuffle "
                "settings that wrote the state"
            )
        if self.interleaved:
            self._open0 = open_pieces(state[OPEN], self.name)
        self.start_pos = self.pos = SourcePos.from_json(state[POSITION])
        self.reported = self.read_mark = tuple(state[REPORTED])
        c, cap = self.counters, self.max_tokens
        c.docs, c.tokens, c.skipped = self.pos.docs, self.pos.tokens, self.pos.skipped
        c.epochs_started = min(self.pos.epoch + 1, self.stream.repeat)
        c.capped = cap is not None and c.tokens >= cap
        self.done = self.pos.epoch >= self.stream.repeat or c.capped

    def start(self) -> None:
        """Begin reading now (the Ray executor starts work on construction)."""
        if self._early is None and not self.done:
            c = self.start_pos
            if self.interleaved:
                units = self.plan.plan(c.epoch, self._open0, c.unit)[0]
            else:
                units = self.units(c.epoch)[c.unit :]
            self._early = self.first_executor(units, self.stream, self.cfg.tokenizer)
            self.first_reads = self._early  # kept for its timings (StepFeed.summary)

    def close(self) -> None:
        """Stop every read this stream started (current, early and read-ahead executions)."""
        for blocks in (self._current, self._early, self._chain, self._ahead):
            close = getattr(blocks, "close", None)
            if close is not None:
                close()
        self._current = self._early = self._chain = self._ahead = None

    def _blocks(self, epoch: int, unit: int) -> Iterator[pa.Table]:
        c = self.start_pos
        if self._early is not None and (epoch, unit) == (c.epoch, c.unit):
            blocks, self._early = self._early, None
        elif unit == 0 and (chained := self._chained(epoch)) is not None:
            blocks = chained
        else:
            blocks = self.executor(self.units(epoch)[unit:], self.stream, self.cfg.tokenizer)
        self._read_ahead(epoch)
        self._current = blocks
        return blocks

    def _interleaved_blocks(self, epoch: int, units: list[Unit]) -> Iterator[pa.Table]:
        """The blocks of `units`, the read of `epoch` from where the stream stands."""
        if self._early is not None and epoch == self.start_pos.epoch:
            blocks, self._early = self._early, None
        elif (chained := self._chained(epoch)) is not None:
            blocks = chained
        else:
            blocks = self.executor(units, self.stream, self.cfg.tokenizer)
        self._read_ahead(epoch)
        self._current = blocks
        return blocks

    def _chained(self, epoch: int) -> Iterator[pa.Table] | None:
        """`epoch`'s blocks, whole, from the chain reading it (started ahead), if one is."""
        for chain in (self._chain, self._ahead):
            if chain is not None and chain.covers(epoch):
                if chain is self._ahead:
                    if self._chain is not None:
                        self._chain.close()  # its epochs are all read
                    self._chain, self._ahead = chain, None
                return chain.blocks(epoch)
        return None

    def _read_ahead(self, epoch: int) -> None:
        # Start reading the epochs after the current read now, so the workers do not idle at
        # the boundary while its last blocks are packed (reads are bounded prefetchers). While
        # `epoch` is read, the next chain is under way: one epoch if epochs are large, several
        # in one execution if small (chain.py: a lane's share of a small, repeated stream).
        # Not under max_tokens: the cap may well end the stream within this epoch.
        if self._ahead is not None or self.max_tokens is not None:
            return
        chain = self._chain
        after = chain.last if chain is not None and chain.covers(epoch) else epoch
        if after + 1 >= self.stream.repeat:
            return
        units = self.units(after + 1, keep=False)
        n = epochs_per_chain(sum(u.work for u in units), self.cfg.read.block_bytes,
                             self.stream.repeat - after - 1)  # fmt: skip
        per_epoch = [units] + [self.units(e, keep=False) for e in range(after + 2, after + 1 + n)]
        self._ahead = EpochChain(
            after + 1, per_epoch, lambda us: self.executor(us, self.stream, self.cfg.tokenizer)
        )

    # -- the plan (stages/plan.py) ----------------------------------------------------------

    @property
    def files(self) -> list[str]:
        """The sorted file list that `file_index` refers to (MDS: shards, not indexes)."""
        return self.plan.files

    @property
    def interleaved(self) -> bool:
        return self.plan.interleaved

    @property
    def salt(self) -> str:
        return self.plan.salt

    def pieces(self) -> list[list[Piece]]:
        return self.plan.pieces()

    def piece_lanes(self) -> list[int]:
        return self.plan.piece_lanes()

    def share_bytes(self) -> int:
        return self.plan.share_bytes()

    def units(self, epoch: int, keep: bool = True) -> list[Unit]:
        return self.plan.units(epoch, keep)

    def __iter__(self) -> DocSource:
        return self

    def __next__(self) -> Doc:
        while not self.done:
            if self._rows is None:
                p = self.pos
                self.counters.epochs_started = p.epoch + 1
                self._whole_epoch = (p.unit, p.row) == (0, 0) and not self._open0
                self._docs_at_epoch = self.counters.docs
                if self.interleaved:
                    self._rows = self._interleaved_rows(p.epoch)
                else:
                    self._rows = self._good_rows(p.epoch, p.unit, p.row)
            doc = next(self._rows, None)
            if doc is not None:
                return doc
            self._rows, self._il, self._open0 = None, None, ()
            c = self.counters
            self.done = c.capped or self.pos.epoch + 1 >= self.stream.repeat
            if not self.done and self._whole_epoch and c.docs == self._docs_at_epoch:
                # Every epoch reads the same records (in another order): one with no good
                # document means they all have none. Reading the other `repeat` epochs only
                # rejected the same records again (a chat file given as a pretrain stream with
                # repeat 1000: 5.1M rejects over 169 s before the run could fail).
                logging.getLogger("tokenmill").warning(
                    "stream %r: epoch %d gave no good document, so no epoch will; the stream "
                    "ends there (repeat %d)", self.name, self.pos.epoch, self.stream.repeat,
                )  # fmt: skip
                self.done = True
            self.pos = SourcePos(self.pos.epoch + 1, 0, 0, c.docs, c.tokens, c.skipped)
        raise StopIteration

    def _good_rows(self, epoch: int, unit0: int, row0: int) -> Iterator[Doc]:
        """Good documents in read order from read position (unit0, row0); rejects handled."""
        cap = self.max_tokens
        c = self.counters
        unit, row = unit0, 0
        for block in self._blocks(epoch, unit0):
            self.first_block_at = self.first_block_at or time.monotonic()
            for record_batch in block.to_batches():
                batch = _Batch(record_batch)
                units, ids, offsets, bad = batch.units, batch.ids, batch.offsets, batch.bad
                per_backend = c.backend_tokens
                for i in range(len(ids)):
                    if units[i] != unit:
                        unit, row = int(units[i]), 0
                    here, row = row, row + 1
                    if unit == unit0 and here < row0:
                        continue  # before the resume point
                    mark = (epoch, unit, here)
                    if bad is not None and bad[i]:
                        self._reject(int(ids[i]), batch.errors[i].as_py(),
                                     report=mark > self.reported)  # fmt: skip
                        self.read_mark = max(self.read_mark, mark)
                        self.pos = SourcePos(epoch, unit, row, c.docs, c.tokens, c.skipped)
                        continue
                    self.read_mark = max(self.read_mark, mark)
                    a, b = offsets[i], offsets[i + 1]
                    before = SourcePos(epoch, unit, here, c.docs, c.tokens, c.skipped)
                    c.docs += 1
                    c.tokens += int(b - a)
                    per_backend[batch.backends[i]] += int(b - a)
                    if len(c.lengths) < self.LENGTH_SAMPLE:
                        c.lengths.append(int(b - a))
                    self.pos = SourcePos(epoch, unit, row, c.docs, c.tokens, c.skipped)
                    yield Doc(self.index, int(ids[i]), batch.values[a:b], batch.loss(i), before)
                    if cap is not None and c.tokens >= cap:
                        c.capped = True
                        return

    def _interleaved_rows(self, epoch: int) -> Iterator[Doc]:
        """Good documents of `epoch` from the current position, its open pieces interleaved by
        shuffle.Interleave; rejects handled in that order. Each document's cursor is the
        OpenPos just before its draw."""
        cap, c, p = self.max_tokens, self.counters, self.pos
        order, _ = self.plan.order(epoch)
        shuffle, resumed = self.cfg.shuffle, self._open0
        il = Interleave(shuffle.pieces, self.cfg.seed, self.salt, epoch, len(order), p.unit,
                        p.row, resumed)  # fmt: skip
        self._il = il
        units, ords = self.plan.plan(epoch, resumed, p.unit)
        pieces = self._piece_rows(epoch, self._interleaved_blocks(epoch, units), units, ords)
        # Parts of each piece still to read: 1 for a piece read whole; the first pieces of an
        # epoch's start come in parts (plan.ramp_parts), the first opening the piece.
        parts = Counter(o for unit_ords in ords for o in unit_ords)
        # Rows read, not yet handed on: pieces not yet open (the rest of one unit at most) and
        # parts read ahead (a few units' worth, in the order the draws are expected to need them).
        ready: dict[int, list] = {}
        slots: dict[int, PieceRows] = {}  # the open pieces' rows

        def rows_of(ordinal: int) -> tuple[list, bool]:
            """The rows of `ordinal` read and not handed on (reading on until some are), and
            whether parts of it are still to come."""
            while ordinal not in ready:
                got = next(pieces, None)
                assert got is not None, f"piece {ordinal} of epoch {epoch} was never read"
                ready.setdefault(got[0], []).extend(got[1])
                parts[got[0]] -= 1
            return ready.pop(ordinal), parts[ordinal] > 0

        per_backend = c.backend_tokens
        while True:
            want = il.to_open()
            while want is not None:
                segments, more = rows_of(want)
                while more and not segments:  # an empty first part: the piece opens on a row
                    segments, more = rows_of(want)
                rows = PieceRows(segments)
                drawn = il.opened(want, rows.n, more)
                if drawn is not None:  # rows to draw (a resumed piece: after those drawn)
                    slots[want] = rows.skip(drawn)
                want = il.to_open()
            if il.finished:
                return
            while (need := il.needs()) is not None:  # a piece in parts: its next part
                segments, more = rows_of(need)
                il.extended(need, slots[need].extend(segments), more)
            next_piece, draws, ords_now, done_now = il.snapshot()
            ordinal, row, last = il.draw()
            batch, i = slots[ordinal].take()
            if last:
                del slots[ordinal]
            mark = (epoch, draws, 0)
            self.read_mark = max(self.read_mark, mark)
            if batch.bad is not None and batch.bad[i]:
                self._reject(
                    int(batch.ids[i]), batch.errors[i].as_py(), report=mark > self.reported
                )
                self.pos = SourcePos(epoch, il.next_piece, il.draws, c.docs, c.tokens, c.skipped)
                continue
            before = OpenPos(SourcePos(epoch, next_piece, draws, c.docs, c.tokens, c.skipped),
                             ords_now, done_now)  # fmt: skip
            a, b = batch.offsets[i], batch.offsets[i + 1]
            n = int(b - a)
            c.docs += 1
            c.tokens += n
            per_backend[batch.backends[i]] += n
            if len(c.lengths) < self.LENGTH_SAMPLE:
                c.lengths.append(n)
            self.pos = SourcePos(epoch, il.next_piece, il.draws, c.docs, c.tokens, c.skipped)
            yield Doc(self.index, int(batch.ids[i]), batch.values[a:b], batch.loss(i), before)
            if cap is not None and c.tokens >= cap:
                c.capped = True
                return

    def _piece_rows(self, epoch: int, blocks: Iterator[pa.Table], units: list[Unit],
                    ords: list[list[int]]) -> Iterator[tuple[int, list]]:  # fmt: skip
        """(piece ordinal, its rows as [(batch, first, stop)]) for every piece of `units`, in
        read order; a unit is split once it is whole (a later unit's rows, or the end)."""
        order, ends = self.plan.order(epoch)
        position = {u.index: k for k, u in enumerate(units)}
        at, parts = 0, list[tuple[_Batch, int, int]]()
        for table in blocks:
            self.first_block_at = self.first_block_at or time.monotonic()
            for record_batch in table.to_batches():
                if record_batch.num_rows == 0:
                    continue
                batch = _Batch(record_batch)
                u = batch.units
                cuts = [0, *(np.flatnonzero(u[1:] != u[:-1]) + 1).tolist(), len(u)]
                for a, z in zip(cuts, cuts[1:], strict=False):
                    k = position[int(u[a])]
                    while at < k:
                        yield from by_piece(ords[at], parts, order, ends)
                        at, parts = at + 1, []
                    parts.append((batch, a, z))
        while at < len(units):
            yield from by_piece(ords[at], parts, order, ends)
            at, parts = at + 1, []

    def _reject(self, doc_id: int, reason: str, report: bool = True) -> None:
        file_index, record = doc_id >> 32, doc_id & 0xFFFFFFFF
        path = self.files[file_index] if file_index < len(self.files) else f"<file {file_index}>"
        rec = None if record == WHOLE_FILE else record
        where = f"{path}" + ("" if rec is None else f", record {rec}")
        if self.cfg.on_error == "fail":
            raise BadRecordError(f"stream {self.name!r}: {where}: {reason}")
        self.counters.skipped += 1
        if report and self.on_reject is not None:
            self.on_reject(Reject(self.name, path, rec, reason))


class _Batch:
    """One record batch of a block, as numpy views (no copies): what a document is cut from."""

    __slots__ = ("units", "ids", "offsets", "values", "backends", "errors", "bad", "_loss")

    def __init__(self, batch: pa.RecordBatch):
        self.units = view(batch.column("unit"))
        self.ids = view(batch.column("doc_id"))
        toks = batch.column("tokens")
        self.offsets, self.values = view(toks.offsets), view(toks.values)
        loss = batch.column("loss")
        self._loss = None
        if loss.null_count < len(loss):
            self._loss = (view(loss.offsets), view(loss.values))
        self.backends = view(batch.column("backend"))
        self.errors = batch.column("error")
        self.bad = valid(self.errors) if self.errors.null_count < len(self.errors) else None

    def loss(self, i: int) -> np.ndarray | None:
        if self._loss is None:
            return None
        offsets, values = self._loss
        return values[offsets[i] : offsets[i + 1]]
