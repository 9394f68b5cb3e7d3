"""Lanes: K independent feeds that each make G/K rows of every global step.

    every stream's pieces ──lane_shares──▶ lane 0: read, shuffle, mix, pack ─▶ rows [0, G/K)
                                          lane 1: …                         ─▶ rows [G/K, 2G/K)
                                          …
    global step s = lane 0's step s ‖ lane 1's step s ‖ … (rows in lane order)

A lane is a `Feed` (pipeline/feed.py) over its share of every stream: a balanced partition of
the stream's pieces by bytes (stages/documents.py `lane_shares`), its own seeded orders, the
same weights, its own token-exact mixer and packer. Each lane runs in a process of its own (a
Ray actor, placed with `service.resources`; in-process lanes for `--local`), so mixing and
packing scale with lanes as tokenizing scales with workers: no process handles every token
but the one that writes them (an export) or serves them.

- The sequence is a pure function of (config, seed, lanes), never of the world size: rank r
  of W takes rows [r·G/W, (r+1)·G/W) of each global step, whichever lanes made them. One lane
  is the sequence a config always had (its hash leaves `lanes: 1` out); changing the number of
  lanes is a new sequence, as Mosaic's `num_canonical_nodes` is.
- Mixing stays exact: every lane mixes by tokens with the same weights, within one segment
  of its targets at every step, so every global prefix that ends at a step is within K
  segments (K rows' tokens) of each stream's target share.
- A weight change takes effect at one global step in every lane: the first step no lane has
  begun (`set_weights`), recorded in each lane's mixture history.
- End of data: the sequence ends at the first step that some lane cannot make whole; with
  `drop_last` it ends before that step, else that step is the last, each lane's rows of it
  in lane order (the one step whose rows a lane may not fill).
- One resume state: `{version, config_hash, step, lanes: [lane 0's state, …], digest}`, sealed
  like a feed's (state/resume.py `check_laned_state`); a state with another number of lanes is
  refused with a named error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import Config, normalize_weights
from pipeline.feed import Feed, LeaveOut
from pipeline.read.reading import (
    Executor,
    iter_blocks_local,
    iter_blocks_ray,
    with_head_start,
)
from pipeline.read.reading import read_ahead as reading_ahead
from pipeline.stages.documents import Reject
from pipeline.stages.mixing import DeficitMixer
from pipeline.stages.policy import window_for
from pipeline.state.resume import (
    CONFIG_HASH,
    DOCS_EMITTED,
    FEED,
    PACKER,
    REAL_TOKENS,
    ROWS,
    STATE_VERSION,
    STEP,
    Kept,
    Nested,
    check_laned_state,
    nest_kept,
)
from pipeline.state.summary import RunSummary, RunTotals, StreamSummary, describe_lengths
from wire.arrays import from_ipc, own, to_ipc, view
from wire.lanes import TAKE_GROUP, TAKE_THREADS, join_parts, lane_parts, rank_meta
from wire.layout import compact, step_path, write_step
from wire.protocol import META_RANK, META_STEP_ROWS, META_WORLD_SIZE, WINDOW_BYTES
from wire.schema import StepChunk

STEPS_PER_CALL = 4  # lane steps asked for at once (one actor call per lane), at least
TAKE_WAIT_S = 120.0  # a rank's take waits this long for a step a restarted lane makes again


def steps_per_call(lanes: int) -> int:
    """Steps asked of each lane per call: STEPS_PER_CALL, or 2K past it, so that the control
    submits about one lane call per two global steps and takes one answer, whatever K (a
    chunk is K calls).
    - At 4 steps a call, the control's CPU per step grew with K: 16 lanes on 2 cores, 8 ranks,
      pre-tokenized (`bench.serve_ranks`), 4.7 ms per step, a quarter of it submitting calls
      and a quarter taking the answers apart (py-spy).
    - At K steps a call, submitting the calls and taking the answers were still a third of
      the time the control held the GIL (16 lanes, 16 ranks; py-spy --gil), hence 2K, with
      half as many chunks in flight (`in_flight`): the steps made ahead stay the same."""
    return max(STEPS_PER_CALL, 2 * lanes)


# Steps asked for ahead of the chunk being joined (actors only), in chunks of
# steps_per_call(K). With one chunk ahead, a lane idled for a round trip after every chunk
# (its next was asked once its answer was back) and between the ranks' bursts. Served
# pre-tokenized, 2 lanes on 2 cores, 4 steps a call (bench.serve_ranks, one run each): 5.7M
# tokens/s with 1 chunk ahead, 7.7M with 2, 10.1M with 3, 12.2M with 4 (8 steps x 2: 10.6M).
# A weight change lands after the steps asked: up to in_flight(K) x steps_per_call(K) steps
# while the lanes keep ahead (more while the control waits on them: `most_in_flight`).
IN_FLIGHT = 4


def in_flight(lanes: int) -> int:
    """Chunks asked for ahead: at least IN_FLIGHT chunks of STEPS_PER_CALL steps' worth (16
    steps: 3 chunks of 6 at 3 lanes), and at least two (one being made while the one before
    is answered)."""
    return max(2, -(-IN_FLIGHT * STEPS_PER_CALL // steps_per_call(lanes)))


# While the control waits on the lanes, it asks more chunks ahead, up to a read unit's tokens
# a lane (`most_in_flight`). A lane reads and tokenizes a whole read unit (up to
# `read.block_bytes`) in the step that first needs it: at 16 lanes a unit of 8 MiB is ~450 of
# a lane's steps and ~0.2 s of a core, and every other lane, whose steps wait for this one's,
# stops once it has made the chunks asked of it. `python -m bench.lane_window` replays each
# lane's time per step (each alone on a core) as the control asks them: 16 lanes of 128 MiB
# of Python sources made 0.65 of the slowest lane's own rate 2 chunks of 32 steps ahead, 0.98
# at 8 and 1.00 at 16.
# While the lanes keep ahead, the control waits on no answer and asks `in_flight` chunks
# again: a weight change lands after the steps asked, so the depth returns to where it costs
# least (pipeline/lanes.py `LanedFeed._fill`).
BYTES_PER_TOKEN = 4  # a read unit's tokens, roughly: text (~4 bytes a token) or int32 ids
MOST_AHEAD_STEPS = 1024


def most_in_flight(cfg: Config) -> int:
    """The most chunks asked ahead: a read unit's tokens of one lane's steps (at most
    MOST_AHEAD_STEPS, and the WINDOW_BYTES the control's window may hold), at least
    `in_flight`."""
    lanes = cfg.lanes
    lane_step = cfg.global_batch_size // lanes * cfg.seq_len  # tokens of a lane's step
    steps = min(-(-cfg.read.block_bytes // BYTES_PER_TOKEN // lane_step), MOST_AHEAD_STEPS,
                WINDOW_BYTES // (cfg.global_batch_size * cfg.seq_len * 4))  # fmt: skip
    return max(in_flight(lanes), -(-steps // steps_per_call(lanes)))


# A lane "has a core" when its process used at least this share of one while it made its
# last chunk. Where lanes share cores (16 lanes on 2), a lane that waits leaves no core idle
# that a deeper bank could use, and asking further ahead cost there (every lane busy at
# once): 16 lanes and 16 ranks on 2 cores served 6.10M and 4.49M tokens/s against 6.90M and
# 6.75M, their lanes 15.3 and 16.7 ms of CPU a step against 13.6 and 13.9.
CORED = 0.75


def had_cores(before: list[tuple[float, float]], answers: list[LaneMade]
              ) -> tuple[bool, list[tuple[float, float]]]:  # fmt: skip
    """Whether the lanes had cores of their own making `answers` (one LaneMade a lane): their
    processes' CPU over their making time since `before` (each lane's `making_s`,
    `making_process_s` at its last answer), summed over the lanes, at least CORED; and the
    figures to compare the next answers with. A lane that made nothing keeps its figures."""
    wall = cpu = 0.0
    after = list(before)
    for k, made in enumerate(answers):
        if not len(made):
            continue
        wall += made.making_s - before[k][0]
        cpu += made.making_process_s - before[k][1]
        after[k] = (made.making_s, made.making_process_s)
    return wall > 0 and cpu >= CORED * wall, after


def next_depth(depth: int, waited: bool, least: int, most: int) -> int:
    """The chunks to ask ahead after joining one: twice as many after waiting on lanes that
    have cores of their own (`waited`: they are the bottleneck, and a deeper bank lets a
    lane's burst pass while the others go on), else one fewer (the lanes keep ahead, or share
    their cores: fewer steps for a weight change to wait)."""
    return min(most, depth * 2) if waited else max(least, depth - 1)


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
    from the lanes (wire/lanes.py `fetch`); `whole` joins them all (provenance, skips)."""

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

    def whole(self, timeout_s: float = 120.0) -> pa.RecordBatch:
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


class LaneWorker:
    """One lane's feed, in the process that runs it (a Ray actor, or this one)."""

    def __init__(self, cfg_json: dict, lane: int, state: dict | None, allow_config_change: bool,
                 full_batches: bool, local: bool, ipc: bool,
                 leave_out: LeaveOut | None = None, hold: bool = False,
                 writes: Writes | None = None, read_ahead: bool | None = None,
                 expect: dict[int, str] | None = None):  # fmt: skip
        cfg = Config.model_validate(cfg_json)
        self.lane = lane
        self.lanes, self.global_batch_size = cfg.lanes, cfg.global_batch_size
        self.writes = writes
        self.names = list(cfg.streams)
        # `hold`: the steps made stay here and the caller gets receipts (the batch server);
        # ranks take their rows (`take`, on threads of their own) until released.
        self.hold = hold
        # step -> the chunk that holds it and its place there (wire/schema.py StepChunk)
        self.held: dict[int, tuple[StepChunk, int]] = {}
        self._held_lock = threading.Lock()
        # Told when steps are held: a rank's take of a step this lane has yet to make (a lane
        # restarted from an earlier step makes the steps its ranks hold again) waits for it.
        self._made = threading.Condition(self._held_lock)
        self.unmade = 0  # the first step not yet held here (set once the feed stands)
        # A restarted lane's (LanedFeed.restart): the digest of the state after each step it
        # makes again, as the dead lane gave it. A step made otherwise is not held: the lane
        # fails (`failed`), and so does every take that waits for it.
        self.expect = dict(expect or {})
        self.failed: str | None = None
        # `read.in_lanes`: the lane reads and tokenizes its share itself, no block crosses a
        # process (K lanes are K tokenizing processes); else through Ray Data's tasks.
        # A lane on an actor reads its share on a thread of its own, ahead of its packer
        # (`read.ahead`, `reading.read_ahead`: the same blocks); in-process lanes (`local`:
        # one after the other, in the caller's thread) read as they pack, unless told.
        ahead = (not local and cfg.read.ahead) if read_ahead is None else read_ahead
        local = local or cfg.read.in_lanes
        executor: Executor = iter_blocks_local if local else iter_blocks_ray
        if local and ahead:
            executor = reading_ahead(executor)
        first = None if local else with_head_start(executor)
        self.feed = Feed(cfg, executor, first, state=state, leave_out=leave_out,
                         allow_config_change=allow_config_change, lane=lane)  # fmt: skip
        self.feed.full_batches = full_batches
        self.unmade = self.feed.step
        self.ipc = ipc
        self.making_s = self.making_cpu_s = 0.0  # Receipt `making_s`, `making_cpu_s`
        self.making_process_s = 0.0  # LaneMade `making_process_s`

    def steps(self, n: int, state_every: int, release_below: int | None = None
              ) -> tuple[list[tuple[Any, Kept | None]] | LaneMade, list[Reject]]:  # fmt: skip
        """Up to `n` next steps of this lane, each with its state when `state_every` says so,
        and the rejects met making them. Holding (`hold`): the lane keeps the steps, in one
        chunk, and answers their counts and states (LaneMade); the steps before
        `release_below` (every rank has them) are let go first."""
        if release_below is not None:
            with self._held_lock:
                for step in [s for s in self.held if s < release_below]:
                    del self.held[step]
        if n == 0:  # a release only (`LanedFeed.release`): nobody reads the answer
            return [], []
        wall, cpu, process = time.monotonic(), time.thread_time(), time.process_time()
        if self.hold:
            chunk, states = self.feed.kept_chunk(n, state_every)
        else:
            made = self.feed.kept_steps(n, state_every)
        self.making_s += time.monotonic() - wall
        self.making_cpu_s += time.thread_time() - cpu
        self.making_process_s += time.process_time() - process
        rejects = list(self.feed.rejects)
        self.feed.rejects.clear()
        if not self.hold:
            return [(to_ipc(b) if self.ipc else b, s) for b, s in made], rejects
        if chunk is None:
            none = np.zeros(0, dtype=np.int64)
            flat = np.zeros((0, len(self.names)), dtype=np.int64)
            return LaneMade(self.feed.step, none, none, flat, flat, []), rejects
        for j, kept in enumerate(states):
            want = self.expect.pop(chunk.first + j + 1, None)
            if want is not None and (kept is None or kept.digest != want):
                with self._held_lock:
                    self.failed = (
                        f"lane {self.lane}, started again, made step {chunk.first + j} otherwise "
                        "than before (its state differs): not served"
                    )
                    self._made.notify_all()
                raise LaneError(self.failed)
        with self._held_lock:
            for j in range(len(chunk)):
                self.held[chunk.first + j] = (chunk, j)
            held = len(self.held)
            self.unmade = chunk.first + len(chunk)
            self._made.notify_all()
        writes = {}
        if self.writes is not None:
            done = [self._write(chunk.first + j, chunk.step(j)) for j in range(len(chunk))]
            writes = {"written": tuple(d.get("written", ()) for d in done),
                      "labels": tuple(d.get("labels", False) for d in done)}  # fmt: skip
        return LaneMade(chunk.first, np.diff(chunk.starts), chunk.real_tokens, chunk.tokens,
                        chunk.docs, states, **writes, held=held, making_s=self.making_s,
                        making_cpu_s=self.making_cpu_s,
                        making_process_s=self.making_process_s), rejects  # fmt: skip

    def _write(self, step: int, batch: pa.RecordBatch) -> dict:
        """The files of `step` whose ranks' rows lie in this lane's part, if the part is full
        (only then are its rows where a full step puts them), written aside: their ranks, and
        whether they keep labels (Receipt `written`, `labels`)."""
        w = self.writes
        assert w is not None
        G = self.global_batch_size
        per_lane = G // self.lanes
        if batch.num_rows < per_lane:
            return {}
        stored = batch if w.full else compact(batch, w.keep_labels)
        full_step = [per_lane] * self.lanes
        written = []
        for r in range(w.world):
            parts = lane_parts(full_step, r, w.world, G)
            if len(parts) != 1 or parts[0][0] != self.lane:
                continue  # not in this lane, or spanning lanes: the export joins them
            _, lo, hi = parts[0]
            part = own(stored.slice(lo, hi - lo))  # the bytes the one-process export writes
            write_step(part.replace_schema_metadata(rank_meta(part, r, w.world)),
                       w.pending(step, r), w.fmt)  # fmt: skip
            written.append(r)
        return {"written": tuple(written), "labels": "labels" in stored.schema.names}

    def take(self, parts: list[tuple[int, int, int]], rank: int, world_size: int
             ) -> list[tuple[bytes, int]]:  # fmt: skip
        """Rows [lo, hi) of this lane's part of each (step, lo, hi), for rank `rank` of
        `world_size`: runs of one schema (wire/lanes.py `runs_of`'s runs), as Arrow IPC.
        Consecutive steps' rows that lie together in one chunk are one slice, sent as it is
        (a run's IPC padding may hold bytes of the rows after it: the rank reads the same
        data). Runs on the `serve` threads, beside the thread that makes steps."""
        with self._held_lock:
            found = [(self._held(s), lo, hi) for s, lo, hi in parts]  # in step order
        # Runs of one schema: each its first step's metadata, its pieces (chunk, first row,
        # end row, step in the chunk) and the rows of each step.
        runs: list[tuple[dict, list[list], list[int]]] = []
        names: tuple | None = None
        for (chunk, j), lo, hi in found:
            step_names = chunk.names(j)
            if step_names != names:
                runs.append((chunk.metadata(j), [], []))
                names = step_names
            _, pieces, step_rows = runs[-1]
            start = int(chunk.starts[j]) + lo
            if pieces and pieces[-1][0] is chunk and pieces[-1][2] == start:
                pieces[-1][2] = start + hi - lo  # right after the last piece: one slice
            else:
                pieces.append([chunk, start, start + hi - lo, j])
            step_rows.append(hi - lo)
        out = []
        for meta, pieces, step_rows in runs:
            batches = [
                c.part(j, a - int(c.starts[j]), b - int(c.starts[j])) for c, a, b, j in pieces
            ]
            joined = pa.concat_batches(batches) if len(batches) > 1 else batches[0]
            meta = meta | {META_RANK: str(rank), META_WORLD_SIZE: str(world_size),
                           META_STEP_ROWS: ",".join(map(str, step_rows))}  # fmt: skip
            out.append((to_ipc(joined.replace_schema_metadata(meta)), len(step_rows)))
        return out

    def part(self, step: int) -> bytes:
        """This lane's part of held step `step` as it was made (Arrow IPC): `LanedStep.whole`."""
        with self._held_lock:
            chunk, j = self._held(step)
        return to_ipc(own(chunk.step(j)))

    def _held(self, step: int) -> tuple[StepChunk, int]:
        """Where held step `step` is (under `_held_lock`), or a LookupError naming what is
        held. A step this lane has yet to make is waited for, up to TAKE_WAIT_S: only a lane
        restarted from an earlier step (`LanedFeed.restart`) is asked for one, while it makes
        again the steps its ranks were told of."""
        deadline = time.monotonic() + TAKE_WAIT_S
        while step not in self.held and step >= self.unmade:
            if self.failed:
                raise LaneError(self.failed)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"lane {self.lane} has not made step {step} within {TAKE_WAIT_S:.0f}s "
                    f"(it has made those before step {self.unmade})"
                )
            self._made.wait(timeout=min(left, 1.0))
        if step not in self.held:
            held = f"{min(self.held)}..{max(self.held)}" if self.held else "none"
            raise LookupError(
                f"lane {self.lane} no longer holds step {step} (it holds {held}): "
                "every rank had it, or the rank was lost; resume from a saved state"
            )
        return self.held[step]

    def set_weights(self, weights: dict[str, float], step: int, source: str = "api") -> int:
        return self.feed.set_weights(weights, step, source)

    def process(self) -> dict:
        """Where this lane runs: its process id and host (metrics `lanes`, benches that pin
        a lane to a core)."""
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def state(self) -> Kept:
        """The lane's state now (before its first step: where it starts), kept."""
        return self.feed.kept_state()

    def summary(self) -> tuple[RunSummary, dict[str, list[int]]]:
        """The lane's summary, and its sampled document lengths per stream (for the join)."""
        lengths = {s.name: list(s.counters.lengths) for s in self.feed.streams}
        return self.feed.summary(), lengths

    def close(self) -> None:
        self.feed.close()


class _Local:
    """A lane in this process: calls answer at once."""

    def __init__(self, worker: LaneWorker):
        self.worker = worker

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)

    def get(self, handle) -> Any:
        return handle

    def ready(self, handle) -> bool:
        return True

    def kill(self) -> None:
        self.worker.close()


class _Actor:
    """A lane in a Ray actor: calls answer with object refs."""

    def __init__(self, handle):
        self.handle = handle

    def call(self, method: str, *args) -> Any:
        return getattr(self.handle, method).remote(*args)

    def get(self, ref) -> Any:
        import ray

        return ray.get(ref)

    def ready(self, ref) -> bool:
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # a dead lane has nothing left to close
            ray.get(self.handle.close.remote(), timeout=30)
        ray.kill(self.handle)


@dataclass
class _Sent:
    """A weight change sent to the lanes (`set_weights`): after the steps asked before
    `asked` and before the others, its step, weights and source, and each lane's call (a
    restarted lane's replaced in place)."""

    asked: int
    step: int
    weights: dict
    source: str
    calls: list

    def change(self) -> dict:
        """As a lane's state records it (stages/mixing.py WeightChange)."""
        weights = {k: float(v) for k, v in self.weights.items()}
        return {"step": self.step, "weights": weights, "source": self.source}


class _Chunk:
    """Steps asked of every lane at once, one call each: the first step, how many, and each
    lane's call (a restarted lane's is replaced in place, `LanedFeed.restart`)."""

    __slots__ = ("first", "n", "calls")

    def __init__(self, first: int, n: int, calls: list):
        self.first, self.n, self.calls = first, n, calls


def lane_died(error: BaseException) -> bool:
    """Whether `error`, met asking a lane actor, says its process is gone (killed, its node
    lost), as opposed to a failure of the lane's own work (a bad record, a bug)."""
    import ray.exceptions

    # ObjectLostError: an answer kept on the lane's node, lost with it.
    return isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError)


class LanedFeed:
    """The global steps of a config with `lanes` K > 1, joined from K lane feeds.

    The face an export and the batch server use of a `Feed`: `next_step`, `get_state` (at
    the start, and every `state_every` steps: a lane's state exists only at the steps it was
    asked for), `set_weights`, `rejects` (or `on_reject`), `mixer` (the global mixture's
    bookkeeping: its weight changes and what was served; the lanes do the mixing), `totals`,
    `summary`, `close`. `local`: the lanes run in this process, one after the other
    (`export --local`, tests); else each in a Ray actor."""

    def __init__(self, cfg: Config, *, local: bool = False, state: dict | None = None,
                 allow_config_change: bool = False, full_batches: bool = True,
                 state_every: int = 0,
                 on_reject: Callable[[Reject], None] | None = None,
                 wait_for_figures: bool = True,
                 leave_out: LeaveOut | None = None, hold: bool = False,
                 writes: Writes | None = None, restarts: int = 0):  # fmt: skip
        self.cfg = cfg
        # `hold` (the batch server): the lanes keep the steps they make and `next_step` gives
        # a LanedStep (where its rows are) instead of the rows: ranks take them from the
        # lanes, and this process never touches token data (actors only).
        # `writes` (an export on actors): the lanes write the step files of the ranks whose
        # rows they hold (holding the steps, so that the export can join the others).
        self.hold = (hold or writes is not None) and not local
        self.writes = writes if self.hold else None
        self._release: int | None = None  # the lanes let go of steps before this (hold)
        self._told = 0  # the last `release` the lanes were told
        self.names = list(cfg.streams)
        self.config_hash = cfg.config_hash()
        self.full_batches = full_batches
        self.state_every = state_every
        K = cfg.lanes
        parts: list[dict | None] = [None] * K
        self.step = 0
        self.rows = self.real_tokens = 0
        self.tokens = np.zeros(len(self.names), dtype=np.int64)
        self.docs_emitted = np.zeros(len(self.names), dtype=np.int64)
        if state is not None:
            checked = check_laned_state(state, self.config_hash, self.names,
                                        allow_config_change, cfg.packing.mode, K)  # fmt: skip
            parts = list(checked)
            self.step = int(state[STEP])
            for part in checked:
                f = part[FEED]
                self.rows += int(f[ROWS])
                self.real_tokens += int(f[REAL_TOKENS])
                placed = part[PACKER]["mixer"]["placed"]
                for i, n in enumerate(self.names):
                    self.docs_emitted[i] += int(f[DOCS_EMITTED].get(n, 0))
                    self.tokens[i] += int(placed.get(n, 0))
        cfg_json = cfg.model_dump(mode="json", context={"reveal_secrets": True})
        # Lanes make steps in the compact layout when this feed does; a step whose lanes
        # differ in layout (one kept labels it could not derive) is joined in full, then
        # compacted again (`_join`).
        # Documents to leave out go to every lane: each meets only its own.
        self._args = [(cfg_json, k, parts[k], allow_config_change, full_batches, local,
                       not local, leave_out, self.hold, self.writes) for k in range(K)]  # fmt: skip
        self.lanes: list[_Local | _Actor]
        if local:
            self.lanes = [_Local(LaneWorker(*a)) for a in self._args]
        else:
            self.lanes = [_Actor(self._start(a)) for a in self._args]
        # One list shared by every step it makes (a restarted lane's actor replaces its
        # entry), and the key a rank's reply names it by (`where`): unique to this feed's
        # actors, so a skip's new lanes have another.
        self.handles = [getattr(lane, "handle", None) for lane in self.lanes]
        # A holding lane whose process died is started again from its state at the oldest
        # step it held, up to `restarts` times per lane (`restart`; service.lane_restarts):
        # the steps it made are made again, the same. Each lane's kept states, by step, from
        # that oldest step on (states at every step: `state_every` 1).
        self.restarts = restarts if self.hold and state_every == 1 else 0
        # Each restart: lane, the step it started again from, the steps asked of it again,
        # reason, time, and the how-manieth of that lane.
        self.restarted: list[dict] = []
        self._kept_lanes: collections.OrderedDict[int, list[Kept]] = collections.OrderedDict()
        self._remade: list[tuple[int, Any, Any]] = []  # lane, its _Actor, a call made again
        self._sent: list[_Sent] = []  # weight changes sent since the oldest kept step
        self._closed = False  # closed, or replaced by a skip: no restart
        self.key = uuid.uuid4().hex
        # Where each lane runs (asked now, read once answered) and the steps it held when it
        # last answered (holding lanes): metrics `lanes`.
        self._processes = [lane.call("process") for lane in self.lanes]
        self._last: list[Receipt | LaneMade] = [
            Receipt(0, 0, [], [])
        ] * K  # each lane's latest receipt
        # The seconds `next_step` waited for the lanes' answers (metrics `lanes_waited_s`):
        # a step waits for its slowest lane, the one whose making time keeps pace (`_last`).
        self.waited_s = 0.0
        self.rejects: list[Reject] = []
        self.on_reject = on_reject
        # False (the batch server): `summary` answers with the lanes' last summaries and asks
        # again in the background, so a metrics call never waits on a lane busy making steps
        # (what was served is counted here, always current; what was read lags one call).
        self.wait_for_figures = wait_for_figures
        self._summaries: list | None = None
        self._asking: list | None = None
        # The batch server calls set_weights from its control thread while its producer
        # thread makes steps: the lock orders the lanes' calls and guards the bookkeeping.
        self._lock = threading.RLock()
        # The global mixture's bookkeeping (never mixes): the same changes as every lane's
        # mixer, and `placed` what was served, so `scheduled_weights` and `realized` answer
        # here without asking the lanes.
        self.mixer = DeficitMixer(self.names, {n: s.weight for n, s in cfg.streams.items()},
                                  cfg.mixing.on_exhausted)  # fmt: skip
        for entry in cfg.schedule:
            self.mixer.schedule(entry.step, entry.weights, source="schedule")
        if state is not None:
            self.mixer.set_state(parts[0][PACKER]["mixer"])  # type: ignore[index]
            if state[CONFIG_HASH] != self.config_hash:
                self.mixer.schedule(self.step, {n: s.weight for n, s in cfg.streams.items()},
                                    "resume")  # fmt: skip
        self.mixer.placed = self.tokens
        self.mixer.begin_step(self.step)
        self.finished = False
        self._ready: collections.deque = collections.deque()
        # The chunks asked for ahead (in_flight): each its step count and the lanes' answers.
        self._pending: collections.deque[_Chunk] = collections.deque()
        self._current: _Chunk | None = None  # the chunk being joined (`_fill`)
        self._asked = self.step  # steps asked of every lane: the first step no lane has begun
        self._first = self.step  # the first call asks STEPS_PER_CALL: the first step comes sooner
        # Chunks asked ahead of the one joined: `in_flight` while the lanes keep ahead, more
        # while the control waits on them (`next_depth`, `most_in_flight`).
        self.depth = self._least_depth = in_flight(K)
        # Whether the ranks, not the lanes, set the pace (the batch server's: True once its
        # window was full, False once a rank waited for a step): a chunk not made yet is then
        # no reason to ask further ahead. With ranks that take 64 steps a call, the producer
        # makes each 64 as fast as the lanes can while the ranks train on the last: told only
        # whether the window filled since the last chunk, the control asked 16 chunks ahead
        # most of a run of ranks taking a step per 50 ms (`bench.lane_restart --step-ms 50`).
        self.ranks_behind = False
        self._most_depth = most_in_flight(cfg)
        self._making = [(0.0, 0.0)] * K  # each lane's making_s, making_process_s last answered
        self._changes: list[tuple[int, list]] = []  # weight changes the lanes have yet to confirm
        # The state after the last step handed out; at the start, the lanes' own.
        self._state: Nested | None = None
        if state_every:
            states = [lane.get(lane.call("state")) for lane in self.lanes]
            self._state = self._nest(states)
            if self.restarts:
                self._kept_lanes[self.step] = states
        self.first_step_at: float | None = None

    def _start(self, args: tuple, expect: dict[int, str] | None = None):
        """A lane actor, with `args` (LaneWorker's), and the states it is to make (`expect`,
        a restart's)."""
        import ray

        # Holding lanes hand out rows on threads of their own (`take`), beside the one
        # thread (the default group) that makes steps, changes weights and gives states.
        groups = {"concurrency_groups": {TAKE_GROUP: TAKE_THREADS}} if self.hold else {}
        actor = ray.remote(num_cpus=0, max_restarts=0, **groups)(  # type: ignore[call-overload]
            LaneWorker
        )
        resources = self.cfg.service.resources
        opts = {"resources": dict(resources)} if resources else {}
        return actor.options(**opts).remote(*args, expect=expect)

    # -- steps ------------------------------------------------------------------------------

    def next_step(self) -> pa.RecordBatch | LanedStep | None:
        """The next global step (G rows; the last may be short), or None when the data ends.
        Holding (`hold`): a LanedStep, whose rows the lanes keep."""
        while not self._ready and not self.finished:
            self._fill()
        if not self._ready:
            return None
        with self._lock:
            made, self._state = self._ready.popleft()
            self.step += 1
            self.mixer.begin_step(self.step)
            if self.hold:
                made, counts = made
                self._add(*counts)
            else:
                self._count([served_counts(made, self.names)])
        return made

    def release(self, below: int) -> None:
        """Every rank has taken the steps before `below` from the lanes (hold): the lanes may
        let them go, told with the next steps asked of them, or alone once the data has ended
        (`_release_alone`)."""
        with self._lock:
            self._release = max(below, self._release or 0)
            if self.finished and self.hold:
                self._release_alone()

    def _release_alone(self) -> None:
        """Under the lock: the steps every rank has, told the lanes in a call of its own (no
        step is asked to carry them: the data ended, or the control asks fewer chunks ahead
        than it has), a chunk's steps at a time: the steps made ahead can be many
        (`most_in_flight`), and a restart makes again those a lane holds."""
        if self._release is None or isinstance(self.lanes[0], _Local):
            return
        if self._release - self._told < steps_per_call(len(self.lanes)):
            return
        below, self._release = self._release, None
        self._told_lanes(below)
        for lane in self.lanes:
            lane.call("steps", 0, 0, below)  # answered by nobody: a release only

    def _told_lanes(self, below: int) -> None:
        """Under the lock: the lanes are told to let go of the steps before `below`, and so
        are their states kept for a restart (every rank has those steps)."""
        self._told = below
        while self._kept_lanes and next(iter(self._kept_lanes)) < below:
            self._kept_lanes.popitem(last=False)
        oldest = next(iter(self._kept_lanes), below)
        # A change sent before the oldest kept step's was made is in every kept state.
        self._sent = [sent for sent in self._sent if sent.asked >= oldest]

    def _room(self) -> int:
        """How many steps may be asked of the lanes now: steps_per_call(K), but never past
        the next decision of the mixing policy after the step being made (`mixing.policy`):
        its weights are decided (`set_weights`) just before it is made, so no lane may begin
        it earlier. A decision at or before `self.step` is made already."""
        per_call = steps_per_call(len(self.lanes))
        policy = self.cfg.mixing.policy
        if policy is None:
            return per_call
        for step in range(self.step + 1, self._asked + per_call):
            if window_for(step, policy.every, policy.delay) is not None:
                return min(per_call, step - self._asked)
        return per_call

    def _ask(self) -> _Chunk | None:
        # Under the lock: a weight change submitted to the lanes is ordered before or after
        # the whole chunk in every lane (an actor runs one caller's calls in order).
        with self._lock:
            n = self._room()
            if self._asked == self._first:
                n = min(n, STEPS_PER_CALL)
            if n <= 0:
                return None
            first, self._asked = self._asked, self._asked + n
            release, self._release = self._release, None
            if release is not None:
                self._told_lanes(release)
            calls = [lane.call("steps", n, self.state_every, release) for lane in self.lanes]
            return _Chunk(first, n, calls)

    def _fill(self) -> None:
        with self._lock:  # a restart (`restart`) re-asks every chunk not yet joined
            chunk = self._current = self._pending.popleft() if self._pending else self._ask()
        assert chunk is not None  # nothing pending and nothing ready: the step made is asked
        n = chunk.n
        made_already = self.hold and self._made(chunk.calls)
        t = time.monotonic()
        answers = [self._answer_of(chunk.calls, k) for k in range(len(self.lanes))]
        self.waited_s += time.monotonic() - t
        with self._lock:
            self._current = None
        if self._remade:
            self._check_remade()
        if self.hold:  # the depth follows holding lanes (LaneMade carries their making time)
            cored, self._making = had_cores(self._making, [made for made, _ in answers])
            waited = not made_already and cored and not self.ranks_behind
            self.depth = next_depth(self.depth, waited, self._least_depth, self._most_depth)
            for k, (lane_made, _) in enumerate(answers):
                if len(lane_made):
                    self._last[k] = lane_made
        self._confirm_changes()
        # The next chunks are made while this one is joined and written (actors only).
        asked = False
        while not isinstance(self.lanes[0], _Local) and len(self._pending) < self.depth:
            with self._lock:  # asked and pending at once, for a restart to find
                ahead = self._ask()
                if ahead is None:  # the mixing policy's next decision comes first
                    break
                self._pending.append(ahead)
                asked = True
        if self.hold and not asked:  # the depth falling back: the releases go alone
            with self._lock:
                self._release_alone()
        for _, rejects in answers:
            for reject in rejects:
                if self.on_reject is not None:
                    self.on_reject(reject)
                else:
                    self.rejects.append(reject)
        made = [steps for steps, _ in answers]
        per_lane = self.cfg.global_batch_size // self.cfg.lanes
        if self.hold:  # what the steps count, summed over the lanes at once
            # The steps keep their lanes' answers without the states (the producer keeps
            # each step's nested state).
            counted = tuple(replace(lane_made, states=[]) for lane_made in made)
            m = min(len(lane_made) for lane_made in made)
            rows = np.stack([lane_made.rows[:m] for lane_made in made], axis=1).tolist()
            counts = [sum(lane_made.rows[:m] for lane_made in made),
                      sum(lane_made.real_tokens[:m] for lane_made in made),
                      sum(lane_made.tokens[:m] for lane_made in made),
                      sum(lane_made.docs[:m] for lane_made in made)]  # fmt: skip
        for j in range(n):
            if any(len(steps) <= j for steps in made):
                self.finished = True  # a lane has no step here: the sequence ends before it
                return
            if self.hold:
                states = [lane_made.states[j] for lane_made in made]
                step = self.step + len(self._ready)  # the steps before it are ready
                if self.restarts:
                    with self._lock:
                        self._kept_lanes[step + 1] = states
                step_rows = tuple(rows[j])
                laned = LanedStep(step, self.handles, step_rows, counted, j, self.key)
                made_step: Any = (laned, [int(counts[0][j]), int(counts[1][j]), counts[2][j],
                                          counts[3][j]])  # fmt: skip
            else:
                states = [steps[j][1] for steps in made]
                batches = [self._batch(steps[j][0]) for steps in made]
                step_rows = tuple(b.num_rows for b in batches)
                made_step = join_parts(batches)
            short = any(r < per_lane for r in step_rows)
            if short and self.cfg.drop_last:
                self.finished = True
                return
            state = None if any(s is None for s in states) else self._nest(states)
            self._ready.append((made_step, state))
            if short:
                self.finished = True
                return

    def _made(self, asked: list) -> bool:
        """Whether every lane (actors: holding lanes are) has answered `asked` already."""
        import ray

        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=0)
        return len(ready) == len(asked)

    def _answer_of(self, calls: list, k: int) -> Any:
        """Lane k's answer to its call in `calls` (a chunk's, a weight change's): asked again
        of the lane's new actor when its process died and it was restarted (`restart`, which
        replaces the call in `calls`). A lane that failed otherwise fails the feed, by name."""
        while True:
            lane = self.lanes[k]  # before the call: a restart replaces the call first
            call = calls[k]
            try:
                return lane.get(call)
            except Exception as e:
                if not self.restart(k, lane, e):
                    raise LaneError(f"lane {k} of {len(self.lanes)} failed: {e}") from e

    # -- a lane whose process died ------------------------------------------------------------

    def restart(self, k: int, lane: Any, error: BaseException) -> bool:
        """Lane k (`lane`, the one that failed with `error`) started again, if its process
        died and it has restarts left: True once lane k is another actor (this call's, or
        another thread's that met the death first).

        The new actor starts from lane k's state at the oldest step it held (every rank had
        the steps before: `release`), takes the weight changes that state does not hold, and
        makes again, in order, every step asked of lane k since: those handed out and held
        for the ranks, then each chunk asked and not yet joined (their calls replaced). The
        sequence is a function of the state, so it makes the same steps; each state it
        answers is checked against the one lane k gave for that step (`_check_remade`).
        Ranks that met the dead actor ask the server for the new one (`check_lane`), and
        their takes of steps it has yet to make again wait for them (LaneWorker `_held`).

        Why from the state, not Ray's own actor restart (`max_restarts`): Ray runs the
        constructor again with its first arguments, so the lane would make the whole run
        again from where the service started before it reached the steps the ranks need."""
        if not lane_died(error):
            return self.lanes[k] is not lane
        import ray

        with self._lock:
            if self.lanes[k] is not lane:
                return True  # restarted already, by the thread that met it first
            done = sum(1 for r in self.restarted if r["lane"] == k)
            if done >= self.restarts or not self._kept_lanes or self._closed:
                return False
            step, states = next(iter(self._kept_lanes.items()))
            state = states[k].unpack()
            args = list(self._args[k])
            args[2] = state
            # The states lane k gave after each step it is to make again: the new actor makes
            # those steps, and holds one for the ranks, only if its state is the same.
            expect = {at: kept[k].digest for at, kept in self._kept_lanes.items() if at > step}
            new = _Actor(self._start(tuple(args), expect=expect))
            with contextlib.suppress(Exception):  # one taken for dead stays so (a partition)
                ray.kill(lane.handle)  # type: ignore[union-attr]  # actors only (lane_died)
            # What was asked of lane k since that state, asked again in the same order: the
            # weight changes the state does not hold, each after the steps asked before it
            # was sent (a lane's state holds the changes scheduled ahead of it), and the
            # steps: those joined already, then the chunks not yet joined (calls replaced).
            held = state[PACKER]["mixer"]["history"]
            changes = collections.deque(
                sent for sent in self._sent
                if sent.asked >= step and sent.change() not in held
            )  # fmt: skip
            replaced: set[int] = set()

            def changes_until(at: int | float) -> None:
                while changes and changes[0].asked <= at:
                    sent = changes.popleft()
                    sent.calls[k] = new.call("set_weights", sent.weights, sent.step, sent.source)
                    replaced.add(id(sent.calls))

            chunks = [c for c in (self._current, *self._pending) if c is not None]
            end = chunks[0].first if chunks else self._asked
            per_call = steps_per_call(len(self.lanes))
            first = step
            while first < end:
                changes_until(first)
                upto = min([first + per_call, end, *(c.asked for c in changes if c.asked > first)])
                self._remade.append((k, new, new.call("steps", upto - first, self.state_every,
                                                      None)))  # fmt: skip
                first = upto
            for c in chunks:
                changes_until(c.first)
                c.calls[k] = new.call("steps", c.n, self.state_every, None)
            changes_until(float("inf"))
            for change_step, calls in self._changes:  # held by the state: answered here
                if id(calls) not in replaced:
                    calls[k] = ray.put(change_step)
            self.lanes[k] = new
            self.handles[k] = new.handle
            self._processes[k] = new.call("process")
            self._making[k] = (0.0, 0.0)
            self._asking = None  # the summaries asked of the dead actor never come
            self.restarted.append({"lane": k, "step": step, "steps": self._asked - step,
                                   "reason": type(error).__name__, "at": time.time(),
                                   "restart": done + 1})  # fmt: skip
        print(f"tokenmill: lane {k} of {len(self.lanes)} died ({type(error).__name__}); "
              f"started again from step {step} (restart {done + 1} of {self.restarts})",
              file=sys.stderr, flush=True)  # fmt: skip
        return True

    def check_lane(self, k: int, timeout_s: float = 10.0) -> None:
        """A rank met lane k's actor dead (wire/lanes.py LaneGone): restarted here if it is
        (the producer may be waiting for room, not for the lane, and not meet it)."""
        import ray

        lane = self.lanes[k]
        if not isinstance(lane, _Actor):
            return  # in this process: nothing dies apart
        ping = lane.handle.process.options(concurrency_group=TAKE_GROUP).remote()
        ready, _ = ray.wait([ping], timeout=timeout_s)
        if not ready:
            return  # busy or starting: the rank asks again
        try:
            ray.get(ping)
        except Exception as e:
            self.restart(k, lane, e)

    def _check_remade(self) -> None:
        """The answers of the steps a restarted lane made again, as they come: a lane that
        made one otherwise than before (LaneWorker `expect`) fails the feed."""
        with self._lock:
            ready = [r for r in self._remade if r[1].ready(r[2])]
            self._remade = [r for r in self._remade if r not in ready]
        for k, lane, call in ready:
            try:
                lane.get(call)
            except Exception as e:
                if self.restart(k, lane, e):
                    continue
                raise LaneError(f"lane {k} of {len(self.lanes)} failed: {e}") from e

    def _confirm_changes(self) -> None:
        """Weight changes set without waiting (`set_weights(wait=False)`) that every lane has
        answered: each must have taken it at its step; a lane that failed fails the feed."""
        while self._changes:
            step, calls = self._changes[0]
            if not all(lane.ready(c) for lane, c in zip(self.lanes, calls, strict=True)):
                return
            for k in range(len(calls)):
                got = self._answer_of(calls, k)
                assert got == step, (got, step)
            self._changes.pop(0)

    def lane_view(self) -> list[dict]:
        """Each lane: its process (pid, host; None until it has said), how many times it was
        started again (`restart`) and, when the lanes hold the rows, the steps it held when it
        last answered (the window's steps, those not yet released, and those made ahead) and
        its seconds making steps by then, wall and CPU (`making_s`, `making_cpu_s`)."""
        out = []
        for k, (lane, call) in enumerate(zip(self.lanes, self._processes, strict=True)):
            where = {"pid": None, "host": None}
            if lane.ready(call):
                with contextlib.suppress(Exception):  # a lane that died says nothing
                    where = lane.get(call)
            last = self._last[k] if self.hold else None
            restarts = sum(1 for r in self.restarted if r["lane"] == k)
            out.append({"lane": k, **where, "restarts": restarts,
                        "held_steps": last and last.held, "making_s": last and last.making_s,
                        "making_cpu_s": last and last.making_cpu_s})  # fmt: skip
        return out

    def _batch(self, made) -> pa.RecordBatch:
        return from_ipc(made) if isinstance(made, bytes) else made

    def _nest(self, states: list[Kept]) -> Nested:
        return nest_kept(STATE_VERSION, self.config_hash, states)

    def _count(self, receipts: list[Receipt]) -> None:
        """What was served (a step's parts): rows, tokens, and per stream its tokens and
        documents started."""
        for r in receipts:
            self._add(r.rows, r.real_tokens, np.asarray(r.tokens, dtype=np.int64),
                      np.asarray(r.docs, dtype=np.int64))  # fmt: skip

    def _add(self, rows: int, real_tokens: int, tokens: np.ndarray, docs: np.ndarray) -> None:
        """A step served: its rows, real tokens, and per stream its tokens and documents
        started."""
        self.first_step_at = self.first_step_at or time.monotonic()
        self.rows += rows
        self.real_tokens += real_tokens
        self.tokens += tokens
        self.docs_emitted += docs

    def get_state(self) -> dict:
        """The state after the last step handed out: the lanes' states at that step, nested
        and sealed. Lanes make states only every `state_every` steps (they run ahead)."""
        return self.kept_state().unpack()

    def kept_state(self) -> Nested:
        """`get_state`, kept (the batch server keeps one for every recent step)."""
        if self._state is None or self._state.step != self.step:
            raise ValueError(
                f"a laned feed has states every {self.state_every} steps (state_every), not at "
                f"step {self.step}"
            )
        return self._state

    def set_weights(self, weights: dict[str, float], effective_step: int | None = None,
                    source: str = "api", wait: bool = True) -> int:  # fmt: skip
        """New weights in every lane from one global step: `effective_step`, or the first
        step no lane has begun if that is later (lanes make steps ahead of what is handed
        out). Never a step already handed out. Returns the step. `wait` False (the batch
        server, under its lock): the lanes' answers, which queue behind the chunks asked
        ahead, are checked as they come (`_fill`), not waited for here."""
        step = self._asked if effective_step is None else int(effective_step)
        if step < self.step:
            raise ValueError(
                f"effective step {step} is already produced (next step is {self.step})"
            )
        normalize_weights(weights, self.names)  # refused here, before any lane changes
        with self._lock:  # the producer thread asks for chunks (`_ask`) meanwhile
            step = max(step, self._asked)
            calls = [lane.call("set_weights", weights, step, source) for lane in self.lanes]
            self.mixer.schedule(step, weights, source=source)
            if self.restarts:  # after the steps asked so far, for a restart to send again
                self._sent.append(_Sent(self._asked, step, dict(weights), source, calls))
            if not wait:
                self._changes.append((step, calls))
        if wait:
            got = [self._answer_of(calls, k) for k in range(len(calls))]
            assert set(got) == {step}, got
        with self._lock:
            if step == self.step == self._asked and self._state is not None:
                # Before its step is begun (the mixing policy's decisions): the state at it
                # holds the change, as a single feed's would, so a replay from it agrees.
                states = [self._call_lane(k, "state") for k in range(len(self.lanes))]
                self._state = self._nest(states)
                if self.restarts:
                    self._kept_lanes[self.step] = states
        return step

    def _call_lane(self, k: int, method: str) -> Any:
        """Lane k's answer to `method` (its state, its summary), asked again of its new actor
        if it died meanwhile."""
        while True:
            lane = self.lanes[k]
            try:
                return lane.get(lane.call(method))
            except Exception as e:
                if not self.restart(k, lane, e):
                    raise LaneError(f"lane {k} of {len(self.lanes)} failed: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._closed = True  # no lane is started again from here on
        for lane in self.lanes:
            lane.kill()

    def stop_reading(self) -> None:
        """Stop the lanes' reads and making, and keep the lanes (and the rows they hold) until
        `close`: a skip replaced this feed while ranks may still fetch its steps. A lane that
        dies from here on is not started again (it would make this feed's steps again)."""
        with self._lock:
            self._closed = True
        for lane in self.lanes:  # queued behind the chunks asked: not waited for
            with contextlib.suppress(Exception):  # a dead lane reads nothing
                lane.call("close")

    # -- figures ----------------------------------------------------------------------------

    def totals(self) -> RunTotals:
        """What was served so far (since step 0, across resumes)."""
        read = self._joined_read()
        return RunTotals(
            steps=self.step,
            rows=self.rows,
            real_tokens=self.real_tokens,
            seq_len=self.cfg.seq_len,
            streams={
                n: {
                    "tokens": int(self.tokens[i]),
                    "docs": int(self.docs_emitted[i]),
                    "skipped": read[n].skipped,
                }
                for i, n in enumerate(self.names)
            },  # fmt: skip
        )

    def _lane_summaries(self) -> list[tuple[RunSummary, dict[str, list[int]]]]:
        """The lanes' summaries: asked for now, or (`wait_for_figures` False) the last ones
        the lanes gave, with the next asked for in the background; the first call waits."""
        if self.wait_for_figures or self._summaries is None:
            self._summaries = [self._call_lane(k, "summary") for k in range(len(self.lanes))]
            return self._summaries
        with self._lock:  # a restart drops what was asked of a dead actor
            asking, lanes = self._asking, list(self.lanes)
        if asking is not None and all(lane.ready(a) for lane, a in zip(lanes, asking, strict=True)):
            with contextlib.suppress(Exception):  # a lane died: the last ones stand
                self._summaries = [lane.get(a) for lane, a in zip(lanes, asking, strict=True)]
            asking = None
        if asking is None:
            asking = [lane.call("summary") for lane in lanes]
        with self._lock:
            if self.lanes == lanes:
                self._asking = asking
        return self._summaries

    def _joined_read(self, parts=None) -> dict[str, StreamSummary]:
        parts = parts or self._lane_summaries()
        out = {}
        for name in self.names:
            each = [p.streams[name] for p, _ in parts]
            lengths = np.concatenate([np.asarray(ls[name], dtype=np.int64) for _, ls in parts])
            first = each[0]
            out[name] = replace(
                first,
                **{
                    k: sum(getattr(s, k) for s in each)
                    for k in (
                        "docs_read",
                        "tokens_read",
                        "skipped",
                        "split",
                        "truncated",
                        "dropped",
                        "truncated_tokens",
                        "dropped_tokens",
                    )
                },  # fmt: skip
                epochs_started=max(s.epochs_started for s in each),
                backend_tokens={
                    b: sum(s.backend_tokens[b] for s in each) for b in first.backend_tokens
                },  # fmt: skip
                length=describe_lengths(lengths),
            )
        return out

    def summary(self) -> RunSummary:
        """The run's summary: what was served counted here, what was read summed over the
        lanes (they read ahead of what was served), the mixture as lane 0 records it (every
        lane holds the same changes)."""
        parts = self._lane_summaries()
        first = parts[0][0]
        read = self._joined_read(parts)
        with self._lock:  # one reading of what was served (the producer thread adds to it)
            step, rows, real = self.step, self.rows, self.real_tokens
            tokens, docs = self.tokens.copy(), self.docs_emitted.copy()
        total = int(tokens.sum())
        streams = {
            n: replace(read[n], tokens=int(tokens[i]), docs=int(docs[i]),
                       realized_share=float(tokens[i] / total) if total else 0.0)
            for i, n in enumerate(self.names)
        }  # fmt: skip
        L = self.cfg.seq_len
        return replace(
            first,
            steps=step,
            rows=rows,
            global_batch_size=self.cfg.global_batch_size,
            real_tokens=real,
            packing_efficiency=real / (rows * L) if rows else 0.0,
            streams=streams,
            exhausted=[f"lane {k}: {line}" for k, (p, _) in enumerate(parts) for line in p.exhausted],
            elapsed_s=max(p.elapsed_s for p, _ in parts),
            tokenizer_backend={b: sum(p.tokenizer_backend[b] for p, _ in parts)
                               for b in first.tokenizer_backend},  # fmt: skip
            first_reads=min((p.first_reads for p, _ in parts),
                            key=lambda r: r.block_at if r.block_at is not None else float("inf")),
        )  # fmt: skip
