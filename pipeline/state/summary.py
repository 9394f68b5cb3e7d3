"""A feed's run summary: what was produced, per stream, and when.

`summarize(feed)` returns a `RunSummary`: one `StreamSummary` per stream, the mixture and the
packing figures, and after an export its files and clock (`ExportReport`). `as_dict()` is its
JSON, read by the export (`summary.json`), the service (`/v1/metrics`) and the CLI; the
per-stream fields marked with `gauge(...)` are also Prometheus gauges (service/api.py), so a
new per-stream figure is one field here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from pipeline.tokenize.encoders import BACKEND_NAMES
from pipeline.tokenize.engines import load_tokenizer

GAUGE = "gauge"  # field metadata: the help text of the field's Prometheus gauge


def gauge(doc: str) -> dict[str, str]:
    """Field metadata: export the field as a Prometheus gauge with this help text."""
    return {GAUGE: doc}


@dataclass(frozen=True)
class StreamSummary:
    """One stream's figures. A `gauge` field is `tokenmill_stream_<name>{stream=...}`."""

    tokens: int = field(metadata=gauge("Tokens served"))
    docs: int = field(metadata=gauge("Documents started"))
    docs_read: int
    tokens_read: int
    skipped: int = field(metadata=gauge("Bad records skipped"))
    split: int = field(metadata=gauge("Overlong documents split"))
    truncated: int = field(metadata=gauge("Overlong documents truncated"))
    dropped: int = field(metadata=gauge("Overlong documents dropped"))
    truncated_tokens: int
    dropped_tokens: int
    target_share: float = field(metadata=gauge("Target token share"))
    realized_share: float = field(metadata=gauge("Realized token share"))
    epochs_started: int
    backend_tokens: dict[str, int]  # tokens read, per tokenizer backend
    length: dict  # describe_lengths of the sampled document lengths

    def as_dict(self) -> dict:
        return asdict(self)


def stream_gauges() -> list[tuple[str, str]]:
    """(field, help text) of StreamSummary's fields that are Prometheus gauges, in order."""
    return [(f.name, f.metadata[GAUGE]) for f in fields(StreamSummary) if GAUGE in f.metadata]


@dataclass(frozen=True)
class FirstReads:
    """When the first tokenized blocks reached the feed (`time.monotonic()` clock) and, with a
    head start (pipeline/read/headstart.py), how many tokens each side made in the first reads.
    An export turns these into its `phases`; they are not part of the JSON."""

    block_at: float | None  # the first block from either side
    head_at: float | None  # the head start's first block, made in this process
    executor_at: float | None  # the executor's first block
    tokens_here: int
    tokens_by_executor: int


@dataclass(frozen=True)
class Phases:
    """When each stage of an export was first reached, in seconds from process start (None:
    never), the time spent writing files, and who made the first reads' tokens."""

    imports_and_config: float | None
    ray_connected: float | None
    feed_started: float | None
    first_block_in_process: float | None
    first_block_from_executor: float | None
    first_step_written: float | None
    last_step_written: float | None
    writing_s: float
    tokens_made_here: int
    tokens_made_by_executor: int


@dataclass(frozen=True)
class RunTotals:
    """Counts a feed has reached: steps, rows, real tokens, and per stream the tokens placed,
    documents started and bad records skipped. A resumed feed starts from its state's counts,
    so one run's own share is the difference of two readings (`since`)."""

    steps: int
    rows: int
    real_tokens: int
    seq_len: int
    streams: dict[str, dict[str, int]]  # name -> {"tokens", "docs", "skipped"}

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / (self.rows * self.seq_len) if self.rows else 0.0

    def since(self, start: RunTotals) -> RunTotals:
        """What was added after `start` (an earlier reading of the same feed)."""
        return RunTotals(
            self.steps - start.steps,
            self.rows - start.rows,
            self.real_tokens - start.real_tokens,
            self.seq_len,
            {
                name: {k: v - start.streams.get(name, {}).get(k, 0) for k, v in st.items()}
                for name, st in self.streams.items()
            },  # fmt: skip
        )

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "rows": self.rows,
            "real_tokens": self.real_tokens,
            "packing_efficiency": self.packing_efficiency,
            "streams": self.streams,
        }


def run_totals(feed) -> RunTotals:
    """A `StepFeed`'s counts as of now (since step 0, across resumes)."""
    skipped = [s.counters.skipped for s in feed.streams]
    return totals_of(feed.step, feed.rows, feed.real_tokens, feed.cfg.seq_len, feed.names,
                     feed.mixer.placed, feed.docs_emitted, skipped)  # fmt: skip


def totals_of(steps: int, rows: int, real_tokens: int, seq_len: int, names: list[str],
              tokens, docs, skipped) -> RunTotals:  # fmt: skip
    """The one way a step source's counts become `RunTotals`: per stream (in `names` order)
    its tokens placed, documents started and records skipped."""
    return RunTotals(
        steps=steps,
        rows=rows,
        real_tokens=real_tokens,
        seq_len=seq_len,
        streams={
            name: {"tokens": int(tokens[i]), "docs": int(docs[i]), "skipped": int(skipped[i])}
            for i, name in enumerate(names)
        },
    )


@dataclass(frozen=True)
class ExportReport:
    """What an export adds to its feed's summary: its files and its clock (service/export.py
    `_timings` defines each figure). In the JSON its fields sit at the top level, and its
    `elapsed_s` and `time_to_first_step_s`, counted from process start, replace the feed's."""

    steps_written: int
    world_size: int
    format: str
    layout: str
    rejects_file: str
    rejects_written: int
    wall_s: float
    startup_s: float
    elapsed_s: float
    time_to_first_step_s: float | None
    time_to_first_block_s: float
    tokens_per_s: float
    steady_tokens_per_s: float
    phases: Phases
    # A resumed export continues a run at this step (None: it began at step 0). The summary's
    # other counts (steps, rows, real_tokens, streams) are the run's since step 0, as its
    # state carries them; `this_run` is what this export itself wrote.
    resumed_from_step: int | None
    this_run: RunTotals


@dataclass(frozen=True)
class RunSummary:
    """What a feed has done so far; `as_dict()` is its JSON (summary.json, /v1/metrics)."""

    steps: int
    rows: int
    seq_len: int
    global_batch_size: int
    real_tokens: int
    packing_efficiency: float
    streams: dict[str, StreamSummary]
    mixture_history: list[dict]  # the mixer's weight changes (WeightChange.as_dict)
    exhausted: list[str]  # one line per stream that ran out
    elapsed_s: float
    time_to_first_step_s: float | None
    # Tokens read per tokenizer backend (`hf_fallback`: batches whose verification sample
    # disagreed with the fast backend, re-encoded by HF).
    tokenizer_backend: dict[str, int]
    config_hash: str
    # What was proven at load about the fast backend (docs/architecture.md, "Tokenizer
    # backends"); None when it was not considered (backend hf).
    tokenizer_guarantees: dict | None
    first_reads: FirstReads
    export: ExportReport | None = None  # set by an export (service/export.py)
    # Documents left out at a resume: per stream how many were named and those
    # met so far (file, record, doc_id), and the log of when and why; None: none.
    left_out: dict | None = None

    @property
    def skipped(self) -> dict[str, int]:
        """Bad records skipped, per stream."""
        return {name: s.skipped for name, s in self.streams.items()}

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["first_reads"]  # clock readings; an export reports them as `phases`
        out["skipped"] = self.skipped
        if out["left_out"] is None:
            del out["left_out"]
        export = out.pop("export")
        if export is None:
            return out
        assert self.export is not None
        return out | export | {"this_run": self.export.this_run.as_dict()}


def summarize(feed) -> RunSummary:
    """What a feed has done so far: counts per stream, mixture, packing, timings."""
    now = time.monotonic()
    L = feed.cfg.seq_len
    target = feed.mixer.scheduled_weights(max(feed.step - 1, 0))
    realized = feed.mixer.realized()
    streams = {}
    for i, (name, s) in enumerate(zip(feed.names, feed.streams, strict=True)):
        c, p = s.counters, feed.packer.counters[i]
        streams[name] = StreamSummary(
            tokens=int(feed.mixer.placed[i]),
            docs=int(feed.docs_emitted[i]),
            docs_read=c.docs,
            tokens_read=c.tokens,
            skipped=c.skipped,
            split=p.split,
            truncated=p.truncated,
            dropped=p.dropped,
            truncated_tokens=p.truncated_tokens,
            dropped_tokens=p.dropped_tokens,
            target_share=float(target[i]),
            realized_share=realized[feed.names[i]],
            epochs_started=c.epochs_started,
            backend_tokens=dict(zip(BACKEND_NAMES, c.backend_tokens, strict=True)),
            length=describe_lengths(np.asarray(c.lengths, dtype=np.int64)),
        )
    return RunSummary(
        steps=feed.step,
        rows=feed.rows,
        seq_len=L,
        global_batch_size=feed.cfg.global_batch_size,
        real_tokens=feed.real_tokens,
        packing_efficiency=feed.real_tokens / (feed.rows * L) if feed.rows else 0.0,
        streams=streams,
        mixture_history=[c.as_dict() for c in feed.mixer.history],
        exhausted=list(feed.packer.exhausted_log),
        elapsed_s=now - feed.started,
        time_to_first_step_s=(feed.first_step_at - feed.started) if feed.first_step_at else None,
        tokenizer_backend={
            name: sum(s.counters.backend_tokens[k] for s in feed.streams)
            for k, name in enumerate(BACKEND_NAMES)
        },
        config_hash=feed.config_hash,
        tokenizer_guarantees=_guarantees(feed.cfg),
        first_reads=_first_reads(feed.streams),
        left_out=left_out(feed),
    )


def left_out(feed) -> dict | None:
    """The documents a feed leaves out (`StepFeed(leave_out=...)`), for its summary."""
    p = feed.packer
    if not any(p.skip):
        return None
    streams = {}
    for s, name in enumerate(feed.names):
        if p.skip[s]:
            files = feed.streams[s].files
            met = [{"source": files[d >> 32] if d >> 32 < len(files) else f"<file {d >> 32}>",
                    "record": d & 0xFFFFFFFF, "doc_id": d} for d in p.met[s]]  # fmt: skip
            streams[name] = {"named": len(p.skip[s]), "met": met}
    return {"streams": streams, "log": list(p.skip_log)}


def _guarantees(cfg) -> dict | None:
    tok = load_tokenizer(cfg.tokenizer)
    g = tok.guarantees
    engine = None if tok.fast is None else tok.fast.name  # the fast engine chosen at load
    return None if g is None else g.as_dict() | {"proven": g.proven, "engine": engine}


def _first_reads(streams) -> FirstReads:
    """The first block's arrival; with a head start (headstart.HeadStart), when each side's
    first block came and how many tokens each side made in the streams' first reads."""
    arrivals = [s.first_block_at for s in streams if s.first_block_at is not None]
    head, worker, made = [], [], {"here": 0, "executor": 0}
    for s in streams:
        first_at = getattr(s.first_reads, "first_at", None)
        if callable(first_at):
            h, w = first_at()
            head += [h] if h is not None else []
            worker += [w] if w is not None else []
            for k, v in s.first_reads.tokens.items():
                made[k] += v
    return FirstReads(min(arrivals, default=None), min(head, default=None),
                      min(worker, default=None), made["here"], made["executor"])  # fmt: skip


def describe_lengths(lengths: np.ndarray, bins: int = 12) -> dict:
    if len(lengths) == 0:
        return {"docs": 0}
    lengths = np.asarray(lengths, dtype=np.int64)
    p50, p90, p99 = (float(np.percentile(lengths, q)) for q in (50, 90, 99))
    top = max(int(lengths.max()), 1)
    edges = np.unique(np.geomspace(1, top + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    return {
        "docs": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "std": float(lengths.std()),
        "min": int(lengths.min()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(lengths.max()),
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
    }
