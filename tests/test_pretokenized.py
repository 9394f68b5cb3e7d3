"""An export used as a pre-tokenized source (SPEC M12): `format: export`."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.read.sources import plan_pieces, read_piece
from service.export import run_export
from tests.conftest import stdlib_texts, write_jsonl
from wire.layout import read_step

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
    summary = run_export(first, a, executor=iter_blocks_local, fmt=fmt)
    assert summary.export.steps_written >= 4
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
    s2 = run_export(again, b, executor=iter_blocks_local)
    assert s2.tokenizer_backend["pretokenized"] == s2.real_tokens == summary.real_tokens
    if fmt == "arrow":  # compare through parquet: write the first export again as parquet
        a = tmp_path / "a2"
        run_export(first, a, executor=iter_blocks_local)
    want, got = _rows(a), _rows(b)
    assert len(got) == len(want)
    assert got == want
    # Joined: fewer documents than the segments they were cut into.
    segments = sum(len(r["seq_lens"]) for r in want)
    assert s2.streams["tokens"].docs_read < segments


def test_an_export_without_labels_reads_back_with_first_tokens_masked(tmp_path):
    """A compact export of text only stores no `labels` (every one is derivable): read back as
    chat (loss kept), every token but each segment's first has loss, and re-exported the rows
    are the same, labels included."""
    src = _corpus(tmp_path)
    code = {"seq_len": SEQ, "global_batch_size": 4, "packing": {"mode": "concat"},
            "streams": {"code": {"paths": [str(src / "code.jsonl")]}}}  # fmt: skip
    a = tmp_path / "a"
    run_export(parse_config(code), a, executor=iter_blocks_local)
    assert all("labels" not in pq.read_schema(f).names for f in a.glob("step-*.parquet"))
    again = code | {"shuffle": {"files": False, "window": 1},
                    "streams": {"t": {"kind": "chat", "format": "export", "paths": [str(a)]}}}  # fmt: skip
    b = tmp_path / "b"
    s2 = run_export(parse_config(again), b, executor=iter_blocks_local)
    assert s2.tokenizer_backend["pretokenized"] == s2.real_tokens > 0
    # Read as it is: in each file, one token without loss per segment, each first of one.
    for f in sorted(a.glob("step-*.parquet"))[:3]:
        (piece,) = plan_pieces([str(f)], "export", 1 << 20)[0]
        docs = [v for _, v, err in read_piece(piece, "tokens") if err is None]
        segments = sum(len(n) for n in pq.read_table(f).column("seq_lens").to_pylist())
        assert all(loss[0] == 0 for _, loss in docs)
        assert sum(int((loss == 0).sum()) for _, loss in docs) == segments
    assert _rows(b) == _rows(a)


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
    from pipeline.feed import StepFeed

    feed = StepFeed(cfg, executor=iter_blocks_local)
    assert feed.next_step() is None  # the one "step file" is corrupt: skipped, reported
    [reject] = feed.rejects
    assert reject.file.endswith("step-00000000-rank-0.parquet")
    assert "corrupt or unreadable export file" in reject.reason
    assert np.int64(feed.summary().skipped["t"]) == 1


# --- tokens_field: token ids read with no tokenizer (issue 14, item 3) -------------------------


def _token_docs(n: int, seed: int = 7) -> list[np.ndarray]:
    """`n` documents of token ids in the default tokenizer's vocabulary, of varied lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100_000, size=int(rng.integers(5, 300))) for _ in range(n)]


def _mds_tokens(out, docs, column_type: str, dtype):
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"tokens": column_type}, size_limit=3000) as w:
        for d in docs:
            arr = d.astype(dtype)
            w.write({"tokens": arr.tobytes() if column_type == "bytes" else arr})
    index = json.loads((out / "index.json").read_text())
    assert len(index["shards"]) > 1
    return np.cumsum([0] + [s["samples"] for s in index["shards"]])


def _export_docs(streams, **extra):
    from tests.test_sources import export_local

    return export_local(streams, **extra)


@pytest.mark.parametrize(
    ("column_type", "dtype", "tokens_dtype"),
    [("ndarray:int32", np.int32, None), ("ndarray:uint32", np.uint32, None),
     ("bytes", np.int64, "int64")],  # LLM-Foundry's older --concat_tokens: int64 bytes
)  # fmt: skip
def test_llm_foundry_mds_tokens_read_as_written(tmp_path, tokenizer, column_type, dtype,
                                                tokens_dtype):  # fmt: skip
    docs = _token_docs(20)
    firsts = _mds_tokens(tmp_path / "mds", docs, column_type, dtype)
    stream = {"paths": [str(tmp_path / "mds")], "tokens_field": "tokens"}
    if tokens_dtype:
        stream["tokens_dtype"] = tokens_dtype
    feed, got = _export_docs({"t": stream})
    assert len(got) == len(docs) and not feed.rejects
    for (_, doc_id), toks in got.items():
        i = int(firsts[doc_id >> 32]) + (doc_id & 0xFFFFFFFF)
        assert toks.tolist() == docs[i].tolist() + [tokenizer.eos_id]
    assert feed.summary().tokenizer_backend["pretokenized"] == sum(len(d) + 1 for d in docs)


def test_parquet_and_arrow_token_lists_get_bos_as_configured(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _token_docs(9, seed=3)
    table = pa.table({"ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=4)
    with (
        pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table, max_chunksize=2)
    tok = {"add_bos": True, "bos_id": 100257, "add_eos": False}
    for name in ("d.parquet", "d.arrow"):
        stream = {"paths": [str(tmp_path / name)], "tokens_field": "ids"}
        _, got = _export_docs({"t": stream}, tokenizer=tok)
        assert {k[1]: v.tolist() for k, v in got.items()} == {
            i: [100257] + d.tolist() for i, d in enumerate(docs)
        }


def test_bad_token_records_are_named_and_counted(tmp_path):
    from streaming import MDSWriter

    from pipeline.feed import StepFeed
    from pipeline.stages.documents import BadRecordError

    good = _token_docs(3, seed=5)
    with MDSWriter(out=str(tmp_path / "mds"), columns={"tokens": "ndarray:int64"}) as w:
        for d in [good[0], np.array([5, 2_000_000]), good[1], np.array([-3, 4]), good[2]]:
            w.write({"tokens": d})
    stream = {"paths": [str(tmp_path / "mds")], "tokens_field": "tokens"}
    feed, got = _export_docs({"t": stream}, on_error="skip")
    assert sorted(k[1] for k in got) == [0, 2, 4]
    reasons = {r.record: r.reason for r in feed.rejects}
    assert reasons == {
        1: "token id 2000000 is outside the tokenizer's vocabulary (size 100277)",
        3: "token id -3 is out of range",
    }
    assert all(r.file.endswith("shard.00000.mds") for r in feed.rejects)
    assert feed.summary().streams["t"].skipped == 2
    with pytest.raises(BadRecordError, match=r"shard.00000.mds, record 1: token id 2000000"):
        _export_docs({"t": stream}, on_error="fail")
    # Raw bytes without tokens_dtype: every record is rejected, and counted, nothing served.
    with MDSWriter(out=str(tmp_path / "raw"), columns={"tokens": "bytes"}) as w:
        for d in good:
            w.write({"tokens": d.astype(np.int64).tobytes()})
    cfg = parse_config({"seq_len": SEQ, "streams": {"t": {"paths": [str(tmp_path / "raw")],
                                                           "tokens_field": "tokens"}}})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    assert feed.next_step() is None
    assert feed.summary().streams["t"].skipped == 3
    assert {r.reason for r in feed.rejects} == {
        "field holds raw bytes; set tokens_dtype (e.g. int64) to read them"
    }


def test_tokens_field_is_validated():
    with pytest.raises(ConfigError, match="tokens_field is for kind pretrain"):
        parse_config({"streams": {"c": {"kind": "chat", "paths": ["x"], "tokens_field": "t"}}})
    with pytest.raises(ConfigError, match="tokens_dtype needs tokens_field"):
        parse_config({"streams": {"c": {"paths": ["x"], "tokens_dtype": "int64"}}})
    with pytest.raises(ConfigError, match="tokens_dtype"):
        parse_config({"streams": {"c": {"paths": ["x"], "tokens_field": "t",
                                        "tokens_dtype": "float32"}}})  # fmt: skip


def test_tokenmill_mds_export_reads_back_split_by_seq_lens(tmp_path):
    """`export --format mds` is a source: recognized by its columns (as `format: export`,
    given the export directory or its `mds/`), each row's segments are documents, with the
    loss mask from `labels`."""
    from pipeline.read.sources import plan_pieces, read_piece

    src = _corpus(tmp_path)
    first = parse_config(
        {
            "seq_len": SEQ,
            "global_batch_size": 4,
            "streams": {
                "code": {"paths": [str(src / "code.jsonl")], "weight": 0.6},
                "chat": {"kind": "chat", "paths": [str(src / "chat.jsonl")], "weight": 0.4},
            },
        }
    )
    run_export(first, tmp_path / "p", executor=iter_blocks_local, steps=4)
    run_export(first, tmp_path / "m", executor=iter_blocks_local, steps=4, fmt="mds")
    segments = []
    for row in _rows(tmp_path / "p"):
        a = 0
        for n in row["seq_lens"]:
            ids, labels = row["input_ids"][a : a + n], row["labels"][a : a + n]
            segments.append((ids, [int(x != -100) for x in labels]))
            a += n
    for path in (tmp_path / "m", tmp_path / "m" / "mds"):
        cfg = parse_config({"seq_len": SEQ, "streams": {"e": {"kind": "chat",
                                                              "paths": [str(path)]}}})  # fmt: skip
        stream = cfg.streams["e"]
        assert stream.format == "export" and stream.paths[0].endswith("mds/index.json")
        got = [
            (v[0].tolist(), v[1].tolist())
            for pieces in plan_pieces(stream.paths, "export", 1 << 20)
            for p in pieces
            for _, v, err in read_piece(p, "unused")
        ]
        assert got == segments
    again = parse_config(
        {
            "seq_len": SEQ,
            "global_batch_size": 4,
            "streams": {"e": {"kind": "chat", "paths": [str(tmp_path / "m")]}},
        }
    )
    s = run_export(again, tmp_path / "again", executor=iter_blocks_local)
    assert s.tokenizer_backend["pretokenized"] == s.real_tokens
    assert s.real_tokens == sum(len(ids) for ids, _ in segments)
