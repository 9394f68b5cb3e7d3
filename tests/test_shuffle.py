"""The shuffle of issue 26: pieces of every file in a seeded order, several open at once and
interleaved, the window on top. Exact resume, world-size independence, epochs that differ,
file order on request, and a quality test that the shuffle before it fails."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import DocSource
from pipeline.stages.positions import OPEN
from pipeline.stages.shuffle import Interleave, WindowShuffle
from service.export import run_export
from tests.conformance import assert_resume_conforms, assert_stage_conforms, doc_key
from tests.test_golden import WORDS

SOURCES, PER_SOURCE = 10, 600


@pytest.fixture(scope="module")
def sorted_corpus(tmp_path_factory):
    """One JSONL of 10 equal sources sorted by source (6000 documents, ~1 MB), and a small
    second file with a bad record and an empty one."""
    d = tmp_path_factory.mktemp("sorted")
    rng = random.Random(26)
    with open(d / "a.jsonl", "w") as f:
        for label in range(SOURCES):
            for _ in range(PER_SOURCE):
                text = " ".join(rng.choices(WORDS, k=rng.randint(15, 45)))
                f.write(json.dumps({"source": label, "text": text}) + "\n")
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=30))}) for _ in range(40)]
    lines[5], lines[17] = "{not json", json.dumps({"text": ""})
    (d / "b.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _cfg(d, shuffle=None, files=("a.jsonl", "b.jsonl"), read=None, **stream):
    return parse_config({
        "seed": 5, "seq_len": 128, "global_batch_size": 4,
        "shuffle": {"piece_bytes": 4096, "pieces": 24, "window": 16} | (shuffle or {}),
        "read": {"block_bytes": 32768, "first_block_bytes": 8192} | (read or {}),
        "streams": {"s": {"paths": [str(d / f) for f in files]} | stream},
    })  # fmt: skip


def _source(cfg, state=None):
    source = DocSource("s", 0, cfg, iter_blocks_local)
    if state is not None:
        source.set_state(state)
    source.start()
    return source


def _labels(docs) -> np.ndarray:
    """The source of each document of a.jsonl (file 0), by its record index."""
    return np.array([(d.doc_id & 0xFFFFFFFF) // PER_SOURCE for d in docs if d.doc_id >> 32 == 0])


def _worst_top(labels: np.ndarray, parts: int = 20) -> float:
    n = len(labels)
    return max(
        np.bincount(labels[w * n // parts : (w + 1) * n // parts], minlength=SOURCES).max()
        / len(labels[w * n // parts : (w + 1) * n // parts])
        for w in range(parts)
    )


def test_the_schedule_draws_every_row_once_and_resumes_from_its_snapshot():
    sizes = [5, 0, 9, 1, 12, 7, 3, 8, 0, 4]
    il = Interleave(3, 1, "x", 0, len(sizes))
    drawn, snaps = [], []
    while True:
        want = il.to_open()
        while want is not None:
            il.opened(want, sizes[want])
            want = il.to_open()
        if il.finished:
            break
        snaps.append(il.snapshot())
        assert len(il.ords) <= 3
        drawn.append(il.draw()[:2])
    assert sorted(drawn) == [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    for p in range(len(sizes)):  # each piece's rows in order
        assert [r for q, r in drawn if q == p] == list(range(sizes[p]))
    for k in (0, 7, 20, len(drawn) - 1):
        nxt, draws, ords, done = snaps[k]
        pairs = tuple(zip(ords, done, strict=True))
        again = Interleave(3, 1, "x", 0, len(sizes), nxt, draws, pairs)
        rest = []
        while not again.finished:
            want = again.to_open()
            if want is not None:
                again.opened(want, sizes[want])
                continue
            rest.append(again.draw()[:2])
        assert rest == drawn[k:], k


def test_pieces_given_in_parts_draw_as_pieces_given_whole():
    """Interleave.opened(more=True) / needs / extended: the draws do not depend on when the
    rest of a piece's rows are given, only on how many there are."""
    rng = random.Random(3)
    sizes = [rng.randint(0, 30) for _ in range(40)]
    for limit in (1, 4, 16):
        whole = Interleave(limit, 9, "x", 0, len(sizes))
        split = Interleave(limit, 9, "x", 0, len(sizes))
        given = [0] * len(sizes)  # rows of each piece given to `split`
        asked = 0
        while not whole.finished:
            want = whole.to_open()
            if want is not None:
                whole.opened(want, sizes[want])
                assert split.to_open() == want
                given[want] = min(sizes[want], rng.randint(1, 4))
                split.opened(want, given[want], given[want] < sizes[want])
                continue
            while (need := split.needs()) is not None:
                extra = min(sizes[need] - given[need], rng.randint(0, 5))
                given[need] += extra
                split.extended(need, extra, given[need] < sizes[need])
                asked += 1
            assert split.to_open() is None and not split.finished
            assert split.draw() == whole.draw()
            assert split.snapshot() == whole.snapshot()
        assert split.finished and asked > 0


@pytest.mark.parametrize(
    ("stream", "midpoints"),
    [({"repeat": 2}, [0, 1, 9, 333, 2999, 3040, 4500]), ({"max_tokens": 60_000}, [0, 2, 500])],
)  # fmt: skip
def test_the_source_resumes_exactly_from_any_state(sorted_corpus, stream, midpoints):
    """Interleaved reading, rejects, two epochs (or a token cap), resumed anywhere."""
    cfg = _cfg(sorted_corpus, **stream)
    assert len(_source(cfg).pieces()[0]) > 100
    assert_stage_conforms(lambda s: _source(cfg, s), 7000, midpoints, doc_key)


def test_the_first_pieces_read_in_parts_give_the_same_documents_reading_less_ahead(
    sorted_corpus,
):
    """read.ramp_parts (plan.ramp_parts): the first epoch's first pieces are read in parts,
    their first rows first: the same documents in the same order as whole pieces, two
    epochs, while the first 2·pieces documents (the interleave's ramp) ask fewer rows read."""
    delivered = []

    def counting(units, stream, tokenizer):
        for block in iter_blocks_local(units, stream, tokenizer):
            delivered[-1] += block.num_rows
            yield block

    runs = {}
    for parts in (1, 5):
        cfg = _cfg(sorted_corpus, repeat=2, read={"ramp_parts": parts})
        source = DocSource("s", 0, cfg, counting)
        delivered.append(0)
        source.start()
        docs = [doc_key(d) for d in source]
        ahead = delivered[-1]
        source = DocSource("s", 0, cfg, counting)
        delivered.append(0)
        source.start()
        for _ in range(2 * cfg.shuffle.pieces):
            next(source)
        runs[parts] = docs, delivered[-1]
        assert delivered[-2] == ahead  # every row read once in the whole run
    units = _source(_cfg(sorted_corpus)).plan.plan(0, (), 0)[0]
    assert any(p.take >= 0 for u in units for p in u.pieces)  # the plan has parts
    assert runs[5][0] == runs[1][0] and len(runs[1][0]) == 2 * (6000 + 38)
    assert runs[5][1] < 0.6 * runs[1][1], (runs[5][1], runs[1][1])


def test_an_export_reads_whole_pieces_and_a_feed_parts(sorted_corpus, tmp_path, monkeypatch):
    """read.ramp_parts unset: parts where ranks wait on the first steps (a feed), whole pieces
    in `export` (throughput); the same rows either way. (What the plans hold, not what an
    executor was handed: the export's head start may make every unit itself.)"""
    from pipeline.stages.plan import StreamPlan

    planned: list = []
    plan = StreamPlan.plan

    def noting(self, *args, **kwargs):
        units, ords = plan(self, *args, **kwargs)
        planned.append([p for u in units for p in u.pieces])
        return units, ords

    monkeypatch.setattr(StreamPlan, "plan", noting)
    cfg = _cfg(sorted_corpus)
    run_export(cfg, tmp_path / "out", steps=8, executor=iter_blocks_local)
    exported, planned[:] = list(planned), []
    feed = StepFeed(cfg, executor=iter_blocks_local)
    rows = [feed.next_step() for _ in range(8)]
    assert exported and all(p.skip == 0 and p.take < 0 for ps in exported for p in ps)
    assert planned and all(any(p.take >= 0 for p in ps) for ps in planned)
    steps = sorted((tmp_path / "out").glob("step-*.parquet"))
    assert len(steps) == 8
    for step, path in zip(rows, steps, strict=True):
        assert pq.read_table(path)["input_ids"].to_pylist() == step["input_ids"].to_pylist()


def test_the_window_over_the_interleave_resumes_exactly(sorted_corpus):
    cfg = _cfg(sorted_corpus)

    def make(state):
        shuffle = WindowShuffle(DocSource("s", 0, cfg, iter_blocks_local), 16, 5, "s")
        if state is not None:
            shuffle.set_state(state)
        shuffle.docs.start()
        return shuffle

    assert_stage_conforms(make, 3100, [0, 5, 100, 1500, 3030], doc_key)


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_the_feed_resumes_exactly(sorted_corpus, mode):
    cfg = _cfg(sorted_corpus)
    cfg = parse_config(cfg.model_dump(mode="json") | {"packing": {"mode": mode, "buffer": 16}})
    assert_resume_conforms(lambda s: StepFeed(cfg, executor=iter_blocks_local, state=s), 60,
                           [0, 1, 17, 40])  # fmt: skip


def test_the_state_is_positions_only(sorted_corpus):
    cfg = _cfg(sorted_corpus)
    source = _source(cfg)
    for _ in range(500):
        next(source)
    state = source.get_state()
    assert len(state[OPEN]) <= cfg.shuffle.pieces
    assert all(len(pair) == 2 and all(isinstance(v, int) for v in pair) for pair in state[OPEN])
    assert len(json.dumps(state)) < 16 * cfg.shuffle.pieces + 200


def test_world_size_one_and_two_give_the_same_global_rows(sorted_corpus, tmp_path):
    cfg = _cfg(sorted_corpus)
    for w in (1, 2):
        run_export(cfg, tmp_path / f"w{w}", steps=6, world_size=w, executor=iter_blocks_local)

    def rows(w):
        return [pq.read_table(tmp_path / f"w{w}" / f"step-{s:08d}-rank-{r}.parquet").to_pylist()
                for s in range(6) for r in range(w)]  # fmt: skip

    one, two = rows(1), rows(2)
    assert [row for step in one for row in step] == [row for step in two for row in step]


def test_two_epochs_are_two_different_permutations(sorted_corpus):
    docs = list(_source(_cfg(sorted_corpus, files=("a.jsonl",), repeat=2)))
    n = SOURCES * PER_SOURCE
    assert len(docs) == 2 * n
    first, second = ([d.doc_id for d in docs[:n]], [d.doc_id for d in docs[n:]])
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second
    assert sum(a == b for a, b in zip(first, second, strict=True)) < n // 20


def test_the_same_seed_gives_the_same_order_and_another_seed_another(sorted_corpus):
    cfg = _cfg(sorted_corpus)
    ids = [d.doc_id for d in _source(cfg)]
    assert ids == [d.doc_id for d in _source(cfg)]
    other = parse_config(cfg.model_dump(mode="json") | {"seed": 6})
    assert ids != [d.doc_id for d in _source(other)]


def test_files_false_still_reads_the_files_in_order(sorted_corpus):
    cfg = _cfg(sorted_corpus, {"files": False, "window": 1})
    assert not cfg.shuffle.interleaved
    ids = [d.doc_id for d in _source(cfg)]
    assert ids == sorted(ids) and len(ids) == SOURCES * PER_SOURCE + 38


@pytest.mark.parametrize(("pieces", "bound"), [(256, 0.2), (24, 0.3)])
def test_a_sorted_corpus_comes_out_mixed(sorted_corpus, pieces, bound):
    """Every 5% window of an epoch of a corpus sorted by 10 sources is mixed with the new
    shuffle, never with the old. With the defaults every piece is open at once here (0.15, as
    a true permutation gives in windows of 300 documents); with 24 of 231 pieces open, 0.27."""
    files = ("a.jsonl",)
    new = _labels(WindowShuffle(_source(_cfg(sorted_corpus, {"pieces": pieces}, files)), 16, 5,
                                "s"))  # fmt: skip
    old = _labels(WindowShuffle(_source(_cfg(sorted_corpus, {"pieces": 0}, files)), 16, 5, "s"))
    assert len(new) == len(old) == SOURCES * PER_SOURCE
    assert _worst_top(old) == 1.0
    assert _worst_top(new) <= bound


def test_a_state_of_the_interleave_is_refused_by_a_config_without_it(sorted_corpus):
    source = _source(_cfg(sorted_corpus))
    next(source)
    state = source.get_state()
    old = DocSource("s", 0, _cfg(sorted_corpus, {"pieces": 0}), iter_blocks_local)
    with pytest.raises(ValueError, match=r"interleaves pieces .*\(shuffle.pieces: 0\)"):
        old.set_state(state)
    bad = state | {OPEN: [[3, 1], [2, 0]]}
    with pytest.raises(ValueError, match="increasing pieces"):
        DocSource("s", 0, _cfg(sorted_corpus), iter_blocks_local).set_state(bad)
    with pytest.raises(ValueError, match="open piece 9999 was not opened yet"):
        _source(_cfg(sorted_corpus), state | {OPEN: [[9999, 0]]})
    with pytest.raises(ValueError, match="files changed since the state"):
        list(_source(_cfg(sorted_corpus), state | {OPEN: [[0, 10**6]]}))


def test_the_old_shuffle_hashes_without_the_new_settings(sorted_corpus):
    """`pieces: 0` is the shuffle before issue 26, byte for byte (tests/test_golden.py), and
    its hash leaves the new settings out (as its configs hashed before), so their states
    still resume; the new shuffle hashes differently."""
    old = _cfg(sorted_corpus, {"pieces": 0})
    assert (
        old.config_hash() == _cfg(sorted_corpus, {"pieces": 0, "piece_bytes": 8192}).config_hash()
    )
    assert _cfg(sorted_corpus).config_hash() != old.config_hash()


def test_ray_workers_and_the_head_start_give_the_in_process_order(ray_cluster, sorted_corpus,
                                                                  tmp_path):  # fmt: skip
    """The interleave is a function of the content, not of which process tokenized a unit or
    when its block came: Ray Data with the head start, and a resume through it, give the
    bytes of the in-process run."""
    cfg = _cfg(sorted_corpus)
    run_export(cfg, tmp_path / "local", steps=8, executor=iter_blocks_local, state_every=4)
    run_export(cfg, tmp_path / "ray", steps=8)
    state = json.loads((tmp_path / "local" / "state-00000004.json").read_text())
    run_export(cfg, tmp_path / "resumed", steps=4, resume=state)
    for step in range(8):
        name = f"step-{step:08d}-rank-0.parquet"
        local = (tmp_path / "local" / name).read_bytes()
        assert (tmp_path / "ray" / name).read_bytes() == local, step
        if step >= 4:
            assert (tmp_path / "resumed" / name).read_bytes() == local, step


def test_the_ramp_keeps_an_empty_piece_and_gives_a_failed_piece_its_own_error(tmp_path):
    """plan.ramp_parts with a piece of no rows (an empty Parquet row group) keeps it; a part
    whose piece cannot be read any more yields the whole-piece error, not nothing; and that
    error goes to its own piece, whatever piece of its file came before it in the unit."""
    from types import SimpleNamespace

    from pipeline.read.access import WHOLE_FILE, Piece
    from pipeline.read.sources import plan_pieces, read_piece
    from pipeline.stages.plan import ramp_parts
    from pipeline.stages.shuffle import by_piece

    order = [Piece(0, "f", "parquet", first_record=r, start=i, nbytes=1000)
             for i, r in enumerate((0, 40, 40, 80))]  # fmt: skip
    ends = [40, 40, 80, WHOLE_FILE]  # piece 1 has no rows
    todo, pieces = ramp_parts(order, ends, 4, 5)
    assert sorted(set(todo)) == [0, 1, 2, 3] and todo.count(1) == 1
    assert any(p.take >= 0 for p in pieces)

    path = tmp_path / "gone.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
    [[piece]] = plan_pieces([str(path)], "jsonl", piece_bytes=1 << 20)
    part = dataclasses.replace(piece, skip=4, take=4)
    assert [r[0] for r in read_piece(part, "text")] == [4, 5, 6, 7]
    path.unlink()
    [(rec, value, err)] = list(read_piece(part, "text"))
    assert rec == WHOLE_FILE and value is None and "unreadable" in err

    # parts of pieces 0 and 1 of one file in one unit: rows of piece 0, then piece 1's error
    ids = np.array([5, 6, WHOLE_FILE], dtype=np.uint64) | np.uint64(0)
    batch = SimpleNamespace(ids=ids)
    two = [Piece(0, "f", "jsonl", first_record=0), Piece(0, "f", "jsonl", first_record=10)]
    got = dict(by_piece([0, 1], [(batch, 0, 3)], two, [10, WHOLE_FILE]))
    assert got == {0: [(batch, 0, 2)], 1: [(batch, 2, 3)]}
