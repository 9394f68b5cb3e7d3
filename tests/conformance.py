"""The shared checkpoint-conformance helper (torchdata's `run_test_save_load_state` idea):
resuming at any midpoint equals the uninterrupted run, byte for byte."""

from __future__ import annotations

import json

import pyarrow as pa


def batch_bytes(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def straight_run(make_feed, steps: int):
    """Batches and the state before each step, uninterrupted."""
    feed = make_feed(None)
    batches, states = [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(feed.state())))  # must survive JSON
        b = feed.next_step()
        if b is None:
            break
        batches.append(batch_bytes(b))
    return feed, batches, states


def assert_resume_conforms(make_feed, steps: int, midpoints) -> None:
    feed, batches, states = straight_run(make_feed, steps)
    assert len(batches) > max(midpoints), "the run is too short for the midpoints"
    for k in midpoints:
        resumed = make_feed(states[k])
        assert resumed.step == k
        for i in range(k, len(batches)):
            b = resumed.next_step()
            assert b is not None, f"resumed at {k}: ended early at step {i}"
            assert batch_bytes(b) == batches[i], f"resumed at {k}: step {i} differs"
        if len(batches) < steps:  # the straight run ended: so must the resumed one
            assert resumed.next_step() is None
        s1, s2 = feed.summary(), resumed.summary()
        for key in ("real_tokens", "rows", "skipped"):
            assert s1[key] == s2[key], (k, key)
        for name in s1["streams"]:
            for key in ("tokens", "docs", "skipped", "split", "truncated", "dropped", "docs_read"):
                assert s1["streams"][name][key] == s2["streams"][name][key], (k, name, key)
