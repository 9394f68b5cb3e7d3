"""End to end on a real local Ray: read -> tokenize -> pack -> export."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from service.export import run_export
from tests.helpers import check_row, reassemble, rows_of
from tests.rayhead import patient

pytestmark = pytest.mark.slow


def config(corpus, mode, **extra):
    return parse_config({
        "seed": 7, "seq_len": 256, "global_batch_size": 4,
        "packing": {"mode": mode, "buffer": 32},
        "shuffle": {"window": 8},
        "read": {"block_bytes": 40_000, "first_block_bytes": 10_000},
        "streams": {"code": {"paths": [str(corpus / "*.jsonl")]}},
        **extra,
    })  # fmt: skip


def read_export(out):
    steps = {}
    for f in sorted(out.glob("step-*.parquet")):
        _, step, _, rank = f.stem.split("-")
        steps.setdefault(int(step), {})[int(rank)] = pq.read_table(f)
    return steps


def global_rows(steps):
    rows = []
    for step in sorted(steps):
        for rank in sorted(steps[step]):
            rows += list(rows_of(steps[step][rank]))
    return rows


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_export_every_document_exact_and_invariants(ray_cluster, corpus, tokenizer, tmp_path, mode):
    cfg = config(corpus, mode)
    summary = run_export(cfg, tmp_path / "out", world_size=2)
    steps = read_export(tmp_path / "out")
    assert len(steps) == summary.export.steps_written > 5
    meta = steps[0][1].schema.metadata
    assert meta[b"global_step"] == b"0" and meta[b"rank"] == b"1" and meta[b"world_size"] == b"2"
    assert meta[b"config_hash"].decode() == cfg.config_hash() and meta[b"seq_len"] == b"256"
    rows = global_rows(steps)
    for row in rows:
        check_row(row, 256, tokenizer.pad_id)
    docs = reassemble(rows)
    files = cfg.streams["code"].paths
    want = {}
    for fi, path in enumerate(files):
        for rec, line in enumerate(Path(path).read_text().splitlines()):
            try:
                text = json.loads(line)["text"]
            except ValueError:
                continue
            ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [
                tokenizer.eos_id
            ]
            want[("code", fi << 32 | rec)] = ids
    assert docs.keys() == want.keys()
    for key, ids in want.items():
        assert docs[key].tolist() == ids
    assert summary.skipped == {"code": 1}
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert rejects == [
        {"stream": "code", "file": files[1], "record": 4, "reason": rejects[0]["reason"]}
    ]
    assert summary.packing_efficiency > (0.99 if mode == "concat" else 0.95)
    assert (
        json.loads((tmp_path / "out" / "summary.json").read_text())["real_tokens"]
        == summary.real_tokens
    )


def test_two_runs_are_byte_identical_and_match_the_in_process_feed(ray_cluster, corpus, tmp_path):
    cfg = config(corpus, "bfd")
    summary = run_export(cfg, tmp_path / "a", steps=6)
    assert summary.tokenizer_backend["fastokens"] > 0  # the fast backend did run
    run_export(cfg, tmp_path / "b", steps=6)
    run_export(cfg, tmp_path / "c", steps=6, executor=iter_blocks_local)
    # The HF tokenizer alone gives the same bytes as the verified fast backend.
    hf = config(corpus, "bfd", tokenizer={"backend": "hf"})
    summary = run_export(hf, tmp_path / "h", steps=6)
    assert summary.tokenizer_backend["fastokens"] == 0 < summary.tokenizer_backend["hf"]
    names = sorted(p.name for p in (tmp_path / "a").glob("step-*"))
    assert len(names) == 6
    for name in names:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()
        assert a == (tmp_path / "h" / name).read_bytes()
    other = config(corpus, "bfd", seed=8)
    run_export(other, tmp_path / "d", steps=6)
    assert any(
        (tmp_path / "a" / n).read_bytes() != (tmp_path / "d" / n).read_bytes() for n in names
    )


def test_world_size_slices_one_global_sequence(ray_cluster, corpus, tmp_path):
    cfg = config(corpus, "concat")
    run_export(cfg, tmp_path / "w1", steps=5, world_size=1)
    run_export(cfg, tmp_path / "w4", steps=5, world_size=4)
    one, four = read_export(tmp_path / "w1"), read_export(tmp_path / "w4")
    for step in range(5):
        whole = one[step][0]
        parts = [four[step][r] for r in range(4)]
        assert all(p.num_rows == 1 for p in parts)
        for r, p in enumerate(parts):
            assert (
                p.column("input_ids").to_pylist()
                == whole.slice(r, 1).column("input_ids").to_pylist()
            )
            assert p.column("doc_id").to_pylist() == whole.slice(r, 1).column("doc_id").to_pylist()


def test_cli_export_against_a_running_cluster(ray_cluster, corpus, tmp_path):
    """Joining a running cluster, an export tokenizes on a warm pool by default (idle 5 s
    here, gone before tests/test_pool.py counts its own), or with `--pool 0` on Ray Data
    tasks: the same files either way."""
    import yaml

    address = ray_cluster.get_runtime_context().gcs_address
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "seq_len": 128, "global_batch_size": 2, "packing": {"mode": "concat"},
        "streams": {"code": {"paths": [str(corpus / "a.jsonl")]}},
    }))  # fmt: skip

    def export(out: str, *flags: str) -> None:
        r = subprocess.run(
            [sys.executable, "-m", "service", "export", "--config", str(cfg_path), "--out", str(tmp_path / out),
             "--steps", "3", "--address", address, "--pool-idle-s", "5", *flags],
            capture_output=True, text=True, timeout=patient(300),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert "packing" in r.stdout

    export("data", "--pool", "0")
    export("o")
    steps = sorted(p.name for p in (tmp_path / "o").glob("step-*-rank-0.parquet"))
    assert len(steps) == 3
    for name in steps:
        assert (tmp_path / "o" / name).read_bytes() == (tmp_path / "data" / name).read_bytes()
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["steps_written"] == 3 and s["streams"]["code"]["tokens"] == 3 * 2 * 128
    assert np.isclose(s["packing_efficiency"], 1.0)


def test_an_export_joining_a_cluster_tokenizes_on_a_warm_pool_by_default(monkeypatch):
    from pipeline.read.pool import PoolExecutor
    from pipeline.read.reading import iter_blocks_local
    from service.cli import build_parser
    from service.commands.export import _executor

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TOKENMILL_RAY_ADDRESS", raising=False)

    def chosen(*flags: str):
        return _executor(
            build_parser().parse_args(["export", "--config", "c", "--out", "o", *flags]), None
        )

    assert chosen() is None, "a private local Ray ends with the export: Ray Data"
    on_cluster = chosen("--address", "10.0.0.1:6379")
    assert isinstance(on_cluster, PoolExecutor) and on_cluster.size is None  # the cluster's CPUs
    assert chosen("--address", "10.0.0.1:6379", "--pool", "0") is None
    assert chosen("--pool", "3").size == 3
    assert chosen("--local") is iter_blocks_local
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # as under `ray job submit`
    assert isinstance(chosen(), PoolExecutor)


def test_resume_from_exported_states_on_ray_any_world_size(ray_cluster, corpus, tmp_path):
    cfg = config(corpus, "bfd")
    straight = run_export(cfg, tmp_path / "s", steps=12, world_size=2, state_every=4)
    assert straight.export.steps_written == 12
    states = sorted(p.name for p in (tmp_path / "s").glob("state-*.json"))
    assert states == ["state-00000004.json", "state-00000008.json", "state-00000012.json"]
    state = json.loads((tmp_path / "s" / "state-00000004.json").read_text())
    assert state["step"] == 4
    run_export(cfg, tmp_path / "r", steps=8, world_size=4, resume=state)
    got = read_export(tmp_path / "r")
    want = read_export(tmp_path / "s")
    assert sorted(got) == list(range(4, 12))
    for step in range(4, 12):
        whole = [r for rank in (0, 1) for r in rows_of(want[step][rank])]
        parts = [r for rank in range(4) for r in rows_of(got[step][rank])]
        assert parts == whole, step
    # the resumed run writes the same state at step 8 as the straight one
    a = json.loads((tmp_path / "s" / "state-00000008.json").read_text())
    run_export(cfg, tmp_path / "r2", steps=4, resume=state, state_every=4)
    b = json.loads((tmp_path / "r2" / "state-00000008.json").read_text())
    assert a == b


def _prefetch_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "tokenmill-prefetch" and t.is_alive()]


def _wait_gone(timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.2)
    return _prefetch_threads()


def test_closing_or_dropping_a_feed_stops_its_reads(ray_cluster, corpus):
    """Reads run ahead on background threads (every stream, the next epoch); none outlive
    the feed, whether it is closed or just dropped."""
    import gc

    from pipeline.feed import StepFeed

    cfg = config(corpus, "concat")
    cfg = cfg.model_copy(
        update={"streams": {n: s.model_copy(update={"repeat": 3}) for n, s in cfg.streams.items()}}
    )
    assert not _wait_gone()
    feed = StepFeed(cfg)
    assert feed.next_step() is not None
    assert _prefetch_threads(), "expected reads running ahead"
    feed.close()
    assert not _wait_gone()
    feed = StepFeed(cfg)
    assert feed.next_step() is not None
    del feed
    gc.collect()
    assert not _wait_gone()
