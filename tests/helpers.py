"""Checks shared by tests: row invariants of SPEC §3.2 and document reassembly."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

IGNORE = -100


def rows_of(batch: pa.RecordBatch | pa.Table):
    """Rows as dicts in the full batch schema (a compact export step is expanded first)."""
    from wire.layout import expand, expand_table

    batch = expand_table(batch) if isinstance(batch, pa.Table) else expand(batch)
    cols = batch.to_pydict()
    n = len(cols["input_ids"])
    for i in range(n):
        yield {k: v[i] for k, v in cols.items()}


def check_row(row: dict, seq_len: int, pad_id: int, loss_streams: set[str] = frozenset()) -> None:
    """Assert every invariant of one packed row."""
    ids = np.array(row["input_ids"])
    labels = np.array(row["labels"])
    pos = np.array(row["position_ids"])
    seg = np.array(row["segment_ids"])
    lens = row["seq_lens"]
    assert len(ids) == len(labels) == len(pos) == len(seg) == seq_len
    assert len(lens) == len(row["stream"]) == len(row["doc_id"]) == len(row["doc_offset"])
    assert all(n > 0 for n in lens)
    total = sum(lens)
    assert total <= seq_len
    start = 0
    for k, n in enumerate(lens, start=1):
        sl = slice(start, start + n)
        assert (seg[sl] == k).all(), "segment ids count 1..k"
        assert (pos[sl] == np.arange(n)).all(), "positions restart at every segment"
        assert labels[start] == IGNORE, "a segment's first token is never a target"
        if row["stream"][k - 1] not in loss_streams:
            assert (labels[start + 1 : start + n] == ids[start + 1 : start + n]).all()
        start += n
    for k in range(len(lens) - 1):  # a document's next piece in the same row continues it
        same = (row["stream"][k], row["doc_id"][k]) == (row["stream"][k + 1], row["doc_id"][k + 1])
        assert not (same and row["doc_offset"][k] + lens[k] == row["doc_offset"][k + 1]), (
            "two adjacent segments are one document's contiguous pieces: should be one segment"
        )
    pad = slice(total, seq_len)
    assert (seg[pad] == 0).all() and (labels[pad] == IGNORE).all() and (ids[pad] == pad_id).all()


def reassemble(rows) -> dict[tuple[str, int], np.ndarray]:
    """Put every document's pieces back together by (stream, doc_id), checking offsets."""
    pieces = defaultdict(list)
    for row in rows:
        start = 0
        for n, stream, doc_id, off in zip(
            row["seq_lens"], row["stream"], row["doc_id"], row["doc_offset"], strict=True
        ):
            pieces[(stream, doc_id)].append((off, row["input_ids"][start : start + n]))
            start += n
    docs = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        expect = 0
        for off, toks in parts:
            assert off == expect, f"{key}: piece at {off}, expected {expect} (lost or duplicated)"
            expect += len(toks)
        docs[key] = np.concatenate([np.array(t, dtype=np.int64) for _, t in parts])
    return docs


def take(srv, rank: int, world: int, step: int, timeout_s: float = 60.0):
    """Rank `rank` of `world`'s answer for global `step` from a batch server in this process,
    once it is ready (failing with the server's last reason after `timeout_s`)."""
    import time

    deadline = time.time() + timeout_s
    while not (reply := srv.get(rank, world, step, 1.0)).ready:
        assert time.time() < deadline, reply.reason
    return resolved(srv, reply, rank, world)


def resolved(srv, reply, rank: int, world: int):
    """A ready answer of batch server `srv` (in this process) with its runs in it: where the
    lanes hold the rows (`lanes` > 1), taken from them as a rank's client does
    (wire/lane_rows.py `fetch`, the lanes' actors looked up by key)."""
    from dataclasses import replace

    from wire.lane_rows import LaneActors, fetch_again

    if not reply.lanes:
        return reply
    runs, counts = fetch_again(reply.lanes, rank, world, 60.0, LaneActors(srv.lane_handles),
                               srv.lane_gone)  # fmt: skip
    return replace(reply, runs=runs, counts=counts, lanes=[])
