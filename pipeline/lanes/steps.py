"""What a lane answers and the control keeps of a step: receipts (what a step counts, not its
rows), a chunk's answer (`LaneMade`), a held step (`LanedStep`) and where a rank takes its
rows of it (`where`), and the step files a lane writes itself in an export (`Writes`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from wire.arrays import from_ipc, view
from wire.lane_rows import TAKE_GROUP, join_parts, lane_parts
from wire.layout import step_path

PENDING = ".lane"  # a step file a lane wrote, until the export takes its step


class LaneError(RuntimeError):
    """A lane failed (its process died, or its feed raised); the message names the lane."""


def served_counts(batch: pa.RecordBatch, names: list[str]) -> Receipt:
    """What a step (or a lane's part of it) serves: rows, real tokens, and per stream (in
    `names` order) its tokens and the documents it starts."""
    seg_lens = view(batch.column("seq_lens").values).astype(np.int64)
    stream = batch.column("stream").values
    idx = np.array([names.index(n) for n in stream.dictionary.to_pylist()], dtype=np.int64)
    idx = idx[view(stream.indices)]
    starts = view(batch.column("doc_offset").values) == 0
    tokens = np.bincount(idx, weights=seg_lens, minlength=len(names)).astype(np.int64)
    docs = np.bincount(idx[starts], minlength=len(names))
    return Receipt(batch.num_rows, int(seg_lens.sum()), tokens.tolist(), docs.tolist())


@dataclass(frozen=True)
class Receipt:
    """A step a lane made and holds (`LaneWorker(hold=True)`): what it counts, not its rows."""

    rows: int
    real_tokens: int
    tokens: list[int]  # per stream, in the config's order
    docs: list[int]  # documents started, per stream
    written: tuple[int, ...] = ()  # ranks whose step files the lane wrote aside (`writes`)
    labels: bool = False  # those files keep a labels column
    held: int = 0  # steps the lane held once it had made this one (metrics `lanes`)
    # The lane's time in making steps so far, once it had made this one: wall and its making
    # thread's CPU seconds (metrics `lanes`: a lane whose CPU nears its wall is out of core).
    making_s: float = 0.0
    making_cpu_s: float = 0.0


@dataclass(frozen=True)
class Writes:
    """Step files a lane writes itself (an export with lanes): for world size `world`, in
    `fmt` (parquet, arrow) and `layout`, into `out`, each aside (`pending`) until the export
    takes the step. A lane writes the files of the ranks whose rows lie in its part of a full
    step; the export writes the others (a rank spanning lanes, the short last step)."""

    out: str
    world: int
    fmt: str
    full: bool  # the full layout, else compact (keeping labels when `keep_labels`)
    keep_labels: bool

    def pending(self, step: int, rank: int) -> Path:
        return Path(str(step_path(Path(self.out), step, rank, self.fmt)) + PENDING)


@dataclass(frozen=True)
class LaneMade:
    """What a holding lane answers for the steps of one call (`LaneWorker.steps`): their
    counts, one array per figure for all of them (a Receipt per step and lane cost the control
    an object to unpickle and a sum each), their kept states, and what it wrote aside."""

    first: int  # the first step's number
    rows: np.ndarray  # per step
    real_tokens: np.ndarray  # per step
    tokens: np.ndarray  # per step and stream (n x S)
    docs: np.ndarray  # documents started, per step and stream (n x S)
    states: list  # per step: its state kept, or None
    written: tuple[tuple[int, ...], ...] = ()  # per step (`writes`): the ranks written aside
    labels: tuple[bool, ...] = ()  # per step (`writes`): those files keep labels
    # Receipt's figures for metrics `lanes`, once the lane had made these steps.
    held: int = 0
    making_s: float = 0.0
    making_cpu_s: float = 0.0
    # The lane's process's CPU seconds (all its threads: the tokenizer's pool, the ranks'
    # takes) while it made steps so far: with `making_s`, whether the lane had a core.
    making_process_s: float = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def receipt(self, j: int) -> Receipt:
        """Step j's receipt."""
        return Receipt(int(self.rows[j]), int(self.real_tokens[j]), self.tokens[j].tolist(),
                       self.docs[j].tolist(), self.written[j] if self.written else (),
                       bool(self.labels[j]) if self.labels else False, self.held,
                       self.making_s, self.making_cpu_s)  # fmt: skip


@dataclass(frozen=True)
class LanedStep:
    """A global step whose rows the lanes hold (the batch server's window holds this, not the
    rows): its number, the lane actors, and how many rows each made. Ranks take their rows
    from the lanes (wire/lane_rows.py `fetch`); `joined` joins them all (provenance, skips)."""

    step: int
    lanes: list  # the feed's `handles`: a restarted lane's actor replaces its entry
    rows: tuple[int, ...]
    made: tuple[LaneMade, ...] = ()  # the lanes' answers that hold this step, in lane order
    index: int = 0  # this step's place in each of them
    key: str = ""  # names the feed's lane actors (`LanedFeed.key`): a reply names it, not them

    @property
    def receipts(self) -> tuple[Receipt, ...]:
        """The lanes' receipts of this step, in lane order."""
        return tuple(m.receipt(self.index) for m in self.made)

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    def joined(self, timeout_s: float = 120.0) -> pa.RecordBatch:
        """The whole step, joined from its lanes' parts (this process touches every row)."""
        import ray

        calls = [h.part.options(concurrency_group=TAKE_GROUP).remote(self.step) for h in self.lanes]
        return join_parts([from_ipc(ray.get(c, timeout=timeout_s)) for c in calls])


def where(steps: list[LanedStep], rank: int, world_size: int, global_batch_size: int
          ) -> list[tuple[str, int, list[tuple[int, int, int]]]]:  # fmt: skip
    """Where rank `rank` of `world_size` takes its rows of consecutive held `steps`: per lane,
    (its feed's key, the lane, [(step, first row, end row), ...]), lanes in order
    (protocol.StepReply `lanes`). Steps a skip's replaced lanes hold come before the new
    lanes' (they are earlier steps).

    The reply names the lanes by key and the rank looks their actors up once
    (`BatchServer.lane_handles`): sending the actors in every reply cost the control actor a
    sixth of the time it held the GIL (16 lanes, 16 ranks; py-spy --gil), as Ray pickles an
    actor handle anew each time (and the rank unpickles it)."""
    groups: dict[str, int] = {}  # a feed's key -> its order of appearance
    out: dict[tuple[int, int], tuple[str, int, list]] = {}
    for s in steps:
        group = groups.setdefault(s.key, len(groups))
        for k, lo, hi in lane_parts(list(s.rows), rank, world_size, global_batch_size):
            out.setdefault((group, k), (s.key, k, []))[2].append((s.step, lo, hi))
    return [out[key] for key in sorted(out)]  # a step's pieces in lane order
