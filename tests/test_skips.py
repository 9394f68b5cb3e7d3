"""Leaving documents out at a resume (issue 27: `--skip-steps`, `--skip-docs`).

The rule (pipeline/feed.py `LeaveOut`): the documents named are dropped where they leave the
shuffle, in every epoch; every other document enters the packer in the order it would have;
the state carries them, so a run resumed again leaves them out too."""

from __future__ import annotations

import json
import time

import pytest

from pipeline.feed import LeaveOut, StepFeed
from pipeline.inspect.provenance import documents_of, segments, stream_files
from pipeline.read.reading import iter_blocks_local
from pipeline.state.resume import StateError, check_state, seal
from tests.conformance import batch_bytes
from tests.helpers import take
from tests.rayhead import patient
from tests.test_export import config


def _run(cfg, state=None, leave_out=None, state_every=0):
    """Every step to the end: [(batch, state after it or None)], and the feed's summary."""
    feed = StepFeed(cfg, iter_blocks_local, state=state, leave_out=leave_out)
    try:
        made = []
        while True:
            batch = feed.steps(1, state_every)
            if not batch:
                return made, feed.summary()
            made += batch
    finally:
        feed.close()


def _docs(cfg, made, first_step=0) -> list[tuple[str, int]]:
    files = stream_files(cfg)
    segs = []
    for k, (batch, _) in enumerate(made):
        segs += segments(batch, first_step + k, files)
    return [(d["stream"], d["doc_id"]) for d in documents_of(segs)]


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_left_out_documents_never_come_and_every_other_one_does(corpus, mode):
    cfg = config(corpus, mode)
    whole, _ = _run(cfg)
    every = set(_docs(cfg, whole))
    named = set(_docs(cfg, whole[3:5], 3))  # what steps 3-4 drew
    assert 0 < len(named) < len(every)
    out = LeaveOut({"code": frozenset(d for _, d in named)}, "a test")
    made, summary = _run(cfg, leave_out=out)
    got = _docs(cfg, made)
    assert len(got) == len(set(got))
    assert set(got) == every - named, "nothing left out comes, nothing else is lost"
    met = summary.left_out["streams"]["code"]
    assert met["named"] == len(named) and len(met["met"]) == len(named)
    assert {(m["source"], m["record"]) for m in met["met"]} == {
        (stream_files(cfg)["code"][d >> 32], d & 0xFFFFFFFF) for _, d in named
    }
    assert summary.left_out["log"] == [{"step": 0, "docs": {"code": len(named)}, "why": "a test"}]


@pytest.mark.parametrize("mode", ["concat", "bfd"])
def test_a_resume_leaving_out_what_later_steps_drew_loses_nothing_else(corpus, mode):
    """Resumed at step 4 leaving out the documents of steps 4-6 (some held by the packer at
    the state: their rest is dropped at the replay); resumed again from its own state, the
    run goes on byte for byte, still leaving them out."""
    cfg = config(corpus, mode)
    whole, _ = _run(cfg, state_every=1)
    state4 = whole[3][1]
    assert state4 is not None and state4["step"] == 4
    named = set(_docs(cfg, whole[4:7], 4))
    out = LeaveOut({"code": frozenset(d for _, d in named)}, "--skip-steps 4-6")
    made, summary = _run(cfg, state=state4, leave_out=out, state_every=1)
    after = _docs(cfg, made, 4)
    assert not set(after) & named
    before = set(_docs(cfg, whole[:4]))
    assert named & before, "a document the packer holds at the state is left out too"
    assert before | set(after) | named == set(_docs(cfg, whole))
    log = summary.left_out["log"]
    assert log == [{"step": 4, "docs": {"code": len(named)}, "why": "--skip-steps 4-6"}]
    # The state carries what is left out: resumed from step 7 of the skipping run, the rest
    # is the same bytes, with no `leave_out` given again.
    state7 = made[2][1]
    assert state7 is not None and state7["step"] == 7
    assert state7["packer"]["skips"]["docs"]["code"] == sorted(d for _, d in named)
    again, _ = _run(cfg, state=state7)
    assert [batch_bytes(b) for b, _ in again] == [batch_bytes(b) for b, _ in made[3:]]


def test_a_state_with_a_malformed_skip_list_is_refused(corpus):
    cfg = config(corpus, "bfd")
    feed = StepFeed(cfg, iter_blocks_local, leave_out=LeaveOut({"code": frozenset({5, 1})}, "t"))
    try:
        feed.next_step()
        state = feed.get_state()
    finally:
        feed.close()
    assert state["packer"]["skips"]["docs"] == {"code": [1, 5]}
    check_state(state, cfg.config_hash(), ["code"], False)
    for key, bad in (("docs", {"code": [5, 1]}), ("met", {"code": [7]}), ("docs", {"other": [1]})):
        broken = json.loads(json.dumps(state))
        broken["packer"]["skips"][key] = bad
        broken.pop("digest")
        with pytest.raises(StateError, match=f"packer.skips.{key}"):
            check_state(seal(broken), cfg.config_hash(), ["code"], False)


def test_documents_to_leave_out_must_name_the_configs_streams(corpus):
    cfg = config(corpus, "bfd")
    with pytest.raises(ValueError, match=r"streams \['prose'\], not in the config"):
        StepFeed(cfg, iter_blocks_local, leave_out=LeaveOut({"prose": frozenset({1})}, "t"))


def test_export_resumed_with_skip_steps_and_skip_docs(corpus, tmp_path):
    """The CLI: `export --resume state --skip-steps` reads the steps' documents from the
    export's directory; `--skip-docs` takes `trace --json` output; summary.json lists them."""
    from pipeline.read.resolve import load_config
    from service.cli import main

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(json.dumps({
        "seed": 7, "seq_len": 256, "global_batch_size": 4,
        "packing": {"mode": "bfd", "buffer": 32}, "shuffle": {"window": 8},
        "read": {"block_bytes": 40_000, "first_block_bytes": 10_000},
        "streams": {"code": {"paths": [str(corpus / "*.jsonl")]}},
    }))  # fmt: skip
    cfg = load_config(str(cfg_path))
    out = tmp_path / "out"
    args = ["export", "--config", str(cfg_path), "--local", "--out", str(out)]
    assert main([*args, "--steps", "8", "--state-every", "4"]) == 0
    named = {d["doc_id"] for d in documents_of(
        s for k in (4, 5) for s in segments(_step(out, k), k, stream_files(cfg)))}  # fmt: skip
    resume = ["--resume", str(out / "state-00000004.json")]
    assert main([*args, *resume, "--skip-steps", "4-5"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    left = summary["left_out"]
    assert left["log"][0]["why"] == "--skip-steps 4-5" and left["log"][0]["step"] == 4
    assert left["streams"]["code"]["named"] == len(named)
    later = {d["doc_id"] for k in range(4, summary["steps"])
             for d in documents_of(segments(_step(out, k), k, stream_files(cfg)))}  # fmt: skip
    assert not later & named
    # --skip-docs: a file of `trace --json` segments (here, one document's)
    pick = tmp_path / "docs.json"
    one = sorted(later)[0]
    pick.write_text(json.dumps([{"stream": "code", "doc_id": one, "extra": "ignored"}]))
    out2 = tmp_path / "out2"
    args2 = ["export", "--config", str(cfg_path), "--local", "--out", str(out2)]
    assert main([*args2, "--skip-docs", str(pick)]) == 0
    steps2 = json.loads((out2 / "summary.json").read_text())["steps"]
    got = {d["doc_id"] for k in range(steps2)
           for d in documents_of(segments(_step(out2, k), k, stream_files(cfg)))}  # fmt: skip
    assert one not in got
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"stream": "code", "doc_id": 1}\n{"stream": "nope", "doc_id": 2}\n')
    assert main([*args2, "--skip-docs", str(bad)]) != 0


def _step(out, k):
    from pipeline.inspect.provenance import export_step

    return export_step(out, k)[0]


def test_lanes_leave_out_the_same_documents(tmp_path):
    """With lanes, every lane is told the documents to leave out and meets its own: none of
    them comes, and the laned state carries them (a run resumed from it is the same bytes).
    (Lanes end together, when the first runs dry, so the tail differs from a run without
    them: not every other document need come.)"""
    from pipeline.lanes import LanedFeed
    from pipeline.read.resolve import parse_config
    from tests.conftest import stdlib_texts, write_jsonl

    texts = stdlib_texts(40, max_bytes=5000)
    for k in range(2):
        write_jsonl(tmp_path / f"c{k}.jsonl", texts[k * 20 : (k + 1) * 20])
    cfg = parse_config({"seq_len": 128, "global_batch_size": 4, "lanes": 2,
                        "shuffle": {"piece_bytes": 8 << 10}, "read": {"first_block_bytes": 8 << 10},
                        "streams": {"code": {"paths": [str(tmp_path / "c*.jsonl")]}}})  # fmt: skip
    files = stream_files(cfg)

    def run(**kw) -> list:
        feed = LanedFeed(cfg, local=True, state_every=1, **kw)
        try:
            return feed.steps(10_000, 1)
        finally:
            feed.close()

    def docs(made, first=0) -> set[int]:
        return {s["doc_id"] for k, (b, _) in enumerate(made) for s in segments(b, first + k, files)}

    every = docs(run())
    named = frozenset(sorted(every)[::5])
    made = run(leave_out=LeaveOut({"code": named}, "t"))
    assert not docs(made) & named and docs(made) <= every
    again = run(state=made[4][1])  # the state after step 5 carries what is left out
    assert [batch_bytes(b) for b, _ in again] == [batch_bytes(b) for b, _ in made[5:]]


@pytest.mark.slow
def test_a_service_resumed_leaving_documents_out_serves_none_of_them(corpus, ray_cluster):
    """`serve --resume STATE --skip-steps`: the batch server starts from the state with the
    documents left out; no step it serves holds one, its provenance (recomputed from a kept
    state too) agrees, and /v1/metrics says what was left out and why."""
    from service.batch_server import BatchServer

    cfg = config(corpus, "bfd")
    whole, _ = _run(cfg, state_every=1)
    named = {d for _, d in _docs(cfg, whole[4:7], 4)}
    out = LeaveOut({"code": frozenset(named)}, "--skip-steps 4-6")
    srv = BatchServer(cfg.model_dump(mode="json"), state=whole[3][1], prefetch=3, leave_out=out)
    try:
        served = set()
        for step in range(4, 12):
            take(srv, 0, 1, step)
            served |= {s["doc_id"] for s in srv.provenance(step, 1)}
        assert served and not served & named
        assert {s["doc_id"] for s in srv.provenance(5, 1)} <= served  # from a kept state
        left = srv.metrics()["left_out"]
        assert left["log"][0]["why"] == "--skip-steps 4-6"
        assert left["streams"]["code"]["named"] == len(named)
    finally:
        srv.close()


def _laned(cfg, state=None, leave_out=None, state_every=0):
    """`_run` for a config with lanes: the lanes in this process."""
    from pipeline.lanes import LanedFeed

    feed = LanedFeed(cfg, local=True, state=state, leave_out=leave_out, state_every=state_every)
    try:
        return feed.steps(10_000, state_every), None
    finally:
        feed.close()


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_running_service_leaves_documents_out_through_the_api(
    corpus, ray_cluster, monkeypatch, lanes
):
    """POST /v1/skips: from the first step not made, the service makes exactly what a resume
    from that step's state with the documents left out makes; the steps made before are
    unchanged, the rank connected all along goes on (no restart), the log says who asked."""
    from fastapi.testclient import TestClient

    from service.api import Backend, create_app
    from service.batch_server import BatchServer
    from wire.arrays import from_ipc
    from wire.layout import expand

    monkeypatch.setenv("TOKENMILL_API_TOKEN", "t0ken")
    cfg = config(corpus, "bfd", lanes=lanes)
    run = _run if lanes == 1 else _laned
    whole, _ = run(cfg, state_every=1)
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    try:
        got = [take(srv, 0, 1, s) for s in range(4)]
        client = TestClient(create_app(Backend(srv)))
        body = {"steps": "1-2", "docs": [{"stream": "code", "doc_id": -1 + (1 << 32)}],
                "why": "loss spike"}  # fmt: skip
        assert client.post("/v1/skips", json=body).status_code == 401
        r = client.post("/v1/skips", json=body, headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 200, r.text
        answer = r.json()
        at = answer["effective_step"]
        assert (
            4 <= at <= 4 + 3
            and answer["why"] == "POST /v1/skips: steps 1-2, 1 named document(s) (loss spike)"
        )
        named = {d for _, d in _docs(cfg, whole[1:3], 1)} | {(1 << 32) - 1}
        assert answer["left_out"] == {"code": len(named)}
        got += [take(srv, 0, 1, s) for s in range(4, 12)]
        bad = client.post("/v1/skips", json={"docs": [{"stream": "web", "doc_id": 1}]},
                          headers={"Authorization": "Bearer t0ken"})  # fmt: skip
        assert bad.status_code == 400 and "stream" in bad.json()["detail"]
        left = srv.metrics()["left_out"]
    finally:
        srv.close()

    def data(batch):  # the rows, whatever the layout and the metadata
        return batch_bytes(expand(batch).replace_schema_metadata(None))

    served = [data(from_ipc(r.runs[0])) for r in got]
    # Before the effective step: the steps as made; from it: a resume from there, leaving out.
    lone, _ = run(cfg, state=whole[at - 1][1], leave_out=LeaveOut({"code": frozenset(named)}, "t"))
    assert served[:at] == [data(b) for b, _ in whole[:at]]
    assert served[at:12] == [data(b) for b, _ in lone[: 12 - at]]
    assert not {d for _, d in _docs(cfg, lone[: 12 - at], at)} & named
    assert left["log"] == [{"step": at, "docs": {"code": len(named)}, "why": answer["why"]}]


@pytest.mark.slow
def test_a_live_skip_while_four_ranks_pull_and_the_api_reads(corpus, ray_cluster):
    """Four ranks (threads) pull their rows while the API reads metrics and mixtures and a
    skip comes in: no rank is told its sequence changed, and the global rows are the original
    run's before the effective step and a lone resume's (leaving the documents out) from it."""
    import threading

    from service.batch_server import BatchServer
    from wire.arrays import from_ipc
    from wire.layout import expand

    cfg = config(corpus, "bfd")
    whole, _ = _run(cfg, state_every=1)
    named = {d for _, d in _docs(cfg, whole[1:3], 1)}
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    got: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []
    done = threading.Event()
    steps = min(14, len(whole))

    def rank(r: int) -> None:
        try:
            srv.hello(r, 4)
            for step in range(steps):
                got[(r, step)] = expand(from_ipc(take(srv, r, 4, step).runs[0])).to_pylist()
                time.sleep(0.02)
        except BaseException as e:  # raised in the test's thread
            errors.append(e)

    def api() -> None:
        while not done.is_set():
            srv.metrics(), srv.mixture(), srv.status()
            time.sleep(0.01)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    watcher = threading.Thread(target=api)
    try:
        for t in (*threads, watcher):
            t.start()
        deadline = time.time() + patient(60)
        while srv.status()["global_step"] < 4:
            assert time.time() < deadline
            time.sleep(0.05)
        at = srv.skip(steps=[1, 2], why="together")["step"]
        for t in threads:
            t.join(timeout=patient(120))
        done.set()
        watcher.join(timeout=30)
        assert not errors, errors
    finally:
        srv.close()
    lone, _ = _run(cfg, state=whole[at - 1][1], leave_out=LeaveOut({"code": frozenset(named)}, "t"))
    want = [expand(b).to_pylist() for b, _ in whole[:at]] + [expand(b).to_pylist() for b, _ in lone]
    for step in range(steps):
        assert [row for r in range(4) for row in got[(r, step)]] == want[step], step
