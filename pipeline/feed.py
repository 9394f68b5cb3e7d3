"""The feed: one deterministic global row sequence, cut into global steps of G rows.

    per-stream documents (Ray Data read+tokenize, windowed shuffle)
        -> deficit mixer + packer (concat | bfd)
        -> global step s = G rows, an Arrow record batch
        -> rank r of W gets rows [r*G/W, (r+1)*G/W) of step s

The global sequence never depends on the world size; only the slicing does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from pipeline.config import Config
from pipeline.documents import Cursor, Reject, StreamDocs
from pipeline.mixing import DeficitMixer
from pipeline.packing import make_packer
from pipeline.reading import Executor, iter_blocks_local, iter_blocks_ray
from pipeline.schema import build_batch, with_metadata
from pipeline.states import STATE_VERSION, check_state, seal
from pipeline.stats import describe_lengths
from pipeline.tokenization import BACKEND_NAMES, load_tokenizer


def default_executor(local: bool) -> Executor:
    return iter_blocks_local if local else iter_blocks_ray


class Feed:
    """The global step sequence of a config. `executor` reads and tokenizes (default: Ray
    Data, or in-process with `local`); `first_executor`, if given, makes each stream's first
    read instead (e.g. reading.with_head_start: this process tokenizes until the workers
    deliver)."""

    def __init__(
        self,
        cfg: Config,
        local: bool = False,
        on_reject: Callable[[Reject], None] | None = None,
        state: dict | None = None,
        allow_config_change: bool = False,
        executor: Executor | None = None,
        first_executor: Executor | None = None,
    ):
        self.cfg = cfg
        self.names = list(cfg.streams)
        self.rejects: list[Reject] = []
        self.config_hash = cfg.config_hash()
        if state is not None:
            check_state(state, self.config_hash, self.names, allow_config_change)
        executor = executor or default_executor(local)
        first = first_executor or executor
        sink = on_reject or self.rejects.append
        self.streams = []
        for i, n in enumerate(self.names):
            start = reported = None
            if state is not None:
                st = state["streams"][n]
                start, reported = Cursor.from_json(st["restart"]), tuple(st["reported"])
            self.streams.append(StreamDocs(n, i, cfg, executor, sink, start, reported, first))
        for s in self.streams:
            s.start()  # every stream's reading begins now, concurrently
        self.mixer = DeficitMixer(self.names, {n: s.weight for n, s in cfg.streams.items()})
        for entry in cfg.schedule:
            self.mixer.schedule(entry.step, entry.weights, source="schedule")
        self.packer = make_packer(
            cfg.packing.mode,
            cfg.seq_len,
            cfg.packing.overflow,
            [iter(s) for s in self.streams],
            self.mixer,
            cfg.mixing.on_exhausted,
            cfg.packing.buffer,
            ramp_rows=cfg.global_batch_size,
        )
        self.pad_id = load_tokenizer(cfg.tokenizer).pad_id
        # False: steps in the compact layout (pipeline/exports.py), as the export writes them.
        self.full_batches = True
        self.step = 0
        self.rows = 0
        self.real_tokens = 0
        self.docs_emitted = np.zeros(len(self.names), dtype=np.int64)
        self.started = time.monotonic()
        self.first_step_at: float | None = None
        self.finished = False
        if state is not None:
            self._restore(state, allow_config_change)

    # -- resumable state (SPEC M7) ------------------------------------------------------------

    def state(self) -> dict:
        """The state as of now: a resumed feed produces step `state["step"]` next.

        Small JSON: per-stream cursors, mixer counters and weight history, and the packer's
        buffer as arrival numbers to be rebuilt by replay. Never tokens.
        """
        nexts = [s.next_cursor for s in self.streams]
        packer = self.packer.state(nexts)
        restart = packer.pop("restart")
        return seal(
            {
                "version": STATE_VERSION,
                "config_hash": self.config_hash,
                "step": self.step,
                "streams": {
                    n: {
                        "restart": (restart[i] or nexts[i]).to_json(),
                        "next": nexts[i].to_json(),
                        "reported": list(self.streams[i].read_mark),
                    }
                    for i, n in enumerate(self.names)
                },
                "packer": packer,
                "mixer": self.mixer.state(),
                "feed": {
                    "rows": self.rows,
                    "real_tokens": self.real_tokens,
                    "docs_emitted": self.docs_emitted.tolist(),
                    "finished": self.finished,
                },
            }
        )

    def _restore(self, state: dict, allow_config_change: bool) -> None:
        self.mixer.restore(state["mixer"])
        self.packer.restore(state["packer"])
        f = state["feed"]
        self.step = int(state["step"])
        self.rows, self.real_tokens = int(f["rows"]), int(f["real_tokens"])
        self.docs_emitted = np.array(f["docs_emitted"], dtype=np.int64)
        self.finished = bool(f["finished"])
        if state["config_hash"] != self.config_hash and allow_config_change:
            # The config's weights take over from the resume step; the change is recorded.
            self.mixer.schedule(
                self.step, {n: s.weight for n, s in self.cfg.streams.items()}, "resume"
            )

    def next_step(self) -> pa.RecordBatch | None:
        """The next global step (G rows; the last may be short), or None when the data ends."""
        if self.finished:
            return None
        G = self.cfg.global_batch_size
        self.mixer.begin_step(self.step)
        rows = []
        while len(rows) < G:
            row = self.packer.next_row()
            if row is None:
                break
            rows.append(row)
        if len(rows) < G:
            self.finished = True
            if not rows or self.cfg.drop_last:
                return None
        batch = build_batch(rows, self.cfg.seq_len, self.pad_id, self.names, self.full_batches)
        for row in rows:
            for seg in row:
                self.real_tokens += seg.length
                if seg.offset == 0:
                    self.docs_emitted[seg.doc.stream] += 1
        self.rows += len(rows)
        batch = with_metadata(
            batch,
            global_step=self.step,
            seq_len=self.cfg.seq_len,
            config_hash=self.config_hash,
            **({} if self.full_batches else {"layout": "compact"}),
        )
        self.step += 1
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        return batch

    def set_weights(self, weights: dict[str, float], effective_step: int | None = None) -> int:
        """New target weights from global step `effective_step` (default: the next step to be
        produced). Never retroactive; recorded in the mixture history. Returns the step."""
        step = self.step if effective_step is None else int(effective_step)
        if step < self.step:
            raise ValueError(
                f"effective step {step} is already produced (next step is {self.step})"
            )
        return self.mixer.schedule(step, weights, source="api")

    def close(self) -> None:
        """Stop all reading (background Ray Data executions). The feed is done after this."""
        for s in self.streams:
            s.close()

    def summary(self) -> dict:
        now = time.monotonic()
        L = self.cfg.seq_len
        target = self.mixer.scheduled_weights(max(self.step - 1, 0))
        realized = self.mixer.realized()
        arrivals = [s.first_block_at for s in self.streams if s.first_block_at is not None]
        streams = {}
        for i, (name, s) in enumerate(zip(self.names, self.streams, strict=True)):
            c, p = s.counters, self.packer.counters[i]
            streams[name] = {
                "tokens": int(self.mixer.placed[i]),
                "docs": int(self.docs_emitted[i]),
                "docs_read": c.docs,
                "tokens_read": c.tokens,
                "skipped": c.skipped,
                "split": p.split,
                "truncated": p.truncated,
                "dropped": p.dropped,
                "truncated_tokens": p.truncated_tokens,
                "dropped_tokens": p.dropped_tokens,
                "target_share": float(target[i]),
                "realized_share": realized[self.names[i]],
                "epochs_started": c.epochs_started,
                "backend_tokens": dict(zip(BACKEND_NAMES, c.backend_tokens, strict=True)),
                "length": describe_lengths(np.asarray(c.lengths, dtype=np.int64)),
            }
        return {
            "steps": self.step,
            "rows": self.rows,
            "seq_len": L,
            "global_batch_size": self.cfg.global_batch_size,
            "real_tokens": self.real_tokens,
            "packing_efficiency": self.real_tokens / (self.rows * L) if self.rows else 0.0,
            "streams": streams,
            "skipped": {
                n: s.counters.skipped for n, s in zip(self.names, self.streams, strict=True)
            },
            "mixture_history": [c.as_dict() for c in self.mixer.history],
            "exhausted": list(self.packer.exhausted_log),
            "elapsed_s": now - self.started,
            "time_to_first_step_s": (self.first_step_at - self.started)
            if self.first_step_at
            else None,
            # When the first tokenized block reached the feed (time.monotonic()); the export's
            # steady rate is measured from here (service/export.py `_timings`).
            "first_block_at": min(arrivals) if arrivals else None,
            # With a head start: when its first block was made here, and the executor's.
            "first_reads_at": _first_reads_at(self.streams),
            # Which tokenizer backend produced the tokens read (`hf_fallback`: batches whose
            # verification sample disagreed with the fast backend, re-encoded by HF).
            "tokenizer_backend": {
                name: sum(s.counters.backend_tokens[k] for s in self.streams)
                for k, name in enumerate(BACKEND_NAMES)
            },
            "config_hash": self.config_hash,
            # What was proven at load about the fast backend (docs/architecture.md,
            # "Tokenizer backends"); null when it was not considered (backend hf).
            "tokenizer_guarantees": self._guarantees(),
        }

    def _guarantees(self) -> dict | None:
        g = load_tokenizer(self.cfg.tokenizer).guarantees
        return None if g is None else g.as_dict() | {"proven": g.proven}


def _first_reads_at(streams) -> dict:
    """With a head start (headstart.HeadStart): when each side's first block came, and how
    many tokens each side made in the streams' first reads."""
    head, worker, made = [], [], {"here": 0, "executor": 0}
    for s in streams:
        first_at = getattr(s.first_reads, "first_at", None)
        if callable(first_at):
            h, w = first_at()
            head += [h] if h is not None else []
            worker += [w] if w is not None else []
            for k, v in s.first_reads.tokens.items():
                made[k] += v
    return {"head": min(head, default=None), "executor": min(worker, default=None),
            "tokens": made}  # fmt: skip


def rank_slice(
    batch: pa.RecordBatch, rank: int, world_size: int, global_batch_size: int
) -> pa.RecordBatch:
    """Rank `rank`'s rows of a global step; world-size independent global order."""
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by world size {world_size}"
        )
    per_rank = global_batch_size // world_size
    start = min(rank * per_rank, batch.num_rows)
    part = batch.slice(start, max(0, min(per_rank, batch.num_rows - start)))
    # Only this rank's rows: a slice still holds the whole step's buffers, and pickling it
    # (ray.put in the server) copied all of them. With 8 ranks every rank's object held the
    # whole step: 527 KB instead of 67 KB per rank of a 16 x 2048 step.
    part = pa.concat_batches([part]) if world_size > 1 else part
    meta = dict(batch.schema.metadata or {})
    meta.update({b"rank": str(rank).encode(), b"world_size": str(world_size).encode()})
    return part.replace_schema_metadata(meta)


def next_steps(
    feed: Feed, n: int, state_every: int = 0
) -> list[tuple[pa.RecordBatch, dict | None]]:
    """Up to `n` steps, each with the state after it when its number of done steps is a
    multiple of `state_every` (the state a resumed run needs to continue right after it)."""
    out = []
    for _ in range(n):
        batch = feed.next_step()
        if batch is None:
            break
        state = feed.state() if state_every and feed.step % state_every == 0 else None
        out.append((batch, state))
    return out
