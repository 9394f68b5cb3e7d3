"""The typed run summary (pipeline/state/summary.py): its JSON keeps summary.json's and the API's
shape, and its declared per-stream gauges are what Prometheus exports (issue 16)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from pipeline.read.reading import iter_blocks_local
from pipeline.state.summary import StreamSummary, stream_gauges
from service.export import run_export
from service.prometheus import prometheus_text
from tests.test_golden import _config, _corpus

# summary.json's keys (docs: README "export"), recorded before RunSummary replaced the dict.
TOP = {
    "config_hash", "elapsed_s", "exhausted", "format", "global_batch_size", "layout",
    "mixture_history", "packing_efficiency", "phases", "real_tokens", "rejects_file",
    "rejects_written", "rows", "seq_len", "skipped", "startup_s", "steady_tokens_per_s", "steps",
    "steps_written", "streams", "time_to_first_block_s", "time_to_first_step_s",
    "tokenizer_backend", "tokenizer_guarantees", "tokens_per_s", "wall_s", "world_size",
    "resumed_from_step", "this_run",
}  # fmt: skip
PHASES = {
    "imports_and_config", "ray_connected", "feed_started", "first_block_in_process",
    "first_block_from_executor", "first_step_written", "last_step_written", "writing_s",
    "tokens_made_here", "tokens_made_by_executor",
}  # fmt: skip
STREAM = {
    "tokens", "docs", "docs_read", "tokens_read", "skipped", "split", "truncated", "dropped",
    "truncated_tokens", "dropped_tokens", "target_share", "realized_share", "epochs_started",
    "backend_tokens", "length",
}  # fmt: skip


def test_summary_json_is_the_typed_summary_with_the_same_shape(tmp_path):
    _corpus(tmp_path)
    s = run_export(
        _config(tmp_path), tmp_path / "o", steps=6, world_size=2, executor=iter_blocks_local
    )
    on_disk = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert set(on_disk) == TOP and set(on_disk["phases"]) == PHASES
    assert all(set(st) == STREAM for st in on_disk["streams"].values())
    d = s.as_dict()
    assert on_disk["wall_s"] <= d.pop("wall_s")  # the returned figure includes the writing
    assert {k: v for k, v in on_disk.items() if k != "wall_s"} == d
    # The export's clock replaces the feed's in the JSON; the feed's own stays on the object.
    assert d["elapsed_s"] == s.export.elapsed_s != s.elapsed_s
    assert s.skipped == {n: st.skipped for n, st in s.streams.items()} == on_disk["skipped"]
    assert s.export.steps_written == 6 and s.steps == 6 and s.rows == 6 * 8
    assert on_disk["mixture_history"] == [
        {"step": 0, "weights": {"code": 0.7, "chat": 0.3}, "source": "config"}
    ]


def test_prometheus_stream_gauges_are_the_declared_fields():
    declared = [name for name, _ in stream_gauges()]
    assert declared == ["tokens", "docs", "skipped", "split", "truncated", "dropped",
                        "target_share", "realized_share"]  # fmt: skip
    share = {k: 0 for k in STREAM} | {"tokens": 7, "realized_share": 0.25}
    assert set(share) == {f for f in StreamSummary.__dataclass_fields__}
    m = {"tokens_per_s": 1.0, "batches_per_s": 1.0, "global_step": 9, "packing_efficiency": 0.9,
         "data_wait_s_last_60s": 0.5, "streams": {"web": share}, "queue_depth": {}}  # fmt: skip
    text = prometheus_text(m, {"state": "running"})
    from service.prometheus import STREAM_COUNTERS

    for name, doc in stream_gauges():
        metric = f"tokenmill_stream_{name}" + ("_total" if name in STREAM_COUNTERS else "")
        assert f"# HELP {metric} {doc}\n" in text
    assert 'tokenmill_stream_tokens_total{stream="web"} 7.0' in text
    assert 'tokenmill_stream_realized_share{stream="web"} 0.25' in text
    assert "tokenmill_stream_docs_read" not in text  # not declared a gauge


def test_a_resumed_export_reports_its_own_totals_beside_the_runs(tmp_path, capsys):
    """Its state carries the run's counts since step 0; the summary labels both (issue 30)."""
    import yaml

    from service.cli import main

    _corpus(tmp_path)
    cfg = _config(tmp_path)
    straight = run_export(cfg, tmp_path / "s", steps=5, state_every=3, executor=iter_blocks_local)
    assert straight.export.resumed_from_step is None
    assert straight.export.this_run.as_dict()["steps"] == 5 == straight.steps
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "r"
    assert main(["export", "--config", str(tmp_path / "c.yaml"), "--out", str(out), "--steps", "2",
                 "--resume", str(tmp_path / "s" / "state-00000003.json"), "--local"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    run = s["this_run"]
    assert s["resumed_from_step"] == 3 and s["steps_written"] == 2
    assert s["steps"] == 5 and run["steps"] == 2  # the run so far, and this export's part
    assert s["real_tokens"] == straight.real_tokens  # the same 5 steps as the straight run
    written = sum(int(pq.read_table(p).column("seq_lens").combine_chunks().flatten().to_numpy().sum())
                  for p in out.glob("step-*.parquet"))  # fmt: skip
    assert run["real_tokens"] == written < s["real_tokens"]
    assert run["rows"] == 2 * 8 and s["rows"] == 5 * 8
    for name, st in s["streams"].items():
        assert 0 < run["streams"][name]["tokens"] < st["tokens"], name
    assert sum(st["tokens"] for st in run["streams"].values()) == written
    assert "2 this run (steps 3-4), 5 since step 0" in printed
    assert f"{written:,} this run, {straight.real_tokens:,} since step 0" in printed
