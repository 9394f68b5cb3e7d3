"""Every format, read through the same feed: doc_id locates the record, tokens match."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.feed import StepFeed
from pipeline.read.formats.jsonl import jsonl_pieces as _jsonl_pieces
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.read.sources import read_piece
from tests.conftest import stdlib_texts, write_jsonl
from tests.helpers import reassemble, rows_of


def export_local(streams, seq_len=256, mode="bfd", **extra):
    cfg = parse_config({"seq_len": seq_len, "global_batch_size": 4, "packing": {"mode": mode},
                        "streams": streams, **extra})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    rows = []
    while (b := feed.next_step()) is not None:
        rows += list(rows_of(b))
    return feed, reassemble(rows)


def expected(tokenizer, text):
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    return np.array(ids + [tokenizer.eos_id])


def test_jsonl_pieces_cut_at_line_starts_with_exact_record_indices(tmp_path):
    lines = [json.dumps({"text": f"record {i} " + "x" * (i % 37)}) for i in range(500)]
    p = tmp_path / "big.jsonl"
    p.write_text("\n".join(lines) + "\n")
    size = p.stat().st_size
    pieces = _jsonl_pieces(0, str(p), size, piece_bytes=1000)
    assert len(pieces) > 5
    seen = []
    for piece in pieces:
        for rec, value, err in read_piece(piece, "text"):
            assert err is None
            assert value.startswith(f"record {rec} ")
            seen.append(rec)
    assert seen == list(range(500))


def test_jsonl_text_parquet_mds_give_the_same_documents(tmp_path, tokenizer):
    texts = stdlib_texts(12, start=40, max_bytes=3000)
    write_jsonl(tmp_path / "d.jsonl", texts)
    tdir = tmp_path / "txt"
    tdir.mkdir()
    for i, t in enumerate(texts):
        (tdir / f"{i:03d}.txt").write_text(t)
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=5)
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"text": "str"}, size_limit=4000) as w:
        for t in texts:
            w.write({"text": t})

    def per_format(streams):
        _, docs = export_local(streams)
        return docs

    jsonl = per_format({"j": {"paths": [str(tmp_path / "d.jsonl")]}})
    assert {k[1] for k in jsonl} == set(range(12))  # file 0, records 0..11
    for (_, doc_id), toks in jsonl.items():
        assert np.array_equal(toks, expected(tokenizer, texts[doc_id & 0xFFFFFFFF]))

    text = per_format({"t": {"paths": [str(tdir)]}})
    assert {k[1] >> 32 for k in text} == set(range(12)) and {k[1] & 0xFFFFFFFF for k in text} == {0}
    for (_, doc_id), toks in text.items():
        assert np.array_equal(toks, expected(tokenizer, texts[doc_id >> 32]))

    parquet = per_format({"p": {"paths": [str(tmp_path / "d.parquet")]}})
    assert {k[1] for k in parquet} == set(range(12))  # rows across 3 row groups
    for (_, doc_id), toks in parquet.items():
        assert np.array_equal(toks, expected(tokenizer, texts[doc_id & 0xFFFFFFFF]))

    mds = per_format({"m": {"paths": [str(tmp_path / "mds")]}})
    shards = sorted((tmp_path / "mds").glob("shard.*.mds"))
    assert len(shards) > 1
    # doc_id = (shard index << 32) | sample within shard; walk shards in order to map back
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    firsts = np.cumsum([0] + [s["samples"] for s in index["shards"]])
    for (_, doc_id), toks in mds.items():
        global_i = firsts[doc_id >> 32] + (doc_id & 0xFFFFFFFF)
        assert np.array_equal(toks, expected(tokenizer, texts[global_i]))
    assert len(mds) == 12


def test_fsspec_file_url_and_gzip(tmp_path, tokenizer):
    import gzip

    texts = stdlib_texts(3, max_bytes=2000)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    _, docs = export_local({"g": {"paths": [f"file://{tmp_path}/d.jsonl.gz"]}})
    assert len(docs) == 3
    for (_, doc_id), toks in docs.items():
        assert np.array_equal(toks, expected(tokenizer, texts[doc_id]))


@pytest.mark.parametrize("bos", [False, True])
def test_bos_eos_policy_is_explicit(tmp_path, tokenizer, bos):
    write_jsonl(tmp_path / "d.jsonl", ["hello world", "second doc"])
    tok = {"name": "default", "add_bos": bos, "bos_id": 100257 if bos else None, "add_eos": not bos}
    _, docs = export_local({"s": {"paths": [str(tmp_path / "d.jsonl")]}}, tokenizer=tok)
    body = tokenizer.tokenizer.encode("hello world", add_special_tokens=False).ids
    want = [100257] + body if bos else body + [tokenizer.eos_id]
    assert docs[("s", 0)].tolist() == want


def test_special_token_text_is_not_a_special_token(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", ["a <|endoftext|> b"])
    _, docs = export_local({"s": {"paths": [str(tmp_path / "d.jsonl")]}})
    assert docs[("s", 0)].tolist().count(tokenizer.eos_id) == 1  # only the appended EOS


@pytest.mark.parametrize("fmt", ["arrow", "mds"])
def test_export_formats_hold_the_parquet_rows(tmp_path, fmt):
    from service.export import run_export

    write_jsonl(tmp_path / "d.jsonl", stdlib_texts(6, max_bytes=2000))
    cfg = parse_config(
        {
            "seq_len": 128,
            "global_batch_size": 2,
            "streams": {"s": {"paths": [str(tmp_path / "d.jsonl")]}},
        }
    )
    run_export(cfg, tmp_path / "p", executor=iter_blocks_local)
    run_export(cfg, tmp_path / "o", executor=iter_blocks_local, fmt=fmt)
    want = [
        r
        for f in sorted((tmp_path / "p").glob("step-*.parquet"))
        for r in rows_of(pq.read_table(f))
    ]
    if fmt == "arrow":
        got = [
            r
            for f in sorted((tmp_path / "o").glob("step-*.arrow"))
            for r in rows_of(pa.ipc.open_file(f).read_all())
        ]
        assert got == want
    else:
        from streaming.base.format import reader_from_json

        index = json.loads((tmp_path / "o" / "mds" / "index.json").read_text())
        samples = []
        for shard in index["shards"]:
            reader = reader_from_json(str(tmp_path / "o" / "mds"), None, shard)
            samples += [
                reader.decode_sample(reader.get_sample_data(i)) for i in range(shard["samples"])
            ]
        assert len(samples) == len(want)
        for s, r in zip(samples, want, strict=True):
            assert s["input_ids"].tolist() == r["input_ids"] and s["labels"].tolist() == r["labels"]
            assert s["tokens"].tolist() == r["input_ids"][: sum(r["seq_lens"])]
