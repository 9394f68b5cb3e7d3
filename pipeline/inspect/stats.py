"""`tokenmill stats` and `tokenmill check`: look at the sources before a run.

`sample_lengths` tokenizes the first N documents of each stream (in-process, same code path as
the workers), and `mixture_seq_len` turns them into one seq_len for the whole mixture at its
configured weights. `count_corpus` reads and tokenizes every record once (the bad ones go to
a callback), and `supply` says how many steps that makes at the configured weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.config import Config
from pipeline.read.reading import iter_blocks_local
from pipeline.stages.documents import DocSource, Reject
from pipeline.stages.shuffle import WindowShuffle

# The mixture's seq_len holds this share of its documents whole (`tokenmill stats --fit`).
FIT = 0.99
MIN_SEQ_LEN = 64


def sample_lengths(cfg: Config, docs: int = 2000) -> dict[str, tuple[np.ndarray, int]]:
    """Per stream: the token lengths of its first `docs` documents as the feed reads them,
    and the bad records skipped on the way."""
    out = {}
    for i, name in enumerate(cfg.streams):
        sd = DocSource(name, i, cfg.model_copy(update={"on_error": "skip"}), iter_blocks_local)
        lengths = []
        for doc in WindowShuffle(sd, cfg.shuffle.window, cfg.seed, name):  # as the feed reads
            lengths.append(len(doc))
            if len(lengths) >= docs:
                break
        out[name] = (np.array(lengths, dtype=np.int64), sd.counters.skipped)
    return out


def cut_share(lengths: np.ndarray, seq_len: int) -> float:
    """The share of a stream's tokens past the first `seq_len` tokens of their document: what
    a row of `seq_len` cannot hold with its document's start (split into later rows, cut off,
    or dropped with the document, per packing.overflow)."""
    total = int(lengths.sum())
    return float(np.maximum(lengths - seq_len, 0).sum() / total) if total else 0.0


def longer_share(lengths: np.ndarray, seq_len: int) -> float:
    """The share of a stream's documents longer than `seq_len` (which no row holds whole)."""
    return float((lengths > seq_len).mean()) if len(lengths) else 0.0


def mixture_seq_len(
    samples: dict[str, np.ndarray], weights: dict[str, float], fit: float = FIT
) -> dict:
    """One seq_len for the whole mixture at its weights (token shares): the shortest power of
    two (at least MIN_SEQ_LEN) whose rows hold `fit` (99%) of the mixture's documents whole.

    The mixture is mixed by tokens, so per token it takes w_s / mean_s documents from stream
    s: a stream of long documents at a small weight contributes few of them. The share of the
    mixture's documents longer than L is then sum_s d_s * longer_s(L) / sum_s d_s with
    d_s = w_s / mean_s. (Per stream, each p99 names its own length, and the longest stream's
    sets the row for everything, however small its weight.) `curve` shows, at each power of
    two around the recommendation, that share and the share of the mixture's tokens past the
    first L of their document (cut_share), so a shorter row's cost can be read off: a long
    row costs attention per token, and packing (bfd) fills it with short documents either way.
    """
    live = {n: a for n, a in samples.items() if len(a) and a.sum() and weights.get(n, 0) > 0}
    if not live:
        return {"seq_len": None, "fit": fit, "curve": {}, "per_stream": {}, "weights": {}}
    total_w = sum(weights[n] for n in live)
    w = {n: weights[n] / total_w for n in live}
    per_token = {n: w[n] / float(a.mean()) for n, a in live.items()}
    docs = sum(per_token.values())

    def longer(L: int) -> float:
        return sum(per_token[n] / docs * longer_share(a, L) for n, a in live.items())

    def cut(L: int) -> float:
        return sum(w[n] * cut_share(a, L) for n, a in live.items())

    longest = max(int(a.max()) for a in live.values())
    L = MIN_SEQ_LEN
    while longer(L) > 1 - fit and longest > L:
        L *= 2
    lows = [L >> k for k in (3, 2, 1) if (L >> k) >= MIN_SEQ_LEN]
    return {
        "seq_len": L,
        "fit": fit,
        "curve": {n: {"docs_longer": longer(n), "tokens_cut": cut(n)} for n in [*lows, L, 2 * L]},
        "per_stream": {
            n: {"docs_longer": longer_share(a, L), "tokens_cut": cut_share(a, L)}
            for n, a in live.items()
        },
        "weights": w,
        "doc_share": {n: v / docs for n, v in per_token.items()},
    }


@dataclass
class StreamCount:
    """One pass over a stream: its records, the good documents and their tokens (with BOS/EOS,
    as the packer gets them), and the tokens packing keeps under `packing.overflow`."""

    records: int = 0
    docs: int = 0
    bad: int = 0
    tokens: int = 0
    kept_tokens: int = 0
    # With lanes: each lane's share, (bytes it reads, tokens they make). A lane's reading and
    # tokenizing cost by the byte and its rows are tokens, so the lane whose share holds the
    # most bytes per token is the slowest, and the K lanes serve at its pace (`lane_pace`).
    lanes: list[tuple[int, int]] = field(default_factory=list)


def count_corpus(cfg: Config, on_reject: Callable[[Reject], None]) -> dict[str, StreamCount]:
    """Read and tokenize every record of every stream once (in this process), counting.

    Bad records go to `on_reject`, in read order; the stream's `repeat` and `max_tokens` are
    left to `supply`, so a count is one pass over the files."""
    L, overflow = cfg.seq_len, cfg.packing.overflow
    once = {n: s.model_copy(update={"repeat": 1, "max_tokens": None})
            for n, s in cfg.streams.items()}  # fmt: skip
    one_pass = cfg.model_copy(update={"on_error": "skip", "streams": once})
    out = {}
    for i, name in enumerate(cfg.streams):
        count = out[name] = StreamCount()
        # With lanes, each lane's share on its own (the same records in all, read once), so
        # that each lane's tokens are known; bad records come lane by lane, each in read order.
        for lane in range(cfg.lanes) if cfg.lanes > 1 else [None]:
            sd = DocSource(name, i, one_pass, iter_blocks_local, on_reject, lane=lane)
            kept = 0
            for doc in sd:
                n = len(doc)
                kept += (
                    n
                    if overflow == "split"
                    else min(n, L)
                    if overflow == "truncate"
                    else n * (n <= L)
                )
            c = sd.counters
            count.records += c.docs + c.skipped
            count.docs += c.docs
            count.bad += c.skipped
            count.tokens += c.tokens
            count.kept_tokens += kept
            if lane is not None:
                count.lanes.append((sd.share_bytes(), c.tokens))
    return out


def lane_pace(cfg: Config, counts: dict[str, StreamCount]) -> list[float] | None:
    """Each lane's bytes read per token it serves, at the configured weights (a lane mixes its
    streams by token weight, so a token of stream s costs its share's bytes per token of s),
    from `count_corpus`; None without lanes or tokens. The lane with the most is the slowest:
    the lanes serve at its pace."""
    w = cfg.weights
    if cfg.lanes == 1 or not counts:
        return None
    pace = [0.0] * cfg.lanes
    for name, c in counts.items():
        if len(c.lanes) != cfg.lanes or w.get(name, 0) <= 0:
            continue
        for k, (size, tokens) in enumerate(c.lanes):
            if tokens == 0:
                return None  # a share with no token: the run fails on it (check says so)
            pace[k] += w[name] * size / tokens
    return pace if any(pace) else None


def supply(cfg: Config, counts: dict[str, StreamCount]) -> dict:
    """How many global steps the counted data makes at the configured weights.

    A step holds at most G x L tokens (global_batch_size x seq_len). Mixed by token weight, a
    stream of T kept tokens at weight w lasts T / (w G L) steps: `pass_steps`. One epoch of
    the mixture ends when its first stream has been read once: `epoch_steps`, the smallest of
    them. Over the whole run each stream supplies `repeat` passes (at most `max_tokens`):
    with `on_exhausted: stop` the data ends when the first stream runs dry (`run_steps`); with
    `renormalize` its weight goes to the others and the data ends when all have run dry, every
    kept token used. These are full rows; the padding that packing leaves in a row (a few %
    with bfd) stretches the same tokens over as many more steps."""
    w = cfg.weights
    per_step = cfg.global_batch_size * cfg.seq_len
    total = {}
    for name, c in counts.items():
        s = cfg.streams[name]
        whole = c.kept_tokens * s.repeat
        total[name] = whole if s.max_tokens is None else min(whole, s.max_tokens)
    pass_steps = {n: c.kept_tokens / (w[n] * per_step) for n, c in counts.items()}
    run_steps = {n: t / (w[n] * per_step) for n, t in total.items()}
    first = min(pass_steps, key=lambda n: pass_steps[n])
    dry = min(run_steps, key=lambda n: run_steps[n])
    stop = cfg.mixing.on_exhausted == "stop"
    run = run_steps[dry] if stop else sum(total.values()) / per_step
    return {
        "tokens_per_step": per_step,
        "weights": w,
        "pass_steps": {n: math.floor(v) for n, v in pass_steps.items()},
        "epoch_steps": math.floor(pass_steps[first]),
        "epoch_ends_with": first,
        "run_steps": math.floor(run),
        "first_dry": dry,
    }


def text_histogram(hist: dict, width: int = 40) -> list[str]:
    counts, edges = hist["counts"], hist["edges"]
    peak = max(counts) or 1
    return [
        f"{edges[i]:>8}-{edges[i + 1] - 1:<8} {'#' * round(width * c / peak):<{width}} {c}"
        for i, c in enumerate(counts)
    ]
