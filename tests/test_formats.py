"""Formats as plug-ins (pipeline/read/formats/): the registry, inference, metadata files, Arrow IPC
(file and stream format, split into pieces) and Hugging Face `save_to_disk` directories."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import ConfigError
from pipeline.read import formats
from pipeline.read.resolve import parse_config
from pipeline.read.sources import plan_pieces, read_piece
from tests.conftest import stdlib_texts, write_jsonl
from tests.test_sources import export_local


def test_every_format_module_is_registered_and_inferred_by_its_files():
    assert set(formats.registry()) == {"jsonl", "parquet", "text", "mds", "arrow", "export"}
    infer = formats.infer_format
    assert infer("/d/x.jsonl.gz") == infer("/d/x.json") == "jsonl"
    assert infer("/d/x.parquet") == "parquet" and infer("/d/x.txt") == "text"
    assert infer("/d/index.json") == "mds"
    assert infer("/d/data-00000-of-00002.arrow") == "arrow"
    assert infer("/d/step-00000003-rank-1.arrow") == "export"  # an export's step name wins
    assert infer("/d/step-00000003-rank-1.parquet") == "export"
    assert infer("/d/shard.00000.mds") is None
    with pytest.raises(ConfigError, match="format: must be one of arrow, export, jsonl"):
        parse_config({"streams": {"s": {"paths": ["x"], "format": "csv"}}})


def test_metadata_files_are_never_records(tmp_path):
    """A directory holding `state.json`, `dataset_info.json` or `index.json` beside JSONL is
    read as its JSONL only (these used to be read as JSONL records, and rejected)."""
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "a.jsonl", ["one", "two"])
    (d / "state.json").write_text(json.dumps({"_data_files": []}))
    (d / "dataset_info.json").write_text("{}")
    (d / "sub").mkdir()
    (d / "sub" / "index.json").write_text(json.dumps({"shards": []}))
    cfg = parse_config({"streams": {"s": {"paths": [str(d)], "format": "jsonl"}}})
    assert cfg.streams["s"].paths == [str(d / "a.jsonl")]
    with pytest.raises(ConfigError, match="_data_files is empty"):  # a datasets directory
        parse_config({"streams": {"s": {"paths": [str(d)]}}})
    (d / "sub" / "index.json").unlink()
    (d / "dataset_info.json").unlink()
    cfg = parse_config({"streams": {"s": {"paths": [str(d)]}}})  # inferred: jsonl
    assert cfg.streams["s"].paths == [str(d / "a.jsonl")] and cfg.streams["s"].format == "jsonl"


def _arrow(path, texts, stream: bool, batch_rows: int):
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    batches = table.to_batches(max_chunksize=batch_rows)
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as w:
        for b in batches:
            w.write_batch(b)


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_arrow_pieces_split_large_files_and_keep_record_indices(tmp_path, stream):
    texts = stdlib_texts(40, max_bytes=1500)
    path = tmp_path / "d.arrow"
    _arrow(path, texts, stream, batch_rows=25)  # a batch of 25 rows, then one of 15
    [pieces] = plan_pieces([str(path)], "arrow", piece_bytes=4000)
    assert len(pieces) > 4  # record batches cut into row ranges of about 4000 bytes
    assert pieces[0].start == 0 and pieces[-1].end == 40
    assert all(a.end == b.start for a, b in zip(pieces, pieces[1:], strict=False))
    got = [(rec, v) for p in pieces for rec, v, err in read_piece(p, "text") if err is None]
    assert got == list(enumerate(texts))
    [whole] = plan_pieces([str(path)], "arrow", piece_bytes=1 << 30)
    assert [(p.start, p.end) for p in whole] == [(0, 40)]
    [[bad]] = plan_pieces([str(path)], "arrow", 1 << 20)
    assert list(read_piece(bad, "nope"))[0][2].startswith("missing column 'nope'")


def test_corrupt_arrow_file_is_one_named_reject(tmp_path):
    (tmp_path / "bad.arrow").write_bytes(b"ARROW1\x00\x00garbage")
    [[piece]] = plan_pieces([str(tmp_path / "bad.arrow")], "arrow", 1 << 20)
    [(rec, value, err)] = list(read_piece(piece, "text"))
    assert value is None and "Arrow IPC" in err


def test_arrow_gives_the_jsonl_documents(tmp_path, tokenizer):
    texts = stdlib_texts(10, start=30, max_bytes=2500)
    write_jsonl(tmp_path / "d.jsonl", texts)
    _arrow(tmp_path / "d.arrow", texts, stream=True, batch_rows=3)
    _, want = export_local({"s": {"paths": [str(tmp_path / "d.jsonl")]}})
    _, got = export_local({"s": {"paths": [str(tmp_path / "d.arrow")]},},
                          read={"first_block_bytes": 1024})  # fmt: skip
    assert len(got) == 10 and got.keys() == want.keys()
    for key in want:
        assert np.array_equal(got[key], want[key])


def test_hf_save_to_disk_directory_is_read_in_state_order(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")  # the `bench` extra; CI installs it
    texts = stdlib_texts(14, start=50, max_bytes=2500)
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    state = json.loads((tmp_path / "hf" / "state.json").read_text())
    names = [f["filename"] for f in state["_data_files"]]
    assert len(names) == 3 and (tmp_path / "hf" / "dataset_info.json").exists()
    cfg = parse_config({"streams": {"hf": {"paths": [str(tmp_path / "hf")]}}})
    assert cfg.streams["hf"].format == "arrow"
    assert cfg.streams["hf"].paths == [str(tmp_path / "hf" / n) for n in names]
    # Shuffled `_data_files` order is the order read (file_index follows state.json).
    state["_data_files"] = state["_data_files"][::-1]
    (tmp_path / "hf" / "state.json").write_text(json.dumps(state))
    cfg = parse_config({"streams": {"hf": {"paths": [str(tmp_path / "hf")]}}})
    assert cfg.streams["hf"].paths == [str(tmp_path / "hf" / n) for n in names[::-1]]

    write_jsonl(tmp_path / "d.jsonl", texts)
    _, want = export_local({"s": {"paths": [str(tmp_path / "d.jsonl")]}})
    _, got = export_local({"s": {"paths": [str(tmp_path / "hf")]}})
    firsts = np.cumsum([0] + [len(ds.shard(3, i, contiguous=True)) for i in range(3)])
    assert len(got) == len(texts)
    for (_, doc_id), toks in got.items():
        shard = 2 - (doc_id >> 32)  # file_index 0 is the last shard now
        index = int(firsts[shard]) + (doc_id & 0xFFFFFFFF)
        assert np.array_equal(toks, want[("s", index)])


def test_datasets_directories_that_cannot_be_one_stream_are_named(tmp_path):
    """A `_data_files` name that leaves the directory, and a DatasetDict (several splits)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "dataset_info.json").write_text("{}")
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../etc/x.arrow"}]}))
    with pytest.raises(ConfigError, match=r"_data_files 0: bad file name '../../etc/x.arrow'"):
        parse_config({"streams": {"s": {"paths": [str(d)]}}})
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    for split in ("train", "test"):
        (tmp_path / "dd" / split).mkdir()
        _arrow(tmp_path / "dd" / split / "data-00000-of-00001.arrow", ["x"], True, 1)
    with pytest.raises(ConfigError, match=r"DatasetDict; give one split's directory .*/dd/test"):
        parse_config({"streams": {"s": {"paths": [str(tmp_path / "dd")]}}})


def test_a_piece_read_in_parts_gives_its_rows_in_order_in_every_format(tmp_path):
    """Piece.skip/take (the interleave's ramp reads a piece's first rows ahead of the rest):
    the parts of a piece, read one after another, are the piece's rows, bad ones included."""
    import pyarrow.parquet as pq

    texts = stdlib_texts(30, max_bytes=800)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[3], lines[11], lines[12] = "{not json", "", json.dumps({"other": 1})
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=30)
    _arrow(tmp_path / "d.arrow", texts, stream=False, batch_rows=7)
    for fmt in ("jsonl", "parquet", "arrow"):
        [[piece]] = plan_pieces([str(tmp_path / f"d.{fmt}")], fmt, piece_bytes=1 << 20)
        assert formats.get(fmt).parts
        whole = list(read_piece(piece, "text"))
        assert len(whole) == 30
        for cuts in ([0, 1, 30], [0, 4, 6, 10, 18, -1], [0, 12, 40, -1], [0, 29, -1]):
            got = []
            for a, b in zip(cuts, cuts[1:], strict=False):
                part = dataclasses.replace(piece, skip=a, take=-1 if b < 0 else b - a)
                got += list(read_piece(part, "text"))
            assert got == whole, (fmt, cuts)
    assert not formats.get("text").parts and not formats.get("export").parts
    jsonl = formats.get("jsonl")
    assert jsonl.reads_in_parts(dataclasses.replace(piece, path="d.jsonl"))
    for name in ("d.jsonl.gz", "d.jsonl.zst", "d.jsonl.bz2"):  # each part would decompress
        assert not jsonl.reads_in_parts(dataclasses.replace(piece, path=name))
