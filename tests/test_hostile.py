"""Hostile inputs: every bad record is counted and named, every good record is kept."""

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import BadRecordError
from tests.conftest import stdlib_texts
from tests.helpers import reassemble, rows_of

GOOD = "good record number {}"


def hostile_jsonl(path):
    """Good records (text starts with 'good') interleaved with every kind of bad one."""
    big = "x = 1\n" * 400_000  # a 2.4 MB document: valid, must be kept whole
    lines = [
        json.dumps({"text": GOOD.format(0)}).encode(),
        b"{not json",
        json.dumps({"txt": "missing field"}).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": GOOD.format(1)}).encode(),
        b'{"text": "bad \xff\xfe bytes"}',
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": "   \n\t"}).encode(),
        json.dumps(["a", "list"]).encode(),
        b"",
        json.dumps({"text": big}).encode(),
        json.dumps({"text": GOOD.format(2), "extra": {"nested": [1, 2]}}).encode(),
        b"\x00\x01\x02 binary junk",
        json.dumps({"text": GOOD.format(3)}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    good = {0: GOOD.format(0), 5: GOOD.format(1), 11: big, 12: GOOD.format(2), 14: GOOD.format(3)}
    return good, 10


def _cfg(tmp_path, paths, on_error="skip", **extra):
    return parse_config({"seq_len": 128, "global_batch_size": 2, "on_error": on_error,
                         "streams": {"h": {"paths": paths}}, **extra})  # fmt: skip


def _run(cfg):
    feed = StepFeed(cfg, executor=iter_blocks_local)
    rows = []
    while (b := feed.next_step()) is not None:
        rows += list(rows_of(b))
    return feed, reassemble(rows)


def test_skip_keeps_every_good_record_and_counts_every_bad_one(tmp_path, tokenizer):
    good, n_bad = hostile_jsonl(tmp_path / "h.jsonl")
    feed, docs = _run(_cfg(tmp_path, [str(tmp_path / "h.jsonl")]))
    assert {doc_id for _, doc_id in docs} == set(good)
    for doc_id, text in good.items():
        want = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.eos_id]
        assert docs[("h", doc_id)].tolist() == want
    s = feed.summary()
    assert s.skipped == {"h": n_bad}
    assert s.streams["h"].split == 1  # the 2.4 MB document, in seq_len pieces
    reasons = {r.record: r.reason for r in feed.rejects}
    assert set(reasons) == {1, 2, 3, 4, 6, 7, 8, 9, 10, 13}
    assert "invalid JSON" in reasons[1] and "missing field 'text'" in reasons[2]
    assert "int" in reasons[3] and "null" in reasons[4] and "UTF-8" in reasons[6]
    assert "empty" in reasons[7] and "empty" in reasons[8]
    assert all(r.file == str(tmp_path / "h.jsonl") for r in feed.rejects)


def test_fail_names_the_file_and_record(tmp_path):
    hostile_jsonl(tmp_path / "h.jsonl")
    feed = StepFeed(
        _cfg(tmp_path, [str(tmp_path / "h.jsonl")], on_error="fail"), executor=iter_blocks_local
    )
    with pytest.raises(BadRecordError, match=r"h\.jsonl, record 1: invalid JSON"):
        while feed.next_step() is not None:
            pass


def test_corrupt_and_unreadable_files_are_skipped_whole_and_named(tmp_path):
    texts = stdlib_texts(4, max_bytes=500)
    pq.write_table(pa.table({"text": texts}), tmp_path / "ok.parquet")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file")
    pq.write_table(pa.table({"body": texts}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    unreadable = tmp_path / "locked.parquet"
    unreadable.write_bytes(b"")
    unreadable.chmod(0)
    feed, docs = _run(_cfg(tmp_path, [str(tmp_path / "*.parquet")]))
    files = feed.streams[0].files
    ok = files.index(str(tmp_path / "ok.parquet"))
    assert {d >> 32 for _, d in docs} == {ok} and len(docs) == 4
    by_file = {r.file.rsplit("/", 1)[-1]: r for r in feed.rejects}
    assert "corrupt" in by_file["corrupt.parquet"].reason.lower()
    assert "missing column 'text'" in by_file["nocol.parquet"].reason
    assert by_file["corrupt.parquet"].record is None
    import os

    if os.geteuid() != 0:  # root reads mode-0 files anyway
        assert "locked.parquet" in by_file


def test_a_truncated_mds_shard_gives_up_only_the_samples_it_cannot_read(tmp_path):
    """A shard cut in half: the samples whose bytes are all there are read, each of the others
    is a counted skip naming its record (it was one skip for the whole shard, its readable
    half lost)."""
    import numpy as np
    from streaming import MDSWriter

    texts = stdlib_texts(40, max_bytes=800)
    with MDSWriter(out=str(tmp_path / "mds"), columns={"text": "str"}, size_limit=1 << 14) as w:
        for t in texts:
            w.write({"text": t})
    shards = sorted((tmp_path / "mds").glob("shard.*.mds"))
    data = shards[0].read_bytes()
    cut = len(data) // 2
    shards[0].write_bytes(data[:cut])  # truncated shard
    n = json.loads((tmp_path / "mds" / "index.json").read_text())["shards"][0]["samples"]
    ends = np.frombuffer(data[8 : 4 * (n + 2)], np.uint32)
    whole = int((ends <= cut).sum())  # the samples of the first half
    assert 0 < whole < n, (whole, n)
    feed, docs = _run(_cfg(tmp_path, [str(tmp_path / "mds")]))
    lost = [r for r in feed.rejects if r.file.endswith(shards[0].name)]
    assert len(lost) == n - whole and len(feed.rejects) == n - whole
    assert sorted(r.record for r in lost) == list(range(whole, n))
    assert all("past the end of the shard" in r.reason for r in lost)
    assert len(docs) == len(texts) - (n - whole)
    assert feed.summary().streams["h"].skipped == n - whole  # the count says how many


def test_check_cli_fails_and_names_every_bad_record(tmp_path):
    hostile_jsonl(tmp_path / "h.jsonl")
    (tmp_path / "c.yaml").write_text(f"streams:\n  h:\n    paths: [{tmp_path}/h.jsonl]\n")
    r = subprocess.run([sys.executable, "-m", "service", "check", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1
    bad_lines = [line for line in r.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad_lines) == 10
    assert all(f"{tmp_path}/h.jsonl:" in line for line in bad_lines)
    assert "h.jsonl:1: invalid JSON" in r.stdout


def test_check_cli_passes_clean_data(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "c.yaml").write_text(f"streams:\n  h:\n    paths: [{tmp_path}/d.jsonl]\n")
    r = subprocess.run([sys.executable, "-m", "service", "check", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"all \d+ records ok", r.stdout), r.stdout
