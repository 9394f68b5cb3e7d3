"""Token-weighted mixing of named streams, pretrain and chat together, weights changed mid-run."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.mixing import DeficitMixer
from service.demo_corpus import _chat_pairs
from tests.conftest import STDLIB, stdlib_texts, write_jsonl
from tests.helpers import check_row, reassemble, rows_of

SEQ = 64


@pytest.fixture
def three_streams(tmp_path):
    write_jsonl(tmp_path / "code.jsonl", stdlib_texts(40, max_bytes=6000))
    docs = []
    for p in sorted(STDLIB.glob("*.py"))[:60]:
        src = p.read_text(encoding="utf-8", errors="replace")
        docs += [pair["messages"][1]["content"] for pair in _chat_pairs(p, src)]
    pq.write_table(pa.table({"body": docs[:400]}), tmp_path / "docs.parquet", row_group_size=50)
    chats = []
    for p in sorted(STDLIB.glob("*.py"))[60:120]:
        chats += list(_chat_pairs(p, p.read_text(encoding="utf-8", errors="replace")))
    write_jsonl(tmp_path / "chat.jsonl", chats[:600])
    return {
        "code": {"paths": [str(tmp_path / "code.jsonl")], "weight": 5},
        "docs": {"paths": [str(tmp_path / "docs.parquet")], "text_field": "body", "weight": 3},
        "chat": {"kind": "chat", "paths": [str(tmp_path / "chat.jsonl")], "weight": 2},
    }


def run(streams, steps, mode="bfd", **extra):
    cfg = parse_config({"seed": 3, "seq_len": SEQ, "global_batch_size": 8, "packing": {"mode": mode, "buffer": 64},
                        "streams": streams, **extra})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    batches = []
    for _ in range(steps):
        b = feed.next_step()
        if b is None:
            break
        batches.append(b)
    return feed, batches


def stream_tokens(batch):
    out = {}
    for row in rows_of(batch):
        for n, s in zip(row["seq_lens"], row["stream"], strict=True):
            out[s] = out.get(s, 0) + n
    return out


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_three_streams_track_token_shares_at_every_prefix(three_streams, tokenizer, mode):
    feed, batches = run(three_streams, steps=130, mode=mode)
    assert len(batches) == 130  # 1040 rows
    target = {"code": 0.5, "docs": 0.3, "chat": 0.2}
    totals = dict.fromkeys(target, 0)
    for b in batches:
        for row in rows_of(b):
            check_row(row, SEQ, tokenizer.pad_id, loss_streams={"chat"})
            for n, s in zip(row["seq_lens"], row["stream"], strict=True):
                totals[s] += n
            whole = sum(totals.values())
            for s, w in target.items():
                assert abs(totals[s] - w * whole) <= SEQ, (s, totals)
    whole = sum(totals.values())
    for s, w in target.items():
        assert abs(totals[s] / whole - w) < 0.005
    summary = feed.summary()
    assert {s: round(v.realized_share, 2) for s, v in summary.streams.items()} == target
    assert all(v.docs > 0 and v.tokens == totals[s] for s, v in summary.streams.items())


def test_pretrain_and_chat_share_a_batch_and_chat_loss_is_assistant_only(three_streams, tokenizer):
    _, batches = run(three_streams, steps=3)
    seen = set()
    for b in batches:
        for row in rows_of(b):
            start = 0
            for n, s in zip(row["seq_lens"], row["stream"], strict=True):
                seen.add(s)
                ids = np.array(row["input_ids"][start : start + n])
                labels = np.array(row["labels"][start : start + n])
                if s == "chat":
                    assert (labels == -100).any()
                else:
                    assert (labels[1:] == ids[1:]).all()
                start += n
    assert seen == {"code", "docs", "chat"}


def test_schedule_switches_at_exactly_the_stated_step(three_streams):
    schedule = [{"step": 20, "weights": {"code": 1, "docs": 0, "chat": 1}}]
    feed, batches = run(three_streams, steps=40, schedule=schedule)
    before = [stream_tokens(b) for b in batches[:20]]
    after = [stream_tokens(b) for b in batches[20:]]
    assert all(t.get("docs", 0) > 0 for t in before[1:])
    assert all(t.get("docs", 0) == 0 for t in after), "no docs tokens from step 20 on"
    since = {"code": 0, "chat": 0}
    for t in after:
        for s in since:
            since[s] += t.get(s, 0)
        assert abs(since["code"] - since["chat"]) <= 2 * SEQ
    hist = feed.summary().mixture_history
    assert [(h["step"], h["source"]) for h in hist] == [(0, "config"), (20, "schedule")]


def test_run_time_weight_change_is_never_retroactive(three_streams):
    feed, batches = run(three_streams, steps=5)
    with pytest.raises(ValueError, match="already produced"):
        feed.set_weights({"code": 1}, effective_step=2)
    with pytest.raises(ValueError, match="unknown stream 'web'"):
        feed.set_weights({"web": 1})
    with pytest.raises(ValueError, match="not all be zero"):
        feed.set_weights({"code": 0, "docs": 0, "chat": 0})
    assert feed.set_weights({"chat": 1}, effective_step=8) == 8
    later = [feed.next_step() for _ in range(6)]
    assert stream_tokens(later[2]).keys() != {"chat"}  # step 7: old weights
    assert stream_tokens(later[3]).keys() == {"chat"}  # step 8 on: chat only
    assert stream_tokens(later[5]).keys() == {"chat"}


def test_exhaustion_stops_or_renormalizes_as_configured(tmp_path):
    write_jsonl(tmp_path / "small.jsonl", ["tiny doc " * 20] * 3)
    write_jsonl(tmp_path / "big.jsonl", stdlib_texts(20, max_bytes=4000))
    streams = {
        "small": {"paths": [str(tmp_path / "small.jsonl")]},
        "big": {"paths": [str(tmp_path / "big.jsonl")]},
    }
    stop, b1 = run(streams, steps=1000, mixing={"on_exhausted": "stop"})
    ren, b2 = run(streams, steps=1000, mixing={"on_exhausted": "renormalize"})
    assert "stopping the run" in stop.summary().exhausted[0]
    assert "renormalizing" in ren.summary().exhausted[0]
    assert len(b2) > len(b1)
    docs = reassemble(r for b in b2 for r in rows_of(b))
    assert len([k for k in docs if k[0] == "big"]) == 20  # renormalized: every big doc served


def test_repeat_and_token_cap(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(5, max_bytes=2000))
    once, _ = run({"a": {"paths": [str(tmp_path / "a.jsonl")]}}, steps=10_000)
    twice, _ = run({"a": {"paths": [str(tmp_path / "a.jsonl")], "repeat": 2}}, steps=10_000)
    capped, _ = run({"a": {"paths": [str(tmp_path / "a.jsonl")], "max_tokens": 1000}}, steps=10_000)
    n1 = once.summary().streams["a"]
    assert twice.summary().streams["a"].tokens == 2 * n1.tokens
    assert twice.summary().streams["a"].epochs_started == 2
    c = capped.summary().streams["a"]
    assert 1000 <= c.tokens < n1.tokens  # whole documents until the cap is reached
    assert c.docs < n1.docs


def test_mixer_picks_deterministically_by_deficit():
    m = DeficitMixer(["a", "b"], {"a": 3, "b": 1})
    picks = []
    for _ in range(8):
        s = m.pick([0, 1])
        picks.append(s)
        m.place(s, 10)
    assert picks == [0, 1, 0, 0, 0, 1, 0, 0]
