"""Epochs read in one execution: a small stream's repeats, chained.

A stream is read an epoch at a time, each epoch one execution of the executor, and the next
epoch's execution starts when this one's first block is taken. With Ray Data (a feed of one
lane, and lanes with `read.in_lanes: false`), an execution has a fixed cost: planning, a
task's start and its first block back, ~80 ms on an idle 2-core VM and more under load. A
small stream read with `repeat`, or a lane's share of one (1/K of its pieces: the demo's
11 MiB of code over 16 lanes is ~0.7 MiB, one read task and ~200k tokens per epoch), then
pays that cost every few hundred thousand tokens, and one epoch in flight ahead does not
hide it: lane 0 of 16 read 3.4M tokens/s that way on 2 cores, 5.2M chained.

An `EpochChain` is one execution over several whole epochs' units, at least one read
block's work (a stream whose epoch is as large is read one epoch per execution),
and hands out each epoch's blocks in turn. The units, their order and their blocks' rows are
those of one execution per epoch, so the documents and every batch are too: only how many
executions carry them changes.

Each unit's rows are labelled with its index in its epoch (`unit`); in a chain, the label is
`slot * STRIDE + index` (slot: the epoch's place in the chain), so a block is assigned to its
epoch by its labels, never by counting blocks (a unit may give several blocks, or none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pyarrow as pa

from pipeline.read.reading import Unit
from wire.arrays import numeric, view

STRIDE = 1 << 20  # labels per epoch in a chain: an epoch has fewer units than this
MAX_EPOCHS = 64  # epochs in one chain, at most (unit labels are int32: 64 x 2^20 < 2^31)
# Work (Unit.work, ~bytes) one chain reads at least: one full read block (8 MiB by default).
# A stream whose epoch is that large has one epoch per chain, as it always had. Two blocks
# chained the demo's code (11 MiB) two epochs at a time with one lane, and one lane's reading
# of it fell from ~11.7M to ~9.8M tokens/s on 2 cores (one execution holds half the blocks
# ahead that two do); with one, it is unchanged, and 8 or 16 lanes gain as much.
CHAIN_BLOCKS = 1


def epochs_per_chain(epoch_work: int, block_bytes: int, epochs_left: int) -> int:
    """How many epochs the next chain reads: enough for `CHAIN_BLOCKS` blocks of work."""
    want = CHAIN_BLOCKS * block_bytes
    n = -(-want // max(1, epoch_work))
    return max(1, min(n, MAX_EPOCHS, epochs_left))


class EpochChain:
    """One read of epochs [first, first + len(units)), whole, in order; `blocks(epoch)` hands
    out each epoch's blocks once, epochs in order, with their units labelled as in the epoch.
    """

    def __init__(self, first: int, units: list[list[Unit]],
                 start: Callable[[list[Unit]], Iterator[pa.Table]]):  # fmt: skip
        assert 0 < len(units) <= MAX_EPOCHS
        assert all(len(us) < STRIDE for us in units)
        self.first, self.last = first, first + len(units) - 1
        labelled = [replace(u, index=slot * STRIDE + u.index)
                    for slot, us in enumerate(units) for u in us]  # fmt: skip
        self._blocks = start(labelled)
        self._slot = 0  # the epoch handed out next
        self._held: pa.Table | None = None  # rows of a later epoch, read while ending one

    def covers(self, epoch: int) -> bool:
        return self.first <= epoch <= self.last

    def blocks(self, epoch: int) -> Iterator[pa.Table]:
        slot = epoch - self.first
        assert slot == self._slot, f"epoch {epoch} asked of a chain at {self.first + self._slot}"
        self._slot += 1
        return self._epoch(slot)

    def _epoch(self, slot: int) -> Iterator[pa.Table]:
        while True:
            block, self._held = self._held, None
            if block is None:
                block = next(self._blocks, None)
                if block is None:
                    return
            if block.num_rows == 0:
                continue
            col = block.schema.get_field_index("unit")
            labels = view(block.column(col))  # not to_numpy(): its first call imports pandas
            slots = labels // STRIDE  # non-decreasing: units come in order
            # Rows of an earlier epoch (one left unfinished) are dropped; a later one's kept.
            lo, hi = (int(x) for x in np.searchsorted(slots, [slot, slot + 1]))
            if lo == hi:
                if hi < len(slots):
                    self._held = block.slice(hi)
                    return
                continue
            mine = block if (lo, hi) == (0, len(slots)) else block.slice(lo, hi - lo)
            if slot:
                unit = (labels[lo:hi] - slot * STRIDE).astype(np.int32)
                mine = mine.set_column(col, "unit", numeric(unit))
            if hi < len(slots):
                self._held = block.slice(hi)
            yield mine
            if hi < len(slots):
                return

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()
