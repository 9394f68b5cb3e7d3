"""`tokenmill stats`: the token-length distribution and the seq_len it implies."""

import subprocess
import sys

import numpy as np
import pytest

from pipeline.inspect.stats import mixture_seq_len, sample_lengths
from pipeline.read.resolve import parse_config
from pipeline.state.summary import describe_lengths
from tests.conftest import write_jsonl


def test_describe_lengths_golden():
    d = describe_lengths(np.array([10] * 98 + [300, 1000]))
    assert d["docs"] == 100 and d["p50"] == 10 and d["max"] == 1000
    assert d["mean"] == (980 + 1300) / 100
    assert sum(d["histogram"]["counts"]) == 100


def test_sample_lengths_tokenizes_real_records(tmp_path, tokenizer):
    texts = ["word " * n for n in (5, 50, 500)]
    write_jsonl(tmp_path / "d.jsonl", texts)
    cfg = parse_config({"streams": {"s": {"paths": [str(tmp_path / "d.jsonl")]}}})
    lengths, skipped = sample_lengths(cfg, docs=10)["s"]
    want = sorted(
        len(tokenizer.tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in texts
    )
    assert sorted(lengths.tolist()) == want and skipped == 0


def test_stats_cli_prints_histogram_and_recommendation(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ["word " * n for n in range(1, 60)])
    (tmp_path / "c.yaml").write_text(f"streams:\n  s:\n    paths: [{tmp_path}/d.jsonl]\n")
    r = subprocess.run([sys.executable, "-m", "service", "stats", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "p50" in r.stdout and "p99" in r.stdout and "#" in r.stdout
    assert "recommended seq_len: 64 for the whole mixture" in r.stdout
    assert r.stdout.count("recommended seq_len") == 1  # one, not one per stream


def test_one_seq_len_for_the_mixture_counts_documents_as_the_weights_take_them():
    """Long documents at a small token weight are few of the mixture's documents: they do not
    set the row for everything (each stream's own p99 would say 128 and 8192)."""
    short, long = np.full(100, 100), np.full(100, 5000)
    few = mixture_seq_len({"a": short, "b": long}, {"a": 0.9, "b": 0.1})
    # per token: a 0.9/100 documents, b 0.1/5000: b's are 0.2% of the mixture's documents
    assert few["seq_len"] == 128
    assert few["doc_share"]["b"] == pytest.approx((0.1 / 5000) / (0.9 / 100 + 0.1 / 5000))
    assert few["curve"][128] == {"docs_longer": pytest.approx(few["doc_share"]["b"]),
                                 "tokens_cut": pytest.approx(0.1 * (5000 - 128) / 5000)}  # fmt: skip
    many = mixture_seq_len({"a": short, "b": long}, {"a": 0.1, "b": 0.9})
    assert many["seq_len"] == 8192  # b's documents are 15% of the mixture's now
    assert (
        mixture_seq_len({"a": short, "b": long}, {"a": 0.9, "b": 0.1}, fit=0.999)["seq_len"] == 8192
    )
