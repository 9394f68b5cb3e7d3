"""`tokenmill stats` and `tokenmill check`: look at the sources before a run.

`length_stats` tokenizes the first N documents of each stream (in-process, same code path as
the workers) and summarizes their token lengths. `scan` reads every record of every stream
and lists the bad ones, without tokenizing.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pipeline.config import Config
from pipeline.documents import DocSource, Reject
from pipeline.reading import Unit, iter_blocks_local, iter_records
from pipeline.shuffle import WindowShuffle
from pipeline.sources import WHOLE_FILE
from pipeline.summary import describe_lengths


def length_stats(cfg: Config, docs: int = 2000) -> dict:
    out = {}
    for i, name in enumerate(cfg.streams):
        sd = DocSource(name, i, cfg.model_copy(update={"on_error": "skip"}), iter_blocks_local)
        lengths = []
        for doc in WindowShuffle(sd, cfg.shuffle.window, cfg.seed, name):  # as the feed reads
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


def scan(cfg: Config, vocab: int | None = None) -> Iterator[Reject]:
    """Every bad record of every stream, in file order.

    With `vocab` (the tokenizer's vocabulary size), token-id documents (`tokens_field`,
    exports) are also checked against it, as the export's tokenizing step does."""
    for i, name in enumerate(cfg.streams):
        sd = DocSource(name, i, cfg, iter_blocks_local)
        files = sd.files
        for per_file in sd.pieces():
            for doc_id, value, err in iter_records(Unit(0, tuple(per_file)), sd.stream):
                if err is None and vocab is not None:
                    err = _outside_vocab(value, vocab)
                if err is not None:
                    rec = doc_id & 0xFFFFFFFF
                    where = None if rec == WHOLE_FILE else rec
                    yield Reject(name, files[doc_id >> 32], where, err)


def _outside_vocab(value, vocab: int) -> str | None:
    """The reject reason of a token-id document with an id the tokenizer does not have."""
    if not isinstance(value, tuple) or not isinstance(value[0], np.ndarray) or not value[0].size:
        return None  # text (or a chat record): the tokenizer makes its ids
    top = int(value[0].max())
    return (
        f"token id {top} is outside the tokenizer's vocabulary (size {vocab})"
        if top >= vocab
        else None
    )
