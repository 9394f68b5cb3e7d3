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

import numpy as np

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
