"""The stage protocol: every stateful stage of the feed is an iterator with explicit state.

    DocSource (per stream: read, tokenize, reject;     documents.py
               pieces in a seeded order, interleaved)    shuffle.py (Interleave)
      -> WindowShuffle (per stream)                      shuffle.py
        -> Packer (all streams, by name; DeficitMixer)   packing.py, mixing.py
          -> StepFeed (global steps)                     feed.py

A stage implements `__next__` (StopIteration at the end), `get_state()` and `set_state(state)`,
like grain's `DatasetIterator` and torchdata's `BaseNode`:

- `get_state()` is small JSON: positions and counters, never tokens. A stage's state nests its
  inputs' states under their own keys (the packer keys its streams by name), so a stage is
  resumed by handing the state down the chain, each stage taking its part.
- `set_state(state)` comes before the first `__next__`; afterwards the stage yields exactly
  what the stage that wrote the state would have yielded next.
- A stage that buffers (the open pieces, the shuffle window, the packers) does not save its
  buffer. It saves where its input stood when the oldest buffered item came (the DocSource:
  which pieces are open and how far each was drawn), and rebuilds the buffer on resume by
  replaying its input from there (grain's packer does the same). For that, every item a
  stage emits carries `cursor`: where that stage stood just before the item, and
  `get_state(at=cursor)` is the state that resumes at that item.
- State keys are module constants, so a reader of a state knows where each key is written.

`tests/conformance.py` checks every stage alone against this contract: resuming from the
state after any prefix yields exactly the rest of an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np


class StateError(ValueError):
    """A resume state that is malformed, corrupted, or does not fit this config or its data:
    raised by the state's checks (pipeline/state/resume.py) and by a stage whose `set_state`
    or replay finds the state disagree with what it reads."""


T_co = TypeVar("T_co", covariant=True)


@dataclass(slots=True)
class Doc:
    """A tokenized document. `tokens` (and `loss`) are views into an Arrow block: no copies."""

    stream: int
    doc_id: int
    tokens: np.ndarray
    loss: np.ndarray | None = None
    # Where the last stage that emitted this doc stood just before it (see above).
    cursor: Any = None
    arrival: int = -1  # set by the bfd packer: the arrival number of this doc's first piece

    def __len__(self) -> int:
        return len(self.tokens)


class Stage(Protocol[T_co]):
    def __iter__(self) -> Stage[T_co]: ...

    def __next__(self) -> T_co: ...

    def get_state(self, at: Any = None) -> dict:
        """The state after the last item emitted (or, with `at`, just before the item whose
        `cursor` that was)."""
        ...

    def set_state(self, state: dict) -> None:
        """Resume from `state`, before the first `__next__`."""
        ...
