"""Hostile clients of the control plane and of the batch server (SPEC M9, M13): every bad
request gets a 4xx that says what is wrong, no request wedges the service, and one client's
bad resume state never touches the sequence the other ranks are pulling."""

import threading
import time

import pytest

from pipeline.state.resume import StateError
from tests import test_api
from tests.rayhead import patient
from tests.test_api import AUTH, take
from wire.arrays import from_ipc

server, client = test_api.server, test_api.client  # the same real-server fixtures

pytestmark = pytest.mark.slow


def test_a_400_digit_integer_weight_is_a_400(client):
    r = client.put("/v1/mixture", json={"weights": {"web": 10**400, "code": 1}}, headers=AUTH)
    assert r.status_code == 400 and "'web' is too large" in r.json()["detail"]


def test_weights_whose_sum_overflows_are_normalized_safely(client):
    r = client.put("/v1/mixture", json={"weights": {"web": 1e308, "code": 1e308}}, headers=AUTH)
    assert r.status_code == 200, r.text
    step = r.json()["effective_step"]
    change = client.get("/v1/mixture").json()["history"][-1]
    assert change["step"] == step and change["weights"] == {"web": 1e308, "code": 1e308}
    assert client.get("/v1/status").json()["state"] in ("running", "paused")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}])
def test_an_unauthenticated_body_is_refused_before_it_is_read(client, headers):
    body = b'{"weights": {"web": 1, "code": 1}, "pad": "' + b"x" * (8 << 20) + b'"}'
    t = time.time()
    r = client.put(
        "/v1/mixture", content=body, headers=headers | {"content-type": "application/json"}
    )
    assert r.status_code == 401 and time.time() - t < 5


def test_an_oversized_body_is_413_even_with_the_token(client):
    body = b'{"weights": {"web": 1, "code": 1}, "pad": "' + b"x" * (1 << 20) + b'"}'
    r = client.put("/v1/mixture", content=body, headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 413 and "over" in r.json()["detail"]


def test_concurrent_weight_changes_while_ranks_pull_are_all_accepted(client, server):
    stop, errors, answers = threading.Event(), [], []

    def rank():
        step = 0
        while not stop.is_set() and take(server, 0, 1, step, 30) is not None:
            step += 1

    def putter(k):
        for i in range(15):
            w = {"web": 1 + (k + i) % 5, "code": 1 + i % 3}
            r = client.put("/v1/mixture", json={"weights": w}, headers=AUTH)
            (answers if r.status_code == 200 else errors).append((r.status_code, r.text))

    puller = threading.Thread(target=rank)
    puller.start()
    threads = [threading.Thread(target=putter, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    puller.join(timeout=patient(60))
    assert not errors and len(answers) == 120
    step = server.window.ranks[0].next  # where the puller stopped
    while take(server, 0, 1, step, 30) is not None:  # to the end of the data
        step += 1
    for _ in range(3):  # after the end, too (the step begun past it counts as begun)
        r = client.put("/v1/mixture", json={"weights": {"web": 1, "code": 2}}, headers=AUTH)
        assert r.status_code == 200, r.text
    steps = [c["step"] for c in client.get("/v1/mixture").json()["history"]]
    assert steps == sorted(steps), "the schedule never goes backwards"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: {"step": 1},  # no streams, no mixer
        lambda s: s | {"config_hash": "0" * 16},
        lambda s: s | {"streams": {}},
        lambda s: s | {"version": 99},
        lambda s: s | {"step": "two"},
    ],
)
def test_a_bad_resume_state_is_refused_and_the_running_sequence_goes_on(server, mutate):
    first = from_ipc(take(server, 0, 1, 0)[0])  # the runs of the steps fetched: one here
    good = server.state(1)
    with pytest.raises(StateError):
        server.seek(mutate(dict(good)))
    assert server.status()["state"] in ("running", "paused") and server.status()["error"] is None
    assert take(server, 0, 1, 1) is not None, "the rank that was pulling carries on"
    assert first.num_rows == 4
