"""`tokenmill stats`: the token-length distribution and the seq_len it implies."""

import subprocess
import sys

import numpy as np

from pipeline.config import parse_config
from pipeline.stats import length_stats
from pipeline.summary import describe_lengths
from tests.conftest import write_jsonl


def test_describe_lengths_golden():
    d = describe_lengths(np.array([10] * 98 + [300, 1000]))
    assert d["docs"] == 100 and d["p50"] == 10 and d["max"] == 1000
    assert d["mean"] == (980 + 1300) / 100
    assert sum(d["histogram"]["counts"]) == 100
    assert d["recommended_seq_len"] == 512  # holds the p99 document (~307 tokens) whole


def test_length_stats_tokenizes_real_records(tmp_path, tokenizer):
    texts = ["word " * n for n in (5, 50, 500)]
    write_jsonl(tmp_path / "d.jsonl", texts)
    cfg = parse_config({"streams": {"s": {"paths": [str(tmp_path / "d.jsonl")]}}})
    st = length_stats(cfg, docs=10)["s"]
    want = sorted(
        len(tokenizer.tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in texts
    )
    assert st["docs"] == 3 and st["min"] == want[0] and st["max"] == want[-1]


def test_stats_cli_prints_histogram_and_recommendation(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ["word " * n for n in range(1, 60)])
    (tmp_path / "c.yaml").write_text(f"streams:\n  s:\n    paths: [{tmp_path}/d.jsonl]\n")
    r = subprocess.run([sys.executable, "-m", "service", "stats", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "p50" in r.stdout and "p99" in r.stdout and "#" in r.stdout
    assert "recommended seq_len: 64" in r.stdout
