"""The shared checkpoint-conformance helper (torchdata's `run_test_save_load_state` idea):
resuming at any midpoint equals the uninterrupted run, byte for byte.

`assert_stage_conforms` checks any stage of pipeline/stages/stage.py alone: the document source, the
shuffle window, the packers, the feed. `assert_resume_conforms` is the feed's, with its
summary counters on top.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa


def batch_bytes(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def doc_key(doc) -> tuple:
    """A document as comparable bytes: its stream, id, tokens and loss mask."""
    loss = None if doc.loss is None else doc.loss.tobytes()
    return doc.stream, doc.doc_id, doc.tokens.tobytes(), loss


def row_key(row) -> list:
    """A packed row: which tokens of which documents, in order."""
    return [(*doc_key(s.doc), s.offset, s.length) for s in row]


def _next(stage, step: Callable | None):
    if step is not None:
        return step(stage)
    return next(stage, None)


def straight(make: Callable, items: int, key: Callable, step: Callable | None = None):
    """An uninterrupted run: the first `items` items (as keys) and the state before each
    (through JSON: a state must survive it)."""
    stage = make(None)
    keys, states = [], []
    for _ in range(items):
        states.append(json.loads(json.dumps(stage.get_state())))
        item = _next(stage, step)
        if item is None:
            break
        keys.append(key(item))
    return stage, keys, states


def assert_stage_conforms(make: Callable, items: int, midpoints, key: Callable,
                          step: Callable | None = None) -> None:  # fmt: skip
    """`make(state)` builds the stage (calling `set_state(state)` when it is not None); `key`
    makes an item comparable; `step`, if given, takes the next item (None at the end) instead
    of `next`. Resumed at each midpoint, the stage yields exactly the rest of the run, ends
    where it ends, and its state then equals the uninterrupted run's."""
    stage, keys, states = straight(make, items, key, step)
    assert len(keys) > max(midpoints), "the run is too short for the midpoints"
    ended = len(keys) < items
    end_state = json.loads(json.dumps(stage.get_state()))
    for k in midpoints:
        resumed = make(states[k])
        for i in range(k, len(keys)):
            item = _next(resumed, step)
            assert item is not None, f"resumed at {k}: ended early at item {i}"
            assert key(item) == keys[i], f"resumed at {k}: item {i} differs"
        if ended:  # the straight run ended: so must the resumed one
            assert _next(resumed, step) is None, f"resumed at {k}: did not end"
        assert json.loads(json.dumps(resumed.get_state())) == end_state, f"resumed at {k}: state"


def assert_resume_conforms(make_feed, steps: int, midpoints) -> None:
    """The feed: its steps, its state at the end, and its summary counters."""
    assert_stage_conforms(make_feed, steps, midpoints, batch_bytes, lambda f: f.next_step())
    feed, _, states = straight(make_feed, steps, batch_bytes, lambda f: f.next_step())
    s1 = feed.summary()
    for k in midpoints:
        resumed = make_feed(states[k])
        while resumed.next_step() is not None and resumed.step < feed.step:
            pass
        s2 = resumed.summary()
        assert (s1.real_tokens, s1.rows, s1.skipped) == (s2.real_tokens, s2.rows, s2.skipped), k
        for name, a in s1.streams.items():
            b = s2.streams[name]
            for key in ("tokens", "docs", "skipped", "split", "truncated", "dropped", "docs_read"):
                assert getattr(a, key) == getattr(b, key), (k, name, key)
