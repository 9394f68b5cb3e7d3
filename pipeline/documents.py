"""One stream's tokenized documents, in their deterministic, shuffled order, across epochs.

Per epoch: the stream's files are put in a seeded order, cut into pieces, grouped into units,
read and tokenized by an executor (Ray Data, or in-process for `check` and tests), then
shuffled within windows of documents. Bad records are handled here, in stream order, so the
error raised (`on_error: fail`) or the rejects written (`skip`) are the same on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.config import Config, StreamConfig
from pipeline.reading import Unit, group_units
from pipeline.shuffle import file_order, windowed_shuffle
from pipeline.sources import WHOLE_FILE, Piece, list_mds_shards, plan_pieces

Executor = Callable[[list[Unit], StreamConfig, object], Iterator[pa.Table]]


class BadRecordError(ValueError):
    """A bad record under `on_error: fail`; the message names stream, file and record."""


@dataclass(slots=True)
class Doc:
    """A tokenized document. `tokens` (and `loss`) are views into an Arrow block: no copies."""

    stream: int
    doc_id: int
    tokens: np.ndarray
    loss: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class StreamCounters:
    docs: int = 0
    tokens: int = 0
    skipped: int = 0
    epochs_started: int = 0
    capped: bool = False
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
    ):
        self.name, self.index, self.cfg = name, index, cfg
        self.stream = cfg.streams[name]
        self.executor = executor
        self.on_reject = on_reject
        self.counters = StreamCounters()
        self._pieces: list[list[Piece]] | None = None
        self._files: list[str] | None = None
        self._early: Iterator[pa.Table] | None = None

    def start(self) -> None:
        """Begin reading epoch 0 now (the Ray executor starts work on construction)."""
        if self._early is None:
            self._early = self.executor(self.units(0), self.stream, self.cfg.tokenizer)

    def _blocks(self, epoch: int) -> Iterator[pa.Table]:
        if epoch == 0 and self._early is not None:
            blocks, self._early = self._early, None
            return blocks
        return self.executor(self.units(epoch), self.stream, self.cfg.tokenizer)

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
            self._pieces = plan_pieces(
                self.stream.paths, self.stream.format, self.cfg.read.piece_bytes
            )
        return self._pieces

    def units(self, epoch: int) -> list[Unit]:
        per_file = self.pieces()
        order = file_order(len(per_file), self.cfg.seed, self.name, epoch, self.cfg.shuffle.files)
        flat = [p for i in order for p in per_file[i]]
        return group_units(flat, self.cfg.read.block_bytes, self.cfg.read.first_block_bytes)

    def __iter__(self) -> Iterator[Doc]:
        for epoch in range(self.stream.repeat):
            self.counters.epochs_started += 1
            docs = self._epoch_docs(epoch)
            yield from windowed_shuffle(
                docs, self.cfg.shuffle.window, self.cfg.seed, self.name, epoch
            )
            if self.counters.capped:
                return

    def _epoch_docs(self, epoch: int) -> Iterator[Doc]:
        cap = self.stream.max_tokens
        c = self.counters
        for block in self._blocks(epoch):
            for batch in block.to_batches():
                ids = batch.column("doc_id").to_numpy()
                toks = batch.column("tokens")
                offsets = toks.offsets.to_numpy()
                values = toks.values.to_numpy()
                loss_col = batch.column("loss")
                has_loss = loss_col.null_count < len(loss_col)
                loss_values = loss_col.values.to_numpy() if has_loss else None
                loss_offsets = loss_col.offsets.to_numpy() if has_loss else None
                errors = batch.column("error")
                bad = (
                    errors.is_valid().to_numpy(zero_copy_only=False)
                    if errors.null_count < len(errors)
                    else None
                )
                for i in range(len(ids)):
                    if bad is not None and bad[i]:
                        self._reject(int(ids[i]), errors[i].as_py())
                        continue
                    a, b = offsets[i], offsets[i + 1]
                    loss = loss_values[loss_offsets[i] : loss_offsets[i + 1]] if has_loss else None
                    c.docs += 1
                    c.tokens += int(b - a)
                    if len(c.lengths) < self.LENGTH_SAMPLE:
                        c.lengths.append(int(b - a))
                    yield Doc(self.index, int(ids[i]), values[a:b], loss)
                    if cap is not None and c.tokens >= cap:
                        c.capped = True
                        return

    def _reject(self, doc_id: int, reason: str) -> None:
        file_index, record = doc_id >> 32, doc_id & 0xFFFFFFFF
        path = self.files[file_index] if file_index < len(self.files) else f"<file {file_index}>"
        rec = None if record == WHOLE_FILE else record
        where = f"{path}" + ("" if rec is None else f", record {rec}")
        if self.cfg.on_error == "fail":
            raise BadRecordError(f"stream {self.name!r}: {where}: {reason}")
        self.counters.skipped += 1
        if self.on_reject is not None:
            self.on_reject(Reject(self.name, path, rec, reason))
