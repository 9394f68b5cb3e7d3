"""An export used as a pre-tokenized source (SPEC M12): `format: export`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.config import ConfigError, parse_config
from pipeline.exports import read_step
from service.export import run_export
from tests.conftest import stdlib_texts, write_jsonl

SEQ = 256


def _corpus(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    write_jsonl(d / "code.jsonl", stdlib_texts(12, max_bytes=4_000))
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"What does line {i} of the file say?"},
                {"role": "assistant", "content": text[:300]},
            ]
        }
        for i, text in enumerate(stdlib_texts(20, start=12, max_bytes=2_000))
    ]
    write_jsonl(d / "chat.jsonl", chats)
    return d


def _rows(out):
    cols = ["input_ids", "labels", "position_ids", "segment_ids", "seq_lens"]
    rows = []
    for f in sorted(out.glob("step-*.parquet")):
        t = read_step(f).select(cols)
        for r in range(t.num_rows):
            rows.append({c: t.column(c)[r].as_py() for c in cols})
    return rows


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_reexporting_an_export_reproduces_its_rows(tmp_path, fmt):
    """Read back in order and packed the same way, an export gives the same rows again:
    the same ids (EOS kept, nothing added), labels (the chat loss mask kept), positions and
    segments, and documents split across rows are joined again."""
    src = _corpus(tmp_path)
    first = parse_config(
        {
            "seq_len": SEQ,
            "global_batch_size": 4,
            "packing": {"mode": "concat"},
            "streams": {
                "code": {"paths": [str(src / "code.jsonl")], "weight": 0.6},
                "chat": {"kind": "chat", "paths": [str(src / "chat.jsonl")], "weight": 0.4},
            },
        }
    )
    a = tmp_path / "a"
    summary = run_export(first, a, local=True, fmt=fmt)
    assert summary["steps_written"] >= 4
    again = parse_config(
        {
            "seq_len": SEQ,
            "global_batch_size": 4,
            "packing": {"mode": "concat"},
            "shuffle": {"files": False, "window": 1},
            "streams": {"tokens": {"kind": "chat", "format": "export", "paths": [str(a)]}},
        }
    )
    b = tmp_path / "b"
    s2 = run_export(again, b, local=True)
    assert s2["tokenizer_backend"]["pretokenized"] == s2["real_tokens"] == summary["real_tokens"]
    if fmt == "arrow":  # compare through parquet: write the first export again as parquet
        a = tmp_path / "a2"
        run_export(first, a, local=True)
    want, got = _rows(a), _rows(b)
    assert len(got) == len(want)
    assert got == want
    # Joined: fewer documents than the segments they were cut into.
    segments = sum(len(r["seq_lens"]) for r in want)
    assert s2["streams"]["tokens"]["docs_read"] < segments


def test_export_source_rejects_what_is_not_an_export(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    write_jsonl(d / "step-00000000-rank-0.parquet", ["not parquet at all"])
    (d / "notes.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ConfigError, match="export"):
        parse_config(
            {"seq_len": SEQ, "streams": {"t": {"format": "export", "paths": [str(d / "*.jsonl")]}}}
        )
    cfg = parse_config(
        {
            "seq_len": SEQ,
            "on_error": "skip",
            "streams": {"t": {"format": "export", "paths": [str(d)]}},
        }
    )
    from pipeline.feed import Feed

    feed = Feed(cfg, local=True)
    assert feed.next_step() is None  # the one "step file" is corrupt: skipped, reported
    [reject] = feed.rejects
    assert reject.file.endswith("step-00000000-rank-0.parquet")
    assert "corrupt or unreadable export file" in reject.reason
    assert np.int64(feed.summary()["skipped"]["t"]) == 1
