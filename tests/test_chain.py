"""Epochs chained into one read (pipeline/read/chain.py): a small repeated stream's epochs, a
lane's share of them above all, are read several to an execution, with the same documents in
the same order as one execution per epoch, and a resume anywhere inside a chain is exact."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import pipeline.read.chain as chain
from pipeline.read.chain import STRIDE, EpochChain, epochs_per_chain
from pipeline.read.reading import BLOCK_SCHEMA, Unit, iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import DocSource
from tests.conformance import assert_stage_conforms, doc_key
from tests.conftest import stdlib_texts, write_jsonl


def _cfg(tmp_path, pieces: int, lanes: int = 1, repeat: int = 9):
    """Two small files (~60 kB, a reject and an empty text among them) read `repeat` times,
    in read blocks larger than an epoch: several epochs to a chain (more for a lane of 2)."""
    if not (tmp_path / "a.jsonl").exists():
        lines = [json.dumps({"text": t}) for t in stdlib_texts(30, max_bytes=1500)]
        lines[4] = "{not json"
        lines[9] = json.dumps({"text": ""})
        (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
        write_jsonl(tmp_path / "b.jsonl", stdlib_texts(10, start=40, max_bytes=1500))
    return parse_config({
        "seed": 7, "seq_len": 64, "global_batch_size": 2, "on_error": "skip", "lanes": lanes,
        "shuffle": {"window": 4, "pieces": pieces, "piece_bytes": 4096},
        "read": {"block_bytes": 262144, "first_block_bytes": 1500},
        "streams": {"s": {"paths": [str(tmp_path / "*.jsonl")], "repeat": repeat}},
    })  # fmt: skip


class Counted:
    """iter_blocks_local, counting its executions and the units each one read."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, units, stream, tok):
        self.calls.append(len(units))
        return iter_blocks_local(units, stream, tok)


def _docs(cfg, lane=None, state=None, executor=iter_blocks_local):
    source = DocSource("s", 0, cfg, executor, lane=lane)
    if state is not None:
        source.set_state(state)
    source.start()
    return source


@pytest.mark.parametrize("pieces", [256, 0], ids=["interleaved", "file-order"])
@pytest.mark.parametrize("lane", [None, 1], ids=["one-lane", "lane-1-of-2"])
def test_chained_epochs_give_the_documents_of_one_read_per_epoch(tmp_path, monkeypatch,
                                                                 pieces, lane):  # fmt: skip
    cfg = _cfg(tmp_path, pieces, lanes=1 if lane is None else 2)
    runs = {}
    for name, blocks in (("chained", chain.CHAIN_BLOCKS), ("per-epoch", 0)):
        monkeypatch.setattr(chain, "CHAIN_BLOCKS", blocks)
        executor = Counted()
        source = _docs(cfg, lane, executor=executor)
        runs[name] = ([doc_key(d) for d in source], executor.calls, source.pos.epoch)
    (chained, calls, epochs), (per_epoch, calls_1, epochs_1) = runs["chained"], runs["per-epoch"]
    assert epochs == epochs_1 == 9
    assert len(chained) > 9 * 10 and chained == per_epoch
    # One execution per epoch without chains; with them, the first epoch (started alone,
    # ramping up from small units) and then chains of several epochs.
    assert len(calls_1) == 9
    assert len(calls) <= 4, calls


@pytest.mark.parametrize("pieces", [256, 0], ids=["interleaved", "file-order"])
def test_a_source_resumes_exactly_inside_and_between_chains(tmp_path, pieces):
    cfg = _cfg(tmp_path, pieces, repeat=7)
    n = sum(1 for _ in _docs(cfg))
    per_epoch = n // 7
    # States in the first epoch, on chain and epoch boundaries, and in the middle of chains.
    midpoints = [0, 5, per_epoch, per_epoch + 3, 2 * per_epoch + 1, 4 * per_epoch - 1,
                 4 * per_epoch, 5 * per_epoch + 7, n - 2]  # fmt: skip
    assert_stage_conforms(lambda s: _docs(cfg, state=s), n + 5, midpoints, doc_key)


def _block(labels: list[int]) -> pa.Table:
    n = len(labels)
    return pa.table({
        "unit": pa.array(labels, pa.int32()), "doc_id": pa.array(range(n), pa.uint64()),
        "tokens": pa.array([[i] for i in range(n)], pa.large_list(pa.int32())),
        "loss": pa.array([[1]] * n, pa.large_list(pa.int8())),
        "error": pa.array([None] * n, pa.string()), "backend": pa.array([0] * n, pa.int8()),
    }, schema=BLOCK_SCHEMA)  # fmt: skip


def test_a_chain_hands_each_epoch_its_rows_however_the_blocks_fall():
    """Blocks that straddle epochs, an empty block, an epoch whose only unit gave no rows:
    each epoch gets exactly its rows, with the unit labels it has alone."""
    units = [[Unit(0, ()), Unit(1, ())], [Unit(0, ())], [Unit(0, ()), Unit(1, ())]]
    seen: list[list[int]] = []
    S = STRIDE
    blocks = [_block([0, 0, 1]), _block([1, 2 * S]), _block([]), _block([2 * S + 1])]

    def start(labelled):
        seen.append([u.index for u in labelled])
        return iter(blocks)

    c = EpochChain(5, units, start)
    assert seen == [[0, 1, S, 2 * S, 2 * S + 1]] and c.covers(7) and not c.covers(8)
    got = {e: [b.column("unit").to_pylist() for b in c.blocks(e)] for e in (5, 6, 7)}
    assert got == {5: [[0, 0, 1], [1]], 6: [], 7: [[0], [1]]}
    with pytest.raises(AssertionError):
        c.blocks(5)  # each epoch once, in order


def test_a_chain_is_as_many_epochs_as_a_block_of_work():
    assert epochs_per_chain(20 << 20, 8 << 20, 100) == 1  # a large epoch: one per read
    assert epochs_per_chain(8 << 20, 8 << 20, 100) == 1
    assert epochs_per_chain(700 << 10, 8 << 20, 100) == 12
    assert epochs_per_chain(700 << 10, 8 << 20, 5) == 5  # no further than the last epoch
    assert epochs_per_chain(1, 8 << 20, 10**6) == chain.MAX_EPOCHS
