"""Seeded shuffles: file order per epoch, and documents within consecutive windows.

Every generator is derived from (seed, stream name, epoch, counter), never from global state,
so a run is a pure function of its config (STYLE §3).

The document shuffle permutes each run of `window` consecutive documents. A sliding shuffle
buffer mixes a little further, but its state is the buffer itself; a fixed window is resumed
from "window k, position j" by re-reading one window, which is what makes exact, cheap resume
possible (the trade-off grain makes for its windowed shuffle too).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline.documents import Doc
    from pipeline.stage import Stage

FILE_ORDER, DOC_WINDOW = 1, 2  # stream-of-randomness tags


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
    """The order in which a stream's files are read in `epoch`."""
    if not enabled:
        return np.arange(n_files)
    return rng_for(seed, stream, epoch, FILE_ORDER).permutation(n_files)


def window_permutation(size: int, seed: int, stream: str, epoch: int, window: int) -> np.ndarray:
    return rng_for(seed, stream, epoch, DOC_WINDOW, window).permutation(size)


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
