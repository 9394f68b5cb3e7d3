"""Exact resume (SPEC M7): every stateful stage, several seeds, concat and bfd, mixed with chat."""

import json

import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.state.resume import StateError
from service.demo_corpus import _chat_pairs
from tests.conformance import assert_resume_conforms, batch_bytes
from tests.conftest import STDLIB, stdlib_texts, write_jsonl
from tests.helpers import rows_of


@pytest.fixture
def mixed(tmp_path):
    write_jsonl(tmp_path / "code.jsonl", stdlib_texts(25, max_bytes=3000))
    lines = [json.dumps({"text": t}) for t in stdlib_texts(20, start=30, max_bytes=1500)]
    lines.insert(3, "{bad")
    lines.insert(11, json.dumps({"text": ""}))
    (tmp_path / "prose.jsonl").write_text("\n".join(lines) + "\n")
    chats = []
    for p in sorted(STDLIB.glob("*.py"))[:40]:
        chats += list(_chat_pairs(p, p.read_text(encoding="utf-8", errors="replace")))
    write_jsonl(tmp_path / "chat.jsonl", chats[:150])
    return tmp_path


def make(tmp, mode, seed, **extra):
    cfg = parse_config({
        "seed": seed, "seq_len": 96, "global_batch_size": 4,
        "packing": {"mode": mode, "buffer": 12},
        "shuffle": {"window": 5},
        "read": {"block_bytes": 8000, "first_block_bytes": 2000},
        "mixing": {"on_exhausted": "renormalize"},
        "streams": {
            "code": {"paths": [str(tmp / "code.jsonl")], "weight": 3, "repeat": 2},
            "prose": {"paths": [str(tmp / "prose.jsonl")], "weight": 1},
            "chat": {"kind": "chat", "paths": [str(tmp / "chat.jsonl")], "weight": 1},
        },
        **extra,
    })  # fmt: skip
    return lambda state: StepFeed(cfg, executor=iter_blocks_local, state=state)


@pytest.mark.parametrize("mode", ["concat", "bfd"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_anywhere_equals_the_straight_run(mixed, mode, seed):
    assert_resume_conforms(make(mixed, mode, seed), steps=400, midpoints=[0, 1, 7, 33, 90])


def test_resume_across_exhaustion_and_to_the_end(mixed):
    make_feed = make(mixed, "bfd", 5)
    feed = make_feed(None)
    n = 0
    while feed.next_step() is not None:
        n += 1
    assert feed.summary().exhausted, "the run must reach exhaustion"
    assert_resume_conforms(make_feed, steps=n + 5, midpoints=[n // 2, n - 3, n - 1])


def test_resume_keeps_run_time_weight_changes(mixed):
    make_feed = make(mixed, "bfd", 3)
    feed = make_feed(None)
    for _ in range(5):
        feed.next_step()
    feed.set_weights({"code": 1, "prose": 0, "chat": 1}, effective_step=9)
    state = json.loads(json.dumps(feed.get_state()))
    straight = [feed.next_step() for _ in range(10)]
    resumed = make_feed(state)
    again = [resumed.next_step() for _ in range(10)]
    assert [b.to_pydict() for b in straight] == [b.to_pydict() for b in again]
    assert [h["step"] for h in resumed.summary().mixture_history] == [0, 9]


def test_state_is_small_json_without_tokens(mixed):
    feed = make(mixed, "bfd", 0)(None)
    for _ in range(20):
        feed.next_step()
    blob = json.dumps(feed.get_state())
    assert len(blob) < 8_000
    assert json.loads(blob)["step"] == 20


def test_rejects_are_not_reported_twice_after_resume(mixed):
    make_feed = make(mixed, "concat", 0)
    feed = make_feed(None)
    states = []
    for _ in range(150):
        states.append(feed.get_state())
        feed.next_step()
    straight = [(r.file, r.record) for r in feed.rejects]
    assert len(straight) == 2
    for k in (5, 20, 60):
        first = make_feed(None)
        for _ in range(k):
            first.next_step()
        before = [(r.file, r.record) for r in first.rejects]
        resumed = make_feed(states[k])
        for _ in range(150 - k):
            resumed.next_step()
        assert before + [(r.file, r.record) for r in resumed.rejects] == straight


def test_config_mismatch_is_an_error_unless_allowed(mixed):
    feed = make(mixed, "bfd", 0)(None)
    feed.next_step()
    state = feed.get_state()
    other = make(mixed, "bfd", 0, schedule=[{"step": 50, "weights": {"code": 1}}])
    with pytest.raises(StateError, match="allow-config-change"):
        other(state)
    cfg = parse_config({**json.loads(json.dumps({})), "seq_len": 96, "global_batch_size": 4,
                        "packing": {"mode": "bfd", "buffer": 12}, "shuffle": {"window": 5},
                        "read": {"block_bytes": 8000, "first_block_bytes": 2000},
                        "mixing": {"on_exhausted": "renormalize"},
                        "streams": {"code": {"paths": [str(mixed / "code.jsonl")], "weight": 3, "repeat": 2},
                                    "prose": {"paths": [str(mixed / "prose.jsonl")], "weight": 5},
                                    "chat": {"kind": "chat", "paths": [str(mixed / "chat.jsonl")], "weight": 1}}})  # fmt: skip
    resumed = StepFeed(cfg, executor=iter_blocks_local, state=state, allow_config_change=True)
    hist = resumed.summary().mixture_history
    assert hist[-1]["step"] == 1 and hist[-1]["source"] == "resume"
    assert resumed.next_step() is not None


def _stream_tokens(batches, name: str) -> list[int]:
    """The tokens a stream contributed, in order (concat places each stream's documents in
    stream order, so this is the stream's own sequence, whatever the mixture)."""
    out: list[int] = []
    for batch in batches:
        for row in rows_of(batch):
            start = 0
            for n, stream in zip(row["seq_lens"], row["stream"], strict=True):
                if stream == name:
                    out += row["input_ids"][start : start + n]
                start += n
    return out


def test_streams_are_resumed_by_name_and_may_be_added_or_removed_when_allowed(mixed):
    """A stream removed at a resume is left out, one added starts from its beginning, the
    others continue exactly where they stood, and the change is in the mixture history."""
    write_jsonl(mixed / "extra.jsonl", stdlib_texts(12, start=60, max_bytes=2000))

    def cfg(streams: dict):
        return parse_config({"seed": 4, "seq_len": 96, "global_batch_size": 4,
                             "packing": {"mode": "concat"}, "shuffle": {"window": 5},
                             "mixing": {"on_exhausted": "renormalize"},
                             "streams": {n: {"paths": [str(mixed / f"{n}.jsonl")], "weight": w}
                                         for n, w in streams.items()}})  # fmt: skip

    before = cfg({"code": 3, "prose": 1})
    straight = StepFeed(before, executor=iter_blocks_local)
    for _ in range(5):
        straight.next_step()
    state = straight.get_state()
    rest = [straight.next_step() for _ in range(10)]

    after = cfg({"extra": 1, "code": 2})  # prose removed, extra added, another order
    with pytest.raises(StateError, match=r"streams \['code', 'prose'\].*allow-config-change"):
        StepFeed(after, executor=iter_blocks_local, state=state)
    resumed = StepFeed(after, executor=iter_blocks_local, state=state, allow_config_change=True)
    got = [resumed.next_step() for _ in range(10)]
    code = _stream_tokens(got, "code")
    assert code and code == _stream_tokens(rest, "code")[: len(code)]
    fresh = StepFeed(cfg({"extra": 1}), executor=iter_blocks_local)
    extra = _stream_tokens(got, "extra")
    assert (
        extra
        and extra == _stream_tokens([fresh.next_step() for _ in range(10)], "extra")[: len(extra)]
    )
    assert not _stream_tokens(got, "prose")
    last = resumed.summary().mixture_history[-1]
    assert last == {"step": 5, "weights": {"extra": 1.0, "code": 2.0}, "source": "resume"}
    again = resumed.get_state()
    assert sorted(again["packer"]["streams"]) == ["code", "extra"]
    # and the state written after the change resumes exactly under the new config
    more = [batch_bytes(resumed.next_step()) for _ in range(3)]
    twice = StepFeed(after, executor=iter_blocks_local, state=again)
    assert [batch_bytes(twice.next_step()) for _ in range(3)] == more
