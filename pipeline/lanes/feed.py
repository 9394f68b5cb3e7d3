"""The control's side of lanes: `LanedFeed`, the global steps of a config with `lanes` K > 1,
joined from K lane feeds (lanes/worker.py) that it asks ahead, a chunk of steps at a time.
Which steps it asks and when is a `ChunkPlan` (lanes/chunks.py); the lanes themselves,
started, called and started again when one's process dies, are a `LaneGroup` (lanes/group.py).
What is left here: the lanes' calls, and their answers joined into global steps."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import Config, normalize_weights
from pipeline.feed import LeaveOut
from pipeline.lanes.chunks import Chunk, ChunkPlan
from pipeline.lanes.depth import had_cores
from pipeline.lanes.figures import joined_read, joined_summary
from pipeline.lanes.group import LaneGroup
from pipeline.lanes.handles import LocalLane
from pipeline.lanes.restart import Sent
from pipeline.lanes.steps import LanedStep, LaneMade, Receipt, Writes, served_counts
from pipeline.stages.documents import Reject
from pipeline.stages.mixing import DeficitMixer
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
from pipeline.state.summary import RunSummary, RunTotals, totals_of
from wire.arrays import from_ipc
from wire.lane_rows import join_parts


def served_before(parts: list[dict | None], names: list[str]
                  ) -> tuple[int, int, np.ndarray, np.ndarray]:  # fmt: skip
    """What the lanes had served at their states `parts` (None: nothing, a start): rows, real
    tokens, and per stream (in `names` order) the tokens placed and the documents started."""
    rows = real_tokens = 0
    tokens = np.zeros(len(names), dtype=np.int64)
    docs = np.zeros(len(names), dtype=np.int64)
    for part in parts:
        if part is None:
            continue
        f = part[FEED]
        rows += int(f[ROWS])
        real_tokens += int(f[REAL_TOKENS])
        placed = part[PACKER]["mixer"]["placed"]
        for i, n in enumerate(names):
            docs[i] += int(f[DOCS_EMITTED].get(n, 0))
            tokens[i] += int(placed.get(n, 0))
    return rows, real_tokens, tokens, docs


def held_counts(made: list[LaneMade]) -> tuple[tuple[LaneMade, ...], list[list[int]], list]:
    """What the steps of a chunk that holding lanes answered (`made`, in lane order) count,
    summed over the lanes at once: the answers without their states (the producer keeps each
    step's nested state), each step's rows per lane, and per step its rows, real tokens, and
    per stream its tokens and documents started (as far as every lane made steps)."""
    counted = tuple(replace(lane_made, states=[]) for lane_made in made)
    m = min(len(lane_made) for lane_made in made)
    rows = np.stack([lane_made.rows[:m] for lane_made in made], axis=1).tolist()
    counts = [sum(lane_made.rows[:m] for lane_made in made),
              sum(lane_made.real_tokens[:m] for lane_made in made),
              sum(lane_made.tokens[:m] for lane_made in made),
              sum(lane_made.docs[:m] for lane_made in made)]  # fmt: skip
    return counted, rows, counts


def global_mixer(cfg: Config, step: int, part: dict | None, changed: bool) -> DeficitMixer:
    """The global mixture's bookkeeping (it never mixes: the lanes do): the config's weights and
    schedule, and at a resume (`part`, lane 0's state: every lane holds the same changes) the
    changes made so far, then the config's weights from `step` where the config `changed`."""
    weights = {n: s.weight for n, s in cfg.streams.items()}
    mixer = DeficitMixer(list(cfg.streams), weights, cfg.mixing.on_exhausted)
    for entry in cfg.schedule:
        mixer.schedule(entry.step, entry.weights, source="schedule")
    if part is not None:
        mixer.set_state(part[PACKER]["mixer"])
        if changed:
            mixer.schedule(step, weights, "resume")
    return mixer


class LanedFeed:
    """The global steps of a config with `lanes` K > 1, joined from K lane feeds.

    The face an export and the batch server use of a `StepFeed`: `next_step`, `get_state` (at
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
        self.names = list(cfg.streams)
        self.config_hash = cfg.config_hash()
        self.full_batches = full_batches
        self.state_every = state_every
        K = cfg.lanes
        parts, self.step = self._resumed(state, allow_config_change)
        # What was served since step 0: rows, real tokens, per stream tokens and documents.
        self.rows, self.real_tokens, self.tokens, self.docs_emitted = served_before(
            parts, self.names
        )
        self.key = uuid.uuid4().hex  # what a rank's reply names this feed's lanes by (`where`)
        # The seconds `next_step` waited for the lanes' answers (metrics `lanes_waited_s`):
        # a step waits for its slowest lane, the one whose making time keeps pace.
        self.waited_s = 0.0
        self.rejects: list[Reject] = []
        self.on_reject = on_reject
        # The batch server calls set_weights from its control thread while its producer
        # thread makes steps: the lock orders the lanes' calls and guards the bookkeeping.
        self._lock = threading.RLock()
        # The global mixture's bookkeeping (never mixes): the same changes as every lane's
        # mixer, and `placed` what was served, so `scheduled_weights` and `realized` answer
        # here without asking the lanes.
        self.mixer = global_mixer(cfg, self.step, parts[0], state is not None
                                  and state[CONFIG_HASH] != self.config_hash)  # fmt: skip
        self.mixer.placed = self.tokens
        self.mixer.begin_step(self.step)
        self.finished = False
        self._ready: collections.deque = collections.deque()
        self.plan = ChunkPlan(cfg, self.step)  # nothing asked of the lanes yet
        # Lanes make steps in the compact layout when this feed does; a step whose lanes
        # differ in layout (one kept labels it could not derive) is joined in full, then
        # compacted again (`_join`). Documents to leave out go to every lane: each meets only
        # its own.
        cfg_json = cfg.model_dump(mode="json", context={"reveal_secrets": True})
        args = [(cfg_json, k, parts[k], allow_config_change, full_batches, local, not local,
                 leave_out, self.hold, self.writes) for k in range(K)]  # fmt: skip
        # A holding lane whose process died is started again from its state at the oldest
        # step it held, up to `restarts` times per lane (service.lane_restarts): the steps it
        # made are made again, the same (lanes/restart.py). `wait_for_figures` False (the
        # batch server): `summary` answers with the lanes' last summaries and asks again in
        # the background, so a metrics call never waits on a lane busy making steps (what was
        # served is counted here, always current; what was read lags one call).
        self.group = LaneGroup(cfg, args, local=local, hold=self.hold, restarts=restarts,
                               state_every=state_every, lock=self._lock,
                               in_flight=self._in_flight,
                               wait_for_figures=wait_for_figures)  # fmt: skip
        # The state after the last step handed out; at the start, the lanes' own.
        self._state: Nested | None = self._first_state() if state_every else None
        self.first_step_at: float | None = None

    def _resumed(self, state: dict | None, allow_config_change: bool
                 ) -> tuple[list[dict | None], int]:  # fmt: skip
        """Each lane's part of a resumed run's `state` (checked against this config), and the
        step it resumes at; at a start, no parts and step 0."""
        cfg = self.cfg
        if state is None:
            return [None] * cfg.lanes, 0
        parts = check_laned_state(state, self.config_hash, self.names, allow_config_change,
                                  cfg.packing.mode, cfg.lanes, cfg.global_batch_size)  # fmt: skip
        return list(parts), int(state[STEP])

    def _first_state(self) -> Nested:
        """The lanes' states at the start (or the resumed step), nested and kept for a
        restart; a lane that fails to answer closes the feed first."""
        try:
            states = [self.group.ask(k, "state") for k in range(self.cfg.lanes)]
        except BaseException:
            self.close()  # no lane is left waiting to be placed, or holding its reads
            raise
        self.group.restarts.keep(self.step, states)
        return self._nest(states)

    def _in_flight(self) -> tuple[list[Chunk], int, list[tuple[int, list]]]:
        """Under the lock, for a restart: the chunks asked and not yet joined, the first step
        no lane has begun, and the weight changes the lanes have yet to confirm."""
        return self.plan.in_flight(), self.plan.asked, self.plan.changes

    @property
    def depth(self) -> int:
        """Chunks asked ahead of the one joined (metrics `lanes_chunks_ahead`)."""
        return self.plan.depth

    @property
    def ranks_behind(self) -> bool:
        """Whether the ranks set the pace (the batch server's: `ChunkPlan.ranks_behind`)."""
        return self.plan.ranks_behind

    @ranks_behind.setter
    def ranks_behind(self, behind: bool) -> None:
        self.plan.ranks_behind = behind

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

    def steps(self, n: int, state_every: int = 0) -> list[tuple[Any, dict | None]]:
        """Up to `n` steps, each with the state after it when its number of done steps is a
        multiple of `state_every` (the state a resumed run needs to continue right after)."""
        out: list[tuple[Any, dict | None]] = []
        for _ in range(n):
            batch = self.next_step()
            if batch is None:
                break
            state = self.get_state() if state_every and self.step % state_every == 0 else None
            out.append((batch, state))
        return out

    def release(self, below: int) -> None:
        """Every rank has taken the steps before `below` from the lanes (hold): the lanes may
        let them go, told with the next steps asked of them, or alone once the data has ended
        (`_release_alone`)."""
        with self._lock:
            self.plan.release = max(below, self.plan.release or 0)
            if self.finished and self.hold:
                self._release_alone()

    def _release_alone(self) -> None:
        """Under the lock: the steps every rank has, told the lanes in a call of its own when
        one is due (`ChunkPlan.release_alone`), and forgotten by the restarts."""
        if isinstance(self.lanes[0], LocalLane):
            return
        below = self.plan.release_alone()
        if below is None:
            return
        self.group.restarts.forget_below(below)
        for lane in self.lanes:
            lane.call("steps", 0, 0, below)  # answered by nobody: a release only

    def _ask(self) -> Chunk | None:
        # Under the lock: a weight change submitted to the lanes is ordered before or after
        # the whole chunk in every lane (an actor runs one caller's calls in order).
        with self._lock:
            n = self.plan.room(self.step)
            if n <= 0:
                return None
            first, release = self.plan.take(n)
            if release is not None:  # every rank has the steps before it: so do the restarts
                self.group.restarts.forget_below(release)
            calls = [lane.call("steps", n, self.state_every, release) for lane in self.lanes]
            return Chunk(first, n, calls)

    def _fill(self) -> None:
        plan = self.plan
        with self._lock:  # a restart (`restart`) re-asks every chunk not yet joined
            chunk = plan.current = plan.pending.popleft() if plan.pending else self._ask()
        assert chunk is not None  # nothing pending and nothing ready: the step made is asked
        n = chunk.n
        made_already = self.hold and self.group.made(chunk.calls)
        t = time.monotonic()
        answers = [self.group.answer_of(chunk.calls, k) for k in range(len(self.lanes))]
        self.waited_s += time.monotonic() - t
        with self._lock:
            plan.current = None
        if self.group.restarts.remade:
            self.group.check_remade()
        if self.hold:  # the depth follows holding lanes (LaneMade carries their making time)
            cored, self.group.making = had_cores(self.group.making, [made for made, _ in answers])
            plan.follow(waited=not made_already and cored)
            for k, (lane_made, _) in enumerate(answers):
                if len(lane_made):
                    self.group.last[k] = lane_made
        self._confirm_changes()
        self._ask_ahead()
        for _, rejects in answers:
            for reject in rejects:
                if self.on_reject is not None:
                    self.on_reject(reject)
                else:
                    self.rejects.append(reject)
        self._join(n, [steps for steps, _ in answers])

    def _ask_ahead(self) -> None:
        """The next chunks, asked up to the depth: made while the one in hand is joined and
        written (actors only)."""
        asked = False
        while not isinstance(self.lanes[0], LocalLane) and self.plan.wants_more():
            with self._lock:  # asked and pending at once, for a restart to find
                ahead = self._ask()
                if ahead is None:  # the mixing policy's next decision comes first
                    break
                self.plan.pending.append(ahead)
                asked = True
        if self.hold and not asked:  # the depth falling back: the releases go alone
            with self._lock:
                self._release_alone()

    def _join(self, n: int, made: list) -> None:
        """A chunk's `n` steps, from each lane's answer in `made`, onto the steps ready to hand
        out, each with its state (nested) where the lanes gave one; the data ends at the first
        step a lane lacks, or at a short one."""
        per_lane = self.cfg.global_batch_size // self.cfg.lanes
        if self.hold:
            counted, rows, counts = held_counts(made)
        for j in range(n):
            if any(len(steps) <= j for steps in made):
                self.finished = True  # a lane has no step here: the sequence ends before it
                return
            if self.hold:
                states = [lane_made.states[j] for lane_made in made]
                step = self.step + len(self._ready)  # the steps before it are ready
                if self.group.restarts.limit:
                    with self._lock:
                        self.group.restarts.keep(step + 1, states)
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

    # -- the lanes (lanes/group.py) -------------------------------------------------------------

    @property
    def lanes(self) -> list:
        return self.group.lanes

    @property
    def handles(self) -> list:
        """Where ranks take a held step's rows: each lane's actor, as it is now."""
        return self.group.handles

    @property
    def restarted(self) -> list[dict]:
        """Each restart (metrics `lanes_restarted`): lanes/restart.py `Restarts.log`."""
        return self.group.restarts.log

    def joined(self, step: LanedStep, timeout_s: float = 120.0) -> pa.RecordBatch:
        """Held step `step`, joined whole from its lanes' parts (an export's step whose rows
        this process writes: a rank spanning lanes, a short last step)."""
        return self.group.joined(step, timeout_s)

    def check_lane(self, k: int, timeout_s: float = 10.0) -> None:
        """A rank met lane k's actor dead: restarted here if it is (LaneGroup `check_lane`)."""
        self.group.check_lane(k, timeout_s)

    def check_placed(self) -> None:
        """Fails the feed (LaneError) if a lane started again was not placed in time (the batch
        server's producer asks this while it waits for room, not for the lanes)."""
        self.group.check_placed()

    def _confirm_changes(self) -> None:
        """Weight changes set without waiting (`set_weights(wait=False)`) that every lane has
        answered: each must have taken it at its step; a lane that failed fails the feed."""
        changes = self.plan.changes
        while changes:
            step, calls = changes[0]
            if not all(lane.ready(c) for lane, c in zip(self.lanes, calls, strict=True)):
                return
            for k in range(len(calls)):
                got = self.group.answer_of(calls, k)
                assert got == step, (got, step)
            changes.pop(0)

    def lane_view(self) -> list[dict]:
        """Each lane's process, restarts and held steps (metrics `lanes`; LaneGroup `view`)."""
        return self.group.view()

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
        step = self.plan.asked if effective_step is None else int(effective_step)
        if step < self.step:
            raise ValueError(
                f"effective step {step} is already produced (next step is {self.step})"
            )
        normalize_weights(weights, self.names)  # refused here, before any lane changes
        with self._lock:  # the producer thread asks for chunks (`_ask`) meanwhile
            step = max(step, self.plan.asked)
            calls = [lane.call("set_weights", weights, step, source) for lane in self.lanes]
            self.mixer.schedule(step, weights, source=source)
            # After the steps asked so far, for a restart to send again.
            self.group.restarts.note(Sent(self.plan.asked, step, dict(weights), source, calls))
            if not wait:
                self.plan.changes.append((step, calls))
        if wait:
            got = [self.group.answer_of(calls, k) for k in range(len(calls))]
            assert set(got) == {step}, got
        with self._lock:
            if step == self.step == self.plan.asked and self._state is not None:
                # Before its step is begun (the mixing policy's decisions): the state at it
                # holds the change, as a single feed's would, so a replay from it agrees.
                states = [self.group.ask(k, "state") for k in range(len(self.lanes))]
                self._state = self._nest(states)
                self.group.restarts.keep(self.step, states)
        return step

    def close(self) -> None:
        self.group.close()

    def stop_reading(self) -> None:
        """Stop the lanes' reads and making, and keep the lanes (and the rows they hold) until
        `close`: a skip replaced this feed while ranks may still fetch its steps. A lane that
        dies from here on is not started again (it would make this feed's steps again)."""
        self.group.stop_reading()

    # -- figures ----------------------------------------------------------------------------

    def totals(self) -> RunTotals:
        """What was served so far (since step 0, across resumes)."""
        read = joined_read(self.names, self.group.summaries())
        return totals_of(self.step, self.rows, self.real_tokens, self.cfg.seq_len, self.names,
                         self.tokens, self.docs_emitted, [read[n].skipped for n in self.names])  # fmt: skip

    def summary(self) -> RunSummary:
        """The run's summary: what was served counted here, what was read summed over the
        lanes (they read ahead of what was served), the mixture as lane 0 records it (every
        lane holds the same changes)."""
        parts = self.group.summaries()
        with self._lock:  # one reading of what was served (the producer thread adds to it)
            step, rows, real = self.step, self.rows, self.real_tokens
            tokens, docs = self.tokens.copy(), self.docs_emitted.copy()
        return joined_summary(self.names, parts, self.cfg.seq_len, self.cfg.global_batch_size,
                              step, rows, real, tokens, docs)  # fmt: skip
