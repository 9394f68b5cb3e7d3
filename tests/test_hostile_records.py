"""Hostile records (issue 13): each one is a named reject; the good records around it survive.

Lone surrogates, deep nesting, damaged and mislabeled compressed files, decompression bombs,
bare-CR line endings, and MDS indexes that are malformed or point outside their dataset.
"""

import gzip
import json
import re
import subprocess
import sys
import zlib

import pytest

from pipeline.config import ConfigError
from pipeline.inspect.stats import count_corpus, sample_lengths
from pipeline.read.formats.jsonl import jsonl_pieces as _jsonl_pieces
from pipeline.read.formats.mds import list_mds_shards
from pipeline.read.resolve import parse_config
from pipeline.read.sources import read_piece
from tests.test_hostile import _run

GOOD = "good record number {}"


def check_rejects(cfg) -> list:
    """The bad records `tokenmill check` lists (its one pass, `count_corpus`), in read order."""
    got: list = []
    count_corpus(cfg, got.append)
    return got


def _cfg(paths, on_error="skip", stream=None, **extra):
    return parse_config({"seq_len": 128, "global_batch_size": 2, "on_error": on_error,
                         "streams": {"h": {"paths": paths, **(stream or {})}}, **extra})  # fmt: skip


def _expect(tokenizer, text):
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.eos_id]


def _assert_kept(docs, tokenizer, good: dict[int, str]):
    """Exactly the records of `good` (record index -> text) came out, with the right tokens."""
    assert {doc_id for _, doc_id in docs} == set(good)
    for doc_id, text in good.items():
        assert docs[("h", doc_id)].tolist() == _expect(tokenizer, text)


# --- 1. lone surrogates --------------------------------------------------------------------


def _surrogate_jsonl(path):
    lines = [
        json.dumps({"text": GOOD.format(0)}),
        json.dumps({"text": "ab\ud800cd"}),  # json.dumps writes the escape "\ud800"
        json.dumps({"text": "smile \ud83d\ude00 pair"}),  # a valid pair: one character, good
        json.dumps({"text": "\udc00 low alone"}),
        json.dumps({"text": GOOD.format(4)}),
    ]
    assert "\\ud800" in lines[1]
    path.write_text("\n".join(lines) + "\n")
    return {0: GOOD.format(0), 2: "smile \U0001f600 pair", 4: GOOD.format(4)}


@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_lone_surrogate_is_a_named_reject_with_every_backend(tmp_path, tokenizer, backend):
    good = _surrogate_jsonl(tmp_path / "s.jsonl")
    cfg = _cfg([str(tmp_path / "s.jsonl")], tokenizer={"backend": backend})
    feed, docs = _run(cfg)
    _assert_kept(docs, tokenizer, good)
    assert feed.summary().skipped == {"h": 2}
    got = {(r.file, r.record): r.reason for r in feed.rejects}
    path = str(tmp_path / "s.jsonl")
    assert got == {
        (path, 1): "text has a lone surrogate (U+D800) at character 2",
        (path, 3): "text has a lone surrogate (U+DC00) at character 0",
    }


def test_check_and_stats_agree_on_lone_surrogates(tmp_path):
    _surrogate_jsonl(tmp_path / "s.jsonl")
    cfg = _cfg([str(tmp_path / "s.jsonl")])
    assert [(r.record, r.reason) for r in check_rejects(cfg)] == [
        (1, "text has a lone surrogate (U+D800) at character 2"),
        (3, "text has a lone surrogate (U+DC00) at character 0"),
    ]
    lengths, skipped = sample_lengths(cfg)["h"]
    assert len(lengths) == 3 and skipped == 2


def test_check_and_stats_cli_on_lone_surrogates(tmp_path):
    _surrogate_jsonl(tmp_path / "s.jsonl")
    (tmp_path / "c.yaml").write_text(f"streams:\n  h:\n    paths: [{tmp_path}/s.jsonl]\n")

    def cli(cmd):
        args = [sys.executable, "-m", "service", cmd, "--config", str(tmp_path / "c.yaml")]
        return subprocess.run(args, capture_output=True, text=True)

    r = cli("check")
    assert r.returncode == 1, r.stdout + r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("BAD")] == [
        f"BAD h: {tmp_path}/s.jsonl:1: text has a lone surrogate (U+D800) at character 2",
        f"BAD h: {tmp_path}/s.jsonl:3: text has a lone surrogate (U+DC00) at character 0",
    ]
    r = cli("stats")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stream h: 3 docs sampled" in r.stdout
    assert "2 bad record(s) skipped while sampling" in r.stdout


def test_lone_surrogate_in_chat_content_is_a_named_reject(tmp_path):
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\udfffy"}]
    (tmp_path / "c.jsonl").write_text(
        "\n".join(json.dumps({"messages": m}) for m in (ok, bad, ok)) + "\n"
    )
    feed, docs = _run(_cfg([str(tmp_path / "c.jsonl")], stream={"kind": "chat"}))
    assert {doc_id for _, doc_id in docs} == {0, 2}
    assert [(r.record, r.reason) for r in feed.rejects] == [
        (1, "message 1: content has a lone surrogate (U+DFFF) at character 1")
    ]


# --- 2. deep nesting ---------------------------------------------------------------------


def test_deeply_nested_field_is_a_named_reject(tmp_path, tokenizer):
    deep = "[" * 100_000 + "]" * 100_000
    lines = [
        json.dumps({"text": GOOD.format(0)}),
        '{"text": "fine text", "meta": ' + deep + "}",
        '{"text": ' + deep + "}",
        json.dumps({"text": GOOD.format(3)}),
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    feed, docs = _run(_cfg([str(tmp_path / "d.jsonl")]))
    _assert_kept(docs, tokenizer, {0: GOOD.format(0), 3: GOOD.format(3)})
    assert [(r.record, r.reason) for r in feed.rejects] == [
        (1, "invalid JSON: nested too deeply"),
        (2, "invalid JSON: nested too deeply"),
    ]
    assert all(r.file == str(tmp_path / "d.jsonl") for r in feed.rejects)


# --- 3. damaged compressed files ---------------------------------------------------------


def test_truncated_gzip_keeps_every_complete_record_before_the_cut(tmp_path, tokenizer):
    texts = [f"record {i} " + "y" * (i % 50) for i in range(3000)]
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    cut = data[: len(data) * 6 // 10]
    (tmp_path / "t.jsonl.gz").write_bytes(cut)
    readable = zlib.decompressobj(31).decompress(cut)  # what any reader could recover
    complete = readable.count(b"\n")
    assert 1000 < complete < 3000
    feed, docs = _run(_cfg([str(tmp_path / "t.jsonl.gz")]))
    _assert_kept(docs, tokenizer, {i: texts[i] for i in range(complete)})
    assert feed.summary().skipped == {"h": 1}
    (r,) = feed.rejects
    assert (r.file, r.record) == (str(tmp_path / "t.jsonl.gz"), complete)
    assert r.reason == (
        f"damaged input after {len(readable)} bytes (EOFError: Compressed file ended "
        "before the end-of-stream marker was reached)"
    )


def test_corrupt_gzip_member_keeps_the_records_before_it(tmp_path):
    first = "".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(5)).encode()
    second = gzip.compress(
        b"".join(json.dumps({"text": f"b{i}"}).encode() + b"\n" for i in range(5))
    )
    damaged = second[:20] + bytes(b ^ 0xFF for b in second[20:40]) + second[40:]
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(first) + damaged)
    got = list(check_rejects(_cfg([str(tmp_path / "c.jsonl.gz")])))
    assert [(r.record, r.reason.split(" (")[0]) for r in got] == [
        (5, "damaged input after 75 bytes")  # the 5 records of the intact first member kept
    ]


# --- 4. record size cap, decompression bombs ---------------------------------------------


def _bomb(path, line_bytes: int):
    """good, one `line_bytes` line, good, good: gzip, written without holding the big line."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(json.dumps({"text": GOOD.format(0)}).encode() + b"\n")
        f.write(b'{"text": "')
        block = b"x" * (1 << 20)
        for _ in range(line_bytes >> 20):
            f.write(block)
        f.write(b'"}\n')
        f.write(json.dumps({"text": GOOD.format(2)}).encode() + b"\n")
        f.write(json.dumps({"text": GOOD.format(3)}).encode())  # no final newline


def test_record_over_the_cap_is_rejected_and_later_records_survive(tmp_path, tokenizer):
    _bomb(tmp_path / "b.jsonl.gz", 8 << 20)
    cfg = _cfg([str(tmp_path / "b.jsonl.gz")], read={"max_record_bytes": 1 << 20})
    feed, docs = _run(cfg)
    _assert_kept(docs, tokenizer, {0: GOOD.format(0), 2: GOOD.format(2), 3: GOOD.format(3)})
    assert [(r.record, r.reason) for r in feed.rejects] == [
        (1, f"record of {(8 << 20) + 12} bytes is longer than read.max_record_bytes (1048576)")
    ]


def test_cap_applies_to_plain_jsonl_pieces_and_text_files(tmp_path):
    big = json.dumps({"text": "z" * 5000})
    lines = [json.dumps({"text": f"r{i}"}) if i % 7 else big for i in range(200)]
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines))
    pieces = _jsonl_pieces(0, str(p), p.stat().st_size, piece_bytes=2000, max_record=4096)
    assert len(pieces) > 3
    got = [(rec, err) for piece in pieces for rec, _, err in read_piece(piece, "text")]
    assert [rec for rec, _ in got] == list(range(200))
    assert [rec for rec, err in got if err] == list(range(0, 200, 7))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("small")
    (tmp_path / "t" / "b.txt").write_text("q" * 5000)
    cfg = _cfg([str(tmp_path / "t")], read={"max_record_bytes": 4096})
    assert [(r.file.rsplit("/", 1)[-1], r.reason) for r in check_rejects(cfg)] == [
        ("b.txt", "file is longer than read.max_record_bytes (4096)")
    ]


def test_gzip_bomb_is_read_in_bounded_memory(tmp_path):
    _bomb(tmp_path / "b.jsonl.gz", 64 << 20)
    code = f"""
import resource
from pipeline.read.access import Piece
from pipeline.read.sources import read_piece
piece = Piece(0, {str(tmp_path / "b.jsonl.gz")!r}, "jsonl", max_record=1 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = [(rec, err) for rec, _, err in read_piece(piece, "text")]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(out[1][0], (after - before) // 1024, [rec for rec, err in out if err is None])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rec, grown_mib, good = r.stdout.split(" ", 2)
    assert rec == "1" and good.strip() == "[0, 2, 3]"
    assert int(grown_mib) < 24, r.stdout  # the 64 MiB line was never held


def test_max_record_bytes_is_validated_and_keeps_default_hashes(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "x"}\n')
    base = {"streams": {"s": {"paths": [str(tmp_path / "x.jsonl")]}}}
    with pytest.raises(ConfigError, match="max_record_bytes"):
        parse_config(base | {"read": {"max_record_bytes": 0}})
    default = parse_config(base)
    assert default.read.max_record_bytes == 64 << 20
    same = parse_config(base | {"read": {"max_record_bytes": 64 << 20}})
    assert same.config_hash() == default.config_hash()
    other = parse_config(base | {"read": {"max_record_bytes": 1 << 20}})
    assert other.config_hash() != default.config_hash()


# --- 5. bare CR, mislabeled .gz ----------------------------------------------------------


def test_bare_cr_file_is_read_line_by_line(tmp_path, tokenizer):
    texts = [f"mac line {i}" for i in range(300)]
    body = "\r".join(json.dumps({"text": t}) for t in texts) + "\r"
    (tmp_path / "m.jsonl").write_bytes(body.encode())
    size = len(body)
    assert len(_jsonl_pieces(0, str(tmp_path / "m.jsonl"), size, piece_bytes=1000)) == 1
    feed, docs = _run(_cfg([str(tmp_path / "m.jsonl")], read={"first_block_bytes": 1024}))
    _assert_kept(docs, tokenizer, dict(enumerate(texts)))
    assert not feed.rejects


def test_crlf_file_keeps_its_record_indices(tmp_path, tokenizer):
    texts = [f"dos line {i}" for i in range(50)]
    body = "\r\n".join(json.dumps({"text": t}) for t in texts) + "\r\n"
    (tmp_path / "w.jsonl").write_bytes(body.encode())
    feed, docs = _run(_cfg([str(tmp_path / "w.jsonl")]))
    _assert_kept(docs, tokenizer, dict(enumerate(texts)))
    assert not feed.rejects


def test_cr_as_json_whitespace_in_an_lf_file_is_not_a_line_ending(tmp_path, tokenizer):
    (tmp_path / "x.jsonl").write_bytes(b'{"text":\r"first"}\r\n{"text": "second"}\n')
    feed, docs = _run(_cfg([str(tmp_path / "x.jsonl")]))
    _assert_kept(docs, tokenizer, {0: "first", 1: "second"})
    assert not feed.rejects


def test_gz_that_is_plain_text_is_read_as_plain_text(tmp_path, tokenizer):
    texts = [GOOD.format(i) for i in range(4)]
    (tmp_path / "p.jsonl.gz").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    feed, docs = _run(_cfg([str(tmp_path / "p.jsonl.gz")]))
    _assert_kept(docs, tokenizer, dict(enumerate(texts)))
    assert not feed.rejects


# --- 6. MDS index ------------------------------------------------------------------------


def _mds(tmp_path, n=6):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"text": "str"}, size_limit=200) as w:
        for i in range(n):
            w.write({"text": GOOD.format(i) + " " + "w" * 60})
    index = tmp_path / "mds" / "index.json"
    return index, json.loads(index.read_text())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: None, r"shard 1: entry is a JSON NoneType, expected an object"),
        (lambda s: s | {"raw_data": None}, r"shard 1: has neither 'raw_data' nor 'zip_data'"),
        (lambda s: s | {"raw_data": {"bytes": 3}}, r"shard 1: raw_data.basename must be a file"),
        (lambda s: s | {"samples": "many"}, r"shard 1: 'samples' must be a count"),
        (
            lambda s: s | {"raw_data": s["raw_data"] | {"basename": "../../../../etc/hostname"}},
            r"shard 1: raw_data.basename '../../../../etc/hostname' leaves the dataset directory",
        ),
        (
            lambda s: s | {"raw_data": s["raw_data"] | {"basename": "/etc/hostname"}},
            r"shard 1: raw_data.basename '/etc/hostname' leaves the dataset directory",
        ),
    ],
)
def test_bad_mds_index_entry_is_a_clear_error(tmp_path, damage, message):
    index, obj = _mds(tmp_path)
    assert len(obj["shards"]) > 2
    obj["shards"][1] = damage(obj["shards"][1])
    index.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=re.escape(f"{index}: ") + message):
        list_mds_shards([str(index)])
    with pytest.raises(ValueError, match=message):
        _run(_cfg([str(tmp_path / "mds")]))


def test_good_mds_index_still_reads(tmp_path):
    index, obj = _mds(tmp_path)
    feed, docs = _run(_cfg([str(tmp_path / "mds")]))
    assert len(docs) == 6 and not feed.rejects


# --- issue 24: truncated Arrow IPC, booleans as token ids, storage options in messages -----


def _arrow(path, texts, file_format: bool, rows_per_batch: int = 20):
    import pyarrow as pa

    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_file if file_format else pa.ipc.new_stream
        with new(sink, table.schema) as w:
            w.write_table(table, max_chunksize=rows_per_batch)


@pytest.mark.parametrize("file_format", [False, True], ids=["stream", "file"])
@pytest.mark.parametrize("piece_bytes", [None, 1024], ids=["one-piece", "many-pieces"])
def test_truncated_arrow_ipc_keeps_every_complete_batch(
    tmp_path, tokenizer, file_format, piece_bytes
):
    """Like a truncated .jsonl.gz: the complete record batches before the cut are read, and
    the cut is one reject naming the file, at the first row not read."""
    texts = [GOOD.format(i) + " " + "z" * (i % 40) for i in range(100)]
    whole = tmp_path / "whole.arrow"
    _arrow(whole, texts, file_format)
    data = whole.read_bytes()
    path = tmp_path / "t.arrow"
    path.write_bytes(data[: len(data) * 7 // 10])
    complete = 60  # 3 batches of 20 rows fit in 70% of the bytes, the 4th does not
    read = (
        {"read": {"block_bytes": piece_bytes, "first_block_bytes": piece_bytes}}
        if piece_bytes
        else {}
    )
    feed, docs = _run(_cfg([str(path)], **read))
    _assert_kept(docs, tokenizer, {i: texts[i] for i in range(complete)})
    assert feed.summary().skipped == {"h": 1}
    (r,) = feed.rejects
    assert (r.file, r.record) == (str(path), complete)
    assert r.reason.startswith(
        "truncated or corrupt Arrow IPC: 3 complete record batches (60 rows) were read, then "
        "the batch after them is damaged"
    ), r.reason
    assert [(x.record, x.reason) for x in check_rejects(_cfg([str(path)], **read))] == [
        (complete, r.reason)
    ]


def test_arrow_file_without_its_footer_keeps_every_batch_and_says_so(tmp_path, tokenizer):
    """Cut exactly after the stream's end-of-stream marker: every batch is there, the footer
    is not; the file is read as its stream and the missing footer is one reject."""
    texts = [GOOD.format(i) for i in range(50)]
    _arrow(tmp_path / "w.arrow", texts, file_format=True)
    data = (tmp_path / "w.arrow").read_bytes()
    eos = data.rindex(b"\xff\xff\xff\xff\x00\x00\x00\x00") + 8
    (tmp_path / "f.arrow").write_bytes(data[:eos])
    feed, docs = _run(_cfg([str(tmp_path / "f.arrow")]))
    _assert_kept(docs, tokenizer, dict(enumerate(texts)))
    (r,) = feed.rejects
    assert r.record == 50 and "no readable footer" in r.reason, r.reason


def test_a_boolean_in_token_ids_is_a_bad_record(tmp_path):
    """numpy reads [1, true] as [1, 1]: the record is bad, not a document of ids."""
    lines = [[5, 6], [1, True], [False], [7, 8, 9], [2, 3.0]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"ids": v}) + "\n" for v in lines))
    stream = {"tokens_field": "ids"}
    cfg = _cfg([str(tmp_path / "ids.jsonl")], stream=stream, tokenizer={"add_eos": False})
    feed, docs = _run(cfg)
    assert {k[1]: v.tolist() for k, v in docs.items()} == {0: [5, 6], 3: [7, 8, 9]}
    got = {r.record: r.reason for r in feed.rejects}
    assert set(got) == {1, 2, 4}
    assert got[1] == "field holds a boolean (True at index 1): booleans are not token ids"
    assert got[2] == "field holds a boolean (False at index 0): booleans are not token ids"


SECRET_PATH = "SECRETPATH-0f3a"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_config_kwargs_value_never_appears_in_an_error():
    opts = {"key": "k", "secret": "s", "config_kwargs": {"region_name": "SECRET REGION 7"}}
    with pytest.raises(ConfigError) as e:
        parse_config({"streams": {"s": {"paths": ["s3://b/x/*.jsonl"], "storage_options": opts}}})
    assert "SECRET REGION 7" not in str(e.value)
    assert "<storage_options.config_kwargs.region_name>" in str(e.value), str(e.value)


def test_an_endpoint_url_never_appears_in_an_error_or_a_reject(tmp_path):
    """An unreachable endpoint: botocore quotes the URL whole, in the error resolving the
    paths and in the reject of a read; both show the option's name instead."""
    from pipeline.read.access import Access, Piece
    from pipeline.read.formats import ReadSpec

    endpoint = f"http://127.0.0.1:{_closed_port()}/{SECRET_PATH}"
    opts = {"endpoint_url": endpoint, "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        parse_config({"streams": {"s": {"paths": ["s3://b/x/*.jsonl"], "storage_options": opts}}})
    assert SECRET_PATH not in str(e.value) and "127.0.0.1" not in str(e.value)
    assert "<storage_options.endpoint_url>" in str(e.value), str(e.value)
    piece = Piece(0, "s3://b/x/a.jsonl", "jsonl")
    (rec, value, reason), *_ = read_piece(piece, ReadSpec("text", access=Access(opts)))
    assert value is None and reason is not None
    assert SECRET_PATH not in reason and "127.0.0.1" not in reason
    assert "<storage_options.endpoint_url" in reason, reason


def test_a_boolean_in_an_mds_json_column_of_token_ids_is_a_bad_record(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"ids": "json"}) as w:
        for ids in ([5, 6], [1, True], [7, 8, 9]):
            w.write({"ids": ids})
    stream = {"tokens_field": "ids"}
    cfg = _cfg([str(tmp_path / "mds")], stream=stream, tokenizer={"add_eos": False})
    feed, docs = _run(cfg)
    assert {k[1]: v.tolist() for k, v in docs.items()} == {0: [5, 6], 2: [7, 8, 9]}
    assert [(r.record, r.reason) for r in feed.rejects] == [
        (1, "field holds a boolean (True at index 1): booleans are not token ids")
    ]
