"""Packer behaviour on tiny synthetic documents: golden rows and hypothesis properties."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.stages.mixing import DeficitMixer
from pipeline.stages.packing import make_packer
from pipeline.stages.stage import Doc
from tests.helpers import check_row, reassemble, rows_of
from wire.schema import build_batch

PAD = 0


def docs_from(lengths, stream=0, base=1):
    # Token values encode (doc, position) so that any mix-up shows.
    return [
        Doc(stream, i, np.arange(base + 1000 * i, base + 1000 * i + n, dtype=np.int32) % 50_000 + 1)
        for i, n in enumerate(lengths)
    ]


def pack_all(mode, lengths_by_stream, seq_len, overflow="split", buffer=8, weights=None):
    names = [f"s{i}" for i in range(len(lengths_by_stream))]
    docs = [docs_from(ls, stream=i) for i, ls in enumerate(lengths_by_stream)]
    mixer = DeficitMixer(names, weights or dict.fromkeys(names, 1.0), "renormalize")
    sources = {n: iter(d) for n, d in zip(names, docs, strict=True)}
    packer = make_packer(mode, seq_len, overflow, sources, mixer, buffer)
    rows = []
    while (row := packer.next_row()) is not None:
        rows.append(row)
    return rows, docs, packer, names


def test_concat_golden():
    rows, _, packer, names = pack_all("concat", [[5, 3, 9]], seq_len=8)
    got = [[(s.doc.doc_id, s.offset, s.length) for s in r] for r in rows]
    assert got == [[(0, 0, 5), (1, 0, 3)], [(2, 0, 8)], [(2, 8, 1)]]
    assert packer.counters[0].split == 1  # doc 2 is longer than seq_len


def test_bfd_golden_keeps_documents_whole():
    rows, _, _, _ = pack_all("bfd", [[5, 3, 6, 2, 7, 1]], seq_len=8, buffer=16)
    got = [sorted(s.length for s in r) for r in rows]
    # largest first, then the largest piece that still fits
    assert got == [[1, 7], [2, 6], [3, 5]]


def test_overflow_truncate_and_drop_are_counted():
    rows, _, packer, _ = pack_all("bfd", [[3, 20, 4]], seq_len=8, overflow="truncate")
    assert packer.counters[0].truncated == 1 and packer.counters[0].truncated_tokens == 12
    assert sum(s.length for r in rows for s in r) == 3 + 8 + 4
    rows, _, packer, _ = pack_all("concat", [[3, 20, 4]], seq_len=8, overflow="drop")
    assert packer.counters[0].dropped == 1 and packer.counters[0].dropped_tokens == 20
    assert {s.doc.doc_id for r in rows for s in r} == {0, 2}


lengths = st.lists(st.integers(min_value=1, max_value=70), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["concat", "bfd"]),
    streams=st.lists(lengths, min_size=1, max_size=3),
    seq_len=st.integers(min_value=8, max_value=64),
    buffer=st.integers(min_value=1, max_value=20),
)
def test_nothing_lost_nothing_duplicated_invariants_hold(mode, streams, seq_len, buffer):
    rows, docs, _, names = pack_all(mode, streams, seq_len, buffer=buffer)
    batch = build_batch(rows, seq_len, PAD, names)
    pyrows = list(rows_of(batch))
    for row in pyrows:
        check_row(row, seq_len, PAD)
    if mode == "concat":
        assert all(sum(r["seq_lens"]) == seq_len for r in pyrows[:-1]), "concat rows are full"
    got = reassemble(pyrows)
    want = {(names[d.stream], d.doc_id): d.tokens for ds in docs for d in ds}
    assert got.keys() == want.keys()
    for key, toks in want.items():
        assert np.array_equal(got[key], toks), key


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["concat", "bfd"]),
    weights=st.lists(st.integers(min_value=1, max_value=9), min_size=2, max_size=3),
    seq_len=st.integers(min_value=16, max_value=64),
    data=st.data(),
)
def test_mixture_tracks_target_within_one_row_at_every_prefix(mode, weights, seq_len, data):
    n = len(weights)
    # Plenty of documents so that no stream runs out within the checked prefix.
    streams = [
        data.draw(st.lists(st.integers(1, 2 * seq_len), min_size=400, max_size=400))
        for _ in range(n)
    ]
    names = [f"s{i}" for i in range(n)]
    docs = [docs_from(ls, stream=i) for i, ls in enumerate(streams)]
    mixer = DeficitMixer(names, dict(zip(names, weights, strict=True)), "stop")
    sources = {n: iter(d) for n, d in zip(names, docs, strict=True)}
    packer = make_packer(mode, seq_len, "split", sources, mixer, 16)
    w = np.array(weights) / sum(weights)
    placed = np.zeros(n)
    for _ in range(60):
        row = packer.next_row()
        if row is None:  # a stream ran out: with on_exhausted=stop the run ends
            assert packer.finished
            break
        for seg in row:
            placed[seg.doc.stream] += seg.length
        err = np.abs(placed - w * placed.sum())
        # concat can cut anywhere: one row. bfd keeps pieces whole, so at a row's end the most
        # behind stream may have no piece that fits; the bound found by search is under 2 rows.
        bound = seq_len if mode == "concat" else 2 * seq_len
        assert (err <= bound).all(), (placed, w)
