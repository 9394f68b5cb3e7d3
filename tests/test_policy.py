"""Mixing that follows the loss (`mixing.policy`, issue 27): the rule, its bounds, its timing,
and a service that follows synthetic loss reports, resumed mid-way byte for byte."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from pipeline.config import PolicyConfig
from pipeline.read.resolve import parse_config
from pipeline.stages.policy import LOSSES, decide, project, window_for, windows_after
from tests.conftest import stdlib_texts, write_jsonl
from tests.helpers import take
from tests.rayhead import patient

BASE = {"code": 0.7, "prose": 0.3}


def test_weight_moves_toward_the_stream_whose_loss_stays_high_within_its_bounds():
    policy = PolicyConfig(every=10, eta=0.2, bounds={"prose": (0.1, 0.6)})
    w = dict(BASE)
    shares = []
    for _ in range(30):  # prose's loss stays 1.0 above code's
        w = decide(policy, w, BASE, {"code": 2.0, "prose": 3.0})
        shares.append(w["prose"])
    assert all(b > a for a, b in zip(shares, shares[1:6], strict=False)), "it grows, step by step"
    assert shares[0] == pytest.approx(0.3 * np.e**0.2 / (0.7 + 0.3 * np.e**0.2))
    assert shares[-1] == pytest.approx(0.6) and max(shares) <= 0.6 + 1e-12
    back = decide(policy, w, BASE, {"code": 4.0, "prose": 1.0})  # the tables turn
    assert back["prose"] < w["prose"]
    # A reference loss: excess under it is none, so a stream at its reference gains nothing.
    ref = PolicyConfig(every=10, reference={"prose": 3.0, "code": 0.0})
    assert decide(ref, BASE, BASE, {"code": 0.0, "prose": 2.5}) == pytest.approx(BASE)
    # No labelled token of a stream in the window: its weight is kept.
    assert decide(policy, BASE, BASE, {"code": 9.0, "prose": None}) == pytest.approx(BASE)
    # Smoothing pulls toward the config's weights.
    smooth = PolicyConfig(every=10, smoothing=1.0)
    assert decide(smooth, {"code": 0.5, "prose": 0.5}, BASE, {"code": 1.0, "prose": 5.0}) == (
        pytest.approx(BASE)
    )


def test_projection_is_inside_the_bounds_and_sums_to_one():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(2, 6))
        lo = rng.uniform(0, 1 / n, n)
        hi = np.minimum(1, lo + rng.uniform(0, 1, n))
        if hi.sum() < 1:
            hi = np.minimum(1, hi * (1.05 / hi.sum()))
        if hi.sum() < 1:
            continue
        w = project(rng.dirichlet(np.ones(n)) * rng.uniform(0.5, 2), lo, hi)
        assert w.sum() == pytest.approx(1, abs=1e-12)
        assert (w >= lo - 1e-9).all() and (w <= hi + 1e-9).all()
    inside = np.array([0.2, 0.3, 0.5])
    assert project(inside, np.zeros(3), np.ones(3)) == pytest.approx(inside)


def test_a_state_carries_the_windows_of_every_decision_still_to_come():
    every, delay = 4, 3
    for step in range(60):
        need = {
            s for lo, hi in windows_after(step, every, delay) for s in range(lo, hi) if s < step
        }
        brute = set()
        for t in range(step, step + 100):
            window = window_for(t, every, delay)
            if window:
                brute |= {s for s in range(*window) if s < step}
        assert need == brute, step
    assert window_for(7, 4, 3) == (0, 4) and window_for(11, 4, 3) == (4, 8)
    assert window_for(3, 4, 3) is None and window_for(8, 4, 3) is None


def _config(tmp_path, **policy):
    code, prose = tmp_path / "code", tmp_path / "prose"
    code.mkdir(exist_ok=True)
    prose.mkdir(exist_ok=True)
    write_jsonl(code / "a.jsonl", stdlib_texts(40, max_bytes=6000))
    words = " ".join(f"word{i % 97} and more text {i}" for i in range(4000))
    write_jsonl(prose / "a.jsonl", [words[i : i + 1500] for i in range(0, len(words), 1500)])
    return parse_config({
        "seed": 3, "seq_len": 128, "global_batch_size": 4,
        "packing": {"mode": "bfd", "buffer": 16}, "shuffle": {"window": 8},
        "read": {"block_bytes": 20_000, "first_block_bytes": 5_000},
        "streams": {"code": {"paths": [str(code / "*.jsonl")], "weight": 0.7},
                    "prose": {"paths": [str(prose / "*.jsonl")], "weight": 0.3}},
        "mixing": {"policy": {"every": 3, "delay": 2, "eta": 0.2,
                              "bounds": {"prose": [0.1, 0.45]}, **policy}},
    })  # fmt: skip


def test_the_policy_is_part_of_the_config_hash_only_when_on(tmp_path):
    cfg = _config(tmp_path)
    off = cfg.model_copy(update={"mixing": cfg.mixing.model_copy(update={"policy": None})})
    longer = _config(tmp_path, wait_s=5)
    assert cfg.config_hash() != off.config_hash() and cfg.config_hash() == longer.config_hash()
    data = cfg.model_dump(mode="json")
    for bad, match in (
        ({"mixing": {"policy": {"every": 3, "bounds": {"web": [0, 1]}}}}, "unknown stream"),
        ({"mixing": {"policy": {"every": 3, "bounds": {"code": [0.8, 1], "prose": [0.5, 1]}}}},
         "sum to"),
        ({"mixing": {"policy": {"every": 3, "bounds": {"code": [0.5, 0.2]}}}}, "lo <= hi"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_config({**data, **bad})


def test_an_export_refuses_the_policy(tmp_path):
    from service.export import run_export

    with pytest.raises(ValueError, match="no trainer"):
        run_export(_config(tmp_path), tmp_path / "out", steps=2)


def _loss(step: int) -> dict[str, list[float]]:
    """The synthetic loss a rank reports: prose stays harder than code."""
    return {"code": [2.0 * 100, 100], "prose": [(3.0 + step / 100) * 50, 50]}


def _serve(srv, first: int, last: int, report=True) -> list[bytes]:
    """One rank takes steps first..last-1 and reports each one's loss; their bytes."""
    out = []
    for step in range(first, last):
        out.append(b"".join(take(srv, 0, 1, step).runs))
        if report:
            srv.report_loss(0, 1, step, _loss(step))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_service_follows_the_loss_and_resumes_mid_way_byte_for_byte(tmp_path, ray_cluster, lanes):
    """With lanes too: every lane takes each decision's weights at its step (the lanes are
    asked for no step past a decision before it is made)."""
    from service.batch_server import BatchServer

    cfg = _config(tmp_path, wait_s=20)  # a resume missing its window's loss fails in 20 s
    spec = cfg.model_dump(mode="json") | {"lanes": lanes}
    srv = BatchServer(spec, prefetch=2)
    try:
        whole = _serve(srv, 0, 18)
        in_window = srv.state(7)  # decisions at 8 and 11 read steps 3-5 and 6-8
        at_decision = srv.state(11)  # kept after its decision: carries it
        history = srv.mixture()["history"]
        metrics = srv.metrics()
    finally:
        srv.close()
    policy = [c for c in history if c["source"] == "policy"]
    assert [c["step"] for c in policy][:4] == [5, 8, 11, 14]
    prose = [c["weights"]["prose"] for c in policy]
    assert 0.3 < prose[0] < prose[1] < prose[2], "toward the stream whose loss stays high"
    assert prose[-1] == pytest.approx(0.45), "up to its bound, not past it"
    assert metrics["policy"]["decisions"][0]["window"] == [0, 3]
    assert metrics["policy"]["decisions"][0]["loss"]["prose"] == pytest.approx(3.01)
    assert sorted(int(s) for s in in_window[LOSSES]) == [3, 4, 5, 6]

    for state, first in ((in_window, 7), (at_decision, 11)):
        again = BatchServer(spec, state=state, prefetch=2)
        try:
            resumed = _serve(again, first, 18)
            hist = again.mixture()["history"]
        finally:
            again.close()
        assert resumed == whole[first:], f"resumed at {first}: byte for byte"
        assert [c for c in hist if c["source"] == "policy"][-1] == policy[-1]


@pytest.mark.slow
def test_a_trainer_that_never_reports_is_told_not_waited_for(tmp_path, ray_cluster):
    from service.batch_server import BatchServer

    srv = BatchServer(_config(tmp_path, wait_s=3).model_dump(mode="json"), prefetch=8)
    try:
        _serve(srv, 0, 5, report=False)  # decision 1 (step 5) reads steps 0-2: never reported
        reply = srv.get(0, 1, 5, 1.0)
        assert not reply.ready and "loss of steps 0-2" in reply.reason
        assert srv.metrics()["producer"] == "waiting_for_loss"
        deadline = time.time() + patient(30)
        with pytest.raises(RuntimeError, match=r"loss of steps 0-2 is not complete after 3 s"):
            while time.time() < deadline:
                srv.get(0, 1, 5, 1.0)
    finally:
        srv.close()


@pytest.mark.slow
def test_the_api_state_of_a_step_not_trained_yet_is_a_503_not_a_hang(tmp_path, ray_cluster):
    from fastapi.testclient import TestClient

    from service.api import Backend, create_app
    from service.batch_server import BatchServer

    srv = BatchServer(_config(tmp_path).model_dump(mode="json"), prefetch=8)
    try:
        _serve(srv, 0, 3)  # steps 0-2 trained and reported
        _serve(srv, 3, 5, report=False)  # 3-4 taken, not reported yet
        client = TestClient(create_app(Backend(srv)))
        r = client.get("/v1/state", params={"step": 4})  # decision 8 reads steps 3-5
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert "loss of steps 3-3" in r.json()["detail"]
        srv.report_loss(0, 1, 3, _loss(3))
        r = client.get("/v1/state", params={"step": 4})
        assert r.status_code == 200 and sorted(r.json()[LOSSES]) == ["0", "1", "2", "3"]
        state4 = r.json()
        # No step given: the newest state whose loss is all in (steps 0-3), not the newest made.
        assert srv.status()["global_step"] > 5
        assert client.get("/v1/state").json()["step"] == 4
        # The rank rewinds to step 4 (a seek): the decisions listed are the new sequence's.
        srv.report_loss(0, 1, 4, _loss(4))
        _serve(srv, 5, 12)
        srv.hello(0, 1, state=state4)
        _serve(srv, 4, 12)
        steps = [d["step"] for d in srv.metrics()["policy"]["decisions"]]
        assert steps == sorted(set(steps)) and steps[:3] == [5, 8, 11], steps
    finally:
        srv.close()


def test_a_decision_before_a_scheduled_change_goes_before_it():
    """A config `schedule:` entry ahead, and the policy (or the API) changes the weights
    before it: the change is inserted in step order and the schedule still takes over."""
    from pipeline.stages.mixing import DeficitMixer

    m = DeficitMixer(["code", "prose"], BASE)
    m.schedule(1000, {"code": 0.5, "prose": 0.5}, "schedule")
    m.begin_step(140)
    m.schedule(140, {"code": 0.4, "prose": 0.6}, "policy")
    assert [c.step for c in m.history] == [0, 140, 1000]
    assert m.scheduled_weights(140).tolist() == pytest.approx([0.4, 0.6])
    assert m.scheduled_weights(1000).tolist() == pytest.approx([0.5, 0.5])


def test_carried_losses_are_checked_and_a_rewind_forgets_later_reports():
    from pipeline.stages.policy import check_losses, needed_steps
    from service.losses import StreamLosses

    names = ["code", "prose"]
    assert check_losses({"3": {"code": [6.0, 3]}}, names) == {3: {"code": [6.0, 3.0]}}
    for bad in ([], {"x": {}}, {"-1": {}}, {"3": {"web": [1, 1]}}, {"3": {"code": [True, 1]}},
                {"3": {"code": [10**400, 1]}}, {"3": {"code": [1.0, -1]}}, {"3": {"code": [1]}},
                {"9" * 30: {}}):  # fmt: skip
        with pytest.raises(ValueError):
            check_losses(bad, names)
    assert needed_steps(7, 3, 2) == {3, 4, 5, 6} and needed_steps(0, 3, 2) == set()
    agg = StreamLosses(names)
    for step in range(6):
        agg.add(0, 1, step, {"code": [float(step), 1]})
    agg.carry({0: {"code": [100.0, 1]}}, start=4)  # a rewind to step 4
    assert agg.mean(0, 1) == {"code": 100.0, "prose": None}, "carried wins"
    assert agg.mean(3, 4) == {"code": 3.0, "prose": None} and agg.mean(4, 5) is None
    agg.add(0, 1, 4, {"code": [40.0, 1]})  # reported again after the rewind: counted
    assert agg.mean(4, 5) == {"code": 40.0, "prose": None}


@pytest.mark.slow
def test_the_policy_turned_on_at_a_resume_and_a_state_missing_its_loss(tmp_path, ray_cluster):
    """A state of a run without the policy: the steps before it count as reported with no
    signal, so the first decision keeps the weights. A policy state whose carried loss is
    incomplete is refused by name."""
    from pipeline.state.resume import StateError, seal
    from service.batch_server import BatchServer

    cfg = _config(tmp_path)
    plain = cfg.model_copy(update={"mixing": cfg.mixing.model_copy(update={"policy": None})})
    srv = BatchServer(plain.model_dump(mode="json"), prefetch=2)
    try:
        _serve(srv, 0, 4, report=False)
        state = srv.state(4)
    finally:
        srv.close()
    assert LOSSES not in state
    spec = cfg.model_dump(mode="json")
    on = BatchServer(spec, state=state, prefetch=2, allow_config_change=True)
    try:
        _serve(on, 4, 10)
        first = next(c for c in on.mixture()["history"] if c["source"] == "policy")
        with_loss = on.state(7)
    finally:
        on.close()
    assert first["step"] == 5 and first["weights"] == pytest.approx(BASE), "no signal: kept"
    broken = {k: v for k, v in with_loss.items() if k != "digest"}
    broken[LOSSES] = {k: v for k, v in broken[LOSSES].items() if k != "3"}
    with pytest.raises(StateError, match="next decisions read steps 3-6"):
        BatchServer(spec, state=seal(broken), prefetch=2)


@pytest.mark.slow
def test_four_ranks_and_api_calls_at_once_get_the_lone_ranks_rows(tmp_path, ray_cluster):
    """World 4 (a thread per rank, each reporting the loss of its own rows) while the API
    reads metrics, mixtures and states: the rows equal a lone rank's, decision for decision
    (they follow the reported loss, never who reported first)."""
    import threading

    from service.batch_server import BatchServer
    from wire.arrays import from_ipc
    from wire.layout import expand
    from wire.protocol import ServiceBusy

    spec = _config(tmp_path, wait_s=patient(60)).model_dump(mode="json")
    steps = 16

    def rows(reply) -> list[dict]:
        return expand(from_ipc(reply.runs[0])).to_pylist()

    lone = BatchServer(spec, prefetch=2)
    try:
        want = [expand(from_ipc(b)).to_pylist() for b in _serve(lone, 0, steps)]
        want_history = lone.mixture()["history"]
    finally:
        lone.close()

    srv = BatchServer(spec, prefetch=2)
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    done = threading.Event()

    def rank(r: int) -> None:
        try:
            srv.hello(r, 4)
            for step in range(steps):
                got[(r, step)] = rows(take(srv, r, 4, step))
                quarter = {k: [v[0] / 4, v[1] / 4] for k, v in _loss(step).items()}
                srv.report_loss(r, 4, step, quarter)
        except BaseException as e:  # raised below, in the test's thread
            errors.append(e)

    def api() -> None:
        while not done.is_set():
            srv.metrics(), srv.mixture(), srv.status()
            with contextlib.suppress(ServiceBusy):  # a state whose loss is not in yet
                srv.state(None, 0.05)
            time.sleep(0.01)

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        watcher = threading.Thread(target=api)
        for t in (*threads, watcher):
            t.start()
        for t in threads:
            t.join(timeout=patient(300))
        done.set()
        watcher.join(timeout=30)
        assert not errors, errors
        history = srv.mixture()["history"]
    finally:
        srv.close()
    for step in range(steps):
        assert [row for r in range(4) for row in got[(r, step)]] == want[step], step

    # The decisions behind the steps the ranks took. The producer runs `prefetch` steps past
    # them and may decide there too (step 17 of 16 taken), or not yet, as its thread goes.
    def decided(h):
        return [c for c in h if c["source"] == "policy" and c["step"] < steps]

    assert decided(history) == decided(want_history) and decided(history)


@pytest.mark.slow
def test_a_trainer_without_a_state_takes_over_mid_window(tmp_path, ray_cluster):
    """A run stops in the middle of a window (steps taken, their loss never reported); a new
    trainer connects without a state and takes over where the service is: it is counted as
    having reported nothing before its first step, so the policy decides on instead of
    waiting for reports that never come."""
    from service.batch_server import BatchServer

    srv = BatchServer(_config(tmp_path, wait_s=5).model_dump(mode="json"), prefetch=3)
    try:
        _serve(srv, 0, 4)  # reported: 0-3
        _serve(srv, 4, 7, report=False)  # taken, never reported: the run stopped
        first = srv.hello(0, 1).step  # a new trainer, no state
        assert first == 7
        _serve(srv, first, 16)  # decisions at 8 (steps 3-5) and 11 (6-8) would wait for ever
        decided = srv.metrics()["policy"]["decisions"]
    finally:
        srv.close()
    assert [d["step"] for d in decided][:4] == [5, 8, 11, 14]
    assert decided[1]["loss"]["prose"] == pytest.approx(3.03), "step 3 only: 4-5 had no report"
