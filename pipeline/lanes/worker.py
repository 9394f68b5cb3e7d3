"""One lane's feed, in the process that runs it (a Ray actor, or the caller's for `--local`):
it makes its G/K rows of each step asked, and, holding them (the batch server), hands each
rank its rows on threads of its own until every rank has them."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import Config
from pipeline.feed import LeaveOut, StepFeed
from pipeline.lanes.steps import LaneError, LaneMade, Writes
from pipeline.read.reading import (
    Executor,
    iter_blocks_local,
    iter_blocks_ray,
    with_head_start,
)
from pipeline.read.reading import read_ahead as reading_ahead
from pipeline.stages.documents import Reject
from pipeline.state.resume import Kept
from pipeline.state.summary import RunSummary
from wire.arrays import own, to_ipc
from wire.lane_rows import lane_parts, rank_meta
from wire.layout import compact, write_step
from wire.protocol import META_RANK, META_STEP_ROWS, META_WORLD_SIZE
from wire.schema import StepChunk

TAKE_WAIT_S = 120.0  # a rank's take waits this long for a step a restarted lane makes again


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
        # A restarted lane's (LaneGroup.restart): the digest of the state after each step it
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
        self.feed = StepFeed(cfg, executor, first, state=state, leave_out=leave_out,
                         allow_config_change=allow_config_change, lane=lane)  # fmt: skip
        self.feed.full_batches = full_batches
        self.unmade = self.feed.step
        self.ipc = ipc
        self.making_s = self.making_cpu_s = 0.0  # Receipt `making_s`, `making_cpu_s`
        self.making_process_s = 0.0  # LaneMade `making_process_s`

    def steps(self, n: int, state_every: int, release_below: int | None = None,
              write: bool = True) -> tuple[list[tuple[Any, Kept | None]] | LaneMade, list[Reject]]:  # fmt: skip
        """Up to `n` next steps of this lane, each with its state when `state_every` says so,
        and the rejects met making them. Holding (`hold`): the lane keeps the steps, in one
        chunk, and answers their counts and states (LaneMade); the steps before
        `release_below` (every rank has them) are let go first. `write` False: no step file
        is written (`writes`), for steps a restarted lane makes again whose files the dead
        one wrote whole (the export may be taking them: lanes/restart.py)."""
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
        if self.writes is not None and write:
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
        `world_size`: runs of one schema (wire/lane_rows.py `runs_of`'s runs), as Arrow IPC.
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
        """This lane's part of held step `step` as it was made (Arrow IPC): `LanedStep.joined`."""
        with self._held_lock:
            chunk, j = self._held(step)
        return to_ipc(own(chunk.step(j)))

    def _held(self, step: int) -> tuple[StepChunk, int]:
        """Where held step `step` is (under `_held_lock`), or a LookupError naming what is
        held. A step this lane has yet to make is waited for, up to TAKE_WAIT_S: only a lane
        restarted from an earlier step (lanes/group.py `LaneGroup.restart`) is asked for one, while it makes
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
        """Where this lane runs: its process id, host, and Ray node (id and address: several
        nodes may share a host) (metrics `lanes`, the page, benches that pin a lane to a core)."""
        node_id = node_ip = None
        with contextlib.suppress(Exception):  # a lane made in-process (LocalLane) has no node
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
                node_ip = ray.util.get_node_ip_address()
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": node_id,
            "node_ip": node_ip,
        }

    def state(self) -> Kept:
        """The lane's state now (before its first step: where it starts), kept."""
        return self.feed.kept_state()

    def summary(self) -> tuple[RunSummary, dict[str, list[int]]]:
        """The lane's summary, and its sampled document lengths per stream (for the join)."""
        lengths = {s.name: list(s.counters.lengths) for s in self.feed.streams}
        return self.feed.summary(), lengths

    def close(self) -> None:
        self.feed.close()
