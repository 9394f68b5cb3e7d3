"""A run's figures joined from its lanes' summaries: what was read summed over the lanes (they
read ahead of what was served), what was served as the control counted it, and the mixture as
lane 0 records it (every lane holds the same changes)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.state.summary import RunSummary, StreamSummary, describe_lengths

# The per-stream counts that add up over the lanes.
SUMMED = ("docs_read", "tokens_read", "skipped", "split", "truncated", "dropped",
          "truncated_tokens", "dropped_tokens")  # fmt: skip

Parts = list[tuple[RunSummary, dict[str, list[int]]]]  # each lane's summary and doc lengths


def joined_read(names: list[str], parts: Parts) -> dict[str, StreamSummary]:
    """Each stream's reading, summed over the lanes (`parts`: each lane's summary and its
    sampled document lengths per stream)."""
    out = {}
    for name in names:
        each = [p.streams[name] for p, _ in parts]
        lengths = np.concatenate([np.asarray(ls[name], dtype=np.int64) for _, ls in parts])
        first = each[0]
        out[name] = replace(
            first,
            **{k: sum(getattr(s, k) for s in each) for k in SUMMED},
            epochs_started=max(s.epochs_started for s in each),
            backend_tokens={
                b: sum(s.backend_tokens[b] for s in each) for b in first.backend_tokens
            },  # fmt: skip
            length=describe_lengths(lengths),
        )
    return out


def joined_summary(names: list[str], parts: Parts, seq_len: int, global_batch_size: int,
                   steps: int, rows: int, real_tokens: int, tokens: np.ndarray,
                   docs: np.ndarray) -> RunSummary:  # fmt: skip
    """The run's summary from its lanes' (`parts`) and what was served: `steps`, `rows`,
    `real_tokens`, and per stream (in `names` order) its `tokens` and the `docs` started."""
    first = parts[0][0]
    read = joined_read(names, parts)
    total = int(tokens.sum())
    streams = {
        n: replace(read[n], tokens=int(tokens[i]), docs=int(docs[i]),
                   realized_share=float(tokens[i] / total) if total else 0.0)
        for i, n in enumerate(names)
    }  # fmt: skip
    exhausted = [f"lane {k}: {line}" for k, (p, _) in enumerate(parts) for line in p.exhausted]
    if exhausted:
        exhausted += unserved_notes(streams)
    return replace(
        first,
        steps=steps,
        rows=rows,
        global_batch_size=global_batch_size,
        real_tokens=real_tokens,
        packing_efficiency=real_tokens / (rows * seq_len) if rows else 0.0,
        streams=streams,
        exhausted=exhausted,
        elapsed_s=max(p.elapsed_s for p, _ in parts),
        tokenizer_backend={b: sum(p.tokenizer_backend[b] for p, _ in parts)
                           for b in first.tokenizer_backend},  # fmt: skip
        first_reads=min((p.first_reads for p, _ in parts),
                        key=lambda r: r.block_at if r.block_at is not None else float("inf")),
    )  # fmt: skip


def unserved_notes(streams: dict) -> list[str]:
    """What the lanes read and did not serve when the data ended, per stream, reported, never
    silent: a laned run ends at the first step a lane cannot fill, and the other lanes' shares
    may hold more (the shares are balanced by bytes, not exactly); with several streams and
    `on_exhausted: stop`, the others' remainder too (as with one lane)."""
    out = []
    for name, st in streams.items():
        docs = st.docs_read - st.docs - st.dropped
        tokens = st.tokens_read - st.tokens - st.dropped_tokens - st.truncated_tokens
        if tokens > 0:
            out.append(
                f"stream {name!r}: {tokens:,} tokens ({docs:,} documents) read were not served "
                "when the data ended: a laned run ends at the first step a lane cannot fill"
            )
    return out
