"""One stream's tokenized documents, in their deterministic read order, across epochs.

Per epoch: the stream's files are put in a seeded order, cut into pieces, grouped into units,
and read and tokenized by an executor (Ray Data, or in-process for `check` and tests). The
windowed document shuffle comes next, in its own stage (shuffle.WindowShuffle). Bad records are handled here, in stream order, so the
error raised (`on_error: fail`) or the rejects written (`skip`) are the same on every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.arrays import valid, view
from pipeline.config import Config
from pipeline.reading import Executor, Unit, group_units
from pipeline.shuffle import file_order
from pipeline.sources import WHOLE_FILE, Access, Piece, data_files, plan_pieces
from pipeline.tokenization import BACKEND_NAMES


class BadRecordError(ValueError):
    """A bad record under `on_error: fail`; the message names stream, file and record."""


@dataclass(slots=True)
class Doc:
    """A tokenized document. `tokens` (and `loss`) are views into an Arrow block: no copies."""

    stream: int
    doc_id: int
    tokens: np.ndarray
    loss: np.ndarray | None = None
    # Where the last stage that emitted this doc stood just before it (pipeline/stage.py).
    cursor: Any = None
    arrival: int = -1  # set by the bfd packer: the arrival number of this doc's first piece

    def __len__(self) -> int:
        return len(self.tokens)


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


# DocSource state keys
POSITION = "position"  # SourcePos.to_json()
REPORTED = "reported"  # (epoch, unit, row) of the last record read: rejects up to it were reported


@dataclass
class StreamCounters:
    docs: int = 0
    tokens: int = 0
    skipped: int = 0
    epochs_started: int = 0
    capped: bool = False
    # tokens read per tokenizer backend (tokenization.BACKEND_NAMES); this run only, not state
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


class DocSource:
    """One stream's good documents in read order: `repeat` epochs, stopping early at
    `max_tokens`. A stage (pipeline/stage.py): each doc's `cursor` is the SourcePos before it.

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
    ):
        self.name, self.index, self.cfg = name, index, cfg
        self.stream = cfg.streams[name]
        self.executor = executor
        self.first_executor = first_executor or executor  # the read `start()` begins
        self.on_reject = on_reject
        self.counters = StreamCounters()
        self._pieces: list[list[Piece]] | None = None
        self._files: list[str] | None = None
        self._early: Iterator[pa.Table] | None = None
        self._next_epoch: tuple[int, Iterator[pa.Table]] | None = None
        self._current: Iterator[pa.Table] | None = None
        self._rows: Iterator[Doc] | None = None  # the current epoch's good documents
        self.start_pos = self.pos = SourcePos()
        self.done = False
        # Rejects at read positions up to this mark were reported (also before a resume).
        self.reported: tuple[int, ...] = (-1, -1, -1)
        self.read_mark = self.reported
        self.first_block_at: float | None = None  # time.monotonic() of the first block in
        self.first_reads: Iterator[pa.Table] | None = None

    # -- state (pipeline/stage.py) ------------------------------------------------------------

    def get_state(self, at: SourcePos | None = None) -> dict:
        return {POSITION: (at or self.pos).to_json(), REPORTED: list(self.read_mark)}

    def set_state(self, state: dict) -> None:
        assert self._early is None and self._rows is None, "set_state after reading began"
        self.start_pos = self.pos = SourcePos.from_json(state[POSITION])
        self.reported = self.read_mark = tuple(state[REPORTED])
        c, cap = self.counters, self.stream.max_tokens
        c.docs, c.tokens, c.skipped = self.pos.docs, self.pos.tokens, self.pos.skipped
        c.epochs_started = min(self.pos.epoch + 1, self.stream.repeat)
        c.capped = cap is not None and c.tokens >= cap
        self.done = self.pos.epoch >= self.stream.repeat or c.capped

    def start(self) -> None:
        """Begin reading now (the Ray executor starts work on construction)."""
        if self._early is None and not self.done:
            c = self.start_pos
            self._early = self.first_executor(
                self.units(c.epoch)[c.unit :], self.stream, self.cfg.tokenizer
            )
            self.first_reads = self._early  # kept for its timings (Feed.summary)

    def close(self) -> None:
        """Stop every read this stream started (current, early and read-ahead executions)."""
        for blocks in (self._current, self._early, self._next_epoch and self._next_epoch[1]):
            close = getattr(blocks, "close", None)
            if close is not None:
                close()
        self._current = self._early = self._next_epoch = None

    def _blocks(self, epoch: int, unit: int) -> Iterator[pa.Table]:
        c = self.start_pos
        if self._early is not None and (epoch, unit) == (c.epoch, c.unit):
            blocks, self._early = self._early, None
        elif self._next_epoch is not None and self._next_epoch[0] == epoch and unit == 0:
            blocks, self._next_epoch = self._next_epoch[1], None
        else:
            blocks = self.executor(self.units(epoch)[unit:], self.stream, self.cfg.tokenizer)
        # Start reading the next epoch now, so the workers do not idle at the epoch boundary
        # while this epoch's last blocks are packed (both executions are bounded prefetchers).
        # Not under max_tokens: the cap may well end the stream within this epoch.
        ahead = epoch + 1 < self.stream.repeat and self.stream.max_tokens is None
        if ahead and self._next_epoch is None:
            self._next_epoch = (
                epoch + 1,
                self.executor(self.units(epoch + 1), self.stream, self.cfg.tokenizer),
            )
        self._current = blocks
        return blocks

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
            read = self.cfg.read
            assert self.stream.format is not None  # load_config resolves every stream's format
            self._pieces = plan_pieces(
                self.stream.paths,
                self.stream.format,
                read.piece_bytes,
                read.max_record_bytes,
                Access.of(self.stream),
            )
        return self._pieces

    def units(self, epoch: int) -> list[Unit]:
        per_file = self.pieces()
        order = file_order(len(per_file), self.cfg.seed, self.name, epoch, self.cfg.shuffle.files)
        flat = [p for i in order for p in per_file[i]]
        # Only the first epoch ramps up from small units (for the first batch); later epochs
        # are read ahead (see `_blocks`), so their units are full size from the start.
        read = self.cfg.read
        return group_units(
            flat, read.block_bytes, read.first_block_bytes if epoch == 0 else read.block_bytes
        )

    def __iter__(self) -> DocSource:
        return self

    def __next__(self) -> Doc:
        while not self.done:
            if self._rows is None:
                p = self.pos
                self.counters.epochs_started = p.epoch + 1
                self._rows = self._good_rows(p.epoch, p.unit, p.row)
            doc = next(self._rows, None)
            if doc is not None:
                return doc
            self._rows = None
            c = self.counters
            self.done = c.capped or self.pos.epoch + 1 >= self.stream.repeat
            self.pos = SourcePos(self.pos.epoch + 1, 0, 0, c.docs, c.tokens, c.skipped)
        raise StopIteration

    def _good_rows(self, epoch: int, unit0: int, row0: int) -> Iterator[Doc]:
        """Good documents in read order from read position (unit0, row0); rejects handled."""
        cap = self.stream.max_tokens
        c = self.counters
        unit, row = unit0, 0
        for block in self._blocks(epoch, unit0):
            self.first_block_at = self.first_block_at or time.monotonic()
            for batch in block.to_batches():
                units = view(batch.column("unit"))
                ids = view(batch.column("doc_id"))
                toks = batch.column("tokens")
                offsets = view(toks.offsets)
                values = view(toks.values)
                loss_col = batch.column("loss")
                has_loss = loss_col.null_count < len(loss_col)
                loss_values = view(loss_col.values) if has_loss else None
                loss_offsets = view(loss_col.offsets) if has_loss else None
                backends = view(batch.column("backend"))
                per_backend = c.backend_tokens
                errors = batch.column("error")
                bad = valid(errors) if errors.null_count < len(errors) else None
                for i in range(len(ids)):
                    if units[i] != unit:
                        unit, row = int(units[i]), 0
                    here, row = row, row + 1
                    if unit == unit0 and here < row0:
                        continue  # before the resume point
                    mark = (epoch, unit, here)
                    if bad is not None and bad[i]:
                        self._reject(int(ids[i]), errors[i].as_py(), report=mark > self.reported)
                        self.read_mark = max(self.read_mark, mark)
                        self.pos = SourcePos(epoch, unit, row, c.docs, c.tokens, c.skipped)
                        continue
                    self.read_mark = max(self.read_mark, mark)
                    a, b = offsets[i], offsets[i + 1]
                    loss = (
                        loss_values[loss_offsets[i] : loss_offsets[i + 1]]
                        if loss_values is not None and loss_offsets is not None  # has_loss
                        else None
                    )
                    before = SourcePos(epoch, unit, here, c.docs, c.tokens, c.skipped)
                    c.docs += 1
                    c.tokens += int(b - a)
                    per_backend[backends[i]] += int(b - a)
                    if len(c.lengths) < self.LENGTH_SAMPLE:
                        c.lengths.append(int(b - a))
                    self.pos = SourcePos(epoch, unit, row, c.docs, c.tokens, c.skipped)
                    yield Doc(self.index, int(ids[i]), values[a:b], loss, before)
                    if cap is not None and c.tokens >= cap:
                        c.capped = True
                        return

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
