"""The compact export layout expands to exactly the served batch; the headline figures hold
together (issue 15: honest figures from process start)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from service.export import run_export
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient
from tests.test_pretokenized import SEQ, _corpus
from wire.layout import compact, expand, read_step


def _config(src, chat: bool, mode: str = "bfd"):
    streams = {"code": {"paths": [str(src / "code.jsonl")], "weight": 0.6}}
    if chat:
        streams["chat"] = {"kind": "chat", "paths": [str(src / "chat.jsonl")], "weight": 0.4}
    return parse_config(
        {"seq_len": SEQ, "global_batch_size": 4, "packing": {"mode": mode}, "streams": streams}
    )


@pytest.mark.parametrize("chat", [False, True], ids=["pretrain", "chat"])
@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_compact_export_expands_to_the_full_export(tmp_path, chat, fmt):
    cfg = _config(_corpus(tmp_path), chat)
    full = run_export(
        cfg, tmp_path / "full", executor=iter_blocks_local, layout="full", fmt=fmt, world_size=2
    )
    small = run_export(cfg, tmp_path / "small", executor=iter_blocks_local, fmt=fmt, world_size=2)
    assert small.export.layout == "compact" and full.export.layout == "full"
    files = sorted(p.name for p in (tmp_path / "full").glob("step-*"))
    assert files and files == sorted(p.name for p in (tmp_path / "small").glob("step-*"))
    for name in files:
        want = read_step(tmp_path / "full" / name)
        got = read_step(tmp_path / "small" / name)
        assert got.equals(want, check_metadata=True), name
        names = pq.read_schema(tmp_path / "small" / name).names if fmt == "parquet" else None
        if names is not None:
            assert "position_ids" not in names and "segment_ids" not in names
            assert ("labels" in names) == chat  # pretrain labels are derived, chat's are kept
    assert (tmp_path / "small" / files[0]).stat().st_size < (
        tmp_path / "full" / files[0]
    ).stat().st_size


def test_compact_keeps_labels_that_are_not_the_derived_ones(tmp_path):
    cfg = _config(_corpus(tmp_path), chat=True)
    run_export(cfg, tmp_path / "full", executor=iter_blocks_local, layout="full")
    masked = [
        b
        for p in sorted((tmp_path / "full").glob("step-*"))
        for b in [read_step(p)]
        if "chat" in b.column("stream").flatten().dictionary.to_pylist()
    ]
    assert masked
    for batch in masked:  # a writer that guessed "no masking" still keeps chat's labels
        small = compact(batch, keep_labels=False)
        assert expand(small).equals(batch, check_metadata=True)
        part = batch.slice(1, 2)  # a rank's rows: a slice with an offset
        assert expand(compact(part, keep_labels=False)).equals(part, check_metadata=True)


def test_export_figures_count_from_process_start_and_hold_together(tmp_path):
    cfg = _config(_corpus(tmp_path), chat=False, mode="concat")
    s = run_export(cfg, tmp_path / "o", executor=iter_blocks_local)
    on_disk = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert 0 < on_disk["startup_s"] <= on_disk["time_to_first_step_s"] <= on_disk["wall_s"]
    assert on_disk["time_to_first_block_s"] <= on_disk["time_to_first_step_s"]
    assert on_disk["wall_s"] <= s.export.wall_s
    assert on_disk["tokens_per_s"] == pytest.approx(
        s.real_tokens / (on_disk["startup_s"] + on_disk["elapsed_s"]), rel=1e-6
    )
    # The steady window is inside the run, so its rate can only be the higher one.
    assert on_disk["steady_tokens_per_s"] >= on_disk["tokens_per_s"] > 0
    g = on_disk["tokenizer_guarantees"]  # what was proven about the fast backend, reported
    assert g["proven"] and g["merges_ordered"] and g["pretokenizer"] == "sampled"


def test_an_unknown_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="layout 'tiny'"):
        run_export(
            _config(_corpus(tmp_path), False),
            tmp_path / "o",
            executor=iter_blocks_local,
            layout="tiny",
        )


def test_full_layout_schema_is_the_batch_schema(tmp_path):
    from wire.schema import batch_schema

    cfg = _config(_corpus(tmp_path), chat=True)
    run_export(cfg, tmp_path / "o", executor=iter_blocks_local, layout="full", steps=1)
    t = pq.read_table(next((tmp_path / "o").glob("step-*")))
    assert t.schema.remove_metadata().equals(batch_schema(SEQ))
    assert isinstance(t, pa.Table)


def _small_units(tmp_path):
    """(config, units, stream, blocks made in-process) of the corpus cut into small units."""
    from pipeline.feed import StepFeed

    cfg = parse_config(
        {
            "seq_len": SEQ,
            "read": {"first_block_bytes": 2048, "block_bytes": 4096},
            "streams": {"code": {"paths": [str(_corpus(tmp_path) / "code.jsonl")]}},
        }
    )
    units = StepFeed(cfg, executor=iter_blocks_local).streams[0].units(0)
    stream = cfg.streams["code"]
    return cfg, units, stream, list(iter_blocks_local(units, stream, cfg.tokenizer))


@pytest.mark.parametrize("executor_delay", [0.0, 0.3])
def test_a_head_start_gives_the_same_blocks_each_unit_made_once(tmp_path, executor_delay):
    """This process and the executor split the units by claims: every unit is tokenized
    once (but for back units this process took over from a slow executor), and the blocks
    come out in unit order, equal to one executor's, whichever side is faster."""
    import time

    from pipeline.read.headstart import BACK_UNITS, HeadStart
    from pipeline.read.reading import iter_blocks_local

    cfg, units, stream, plain = _small_units(tmp_path)
    made: dict[str, list[int]] = {"local": [], "executor": []}
    # After its first unit, the local side makes the next only once the executor has begun:
    # on a loaded machine the local thread could otherwise claim every unit before the
    # executor's thread first ran (a fresh-clone CI failed "both took part" so).
    executor_began = threading.Event()

    def side(name, delay):
        def run(us, st, tok):
            if name == "executor":
                executor_began.set()
            elif made["local"]:
                executor_began.wait(60)
            made[name] += [u.index for u in us]
            for block in iter_blocks_local(us, st, tok):
                time.sleep(delay)  # a slow start, as Ray's workers have
                yield block

        run.startup_s = 0.0  # type: ignore[attr-defined]  # always worth starting
        return run

    head = HeadStart(units, stream, cfg.tokenizer, side("executor", executor_delay), None,
                     side("local", 0.0))  # fmt: skip
    got = list(head)
    head.close()
    assert len(units) >= 8
    twice = set(made["local"]) & set(made["executor"])
    assert sorted(set(made["local"]) | set(made["executor"])) == [u.index for u in units]
    assert len(made["local"]) == len(set(made["local"]))  # no side makes a unit twice
    assert twice <= {u.index for u in units[-BACK_UNITS:]}  # only back units are taken over
    assert made["local"][:1] == [0] and made["executor"]  # both took part
    assert [b.num_rows for b in got] == [b.num_rows for b in plain]
    assert all(a.equals(b) for a, b in zip(got, plain, strict=True))


def test_a_head_start_takes_over_what_a_starting_executor_has_not_delivered(tmp_path):
    """Ray is up but its workers deliver nothing (still starting, cold): once nothing is left
    to claim, this process makes the executor's back units too, and the export ends without
    waiting for them (a cold 130 MB export waited 5 s for two such units)."""
    import threading
    import time
    from concurrent.futures import Future

    from pipeline.read.headstart import HeadStart
    from pipeline.read.reading import iter_blocks_local

    cfg, units, stream, plain = _small_units(tmp_path)
    closed = threading.Event()

    class Starting:  # an execution whose workers never come up before it is closed
        startup_s = 0.0  # but says it delivers at once, so it is started

        def __init__(self, us, st, tok):
            pass

        def __iter__(self):
            return self

        def __next__(self):
            closed.wait(60)
            raise StopIteration

        def close(self):
            closed.set()

    up: Future = Future()
    up.set_result(None)
    t0 = time.monotonic()
    head = HeadStart(units, stream, cfg.tokenizer, Starting, up, iter_blocks_local)
    got = list(head)
    waited = time.monotonic() - t0
    head.close()
    assert waited < 30, f"the blocks waited {waited:.1f}s for the executor"
    assert all(a.equals(b) for a, b in zip(got, plain, strict=True)) and len(got) == len(plain)
    assert head.tokens["executor"] == 0 < head.tokens["here"]


@pytest.mark.parametrize("startup_s", [0.0, 3600.0])
def test_an_executor_starts_only_if_it_would_deliver_before_the_local_thread_is_done(
    tmp_path, startup_s
):
    """Ray up, the local thread already under way: an executor whose first block would come
    after the local thread has made everything left (`startup_s`) is never started; one that
    delivers at once is. The blocks are the same either way."""
    import threading
    from concurrent.futures import Future

    from pipeline.read.headstart import HeadStart
    from pipeline.read.reading import iter_blocks_local

    cfg, units, stream, plain = _small_units(tmp_path)
    started: list[int] = []

    called = threading.Event()

    def executor(us, st, tok):
        started.extend(u.index for u in us)
        called.set()
        return iter_blocks_local(us, st, tok)

    executor.startup_s = startup_s  # type: ignore[attr-defined]
    up: Future = Future()
    local_done_one = threading.Event()

    def local(us, st, tok):  # Ray comes up once the local thread has a pace
        if local_done_one.is_set():
            # Its second unit waits for the executor's decision: unheld, on a busy machine the
            # thread made every unit before the executor looked (and then rightly stayed off).
            # An executor that should not start has had 1 s (twice its recheck) to do it wrongly.
            called.wait(60 if startup_s == 0.0 else 1)
        yield from iter_blocks_local(us, st, tok)
        local_done_one.set()

    head = HeadStart(units, stream, cfg.tokenizer, executor, up, local)
    local_done_one.wait(30)
    up.set_result(None)
    got = list(head)
    head.close()
    assert all(a.equals(b) for a, b in zip(got, plain, strict=True)) and len(got) == len(plain)
    assert bool(started) == (startup_s == 0.0), started


@pytest.mark.parametrize("slow", ["consumer", "local"])
def test_an_executor_starts_only_once_the_consumer_waits_on_the_local_thread(tmp_path, slow):
    """A service's head start (`paced`), Ray up and an executor worth starting: while the
    consumer takes blocks slower than the local thread makes them (ranks that want fewer
    tokens than one thread makes), the executor is not started, so its start takes no CPU
    from the steps; once the consumer waits on the local thread, it is. The same blocks."""
    import threading
    import time
    from concurrent.futures import Future

    from pipeline.read.headstart import HeadStart
    from pipeline.read.reading import iter_blocks_local

    cfg, units, stream, plain = _small_units(tmp_path)
    started: list[int] = []
    made = [0]  # blocks the local thread has made
    progress = threading.Condition()

    def executor(us, st, tok):
        with progress:
            started.extend(u.index for u in us)
            progress.notify_all()
        return iter_blocks_local(us, st, tok)

    executor.startup_s = 0.0  # type: ignore[attr-defined]  # always worth starting

    def local(us, st, tok):
        for block in iter_blocks_local(us, st, tok):
            time.sleep(0.05 if slow == "local" else 0.0)
            with progress:
                made[0] += 1
                progress.notify_all()
            yield block

    up: Future = Future()
    up.set_result(None)
    head = HeadStart(units, stream, cfg.tokenizer, executor, up, local, paced=True,
                     behind_s=0.2)  # fmt: skip
    got = []
    for block in head:
        got.append(block)
        if slow == "consumer":  # it asks for a block only once the thread has made it: it
            # never waits on the thread, however busy the machine (a fixed sleep here was
            # outrun by a thread slowed by a loaded machine)
            with progress:
                progress.wait_for(
                    lambda: made[0] > len(got) or len(got) == len(plain) or started, 60
                )
    head.close()
    assert all(a.equals(b) for a, b in zip(got, plain, strict=True)) and len(got) == len(plain)
    assert bool(started) == (slow == "local"), started


def test_the_consumer_is_behind_by_its_recent_waits_not_its_whole_run():
    """Ranks idle for an hour (the local thread far ahead), then faster than one thread: the
    executor is judged by the consumer's waits of the last seconds (`BEHIND_WINDOW_S`), so
    it starts within seconds of their speeding up, not once a quarter of the hour waited."""
    import collections
    import time

    from pipeline.read.headstart import BEHIND_S, BEHIND_WINDOW_S, HeadStart

    head = HeadStart([], None, None, None, None, None, paced=True)  # no unit: threads idle
    now = time.monotonic()
    head._first_emit_at = now - 3600
    head._waits = collections.deque([(now - 3000, 1.0)])  # long ago: forgotten
    assert not head._behind()
    head._waits.append((now - 0.1, BEHIND_WINDOW_S / 4 + BEHIND_S))  # just now
    assert head._behind()
    head.close()


def test_a_head_start_that_made_everything_does_not_wait_for_ray(tmp_path):
    """Fewer units than the executor takes: this process makes them all, and neither the
    blocks nor `close` wait for a Ray that is still starting (a small export used to end only
    once Ray was up, 5-10 s cold on 2 cores)."""
    import time
    from concurrent.futures import Future

    from pipeline.feed import StepFeed
    from pipeline.read.headstart import MIN_UNITS_FOR_EXECUTOR, HeadStart
    from pipeline.read.reading import iter_blocks_local

    cfg = parse_config(
        {"seq_len": SEQ, "streams": {"code": {"paths": [str(_corpus(tmp_path) / "code.jsonl")]}}}
    )
    units = StepFeed(cfg, executor=iter_blocks_local).streams[0].units(0)
    assert len(units) < MIN_UNITS_FOR_EXECUTOR
    stream = cfg.streams["code"]

    def executor(us, st, tok):
        raise AssertionError("the executor ran before Ray was up")

    never: Future = Future()  # Ray, still starting
    t0 = time.monotonic()
    head = HeadStart(units, stream, cfg.tokenizer, executor, never, iter_blocks_local)
    got = list(head)
    head.close()
    assert time.monotonic() - t0 < 5
    assert all(
        a.equals(b)
        for a, b in zip(got, iter_blocks_local(units, stream, cfg.tokenizer), strict=True)
    )
    assert head.tokens["executor"] == 0 and not any(t.is_alive() for t in head._threads)


def test_cli_export_exits_at_once_and_leaves_no_ray_process(tmp_path):
    """`tokenmill export` ends its process as soon as its files are written (service/cli.py
    `entry`); the embedded Ray's processes end with it."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    import yaml

    cfg = _config(_corpus(tmp_path), chat=False, mode="concat")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    temp = tempfile.mkdtemp(prefix="tm", dir="/tmp")  # this Ray's own temp root
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS")}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "service", "export", "--config", str(tmp_path / "c.yaml"),
             "--out", f"{tmp_path / 'o'}/"],
            env=env | {"RAY_TMPDIR": temp}, capture_output=True, text=True, timeout=patient(300),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        # Neither Ray's note on its connect thread's signals nor a doubled slash (issue 30).
        assert "SIGTERM handler" not in r.stdout + r.stderr, r.stderr[-3000:]
        assert f"wrote {tmp_path / 'o'}/ (" in r.stdout and "//" not in r.stdout, r.stdout
        assert json.loads((tmp_path / "o" / "summary.json").read_text())["steps_written"] > 0
        deadline = time.time() + patient(10)
        while (left := _processes_mentioning(temp)) and time.time() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _processes_mentioning(text: str) -> list[str]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:120]}")
    return found


def test_the_first_step_does_not_import_pandas(tmp_path):
    """pyarrow's `pa.array`/`to_numpy` import pandas on first use (0.35-0.5 s, 294 modules):
    the path to an export's first step builds its arrays from buffers instead
    (wire/arrays.py). Run in a fresh process, where nothing imported pandas yet."""
    import subprocess
    import sys

    write_jsonl(tmp_path / "d.jsonl", stdlib_texts(20, max_bytes=3000))
    code = f"""
import sys
from pathlib import Path
from pipeline.read.resolve import parse_config
from wire.layout import compact
from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from wire.layout import write_step as _write
cfg = parse_config({{"seq_len": 256, "global_batch_size": 4,
                    "streams": {{"s": {{"paths": ["{tmp_path / "d.jsonl"}"]}}}}}})
feed = StepFeed(cfg, iter_blocks_local)
feed.full_batches = False
_write(compact(feed.next_step(), False), Path("{tmp_path / "s.parquet"}"), "parquet")
assert "pandas" not in sys.modules, "pandas was imported on the way to the first step"
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def _reference_positions(rows: list[list[int]], L: int):
    """Positions, segment numbers and first-token flags, one token at a time."""
    pos, seg, first = [], [], []
    for docs in rows:
        for k, n in enumerate(docs, start=1):
            pos += range(n)
            seg += [k] * n
            first += [True] + [False] * (n - 1) if n else []
        pad = L - sum(docs)
        pos, seg, first = pos + [0] * pad, seg + [0] * pad, first + [False] * pad
    return pos, seg, first


def test_derived_positions_match_a_token_by_token_reference():
    """Rows with no documents, full rows, empty documents, sliced list arrays."""
    import random

    from wire.layout import _positions

    rng = random.Random(0)
    for _ in range(500):
        L = rng.choice([1, 2, 7, 64])
        rows = []
        for _ in range(rng.randint(1, 6)):
            docs, left = [], L
            while left and rng.random() < 0.8:
                docs.append(rng.randint(0 if rng.random() < 0.1 else 1, left))
                left -= docs[-1]
            rows.append(docs)
        lead = rng.randint(0, 2)  # a slice, as a rank's rows are
        col = pa.array([[1]] * lead + rows, type=pa.list_(pa.int32())).slice(lead)
        got = [a.tolist() for a in _positions(col, len(rows), L)]
        assert got == [list(x) for x in _reference_positions(rows, L)], (rows, L)


@pytest.mark.parametrize("decode_tokens", [1, 2 * SEQ, 1 << 16], ids=["step", "two", "all"])
def test_a_reply_run_decodes_to_each_step_of_the_rank(tmp_path, monkeypatch, decode_tokens):
    """What a rank gets in one answer (BatchServer.get: rank_runs, to_ipc) cuts back into its
    steps (trainer.feed.to_torch_steps) exactly as each step decodes alone: across a schema
    change, which starts a new run, and a short last step that leaves some ranks no row;
    decoded a step, two steps, or the whole run per pass."""
    import numpy as np

    import trainer.feed

    monkeypatch.setattr(trainer.feed, "DECODE_TOKENS", decode_tokens)

    from pipeline.feed import StepFeed, rank_runs, rank_slice
    from trainer.feed import to_torch_steps
    from wire.arrays import from_ipc, to_ipc
    from wire.layout import tensor_columns

    cfg = _config(_corpus(tmp_path), chat=False)
    feed = StepFeed(cfg, iter_blocks_local)
    feed.full_batches = False
    steps = [feed.next_step() for _ in range(6)]
    feed.close()
    steps[2] = expand(steps[2])  # another layout: its own run
    steps[5] = steps[5].slice(0, 2)  # a short last step: ranks 2 and 3 of 4 get no row
    G, W = cfg.global_batch_size, 4
    for rank in range(W):
        parts = [rank_slice(s, rank, W, G) for s in steps]  # each step alone
        runs = rank_runs(steps, rank, W, G)
        assert [n for _, n in runs] == [2, 1, 3]
        got = [step for run, _ in runs for step in to_torch_steps(from_ipc(to_ipc(run)))]
        assert [g["global_step"] for g in got] == list(range(6))
        for g, part in zip(got, parts, strict=True):
            assert g["seq_lens"] == part.column("seq_lens").to_pylist()
            for name, want in tensor_columns(part).items():
                assert np.array_equal(g[name].numpy(), want.reshape(part.num_rows, SEQ)), name
        assert got[5]["input_ids"].shape == ((1 if rank < 2 else 0), SEQ)


@pytest.mark.parametrize("full", [True, False], ids=["full", "compact"])
@pytest.mark.parametrize("chat", [False, True], ids=["pretrain", "chat"])
def test_steps_assembled_together_are_the_steps_made_one_by_one(tmp_path, chat, full):
    """`StepFeed.steps(n)` packs n steps and assembles their rows in one pass: each batch, its
    schema (compact: labels only on a step whose rows carry a loss mask), its metadata and
    its IPC bytes are those of `next_step` called n times, through the short last step; the
    states after each step are the same too."""
    from pipeline.feed import StepFeed
    from wire.arrays import to_ipc

    cfg = _config(_corpus(tmp_path), chat, mode="concat")
    raw = cfg.model_dump(mode="json") | {"global_batch_size": 3}
    if chat:  # a few chats: steps with a loss mask and steps without
        raw["streams"]["code"]["weight"], raw["streams"]["chat"]["weight"] = 0.95, 0.05
    cfg = parse_config(raw)
    alone, together = (StepFeed(cfg, executor=iter_blocks_local) for _ in range(2))
    alone.full_batches = together.full_batches = full
    want = []
    while (b := alone.next_step()) is not None:
        want.append((b, alone.get_state()))
    got = []
    while made := together.steps(3, state_every=1):
        got += made
    assert len(want) > 3 and len(got) == len(want)
    assert want[-1][0].num_rows < cfg.global_batch_size, "the short last step is covered"
    schemas = set()
    for (w, w_state), (g, g_state) in zip(want, got, strict=True):
        assert g.schema.equals(w.schema, check_metadata=True)
        assert g.equals(w) and to_ipc(g) == to_ipc(w)
        assert g_state == w_state
        schemas.add(tuple(g.schema.names))
    if chat and not full:
        assert len(schemas) == 2, "steps with and without a loss mask both occur"
