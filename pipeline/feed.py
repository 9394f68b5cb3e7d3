"""The feed: one deterministic global row sequence, cut into global steps of G rows.

    per-stream documents (DocSource: Ray Data read+tokenize; WindowShuffle)
        -> deficit mixer + packer (concat | bfd)
        -> global step s = G rows, an Arrow record batch
        -> rank r of W gets rows [r*G/W, (r+1)*G/W) of step s

The global sequence never depends on the world size; only the slicing does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa

from pipeline.config import Config
from pipeline.read.formats import is_pretokenized
from pipeline.read.reading import Executor, iter_blocks_ray
from pipeline.stages.documents import DocSource, Reject
from pipeline.stages.mixing import DeficitMixer
from pipeline.stages.packing import Row, make_packer
from pipeline.stages.shuffle import WindowShuffle
from pipeline.state.resume import (
    CONFIG_HASH,
    DOCS_EMITTED,
    FEED,
    FINISHED,
    PACKER,
    REAL_TOKENS,
    ROWS,
    STATE_VERSION,
    STEP,
    VERSION,
    Kept,
    check_state,
    seal,
)
from pipeline.state.summary import RunSummary, RunTotals, run_totals, summarize
from pipeline.tokenize.engines import load_in_background, load_tokenizer
from wire.lane_rows import rank_meta, rank_rows, runs_of
from wire.schema import StepChunk, build_batches, build_chunk, with_metadata

S = TypeVar("S")  # a state as `StepFeed._steps` takes it: a dict, or kept


@dataclass(frozen=True)
class LeaveOut:
    """Documents a run leaves out from a step on: ids per stream (`doc_id`, see
    pipeline/inspect/provenance.py) and why, for the state's log ("--skip-steps 41230-41240").

    The rule: they are dropped where they leave the shuffle, in every epoch; every other
    document enters the packer in the order it would have. Rows change from there (the
    packer fills them with the others), the mixture stays exact, and the run stays a pure
    function of its state, which carries them."""

    docs: dict[str, frozenset[int]]
    why: str


class StepFeed:
    """The global step sequence of a config. `executor` reads and tokenizes: Ray Data
    (`reading.iter_blocks_ray`, the default) or this process (`reading.iter_blocks_local`);
    `first_executor`, if given, makes each stream's first read instead (e.g.
    `reading.with_head_start`: this process tokenizes until the workers deliver)."""

    def __init__(
        self,
        cfg: Config,
        executor: Executor = iter_blocks_ray,
        first_executor: Executor | None = None,
        *,
        on_reject: Callable[[Reject], None] | None = None,
        state: dict | None = None,
        allow_config_change: bool = False,
        lane: int | None = None,
        leave_out: LeaveOut | None = None,
    ):
        """With `cfg.lanes` K > 1 this is lane `lane`: its share of every stream and its
        G/K rows of every step (pipeline/lanes/feed.py joins the lanes into global steps).
        `leave_out`: documents to leave out from this step on (a resume's `--skip-steps`,
        `--skip-docs`), added to those the state already leaves out."""
        if lane is None:
            if cfg.lanes > 1:
                raise ValueError(
                    f"the config has lanes: {cfg.lanes}: its steps are made by "
                    "pipeline.lanes.LanedFeed (a StepFeed is one lane: pass lane=k)"
                )
            lane = 0
        if not 0 <= lane < cfg.lanes:
            raise ValueError(f"lane {lane} of {cfg.lanes}")
        self.cfg = cfg
        self.lane = lane
        self.step_rows = cfg.global_batch_size // cfg.lanes
        self.names = list(cfg.streams)
        self.rejects: list[Reject] = []
        self.config_hash = cfg.config_hash()
        sink = on_reject or self.rejects.append
        self.streams = [DocSource(n, i, cfg, executor, sink, first_executor, lane)
                        for i, n in enumerate(self.names)]  # fmt: skip
        shuffled = {s.name: WindowShuffle(s, cfg.shuffle.window, cfg.seed, s.salt)
                    for s in self.streams}  # fmt: skip
        weights = {n: s.weight for n, s in cfg.streams.items()}
        self.mixer = DeficitMixer(self.names, weights, cfg.mixing.on_exhausted)
        for entry in cfg.schedule:
            self.mixer.schedule(entry.step, entry.weights, source="schedule")
        self.packer = make_packer(cfg.packing.mode, cfg.seq_len, cfg.packing.overflow, shuffled,
                                  self.mixer, cfg.packing.buffer, ramp_rows=self.step_rows)  # fmt: skip
        self._tokenizer = _tokenizer(
            cfg, getattr(first_executor or executor, "tokenizes_here", True)
        )
        # False: steps in the compact layout (wire/layout.py), as the export writes them.
        self.full_batches = True
        self.step = 0
        self.rows = 0
        self.real_tokens = 0
        self.docs_emitted = np.zeros(len(self.names), dtype=np.int64)
        self.started = time.monotonic()
        self.first_step_at: float | None = None
        self.finished = False
        if state is not None:
            state = check_state(state, self.config_hash, self.names, allow_config_change,
                                cfg.packing.mode, self.step_rows)  # fmt: skip
            self.set_state(state)
        if leave_out is not None:
            self.packer.leave_out(leave_out.docs, self.step, leave_out.why)
        for s in self.streams:
            s.start()  # every stream's reading begins now, concurrently
        self.packer.replay()  # a resume's held documents (a changed source fails here)

    @property
    def pad_id(self) -> int:
        return self._tokenizer.result().pad_id

    # -- resumable state (pipeline/stages/stage.py) -------------------------------------------------

    def get_state(self) -> dict:
        """The state as of now: a resumed feed produces step `state["step"]` next.

        Small JSON: the packer's state (which nests the mixer's and, per stream, the shuffle
        window's and the read position's) and the feed's counters. Never tokens.
        """
        return seal(self._state_body())

    def kept_state(self) -> Kept:
        """`get_state`, kept (the batch server keeps one for every recent step; a lane sends
        one with each step)."""
        return Kept.seal(self._state_body())

    def _state_body(self) -> dict:
        return {
            VERSION: STATE_VERSION,
            CONFIG_HASH: self.config_hash,
            STEP: self.step,
            PACKER: self.packer.get_state(),
            FEED: {
                ROWS: self.rows,
                REAL_TOKENS: self.real_tokens,
                DOCS_EMITTED: dict(zip(self.names, self.docs_emitted.tolist(), strict=True)),
                FINISHED: self.finished,
            },
        }

    def set_state(self, state: dict) -> None:
        """Resume from a state checked by `states.check_state` (of this version). With a
        changed config (`allow_config_change`), the config's weights take over from the resume
        step, recorded in the mixture history; streams it adds start from their beginning."""
        self.packer.set_state(state[PACKER])
        f = state[FEED]
        self.step = int(state[STEP])
        self.rows, self.real_tokens = int(f[ROWS]), int(f[REAL_TOKENS])
        emitted = f[DOCS_EMITTED]
        self.docs_emitted = np.array([emitted.get(n, 0) for n in self.names], dtype=np.int64)
        self.finished = bool(f[FINISHED])
        if state[CONFIG_HASH] != self.config_hash:
            weights = {n: s.weight for n, s in self.cfg.streams.items()}
            self.mixer.schedule(self.step, weights, "resume")

    def __iter__(self) -> StepFeed:
        return self

    def __next__(self) -> pa.RecordBatch:
        batch = self.next_step()
        if batch is None:
            raise StopIteration
        return batch

    def next_step(self) -> pa.RecordBatch | None:
        """The next global step (G rows; the last may be short), or None when the data ends."""
        made = self.steps(1)
        return made[0][0] if made else None

    def steps(self, n: int, state_every: int = 0) -> list[tuple[pa.RecordBatch, dict | None]]:
        """Up to `n` next steps (fewer when the data ends), each with the state after it when
        its number of done steps is a multiple of `state_every`. The steps' rows are packed
        one step at a time (the mixer begins each) and assembled in one pass
        (wire/schema.py `build_batches`): the same batches as `n` calls of `next_step`."""
        return self._steps(n, state_every, self.get_state)

    def kept_steps(self, n: int, state_every: int) -> list[tuple[pa.RecordBatch, Kept | None]]:
        """`steps`, each state kept (`kept_state`: what a lane sends)."""
        return self._steps(n, state_every, self.kept_state)

    def kept_chunk(self, n: int, state_every: int) -> tuple[StepChunk | None, list[Kept | None]]:
        """`kept_steps`, the steps' rows in one record batch (wire/schema.py `StepChunk`: what
        a lane that holds its steps keeps), and their kept states; None when the data ended
        before the first."""
        rows, states = self._packed(n, state_every, self.kept_state)
        if not rows:
            return None, []
        chunk = build_chunk(rows, self.cfg.seq_len, self.pad_id, self.names, self.full_batches,
                            self.step - len(rows), self._meta())  # fmt: skip
        return chunk, states

    def _steps(self, n: int, state_every: int, state: Callable[[], S]
               ) -> list[tuple[pa.RecordBatch, S | None]]:  # fmt: skip
        rows, states = self._packed(n, state_every, state)
        if not rows:
            return []
        first = self.step - len(rows)
        batches = build_batches(rows, self.cfg.seq_len, self.pad_id, self.names,
                                self.full_batches)  # fmt: skip
        meta = self._meta()
        return [(with_metadata(b, global_step=first + i, **meta), st)
                for i, (b, st) in enumerate(zip(batches, states, strict=True))]  # fmt: skip

    def _packed(self, n: int, state_every: int, state: Callable[[], S]
                ) -> tuple[list[list[Row]], list[S | None]]:  # fmt: skip
        """Up to `n` next steps' rows, packed one step at a time, each with the state after it
        when its number of done steps is a multiple of `state_every`."""
        rows: list[list[Row]] = []
        states: list[S | None] = []
        for _ in range(n):
            step_rows = self._step_rows()
            if step_rows is None:
                break
            rows.append(step_rows)
            states.append(state() if state_every and self.step % state_every == 0 else None)
        return rows, states

    def _meta(self) -> dict:
        """Every step's metadata but its `global_step`."""
        return {"seq_len": self.cfg.seq_len, "config_hash": self.config_hash,
                **({} if self.full_batches else {"layout": "compact"})}  # fmt: skip

    def _step_rows(self) -> list[Row] | None:
        """The next step's rows, packed and counted (the step is then done), or None when the
        data ends."""
        if self.finished:
            return None
        G = self.step_rows
        self.mixer.begin_step(self.step)
        rows: list[Row] = []
        while len(rows) < G:
            row = self.packer.next_row()
            if row is None:
                break
            rows.append(row)
        if len(rows) < G:
            self.finished = True
            if not rows or self.cfg.drop_last:
                return None
        for row in rows:
            for seg in row:
                self.real_tokens += seg.length
                if seg.offset == 0:
                    self.docs_emitted[seg.doc.stream] += 1
        self.rows += len(rows)
        self.step += 1
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        return rows

    def set_weights(self, weights: dict[str, float], effective_step: int | None = None,
                    source: str = "api", wait: bool = True) -> int:  # fmt: skip
        """New target weights from global step `effective_step` (default: the next step to be
        produced). Never retroactive; recorded in the mixture history with `source` (who
        asked: "api", or "policy" for mixing.policy). Returns the step. (`wait`: lanes only;
        here the change is made at once.)"""
        step = self.step if effective_step is None else int(effective_step)
        if step < self.step:
            raise ValueError(
                f"effective step {step} is already produced (next step is {self.step})"
            )
        return self.mixer.schedule(step, weights, source=source)

    def close(self) -> None:
        """Stop all reading (background Ray Data executions). The feed is done after this."""
        for s in self.streams:
            s.close()

    # -- StepSource: what only lanes do, nothing here (this process makes every row) --------
    hold = False
    ranks_behind = False
    key: str | None = None
    waited_s: float | None = None
    depth: int | None = None

    @property
    def restarted(self) -> list[dict]:
        return []

    def release(self, below: int) -> None:
        pass

    def check_placed(self) -> None:
        pass

    def check_lane(self, lane: int) -> None:
        pass

    def stop_reading(self) -> None:
        self.close()

    def lane_view(self) -> list[dict] | None:
        return None

    def summary(self) -> RunSummary:
        return summarize(self)

    def totals(self) -> RunTotals:
        """What was served so far (since step 0, across resumes)."""
        return run_totals(self)


def rank_slice(
    batch: pa.RecordBatch,
    rank: int,
    world_size: int,
    global_batch_size: int,
    own_buffers: bool = True,
) -> pa.RecordBatch:
    """Rank `rank`'s rows of a global step; world-size independent global order.

    `own_buffers=False` gives a zero-copy view, which still holds the whole step's buffers:
    for a writer or `to_ipc`, which take only its rows. Pickled, a view carried them all
    (527 KB instead of 67 KB per rank of a 16 x 2048 step), hence the copy by default."""
    rows = rank_rows(batch.num_rows, rank, world_size, global_batch_size)
    part = batch.slice(rows.start, rows.stop - rows.start)
    part = pa.concat_batches([part]) if own_buffers and world_size > 1 else part
    return part.replace_schema_metadata(rank_meta(batch, rank, world_size))


def rank_runs(
    batches: list[pa.RecordBatch], rank: int, world_size: int, global_batch_size: int
) -> list[tuple[pa.RecordBatch, int]]:
    """Rank `rank`'s rows of consecutive global steps, joined into runs of one schema
    (wire/lane_rows.py `runs_of`): what a rank gets in one answer of the batch service."""
    parts = []
    for batch in batches:
        rows = rank_rows(batch.num_rows, rank, world_size, global_batch_size)
        parts.append(batch.slice(rows.start, rows.stop - rows.start))
    return runs_of(parts, rank, world_size)


class StepSource(Protocol):
    """What makes global steps, behind one interface: a `StepFeed` (this process makes every row)
    or a `LanedFeed` (pipeline/lanes/feed.py: K lanes make them; with `hold` the lanes keep
    the rows and ranks take them from there). The batch server, its producer and `export` use
    a source only through this, never asking which one it is. What only lanes do is a no-op
    (or None) on a `StepFeed`."""

    step: int  # the next global step to make
    rows: int  # rows made so far
    real_tokens: int  # real tokens made so far
    mixer: DeficitMixer  # the mixture: its weights, scheduled and realized
    config_hash: str
    hold: bool  # steps are LanedSteps whose rows stay in the lanes until `release`
    ranks_behind: bool  # the ranks set the pace (the lanes may make ahead); set by the server

    @property
    def key(self) -> str | None: ...  # the name ranks fetch held rows by; None: no lanes

    @property
    def waited_s(self) -> float | None: ...  # the producer's wait on lanes; None: no lanes

    @property
    def depth(self) -> int | None: ...  # chunks asked of the lanes ahead; None: no lanes

    def next_step(self) -> Any: ...  # a RecordBatch, a LanedStep (`hold`), or None at the end

    def steps(self, n: int, state_every: int = 0) -> list[tuple[Any, dict | None]]: ...

    def get_state(self) -> dict: ...

    def kept_state(self) -> Any: ...  # the state after the last step, sealed lazily

    def set_weights(self, weights: dict[str, float], effective_step: int | None = None,
                    source: str = "api", wait: bool = True) -> int: ...  # fmt: skip

    @property
    def restarted(self) -> list[dict]: ...  # lanes started again after their process died

    def release(self, below: int) -> None: ...  # held steps before `below` are taken

    def check_placed(self) -> None: ...  # a lane started again is placed, or fails naming it

    def check_lane(self, lane: int) -> None: ...  # a rank met `lane` gone: start it again

    def stop_reading(self) -> None: ...  # a source a skip replaced: its held steps stay

    def lane_view(self) -> list[dict] | None: ...  # where each lane runs (metrics `lanes`)

    def summary(self) -> RunSummary: ...

    def totals(self) -> RunTotals: ...

    def close(self) -> None: ...


def _tokenizer(cfg: Config, here: bool) -> Future:
    """The config's tokenizer, for this process: at once where this process tokenizes (its
    errors are then the constructor's), with the chat glue copy started beside (~0.45 s for
    cl100k, which the first chat unit would otherwise wait for); else on a thread (~0.6 s):
    a feed whose warm pool makes every unit needs only the pad id, at its first step."""
    if not here:
        return load_in_background(cfg.tokenizer)  # the first step raises its error
    done: Future = Future()
    tok = load_tokenizer(cfg.tokenizer)
    if any(s.kind == "chat" and not is_pretokenized(s.format or "", s.tokens_field)
           for s in cfg.streams.values()):  # fmt: skip
        tok.glue_in_background()
    done.set_result(tok)
    return done
