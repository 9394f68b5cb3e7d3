"""Lanes (pipeline/lanes/): K feeds, each with its share of every stream, make G/K rows of
every global step. The sequence is a function of (config, seed, K), never of the world size;
it resumes exactly from one nested state; mixing stays within K segments of its targets; a
weight change lands at one step in every lane; lanes on Ray actors make the bytes that lanes
in one process make."""

from __future__ import annotations

import hashlib
import itertools
import json

import pyarrow as pa
import pytest

from pipeline.feed import StepFeed
from pipeline.lanes import LanedFeed, LaneError
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.plan import lane_shares
from pipeline.state.resume import StateError, check_laned_state, seal
from service.export import run_export, step_path
from tests.conftest import stdlib_texts, write_jsonl
from tests.helpers import reassemble, rows_of
from tests.rayhead import patient
from wire.layout import read_step


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("lanes")
    texts = stdlib_texts(120, max_bytes=6000)
    for k in range(3):
        write_jsonl(d / f"code{k}.jsonl", texts[k * 30 : (k + 1) * 30])
    chats = [{"messages": [{"role": "user", "content": t[:80]},
                           {"role": "assistant", "content": t[:600]}]} for t in texts[90:]]  # fmt: skip
    write_jsonl(d / "chat.jsonl", chats)
    return {
        "code": {"paths": [str(d / "code*.jsonl")], "weight": 0.7},
        "chat": {"paths": [str(d / "chat.jsonl")], "kind": "chat", "weight": 0.3},
    }


def config(streams, lanes: int, **extra):
    base = {"seq_len": 128, "global_batch_size": 8, "lanes": lanes, "streams": streams,
            "shuffle": {"piece_bytes": 8 << 10}, "read": {"first_block_bytes": 8 << 10}}  # fmt: skip
    return parse_config(base | extra)


def steps_of(feed, n: int | None = None) -> list[pa.RecordBatch]:
    out = []
    while (n is None or len(out) < n) and (b := feed.next_step()) is not None:
        out.append(b)
    feed.close()
    return out


def laned(cfg, **kw) -> LanedFeed:
    return LanedFeed(cfg, local=True, **kw)


def test_one_lane_is_the_config_without_lanes(streams):
    with_key = config(streams, 1)
    without = parse_config({k: v for k, v in with_key.model_dump(mode="json").items()
                            if k != "lanes"})  # fmt: skip
    assert with_key.config_hash() == without.config_hash()
    assert config(streams, 2).config_hash() != with_key.config_hash()


def test_lanes_must_divide_the_step(streams):
    with pytest.raises(ValueError, match="lanes: 3 must divide global_batch_size 8"):
        config(streams, 3)


def test_lanes_are_asked_2k_steps_a_call_with_16_steps_ahead():
    """The control asks a lane for max(4, 2K) steps a call, with at least 16 steps and two
    calls ahead (the depth that kept 2 lanes busy), and the first call for 4 steps."""
    from pipeline.lanes import STEPS_PER_CALL, in_flight, steps_per_call

    for k, per_call, ahead in [(2, 4, 4), (3, 6, 3), (4, 8, 2), (8, 16, 2), (16, 32, 2),
                               (64, 128, 2)]:  # fmt: skip
        assert (steps_per_call(k), in_flight(k)) == (per_call, ahead), k
        assert in_flight(k) * steps_per_call(k) >= 16
    assert STEPS_PER_CALL == 4


def test_the_control_asks_more_chunks_ahead_while_it_waits_on_the_lanes(streams, ray_cluster,
                                                                         monkeypatch):  # fmt: skip
    """While the control waits on lanes that have cores of their own it asks twice as many
    chunks ahead, up to a read unit's tokens of a lane's steps (`most_in_flight`): a lane
    tokenizing a unit then does not stop the others. While the answers are made before it
    asks, or the lanes share their cores, one fewer, down to `in_flight`: a weight change
    waits for fewer steps."""
    import time
    from dataclasses import replace

    import numpy as np

    from pipeline.lanes import (
        LaneMade,
        had_cores,
        in_flight,
        most_in_flight,
        next_depth,
        steps_per_call,
    )
    from pipeline.lanes import depth as lanes_depth

    big = parse_config({"seq_len": 2048, "global_batch_size": 32, "lanes": 16,
                        "streams": streams})  # fmt: skip
    assert most_in_flight(big) == 16  # 8 MiB ~ 2M tokens, 512 of a lane's 4,096-token steps
    huge = parse_config({"seq_len": 8192, "global_batch_size": 1024, "lanes": 2,
                         "streams": streams})  # fmt: skip
    assert most_in_flight(huge) == in_flight(2)  # 32 MB a step: the window's bytes bound it
    depths = [2]
    for waited in [True] * 5 + [False] * 20:
        depths.append(next_depth(depths[-1], waited, 2, 16))
    assert depths[:6] == [2, 4, 8, 16, 16, 16] and depths[-1] == 2
    assert depths[6:9] == [15, 14, 13]

    # Lanes have cores of their own when their processes' CPU keeps up with their making.
    def made(wall: float, process: float) -> LaneMade:
        return replace(empty, making_s=wall, making_process_s=process)

    empty = LaneMade(0, np.ones(1), np.ones(1), np.ones((1, 1)), np.ones((1, 1)), [None])
    cored, after = had_cores([(0.0, 0.0)] * 2, [made(1.0, 0.9), made(2.0, 1.6)])
    assert cored and after == [(1.0, 0.9), (2.0, 1.6)]
    assert not had_cores(after, [made(2.0, 1.0), made(3.0, 1.7)])[0]  # 0.2 of a core: shared
    nothing = replace(empty, rows=np.zeros(0))
    assert had_cores(after, [made(2.0, 1.9), nothing]) == (True, [(2.0, 1.9), (2.0, 1.6)])

    # Live, on actors. This machine's cores are shared with the test, so the lanes are taken
    # to have cores of their own whatever they had (CORED 0): the rule above decides that.
    monkeypatch.setattr(lanes_depth, "CORED", 0.0)
    cfg = config({n: s | {"repeat": 40} for n, s in streams.items()}, 2,
                 read={"first_block_bytes": 8 << 10, "block_bytes": 64 << 10})  # fmt: skip
    least, most = in_flight(2), most_in_flight(cfg)
    assert (least, most) == (4, 8)  # 64 KiB: 16k tokens, 32 steps of 4 x 128
    feed = LanedFeed(cfg, hold=True)
    try:
        seen = [feed.depth]
        for _ in range(12):  # taken as fast as they come: the lanes read as they go
            feed.next_step()
            seen.append(feed.depth)
        assert seen[0] == least and max(seen) > least, seen
        for _ in range(most * 3):  # each chunk taken once its lanes have long made it
            time.sleep(0.2)
            for _ in range(steps_per_call(2)):
                feed.next_step()
            if feed.depth == least:
                break
        assert feed.depth == least
        # Taken as fast as they come again while the ranks set the pace (the batch server's
        # window filled, and no rank has waited since: they train on what they took), the
        # depth stays. Then once a rank waits: the lanes' reads make the control wait again.
        for behind in (True, False):
            feed.ranks_behind = behind
            seen = []
            for _ in range(96):
                feed.next_step()
                seen.append(feed.depth)
            assert max(seen) == least if behind else max(seen) > least, (behind, seen)
    finally:
        feed.close()


def test_a_nested_state_is_sealed_once_and_keeps_one_copy():
    """A laned step's state is kept as its lanes' parts and sealed when first asked for: the
    seal is the one over the lanes' digests, asked again it is the same object, and the parts
    are let go once sealed (a state asked for holds one copy of its text, not two)."""
    import threading

    from pipeline.state.resume import STATE_VERSION, Kept, digest, nest_kept

    lanes = [Kept.seal({"step": 5, "lane": k, "text": "é" * k}) for k in range(3)]
    for threads in (1, 8):
        nested = nest_kept(STATE_VERSION, "h", lanes)
        assert nested.step == 5 and nested._kept is None  # nothing sealed yet
        got: list = []
        workers = [threading.Thread(target=lambda n=nested, g=got: g.append(n.kept))
                   for _ in range(threads)]  # fmt: skip
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len({(k.digest, k.text) for k in got}) == 1
        assert nested.kept is nested.kept and nested._texts is None and nested._digests is None
        state = nested.unpack()
        assert state["lanes"] == [k.unpack() for k in lanes]
        assert nested.digest == state["digest"] == digest(state)


@pytest.mark.parametrize("full", [True, False], ids=["full", "compact"])
def test_a_lane_holding_chunks_gives_each_rank_the_steps_made_one_by_one(streams, full):
    """A holding lane keeps each call's steps in one chunk (wire/schema.py StepChunk) and
    slices a rank's rows out when it takes them. For world sizes 1, 2, 4 and 8, the runs a
    rank takes (rows, schema, metadata in order, steps per run), across chunks, across steps
    with and without `labels` and in chunks with and without them, through the short last
    step, are those that `runs_of` joins from the lane's steps made one by one; each step's
    part (its IPC bytes), receipt and state are that step's."""
    from pipeline.lanes import LaneWorker, served_counts
    from wire.arrays import from_ipc, to_ipc
    from wire.lane_rows import lane_parts, runs_of

    few_chats = {
        "code": streams["code"] | {"weight": 0.9},
        "chat": streams["chat"] | {"weight": 0.1},
    }
    cfg = config(few_chats, 2)
    cfg_json = cfg.model_dump(mode="json", context={"reveal_secrets": True})
    plain = LaneWorker(cfg_json, 1, None, False, full, True, False)
    held = LaneWorker(cfg_json, 1, None, False, full, True, False, hold=True)
    want: list = []
    chunks_labelled = set()
    for call in itertools.cycle([1, 2, 1, 3, 1]):  # chunks of several sizes
        got, _ = plain.steps(call, 1)
        made, _ = held.steps(call, 1)
        assert len(made) == len(got) and made.first == len(want)
        if not got:
            break
        chunks_labelled.add(any("labels" in b.schema.names for b, _ in got))
        for j, (batch, state) in enumerate(got):
            assert made.states[j] == state
            r, c = made.receipt(j), served_counts(batch, list(cfg.streams))
            assert (r.rows, r.real_tokens, r.tokens, r.docs) == (c.rows, c.real_tokens, c.tokens,
                                                                 c.docs)  # fmt: skip
            assert held.part(made.first + j) == to_ipc(batch)
        want += [batch for batch, _ in got]
    rows = [b.num_rows for b in want]
    assert len(rows) > 6 and rows[-1] < 4, "the short last step is covered"
    schemas = {tuple(b.schema.names) for b in want}
    if not full:
        assert len(schemas) == 2, "steps with and without labels both occur"
        assert chunks_labelled == {True, False}, "chunks with and without labels both occur"
    for world in (1, 2, 4, 8):
        for rank in range(world):
            parts = [(s, lo, hi) for s, n in enumerate(rows)
                     for k, lo, hi in lane_parts([4, n], rank, world, 8) if k == 1]  # fmt: skip
            for at in range(0, len(parts), 5):  # 5 steps a call: across chunks
                asked = parts[at : at + 5]
                runs = held.take(asked, rank, world)
                expect = runs_of([want[s].slice(lo, hi - lo) for s, lo, hi in asked], rank, world)
                assert [n for _, n in runs] == [n for _, n in expect]
                for (ipc, _), (batch, _) in zip(runs, expect, strict=True):
                    got = from_ipc(ipc)
                    assert got.equals(batch), (world, rank, at)
                    assert list(got.schema.metadata.items()) == list(batch.schema.metadata.items())
    held.close()
    plain.close()


def test_the_partition_is_balanced_and_deterministic():
    works = [100, 5, 70, 70, 30, 1, 1, 60, 40]
    shares = lane_shares(works, 3)
    assert shares == lane_shares(works, 3)
    load = [sum(w for w, s in zip(works, shares, strict=True) if s == k) for k in range(3)]
    assert max(load) - min(load) <= max(works)
    assert lane_shares(works, 1) == [0] * len(works)


def pieces_of(batches) -> dict:
    out: dict = {}
    for b in batches:
        for row in rows_of(b):
            at = 0
            for n, s, d, off in zip(row["seq_lens"], row["stream"], row["doc_id"],
                                    row["doc_offset"], strict=True):  # fmt: skip
                out.setdefault((s, d), []).append((off, row["input_ids"][at : at + n]))
                at += n
    return out


@pytest.mark.parametrize("lanes", [2, 4])
def test_lanes_serve_each_piece_once_with_the_documents_tokens(streams, lanes):
    """Pieces of the streams are shared among the lanes, never repeated: every segment the
    lanes serve holds its document's tokens at its offset (each stream alone, one lane, gives
    every document whole), none twice, and the lanes serve most of what one lane serves (the
    sequence ends when the first lane runs dry, leaving the others' tail: within a piece per
    lane of the data, here ~17k tokens cut into 8 KiB pieces, so up to a quarter at K=4)."""
    docs = {}
    for name, stream in streams.items():
        alone = steps_of(StepFeed(config({name: stream}, 1), iter_blocks_local))
        docs |= reassemble(r for b in alone for r in rows_of(b))
    many = pieces_of(steps_of(laned(config(streams, lanes))))
    seen = set()
    for key, parts in many.items():
        for off, toks in parts:
            assert (key, off) not in seen, (key, off)
            seen.add((key, off))
            assert toks == docs[key][off : off + len(toks)].tolist(), (key, off)
    served = sum(len(t) for parts in many.values() for _, t in parts)
    one = pieces_of(steps_of(StepFeed(config(streams, 1), iter_blocks_local)))
    assert served >= 0.75 * sum(len(t) for parts in one.values() for _, t in parts)


@pytest.mark.parametrize("lanes", [2, 4])
def test_global_rows_do_not_depend_on_the_world_size(streams, tmp_path, lanes):
    cfg = config(streams, lanes)
    seen = {}
    for world in (1, 2, 4, 8):
        out = tmp_path / f"w{world}"
        s = run_export(cfg, out, steps=6, world_size=world, executor=iter_blocks_local)
        assert s.export.steps_written == 6
        steps = []
        for step in range(6):
            parts = [read_step(step_path(out, step, r, "parquet")) for r in range(world)]
            steps.append(pa.Table.from_batches(parts).to_pydict())
        seen[world] = steps
    for world in (2, 4, 8):
        assert seen[world] == seen[1], world


def test_a_lane_owns_its_rows_of_every_step(streams):
    """Lane k makes rows [k*G/K, (k+1)*G/K): a lane's own feed gives exactly those rows."""
    cfg = config(streams, 2)
    joined = steps_of(laned(cfg), 5)
    lane1 = steps_of(StepFeed(cfg, iter_blocks_local, lane=1), 5)
    for whole, part in zip(joined, lane1, strict=True):
        assert whole.slice(4, 4).to_pydict() == part.to_pydict()


def test_resume_from_a_laned_state_equals_the_uninterrupted_run(streams):
    cfg = config(streams, 2)
    full = steps_of(laned(cfg))
    assert len(full) > 8
    first = laned(cfg, state_every=4)
    head = [first.next_step() for _ in range(4)]
    state = json.loads(json.dumps(first.get_state()))
    first.close()
    assert state["step"] == 4 and len(state["lanes"]) == 2
    rest = steps_of(laned(cfg, state=state))
    for a, b in zip(head + rest, full, strict=True):
        assert a.to_pydict() == b.to_pydict()
        assert a.schema.metadata == b.schema.metadata


def test_states_of_other_lanes_are_refused_by_name(streams):
    two, four, one = config(streams, 2), config(streams, 4), config(streams, 1)
    feed = laned(two, state_every=2)
    steps_of(feed, 2)
    state = feed.get_state()
    with pytest.raises(StateError, match="has 2 lanes, this config has lanes: 4"):
        laned(four, state=state)
    with pytest.raises(StateError, match="holds 2 lanes and this config has lanes: 1"):
        StepFeed(one, iter_blocks_local, state=state)
    single = StepFeed(one, iter_blocks_local)
    single.next_step()
    with pytest.raises(StateError, match="a single feed's and this config has lanes: 2"):
        check_laned_state(single.get_state(), two.config_hash(), ["code", "chat"], False,
                          "bfd", 2)  # fmt: skip
    single.close()
    broken = dict(state, step=3)
    with pytest.raises(StateError, match="digest does not match"):
        laned(two, state=broken)


def test_a_laned_state_is_sealed_over_its_lanes_seals(streams):
    """The outer seal covers each lane by its digest, and each lane is checked by its own: a
    lane edited (re-sealed or not), lanes swapped, all refused; a state sealed over the lanes'
    whole JSON, as before, resumes."""
    cfg = config(streams, 2)
    feed = laned(cfg, state_every=2)
    steps_of(feed, 2)
    state = json.loads(json.dumps(feed.get_state()))
    assert set(state) == {"version", "config_hash", "step", "lanes", "digest"}
    names, hashed = ["code", "chat"], cfg.config_hash()

    def check(s):
        return check_laned_state(s, hashed, names, False, "bfd", 2)

    assert [p["digest"] for p in check(state)] == [p["digest"] for p in state["lanes"]]
    edited = json.loads(json.dumps(state))
    edited["lanes"][1]["feed"]["rows"] += 1
    with pytest.raises(StateError, match="lane 1: resume state digest does not match"):
        check(edited)
    resealed = json.loads(json.dumps(edited))
    seal(resealed["lanes"][1])  # the lane passes its own check; the outer seal names it
    with pytest.raises(StateError, match="digest does not match"):
        check(resealed)
    swapped = dict(state, lanes=state["lanes"][::-1])
    with pytest.raises(StateError, match="digest does not match"):
        check(swapped)
    whole = {k: v for k, v in state.items() if k != "digest"}
    canonical = json.dumps(whole, sort_keys=True, separators=(",", ":"))
    before = dict(whole, digest=hashlib.sha256(canonical.encode()).hexdigest())
    assert before["digest"] != state["digest"]
    assert check(before) == check(state)


def test_mixing_holds_at_every_prefix_within_one_segment_per_lane(streams):
    lanes, cfg = 4, config(streams, 4)
    placed, total = {"code": 0, "chat": 0}, 0
    for b in steps_of(laned(cfg)):
        for row in rows_of(b):
            for n, s in zip(row["seq_lens"], row["stream"], strict=True):
                placed[s] += n
                total += n
        for name, w in (("code", 0.7), ("chat", 0.3)):
            assert abs(placed[name] - w * total) <= lanes * cfg.seq_len, (name, placed, total)


def test_a_weight_change_lands_at_one_step_in_every_lane(streams):
    cfg = config(streams, 2)
    feed = laned(cfg)
    for _ in range(3):
        feed.next_step()
    with pytest.raises(ValueError, match="already produced"):
        feed.set_weights({"code": 0.5, "chat": 0.5}, 2)
    at = feed.set_weights({"code": 0.1, "chat": 0.9}, 3)
    assert at == feed.plan.asked > 3  # the first step no lane has begun
    for lane in feed.lanes:
        history = lane.worker.feed.mixer.history
        assert [(c.step, c.source) for c in history][-1] == (at, "api")
    later = steps_of(feed)[at - 3 :]
    chat = sum(n for b in later for r in rows_of(b)
               for n, s in zip(r["seq_lens"], r["stream"], strict=True) if s == "chat")  # fmt: skip
    every = sum(n for b in later for r in rows_of(b) for n in r["seq_lens"])
    assert chat / every > 0.6


def test_the_summary_counts_what_was_served(streams):
    cfg = config(streams, 2)
    feed = laned(cfg)
    batches = steps_of(feed)
    summary = feed.summary()
    served = sum(n for b in batches for r in rows_of(b) for n in r["seq_lens"])
    assert summary.real_tokens == served
    assert summary.steps == len(batches) and summary.rows == sum(b.num_rows for b in batches)
    assert sum(s.tokens for s in summary.streams.values()) == served
    assert abs(summary.streams["code"].realized_share - 0.7) < 0.05


def test_what_the_lanes_read_and_did_not_serve_at_the_end_is_reported(streams):
    """The data ends at the first step a lane cannot fill; what the other lanes read beyond
    it is counted in the summary's notes (against `lanes: 1`, which serves every token of one
    stream)."""
    code = {"code": streams["code"] | {"weight": 1.0}}
    whole = steps_of(laned(config(code, 1)))
    feed = laned(config(code, 4))
    batches = steps_of(feed)
    summary = feed.summary()
    lost = sum(n for b in whole for r in rows_of(b) for n in r["seq_lens"]) - summary.real_tokens
    notes = [line for line in summary.exhausted if "were not served" in line]
    told = sum(int(line.split(": ", 1)[1].split(" tokens")[0].replace(",", "")) for line in notes)
    assert batches and lost > 0 and told == lost, (lost, notes)


def test_a_lane_reading_ahead_makes_the_steps_of_a_lane_reading_as_it_packs(streams,
                                                                            monkeypatch):  # fmt: skip
    """A lane actor reads its share on a thread of its own (`read.ahead`,
    `reading.read_ahead`): through several epochs, chained (small epochs read together), to
    the data's end, its steps, states and rows are those of a lane that reads as it packs;
    closed, it leaves no reading thread behind. A record that fails the read fails the lane
    reading ahead with the error it raises reading as it packs."""
    import threading

    from pipeline.lanes import LaneWorker
    from pipeline.read import reading

    def threads() -> int:
        return sum(t.name == "tokenmill-prefetch" for t in threading.enumerate())

    tokenized_on: set[str] = set()  # the threads that tokenized a unit
    tokenize_unit = reading.tokenize_unit

    def noting(*args, **kw):
        tokenized_on.add(threading.current_thread().name)
        return tokenize_unit(*args, **kw)

    monkeypatch.setattr(reading, "tokenize_unit", noting)

    def run(cfg, ahead: bool, k: int = 1):
        cfg_json = cfg.model_dump(mode="json", context={"reveal_secrets": True})
        lane = LaneWorker(cfg_json, k, None, False, False, True, False, hold=True,
                          read_ahead=ahead)  # fmt: skip
        out = []
        tokenized_on.clear()
        try:
            while True:
                made, _ = lane.steps(3, 1, len(out) - 4)
                if not len(made):
                    break
                out += [(s.text, lane.part(made.first + j)) for j, s in enumerate(made.states)]
        finally:
            lane.close()
        assert tokenized_on == ({"tokenmill-prefetch"} if ahead else {"MainThread"})
        return out

    cfg = config({n: s | {"repeat": 3} for n, s in streams.items()}, 2)
    before = threads()
    plain, ahead = run(cfg, False), run(cfg, True)
    assert len(plain) > 20 and ahead == plain
    assert threads() == before

    bad = streams["code"] | {"paths": streams["code"]["paths"] + [str(_bad_file(streams))]}
    failing = config({"code": bad}, 2, on_error="fail")

    def outcomes(read_ahead: bool) -> list:
        out = []
        for k in (0, 1):  # the lane whose share holds the bad file fails
            try:
                out.append(len(run(failing, read_ahead, k)))
            except Exception as e:  # the same error, whatever it is
                out.append((type(e), str(e)))
        return out

    plain_outcome = outcomes(False)
    assert any(isinstance(o, tuple) for o in plain_outcome), plain_outcome
    assert outcomes(True) == plain_outcome
    assert threads() == before


def _bad_file(streams) -> object:
    import glob
    from pathlib import Path

    first = Path(sorted(glob.glob(streams["code"]["paths"][0]))[0])
    bad = first.with_name("zz_bad.notjsonl.jsonl")
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    return bad


@pytest.mark.slow
def test_lanes_on_ray_actors_make_the_bytes_of_lanes_in_one_process(streams, ray_cluster,
                                                                    tmp_path):  # fmt: skip
    """Two lane actors, each reading and tokenizing its share itself (`read.in_lanes`, the
    default) or through Ray Data's tasks, beside an in-process laned export: the same step
    files and states, byte for byte; a lane actor killed mid-run fails the run naming it."""
    import ray

    cfg = config(streams, 2)
    by_ray_data = config(streams, 2, read={"first_block_bytes": 8 << 10, "in_lanes": False})
    assert by_ray_data.config_hash() == cfg.config_hash()
    run_export(cfg, tmp_path / "local", steps=8, state_every=4, executor=iter_blocks_local)
    for d, c in (("actors", cfg), ("ray-data", by_ray_data)):
        run_export(c, tmp_path / d, steps=8, state_every=4)
        for step in range(8):
            a, b = (read_step(step_path(tmp_path / x, step, 0, "parquet")) for x in (d, "local"))
            assert a.equals(b) and a.schema.metadata == b.schema.metadata
        for name in ("state-00000004.json", "state-00000008.json"):
            assert (tmp_path / d / name).read_bytes() == (tmp_path / "local" / name).read_bytes()

    feed = LanedFeed(cfg)
    feed.next_step()
    ray.kill(feed.lanes[1].handle)
    with pytest.raises(LaneError, match="lane 1 of 2 failed"):
        steps_of(feed)


@pytest.mark.slow
def test_a_laned_service_serves_many_ranks_the_export_with_its_weight_change(
    streams, ray_cluster, tmp_path
):
    """Lanes behind the batch server: 4 ranks pull at once while the weights change through
    the control path; every rank gets exactly the rows of an export whose config schedules
    that change at the step the service chose, and the mixture records it once."""
    import os
    import threading
    import time

    import ray

    from service.serve import start_server
    from tests.test_ranks import assert_equal_to_export, exported, pull, wait_produced

    cfg = config(streams, 2)
    name = f"lanes{os.getpid()}"
    actor = start_server(cfg, name=name, prefetch=4)
    try:
        wait_produced(actor, 2)
        step = ray.get(actor.set_weights.remote({"code": 0.5, "chat": 0.5}))
        assert step >= 2
        steps = 8
        got: dict[int, list] = {r: [] for r in range(4)}
        threads = [threading.Thread(target=pull, args=(name, r, 4, steps, got[r]))
                   for r in range(4)]  # fmt: skip
        figures = []

        def watch():  # the page's polling, while the ranks pull
            while any(t.is_alive() for t in threads):
                figures.append(ray.get(actor.metrics.remote()))
                time.sleep(0.1)

        for t in threads:
            t.start()
        watcher = threading.Thread(target=watch)
        watcher.start()
        for t in threads:
            t.join(timeout=patient(300))
        watcher.join()
        figures.append(ray.get(actor.metrics.remote()))
        for m in figures:
            assert sum(s["tokens"] for s in m["streams"].values()) == m["real_tokens"]
        assert figures[-1]["real_tokens"] > 0
        mixture = ray.get(actor.mixture.remote())
        assert [c["step"] for c in mixture["history"] if c["source"] == "api"] == [step]
    finally:
        ray.kill(actor)
    scheduled = parse_config(cfg.model_dump(mode="json")
                             | {"schedule": [{"step": step, "weights": {"code": 0.5, "chat": 0.5}}]})  # fmt: skip
    assert_equal_to_export(got, exported(scheduled, tmp_path, steps, 4), steps)


def test_trace_from_a_laned_state_is_the_laned_run(streams):
    """`tokenmill trace --state` of a laned run replays every lane from the nested state."""
    from pipeline.inspect.provenance import state_step

    cfg = config(streams, 2)
    steps = steps_of(laned(cfg), 5)
    first = laned(cfg, state_every=2)
    steps_of(first, 2)
    at_two = first.get_state()
    for step in (2, 4):
        assert state_step(cfg, at_two, step).to_pydict() == steps[step].to_pydict()


def test_check_and_stats_of_a_laned_config_count_the_whole_corpus(streams):
    from pipeline.inspect.stats import count_corpus

    def counts(cfg):
        return {n: (c.records, c.tokens) for n, c in count_corpus(cfg, lambda r: None).items()}

    assert counts(config(streams, 4)) == counts(config(streams, 1))


@pytest.mark.slow
def test_laned_ranks_resuming_from_a_state_go_on_as_the_export(streams, ray_cluster, tmp_path):
    """Ranks that resume from a state of the laned service (the seek builds new lane actors
    from the nested state and closes the old ones) get steps 2, 3, ... exactly as the
    export has them."""
    import os
    import threading

    import numpy as np
    import ray

    from service.serve import start_server
    from tests.test_ranks import exported, wait_produced
    from trainer.feed import Feed as RankFeed

    cfg = config(streams, 2)
    name = f"seek{os.getpid()}"
    actor = start_server(cfg, name=name, prefetch=4)
    got: dict[int, list] = {0: [], 1: []}
    try:
        wait_produced(actor, 4)  # the window's worth, with no rank connected
        state = ray.get(actor.state.remote(2))
        assert ray.get(actor.seek.remote(state)) == 2  # the new lanes, from the state

        def rank(r):
            feed = RankFeed.connect(service=name, rank=r, world_size=2, state=state, timeout_s=60)
            for _ in range(4):
                b = next(feed)
                got[r].append((b["global_step"], b["input_ids"].numpy(), b["labels"].numpy()))

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=patient(300))
    finally:
        ray.kill(actor)
    want = exported(cfg, tmp_path, 6, 2)
    for r, taken in got.items():
        assert [s for s, _, _ in taken] == [2, 3, 4, 5], r
        for s, ids, labels in taken:
            np.testing.assert_array_equal(ids, want[(s, r)][0])
            np.testing.assert_array_equal(labels, want[(s, r)][1])


@pytest.mark.slow
def test_two_laned_exports_at_once_are_each_the_lone_run(streams, ray_cluster, tmp_path):
    """Two laned exports of different seeds at the same time on one cluster (four lane
    actors at once): each writes the bytes of its lone in-process run."""
    from concurrent.futures import ThreadPoolExecutor

    runs = {"a": config(streams, 2), "b": config(streams, 2, seed=99)}
    for name, cfg in runs.items():
        run_export(cfg, tmp_path / f"lone-{name}", steps=6, executor=iter_blocks_local)
    with ThreadPoolExecutor(2) as pool:
        done = [
            pool.submit(run_export, cfg, tmp_path / name, steps=6) for name, cfg in runs.items()
        ]
        for f in done:
            f.result()
    for name in runs:
        for step in range(6):
            a, b = (read_step(step_path(tmp_path / d, step, 0, "parquet"))
                    for d in (name, f"lone-{name}"))  # fmt: skip
            assert a.equals(b), (name, step)
    lone_a = read_step(step_path(tmp_path / "lone-a", 0, 0, "parquet"))
    assert not lone_a.equals(read_step(step_path(tmp_path / "lone-b", 0, 0, "parquet")))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    """A corpus whose end comes within ~20 steps of 8 x 128 tokens (the short last step)."""
    d = tmp_path_factory.mktemp("small")
    texts = stdlib_texts(40, max_bytes=3000)
    write_jsonl(d / "code.jsonl", texts[:25])
    write_jsonl(d / "prose.jsonl", [{"text": t} for t in texts[25:]])
    return {
        "code": {"paths": [str(d / "code.jsonl")], "weight": 0.6},
        "prose": {"paths": [str(d / "prose.jsonl")], "weight": 0.4},
    }


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [2, 4])
def test_ranks_take_their_rows_from_the_lanes_for_any_world(small, ray_cluster, lanes):
    """The batch server never holds a token with lanes: its window holds where each step's
    rows are, and every answer says where (no rows in it). Ranks of worlds 1, 2, 4 and 8 take
    them from the lanes, alone or joined across lanes (a world smaller than K, the short last
    step), and get exactly their slice of the laned sequence, to its end. Once every rank has
    asked past a step, the lanes let it go."""
    import os

    import ray

    from pipeline.feed import rank_slice
    from pipeline.lanes import LanedStep, in_flight, most_in_flight, steps_per_call
    from service.batch_server import BatchServer
    from service.prometheus import prometheus_text
    from wire.arrays import from_ipc
    from wire.lane_rows import LaneActors, fetch, split_run
    from wire.layout import expand

    cfg = config(small, lanes)
    want = steps_of(LanedFeed(cfg, local=True, full_batches=False))
    assert 6 <= len(want) <= 40 and want[-1].num_rows < 8  # it ends in a short step
    # Each case of a world against K: smaller (ranks join rows across lanes), K, larger. Two
    # lanes take every world; four take the two whose joins differ with K (each server starts
    # K lane processes, ~2 CPU-s each: four worlds of four lanes were 35 CPU-s).
    for world in {2: (1, 2, 4, 8), 4: (2, 8)}[lanes]:
        srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
        views: list[list[dict]] = []
        asked: list[str] = []  # keys whose lane actors a rank asked for
        actors = LaneActors(lambda key, a=asked, s=srv: a.append(key) or s.lane_handles(key))
        try:
            pos, ended = [0] * world, set()
            while len(ended) < world:
                for r in sorted(set(range(world)) - ended):
                    while (reply := srv.get(r, world, pos[r], 2.0, 2)).status == "wait":
                        pass
                    if reply.status == "end":
                        ended.add(r)
                        continue
                    assert reply.ready and not reply.runs and reply.lanes, reply
                    with srv._cond:  # the window: where rows are, never the rows
                        assert all(isinstance(p, LanedStep) for p in srv.window.steps.values())
                    # The reply names lanes by key (no actor pickled into it); their actors
                    # are asked for once.
                    assert {key for key, _, _ in reply.lanes} == {srv.feed.key}
                    assert all(type(k) is int for _, k, _ in reply.lanes)
                    at = pos[r]
                    runs = fetch(reply.lanes, r, world, 60.0, actors)[0]
                    assert asked == [srv.feed.key]
                    for run in runs:
                        for part in split_run(from_ipc(run)):
                            mine = rank_slice(want[at], r, world, cfg.global_batch_size)
                            assert expand(part).to_pydict() == expand(mine).to_pydict(), (
                                world,
                                r,
                                at,
                            )
                            at += 1
                    assert at == pos[r] + reply.steps
                    pos[r] = at
                    views.append(srv.metrics()["lanes"])
            assert pos == [len(want)] * world, (world, pos)
            # Metrics say where each lane runs and what it holds: K live processes of their
            # own, each holding at most the window, a fetch per rank and the steps made ahead.
            bound = 3 + 2 * 2 + (most_in_flight(cfg) + 1) * steps_per_call(lanes)
            assert all(len(v) == lanes for v in views)
            assert max(d["held_steps"] for v in views for d in v) > 0
            assert all(d["held_steps"] <= bound for v in views for d in v), views
            pids = {d["pid"] for d in views[-1]}
            assert len(pids) == lanes and os.getpid() not in pids
            for pid in pids:
                os.kill(pid, 0)  # alive
            # Each lane's time making steps, wall and CPU, and the producer's wait on them.
            last = views[-1]
            assert all(d["making_s"] > 0 and d["making_cpu_s"] > 0 for d in last), last
            assert all(d["making_cpu_s"] <= d["making_s"] + 0.05 for d in last), last
            waited = srv.metrics()["lanes_waited_s"]
            assert waited is not None and waited >= 0
            text = prometheus_text(srv.metrics(), srv.status())
            assert text.count("tokenmill_lane_held_steps{lane=") == lanes
            assert text.count("tokenmill_lane_restarts_total{lane=") == lanes
            assert text.count("tokenmill_lane_making_seconds_total{lane=") == lanes
            assert text.count("tokenmill_lane_making_cpu_seconds_total{lane=") == lanes
            assert "tokenmill_lanes_waited_seconds_total " in text
            ahead = srv.metrics()["lanes_chunks_ahead"]  # LanedFeed.depth
            assert in_flight(lanes) <= ahead <= most_in_flight(cfg)
            assert f"tokenmill_lanes_chunks_ahead {float(ahead)}" in text
            first = srv.feed.lanes[0].handle  # every rank asked past step 0 long ago
            with pytest.raises(ray.exceptions.RayTaskError, match="no longer holds step 0"):
                ray.get(first.take.options(concurrency_group="serve").remote([(0, 0, 1)], 0, 1))
        finally:
            srv.close()


def _kill(actor) -> None:
    """Kill a lane actor and wait until it is gone (ray.kill is asynchronous)."""
    import time

    import ray

    ray.kill(actor)
    deadline = time.time() + patient(60)
    while True:
        try:
            ray.get(actor.process.remote(), timeout=2.0)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.time() < deadline, "the killed lane still answers"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_lane_killed_under_a_service_fails_it_by_name(small, ray_cluster):
    """A lane actor killed mid-run with no restarts left (`service.lane_restarts: 0`): a rank
    taking rows it held gets an error that says the lane is gone, and the service fails naming
    the lane, instead of hanging or serving a step without that lane's rows."""
    import time

    from service.batch_server import BatchServer
    from tests.helpers import resolved
    from wire.lane_rows import LaneGone

    # Read many times over: the lanes cannot have made the whole sequence (16 steps ahead of
    # what is handed out) before the kill, so the producer meets the dead lane (a CI run saw
    # the short corpus made to its end first, and nothing left to fail).
    forever = {n: s | {"repeat": 100} for n, s in small.items()}
    cfg = config(forever, 2, service={"lane_restarts": 0})
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    try:
        assert resolved(srv, srv.get(0, 1, 0, 30.0), 0, 1).runs
        while not (reply := srv.get(0, 1, 1, 2.0)).ready:
            pass
        _kill(srv.feed.lanes[1].handle)
        with pytest.raises(LaneGone, match="is gone"):
            resolved(srv, reply, 0, 1)
        deadline, step = time.time() + patient(60), 1 + reply.steps
        with pytest.raises(RuntimeError, match="lane 1 of 2 failed"):
            while time.time() < deadline:
                if (r := srv.get(0, 1, step, 2.0)).ready:
                    step += r.steps
        assert "lane 1 of 2 failed" in srv.status()["error"]
    finally:
        srv.close()


def _serve_to_the_end(srv, world: int, kills: dict[int, int], change: tuple | None = None
                      ) -> tuple[list[bytes], dict]:  # fmt: skip
    """Every rank's rows of every step to the end of the data (ranks take turns, a few steps
    at a time, as the client does), as Arrow IPC per rank and step; lane `kills[step]` is
    killed once rank 0 has taken the steps before `step`, after `change` (rank 0's step,
    weights, effective step) is sent to the lanes, as the API sends one. And the state at the
    last step."""
    from tests.helpers import resolved
    from wire.arrays import from_ipc, own, to_ipc
    from wire.lane_rows import split_run

    out: dict[tuple[int, int], bytes] = {}
    at, ended = [0] * world, [False] * world
    while not all(ended):
        for r in range(world):
            if ended[r]:
                continue
            if r == 0 and change is not None and change[0] <= at[0]:
                with srv._cond:  # as BatchServer.set_weights calls it
                    assert srv.feed.plan.asked < change[2], "the lanes began the change's step"
                    assert srv.feed.set_weights(change[1], change[2], wait=False) == change[2]
                change = None
            if r == 0 and kills and min(kills) <= at[0]:
                _kill(srv.feed.lanes[kills.pop(min(kills))].handle)
            reply = srv.get(r, world, at[r], 30.0, count=3)
            if reply.status == "end":
                ended[r] = True
                continue
            assert reply.ready, reply
            for run in resolved(srv, reply, r, world).runs:
                for part in split_run(from_ipc(run)):
                    out[(r, at[r])] = to_ipc(own(part.replace_schema_metadata(None)))
                    at[r] += 1
    assert not kills, f"the data ended before the kills at steps {sorted(kills)}"
    return [out[key] for key in sorted(out)], srv.state(at[0])


@pytest.mark.slow
def test_a_lane_killed_under_a_service_starts_again_and_the_ranks_get_the_same_rows(
    small, ray_cluster
):
    """A lane's process killed mid-run (as when its node is lost) is started again from its
    state at the oldest step it holds, makes the same steps again, and the ranks wait for
    them: two ranks (one per lane) get the same rows, byte for byte, as a run nothing killed,
    to the end of the data, and the same final state. The metrics name each restart.

    Lane 1 dies right after a weight change for step 300 was sent: the new actor is sent it
    again after the same steps as the dead one was (a lane's state holds the changes
    scheduled ahead of it, so its states differ otherwise, and the lane refuses to serve
    them). Lane 0 dies at step 200, its state holding that change already."""
    from service.batch_server import BatchServer

    cfg = config({n: s | {"repeat": 40} for n, s in small.items()}, 2).model_dump(mode="json")
    change = (2, {"code": 0.2, "prose": 0.8}, 300)
    alone = BatchServer(cfg, prefetch=3)
    try:
        rows_alone, state_alone = _serve_to_the_end(alone, 2, {}, change)
    finally:
        alone.close()
    srv = BatchServer(cfg, prefetch=3)
    try:
        rows, state = _serve_to_the_end(srv, 2, {2: 1, 200: 0}, change)
        restarted = srv.metrics()["lanes_restarted"]
        lanes_view = srv.metrics()["lanes"]
    finally:
        srv.close()
    assert len(rows) == len(rows_alone) > 2 * 350
    assert rows == rows_alone
    assert state == state_alone
    assert [(r["lane"], r["restart"]) for r in restarted] == [(1, 1), (0, 1)]
    assert restarted[0]["step"] <= 2 < restarted[1]["step"] <= 200
    assert [v["restarts"] for v in lanes_view] == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize(("lanes", "fmt"), [(2, "parquet"), (4, "parquet"), (2, "arrow")])
def test_laned_exports_write_their_files_in_the_lanes(small, streams, ray_cluster, tmp_path,
                                                      monkeypatch, lanes, fmt):  # fmt: skip
    """An export on lane actors: each lane writes the files of the ranks whose rows it holds,
    the export's process only joins and writes what spans lanes (a world smaller than K, the
    short last step). Every file and state equals the export made in one process, byte for
    byte, for worlds smaller than K, K and larger, to the end of the data and with a step limit the lanes
    ran past; nothing a lane wrote ahead is left behind. Arrow files too, whose bytes are the
    buffers' (a slice's padding would carry the rows after it: wire/arrays.py `own`)."""
    from pipeline.lanes import PENDING

    joined: list[int] = []
    join = LanedFeed.joined  # what the export joins itself
    monkeypatch.setattr(LanedFeed, "joined",
                        lambda f, s, *a: joined.append(s.step) or join(f, s, *a))  # fmt: skip
    for corpus, steps, tag in ((small, None, "small"), (streams, 5, "chat")):
        cfg = config(corpus, lanes)
        # Each case once across the three runs: a world smaller than K (ranks span lanes), K,
        # larger than K; Arrow (whose bytes are the buffers') once spanning and once not. Four
        # lanes take the two cases whose joins differ with K (a world smaller and larger);
        # world == K is two lanes' (each laned export starts K lane processes: ~2.5 CPU-s each).
        worlds = {(2, "parquet"): (1, 2, 4, 8), (4, "parquet"): (2, 8), (2, "arrow"): (1, 4)}
        for world in worlds[(lanes, fmt)]:
            local, actors = tmp_path / f"{tag}-{world}-local", tmp_path / f"{tag}-{world}-actors"
            run_export(cfg, local, steps=steps, world_size=world, state_every=2, fmt=fmt,
                       executor=iter_blocks_local)  # fmt: skip
            joined.clear()
            s = run_export(cfg, actors, steps=steps, world_size=world, state_every=2, fmt=fmt)
            names = sorted(p.name for p in local.iterdir() if p.name != "summary.json")
            assert names == sorted(p.name for p in actors.iterdir() if p.name != "summary.json")
            assert not list(actors.glob(f"*{PENDING}"))
            for name in names:
                assert (local / name).read_bytes() == (actors / name).read_bytes(), (
                    tag,
                    world,
                    name,
                )
            n = s.export.steps_written
            # The export joins every step when ranks span lanes, else only the short last one.
            spans = world < lanes
            last_short = steps is None
            assert len(joined) == (n if spans else int(last_short)), (tag, world, joined)


def test_a_chunks_held_counts_and_a_resumes_served_figures_sum_over_the_lanes(streams):
    """The control's sums of the lanes' answers, without Ray: a chunk's counts stop where the
    shortest lane's answer stops; what a resume starts from adds the lanes' states."""
    import numpy as np

    from pipeline.lanes.feed import global_mixer, held_counts, served_before
    from pipeline.lanes.steps import LaneMade

    def made(rows: list[int], states: list) -> LaneMade:
        n = len(rows)
        return LaneMade(0, np.array(rows), np.array(rows) * 100, np.ones((n, 2), dtype=np.int64),
                        np.full((n, 2), 3), states)  # fmt: skip

    counted, rows, counts = held_counts([made([4, 4, 2], ["a", "b", "c"]), made([4, 3], [1, 2])])
    assert [c.states for c in counted] == [[], []]  # the producer keeps the states
    assert rows == [[4, 4], [4, 3]]  # per step, each lane's rows, as far as both made steps
    assert counts[0].tolist() == [8, 7] and counts[1].tolist() == [800, 700]
    assert counts[2].tolist() == [[2, 2], [2, 2]] and counts[3].tolist() == [[6, 6], [6, 6]]

    names = ["code", "chat"]
    assert served_before([None, None], names)[:2] == (0, 0)
    part = {"feed": {"rows": 5, "real_tokens": 600, "docs_emitted": {"code": 2, "chat": 1}},
            "packer": {"mixer": {"placed": {"code": 400, "chat": 200}}}}  # fmt: skip
    rows_, real, tokens, docs = served_before([part, part], names)
    assert (rows_, real, tokens.tolist(), docs.tolist()) == (10, 1200, [800, 400], [4, 2])

    cfg = config(streams, 2, schedule=[{"step": 5, "weights": {"code": 0.5, "chat": 0.5}}])
    fresh = global_mixer(cfg, 0, None, changed=False)
    assert fresh.scheduled_weights(4).tolist() == [0.7, 0.3]
    assert fresh.scheduled_weights(5).tolist() == [0.5, 0.5]  # the schedule's change
    fresh.schedule(9, {"code": 1.0, "chat": 0.0}, source="api")
    resumed = global_mixer(cfg, 12, {"packer": {"mixer": fresh.get_state()}}, changed=True)
    assert resumed.scheduled_weights(10).tolist() == [1.0, 0.0]  # the changes made so far
    assert resumed.scheduled_weights(12).tolist() == [0.7, 0.3]  # a changed config's, from 12


def test_a_lane_group_answers_shows_and_names_a_failed_lane_without_ray(streams):
    """The lanes as the control holds them (lanes/group.py), in this process: each answers,
    each is shown with its process, and one that fails otherwise than by its process dying is
    not started again but fails by name (what the feed raises)."""
    import os
    import threading

    from pipeline.lanes.group import LaneGroup

    cfg = config(streams, 2)
    cfg_json = cfg.model_dump(mode="json", context={"reveal_secrets": True})
    args = [(cfg_json, k, None, False, True, True, False) for k in range(2)]
    asked: list = []
    group = LaneGroup(cfg, args, local=True, hold=False, restarts=3, state_every=1,
                      lock=threading.RLock(), in_flight=lambda: asked.append(1) or ([], 0, []))  # fmt: skip
    try:
        assert len(group) == 2 and group.handles == [None, None]
        assert group.restarts.limit == 0  # restarts are for holding lanes (actors) only
        states = [group.ask(k, "state") for k in range(2)]
        assert [s.unpack()["feed"]["rows"] for s in states] == [0, 0]
        view = group.view()
        assert [v["lane"] for v in view] == [0, 1]
        assert {v["pid"] for v in view} == {os.getpid()} and {v["restarts"] for v in view} == {0}
        assert len(group.summaries()) == 2

        error = ValueError("a record the lane could not read")
        assert group.restart(1, group.lanes[1], error) is False  # not a death: no restart
        assert asked == []  # nothing in flight was asked again
        failure = str(group.failure(1, error))
        assert failure == "lane 1 of 2 failed: a record the lane could not read"
    finally:
        group.close()
    assert group.closed
