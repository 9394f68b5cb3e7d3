"""Golden batches: the demo mixture's served sequence, pinned by digest (issue 16).

Refactors must keep exports byte-identical for the same config and seed. This test exports the
demo config's settings (bfd packing, a windowed shuffle, a 70/30 pretrain/chat mixture, a
resume halfway) over a corpus generated here from a seeded `random.Random`, which is the same
on every machine and Python version (the demo corpus is not: it is made from the running
Python's standard library), and compares a digest of every column of every step with the one
recorded when the test was written.

If a change is *meant* to change the batches, the digest changes with it: say so in the
commit and update GOLDEN, never silently.

Two shuffles are pinned: today's default (pieces in a seeded order across files, interleaved,
issue 26: GOLDEN) and `shuffle.pieces: 0`, the shuffle before it (LEGACY_GOLDEN, the digest
recorded before issue 26, unchanged), which the states of earlier versions resume with
(tests/test_state_migration.py builds its runs with `_config`'s default, that one).
"""

from __future__ import annotations

import hashlib
import json
import random

import pyarrow.parquet as pq
import pytest

from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from service.export import run_export
from wire.layout import expand_table

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or have an they which "
    "one you were all we when there can more if no out so said what up its about into than "
    "them only some could new these two may first then do any like my now over such our man "
    "def return class import self None True False yield lambda async await raise try except"
)
WORDS = _WORDS.split()
# Recorded with the code of 0a3f24b (before issue 14's formats refactor, packaging and tokenizer
# work) and unchanged after it, up to issue 26: now the digest of `shuffle.pieces: 0`.
LEGACY_GOLDEN = "0197e61bc10056ac"
# Issue 26: the default shuffle reads pieces (256 KiB: code.jsonl is two) in a seeded order
# and interleaves them, so the batches changed.
GOLDEN = "4c6d4cb34a5020df"
LEGACY_SHUFFLE = {"window": 64, "pieces": 0}
CORPUS_GOLDEN = "c89aec571414cc74"
STEPS = 12
COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids", "seq_lens", "stream", "doc_id",
           "doc_offset")  # fmt: skip


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _corpus(tmp_path):
    rng = random.Random(20261123)
    with open(tmp_path / "code.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": _text(rng, 5, 700)}) + "\n")
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(300):
            turns = [{"role": "user", "content": _text(rng, 3, 60)},
                     {"role": "assistant", "content": _text(rng, 3, 200)}]  # fmt: skip
            if rng.random() < 0.3:
                turns.insert(0, {"role": "system", "content": _text(rng, 3, 20)})
            f.write(json.dumps({"messages": turns}) + "\n")


def _config(tmp_path, shuffle: dict | None = None):
    """The demo mixture; `shuffle` None: the shuffle before issue 26 (LEGACY_SHUFFLE)."""
    return parse_config({
        "seed": 1234, "seq_len": 512, "global_batch_size": 8, "tokenizer": {"name": "default"},
        "packing": {"mode": "bfd", "buffer": 128, "overflow": "split"},
        "shuffle": LEGACY_SHUFFLE if shuffle is None else shuffle, "on_error": "skip",
        "streams": {
            "code": {"kind": "pretrain", "paths": [str(tmp_path / "code.jsonl")], "weight": 0.7},
            "chat": {"kind": "chat", "paths": [str(tmp_path / "chat.jsonl")], "weight": 0.3},
        },
    })  # fmt: skip


def _digest(out, steps: range) -> str:
    h = hashlib.sha256()
    for step in steps:
        table = expand_table(pq.read_table(out / f"step-{step:08d}-rank-0.parquet"))
        for name in COLUMNS:
            h.update(name.encode())
            h.update(json.dumps(table.column(name).to_pylist()).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    ("shuffle", "golden"), [({"window": 64}, GOLDEN), (LEGACY_SHUFFLE, LEGACY_GOLDEN)],
    ids=["default", "pieces-0"],
)  # fmt: skip
def test_the_demo_mixture_is_byte_identical_to_the_recorded_batches(tmp_path, shuffle, golden):
    _corpus(tmp_path)
    cfg = _config(tmp_path, shuffle)
    out = tmp_path / "straight"
    run_export(cfg, out, steps=STEPS, executor=iter_blocks_local, state_every=STEPS // 2)
    straight = _digest(out, range(STEPS))
    assert straight == golden, f"the batches changed: digest {straight}, recorded {golden}"
    # A resume from the halfway state continues the same sequence.
    state = json.loads((out / f"state-{STEPS // 2:08d}.json").read_text())
    again = tmp_path / "resumed"
    run_export(cfg, again, steps=STEPS // 2, executor=iter_blocks_local, resume=state)
    assert _digest(again, range(STEPS // 2, STEPS)) == _digest(out, range(STEPS // 2, STEPS))


def test_the_corpus_generator_is_stable(tmp_path):
    """The fixture itself: a changed generator would masquerade as changed batches."""
    _corpus(tmp_path)
    digest = hashlib.sha256((tmp_path / "code.jsonl").read_bytes()).hexdigest()[:16]
    assert digest == CORPUS_GOLDEN
