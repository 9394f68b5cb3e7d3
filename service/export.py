"""`tokenmill export`: write the batches exactly as they would be served (SPEC M12).

One file per global step and rank, ``DIR/step-00000012-rank-0.parquet`` (or ``.arrow``), in the
batch schema of SPEC §3.2; ``DIR/rejects.jsonl`` lists every skipped record; and
``DIR/summary.json`` holds the run's figures. Tokenization runs in Ray Data tasks; the feed
(mixing, packing, batch assembly) runs here, in the driver, beside the writer: its reads run
ahead on background threads, so writing a step overlaps tokenizing the next ones. (It used to
run in a Ray actor: in-process, the first step of a second export on a warm cluster came after
1.2 s instead of 3.1 s, and steady throughput rose 4.23M -> 4.78M tokens/s, with no actor to
start and no batch to ship from it.)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import Config
from pipeline.feed import FeedActor, next_steps, rank_slice
from pipeline.states import check_state

STEPS_PER_CALL = 4


def step_path(out: Path, step: int, rank: int, fmt: str) -> Path:
    ext = {"parquet": "parquet", "arrow": "arrow"}[fmt]  # mds: one dataset, see _MdsSink
    return out / f"step-{step:08d}-rank-{rank}.{ext}"


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


def _write(batch: pa.RecordBatch, path: Path, fmt: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    if fmt == "parquet":
        # No dictionary pages: token ids barely repeat within a step, so dictionary encoding
        # is wasted work (measured: 8.1M -> 13.5M tokens/s written, 2.90 -> 2.25 bytes/token).
        pq.write_table(
            pa.Table.from_batches([batch]), tmp, compression="zstd", use_dictionary=False
        )
    else:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
    os.replace(tmp, path)


class _LocalFeed(FeedActor):
    """The feed in this process; tokenizing through Ray Data (`ray=True`) or in-process too
    (`--local`: no Ray at all)."""

    def __init__(
        self, cfg: Config, state=None, allow_config_change=False, state_every=0, ray=False
    ):
        super().__init__(cfg.model_dump(mode="json"), state, allow_config_change, local=not ray)
        self.state_every = state_every

    def next_steps(self, n, prefetch=0):
        return next_steps(self.feed, n, self.state_every)


def run_export(
    cfg: Config,
    out: str | Path,
    steps: int | None = None,
    world_size: int = 1,
    fmt: str = "parquet",
    local: bool = False,
    progress=None,
    state_every: int = 0,
    resume: dict | None = None,
    allow_config_change: bool = False,
) -> dict:
    """Export up to `steps` global steps (all the data when None); return the summary.

    With `state_every` K, ``DIR/state-00000012.json`` is written whenever 12 steps (a multiple
    of K) are done: resuming from it continues with step 12. With `resume`, the run continues
    from such a state and step numbers carry on from it.
    """
    if cfg.global_batch_size % world_size:
        raise ValueError(
            f"--world-size {world_size} does not divide global_batch_size {cfg.global_batch_size}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if resume is not None:  # fail here, with a clear message, not inside the actor
        check_state(resume, cfg.config_hash(), list(cfg.streams), allow_config_change)
    feed = _LocalFeed(cfg, resume, allow_config_change, state_every, ray=not local)
    written = 0
    tokens = 0
    first_at = None
    first_tokens = 0
    rejects_path = out / "rejects.jsonl"
    rejects_n = 0
    mds = _MdsSink(out) if fmt == "mds" else None
    try:
        with open(rejects_path, "w") as rejects:
            while steps is None or written < steps:
                want = STEPS_PER_CALL if steps is None else min(STEPS_PER_CALL, steps - written)
                after = (
                    STEPS_PER_CALL if steps is None else min(STEPS_PER_CALL, steps - written - want)
                )
                batches = feed.next_steps(want, prefetch=after)
                for batch, state in batches:
                    step = int(batch.schema.metadata[b"global_step"])
                    if mds is not None:
                        mds.write(batch)
                    for r in range(world_size if mds is None else 0):
                        part = rank_slice(batch, r, world_size, cfg.global_batch_size)
                        _write(part, step_path(out, step, r, fmt), fmt)
                    if state is not None:
                        path = out / f"state-{state['step']:08d}.json"
                        path.write_text(json.dumps(state, separators=(",", ":")) + "\n")
                    tokens += int(pc.sum(pc.list_flatten(batch.column("seq_lens"))).as_py() or 0)
                    written += 1
                    if first_at is None:
                        first_at, first_tokens = time.monotonic(), tokens
                for rej in feed.drain_rejects():
                    rejects.write(json.dumps(rej) + "\n")
                    rejects_n += 1
                if progress:
                    progress(written, tokens, time.monotonic() - started)
                if len(batches) < want:
                    break
        summary = feed.summary()
    finally:
        if mds is not None:
            mds.close()
        feed.close()
    elapsed = time.monotonic() - started
    steady = time.monotonic() - first_at if first_at else 0.0
    summary.update(
        {
            "steps_written": written,
            "world_size": world_size,
            "format": fmt,
            "elapsed_s": elapsed,
            "time_to_first_step_s": (first_at - started) if first_at else None,
            "tokens_per_s": (tokens - first_tokens) / steady if steady > 0 else 0.0,
            "rejects_file": str(rejects_path),
            "rejects_written": rejects_n,
        }
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
