"""The control API (SPEC §3.3) over a real batch server, through FastAPI's TestClient."""

import time

import pytest
from fastapi.testclient import TestClient

from pipeline.config import parse_config
from service.api import Backend, create_app
from service.server import BatchServer, StepGone
from tests.conftest import stdlib_texts, write_jsonl

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


@pytest.fixture
def server(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(12, max_bytes=3000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(12, start=20, max_bytes=3000))
    cfg = parse_config({"seq_len": 128, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"web": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.6},
                                    "code": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.4}}})  # fmt: skip
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    deadline = time.time() + 60
    while srv.status()["global_step"] < 3 and time.time() < deadline:
        time.sleep(0.2)
    yield srv
    srv._generation += 1  # stop the producer thread


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_TOKEN", TOKEN)
    return TestClient(create_app(Backend(server)))


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_read_routes(client):
    assert client.get("/healthz").json() == {"ok": True}
    st = client.get("/v1/status").json()
    assert st["state"] in ("running", "paused") and st["streams"] == ["web", "code"]
    m = client.get("/v1/metrics").json()
    assert set(m["streams"]) == {"web", "code"} and 0 < m["packing_efficiency"] <= 1
    assert m["tokenizer_backend"]["tiktoken"] > 0  # which tokenizer ran is reported
    text = client.get("/metrics").text
    assert (
        "tokenmill_tokens_per_second" in text
        and 'tokenmill_stream_realized_share{stream="web"}' in text
        and 'tokenmill_tokenizer_backend_tokens{backend="tiktoken"}' in text
    )
    mix = client.get("/v1/mixture").json()
    assert mix["weights"] == pytest.approx({"web": 0.6, "code": 0.4})
    page = client.get("/").text
    assert "<canvas" in page and "http://" not in page and "https://" not in page  # air-gapped


def test_mutations_need_the_token(client, monkeypatch):
    body = {"weights": {"web": 1, "code": 1}}
    assert client.put("/v1/mixture", json=body).status_code == 401
    assert (
        client.put("/v1/mixture", json=body, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert client.put("/v1/mixture", json=body, headers={"Authorization": TOKEN}).status_code == 401
    assert client.post("/v1/pause").status_code == 401
    monkeypatch.delenv("TOKENMILL_API_TOKEN")
    r = client.put("/v1/mixture", json=body, headers=AUTH)
    assert r.status_code == 403 and "TOKENMILL_API_TOKEN" in r.json()["detail"]


def test_token_from_file(client, monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_API_TOKEN")
    (tmp_path / "tok").write_text("filetoken\n")
    monkeypatch.setenv("TOKENMILL_API_TOKEN_FILE", str(tmp_path / "tok"))
    r = client.post("/v1/pause", headers={"Authorization": "Bearer filetoken"})
    assert r.status_code == 200 and r.json() == {"state": "paused"}


def test_put_mixture_takes_effect_at_the_stated_step(client, server):
    r = client.put("/v1/mixture", json={"weights": {"web": 0, "code": 1}}, headers=AUTH)
    assert r.status_code == 200
    step = r.json()["effective_step"]
    assert step >= 3
    hist = client.get("/v1/mixture").json()["history"]
    assert hist[-1] == {"step": step, "weights": {"web": 0.0, "code": 1.0}, "source": "api"}
    # the steps from `step` on carry only the code stream
    deadline = time.time() + 60
    while server.status()["global_step"] <= step and time.time() < deadline:
        server.get(0, 1, server.status()["global_step"] - 1)  # keep the producer moving
        time.sleep(0.1)
    import ray

    batch = ray.get(server.get(0, 1, step)[0])
    assert set(s for row in batch.column("stream").to_pylist() for s in row) == {"code"}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"weights": {"nope": 1}}', "unknown stream 'nope'"),
        ('{"weights": {"web": -1}}', "finite and >= 0"),
        ('{"weights": {"web": 0, "code": 0}}', "not all be zero"),
        ('{"weights": {"web": NaN}}', "finite"),
        ('{"weights": {"web": Infinity}}', "finite"),
        ('{"weights": {"web": "0.5"}}', "weights.web"),
        ('{"weights": {"web": true}}', "weights.web"),
        ('{"weights": [1, 2]}', "weights"),
        ('{"weight": {"web": 1}}', "weights"),
        ("{not json", "JSON"),
        ("", "body"),
    ],
)
def test_invalid_mixture_is_a_4xx_with_a_message(client, content, fragment):
    r = client.put(
        "/v1/mixture", content=content, headers=AUTH | {"Content-Type": "application/json"}
    )
    assert 400 <= r.status_code < 500, r.text
    assert fragment.lower() in r.text.lower()


def test_state_route(client):
    s = client.get("/v1/state", params={"step": 1}).json()
    assert s["step"] == 1 and s["version"] == 1
    assert client.get("/v1/state", params={"step": 10**9}).status_code == 404
    assert client.get("/v1/state", params={"step": -1}).status_code == 422
    assert client.get("/v1/state", params={"step": "abc"}).status_code == 422


def test_pause_and_resume(client, server):
    assert client.post("/v1/pause", headers=AUTH).json() == {"state": "paused"}
    time.sleep(1.5)
    assert client.get("/v1/status").json()["state"] == "paused"
    assert client.post("/v1/resume", headers=AUTH).json() == {"state": "running"}


def test_far_behind_rank_gets_a_clear_error(server):
    # consume far ahead with rank 0 so that early steps are evicted
    for s in range(0, 12):
        if server.get(0, 1, s, timeout_s=60) is None:
            break
    with pytest.raises(StepGone, match="no longer held"):
        server.get(0, 1, 0)
