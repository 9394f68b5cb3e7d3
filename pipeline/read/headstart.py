"""A head start: the feed's own process tokenizes until the Ray workers deliver.

A fresh export waits for Ray before its workers tokenize anything: `ray.init` (cold), a
worker process per CPU for the new job, Ray Data's executor and its helper actors, and each
worker's imports and tokenizer. On this 2-core machine that was 9-19 s cold and 3-5 s warm,
most of a ~100 MB export, with the feed idle. Here the feed's process tokenizes meanwhile:

- a **local** thread claims units one at a time from the front, so the first step comes
  from it within a second of the feed's start;
- the **executor** (Ray Data) first claims a few units from the *back* of the list, whose
  blocks are needed last: its slow start never holds up a step. Once its first block
  arrives (its workers are up), the local thread stops claiming, and the executor claims
  runs of units from the front of what is left, two runs in flight so the workers never
  wait for the next execution to start;
- blocks are handed out strictly in unit order, whoever made them;
- once Ray is up, the executor starts only if the local thread, at its pace so far, would
  not make everything left before the executor's first block could come (its `startup_s`:
  Ray Data's fresh workers ~4 s here, a warm pool ~1 s); otherwise it waits and looks again.
  (A cold export whose Ray came up 7 s in, with 2 of 8 s of local work left, took 15.5-16.5 s
  instead of ~9.4 s: Ray Data's workers starting took the CPU from the feed, and delivered
  nothing it still needed.);
- a service's head start (`paced`: its consumer is paced by the ranks) also waits until the
  local thread falls behind: until the consumer has waited for blocks the local thread had
  yet to make `BEHIND_SHARE` of the last `BEHIND_WINDOW_S` seconds (of the time since its
  first block, if less) and `BEHIND_S` in all. Ranks that take fewer tokens than one thread
  makes never start it; ranks idle for an hour, then faster than one thread, start it within
  seconds. An export, which wants every core, starts it as soon as it is worth it. (With 4
  ranks at 50 ms a step on 2 cores, `python -m bench.first_steps`, the executor's start
  beside the local thread, Ray Data's imports in this process and its workers' on the same
  cores, made the ranks wait 53-58% of their first 32 steps, 12-14% of 300; paced, 8-17%
  and 2.5-3.4%.);
- when nothing is left to claim and the executor has still delivered nothing (a cold Ray's
  workers still starting), the local thread takes over the executor's back units one by one:
  whichever side makes such a unit first, its block is kept and the other is dropped.

Every unit is claimed by one side (a taken-over back unit aside), and a unit's block is the
same bytes whichever process made it: the output does not depend on the timing. (Why the
take-over: with a fast engine the local thread finished everything else of a 130 MB cold
export by 9 s, then the feed waited until 14.3 s for the two back units of Ray Data's workers,
still starting on the same two cores.)
Memory is bounded: the local thread stops claiming while `MAX_AHEAD` blocks' worth waits (in
a large unit's input bytes, the 90th percentile: small units do not stop it early), and the
executor claims a new run only when less than that waits; the back run is `BACK_UNITS` long.
(The idea of splitting one ordered input between a fast local path and remote workers that
take over once warm is the same as work stealing in any fork-join pool; here the split is
fixed by claims, never by races on the output.)
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from concurrent.futures import Future, wait

import numpy as np

from pipeline.config import StreamConfig, TokenizerConfig
from wire.arrays import view

BACK_UNITS = 2  # the executor's warm-up run, from the back
MIN_UNITS_FOR_EXECUTOR = 4  # fewer units than this: the local thread does them all
FIRST_RUN_UNITS = 4  # then runs from the front double up to MAX_RUN_UNITS
MAX_RUN_UNITS = 64
MAX_AHEAD = 8  # blocks (of a large unit's bytes) made ahead of the consumer, at most
# Seconds from an execution's start to its first block, when the executor does not say
# (`startup_s`): Ray Data's tasks in a job's fresh workers, 3-4 s on a running cluster here
# and ~7 s on a cold embedded one; the lower end, so the executor is rather started early.
EXECUTOR_STARTUP_S = 4.0
RECHECK_S = 0.5  # how often a waiting executor looks at the local thread's pace again
# The executor starts once the consumer has waited on the local thread this share of the time
# since its first block, and this many seconds in all (see module).
BEHIND_SHARE, BEHIND_S, BEHIND_WINDOW_S = 0.25, 0.5, 8.0


class HeadStart:
    """Iterate the blocks of `units` in order, made here and by `executor` (see module)."""

    def __init__(self, units, stream: StreamConfig, tok_cfg: TokenizerConfig, executor,
                 ready: Future | None, local, paced: bool = False,
                 behind_s: float = BEHIND_S):  # fmt: skip
        self.units, self.stream, self.tok_cfg = units, stream, tok_cfg
        self.executor, self.ready, self.local = executor, ready, local
        self._cond = threading.Condition()
        self._blocks: dict[int, object] = {}
        self._front, self._back = 0, len(units)  # unclaimed: [front, back)
        self._emit = 0
        self._pending: list = []  # the blocks of the unit being handed out
        self._error: BaseException | None = None
        self._stop = False
        self._warm = False  # the executor has delivered a block
        self._taken: set[int] = set()  # the executor's units this process took over
        # Input bytes (Unit.work) before each unit: what is left is a difference, at every
        # wake-up of a waiting executor (every block put) in O(1).
        self._work_before = np.concatenate([[0], np.cumsum([u.work for u in units])])
        # A unit's size for MAX_AHEAD: the 90th percentile, so that one outsized unit (a
        # piece that cannot be cut: a compressed file, a large row group) does not raise the
        # bound for all the others.
        self._largest = float(np.quantile([u.work for u in units], 0.9)) if units else 1.0
        self._local_bytes = 0  # input bytes of the units the local thread made
        self._local_since: float | None = None  # when it claimed its first
        self.startup_s = float(getattr(executor, "startup_s", EXECUTOR_STARTUP_S))
        self._runs: list = []  # executions, for close()
        self.first_local_at: float | None = None
        self.first_executor_at: float | None = None
        self.tokens = {"here": 0, "executor": 0}  # tokens of the blocks kept, per side
        # The consumer's seconds waiting for a block the local thread was yet to make, since
        # its first block (`_behind`): whether the local thread keeps up alone.
        self._waits: collections.deque[tuple[float, float]] = collections.deque()  # (end, s)
        self._first_emit_at: float | None = None
        self.paced, self.behind_s = paced, behind_s
        self._threads = [
            threading.Thread(target=self._guard, args=(f,), daemon=True, name=f"tokenmill-{n}")
            for n, f in (("head-local", self._run_local), ("head-executor", self._run_executor))
        ]
        for t in self._threads:
            t.start()

    # -- claims -----------------------------------------------------------------------------

    def _claim_front(self, n: int) -> range:
        a = self._front
        self._front = min(self._back, a + n)
        return range(a, self._front)

    def _ahead(self) -> bool:
        """Whether `MAX_AHEAD` blocks' worth waits for the consumer: counted in input bytes,
        as MAX_AHEAD of the large units (`_largest`), so that small units (the first ones,
        and the parts of the first pieces: stages/plan.py `ramp_parts`) do not stop the
        reads early."""
        waiting = sum(self.units[i].work for i in self._blocks if i >= self._emit)
        return waiting >= MAX_AHEAD * self._largest

    def _take_over(self) -> range:
        """The executor's earliest back unit not yet made, which this process then makes
        too (see module): only while the executor has delivered nothing."""
        for i in range(max(self._back, self._emit), len(self.units)):
            if i not in self._blocks and i not in self._taken:
                self._taken.add(i)
                return range(i, i + 1)
        return range(0)

    def _put(self, i: int, blocks: list, side: str) -> None:
        with self._cond:
            if i < self._emit or i in self._blocks:
                return  # a unit both sides made: the first block is kept
            self._blocks[i] = blocks
            self.tokens[side] += sum(_tokens(b) for b in blocks)
            self._cond.notify_all()

    # -- the two producers ------------------------------------------------------------------

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # carried to the consumer, never swallowed
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    def _run_local(self) -> None:
        _as_nice_as_a_worker()
        while True:
            with self._cond:
                while not self._stop and not self._warm and self._ahead():
                    self._cond.wait(0.5)
                claimed = None if self._stop or self._warm else self._claim_front(1)
                if claimed is not None and not claimed:
                    claimed = self._take_over()
            if not claimed:
                return
            i = claimed[0]
            self._local_since = self._local_since or time.monotonic()
            blocks = list(self.local([self.units[i]], self.stream, self.tok_cfg))
            self.first_local_at = self.first_local_at or time.monotonic()
            self._local_bytes += self.units[i].work
            self._put(i, blocks, "here")

    def _local_finishes_first(self) -> bool:
        """Whether the local thread, at its pace so far, makes every unclaimed unit before an
        execution started now could deliver its first block (see module). Under the lock."""
        if not self._local_bytes or self._local_since is None:
            return False  # no pace yet: start the executor
        rate = self._local_bytes / max(time.monotonic() - self._local_since, 1e-6)
        left = int(self._work_before[self._back] - self._work_before[self._front])
        return left / rate < self.startup_s

    def _behind(self) -> bool:
        """Whether the consumer waits on the local thread (see module); always, unless
        `paced`. Under the lock."""
        if not self.paced:
            return True
        if self._first_emit_at is None:
            return False  # the first block tells nothing of the pace: judged after it
        now = time.monotonic()
        while self._waits and self._waits[0][0] < now - BEHIND_WINDOW_S:
            self._waits.popleft()
        span = min(now - self._first_emit_at, BEHIND_WINDOW_S)
        waited = sum(s for _, s in self._waits)
        return waited >= max(self.behind_s, BEHIND_SHARE * span)

    def _run_executor(self) -> None:
        if self.ready is not None:
            while not self.ready.done():  # a run the local thread finished does not wait for Ray
                wait([self.ready], timeout=0.2)
                if self._stop:
                    return
            self.ready.result()  # Ray failed to come up: the run fails with its error
        with self._cond:
            while not self._stop and (self._local_finishes_first() or not self._behind()):
                self._cond.wait(RECHECK_S)
            if self._stop or self._back - self._front < MIN_UNITS_FOR_EXECUTOR:
                return
            self._back -= BACK_UNITS
            runs = self._start(range(self._back, self._back + BACK_UNITS))
        size = FIRST_RUN_UNITS
        while runs and not self._stop:
            first = True
            for _ in self._drain(*runs.pop(0)):
                if first and len(runs) < 2:  # its workers deliver: start the next run now
                    first = False
                    with self._cond:
                        while not self._stop and self._ahead():
                            self._cond.wait(0.5)
                        claimed = self._claim_front(size)
                    if claimed:
                        runs += self._start(claimed)
                        size = min(size * 2, MAX_RUN_UNITS)
            if not runs:  # claim what is left, if anything
                with self._cond:
                    claimed = self._claim_front(size)
                if claimed:
                    runs += self._start(claimed)

    def _drain(self, positions: range, blocks):
        """Deposit a run's units as their blocks come (yielding after each block).

        Blocks arrive in unit order; a unit may come in several blocks, or in none if it had
        no records. A unit is complete once a later unit's rows (or the run's end) arrive."""
        position_of = {self.units[p].index: p for p in positions}
        at = positions.start
        parts: list = []  # one unit's tables (pyarrow.Table), as `_put` takes them
        for table in blocks:
            if self._stop:
                return
            if not self._warm:
                self.first_executor_at = time.monotonic()
                with self._cond:
                    self._warm = True
                    self._cond.notify_all()
            for unit, part in _split_by_unit(table):
                p = position_of[unit]
                while at < p:
                    self._put(at, parts, "executor")
                    at, parts = at + 1, []
                parts.append(part)
            yield
        while at < positions.stop:
            self._put(at, parts, "executor")
            at, parts = at + 1, []

    def _start(self, positions: range) -> list:
        """[(positions, blocks)] of a new execution, or [] once closed: under the lock, so
        that `close` sees every execution that ever started (one started as it closed
        outlived the feed, its Ray Data execution running on)."""
        with self._cond:
            if self._stop:
                return []
            blocks = self.executor([self.units[p] for p in positions], self.stream, self.tok_cfg)
            self._runs.append(blocks)
            return [(positions, blocks)]

    # -- the consumer -----------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self):
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if self._pending:
                    return self._pending.pop(0)
                if self._emit >= len(self.units):
                    raise StopIteration
                if self._emit in self._blocks:
                    self._pending = list(self._blocks.pop(self._emit))
                    self._emit += 1
                    self._first_emit_at = self._first_emit_at or time.monotonic()
                    self._cond.notify_all()
                    continue
                t = time.monotonic()
                self._cond.wait(0.5)
                if self._first_emit_at is not None:
                    now = time.monotonic()
                    self._waits.append((now, now - t))

    def first_at(self) -> list[float | None]:
        """When the first block was made here, and when the executor's first arrived."""
        return [self.first_local_at, self.first_executor_at]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for run in list(self._runs):
            close = getattr(run, "close", None)
            if close is not None:
                # A generator mid-block (an in-process executor, tests) cannot be closed: its
                # thread sees `_stop` after that block and drops the rest.
                with contextlib.suppress(ValueError):
                    close()
        for t in self._threads:
            t.join(timeout=60)


def _tokens(table) -> int:
    return sum(len(chunk.values) for chunk in table.column("tokens").chunks)


def _split_by_unit(table):
    """(unit index, rows of that unit) for each run of equal `unit` values in a block."""
    if table.num_rows == 0:
        return []
    units = view(table.column("unit"))
    cuts = [0, *(np.flatnonzero(units[1:] != units[:-1]) + 1).tolist(), len(units)]
    return [(int(units[a]), table.slice(a, b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]


# Ray starts its workers at niceness 15 (`ray start` clusters; measured here), or at Ray's
# own setting `RAY_worker_niceness` where the environment gives one. A head-start thread at 0
# took a whole core from the workers it was waiting for: they were slow to start and to
# deliver, and the head start ran on. At the workers' level they share fairly, and the feed's
# own thread (packing, writing) keeps its priority over both.
def _worker_niceness() -> int:
    try:
        return int(os.environ.get("RAY_worker_niceness", "15"))  # noqa: SIM112 (Ray's name)
    except ValueError:
        return 15


def _as_nice_as_a_worker() -> None:
    try:  # Linux: niceness is per thread
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid),
                                                 _worker_niceness()))  # fmt: skip
    except (AttributeError, OSError):
        pass
