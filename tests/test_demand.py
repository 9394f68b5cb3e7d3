"""`service.autoscale`: the service asks the cluster for CPUs while the ranks wait for data
and withdraws the request when it is ahead (service/demand.py), on a real local Ray."""

from __future__ import annotations

import time

import pytest

from service.demand import WINDOW_S, Demand, producer_shares
from tests.rayhead import patient


def test_producer_shares_weigh_each_state_by_how_long_it_lasted():
    now = 1000.0
    obs = [(now - 100, "making"), (now - 30, "window_full"), (now - 15, "making")]
    shares = producer_shares(obs, now)  # the window is the last 60 s: 30 making, 15 + 15
    assert shares == pytest.approx({"making": 0.75, "window_full": 0.25})
    assert producer_shares([], now) == {}
    assert producer_shares([(now - 10, "starting")], now) == {}, "10 s is no minute to judge"
    # `service.autoscale.window_s`: a shorter window, judged once half of it is seen.
    shares = producer_shares(obs, now, window_s=20)  # 5 window_full, 15 making
    assert shares == pytest.approx({"making": 0.75, "window_full": 0.25})
    assert producer_shares([(now - 10, "starting")], now, window_s=20) == {"starting": 1.0}
    assert producer_shares([(now - 9, "starting")], now, window_s=20) == {}


def test_it_asks_while_ranks_wait_and_steps_down_when_the_service_is_ahead():
    d = Demand(max_cpus=10, up_wait=0.05, cooldown_s=60)
    making, full = {"making": 1.0}, {"window_full": 0.95, "making": 0.05}
    assert d.decide(0, {0: 0.5}, making, 4) is None, "0.8% waited: no change"
    assert d.decide(0, {0: 1.0, 1: 12.0}, full, 4) is None, "waiting, but the service is ahead"
    assert d.decide(0, {1: 12.0}, {"paused": 1.0}, 4) is None, "paused: CPUs would not help"
    assert d.decide(0, {1: 12.0}, {"starting": 1.0}, 4) is None, "starting: not yet"
    want, reason = d.decide(0, {0: 1.0, 1: 12.0}, making, 4)
    assert want == 5 and "20%" in reason and "asking for 5 CPUs" in reason
    d.changed(0, want, reason, None, 4)
    assert d.decide(30, {1: 12.0}, making, 4) is None, "cooldown"
    assert d.decide(61, {1: 12.0}, making, 4) is None, "the nodes asked for are not up yet"
    assert d.decide(61, {1: 12.0}, making, 5)[0] == 7  # a quarter more (rounded up)
    d.changed(61, 7, "r", None, 5)
    d.changed(122, 10, "r", None, 7)
    assert d.decide(200, {1: 12.0}, making, 10) is None, "at max_cpus"
    assert d.decide(250, {1: 0.5}, full, 10) is None, "a step down waits 3 cooldowns"
    steps = []
    for t in (310, 500, 700):
        cpus, why = d.decide(t, {1: 0.5}, full, d.requested)
        d.changed(t, cpus, why, None, d.requested)
        steps.append(cpus)
    assert steps == [8, 6, 0], "a fifth less each time, withdrawn at what it had before"
    assert "withdrawing the request (was 6)" in d.view()["changes"][-1]["reason"]
    d.changed(900, 5, "r", "RuntimeError: no coordinator")  # a failed call changes nothing
    assert d.requested == 0 and d.view()["changes"][-1]["error"].startswith("RuntimeError")
    assert WINDOW_S == 60


@pytest.mark.slow
def test_a_service_whose_rank_waits_asks_the_cluster_for_cpus(tmp_path, ray_cluster):
    """A real batch server on the session's Ray: a rank that reports waiting for data while
    the producer makes steps; once its states cover half the window (`window_s`: 8 s, not the
    default minute, which the test would spend tokenizing), the service asks for CPUs
    (through Ray Data's autoscaling coordinator, no error), says why in its status and
    Prometheus, and withdraws the request when it closes."""
    from pipeline.read.resolve import parse_config
    from service.api import prometheus_text
    from service.batch_server import BatchServer
    from tests.conftest import stdlib_texts, write_jsonl

    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(40, max_bytes=20_000))
    # HF's tokenizer and long rows: the producer is behind a rank that takes steps at once.
    cfg = parse_config({"seq_len": 8192, "global_batch_size": 4, "tokenizer": {"backend": "hf"},
                        "read": {"block_bytes": 20_000, "first_block_bytes": 5_000},
                        "streams": {"code": {"paths": [str(tmp_path / "a.jsonl")],
                                             "repeat": 1000}},
                        "service": {"autoscale": {"max_cpus": 64, "cooldown_s": 0,
                                                  "window_s": 8}}})  # fmt: skip
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=2)
    try:
        srv.hello(0, 1)
        deadline, step = time.time() + patient(120), 0
        while time.time() < deadline and not srv.status()["autoscale"]["changes"]:
            if srv.get(0, 1, step, 1.0).ready:
                step += 1
            srv.report_wait(0, 1.0)  # waited 1 s for data: 12% of the window per report
        scale = srv.status()["autoscale"]
        change = scale["changes"][0]
        assert change["error"] is None, change
        assert scale["requested_cpus"] == change["requested_cpus"] > 0
        assert "ranks waited" in change["reason"] and "of the last 8 s" in change["reason"]
        text = prometheus_text(srv.metrics(), srv.status())
        assert f"tokenmill_autoscale_requested_cpus {float(change['requested_cpus'])}" in text
    finally:
        srv.close()
    assert srv.demand.requested == 0 and srv.demand.changes[-1]["reason"] == "the service closed"


def test_the_autoscale_thread_asks_renews_and_withdraws_its_request():
    """The loop around `Demand` (service/autoscale.py), with the cluster's answers given: a
    rank that waits while the producer makes steps gets a request placed, renewed every
    tick, and withdrawn when the thread closes; a tick on which the cluster does not answer
    decides nothing."""
    from service.autoscale import Autoscaler

    placed: list[int] = []
    answers = iter([RuntimeError("the GCS is restarting")] * 3)

    def cluster():
        for e in answers:  # the first ticks: no answer
            raise e
        return 1, 4.0

    now = time.time()
    making = [(now - 60 + i, "making") for i in range(60)]
    d = Demand(max_cpus=16, up_wait=0.05, cooldown_s=0)
    scaler = Autoscaler(d, waits=lambda: {0: 30.0}, observed=lambda: making,
                        place=lambda: placed.append, cluster=cluster, tick_s=0.01)  # fmt: skip
    try:
        deadline = time.time() + patient(30)
        while time.time() < deadline and placed.count(5) < 3:
            time.sleep(0.01)
    finally:
        scaler.close()
    assert d.cluster == {"nodes": 1, "cpus": 4.0}
    assert placed[0] == 5 and placed.count(5) >= 3, placed  # 4 CPUs and a quarter more, renewed
    assert placed[-1] == 0 and d.requested == 0
    reasons = [c["reason"] for c in d.view()["changes"]]
    assert "ranks waited" in reasons[0] and reasons[-1] == "the service closed"
