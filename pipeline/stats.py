"""`tokenmill stats` and `tokenmill check`: look at the sources before a run.

`length_stats` tokenizes the first N documents of each stream (in-process, same code path as
the workers) and summarizes their token lengths. `scan` reads every record of every stream
and lists the bad ones, without tokenizing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from pipeline.config import Config
from pipeline.documents import Reject, StreamDocs
from pipeline.reading import Unit, iter_blocks_local, iter_records
from pipeline.sources import WHOLE_FILE


def describe_lengths(lengths: np.ndarray, bins: int = 12) -> dict:
    if len(lengths) == 0:
        return {"docs": 0}
    lengths = np.asarray(lengths, dtype=np.int64)
    p50, p90, p99 = (float(np.percentile(lengths, q)) for q in (50, 90, 99))
    top = max(int(lengths.max()), 1)
    edges = np.unique(np.geomspace(1, top + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    cover = int(math.ceil(p99))
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
        # A row that holds the p99 document whole: bfd then splits ~1% of documents.
        "recommended_seq_len": max(8, 1 << max(3, (cover - 1).bit_length())),
    }


def length_stats(cfg: Config, docs: int = 2000) -> dict:
    out = {}
    for i, name in enumerate(cfg.streams):
        sd = StreamDocs(name, i, cfg.model_copy(update={"on_error": "skip"}), iter_blocks_local)
        lengths = []
        for doc in sd:
            lengths.append(len(doc))
            if len(lengths) >= docs:
                break
        out[name] = describe_lengths(np.array(lengths)) | {
            "skipped_while_sampling": sd.counters.skipped
        }
    return out


def text_histogram(hist: dict, width: int = 40) -> list[str]:
    counts, edges = hist["counts"], hist["edges"]
    peak = max(counts) or 1
    return [
        f"{edges[i]:>8}-{edges[i + 1] - 1:<8} {'#' * round(width * c / peak):<{width}} {c}"
        for i, c in enumerate(counts)
    ]


def scan(cfg: Config) -> Iterator[Reject]:
    """Every bad record of every stream, in file order."""
    for i, name in enumerate(cfg.streams):
        sd = StreamDocs(name, i, cfg, iter_blocks_local)
        files = sd.files
        for per_file in sd.pieces():
            for doc_id, _, err in iter_records(Unit(0, tuple(per_file)), sd.stream):
                if err is not None:
                    rec = doc_id & 0xFFFFFFFF
                    where = None if rec == WHOLE_FILE else rec
                    yield Reject(name, files[doc_id >> 32], where, err)
