"""`tokenmill export`: write the batches exactly as they would be served.

One file per global step and rank, ``DIR/step-00000012-rank-0.parquet`` (or ``.arrow``), in the
batch schema (wire/schema.py); ``DIR/rejects.jsonl`` lists every skipped record; and
``DIR/summary.json`` holds the run's figures. Tokenization runs in Ray Data tasks; the feed
(mixing, packing, batch assembly) runs here, in the driver, beside the writer: its reads run
ahead on background threads, so writing a step overlaps tokenizing the next ones. (Why not a
Ray actor: in-process there is no actor to start and no batch to ship from it; the first step
of an export on a warm cluster comes ~2 s sooner.) The CLI connects to Ray on a thread while the feed
starts, and the first units are tokenized here meanwhile: see docs/performance.md.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import Config
from pipeline.feed import LeaveOut, StepFeed, rank_slice
from pipeline.lanes import PENDING, LanedFeed, LanedStep, Writes
from pipeline.read.reading import Executor, iter_blocks_local, ray_executor, with_head_start
from pipeline.state.resume import check_laned_state, check_state
from pipeline.state.summary import (
    ExportReport,
    FirstReads,
    Phases,
    RunSummary,
)
from wire.layout import LAYOUTS, compact, step_path, write_step

STEPS_PER_CALL = 4


MDS_COLUMNS = {
    "tokens": "ndarray:int32",  # input_ids up to the row's real length (LLM-Foundry's column)
    "input_ids": "ndarray:int32",
    "labels": "ndarray:int32",
    "position_ids": "ndarray:int32",
    "segment_ids": "ndarray:int32",
    "seq_lens": "ndarray:int32",
    "global_step": "int",
}


class _MdsSink:
    """All rows in global order into one MDS dataset at DIR/mds (world-size independent)."""

    def __init__(self, out: Path):
        from pipeline.read.formats.mds import require_streaming

        require_streaming()  # a clear message where the `mds` extra is not installed
        from streaming import MDSWriter

        self.writer = MDSWriter(out=str(out / "mds"), columns=MDS_COLUMNS, exist_ok=True)

    def write(self, batch: pa.RecordBatch) -> None:
        import numpy as np

        step = int(batch.schema.metadata[b"global_step"])
        n, cols = batch.num_rows, {}
        for name in ("input_ids", "labels", "position_ids", "segment_ids"):
            col = batch.column(name)
            cols[name] = col.values.to_numpy().reshape(n, col.type.list_size)
        lens = batch.column("seq_lens").to_pylist()
        for i in range(n):
            real = int(sum(lens[i]))
            self.writer.write({
                "tokens": cols["input_ids"][i, :real].copy(),
                **{k: v[i].copy() for k, v in cols.items()},
                "seq_lens": np.asarray(lens[i], dtype=np.int32),
                "global_step": step,
            })  # fmt: skip

    def close(self) -> None:
        self.writer.finish()


def process_started() -> float:
    """This process's start on the `time.monotonic()` clock (Linux: /proc; else: now).

    Every headline figure of an export counts from here, so imports and Ray's start-up are in
    it, as they are in the wall time a user measures."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # start, in ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.monotonic() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic()


class _StepFiles:
    """Writes each step's files (one per rank, or rows into the MDS dataset), the states due
    with them and the rejects, and keeps the export's counts and clock readings."""

    def __init__(self, out: Path, cfg: Config, world_size: int, fmt: str, layout: str):
        self.out, self.cfg, self.world_size, self.fmt, self.layout = (
            out,
            cfg,
            world_size,
            fmt,
            layout,
        )
        # Every file of an export has the same columns: labels are kept when a stream can mask.
        self.keep_labels = any(s.kind == "chat" for s in cfg.streams.values())
        self.mds = _MdsSink(out) if fmt == "mds" else None
        self.rejects_path = out / "rejects.jsonl"
        self._rejects = open(self.rejects_path, "w")  # noqa: SIM115 (closed in close())
        self.written = self.tokens = self.rejects_written = 0
        self.writing = 0.0  # seconds spent writing
        self.writes: Writes | None = None  # lanes write files aside: taken, or cleared at close
        self.first_at: float | None = None  # time.monotonic() of the first and last step written
        self.last_at: float | None = None

    def step(
        self, batch: pa.RecordBatch, state: dict | None, ranks: list[int] | None = None
    ) -> None:
        """A step's files (`ranks`' only, when given: the lanes wrote the others)."""
        t = time.monotonic()
        step = int(batch.schema.metadata[b"global_step"])
        if self.mds is not None:
            self.mds.write(batch)
        full = self.layout == "full" or self.mds is not None
        stored = batch if full else compact(batch, self.keep_labels)
        for r in ranks if ranks is not None else range(self.world_size if self.mds is None else 0):
            part = rank_slice(stored, r, self.world_size, self.cfg.global_batch_size)
            write_step(part, step_path(self.out, step, r, self.fmt), self.fmt)
        if state is not None:
            self._state(state)
        self.writing += time.monotonic() - t
        self.tokens += int(pc.sum(pc.list_flatten(batch.column("seq_lens"))).as_py() or 0)
        self.written += 1
        self.last_at = time.monotonic()
        self.first_at = self.first_at or self.last_at

    def from_lanes(self, made: LanedStep, state: dict | None, feed: LanedFeed) -> None:
        """A step whose lanes wrote the files of the ranks whose rows they hold (`Writes`):
        those are taken (renamed from aside), and the others written here from the whole
        step, as `step` writes them: a rank whose rows span lanes, every rank of a short last
        step, and every rank of a step whose lanes' files differ in keeping labels (one lane
        masked tokens, and `step` keeps labels in every file then)."""
        t = time.monotonic()
        per_lane = self.cfg.global_batch_size // self.cfg.lanes
        receipts = made.receipts
        usable = (
            all(r.rows == per_lane for r in receipts) and len({r.labels for r in receipts}) == 1
        )
        done: set[int] = set()
        assert self.writes is not None
        for r in receipts:
            for rank in r.written:
                pending = self.writes.pending(made.step, rank)
                if usable:
                    try:
                        os.replace(pending, step_path(self.out, made.step, rank, self.fmt))
                        done.add(rank)
                    except FileNotFoundError:  # not where this process sees it: written here
                        pass
                else:
                    pending.unlink(missing_ok=True)
        rest = [r for r in range(self.world_size) if r not in done]
        if rest:  # this process joins the step: every row of it passes here
            self.step(feed.joined(made), state, ranks=rest)  # a dead lane started again
            return
        if state is not None:
            self._state(state)
        self.writing += time.monotonic() - t
        self.tokens += sum(r.real_tokens for r in receipts)
        self.written += 1
        self.last_at = time.monotonic()
        self.first_at = self.first_at or self.last_at

    def rejects(self, feed: StepFeed | LanedFeed) -> None:
        for rej in feed.rejects:
            self._rejects.write(json.dumps(rej.as_dict()) + "\n")
        self.rejects_written += len(feed.rejects)
        feed.rejects.clear()

    def _state(self, state: dict) -> None:
        path = self.out / f"state-{state['step']:08d}.json"
        path.write_text(json.dumps(state, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._rejects.close()
        if self.mds is not None:
            self.mds.close()
        for left in self.out.glob(f"*{PENDING}*") if self.writes is not None else ():
            left.unlink(missing_ok=True)  # made ahead by the lanes, never taken


def _one_node() -> bool:
    """Does the Ray cluster this process joined have one live node (this one)?"""
    import ray

    try:
        return sum(1 for n in ray.nodes() if n.get("Alive")) == 1
    except Exception:
        return False


def _check_resume(cfg: Config, resume: dict, allow_config_change: bool) -> None:
    """A state this config can continue from (a feed's, or K lanes' with `lanes` K)."""
    if cfg.lanes == 1:
        check_state(resume, cfg.config_hash(), list(cfg.streams), allow_config_change,
                    cfg.packing.mode, cfg.global_batch_size)  # fmt: skip
    else:
        check_laned_state(resume, cfg.config_hash(), list(cfg.streams), allow_config_change,
                          cfg.packing.mode, cfg.lanes, cfg.global_batch_size)  # fmt: skip


def _open_feed(cfg: Config, executor: Executor, first: Executor | None, files: _StepFiles, *,
               resume: dict | None, allow_config_change: bool, leave_out: LeaveOut | None,
               full: bool, state_every: int,
               ray_ready: Future | None) -> tuple[StepFeed | LanedFeed, float]:  # fmt: skip
    """The export's step source, and when its production began (the steady window's start):
    one feed here (`lanes: 1`), else K lanes, each reading with Ray Data in its own actor (or
    here, with `--local`)."""
    if cfg.lanes == 1:
        feed = StepFeed(cfg, executor, first, state=resume, allow_config_change=allow_config_change,
                        leave_out=leave_out)  # fmt: skip
        feed.full_batches = full
        return feed, time.monotonic()
    local = executor is iter_blocks_local
    if not local and ray_ready is not None:
        ray_ready.result()
    # On actors, the lanes write the files of the ranks whose rows they hold (all of
    # them when K divides the world size): the writing, and every row, stay there.
    # Only where the lanes share this machine's disk: one node (a lane elsewhere
    # would write where this process cannot rename).
    writes = (Writes(str(files.out.resolve()), files.world_size, files.fmt, full, files.keep_labels)
              if not local and files.fmt != "mds" and _one_node() else None)  # fmt: skip
    files.writes = writes
    # Lanes that hold their steps (writing them) are started again when their process
    # dies, as under `serve` (service.lane_restarts): that needs their states at every
    # step (the state files keep `state_every`: `steps` asks for those only).
    restarts = cfg.service.lane_restarts if writes is not None else 0
    # The steady window opens as the lanes are started: their constructors begin
    # reading (and the first states, asked at once, wait for them).
    started = time.monotonic()
    laned = LanedFeed(cfg, local=local, state=resume, allow_config_change=allow_config_change,
                      full_batches=full, state_every=1 if restarts else state_every,
                      leave_out=leave_out, writes=writes, restarts=restarts)  # fmt: skip
    return laned, started


def run_export(
    cfg: Config,
    out: str | Path,
    steps: int | None = None,
    world_size: int = 1,
    fmt: str = "parquet",
    executor: Executor | None = None,
    progress=None,
    state_every: int = 0,
    resume: dict | None = None,
    allow_config_change: bool = False,
    layout: str = "compact",
    started: float | None = None,
    ray_ready: Future | None = None,
    leave_out: LeaveOut | None = None,
) -> RunSummary:
    """Export up to `steps` global steps (all the data when None); return the summary, with
    the export's part (`RunSummary.export`) set.

    With `state_every` K, ``DIR/state-00000012.json`` is written whenever 12 steps (a multiple
    of K) are done: resuming from it continues with step 12. With `resume`, the run continues
    from such a state and step numbers carry on from it. `layout` is `compact` or `full`
    (wire/layout.py). `started` is when the clock of the headline figures starts
    (`time.monotonic()`); by default this process's start. With `ray_ready`, Ray is still
    connecting in the background. `executor` reads and tokenizes: by default Ray Data, or a
    warm pool (pipeline/read/pool.py), with this process tokenizing until those workers deliver
    (pipeline/read/headstart.py); `reading.iter_blocks_local` makes everything in this process.
    `leave_out`: documents to leave out from the first step written on.
    """
    _check_export(cfg, world_size, layout)
    if cfg.read.ramp_parts is None:  # whole pieces: an export wants throughput (config.py)
        cfg = cfg.model_copy(update={"read": cfg.read.model_copy(update={"ramp_parts": 1})})
    started = process_started() if started is None else started
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.monotonic()
    if resume is not None:  # fail here, with a clear message, not inside the actor
        _check_resume(cfg, resume, allow_config_change)
    connected: list[float | None] = [None]
    if ray_ready is not None:
        ray_ready.add_done_callback(lambda _: connected.__setitem__(0, time.monotonic()))
    executor = executor or ray_executor(ray_ready)
    # Workers elsewhere (Ray Data, a warm pool): this process tokenizes until they deliver.
    first = None if executor is iter_blocks_local else with_head_start(executor, ray_ready)
    files = _StepFiles(out, cfg, world_size, fmt, layout)
    feed: StepFeed | LanedFeed | None = None
    full = layout == "full" or fmt == "mds"  # compact: nothing derivable
    try:
        feed, feed_started = _open_feed(cfg, executor, first, files, resume=resume,
                                        allow_config_change=allow_config_change,
                                        leave_out=leave_out, full=full,
                                        state_every=state_every, ray_ready=ray_ready)  # fmt: skip
        at_start = feed.totals()  # a resumed feed's counts start at its state's
        _write_steps(feed, files, steps, state_every, progress, started)
        summary = feed.summary()
        this_run = feed.totals().since(at_start)
    finally:
        if feed is not None:
            feed.close()  # first: no lane writes a file after this
        files.close()
    marks = {"ray_connected": connected[0], "feed_started": feed_started}
    clock = _timings(summary.first_reads, started, begun, files, marks)
    report = ExportReport(
        steps_written=files.written,
        world_size=world_size,
        format=fmt,
        layout=layout if files.mds is None else "mds",
        rejects_file=str(files.rejects_path),
        rejects_written=files.rejects_written,
        **clock,
        resumed_from_step=None if resume is None else at_start.steps,
        this_run=this_run,
    )
    summary = replace(summary, export=report)
    (out / "summary.json").write_text(
        json.dumps(summary.as_dict(), indent=2, sort_keys=True) + "\n"
    )
    # The figure printed includes writing the summary.
    return replace(summary, export=replace(report, wall_s=time.monotonic() - started))


def _check_export(cfg: Config, world_size: int, layout: str) -> None:
    """What an export refuses before it starts anything, each with what to do instead."""
    if cfg.mixing.policy is not None:
        raise ValueError(
            "mixing.policy follows the loss the trainer ranks report, and an export has no "
            "trainer: serve this config (tokenmill serve), or export it without mixing.policy"
        )
    if cfg.global_batch_size % world_size:
        raise ValueError(
            f"--world-size {world_size} does not divide global_batch_size {cfg.global_batch_size}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def _write_steps(feed: StepFeed | LanedFeed, files: _StepFiles, steps: int | None,
                 state_every: int, progress, started: float) -> None:  # fmt: skip
    """Up to `steps` steps (all when None) from `feed` into `files`, a call's worth at a time,
    the rejects after each call; `progress(steps, tokens, seconds)` after each call too."""
    while steps is None or files.written < steps:
        want = STEPS_PER_CALL if steps is None else min(STEPS_PER_CALL, steps - files.written)
        batches = feed.steps(want, state_every)
        for batch, state in batches:
            if feed.hold:  # the step's rows are in the lanes, some of its files too
                files.from_lanes(batch, state, feed)  # type: ignore[arg-type]
                feed.release(batch.step + 1)
            else:
                files.step(batch, state)
        files.rejects(feed)
        if progress:
            progress(files.written, files.tokens, time.monotonic() - started)
        if len(batches) < want:
            return


def _timings(reads: FirstReads, started, begun, files: _StepFiles, marks) -> dict:
    """The run's headline figures (ExportReport's), all on one clock from `started` (see
    process_started).

    - `wall_s`: process start to the last file written;
    - `time_to_first_step_s`: process start to the first step's files written;
    - `tokens_per_s`: real tokens / `wall_s` (end to end: imports, Ray start, everything);
    - `steady_tokens_per_s`: real tokens / (last step - the feed's start). Tokenizing begins
      when the feed starts (this process's head start, or `--local`), so the window is the
      whole production, imports, Ray's start and the tokenizer's load left out: no drain of a
      filled prefetch queue can inflate it. (Opening it at the first tokenized block would
      leave that block's tokenizing out of the window but its tokens in: ~6-8% high on the
      man pages, whose units are 8 MB.) With lanes it opens as the lanes are started
      (their constructors begin reading; their tokenizers' load falls inside);
    - `startup_s`: process start to the export's own start (imports, Ray start or connect);
    - `phases`: when each stage was first reached, in seconds from process start, and the
      time spent writing files (docs/performance.md reads the breakdown from here).
    """
    first_at, last_at, tokens = files.first_at, files.last_at, files.tokens
    end = last_at or time.monotonic()
    first_block = reads.block_at or first_at or end

    def since(t):
        return None if t is None else round(t - started, 3)

    phases = Phases(
        imports_and_config=since(begun),
        ray_connected=since(marks["ray_connected"]),
        feed_started=since(marks["feed_started"]),
        first_block_in_process=since(reads.head_at),
        first_block_from_executor=since(reads.executor_at),
        first_step_written=since(first_at),
        last_step_written=since(last_at),
        writing_s=round(files.writing, 3),
        tokens_made_here=reads.tokens_here,
        tokens_made_by_executor=reads.tokens_by_executor,
    )
    return {
        "phases": phases,
        "wall_s": time.monotonic() - started,
        "startup_s": begun - started,
        "time_to_first_step_s": (first_at - started) if first_at else None,
        "time_to_first_block_s": first_block - started,
        "tokens_per_s": tokens / max(end - started, 1e-9),
        "steady_tokens_per_s": tokens / max(end - marks["feed_started"], 1e-9),
        "elapsed_s": end - begun,
    }
