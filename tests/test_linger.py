"""How many steps a rank gets per call (BatchServer.get): a rank that finds its steps ready is
answered at once; a rank that had to wait for the producer lingers for up to `count` steps."""

import threading
import time

import pytest

import service.ranks
from pipeline.read.resolve import parse_config
from service.batch_server import BatchServer
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient

pytestmark = pytest.mark.slow
PREFETCH = 3


@pytest.fixture
def server(ray_cluster, tmp_path, monkeypatch):
    # Long enough that a lingering answer could never pass for a prompt one on a slow machine.
    monkeypatch.setattr(service.ranks, "LINGER_S", 30.0)
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(40, max_bytes=3000))
    cfg = parse_config({"seq_len": 128, "global_batch_size": 2,
                        "streams": {"web": {"paths": [str(tmp_path / "a.jsonl")]}}})  # fmt: skip
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=PREFETCH)
    make = srv.feed.next_step  # a slow producer: a step every 0.2 s, so lingering shows

    def slow_step():
        time.sleep(0.2)
        return make()

    srv.feed.next_step = slow_step
    yield srv
    srv.close()


def _produced(srv, n: int) -> None:
    deadline = time.time() + patient(60)
    while srv.status()["global_step"] < n:
        assert time.time() < deadline, "the producer made too few steps"
        time.sleep(0.05)


def _get(srv, step: int, count: int) -> tuple[int, float]:
    """(steps in the answer, seconds it took) for rank 0 of 1."""
    t = time.monotonic()
    reply = srv.get(0, 1, step, 20.0, count)
    assert reply.ready, reply
    return reply.steps, time.monotonic() - t


def test_a_rank_that_finds_steps_ready_gets_them_at_once(server):
    _produced(server, PREFETCH)  # the window is full: the rank is the one holding it back
    n, took = _get(server, 0, 8)
    assert n == PREFETCH and took < 5  # never more than the window; no lingering
    _produced(server, 4)
    n, took = _get(server, PREFETCH, 8)
    assert n >= 1 and took < 5


def test_a_hungry_rank_lingers_for_count_steps_then_not_once_fed(server):
    _produced(server, PREFETCH)
    server.pause()  # the window is full, so nothing is being made: the next steps wait
    assert _get(server, 0, PREFETCH)[0] == PREFETCH
    got: list = []
    asking = threading.Thread(target=lambda: got.append(_get(server, PREFETCH, PREFETCH)))
    asking.start()
    time.sleep(0.5)
    server.resume()
    asking.join(60)
    assert got and got[0][0] == PREFETCH, "one answer with every step it asked for"
    # Still hungry: it finds step 6 made, but not 7 and 8, and lingers for them.
    _produced(server, 2 * PREFETCH + 1)
    n, _ = _get(server, 2 * PREFETCH, PREFETCH)
    assert n == PREFETCH
    # Fed: the window is full again when it asks, so it gets what is there at once.
    _produced(server, 3 * PREFETCH + PREFETCH)
    n, took = _get(server, 3 * PREFETCH, 8)
    assert n == PREFETCH and took < 5
