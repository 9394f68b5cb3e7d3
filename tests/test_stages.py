"""Every stateful stage alone passes the conformance helper (issue 16; pipeline/stages/stage.py):
the document source, the shuffle window, the mixer and both packers. The feed, which chains
them, is checked in tests/test_resume.py. A hypothesis property then checks random chains."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import DocSource
from pipeline.stages.mixing import DeficitMixer
from pipeline.stages.packing import make_packer
from pipeline.stages.shuffle import WindowShuffle
from pipeline.stages.stage import Doc
from tests.conformance import assert_stage_conforms, doc_key, row_key
from tests.conftest import stdlib_texts, write_jsonl


@dataclass(frozen=True)
class At:
    epoch: int
    i: int


class ListDocs:
    """A stage of synthetic documents, `lengths[e]` in epoch e: the smallest input with the
    protocol's contract (cursors carry the epoch), so that the stages above it are tested
    alone and on inputs hypothesis chooses."""

    def __init__(self, stream: int, lengths: list[list[int]]):
        self.stream, self.lengths = stream, lengths
        self.pos = At(0, 0)

    def __iter__(self):
        return self

    def __next__(self) -> Doc:
        e, i = self.pos.epoch, self.pos.i
        while e < len(self.lengths) and i >= len(self.lengths[e]):
            e, i = e + 1, 0
        if e == len(self.lengths):
            self.pos = At(e, 0)
            raise StopIteration
        self.pos = At(e, i + 1)
        start = 1 + 100_000 * self.stream + 1000 * i
        tokens = np.arange(start, start + self.lengths[e][i], dtype=np.int32)
        return Doc(self.stream, (e << 20) | i, tokens, None, At(e, i))

    def get_state(self, at: At | None = None) -> dict:
        at = at or self.pos
        return {"epoch": at.epoch, "i": at.i}

    def set_state(self, state: dict) -> None:
        self.pos = At(state["epoch"], state["i"])


def _stream_cfg(tmp_path):
    lines = [json.dumps({"text": t}) for t in stdlib_texts(30, max_bytes=1500)]
    lines[4] = "{not json"
    lines[9] = json.dumps({"text": ""})
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(10, start=40, max_bytes=1500))
    return parse_config({"seed": 7, "seq_len": 64, "global_batch_size": 2, "on_error": "skip",
                         "shuffle": {"window": 4},
                         "read": {"block_bytes": 6000, "first_block_bytes": 1500},
                         "streams": {"s": {"paths": [str(tmp_path / "*.jsonl")], "repeat": 2}}})  # fmt: skip


def _source(cfg, state):
    source = DocSource("s", 0, cfg, iter_blocks_local)
    if state is not None:
        source.set_state(state)
    source.start()
    return source


@pytest.mark.parametrize("pieces", [256, 3, 0], ids=["all-open", "3-open", "file-order"])
@pytest.mark.parametrize("max_tokens", [None, 20_000])
def test_the_document_source_resumes_exactly(tmp_path, max_tokens, pieces):
    """Two epochs of two files in small units, with rejects; and stopped by max_tokens. Pieces
    interleaved (all open at once, or 3 of them), or read in file order (`pieces: 0`)."""
    cfg = _stream_cfg(tmp_path)
    stream = {"paths": [str(tmp_path / "*.jsonl")], "repeat": 2}
    if max_tokens:
        stream["max_tokens"] = max_tokens
    cfg = parse_config(cfg.model_dump(mode="json") | {"streams": {"s": stream},
                       "shuffle": {"window": 4, "pieces": pieces, "piece_bytes": 4096}})  # fmt: skip
    assert_stage_conforms(lambda s: _source(cfg, s), 200, [0, 1, 5, 17, 37], doc_key)


def test_the_shuffle_window_resumes_exactly_over_the_source(tmp_path):
    cfg = _stream_cfg(tmp_path)

    def make(state):
        shuffle = WindowShuffle(DocSource("s", 0, cfg, iter_blocks_local), 4, 7, "s")
        if state is not None:
            shuffle.set_state(state)
        shuffle.docs.start()
        return shuffle

    assert_stage_conforms(make, 200, [0, 3, 8, 30, 38, 45], doc_key)


def test_the_shuffle_window_alone_keeps_windows_within_an_epoch():
    lengths = [[3] * 13, [5] * 7]
    docs = list(WindowShuffle(ListDocs(0, lengths), 6, 1, "x"))
    epochs = [d.doc_id >> 20 for d in docs]
    assert epochs == [0] * 13 + [1] * 7
    assert sorted(d.doc_id & 0xFFFFF for d in docs[:13]) == list(range(13))


def _mixer(weights, on_exhausted="stop"):
    return DeficitMixer(list(weights), weights, on_exhausted)


def test_the_mixer_resumes_exactly():
    lengths = np.random.default_rng(0).integers(1, 50, size=300)

    class Driven:
        """The mixer as a stage: pick among all live streams, place a length."""

        def __init__(self):
            self.mixer, self.n = _mixer({"a": 3.0, "b": 1.0, "c": 0.5}, "renormalize"), 0

        def get_state(self):
            return self.mixer.get_state() | {"n": self.n}

        def step(self):
            if self.n == len(lengths):
                return None
            if self.n == 150:
                self.mixer.exhausted(1)
            if self.n == 100:
                self.mixer.schedule(self.mixer._step, {"a": 1, "b": 1, "c": 1})
            self.mixer.begin_step(self.n // 10)
            s = self.mixer.pick(range(3))
            self.mixer.place(s, int(lengths[self.n]))
            self.n += 1
            return s

    def make(state):
        d = Driven()
        if state is not None:
            d.mixer.set_state(state)
            d.n = state["n"]
        return d

    assert_stage_conforms(make, 400, [0, 1, 99, 100, 151, 299], int, Driven.step)


def _packer(mode, lengths_by_stream, weights, seq_len, window, on_exhausted, state=None):
    sources = {
        f"s{i}": WindowShuffle(ListDocs(i, lengths), window, 3, f"s{i}")
        for i, lengths in enumerate(lengths_by_stream)
    }
    mixer = _mixer(dict(zip(sources, weights, strict=True)), on_exhausted)
    packer = make_packer(mode, seq_len, "split", sources, mixer, buffer=6, ramp_rows=2)
    if state is not None:
        packer.set_state(state)
    return packer


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_the_packers_resume_exactly(mode):
    rng = np.random.default_rng(1)
    streams = [[list(rng.integers(1, 70, size=40)), list(rng.integers(1, 70, size=25))],
               [list(rng.integers(1, 30, size=90))]]  # fmt: skip
    streams = [[[int(x) for x in e] for e in s] for s in streams]

    def make(state):
        return _packer(mode, streams, [2.0, 1.0], 48, 5, "renormalize", state)

    assert_stage_conforms(make, 500, [0, 1, 10, 40, 77], row_key)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_stage_chains_resume_exactly(data):
    """Any chain ListDocs -> WindowShuffle -> mixer + packer, resumed after any prefix."""
    n = data.draw(st.integers(1, 3), label="streams")
    lengths = st.lists(st.integers(1, 90), min_size=0, max_size=25)
    streams = [data.draw(st.lists(lengths, min_size=1, max_size=2), label="epochs")
               for _ in range(n)]  # fmt: skip
    weights = [data.draw(st.floats(0.1, 5), label="weight") for _ in range(n)]
    mode = data.draw(st.sampled_from(["concat", "bfd"]), label="mode")
    seq_len = data.draw(st.integers(8, 64), label="seq_len")
    window = data.draw(st.integers(1, 6), label="window")
    on_exhausted = data.draw(st.sampled_from(["stop", "renormalize"]), label="on_exhausted")

    def make(state):
        return _packer(mode, streams, weights, seq_len, window, on_exhausted, state)

    total = sum(sum(sum(e) for e in s) for s in streams)
    rows = len(list(make(None)))
    if rows == 0:
        return
    midpoints = sorted({0, rows - 1, data.draw(st.integers(0, rows - 1), label="midpoint")})
    assert_stage_conforms(make, rows + 2 + total // seq_len, midpoints, row_key)
