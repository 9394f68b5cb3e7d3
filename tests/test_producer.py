"""The Ray-free producer and telemetry: a real StepFeed (in-process reads) into a StepWindow."""

import threading
import time

import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import Reject
from service.producer import Producer
from service.telemetry import Telemetry
from service.window import StepWindow
from tests.conftest import stdlib_texts, write_jsonl
from wire.protocol import FAILED, FINISHED, PAUSED


def until(cond, timeout_s=60.0):
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def parts(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(6, max_bytes=2000))
    cfg = parse_config({"seq_len": 64, "global_batch_size": 2, "shuffle": {"window": 2},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    window, cond = StepWindow(0, 3, None), threading.Condition()
    producer = Producer(feed, window, cond)
    yield producer, window, cond
    producer.stop()


def test_fills_the_window_waits_for_room_and_keeps_states(parts):
    producer, window, cond = parts
    producer.start()
    until(lambda: window.produced == 3)
    time.sleep(0.3)
    assert window.produced == 3, "no room: the producer waits"
    assert sorted(producer.states) == [0, 1, 2, 3]
    with cond:
        assert window.take(0, 1, 0) is not None
        cond.notify_all()
    until(lambda: window.produced == 4)
    assert producer.states[4].unpack()["step"] == 4


def test_pause_stops_production(parts):
    producer, window, cond = parts
    producer.set_paused(True)
    producer.start()
    time.sleep(0.5)
    assert window.produced == 0 and producer.state == PAUSED
    producer.set_paused(False)
    until(lambda: window.produced == 3)


def test_the_end_of_the_data_finishes(parts):
    producer, window, cond = parts
    producer.start()
    step = 0
    while producer.state != FINISHED or step < window.produced:
        with cond:
            if window.take(0, 1, step) is not None:
                step += 1
                cond.notify_all()
        time.sleep(0.01)
    assert step == window.produced > 3
    # The step after the last one was begun (and found no data): weights changed now take
    # effect after it, never at a step before one already handed out.
    assert producer.first_open == window.produced + 1


def test_an_error_in_the_feed_is_kept_for_the_consumers(parts):
    producer, window, cond = parts

    def boom():
        raise OSError("disk gone")

    producer.feed.next_step = boom
    producer.start()
    until(lambda: producer.state == FAILED)
    assert producer.error == "OSError: disk gone" and producer.ended


def test_telemetry_rates_waits_and_bounded_rejects():
    now = [100.0]
    t = Telemetry(max_rejects=3, clock=lambda: now[0])
    for k in range(5):
        t.sample(tokens=1000 * k, rows=10 * k, shares={"a": 1.0}, targets={"a": 1.0})
        now[0] += 0.5  # one sample a second at most: 100, 101, 102
    assert [h["t"] for h in t.history_view()] == [100.0, 101.0, 102.0]
    assert t.rates() == (2000.0, 20.0)  # samples k = 0, 2, 4
    t.report_wait(0, 0.25)
    t.report_wait(0, 0.5)
    t.report_wait(1, 2.0)
    now[0] += 61
    t.report_wait(1, 1.0)
    assert t.wait_by_rank() == {1: (1.0, 1)}
    for k in range(5):
        t.add_reject(Reject("a", "f.jsonl", k, "bad"))
    assert t.rejects_total == 5 and t.rejects_unlisted == 2
    assert [r["record"] for r in t.drain_rejects()] == [2, 3, 4] and not t.drain_rejects()
