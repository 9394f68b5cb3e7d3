"""One stream's tokenized documents, in their deterministic, shuffled order, across epochs.

Per epoch: the stream's files are put in a seeded order, cut into pieces, grouped into units,
read and tokenized by an executor (Ray Data, or in-process for `check` and tests), then
shuffled within windows of documents. Bad records are handled here, in stream order, so the
error raised (`on_error: fail`) or the rejects written (`skip`) are the same on every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa

from pipeline.config import Config
from pipeline.reading import Executor, Unit, group_units
from pipeline.shuffle import file_order, window_permutation
from pipeline.sources import WHOLE_FILE, Piece, list_mds_shards, plan_pieces


class BadRecordError(ValueError):
    """A bad record under `on_error: fail`; the message names stream, file and record."""


@dataclass(slots=True)
class Doc:
    """A tokenized document. `tokens` (and `loss`) are views into an Arrow block: no copies."""

    stream: int
    doc_id: int
    tokens: np.ndarray
    loss: np.ndarray | None = None
    cursor: Cursor | None = None  # where the stream stood just before yielding this doc
    arrival: int = -1  # set by the bfd packer: the arrival number of this doc's first piece

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Cursor:
    """A position in a stream's shuffled document sequence, enough to resume there exactly.

    Documents are shuffled within windows of `shuffle.window` good documents in read order.
    (`unit`, `row`) is the read position of the window's first row; the counters are the
    stream's as of that position; `offset` is how many documents of the window were yielded.
    Resuming re-reads one window from (`unit`, `row`), never the prefix of the epoch.
    """

    epoch: int = 0
    window: int = 0
    unit: int = 0
    row: int = 0
    docs: int = 0
    tokens: int = 0
    skipped: int = 0
    offset: int = 0

    def to_json(self) -> list[int]:
        return [
            self.epoch,
            self.window,
            self.unit,
            self.row,
            self.docs,
            self.tokens,
            self.skipped,
            self.offset,
        ]

    @staticmethod
    def from_json(v: list[int]) -> Cursor:
        return Cursor(*(int(x) for x in v))


@dataclass
class StreamCounters:
    docs: int = 0
    tokens: int = 0
    skipped: int = 0
    epochs_started: int = 0
    capped: bool = False
    # tokens read per tokenizer backend (tokenization.BACKEND_NAMES); this run only, not state
    backend_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
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


FIRST_WINDOW = 8


def window_size(window: int, k: int) -> int:
    """Window k of an epoch holds min(window, 8 * 2^k) documents.

    The ramp lets the first documents of an epoch out after 8 are read instead of `window`
    (the first batch comes sooner); from the fifth or so window on, windows are full size.
    """
    return min(window, FIRST_WINDOW << min(k, 40))


class StreamDocs:
    """Iterate one stream's documents: `repeat` epochs, stopping early at `max_tokens`."""

    LENGTH_SAMPLE = 100_000  # doc lengths kept for the length distribution

    def __init__(
        self,
        name: str,
        index: int,
        cfg: Config,
        executor: Executor,
        on_reject: Callable[[Reject], None] | None = None,
        start: Cursor | None = None,
        reported: tuple[int, int, int] | None = None,
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
        self.start_cursor = start or Cursor()
        self.next_cursor = self.start_cursor
        c = self.counters
        c.docs, c.tokens, c.skipped = (
            self.start_cursor.docs,
            self.start_cursor.tokens,
            self.start_cursor.skipped,
        )
        c.epochs_started = min(self.start_cursor.epoch + (start is not None), self.stream.repeat)
        # Rejects at read positions before this mark were reported before a resume.
        self.reported = reported or (-1, -1, -1)
        self.read_mark = self.reported
        self.first_block_at: float | None = None  # time.monotonic() of the first block in
        self.first_reads = None

    def start(self) -> None:
        """Begin reading now (the Ray executor starts work on construction)."""
        if self._early is None:
            c = self.start_cursor
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
        c = self.start_cursor
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
            if self.stream.format == "mds":
                self._files = [path for path, _ in list_mds_shards(self.stream.paths)]
            else:
                self._files = list(self.stream.paths)
        return self._files

    def pieces(self) -> list[list[Piece]]:
        if self._pieces is None:
            read = self.cfg.read
            self._pieces = plan_pieces(
                self.stream.paths, self.stream.format, read.piece_bytes, read.max_record_bytes
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

    def __iter__(self) -> Iterator[Doc]:
        c, W = self.counters, self.cfg.shuffle.window
        cur = self.start_cursor
        for epoch in range(cur.epoch, self.stream.repeat):
            c.epochs_started = epoch + 1
            fresh = epoch != cur.epoch
            k = 0 if fresh else cur.window
            self._pos = (0, 0) if fresh else (cur.unit, cur.row)
            skip = 0 if fresh else cur.offset
            rows = self._good_rows(epoch, *self._pos)
            while True:
                at = Cursor(epoch, k, *self._pos, c.docs, c.tokens, c.skipped, 0)
                window = [doc for _, doc in zip(range(window_size(W, k)), rows, strict=False)]
                if not window:
                    break
                order = (
                    window_permutation(len(window), self.cfg.seed, self.name, epoch, k)
                    if W > 1
                    else range(1)
                )
                for j in range(skip, len(window)):
                    doc = window[order[j]]
                    doc.cursor = replace(at, offset=j)
                    self.next_cursor = replace(at, offset=j + 1)
                    yield doc
                skip, k = 0, k + 1
                if c.capped:
                    return
            self.next_cursor = Cursor(epoch + 1, docs=c.docs, tokens=c.tokens, skipped=c.skipped)
            if c.capped:
                return

    def _good_rows(self, epoch: int, unit0: int, row0: int) -> Iterator[Doc]:
        """Good documents in read order from read position (unit0, row0); rejects handled."""
        cap = self.stream.max_tokens
        c = self.counters
        unit, row = unit0, 0
        for block in self._blocks(epoch, unit0):
            self.first_block_at = self.first_block_at or time.monotonic()
            for batch in block.to_batches():
                units = batch.column("unit").to_numpy()
                ids = batch.column("doc_id").to_numpy()
                toks = batch.column("tokens")
                offsets = toks.offsets.to_numpy()
                values = toks.values.to_numpy()
                loss_col = batch.column("loss")
                has_loss = loss_col.null_count < len(loss_col)
                loss_values = loss_col.values.to_numpy() if has_loss else None
                loss_offsets = loss_col.offsets.to_numpy() if has_loss else None
                backends = batch.column("backend").to_numpy()
                per_backend = c.backend_tokens
                errors = batch.column("error")
                bad = (
                    errors.is_valid().to_numpy(zero_copy_only=False)
                    if errors.null_count < len(errors)
                    else None
                )
                for i in range(len(ids)):
                    if units[i] != unit:
                        unit, row = int(units[i]), 0
                    here, row = row, row + 1
                    if unit == unit0 and here < row0:
                        continue  # before the resume point
                    self._pos = (unit, row)
                    mark = (epoch, unit, here)
                    if bad is not None and bad[i]:
                        self._reject(int(ids[i]), errors[i].as_py(), report=mark > self.reported)
                        self.read_mark = max(self.read_mark, mark)
                        continue
                    self.read_mark = max(self.read_mark, mark)
                    a, b = offsets[i], offsets[i + 1]
                    loss = loss_values[loss_offsets[i] : loss_offsets[i + 1]] if has_loss else None
                    c.docs += 1
                    c.tokens += int(b - a)
                    per_backend[backends[i]] += int(b - a)
                    if len(c.lengths) < self.LENGTH_SAMPLE:
                        c.lengths.append(int(b - a))
                    yield Doc(self.index, int(ids[i]), values[a:b], loss)
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
